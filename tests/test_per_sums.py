"""The replay's block cumulative sums as a Pallas kernel (jdqn.pallas.per_sums) in Pallas'
interpreter: the sums against the replay's XLA path, the exact tail and empty blocks, the
sampler's contract under ``impl="pallas"`` (frequencies, never an unfilled or zero-priority
slot, weights), vmapping over seeds, and the dispatch of ``"auto"``/``"pallas"``/``"xla"``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import pallas_kernel_names
from test_replay import (
    ITEM,
    _exact_probs,
    _filled,
    _items,
    assert_frequencies_match,
    chi_square_case,
)

from jdqn import replay as R
from jdqn.pallas import per_sums
from jdqn.replay import per

_kernel = jax.jit(lambda p, n, a: per_sums.block_cumsums(p, n, a, interpret=True))


def _priorities(c: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = (10.0 ** rng.uniform(-4, 2, c)).astype(np.float32)  # six orders of magnitude
    p[rng.uniform(size=c) < 0.1] = 0.0
    p[::17] *= -1.0  # negatives count as 0
    return p


@pytest.mark.parametrize("capacity,size,alpha", [
    (5000, 5000, 0.6),   # full, C not a multiple of the block (S = 128, G = 40)
    (5000, 3333, 0.6),   # partly filled: one block straddles the size, the rest are empty
    (4097, 10, 1.0),     # one block of a few slots, the last block a single slot
    (1000, 1000, 0.0),   # α = 0: every positive priority the same mass
    (64, 1, 0.6), (1, 1, 0.6), (7, 0, 0.6),  # one slot, one filled slot, nothing filled
])
def test_kernel_sums_match_the_replays_xla_sums(capacity, size, alpha):
    p = jnp.asarray(_priorities(capacity, seed=capacity))
    got, pmax = _kernel(p, jnp.int32(size), alpha)
    want = per_sums.reference(p, size, alpha)
    g, s = per._blocks(capacity)
    assert got.shape == want.shape == (g, s) and got.dtype == jnp.float32
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    # float32 rounding of the running sums only (another scan order), per block
    np.testing.assert_allclose(got, want, rtol=0,
                               atol=4e-7 * max(float(np.max(want, initial=0.0)), 1e-30))
    filled = np.arange(g * s).reshape(g, s) < size
    assert float(pmax) == float(np.max(np.maximum(np.asarray(p)[:size], 0.0), initial=0.0))
    # Exactly: no mass past the filled size (each slot there repeats its block's filled prefix
    # end, bitwise), so an unfilled slot's interval is empty; a block with nothing filled is 0.
    flat = got.reshape(-1)
    if 0 < size < g * s:
        assert np.all(flat[size:(size // s + 1) * s] == flat[size - 1])
    assert np.all(got[~filled.any(axis=1)] == 0.0)
    # each filled slot's increment is its mass (to rounding): zero-priority ones get none
    q = np.asarray(per._masses(R.ReplayState({}, p, jnp.int32(0), jnp.int32(size),
                                             jnp.float32(1)), alpha), np.float64)
    inc = np.diff(np.concatenate([np.zeros((g, 1)), got], axis=1), axis=1).reshape(-1)
    np.testing.assert_allclose(inc[:capacity], q, rtol=0,
                               atol=4e-7 * max(float(np.max(want, initial=0.0)), 1e-30))


def test_all_zero_priorities_give_uniform_masses_over_the_filled_slots():
    got, pmax = _kernel(jnp.zeros(100, jnp.float32), jnp.int32(30), 0.6)
    flat = np.asarray(got).reshape(-1)
    assert float(pmax) == 0.0
    np.testing.assert_array_equal(flat[:30], np.arange(1, 31) - np.repeat(np.arange(0, 30, 16),
                                                                         16)[:30])
    np.testing.assert_array_equal(flat[30:32], [14.0, 14.0])  # the tail of block 1 = its end
    assert np.all(flat[32:] == 0.0)


def test_vmapped_over_seeds_each_gets_its_own_sums():
    p = jnp.stack([jnp.asarray(_priorities(600, seed=k)) for k in range(3)])
    sizes = jnp.array([600, 250, 0], jnp.int32)
    got, pmax = jax.vmap(lambda a, n: per_sums.block_cumsums(a, n, 0.6, True))(p, sizes)
    for k in range(3):
        one, m = _kernel(p[k], sizes[k], 0.6)
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(one))
        assert float(pmax[k]) == float(m)


_sample_pallas = jax.jit(lambda st, key, b, a, be: R.sample(st, key, b, a, be, impl="pallas"),
                         static_argnums=2)


def test_the_sampler_on_the_kernel_keeps_its_contract():
    pr, st = chi_square_case()
    draws = jax.jit(lambda s, key: jax.vmap(
        lambda k: R.sample(s, k, 1000, 0.6, 0.4, impl="pallas").indices)(
            jax.random.split(key, 50)).reshape(-1))
    assert_frequencies_match(np.asarray(draws(st, jax.random.key(1))), pr)  # 50k samples
    # the distribution it draws from, and the importance weights of a draw, as the XLA path's
    np.testing.assert_allclose(np.asarray(R.sampling_probabilities(st, 0.6, impl="pallas")),
                               np.asarray(R.sampling_probabilities(st, 0.6)), rtol=1e-5,
                               atol=1e-7)
    s = _sample_pallas(st, jax.random.key(0), 64, 0.7, 0.4)
    prob = _exact_probs(pr, 0.7)[np.asarray(s.indices)]
    w = (50 * prob) ** -0.4
    np.testing.assert_allclose(np.asarray(s.weights), w / w.max(), rtol=1e-5)
    assert np.all(np.diff(np.asarray(s.indices)) >= 0)  # non-decreasing, as update() assumes
    np.testing.assert_array_equal(np.asarray(s.items["t"]), np.asarray(s.indices))


def test_a_partly_filled_buffer_never_yields_an_unfilled_slot():
    st = R.add(R.init(5000, ITEM), _items(3333))  # all at max priority: uniform over 3333
    s = _sample_pallas(st, jax.random.key(0), 4096, 0.6, 0.4)
    idx = np.asarray(s.indices)
    assert idx.min() >= 0 and idx.max() < 3333
    assert np.bincount(idx // 128).size == 3333 // 128 + 1  # every filled block drawn from
    np.testing.assert_allclose(np.asarray(s.weights), 1.0, rtol=1e-5)


def test_impl_selects_the_kernel_and_auto_keeps_xla_off_the_gpu(monkeypatch):
    st = _filled(300, np.random.default_rng(4).uniform(0.1, 3.0, 200))
    key = jax.random.key(2)

    def kernels(impl):
        return pallas_kernel_names(jax.make_jaxpr(
            lambda s: R.sample(s, key, 32, 0.6, 0.4, impl=impl))(st).jaxpr)

    assert kernels("pallas") == ["per_block_cumsums"]
    assert kernels("xla") == [] and kernels("auto") == []  # CPU: "auto" is XLA's, same bits
    a, b = (R.sample(st, key, 32, 0.6, 0.4, impl=i) for i in ("auto", "xla"))
    np.testing.assert_array_equal(np.asarray(a.indices), np.asarray(b.indices))
    np.testing.assert_array_equal(np.asarray(a.weights), np.asarray(b.weights))
    from jdqn import pallas

    monkeypatch.setattr(pallas.jax, "default_backend", lambda: "gpu")
    assert kernels("auto") == ["per_block_cumsums"]  # measured faster on the H200
    with pytest.raises(ValueError, match="model.impl = 'cuda'"):
        kernels("cuda")
