"""The trunk's grad-free readers of the observation as Pallas kernels (jdqn.pallas.trunk_input:
variable selection + the input layer, the MoE gate), in Pallas' interpreter: their oracles,
the network's switches ("trunk_input_bf16", "trunk_input_f32"), eligibility, parameter sets
under vmap, the refused derivative and the update's loss."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdqn.config import ModelConfig
from jdqn.networks.model import BranchingQNetwork, init_params
from jdqn.pallas import trunk_input

W = 32  # the tests' observation width (a power of two, as the kernels need)


def _f32(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def _args(seed: int, m: int = 64, w: int = W, h: int = 64, g: int = 16, k: int = 3):
    """obs and the two stacks' parameters (non-trivial biases; the gate's output layer not
    zero, as it is at initialisation)."""
    ks = jax.random.split(jax.random.key(seed), 9)
    n = lambda key, shape, fan: jax.random.normal(key, shape) / np.sqrt(fan)
    obs = jax.random.normal(ks[0], (m, w))
    sel = (n(ks[1], (w, w), w), 0.3 * jax.random.normal(ks[2], (w,)), n(ks[3], (w, h), w),
           0.1 * jax.random.normal(ks[4], (h,)))
    gate = (n(ks[5], (w, g), w), 0.1 * jax.random.normal(ks[6], (g,)), 2 * n(ks[7], (g, k), g),
            0.3 * jax.random.normal(ks[8], (k,)))
    return obs, sel, gate


@pytest.mark.parametrize("md", ["float32", "bfloat16"])
def test_the_kernels_are_their_oracles_and_batch_parameter_sets(md):
    """Each kernel equals its oracle (the trunk's layers written out) to the stored dtype's
    rounding — in the interpreter the same operations, so the same bits but for the dots'
    order — with the gate's probabilities summing to one over its K = 3 real columns (padded
    to Triton's 16); vmapped over two parameter sets with obs shared (the float32 twin pass at
    s′), each set's result is that set's alone."""
    obs, sel, gate = _args(0)
    h = trunk_input.selection_input(obs, *sel, md, True)
    assert h.dtype == (jnp.bfloat16 if md == "bfloat16" else jnp.float32)
    assert h.shape == (64, 64)
    want = trunk_input.selection_input_reference(obs, *sel, md)
    tol = 1 / 64 if md == "bfloat16" else 1e-5
    np.testing.assert_allclose(_f32(h), _f32(want), rtol=tol, atol=tol)
    logits, probs = trunk_input.gate(obs, *gate, md, True)
    want_l, want_p = trunk_input.gate_reference(obs, *gate, md)
    assert logits.shape == probs.shape == (64, 3) and probs.dtype == jnp.float32
    np.testing.assert_allclose(logits, want_l, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(probs, want_p, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-6)
    assert float(probs.std()) > 0.05  # the gate is not uniform: the softmax is exercised

    _, sel2, gate2 = _args(5)
    stack = lambda a, b: [jnp.stack(p) for p in zip(a, b, strict=True)]
    both = jax.vmap(lambda *p: trunk_input.selection_input(obs, *p, md, True))(
        *stack(sel, sel2))
    np.testing.assert_array_equal(_f32(both[0]), _f32(h))
    np.testing.assert_array_equal(_f32(both[1]),
                                  _f32(trunk_input.selection_input(obs, *sel2, md, True)))
    assert np.abs(_f32(both[0]) - _f32(both[1])).max() > 0.1
    gl, gp = jax.vmap(lambda *p: trunk_input.gate(obs, *p, md, True))(*stack(gate, gate2))
    np.testing.assert_array_equal(gp[0], probs)
    np.testing.assert_array_equal(gl[1], trunk_input.gate(obs, *gate2, md, True)[0])


def test_the_oracles_round_where_the_bf16_model_stores_activations():
    """Under bf16 the oracle rounds the selection's product, bias add, sigmoid and the gated
    input as the XLA layers store them: dropping those roundings (the float32 oracle on the
    same inputs) moves the result, so a kernel that skipped one would fail the tests above."""
    obs, sel, _ = _args(1)
    bf = _f32(trunk_input.selection_input_reference(obs, *sel, "bfloat16"))
    f32 = _f32(trunk_input.selection_input_reference(obs, *sel, "float32"))
    assert np.mean(np.abs(bf - f32) > 1e-3) > 0.5


def test_only_float32_obs_in_whole_tiles_of_power_of_two_width_are_eligible():
    obs = jnp.zeros((128, 32))
    assert trunk_input.eligible(obs, 64)
    assert trunk_input.eligible(obs)  # obs alone
    assert not trunk_input.eligible(obs, 24)  # an input layer or gate 24 wide: not a power of 2
    assert not trunk_input.eligible(obs[:96], 64)  # rows: not whole tiles of 64
    assert not trunk_input.eligible(obs[:0], 64)  # an empty batch: XLA's path
    assert not trunk_input.eligible(jnp.zeros((128, 24)), 64)  # width 24: not a power of two
    assert not trunk_input.eligible(jnp.zeros((128, 512)), 64)  # wider than 256
    assert not trunk_input.eligible(obs, 96)  # the input layer's width
    assert not trunk_input.eligible(obs.astype(jnp.bfloat16), 64)  # obs arrive in float32
    assert not trunk_input.eligible(obs.astype(jnp.float64) if jax.config.jax_enable_x64
                                    else obs[None], 64)
    with jax.default_matmul_precision("highest"):  # XLA's exact float32: the kernels are not
        assert not trunk_input.eligible(obs, 64)
    with jax.default_matmul_precision("tensorfloat32"):
        assert trunk_input.eligible(obs, 64)


def _cfg(md: str, gate_hidden: int = 16, **kw) -> ModelConfig:
    return ModelConfig(width=64, n_grn_blocks=1, n_experts=3, expert_hidden=8,
                       gate_hidden=gate_hidden, head_hidden=16, n_atoms=11, iqn=False,
                       matmul_dtype=md, **kw)


def _perturbed(params, seed: int = 9):
    """Parameters moved off their initialisation (the gate's zero output layer included), so
    the gate is not uniform and every bias matters."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [p + 0.2 * jax.random.normal(k, p.shape)
                                     for p, k in zip(leaves, keys, strict=True)])


def _switch_only(monkeypatch, switch: str) -> None:
    from jdqn.networks import trunk as trunk_module

    monkeypatch.setattr(trunk_module, "use_pallas",
                        lambda impl, kernel: impl == "pallas" and kernel == switch)


def _count_kernels(monkeypatch) -> list[str]:
    calls: list[str] = []
    for name in ("selection_input", "gate"):
        real = getattr(trunk_input, name)
        monkeypatch.setattr(trunk_input, name,
                            lambda *a, _n=name, _r=real: calls.append(_n) or _r(*a))
    return calls


SEL_GATE = ["selection_input", "gate"]


@pytest.mark.parametrize("md", ["bfloat16", "float32"])
@pytest.mark.parametrize("rows,width,gate_hidden,used", [
    (64, W, 16, SEL_GATE), (40, W, 16, []), (64, 24, 16, []), (64, W, 24, ["selection_input"])])
def test_the_grad_free_network_reads_obs_through_the_kernels(monkeypatch, md, rows, width,
                                                             gate_hidden, used):
    """``impl = "pallas"`` with only this dtype's switch on: a grad-free forward runs the two
    kernels where obs tiles and its width is a power of two — the gate's only where its hidden
    width is one too — (else XLA's layers), with the XLA
    network's parameters, and gives its logits, gate and features to the stored dtype's
    rounding, its selection weights (computed by XLA beside the kernel) exactly; the
    differentiated forward runs neither, nor the other dtype (its switch off), nor float32
    under ``"highest"``."""
    switch = "trunk_input_bf16" if md == "bfloat16" else "trunk_input_f32"
    other = "float32" if md == "bfloat16" else "bfloat16"
    _switch_only(monkeypatch, switch)
    calls = _count_kernels(monkeypatch)
    cfg = _cfg(md, gate_hidden)
    xla_net = BranchingQNetwork(dataclasses.replace(cfg, impl="xla"))
    net = BranchingQNetwork(dataclasses.replace(cfg, impl="pallas"))
    params = _perturbed(init_params(xla_net, jax.random.key(0), width))
    obs = jax.random.normal(jax.random.key(1), (rows, width))
    got = net.apply(params, obs, grad_free=True)
    assert calls == used
    want = xla_net.apply(params, obs)
    tol = 3e-2 if md == "bfloat16" else 1e-5
    for a, b in zip(got.logits, want.logits, strict=True):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
    np.testing.assert_allclose(_f32(got.features), _f32(want.features), rtol=tol, atol=tol)
    np.testing.assert_allclose(got.gate, want.gate, rtol=1e-5, atol=1e-6)
    assert float(jnp.std(want.gate)) > 0.05
    np.testing.assert_array_equal(got.aux["selection"], want.aux["selection"])
    calls.clear()
    net.apply(params, obs)  # differentiated forward
    BranchingQNetwork(dataclasses.replace(cfg, impl="pallas", matmul_dtype=other)).apply(
        params, obs, grad_free=True)
    if md == "float32":
        with jax.default_matmul_precision("highest"):
            net.apply(params, obs, grad_free=True)
    assert calls == []


def test_the_kernel_branch_creates_the_xla_trunks_parameters(monkeypatch):
    """A grad-free network initialised through the kernels' branch has the XLA network's
    parameters: the same names, shapes, dtypes and values."""
    _switch_only(monkeypatch, "trunk_input_bf16")
    calls = _count_kernels(monkeypatch)
    obs = jax.random.normal(jax.random.key(3), (64, W))
    cfg = _cfg("bfloat16")
    got = BranchingQNetwork(dataclasses.replace(cfg, impl="pallas")).init(
        jax.random.key(0), obs, grad_free=True)
    assert calls == ["selection_input", "gate"]  # the kernels' branch ran
    want = BranchingQNetwork(dataclasses.replace(cfg, impl="xla")).init(jax.random.key(0), obs)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_a_gradient_through_the_kernels_is_refused_by_name_and_stop_gradient_passes():
    """No derivative: a gradient with respect to obs or a weight raises naming the kernel;
    operands under stop_gradient (the grad-free forwards') differentiate to zero."""
    obs, sel, gate = _args(2)
    run = functools.partial(trunk_input.selection_input, matmul_dtype="float32",
                            interpret=True)
    with pytest.raises(TypeError, match="trunk_input.selection_input: the kernel has no"):
        jax.grad(lambda o: run(o, *sel).sum())(obs)
    with pytest.raises(TypeError, match="trunk_input.gate: the kernel has no derivative"):
        jax.grad(lambda w: trunk_input.gate(obs, w, *gate[1:], "float32", True)[1].sum())(
            gate[0])
    frozen = jax.grad(lambda w: run(*jax.lax.stop_gradient((obs, w)), *sel[1:]).sum()
                      + w.sum())(sel[0])
    np.testing.assert_array_equal(frozen, np.ones_like(sel[0]))


@pytest.mark.parametrize("md,fuse_next_obs,launches", [("bfloat16", False, 2),
                                                      ("float32", False, 1)])
def test_the_update_loss_runs_the_kernels_in_the_grad_free_forwards_at_s_prime(
        monkeypatch, md, fuse_next_obs, launches):
    """The trainer's loss and gradient with only this dtype's switch on: as ``gpu.toml`` runs
    it (``fuse_next_obs = false``) the forwards at s′ read obs through the kernels — bf16 runs
    the online and target networks apart (two calls of each kernel), float32 as one twin pass
    vmapped over the pair (one call each, the pair a grid axis) — never the differentiated
    forward. The loss and gradients are the XLA
    network's to rounding, and the target's parameters get a zero gradient (stop_gradient, not
    the kernels' refusal)."""
    from helpers import assert_loss_and_grads_close

    from jdqn.config import TrainConfig
    from jdqn.losses import Batch, init_moe_state, total_loss

    switch = "trunk_input_bf16" if md == "bfloat16" else "trunk_input_f32"
    _switch_only(monkeypatch, switch)
    cfg = _cfg(md, fuse_next_obs=fuse_next_obs)
    net, xla_net = (BranchingQNetwork(dataclasses.replace(cfg, impl=i))
                    for i in ("pallas", "xla"))
    k = jax.random.split(jax.random.key(0), 6)
    b, d = 64, len(cfg.branch_sizes)
    batch = Batch(obs=jax.random.normal(k[2], (b, W)), next_obs=jax.random.normal(k[3], (b, W)),
                  action=jax.random.randint(k[4], (b, d), 0, 2), reward=jnp.ones((b,)),
                  discount=jnp.full((b,), 0.9), weight=jnp.ones((b,)))
    params = _perturbed(init_params(net, k[0], W))
    target = _perturbed(init_params(net, k[1], W), 4)

    def loss(model):
        return lambda p: total_loss(p, target, batch, k[5], init_moe_state(3), 0.5, net=model,
                                    train_cfg=TrainConfig())

    calls = _count_kernels(monkeypatch)
    jax.make_jaxpr(jax.grad(lambda p: loss(net)(p)[0]))(params)
    assert sorted(calls) == sorted(["selection_input", "gate"] * launches)
    tol = 3e-2 if md == "bfloat16" else 1e-5
    assert_loss_and_grads_close(loss(net), loss(xla_net), params, tol)
    zero = jax.grad(lambda t: total_loss(params, t, batch, k[5], init_moe_state(3), 0.5,
                                         net=net, train_cfg=TrainConfig())[0])(target)
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(zero))
