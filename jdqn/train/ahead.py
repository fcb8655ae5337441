"""Compile a run's programs ahead of their first call, beside other work.

Most of a job's first minute on a laptop is XLA compiling. On the 2-core CPU of 2026-12-01 the
quickstart traced the epoch program in 3.5 s and compiled it in 26 s, compiled the parameter
initialisation in 6.5 s, the validation backtest in 4 s, the baselines' backtest in 2.6 s and
the checkpoint checksums in 2 s — each at its first call, one after another, while XLA's
single-threaded passes and Python's tracing left the second core idle for much of it.

Here the epoch program and the baselines' backtest are lowered and compiled in a background
thread from shapes alone (``jax.jit(f).lower(abstract...).compile()`` fills the caches the
later call looks in, so that call runs the compiled program), while the main thread builds the
state and compiles the validation backtest, the best-parameters selection and the checksums
the same way; the first epoch call waits for its program. The programs are the same programs,
so results do not change (tested: bitwise the same run, and no program compiled twice).

Only an optimisation: a task that fails is dropped (the real call compiles the program itself
and raises there, in context) and logged at debug level. ``JDQN_COMPILE_AHEAD=0`` turns it
off. One-device, one-process runs only: a data-parallel epoch is placed by a wrapper at its
call, and a multi-host job's processes must compile in step.

A run that stops early (an error, a safety halt) closes its ``Ahead``: the tasks not yet started
are dropped, and at interpreter exit the one in progress is waited for (an XLA compilation
cannot be interrupted, and a thread still inside one when Python finalises crashed the process
with a segmentation fault on the H200 machine, after the run's own error message).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax

log = logging.getLogger(__name__)


def enabled(n_devices: int) -> bool:
    """Whether a run on ``n_devices`` compiles ahead (``JDQN_COMPILE_AHEAD`` ≠ ``0``, one
    device, one process)."""
    return (os.environ.get("JDQN_COMPILE_AHEAD", "1") != "0" and n_devices == 1
            and jax.process_count() == 1)


_LIVE: weakref.WeakSet[Ahead] = weakref.WeakSet()


@atexit.register
def _finish_at_exit() -> None:
    """Let every background compilation in progress finish before Python finalises."""
    for ahead in list(_LIVE):
        ahead.close(join=True)


class Ahead:
    """Named compile tasks: :meth:`submit` queues one for the background thread, :meth:`run`
    does one now; :meth:`wait` blocks until a submitted task is done. With ``on=False`` every
    method does nothing, so callers need no branches."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self._done: dict[str, threading.Event] = {}
        self._tasks: queue.SimpleQueue[tuple[str, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._closed = False
        self._thread: threading.Thread | None = None
        if on:
            # A daemon thread, so that one never closed cannot keep the process alive; the
            # exit hook above waits for its compilation in progress.
            self._thread = threading.Thread(target=self._work, name="jdqn-compile-ahead",
                                            daemon=True)
            self._thread.start()
            _LIVE.add(self)

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            name, fn = task
            if not self._closed:
                self._call(name, fn)
            self._done[name].set()

    @staticmethod
    def _call(name: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the real call compiles it again, raises there
            log.debug("compiling %s ahead failed: %s", name, e)

    def submit(self, name: str, fn: Callable[[], Any]) -> None:
        if self.on and not self._closed:
            self._done[name] = threading.Event()
            self._tasks.put((name, fn))

    def run(self, name: str, fn: Callable[[], Any]) -> None:
        if self.on:
            self._call(name, fn)

    def wait(self, name: str) -> None:
        """Block until the submitted task ``name`` is done (at once if none was submitted)."""
        done = self._done.get(name)
        if done is not None:
            done.wait()

    def close(self, join: bool = False) -> None:
        """Drop the tasks not yet started and stop the background thread after the one in
        progress; ``join``: wait for that one."""
        self._closed = True
        thread, self._thread = self._thread, None
        if thread is not None:
            self._tasks.put(None)
            if join:
                thread.join()
