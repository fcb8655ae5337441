"""Hand-computed micro scenarios for the env: fills, costs, churn, flips, liquidation, sizing."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import x64

from jdqn import env as E
from jdqn.config import EnvConfig, SizingConfig

# Ten bars with known prices (tick 0.25). low ≤ open, close ≤ high everywhere.
O = [100, 101, 101.5, 100, 100.5, 101, 102, 101, 100, 100]
H = [100.5, 102, 102, 100.25, 101, 101.5, 102.5, 102, 101, 100.5]
L = [99.5, 100.5, 99, 99.75, 100, 100.5, 101.5, 100.5, 99.5, 99.5]
C = [100, 101.5, 100, 100, 100.75, 101.25, 102, 101, 99.75, 100]
MULT, E0 = 10.0, 10_000.0
NO_SIZING = SizingConfig(conviction=False, variance=False, kelly=False, cvar=False)
BASE = {"tick_size": 0.25, "spread_ticks": 0.0, "slippage_ticks": 0.0, "commission": 0.0,
        "maker_fee": 0.0, "holding_cost": 0.0, "contract_multiplier": MULT, "initial_equity": E0,
        "max_position": 1.0, "limit_expiry": (1, 2, 3), "sizing": NO_SIZING, "n_envs": 1,
        "episode_length": 4}


def make(training: bool = True, **kw) -> E.EnvParams:
    cfg = EnvConfig(**{**BASE, **kw})
    feats = np.arange(len(C) * 2, dtype=np.float32).reshape(len(C), 2)
    return E.make_params(feats, O, H, L, C, cfg, training=training, state_width=12)


def act(d: int, m: int = 2, o: int = E.MARKET, u: int = 0) -> jnp.ndarray:
    return jnp.array([[d, m, o, u]], jnp.int32)


def run(params: E.EnvParams, actions: list, last: int = 8, aux: E.PolicyAux | None = None):
    """Step one episode from bar 0 through ``actions``; return per-step (reward, done, info)."""
    state = E.reset_at(params, jnp.array([0]), jnp.array([last]))
    aux = E.PolicyAux.zeros(1) if aux is None else aux
    out = []
    for a in actions:
        state, r, d, info = E.step(params, state, a, aux)
        out.append((float(r[0]), bool(d[0]), {k: np.asarray(v)[0] for k, v in info.items()}))
    return state, out


# ------------------------------------------------------------------ market orders and costs


def test_market_buy_fills_at_next_open_and_marks_to_close():
    _, out = run(make(), [act(E.LONG), act(E.HOLD)])
    (r1, _, i1), (_, _, i2) = out
    assert i1["fill_price"] == 101 and i1["position"] == 1
    assert i1["gross_pnl"] == MULT * (101.5 - 101)
    assert r1 == pytest.approx(5.0 / E0, rel=1e-6)
    assert i2["gross_pnl"] == MULT * (100 - 101.5) and not i2["filled"]


def test_market_order_pays_half_spread_slippage_and_commission():
    _, out = run(make(spread_ticks=2, slippage_ticks=1, commission=2.0), [act(E.LONG)])
    r, _, i = out[0]
    assert i["fill_price"] == 101 + 0.25 + 0.25
    assert i["spread_cost"] == pytest.approx(MULT * 0.5)
    assert i["commission"] == 2.0
    assert i["net_pnl"] == pytest.approx(5.0 - 5.0 - 2.0)
    assert r == pytest.approx(-2.0 / E0, rel=1e-6)


def test_market_sell_pays_costs_on_the_other_side():
    _, out = run(make(spread_ticks=2, slippage_ticks=1, commission=2.0), [act(E.SHORT, m=1)])
    i = out[0][2]
    assert i["fill_qty"] == -0.5 and i["fill_price"] == 101 - 0.5
    # −0.5 × (101.5 − 101) × 10 − 0.5 × 0.5 × 10 − 0.5 × 2
    assert i["net_pnl"] == pytest.approx(-2.5 - 2.5 - 1.0)


def test_holding_cost_per_contract_per_bar():
    _, out = run(make(holding_cost=1.5), [act(E.LONG, m=1), act(E.HOLD), act(E.FLAT)])
    assert [o[2]["holding_cost"] for o in out] == [0.75, 0.75, 0.0]


def test_magnitudes_are_quarter_half_full_of_max_position():
    for m, q in enumerate((0.5, 1.0, 2.0)):
        _, out = run(make(max_position=2.0), [act(E.LONG, m=m)])
        assert out[0][2]["position"] == q


# ------------------------------------------------------------------ limit orders


def test_limit_at_touch_that_does_not_fill_expires():
    # Buy at touch = close[0] − half spread = 99.75; bar 1's low is 100.5: no fill; urgency 0
    # lives one bar, so bar 2 (low 99) no longer fills it.
    _, out = run(make(spread_ticks=2), [act(E.LONG, o=E.LIMIT_TOUCH, u=0), act(E.HOLD)])
    assert not out[0][2]["filled"] and not out[1][2]["filled"]
    assert out[1][2]["position"] == 0


def test_limit_at_touch_fills_within_expiry_at_limit_price_with_maker_fee():
    _, out = run(make(spread_ticks=2, maker_fee=0.5, commission=9.0),
                 [act(E.LONG, o=E.LIMIT_TOUCH, u=1), act(E.HOLD)])
    assert not out[0][2]["filled"]
    i = out[1][2]
    assert i["filled"] and i["fill_price"] == 99.75 and i["position"] == 1
    assert i["commission"] == 0.5 and i["spread_cost"] == 0.0
    assert i["net_pnl"] == pytest.approx(MULT * (100 - 99.75) - 0.5)


def test_an_expired_limit_is_no_longer_reported_as_the_target():
    # expiry 1: the buy at 99.75 can fill in bar 1 only (low 100.5): expired after that step
    _, out = run(make(spread_ticks=2), [act(E.LONG, o=E.LIMIT_TOUCH, u=0), act(E.HOLD),
                                        act(E.HOLD)])
    for _, _, info in out:
        assert info["target_position"] == info["position"] == 0.0
        assert info["intended_position"] == 1.0  # the latest order's unsized target


def _run_sized(params, steps):
    """Steps of (action, conviction): the conviction factor alone sizes each order."""
    state = E.reset_at(params, jnp.array([0]), jnp.array([8]))
    out = []
    for a, gap in steps:
        aux = E.PolicyAux(q_gap=jnp.array([gap], jnp.float32), q_var=jnp.zeros(1, jnp.float32))
        port = np.asarray(E.portfolio(params, state))[0]
        state, _, _, info = E.step(params, state, a, aux)
        out.append(({k: np.asarray(v)[0] for k, v in info.items()}, port))
    return out


def test_a_fill_lands_exactly_on_its_target_and_a_repeat_order_trades_nothing():
    # from a = 0.65315694 to −b = −0.95581996 contracts: a + (−b − a) is not −b in float32; the
    # ulp left over used to trade again (a fill, its commission) when the same order came back,
    # and a limit order for it showed as a working order in the observation
    a, b = np.float32(0.65315694), np.float32(0.95581996)
    assert a + (-b - a) != -b  # the rounding this guards against
    sized = SizingConfig(conviction=True, variance=False, kelly=False, cvar=False)
    out = _run_sized(make(sizing=sized, commission=2.0, spread_ticks=1),
                     [(act(E.LONG), a), (act(E.SHORT), b), (act(E.SHORT), b),
                      (act(E.SHORT, o=E.LIMIT_PASSIVE), b), (act(E.HOLD), b)])
    assert out[1][0]["position"] == -b == out[1][0]["target_position"]
    assert out[1][0]["fill_qty"] == -b - a  # the quantity traded is unchanged
    for info, _ in out[2:]:
        assert not info["filled"] and info["fill_qty"] == 0 and info["commission"] == 0
        assert info["position"] == -b
    assert np.all(out[4][1][4:] == 0)  # no working order in the observation


def test_prices_off_the_tick_grid_are_refused_naming_the_bar():
    E.check_tick_grid(0.25, close=np.array(C, np.float32), low=np.array(L) + 1e-9)
    E.check_tick_grid(0.01, close=np.array([4123.37, 4123.38], np.float32))  # float32 rounding
    low = np.array(L, np.float64)
    low[2] = 99.6
    with pytest.raises(E.EnvInputError, match=r"low price 99.6 at bar 2 is off the "
                                              r"env.tick_size = 0.25 grid \(0.400 of a tick; "
                                              r"1 of 10 low prices are\)"):
        E.check_tick_grid(0.25, close=np.array(C), low=low)
    with pytest.raises(E.EnvInputError, match="env.check_tick_grid = false"):
        E.check_tick_grid(0.5, close=np.array(C))


def test_passive_limit_is_one_tick_further():
    _, out = run(make(spread_ticks=2), [act(E.LONG, o=E.LIMIT_PASSIVE, u=1), act(E.HOLD)])
    assert out[1][2]["fill_price"] == 99.5
    assert out[1][2]["gross_pnl"] == MULT * (100 - 99.5)


def test_limit_fills_only_when_traded_through_not_at_touch():
    # Decide at bar 2 (close 100): buy limit 99.75; bar 3's low is exactly 99.75 → no fill.
    _, out = run(make(spread_ticks=2), [act(E.FLAT), act(E.FLAT),
                                        act(E.LONG, o=E.LIMIT_TOUCH, u=0)])
    assert not out[2][2]["filled"]


@pytest.mark.parametrize("spread,otype", [(2, E.LIMIT_TOUCH), (0, E.LIMIT_PASSIVE),
                                           (4, E.LIMIT_PASSIVE)])
def test_a_touch_never_fills_a_limit_on_a_decimal_tick_grid(spread, otype):
    """With a decimal tick (crude oil: 0.01) the limit price close − offset is a float32 that
    can land an ulp above the grid price a touching low is stored as: 1408 of 10,000 such
    touches filled before. Over 10,000 closes, a low at the limit price never fills a buy and
    a high at it never fills a sell; one tick through always does."""
    tick = 0.01
    closes = np.round(np.arange(50.0, 150.0, tick), 2)[:10_000]
    n = closes.size
    off = spread / 2 * tick + (tick if otype == E.LIMIT_PASSIVE else 0.0)
    cfg = EnvConfig(**{**BASE, "tick_size": tick, "spread_ticks": float(spread), "n_envs": n,
                       "episode_length": 2})
    for side, through in ((E.LONG, 0), (E.LONG, 1), (E.SHORT, 0), (E.SHORT, 1)):
        limit = np.round(closes - off if side == E.LONG else closes + off, 2)
        beyond = np.round(limit - through * tick if side == E.LONG else limit + through * tick,
                          2)
        o, h, lo, c = (np.empty(2 * n) for _ in range(4))
        for a in (o, h, lo, c):
            a[0::2] = closes
            a[1::2] = closes
        (lo if side == E.LONG else h)[1::2] = beyond
        params = E.make_params(np.zeros((2 * n, 1), np.float32), o, h, lo, c, cfg,
                               state_width=12)
        starts = jnp.arange(0, 2 * n, 2)
        state = E.reset_at(params, starts, starts + 1)
        a = jnp.tile(jnp.array([[side, 2, otype, 0]], jnp.int32), (n, 1))
        _, _, _, info = E.step(params, state, a, E.PolicyAux.zeros(n))
        filled = np.asarray(info["filled"])
        assert filled.all() if through else not filled.any(), (side, through, filled.sum())


def test_a_working_limit_order_is_in_the_observation_until_it_fills():
    """"Hold" keeps a live limit order working; the observation shows it (remaining quantity,
    bars it may still fill in, its price against the close in ticks), so a flat state with a
    working order does not look like one without."""
    params = make(spread_ticks=2)
    slot = {n: 2 + i for i, n in enumerate(E.PORTFOLIO_SLOTS)}  # 2 feature columns first
    # Bar 0: buy 1 at the touch 99.75, urgency 1 (two bars); bar 1 (low 100.5) does not fill.
    working, out = run(params, [act(E.LONG, o=E.LIMIT_TOUCH, u=1)])
    assert not out[0][2]["filled"] and int(working.t[0]) == 1
    obs = np.asarray(E.observe(params, working))[0]
    assert obs[slot["position"]] == 0.0 and obs[slot["order_size"]] == 1.0
    assert obs[slot["order_bars_left"]] == pytest.approx(1 / 3)  # bar 2 of limit_expiry 3
    assert obs[slot["order_distance"]] == pytest.approx((99.75 - 101.5) / 0.25 / 10)
    idle, _ = run(params, [act(E.FLAT)])
    plain = np.asarray(E.observe(params, idle))[0]
    assert plain[slot["position"]] == 0.0 and plain[slot["order_size"]] == 0.0
    assert not np.array_equal(obs, plain)
    # Bar 2 trades through 99.75: filled, nothing working any more.
    filled, out = run(params, [act(E.LONG, o=E.LIMIT_TOUCH, u=1), act(E.HOLD)])
    assert out[1][2]["filled"]
    after = np.asarray(E.observe(params, filled))[0]
    assert after[slot["position"]] == 1.0
    for k in ("order_size", "order_bars_left", "order_distance"):
        assert after[slot[k]] == 0.0
    # A sell limit shows a negative quantity and a price above the close; a far price clips.
    short, _ = run(make(spread_ticks=40), [act(E.SHORT, o=E.LIMIT_TOUCH, u=2)])
    s = np.asarray(E.observe(make(spread_ticks=40), short))[0]
    assert s[slot["order_size"]] == -1.0 and s[slot["order_distance"]] == 1.0


def test_sell_limit_fills_when_high_trades_through():
    _, out = run(make(spread_ticks=2), [act(E.SHORT, o=E.LIMIT_TOUCH)])
    i = out[0][2]
    assert i["filled"] and i["fill_price"] == 100.25 and i["position"] == -1
    assert i["gross_pnl"] == MULT * -(101.5 - 100.25)


def test_new_order_cancels_pending_limit():
    _, out = run(make(spread_ticks=2), [act(E.LONG, o=E.LIMIT_TOUCH, u=2), act(E.FLAT)])
    assert not out[1][2]["filled"] and out[1][2]["position"] == 0  # bar 2 would have filled it


# ------------------------------------------------------------------ flips and churn


def test_flip_and_churn_penalty_at_age_zero():
    params = make(commission=2.0, churn_penalty=0.01, churn_window=4)
    _, out = run(params, [act(E.LONG), act(E.SHORT)])
    r, _, i = out[1]
    assert i["fill_qty"] == -2 and i["position"] == -1
    assert i["gross_pnl"] == MULT * (1 * (100 - 101.5) + (-2) * (100 - 101.5))
    assert i["churn_penalty"] == pytest.approx(0.01)
    assert r == pytest.approx((15 - 4) / E0 - 0.01, rel=1e-5)
    # Exact split of the flip bar: the closing leg gets its mark (0) and one commission.
    assert i["trade_closed"] and i["closed_trade_pnl"] == pytest.approx(3.0 - 2.0)


def test_churn_penalty_is_graduated_and_zero_beyond_window():
    def penalty(holds: int) -> float:
        acts = [act(E.LONG)] + [act(E.HOLD)] * holds + [act(E.SHORT)]
        return float(run(make(churn_penalty=0.01, churn_window=4), acts)[1][-1][2]
                     ["churn_penalty"])

    assert penalty(0) == pytest.approx(0.01)
    assert penalty(2) == pytest.approx(0.005)
    assert penalty(4) == 0.0 and penalty(5) == 0.0


def test_closing_to_flat_is_not_churn():
    _, out = run(make(churn_penalty=0.01), [act(E.LONG), act(E.FLAT)])
    assert out[1][2]["churn_penalty"] == 0 and out[1][2]["trade_closed"]


# ------------------------------------------------------------------ episode end


def test_forced_liquidation_on_last_step_with_costs():
    params = make(commission=2.0, spread_ticks=2)
    state, out = run(params, [act(E.LONG), act(E.HOLD), act(E.LONG)], last=2)
    assert [o[1] for o in out] == [False, False, True]
    i = out[2][2]
    assert i["position"] == 0 and i["fill_qty"] == -1 and i["fill_price"] == 100 - 0.25
    assert i["commission"] == 2.0 and i["spread_cost"] == MULT * 0.25
    assert int(state.t[0]) == 3


def test_forced_liquidation_cancels_pending_limit():
    state, out = run(make(spread_ticks=2), [act(E.LONG, o=E.LIMIT_TOUCH, u=2)], last=0)
    assert out[0][1] and out[0][2]["position"] == 0 and int(state.pend_left[0]) == 0


def test_reward_is_equity_relative_net_pnl_and_opportunity_cost_only_in_training():
    aux = E.PolicyAux(q_gap=jnp.array([2.0]), q_var=jnp.array([0.0]))
    _, out = run(make(opportunity_cost=0.1), [act(E.FLAT)], aux=aux)
    assert out[0][0] == pytest.approx(-0.2)
    _, out = run(make(training=False, opportunity_cost=0.1), [act(E.FLAT)], aux=aux)
    assert out[0][0] == 0.0


# ------------------------------------------------------------------ sizing chain


def test_sizing_with_every_factor_at_its_floor_keeps_min_share():
    sizing = SizingConfig(kelly_min_trades=20, cvar_limit=1e-9, min_share=0.1)
    cfg = dataclasses.replace(EnvConfig(), sizing=sizing)
    n = jnp.array([20])
    scale, f = E.sizing_factors(cfg.sizing, jnp.array([0.0]), jnp.array([1e6]), n,
                                jnp.array([0]), jnp.array([0.0]), jnp.array([500.0]),
                                jnp.array([1.0]))
    for name in E.FACTOR_NAMES:  # every factor sits at its floor
        floor = {"conviction": sizing.conviction_floor, "variance": sizing.conviction_floor,
                 "kelly": sizing.kelly_floor, "cvar": sizing.cvar_floor}[name]
        assert float(f[name][0]) == pytest.approx(floor)
    assert float(scale[0]) >= sizing.min_share - 1e-7
    # Through the env: realised target ≥ min_share × intended.
    params = make(sizing=sizing)
    state = E.reset_at(params, jnp.array([0]), jnp.array([8])).replace(
        n_trades=jnp.array([20]), n_wins=jnp.array([0]), sum_loss=jnp.array([500.0]))
    _, _, _, info = E.step(params, state, act(E.LONG), E.PolicyAux(jnp.array([0.0]),
                                                                   jnp.array([1e6])))
    intended, target = float(info["intended_position"][0]), float(info["target_position"][0])
    assert intended == 1.0 and target >= sizing.min_share * intended - 1e-7


def test_sizing_factors_values():
    s = SizingConfig()
    args = (jnp.array([0.5]), jnp.array([0.0]))
    scale, f = E.sizing_factors(s, *args, jnp.array([0]), jnp.array([0]), jnp.array([0.0]),
                                jnp.array([0.0]), jnp.array([0.0]))
    assert float(f["conviction"][0]) == 0.5 and float(scale[0]) == 0.5
    # Kelly after 20 trades with p = 0.75, payoff 2: f = 0.75 − 0.25 / 2 = 0.625.
    _, f = E.sizing_factors(s, *args, jnp.array([20]), jnp.array([15]), jnp.array([30.0]),
                            jnp.array([5.0]), jnp.array([0.0]))
    assert float(f["kelly"][0]) == pytest.approx(0.625)
    _, f = E.sizing_factors(s, *args, jnp.array([19]), jnp.array([0]), jnp.array([0.0]),
                            jnp.array([9.0]), jnp.array([0.0]))
    assert float(f["kelly"][0]) == 1.0  # not enough trades yet
    # Variance scale floored by conviction.
    _, f = E.sizing_factors(s, jnp.array([0.8]), jnp.array([99.0]), *(jnp.array([0]),) * 2,
                            jnp.array([0.0]), jnp.array([0.0]), jnp.array([0.0]))
    assert float(f["variance"][0]) == pytest.approx(0.8)


def test_sizing_reports_intended_and_realised_position():
    params = make(sizing=SizingConfig(variance=False, kelly=False, cvar=False))
    aux = E.PolicyAux(q_gap=jnp.array([0.5]), q_var=jnp.array([0.0]))
    _, out = run(params, [act(E.LONG)], aux=aux)
    i = out[0][2]
    assert i["intended_position"] == 1.0 and i["position"] == 0.5 and i["size_scale"] == 0.5


def test_lot_size_cuts_sized_targets_to_whole_lots_toward_zero():
    # max_position 3: half = 1.5 contracts → 1 with whole contracts; quarter = 0.75 → none.
    _, out_c = run(make(max_position=3.0), [act(E.LONG, m=1)])
    assert out_c[0][2]["position"] == 1.5
    _, out = run(make(max_position=3.0, lot_size=1.0), [act(E.LONG, m=1), act(E.SHORT, m=1)])
    assert out[0][2]["position"] == 1.0 and out[1][2]["position"] == -1.0
    assert out[0][2]["intended_position"] == 1.5  # the unsized intent is reported unchanged
    _, out = run(make(max_position=3.0, lot_size=1.0), [act(E.LONG, m=0)])
    assert out[0][2]["position"] == 0.0 and not out[0][2]["filled"]
    _, out = run(make(max_position=3.0, lot_size=1.0), [act(E.LONG, m=2)])
    assert out[0][2]["position"] == 3.0  # a whole number of lots stays whole
    # Held long 3 lots, a long order that sizes under one lot places no order: the position
    # stays (it used to be read as a target of 0 and close the position).
    _, out = run(make(max_position=3.0, lot_size=1.0), [act(E.LONG, m=2), act(E.LONG, m=0)])
    assert out[1][2]["position"] == 3.0 and not out[1][2]["filled"]
    _, out = run(make(max_position=3.0, lot_size=1.0), [act(E.LONG, m=2), act(E.FLAT)])
    assert out[1][2]["position"] == 0.0  # flat is an order for 0, lots or not
    # A sized target that is one lot but lands a hair below it in float32 (41 × f32(1/41) =
    # 0.99999994) keeps that lot.
    params = make(max_position=41.0, lot_size=1.0,
                  sizing=SizingConfig(conviction=True, variance=False, kelly=False, cvar=False,
                                      conviction_scale=41.0, conviction_floor=0.01,
                                      min_share=0.01))
    aux = E.PolicyAux(q_gap=jnp.array([1.0]), q_var=jnp.array([0.0]))
    _, out = run(params, [act(E.LONG)], aux=aux)
    assert out[0][2]["size_scale"] == pytest.approx(1 / 41) and out[0][2]["position"] == 1.0


# ------------------------------------------------------------------ observation, reset, vmap


def test_observation_layout_and_obs_from_index():
    params = make()
    state, _ = run(params, [act(E.LONG), act(E.HOLD)])
    obs = np.asarray(E.observe(params, state))
    assert obs.shape == (1, 12)
    np.testing.assert_array_equal(obs[0, :2], np.asarray(params.features[2]))
    assert obs[0, 2] == 1.0 and obs[0, 5] == 1.0  # position, last direction
    assert obs[0, 4] == pytest.approx(np.log1p(1) / np.log1p(1000))
    np.testing.assert_array_equal(obs[0, 6:], 0)  # no live order (its slots), padding
    rebuilt = E.obs_from_index(params, state.t, E.portfolio(params, state))
    np.testing.assert_array_equal(np.asarray(rebuilt), obs)


def test_reset_windows_stay_inside_bounds_over_whole_episodes():
    rng = np.random.default_rng(0)
    t_len = 300
    c = 1000 + np.round(np.cumsum(rng.normal(0, 1, t_len)) * 4) / 4
    o = np.r_[c[0], c[:-1]]
    cfg = EnvConfig(n_envs=512, episode_length=20)
    params = E.make_params(rng.normal(size=(t_len, 3)), o, np.maximum(o, c) + 0.25,
                           np.minimum(o, c) - 0.25, c, cfg, state_width=16)
    params = E.with_window(params, 100, 150, min_len=cfg.episode_length + 1)

    @jax.jit
    def episode(key):
        state = E.reset(params, key)

        def body(s, k):
            a = jax.random.randint(k, (cfg.n_envs, 4), 0, jnp.array(E.BRANCH_SIZES))
            s2, _, d, info = E.step(params, s, a, E.PolicyAux.zeros(cfg.n_envs))
            return s2, (s.t, info["bar"], d)

        return jax.lax.scan(body, state, jax.random.split(key, cfg.episode_length))

    state, (t, bar, done) = episode(jax.random.key(0))
    assert int(t.min()) >= 100 and int(bar.max()) <= 149
    assert bool(done[-1].all()) and not bool(done[:-1].any())
    assert float(jnp.abs(state.position).max()) == 0.0  # liquidated
    assert len(np.unique(np.asarray(t[0]))) > 10  # starts differ across episodes


def test_episodes_in_a_window_shorter_than_an_episode_end_early_never_filling_stale():
    """A training window of fewer than L + 1 bars (public API; the trainer never makes one):
    the episodes end with their decision at bar hi − 2 filled in bar hi − 1, instead of
    stepping on at the clamped last bar, where an order decided at its close filled at its
    open — a price from before the decision."""
    params = E.with_window(make(episode_length=100), 2, 6)
    state = E.reset(params, jax.random.key(0))
    assert int(state.t[0]) == 2 and int(state.last[0]) == 4
    bars, done = [], []
    for _ in range(3):
        state, _, d, info = E.step(params, state, act(E.LONG), E.PolicyAux.zeros(1))
        bars.append(int(info["bar"][0]))
        done.append(bool(d[0]))
    assert bars == [3, 4, 5] and done == [False, False, True]
    assert float(info["position"][0]) == 0.0  # liquidated at bar 5's open, inside the window


def test_auto_reset_replaces_only_done_episodes_and_restarts_their_kelly_stats():
    params = make(n_envs=2)
    state = E.reset_at(params, jnp.array([3, 3]), jnp.array([5, 5])).replace(
        n_trades=jnp.array([7, 7]), n_wins=jnp.array([4, 4]),
        sum_win=jnp.array([2.0, 2.0]), sum_loss=jnp.array([1.0, 1.0]),
        position=jnp.array([1.0, 1.0]))
    new = E.auto_reset(params, state, jnp.array([True, False]), jax.random.key(1))
    assert float(new.position[0]) == 0 and int(new.n_trades[0]) == 0
    assert int(new.n_wins[0]) == 0 and float(new.sum_win[0]) == 0 == float(new.sum_loss[0])
    assert float(new.position[1]) == 1 and int(new.t[1]) == 3
    assert int(new.n_trades[1]) == 7 and float(new.sum_win[1]) == 2.0  # running: untouched
    assert int(new.last[0]) == int(new.t[0]) + 3


def test_step_is_vmappable_and_jittable():
    params = make(n_envs=1)
    state = E.reset_at(params, jnp.array([0]), jnp.array([8]))
    states = jax.tree.map(lambda x: jnp.stack([x, x]), state)
    actions = jnp.stack([act(E.LONG), act(E.SHORT)])
    aux = jax.tree.map(lambda x: jnp.stack([x, x]), E.PolicyAux.zeros(1))
    out = jax.jit(jax.vmap(E.step, in_axes=(None, 0, 0, 0)))(params, states, actions, aux)
    assert np.asarray(out[0].position).ravel().tolist() == [1.0, -1.0]


# ------------------------------------------------------------------ reward normalisation


def test_robust_normaliser_first_batch_and_floor():
    ns = E.init_norm_state(EnvConfig())
    r = jnp.array([0.0, 1.0, 2.0, 3.0, 4.0]) * 1e-3
    ns, rn = E.normalise_reward(ns, r)
    np.testing.assert_allclose(np.asarray(rn), [-1.0, -0.5, 0.0, 0.5, 1.0], atol=1e-5)
    ns2, rn2 = E.normalise_reward(E.init_norm_state(EnvConfig()), jnp.zeros(8))
    assert np.isfinite(np.asarray(rn2)).all() and float(ns2.count) == 1
    # Statistics carry: a second batch moves them only by the running-average weight.
    ns, _ = E.normalise_reward(ns, r + 1.0)
    assert float(ns.count) == 2 and float(ns.center) == pytest.approx((2e-3 + 1.002) / 2)


@pytest.mark.parametrize("squash", [False, True])
def test_rank_selected_quantiles_are_jnps(squash):
    """Off the CPU the normaliser's quartiles select order statistics by rank instead of
    sorting: the same element jnp's stable sort puts at each position, bit for bit (ties, −0
    before or after +0 in input order, ±inf, NaNs sorting last or poisoning), and jnp's
    interpolation of them (to one rounding: XLA may contract its multiply-add)."""
    from jdqn.env.normalise import quantiles_by_rank

    rng = np.random.default_rng(0)
    cases = []
    for n in (1, 2, 5, 100, 4097):
        v = rng.normal(size=n).astype(np.float32)
        ties = np.round(v * 2) / 2  # many equal values, -0.0 among them
        zeros = v.copy()
        zeros[::3], zeros[1::3] = 0.0, -0.0
        infs = v.copy()
        infs[::5], infs[2::7] = np.inf, -np.inf
        nans = v.copy()
        nans[::4] = np.nan
        cases += [v, ties, zeros, infs, nans, np.full(n, np.nan, np.float32)]
    ref = jnp.nanquantile if squash else jnp.quantile
    by_rank = jax.jit(quantiles_by_rank, static_argnums=(1, 2))
    for x in cases:
        counted = int(np.sum(~np.isnan(x))) if squash else x.shape[0]
        # positions that are whole numbers: the result is an order statistic itself (weights
        # 0 and 1), bit for bit; (an inf · 0 weight is NaN in both)
        exact = (0.0, 0.25, 0.5, 0.75, 1.0) if (counted - 1) % 4 == 0 else (0.0, 1.0)
        want = np.asarray(ref(jnp.asarray(x), jnp.asarray(exact)))
        got = np.asarray(jnp.stack(by_rank(jnp.asarray(x), exact, squash)))
        assert np.array_equal(want.view(np.int32), got.view(np.int32)), (x, exact, want, got)
        want = np.asarray(ref(jnp.asarray(x), jnp.asarray([0.25, 0.5, 0.75])))
        got = np.asarray(jnp.stack(by_rank(jnp.asarray(x), (0.25, 0.5, 0.75), squash)))
        np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)
    with pytest.raises(ValueError, match="1-D float32"):
        quantiles_by_rank(jnp.zeros((2, 2)), (0.5,))


def test_quartiles_sort_on_the_cpu_and_select_by_rank_elsewhere():
    """The rank selection's ``[n, n]`` count is slower than a sort on the CPU (and
    materialised there), so the CPU program sorts and a GPU program does not: checked on the
    programs lowered for each platform (no GPU needed). Under x64 the result keeps its shape."""
    from jdqn.env.normalise import quantiles, quantiles_by_rank

    spec = jax.ShapeDtypeStruct((4096,), jnp.float32)
    for squash in (False, True):
        f = jax.jit(lambda v, s=squash: quantiles(v, (0.25, 0.5, 0.75), s))
        for platform, sorts in (("cpu", True), ("cuda", False)):
            text = jax.export.export(f, platforms=[platform])(spec).mlir_module()
            assert ("stablehlo.sort" in text) is sorts, (platform, squash)
    x = jnp.arange(9.0, dtype=jnp.float32)
    np.testing.assert_array_equal(jnp.stack(quantiles(x, (0.25, 0.5))), [2.0, 4.0])
    with x64():
        got = quantiles_by_rank(jnp.arange(9.0, dtype=jnp.float32), (0.25, 0.5))
        assert [g.shape for g in got] == [(), ()]
        np.testing.assert_array_equal(jnp.stack(got), [2.0, 4.0])


def test_zscore_and_none_modes():
    ns = E.init_norm_state(EnvConfig(reward_norm="zscore"))
    _, rn = E.normalise_reward(ns, jnp.array([1.0, 3.0]))
    np.testing.assert_allclose(np.asarray(rn), [-1.0, 1.0], atol=1e-6)
    ns = E.init_norm_state(EnvConfig(reward_norm="none"))
    _, rn = E.normalise_reward(ns, jnp.array([1.0, 3.0]))
    np.testing.assert_array_equal(np.asarray(rn), [1.0, 3.0])


@pytest.mark.parametrize("mode", ["robust", "zscore"])
def test_a_mask_restricts_the_normaliser_statistics(mode):
    rng = np.random.default_rng(0)
    r = jnp.asarray(rng.normal(size=64).astype(np.float32))
    mask = jnp.asarray(rng.random(64) < 0.7)
    ns0 = E.init_norm_state(EnvConfig(reward_norm=mode))
    ns0, _ = E.normalise_reward(ns0, r * 2.0 + 1.0)  # non-trivial running statistics
    masked, rn = E.normalise_reward(ns0, r, mask)
    subset, _ = E.normalise_reward(ns0, r[np.asarray(mask)])
    for name in ("center", "scale", "count"):  # = the update on the marked rewards alone
        np.testing.assert_allclose(float(getattr(masked, name)), float(getattr(subset, name)),
                                   rtol=1e-6, err_msg=name)
    unmasked, _ = E.normalise_reward(ns0, r)
    assert float(unmasked.center) != float(masked.center)
    # every reward is still normalised, with the new statistics
    denom = (max(float(masked.scale), ns0.floor) if mode == "robust" else
             max(np.sqrt(max(float(masked.scale) - float(masked.center) ** 2, 0.0)), ns0.floor))
    np.testing.assert_allclose(np.asarray(rn), (np.asarray(r) - float(masked.center)) / denom,
                               rtol=1e-5, atol=1e-6)
    # nothing marked: statistics and count unchanged; all marked: the unmasked update
    none, rn0 = E.normalise_reward(ns0, r, jnp.zeros(64, bool))
    for name in ("center", "scale", "count"):
        assert float(getattr(none, name)) == float(getattr(ns0, name)), name
    assert np.isfinite(np.asarray(rn0)).all()
    every, _ = E.normalise_reward(ns0, r, jnp.ones(64, bool))
    for name in ("center", "scale", "count"):
        np.testing.assert_allclose(float(getattr(every, name)), float(getattr(unmasked, name)),
                                   rtol=1e-6, err_msg=name)
    with pytest.raises(ValueError, match="mask shape"):
        E.normalise_reward(ns0, r, jnp.ones(63, bool))
    # a NaN reward poisons the statistics if marked (as without a mask), not if unmarked
    nan_r = r.at[3].set(jnp.nan)
    for marked in (True, False):
        m = mask.at[3].set(marked)
        ns_nan, _ = E.normalise_reward(ns0, nan_r, m)
        assert np.isnan(float(ns_nan.center)) == marked, marked


# ------------------------------------------------------------------ bad input


def test_nan_or_bad_prices_are_rejected_before_jit():
    c = np.array(C, float)
    c[4] = np.nan
    with pytest.raises(E.EnvInputError, match="close .*bar 4"):
        E.make_params(np.zeros((10, 2)), O, H, L, c, EnvConfig())
    with pytest.raises(E.EnvInputError, match="not positive"):
        E.make_params(np.zeros((10, 2)), np.array(O) * 0, H, L, C, EnvConfig())
    with pytest.raises(E.EnvInputError, match="inconsistent bar"):
        E.make_params(np.zeros((10, 2)), O, L, H, C, EnvConfig())
    f = np.zeros((10, 2))
    f[3, 1] = np.nan
    with pytest.raises(E.EnvInputError, match="features .*bar 3"):
        E.make_params(f, O, H, L, C, EnvConfig())


def test_validate_actions_names_the_problem():
    with pytest.raises(E.EnvInputError, match="direction action 4 out of range"):
        E.validate_actions(np.array([[4, 0, 0, 0]]))
    with pytest.raises(E.EnvInputError, match="urgency action -1"):
        E.validate_actions(np.array([[0, 0, 0, -1]]))
    with pytest.raises(E.EnvInputError, match="NaN"):
        E.validate_actions(np.array([[0.0, np.nan, 0.0, 0.0]]))
    with pytest.raises(E.EnvInputError, match="shape"):
        E.validate_actions(np.array([[0, 0, 0]]))
    with pytest.raises(E.EnvInputError, match="aux.q_var"):
        E.validate_actions(np.array([[0, 0, 0, 0]]), E.PolicyAux(np.array([0.0]),
                                                                 np.array([np.nan])))
    E.validate_actions(np.array([[3, 2, 2, 2]]), E.PolicyAux(np.zeros(1), np.zeros(1)))
