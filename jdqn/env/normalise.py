"""Reward normalisation whose statistics are a pytree the trainer carries across folds.

The predecessor zeroed these statistics at fold boundaries; the first rewards of each fold were
then divided by a near-zero scale and the losses exploded. Keep ``NormState`` across folds.

Modes (``EnvConfig.reward_norm``):

* ``"robust"``: ``r_n = (r − m) / max(iqr, reward_iqr_floor)`` with ``m``, ``iqr`` running
  estimates of the median and inter-quartile range. Each call takes the exact quartiles of the
  batch (at most 4096 evenly strided samples, so the sort stays cheap at large N) and moves the
  running values towards them with weight ``w = max(1 − decay, 1 / (count + 1))`` — the plain
  average of the batches seen so far until ``1 / (count + 1)`` drops below ``1 − decay``, then an
  EMA. No zero-initialisation bias.
* ``"popart"``: the same update of a running mean and second moment; ``r_n = (r − μ) / max(σ,
  floor)``. (Preserving the network's outputs when μ, σ move — the "art" of PopArt — needs the
  learner's last layer and is the learner's job; ``NormState`` exposes the statistics.)
* ``"none"``: identity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jdqn.config import EnvConfig

MAX_QUANTILE_SAMPLES = 4096


@struct.dataclass
class NormState:
    center: jax.Array  # f32 []: running median (robust) or mean (popart)
    scale: jax.Array  # f32 []: running IQR (robust) or second moment (popart)
    count: jax.Array  # f32 []: batches seen
    mode: str = struct.field(pytree_node=False, default="robust")
    decay: float = struct.field(pytree_node=False, default=0.999)
    floor: float = struct.field(pytree_node=False, default=1e-4)


def init_norm_state(cfg: EnvConfig) -> NormState:
    z = jnp.zeros((), jnp.float32)
    return NormState(center=z, scale=z, count=z, mode=cfg.reward_norm,
                     decay=float(cfg.reward_norm_decay), floor=float(cfg.reward_iqr_floor))


def normalise_reward(norm_state: NormState, reward: jax.Array) -> tuple[NormState, jax.Array]:
    """Update the running statistics with ``reward`` (any shape) and return it normalised."""
    ns = norm_state
    if ns.mode == "none":
        return ns, reward
    flat = reward.reshape(-1).astype(jnp.float32)
    w = jnp.maximum(1.0 - ns.decay, 1.0 / (ns.count + 1.0))
    if ns.mode == "robust":
        stride = max(1, flat.shape[0] // MAX_QUANTILE_SAMPLES)
        q25, q50, q75 = jnp.quantile(flat[::stride], jnp.array([0.25, 0.5, 0.75]))
        center = ns.center + w * (q50 - ns.center)
        scale = ns.scale + w * ((q75 - q25) - ns.scale)
        denom = jnp.maximum(scale, ns.floor)
    elif ns.mode == "popart":
        center = ns.center + w * (flat.mean() - ns.center)
        scale = ns.scale + w * (jnp.mean(flat * flat) - ns.scale)
        denom = jnp.maximum(jnp.sqrt(jnp.maximum(scale - center * center, 0.0)), ns.floor)
    else:
        raise ValueError(f"unknown reward_norm mode {ns.mode!r}")
    new = ns.replace(center=center, scale=scale, count=ns.count + 1.0)
    return new, ((reward - center) / denom).astype(reward.dtype)
