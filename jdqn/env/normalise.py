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

``mask`` (bool, the shape of ``reward``) restricts the statistics to the rewards it marks; every
reward is still normalised. The trainer passes ``~done`` under ``train.episode_end =
"truncate"``, where the forced-liquidation step is not a transition: the statistics are those
of the rewards the learner fits. A call whose (strided) sample has no marked reward leaves the
statistics and ``count`` unchanged. Without a mask (``"terminal"``) the update is the one of
earlier versions, bit for bit.
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


def normalise_reward(norm_state: NormState, reward: jax.Array, mask: jax.Array | None = None
                     ) -> tuple[NormState, jax.Array]:
    """Update the running statistics with ``reward`` (any shape; only where ``mask``, if given)
    and return every reward normalised."""
    ns = norm_state
    if ns.mode == "none":
        return ns, reward
    flat = reward.reshape(-1).astype(jnp.float32)
    keep = None if mask is None else mask.reshape(-1)
    if keep is not None and keep.shape != flat.shape:
        raise ValueError(f"normalise_reward: mask shape {mask.shape} != reward shape "
                         f"{reward.shape}")
    w = jnp.maximum(1.0 - ns.decay, 1.0 / (ns.count + 1.0))
    if ns.mode == "robust":
        stride = max(1, flat.shape[0] // MAX_QUANTILE_SAMPLES)
        qs = jnp.array([0.25, 0.5, 0.75])
        if keep is None:
            q25, q50, q75 = jnp.quantile(flat[::stride], qs)
            seen = None
        else:
            sub = jnp.where(keep[::stride], flat[::stride], jnp.nan)
            seen = jnp.any(keep[::stride])
            q25, q50, q75 = jnp.nanquantile(sub, qs)
            # a marked NaN must not be skipped as if unmarked: it poisons the statistics, as
            # without a mask (the finite checks then halt on the normalised rewards)
            poison = jnp.any(keep[::stride] & jnp.isnan(flat[::stride]))
            q25, q50, q75 = (jnp.where(poison, jnp.nan, q) for q in (q25, q50, q75))
        center = ns.center + w * (q50 - ns.center)
        scale = ns.scale + w * ((q75 - q25) - ns.scale)
    elif ns.mode == "popart":
        if keep is None:
            m1, m2, seen = flat.mean(), jnp.mean(flat * flat), None
        else:
            n = jnp.sum(keep.astype(jnp.float32))
            seen = n > 0
            m1 = jnp.sum(jnp.where(keep, flat, 0.0)) / jnp.maximum(n, 1.0)
            m2 = jnp.sum(jnp.where(keep, flat * flat, 0.0)) / jnp.maximum(n, 1.0)
        center = ns.center + w * (m1 - ns.center)
        scale = ns.scale + w * (m2 - ns.scale)
    else:
        raise ValueError(f"unknown reward_norm mode {ns.mode!r}")
    count = ns.count + 1.0
    if seen is not None:  # nothing marked: keep the statistics as they were
        center, scale, count = (jnp.where(seen, a, b) for a, b in
                                ((center, ns.center), (scale, ns.scale), (count, ns.count)))
    if ns.mode == "robust":
        denom = jnp.maximum(scale, ns.floor)
    else:
        denom = jnp.maximum(jnp.sqrt(jnp.maximum(scale - center * center, 0.0)), ns.floor)
    new = ns.replace(center=center, scale=scale, count=count)
    return new, ((reward - center) / denom).astype(reward.dtype)
