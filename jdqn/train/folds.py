"""Walk-forward fold layout.

The usable bars ``[warmup, T)`` are split into a pre-test span and a final untouched **test**
window (the last ``test_frac`` of the span, after a purge gap). The last ``1 − train_frac`` of the
pre-test span is cut into ``n_folds`` consecutive **validation** blocks; fold ``i`` trains on an
*expanding* window from the first usable bar up to its validation block minus the purge gap:

    |warm-up| train₀ ............|purge|val₀|
    |warm-up| train₁ .................... |purge|val₁|
    |warm-up| train₂ ............................. |purge|val₂| |purge| test |

Every window is half-open ``[lo, hi)`` in bar indices. An episode never reads a bar outside its
window, so train, validation and test never share a bar. The purge gap is a margin between
windows, not a look-back cut: features are causal, and a validation row's feature look-back
(up to ~165 bars at the defaults, longer for the EMA-type features) may reach back into the
train span, which is past data at that row — no leak. Nothing of the evaluated windows reaches
training or the normaliser (tests/test_folds.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from jdqn.config import ConfigError, TrainConfig


@dataclass(frozen=True)
class Fold:
    index: int
    train: tuple[int, int]  # [lo, hi)
    val: tuple[int, int]


@dataclass(frozen=True)
class FoldPlan:
    folds: tuple[Fold, ...]
    test: tuple[int, int]


MIN_WINDOW = 16  # bars; shorter windows cannot hold an episode plus a fill bar


def plan_folds(n_bars: int, warmup: int, cfg: TrainConfig) -> FoldPlan:
    """Split bars ``[warmup, n_bars)`` into walk-forward folds and a test window."""
    usable = n_bars - warmup
    purge = cfg.purge_bars
    n_test = int(usable * cfg.test_frac)
    test = (n_bars - n_test, n_bars)
    pre_hi = test[0] - purge
    pre = pre_hi - warmup
    n_val_total = int(pre * (1.0 - cfg.train_frac))
    val_len = n_val_total // cfg.n_folds
    if n_test < MIN_WINDOW or val_len < MIN_WINDOW:
        raise ConfigError(
            f"{n_bars} bars (warm-up {warmup}) are too few for train.n_folds = {cfg.n_folds}, "
            f"train.test_frac = {cfg.test_frac}, train.purge_bars = {purge}: the test window has "
            f"{n_test} bars and each validation window {val_len} (need ≥ {MIN_WINDOW}); use more "
            "data or fewer folds")
    folds = []
    for i in range(cfg.n_folds):
        v_lo = pre_hi - (cfg.n_folds - i) * val_len
        v_hi = v_lo + val_len
        t_hi = v_lo - purge
        if t_hi - warmup < MIN_WINDOW:
            raise ConfigError(f"fold {i}: its train window has {t_hi - warmup} bars; reduce "
                                  "train.n_folds or train.purge_bars, or use more data")
        folds.append(Fold(i, (warmup, t_hi), (v_lo, v_hi)))
    return FoldPlan(tuple(folds), test)


def _evaluated_windows(plan: FoldPlan) -> list[tuple[str, tuple[int, int]]]:
    """Every window a backtest evaluates, named for messages: the folds' validation windows
    and the test window."""
    return [(f"fold {f.index}'s validation window", f.val) for f in plan.folds] + [
        ("the test window", plan.test)]


def check_eval_stride(plan: FoldPlan, stride: int) -> None:
    """Refuse an ``eval.stride`` that leaves a validation or the test window fewer evaluation
    periods than a stride-1 backtest of the shortest allowed window has (``MIN_WINDOW − 1``
    returns), before anything trains: the backtest would otherwise fail at the first
    validation, or score a fold on a handful of returns."""
    windows = _evaluated_windows(plan)
    need = MIN_WINDOW - 1
    for name, (lo, hi) in windows:
        periods = (hi - 1 - lo) // stride
        if periods < need:
            largest = min((b - 1 - a) // need for _, (a, b) in windows)
            raise ConfigError(
                f"eval.stride = {stride} leaves {name} [{lo}, {hi}) {periods} evaluation "
                f"periods (need ≥ {need}); these windows allow eval.stride ≤ {largest}")


def check_eval_windows(plan: FoldPlan, n_windows: int, stride: int) -> None:
    """Refuse an ``eval.n_windows`` that cuts a validation or the test window into parallel
    backtest windows shorter than :data:`jdqn.evaluate.backtest.MIN_WINDOW_STEPS` steps, before
    anything trains: each window ends in a forced liquidation, so such a backtest scores
    liquidations, not the policy (at one window per step every Sharpe was undefined and early
    stopping chose among NaNs)."""
    from jdqn.evaluate.backtest import MIN_WINDOW_STEPS

    if n_windows <= 1:
        return
    windows = _evaluated_windows(plan)
    for name, (lo, hi) in windows:
        periods = (hi - 1 - lo) // stride
        steps = -(-periods // min(n_windows, max(periods, 1)))
        if steps < MIN_WINDOW_STEPS:
            # n windows of ⌈m / n⌉ steps: ≥ MIN steps while n ≤ (m − 1) // (MIN − 1)
            largest = max(1, min(((b - 1 - a) // stride - 1) // (MIN_WINDOW_STEPS - 1)
                                 for _, (a, b) in windows))
            raise ConfigError(
                f"eval.n_windows = {n_windows} cuts {name} [{lo}, {hi}) ({periods} decisions) "
                f"into windows of {steps} steps, each ending in a forced liquidation (need ≥ "
                f"{MIN_WINDOW_STEPS} steps); these windows allow eval.n_windows ≤ {largest}")


def check_momentum_lookback(plan: FoldPlan, lookback: int, stride: int) -> None:
    """Refuse an ``eval.momentum_lookback`` that reaches before the first bar from the test
    window's first decision (the baselines run on the test window): the baseline's past close
    would be clamped to bar 0, so it compared against the series' start — buy-and-hold in an up
    market — without a word."""
    first = plan.test[0]
    if lookback * stride > first:
        raise ConfigError(
            f"eval.momentum_lookback = {lookback} (× eval.stride = {stride} bars) reaches "
            f"before the first bar from the test window's first decision (bar {first}); "
            f"use ≤ {first // stride}, or more data")
