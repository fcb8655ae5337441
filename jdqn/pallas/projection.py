"""Pallas kernel: categorical L2 projection of D distributions onto a uniform support.

The C51 target of every branch is the projection of the target net's distribution at the
double-Q action, placed at ``Tz = clip(r + γⁿ(1−done)·z)``. The oracle is
:func:`jdqn.losses.batch.project_uniform` (plain JAX):

    m[b, d, i] = Σ_j p[b, d, j] · max(0, 1 − |x[b, j] − i|),   x = (Tz − v_min) / Δz.

XLA compiles that ``[B, D, Z, Z]`` multiply-reduce into a reduction fusion that took 0.23–0.58 ms
at B = 16384 on an H200 (one update is ~5 ms), and a kernel that materialises the ``[Z, Z]``
hat weights per sample and reduces them across lanes was no better (0.36 ms). This kernel never
reduces across lanes: a program owns a block of rows and keeps the ``D`` projected
distributions ``[rows, Zp]`` as accumulators; it walks the source atoms ``j`` in order and adds
``p[:, d, j] · max(0, 1 − |x[:, j] − i|)`` to every target atom ``i`` at once. The summation
order is fixed (j = 0, 1, …), so the result is bitwise reproducible run to run.

Layout: Triton needs every block dimension to be a power of two, so the atom axis is padded to
``Zp`` and the branch axis to ``Dp`` (padded branches have probability 0 and are sliced off,
as are the padded target atoms; the kernel reads only the Z real source atoms), and the batch
to a multiple of the rows per program (padded rows sit far outside the support and are sliced
off). The branches are laid out side by side in one ``[B, Dp·Zp]`` row, a free reshape of
``[B, Dp, Zp]``. Rows per program shrink as ``Dp·Zp`` grows, to keep the accumulators
(``rows × Dp·Zp`` floats) in registers.

The projected target is a constant of the loss (it sits under ``stop_gradient``), so the kernel
needs no VJP.

Two layouts compute the same sums in the same order (bitwise equal results, tested):

* ``"lanes"`` (the default): the transposed problem, samples along the lanes. Inputs are
  passed as ``xᵀ [Zp, B]`` and ``pᵀ [Dp·Zp, B]``, so each j-step loads contiguous ``[1, C]``
  vectors (coalesced), and the accumulators are ``[Zp, C]`` tiles; the output comes back as
  ``mᵀ`` and is transposed by XLA. Measured on the H200 at B = 16384 (``bench/kernels.py``,
  ``bench/results/kernels_h200_projection_lanes.json``): **78 µs** at 32 samples per program,
  against 142 µs for ``"rows"`` and 225 µs for the XLA reference; bitwise repeatable. A sweep
  of samples per program and warps (``kernels_h200_projection_tiles.json``, pads and
  transposes included) gave 64.8–67.0 µs at **16 samples and 4 warps** against 75.7–79.8 at
  32 and 4 (62.1 at 32 and 8; 8 samples or 1–2 warps slower), the same bits, so the layout
  takes 16 (``LANES_SAMPLES_PER_PROGRAM``; the update: 2.807 / 2.816 against 2.845 / 2.825
  ms, ``train_h200_f32_projection_lanes16_ab_console.json``). Storing ``m`` in the row layout
  instead, by transposing the accumulators in registers before the store (the loss then needs
  no transposes, 64 µs of them in a bf16 profile), made the update 1.2–1.4 ms *slower* on an
  H100 (``train_h100_{bf16,f32}_projection_row_output_rejected_ab.json``), and storing them
  element by element through index arrays 32–90 µs slower
  (``…_projection_row_store_rejected_ab.json``): both rejected. Nor did the other side pay:
  the loss reading ``mᵀ`` as written, with the online logits computed batch-minor
  (``[A_d, Z, B]``), was 47–59 µs slower (``…_c51_loss_batch_minor_rejected_ab.json``).
  Nor did a transpose of its own: ``mᵀ`` → ``m`` as a second Pallas kernel (7.6 µs; the loss's
  transposing fusions went from the profile) made the bf16 update 37–44 µs slower on an H100
  (``train_h100_bf16_projection_rows_kernel_rejected_ab.json``).
* ``"rows"``: samples along the block's rows; each step of the j-loop loads the column
  ``x[:, j]`` (a strided load of one float per row, uncoalesced). Kept as the measured
  alternative.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

Array = jax.Array

ROWS_PER_PROGRAM = 32  # samples per program at the default sizes (Dp·Zp = 256)
# The "lanes" layout's samples per program (at most the layout's rows): 16 measured faster than
# 32 on the H200 at B = 16384 (bench/results/kernels_h200_projection_tiles.json)
LANES_SAMPLES_PER_PROGRAM = 16
_ACCUMULATORS = 8192  # rows × Dp·Zp floats held per program
_FAR = -1.0e4  # location of padded rows' atoms (in atom units): weight 0 everywhere


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Layout:
    """The padded row layout shared by the kernels over ``[B, D, Z]`` distributions: atoms
    padded to ``zp`` and branches to ``dp`` (powers of two, Triton's rule), ``rows`` samples per
    program (fewer as ``dp·zp`` grows, to keep ``rows·dp·zp`` accumulators in registers), the
    batch padded to ``bp``, a multiple of ``rows``."""

    b: int
    d: int
    z: int
    zp: int
    dp: int
    rows: int
    bp: int

    @staticmethod
    def of(b: int, d: int, z: int) -> Layout:
        zp, dp = _next_pow2(z), _next_pow2(d)
        rows = max(1, min(ROWS_PER_PROGRAM, _ACCUMULATORS // (dp * zp)))
        return Layout(b, d, z, zp, dp, rows, pl.cdiv(b, rows) * rows)

    def atom_positions(self, tz: Array, v_min: float, v_max: float) -> Array:
        """``x = (clip(Tz) − v_min)/Δz`` [bp, zp] in atom units; padding sits far away."""
        dz = (v_max - v_min) / (self.z - 1)
        x = (jnp.clip(tz.astype(jnp.float32), v_min, v_max) - v_min) / jnp.float32(dz)
        return jnp.pad(x, ((0, self.bp - self.b), (0, self.zp - self.z)), constant_values=_FAR)

    def branch_rows(self, a: Array, pad: float) -> Array:
        """``[B, D, Z]`` → float32 ``[bp, dp·zp]`` with ``pad`` in every padded slot. An input
        already padded (atoms to ``zp`` with ``pad``, branches to ``dp``) is only reshaped."""
        widths = ((0, self.bp - self.b), (0, self.dp - a.shape[1]), (0, self.zp - a.shape[2]))
        a = a.astype(jnp.float32)
        if any(w[1] for w in widths):
            a = jnp.pad(a, widths, constant_values=pad)
        return a.reshape(self.bp, self.dp * self.zp)


def _kernel(x_ref, p_ref, o_ref, *, n_branches: int, z: int, zp: int):
    i = jax.lax.broadcasted_iota(jnp.int32, (1, zp), 1).astype(jnp.float32)  # target atoms
    acc = [None] * n_branches
    for j in range(z):  # source atoms, in order
        w = jnp.maximum(0.0, 1.0 - jnp.abs(x_ref[:, pl.ds(j, 1)] - i))  # [R, Zp]
        for d in range(n_branches):
            term = p_ref[:, pl.ds(d * zp + j, 1)] * w
            acc[d] = term if acc[d] is None else acc[d] + term
    for d in range(n_branches):
        o_ref[:, pl.ds(d * zp, zp)] = acc[d]


def _kernel_lanes(x_ref, p_ref, o_ref, *, n_branches: int, z: int, zp: int):
    i = jax.lax.broadcasted_iota(jnp.int32, (zp, 1), 0).astype(jnp.float32)  # target atoms
    acc = [None] * n_branches
    for j in range(z):  # source atoms, in order (as in the rows layout)
        w = jnp.maximum(0.0, 1.0 - jnp.abs(x_ref[pl.ds(j, 1), :] - i))  # [Zp, C]
        for d in range(n_branches):
            term = p_ref[pl.ds(d * zp + j, 1), :] * w
            acc[d] = term if acc[d] is None else acc[d] + term
    for d in range(n_branches):
        o_ref[pl.ds(d * zp, zp), :] = acc[d]


@functools.partial(jax.jit, static_argnames=("v_min", "v_max", "interpret", "layout"))
def project_uniform_pallas(tz: Array, probs: Array, v_min: float, v_max: float,
                           interpret: bool = False, layout: str = "lanes") -> Array:
    """Same contract as :func:`jdqn.losses.batch.project_uniform`: tz [B, Z], probs [B, D, Z]
    (float32) → [B, D, Z]. ``probs`` may come with its atoms already padded to the layout's
    power of two with zeros (the double-Q kernel's output): then it is read as it is.
    ``interpret=True`` runs the kernel in Pallas' interpreter (CPU); ``layout`` is ``"rows"``
    or ``"lanes"`` (module docstring)."""
    if layout not in ("rows", "lanes"):
        raise ValueError(f"layout = {layout!r}: expected 'rows' or 'lanes'")
    (b, n_real), z = probs.shape[:2], tz.shape[-1]
    if probs.shape[-1] not in (z, _next_pow2(z)):
        raise ValueError(f"probs has {probs.shape[-1]} atoms; expected {z} (tz's), or "
                         f"{_next_pow2(z)} padded with zeros")
    lay = Layout.of(b, n_real, z)
    x = lay.atom_positions(tz, v_min, v_max)
    p = lay.branch_rows(probs, 0.0)
    zp, n_branches, rows, bp = lay.zp, lay.dp, lay.rows, lay.bp
    if layout == "lanes":
        cols = min(rows, LANES_SAMPLES_PER_PROGRAM)  # divides bp, a multiple of rows
        return _lanes(x, p, n_branches, z, zp, bp, cols, interpret)[:b, :n_real, :z].astype(
            probs.dtype)
    out = pl.pallas_call(
        functools.partial(_kernel, n_branches=n_branches, z=z, zp=zp),
        out_shape=jax.ShapeDtypeStruct((bp, n_branches * zp), jnp.float32),
        grid=(bp // rows,),
        in_specs=[pl.BlockSpec((rows, zp), lambda r: (r, 0)),
                  pl.BlockSpec((rows, n_branches * zp), lambda r: (r, 0))],
        out_specs=pl.BlockSpec((rows, n_branches * zp), lambda r: (r, 0)),
        interpret=interpret,
        name="c51_projection",
    )(x, p)
    return out.reshape(bp, n_branches, zp)[:b, :n_real, :z].astype(probs.dtype)


def _lanes(x: Array, p: Array, n_branches: int, z: int, zp: int, bp: int, cols: int,
           interpret: bool) -> Array:
    """The ``"lanes"`` layout on padded inputs x [Bp, Zp], p [Bp, Dp·Zp] → [Bp, Dp, Zp]."""
    out = pl.pallas_call(
        functools.partial(_kernel_lanes, n_branches=n_branches, z=z, zp=zp),
        out_shape=jax.ShapeDtypeStruct((n_branches * zp, bp), jnp.float32),
        grid=(bp // cols,),
        in_specs=[pl.BlockSpec((zp, cols), lambda c: (0, c)),
                  pl.BlockSpec((n_branches * zp, cols), lambda c: (0, c))],
        out_specs=pl.BlockSpec((n_branches * zp, cols), lambda c: (0, c)),
        interpret=interpret,
        name="c51_projection_lanes",
    )(x.T, p.T)
    return out.T.reshape(bp, n_branches, zp)
