"""The whole job: data → features → walk-forward training → test backtest → report.

    run_job ─ prepare (bars, features, fold plan, learner)
            ─ for each fold: normalise on its train window → reset state by policy
                ─ for each epoch: run_epoch (one jitted call, all seeds) → safety checks
                                  → validation backtest per seed → best params, early stopping
                                  → async checkpoint → log
            ─ test backtest of each seed's best params + baselines → report

Host-side loop state (fold, epoch, best validation Sharpe and patience per seed, fold metrics)
is saved with every checkpoint, so ``--resume`` continues exactly where the run stopped and ends
bitwise identical to an uninterrupted run on CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdqn import provenance
from jdqn.config import Config, ConfigError, LoggingConfig, dumps_toml
from jdqn.data import (
    SCHEMA_VERSION,
    Bars,
    FeatureSet,
    StateLayout,
    fit_normaliser,
    load_or_build,
    resolve_state_width,
)
from jdqn.data.bars import event_bar_seconds
from jdqn.env import core as env_core
from jdqn.errors import CheckpointError
from jdqn.evaluate.backtest import BacktestResult, compile_rollout, rollout
from jdqn.evaluate.baselines import compile_baselines, run_baselines
from jdqn.evaluate.metrics import compute_metrics, periods_per_year
from jdqn.evaluate.report import write_report, write_seed_summary
from jdqn.train import ahead as ahead_lib
from jdqn.train import distributed, parallel, safety
from jdqn.train.epoch import greedy_policy, make_epoch_fn, select_seeds
from jdqn.train.folds import (
    FoldPlan,
    check_eval_stride,
    check_eval_windows,
    check_momentum_lookback,
    plan_folds,
)
from jdqn.train.logger import RunLogger
from jdqn.train.policy import fold_reset_policy
from jdqn.train.reset import apply_reset, check_policy_covers
from jdqn.train.state import CHECKED_TENSORS, Learner, TrainState, init_state, seed_keys

VAL_KEYS = ("sharpe", "sortino", "calmar", "max_drawdown", "total_return", "n_trades",
            "hit_rate", "turnover")


# --------------------------------------------------------------------------------------------
# set-up
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Prepared:
    bars: Bars
    feats: FeatureSet
    layout: StateLayout
    plan: FoldPlan
    learner: Learner
    ppy: float
    cache_hit: bool


def prepare(cfg: Config) -> Prepared:
    parallel.resolve_n_devices(cfg)  # a device count the machine lacks: refused before the data
    bars, feats, hit = load_or_build(cfg)
    if cfg.env.check_tick_grid:
        env_core.check_tick_grid(cfg.env.tick_size, open=bars.open, high=bars.high,
                                 low=bars.low, close=bars.close)
    layout = StateLayout(feats.n_features,
                         resolve_state_width(feats.n_features, cfg.features.state_width))
    plan = plan_folds(len(bars.close), feats.warmup, cfg.train)
    check_eval_stride(plan, cfg.eval.stride)
    check_eval_windows(plan, cfg.eval.n_windows, cfg.eval.stride)
    if "momentum" in cfg.eval.baselines:
        check_momentum_lookback(plan, cfg.eval.momentum_lookback, cfg.eval.stride)
    shortest = min(f.train[1] - f.train[0] for f in plan.folds)
    if shortest < cfg.env.episode_length + 1:
        raise ConfigError(f"env.episode_length = {cfg.env.episode_length} does not fit the "
                          f"shortest train window ({shortest} bars, fold 0); use ≤ "
                          f"{shortest - 1}, fewer folds or more data")
    learner = Learner.create(cfg, feats.flow_idx, layout.width)
    bar_seconds = bars.bar_seconds
    if cfg.data.bar_type != "time":
        # Event bars: the mean in-session spacing of the bars before the test window only, so
        # the test window's trading pace cannot scale any reported Sharpe (the cached bars
        # carry the whole series' spacing).
        bar_seconds = event_bar_seconds(bars.ts[: plan.test[0]])
    return Prepared(bars, feats, layout, plan, learner,
                    periods_per_year(bar_seconds, cfg.eval), hit)


def fold_env_params(cfg: Config, p: Prepared, fold_index: int) -> env_core.EnvParams:
    """Env arrays for a fold: features normalised on that fold's train window only."""
    fold = p.plan.folds[fold_index]
    norm = fit_normaliser(p.feats.values, fold.train[0], fold.train[1],
                          cfg.features.normalisation, cfg.features.clip)
    b = p.bars
    return env_core.make_params(norm.apply(p.feats.values), b.open, b.high, b.low, b.close,
                                cfg.env, lo=fold.train[0], hi=fold.train[1], training=True,
                                state_width=p.layout.width,
                                portfolio_offset=p.layout.portfolio_offset)


def feature_schema(p: Prepared) -> str:
    """What a checkpoint belongs to, as ``features=…;data=…;config=…`` digests: the meaning of
    its observations (feature names, cache schema, state width, flow columns), the market data
    it was trained on (every bar's time and OHLCV) and the whole resolved config.

    Under data parallel a ``devices=D`` part names the device count.

    The checkpointer combines it with the state's tree structure, shapes and dtypes into the
    layout fingerprint that every restore checks, so a resume on changed data (which moves the
    fold windows: a new test window could overlap bars already used for validation) or under
    a changed config is refused, naming which part differs."""
    def digest(*parts: Any) -> str:
        h = hashlib.sha256()
        for part in parts:
            h.update(np.ascontiguousarray(part).tobytes() if isinstance(part, np.ndarray)
                     else json.dumps(part, sort_keys=True).encode())
        return h.hexdigest()[:16]

    b = p.bars
    features = digest({"features": list(p.feats.names), "schema": SCHEMA_VERSION,
                       "width": p.layout.width, "flow_idx": list(p.feats.flow_idx)})
    data = digest(len(b.close), b.ts, b.open, b.high, b.low, b.close, b.volume)
    # The config as run: `parallel.n_devices = 0` ("every device") is digested as the count it
    # resolved to, so the same file on another machine is another run (the replay is saved
    # as one ring per device: resumed on another count, its slots would be misread).
    cfg, n_dev = p.learner.cfg, p.learner.n_devices
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, n_devices=n_dev))
    config = digest(dumps_toml(cfg))
    schema = f"features={features};data={data};config={config}"
    return schema + (f";devices={n_dev}" if n_dev > 1 else "")


@functools.cache
def _greedy_fn(learner: Learner):
    """One policy function object per learner, so the backtest's jit cache is reused."""

    def policy(params, obs, ctx):
        del ctx
        return greedy_policy(learner, params, obs)

    return policy


def seed_slice(tree: Any, s: int) -> Any:
    return jax.tree.map(lambda x: x[s], tree)


def evaluate_params(cfg: Config, p: Prepared, env_params: env_core.EnvParams, params: Any,
                    lo: int, hi: int) -> BacktestResult:
    params = parallel.on_first_device(params, p.learner.n_devices)  # one device backtests
    return rollout(env_params, _greedy_fn(p.learner), params, lo=lo, hi=hi,
                   n_windows=cfg.eval.n_windows, stride=cfg.eval.stride)


@functools.partial(jax.jit, donate_argnums=(0,))
def _select_best(state: TrainState, improved: jax.Array) -> TrainState:
    return state.replace(best_params=select_seeds(improved, state.params, state.best_params))


# --------------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------------


def _fresh_progress(n_seeds: int) -> dict[str, Any]:
    return {"fold": 0, "epoch": -1, "fold_done": False, "global_epoch": 0,
            "best_val": [None] * n_seeds, "best_val_metrics": [None] * n_seeds,
            "bad_epochs": [0] * n_seeds, "epochs_trained": [0] * n_seeds, "prev_q": None,
            "fold_metrics": []}


def _state_jit(learner: Learner, fn, **kw):
    """``jax.jit(fn)`` for a ``fn`` that returns a multi-seed state; under data parallel the
    state comes out laid out over the mesh as the epoch lays it out (replay and envs split,
    the rest replicated), so it is never whole on one device (nor, multi-host, on one host)."""
    if learner.n_devices == 1:
        return jax.jit(fn, **kw)
    mesh = parallel.make_mesh(learner.n_devices)
    compiled: dict[str, Any] = {}

    def call(*args):
        if "fn" not in compiled:
            shardings = parallel.state_shardings(jax.eval_shape(fn, *args), mesh)
            compiled["fn"] = jax.jit(fn, out_shardings=shardings, **kw)
        return compiled["fn"](*args)

    return call


@functools.cache
def _init_fn(learner: Learner):
    return _state_jit(learner, jax.vmap(lambda k, ep: init_state(learner, k, ep),
                                        in_axes=(0, None)))


@functools.cache
def _reset_fn(learner: Learner):
    policy = fold_reset_policy(learner.cfg.train)
    return _state_jit(learner, jax.vmap(lambda st, fr: apply_reset(policy, st, None, fr)),
                      donate_argnums=(0,))


def _placed_abstract(learner: Learner, abstract: Any) -> Any:
    """The restore target: under data parallel each leaf carries the sharding the epoch uses,
    so orbax reads every process's shards straight onto its devices."""
    if learner.n_devices == 1:
        return abstract
    shardings = parallel.state_shardings(abstract, parallel.make_mesh(learner.n_devices))
    return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                        abstract, shardings)


def _fold_state(p: Prepared, state: TrainState | None, env_params: env_core.EnvParams,
                fold: int, keys: jax.Array) -> TrainState:
    """Fold 0: a fresh state. Later folds: each seed's best-by-validation params of the fold
    just finished (the ones its test backtest would use, not those of the epochs after its best)
    become its params, then the declarative reset policy runs over every leaf."""
    learner = p.learner
    fold_keys = jax.vmap(lambda k: jax.random.fold_in(k, 1_000 + fold))(keys)
    fresh = _init_fn(learner)(fold_keys, env_params)
    if state is None:
        return fresh
    check_policy_covers(fold_reset_policy(learner.cfg.train), state)
    state = state.replace(params=state.best_params)
    return _reset_fn(learner)(state, fresh)


def _held_outputs(out: Path) -> list[str]:
    ckdir = out / "checkpoints"
    held = [n for n in ("metrics.jsonl", "report.json", "returns.csv") if (out / n).exists()]
    if ckdir.is_dir() and any(ckdir.iterdir()):
        held.append("checkpoints/")
    return held


def run_job(cfg: Config, out: Path, resume: bool = False, quiet: bool = False) -> dict[str, Any]:
    """Run (or resume) the whole job into ``out``; returns the report of the first seed (an
    empty dict on the processes other than 0 of a multi-host job, which write no report)."""
    t0 = time.perf_counter()
    out = Path(out)
    provenance.warn_if_untested_jax()
    if cfg.parallel.distributed and not jax.distributed.is_initialized():
        raise ConfigError("parallel.distributed = true: this process has not joined a "
                          "multi-process job; call jdqn.train.distributed.initialize(...) "
                          "before JAX starts (the CLI does, from --coordinator/--num-processes/"
                          "--process-id)")
    if not resume:
        # The CLI refuses a non-empty folder itself (and then writes config.toml into it); a
        # caller of this function gets the same protection for another run's outputs.
        # Multi-host: process 0 looks (the others would see its first files); its refusal
        # reaches the others through `together`.
        with distributed.together("checking the run folder"):
            held = _held_outputs(out) if distributed.is_primary() else []
            if held:
                raise CheckpointError(f"{out} already holds a run ({', '.join(held)}); resume "
                                      "it (resume=True, CLI --resume) or choose another folder")
    with distributed.together("creating the run folder"):
        out.mkdir(parents=True, exist_ok=True)
    with distributed.together("building the data"):
        p = prepare(cfg)
    # Multi-host: every process must have read the same data under the same config.
    distributed.same_everywhere({"data and config digest": feature_schema(p)})
    keys = seed_keys(cfg.train.seeds)
    epoch_fn = make_epoch_fn(p.learner)
    env_params = fold_env_params(cfg, p, 0)
    abstract = jax.eval_shape(jax.vmap(lambda k: init_state(p.learner, k, env_params)), keys)
    ahead = ahead_lib.Ahead(False)

    ckpt = None
    if cfg.checkpoint.enabled:
        from jdqn.train.checkpoint import Checkpointer

        ckpt = Checkpointer(out / "checkpoints", keep_best=cfg.checkpoint.keep_best,
                            keep_latest=cfg.checkpoint.keep_latest,
                            async_save=cfg.checkpoint.async_save, fingerprint=feature_schema(p))
    elif resume:
        raise CheckpointError("--resume needs checkpoint.enabled = true")
    try:
        progress = _fresh_progress(len(cfg.train.seeds))
        state: TrainState | None = None
        if resume:
            if ckpt.latest_step() is None:
                raise CheckpointError(
                    f"--resume: no checkpoint found in {out / 'checkpoints'}: the run stopped "
                    "before its first checkpoint, so there is nothing to resume; start it again "
                    "in a new --output-dir (or delete this folder)")
            state, progress = ckpt.restore(ckpt.latest_step(),
                                           _placed_abstract(p.learner, abstract))
            fresh = _fresh_progress(len(cfg.train.seeds))
            lacking = sorted(set(fresh) - set(progress if isinstance(progress, dict) else {}))
            if lacking:
                raise CheckpointError(
                    f"{out / 'checkpoints' / str(ckpt.latest_step())}: its loop state (extra) "
                    f"lacks {', '.join(lacking)}; the checkpoint is damaged or not this "
                    "program's")
        primary = distributed.is_primary()  # multi-host: process 0 alone logs
        with distributed.together("opening the logs"):
            logger = RunLogger(out, cfg.logging if primary else
                               LoggingConfig(False, False, False), plan_epochs(cfg),
                               quiet=quiet or not primary,
                               resume_epoch=progress["global_epoch"] if resume else None)
        logger.advance(epochs_done(progress, cfg.train.epochs_per_fold))
        # Started once the run's folders, logs and any restore are in place, so that an error
        # there does not wait for a compilation.
        ahead = _compile_ahead(cfg, p, epoch_fn, abstract, env_params)
        try:
            state, progress = _walk_forward(cfg, p, epoch_fn, keys, state, progress, ckpt,
                                            logger, ahead)
        finally:
            logger.close()
        if ckpt is not None:
            ckpt.close()  # waits for the last asynchronous save
            ckpt = None
        ahead.wait("baselines")
    finally:
        ahead.close()
        if ckpt is not None:  # an error is on its way out: stop orbax's threads quietly
            try:
                ckpt.close()
            except CheckpointError:
                pass
    return _test_and_report(cfg, p, state, progress, out, epoch_fn, t0)


def _compile_ahead(cfg: Config, p: Prepared, epoch_fn, abstract: TrainState,
                   env_params: env_core.EnvParams) -> ahead_lib.Ahead:
    """Start compiling the run's programs from their shapes (:mod:`jdqn.train.ahead`): the
    epoch, the baselines' backtest and the fold boundary's reset in the background, the
    validation backtest, the best-parameters selection and the checkpoint checksums now. Every
    fold's programs are these (the same shapes; a resume too)."""
    ahead = ahead_lib.Ahead(ahead_lib.enabled(p.learner.n_devices))
    if not ahead.on:
        return ahead
    n_seeds = len(cfg.train.seeds)
    seeds_mask = jax.ShapeDtypeStruct((n_seeds,), jnp.bool_)
    lower = getattr(epoch_fn, "lower", None)  # (a test's stand-in may not be a jit)
    if lower is not None:
        ahead.submit("epoch", lambda: lower(abstract, parallel.replicate(env_params, 1),
                                            jnp.asarray(0, jnp.int32),
                                            seeds_mask if n_seeds > 1 else None).compile())
    lo, hi = p.plan.test
    ahead.submit("baselines", lambda: compile_baselines(
        env_core.with_window(env_params, lo, hi, training=False), cfg.eval, lo=lo, hi=hi))
    reset = getattr(_reset_fn(p.learner), "lower", None)
    if len(p.plan.folds) > 1 and reset is not None:  # the fold boundary's reset program
        ahead.submit("reset", lambda: reset(abstract, abstract).compile())
    val = p.plan.folds[0].val
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), abstract.params)
    ahead.run("validation", lambda: compile_rollout(
        env_core.with_window(env_params, *val, training=False), _greedy_fn(p.learner), params,
        lo=val[0], hi=val[1], n_windows=cfg.eval.n_windows, stride=cfg.eval.stride))
    ahead.run("best", lambda: _select_best.lower(abstract, seeds_mask).compile())
    if cfg.checkpoint.enabled:
        from jdqn.train.checkpoint import compile_checksums

        ahead.run("checksums", lambda: compile_checksums(abstract))
    return ahead


def _test_and_report(cfg: Config, p: Prepared, state: TrainState, progress: dict[str, Any],
                     out: Path, epoch_fn, t0: float) -> dict[str, Any]:
    """Test window: each seed's best-by-validation params of the last fold, and the baselines,
    through the same engine (same costs)."""
    plan, seeds = p.plan, cfg.train.seeds
    env_params = fold_env_params(cfg, p, len(plan.folds) - 1)
    lo, hi = plan.test
    test_params = env_core.with_window(env_params, lo, hi, training=False)
    baselines = run_baselines(test_params, cfg.eval, lo=lo, hi=hi)
    reports = []
    for s, seed in enumerate(seeds):
        res = evaluate_params(cfg, p, test_params, seed_slice(state.best_params, s), lo, hi)
        folder = out if s == 0 else out / "seeds" / f"seed_{seed}"
        extra = {
            "seed": seed, "seeds": list(seeds),
            "fold_plan": {"folds": [{"train": list(f.train), "val": list(f.val)}
                                    for f in plan.folds], "test": list(plan.test)},
            "features": list(p.feats.names),
            "n_params": int(sum(np.prod(x.shape[1:]) for x in jax.tree.leaves(state.params))),
            "epoch_compilations": int(epoch_fn.compilations()),
            "devices": p.learner.n_devices, "processes": jax.process_count(),
            "platform": jax.devices()[0].platform,
            "device_kind": jax.devices()[0].device_kind, "versions": provenance.versions(),
            "wall_seconds": time.perf_counter() - t0,
        }
        with distributed.together("writing the report"):
            if distributed.is_primary():  # multi-host: process 0 writes the report
                reports.append(write_report(folder, p.bars.ts[res.bar], res, baselines,
                                            [fm[s] for fm in progress["fold_metrics"]], p.ppy,
                                            extra))
    with distributed.together("writing the report"):
        if len(seeds) > 1 and reports:
            write_seed_summary(out, seeds, reports)
    return reports[0] if reports else {}


def plan_epochs(cfg: Config) -> int:
    return cfg.train.n_folds * cfg.train.epochs_per_fold


def epochs_done(progress: dict[str, Any], epochs_per_fold: int) -> int:
    """Where the progress bar (of :func:`plan_epochs` epochs) stands for a run's loop state:
    a finished fold counts in full, its early-stopped epochs too, so a resumed run's bar starts
    where the killed run's stood and ends full (``global_epoch`` counts trained epochs only)."""
    if progress["fold_done"]:
        return (progress["fold"] + 1) * epochs_per_fold
    return progress["fold"] * epochs_per_fold + progress["epoch"] + 1


def _walk_forward(cfg: Config, p: Prepared, epoch_fn, keys, state, progress, ckpt,
                  logger: RunLogger, ahead: ahead_lib.Ahead | None = None
                  ) -> tuple[TrainState, dict[str, Any]]:
    tc = cfg.train
    n_seeds = len(tc.seeds)
    start_fold = progress["fold"] + (1 if progress["fold_done"] else 0)
    for f in range(start_fold, len(p.plan.folds)):
        fold = p.plan.folds[f]
        env_params = fold_env_params(cfg, p, f)
        val_params = env_core.with_window(env_params, *fold.val, training=False)
        train_env = parallel.replicate(env_params, p.learner.n_devices)  # once per fold
        if progress["fold"] != f or progress["fold_done"] or state is None:
            if ahead is not None and state is not None:
                ahead.wait("reset")  # its program, compiling in the background
            state = _fold_state(p, state, env_params, f, keys)
            progress.update(fold=f, epoch=-1, fold_done=False, best_val=[None] * n_seeds,
                            best_val_metrics=[None] * n_seeds, bad_epochs=[0] * n_seeds,
                            epochs_trained=[0] * n_seeds)
        fold_arr = jnp.asarray(f, jnp.int32)
        progress.setdefault("epochs_trained", [progress["epoch"] + 1] * n_seeds)  # old ckpts
        last_val: list[dict[str, Any] | None] = [None] * n_seeds
        for e in range(progress["epoch"] + 1, tc.epochs_per_fold):
            # A seed out of patience is frozen (its state does not move) while the others
            # train on, so every seed's run is the one it would have alone.
            active = [b < tc.patience for b in progress["bad_epochs"]]
            # One seed is always active here (its fold ends when it stops): no mask, so the
            # epoch does not keep its input state alive to select from (one state's memory).
            mask = jnp.asarray(active) if n_seeds > 1 else None
            if ahead is not None:
                ahead.wait("epoch")  # its program, compiling in the background
            state, metrics = epoch_fn(state, train_env, fold_arr, mask)
            metrics, monitor = jax.device_get((metrics, state.monitor))
            safety.raise_if_halted(monitor, CHECKED_TENSORS, tc.seeds)
            q_now = [float(x) for x in metrics["collect"]["q_abs_mean"]]
            prev_q = progress["prev_q"] or [None] * n_seeds
            if tc.q_drift_halt:  # (a first epoch, prev None, halts only on a non-finite Q)
                for s in range(n_seeds):
                    if active[s]:
                        safety.check_q_drift(prev_q[s], q_now[s], e, floor=tc.q_drift_floor,
                                             fold=f, seed=tc.seeds[s] if n_seeds > 1 else None)
            progress["prev_q"] = [q if a else old for q, old, a in zip(q_now, prev_q, active,
                                                                         strict=True)]

            # A frozen seed's params did not move: its last validation still holds.
            with distributed.together("validating"):  # (one-device backtests: no collective)
                val = [last_val[s] if not active[s] and last_val[s] is not None else
                       compute_metrics(evaluate_params(cfg, p, val_params,
                                                       seed_slice(state.params, s), *fold.val),
                                       p.ppy)
                       for s in range(n_seeds)]
            # Multi-host: process 0's validation decides for every process (identical on
            # CPU; on GPUs each process compiles its own backtest and could round otherwise).
            val = distributed.broadcast_json(val)
            last_val = val
            improved = []
            updated = np.broadcast_to(np.asarray(metrics["n_updates"]) > 0, (n_seeds,))
            for s in range(n_seeds):
                if not active[s]:
                    improved.append(False)
                    continue
                progress["epochs_trained"][s] += 1
                if not updated[s]:
                    # the replay not yet at min_replay: no update, the params did not move,
                    # so this epoch neither improves nor uses up patience (an untrained
                    # network could otherwise end the fold and go on as its best)
                    improved.append(False)
                    continue
                sharpe = _rank(val[s]["sharpe"])
                best = progress["best_val"][s]
                better = best is None or sharpe > best
                improved.append(better)
                if better:
                    progress["best_val"][s] = sharpe
                    progress["best_val_metrics"][s] = {k: val[s][k] for k in VAL_KEYS}
                    progress["bad_epochs"][s] = 0
                else:
                    progress["bad_epochs"][s] += 1
            state = _select_best(state, jnp.asarray(improved))
            stop = all(b >= tc.patience for b in progress["bad_epochs"])
            last_epoch = e == tc.epochs_per_fold - 1
            progress.update(epoch=e, fold_done=stop or last_epoch,
                            global_epoch=progress["global_epoch"] + 1)
            if progress["fold_done"]:
                progress["fold_metrics"].append([
                    {"fold": f, "train": list(fold.train), "val": list(fold.val),
                     "epochs": progress["epochs_trained"][s],
                     **(progress["best_val_metrics"][s] or {})}
                    for s in range(n_seeds)])
            if not all(active):  # diagnostics of the seeds that trained this epoch
                rows = np.asarray(active)
                metrics = jax.tree.map(lambda x, rows=rows: x[rows], metrics)
            record = _epoch_record(f, e, metrics, val, tc.seeds, active)
            with distributed.together("logging an epoch"):
                logger.log_epoch(record, progress["global_epoch"])
            if ckpt is not None:
                ckpt.save(progress["global_epoch"], state,
                          metrics={"val_sharpe": record["val"]["sharpe"],
                                   "fold": f},
                          extra_json=progress)
            if progress["fold_done"]:
                logger.advance(tc.epochs_per_fold - 1 - e)
                break
    return state, progress


def _rank(sharpe: Any) -> float:
    """Validation Sharpe as a ranking key: an undefined Sharpe (NaN — e.g. a policy that never
    trades has zero variance) ranks lowest instead of poisoning every later comparison."""
    try:
        v = float(sharpe)
    except (TypeError, ValueError):
        return -math.inf
    return -math.inf if math.isnan(v) else v


def _mean(x: Any) -> Any:
    """The mean over the seeds of a diagnostic, leaving out the seeds that have none (NaN: no
    update this epoch); NaN when no seed has one."""
    a = np.asarray(x, np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN: the mean is NaN
        return float(np.nanmean(a)) if a.ndim <= 1 else np.nanmean(a, axis=0).tolist()


def val_summary(val: list[dict[str, Any]], seeds: tuple[int, ...]) -> dict[str, Any]:
    """An epoch's validation over the seeds: means over the seeds with a defined value (a seed
    that held no position has no Sharpe, NaN), so one flat seed does not make the mean, or the
    checkpoints' best-N ranking by it (``val_sharpe``), NaN; each seed's Sharpe beside them."""
    return {"sharpe": _mean([v["sharpe"] for v in val]),
            "total_return": _mean([v["total_return"] for v in val]),
            "sharpe_per_seed": {str(s): float(v["sharpe"]) for s, v in zip(seeds, val)},
            "n_trades": _mean([v["n_trades"] for v in val])}


def _epoch_record(fold: int, epoch: int, m: dict[str, Any], val: list[dict[str, Any]],
                  seeds: tuple[int, ...], active: list[bool]) -> dict[str, Any]:
    """The per-epoch diagnostics line: training diagnostics are means over the seeds that
    trained this epoch (``m`` holds only theirs; ``training_seeds`` names them), validation is
    over every seed's current params, with the Sharpe per seed kept."""
    u, c = m["update"], m["collect"]
    intended = np.asarray(c["abs_intended"], np.float64)
    realised = np.asarray(c["abs_realised"], np.float64)
    return {
        "fold": fold, "epoch": epoch,
        "training_seeds": [int(s) for s, a in zip(seeds, active, strict=True) if a],
        "loss": {"total": _mean(u["loss_total"]), "td": _mean(u["loss_td"]),
                 "c51": _mean(u["loss_c51"]), "mse": _mean(u["loss_mse"]),
                 "iqn": _mean(u["loss_iqn"]), "moe": _mean(u["loss_moe_balance"])},
        "q": {"mean": _mean(u["q_mean"]), "std": _mean(u["q_std"]), "gap": _mean(u["q_gap"]),
              "mean_per_branch": _mean(u["q_mean"]), "std_per_branch": _mean(u["q_std"]),
              "collect_abs_mean": _mean(c["q_abs_mean"]), "collect_abs_ema": _mean(m["q_abs_ema"])},
        "atoms": {"edge_mass": _mean(c["atom_edge_mass"]),
                  "effective": _mean(c["atom_effective"]),
                  "target_mean_per_branch": _mean(u["target_mean"])},
        "moe": {"utilisation": _mean(u["gate_util"]), "entropy": _mean(u["gate_entropy"]),
                "util_entropy": _mean(u["util_entropy"]), "lambda_eff": _mean(u["lambda_eff"])},
        "size": {"abs_intended": float(intended.mean()), "abs_realised": float(realised.mean()),
                 "realised_over_intended": float(realised.mean() / max(intended.mean(), 1e-12)),
                 "scale": _mean(c["size_scale"]),
                 "factors": {k[len("size_"):]: _mean(v) for k, v in c.items()
                             if k.startswith("size_") and k != "size_scale"}},
        "actions": {k[len("action_"):]: _mean(v) for k, v in c.items() if k.startswith("action_")},
        "reward": {"raw": _mean(c["reward_raw"]), "normalised": _mean(c["reward_norm"])},
        "optim": {"grad_norm": _mean(u["grad_norm"]), "per_beta": _mean(u["per_beta"]),
                  "blend_alpha": _mean(u["blend_alpha"]), "updates": _mean(m["n_updates"])},
        "replay_size": _mean(m["replay_size"]),
        "val": val_summary(val, seeds),
    }
