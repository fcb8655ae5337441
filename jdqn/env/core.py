"""Vectorised single-instrument futures environment: pure functions over N parallel episodes.

Axes: ``T`` bars, ``F`` features, ``W`` observation width, ``N`` episodes, ``B`` a replay batch.
Every function is jittable, vmappable and scannable; nothing loops over episodes or bars.

Timing (see ``docs/env.md`` for the full fill model with formulas): an episode at bar ``t`` has
seen bars ``≤ t`` only. ``step`` takes the decision made at the close of bar ``t`` and executes it
during bar ``t + 1`` (market orders at ``open[t+1]``, limits if bar ``t + 1`` trades through the
limit price), marks the position to ``close[t+1]`` and advances to ``t + 1``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jdqn.config import EnvConfig
from jdqn.data.layout import PORTFOLIO_SLOTS
from jdqn.env.sizing import FACTOR_NAMES, cvar_series, sizing_factors
from jdqn.errors import JdqnError

# Branches of the factorised action (int32 [N, 4] columns).
BRANCH_NAMES = ("direction", "magnitude", "order_type", "urgency")
BRANCH_SIZES = (4, 3, 3, 3)
ACTION_LABELS = (
    ("short", "hold", "long", "flat"),
    ("quarter", "half", "full"),
    ("market", "limit_touch", "limit_passive"),
    ("urgency_0", "urgency_1", "urgency_2"),
)
SHORT, HOLD, LONG, FLAT = 0, 1, 2, 3
MARKET, LIMIT_TOUCH, LIMIT_PASSIVE = 0, 1, 2
MAGNITUDES = (0.25, 0.5, 1.0)
# How far past a limit price a bar must trade for it to fill ("strictly through"), in ticks:
# far below any real price step, far above float32's rounding of prices on a decimal tick grid.
_THROUGH_TICKS = 0.01

# Portfolio slots of the observation, in StateLayout order.
N_PORTFOLIO = len(PORTFOLIO_SLOTS)
PNL_SLOT_UNIT = 1e-3  # unrealised-PnL slot is open-trade PnL in units of 0.1 % of equity …
PNL_SLOT_CLIP = 10.0  # … clipped to ±10 (1 % of equity) so one bad trade cannot blow up inputs
TIME_SLOT_NORM = math.log1p(1000.0)  # time slot = log1p(bars) / log1p(1000)
ORDER_DIST_CLIP = 10.0  # order-distance slot: limit price − close in ticks, clipped ±10, / 10


class EnvInputError(JdqnError, ValueError):
    """Bad input at the env/backtest API edge (prices, features, windows, actions)."""


@struct.dataclass
class PolicyAux:
    """What the agent's heads tell the env besides the action (sizing, opportunity cost)."""

    q_gap: jax.Array  # f32 [N]: Q(best) − Q(second best) of the direction branch
    q_var: jax.Array  # f32 [N]: Var[Z] of the chosen direction's return distribution

    @staticmethod
    def zeros(n: int) -> PolicyAux:
        """No information: conviction sits at its floor."""
        return PolicyAux(q_gap=jnp.zeros((n,), jnp.float32), q_var=jnp.zeros((n,), jnp.float32))

    @staticmethod
    def confident(n: int) -> PolicyAux:
        """Full conviction, no variance penalty (rule-based baselines)."""
        return PolicyAux(q_gap=jnp.full((n,), 1e6, jnp.float32), q_var=jnp.zeros((n,), jnp.float32))


@struct.dataclass
class EnvParams:
    """Everything the env reads: device arrays, window bounds and static config.

    ``lo``, ``hi`` and ``training`` are array leaves, so switching the window (train → validation)
    or the mode does not recompile.
    """

    features: jax.Array  # f32 [T, F], normalised
    bars: jax.Array  # f32 [T, 5]: open, high, low, close, CVaR of a full-size 1-bar position
    lo: jax.Array  # i32 []: first bar the env may read
    hi: jax.Array  # i32 []: one past the last bar the env may read
    training: jax.Array  # bool []: opportunity cost only when True
    cfg: EnvConfig = struct.field(pytree_node=False)
    state_width: int = struct.field(pytree_node=False, default=128)
    portfolio_offset: int = struct.field(pytree_node=False, default=0)

    @property
    def open(self) -> jax.Array:
        return self.bars[:, 0]

    @property
    def high(self) -> jax.Array:
        return self.bars[:, 1]

    @property
    def low(self) -> jax.Array:
        return self.bars[:, 2]

    @property
    def close(self) -> jax.Array:
        return self.bars[:, 3]

    @property
    def n_bars(self) -> int:
        return int(self.bars.shape[0])


@struct.dataclass
class EnvState:
    """Structure of arrays for N episodes; every leaf has leading axis N."""

    t: jax.Array  # i32 [N]: current bar (decisions are made at its close)
    last: jax.Array  # i32 [N]: final decision bar; the step from it liquidates and ends
    position: jax.Array  # f32 [N]: signed contracts held
    target: jax.Array  # f32 [N]: sized target of the live order; the position when none is live
    intended: jax.Array  # f32 [N]: unsized target (direction × magnitude × max_position)
    pend_price: jax.Array  # f32 [N]: limit price of the live limit order
    pend_left: jax.Array  # i32 [N]: bars the live limit order may still fill in (0 = none)
    trade_pnl: jax.Array  # f32 [N]: $ net PnL of the open trade (0 when flat)
    time_in_pos: jax.Array  # i32 [N]: bars since the open trade was entered
    last_dir: jax.Array  # i32 [N]: sign of the last non-hold direction (−1, 0, +1)
    n_trades: jax.Array  # i32 [N]: closed trades in this episode (Kelly; reset with it)
    n_wins: jax.Array  # i32 [N]
    sum_win: jax.Array  # f32 [N]: $ sum of winning closed trades
    sum_loss: jax.Array  # f32 [N]: $ sum of |losing closed trades|


# --------------------------------------------------------------------------------------------
# construction and validation (host side, before jit)
# --------------------------------------------------------------------------------------------


def check_inputs(features: Any, open: Any, high: Any, low: Any, close: Any) -> None:
    """Validate bar arrays on the host; raise :class:`EnvInputError` naming the row and problem."""
    feats = np.asarray(features)
    cols = {"open": np.asarray(open), "high": np.asarray(high), "low": np.asarray(low),
            "close": np.asarray(close)}
    if feats.ndim != 2:
        raise EnvInputError(f"features must be [T, F], got shape {feats.shape}")
    t_len = feats.shape[0]
    if t_len < 2:
        raise EnvInputError(f"need at least 2 bars, got {t_len}")
    for name, a in cols.items():
        if a.shape != (t_len,):
            raise EnvInputError(f"{name} must have shape ({t_len},) like features, got {a.shape}")
        bad = ~np.isfinite(a)
        if bad.any():
            raise EnvInputError(f"{name} price is not finite (NaN/Inf) at bar {int(np.argmax(bad))}")
        if (a <= 0).any():
            raise EnvInputError(f"{name} price is not positive at bar {int(np.argmax(a <= 0))}")
    if not np.issubdtype(feats.dtype, np.floating) and not np.issubdtype(feats.dtype, np.integer):
        raise EnvInputError(f"features must be numeric, got dtype {feats.dtype}")
    top = np.maximum(cols["open"], cols["close"])
    bot = np.minimum(cols["open"], cols["close"])
    bad = (cols["high"] < top) | (cols["low"] > bot)
    if bad.any():
        raise EnvInputError(f"inconsistent bar at {int(np.argmax(bad))}: need low ≤ open, close ≤ "
                            "high")


TICK_GRID_TOLERANCE = 0.01  # of a tick: prices further off the grid are refused


def check_tick_grid(tick_size: float, **prices: Any) -> None:
    """Refuse prices off the ``tick_size`` grid: raise :class:`EnvInputError` naming the first
    bar, its price, how far off the grid it is and the fixes. Costs (spread, slippage) and limit
    prices are counted in ticks of ``env.tick_size``, so data on another grid (a tick of 0.01
    against the default 0.25) would be charged and filled in the wrong units without a word.
    Rounding is allowed for: a price passes within 1 % of a tick of the grid plus one float32
    unit in the last place at its level (the env holds prices in float32; 4123.37 is 0.012 of
    a 0.01 tick off the grid there)."""
    for name, a in prices.items():
        a = np.asarray(a)
        ticks = a.astype(np.float64) / tick_size
        off = np.abs(ticks - np.round(ticks))
        ulp = np.spacing(np.abs(a).astype(np.float32)).astype(np.float64) / tick_size
        bad = off > TICK_GRID_TOLERANCE + ulp
        if bad.any():
            i = int(np.argmax(bad))
            raise EnvInputError(
                f"{name} price {float(a[i])!r} at bar {i} is off the env.tick_size "
                f"= {tick_size} grid ({off[i]:.3f} of a tick; {int(bad.sum())} of {bad.size} "
                f"{name} prices are): set env.tick_size to the instrument's tick, or "
                "env.check_tick_grid = false for a series that is off any grid (a ratio "
                "back-adjusted continuous contract)")


def _check_window(t_len: int, lo: int, hi: int, min_len: int) -> None:
    if not (0 <= lo < hi <= t_len):
        raise EnvInputError(f"window [{lo}, {hi}) is not inside the {t_len} bars")
    if hi - lo < min_len:
        raise EnvInputError(f"window [{lo}, {hi}) has {hi - lo} bars; need ≥ {min_len}")


def make_params(features: Any, open: Any, high: Any, low: Any, close: Any, cfg: EnvConfig, *,
                lo: int = 0, hi: int | None = None, training: bool = True, state_width: int = 128,
                portfolio_offset: int | None = None) -> EnvParams:
    """Validate host arrays and put them on the device as :class:`EnvParams`.

    ``portfolio_offset`` (default ``F``) is the first portfolio column of the observation, per
    ``StateLayout``; ``state_width`` its total width.
    """
    check_inputs(features, open, high, low, close)
    feats = np.asarray(features, dtype=np.float32)
    t_len, n_feat = feats.shape
    hi = t_len if hi is None else int(hi)
    offset = n_feat if portfolio_offset is None else int(portfolio_offset)
    if offset < n_feat or offset + N_PORTFOLIO > state_width:
        raise EnvInputError(f"layout does not fit: {n_feat} features, portfolio at column {offset}"
                            f" + {N_PORTFOLIO} slots, state width {state_width}")
    _check_window(t_len, int(lo), hi, 2)
    if not np.isfinite(feats[lo:hi]).all():
        row = int(lo + np.argmax(~np.isfinite(feats[lo:hi]).all(axis=1)))
        raise EnvInputError(f"features are not finite at bar {row} inside the window [{lo}, {hi})")
    risk = cvar_series(np.asarray(close), cfg.sizing, cfg.max_position, cfg.contract_multiplier,
                       cfg.initial_equity)
    bars = np.stack([np.asarray(a, np.float64) for a in (open, high, low, close)] + [risk], axis=1)
    return EnvParams(features=jnp.asarray(feats), bars=jnp.asarray(bars, jnp.float32),
                     lo=jnp.asarray(lo, jnp.int32), hi=jnp.asarray(hi, jnp.int32),
                     training=jnp.asarray(training), cfg=cfg, state_width=int(state_width),
                     portfolio_offset=offset)


def with_window(params: EnvParams, lo: int, hi: int, training: bool | None = None,
                min_len: int = 2) -> EnvParams:
    """Same arrays, another window ``[lo, hi)`` (and mode); validated on the host, no recompile."""
    _check_window(params.n_bars, int(lo), int(hi), min_len)
    if not bool(jnp.isfinite(params.features[lo:hi]).all()):
        raise EnvInputError(f"features are not finite inside the window [{lo}, {hi})")
    training = params.training if training is None else jnp.asarray(training)
    return params.replace(lo=jnp.asarray(lo, jnp.int32), hi=jnp.asarray(hi, jnp.int32),
                          training=training)


def validate_actions(action: Any, aux: PolicyAux | None = None, n: int | None = None) -> None:
    """Host-side check of a policy's output; raise :class:`EnvInputError` on anything bad.

    Accepts ``[N, 4]`` (one step) or ``[S, N, 4]`` (a recorded rollout). Float actions are
    accepted only when finite and whole.
    """
    a = np.asarray(action)
    if a.ndim < 2 or a.shape[-1] != len(BRANCH_SIZES):
        raise EnvInputError(f"actions must be [N, 4] (direction, magnitude, order type, urgency), "
                            f"got shape {a.shape}")
    if n is not None and a.shape[-2] != n:
        raise EnvInputError(f"actions have {a.shape[-2]} rows, the env has {n} episodes")
    if np.issubdtype(a.dtype, np.floating):
        if not np.isfinite(a).all():
            idx = np.argwhere(~np.isfinite(a))[0]
            raise EnvInputError(f"action is NaN/Inf at index {tuple(int(i) for i in idx)}")
        if (a != np.round(a)).any():
            idx = np.argwhere(a != np.round(a))[0]
            raise EnvInputError(f"action is not a whole number at index "
                                f"{tuple(int(i) for i in idx)}: {a[tuple(idx)]}")
    elif not np.issubdtype(a.dtype, np.integer):
        raise EnvInputError(f"actions must be integers, got dtype {a.dtype}")
    for b, (name, size) in enumerate(zip(BRANCH_NAMES, BRANCH_SIZES, strict=True)):
        col = a[..., b]
        bad = (col < 0) | (col >= size)
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            raise EnvInputError(f"{name} action {col[idx]} out of range [0, {size}) at index {idx}")
    if aux is not None:
        for name in ("q_gap", "q_var"):
            v = np.asarray(getattr(aux, name))
            if v.shape != a.shape[:-1]:
                raise EnvInputError(f"aux.{name} must have shape {a.shape[:-1]}, got {v.shape}")
            if not np.isfinite(v).all():
                idx = tuple(int(i) for i in np.argwhere(~np.isfinite(v))[0])
                raise EnvInputError(f"aux.{name} is NaN/Inf at index {idx}")


# --------------------------------------------------------------------------------------------
# reset
# --------------------------------------------------------------------------------------------


def reset_at(params: EnvParams, start: jax.Array, last: jax.Array) -> EnvState:
    """Flat episodes starting at bar ``start`` whose final decision bar is ``last`` (i32 [N])."""
    start = jnp.asarray(start, jnp.int32)

    # Distinct buffers per leaf (not one shared zeros array), so the state can be donated.
    def zf() -> jax.Array:
        return jnp.zeros(start.shape, jnp.float32)

    def zi() -> jax.Array:
        return jnp.zeros(start.shape, jnp.int32)

    return EnvState(t=start, last=jnp.asarray(last, jnp.int32), position=zf(), target=zf(),
                    intended=zf(), pend_price=zf(), pend_left=zi(), trade_pnl=zf(),
                    time_in_pos=zi(), last_dir=zi(), n_trades=zi(), n_wins=zi(), sum_win=zf(),
                    sum_loss=zf())


def hash_u32(seed: jax.Array, idx: jax.Array) -> jax.Array:
    """Counter-based 32-bit hash (murmur3 finaliser) of ``seed ⊕ idx``: u32, same shape as idx.

    One threefry draw per call plus this hash per episode is ~10× cheaper on CPU than a threefry
    draw per episode, and is reproducible from the key.
    """
    x = idx.astype(jnp.uint32) * jnp.uint32(0x9E3779B1) ^ seed.astype(jnp.uint32)
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def reset(params: EnvParams, key: jax.Array, n: int | None = None) -> EnvState:
    """``n`` (default ``cfg.n_envs``) flat episodes of ``cfg.episode_length`` steps at random
    starts in the window.

    An episode starting at ``s`` decides at bars ``s … s+L−1`` and fills up to bar ``s+L``,
    so ``s ≤ hi − L − 1``: it never reads a bar outside ``[lo, hi)``. The window should hold
    at least ``L + 1`` bars (the trainer's do; :func:`with_window`'s ``min_len`` checks it on
    the host); in a shorter one the episodes start at ``lo`` and end early, their last decision
    at bar ``hi − 2`` filled in bar ``hi − 1`` — never stepping on at the clamped last bar,
    where an order decided at its close would fill at its open, before the decision.
    Starts are uniform over the ``hi − lo − L`` admissible bars (modulo bias < span / 2³²).
    """
    n, length = params.cfg.n_envs if n is None else n, params.cfg.episode_length
    span = jnp.maximum(params.hi - params.lo - length, 1).astype(jnp.uint32)
    seed = jax.random.bits(key, (), jnp.uint32)
    start = params.lo + (hash_u32(seed, jnp.arange(n)) % span).astype(jnp.int32)
    return reset_at(params, start, jnp.minimum(start + length - 1, params.hi - 2))


def auto_reset(params: EnvParams, state: EnvState, done: jax.Array, key: jax.Array) -> EnvState:
    """Replace finished episodes (``done`` bool [N]) by fresh ones, Kelly statistics included.

    The Kelly statistics restart with each episode, as in the backtest: a new episode starts at
    a random bar, often *before* bars where the previous one traded, so carrying its closed
    trades over would size decisions at bar t with outcomes from bars after t (lookahead)."""
    fresh = reset(params, key, done.shape[0])
    return jax.tree.map(lambda a, b: jnp.where(done, a, b), fresh, state)


# --------------------------------------------------------------------------------------------
# observation
# --------------------------------------------------------------------------------------------


def portfolio(params: EnvParams, state: EnvState) -> jax.Array:
    """The portfolio slots (``PORTFOLIO_SLOTS``), f32 [N, 7]: position / max_position,
    open-trade PnL (0.1 % of equity, clipped ±10), log1p(time in position) / log1p(1000), last
    direction (−1, 0, +1), and the live limit order (all 0 when there is none): its remaining
    quantity (target − position) / max_position, the bars it may still fill in / the longest
    ``limit_expiry``, and its price's distance from bar t's close in ticks, clipped ±10, / 10.
    Everything is known at bar t's close."""
    cfg = params.cfg
    pnl = jnp.clip(state.trade_pnl / (cfg.initial_equity * PNL_SLOT_UNIT), -PNL_SLOT_CLIP,
                   PNL_SLOT_CLIP)
    live = (state.pend_left > 0) & (state.target != state.position)
    close = params.bars[state.t, 3]
    dist = jnp.clip((state.pend_price - close) / cfg.tick_size, -ORDER_DIST_CLIP,
                    ORDER_DIST_CLIP) / ORDER_DIST_CLIP
    zero = jnp.zeros_like(state.position)
    return jnp.stack([state.position / cfg.max_position, pnl,
                      jnp.log1p(state.time_in_pos.astype(jnp.float32)) / TIME_SLOT_NORM,
                      state.last_dir.astype(jnp.float32),
                      jnp.where(live, (state.target - state.position) / cfg.max_position, zero),
                      jnp.where(live, state.pend_left.astype(jnp.float32)
                                / max(cfg.limit_expiry), zero),
                      jnp.where(live, dist, zero)], axis=-1)


def obs_from_index(params: EnvParams, t: jax.Array, portfolio_slots: jax.Array) -> jax.Array:
    """Rebuild observations from bar indices ``t: i32 [B]`` and ``portfolio_slots: f32 [B, P]``
    (P = ``N_PORTFOLIO``):
    ``features[t]`` in columns ``[0, F)``, portfolio at ``portfolio_offset``, zeros elsewhere.
    Returns f32 [B, W]."""
    feats = params.features[t]
    b, n_feat = feats.shape
    gap = params.portfolio_offset - n_feat
    tail = params.state_width - params.portfolio_offset - N_PORTFOLIO
    parts = [feats]
    if gap:
        parts.append(jnp.zeros((b, gap), jnp.float32))
    parts.append(portfolio_slots.astype(jnp.float32))
    if tail:
        parts.append(jnp.zeros((b, tail), jnp.float32))
    return jnp.concatenate(parts, axis=-1)


def observe(params: EnvParams, state: EnvState) -> jax.Array:
    """Observation at each episode's current bar, f32 [N, W]; reads bar ``state.t`` only."""
    return obs_from_index(params, state.t, portfolio(params, state))


# --------------------------------------------------------------------------------------------
# step
# --------------------------------------------------------------------------------------------


def _pick3(i: jax.Array, values: tuple[float, float, float]) -> jax.Array:
    return jnp.where(i == 0, values[0], jnp.where(i == 1, values[1], values[2]))


def step(params: EnvParams, state: EnvState, action: jax.Array, aux: PolicyAux
         ) -> tuple[EnvState, jax.Array, jax.Array, dict[str, jax.Array]]:
    """Execute the decisions made at the close of bar ``t`` during bar ``t + 1``.

    ``action: i32 [N, 4]``, ``aux: PolicyAux``. Returns ``(state, reward f32 [N], done bool [N],
    info)``; ``info`` holds per-episode f32/i32/bool [N] arrays (dollar PnL and costs, fill,
    intended and realised position, sizing factors). The step from bar ``state.last`` closes the
    position with a market order at the next open and returns ``done = True``; see
    :func:`auto_reset`. Out-of-range actions are the caller's bug: they are clamped here (no NaN),
    and :func:`validate_actions` / the backtest report them.
    """
    cfg = params.cfg
    mult, tick = cfg.contract_multiplier, cfg.tick_size
    half = 0.5 * cfg.spread_ticks * tick
    slip = cfg.slippage_ticks * tick

    t = state.t
    t1 = jnp.minimum(t + 1, params.hi - 1)  # never read past the window, even if not reset
    row0 = params.bars[t]
    row1 = params.bars[t1]
    c0, risk = row0[:, 3], row0[:, 4]
    o1, h1, l1, c1 = row1[:, 0], row1[:, 1], row1[:, 2], row1[:, 3]
    is_last = t >= state.last

    action = action.astype(jnp.int32)
    direction, magnitude, otype, urgency = (action[:, i] for i in range(4))
    q_gap = jnp.where(jnp.isfinite(aux.q_gap), aux.q_gap, 0.0)
    q_var = jnp.where(jnp.isfinite(aux.q_var), aux.q_var, 0.0)
    scale, factors = sizing_factors(cfg.sizing, q_gap, q_var, state.n_trades, state.n_wins,
                                    state.sum_win, state.sum_loss, risk)

    # The new order (if any). Hold keeps the position and any live limit order; the last step
    # of an episode is a forced flat market order whatever the policy chose.
    sign = jnp.where(direction == SHORT, -1.0, jnp.where(direction == LONG, 1.0, 0.0))
    sign = jnp.where(is_last, 0.0, sign)
    intended_new = sign * _pick3(magnitude, MAGNITUDES) * cfg.max_position
    target_new = intended_new * scale
    if cfg.lot_size > 0:  # whole lots, cut toward zero: never more than the chain allows
        # (the 1 + 1e-6 keeps a product that is a whole number of lots but rounded a hair
        # below it, e.g. 41 × float32(1/41) = 0.99999994, from losing a lot)
        target_new = jnp.trunc(target_new / cfg.lot_size * (1.0 + 1e-6)) * cfg.lot_size
    new_order = (direction != HOLD) | is_last
    if cfg.lot_size > 0:  # a target under one lot places no order (docs/env.md): not a close
        new_order = new_order & ~((target_new == 0.0) & (intended_new != 0.0))
    otype = jnp.where(is_last, MARKET, otype)
    pos = state.position

    market_new = new_order & (otype == MARKET)
    limit_new = new_order & (otype != MARKET)
    offset = half + jnp.where(otype == LIMIT_PASSIVE, tick, 0.0)
    price_new = jnp.where(target_new > pos, c0 - offset, c0 + offset)
    expiry = _pick3(urgency, tuple(float(e) for e in cfg.limit_expiry)).astype(jnp.int32)
    target = jnp.where(new_order, target_new, state.target)
    pend_price = jnp.where(limit_new, price_new, state.pend_price)
    pend_left = jnp.where(limit_new, expiry, jnp.where(market_new, 0, state.pend_left))

    # Fills during bar t+1. A limit fills only if the bar trades strictly through its price:
    # by more than 1 % of a tick, so that a low or high that only touches it never counts,
    # whatever float32 rounding did to the two (with a decimal tick such as 0.01, c0 − offset
    # can come out an ulp above the grid price a touching low is stored as).
    through = _THROUGH_TICKS * tick
    mkt_fill = market_new & (target != pos)
    live = (pend_left > 0) & (target != pos)
    lim_fill = live & jnp.where(target > pos, l1 < pend_price - through,
                                h1 > pend_price + through)
    filled = mkt_fill | lim_fill
    ref_price = jnp.where(mkt_fill, o1, pend_price)
    # A fill lands on the target exactly: pos + (target − pos) rounds off it in float32 for
    # about one position in six, and the ulp left over read as a live order and traded again.
    pos1 = jnp.where(filled, target, pos)
    dq = pos1 - pos
    pend_left = jnp.where(filled, 0, jnp.maximum(pend_left - 1, 0))
    # No live order left (filled, market, expired): the target is the position held, so an
    # expired limit is no longer reported as one.
    target = jnp.where(pend_left > 0, target, pos1)
    adq = jnp.abs(dq)

    # Dollar PnL over bar t+1 and its costs.
    gross = mult * (pos * (c1 - c0) + dq * (c1 - ref_price))
    commission = adq * jnp.where(mkt_fill, cfg.commission, cfg.maker_fee)
    spread_cost = jnp.where(mkt_fill, adq * (half + slip) * mult, 0.0)
    holding = cfg.holding_cost * jnp.abs(pos1)
    net = gross - commission - spread_cost - holding
    fill_price = jnp.where(mkt_fill, o1 + jnp.sign(dq) * (half + slip), ref_price)

    # Trade bookkeeping: a trade runs from entry until the position is flat or flips sign.
    s0, s1 = jnp.sign(pos), jnp.sign(pos1)
    closed = (s0 != 0) & (s1 != s0)
    flip = closed & (s1 != 0)
    opened = (s1 != 0) & (s1 != s0)
    # On a flip the bar's PnL is split exactly: the closing leg (−pos contracts) keeps its mark
    # and its share of the costs; the opening leg starts the new trade.
    per_contract = (commission + spread_cost) / jnp.maximum(adq, 1e-12)
    old_leg = mult * pos * (ref_price - c0) - per_contract * jnp.abs(pos)
    running = state.trade_pnl + net
    closed_pnl = jnp.where(flip, state.trade_pnl + old_leg, jnp.where(closed, running, 0.0))
    trade_pnl = jnp.where(flip, net - old_leg, jnp.where(s1 != 0, running, 0.0))
    win = closed & (closed_pnl > 0)
    age = state.time_in_pos
    time_in_pos = jnp.where(opened, 0, jnp.where(s1 != 0, age + 1, 0))

    # Reward shaping (not part of backtest returns): graduated churn penalty for flips of young
    # positions, opportunity cost of staying flat while the policy was sure (training only).
    churn = jnp.where(flip, cfg.churn_penalty
                      * jnp.maximum(0.0, 1.0 - age.astype(jnp.float32) / cfg.churn_window), 0.0)
    opp = jnp.where(params.training & (pos1 == 0), cfg.opportunity_cost * jnp.abs(q_gap), 0.0)
    reward = net / cfg.initial_equity - churn - opp

    new_state = EnvState(
        t=t1, last=state.last, position=pos1, target=target,
        intended=jnp.where(new_order, intended_new, state.intended),
        pend_price=pend_price, pend_left=pend_left, trade_pnl=trade_pnl, time_in_pos=time_in_pos,
        last_dir=jnp.where(new_order, sign.astype(jnp.int32), state.last_dir),
        n_trades=state.n_trades + closed.astype(jnp.int32),
        n_wins=state.n_wins + win.astype(jnp.int32),
        sum_win=state.sum_win + jnp.where(win, closed_pnl, 0.0),
        sum_loss=state.sum_loss + jnp.where(closed & ~win, -closed_pnl, 0.0),
    )
    info = {
        "bar": t1, "position": pos1, "target_position": target,
        "intended_position": new_state.intended, "fill_qty": dq, "fill_price": fill_price,
        "filled": filled, "market_fill": mkt_fill, "gross_pnl": gross, "commission": commission,
        "spread_cost": spread_cost, "holding_cost": holding, "net_pnl": net, "churn_penalty": churn,
        "opportunity_cost": opp, "trade_closed": closed, "closed_trade_pnl": closed_pnl,
        "size_scale": scale, **{f"size_{k}": factors[k] for k in FACTOR_NAMES},
    }
    return new_state, reward, is_last, info
