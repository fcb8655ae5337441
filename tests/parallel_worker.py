"""Data-parallel checks on simulated CPU devices, run by ``test_parallel.py`` in a subprocess
(the device count must be set before JAX starts, and the test workers' JAX has started).

    python tests/parallel_worker.py OUT_DIR      # prints one JSON object of measurements
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax

N_DEV = 2
jax.config.update("jax_num_cpu_devices", N_DEV)

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import tiny_config

from jdqn.losses.moe import init_moe_state
from jdqn.losses.total import Batch, total_loss
from jdqn.train import job as job_lib
from jdqn.train import parallel
from jdqn.train.epoch import make_epoch_fn
from jdqn.train.state import seed_keys


def _data(x):
    return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def max_rel(a, b) -> float:
    """Largest |a − b| / (|b|_max + tiny) over the leaves of two trees."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        worst = max(worst, float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-30)))
    return worst


def gradient_check() -> dict:
    """The loss and gradient of a batch split over the devices (shard means, pmean) against one
    device's on the whole batch; a non-uniform gate so the load-balance term has a gradient.
    The control computes each device's load balance on its own share (what a naive split
    would do) and must differ."""
    # fuse_next_obs=false: the online and target forwards at s′ paired in one pass (float32)
    cfg = tiny_config("model.iqn=false", "model.fuse_next_obs=false", f"parallel.n_devices={N_DEV}")
    p = job_lib.prepare(cfg)
    net = p.learner.net
    env_params = job_lib.fold_env_params(cfg, p, 0)
    state = job_lib._fold_state(p, None, env_params, 0, seed_keys((0,)))
    # (on the host: the state comes out laid out over the mesh, and a mesh array captured by
    # the shard_map below would clash with its manual axes)
    params = jax.tree.map(lambda x: np.asarray(x[0]), state.params)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    params = jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape)
                                       for x, k in zip(leaves, keys, strict=True)])
    target = jax.tree.map(lambda x: 0.9 * x, params)
    b, w = 32, p.learner.width
    ks = jax.random.split(jax.random.key(3), 6)
    batch = Batch(obs=jax.random.normal(ks[0], (b, w)),
                  action=jnp.stack([jax.random.randint(jax.random.fold_in(ks[1], d), (b,), 0, a)
                                    for d, a in enumerate(cfg.model.branch_sizes)], 1),
                  reward=jax.random.normal(ks[2], (b,)),
                  discount=jax.random.uniform(ks[3], (b,), minval=0.5, maxval=0.95),
                  next_obs=jax.random.normal(ks[4], (b, w)),
                  weight=jax.random.uniform(ks[5], (b,), minval=0.2, maxval=1.0))
    moe = init_moe_state(cfg.model.n_experts)
    alpha = jnp.asarray(0.5, jnp.float32)
    key = jax.random.key(0)

    def loss(prm, bt, axis):
        (_, (comps, _, new_moe, _)), g = jax.value_and_grad(total_loss, has_aux=True)(
            prm, target, bt, key, moe, alpha, net=net, train_cfg=cfg.train, axis_name=axis)
        return comps, new_moe, g

    one = jax.jit(lambda prm, bt: loss(prm, bt, None))(params, batch)
    mesh = parallel.make_mesh(N_DEV)

    def split(axis_in_loss):
        def body(prm, bt):
            comps, new_moe, g = loss(prm, bt, axis_in_loss)
            return jax.lax.pmean((comps, g), "data") + (new_moe if axis_in_loss else
                                                         jax.lax.pmean(new_moe, "data"),)
        f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                          check_vma=False)
        return jax.jit(f)(params, batch)

    comps, g, new_moe = split("data")
    comps_naive, g_naive, _ = split(None)
    return {"grad_rel": max_rel(g, one[2]), "comps_rel": max_rel(comps, one[0]),
            "moe_rel": max_rel(new_moe, one[1]),
            "balance_value": float(comps["moe_balance"]),
            "balance_value_one": float(one[0]["moe_balance"]),
            "naive_grad_rel": max_rel(g_naive, one[2]),
            "naive_balance_rel": max_rel(comps_naive["moe_balance"], one[0]["moe_balance"])}


def job_config():
    """One config for the epoch and job checks, so they share the compiled epoch."""
    return tiny_config("train.seeds=[0, 1]", f"parallel.n_devices={N_DEV}",
                       "logging.tensorboard=false", "model.fuse_next_obs=false")


def _split_check(st) -> tuple[list[str], int, bool]:
    """(replicated leaves that differ between devices, sharded leaf count, env.t differs)."""
    specs = jax.tree.leaves(parallel.state_specs(st), is_leaf=lambda x: isinstance(x, P))
    diverged, sharded, env_t_differs = [], 0, False
    for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(st)[0], specs, strict=True):
        shards = [np.asarray(_data(s.data)) for s in x.addressable_shards]
        name = jax.tree_util.keystr(path)
        if len(spec) == 0:
            if not all(np.array_equal(shards[0], s) for s in shards[1:]):
                diverged.append(name)
        else:
            sharded += 1
            assert shards[0].shape[spec.index("data")] * N_DEV == x.shape[spec.index("data")]
            if name == ".env.t":
                env_t_differs = not np.array_equal(shards[0], shards[1])
    return diverged, sharded, env_t_differs


def _laid_out(st, mesh) -> bool:
    """Every leaf already carries the epoch's layout (replay and envs split, the rest
    replicated): the state was never whole on one device."""
    want = jax.tree.leaves(parallel.state_shardings(st, mesh))
    return all(x.sharding.is_equivalent_to(w, x.ndim)
               for x, w in zip(jax.tree.leaves(st), want, strict=True))


def _equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(_data(x)), np.asarray(_data(y)))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def epoch_check(out: Path) -> dict:
    """Two seeds, three epochs on the devices: replicated leaves identical on every device,
    one compilation, a second run bitwise equal. Then, on the same program: an epoch with
    seed 1 frozen (it must not move), a fold boundary (the reset policy applied outside
    shard_map), a checkpoint save + restore, and an epoch after each, all still replicated."""
    cfg = job_config()
    p = job_lib.prepare(cfg)
    env_params = job_lib.fold_env_params(cfg, p, 0)
    fn = make_epoch_fn(p.learner)
    fold0 = jnp.asarray(0, jnp.int32)

    def run():
        st = job_lib._fold_state(p, None, env_params, 0, seed_keys(cfg.train.seeds))
        out = []
        for _ in range(3):
            st, m = fn(st, env_params, fold0, jnp.asarray([True, True]))
            out.append(jax.device_get(m))
        return st, out

    mesh = parallel.make_mesh(N_DEV)
    fresh = job_lib._fold_state(p, None, env_params, 0, seed_keys(cfg.train.seeds))
    laid_out = {"fresh": _laid_out(fresh, mesh)}
    del fresh
    st, metrics = run()
    diverged, sharded, env_t_differs = _split_check(st)
    st2, _ = run()
    res = {"diverged": diverged, "n_sharded_leaves": sharded, "env_t_differs": env_t_differs,
           "repeat_bitwise": _equal(st, st2),
           "n_updates": [float(x) for x in metrics[-1]["n_updates"]],
           "replay_size": [int(x) for x in metrics[-1]["replay_size"]],
           "loss_finite": bool(np.all(np.isfinite(metrics[-1]["update"]["loss_total"])))}

    seed1 = job_lib.seed_slice(st, 1)
    st, _ = fn(st, env_params, fold0, jnp.asarray([True, False]))
    res["frozen_seed_unchanged"] = _equal(job_lib.seed_slice(st, 1), seed1)
    res["after_freeze"] = _split_check(st)[0]

    env1 = job_lib.fold_env_params(cfg, p, 1)
    st = job_lib._fold_state(p, st, env1, 1, seed_keys(cfg.train.seeds))
    laid_out["fold_reset"] = _laid_out(st, mesh)
    st, _ = fn(st, env1, jnp.asarray(1, jnp.int32), jnp.asarray([True, True]))
    res["after_fold_reset"] = _split_check(st)[0]

    from jdqn.train.checkpoint import Checkpointer

    ck = Checkpointer(out / "ck", fingerprint=job_lib.feature_schema(p))
    ck.save(1, st, metrics={"val_sharpe": 0.0, "fold": 1}, extra_json={})
    ck.close()
    ck = Checkpointer(out / "ck", fingerprint=job_lib.feature_schema(p))
    restored, _ = ck.restore(1, job_lib._placed_abstract(p.learner,
                                                         jax.eval_shape(lambda x: x, st)))
    ck.close()
    laid_out["restored"] = _laid_out(restored, mesh)
    res["laid_out"] = laid_out
    res["restore_equal"] = _equal(restored, st)
    st, _ = fn(restored, env1, jnp.asarray(1, jnp.int32), jnp.asarray([True, True]))
    res["after_restore"] = _split_check(st)[0]
    res["compilations"] = int(fn.compilations())
    res["schema"] = job_lib.feature_schema(p)
    return res


def randomness_check() -> dict:
    """Per-device randomness, shown on a state whose every shard holds the same block: with
    the key folded by device, the devices' exploration (collect) and PER draws (train_step)
    differ; unfolded they would be identical (the test fails on a missing fold). Also PER's
    importance weights (max 1 over the global batch) and the reward normaliser (the gathered
    statistics equal one device's on the global rewards, bitwise, for N > 4096)."""
    from jdqn.env.normalise import init_norm_state, normalise_reward
    from jdqn.replay import per
    from jdqn.train import epoch as epoch_lib

    cfg = job_config()
    p = job_lib.prepare(cfg)
    learner = p.learner
    env_params = job_lib.fold_env_params(cfg, p, 0)
    fn = make_epoch_fn(learner)
    st = job_lib._fold_state(p, None, env_params, 0, seed_keys(cfg.train.seeds))
    st, _ = fn(st, env_params, jnp.asarray(0, jnp.int32), jnp.asarray([True, True]))
    one = jax.device_get(job_lib.seed_slice(st, 0))
    specs = parallel.state_specs(one, seeded=False)
    leaves, tree = jax.tree.flatten(one)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))

    def dup(x, spec):  # device 0's block on every device
        if len(spec) == 0:
            return x
        ax = spec.index("data")
        block = jax.lax.slice_in_dim(x, 0, x.shape[ax] // N_DEV, axis=ax)
        return jnp.concatenate([block] * N_DEV, axis=ax)

    same = jax.tree.unflatten(tree, [dup(x, s) for x, s in zip(leaves, spec_leaves,
                                                               strict=True)])
    mesh = parallel.make_mesh(N_DEV)

    def collect_actions(s):
        s, chunk, _ = epoch_lib.collect(learner, s, env_params)
        return s, chunk.action

    collect = parallel.on_devices(collect_actions, N_DEV, P(None, "data"))
    _, actions = collect(same)
    half = actions.shape[1] // N_DEV
    step = parallel.on_devices(lambda s: epoch_lib.train_step(
        learner, s, env_params, jnp.asarray(0, jnp.int32)), N_DEV, P())
    after, _ = step(same)
    pr = np.asarray(after.replay.priorities)
    res = {"actions_differ": not np.array_equal(actions[:, :half], actions[:, half:]),
           "priorities_differ": not np.array_equal(pr[: pr.size // 2], pr[pr.size // 2:]),
           "start_identical": np.array_equal(np.asarray(same.env.t)[:half],
                                             np.asarray(same.env.t)[half:])}

    # PER importance weights: divided by their maximum over both devices' draws.
    pri = jax.random.uniform(jax.random.key(5), (2048,), minval=0.01, maxval=5.0)
    rs = per.init(2048, jnp.zeros((), jnp.float32)).replace(
        priorities=pri, size=jnp.asarray(1024, jnp.int32))  # 1024 filled slots per shard
    rs_specs = jax.tree.map(lambda _: P(), rs).replace(storage=P("data"), priorities=P("data"))

    def draw(r):
        k = jax.random.fold_in(jax.random.key(1), jax.lax.axis_index("data"))
        return per.sample(r, k, 64, 0.6, 0.4, axis_name="data").weights

    w = np.asarray(jax.jit(jax.shard_map(draw, mesh=mesh, in_specs=(rs_specs,),
                                         out_specs=P("data"), check_vma=False))(rs))
    res["weights_max"] = float(w.max())
    res["weights_shard_max"] = [float(w[:64].max()), float(w[64:].max())]

    # Reward normaliser: gathered statistics vs one device on the global rewards (2 seeds).
    # With a mask (episode_end = "truncate": forced liquidations out), the gathered mask.
    rewards = jax.random.normal(jax.random.key(2), (2, 10000)) * 0.01
    mask = jax.random.uniform(jax.random.key(3), (2, 10000)) < 0.9
    for mode in ("robust", "zscore"):
        ns = init_norm_state(cfg.env).replace(mode=mode)
        ns = jax.tree.map(lambda x: jnp.stack([x, x]), ns)
        for tag, m in (("", None), ("_masked", mask)):
            want = jax.jit(jax.vmap(normalise_reward))(ns, rewards, m)  # (jitted, as the trainer)
            got = jax.jit(jax.shard_map(
                jax.vmap(lambda n, r, mk: epoch_lib._normalise(n, r, "data", mk)),
                mesh=mesh, in_specs=(P(), P(None, "data"), P(None, "data")),
                out_specs=(P(), P(None, "data")), check_vma=False))(ns, rewards, m)
            res[f"normaliser_{mode}{tag}_bitwise"] = _equal(got, want)
    return res


def job_check(out: Path) -> dict:
    """The whole job on the devices (checkpoints written from sharded arrays), then --resume of
    the finished run: the restored state gives the same report."""
    cfg = job_config()
    rep = job_lib.run_job(cfg, out / "run", quiet=True)
    before = (out / "run" / "returns.csv").read_bytes()
    rep2 = job_lib.run_job(cfg, out / "run", resume=True, quiet=True)
    return {"test_sharpe": rep["test"]["sharpe"], "devices": rep["extra"]["devices"],
            "compilations": rep["extra"]["epoch_compilations"],
            "resume_same_returns": (out / "run" / "returns.csv").read_bytes() == before,
            "resume_same_sharpe": rep2["test"]["sharpe"] == rep["test"]["sharpe"]}


if __name__ == "__main__":
    import time

    out = Path(sys.argv[1])
    res: dict = {"devices": len(jax.devices())}
    for name, fn in (("gradient", gradient_check), ("epoch", lambda: epoch_check(out)),
                     ("randomness", randomness_check), ("job", lambda: job_check(out))):
        t = time.perf_counter()
        res[name] = fn()
        res[name]["seconds"] = round(time.perf_counter() - t, 1)
    print(json.dumps(res))
