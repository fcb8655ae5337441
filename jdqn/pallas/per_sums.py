"""Pallas kernel: the prioritised replay's sampling masses and their block cumulative sums.

Every call of :func:`jdqn.replay.per.sample` rebuilds, from the raw priorities ``p [C]`` and the
filled size, the masses ``q = (p / max p)^α`` (0 on unfilled slots; uniform over the filled ones
when every priority is 0) and their inclusive cumulative sums within blocks of ``S`` slots
(``local [G, S]``, ``G·S ≥ C``; the two-level scheme of :mod:`jdqn.replay.per`, "Why two
levels"). XLA runs that as the masses' pass, a padding copy and a scan of several passes over
the 16 MB of a 4 M-slot buffer. :func:`block_cumsums` is one kernel, one program per block: it
reads the block's priorities once (a masked load: no padding copy), computes their masses and
writes their cumulative sum once. The maximum ``max p`` stays an XLA reduction before it.

The scan inside a block is Triton's (sequential within a thread, a fixed tree across threads):
deterministic, but not XLA's order, so the sums agree with :func:`reference` to float32
rounding, not bitwise. Two properties the sampler relies on are kept exactly: a slot past the
filled size holds the filled prefix's end (so its interval is empty and it is never drawn: the
kernel writes that value rather than scanning zeros), and a block with no filled slot is all
zeros. A filled slot of priority 0 inside a block gets an interval of width 0 or at most the
rounding of the running sum at a thread boundary (``≤ 2⁻²³`` of the block's mass), the same
bound as every other slot's rounding (``docs/replay_and_checkpoints.md``).

The oracle is :func:`reference` (the replay's own XLA path, ``per._cumsums(per._masses(...))``).

Measured on the H200 (2026-12-03, jax 0.11.2, ``bench/replay.py``, C = 4 M, B = 16384): the sums
30 µs against 85 for XLA's passes, ``sample`` 74 µs against 104 (``replay_h200_per_sums.json``);
the update at B = 16384 2.492–2.502 ms against 2.504–2.516 over three alternated rounds
(``train_h200_f32_per_sums_ab.json``), bf16 1.723–1.731 against 1.743–1.757
(``train_h200_bf16_per_sums_ab.json``); two ``gpu.toml`` runs bitwise identical
(``determinism_h200_per_sums.json``). So ``"auto"`` takes it on the GPU (``"per_sums"``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

Array = jax.Array

WARPS = 4


def reference(priorities: Array, size: Array, alpha: float | Array) -> Array:
    """The block cumulative sums ``[G, S]`` as :func:`jdqn.replay.per.sample` computes them in
    XLA."""
    from jdqn.replay import per

    state = per.ReplayState(storage={}, priorities=priorities, position=jnp.int32(0),
                            size=jnp.asarray(size, jnp.int32), max_priority=jnp.float32(1))
    return per._cumsums(per._masses(state, alpha))[0]


def _kernel(p_ref, prm_ref, n_ref, out_ref, *, s: int):
    size = n_ref[0]
    slot = pl.program_id(0) * s + jax.lax.broadcasted_iota(jnp.int32, (s,), 0)
    filled = slot < size
    p = jnp.maximum(pl_triton.load(p_ref, mask=filled, other=0.0), 0.0)
    pmax, alpha = prm_ref[0], prm_ref[1]
    # (p / max p)^α as exp(α·log(·)): with libdevice's powf the kernel took 39 µs instead of 30
    # at 4 M slots on the H200 (bench/results/replay_h200_per_sums*.json); the two agree to a
    # few ulp, far below the sums' own rounding.
    q = jnp.where(p > 0, jnp.exp(alpha * jnp.log(p / jnp.where(pmax > 0, pmax, 1.0))), 0.0)
    q = jnp.where(pmax > 0, q, filled.astype(jnp.float32))
    c = jnp.cumsum(q)
    end = jnp.sum(jnp.where(slot == size - 1, c, 0.0))  # one term at most: exact
    out_ref[...] = jnp.where(filled, c, end)


@functools.partial(jax.jit, static_argnames=("interpret", "warps"))
def block_cumsums(priorities: Array, size: Array, alpha: float | Array,
                  interpret: bool = False, warps: int = WARPS) -> tuple[Array, Array]:
    """``(local [G, S], max p)``: the block cumulative sums of the sampling masses over the
    first ``size`` slots of ``priorities [C]`` (float32), and the normaliser they used.
    ``interpret=True`` runs the kernel in Pallas' interpreter (CPU tests)."""
    from jdqn.replay.per import _blocks, clamped  # (G, S): the replay's two-level layout

    g, s = _blocks(priorities.shape[0])
    p = priorities.astype(jnp.float32)
    size = jnp.asarray(size, jnp.int32)
    pmax = jnp.max(clamped(p, jnp.arange(p.shape[0]) < size))  # the masses' normaliser
    prm = jnp.stack([pmax, jnp.asarray(alpha, jnp.float32)])
    local = pl.pallas_call(
        functools.partial(_kernel, s=s),
        out_shape=jax.ShapeDtypeStruct((g * s,), jnp.float32),
        grid=(g,),
        in_specs=[pl.BlockSpec((s,), lambda i: (i,)), pl.BlockSpec((2,), lambda i: (0,)),
                  pl.BlockSpec((1,), lambda i: (0,))],
        out_specs=pl.BlockSpec((s,), lambda i: (i,)),
        interpret=interpret,
        name="per_block_cumsums",
        compiler_params=pl_triton.CompilerParams(num_warps=warps),
    )(p, prm, size.reshape(1))
    return local.reshape(g, s), pmax
