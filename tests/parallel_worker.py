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
    cfg = tiny_config("model.iqn=false", f"parallel.n_devices={N_DEV}")
    p = job_lib.prepare(cfg)
    net = p.learner.net
    env_params = job_lib.fold_env_params(cfg, p, 0)
    state = job_lib._fold_state(p, None, env_params, 0, seed_keys((0,)))
    params = jax.tree.map(lambda x: x[0], state.params)
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
    return tiny_config("train.seeds=[0, 1]", f"parallel.n_devices={N_DEV}", "train.n_folds=1",
                       "logging.tensorboard=false")


def epoch_check() -> dict:
    """Two seeds, three epochs on the devices: replicated leaves identical on every device,
    the devices' env shards different, one compilation, and a second run bitwise equal."""
    cfg = job_config()
    p = job_lib.prepare(cfg)
    env_params = job_lib.fold_env_params(cfg, p, 0)
    fn = make_epoch_fn(p.learner)

    def run():
        st = job_lib._fold_state(p, None, env_params, 0, seed_keys(cfg.train.seeds))
        out = []
        for _ in range(3):
            st, m = fn(st, env_params, jnp.asarray(0, jnp.int32), jnp.asarray([True, True]))
            out.append(jax.device_get(m))
        return st, out

    st, metrics = run()
    specs = jax.tree.leaves(parallel.state_specs(st), is_leaf=lambda x: isinstance(x, P))
    diverged, sharded, env_t_differs = [], 0, None
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
    st2, _ = run()
    repeat = all(np.array_equal(np.asarray(_data(a)), np.asarray(_data(b)))
                 for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(st2), strict=True))
    return {"diverged": diverged, "n_sharded_leaves": sharded, "env_t_differs": env_t_differs,
            "repeat_bitwise": repeat, "compilations": int(fn._cache_size()),
            "n_updates": [float(x) for x in metrics[-1]["n_updates"]],
            "replay_size": [int(x) for x in metrics[-1]["replay_size"]],
            "loss_finite": bool(np.all(np.isfinite(metrics[-1]["update"]["loss_total"])))}


def job_check(out: Path) -> dict:
    """The whole job on the devices (checkpoints written from sharded arrays), then --resume of
    the finished run: the restored state gives the same report."""
    cfg = job_config()
    rep = job_lib.run_job(cfg, out / "run", quiet=True)
    before = (out / "run" / "returns.csv").read_bytes()
    rep2 = job_lib.run_job(cfg, out / "run", resume=True, quiet=True)
    return {"test_sharpe": rep["test"]["sharpe"], "compilations": rep["extra"]["epoch_compilations"],
            "resume_same_returns": (out / "run" / "returns.csv").read_bytes() == before,
            "resume_same_sharpe": rep2["test"]["sharpe"] == rep["test"]["sharpe"]}


if __name__ == "__main__":
    import time

    out = Path(sys.argv[1])
    res: dict = {"devices": len(jax.devices())}
    for name, fn in (("gradient", gradient_check), ("epoch", epoch_check),
                     ("job", lambda: job_check(out))):
        t = time.perf_counter()
        res[name] = fn()
        res[name]["seconds"] = round(time.perf_counter() - t, 1)
    print(json.dumps(res))
