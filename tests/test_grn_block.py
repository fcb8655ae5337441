"""The whole-block Mosaic GPU kernel of a grad-free GRN block (jdqn.pallas.grn_block), in
JAX's GPU interpreter: the model's block to bf16 rounding, its batching rule, the network's
switch ("grn_block_bf16") and its eligibility."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.params")

from jdqn.config import ModelConfig
from jdqn.networks.model import BranchingQNetwork, init_params
from jdqn.networks.trunk import GRNBlock
from jdqn.pallas import grn_block, grn_tail


def _block_args(seed: int, m: int = 64, h: int = 128):
    """A GRNBlock's input and parameters (perturbed from their initialisation, so the biases,
    scale and offset are not trivial) in the kernel's argument order."""
    block = GRNBlock(width=h, matmul_dtype="bfloat16", impl="xla")
    x = jax.random.normal(jax.random.key(seed + 7), (m, h)).astype(jnp.bfloat16)
    params = block.init(jax.random.key(seed), x)["params"]
    params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(seed + 2),
                                                                p.shape), params)
    w = params["fc"]["kernel"] @ params["glu"]["kernel"]
    b = params["fc"]["bias"] @ params["glu"]["kernel"] + params["glu"]["bias"]
    return params, (x, params["fc_elu"]["kernel"], params["fc_elu"]["bias"], w, b,
                    params["norm"]["scale"], params["norm"]["bias"])


def _tail_path(x, w_fc, b_fc, w, b, scale, offset, interpret=True):
    """The model's grad-free block before this kernel: XLA's GEMMs with the model's roundings
    and the tail kernel (in Pallas' interpreter unless ``interpret`` is false)."""
    eta = grn_block.eta_from_product(jnp.dot(x, w_fc.astype(jnp.bfloat16),
                                             preferred_element_type=jnp.float32), b_fc,
                                     jnp.bfloat16)
    y = jnp.dot(eta, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    return grn_tail.grn_tail(y.astype(jnp.bfloat16), b, x, scale, offset, grn_tail.EPSILON,
                             interpret)


def _f32(a):
    return np.asarray(a.astype(jnp.float32))


def test_the_kernel_is_the_models_block_to_bf16_rounding_and_batches_its_parameter_sets():
    """Two parameter sets and inputs under vmap (one launch over the kernel's set axis): each
    equals the block with its tail kernel but for rare last bits (a changed rounding, epsilon
    or normalisation moves percents of the elements), and equals the kernel run on that set
    alone bit for bit; x shared by the sets (vmap without x's axis) and nested vmaps give the
    same bits."""
    sets = [_block_args(s)[1] for s in (0, 3)]
    stacked = [jnp.stack(a) for a in zip(*sets, strict=True)]
    run = jax.vmap(lambda *a: grn_block.grn_block(*a, grn_tail.EPSILON, True))
    got = _f32(run(*stacked))
    for i, args in enumerate(sets):
        want = _f32(_tail_path(*args))
        assert np.abs(got[i] - want).max() <= 1 / 32, i
        assert np.mean(got[i] != want) <= 1e-3, i
        np.testing.assert_array_equal(got[i], _f32(grn_block.grn_block(*args, grn_tail.EPSILON,
                                                                        True)))
    assert np.abs(got[0] - got[1]).max() > 0.5  # each set its own parameters
    shared = jax.vmap(lambda x, *p: grn_block.grn_block(x, *p, grn_tail.EPSILON, True),
                      in_axes=(None, 0, 0, 0, 0, 0, 0))(sets[0][0], *stacked[1:])
    np.testing.assert_array_equal(_f32(shared)[0], got[0])
    one = _f32(grn_block.grn_block(sets[0][0], *sets[1][1:], grn_tail.EPSILON, True))
    np.testing.assert_array_equal(_f32(shared)[1], one)
    nested = jax.vmap(run)(*(jnp.stack([a, a[::-1]]) for a in stacked))
    np.testing.assert_array_equal(_f32(nested)[0], got)
    np.testing.assert_array_equal(_f32(nested)[1], got[::-1])


def _f32_block_args(seed: int, m: int = 64, h: int = 128):
    """:func:`_block_args` for a float32 block: its parameters and the kernel's arguments."""
    block = GRNBlock(width=h, matmul_dtype="float32", impl="xla")
    x = jax.random.normal(jax.random.key(seed + 7), (m, h))
    params = block.init(jax.random.key(seed), x)["params"]
    params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(seed + 2),
                                                                p.shape), params)
    hi = jax.lax.Precision.HIGHEST
    w = jnp.dot(params["fc"]["kernel"], params["glu"]["kernel"], precision=hi)
    b = jnp.dot(params["fc"]["bias"], params["glu"]["kernel"], precision=hi) \
        + params["glu"]["bias"]
    return block, params, (x, params["fc_elu"]["kernel"], params["fc_elu"]["bias"], w, b,
                           params["norm"]["scale"], params["norm"]["bias"])


@pytest.mark.parametrize("h", [64, 128])
def test_the_float32_kernel_is_the_models_float32_block_and_batches_its_parameter_sets(h):
    """float32 (TF32 on the GPU; exact float32 products in the interpreter): the kernel — two
    32-column chunks per 64, the gate's and value's column blocks as one product — equals the
    XLA block (``GRNBlock``, float32) to float32 rounding, for two parameter sets in one launch,
    each the same bits as alone."""
    made = [_f32_block_args(s, 64, h) for s in (0, 3)]
    stacked = [jnp.stack(a) for a in zip(*(m[2] for m in made), strict=True)]
    got = np.asarray(jax.vmap(lambda *a: grn_block.grn_block(*a, grn_tail.EPSILON, True))(
        *stacked))
    assert got.dtype == np.float32
    for i, (block, params, args) in enumerate(made):
        want = np.asarray(block.apply({"params": params}, args[0]))
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5, err_msg=str(i))
        np.testing.assert_array_equal(got[i], grn_block.grn_block(*args, grn_tail.EPSILON,
                                                                   True))
    assert np.abs(got[0] - got[1]).max() > 0.5


def test_only_bf16_or_float32_inputs_in_whole_tiles_are_eligible():
    x = jnp.zeros((128, 64), jnp.bfloat16)
    assert grn_block.eligible(x, 64)
    assert grn_block.eligible(x.astype(jnp.float32), 64)  # TF32 products, as XLA's default
    with jax.default_matmul_precision("highest"):  # XLA's exact float32: the kernel is not
        assert not grn_block.eligible(x.astype(jnp.float32), 64)
        assert grn_block.eligible(x, 64)  # bf16 is bf16 under any precision
    with jax.default_matmul_precision("tensorfloat32"):
        assert grn_block.eligible(x.astype(jnp.float32), 64)
    assert not grn_block.eligible(x.astype(jnp.float16), 64)
    assert not grn_block.eligible(x[:96], 64)  # rows: not whole tiles of 64
    assert not grn_block.eligible(jnp.zeros((128, 96), jnp.bfloat16), 96)  # width
    assert not grn_block.eligible(x, 128)  # the residual's width differs
    assert not grn_block.eligible(x[None], 64)
    assert not grn_block.eligible(x[:0], 64)  # an empty batch: XLA's path
    for width in (320, 512):  # wider than one wgmma's N = 256: does not lower
        assert not grn_block.eligible(jnp.zeros((64, width), jnp.bfloat16), width)
    assert grn_block.eligible(jnp.zeros((64, 256), jnp.bfloat16), 256)
    with pytest.raises(ValueError, match="does not tile"):
        grn_block.grn_block(x[:96], *_block_args(0, 64, 64)[1][1:], grn_tail.EPSILON, True)
    with pytest.raises(ValueError, match="runs bf16 or float32, not float16"):
        grn_block.grn_block(x.astype(jnp.float16), *_block_args(0, 64, 64)[1][1:],
                            grn_tail.EPSILON, True)


@pytest.mark.parametrize("md", ["bfloat16", "float32"])
@pytest.mark.parametrize("rows,width,used", [(64, 64, True), (40, 64, False),
                                             (64, 32, False)])
def test_the_grad_free_network_runs_each_grn_block_as_the_kernel(monkeypatch, rows, width,
                                                                 used, md):
    """``impl = "pallas"`` with only this dtype's switch on (``"grn_block_bf16"``,
    ``"grn_block_f32"``): a grad-free forward runs one kernel per GRN block where the block's
    input tiles (else XLA's path), the same parameters as the XLA network and its values to
    bf16 (float32) rounding; the differentiated forward runs none, nor the other matmul dtype
    (its switch off), nor float32 under ``"highest"`` matmul precision."""
    from helpers import pallas_kernel_names

    from jdqn.networks import trunk as trunk_module

    switch = "grn_block_bf16" if md == "bfloat16" else "grn_block_f32"
    other = "float32" if md == "bfloat16" else "bfloat16"
    calls = []
    real = grn_block.grn_block
    monkeypatch.setattr(grn_block, "grn_block", lambda *a: calls.append(a[0].shape) or real(*a))
    monkeypatch.setattr(trunk_module, "use_pallas",
                        lambda impl, kernel: impl == "pallas" and kernel == switch)
    cfg = ModelConfig(width=width, n_grn_blocks=2, n_experts=3, expert_hidden=8,
                      gate_hidden=8, head_hidden=16, n_atoms=11, iqn=False, matmul_dtype=md)
    obs = jax.random.normal(jax.random.key(1), (rows, 24))
    xla_net = BranchingQNetwork(dataclasses.replace(cfg, impl="xla"))
    net = BranchingQNetwork(dataclasses.replace(cfg, impl="pallas"))
    params = init_params(xla_net, jax.random.key(0), 24)
    got = net.apply(params, obs, grad_free=True)
    assert calls == ([(rows, width)] * 2 if used else [])
    want = xla_net.apply(params, obs)
    tol = 3e-2 if md == "bfloat16" else 1e-5
    for a, b in zip(got.logits, want.logits, strict=True):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
    np.testing.assert_allclose(_f32(got.features), _f32(want.features), rtol=tol, atol=tol)
    calls.clear()
    net.apply(params, obs)  # differentiated forward
    BranchingQNetwork(dataclasses.replace(cfg, impl="pallas", matmul_dtype=other)).apply(
        params, obs, grad_free=True)
    assert calls == []
    if md == "float32":
        with jax.default_matmul_precision("highest"):
            net.apply(params, obs, grad_free=True)
        assert calls == []
    jaxpr = jax.make_jaxpr(lambda p: net.apply(p, obs, grad_free=True).logits)(params).jaxpr
    assert "grn_tail" not in pallas_kernel_names(jaxpr)
    calls.clear()
    monkeypatch.setattr(grn_block, "device_supported", lambda: False)  # not a Hopper GPU
    net.apply(params, obs, grad_free=True)
    assert calls == []


def test_the_kernel_runs_on_hopper_gpus_only(monkeypatch):
    """wgmma and TMA as sm_90a has them: a GPU of compute capability 9.x takes the kernel, an
    Ampere (a Colab A100), Ada or Blackwell one XLA's path; off the GPU the interpreter."""
    assert grn_block.device_supported()  # the CPU: the interpreter

    class Device:
        def __init__(self, cc):
            self.compute_capability = cc

    monkeypatch.setattr(grn_block.jax, "default_backend", lambda: "gpu")
    for cc, ok in (("9.0", True), ("8.0", False), ("8.9", False), ("10.0", False)):
        monkeypatch.setattr(grn_block.jax, "devices", lambda cc=cc: [Device(cc)])
        assert grn_block.device_supported() is ok, cc


def test_registers_load_passes_the_index_only_where_the_jax_version_requires_it():
    """``mgpu_load``: jax 0.10's ``plgpu.load(src, idx, *, layout)`` gets ``()`` for the
    index; jax 0.11's ``plgpu.load(src, idx=NotSpecified, *, layout)``, which warns that a
    separate index is deprecated, and a later one without ``idx`` get none — read off the
    signature of the module it is given."""
    import types

    from jdqn.pallas.grn_block import mgpu_load

    calls, unset = [], object()

    def jax_010(src, idx, *, layout=None, optimized=True):
        calls.append(("0.10", src, idx, layout))

    def jax_011(src, idx=unset, *, layout=None, optimized=True):
        calls.append(("0.11", src, idx is unset, layout))

    def later(src, *, layout=None, optimized=True):
        calls.append(("later", src, layout))

    for load in (jax_010, jax_011, later):
        mgpu_load("ref", "L", types.SimpleNamespace(load=load))
    assert calls == [("0.10", "ref", (), "L"), ("0.11", "ref", True, "L"), ("later", "ref", "L")]


def test_the_gpu_kernel_lowers_for_cuda_off_the_gpu_with_the_installed_jax():
    """The kernel as the GPU runs it (not the interpreter's form) lowers to a Mosaic GPU
    custom call for CUDA on any machine: the installed JAX's ``plgpu.load`` (through
    ``mgpu_load``), TMA, wgmma and the shared-memory budget, checked by tracing alone."""
    from jdqn.pallas.grn_block import grn_block

    h, m = 64, 128
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (m, h)).astype(jnp.bfloat16)
    w_fc = jax.random.normal(k[1], (h, h)).astype(jnp.bfloat16)
    w = jax.random.normal(k[2], (h, 2 * h)).astype(jnp.bfloat16)
    args = (x, w_fc, jnp.zeros(h), w, jnp.zeros(2 * h), jnp.ones(h), jnp.zeros(h))
    run = jax.jit(lambda *a: grn_block(*a, eps=1e-6, interpret=False))
    text = run.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_the_kernel_names_lane_semantics_with_approximate_math(mosaic_gpu_params_asked):
    """The kernel writes its layouts out and names Mosaic GPU's lane semantics (jax 0.11
    defaults to warpgroup, which re-derives them by a search), with ``approx_math``; the bench's
    ``semantics="warpgroup"`` and ``approx=False`` ask for those; an unknown name is refused."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def asked():
        return [(k.get("lowering_semantics"), k.get("approx_math"))
                for k in mosaic_gpu_params_asked]

    grn_block._batched.cache_clear()  # trace afresh: the spy sees the kernel built
    _, args = _block_args(0, h=64)
    jax.jit(lambda *a: grn_block.grn_block(*a, eps=1e-6)).trace(*args)
    assert asked() == [(plgpu.LoweringSemantics.Lane, True)]
    stacked = tuple(a[None] for a in args)
    mosaic_gpu_params_asked.clear()
    jax.jit(functools.partial(grn_block._kernel, eps=1e-6, approx=False,
                              semantics="warpgroup")).trace(*stacked)
    assert asked() == [(plgpu.LoweringSemantics.Warpgroup, False)]
    with pytest.raises(ValueError, match="semantics must be one of"):
        grn_block._kernel(*stacked, eps=1e-6, semantics="warp")
    grn_block._batched.cache_clear()


def test_the_kernel_branch_creates_the_xla_blocks_parameters(monkeypatch):
    """A grad-free bf16 block initialised through the kernel's branch (its input tiles) has
    the XLA block's parameters: the same names, shapes, dtypes and values."""
    from jdqn.networks import trunk as trunk_module

    monkeypatch.setattr(trunk_module, "use_pallas",
                        lambda impl, kernel: impl == "pallas" and kernel == "grn_block_bf16")
    calls = []
    real = grn_block.grn_block
    monkeypatch.setattr(grn_block, "grn_block", lambda *a: calls.append(1) or real(*a))
    x = jax.random.normal(jax.random.key(3), (64, 64)).astype(jnp.bfloat16)
    kw = {"width": 64, "matmul_dtype": "bfloat16", "grad_free": True}
    got = GRNBlock(impl="pallas", **kw).init(jax.random.key(0), x)
    assert calls == [1]  # the kernel's branch ran
    want = GRNBlock(impl="xla", **kw).init(jax.random.key(0), x)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_a_gradient_through_the_kernel_is_refused_by_name_and_stop_gradient_passes():
    """The kernel has no derivative: a gradient with respect to its input or a weight raises
    naming it, rather than JAX's generic error from inside the kernel; inputs under
    stop_gradient (how the model's grad-free forwards reach it) differentiate to zero."""
    args = _block_args(0, 64, 64)[1]
    block = functools.partial(grn_block.grn_block, eps=grn_tail.EPSILON, interpret=True)
    with pytest.raises(TypeError, match="grn_block: the whole-block kernel has no derivative"):
        jax.grad(lambda x: block(x, *args[1:]).astype(jnp.float32).sum())(args[0])
    with pytest.raises(TypeError, match="no derivative"):
        jax.grad(lambda w: block(args[0], args[1], args[2], w, *args[4:])
                 .astype(jnp.float32).sum())(args[3])
    frozen = jax.grad(lambda w: (block(*jax.lax.stop_gradient(args[:3]),
                                       jax.lax.stop_gradient(w), *args[4:])
                                 .astype(jnp.float32).sum() + w.sum()))(args[3])
    np.testing.assert_array_equal(frozen, np.ones_like(args[3]))


@pytest.mark.parametrize("fuse_next_obs,seeds", [(False, 0), (False, 2), (True, 2)])
def test_the_update_loss_runs_the_kernel_in_the_grad_free_forwards_at_s_prime(
        monkeypatch, fuse_next_obs, seeds):
    """The trainer's loss and its gradient under bf16 matmuls, width 64 and a batch of 64
    (whole tiles) with only ``"grn_block_bf16"`` on: as ``gpu.toml`` runs it
    (``fuse_next_obs = false``), the online and target forwards at s′ run the kernel once per
    block each (four blocks); with the [s; s′] forward, the target's alone (two); never the
    differentiated forward, which no gradient could pass. The loss and gradients are the XLA
    network's to bf16 rounding; vmapped over seeds (``train.seeds``) each launch covers the
    seeds' parameter sets."""
    from helpers import assert_loss_and_grads_close

    from jdqn.config import TrainConfig
    from jdqn.losses import Batch, init_moe_state, total_loss
    from jdqn.networks import trunk as trunk_module

    monkeypatch.setattr(trunk_module, "use_pallas",
                        lambda impl, kernel: impl == "pallas" and kernel == "grn_block_bf16")
    cfg = ModelConfig(width=64, n_grn_blocks=2, n_experts=3, expert_hidden=8, gate_hidden=8,
                      head_hidden=16, n_atoms=11, iqn=False, matmul_dtype="bfloat16",
                      fuse_next_obs=fuse_next_obs)
    net, xla_net = (BranchingQNetwork(dataclasses.replace(cfg, impl=i))
                    for i in ("pallas", "xla"))
    k = jax.random.split(jax.random.key(0), 6)
    b, d = 64, len(cfg.branch_sizes)
    batch = Batch(obs=jax.random.normal(k[2], (b, 24)), next_obs=jax.random.normal(k[3], (b, 24)),
                  action=jax.random.randint(k[4], (b, d), 0, 2), reward=jnp.ones((b,)),
                  discount=jnp.full((b,), 0.9), weight=jnp.ones((b,)))
    n = max(seeds, 1)
    params = jax.vmap(lambda key: init_params(net, key, 24))(jax.random.split(k[0], n))
    target = jax.vmap(lambda key: init_params(net, key, 24))(jax.random.split(k[1], n))

    def loss(model):
        one = functools.partial(total_loss, batch=batch, key=k[5], moe_state=init_moe_state(3),
                                alpha=0.5, net=model, train_cfg=TrainConfig())
        if seeds:
            def both(p):
                values, aux = jax.vmap(one)(p, target)
                return values.sum(), aux
            return both
        return lambda p: one(jax.tree.map(lambda a: a[0], p),
                             jax.tree.map(lambda a: a[0], target))

    blocks, launches = [], []
    real_block, real_kernel = grn_block.grn_block, grn_block._kernel
    monkeypatch.setattr(grn_block, "grn_block",
                        lambda *a: blocks.append(a[0].shape) or real_block(*a))
    monkeypatch.setattr(grn_block, "_kernel",
                        lambda *a, **kw: launches.append(a[0].shape) or real_kernel(*a, **kw))
    # fresh custom_vmap/custom_jvp objects: jax 0.11 reuses a traced rule's jaxpr for the same
    # objects and shapes, so an earlier test's trace would hide the launches from the spy
    grn_block._batched.cache_clear()
    jax.make_jaxpr(jax.grad(lambda p: loss(net)(p)[0]))(params)
    assert blocks == [(b, 64)] * (2 if fuse_next_obs else 4)
    assert (n, b, 64) in launches  # the seeds: one launch's parameter sets (the rule's)
    assert_loss_and_grads_close(loss(net), loss(xla_net), params, 3e-2)
    # the target network's parameters reach the kernel under stop_gradient in every layout:
    # a gradient with respect to them is zero, as on XLA's path, not the kernel's refusal
    one = jax.tree.map(lambda a: a[0], params)
    zero = jax.jit(jax.grad(lambda t: total_loss(one, t, batch, k[5], init_moe_state(3), 0.5,
                                                 net=net, train_cfg=TrainConfig())[0]))(
        jax.tree.map(lambda a: a[0], target))
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(zero))


def _on_hopper() -> bool:
    return jax.default_backend() == "gpu" and grn_block.device_supported()


@pytest.mark.gpu
@pytest.mark.skipif(not _on_hopper(), reason="compiles the kernel: needs a Hopper GPU")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("width", [64, 128, 256])
def test_compiled_kernel_rings_keep_their_order_on_a_hopper_gpu(width, dtype):
    """On the GPU, where wgmma reads shared memory asynchronously (the interpreter runs it
    synchronously, so its race detector cannot see a slot refilled too early): every ring
    depth, from one slot (each refill waits for the wgmma reading the slot) to more slots than
    the loop has steps, gives the same bits, bitwise repeatable, within rounding of the
    block's path before the kernel, over sixteen tiles and two parameter sets in one launch;
    the precise ``exp`` too. bf16: against XLA's GEMMs and the tail kernel (14.6 % of the
    elements differ in their last bit on the H100). float32 — TF32 products, the weights'
    blocks read through transposed (K-major) views, which the interpreter does not have —
    against XLA's float32 block at its default (TF32) precision."""
    if dtype == "bfloat16":
        sets = [_block_args(s, 1024, width)[1] for s in (0, 3)]
    else:
        sets = [_f32_block_args(s, 1024, width)[2] for s in (0, 3)]
    stacked = [jnp.stack(a) for a in zip(*sets, strict=True)]
    interpret = jax.default_backend() != "gpu"  # (the test's logic was checked in the
    # interpreter by calling it directly; pytest skips it off Hopper)
    if dtype == "bfloat16":
        want = np.stack([_f32(jax.jit(functools.partial(_tail_path, interpret=interpret))(*a))
                         for a in sets])
    else:
        block = GRNBlock(width=width, matmul_dtype="float32", impl="xla")
        want = np.stack([np.asarray(jax.jit(block.apply)({"params": m[1]}, m[2][0]))
                         for m in (_f32_block_args(s, 1024, width) for s in (0, 3))])

    def run(*args, **kw):
        return _f32(jax.jit(functools.partial(grn_block._kernel, eps=grn_tail.EPSILON,
                                              interpret=interpret, **kw))(*args))

    first = None
    # rings from one slot to the loop's whole length (8/20 clamps to it below H = 256; at 256
    # the 16 (float32: 64) steps would not fit shared memory, 4/6 is 165 KB (197) with x and
    # the vectors)
    deepest = (4, 6) if width == 256 else (8, 20)
    for stages, stages2 in ((1, 1), (1, 3), (2, 1), (2, 3), (2, 2), (3, 4), deepest):
        got = run(*stacked, stages=stages, stages2=stages2)
        again = run(*stacked, stages=stages, stages2=stages2)
        np.testing.assert_array_equal(got, again, err_msg=f"rings {stages}/{stages2}")
        first = got if first is None else first
        np.testing.assert_array_equal(got, first, err_msg=f"rings {stages}/{stages2}")
    if dtype == "bfloat16":
        assert np.abs(first - want).max() <= 1 / 16
        assert np.mean(first != want) <= 0.25
    else:  # TF32 both, but not the same roundings (measured: max 0.0073 at 1024 rows)
        assert np.abs(first - want).max() <= 3e-2
        assert np.sqrt(np.mean((first - want) ** 2)) <= 3e-3
    precise = run(*stacked, approx=False)
    assert np.abs(precise - want).max() <= (1 / 16 if dtype == "bfloat16" else 3e-2)
    one = _f32(jax.jit(lambda *a: grn_block.grn_block(*a, grn_tail.EPSILON, interpret))(
        *sets[1]))
    np.testing.assert_array_equal(one, first[1])  # one set alone: the pair's bits
