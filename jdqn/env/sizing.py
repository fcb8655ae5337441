"""Position sizing: a chain of named factors, each with a permanent floor.

The predecessor multiplied ``var_scale × Kelly × conviction`` without floors and the product
collapsed "full" positions to zero, silencing the policy. Here every factor is clamped to its own
floor, and the product is floored once more by ``min_share``, so the realised target is always at
least ``min_share × intended`` (a test checks it with every factor at its floor).

Factors (all ``f32 [N]`` in ``[floor, 1]``; a switched-off factor is exactly 1):

* ``conviction = clip(|q_gap| / conviction_scale, conviction_floor, 1)``
* ``variance   = max(1 / (1 + sqrt(q_var)), conviction)`` — floored by conviction, so a confident
  policy is not silenced by a wide return distribution (``conviction_floor`` when conviction
  is off);
* ``kelly      = clip(p − (1 − p) / b, kelly_floor, 1)`` once the env has closed
  ``kelly_min_trades`` trades (p = win rate, b = mean win / mean loss of closed trades), else 1;
* ``cvar       = clip(cvar_limit / CVaR_t, cvar_floor, 1)`` where ``CVaR_t`` is the expected
  shortfall of the past ``cvar_window`` one-bar returns of a full-size position (a causal
  per-bar series precomputed in :func:`jdqn.env.core.make_params`), 1 when ``CVaR_t ≤ 0``.

``scale = max(conviction · variance · kelly · cvar, min_share)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jdqn.config import SizingConfig

FACTOR_NAMES = ("conviction", "variance", "kelly", "cvar")


def sizing_factors(cfg: SizingConfig, q_gap: jax.Array, q_var: jax.Array, n_trades: jax.Array,
                   n_wins: jax.Array, sum_win: jax.Array, sum_loss: jax.Array,
                   risk: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Return ``(scale f32 [N], {factor name: f32 [N]})`` for the sizing chain."""
    ones = jnp.ones_like(q_gap)
    if cfg.conviction:
        conviction = jnp.clip(jnp.abs(q_gap) / cfg.conviction_scale, cfg.conviction_floor, 1.0)
    else:
        conviction = ones
    if cfg.variance:
        raw = 1.0 / (1.0 + jnp.sqrt(jnp.maximum(q_var, 0.0)))
        floor = conviction if cfg.conviction else cfg.conviction_floor
        variance = jnp.clip(jnp.maximum(raw, floor), 0.0, 1.0)
    else:
        variance = ones
    if cfg.kelly:
        n = n_trades.astype(jnp.float32)
        wins = n_wins.astype(jnp.float32)
        p = wins / jnp.maximum(n, 1.0)
        mean_win = sum_win / jnp.maximum(wins, 1.0)
        mean_loss = sum_loss / jnp.maximum(n - wins, 1.0)
        # No losing trade yet (or no loss size): the Kelly fraction is unbounded → cap 1.
        f = jnp.where(mean_loss > 0, p - (1.0 - p) * mean_loss / jnp.maximum(mean_win, 1e-12),
                      1.0)
        f = jnp.where(mean_win > 0, f, 0.0)  # never a win: the cap sits at its floor
        kelly = jnp.where(n_trades >= cfg.kelly_min_trades,
                          jnp.clip(f, cfg.kelly_floor, 1.0), 1.0)
    else:
        kelly = ones
    if cfg.cvar:
        cvar = jnp.where(risk > 0, jnp.clip(cfg.cvar_limit / jnp.maximum(risk, 1e-12),
                                            cfg.cvar_floor, 1.0), 1.0)
    else:
        cvar = ones
    scale = jnp.maximum(conviction * variance * kelly * cvar, cfg.min_share)
    return scale, {"conviction": conviction, "variance": variance, "kelly": kelly, "cvar": cvar}


def cvar_series(close: np.ndarray, cfg: SizingConfig, max_position: float,
                contract_multiplier: float, initial_equity: float) -> np.ndarray:
    """Causal expected shortfall per bar of holding ``max_position`` for one bar.

    ``out[t] = −mean(worst ⌈α·w⌉ of r[t−w+1 .. t])`` clipped at 0, with
    ``r[j] = max_position · multiplier · (close[j] − close[j−1]) / initial_equity`` and ``r[0] = 0``;
    bars before the start of the series count as zero returns. Uses only bars ≤ t (it is a
    feature-like statistic known at the close of bar t). Returns float64 ``[T]``.
    """
    close = np.asarray(close, dtype=np.float64)
    t_len = close.shape[0]
    r = np.zeros(t_len)
    r[1:] = max_position * contract_multiplier * np.diff(close) / initial_equity
    w = int(cfg.cvar_window)
    k = max(1, int(np.ceil(cfg.cvar_alpha * w)))
    padded = np.concatenate([np.zeros(w - 1), r])
    windows = np.lib.stride_tricks.sliding_window_view(padded, w)  # [T, w], a view
    out = np.empty(t_len)
    chunk = 1 << 16
    for s in range(0, t_len, chunk):  # host-side, bounded memory; not a loop over bars
        block = np.partition(windows[s:s + chunk], k - 1, axis=1)[:, :k]
        out[s:s + chunk] = -block.mean(axis=1)
    return np.maximum(out, 0.0)
