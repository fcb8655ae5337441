"""XLA compile options for the training programs (``train.gpu_graphs``).

On the GPU, XLA records runs of kernels as CUDA graphs ("command buffers"). By default
(``gpu_graphs = "xla"``) it builds them in its scheduler's order, one kernel after the other.
``gpu_graphs = "concurrent"`` compiles the training programs with

* ``xla_gpu_command_buffer_scheduling_mode = CONCURRENT``: a graph's kernels are ordered by
  their data dependencies only, so independent kernels run side by side;
* ``xla_gpu_enable_command_buffer`` = XLA's default command types plus ``WHILE`` and
  ``CONDITIONAL``: whole loops are captured as graphs too.

Measured on the H200 (``bench/results/train_h200_gpu_graphs.json``), it is a trade, which is why
it is not the default:

* the update loop alone gets faster: B = 16384 from 4.15–4.18 to 3.70 ms (float32) and from
  2.81 to 2.37 ms (bf16); B = 256 from 0.86 to 0.63 ms. The update has much independent work
  (three network forwards, the weight and input gradients of each layer, per-leaf optimiser
  updates) in kernels too small to fill the GPU;
* the ``configs/gpu.toml`` epoch, which collects 13 M env steps beside its 800 updates in the
  same program, gets slower: 6.49 s against 5.22 s (6.42 s without the loop graphs), and its
  peak memory grows from 1.83 to 2.33 GB.

So it can pay for configs whose epochs are mostly updates (many ``updates_per_iter``, few envs);
time your config with ``bench/train.py --set train.gpu_graphs=concurrent``. Each kernel computes
what it computed before: the final state after two 20-iteration epochs at ``gpu.toml`` sizes
is bitwise identical under both settings. The options are per program (``jax.jit(compiler_options=…)``), not
process-wide, and a key the user sets in ``XLA_FLAGS`` wins over ours. On the CPU there are no
command buffers and no options are passed. Measured on one GPU only (not under data parallel).
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


def compiler_options(gpu_graphs: str, backend: str | None = None,
                     xla_flags: str | None = None) -> dict[str, str] | None:
    """The ``compiler_options`` for a training program under ``train.gpu_graphs``: None on a
    non-GPU backend or with ``"xla"``; otherwise :data:`CONCURRENT_GRAPHS` less any key that
    ``XLA_FLAGS`` already sets (the user's flag wins). ``backend``/``xla_flags`` default to
    JAX's default backend and the environment (arguments for tests)."""
    if gpu_graphs not in ("concurrent", "xla"):
        raise ValueError(f"train.gpu_graphs must be 'concurrent' or 'xla', got {gpu_graphs!r}")
    backend = jax.default_backend() if backend is None else backend
    if gpu_graphs == "xla" or backend != "gpu":
        return None
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    opts = {k: v for k, v in CONCURRENT_GRAPHS.items() if f"--{k}=" not in flags}
    return opts or None


def jit(fn: Any, gpu_graphs: str, **kw: Any) -> Any:
    """``jax.jit(fn, **kw)`` with :func:`compiler_options` when there are any."""
    opts = compiler_options(gpu_graphs)
    if opts:
        kw["compiler_options"] = opts
    return jax.jit(fn, **kw)
