"""Ticks/trades and OHLCV tables (CSV or Parquet) → validated numpy columns → Bars.

Every problem is a :class:`DataError` with one line naming the file, the row and the field.
Rows are counted as a user sees them: **row 1 is the first data row** (for CSV the message adds
the physical line, counting the header and ``skip_rows``). Row numbers always refer to the file's
own order, also when a descending file is sorted afterwards.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from jdqn.config import DataConfig
from jdqn.data.bars import (
    NS,
    Bars,
    ohlc_inconsistent,
    parse_bar_size,
    session_gaps,
    ticks_to_bars,
)
from jdqn.data.load import require_file
from jdqn.errors import DataError

_UNIX = {"unix_s": NS, "unix_ms": 1_000_000, "unix_us": 1_000, "unix_ns": 1}
_TS_MIN, _TS_MAX = -2_208_988_800 * NS, 7_258_118_400 * NS  # 1900-01-01, 2200-01-01 (UTC)
_YEAR_NS = 365 * 86_400 * NS  # unix stamps all within it of the epoch: a unit too fine


@dataclass(frozen=True)
class _Table:
    """A read table plus what is needed to point at a row."""

    path: Path
    table: pa.Table
    csv: bool
    skip_rows: int

    def where(self, row0: int, field: str) -> str:
        """'file: row R (line L), field 'x'' for a 0-based data row index."""
        row = row0 + 1
        loc = f"row {row} (line {row + 1 + self.skip_rows})" if self.csv else f"row {row}"
        return f"{self.path}: {loc}, field '{field}'"

    def column(self, name: str, role: str) -> pa.ChunkedArray:
        if name not in self.table.column_names:
            have = ", ".join(self.table.column_names)
            raise DataError(f"{self.path}: missing column '{name}' (data.columns.{role}); "
                            f"columns present: {have}")
        if self.table.column_names.count(name) > 1:  # pyarrow raises a KeyError on the name
            raise DataError(f"{self.path}: column '{name}' (data.columns.{role}) appears "
                            f"{self.table.column_names.count(name)} times in the header; "
                            "rename the duplicates so that it names one column")
        col = self.table.column(name)
        if pa.types.is_dictionary(col.type):  # Parquet's dictionary encoding: its values
            col = col.cast(col.type.value_type)
        return col


def _format_of(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    name = path.name.lower()
    if name.endswith((".parquet", ".pq", ".parq")):
        return "parquet"
    return "csv"


def read_table(path: Path, cfg: DataConfig, string_cols: tuple[str, ...] = ()) -> _Table:
    """Read a CSV (optionally .gz/.bz2/.zst, by extension) or Parquet file with pyarrow."""
    require_file(path, cfg.path)
    if os.path.getsize(path) == 0:
        raise DataError(f"{path}: empty file (0 bytes)")
    fmt = _format_of(path, cfg.format)
    try:
        if fmt == "parquet":
            table = pq.read_table(path)
        else:
            table = pacsv.read_csv(
                path,
                read_options=pacsv.ReadOptions(skip_rows=cfg.skip_rows),
                convert_options=pacsv.ConvertOptions(
                    column_types={c: pa.string() for c in string_cols if c},
                    null_values=[""], strings_can_be_null=True),  # 'nan' stays a NaN, not null
            )
    except (pa.ArrowInvalid, OSError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "Empty CSV file" in msg:
            raise DataError(f"{path}: empty file (no header row)") from None
        if fmt == "csv" and "columns, got" in msg:
            at = _ragged_row(path, cfg.skip_rows)
            where = f"{path}: row {at[0]} (line {at[1]})" if at else str(path)
            raise DataError(f"{where}: {_printable(msg)}") from None
        raise DataError(f"{path}: cannot read as {fmt}: {_printable(msg)}") from None
    if table.num_rows == 0:
        raise DataError(f"{path}: empty file (a header but no data rows)")
    return _Table(path, table, fmt == "csv", cfg.skip_rows if fmt == "csv" else 0)


def _ragged_row(path: Path, skip_rows: int) -> tuple[int, int] | None:
    """``(data row, physical line)``, 1-based, of the first CSV row whose field count differs
    from the header's (pyarrow's parse error quotes the row's text, not where it is); None if
    none is found. Only called on that error, so the second read costs nothing otherwise."""
    import csv
    import io

    with pa.input_stream(str(path), compression="detect") as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline="")
        for _ in range(skip_rows):
            text.readline()
        reader = csv.reader(text)
        width, row_no = None, 0
        for row in reader:
            if not row:
                continue
            if width is None:
                width = len(row)
                continue
            row_no += 1
            if len(row) != width:
                return row_no, skip_rows + reader.line_num
    return None


def _printable(msg: str, limit: int = 200) -> str:
    """An error message safe for one terminal line: control and undecodable bytes escaped,
    long texts cut (a binary file read as CSV would otherwise print raw bytes)."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in msg)
    return out if len(out) <= limit else out[:limit] + "…"


# --------------------------------------------------------------------------------------------
# columns
# --------------------------------------------------------------------------------------------


def _numeric(t: _Table, name: str, role: str) -> np.ndarray:
    """A numeric column as float64; unparseable text or a missing value is an error."""
    col = t.column(name, role)
    if pa.types.is_integer(col.type) or pa.types.is_floating(col.type):
        arr = col.to_numpy(zero_copy_only=False).astype(np.float64)
        if col.null_count:
            bad = int(np.flatnonzero(pd.isna(col.to_pandas()).to_numpy())[0])
            raise DataError(f"{t.where(bad, name)}: missing value")
        return arr
    if pa.types.is_boolean(col.type):
        raise DataError(f"{t.where(0, name)}: not a number: {col[0].as_py()!r} (a true/false "
                        "column)")
    if pa.types.is_null(col.type):
        raise DataError(f"{t.where(0, name)}: missing value (the column is empty)")
    s = col.to_pandas()
    arr = pd.to_numeric(s, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    bad_mask = np.isnan(arr) & ~s.astype(str).str.strip().str.lower().isin(["nan"]).to_numpy()
    if bad_mask.any():
        bad = int(np.flatnonzero(bad_mask)[0])
        val = s.iloc[bad]
        what = "missing value" if pd.isna(val) or str(val).strip() == "" else \
            f"not a number: {str(val)!r}"
        raise DataError(f"{t.where(bad, name)}: {what}")
    return arr


def _prices(t: _Table, name: str, role: str, scale: float) -> np.ndarray:
    p = _numeric(t, name, role) * scale
    bad = ~(p > 0)  # catches NaN too
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        what = "NaN price" if np.isnan(p[i]) else f"non-positive price {p[i]:g}"
        raise DataError(f"{t.where(i, name)}: {what}")
    if not np.isfinite(p).all():
        i = int(np.flatnonzero(~np.isfinite(p))[0])
        raise DataError(f"{t.where(i, name)}: infinite price")
    return p


def _sizes(t: _Table, name: str, role: str) -> np.ndarray:
    v = _numeric(t, name, role)
    bad = ~(v >= 0) | ~np.isfinite(v)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        what = "NaN size" if np.isnan(v[i]) else f"negative or infinite size {v[i]:g}"
        raise DataError(f"{t.where(i, name)}: {what}")
    return v


_SIDE_WORDS = {"B": 1, "BUY": 1, "BID": 1, "1": 1, "+1": 1, "1.0": 1,
               "A": -1, "S": -1, "SELL": -1, "ASK": -1, "-1": -1, "-1.0": -1,
               "N": 0, "": 0, "0": 0, "0.0": 0, "NONE": 0}


def _sides(t: _Table, name: str) -> np.ndarray:
    """Aggressor side → +1 buy / −1 sell / 0 unknown (then the tick rule decides).

    Accepted: 'B'/'buy'/'bid'/+1, 'A'/'S'/'sell'/'ask'/−1 (Databento: 'A' = sell aggressor),
    'N'/''/0/missing = unknown.
    """
    col = t.column(name, "side")
    if pa.types.is_integer(col.type) or pa.types.is_floating(col.type):
        v = col.to_numpy(zero_copy_only=False).astype(np.float64)
        v = np.where(np.isnan(v), 0.0, v)
        bad = ~np.isin(v, (-1.0, 0.0, 1.0))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise DataError(f"{t.where(i, name)}: side {v[i]:g} is not +1, −1 or 0")
        return v.astype(np.int8)
    s = col.to_pandas().fillna("").astype(str).str.strip().str.upper()
    mapped = s.map(_SIDE_WORDS)
    if mapped.isna().any():
        i = int(np.flatnonzero(mapped.isna().to_numpy())[0])
        raise DataError(f"{t.where(i, name)}: side {s.iloc[i]!r} is not one of B/buy/+1, "
                        "A/S/sell/−1, N/0")
    return mapped.to_numpy(dtype=np.int8)


def _localise(idx: pd.DatetimeIndex, tz: str, t: _Table, name: str) -> np.ndarray:
    if idx.tz is None:
        if not tz.strip():
            raise DataError(f"{t.path}: data.timezone is empty; the timestamps have no UTC offset, "
                            "so set it to their zone (e.g. 'UTC' or 'America/Chicago')")
        try:
            idx = idx.tz_localize(tz, ambiguous="NaT", nonexistent="NaT")
        except (KeyError, ValueError, IndexError) as e:  # unknown zone name
            raise DataError(f"{t.path}: data.timezone = {tz!r}: {e}") from None
        if idx.isna().any():
            i = int(np.flatnonzero(idx.isna())[0])
            raise DataError(f"{t.where(i, name)}: local time does not exist or is ambiguous in "
                            f"{tz} (DST change); store UTC or offset-aware timestamps")
    return idx.tz_convert("UTC").as_unit("ns").asi8.astype(np.int64)


# An ISO-8601 time of day followed by a UTC offset ("Z", "+01", "-05:00", "+0530").
_OFFSET_AFTER_TIME = r"\d{2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?\s*(?:Z|[+-]\d{2}(?::?\d{2})?)$"


def _refuse_naive_beside_offsets(s: pd.Series, t: _Table, name: str) -> None:
    """A column mixing stamps with a UTC offset and naive ones is refused, naming one row of
    each: pandas would read the naive ones as UTC, not in ``data.timezone``. (Stamps that all
    carry offsets, which may differ across a DST change, are read by their offsets.)"""
    text = s.fillna("").str.strip()
    aware = text.str.contains(_OFFSET_AFTER_TIME, regex=True).to_numpy(dtype=bool)
    naive = ~aware & (text != "").to_numpy(dtype=bool)
    if aware.any() and naive.any():
        i, j = int(np.flatnonzero(aware)[0]), int(np.flatnonzero(naive)[0])
        raise DataError(f"{t.where(j, name)}: timestamp {str(text.iloc[j])!r} has no UTC offset "
                        f"but row {i + 1} ({str(text.iloc[i])!r}) has one; store every stamp "
                        "with its offset, or none (naive stamps are read in data.timezone)")


def _decimal_text_ns(col: pa.ChunkedArray, unit_ns: int) -> np.ndarray | None:
    """A text column of plain decimal numbers (``1704205860000000001``, ``1704205860.25``) in
    units of ``unit_ns`` nanoseconds → int64 ns, exactly (float64 keeps only ~16 digits: 256 ns
    at today's epochs in ns); digits below a nanosecond are dropped. None where a value is not
    such a number (an exponent, say): the caller's float path reads it."""
    parts = col.to_pandas().astype("string").str.strip().str.extract(
        r"^([+-]?)(\d+)(?:\.(\d*))?$")
    # (the caller has checked the values' range, 1900–2200, so the products fit in int64)
    if parts[1].isna().any() or parts[1].str.len().max() > 19:
        return None
    frac_digits = len(str(unit_ns)) - 1  # 9 for seconds, 0 for nanoseconds
    whole = parts[1].astype("int64").to_numpy()
    frac = parts[2].fillna("").str.slice(0, frac_digits).str.pad(frac_digits, "right", "0")
    frac_ns = frac.replace("", "0").astype("int64").to_numpy() if frac_digits else 0
    sign = np.where((parts[0] == "-").to_numpy(), -1, 1)
    return sign * (whole * unit_ns + frac_ns)


def parse_timestamps(t: _Table, name: str, fmt: str, tz: str) -> np.ndarray:
    """A timestamp column → int64 ns since epoch UTC.

    ``fmt``: '' ISO-8601 (naive stamps are in ``tz``), 'unix_s'|'unix_ms'|'unix_us'|'unix_ns'
    (always UTC), or a strftime pattern (naive → ``tz``).
    """
    col = t.column(name, "timestamp")
    if pa.types.is_timestamp(col.type):
        idx = pd.DatetimeIndex(col.to_pandas())
        if idx.isna().any():
            raise DataError(f"{t.where(int(np.flatnonzero(idx.isna())[0]), name)}: "
                            "missing timestamp")
        return _localise(idx, tz, t, name)
    if fmt in _UNIX:
        v = _numeric(t, name, "timestamp")
        if not np.isfinite(v).all():
            raise DataError(f"{t.where(int(np.flatnonzero(~np.isfinite(v))[0]), name)}: "
                            "unparseable timestamp")
        out_of_range = ~((v * _UNIX[fmt] > _TS_MIN) & (v * _UNIX[fmt] < _TS_MAX))
        if out_of_range.any():
            i = int(np.flatnonzero(out_of_range)[0])
            raise DataError(f"{t.where(i, name)}: timestamp {v[i]:g} is out of range for "
                            f"{fmt} (years 1900–2200)")
        coarser = [u for u, n in _UNIX.items() if n > _UNIX[fmt]]
        if coarser and v.shape[0] and (np.abs(v * _UNIX[fmt]) < _YEAR_NS).all():
            raise DataError(f"{t.path}: every timestamp read as {fmt} falls within a year of "
                            f"1970-01-01 (first: {v[0]:g}), so they were written in a coarser "
                            f"unit; set data.timestamp_format to "
                            f"{' or '.join(repr(u) for u in coarser)}")
        raw = t.column(name, "timestamp")
        if pa.types.is_integer(raw.type):
            return raw.to_numpy(zero_copy_only=False).astype(np.int64) * _UNIX[fmt]
        exact = _decimal_text_ns(raw, _UNIX[fmt])
        return exact if exact is not None else np.round(v * _UNIX[fmt]).astype(np.int64)
    s = col.to_pandas().astype("string")
    try:
        parsed = pd.to_datetime(s, format=fmt or "ISO8601", errors="coerce")
    except (ValueError, TypeError):  # mixed UTC offsets, or a bad strftime pattern
        _refuse_naive_beside_offsets(s, t, name)
        try:
            parsed = pd.to_datetime(s, format=fmt or "ISO8601", errors="coerce", utc=True)
        except (ValueError, TypeError) as e:
            raise DataError(f"{t.path}: data.timestamp_format = {fmt!r}: {e}") from None
    idx = pd.DatetimeIndex(parsed)
    if idx.isna().any():
        i = int(np.flatnonzero(idx.isna())[0])
        val = s.iloc[i]
        shown = "missing" if pd.isna(val) else repr(str(val))
        want = f"format {fmt!r}" if fmt else "ISO-8601 (or set data.timestamp_format)"
        raise DataError(f"{t.where(i, name)}: unparseable timestamp {shown}; expected {want}")
    return _localise(idx, tz, t, name)


def _span(seconds: float) -> str:
    """90 → '90s', 300 → '5min', 86400 → '1d'."""
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= n and seconds % n == 0:
            return f"{seconds / n:g}{unit}"
    return f"{seconds:g}s"


def _order(ts: np.ndarray, path: Path, what: str) -> np.ndarray | None:
    """Permutation that sorts ``ts`` ascending (None if already sorted), with a warning."""
    if ts.shape[0] < 2:
        return None
    if (ts[1:] >= ts[:-1]).all():  # not np.diff: int64 differences can wrap
        return None
    if (ts[1:] <= ts[:-1]).all():
        warnings.warn(f"{path}: {what} are in descending time order; sorted ascending",
                      stacklevel=3)
        return np.arange(ts.shape[0] - 1, -1, -1)
    back = np.flatnonzero(ts[1:] < ts[:-1])
    warnings.warn(f"{path}: {what} are not in time order ({back.shape[0]} stamped before the "
                  f"row they follow, first: data row {int(back[0]) + 2}); sorted ascending "
                  "(stable)", stacklevel=3)
    return np.argsort(ts, kind="stable")


# --------------------------------------------------------------------------------------------
# loaders
# --------------------------------------------------------------------------------------------


def read_ticks(path: Path, cfg: DataConfig
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Ticks/trades table → validated, time-sorted ``(ts, price, size, side | None)``.
    Ticks may share a timestamp (several fills of one aggressor order)."""
    c = cfg.columns
    string_cols = (c.timestamp,) if cfg.timestamp_format not in _UNIX else ()
    t = read_table(path, cfg, string_cols + ((c.side,) if c.side else ()))
    ts = parse_timestamps(t, c.timestamp, cfg.timestamp_format, cfg.timezone)
    price = _prices(t, c.price, "price", cfg.price_scale)
    size = _sizes(t, c.size, "size")
    side = _sides(t, c.side) if c.side else None
    perm = _order(ts, path, "ticks")
    if perm is not None:
        ts, price, size = ts[perm], price[perm], size[perm]
        side = side[perm] if side is not None else None
    return ts, price, size, side


def load_ticks(path: Path, cfg: DataConfig) -> Bars:
    """Ticks/trades table → bars (time, volume or dollar)."""
    ts, price, size, side = read_ticks(path, cfg)
    bar_ns = parse_bar_size(cfg.bar_size) if cfg.bar_type == "time" else 0
    return ticks_to_bars(ts, price, size, side, bar_type=cfg.bar_type, bar_ns=bar_ns,
                         threshold=cfg.bar_threshold, source=str(path)).check()


def load_ohlcv(path: Path, cfg: DataConfig) -> Bars:
    """OHLCV bars table → Bars. ``data.bar_size`` states the bars' length; with
    ``timestamp_label = 'open'`` each stamp is moved to its close (stamp + bar length)."""
    c = cfg.columns
    if cfg.bar_type != "time":
        raise DataError(f"{path}: data.bar_type = {cfg.bar_type!r} needs tick or trade input; "
                        "OHLCV input is already time bars (use bar_type = 'time')")
    bar_ns = parse_bar_size(cfg.bar_size)
    string_cols = (c.timestamp,) if cfg.timestamp_format not in _UNIX else ()
    t = read_table(path, cfg, string_cols)
    ts = parse_timestamps(t, c.timestamp, cfg.timestamp_format, cfg.timezone)
    o = _prices(t, c.open, "open", cfg.price_scale)
    h = _prices(t, c.high, "high", cfg.price_scale)
    lo = _prices(t, c.low, "low", cfg.price_scale)
    cl = _prices(t, c.close, "close", cfg.price_scale)
    bad = ohlc_inconsistent(o, h, lo, cl)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise DataError(f"{t.where(i, c.high)}: high {h[i]:g} / low {lo[i]:g} do not bracket "
                        f"open {o[i]:g} and close {cl[i]:g}")
    vol = _sizes(t, c.volume, "volume")
    if c.buy_volume or c.sell_volume:
        if not (c.buy_volume and c.sell_volume):
            raise DataError(f"{path}: set both data.columns.buy_volume and sell_volume, or "
                            "neither")
        buy, sell = _sizes(t, c.buy_volume, "buy_volume"), _sizes(t, c.sell_volume,
                                                                   "sell_volume")
    else:
        buy = sell = np.full(ts.shape[0], np.nan)
    rows = np.arange(ts.shape[0])
    perm = _order(ts, path, "bars")
    if perm is not None:
        ts, o, h, lo, cl, vol, buy, sell, rows = (a[perm] for a in
                                                  (ts, o, h, lo, cl, vol, buy, sell, rows))
    dup = np.flatnonzero(np.diff(ts) == 0)
    if dup.shape[0]:
        i, j = sorted((int(rows[dup[0]]), int(rows[dup[0] + 1])))
        stamp = pd.Timestamp(ts[dup[0]], tz="UTC").isoformat()
        raise DataError(f"{t.where(j, c.timestamp)}: duplicate timestamp {stamp} (also row "
                        f"{i + 1}); OHLCV bars need unique timestamps")
    gaps = session_gaps(ts)
    if gaps.shape[0] and not 0.5 <= np.median(gaps) * NS / bar_ns <= 2.0:
        raise DataError(f"{path}: the bars are {_span(float(np.median(gaps)))} apart (median "
                        f"within sessions), but data.bar_size = {cfg.bar_size!r}; set "
                        "data.bar_size to the bars' length (1s … 1d)")
    if cfg.timestamp_label == "open":
        ts = ts + bar_ns
    return Bars(ts=ts, start_ts=ts - bar_ns, open=o, high=h, low=lo, close=cl, volume=vol,
                buy_volume=buy, sell_volume=sell, n_trades=np.zeros(ts.shape[0], np.int64),
                bar_seconds=bar_ns / NS, source=str(path)).check()
