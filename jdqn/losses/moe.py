"""Mixture-of-Experts load balancing with an entropy-adaptive weight.

Axes: ``B`` batch, ``K`` experts.

The load-balance loss ``λ·K·Σ_k (mean_b g[b,k])²`` equals λ for a perfectly balanced gate and
λ·K when one expert takes everything. A static λ = 0.01 let the predecessor collapse onto one
expert (81 % utilisation, 7 of 8 experts < 5 %), so λ adapts to the **utilisation entropy**
``H(ū)``, ``ū = mean_b g[b]``: ``λ_eff = λ_floor + λ_extra·max(0, H_target − H_ema)/H_target``.
λ_floor is a permanent minimum. The utilisation entropy (not the mean per-sample entropy) is the
signal because load collapse is what the controller fights: a gate that routes each sample
confidently but spreads the batch over all experts is healthy.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

Array = jax.Array


class MoEState(NamedTuple):
    """Evolving MoE statistics (part of the train state; reset rule at folds: keep or re-init)."""

    entropy_ema: Array  # [] EMA of the utilisation entropy H(mean_b g)
    util_ema: Array  # [K] EMA of the per-expert utilisation mean_b g[b, k]


def init_moe_state(n_experts: int) -> MoEState:
    """Balanced start: entropy log K, utilisation 1/K (so λ_eff starts at λ_floor)."""
    return MoEState(entropy_ema=jnp.asarray(math.log(n_experts), jnp.float32),
                    util_ema=jnp.full((n_experts,), 1.0 / n_experts, jnp.float32))


def gate_utilisation(gate: Array) -> Array:
    """``mean_b g[b, k]``: gate [B, K] → [K]."""
    chex.assert_rank(gate, 2)
    return jnp.mean(gate, axis=0)


def entropy(p: Array, axis: int = -1) -> Array:
    """Shannon entropy (nats) of probabilities along ``axis``; 0·log 0 = 0."""
    return -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=axis)


def entropy_target(n_experts: int, target: float = 0.0) -> float:
    """``H_target``: the configured value, or 0.9·log K when it is 0."""
    return float(target) if target > 0 else 0.9 * math.log(n_experts)


def update_moe_state(state: MoEState, gate: Array, decay: float,
                     util: Array | None = None) -> MoEState:
    """One EMA step from a batch of gate probabilities ``gate [B, K]`` (no gradient), or from
    a given utilisation ``util [K]`` (data parallel: the global batch's)."""
    if util is None:
        util = gate_utilisation(gate)
    util = jax.lax.stop_gradient(util).astype(state.util_ema.dtype)
    h = entropy(util)
    return MoEState(entropy_ema=decay * state.entropy_ema + (1.0 - decay) * h,
                    util_ema=decay * state.util_ema + (1.0 - decay) * util)


def lambda_eff(entropy_ema: Array, lambda_floor: float, lambda_extra: float,
               h_target: float) -> Array:
    """``λ_floor + λ_extra·max(0, H_target − H_ema)/H_target`` (λ_floor when H_target ≤ 0,
    e.g. K = 1). Never below λ_floor."""
    if h_target <= 0:
        return jnp.asarray(lambda_floor, jnp.float32)
    deficit = jnp.maximum(0.0, h_target - entropy_ema) / h_target
    return lambda_floor + lambda_extra * deficit


def load_balance_loss(gate: Array, lam: Array, util_all: Array | None = None) -> Array:
    """``λ·K·Σ_k (mean_b g[b,k])²``: gate [B, K], lam [] → []. Equals λ for a uniform gate.

    ``util_all [K]`` (data parallel): the utilisation of the global batch, of which ``gate`` is
    one device's share. The term is then ``λ·K·Σ_k [ū_k² + 2ū_k·(u_k − sg(u_k))]`` with ``u``
    this share's utilisation and ``ū = sg(util_all)``: its value is the global term and its
    gradient is ``λ·K·Σ_k 2ū_k·∂u_k``, whose mean over equal shares is the global term's
    gradient ``λ·K·Σ_k 2ū_k·∂ū_k``."""
    chex.assert_rank([gate, lam], [2, 0])
    k = gate.shape[-1]
    u = gate_utilisation(gate)
    lam = jax.lax.stop_gradient(lam)
    if util_all is None:
        return lam * k * jnp.sum(jnp.square(u))
    ubar = jax.lax.stop_gradient(util_all).astype(u.dtype)
    return lam * k * jnp.sum(jnp.square(ubar) + 2.0 * ubar * (u - jax.lax.stop_gradient(u)))
