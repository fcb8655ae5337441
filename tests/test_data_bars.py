"""Bars from ticks: the boundary convention, empty intervals, the tick rule, volume/dollar bars,
and the real ES ticks against an independent pandas resample."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from jdqn.config import ColumnMap, DataConfig
from jdqn.data import load_bars, parse_bar_size, ticks_to_bars
from jdqn.data.bars import NS, check_ticks, trade_signs
from jdqn.errors import DataError

SHARED = Path(__file__).parents[1].parent / "shared" / "data"
ES_FULL = SHARED / "es_ticks" / "ES_ticks_2013-09-01_03.csv.gz"
ES_COLUMNS = ColumnMap(timestamp="DateTime", price="Price", size="Volume")
T0 = 28_333_334 * 60 * NS  # a whole minute (2023-11-14T22:14Z)


def test_parse_bar_size() -> None:
    assert parse_bar_size("30s") == 30 * NS
    assert parse_bar_size("1min") == 60 * NS
    assert parse_bar_size("5min") == 300 * NS
    assert parse_bar_size("1h") == 3600 * NS
    assert parse_bar_size("1d") == 86400 * NS
    for bad in ("", "5", "1week", "0s", "2d", "min"):
        with pytest.raises(DataError, match="bar_size"):
            parse_bar_size(bad)


def test_time_bar_contains_events_in_previous_close_to_own_close() -> None:
    """(close(t−1), close(t)]: an event on the grid point closes that bar; 1 ns later opens the
    next one. Empty grid intervals produce no bar."""
    s = NS
    ts = T0 + np.array([1, 60 * s, 60 * s + 1, 119 * s, 300 * s + 5])
    price = np.array([10.0, 11.0, 12.0, 9.0, 13.0])
    size = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    b = ticks_to_bars(ts, price, size, bar_ns=60 * s)
    np.testing.assert_array_equal(b.ts - T0, np.array([60, 120, 360]) * s)
    np.testing.assert_array_equal(b.start_ts, ts[[0, 2, 4]])
    np.testing.assert_array_equal(b.open, [10.0, 12.0, 13.0])
    np.testing.assert_array_equal(b.high, [11.0, 12.0, 13.0])
    np.testing.assert_array_equal(b.low, [10.0, 9.0, 13.0])
    np.testing.assert_array_equal(b.close, [11.0, 9.0, 13.0])
    np.testing.assert_array_equal(b.volume, [3.0, 7.0, 5.0])
    np.testing.assert_array_equal(b.n_trades, [2, 2, 1])
    assert b.bar_seconds == 60.0


def test_volume_bar_seconds_leave_out_closures() -> None:
    """Annualisation of event bars uses their spacing inside sessions: two 'sessions' of one
    trade every 10 s (volume bars of 3 trades, one bar per 30 s) separated by a weekend-like
    49-hour closure and a 1-hour break must give 30 s, not the whole-series mean (which counts
    the closures: 30 s over trading time, thousands over calendar time)."""
    session = np.arange(600) * 10 * NS  # 100 minutes of trades
    ts = np.concatenate([T0 + session, T0 + session[-1] + 49 * 3600 * NS + session,
                         T0 + session[-1] * 2 + 50 * 3600 * NS + session])
    n = ts.shape[0]
    b = ticks_to_bars(ts, np.full(n, 100.0), np.ones(n), bar_type="volume", threshold=3.0)
    assert b.bar_seconds == pytest.approx(30.0)
    whole = (b.ts[-1] - b.ts[0]) / NS / (len(b) - 1)
    assert whole > 10 * b.bar_seconds  # what the whole-series mean would have said
    # Slow trading that is not a closure (one bar per 20 min, the median) is kept.
    slow = ticks_to_bars(T0 + np.arange(30) * 400 * NS, np.full(30, 1.0), np.ones(30),
                         bar_type="volume", threshold=3.0)
    assert slow.bar_seconds == pytest.approx(1200.0)


def test_tick_rule_signs_carry_forward_and_side_overrides() -> None:
    price = np.array([5.0, 5.0, 6.0, 6.0, 5.5, 5.5, 7.0])
    np.testing.assert_array_equal(trade_signs(price, None), [0, 0, 1, 1, -1, -1, 1])
    side = np.array([0, -1, 0, 0, 1, 0, 0], np.int8)
    np.testing.assert_array_equal(trade_signs(price, side), [0, -1, 1, 1, 1, -1, 1])
    b = ticks_to_bars(T0 + np.arange(7) * NS, price, np.ones(7), bar_ns=3600 * NS)
    # unknown sign → half each way: buys = 0.5+0.5+1+1+0+0+1
    assert b.buy_volume[0] == 4.0 and b.sell_volume[0] == 3.0


def test_volume_bars_close_on_threshold_crossing_and_whole_timestamps() -> None:
    ts = T0 + np.array([1, 2, 3, 3, 4, 5, 6]) * NS
    size = np.array([4.0, 4.0, 3.0, 1.0, 10.0, 2.0, 1.0])
    b = ticks_to_bars(ts, np.full(7, 100.0), size, bar_type="volume", threshold=10.0)
    # cumulative 4, 8, 11 (crosses 10 at the 3rd event; its stamp also holds the 4th), 12, 22
    # (crosses 20), 24, 25 → bars [0..3], [4]; the rest is an incomplete bar and dropped
    np.testing.assert_array_equal(b.volume, [12.0, 10.0])
    np.testing.assert_array_equal(b.ts, ts[[3, 4]])
    assert (np.diff(b.ts) > 0).all()
    d = ticks_to_bars(ts, np.full(7, 100.0), size, bar_type="dollar", threshold=1000.0)
    np.testing.assert_array_equal(d.volume, b.volume)
    with pytest.raises(DataError, match="threshold"):
        ticks_to_bars(ts, np.full(7, 100.0), size, bar_type="volume", threshold=0.0)


def test_ticks_to_bars_is_vectorised_over_a_million_ticks_quickly() -> None:
    rng = np.random.default_rng(0)
    n = 1_000_000
    ts = T0 + np.cumsum(rng.integers(0, 20_000_000, n))
    price = 4000 + 0.25 * np.cumsum(rng.integers(-1, 2, n))
    b = ticks_to_bars(ts, price, np.ones(n), bar_ns=NS)
    assert b.volume.sum() == n and b.n_trades.sum() == n


def _pandas_bars(path: Path, n_rows: int | None = None) -> pd.DataFrame:
    df = pd.read_csv(path, nrows=n_rows)
    idx = pd.DatetimeIndex(pd.to_datetime(df["DateTime"])).tz_localize("America/Chicago")
    s = pd.DataFrame({"p": df["Price"].to_numpy(), "v": df["Volume"].to_numpy(
        dtype=float)}, index=idx)
    r = s.resample("1min", closed="right", label="right")
    out = pd.DataFrame({"open": r["p"].first(), "high": r["p"].max(), "low": r["p"].min(),
                        "close": r["p"].last(), "volume": r["v"].sum(), "n": r["p"].count()})
    return out[out["n"] > 0]


def _check_against_pandas(cfg: DataConfig, ref: pd.DataFrame) -> None:
    b = load_bars(cfg)
    ref_ts = ref.index.tz_convert("UTC").as_unit("ns").asi8
    np.testing.assert_array_equal(b.ts, ref_ts)
    for name in ("open", "high", "low", "close", "volume"):
        np.testing.assert_array_equal(getattr(b, name), ref[name].to_numpy(float), err_msg=name)
    np.testing.assert_array_equal(b.n_trades, ref["n"].to_numpy())
    np.testing.assert_allclose(b.buy_volume + b.sell_volume, b.volume)


def test_builtin_es_sample_matches_pandas_resample() -> None:
    from jdqn.data import resolve_path

    path = resolve_path("builtin:es_ticks")
    assert path.stat().st_size < 512 * 1024
    cfg = DataConfig(source="ticks", path="builtin:es_ticks", columns=ES_COLUMNS,
                     timezone="America/Chicago", bar_size="1min")
    _check_against_pandas(cfg, _pandas_bars(path))


@pytest.mark.skipif(not ES_FULL.is_file(), reason=f"shared ES ticks not found at {ES_FULL}")
def test_es_ticks_to_1min_bars_match_pandas_resample() -> None:
    cfg = DataConfig(source="ticks", path=str(ES_FULL), columns=ES_COLUMNS,
                     timezone="America/Chicago", bar_size="1min")
    _check_against_pandas(cfg, _pandas_bars(ES_FULL))


def test_ordering_checks_do_not_wrap_on_int64() -> None:
    """9e18 → −9e18 goes back in time, but np.diff wraps it to a positive step."""
    ts = np.array([9 * 10**18, -9 * 10**18], np.int64)
    one = np.ones(2)
    with pytest.raises(DataError, match="src: event timestamps are not ascending "
                                        r"\(event 2 is before event 1\)"):
        check_ticks(ts, one, one, "src")
    bars = ticks_to_bars(np.array([T0, T0 + NS]), one, one, bar_ns=NS, source="src")
    with pytest.raises(DataError, match="src: bar close times are not strictly ascending"):
        dataclasses.replace(bars, ts=ts).check()
