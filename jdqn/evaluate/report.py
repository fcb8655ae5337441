"""Report folder: ``report.json``, ``returns.csv``, ``plots/*.png``, ``summary.md``.

``returns.csv`` holds one row per out-of-sample bar with simple per-bar returns of equity net of
costs, so every metric in ``report.json`` can be recomputed from it with the stated
``annualization_periods`` (e.g. ``mean / std(ddof=1) · √P`` is the Sharpe ratio).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from jdqn.evaluate.backtest import BacktestResult
from jdqn.evaluate.metrics import compute_metrics, drawdown_series

SUMMARY_KEYS = ("sharpe", "sharpe_se", "psr", "sortino", "calmar", "max_drawdown",
                "total_return", "annual_return", "n_trades", "hit_rate", "turnover", "cost_share")


def _clean(x: Any) -> Any:
    """JSON-safe: NaN/inf → None, numpy scalars → Python."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, np.ndarray):
        return _clean(x.tolist())
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return x if math.isfinite(x) else None
    return x


def _timestamps(timestamps: Any, bar: np.ndarray) -> pd.Index:
    """The report's index: the bars' close times, or without them the bars' own numbers in the
    original series (``BacktestResult.bar``), named ``bar``."""
    n = len(bar)
    if timestamps is None:
        return pd.Index(np.asarray(bar, np.int64), name="bar")
    ts = np.asarray(timestamps)
    if len(ts) != n:
        raise ValueError(f"timestamps has {len(ts)} entries, the backtest {n} bars")
    if np.issubdtype(ts.dtype, np.integer):
        return pd.DatetimeIndex(pd.to_datetime(ts, unit="ns", utc=True), name="timestamp")
    return pd.Index(pd.to_datetime(ts, utc=True), name="timestamp")


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_report(out_dir: str | Path, timestamps: Any, strategy: BacktestResult,
                 baselines: dict[str, BacktestResult], fold_metrics: list[dict[str, Any]],
                 periods_per_year: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the report folder and return the ``report.json`` content.

    ``timestamps``: close time of each return bar (``int64`` ns since epoch, datetimes, or
    ``None``: then the bar numbers ``strategy.bar`` index the files, and ``period`` gives them
    as its start and end), aligned with ``strategy.bar``; every baseline must cover the same
    bars. ``fold_metrics``: per-fold validation metric dicts from the trainer, passed through.
    """
    out = Path(out_dir)
    (out / "plots").mkdir(parents=True, exist_ok=True)
    for name, res in baselines.items():
        if res.n_bars != strategy.n_bars or not np.array_equal(res.bar, strategy.bar):
            raise ValueError(f"baseline {name!r} does not cover the strategy's bars")
    index = _timestamps(timestamps, strategy.bar)

    test = compute_metrics(strategy, periods_per_year)
    base = {name: compute_metrics(res, periods_per_year) for name, res in baselines.items()}
    report = _clean({
        "test": test, "baselines": base, "folds": list(fold_metrics),
        "annualization_periods": float(periods_per_year), "stride": strategy.stride,
        "period": {"first_bar": int(strategy.bar[0]) if strategy.n_bars else None,
                   "last_bar": int(strategy.bar[-1]) if strategy.n_bars else None,
                   "start": str(index[0]) if len(index) else None,
                   "end": str(index[-1]) if len(index) else None},
        "extra": extra or {},
    })
    (out / "report.json").write_text(json.dumps(report, indent=2, allow_nan=False))

    cols = {} if timestamps is None else {"bar": strategy.bar}  # (else the bars index it)
    cols |= {"strategy_return": strategy.returns,
            "position": strategy.position, "intended_position": strategy.intended_position,
            "fill_qty": strategy.fill_qty, "net_pnl": strategy.net_pnl,
            "costs": strategy.total_costs, "equity": strategy.equity}
    for name, res in baselines.items():
        cols[f"{name}_return"] = res.returns
    pd.DataFrame(cols, index=index).to_csv(out / "returns.csv")

    _plots(out / "plots", index, strategy, baselines, test)
    _summary(out / "summary.md", report)
    return report


def _plots(folder: Path, index: pd.Index, strategy: BacktestResult,
           baselines: dict[str, BacktestResult], test: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = index
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(x, np.cumprod(1 + strategy.returns), label="strategy", lw=1.5, color="black")
    for name, res in baselines.items():
        ax.plot(x, np.cumprod(1 + res.returns), label=name, lw=1)
    ax.set_title("Equity (growth of 1), net of costs")
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(folder / "equity.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 3))
    ax.fill_between(x, drawdown_series(strategy.returns), 0, color="tab:red", alpha=0.5)
    ax.set_title(f"Drawdown (max {test['max_drawdown']:.2%})")
    fig.tight_layout()
    fig.savefig(folder / "drawdown.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 3))
    ax.step(x, strategy.position, where="post", label="realised", lw=1)
    ax.step(x, strategy.intended_position, where="post", label="intended", lw=1, alpha=0.6)
    ax.set_title("Position (contracts)")
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(folder / "position.png", dpi=100)
    plt.close(fig)

    dist = test["actions"]
    fig, axes = plt.subplots(1, len(dist), figsize=(12, 3))
    for ax, (branch, shares) in zip(np.atleast_1d(axes), dist.items(), strict=True):
        ax.bar(list(shares), list(shares.values()))
        ax.set_title(branch)
        ax.set_ylim(0, 1)
        ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    fig.savefig(folder / "actions.png", dpi=100)
    plt.close(fig)


def write_seed_summary(out_dir: str | Path, seeds: list[int] | tuple[int, ...],
                       reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Across-seed view of a multi-seed run: ``seeds.json`` with each seed's test metrics and
    their mean, standard deviation (ddof = 1), min and max, and an "Across seeds" table appended
    to ``summary.md`` (the top-level report is the first seed's; one seed's Sharpe says little
    about a configuration, the spread over seeds says more). Returns the ``seeds.json`` content.
    """
    if len(seeds) != len(reports) or len(seeds) < 2:
        raise ValueError(f"need one report per seed and ≥ 2 seeds, got {len(seeds)} seeds and "
                         f"{len(reports)} reports")
    out = Path(out_dir)
    per_seed = {str(seed): {k: r["test"].get(k) for k in SUMMARY_KEYS}
                for seed, r in zip(seeds, reports, strict=True)}
    aggregate = {}
    for k in SUMMARY_KEYS:
        v = np.array([m[k] for m in per_seed.values() if m[k] is not None], np.float64)
        aggregate[k] = ({"mean": float(v.mean()), "std": float(v.std(ddof=1)),
                         "min": float(v.min()), "max": float(v.max()), "n": int(v.size)}
                        if v.size >= 2 else {"mean": None, "std": None, "min": None,
                                             "max": None, "n": int(v.size)})
    summary = _clean({"seeds": [int(x) for x in seeds], "test": per_seed,
                      "aggregate": aggregate, "baselines": reports[0]["baselines"]})
    (out / "seeds.json").write_text(json.dumps(summary, indent=2, allow_nan=False))
    # the same statistics as seeds.json, with n: a seed whose metric is undefined (a Sharpe
    # for a seed that never held a position, a Sortino without a losing bar) is left out of
    # its column's statistics, and n says over how many seeds each one is
    stats = {stat: {k: aggregate[k][stat] for k in SUMMARY_KEYS}
             for stat in ("mean", "std", "min", "max", "n")}
    lines = ["", "## Across seeds (test window)", "",
             *_table("seed", SUMMARY_KEYS, {**per_seed, **stats})]
    if any(aggregate[k]["n"] < len(seeds) for k in SUMMARY_KEYS):
        lines += ["", (f"Over {len(seeds)} seeds; a column's statistics leave out the seeds "
                       "where its metric is undefined (–), row n counts the seeds kept.")]
    lines += ["", "Per-seed reports: `seeds/seed_<s>/`; all seeds: `seeds.json`.", ""]
    with (out / "summary.md").open("a") as f:
        f.write("\n".join(lines))
    return summary


def _table(first: str, keys: tuple[str, ...] | list[str],
           rows: dict[Any, dict[str, Any]]) -> list[str]:
    """A markdown table: one row per ``rows`` entry (its name in the ``first`` column), one
    column per key."""
    lines = [f"| {first} | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    return lines + [f"| {name} | " + " | ".join(_fmt(m.get(k)) for k in keys) + " |"
                    for name, m in rows.items()]


def _summary(path: Path, report: dict[str, Any]) -> None:
    rows = {"strategy": report["test"], **report["baselines"]}
    n, ppy = report["test"]["n_bars"], report["annualization_periods"]
    lines = ["# Out-of-sample report", "",
             (f"{n} bars, annualisation {ppy:.6g} periods/year, stride {report['stride']}, "
              f"period {report['period']['start']} → {report['period']['end']}."), "",
             *_table("policy", (*SUMMARY_KEYS, "mean_abs_position"), rows), ""]
    wiped = report["test"].get("wiped_out_bar")
    if wiped is not None:
        lines.append(f"**The strategy's equity reached zero at bar {wiped}**: its return there "
                     "is −1 and the account holds, trades and pays nothing after it; the "
                     "trading and dollar figures stop there too.")
        lines.append("")
    if n < ppy:
        lines.append(f"The window is {n / ppy:.2%} of a year: `annual_return` and `calmar` "
                     "compound it up to a year and mean little; read `total_return`, `sharpe` "
                     "with its standard error `sharpe_se`, and `psr`.")
        lines.append("")
    lines.append("Every policy runs through the same sizing chain (conviction, Kelly, CVaR "
                 "caps), so they hold different average positions (`mean_abs_position`, in "
                 "contracts, fractional: the engine trades continuous sizes): returns and "
                 "drawdowns scale with the size held, Sharpe only with how the size varies "
                 "over time; compare policies by Sharpe.")
    if report["folds"]:
        # the columns any fold has: a fold whose seed never updated (replay below
        # min_replay) has no validation metrics, and the first fold may be that one
        keys = [k for k in ("sharpe", "total_return", "max_drawdown")
                if any(k in fold for fold in report["folds"])]
        lines += ["", "## Walk-forward validation", "",
                  ("Each fold's best epoch by validation Sharpe, the one early stopping kept: "
                   "chosen on these very windows, so biased upwards; the test window above is "
                   "the unbiased estimate."), "",
                  *_table("fold", keys, dict(enumerate(report["folds"])))]
    lines += ["", ("Plots: `plots/equity.png`, `plots/drawdown.png`, `plots/position.png`, "
                   "`plots/actions.png`. Per-bar returns: `returns.csv`."), ""]
    path.write_text("\n".join(lines))
