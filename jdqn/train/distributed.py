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
  TensorBoard, the report; the others print nothing per epoch;
* the processes must be started alike: :func:`same_everywhere` refuses a job whose processes
  differ in config, ``--resume`` or run folder (checked before anything is written), or in the
  data they read (checked after building it);
* a failure in a part that does not communicate (building the data, process 0's logging and
  report) is shared at the end of that part (:func:`together`): every process stops with it
  (the others name the process that failed) instead of waiting for a collective the failed
  process never reaches. A process that dies or fails inside a collective (an epoch, a
  checkpoint save) is JAX's to detect: the others abort after ``jax.distributed``'s heartbeat
  timeout (100 s).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from jdqn.config import ConfigError
from jdqn.errors import DistributedError

_ADDRESS = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})$")
CONNECT_TIMEOUT_S = 300.0  # how long a process waits for process 0's coordinator (JAX's own
#                            initialisation timeout)


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """Join the multi-process job (before anything starts JAX's backend). With all three
    arguments None, JAX detects the cluster; otherwise all three are needed."""
    given = [coordinator is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        raise ConfigError("--coordinator, --num-processes and --process-id go together (or "
                          "none of them, to let JAX detect the cluster: SLURM, Open MPI, ...)")
    if coordinator is not None:
        m = _ADDRESS.match(coordinator)
        if not m or not 0 < int(m["port"]) < 65536:
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
    if coordinator is not None and process_id != 0:
        # JAX aborts the process (no Python error) when the coordinator never answers: wait for
        # it here first, so that an unreachable address is a one-line error.
        _wait_for(m["host"].strip("[]"), int(m["port"]), coordinator)
    if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
        try:  # CPU processes exchange collectives through gloo (no effect on GPU)
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except (AttributeError, ValueError):  # pragma: no cover - option renamed
            pass
    try:
        jax.distributed.initialize(coordinator_address=coordinator,
                                   num_processes=num_processes, process_id=process_id)
    except (RuntimeError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ConfigError(f"parallel.distributed = true: could not join the multi-process "
                          f"job ({first}); give --coordinator, --num-processes and "
                          "--process-id, or run under a cluster JAX detects") from None


def _wait_for(host: str, port: int, coordinator: str) -> None:
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            with socket.create_connection((host, port), timeout=5.0):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise ConfigError(f"--coordinator {coordinator}: nothing answered there for "
                                  f"{CONNECT_TIMEOUT_S:.0f} s ({e.strerror or e}); start "
                                  "process 0 with the same address, on that host") from None
            time.sleep(0.5)


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


def allgather_json(obj: Any) -> list[Any]:
    """Every process's ``obj`` (anything JSON carries; numpy values become Python ones), in
    process order, on every process. Every process must call it at the same point. Buffers
    are padded to a power of two, so the few programs it compiles are reused."""
    if process_count() == 1:
        return [json.loads(json.dumps(obj, default=_plain))]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj, default=_plain).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int32)))
    width = max(1024, 1 << (int(sizes.max()) - 1).bit_length())
    buf = np.zeros(width, np.uint8)
    buf[:data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(sizes), width)
    return [json.loads(rows[i, :int(sizes.reshape(-1)[i])].tobytes().decode())
            for i in range(len(rows))]


def broadcast_json(obj: Any) -> Any:
    """Process 0's ``obj`` on every process (process 0 included, as JSON decodes it); a
    one-process run returns ``obj`` unchanged."""
    if process_count() == 1:
        return obj
    return allgather_json(obj if is_primary() else None)[0]


def agree(error: BaseException | None, what: str) -> None:
    """Share whether this process failed at ``what``: every process raises together — the one
    that failed its own error, the others a :class:`DistributedError` naming it."""
    if process_count() == 1:
        if error is not None:
            raise error
        return
    import jax

    msg = None if error is None else (str(error).strip().splitlines() or [""])[0][:500] \
        or type(error).__name__
    msgs = allgather_json(msg)
    if error is not None:
        raise error
    failed = [(i, m) for i, m in enumerate(msgs) if m is not None and i != jax.process_index()]
    if failed:
        i, m = failed[0]
        raise DistributedError(f"process {i} failed {what}: {m}")


@contextlib.contextmanager
def together(what: str) -> Iterator[None]:
    """Run a block that does not communicate, then :func:`agree` on how it went. (A block
    holding a collective cannot be wrapped: a process failing before it would leave the others
    waiting inside it.)"""
    error = None
    try:
        yield
    except (Exception, KeyboardInterrupt, SystemExit) as e:  # shared, then re-raised
        if process_count() == 1:
            raise
        error = e
    agree(error, what)


def same_everywhere(values: dict[str, Any]) -> None:
    """Refuse a job whose processes hold different ``values`` (every process raises, naming
    the first entry that differs and the first process that differs in it)."""
    if process_count() == 1:
        return
    everyone = allgather_json(values)
    keys = list(dict.fromkeys(k for v in everyone for k in v))  # the same order everywhere
    for key in keys:
        odd = [i for i, v in enumerate(everyone) if v.get(key) != everyone[0].get(key)]
        if odd:
            mine, theirs = (json.dumps(everyone[i].get(key))[:200] for i in (odd[0], 0))
            raise DistributedError(
                f"the processes were not started alike: process {odd[0]}'s {key} differs "
                f"from process 0's ({mine} vs {theirs}); start every process with the same "
                "config, --set overrides, --resume, --output-dir and data")


def shutdown() -> None:
    """Leave the multi-process job now (before ``os._exit``, which skips JAX's exit hook: the
    other processes would then wait for this one at JAX's shutdown barrier until its timeout).
    No-op when this process has not joined one."""
    import jax

    with contextlib.suppress(Exception):  # leaving anyway; JAX's timeout is the fallback
        if jax.distributed.is_initialized():
            jax.distributed.shutdown()
