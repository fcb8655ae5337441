"""Backtest cost at a config's sizes: the agent's greedy policy rolled over fold 0's validation
window and the test window, as the trainer runs them, for each scan chunk length.

Prints one JSON object. The rollout runs its steps in calls of ``SCAN_CHUNK`` steps
(``jdqn.evaluate.backtest``) so that periods of different lengths share one compiled program;
``--chunks`` compares chunk lengths, ``0`` meaning the whole period in one call (one program per
period length, the behaviour before 2026-12-01). Per chunk length and window: the first call
(compilation included, as a run pays it) and the best of ``--repeats`` later calls, with the
number of programs compiled for the two windows together; every setting's records must be
bitwise those of the first setting (checked; ``same_records``).

    python bench/backtest.py                                  # configs/gpu.toml sizes
    python bench/backtest.py --config configs/quickstart.toml --out r.json

The policy's parameters are a fresh initialisation (the cost does not depend on their values).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from timing import best_of, emit

from jdqn.config import load_config
from jdqn.evaluate import backtest as bt
from jdqn.train import job as job_lib
from jdqn.train.state import seed_keys

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "gpu.toml"))
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="config override key=value (repeatable)")
    ap.add_argument("--chunks", default="256,0",
                    help="comma-separated scan chunk lengths; 0 = the whole period in one call")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    chunks = [int(c) for c in a.chunks.split(",") if c.strip()]
    if not chunks or any(c < 0 for c in chunks):
        ap.error(f"--chunks must be non-negative integers, got {a.chunks!r}")

    sets = ["parallel.n_devices=1", *a.sets]
    cfg = load_config(a.config, sets)
    p = job_lib.prepare(cfg)
    fold = p.plan.folds[0]
    env_params = job_lib.fold_env_params(cfg, p, 0)
    state = job_lib._fold_state(p, None, env_params, 0, seed_keys(cfg.train.seeds))
    params = job_lib.seed_slice(state.params, 0)
    windows = {"validation": fold.val, "test": p.plan.test}

    res: dict = {"bench": "backtest", "config": a.config, "sets": sets,
                 "n_windows": cfg.eval.n_windows, "stride": cfg.eval.stride,
                 "periods": {k: list(v) for k, v in windows.items()}, "rows": []}
    first = None
    same = True
    for chunk in chunks:
        bt.SCAN_CHUNK = chunk if chunk else 1 << 40
        bt._scan.clear_cache()
        row: dict = {"chunk": chunk}
        results = {}
        for name, (lo, hi) in windows.items():
            def run(lo=lo, hi=hi):
                return job_lib.evaluate_params(cfg, p, env_params, params, lo, hi)

            t = time.perf_counter()
            results[name] = run()
            row[f"{name}_first_call_s"] = time.perf_counter() - t
            row[f"{name}_s"] = best_of(run, a.repeats)
            m = hi - lo - 1
            row[f"{name}_steps"] = -(-m // max(1, min(cfg.eval.n_windows, m)))
        row["programs_compiled"] = bt._scan._cache_size()
        res["rows"].append(row)
        if first is None:
            first = results
        else:
            for name, r in results.items():
                for f in dataclasses.fields(r):
                    same &= bool(np.array_equal(getattr(r, f.name), getattr(first[name], f.name)))
    res["same_records"] = same
    emit(res, a.out)
    if not same:
        sys.exit("records differ between chunk lengths")


if __name__ == "__main__":
    main()
