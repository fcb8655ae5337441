"""The mechanism ``conftest._release_compiled_programs_when_mappings_run_high`` relies on: XLA's
CPU programs hold memory mappings while JAX caches them, and ``jax.clear_caches()`` gives them
back (a worker once crossed ``vm.max_map_count`` and died compiling)."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import pytest
from conftest import _memory_mappings


@pytest.mark.skipif(_memory_mappings() is None, reason="needs Linux's /proc")
def test_compiled_programs_hold_mappings_until_the_caches_are_cleared():
    jax.clear_caches()
    gc.collect()
    before = _memory_mappings()[0]
    for i in range(24):  # 24 distinct programs (the shape differs), each kept in JAX's caches
        jax.jit(lambda x: jnp.tanh(x @ x.T).sum(0) + jnp.cumsum(x, 1)[:, -1])(
            jnp.ones((8 + i, 4))).block_until_ready()
    held = _memory_mappings()[0]
    assert held > before + 24, (before, held)
    jax.clear_caches()
    gc.collect()
    after = _memory_mappings()[0]
    assert after < held - 24, (before, held, after)
    used, limit = _memory_mappings()
    assert 0 < used < limit
