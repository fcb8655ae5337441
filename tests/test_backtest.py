"""Backtest engine: exact buy-and-hold, window stitching, stride, baselines, bad policies."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import jax_events, random_bars

from jdqn import env as E
from jdqn.config import EnvConfig, EvalConfig, SizingConfig
from jdqn.evaluate import compute_metrics, rollout, run_baselines
from jdqn.evaluate.baselines import buy_and_hold_policy

T, F, W = 400, 4, 16
MULT = 50.0
NO_SIZING = SizingConfig(conviction=False, variance=False, kelly=False, cvar=False)


def bars(seed: int = 0):
    """Random bars on the 0.25 tick grid (exact in float32: < 2²⁴ ticks)."""
    return random_bars(T, F, seed)


def zero_cost_cfg(initial_equity: float) -> EnvConfig:
    return EnvConfig(spread_ticks=0, slippage_ticks=0, commission=0, maker_fee=0, holding_cost=0,
                     contract_multiplier=MULT, max_position=1.0, initial_equity=initial_equity,
                     sizing=NO_SIZING)


def test_buy_and_hold_with_zero_costs_reproduces_the_price_path_exactly():
    feats, o, h, lo_, c = bars()
    lo, hi = 50, 350
    # Equity = notional of one contract at the entry price (open of bar lo+1), so the equity
    # curve of a constant one-contract position is the price path itself.
    cfg = zero_cost_cfg(MULT * o[lo + 1])
    params = E.make_params(feats, o, h, lo_, c, cfg, state_width=W)
    res = rollout(params, buy_and_hold_policy, jnp.int32(0), lo=lo, hi=hi)
    assert res.n_bars == hi - lo - 1 and np.array_equal(res.bar, np.arange(lo + 1, hi))
    # Entry at open[lo+1], marks at each close, forced exit at open[hi−1].
    path = np.r_[o[lo + 1], c[lo + 1:hi - 1], o[hi - 1]]
    expected = path[1:] / path[:-1] - 1
    # Prices and per-bar PnL are exact in float32 (tick multiples, integer multiplier); the only
    # rounding is float64 division and the product: a few ulps per bar.
    np.testing.assert_allclose(res.returns, expected, rtol=0, atol=1e-13)
    total = np.prod(1 + res.returns) - 1
    assert total == pytest.approx(o[hi - 1] / o[lo + 1] - 1, abs=1e-12)
    assert res.position[:-1].min() == 1.0 and res.position[-1] == 0.0
    assert res.total_costs.sum() == 0


def test_a_period_outside_the_params_window_is_backtested_on_its_own_bars():
    """Params whose window is [0, 200) (e.g. a fold's training window), backtested on
    [150, 350): every bar of the period is traded at its own prices, exactly as with params
    built on that period (the env clamps fills to the params' window, so the backtest must
    re-window them)."""
    feats, o, h, lo_, c = bars(2)
    cfg = zero_cost_cfg(MULT * o[151])
    early = E.make_params(feats, o, h, lo_, c, cfg, lo=0, hi=200, state_width=W)
    own = E.make_params(feats, o, h, lo_, c, cfg, lo=150, hi=350, state_width=W)
    got = rollout(early, buy_and_hold_policy, jnp.int32(0), lo=150, hi=350)
    want = rollout(own, buy_and_hold_policy, jnp.int32(0), lo=150, hi=350)
    assert np.array_equal(got.bar, np.arange(151, 350))
    np.testing.assert_array_equal(got.returns, want.returns)
    assert np.count_nonzero(got.returns[60:]) > 100  # bars after 199 move (they froze before)


def test_costs_reconcile_and_returns_compound_to_equity():
    feats, o, h, lo_, c = bars(1)
    cfg = EnvConfig(contract_multiplier=MULT, holding_cost=0.3)
    params = E.make_params(feats, o, h, lo_, c, cfg, state_width=W)
    res = run_baselines(params, EvalConfig(), lo=10, hi=300, names=("random",))["random"]
    np.testing.assert_allclose(res.net_pnl, res.gross_pnl - res.total_costs, atol=1e-3)
    final = cfg.initial_equity + res.net_pnl.sum()
    assert np.prod(1 + res.returns) * cfg.initial_equity == pytest.approx(final, rel=1e-12)
    assert res.commission.sum() > 0 and res.spread_cost.sum() > 0


def test_parallel_windows_cover_each_bar_once_and_are_flat_at_boundaries():
    feats, o, h, lo_, c = bars(2)
    params = E.make_params(feats, o, h, lo_, c, zero_cost_cfg(1e5), state_width=W)
    one = rollout(params, buy_and_hold_policy, jnp.int32(0), lo=20, hi=320)
    many = rollout(params, buy_and_hold_policy, jnp.int32(0), lo=20, hi=320, n_windows=7)
    np.testing.assert_array_equal(one.bar, many.bar)
    # 299 return bars in 7 windows of ⌈299 / 7⌉ = 43 steps; flat at each window end.
    ends = np.flatnonzero(many.position == 0)
    assert len(ends) == 7 and ends[-1] == many.n_bars - 1
    np.testing.assert_array_equal(np.diff(np.r_[-1, ends])[:-1], 43)
    # With zero costs and a one-bar gap at each boundary, returns equal except at those bars.
    same = np.ones(many.n_bars, bool)
    same[ends[:-1] + 1] = False
    same[ends] = False
    np.testing.assert_allclose(one.net_pnl[same], many.net_pnl[same], atol=1e-9)
    # Windows so short that the forced liquidations crowd out the policy draw a warning.
    with pytest.warns(UserWarning, match=r"in 60 windows of 5 steps: .*20% of the decisions"):
        rollout(params, buy_and_hold_policy, jnp.int32(0), lo=20, hi=320, n_windows=60)


def test_stride_evaluates_k_bar_bars_with_original_bar_indices():
    feats, o, h, lo_, c = bars(3)
    params = E.make_params(feats, o, h, lo_, c, zero_cost_cfg(1e5), state_width=W)
    k, lo, hi = 5, 10, 311
    res = rollout(params, buy_and_hold_policy, jnp.int32(0), lo=lo, hi=hi, stride=k)
    assert res.n_bars == (hi - 1 - lo) // k and res.stride == k
    np.testing.assert_array_equal(res.bar, lo + k * np.arange(1, res.n_bars + 1))
    # Entry at the first open after bar lo, exit at the first open after the penultimate decision.
    exit_open = o[res.bar[-2] + 1]
    assert res.net_pnl.sum() == pytest.approx(MULT * (exit_open - o[lo + 1]), abs=1e-9)


def test_a_strided_backtests_cvar_sizing_sees_the_k_bar_history_before_its_period():
    """The CVaR factor of the first decisions of a strided backtest comes from the k-bar
    returns before the period (as a stride-1 backtest's comes from the bars before it); built
    from the period alone it started at full size. Every decision's size here equals the CVaR
    cap computed on the k-bar closes of the whole history."""
    feats, o, h, lo_, c = random_bars(3000, 4, seed=5, step_sd=3.0)
    sz = SizingConfig(conviction=False, variance=False, kelly=False, cvar=True,
                      cvar_limit=2e-4)
    params = E.make_params(feats, o, h, lo_, c, EnvConfig(sizing=sz), state_width=W)
    k, lo, hi = 5, 1500, 2500

    def long_always(pp, obs, ctx):
        n = obs.shape[0]
        act = jnp.stack([jnp.full((n,), E.LONG), jnp.full((n,), 2), jnp.zeros(n, jnp.int32),
                         jnp.zeros(n, jnp.int32)], -1).astype(jnp.int32)
        return act, E.PolicyAux.confident(n)

    res = rollout(params, long_always, jnp.int32(0), lo=lo, hi=hi, stride=k)
    closes = c[lo % k::k]  # every k-bar close from the start of the data, on lo's grid
    risk = E.cvar_series(closes, sz, 1.0, EnvConfig().contract_multiplier,
                         EnvConfig().initial_equity)[(lo - lo % k) // k:][:res.n_bars]
    want = np.clip(sz.cvar_limit / np.maximum(risk, 1e-12), sz.cvar_floor, 1.0)
    assert want[0] < 1.0  # the history's risk caps the first decision: the test can fail
    np.testing.assert_allclose(res.size_scale[:-1], want[:-1], rtol=1e-5)


def test_stride_charges_holding_cost_per_original_bar_and_keeps_limit_expiry_in_time():
    from jdqn.evaluate.backtest import strided_cfg

    feats, o, h, lo_, c = bars(3)
    cfg = dataclasses.replace(zero_cost_cfg(1e5), holding_cost=0.5)
    params = E.make_params(feats, o, h, lo_, c, cfg, state_width=W)
    lo, hi = 10, 311
    held = {k: rollout(params, buy_and_hold_policy, jnp.int32(0), lo=lo, hi=hi, stride=k)
            for k in (1, 5)}
    # Holding one contract from the first to the last decision: the same time, the same cost.
    bars_held = {k: int(np.sum(r.position != 0)) * k for k, r in held.items()}
    for k, r in held.items():
        assert r.total_costs.sum() == pytest.approx(0.5 * bars_held[k], rel=1e-9)
    assert abs(bars_held[5] - bars_held[1]) < 5  # the k-bar grid ends up to k−1 bars earlier
    s = strided_cfg(dataclasses.replace(cfg, limit_expiry=(1, 3, 10)), 4)
    assert s.holding_cost == 2.0 and s.limit_expiry == (1, 1, 3)
    assert strided_cfg(cfg, 1) is cfg


def test_baselines_run_through_the_same_engine():
    feats, o, h, lo_, c = bars(4)
    params = E.make_params(feats, o, h, lo_, c, EnvConfig(contract_multiplier=MULT),
                           state_width=W)
    out = run_baselines(params, EvalConfig(), lo=30, hi=330)
    assert set(out) == {"flat", "buy_and_hold", "momentum", "random"}
    assert np.all(out["flat"].returns == 0) and out["flat"].n_bars == 299
    assert compute_metrics(out["buy_and_hold"], 1000.0)["n_trades"] == 1
    mom = out["momentum"]
    # Momentum's decision at bar t is the sign of close[t] − close[t−20].
    t = mom.bar - 1
    s = np.sign(c[t] - c[np.maximum(t - 20, 0)])
    held = np.sign(np.r_[0, mom.position[:-1]])
    want = np.where(held == s, 1, np.where(s > 0, 2, np.where(s < 0, 0, 1)))
    np.testing.assert_array_equal(mom.actions[:-1, 0], want[:-1])
    again = run_baselines(params, EvalConfig(), lo=30, hi=330, names=("random",))["random"]
    np.testing.assert_array_equal(again.actions, out["random"].actions)
    other = run_baselines(params, EvalConfig(random_seed=7), lo=30, hi=330,
                          names=("random",))["random"]
    assert not np.array_equal(other.actions, out["random"].actions)


@pytest.mark.parametrize("bad", ["range", "nan", "shape", "aux"])
def test_bad_policy_output_raises_a_clear_error_not_a_nan_curve(bad):
    feats, o, h, lo_, c = bars(5)
    params = E.make_params(feats, o, h, lo_, c, EnvConfig(), state_width=W)

    def policy(obs):
        n = obs.shape[0]
        action = jnp.tile(jnp.array([[2, 2, 0, 0]], jnp.int32), (n, 1))
        aux = E.PolicyAux.zeros(n)
        if bad == "range":
            action = action.at[:, 2].set(jnp.where(obs[:, 0] > 1.0, 7, 0))
        elif bad == "nan":
            action = action.astype(jnp.float32).at[:, 1].set(jnp.where(obs[:, 0] > 1.0,
                                                                       jnp.nan, 1.0))
        elif bad == "shape":
            action = action[:, :3]
        else:
            aux = E.PolicyAux(q_gap=jnp.where(obs[:, 0] > 1.0, jnp.nan, 0.0), q_var=aux.q_var)
        return action, aux

    match = {"range": "order_type action 7 out of range", "nan": "NaN", "shape": "shape",
             "aux": "aux.q_gap"}[bad]
    with pytest.raises(E.EnvInputError, match=match):
        rollout(params, policy, lo=0, hi=100)


def test_bad_period_raises():
    feats, o, h, lo_, c = bars(5)
    params = E.make_params(feats, o, h, lo_, c, EnvConfig(), state_width=W)
    with pytest.raises(E.EnvInputError, match="period"):
        rollout(params, buy_and_hold_policy, jnp.int32(0), lo=390, hi=500)


@pytest.mark.parametrize("n_windows", [1, 3])
def test_chunked_scan_is_bitwise_one_scan_and_periods_share_one_program(monkeypatch, n_windows):
    # The rollout runs its steps in calls of SCAN_CHUNK steps carrying the env state: the
    # records must be bitwise those of one scan over all the steps (the random policy's key is
    # folded with the step's index in the whole rollout, not in the call), and periods of
    # other lengths must reuse the compiled program.
    from jdqn.evaluate import backtest as bt
    from jdqn.evaluate.baselines import random_policy

    feats, o, h, lo_, c = bars(5)
    params = E.make_params(feats, o, h, lo_, c, EnvConfig(contract_multiplier=MULT),
                           state_width=W)
    fields = [f.name for f in dataclasses.fields(bt.BacktestResult)]

    def run(lo, hi):
        return rollout(params, random_policy, jnp.int32(0), lo=lo, hi=hi, n_windows=n_windows)

    monkeypatch.setattr(bt, "SCAN_CHUNK", 1 << 20)  # one call: the whole scan
    whole = run(20, 390)
    monkeypatch.setattr(bt, "SCAN_CHUNK", 32)
    with jax_events() as lowered:
        chunked = run(20, 390)  # 369 steps (n_windows = 1): 12 calls, the last one 15 long
        assert chunked.n_bars == whole.n_bars == 369
        for f in fields:
            np.testing.assert_array_equal(getattr(chunked, f), getattr(whole, f), err_msg=f)
        other = run(60, 300)
    assert other.n_bars == 239 and lowered.count("jit(_scan)") == 1, lowered


def test_baselines_through_one_program_equal_each_baseline_alone():
    from jdqn.evaluate import backtest as bt
    from jdqn.evaluate.baselines import BASELINES

    feats, o, h, lo_, c = bars(6)
    params = E.make_params(feats, o, h, lo_, c, EnvConfig(contract_multiplier=MULT),
                           state_width=W)
    cfg = EvalConfig(momentum_lookback=7, random_seed=3)
    bt._scan.clear_cache()
    out = run_baselines(params, cfg, lo=30, hi=330)
    assert bt._scan._cache_size() == 1  # four baselines, one compiled program
    for name, res in out.items():
        alone = rollout(params, BASELINES[name], jnp.int32(7), lo=30, hi=330,
                        key=jax.random.key(3))
        for f in dataclasses.fields(bt.BacktestResult):
            np.testing.assert_array_equal(getattr(res, f.name), getattr(alone, f.name),
                                          err_msg=f"{name}.{f.name}")


def test_a_wiped_out_account_holds_trades_and_pays_nothing_after_that_bar(tmp_path):
    """Buy and hold $400 of equity through a 10-point fall (−$500 on one ES contract), then a
    110-point rise: the account is gone at the fall, so the report must not count the rise —
    its return −1 there, then flat records, dollar and trading figures that stop there too."""
    from jdqn.evaluate import write_report

    t_len = 60
    c = np.r_[np.full(5, 1600.0), np.linspace(1600, 1590, 6)[1:],
              np.linspace(1590, 1700, t_len - 10)]
    o = np.r_[c[0], c[:-1]]
    cfg = EnvConfig(contract_multiplier=50.0, initial_equity=400.0, spread_ticks=0,
                    slippage_ticks=0, commission=0)
    params = E.make_params(np.zeros((t_len, 2), np.float32), o, np.maximum(o, c) + 0.25,
                           np.minimum(o, c) - 0.25, c, cfg, state_width=16)
    res = run_baselines(params, EvalConfig(), lo=0, hi=t_len,
                        names=("buy_and_hold",))["buy_and_hold"]
    cash = cfg.initial_equity + np.cumsum(res.net_pnl)
    j = res.wiped_out_at
    assert j is not None and cash[j] <= 0 and (cash[:j] > 0).all()
    assert res.returns[j] == -1.0 and (res.returns[j + 1:] == 0).all()
    for name in ("position", "fill_qty", "net_pnl", "gross_pnl", "commission", "spread_cost",
                 "holding_cost", "closed_trade_pnl"):
        assert (getattr(res, name)[j + 1:] == 0).all(), name
    assert not res.filled[j + 1:].any() and not res.trade_closed[j + 1:].any()
    m = compute_metrics(res, 252.0)
    assert m["total_return"] == -1.0 and m["wiped_out_bar"] == int(res.bar[j])
    # the dollar figures end where the returns do: a loss of at least the whole equity
    assert m["net_pnl"] == pytest.approx(cash[j] - cfg.initial_equity)
    assert m["net_pnl"] <= -cfg.initial_equity
    assert m["n_fills"] == int(res.filled[:j + 1].sum()) and m["n_trades"] == 0
    assert m["exposure"] == pytest.approx((j + 1) / res.n_bars)
    report = write_report(tmp_path, None, res, {}, [], 252.0)
    assert report["test"]["wiped_out_bar"] == int(res.bar[j])
    assert f"equity reached zero at bar {int(res.bar[j])}" in (tmp_path / "summary.md").read_text()
    fine = run_baselines(params, EvalConfig(), lo=0, hi=8, names=("buy_and_hold",))
    assert fine["buy_and_hold"].wiped_out_at is None
    assert compute_metrics(fine["buy_and_hold"], 252.0)["wiped_out_bar"] is None
