"""Rule-based baselines, run through the same backtest engine (identical fills and costs).

All send full-magnitude market orders with full conviction (``PolicyAux.confident``) and "hold"
when their position already has the wanted sign, so they do not pay for needless rebalancing.
Their orders go through the env's sizing chain like the agent's: the Kelly and CVaR factors
still scale them (a baseline that trades often and loses ends up small), so compare policies by
Sharpe, not by return:

* ``flat``: never trades;
* ``buy_and_hold``: goes long at the first decision, holds to the end;
* ``momentum``: the sign of ``close[t] − close[t − L]`` (``L = momentum_lookback`` evaluation
  bars), long / short, hold when 0; a run refuses an ``L`` that reaches before the data from
  the test window's first decision (``folds.check_momentum_lookback``: the past close would be
  clamped to bar 0);
* ``random``: uniform over all 108 joint actions, seeded from ``EvalConfig.random_seed``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jdqn.config import EvalConfig
from jdqn.env.core import BRANCH_SIZES, FLAT, HOLD, LONG, MARKET, SHORT, EnvParams, PolicyAux
from jdqn.evaluate.backtest import BacktestResult, PolicyContext, compile_rollout, rollout

FULL = 2


def _orders(direction: jax.Array) -> jax.Array:
    n = direction.shape[0]
    return jnp.stack([direction, jnp.full((n,), FULL), jnp.full((n,), MARKET),
                      jnp.zeros((n,), jnp.int32)], axis=-1).astype(jnp.int32)


def flat_policy(policy_params: Any, obs: jax.Array, ctx: PolicyContext
                ) -> tuple[jax.Array, PolicyAux]:
    n = obs.shape[0]
    return _orders(jnp.full((n,), FLAT)), PolicyAux.confident(n)


def buy_and_hold_policy(policy_params: Any, obs: jax.Array, ctx: PolicyContext
                        ) -> tuple[jax.Array, PolicyAux]:
    n = obs.shape[0]
    return _orders(jnp.where(ctx.position > 0, HOLD, LONG)), PolicyAux.confident(n)


def momentum_policy(policy_params: Any, obs: jax.Array, ctx: PolicyContext
                    ) -> tuple[jax.Array, PolicyAux]:
    lookback = policy_params
    close = ctx.env.close
    past = close[jnp.maximum(ctx.t - lookback, 0)]  # bars ≤ t only
    s = jnp.sign(close[ctx.t] - past)
    want = jnp.where(s > 0, LONG, jnp.where(s < 0, SHORT, HOLD))
    direction = jnp.where(jnp.sign(ctx.position) == s, HOLD, want)
    return _orders(direction), PolicyAux.confident(obs.shape[0])


def random_policy(policy_params: Any, obs: jax.Array, ctx: PolicyContext
                  ) -> tuple[jax.Array, PolicyAux]:
    n = obs.shape[0]
    action = jax.random.randint(ctx.key, (n, len(BRANCH_SIZES)), 0, jnp.array(BRANCH_SIZES))
    return action.astype(jnp.int32), PolicyAux.confident(n)


BASELINES = {"flat": flat_policy, "buy_and_hold": buy_and_hold_policy,
             "momentum": momentum_policy, "random": random_policy}
_ORDER = tuple(BASELINES)


def any_baseline_policy(policy_params: tuple[jax.Array, jax.Array], obs: jax.Array,
                        ctx: PolicyContext) -> tuple[jax.Array, PolicyAux]:
    """The baseline numbered ``policy_params[0]`` (in :data:`BASELINES` order) with momentum
    lookback ``policy_params[1]``. The number is traced, so all the baselines run through one
    compiled backtest program instead of one each (on the 2-core CPU of 2026-12-01 the four
    took 5.9 s to compile at the end of every quickstart run)."""
    index, lookback = policy_params
    branches = [lambda o, cx, f=BASELINES[name]: f(lookback, o, cx) for name in _ORDER]
    return jax.lax.switch(index, branches, obs, ctx)


def _params_of(name: str, eval_cfg: EvalConfig) -> tuple[jax.Array, jax.Array]:
    return jnp.int32(_ORDER.index(name)), jnp.asarray(eval_cfg.momentum_lookback, jnp.int32)


def compile_baselines(params: EnvParams, eval_cfg: EvalConfig, *, lo: int | None = None,
                      hi: int | None = None, n_windows: int | None = None) -> None:
    """Compile the one program :func:`run_baselines` with these arguments runs, without
    running it (:mod:`jdqn.train.ahead`)."""
    compile_rollout(params, any_baseline_policy, _params_of("flat", eval_cfg), lo=lo, hi=hi,
                    n_windows=eval_cfg.n_windows if n_windows is None else n_windows,
                    stride=eval_cfg.stride, key=jax.random.key(eval_cfg.random_seed))


def run_baselines(params: EnvParams, eval_cfg: EvalConfig, *, lo: int | None = None,
                  hi: int | None = None, names: tuple[str, ...] | None = None,
                  n_windows: int | None = None) -> dict[str, BacktestResult]:
    """Backtest each baseline of ``names`` (default ``eval_cfg.baselines``) on ``[lo, hi)``."""
    names = eval_cfg.baselines if names is None else names
    out = {}
    for name in names:
        if name not in BASELINES:
            raise ValueError(f"unknown baseline {name!r}; known: {', '.join(BASELINES)}")
        out[name] = rollout(params, any_baseline_policy, _params_of(name, eval_cfg), lo=lo, hi=hi,
                            n_windows=eval_cfg.n_windows if n_windows is None else n_windows,
                            stride=eval_cfg.stride, key=jax.random.key(eval_cfg.random_seed))
    return out
