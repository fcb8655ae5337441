"""Databento DBN files (MBP-10, trades, OHLCV; plain or zstd) → Bars.

Records are read as numpy structured arrays (the DBN record layout, little-endian), so nothing
loops over records in Python. ``databento_dbn`` reads the metadata (schema, version) and
decompresses zstd input: its decoder yields record objects whose ``bytes()`` are the raw
records, joined once into one buffer. A plain file of one record type is sliced directly.

Times: trades and book updates are stamped with ``ts_recv`` (when the data was known; Databento's
index time), OHLCV records with ``ts_event`` = the *open* of the interval, so a bar closes at
``ts_event + length``. Prices are fixed-point integers, 1 unit = 1e-9.

Checks beyond the trade/tick ones: OHLCV high/low must bracket open and close (as for tables);
an MBP-10 book price ≤ 0 on any level is refused; a crossed or locked top of book (bid ≥ ask)
is kept with a warning, since real books cross during pre-open and auctions.
"""

from __future__ import annotations

import os
import struct
import sys
import tempfile
import warnings
from pathlib import Path

import databento_dbn as dbn
import numpy as np

from jdqn.config import DataConfig
from jdqn.data.bars import (
    NS,
    Bars,
    attach_book,
    check_ticks,
    events_to_bars,
    ohlc_inconsistent,
    parse_bar_size,
    trade_signs,
)
from jdqn.errors import DataError

UNDEF_PRICE = np.iinfo(np.int64).max
TS_MAX = 7_258_118_400 * NS  # 2200-01-01 UTC: later stamps (or UNDEF_TIMESTAMP) are refused
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

_HEADER = [("length", "u1"), ("rtype", "u1"), ("publisher_id", "<u2"),
           ("instrument_id", "<u4"), ("ts_event", "<u8")]
_TRADE = _HEADER + [("price", "<i8"), ("size", "<u4"), ("action", "S1"), ("side", "S1"),
                    ("flags", "u1"), ("depth", "u1"), ("ts_recv", "<u8"),
                    ("ts_in_delta", "<i4"), ("sequence", "<u4")]
_LEVEL = [("bid_px", "<i8"), ("ask_px", "<i8"), ("bid_sz", "<u4"), ("ask_sz", "<u4"),
          ("bid_ct", "<u4"), ("ask_ct", "<u4")]
TRADE_DTYPE = np.dtype(_TRADE)  # 48 bytes
MBP10_DTYPE = np.dtype(_TRADE + [("levels", np.dtype(_LEVEL), (10,))])  # 368 bytes
OHLCV_DTYPE = np.dtype(_HEADER + [("open", "<i8"), ("high", "<i8"), ("low", "<i8"),
                                  ("close", "<i8"), ("volume", "<u8")])  # 56 bytes
assert TRADE_DTYPE.itemsize == 48 and MBP10_DTYPE.itemsize == 368 and OHLCV_DTYPE.itemsize == 56

_OHLCV_SECONDS = {32: 1, 33: 60, 34: 3600, 35: 86400}  # rtype → interval (1s, 1m, 1h, 1d)
_SCHEMAS = {"mbp-10": (MBP10_DTYPE, (10,)), "trades": (TRADE_DTYPE, (0,)),
            "ohlcv-1s": (OHLCV_DTYPE, (32,)), "ohlcv-1m": (OHLCV_DTYPE, (33,)),
            "ohlcv-1h": (OHLCV_DTYPE, (34,)), "ohlcv-1d": (OHLCV_DTYPE, (35,))}
_RECORD_CLASS = {"mbp-10": "MBP10Msg", "trades": "TradeMsg"}


def _schema_name(meta: object, path: Path) -> str:
    schema = getattr(meta, "schema", None)
    name = str(getattr(schema, "value", schema) or "").lower()
    if name not in _SCHEMAS:
        raise DataError(f"{path}: DBN schema {name or 'unknown'!r} is not supported; use "
                        "mbp-10, trades or ohlcv-1s/1m/1h/1d")
    return name


def _without_panic_noise(fn):
    """``fn()`` with the process's file descriptor 2 captured: passed on if it returns,
    dropped if it panics (Rust's panic hook writes its message, and with ``RUST_BACKTRACE`` a
    backtrace, to descriptor 2, whatever ``sys.stderr`` is, before the exception reaches
    Python; the error the user sees is our one line)."""
    fd = 2
    try:
        sys.stderr.flush()
        saved = os.dup(fd)
    except OSError:  # no descriptor 2: nothing to hide
        return fn()
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), fd)
        panicked = False
        try:
            return fn()
        except BaseException as e:
            panicked = type(e).__name__ == "PanicException"
            raise
        finally:
            os.dup2(saved, fd)
            os.close(saved)
            if not panicked:
                tmp.seek(0)
                noise = tmp.read()
                if noise:
                    os.write(fd, noise)


def _decode_all(dec: dbn.DBNDecoder, path: Path) -> list:
    """All records of a decoder that was given the whole input; a truncated input is an error,
    and so is one the decoder cannot read (it reports some malformed records, e.g. one shorter
    than its header says, by a Rust panic rather than a ``DBNError``)."""
    try:
        recs = _without_panic_noise(dec.decode)
    except BaseException as e:  # pyo3's PanicException derives from BaseException
        if type(e).__name__ != "PanicException":
            raise
        raise DataError(f"{path}: cannot decode DBN: {str(e).splitlines()[0]}") from None
    if not recs or not isinstance(recs[0], dbn.Metadata):
        raise DataError(f"{path}: truncated or corrupt DBN data (no metadata header decoded)")
    if len(dec.buffer()):
        raise DataError(f"{path}: truncated DBN data: {len(dec.buffer())} bytes after record "
                        f"{len(recs) - 1} do not form a whole record")
    return recs


def _zstd_truncation(raw: bytes) -> str | None:
    """Where a zstd stream ends early, or None when it is whole frames: the frames are walked
    by their headers and block sizes, nothing decompressed (RFC 8878 §3.1). The decoder of
    ``databento_dbn`` returns whatever whole records it decoded from a stream cut at a block
    boundary, so a truncated ``.dbn.zst`` would otherwise load as a shorter dataset."""
    pos, n = 0, len(raw)
    while pos < n:
        if n - pos < 4:
            return f"{n - pos} stray bytes after the last frame"
        magic = int.from_bytes(raw[pos:pos + 4], "little")
        if 0x184D2A50 <= magic <= 0x184D2A5F:  # a skippable frame: magic, size, data
            if n - pos < 8:
                return f"a skippable frame's header cut at byte {n}"
            pos += 8 + int.from_bytes(raw[pos + 4:pos + 8], "little")
            if pos > n:
                return f"a skippable frame cut at byte {n}"
            continue
        if magic != 0xFD2FB528:
            return f"no zstd frame at byte {pos}"
        if n - pos < 5:
            return f"a frame header cut at byte {n}"
        fhd = raw[pos + 4]
        single, checksum = (fhd >> 5) & 1, (fhd >> 2) & 1
        fcs = (0 if not single else 1, 2, 4, 8)[fhd >> 6]
        header = 1 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3] + fcs
        pos += 4 + header
        while True:  # blocks: a 3-byte header (last flag, type, size), then the block's bytes
            if pos + 3 > n:
                return f"a frame cut at byte {n} (inside a block header, before its last block)"
            bh = int.from_bytes(raw[pos:pos + 3], "little")
            last, kind, size = bh & 1, (bh >> 1) & 3, bh >> 3
            pos += 3 + (1 if kind == 1 else size)  # an RLE block stores one byte
            if pos > n:
                return f"a frame cut at byte {n} (inside a block, before its last block)"
            if last:
                break
        pos += 4 * checksum
        if pos > n:
            return f"a frame's checksum cut at byte {n}"
    return None


def read_dbn(path: Path) -> tuple[str, np.ndarray]:
    """Read a DBN file → (schema name, structured record array of that schema)."""
    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    raw = path.read_bytes()
    if not raw:
        raise DataError(f"{path}: empty file (0 bytes)")
    try:
        if raw[:4] == _ZSTD_MAGIC:
            cut = _zstd_truncation(raw)
            if cut:
                raise DataError(f"{path}: truncated or corrupt zstd data ({cut}); the file "
                                "is not whole — download or copy it again")
            dec = dbn.DBNDecoder(compression=dbn.Compression.ZSTD)
            try:
                dec.write(raw)
            except RuntimeError as e:  # zstd's own errors: "Data corruption detected", …
                raise DataError(f"{path}: cannot decompress zstd data: {e}") from None
            recs = _decode_all(dec, path)
            schema = _schema_name(recs[0], path)
            return schema, _walked(recs, schema, bool(getattr(recs[0], "ts_out", False)), path)
        if raw[:3] != b"DBN" or len(raw) < 8:
            raise DataError(f"{path}: not a DBN file (no 'DBN' header, not zstd)")
        off = 8 + struct.unpack("<I", raw[4:8])[0]
        dec = dbn.DBNDecoder()
        dec.write(raw[:off])
        meta = _decode_all(dec, path)[0]
    except dbn.DBNError as e:
        raise DataError(f"{path}: cannot decode DBN: {e}") from None
    schema = _schema_name(meta, path)
    dtype, rtypes = _SCHEMAS[schema]
    ts_out = bool(getattr(meta, "ts_out", False))
    size = _record_size(dtype, ts_out)
    body = raw[off:]
    if body and len(body) % size == 0:
        rec = np.frombuffer(body, dtype=_padded(dtype, size))
        if (rec["length"].astype(np.int64) * 4 == size).all() and \
                np.isin(rec["rtype"], rtypes).all():
            return schema, _without_ts_out(rec, dtype) if ts_out else rec
    # mixed record types or sizes (e.g. symbol mappings in a live stream): let databento_dbn
    # walk the records, keep those of the schema
    dec = dbn.DBNDecoder()
    dec.write(raw)
    try:
        recs = _decode_all(dec, path)
    except dbn.DBNError as e:
        raise DataError(f"{path}: cannot decode DBN: {e}") from None
    return schema, _walked(recs, schema, ts_out, path)


# A file written with ``ts_out`` (a live gateway's send time, ``Metadata.ts_out``) carries 8
# more bytes after every record; its ``length`` field counts them.
_TS_OUT_BYTES = 8


def _record_size(dtype: np.dtype, ts_out: bool) -> int:
    """Bytes per record of ``dtype`` in a file written with or without ``ts_out``."""
    return dtype.itemsize + (_TS_OUT_BYTES if ts_out else 0)


def _padded(dtype: np.dtype, size: int) -> np.dtype:
    """``dtype``'s fields at their offsets in records of ``size`` bytes (the rest skipped)."""
    if size == dtype.itemsize:
        return dtype
    names = list(dtype.names)
    return np.dtype({"names": names, "formats": [dtype.fields[n][0] for n in names],
                     "offsets": [dtype.fields[n][1] for n in names], "itemsize": size})


def _walked(recs: list, schema: str, ts_out: bool, path: Path) -> np.ndarray:
    """The decoded records of ``schema``'s record type as its structured array, each record's
    ``ts_out`` suffix dropped; a record of another size is an error, not a misread."""
    dtype, rtypes = _SCHEMAS[schema]
    size = _record_size(dtype, ts_out)
    parts = []
    for i, r in enumerate(recs[1:]):
        if int(getattr(r, "rtype", -1)) not in rtypes:
            continue
        b = bytes(r)
        if len(b) != size:
            raise DataError(f"{path}: DBN record {i} ({type(r).__name__}) is {len(b)} bytes; "
                            f"{schema} records are {size} bytes"
                            + (" with ts_out" if ts_out else ""))
        parts.append(b[:dtype.itemsize])
    rec = np.frombuffer(b"".join(parts), dtype=dtype)
    return _without_ts_out(rec, dtype) if ts_out else rec


def _without_ts_out(rec: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The records in ``dtype``'s own layout, their ``length`` fields saying so."""
    out = rec.astype(dtype)  # a copy: the fields only
    out["length"] = dtype.itemsize // 4
    return out


def _one_instrument(rec: np.ndarray, cfg: DataConfig, path: Path) -> np.ndarray:
    ids = np.unique(rec["instrument_id"])
    if cfg.instrument_id:
        if cfg.instrument_id not in ids:
            raise DataError(f"{path}: data.instrument_id = {cfg.instrument_id} not in the file "
                            f"(instruments: {', '.join(map(str, ids[:20]))})")
        return rec[rec["instrument_id"] == cfg.instrument_id]
    if ids.shape[0] > 1:
        raise DataError(f"{path}: {ids.shape[0]} instruments in the file "
                        f"({', '.join(map(str, ids[:20]))}); set data.instrument_id to one")
    return rec


def _prices(px: np.ndarray, scale: float, path: Path, field: str) -> np.ndarray:
    bad = (px == UNDEF_PRICE) | (px <= 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        what = "undefined price" if px[i] == UNDEF_PRICE else f"non-positive price {px[i]}"
        raise DataError(f"{path}: record {i + 1}, field '{field}': {what}")
    # divide by the exact 1e9 (correctly rounded: 3720250000000 → 3720.25, the same double as
    # parsing "3720.25"); multiplying by 1e-9 would give 3720.2500000000005
    out = px.astype(np.float64) / 1e9
    return out * scale if scale != 1.0 else out


def _trade_sides(side: np.ndarray) -> np.ndarray:
    """Databento side of a trade = the aggressor: 'B' buy, 'A' sell, 'N' none (→ tick rule)."""
    return np.where(side == b"B", 1, np.where(side == b"A", -1, 0)).astype(np.int8)


def _check_book(lv: np.ndarray, path: Path) -> None:
    """MBP-10 levels ``[N, 10]``: a non-positive price on any level is an error. A crossed or
    locked top of book (bid ≥ ask at level 0) is kept with a warning: it is the real book during
    pre-open and auctions, when orders rest without matching. Empty levels carry UNDEF_PRICE."""
    for field in ("bid_px", "ask_px"):
        bad = np.argwhere(lv[field] <= 0)
        if bad.shape[0]:
            i, m = (int(x) for x in bad[0])
            raise DataError(f"{path}: record {i + 1}, field '{field}' (level {m}): non-positive "
                            f"price {lv[field][i, m] / 1e9:g}")
    bid, ask = lv["bid_px"][:, 0], lv["ask_px"][:, 0]
    crossed = np.flatnonzero((bid >= ask) & (bid != UNDEF_PRICE) & (ask != UNDEF_PRICE))
    if crossed.shape[0]:
        warnings.warn(f"{path}: {crossed.shape[0]} of {bid.shape[0]} records have a crossed or "
                      f"locked book (level-0 bid ≥ ask; first: record {crossed[0] + 1}); kept, "
                      "as in pre-open auctions", stacklevel=3)


def _sorted_by(rec: np.ndarray, key: str, path: Path, of: str = "") -> np.ndarray:
    """The records in ``key`` order (stable), with a warning naming the first record stamped
    before its predecessor: a DBN file is written in time order, so one out of it is a damaged
    or hand-edited stamp that the sort moves (a year-late trade becomes a bar a year later)."""
    ts = rec[key]
    back = np.flatnonzero(ts[1:] < ts[:-1])  # not np.diff: differences can wrap
    if back.shape[0]:
        i = int(back[0]) + 1
        warnings.warn(f"{path}: {back.shape[0]} record(s) stamped before the record they follow "
                      f"(first: record {i + 1}{of}, field '{key}' {int(ts[i])} < "
                      f"{int(ts[i - 1])} of record {i}); sorted by time — check the file if it "
                      "came from a feed "
                      "that writes in order", stacklevel=3)
        return rec[np.argsort(ts, kind="stable")]
    return rec


def load_dbn(path: Path, cfg: DataConfig) -> Bars:
    """DBN → Bars. MBP-10: trades are the records with action 'T' (aggressor side from the
    record), every record is a book update for OFI. Trades: as ticks. OHLCV: bars as they are."""
    schema, rec = read_dbn(path)
    if rec.shape[0] == 0:
        raise DataError(f"{path}: no {schema} records in the file")
    key = "ts_event" if schema.startswith("ohlcv") else "ts_recv"
    late = np.flatnonzero(rec[key] >= TS_MAX)  # uint64: int64 would wrap them negative
    if late.shape[0]:
        i = int(late[0])
        raise DataError(f"{path}: record {i + 1}, field '{key}': timestamp {rec[key][i]} is "
                        "undefined or out of range (after 2200-01-01)")
    rec = _one_instrument(rec, cfg, path)
    # record numbers count the chosen instrument's records when the file holds several
    of = f" of instrument {cfg.instrument_id}" if cfg.instrument_id else ""
    src = str(path)
    if schema.startswith("ohlcv"):
        if cfg.bar_type != "time":
            raise DataError(f"{path}: data.bar_type = {cfg.bar_type!r} needs trades or MBP-10; "
                            f"{schema} is already time bars")
        rec = _sorted_by(rec, "ts_event", path, of)
        secs = _OHLCV_SECONDS[int(rec["rtype"][0])]
        ts = rec["ts_event"].astype(np.int64) + secs * NS
        if (np.diff(ts) == 0).any():
            i = int(np.flatnonzero(np.diff(ts) == 0)[0]) + 1
            raise DataError(f"{path}: record {i + 1}, field 'ts_event': duplicate bar time")
        o, h, lo, c = (_prices(rec[k], cfg.price_scale, path, k)
                       for k in ("open", "high", "low", "close"))
        bad = np.flatnonzero(ohlc_inconsistent(o, h, lo, c))
        if bad.shape[0]:
            i = int(bad[0])
            raise DataError(f"{path}: record {i + 1}, field 'high': high {h[i]:g} / low {lo[i]:g} "
                            f"do not bracket open {o[i]:g} and close {c[i]:g}")
        vol = rec["volume"].astype(np.float64)
        nan = np.full(ts.shape[0], np.nan)
        return Bars(ts=ts, start_ts=ts - secs * NS, open=o, high=h, low=lo, close=c,
                    volume=vol, buy_volume=nan, sell_volume=nan.copy(),
                    n_trades=np.zeros(ts.shape[0], np.int64), bar_seconds=float(secs),
                    source=src).check()
    if schema == "mbp-10":
        _check_book(rec["levels"], path)
    rec = _sorted_by(rec, "ts_recv", path, of)
    bar_ns = parse_bar_size(cfg.bar_size) if cfg.bar_type == "time" else 0
    trades = rec[rec["action"] == b"T"] if schema == "mbp-10" else rec
    if trades.shape[0] == 0:
        raise DataError(f"{path}: no trade records (action 'T'), so no bars can be built")
    ts = trades["ts_recv"].astype(np.int64)
    price = _prices(trades["price"], cfg.price_scale, path, "price")
    size = trades["size"].astype(np.float64)
    check_ticks(ts, price, size, src)
    sign = trade_signs(price, _trade_sides(trades["side"]))
    bars = events_to_bars(ts, price, size, sign, bar_type=cfg.bar_type, bar_ns=bar_ns,
                          threshold=cfg.bar_threshold, source=src)
    if schema == "mbp-10":
        lv = rec["levels"]
        bid_px = np.where(lv["bid_px"] == UNDEF_PRICE, np.iinfo(np.int64).min, lv["bid_px"])
        ask_px = lv["ask_px"]  # undefined ask = int64 max, already 'above everything'
        bars = attach_book(bars, rec["ts_recv"].astype(np.int64), bid_px, lv["bid_sz"],
                           ask_px, lv["ask_sz"])
    return bars.check()
