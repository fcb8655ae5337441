"""The fused C51-heads + double-Q kernel (``jdqn.pallas.double_q_heads``) against its plain-JAX
oracle in Pallas' interpreter (CPU), the head's ``streams="inputs"`` output, and the loss's
path through the kernel.

GPU parity, bitwise repeatability and speed at the update's shape: ``bench/kernels.py --kernel
double_q_heads`` (results in ``bench/results/``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import pallas_kernel_names, random_biases
from test_double_q import _loss_setup

from jdqn.config import ModelConfig
from jdqn.losses import total as total_module
from jdqn.networks import BranchingQNetwork, init_params
from jdqn.networks.heads import HeadInputs, streams_from_inputs
from jdqn.pallas import double_q, double_q_heads

V_MIN, V_MAX = -10.0, 10.0


def _inputs(matmul_dtype: str, flow_idx: tuple[int, ...], b: int, seeds=(0, 1), width=32):
    """Both networks' HeadInputs at the same s′ (a small model; rows of obs scaled so that the
    networks' Q spread and the rows choose different actions)."""
    cfg = ModelConfig(width=width, n_grn_blocks=1, n_experts=3, expert_hidden=8, gate_hidden=8,
                      head_hidden=16, n_atoms=11, iqn=False, impl="xla",
                      matmul_dtype=matmul_dtype, v_min=V_MIN, v_max=V_MAX)
    net = BranchingQNetwork(cfg, flow_idx=flow_idx)
    obs = 3.0 * jax.random.normal(jax.random.key(7), (b, 24))
    out = []
    for seed in seeds:
        params = random_biases(init_params(net, jax.random.key(seed), 24),
                               jax.random.key(10 + seed))
        # larger output layers: logits of a few units, so the argmax is not a near-tie
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: x * 8.0 if "_out" in jax.tree_util.keystr(path) else x, params)
        out.append(net.apply(params, obs, grad_free=True, head_streams="inputs").streams)
    return out


def _run(online, target, **kw):
    return double_q_heads.double_q_heads(online, target, z=11, v_min=V_MIN, v_max=V_MAX,
                                         interpret=True, **kw)


def _pair(online: HeadInputs, target: HeadInputs) -> HeadInputs:
    return jax.tree.map(lambda o, t: jnp.stack([o, t]), online, target)


@pytest.mark.parametrize("matmul_dtype,flow_idx,b,rows,stages",
                         [("bfloat16", (3, 5), 37, 16, None), ("float32", (3, 5), 37, 32, 2),
                          ("bfloat16", (), 16, 16, 1), ("bfloat16", (3, 5), 37, 16, 3)])
def test_kernel_matches_the_reference_pair_and_apart(matmul_dtype, flow_idx, b, rows, stages):
    """Greedy actions equal to the oracle's (the head's own products, then the double-Q
    selection), the target's probabilities to float32 rounding, zero on the padded atoms; two
    networks and the pair (one ``[2, …]`` tree, its ``pre`` read in place) give the same; the
    rows choose different actions (a wrong row or action would show). Each branch's actions
    unrolled (``stages=None``) or as a loop (the form Triton pipelines) agree alike."""
    online, target = _inputs(matmul_dtype, flow_idx, b)
    assert online.pre.dtype == (jnp.bfloat16 if matmul_dtype == "bfloat16" else jnp.float32)
    assert online.flow.shape == (b, len(flow_idx))
    want_a, want_p = double_q_heads.reference(online, target, 11, V_MIN, V_MAX)
    assert want_a.shape == (b, 4) and want_p.shape == (b, 4, 16)
    for d in range(4):
        assert len(set(np.asarray(want_a[:, d]).tolist())) > 1, d
    for got_a, got_p in (_run(online, target, rows=rows, stages=stages),
                         _run(_pair(online, target), None, rows=rows, stages=stages)):
        np.testing.assert_array_equal(got_a, want_a)
        np.testing.assert_allclose(got_p, want_p, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got_p[..., 11:], 0.0)
    pair_a, pair_p = double_q_heads.reference(_pair(online, target), None, 11, V_MIN, V_MAX)
    np.testing.assert_array_equal(pair_a, want_a)
    np.testing.assert_array_equal(pair_p, want_p)


def test_each_conditioning_reaches_the_kernel():
    """The magnitude stream's conditioning on the direction's expected Q and the order-type and
    urgency streams' order flow are in the kernel's arithmetic: with either kernel zeroed, the
    reference moves, and the kernel moves with it."""
    online, target = _inputs("float32", (3, 5), 24)
    base = _run(online, target, rows=16)
    for name, change in (("cond_kernel", lambda x: x._replace(cond_kernel=0 * x.cond_kernel)),
                         ("flow_kernel", lambda x: x._replace(
                             flow_kernel=tuple(0 * w for w in x.flow_kernel)))):
        o, t = change(online), change(target)
        want_a, want_p = double_q_heads.reference(o, t, 11, V_MIN, V_MAX)
        got_a, got_p = _run(o, t, rows=16)
        np.testing.assert_array_equal(got_a, want_a)
        np.testing.assert_allclose(got_p, want_p, rtol=1e-5, atol=1e-6)
        assert np.abs(np.asarray(got_p) - np.asarray(base[1])).max() > 1e-3, name


def test_head_inputs_give_the_head_streams_bitwise():
    """``head_streams="inputs"`` returns what ``head_streams=True`` computes its products from:
    :func:`streams_from_inputs` on it is that output, bit for bit, and the rest of the network's
    output is the same."""
    cfg = ModelConfig(width=32, n_grn_blocks=1, n_experts=3, expert_hidden=8, gate_hidden=8,
                      head_hidden=16, n_atoms=11, iqn=False, impl="xla",
                      matmul_dtype="bfloat16")
    net = BranchingQNetwork(cfg, flow_idx=(3, 5))
    params = random_biases(init_params(net, jax.random.key(0), 24), jax.random.key(2))
    obs = jax.random.normal(jax.random.key(1), (9, 24))
    streams = net.apply(params, obs, grad_free=True, head_streams=True)
    inputs = net.apply(params, obs, grad_free=True, head_streams="inputs")
    assert isinstance(inputs.streams, HeadInputs) and inputs.logits == ()
    assert inputs.streams.pre.shape == (9, 5 * 16)
    assert [k.shape for k in inputs.streams.out_kernel] == [(16, 12), (16, 48)] + [(16, 36)] * 3
    for a, b in zip(jax.tree.leaves(streams_from_inputs(inputs.streams, 11, cfg.v_min,
                                                        cfg.v_max)),
                    jax.tree.leaves(streams.streams), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(inputs.features, streams.features)
    with pytest.raises(ValueError, match="streams = 'input': expected False, True or 'inputs'"):
        net.apply(params, obs, grad_free=True, head_streams="input")


def test_empty_batch_and_bad_settings():
    online, target = _inputs("float32", (3,), 20)
    empty = online._replace(pre=online.pre[:0], flow=online.flow[:0])
    a, p = _run(empty, empty)
    assert a.shape == (0, 4) and p.shape == (0, 4, 16)
    with pytest.raises(ValueError, match="rows = 24"):
        _run(online, target, rows=24)
    with pytest.raises(ValueError, match="rows = 8"):
        _run(online, target, rows=8)
    with pytest.raises(ValueError, match="stages = 0"):
        _run(online, target, stages=0)
    three = online._replace(out_kernel=online.out_kernel[:4], out_bias=online.out_bias[:4])
    with pytest.raises(ValueError, match="3 branches"):
        _run(three, three)


@pytest.mark.parametrize("matmul_dtype", ["bfloat16", "float32"])
def test_the_kernel_lowers_to_one_triton_call_for_cuda_on_any_machine(matmul_dtype):
    """The kernel as the GPU runs it (not the interpreter's form) lowers to a single Triton
    custom call for CUDA on a CPU-only machine: Pallas' Triton lowering of every load, dot and
    reduction it uses, at two row counts, unrolled and as a loop — checked by tracing alone
    (Triton's own compilation happens on the GPU: ``bench/kernels.py --kernel
    double_q_heads``)."""
    online, target = _inputs(matmul_dtype, (3, 5), 64)
    # the target GPU named as an abstract device: jax 0.11's Triton lowering reads the GPU's
    # kind from it when no GPU is attached (jax 0.10's assumed one)
    hopper = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"))
    for rows, stages in ((32, None), (64, None), (64, 2)):
        run = jax.jit(functools.partial(double_q_heads.double_q_heads, target=None, z=11,
                                        v_min=V_MIN, v_max=V_MAX, rows=rows, stages=stages))
        with jax.sharding.use_abstract_mesh(hopper):
            lowered = run.trace(_pair(online, target)).lower(lowering_platforms=("cuda",))
        text = lowered.as_text()
        assert text.count("custom_call @__gpu$xla.gpu.triton") == 1, (rows, stages)
        assert 'name = "double_q_heads"' in text, (rows, stages)


def _only(monkeypatch, *kernels):
    monkeypatch.setattr(total_module, "use_pallas", lambda impl, kernel: kernel in kernels)


@pytest.mark.parametrize("matmul_dtype", ["bfloat16", "float32"])
def test_total_loss_through_the_kernel_equals_the_double_q_kernels_path(monkeypatch,
                                                                       matmul_dtype):
    """The loss with the fused kernel (bf16: the forwards at s′ apart; float32: the paired
    forward) has the value, per-sample losses, components and gradients of the loss through
    the products and the double-Q kernel, to float32 rounding; the update's program calls the
    fused kernel once and neither the double-Q kernel nor ``expected_q_streams``."""
    loss, params = _loss_setup(matmul_dtype)
    grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    _only(monkeypatch, "double_q")
    (want, (want_c, want_ps, _, _)), want_g = grad(params)
    _only(monkeypatch, "double_q", double_q_heads.kernel_name(matmul_dtype))
    grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (got, (got_c, got_ps, _, _)), got_g = grad(params)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got_ps, want_ps, rtol=1e-6)
    for name in ("c51", "mse", "iqn"):
        np.testing.assert_allclose(got_c[name], want_c[name], rtol=1e-6, err_msg=name)
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    names = pallas_kernel_names(jax.make_jaxpr(
        jax.grad(lambda p: loss(p)[0]))(params).jaxpr)
    assert names.count("double_q_heads") == 1
    assert "double_q_next" not in names and "expected_q_streams" not in names


def test_kernel_names_follow_the_matmul_dtype_and_auto_takes_neither_off_the_gpu():
    from jdqn import pallas

    assert double_q_heads.kernel_name("bfloat16") == "double_q_heads_bf16"
    assert double_q_heads.kernel_name("float32") == "double_q_heads_f32"
    if jax.default_backend() != "gpu":
        assert not pallas.use_pallas("auto", "double_q_heads_bf16")
    assert pallas.use_pallas("pallas", "double_q_heads_f32")


def test_reference_is_the_double_q_reference_on_the_heads_products():
    """The oracle is the head's own products (``streams_from_inputs``) through
    :func:`jdqn.pallas.double_q.reference`."""
    online, target = _inputs("bfloat16", (3, 5), 12)
    ref = functools.partial(double_q.reference, z=11, v_min=V_MIN, v_max=V_MAX)
    want = ref(streams_from_inputs(online, 11, V_MIN, V_MAX),
               streams_from_inputs(target, 11, V_MIN, V_MAX))
    got = double_q_heads.reference(online, target, 11, V_MIN, V_MAX)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
