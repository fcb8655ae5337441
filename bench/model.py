"""Benchmark the model: forward and forward+backward (value_and_grad of total_loss) per batch.

Prints one JSON object. Times exclude compilation (one warm-up call first) and are taken with
``block_until_ready``; each figure is the median over ``--repeats`` timed loops of calls.
Achieved TFLOP/s use the analytic matmul FLOP count (``flops_per_sample`` /
``train_flops_per_sample``), i.e. useful model FLOPs, not what XLA happens to execute.

    python bench/model.py                 # B ∈ {256, 4096, 16384}, default model
    python bench/model.py --quick         # B ∈ {64, 256, 1024}, fewer repeats (CPU smoke)
    python bench/model.py --matmul-dtype bfloat16 --unfused
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp

from jdqn.config import ModelConfig, TrainConfig
from jdqn.losses import Batch, init_moe_state, total_loss
from jdqn.networks import (
    BranchingQNetwork,
    count_params,
    flops_per_sample,
    init_params,
    train_flops_per_sample,
)


def _time(fn, *args, repeats: int, min_seconds: float) -> float:
    """Median seconds per call over ``repeats`` loops (each ≥ min_seconds or ≥ 3 calls)."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    per_call = max(time.perf_counter() - t0, 1e-6)
    n = max(3, int(min_seconds / per_call))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


def _batch(key: jax.Array, b: int, width: int, branch_sizes: tuple[int, ...]) -> Batch:
    k = jax.random.split(key, 4)
    action = jnp.stack([jax.random.randint(jax.random.fold_in(k[1], d), (b,), 0, a)
                        for d, a in enumerate(branch_sizes)], axis=1).astype(jnp.int32)
    return Batch(obs=jax.random.normal(k[0], (b, width)), action=action,
                 reward=jax.random.normal(k[2], (b,)), discount=jnp.full((b,), 0.97),
                 next_obs=jax.random.normal(k[3], (b, width)), weight=jnp.ones((b,)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small batches, fewer repeats")
    ap.add_argument("--batch", type=int, nargs="*", help="batch sizes (overrides defaults)")
    ap.add_argument("--matmul-dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--unfused", action="store_true",
                    help="fuse_next_obs=false: online at s, then online and target at s′ (paired "
                    "in one pass under float32) instead of one online forward over [s; s′]")
    ap.add_argument("--no-iqn", action="store_true")
    ap.add_argument("--obs-width", type=int, default=128)
    ap.add_argument("--n-flow", type=int, default=3, help="order-flow features fed to heads")
    ap.add_argument("--repeats", type=int, default=0)
    args = ap.parse_args()

    batches = args.batch or ([64, 256, 1024] if args.quick else [256, 4096, 16384])
    repeats = args.repeats or (3 if args.quick else 5)
    min_seconds = 0.2 if args.quick else 0.5
    cfg = dataclasses.replace(ModelConfig(), matmul_dtype=args.matmul_dtype,
                              fuse_next_obs=not args.unfused, iqn=not args.no_iqn)
    width, flow_idx = args.obs_width, tuple(range(args.n_flow))
    net = BranchingQNetwork(cfg, flow_idx)
    train_cfg = TrainConfig()
    key = jax.random.key(0)
    params = init_params(net, jax.random.fold_in(key, 1), width)
    target = init_params(net, jax.random.fold_in(key, 2), width)

    forward = jax.jit(net.apply)
    grad = jax.jit(jax.value_and_grad(
        functools.partial(total_loss, net=net, train_cfg=train_cfg), has_aux=True))
    fwd_flops = flops_per_sample(cfg, width, len(flow_idx), 0)
    trn_flops = train_flops_per_sample(cfg, width, len(flow_idx))

    results = []
    for b in batches:
        batch = _batch(jax.random.fold_in(key, b), b, width, cfg.branch_sizes)
        t_fwd = _time(forward, params, batch.obs, repeats=repeats, min_seconds=min_seconds)
        t_trn = _time(grad, params, target, batch, jax.random.key(3), init_moe_state(
            cfg.n_experts), jnp.float32(0.5), repeats=repeats, min_seconds=min_seconds)
        results.append({
            "batch": b,
            "forward_ms": round(t_fwd * 1e3, 4),
            "forward_tflops": round(b * fwd_flops / t_fwd / 1e12, 4),
            "forward_backward_ms": round(t_trn * 1e3, 4),
            "forward_backward_tflops": round(b * trn_flops / t_trn / 1e12, 4),
        })

    dev = jax.devices()[0]
    print(json.dumps({
        "benchmark": "jdqn model forward / value_and_grad(total_loss)",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)),
        "n_devices": jax.device_count(),
        "default_matmul_precision": str(jax.config.jax_default_matmul_precision or "default"),
        "matmul_dtype": cfg.matmul_dtype,
        "fuse_next_obs": cfg.fuse_next_obs,
        "iqn": cfg.iqn,
        "obs_width": width,
        "n_flow": len(flow_idx),
        "param_count": count_params(cfg, width, flow_idx),
        "flops_per_sample_forward": fwd_flops,
        "flops_per_sample_train": trn_flops,
        "results": results,
    }, indent=2))


if __name__ == "__main__":
    main()
