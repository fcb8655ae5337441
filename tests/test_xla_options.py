"""``train.gpu_graphs``: which XLA options the training programs are compiled with, and that they
reach the compilations (the GPU timing and bitwise checks are in bench/results)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_config

from jdqn.config import Config
from jdqn.train import epoch as epoch_lib
from jdqn.train import job as job_lib
from jdqn.train import parallel, xla_options
from jdqn.train.state import seed_keys


def test_options_only_on_the_gpu_and_graphs_only_with_concurrent():
    full = xla_options.compiler_options("concurrent", backend="gpu", xla_flags="")
    assert full == {**xla_options.CONCURRENT_GRAPHS, **xla_options.GPU_OPTIONS}
    assert full["xla_gpu_command_buffer_scheduling_mode"] == "CONCURRENT"
    assert "WHILE" in full["xla_gpu_enable_command_buffer"].split(",")
    assert xla_options.compiler_options("concurrent", backend="cpu", xla_flags="") is None
    assert xla_options.compiler_options("xla", backend="cpu", xla_flags="") is None
    # XLA's own graphs, still without the DotMerger (measured faster, GPU_OPTIONS)
    assert xla_options.compiler_options("xla", backend="gpu", xla_flags="") == \
        {"xla_gpu_dot_merger_threshold_mb": "0"}
    with pytest.raises(ValueError, match="gpu_graphs"):
        xla_options.compiler_options("fast", backend="gpu", xla_flags="")
    with pytest.raises(ValueError, match="resolved"):  # "auto" needs the program's seeds
        xla_options.compiler_options("auto", backend="gpu", xla_flags="")


def test_auto_is_concurrent_except_multi_host():
    """The default, from the H200's measurements: concurrent graphs made the gpu.toml epoch
    faster with one seed (4.15 vs 5.00 s) and two (7.45 vs 8.26 s), and the data-parallel
    multi_gpu.toml epoch on two H200s with one seed (4.96 vs 5.17 s) and two (8.21 / 8.24 vs
    8.79 / 8.76 s, final states bitwise identical); multi-host runs were not measured with them
    and keep XLA's graphs."""
    assert Config().train.gpu_graphs == "auto"
    assert xla_options.resolve("auto", n_processes=1) == "concurrent"
    # multi-host (several processes) was measured with XLA's graphs only
    assert xla_options.resolve("auto", n_processes=2) == "xla"
    assert xla_options.resolve("auto") == "concurrent"  # this test's one process
    for fixed in ("concurrent", "xla"):
        assert xla_options.resolve(fixed, n_processes=1) == fixed
        assert xla_options.resolve(fixed, n_processes=2) == fixed
    with pytest.raises(ValueError, match="train.gpu_graphs must be one of"):
        xla_options.resolve("fast")


def test_a_key_set_in_xla_flags_is_left_to_the_user():
    flags = "--xla_gpu_deterministic_ops=true --xla_gpu_command_buffer_scheduling_mode=LHS"
    opts = xla_options.compiler_options("concurrent", backend="gpu", xla_flags=flags)
    assert opts == {"xla_gpu_enable_command_buffer":
                    xla_options.CONCURRENT_GRAPHS["xla_gpu_enable_command_buffer"],
                    "xla_gpu_dot_merger_threshold_mb": "0"}
    merge = " --xla_gpu_dot_merger_threshold_mb=32"
    assert xla_options.compiler_options("xla", backend="gpu", xla_flags=flags + merge) is None
    every = flags + " --xla_gpu_enable_command_buffer=" + merge
    assert xla_options.compiler_options("concurrent", backend="gpu", xla_flags=every) is None


def test_auto_resolves_concurrent_for_every_program_of_one_process(monkeypatch):
    """The epoch and ``parallel.on_devices`` resolve "auto" to concurrent graphs for one seed or
    several, on one device or several, and to XLA's graphs when the job has several processes.
    Checked at construction, which needs no second device or process (mesh and process count
    stubbed)."""
    seen = []
    monkeypatch.setattr(xla_options, "compiler_options", lambda g, *a, **k: seen.append(g))
    monkeypatch.setattr(parallel, "make_mesh", lambda n: object())
    p = job_lib.prepare(tiny_config("train.gpu_graphs=auto"))
    p3 = job_lib.prepare(tiny_config("train.gpu_graphs=auto", "train.seeds=[0, 1, 2]"))

    def build_all():
        epoch_lib.make_epoch_fn.__wrapped__(dataclasses.replace(p.learner, n_devices=2))
        parallel.on_devices(lambda s: s, 2, gpu_graphs="auto")
        epoch_lib.make_epoch_fn.__wrapped__(dataclasses.replace(p3.learner, n_devices=2))
        epoch_lib.make_epoch_fn.__wrapped__(p3.learner)
        parallel.on_devices(lambda s: s, 1, gpu_graphs="auto")

    build_all()
    assert seen == ["concurrent"] * 5
    seen.clear()
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    build_all()
    assert seen == ["xla"] * 5


def test_this_jax_accepts_the_options():
    """XLA parses the option values (enum names, the merger's integer) on every backend: a typo
    or a command type this JAX does not know fails here, on the CPU, instead of at the first
    GPU run."""
    opts = xla_options.compiler_options("concurrent", backend="gpu", xla_flags="")
    f = jax.jit(lambda x: jnp.sin(x) * 2, compiler_options=opts)
    np.testing.assert_array_equal(f(jnp.arange(3.0)), jnp.sin(jnp.arange(3.0)) * 2)
    bad = jax.jit(lambda x: x + 1, compiler_options={"xla_gpu_dot_merger_threshold_mb": "x"})
    with pytest.raises(RuntimeError, match="xla_gpu_dot_merger_threshold_mb"):
        bad(jnp.arange(3.0))  # the values are parsed, so the check above can fail


def _bogus(gpu_graphs, backend=None, xla_flags=None):
    """What the real function gives on a GPU, made invalid so that its use shows: options for
    "concurrent", none for "xla"."""
    return {"xla_gpu_command_buffer_scheduling_mode": "NOT_A_MODE"} if gpu_graphs == "concurrent" \
        else None


@pytest.mark.parametrize("setting,seeds,epoch_concurrent", [
    ("concurrent", "[0]", True), ("xla", "[0]", False), ("auto", "[0]", True),
    ("auto", "[0, 1]", True), ("xla", "[0, 1]", False)])
def test_the_epoch_and_the_bench_pieces_are_compiled_with_the_configs_options(
        monkeypatch, setting, seeds, epoch_concurrent):
    """``train.gpu_graphs`` reaches the epoch's compilation and ``parallel.on_devices``: the
    (patched, invalid) options of "concurrent" make a program fail to compile, "xla" compiles;
    "auto" gives the one-device pieces and epochs "concurrent", for one seed and for two."""
    cfg = tiny_config(f"train.gpu_graphs={setting}", f"train.seeds={seeds}")
    p = job_lib.prepare(cfg)
    env_params = job_lib.fold_env_params(cfg, p, 0)
    state = job_lib._fold_state(p, None, env_params, 0, seed_keys(cfg.train.seeds))
    monkeypatch.setattr(xla_options, "compiler_options", _bogus)
    fn = epoch_lib.make_epoch_fn.__wrapped__(p.learner)  # not the cached program
    one = jax.tree.map(lambda x: x[0], state)
    step = parallel.on_devices(lambda s: epoch_lib.collect(p.learner, s, env_params)[0], 1,
                               gpu_graphs=cfg.train.gpu_graphs)
    if setting == "xla":
        jax.block_until_ready(step(one))
    else:  # a one-seed program on one device
        with pytest.raises(Exception, match="NOT_A_MODE"):
            step(one)
    if epoch_concurrent:
        with pytest.raises(Exception, match="NOT_A_MODE"):
            fn(state, env_params, jnp.asarray(0, jnp.int32))
    else:
        jax.block_until_ready(fn(state, env_params, jnp.asarray(0, jnp.int32)))
