"""Run-to-run determinism of the training epoch on the current device.

Runs ``--epochs`` jitted epochs (collection, PER, updates — the trainer's own ``make_epoch_fn``)
twice from the same seed in one process (the second run with any ``--second-set`` overrides)
and compares every leaf of the final ``TrainState`` bitwise; prints one JSON object with the
state's sha256 and the XLA flags it ran under. Within one process the GPU program is deterministic without flags. Across processes compare the
``state_sha256`` of two runs: a fresh compilation may autotune other kernels, so pin them as
the CLI's ``--autotune-file`` does (first run records, second loads) or use XLA's determinism
flags (docs/training.md, "Determinism"):

    XLA_FLAGS=--xla_gpu_dump_autotune_results_to=at.textproto python bench/determinism.py --config configs/gpu.toml
    XLA_FLAGS=--xla_gpu_load_autotune_results_from=at.textproto python bench/determinism.py --config configs/gpu.toml
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from jdqn.config import load_config
from jdqn.train import job as job_lib
from jdqn.train import parallel, xla_options
from jdqn.train.epoch import make_epoch_fn
from jdqn.train.state import seed_keys


def digest(tree) -> tuple[str, list[str]]:
    h = hashlib.sha256()
    names = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        h.update(np.asarray(x).tobytes())
        names.append(jax.tree_util.keystr(path))
    return h.hexdigest(), names


def run(cfg, epochs: int):
    p = job_lib.prepare(cfg)
    env_params = job_lib.fold_env_params(cfg, p, 0)
    state = job_lib._fold_state(p, None, env_params, 0, seed_keys(cfg.train.seeds))
    fn = make_epoch_fn(p.learner)
    for _ in range(epochs):
        state, m = fn(state, env_params, jnp.asarray(0, jnp.int32))
    state = jax.device_get(state)
    return state, float(np.mean(m["update"]["loss_total"]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/quickstart.toml")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--second-set", dest="second_sets", action="append", default=[],
                    help="override for the second run only: checks that a setting leaves the "
                         "results unchanged, e.g. --second-set train.gpu_graphs=xla")
    args = ap.parse_args()
    cfg = load_config(args.config, ["data.cache_dir=''", *args.sets])
    cfg2 = load_config(args.config, ["data.cache_dir=''", *args.sets, *args.second_sets])
    (s1, l1), (s2, l2) = run(cfg, args.epochs), run(cfg2, args.epochs)
    d1, names = digest(s1)
    d2, _ = digest(s2)
    differing = [n for n, a, b in zip(names, jax.tree.leaves(s1), jax.tree.leaves(s2),
                                      strict=True)
                 if not np.array_equal(np.asarray(jax.random.key_data(a) if jnp.issubdtype(
                     a.dtype, jax.dtypes.prng_key) else a), np.asarray(jax.random.key_data(b)
                     if jnp.issubdtype(b.dtype, jax.dtypes.prng_key) else b))]
    dev = jax.devices()[0]
    print(json.dumps({
        "bench": "determinism", "config": args.config, "sets": args.sets,
        "second_sets": args.second_sets, "gpu_graphs": [cfg.train.gpu_graphs, cfg2.train.gpu_graphs],
        # what each run's epoch compiled with ("auto" resolved)
        "gpu_graphs_resolved": [xla_options.resolve(c.train.gpu_graphs) for c in (cfg, cfg2)],
        "n_seeds": len(cfg.train.seeds), "n_devices": parallel.resolve_n_devices(cfg),
        "epochs": args.epochs,
        "bitwise_identical": d1 == d2, "state_sha256": [d1, d2], "differing_leaves": differing[:20],
        "n_leaves": len(names), "final_loss": [l1, l2],
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "device": getattr(dev, "device_kind", ""),
        "platform": dev.platform, "jax": jax.__version__,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}))


if __name__ == "__main__":
    main()
