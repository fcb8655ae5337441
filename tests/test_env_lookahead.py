"""No lookahead: nothing observed or decided at bar t may depend on bars > t."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_bars

from jdqn import env as E
from jdqn.config import EnvConfig, SizingConfig
from jdqn.evaluate import rollout

T, F, W, CUT = 120, 3, 16, 60


def bars(seed: int = 0):
    return random_bars(T, F, seed, start=2000.0, step_sd=1.5, open_sd=0.5, max_wick_ticks=3)


def perturbed_after(t: int, seed: int = 0):
    """Same bars up to and including ``t``; every input (features, OHLC) changed after ``t``."""
    feats, o, h, lo, c = (np.array(a, copy=True) for a in bars(seed))
    rng = np.random.default_rng(99)
    shift = np.round(rng.normal(0, 5, T - t - 1) * 4) / 4
    o[t + 1:] += shift + 3
    c[t + 1:] += shift - 2
    h[t + 1:] = np.maximum(h[t + 1:] + shift + 5, np.maximum(o[t + 1:], c[t + 1:]))
    lo[t + 1:] = np.minimum(lo[t + 1:] + shift - 5, np.minimum(o[t + 1:], c[t + 1:]))
    feats[t + 1:] = rng.normal(size=(T - t - 1, F))
    return feats, o, h, lo, c


# cvar_limit low enough that the CVaR sizing factor is active (it reads a per-bar risk series).
CFG = EnvConfig(n_envs=4, episode_length=100, spread_ticks=1, commission=1.0, holding_cost=0.1,
                sizing=SizingConfig(cvar_limit=4e-4, cvar_window=10))


def obs_policy(obs):
    """A deterministic policy of the observation only (so actions inherit any leak)."""
    z = obs @ jnp.linspace(-1.0, 1.0, W * 4).reshape(W, 4)
    action = jnp.stack([jnp.argmax(z, -1), jnp.abs(z[:, 1] * 7).astype(jnp.int32) % 3,
                        jnp.abs(z[:, 2] * 5).astype(jnp.int32) % 3,
                        jnp.abs(z[:, 3] * 3).astype(jnp.int32) % 3], -1).astype(jnp.int32)
    return action, E.PolicyAux(q_gap=jnp.abs(z[:, 0]), q_var=z[:, 1] ** 2)


def trajectory(arrays):
    params = E.make_params(*arrays, CFG, state_width=W)
    state = E.reset_at(params, jnp.array([5, 10, 20, 40]), jnp.array([110] * 4))
    obs_seq, info_seq, t_seq = [], [], []
    for _ in range(CUT):
        obs = E.observe(params, state)
        action, aux = obs_policy(obs)
        t_seq.append(np.asarray(state.t))
        obs_seq.append(np.asarray(obs))
        state, reward, done, info = E.step(params, state, action, aux)
        info_seq.append({**{k: np.asarray(v) for k, v in info.items()},
                         "reward": np.asarray(reward), "done": np.asarray(done)})
    return np.array(t_seq), np.array(obs_seq), info_seq


def test_perturbing_bars_after_t_changes_nothing_observed_at_or_before_t():
    t_a, obs_a, info_a = trajectory(bars())
    t_b, obs_b, info_b = trajectory(perturbed_after(CUT))
    np.testing.assert_array_equal(t_a, t_b)
    seen = t_a <= CUT  # [steps, N]: observation taken at a bar ≤ CUT
    np.testing.assert_array_equal(obs_a[seen], obs_b[seen])
    for s in range(len(info_a)):
        decided_by_cut = t_a[s] <= CUT  # the decision (incl. its size) is made at bar t ≤ CUT
        for k in ("size_scale", "target_position", "intended_position", "done"):
            np.testing.assert_array_equal(info_a[s][k][decided_by_cut],
                                          info_b[s][k][decided_by_cut], err_msg=k)
        filled_by_cut = info_a[s]["bar"] <= CUT  # executions within bars ≤ CUT
        # the reward too: a leak confined to reward shaping would reach the learner
        for k in ("position", "net_pnl", "fill_price", "intended_position", "reward"):
            np.testing.assert_array_equal(info_a[s][k][filled_by_cut], info_b[s][k][filled_by_cut])
    # …and the perturbation is real: something after CUT does change.
    assert not np.array_equal(obs_a[~seen], obs_b[~seen])


def test_bar_t_plus_1_only_changes_fills_at_t_plus_1_never_obs_at_t():
    base = bars()
    params = E.make_params(*base, CFG, state_width=W)
    state = E.reset_at(params, jnp.full((4,), CUT), jnp.full((4,), 110))
    action = jnp.array([[2, 2, 0, 0], [0, 2, 1, 2], [2, 1, 2, 2], [3, 0, 0, 0]], jnp.int32)
    aux = E.PolicyAux.zeros(4)
    obs_a = E.observe(params, state)
    _, _, _, info_a = E.step(params, state, action, aux)
    feats, o, h, lo, c = (np.array(a, copy=True) for a in base)
    o[CUT + 1] -= 3
    h[CUT + 1] += 4
    lo[CUT + 1] -= 6
    c[CUT + 1] -= 1
    feats[CUT + 1] += 10
    params_b = E.make_params(feats, o, h, lo, c, CFG, state_width=W)
    obs_b = E.observe(params_b, state)
    _, _, _, info_b = E.step(params_b, state, action, aux)
    np.testing.assert_array_equal(np.asarray(obs_a), np.asarray(obs_b))
    assert not np.array_equal(np.asarray(info_a["fill_price"]), np.asarray(info_b["fill_price"]))


def test_a_working_limit_order_in_the_observation_reads_no_later_bar():
    """The order slots (size, bars left, price against the close) at bar t: with limit orders
    still working at CUT, moving every price and feature of bar CUT + 1 changes nothing in the
    observation at CUT (it did when the distance slot read bar t + 1's close)."""
    from jdqn.data.layout import PORTFOLIO_SLOTS

    base = bars()
    params = E.make_params(*base, CFG, state_width=W)
    start = E.reset_at(params, jnp.full((4,), CUT - 1), jnp.full((4,), 110))
    # Buy and sell limits, passive, urgency 2 (10 bars): most do not fill during bar CUT.
    orders = jnp.array([[2, 2, 2, 2], [0, 2, 2, 2], [2, 1, 1, 2], [0, 0, 2, 2]], jnp.int32)
    state, _, _, _ = E.step(params, start, orders, E.PolicyAux.zeros(4))
    assert int(state.t[0]) == CUT
    obs_a = np.asarray(E.observe(params, state))
    size = obs_a[:, F + PORTFOLIO_SLOTS.index("order_size")]
    assert np.any(size != 0), "no order left working at CUT: the test would check nothing"
    feats, o, h, lo, c = (np.array(a, copy=True) for a in base)
    o[CUT + 1:] -= 3
    h[CUT + 1:] += 4
    lo[CUT + 1:] -= 6
    c[CUT + 1:] += 2  # bar CUT + 1's close moves 8 ticks, inside the distance slot's ±10 clip
    feats[CUT + 1:] += 10
    obs_b = np.asarray(E.observe(E.make_params(feats, o, h, lo, c, CFG, state_width=W), state))
    np.testing.assert_array_equal(obs_a, obs_b)


def test_cvar_risk_input_is_causal():
    _, _, _, _, c = bars()
    _, _, _, _, c2 = perturbed_after(CUT)
    a = E.cvar_series(c, CFG.sizing, 1.0, 50.0, 250_000.0)
    b = E.cvar_series(c2, CFG.sizing, 1.0, 50.0, 250_000.0)
    np.testing.assert_array_equal(a[:CUT + 1], b[:CUT + 1])
    assert not np.array_equal(a[CUT + 1:], b[CUT + 1:])


@pytest.mark.parametrize("stride,n_windows", [(1, 1), (3, 1), (1, 4), (2, 2)])
def test_backtest_actions_and_returns_up_to_t_ignore_later_bars(stride, n_windows):
    """Also strided (decisions every k bars on k-bar returns: its own code path, which
    aggregates bars) and split into parallel windows (each window's first decision at its
    start, run side by side): nothing up to the cut reads a later bar."""
    pa = E.make_params(*bars(), CFG, state_width=W)
    pb = E.make_params(*perturbed_after(CUT), CFG, state_width=W)
    ra = rollout(pa, obs_policy, lo=10, hi=T, stride=stride, n_windows=n_windows)
    rb = rollout(pb, obs_policy, lo=10, hi=T, stride=stride, n_windows=n_windows)
    upto = ra.bar <= CUT
    assert upto.sum() >= 5 and (~upto).sum() >= 5
    np.testing.assert_array_equal(ra.bar, rb.bar)
    for k in ("actions", "returns", "position", "size_scale", "target_position"):
        np.testing.assert_array_equal(getattr(ra, k)[upto], getattr(rb, k)[upto], err_msg=k)
    assert not np.array_equal(ra.returns[~upto], rb.returns[~upto])


def test_reset_never_reads_outside_window_even_when_not_reset():
    params = E.make_params(*bars(), CFG, lo=20, hi=30, state_width=W)
    state = E.reset_at(params, jnp.full((4,), 27), jnp.full((4,), 28))
    step = jax.jit(E.step)
    for _ in range(6):  # keep stepping past `last` without a reset
        state, _, _, info = step(params, state, jnp.full((4, 4), 2, jnp.int32),
                                    E.PolicyAux.zeros(4))
        assert int(info["bar"].max()) <= 29


def test_decisions_across_auto_resets_ignore_later_bars():
    """Training episodes auto-reset to random starts, often before bars an earlier episode
    traded at. Nothing an episode carries over may let a decision at bar t depend on bars > t:
    with the Kelly factor active after 2 trades (and a floor of 0.01, so it moves sizes), every
    size and position decided at a bar ≤ CUT is bitwise the same when all bars after CUT change.
    """
    cfg = EnvConfig(n_envs=8, episode_length=12, spread_ticks=1, commission=1.0,
                    sizing=SizingConfig(kelly_min_trades=2, kelly_floor=0.01))

    def run(arrays):
        params = E.make_params(*arrays, cfg, state_width=W)
        state = E.reset(params, jax.random.key(3))
        rows = []
        for i in range(60):
            obs = E.observe(params, state)
            action, aux = obs_policy(obs)
            t = np.asarray(state.t)
            state, _, done, info = E.step(params, state, action, aux)
            rows.append((t, {k: np.asarray(info[k]) for k in
                             ("size_scale", "size_kelly", "target_position", "position")}))
            state = E.auto_reset(params, state, done, jax.random.key(100 + i))
        return rows

    a, b = run(bars()), run(perturbed_after(CUT))
    resets_to_earlier = 0
    for (t_a, ia), (t_b, ib) in zip(a, b, strict=True):
        np.testing.assert_array_equal(t_a, t_b)  # starts come from the key, not the data
        early = t_a <= CUT - 1  # decided and (next-open) filled by CUT
        for k in ia:
            np.testing.assert_array_equal(ia[k][early], ib[k][early], err_msg=k)
    for (t0, _), (t1, _) in itertools.pairwise(a):
        resets_to_earlier += int(np.sum((t0 > CUT) & (t1 <= CUT - 1)))
    assert resets_to_earlier > 0  # the scenario that leaked really happens
    assert any(np.any(i["size_kelly"] < 1.0) for _, i in a)  # and the Kelly factor is active
