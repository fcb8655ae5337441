"""Performance metrics (numpy float64) with empyrical-reloaded's conventions.

Return metrics take simple per-period returns ``r`` and an explicit ``periods_per_year`` (``P``):

* ``total_return = ∏(1 + r) − 1``
* ``annual_return = (∏(1 + r))^(1 / (n / P)) − 1`` (geometric)
* ``annual_volatility = std(r, ddof=1) · √P``
* ``sharpe = mean(r) / std(r, ddof=1) · √P`` (risk-free 0; NaN for n < 2; a constant series has
  zero dispersion: ±inf, or NaN when all returns are 0)
* ``sortino = mean(r) · P / (√mean(min(r, 0)²) · √P)`` (required return 0)
* ``max_drawdown = min_j (V_j − max_{i≤j} V_i) / max_{i≤j} V_i`` with ``V = 100·∏(1 + r)`` and
  ``V_0 = 100`` (≤ 0)
* ``calmar = annual_return / |max_drawdown|`` (NaN when there is no drawdown)
* ``sharpe_se``: the standard error of ``sharpe`` for independent but not necessarily normal
  returns (Mertens 2002): with the per-period ``SR = mean/std``, skewness ``γ₃`` and
  (non-excess) kurtosis ``γ₄`` of ``r``, ``SE = √((1 − γ₃·SR + (γ₄ − 1)/4·SR²) / (n − 1)) · √P``
* ``psr``: the probabilistic Sharpe ratio against 0 (Bailey & López de Prado 2012),
  ``Φ(SR·√(n − 1) / √(1 − γ₃·SR + (γ₄ − 1)/4·SR²))``, the probability that the true Sharpe ratio
  is above 0 given the sample's length, skew and tails (NaN for n < 3 or zero dispersion).
  Both assume independent, identically distributed returns. Serial correlation (a strategy
  riding trending prices) or volatility clustering change the true uncertainty, usually
  upwards: read them as a floor on it.

Annualisation: ``periods_per_year = sessions_per_year × session_hours × 3600 / bar_seconds``
(or ``EvalConfig.periods_per_year`` when set), divided by the evaluation stride — the predecessor
annualised strided evaluations as if every bar were evaluated and over-reported Sharpe by √stride.
"""

from __future__ import annotations

import math
from typing import Any, Self

import numpy as np

from jdqn.config import EvalConfig
from jdqn.env.core import ACTION_LABELS, BRANCH_NAMES

RETURN_KEYS = ("total_return", "annual_return", "annual_volatility", "sharpe", "sharpe_se",
               "psr", "sortino", "calmar", "max_drawdown", "n_bars", "annualization_periods")


class PeriodsPerYear(float):
    """A periods-per-year figure that remembers the evaluation stride it is for (what
    :func:`periods_per_year` returns). :func:`compute_metrics` checks it against the backtest's
    own stride, so a strided backtest cannot be annualised as if every bar were evaluated. It is
    a ``float`` everywhere else."""

    __slots__ = ("stride",)

    def __new__(cls, value: float, stride: int) -> Self:
        if int(stride) < 1:
            raise ValueError(f"stride must be ≥ 1, got {stride}")
        obj = super().__new__(cls, value)
        obj.stride = int(stride)
        return obj

    def __repr__(self) -> str:
        return f"PeriodsPerYear({float(self)!r}, stride={self.stride})"

    def __reduce__(self) -> tuple:  # copy, deepcopy and pickle keep the stride
        return (PeriodsPerYear, (float(self), self.stride))


def periods_per_year(bar_seconds: float, eval_cfg: EvalConfig) -> PeriodsPerYear:
    """Evaluation periods per year for bars of ``bar_seconds``, corrected for ``eval_cfg.stride``:
    ``sessions_per_year × bars per session``, where a session holds
    ``session_hours · 3600 / bar_seconds`` bars but never fewer than one (a daily bar is one
    period per session, not 23/24 of one). The result carries the stride
    (:class:`PeriodsPerYear`)."""
    if eval_cfg.periods_per_year > 0:
        base = float(eval_cfg.periods_per_year)
    else:
        if bar_seconds <= 0:
            raise ValueError(f"bar_seconds must be > 0, got {bar_seconds}")
        per_session = max(1.0, eval_cfg.session_hours * 3600.0 / float(bar_seconds))
        base = eval_cfg.sessions_per_year * per_session
    return PeriodsPerYear(base / eval_cfg.stride, eval_cfg.stride)


def total_return(r: np.ndarray) -> float:
    return float(np.nanprod(r + 1.0) - 1.0) if len(r) else float("nan")


def annual_return(r: np.ndarray, ppy: float) -> float:
    if len(r) < 1:
        return float("nan")
    num_years = len(r) / ppy
    return float(np.nanprod(r + 1.0) ** (1.0 / num_years) - 1.0)


def _std(r: np.ndarray) -> float:
    std = float(np.nanstd(r, ddof=1))
    # Identical values: the true deviation is 0; the float mean can leave a ~1e-18 residue.
    return 0.0 if np.isfinite(std) and np.nanmax(r) == np.nanmin(r) else std


def annual_volatility(r: np.ndarray, ppy: float) -> float:
    return float(_std(r) * ppy ** 0.5) if len(r) >= 2 else float("nan")


def sharpe_ratio(r: np.ndarray, ppy: float) -> float:
    if len(r) < 2:
        return float("nan")
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.divide(np.nanmean(r), _std(r)) * np.sqrt(ppy))


def sharpe_uncertainty(r: np.ndarray, ppy: float) -> tuple[float, float]:
    """``(sharpe_se, psr)``: the annualised standard error of the Sharpe ratio and the
    probabilistic Sharpe ratio P[true SR > 0] (module docstring). NaN for fewer than 3 returns
    or returns without dispersion."""
    r = r[~np.isnan(r)]
    n = len(r)
    sd = _std(r) if n >= 3 else 0.0
    if not (sd > 0 and np.isfinite(sd)):
        return float("nan"), float("nan")
    dev = r - r.mean()
    m2 = float(np.mean(dev ** 2))
    skew = float(np.mean(dev ** 3)) / m2 ** 1.5
    kurt = float(np.mean(dev ** 4)) / m2 ** 2
    sr = float(r.mean()) / sd
    # ≥ (1 − γ₃·SR/2)² ≥ 0, since every distribution has γ₄ ≥ 1 + γ₃².
    var = 1.0 - skew * sr + 0.25 * (kurt - 1.0) * sr * sr
    if not var > 0:
        return float("nan"), float("nan")
    se = math.sqrt(var / (n - 1))
    return se * math.sqrt(ppy), 0.5 * math.erfc(-(sr / se) / math.sqrt(2.0))


def sortino_ratio(r: np.ndarray, ppy: float) -> float:
    if len(r) < 2:
        return float("nan")
    downside = np.sqrt(np.nanmean(np.square(np.clip(r, -np.inf, 0.0)))) * np.sqrt(ppy)
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.divide(np.nanmean(r) * ppy, downside))


def drawdown_series(r: np.ndarray) -> np.ndarray:
    """f64 [n]: drawdown (≤ 0) of the equity curve after each period."""
    v = np.empty(len(r) + 1)
    v[0] = 100.0
    v[1:] = 100.0 * np.cumprod(np.where(np.isnan(r), 0.0, r) + 1.0)
    peak = np.fmax.accumulate(v)
    return ((v - peak) / peak)[1:]


def max_drawdown(r: np.ndarray) -> float:
    return float(np.nanmin(drawdown_series(r))) if len(r) else float("nan")


def calmar_ratio(r: np.ndarray, ppy: float) -> float:
    mdd = max_drawdown(r)
    if not mdd < 0:
        return float("nan")
    out = annual_return(r, ppy) / abs(mdd)
    return float("nan") if np.isinf(out) else float(out)


def return_metrics(returns: Any, ppy: float) -> dict[str, float]:
    """The return-based metrics of :data:`RETURN_KEYS` for simple per-period returns."""
    r = np.asarray(returns, dtype=np.float64)
    se, psr = sharpe_uncertainty(r, ppy)
    return {
        "total_return": total_return(r), "annual_return": annual_return(r, ppy),
        "annual_volatility": annual_volatility(r, ppy), "sharpe": sharpe_ratio(r, ppy),
        "sharpe_se": se, "psr": psr,
        "sortino": sortino_ratio(r, ppy), "calmar": calmar_ratio(r, ppy),
        "max_drawdown": max_drawdown(r), "n_bars": len(r),
        "annualization_periods": float(ppy),
    }


def action_distribution(actions: np.ndarray) -> dict[str, dict[str, float]]:
    """Share of each action per branch over the decisions ``actions: int [n, 4]``."""
    a = np.asarray(actions)
    out = {}
    for b, (name, labels) in enumerate(zip(BRANCH_NAMES, ACTION_LABELS, strict=True)):
        counts = np.bincount(a[:, b], minlength=len(labels))[:len(labels)] if len(a) else \
            np.zeros(len(labels))
        total = max(int(counts.sum()), 1)
        out[name] = {lab: float(c) / total for lab, c in zip(labels, counts, strict=True)}
    return out


def compute_metrics(result: Any, periods_per_year: float) -> dict[str, Any]:
    """All metrics of a :class:`BacktestResult` (or return metrics only for a returns array).

    Trading metrics: ``n_trades`` closed trades (a flip closes one and opens another; every
    position is closed by the final forced liquidation), ``hit_rate`` share of closed trades
    with net PnL > 0, ``mean_holding_bars`` bars in a position per entry, ``exposure`` share of
    time in a position, ``turnover`` mean |Δposition| / max_position per bar (and per year),
    ``cost_share`` total costs / |gross PnL| (> 1: costs exceed the gross edge), dollar totals,
    mean sizing scale, the action distribution per branch, and ``wiped_out_bar``: the bar at
    which equity reached ≤ 0 (None if it never did; the decisions' shares and the sizing scale
    are over the bars up to it).

    For a backtest ``result``, ``periods_per_year`` must be for the stride it ran at: a
    :class:`PeriodsPerYear` of the same stride (as :func:`periods_per_year` returns it), or a
    plain number for a stride-1 backtest. Anything else raises ``ValueError``: a strided
    backtest annualised per bar over-reports Sharpe by √stride (the predecessor's bug).
    """
    if not hasattr(result, "returns"):
        return return_metrics(result, periods_per_year)
    res = result
    given = getattr(periods_per_year, "stride", None)
    if (given if given is not None else 1) != res.stride:
        raise ValueError(
            f"periods_per_year {float(periods_per_year):.6g} is for stride {given} but the "
            f"backtest ran at stride {res.stride}" if given is not None else
            f"the backtest ran at stride {res.stride}: pass periods_per_year(bar_seconds, "
            f"eval_cfg) of an EvalConfig with stride={res.stride}, or "
            f"PeriodsPerYear(value, stride={res.stride}) for a figure already divided by the "
            f"stride; a plain number cannot show that it was")
    out: dict[str, Any] = return_metrics(res.returns, periods_per_year)
    n = max(res.n_bars, 1)
    # A wiped-out account (equity ≤ 0) decided nothing after that bar: the decisions' shares
    # and the sizing scale are over the bars up to it (its records after it are flat).
    wiped = res.wiped_out_at
    live = res.n_bars if wiped is None else wiped + 1
    sign = np.sign(res.position)
    prev = np.r_[0.0, sign[:-1]]
    entries = int(((sign != 0) & (sign != prev)).sum())
    in_pos = int((sign != 0).sum())
    closed = res.closed_trade_pnl[res.trade_closed]
    gross = float(res.gross_pnl.sum())
    costs = float(res.total_costs.sum())
    # Per period of the backtest; a strided backtest's period spans `stride` original bars,
    # and holding times and turnover are reported per original bar.
    k = res.stride
    turnover = float(np.abs(res.fill_qty).sum() / res.max_position / n)
    out.update(
        n_trades=int(res.trade_closed.sum()),
        n_entries=entries,
        hit_rate=float((closed > 0).mean()) if len(closed) else float("nan"),
        mean_holding_bars=float(in_pos * k / entries) if entries else 0.0,
        exposure=float(in_pos / n),
        turnover=turnover / k,
        annual_turnover=turnover * periods_per_year,
        n_fills=int(res.filled.sum()),
        gross_pnl=gross, net_pnl=float(res.net_pnl.sum()), total_costs=costs,
        commission=float(res.commission.sum()), spread_cost=float(res.spread_cost.sum()),
        holding_cost=float(res.holding_cost.sum()),
        cost_share=float(costs / abs(gross)) if gross != 0 else float("nan"),
        mean_size_scale=float(res.size_scale[:live].mean()) if live else float("nan"),
        mean_abs_intended=float(np.abs(res.intended_position).mean()) if res.n_bars else 0.0,
        mean_abs_position=float(np.abs(res.position).mean()) if res.n_bars else 0.0,
        actions=action_distribution(res.actions[:live]),
        wiped_out_bar=None if wiped is None else int(res.bar[wiped]),
    )
    return out
