"""Reward normalisation whose statistics are a pytree the trainer carries across folds.

The predecessor zeroed these statistics at fold boundaries; the first rewards of each fold were
then divided by a near-zero scale and the losses exploded. Keep ``NormState`` across folds.

Modes (``EnvConfig.reward_norm``):

* ``"robust"``: ``r_n = (r − m) / max(iqr, reward_iqr_floor)`` with ``m``, ``iqr`` running
  estimates of the median and inter-quartile range. Each call takes the exact quartiles of the
  batch (at most 8191 evenly strided samples, so it stays cheap at large N) and moves the
  running values towards them with weight ``w = max(1 − decay, 1 / (count + 1))`` — the plain
  average of the batches seen so far until ``1 / (count + 1)`` drops below ``1 − decay``, then an
  EMA. No zero-initialisation bias.
* ``"zscore"``: the same update of a running mean and second moment; ``r_n = (r − μ) / max(σ,
  floor)``. Not PopArt (and named so since 2026-12-04; ``"popart"`` is refused with the new
  name): PopArt also rescales the value layer so that the network's outputs are preserved
  when μ, σ move, and with C51's fixed support that has no exact form — a move of the target's
  scale maps the atoms off the support, which no change of the logits can follow. SPEC §3's
  alternative to the robust normaliser is this running z-score.
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

MAX_QUANTILE_SAMPLES = 4096  # the stride is n // this: at most 2·4096 − 1 samples are taken
_QUARTILES = (0.25, 0.5, 0.75)


def _sort_keys(x: jax.Array) -> jax.Array:
    """int32 keys whose order is ``lax.sort``'s order of float32 ``x``: −0 and +0 are equal, a
    (positive) NaN is above +inf."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _check_samples(x: jax.Array) -> None:
    if x.ndim != 1 or x.dtype != jnp.float32:
        raise ValueError(f"quantiles: expected a 1-D float32 array, got {x.dtype}{x.shape}")


def quantiles(x: jax.Array, qs: tuple[float, ...], squash_nans: bool = False
              ) -> tuple[jax.Array, ...]:
    """``jnp.quantile(x, qs)`` (``squash_nans=True``: ``jnp.nanquantile``), linear method, for a
    1-D float32 ``x``: on the CPU jnp's own (a sort), elsewhere :func:`quantiles_by_rank`.

    The reward normaliser takes the quartiles of up to 8191 rewards on every collection step.
    On the H200 the sort was most likely the ~34 µs sort kernel of a ~300 µs step of 4096
    envs (bench/results/epoch_h200_one_seed.json), and the rank selection took the
    ``gpu.toml`` epoch from 4.18 to 4.07 s (epoch_h200_seeds_switch.json). On the CPU the
    ``[n, n]`` comparison count is 60× slower than the sort at n = 4096 and materialised,
    so the CPU keeps the sort. Both pick the same elements; the interpolation may differ by a
    rounding (:func:`quantiles_by_rank`)."""
    _check_samples(x)

    def by_sort(v):
        f = jnp.nanquantile if squash_nans else jnp.quantile
        return tuple(f(v, jnp.asarray(qs, jnp.float32)))

    return jax.lax.platform_dependent(x, cpu=by_sort,
                                      default=lambda v: quantiles_by_rank(v, qs, squash_nans))


def quantiles_by_rank(x: jax.Array, qs: tuple[float, ...], squash_nans: bool = False
                      ) -> tuple[jax.Array, ...]:
    """:func:`quantiles` without a sort: each order statistic is selected by rank. Element i
    sits at position ``#{j: x_j < x_i} + #{j < i: x_j = x_i}`` of jnp's stable sort (one
    ``[n, n]`` comparison count, no data movement), so the selected values are jnp's bit for
    bit (ties, ±0 in input order, ±inf, NaNs sorting last or poisoning every quantile). The
    positions and the interpolation are jnp's arithmetic; XLA may contract the interpolation's
    multiply-add differently, so a result may differ from jnp's by one rounding. Tested
    against jnp on the CPU."""
    _check_samples(x)
    n = x.shape[0]
    if squash_nans:
        x = jnp.where(jnp.isnan(x), jnp.nan, x)  # one NaN, positive: it sorts last
        counts = jnp.sum(~jnp.isnan(x), dtype=jnp.float32)
    else:
        x = jnp.where(jnp.any(jnp.isnan(x)), jnp.nan, x)  # a NaN makes every quantile NaN
        counts = jnp.asarray(n, jnp.float32)
    keys = _sort_keys(x)
    idx = jnp.arange(n, dtype=jnp.int32)
    before = (keys[None, :] < keys[:, None]) | ((keys[None, :] == keys[:, None])
                                                & (idx[None, :] < idx[:, None]))
    position = jnp.sum(before, axis=1, dtype=jnp.int32)  # [n], a permutation of 0..n-1
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)

    def order_statistic(k: jax.Array) -> jax.Array:  # sorted(x)[k], k int32 []
        # exactly one term, bits intact (int32 even under x64, or the bitcast changes shape)
        picked = jnp.sum(jnp.where(position == k, bits, 0), dtype=jnp.int32)
        return jax.lax.bitcast_convert_type(picked, jnp.float32)

    q = jnp.asarray(qs, jnp.float32) * (counts - 1.0)
    low, high = jnp.floor(q), jnp.ceil(q)
    high_weight = q - low
    low_weight = 1.0 - high_weight
    if squash_nans:  # as jnp: max(0, min(·, counts − 1)), so no marked value → position 0
        low, high = (jnp.maximum(0.0, jnp.minimum(v, counts - 1.0)) for v in (low, high))
    else:
        low, high = (jnp.clip(v, 0.0, counts - 1.0) for v in (low, high))
    low, high = low.astype(jnp.int32), high.astype(jnp.int32)
    out = []
    for i in range(len(qs)):
        out.append(order_statistic(low[i]) * low_weight[i]
                   + order_statistic(high[i]) * high_weight[i])
    return tuple(out)


@struct.dataclass
class NormState:
    center: jax.Array  # f32 []: running median (robust) or mean (zscore)
    scale: jax.Array  # f32 []: running IQR (robust) or second moment (zscore)
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
        if keep is None:
            q25, q50, q75 = quantiles(flat[::stride], _QUARTILES)
            seen = None
        else:
            sub = jnp.where(keep[::stride], flat[::stride], jnp.nan)
            seen = jnp.any(keep[::stride])
            q25, q50, q75 = quantiles(sub, _QUARTILES, squash_nans=True)
            # a marked NaN must not be skipped as if unmarked: it poisons the statistics, as
            # without a mask (the finite checks then halt on the normalised rewards)
            poison = jnp.any(keep[::stride] & jnp.isnan(flat[::stride]))
            q25, q50, q75 = (jnp.where(poison, jnp.nan, q) for q in (q25, q50, q75))
        center = ns.center + w * (q50 - ns.center)
        scale = ns.scale + w * ((q75 - q25) - ns.scale)
    elif ns.mode == "zscore":
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
