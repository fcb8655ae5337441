"""Pallas kernels: the IQN head's output stage — hidden bias, ReLU and output layer — forward
and backward.

The IQN head with fractions shared by groups of rows (:func:`jdqn.networks.heads.
iqn_features_shared`, the default) computes its first layer as one product ``pre = h ·
(diag φ(τ) W1)`` ``[B, Q·F]`` and then, per row of ``pre`` seen as ``[B·Q, F]``::

    out = relu(pre + b1) · W2 + b2          pre [M, F], b1 [F], W2 [F, O], b2 [O] → [M, O]

At the default sizes (B = 16384, Q = 8, F = 128, O = 14) ``pre`` is 67 MB in float32 and
``out`` 7 MB. XLA runs the forward as a bias add that writes ``pre + b1`` (kept for the ReLU's
derivative) and a GEMM that reads it back, and the backward as a GEMM writing ``d hid``
(67 MB), a masked reduction reading it and the pre-activation to write ``d pre`` and ``db1``,
and a GEMM re-reading the activation for ``dW2`` — about five 67 MB passes.

:func:`iqn_tail` reads ``pre`` once and writes ``out``: a tile of rows stays in registers from
the bias add to the output product (``[rows, F] × [F, O]``, O padded to 16). Its gradient
(:func:`_backward`) reads ``pre`` and ``d out`` once per tile of rows, recomputes the
activation, and writes ``d pre`` (the one large output: the first layer's products read it)
and, per program, its partial sums of ``dW2 = relu(·)ᵀ d out``, ``db1`` and ``db2``, which one
XLA reduction each sums over the programs — a fixed order, so the gradients are bitwise
repeatable. Nothing but the operands is kept for the backward pass. The products use JAX's
default precision (TF32-class on Hopper, like XLA's float32 GEMMs) unless
``jax_default_matmul_precision`` asks for more (:func:`jdqn.pallas.iqn._precision`).

The oracle is :func:`reference` (the plain-JAX stack's last two layers), to which values and
gradients agree to float32 rounding (tested against float64, padded and vmapped). The network
takes it under ``"iqn_tail_grad"`` (the online head at s, differentiated) and ``"iqn_tail"``
(grad-free forwards: the target network's quantiles at s′) with float32 matmuls, and under
``"iqn_tail_grad_bf16"`` / ``"iqn_tail_bf16"`` with bf16 ones
(:func:`jdqn.networks.model._iqn_head`).

**bf16** (``pre`` bf16, what bf16 matmuls store): the rounding points of the network's bf16
path — the bias added in float32 and the hidden layer rounded once to bf16, a bf16 × bf16
output product accumulated in float32. The backward kernel computes in float32 from the bf16
operands (``W2`` rounded as the forward product read it) and rounds ``d pre`` once to bf16;
``db1`` and ``dW2`` are summed from float32 terms, where XLA's gradient sums bf16-rounded ones,
so they are closer to the float64 oracle than XLA's (tested: each gradient at least as close).
On the GPU, XLA itself drops the f32 → bf16 → f32 round trip of ``W2`` in its gradient
(``xla_allow_excess_precision``), so there the two ``d pre`` differ by up to one bf16
rounding (6.9e-3 of the largest, ``kernels_h200_iqn_tail_bf16.json``).

Measured on the H200 (``bench/kernels.py --kernel iqn_tail`` / ``iqn_tail_grad``, rows
131072 = 16384 × 8, F = 128, O = 14): forward 46.0–46.2 µs at 64 rows on 4 warps against
67.8–68.6 for XLA's kernels; backward 115–120 µs at 32 rows × 2–8 steps on 4 warps against
154–158 for XLA's autodiff (64-row steps 145–155 µs); within 1e-6 relative of XLA's TF32
results, bitwise repeatable. Float32 FMA forms of the small products were far slower (82 µs to
4.5 ms, ``kernels_h200_iqn_tail_variants.json``). In the update: 2.532–2.534 against
2.576–2.589 ms (``train_h200_f32_iqn_tail_ab2.json``), two ``gpu.toml`` runs bitwise
identical; in the target's grad-free head as well it measured slower than in the online head
alone (2.556–2.566 against 2.550–2.553, ``…_ab1.json``), so ``"auto"`` takes
``"iqn_tail_grad"`` only (:data:`jdqn.pallas.GPU_VALIDATED`). Under bf16 (2026-12-03, fifth
session): forward 31.7–41.6 µs over five tiles against 50.4 for XLA (34–35 at the default
tile), backward 92.6–94.6 µs against 99.7–102.3; the update 1.688–1.703 ms with the kernels
in both heads against 1.733–1.738 (``train_h200_bf16_iqn_tail_ab2.json``), and in another call
1.682–1.696 with both and 1.707–1.709 with the online head's alone against 1.728–1.734
(``…_ab1.json``) — without the float32 path's bias-in-product fold the target's head gains
too, so ``"auto"`` takes both bf16 switches. Two bf16 ``gpu.toml`` runs bitwise identical
(``determinism_h200_bf16_iqn_tail.json``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jdqn.pallas.iqn import _pow2, _precision

Array = jax.Array

# Forward: rows per program and warps. Backward: rows per step, steps per program (the
# program's partial sums cover rows × steps rows) and warps.
ROWS = 64
WARPS = 4
BWD_ROWS = 32
BWD_STEPS = 4
BWD_WARPS = 4


def reference(pre: Array, b1: Array, w2: Array, b2: Array) -> Array:
    """The output stage in plain JAX, as :func:`jdqn.networks.heads.iqn_features_shared`
    computes it: pre [M, F], b1 [F], w2 [F, O], b2 [O] → [M, O] float32. A float32 ``pre``
    is the float32-matmul path; a bf16 ``pre`` the bf16 one (the bias added in float32 and
    rounded to bf16, a bf16 × bf16 product accumulated in float32)."""
    if pre.dtype == jnp.bfloat16:  # the network's own bf16 operations
        from jdqn.networks.trunk import add_bias_values, matmul

        return matmul(jax.nn.relu(add_bias_values(pre, b1)), w2, "bfloat16") + b2
    return jnp.dot(jax.nn.relu(pre + b1), w2) + b2


def _check(pre: Array) -> None:
    if pre.dtype not in (jnp.float32, jnp.bfloat16) or pre.ndim != 2:
        raise TypeError("iqn_tail: pre must be a float32 or bfloat16 matrix, got "
                        f"{pre.dtype}{list(pre.shape)}")


def _operands(pre, b1, w2, rows, w_dtype=jnp.float32):
    """Rows padded to whole programs of ``rows`` (zero rows, sliced off), F and O padded to
    powers of two ≥ 16 (zero columns: a padded feature is relu(0) = 0 and meets zero weights; a
    padded output is zero and sliced off); the bias as a float32 ``[1, F]`` row; ``W2`` in
    ``w_dtype``."""
    (m, f), o = pre.shape, w2.shape[1]
    mp, fp, op = pl.cdiv(m, rows) * rows, _pow2(f), _pow2(o)
    pre = jnp.pad(pre, ((0, mp - m), (0, fp - f))) if (mp, fp) != (m, f) else pre
    b1 = jnp.pad(b1.astype(jnp.float32), (0, fp - f))[None]
    return (mp, fp, op), pre, b1, jnp.pad(w2.astype(w_dtype), ((0, fp - f), (0, op - o)))


def _hidden(p, b1):
    """``(a, relu(a))``: the pre-activation ``p + b1`` in float32 and the hidden layer in
    ``p``'s dtype (bf16: the float32 sum rounded once, as ``add_bias``)."""
    a = p.astype(jnp.float32) + b1
    return a, jnp.maximum(a, 0.0).astype(p.dtype)


def _kernel(p_ref, b1_ref, w2_ref, b2_ref, o_ref, *, precision):
    _, hid = _hidden(p_ref[...], b1_ref[...])
    out = jnp.dot(hid, w2_ref[...], precision=precision, preferred_element_type=jnp.float32)
    o_ref[...] = out + b2_ref[...]


def _forward(pre, b1, w2, b2, interpret, rows, warps):
    _check(pre)
    m, o = pre.shape[0], w2.shape[1]
    if m == 0:
        return reference(pre, b1, w2, b2)
    (mp, fp, op), pre, b1, w2 = _operands(pre, b1, w2, rows, pre.dtype)  # bf16: bf16 × bf16
    b2 = jnp.pad(b2.astype(jnp.float32), (0, op - o))[None]
    full = lambda shape: pl.BlockSpec(shape, lambda r: (0, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, precision=_precision()),
        out_shape=jax.ShapeDtypeStruct((mp, op), jnp.float32),
        grid=(mp // rows,),
        in_specs=[pl.BlockSpec((rows, fp), lambda r: (r, 0)), full((1, fp)), full((fp, op)),
                  full((1, op))],
        out_specs=pl.BlockSpec((rows, op), lambda r: (r, 0)),
        interpret=interpret,
        name="iqn_tail",
        compiler_params=pl_triton.CompilerParams(num_warps=warps),
    )(pre, b1, w2, b2)
    return out[:m, :o]


def _bwd_kernel(p_ref, b1_ref, w2t_ref, g_ref, dp_ref, dw2t_ref, db1_ref, db2_ref, *,
                rows, steps, precision):
    f32 = jnp.float32
    op, fp = w2t_ref.shape
    dw2t = jnp.zeros((op, fp), f32)
    db1 = jnp.zeros((1, fp), f32)
    db2 = jnp.zeros((1, op), f32)
    for step in range(steps):
        sl = pl.ds(step * rows, rows)
        a, hid = _hidden(p_ref[sl, :], b1_ref[...])  # [rows, F]: the pre-activation
        g = g_ref[sl, :]  # [rows, O]: the output's cotangent
        # Both small products in float32 also for a bf16 pre (the float32 cotangent meets the
        # bf16 operand upcast, as in XLA's gradient of the bf16 path)
        dhid = jnp.dot(g, w2t_ref[...], precision=precision, preferred_element_type=f32)
        dpre = jnp.where(a > 0.0, dhid, 0.0)  # relu′(0) = 0, as jax.nn.relu
        dp_ref[sl, :] = dpre.astype(dp_ref.dtype)  # bf16 pre: rounded once
        # dW2ᵀ = gᵀ·relu(a): the small cotangent is the transposed operand, not the activation
        dw2t += jax.lax.dot_general(g, hid.astype(f32), (((0,), (0,)), ((), ())),
                                    precision=precision, preferred_element_type=f32)
        db1 += jnp.sum(dpre, axis=0, keepdims=True)
        db2 += jnp.sum(g, axis=0, keepdims=True)
    dw2t_ref[...] = dw2t
    db1_ref[...] = db1
    db2_ref[...] = db2


def _backward(pre, b1, w2, g, interpret, rows, steps, warps):
    """The gradients ``(d pre [M, F], db1 [F], dW2 [F, O], db2 [O])`` from the operands and the
    output's cotangent ``g [M, O]``. Padded rows carry a zero cotangent, so everything they add
    is exactly zero."""
    (m, f), o = pre.shape, w2.shape[1]
    if m == 0:
        return (jnp.zeros_like(pre), jnp.zeros((f,), jnp.float32), jnp.zeros((f, o), jnp.float32),
                jnp.zeros((o,), jnp.float32))
    tile = rows * steps
    # W2 as the forward product read it (bf16 pre: rounded to bf16), in float32
    (mp, fp, op), pre, b1, w2 = _operands(pre, b1, w2.astype(pre.dtype), tile)
    g = jnp.pad(g.astype(jnp.float32), ((0, mp - m), (0, op - o)))
    programs = mp // tile
    block = lambda cols: pl.BlockSpec((tile, cols), lambda r: (r, 0))
    row = lambda cols: pl.BlockSpec((1, cols), lambda r: (r, 0))
    dpre, dw2t, db1, db2 = pl.pallas_call(
        functools.partial(_bwd_kernel, rows=rows, steps=steps, precision=_precision()),
        out_shape=(jax.ShapeDtypeStruct((mp, fp), pre.dtype),
                   jax.ShapeDtypeStruct((programs * op, fp), jnp.float32),
                   jax.ShapeDtypeStruct((programs, fp), jnp.float32),
                   jax.ShapeDtypeStruct((programs, op), jnp.float32)),
        grid=(programs,),
        in_specs=[block(fp), pl.BlockSpec((1, fp), lambda r: (0, 0)),
                  pl.BlockSpec((op, fp), lambda r: (0, 0)), block(op)],
        out_specs=(block(fp), pl.BlockSpec((op, fp), lambda r: (r, 0)), row(fp), row(op)),
        interpret=interpret,
        name="iqn_tail_bwd",
        compiler_params=pl_triton.CompilerParams(num_warps=warps),
    )(pre, b1, w2.T, g)
    dw2 = jnp.sum(dw2t.reshape(programs, op, fp), axis=0).T  # fixed-order sums of partials
    return (dpre[:m, :f], jnp.sum(db1, axis=0)[:f], dw2[:f, :o], jnp.sum(db2, axis=0)[:o])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def iqn_tail(pre: Array, b1: Array, w2: Array, b2: Array, interpret: bool = False,
             rows: int = ROWS, warps: int = WARPS, bwd_rows: int = BWD_ROWS,
             bwd_steps: int = BWD_STEPS, bwd_warps: int = BWD_WARPS) -> Array:
    """:func:`reference` as one Pallas kernel, its gradient a second: pre [M, F] float32 or
    bf16, b1 [F], w2 [F, O], b2 [O] → [M, O] float32 (``d pre`` in ``pre``'s dtype).
    ``interpret=True`` runs Pallas' interpreter (CPU tests)."""
    return _forward(pre, b1, w2, b2, interpret, rows, warps)


def _fwd(pre, b1, w2, b2, interpret, rows, warps, bwd_rows, bwd_steps, bwd_warps):
    return _forward(pre, b1, w2, b2, interpret, rows, warps), (pre, b1, w2, b2)


def _bwd(interpret, rows, warps, bwd_rows, bwd_steps, bwd_warps, residuals, g):
    pre, b1, w2, b2 = residuals
    dpre, db1, dw2, db2 = _backward(pre, b1, w2, g, interpret, bwd_rows, bwd_steps, bwd_warps)
    return dpre, db1.astype(b1.dtype), dw2.astype(w2.dtype), db2.astype(b2.dtype)


iqn_tail.defvjp(_fwd, _bwd)
