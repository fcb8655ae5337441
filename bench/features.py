"""Benchmark: ticks → bars and bars → features on one CPU core. Prints one JSON object.

    python bench/features.py [--ticks 5000000] [--bars 1000000] [--repeat 3]

Ticks: the real ES ticks (../shared/data/es_ticks, else the sample shipped in the package),
replicated with shifted timestamps to at least ``--ticks`` ticks, then aggregated to 1-min time
bars (tick rule included) and to volume bars. CSV parsing is not timed. Features: the synthetic
market with ``--bars`` bars, default feature config. Best of ``--repeat`` runs.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")  # one core, as the target says

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import numpy as np
from timing import best_of

from jdqn.config import ColumnMap, DataConfig, FeaturesConfig, SyntheticConfig
from jdqn.data import build_features, generate_synthetic, resolve_path, ticks_to_bars
from jdqn.data.bars import NS
from jdqn.data.tables import read_ticks

ES_SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "es_ticks" / \
    "ES_ticks_2013-09-01_03.csv.gz"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ticks", type=int, default=5_000_000)
    ap.add_argument("--bars", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        except OSError:
            pass

    src = ES_SHARED if ES_SHARED.is_file() else resolve_path("builtin:es_ticks")
    cfg = DataConfig(source="ticks", path=str(src), timezone="America/Chicago",
                     columns=ColumnMap(timestamp="DateTime", price="Price", size="Volume"))
    ts0, price0, size0, _ = read_ticks(src, cfg)
    reps = -(-args.ticks // ts0.shape[0])
    span = int(ts0[-1] - ts0[0]) + 60 * NS
    ts = np.concatenate([ts0 + k * span for k in range(reps)])
    price, size = np.tile(price0, reps), np.tile(size0, reps)
    n_ticks = ts.shape[0]
    bars = ticks_to_bars(ts, price, size, bar_ns=60 * NS)
    t_time = best_of(lambda: ticks_to_bars(ts, price, size, bar_ns=60 * NS), args.repeat)
    t_vol = best_of(lambda: ticks_to_bars(ts, price, size, bar_type="volume", threshold=1000.0),
                  args.repeat)

    t = time.perf_counter()
    syn = generate_synthetic(SyntheticConfig(n_bars=args.bars, seed=0))
    t_syn = time.perf_counter() - t
    fcfg = FeaturesConfig()
    feats = build_features(syn, fcfg)
    t_feat = best_of(lambda: build_features(syn, fcfg), args.repeat)

    print(json.dumps({
        "ticks_source": src.name,
        "ticks": n_ticks,
        "time_bars_1min": len(bars),
        "ticks_per_s_time_bars": round(n_ticks / t_time),
        "ticks_per_s_volume_bars": round(n_ticks / t_vol),
        "bars": len(syn),
        "features": feats.n_features,
        "bars_per_s_features": round(len(syn) / t_feat),
        "bars_per_s_synthetic_generation": round(len(syn) / t_syn),
        "seconds": {"time_bars": round(t_time, 4), "volume_bars": round(t_vol, 4),
                    "features": round(t_feat, 4), "synthetic": round(t_syn, 4)},
        "repeat": args.repeat,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "cpu": _cpu(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }))


if __name__ == "__main__":
    main()
