"""The learner's state: one pytree holding everything that evolves during training.

Axes: ``S`` seeds (every leaf of a multi-seed :class:`TrainState` has it first), ``N`` envs,
``C`` replay capacity, ``W`` state width.

What a replay item holds (``Transition``) is the bar index and the 7 portfolio slots of s and s′
plus the action, the n-step return and the bootstrap discount — the observation is rebuilt from
the on-device feature matrix when it is sampled (``env.obs_from_index``), so a transition costs
92 bytes with its priority instead of 2 × 128 floats (see ``docs/training.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from jdqn.config import Config
from jdqn.env import core as env_core
from jdqn.env.normalise import NormState, init_norm_state
from jdqn.losses.moe import MoEState, init_moe_state
from jdqn.networks.model import BranchingQNetwork, init_params
from jdqn.replay import nstep as nstep_lib
from jdqn.replay import per
from jdqn.train import parallel, safety
from jdqn.train.optim import make_optimizer

# Named tensors checked for finiteness every update (order fixed: it is the monitor's index).
CHECKED_TENSORS = ("rewards", "logits", "loss", "grads", "params")


@struct.dataclass
class Transition:
    """One replay item (an n-step transition). Leaves get a leading batch/capacity axis."""

    t: jax.Array  # i32 []: bar of s
    port: jax.Array  # f32 [P]: portfolio slots of s (P = len(PORTFOLIO_SLOTS))
    action: jax.Array  # i32 [4]
    reward: jax.Array  # f32 []: n-step discounted (normalised) return
    discount: jax.Array  # f32 []: γ^m · (1 − terminal)
    next_t: jax.Array  # i32 []: bar of s′
    next_port: jax.Array  # f32 [P]: portfolio slots of s′


@struct.dataclass
class StepRecord:
    """One collected env step (leaves ``[N, ...]``), the unit of the n-step window."""

    t: jax.Array
    port: jax.Array
    action: jax.Array
    reward: jax.Array
    done: jax.Array  # the forced-liquidation step that ended the episode
    truncated: jax.Array  # the episode's next step (if any) is its forced-liquidation step
    next_t: jax.Array
    next_port: jax.Array


@struct.dataclass
class TrainState:
    """Everything that evolves. Every leaf has a fold-boundary rule in ``jdqn.train.policy``."""

    params: Any  # online network (trunk, C51 heads, IQN head)
    target_params: Any  # target network (one tree: the IQN target is inside)
    best_params: Any  # best-by-validation-Sharpe params of the current fold
    opt_state: Any  # optax state (base LR is a leaf: changing it never recompiles)
    replay: per.ReplayState
    nstep: nstep_lib.NStepCarry  # last n−1 collected steps (the n-step window carry)
    env: env_core.EnvState
    norm: NormState  # reward-normaliser statistics (carried across folds)
    moe: MoEState  # gate-entropy EMA driving the adaptive load-balance λ
    monitor: safety.NaNMonitor  # first non-finite named tensor (sticky)
    key: jax.Array  # typed PRNG key
    update_step: jax.Array  # i32 []: gradient updates this fold (schedules)
    collect_step: jax.Array  # i32 []: vectorised env steps in total (exploration schedule)
    q_abs_ema: jax.Array  # f32 []: EMA of |mean Q| of collected states (diagnostic)


@dataclass(frozen=True, eq=False)
class Learner:
    """The static pieces (network, optimiser, configs) that the jitted functions close over.

    Equality and hash are those of ``(cfg, flow_idx, width, n_devices)``, which determine
    everything else, so two learners built from the same config share compiled programs
    (``functools.cache``).
    """

    cfg: Config
    net: BranchingQNetwork
    tx: optax.GradientTransformation
    width: int  # observation width W
    n_devices: int = 1  # data-parallel devices (jdqn.train.parallel); 1 = one device

    @property
    def axis(self) -> str | None:
        """The mesh axis of the data-parallel collectives, None on one device."""
        return parallel.AXIS if self.n_devices > 1 else None

    def _key(self) -> tuple:
        return (self.cfg, tuple(self.net.flow_idx), self.width, self.n_devices)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Learner) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @staticmethod
    def create(cfg: Config, flow_idx: tuple[int, ...], width: int) -> Learner:
        """The learner for ``cfg``; ``parallel.n_devices`` is resolved against the devices JAX
        sees (a count it cannot have is a ConfigError)."""
        net = BranchingQNetwork(cfg.model, tuple(flow_idx))
        return Learner(cfg=cfg, net=net, tx=make_optimizer(cfg.train), width=width,
                       n_devices=parallel.resolve_n_devices(cfg))


def transition_example() -> Transition:
    f, i, p = jnp.float32, jnp.int32, env_core.N_PORTFOLIO
    return Transition(t=jnp.zeros((), i), port=jnp.zeros((p,), f), action=jnp.zeros((4,), i),
                      reward=jnp.zeros((), f), discount=jnp.zeros((), f),
                      next_t=jnp.zeros((), i), next_port=jnp.zeros((p,), f))


def step_example(n_envs: int) -> StepRecord:
    f, i, p = jnp.float32, jnp.int32, env_core.N_PORTFOLIO
    return StepRecord(t=jnp.zeros((n_envs,), i), port=jnp.zeros((n_envs, p), f),
                      action=jnp.zeros((n_envs, 4), i), reward=jnp.zeros((n_envs,), f),
                      done=jnp.zeros((n_envs,), bool), truncated=jnp.zeros((n_envs,), bool),
                      next_t=jnp.zeros((n_envs,), i),
                      next_port=jnp.zeros((n_envs, p), f))


def init_state(learner: Learner, key: jax.Array, env_params: env_core.EnvParams) -> TrainState:
    """A fresh single-seed state (vmap over keys for several seeds)."""
    cfg = learner.cfg
    k_params, k_env, k_run = jax.random.split(key, 3)
    params = init_params(learner.net, k_params, learner.width)
    return TrainState(
        params=params,
        target_params=params,
        best_params=params,
        opt_state=learner.tx.init(params),
        replay=per.init(cfg.train.replay_capacity, transition_example()),
        nstep=nstep_lib.carry_init(cfg.train.n_step, step_example(cfg.env.n_envs)),
        env=env_core.reset(env_params, k_env),
        norm=init_norm_state(cfg.env),
        moe=init_moe_state(cfg.model.n_experts),
        monitor=safety.monitor_init(),
        key=k_run,
        update_step=jnp.zeros((), jnp.int32),
        collect_step=jnp.zeros((), jnp.int32),
        q_abs_ema=jnp.zeros((), jnp.float32),
    )


def seed_keys(seeds: tuple[int, ...]) -> jax.Array:
    """One independent typed key per seed (``[S]``): each seed its own stream (PureJaxRL #35)."""
    return jnp.stack([jax.random.key(s) for s in seeds])
