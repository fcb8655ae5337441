"""Lookahead is a correctness bug: every feature at bar ≤ t must be a function of the raw data up
to bar t's close only.

For every input kind we build bars and features, then perturb **all raw data strictly after bar
t's close** (drop events, re-time the rest, scramble prices, sizes, sides, book levels), rebuild
from the files, and require the bars and every feature column at bars ≤ t to be bitwise equal.
A deliberately leaky feature must fail the same check (the test bites).
"""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path

import numpy as np
import pytest

from jdqn.config import ColumnMap, DataConfig, FeaturesConfig, SyntheticConfig
from jdqn.data import Bars, FeatureSet, build_features, load_bars
from jdqn.data import testing as tk
from jdqn.data.bars import NS

SMALL = FeaturesConfig(return_lags=(1, 2, 5), vol_windows=(5, 10), volume_z_window=10,
                       adx_period=5, mtf_factors=(3,), ofi_window=5, ofi_levels=10)

FAMILIES = {
    "returns": "ret_", "realised vol": "rvol_", "range": "range", "volume z": "volume_z",
    "adx": "adx", "di": "plus_di", "cusum": "cusum_", "multi-timeframe": "mtf_",
    "duration": "log_duration", "time of day": "tod_", "trade flow": "flow_imb",
}
BOOK_FAMILIES = {"book ofi": "ofi_l", "book ofi sum": "ofi_sum_", "depth imbalance": "depth_imb"}


def lookahead_violations(f0: FeatureSet, f1: FeatureSet, t: int) -> list[str]:
    """Names of the feature columns whose values at bars ≤ t differ between two builds."""
    assert f0.names == f1.names
    return [name for j, name in enumerate(f0.names)
            if not np.array_equal(f0.values[: t + 1, j], f1.values[: t + 1, j])]


def bar_violations(b0: Bars, b1: Bars, t: int) -> list[str]:
    a0, a1 = b0.arrays(), b1.arrays()
    assert a0.keys() == a1.keys()
    return [k for k in a0 if not np.array_equal(a0[k][: t + 1], a1[k][: t + 1], equal_nan=True)]


# --------------------------------------------------------------------------------------------
# input kinds: raw generator, writer → DataConfig
# --------------------------------------------------------------------------------------------


def _ticks(rng):
    return tk.random_ticks(rng, 5000, 300.0)


def _ticks_noside(rng):
    return tk.random_ticks(rng, 5000, 300.0, with_side=False)


KINDS = {
    "ticks_csv": (_ticks, lambda raw, d: DataConfig(
        source="ticks", path=str(tk.write_ticks_csv(raw, d / "t.csv")),
        columns=ColumnMap(side="side"), bar_size="1s")),
    "ticks_csv_tick_rule": (_ticks_noside, lambda raw, d: DataConfig(
        source="ticks", path=str(tk.write_ticks_csv(raw, d / "t.csv")), bar_size="1s")),
    "ticks_csv_volume_bars": (_ticks, lambda raw, d: DataConfig(
        source="ticks", path=str(tk.write_ticks_csv(raw, d / "t.csv")),
        columns=ColumnMap(side="side"), bar_type="volume", bar_threshold=150.0)),
    "ticks_parquet_dollar_bars": (_ticks, lambda raw, d: DataConfig(
        source="ticks", path=str(tk.write_ticks_parquet(raw, d / "t.parquet")),
        columns=ColumnMap(side="side"), bar_type="dollar", bar_threshold=600_000.0)),
    "ticks_parquet": (_ticks, lambda raw, d: DataConfig(
        source="ticks", path=str(tk.write_ticks_parquet(raw, d / "t.parquet")),
        columns=ColumnMap(side="side"), bar_size="1s")),
    "ohlcv_csv": (lambda rng: tk.random_ohlcv(rng, 300), lambda raw, d: DataConfig(
        source="ohlcv", path=str(tk.write_ohlcv_csv(raw, d / "o.csv")), bar_size="1min")),
    # with aggressor volumes: the order-flow features are live (without them they are zeros)
    "ohlcv_csv_flow": (lambda rng: tk.random_ohlcv(rng, 300, flow=True), lambda raw, d: DataConfig(
        source="ohlcv", path=str(tk.write_ohlcv_csv(raw, d / "o.csv")), bar_size="1min",
        columns=ColumnMap(buy_volume="buy_volume", sell_volume="sell_volume"))),
    "dbn_mbp10": (lambda rng: tk.random_mbp10(rng, 3000, 200.0), lambda raw, d: DataConfig(
        source="dbn", path=str(tk.write_dbn(d / "m.dbn", "mbp-10", raw)), bar_size="1s")),
    "dbn_mbp10_zstd": (lambda rng: tk.random_mbp10(rng, 3000, 200.0), lambda raw, d: DataConfig(
        source="dbn", path=str(tk.write_dbn(d / "m.dbn.zst", "mbp-10", raw, compress=True)),
        bar_size="1s")),
    "dbn_trades": (_ticks, lambda raw, d: DataConfig(
        source="dbn", path=str(tk.write_dbn(d / "t.dbn", "trades", raw)), bar_size="1s")),
    "dbn_ohlcv": (lambda rng: tk.random_ohlcv(rng, 300), lambda raw, d: DataConfig(
        source="dbn", path=str(tk.write_dbn(d / "o.dbn.zst", "ohlcv-1m", raw, compress=True)))),
}


def _check_families(names: tuple[str, ...], book: bool) -> None:
    fams = {**FAMILIES, **(BOOK_FAMILIES if book else {})}
    for fam, prefix in fams.items():
        assert any(n.startswith(prefix) for n in names), f"feature family {fam} missing"
    if not book:
        assert not any(n.startswith(("ofi_", "depth_")) for n in names)


@pytest.mark.parametrize("kind", list(KINDS))
def test_features_at_t_ignore_all_raw_data_after_t(kind: str, tmp_path: Path) -> None:
    make, write = KINDS[kind]
    rng = np.random.default_rng(zlib.crc32(kind.encode()))  # stable across processes
    raw = make(rng)
    (tmp_path / "a").mkdir()
    b0 = load_bars(write(raw, tmp_path / "a"))
    f0 = build_features(b0, SMALL)
    _check_families(f0.names, book=kind.startswith("dbn_mbp10"))
    if kind == "ohlcv_csv_flow":
        assert np.any(f0.values[f0.warmup:, list(f0.flow_idx)] != 0), "order flow is all zero"
    assert len(b0) > 60, len(b0)
    for i, t in enumerate((f0.warmup + 3, len(b0) // 2, len(b0) - 3)):
        d = tmp_path / f"p{i}"
        d.mkdir()
        raw1 = tk.perturb_after(raw, int(b0.ts[t]), np.random.default_rng(i))
        b1 = load_bars(write(raw1, d))
        f1 = build_features(b1, SMALL)
        assert not bar_violations(b0, b1, t), (kind, t, bar_violations(b0, b1, t))
        assert not lookahead_violations(f0, f1, t), (kind, t, lookahead_violations(f0, f1, t))
        # the perturbation really changed the future (otherwise the test proves nothing)
        assert lookahead_violations(f0, f1, len(b0) - 1) or len(b1) != len(b0)


def _perturb_bars(b: Bars, t: int, rng: np.random.Generator) -> Bars:
    """Synthetic input: its raw data are the bars; change every bar after t."""
    n = len(b) - t - 1
    k = np.s_[t + 1:]
    scale = np.exp(rng.normal(0, 0.01, n))
    arrays = b.arrays()
    for name in ("open", "high", "low", "close"):
        arrays[name] = arrays[name].copy()
        arrays[name][k] *= scale
    arrays["high"][k] *= 1.001
    for name in ("volume", "buy_volume", "sell_volume"):
        arrays[name] = arrays[name].copy()
    arrays["volume"][k] = rng.integers(2, 999, n)
    # new aggressor volumes, parts of the new volume (Bars.check's invariant)
    arrays["buy_volume"][k] = np.floor(arrays["volume"][k] * rng.uniform(0, 1, n))
    arrays["sell_volume"][k] = arrays["volume"][k] - arrays["buy_volume"][k]
    arrays["ts"] = arrays["ts"].copy()
    arrays["ts"][k] = b.ts[t] + (b.ts[k] - b.ts[t]) * 3
    # each later bar's first event somewhere between the previous close and its own
    prev = np.r_[arrays["ts"][t], arrays["ts"][k][:-1]]
    arrays["start_ts"] = arrays["start_ts"].copy()
    arrays["start_ts"][k] = prev + 1 + (arrays["ts"][k] - prev - 1) * rng.uniform(0, 1, n)
    arrays["n_trades"] = arrays["n_trades"].copy()
    arrays["n_trades"][k] = rng.integers(1, 999, n)
    changed = {"open", "high", "low", "close", "volume", "buy_volume", "sell_volume", "ts",
               "start_ts", "n_trades"}
    # Every field of the bars is changed after t (a field added to Bars must be added here).
    assert set(arrays) == changed, set(arrays) ^ changed
    return dataclasses.replace(b, **arrays)


@pytest.mark.parametrize("fcfg", [SMALL, FeaturesConfig()], ids=["small", "default"])
def test_synthetic_features_at_t_ignore_bars_after_t(fcfg: FeaturesConfig) -> None:
    b0 = load_bars(DataConfig(synthetic=SyntheticConfig(n_bars=1500, seed=3)))
    f0 = build_features(b0, fcfg)
    _check_families(f0.names, book=False)
    for i, t in enumerate((f0.warmup, f0.warmup + 1, 700, 1400)):
        b1 = _perturb_bars(b0, t, np.random.default_rng(i))
        f1 = build_features(b1, fcfg)
        assert not lookahead_violations(f0, f1, t), (t, lookahead_violations(f0, f1, t))
        assert lookahead_violations(f0, f1, len(b0) - 1)


def test_lookahead_check_catches_a_leaky_feature() -> None:
    """A feature that peeks one bar ahead (np.roll(x, -1)) must be reported."""

    def leaky_build(bars: Bars, cfg: FeaturesConfig) -> FeatureSet:
        f = build_features(bars, cfg)
        peek = np.roll(np.log(bars.close), -1) - np.log(bars.close)  # r[t+1]: a leak
        return dataclasses.replace(f, values=np.column_stack([f.values, peek]).astype(np.float32),
                                   names=f.names + ("leaky_next_return",))

    b0 = load_bars(DataConfig(synthetic=SyntheticConfig(n_bars=500, seed=1)))
    t = 300
    b1 = _perturb_bars(b0, t, np.random.default_rng(0))
    bad = lookahead_violations(leaky_build(b0, SMALL), leaky_build(b1, SMALL), t)
    assert bad == ["leaky_next_return"]


# --------------------------------------------------------------------------------------------
# the predecessor's regression: OFI at t used bar t+1's window
# --------------------------------------------------------------------------------------------


def _book_raw(times_s: list[float], actions: list[str], bid0_sz: list[int]) -> dict:
    n = len(times_s)
    lv = np.arange(10)
    return {
        "ts": tk.T0 + np.round(np.array(times_s) * NS).astype(np.int64),
        "action": np.array(actions), "side": np.array(["B"] * n),
        "price": np.full(n, 100.25), "size": np.full(n, 1, np.int64),
        "bid_px": np.tile(tk._px(100.0 - 0.25 * lv), (n, 1)),
        "ask_px": np.tile(tk._px(100.25 + 0.25 * lv), (n, 1)),
        "bid_sz": np.column_stack([bid0_sz] + [np.full(n, 50)] * 9).astype(np.int64),
        "ask_sz": np.full((n, 10), 40, np.int64),
    }


def test_ofi_at_bar_t_ignores_bar_t_plus_1(tmp_path: Path) -> None:
    """Bars of 1 s on a grid at T0 (T0 is a whole second). Bar t closes at T0 + 2 s.

    An event exactly at the close belongs to bar t; an event 1 ns later belongs to bar t+1 and
    must never change OFI (raw or feature) at t."""
    base_t = [0.5, 1.5, 2.5, 3.5]
    base_a = ["T", "T", "T", "T"]
    base_sz = [10, 10, 10, 10]

    def ofi_of(times, actions, sizes, name):
        raw = _book_raw(times, actions, sizes)
        cfg = DataConfig(source="dbn", bar_size="1s",
                         path=str(tk.write_dbn(tmp_path / name, "mbp-10", raw)))
        return load_bars(cfg)

    b0 = ofi_of(base_t, base_a, base_sz, "base.dbn")
    assert list((b0.ts - tk.T0) // NS) == [1, 2, 3, 4]
    assert np.all(b0.ofi == 0)
    t = 1  # closes at T0 + 2 s
    # a lasting bid-size jump (+80) 1 ns after bar t's close: OFI of bar t+1 only
    after = ofi_of(base_t[:2] + [2.0 + 1e-9] + base_t[2:], base_a[:2] + ["A"] + base_a[2:],
                   base_sz[:2] + [90, 90, 90], "after.dbn")
    np.testing.assert_array_equal(after.ofi[: t + 1], b0.ofi[: t + 1])
    assert after.ofi[t + 1, 0] == 80.0
    # the same event exactly at the close is part of bar t's formation interval
    at = ofi_of(base_t[:2] + [2.0] + base_t[2:], base_a[:2] + ["A"] + base_a[2:],
                base_sz[:2] + [90, 90, 90], "at.dbn")
    assert at.ofi[t, 0] == 80.0 and at.ofi[t + 1, 0] == 0.0
    assert at.depth_imbalance[t] != b0.depth_imbalance[t]
    assert after.depth_imbalance[t] == b0.depth_imbalance[t]
    # and a trade 1 ns after the close starts bar t+1 instead of joining bar t
    later = ofi_of([0.5, 1.5, 2.0 + 1e-9, 3.5], base_a, base_sz, "later.dbn")
    assert list((later.ts - tk.T0) // NS) == [1, 2, 3, 4]
    assert later.n_trades[t] == 1


def test_aggressor_volume_unknown_at_some_bars_only_is_refused() -> None:
    """Whether the order-flow features exist is one switch for the whole series; a bar of
    unknown aggressor volume after t would turn them off (zero-fill them) at t as well. So a
    series with the volumes known at some bars and not at others is refused, naming the bar,
    and one with them unknown everywhere builds with the flow features zero-filled."""
    from jdqn.errors import DataError

    b = load_bars(DataConfig(synthetic=SyntheticConfig(n_bars=800, seed=3)))
    f = build_features(b, SMALL)
    for name in ("buy_volume", "sell_volume"):
        x = getattr(b, name).copy()
        x[700] = np.nan
        with pytest.raises(DataError, match=f"{name} is unknown \\(NaN\\) at bar 700"):
            build_features(dataclasses.replace(b, **{name: x}), SMALL)
    nan = np.full(len(b), np.nan)
    g = build_features(dataclasses.replace(b, buy_volume=nan, sell_volume=nan), SMALL)
    flow = [i for i, n in enumerate(g.names) if n.startswith("flow_imb")]
    assert flow and (g.values[:, flow] == 0).all() and (f.values[:, flow] != 0).any()
