"""Pallas kernel: the backward pass of the MoE's gated hidden layer.

:class:`jdqn.networks.trunk.MixtureOfExperts` (float32 matmuls) feeds its mixture product with
the experts' hidden layer scaled by the gate::

    w[b, k, e] = g[b, k] · relu(pre[b, k, e] + b1[k, e])     pre [B, K, E] (x·W1_k), g [B, K]

seen here as ``[B, K·E]`` rows (a free reshape). The forward pass stays XLA's (it fuses the
product into the concatenation the mixture's bias-carrying product reads). The gradient, from
the cotangent ``dw [B, K·E]``::

    d pre = dw · g · [pre + b1 > 0]          dg[b, k] = Σ_e dw · relu(pre + b1)
    db1   = Σ_b d pre

which XLA runs as separate passes over the ``[B, K·E]`` tensors (a masked select, a product, a
row reduction for ``dg`` and a column reduction for ``db1``). :func:`gated_hidden`'s backward
kernel reads ``pre`` and ``dw`` once per tile of rows and writes ``d pre``, ``dg`` and one
``[1, K·E]`` row of ``db1`` partial sums per program, which one XLA reduction sums — a fixed
order, so the gradients are bitwise repeatable. Only the operands are kept for it.

Float32 only; the oracle is :func:`reference`, to which values and gradients agree to float32
rounding (tested against float64, padded and vmapped). The network takes it under
``"moe_gate_grad"`` (:class:`jdqn.networks.trunk.MixtureOfExperts`, float32 matmuls).

Measured on the H200 (2026-12-03, jax 0.11.2): alone at B = 16384, K = 8, E = 64
(``bench/kernels.py --kernel moe_gate_grad``, ``kernels_h200_moe_gate_grad.json``) 70.9–71.1 µs
at 16–32 rows on 4 warps against 73.1 for XLA's autodiff of the reference, bitwise repeatable,
within 2e-7 relative; in the update (``bench/ab.py``, alternated rounds in one machine
session) 2.508–2.516 ms against 2.534–2.546 for the code before
(``train_h200_f32_moe_gate_wgrad_split_ab.json``) and 2.511–2.515 against 2.540–2.542 in two
more rounds (``…_moe_gate_ab2.json``); two ``gpu.toml`` runs bitwise identical
(``determinism_h200_moe_gate_grad.json``). The serial-graph profile's MoE backward 208 → 185 µs
(the kernel 34.5 µs in place of the masked select, the gate product and the gate's row
reduction, 69 µs; ``profile_h200_f32_moe_gate_grad.json``). So ``"auto"`` takes it on the GPU
(:data:`jdqn.pallas.GPU_VALIDATED`); ``impl = "pallas"`` runs the whole mixture as
:mod:`jdqn.pallas.moe`'s kernels instead, which take precedence.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jdqn.pallas.iqn import _pow2
from jdqn.pallas.moe import _column

Array = jax.Array

ROWS = 16  # rows per program of the backward kernel
WARPS = 4


def reference(pre: Array, b1: Array, gate: Array) -> Array:
    """``g ⊗ relu(pre + b1)`` in plain JAX, as the layer computes it: pre [M, K·E], b1 [K·E],
    gate [M, K] → [M, K·E]."""
    m, k = gate.shape
    hidden = jax.nn.relu(pre + b1).reshape(m, k, pre.shape[1] // k)
    return (gate[..., None] * hidden).reshape(pre.shape)


def _bwd_kernel(p_ref, b1_ref, g_ref, dw_ref, dp_ref, dg_ref, db1_ref, *, k: int, kp: int,
                e: int):
    gate = g_ref[...]  # [rows, Kp]
    col = jax.lax.broadcasted_iota(jnp.int32, gate.shape, 1)
    dg = jnp.zeros(gate.shape, jnp.float32)
    for j in range(k):
        cols = pl.ds(j * e, e)
        a = p_ref[:, cols] + b1_ref[:, cols]  # [rows, E]: expert j's pre-activation
        dw = dw_ref[:, cols]
        g = _column(gate, j, kp)  # [rows, 1]
        dpre = jnp.where(a > 0.0, dw * g, 0.0)  # relu′(0) = 0, as jax.nn.relu
        dp_ref[:, cols] = dpre
        dg = jnp.where(col == j, jnp.sum(dw * jnp.maximum(a, 0.0), axis=1, keepdims=True), dg)
        db1_ref[:, cols] = jnp.sum(dpre, axis=0, keepdims=True)
    dg_ref[...] = dg


def _backward(pre, b1, gate, dw, interpret, rows, warps):
    """``(d pre [M, K·E], db1 [K·E], dg [M, K])`` from the operands and the cotangent ``dw``.
    Padded rows carry a zero cotangent (and a zero gate): everything they add is zero."""
    m, k = gate.shape
    e = pre.shape[1] // k
    if m == 0:
        return jnp.zeros_like(pre), jnp.zeros((k * e,), jnp.float32), jnp.zeros_like(gate)
    mp, kp = pl.cdiv(m, rows) * rows, _pow2(k, 1)
    pad = lambda a, cols=0: jnp.pad(a, ((0, mp - m), (0, cols)))
    programs = mp // rows
    block = lambda cols: pl.BlockSpec((rows, cols), lambda r: (r, 0))
    dpre, dg, db1 = pl.pallas_call(
        functools.partial(_bwd_kernel, k=k, kp=kp, e=e),
        out_shape=(jax.ShapeDtypeStruct((mp, k * e), jnp.float32),
                   jax.ShapeDtypeStruct((mp, kp), jnp.float32),
                   jax.ShapeDtypeStruct((programs, k * e), jnp.float32)),
        grid=(programs,),
        in_specs=[block(k * e), pl.BlockSpec((1, k * e), lambda r: (0, 0)), block(kp),
                  block(k * e)],
        out_specs=(block(k * e), block(kp), pl.BlockSpec((1, k * e), lambda r: (r, 0))),
        interpret=interpret,
        name="moe_gate_bwd",
        compiler_params=pl_triton.CompilerParams(num_warps=warps),
    )(pad(pre), b1.astype(jnp.float32)[None], pad(gate, kp - k), pad(dw.astype(jnp.float32)))
    return dpre[:m], jnp.sum(db1, axis=0), dg[:m, :k]


def eligible(pre: Array, gate: Array) -> bool:
    """Whether the kernel takes these operands: float32 ``pre [M, K·E]`` and ``gate [M, K]``
    with E a power of two ≥ 16 (Triton's block rule)."""
    if pre.dtype != jnp.float32 or gate.dtype != jnp.float32 or pre.ndim != 2 or gate.ndim != 2:
        return False
    (m, n), k = pre.shape, gate.shape[1]
    e = n // k if k else 0
    return gate.shape[0] == m and e * k == n and e >= 16 and e & (e - 1) == 0


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def gated_hidden(pre: Array, b1: Array, gate: Array, interpret: bool = False, rows: int = ROWS,
                 warps: int = WARPS) -> Array:
    """:func:`reference` (computed by XLA), its gradient one Pallas kernel: pre [M, K·E], b1
    [K·E], gate [M, K], float32 (check :func:`eligible`) → [M, K·E]. ``interpret=True`` runs
    the kernel in Pallas' interpreter (CPU tests)."""
    return reference(pre, b1, gate)


def _fwd(pre, b1, gate, interpret, rows, warps):
    return reference(pre, b1, gate), (pre, b1, gate)


def _bwd(interpret, rows, warps, residuals, dw):
    pre, b1, gate = residuals
    dpre, db1, dg = _backward(pre, b1, gate, dw, interpret, rows, warps)
    return dpre, db1.astype(b1.dtype), dg


gated_hidden.defvjp(_fwd, _bwd)
