"""Device-resident proportional prioritised replay (Schaul et al., 2016, "Prioritized Experience
Replay", arXiv:1511.05952) over an arbitrary pytree of items.

Axes: ``C`` capacity, ``B`` sample batch, ``n`` items added at once, ``S`` block size and ``G``
blocks of the two-level cumulative sum (``G·S ≥ C``).

Why no sum-tree: a float32 sum-tree that is *updated* incrementally accumulates rounding error in
its inner nodes until it samples zero-probability (empty) slots after millions of updates
(flashbax issue #52). Here the buffer stores only the raw priorities ``p [C]``; every call of
:func:`sample` rebuilds the cumulative sums from them, so there is no state that could drift.

Why two levels: a single float32 ``cumsum`` over ``C`` values rounds each slot's increment to the
ulp of the running total, i.e. to a relative error of about ``C·2⁻²⁴`` of an average slot — at
``C = 10⁷`` that is ±30% (worse: with ``p/max(p) ≤ 1`` the total is ≈ 10⁷ whose ulp is 1). We
split the buffer into ``G`` blocks of ``S ≈ √C`` slots, take a cumulative sum *within* each block
and one *over the block totals*; each level then has at most ``max(S, G) ≈ √C`` terms and a relative
error of about ``√C·2⁻²⁴`` (≈ 2·10⁻⁴ at ``C = 10⁷``; ≈ 10⁻⁶ at ``C = 10⁵``). The draw points are
located at that precision too (:func:`_stratified_slots`), not at the ulp of the total. Unfilled
slots are never drawn; a zero-priority slot can get an ulp of width in float32 sums that are not
summed left to right (XLA's), and a draw landing there is returned as no sample (weight 0,
index ``C``).

Sampling is stratified: the total mass is cut into ``B`` equal segments and one point is drawn
uniformly in each (as in the paper's reference implementation), which lowers the variance of the
batch composition. Everything is pure and jittable; the result depends only on the key.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

PyTree = Any


@struct.dataclass
class ReplayState:
    """A fixed-capacity ring buffer with priorities.

    storage: pytree, every leaf ``[C, ...]``; priorities: ``f32 [C]`` raw priorities ``p`` (α is
    applied at sampling time, 0 for unfilled slots); position: ``i32 []`` next slot to write;
    size: ``i32 []`` number of filled slots (≤ C); max_priority: ``f32 []`` largest priority ever
    given (new items get it, so that each is replayed at least once with high probability).
    """

    storage: PyTree
    priorities: jax.Array
    position: jax.Array
    size: jax.Array
    max_priority: jax.Array

    @property
    def capacity(self) -> int:
        return self.priorities.shape[0]


class Sample(NamedTuple):
    items: PyTree  # leaves [B, ...]
    indices: jax.Array  # i32 [B] slots, for update(); C for a draw that is no sample
    weights: jax.Array  # f32 [B] importance weights (N·P)^-β / max over the batch; 0 for those


def init(capacity: int, item_example: PyTree) -> ReplayState:
    """An empty buffer; ``item_example`` is one item (leaves without the capacity axis)."""
    if capacity < 1:
        raise ValueError(f"replay capacity must be ≥ 1, got {capacity}")
    storage = jax.tree.map(
        lambda x: jnp.zeros((capacity, *jnp.shape(x)), jnp.asarray(x).dtype), item_example)
    return ReplayState(
        storage=storage,
        priorities=jnp.zeros((capacity,), jnp.float32),
        position=jnp.zeros((), jnp.int32),
        size=jnp.zeros((), jnp.int32),
        max_priority=jnp.ones((), jnp.float32),
    )


def _batch_size(items: PyTree) -> int:
    sizes = {x.shape[0] for x in jax.tree.leaves(items)}
    if len(sizes) != 1:
        raise ValueError(f"items must share one leading (batch) axis, got sizes {sorted(sizes)}")
    return sizes.pop()


def add(state: ReplayState, items: PyTree) -> ReplayState:
    """Write a batch of ``n`` items (leaves ``[n, ...]``) at the ring position, wrapping around.

    New items get ``max_priority``. If ``n > C`` only the last ``C`` items are kept (exactly what
    writing them one after another would leave), so the scatter never sees a duplicate slot.
    """
    n = _batch_size(items)
    cap = state.capacity
    if n > cap:
        items = jax.tree.map(lambda x: x[n - cap:], items)
        start = (state.position + (n - cap)) % cap
        m = cap
    else:
        start, m = state.position, n
    idx = (start + jnp.arange(m, dtype=jnp.int32)) % cap
    # m ≤ C consecutive ring slots: distinct, so the scatters are declared unique (see update()).
    storage = jax.tree.map(lambda buf, x: buf.at[idx].set(x.astype(buf.dtype),
                                                          unique_indices=True),
                           state.storage, items)
    priorities = state.priorities.at[idx].set(state.max_priority, unique_indices=True)
    return state.replace(
        storage=storage,
        priorities=priorities,
        position=((state.position + n) % cap).astype(jnp.int32),
        size=jnp.minimum(state.size + n, cap).astype(jnp.int32),
    )


def n_sampleable(state: ReplayState) -> jax.Array:
    """Number of slots :func:`sample` can draw: filled, with a positive priority (i32 [])."""
    filled = jnp.arange(state.capacity) < state.size
    return jnp.sum(filled & (state.priorities > 0)).astype(jnp.int32)


def _blocks(capacity: int) -> tuple[int, int]:
    """(G, S): block count and a power-of-two block size ≈ √C."""
    s = 1 << max(0, math.ceil(math.log2(max(1.0, math.sqrt(capacity)))))
    return -(-capacity // s), s


def _masses(state: ReplayState, alpha: float | jax.Array) -> jax.Array:
    """Unnormalised sampling masses ``q [C] = (p / max p)^α`` on filled slots, 0 elsewhere.

    Dividing by the max keeps every mass in [0, 1] whatever the priority scale. If every filled
    slot has priority 0, this gives uniform sampling over the filled slots (α = 0: uniform over
    the filled slots of positive priority).
    """
    filled = jnp.arange(state.capacity) < state.size
    p = clamped(state.priorities, filled)
    return _mass(p, filled, jnp.max(p), alpha)


def clamped(priorities: jax.Array, filled: jax.Array) -> jax.Array:
    """The priorities the masses read: negatives as 0, 0 where not ``filled``."""
    return jnp.where(filled, jnp.maximum(priorities, 0.0), 0.0)


def _mass(p: jax.Array, filled: jax.Array, pmax: jax.Array,
          alpha: float | jax.Array) -> jax.Array:
    """The masses of slots with clamped priorities ``p`` (0 where not ``filled``), given the
    filled maximum ``pmax`` (:func:`_masses`, elementwise)."""
    q = jnp.where(p > 0, (p / jnp.where(pmax > 0, pmax, 1.0)) ** alpha, 0.0)
    # Every mass is 0 exactly when pmax is: a slot holding pmax > 0 has mass 1^α = 1 (any α).
    # Read off the max rather than a second pass over q (a C-long reduction per update).
    return jnp.where(pmax > 0, q, filled.astype(jnp.float32)).astype(jnp.float32)


def _sums(state: ReplayState, alpha: float | jax.Array,
          impl: str) -> tuple[jax.Array, jax.Array, Any]:
    """``(local [G, S], block_cum [G], mass_at)``: the two-level cumulative sums of the masses
    and a function giving the masses at slot indices, through the implementation ``impl``
    (``ModelConfig.impl``) selects: XLA's passes, or one Pallas kernel per block
    (:mod:`jdqn.pallas.per_sums`, ``"per_sums"``)."""
    from jdqn.pallas import use_pallas

    if use_pallas(impl, "per_sums"):
        from jdqn.pallas import per_sums

        local, pmax = per_sums.block_cumsums(state.priorities, state.size, alpha,
                                             interpret=jax.default_backend() != "gpu")

        def mass_at(idx: jax.Array) -> jax.Array:
            filled = idx < state.size
            return _mass(clamped(state.priorities[idx], filled), filled, pmax, alpha)

        return local, jnp.cumsum(local[:, -1]), mass_at
    q = _masses(state, alpha)
    local, block_cum = _cumsums(q)
    return local, block_cum, lambda idx: q[idx]


def _cumsums(q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two-level inclusive cumulative sums: within blocks ``[G, S]`` and over block totals ``[G]``."""
    g, s = _blocks(q.shape[0])
    local = jnp.cumsum(jnp.pad(q, (0, g * s - q.shape[0])).reshape(g, s), axis=1)
    return local, jnp.cumsum(local[:, -1])


def _first_above(get: Any, u: jax.Array, n: int) -> jax.Array:
    """Vectorised binary search: the first ``j`` in ``[0, n)`` with ``get(j) > u`` (``n`` if none).

    ``get(j)`` reads a non-decreasing sequence at int32 positions ``j`` (same shape as ``u``).
    """
    lo = jnp.zeros(u.shape, jnp.int32)
    hi = jnp.full(u.shape, n, jnp.int32)
    for _ in range(max(1, math.ceil(math.log2(n + 1)))):  # static, ~log2(√C) iterations
        mid = (lo + hi) // 2
        right = get(jnp.minimum(mid, n - 1)) <= u
        lo = jnp.where(right, mid + 1, lo)
        hi = jnp.where(right, hi, mid)
    return lo


def _split_segment(seg: jax.Array, batch: int) -> tuple[jax.Array, jax.Array]:
    """``seg = hi + lo`` with ``hi`` holding few enough significant bits that ``i · hi`` is exact
    in float32 for every stratum ``i < batch`` (``lo`` is then exact too)."""
    k = max(1, (batch - 1).bit_length())
    bits = jax.lax.bitcast_convert_type(seg.astype(jnp.float32), jnp.uint32)
    hi = jax.lax.bitcast_convert_type(bits & jnp.uint32(~((1 << k) - 1) & 0xFFFFFFFF),
                                      jnp.float32)
    return hi, seg - hi


def _stratified_slots(local: jax.Array, block_cum: jax.Array, stratum: jax.Array,
                      uniform: jax.Array, batch: int) -> jax.Array:
    """The slots holding the stratified points ``m = (stratum + uniform) · total / batch`` of
    the cumulative masses (``stratum`` int, ``uniform`` in [0, 1), same shape).

    The point is never one float32 at the scale of the total: there its ulp (0.25 at a total of
    4·10⁶, a replay of 4 M slots) is comparable to one slot's mass, so which slot a point hits
    would be resolved only to that — slots' draw probabilities off by tens of percent, and light
    slots never drawn — whatever the precision of the sums. ``m = a + b`` with ``a = stratum ·
    hi`` exact (:func:`_split_segment`) and ``b`` small; ``m`` rounded picks the block, and the
    offset inside it is ``(a − before) + b`` (``a − before`` exact or rounded at the block's
    scale), so the slot is located to the precision of the block's own sums (``√C·2⁻²⁴``). Near
    a block edge the rounded ``m`` may pick the neighbour; the offset's sign moves it back."""
    g, s = local.shape
    total = block_cum[-1]
    seg = total / batch
    hi, lo = _split_segment(seg, batch)
    i = stratum.astype(jnp.float32)
    a = i * hi
    b = i * lo + uniform * seg
    m = jnp.clip(a + b, 0.0, jnp.nextafter(total, jnp.float32(0)))
    blk = jnp.minimum(_first_above(lambda j: block_cum[j], m, g), g - 1)

    def offset(blk):
        """(offset of the point past the block's start, the block's width), both in the
        block-level sums."""
        before = jnp.where(blk > 0, block_cum[jnp.maximum(blk - 1, 0)], 0.0)
        return (a - before) + b, block_cum[blk] - before

    u_in, width = offset(blk)
    prev_w = jnp.where(blk > 1, block_cum[jnp.maximum(blk - 1, 0)]
                       - block_cum[jnp.maximum(blk - 2, 0)], block_cum[0])
    next_w = block_cum[jnp.minimum(blk + 1, g - 1)] - block_cum[blk]
    # (only into a neighbour with mass: a point never belongs to an empty block)
    blk = (blk - ((u_in < 0) & (blk > 0) & (prev_w > 0)).astype(jnp.int32)
           + ((u_in >= width) & (blk < g - 1) & (next_w > 0)).astype(jnp.int32))
    u_in, width = offset(blk)
    # The block's width in the block-level sums (rounded at the total's scale, ~ulp(total))
    # and its total in its own sums differ by that rounding: scale the offset from the one to
    # the other, so the difference is spread over the block's slots in proportion to their
    # masses rather than given to (or taken from) its first or last slot.
    block_total = local[blk, s - 1]
    u_in = u_in * (block_total / jnp.where(width > 0, width, 1.0))
    # Rounding can still leave the offset just outside the block: clamp into it.
    u_in = jnp.clip(u_in, 0.0, jnp.nextafter(block_total, jnp.float32(0)))
    j = jnp.minimum(_first_above(lambda k: local[blk, k], u_in, s), s - 1)
    return blk * s + j


def sampling_probabilities(state: ReplayState, alpha: float | jax.Array,
                           impl: str = "xla") -> jax.Array:
    """The exact distribution :func:`sample` draws from (``f32 [C]``), read off its own cumulative
    sums — for tests and diagnostics. Equals ``p^α / Σ p^α`` over filled slots up to float32
    rounding of the two-level sums. ``impl`` as in :func:`sample`."""
    local, block_cum, _ = _sums(state, alpha, impl)
    g = local.shape[0]
    # P(slot) = P(block) · P(slot | block), each the width of its interval in the float32 sums
    # that the two binary searches walk.
    slot_w = jnp.diff(jnp.concatenate([jnp.zeros((g, 1), jnp.float32), local], axis=1), axis=1)
    block_w = jnp.diff(jnp.concatenate([jnp.zeros((1,), jnp.float32), block_cum]))
    block_t = local[:, -1]
    p_block = block_w / block_cum[-1]
    probs = slot_w / jnp.where(block_t > 0, block_t, 1.0)[:, None] * p_block[:, None]
    return probs.reshape(-1)[: state.capacity].astype(jnp.float32)


def sample(state: ReplayState, key: jax.Array, batch: int, alpha: float | jax.Array,
           beta: float | jax.Array, axis_name: str | None = None, impl: str = "xla") -> Sample:
    """Draw ``batch`` items with ``P(i) = p_i^α / Σ_j p_j^α`` over the filled slots (stratified).

    Returns the items (leaves ``[B, ...]``), their slot indices ``i32 [B]`` — non-decreasing (the
    stratified points increase and the slot search is monotone in them), which
    ``update(..., indices_sorted=True)`` relies on — and importance weights
    ``f32 [B]``: ``w_i = (N·P(i))^-β`` divided by the largest ``w`` in the batch (so ``w ≤ 1``;
    Schaul et al. normalise by the max for stability; the batch max keeps one rarely-sampled slot
    elsewhere in the buffer from shrinking every weight). ``N`` = number of filled slots.
    A draw landing on a zero-mass slot (a priority-0 item given an ulp of width by the float32
    sums) is no sample: index ``C`` (``update`` ignores it) and weight 0, excluded from the max.
    Sampling an empty buffer is the caller's error (guard with ``size ≥ min_replay``); it returns
    slot 0 with weight 1 rather than NaN. Under data parallel (``axis_name``: each device samples
    its own replay shard) the maximum is taken over the global batch. ``impl``
    (``ModelConfig.impl``): how the masses' cumulative sums are built — ``"xla"``, or on the
    GPU under ``"auto"`` one Pallas kernel (:mod:`jdqn.pallas.per_sums`; the same sums to
    float32 rounding, not bitwise).
    """
    local, block_cum, mass_at = _sums(state, alpha, impl)
    total = block_cum[-1]
    idx = _stratified_slots(local, block_cum, jnp.arange(batch, dtype=jnp.int32),
                            jax.random.uniform(key, (batch,)), batch)
    idx = jnp.clip(idx, 0, jnp.maximum(state.size - 1, 0)).astype(jnp.int32)
    # Non-decreasing whatever the last ulp did (update(indices_sorted=True) relies on it).
    idx = jax.lax.cummax(idx)
    mass = mass_at(idx)
    # A slot of zero mass (a priority-0 item: a forced liquidation, a fold-start placeholder)
    # has an interval of zero width in exact arithmetic; XLA's float32 cumulative sums are not
    # summed left to right, so one can get an ulp of width. Such a draw is no sample: weight 0,
    # and index C, which update() ignores (its priority stays 0). Only the buffer being empty
    # (the caller's error) makes every draw one; it gets slot 0 with weight 1, as before.
    valid = (mass > 0) | (state.size == 0)
    prob = mass / jnp.where(total > 0, total, 1.0)
    n = jnp.maximum(state.size, 1).astype(jnp.float32)
    # log-space avoids overflow of (N·P)^-β for tiny P.
    logw = -beta * jnp.log(jnp.maximum(n * prob, jnp.finfo(jnp.float32).tiny))
    logw = jnp.where(valid, logw, -jnp.inf)
    top = jnp.max(logw)
    if axis_name is not None:
        top = jax.lax.pmax(top, axis_name)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.where(valid, jnp.exp(logw - top), 0.0)
    items = jax.tree.map(lambda buf: buf[idx], state.storage)
    return Sample(items, jnp.where(valid, idx, state.capacity).astype(jnp.int32),
                  weights.astype(jnp.float32))


def update(state: ReplayState, indices: jax.Array, priorities: jax.Array,
           indices_sorted: bool = False) -> ReplayState:
    """Set the priorities of slots ``indices [B]`` to ``priorities [B]`` (e.g. per-sample loss + ε).

    Duplicates: when a slot appears several times in ``indices`` the **last occurrence wins**
    (as if the updates were applied one after another). XLA's scatter leaves the winner of
    duplicate writes unspecified, so we sort, keep each slot's last occurrence and send every
    other write to its own slot past the end (``C + position``), where it is dropped. Every
    scatter index is then distinct, and the scatter says so (``unique_indices``): XLA may then
    treat it as deterministic, where under ``--xla_gpu_deterministic_ops`` it would otherwise
    rewrite it into a slower deterministic form. Indices outside ``[0, C)`` (negative ones too:
    no Python-style wrap-around) are ignored. Negative priorities are clamped to 0; non-finite
    ones are replaced by ``max_priority`` (the NaN monitor on the loss reports the cause — this
    only keeps the cumulative sums finite).

    ``indices_sorted=True`` promises ``indices`` non-decreasing — what :func:`sample` returns
    (its stratified points are increasing and the slot search is monotone) — so the sort is
    skipped: equal slots are already neighbours in batch order. The same result for such
    input (tested); for unsorted input the promise is broken and a duplicated slot's winner is
    unspecified.
    """
    cap = state.capacity
    indices = jnp.asarray(indices).reshape(-1)
    if indices.shape[0] == 0:
        return state
    # Out-of-range slots get the key C (compared before any cast, so a wide index cannot
    # wrap into range): they sort after every slot and are dropped.
    in_range = (indices >= 0) & (indices < cap)
    key = jnp.where(in_range, indices, cap).astype(jnp.int32)
    pr = priorities.astype(jnp.float32).reshape(-1)
    pr = jnp.where(jnp.isfinite(pr), jnp.maximum(pr, 0.0), state.max_priority)
    if indices_sorted:
        # In-range runs of one slot stay contiguous when out-of-range keys become C (they are
        # dropped below whatever their place), so "last of its run" is still the last occurrence.
        s_key, s_pr = key, pr
    else:
        order = jnp.argsort(key, stable=True)  # equal slots keep their batch order
        s_key, s_pr = key[order], pr[order]
    is_last = jnp.concatenate([s_key[:-1] != s_key[1:], jnp.ones((1,), bool)])
    keep = is_last & (s_key < cap)
    dropped = cap + jnp.arange(s_key.shape[0], dtype=jnp.int32)  # distinct, all past the end
    target = jnp.where(keep, s_key, dropped)
    new = state.priorities.at[target].set(s_pr, mode="drop", unique_indices=True)
    mp = jnp.maximum(state.max_priority, jnp.max(jnp.where(in_range, pr, 0.0)))
    return state.replace(priorities=new, max_priority=mp)


def bytes_per_transition(item_example: PyTree) -> int:
    """Storage bytes of one item plus its f32 priority."""
    leaves = jax.tree.leaves(item_example)
    return sum(int(jnp.asarray(x).nbytes) for x in leaves) + 4


class PrioritisedReplay(NamedTuple):
    """The ``jdqn.replay`` contract as a small stateless bundle: capacity and α fixed by config.

    ``PrioritisedReplay(capacity, alpha).sample(state, key, batch, beta)``; the module functions
    take α per call instead (e.g. for an α schedule).
    """

    capacity: int
    alpha: float

    def init(self, item_example: PyTree) -> ReplayState:
        return init(self.capacity, item_example)

    def add(self, state: ReplayState, items: PyTree) -> ReplayState:
        return add(state, items)

    def sample(self, state: ReplayState, key: jax.Array, batch: int,
               beta: float | jax.Array) -> Sample:
        return sample(state, key, batch, self.alpha, beta)

    def update(self, state: ReplayState, indices: jax.Array,
               priorities: jax.Array) -> ReplayState:
        return update(state, indices, priorities)
