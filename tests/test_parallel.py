"""Data-parallel training (``parallel.n_devices``): config checks here, the training checks on
two simulated CPU devices in a subprocess (``parallel_worker.py``)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from helpers import tiny_config

from jdqn.config import ConfigError
from jdqn.train import job as job_lib
from jdqn.train.parallel import resolve_n_devices
from jdqn.train.state import Learner

HERE = Path(__file__).resolve().parent


def test_sizes_that_do_not_divide_over_the_devices_are_refused():
    with pytest.raises(ConfigError, match=r"parallel.n_devices = 3: env.n_envs = 16, "
                                          r"train.batch_size = 32, train.replay_capacity = 2048 "
                                          r"not divisible by 3"):
        tiny_config("parallel.n_devices=3")
    tiny_config("parallel.n_devices=4")  # 16, 32 and 2048 divide by 4


def test_multi_host_trains_on_every_device_of_every_process(monkeypatch):
    cfg = tiny_config("parallel.distributed=true", "parallel.n_devices=1")
    assert resolve_n_devices(cfg) == 1  # one process: distributed alone changes nothing
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "device_count", lambda: 4)
    with pytest.raises(ConfigError, match=r"parallel.n_devices = 1 with parallel.distributed "
                                          r"= true: .* \(here 4 on 2 processes\); use 0"):
        resolve_n_devices(cfg)


def test_more_devices_than_present_is_a_clear_error_before_the_data_is_read(monkeypatch):
    n = len(jax.devices())
    cfg = tiny_config(f"parallel.n_devices={2 * n}")
    monkeypatch.setattr(job_lib, "load_or_build", lambda c: pytest.fail("data read first"))
    with pytest.raises(ConfigError, match=rf"parallel.n_devices = {2 * n}, but JAX sees {n} "):
        job_lib.prepare(cfg)


def test_every_device_resolves_to_the_count_present_and_names_it_in_errors():
    learner = Learner.create(tiny_config("parallel.n_devices=0"), (), 32)
    n = len(jax.devices())
    assert learner.n_devices == n and (learner.axis is None) == (n == 1)
    with pytest.raises(ConfigError, match=r"^parallel.n_devices = 0 \(every device JAX sees: "
                                          r"3\): env.n_envs = 16, train.batch_size = 32, "):
        resolve_n_devices(tiny_config("parallel.n_devices=0"), ["d0", "d1", "d2"])
    assert resolve_n_devices(tiny_config("parallel.n_devices=0"), ["d0", "d1"]) == 2
    # A Config built in Python skips the file loader's checks: the count is checked here too
    # (a batch of 33 on 2 devices was silently drawn as 2 × 16).
    import dataclasses

    cfg = tiny_config("parallel.n_devices=2")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=33))
    with pytest.raises(ConfigError, match=r"^parallel.n_devices = 2: train.batch_size = 33 not "
                                          r"divisible by 2"):
        resolve_n_devices(cfg, ["d0", "d1"])


def test_the_resolved_device_count_is_part_of_the_checkpoint_fingerprint(monkeypatch):
    from jdqn.train.checkpoint import _schema_diff

    p = job_lib.prepare(tiny_config("parallel.n_devices=0"))
    one = job_lib.feature_schema(p)
    assert one == job_lib.feature_schema(job_lib.prepare(tiny_config()))  # 0 → 1 here
    two = job_lib.feature_schema(dataclasses.replace(p, learner=dataclasses.replace(
        p.learner, n_devices=2)))
    assert two != one and two.endswith(";devices=2")
    assert "device count (2 in the checkpoint vs 1 now)" in _schema_diff(two, one)


@pytest.mark.slow
def test_two_devices_train_the_global_batch_identically_everywhere(tmp_path):
    # CPU devices whatever the machine has (on a GPU, TF32 matmuls put the gradients of a split
    # and a whole batch 1e-3 apart, so the gradient check is a CPU check).
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(HERE / "parallel_worker.py"), str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["devices"] == 2

    g = res["gradient"]
    # The split batch's gradient is the whole batch's (float32 summation order only) ...
    assert g["grad_rel"] < 5e-5 and g["comps_rel"] < 5e-6 and g["moe_rel"] < 1e-6, g
    assert g["balance_value"] == pytest.approx(g["balance_value_one"], rel=1e-5)
    # ... and would not be with each device's load balance on its own share (the check can fail).
    assert g["naive_grad_rel"] > 20 * max(g["grad_rel"], 1e-6), g
    assert g["naive_balance_rel"] > 1e-3, g

    e = res["epoch"]
    assert e["diverged"] == [], f"replicated leaves differ between devices: {e['diverged']}"
    assert e["n_sharded_leaves"] == 31 and e["env_t_differs"], e  # env 14, n-step 8, replay 9
    assert e["repeat_bitwise"] and e["compilations"] == 1, e
    assert e["n_updates"] == [16.0, 16.0] and e["loss_finite"], e
    # The replay holds both devices' transitions: 3 epochs × 8 iters × 4 steps × 16 envs.
    assert e["replay_size"] == [1536, 1536], e
    assert e["frozen_seed_unchanged"], e
    assert e["after_freeze"] == e["after_fold_reset"] == e["after_restore"] == [], e
    assert e["restore_equal"] and e["schema"].endswith(";devices=2"), e
    assert e["laid_out"] == {"fresh": True, "fold_reset": True, "restored": True}, e

    r = res["randomness"]
    assert r["start_identical"], r  # every device starts from the same block ...
    assert r["actions_differ"] and r["priorities_differ"], r  # ... and draws its own noise
    assert r["weights_max"] == 1.0 and min(r["weights_shard_max"]) < 1.0, r
    assert all(r[f"normaliser_{m}{t}_bitwise"] for m in ("robust", "zscore")
               for t in ("", "_masked")), r

    j = res["job"]
    assert j["compilations"] == 1 and j["resume_same_returns"] and j["resume_same_sharpe"], j
    assert j["devices"] == 2, j  # the report says what trained it
