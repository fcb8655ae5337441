"""Vectorised market environment: pure ``reset``/``step``/``observe`` over N episodes.

See ``docs/env.md`` for the execution (fill) model, costs, sizing chain and reward.
"""

from jdqn.env.core import (
    ACTION_LABELS,
    BRANCH_NAMES,
    BRANCH_SIZES,
    FLAT,
    HOLD,
    LIMIT_PASSIVE,
    LIMIT_TOUCH,
    LONG,
    MAGNITUDES,
    MARKET,
    N_PORTFOLIO,
    PORTFOLIO_SLOTS,
    SHORT,
    EnvInputError,
    EnvParams,
    EnvState,
    PolicyAux,
    auto_reset,
    check_inputs,
    check_tick_grid,
    make_params,
    obs_from_index,
    observe,
    portfolio,
    reset,
    reset_at,
    step,
    validate_actions,
    with_window,
)
from jdqn.env.normalise import NormState, init_norm_state, normalise_reward
from jdqn.env.sizing import FACTOR_NAMES, cvar_series, sizing_factors

__all__ = [
    "ACTION_LABELS", "BRANCH_NAMES", "BRANCH_SIZES", "FACTOR_NAMES", "FLAT", "HOLD",
    "LIMIT_PASSIVE", "LIMIT_TOUCH", "LONG", "MAGNITUDES", "MARKET", "N_PORTFOLIO",
    "PORTFOLIO_SLOTS", "SHORT", "EnvInputError", "EnvParams", "EnvState", "NormState",
    "PolicyAux", "auto_reset", "check_inputs", "check_tick_grid", "cvar_series", "init_norm_state", "make_params",
    "normalise_reward", "obs_from_index", "observe", "portfolio", "reset", "reset_at",
    "sizing_factors", "step", "validate_actions", "with_window",
]
