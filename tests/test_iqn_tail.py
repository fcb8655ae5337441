"""The IQN head's output-stage kernels (jdqn.pallas.iqn_tail) in Pallas' interpreter: values and
gradients against the float64 reference, tiles, padding, vmapping, the ReLU's kink, and the
network taking them where (and only where) its switches say."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_grads_close, assert_loss_and_grads_close, pallas_kernel_names, x64
from test_pallas import _kernel_and_xla_losses

from jdqn.config import ModelConfig
from jdqn.pallas import iqn_tail

NAMES = ("pre", "b1", "w2", "b2")


def _args(m: int, f: int = 128, o: int = 14, seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(k[0], (m, f)), 0.3 * jax.random.normal(k[1], (f,)),
            jax.random.normal(k[2], (f, o)) / 4.0, jax.random.normal(k[3], (o,)))


def _f64(args, ct):
    """The reference's value and its gradients of ``Σ out · ct`` in float64 (the oracle)."""
    with x64():
        wide = [jnp.asarray(a, jnp.float64) for a in (*args, ct)]
        out = iqn_tail.reference(*wide[:-1])
        grads = jax.grad(lambda *a: jnp.sum(iqn_tail.reference(*a) * wide[-1]),
                         argnums=(0, 1, 2, 3))(*wide[:-1])
        return np.asarray(out), [np.asarray(g) for g in grads]


def _grads(args, ct, **tiles):
    return jax.grad(lambda *a: jnp.sum(iqn_tail.iqn_tail(*a, interpret=True, **tiles) * ct),
                    argnums=(0, 1, 2, 3))(*args)


def _assert_close(got, want):
    assert_grads_close(got, want, NAMES, dtype=jnp.float32)


@pytest.mark.parametrize("shape", [(37, 128, 14), (1, 16, 16), (64, 20, 3), (0, 128, 14)])
def test_iqn_tail_matches_the_float64_stage_and_its_gradient(shape):
    """Values and every gradient (the backward kernel's row gradient and its per-program
    partial sums) against float64, to float32 rounding: the default sizes' F and O with a last
    program padded, one row, F and O that are not powers of two (padded columns), no rows."""
    args = _args(*shape)
    ct = jax.random.normal(jax.random.key(7), (shape[0], shape[2]))
    out = iqn_tail.iqn_tail(*args, interpret=True)
    want, want_grads = _f64(args, ct)
    assert out.shape == (shape[0], shape[2]) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=0,
                               atol=2e-6 * max(np.abs(want).max(initial=0.0), 1.0))
    _assert_close(_grads(args, ct), want_grads)


@pytest.mark.parametrize("rows, warps, bwd_rows, bwd_steps", [(16, 1, 16, 1), (64, 2, 16, 3),
                                                              (32, 4, 32, 2)])
def test_iqn_tail_tiles_agree(rows, warps, bwd_rows, bwd_steps):
    """Any tile — rows per program forward; rows per step and steps per program backward (77
    rows leave a padded last program each time) — gives the float64 results to rounding."""
    tiles = {"rows": rows, "warps": warps, "bwd_rows": bwd_rows, "bwd_steps": bwd_steps}
    args = _args(77, seed=3)
    ct = jax.random.normal(jax.random.key(4), (77, 14))
    want, want_grads = _f64(args, ct)
    out = iqn_tail.iqn_tail(*args, interpret=True, **tiles)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=0, atol=2e-6 *
                               np.abs(want).max())
    _assert_close(_grads(args, ct, **tiles), want_grads)


def test_iqn_tail_gradient_at_the_relu_kink_is_zero_as_jax_relu():
    """Where ``pre + b1`` is exactly 0 the ReLU's derivative is taken as 0 (``jax.nn.relu``'s
    choice): the row gradient is 0 there and the bias gradient is the reference's."""
    pre, b1, w2, b2 = _args(16, 32, 4, seed=5)
    pre = pre.at[:, :8].set(-b1[:8])  # a kink in the first eight features of every row
    ct = jax.random.normal(jax.random.key(6), (16, 4))
    got = _grads((pre, b1, w2, b2), ct)
    assert np.all(np.asarray(got[0])[:, :8] == 0.0)
    _assert_close(got, _f64((pre, b1, w2, b2), ct)[1])


def test_iqn_tail_vmaps_over_parameter_sets():
    """Vmapped over two parameter sets and batches (``train.seeds`` vmapped), forward and
    backward: each set's results are its own float64 ones to rounding, and differ from the
    other's."""
    sets = [_args(21, 32, 6, seed=s) for s in (0, 1)]
    ct = jax.random.normal(jax.random.key(2), (2, 21, 6))
    stacked = tuple(jnp.stack(a) for a in zip(*sets))
    out = jax.vmap(lambda *a: iqn_tail.iqn_tail(*a, interpret=True))(*stacked)
    grads = jax.vmap(_grads)(stacked, ct)
    for i in range(2):
        want, want_grads = _f64(sets[i], ct[i])
        np.testing.assert_allclose(np.asarray(out[i], np.float64), want, rtol=0,
                                   atol=2e-6 * np.abs(want).max())
        _assert_close([g[i] for g in grads], want_grads)
    assert not np.allclose(grads[2][0], grads[2][1])


def test_iqn_tail_rows_are_independent():
    """A row changed changes its own output only (no data crosses rows in a program)."""
    args = _args(40, 32, 6)
    base = np.asarray(iqn_tail.iqn_tail(*args, interpret=True))
    moved = np.asarray(iqn_tail.iqn_tail(args[0].at[17].multiply(3.0), *args[1:],
                                         interpret=True))
    assert not np.array_equal(base[17], moved[17])
    np.testing.assert_array_equal(np.delete(base, 17, 0), np.delete(moved, 17, 0))


@pytest.mark.parametrize("shape", [(37, 128, 14), (64, 20, 3)])
def test_iqn_tail_bf16_follows_the_bf16_matmul_path(shape):
    """A bf16 ``pre`` (bf16 matmuls): the values are the bf16 path's (the bias added in float32
    and rounded once, a bf16 × bf16 product accumulated in float32) — the XLA reference's to
    float32 rounding — and the gradients the float64 oracle's to bf16 rounding (``d pre`` is
    bf16, rounded once; the bias and weight gradients float32), each at least as close to it
    as XLA's own gradient of the reference (the kernel sums ``db1`` and ``dW2`` from float32
    terms, XLA from bf16-rounded ones); padded F and O too."""
    pre, b1, w2, b2 = _args(*shape)
    args = (pre.astype(jnp.bfloat16), b1, w2, b2)
    ct = jax.random.normal(jax.random.key(7), (shape[0], shape[2]))
    out = iqn_tail.iqn_tail(*args, interpret=True)
    ref = iqn_tail.reference(*args)
    assert out.dtype == ref.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=0,
                               atol=1e-6 * float(jnp.max(jnp.abs(ref))))
    # The oracle reads the operands the products read: pre as given, W2 rounded to bf16.
    _, want = _f64((args[0].astype(jnp.float32), b1,
                    w2.astype(jnp.bfloat16).astype(jnp.float32), b2), ct)
    got = _grads(args, ct)
    assert got[0].dtype == jnp.bfloat16 and all(g.dtype == jnp.float32 for g in got[1:])
    xla = jax.vjp(iqn_tail.reference, *args)[1](ct)
    assert_grads_close(got, want, NAMES, rel=1e-2)
    for name, k, x, w in zip(NAMES, got, xla, want, strict=True):
        err = [float(np.max(np.abs(np.asarray(a, np.float64) - w))) for a in (k, x)]
        assert err[0] <= 1.05 * err[1] + 1e-6 * np.abs(w).max(), (name, err)


def test_iqn_tail_refuses_other_dtypes_and_ranks():
    pre, b1, w2, b2 = _args(8)
    with pytest.raises(TypeError, match="float32 or bfloat16 matrix"):
        iqn_tail.iqn_tail(pre.astype(jnp.float16), b1, w2, b2, interpret=True)
    with pytest.raises(TypeError, match="float32 or bfloat16 matrix"):
        iqn_tail.iqn_tail(pre[None], b1, w2, b2, interpret=True)
    with pytest.raises(TypeError, match="float32 or bfloat16 matrix"):  # differentiated too
        jax.grad(lambda p: jnp.sum(iqn_tail.iqn_tail(p, b1, w2, b2, interpret=True)))(
            pre.astype(jnp.float16))


@pytest.mark.parametrize(("keys", "matmul_dtype"), [
    (("iqn_tail", "iqn_tail_grad"), "float32"), (("iqn_tail_grad",), "float32"),
    (("iqn_tail",), "float32"), (("iqn_tail", "iqn_tail_grad"), "bfloat16"),
    (("iqn_tail_bf16", "iqn_tail_grad_bf16"), "bfloat16"), (("iqn_tail_grad_bf16",), "bfloat16"),
    (("iqn_tail_bf16", "iqn_tail_grad_bf16"), "float32")])
def test_network_runs_the_iqn_tail_kernels_where_its_switches_say(monkeypatch, keys,
                                                                  matmul_dtype):
    """Under float32 matmuls ``"iqn_tail_grad"`` puts the online head at s (differentiated)
    through the forward and backward kernels and ``"iqn_tail"`` the target network's head at s′
    (grad-free) through the forward kernel; under bf16 matmuls the switches are
    ``"iqn_tail_grad_bf16"`` and ``"iqn_tail_bf16"``, and neither dtype takes the other's.
    Either way the loss and its gradient are the XLA network's to rounding."""
    import jdqn.pallas as pallas_module
    from jdqn.losses import total as total_module
    from jdqn.networks import heads as heads_module
    from jdqn.networks import model as model_module
    from jdqn.networks import trunk as trunk_module

    def only(impl, kernel="projection"):  # the IQN tail's kernels only, nothing else
        return impl == "pallas" and kernel in keys
    for module in (pallas_module, total_module, heads_module, model_module, trunk_module):
        monkeypatch.setattr(module, "use_pallas", only)
    loss, xla_loss, params = _kernel_and_xla_losses(ModelConfig(
        width=32, n_grn_blocks=1, n_experts=3, expert_hidden=8, gate_hidden=8, head_hidden=16,
        n_atoms=11, iqn=True, iqn_embed=8, iqn_n=4, iqn_n_prime=4, iqn_tau_groups=2,
        matmul_dtype=matmul_dtype))
    names = [n for n in pallas_kernel_names(jax.make_jaxpr(jax.grad(
        lambda p: loss(p)[0]))(params).jaxpr) if n.startswith("iqn_tail")]
    suffix = "" if matmul_dtype == "float32" else "_bf16"
    grad, free = f"iqn_tail_grad{suffix}" in keys, f"iqn_tail{suffix}" in keys
    want_names = ["iqn_tail"] * (grad + free) + ["iqn_tail_bwd"] * grad
    assert sorted(names) == sorted(want_names), names
    assert_loss_and_grads_close(loss, xla_loss, params,
                                1e-5 if matmul_dtype == "float32" else 3e-2)
