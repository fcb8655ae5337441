"""The observation layout — the one place that defines what each column of a state means.

An observation is a float32 vector of width ``W = features.state_width`` (128 by default, a
multiple of the matmul tile; ``"auto"``: the ``F + 7`` columns below rounded up to a multiple
of :data:`STATE_ALIGN`, :func:`resolve_state_width`):

=====================  ==========================================================
columns                meaning
=====================  ==========================================================
``[0, F)``             normalised features, in ``FeatureSet.names`` order
``F + 0``              ``position``: signed position / max_position, in [−1, 1]
``F + 1``              ``unrealised_pnl``: open-trade PnL (env-normalised)
``F + 2``              ``time_in_position``: bars held (env-scaled)
``F + 3``              ``last_direction``: last direction action (env-encoded)
``F + 4``              ``order_size``: the live limit order's remaining quantity
``F + 5``              ``order_bars_left``: bars it may still fill in (env-scaled)
``F + 6``              ``order_distance``: its price against the bar's close (env-scaled)
``[F + 7, W)``         zeros (padding)
=====================  ==========================================================

The env fills the portfolio slots (their scaling is the env's contract); the data side fixes
their positions. ``F + 7 > W`` is a configuration error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from jdqn.config import ConfigError

# The portfolio part of the observation (values: jdqn.env.core.portfolio). The last three
# describe the live limit order, which "hold" keeps working: without them two states that look
# alike (flat, with or without a working order) would act differently.
PORTFOLIO_SLOTS = ("position", "unrealised_pnl", "time_in_position", "last_direction",
                   "order_size", "order_bars_left", "order_distance")


# "auto" rounds the observation width up to a multiple of this: 8 columns keep a bf16 row a
# multiple of 16 bytes and a float32 one of 32, as the tensor-core GEMMs want their operands
STATE_ALIGN = 8


def resolve_state_width(n_features: int, setting: int | str) -> int:
    """The observation width for ``n_features`` features under ``features.state_width``: the
    setting itself, or for ``"auto"`` the features plus the portfolio slots rounded up to a
    multiple of :data:`STATE_ALIGN`, so at most 7 of the columns the network reads are padding.

    Why "auto" exists: the predecessor's fixed 128 columns leave most of them zero padding with
    the default features (24 + 7 = 31 used), and every layer that reads the observation (the
    variable selection, the input layer, the MoE gate) multiplied those zeros. The GPU configs
    take it: on the H100 at B = 16384 the update 1.685 → 1.655 ms bf16 and 2.775 → 2.689 ms
    float32 (32 columns against 128; ``bench/results/train_h100_*_state_width_*_ab.json``)."""
    if setting == "auto":
        need = n_features + len(PORTFOLIO_SLOTS)
        return -(-need // STATE_ALIGN) * STATE_ALIGN
    if isinstance(setting, bool) or not isinstance(setting, int):
        raise ConfigError(f"features.state_width = {setting!r}: expected an integer or 'auto'")
    return setting


@dataclass(frozen=True)
class StateLayout:
    n_features: int  # F
    width: int = 128  # W

    def __post_init__(self) -> None:
        need = self.n_features + len(PORTFOLIO_SLOTS)
        if self.n_features < 0 or need > self.width:
            raise ConfigError(
                f"features.state_width = {self.width} is too small: {self.n_features} features "
                f"+ {len(PORTFOLIO_SLOTS)} portfolio slots need {need}; raise state_width or "
                "use fewer features")

    @property
    def portfolio_offset(self) -> int:
        return self.n_features

    @property
    def n_portfolio(self) -> int:
        return len(PORTFOLIO_SLOTS)

    @property
    def n_padding(self) -> int:
        return self.width - self.n_features - self.n_portfolio

    def slot(self, name: str) -> int:
        """Column of a portfolio slot, e.g. ``layout.slot('position')``."""
        return self.n_features + PORTFOLIO_SLOTS.index(name)

    def column_names(self, feature_names: tuple[str, ...]) -> tuple[str, ...]:
        """Name of every column: features, portfolio slots, 'pad_i'."""
        if len(feature_names) != self.n_features:
            raise ValueError(f"{len(feature_names)} feature names for a layout of "
                             f"{self.n_features} features")
        return (tuple(feature_names) + PORTFOLIO_SLOTS
                + tuple(f"pad_{i}" for i in range(self.n_padding)))

    def assemble(self, features: Any, portfolio: Any, xp: Any = np) -> Any:
        """[..., F] features + [..., 4] portfolio → [..., W] (``xp`` = numpy or jax.numpy)."""
        pad = xp.zeros(features.shape[:-1] + (self.n_padding,), dtype=features.dtype)
        return xp.concatenate([features, portfolio.astype(features.dtype), pad], axis=-1)
