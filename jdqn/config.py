"""Typed configuration: TOML → frozen dataclasses.

Every section is a frozen dataclass with defaults and a one-line comment per field. The loader
(`load_config`, `config_from_dict`) walks the dataclass tree, so there are no string keys
scattered through the code:

* an unknown key is an error naming the nearest valid key (``difflib``);
* a wrong type names the field, the expected type and the value;
* a value outside its range or not among its choices names the field and the allowed values.

Ranges and choices are declared next to the field with :func:`fld`. ``--set a.b=value`` on the
CLI goes through :func:`apply_overrides`, which parses the value as a TOML literal (falling back to
a bare string) and then through the same validation.

Each module owns its section: data/features (``jdqn.data``), env/eval (``jdqn.env``,
``jdqn.evaluate``), model (``jdqn.networks``/``jdqn.losses``), train/checkpoint/parallel/logging
(``jdqn.train``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from jdqn.errors import JdqnError


class ConfigError(JdqnError, ValueError):
    """A configuration problem; the message names the key and what is allowed."""


# len(jdqn.data.layout.PORTFOLIO_SLOTS), which imports this module (a test checks they agree).
N_PORTFOLIO_SLOTS = 7


def fld(default: Any = dataclasses.MISSING, *, ge: float | None = None, le: float | None = None,
        gt: float | None = None, lt: float | None = None, default_factory: Any = dataclasses.MISSING,
        doc: str = "") -> Any:
    """A dataclass field with an inclusive/exclusive numeric range checked by the loader."""
    meta = {"ge": ge, "le": le, "gt": gt, "lt": lt, "doc": doc}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def _tuple(*xs: Any) -> Any:
    return field(default_factory=lambda: tuple(xs))


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ColumnMap:
    """Names of the input columns (ticks or OHLCV). Empty string = column absent."""

    timestamp: str = "timestamp"  # timestamp column (ticks and OHLCV)
    price: str = "price"  # trade price (ticks)
    size: str = "size"  # trade size (ticks)
    side: str = ""  # aggressor side (ticks, optional; 'B'/'A', 'buy'/'sell' or +1/-1)
    open: str = "open"  # OHLCV
    high: str = "high"
    low: str = "low"
    close: str = "close"
    volume: str = "volume"
    buy_volume: str = ""  # OHLCV, optional aggressor-buy volume
    sell_volume: str = ""  # OHLCV, optional aggressor-sell volume


@dataclass(frozen=True)
class SyntheticConfig:
    """The seeded synthetic market (regimes, volatility clustering, informative order flow)."""

    n_bars: int = fld(20_000, ge=200, le=10**9)  # bars to generate
    seed: int = fld(0, ge=0, lt=2**64)  # generator seed (independent of the training seed)
    bar_seconds: int = fld(60, ge=1)  # nominal bar length
    start_price: float = fld(4000.0, gt=0)
    tick_size: float = fld(0.25, gt=0)
    base_vol: float = fld(4e-4, gt=0)  # per-bar log-return volatility in the calm regime
    signal_strength: float = fld(0.15, ge=0, le=1)  # predictive power of order flow for r[t+1]
    flow_persistence: float = fld(0.9, ge=0, lt=1)  # AR(1) coefficient of the latent order flow
    regime_persistence: float = fld(0.995, ge=0, lt=1)  # P(stay in regime) per bar
    garch_alpha: float = fld(0.08, ge=0, lt=1)  # volatility clustering
    garch_beta: float = fld(0.9, ge=0, lt=1)
    shuffle_returns: bool = False  # control: destroy all temporal structure (no signal)


@dataclass(frozen=True)
class DataConfig:
    source: Literal["synthetic", "ticks", "ohlcv", "dbn"] = "synthetic"  # input kind
    path: str = ""  # input file; 'builtin:es_ticks' = the ES sample shipped with the package
    format: Literal["auto", "csv", "parquet"] = "auto"  # tables only; DBN is always DBN
    columns: ColumnMap = field(default_factory=ColumnMap)
    timestamp_format: str = ""  # '' = ISO-8601; 'unix_s'|'unix_ms'|'unix_us'|'unix_ns'; or strftime
    timezone: str = "UTC"  # zone of naive timestamps in the input
    skip_rows: int = fld(0, ge=0)  # rows to skip before the header (CSV)
    bar_type: Literal["time", "volume", "dollar"] = "time"  # bars built from ticks/DBN
    bar_size: str = "1min"  # time bars: 1s … 1d (e.g. '30s', '5min', '1h', '1d')
    bar_threshold: float = fld(0.0, ge=0)  # volume (contracts) or dollar amount per bar
    price_scale: float = fld(1.0, gt=0)  # multiply input prices by this (e.g. cents → dollars)
    timestamp_label: Literal["close", "open"] = "close"  # OHLCV rows: stamp marks bar close/open
    instrument_id: int = fld(0, ge=0, lt=2**32)  # DBN: instrument to keep (0 = the only one)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    cache_dir: str = ".jdqn_cache"  # feature cache folder ('' disables the cache)
    # A bar whose open/high/low/close moves beyond a factor 1 + max_jump up or down from the
    # previous close (0.25: +25 % / −20 %) is refused as a likely bad print (0 accepts any move;
    # synthetic data is not checked).
    max_jump: float = fld(0.25, ge=0)


# --------------------------------------------------------------------------------------------
# features
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FeaturesConfig:
    return_lags: tuple[int, ...] = _tuple(1, 2, 5, 10, 20)  # log returns over these many bars
    vol_windows: tuple[int, ...] = _tuple(10, 30)  # realised-volatility windows (bars)
    volume_z_window: int = fld(30, ge=2)  # volume z-score window
    adx_period: int = fld(14, ge=2)  # Wilder ADX period
    cusum_threshold: float = fld(2.0, gt=0)  # CUSUM threshold in units of realised vol
    mtf_factors: tuple[int, ...] = _tuple(5, 15)  # multi-timeframe aggregates (× bar size)
    ofi_window: int = fld(10, ge=1)  # rolling sum window for OFI / signed-volume features
    ofi_levels: int = fld(10, ge=1, le=10)  # MBP-10 book levels used for multi-level OFI
    time_of_day: bool = True  # sin/cos time-of-day encoding
    normalisation: Literal["zscore", "robust"] = "robust"  # fitted on each fold's train window
    clip: float = fld(5.0, gt=0)  # clip normalised features to ±clip
    # observation width (features + portfolio + zero padding); "auto": the features and the
    # portfolio slots rounded up to a multiple of 8 (jdqn.data.layout.resolve_state_width)
    state_width: int | Literal["auto"] = fld(128, ge=8)


# --------------------------------------------------------------------------------------------
# env
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SizingConfig:
    """Position-sizing chain; each factor has a permanent floor and can be switched off."""

    conviction: bool = True  # scale by Q-gap conviction, clamped to [conviction_floor, 1]
    conviction_floor: float = fld(0.25, gt=0, le=1)
    conviction_scale: float = fld(1.0, gt=0)  # |Q-gap| at which conviction reaches 1
    variance: bool = True  # 1/(1+sqrt(Var[Q])), floored by conviction
    kelly: bool = True  # Kelly cap from realised win rate/payoff after kelly_min_trades
    kelly_min_trades: int = fld(20, ge=1)
    kelly_floor: float = fld(0.25, gt=0, le=1)
    cvar: bool = True  # CVaR scale from recent realised returns
    cvar_alpha: float = fld(0.05, gt=0, lt=1)
    cvar_floor: float = fld(0.25, gt=0, le=1)
    cvar_window: int = fld(100, ge=2)  # bars of past full-size returns in the CVaR estimate
    cvar_limit: float = fld(1e-3, gt=0)  # tolerated per-bar CVaR at full size (share of equity)
    min_share: float = fld(0.1, gt=0, le=1)  # realised ≥ min_share × intended, whatever the factors


@dataclass(frozen=True)
class EnvConfig:
    n_envs: int = fld(256, ge=1)  # parallel episodes during training
    episode_length: int = fld(512, ge=2)  # bars per training episode
    max_position: float = fld(1.0, gt=0)  # contracts at 'full' magnitude
    # Position granularity in contracts: a sized target is cut toward zero to a multiple of it
    # (1.0 = whole contracts, never more than the sizing chain allows); 0 = continuous sizes.
    lot_size: float = fld(0.0, ge=0)
    contract_multiplier: float = fld(50.0, gt=0)  # $ per point (ES = 50)
    initial_equity: float = fld(250_000.0, gt=0)  # $; returns are relative to equity
    tick_size: float = fld(0.25, gt=0)
    # Refuse bars whose prices are off the tick_size grid (a mis-set tick rescales every cost
    # and limit price); false for series that are legitimately off it (ratio back-adjusted
    # continuous contracts)
    check_tick_grid: bool = True
    spread_ticks: float = fld(1.0, ge=0)  # quoted spread; market orders pay half of it
    slippage_ticks: float = fld(0.25, ge=0)  # extra per market-order contract
    commission: float = fld(2.0, ge=0)  # $ per contract, taker
    maker_fee: float = fld(0.5, ge=0)  # $ per contract, limit fills
    holding_cost: float = fld(0.0, ge=0)  # $ per contract per bar
    churn_penalty: float = fld(0.0, ge=0)  # reward units for a flip at 0 bars; graduated to 0
    churn_window: int = fld(10, ge=1)  # flips within this many bars are penalised
    opportunity_cost: float = fld(0.0, ge=0)  # × |Q-gap| while flat (training only)
    limit_expiry: tuple[int, ...] = _tuple(1, 3, 10)  # bars a limit waits, per urgency level
    reward_norm: Literal["robust", "zscore", "none"] = "robust"
    reward_iqr_floor: float = fld(1e-4, gt=0)  # IQR floor for the robust normaliser
    reward_norm_decay: float = fld(0.999, gt=0, lt=1)  # EMA decay of normaliser statistics
    sizing: SizingConfig = field(default_factory=SizingConfig)


# --------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    width: int = fld(256, ge=4)  # trunk width (h_s1)
    n_grn_blocks: int = fld(2, ge=0)  # gated residual blocks
    n_experts: int = fld(8, ge=1)  # MoE experts K
    expert_hidden: int = fld(64, ge=1)  # expert bottleneck (width → hidden → width)
    gate_hidden: int = fld(64, ge=1)  # gate MLP hidden (state → hidden → K)
    branch_sizes: tuple[int, ...] = _tuple(4, 3, 3, 3)  # direction, magnitude, order type, urgency
    head_hidden: int = fld(128, ge=1)  # hidden width of each dueling stream (value, per branch)
    n_atoms: int = fld(51, ge=2)
    v_min: float = -50.0
    v_max: float = 50.0
    iqn: bool = True  # IQN quantile head
    iqn_embed: int = fld(64, ge=1)  # cosine basis functions
    iqn_n: int = fld(8, ge=1)  # online quantile samples N
    iqn_n_prime: int = fld(8, ge=1)  # target quantile samples N'
    # IQN fractions τ: "batch" = one set of N (and N′) per update, shared by every sample (as
    # Dopamine's JAX IQN agent draws them), so the head folds φ(τ) into its first layer's
    # weights and never forms the [B, N, H] modulated features; "sample" = N per sample
    # (Dabney et al. 2018). docs/model.md, "IQN fractions".
    iqn_taus: Literal["batch", "sample"] = "batch"
    # With iqn_taus = "batch": the batch is cut into this many groups of consecutive rows, each
    # with its own N (and N′) fractions, so an update sees G·N fractions at the folded head's
    # cost (one batched [G, B/G, H] × [G, H, N·F] product); 1 = one set for the whole batch.
    # Must divide each device's batch; unused with "sample" (docs/model.md, "IQN fractions").
    iqn_tau_groups: int = fld(8, ge=1)
    # "bfloat16" = mixed precision: bf16 matmul inputs and stored activations, float32
    # accumulation, bias adds, logits, gate and losses (docs/model.md, "Precision").
    matmul_dtype: Literal["float32", "bfloat16"] = "float32"
    # loss: one online forward over [s; s′] (fewer kernels), or false: online at s, then the
    # online and target forwards at s′ (one pass paired over both networks under float32;
    # docs/model.md, "Losses")
    fuse_next_obs: bool = True
    # Kernels (SPEC §8): "pallas" = the fused Pallas kernels (jdqn/pallas; on CPU they run in
    # Pallas' interpreter, for tests), "xla" = the plain-JAX reference, "auto" = pallas on GPU,
    # xla elsewhere.
    impl: Literal["auto", "pallas", "xla"] = "auto"


# --------------------------------------------------------------------------------------------
# train
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    # One program, vmapped over seeds (each a 32-bit PRNG seed).
    seeds: tuple[int, ...] = fld(default_factory=lambda: (0,), ge=0, lt=2**32)
    n_folds: int = fld(3, ge=1)  # walk-forward folds
    # share of the span before the test window that precedes the validation blocks (fold 0's
    # training span; later folds' expand over the earlier blocks): the blocks are its last
    # 1 − train_frac, independent of test_frac (a share of the whole usable span)
    train_frac: float = fld(0.6, gt=0, lt=1)
    purge_bars: int = fld(20, ge=0)  # gap between train and validation windows
    test_frac: float = fld(0.2, gt=0, lt=1)  # final untouched test window share
    epochs_per_fold: int = fld(10, ge=1)
    patience: int = fld(4, ge=1)  # early stopping on validation Sharpe
    collect_steps: int = fld(8, ge=1)  # K env steps per iteration
    updates_per_iter: int = fld(4, ge=1)  # M gradient updates per iteration
    iters_per_epoch: int = fld(50, ge=1)  # scan length of an epoch
    batch_size: int = fld(256, ge=1)
    gamma: float = fld(0.99, ge=0, le=1)
    n_step: int = fld(3, ge=1)
    lr: float = fld(3e-4, gt=0)
    lr_warmup_steps: int = fld(200, ge=0)
    lr_restart_period: int = fld(2000, ge=1)  # cosine warm-restart period (updates)
    lr_min_ratio: float = fld(0.1, ge=0, le=1)
    weight_decay: float = fld(1e-4, ge=0)
    clip_norm: float = fld(10.0, gt=0)
    tau: float = fld(0.005, gt=0, le=1)  # Polyak target update per step
    replay_capacity: int = fld(100_000, ge=1, le=2**30)  # int32 slot arithmetic
    min_replay: int = fld(1000, ge=1)  # transitions before updates start
    per_alpha: float = fld(0.6, ge=0, le=1)
    per_beta0: float = fld(0.4, ge=0, le=1)
    per_beta_steps: int = fld(10_000, ge=1)
    per_eps: float = fld(1e-6, gt=0)
    # A transition's priority (docs/model.md, "Priorities"): "kl" = the blended C51 loss with
    # its cross-entropy less the projected target's entropy, KL(m ‖ p) — zero for a transition
    # the network already fits, as Rainbow prioritises; "cross_entropy" = the loss itself, whose
    # target-entropy part (~98 % of it early in training) flattens the priorities
    per_priority: Literal["kl", "cross_entropy"] = "kl"
    exploration: Literal["epsilon", "boltzmann"] = "epsilon"
    # How a training episode's end enters the returns (docs/training.md, "Episode ends"):
    # "truncate" = the market goes on: the forced-liquidation step (it ignores the policy) is
    # not a transition, and the step before it bootstraps from the final decision bar's state;
    # "terminal" = the episode's end is the end of the task: no bootstrap after it.
    episode_end: Literal["truncate", "terminal"] = "truncate"
    eps_start: float = fld(1.0, ge=0, le=1)
    eps_end: float = fld(0.05, ge=0, le=1)
    eps_decay_steps: int = fld(5000, ge=1)
    temperature: float = fld(1.0, gt=0)  # Boltzmann
    warmup_blend_steps: int = fld(500, ge=0)  # α ramps 0→1 over these updates (MSE → C51)
    iqn_weight: float = fld(1.0, ge=0)
    moe_lambda_floor: float = fld(0.01, ge=0)
    moe_lambda_extra: float = fld(0.05, ge=0)
    moe_entropy_target: float = fld(0.0, ge=0)  # 0 = 0.9·log K
    moe_entropy_decay: float = fld(0.99, ge=0, lt=1)
    shrink: float = fld(0.8, ge=0, le=1)  # shrink-and-perturb at fold boundaries
    perturb: float = fld(0.01, ge=0)
    finite_checks: bool = True  # halt naming the first non-finite tensor
    # The update's Q statistics (q.mean/std/gap in the log) read a systematic sample of this
    # many batch rows (every B // q_stats_rows-th row of a device's share; 0 = every row):
    # over all 16384 rows the expected Q of every action cost 31 µs bf16 / 58 µs float32 of
    # the H200 update, for diagnostics alone. The finite check still covers every row
    # (docs/training.md, "Safety").
    q_stats_rows: int = fld(1024, ge=0)
    q_drift_halt: bool = True  # reject a model whose |mean Q| explodes
    q_drift_floor: float = fld(10.0, ge=0)
    # GPU only: "concurrent" compiles the epoch so that its CUDA graphs run independent kernels
    # side by side and capture whole loops (jdqn/train/xla_options.py); "xla" = XLA's default
    # graphs; "auto" = concurrent (on the H200 the gpu.toml epoch 4.15 s vs 5.00 s, two seeds
    # 7.45 vs 8.26 s, data-parallel on two H200s one seed 4.96 vs 5.17 s and two 8.21 vs
    # 8.79 s; +0.45-0.7 GB peak memory per seed) except for multi-host runs, not measured: xla
    # there. Same kernels, other order: bitwise the same state (checked for one and two seeds,
    # on one GPU and data-parallel on two). Ignored on CPU.
    gpu_graphs: Literal["auto", "concurrent", "xla"] = "auto"


@dataclass(frozen=True)
class EvalConfig:
    periods_per_year: float = fld(0.0, ge=0)  # 0 = derive from bar size and sessions
    sessions_per_year: float = fld(252.0, gt=0)
    session_hours: float = fld(23.0, gt=0, le=24)  # CME Globex ≈ 23 h
    stride: int = fld(1, ge=1)  # evaluation subsampling stride (annualisation corrected)
    momentum_lookback: int = fld(20, ge=1)
    n_windows: int = fld(1, ge=1)  # backtest windows run in parallel (flat at each boundary)
    random_seed: int = fld(12345, ge=0, lt=2**32)
    baselines: tuple[str, ...] = _tuple("flat", "buy_and_hold", "momentum", "random")


@dataclass(frozen=True)
class CheckpointConfig:
    enabled: bool = True
    keep_best: int = fld(2, ge=1)  # best-N by validation Sharpe
    keep_latest: int = fld(2, ge=1)
    async_save: bool = True


@dataclass(frozen=True)
class ParallelConfig:
    # Data-parallel training over the devices of one host (docs/training.md, "Data parallel"):
    # 1 = one device; D > 1 = the first D devices; 0 = every device JAX sees. env.n_envs,
    # train.batch_size and train.replay_capacity are global and must divide by the count.
    n_devices: int = fld(1, ge=0, le=4096)
    # Multi-host: this process is one of several started together (one per host), joined by
    # jax.distributed (CLI --coordinator/--num-processes/--process-id, or cluster detection);
    # n_devices then counts every process's devices (docs/training.md, "Multi-host").
    distributed: bool = False


@dataclass(frozen=True)
class LoggingConfig:
    progress: bool = True  # rich progress bar
    tensorboard: bool = True
    jsonl: bool = True


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# --------------------------------------------------------------------------------------------
# loading and validation
# --------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _union_member_name(tp: Any) -> str:
    """One alternative of a union field, for its error message (``an integer``, ``'auto'``)."""
    if typing.get_origin(tp) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, _type_name(tp))


# Choices that existed under another name, with what to use instead
_RETIRED = {
    ("reward_norm", "popart"): "'popart' was renamed 'zscore': it is a running mean/std "
    "normaliser without PopArt's output-preserving rescale, which has no exact form for the "
    "fixed-support C51 heads (docs/env.md, \"Reward\")",
}


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            why = _RETIRED.get((key.rsplit(".", 1)[-1], value), "")
            raise ConfigError(f"{key} = {value!r} is not allowed; allowed values: "
                              + ", ".join(repr(a) for a in allowed) + (f" ({why})" if why
                                                                       else ""))
        return value
    if origin in (types.UnionType, typing.Union):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key} = {value!r} has the wrong type; expected "
                          + " or ".join(_union_member_name(a) for a in typing.get_args(tp)))
    if origin is tuple:
        (elem,) = typing.get_args(tp)[:1]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} = {value!r} has the wrong type; expected a list of "
                              f"{_type_name(elem)}")
        return tuple(_coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table (section), got {value!r}")
        return _build(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r} has the wrong type; expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} = {value!r} has the wrong type; expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} = {value!r} has the wrong type; expected a number")
        try:
            return float(value)
        except OverflowError:  # an integer beyond float range
            raise ConfigError(f"{key} = {value!r} is too large for a number") from None
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} = {value!r} has the wrong type; expected a string")
        return value
    raise ConfigError(f"{key}: unsupported field type {tp}")  # a programming error


INT32_MAX = 2**31 - 1  # the largest integer setting without a range of its own


def _check_range(value: Any, meta: typing.Mapping[str, Any], key: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    ge, le, gt, lt = meta.get("ge"), meta.get("le"), meta.get("gt"), meta.get("lt")
    lo = f"[{ge}" if ge is not None else (f"({gt}" if gt is not None else "(-inf")
    hi = f"{le}]" if le is not None else (f"{lt})" if lt is not None else "inf)")
    if isinstance(value, int) and le is None and lt is None:
        # Counts and sizes become int32 array dimensions and indices: larger ones overflow
        # inside JAX with a raw traceback (or abort in XLA), after the run folder exists.
        le, hi = INT32_MAX, f"{INT32_MAX}]"
    bad = ((ge is not None and value < ge) or (le is not None and value > le)
           or (gt is not None and value <= gt) or (lt is not None and value >= lt))
    if isinstance(value, float) and not math.isfinite(value):  # NaN, ±inf: never usable
        raise ConfigError(f"{key} = {value!r} is not a finite number; allowed: {lo}, {hi}")
    if bad:
        raise ConfigError(f"{key} = {value!r} is out of range; allowed: {lo}, {hi}")


def _build(cls: type, table: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in table.items():
        key = f"{prefix}.{k}" if prefix else k
        if k not in fields:
            near = difflib.get_close_matches(k, list(fields), n=1, cutoff=0.5)
            if near:  # the likely key is enough; the whole section's list would bury it
                raise ConfigError(f"unknown config key '{key}'; did you mean "
                                  f"'{(prefix + '.') if prefix else ''}{near[0]}'?")
            valid = ", ".join(sorted(fields))
            raise ConfigError(f"unknown config key '{key}' (valid keys here: {valid})")
        val = _coerce(v, hints[k], key)
        if isinstance(val, tuple):
            for i, x in enumerate(val):
                _check_range(x, fields[k].metadata, f"{key}[{i}]")
        else:
            _check_range(val, fields[k].metadata, key)
        kwargs[k] = val
    obj = cls(**kwargs)
    _validate(obj, prefix)
    return obj


# The synthetic bars are stamped from 2024 in int64 nanoseconds, which end in 2262.
_SYNTHETIC_SPAN_S = 5 * 10**9


def _validate(obj: Any, prefix: str) -> None:
    """Cross-field checks that a single field's range cannot express."""
    p = (prefix + ".") if prefix else ""
    if isinstance(obj, ModelConfig):
        if obj.v_min >= obj.v_max:
            raise ConfigError(f"{p}v_min = {obj.v_min} must be < {p}v_max = {obj.v_max}")
        if len(obj.branch_sizes) != 4 or any(b < 1 for b in obj.branch_sizes):
            raise ConfigError(f"{p}branch_sizes = {list(obj.branch_sizes)}: need 4 positive sizes "
                              "(direction, magnitude, order type, urgency)")
        if obj.branch_sizes[0] != 4:
            raise ConfigError(f"{p}branch_sizes[0] = {obj.branch_sizes[0]}: the direction branch "
                              "has exactly 4 actions (short, hold, long, flat)")
        for i, (name, values) in enumerate((("magnitude", "¼, ½, full"),
                                            ("order type", "market, limit, passive limit"),
                                            ("urgency", "three limit expiries")), start=1):
            if obj.branch_sizes[i] > 3:
                raise ConfigError(f"{p}branch_sizes[{i}] = {obj.branch_sizes[i]}: the env has 3 "
                                  f"{name} actions ({values}); use at most 3")
    if isinstance(obj, EnvConfig) and (len(obj.limit_expiry) != 3
                                       or any(e < 1 for e in obj.limit_expiry)):
        raise ConfigError(f"{p}limit_expiry = {list(obj.limit_expiry)}: need 3 positive bar "
                          "counts, one per urgency level")
    if isinstance(obj, SyntheticConfig) and obj.n_bars * obj.bar_seconds > _SYNTHETIC_SPAN_S:
        raise ConfigError(f"{p}n_bars × {p}bar_seconds = {obj.n_bars} × {obj.bar_seconds} s "
                          f"spans more than the {_SYNTHETIC_SPAN_S:.0e} s (≈ 158 years) the "
                          "synthetic market's nanosecond timestamps can hold")
    if isinstance(obj, DataConfig):
        if obj.timezone.strip():  # an empty one is named where the data is read
            import pandas as pd

            try:  # what the loaders localise with: IANA names, 'utc', fixed offsets
                pd.DatetimeIndex([]).tz_localize(obj.timezone)
            except Exception:  # noqa: BLE001 — pandas/pytz/zoneinfo/OS errors alike
                raise ConfigError(f"{p}timezone = {obj.timezone!r} is not a time zone pandas "
                                  "knows (e.g. 'UTC', 'America/Chicago', '+01:00')") from None
        if obj.bar_type == "time":  # checked here, not only where a file's bars are built
            from jdqn.data.bars import parse_bar_size
            from jdqn.errors import DataError

            try:
                parse_bar_size(obj.bar_size)
            except DataError as e:
                raise ConfigError(f"{p}{str(e).removeprefix('data.')}") from None
    if isinstance(obj, DataConfig) and obj.source == "synthetic":
        given = ([f"{p}path = {obj.path!r}"] if obj.path else []) + (
            [f"{p}columns"] if obj.columns != ColumnMap() else [])
        if given:
            raise ConfigError(f"{' and '.join(given)} set, but {p}source = 'synthetic' reads no "
                              f"file; set {p}source to 'ticks', 'ohlcv' or 'dbn' to read it, or "
                              f"remove {p}path and {p}columns")
    if isinstance(obj, FeaturesConfig):
        for name in ("return_lags", "vol_windows", "mtf_factors"):
            vals = getattr(obj, name)
            if any(v < 1 for v in vals):
                raise ConfigError(f"{p}{name} = {list(vals)}: every entry must be ≥ 1")
            dup = sorted({v for v in vals if vals.count(v) > 1})
            if dup:
                raise ConfigError(f"{p}{name} = {list(vals)}: {dup} repeated; each entry makes "
                                  "its own feature column, so a repeat is the same column twice")
        if not obj.vol_windows:  # the first one scales CUSUM and the multi-timeframe vols
            raise ConfigError(f"{p}vol_windows = []: give at least one window (bars)")
        n = n_base_features(obj)
        if obj.state_width != "auto" and n + N_PORTFOLIO_SLOTS > obj.state_width:
            raise ConfigError(f"{p}state_width = {obj.state_width} is too small: {n} features + "
                              f"{N_PORTFOLIO_SLOTS} portfolio slots need {n + N_PORTFOLIO_SLOTS}; "
                              "raise state_width or use fewer features")
    if isinstance(obj, TrainConfig):
        if not obj.seeds:
            raise ConfigError(f"{p}seeds is empty; give at least one seed")
        dup = sorted({s for s in obj.seeds if obj.seeds.count(s) > 1})
        if dup:
            raise ConfigError(f"{p}seeds = {list(obj.seeds)}: seed(s) {dup} repeated; each seed "
                              "is a separate model with its own report folder")
        if obj.min_replay > obj.replay_capacity:
            raise ConfigError(f"{p}min_replay = {obj.min_replay} > {p}replay_capacity = "
                              f"{obj.replay_capacity}: the replay could never fill enough for "
                              "a single gradient update")
    if isinstance(obj, Config):
        t, m = obj.train, obj.model
        if obj.data.source == "synthetic" and obj.data.synthetic.tick_size != obj.env.tick_size:
            raise ConfigError(
                f"data.synthetic.tick_size = {obj.data.synthetic.tick_size} but env.tick_size = "
                f"{obj.env.tick_size}: the synthetic market's prices move on its tick, while "
                "the env prices spread, slippage and limit orders in env.tick_size; set both "
                "to the same value")
        if m.iqn and m.iqn_taus == "batch" and t.batch_size % m.iqn_tau_groups:
            raise ConfigError(f"model.iqn_tau_groups = {m.iqn_tau_groups} does not divide "
                              f"train.batch_size = {t.batch_size}: the groups are equal shares "
                              "of the batch")
        if obj.parallel.n_devices > 1:
            check_divides(obj, obj.parallel.n_devices,
                          f"parallel.n_devices = {obj.parallel.n_devices}")
        # Updates wait for min_replay sampleable transitions. Per env, fold 0 collects `steps`
        # steps; the last n − 1 are still in the n-step carry when it ends, and under
        # episode_end = "truncate" every episode's forced-liquidation step is never sampled.
        steps = t.epochs_per_fold * t.iters_per_epoch * t.collect_steps
        forced = steps // obj.env.episode_length if t.episode_end == "truncate" else 0
        most = max(0, steps - (t.n_step - 1) - forced) * obj.env.n_envs
        if t.min_replay > most:
            raise ConfigError(
                f"train.min_replay = {t.min_replay} can never be reached in fold 0: it collects "
                f"train.epochs_per_fold × iters_per_epoch × collect_steps = "
                f"{t.epochs_per_fold} × {t.iters_per_epoch} × {t.collect_steps} = {steps} steps "
                f"per env, of which n_step − 1 = {t.n_step - 1} are still in the n-step window "
                f"at the end and {forced} are forced liquidations (train.episode_end = "
                f"{t.episode_end!r}, env.episode_length = {obj.env.episode_length}), × "
                f"env.n_envs = {obj.env.n_envs}: at most {most} sampleable transitions, so it "
                "would run no gradient update; lower min_replay or collect more")
    if isinstance(obj, EvalConfig):
        allowed = {"flat", "buy_and_hold", "momentum", "random"}
        for b in obj.baselines:
            if b not in allowed:
                raise ConfigError(f"{p}baselines: unknown baseline {b!r}; allowed: "
                                  + ", ".join(sorted(allowed)))


def check_divides(cfg: Config, n_devices: int, what: str) -> None:
    """Data parallel splits the envs, the batch and the replay evenly over the devices: refuse
    sizes that do not divide (``what`` opens the message: where the device count came from)."""
    sizes = {"env.n_envs": cfg.env.n_envs, "train.batch_size": cfg.train.batch_size,
             "train.replay_capacity": cfg.train.replay_capacity}
    bad = [f"{k} = {v}" for k, v in sizes.items() if v % n_devices]
    if bad:
        raise ConfigError(f"{what}: {', '.join(bad)} not divisible by "
                          f"{n_devices}; data parallel gives every device an equal share of "
                          "the envs, the batch and the replay")
    share, groups = cfg.train.batch_size // n_devices, cfg.model.iqn_tau_groups
    if cfg.model.iqn and cfg.model.iqn_taus == "batch" and share % groups:
        raise ConfigError(f"{what}: each device's batch, train.batch_size / {n_devices} = "
                          f"{share}, is not divisible by model.iqn_tau_groups = {groups}: "
                          "every device cuts its share into the groups")


def n_base_features(cfg: FeaturesConfig) -> int:
    """Feature columns ``jdqn.data.features.build_features`` makes from any input; order-book
    inputs (DBN MBP-10) add up to ``ofi_levels`` + 2 more."""
    return (len(cfg.return_lags) + len(cfg.vol_windows) + 2 * len(cfg.mtf_factors)
            + 11 + 2 * cfg.time_of_day)  # range, volume_z, 3 ADX, 3 CUSUM, duration, 2 flow


def config_from_dict(table: dict[str, Any]) -> Config:
    """Build and validate a :class:`Config` from a nested dict (parsed TOML)."""
    return _build(Config, table, "")


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare string, e.g. --set data.source=ticks


def _merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    """Merge ``src`` into ``dst`` in place; a table merges into a table, key by key."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


def apply_overrides(table: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` overrides to a nested dict (returns a new dict). A table value
    (``--set 'data.synthetic={n_bars=5000}'``) merges into the table there: keys it does not
    name keep their values."""
    import copy

    out = copy.deepcopy(table)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. train.lr=1e-3")
        key, text = item.split("=", 1)
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise ConfigError(f"--set {item!r}: empty key")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: '{p}' is not a section")
        _merge(node, {parts[-1]: _parse_value(text.strip())})
    return out


def _blame(msg: str, table: dict[str, Any], overrides: list[str], path: Path) -> str:
    """Where a config error came from: ``--set`` when the message names a key the command line
    set (or the file alone is valid), else the file."""
    import re

    keys = [o.split("=", 1)[0].strip() for o in overrides if "=" in o]
    if any(re.search(rf"(?<![\w.]){re.escape(k)}(?!\w)", msg) for k in keys if k):
        return "--set"
    if overrides:
        try:
            config_from_dict(table)
            return "--set"
        except ConfigError:
            pass
    return str(path)


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Read a TOML config file, apply CLI overrides and validate."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a UTF-8 text file (byte {e.start}); TOML configs are "
                          "UTF-8") from None
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot be read ({e.strerror})") from None
    merged = apply_overrides(table, overrides or [])
    try:
        cfg = config_from_dict(merged)
    except ConfigError as e:
        raise ConfigError(f"{_blame(str(e), table, overrides or [], path)}: {e}") from None
    return resolve_paths(cfg, path.parent)


def resolve_paths(cfg: Config, base: Path) -> Config:
    """Make a relative data path relative to the config file's folder when it exists there (and
    only there: a different file of that name in the current folder too is refused)."""
    p = cfg.data.path
    if p and not p.startswith("builtin:") and not Path(p).is_absolute():
        here, cand = Path(p).expanduser(), base / p
        if here.exists() and cand.exists() and here.resolve() != cand.resolve():
            raise ConfigError(f"data.path = {p!r} is ambiguous: both {here.resolve()} (current "
                              f"folder) and {cand.resolve()} (the config's folder) exist; give "
                              "an absolute path")
        if cand.exists() and not here.exists():
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(cand)))
    return cfg


def to_dict(obj: Any) -> dict[str, Any]:
    """Dataclass → plain nested dict with lists (TOML-serialisable)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            out[f.name] = to_dict(v)
        elif isinstance(v, tuple):
            out[f.name] = list(v)
        else:
            out[f.name] = v
    return out


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return "nan" if isinstance(v, float) and math.isnan(v) else repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def dumps_toml(cfg: Config) -> str:
    """Write the resolved config as TOML (round-trips through :func:`config_from_dict`)."""
    lines: list[str] = []

    def section(name: str, d: dict[str, Any]) -> None:
        scalars = {k: v for k, v in d.items() if not isinstance(v, dict)}
        tables = {k: v for k, v in d.items() if isinstance(v, dict)}
        lines.append(f"[{name}]")
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in scalars.items())
        lines.append("")
        for k, v in tables.items():
            section(f"{name}.{k}", v)

    for name, d in to_dict(cfg).items():
        section(name, d)
    return "\n".join(lines)


# Characters orbax cannot have in a checkpoint's path: it finds a save's data files with a glob
# (so "[...]" is a pattern that matches nothing) and tensorstore reads "\\" as a separator (the
# data lands in another folder). The save "succeeds" and the checkpoint can never be restored.
UNSAFE_PATH_CHARS = "[]\\"


def checkpoint_path_problem(path: str | Path) -> str | None:
    """Why orbax checkpoints could not live under ``path`` (made absolute), or None: the
    :data:`UNSAFE_PATH_CHARS` it holds, in one message for every caller."""
    text = str(Path(path).absolute())
    bad = sorted({c for c in text if c in UNSAFE_PATH_CHARS})
    if not bad:
        return None
    return (f"the path holds {' '.join(repr(c) for c in bad)}, which the checkpoint library "
            "(orbax) reads as glob or path syntax, so checkpoints there could never be restored")
