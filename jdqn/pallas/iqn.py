"""Pallas kernel: the IQN head's dense stack in one pass, for grad-free forwards.

Per sample ``b`` and quantile fraction ``τ_bq`` (:func:`jdqn.networks.heads.iqn_features`)::

    out[b, q] = W2·relu(W1·(h_b ⊙ relu(We·cos(π i τ_bq) + be)) + b1) + b2

XLA runs this as separate kernels over ``[B·Q, H]`` tensors — at the default sizes
(B = 16384, Q = 8, H = 256) each is 134 MB in float32, written and read back several times
for a single forward. The kernel keeps a tile of ``rows`` samples in registers and loops over
the Q fractions, and within a fraction over column chunks of ``h ⊙ φ(τ)``, each multiplied
straight into ``W1`` (a ``[rows, F]`` accumulator): it reads ``h`` and ``τ`` and writes only
``out [B, Q, O]``; the weights (about 200 KB) are re-read per fraction from L2.

Where it runs: the **target network's** quantiles at s′ (``BranchingQNetwork(...,
grad_free=True)``), which carry no gradient. The custom VJP recomputes through the plain-JAX
stack, so differentiating through the kernel is correct (tested) but not faster: the online
forward at s, which is differentiated, keeps the XLA path.

Layout: every dimension is padded to a power of two (Triton's rule; padded weights are zero,
so padded features are exactly zero and padded outputs are sliced off); the batch is padded to
a multiple of ``rows``. Matmuls use JAX's default precision (TF32-class on Hopper, like XLA's
float32 GEMMs) unless ``jax_default_matmul_precision`` asks for ``"highest"``; under
``matmul_dtype = "bfloat16"`` the kernel rounds where the XLA path stores bf16 activations.

Status: tested in Pallas' interpreter against the plain-JAX stack (values, gradients, padded
and vmapped shapes). Measured on the H200 at B = 16384 (``bench/kernels.py --kernel iqn``,
``bench/results/kernels_h200_iqn.json``): 415–753 µs over tile shapes against 257 µs for XLA,
whose cuBLAS matmuls (with their separate elementwise kernels) reach ~52 TFLOP/s against the
kernel's ~32 — slower matmuls outweigh the traffic the fusion saves; the update takes 4.45 vs 4.27 ms with it. So ``impl = "pallas"``
selects it and ``"auto"`` does not (:data:`jdqn.pallas.GPU_VALIDATED`). Hopper's wgmma/TMA
path (Pallas Mosaic GPU) is the untried candidate for a version that wins.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

Array = jax.Array

ROWS = 64  # samples per program (a tile of ROWS × CHUNK floats per register tensor)
CHUNK = 64  # H columns per inner step


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (n - 1).bit_length())


# jax_default_matmul_precision values under which XLA's float32 matmuls may use TF32 (or less);
# under any other value (e.g. "highest", "float32", "F32_F32_F32", "TF32_TF32_F32_X3") the
# kernel computes in full float32, at least as precise as the XLA path.
_FAST = (None, "default", "fastest", "high", "bfloat16", "tensorfloat32", "BF16_BF16_F32",
         "TF32_TF32_F32")


def _precision() -> jax.lax.Precision:
    p = jax.config.jax_default_matmul_precision
    return jax.lax.Precision.DEFAULT if p in _FAST else jax.lax.Precision.HIGHEST


def _kernel(h_ref, t_ref, we_ref, be_ref, w1_ref, b1_ref, w2_ref, b2_ref, o_ref, *,
            n_q: int, mp: int, qp: int, fp: int, op: int, chunk: int, bf16: bool, precision):
    rows, hp = h_ref.shape
    act = jnp.bfloat16 if bf16 else jnp.float32

    def dot(a, w):
        return jnp.dot(a.astype(act), w.astype(act), precision=precision,
                       preferred_element_type=jnp.float32)

    def stored(y):  # where the XLA path stores a bf16 activation, round here too
        return y.astype(jnp.bfloat16).astype(jnp.float32) if bf16 else y

    taus = t_ref[...]  # [R, Qp]
    col = jax.lax.broadcasted_iota(jnp.int32, (rows, qp), 1)
    freq = jnp.pi * jax.lax.broadcasted_iota(jnp.int32, (1, mp), 1).astype(jnp.float32)
    for q in range(n_q):
        tau = jnp.sum(jnp.where(col == q, taus, 0.0), axis=1)[:, None]  # [R, 1]: column q
        emb = jnp.cos(freq * tau)  # [R, Mp]
        acc = jnp.zeros((rows, fp), jnp.float32)
        for c in range(hp // chunk):  # h ⊙ φ one column chunk at a time, straight into W1
            cols = pl.ds(c * chunk, chunk)
            phi = jnp.maximum(stored(stored(dot(emb, we_ref[:, cols])) + be_ref[:, cols]), 0.0)
            x = stored(h_ref[:, cols].astype(jnp.float32) * phi)  # [R, chunk]
            acc = acc + dot(x, w1_ref[cols, :])
        hid = jnp.maximum(stored(stored(acc) + b1_ref[...]), 0.0)  # [R, Fp]
        out = dot(hid, w2_ref[...]) + b2_ref[...]  # [R, Op]
        o_ref[:, pl.ds(q * op, op)] = out.astype(o_ref.dtype)


def _pad2(a: Array, rows: int, cols: int) -> Array:
    return jnp.pad(a, ((0, rows - a.shape[0]), (0, cols - a.shape[1])))


def _forward(h, taus, we, be, w1, b1, w2, b2, matmul_dtype, interpret, rows=ROWS, chunk=CHUNK,
             num_warps=None, num_stages=None):
    b, hd = h.shape
    n_q, m, f, o = taus.shape[1], we.shape[0], w1.shape[1], w2.shape[1]
    hp, mp, fp, op, qp = _pow2(hd), _pow2(m), _pow2(f), _pow2(o), _pow2(n_q, 1)
    chunk = min(chunk, hp)
    bp = pl.cdiv(b, rows) * rows
    out_dtype = jnp.float32 if matmul_dtype == "bfloat16" else h.dtype
    f32 = jnp.float32
    args = (_pad2(h, bp, hp),
            jnp.pad(taus.astype(f32), ((0, bp - b), (0, qp - n_q)), constant_values=0.5),
            _pad2(we.astype(f32), mp, hp), _pad2(be.astype(f32)[None], 1, hp),
            _pad2(w1.astype(f32), hp, fp), _pad2(b1.astype(f32)[None], 1, fp),
            _pad2(w2.astype(f32), fp, op), _pad2(b2.astype(f32)[None], 1, op))
    full = lambda shape: pl.BlockSpec(shape, lambda i: (0, 0))
    params = None
    if num_warps or num_stages:
        from jax.experimental.pallas import triton as pl_triton

        params = pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    out = pl.pallas_call(
        functools.partial(_kernel, n_q=n_q, mp=mp, qp=qp, fp=fp, op=op, chunk=chunk,
                          bf16=matmul_dtype == "bfloat16", precision=_precision()),
        out_shape=jax.ShapeDtypeStruct((bp, qp * op), f32),
        grid=(bp // rows,),
        in_specs=[pl.BlockSpec((rows, hp), lambda i: (i, 0)),
                  pl.BlockSpec((rows, qp), lambda i: (i, 0)),
                  full((mp, hp)), full((1, hp)), full((hp, fp)), full((1, fp)),
                  full((fp, op)), full((1, op))],
        out_specs=pl.BlockSpec((rows, qp * op), lambda i: (i, 0)),
        compiler_params=params,
        interpret=interpret,
        name="iqn_features",
    )(*args)
    return out.reshape(bp, qp, op)[:b, :n_q, :o].astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def iqn_features_pallas(h: Array, taus: Array, we: Array, be: Array, w1: Array, b1: Array,
                        w2: Array, b2: Array, matmul_dtype: str = "float32",
                        interpret: bool = False) -> Array:
    """Same contract as :func:`jdqn.networks.heads.iqn_features`: h [B, H], taus [B, Q],
    we [M, H], be [H], w1 [H, F], b1 [F], w2 [F, O], b2 [O] → [B, Q, O]. ``interpret=True``
    runs the kernel in Pallas' interpreter (CPU)."""
    if h.dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"iqn_features_pallas: h must be float32 or bfloat16, got {h.dtype}")
    if math.prod(h.shape) == 0:
        raise ValueError(f"iqn_features_pallas: empty batch, h shape {h.shape}")
    return _forward(h, taus, we, be, w1, b1, w2, b2, matmul_dtype, interpret)


def _fwd(h, taus, we, be, w1, b1, w2, b2, matmul_dtype, interpret):
    out = iqn_features_pallas(h, taus, we, be, w1, b1, w2, b2, matmul_dtype, interpret)
    return out, (h, taus, we, be, w1, b1, w2, b2)


def _bwd(matmul_dtype, interpret, res, g):
    from jdqn.networks.heads import iqn_features

    _, vjp = jax.vjp(lambda *a: iqn_features(*a, matmul_dtype), *res)
    return vjp(g)


iqn_features_pallas.defvjp(_fwd, _bwd)
