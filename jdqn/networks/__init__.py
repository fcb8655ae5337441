"""Flax (Linen) networks: GRN + MoE trunk, dueling branching C51 heads, IQN head.

See ``docs/model.md`` for the architecture, the gradient policy of the conditioning and the
parameter count of the default model.
"""

from jdqn.networks.heads import (
    BRANCH_NAMES,
    DIRECTION,
    MAGNITUDE,
    ORDER_TYPE,
    URGENCY,
    DuelingBranchingHead,
    IQNHead,
    cosine_embedding,
    dueling_logits,
    expected_q,
    make_support,
    q_gap,
    q_variance,
)
from jdqn.networks.model import (
    BranchingQNetwork,
    NetOutput,
    count_params,
    decay_mask,
    flops_per_sample,
    greedy_action,
    init_params,
    init_params_batched,
    policy_aux,
    quantiles,
    train_flops_per_sample,
)
from jdqn.networks.trunk import (
    GRNBlock,
    MixtureOfExperts,
    Trunk,
    VariableSelection,
    expert_outputs,
    moe_mixture_reference,
)

__all__ = [
    "BRANCH_NAMES", "DIRECTION", "MAGNITUDE", "ORDER_TYPE", "URGENCY",
    "BranchingQNetwork", "DuelingBranchingHead", "GRNBlock", "IQNHead", "MixtureOfExperts",
    "NetOutput", "Trunk", "VariableSelection",
    "cosine_embedding", "count_params", "decay_mask", "dueling_logits", "expected_q", "expert_outputs",
    "flops_per_sample", "greedy_action", "init_params", "init_params_batched", "make_support", "moe_mixture_reference",
    "policy_aux", "q_gap", "q_variance", "quantiles", "train_flops_per_sample",
]
