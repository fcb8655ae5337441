"""One epoch = one jitted call: ``lax.scan`` over (collect K steps on N envs → insert → M updates).

    run_epoch ─ scan(iters_per_epoch) ─┬─ collect: scan(K) over env.step with per-branch exploration
                                       ├─ n-step window → replay.add
                                       └─ scan(M) over train_step (sample → loss → AdamW → Polyak
                                          → priorities → finite checks)

Nothing leaves the device inside an epoch: metrics are summed in the scan carry and returned
once. The state is donated. Every schedule (learning rate, ε, PER β, warm-up blend α) is a
function of a step counter inside the program, so nothing recompiles between epochs or folds.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jdqn.env import core as env_core
from jdqn.env.normalise import normalise_reward
from jdqn.env.sizing import FACTOR_NAMES
from jdqn.losses.total import Batch, total_loss, warmup_alpha
from jdqn.networks.model import greedy_action, policy_aux
from jdqn.replay import nstep as nstep_lib
from jdqn.replay import per
from jdqn.train import parallel, safety, xla_options
from jdqn.train.optim import global_norm
from jdqn.train.state import CHECKED_TENSORS, Learner, StepRecord, TrainState, Transition

BRANCH_SIZES = env_core.BRANCH_SIZES


# --------------------------------------------------------------------------------------------
# acting
# --------------------------------------------------------------------------------------------


# Decay per collection step of ``TrainState.q_abs_ema`` (≈ 100 steps' memory).
Q_ABS_EMA_DECAY = 0.99


def epsilon(learner: Learner, collect_step: jax.Array) -> jax.Array:
    """ε of per-branch ε-greedy: linear from eps_start to eps_end over eps_decay_steps."""
    c = learner.cfg.train
    frac = jnp.clip(collect_step.astype(jnp.float32) / c.eps_decay_steps, 0.0, 1.0)
    return c.eps_start + frac * (c.eps_end - c.eps_start)


def explore(learner: Learner, q: tuple[jax.Array, ...], key: jax.Array,
            collect_step: jax.Array) -> jax.Array:
    """Exploratory actions ``i32 [N, 4]`` from expected Q per branch ``[N, A_d]``.

    ε-greedy: each branch independently takes a uniform random action with probability ε.
    Boltzmann: each branch samples ``softmax(Q / temperature)``.
    """
    c = learner.cfg.train
    if c.exploration == "boltzmann":
        keys = jax.random.split(key, len(q))
        cols = [jax.random.categorical(k, qd / c.temperature, axis=-1)
                for k, qd in zip(keys, q, strict=True)]
        return jnp.stack(cols, axis=-1).astype(jnp.int32)
    # One uniform draw ``[N, D, 2]`` for all branches, not two draws per branch (fewer random-
    # bit programs in the compiled epoch): ``[..., 0] < ε`` explores, and ``[..., 1]`` picks
    # the random action, ⌊u·A_d⌋, uniform on branch d's A_d actions (u has 2^23 equally likely
    # values, a multiple of A_d = 2, 4 and 8 and within 1e-6 of uniform for others).
    n = q[0].shape[0]
    sizes = jnp.asarray([qd.shape[-1] for qd in q], jnp.float32)
    u = jax.random.uniform(key, (n, len(q), 2))
    take = u[..., 0] < epsilon(learner, collect_step)
    rand = jnp.minimum(jnp.floor(u[..., 1] * sizes), sizes - 1).astype(jnp.int32)
    greedy = jnp.stack([jnp.argmax(qd, axis=-1) for qd in q], axis=-1)
    return jnp.where(take, rand, greedy).astype(jnp.int32)


def greedy_policy(learner: Learner, params: Any, obs: jax.Array
                  ) -> tuple[jax.Array, env_core.PolicyAux]:
    """Deterministic evaluation policy: per-branch argmax of expected Q, plus the sizing aux."""
    out = learner.net.apply(params, obs, grad_free=True)
    action = greedy_action(out)
    gap, var = policy_aux(out, action[:, 0])
    return action, env_core.PolicyAux(q_gap=gap, q_var=var)


# --------------------------------------------------------------------------------------------
# collection
# --------------------------------------------------------------------------------------------


def collect(learner: Learner, state: TrainState, env_params: env_core.EnvParams
            ) -> tuple[TrainState, StepRecord, dict[str, jax.Array]]:
    """K exploratory steps on all N envs; returns the chunk ``[K, N]`` and summed statistics.
    (Data parallel: this device's envs; the reward normaliser sees every device's rewards.)"""
    k_steps = learner.cfg.train.collect_steps
    ax = learner.axis

    def one(carry, _):
        st = carry
        key, k_act, k_reset = jax.random.split(st.key, 3)
        obs = env_core.observe(env_params, st.env)
        out = learner.net.apply(st.params, obs, grad_free=True)
        action = explore(learner, out.q, parallel.device_key(k_act, ax), st.collect_step)
        gap, var = policy_aux(out, action[:, 0])
        env1, reward, done, info = env_core.step(env_params, st.env, action,
                                                 env_core.PolicyAux(q_gap=gap, q_var=var))
        # Under "truncate" the forced liquidation (done) is no transition: keep its reward out
        # of the normaliser's statistics too.
        fit = None if learner.cfg.train.episode_end == "terminal" else ~done
        norm, reward_n = _normalise(st.norm, reward, ax, fit)
        rec = StepRecord(t=st.env.t, port=env_core.portfolio(env_params, st.env), action=action,
                         reward=reward_n, done=done, truncated=env1.t >= env1.last,
                         next_t=env1.t,
                         next_port=env_core.portfolio(env_params, env1))
        env2 = env_core.auto_reset(env_params, env1, done, parallel.device_key(k_reset, ax))
        q_dir = out.q[0]
        # Atom utilisation of the direction branch: probability mass on the two edge atoms
        # (saturation against [v_min, v_max]) and the effective number of atoms exp(H).
        probs = jax.nn.softmax(out.logits[0].astype(jnp.float32), axis=-1)  # [N, 4, Z]
        entropy = -jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-12)), axis=-1)
        stats = {
            "atom_edge_mass": jnp.mean(probs[..., 0] + probs[..., -1]),
            "atom_effective": jnp.mean(jnp.exp(entropy)),
            "reward_raw": jnp.mean(reward),
            "reward_norm": jnp.mean(reward_n),
            "q_abs_mean": jnp.abs(parallel.pmean(jnp.mean(q_dir), ax)),  # all envs' mean
            "abs_intended": jnp.mean(jnp.abs(info["intended_position"])),
            "abs_realised": jnp.mean(jnp.abs(info["position"])),
            "size_scale": jnp.mean(info["size_scale"]),
            **{f"size_{k}": jnp.mean(info[f"size_{k}"]) for k in FACTOR_NAMES},
            "episodes_done": jnp.sum(done.astype(jnp.float32)),
            "finite_rewards": jnp.all(jnp.isfinite(reward_n)),
            "finite_logits": jnp.all(jnp.stack([jnp.all(jnp.isfinite(lg)) for lg in out.logits])),
            **{f"action_{name}": jnp.mean(jax.nn.one_hot(action[:, i], BRANCH_SIZES[i]), 0)
               for i, name in enumerate(env_core.BRANCH_NAMES)},
        }
        # The diagnostic EMA of |mean Q| over the collected states (per collection step; the
        # first step of a run starts it at its value rather than pulling it up from 0).
        q_abs = stats["q_abs_mean"]
        ema = jnp.where(st.q_abs_ema == 0.0, q_abs,
                        Q_ABS_EMA_DECAY * st.q_abs_ema + (1.0 - Q_ABS_EMA_DECAY) * q_abs)
        st = st.replace(env=env2, norm=norm, key=key, collect_step=st.collect_step + 1,
                        q_abs_ema=ema.astype(jnp.float32))
        return st, (rec, stats)

    state, (chunk, stats) = jax.lax.scan(one, state, None, length=k_steps)
    finite = {k: jnp.all(stats.pop(k)) for k in ("finite_rewards", "finite_logits")}
    summed = jax.tree.map(lambda x: jnp.sum(x, axis=0), stats)
    summed.update(finite)
    return state, chunk, summed


def _normalise(norm, reward: jax.Array, axis: str | None, mask: jax.Array | None = None):
    """Reward normalisation; under data parallel its statistics are taken over the rewards of
    every device's envs (so they stay replicated) and this device's block is returned."""
    if axis is None or norm.mode == "none":
        return normalise_reward(norm, reward, mask)
    norm, rn = normalise_reward(norm, parallel.gather(reward, axis),
                                None if mask is None else parallel.gather(mask, axis))
    return norm, parallel.local_block(rn, reward.shape[0], axis)


def to_transitions(learner: Learner, state: TrainState, chunk: StepRecord
                   ) -> tuple[TrainState, Transition, jax.Array]:
    """n-step transitions ``[K·N]`` from the carry + chunk, and which of them are valid.

    ``train.episode_end = "truncate"``: an episode's forced-liquidation step ignored the policy,
    so it starts no transition, and the step before it ends every sum with a bootstrap from the
    final decision bar's state (a time limit, not a termination: the market goes on).
    ``"terminal"``: the forced step is a transition and its ``done`` ends the return with no
    bootstrap."""
    c = learner.cfg.train
    win, valid, carry = nstep_lib.window(state.nstep, chunk)
    k = chunk.reward.shape[0]
    if c.episode_end == "truncate":
        ns = nstep_lib.nstep_returns(win.reward, jnp.zeros_like(win.done), c.gamma, c.n_step,
                                     truncated=win.truncated)
        valid = valid & ~win.done[:k]
    else:
        ns = nstep_lib.nstep_returns(win.reward, win.done, c.gamma, c.n_step)
    # Bootstrap from the recorded next-observation of step t + m − 1 (window row).
    rows = jnp.arange(k, dtype=jnp.int32)[:, None] + ns.offsets - 1  # [K, N]
    take = lambda x: jnp.take_along_axis(
        x, rows.reshape(rows.shape + (1,) * (x.ndim - 2)), axis=0)
    start = jax.tree.map(lambda x: x[:k], win)
    tr = Transition(t=start.t, port=start.port, action=start.action, reward=ns.returns,
                    discount=ns.discounts, next_t=take(win.next_t),
                    next_port=take(win.next_port))
    flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), tr)
    return state.replace(nstep=carry), flat, valid.reshape(-1)


def insert(state: TrainState, items: Transition, valid: jax.Array) -> TrainState:
    """Add the transitions; invalid ones (an incomplete window at a fold start, a forced
    liquidation under ``episode_end = "truncate"``) get priority 0 so they are never sampled,
    and are overwritten in ring order like any other slot."""
    cap = state.replay.capacity
    n = valid.shape[0]
    pos0 = state.replay.position
    replay = per.add(state.replay, items)
    slots = (pos0 + jnp.arange(n, dtype=jnp.int32)) % cap
    if n > cap:
        slots = (pos0 + jnp.arange(n - cap, n, dtype=jnp.int32)) % cap
        valid = valid[n - cap:]
    pr = jnp.where(valid, replay.priorities[slots], 0.0)
    # The slots are distinct (n ≤ C consecutive ring slots), as per.add's.
    return state.replace(replay=replay.replace(
        priorities=replay.priorities.at[slots].set(pr, unique_indices=True)))


# --------------------------------------------------------------------------------------------
# learning
# --------------------------------------------------------------------------------------------


def per_beta(learner: Learner, update_step: jax.Array) -> jax.Array:
    c = learner.cfg.train
    frac = jnp.clip(update_step.astype(jnp.float32) / c.per_beta_steps, 0.0, 1.0)
    return c.per_beta0 + frac * (1.0 - c.per_beta0)


def train_step(learner: Learner, state: TrainState, env_params: env_core.EnvParams,
               fold: jax.Array) -> tuple[TrainState, dict[str, Any]]:
    """One prioritised gradient update: sample → loss → clip+AdamW → Polyak → priorities."""
    c = learner.cfg.train
    ax = learner.axis  # data parallel: this device's B/D of the batch, from its replay shard
    key, k_sample, k_loss = jax.random.split(state.key, 3)
    sample = per.sample(state.replay, parallel.device_key(k_sample, ax),
                        c.batch_size // learner.n_devices, c.per_alpha,
                        per_beta(learner, state.update_step), axis_name=ax,
                        impl=learner.cfg.model.impl)
    it = sample.items
    batch = Batch(obs=env_core.obs_from_index(env_params, it.t, it.port), action=it.action,
                  reward=it.reward, discount=it.discount,
                  next_obs=env_core.obs_from_index(env_params, it.next_t, it.next_port),
                  weight=sample.weights)
    alpha = warmup_alpha(state.update_step, c.warmup_blend_steps)
    grad_fn = jax.value_and_grad(total_loss, has_aux=True)
    (loss, (comps, per_sample, moe, diag)), grads = grad_fn(
        state.params, state.target_params, batch, parallel.device_key(k_loss, ax), state.moe,
        alpha, net=learner.net, train_cfg=c, axis_name=ax)
    grads = parallel.pmean(grads, ax)  # every device applies the same step
    updates, opt_state = learner.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    target = optax.incremental_update(params, state.target_params, c.tau)
    replay = per.update(state.replay, sample.indices, per_sample + c.per_eps,
                        indices_sorted=True)  # per.sample's indices are non-decreasing
    if ax is not None:  # new items get the global max priority on every shard
        replay = replay.replace(max_priority=parallel.pmax(replay.max_priority, ax))
    monitor = state.monitor
    grad_norm = global_norm(grads)
    logits_finite = diag.pop("logits_finite")
    if c.finite_checks:
        # Cheap per-update checks: the Q statistics are computed from the online logits of a
        # sample of rows (NaN logits make them NaN), the taken action's logits of every row
        # are checked in the loss (`logits_finite`), and the gradient's global norm is finite
        # iff every gradient is. The params are checked around each iteration (see
        # `iteration`), not after every update: a full reduction over all parameters per
        # update cost ~0.4 ms at B = 16384 on an H200.
        flags = _flags({"rewards": jnp.all(jnp.isfinite(batch.reward)),
                        "logits": jnp.all(jnp.isfinite(diag["q_mean"]))
                        & jnp.all(jnp.isfinite(diag["q_std"])) & logits_finite,
                        "loss": jnp.isfinite(loss), "grads": jnp.isfinite(grad_norm)}, ax)
        monitor = safety.monitor_update(monitor, flags, state.update_step, fold)
    new = state.replace(params=params, target_params=target, opt_state=opt_state, replay=replay,
                        moe=moe, monitor=monitor, key=key, update_step=state.update_step + 1)
    metrics = {**{f"loss_{k}": v for k, v in comps.items()}, **diag,
               "grad_norm": grad_norm, "per_beta": per_beta(learner, state.update_step),
               "blend_alpha": alpha}
    return new, metrics


def _updates_or_skip(ready: jax.Array, run, state: TrainState) -> tuple[TrainState, Any]:
    """``lax.cond(ready, run, skip, state)``: ``run(state) -> (state, metrics)`` or the state
    unchanged with zero metrics shaped like ``run``'s. ``lax.cond`` traces ``run`` first; the
    skip branch takes the metrics' shapes recorded then, instead of tracing the updates a
    second time to learn them (~1 s of the quickstart epoch's 4–5 s trace). Were a JAX to
    trace the skip branch first, it would trace ``run`` itself (same result, slower)."""
    seen: dict[str, Any] = {}

    def run_and_record(st):
        new, metrics = run(st)
        seen["shapes"] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), metrics)
        return new, metrics

    def skip(st):
        shapes = seen["shapes"] if "shapes" in seen else jax.eval_shape(run, st)[1]
        return st, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    return jax.lax.cond(ready, run_and_record, skip, state)


def _flags(checked: dict[str, jax.Array], axis: str | None = None) -> jax.Array:
    """``bool [len(CHECKED_TENSORS)]`` with the given flags in place, True elsewhere; under data
    parallel (``axis``) AND-ed over devices, so every device's monitor halts on the same step."""
    flags = jnp.stack([jnp.asarray(checked.get(n, True)) for n in CHECKED_TENSORS])
    return parallel.all_true(flags, axis)


def _check_params(state: TrainState, fold: jax.Array) -> TrainState:
    flags = _flags({"params": safety.finite_flags({"params": state.params})[0]})
    return state.replace(monitor=safety.monitor_update(state.monitor, flags, state.update_step,
                                                       fold))


def _collect_and_insert(learner: Learner, state: TrainState, env_params: env_core.EnvParams,
                        fold: jax.Array) -> tuple[TrainState, dict[str, Any], jax.Array]:
    """An iteration up to its updates: collect K steps → insert, with the finite checks.
    Returns the state, the collection statistics and whether the replay is ready for updates
    (bool [])."""
    c = learner.cfg.train
    if c.finite_checks:
        # Params are checked before they act, so a corrupted parameter is reported as 'params'
        # rather than as the logits it poisons.
        state = _check_params(state, fold)
    state, chunk, col_stats = collect(learner, state, env_params)
    state, items, valid = to_transitions(learner, state, chunk)
    state = insert(state, items, valid)
    if c.finite_checks:
        flags = _flags({"rewards": col_stats["finite_rewards"],
                        "logits": col_stats["finite_logits"]}, learner.axis)
        state = state.replace(monitor=safety.monitor_update(
            state.monitor, flags, state.update_step, fold))
    col_stats.pop("finite_rewards")
    col_stats.pop("finite_logits")
    # Updates start once min_replay transitions can be *sampled*: the invalid slots of a fold
    # start's incomplete n-step window are stored with priority 0 and must not count (were
    # they all the replay held, PER's all-zero fallback would sample them uniformly and give
    # them a priority, making fake transitions from bar 0 training data).
    ready = parallel.psum(per.n_sampleable(state.replay), learner.axis) >= c.min_replay
    return state, col_stats, ready


def _updates(learner: Learner, state: TrainState, env_params: env_core.EnvParams,
             fold: jax.Array) -> tuple[TrainState, dict[str, Any]]:
    """M gradient updates; their metrics summed."""
    def body(s, _):
        return train_step(learner, s, env_params, fold)

    state, m = jax.lax.scan(body, state, None, length=learner.cfg.train.updates_per_iter)
    return state, jax.tree.map(lambda x: jnp.sum(x, axis=0), m)


def _after_updates(learner: Learner, state: TrainState, fold: jax.Array) -> TrainState:
    if learner.cfg.train.finite_checks:
        state = _check_params(state, fold)  # catches params an update made non-finite
    return state


def iteration(learner: Learner, state: TrainState, env_params: env_core.EnvParams,
              fold: jax.Array) -> tuple[TrainState, dict[str, Any]]:
    """Collect K steps → insert → M updates (skipped until the replay holds min_replay)."""
    c = learner.cfg.train
    state, col_stats, ready = _collect_and_insert(learner, state, env_params, fold)

    state, up = _updates_or_skip(ready, lambda st: _updates(learner, st, env_params, fold),
                                 state)
    state = _after_updates(learner, state, fold)
    n_up = jnp.where(ready, c.updates_per_iter, 0).astype(jnp.float32)
    return state, {"collect": col_stats, "update": up, "n_updates": n_up}


def iteration_seeds(learner: Learner, state: TrainState, env_params: env_core.EnvParams,
                    fold: jax.Array) -> tuple[TrainState, dict[str, Any]]:
    """:func:`iteration` for S seeds at once (state leaves ``[S, ...]``): each seed's result is
    what ``vmap(iteration)`` computes for it.

    Not ``vmap(iteration)`` itself: vmapped, the conditional that skips the updates until the
    replay is ready has a batched predicate and becomes a select that runs the updates *and*
    the skip on every iteration. Here the collection and the updates are vmapped separately
    and one unbatched ``lax.cond`` on "any seed ready" runs the vmapped updates, kept only for
    the ready seeds (what the select computed), or skips them. The updates are compiled once.
    With every seed ready (the common case) the selection keeps everything: on the H200 the
    two-seed gpu.toml epoch took 7.54 s this way and 7.45 s with a separate all-ready branch
    that skipped it but compiled the updates twice (another machine session)."""
    c = learner.cfg.train
    state, col_stats, ready = jax.vmap(
        lambda st: _collect_and_insert(learner, st, env_params, fold))(state)

    def run(st):
        new, up = jax.vmap(lambda s: _updates(learner, s, env_params, fold))(st)
        return select_seeds(ready, new, st), select_seeds(ready, up, jax.tree.map(
            jnp.zeros_like, up))

    state, up = _updates_or_skip(jnp.any(ready), run, state)
    state = jax.vmap(lambda st: _after_updates(learner, st, fold))(state)
    n_up = jnp.where(ready, c.updates_per_iter, 0).astype(jnp.float32)
    return state, {"collect": col_stats, "update": up, "n_updates": n_up}


def select_seeds(mask: jax.Array, new: Any, old: Any) -> Any:
    """Per seed, ``new`` where ``mask [S]`` is True and ``old`` elsewhere, leaf by leaf (leaves
    carry the seed axis first; PRNG key leaves keep their key type)."""

    def pick(n, o):
        m = mask.reshape(mask.shape + (1,) * (n.ndim - 1))
        if jax.dtypes.issubdtype(n.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(
                jnp.where(m[..., None], jax.random.key_data(n), jax.random.key_data(o)),
                impl=jax.random.key_impl(n))
        return jnp.where(m, n, o)

    return jax.tree.map(pick, new, old)


@functools.cache
def make_epoch_fn(learner: Learner):
    """The jitted epoch over all seeds: ``(state [S], env_params, fold, active [S] | None) ->
    (state, metrics)``.

    The state is donated; ``env_params`` (feature matrix, bars, window) is shared by the seeds.
    Metrics come back as per-seed means over the epoch (one device→host transfer per epoch).
    ``active`` (bool per seed, traced: changing it never recompiles) freezes the seeds marked
    False — their state comes back unchanged — so a seed that has stopped early does not move
    while the others train: each seed's run is the same as if it were trained alone. Their
    metrics are computed and must be ignored.

    Data parallel (``learner.n_devices > 1``): the epoch runs under ``shard_map`` on a mesh of
    the first D devices (:mod:`jdqn.train.parallel`); the returned function places the state
    (env, n-step carry and replay split over the devices, the rest replicated) and the env
    params (replicated) before calling the jitted program, so its inputs always have the same
    shardings and it compiles once. Metrics are means over the devices (sums for counts).

    ``fn.compilations()``: how many programs JAX has traced (and so compiled, or taken from the
    persistent compilation cache) for this function since it was made — one per input
    signature. The function is cached per learner, so in one process this counts across the
    jobs that share it. (jit's dispatch cache, ``_cache_size``, is not this count: whether it
    keeps an entry depends on what else the process ran before.)
    """
    c = learner.cfg.train
    ax = learner.axis
    traces = [0]  # run's traces: fn.compilations()

    def summary(state: TrainState, m: dict[str, Any]) -> dict[str, Any]:
        """One seed's epoch metrics from its per-iteration metrics (leaves ``[iters, ...]``)."""
        n_up = jnp.sum(m["n_updates"])
        n_col = float(c.iters_per_epoch * c.collect_steps)
        out = {
            "collect": jax.tree.map(lambda x: jnp.sum(x, axis=0) / n_col, m["collect"]),
            # an epoch without updates (replay below min_replay) has no update metrics: NaN,
            # written as null, not a loss of 0.0 that reads as a perfect fit
            "update": jax.tree.map(
                lambda x: jnp.where(n_up > 0, jnp.sum(x, axis=0) / jnp.maximum(n_up, 1.0),
                                    jnp.nan), m["update"]),
            "n_updates": n_up,
            "replay_size": state.replay.size,
            "q_abs_ema": state.q_abs_ema,  # (the same on every device: q_abs_mean is global)
        }
        out["collect"]["episodes_done"] = out["collect"]["episodes_done"] * n_col
        if ax is not None:  # this device's envs and batch → the global figures
            episodes = parallel.psum(out["collect"].pop("episodes_done"), ax)
            out["collect"] = parallel.pmean(out["collect"], ax)
            out["collect"]["episodes_done"] = episodes
            out["update"] = parallel.pmean(out["update"], ax)
            out["replay_size"] = parallel.psum(out["replay_size"], ax)
        return out

    def vm(state: TrainState, env_params, fold):
        # One seed runs the plain epoch, several run `iteration_seeds`: neither vmaps the
        # `lax.cond` that skips the updates until the replay is ready, which vmapped becomes a
        # select running both branches. On the H200 a one-seed gpu.toml iteration took 26.2 ms
        # and 4488 kernels vmapped, 25.0 ms and 4123 kernels unvmapped
        # (bench/results/epoch_h200_one_seed.json); the epoch under train.gpu_graphs =
        # "concurrent" 4.15 s unvmapped, 6.49 s vmapped (train_h200_gpu_graphs.json).
        n_state = jax.tree.leaves(state)[0].shape[0]
        if n_state != len(c.seeds):
            raise ValueError(f"the state has {n_state} seeds, train.seeds has {len(c.seeds)}")
        one = len(c.seeds) == 1
        if one:
            state = jax.tree.map(lambda x: x[0], state)
        step = iteration if one else iteration_seeds

        def body(st, _):
            return step(learner, st, env_params, fold)

        state, m = jax.lax.scan(body, state, None, length=c.iters_per_epoch)
        if one:
            return jax.tree.map(lambda x: x[None], (state, summary(state, m)))
        return state, jax.vmap(summary, in_axes=(0, 1))(state, m)

    mesh = parallel.make_mesh(learner.n_devices) if ax is not None else None

    def run(state: TrainState, env_params, fold, active: jax.Array | None = None):
        traces[0] += 1  # Python, so it runs when JAX traces: once per program
        if mesh is None:
            new, out = vm(state, env_params, fold)
        else:
            specs = parallel.state_specs(state)
            new, out = jax.shard_map(vm, mesh=mesh, in_specs=(specs, P(), P()),
                                     out_specs=(specs, P()), check_vma=False)(
                state, env_params, fold)
        if active is not None:
            new = select_seeds(active, new, state)
        return new, out

    jitted = xla_options.jit(run, c.gpu_graphs, donate_argnums=(0,))
    jitted.compilations = lambda: traces[0]
    if mesh is None:
        return jitted

    def placed(state: TrainState, env_params, fold, active: jax.Array | None = None):
        state = parallel.put(state, parallel.state_shardings(state, mesh))
        env_params = parallel.put(env_params, parallel.replicated(mesh))
        return jitted(state, env_params, fold, active)

    placed.compilations = jitted.compilations
    return placed
