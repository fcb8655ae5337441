"""The training system: reset policy coverage, compile count, determinism, safety halts, resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_eqns, jax_events, tiny_config, tiny_toml

from jdqn.errors import CheckpointError, TrainingHalted
from jdqn.train import job as job_lib
from jdqn.train.epoch import make_epoch_fn
from jdqn.train.optim import set_learning_rate
from jdqn.train.policy import fold_reset_policy
from jdqn.train.reset import ResetPolicyError, check_policy_covers
from jdqn.train.state import TrainState, seed_keys

REPO = Path(__file__).resolve().parents[1]


def _setup(cfg):
    p = job_lib.prepare(cfg)
    env_params = job_lib.fold_env_params(cfg, p, 0)
    state = job_lib._fold_state(p, None, env_params, 0, seed_keys(cfg.train.seeds))
    return p, env_params, state


def _leaves_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.array_equal(np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x),
                       np.asarray(jax.random.key_data(y) if jnp.issubdtype(y.dtype, jax.dtypes.prng_key) else y))
        for x, y in zip(la, lb, strict=True))


# --------------------------------------------------------------------------------------------
# fold reset policy
# --------------------------------------------------------------------------------------------


def test_every_state_leaf_has_a_fold_reset_rule():
    cfg = tiny_config()
    _, _, state = _setup(cfg)
    check_policy_covers(fold_reset_policy(cfg.train), state)


def test_a_state_leaf_without_a_rule_fails_the_check():
    cfg = tiny_config()
    _, _, state = _setup(cfg)
    policy = fold_reset_policy(cfg.train)
    del policy["norm"]
    with pytest.raises(ResetPolicyError, match="norm"):
        check_policy_covers(policy, state)
    # A new leaf in the state (simulated with a dict view of it) without a rule is named too.
    as_dict = {f: getattr(state, f) for f in TrainState.__dataclass_fields__}
    as_dict["readiness_gauge"] = jnp.zeros(())
    with pytest.raises(ResetPolicyError, match="readiness_gauge"):
        check_policy_covers(fold_reset_policy(cfg.train), as_dict)


def test_fold_reset_syncs_targets_zeroes_moments_and_carries_normaliser():
    cfg = tiny_config()
    p, env_params, state = _setup(cfg)
    state, _ = make_epoch_fn(p.learner)(state, env_params, jnp.asarray(0))
    state = jax.block_until_ready(state)
    norm_before = np.asarray(state.norm.scale)
    replay_size = int(state.replay.size[0])
    new = job_lib._fold_state(p, state, job_lib.fold_env_params(cfg, p, 1), 1,
                              seed_keys(cfg.train.seeds))
    assert _leaves_equal(new.target_params, new.params)  # hard sync (main and IQN heads)
    assert _leaves_equal(new.best_params, new.params)
    assert np.array_equal(np.asarray(new.norm.scale), norm_before)  # carried, not zeroed
    assert np.asarray(new.norm.scale)[0] > 0
    assert int(new.replay.size[0]) == replay_size
    assert int(new.update_step[0]) == 0
    moments = jax.tree.leaves(new.opt_state.inner_state)
    assert all(not np.any(np.asarray(x)) for x in moments), "optimiser moments must be zeroed"
    assert float(new.opt_state.hyperparams["base_lr"][0]) == pytest.approx(cfg.train.lr)
    assert not bool(new.monitor.halted[0])


# --------------------------------------------------------------------------------------------
# compile count, determinism
# --------------------------------------------------------------------------------------------


def test_the_update_skip_stays_a_conditional_for_one_seed_and_for_several():
    """The conditional that skips the updates until the replay is ready stays a conditional:
    vmapped over seeds its predicate would be batched and it would become a select running the
    updates and the skip every iteration (on the H200 a one-seed gpu.toml iteration took
    26.2 ms that way and 25.0 ms without, and concurrent CUDA graphs slowed that form's epoch).
    One seed runs the plain epoch; several run `iteration_seeds`, whose conditional is on "any
    seed ready". Either way the updates are compiled once (one branch with matmuls). A state
    whose seed count is not the config's is refused."""
    for seeds in ("[0]", "[0, 1]"):
        cfg = tiny_config(f"train.seeds={seeds}")
        p, env_params, state = _setup(cfg)
        jaxpr = jax.make_jaxpr(make_epoch_fn(p.learner))(state, env_params, jnp.asarray(0))
        skips = [e for e in all_eqns(jaxpr.jaxpr) if e.primitive.name == "cond"
                 and any("dot_general" in str(br) for br in e.params["branches"])]
        assert len(skips) == 1, seeds
        # two branches, the skip without a matmul
        assert ["dot_general" in str(br) for br in skips[0].params["branches"]] == [False, True]
    two = jax.tree.map(lambda x: jnp.concatenate([x, x]), state)  # 4 seeds' state
    with pytest.raises(ValueError, match="the state has 4 seeds, train.seeds has 2"):
        jax.make_jaxpr(make_epoch_fn(p.learner))(two, env_params, jnp.asarray(0))


def test_the_update_is_traced_once_and_the_skip_returns_zero_metrics(monkeypatch):
    """Tracing the epoch traces ``train_step`` once, for one seed and for several: the skip
    branch takes its zero metrics' shapes from the updates branch instead of tracing the updates
    again (about a fifth of the epoch's trace time). The skip returns the state unchanged and
    zeros of the updates' metric structure."""
    from jdqn.train import epoch as epoch_lib

    calls = []
    real = epoch_lib.train_step

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(epoch_lib, "train_step", counted)
    for seeds in ("[0]", "[0, 1]"):
        p, env_params, state = _setup(tiny_config(f"train.seeds={seeds}"))
        calls.clear()
        jax.make_jaxpr(epoch_lib.make_epoch_fn.__wrapped__(p.learner))(
            state, env_params, jnp.asarray(0))
        assert len(calls) == 1, seeds
    one = jax.tree.map(lambda x: x[0], state)

    def run(st):
        return epoch_lib._updates(p.learner, st, env_params, jnp.asarray(0))

    both = jax.jit(lambda r, st: epoch_lib._updates_or_skip(r, run, st))
    new, ran = both(jnp.bool_(True), one)
    kept, zeros = both(jnp.bool_(False), one)
    assert jax.tree.structure(zeros) == jax.tree.structure(ran) and jax.tree.leaves(zeros)
    assert all(not np.any(np.asarray(z)) for z in jax.tree.leaves(zeros))
    assert any(np.any(np.asarray(r)) for r in jax.tree.leaves(ran))
    assert _leaves_equal(kept, one) and not _leaves_equal(new.params, one.params)


def _assert_trees_match(a, b, rtol=1e-6):
    """Integer, boolean and key leaves equal; float leaves to ``rtol`` (separately compiled
    programs may round differently)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if jnp.issubdtype(x.dtype, jnp.floating):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=1e-7)
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_seeds_ready_for_updates_at_different_iterations_train_as_vmapped_iterations():
    """Several seeds whose replays become ready at different iterations (one fresh, one a
    trained epoch ahead): while only one is ready, the updates run for both and are kept for
    that one. The result is the one of the definition — ``vmap`` of the one-seed iteration,
    whose conditional becomes a select — and each seed's is the one-seed epoch's up to
    rounding (vmapped matmuls may round differently on the CPU)."""
    from jdqn.train import epoch as epoch_lib

    common = ("train.iters_per_epoch=6", "train.min_replay=150")
    cfg1, cfg2 = tiny_config("train.seeds=[0]", *common), tiny_config("train.seeds=[0, 1]",
                                                                       *common)
    p1, env_params, fresh = _setup(cfg1)
    p2, _, both = _setup(cfg2)
    one, two = make_epoch_fn(p1.learner), make_epoch_fn(p2.learner)
    ahead, _ = one(jax.tree.map(lambda x: x[1:], both), env_params, jnp.asarray(0))
    assert int(fresh.replay.size[0]) == 0
    mixed = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), fresh, ahead)

    @jax.jit
    def definition(st):
        it = jax.vmap(lambda s: epoch_lib.iteration(p2.learner, s, env_params, jnp.asarray(0)))
        return jax.lax.scan(lambda s, _: it(s), st, None, length=cfg2.train.iters_per_epoch)

    want, want_m = definition(mixed)
    got, got_m = two(jax.tree.map(lambda x: jnp.array(x, copy=True), mixed), env_params,
                     jnp.asarray(0))
    _assert_trees_match(got, want)
    np.testing.assert_array_equal(got_m["n_updates"], want_m["n_updates"].sum(0))
    # seed 0 was not ready for its first iterations, seed 1 was ready throughout
    n_up = np.asarray(got_m["n_updates"])
    assert 0 < n_up[0] < n_up[1] == cfg2.train.iters_per_epoch * cfg2.train.updates_per_iter
    np.testing.assert_array_equal(got.update_step, n_up + np.asarray(mixed.update_step))
    np.testing.assert_allclose(got_m["update"]["loss_total"],
                               want_m["update"]["loss_total"].sum(0) / n_up, rtol=1e-6)
    for i, st in enumerate((fresh, ahead)):
        alone, _ = one(st, env_params, jnp.asarray(0))
        for x, y in zip(jax.tree.leaves(jax.tree.map(lambda x, i=i: x[i:i + 1], got.params)),
                        jax.tree.leaves(alone.params), strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_a_one_seed_job_runs_its_epochs_without_a_seed_mask(tmp_path, monkeypatch):
    """One seed is always active while its fold runs (the fold ends when it stops), so the job
    passes no mask: with one, the epoch keeps its input state alive to select from (one more
    state's device memory). Several seeds get the mask every epoch (one compilation)."""
    masks: dict[int, list] = {1: [], 2: []}
    real = job_lib.make_epoch_fn

    def spy(learner):
        fn = real(learner)

        def run(state, env_params, fold, active=None):
            masks[len(learner.cfg.train.seeds)].append(active)
            return fn(state, env_params, fold, active)

        run.compilations = fn.compilations  # the job reports its compile count
        return run

    monkeypatch.setattr(job_lib, "make_epoch_fn", spy)
    common = ("train.epochs_per_fold=2", "train.n_folds=1", "train.iters_per_epoch=2",
              "logging.tensorboard=false", "checkpoint.enabled=false")
    job_lib.run_job(tiny_config("train.seeds=[0]", *common), tmp_path / "a", quiet=True)
    job_lib.run_job(tiny_config("train.seeds=[0, 1]", *common), tmp_path / "b", quiet=True)
    assert masks[1] and all(m is None for m in masks[1])
    assert masks[2] and all(m is not None and m.shape == (2,) for m in masks[2])


def test_one_compilation_across_epochs_folds_lr_changes_and_a_resume(tmp_path):
    """One compiled epoch program for the whole run: across epochs, a stopped seed's mask, a
    learning-rate change, a new fold and a state restored from a checkpoint (orbax returns
    device-committed arrays and committedness is part of jit's cache key: a resume used to
    compile the full program a second time). Counted as the lowerings to XLA that the epoch
    calls trigger (each compilation starts with one, also when the persistent compilation
    cache then supplies the executable); jit's dispatch cache (``_cache_size``) is not the
    measure, as whether it keeps an entry depends on what else the process ran."""
    from jdqn.train.checkpoint import Checkpointer

    cfg = tiny_config("train.iters_per_epoch=4")
    p, env_params, state = _setup(cfg)
    epoch = make_epoch_fn(p.learner)
    before = epoch.compilations()
    lowered: list[str] = []

    def fn(*args):  # only the epoch calls' lowerings count
        with jax_events() as names:
            out = epoch(*args)
        lowered.extend(names)
        return out

    on, off = jnp.asarray([True]), jnp.asarray([False])  # the per-seed early-stopping mask
    state, _ = fn(state, env_params, jnp.asarray(0), on)
    state, _ = fn(state, env_params, jnp.asarray(0), on)
    state = state.replace(opt_state=jax.vmap(lambda o: set_learning_rate(o, 1e-5))(
        state.opt_state))
    state, _ = fn(state, env_params, jnp.asarray(0), on)
    frozen = jax.tree.map(lambda x: jnp.array(x, copy=True), state)  # survives donation
    state, _ = fn(state, env_params, jnp.asarray(0), off)  # a stopped seed: unchanged
    assert _leaves_equal(state, frozen)
    env1 = job_lib.fold_env_params(cfg, p, 1)  # new fold: new window, normalised features
    state = job_lib._fold_state(p, state, env1, 1, seed_keys(cfg.train.seeds))
    state, _ = fn(state, env1, jnp.asarray(1), on)
    jax.block_until_ready(state)
    with Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(1, state, {"val_sharpe": 0.0})
        restored, _ = ck.restore(1, jax.eval_shape(lambda s: s, state))
    assert _leaves_equal(restored, state)
    state, _ = fn(restored, env1, jnp.asarray(1), on)
    jax.block_until_ready(state)
    assert len(lowered) == 1 and "run" in lowered[0], lowered
    assert epoch.compilations() - before == 1  # what the job reports as epoch_compilations
    assert float(state.opt_state.hyperparams["base_lr"][0]) == pytest.approx(1e-5)


def test_an_epoch_is_one_program_with_no_host_round_trip():
    """The epoch program contains no host callback (the only way a jitted program can stop for
    the host), and calling it moves nothing between host and device implicitly."""
    cfg = tiny_config("train.iters_per_epoch=2")
    p, env_params, state = _setup(cfg)
    fn = make_epoch_fn(p.learner)
    fold = jax.device_put(jnp.asarray(0))

    names = {e.primitive.name for e in all_eqns(jax.make_jaxpr(fn)(state, env_params,
                                                                    fold).jaxpr)}
    assert "scan" in names or "while" in names
    host = {n for n in names if "callback" in n or n in ("debug_print", "infeed", "outfeed")}
    assert not host, host
    jax.block_until_ready(fn(state, env_params, fold))  # compile outside the guard
    state = job_lib._fold_state(p, None, env_params, 0, seed_keys(cfg.train.seeds))
    with jax.transfer_guard("disallow"):
        state, metrics = fn(state, env_params, fold)
        jax.block_until_ready((state, metrics))


def test_seeds_get_independent_streams_in_one_program():
    cfg = tiny_config("train.seeds=[3, 4]", "train.iters_per_epoch=4")
    p, env_params, state = _setup(cfg)
    state, _ = make_epoch_fn(p.learner)(state, env_params, jnp.asarray(0))
    leaves = jax.tree.leaves(state.params)
    assert all(not np.array_equal(np.asarray(x[0]), np.asarray(x[1])) for x in leaves
               if np.asarray(x[0]).size > 1 and np.any(np.asarray(x[0])))
    assert not np.array_equal(np.asarray(state.env.t[0]), np.asarray(state.env.t[1]))


@pytest.mark.slow
def test_same_seed_is_bitwise_identical_and_different_seeds_differ(tmp_path):
    a = job_lib.run_job(tiny_config(), tmp_path / "a", quiet=True)
    b = job_lib.run_job(tiny_config(), tmp_path / "b", quiet=True)
    c = job_lib.run_job(tiny_config("train.seeds=[1, 2]"), tmp_path / "c", quiet=True)
    ra = (tmp_path / "a" / "returns.csv").read_bytes()
    assert ra == (tmp_path / "b" / "returns.csv").read_bytes()
    assert a["test"] == b["test"] and a["folds"] == b["folds"]
    assert a["folds"] != c["folds"]
    # Multi-seed: one program, a report per seed; the seeds differ from each other.
    c2 = json.loads((tmp_path / "c" / "seeds" / "seed_2" / "report.json").read_text())
    assert c["extra"]["seed"] == 1 and c2["extra"]["seed"] == 2
    assert c2["folds"] != c["folds"]
    assert (tmp_path / "c" / "seeds" / "seed_2" / "returns.csv").is_file()


# --------------------------------------------------------------------------------------------
# safety: fault injection
# --------------------------------------------------------------------------------------------


def test_the_q_abs_ema_follows_the_collected_states_mean_q():
    """``TrainState.q_abs_ema``: starts at the first collection step's |mean Q|, then
    ``0.99·ema + 0.01·|mean Q|`` per step (it was a leaf that nothing updated)."""
    from jdqn.train import epoch as epoch_lib

    p, env_params, state = _setup(tiny_config("train.collect_steps=1"))
    one = jax.tree.map(lambda x: x[0], state)
    assert float(one.q_abs_ema) == 0.0
    step = jax.jit(lambda s: epoch_lib.collect(p.learner, s, env_params))
    one, _, s1 = step(one)
    q1 = float(s1["q_abs_mean"])
    assert q1 > 0 and float(one.q_abs_ema) == q1
    one, _, s2 = step(one)
    q2 = float(s2["q_abs_mean"])
    d = epoch_lib.Q_ABS_EMA_DECAY
    np.testing.assert_allclose(float(one.q_abs_ema), d * q1 + (1 - d) * q2, rtol=1e-6)
    assert q2 != q1


def _run_epoch_with(cfg, mutate_state=None, mutate_env=None):
    p, env_params, state = _setup(cfg)
    if mutate_state is not None:
        state = mutate_state(state)
    if mutate_env is not None:
        env_params = mutate_env(env_params)
    state, _ = make_epoch_fn(p.learner)(state, env_params, jnp.asarray(0))
    from jdqn.train import safety
    from jdqn.train.state import CHECKED_TENSORS

    safety.raise_if_halted(jax.device_get(state.monitor), CHECKED_TENSORS)


def test_nan_planted_in_a_param_halts_naming_params():
    def poison(state):
        leaves, tree = jax.tree.flatten(state.params)
        leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].set(jnp.nan)
        return state.replace(params=jax.tree.unflatten(tree, leaves))

    with pytest.raises(TrainingHalted, match=r"non-finite values in 'params' at step 0 of fold 0"):
        _run_epoch_with(tiny_config("train.iters_per_epoch=2"), mutate_state=poison)


def test_nan_in_a_reward_halts_naming_rewards():
    # A NaN close inside the train window (planted past the host-side input validation) makes
    # the reward of the episode that marks to it NaN.
    def poison(env_params):
        lo = int(env_params.lo)
        bars = env_params.bars.at[lo + 1 : int(env_params.hi), 3].set(jnp.nan)
        return env_params.replace(bars=bars)

    with pytest.raises(TrainingHalted, match=r"non-finite values in 'rewards'"):
        _run_epoch_with(tiny_config("train.iters_per_epoch=2"), mutate_env=poison)


def test_an_update_with_non_finite_taken_logits_halts_naming_logits(monkeypatch):
    """The update's ``logits`` check reads the Q statistics (a sample of rows) and the loss's
    ``logits_finite`` (every row's taken-action logits): with finite Q statistics and that flag
    down, the update's monitor names ``logits`` at its step; the flag is not a logged metric."""
    from jdqn.train import epoch as epoch_lib
    from jdqn.train.state import CHECKED_TENSORS

    p, env_params, state = _setup(tiny_config())
    one = jax.tree.map(lambda x: x[0], state)
    real = epoch_lib.total_loss

    def step(flag):
        def loss(*a, **k):
            value, (comps, per_sample, moe, diag) = real(*a, **k)
            return value, (comps, per_sample, moe, {**diag, "logits_finite": jnp.bool_(flag)})

        monkeypatch.setattr(epoch_lib, "total_loss", loss)
        return jax.jit(lambda s: epoch_lib.train_step(p.learner, s, env_params,
                                                      jnp.asarray(2, jnp.int32)))(one)

    ok, metrics = step(True)
    assert not bool(ok.monitor.halted) and "logits_finite" not in metrics
    assert np.all(np.isfinite(np.asarray(metrics["q_mean"])))
    bad, _ = step(False)
    assert bool(bad.monitor.halted) and int(bad.monitor.fold) == 2
    assert CHECKED_TENSORS[int(bad.monitor.tensor)] == "logits"
    assert int(bad.monitor.step) == int(one.update_step)


def test_finite_checks_can_be_switched_off():
    def poison(state):
        leaves, tree = jax.tree.flatten(state.params)
        leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].set(jnp.nan)
        return state.replace(params=jax.tree.unflatten(tree, leaves))

    _run_epoch_with(tiny_config("train.iters_per_epoch=2", "train.finite_checks=false"),
                    mutate_state=poison)


def test_q_drift_halts_and_rejects_the_model(tmp_path, monkeypatch):
    """After the first epoch the value stream's bias is pushed up: |mean Q| jumps far above 2×
    the previous epoch and above the floor, so the job halts and names the epoch."""
    real = job_lib.make_epoch_fn

    def drifting(learner):
        fn = real(learner)
        calls = {"n": 0}

        def run(state, env_params, fold, active=None):
            calls["n"] += 1
            if calls["n"] == 2:
                def bump(path, x):
                    name = jax.tree_util.keystr(path)
                    return x + 4.0 if "value" in name and name.endswith("['bias']") else x

                state = state.replace(params=jax.tree_util.tree_map_with_path(bump,
                                                                               state.params))
            return fn(state, env_params, fold, active)

        run.compilations = fn.compilations
        return run

    monkeypatch.setattr(job_lib, "make_epoch_fn", drifting)
    cfg = tiny_config("train.q_drift_floor=0.5", "model.iqn=false")
    with pytest.raises(TrainingHalted, match=r"Q drift at epoch 1 of fold 0.*rejected"):
        job_lib.run_job(cfg, tmp_path / "run", quiet=True)
    # Switched off, the same drift is let through and the job finishes.
    off = tiny_config("train.q_drift_floor=0.5", "model.iqn=false", "train.q_drift_halt=false")
    report = job_lib.run_job(off, tmp_path / "off", quiet=True)
    assert (tmp_path / "off" / "report.json").exists() and "test" in report


def test_nan_reward_in_a_later_fold_halts_the_cli_run_naming_tensor_and_fold(tmp_path,
                                                                             monkeypatch, capsys):
    """Through the whole job: a NaN close planted in fold 1's train window (past the input
    validation) halts the run with the tensor's name and the fold, exit code 2, one line."""
    from jdqn import main as main_lib

    real = job_lib.fold_env_params

    def poisoned(cfg, p, fold_index):
        env = real(cfg, p, fold_index)
        if fold_index == 1:
            lo, hi = int(env.lo), int(env.hi)
            env = env.replace(bars=env.bars.at[lo + 1:hi, 3].set(jnp.nan))
        return env

    monkeypatch.setattr(job_lib, "fold_env_params", poisoned)
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(tiny_toml("train.epochs_per_fold=1", "logging.tensorboard=false"))
    code = main_lib.main(["--config", str(cfg), "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == main_lib.EXIT_USER_ERROR, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("jdqn: error: "), err
    assert "non-finite values in 'rewards'" in lines[0] and "of fold 1" in lines[0], lines[0]
    assert not (tmp_path / "run" / "report.json").exists()
    # Fold 0 finished and was logged and checkpointed before the halt.
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1


# --------------------------------------------------------------------------------------------
# checkpoints and exact resume through the CLI
# --------------------------------------------------------------------------------------------


def _cli(args, **kw):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "jdqn.main", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, check=False, **kw)


def _write_cfg(tmp_path, *overrides, name: str = "tiny.toml") -> Path:
    path = tmp_path / name
    path.write_text(tiny_toml(*overrides))
    return path


@pytest.mark.slow
def test_killed_run_resumes_to_a_bitwise_identical_result(tmp_path):
    cfg = _write_cfg(tmp_path, "train.epochs_per_fold=3", "train.iters_per_epoch=12")
    ref = _cli(["--config", str(cfg), "--output-dir", str(tmp_path / "ref")])
    assert ref.returncode == 0, ref.stderr

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "jdqn.main", "--config", str(cfg),
                             "--output-dir", str(out)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Kill it mid-fold 0 once a checkpoint of epoch 2 (global step 2) is committed.
    deadline = time.time() + 300
    while time.time() < deadline and not (out / "checkpoints" / "2" / "commit_success.txt").exists():
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed; make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "report.json").exists()

    res = _cli(["--config", str(cfg), "--output-dir", str(out), "--resume"])
    assert res.returncode == 0, res.stderr
    for name in ("returns.csv",):
        assert (out / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()
    a = json.loads((out / "report.json").read_text())
    b = json.loads((tmp_path / "ref" / "report.json").read_text())
    for r in (a, b):
        r["extra"].pop("wall_seconds")
    assert a == b
    # Every epoch logged once, with the same values as the uninterrupted run.
    assert (out / "metrics.jsonl").read_text() == (tmp_path / "ref" / "metrics.jsonl").read_text()

    # Final params bitwise equal: restore the last checkpoint of both runs.
    from jdqn.config import load_config
    from jdqn.train import checkpoint as ckpt_lib

    c = load_config(cfg)
    p = job_lib.prepare(c)
    env_params = job_lib.fold_env_params(c, p, 0)
    abstract = jax.eval_shape(jax.vmap(lambda k: job_lib.init_state(p.learner, k, env_params)),
                              seed_keys(c.train.seeds))
    states = []
    for run in (out, tmp_path / "ref"):
        ck = ckpt_lib.Checkpointer(run / "checkpoints", fingerprint=job_lib.feature_schema(p))
        states.append(ck.restore(None, abstract)[0])
        ck.close()
    assert _leaves_equal(states[0].params, states[1].params)


def test_resume_refuses_corrupt_and_foreign_checkpoints(tmp_path):
    cfg = _write_cfg(tmp_path, "train.epochs_per_fold=1", "train.n_folds=2")
    out = tmp_path / "run"
    # The run also takes --autotune-file: on the CPU its GPU-only XLA flags are harmless, the
    # run trains and says that nothing was recorded (the GPU effect is measured in
    # bench/results/determinism_h200_cross_process.json). Recording turns the compilation cache
    # off for the run, so it rides on this test, whose run compiles anew anyway, rather than the
    # quickstart's, which share their programs through the cache.
    autotune = tmp_path / "autotune.textproto"
    res = _cli(["--config", str(cfg), "--output-dir", str(out), "--autotune-file", str(autotune)])
    assert res.returncode == 0, res.stderr
    assert "nothing recorded" in res.stdout and not autotune.exists()

    # Foreign: a checkpoint from a run whose model differs (config edited to match the run's
    # config.toml check, so the layout fingerprint is what refuses it).
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.toml").write_text((out / "config.toml").read_text())
    import shutil

    shutil.copytree(out / "checkpoints", foreign / "checkpoints")
    cfg2 = _write_cfg(tmp_path, "train.epochs_per_fold=1", "train.n_folds=2", "model.width=48",
                      name="wide.toml")
    (foreign / "config.toml").write_text(tiny_toml("train.epochs_per_fold=1", "train.n_folds=2",
                                                   "model.width=48"))
    res = _cli(["--config", str(cfg2), "--output-dir", str(foreign), "--resume"])
    assert res.returncode == 2
    assert "does not match this run's state layout" in res.stderr
    assert "Traceback" not in res.stderr

    # Corrupt: garbage over the array data of the latest checkpoint.
    latest = max(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    for f in (out / "checkpoints" / str(latest) / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(b"\x00garbage" * 8)
    res = _cli(["--config", str(cfg), "--output-dir", str(out), "--resume"])
    assert res.returncode == 2, res.stderr
    assert "unreadable" in res.stderr and str(latest) in res.stderr
    assert "Traceback" not in res.stderr


def test_resume_refuses_a_changed_config(tmp_path):
    cfg = _write_cfg(tmp_path, "train.epochs_per_fold=1")
    out = tmp_path / "run"
    (out).mkdir()
    (out / "config.toml").write_text(tiny_toml("train.epochs_per_fold=1", "train.lr=0.1"))
    res = _cli(["--config", str(cfg), "--output-dir", str(out), "--resume"])
    assert res.returncode == 2 and "config differs" in res.stderr
    assert "train.lr: 0.1 → 0.0003" in res.stderr, res.stderr  # names what differs


def test_run_job_refuses_a_folder_holding_another_run(tmp_path):
    # The CLI refuses a non-empty --output-dir; run_job itself refuses another run's outputs
    # (it once trained into them, mixing two runs' checkpoints), before building anything.
    for name in ("report.json", "checkpoints/7/state"):
        out = tmp_path / name.split("/")[0].replace(".", "_")
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("another run")
        with pytest.raises(CheckpointError, match="already holds a run"):
            job_lib.run_job(tiny_config(), out, quiet=True)
        assert (out / name).read_text() == "another run"
        assert sorted(p.name for p in out.iterdir()) == [name.split("/")[0]]


def test_fold_start_placeholders_never_become_training_data():
    # With K ≤ n − 1 collection steps the first iteration stores only the incomplete n-step
    # window's placeholders (t = 0, priority 0). Counting them towards min_replay let PER's
    # all-zero fallback sample them and give them priorities: fake transitions from bar 0.
    cfg = tiny_config("logging.tensorboard=false", "train.collect_steps=1", "train.n_step=3",
                      "train.min_replay=32", "train.iters_per_epoch=6")
    p = job_lib.prepare(cfg)
    env_params = job_lib.fold_env_params(cfg, p, 0)
    state = job_lib._fold_state(p, None, env_params, 0, seed_keys(cfg.train.seeds))
    state, m = make_epoch_fn(p.learner)(state, env_params, jnp.asarray(0, jnp.int32))
    r = jax.device_get(state.replay)
    size = int(r.size[0])
    t, pr = np.asarray(r.storage.t[0, :size]), np.asarray(r.priorities[0, :size])
    lo = p.plan.folds[0].train[0]
    assert float(m["n_updates"][0]) > 0 and (t < lo).any()  # updates ran; placeholders exist
    assert not ((t < lo) & (pr > 0)).any()  # none of them can ever be sampled


def _episode_end_transitions(mode: str):
    """Collect 2 chunks of 7 steps on 5-step episodes; returns the second chunk's window
    (as numpy), the transitions built from it and their valid flags."""
    from jdqn.replay import nstep as nstep_lib
    from jdqn.train import epoch as epoch_lib

    cfg = tiny_config("env.episode_length=5", "train.collect_steps=7", "train.n_step=3",
                      "train.gamma=0.9", f"train.episode_end={mode}")
    p, env_params, state = _setup(cfg)
    st = jax.tree.map(lambda x: x[0], state)
    st, chunk, _ = epoch_lib.collect(p.learner, st, env_params)
    st, _, _ = epoch_lib.to_transitions(p.learner, st, chunk)
    st, chunk, _ = epoch_lib.collect(p.learner, st, env_params)
    win, _, _ = nstep_lib.window(st.nstep, chunk)
    _, tr, valid = epoch_lib.to_transitions(p.learner, st, chunk)
    return jax.device_get(win), jax.device_get(tr), np.asarray(valid), st.nstep.tail.t.shape[1]


def test_an_episode_end_is_a_time_limit_not_a_termination():
    # The forced liquidation ignores the policy: it must not be a transition, and the returns
    # of the steps before it stop at the final decision bar and bootstrap from its state.
    win, tr, valid, n_envs = _episode_end_transitions("truncate")
    k, n, g = 7, 3, 0.9
    done, trunc = np.asarray(win.done), np.asarray(win.truncated)
    assert done.any() and (trunc & ~done).any()  # the window holds episode ends
    for i in range(k):
        for e in range(n_envs):
            j = i * n_envs + e
            assert valid[j] == (not done[i, e])  # a whole window; only forced steps are out
            if done[i, e]:
                continue
            m = next((q + 1 for q in range(n) if trunc[i + q, e]), n)
            assert not done[i:i + m, e].any()  # no forced liquidation inside a return
            want = sum(g**q * float(win.reward[i + q, e]) for q in range(m))
            np.testing.assert_allclose(tr.reward[j], want, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(tr.discount[j], g**m, rtol=1e-6)  # always a bootstrap
            assert tr.next_t[j] == win.next_t[i + m - 1, e]
            if trunc[i + m - 1, e] and i + m < done.shape[0]:  # the forced step is next:
                assert done[i + m, e] and win.t[i + m, e] == tr.next_t[j]  # its decision bar


def test_a_terminal_episode_end_stores_the_forced_step_without_bootstrap():
    win, tr, valid, n_envs = _episode_end_transitions("terminal")
    done = np.asarray(win.done)
    assert done.any() and valid.all()
    for i in range(7):
        for e in range(n_envs):
            j = i * n_envs + e
            assert (tr.discount[j] == 0) == done[i:i + 3, e].any()  # an end within n steps
            if done[i, e]:  # the forced step itself: its own reward, no bootstrap
                np.testing.assert_allclose(tr.reward[j], win.reward[i, e], rtol=1e-6)


@pytest.mark.parametrize("mode", ["truncate", "terminal"])
def test_the_reward_normaliser_fits_the_rewards_the_learner_fits(monkeypatch, mode):
    # Under "truncate" the forced liquidation is no transition, so its reward stays out of the
    # normaliser's statistics (mask = ~done); under "terminal" every reward counts, as before.
    from jdqn.env.normalise import normalise_reward
    from jdqn.train import epoch as epoch_lib

    seen = []

    def spy(ns, reward, mask=None):
        if mask is None:
            jax.debug.callback(lambda r: seen.append((np.asarray(r), None)), reward, ordered=True)
        else:
            jax.debug.callback(lambda r, m: seen.append((np.asarray(r), np.asarray(m))),
                               reward, mask, ordered=True)
        return normalise_reward(ns, reward, mask)

    monkeypatch.setattr(epoch_lib, "normalise_reward", spy)
    cfg = tiny_config("env.episode_length=5", "train.collect_steps=7",
                      f"train.episode_end={mode}")
    p, env_params, state = _setup(cfg)
    st = jax.tree.map(lambda x: x[0], state)
    st1, chunk, _ = epoch_lib.collect(p.learner, st, env_params)
    jax.effects_barrier()
    done = np.asarray(chunk.done)
    assert len(seen) == 7 and done.any() and not done.all()
    ns = st.norm
    for k, (r, m) in enumerate(seen):
        if mode == "terminal":
            assert m is None
        else:
            np.testing.assert_array_equal(m, ~done[k])  # exactly the non-forced steps
        ns, _ = normalise_reward(ns, jnp.asarray(r), None if m is None else jnp.asarray(m))
    for name in ("center", "scale", "count"):  # the state is the fold of those updates
        np.testing.assert_array_equal(np.asarray(getattr(st1.norm, name)),
                                      np.asarray(getattr(ns, name)), err_msg=name)
    if mode == "truncate":  # and it differs from the unmasked fold: the mask did something
        ns_all = st.norm
        for r, _ in seen:
            ns_all, _ = normalise_reward(ns_all, jnp.asarray(r))
        assert float(ns_all.center) != float(ns.center) or float(ns_all.scale) != float(ns.scale)


def test_resume_refuses_a_checkpoint_without_loop_state(tmp_path):
    from jdqn.train import checkpoint as ckpt_lib

    cfg = tiny_config()
    p = job_lib.prepare(cfg)
    env_params = job_lib.fold_env_params(cfg, p, 0)
    state = job_lib._fold_state(p, None, env_params, 0, seed_keys(cfg.train.seeds))
    out = tmp_path / "run"
    ck = ckpt_lib.Checkpointer(out / "checkpoints", fingerprint=job_lib.feature_schema(p),
                               async_save=False)
    ck.save(1, state, {"val_sharpe": 0.0, "fold": 0}, extra_json={})
    ck.close()
    with pytest.raises(CheckpointError, match=r"checkpoints/1: its loop state .* lacks"):
        job_lib.run_job(cfg, out, resume=True, quiet=True)


def test_restore_without_checkpoint_is_a_clear_error(tmp_path):
    cfg = tiny_config()
    out = tmp_path / "run"
    out.mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        job_lib.run_job(cfg, out, resume=True, quiet=True)


def test_an_undefined_validation_sharpe_ranks_lowest():
    # A flat policy has an undefined (NaN) Sharpe; it must not block every later improvement.
    assert job_lib._rank(float("nan")) == -float("inf")
    assert job_lib._rank(None) == -float("inf")
    assert job_lib._rank(0.5) > job_lib._rank(float("nan"))


@pytest.mark.slow
def test_default_compile_pipeline_is_deterministic_too(tmp_path):
    # The suite compiles at LLVM -O0 (conftest.py); the CLI runs XLA's default pipeline. Two
    # quickstart-size epochs, twice in one process, under the default pipeline: bitwise equal.
    from conftest import FAST_COMPILE, default_pipeline_env

    env = default_pipeline_env(JAX_ENABLE_COMPILATION_CACHE="false")
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "determinism.py"), "--config",
         str(REPO / "configs" / "quickstart.toml"), "--epochs", "2",
         "--set", "train.iters_per_epoch=10", "--set", "data.cache_dir=''"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["bitwise_identical"] and not res["differing_leaves"], res
    assert not any(f in res["xla_flags"] for f in FAST_COMPILE), res["xla_flags"]
    # what the epochs compiled with: "auto" resolves to concurrent graphs for one seed, one device
    assert (res["gpu_graphs_resolved"], res["n_seeds"], res["n_devices"]) == (
        ["concurrent", "concurrent"], 1, 1), res
