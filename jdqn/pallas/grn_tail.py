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

Grad-free use only: the custom VJP's backward pass differentiates the reference, recomputing
the block's tail from its inputs, which would cost the backward pass more than the forward
kernel saves. The network asks for it where no gradient is taken
(``BranchingQNetwork.apply(..., grad_free=True)``); it is correct under ``jax.grad`` either way
(tested). Float32, or bf16 activations (bf16 matmuls): then the kernel reads bf16, computes
in float32 and rounds the output once, where XLA rounded the pre-norm sum to bf16 before the
LayerNorm's float32 statistics — the same function to bf16 rounding.

Measured on the H200 (B = 16384, ``bench/kernels.py --kernel grn_tail``, the pair's
``[2, B, 512]`` product): 48.7–57.4 µs at 2–16 rows per program against 69.0 µs for XLA's
kernels, bitwise repeatable; in the update (``bench/ab.py``, three machine sessions) 2.706–2.738
against 2.744–2.802 ms float32, and for bf16 operands 1.779–1.790 against 1.807–1.814 ms
(``docs/model.md``, "Kernels").
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


def _forward(y: Array, b: Array, x: Array, scale: Array, offset: Array, eps: float,
             interpret: bool, rows: int, warps: int) -> Array:
    m, h = x.shape
    if m == 0:  # no rows, no programs
        return reference(y, b, x, scale, offset, eps)
    mp = pl.cdiv(m, rows) * rows
    if mp != m:  # pad the rows to whole programs (padded rows are sliced off)
        y = jnp.pad(y, ((0, mp - m), (0, 0)))
        x = jnp.pad(x, ((0, mp - m), (0, 0)))
    row = lambda a: a.astype(jnp.float32).reshape(1, -1)
    b = row(b)
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
    )(y, y, b[:, :h], b[:, h:], x, row(scale), row(offset))
    return out[:m]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def grn_tail(y: Array, b: Array, x: Array, scale: Array, offset: Array,
             eps: float = EPSILON, interpret: bool = False, rows: int = ROWS_PER_PROGRAM,
             warps: int = NUM_WARPS) -> Array:
    """:func:`reference` as one Pallas kernel: y [M, 2H] (the GLU product without its bias),
    b [2H], x [M, H] (the residual), scale/offset [H] (LayerNorm) → [M, H] in x's dtype. Check
    :func:`eligible` first. ``interpret=True`` runs Pallas' interpreter (CPU tests)."""
    return _forward(y, b, x, scale, offset, eps, interpret, rows, warps)


def _fwd(y, b, x, scale, offset, eps, interpret, rows, warps):
    return _forward(y, b, x, scale, offset, eps, interpret, rows, warps), (y, b, x, scale,
                                                                           offset)


def _bwd(eps, interpret, rows, warps, residuals, g):
    _, pullback = jax.vjp(functools.partial(reference, eps=eps), *residuals)
    return pullback(g)


grn_tail.defvjp(_fwd, _bwd)
