"""Safety checks: on-device finite checks over named tensors, and the Q-drift halt.

Inside the jitted epoch nothing is read back to the host: :func:`finite_flags` turns a dict of
named tensors (each a pytree: ``params``, ``grads``, ``logits``, ``loss``, ``rewards``, …) into a
``bool [n]`` vector, and :func:`monitor_update` folds it into a small :class:`NaNMonitor` that
remembers the **first** non-finite tensor (sticky: later failures never overwrite it). The host
reads the monitor once per epoch with :func:`raise_if_halted`, which raises
``TrainingHalted("non-finite values in 'grads' at step 1234 of fold 1")``.

Order matters: when several tensors go non-finite in the same step, the one listed first is
reported. List them in pipeline order (rewards → logits → loss → grads → params) so the name
points at the cause, not a consequence, and use one fixed tuple of names for both calls.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jdqn.errors import TrainingHalted


def _all_finite(tree: Any) -> jax.Array:
    """Every floating leaf finite: one reduction per dtype over the leaves concatenated (XLA
    fuses the concatenation into it), not one per leaf."""
    by_dtype: dict[Any, list[jax.Array]] = {}
    for x in jax.tree.leaves(tree):
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            by_dtype.setdefault(x.dtype, []).append(jnp.ravel(x))
    checks = [jnp.all(jnp.isfinite(jnp.concatenate(xs))) for xs in by_dtype.values()]
    return jnp.all(jnp.stack(checks)) if checks else jnp.bool_(True)


def finite_flags(named: Mapping[str, Any]) -> jax.Array:
    """``bool [n]``: True where every floating leaf of the named tensor is finite, in the dict's
    order (integer and key leaves are always finite). One fused reduction per tensor and dtype,
    no host transfer."""
    return jnp.stack([_all_finite(v) for v in named.values()])


@struct.dataclass
class NaNMonitor:
    """Where training first went non-finite. ``tensor`` indexes the names; −1 = never."""

    halted: jax.Array  # bool []
    tensor: jax.Array  # i32 []
    step: jax.Array  # i32 []
    fold: jax.Array  # i32 []


def monitor_init() -> NaNMonitor:
    m1 = jnp.int32(-1)
    return NaNMonitor(halted=jnp.bool_(False), tensor=m1, step=m1, fold=m1)


def monitor_update(monitor: NaNMonitor, flags: jax.Array, step: jax.Array | int,
                   fold: jax.Array | int) -> NaNMonitor:
    """Record the first non-finite entry of ``flags`` at (step, fold) unless already halted."""
    bad = jnp.logical_not(flags)
    hit = jnp.any(bad) & jnp.logical_not(monitor.halted)
    first = jnp.argmax(bad).astype(jnp.int32)  # the first True
    pick = lambda new, old: jnp.where(hit, jnp.asarray(new, jnp.int32), old)
    return NaNMonitor(halted=monitor.halted | hit, tensor=pick(first, monitor.tensor),
                      step=pick(step, monitor.step), fold=pick(fold, monitor.fold))


def check_finite(monitor: NaNMonitor, named: Mapping[str, Any], step: jax.Array | int,
                 fold: jax.Array | int) -> NaNMonitor:
    """``monitor_update(monitor, finite_flags(named), step, fold)``."""
    return monitor_update(monitor, finite_flags(named), step, fold)


def raise_if_halted(monitor: NaNMonitor, names: Sequence[str],
                    seeds: Sequence[int] | None = None) -> None:
    """Host side, once per epoch (one small device→host read): raise :class:`TrainingHalted`
    naming the first non-finite tensor, its step and fold. ``names`` = the dict's keys, in the
    order given to :func:`finite_flags`. Works on a monitor batched over seeds (leading axis):
    the first halted seed is reported, by its value when ``seeds`` are given."""
    m = jax.device_get(monitor)
    halted = jnp.asarray(m.halted).reshape(-1)
    if not bool(halted.any()):
        return
    s = int(jnp.argmax(halted))
    get = lambda x: int(jnp.asarray(x).reshape(-1)[s])
    names = list(names)
    i = get(m.tensor)
    name = names[i] if 0 <= i < len(names) else f"tensor #{i}"
    if seeds is not None and len(seeds) == halted.size:
        seed = f" (seed {seeds[s]})" if halted.size > 1 else ""
    else:
        seed = f" (seed index {s})" if halted.size > 1 else ""
    raise TrainingHalted(f"non-finite values in '{name}' at step {get(m.step)} of fold "
                         f"{get(m.fold)}{seed}")


def q_drift_exceeded(prev_abs_mean_q: Any, abs_mean_q: Any, factor: float = 2.0,
                     floor: float = 10.0) -> Any:
    """True when ``|mean Q|`` more than ``factor``× the previous epoch's **and** above ``floor``
    (the floor keeps small-value noise, e.g. 0.1 → 0.3, from halting), or when it is not finite.
    Works on Python floats and on (batched) arrays."""
    cur, prev = jnp.abs(jnp.asarray(abs_mean_q)), jnp.abs(jnp.asarray(prev_abs_mean_q))
    return jnp.logical_not(jnp.isfinite(cur)) | ((cur > factor * prev) & (cur > floor))


def check_q_drift(prev_abs_mean_q: float | None, abs_mean_q: float, epoch: int,
                  factor: float = 2.0, floor: float = 10.0, fold: int | None = None,
                  seed: int | None = None) -> None:
    """Host side, once per epoch: raise :class:`TrainingHalted` (the model is rejected) when
    :func:`q_drift_exceeded`. On the first epoch (``prev`` is None) only non-finite Q halts."""
    cur = float(abs_mean_q)
    if prev_abs_mean_q is None:
        if math.isfinite(cur):
            return
        prev = float("nan")
    else:
        prev = float(prev_abs_mean_q)
        if not bool(q_drift_exceeded(prev, cur, factor, floor)):
            return
    where = (f"epoch {epoch}" + (f" of fold {fold}" if fold is not None else "")
             + (f" (seed {seed})" if seed is not None else ""))
    raise TrainingHalted(
        f"Q drift at {where}: |mean Q| went from {prev:.4g} to {cur:.4g} (halt when it is more "
        f"than {factor:g}× the previous epoch and above the floor {floor:g}, or not finite); "
        "the model is rejected")
