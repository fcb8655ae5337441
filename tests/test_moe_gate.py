"""The MoE gated hidden layer's backward kernel (jdqn.pallas.moe_gate) in Pallas' interpreter:
gradients against the float64 reference, tiles, padding, vmapping, the ReLU's kink, and the
network taking it where its switch says."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_grads_close, assert_loss_and_grads_close, pallas_kernel_names, x64
from test_pallas import _kernel_and_xla_losses

from jdqn.config import ModelConfig
from jdqn.pallas import moe_gate

NAMES = ("pre", "b1", "gate")


def _args(m: int, k: int = 8, e: int = 64, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (m, k * e)), 0.3 * jax.random.normal(ks[1], (k * e,)),
            jax.nn.softmax(jax.random.normal(ks[2], (m, k)), axis=-1))


def _f64_grads(args, ct):
    with x64():
        wide = [jnp.asarray(a, jnp.float64) for a in (*args, ct)]
        return [np.asarray(g) for g in jax.grad(
            lambda *a: jnp.sum(moe_gate.reference(*a) * wide[-1]), argnums=(0, 1, 2))(*wide[:-1])]


def _grads(args, ct, **tile):
    return jax.grad(lambda *a: jnp.sum(moe_gate.gated_hidden(*a, True, **tile) * ct),
                    argnums=(0, 1, 2))(*args)


def _assert_close(got, want):
    assert_grads_close(got, want, NAMES, dtype=jnp.float32)


@pytest.mark.parametrize("shape", [(37, 8, 64), (5, 3, 16), (1, 2, 32), (0, 8, 64)])
@pytest.mark.parametrize("rows", [16, 4])
def test_gated_hidden_gradient_matches_float64(shape, rows):
    """The value is the reference's (XLA computes it); the gradients — the kernel's row
    gradient, gate gradient and per-program bias partial sums — are the float64 reference's to
    float32 rounding: the default K and E with a padded last program, an expert count that is
    not a power of two (a padded gate), one row, no rows."""
    args = _args(*shape)
    ct = jax.random.normal(jax.random.key(7), (shape[0], shape[1] * shape[2]))
    np.testing.assert_array_equal(moe_gate.gated_hidden(*args, True, rows),
                                  moe_gate.reference(*args))
    _assert_close(_grads(args, ct, rows=rows), _f64_grads(args, ct))


def test_gated_hidden_gradient_at_the_relu_kink_is_zero_as_jax_relu():
    pre, b1, gate = _args(16, 4, 16, seed=5)
    pre = pre.at[:, :5].set(-b1[:5])  # pre + b1 = 0 in expert 0's first five units
    ct = jax.random.normal(jax.random.key(6), (16, 64))
    got = _grads((pre, b1, gate), ct)
    assert np.all(np.asarray(got[0])[:, :5] == 0.0)
    _assert_close(got, _f64_grads((pre, b1, gate), ct))


def test_gated_hidden_gradient_vmaps_over_parameter_sets():
    sets = [_args(21, 4, 16, seed=s) for s in (0, 1)]
    ct = jax.random.normal(jax.random.key(2), (2, 21, 64))
    stacked = tuple(jnp.stack(a) for a in zip(*sets))
    grads = jax.vmap(_grads)(stacked, ct)
    for i in range(2):
        _assert_close([g[i] for g in grads], _f64_grads(sets[i], ct[i]))
    assert not np.allclose(grads[1][0], grads[1][1])


def test_gated_hidden_takes_float32_power_of_two_experts_only():
    pre, _, gate = _args(8, 4, 16)
    assert moe_gate.eligible(pre, gate)
    assert not moe_gate.eligible(pre.astype(jnp.bfloat16), gate)
    assert not moe_gate.eligible(pre[:, :48], gate[:, :4])  # E = 12
    assert not moe_gate.eligible(pre[:, :60], gate)  # K·E ≠ the width


@pytest.mark.parametrize("matmul_dtype", ["float32", "bfloat16"])
def test_network_runs_the_moe_gate_kernel_where_its_switch_says(monkeypatch, matmul_dtype):
    """Under float32 matmuls ``"moe_gate_grad"`` differentiates the online network's MoE
    through the backward kernel (one, at s; the grad-free forwards at s′ run no kernel: their
    forward is XLA's); under bf16 matmuls none. The loss and its gradient are the XLA
    network's to rounding."""
    import jdqn.pallas as pallas_module
    from jdqn.losses import total as total_module
    from jdqn.networks import heads as heads_module
    from jdqn.networks import model as model_module
    from jdqn.networks import trunk as trunk_module

    def only(impl, kernel="projection"):
        return impl == "pallas" and kernel == "moe_gate_grad"
    for module in (pallas_module, total_module, heads_module, model_module, trunk_module):
        monkeypatch.setattr(module, "use_pallas", only)
    loss, xla_loss, params = _kernel_and_xla_losses(ModelConfig(
        width=32, n_grn_blocks=1, n_experts=4, expert_hidden=16, gate_hidden=8, head_hidden=16,
        n_atoms=11, iqn=False, matmul_dtype=matmul_dtype))
    names = [n for n in pallas_kernel_names(jax.make_jaxpr(jax.grad(
        lambda p: loss(p)[0]))(params).jaxpr) if n.startswith("moe")]
    assert names == (["moe_gate_bwd"] if matmul_dtype == "float32" else []), names
    assert_loss_and_grads_close(loss, xla_loss, params,
                                1e-5 if matmul_dtype == "float32" else 3e-2)
