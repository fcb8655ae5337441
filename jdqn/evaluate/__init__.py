"""Backtest engine, metrics (empyrical conventions), baselines and the report folder."""

from jdqn.evaluate.backtest import BacktestResult, PolicyContext, rollout, strided_arrays
from jdqn.evaluate.baselines import BASELINES, run_baselines
from jdqn.evaluate.metrics import (
    PeriodsPerYear,
    action_distribution,
    compute_metrics,
    periods_per_year,
    return_metrics,
)
from jdqn.evaluate.report import write_report, write_seed_summary

__all__ = [
    "BASELINES", "BacktestResult", "PeriodsPerYear", "PolicyContext", "action_distribution",
    "compute_metrics",
    "periods_per_year", "return_metrics", "rollout", "run_baselines", "strided_arrays",
    "write_report",
    "write_seed_summary",
]
