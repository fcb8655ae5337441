"""The fold-boundary reset policy: one declarative rule for **every** leaf of :class:`TrainState`.

``tests/test_training.py::test_every_state_leaf_has_a_fold_reset_rule`` fails when a leaf is
added to the state without a rule here. Why each rule:

=================  ======================  ===================================================
leaf               rule                    why
=================  ======================  ===================================================
params             ShrinkPerturb           keep what was learnt, regain plasticity (Ash & Adams);
                                           applied to the fold's best-by-validation params,
                                           which the job makes the params first
target_params      CopyFrom(params)        hard sync to the *new* online params (main and IQN:
                                           the IQN head lives in the same tree)
best_params        CopyFrom(params)        the new fold's best starts at its starting point
opt_state          moments/counts Zero,    fresh Adam statistics and LR warm-up for the new
                   hyperparams Keep        data; keeping the base LR (a blanket zero would set
                                           the learning rate to 0)
replay             Keep                    old transitions index bars inside the new (expanding)
                                           train window; they stay valid
nstep              Reinit                  an n-step window must not span two folds
env                Reinit                  episodes restart inside the new train window
norm               Keep                    reward statistics carried — zeroing them exploded the
                                           predecessor's losses (near-zero IQR at fold start)
moe                Keep                    gate-entropy EMA describes the network, which is kept
monitor            Reinit                  NaN flags start clean in each fold
key                Keep                    the PRNG stream continues (never re-seeded)
update_step        Zero                    schedules (LR warm-up, PER β, blend α) restart per fold
collect_step       Keep                    exploration ε decays over the whole run
q_abs_ema          Keep                    diagnostic continuity
=================  ======================  ===================================================
"""

from __future__ import annotations

from jdqn.config import TrainConfig
from jdqn.train.optim import opt_state_reset_rules
from jdqn.train.reset import CopyFrom, Keep, Reinit, ShrinkPerturb, Zero


def fold_reset_policy(cfg: TrainConfig) -> dict:
    return {
        "params": ShrinkPerturb(cfg.shrink, cfg.perturb),
        "target_params": CopyFrom("params"),
        "best_params": CopyFrom("params"),
        "opt_state": opt_state_reset_rules(),
        "replay": Keep(),
        "nstep": Reinit(),
        "env": Reinit(),
        "norm": Keep(),
        "moe": Keep(),
        "monitor": Reinit(),
        "key": Keep(),
        "update_step": Zero(),
        "collect_step": Keep(),
        "q_abs_ema": Keep(),
    }
