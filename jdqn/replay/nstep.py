"""n-step returns over a trajectory chunk, vectorised over time and envs.

Axes: ``L`` steps in a window, ``N`` envs, ``S = L − n + 1`` start steps with a complete window.

For a start step ``t`` the transition sums rewards until the first episode end inside the window:

    m      = min(n, 1 + first k ≥ 0 with done[t+k] or truncated[t+k])    (steps summed, 1..n)
    G_t    = Σ_{k<m} γ^k · r[t+k]
    disc_t = γ^m · (1 − terminal)      terminal = done[t+m−1]   (the ``(1 − done)`` semantic)

and bootstraps from the *next observation of step t+m−1* (``offset = m``: the observation at
``t+m`` when no episode ended in between; at an episode end, the final observation recorded
with that step — with auto-reset envs the observation at ``t+m`` belongs to the next episode).
``done`` is a true termination (no bootstrap); ``truncated`` (e.g. a time limit or the end of a
data window) stops the sum but keeps the bootstrap ``γ^m``.

Chunk boundaries — nothing is lost: :func:`nstep_returns` emits only starts whose whole window of
``n`` steps is inside its input. The trainer keeps the last ``n − 1`` steps of each collected
chunk in a carry (:class:`NStepCarry`) and prepends them to the next chunk with
:func:`window`, so every collected step becomes exactly one start, one chunk later for the last
``n − 1`` steps of a chunk. The carry starts invalid (``valid = False``) at the beginning of a
fold; starts in the invalid part are flagged in ``valid`` and must not be inserted.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

PyTree = Any


class NStep(NamedTuple):
    returns: jax.Array  # f32 [S, N]  Σ_{k<m} γ^k r[t+k]
    discounts: jax.Array  # f32 [S, N]  γ^m · (1 − terminal)
    offsets: jax.Array  # i32 [S, N]  m ∈ [1, n]: bootstrap from the next-observation of t+m−1


def nstep_returns(rewards: jax.Array, dones: jax.Array, gamma: float | jax.Array, n: int,
                  truncated: jax.Array | None = None) -> NStep:
    """n-step returns for every start ``t ∈ [0, L−n]`` of a window ``rewards, dones [L, N]``."""
    steps = rewards.shape[0]
    if n < 1 or steps < n:
        raise ValueError(f"need 1 ≤ n ≤ window length; got n = {n}, length = {steps}")
    s = steps - n + 1
    dones = dones.astype(bool)
    ends = dones if truncated is None else dones | truncated.astype(bool)
    rewards = rewards.astype(jnp.float32)
    gamma = jnp.asarray(gamma, jnp.float32)
    ret = jnp.zeros((s, *rewards.shape[1:]), jnp.float32)
    alive = jnp.ones(ret.shape, bool)  # no episode end yet in [t, t+k)
    m = jnp.zeros(ret.shape, jnp.int32)
    terminal = jnp.zeros(ret.shape, bool)
    for k in range(n):  # static, n is small
        ret = ret + jnp.where(alive, gamma**k * rewards[k:k + s], 0.0)
        m = m + alive.astype(jnp.int32)
        terminal = terminal | (alive & dones[k:k + s])
        alive = alive & ~ends[k:k + s]
    disc = jnp.where(terminal, 0.0, gamma ** m.astype(jnp.float32))
    return NStep(ret, disc.astype(jnp.float32), m)


class NStepCarry(NamedTuple):
    """The last ``n − 1`` steps of the previous chunk (leaves ``[n−1, N, ...]``)."""

    tail: PyTree
    valid: jax.Array  # bool [n−1, N]; False until real steps have filled it


def carry_init(n: int, step_example: PyTree) -> NStepCarry:
    """An empty carry; ``step_example`` is one time step (leaves ``[N, ...]``)."""
    tail = jax.tree.map(lambda x: jnp.zeros((n - 1, *jnp.shape(x)), jnp.asarray(x).dtype),
                        step_example)
    n_envs = jax.tree.leaves(step_example)[0].shape[0]
    return NStepCarry(tail, jnp.zeros((n - 1, n_envs), bool))


def window(carry: NStepCarry, chunk: PyTree) -> tuple[PyTree, jax.Array, NStepCarry]:
    """Prepend the carry to a chunk (leaves ``[K, N, ...]``).

    Returns the window (leaves ``[n−1+K, N, ...]``), ``valid: bool [K, N]`` for the ``K`` starts
    that now have a complete window (start ``i`` is window step ``i``), and the new carry.
    """
    k = jax.tree.leaves(chunk)[0].shape[0]
    win = jax.tree.map(lambda a, b: jnp.concatenate([a, b.astype(a.dtype)]), carry.tail, chunk)
    valid_steps = jnp.concatenate([carry.valid, jnp.ones((k, carry.valid.shape[1]), bool)])
    new_carry = NStepCarry(jax.tree.map(lambda x: x[k:], win), valid_steps[k:])
    return win, valid_steps[:k], new_carry
