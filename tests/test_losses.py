"""Specification tests for jdqn.losses: projection, double-Q C51, warm-up blend, IQN, MoE."""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_eqns, x64
from jax.test_util import check_grads

from jdqn.config import ModelConfig, TrainConfig
from jdqn.losses import (
    Batch,
    branching_td_loss,
    categorical_double_q_loss,
    categorical_l2_project,
    categorical_target,
    cross_entropy,
    entropy_target,
    init_moe_state,
    iqn_double_q_loss,
    lambda_eff,
    load_balance_loss,
    quantile_huber_loss,
    total_loss,
    update_moe_state,
    warmup_alpha,
    warmup_blend_loss,
)
from jdqn.losses.total import next_state_forwards
from jdqn.networks import BranchingQNetwork, init_params_batched, make_support
from jdqn.networks.model import iqn_quantiles

W = 12
FLOW = (1, 2)
SMALL = ModelConfig(width=16, n_grn_blocks=1, n_experts=3, expert_hidden=8, gate_hidden=8,
                    head_hidden=8, n_atoms=11, v_min=-5.0, v_max=5.0, iqn_embed=4, iqn_n=3,
                    iqn_n_prime=5)
TRAIN = TrainConfig()
NET = BranchingQNetwork(SMALL, FLOW)  # equal to the one in test_networks.py: init compiles once
B = 16
LOSS = jax.jit(functools.partial(total_loss, net=NET, train_cfg=TRAIN))
LOSS_CE = jax.jit(functools.partial(total_loss, net=NET, train_cfg=dataclasses.replace(
    TRAIN, per_priority="cross_entropy")))


@pytest.fixture(scope="module")
def seed_params():
    return init_params_batched(NET, jax.random.split(jax.random.key(0), 3), W)


@pytest.fixture(scope="module")
def online(seed_params):
    return jax.tree.map(lambda x: x[0], seed_params)


@pytest.fixture(scope="module")
def target(seed_params):
    return jax.tree.map(lambda x: x[1], seed_params)




# ------------------------------------------------------------------------------------------
# categorical projection
# ------------------------------------------------------------------------------------------


def textbook_projection(tz, probs, v_min, v_max):
    """Bellemare, Dabney & Munos 2017, Algorithm 1, written literally (float64 loops) for the
    target atoms ``tz[j] = r + γ z_j``, with the usual fix for ``b_j`` landing exactly on an atom
    (l = u), where Alg. 1 as printed drops that mass."""
    n = len(tz)
    dz = (v_max - v_min) / (n - 1)
    m = np.zeros(n)
    for j in range(n):
        b = (min(max(tz[j], v_min), v_max) - v_min) / dz
        lo, up = int(np.floor(b)), int(np.ceil(b))
        if lo == up:
            m[lo] += probs[j]
        else:
            m[lo] += probs[j] * (up - b)
            m[up] += probs[j] * (b - lo)
    return m


@pytest.mark.parametrize("case", ["random", "far_outside", "done", "gamma_zero", "on_atoms"])
def test_projection_equals_textbook_algorithm(case):
    rng = np.random.default_rng({"random": 0, "far_outside": 1, "done": 2, "gamma_zero": 3,
                                 "on_atoms": 4}[case])
    v_min, v_max, n = -10.0, 10.0, 51
    z = np.linspace(v_min, v_max, n)
    for _ in range(10):
        probs = rng.dirichlet(np.ones(n) * 0.3)
        r = rng.normal(0, 6.0)
        discount = rng.uniform(0.5, 1.0)
        if case == "far_outside":
            r = rng.choice([-1.0, 1.0]) * rng.uniform(8.0, 100.0)  # most of Tz outside
            discount = rng.uniform(0.9, 1.5)
        elif case == "done":
            discount = 0.0  # γⁿ(1 − done) with done = 1
        elif case == "gamma_zero":
            discount, r = 0.0, rng.uniform(-20.0, 20.0)
        elif case == "on_atoms":
            r, discount = 0.4 * rng.integers(-5, 6), 1.0  # every Tz exactly on an atom
        tz = r + discount * z
        want = textbook_projection(tz, probs, v_min, v_max)
        with x64():  # exact comparison in float64
            got64 = categorical_l2_project(jnp.asarray(tz), jnp.asarray(probs), jnp.asarray(z))
            np.testing.assert_allclose(got64, want, atol=1e-12)
        # float32 (what training runs): same result to float32 rounding, mass conserved
        tz32, p32 = np.float32(tz), np.float32(probs)
        got = np.asarray(categorical_l2_project(jnp.asarray(tz32), jnp.asarray(p32),
                                                make_support(v_min, v_max, n)))
        np.testing.assert_allclose(got, textbook_projection(np.float64(tz32), p32, v_min, v_max),
                                   atol=1e-5)
        assert abs(got.sum() - p32.sum(dtype=np.float64)) < 1e-6, got.sum()
        assert abs(got.sum() - 1.0) < 1e-6
        assert np.all(got >= 0)


def test_projection_vectorises_over_a_batch():
    support = make_support(-1.0, 1.0, 5)
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (7, 5)))
    tz = jax.random.normal(jax.random.key(1), (7, 5)) * 2
    batched = jax.vmap(categorical_l2_project, in_axes=(0, 0, None))(tz, probs, support)
    for i in range(7):
        np.testing.assert_allclose(batched[i], categorical_l2_project(tz[i], probs[i], support),
                                   rtol=1e-6)


def test_terminal_target_is_the_clipped_reward_alone():
    support = make_support(-5.0, 5.0, 11)
    logits = jax.random.normal(jax.random.key(0), (3, 11))
    q_sel = jnp.array([0.0, 1.0, 0.5])
    t = categorical_target(jnp.float32(2.5), jnp.float32(0.0), logits, q_sel, support)
    np.testing.assert_allclose(t, np.eye(11)[7] * 0.5 + np.eye(11)[8] * 0.5, atol=1e-6)
    t = categorical_target(jnp.float32(1e6), jnp.float32(0.0), logits, q_sel, support)
    np.testing.assert_allclose(t, np.eye(11)[10], atol=1e-6)  # clamped onto v_max


# ------------------------------------------------------------------------------------------
# double Q
# ------------------------------------------------------------------------------------------


def test_double_q_uses_online_argmax_with_target_distribution():
    support = make_support(-5.0, 5.0, 11)
    # Target net: action 2 has by far the highest mean; action 0 a low one.
    target_logits = jnp.stack([
        -((support + 4.0) ** 2), -((support - 0.0) ** 2), -((support - 4.0) ** 2)])
    target_q = jnp.sum(jax.nn.softmax(target_logits) * support, -1)
    online_q = jnp.array([3.0, -1.0, 0.0])  # online net prefers action 0
    assert int(jnp.argmax(target_q)) == 2 and int(jnp.argmax(online_q)) == 0
    r, disc = jnp.float32(0.3), jnp.float32(0.9)
    got = categorical_target(r, disc, target_logits, online_q, support)
    want = categorical_l2_project(r + disc * support, jax.nn.softmax(target_logits[0]), support)
    np.testing.assert_allclose(got, want, atol=1e-6)
    # not the target-argmax action, and not the online distribution
    other = categorical_l2_project(r + disc * support, jax.nn.softmax(target_logits[2]), support)
    assert not np.allclose(got, other, atol=1e-3)
    # ... and the loss is the cross-entropy of the online logits at the *taken* action.
    online_logits = jax.random.normal(jax.random.key(0), (3, 11))
    loss = categorical_double_q_loss(online_logits, jnp.int32(1), r, disc, target_logits,
                                     online_q, support)
    np.testing.assert_allclose(loss, cross_entropy(online_logits[1], want), rtol=1e-6)


def test_total_loss_selects_next_action_with_online_net(online, target):
    """Through the network: a′ from the online net at s′, distribution from the target net."""
    batch = _batch()
    apply = jax.jit(NET.apply)
    out_next, tgt, out_s = (apply(online, batch.next_obs), apply(target, batch.next_obs),
                            apply(online, batch.obs))
    support = make_support(SMALL.v_min, SMALL.v_max, SMALL.n_atoms)
    n_disagree = sum(int(jnp.sum(jnp.argmax(out_next.q[d], -1) != jnp.argmax(tgt.q[d], -1)))
                     for d in range(4))
    assert n_disagree > 0  # online and target nets disagree on some a′: the test can fail
    want = []
    for i in range(B):
        per_branch = []
        for d in range(4):
            a_next = int(jnp.argmax(out_next.q[d][i]))
            tz = batch.reward[i] + batch.discount[i] * support
            proj = categorical_l2_project(tz, jax.nn.softmax(tgt.logits[d][i, a_next]), support)
            ce = cross_entropy(out_s.logits[d][i, batch.action[i, d]], proj)
            entropy = -float(jnp.sum(jax.scipy.special.xlogy(proj, proj)))
            per_branch.append((float(ce), float(ce) - entropy))
        want.append(np.sum(per_branch, axis=0))
    want = np.array(want)  # [B, (cross-entropy, KL)] summed over branches
    _, (_, per_sample, _, _) = LOSS(online, target, batch, jax.random.key(0), init_moe_state(3),
                                    1.0)
    # the default priority: KL(m ‖ p) = CE − H(m), the loss less the target's own entropy
    np.testing.assert_allclose(per_sample, want[:, 1], rtol=1e-4, atol=1e-5)
    assert np.all(want[:, 1] < want[:, 0] - 1.0)  # the entropy is a large share here
    _, (_, per_sample, _, _) = LOSS_CE(online, target, batch, jax.random.key(0),
                                       init_moe_state(3), 1.0)
    np.testing.assert_allclose(per_sample, want[:, 0], rtol=1e-4, atol=1e-5)


def test_kl_priority_ranks_a_badly_fit_sharp_target_above_a_fit_spread_one():
    """Two transitions (one branch, 2 actions, 5 atoms): one whose online distribution equals
    its spread-out projected target (fit: KL 0, cross-entropy log 5 — the target's entropy), one
    fit badly to a one-atom target. The cross-entropy ranks them the wrong way round."""
    from jdqn.losses.batch import branching_td_loss_batch

    z = 5
    logits = jnp.zeros((2, 2, z)).at[1, 0, 4].set(-1.0)  # row 0 uniform: the fit one
    # row 0: reward 0, discount 1 and uniform next probabilities project to a uniform target;
    # row 1: reward −2 (atom 0), discount 0: a one-atom target
    target_logits = jnp.zeros((2, 2, z)).at[1].set(jnp.array([0.0, -1e9, -1e9, -1e9, -1e9]))
    td = branching_td_loss_batch((logits,), jnp.zeros((2, 1), jnp.int32),
                                 jnp.array([0.0, -2.0]), jnp.array([1.0, 0.0]),
                                 (target_logits,), (jnp.zeros((2, 2)),), -2.0, 2.0,
                                 jnp.float32(1.0))
    kl, ce = np.asarray(td["td_kl"][:, 0]), np.asarray(td["ce"][:, 0])
    np.testing.assert_allclose(kl[0], 0.0, atol=1e-6)
    np.testing.assert_allclose(ce[0], np.log(z), rtol=1e-6)
    assert kl[1] > kl[0] and ce[1] < ce[0]


# ------------------------------------------------------------------------------------------
# warm-up blend
# ------------------------------------------------------------------------------------------


def test_warmup_blend_endpoints_and_clamped_target():
    support = make_support(-5.0, 5.0, 11)
    logits = jax.random.normal(jax.random.key(0), (11,))
    target = categorical_l2_project(1e6 + 0.9 * support, jax.nn.softmax(logits), support)
    blended0, sq, ce = warmup_blend_loss(logits, target, support, jnp.float32(0.0))
    q = jnp.sum(jax.nn.softmax(logits) * support)
    np.testing.assert_allclose(sq, (q - 5.0) ** 2, rtol=1e-5)  # target clamped to v_max
    assert float(sq) <= (10.0) ** 2
    np.testing.assert_allclose(blended0, sq)
    blended1, _, _ = warmup_blend_loss(logits, target, support, jnp.float32(1.0))
    np.testing.assert_allclose(blended1, ce)
    mid, _, _ = warmup_blend_loss(logits, target, support, jnp.float32(0.25))
    np.testing.assert_allclose(mid, 0.75 * sq + 0.25 * ce, rtol=1e-6)


def test_warmup_alpha_ramps_to_one():
    assert float(warmup_alpha(0, 100)) == 0.0
    assert float(warmup_alpha(50, 100)) == 0.5
    assert float(warmup_alpha(1000, 100)) == 1.0
    assert float(warmup_alpha(0, 0)) == 1.0


# ------------------------------------------------------------------------------------------
# IQN
# ------------------------------------------------------------------------------------------


def naive_quantile_huber(theta, tau, target, kappa=1.0):
    total = 0.0
    for i in range(len(theta)):
        for j in range(len(target)):
            u = target[j] - theta[i]
            h = 0.5 * u * u if abs(u) <= kappa else kappa * (abs(u) - 0.5 * kappa)
            total += abs(tau[i] - (u < 0)) * h / kappa / len(target)
    return total


def test_quantile_huber_matches_definition():
    rng = np.random.default_rng(0)
    theta, tau, target = rng.normal(size=4) * 2, rng.uniform(size=4), rng.normal(size=6) * 2
    got = quantile_huber_loss(jnp.asarray(theta), jnp.asarray(tau), jnp.asarray(target))
    np.testing.assert_allclose(got, naive_quantile_huber(theta, tau, target), rtol=1e-5)


def test_iqn_double_q_uses_online_selector_and_clamps():
    q_tm1 = jnp.zeros((3, 2))
    tau = jnp.array([0.25, 0.75])
    tq = jnp.array([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [100.0, 100.0, 100.0]])
    sel = jnp.array([0.0, 1.0, -1.0])  # online picks action 1 (target would pick 2)
    got = iqn_double_q_loss(q_tm1, tau, jnp.int32(0), jnp.float32(0.0), jnp.float32(1.0), tq,
                            sel, -5.0, 5.0)
    np.testing.assert_allclose(got, quantile_huber_loss(q_tm1[0], tau, jnp.full(3, 2.0)))
    sel = jnp.array([0.0, -1.0, 1.0])  # online picks 2: target 100 is clamped to v_max = 5
    got = iqn_double_q_loss(q_tm1, tau, jnp.int32(0), jnp.float32(0.0), jnp.float32(1.0), tq,
                            sel, -5.0, 5.0)
    np.testing.assert_allclose(got, quantile_huber_loss(q_tm1[0], tau, jnp.full(3, 5.0)))


# ------------------------------------------------------------------------------------------
# MoE load balance
# ------------------------------------------------------------------------------------------


def test_uniform_gate_gives_load_balance_loss_exactly_lambda():
    for k in (1, 3, 8):
        gate = jnp.full((16, k), 1.0 / k)
        np.testing.assert_allclose(load_balance_loss(gate, jnp.float32(0.37)), 0.37, rtol=1e-6)
    collapsed = jnp.zeros((16, 8)).at[:, 2].set(1.0)
    np.testing.assert_allclose(load_balance_loss(collapsed, jnp.float32(0.37)), 0.37 * 8)


def test_lambda_eff_rises_as_entropy_falls_and_never_below_floor():
    h_target = entropy_target(8)
    assert h_target == pytest.approx(0.9 * math.log(8))
    ents = jnp.linspace(math.log(8), 0.0, 50)  # falling entropy EMA
    lam = np.asarray([lambda_eff(h, 0.01, 0.05, h_target) for h in ents])
    assert np.all(np.diff(lam) >= 0) and lam[-1] > lam[0]
    assert np.all(lam >= 0.01 - 1e-9)
    np.testing.assert_allclose(lam[0], 0.01)  # above target → floor
    np.testing.assert_allclose(lam[-1], 0.06, rtol=1e-6)  # H = 0 → floor + extra
    assert float(lambda_eff(jnp.float32(0.0), 0.01, 0.05, 0.0)) == pytest.approx(0.01)


def test_moe_state_tracks_entropy_ema():
    state = init_moe_state(4)
    np.testing.assert_allclose(state.entropy_ema, math.log(4), rtol=1e-6)
    collapsed = jnp.zeros((8, 4)).at[:, 0].set(1.0)
    for _ in range(200):
        state = update_moe_state(state, collapsed, 0.95)
    assert float(state.entropy_ema) < 1e-3
    np.testing.assert_allclose(state.util_ema, [1, 0, 0, 0], atol=1e-3)


# ------------------------------------------------------------------------------------------
# gradients (float64 finite differences)
# ------------------------------------------------------------------------------------------


def test_loss_gradients_match_finite_differences():
    with x64():
        k = jax.random.split(jax.random.key(0), 6)
        support = make_support(-5.0, 5.0, 11, dtype=jnp.float64)
        logits = jax.random.normal(k[0], (3, 11), jnp.float64)
        tlogits = jax.random.normal(k[1], (3, 11), jnp.float64)
        sel = jnp.array([0.1, 0.7, 0.3], jnp.float64)
        r, disc = jnp.float64(0.7), jnp.float64(0.95)

        def c51(lg):
            return categorical_double_q_loss(lg, jnp.int32(1), r, disc, tlogits, sel, support)

        check_grads(c51, (logits,), order=1, modes=("rev",), eps=1e-6)
        target = categorical_target(r, disc, tlogits, sel, support)
        for alpha in (0.0, 0.4, 1.0):
            def blend(lg, a=alpha):
                return warmup_blend_loss(lg, target, support, jnp.float64(a))[0]

            check_grads(blend, (logits[0],), order=1, modes=("rev",), eps=1e-6)

        theta = jax.random.normal(k[2], (3, 4), jnp.float64)
        tau = jax.random.uniform(k[3], (4,), jnp.float64)
        tq = jax.random.normal(k[4], (3, 5), jnp.float64) * 3

        def iqn(th):
            return iqn_double_q_loss(th, tau, jnp.int32(2), r, disc, tq, sel, -5.0, 5.0)

        check_grads(iqn, (theta,), order=1, modes=("rev",), eps=1e-6)

        gate_logits = jax.random.normal(k[5], (6, 4), jnp.float64)

        def balance(gl):
            return load_balance_loss(jax.nn.softmax(gl), jnp.float64(0.3))

        check_grads(balance, (gate_logits,), order=1, modes=("rev",), eps=1e-6)


@pytest.mark.slow
def test_total_loss_gradient_matches_finite_differences(online, target):
    net = BranchingQNetwork(dataclasses.replace(SMALL, iqn_tau_groups=2), FLOW)  # 2 of 2 rows
    with x64():
        cast = functools.partial(jax.tree.map, lambda a: jnp.asarray(a, jnp.float64))
        online = cast(without_direction_conditioning(online))
        target = cast(target)
        b = _batch(4)
        batch = b._replace(**{f: jnp.asarray(getattr(b, f), jnp.float64)
                              for f in ("obs", "reward", "discount", "next_obs", "weight")})
        f = functools.partial(total_loss, target_params=target, batch=batch,
                              key=jax.random.key(3), moe_state=init_moe_state(3),
                              alpha=jnp.float64(0.5), net=net, train_cfg=TRAIN)
        check_grads(jax.jit(lambda p: f(p)[0]), (online,), order=1, modes=("rev",), eps=1e-6,
                    atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------
# total loss
# ------------------------------------------------------------------------------------------


def without_direction_conditioning(params):
    """Zero the magnitude stream's weights on E[Q_dir] so that the conditioning's stop-gradient
    changes nothing and finite differences are a valid gradient oracle."""
    p = jax.tree.map(lambda x: x, params)
    k = p["params"]["c51"]["magnitude_fc"]["kernel"]
    p["params"]["c51"]["magnitude_fc"]["kernel"] = k.at[-SMALL.branch_sizes[0]:].set(0.0)
    return p


def _batch(b=B, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    action = jnp.stack([jax.random.randint(jax.random.fold_in(k[1], d), (b,), 0, a)
                        for d, a in enumerate(SMALL.branch_sizes)], axis=1).astype(jnp.int32)
    done = jax.random.bernoulli(k[3], 0.2, (b,))
    return Batch(obs=jax.random.normal(k[0], (b, W)), action=action,
                 reward=jax.random.normal(k[2], (b,)) * 3,
                 discount=jnp.where(done, 0.0, 0.99**3).astype(jnp.float32),
                 next_obs=jax.random.normal(k[4], (b, W)), weight=jnp.ones((b,)))


def test_total_loss_shapes_components_and_importance_weights(online, target):
    f = LOSS_CE  # priorities = the per-sample TD loss, so the two are compared below
    batch = _batch()
    args = (online, target, batch, jax.random.key(0), init_moe_state(3), 0.5)
    loss, (comp, per_sample, moe_state, diag) = f(*args)
    chex.assert_shape(per_sample, (16,))
    chex.assert_type([loss, per_sample], jnp.float32)
    chex.assert_shape(diag["q_mean"], (4,))
    chex.assert_shape(diag["gate_util"], (3,))
    np.testing.assert_allclose(
        loss, comp["td"] + TRAIN.iqn_weight * comp["iqn"] + comp["moe_balance"], rtol=1e-6)
    np.testing.assert_allclose(comp["td"], 0.5 * comp["mse"] + 0.5 * comp["c51"], rtol=1e-5)
    np.testing.assert_allclose(comp["td"], per_sample.mean() / 4, rtol=1e-5)
    assert comp["moe_balance"] >= TRAIN.moe_lambda_floor * 0.999
    # importance weights scale the TD and IQN terms per sample; priorities ignore them
    w = jnp.zeros(16).at[:4].set(4.0)
    loss_w, (comp_w, per_sample_w, _, _) = f(args[0], args[1], batch._replace(weight=w),
                                             *args[3:])
    np.testing.assert_allclose(per_sample_w, per_sample)
    np.testing.assert_allclose(
        loss_w, comp_w["td"] + TRAIN.iqn_weight * comp_w["iqn"] + comp_w["moe_balance"],
        rtol=1e-6)
    np.testing.assert_allclose(comp_w["td"], per_sample[:4].sum() * 4 / 16 / 4, rtol=1e-5)
    assert moe_state.entropy_ema.shape == ()


def test_q_statistics_read_a_systematic_sample_and_every_rows_logits_are_checked(online,
                                                                                  target):
    """``train.q_stats_rows``: a batch larger than it has its Q statistics (mean, spread, the
    direction's gap) from every ``B // q_stats_rows``-th row of the online logits at s — the
    same numbers as the full batch's statistics over those rows — and 0 means every row;
    the loss is untouched. ``logits_finite`` still covers every row: a NaN planted in a row the
    sample skips is not in the statistics but is reported."""
    from jdqn.losses.total import q_stats_stride
    from jdqn.networks.heads import DIRECTION, expected_q, make_support, q_gap

    assert [q_stats_stride(16, r) for r in (0, 4, 5, 16, 32)] == [1, 4, 3, 1, 1]
    batch = _batch()
    args = (online, target, batch, jax.random.key(0), init_moe_state(3), 0.5)

    def run(rows, b=batch):
        return jax.jit(functools.partial(total_loss, net=NET, train_cfg=dataclasses.replace(
            TRAIN, q_stats_rows=rows)))(args[0], args[1], b, *args[3:])

    loss0, (_, _, _, full) = run(0)
    loss4, (_, _, _, sampled) = run(4)
    assert float(loss0) == float(loss4)
    out = NET.apply(online, batch.obs)
    support = make_support(SMALL.v_min, SMALL.v_max, SMALL.n_atoms)
    q_all = [expected_q(lg, support) for lg in out.logits]
    for stats, rows in ((full, slice(None)), (sampled, slice(None, None, 4))):
        q = [x[rows] for x in q_all]
        np.testing.assert_allclose(stats["q_mean"], [jnp.mean(x) for x in q], rtol=1e-5)
        np.testing.assert_allclose(stats["q_std"], [jnp.std(x) for x in q], rtol=1e-5)
        np.testing.assert_allclose(stats["q_gap"], jnp.mean(q_gap(q[DIRECTION])), rtol=1e-5)
    assert not np.allclose(full["q_mean"], sampled["q_mean"], rtol=1e-3)  # 16 rows, not 4
    assert bool(full["logits_finite"]) and bool(sampled["logits_finite"])
    bad = batch._replace(obs=batch.obs.at[5, 0].set(jnp.nan))  # row 5: not in rows 0, 4, 8, 12
    _, (_, _, _, diag) = run(4, bad)
    assert np.all(np.isfinite(diag["q_mean"])) and np.all(np.isfinite(diag["q_std"]))
    assert not bool(diag["logits_finite"])


@pytest.mark.parametrize("mode,groups,fuse", [("batch", 1, True), ("batch", 4, True),
                                               ("batch", 4, False), ("sample", 1, True)],
                         ids=["shared", "groups", "groups_twin", "per_sample"])
def test_iqn_fractions_come_from_the_loss_key_shared_or_per_sample(online, target, mode, groups,
                                                                  fuse):
    """ModelConfig.iqn_taus: "batch" draws one [N] set (and one [N′]) from the update's key for
    every sample — [G, N] with iqn_tau_groups = G, one set per B/G consecutive samples —
    "sample" draws [B, N]; the IQN term is the batch loss at exactly those fractions (rebuilt
    here from the key: online quantiles at s, target quantiles at s′, the online network's
    expected Q at s′ selecting the next action), with the online forward over [s; s′] (fuse)
    or the paired forward at s′."""
    from jdqn.losses.batch import branching_iqn_loss_batch

    cfg = dataclasses.replace(SMALL, iqn_taus=mode, iqn_tau_groups=groups, fuse_next_obs=fuse)
    net = BranchingQNetwork(cfg, FLOW)
    batch, key = _batch(), jax.random.key(7)
    _, (comp, _, _, _) = jax.jit(functools.partial(total_loss, net=net, train_cfg=TRAIN))(
        online, target, batch, key, init_moe_state(3), 0.5)
    k_online, k_target = jax.random.split(key)
    rows = (B,) if mode == "sample" else () if groups == 1 else (groups,)
    taus = jax.random.uniform(k_online, (*rows, cfg.iqn_n))
    taus_prime = jax.random.uniform(k_target, (*rows, cfg.iqn_n_prime))

    def each_row(t):
        return jnp.broadcast_to(t, (B, t.shape[-1])) if t.ndim == 1 else jnp.repeat(
            t, B // t.shape[0], axis=0)

    taus_b = each_row(taus)
    if groups > 1:  # the groups really differ: not one set repeated
        assert not np.allclose(taus_b[0], taus_b[-1])
    per_row = BranchingQNetwork(dataclasses.replace(cfg, iqn_taus="sample", iqn_tau_groups=1),
                                FLOW)
    quantiles = per_row.apply(online, batch.obs, taus_b).quantiles
    target_q = per_row.apply(target, batch.next_obs, each_row(taus_prime)).quantiles
    selector = per_row.apply(online, batch.next_obs).q
    iqn = branching_iqn_loss_batch(quantiles, taus_b, batch.action, batch.reward,
                                   batch.discount, target_q, selector, cfg.v_min, cfg.v_max)
    np.testing.assert_allclose(comp["iqn"], jnp.mean(jnp.mean(iqn, axis=1)), rtol=1e-5)
    assert float(comp["iqn"]) > 0


def test_iqn_groups_that_do_not_divide_the_batch_are_a_clear_error(online, target):
    net = BranchingQNetwork(dataclasses.replace(SMALL, iqn_tau_groups=3), FLOW)
    with pytest.raises(ValueError, match=r"model.iqn_tau_groups = 3 does not divide the batch "
                                         r"of 16 rows"):
        total_loss(online, target, _batch(), jax.random.key(0), init_moe_state(3), 0.5,
                   net=net, train_cfg=TRAIN)


def test_fused_and_separate_next_obs_forward_agree(online, target):
    """Values and gradients: one online forward over [s; s′] (fused) against the separate one
    at s with the twin online/target forward at s′ (next_state_forwards)."""
    args = (online, target, _batch(), jax.random.key(0), init_moe_state(3), 0.3)
    net = BranchingQNetwork(dataclasses.replace(SMALL, fuse_next_obs=False), FLOW)
    grad = functools.partial(jax.value_and_grad, has_aux=True)
    fused = jax.jit(grad(functools.partial(total_loss, net=NET, train_cfg=TRAIN)))
    separate = jax.jit(grad(functools.partial(total_loss, net=net, train_cfg=TRAIN)))
    ((loss_f, aux_f), g_f), ((loss_s, aux_s), g_s) = fused(*args), separate(*args)
    np.testing.assert_allclose(loss_f, loss_s, rtol=1e-5)
    np.testing.assert_allclose(aux_f[1], aux_s[1], rtol=1e-5)
    chex.assert_trees_all_close(aux_f[0], aux_s[0], rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(g_f, g_s, rtol=1e-4, atol=1e-6)
    assert float(optax_norm(g_s)) > 0


def optax_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(tree)))


def _dot_pairing(jaxpr) -> list[str]:
    """Per dot_general: "batched" (a batch dimension of 2: one matmul per network of the pair),
    "shared lhs" (no batch dimension, the rhs a stack of two weights whose leading axis is a
    free dimension: one matmul of a shared input against both networks' weights), or "single"
    (a plain matmul)."""
    kinds = []
    for e in all_eqns(jaxpr):
        if e.primitive.name != "dot_general":
            continue
        (_, rc), (lb, rb) = e.params["dimension_numbers"]
        rhs = e.invars[1].aval.shape
        if tuple(e.invars[0].aval.shape[d] for d in lb) == (2,):
            kinds.append("batched")
        elif not rb and 0 not in rc and rhs[0] == 2 and len(rhs) == 3:
            kinds.append("shared lhs")
        else:
            kinds.append("single")
    return kinds


def test_next_state_forwards_runs_both_networks_in_one_pass(online, target):
    """The twin forward at s′ equals two separate forwards (online without IQN, target with
    its quantiles at τ′), and every matmul of trunk and C51 heads runs once for both networks
    (batched over the pair, or s′ against both weights side by side where it reads s′ itself);
    only the target's IQN head runs alone."""
    next_obs = _batch().next_obs
    taus = jax.random.uniform(jax.random.key(3), (B, SMALL.iqn_n_prime))
    fn = jax.jit(functools.partial(next_state_forwards, NET))
    online_next, tgt = fn(online, target, next_obs, taus)
    ref_online = NET.apply(online, next_obs)
    ref_target = NET.apply(target, next_obs, taus, grad_free=True)
    assert online_next.quantiles is None and ref_online.quantiles is None
    chex.assert_trees_all_close(online_next, ref_online, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(tgt, ref_target, rtol=1e-5, atol=1e-6)
    # not the same network twice: the two outputs differ
    assert not np.allclose(online_next.q[0], tgt.q[0])

    # Structure (traced without jit, so the network's equations read the traced s′ itself):
    # the network's own matmuls are plain; in the twin program every trunk and head matmul runs
    # once for the pair — those reading s′ itself (here the variable-selection layer and the
    # MoE gate's first layer) as s′ against both weights side by side, the rest batched over
    # the two networks — and the IQN head's (the last dots of a forward with taus) run alone.
    def reads(jaxpr, var):  # per dot_general: does its lhs read `var` itself?
        return [e.invars[0] is var for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]

    one_jaxpr = jax.make_jaxpr(NET.apply)(online, next_obs).jaxpr
    one = _dot_pairing(one_jaxpr)
    n_reads = sum(reads(one_jaxpr, one_jaxpr.invars[-1]))
    twin_jaxpr = jax.make_jaxpr(functools.partial(next_state_forwards, NET))(
        online, target, next_obs, taus).jaxpr
    twin = _dot_pairing(twin_jaxpr)
    twin_reads = reads(twin_jaxpr, twin_jaxpr.invars[-2])
    iqn = _dot_pairing(jax.make_jaxpr(lambda p: NET.apply(p, next_obs, taus))(
        online).jaxpr)[len(one):]
    assert one and set(one) == {"single"} and iqn and n_reads == 2
    assert sorted(twin) == sorted(["shared lhs"] * n_reads + ["batched"] * (len(one) - n_reads)
                                  + ["single"] * len(iqn))
    # ... and those read s′ itself, not a copy broadcast to both networks (the pair's old form)
    assert [k for k, r in zip(twin, twin_reads, strict=True) if r] == ["shared lhs"] * n_reads
    # twin=False: the two passes, the same outputs
    two = jax.jit(functools.partial(next_state_forwards, NET, twin=False))(
        online, target, next_obs, taus)
    chex.assert_trees_all_close(two, (online_next, tgt), rtol=1e-5, atol=1e-6)


def test_twin_pass_computes_the_expected_q_of_the_online_network_only(online):
    """The loss reads the expected Q at s′ of the online network only. Taken from the pair's
    output it would be computed for both networks and half of it dropped (XLA reduces before it
    slices); computed from the online logits, the compiled program's softmax over the atoms
    covers the pair only where the network itself needs both (the direction branch, whose
    expected Q conditions the magnitude stream)."""
    next_obs = _batch().next_obs
    fn = jax.jit(lambda p, t: next_state_forwards(NET, p, t, next_obs, None)[0].q)
    hlo = fn.lower(online, online).compile().as_text()
    exps = re.findall(r"(f32\[[0-9,]*\])\S* exponential\(", hlo)
    z, (n_dir, *rest) = SMALL.n_atoms, SMALL.branch_sizes
    assert f"f32[2,{B},{n_dir},{z}]" in exps  # the pair's direction softmax (conditioning)
    for a in set(rest):
        assert f"f32[{B},{a},{z}]" in exps and f"f32[2,{B},{a},{z}]" not in exps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_total_loss_pairs_the_next_state_forwards_under_float32_only(online, target, dtype):
    """The twin pass where it was measured faster on the H200 (float32 matmuls), two passes
    under bf16 (docs/model.md); the fused [s; s′] form has no pass at s′ to pair."""
    args = (online, target, _batch(), jax.random.key(0), init_moe_state(3), 0.3)
    for fuse in (False, True):
        net = BranchingQNetwork(dataclasses.replace(SMALL, fuse_next_obs=fuse,
                                                    matmul_dtype=dtype), FLOW)
        jaxpr = jax.make_jaxpr(functools.partial(total_loss, net=net, train_cfg=TRAIN))(*args)
        paired = "batched" in _dot_pairing(jaxpr.jaxpr)
        assert paired == (dtype == "float32" and not fuse), (dtype, fuse)


def test_loss_without_iqn_head(online):
    net = BranchingQNetwork(dataclasses.replace(SMALL, iqn=False), FLOW)
    params = {"params": {k: v for k, v in online["params"].items() if k != "iqn"}}
    shapes = jax.eval_shape(lambda k: init_params_batched(net, k, W), jax.random.split(
        jax.random.key(0), 1))
    assert "iqn" not in shapes["params"]
    loss, (comp, _, _, _) = jax.jit(functools.partial(total_loss, net=net, train_cfg=TRAIN))(
        params, params, _batch(), jax.random.key(0), init_moe_state(3), 1.0)
    assert float(comp["iqn"]) == 0.0 and np.isfinite(float(loss))
    with pytest.raises(ValueError, match="ModelConfig.iqn is false"):
        iqn_quantiles(net, params, jnp.zeros((2, SMALL.width)), jnp.full((2, 3), 0.5))


def test_forward_and_loss_jit_and_vmap_over_seeds(seed_params):
    """Per seed: own params (from init with its own key), own τ key; one jitted program."""
    targets = jax.tree.map(lambda x: jnp.roll(x, 1, axis=0), seed_params)
    loss_keys = jax.random.split(jax.random.key(42), 3)

    @jax.jit
    @functools.partial(jax.vmap, in_axes=(0, 0, None, 0))
    def one_seed(params, target, batch, key):
        (loss, aux), grads = jax.value_and_grad(
            functools.partial(total_loss, net=NET, train_cfg=TRAIN), has_aux=True)(
            params, target, batch, key, init_moe_state(3), 0.5)
        return loss, aux[1], grads

    loss, per_sample, grads = one_seed(seed_params, targets, _batch(), loss_keys)
    chex.assert_shape(loss, (3,))
    chex.assert_shape(per_sample, (3, B))
    assert len(set(np.asarray(loss).round(6).tolist())) == 3  # every seed is different
    chex.assert_tree_all_finite(grads)


def test_bf16_loss_stays_float32_and_close(online, target):
    args = (online, target, _batch(), jax.random.key(0), init_moe_state(3), 0.5)
    net16 = BranchingQNetwork(dataclasses.replace(SMALL, matmul_dtype="bfloat16"), FLOW)
    losses = []
    for f in (LOSS, jax.jit(functools.partial(total_loss, net=net16, train_cfg=TRAIN))):
        loss, (_, per_sample, _, _) = f(*args)
        chex.assert_type([loss, per_sample], jnp.float32)
        losses.append(float(loss))
    assert losses[1] == pytest.approx(losses[0], rel=0.05)


def test_branching_td_loss_is_mean_over_branches_of_c51_at_alpha_one():
    support = make_support(-5.0, 5.0, 11)
    k = jax.random.split(jax.random.key(0), 3)
    sizes = (4, 3, 3, 3)
    logits = tuple(jax.random.normal(jax.random.fold_in(k[0], d), (a, 11))
                   for d, a in enumerate(sizes))
    tlogits = tuple(jax.random.normal(jax.random.fold_in(k[1], d), (a, 11))
                    for d, a in enumerate(sizes))
    sel = tuple(jax.random.normal(jax.random.fold_in(k[2], d), (a,)) for d, a in enumerate(sizes))
    action = jnp.array([3, 0, 2, 1], jnp.int32)
    out = branching_td_loss(logits, action, jnp.float32(0.5), jnp.float32(0.9), tlogits, sel,
                            support, jnp.float32(1.0))
    for d in range(4):
        want = categorical_double_q_loss(logits[d], action[d], jnp.float32(0.5),
                                         jnp.float32(0.9), tlogits[d], sel[d], support)
        np.testing.assert_allclose(out["td"][d], want, rtol=1e-6)


# ------------------------------------------------------------------------------------------
# batch forms (what total_loss runs) against the per-sample definitions
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["random", "far_outside", "done", "on_atoms"])
def test_uniform_batch_projection_matches_per_sample_projection(case):
    from jdqn.losses.batch import project_uniform

    rng = np.random.default_rng(7)
    b, d, z, v_min, v_max = 33, 4, 51, -25.0, 25.0
    support = np.linspace(v_min, v_max, z)
    r = rng.normal(0, 8.0, b)
    disc = rng.uniform(0.0, 1.0, b)
    if case == "far_outside":
        r = rng.choice([-1.0, 1.0], b) * rng.uniform(20.0, 1e4, b)
    elif case == "done":
        disc[:] = 0.0
    elif case == "on_atoms":
        r, disc = 1.0 * rng.integers(-10, 10, b), np.ones(b)
    probs = rng.dirichlet(np.ones(z) * 0.3, (b, d))
    tz = r[:, None] + disc[:, None] * support
    with x64():
        got = project_uniform(jnp.asarray(tz), jnp.asarray(probs), v_min, v_max)
        want = jax.vmap(jax.vmap(categorical_l2_project, in_axes=(None, 0, None)),
                        in_axes=(0, 0, None))(jnp.asarray(tz), jnp.asarray(probs),
                                              jnp.asarray(support))
        np.testing.assert_allclose(got, want, atol=1e-12)
    got32 = project_uniform(jnp.asarray(tz, jnp.float32), jnp.asarray(probs, jnp.float32),
                            v_min, v_max)
    np.testing.assert_allclose(got32, want, atol=2e-6)
    np.testing.assert_allclose(np.sum(got32, -1), 1.0, atol=1e-5)


def test_batch_td_and_iqn_losses_match_vmapped_per_sample_losses():
    from jdqn.losses.batch import branching_iqn_loss_batch, branching_td_loss_batch
    from jdqn.losses.quantile import branching_iqn_loss

    b, z, n, sizes, v_min, v_max = 17, 11, 5, (4, 3, 3, 3), -5.0, 5.0
    k = jax.random.split(jax.random.key(3), 8)
    normal = jax.random.normal
    with x64():
        logits = tuple(normal(jax.random.fold_in(k[0], d), (b, a, z), jnp.float64)
                       for d, a in enumerate(sizes))
        tlogits = tuple(normal(jax.random.fold_in(k[1], d), (b, a, z), jnp.float64)
                        for d, a in enumerate(sizes))
        sel = tuple(normal(jax.random.fold_in(k[2], d), (b, a), jnp.float64)
                    for d, a in enumerate(sizes))
        sel = (sel[0].at[0].set(1.0),) + sel[1:]  # a tie: argmax picks the first, like jnp
        action = jnp.stack([jax.random.randint(jax.random.fold_in(k[3], d), (b,), 0, a)
                            for d, a in enumerate(sizes)], 1)
        reward = normal(k[4], (b,), jnp.float64) * 4
        discount = jnp.where(jnp.arange(b) % 5 == 0, 0.0, 0.9)
        support = jnp.linspace(v_min, v_max, z)
        # each side one jitted program (eagerly, every small operation compiles on its own)
        td_batch = jax.jit(branching_td_loss_batch, static_argnums=(6, 7))
        td_ref = jax.jit(jax.vmap(branching_td_loss, in_axes=(0, 0, 0, 0, 0, 0, None, None)))
        for alpha in (0.0, 0.3, 1.0):
            got = td_batch(logits, action, reward, discount, tlogits, sel, v_min, v_max,
                           jnp.float64(alpha))
            want = td_ref(logits, action, reward, discount, tlogits, sel, support,
                          jnp.float64(alpha))
            for key in ("td", "sq", "ce", "target_mean"):
                np.testing.assert_allclose(got[key], want[key], rtol=1e-10, atol=1e-12)
        # gradients w.r.t. the online logits agree too
        g_batch = jax.jit(jax.grad(lambda lg: jnp.sum(branching_td_loss_batch(
            lg, action, reward, discount, tlogits, sel, v_min, v_max, jnp.float64(0.5))["td"])))(
            logits)
        g_ref = jax.jit(jax.grad(lambda lg: jnp.sum(jax.vmap(
            branching_td_loss, in_axes=(0, 0, 0, 0, 0, 0, None, None))(
            lg, action, reward, discount, tlogits, sel, support, jnp.float64(0.5))["td"])))(
            logits)
        for gb, gr in zip(g_batch, g_ref, strict=True):
            np.testing.assert_allclose(gb, gr, rtol=1e-10, atol=1e-12)
        quant = tuple(normal(jax.random.fold_in(k[5], d), (b, a, n), jnp.float64)
                      for d, a in enumerate(sizes))
        tquant = tuple(normal(jax.random.fold_in(k[6], d), (b, a, n + 2), jnp.float64) * 9
                       for d, a in enumerate(sizes))
        taus = jax.random.uniform(k[7], (b, n), jnp.float64)
        got = jax.jit(branching_iqn_loss_batch, static_argnums=(7, 8))(
            quant, taus, action, reward, discount, tquant, sel, v_min, v_max)
        iqn_ref = jax.jit(jax.vmap(branching_iqn_loss, in_axes=(0, 0, 0, 0, 0, 0, 0, None, None)),
                          static_argnums=(7, 8))
        want = iqn_ref(quant, taus, action, reward, discount, tquant, sel, v_min, v_max)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
        g_batch = jax.jit(jax.grad(lambda q: jnp.sum(branching_iqn_loss_batch(
            q, taus, action, reward, discount, tquant, sel, v_min, v_max))))(quant)
        g_ref = jax.jit(jax.grad(lambda q: jnp.sum(iqn_ref(
            q, taus, action, reward, discount, tquant, sel, v_min, v_max))))(quant)
        for gb, gr in zip(g_batch, g_ref, strict=True):
            assert np.any(np.asarray(gr) != 0)
            np.testing.assert_allclose(gb, gr, rtol=1e-10, atol=1e-12)


def test_select_masks_instead_of_multiplying():
    from jdqn.losses.batch import select

    x = jnp.array([[[1.0, 2.0], [jnp.inf, 3.0]], [[jnp.nan, 0.0], [4.0, 5.0]]])  # [B=2, A=2, 2]
    got = select(x, jnp.array([0, 1]))
    np.testing.assert_array_equal(got, [[1.0, 2.0], [4.0, 5.0]])  # no 0·inf, no NaN leak
