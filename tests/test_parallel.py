"""Data-parallel training (``parallel.n_devices``): config checks here, the training checks on
two simulated CPU devices in a subprocess (``parallel_worker.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_config

from jdqn.config import ConfigError
from jdqn.train import job as job_lib
from jdqn.train.state import Learner

HERE = Path(__file__).resolve().parent


def test_sizes_that_do_not_divide_over_the_devices_are_refused():
    with pytest.raises(ConfigError, match=r"parallel.n_devices = 3: env.n_envs = 16, "
                                          r"train.batch_size = 32, train.replay_capacity = 2048 "
                                          r"not divisible by 3"):
        tiny_config("parallel.n_devices=3")
    tiny_config("parallel.n_devices=4")  # 16, 32 and 2048 divide by 4


def test_multi_host_is_refused_not_ignored():
    with pytest.raises(ConfigError, match="distributed = true: multi-host training is not "
                                          "available"):
        tiny_config("parallel.distributed=true")


def test_more_devices_than_present_is_a_clear_error():
    cfg = tiny_config("parallel.n_devices=2")  # the test process has one CPU device
    with pytest.raises(ConfigError, match=r"parallel.n_devices = 2, but JAX sees 1 cpu "
                                          r"device\(s\)"):
        job_lib.prepare(cfg)


def test_all_devices_on_a_one_device_machine_is_the_single_device_program():
    cfg = tiny_config("parallel.n_devices=0")
    learner = Learner.create(cfg, (), 32)
    assert learner.n_devices == 1 and learner.axis is None


@pytest.mark.slow
def test_two_devices_train_the_global_batch_identically_everywhere(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
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
    assert e["n_sharded_leaves"] > 0 and e["env_t_differs"], e  # the devices explore apart
    assert e["repeat_bitwise"] and e["compilations"] == 1, e
    assert e["n_updates"] == [16.0, 16.0] and e["loss_finite"], e
    # The replay holds both devices' transitions: 3 epochs × 8 iters × 4 steps × 16 envs.
    assert e["replay_size"] == [1536, 1536], e

    j = res["job"]
    assert j["compilations"] == 1 and j["resume_same_returns"] and j["resume_same_sharpe"], j
