"""Table inputs: column mapping, timestamp formats and zones, skip_rows, ordering, Parquet."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jdqn.config import ColumnMap, DataConfig
from jdqn.data import load_bars
from jdqn.data.bars import NS
from jdqn.errors import DataError

UTC_1430 = int(pd.Timestamp("2024-01-02 14:30:00", tz="UTC").value)  # a whole minute


def _csv(tmp_path: Path, text: str, name: str = "in.csv") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("fmt,stamps", [
    ("", ["2024-01-02T14:30:00Z", "2024-01-02T14:31:00Z"]),
    ("", ["2024-01-02 08:30:00-06:00", "2024-01-02 08:31:00-06:00"]),
    ("unix_s", ["1704205800", "1704205860"]),
    ("unix_s", ["1704205800.0", "1704205860.0"]),
    ("unix_ms", ["1704205800000", "1704205860000"]),
    ("unix_us", ["1704205800000000", "1704205860000000"]),
    ("unix_ns", ["1704205800000000000", "1704205860000000000"]),
    ("%d/%m/%Y %H:%M", ["02/01/2024 14:30", "02/01/2024 14:31"]),
])
def test_timestamp_formats(tmp_path: Path, fmt: str, stamps: list[str]) -> None:
    text = "t,o,h,l,c,v\n" + "".join(f"{s},10,11,9,10,5\n" for s in stamps)
    cols = ColumnMap(timestamp="t", open="o", high="h", low="l", close="c", volume="v")
    b = load_bars(DataConfig(source="ohlcv", path=_csv(tmp_path, text), columns=cols,
                             timestamp_format=fmt))
    np.testing.assert_array_equal(b.ts, [UTC_1430, UTC_1430 + 60 * NS])


def test_naive_stamps_are_in_the_configured_zone(tmp_path: Path) -> None:
    text = "timestamp,open,high,low,close,volume\n2024-01-02 08:30:00,10,11,9,10,5\n"
    b = load_bars(DataConfig(source="ohlcv", path=_csv(tmp_path, text),
                             timezone="America/Chicago"))
    assert b.ts[0] == UTC_1430


def test_stamps_with_offsets_across_a_dst_change_read_by_their_offsets(tmp_path: Path) -> None:
    """Every stamp carries its own offset (CST, then CDT after the change): each is read by it."""
    text = ("timestamp,price,size\n2024-03-08 08:30:10-06:00,100,1\n"
            "2024-03-11 09:30:10-05:00,100,1\n")
    b = load_bars(DataConfig(source="ticks", path=_csv(tmp_path, text), bar_size="1min",
                             timezone="America/Chicago"))
    want = [pd.Timestamp(f"2024-03-{d} 14:31:00", tz="UTC").value for d in ("08", "11")]
    np.testing.assert_array_equal(b.ts, want)


@pytest.mark.parametrize("order", ["naive_first", "offset_first"])
def test_naive_stamps_beside_offset_stamps_are_refused_naming_both(tmp_path: Path,
                                                                   order: str) -> None:
    """pandas would read the naive stamps as UTC beside the offset ones (not in
    data.timezone): six hours off for Chicago, silently. Refused instead."""
    rows = [f"2024-01-02 08:{m:02d}:30,100,1" for m in range(5)]
    aware = "2024-01-02 08:05:30-06:00,100,1"
    rows = rows + [aware] if order == "naive_first" else [aware] + rows
    path = _csv(tmp_path, "timestamp,price,size\n" + "\n".join(rows) + "\n", "mixed.csv")
    with pytest.raises(DataError, match=r"mixed\.csv: row \d.*'2024-01-02 08:0\d:30' has no "
                                        r"UTC offset but row \d \('2024-01-02 08:05:30-06:00'\)"):
        load_bars(DataConfig(source="ticks", path=path, timezone="America/Chicago"))


@pytest.mark.parametrize("fmt,unit", [("unix_ns", 1), ("unix_us", 1_000), ("unix_s", NS)])
def test_unix_stamps_stored_as_text_are_exact(tmp_path: Path, fmt: str, unit: int) -> None:
    """A text (Parquet string) column of unix stamps is read as integers, not through float64
    (which keeps 256 ns at today's epochs): ticks 1 ns either side of a bar edge stay in their
    bars. Fractions of the unit are read digit by digit too."""
    edge = UTC_1430 + 60 * NS  # 14:31:00
    ts = np.array([UTC_1430 + 30 * NS, edge - 1, edge + 1, edge + 30 * NS], np.int64)
    if fmt == "unix_ns":
        text = [str(x) for x in ts]
    elif fmt == "unix_us":
        ts = ts // 1000 * 1000 + np.array([0, -1000, 1000, 0])  # 1 µs either side of the edge
        text = [str(x // unit) for x in ts]
    else:
        text = [f"{x // NS}.{x % NS:09d}" for x in ts]
    path = tmp_path / "unix.parquet"
    pq.write_table(pa.table({"timestamp": text, "price": [100.0, 100.25, 100.5, 100.75],
                             "size": [1.0, 2.0, 3.0, 4.0]}), path)
    b = load_bars(DataConfig(source="ticks", path=str(path), timestamp_format=fmt,
                             bar_size="1min"))
    np.testing.assert_array_equal(b.ts, [edge, edge + 60 * NS])
    np.testing.assert_array_equal(b.volume, [3.0, 7.0])  # the tick after the edge: next bar
    np.testing.assert_array_equal(b.close, [100.25, 100.75])


def test_skip_rows_open_label_price_scale_and_flow_columns(tmp_path: Path) -> None:
    text = ("# junk\n"
            "time,open,high,low,close,volume,buys,sells\n"
            "2024-01-02 14:29:00,1000,1100,900,1050,10,6,4\n"
            "2024-01-02 14:30:00,1050,1100,1000,1075,20,5,15\n")
    cols = ColumnMap(timestamp="time", buy_volume="buys", sell_volume="sells")
    b = load_bars(DataConfig(source="ohlcv", path=_csv(tmp_path, text), columns=cols,
                             skip_rows=1, timestamp_label="open", price_scale=0.01))
    np.testing.assert_array_equal(b.ts, [UTC_1430, UTC_1430 + 60 * NS])  # stamp + bar length
    np.testing.assert_allclose(b.close, [10.5, 10.75])
    np.testing.assert_array_equal(b.buy_volume, [6, 5])
    assert b.has_flow


def test_descending_ohlcv_is_sorted_with_a_warning_naming_the_file(tmp_path: Path) -> None:
    text = ("timestamp,open,high,low,close,volume\n"
            "2024-01-02 14:32:00,3,3,3,3,1\n2024-01-02 14:31:00,2,2,2,2,1\n"
            "2024-01-02 14:30:00,1,1,1,1,1\n")
    path = _csv(tmp_path, text, "desc.csv")
    with pytest.warns(UserWarning, match=r"desc\.csv.*descending"):
        b = load_bars(DataConfig(source="ohlcv", path=path, max_jump=0))  # toy prices 1, 2, 3
    np.testing.assert_array_equal(b.close, [1, 2, 3])
    assert (np.diff(b.ts) > 0).all()


def test_unordered_ticks_are_stably_sorted_with_a_warning(tmp_path: Path) -> None:
    text = ("timestamp,price,size\n2024-01-02 14:30:00.5,10,1\n2024-01-02 14:30:00.2,11,2\n"
            "2024-01-02 14:30:00.9,12,3\n")
    with pytest.warns(UserWarning, match=r"not in time order \(1 stamped before the row they "
                                         r"follow, first: data row 2\)"):
        b = load_bars(DataConfig(source="ticks", path=_csv(tmp_path, text), bar_size="1s"))
    assert b.open[0] == 11 and b.close[0] == 12


@pytest.mark.parametrize("sides,buy", [(["B", "A", "N"], 1 + 1.5), (["buy", "sell", ""], 1 + 1.5),
                                       (["1", "-1", "0"], 1 + 1.5)])
def test_side_column_spellings(tmp_path: Path, sides: list[str], buy: float) -> None:
    rows = [("14:30:00.1", 10, 1), ("14:30:00.2", 10, 2), ("14:30:00.3", 10, 3)]
    text = "timestamp,price,size,side\n" + "".join(
        f"2024-01-02 {t},{p},{s},{sd}\n" for (t, p, s), sd in zip(rows, sides, strict=True))
    b = load_bars(DataConfig(source="ticks", path=_csv(tmp_path, text), bar_size="1s",
                             columns=ColumnMap(side="side")))
    # third trade: unknown side, no price change yet → half each way
    assert b.buy_volume[0] == buy and b.sell_volume[0] == 6 - buy


def test_parquet_ticks_with_timestamp_type_and_integer_stamps(tmp_path: Path) -> None:
    ts = UTC_1430 + np.array([1, 2, 61]) * NS
    p1 = tmp_path / "a.parquet"
    pq.write_table(pa.table({"timestamp": pa.array(ts.astype("datetime64[ns]")).cast(
        pa.timestamp("ns", tz="UTC")), "price": [1.0, 2.0, 3.0], "size": [1.0, 1.0, 1.0]}), p1)
    p2 = tmp_path / "b.parquet"
    pq.write_table(pa.table({"timestamp": ts // 1_000_000, "price": [1.0, 2.0, 3.0],
                             "size": [1.0, 1.0, 1.0]}), p2)
    b1 = load_bars(DataConfig(source="ticks", path=str(p1), max_jump=0))  # toy prices
    b2 = load_bars(DataConfig(source="ticks", path=str(p2), timestamp_format="unix_ms",
                              max_jump=0))
    for b in (b1, b2):
        np.testing.assert_array_equal(b.ts, [UTC_1430 + 60 * NS, UTC_1430 + 120 * NS])
        np.testing.assert_array_equal(b.close, [2.0, 3.0])


def test_dictionary_encoded_parquet_columns_read_as_their_values(tmp_path: Path) -> None:
    """Parquet writers dictionary-encode repetitive columns (a side, a symbol, text stamps):
    the values are read, not the codes, and the side is not a raw pandas error."""
    cols = {"timestamp": pa.array(["2024-01-02 14:30:01", "2024-01-02 14:30:02",
                                   "2024-01-02 14:31:03"]),
            "price": pa.array([100.0, 100.25, 100.5]), "size": pa.array([1.0, 2.0, 4.0]),
            "side": pa.array(["B", None, "S"])}
    bars = []
    for enc in (False, True):
        p = tmp_path / f"{enc}.parquet"
        pq.write_table(pa.table({k: v.dictionary_encode() if enc else v
                                 for k, v in cols.items()}), p)
        bars.append(load_bars(DataConfig(source="ticks", path=str(p), bar_size="1min",
                                         columns=ColumnMap(side="side"))))
    plain, enc = bars
    for k in ("ts", "close", "volume", "buy_volume"):
        np.testing.assert_array_equal(getattr(enc, k), getattr(plain, k), err_msg=k)
    np.testing.assert_array_equal(enc.buy_volume, [3.0, 0.0])  # B, then tick rule (up), S


def test_unknown_builtin_and_empty_path() -> None:
    with pytest.raises(DataError, match="builtin:es_ticks"):
        load_bars(DataConfig(source="ticks", path="builtin:nope"))
    with pytest.raises(DataError, match="data.path is empty"):
        load_bars(DataConfig(source="ticks", path=""))


def test_ohlcv_refuses_volume_bars(tmp_path: Path) -> None:
    text = "timestamp,open,high,low,close,volume\n2024-01-02 14:30:00,1,1,1,1,1\n"
    with pytest.raises(DataError, match="bar_type"):
        load_bars(DataConfig(source="ohlcv", path=_csv(tmp_path, text), bar_type="volume",
                             bar_threshold=10.0))
