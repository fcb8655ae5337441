"""Batch-level forms of the per-branch C51 and IQN losses: what ``total_loss`` runs.

The per-sample functions of :mod:`jdqn.losses.categorical` and :mod:`jdqn.losses.quantile`
(rlax style, vmapped by the caller) are the readable definitions and the test oracles. Vmapping
them over a batch of 16384 compiles into XLA gathers and a reduction over a ``[B, Z, Z]``
projection tensor per branch whose reduced axis is not the minor one: on an H200 that reduction
alone took 0.58 ms of a 5.1 ms update (``bench/profile_step.py``). The forms here compute the
same values with:

* **one projection for all branches.** ``Tz = clip(r + γⁿ(1−done)·z)`` depends on the
  transition, not on the branch, so the hat-kernel weights ``w[b, i, j]`` are shared; on the
  uniform support of :func:`jdqn.networks.heads.make_support` they are
  ``max(0, 1 − |(Tz_j − v_min)/Δz − i|)`` and the projection is a reduction over the minor
  (source-atom) axis of a tensor XLA never writes to memory;
* **one-hot contractions instead of gathers** for the taken action and the double-Q action, so
  the backward pass is elementwise (no scatter).

Axes: ``B`` batch, ``D`` branches, ``A_d`` actions of branch d, ``Z`` atoms, ``N``/``N′``
quantile samples. Every function returns per-sample, per-branch arrays ``[B, D]``.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from jdqn.losses.quantile import huber

Array = jax.Array


def select(x: Array, index: Array) -> Array:
    """``x[b, index[b], ...]`` as a masked sum: x [B, A, ...], index int [B] → [B, ...].

    Differentiable in ``x`` with an elementwise backward pass (no scatter-add). Rows of actions
    not selected are masked out with ``where`` (not multiplied by 0), so an ``inf`` there does
    not become NaN. ``index`` must lie in ``[0, A)``: out of range it selects nothing (zeros)
    where a gather would clamp; callers pass actions the env validated and argmaxes."""
    mask = jax.nn.one_hot(index, x.shape[1], dtype=jnp.bool_)  # [B, A]
    mask = mask.reshape(mask.shape + (1,) * (x.ndim - 2))
    return jnp.sum(jnp.where(mask, x, jnp.zeros((), x.dtype)), axis=1)


def argmax_select(x: Array, selector: Array) -> Array:
    """``x[b, argmax_a selector[b, a], ...]``: x [B, A, ...], selector [B, A] → [B, ...]."""
    return select(x, jnp.argmax(selector, axis=-1))


def project_uniform(tz: Array, probs: Array, v_min: float, v_max: float) -> Array:
    """Categorical L2 projection of ``D`` distributions sharing their atom locations onto the
    uniform support ``linspace(v_min, v_max, Z)``.

    tz: [B, Z] source atom locations (clipped here); probs: [B, D, Z] → [B, D, Z]. Source and
    target have the same number of atoms Z (the C51 target: ``Tz = r + γⁿ(1−done)·z``).
    Equal to :func:`jdqn.losses.categorical.categorical_l2_project` applied per (b, d) on a
    uniform support (tested), computed as ``m[b, d, i] = Σ_j p[b, d, j]·max(0, 1 − |x_bj − i|)``
    with ``x = (Tz − v_min)/Δz``.
    """
    chex.assert_rank([tz, probs], [2, 3])
    z = probs.shape[-1]
    dz = (v_max - v_min) / (z - 1)
    x = (jnp.clip(tz, v_min, v_max) - v_min) / jnp.asarray(dz, tz.dtype)  # [B, Zs] in [0, Z-1]
    i = jnp.arange(z, dtype=tz.dtype)
    w = jnp.maximum(0.0, 1.0 - jnp.abs(x[:, None, :] - i[:, None]))  # [B, Z, Zs]
    return jnp.sum(w[:, None, :, :] * probs[:, :, None, :], axis=-1)


def branching_td_loss_batch(logits: tuple[Array, ...], action: Array, reward: Array,
                            discount: Array, target_logits: tuple[Array, ...] | None,
                            q_selector: tuple[Array, ...] | None, v_min: float, v_max: float,
                            alpha: Array, impl: str = "xla",
                            next_probs: Array | None = None) -> dict[str, Array]:
    """Batch form of :func:`jdqn.losses.categorical.branching_td_loss`.

    logits, target_logits: per branch [B, A_d, Z]; action int [B, D]; reward, discount [B];
    q_selector: per branch [B, A_d] (online expected Q at s′). Returns a dict of [B, D]:
    ``td`` (warm-up blend), ``sq``, ``ce``, ``target_mean``, ``td_kl`` (the blend with the
    cross-entropy's KL form, ``ce − H(m)``: the priorities' term) and ``logits_finite`` (bool:
    every atom of the taken action's logits is finite; the update's finite check reads it. A
    non-finite value in the head's inputs or weights reaches every action of the branch and
    row, the advantage weights being centred over the actions; an overflow in one action's
    product alone would not). ``impl`` (``ModelConfig.impl``)
    selects the implementation of the loss terms and of the projection (see :mod:`jdqn.pallas`).
    ``next_probs`` [B, D, ≥ Z] (zero beyond Z): the target's distribution at the double-Q
    action, already selected (:func:`jdqn.pallas.double_q.double_q_next`); then
    ``target_logits`` and ``q_selector`` are not read (pass None).
    """
    from jdqn.pallas import c51_terms

    chex.assert_rank([action, reward, discount], [2, 1, 1])
    z = logits[0].shape[-1]
    support = jnp.linspace(v_min, v_max, z, dtype=logits[0].dtype)
    taken = jnp.stack([select(lg, action[:, d]) for d, lg in enumerate(logits)], 1)  # [B,D,Z]
    nxt = None
    if next_probs is None:
        nxt = jax.lax.stop_gradient(jnp.stack([
            argmax_select(tl, qs) for tl, qs in zip(target_logits, q_selector, strict=True)],
            1))  # [B, D, Z]
    tz = reward[:, None] + discount[:, None] * support  # [B, Z]
    sq, ce, target_mean, kl = c51_terms(taken, nxt, jax.lax.stop_gradient(tz), v_min, v_max,
                                        impl, next_probs)
    td = (1.0 - alpha) * sq + alpha * ce
    return {"td": td, "sq": sq, "ce": ce, "target_mean": target_mean,
            "td_kl": (1.0 - alpha) * sq + alpha * kl,
            "logits_finite": jnp.all(jnp.isfinite(jax.lax.stop_gradient(taken)), axis=-1)}


def branching_iqn_loss_batch(quantiles: tuple[Array, ...], taus: Array, action: Array,
                             reward: Array, discount: Array,
                             target_quantiles: tuple[Array, ...],
                             q_selector: tuple[Array, ...] | None, v_min: float, v_max: float,
                             kappa: float = 1.0, next_action: Array | None = None) -> Array:
    """Batch form of :func:`jdqn.losses.quantile.branching_iqn_loss`.

    quantiles: per branch [B, A_d, N] at ``taus [B, N]``; target_quantiles: per branch
    [B, A_d, N′]; the rest as in :func:`branching_td_loss_batch`. ``next_action`` int [B, D]:
    the double-Q action, already selected; then ``q_selector`` is not read. Returns [B, D].
    """
    theta = jnp.stack([select(q, action[:, d]) for d, q in enumerate(quantiles)], 1)  # [B,D,N]
    if next_action is None:
        tq = jnp.stack([argmax_select(t, qs) for t, qs in zip(target_quantiles, q_selector,
                                                               strict=True)], 1)  # [B, D, N′]
    else:
        tq = jnp.stack([select(t, next_action[:, d]) for d, t in enumerate(target_quantiles)],
                       1)
    target = jnp.clip(reward[:, None, None] + discount[:, None, None] * tq, v_min, v_max)
    u = jax.lax.stop_gradient(target)[:, :, None, :] - theta[..., None]  # [B, D, N, N′]
    weight = jnp.abs(taus[:, None, :, None] - (u < 0).astype(u.dtype))
    return jnp.sum(jnp.mean(weight * huber(u, kappa) / kappa, axis=-1), axis=-1)
