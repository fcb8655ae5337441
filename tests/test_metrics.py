"""Metrics equal empyrical-reloaded's; annualisation is explicit and stride-corrected."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from jdqn.config import EvalConfig
from jdqn.evaluate import metrics as M

empyrical = pytest.importorskip("empyrical")

ES_TICKS = (Path(__file__).resolve().parents[2] / "shared" / "data" / "es_ticks"
            / "ES_ticks_2013-09-01_03.csv.gz")


def empyrical_metrics(r: np.ndarray, ppy: float) -> dict[str, float]:
    return {
        "total_return": empyrical.cum_returns_final(r),
        "annual_return": empyrical.annual_return(r, annualization=ppy),
        "annual_volatility": empyrical.annual_volatility(r, annualization=ppy),
        "sharpe": empyrical.sharpe_ratio(r, annualization=ppy),
        "sortino": empyrical.sortino_ratio(r, annualization=ppy),
        "calmar": empyrical.calmar_ratio(r, annualization=ppy),
        "max_drawdown": empyrical.max_drawdown(r),
    }


def assert_matches_empyrical(r: np.ndarray, ppy: float) -> None:
    ours = M.return_metrics(r, ppy)
    for k, v in empyrical_metrics(r, ppy).items():
        if np.isnan(v):
            assert np.isnan(ours[k]), k
        else:
            assert ours[k] == pytest.approx(v, rel=1e-9, abs=1e-9), k


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_equal_empyrical_on_random_returns(seed):
    rng = np.random.default_rng(seed)
    r = rng.standard_t(4, size=2000) * 1e-3 + 2e-5
    for ppy in (252.0, 98_280.0, 347_760.0 / 5):
        assert_matches_empyrical(r, ppy)


def test_metrics_equal_empyrical_on_edge_cases():
    for r in (np.zeros(50), np.full(30, 1e-4), np.array([0.01]), np.array([0.01, -0.02]),
              np.abs(np.random.default_rng(3).normal(0, 1e-3, 100))):
        assert_matches_empyrical(r, 252.0)


def es_minute_returns() -> np.ndarray:
    if not ES_TICKS.is_file():
        pytest.skip(f"real ES sample not found at {ES_TICKS}")
    ticks = pd.read_csv(ES_TICKS, usecols=["DateTime", "Price"], parse_dates=["DateTime"])
    close = ticks.set_index("DateTime")["Price"].resample("1min").last().dropna()
    return close.pct_change().dropna().to_numpy()


def test_metrics_equal_empyrical_on_real_es_minute_returns():
    r = es_minute_returns()
    assert len(r) > 1000
    ppy = M.periods_per_year(60, EvalConfig())
    assert_matches_empyrical(r, ppy)
    assert_matches_empyrical(-r, ppy)  # a short position on the same series


def test_periods_per_year_from_bar_size_and_sessions():
    assert M.periods_per_year(60, EvalConfig()) == 252 * 23 * 60
    assert M.periods_per_year(300, EvalConfig(session_hours=6.5)) == 252 * 6.5 * 12
    assert M.periods_per_year(60, EvalConfig(periods_per_year=1000.0)) == 1000.0
    # A bar longer than a session is one period per session (a daily bar: 252 a year, not the
    # 241.5 that 23 h / 24 h per session would give).
    assert M.periods_per_year(86400, EvalConfig()) == 252
    assert M.periods_per_year(86400, EvalConfig(stride=2)) == 126
    assert M.periods_per_year(60, EvalConfig(periods_per_year=1000.0, stride=4)) == 250.0


@pytest.mark.parametrize("k", [2, 3, 10])
def test_stride_changes_annualisation_by_exactly_sqrt_k(k):
    r = np.random.default_rng(k).normal(1e-5, 1e-3, 500)
    p1 = M.periods_per_year(60, EvalConfig())
    pk = M.periods_per_year(60, EvalConfig(stride=k))
    assert p1 / pk == k
    a, b = M.return_metrics(r, p1), M.return_metrics(r, pk)
    assert a["sharpe"] / b["sharpe"] == pytest.approx(np.sqrt(k), rel=1e-12)
    assert a["sortino"] / b["sortino"] == pytest.approx(np.sqrt(k), rel=1e-12)
    assert a["annual_volatility"] / b["annual_volatility"] == pytest.approx(np.sqrt(k), rel=1e-12)


def _hand_built_result(stride: int = 1):
    from jdqn.evaluate import BacktestResult

    pos = np.array([1.0, 1.0, 0.0, -0.5, -0.5, -0.5, 0.0, 0.0])
    fill = np.diff(np.r_[0.0, pos])
    closed = np.array([0, 0, 1, 0, 0, 0, 1, 0], bool)
    closed_pnl = np.where(closed, [0, 0, 30.0, 0, 0, 0, -10.0, 0], 0.0)
    z = np.zeros(8)
    res = BacktestResult(
        bar=np.arange(1, 9), returns=np.full(8, 1e-4), net_pnl=np.full(8, 25.0),
        gross_pnl=np.full(8, 30.0), commission=np.full(8, 5.0), spread_cost=z,
        holding_cost=z, position=pos, intended_position=pos, target_position=pos,
        fill_qty=fill, fill_price=z, filled=fill != 0, trade_closed=closed,
        closed_trade_pnl=closed_pnl, size_scale=np.ones(8),
        actions=np.array([[2, 2, 0, 0]] * 4 + [[1, 0, 1, 2]] * 4, np.int32),
        initial_equity=1e5, max_position=1.0, stride=stride)
    return res


def test_trading_metrics_on_a_hand_built_result():
    m = M.compute_metrics(_hand_built_result(), 100.0)
    assert m["n_trades"] == 2 and m["n_entries"] == 2 and m["hit_rate"] == 0.5
    assert m["mean_holding_bars"] == 2.5 and m["exposure"] == 5 / 8
    assert m["turnover"] == pytest.approx((1 + 1 + 0.5 + 0.5) / 8)
    assert m["cost_share"] == pytest.approx(40 / 240)
    assert m["actions"]["direction"] == {"short": 0.0, "hold": 0.5, "long": 0.5, "flat": 0.0}
    assert m["actions"]["urgency"]["urgency_2"] == 0.5


def test_a_strided_backtest_needs_periods_per_year_of_its_stride():
    """The predecessor annualised strided evaluations per bar (Sharpe × √stride). A strided
    result takes only a figure that says it was divided by that stride."""
    res = _hand_built_result(stride=2)
    ppy = M.periods_per_year(60, EvalConfig(stride=2))
    assert isinstance(ppy, M.PeriodsPerYear) and ppy.stride == 2 and ppy == 252 * 23 * 30
    m = M.compute_metrics(res, ppy)
    assert m["sharpe"] == M.return_metrics(res.returns, 252 * 23 * 30)["sharpe"]
    # Holding time and turnover stay in original bars: each strided period spans 2 of them.
    one = M.compute_metrics(_hand_built_result(), 100.0)
    assert m["mean_holding_bars"] == 2 * one["mean_holding_bars"] == 5.0
    assert m["turnover"] == one["turnover"] / 2 and m["exposure"] == one["exposure"]
    assert m["annual_turnover"] == pytest.approx(m["turnover"] * 252 * 23 * 60, rel=1e-15)
    with pytest.raises(ValueError, match="stride 2: pass periods_per_year"):
        M.compute_metrics(res, 252 * 23 * 60.0)  # a plain number: per bar or not, unknown
    with pytest.raises(ValueError, match="is for stride 1 but the backtest ran at stride 2"):
        M.compute_metrics(res, M.periods_per_year(60, EvalConfig()))
    assert M.compute_metrics(res, M.PeriodsPerYear(1000.0, stride=2))["n_trades"] == 2
    with pytest.raises(ValueError, match="is for stride 2 but the backtest ran at stride 1"):
        M.compute_metrics(_hand_built_result(), ppy)
    # A stride-1 backtest takes a plain number too; the figure is a float everywhere else.
    assert M.compute_metrics(_hand_built_result(), 100.0)["n_bars"] == 8
    assert json.loads(json.dumps({"p": ppy})) == {"p": 252 * 23 * 30}
    assert float(ppy) * 2 == 252 * 23 * 60 and "stride=2" in repr(ppy)
    import copy
    import pickle

    for clone in (copy.copy(ppy), copy.deepcopy(ppy), pickle.loads(pickle.dumps(ppy))):
        assert isinstance(clone, M.PeriodsPerYear) and clone == ppy and clone.stride == 2
    with pytest.raises(ValueError, match="stride must be"):
        M.PeriodsPerYear(1.0, stride=0)


def test_sharpe_standard_error_and_psr_against_scipy_moments():
    from scipy import stats

    rng = np.random.default_rng(7)
    r = rng.standard_t(5, size=700) * 1e-3 + 1e-4
    ppy = 98_280.0
    got = M.return_metrics(r, ppy)
    sr = r.mean() / r.std(ddof=1)
    g3, g4 = stats.skew(r), stats.kurtosis(r, fisher=False)
    v = 1 - g3 * sr + (g4 - 1) / 4 * sr**2
    assert got["sharpe_se"] == pytest.approx(np.sqrt(v / (len(r) - 1)) * np.sqrt(ppy), rel=1e-12)
    assert got["psr"] == pytest.approx(stats.norm.cdf(sr * np.sqrt(len(r) - 1) / np.sqrt(v)),
                                       rel=1e-12)
    # The standard error scales with √P like the Sharpe ratio; the probability does not.
    other = M.return_metrics(r, 252.0)
    assert got["sharpe_se"] / other["sharpe_se"] == pytest.approx(np.sqrt(ppy / 252.0))
    assert got["psr"] == pytest.approx(other["psr"], rel=1e-14)
    for short in (np.array([0.01, -0.02]), np.zeros(50), np.full(30, 1e-4)):
        out = M.return_metrics(short, 252.0)
        assert np.isnan(out["sharpe_se"]) and np.isnan(out["psr"])


@pytest.mark.parametrize("draw", ["normal", "skewed"])
def test_sharpe_standard_error_matches_the_spread_of_sample_sharpes(draw):
    # Monte Carlo: 3000 series of 400 returns with a known true Sharpe ratio; the formula's
    # mean standard error must match the observed spread of the sample Sharpe ratios.
    rng = np.random.default_rng(11)
    n, reps = 400, 3000
    if draw == "normal":
        x = rng.normal(0.1, 1.0, size=(reps, n))
    else:  # right-skewed, fat-tailed: a centred lognormal plus a drift
        z = rng.lognormal(0.0, 0.6, size=(reps, n))
        x = (z - np.exp(0.18)) / np.sqrt((np.exp(0.36) - 1) * np.exp(0.36)) + 0.1
    per = [M.return_metrics(row * 1e-3, 1.0) for row in x]  # return-sized; SR is scale-free
    sharpes = np.array([m["sharpe"] for m in per])
    se = np.array([m["sharpe_se"] for m in per])
    assert np.std(sharpes, ddof=1) == pytest.approx(np.mean(se), rel=0.05)
    if draw == "skewed":  # the normal-returns formula would be off here: the correction matters
        naive = np.sqrt((1 + 0.5 * sharpes**2) / (n - 1))
        assert abs(np.mean(naive) / np.std(sharpes, ddof=1) - 1) > 0.05


def test_psr_is_calibrated_under_no_edge_and_confident_with_one():
    rng = np.random.default_rng(5)
    null = np.array([M.return_metrics(rng.standard_t(6, 500) * 1e-3, 252.0)["psr"]
                     for _ in range(3000)])
    assert np.mean(null > 0.95) == pytest.approx(0.05, abs=0.015)  # uniform under the null
    assert np.mean(null < 0.5) == pytest.approx(0.5, abs=0.04)
    edge = M.return_metrics(rng.normal(0.3, 1.0, 500) * 1e-3, 252.0)
    assert edge["psr"] > 0.999
