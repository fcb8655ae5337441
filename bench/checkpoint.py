"""Checkpoint cost at a config's sizes: save (async: the blocking part, then the write), the
content checksums alone, and restore (read + layout check + checksum verification).

Prints one JSON object. The state is the trainer's own fold state (``jdqn.train.job``) with its
replay's storage and priorities at full capacity and filled with random bits (a fresh replay is
all zeros, which orbax's compression shrinks to nothing; a trained one does not compress), on
the default device (the first of ``parallel.n_devices`` when data
parallel: sharded states are checksummed the same way, this bench keeps to one device).

    python bench/checkpoint.py                          # configs/gpu.toml sizes
    python bench/checkpoint.py --config configs/quickstart.toml --out r.json

Timings are the best of ``--repeats`` after one warm-up (which compiles the checksum program);
``save_blocking_s`` is what the training loop waits for (device→host copy and checksums), the
write itself goes on in orbax's background thread (``save_wait_s``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
from timing import best_of, emit

from jdqn.config import load_config
from jdqn.train import checkpoint as ckpt_lib
from jdqn.train import job as job_lib
from jdqn.train.state import seed_keys

REPO = Path(__file__).resolve().parents[1]


def _randomised(replay):
    """The replay with every storage and priority array filled with random bits (slot indices
    and bar indices kept in range is not needed: the bench only saves and restores them)."""
    leaves, treedef = jax.tree.flatten(replay)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    out = []
    for k, x in zip(keys, leaves, strict=True):
        if x.ndim >= 1 and x.size >= 1024:  # storage and priorities, not counters
            bits = jax.random.bits(k, x.shape, jnp.uint8 if x.dtype == jnp.bool_ else
                                   jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
            x = (bits & 1).astype(bool) if x.dtype == jnp.bool_ else \
                jax.lax.bitcast_convert_type(bits, x.dtype)
            if jnp.issubdtype(x.dtype, jnp.floating):  # finite values, as a real replay holds
                x = jnp.where(jnp.isfinite(x), x, 0)
        out.append(x)
    return jax.tree.unflatten(treedef, out)


def _disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "gpu.toml"))
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="config override key=value (repeatable)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="", help="where to write (default: a temporary folder)")
    ap.add_argument("--group-leaf-words", type=int, default=None,
                    help="on the CPU, checksum leaves of up to this many words in one pass "
                         "(default: the library's; 0 = every leaf alone, the program before "
                         "2026-12-01, which other backends always run)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if a.group_leaf_words is not None:
        if a.group_leaf_words < 0:
            ap.error(f"--group-leaf-words must be ≥ 0, got {a.group_leaf_words}")
        ckpt_lib._GROUP_LEAF_WORDS = a.group_leaf_words

    sets = ["parallel.n_devices=1", *a.sets]
    cfg = load_config(a.config, sets)
    p = job_lib.prepare(cfg)
    env_params = job_lib.fold_env_params(cfg, p, 0)
    state = job_lib._fold_state(p, None, env_params, 0, seed_keys(cfg.train.seeds))
    state = state.replace(replay=_randomised(state.replay))
    jax.block_until_ready(state)
    n_bytes = sum(int(np.dtype(x.dtype).itemsize) * int(np.prod(x.shape))
                  for x in jax.tree.leaves(ckpt_lib._encode_keys(state)))
    encoded = ckpt_lib._encode_keys(state)

    root = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="jdqn_ckbench_"))
    res: dict = {"bench": "checkpoint", "config": a.config, "sets": sets,
                 "state_bytes": n_bytes, "n_leaves": len(jax.tree.leaves(state)),
                 "replay_capacity": cfg.train.replay_capacity,
                 "group_leaf_words": ckpt_lib._GROUP_LEAF_WORDS,
                 "checksum_groups": (len(ckpt_lib._groups(jax.tree.leaves(encoded))[0])
                                     if jax.default_backend() == "cpu" else 0)}
    try:
        ckpt_lib.leaf_checksums(encoded)  # compile
        res["checksums_device_s"] = best_of(lambda: ckpt_lib.leaf_checksums(encoded), a.repeats)
        host = jax.device_get(encoded)
        res["checksums_host_numpy_s"] = best_of(
            lambda: ckpt_lib.leaf_checksums(host, on_device=False), a.repeats)
        assert ckpt_lib.leaf_checksums(host, on_device=False) == ckpt_lib.leaf_checksums(encoded)

        blocking, waits, restores = [], [], []
        with ckpt_lib.Checkpointer(root / "ck", keep_best=1, keep_latest=a.repeats + 1) as ck:
            for step in range(a.repeats + 1):
                t = time.perf_counter()
                ck.save(step, state, {"val_sharpe": 0.0, "fold": 0})
                t1 = time.perf_counter()
                ck.wait()
                t2 = time.perf_counter()
                _, _ = ck.restore(step, state)
                t3 = time.perf_counter()
                if step:  # the first save/restore warms up
                    blocking.append(t1 - t)
                    waits.append(t2 - t1)
                    restores.append(t3 - t2)
            disk = _disk_bytes(root / "ck" / str(a.repeats))
        res.update(save_blocking_s=min(blocking), save_wait_s=min(waits),
                   restore_verified_s=min(restores), checkpoint_disk_bytes=disk)
    finally:
        if not a.dir:
            shutil.rmtree(root, ignore_errors=True)
    emit(res, a.out)


if __name__ == "__main__":
    main()
