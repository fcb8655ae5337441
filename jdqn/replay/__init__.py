"""Device-resident prioritised replay and n-step returns (``jdqn.replay`` contract in
docs/ARCHITECTURE.md; design notes in docs/replay_and_checkpoints.md)."""

from jdqn.replay.nstep import NStep, NStepCarry, carry_init, nstep_returns, window
from jdqn.replay.per import (
    PrioritisedReplay,
    ReplayState,
    Sample,
    add,
    bytes_per_transition,
    init,
    sample,
    sampling_probabilities,
    update,
)

__all__ = [
    "NStep",
    "NStepCarry",
    "PrioritisedReplay",
    "ReplayState",
    "Sample",
    "add",
    "bytes_per_transition",
    "carry_init",
    "init",
    "nstep_returns",
    "sample",
    "sampling_probabilities",
    "update",
    "window",
]
