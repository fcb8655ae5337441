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
import time
from pathlib import Path

import jax
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


def _launch(cfg: Path, out: Path, *extra: str) -> list:
    port = _free_port()
    return [subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "distributed_cli.py"), "--config", str(cfg),
         "--output-dir", str(out), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
         "--process-id", str(i), *extra], cwd=REPO, env=_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]


def _wait(procs: list, timeout: float = 600) -> list[subprocess.CompletedProcess]:
    done = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return done


def _clean(report: dict) -> dict:
    report["extra"].pop("wall_seconds")
    report["extra"].pop("processes")
    return report


@pytest.mark.slow
def test_two_processes_train_what_one_process_trains_on_two_devices(tmp_path):
    # Every process but 0 runs with probes (tests/distributed_cli.py): it may not write the
    # run folder, and its own validation Sharpe is negated. The run is killed mid-fold 0 and
    # resumed, and must still end as one process on two devices does, bit for bit.
    overrides = ("train.epochs_per_fold=3", "train.iters_per_epoch=8",
                 "checkpoint.async_save=false")
    one = tmp_path / "one.toml"
    one.write_text(tiny_toml("parallel.n_devices=2", *overrides))
    multi = tmp_path / "multi.toml"
    multi.write_text(tiny_toml("parallel.n_devices=0", "parallel.distributed=true", *overrides))
    ref = subprocess.Popen([sys.executable, "-m", "jdqn.main", "--config", str(one),
                            "--output-dir", str(tmp_path / "ref")], cwd=REPO,
                           env=_env("--xla_force_host_platform_device_count=2"),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = tmp_path / "multi"
    procs = _launch(multi, out)  # (beside the reference run: compiling is most of both)
    deadline = time.time() + 300
    while time.time() < deadline and not (out / "checkpoints" / "2" / "commit_success.txt"
                                           ).exists():
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    alive = [p.poll() is None for p in procs]
    for p in procs:
        p.kill()
    killed = _wait(procs)
    assert all(alive), f"a process ended before the kill: {killed[0].stderr[-3000:]}" \
                       f"{killed[1].stderr[-3000:]}"
    assert not (out / "report.json").exists()

    # Relaunched without --resume on the folder: process 0 refuses it, and process 1 stops
    # with it rather than waiting for process 0 in a collective.
    bad = _wait(_launch(multi, out))
    assert bad[0].returncode == 2 and "already holds files; pass --resume" in bad[0].stderr
    assert bad[1].returncode == 2 and ("process 0 failed checking the run folder: output dir"
                                       in bad[1].stderr)

    (ref,) = _wait([ref])
    assert ref.returncode == 0, ref.stderr[-2000:]
    runs = _wait(_launch(multi, out, "--resume"))
    for i, r in enumerate(runs):
        assert r.returncode == 0, f"process {i}: {r.stderr[-3000:]}"
    assert "run written to" in runs[0].stdout and "run written to" not in runs[1].stdout
    assert "fold 1 ep" in runs[0].stdout and "fold 1 ep" not in runs[1].stdout  # one logger

    # The same program on the same two devices: the same returns, bit for bit, the same
    # validation decisions (process 1's negated Sharpe did not decide), each epoch logged once.
    refdir = tmp_path / "ref"
    assert (out / "returns.csv").read_bytes() == (refdir / "returns.csv").read_bytes()
    rep, want = (json.loads((d / "report.json").read_text()) for d in (out, refdir))
    assert rep["extra"]["devices"] == want["extra"]["devices"] == 2
    assert rep["extra"]["processes"] == 2 and want["extra"]["processes"] == 1
    assert _clean(rep) == _clean(want)
    assert (out / "metrics.jsonl").read_text() == (refdir / "metrics.jsonl").read_text()
    assert len(list((out / "tensorboard").glob("events.*"))) == 2  # process 0's, twice (resume)


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
    res = _cli(["--config", str(multi), "--output-dir", str(tmp_path / "o"), "--autotune-file",
                str(tmp_path / "a.txt")], env=_env())
    assert res.returncode == 2 and "--autotune-file is not available" in res.stderr
    assert not (tmp_path / "o").exists() and not (REPO / "runs" / "m").exists()
    with pytest.raises(ConfigError, match="go together"):
        distributed.initialize("127.0.0.1:1234", 2, None)
    with pytest.raises(ConfigError, match="expected HOST:PORT"):
        distributed.initialize("localhost", 2, 0)
    with pytest.raises(ConfigError, match=r"--process-id 2: must be in \[0, 2\)"):
        distributed.initialize("127.0.0.1:1234", 2, 2)
    with pytest.raises(ConfigError, match=r"--process-id -1: must be in \[0, 2\)"):
        distributed.initialize("127.0.0.1:1234", 2, -1)
    jax.devices()  # (JAX may not have started yet in this test process)
    with pytest.raises(ConfigError, match="JAX has already started"):
        distributed.initialize("127.0.0.1:1234", 2, 1)


def test_one_process_helpers_are_identities():
    obj = {"a": [1.5, 2], "b": None}
    assert distributed.broadcast_json(obj) is obj
    assert distributed.allgather_json(obj) == [obj]
    assert distributed.is_primary() and distributed.process_count() == 1
    distributed.same_everywhere({"x": 1})
    distributed.agree(None, "nothing")
    with pytest.raises(KeyError), distributed.together("a block"):
        raise KeyError("a one-process failure is raised as it is")


def test_an_unreachable_coordinator_is_a_one_line_error(monkeypatch):
    # (JAX itself would abort the process after its 300 s initialisation timeout.)
    monkeypatch.setattr(distributed, "CONNECT_TIMEOUT_S", 0.5)
    port = _free_port()  # nothing listens there
    with pytest.raises(ConfigError, match=rf"--coordinator 127.0.0.1:{port}: nothing answered "
                                          r"there for 0 s"):
        distributed._wait_for("127.0.0.1", port, f"127.0.0.1:{port}")


def test_run_job_refuses_distributed_without_joining(tmp_path):
    from helpers import tiny_config

    from jdqn.train import job

    with pytest.raises(ConfigError, match="has not joined a multi-process job"):
        job.run_job(tiny_config("parallel.distributed=true"), tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_processes_started_unlike_or_failing_alone_stop_together(monkeypatch):
    # The exchange itself is the two-process test's; here, what each process concludes from
    # what the others sent (a fake two-process all-gather, seen from process 0 and from 1).
    import jax

    from jdqn.errors import DistributedError

    monkeypatch.setattr(distributed, "process_count", lambda: 2)
    for me in (0, 1):
        monkeypatch.setattr(jax, "process_index", lambda me=me: me)
        others = {"config": "abc", "--resume": False}

        def gather(obj, others=others, me=me):
            return [obj, others] if me == 0 else [others, obj]

        monkeypatch.setattr(distributed, "allgather_json", gather)
        distributed.same_everywhere({"config": "abc", "--resume": False})  # alike: no error
        with pytest.raises(DistributedError, match=r"process 1's --resume differs from process "
                                                   r"0's \((true vs false|false vs true)\)"):
            distributed.same_everywhere({"config": "abc", "--resume": True})
        # a key only one process sends is a difference too, seen by every process
        monkeypatch.setattr(distributed, "allgather_json",
                            lambda obj: [{"config": "abc", "extra": 1}, {"config": "abc"}])
        with pytest.raises(DistributedError, match="process 1's extra differs"):
            distributed.same_everywhere({"config": "abc"})

        # a failure elsewhere: every other process raises naming it; the one that failed
        # raises its own error
        monkeypatch.setattr(distributed, "allgather_json",
                            lambda obj, me=me: [obj, "disk full"] if me == 0 else
                            ["disk full", obj])
        if me == 0:
            with pytest.raises(DistributedError, match="process 1 failed writing: disk full"), \
                    distributed.together("writing"):
                pass
        else:
            with pytest.raises(OSError, match="disk full"), distributed.together("writing"):
                raise OSError("disk full")
