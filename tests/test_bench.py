"""The benchmarks run and print what their committed results claim to contain (CPU smoke runs;
the timings themselves are not asserted — benchmarks measure, tests check)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_train_bench_reports_updates_and_xla_cost(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "train.py"), "--quick", "--batches", "64",
         "--updates", "2", "--repeats", "1", "--skip-epoch", "--skip-collect",
         "--pallas-kernels", "projection,iqn", "--out", str(out)],
        check=False, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert printed == json.loads(out.read_text())  # --out holds the same, complete record
    assert printed["complete"] and printed["pallas_kernels"] == ["iqn", "projection"]
    (row,) = printed["updates"]
    assert row["batch"] == 64 and row["ms_per_update"] > 0
    # XLA's cost model of one train step (on the CPU every dot is an op it counts; on the GPU
    # cuBLAS calls are not): at least the useful matmul FLOPs of the batch, and
    # at least the bytes of its observations.
    from jdqn.config import ModelConfig
    from jdqn.networks.model import train_flops_per_sample

    assert row["xla_flops"] >= 0.5 * 64 * train_flops_per_sample(ModelConfig(), 128)
    assert row["xla_bytes_accessed"] > 2 * 64 * 128 * 4
