"""Pallas kernels against their plain-JAX oracles, in Pallas' interpreter (CPU).

GPU parity, bitwise determinism and speed at production shapes: ``bench/kernels.py``
(results in ``bench/results/``).
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_grads_close, assert_loss_and_grads_close, x64

from jdqn.config import ConfigError, ModelConfig, TrainConfig, config_from_dict
from jdqn.losses import init_moe_state, total_loss
from jdqn.losses.batch import project_uniform
from jdqn.networks import BranchingQNetwork, init_params
from jdqn.pallas import c51_terms, use_pallas
from jdqn.pallas import project_uniform as project_dispatch
from jdqn.pallas.projection import ROWS_PER_PROGRAM, project_uniform_pallas


def _inputs(b, d, z, v_min, v_max, case, seed=0):
    rng = np.random.default_rng(seed)
    support = np.linspace(v_min, v_max, z)
    r = rng.normal(0, (v_max - v_min) / 6, b)
    disc = rng.uniform(0.0, 1.0, b)
    if case == "far_outside":
        r = rng.choice([-1.0, 1.0], b) * rng.uniform(v_max, 1e4, b)
    elif case == "done":
        disc[:] = 0.0
    elif case == "on_atoms":
        dz = (v_max - v_min) / (z - 1)
        r, disc = dz * rng.integers(-(z // 2), z // 2, b), np.ones(b)
    probs = rng.dirichlet(np.ones(z) * 0.3, (b, d))
    return np.float32(r[:, None] + disc[:, None] * support), np.float32(probs)


@pytest.mark.parametrize("b,d,z", [(1, 1, 2), (ROWS_PER_PROGRAM, 4, 51), (45, 4, 51),
                                   (70, 3, 64), (9, 2, 21), (33, 4, 101)])
@pytest.mark.parametrize("case", ["random", "far_outside", "done", "on_atoms"])
def test_projection_kernel_matches_reference(b, d, z, case):
    v_min, v_max = -25.0, 10.0
    tz, probs = _inputs(b, d, z, v_min, v_max, case, seed=b * 7 + z)
    got = np.asarray(project_uniform_pallas(jnp.asarray(tz), jnp.asarray(probs), v_min=v_min,
                                            v_max=v_max, interpret=True))
    assert got.shape == (b, d, z) and got.dtype == np.float32
    with x64():  # the oracle in float64 on the same (float32) inputs
        want = np.asarray(project_uniform(jnp.asarray(tz, jnp.float64),
                                          jnp.asarray(probs, jnp.float64), v_min, v_max))
    np.testing.assert_allclose(got, want, atol=z * 1.2e-7)  # float32 sums of up to Z terms
    np.testing.assert_allclose(got.sum(-1), probs.sum(-1), atol=2e-5)  # mass is conserved
    assert np.all(got >= 0)


@pytest.mark.parametrize("b,d,z", [(1, 1, 2), (45, 4, 51), (70, 3, 64), (33, 4, 101)])
def test_lanes_layout_equals_rows_layout_bitwise(b, d, z):
    """The transposed ("lanes") kernel computes the same sums in the same order."""
    tz, probs = _inputs(b, d, z, -25.0, 10.0, "random", seed=b + z)
    f = functools.partial(project_uniform_pallas, jnp.asarray(tz), jnp.asarray(probs),
                          v_min=-25.0, v_max=10.0, interpret=True)
    rows, lanes = np.asarray(f(layout="rows")), np.asarray(f(layout="lanes"))
    assert lanes.shape == (b, d, z) and np.array_equal(rows, lanes)
    with pytest.raises(ValueError, match="layout"):
        f(layout="columns")


def test_projection_kernel_rows_are_independent_of_their_block():
    """(Bitwise repeatability on the GPU is measured by bench/kernels.py; the interpreter runs
    the grid sequentially, so here only the row independence can fail.)"""
    tz, probs = _inputs(100, 4, 51, -25.0, 25.0, "random", seed=3)
    f = functools.partial(project_uniform_pallas, v_min=-25.0, v_max=25.0, interpret=True)
    a = np.asarray(f(jnp.asarray(tz), jnp.asarray(probs)))
    b = np.asarray(f(jnp.asarray(tz), jnp.asarray(probs)))
    assert np.array_equal(a, b)
    # A row's result does not depend on which block it lands in or on its neighbours.
    part = np.asarray(f(jnp.asarray(tz[37:41]), jnp.asarray(probs[37:41])))
    assert np.array_equal(part, a[37:41])


def _logits(b, d, z, seed):
    rng = np.random.default_rng(seed)
    taken = rng.normal(0, 2, (b, d, z)).astype(np.float32)
    nxt = rng.normal(0, 2, (b, d, z)).astype(np.float32)
    nxt[: b // 3, 0, z // 2] += 40.0  # near-one-hot target distributions too
    return taken, nxt


@functools.cache
def _c51_terms_and_grad(impl: str):
    """Jitted ``(taken, nxt, tz, cot) -> (terms, d weighted / d taken)`` for the kernel
    (interpreted) or its plain-JAX reference, so each shape compiles once for every case."""
    from jdqn.pallas.c51_loss import c51_terms_pallas, c51_terms_reference

    v_min, v_max = -25.0, 10.0

    @jax.jit
    def run(taken, nxt, tz, cot):
        if impl == "pallas":
            f = functools.partial(c51_terms_pallas, nxt=nxt, tz=tz, v_min=v_min, v_max=v_max,
                                  interpret=True)
        else:
            f = functools.partial(c51_terms_reference, nxt=nxt, tz=tz, v_min=v_min,
                                  v_max=v_max)

        def weighted(t):
            return sum(jnp.sum(c * o) for c, o in zip(cot, f(t), strict=True))

        return f(taken), jax.grad(weighted)(taken)

    return run


def test_c51_terms_in_two_passes_are_the_textbook_terms_at_large_logits():
    """The XLA path's terms (:func:`jdqn.pallas.c51_terms`: the cross-entropy as
    ``Σm·log Σe − Σ m·(x − max)``, the expectation as ``Σ e·z / Σ e``, two passes over the
    logits) against the textbook ``−Σ m·log_softmax(x)``, ``Σ softmax(x)·z`` in float64 — values
    and gradients, with logits spread over ±60 and offset by 200, and near-one-hot targets."""
    b, d, z, v_min, v_max = 33, 4, 51, -25.0, 10.0
    tz, _ = _inputs(b, d, z, v_min, v_max, "random", seed=7)
    taken, nxt = _logits(b, d, z, seed=8)
    taken = (taken * 30.0 + 200.0).astype(np.float32)
    cot = np.random.default_rng(9).normal(size=(4, b, d))

    def textbook(x, target):
        support = jnp.linspace(v_min, v_max, z, dtype=jnp.float64)
        logp = jax.nn.log_softmax(x, axis=-1)
        ce = -jnp.sum(target * logp, -1)
        tm = jnp.sum(target * support, -1)
        q = jnp.sum(jnp.exp(logp) * support, -1)
        return jnp.square(q - tm), ce, tm, ce + jnp.sum(jax.scipy.special.xlogy(target, target),
                                                        -1)

    def weighted(f, x, *args):
        return sum(jnp.sum(c * o) for c, o in zip(cot, f(x, *args), strict=True))

    terms = functools.partial(c51_terms, v_min=v_min, v_max=v_max, impl="xla")
    got = terms(jnp.asarray(taken), jnp.asarray(nxt), jnp.asarray(tz))
    g_got = jax.grad(lambda x: weighted(lambda t: terms(t, jnp.asarray(nxt), jnp.asarray(tz)),
                                        x))(jnp.asarray(taken))
    with x64():
        target = project_uniform(jnp.asarray(tz, jnp.float64),
                                 jax.nn.softmax(jnp.asarray(nxt, jnp.float64), -1), v_min, v_max)
        x = jnp.asarray(taken, jnp.float64)
        want = textbook(x, target)
        g_want = jax.grad(lambda v: weighted(textbook, v, target))(x)
        for name, g, w in zip(("sq", "ce", "tm", "kl"), got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-4, err_msg=name)
        np.testing.assert_allclose(g_got, g_want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("b,d,z", [(1, 1, 2), (45, 4, 51), (9, 3, 21), (33, 2, 101)])
def test_c51_loss_kernel_matches_reference_values_and_gradients(b, d, z):
    """Each target case (the per-shape programs compile once; the cases are data)."""
    for case in ("random", "far_outside", "done", "on_atoms"):
        tz, _ = _inputs(b, d, z, -25.0, 10.0, case, seed=b * 5 + z)
        taken, nxt = _logits(b, d, z, seed=b + z)
        cot = np.random.default_rng(b).normal(size=(4, b, d)).astype(np.float32)
        terms, g_got = _c51_terms_and_grad("pallas")(taken, nxt, tz, cot)
        got, g_got = [np.asarray(x) for x in terms], np.asarray(g_got)
        with x64():  # the oracle in float64 on the same (float32) inputs
            terms, g_want = _c51_terms_and_grad("reference")(
                *(jnp.asarray(a, jnp.float64) for a in (taken, nxt, tz, cot)))
            want, g_want = [np.asarray(x) for x in terms], np.asarray(g_want)
        for name, g, w in zip(("sq", "ce", "tm", "kl"), got, want, strict=True):
            assert g.shape == (b, d) and g.dtype == np.float32, (case, name)
            scale = 1.0 + np.abs(w)
            np.testing.assert_array_less(np.abs(g - w) / scale, 2e-5, err_msg=f"{case} {name}")
        scale = 1.0 + np.max(np.abs(g_want))
        np.testing.assert_array_less(np.abs(g_got - g_want) / scale, 2e-5, err_msg=case)


def test_auto_takes_only_kernels_measured_on_the_gpu(monkeypatch):
    from jdqn import pallas

    monkeypatch.setattr(pallas.jax, "default_backend", lambda: "gpu")
    faster = ("projection", "grn_tail", "grn_tail_grad", "double_q", "iqn_tail",
              "iqn_tail_grad", "moe_gate_grad", "per_sums", "iqn_tail_bf16",
              "iqn_tail_grad_bf16", "grn_tail_grad_bf16", "grn_block_bf16",
              "double_q_heads_mgpu")
    assert pallas.GPU_VALIDATED == frozenset(faster)
    for kernel in faster:
        assert pallas.use_pallas("auto", kernel)
    # measured on the H200 (the trunk-input kernels on an H100): slower than XLA, or no faster
    for slower in ("c51_loss", "iqn", "moe", "reductions", "grn_block_f32", "trunk_input_bf16",
                   "trunk_input_f32", "double_q_heads_bf16", "double_q_heads_f32"):
        assert slower not in pallas.GPU_VALIDATED
        assert not pallas.use_pallas("auto", slower)
    assert pallas.use_pallas("pallas", "c51_loss") and not pallas.use_pallas("xla", "projection")
    monkeypatch.setattr(pallas.jax, "default_backend", lambda: "cpu")
    assert not any(pallas.use_pallas("auto", kernel) for kernel in faster)


def test_impl_switch_resolves_per_backend_and_refuses_unknown_values():
    assert use_pallas("pallas") and not use_pallas("xla")
    assert use_pallas("auto") == (jax.default_backend() == "gpu")
    with pytest.raises(ValueError, match="model.impl"):
        use_pallas("triton")
    with pytest.raises(ConfigError, match="model.impl"):
        config_from_dict({"model": {"impl": "cuda"}})
    tz, probs = _inputs(5, 4, 11, -1.0, 1.0, "random")
    a = project_dispatch(jnp.asarray(tz), jnp.asarray(probs), -1.0, 1.0, "pallas")
    b = project_dispatch(jnp.asarray(tz), jnp.asarray(probs), -1.0, 1.0, "xla")
    np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("fuse_next_obs", [True, False])
def test_total_loss_and_gradients_agree_between_pallas_and_xla(fuse_next_obs):
    """fuse_next_obs=False pairs the online and target forwards at s′ (the MoE kernel vmapped
    over the two networks) and runs the target's IQN head alone through its fused kernel."""
    cfg = ModelConfig(width=32, n_grn_blocks=1, n_experts=3, expert_hidden=8, gate_hidden=8,
                      head_hidden=16, n_atoms=11, v_min=-5.0, v_max=5.0, iqn=True, iqn_embed=8,
                      iqn_n=4, iqn_n_prime=4, fuse_next_obs=fuse_next_obs,
                      iqn_tau_groups=1)  # one set for the 13 rows (an odd batch, for padding)
    train = TrainConfig()
    from jdqn.losses import Batch

    k = jax.random.split(jax.random.key(0), 8)
    b = 13
    batch = Batch(obs=jax.random.normal(k[0], (b, 24)), next_obs=jax.random.normal(k[1], (b, 24)),
                  action=jnp.stack([jax.random.randint(jax.random.fold_in(k[2], d), (b,), 0, a)
                                    for d, a in enumerate(cfg.branch_sizes)], 1),
                  reward=jax.random.normal(k[3], (b,)) * 3,
                  discount=jnp.where(jnp.arange(b) % 4 == 0, 0.0, 0.95),
                  weight=jax.random.uniform(k[4], (b,), minval=0.5, maxval=1.0))
    results = {}
    for impl in ("xla", "pallas"):
        net = BranchingQNetwork(dataclasses.replace(cfg, impl=impl), (2, 5))
        params = init_params(net, k[5], 24)
        target = init_params(net, k[6], 24)
        fn = jax.jit(jax.value_and_grad(functools.partial(total_loss, net=net, train_cfg=train),
                                        has_aux=True))
        (loss, (_, per_sample, _, _)), grads = fn(params, target, batch, k[7], init_moe_state(3),
                                                  0.7)
        results[impl] = (loss, per_sample, grads)
    np.testing.assert_allclose(results["pallas"][0], results["xla"][0], rtol=1e-5)
    np.testing.assert_allclose(results["pallas"][1], results["xla"][1], rtol=1e-5, atol=1e-6)
    for g_p, g_x in zip(jax.tree.leaves(results["pallas"][2]), jax.tree.leaves(results["xla"][2]),
                        strict=True):
        np.testing.assert_allclose(g_p, g_x, rtol=1e-4, atol=1e-6)


def _iqn_args(b, q, h, m, f, o, dtype=jnp.float32, seed=0):
    k = jax.random.split(jax.random.key(seed), 8)
    return (jax.random.normal(k[0], (b, h)).astype(dtype), jax.random.uniform(k[1], (b, q)),
            jax.random.normal(k[2], (m, h)) / np.sqrt(m), jax.random.normal(k[3], (h,)) * 0.1,
            jax.random.normal(k[4], (h, f)) / np.sqrt(h), jax.random.normal(k[5], (f,)) * 0.1,
            jax.random.normal(k[6], (f, o)) / np.sqrt(f), jax.random.normal(k[7], (o,)) * 0.1)


# (B, Q, H, M, F, O): the default head at a small batch (B not a multiple of the tile), odd sizes
# that pad every axis, Q = 1, and H wider than one column chunk.
IQN_SHAPES = [(70, 8, 256, 64, 128, 14), (5, 3, 20, 7, 9, 5), (33, 1, 32, 16, 16, 16),
              (2, 5, 160, 12, 40, 3)]


@pytest.mark.parametrize("shape", IQN_SHAPES)
@pytest.mark.parametrize("matmul_dtype", ["float32", "bfloat16"])
def test_iqn_kernel_matches_the_plain_jax_stack(shape, matmul_dtype):
    from jdqn.networks.heads import iqn_features
    from jdqn.pallas.iqn import iqn_features_pallas

    dtype = jnp.bfloat16 if matmul_dtype == "bfloat16" else jnp.float32
    args = _iqn_args(*shape, dtype=dtype, seed=sum(shape))
    got = iqn_features_pallas(*args, matmul_dtype, True)
    want = iqn_features(*args, matmul_dtype)
    assert got.shape == want.shape == shape[:2] + (shape[-1],)
    assert got.dtype == want.dtype == jnp.float32
    from jdqn.pallas.iqn import CHUNK

    if matmul_dtype == "bfloat16" and shape[2] <= CHUNK:
        # One column chunk: the same products and the same bf16 roundings, in the same order.
        np.testing.assert_array_equal(got, want)
        return
    # float32: the same products summed in column chunks; bf16: the same roundings, where a
    # chunked float32 sum may land on the other side of a bf16 rounding boundary (~1e-3 here;
    # dropping the roundings, or rounding a bias add differently, moves it by 4e-3 to 1e-2).
    tol = 1e-5 if matmul_dtype == "float32" else 1e-3
    np.testing.assert_allclose(got, want, atol=tol * (1 + float(jnp.max(jnp.abs(want)))))


def test_iqn_kernel_gradient_is_the_plain_jax_gradient():
    from jdqn.networks.heads import iqn_features
    from jdqn.pallas.iqn import iqn_features_pallas

    args = _iqn_args(*IQN_SHAPES[1])

    def loss(fn):
        return lambda *a: jnp.sum(jnp.sin(3.0 * fn(*a)))

    got = jax.grad(loss(lambda *a: iqn_features_pallas(*a, "float32", True)),
                   argnums=tuple(range(8)))(*args)
    want = jax.grad(loss(lambda *a: iqn_features(*a, "float32")), argnums=tuple(range(8)))(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
        assert float(jnp.max(jnp.abs(w))) > 0  # every input gets a real gradient


def test_iqn_kernel_under_vmap_over_seeds():
    from jdqn.pallas.iqn import iqn_features_pallas

    per_seed = [_iqn_args(*IQN_SHAPES[1], seed=s) for s in range(3)]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *per_seed)
    got = jax.vmap(lambda *a: iqn_features_pallas(*a, "float32", True))(*stacked)
    for s, args in enumerate(per_seed):
        np.testing.assert_array_equal(got[s], iqn_features_pallas(*args, "float32", True))


def test_iqn_kernel_refuses_other_dtypes_and_empty_batches():
    from jdqn.pallas.iqn import iqn_features_pallas

    args = _iqn_args(*IQN_SHAPES[1])
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        iqn_features_pallas(args[0].astype(jnp.float16), *args[1:], "float32", True)
    with pytest.raises(ValueError, match="empty batch"):
        iqn_features_pallas(args[0][:0], args[1][:0], *args[2:], "float32", True)


def _small_batch(k_obs, k_next, n_branches: int, b: int = 6):
    """Six transitions with random states (width 24), action 0 everywhere, reward 1, γ 0.9."""
    from jdqn.losses import Batch

    return Batch(obs=jax.random.normal(k_obs, (b, 24)), next_obs=jax.random.normal(k_next, (b, 24)),
                 action=jnp.zeros((b, n_branches), jnp.int32), reward=jnp.ones((b,)),
                 discount=jnp.full((b,), 0.9), weight=jnp.ones((b,)))


def _kernel_and_xla_losses(cfg: ModelConfig):
    """For ``cfg`` with ``impl = "pallas"`` and ``"xla"``: the total loss of each network as a
    function of the online parameters (a fixed target network, six transitions of
    :func:`_small_batch`), and the online parameters. Which kernels ``"pallas"`` takes is the
    caller's monkeypatched ``use_pallas``, read when the loss is traced."""
    net, xla_net = (BranchingQNetwork(dataclasses.replace(cfg, impl=i)) for i in ("pallas", "xla"))
    k = jax.random.split(jax.random.key(0), 4)
    params, target = init_params(net, k[0], 24), init_params(net, k[1], 24)
    batch = _small_batch(k[2], k[3], len(cfg.branch_sizes))

    def loss(n):
        return lambda p: total_loss(p, target, batch, k[0], init_moe_state(cfg.n_experts), 0.5,
                                    net=n, train_cfg=TrainConfig())

    return loss(net), loss(xla_net), params


@pytest.mark.parametrize("taus", ["sample", "batch"])
def test_total_loss_sends_only_the_target_network_through_the_iqn_kernel(monkeypatch, taus):
    """Per-sample fractions: the target network's quantiles go through the fused IQN kernel,
    the online ones do not. Fractions shared by groups of rows: no kernel (there is no per-row
    ``[B·Q, H]`` stack to fuse; the head folds φ(τ) into its weights)."""
    from jdqn.networks import model as model_module
    from jdqn.pallas import iqn as iqn_module

    seen = []
    real = iqn_module.iqn_features_pallas
    monkeypatch.setattr(iqn_module, "iqn_features_pallas",
                        lambda *a: seen.append(a[2]) or real(*a))  # a[2]: the τ-embedding kernel
    # Only the IQN kernel (the C51 kernels in the interpreter would only slow this test down).
    monkeypatch.setattr(model_module, "use_pallas", lambda impl, kernel: kernel == "iqn")
    cfg = ModelConfig(width=32, n_grn_blocks=1, n_experts=3, expert_hidden=8, gate_hidden=8,
                      head_hidden=16, n_atoms=11, iqn=True, iqn_embed=8, iqn_n=4, iqn_n_prime=4,
                      iqn_taus=taus, iqn_tau_groups=2, impl="xla")  # "batch": 2 groups of 3
    net = BranchingQNetwork(cfg)
    k = jax.random.split(jax.random.key(3), 5)
    params, target = init_params(net, k[0], 24), init_params(net, k[1], 24)
    batch = _small_batch(k[2], k[3], len(cfg.branch_sizes))

    def loss(p, t):  # the kernel calls' τ-embedding weights, traced, as outputs to compare
        seen.clear()
        value = total_loss(p, t, batch, k[4], init_moe_state(3), 0.5, net=net,
                           train_cfg=TrainConfig())[0]
        return value, list(seen)

    # jitted (one program, not hundreds of eager ones); the target is an argument of its own,
    # so the weights the kernel got are the target network's only if they equal its values
    _, weights = jax.jit(jax.grad(loss, has_aux=True))(params, target)
    if taus == "batch":
        assert weights == []
        return
    (we,) = weights  # one kernel call, with the target network's weights
    np.testing.assert_array_equal(we, target["params"]["iqn"]["tau_embed"]["kernel"])
    assert np.abs(np.asarray(we) - params["params"]["iqn"]["tau_embed"]["kernel"]).max() > 0


def test_grad_free_forward_uses_the_kernel_only_for_the_target_network(monkeypatch):
    """``impl = "pallas"``: the target network's quantiles (``grad_free=True``) come from the
    fused kernel, the online ones (differentiated) from XLA's forward (their backward pass goes
    through the modulation kernel: the next test); both equal the XLA network."""
    from jdqn.networks import trunk as trunk_module
    from jdqn.pallas import iqn as iqn_module

    calls = []
    real = iqn_module.iqn_features_pallas
    monkeypatch.setattr(iqn_module, "iqn_features_pallas",
                        lambda *a: calls.append(a[0].shape) or real(*a))
    # The kernels trunk.use_pallas decides off — the MoE mixture and the tree-sum bias
    # gradients of every dense layer (trunk.add_bias): the online quantiles are then bitwise
    # the XLA network's.
    monkeypatch.setattr(trunk_module, "use_pallas", lambda impl, kernel: False)
    cfg = ModelConfig(width=32, n_grn_blocks=1, n_experts=3, expert_hidden=8, gate_hidden=8,
                      head_hidden=16, n_atoms=11, iqn=True, iqn_embed=8)
    obs = jax.random.normal(jax.random.key(1), (9, 24))
    taus = jax.random.uniform(jax.random.key(2), (9, 4))
    xla_net = BranchingQNetwork(dataclasses.replace(cfg, impl="xla"))
    params = init_params(xla_net, jax.random.key(0), 24)
    want = xla_net.apply(params, obs, taus).quantiles
    net = BranchingQNetwork(dataclasses.replace(cfg, impl="pallas"))
    online = net.apply(params, obs, taus).quantiles
    assert calls == []
    target = net.apply(params, obs, taus, grad_free=True).quantiles
    assert calls == [(9, 32)]
    for a, b, c in zip(online, target, want, strict=True):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_allclose(b, c, atol=1e-5)
    calls.clear()
    xla_net.apply(params, obs, taus, grad_free=True)
    assert calls == []  # impl = "xla" never takes a kernel


def test_differentiated_iqn_head_takes_the_modulation_kernel_under_pallas(monkeypatch):
    """``impl = "pallas"``: the gradient of the online quantiles (τ for the first B_τ = 5 of
    9 rows, as the loss asks) runs the modulation kernel once and equals the XLA network's;
    ``impl = "xla"`` runs no kernel."""
    from helpers import pallas_kernel_names

    from jdqn.networks import trunk as trunk_module

    # the MoE mixture and the tree-sum bias gradients off (trunk.use_pallas decides both):
    # the modulation kernel is then the only one
    monkeypatch.setattr(trunk_module, "use_pallas", lambda impl, kernel: False)
    cfg = ModelConfig(width=32, n_grn_blocks=1, n_experts=3, expert_hidden=8, gate_hidden=8,
                      head_hidden=16, n_atoms=11, iqn=True, iqn_embed=8, iqn_n=4)
    obs = jax.random.normal(jax.random.key(1), (9, 24))
    taus = jax.random.uniform(jax.random.key(2), (5, 4))
    params = init_params(BranchingQNetwork(cfg), jax.random.key(0), 24)
    results = {}
    for impl in ("xla", "pallas"):
        net = BranchingQNetwork(dataclasses.replace(cfg, impl=impl))

        def loss(p, net=net):
            return sum(jnp.sum(jnp.square(q))
                       for q in net.apply(p, obs, taus, tau_rows=5).quantiles)

        jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
        kernels = pallas_kernel_names(jaxpr)
        results[impl] = kernels, jax.jit(jax.grad(loss))(params)
    assert results["xla"][0] == []
    assert len(results["pallas"][0]) == 1 and "iqn_modulation_bwd" in results["pallas"][0][0]
    chex.assert_trees_all_close(results["pallas"][1], results["xla"][1], rtol=1e-5, atol=1e-6)


# (B, K, E, H): the default mixture at a batch that is not a multiple of the tile, odd sizes
# that pad every axis, one expert of width 1, and more samples than one tile of each kernel.
MOE_SHAPES = [(70, 8, 64, 256), (5, 3, 20, 33), (1, 1, 1, 1), (130, 5, 16, 48)]


def _moe_args(b, k, e, h, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(ks[0], (b, k)) * 2,
            jax.nn.relu(jax.random.normal(ks[1], (b, k, e))),
            jax.random.normal(ks[2], (k, e, h)) / np.sqrt(e),
            jax.random.normal(ks[3], (k, h)) * 0.1)


@pytest.mark.parametrize("shape", MOE_SHAPES)
def test_moe_kernel_matches_reference_values_and_gradients(shape):
    from jdqn.pallas.moe import moe_mixture_pallas, moe_mixture_reference

    b, k, _, h = shape
    args = _moe_args(*shape)
    ct_h = jax.random.normal(jax.random.key(7), (b, h))
    ct_g = jax.random.normal(jax.random.key(8), (b, k))

    def loss(fn):  # cotangents on both outputs: h, and the gate (the load-balance term's path)
        def f(*a):
            out, gate = fn(*a)
            return jnp.sum(out * ct_h) + jnp.sum(jnp.square(gate) * ct_g)
        return f

    kernel = lambda *a: moe_mixture_pallas(*a, True)
    with jax.default_matmul_precision("highest"):
        got, want = kernel(*args), moe_mixture_reference(*args)
        g_got = jax.grad(loss(kernel), argnums=(0, 1, 2, 3))(*args)
        g_want = jax.grad(loss(moe_mixture_reference), argnums=(0, 1, 2, 3))(*args)
    for x, y in zip(got, want, strict=True):
        assert x.shape == y.shape and x.dtype == jnp.float32
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    for name, x, y in zip(("logits", "hidden", "w2", "b2"), g_got, g_want, strict=True):
        assert x.shape == y.shape, name
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5, err_msg=name)


def test_moe_kernel_under_vmap_over_seeds_and_refusals():
    from jdqn.pallas.moe import moe_mixture_pallas

    per_seed = [_moe_args(*MOE_SHAPES[1], seed=s) for s in range(3)]
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *per_seed)
    got = jax.vmap(lambda *a: moe_mixture_pallas(*a, True))(*stacked)
    for s, args in enumerate(per_seed):  # (the interpreter's batched dot may round 1 ulp
        for x, y in zip(got, moe_mixture_pallas(*args, True), strict=True):  # differently)
            np.testing.assert_allclose(x[s], y, rtol=1e-6, atol=1e-8)
    args = _moe_args(*MOE_SHAPES[1])
    with pytest.raises(TypeError, match="hidden must be float32"):
        moe_mixture_pallas(args[0], args[1].astype(jnp.bfloat16), *args[2:], True)
    with pytest.raises(ValueError, match="empty batch"):
        moe_mixture_pallas(args[0][:0], args[1][:0], *args[2:], True)


@pytest.mark.parametrize("impl,dtype,fused", [("pallas", "float32", True),
                                              ("pallas", "bfloat16", False),
                                              ("xla", "float32", False)])
def test_the_network_mixes_experts_in_the_kernel_under_pallas_in_float32(monkeypatch, impl,
                                                                         dtype, fused):
    from jdqn.pallas import moe as moe_module

    calls = []
    real = moe_module.moe_mixture_pallas
    monkeypatch.setattr(moe_module, "moe_mixture_pallas",
                        lambda *a: calls.append(a[1].shape) or real(*a))
    # the MoE alone: under bf16 "pallas" also runs the GRN tails' kernels in this forward
    # ("grn_tail_grad_bf16"), which round once where XLA's bf16 path rounds twice
    from jdqn.networks import trunk as trunk_module

    use = trunk_module.use_pallas
    monkeypatch.setattr(trunk_module, "use_pallas",
                        lambda impl, kernel: kernel != "grn_tail_grad_bf16" and use(impl, kernel))
    cfg = ModelConfig(width=32, n_grn_blocks=1, n_experts=3, expert_hidden=8, gate_hidden=8,
                      head_hidden=16, n_atoms=11, iqn=False, matmul_dtype=dtype)
    obs = jax.random.normal(jax.random.key(1), (9, 24))
    ref_net = BranchingQNetwork(dataclasses.replace(cfg, impl="xla"))
    params = init_params(ref_net, jax.random.key(0), 24)
    net = BranchingQNetwork(dataclasses.replace(cfg, impl=impl))
    with jax.default_matmul_precision("highest"):
        got, want = net.apply(params, obs), ref_net.apply(params, obs)
    assert calls == ([(9, 3, 8)] if fused else [])
    np.testing.assert_allclose(got.gate, want.gate, rtol=1e-5, atol=1e-7)
    for a, b in zip(got.logits, want.logits, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------
# IQN τ modulation: backward kernel
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(16, 8, 32), (7, 4, 16), (5, 1, 8)])  # (B, Q, H); 7, 5 pad B
def test_modulation_kernel_gradients_match_autodiff_of_the_reference(shape):
    from jdqn.pallas import modulation

    b, q, hw = shape
    k = jax.random.split(jax.random.key(b), 4)
    h, pre = jax.random.normal(k[0], (b, hw)), jax.random.normal(k[1], (b, q, hw))
    be = jax.random.normal(k[2], (hw,)) * 0.1
    pre = pre.at[0, 0, :2].set(-be[:2])  # exactly at the ReLU's kink: gradient 0 there, as XLA's
    g = jax.random.normal(k[3], (b, q, hw))
    want = jax.vjp(modulation.reference, h, pre, be)[1](g)
    value, vjp = jax.vjp(lambda *a: modulation.modulate(*a, True), h, pre, be)
    got = vjp(g)
    np.testing.assert_array_equal(value, modulation.reference(h, pre, be))  # XLA's forward
    np.testing.assert_array_equal(got[1], want[1])  # dpre: one product per element
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)  # dh: a sum over Q
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-5)  # dbe: over B·Q
    assert not np.array_equal(got[0], np.zeros_like(got[0]))
    # vmapped (several seeds in one program): the kernel gains a grid axis; every gradient of
    # every seed equals the reference's, with the bias batched per seed or shared
    def grads(fn, be_axis):
        return jax.vmap(lambda hh, p, b_, gg: jax.vjp(fn, hh, p, b_)[1](gg),
                        in_axes=(0, 0, be_axis, 0))

    stacked = [jnp.stack([x, 2 * x - 0.1]) for x in (h, pre, g)]
    for be_axis, bias in ((0, jnp.stack([be, -be])), (None, be)):
        args = (stacked[0], stacked[1], bias, stacked[2])
        seeds = grads(lambda *x: modulation.modulate(*x, True), be_axis)(*args)
        ref = grads(modulation.reference, be_axis)(*args)
        for s, r in zip(seeds, ref, strict=True):
            np.testing.assert_allclose(s, r, rtol=1e-5, atol=1e-5)


def test_modulation_kernel_is_taken_only_where_it_applies():
    """iqn_features with the kernel selected: a float32 head with Q and H powers of two runs its
    backward through the kernel (and gives the reference's gradients); Q = 3 or bf16 matmuls
    keep XLA; a direct call with other shapes is refused with the shapes named."""
    from helpers import pallas_kernel_names

    from jdqn.networks.heads import iqn_features
    from jdqn.pallas import modulation

    def kernels(q, dtype, use):
        args = _iqn_args(6, q, 16, 4, 8, 5)
        fn = jax.grad(lambda *a: jnp.sum(iqn_features(*a, dtype, use) ** 2), argnums=(0, 2, 3))
        names = pallas_kernel_names(jax.make_jaxpr(fn)(*args).jaxpr)
        return names, fn(*args)

    names, grads = kernels(4, "float32", True)
    assert len(names) == 1 and "iqn_modulation_bwd" in names[0], names
    ref_names, ref = kernels(4, "float32", False)
    assert ref_names == []
    for got, want in zip(grads, ref, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert kernels(3, "float32", True)[0] == []
    assert kernels(4, "bfloat16", True)[0] == []
    with pytest.raises(ValueError, match=r"powers of two.*pre \(2, 3, 16\)"):
        modulation.modulate(jnp.ones((2, 16)), jnp.ones((2, 3, 16)), jnp.ones(16), True)
    with pytest.raises(ValueError, match=r"be \[H\].*be \(1,\)"):
        modulation.modulate(jnp.ones((2, 16)), jnp.ones((2, 4, 16)), jnp.ones(1), True)
    assert not modulation.eligible(jnp.ones((2, 64, 256)))  # a tile row over MAX_QH
    assert not modulation.eligible(jnp.ones((0, 4, 16)))


def test_modulation_kernel_keeps_nan_where_the_reference_does():
    from jdqn.pallas import modulation

    h, pre, be, g = jnp.ones((2, 8)), jnp.ones((2, 2, 8)), jnp.zeros(8), jnp.ones((2, 2, 8))
    pre = pre.at[1, 0, 3].set(jnp.nan)
    want = jax.vjp(modulation.reference, h, pre, be)[1](g)
    got = jax.vjp(lambda *a: modulation.modulate(*a, True), h, pre, be)[1](g)
    for w, o in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.isnan(o), np.isnan(w))
    assert np.isnan(got[0][1, 3])


# (M, H): a batch that is not a multiple of the rows per program, one row, the default width,
# no rows
GRN_TAIL_SHAPES = [(37, 32), (1, 16), (64, 256), (0, 16)]


def _grn_tail_args(m, h, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    return (jax.random.normal(k[0], (m, 2 * h)) * 2, jax.random.normal(k[1], (2 * h,)),
            jax.random.normal(k[2], (m, h)), 1.0 + 0.3 * jax.random.normal(k[3], (h,)),
            0.3 * jax.random.normal(k[4], (h,)))


def _grn_tail_grads_f64(args, ct):
    """The reference's gradients of ``Σ out · ct`` in float64 (the oracle of the backward
    kernel)."""
    from jdqn.pallas import grn_tail

    with x64():
        wide = [jnp.asarray(a, jnp.float64) for a in (*args, ct)]
        return [np.asarray(g) for g in jax.grad(
            lambda *a: jnp.sum(grn_tail.reference(*a) * wide[-1]),
            argnums=(0, 1, 2, 3, 4))(*wide[:-1])]


def _assert_grads_close(got, want, rel=2e-6):
    assert_grads_close(got, want, ("y", "b", "x", "scale", "offset"), rel)


@pytest.mark.parametrize("shape", GRN_TAIL_SHAPES)
def test_grn_tail_kernel_matches_the_float64_block_and_its_gradient(shape):
    """Values against the reference in float64 (to float32 rounding); the gradient — the
    backward kernel's (row gradients and per-program column sums of the parameter gradients) —
    against the float64 reference's, to float32 rounding (0 and 37 rows: none, and a last
    program padded)."""
    from jdqn.pallas import grn_tail

    args = _grn_tail_args(*shape)
    got = grn_tail.grn_tail(*args, interpret=True)
    assert got.shape == (shape[0], shape[1]) and got.dtype == jnp.float32
    with x64():
        want = grn_tail.reference(*(jnp.asarray(a, jnp.float64) for a in args))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    ct = jax.random.normal(jax.random.key(9), got.shape)
    g_got = jax.grad(lambda *a: jnp.sum(grn_tail.grn_tail(*a, interpret=True) * ct),
                     argnums=(0, 1, 2, 3, 4))(*args)
    assert [g.dtype for g in g_got] == [jnp.float32] * 5
    _assert_grads_close(g_got, _grn_tail_grads_f64(args, ct))


@pytest.mark.parametrize("bwd_rows", [1, 4, 32])
def test_grn_tail_backward_kernel_tiles_agree(bwd_rows):
    """Any backward tile (rows per program; 37 rows pad the last program but for one row per
    program) gives the float64 gradient to float32 rounding."""
    from jdqn.pallas import grn_tail

    args = _grn_tail_args(37, 32, seed=3)
    ct = jax.random.normal(jax.random.key(4), (37, 32))

    def grads(rows):
        return jax.grad(lambda *a: jnp.sum(grn_tail.grn_tail(
            *a, interpret=True, bwd_rows=rows, bwd_warps=2) * ct), argnums=(0, 1, 2, 3, 4))(*args)

    _assert_grads_close(grads(bwd_rows), _grn_tail_grads_f64(args, ct))


def test_grn_tail_gradient_through_a_constant_row_is_finite_and_exact():
    """A row whose pre-norm sum is constant (the variance clamped at 0: the gate shut, the
    residual flat) normalises to the offset; its gradient stays finite and equals the float64
    reference's (the variance's path carries nothing there)."""
    from jdqn.pallas import grn_tail

    y, b, x, scale, offset = _grn_tail_args(8, 16, seed=5)
    y = y.at[2, :16].set(-200.0)  # σ(gate) = 0: s = x on row 2
    x = x.at[2].set(0.75)
    ct = jax.random.normal(jax.random.key(6), (8, 16))
    out = grn_tail.grn_tail(y, b, x, scale, offset, interpret=True)
    np.testing.assert_allclose(out[2], offset, atol=1e-6)
    got = jax.grad(lambda *a: jnp.sum(grn_tail.grn_tail(*a, interpret=True) * ct),
                   argnums=(0, 1, 2, 3, 4))(y, b, x, scale, offset)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in got)
    _assert_grads_close(got, _grn_tail_grads_f64((y, b, x, scale, offset), ct))


def test_grn_tail_gradient_vmaps_over_parameter_sets():
    """Differentiated under ``vmap`` over two parameter sets and batches (``train.seeds``
    vmapped): each set's gradient is its own — its float64 gradient to float32 rounding, and
    different from the other set's."""
    from jdqn.pallas import grn_tail

    sets = [_grn_tail_args(21, 32, seed=s) for s in (0, 1)]
    ct = jax.random.normal(jax.random.key(2), (2, 21, 32))

    def grad(args, c):
        return jax.grad(lambda *a: jnp.sum(grn_tail.grn_tail(*a, interpret=True) * c),
                        argnums=(0, 1, 2, 3, 4))(*args)

    stacked = tuple(jnp.stack(a) for a in zip(*sets))
    batched = jax.vmap(grad)(stacked, ct)
    for i in range(2):
        _assert_grads_close([g[i] for g in batched], _grn_tail_grads_f64(sets[i], ct[i]))
    assert not np.allclose(batched[3][0], batched[3][1])


def test_grn_tail_kernel_rows_are_independent_and_it_vmaps_over_parameter_sets():
    """Each row's output is its own (a row changed elsewhere in its block changes nothing else),
    and vmapped over two parameter sets (the paired forward at s′) it is each set's result."""
    from jdqn.pallas import grn_tail

    y, b, x, scale, offset = _grn_tail_args(10, 32)
    base = np.asarray(grn_tail.grn_tail(y, b, x, scale, offset, interpret=True))
    moved = np.asarray(grn_tail.grn_tail(y.at[1].multiply(5.0), b, x, scale, offset,
                                         interpret=True))
    assert not np.array_equal(base[1], moved[1])
    np.testing.assert_array_equal(np.delete(base, 1, 0), np.delete(moved, 1, 0))
    y2, b2, _, scale2, offset2 = _grn_tail_args(10, 32, seed=1)
    pair = jax.vmap(lambda *a: grn_tail.grn_tail(*a, interpret=True), in_axes=(0, 0, None, 0, 0))(
        jnp.stack([y, y2]), jnp.stack([b, b2]), x, jnp.stack([scale, scale2]),
        jnp.stack([offset, offset2]))
    np.testing.assert_array_equal(pair[0], base)
    np.testing.assert_array_equal(pair[1], grn_tail.grn_tail(y2, b2, x, scale2, offset2,
                                                             interpret=True))


def test_grn_tail_kernel_in_bf16_computes_in_float32_and_rounds_once():
    """bf16 operands (bf16 matmuls): the result is the float32 computation rounded to bf16 —
    within one bf16 rounding of the float64 block — and its gradients come back in the
    operands' dtypes."""
    from jdqn.pallas import grn_tail

    y, b, x, scale, offset = _grn_tail_args(37, 32)
    y16, x16 = y.astype(jnp.bfloat16), x.astype(jnp.bfloat16)
    got = grn_tail.grn_tail(y16, b, x16, scale, offset, interpret=True)
    assert got.dtype == jnp.bfloat16
    with x64():
        want = np.asarray(grn_tail.reference(*(jnp.asarray(a, jnp.float64) for a in (
            y16, b, x16, scale, offset))))
    np.testing.assert_allclose(np.asarray(got, np.float64), want,
                               rtol=2 ** -8, atol=2 ** -8 * np.abs(want).max())
    ct = jax.random.normal(jax.random.key(7), got.shape)
    grads = jax.grad(lambda *a: jnp.sum(grn_tail.grn_tail(*a, interpret=True).astype(
        jnp.float32) * ct), argnums=(0, 1, 2, 3, 4))(y16, b, x16, scale, offset)
    assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.float32, jnp.bfloat16,
                                        jnp.float32, jnp.float32]
    # computed in float32 from the bf16 operands; dy and dx rounded once to bf16
    # (the bf16 output's cotangent is itself rounded to bf16)
    want = _grn_tail_grads_f64((y16, b, x16, scale, offset),
                               ct.astype(jnp.bfloat16).astype(jnp.float32))
    for name, g, w, rel in zip(("y", "b", "x", "scale", "offset"), grads, want,
                               (2 ** -8, 1e-5, 2 ** -8, 1e-5, 1e-5), strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=rel,
                                   atol=rel * np.abs(w).max(), err_msg=name)


def test_grn_tail_kernel_takes_float32_or_bf16_power_of_two_widths():
    from jdqn.pallas import grn_tail

    y, _, x, _, _ = _grn_tail_args(8, 32)
    assert grn_tail.eligible(y, x)
    assert grn_tail.eligible(y.astype(jnp.bfloat16), x.astype(jnp.bfloat16))
    assert not grn_tail.eligible(y.astype(jnp.bfloat16), x)  # mixed dtypes
    assert not grn_tail.eligible(y.astype(jnp.float16), x.astype(jnp.float16))
    assert not grn_tail.eligible(y[:, :48], x[:, :24])  # H = 24: not a power of two
    assert not grn_tail.eligible(y[:4], x)  # rows differ
    assert not grn_tail.eligible(y, x[:, :16])  # y is not [M, 2H]


@pytest.mark.parametrize("matmul_dtype", ["float32", "bfloat16"])
def test_grad_free_network_runs_each_grn_tail_as_the_kernel(monkeypatch, matmul_dtype):
    """``impl = "pallas"``, only this kernel on: a ``grad_free`` forward runs one kernel per
    GRN block and equals the XLA network to rounding (so the kernel's reference is the block's
    function, flax's LayerNorm included; under bf16 matmuls to bf16 rounding, the kernel
    rounding once where XLA rounds the pre-norm sum too); a differentiated forward and
    ``impl = "xla"`` run none."""
    from helpers import pallas_kernel_names

    from jdqn.networks import trunk as trunk_module

    monkeypatch.setattr(trunk_module, "use_pallas",
                        lambda impl, kernel: impl == "pallas" and kernel == "grn_tail")
    cfg = ModelConfig(width=32, n_grn_blocks=2, n_experts=3, expert_hidden=8, gate_hidden=8,
                      head_hidden=16, n_atoms=11, iqn=False, matmul_dtype=matmul_dtype)
    obs = jax.random.normal(jax.random.key(1), (9, 24))
    xla_net = BranchingQNetwork(dataclasses.replace(cfg, impl="xla"))
    net = BranchingQNetwork(dataclasses.replace(cfg, impl="pallas"))
    params = init_params(xla_net, jax.random.key(0), 24)

    def kernels(n, grad_free):
        return pallas_kernel_names(jax.make_jaxpr(
            lambda p: n.apply(p, obs, grad_free=grad_free).logits)(params).jaxpr)

    assert kernels(net, False) == [] and kernels(xla_net, True) == []
    assert kernels(net, True) == ["grn_tail", "grn_tail"]
    got = net.apply(params, obs, grad_free=True)
    want = xla_net.apply(params, obs)
    tol = 1e-5 if matmul_dtype == "float32" else 3e-2  # bf16: a few roundings of the features
    for a, b in zip(got.logits, want.logits, strict=True):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(got.features, np.float32),
                               np.asarray(want.features, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("fuse_next_obs,matmul_dtype,n_kernels",
                         [(False, "float32", 2), (True, "float32", 2), (False, "bfloat16", 4)])
def test_total_loss_runs_the_grn_tail_kernel_only_at_s_prime(monkeypatch, fuse_next_obs,
                                                             matmul_dtype, n_kernels):
    """The paired online/target forward at s′ (float32: one vmapped kernel per block), the
    online and target forwards at s′ apart (bf16: one kernel per block each) or, with the
    concatenated [s; s′] forward, the target's alone; never the differentiated forward at s."""
    from helpers import pallas_kernel_names

    from jdqn.networks import trunk as trunk_module

    monkeypatch.setattr(trunk_module, "use_pallas",
                        lambda impl, kernel: impl == "pallas" and kernel == "grn_tail")
    cfg = ModelConfig(width=32, n_grn_blocks=2, n_experts=3, expert_hidden=8, gate_hidden=8,
                      head_hidden=16, n_atoms=11, iqn=False, impl="pallas",
                      fuse_next_obs=fuse_next_obs, matmul_dtype=matmul_dtype)
    net = BranchingQNetwork(cfg)
    k = jax.random.split(jax.random.key(0), 4)
    params, target = init_params(net, k[0], 24), init_params(net, k[1], 24)
    batch = _small_batch(k[2], k[3], len(cfg.branch_sizes))
    loss = functools.partial(total_loss, batch=batch, key=k[0], moe_state=init_moe_state(3),
                             alpha=0.5, net=net, train_cfg=TrainConfig())
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: loss(p, target)[0]))(params).jaxpr
    names = pallas_kernel_names(jaxpr)  # (the loss's kernels follow jdqn.pallas.use_pallas)
    assert [n for n in names if "grn" in n] == ["grn_tail"] * n_kernels


@pytest.mark.parametrize("matmul_dtype,switch,applies", [
    ("float32", "grn_tail_grad", True), ("bfloat16", "grn_tail_grad_bf16", True),
    ("bfloat16", "grn_tail_grad", False), ("float32", "grn_tail_grad_bf16", False)])
def test_differentiated_forward_runs_the_grn_tail_and_its_backward_kernel(
        monkeypatch, matmul_dtype, switch, applies):
    """With ``"grn_tail"`` and the backward kernel's switch of the matmul dtype on
    (``"grn_tail_grad"`` for float32, ``"grn_tail_grad_bf16"`` for bf16, measured apart), the
    differentiated forward at s runs each GRN block's tail as the kernel and the gradient as
    the backward kernel (one per block); the other dtype's switch leaves XLA's tail there, and
    the kernels are those of ``"grn_tail"`` alone. Either way the loss and its gradient are the
    XLA network's to rounding."""
    from helpers import pallas_kernel_names

    from jdqn.networks import trunk as trunk_module

    def grn_kernels(on):
        monkeypatch.setattr(trunk_module, "use_pallas",
                            lambda impl, kernel: impl == "pallas" and kernel in on)
        return [n for n in pallas_kernel_names(jax.make_jaxpr(jax.grad(
            lambda p: loss(p)[0]))(params).jaxpr) if "grn" in n]

    loss, xla_loss, params = _kernel_and_xla_losses(ModelConfig(
        width=32, n_grn_blocks=2, n_experts=3, expert_hidden=8, gate_hidden=8, head_hidden=16,
        n_atoms=11, iqn=False, matmul_dtype=matmul_dtype))
    alone = grn_kernels(("grn_tail",))  # the grad-free forwards' at s′
    assert alone and "grn_tail_bwd" not in alone, alone
    grn = grn_kernels(("grn_tail", switch))
    if applies:
        assert grn.count("grn_tail_bwd") == 2, grn
        assert grn.count("grn_tail") == alone.count("grn_tail") + 2, grn
    else:
        assert grn == alone, grn
    assert_loss_and_grads_close(loss, xla_loss, params,
                                1e-5 if matmul_dtype == "float32" else 3e-2)
