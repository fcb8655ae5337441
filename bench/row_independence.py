"""Row independence of the acting network on the current device.

A backtest runs its parallel windows (``eval.n_windows``; 64 in ``configs/gpu.toml``) as the
network's batch rows, and collection runs its envs the same way: each row is another stretch of
time. So one row's decision must not depend on any other row's observation — a later window's
bars reaching an earlier window's decision would be lookahead. This perturbs rows ``1 … N−1`` of
an observation batch and requires row 0's greedy action, sizing aux (``q_gap``, ``q_var``) and
every branch's expected Q to stay **bitwise** equal, while the other rows' Q must change. Run on
the GPU it covers the compiled kernels (Pallas under ``model.impl = "auto"``) and XLA's GEMM
tilings at the batch sizes given; prints one JSON object.

    python bench/row_independence.py --config configs/gpu.toml --rows 64,16384
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np

from jdqn.config import Config, load_config, n_base_features
from jdqn.data import resolve_state_width
from jdqn.train.epoch import greedy_policy
from jdqn.train.state import Learner


def check(cfg: Config, rows: int, seed: int = 0, flow_idx: tuple[int, ...] = (0, 1)
          ) -> dict[str, Any]:
    """One batch size: ``{"rows", "row0_unchanged", "others_changed"}`` (see the module doc)."""
    width = resolve_state_width(n_base_features(cfg.features), cfg.features.state_width)
    learner = Learner.create(cfg, flow_idx, width)
    k_obs, k_init, k_new = jax.random.split(jax.random.key(seed), 3)
    obs = jax.random.normal(k_obs, (rows, width))
    params = learner.net.init(k_init, obs)

    @jax.jit
    def act(p, o):
        action, aux = greedy_policy(learner, p, o)
        return action, aux, learner.net.apply(p, o, grad_free=True).q

    a0, x0, q0 = jax.device_get(act(params, obs))
    other = obs.at[1:].set(3.0 * jax.random.normal(k_new, (rows - 1, width)))
    a1, x1, q1 = jax.device_get(act(params, other))
    same = (np.array_equal(a0[0], a1[0]) and np.array_equal(x0.q_gap[0], x1.q_gap[0])
            and np.array_equal(x0.q_var[0], x1.q_var[0])
            and all(np.array_equal(u[0], v[0]) for u, v in zip(q0, q1, strict=True)))
    changed = any(not np.array_equal(u[1:], v[1:]) for u, v in zip(q0, q1, strict=True))
    return {"rows": rows, "row0_unchanged": bool(same), "others_changed": bool(changed)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/gpu.toml")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--rows", default="64,16384", help="comma-separated batch sizes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    cfg = load_config(args.config, ["data.cache_dir=''", *args.sets])
    results = [check(cfg, int(r), args.seed) for r in args.rows.split(",")]
    dev = jax.devices()[0]
    out = {"bench": "row_independence", "config": args.config, "sets": args.sets,
           "impl": cfg.model.impl, "matmul_dtype": cfg.model.matmul_dtype, "results": results,
           "all_independent": all(r["row0_unchanged"] and r["others_changed"]
                                  for r in results),
           "device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
           "jax": jax.__version__, "python": platform.python_version(),
           "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
    text = json.dumps(out)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if not out["all_independent"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
