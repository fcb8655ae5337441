"""XLA flags against the update: ``bench/train.py`` run once per flag setting, in subprocesses.

Prints one JSON object. Each setting is a separate process with ``XLA_FLAGS`` set to it (XLA
reads the variable once, at backend start), timing the update loop at one batch size with
``bench/train.py --skip-collect --skip-epoch``; the unflagged base runs first and again last, so
the drift within the machine session is on record beside the differences. A setting that fails
to compile, crashes or outruns ``--timeout`` is kept with its return code and the tail of its
output, not dropped.

    python bench/xla_flags.py --flag=--xla_gpu_enable_pdl=true --out sweep.json
    python bench/xla_flags.py --flag="--xla_a=1 --xla_b=2" --flag=--xla_c=3 --dtype bfloat16

(``--flag=VALUE`` with the ``=``: a value that starts with ``--`` is otherwise read as an option.)

A flag from the user's own ``XLA_FLAGS`` is kept in every run (the setting is appended to it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_setting(flags: str, args: argparse.Namespace) -> dict:
    """One ``bench/train.py`` process with ``XLA_FLAGS`` extended by ``flags``."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), flags) if f)
    with tempfile.TemporaryDirectory() as tmp:
        out_file = Path(tmp) / "train.json"
        cmd = [sys.executable, str(REPO / "bench" / "train.py"), "--config", args.config,
               "--dtype", args.dtype, "--batches", str(args.batch), "--updates", str(args.updates),
               "--repeats", str(args.repeats), "--skip-collect", "--skip-epoch",
               "--out", str(out_file)]
        cmd += [a for s in args.sets for a in ("--set", s)]
        if args.quick:
            cmd.append("--quick")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, check=False, env=env, capture_output=True,
                                  text=True, timeout=args.timeout)
            rc, log = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc = "timeout"
            log = "".join(x.decode() if isinstance(x, bytes) else (x or "")
                          for x in (e.stdout, e.stderr))
        row: dict = {"flags": flags, "rc": rc, "wall_s": round(time.perf_counter() - t0, 1)}
        if out_file.exists():
            res = json.loads(out_file.read_text())
            ups = res.get("updates", [])
            if ups:
                row["ms_per_update"] = ups[0]["ms_per_update"]
            for k in ("device", "jax", "xla_flags", "gpu_graphs_resolved", "compiler_options"):
                row[k] = res.get(k)
        if rc != 0 or "ms_per_update" not in row:
            row["log_tail"] = log[-1500:]
        return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flag", dest="flags", action="append", default=[],
                    help="one setting: an XLA_FLAGS string (several flags in one setting are "
                    "space-separated); repeat for more settings")
    ap.add_argument("--config", default=str(REPO / "configs" / "gpu.toml"))
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--updates", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="config override passed to bench/train.py")
    ap.add_argument("--timeout", type=float, default=240.0,
                    help="seconds one setting may take, compilation included")
    ap.add_argument("--quick", action="store_true",
                    help="bench/train.py's small sizes (CPU smoke run; the flags still apply)")
    ap.add_argument("--out", default="", help="also write the JSON here after every setting")
    args = ap.parse_args()
    if not args.flags:
        ap.error("give at least one --flag setting to compare with the base")
    for f in args.flags:
        bad = [t for t in f.split() if not t.startswith("--xla_")]
        if bad:
            ap.error(f"--flag {f!r}: {bad[0]!r} is not an XLA flag (--xla_...=value)")
    out = {"bench": "xla_flags", "config": Path(args.config).name, "dtype": args.dtype,
           "batch": args.batch, "updates": args.updates, "repeats": args.repeats,
           "sets": args.sets, "quick": args.quick,
           "base_xla_flags": os.environ.get("XLA_FLAGS", ""),
           "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "complete": False,
           "runs": []}

    def checkpoint() -> None:
        if args.out:
            tmp = Path(args.out + ".tmp")
            tmp.write_text(json.dumps(out, indent=1) + "\n")
            tmp.replace(args.out)

    for flags in ["", *args.flags, ""]:
        row = run_setting(flags, args)
        out["runs"].append(row)
        print(json.dumps({k: row.get(k) for k in ("flags", "rc", "wall_s", "ms_per_update")}),
              file=sys.stderr, flush=True)
        checkpoint()
    base = [r["ms_per_update"] for r in out["runs"] if not r["flags"] and "ms_per_update" in r]
    if base:
        out["base_ms"] = [min(base), max(base)]
        for r in out["runs"]:
            if r["flags"] and "ms_per_update" in r:
                r["vs_base_best"] = round(r["ms_per_update"] / min(base), 4)
    out["complete"] = True
    checkpoint()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
