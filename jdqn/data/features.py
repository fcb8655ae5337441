"""Causal per-bar features: ``build_features(bars, cfg) -> FeatureSet``.

Every feature at bar t is a function of bars 0..t only (causal windows and causal recursions;
no centred windows, no ``shift(-1)``, no whole-series statistics). ``tests/test_data_lookahead.py``
checks this bitwise for every feature and every input kind. The formulas are listed in
``docs/data.md``; in short (r = 1-bar log return, all windows end at t and include it):

=================  =====================================================================
ret_k              log(close[t] / close[t−k]) for k in ``return_lags``
rvol_w             sqrt(mean(r², last w bars)) for w in ``vol_windows``
range              (high − low) / close
volume_z           z-score of log(1 + volume) over the last ``volume_z_window`` bars
adx, plus_di,      Wilder ADX(``adx_period``) and ±DI, /100 (Wilder smoothing = EMA α = 1/n)
minus_di
cusum_pos/neg/dir  symmetric CUSUM filter on r/σ (σ = rvol_{vol_windows[0]} at t−1), reset on
                   trigger at ``cusum_threshold``; pos/neg = sums / threshold; dir = sign of
                   the last trigger
mtf_ret_m,         return over m bars and realised vol of m-bar returns over
mtf_vol_m          ``vol_windows[0]`` non-overlapping m-bar steps, m in ``mtf_factors``
log_duration       log(seconds between this bar's close and the previous bar's close)
tod_sin/cos        time of day (UTC) on the unit circle (if ``time_of_day``)
flow_imb           (buy − sell) / (buy + sell) of the bar (0 when unknown or no volume)
flow_imb_w         Σ(buy − sell) / Σ(buy + sell) over the last ``ofi_window`` bars
ofi_l1..L          (MBP-10 only) OFI of book level m over the bar / mean level depth
ofi_sum_w          (MBP-10 only) Σ_levels OFI / Σ_levels depth over the last ``ofi_window``
depth_imb          (MBP-10 only) (Σbid − Σask)/(Σbid + Σask), 10 levels, book at the close
=================  =====================================================================

Input kinds without aggressor information (OHLCV without buy/sell columns) get the trade-flow
columns **zero-filled** (the layout stays the same as for ticks, ``flow_idx`` is never empty);
the book columns exist **only** for MBP-10 input. The first ``warmup`` rows (longest window not
yet full) are set to 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jdqn.config import FeaturesConfig
from jdqn.data.bars import NS, Bars
from jdqn.errors import DataError

DAY_NS = 86_400 * NS


@dataclass(frozen=True)
class FeatureSet:
    """Raw (un-normalised) features: ``values`` float32 [T, F], finite everywhere."""

    values: np.ndarray  # float32 [T, F]
    names: tuple[str, ...]  # [F]
    flow_idx: tuple[int, ...]  # columns of order-flow features (order-type/urgency heads)
    warmup: int  # rows [0, warmup) are warm-up (zeros); the env must not use them

    @property
    def n_features(self) -> int:
        return len(self.names)


# --------------------------------------------------------------------------------------------
# causal building blocks (all O(T) or O(T·w), vectorised)
# --------------------------------------------------------------------------------------------


def lag_diff(x: np.ndarray, k: int) -> np.ndarray:
    """x[t] − x[t−k]; 0 for t < k."""
    out = np.zeros_like(x)
    if k < x.shape[0]:
        out[k:] = x[k:] - x[:-k]
    return out


def rolling_sum(x: np.ndarray, w: int) -> np.ndarray:
    """Σ x[t−w+1..t] (partial sums for t < w−1). A cumulative sum is a sequential scan, so the
    value at t depends on x[≤t] only, bitwise."""
    c = np.cumsum(x, axis=0)
    out = c.copy()
    if w < x.shape[0]:
        out[w:] -= c[:-w]
    return out


def rolling_extreme(x: np.ndarray, w: int, fn: np.ufunc) -> np.ndarray:
    """max/min over the last w values (``fn`` = np.maximum or np.minimum); partial for t < w−1."""
    out = x.copy()
    for j in range(1, w):  # w shifted passes; w is small (mtf factors)
        np.copyto(out[j:], fn(out[j:], x[:-j]))
    return out


def ema(x: np.ndarray, alpha: float) -> np.ndarray:
    """Bias-corrected EMA y[t] = (1−α)·y[t−1] + α·x[t] (y[−1] = 0), divided by 1 − (1−α)^(t+1)
    so early values are proper weighted means. Computed by log-depth doubling
    (Hillis–Steele: y[i] += a^s·y[i−s], s = 1, 2, 4, …) — vectorised, and y[t] only ever adds
    terms from indices < t, so it is causal bitwise. Terms weighted below 1e-18 (under float64
    resolution relative to the newest term) are dropped."""
    a = 1.0 - alpha
    y = alpha * x.astype(np.float64)
    n, s, c = y.shape[0], 1, a
    buf = np.empty(n)
    while s < n and c > 1e-18:
        np.multiply(y[:-s], c, out=buf[: n - s])
        y[s:] += buf[: n - s]  # buf is a copy, so the in-place add never reads updated values
        s, c = 2 * s, c * c
    k = min(n, int(np.ceil(np.log(1e-18) / np.log(a))) + 1) if a > 0 else 1
    y[:k] /= 1.0 - a ** np.arange(1, k + 1, dtype=np.float64)  # beyond k the factor is 1.0
    return y


def cusum(z: np.ndarray, h: float, chunk: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symmetric CUSUM filter with reset (Page 1954; López de Prado 2018, §2.5.2.1):
    S⁺[t] = max(0, S⁺[t−1] + z[t]), S⁻[t] = min(0, S⁻[t−1] + z[t]); a side that passes ±h
    fires an event and resets to 0. Returns (S⁺, S⁻, event sign) as [T] arrays.

    The recursion is sequential; to stay vectorised it runs K chunks side by side (a Python loop
    of ~√T steps over K-vectors) and repeats with each chunk started from the previous chunk's
    final state until nothing changes. Chunk k is exact after pass k+1, and the fixed point is
    exactly — bitwise, same float operations — the sequential result; in practice the state
    forgets its start within a few bars, so 2–3 passes suffice.
    """
    n = z.shape[0]
    if n == 0:
        e = np.zeros(0)
        return e, e, e
    b = chunk or max(16, int(np.sqrt(n)))
    k = -(-n // b)
    zz = np.zeros(k * b)
    zz[:n] = z
    zz = zz.reshape(k, b)

    def run(side: float, init: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        s = init.copy()
        out = np.empty((k, b))
        fired = np.empty((k, b), bool)
        for j in range(b):
            s = np.maximum(s + side * zz[:, j], 0.0)
            f = s > h
            s[f] = 0.0
            out[:, j] = s
            fired[:, j] = f
        return out, fired, s

    results = []
    for side in (1.0, -1.0):
        init = np.zeros(k)
        for _ in range(k + 1):
            out, fired, final = run(side, init)
            new = np.concatenate([[0.0], final[:-1]])
            if np.array_equal(new, init):
                break
            init = new
        results.append((side * out.reshape(-1)[:n], fired.reshape(-1)[:n]))
    (sp, fp), (sn, fn) = results
    event = fp.astype(np.float64) - fn.astype(np.float64)
    return sp, sn, event


def _carry_forward(x: np.ndarray) -> np.ndarray:
    idx = np.where(x != 0, np.arange(x.shape[0]), 0)
    np.maximum.accumulate(idx, out=idx)
    return x[idx]


def _safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    ok = den > 0
    return np.where(ok, num / np.where(ok, den, 1.0), 0.0)


# --------------------------------------------------------------------------------------------
# the feature set
# --------------------------------------------------------------------------------------------


def warmup_rows(cfg: FeaturesConfig) -> int:
    """Rows until the longest window is full (depends on the config only, never on the data)."""
    v0 = cfg.vol_windows[0]
    mtf = max((m * (v0 + 1) for m in cfg.mtf_factors), default=0)
    return max(max(cfg.return_lags, default=1), max(cfg.vol_windows) + 1, cfg.volume_z_window,
               3 * cfg.adx_period + 1, v0 + 2, mtf, cfg.ofi_window, 2)


def build_features(bars: Bars, cfg: FeaturesConfig) -> FeatureSet:
    """All features for every bar (see the module docstring). float32 [T, F]."""
    bars.check()  # (a hand-built Bars too: e.g. partly unknown aggressor volumes)
    t_len = len(bars)
    warm = warmup_rows(cfg)
    if t_len <= warm:
        raise DataError(f"{bars.source}: {t_len} bars are too few; the features need {warm} "
                        "warm-up bars (the longest window) plus bars to use")
    cols: list[tuple[str, np.ndarray]] = []
    lc = np.log(bars.close)
    r1 = lag_diff(lc, 1)

    for k in cfg.return_lags:
        cols.append((f"ret_{k}", lag_diff(lc, k)))
    rvol = {}
    for w in cfg.vol_windows:
        rvol[w] = np.sqrt(np.maximum(rolling_sum(r1 * r1, w), 0.0) / w)
        cols.append((f"rvol_{w}", rvol[w]))
    cols.append(("range", (bars.high - bars.low) / bars.close))

    lv = np.log1p(bars.volume)
    w = cfg.volume_z_window
    mean = rolling_sum(lv, w) / w
    var = np.maximum(rolling_sum(lv * lv, w) / w - mean * mean, 0.0)
    cols.append(("volume_z", (lv - mean) / np.sqrt(var + 1e-12)))

    # Wilder ADX / ±DI
    hi, lo, cl = bars.high, bars.low, bars.close
    up, down = lag_diff(hi, 1), -lag_diff(lo, 1)
    pdm = np.where((up > down) & (up > 0), up, 0.0)
    mdm = np.where((down > up) & (down > 0), down, 0.0)
    prev_c = np.concatenate([cl[:1], cl[:-1]])
    tr = np.maximum(hi - lo, np.maximum(np.abs(hi - prev_c), np.abs(lo - prev_c)))
    alpha = 1.0 / cfg.adx_period
    atr = ema(tr, alpha)
    pdi = _safe_div(ema(pdm, alpha), atr)
    mdi = _safe_div(ema(mdm, alpha), atr)
    dx = _safe_div(np.abs(pdi - mdi), pdi + mdi)
    cols += [("adx", ema(dx, alpha)), ("plus_di", pdi), ("minus_di", mdi)]

    # CUSUM on returns in units of the previous bar's realised vol
    sig_prev = np.concatenate([[0.0], rvol[cfg.vol_windows[0]][:-1]])
    z = np.clip(_safe_div(r1, sig_prev), -10.0, 10.0)
    z[: cfg.vol_windows[0] + 1] = 0.0
    sp, sn, ev = cusum(z, cfg.cusum_threshold)
    cols += [("cusum_pos", sp / cfg.cusum_threshold), ("cusum_neg", sn / cfg.cusum_threshold),
             ("cusum_dir", _carry_forward(ev))]

    # multi-timeframe aggregates
    v0 = cfg.vol_windows[0]
    for m in cfg.mtf_factors:
        rm = lag_diff(lc, m)
        rm2 = rm * rm
        acc = rm2.copy()
        for j in range(1, v0):
            if j * m < t_len:
                acc[j * m:] += rm2[: t_len - j * m]
        cols += [(f"mtf_ret_{m}", rm), (f"mtf_vol_{m}", np.sqrt(acc / v0))]

    dur = np.diff(bars.ts, prepend=bars.ts[0] - int(bars.bar_seconds * NS)).astype(np.float64)
    cols.append(("log_duration", np.log(np.maximum(dur, 1.0) / NS)))
    if cfg.time_of_day:
        ang = 2.0 * np.pi * (np.mod(bars.ts, DAY_NS).astype(np.float64) / DAY_NS)
        cols += [("tod_sin", np.sin(ang)), ("tod_cos", np.cos(ang))]

    # order flow from trades (zero-filled when the input has no aggressor information)
    flow_start = len(cols)
    if bars.has_flow:
        buy, sell = bars.buy_volume, bars.sell_volume
    else:
        buy = sell = np.zeros(t_len)
    w = cfg.ofi_window
    cols += [("flow_imb", _safe_div(buy - sell, buy + sell)),
             (f"flow_imb_{w}", _safe_div(rolling_sum(buy - sell, w), rolling_sum(buy + sell, w)))]
    if bars.has_book:
        n_lev = min(cfg.ofi_levels, bars.ofi.shape[1])
        depth = np.maximum(bars.book_depth[:, :n_lev], 1.0)
        ofi = bars.ofi[:, :n_lev]
        for m in range(n_lev):
            cols.append((f"ofi_l{m + 1}", ofi[:, m] / depth[:, m]))
        cols.append((f"ofi_sum_{w}", _safe_div(rolling_sum(ofi.sum(axis=1), w),
                                               rolling_sum(depth.sum(axis=1), w))))
        cols.append(("depth_imb", bars.depth_imbalance))

    names = tuple(n for n, _ in cols)
    by_col = np.empty((len(cols), t_len), np.float32)  # contiguous writes, one transpose
    for j, (_, v) in enumerate(cols):
        by_col[j] = v
    values = np.ascontiguousarray(by_col.T)
    values[:warm] = 0.0
    if not np.isfinite(values).all():
        r, c = np.argwhere(~np.isfinite(values))[0]
        raise DataError(f"{bars.source}: feature '{names[c]}' is not finite at bar {r} "
                        f"(close time {bars.ts[r]}); check the input around that bar")
    return FeatureSet(values=values, names=names,
                      flow_idx=tuple(range(flow_start, len(cols))), warmup=warm)
