"""Categorical (C51) losses for one sample; callers vmap over the batch.

Axes: ``N`` atoms of the source distribution, ``M``/``Z`` atoms of the target support,
``A`` actions of one branch, ``D`` branches.

Convention (as in rlax): every function here is written for **one** transition, takes float
arrays of the shapes in its docstring, and stops gradients on its targets explicitly.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

Array = jax.Array


def categorical_l2_project(z_p: Array, probs: Array, z_q: Array) -> Array:
    """Project a categorical distribution onto a fixed support (Cramér / L2 projection).

    Rowland et al. 2018, "An Analysis of Categorical Distributional RL", eq. 7; equal to the
    projection of Bellemare et al. 2017, Alg. 1. Each source atom ``z_p[j]`` (clipped to
    ``[z_q[0], z_q[-1]]``) splits its mass ``probs[j]`` between its two neighbouring target
    atoms with the triangular ("hat") kernel

        w[j, i] = clip(1 − |z_p[j] − z_q[i]| / Δ_i(sign), 0, 1),

    where ``Δ_i`` is the gap to the target atom on the side of ``z_p[j]``. Dense and vectorised:
    an ``[N, M]`` weight matrix instead of a loop with scatters.

    Args:
      z_p: [N] source atom locations (e.g. ``r + γⁿ(1−done)·z``; may lie outside the support).
      probs: [N] source probabilities.
      z_q: [M] target support, strictly increasing.
    Returns:
      [M] projected probabilities (sums to ``sum(probs)``).
    """
    chex.assert_rank([z_p, probs, z_q], 1)
    chex.assert_equal_shape([z_p, probs])
    z_p = jnp.clip(z_p, z_q[0], z_q[-1])
    # Gap from atom i to its right / left neighbour; at the ends the gap never matters
    # (a clipped source cannot lie beyond the end atoms), so it is set to 1 to avoid 0/0.
    gap_right = jnp.concatenate([z_q[1:] - z_q[:-1], jnp.ones((1,), z_q.dtype)])
    gap_left = jnp.concatenate([jnp.ones((1,), z_q.dtype), z_q[1:] - z_q[:-1]])
    delta = z_p[:, None] - z_q[None, :]  # [N, M]
    gap = jnp.where(delta >= 0, gap_right[None, :], gap_left[None, :])
    weight = jnp.clip(1.0 - jnp.abs(delta) / gap, 0.0, 1.0)
    return jnp.sum(weight * probs[:, None], axis=0)


def categorical_target(r_t: Array, discount_t: Array, target_logits_t: Array,
                       q_selector_t: Array, support: Array) -> Array:
    """Double-Q categorical target for one branch, projected onto the support.

    The next action is chosen by the **online** network (``q_selector_t``, its expected Q at
    s′), the distribution comes from the **target** network (van Hasselt et al. 2016, applied to
    C51 as in Rainbow). ``Tz = clip(r + discount·z, v_min, v_max)``: the clip is mandatory
    (the projection needs it, and the MSE warm-up without it blew up the predecessor's loss by
    1e5).

    Args:
      r_t: [] n-step return.
      discount_t: [] ``γⁿ·(1 − done)`` (0 at terminal transitions).
      target_logits_t: [A, Z] target-network logits at s′.
      q_selector_t: [A] online-network expected Q at s′ (picks a′ = argmax).
      support: [Z] atom values.
    Returns:
      [Z] target probabilities (gradient stopped).
    """
    chex.assert_rank([r_t, discount_t, target_logits_t, q_selector_t, support], [0, 0, 2, 1, 1])
    a_t = jnp.argmax(q_selector_t)
    probs_t = jax.nn.softmax(target_logits_t[a_t])
    tz = jnp.clip(r_t + discount_t * support, support[0], support[-1])
    return jax.lax.stop_gradient(categorical_l2_project(tz, probs_t, support))


def cross_entropy(logits: Array, target_probs: Array) -> Array:
    """``−Σ_z p_z log softmax(logits)_z``. logits, target_probs: [Z] → []."""
    chex.assert_rank([logits, target_probs], 1)
    return -jnp.sum(target_probs * jax.nn.log_softmax(logits))


def categorical_double_q_loss(logits_tm1: Array, a_tm1: Array, r_t: Array, discount_t: Array,
                              target_logits_t: Array, q_selector_t: Array,
                              support: Array) -> Array:
    """C51 loss with double-Q action selection for one branch of one transition.

    logits_tm1: [A, Z] online logits at s; a_tm1: [] int action taken; the rest as in
    :func:`categorical_target`. Returns [] cross-entropy of the projected target against the
    online distribution of the taken action.
    """
    chex.assert_type(a_tm1, int)
    target = categorical_target(r_t, discount_t, target_logits_t, q_selector_t, support)
    return cross_entropy(logits_tm1[a_tm1], target)


def warmup_blend_loss(logits_a: Array, target_probs: Array, support: Array,
                      alpha: Array) -> tuple[Array, Array, Array]:
    """Warm-up blend ``(1−α)·(E[Q](s,a) − E[target])² + α·CE`` for one branch.

    The regression target ``E[target] = Σ_z target_probs·z`` is the mean of the clipped,
    projected C51 target, i.e. ``E[clip(r + γⁿ(1−done)·z, v_min, v_max)]`` — a clamped target
    inside the support, and the very value the C51 term's distribution has as its mean, so both
    terms pull E[Q] towards the same fixed point while α ramps from 0 to 1.

    Args:
      logits_a: [Z] online logits at (s, a).
      target_probs: [Z] projected target (from :func:`categorical_target`).
      support: [Z]; alpha: [] in [0, 1].
    Returns:
      (blended [], squared error [], cross-entropy []).
    """
    chex.assert_rank([logits_a, target_probs, support, alpha], [1, 1, 1, 0])
    q = jnp.sum(jax.nn.softmax(logits_a) * support)
    q_target = jax.lax.stop_gradient(jnp.sum(target_probs * support))
    sq = jnp.square(q - q_target)
    ce = cross_entropy(logits_a, target_probs)
    return (1.0 - alpha) * sq + alpha * ce, sq, ce


def branching_td_loss(logits_tm1: tuple[Array, ...], a_tm1: Array, r_t: Array,
                      discount_t: Array, target_logits_t: tuple[Array, ...],
                      q_selector_t: tuple[Array, ...], support: Array,
                      alpha: Array) -> dict[str, Array]:
    """Per-branch warm-up-blended C51 loss for one transition (α = 1: pure C51).

    Every branch shares the transition's return and discount and bootstraps from its own
    double-Q target (independent branch targets, as in Branching Dueling Q-Networks).

    Args:
      logits_tm1: per branch [A_d, Z] online logits at s.
      a_tm1: [D] int actions taken.
      r_t, discount_t: [] n-step return and ``γⁿ(1−done)``.
      target_logits_t: per branch [A_d, Z] target logits at s′.
      q_selector_t: per branch [A_d] online expected Q at s′.
      support: [Z]; alpha: [] warm-up blend weight.
    Returns:
      dict of [D] arrays: ``td`` (blended), ``sq`` (squared error), ``ce`` (cross-entropy),
      ``target_mean`` (mean of the projected target).
    """
    chex.assert_rank(a_tm1, 1)
    chex.assert_type(a_tm1, int)
    out: dict[str, list[Array]] = {"td": [], "sq": [], "ce": [], "target_mean": []}
    for d, (lg, tlg, qs) in enumerate(zip(logits_tm1, target_logits_t, q_selector_t,
                                          strict=True)):
        target = categorical_target(r_t, discount_t, tlg, qs, support)
        td, sq, ce = warmup_blend_loss(lg[a_tm1[d]], target, support, alpha)
        out["td"].append(td)
        out["sq"].append(sq)
        out["ce"].append(ce)
        out["target_mean"].append(jnp.sum(target * support))
    return {k: jnp.stack(v) for k, v in out.items()}
