"""Shared test set-up.

Compiled XLA programs are cached on disk (``.pytest_cache/xla``): the test processes and the
subprocesses the CLI tests start all write and read the cache (a program that took at least
0.5 s to compile), so a program compiled once — by a CLI run, by the other xdist worker, or by
this worker before it released its programs (below) — is loaded, not compiled, the next time.

The test processes used to read the cache only (2026-11-30: jaxlib 0.10.2 crashed an xdist
worker inside a cache write, twice in CI, after the worker had compiled a few hundred
programs). That was most likely the memory-mapping limit found on 2026-12-06 (a worker near
``vm.max_map_count`` died compiling; the fixture below now keeps workers far from it). With
writes back on, the whole suite on a clean clone took 14:56 against 16:18 read-only in the
same machine session (docs/performance_history.md, "Test suite").
"""

import os
from pathlib import Path

import pytest

CACHE = Path(os.environ.setdefault("JDQN_TEST_XLA_CACHE",
                                   str(Path(__file__).resolve().parents[1] / ".pytest_cache"
                                       / "xla")))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

# The tests' programs compile for far longer than they run (the tiny config's epoch: 12 s to
# compile, 0.09 s to run on one core), so on a CPU-only JAX the test processes and every
# subprocess they start (which inherit the environment) compile with XLA's CPU backend at LLVM
# -O0 and without the new fusion emitters: 5.0 s for that epoch, which then runs in 0.14 s.
# Same programs and semantics, not the same bits (rounding may differ from the default
# pipeline's): the bitwise tests compare runs under the same flags, and
# test_default_compile_pipeline_is_deterministic_too checks the default one. Flags already in
# XLA_FLAGS (the user's, or the xdist controller's) are kept, not repeated;
# JDQN_TEST_FAST_COMPILE=0 tests with XLA's default pipeline throughout. jaxlib 0.11 has no
# fusion-emitter switch (XLA aborts the process on a flag it does not know), so there the
# tests compile at -O0 alone.


def _fast_compile_flags() -> tuple[str, ...]:
    """The fast-compile flags the installed jaxlib knows (read without importing JAX)."""
    from importlib.metadata import PackageNotFoundError, version

    flags = ("--xla_backend_optimization_level=0",)
    try:
        major, minor = (int(v) for v in version("jaxlib").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return flags
    return flags + ("--xla_cpu_use_fusion_emitters=false",) if (major, minor) < (0, 11) \
        else flags


FAST_COMPILE = _fast_compile_flags()


def _cuda_jax() -> bool:
    """A CUDA plugin is installed and not switched off (the -O0 flag would reach the GPU)."""
    import importlib.util

    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return False
    return any(importlib.util.find_spec(m) is not None
               for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


if os.environ.get("JDQN_TEST_FAST_COMPILE", "1") != "0" and not _cuda_jax():
    _have = os.environ.get("XLA_FLAGS", "").split()
    _names = {f.split("=")[0] for f in _have}
    _add = [f for f in FAST_COMPILE if f.split("=")[0] not in _names]
    if _add:
        os.environ["XLA_FLAGS"] = " ".join(_have + _add)


def default_pipeline_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess that compiles with XLA's default CPU pipeline: this
    process's, less the :data:`FAST_COMPILE` flags (and told not to add them back). For the
    runs whose execution, not compilation, dominates: the quickstart trains for 8 epochs, which
    at -O0 run for longer than the compilation saves (one run: 32.6 s cold at -O0 against 25.6
    s default, 30.5 s against 14.3 s with the programs in the cache)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f not in FAST_COMPILE]
    return {**os.environ, "XLA_FLAGS": " ".join(flags), "JDQN_TEST_FAST_COMPILE": "0", **extra}


REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture
def mosaic_gpu_params_asked(monkeypatch):
    """The keyword arguments of every ``plgpu.CompilerParams`` built while the test runs (a
    spy over Mosaic GPU's compiler parameters, as the kernels ask for them): a list of dicts,
    which the test may clear between traces."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    asked = []
    real = plgpu.CompilerParams

    def spy(*args, **kwargs):
        asked.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(plgpu, "CompilerParams", spy)
    return asked


def _memory_mappings() -> tuple[int, int] | None:
    """``(this process's memory mappings, vm.max_map_count)`` on Linux, else None."""
    try:
        with open("/proc/self/maps", "rb") as f:
            used = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            return used, int(f.read())
    except (OSError, ValueError):
        return None


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs_when_mappings_run_high():
    """Drop JAX's compiled programs (``jax.clear_caches()``) when a test file ends with this
    process holding more than a third of the kernel's limit on memory mappings.

    XLA's CPU backend maps each compiled program's code into the process (a few mappings per
    kernel), and JAX keeps every program it compiled alive in its caches. A worker that ran
    half the suite crossed Linux's default ``vm.max_map_count`` (65530) near its end (2026-12-06:
    64,741 mappings), and its next compilation died in native code (a segmentation fault, an
    abort), taking the xdist worker down. Releasing the programs at a file boundary keeps a
    worker far from the limit (one file needs at most ~21,000); below the threshold the
    programs stay, for a later file on the same worker that compiles the same ones."""
    yield
    seen = _memory_mappings()
    if seen is not None and seen[0] > seen[1] // 3:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


# Test files by measured cost, heaviest first (worker-seconds in a `--durations=0` run of
# 2026-12-05 under `--dist loadfile`: test_training 317, test_pallas 189, test_bench 175,
# test_distributed 119, test_ahead 88, test_quickstart 85, test_networks 81, test_folds 78,
# test_parallel 71, test_losses 67, test_iqn_tail 66, test_cli 52, test_double_q 48, then
# under 42 each). Files not listed follow in collection order. Only the schedule depends on
# this list: a stale entry makes the two workers end less evenly, nothing else.
HEAVY_FIRST = ("test_training", "test_pallas", "test_bench", "test_distributed", "test_ahead",
               "test_quickstart", "test_networks", "test_folds", "test_parallel", "test_losses",
               "test_iqn_tail", "test_cli", "test_double_q")


def pytest_collection_modifyitems(config, items):
    """The order the workers take the test files in: heaviest first.

    pytest-xdist runs with ``--dist loadfile --no-loadscope-reorder`` (``pyproject.toml``):
    each file goes whole to one worker, so the programs its tests share (the same config's
    epoch, backtest and init programs, the same kernel shapes) compile once in that worker's
    process, not once in each (−15 % worker time against ``--dist load``: 1699 s against 1990
    s, 15:04 against 16:56 wall; docs/performance_history.md). A worker takes the next file
    when it is nearly done, in collection order, so with the heaviest files first the two
    workers end together on light ones. Within a file the ``slow`` tests run first. The order
    is a stable sort of the collection order."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}

    def key(item):
        return (rank.get(Path(str(item.fspath)).stem, len(rank)),
                item.get_closest_marker("slow") is None)

    items.sort(key=key)
