"""Data: inputs → canonical bars → causal features → normalised observations.

Public API (the ``jdqn.data`` contract in ``docs/ARCHITECTURE.md``; details in ``docs/data.md``):

* :class:`Bars`, :func:`load_bars` — ticks/trades, OHLCV, Databento DBN, synthetic;
* :class:`FeatureSet`, :func:`build_features`;
* :class:`Normaliser`, :func:`fit_normaliser`;
* :class:`StateLayout`, :func:`resolve_state_width` — the observation layout;
* :func:`load_or_build` — the on-disk feature cache.
"""

from jdqn.data.bars import Bars, parse_bar_size, ticks_to_bars
from jdqn.data.cache import SCHEMA_VERSION, load_or_build
from jdqn.data.features import FeatureSet, build_features, warmup_rows
from jdqn.data.layout import PORTFOLIO_SLOTS, StateLayout, resolve_state_width
from jdqn.data.load import load_bars, resolve_path
from jdqn.data.normalise import Normaliser, fit_normaliser
from jdqn.data.synthetic import generate as generate_synthetic

__all__ = [
    "PORTFOLIO_SLOTS",
    "SCHEMA_VERSION",
    "Bars",
    "FeatureSet",
    "Normaliser",
    "StateLayout",
    "build_features",
    "fit_normaliser",
    "generate_synthetic",
    "load_bars",
    "load_or_build",
    "parse_bar_size",
    "resolve_path",
    "resolve_state_width",
    "ticks_to_bars",
    "warmup_rows",
]
