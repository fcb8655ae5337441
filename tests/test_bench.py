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
def test_train_bench_reports_updates_and_its_kernel_selection(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "train.py"), "--quick", "--batches", "64",
         "--repeats", "1", "--skip-epoch", "--skip-collect",
         "--pallas-kernels", "projection,iqn", "--out", str(out)],
        check=False, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert printed == json.loads(out.read_text())  # --out holds the same, complete record
    assert printed["complete"] and printed["pallas_kernels"] == ["iqn", "projection"]
    # gpu.toml: online at s, then online + target paired at s′ (float32)
    assert printed["fuse_next_obs"] is False and printed["next_state_twin"] is True
    (row,) = printed["updates"]
    assert row["batch"] == 64 and row["ms_per_update"] > 0
    assert row["samples_per_s"] == pytest.approx(64 * row["updates_per_s"])
    # updates are timed on a replay filled to its capacity (--quick: 100,000), as in training
    assert printed["replay_fill"] == "capacity" and row["replay_size"] == 100_000
    # one seed on one device: "auto" resolves to concurrent graphs, which the CPU has none of
    assert printed["gpu_graphs_resolved"] == "concurrent" and printed["compiler_options"] is None


def test_profile_summary_counts_each_devices_busy_time_once():
    """Overlapping kernels (concurrent CUDA graphs) count once in the busy time, per device,
    averaged over devices; the summed kernel time counts them all."""
    sys.path.insert(0, str(REPO / "bench"))
    import profile_step

    meta = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}
            for pid, name in ((1, "/device:GPU:0"), (2, "/device:GPU:1"), (3, "/host:CPU"))]
    spans = [(1, 0, 10), (1, 5, 10), (1, 20, 5), (2, 0, 4), (3, 0, 100)]
    events = meta + [{"ph": "X", "name": f"k{i}", "pid": pid, "ts": ts, "dur": dur}
                     for i, (pid, ts, dur) in enumerate(spans)]
    out = profile_step.summarise({"traceEvents": events}, n_updates=2, top=3)
    assert out["device_us_per_update"] == (10 + 10 + 5 + 4) / 2
    assert out["device_busy_us_per_update"] == (20 + 4) / 2 / 2  # device 0: 15 + 5; device 1: 4
    assert out["device_kernels_per_update"] == 2.0


def test_checkpoint_bench_times_save_checksums_and_a_verified_restore(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "checkpoint.py"), "--config",
         str(REPO / "configs" / "quickstart.toml"), "--set", "train.replay_capacity=2000",
         "--set", "env.n_envs=16", "--repeats", "1", "--out", str(out)],
        check=False, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert printed == json.loads(out.read_text())
    assert printed["replay_capacity"] == 2000 and printed["state_bytes"] > 2000 * 68
    # The replay is filled with random bits, so the files are as large as a trained run's.
    assert printed["checkpoint_disk_bytes"] > 2000 * 68
    for k in ("checksums_device_s", "checksums_host_numpy_s", "save_blocking_s", "save_wait_s",
              "restore_verified_s"):
        assert printed[k] > 0, k


def test_kernels_bench_times_the_tree_sum_at_the_updates_bias_shapes():
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "kernels.py"), "--kernel", "reduce", "--batch",
         "128", "--reps", "2", "--reduce-tiles", "32/256/4,16/64/4", "--interpret"],
        check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["kernel"] == "reduce" and out["batch"] == 128
    # the twelve bias-gradient shapes, rows scaled to the batch (B·Q rows for the IQN head)
    assert len(out["results"]) == 12 and "128x640" in out["results"]
    assert "1024x256" in out["results"] and "1024x14" in out["results"]
    assert out["interpret"] is True and out["dtype"] == "float32"
    for row in out["results"].values():
        assert set(row) == {"xla_sum", "pallas_r32_c256_w4", "pallas_r16_c64_w4"}
        for name, r in row.items():
            assert r["us"] > 0 and r["bitwise_repeat"], name
            assert r["max_err_over_abs_sum"] < 1e-6, name
            # the kernel (here in the interpreter) is bitwise its tree's jnp reference
            assert r.get("bitwise_reference", True), name
        assert "bitwise_reference" in row["pallas_r16_c64_w4"]
