"""Jitted deterministic backtest: roll a policy through the env over one out-of-sample period.

The period ``[lo, hi)`` has decision bars ``lo … hi−2`` and return bars ``lo+1 … hi−1``
(``M = hi − lo − 1`` of each). It is cut into ``n_windows`` contiguous windows that run in
parallel as the env's N axis (a ``lax.scan`` over ``⌈M / n_windows⌉`` steps, run in calls of
:data:`SCAN_CHUNK` steps so that periods of any length share one program); every window starts
flat and is liquidated at its end by the env's forced liquidation, and the per-bar records are
stitched back in time order, so every return bar of the period appears exactly once.
``n_windows = 1`` is one sequential episode (exact, the default); ``K`` windows add ``K − 1``
forced round trips in exchange for ``K×`` shorter sequential depth (GPU validation).

Returns are simple returns of equity, net of all costs: ``E_j = E_0 + Σ_{i ≤ j} pnl_i`` with a
constant contract count (no compounding of size), ``r_j = pnl_j / E_{j−1}``, so
``∏(1 + r_j) = E_M / E_0`` exactly up to float64 rounding. Reward shaping (churn penalty,
opportunity cost) is not a cash flow and is not in the returns.

With ``stride = k > 1`` the period is evaluated on k-bar bars: decisions every k-th bar
(``lo, lo+k, …``), each k-bar bar has the first open after the previous decision, the max high,
the min low and the close of its last bar. Annualise with ``periods_per_year(…)`` of an
``EvalConfig`` whose ``stride = k``. Costs stay per unit of time (:func:`strided_cfg`): the
holding cost of a k-bar bar is k bars' worth and limit orders expire after the same time.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jdqn.config import EnvConfig
from jdqn.env.core import (
    BRANCH_SIZES,
    EnvInputError,
    EnvParams,
    PolicyAux,
    make_params,
    observe,
    reset_at,
    step,
    validate_actions,
    with_window,
)


@struct.dataclass
class PolicyContext:
    """What a rule-based policy may know at a decision besides the observation (all ≤ t)."""

    t: jax.Array  # i32 [N]: decision bar (index into env.bars)
    position: jax.Array  # f32 [N]: contracts held
    key: jax.Array  # typed PRNG key for this step (random policies)
    env: EnvParams  # the env's arrays; read only bars ≤ t


PolicyFn = Callable[..., tuple[jax.Array, PolicyAux]]

# Per-step info fields recorded by the rollout (float64 / bool on the host).
_RECORDED = ("bar", "position", "intended_position", "target_position", "fill_qty", "fill_price",
             "filled", "gross_pnl", "commission", "spread_cost", "holding_cost", "net_pnl",
             "trade_closed", "closed_trade_pnl", "size_scale")


@dataclasses.dataclass(frozen=True)
class BacktestResult:
    """Per-return-bar records of one backtest, in time order (host numpy, float64 money)."""

    bar: np.ndarray  # int64 [n]: index in the original series of the bar that ends each period
    returns: np.ndarray  # f64 [n]: simple return of equity over the bar, net of costs
    net_pnl: np.ndarray  # f64 [n] $
    gross_pnl: np.ndarray  # f64 [n] $ (before commission, spread/slippage, holding cost)
    commission: np.ndarray  # f64 [n] $
    spread_cost: np.ndarray  # f64 [n] $ (half-spread + slippage of market orders)
    holding_cost: np.ndarray  # f64 [n] $
    position: np.ndarray  # f64 [n]: contracts held at the bar's close
    intended_position: np.ndarray  # f64 [n]: unsized target of the latest order
    target_position: np.ndarray  # f64 [n]: sized target of the live order, else the position
    fill_qty: np.ndarray  # f64 [n]: contracts bought (+) / sold (−) during the bar
    fill_price: np.ndarray  # f64 [n]: execution price incl. half-spread and slippage
    filled: np.ndarray  # bool [n]
    trade_closed: np.ndarray  # bool [n]: a trade was closed (flat or flipped) in this bar
    closed_trade_pnl: np.ndarray  # f64 [n] $: net PnL of the closed trade
    size_scale: np.ndarray  # f64 [n]: sizing-chain scale applied to the decision
    actions: np.ndarray  # int32 [n, 4]: the decision taken at the previous bar's close
    initial_equity: float
    max_position: float
    stride: int = 1
    # Index (into these records) of the bar at whose close equity first reached ≤ 0, or None.
    # The account is closed there: that bar's return is −1, and every record after it is flat
    # (no position, fill, trade, PnL or cost); the decisions the policy went on returning after
    # it are kept in ``actions`` but not counted by the metrics.
    wiped_out_at: int | None = None

    @property
    def n_bars(self) -> int:
        return int(self.returns.shape[0])

    @property
    def equity(self) -> np.ndarray:
        """f64 [n]: equity at each bar's close."""
        return self.initial_equity * np.cumprod(1.0 + self.returns)

    @property
    def total_costs(self) -> np.ndarray:
        return self.commission + self.spread_cost + self.holding_cost


def strided_arrays(features: np.ndarray, open: np.ndarray, high: np.ndarray, low: np.ndarray,
                   close: np.ndarray, lo: int, hi: int, stride: int
                   ) -> tuple[np.ndarray, ...]:
    """k-bar bars of ``[lo, hi)`` with decisions at ``lo + j·k``; returns arrays and bar map."""
    m = (hi - 1 - lo) // stride
    idx = lo + stride * np.arange(m + 1)  # decision / closing bars
    first = np.r_[lo, idx[:-1] + 1]  # first bar of each k-bar bar
    hi_k = np.maximum.reduceat(high[lo:idx[-1] + 1], first - lo)
    lo_k = np.minimum.reduceat(low[lo:idx[-1] + 1], first - lo)
    return features[idx], open[first], hi_k, lo_k, close[idx], idx


def _policy_caller(policy_fn: PolicyFn, obs_only: bool) -> PolicyFn:
    return _wrap_obs_only(policy_fn) if obs_only else policy_fn


@functools.cache
def _wrap_obs_only(policy_fn: PolicyFn) -> PolicyFn:
    # Cached so that the same obs-only policy hits the same jit cache entry.
    def call(policy_params: Any, obs: jax.Array, ctx: PolicyContext) -> Any:
        del policy_params, ctx
        return policy_fn(obs)

    return call


# Parallel backtest windows shorter than this many steps draw a warning: every window ends
# with a forced liquidation, which overrides that step's decision.
MIN_WINDOW_STEPS = 20

# Steps per call of the jitted scan. A backtest runs its ⌈M / n_windows⌉ steps as calls of this
# one program, carrying the env state between them, so every period length (each fold's
# validation window, the test window) shares one compiled program per policy and window count
# instead of one per length; the last call's steps past the windows' ends are inactive (the
# windows are done) and dropped like those of a window that ends early.
SCAN_CHUNK = 256


@jax.jit
def _begin(params: EnvParams, start: jax.Array, last: jax.Array) -> Any:
    return reset_at(params, start, last), jnp.zeros(start.shape, bool)


@functools.partial(jax.jit, static_argnames=("policy_fn", "n_steps"))
def _scan(params: EnvParams, policy_params: Any, carry: Any, i0: jax.Array, key: jax.Array,
          policy_fn: PolicyFn, n_steps: int) -> tuple[Any, dict[str, jax.Array]]:
    """Steps ``i0 … i0 + n_steps − 1`` of the rollout from ``carry`` (env state, done)."""

    def body(carry: Any, i: jax.Array) -> Any:
        state, done = carry
        obs = observe(params, state)
        ctx = PolicyContext(t=state.t, position=state.position, key=jax.random.fold_in(key, i),
                            env=params)
        action, aux = policy_fn(policy_params, obs, ctx)
        new, _, d, info = step(params, state, action, aux)
        active = ~done
        state = jax.tree.map(lambda a, b: jnp.where(active, a, b), new, state)
        rec = {k: info[k] for k in _RECORDED}
        rec.update(active=active, action=action, q_gap=aux.q_gap, q_var=aux.q_var)
        return (state, done | d), rec

    return jax.lax.scan(body, carry, i0 + jnp.arange(n_steps, dtype=jnp.int32))


def _chunk(n_steps: int) -> int:
    """Steps per call: :data:`SCAN_CHUNK`, or all of them for periods of at most a quarter of
    it (whose padding would cost more than a program of their own)."""
    return n_steps if n_steps <= SCAN_CHUNK // 4 else SCAN_CHUNK


def _run_scan(params: EnvParams, policy_params: Any, start: np.ndarray, last: np.ndarray,
              key: jax.Array, policy_fn: PolicyFn, n_steps: int) -> dict[str, np.ndarray]:
    """The rollout's per-step records ``[n_steps, N]`` (host), in calls of :data:`SCAN_CHUNK`
    steps (the last one's extra steps cut off)."""
    carry = _begin(params, jnp.asarray(start, jnp.int32), jnp.asarray(last, jnp.int32))
    chunk = _chunk(n_steps)
    parts = []
    for i0 in range(0, n_steps, chunk):
        carry, recs = _scan(params, policy_params, carry, jnp.int32(i0), key, policy_fn, chunk)
        parts.append(recs)
    parts = jax.device_get(parts)
    return {k: np.concatenate([np.asarray(r[k]) for r in parts])[:n_steps] for k in parts[0]}


def strided_cfg(cfg: EnvConfig, stride: int) -> EnvConfig:
    """The env config of a ``stride``-bar backtest, in its bars' units: the per-bar holding cost
    is charged for the ``stride`` bars each k-bar bar spans, and a limit order waits the same
    time (``⌈expiry / k⌉`` k-bar bars, at least one). Statistics measured over a number of
    bars (the CVaR and churn windows) count k-bar bars."""
    if stride == 1:
        return cfg
    return dataclasses.replace(
        cfg, holding_cost=cfg.holding_cost * stride,
        limit_expiry=tuple(max(1, -(-e // stride)) for e in cfg.limit_expiry))


def rollout(params: EnvParams, policy_fn: PolicyFn, policy_params: Any = None, *,
            lo: int | None = None, hi: int | None = None, n_windows: int = 1, stride: int = 1,
            key: jax.Array | None = None) -> BacktestResult:
    """Backtest ``policy_fn`` on ``[lo, hi)`` (default: the params' window) deterministically.

    Policy protocol: with ``policy_params=None`` the policy is ``policy_fn(obs f32 [N, W]) ->
    (action i32 [N, 4], PolicyAux)``; otherwise ``policy_fn(policy_params, obs, ctx:
    PolicyContext)`` — pass network weights as ``policy_params`` (not captured in a closure) and
    keep ``policy_fn`` the same object across calls so the jitted scan is reused.

    The policy's output is checked (shape/dtype before running, values after): out-of-range or
    non-finite actions, non-finite aux or a non-finite PnL raise :class:`EnvInputError`.
    """
    params, bar_map, start, last, n_steps = _setup(params, lo, hi, n_windows, stride)
    caller = _policy_caller(policy_fn, policy_params is None)
    key = jax.random.key(0) if key is None else key
    _check_policy_shapes(params, caller, policy_params, len(start), key)

    recs = _run_scan(params, policy_params, start, last, key, caller, n_steps)
    active = np.asarray(recs["active"]).T  # [K, S]; windows are in time order
    flat = {k: np.asarray(v).swapaxes(0, 1)[active] for k, v in recs.items() if k != "active"}
    validate_actions(flat["action"], PolicyAux(q_gap=flat["q_gap"], q_var=flat["q_var"]))
    return _assemble(flat, params, bar_map, stride)


def _setup(params: EnvParams, lo: int | None, hi: int | None, n_windows: int, stride: int
           ) -> tuple[EnvParams, np.ndarray | None, np.ndarray, np.ndarray, int]:
    """A rollout's env params (re-windowed or strided), bar map, window starts and last
    decision bars, and steps per window."""
    lo = int(params.lo) if lo is None else int(lo)
    hi = int(params.hi) if hi is None else int(hi)
    if not (0 <= lo and lo + 2 <= hi <= params.n_bars):
        raise EnvInputError(f"backtest period [{lo}, {hi}) must hold ≥ 2 of the {params.n_bars} "
                            "bars")
    if stride < 1:
        raise EnvInputError(f"stride must be ≥ 1, got {stride}")
    bar_map = None
    if stride > 1:
        host = [np.asarray(a) for a in (params.features, params.open, params.high, params.low,
                                         params.close)]
        # the k-bar bars of the history before lo, on the same grid: what the first decisions
        # look back on — the CVaR sizing input over the k-bar returns before them, as a
        # stride-1 backtest's over the bars before lo (built from the period alone it started
        # from zero returns, at full size), a momentum baseline's lookback; no decision is
        # made on them
        hist = lo // stride
        *arrays, bar_map = strided_arrays(*host, lo - stride * hist, hi, stride)
        if len(bar_map) - hist < 2:
            raise EnvInputError(f"period [{lo}, {hi}) is too short for stride {stride}")
        params = make_params(*arrays, strided_cfg(params.cfg, stride), lo=hist,
                             hi=len(bar_map), training=False,
                             state_width=params.state_width,
                             portfolio_offset=params.portfolio_offset)
        lo, hi = hist, len(bar_map)
    else:
        # The env clamps fills and episode ends to the params' own window, so the params must
        # carry [lo, hi) itself (a backtest of a later period with the training window's params
        # would otherwise replay the window's last bar with zero PnL).
        params = with_window(params, lo, hi, training=False)

    m = hi - lo - 1
    n_win = max(1, min(int(n_windows), m))
    n_steps = -(-m // n_win)
    n_win = -(-m // n_steps)  # drop windows that would be empty
    start = lo + n_steps * np.arange(n_win)
    last = np.minimum(start + n_steps, lo + m) - 1
    if n_win > 1 and n_steps < MIN_WINDOW_STEPS:
        warnings.warn(f"backtest of [{lo}, {hi}) in {n_win} windows of {n_steps} steps: each "
                      f"window's last step is a forced liquidation, so {1 / n_steps:.0%} of the "
                      "decisions are not the policy's; use fewer eval.n_windows", stacklevel=3)
    return params, bar_map, start, last, n_steps


def compile_rollout(params: EnvParams, policy_fn: PolicyFn, policy_params: Any = None, *,
                    lo: int | None = None, hi: int | None = None, n_windows: int = 1,
                    stride: int = 1, key: jax.Array | None = None) -> None:
    """Compile the programs :func:`rollout` with these arguments runs, without running them
    (``policy_params`` may be abstract: ``jax.ShapeDtypeStruct`` leaves), so that a backtest
    can be compiled ahead of its first call (:mod:`jdqn.train.ahead`)."""
    params, _, start, last, n_steps = _setup(params, lo, hi, n_windows, stride)
    caller = _policy_caller(policy_fn, policy_params is None)
    key = jax.random.key(0) if key is None else key
    _check_policy_shapes(params, caller, policy_params, len(start), key)
    start, last = jnp.asarray(start, jnp.int32), jnp.asarray(last, jnp.int32)
    _begin.lower(params, start, last).compile()
    carry = jax.eval_shape(_begin, params, start, last)
    _scan.lower(params, policy_params, carry, jnp.int32(0), key, caller,
                _chunk(n_steps)).compile()


def _check_policy_shapes(params: EnvParams, caller: PolicyFn, policy_params: Any, n: int,
                         key: jax.Array) -> None:
    obs = jax.ShapeDtypeStruct((n, params.state_width), jnp.float32)
    ctx = PolicyContext(t=jax.ShapeDtypeStruct((n,), jnp.int32),
                        position=jax.ShapeDtypeStruct((n,), jnp.float32), key=key, env=params)
    try:
        action, aux = jax.eval_shape(caller, policy_params, obs, ctx)
    except (TypeError, ValueError) as e:
        raise EnvInputError(f"policy must return (action [N, 4], PolicyAux); calling it failed: "
                            f"{e}") from e
    if action.shape != (n, len(BRANCH_SIZES)):
        raise EnvInputError(f"policy returned actions of shape {action.shape}; expected "
                            f"({n}, {len(BRANCH_SIZES)})")
    if not isinstance(aux, PolicyAux) or aux.q_gap.shape != (n,) or aux.q_var.shape != (n,):
        raise EnvInputError(f"policy must return a PolicyAux with q_gap, q_var of shape ({n},)")


def _assemble(flat: dict[str, np.ndarray], params: EnvParams, bar_map: np.ndarray | None,
              stride: int) -> BacktestResult:
    cfg = params.cfg
    net = flat["net_pnl"].astype(np.float64)
    if not np.isfinite(net).all():
        j = int(np.argmax(~np.isfinite(net)))
        raise EnvInputError(f"non-finite PnL at return bar {int(flat['bar'][j])}; check prices")
    equity = cfg.initial_equity + np.cumsum(net)
    prev = np.r_[cfg.initial_equity, equity[:-1]]
    with np.errstate(divide="ignore", invalid="ignore"):
        returns = net / prev
    bar = flat["bar"].astype(np.int64)
    if bar_map is not None:
        bar = bar_map[bar]
    f64 = {k: flat[k].astype(np.float64) for k in _RECORDED if k not in
           ("bar", "filled", "trade_closed")}
    filled = flat["filled"].astype(bool)
    trade_closed = flat["trade_closed"].astype(bool)
    wiped = None
    if (equity <= 0).any():  # equity wiped out: the loss is total, nothing after it counts
        wiped = int(np.argmax(equity <= 0))
        returns[wiped] = -1.0
        returns[wiped + 1:] = 0.0
        # The env traded on (it knows no account); the account itself closed at that bar, so
        # its records after it are flat — the dollar and trading metrics then agree with the
        # returns instead of counting trades made with money that was gone.
        for k, values in f64.items():
            if k != "fill_price":
                values[wiped + 1:] = 0.0
        filled[wiped + 1:] = False
        trade_closed[wiped + 1:] = False
    return BacktestResult(
        bar=bar, returns=returns, filled=filled, trade_closed=trade_closed,
        actions=np.asarray(flat["action"]).astype(np.int32), initial_equity=cfg.initial_equity,
        max_position=cfg.max_position, stride=stride, wiped_out_at=wiped, **f64)
