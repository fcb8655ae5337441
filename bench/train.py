"""Training throughput: gradient updates/s and samples/s, env steps/s while collecting, s/epoch.

Prints one JSON object. Everything timed is the same jitted code the trainer runs
(``jdqn.train.epoch``): the update loop is ``lax.scan`` over ``train_step`` (PER sample → rebuild
observations → loss → clip+AdamW → Polyak → priorities → finite checks) on a replay filled to
its capacity with collected transitions, as in training once the first epoch has filled it (the
batch then gathers from the whole buffer; ``--fill batch`` fills only what the largest batch
needs, as versions before 2026-11-30 evening did: 262,144 items, which fit in the H200's L2,
though the update measured the same, 4.156 vs 4.162 ms);
collection is ``collect`` (network forward + per-branch exploration + env step + reward
normalisation) on N envs; the epoch is ``make_epoch_fn`` with the config's sizes.

    python bench/train.py                       # default model (configs/gpu.toml sizes), GPU
    python bench/train.py --quick               # small sizes, CPU smoke run
    python bench/train.py --dtype bfloat16      # bf16 mixed precision
    python bench/train.py --out r.json          # r.json rewritten after each section
    python bench/ab.py --variant base=. --variant nosp=. \
        --env 'nosp:JDQN_BENCH_PROBE=no_next_state'   # what the forwards at s′ cost the update
    python bench/train.py --config configs/multi_gpu.toml   # data parallel over every GPU

Timings exclude compilation (one warm-up call) and end with ``block_until_ready``; each figure
is the best of ``--repeats`` runs. Matmul precision is JAX's default unless ``--precision`` is
given (on Hopper the default float32 matmul uses TF32-class tensor-core math).
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from timing import best_of

import jdqn.pallas
from jdqn.config import apply_overrides, config_from_dict, load_config
from jdqn.losses.total import pairs_next_state_forwards
from jdqn.train import epoch as epoch_lib
from jdqn.train import job as job_lib
from jdqn.train import parallel, xla_options
from jdqn.train.state import seed_keys

REPO = Path(__file__).resolve().parents[1]


# Timing probes (wrong results, never the model), each removing one part of the update so its
# A/B against the model says what that part costs the update's wall time — where parts run
# beside each other under concurrent CUDA graphs, less than their kernels' sum (docs/model.md,
# "Where an update's time goes"):
# * "no_next_state": the loss's forwards at s′ (the online and target networks', through the
#   double-Q kernel or not) become zeros of their shapes;
# * "no_backward": the loss sees the online params through stop_gradient, so the gradients
#   are zeros and XLA drops the backward pass (the forwards, loss, optimiser and replay stay);
# * "no_network": the loss and its outputs become zeros of their shapes, leaving what is not
#   the network (PER sampling, the observation gathers, AdamW, Polyak, priorities, checks);
# * "no_loss": the TD (C51) and IQN loss terms become per-branch means of the online logits
#   and quantiles plus the means of what they read at s′ (so the forwards there stay), which
#   removes the projection, the cross-entropies and the quantile Huber loss, forward and
#   backward, while the network's forwards and backward pass stay;
# * "no_backward_grad_free": "no_backward" with the forward at s in its grad-free form (the
#   kernels the forwards at s′ take), so against "no_backward" it prices the differentiable
#   forward's form (its custom-VJP kernels, the residuals they write);
# * "no_q_diagnostics": the expected Q per action behind the update's Q statistics (over
#   `train.q_stats_rows` sampled rows of the online logits at s; every row before 2026-12-06,
#   when this probe priced that at 31 µs bf16 / 58 µs float32) becomes zeros, so XLA drops
#   its softmax-expectation pass.
# * "no_diagnostics": every diagnostic the loss returns (the Q statistics, target means, TD
#   per branch, the gate's utilisation and entropies, λ_eff) and its components other than
#   the two loss terms (c51, mse) become zeros (the taken logits' finite flag: true), so XLA
#   drops what only they read; what is left for the update's metrics is the loss terms, the
#   gradient norm, β and α. Prices the per-update metrics beside the Q statistics.
# JDQN_BENCH_PROBE sets one per variant under bench/ab.py (--env).
PROBES = ("", "no_next_state", "no_backward", "no_network", "no_loss", "no_backward_grad_free",
          "no_q_diagnostics", "no_diagnostics")


def apply_probe(probe: str) -> None:
    """Install a timing probe (:data:`PROBES`) in this process's loss; ``""`` leaves it as is."""
    if probe not in PROBES:
        raise SystemExit(f"--probe must be one of {PROBES[1:]}, not {probe!r}")
    if not probe:
        return
    from jdqn.losses import total

    def zeros_of(real, n_static=0):  # the first n_static positional arguments are not arrays
        def zeros_like_result(*args, **kw):
            static = args[:n_static]
            shapes = jax.eval_shape(lambda *a: real(*static, *a, **kw), *args[n_static:])
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        return zeros_like_result

    if probe == "no_next_state":  # their first argument is the network
        total.next_state_double_q = zeros_of(total.next_state_double_q, 1)
        total.next_state_forwards = zeros_of(total.next_state_forwards, 1)
    elif probe in ("no_backward", "no_backward_grad_free"):
        real = epoch_lib.total_loss

        def forward_only(params, *args, net, **kw):
            if probe == "no_backward_grad_free":
                net = _GradFree(net)
            return real(jax.lax.stop_gradient(params), *args, net=net, **kw)
        epoch_lib.total_loss = forward_only
    elif probe == "no_diagnostics":
        real = epoch_lib.total_loss

        def without_diagnostics(*args, **kw):
            loss, (comps, per_sample, moe, diag) = real(*args, **kw)
            zero = lambda tree: jax.tree.map(jnp.zeros_like, tree)
            comps = {k: v if k in ("td", "iqn", "moe_balance", "total") else zero(v)
                     for k, v in comps.items()}
            diag = {**zero(diag), "logits_finite": jnp.bool_(True)}
            return loss, (comps, per_sample, moe, diag)
        epoch_lib.total_loss = without_diagnostics
    elif probe == "no_q_diagnostics":
        total.expected_q = lambda logits, support: jnp.zeros(logits.shape[:-1], logits.dtype)
    elif probe == "no_loss":
        total.branching_td_loss_batch = _td_standin
        total.branching_iqn_loss_batch = _iqn_standin
    else:  # no_network
        epoch_lib.total_loss = zeros_of(epoch_lib.total_loss)


class _GradFree:
    """The network with every ``apply`` grad-free (the ``no_backward_grad_free`` probe)."""

    def __init__(self, net):
        self._net = net

    def __getattr__(self, name):
        return getattr(self._net, name)

    def apply(self, *args, **kw):
        return self._net.apply(*args, **{"grad_free": True, **kw})


def _mean_of(tree) -> jax.Array:
    """One float32 scalar from every array of ``tree`` (None leaves skipped)."""
    leaves = [jnp.mean(x.astype(jnp.float32)) for x in jax.tree.leaves(tree)]
    return sum(leaves, jnp.zeros((), jnp.float32))


def _branch_means(per_branch) -> jax.Array:
    """[B, D]: each branch's online output averaged over its actions and atoms/quantiles."""
    return jnp.stack([jnp.mean(x.astype(jnp.float32), axis=(1, 2)) for x in per_branch], 1)


def _td_standin(logits, action, reward, discount, target_logits, q_selector, v_min, v_max,
                alpha, impl="xla", next_probs=None):
    """The ``no_loss`` probe's TD terms: what they read, reduced, in the loss's shapes."""
    at_next = jax.lax.stop_gradient(_mean_of((target_logits, q_selector, next_probs)))
    x = (_branch_means(logits) + at_next + jnp.mean(reward + discount)).astype(logits[0].dtype)
    return {"td": x, "ce": x, "sq": x, "td_kl": x, "target_mean": x,
            "logits_finite": jnp.isfinite(x)}


def _iqn_standin(quantiles, taus, action, reward, discount, target_quantiles, q_selector,
                 v_min, v_max, kappa=1.0, next_action=None):
    """The ``no_loss`` probe's IQN term (as :func:`_td_standin`)."""
    at_next = jax.lax.stop_gradient(_mean_of((target_quantiles, q_selector, next_action)))
    return (_branch_means(quantiles) + at_next).astype(quantiles[0].dtype)


def _time(fn, repeats: int) -> float:
    return best_of(lambda: jax.block_until_ready(fn()), repeats)


def build(cfg):
    p = job_lib.prepare(cfg)
    env_params = job_lib.fold_env_params(cfg, p, 0)
    state = job_lib._fold_state(p, None, env_params, 0, seed_keys(cfg.train.seeds))
    return p, env_params, state


def filled_update_loop(cfg, n_updates: int, fill_to: str = "capacity"):
    """``(updates, state)``: a jitted ``lax.scan`` of ``n_updates`` train steps and a single-seed
    state whose replay holds real collected transitions: up to its capacity (``fill_to =
    "capacity"``) or four collection chunks (``"batch"``, enough for any batch). With
    ``parallel.n_devices > 1`` both run under ``shard_map`` on the devices, as the epoch does
    (each device updates on its B/D share; the reported loss is device 0's)."""
    p, env_params, state = build(cfg)
    learner = p.learner
    fold = jnp.asarray(0, jnp.int32)
    c = cfg.train
    per_chunk = c.collect_steps * cfg.env.n_envs  # global sizes, as replay_capacity
    n_chunks = 4 if fill_to == "batch" else max(4, -(-c.replay_capacity // per_chunk))

    @functools.partial(parallel.on_devices, n_devices=learner.n_devices,
                       gpu_graphs=cfg.train.gpu_graphs)
    def fill(st):
        def body(s, _):
            s, chunk, _ = epoch_lib.collect(learner, s, env_params)
            s, items, valid = epoch_lib.to_transitions(learner, s, chunk)
            return epoch_lib.insert(s, items, valid), None

        return jax.lax.scan(body, st, None, length=n_chunks)[0]

    @functools.partial(parallel.on_devices, n_devices=learner.n_devices, extra_out=P(),
                       gpu_graphs=cfg.train.gpu_graphs)
    def updates(st):
        def body(s, _):
            s, m = epoch_lib.train_step(learner, s, env_params, fold)
            return s, m["loss_total"]

        return jax.lax.scan(body, st, None, length=n_updates)

    return updates, fill(jax.tree.map(lambda x: x[0], state))


def bench_updates(cfg, batch: int, n_updates: int, repeats: int,
                  fill_to: str = "capacity") -> dict:
    cfg = config_from_dict(apply_overrides(_as_dict(cfg), [f"train.batch_size={batch}"]))
    updates, one = filled_update_loop(cfg, n_updates, fill_to)
    jax.block_until_ready(updates(one))  # compile + warm-up
    sec = _time(lambda: updates(one), repeats)
    per = sec / n_updates
    return {"batch": batch, "ms_per_update": 1e3 * per, "updates_per_s": 1.0 / per,
            "samples_per_s": batch / per, "replay_size": int(one.replay.size)}


def collect_loop(cfg, n_chunks: int = 8):
    """``(collect, state)``: a jitted ``lax.scan`` of ``n_chunks`` collection chunks (each
    ``train.collect_steps`` steps of all envs, as in the epoch) and a single-seed state."""
    p, env_params, state = build(cfg)
    learner = p.learner

    @functools.partial(parallel.on_devices, n_devices=learner.n_devices, extra_out=P(),
                       gpu_graphs=cfg.train.gpu_graphs)
    def collect(st):
        def body(s, _):
            s, _, stats = epoch_lib.collect(learner, s, env_params)
            return s, stats["reward_raw"]

        return jax.lax.scan(body, st, None, length=n_chunks)

    return collect, jax.tree.map(lambda x: x[0], state)


def bench_collect(cfg, repeats: int) -> dict:
    collect, one = collect_loop(cfg, 8)
    jax.block_until_ready(collect(one))
    sec = _time(lambda: collect(one), repeats)
    steps = 8 * cfg.train.collect_steps * cfg.env.n_envs
    return {"n_envs": cfg.env.n_envs, "env_steps_per_s": steps / sec,
            "note": "network forward + exploration + env step + reward normalisation"}


def bench_epoch(cfg, repeats: int) -> dict:
    p, env_params, state = build(cfg)
    fn = epoch_lib.make_epoch_fn(p.learner)
    fold = jnp.asarray(0, jnp.int32)
    state, _ = fn(state, env_params, fold)  # compile; fills the replay past min_replay
    jax.block_until_ready(state)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        state, _ = fn(state, env_params, fold)
        jax.block_until_ready(state)
        best = min(best, time.perf_counter() - t)
    c = cfg.train
    return {"seconds_per_epoch": best, "iters_per_epoch": c.iters_per_epoch,
            "updates_per_epoch": c.iters_per_epoch * c.updates_per_iter,
            "env_steps_per_epoch": c.iters_per_epoch * c.collect_steps * cfg.env.n_envs,
            "compilations": int(fn.compilations()), "peak_device_bytes": _peak_bytes()}


def _peak_bytes() -> int | None:
    """The device's peak allocation so far (None where JAX does not report it: the CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _as_dict(cfg) -> dict:
    from jdqn.config import to_dict

    return to_dict(cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "gpu.toml"))
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--precision", choices=("default", "high", "highest"), default="default")
    ap.add_argument("--batches", default="")
    ap.add_argument("--updates", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fill", choices=("capacity", "batch"), default="capacity",
                    help="fill the replay to its capacity before timing updates (as in "
                    "training), or only with four collection chunks (the older figures)")
    ap.add_argument("--skip-epoch", action="store_true")
    ap.add_argument("--skip-collect", action="store_true")
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="config override, e.g. --set model.fuse_next_obs=false")
    ap.add_argument("--pallas-kernels", default=None,
                    help="comma-separated kernels model.impl='auto' takes on the GPU, replacing "
                    "jdqn.pallas.GPU_VALIDATED for this run (to time a candidate kernel in the "
                    "full update before it is validated)")
    ap.add_argument("--probe", default=os.environ.get("JDQN_BENCH_PROBE", ""),
                    help="a timing probe that changes what the update computes (wrong "
                    "results): 'no_next_state' drops the forwards at s′, 'no_backward' the "
                    "backward pass, 'no_network' the whole loss, 'no_loss' the loss terms "
                    "(not the network), 'no_backward_grad_free' the backward pass with "
                    "the forward at s grad-free, 'no_q_diagnostics' the expected Q of every "
                    "action at s (default: the "
                    "JDQN_BENCH_PROBE environment variable, else none)")
    ap.add_argument("--out", default="", help="also write the JSON to this file after every "
                    "section, so a run stopped by a time limit keeps its finished sections "
                    "(\"complete\": false until the end)")
    args = ap.parse_args()
    apply_probe(args.probe)
    if args.pallas_kernels is not None:
        jdqn.pallas.GPU_VALIDATED = frozenset(k for k in args.pallas_kernels.split(",") if k)
    if args.precision != "default":
        jax.config.update("jax_default_matmul_precision", args.precision)

    sets = [f"model.matmul_dtype={args.dtype}", "data.cache_dir=''",
            "data.synthetic.n_bars=200000"]
    if args.quick:
        sets += ["env.n_envs=256", "env.episode_length=256", "train.replay_capacity=100000",
                 "train.min_replay=2000", "train.iters_per_epoch=10",
                 "train.collect_steps=8", "train.updates_per_iter=2", "train.batch_size=1024"]
    base = load_config(args.config, sets + args.sets)
    # what the epoch of this config compiles with; the update loop and collection pieces (one
    # seed's state) are compiled the same way (parallel.on_devices resolves the same setting)
    graphs = xla_options.resolve(base.train.gpu_graphs)
    batches = ([int(b) for b in args.batches.split(",")] if args.batches
               else ([256, 1024] if args.quick else [256, 4096, 16384]))
    n_up = 10 if args.quick else args.updates
    dev = jax.devices()[0]
    out = {
        "bench": "train", "config": Path(args.config).name, "quick": args.quick,
        "sets": args.sets, "probe": args.probe,
        "pallas_kernels": sorted(jdqn.pallas.GPU_VALIDATED),
        "fuse_next_obs": base.model.fuse_next_obs,
        "next_state_twin": pairs_next_state_forwards(base.model),
        "matmul_dtype": args.dtype, "matmul_precision": args.precision,
        "model": {k: getattr(base.model, k) for k in ("width", "n_grn_blocks", "n_experts",
                                                       "expert_hidden", "n_atoms", "iqn")},
        "device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
        "n_devices": base.parallel.n_devices, "device_count": jax.device_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "gpu_graphs": base.train.gpu_graphs,
        "gpu_graphs_resolved": graphs, "compiler_options": xla_options.compiler_options(graphs),
        "jax": jax.__version__,
        "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "complete": False, "replay_fill": args.fill, "updates": [],
    }

    def checkpoint() -> None:  # a run cut short by a time limit keeps what it measured
        if args.out:
            tmp = Path(args.out + ".tmp")
            tmp.write_text(json.dumps(out) + "\n")
            tmp.replace(args.out)

    for b in batches:
        out["updates"].append(bench_updates(base, b, n_up, args.repeats, args.fill))
        checkpoint()
    if not args.skip_collect:
        out["collect"] = bench_collect(base, args.repeats)
        checkpoint()
    if not args.skip_epoch:
        out["epoch"] = bench_epoch(base, max(1, args.repeats - 1))
    out["complete"] = True
    checkpoint()
    print(json.dumps(out))

if __name__ == "__main__":
    main()
