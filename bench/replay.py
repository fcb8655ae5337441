"""Prioritised replay alone: the per-update cost of sampling and of the priority update.

Prints one JSON object. A replay of capacity ``C`` holding the trainer's item (the ``Transition``
of ``jdqn.train.state``: bar indices, portfolio slots, actions, return, discount) filled to
capacity with priorities over six orders of magnitude (a fifth of them 0), then, each timed
alone as ``bench/timing.seconds_per_call`` (a jitted ``fori_loop``, the priorities perturbed per
iteration so nothing is hoisted):

* ``sample``: :func:`jdqn.replay.per.sample` of ``B`` items (masses, two-level cumulative sums,
  binary searches, the items' gathers, importance weights);
* ``update_sorting`` / ``update_sorted``: :func:`jdqn.replay.per.update` of ``B`` sampled slots,
  the general form (a stable sort for last-occurrence-wins) and ``indices_sorted=True`` (what
  ``train_step`` uses: sampled slots are non-decreasing);
* ``sample_and_update``: both, as one update step does them (sorted form);
* ``n_sampleable``: the count that gates updates each iteration.

    python bench/replay.py [--capacity 4000000] [--batch 16384] [--reps 200] [--out FILE]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from timing import emit, seconds_per_call

from jdqn.replay import per
from jdqn.train.state import Transition


def filled(capacity: int, n_port: int = 7) -> per.ReplayState:
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    c = capacity
    items = Transition(
        t=jnp.arange(c, dtype=jnp.int32), port=jax.random.normal(k1, (c, n_port)),
        action=jnp.zeros((c, 4), jnp.int32), reward=jax.random.normal(k2, (c,)),
        discount=jnp.full((c,), 0.97**3, jnp.float32), next_t=jnp.arange(c, dtype=jnp.int32) + 3,
        next_port=jax.random.normal(k1, (c, n_port)))
    example = jax.tree.map(lambda x: x[0], items)
    st = per.init(c, example)
    st = per.add(st, items)
    u = jax.random.uniform(k3, (c,))
    pr = jnp.where(u < 0.2, 0.0, 10.0 ** (6.0 * u - 4.0))
    return st.replace(priorities=pr.astype(jnp.float32), max_priority=jnp.max(pr))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacity", type=int, default=4_000_000)
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--alpha", type=float, default=0.6)
    ap.add_argument("--beta", type=float, default=0.4)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    st = filled(args.capacity)
    key = jax.random.key(1)
    b, a, be = args.batch, args.alpha, args.beta
    new_pr = jax.random.uniform(jax.random.key(2), (b,), minval=0.01, maxval=5.0)

    def with_pr(pr):
        return st.replace(priorities=pr)

    def sample(pr):
        return per.sample(with_pr(pr), key, b, a, be)

    idx = jax.jit(sample)(st.priorities).indices

    def update(pr, sorted_):
        return per.update(with_pr(pr), idx, new_pr, indices_sorted=sorted_).priorities

    def both(pr):
        s = per.sample(with_pr(pr), key, b, a, be)
        return per.update(with_pr(pr), s.indices, new_pr + s.weights,
                          indices_sorted=True).priorities

    def count(pr):
        return per.n_sampleable(with_pr(pr))

    us = {
        "sample": seconds_per_call(sample, (st.priorities,), args.reps),
        "update_sorting": seconds_per_call(lambda p: update(p, False), (st.priorities,),
                                           args.reps),
        "update_sorted": seconds_per_call(lambda p: update(p, True), (st.priorities,),
                                          args.reps),
        "sample_and_update": seconds_per_call(both, (st.priorities,), args.reps),
        "n_sampleable": seconds_per_call(count, (st.priorities,), args.reps),
    }
    emit({"bench": "replay", "capacity": args.capacity, "batch": b, "alpha": a,
          "reps": args.reps, "us": {k: round(1e6 * v, 2) for k, v in us.items()}}, args.out)


if __name__ == "__main__":
    main()
