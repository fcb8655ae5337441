"""Env throughput: env-steps/s of a random policy over a jitted ``lax.scan`` of env steps.

Prints one JSON object. Each measurement: ``N`` episodes × ``steps`` scan steps of
``step`` + ``auto_reset`` (episodes of ``episode_length`` bars) with a random policy, compile
excluded (one warm-up call), ``block_until_ready``, best of ``repeats``. Two random policies:
``hash`` (a counter-based integer hash of (step, env) — the policy costs ~nothing, so this is
the env's own speed) and ``threefry`` (``jax.random.randint`` per step — includes JAX's PRNG
cost, which dominates on CPU). Also ``step+observe`` (building the [N, 128] observation each
step, as a network-driven collection would).

Where ``gym_anytrading`` is importable (not a project dependency: ``pip install gym-anytrading``
for the comparison only), its ``stocks-v0`` env steps the same closes with random actions in a
Python loop, and the ratio is reported.

    python bench/env.py [--quick] [--sizes 4096 65536] [--steps 1000]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from jdqn import env as E
from jdqn.config import EnvConfig


def synthetic_bars(t_len: int, seed: int = 0, n_feat: int = 32):
    rng = np.random.default_rng(seed)
    c = 4000 + np.round(np.cumsum(rng.normal(0, 1.0, t_len)) * 4) / 4
    c = np.maximum(c, 100.0)
    o = np.r_[c[0], c[:-1]]
    h = np.maximum(o, c) + 0.25 * rng.integers(0, 4, t_len)
    lo = np.minimum(o, c) - 0.25 * rng.integers(0, 4, t_len)
    return rng.normal(size=(t_len, n_feat)).astype(np.float32), o, h, lo, c


def hash_actions(i: jax.Array, n: int) -> jax.Array:
    x = E.core.hash_u32(i.astype(jnp.uint32) * jnp.uint32(0x27D4EB2F), jnp.arange(n))
    return jnp.stack([x % 4, (x >> 8) % 3, (x >> 16) % 3, (x >> 24) % 3], -1).astype(jnp.int32)


def make_run(params: E.EnvParams, n: int, steps: int, policy: str, with_obs: bool):
    def run(state, key):
        def body(carry, i):
            state, acc = carry
            k = jax.random.fold_in(key, i)
            if policy == "hash":
                action = hash_actions(i, n)
            else:
                action = jax.random.randint(k, (n, 4), 0, jnp.array(E.BRANCH_SIZES))
            if with_obs:
                acc = acc + E.observe(params, state).sum()
            state, reward, done, _ = E.step(params, state, action, E.PolicyAux.zeros(n))
            state = E.auto_reset(params, state, done, k)
            return (state, acc + reward.sum()), None

        (state, acc), _ = jax.lax.scan(body, (state, jnp.float32(0)), jnp.arange(steps))
        return state, acc

    return jax.jit(run, donate_argnums=0)


def measure(n: int, steps: int, policy: str, with_obs: bool, repeats: int, t_len: int) -> float:
    cfg = EnvConfig(n_envs=n, episode_length=512)
    params = E.make_params(*synthetic_bars(t_len), cfg, state_width=128)
    run = make_run(params, n, steps, policy, with_obs)
    state = E.reset(params, jax.random.key(0))
    state, acc = run(state, jax.random.key(1))  # compile + warm-up
    jax.block_until_ready(acc)
    best = float("inf")
    for r in range(repeats):
        t0 = time.perf_counter()
        state, acc = run(state, jax.random.key(2 + r))
        jax.block_until_ready(acc)
        best = min(best, time.perf_counter() - t0)
    return n * steps / best


def gym_anytrading_steps_per_s(t_len: int, n_steps: int) -> float | None:
    try:
        import pandas as pd
        from gym_anytrading.envs import StocksEnv
    except ImportError:
        return None
    _, o, h, lo, c = synthetic_bars(t_len)
    df = pd.DataFrame({"Open": o, "High": h, "Low": lo, "Close": c, "Volume": 1.0})
    env = StocksEnv(df=df, window_size=10, frame_bound=(10, t_len))
    rng = np.random.default_rng(0)
    actions = rng.integers(0, 2, n_steps)
    env.reset(seed=0)
    t0 = time.perf_counter()
    for a in actions:
        _, _, terminated, truncated, _ = env.step(int(a))
        if terminated or truncated:
            env.reset()
    return n_steps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    ap.add_argument("--sizes", type=int, nargs="*", default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sizes = args.sizes or ([1024] if args.quick else [4096, 65536])
    steps = args.steps or (100 if args.quick else 1000)
    t_len = 20_000
    results = {}
    for n in sizes:
        row = {}
        for policy, with_obs in (("hash", False), ("threefry", False), ("hash", True)):
            name = f"{policy}{'+observe' if with_obs else ''}"
            row[name] = measure(n, steps, policy, with_obs, args.repeats, t_len)
        results[str(n)] = row
    gym = gym_anytrading_steps_per_s(t_len, 2_000 if args.quick else 20_000)
    best = max(r["hash"] for r in results.values())
    out = {
        "bench": "env", "unit": "env-steps/s", "scan_steps": steps, "n_bars": t_len,
        "results": results,
        "gym_anytrading_steps_per_s": gym,
        "speedup_vs_gym_anytrading": (best / gym) if gym else None,
        "device": str(jax.devices()[0].device_kind), "platform": jax.default_backend(),
        "n_devices": jax.device_count(), "jax": jax.__version__,
        "python": platform.python_version(), "cpu_threads_hint": _cpu_hint(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    print(json.dumps(out))


def _cpu_hint() -> int | None:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count()


if __name__ == "__main__":
    main()
