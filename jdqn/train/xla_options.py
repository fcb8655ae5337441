"""XLA compile options for the training programs (``train.gpu_graphs``).

On the GPU, XLA records runs of kernels as CUDA graphs ("command buffers"). XLA's own way
(``gpu_graphs = "xla"``) builds them in its scheduler's order, one kernel after the other.
``gpu_graphs = "concurrent"`` compiles the training programs with

* ``xla_gpu_command_buffer_scheduling_mode = CONCURRENT``: a graph's kernels are ordered by
  their data dependencies only, so independent kernels run side by side;
* ``xla_gpu_enable_command_buffer`` = XLA's default command types plus ``WHILE`` and
  ``CONDITIONAL``: whole loops are captured as graphs too.

``gpu_graphs = "auto"`` (the default) takes "concurrent" for every program of one process — each
shape the H200 measured was faster that way — and "xla" for multi-host runs, not measured with
it (the multi-host figures and bitwise checks are XLA's serial graphs)
(``bench/results/train_h200_gpu_graphs.json``, ``epoch_h200_one_seed.json``,
``epoch_h200_seeds_switch.json`` and ``epoch_2xh200_dp_seeds_graphs.json``; float32 unless said):

* one seed (``configs/gpu.toml``): the update at B = 16384 takes 3.72 ms against 4.16 (bf16 2.36
  against 2.79), B = 256 0.63 against 0.86 ms; the epoch (800 updates + 13.1 M env steps)
  took **4.15 s against 5.00 s**; peak memory grows from 2.06 to 2.67 GB. The update has much
  independent work (three network forwards, each layer's weight and input gradients, the
  optimiser's per-leaf updates) in kernels too small to fill the GPU;
* two seeds on one GPU: **7.45 s against 8.26 s** per epoch (peak 4.34 against 3.64 GB), since
  the seeds' epoch keeps its update conditional a conditional (:func:`jdqn.train.epoch.
  iteration_seeds`; measured with a three-way switch, the final one-conditional form took
  7.54 s concurrent, peak 4.19 GB, in another machine session). The vmapped program before it, whose conditional was a select running
  both branches, lost under concurrent graphs: 10.17 against 8.44 s (and one seed, while it
  was vmapped too, 6.49 against 5.22 s);
* one seed data-parallel on two H200s (``configs/multi_gpu.toml``): **4.96 s against 5.17 s**
  per epoch (peak 2.49 against 1.99 GB per device);
* two seeds data-parallel on two H200s (``multi_gpu.toml``, 2026-12-01): **8.21 / 8.24 s against
  8.79 / 8.76 s** per epoch in two calls of opposite order (peak 4.19 against 3.54 GB per
  device);
* multi-host runs: not measured, so "auto" stays with XLA's graphs there.

Each kernel computes what it computed before, only the order of independent kernels changes:
the final state after two 20-iteration epochs is bitwise identical under both settings, at
``gpu.toml`` sizes (one seed and two) and data-parallel on two H200s at ``multi_gpu.toml`` sizes
(one seed and two; ``determinism_2xh200_dp_*graphs.json``). The concurrent graphs hold more
buffers live: +0.45–0.7 GB peak device memory at ``gpu.toml`` sizes. A CUDA graph needs driver memory
when it is instantiated: with two JAX processes on one GPU (each preallocating 75 % of it) an
instantiation failed with ``RESOURCE_EXHAUSTED … instantiate command buffer``; give each
process less (``XLA_CLIENT_MEM_FRACTION``) or use ``"xla"``. The options are per program
(``jax.jit(compiler_options=…)``), not process-wide, and a key the user sets in ``XLA_FLAGS``
wins over ours. On the CPU there are no command buffers and no options are passed.

Whatever the setting, a training program on the GPU is also compiled without XLA's DotMerger
(:data:`GPU_OPTIONS`: measured faster, bf16 by 3.5 %), so ``"xla"`` means XLA's graphs, not
every XLA default.
"""

from __future__ import annotations

import os
from typing import Any

import jax

# XLA's default command types plus whole loops and conditionals: the list that
# ``--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL`` gives (the same update time on the H200,
# jax 0.11.2). Options take a whole list, not XLA_FLAGS' +/- edits.
_COMMAND_TYPES = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"

CONCURRENT_GRAPHS: dict[str, str] = {
    "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT",
    "xla_gpu_enable_command_buffer": _COMMAND_TYPES,
}


# For every training program on the GPU, whatever ``gpu_graphs`` says: no DotMerger. XLA merges
# two products that share an operand into one over the operands concatenated, then slices the
# result apart. Under bf16 matmuls it merged the online network's differentiated forward at s
# with its grad-free forward at s′ (the same weights): one GEMM over 2B rows. The s′ half then fed
# Pallas kernels (GRN tails, the double-Q selection), which take whole buffers, so XLA copied
# each slice (seven copies, 43 µs per update at B = 16384). Without the merger the update took
# 1.623–1.644 ms against 1.680–1.682 (bf16) and 2.455–2.460 against 2.462–2.473 (float32) on the
# H200 with the flag in XLA_FLAGS (bench/results/train_h200_{bf16,f32}_dot_merger_ab.json), and
# as this option 1.635–1.642 against 1.694–1.701 (bf16), 2.498–2.512 against 2.507–2.514
# (float32) (…_ab2.json).
GPU_OPTIONS: dict[str, str] = {"xla_gpu_dot_merger_threshold_mb": "0"}

SETTINGS = ("auto", "concurrent", "xla")


def resolve(gpu_graphs: str, n_processes: int | None = None) -> str:
    """The setting a program is compiled with: ``"auto"`` is ``"concurrent"`` unless the job
    runs in several processes (multi-host, not measured with concurrent graphs: ``"xla"`` then;
    see the module's measurements); the others are themselves. ``n_processes`` defaults to
    ``jax.process_count()``."""
    if gpu_graphs not in SETTINGS:
        raise ValueError(f"train.gpu_graphs must be one of {', '.join(map(repr, SETTINGS))}, "
                         f"got {gpu_graphs!r}")
    if gpu_graphs != "auto":
        return gpu_graphs
    n_processes = jax.process_count() if n_processes is None else n_processes
    if n_processes > 1:
        return "xla"
    return "concurrent"


def compiler_options(gpu_graphs: str, backend: str | None = None,
                     xla_flags: str | None = None) -> dict[str, str] | None:
    """The ``compiler_options`` for a training program under ``train.gpu_graphs``: None on a
    non-GPU backend; on the GPU :data:`GPU_OPTIONS`, plus :data:`CONCURRENT_GRAPHS` with
    ``"concurrent"``, less any key that ``XLA_FLAGS`` already sets (the user's flag wins).
    ``backend``/``xla_flags`` default to JAX's default backend and the environment (arguments
    for tests)."""
    if gpu_graphs not in ("concurrent", "xla"):  # resolved settings only (see resolve)
        raise ValueError(f"gpu_graphs must be resolved to 'concurrent' or 'xla', got "
                         f"{gpu_graphs!r}")
    backend = jax.default_backend() if backend is None else backend
    if backend != "gpu":
        return None
    wanted = {**CONCURRENT_GRAPHS, **GPU_OPTIONS} if gpu_graphs == "concurrent" \
        else dict(GPU_OPTIONS)
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    opts = {k: v for k, v in wanted.items() if f"--{k}=" not in flags}
    return opts or None


def jit(fn: Any, gpu_graphs: str, **kw: Any) -> Any:
    """``jax.jit(fn, **kw)`` with the :func:`compiler_options` of ``gpu_graphs`` resolved for
    this process's job, when there are any."""
    opts = compiler_options(resolve(gpu_graphs))
    if opts:
        kw["compiler_options"] = opts
    return jax.jit(fn, **kw)
