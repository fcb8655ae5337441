"""Metrics equal empyrical-reloaded's; annualisation is explicit and stride-corrected."""

from __future__ import annotations

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


def test_trading_metrics_on_a_hand_built_result():
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
        initial_equity=1e5, max_position=1.0)
    m = M.compute_metrics(res, 100.0)
    assert m["n_trades"] == 2 and m["n_entries"] == 2 and m["hit_rate"] == 0.5
    assert m["mean_holding_bars"] == 2.5 and m["exposure"] == 5 / 8
    assert m["turnover"] == pytest.approx((1 + 1 + 0.5 + 0.5) / 8)
    assert m["cost_share"] == pytest.approx(40 / 240)
    assert m["actions"]["direction"] == {"short": 0.0, "hold": 0.5, "long": 0.5, "flat": 0.0}
    assert m["actions"]["urgency"]["urgency_2"] == 0.5
