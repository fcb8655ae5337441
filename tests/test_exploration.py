"""Per-branch exploration (``jdqn.train.epoch.explore``): ε-greedy from one uniform draw for all
branches, and Boltzmann sampling."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdqn.config import Config
from jdqn.env.core import BRANCH_SIZES
from jdqn.train.epoch import epsilon, explore

N = 20_000


def _learner(**train):
    cfg = Config()
    return types.SimpleNamespace(cfg=dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, **train)))


def _q(seed=0, n=N):
    keys = jax.random.split(jax.random.key(seed), len(BRANCH_SIZES))
    return tuple(jax.random.normal(k, (n, a)) for k, a in zip(keys, BRANCH_SIZES, strict=True))


def _chi2_uniform(counts):
    counts = np.asarray(counts, np.float64)
    e = counts.sum() / counts.size
    return float(((counts - e) ** 2 / e).sum())


# 99.9 % quantiles of χ² with A − 1 degrees of freedom, A = 3 and 4
CHI2_999 = {2: 13.82, 3: 16.27}


def test_greedy_when_epsilon_is_zero():
    lr = _learner(eps_start=0.0, eps_end=0.0)
    q = _q()
    a = explore(lr, q, jax.random.key(1), jnp.int32(0))
    assert a.shape == (N, len(BRANCH_SIZES)) and a.dtype == jnp.int32
    for d, qd in enumerate(q):
        np.testing.assert_array_equal(a[:, d], jnp.argmax(qd, axis=-1))


def test_uniform_on_each_branch_when_epsilon_is_one():
    """Every branch draws on its own action count (4, 3, 3, 3): never out of range, each action
    about equally often (χ² at 99.9 %), the branches not copies of one another."""
    lr = _learner(eps_start=1.0, eps_end=1.0)
    a = np.asarray(explore(lr, _q(), jax.random.key(2), jnp.int32(0)))
    for d, size in enumerate(BRANCH_SIZES):
        assert a[:, d].min() == 0 and a[:, d].max() == size - 1
        assert _chi2_uniform(np.bincount(a[:, d], minlength=size)) < CHI2_999[size - 1]
    assert np.mean(a[:, 1] == a[:, 2]) < 0.4  # independent: 1/3 when equal by chance


@pytest.mark.parametrize("step", [0, 2500, 10_000])
def test_the_exploring_fraction_follows_the_schedule(step):
    """With Q constant over a branch's actions but for one, a draw away from the greedy action
    can only come from exploring: its frequency is ε·(A − 1)/A for ε at ``step``."""
    lr = _learner(eps_start=1.0, eps_end=0.1, eps_decay_steps=5000)
    q = tuple(jnp.zeros((N, a)).at[:, 0].set(1.0) for a in BRANCH_SIZES)
    a = np.asarray(explore(lr, q, jax.random.key(3), jnp.int32(step)))
    eps = float(epsilon(lr, jnp.int32(step)))
    for d, size in enumerate(BRANCH_SIZES):
        want = eps * (size - 1) / size
        sd = np.sqrt(want * (1 - want) / N)
        assert abs(np.mean(a[:, d] != 0) - want) < 5 * sd + 1e-9


def test_same_key_same_actions_other_key_other_actions():
    lr = _learner(eps_start=0.5, eps_end=0.5)
    q = _q()
    a1 = explore(lr, q, jax.random.key(4), jnp.int32(0))
    np.testing.assert_array_equal(a1, explore(lr, q, jax.random.key(4), jnp.int32(0)))
    assert np.any(np.asarray(a1) != np.asarray(explore(lr, q, jax.random.key(5), jnp.int32(0))))


def test_boltzmann_samples_the_softmax_of_each_branch():
    lr = _learner(exploration="boltzmann", temperature=0.5)
    logits = jnp.log(jnp.asarray([0.1, 0.2, 0.3, 0.4]))
    q = tuple(jnp.broadcast_to(logits[:a] * 0.5, (N, a)) for a in BRANCH_SIZES)
    a = np.asarray(explore(lr, q, jax.random.key(6), jnp.int32(0)))
    for d, size in enumerate(BRANCH_SIZES):
        p = np.asarray(jax.nn.softmax(logits[:size]))
        freq = np.bincount(a[:, d], minlength=size) / N
        np.testing.assert_allclose(freq, p, atol=5 * np.sqrt(p.max() / N))
