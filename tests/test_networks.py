"""Specification tests for jdqn.networks: trunk, MoE, dueling branching heads, IQN head."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_eqns, dot_contractions, x64
from jax.test_util import check_grads

from jdqn.config import ModelConfig
from jdqn.networks import (
    DIRECTION,
    MAGNITUDE,
    ORDER_TYPE,
    URGENCY,
    BranchingQNetwork,
    MixtureOfExperts,
    Trunk,
    cosine_embedding,
    count_params,
    decay_mask,
    dueling_logits,
    expected_q,
    expert_outputs,
    flops_per_sample,
    greedy_action,
    init_params,
    init_params_batched,
    make_support,
    moe_mixture_reference,
    policy_aux,
    q_gap,
    q_variance,
)

W = 12  # small observation width
FLOW = (1, 2)
SMALL = ModelConfig(width=16, n_grn_blocks=1, n_experts=3, expert_hidden=8, gate_hidden=8,
                    head_hidden=8, n_atoms=11, v_min=-5.0, v_max=5.0, iqn_embed=4, iqn_n=3,
                    iqn_n_prime=5)


B, NQ = 8, 3  # one batch shape everywhere, so compiled programs are shared between tests
NET = BranchingQNetwork(SMALL, FLOW)
NET16 = BranchingQNetwork(dataclasses.replace(SMALL, matmul_dtype="bfloat16"), FLOW)
APPLY = jax.jit(NET.apply)
APPLY16 = jax.jit(NET16.apply)
TAUS = jax.random.uniform(jax.random.key(9), (B, NQ))


@pytest.fixture(scope="module")
def seed_params():
    """Three seeds' params from one vmapped, jitted init (compiled once for the module)."""
    return init_params_batched(NET, jax.random.split(jax.random.key(0), 3), W)


@pytest.fixture(scope="module")
def params(seed_params):
    return jax.tree.map(lambda x: x[0], seed_params)




def _net(cfg: ModelConfig = SMALL, flow=FLOW) -> BranchingQNetwork:
    return BranchingQNetwork(cfg, flow)


def without_direction_conditioning(params):
    """Zero the magnitude stream's weights on E[Q_dir]: then the stop-gradient in the
    conditioning changes nothing and finite differences are a valid gradient oracle."""
    p = jax.tree.map(lambda x: x, params)
    k = p["params"]["c51"]["magnitude_fc"]["kernel"]
    p["params"]["c51"]["magnitude_fc"]["kernel"] = k.at[-SMALL.branch_sizes[0]:].set(0.0)
    return p


def _obs(b: int = B, seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (b, W))


@pytest.mark.parametrize("matmul_dtype", ["float32", "bfloat16"])
def test_forward_shapes_and_dtypes(params, matmul_dtype):
    for leaf in jax.tree.leaves(params):
        chex.assert_type(leaf, jnp.float32)  # params are float32 in every precision mode
    apply = APPLY16 if matmul_dtype == "bfloat16" else APPLY
    out = apply(params, _obs(), TAUS)
    for d, a in enumerate(SMALL.branch_sizes):
        chex.assert_shape(out.logits[d], (B, a, SMALL.n_atoms))
        chex.assert_shape([out.q[d], out.q_var[d]], (B, a))
        chex.assert_shape(out.quantiles[d], (B, a, NQ))
        chex.assert_type([out.logits[d], out.q[d], out.q_var[d], out.quantiles[d]], jnp.float32)
        chex.assert_tree_all_finite(out.logits[d])
        assert bool(jnp.all(out.q_var[d] >= 0))
    chex.assert_shape(out.gate, (B, SMALL.n_experts))
    chex.assert_shape(out.aux["selection"], (B, W))
    chex.assert_shape(out.aux["gate_util"], (SMALL.n_experts,))
    np.testing.assert_allclose(out.aux["gate_util"], out.gate.mean(0), rtol=1e-6)
    np.testing.assert_allclose(out.aux["gate_entropy"], np.log(SMALL.n_experts), rtol=1e-5)
    np.testing.assert_allclose(out.gate.sum(-1), 1.0, rtol=1e-6)


def test_bf16_matmuls_track_float32(params):
    q32 = APPLY(params, _obs(), TAUS).q
    q16 = APPLY16(params, _obs(), TAUS).q
    for a, b in zip(q32, q16, strict=True):
        np.testing.assert_allclose(a, b, atol=0.05 * SMALL.v_max)


def test_bf16_matmuls_really_run_in_bf16(params):
    hlo = jax.jit(NET16.apply).lower(params, _obs(), TAUS).as_text()
    assert re.search(r"dot_general.*bf16", hlo), "no bf16 matmul in the lowered program"
    hlo32 = jax.jit(NET.apply).lower(params, _obs(), TAUS).as_text()
    assert not re.search(r"dot_general.*bf16", hlo32)


def _dot_outputs(jaxpr) -> list[tuple[str, int]]:
    """(output dtype, output width) of every dot_general in a jaxpr, nested calls included."""
    return [(str(e.outvars[0].aval.dtype), e.outvars[0].aval.shape[-1])
            for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]


def test_bf16_mode_stores_activations_in_bf16_and_outputs_in_float32(params):
    """Mixed precision: every matmul writes a bf16 activation except those whose output a loss
    or softmax reads (the value and four advantage output layers, the IQN output layer, the MoE
    gate logits), which write float32, and the GRN blocks' parameter products W45·W1 and
    W45·b1 (parameters are float32). The gate-weighted expert bias Σ_k g_k b2_k rides in the
    MoE's bf16 output product (trunk._mix_with_bias_bf16), so no float32 [B, H] product is
    left in the forward pass. Checked by output width, so swapping which layer writes float32
    fails too (the C51 output layers write their atoms padded to Zp columns per action, see
    pad_atoms)."""
    from jdqn.networks.heads import ATOM_ALIGN

    z, sizes = -(-SMALL.n_atoms // ATOM_ALIGN) * ATOM_ALIGN, SMALL.branch_sizes
    assert z == 12  # SMALL's 11 atoms, padded
    wide = sorted([z, *(a * z for a in sizes), 1 + sum(sizes), SMALL.n_experts,
                   *[2 * SMALL.width] * (2 * SMALL.n_grn_blocks)])
    dots = _dot_outputs(jax.make_jaxpr(NET16.apply)(params, _obs(), TAUS).jaxpr)
    assert sorted(w for d, w in dots if d == "float32") == wide, dots
    assert {d for d, _ in dots} == {"float32", "bfloat16"}
    assert sum(d == "bfloat16" for d, _ in dots) >= 8, dots
    assert {d for d, _ in _dot_outputs(jax.make_jaxpr(NET.apply)(params, _obs(), TAUS).jaxpr)} == {
        "float32"}
    trunk = Trunk(SMALL.width, SMALL.n_grn_blocks, SMALL.n_experts, SMALL.expert_hidden,
                  SMALL.gate_hidden, "bfloat16")
    out = trunk.apply({"params": params["params"]["trunk"]}, _obs())
    assert out.h.dtype == jnp.bfloat16
    chex.assert_type([out.gate, out.selection], jnp.float32)


def test_bf16_bias_gradients_are_reduced_in_float32(params):
    """The bias gradient of a bf16 layer is a sum over the batch: it must accumulate in float32
    (every reduce_sum in the backward pass of the bf16 model runs in float32)."""
    def loss(p):
        out = NET16.apply(p, _obs(), TAUS)
        return sum(jnp.sum(lg) for lg in out.logits) + sum(jnp.sum(q) for q in out.quantiles)

    def reduces(jaxpr):  # dtypes of real sums (not squeezes)
        return [str(e.outvars[0].aval.dtype) for e in all_eqns(jaxpr)
                if e.primitive.name == "reduce_sum"
                and any(e.invars[0].aval.shape[a] > 1 for a in e.params["axes"])]

    dtypes = reduces(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
    assert dtypes and set(dtypes) == {"float32"}, dtypes


def test_init_vmapped_over_seeds_gives_different_params(seed_params):
    kernel = seed_params["params"]["trunk"]["proj"]["kernel"]  # [3, W, H]
    assert not np.allclose(kernel[0], kernel[1]) and not np.allclose(kernel[1], kernel[2])
    out = jax.jit(jax.vmap(NET.apply, in_axes=(0, None, None)))(seed_params, _obs(), TAUS)
    assert not np.allclose(out.q[0][0], out.q[0][1])


def test_dueling_identity_constant_advantage_shift_leaves_logits_unchanged(params):
    value = jax.random.normal(jax.random.key(0), (4, 11))
    adv = jax.random.normal(jax.random.key(1), (4, 3, 11))
    shift = jax.random.normal(jax.random.key(2), (4, 1, 11)) * 10.0  # per sample and atom
    np.testing.assert_allclose(dueling_logits(value, adv), dueling_logits(value, adv + shift),
                               atol=1e-5)
    # ... and through the network: a per-atom shift of a branch's advantage output bias.
    for d, name in enumerate(("direction", "magnitude", "order_type", "urgency")):
        a = SMALL.branch_sizes[d]
        c = jnp.tile(jnp.linspace(-3.0, 7.0, SMALL.n_atoms), a)  # bias layout [A_d * Z]
        shifted = jax.tree.map(lambda x: x, params)
        shifted["params"]["c51"][f"{name}_out"]["bias"] = (
            params["params"]["c51"][f"{name}_out"]["bias"] + c)
        before, after = APPLY(params, _obs(), TAUS), APPLY(shifted, _obs(), TAUS)
        np.testing.assert_allclose(before.logits[d], after.logits[d], atol=1e-5)
    # A shift that differs across actions does change them (the test can fail).
    bad = jax.random.normal(jax.random.key(3), (4, 3, 1))
    assert not np.allclose(dueling_logits(value, adv), dueling_logits(value, adv + bad))


def test_expected_q_variance_and_gap_match_numpy():
    logits = jax.random.normal(jax.random.key(0), (6, 4, 11)) * 2
    z = make_support(-5.0, 5.0, 11)
    p = np.exp(np.asarray(logits, np.float64))
    p /= p.sum(-1, keepdims=True)
    mean = (p * np.asarray(z)).sum(-1)
    var = (p * np.asarray(z) ** 2).sum(-1) - mean**2
    np.testing.assert_allclose(expected_q(logits, z), mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(q_variance(logits, z), var, rtol=1e-4, atol=1e-4)
    srt = np.sort(mean, -1)
    np.testing.assert_allclose(q_gap(jnp.asarray(mean)), srt[:, -1] - srt[:, -2], atol=1e-6)


def test_expected_q_is_softmax_weighted_support_at_any_offset_with_masked_atoms_and_its_grad():
    """``expected_q`` sums ``e·z`` and ``e`` in one pass (``e = exp(x − max)``) instead of
    normalising first: the same ``Σ softmax(x)·z`` as float64's, at logits offset by ±300
    (float32's exp alone would overflow or vanish), with atoms at −inf (weight 0), and with
    the gradient ``p·(z − E[Q])``."""
    k = jax.random.split(jax.random.key(5), 2)
    z = make_support(-10.0, 10.0, 51)
    base = np.asarray(jax.random.normal(k[0], (7, 3, 51)) * 4, np.float64)
    base[0, 0, 5:] = -np.inf  # only the first five atoms carry weight
    for offset in (0.0, 300.0, -300.0):
        x = (base + offset).astype(np.float32).astype(np.float64)  # what float32 holds
        p = np.exp(x - x.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        want = (p * np.asarray(z, np.float64)).sum(-1)
        got = expected_q(jnp.asarray(x, jnp.float32), z)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-5)
        assert float(got[0, 0]) <= float(z[4]) + 1e-5  # the masked atoms' values never enter
    with x64():
        x = jnp.asarray(base[1:])
        z64 = jnp.asarray(z, jnp.float64)
        cot = jax.random.normal(k[1], x.shape[:-1], jnp.float64)
        grad = jax.grad(lambda v: jnp.sum(cot * expected_q(v, z64)))(x)
        p = jax.nn.softmax(x, -1)
        q = jnp.sum(p * z64, -1, keepdims=True)
        np.testing.assert_allclose(grad, cot[..., None] * p * (z64 - q), rtol=1e-10, atol=1e-12)


def test_policy_aux_gives_direction_gap_and_variance_of_chosen_direction(params):
    out = APPLY(params, _obs(), TAUS)
    direction = jnp.array([0, 1, 2, 3, 0, 1, 2, 3], jnp.int32)
    gap, var = policy_aux(out, direction)
    chex.assert_shape([gap, var], (8,))
    np.testing.assert_allclose(var, out.q_var[DIRECTION][jnp.arange(8), direction])
    np.testing.assert_allclose(gap, q_gap(out.q[DIRECTION]))
    act = greedy_action(out)
    chex.assert_shape(act, (8, 4))
    chex.assert_type(act, jnp.int32)


def test_magnitude_loss_cannot_move_direction_stream(params):
    """Gradient policy: E[Q_dir] enters the magnitude stream through a stop-gradient."""

    def mag(p):
        return jnp.sum(NET.apply(p, _obs(), TAUS).logits[MAGNITUDE] ** 2)

    g = jax.jit(jax.grad(mag))(params)["params"]["c51"]
    for name in ("direction_fc", "direction_out"):
        for leaf in jax.tree.leaves(g[name]):
            assert np.all(np.asarray(leaf) == 0.0), name
    assert np.any(np.asarray(g["magnitude_out"]["kernel"]) != 0.0)
    # ... but the conditioning is real: moving the direction stream changes magnitude logits.
    moved = jax.tree.map(lambda x: x, params)
    moved["params"]["c51"]["direction_out"]["bias"] = (
        params["params"]["c51"]["direction_out"]["bias"]
        + jax.random.normal(jax.random.key(5), params["params"]["c51"]["direction_out"]["bias"]
                            .shape))
    assert not np.allclose(APPLY(params, _obs(), TAUS).logits[MAGNITUDE],
                           APPLY(moved, _obs(), TAUS).logits[MAGNITUDE])


def test_order_type_and_urgency_read_order_flow_features(params):
    c51 = params["params"]["c51"]
    for name in ("order_type_fc", "urgency_fc"):
        assert c51[name]["kernel"].shape[0] == SMALL.width + len(FLOW)
    assert c51["magnitude_fc"]["kernel"].shape[0] == SMALL.width + SMALL.branch_sizes[0]
    assert c51["direction_fc"]["kernel"].shape[0] == SMALL.width
    no_flow = jax.eval_shape(lambda k: init_params(_net(flow=()), k, W), jax.random.key(0))
    assert no_flow["params"]["c51"]["order_type_fc"]["kernel"].shape[0] == SMALL.width

    # The flow columns reach the order-type/urgency heads directly (beyond the trunk): the
    # gradient w.r.t. obs[:, flow] changes when the direct flow weights are zeroed.
    @jax.jit
    def flow_grads(p):
        def f(obs):
            q = NET.apply(p, obs, TAUS).q
            return jnp.sum(q[ORDER_TYPE]), jnp.sum(q[URGENCY])

        return jax.jacrev(f)(_obs())

    cut = jax.tree.map(lambda x: x, params)
    for name in ("order_type_fc", "urgency_fc"):
        k = params["params"]["c51"][name]["kernel"]
        cut["params"]["c51"][name]["kernel"] = k.at[SMALL.width:].set(0.0)
    for g_full, g_cut in zip(flow_grads(params), flow_grads(cut), strict=True):
        assert not np.allclose(g_full[:, FLOW], g_cut[:, FLOW])


def _moe_setup(zero_gate: bool):
    moe = MixtureOfExperts(n_experts=4, hidden=5, gate_hidden=6)
    x = jax.random.normal(jax.random.key(0), (7, 9))
    obs = jax.random.normal(jax.random.key(1), (7, W))
    params = moe.init(jax.random.key(2), x, obs)
    if not zero_gate:
        gk = params["params"]["gate_out"]["kernel"]
        params["params"]["gate_out"]["kernel"] = jax.random.normal(jax.random.key(3), gk.shape)
    return moe, params, x, obs


def test_zero_initialised_gate_gives_mean_of_experts():
    moe, params, x, obs = _moe_setup(zero_gate=True)
    out = moe.apply(params, x, obs)
    np.testing.assert_allclose(out.gate, 0.25, rtol=1e-6)
    experts = expert_outputs(params["params"], x)  # [B, K, H]
    np.testing.assert_allclose(out.h, experts.mean(axis=1), rtol=1e-5, atol=1e-6)
    assert not np.allclose(experts[:, 0], experts[:, 1])  # experts do differ


def test_moe_fused_mixture_equals_reference_mixture():
    moe, params, x, obs = _moe_setup(zero_gate=False)
    out = moe.apply(params, x, obs)
    assert not np.allclose(out.gate, 0.25)
    ref = moe_mixture_reference(out.gate, expert_outputs(params["params"], x))
    np.testing.assert_allclose(out.h, ref, rtol=1e-5, atol=1e-5)


def test_moe_mixture_gradients_match_finite_differences():
    moe, params, x, obs = _moe_setup(zero_gate=False)
    with x64():
        p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
        x64_, obs64 = jnp.asarray(x, jnp.float64), jnp.asarray(obs, jnp.float64)

        @jax.jit
        def f(p, xx):
            return jnp.sum(jnp.tanh(moe.apply(p, xx, obs64).h))

        check_grads(f, (p64, x64_), order=1, modes=("rev",), eps=1e-6, atol=1e-5, rtol=1e-5)
        gate = jax.nn.softmax(jax.random.normal(jax.random.key(4), (7, 4), jnp.float64))
        e = jax.random.normal(jax.random.key(5), (7, 4, 9), jnp.float64)
        check_grads(moe_mixture_reference, (gate, e), order=1, modes=("rev",), eps=1e-6)


def test_moe_output_bias_rides_in_the_mixture_product():
    """The float32 MoE output ``weighted @ w2 + gate @ b2`` runs forward as one product over
    ``[weighted, gate]`` (no separate bias pass) and backward as the two separate products:
    the same values, gradients and forward-mode derivatives as the two-product form (float64),
    also vmapped over the parameters with a shared input (the paired online/target forward
    at s′)."""
    from jdqn.networks.trunk import _mix_with_bias

    k = jax.random.split(jax.random.key(11), 5)
    b, ke, n_k, h = 6, 12, 3, 5
    with x64():
        weighted = jax.random.normal(k[0], (b, ke), jnp.float64)
        gate = jax.nn.softmax(jax.random.normal(k[1], (b, n_k), jnp.float64))
        w2 = jax.random.normal(k[2], (ke, h), jnp.float64)
        b2 = jax.random.normal(k[3], (n_k, h), jnp.float64)
        ct = jax.random.normal(k[4], (b, h), jnp.float64)

        def two(wt, g, w, c):
            return wt @ w + g @ c

        args = (weighted, gate, w2, b2)
        np.testing.assert_allclose(_mix_with_bias(*args), two(*args), rtol=1e-13)
        grads = [jax.grad(lambda *a, f=f: jnp.vdot(ct, f(*a)), argnums=(0, 1, 2, 3))(*args)
                 for f in (_mix_with_bias, two)]
        for g_fold, g_two in zip(*grads, strict=True):
            np.testing.assert_allclose(g_fold, g_two, rtol=1e-12, atol=1e-13)
        tangents = tuple(jax.random.normal(jax.random.key(30 + i), a.shape, jnp.float64)
                         for i, a in enumerate(args))
        np.testing.assert_allclose(jax.jvp(_mix_with_bias, args, tangents)[1],
                                   jax.jvp(two, args, tangents)[1], rtol=1e-12, atol=1e-13)
        pair_w, pair_b = jnp.stack([w2, -w2]), jnp.stack([b2, 2 * b2])
        np.testing.assert_allclose(
            jax.vmap(_mix_with_bias, in_axes=(None, None, 0, 0))(weighted, gate, pair_w, pair_b),
            jnp.stack([two(weighted, gate, w2, b2), two(weighted, gate, -w2, 2 * b2)]),
            rtol=1e-12)
        # one forward product over the K·E + K columns; the backward's are the separate ones
        jaxpr = jax.make_jaxpr(jax.grad(lambda *a: jnp.vdot(ct, _mix_with_bias(*a)),
                                        argnums=(0, 1, 2, 3)))(*args)
        dots = dot_contractions(jaxpr.jaxpr)
        outputs = {tuple(sorted(shape)) for _, shape in dots}  # either orientation
        assert [n for n, _ in dots].count(ke + n_k) == 1
        assert tuple(sorted((ke + n_k, h))) not in outputs
        assert {tuple(sorted((ke, h))), tuple(sorted((n_k, h)))} <= outputs


def _mix_separate_bf16(weighted, gate, w2, b2):
    """The bf16 MoE output as the layer computed it before ``_mix_with_bias_bf16``: the
    mixture as a bf16 GEMM writing bf16, the gate-weighted bias in float32, added in float32
    and rounded once."""
    from jdqn.networks.trunk import _einsum

    h = _einsum("bk,kh->bh", weighted, w2, "bfloat16", jnp.bfloat16)
    return (h.astype(jnp.float32) + gate @ b2.astype(gate.dtype)).astype(jnp.bfloat16)


def test_bf16_moe_output_bias_rides_in_the_mixture_product_split_into_bf16_halves():
    """bf16: ``weighted @ w2 + gate @ b2`` as one bf16 GEMM over ``[weighted, g_hi, g_hi,
    g_lo]`` and ``[w2; b_hi; b_lo; b_hi]``: the exact sum (float64, of the bf16 mixture
    operands and the float32 gate and bias) rounded once to bf16 — correctly rounded where
    the separate form (its GEMM's output rounded before the bias is added) and bf16 operands
    for the bias alone are not; the derivative is bit for bit the separate form's, also
    vmapped over the parameters (the paired forward at s′)."""
    from jdqn.networks.trunk import _mix_with_bias_bf16

    k = jax.random.split(jax.random.key(12), 5)
    b, ke, n_k, h = 256, 24, 3, 8
    weighted = jax.random.normal(k[0], (b, ke)).astype(jnp.bfloat16)
    gate = jax.nn.softmax(2 * jax.random.normal(k[1], (b, n_k)))
    w2 = 0.3 * jax.random.normal(k[2], (ke, h))
    b2 = 3.0 + jax.random.normal(k[3], (n_k, h))
    args = (weighted, gate, w2, b2)

    def as64(a):
        return np.asarray(a, np.float64)

    def to_bf16(a):  # float64 → nearest bf16 (via float32: no double-rounding tie here)
        return as64(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16))

    mixture = as64(weighted) @ as64(w2.astype(jnp.bfloat16))
    nearest = to_bf16(mixture + as64(gate) @ as64(b2))
    fused = _mix_with_bias_bf16(*args)
    assert fused.dtype == jnp.bfloat16
    separate = as64(_mix_separate_bf16(*args))
    plain = to_bf16(mixture + as64(gate.astype(jnp.bfloat16)) @ as64(b2.astype(jnp.bfloat16)))
    hits = [np.mean(a == nearest) for a in (as64(fused), separate, plain)]
    assert hits[0] >= 0.99 and hits[1] < 0.95 and hits[2] < 0.9, hits
    np.testing.assert_allclose(as64(fused), nearest, rtol=2.0**-7)
    ct = jax.random.normal(k[4], (b, h))
    grads = [jax.grad(lambda *a, f=f: jnp.vdot(ct, f(*a).astype(jnp.float32)),
                      argnums=(0, 1, 2, 3))(*args)
             for f in (_mix_with_bias_bf16, _mix_separate_bf16)]
    for g_fold, g_two in zip(*grads, strict=True):
        np.testing.assert_array_equal(g_fold, g_two)
    tangents = tuple(jax.random.normal(jax.random.key(40 + i), a.shape).astype(a.dtype)
                     for i, a in enumerate(args))
    np.testing.assert_array_equal(jax.jvp(_mix_with_bias_bf16, args, tangents)[1],
                                  jax.jvp(_mix_separate_bf16, args, tangents)[1])
    pair_w, pair_b = jnp.stack([w2, -w2]), jnp.stack([b2, 2 * b2])
    pair = jax.vmap(_mix_with_bias_bf16, in_axes=(None, None, 0, 0))(weighted, gate, pair_w,
                                                                    pair_b)
    np.testing.assert_array_equal(pair[0], fused)
    np.testing.assert_array_equal(pair[1], _mix_with_bias_bf16(weighted, gate, -w2, 2 * b2))
    # one forward product over K·E + 3K columns; the derivative's products are the separate
    # form's (K·E and K wide), and the float32 [B, H] bias product is gone from the forward
    fwd = dot_contractions(jax.make_jaxpr(_mix_with_bias_bf16)(*args).jaxpr)
    assert [n for n, _ in fwd] == [ke + 3 * n_k]
    jaxpr = jax.make_jaxpr(jax.grad(lambda *a: jnp.vdot(ct, _mix_with_bias_bf16(*a).astype(
        jnp.float32)), argnums=(0, 1, 2, 3)))(*args)
    dots = dot_contractions(jaxpr.jaxpr)
    outputs = {tuple(sorted(shape)) for _, shape in dots}  # either orientation
    assert [n for n, _ in dots].count(ke + 3 * n_k) == 1
    assert {tuple(sorted((ke, h))), tuple(sorted((n_k, h))), (n_k, b)} <= outputs


def test_moe_layer_folds_the_output_bias_into_its_product_in_both_precisions():
    moe = MixtureOfExperts(n_experts=4, hidden=5, gate_hidden=6)
    x = jax.random.normal(jax.random.key(0), (7, 9))
    obs = jax.random.normal(jax.random.key(1), (7, W))
    params = moe.init(jax.random.key(2), x, obs)
    params["params"]["experts_out"]["bias"] = jax.random.normal(jax.random.key(3), (4, 9))

    def contractions(m):  # the output layer: one product over K·E + K, or K·E and K apart
        return [n for n, _ in dot_contractions(
            jax.make_jaxpr(lambda p: m.apply(p, x, obs).h)(params).jaxpr)]

    assert 4 * 5 + 4 in contractions(moe)
    bf16 = MixtureOfExperts(n_experts=4, hidden=5, gate_hidden=6, matmul_dtype="bfloat16")
    assert 4 * 5 + 3 * 4 in contractions(bf16) and 4 not in contractions(bf16)
    np.testing.assert_allclose(
        bf16.apply(params, x, obs).h.astype(jnp.float32),
        moe_mixture_reference(bf16.apply(params, x, obs).gate,
                              expert_outputs(params["params"], x, "bfloat16")),
        rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(
        moe.apply(params, x, obs).h,
        moe_mixture_reference(moe.apply(params, x, obs).gate,
                              expert_outputs(params["params"], x)), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_whole_network_gradients_match_finite_differences(params):
    net = NET
    params = without_direction_conditioning(params)
    with x64():
        p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
        obs = jnp.asarray(_obs(3), jnp.float64)
        taus = jnp.asarray([[0.1, 0.5], [0.3, 0.9], [0.7, 0.2]], jnp.float64)

        @jax.jit
        def f(p):
            out = net.apply(p, obs, taus)
            return sum(jnp.sum(jnp.sin(q)) for q in out.q + out.quantiles)

        check_grads(f, (p64,), order=1, modes=("rev",), eps=1e-6, atol=1e-5, rtol=1e-5)


def test_iqn_head_cosine_embedding_and_partial_rows(params):
    taus = jnp.array([[0.0, 0.25, 1.0]])
    emb = cosine_embedding(taus, 3)  # cos(π i τ), i = 0, 1, 2
    np.testing.assert_allclose(emb[0, 1], [1.0, np.cos(np.pi / 4), np.cos(np.pi / 2)], atol=1e-6)
    apply = jax.jit(NET.apply, static_argnames="tau_rows")
    obs = _obs(6)
    taus = jax.random.uniform(jax.random.key(1), (2, 5))
    part = apply(params, obs, taus, tau_rows=2).quantiles  # quantiles for rows 0..1 only
    full = apply(params, obs[:2], taus).quantiles
    for a, b in zip(part, full, strict=True):
        chex.assert_shape(a, (2, b.shape[1], 5))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shared_taus", [False, True])
def test_analytic_flops_match_xla_cost_analysis(shared_taus):
    cfg = ModelConfig()
    net = BranchingQNetwork(cfg, (3, 4, 5))
    params = jax.eval_shape(lambda k: init_params(net, k, 128), jax.random.key(0))
    q = 4

    def cost_flops(b):
        lowered = jax.jit(net.apply).lower(params, jax.ShapeDtypeStruct((b, 128), jnp.float32),
                                           jax.ShapeDtypeStruct((q,) if shared_taus else (b, q),
                                                                jnp.float32))
        if not hasattr(lowered, "cost_analysis"):
            pytest.skip("this JAX has no Lowered.cost_analysis")
        cost = lowered.cost_analysis()  # XLA's HLO cost model, no compilation needed
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        if not cost or "flops" not in cost:
            pytest.skip("this backend reports no cost analysis")
        return cost["flops"]

    # Per observation: what grows from 64 to 128 rows. Parameter-sized products (each GRN
    # block's W45·W1, the τ embedding of fractions shared by the batch) do not, and cancel.
    per_row = (cost_flops(128) - cost_flops(64)) / 64
    analytic = flops_per_sample(cfg, 128, n_flow=3, n_quantiles=q, shared_taus=shared_taus)
    # within 2 % (elementwise work is not counted); the other τ mode's count is 4-6 % off
    assert abs(analytic - per_row) / per_row < 0.02, (analytic, per_row)
    other = flops_per_sample(cfg, 128, n_flow=3, n_quantiles=q, shared_taus=not shared_taus)
    assert abs(other - per_row) > 2 * abs(analytic - per_row)


def test_decay_mask_decays_kernels_only(params):
    mask = decay_mask(params)
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(mask)}
    assert flat["['params']['trunk']['moe']['experts_in']['kernel']"] is True
    assert flat["['params']['trunk']['moe']['experts_out']['bias']"] is False
    assert flat["['params']['trunk']['grn_0']['norm']['scale']"] is False
    assert flat["['params']['c51']['value_out']['kernel']"] is True


DEFAULT_PARAM_COUNT = 1_158_816  # ModelConfig() defaults, W = 128, no flow features


def test_default_param_count_matches_docs(capsys):
    n = count_params(ModelConfig(), obs_width=128, flow_idx=())
    with capsys.disabled():
        print(f"\ndefault model parameter count (W=128, no flow features): {n:,}")
    assert n == DEFAULT_PARAM_COUNT
    # Each order-flow feature adds one input row to the order-type and urgency streams.
    assert count_params(ModelConfig(), 128, (5, 6, 7)) == n + 3 * 2 * ModelConfig().head_hidden
    doc = (Path(__file__).resolve().parents[1] / "docs" / "model.md").read_text()
    assert f"{DEFAULT_PARAM_COUNT:,}" in doc


def _reference_head(p, h, obs, flow):
    """The textbook head: one Dense→ReLU→Dense per stream on concatenated inputs."""
    from jdqn.networks.heads import BRANCH_NAMES, dueling_logits

    b = h.shape[0]
    support = make_support(SMALL.v_min, SMALL.v_max, SMALL.n_atoms, h.dtype)

    def stream(x, name):
        hid = jax.nn.relu(x @ p[f"{name}_fc"]["kernel"] + p[f"{name}_fc"]["bias"])
        return hid @ p[f"{name}_out"]["kernel"] + p[f"{name}_out"]["bias"]

    value = stream(h, "value")

    def branch(x, d):
        adv = stream(x, BRANCH_NAMES[d]).reshape(b, SMALL.branch_sizes[d], SMALL.n_atoms)
        return dueling_logits(value, adv)

    direction = branch(h, 0)
    q_dir = jax.lax.stop_gradient(jnp.sum(jax.nn.softmax(direction, -1) * support, -1)) / max(
        abs(SMALL.v_min), abs(SMALL.v_max))  # the conditioning carries no gradient (SPEC §4)
    h_flow = jnp.concatenate([h, obs[:, np.asarray(flow)]], -1) if flow else h
    return (direction, branch(jnp.concatenate([h, q_dir], -1), 1), branch(h_flow, 2),
            branch(h_flow, 3))


@pytest.mark.parametrize("flow", [FLOW, (), tuple(range(1, 11))])  # 10 > 8: the matmul path
def test_fused_head_equals_five_separate_dense_streams(flow):
    """The head runs its five first layers as one matmul and adds the conditioning rows as small
    products; it must equal the textbook definition with the same parameters."""
    from jdqn.networks.heads import DuelingBranchingHead

    head = DuelingBranchingHead(SMALL.branch_sizes, SMALL.n_atoms, SMALL.head_hidden,
                                SMALL.v_min, SMALL.v_max, flow)
    k = jax.random.split(jax.random.key(11), 3)
    with x64():
        h = jax.random.normal(k[0], (9, SMALL.width), jnp.float64)
        obs = jax.random.normal(k[1], (9, 12), jnp.float64)
        params = jax.tree.map(lambda x: x.astype(jnp.float64), head.init(k[2], h, obs))
        # same values and gradients (the centring on the weights is a projection of theirs)
        _assert_same_values_and_grads(lambda p: head.apply(p, h, obs),
                                      lambda p: _reference_head(p["params"], h, obs, flow),
                                      params)


def test_pad_atoms_pads_each_action_and_leaves_aligned_atoms_alone():
    from jdqn.networks.heads import ATOM_ALIGN, pad_atoms

    assert ATOM_ALIGN == 4  # 16 bytes of float32 (Z = 51 → 52)
    kernel = jnp.arange(3 * 2 * 5, dtype=jnp.float32).reshape(3, 10) + 1  # 2 actions × 5 atoms
    bias = jnp.arange(10, dtype=jnp.float32) + 1
    k, b, zp = pad_atoms(kernel, bias, 2)
    assert zp == 8 and k.shape == (3, 16) and b.shape == (16,)
    np.testing.assert_array_equal(k.reshape(3, 2, 8)[:, :, :5], kernel.reshape(3, 2, 5))
    np.testing.assert_array_equal(b.reshape(2, 8)[:, :5], bias.reshape(2, 5))
    assert not np.any(k.reshape(3, 2, 8)[:, :, 5:]) and not np.any(b.reshape(2, 8)[:, 5:])
    k, b, zp = pad_atoms(kernel[:, :8], bias[:8], 2)  # 4 atoms: aligned already
    assert zp == 4
    np.testing.assert_array_equal(k, kernel[:, :8])
    np.testing.assert_array_equal(b, bias[:8])


def test_c51_output_layers_write_their_atoms_padded_to_aligned_rows(params):
    """Every C51 output-layer GEMM writes Zp = 12 columns per action (SMALL's 11 atoms rounded
    up to a multiple of 4), none writes the unpadded Z; the logits are Z wide (the values are
    the textbook head's: test_fused_head_equals_five_separate_dense_streams)."""
    z, zp, sizes = SMALL.n_atoms, 12, SMALL.branch_sizes
    widths = [w for _, w in _dot_outputs(jax.make_jaxpr(NET.apply)(params, _obs()).jaxpr)]
    assert W == zp  # the variable-selection layer writes W = 12 columns as well
    assert sorted(w for w in widths if w % zp == 0 and w <= max(sizes) * zp) == sorted(
        [W, zp, *(a * zp for a in sizes)])
    assert not {z, *(a * z for a in sizes)} & set(widths)
    for lg, a in zip(APPLY(params, _obs()).logits, sizes, strict=True):
        chex.assert_shape(lg, (B, a, z))


def _assert_same_values_and_grads(fn, ref, params):
    """``fn(params)`` and ``ref(params)`` (tuples of float64 arrays) agree, and so do the
    gradients of a random linear functional of them w.r.t. every parameter. Each side runs as
    one jitted program (eagerly, every small operation would compile on its own)."""
    got, want = jax.jit(fn)(params), jax.jit(ref)(params)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    cts = [jax.random.normal(jax.random.key(i), g.shape, jnp.float64) for i, g in enumerate(got)]

    def loss(out):
        return sum(jnp.vdot(c, o) for c, o in zip(cts, out, strict=True))

    g_fn = jax.jit(jax.grad(lambda p: loss(fn(p))))(params)
    g_ref = jax.jit(jax.grad(lambda p: loss(ref(p))))(params)
    for g, w in zip(jax.tree.leaves(g_fn), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_iqn_head_equals_the_textbook_dueling_quantiles():
    """The IQN head centres its advantage columns in the output layer's weights; values and
    gradients equal the textbook ``value + A − mean_a A`` on the uncentred dense stack."""
    from jdqn.networks.heads import IQNHead, iqn_features

    sizes = SMALL.branch_sizes
    head = IQNHead(sizes, SMALL.iqn_embed, SMALL.head_hidden)
    k = jax.random.split(jax.random.key(5), 3)
    with x64():
        h = jax.random.normal(k[0], (7, SMALL.width), jnp.float64)
        taus = jax.random.uniform(k[1], (7, 5), jnp.float64)
        params = jax.tree.map(lambda x: x.astype(jnp.float64), head.init(k[2], h, taus))
        params = jax.tree.map(lambda x: x + 0.1 * jnp.arange(x.size).reshape(x.shape) % 0.7,
                              params)  # non-zero biases

        def reference(p):
            p = p["params"]
            out = iqn_features(h, taus, *(p[n][w] for n in ("tau_embed", "fc", "out")
                                          for w in ("kernel", "bias")), "float32")
            value, adv, res, start = out[..., :1], out[..., 1:], [], 0
            for a in sizes:
                adv_d = adv[..., start:start + a]
                start += a
                res.append(jnp.swapaxes(value + adv_d - adv_d.mean(-1, keepdims=True), 1, 2))
            return tuple(res)

        _assert_same_values_and_grads(lambda p: head.apply(p, h, taus), reference, params)


@pytest.mark.parametrize("width", [16, 24])
def test_grn_block_is_the_textbook_three_layer_grn(width):
    """The GRN block applies its ``fc`` and ``glu`` layers as one product of their weights; it
    must equal TFT's GRN (Lim et al. 2021, eq. 2–5) written with three separate dense layers,
    values and gradients w.r.t. every parameter and the input, in float64."""
    from jdqn.networks.trunk import GRNBlock

    block = GRNBlock(width)
    k = jax.random.split(jax.random.key(13), 2)
    with x64():
        x = jax.random.normal(k[0], (9, width), jnp.float64)
        params = jax.tree.map(lambda a: a.astype(jnp.float64), block.init(k[1], x))
        params = jax.tree.map(lambda a: a + 0.1 * jnp.arange(a.size).reshape(a.shape) % 0.7,
                              params)  # non-zero biases and norm offsets

        def textbook(p, x):
            p = p["params"]

            def dense(name, v):
                return v @ p[name]["kernel"] + p[name]["bias"]

            eta2 = jax.nn.elu(dense("fc_elu", x))
            eta1 = dense("fc", eta2)
            gate, value = jnp.split(dense("glu", eta1), 2, axis=-1)
            y = x + jax.nn.sigmoid(gate) * value
            mu = y.mean(-1, keepdims=True)
            var = ((y - mu) ** 2).mean(-1, keepdims=True)
            return (y - mu) / jnp.sqrt(var + 1e-6) * p["norm"]["scale"] + p["norm"]["bias"]

        _assert_same_values_and_grads(lambda p: (block.apply(p, x),),
                                      lambda p: (textbook(p, x),), params)
        ct = jax.random.normal(jax.random.key(3), x.shape, jnp.float64)
        dx = [jax.grad(lambda v, f=f: jnp.vdot(ct, f(v)))(x)
              for f in (lambda v: block.apply(params, v), lambda v: textbook(params, v))]
        np.testing.assert_allclose(dx[0], dx[1], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("groups", [0, 1, 3], ids=["shared", "one_group", "three_groups"])
def test_iqn_head_with_shared_fractions_is_the_per_row_head_at_those_fractions(groups):
    """taus [Q] (one set for every row) or [G, Q] (one per group of B/G rows): the modulation
    folded into the first layer's weights gives the per-row head's values and gradients at
    each row's fractions — w.r.t. every parameter and the trunk feature h."""
    from jdqn.networks.heads import IQNHead, iqn_features_shared

    head = IQNHead(SMALL.branch_sizes, SMALL.iqn_embed, SMALL.head_hidden)
    k = jax.random.split(jax.random.key(6), 3)
    n = 9
    with x64():
        h = jax.random.normal(k[0], (n, SMALL.width), jnp.float64)
        if groups == 0:
            taus = jax.random.uniform(k[1], (5,), jnp.float64)
            rows = jnp.broadcast_to(taus, (n, 5))
        else:
            taus = jax.random.uniform(k[1], (groups, 5), jnp.float64)
            rows = jnp.repeat(taus, n // groups, axis=0)
        params = jax.tree.map(lambda x: x.astype(jnp.float64), head.init(k[2], h, rows))
        params = jax.tree.map(lambda x: x + 0.1 * jnp.arange(x.size).reshape(x.shape) % 0.7,
                              params)  # non-zero biases, some φ units off (relu)
        _assert_same_values_and_grads(lambda p: head.apply(p, h, taus),
                                      lambda p: head.apply(p, h, rows), params)
        ct = [jax.random.normal(jax.random.key(20 + i), (n, a, 5), jnp.float64)
              for i, a in enumerate(SMALL.branch_sizes)]

        def dh(t):
            return jax.grad(lambda x: sum(jnp.vdot(c, q) for c, q in zip(
                ct, head.apply(params, x, t), strict=True)))(h)

        np.testing.assert_allclose(dh(taus), dh(rows), rtol=1e-12, atol=1e-12)
        # the shared form never builds a [B, Q, H] tensor: its largest is the [B, Q, F] layer
        p = params["params"]
        jaxpr = jax.make_jaxpr(lambda x: iqn_features_shared(
            x, taus, *(p[n][w] for n in ("tau_embed", "fc", "out") for w in ("kernel", "bias")),
            "float32"))(h)
        shapes = {tuple(v.aval.shape) for e in all_eqns(jaxpr.jaxpr) for v in e.outvars}
        assert (n, 5, SMALL.width) not in shapes and (n, 5, SMALL.head_hidden) in shapes
        if groups > 1:  # the groups' first layers: one batched product, not one per group
            dots = [e for e in all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"
                    and e.outvars[0].aval.shape == (groups, n // groups, 5 * SMALL.head_hidden)]
            assert len(dots) == 1
            with pytest.raises(ValueError, match="3 groups of IQN fractions do not divide the "
                                                 "8 rows"):
                iqn_features_shared(h[:8], taus, *(p[m][w] for m in ("tau_embed", "fc", "out")
                                                   for w in ("kernel", "bias")), "float32")


def _first_iqn_contraction(fn, *args, n_q: int = 5) -> set[int]:
    """The contraction lengths of the dot_generals in ``fn``'s jaxpr whose output is the IQN
    hidden layer's pre-activation (``… Q·F`` columns; pick Q so no other layer has as many)."""
    return {n for n, shape in dot_contractions(jax.make_jaxpr(fn)(*args).jaxpr)
            if shape[-1] == n_q * SMALL.head_hidden}


@pytest.mark.parametrize("groups", [0, 3], ids=["shared", "three_groups"])
def test_iqn_bias_in_the_first_product_is_the_same_function(groups):
    """``bias_in_product``: b1 as a weight row read by a constant-1 column of the padded h —
    the same values and gradients (float64, w.r.t. every parameter and h); the first product
    then contracts over H + 8. Not under bf16 matmuls or the Pallas bias reductions."""
    from jdqn.networks.heads import IQNHead, iqn_features_shared

    head = IQNHead(SMALL.branch_sizes, SMALL.iqn_embed, SMALL.head_hidden)
    fold = IQNHead(SMALL.branch_sizes, SMALL.iqn_embed, SMALL.head_hidden,
                   bias_in_product=True)
    k = jax.random.split(jax.random.key(7), 3)
    n = 9
    with x64():
        h = jax.random.normal(k[0], (n, SMALL.width), jnp.float64)
        taus = jax.random.uniform(k[1], (5,) if groups == 0 else (groups, 5), jnp.float64)
        params = jax.tree.map(lambda x: x.astype(jnp.float64), head.init(k[2], h, taus))
        params = jax.tree.map(lambda x: x + 0.1 * jnp.arange(x.size).reshape(x.shape) % 0.7,
                              params)  # non-zero biases, some hidden units off (relu)
        _assert_same_values_and_grads(lambda p: fold.apply(p, h, taus),
                                      lambda p: head.apply(p, h, taus), params)
        _assert_same_values_and_grads(lambda x: fold.apply(params, x, taus),
                                      lambda x: head.apply(params, x, taus), h)
        assert _first_iqn_contraction(lambda x: fold.apply(params, x, taus), h) == {
            SMALL.width + 8}
        assert _first_iqn_contraction(lambda x: head.apply(params, x, taus), h) == {SMALL.width}
        p = params["params"]
        weights = [p[m][w] for m in ("tau_embed", "fc", "out") for w in ("kernel", "bias")]
        for md, impl in (("bfloat16", "xla"), ("float32", "pallas")):
            assert _first_iqn_contraction(lambda x, md=md, impl=impl: iqn_features_shared(
                x, taus, *weights, md, impl, True), h) == {SMALL.width}


def test_network_puts_the_iqn_bias_in_the_product_only_where_no_gradient_is_taken(params):
    obs, taus = _obs(4), jax.random.uniform(jax.random.key(3), (7,))
    assert _first_iqn_contraction(lambda p: NET.apply(p, obs, taus, grad_free=True),
                                  params, n_q=7) == {SMALL.width + 8}
    assert _first_iqn_contraction(lambda p: NET.apply(p, obs, taus), params,
                                  n_q=7) == {SMALL.width}
    np.testing.assert_allclose(
        np.concatenate(NET.apply(params, obs, taus, grad_free=True).quantiles, axis=1),
        np.concatenate(NET.apply(params, obs, taus).quantiles, axis=1), rtol=1e-5, atol=1e-5)


def test_network_takes_shared_and_grouped_fractions_for_the_first_rows(params):
    obs = _obs(6)
    taus = jax.random.uniform(jax.random.key(3), (4,))
    part = jax.jit(NET.apply, static_argnames="tau_rows")(params, obs, taus,
                                                          tau_rows=2).quantiles
    rows = APPLY(params, obs[:2], jnp.broadcast_to(taus, (2, 4))).quantiles
    every = APPLY(params, obs, taus).quantiles
    for a, b, c in zip(part, rows, every, strict=True):
        chex.assert_shape(a, (2, b.shape[1], 4))
        chex.assert_shape(c, (6, b.shape[1], 4))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(c[:2], b, rtol=1e-5, atol=1e-5)
    # groups: [G, Q] over the first tau_rows rows, each group of tau_rows/G rows its own set
    groups = jax.random.uniform(jax.random.key(5), (2, 4))
    part = jax.jit(NET.apply, static_argnames="tau_rows")(params, obs, groups,
                                                          tau_rows=4).quantiles
    rows = APPLY(params, obs[:4], jnp.repeat(groups, 2, axis=0)).quantiles
    every = APPLY(params, obs, jnp.repeat(groups, 3, axis=0)).quantiles
    for a, b, c, d in zip(part, rows, APPLY(params, obs, groups).quantiles, every, strict=True):
        chex.assert_shape(a, (4, b.shape[1], 4))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(c, d, rtol=1e-5, atol=1e-5)  # default: all 6 rows, 3 each
    with pytest.raises(ValueError, match=r"tau_rows = 3 is not a multiple of the 2 rows"):
        NET.apply(params, obs, jnp.broadcast_to(taus, (2, 4)), tau_rows=3)
    with pytest.raises(ValueError, match=r"tau_rows = 6 is not a multiple of the 4 rows"):
        NET.apply(params, obs, jnp.zeros((4, 4)))
    with pytest.raises(ValueError, match="taus cover 8 rows but obs has 6"):
        NET.apply(params, obs, taus, tau_rows=8)
    with pytest.raises(ValueError, match=r"taus must be \[Q\], \[G, Q\] or \[B, Q\]"):
        NET.apply(params, obs, jnp.zeros((2, 2, 4)))


def test_shared_fractions_under_bf16_track_the_float32_head(params):
    taus = jax.random.uniform(jax.random.key(4), (3,))
    obs = _obs()
    got = APPLY16(params, obs, taus).quantiles
    want = APPLY(params, obs, jnp.broadcast_to(taus, (B, 3))).quantiles
    for g, w in zip(got, want, strict=True):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, w, rtol=0.05, atol=0.05 * float(jnp.max(jnp.abs(w))))


def test_fused_head_in_bf16_tracks_the_float32_reference():
    from jdqn.networks.heads import DuelingBranchingHead

    flow = tuple(range(1, 11))
    head = DuelingBranchingHead(SMALL.branch_sizes, SMALL.n_atoms, SMALL.head_hidden,
                                SMALL.v_min, SMALL.v_max, flow, matmul_dtype="bfloat16")
    k = jax.random.split(jax.random.key(12), 3)
    h, obs = jax.random.normal(k[0], (9, SMALL.width)), jax.random.normal(k[1], (9, 12))
    params = head.init(k[2], h, obs)
    chex.assert_trees_all_equal_dtypes(params, jax.tree.map(lambda x: x.astype(jnp.float32),
                                                            params))
    got = head.apply(params, h, obs)
    want = _reference_head(params["params"], h, obs, flow)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, w, atol=0.05)  # bf16 inputs: ~3 significant digits
        assert not np.array_equal(np.asarray(g), np.asarray(w))  # bf16 really ran
