"""Bad input → one-line DataError naming the file, the row (row 1 = first data row; CSV adds the
physical line) and the field. Never a numpy/pyarrow traceback, never a silent result."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from jdqn.config import ColumnMap, DataConfig
from jdqn.data import load_bars
from jdqn.errors import DataError

TICKS = """timestamp,price,size
2024-01-02 14:30:00.100,4000.25,3
2024-01-02 14:30:00.200,4000.50,1
2024-01-02 14:30:01.000,4000.25,2
"""
OHLCV = """timestamp,open,high,low,close,volume
2024-01-02 14:31:00,10,11,9,10.5,100
2024-01-02 14:32:00,10.5,11,10,10.75,50
2024-01-02 14:33:00,10.75,12,10.5,11,70
"""


def _write(tmp_path: Path, text: str, name: str = "in.csv") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _replace_line(text: str, line: int, new: str) -> str:
    lines = text.splitlines()
    lines[line - 1] = new
    return "\n".join(lines) + "\n"


def _error(cfg: DataConfig) -> str:
    with pytest.raises(DataError) as e:
        load_bars(cfg)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert e.value.__cause__ is None or isinstance(e.value.__cause__, DataError)
    return msg


def _ticks(tmp_path: Path, text: str, **kw) -> DataConfig:
    return DataConfig(source="ticks", path=_write(tmp_path, text), bar_size="1s", **kw)


def _ohlcv(tmp_path: Path, text: str, **kw) -> DataConfig:
    return DataConfig(source="ohlcv", path=_write(tmp_path, text), **kw)


def test_good_inputs_load(tmp_path: Path) -> None:
    assert len(load_bars(_ticks(tmp_path, TICKS))) == 1  # 14:30:01.000 closes the 1st 1-s bar
    assert len(load_bars(_ohlcv(tmp_path, OHLCV))) == 3


def test_missing_file() -> None:
    for source in ("ticks", "ohlcv", "dbn"):
        msg = _error(DataConfig(source=source, path="/nonexistent/x.csv"))
        assert "/nonexistent/x.csv" in msg and "not found" in msg


@pytest.mark.parametrize("text,what", [("", "empty file"), ("timestamp,price,size\n",
                                                              "no data rows")])
def test_empty_file(tmp_path: Path, text: str, what: str) -> None:
    msg = _error(_ticks(tmp_path, text))
    assert "in.csv" in msg and what in msg


def test_missing_column_names_field_and_config_key(tmp_path: Path) -> None:
    msg = _error(_ticks(tmp_path, TICKS.replace("size", "qty")))
    assert "in.csv" in msg and "missing column 'size'" in msg and "data.columns.size" in msg
    assert "qty" in msg  # the columns that are there
    msg = _error(_ohlcv(tmp_path, OHLCV, columns=ColumnMap(close="Close")))
    assert "missing column 'Close'" in msg


@pytest.mark.parametrize("value,problem", [("nan", "NaN price"), ("", "missing value"),
                                           ("-1.5", "non-positive price -1.5"),
                                           ("0", "non-positive price 0"),
                                           ("abc", "not a number: 'abc'")])
def test_bad_tick_price(tmp_path: Path, value: str, problem: str) -> None:
    text = _replace_line(TICKS, 3, f"2024-01-02 14:30:00.200,{value},1")
    msg = _error(_ticks(tmp_path, text))
    assert re.search(r"in\.csv: row 2 \(line 3\), field 'price': ", msg), msg
    assert problem in msg


def test_bad_ohlcv_price_and_row_counting_with_skip_rows(tmp_path: Path) -> None:
    text = "exported by some tool\nsecond junk line\n" + _replace_line(
        OHLCV, 4, "2024-01-02 14:33:00,10.75,12,10.5,nan,70")
    msg = _error(_ohlcv(tmp_path, text, skip_rows=2))
    assert "row 3 (line 6), field 'close': NaN price" in msg


def test_non_positive_size_and_high_below_low(tmp_path: Path) -> None:
    msg = _error(_ticks(tmp_path, _replace_line(TICKS, 2, "2024-01-02 14:30:00.100,4000,-2")))
    assert "row 1 (line 2), field 'size'" in msg and "negative" in msg
    msg = _error(_ohlcv(tmp_path, _replace_line(OHLCV, 3, "2024-01-02 14:32:00,10.5,9,10,10,5")))
    assert "row 2 (line 3), field 'high'" in msg


@pytest.mark.parametrize("stamp", ["2024-13-02 14:30:00", "yesterday", ""])
def test_unparseable_timestamp(tmp_path: Path, stamp: str) -> None:
    text = _replace_line(TICKS, 4, f"{stamp},4000.25,2")
    msg = _error(_ticks(tmp_path, text))
    assert "row 3 (line 4), field 'timestamp'" in msg
    assert "unparseable timestamp" in msg


def test_unparseable_timestamp_with_strftime_and_unix_formats(tmp_path: Path) -> None:
    text = "timestamp,price,size\n02/01/2024 14:30:00,10,1\n2024-01-02 14:30:01,10,1\n"
    msg = _error(_ticks(tmp_path, text, timestamp_format="%d/%m/%Y %H:%M:%S"))
    assert "row 2 (line 3), field 'timestamp'" in msg and "%d/%m/%Y" in msg
    text = "timestamp,price,size\n1704205800,10,1\nsoon,10,1\n"
    msg = _error(_ticks(tmp_path, text, timestamp_format="unix_s"))
    assert "row 2 (line 3), field 'timestamp'" in msg


def test_duplicate_ohlcv_timestamp_names_both_rows(tmp_path: Path) -> None:
    text = _replace_line(OHLCV, 4, "2024-01-02 14:32:00,10.75,12,10.5,11,70")
    msg = _error(_ohlcv(tmp_path, text))
    assert "row 3 (line 4), field 'timestamp'" in msg and "duplicate timestamp" in msg
    assert "row 2" in msg


def test_ticks_may_share_a_timestamp(tmp_path: Path) -> None:
    text = TICKS + "2024-01-02 14:30:01.000,4000.50,4\n"
    b = load_bars(_ticks(tmp_path, text))
    assert b.volume.sum() == 10


def test_dst_gap_local_time_is_an_error(tmp_path: Path) -> None:
    text = "timestamp,price,size\n2024-03-10 02:30:00,10,1\n"  # does not exist in Chicago
    msg = _error(_ticks(tmp_path, text, timezone="America/Chicago"))
    assert "row 1 (line 2), field 'timestamp'" in msg and "DST" in msg


def test_bad_side_value(tmp_path: Path) -> None:
    text = "timestamp,price,size,side\n2024-01-02 14:30:00,10,1,B\n2024-01-02 14:30:01,10,1,X\n"
    msg = _error(_ticks(tmp_path, text, columns=ColumnMap(side="side")))
    assert "row 2 (line 3), field 'side'" in msg


def test_garbage_and_wrong_kind_files(tmp_path: Path) -> None:
    p = tmp_path / "x.dbn"
    p.write_bytes(b"not a dbn file at all")
    assert "not a DBN file" in _error(DataConfig(source="dbn", path=str(p)))
    p = tmp_path / "x.parquet"
    p.write_bytes(b"PAR1 broken")
    msg = _error(DataConfig(source="ticks", path=str(p)))
    assert "x.parquet" in msg and "cannot read as parquet" in msg


def test_parquet_errors_count_rows_from_one(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"timestamp": np.array([1, 2, 3], "datetime64[s]"),
                             "price": [1.0, np.nan, 2.0], "size": [1.0, 1.0, 1.0]}), p)
    msg = _error(DataConfig(source="ticks", path=str(p)))
    assert "t.parquet: row 2, field 'price': NaN price" in msg


def test_truncated_dbn_and_out_of_range_unix_stamps(tmp_path: Path) -> None:
    import databento_dbn as dbn

    from jdqn.data import testing as tk

    raw = tk.random_mbp10(np.random.default_rng(0), 20, 5.0)
    full = tk.encode_dbn(dbn.Schema.MBP_10, tk.mbp10_records(raw))
    for name, data in (("cut.dbn", full[:-100]), ("head.dbn", full[:20])):
        p = tmp_path / name
        p.write_bytes(data)
        msg = _error(DataConfig(source="dbn", path=str(p)))
        assert name in msg and "truncated" in msg
    text = "timestamp,price,size\n1704205800,10,1\n-1e30,10,1\n"
    msg = _error(_ticks(tmp_path, text, timestamp_format="unix_s"))
    assert "row 2 (line 3), field 'timestamp'" in msg and "out of range" in msg


def test_a_zstd_dbn_file_cut_anywhere_or_corrupted_is_refused(tmp_path: Path) -> None:
    """A .dbn.zst cut at a zstd block boundary decoded as whole records, so it loaded as a
    shorter dataset; a corrupted block raised zstd's RuntimeError (a traceback). Every cut
    point of a compressed file is refused naming the file, and so is a flipped byte."""
    import databento_dbn as dbn

    from jdqn.data import testing as tk
    from jdqn.data.dbn import read_dbn

    raw = tk.random_mbp10(np.random.default_rng(0), 400, 60.0)
    full = tk.encode_dbn(dbn.Schema.MBP_10, tk.mbp10_records(raw), compress=True)
    p = tmp_path / "m.dbn.zst"
    p.write_bytes(full)
    assert len(read_dbn(p)[1]) == 400
    for cut in range(4, len(full), max(1, len(full) // 300)):
        p.write_bytes(full[:cut])
        with pytest.raises(DataError, match=r"m\.dbn\.zst: (truncated|cannot)"):
            read_dbn(p)
    bad = bytearray(full)
    bad[len(full) // 2] ^= 0xFF
    p.write_bytes(bytes(bad))
    msg = _error(DataConfig(source="dbn", path=str(p), bar_size="1s"))
    assert "m.dbn.zst" in msg


def test_a_duplicated_column_name_is_named(tmp_path: Path) -> None:
    msg = _error(_ohlcv(tmp_path, OHLCV.replace(",volume\n", ",close\n", 1)))
    assert "in.csv: column 'close' (data.columns.close) appears 2 times in the header" in msg
    msg = _error(_ticks(tmp_path, TICKS.replace("timestamp,price,size", "timestamp,price,price")))
    assert "column 'price' (data.columns.price) appears 2 times" in msg


def test_aggressor_volumes_above_the_volume_are_refused(tmp_path: Path) -> None:
    text = ("timestamp,open,high,low,close,volume,buys,sells\n"
            "2024-01-02 14:31:00,10,11,9,10.5,100,60,40\n"
            "2024-01-02 14:32:00,10.5,11,10,10.75,50,200,50\n")  # the volumes mislabelled
    cols = ColumnMap(buy_volume="buys", sell_volume="sells")
    msg = _error(_ohlcv(tmp_path, text, columns=cols))
    assert "in.csv: bar 1: buy_volume + sell_volume = 250 exceeds the bar's volume 50" in msg
    assert len(load_bars(_ohlcv(tmp_path, text.replace("200,50", "10,40"), columns=cols))) == 2


def test_unix_stamps_read_in_too_fine_a_unit_are_named(tmp_path: Path) -> None:
    text = "timestamp,price,size\n1704205800,10,1\n1704205800.5,11,1\n1704205801.2,12,1\n"
    msg = _error(_ticks(tmp_path, text, timestamp_format="unix_ms"))  # they are seconds
    assert "in.csv: every timestamp read as unix_ms falls within a year of 1970-01-01" in msg
    assert "'unix_s'" in msg
    assert len(load_bars(_ticks(tmp_path, text, timestamp_format="unix_s"))) == 3
    early = "timestamp,price,size\n3600,10,1\n3600.5,11,1\n3601.2,12,1\n"  # 1970, in seconds
    assert len(load_bars(_ticks(tmp_path, early, timestamp_format="unix_s"))) == 3  # no coarser


def test_a_bar_months_after_the_one_before_draws_a_warning_naming_it(tmp_path: Path) -> None:
    text = TICKS + "2031-01-02 14:30:02.000,4000.75,1\n2031-01-02 14:30:03.000,4000.5,1\n"
    with pytest.warns(UserWarning, match=r"in.csv: bar 1 \(close 2031-01-02T14:30:02 UTC\) "
                                         r"closes \d+ days after the bar before it"):
        b = load_bars(_ticks(tmp_path, text))
    assert len(b) == 3  # used as it is


def _bars_csv(stamps: pd.DatetimeIndex) -> str:
    return "timestamp,open,high,low,close,volume\n" + "".join(
        f"{s:%Y-%m-%d %H:%M:%S},10,11,9,10.5,100\n" for s in stamps)


def test_ohlcv_spacing_must_match_bar_size(tmp_path: Path) -> None:
    """Daily bars read as 1-min bars would annualise with 347,760 periods a year instead of 252
    (Sharpe ×37); 1-min bars read as 1-h bars deflate it. The median spacing within sessions
    must lie in [0.5, 2] × bar_size."""
    daily = pd.bdate_range("2024-01-02 21:00", periods=40)  # weekends: 3-day gaps
    msg = _error(_ohlcv(tmp_path, _bars_csv(daily)))
    assert "in.csv" in msg and "1d apart" in msg and "'1min'" in msg and "data.bar_size" in msg
    assert len(load_bars(_ohlcv(tmp_path, _bars_csv(daily), bar_size="1d"))) == 40
    minutes = pd.date_range("2024-01-02 14:30", periods=90, freq="1min")
    minutes = minutes[:45].append(minutes[45:] + pd.Timedelta(hours=18))  # overnight closure
    msg = _error(_ohlcv(tmp_path, _bars_csv(minutes), bar_size="1h"))
    assert "1min apart" in msg and "'1h'" in msg
    assert len(load_bars(_ohlcv(tmp_path, _bars_csv(minutes)))) == 90
    assert len(load_bars(_ohlcv(tmp_path, _bars_csv(minutes[::2]), bar_size="2min"))) == 45


def test_empty_timezone_and_bad_strftime_pattern_name_the_setting(tmp_path: Path) -> None:
    for tz in ("", " "):
        msg = _error(_ticks(tmp_path, TICKS, timezone=tz))
        assert "in.csv" in msg and "data.timezone is empty" in msg
    msg = _error(_ticks(tmp_path, TICKS, timestamp_format="%Q"))
    assert "in.csv" in msg and "data.timestamp_format = '%Q'" in msg and "bad directive" in msg


@pytest.mark.parametrize("bar_type", ["volume", "dollar"])
def test_threshold_above_the_whole_input_is_no_complete_bar(tmp_path: Path,
                                                            bar_type: str) -> None:
    msg = _error(_ticks(tmp_path, TICKS, bar_type=bar_type, bar_threshold=1e12))
    assert "in.csv: no complete bar could be formed from 3 events" in msg
    assert "data.bar_threshold = 1e+12" in msg


def test_a_bad_print_is_refused_naming_the_bar_unless_allowed(tmp_path: Path) -> None:
    # One tick typed ×10 opens the second 1-s bar: +900 % from the first bar's close.
    spiky = TICKS + "2024-01-02 14:30:01.500,40002.5,1\n2024-01-02 14:30:02.000,4000.75,1\n"
    msg = _error(_ticks(tmp_path, spiky))
    assert "bar 1 (close 2024-01-02T14:30:02 UTC): open 40002.5 is +900.0% from the previous " \
           "close 4000.25 (1 bar beyond the limit)" in msg and "data.max_jump = 0.25" in msg, msg
    bars = load_bars(_ticks(tmp_path, spiky, max_jump=0.0))  # accepted when asked to
    assert bars.high.max() == 40002.5
    # OHLCV: a close that halves is refused at the default, accepted with a wider limit.
    crash = _replace_line(OHLCV, 4, "2024-01-02 14:33:00,10.75,10.75,5,5,70")
    msg = _error(_ohlcv(tmp_path, crash))
    assert "bar 2 " in msg and "low 5 is -53.5% from the previous close 10.75" in msg, msg
    assert len(load_bars(_ohlcv(tmp_path, crash, max_jump=1.2))) == 3  # ÷2.2 is within ×/÷ 2.2
    assert len(load_bars(_ohlcv(tmp_path, OHLCV))) == 3  # ordinary moves pass


def test_a_ragged_csv_row_is_located_by_row_and_line(tmp_path: Path) -> None:
    # Two preamble lines skipped, then a row with a field missing: data row 3, line 6.
    text = ('# exported\n# by a tool\ntimestamp,price,size\n2024-01-02 14:30:00,4000,1\n'
            '2024-01-02 14:30:01,"4000",1\n2024-01-02 14:30:02,4000.25\n')
    msg = _error(_ticks(tmp_path, text, skip_rows=2))
    assert "row 3 (line 6)" in msg and "Expected 3 columns, got 2" in msg, msg
    # A quoted field spanning two lines: the ragged row after it is data row 2, on line 4.
    text = ('timestamp,price,size\n"2024-01-02\n14:30:00",4000,1\n2024-01-02 14:30:02,4000.25\n')
    msg = _error(_ticks(tmp_path, text))
    assert "row 2 (line 4)" in msg, msg
