"""Shared test set-up.

Compiled XLA programs are cached on disk across test processes (and the subprocesses the CLI
tests start), so each distinct program compiles once per machine rather than once per test.
"""

import os
from pathlib import Path

CACHE = Path(os.environ.setdefault("JDQN_TEST_XLA_CACHE",
                                   str(Path(__file__).resolve().parents[1] / ".pytest_cache"
                                       / "xla")))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
