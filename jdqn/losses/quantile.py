"""IQN quantile-Huber loss for one sample; callers vmap over the batch.

Axes: ``N`` online quantile samples, ``N′`` target quantile samples, ``A`` actions of a branch,
``D`` branches.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

Array = jax.Array


def huber(u: Array, kappa: float = 1.0) -> Array:
    """Huber function ``½u²`` for ``|u| ≤ κ``, ``κ(|u| − ½κ)`` beyond."""
    abs_u = jnp.abs(u)
    quad = jnp.minimum(abs_u, kappa)
    return 0.5 * jnp.square(quad) + kappa * (abs_u - quad)


def quantile_huber_loss(dist_src: Array, tau_src: Array, dist_target: Array,
                        kappa: float = 1.0) -> Array:
    """Quantile-regression Huber loss (Dabney et al. 2018, IQN, eq. 3).

    ``Σ_i (1/N′) Σ_j |τ_i − 1{u_ij < 0}| · huber_κ(u_ij) / κ`` with ``u_ij = T_j − θ_i``.

    Args:
      dist_src: [N] online quantile values θ_i at fractions ``tau_src``.
      tau_src: [N] fractions in (0, 1).
      dist_target: [N′] target samples T_j (gradient stopped here).
      kappa: Huber threshold (1 by default, as in the IQN paper).
    Returns:
      [] loss.
    """
    chex.assert_rank([dist_src, tau_src, dist_target], 1)
    chex.assert_equal_shape([dist_src, tau_src])
    u = jax.lax.stop_gradient(dist_target)[None, :] - dist_src[:, None]  # [N, N′]
    weight = jnp.abs(tau_src[:, None] - (u < 0).astype(u.dtype))
    return jnp.sum(jnp.mean(weight * huber(u, kappa) / kappa, axis=1))


def iqn_double_q_loss(quantiles_tm1: Array, tau_tm1: Array, a_tm1: Array, r_t: Array,
                      discount_t: Array, target_quantiles_t: Array, q_selector_t: Array,
                      v_min: float, v_max: float, kappa: float = 1.0) -> Array:
    """IQN loss for one branch of one transition with double-Q action selection.

    ``a′ = argmax q_selector_t`` (the caller passes the **online C51** expected Q at s′, the same
    selector as the C51 loss, so both heads bootstrap from the same next action); target samples
    ``T_j = clip(r + discount·θ′_j(s′, a′), v_min, v_max)`` from the **target** network's
    quantiles. The clip keeps IQN targets on the same range as the C51 support.

    Args:
      quantiles_tm1: [A, N] online quantiles at s; tau_tm1: [N] their fractions.
      a_tm1: [] int action taken; r_t: [] n-step return; discount_t: [] ``γⁿ(1−done)``.
      target_quantiles_t: [A, N′] target-network quantiles at s′.
      q_selector_t: [A] online expected Q at s′.
    Returns:
      [] loss.
    """
    chex.assert_rank([quantiles_tm1, tau_tm1, a_tm1, r_t, discount_t, target_quantiles_t,
                      q_selector_t], [2, 1, 0, 0, 0, 2, 1])
    chex.assert_type(a_tm1, int)
    a_t = jnp.argmax(q_selector_t)
    target = jnp.clip(r_t + discount_t * target_quantiles_t[a_t], v_min, v_max)
    return quantile_huber_loss(quantiles_tm1[a_tm1], tau_tm1, jax.lax.stop_gradient(target),
                               kappa)


def branching_iqn_loss(quantiles_tm1: tuple[Array, ...], tau_tm1: Array, a_tm1: Array,
                       r_t: Array, discount_t: Array, target_quantiles_t: tuple[Array, ...],
                       q_selector_t: tuple[Array, ...], v_min: float, v_max: float,
                       kappa: float = 1.0) -> Array:
    """Per-branch IQN loss for one transition: tuples of per-branch arrays as in
    :func:`iqn_double_q_loss`, ``a_tm1 [D]`` → ``[D]``."""
    chex.assert_rank(a_tm1, 1)
    return jnp.stack([
        iqn_double_q_loss(q, tau_tm1, a_tm1[d], r_t, discount_t, tq, qs, v_min, v_max, kappa)
        for d, (q, tq, qs) in enumerate(zip(quantiles_tm1, target_quantiles_t, q_selector_t,
                                            strict=True))
    ])
