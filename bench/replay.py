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
* ``n_sampleable``: the count that gates updates each iteration;
* with ``--impls xla,pallas`` (the default): ``sums_xla`` / ``sums_pallas``, the masses' block
  cumulative sums alone (XLA's passes against the :mod:`jdqn.pallas.per_sums` kernel, which
  runs in Pallas' interpreter off the GPU), and ``sample_pallas`` / ``sample_and_update_pallas``
  with the kernel; ``parity`` gives the sums' largest difference relative to the block totals
  and the share of sampled slots that agree.

``--profile N``: also trace ``N`` calls of ``sample`` per implementation under the JAX profiler
and report the device's busy time per call and its kernels (``bench/profile_step.summarise``).

    python bench/replay.py [--capacity 4000000] [--batch 16384] [--reps 200] [--impls xla,pallas]
                           [--warps 4,8] [--profile 20] [--out FILE]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from timing import emit, seconds_per_call

from jdqn.pallas import per_sums
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacity", type=int, default=4_000_000)
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--alpha", type=float, default=0.6)
    ap.add_argument("--beta", type=float, default=0.4)
    ap.add_argument("--impls", default="xla,pallas",
                    help="comma-separated implementations of the masses' cumulative sums")
    ap.add_argument("--warps", default="",
                    help="comma-separated warp counts: also time the kernel's sums at each")
    ap.add_argument("--profile", type=int, default=0,
                    help="trace this many sample calls per implementation (0: none)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    impls = [i for i in args.impls.split(",") if i]
    if not impls or any(i not in ("xla", "pallas") for i in impls):
        ap.error(f"--impls {args.impls!r}: expected a comma-separated subset of xla,pallas")
    st = filled(args.capacity)
    key = jax.random.key(1)
    b, a, be = args.batch, args.alpha, args.beta
    new_pr = jax.random.uniform(jax.random.key(2), (b,), minval=0.01, maxval=5.0)

    def with_pr(pr):
        return st.replace(priorities=pr)

    def sample(pr, impl="xla"):
        return per.sample(with_pr(pr), key, b, a, be, impl=impl)

    idx = jax.jit(sample)(st.priorities).indices

    def update(pr, sorted_):
        return per.update(with_pr(pr), idx, new_pr, indices_sorted=sorted_).priorities

    def both(pr, impl="xla"):
        s = per.sample(with_pr(pr), key, b, a, be, impl=impl)
        return per.update(with_pr(pr), s.indices, new_pr + s.weights,
                          indices_sorted=True).priorities

    def sums(pr, impl):
        if impl == "xla":
            return per_sums.reference(pr, st.size, a)
        return per_sums.block_cumsums(pr, st.size, a, jax.default_backend() != "gpu")[0]

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
    out = {"bench": "replay", "capacity": args.capacity, "batch": b, "alpha": a,
           "reps": args.reps, "impls": impls}
    for impl in impls:
        us[f"sums_{impl}"] = seconds_per_call(lambda p, i=impl: sums(p, i), (st.priorities,),
                                              args.reps)
        if impl != "xla":
            us[f"sample_{impl}"] = seconds_per_call(lambda p, i=impl: sample(p, i),
                                                    (st.priorities,), args.reps)
            us[f"sample_and_update_{impl}"] = seconds_per_call(
                lambda p, i=impl: both(p, i), (st.priorities,), args.reps)
    for w in (int(x) for x in args.warps.split(",") if x):
        us[f"sums_pallas_warps{w}"] = seconds_per_call(
            lambda p, w=w: per_sums.block_cumsums(p, st.size, a, jax.default_backend() != "gpu",
                                                  warps=w)[0], (st.priorities,), args.reps)
    if "xla" in impls and "pallas" in impls:
        ref, got = (jax.jit(sums, static_argnums=1)(st.priorities, i) for i in ("xla", "pallas"))
        scale = jnp.maximum(ref[:, -1:], 1e-30)  # each block's total
        same = jax.jit(sample, static_argnums=1)
        out["parity"] = {
            "sums_max_rel_diff": float(jnp.max(jnp.abs(got - ref) / scale)),
            "sums_bitwise_equal": bool(jnp.array_equal(got, ref)),
            "sampled_slots_equal": float(jnp.mean(same(st.priorities, "xla").indices
                                                  == same(st.priorities, "pallas").indices))}
    out["us"] = {k: round(1e6 * v, 2) for k, v in us.items()}
    if args.profile > 0:
        out["profile"] = {impl: _profile(lambda k, i=impl: per.sample(st, k, b, a, be, impl=i),
                                         key, args.profile) for impl in impls}
    emit(out, args.out)


def _profile(fn, key: jax.Array, n: int) -> dict:
    """The device's kernels over ``n`` calls of the jitted ``fn(key)`` (each with its own key)."""
    import tempfile

    import profile_step

    f = jax.jit(fn)
    jax.block_until_ready(f(key))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for i in range(n):
                r = f(jax.random.fold_in(key, i))
            jax.block_until_ready(r)
        s = profile_step.summarise(profile_step._load_trace(d), n, 30)
    return {"device_busy_us_per_call": s["device_busy_us_per_update"],
            "kernels_per_call": s["device_kernels_per_update"],
            "top": [{k: t[k] for k in ("name", "kind", "us_per_update")} for t in s["top"]]}


if __name__ == "__main__":
    main()
