"""Pallas kernels: the MoE mixture fused with the experts' output layer, forward and backward.

SPEC §8, kernel 2. The mixture of :class:`jdqn.networks.trunk.MixtureOfExperts` with the gate
softmax and the experts' second layer folded in (``a_k`` the experts' hidden ReLU layer)::

    g = softmax(gate_logits)                                   [B, K]
    h = Σ_k g_k · (a_k W2_k + b2_k) = Σ_k (g_k a_k) W2_k + g·b2   [B, H]

The forward kernel takes a tile of ``rows`` samples: the softmax, then per expert one
``[rows, E] × [E, H]`` product into a ``[rows, H]`` accumulator, so neither the expert outputs
``e_k = a_k W2_k + b2_k`` (``[B, K, H]``) nor the weighted hidden layer reach device memory. It
returns ``h`` and the gate (the load-balance loss and the diagnostics read it).

The backward kernel, per tile, with ``dh`` the cotangent of ``h``: ``d_k = dh·W2_kᵀ``
(``[rows, E]``), ``da_k = g_k·d_k``, ``dg_k = Σ_e a_k·d_k + dh·b2_k`` (= ``Σ_c e_k·dh``, SPEC's
``dg_k``, without forming ``e_k``), and through the softmax ``dlogits = g ⊙ (dg − Σ_k g_k dg_k)``.
The weight gradients are sums over the whole batch, left to XLA's matmuls:
``dW2_k = (g_k a_k)ᵀ dh``, ``db2 = gᵀ dh``. A cotangent arriving on the gate output itself (the
load-balance term) goes through the softmax outside the kernel.

Layout: the hidden layer is read as ``[B, K·Ep]`` rows (a free reshape), ``W2`` as
``[K·Ep, Hp]`` and, for the backward pass, its transpose ``[Hp, K·Ep]`` (made by XLA, 512 KB at
the default sizes); ``E``, ``H`` and the gate width are padded to powers of two ≥ 16 (Triton's
rule), padded gate logits are ``−1e30`` (gate 0), padded weights zero, and the batch is padded
to a multiple of ``rows``. Every sum runs in a fixed order: bitwise repeatable. Float32 only:
under ``matmul_dtype = "bfloat16"`` the layer keeps the XLA path (its bf16 rounding points are
the XLA path's own). Matmul precision follows ``jax_default_matmul_precision`` as in
:mod:`jdqn.pallas.iqn`.

The oracle is the layer's plain-JAX mixture (:func:`moe_mixture_reference`), tested against in
Pallas' interpreter (values and all four gradients, odd shapes, vmapped over seeds).

Status: measured on the H200 at B = 16384, K = 8, E = 64, H = 256 (``bench/kernels.py --kernel
moe``, ``bench/results/kernels_h200_moe.json``): 551–597 µs forward + backward over six tile
shapes against 137 µs for the XLA path, gradients within 8e-5 relative of it (TF32), bitwise
repeatable; the update takes 5.08 ms with it against 4.19. XLA runs the same arithmetic as two
large cuBLAS GEMMs; the kernel's per-expert Triton dots are small. So ``impl = "pallas"``
selects it and ``"auto"`` does not (:data:`jdqn.pallas.GPU_VALIDATED`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jdqn.pallas.iqn import _pow2, _precision

Array = jax.Array

# Tiles (bench/kernels.py --kernel moe sweeps them): samples per program and output columns
# per program in the forward kernel (the accumulator is [ROWS, H_CHUNK]); samples per program
# in the backward kernel (it holds a [BWD_ROWS, H] cotangent tile); warps per program.
ROWS, H_CHUNK, BWD_ROWS, NUM_WARPS = 64, 64, 32, 4
_NEG = -1.0e30  # logit of a padded expert: gate exactly 0


def _column(x: Array, j: int, width: int) -> Array:
    """Column ``j`` of a ``[R, width]`` tile as ``[R, 1]`` (a masked row sum: Triton has no
    dynamic column slice of a register tensor)."""
    col = jax.lax.broadcasted_iota(jnp.int32, (x.shape[0], width), 1)
    return jnp.sum(jnp.where(col == j, x, 0.0), axis=1)[:, None]


def _softmax(logits: Array) -> Array:
    m = jnp.max(logits, axis=1, keepdims=True)
    e = jnp.exp(logits - m)
    return e / jnp.sum(e, axis=1, keepdims=True)


def _fwd_kernel(lg_ref, a_ref, w2_ref, b2_ref, h_ref, g_ref, *, k: int, kp: int, ep: int,
                precision):
    # Program (i, c): rows tile i, output columns chunk c (the gate is recomputed per chunk,
    # a [rows, Kp] softmax; every chunk writes the same gate values).
    g = _softmax(lg_ref[...])  # [R, Kp]
    g_ref[...] = g
    acc = jnp.zeros(h_ref.shape, jnp.float32)
    for j in range(k):  # experts in order: fixed summation order
        gj = _column(g, j, kp)  # [R, 1]
        x = a_ref[:, pl.ds(j * ep, ep)] * gj  # [R, Ep]
        acc = acc + jnp.dot(x, w2_ref[pl.ds(j * ep, ep), :], precision=precision,
                            preferred_element_type=jnp.float32)
        acc = acc + gj * b2_ref[pl.ds(j, 1), :]
    h_ref[...] = acc


def _bwd_kernel(dh_ref, g_ref, a_ref, w2t_ref, b2_ref, da_ref, dl_ref, *, k: int, kp: int,
                ep: int, precision):
    dh = dh_ref[...]  # [R, Hp]
    g = g_ref[...]  # [R, Kp]
    col = jax.lax.broadcasted_iota(jnp.int32, g.shape, 1)
    dg = jnp.zeros(g.shape, jnp.float32)
    for j in range(k):
        cols = pl.ds(j * ep, ep)
        d = jnp.dot(dh, w2t_ref[:, cols], precision=precision,
                    preferred_element_type=jnp.float32)  # [R, Ep] = dh·W2_jᵀ
        a = a_ref[:, cols]
        da_ref[:, cols] = _column(g, j, kp) * d
        dgj = (jnp.sum(a * d, axis=1) + jnp.sum(dh * b2_ref[pl.ds(j, 1), :], axis=1))[:, None]
        dg = jnp.where(col == j, dgj, dg)
    dl_ref[...] = g * (dg - jnp.sum(g * dg, axis=1, keepdims=True))


class _Dims:
    """Padded sizes of one call."""

    def __init__(self, b: int, k: int, e: int, h: int, rows: int):
        self.b, self.k, self.e, self.h, self.rows = b, k, e, h, rows
        self.kp, self.ep, self.hp = _pow2(k), _pow2(e), _pow2(h)
        self.kb = _pow2(k, 1)  # rows of the padded b2 block
        self.bp = pl.cdiv(b, rows) * rows

    def rows_spec(self, width: int) -> pl.BlockSpec:
        return pl.BlockSpec((self.rows, width), lambda i: (i, 0))

    @staticmethod
    def full(shape: tuple[int, int]) -> pl.BlockSpec:
        return pl.BlockSpec(shape, lambda i: (0, 0))

    def hidden_rows(self, a: Array) -> Array:  # [B, K, E] → [Bp, K·Ep]
        a = jnp.pad(a.astype(jnp.float32),
                    ((0, self.bp - self.b), (0, 0), (0, self.ep - self.e)))
        return a.reshape(self.bp, self.k * self.ep)

    def weights(self, w2: Array, b2: Array) -> tuple[Array, Array]:  # [K·Ep, Hp], [Kb, Hp]
        w = jnp.pad(w2.astype(jnp.float32), ((0, 0), (0, self.ep - self.e), (0, self.hp - self.h)))
        bias = jnp.pad(b2.astype(jnp.float32), ((0, self.kb - self.k), (0, self.hp - self.h)))
        return w.reshape(self.k * self.ep, self.hp), bias


def _params(num_warps: int | None):
    if not num_warps:
        return None
    from jax.experimental.pallas import triton as pl_triton

    return pl_triton.CompilerParams(num_warps=num_warps)


def _forward(gate_logits, hidden, w2, b2, interpret: bool):
    rows, num_warps = ROWS, NUM_WARPS  # read at trace time (the bench sweeps them)
    b, k, e = hidden.shape
    dm = _Dims(b, k, e, w2.shape[-1], rows)
    hc = min(H_CHUNK, dm.hp)
    lg = jnp.pad(gate_logits.astype(jnp.float32), ((0, dm.bp - b), (0, dm.kp - k)),
                 constant_values=_NEG)  # padded samples: a uniform gate, sliced off
    w, bias = dm.weights(w2, b2)
    h, g = pl.pallas_call(
        functools.partial(_fwd_kernel, k=k, kp=dm.kp, ep=dm.ep, precision=_precision()),
        out_shape=(jax.ShapeDtypeStruct((dm.bp, dm.hp), jnp.float32),
                   jax.ShapeDtypeStruct((dm.bp, dm.kp), jnp.float32)),
        grid=(dm.bp // rows, dm.hp // hc),
        in_specs=[pl.BlockSpec((rows, dm.kp), lambda i, c: (i, 0)),
                  pl.BlockSpec((rows, k * dm.ep), lambda i, c: (i, 0)),
                  pl.BlockSpec((k * dm.ep, hc), lambda i, c: (0, c)),
                  pl.BlockSpec((dm.kb, hc), lambda i, c: (0, c))],
        out_specs=[pl.BlockSpec((rows, hc), lambda i, c: (i, c)),
                   pl.BlockSpec((rows, dm.kp), lambda i, c: (i, 0))],
        compiler_params=_params(num_warps),
        interpret=interpret,
        name="moe_mixture",
    )(lg, dm.hidden_rows(hidden), w, bias)
    return h[:b, :dm.h], g[:b, :k]


def _backward(dh, gate, hidden, w2, b2, interpret: bool):
    rows, num_warps = BWD_ROWS, NUM_WARPS
    b, k, e = hidden.shape
    dm = _Dims(b, k, e, w2.shape[-1], rows)
    w, bias = dm.weights(w2, b2)
    dh_p = jnp.pad(dh.astype(jnp.float32), ((0, dm.bp - b), (0, dm.hp - dm.h)))
    g_p = jnp.pad(gate.astype(jnp.float32), ((0, dm.bp - b), (0, dm.kp - k)))
    da, dl = pl.pallas_call(
        functools.partial(_bwd_kernel, k=k, kp=dm.kp, ep=dm.ep, precision=_precision()),
        out_shape=(jax.ShapeDtypeStruct((dm.bp, k * dm.ep), jnp.float32),
                   jax.ShapeDtypeStruct((dm.bp, dm.kp), jnp.float32)),
        grid=(dm.bp // rows,),
        in_specs=[dm.rows_spec(dm.hp), dm.rows_spec(dm.kp), dm.rows_spec(k * dm.ep),
                  dm.full((dm.hp, k * dm.ep)), dm.full((dm.kb, dm.hp))],
        out_specs=[dm.rows_spec(k * dm.ep), dm.rows_spec(dm.kp)],
        compiler_params=_params(num_warps),
        interpret=interpret,
        name="moe_mixture_bwd",
    )(dh_p, g_p, dm.hidden_rows(hidden), w.T, bias)
    da = da.reshape(dm.bp, k, dm.ep)[:b, :, :e]
    return da, dl[:b, :k]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def moe_mixture_pallas(gate_logits: Array, hidden: Array, w2: Array, b2: Array,
                       interpret: bool = False) -> tuple[Array, Array]:
    """``(h [B, H], gate [B, K])`` from ``gate_logits [B, K]``, the experts' hidden layer
    ``hidden [B, K, E]`` and their output layers ``w2 [K, E, H]``, ``b2 [K, H]`` (float32).
    Same function as :func:`moe_mixture_reference`; ``interpret=True`` runs the kernels in
    Pallas' interpreter (CPU)."""
    for name, x in (("gate_logits", gate_logits), ("hidden", hidden), ("w2", w2), ("b2", b2)):
        if x.dtype != jnp.float32:
            raise TypeError(f"moe_mixture_pallas: {name} must be float32, got {x.dtype}")
    if hidden.shape[0] == 0:
        raise ValueError(f"moe_mixture_pallas: empty batch, hidden shape {hidden.shape}")
    return _forward(gate_logits, hidden, w2, b2, interpret)


def _fwd(gate_logits, hidden, w2, b2, interpret):
    h, gate = _forward(gate_logits, hidden, w2, b2, interpret)
    return (h, gate), (gate, hidden, w2, b2)


def _bwd(interpret, res, cot):
    gate, hidden, w2, b2 = res
    dh, dgate = cot
    da, dlogits = _backward(dh, gate, hidden, w2, b2, interpret)
    # The gate output's own cotangent (the load-balance loss) through the softmax.
    dlogits = dlogits + gate * (dgate - jnp.sum(gate * dgate, axis=-1, keepdims=True))
    weighted = gate[..., None] * hidden  # [B, K, E]
    dw2 = jnp.einsum("bke,bh->keh", weighted, dh)
    db2 = jnp.einsum("bk,bh->kh", gate, dh)
    return dlogits, da, dw2, db2


moe_mixture_pallas.defvjp(_fwd, _bwd)


def moe_mixture_reference(gate_logits: Array, hidden: Array, w2: Array,
                          b2: Array) -> tuple[Array, Array]:
    """The oracle: the mixture as :class:`jdqn.networks.trunk.MixtureOfExperts` computes it in
    float32 on the XLA path."""
    gate = jax.nn.softmax(gate_logits, axis=-1)
    h = jnp.einsum("bke,keh->bh", gate[..., None] * hidden, w2) + gate @ b2
    return h, gate
