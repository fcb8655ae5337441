"""Prioritised replay and n-step returns: the ``jdqn.replay`` contract."""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import x64

from jdqn import replay as R

_sample = jax.jit(R.sample, static_argnums=2)
ITEM = {"t": jnp.int32(0), "pf": jnp.zeros(4, jnp.float32), "a": jnp.zeros(4, jnp.int8)}


def _items(n: int, start: int = 0) -> dict:
    t = jnp.arange(start, start + n, dtype=jnp.int32)
    return {"t": t, "pf": jnp.tile(t[:, None].astype(jnp.float32), (1, 4)),
            "a": jnp.tile((t % 7)[:, None].astype(jnp.int8), (1, 4))}


def _filled(capacity: int, priorities: np.ndarray) -> R.ReplayState:
    st = R.add(R.init(capacity, ITEM), _items(len(priorities)))
    return R.update(st, jnp.arange(len(priorities)), jnp.asarray(priorities, jnp.float32))


def _chi2_critical(df: int, z: float) -> float:
    """Upper χ² quantile by the Wilson–Hilferty approximation (accurate to <0.1% at df ≈ 50)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def _exact_probs(priorities: np.ndarray, alpha: float) -> np.ndarray:
    q = np.asarray(priorities, np.float64) ** alpha
    q[np.asarray(priorities) <= 0] = 0.0
    return q / q.sum()


@jax.jit
def _draw_many(state: R.ReplayState, key: jax.Array) -> jax.Array:
    keys = jax.random.split(key, 200)
    return jax.vmap(lambda k: R.sample(state, k, 1000, 0.6, 0.4).indices)(keys).reshape(-1)


def chi_square_case() -> tuple[np.ndarray, R.ReplayState]:
    """50 filled slots of 64, two of them of priority 0."""
    rng = np.random.default_rng(0)
    pr = rng.uniform(0.01, 5.0, size=50)
    pr[[7, 31]] = 0.0  # zero priority: never sampled
    return pr, _filled(64, pr)  # 14 unfilled slots: never sampled


def assert_frequencies_match(idx: np.ndarray, pr: np.ndarray) -> None:
    """Slots drawn from :func:`chi_square_case` (α = 0.6): never an unfilled or zero-priority
    slot, and frequencies that pass a χ² test against ``p^α/Σp^α`` which α = 1 fails."""
    counts = np.bincount(idx, minlength=64)
    assert counts[50:].sum() == 0 and counts[7] == 0 and counts[31] == 0
    expected = _exact_probs(pr, 0.6) * idx.size
    cells = expected > 0
    chi2 = float(np.sum((counts[:50][cells] - expected[cells]) ** 2 / expected[cells]))
    # significance 0.001 (z = 3.0902); stratified draws only make χ² smaller than multinomial.
    crit = _chi2_critical(int(cells.sum()) - 1, 3.0902)
    assert chi2 < crit, f"χ² = {chi2:.1f} ≥ {crit:.1f}"
    # The same test rejects the wrong exponent (α = 1 frequencies against α = 0.6 draws).
    wrong = _exact_probs(pr, 1.0)[cells] * idx.size
    assert float(np.sum((counts[:50][cells] - wrong) ** 2 / wrong)) > crit


def test_sampling_frequencies_match_priorities_chi_square():
    pr, st = chi_square_case()
    assert_frequencies_match(np.asarray(_draw_many(st, jax.random.key(1))), pr)  # 200k samples


def test_a_million_priority_updates_leave_no_drift():
    cap, per_step, steps = 4096, 64, 15_625  # 10⁶ updates
    st = R.add(R.init(cap, ITEM), _items(cap))

    def body(s, key):
        k1, k2 = jax.random.split(key)
        idx = jax.random.randint(k1, (per_step,), 0, cap)
        # Priorities over six orders of magnitude, plus exact zeros.
        val = 10.0 ** jax.random.uniform(k2, (per_step,), minval=-4.0, maxval=2.0)
        val = jnp.where(idx % 97 == 0, 0.0, val)
        return R.update(s, idx, val), None

    run = jax.jit(lambda s, k: jax.lax.scan(body, s, jax.random.split(k, steps))[0])
    t0 = time.perf_counter()
    st = jax.block_until_ready(run(st, jax.random.key(7)))
    elapsed = time.perf_counter() - t0
    print(f"10^6 priority updates in a jitted scan: {elapsed:.2f} s (incl. compile)")
    pr = np.asarray(st.priorities)
    exact = _exact_probs(pr, 0.6)
    got = np.asarray(R.sampling_probabilities(st, 0.6), np.float64)
    # Float32 rounding of the rebuilt sums only: ≤ 1e-4 of an average slot's probability.
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-4 / cap)
    assert np.all(got[exact == 0] == 0)
    idx = np.asarray(_draw_many(st, jax.random.key(3)))
    assert np.all(pr[idx] > 0), "a zero-probability slot was sampled"


def test_large_buffer_probabilities_stay_accurate():
    # A single float32 cumsum over 2^20 slots rounds a slot's share by up to ~9% of an average
    # slot (measured 0.094); the two-level sums keep it at ~2e-4.
    cap = 1 << 20
    rng = np.random.default_rng(1)
    pr = rng.uniform(0.0, 1.0, size=cap).astype(np.float32)
    st = R.ReplayState(storage={}, priorities=jnp.asarray(pr),
                       position=jnp.int32(0), size=jnp.int32(cap), max_priority=jnp.float32(1))
    got = np.asarray(jax.jit(R.sampling_probabilities)(st, 1.0), np.float64)
    exact = _exact_probs(pr, 1.0)
    assert np.max(np.abs(got - exact)) * cap < 1e-3


@pytest.mark.parametrize("dist", ["trainer_like", "lognormal"])
def test_draw_points_resolve_slots_at_the_block_sums_precision(dist):
    """At a production capacity (C = 4 M, B = 16384: gpu.toml) a draw point written as one
    float32 at the scale of the total mass is resolved only to ulp(total) = 0.25, about a
    slot's mass: slots' draw probabilities came out 0.68–1.32× the intended (priorities
    uniform in [10, 14], the trainer's), and light slots of a lognormal spread could never be
    drawn. Every uniform the key can give, on a 2⁻²⁰ grid, for the last (largest) stratum: each
    slot inside it is hit as often as its mass says, to the grid's resolution."""
    from jdqn.replay.per import _masses, _stratified_slots, _sums

    cap, batch = 4_000_000, 16384
    rng = np.random.default_rng(0)
    pr = (rng.uniform(10.0, 14.0, cap) if dist == "trainer_like"
          else rng.lognormal(0.0, 2.0, cap)).astype(np.float32)
    st = R.ReplayState(storage={}, priorities=jnp.asarray(pr), position=jnp.int32(0),
                       size=jnp.int32(cap), max_priority=jnp.float32(pr.max()))
    local, block_cum = jax.jit(lambda st: _sums(st, 0.6, "xla")[:2])(st)
    q = np.asarray(jax.jit(_masses)(st, 0.6), np.float64)
    grid = 1 << 20
    uniform = jnp.arange(grid, dtype=jnp.float32) / grid  # exact multiples of 2^-20
    slots = np.asarray(jax.jit(_stratified_slots, static_argnums=4)(
        local, block_cum, jnp.full(grid, batch - 1, jnp.int32), uniform, batch))
    hits = np.bincount(slots - slots.min())
    inner = slice(1, hits.size - 1)  # the slots wholly inside the stratum
    seg = float(block_cum[-1]) / batch
    want = q[slots.min():slots.max() + 1][inner] / seg * grid  # expected hits
    got = hits[inner]
    assert got.size > 50 and np.median(want) > 500
    # Each slot's interval holds its expected count of grid points, ± 1 for where the grid
    # falls and ± 1 more per end for the offset's rounding at the block's scale (~0.6 grid
    # steps), and within the block sums' relative rounding. (Before: off by up to 32 %, and
    # light slots with hundreds expected got 0.)
    np.testing.assert_array_less(np.abs(got - want), 3.0 + 2e-3 * want)


def test_a_zero_mass_slot_never_counts_as_a_draw():
    """A priority-0 slot (a forced liquidation, a fold-start placeholder) can get an ulp of
    width in float32 cumulative sums that are not summed left to right (XLA's are not). Drawn,
    it took the batch's largest importance weight and shrank every real sample's to ~1e-16;
    now it is no sample: weight 0 and an index update() ignores."""
    cap = 1 << 20
    rng = np.random.default_rng(0)
    pr = rng.uniform(10.0, 14.0, cap).astype(np.float32)
    pr[rng.uniform(size=cap) < 0.1] = 0.0
    st = R.ReplayState(storage={"slot": jnp.arange(cap, dtype=jnp.int32)},
                       priorities=jnp.asarray(pr), position=jnp.int32(0), size=jnp.int32(cap),
                       max_priority=jnp.float32(14.0))
    from jdqn.replay.per import _stratified_slots, _sums

    local, block_cum = jax.jit(lambda st: _sums(st, 0.6, "xla")[:2])(st)
    loc = np.asarray(local)
    width = np.diff(np.concatenate([np.zeros((loc.shape[0], 1), np.float32), loc], 1),
                    axis=1).reshape(-1)[:cap]
    wide_zeros = np.flatnonzero((pr == 0) & (width > 0))
    assert wide_zeros.size > 0  # the hazard is real in these sums
    # A uniform that lands a stratum's point inside such a slot's interval: search the grid of
    # the float32 uniforms near the slot's position for one that _stratified_slots maps to it.
    batch, alpha = 16384, 0.6
    slot = int(wide_zeros[0])
    blk, j = divmod(slot, loc.shape[1])
    point = (float(block_cum[blk - 1]) if blk else 0.0) + float(loc[blk, j - 1])
    seg = float(block_cum[-1]) / batch
    stratum = int(point // seg)
    centre = point / seg - stratum
    cands = np.clip(centre + np.arange(-4096, 4096) * 2.0 ** -23, 0, 1 - 2.0 ** -23)
    hit = np.asarray(jax.jit(_stratified_slots, static_argnums=4)(
        local, block_cum, jnp.full(cands.size, stratum, jnp.int32),
        jnp.asarray(cands, jnp.float32), batch))
    if not (hit == slot).any():
        pytest.skip("no float32 uniform reaches the slot in these sums")
    u_star = np.float32(cands[hit == slot][0])
    real = jax.random.uniform

    def planted(key, shape, *a, **k):  # the key's uniforms, with that one in its stratum
        return real(key, shape).at[stratum].set(u_star)

    try:
        jax.random.uniform = planted
        s = R.sample(st, jax.random.key(0), batch, alpha, 0.4)
    finally:
        jax.random.uniform = real
    idx, w = np.asarray(s.indices), np.asarray(s.weights)
    assert int(np.asarray(s.items["slot"])[stratum]) == slot  # the point did land there
    assert idx[stratum] == cap and w[stratum] == 0.0
    others = np.delete(w, stratum)
    assert others.max() == 1.0 and others.min() > 0.5  # the real samples keep their weights
    new = R.update(st, s.indices, jnp.full(batch, 5.0), indices_sorted=True)
    assert float(new.priorities[slot]) == 0.0  # and the slot stays out of the replay


def test_all_zero_priorities_fall_back_to_uniform_over_filled_slots():
    prob = jax.jit(R.sampling_probabilities)
    st = _filled(16, np.zeros(10))  # 10 filled slots, every priority 0
    np.testing.assert_allclose(np.asarray(prob(st, 0.6)), np.r_[np.full(10, 0.1), np.zeros(6)],
                               rtol=1e-6)
    idx = np.asarray(_sample(st, jax.random.key(0), 64, 0.6, 0.4).indices)
    assert idx.min() >= 0 and idx.max() <= 9
    # One positive priority, however small against the rest's 0: it takes all the mass.
    st = _filled(16, np.r_[np.zeros(9), 1e-30])
    np.testing.assert_array_equal(np.asarray(prob(st, 0.6)), np.r_[np.zeros(9), 1.0, np.zeros(6)])
    # α = 0: uniform over the positive slots; zero-priority slots stay out.
    st = _filled(16, np.r_[np.ones(6), np.zeros(2), 10.0 ** np.arange(-4, 4)[:2]])
    want = np.r_[np.full(6, 1 / 8), 0, 0, 1 / 8, 1 / 8, np.zeros(6)]
    np.testing.assert_allclose(np.asarray(prob(st, 0.0)), want, rtol=1e-6)


def test_duplicate_indices_last_occurrence_wins():
    st = _filled(16, np.ones(10))
    new = R.update(st, jnp.array([3, 3, 5, 3, 5, 9]), jnp.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]))
    got = np.asarray(new.priorities)
    assert got[3] == 4.0 and got[5] == 5.0 and got[9] == 6.0
    # Against a sequential oracle on many random duplicate-heavy batches, under jit.
    rng = np.random.default_rng(0)
    upd = jax.jit(R.update)
    for _ in range(5):
        # Out-of-range slots on both sides are ignored; slots 13..15 (where -3..-1 would wrap
        # to) are never written otherwise.
        idx = rng.choice(np.r_[-3:12, 16:19], size=256)
        val = rng.uniform(0.1, 9.0, size=256).astype(np.float32)
        oracle = np.asarray(st.priorities).copy()
        for i, v in zip(idx, val, strict=True):
            if 0 <= i < oracle.size:
                oracle[i] = v
        np.testing.assert_array_equal(np.asarray(upd(st, jnp.asarray(idx), jnp.asarray(val))
                                                 .priorities), oracle)


def test_sampled_indices_are_sorted_and_the_sort_free_update_matches():
    # train_step passes per.sample's indices to update(indices_sorted=True), which skips the
    # sort: sample must return them non-decreasing — with duplicates (few slots, many draws),
    # zero-priority and unfilled slots, priorities over many orders of magnitude — and on such
    # input the sort-free update must equal the general one and the sequential oracle.
    rng = np.random.default_rng(5)
    upd = jax.jit(R.update, static_argnames="indices_sorted")
    for cap, filled, batch in ((64, 50, 1000), (4096, 4096, 256), (1 << 14, 9000, 4096)):
        pr = 10.0 ** rng.uniform(-6, 3, size=filled)
        pr[rng.random(filled) < 0.2] = 0.0
        st = _filled(cap, pr)
        for k in range(4):
            s = _sample(st, jax.random.key(k), batch, 0.6, 0.4)
            idx = np.asarray(s.indices)
            assert np.all(np.diff(idx) >= 0), "sampled indices are not sorted"
            val = rng.uniform(0.1, 9.0, size=batch).astype(np.float32)
            oracle = np.asarray(st.priorities).copy()
            for i, v in zip(idx, val, strict=True):
                oracle[i] = v
            if cap == 64:
                assert len(np.unique(idx)) < batch  # duplicates were exercised
            fast = upd(st, s.indices, jnp.asarray(val), indices_sorted=True)
            np.testing.assert_array_equal(np.asarray(fast.priorities), oracle)
            np.testing.assert_array_equal(
                np.asarray(fast.priorities), np.asarray(upd(st, s.indices, jnp.asarray(val)).priorities))
            assert float(fast.max_priority) == float(max(st.max_priority, val.max()))
    # Sorted input with out-of-range slots at both ends (their keys become C mid-sequence):
    st = _filled(8, np.ones(8))
    new = upd(st, jnp.array([-3, -1, 2, 2, 5, 5, 5, 8, 30]),
              jnp.array([9.0, 9, 3, 4, 5, 6, 7, 9, 9]), indices_sorted=True)
    np.testing.assert_array_equal(np.asarray(new.priorities), [1, 1, 4, 1, 1, 7, 1, 1])
    # Without the promise, an unsorted batch still gets last-occurrence semantics (the sort).
    new = upd(st, jnp.array([5, 2, 5, 2]), jnp.array([1.0, 2, 3, 4]))
    np.testing.assert_array_equal(np.asarray(new.priorities), [1, 1, 4, 1, 1, 3, 1, 1])


def test_out_of_range_indices_are_ignored_not_wrapped():
    # A negative slot once wrapped around Python-style (-1 wrote slot C-1).
    st = _filled(8, np.ones(8))
    new = R.update(st, jnp.array([-1, 2, 8, 100, 2, -8]), jnp.array([5.0, 6, 7, 8, 9, 4]))
    np.testing.assert_array_equal(np.asarray(new.priorities), [1, 1, 9, 1, 1, 1, 1, 1])
    assert float(new.max_priority) == 9.0  # ignored writes do not raise max_priority
    # Only out-of-range writes besides slot 0 (they must not be taken for duplicates of it),
    # an empty batch, and wide indices that would wrap into range if cast first.
    new = R.update(st, jnp.array([0, 9, -5]), jnp.array([3.0, 4.0, 5.0]))
    np.testing.assert_array_equal(np.asarray(new.priorities), [3, 1, 1, 1, 1, 1, 1, 1])
    assert R.update(st, jnp.zeros(0, jnp.int32), jnp.zeros(0)) is st
    with x64():  # int64 slots exist only with x64 on
        new = R.update(st, jnp.array([2**32 + 3, 5], jnp.int64), jnp.array([7.0, 6.0]))
    np.testing.assert_array_equal(np.asarray(new.priorities), [1, 1, 1, 1, 1, 6, 1, 1])


def test_priority_scatters_are_declared_unique():
    # Under --xla_gpu_deterministic_ops XLA rewrites every scatter it cannot prove
    # deterministic into a slower form; a scatter declared unique is left alone. The
    # declaration must also be true: every index distinct (checked above against the
    # sequential oracle, out-of-range writes included).
    st = _filled(16, np.ones(10))
    upd = jax.jit(R.update).lower(st, jnp.zeros(32, jnp.int32), jnp.ones(32)).as_text()
    add = jax.jit(R.add).lower(st, _items(4)).as_text()
    for text in (upd, add):
        n_scatter = text.count("\"stablehlo.scatter\"(")
        assert n_scatter >= 1 and text.count("unique_indices = true") == n_scatter


def test_add_wraps_around_and_tracks_size():
    st = R.init(5, ITEM)
    st = R.add(st, _items(3))
    assert int(st.size) == 3 and int(st.position) == 3
    st = R.add(st, _items(4, start=3))  # t = 3..6 → slots 3, 4, 0, 1
    assert int(st.size) == 5 and int(st.position) == 2
    np.testing.assert_array_equal(np.asarray(st.storage["t"]), [5, 6, 2, 3, 4])
    np.testing.assert_array_equal(np.asarray(st.storage["a"])[:, 0], [5, 6, 2, 3, 4])
    st = R.add(st, _items(12, start=100))  # more than the capacity: the last 5 survive
    assert int(st.position) == (2 + 12) % 5
    np.testing.assert_array_equal(np.sort(np.asarray(st.storage["t"])), np.arange(107, 112))
    assert np.asarray(st.storage["t"])[(int(st.position) - 1) % 5] == 111


def test_new_items_get_the_max_priority():
    st = _filled(8, np.array([0.5, 7.0, 1.0]))
    st = R.add(st, _items(2, start=3))
    np.testing.assert_array_equal(np.asarray(st.priorities)[:5], [0.5, 7.0, 1.0, 7.0, 7.0])


def test_only_filled_slots_are_sampled():
    st = R.add(R.init(100, ITEM), _items(10))
    s = _sample(st, jax.random.key(0), 4096, 0.6, 0.4)
    assert int(jnp.max(s.indices)) < 10 and int(jnp.min(s.indices)) >= 0
    np.testing.assert_array_equal(np.asarray(s.items["t"]), np.asarray(s.indices))


def test_sampling_is_reproducible_from_the_key():
    st = _filled(64, np.random.default_rng(2).uniform(0.1, 3.0, 40))
    a = _sample(st, jax.random.key(5), 32, 0.6, 0.4)
    b = _sample(st, jax.random.key(5), 32, 0.6, 0.4)
    c = _sample(st, jax.random.key(6), 32, 0.6, 0.4)
    np.testing.assert_array_equal(np.asarray(a.indices), np.asarray(b.indices))
    np.testing.assert_array_equal(np.asarray(a.weights), np.asarray(b.weights))
    assert not np.array_equal(np.asarray(a.indices), np.asarray(c.indices))


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_importance_weights_match_numpy(beta):
    pr = np.random.default_rng(3).uniform(0.01, 10.0, 30)
    st = _filled(48, pr)
    s = _sample(st, jax.random.key(0), 64, 0.7, beta)
    prob = _exact_probs(pr, 0.7)[np.asarray(s.indices)]
    w = (30 * prob) ** (-beta)
    np.testing.assert_allclose(np.asarray(s.weights), w / w.max(), rtol=1e-5)


def test_contract_bundle_and_bytes_per_transition():
    rb = R.PrioritisedReplay(capacity=32, alpha=0.6)
    item = {"t": jnp.int32(0), "pf": jnp.zeros(4), "pf_next": jnp.zeros(4),
            "a": jnp.zeros(4, jnp.int8), "r": jnp.float32(0), "disc": jnp.float32(0),
            "t_next": jnp.int32(0)}
    assert R.bytes_per_transition(item) == 4 + 16 + 16 + 4 + 4 + 4 + 4 + 4  # = 56 with priority

    @jax.jit
    def roundtrip(key):
        st = rb.add(rb.init(item), jax.tree.map(lambda x: jnp.stack([x] * 3), item))
        s = rb.sample(st, key, 4, 0.4)
        return rb.update(st, s.indices, jnp.full(4, 2.0))

    st = roundtrip(jax.random.key(0))
    assert int(st.size) == 3 and float(st.max_priority) == 2.0


# ------------------------------------------------------------------------------------------
# n-step returns
# ------------------------------------------------------------------------------------------


def test_nstep_returns_by_hand_with_a_done_in_the_middle():
    g = 0.9
    r = jnp.array([[1.0], [2.0], [3.0], [4.0], [5.0]])
    d = jnp.array([[0], [1], [0], [0], [0]])
    out = R.nstep_returns(r, d, g, 3)  # starts 0, 1, 2
    np.testing.assert_allclose(np.asarray(out.returns)[:, 0],
                               [1 + g * 2, 2.0, 3 + g * 4 + g * g * 5], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out.discounts)[:, 0], [0.0, 0.0, g**3], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.offsets)[:, 0], [2, 1, 3])


def test_nstep_truncation_stops_the_sum_but_bootstraps():
    g = 0.5
    r = jnp.array([[1.0], [2.0], [3.0]])
    out = R.nstep_returns(r, jnp.zeros((3, 1)), g, 3, truncated=jnp.array([[0], [1], [0]]))
    assert float(out.returns[0, 0]) == pytest.approx(1 + g * 2)
    assert float(out.discounts[0, 0]) == pytest.approx(g**2)
    assert int(out.offsets[0, 0]) == 2


def test_nstep_n1_is_one_step_td():
    r = jnp.arange(4.0)[:, None]
    d = jnp.array([[0], [0], [1], [0]])
    out = R.nstep_returns(r, d, 0.99, 1)
    np.testing.assert_array_equal(np.asarray(out.returns), np.asarray(r))
    np.testing.assert_allclose(np.asarray(out.discounts)[:, 0], [0.99, 0.99, 0.0, 0.99])


def test_carried_window_loses_no_transition():
    n, k, chunks, envs = 3, 4, 3, 2
    rng = np.random.default_rng(0)
    r = rng.normal(size=(k * chunks, envs)).astype(np.float32)
    d = rng.random((k * chunks, envs)) < 0.2
    whole = R.nstep_returns(jnp.asarray(r), jnp.asarray(d), 0.9, n)
    carry = R.carry_init(n, {"r": jnp.zeros(envs), "d": jnp.zeros(envs, bool)})
    got, valid_all = [], []
    for c in range(chunks):
        sl = slice(c * k, (c + 1) * k)
        win, valid, carry = R.window(carry, {"r": jnp.asarray(r[sl]), "d": jnp.asarray(d[sl])})
        out = R.nstep_returns(win["r"], win["d"], 0.9, n)
        got.append(np.asarray(out.returns)[np.asarray(valid[:, 0])])
        valid_all.append(np.asarray(valid))
    got = np.concatenate(got)
    # Every start with a complete window appears exactly once, in order.
    assert got.shape[0] == k * chunks - (n - 1)
    np.testing.assert_allclose(got, np.asarray(whole.returns)[:, :], rtol=1e-6)
    assert not valid_all[0][: n - 1].any() and valid_all[1].all()
