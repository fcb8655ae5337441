"""Pallas kernel: deterministic fixed-order tree reductions (SPEC §8, kernel 3).

``tree_sum(x)`` sums ``x [M, N]`` over its rows, ``[N]`` out, in an order fixed by the shapes
alone — the same on every run, device and backend:

* **a level** groups the rows in consecutive blocks of ``R`` (``R = min(ROWS, next_pow2(M))``;
  the last block is completed with zero rows) and reduces each block by halving: row ``i`` is
  added to row ``i + R/2``, then the same on the ``R/2`` sums, down to one row. A level turns
  ``[M, N]`` into ``[⌈M/R⌉, N]``;
* **levels repeat** until one row is left (B = 16384: 16384 → 512 → 16 → 1).

Every addition is a float32 addition of two named operands (``x + 0 = x`` exactly for the
zero rows), so :func:`tree_sum_reference` — the same tree written with ``jnp`` slices — gives
**bitwise** the kernel's result, in Pallas' interpreter on the CPU and compiled on the GPU
(tested), and the sum is bitwise repeatable with no atomics and no dependence on how a
compiler splits a reduction across threads. Its rounding error grows like ``log₂ M`` (a
pairwise sum), not like ``M`` (a running sum).

One program reduces one ``[R, C]`` tile (``C ≤ COLS`` columns, a power of two): it loads the
tile with a mask (rows ≥ M and columns ≥ N read 0, so neither axis needs padding in memory), adds
halves with ``jnp.split`` (which Triton lowers for power-of-two parts) and writes one ``[1, C]``
row of the level's output. Inputs are summed in float32 (float64 ones in float64).

**Where the trainer uses it** (``ModelConfig.impl``, :mod:`jdqn.pallas`): :func:`add_bias`, a
bias add whose backward pass reduces the bias gradient — the batch sum of the cotangent, the
reduction in every dense layer — with :func:`tree_sum`. The forward pass is XLA's (the same
operations as :func:`jdqn.networks.trunk.add_bias`, so the values are bitwise those). The
gradient is the same function summed in another order (to float32 rounding; tested).

Status: measured on the H200 (jax 0.11.2). Alone (``bench/kernels.py --kernel reduce``,
``bench/results/kernels_h200_reduce.json``), at the eleven bias-gradient shapes of the default
model's update at B = 16384, four tiles: bitwise equal to :func:`tree_sum_reference` run by XLA
on the GPU and bitwise repeatable at every shape and tile; at the default tile 16–68 µs against
13–65 µs for ``jnp.sum`` (both reading a materialised input; e.g. ``[16384, 256]`` 22.7 vs
25.5 µs, ``[131072, 128]`` 67.5 vs 65.2, ``[16384, 51]`` 23.3 vs 14.4), and more accurate
than a running sum (pairwise). In the update (``train_h200_f32_tree_sum_bias.json`` against
``train_h200_f32_tree_sum_session_base.json``, one machine session): **3.76 vs 3.56 ms** float32
and 2.46 vs 2.35 ms bf16 — slower. The serial-graph profiles
(``profile_h200_f32_tree_sum_{bias,session_base}.json``: 4.32 vs 4.20 ms) show why: XLA's
reductions fall by 0.48 ms, but the tree-sum levels take 0.23 ms and XLA's elementwise fusions
grow by 0.45 ms — XLA had computed each bias sum in the same fusion as the elementwise backward
that produces its cotangent, which a separate reduction kernel splits in two. So ``impl = "pallas"`` selects it and ``"auto"`` does not
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

Array = jax.Array

# Rows per block of a level (the halving tree's width: 5 halvings) and the widest column tile
# of one program; bench/kernels.py --kernel reduce sweeps them.
ROWS, COLS, NUM_WARPS = 32, 256, 4


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


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
    """The sum over the rows of ``x [M, N]`` → float32 ``[N]``, in the fixed tree order of the
    module docstring, one Pallas kernel per level. Bitwise equal to
    :func:`tree_sum_reference` with the same ``rows``. ``cols`` (a power of two) only sets the
    tiling, never the result."""
    _check(x, rows)
    if cols < 1 or cols & (cols - 1):
        raise ValueError(f"tree_sum: columns per tile must be a power of two, got {cols}")
    m, n = x.shape
    if m == 0 or n == 0:
        return jnp.zeros((n,), _acc_dtype(x))
    if m == 1:
        return x[0].astype(_acc_dtype(x))
    while x.shape[0] > 1:
        x = _level(x, rows, cols, num_warps, interpret)
    return x[0]


def sum_leading(g: Array, n_trailing: int, interpret: bool = False) -> Array:
    """``g`` summed over all but its last ``n_trailing`` axes (a bias gradient) with
    :func:`tree_sum`: ``[..., *T]`` → float32 ``T``."""
    tail = g.shape[g.ndim - n_trailing:]
    return tree_sum(g.reshape(-1, math.prod(tail)), interpret).reshape(tail)


# ---- the bias add whose gradient is a tree sum --------------------------------------------


def _add_bias_fwd_values(y: Array, bias: Array) -> Array:
    # the same operations as jdqn.networks.trunk.add_bias
    if y.dtype == jnp.bfloat16:
        return (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(jnp.bfloat16)
    return y + bias.astype(y.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def add_bias(y: Array, bias: Array, interpret: bool = False) -> Array:
    """``y + bias`` (``bias`` broadcast over ``y``'s leading axes), valued exactly as
    :func:`jdqn.networks.trunk.add_bias`; the bias gradient is :func:`tree_sum` of the
    cotangent over the leading axes, in float32, cast to the bias dtype."""
    return _add_bias_fwd_values(y, bias)


def _add_bias_fwd(y, bias, interpret):
    return _add_bias_fwd_values(y, bias), bias


def _add_bias_bwd(interpret, bias, g):
    db = sum_leading(g, bias.ndim, interpret)
    return g, db.astype(bias.dtype)


add_bias.defvjp(_add_bias_fwd, _add_bias_bwd)
