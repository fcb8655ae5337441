"""Where the time of one gradient update goes: a device-kernel breakdown of ``train_step``.

Runs the same ``lax.scan`` over ``train_step`` that ``bench/train.py`` times, under
``jax.profiler.trace`` (Perfetto output), then aggregates the device events by kernel name and by
kind (GEMM, reduction, elementwise loop fusion, copy, other). Prints one JSON object: wall time
per update, summed kernel time per update, per-kind totals and the top kernels.

    python bench/profile_step.py --batch 16384                 # GPU, default model
    python bench/profile_step.py --quick                       # CPU smoke run (host events only)
    python bench/profile_step.py --phase collect               # one collection step instead

``device_us_per_update`` sums kernel durations; ``device_busy_us_per_update`` is the union of
their intervals on each device, averaged over the devices (less than the sum when kernels run
side by side under concurrent CUDA graphs), and the wall time minus it is time the GPU sat
idle. With ``--phase collect`` every ``*_per_update`` figure is per collection step of all
envs (``per`` says which) and ``--updates`` counts collection chunks. Kernels inside a loop that
XLA captured whole as a CUDA graph (``train.gpu_graphs`` concurrent) do not appear in the trace:
profile with ``--set train.gpu_graphs=xla`` to see them.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import glob
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import train as train_bench

from jdqn.config import apply_overrides, config_from_dict, load_config, to_dict
from jdqn.train import xla_options

REPO = Path(__file__).resolve().parents[1]

_KINDS = (("gemm", ("gemm", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "wgmma", "dot")),
          ("reduce", ("reduce", "reduction")),
          ("copy", ("memcpy", "memset", "copy", "transpose", "concatenate", "dynamic_update")),
          ("scatter/gather", ("scatter", "gather", "sort", "searchsorted")),
          ("fusion", ("fusion", "loop_", "input_")))


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in _KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def _load_trace(log_dir: str) -> dict:
    files = sorted(glob.glob(os.path.join(log_dir, "**", "*.json.gz"), recursive=True))
    if not files:
        raise SystemExit(f"no trace written under {log_dir}")
    with gzip.open(files[-1], "rt") as fh:
        return json.load(fh)


def _scope(op_name: str) -> str:
    """A coarse place in the program from an HLO op_name (``jit(updates)/while/body/...``)."""
    tail = op_name.split("while/body/")[-1]
    bwd = "bwd " if "transpose(" in tail else ""
    for key, label in (("/iqn/", "iqn"), ("/moe/", "moe"), ("/grn_", "grn"),
                       ("/selection/", "selection"), ("/proj/", "proj"), ("/c51/", "c51 heads"),
                       ("BranchingQNetwork", "net other"), ("optax", "optimizer"),
                       ("per.", "replay"), ("replay", "replay")):
        if key in tail:
            return bwd + label
    return bwd + tail.split("/")[-1][:24] if tail else "?"


def _hlo_key(name: str) -> str:
    """An HLO instruction or kernel name as both the dump and the trace can be matched on
    (``custom-call.18`` and ``custom_call_18`` alike)."""
    return name.replace(".", "_").replace("-", "_")


def hlo_op_names(hlo_dir: str, program: str = "updates") -> dict:
    """Kernel name → HLO op_name metadata, from the dumped optimised HLO of ``jit(program)``
    (``updates`` or ``collect``)."""
    import re

    files = sorted(glob.glob(os.path.join(hlo_dir, f"*jit_{program}*after_optimizations.txt")))
    if not files:
        return {}
    names = {}
    pat = re.compile(r'^\s+%?([\w.\-]+) = .*?op_name="([^"]+)"', re.MULTILINE)
    for m in pat.finditer(Path(files[-1]).read_text()):
        names[_hlo_key(m.group(1))] = m.group(2)
    return names


def summarise(trace: dict, n_updates: int, top: int, hlo_dir: str = "",
              program: str = "updates") -> dict:
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pname = {e["pid"]: e.get("args", {}).get("name", "")
             for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    per_proc: dict = collections.Counter()
    dev_events = []
    for e in events:
        if e.get("ph") != "X":
            continue
        proc = pname.get(e.get("pid"), str(e.get("pid")))
        per_proc[proc] += float(e.get("dur", 0.0))
        if "/device:" in proc and "host" not in proc.lower():
            dev_events.append(e)
    # one row per (kernel, HLO instruction): a library kernel (a cuBLAS GEMM) that several
    # instructions launch gets a row for each, so each can be attributed to its own scope
    by_name: dict = collections.defaultdict(lambda: [0, 0.0, ""])
    for e in dev_events:
        args = e.get("args", {})
        hlo_op = str(args.get("hlo_op", ""))
        rec = by_name[(e["name"], hlo_op)]
        rec[0] += 1
        rec[1] += float(e.get("dur", 0.0))
        rec[2] = rec[2] or str(hlo_op or args.get("long_name", ""))[:160]
    kinds: dict = collections.Counter()
    for (name, _), (_, us, _) in by_name.items():
        kinds[kind_of(name)] += us
    total = sum(us for _, us, _ in by_name.values())
    busy_per_dev: dict = collections.Counter()  # per device: union of [ts, ts + dur)
    ends: dict = {}
    for e in sorted(dev_events, key=lambda e: float(e["ts"])):
        t0, t1 = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
        end = ends.get(e["pid"], float("-inf"))
        busy_per_dev[e["pid"]] += max(0.0, t1 - max(t0, end))
        ends[e["pid"]] = max(end, t1)
    busy = sum(busy_per_dev.values()) / max(1, len(busy_per_dev))  # mean over devices
    ops = hlo_op_names(hlo_dir, program) if hlo_dir else {}
    scopes: dict = collections.Counter()
    for (name, hlo_op), rec in by_name.items():
        op = next((ops[_hlo_key(k)] for k in (hlo_op, name) if k and _hlo_key(k) in ops), "")
        rec[2] = op or rec[2]
        scopes[_scope(op) if op else kind_of(name) + " (unattributed)"] += rec[1]
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "processes_us": {k: round(v, 1) for k, v in per_proc.most_common(12)},
        "device_kernels_per_update": round(sum(c for c, _, _ in by_name.values()) / n_updates, 1),
        "device_us_per_update": round(total / n_updates, 1),
        "device_busy_us_per_update": round(busy / n_updates, 1),
        "kinds_us_per_update": {k: round(v / n_updates, 1) for k, v in kinds.most_common()},
        "scopes_us_per_update": {k: round(v / n_updates, 1) for k, v in scopes.most_common()},
        "top": [{"name": n[:90], "kind": kind_of(n), "calls_per_update": round(c / n_updates, 2),
                 "us_per_update": round(us / n_updates, 1), "hlo_op": h,
                 "op": op.split("while/body/")[-1][:150]}
                for (n, h), (c, us, op) in rows],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "gpu.toml"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--updates", type=int, default=20)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--trace-dir", default="")
    ap.add_argument("--hlo-dir", default="", help="XLA dump folder (--xla_dump_to) to attribute "
                    "kernels to the model's scopes")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--phase", choices=("update", "collect"), default="update",
                    help="profile the update loop (per update) or the collection loop (per "
                    "collection step of all env.n_envs envs)")
    args = ap.parse_args()
    sets = [f"model.matmul_dtype={args.dtype}", "data.cache_dir=''",
            "data.synthetic.n_bars=200000"]
    if args.quick:
        sets += ["env.n_envs=256", "env.episode_length=256", "train.replay_capacity=100000",
                 "train.min_replay=2000", "train.collect_steps=8"]
    cfg = load_config(args.config, sets + args.sets)
    cfg = config_from_dict(apply_overrides(to_dict(cfg), [f"train.batch_size={args.batch}"]))
    if args.phase == "update":
        updates, one = train_bench.filled_update_loop(cfg, args.updates)
        n_steps = args.updates
    else:
        updates, one = train_bench.collect_loop(cfg, args.updates)
        n_steps = args.updates * cfg.train.collect_steps
    jax.block_until_ready(updates(one))
    t = time.perf_counter()
    jax.block_until_ready(updates(one))
    wall = (time.perf_counter() - t) / n_steps
    log_dir = args.trace_dir or tempfile.mkdtemp(prefix="jdqn_trace_")
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        jax.block_until_ready(updates(one))
    graphs = xla_options.resolve(cfg.train.gpu_graphs)
    out = {"bench": "profile_step", "phase": args.phase,
           "per": "update" if args.phase == "update" else "collection step",
           "batch": args.batch, "n_envs": cfg.env.n_envs, "matmul_dtype": args.dtype,
           "sets": args.sets, "gpu_graphs": graphs,
           "compiler_options": xla_options.compiler_options(graphs),
           "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "wall_us_per_update": round(1e6 * wall, 1),
           **summarise(_load_trace(log_dir), n_steps, args.top, args.hlo_dir,
                       "updates" if args.phase == "update" else "collect")}
    dev = jax.devices()[0]
    out.update(device=getattr(dev, "device_kind", str(dev)), jax=jax.__version__,
               date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
