"""The double-Q kernel (``jdqn.pallas.double_q``) against its plain-JAX oracle, in Pallas'
interpreter (CPU), and the loss's path through it.

GPU parity, bitwise determinism and speed at the update's shape: ``bench/kernels.py --kernel
double_q`` (results in ``bench/results/``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import pallas_kernel_names
from test_pallas import _small_batch

from jdqn.config import ModelConfig, TrainConfig
from jdqn.losses import init_moe_state
from jdqn.losses import total as total_module
from jdqn.networks import BranchingQNetwork, init_params
from jdqn.networks.heads import (
    MAGNITUDE,
    HeadStreams,
    expected_q,
    make_support,
    stream_logits,
)
from jdqn.pallas import double_q
from jdqn.pallas import project_uniform as project_dispatch

V_MIN, V_MAX = -10.0, 10.0


def _streams(seed: int, b: int, zp: int, sizes: tuple[int, ...], lead: tuple[int, ...] = (),
             scale: float = 1.0) -> HeadStreams:
    ks = iter(jax.random.split(jax.random.key(seed), 2 + 2 * len(sizes)))

    def normal(*shape):
        return scale * jax.random.normal(next(ks), (*lead, *shape), jnp.float32)

    return HeadStreams(normal(b, zp), normal(zp), tuple(normal(b, a * zp) for a in sizes),
                       tuple(normal(a * zp) for a in sizes))


def _pair(online: HeadStreams, target: HeadStreams) -> HeadStreams:
    return jax.tree.map(lambda o, t: jnp.stack([o, t]), online, target)


def _run(online, target, z, **kw):
    return double_q.double_q_next(online, target, z=z, v_min=V_MIN, v_max=V_MAX,
                                  interpret=True, **kw)


@pytest.mark.parametrize("b,z,zp,sizes,rows", [(37, 51, 52, (4, 3, 3, 3), 16),
                                               (16, 11, 12, (4, 2, 5, 1), 16),
                                               (1, 11, 12, (4, 3, 3, 3), 4)])
def test_kernel_matches_the_reference_pair_and_apart(b, z, zp, sizes, rows):
    """Greedy actions equal to the oracle's, the target's probabilities to float32 rounding and
    zero on the padded atoms; the pair (one ``[2, …]`` tree) and two networks give the same."""
    online = _streams(0, b, zp, sizes, scale=2.0)
    target = _streams(1, b, zp, sizes, scale=2.0)
    want_a, want_p = double_q.reference(online, target, z, V_MIN, V_MAX)
    zb = 1 << (z - 1).bit_length()
    assert want_a.shape == (b, 4) and want_p.shape == (b, 4, zb)
    assert want_a.dtype == jnp.int32
    np.testing.assert_array_equal(want_p[..., z:], 0.0)
    np.testing.assert_allclose(jnp.sum(want_p, -1), 1.0, rtol=1e-6)
    for got_a, got_p in (_run(online, target, z, rows=rows), _run(_pair(online, target), None, z,
                                                                  rows=rows)):
        np.testing.assert_array_equal(got_a, want_a)
        np.testing.assert_allclose(got_p, want_p, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got_p[..., z:], 0.0)
    pair_a, pair_p = double_q.reference(_pair(online, target), None, z, V_MIN, V_MAX)
    np.testing.assert_array_equal(pair_a, want_a)
    np.testing.assert_array_equal(pair_p, want_p)


def test_reference_is_the_losses_double_q_selection():
    """The oracle picks ``argmax_a E[Q_online]`` over the head's logits (each branch's actions
    differ in the chosen one: the test would see a wrong argmax) and returns the target's
    softmax at that action."""
    b, z, zp, sizes = 9, 11, 12, (4, 3, 3, 3)
    online, target = _streams(2, b, zp, sizes, scale=3.0), _streams(3, b, zp, sizes)
    a, p = double_q.reference(online, target, z, V_MIN, V_MAX)
    support = make_support(V_MIN, V_MAX, z)
    for d, (lo, lt) in enumerate(zip(stream_logits(online, z), stream_logits(target, z),
                                     strict=True)):
        q = np.asarray(expected_q(lo, support))  # [B, A_d]
        np.testing.assert_array_equal(a[:, d], np.argmax(q, axis=1))
        assert len(set(np.argmax(q, axis=1).tolist())) > 1  # the rows choose differently
        want = jax.nn.softmax(np.asarray(lt)[np.arange(b), np.argmax(q, axis=1)], axis=-1)
        np.testing.assert_allclose(p[:, d, :z], want, rtol=1e-6)


def test_ties_go_to_the_first_action_as_argmax():
    """Two actions with the same logits (the same expected Q, bitwise): the first is chosen,
    as ``jnp.argmax`` chooses, in every branch; a third, better action wins over both."""
    b, z, zp, sizes = 5, 11, 12, (4, 3, 3, 3)
    online, target = _streams(4, b, zp, sizes), _streams(5, b, zp, sizes)
    adv = []
    for x, a in zip(online.adv, sizes, strict=True):
        x = x.reshape(b, a, zp)
        # action 1 = action 2 on every atom, both far above action 0 (and action 3)
        hi = x[:, 0] + 5.0 * jnp.linspace(0.0, 1.0, zp)
        x = x.at[:, 1].set(hi)
        if a > 2:
            x = x.at[:, 2].set(hi)
        adv.append(x.reshape(b, a * zp))
    online = online._replace(adv=tuple(adv), adv_bias=tuple(jnp.zeros_like(x)
                                                            for x in online.adv_bias))
    got_a, _ = _run(online, target, z)
    np.testing.assert_array_equal(got_a, 1)
    np.testing.assert_array_equal(double_q.reference(online, target, z, V_MIN, V_MAX)[0], 1)


def test_empty_batch_and_branch_count():
    online = _streams(6, 0, 12, (4, 3, 3, 3))
    a, p = _run(online, online, 11)
    assert a.shape == (0, 4) and p.shape == (0, 4, 16)
    three = _streams(6, 4, 12, (4, 3, 3))
    with pytest.raises(ValueError, match="3 branches"):
        _run(three, three, 11)


def test_projection_reads_probabilities_padded_by_the_kernel():
    """The projection takes the kernel's zero-padded ``[B, D, Zb]`` probabilities as they are
    (no re-layout) and gives the same target as for the unpadded ones — in the kernel and the
    XLA path; any other atom count is refused."""
    from jdqn.pallas.projection import project_uniform_pallas

    b, z = 12, 11
    rng = np.random.default_rng(0)
    tz = jnp.asarray(rng.normal(0.0, 4.0, (b, 1)) + np.linspace(V_MIN, V_MAX, z), jnp.float32)
    probs = jnp.asarray(rng.dirichlet(np.ones(z), (b, 4)), jnp.float32)
    padded = jnp.pad(probs, ((0, 0), (0, 0), (0, 16 - z)))
    for impl in ("xla", "pallas"):
        want = project_dispatch(tz, probs, V_MIN, V_MAX, impl)
        np.testing.assert_array_equal(project_dispatch(tz, padded, V_MIN, V_MAX, impl), want)
    with pytest.raises(ValueError, match="13 atoms"):
        project_uniform_pallas(tz, padded[..., :13], V_MIN, V_MAX, interpret=True)


def test_head_streams_are_the_logits_products():
    """``head_streams=True`` returns the C51 head's output products and biases; their logits
    (:func:`stream_logits`) are the network's — bitwise but for the magnitude branch, whose
    conditioning on the direction's expected Q then comes from the kernel (float32 rounding) —
    and the rest of the output is the same."""
    cfg = ModelConfig(width=32, n_grn_blocks=1, n_experts=3, expert_hidden=8, gate_hidden=8,
                      head_hidden=16, n_atoms=11, iqn=False, impl="xla")
    net = BranchingQNetwork(cfg, flow_idx=(3, 5))
    params = init_params(net, jax.random.key(0), 24)
    obs = jax.random.normal(jax.random.key(1), (7, 24))
    want = net.apply(params, obs)
    got = net.apply(params, obs, head_streams=True)
    assert got.logits == () and got.q == () and want.streams is None
    assert got.streams.value.shape == (7, 12) and got.streams.adv[1].shape == (7, 3 * 12)
    for d, (a, b) in enumerate(zip(stream_logits(got.streams, 11), want.logits, strict=True)):
        if d == MAGNITUDE:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got.features, want.features)


def test_expected_q_from_streams_matches_the_logits_and_vmaps():
    """The direction's expected Q from the products (the magnitude stream's conditioning in
    the grad-free head) equals ``expected_q`` over the logits to float32 rounding, for one
    network and vmapped over the pair; an empty batch gives ``[0, A]``."""
    s = _streams(7, 37, 52, (4, 3, 3, 3), lead=(2,), scale=2.0)
    support = make_support(V_MIN, V_MAX, 51)

    def kernel(v, vb, a, ab):
        return double_q.expected_q_streams(v, vb, a, ab, 51, V_MIN, V_MAX, interpret=True)

    got = jax.vmap(kernel)(s.value, s.value_bias, s.adv[0], s.adv_bias[0])  # [2, B, 4]
    for i in range(2):
        one = jax.tree.map(lambda x: x[i], s)  # noqa: B023
        want = expected_q(stream_logits(one, 51)[0], support)
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)
    three = kernel(s.value[0], s.value_bias[0], s.adv[1][0], s.adv_bias[1][0])
    np.testing.assert_allclose(three, expected_q(stream_logits(jax.tree.map(
        lambda x: x[0], s), 51)[1], support), rtol=1e-5, atol=1e-5)
    assert kernel(s.value[0][:0], s.value_bias[0], s.adv[0][0][:0], s.adv_bias[0][0]).shape \
        == (0, 4)


def _loss_setup(matmul_dtype: str, fuse_next_obs: bool = False, iqn: bool = True):
    cfg = ModelConfig(width=32, n_grn_blocks=1, n_experts=3, expert_hidden=8, gate_hidden=8,
                      head_hidden=16, n_atoms=11, iqn=iqn, iqn_embed=8, iqn_n=4, iqn_n_prime=4,
                      impl="xla", matmul_dtype=matmul_dtype, fuse_next_obs=fuse_next_obs)
    net = BranchingQNetwork(cfg)
    k = jax.random.split(jax.random.key(0), 5)
    params, target = init_params(net, k[0], 24), init_params(net, k[1], 24)
    batch = _small_batch(k[2], k[3], len(cfg.branch_sizes), b=8)
    return functools.partial(total_module.total_loss, target_params=target, batch=batch,
                             key=k[4], moe_state=init_moe_state(3), alpha=0.5, net=net,
                             train_cfg=TrainConfig()), params


def _only_double_q(monkeypatch):
    monkeypatch.setattr(total_module, "use_pallas",
                        lambda impl, kernel: kernel == "double_q")


@pytest.mark.parametrize("matmul_dtype", ["float32", "bfloat16"])
def test_total_loss_through_the_kernel_equals_the_xla_path(monkeypatch, matmul_dtype):
    """The loss with the double-Q kernel (float32: the paired forward at s′; bf16: the two
    forwards apart) has the XLA path's value, per-sample losses and components, C51 and IQN
    targets included."""
    loss, params = _loss_setup(matmul_dtype)
    want, (want_c, want_ps, _, want_diag) = jax.jit(loss)(params)
    _only_double_q(monkeypatch)
    got, (got_c, got_ps, _, got_diag) = jax.jit(loss)(params)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got_ps, want_ps, rtol=1e-6)
    for name in ("c51", "mse", "iqn"):
        np.testing.assert_allclose(got_c[name], want_c[name], rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(got_diag["target_mean"], want_diag["target_mean"], rtol=1e-6,
                               atol=1e-7)


@pytest.mark.parametrize("fuse_next_obs,matmul_dtype,n_kernels,n_conditioning",
                         [(False, "float32", 1, 1), (False, "bfloat16", 1, 2),
                          (True, "float32", 0, 0)])
def test_total_loss_runs_the_kernel_once_where_it_applies(monkeypatch, fuse_next_obs,
                                                          matmul_dtype, n_kernels,
                                                          n_conditioning):
    """One double-Q kernel per update, paired or not, and the direction's expected Q for the
    magnitude conditioning from the products once per forward at s′ (one vmapped call for the
    pair); none with the concatenated [s; s′] forward (the online Q at s′ comes from the
    differentiated forward there); the gradient traces through them (their outputs are
    targets and a stop-gradient conditioning: no cotangent reaches them)."""
    loss, params = _loss_setup(matmul_dtype, fuse_next_obs)
    _only_double_q(monkeypatch)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: loss(p)[0]))(params).jaxpr
    names = pallas_kernel_names(jaxpr)
    assert names.count("double_q_next") == n_kernels
    assert names.count("expected_q_streams") == n_conditioning
    assert total_module.double_q_applies(dataclasses.replace(
        BranchingQNetwork(ModelConfig()).cfg, fuse_next_obs=fuse_next_obs)) is (n_kernels == 1)


def test_auto_takes_the_kernel_on_the_gpu_only(monkeypatch):
    from jdqn import pallas

    assert "double_q" in pallas.GPU_VALIDATED
    assert not pallas.use_pallas("auto", "double_q") or jax.default_backend() == "gpu"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert pallas.use_pallas("auto", "double_q")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_c51_terms_take_the_selected_probabilities(impl):
    """The C51 loss terms from the kernel's zero-padded probabilities equal those from the
    target logits, through the XLA path and through the fused C51 loss kernel (which takes
    logits: it is given ``log p``)."""
    from jdqn.pallas import c51_terms

    b, z = 10, 11
    rng = np.random.default_rng(1)
    taken = jnp.asarray(rng.normal(0.0, 1.0, (b, 4, z)), jnp.float32)
    nxt = jnp.asarray(rng.normal(0.0, 1.0, (b, 4, z)), jnp.float32)
    tz = jnp.asarray(rng.normal(0.0, 4.0, (b, 1)) + np.linspace(V_MIN, V_MAX, z), jnp.float32)
    padded = jnp.pad(jax.nn.softmax(nxt, axis=-1), ((0, 0), (0, 0), (0, 16 - z)))
    want = c51_terms(taken, nxt, tz, V_MIN, V_MAX, "xla")
    got = c51_terms(taken, None, tz, V_MIN, V_MAX, impl, probs=padded)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
