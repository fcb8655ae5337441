"""Compiling ahead (``jdqn.train.ahead``): the same run, no program compiled twice, the
programs compiled ahead are the ones the calls use, and a failed task is only dropped."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import COMPILED, jax_events, tiny_config

from jdqn.train.ahead import Ahead

REPO = Path(__file__).resolve().parents[1]

_RUN = r"""
import hashlib, json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from jax import monitoring
names = []
def count(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
        names.append(kw.get("fun_name", "?"))
monitoring.register_event_duration_secs_listener(count)
from helpers import tiny_config
from jdqn.train import job
out = Path(sys.argv[1])
report = job.run_job(tiny_config("train.seeds=[0, 1]"), out, quiet=True)
print(json.dumps({"compiles": sorted(names), "report": report,
                  "returns": hashlib.sha256((out / "returns.csv").read_bytes()).hexdigest()}))
"""


def _run(tmp_path: Path, name: str, ahead: str) -> dict:
    env = {**os.environ, "JDQN_COMPILE_AHEAD": ahead}
    proc = subprocess.run([sys.executable, "-c", _RUN, str(tmp_path / name),
                           str(REPO / "tests")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_run_compiling_ahead_is_the_same_run_with_no_program_compiled_twice(tmp_path):
    on = _run(tmp_path, "on", "1")
    off = _run(tmp_path, "off", "0")
    assert on["returns"] == off["returns"]
    for r in (on, off):
        r["report"]["extra"].pop("wall_seconds")
    assert on["report"] == off["report"]
    assert on["report"]["extra"]["epoch_compilations"] == 1
    # Every program compiled ahead was the one its call used: a call that missed it would
    # have compiled it again.
    assert on["compiles"] == off["compiles"]
    assert on["compiles"].count("jit(run)") == 1 and on["compiles"].count("jit(_scan)") == 2


def _compiled_during(fn) -> list[str]:
    """The names of the programs XLA compiled while ``fn()`` ran."""
    with jax_events(COMPILED) as names:
        fn()
    return names


def test_programs_compiled_ahead_are_the_ones_the_calls_use():
    from jdqn.evaluate import backtest as bt
    from jdqn.evaluate.baselines import compile_baselines, random_policy, run_baselines
    from jdqn.train import checkpoint as ck_lib
    from jdqn.train import job as job_lib
    from jdqn.train.state import init_state, seed_keys

    cfg = tiny_config("train.seeds=[0, 1]")
    p = job_lib.prepare(cfg)
    env = job_lib.fold_env_params(cfg, p, 0)
    keys = seed_keys(cfg.train.seeds)
    abstract = jax.eval_shape(jax.vmap(lambda k: init_state(p.learner, k, env)), keys)
    lo, hi = p.plan.folds[0].val
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
                          abstract.params)

    state = job_lib._fold_state(p, None, env, 0, keys)
    seed0 = job_lib.seed_slice(state.params, 0)
    ours = ("jit(_scan)", "jit(_begin)", "jit(_checksum_lanes)", "jit(_select_best)")
    for f in (bt._scan, bt._begin, job_lib._select_best):
        f.clear_cache()
    ck_lib._checksums_over.cache_clear()

    def ahead():
        bt.compile_rollout(env, job_lib._greedy_fn(p.learner), params, lo=lo, hi=hi)
        bt.compile_rollout(env, random_policy, jnp.int32(0), lo=lo, hi=hi, n_windows=3)
        compile_baselines(env, cfg.eval, lo=lo, hi=hi)
        ck_lib.compile_checksums(abstract)
        job_lib._select_best.lower(abstract, jax.ShapeDtypeStruct((2,), jnp.bool_)).compile()
        job_lib._reset_fn(p.learner).lower(abstract, abstract).compile()

    def calls():
        got = job_lib.evaluate_params(cfg, p, env, seed0, lo, hi)
        rnd = bt.rollout(env, random_policy, jnp.int32(0), lo=lo, hi=hi, n_windows=3)
        assert got.n_bars == rnd.n_bars == hi - lo - 1
        run_baselines(env, cfg.eval, lo=lo, hi=hi)
        ck_lib.leaf_checksums(ck_lib._encode_keys(state))
        best = job_lib._select_best(state, jnp.asarray([True, False]))
        job_lib._fold_state(p, best, env, 1, keys)  # init (compiled above) and the reset

    job_lib._reset_fn.cache_clear()
    before = _compiled_during(ahead)
    assert sorted(n for n in before if n in ours) == sorted(
        ["jit(_scan)"] * 3 + ["jit(_begin)"] * 2 + ["jit(_checksum_lanes)", "jit(_select_best)"])
    assert "jit(<lambda>)" in before  # the reset
    assert [n for n in _compiled_during(calls) if n in ours or n == "jit(<lambda>)"] == []


def test_the_job_compiles_the_fold_reset_ahead_when_it_has_several_folds(monkeypatch):
    from jdqn.train import ahead as ahead_lib
    from jdqn.train import job as job_lib
    from jdqn.train.state import init_state, seed_keys

    names = []
    monkeypatch.setattr(ahead_lib.Ahead, "submit", lambda self, name, fn: names.append(name))
    monkeypatch.setattr(ahead_lib.Ahead, "run", lambda self, name, fn: names.append(name))
    for folds, want in ((2, True), (1, False)):
        cfg = tiny_config(f"train.n_folds={folds}")
        p = job_lib.prepare(cfg)
        env = job_lib.fold_env_params(cfg, p, 0)
        abstract = jax.eval_shape(jax.vmap(lambda k, p=p, env=env: init_state(p.learner, k, env)),
                                  seed_keys(cfg.train.seeds))
        names.clear()
        job_lib._compile_ahead(cfg, p, job_lib.make_epoch_fn(p.learner), abstract, env).close()
        assert ("reset" in names) is want and names[:2] == ["epoch", "baselines"], names


def test_tasks_run_in_order_in_the_background_and_a_failure_is_only_logged(caplog):
    ahead = Ahead(True)
    order = []
    gate = threading.Event()
    ahead.submit("a", lambda: (gate.wait(5), order.append(("a", threading.current_thread()))))
    ahead.submit("b", lambda: 1 / 0)
    ahead.submit("c", lambda: order.append(("c", threading.current_thread())))
    ahead.run("now", lambda: order.append(("now", threading.current_thread())))
    gate.set()
    with caplog.at_level(logging.DEBUG, logger="jdqn.train.ahead"):
        ahead.wait("c")
        ahead.run("bad", lambda: np.asarray([1])[5])
    ahead.wait("a")
    ahead.wait("never submitted")  # returns at once
    ahead.close()
    assert [n for n, _ in order] == ["now", "a", "c"]
    main = threading.current_thread()
    assert order[0][1] is main and order[1][1] is not main and order[2][1] is order[1][1]
    msgs = [r.getMessage() for r in caplog.records]
    assert any("b ahead failed" in m and "division by zero" in m for m in msgs), msgs
    assert any("bad ahead failed" in m for m in msgs), msgs

    off = Ahead(False)
    ran = []
    off.submit("x", lambda: ran.append(1))
    off.run("y", lambda: ran.append(2))
    off.wait("x")
    off.close()
    assert ran == []


def test_closing_drops_the_tasks_not_started_and_can_wait_for_the_one_in_progress():
    ahead = Ahead(True)
    ran = []
    gate, started = threading.Event(), threading.Event()
    ahead.submit("slow", lambda: (started.set(), gate.wait(5), ran.append("slow")))
    ahead.submit("later", lambda: ran.append("later"))
    assert started.wait(5)
    ahead.close()
    ahead.submit("after", lambda: ran.append("after"))  # closed: not queued
    gate.set()
    ahead.wait("later")  # dropped, yet a wait for it returns
    ahead.wait("after")
    ahead.close(join=True)
    assert ran == ["slow"]


_FAIL_WHILE_COMPILING = r"""
import sys, threading, time
from pathlib import Path
from jdqn.train.ahead import Ahead

ahead = Ahead(True)
started = threading.Event()

def compiling():  # stands for an XLA compilation: a second in code that holds no GIL
    started.set()
    time.sleep(1.0)
    Path(sys.argv[1]).write_text("finished")

ahead.submit("compile", compiling)
started.wait()
raise RuntimeError("the run failed")
"""


def test_a_process_that_fails_while_compiling_ahead_waits_for_the_compilation_at_exit(
        tmp_path):
    # Python finalising while the background thread was inside an XLA compilation aborted the
    # process after the run's own error (SIGABRT on the CPU, 3 times in 3 with a 400-operation
    # program; a segmentation fault on the H200 machine): the thread came back into Python
    # during finalisation. At exit the task in progress is now waited for, then the process
    # exits with the run's error.
    marker = tmp_path / "finished"
    proc = subprocess.run([sys.executable, "-c", _FAIL_WHILE_COMPILING, str(marker)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.rstrip().endswith("RuntimeError: the run failed"), proc.stderr[-2000:]
    assert marker.read_text() == "finished"
