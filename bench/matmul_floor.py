"""What the update's matmuls cost on their own: every ``dot_general`` of one ``train_step``,
timed in isolation.

Traces ``train_step`` (the update the trainer runs: PER sample → observations → loss and its
gradient → AdamW → Polyak → priorities) to a jaxpr, collects every ``dot_general`` in it (inside
``scan`` bodies counted ``length`` times; Pallas kernels are not XLA matmuls and are skipped),
groups identical ones, and times each alone — random operands of its shapes and dtypes, the
same dimension numbers, precision and accumulation type — as one jitted call. On a GPU the time
is the sum of the call's kernel durations from CUPTI (no launch gaps, no host time); elsewhere
it is the best wall time of ``--repeats`` calls.

The sum over the update (``isolated_matmul_us_per_update``) is what the update's matmuls take
with XLA's kernels when each runs by itself, with nothing fused into it and nothing beside it.
Each row also gives the bytes the matmul reads and writes (operands + result, each once) and
the rate that implies; ``bytes_at_stream_us_per_update`` is the time those bytes take at the
device's streaming rate (``stream_tb_s``: ``x + 1`` over 1 GB, timed the same way) — what any
design with one kernel per matmul spends moving them unless consecutive kernels meet in cache.

``--mgpu`` also times JAX's own Hopper wgmma/TMA matmul (``jax.experimental.pallas.ops.gpu.
hopper_matmul_mgpu``, Pallas Mosaic GPU) over a small tile sweep for the rows it can run:
2-D ``[M, K] × [K, N]`` products in bf16 (its float32/TF32 path needs a K-major right operand:
"Only f16 WGMMA supports transposes").

    python bench/matmul_floor.py                      # default model (configs/gpu.toml), GPU
    python bench/matmul_floor.py --dtype bfloat16 --mgpu
    python bench/matmul_floor.py --quick              # small sizes, CPU smoke run
    python bench/matmul_floor.py --split-k 2,4,8      # + the long contractions split in parts

``--split-k`` times, for each dot contracting over at least ``--split-min`` elements (the
weight gradients, whose contraction runs over the batch), the same product with its
contraction split into S parts made a batch axis and summed afterwards (:func:`split_k_fn`):
whether handing cuBLAS more, shorter products beats its own choice for the few output tiles
such a gradient has.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import functools
import itertools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import train as train_bench
from timing import best_of

from jdqn.config import apply_overrides, config_from_dict, load_config, to_dict
from jdqn.train import epoch as epoch_lib

REPO = Path(__file__).resolve().parents[1]
_SKIP = ("pallas_call",)  # kernels written in Pallas: their dots are not XLA matmuls


def _sub_jaxprs(value):
    if hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


_OTHER_MATMULS = ("conv_general_dilated", "ragged_dot_general")


def collect_dots(jaxpr, times: int = 1, out=None) -> collections.Counter:
    """``Counter`` of dot signatures → executions per call of ``jaxpr``. A signature is
    ``(lhs shape, lhs dtype, rhs shape, rhs dtype, dimension_numbers, precision,
    preferred_element_type)``. ``scan`` bodies count ``length`` times; of a ``cond``'s branches
    (one runs) the one with the most matmul FLOPs counts; ``while`` bodies count once (their trip
    count is not static); inside ``shard_map`` the shapes are one device's, as its time is.
    ``train_step`` has none of these four around its matmuls today. Convolutions and ragged dots
    are matmuls this bench cannot time: it refuses a program with one rather than leave it out."""
    out = collections.Counter() if out is None else out
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            lhs, rhs = (v.aval for v in eqn.invars)
            p = eqn.params
            pref = p.get("preferred_element_type")
            key = (tuple(lhs.shape), str(lhs.dtype), tuple(rhs.shape), str(rhs.dtype),
                   p["dimension_numbers"], p.get("precision"),
                   None if pref is None else str(np.dtype(pref)))
            out[key] += times
            continue
        if name in _OTHER_MATMULS:
            raise ValueError(f"matmul_floor: the program has a {name}, which this bench does "
                             "not time")
        if name in _SKIP:
            continue
        if name == "cond":
            branches = [collect_dots(b.jaxpr, times) for b in eqn.params["branches"]]
            out.update(max(branches, key=lambda c: sum(n * flops_bytes(k)[0]
                                                         for k, n in c.items())))
            continue
        inner = times * (int(eqn.params["length"]) if name == "scan" else 1)
        for v in eqn.params.values():
            for sub in _sub_jaxprs(v):
                collect_dots(sub, inner, out)
    return out


def _dot_fn(key):
    _, _, _, _, dn, precision, pref = key
    return jax.jit(lambda a, b: jax.lax.dot_general(
        a, b, dn, precision=precision, preferred_element_type=pref))


def split_k_fn(key, s: int):
    """The dot of ``key`` with its contraction split into ``s`` parts: the contracting axis
    (one per operand; its size divisible by ``s``) reshaped to ``[s, K/s]``, the ``s`` axis made
    a batch axis of the product, and the ``s`` partial products summed by XLA in a fixed order —
    what a custom VJP could hand XLA for a weight gradient whose contraction runs over the batch
    (few output tiles, a long K). None where the dot does not have that form."""
    ls, _, _, _, dn, precision, pref = key
    (lc, rc), (lb, rb) = dn
    if len(lc) != 1 or ls[lc[0]] % s:
        return None
    (c, d), k = (lc[0], rc[0]), ls[lc[0]]

    def shifted(axes, at):  # axis indices after an axis is inserted at ``at``
        return tuple(a + (a > at) for a in axes)

    dn_split = (((c + 1,), (d + 1,)), (shifted(lb, c) + (c,), shifted(rb, d) + (d,)))

    def fn(a, b):
        a = a.reshape(a.shape[:c] + (s, k // s) + a.shape[c + 1:])
        b = b.reshape(b.shape[:d] + (s, k // s) + b.shape[d + 1:])
        parts = jax.lax.dot_general(a, b, dn_split, precision=precision,
                                    preferred_element_type=pref)
        return jnp.sum(parts, axis=len(lb)).astype(parts.dtype)

    return jax.jit(fn)


def _operands(key, seed: int = 0):
    ls, ld, rs, rd = key[:4]
    ka, kb = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(ka, ls, jnp.float32).astype(ld),
            jax.random.normal(kb, rs, jnp.float32).astype(rd))


def device_us(fn, args, repeats: int) -> float:
    """Microseconds per ``fn(*args)``: CUPTI kernel time on a GPU (median of ``repeats``),
    else the best wall time."""
    if jax.default_backend() == "gpu":
        from jax.experimental.mosaic.gpu import profiler

        _, runtimes_ms = profiler.measure(fn, iterations=repeats)(*args)
        return 1e3 * statistics.median(runtimes_ms)
    jax.block_until_ready(fn(*args))
    return 1e6 * best_of(lambda: jax.block_until_ready(fn(*args)), repeats)


def flops_bytes(key) -> tuple[float, float]:
    ls, ld, rs, rd, dn, _, pref = key
    (lc, _), (lb, _) = dn
    contract = int(np.prod([ls[i] for i in lc]))
    batch = int(np.prod([ls[i] for i in lb]))
    m = int(np.prod(ls)) // (contract * batch)
    n = int(np.prod(rs)) // (contract * batch)
    out_dtype = np.dtype(pref) if pref else np.result_type(np.dtype(ld), np.dtype(rd))
    nbytes = (np.prod(ls) * np.dtype(ld).itemsize + np.prod(rs) * np.dtype(rd).itemsize
              + batch * m * n * out_dtype.itemsize)
    return 2.0 * batch * m * n * contract, float(nbytes)


def mgpu_us(key, repeats: int) -> dict:
    """JAX's Hopper Mosaic-GPU matmul on a 2-D ``[M, K] × [K, N]`` bf16 dot: best over a small
    tile sweep, with its largest deviation from XLA's result."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    ls, ld, rs, rd, dn, _, _ = key
    if not (len(ls) == 2 and len(rs) == 2 and dn == (((1,), (0,)), ((), ()))
            and ld == rd == "bfloat16"):
        return {"skipped": "not a 2-D [M,K]x[K,N] bf16 product"}
    a, b = _operands(key)
    ref = _dot_fn(key)(a, b).astype(jnp.float32)
    best, errors = None, []
    for tm, tn, wgd, steps in itertools.product((64, 128), (64, 128), hm.MatmulDimension,
                                                (2, 4)):
        cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=min(64, rs[0]),
                              max_concurrent_steps=min(steps, max(1, rs[0] // 64)),
                              epi_tile_m=64, epi_tile_n=64, grid_tile_width=4, wg_dimension=wgd)
        try:
            fn = jax.jit(functools.partial(hm.matmul, config=cfg))
            us = device_us(lambda x, y, fn=fn: fn(x, y, None), (a, b), repeats)
            err = float(jnp.max(jnp.abs(fn(a, b, None).astype(jnp.float32) - ref)))
        except (ValueError, NotImplementedError, RuntimeError) as e:  # a tile it cannot take
            errors.append(f"{tm}x{tn}/{wgd}/{steps}: {type(e).__name__}: {str(e)[:120]}")
            continue
        if best is None or us < best["us"]:
            best = {"us": round(us, 2), "tile": [tm, tn, str(wgd), steps], "max_abs_diff": err}
    return best or {"errors": errors[:4]}


def update_dots(cfg):
    """``(dots, prepared)``: :func:`collect_dots` of one ``train_step`` of ``cfg`` (one seed,
    traced, not run) and the prepared job (its feature layout gives the observation width)."""
    p, env_params, state = train_bench.build(cfg)
    one = jax.tree.map(lambda x: x[0], state)
    fold = jnp.asarray(0, jnp.int32)
    jaxpr = jax.make_jaxpr(
        lambda s: epoch_lib.train_step(p.learner, s, env_params, fold))(one).jaxpr
    return collect_dots(jaxpr), p


def quick_sets() -> list[str]:
    """Small sizes for a CPU smoke run (``--quick``)."""
    return ["env.n_envs=64", "env.episode_length=64", "train.replay_capacity=4096",
            "train.min_replay=256", "train.collect_steps=4", "data.synthetic.n_bars=4000",
            "eval.n_windows=1"]  # 4000 bars' validation windows are too short for 64


def stream_tb_s(repeats: int, mbytes: int = 1024) -> float:
    """The device's streaming rate in TB/s: ``x + 1`` over a float32 array of ``mbytes`` MB
    (read once, written once), timed like the matmuls."""
    x = jnp.zeros((mbytes * 2**20 // 4,), jnp.float32)
    us = device_us(jax.jit(lambda x: x + 1.0), (x,), repeats)
    return 2 * x.nbytes / us / 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "gpu.toml"))
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    ap.add_argument("--batch", type=int, default=None, help="default: 16384 (256 with --quick)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--mgpu", action="store_true",
                    help="also time JAX's Hopper Mosaic-GPU matmul (GPU only)")
    ap.add_argument("--split-k", default="",
                    help="also time each dot whose contraction is at least --split-min long "
                         "with it split into S parts (comma-separated S), e.g. 2,4,8")
    ap.add_argument("--split-min", type=int, default=4096)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    args = ap.parse_args(argv)
    try:
        splits = [int(x) for x in args.split_k.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--split-k {args.split_k!r}: expected comma-separated integers") from None
    if any(x < 2 for x in splits):
        raise SystemExit(f"--split-k {args.split_k!r}: each split must be at least 2")
    if args.mgpu and jax.default_backend() != "gpu":
        raise SystemExit("--mgpu needs a GPU (the Mosaic GPU kernel does not run elsewhere)")
    batch = args.batch or (256 if args.quick else 16384)
    sets = [f"model.matmul_dtype={args.dtype}", "data.cache_dir=''",
            "data.synthetic.n_bars=200000"]
    if args.quick:
        sets += quick_sets()
    cfg = load_config(args.config, sets + args.sets)
    cfg = config_from_dict(apply_overrides(to_dict(cfg), [f"train.batch_size={batch}"]))
    dots, _ = update_dots(cfg)

    rows, total_us, total_flops, total_bytes = [], 0.0, 0.0, 0.0
    for key, count in sorted(dots.items(), key=lambda kv: -flops_bytes(kv[0])[0] * kv[1]):
        flops, nbytes = flops_bytes(key)
        us = device_us(_dot_fn(key), _operands(key), args.repeats)
        row = {"lhs": [list(key[0]), key[1]], "rhs": [list(key[2]), key[3]],
               "dimension_numbers": [[list(x) for x in pair] for pair in key[4]],
               "precision": str(key[5]), "preferred": key[6], "count": count,
               "us": round(us, 2), "gflop": round(flops / 1e9, 4),
               "mbytes": round(nbytes / 1e6, 2),
               "tflop_s": round(flops / us / 1e6, 1), "tb_s": round(nbytes / us / 1e6, 2)}
        if args.mgpu:
            row["mgpu"] = mgpu_us(key, args.repeats)
        contract = int(np.prod([key[0][i] for i in key[4][0][0]]))  # lhs contracting dims
        if splits and contract >= args.split_min:
            ref = np.asarray(_dot_fn(key)(*_operands(key)), np.float32)
            row["split_k"] = {}
            for s in splits:
                fn = split_k_fn(key, s)
                if fn is None:
                    continue
                got = np.asarray(fn(*_operands(key)), np.float32)
                row["split_k"][str(s)] = {
                    "us": round(device_us(fn, _operands(key), args.repeats), 2),
                    "max_rel_diff": float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))}
        rows.append(row)
        total_us += count * us
        total_flops += count * flops
        total_bytes += count * nbytes
        print(json.dumps({k: row[k] for k in ("lhs", "rhs", "count", "us")}), file=sys.stderr,
              flush=True)
    stream = stream_tb_s(args.repeats, 64 if args.quick else 1024)
    dev = jax.devices()[0]
    out = {"bench": "matmul_floor", "config": Path(args.config).name, "quick": args.quick,
           "batch": batch, "matmul_dtype": args.dtype, "sets": args.sets,
           "timing": "CUPTI kernel time, median" if jax.default_backend() == "gpu"
           else "wall time, best",
           "n_dots_per_update": sum(dots.values()), "n_distinct": len(dots),
           "isolated_matmul_us_per_update": round(total_us, 1),
           "gflop_per_update": round(total_flops / 1e9, 2),
           "gbytes_per_update": round(total_bytes / 1e9, 3),
           "stream_tb_s": round(stream, 2),
           "bytes_at_stream_us_per_update": round(total_bytes / stream / 1e6, 1),
           "rows": rows, "device": getattr(dev, "device_kind", str(dev)),
           "jax": jax.__version__,
           "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
    if args.mgpu:
        eligible = [r for r in rows if "us" in r["mgpu"]]
        out["mgpu_vs_xla_on_eligible_us"] = [
            round(sum(r["count"] * r["mgpu"]["us"] for r in eligible), 1),
            round(sum(r["count"] * r["us"] for r in eligible), 1)]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
