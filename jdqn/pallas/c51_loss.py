"""Pallas kernel: the branching C51 loss terms of a batch, forward fused, with a custom VJP.

SPEC §8, kernel 1. Per sample ``b`` and branch ``d`` (all branches in one program):

* the target distribution: softmax of the target net's logits at the double-Q action, projected
  onto the support at ``Tz = clip(r + γⁿ(1−done)·z)`` (the j-loop of
  :mod:`jdqn.pallas.projection`, reading the softmax straight from the logits);
* the online distribution at the taken action, ``log_softmax(taken)``;
* ``ce = −Σ m·log p`` (cross-entropy), ``sq = (E_p[z] − E_m[z])²`` (the warm-up MSE) and
  ``tm = E_m[z]`` (the target mean); outside the kernel, from its ``m``, ``kl = ce + Σ m·log m``
  (the priorities' term; its gradient is the cross-entropy's).

The oracle is the plain-JAX tail of :func:`jdqn.losses.batch.branching_td_loss_batch`
(:func:`c51_terms_reference`). The backward pass needs no kernel: with ``p = softmax(taken)``,
``q = E_p[z]`` and the projected target ``m`` kept from the forward pass,

    ∂ce/∂taken = p·Σm − m,    ∂sq/∂taken = 2(q − tm)·p·(z − q),

one elementwise pass that XLA fuses. The target side (``nxt``, ``tz``) is a constant of the loss
(``stop_gradient`` in the reference), so its cotangents are zero.

Layout as the projection kernel's ``"rows"`` layout: ``[B, Dp·Zp]`` rows, atoms and branches
padded to powers of two; padded atoms carry logit ``−1e30`` (probability 0) and are masked out
of every sum. Outputs ``sq``, ``ce``, ``tm`` come back as ``[B, Dp]`` tiles and the target ``m``
as ``[B, Dp·Zp]`` (the residual of the backward pass).

Status: tested in Pallas' interpreter against the oracle (values and gradients). Measured on
the H200 at B = 16384 (``bench/results/kernels_h200_c51_loss.json``): 358 µs forward + backward
against 524 µs for the XLA reference alone, bitwise repeatable — but the whole update is slower
with it (4.47 vs 4.27 ms float32), because XLA fuses the reference's tail into the kernels
around it and the custom call breaks those fusions. So ``impl = "pallas"`` selects it and
``"auto"`` does not (:data:`jdqn.pallas.GPU_VALIDATED`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jdqn.pallas.projection import Layout

Array = jax.Array

_NEG = -1.0e30  # logit of a padded atom or branch: probability 0, no inf arithmetic


def _kernel(x_ref, tk_ref, nx_ref, sq_ref, ce_ref, tm_ref, m_ref, *, n_branches: int, z: int,
            zp: int, v_min: float, dz: float):
    i = jax.lax.broadcasted_iota(jnp.int32, (1, zp), 1)
    valid = i < z
    fi = i.astype(jnp.float32)
    support = v_min + fi * dz  # [1, Zp] (padded atoms masked below)
    # Softmax statistics of the target logits, per branch.
    mx, inv = [], []
    for d in range(n_branches):
        nl = nx_ref[:, pl.ds(d * zp, zp)]
        m = jnp.max(nl, axis=1, keepdims=True)
        mx.append(m)
        inv.append(1.0 / jnp.sum(jnp.exp(nl - m), axis=1, keepdims=True))
    acc = [None] * n_branches
    for j in range(z):  # source atoms, in order: fixed summation order
        w = jnp.maximum(0.0, 1.0 - jnp.abs(x_ref[:, pl.ds(j, 1)] - fi))  # [R, Zp]
        for d in range(n_branches):
            pj = jnp.exp(nx_ref[:, pl.ds(d * zp + j, 1)] - mx[d]) * inv[d]  # [R, 1]
            term = pj * w
            acc[d] = term if acc[d] is None else acc[d] + term
    col = jax.lax.broadcasted_iota(jnp.int32, (1, n_branches), 1)
    sq = ce = tm = None
    for d in range(n_branches):
        tl = tk_ref[:, pl.ds(d * zp, zp)]
        mt = jnp.max(tl, axis=1, keepdims=True)
        logp = tl - (jnp.log(jnp.sum(jnp.exp(tl - mt), axis=1, keepdims=True)) + mt)
        p = jnp.exp(logp)
        target = acc[d]
        m_ref[:, pl.ds(d * zp, zp)] = target
        ce_d = -jnp.sum(jnp.where(valid, target * logp, 0.0), axis=1, keepdims=True)
        q_d = jnp.sum(jnp.where(valid, p * support, 0.0), axis=1, keepdims=True)
        tm_d = jnp.sum(jnp.where(valid, target * support, 0.0), axis=1, keepdims=True)
        sq_d = jnp.square(q_d - tm_d)
        here = col == d
        sq = jnp.where(here, sq_d, 0.0 if sq is None else sq)
        ce = jnp.where(here, ce_d, 0.0 if ce is None else ce)
        tm = jnp.where(here, tm_d, 0.0 if tm is None else tm)
    sq_ref[...] = sq
    ce_ref[...] = ce
    tm_ref[...] = tm


def _forward(taken: Array, nxt: Array, tz: Array, v_min: float, v_max: float,
             interpret: bool) -> tuple[Array, Array, Array, Array, Array]:
    b, n_real, z = taken.shape
    lay = Layout.of(b, n_real, z)
    zp, n_branches, rows, bp = lay.zp, lay.dp, lay.rows, lay.bp
    dz = (v_max - v_min) / (z - 1)
    x = lay.atom_positions(tz, v_min, v_max)

    row = functools.partial(pl.BlockSpec, index_map=lambda r: (r, 0))
    sq, ce, tm, m = pl.pallas_call(
        functools.partial(_kernel, n_branches=n_branches, z=z, zp=zp, v_min=float(v_min),
                          dz=float(dz)),
        out_shape=(jax.ShapeDtypeStruct((bp, n_branches), jnp.float32),) * 3
        + (jax.ShapeDtypeStruct((bp, n_branches * zp), jnp.float32),),
        grid=(bp // rows,),
        in_specs=[row((rows, zp)), row((rows, n_branches * zp)), row((rows, n_branches * zp))],
        out_specs=[row((rows, n_branches))] * 3 + [row((rows, n_branches * zp))],
        interpret=interpret,
        name="c51_loss",
    )(x, lay.branch_rows(taken, _NEG), lay.branch_rows(nxt, _NEG))
    from jdqn.pallas import kl_from_ce

    m = m.reshape(bp, n_branches, zp)[:b, :n_real, :z]
    ce = ce[:b, :n_real]
    return sq[:b, :n_real], ce, tm[:b, :n_real], kl_from_ce(ce, m), m


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def c51_terms_pallas(taken: Array, nxt: Array, tz: Array, v_min: float, v_max: float,
                     interpret: bool = False) -> tuple[Array, Array, Array, Array]:
    """``(sq, ce, tm, kl)`` [B, D] from the online logits at the taken actions ``taken [B, D,
    Z]``, the target logits at the double-Q actions ``nxt [B, D, Z]`` and the target atom
    locations ``tz [B, Z]`` (unclipped; clipped here). Float32. Differentiable in ``taken``
    only."""
    sq, ce, tm, kl, _ = _forward(taken, nxt, tz, v_min, v_max, interpret)
    return sq, ce, tm, kl


def _fwd(taken, nxt, tz, v_min, v_max, interpret):
    sq, ce, tm, kl, m = _forward(taken, nxt, tz, v_min, v_max, interpret)
    return (sq, ce, tm, kl), (taken, m, tm, nxt, tz)


def _bwd(v_min, v_max, interpret, res, g):
    del interpret
    taken, m, tm, nxt, tz = res
    g_sq, g_ce, _, g_kl = g  # the target mean does not depend on `taken`
    g_ce = g_ce + g_kl  # kl = ce + a constant of `taken`
    z = taken.shape[-1]
    support = jnp.linspace(v_min, v_max, z, dtype=jnp.float32)
    p = jax.nn.softmax(taken.astype(jnp.float32), axis=-1)
    q = jnp.sum(p * support, axis=-1, keepdims=True)
    d_ce = p * jnp.sum(m, axis=-1, keepdims=True) - m
    d_sq = 2.0 * (q - tm[..., None]) * p * (support - q)
    d_taken = g_sq[..., None] * d_sq + g_ce[..., None] * d_ce
    return d_taken.astype(taken.dtype), jnp.zeros_like(nxt), jnp.zeros_like(tz)


c51_terms_pallas.defvjp(_fwd, _bwd)


def c51_terms_reference(taken: Array, nxt: Array, tz: Array, v_min: float,
                        v_max: float) -> tuple[Array, Array, Array, Array]:
    """The oracle: the same terms in plain JAX (the XLA path of :func:`jdqn.pallas.c51_terms`)."""
    from jdqn.pallas import c51_terms

    return c51_terms(taken, nxt, tz, v_min, v_max, "xla")
