"""Pallas kernel: deterministic fixed-order tree reductions (SPEC §8, kernel 3).

``tree_sum(x)`` sums ``x [M, N]`` over its rows, ``[N]`` out, in an order fixed by the shapes
alone — not by the device, the tiling or how a compiler splits a reduction:

* **a level** groups the rows in consecutive blocks of ``R`` (``R = min(ROWS, next_pow2(M))``;
  the last block is completed with zero rows) and reduces each block by halving: row ``i`` is
  added to row ``i + R/2``, then the same on the ``R/2`` sums, down to one row. A level turns
  ``[M, N]`` into ``[⌈M/R⌉, N]``;
* **levels repeat** until one row is left (B = 16384: 16384 → 512 → 16 → 1).

Every addition is a float32 addition of two named operands (the zero rows add nothing, up to
the sign of a zero sum), so :func:`tree_sum_reference` — the same tree written with ``jnp``
slices — gives **bitwise** the kernel's result on the same backend: in Pallas' interpreter on
the CPU (tested, comparing bits) and compiled on the H200 against the reference run by XLA
there (``bench/kernels.py --kernel reduce``). The sum is bitwise repeatable (no atomics).
Across backends the same tree gives the same bits except where one flushes subnormals (XLA's
CPU backend does, the GPU does not by default). Being a pairwise sum, its rounding-error
bound grows like ``log₂ M`` rather than ``M`` (theory; the tests check that bound, the bench
measures its error against a float64 sum beside ``jnp.sum``'s).

One program reduces one ``[R, C]`` tile (``C ≤ COLS`` columns, a power of two; the tile never
changes the result): it loads the
tile with a mask (rows ≥ M and columns ≥ N read 0, so neither axis needs padding in memory), adds
halves with ``jnp.split`` (which Triton lowers for power-of-two parts) and writes one ``[1, C]``
row of the level's output. Inputs are summed in float32 (float64 ones in float64).

**Where the trainer uses it** (``ModelConfig.impl``, :mod:`jdqn.pallas`): :func:`add_bias`, a
bias add whose backward pass reduces the bias gradient — the batch sum of the cotangent, the
reduction in every dense layer — with :func:`tree_sum`. The forward pass is XLA's (the same
operations, :func:`jdqn.networks.trunk.add_bias_values`, so the values are bitwise those). The
gradient is the same function summed in another order (to float32 rounding; tested).
:func:`tree_sum` has a custom VJP too (a sum's: the cotangent broadcast over the rows), so a
gradient of a gradient through :func:`add_bias` works.

Status: measured on the H200 (jax 0.11.2). Alone (``bench/kernels.py --kernel reduce``), at
the twelve bias-gradient shapes of the default model's update at B = 16384, four tiles:
bitwise equal (bit patterns) to :func:`tree_sum_reference` run by XLA on the GPU and bitwise
repeatable at every shape and tile, for float32 and bf16 inputs
(``kernels_h200_reduce_{f32,bf16}_cols128.json``; a first run at 32 × 256 tiles over eleven
shapes, ``kernels_h200_reduce_f32_cols256.json``, compared values only). Its time: 12.5–116 µs
per shape at the default tile against 12.1–121 µs for ``jnp.sum`` (both reading a
materialised input), 439 against 404 µs over all twelve (float32) — from 0.9× to 3× XLA's
time per shape, the narrow ones (``[131072, 14]``: 38.8 vs 12.9 µs) the slowest; the column
tile (128 or 256) moved the total by under 5 %, in opposite directions in the two runs. In the
update, float32, two machine sessions: **3.76 vs 3.56 ms** (``train_h200_f32_tree_sum_bias.json``
against ``…_session_base.json``, 256 columns) and **3.70 vs 3.50 ms**
(``train_h200_f32_tree_sum_bias_cols128.json`` against ``…_session_base2.json``); bf16 2.46 vs
2.35 ms — slower. The serial-graph profiles
(``profile_h200_f32_tree_sum_{bias,session_base}.json``: 4.32 vs 4.20 ms) show why: XLA's
reductions fall by 0.48 ms, but the "other" kernels (the tree-sum levels, beside the projection
kernel) grow by 0.23 ms and XLA's elementwise fusions by 0.45 ms — XLA had computed each bias
sum in the same fusion as the elementwise backward that produces its cotangent, which a
separate reduction kernel splits in two. So ``impl = "pallas"`` selects it and ``"auto"`` does not
(:data:`jdqn.pallas.GPU_VALIDATED`). XLA's program is bitwise repeatable on the H200 without it
(``docs/training.md``, "Determinism"); the kernel's value is an order that is fixed by
construction and the same on every backend, for the bias sums it covers.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jdqn.pallas.projection import _next_pow2

Array = jax.Array

# Rows per block of a level (the halving tree's width: 5 halvings) and the widest column tile
# of one program; bench/kernels.py --kernel reduce sweeps them.
ROWS, COLS, NUM_WARPS = 32, 128, 4


def _halve(x: Array, axis: int) -> Array:
    """Add the second half of ``x`` along ``axis`` (a power of two) to the first, until one is
    left: the tree every level uses."""
    while x.shape[axis] > 1:
        lo, hi = jnp.split(x, 2, axis=axis)
        x = lo + hi
    return x


def _level_rows(m: int, rows: int) -> int:
    """Rows per block of a level over ``m`` rows."""
    return min(rows, _next_pow2(m))


def tree_sum_reference(x: Array, rows: int = ROWS) -> Array:
    """The sum over the rows of ``x [M, N]`` → float32 ``[N]`` in the kernel's order, in plain
    JAX (the oracle of :func:`tree_sum`; bitwise the same result)."""
    _check(x, rows)
    x = x.astype(_acc_dtype(x))
    m, n = x.shape
    if m == 0:
        return jnp.zeros((n,), x.dtype)
    while x.shape[0] > 1:
        m = x.shape[0]
        r = _level_rows(m, rows)
        g = -(-m // r)
        x = jnp.pad(x, ((0, g * r - m), (0, 0))).reshape(g, r, n)
        x = _halve(x, 1)[:, 0, :]
    return x[0]


def _acc_dtype(x: Array):
    """float32 for float32 and narrower inputs (float64 stays float64: the gradient tests)."""
    return jnp.promote_types(x.dtype, jnp.float32)


def _check(x: Array, rows: int) -> None:
    if x.ndim != 2:
        raise ValueError(f"tree_sum: expected a 2-D [rows, columns] array, got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"tree_sum: expected a float array, got {x.dtype}")
    if rows < 2 or rows & (rows - 1):
        raise ValueError(f"tree_sum: rows per block must be a power of two ≥ 2, got {rows}")


def _level_kernel(x_ref, o_ref, *, m: int, n: int, rows: int, cols: int):
    i, j = pl.program_id(0), pl.program_id(1)
    r = i * rows + jnp.arange(rows)
    c = j * cols + jnp.arange(cols)
    mask = (r[:, None] < m) & (c[None, :] < n)
    # Clamped indices keep every address in bounds (the interpreter gathers them all); the
    # mask then reads 0 for the rows and columns beyond the array.
    ri = jnp.minimum(r, m - 1)[:, None]
    ci = jnp.minimum(c, n - 1)[None, :]
    x = _load(x_ref.at[ri, ci], mask).astype(o_ref.dtype)  # [rows, cols]
    o_ref[...] = _halve(x, 0)


def _load(ref, mask: Array) -> Array:
    from jax.experimental.pallas import triton as pl_triton

    return pl_triton.load(ref, mask=mask, other=0.0)


def _params(num_warps: int | None):
    from jax.experimental.pallas import triton as pl_triton

    return pl_triton.CompilerParams(num_warps=num_warps)


def _level(x: Array, rows: int, cols: int, num_warps: int | None, interpret: bool) -> Array:
    m, n = x.shape
    r = _level_rows(m, rows)
    c = min(cols, _next_pow2(n))
    g, nc = -(-m // r), -(-n // c)
    out = pl.pallas_call(
        functools.partial(_level_kernel, m=m, n=n, rows=r, cols=c),
        out_shape=jax.ShapeDtypeStruct((g, nc * c), _acc_dtype(x)),
        grid=(g, nc),
        out_specs=pl.BlockSpec((1, c), lambda i, j: (i, j)),
        compiler_params=None if interpret else _params(num_warps),
        interpret=interpret,
        name="tree_sum_level",
    )(x)
    return out if nc * c == n else out[:, :n]


def tree_sum(x: Array, interpret: bool = False, rows: int = ROWS, cols: int = COLS,
             num_warps: int | None = NUM_WARPS) -> Array:
    """The sum over the rows of ``x [M, N]`` → float32 ``[N]`` (float64 for float64 input), in
    the fixed tree order of the module docstring, one Pallas kernel per level. Bitwise equal to
    :func:`tree_sum_reference` with the same ``rows`` on the same backend. ``cols`` (a power
    of two) only sets the tiling, never the result. Differentiable in reverse mode."""
    _check(x, rows)
    if cols < 1 or cols & (cols - 1):
        raise ValueError(f"tree_sum: columns per tile must be a power of two, got {cols}")
    return _tree_sum(x, interpret, rows, cols, num_warps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _tree_sum(x: Array, interpret: bool, rows: int, cols: int,
              num_warps: int | None) -> Array:
    m, n = x.shape
    if m == 0 or n == 0:
        return jnp.zeros((n,), _acc_dtype(x))
    if m == 1:
        return x[0].astype(_acc_dtype(x))
    while x.shape[0] > 1:
        x = _level(x, rows, cols, num_warps, interpret)
    return x[0]


def _tree_sum_fwd(x, interpret, rows, cols, num_warps):
    # residual: a zero-size array carrying x's shape and dtype
    return _tree_sum(x, interpret, rows, cols, num_warps), jnp.zeros((x.shape[0], 0), x.dtype)


def _tree_sum_bwd(interpret, rows, cols, num_warps, res, g):
    return (jnp.broadcast_to(g, (res.shape[0], g.shape[0])).astype(res.dtype),)


_tree_sum.defvjp(_tree_sum_fwd, _tree_sum_bwd)


def sum_leading(g: Array, n_trailing: int, interpret: bool = False) -> Array:
    """``g`` summed over all but its last ``n_trailing`` axes (a bias gradient) with
    :func:`tree_sum`: ``[..., *T]`` → float32 ``T``."""
    tail = g.shape[g.ndim - n_trailing:]
    return tree_sum(g.reshape(-1, math.prod(tail)), interpret).reshape(tail)


# ---- the bias add whose gradient is a tree sum --------------------------------------------


def _add_bias_values(y: Array, bias: Array) -> Array:
    from jdqn.networks.trunk import add_bias_values  # (no import cycle at module load)

    return add_bias_values(y, bias)


def add_bias(y: Array, bias: Array, interpret: bool = False) -> Array:
    """``y + bias`` (``bias`` matching ``y``'s trailing axes, broadcast over its leading ones),
    valued exactly as :func:`jdqn.networks.trunk.add_bias`; the bias gradient is
    :func:`tree_sum` of the cotangent over the leading axes, in float32, cast to the bias
    dtype."""
    if bias.ndim > y.ndim or y.shape[y.ndim - bias.ndim:] != bias.shape:
        raise ValueError(f"add_bias: the bias shape {bias.shape} must be the trailing axes of "
                         f"y's shape {y.shape}")
    return _add_bias(y, bias, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _add_bias(y: Array, bias: Array, interpret: bool) -> Array:
    return _add_bias_values(y, bias)


def _add_bias_fwd(y, bias, interpret):
    return _add_bias_values(y, bias), bias


def _add_bias_bwd(interpret, bias, g):
    db = sum_leading(g, bias.ndim, interpret)
    return g, db.astype(bias.dtype)


_add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)
