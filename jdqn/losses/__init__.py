"""Losses: per-sample pure functions (rlax style, vmapped by the caller) and ``total_loss``.

See ``docs/model.md`` for the formulas, the double-Q conventions and the priority definition.
"""

from jdqn.losses.categorical import (
    branching_td_loss,
    categorical_double_q_loss,
    categorical_l2_project,
    categorical_target,
    cross_entropy,
    warmup_blend_loss,
)
from jdqn.losses.moe import (
    MoEState,
    entropy,
    entropy_target,
    gate_utilisation,
    init_moe_state,
    lambda_eff,
    load_balance_loss,
    update_moe_state,
)
from jdqn.losses.quantile import (
    branching_iqn_loss,
    huber,
    iqn_double_q_loss,
    quantile_huber_loss,
)
from jdqn.losses.total import Batch, total_loss, warmup_alpha

__all__ = [
    "Batch", "MoEState",
    "branching_iqn_loss", "branching_td_loss", "categorical_double_q_loss",
    "categorical_l2_project", "categorical_target", "cross_entropy", "entropy", "entropy_target",
    "gate_utilisation", "huber", "init_moe_state", "iqn_double_q_loss", "lambda_eff",
    "load_balance_loss", "quantile_huber_loss", "total_loss", "update_moe_state",
    "warmup_alpha", "warmup_blend_loss",
]
