"""Pallas kernel: the backward pass of the IQN head's τ modulation, in one pass.

The IQN head (:func:`jdqn.networks.heads.iqn_features`) modulates the trunk feature ``h`` with
the τ embedding::

    x[b, q] = h[b] ⊙ relu(pre[b, q] + be)          h [B, H], pre [B, Q, H], be [H] → [B, Q, H]

where ``pre`` is the embedding matmul's output. With ``g`` the cotangent of ``x``, its
gradients are

    dh[b]      = Σ_q g[b, q] ⊙ relu(pre[b, q] + be)                              [B, H]
    dpre[b, q] = g[b, q] ⊙ h[b] ⊙ 1[pre[b, q] + be > 0]                          [B, Q, H]
    dbe        = Σ_{b, q} dpre[b, q]                                             [H]

XLA computes them in two kernels that each read ``g`` and ``pre`` (``[B, Q, H]``, 134 MB each
in float32 at B = 16384, Q = 8, H = 256): one for ``dh`` (a sum over Q) and one for ``dpre``
with the partial sums of ``dbe`` (a sum over B·Q); being reductions over different axes, they
do not fuse. The kernel here reads each input once and writes ``dpre``, ``dh`` and one partial
sum of ``dbe`` per program (summed by XLA afterwards, a ``[B / rows, H]`` array): three passes
over ``[B, Q, H]`` tensors instead of five. Every sum runs in a fixed order: bitwise repeatable.

The forward pass stays XLA's (one elementwise kernel, the same operations as the reference, so
the values are bitwise the reference's); :func:`modulate` wraps both in a ``custom_vjp``.

Float32 only, ``Q`` and ``H`` powers of two (Triton's block rule; no padding of the big
tensors): :func:`eligible` says when; otherwise the caller keeps the reference. The batch is
padded to a multiple of ``ROWS`` when it is not one (at the default sizes it is).

Status: measured on the H200 at B = 16384, Q = 8, H = 256. In the update
(``bench/results/train_h200_f32_pallas_modulation.json`` against
``train_h200_f32_modulation_session_base.json``, one machine session): 3.526 vs 3.542 ms, noise.
So ``impl = "pallas"`` selects it and ``"auto"`` does not (:data:`jdqn.pallas.GPU_VALIDATED`).
Alone (``bench/kernels.py --kernel modulation``, ``kernels_h200_modulation.json``): 214 µs at
the best of five tiles (2 samples per program, 4 warps; 302–1369 µs for the others), gradients
within 3e-7 relative, ``dpre`` exact, bitwise repeatable; the 78 µs that file gives for XLA is
too low to be the same work (writing ``dpre`` alone moves 134 MB): the timing loop then summed
the outputs inside the jit, so XLA could fuse the sum of ``dpre`` instead of writing it. With
an optimisation barrier before the sums (``kernels_h200_modulation_barrier.json``): 218 µs for
the kernel against 234 µs for XLA. Inside the update,
XLA's two kernels for this took 77 µs (``dh``, fused there with the accumulation of ``h``'s
other gradients) + 107 µs (``profile_h200_f32_separate_next.json``). The kernel's 3-D
``[rows, Q, H]`` tiles are what a next version would change (e.g. a ``[rows·Q, H]`` layout with
the sum over Q as a segment sum).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

Array = jax.Array

# Samples per program (a [ROWS, Q, H] tile per tensor) and warps per program; bench/kernels.py
# --kernel modulation sweeps them.
ROWS, NUM_WARPS = 2, 4


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# Largest Q·H tile row the kernel takes: each program holds a few [ROWS, Q, H] float32 tensors
# in registers (the default head: Q·H = 2048).
MAX_QH = 8192


def eligible(pre: Array) -> bool:
    """Whether the kernel takes ``pre [B, Q, H]``: float32, B > 0, Q and H powers of two with
    Q·H ≤ :data:`MAX_QH`."""
    return (pre.ndim == 3 and pre.dtype == jnp.float32 and pre.shape[0] > 0
            and _is_pow2(pre.shape[1]) and _is_pow2(pre.shape[2])
            and pre.shape[1] * pre.shape[2] <= MAX_QH)


def reference(h: Array, pre: Array, be: Array) -> Array:
    """The oracle (and the forward pass): ``h[:, None, :] * relu(pre + be)``."""
    return h[:, None, :] * jax.nn.relu(pre + be.astype(pre.dtype))


def _bwd_kernel(g_ref, h_ref, pre_ref, be_ref, dh_ref, dpre_ref, dbe_ref):
    g = g_ref[...]  # [R, Q, H]
    z = pre_ref[...] + be_ref[...]  # + [1, 1, H]
    pos = z > 0
    # relu as jax.nn.relu computes it (a NaN stays NaN); its gradient is 0 at z ≤ 0 (and NaN)
    dh_ref[...] = jnp.sum(g * jnp.maximum(z, 0.0), axis=1, keepdims=True)  # [R, 1, H]
    dpre = jnp.where(pos, g * h_ref[...], 0.0)  # h: [R, 1, H]
    dpre_ref[...] = dpre
    dbe_ref[...] = jnp.sum(jnp.sum(dpre, axis=1, keepdims=True), axis=0, keepdims=True)


def _params(num_warps: int | None):
    if not num_warps:
        return None
    from jax.experimental.pallas import triton as pl_triton

    return pl_triton.CompilerParams(num_warps=num_warps)


def backward(g: Array, h: Array, pre: Array, be: Array,
             interpret: bool = False) -> tuple[Array, Array, Array]:
    """``(dh [B, H], dpre [B, Q, H], dbe [H])`` for the cotangent ``g [B, Q, H]`` of
    :func:`reference` ``(h, pre, be)``, by the kernel."""
    rows, num_warps = ROWS, NUM_WARPS  # read at trace time (the bench sweeps them)
    b, q, hw = pre.shape
    bp = -(-b // rows) * rows
    pad = ((0, bp - b), (0, 0), (0, 0))
    g3, pre3 = jnp.pad(g.astype(jnp.float32), pad), jnp.pad(pre, pad)  # no-ops when bp == b
    h3 = jnp.pad(h.astype(jnp.float32)[:, None, :], pad)
    n = bp // rows
    dh, dpre, dbe = pl.pallas_call(
        _bwd_kernel,
        out_shape=(jax.ShapeDtypeStruct((bp, 1, hw), jnp.float32),
                   jax.ShapeDtypeStruct((bp, q, hw), jnp.float32),
                   jax.ShapeDtypeStruct((n, 1, hw), jnp.float32)),
        grid=(n,),
        in_specs=[pl.BlockSpec((rows, q, hw), lambda i: (i, 0, 0)),
                  pl.BlockSpec((rows, 1, hw), lambda i: (i, 0, 0)),
                  pl.BlockSpec((rows, q, hw), lambda i: (i, 0, 0)),
                  pl.BlockSpec((1, 1, hw), lambda i: (0, 0, 0))],
        out_specs=[pl.BlockSpec((rows, 1, hw), lambda i: (i, 0, 0)),
                   pl.BlockSpec((rows, q, hw), lambda i: (i, 0, 0)),
                   pl.BlockSpec((1, 1, hw), lambda i: (i, 0, 0))],
        compiler_params=_params(num_warps),
        interpret=interpret,
        name="iqn_modulation_bwd",
    )(g3, h3, pre3, be.astype(jnp.float32).reshape(1, 1, hw))
    # padded samples have g = 0: they add nothing to dbe
    return dh[:b, 0], dpre[:b], jnp.sum(dbe[:, 0], axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def modulate(h: Array, pre: Array, be: Array, interpret: bool = False) -> Array:
    """:func:`reference` ``(h, pre, be)`` whose backward pass is the kernel (float32,
    :func:`eligible` shapes)."""
    if (not eligible(pre) or h.dtype != jnp.float32 or h.shape != (pre.shape[0], pre.shape[2])
            or be.shape != pre.shape[2:]):
        raise ValueError(f"iqn modulation kernel: needs float32 h [B, H], pre [B, Q, H] and be "
                         f"[H] with B > 0, Q and H powers of two, Q·H ≤ {MAX_QH}; got h "
                         f"{h.shape} {h.dtype}, pre {pre.shape} {pre.dtype}, be {be.shape}")
    return reference(h, pre, be)


def _fwd(h, pre, be, interpret):
    return modulate(h, pre, be, interpret), (h, pre, be)


def _bwd(interpret, res, g):
    h, pre, be = res
    dh, dpre, dbe = backward(g, h, pre, be, interpret)
    return dh, dpre, dbe.astype(be.dtype)


modulate.defvjp(_fwd, _bwd)
