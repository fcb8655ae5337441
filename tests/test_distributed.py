"""Multi-host training (``parallel.distributed = true``): two CLI processes on this machine, one
CPU device each, joined by ``jax.distributed`` (gloo collectives), must train the very program
one process runs on two devices: same report, bitwise; process 0 alone writes the run folder;
a resume of the two-process run restores on both and reproduces the report."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_toml

from jdqn.config import ConfigError
from jdqn.train import distributed

REPO = Path(__file__).resolve().parents[1]


def _env(extra_xla: str = "") -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {extra_xla}".strip()
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(args: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jdqn.main", *args], cwd=REPO,
                          capture_output=True, text=True, check=False, **kw)


def _two_processes(cfg: Path, out: Path, *extra: str) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jdqn.main", "--config", str(cfg), "--output-dir", str(out),
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
         *extra], cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True) for i in range(2)]
    done = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return done


@pytest.mark.slow
def test_two_processes_train_what_one_process_trains_on_two_devices(tmp_path):
    overrides = ("train.epochs_per_fold=2", "checkpoint.async_save=false")
    one = tmp_path / "one.toml"
    one.write_text(tiny_toml("parallel.n_devices=2", *overrides))
    multi = tmp_path / "multi.toml"
    multi.write_text(tiny_toml("parallel.n_devices=0", "parallel.distributed=true", *overrides))

    ref = _cli(["--config", str(one), "--output-dir", str(tmp_path / "ref")],
               env=_env("--xla_force_host_platform_device_count=2"))
    assert ref.returncode == 0, ref.stderr[-2000:]
    out = tmp_path / "multi"
    runs = _two_processes(multi, out)
    for i, r in enumerate(runs):
        assert r.returncode == 0, f"process {i}: {r.stderr[-3000:]}"
    assert "run written to" in runs[0].stdout and "run written to" not in runs[1].stdout
    assert "fold 0 ep" in runs[0].stdout and "fold 0 ep" not in runs[1].stdout  # one logger

    # The same program on the same two devices: the same returns, bit for bit.
    assert (out / "returns.csv").read_bytes() == (tmp_path / "ref" / "returns.csv").read_bytes()
    rep, want = (json.loads((d / "report.json").read_text()) for d in (out, tmp_path / "ref"))
    assert rep["test"]["sharpe"] == want["test"]["sharpe"]
    assert rep["folds"] == want["folds"]  # validation decided the same epochs
    assert rep["extra"]["devices"] == want["extra"]["devices"] == 2
    assert rep["extra"]["processes"] == 2 and want["extra"]["processes"] == 1
    # process 0 wrote each file once: one metrics line per epoch, not two
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len((tmp_path / "ref" / "metrics.jsonl").read_text().splitlines())
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit())

    # --resume of the finished two-process run: both processes restore (and verify) the
    # checkpoint and the report comes out the same.
    before = (out / "returns.csv").read_bytes()
    again = _two_processes(multi, out, "--resume")
    for i, r in enumerate(again):
        assert r.returncode == 0, f"resume, process {i}: {r.stderr[-3000:]}"
    assert (out / "returns.csv").read_bytes() == before


def test_multi_host_flags_are_checked_before_anything_starts(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(tiny_toml())
    res = _cli(["--config", str(cfg), "--output-dir", str(tmp_path / "o"), "--coordinator",
                "127.0.0.1:1234", "--num-processes", "2", "--process-id", "0"], env=_env())
    assert res.returncode == 2 and "need parallel.distributed = true" in res.stderr
    multi = tmp_path / "m.toml"
    multi.write_text(tiny_toml("parallel.n_devices=0", "parallel.distributed=true"))
    res = _cli(["--config", str(multi)], env=_env())
    assert res.returncode == 2 and "needs --output-dir" in res.stderr
    assert not (tmp_path / "o").exists() and not (REPO / "runs" / "m").exists()
    with pytest.raises(ConfigError, match="go together"):
        distributed.initialize("127.0.0.1:1234", 2, None)
    with pytest.raises(ConfigError, match="expected HOST:PORT"):
        distributed.initialize("localhost", 2, 0)
    with pytest.raises(ConfigError, match=r"--process-id 2: must be in \[0, 2\)"):
        distributed.initialize("127.0.0.1:1234", 2, 2)
    with pytest.raises(ConfigError, match="JAX has already started"):
        distributed.initialize("127.0.0.1:1234", 2, 1)  # this test process runs JAX already


def test_one_process_helpers_are_identities():
    obj = {"a": [1.5, float("nan")], "b": None}
    assert distributed.broadcast_json(obj) is obj
    assert distributed.is_primary() and distributed.process_count() == 1
    distributed.barrier("nothing to wait for")
