"""A/B timing across code variants in one machine session: rounds alternate, one JSON out.

A variant is a directory holding a checkout of the project — its own ``jdqn/`` and ``bench/``
(``git worktree add ../base aded933``, or a copy of the working tree) — with, optionally,
environment settings of its own (``XLA_FLAGS``, say). Each round runs every variant once, in
the order given (A B A B …), so a drift of the machine (clocks, temperature, a neighbour) falls
on all of them; each run is a fresh process running the variant's own script
(``bench/train.py`` by default: the update at B = 16384), with that directory first on the
import path. The harness prints one JSON object and, with ``--out``, rewrites that file after
every run, so a session cut short keeps what it measured — and a machine that returns only a
few files returns all the runs in one:

* ``runs``: per run the variant, the round, its wall time, the value read at ``--metric``
  (a dotted path into the script's last JSON line; numbers index lists) and the script's whole
  record (or its exit status and the end of its stderr, if it failed);
* ``summary``: per variant the values in run order, the best (lowest) and the mean;
* ``variants``: per variant its directory, extra environment and, where the directory is a git
  checkout, its commit and whether it had uncommitted changes.

    python bench/ab.py --variant base=../base --variant new=. --rounds 2 --out ab.json
    python bench/ab.py --variant base=. --variant flag=. \\
        --env 'flag:XLA_FLAGS=--xla_gpu_enable_command_buffer=' -- --dtype bfloat16

For a remote machine that receives only the working tree, keep the base inside it, untracked:
``mkdir -p .ab/base && git archive aded933 jdqn bench configs | tar -x -C .ab/base`` (only
those three folders, so the tests and the linter do not pick up a second copy; remove it
before committing).

Arguments after ``--`` are added to the script's (by default ``--batches 16384 --skip-epoch
--skip-collect --fill batch --updates 100 --repeats 5``; ``--script-args`` replaces those).
The harness does not import JAX, so it holds no device memory while the variants run.
Compilation dominates a run (~65 s of it on the H200 for the default update); with
``JAX_COMPILATION_CACHE_DIR`` set in the harness's environment, every run after a variant's
first loads its programs from the cache (14–17 s per run, measured 2026-12-02), so more rounds
fit in one call.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_ARGS = ("--batches 16384 --skip-epoch --skip-collect --fill batch --updates 100 "
                "--repeats 5")


def parse_variants(specs: list[str], envs: list[str]) -> dict[str, dict[str, Any]]:
    """``NAME=DIR`` specs and ``NAME:KEY=VALUE`` environment settings → ``{name: {"dir",
    "env"}}`` in the order given. Raises ``SystemExit`` naming a bad spec."""
    variants: dict[str, dict[str, Any]] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--variant {spec!r}: expected NAME=DIR")
        if name in variants:
            raise SystemExit(f"--variant {spec!r}: the name {name!r} is given twice")
        d = Path(path).resolve()
        if not d.is_dir():
            raise SystemExit(f"--variant {spec!r}: {d} is not a directory")
        variants[name] = {"dir": str(d), "env": {}}
    for spec in envs:
        name, sep, setting = spec.partition(":")
        key, eq, value = setting.partition("=")
        if not sep or not eq or not key:
            raise SystemExit(f"--env {spec!r}: expected NAME:KEY=VALUE")
        if name not in variants:
            raise SystemExit(f"--env {spec!r}: no variant named {name!r}")
        variants[name]["env"][key] = value
    return variants


def git_identity(d: str) -> dict[str, Any]:
    """The commit of the checkout at ``d`` and whether its tracked files have changes; both
    None where ``d`` is not the top of a git checkout (a plain copy, e.g. a ``git archive``
    unpacked inside another checkout, which would otherwise report that checkout's commit)."""
    def git(*args: str) -> str | None:
        try:
            p = subprocess.run(["git", "-C", d, *args], capture_output=True, text=True,
                               timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or os.path.realpath(top) != os.path.realpath(d):
        return {"commit": None, "dirty": None}
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def read_metric(record: Any, path: str) -> float:
    """The number at a dotted ``path`` in ``record`` (``updates.0.ms_per_update``)."""
    value = record
    for part in path.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return float(value)


def run_once(variant: dict[str, Any], script: str, args: list[str], timeout: float,
             metric: str) -> dict[str, Any]:
    """One run of ``script`` (relative to the variant's directory) in a fresh process."""
    d = variant["dir"]
    env = {**os.environ, **variant["env"]}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [d, os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, str(Path(d) / script), *args], cwd=d, env=env,
                           capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"seconds": round(time.perf_counter() - t0, 1), "value": None,
                "error": f"timed out after {timeout:g} s"}
    out: dict[str, Any] = {"seconds": round(time.perf_counter() - t0, 1), "value": None}
    lines = [ln for ln in p.stdout.splitlines() if ln.strip().startswith("{")]
    if p.returncode != 0 or not lines:
        out.update(returncode=p.returncode, error=(p.stderr or p.stdout)[-2000:])
        return out
    try:
        record = json.loads(lines[-1])
        out["value"] = read_metric(record, metric)
    except (ValueError, KeyError, IndexError, TypeError) as e:
        out.update(error=f"no number at --metric {metric!r} in the script's JSON: {e!r}")
        return out
    out["record"] = record
    return out


def summarise(runs: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    summary = {}
    for name in names:
        values = [r["value"] for r in runs if r["variant"] == name and r["value"] is not None]
        summary[name] = {"values": values, "best": min(values) if values else None,
                         "mean": sum(values) / len(values) if values else None}
    return summary


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", action="append", default=[], required=True,
                    help="NAME=DIR: a checkout to time (repeat; runs go in this order)")
    ap.add_argument("--env", action="append", default=[],
                    help="NAME:KEY=VALUE: an environment setting for one variant's runs")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--script", default="bench/train.py",
                    help="the script each variant runs, relative to its directory")
    ap.add_argument("--script-args", default=DEFAULT_ARGS,
                    help="the script's arguments (those after -- are added)")
    ap.add_argument("--metric", default="updates.0.ms_per_update",
                    help="dotted path to the timed number in the script's JSON")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    ap.add_argument("--out", default="", help="also write the JSON here after every run")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: expected at least 1")
    variants = parse_variants(args.variant, args.env)
    for v in variants.values():
        if not (Path(v["dir"]) / args.script).is_file():
            raise SystemExit(f"{args.script} not found in the variant directory {v['dir']}")
        v.update(git_identity(v["dir"]))
    script_args = shlex.split(args.script_args) + extra
    result: dict[str, Any] = {
        "bench": "ab", "script": args.script, "script_args": script_args,
        "metric": args.metric, "rounds": args.rounds, "variants": variants, "runs": [],
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "complete": False}

    def write() -> None:
        result["summary"] = summarise(result["runs"], list(variants))
        if args.out:
            tmp = Path(args.out + ".tmp")
            tmp.write_text(json.dumps(result) + "\n")
            tmp.replace(args.out)

    for rnd in range(args.rounds):
        for name, v in variants.items():
            run = run_once(v, args.script, script_args, args.timeout, args.metric)
            result["runs"].append({"variant": name, "round": rnd, **run})
            for key in ("device", "jax"):  # from the first record that has them
                rec = run.get("record", {})
                if key not in result and isinstance(rec, dict) and key in rec:
                    result[key] = rec[key]
            print(f"{name} round {rnd}: {run['value']} ({run['seconds']} s)"
                  + (f" — {run['error'][-300:]}" if "error" in run else ""), file=sys.stderr)
            write()
    result["complete"] = True
    write()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
