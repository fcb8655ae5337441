"""Multi-host (multi-process) training: one process per host, started together.

``parallel.distributed = true`` makes the job one process of several; each calls
:func:`initialize` (``jax.distributed.initialize``) before JAX starts its backend, after which
``jax.devices()`` lists every process's devices and the data-parallel epoch of
:mod:`jdqn.train.parallel` runs on a mesh over all of them (``parallel.n_devices`` must be 0 or
that global count). Where the address, process count and index come from: the CLI flags
``--coordinator HOST:PORT --num-processes N --process-id I``, or, without them, JAX's cluster
detection (SLURM, Open MPI, Kubernetes, cloud TPU). On CPU the processes exchange collectives
through gloo.

What each process does (docs/training.md, "Multi-host"):

* every process builds the data (the feature cache writes atomically, so processes sharing a
  cache folder do not corrupt it), runs every epoch program and every checkpoint save/restore
  (orbax writes each process's shards; the run folder must be on a file system all processes
  share);
* validation backtests run on each process's first local device, and **process 0's** metrics
  are broadcast to all (:func:`broadcast_json`), so early stopping, best-params selection and
  checkpoint retention take the same decision everywhere even if two processes' compiled
  backtests rounded differently;
* only process 0 checks and writes the run folder's files: ``config.toml``, ``metrics.jsonl``,
  TensorBoard, the report; the others print nothing per epoch.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from jdqn.config import ConfigError

_ADDRESS = re.compile(r"^\[?[A-Za-z0-9_.:-]+\]?:\d{1,5}$")


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """Join the multi-process job (before anything starts JAX's backend). With all three
    arguments None, JAX detects the cluster; otherwise all three are needed."""
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        raise ConfigError("--coordinator, --num-processes and --process-id go together (or "
                          "none of them, to let JAX detect the cluster: SLURM, Open MPI, ...)")
    if coordinator is not None:
        if not _ADDRESS.match(coordinator):
            raise ConfigError(f"--coordinator {coordinator!r}: expected HOST:PORT")
        if num_processes < 1:
            raise ConfigError(f"--num-processes {num_processes}: must be ≥ 1")
        if not 0 <= process_id < num_processes:
            raise ConfigError(f"--process-id {process_id}: must be in [0, {num_processes})")
    import jax

    from jdqn.main import _jax_backend_started

    if _jax_backend_started():
        raise ConfigError("parallel.distributed = true: JAX has already started in this "
                          "process; multi-process training must join the job before that")
    try:  # CPU processes exchange collectives through gloo (a no-op setting on GPU)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError):  # pragma: no cover - option renamed in a later JAX
        pass
    try:
        jax.distributed.initialize(coordinator_address=coordinator,
                                   num_processes=num_processes, process_id=process_id)
    except (RuntimeError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ConfigError(f"parallel.distributed = true: could not join the multi-process "
                          f"job ({first}); give --coordinator, --num-processes and "
                          "--process-id, or run under a cluster JAX detects") from None


def process_count() -> int:
    import jax

    return jax.process_count()


def is_primary() -> bool:
    """Process 0, the one that writes the run folder's files (True in a one-process run)."""
    import jax

    return jax.process_index() == 0


def _plain(o: Any) -> Any:
    if hasattr(o, "tolist"):  # numpy scalars and arrays
        return o.tolist()
    raise TypeError(f"{type(o).__name__} cannot be sent to the other processes")


def broadcast_json(obj: Any) -> Any:
    """Process 0's ``obj`` (anything JSON can carry; numpy values become Python ones) on every
    process, process 0 included, as JSON decodes it; a one-process run returns ``obj``
    unchanged. Every process must call it at the same point."""
    if process_count() == 1:
        return obj
    from jax.experimental import multihost_utils

    data = (np.frombuffer(json.dumps(obj, default=_plain).encode(), np.uint8)
            if is_primary() else None)
    n = int(multihost_utils.broadcast_one_to_all(
        np.asarray(0 if data is None else data.size, np.int32)))
    buf = np.zeros(n, np.uint8) if data is None else data
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8)
    return json.loads(out.tobytes().decode())


def barrier(name: str) -> None:
    """Wait until every process reaches ``name`` (no-op with one process)."""
    if process_count() == 1:
        return
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
