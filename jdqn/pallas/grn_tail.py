"""Pallas kernel: a GRN block's tail — bias, GLU, residual and LayerNorm in one pass.

A GRN block (:class:`jdqn.networks.trunk.GRNBlock`) ends with

    s   = x + σ(y_g + b_g) ⊙ (y_v + b_v)            y = [y_g, y_v] [M, 2H], the GLU product
    out = (s − mean(s)) · rsqrt(var(s) + ε) · γ + β   (LayerNorm over H, flax's fast variance
                                                       var = max(0, mean(s²) − mean(s)²))

XLA runs that as three kernels where no gradient is taken (the online and target forwards at
s′, paired under float32 matmuls): the GLU with the residual add writes ``s`` ``[M, H]``, a
reduction reads it for the statistics, and the normalisation reads it again and writes
``out``. This kernel reads ``y`` and ``x`` once and writes ``out`` once: each program owns
``rows`` rows, whose whole ``H``-wide sum stays in registers for the statistics. The oracle is :func:`reference` (what the block
computes in plain JAX); the kernel agrees with it to float32 rounding (the sigmoid is
``1 / (1 + exp(−g))`` and the row means are Triton's reductions), not bitwise; the kernel's
results are bitwise repeatable on the H200.

The gradient is a second kernel (:func:`_backward`). Per tile of ``BWD_ROWS`` rows it reads
``y``, ``x`` and the output's cotangent ``do``, recomputes ``s`` and the row statistics, and
writes the cotangents of the product ``dy = [dg, dv]`` ``[M, 2H]`` (in place, no concatenation)
and of the residual ``dx = ds`` ``[M, H]``::

    x̂ = (s − mean)·rstd,   d x̂ = do·γ
    ds = rstd·(d x̂ − mean(d x̂) − x̂·mean(d x̂·x̂))      (the last term only where var > 0)
    dv = ds·σ,   dg = ds·v·σ(1 − σ)

with its own column sums of ``dg``, ``dv`` (the bias gradient), ``do·x̂`` (γ's) and ``do``
(β's) as one ``[1, 4H]`` row of partials, which one XLA reduction sums over the programs — a
fixed order, so the gradients are bitwise repeatable. Nothing but the block's inputs is kept
for the backward pass (no pre-norm sum, no statistics). An earlier try kept the forward
kernel in the differentiated forward with a backward pass written in plain JAX
(2026-12-02, ``docs/model.md``): slower than XLA's own; as one kernel the backward pass reads
each operand once. The network takes the kernel in its differentiated forward under
``"grn_tail_grad"`` (:data:`jdqn.pallas.GPU_VALIDATED`; float32 matmuls only), and in
grad-free forwards under ``"grn_tail"``. The oracle of the gradients is the reference's, in
float64 (tested, also padded, vmapped, bf16 and through a constant row).

Float32, or bf16 activations (bf16 matmuls): then the kernel reads bf16, computes
in float32 and rounds the output once, where XLA rounded the pre-norm sum to bf16 before the
LayerNorm's float32 statistics — the same function to bf16 rounding.

Measured on the H200 (B = 16384, ``bench/kernels.py --kernel grn_tail``, the pair's
``[2, B, 512]`` product): 48.7–57.4 µs at 2–16 rows per program against 69.0 µs for XLA's
kernels, bitwise repeatable; in the update (``bench/ab.py``, three machine sessions) 2.706–2.738
against 2.744–2.802 ms float32, and for bf16 operands 1.779–1.790 against 1.807–1.814 ms
(``docs/model.md``, "Kernels"). The backward kernel (``bench/kernels.py --kernel
grn_tail_grad``, ``[B, 512]``): 90.2 µs at 8 rows on 4 warps against 98.4 µs for XLA's
autodiff of the reference (rows 4–16 on 2–4 warps within 1.4 µs; 16/8 107.8), gradients within
2.7e-7 relative, bitwise repeatable; in the update, with the forward kernel in the
differentiated forward too, 2.556–2.563 against 2.589–2.602 ms float32 (and 2.587–2.599
against 2.613–2.622 in another machine session, an earlier version that concatenated ``dy``
and summed four partial arrays); two ``gpu.toml`` runs bitwise identical. Under bf16 matmuls
1.752–1.757 against 1.743–1.747 ms — slower, so the differentiated forward keeps XLA's tail
there (:class:`jdqn.networks.trunk.GRNBlock`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

Array = jax.Array

# Rows of the [M, 2H] GLU product per program, and warps: 4 rows on 1 warp measured fastest in
# the update on the H200 (bench/results/train_h200_f32_grn_tail_ab*.json; 8/2, 16/2, 16/4 and
# 32/4 up to 30 µs slower), small tiles keeping more programs' loads in flight
ROWS_PER_PROGRAM = 4
NUM_WARPS = 1
EPSILON = 1e-6  # flax.linen.LayerNorm's default, which GRNBlock uses
# The backward kernel's tile: rows per program and warps (its per-program column sums of the
# parameter gradients are [M / BWD_ROWS, 4H] partials, summed by XLA)
BWD_ROWS = 8
BWD_WARPS = 4


def reference(y: Array, b: Array, x: Array, scale: Array, offset: Array,
              eps: float = EPSILON) -> Array:
    """The block's tail in plain JAX, as :class:`jdqn.networks.trunk.GRNBlock` computes it
    in float32: y [M, 2H], b [2H], x [M, H], scale/offset [H] → [M, H] in x's dtype (bf16
    operands are computed in float32 and the result rounded once, as the kernel does)."""
    out_dtype = x.dtype
    wide = jnp.promote_types(x.dtype, jnp.float32)
    y, x = y.astype(wide), x.astype(wide)
    gate, value = jnp.split(y + b.astype(wide), 2, axis=-1)
    s = x + jax.nn.sigmoid(gate) * value
    mean = jnp.mean(s, axis=-1, keepdims=True)
    var = jnp.maximum(jnp.mean(jnp.square(s), axis=-1, keepdims=True) - jnp.square(mean), 0.0)
    return ((s - mean) * (jax.lax.rsqrt(var + eps) * scale) + offset).astype(out_dtype)


def _kernel(yg_ref, yv_ref, bg_ref, bv_ref, x_ref, scale_ref, offset_ref, o_ref, *, eps: float):
    f32 = jnp.float32
    g = yg_ref[...].astype(f32) + bg_ref[...]
    v = yv_ref[...].astype(f32) + bv_ref[...]
    s = x_ref[...].astype(f32) + v / (1.0 + jnp.exp(-g))
    n = s.shape[1]
    mean = jnp.sum(s, axis=1, keepdims=True) / n
    var = jnp.maximum(jnp.sum(s * s, axis=1, keepdims=True) / n - mean * mean, 0.0)
    out = (s - mean) * (jax.lax.rsqrt(var + eps) * scale_ref[...]) + offset_ref[...]
    o_ref[...] = out.astype(o_ref.dtype)


def eligible(y: Array, x: Array) -> bool:
    """Whether the kernel takes these operands: both float32 or both bf16, H a power of two
    (Triton's block rule) and y exactly ``[M, 2H]`` for ``x [M, H]``."""
    h = x.shape[-1]
    return (y.dtype == x.dtype and x.dtype in (jnp.float32, jnp.bfloat16) and x.ndim == 2
            and y.shape == (x.shape[0], 2 * h) and h >= 16 and h & (h - 1) == 0)


def _pad_rows(rows: int, *arrays: Array) -> tuple[int, list[Array]]:
    """The rows rounded up to whole programs of ``rows``, and each ``[M, ·]`` array padded with
    zero rows to that count."""
    m = arrays[0].shape[0]
    mp = pl.cdiv(m, rows) * rows
    return mp, [a if mp == m else jnp.pad(a, ((0, mp - m), (0, 0))) for a in arrays]


def _row(a: Array) -> Array:
    """A parameter vector as a float32 ``[1, n]`` row (a kernel operand)."""
    return a.astype(jnp.float32).reshape(1, -1)


def _forward(y: Array, b: Array, x: Array, scale: Array, offset: Array, eps: float,
             interpret: bool, rows: int, warps: int) -> Array:
    m, h = x.shape
    if m == 0:  # no rows, no programs
        return reference(y, b, x, scale, offset, eps)
    mp, (y, x) = _pad_rows(rows, y, x)  # padded rows are sliced off
    b = _row(b)
    block = pl.BlockSpec((rows, h), lambda r: (r, 0))
    vector = pl.BlockSpec((1, h), lambda r: (0, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, eps=eps),
        out_shape=jax.ShapeDtypeStruct((mp, h), x.dtype),
        grid=(mp // rows,),
        in_specs=[pl.BlockSpec((rows, h), lambda r: (r, 0)),  # y's gate half
                  pl.BlockSpec((rows, h), lambda r: (r, 1)),  # y's value half
                  vector, vector, block, vector, vector],
        out_specs=block,
        interpret=interpret,
        name="grn_tail",
        compiler_params=pl_triton.CompilerParams(num_warps=warps),
    )(y, y, b[:, :h], b[:, h:], x, _row(scale), _row(offset))
    return out[:m]


def _bwd_kernel(yg_ref, yv_ref, bg_ref, bv_ref, x_ref, scale_ref, do_ref, dy_ref, dx_ref,
                sums_ref, *, eps: float):
    f32 = jnp.float32
    g = yg_ref[...].astype(f32) + bg_ref[...]
    v = yv_ref[...].astype(f32) + bv_ref[...]
    sig = 1.0 / (1.0 + jnp.exp(-g))
    s = x_ref[...].astype(f32) + v * sig
    n = s.shape[1]
    mean = jnp.sum(s, axis=1, keepdims=True) / n
    raw = jnp.sum(s * s, axis=1, keepdims=True) / n - mean * mean
    rstd = jax.lax.rsqrt(jnp.maximum(raw, 0.0) + eps)
    xhat = (s - mean) * rstd
    do = do_ref[...].astype(f32)
    dxhat = do * scale_ref[...]
    m1 = jnp.sum(dxhat, axis=1, keepdims=True) / n
    m2 = jnp.where(raw > 0.0, jnp.sum(dxhat * xhat, axis=1, keepdims=True) / n, 0.0)
    ds = rstd * (dxhat - m1 - xhat * m2)  # through the mean and the (clamped) variance
    dv = ds * sig
    dg = dv * v * (1.0 - sig)
    h = dg.shape[1]
    dy_ref[:, pl.ds(0, h)] = dg.astype(dy_ref.dtype)  # dy = [dg, dv], written in place
    dy_ref[:, pl.ds(h, h)] = dv.astype(dy_ref.dtype)
    dx_ref[...] = ds.astype(dx_ref.dtype)
    # this program's column sums: [db_gate, db_value, dscale, doffset]
    sums_ref[:, pl.ds(0, h)] = jnp.sum(dg, axis=0, keepdims=True)
    sums_ref[:, pl.ds(h, h)] = jnp.sum(dv, axis=0, keepdims=True)
    sums_ref[:, pl.ds(2 * h, h)] = jnp.sum(do * xhat, axis=0, keepdims=True)
    sums_ref[:, pl.ds(3 * h, h)] = jnp.sum(do, axis=0, keepdims=True)


def _backward(y: Array, b: Array, x: Array, scale: Array, d_out: Array, eps: float,
              interpret: bool, rows: int, warps: int) -> tuple[Array, ...]:
    """The tail's gradients from its inputs and the output's cotangent ``d_out [M, H]``:
    ``(dy [M, 2H] in y's dtype, db [2H], dx [M, H] in x's dtype, dscale [H], doffset [H])``.
    One kernel per tile of ``rows`` rows recomputes the forward (the statistics from the whole
    rows it holds), writes ``dy`` and ``dx`` and its own column sums of the parameter
    gradients; XLA sums those ``[M / rows, 4H]`` partials (a fixed order: bitwise
    repeatable)."""
    m, h = x.shape
    if m == 0:  # no rows, no programs: every gradient is zero
        zero = jnp.zeros((h,), jnp.float32)
        return jnp.zeros_like(y), jnp.zeros((2 * h,), jnp.float32), jnp.zeros_like(x), zero, zero
    # padded rows have a zero cotangent: every gradient they add is exactly zero
    mp, (y, x, d_out) = _pad_rows(rows, y, x, d_out)
    b = _row(b)
    programs = mp // rows
    block = pl.BlockSpec((rows, h), lambda r: (r, 0))
    vector = pl.BlockSpec((1, h), lambda r: (0, 0))
    dy, dx, sums = pl.pallas_call(
        functools.partial(_bwd_kernel, eps=eps),
        out_shape=(jax.ShapeDtypeStruct((mp, 2 * h), y.dtype),
                   jax.ShapeDtypeStruct((mp, h), x.dtype),
                   jax.ShapeDtypeStruct((programs, 4 * h), jnp.float32)),
        grid=(programs,),
        in_specs=[pl.BlockSpec((rows, h), lambda r: (r, 0)),  # y's gate half
                  pl.BlockSpec((rows, h), lambda r: (r, 1)),  # y's value half
                  vector, vector, block, vector, block],
        out_specs=(pl.BlockSpec((rows, 2 * h), lambda r: (r, 0)), block,
                   pl.BlockSpec((1, 4 * h), lambda r: (r, 0))),
        interpret=interpret,
        name="grn_tail_bwd",
        compiler_params=pl_triton.CompilerParams(num_warps=warps),
    )(y, y, b[:, :h], b[:, h:], x, _row(scale), d_out)
    sums = jnp.sum(sums, axis=0)  # [4H]: one reduction over the programs' partials
    return dy[:m], sums[:2 * h], dx[:m], sums[2 * h:3 * h], sums[3 * h:]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def grn_tail(y: Array, b: Array, x: Array, scale: Array, offset: Array,
             eps: float = EPSILON, interpret: bool = False, rows: int = ROWS_PER_PROGRAM,
             warps: int = NUM_WARPS, bwd_rows: int = BWD_ROWS,
             bwd_warps: int = BWD_WARPS) -> Array:
    """:func:`reference` as one Pallas kernel: y [M, 2H] (the GLU product without its bias),
    b [2H], x [M, H] (the residual), scale/offset [H] (LayerNorm) → [M, H] in x's dtype. Check
    :func:`eligible` first. ``interpret=True`` runs Pallas' interpreter (CPU tests). Its
    gradient is a second kernel (:func:`_backward`, tile ``bwd_rows`` × ``bwd_warps``)."""
    return _forward(y, b, x, scale, offset, eps, interpret, rows, warps)


def _fwd(y, b, x, scale, offset, eps, interpret, rows, warps, bwd_rows, bwd_warps):
    return _forward(y, b, x, scale, offset, eps, interpret, rows, warps), (y, b, x, scale,
                                                                           offset)


def _bwd(eps, interpret, rows, warps, bwd_rows, bwd_warps, residuals, g):
    y, b, x, scale, offset = residuals
    dy, db, dx, dscale, doffset = _backward(y, b, x, scale, g, eps, interpret, bwd_rows,
                                            bwd_warps)
    return (dy, db.astype(b.dtype), dx, dscale.astype(scale.dtype),
            doffset.astype(offset.dtype))


grn_tail.defvjp(_fwd, _bwd)
