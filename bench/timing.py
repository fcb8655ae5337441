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


def seconds_per_call(fn: Callable[..., Any], args: tuple, reps: int,
                     evict_bytes: int = 0) -> float:
    """Seconds per ``fn(*args)`` run ``reps`` times in :func:`timed_loop`'s program, after a
    warm-up call that compiles it."""
    import jax

    loop = timed_loop(fn, reps, evict_bytes)
    jax.block_until_ready(loop(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(loop(*args))
    return (time.perf_counter() - t0) / reps


def timed_loop(fn: Callable[..., Any], reps: int, evict_bytes: int = 0):
    """The jitted program that runs ``fn`` ``reps`` times in one ``lax.fori_loop`` and returns
    the sum of its outputs. The first argument is perturbed per iteration (so nothing is
    hoisted out of the loop) and every output leaf is consumed, behind an optimisation barrier:
    the outputs are materialised as a caller would get them, not fused into the consuming sums
    (without the barrier XLA could sum a large output inside the kernel that computes it, and
    skip writing it; added 2026-12-01, results before then lack it).

    ``evict_bytes > 0``: before each call the loop rewrites a float32 buffer of that many bytes
    (twice the GPU's L2 cache evicts it: the kernel's code, weights and input then come from
    HBM, as for a kernel that follows unrelated work), chained to the call through data
    dependencies so the rewrite cannot overlap it; that rewrite's own time is included (time an
    identity function with the same ``evict_bytes`` and subtract)."""
    import jax
    import jax.numpy as jnp

    n_evict = max(0, int(evict_bytes) // 4)

    def body(i, acc, x, rest):
        out = jax.lax.optimization_barrier(fn((x + 1e-3 * i).astype(x.dtype), *rest))
        return acc + sum(jnp.sum(leaf).astype(jnp.float32) for leaf in jax.tree.leaves(out))

    def evicting_body(i, carry, x, rest):
        acc, buf = carry
        # the rewrite after the previous call's sums, materialised whole (the barrier: XLA
        # cannot fuse the one element read below into a copy of the add), then the call after
        # it (x·0 is not folded away for floats)
        buf = jax.lax.optimization_barrier(buf + (1.0 + 0.0 * acc))
        dep = 0.0 * buf[-1]
        return body(i, acc, (x + dep).astype(x.dtype), rest), buf

    def run(x, *rest):
        if not n_evict:
            return jax.lax.fori_loop(0, reps, lambda i, acc: body(i, acc, x, rest),
                                     jnp.float32(0.0))
        return jax.lax.fori_loop(0, reps, lambda i, c: evicting_body(i, c, x, rest),
                                 (jnp.float32(0.0), jnp.zeros((n_evict,), jnp.float32)))[0]

    return jax.jit(run)


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
