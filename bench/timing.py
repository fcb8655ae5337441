"""Timing helpers shared by the benchmark scripts (each imports this module from its folder,
which Python puts first on ``sys.path`` when the script runs)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    """The shortest wall time of ``fn()`` over ``repeats`` calls, in seconds (``fn`` blocks on
    any device work it starts)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def seconds_per_call(fn: Callable[..., Any], args: tuple, reps: int) -> float:
    """Seconds per ``fn(*args)`` run ``reps`` times in one jitted ``lax.fori_loop``, after a
    warm-up call that compiles it. The first argument is perturbed per iteration (so nothing is
    hoisted out of the loop) and every output leaf is consumed, behind an optimisation barrier:
    the outputs are materialised as a caller would get them, not fused into the consuming sums
    (without the barrier XLA could sum a large output inside the kernel that computes it, and
    skip writing it; added 2026-12-01, results before then lack it)."""
    import jax
    import jax.numpy as jnp

    def body(i, acc, x, rest):
        out = jax.lax.optimization_barrier(fn((x + 1e-3 * i).astype(x.dtype), *rest))
        return acc + sum(jnp.sum(leaf).astype(jnp.float32) for leaf in jax.tree.leaves(out))

    loop = jax.jit(lambda x, *rest: jax.lax.fori_loop(
        0, reps, lambda i, acc: body(i, acc, x, rest), jnp.float32(0.0)))
    jax.block_until_ready(loop(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(loop(*args))
    return (time.perf_counter() - t0) / reps


def emit(res: dict, out: str = "") -> None:
    """Add the device, platform, JAX and Python versions and the UTC date to a benchmark's
    record, print it as one JSON line and, with ``out``, write it there too."""
    import datetime as dt
    import json
    import platform
    from pathlib import Path

    import jax

    res.update(device=str(jax.devices()[0].device_kind), platform=jax.default_backend(),
               jax=jax.__version__, python=platform.python_version(),
               date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
    print(json.dumps(res))
    if out:
        Path(out).write_text(json.dumps(res, indent=1) + "\n")
