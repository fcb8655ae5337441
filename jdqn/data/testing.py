"""Random raw inputs and writers for tests (and anyone who needs a realistic small input).

Each generator returns plain numpy columns (a ``dict``) that the writers turn into the file
formats ``load_bars`` reads: tick CSV/Parquet, OHLCV CSV, and Databento DBN (MBP-10, trades,
OHLCV-1m; plain or zstd) written with ``databento_dbn`` itself.
"""

from __future__ import annotations

import io
import struct
from pathlib import Path

import databento_dbn as dbn
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from jdqn.data.bars import NS

T0 = 1_700_000_000 * NS  # 2023-11-14T22:13:20Z
TICK = 0.25


def random_ticks(rng: np.random.Generator, n: int, seconds: float, t0: int = T0,
                 with_side: bool = True) -> dict[str, np.ndarray]:
    """n ticks over ``seconds`` (clustered arrivals, some sharing a timestamp)."""
    gaps = rng.exponential(1.0, n) * (rng.random(n) < 0.8)  # 20% share the previous stamp
    ts = t0 + np.round(np.cumsum(gaps) / max(gaps.sum(), 1e-9) * seconds * NS).astype(np.int64)
    ts = ts // 1_000_000 * 1_000_000  # millisecond stamps, as in real tick files
    price = 4000.0 + TICK * np.cumsum(rng.integers(-1, 2, n))
    out = {"ts": ts, "price": price, "size": rng.integers(1, 20, n).astype(np.float64)}
    if with_side:
        out["side"] = rng.choice(np.array(["B", "A", "N"]), n, p=[0.45, 0.45, 0.1])
    return out


def perturb_after(raw: dict[str, np.ndarray], cutoff: int, rng: np.random.Generator,
                  ts_key: str = "ts", drop: float = 0.2) -> dict[str, np.ndarray]:
    """Change every event with ``ts > cutoff``: drop a share of them, re-time the rest (still
    after ``cutoff``, still sorted; OHLCV bars keep their spacing) and scramble every other
    column (prices stay positive and on the tick grid; book levels stay ordered)."""
    ts = raw[ts_key]
    fut = ts > cutoff
    keep = ~fut | (rng.random(ts.shape[0]) >= drop)
    out = {k: v[keep].copy() for k, v in raw.items()}
    fut = out[ts_key] > cutoff
    m = int(fut.sum())
    if m == 0:
        return out
    if "open" in out:  # OHLCV: move the future bars later, keeping their spacing (bar length)
        out[ts_key][fut] += (out[ts_key][fut][0] - cutoff) * int(rng.integers(1, 4))
    else:  # stretch the future away from the cutoff: strictly after it, order (and ties) kept
        out[ts_key][fut] = cutoff + (out[ts_key][fut] - cutoff) * int(rng.integers(2, 4))
    for k, v in out.items():
        if k == ts_key:
            continue
        if k in ("price", "open", "high", "low", "close", "bid_px", "ask_px"):
            continue
        if v.dtype.kind == "f" and v.ndim == 1:
            v[fut] = rng.integers(1, 50, m).astype(np.float64)
        elif v.dtype.kind in "iu" and v.ndim == 1:
            v[fut] = rng.integers(1, 50, m).astype(v.dtype)
        elif v.dtype.kind in "iu" and v.ndim == 2:
            v[fut] = rng.integers(1, 50, (m, v.shape[1])).astype(v.dtype)
        elif v.dtype.kind in "US":
            v[fut] = rng.choice(np.unique(v), m)
    shift = TICK * rng.integers(-8, 9, m)
    if "price" in out:
        out["price"][fut] = np.maximum(out["price"][fut] + shift, TICK)
    if "open" in out:  # OHLCV: move the whole bar, keep it consistent
        for k in ("open", "high", "low", "close"):
            out[k][fut] = np.maximum(out[k][fut] + shift, TICK)
        out["high"][fut] += TICK * rng.integers(0, 3, m)
    if "bid_px" in out:  # book: move the whole ladder
        for k in ("bid_px", "ask_px"):
            out[k][fut] = out[k][fut] + (shift * 1e9).astype(np.int64)[:, None]
    if "buy_volume" in out and "volume" in out:  # OHLCV aggressor volumes: parts of the new volume
        out["buy_volume"][fut] = np.floor(out["volume"][fut] * rng.uniform(0, 1, m))
        out["sell_volume"][fut] = out["volume"][fut] - out["buy_volume"][fut]
    return out


# --------------------------------------------------------------------------------------------
# tables
# --------------------------------------------------------------------------------------------


def _iso(ts: np.ndarray) -> np.ndarray:
    return pd.DatetimeIndex(ts.astype("datetime64[ns]")).strftime("%Y-%m-%d %H:%M:%S.%f") \
        .to_numpy()


def write_ticks_csv(raw: dict[str, np.ndarray], path: Path) -> Path:
    df = pd.DataFrame({"timestamp": _iso(raw["ts"]), "price": raw["price"], "size": raw["size"]})
    if "side" in raw:
        df["side"] = raw["side"]
    df.to_csv(path, index=False)
    return path


def write_ticks_parquet(raw: dict[str, np.ndarray], path: Path) -> Path:
    cols = {"timestamp": pa.array(raw["ts"].astype("datetime64[ns]")),
            "price": raw["price"], "size": raw["size"]}
    if "side" in raw:
        cols["side"] = raw["side"]
    pq.write_table(pa.table(cols), path)
    return path


def random_ohlcv(rng: np.random.Generator, n: int, bar_s: int = 60,
                 t0: int = T0, flow: bool = False) -> dict[str, np.ndarray]:
    """n OHLCV bars with gaps (about 10% of grid slots missing); ``ts`` = bar close. ``flow``:
    with aggressor ``buy_volume`` and ``sell_volume`` columns, parts of each bar's volume."""
    slots = np.flatnonzero(rng.random(int(n * 1.2) + 10) < 0.9)[:n] + 1
    ts = t0 + slots.astype(np.int64) * bar_s * NS
    close = 4000.0 + TICK * np.cumsum(rng.integers(-4, 5, n))
    open_ = np.concatenate([[4000.0], close[:-1]])
    high = np.maximum(open_, close) + TICK * rng.integers(0, 4, n)
    low = np.minimum(open_, close) - TICK * rng.integers(0, 4, n)
    vol = rng.integers(1, 500, n).astype(np.float64)
    out = {"ts": ts, "open": open_, "high": high, "low": low, "close": close, "volume": vol}
    if flow:
        out["buy_volume"] = np.floor(vol * rng.uniform(0, 1, n))
        out["sell_volume"] = np.floor((vol - out["buy_volume"]) * rng.uniform(0, 1, n))
    return out


def write_ohlcv_csv(raw: dict[str, np.ndarray], path: Path) -> Path:
    df = pd.DataFrame({"timestamp": _iso(raw["ts"])})
    for k in ("open", "high", "low", "close", "volume", "buy_volume", "sell_volume"):
        if k in raw:
            df[k] = raw[k]
    df.to_csv(path, index=False)
    return path


# --------------------------------------------------------------------------------------------
# DBN
# --------------------------------------------------------------------------------------------


def _px(x: float | np.ndarray) -> np.ndarray:
    return np.round(np.asarray(x, np.float64) * 1e9).astype(np.int64)


def encode_dbn(schema: dbn.Schema, records: list, compress: bool = False,
               ts_out: bool = False) -> bytes:
    """Metadata + records → DBN bytes (zstd through ``databento_dbn.Transcoder``). ``ts_out``:
    as a live gateway writes them, each record followed by an 8-byte send time (its ``length``
    field counting those bytes)."""
    meta = dbn.Metadata(dataset="GLBX.MDP3", start=0, stype_in=dbn.SType.INSTRUMENT_ID,
                        stype_out=dbn.SType.INSTRUMENT_ID, schema=schema, ts_out=ts_out)

    def encoded(r) -> bytes:
        b = bytes(r)
        if not ts_out:
            return b
        ts_recv = int(getattr(r, "ts_recv", 0) or getattr(r, "ts_event", 0))
        return bytes([b[0] + 2]) + b[1:] + struct.pack("<Q", ts_recv + 1_000)

    plain = meta.encode() + b"".join(encoded(r) for r in records)
    if not compress:
        return plain
    buf = io.BytesIO()
    tr = dbn.Transcoder(buf, dbn.Encoding.DBN, dbn.Compression.ZSTD)
    tr.write(plain)
    tr.finish()  # ends the zstd frame (flush alone leaves it open: a truncated stream)
    return buf.getvalue()


_ACTIONS = {"T": dbn.Action.TRADE, "A": dbn.Action.ADD, "C": dbn.Action.CANCEL,
            "M": dbn.Action.MODIFY, "F": dbn.Action.FILL}
_SIDES = {"B": dbn.Side.BID, "A": dbn.Side.ASK, "N": dbn.Side.NONE}


def random_mbp10(rng: np.random.Generator, n: int, seconds: float, t0: int = T0,
                 trade_share: float = 0.3) -> dict[str, np.ndarray]:
    """n MBP-10 events: a 10-level book around a random-walk mid; ``trade_share`` are trades."""
    ts = t0 + np.sort(rng.integers(0, int(seconds * NS), n)).astype(np.int64)
    ts = ts // 1_000 * 1_000
    mid_ticks = 16000 + np.cumsum(rng.integers(-1, 2, n) * (rng.random(n) < 0.3))
    lv = np.arange(10)
    bid_px = _px((mid_ticks[:, None] - 1 - lv) * TICK)
    ask_px = _px((mid_ticks[:, None] + 1 + lv) * TICK)
    action = np.where(rng.random(n) < trade_share, "T", rng.choice(np.array(["A", "C", "M"]), n))
    side = rng.choice(np.array(["B", "A", "N"]), n, p=[0.45, 0.45, 0.1])
    is_buy = side == "B"
    price = np.where(is_buy, ask_px[:, 0], bid_px[:, 0]).astype(np.float64) / 1e9
    return {"ts": ts, "action": action, "side": side, "price": price,
            "size": rng.integers(1, 30, n).astype(np.int64), "bid_px": bid_px, "ask_px": ask_px,
            "bid_sz": rng.integers(1, 200, (n, 10)).astype(np.int64),
            "ask_sz": rng.integers(1, 200, (n, 10)).astype(np.int64)}


def _event_times(ts: np.ndarray) -> np.ndarray:
    """``ts_event`` for records *received* at ``ts`` (``ts_recv``): 0–2 s earlier, varying by
    record. Real feeds stamp the event before its receipt; making the two differ lets the
    lookahead tests tell a reader that bins by ``ts_recv`` (when the data was known) from one
    that bins by ``ts_event`` (which would put late-arriving records into bars that had already
    closed)."""
    lag = (np.arange(ts.shape[0], dtype=np.int64) * 7919 % 2000) * (NS // 1000)  # 0–1.999 s
    return np.maximum(ts.astype(np.int64) - lag, 0)


def mbp10_records(raw: dict[str, np.ndarray], instrument_id: int = 1) -> list:
    recs = []
    px = _px(raw["price"])
    events = _event_times(raw["ts"])
    for i in range(raw["ts"].shape[0]):
        levels = [dbn.BidAskPair(bid_px=int(raw["bid_px"][i, m]), ask_px=int(raw["ask_px"][i, m]),
                                 bid_sz=int(raw["bid_sz"][i, m]), ask_sz=int(raw["ask_sz"][i, m]))
                  for m in range(10)]
        t = int(raw["ts"][i])
        recs.append(dbn.MBP10Msg(publisher_id=1, instrument_id=instrument_id,
                                 ts_event=int(events[i]),
                                 price=int(px[i]), size=int(raw["size"][i]),
                                 action=_ACTIONS[str(raw["action"][i])],
                                 side=_SIDES[str(raw["side"][i])], depth=0, ts_recv=t, flags=0,
                                 levels=levels))
    return recs


def trade_records(raw: dict[str, np.ndarray], instrument_id: int = 1) -> list:
    px = _px(raw["price"])
    side = raw.get("side", np.full(raw["ts"].shape[0], "N"))
    return [dbn.TradeMsg(publisher_id=1, instrument_id=instrument_id, ts_event=int(e),
                         price=int(p), size=int(s), action=dbn.Action.TRADE,
                         side=_SIDES[str(sd)], depth=0, ts_recv=int(t))
            for t, e, p, s, sd in zip(raw["ts"], _event_times(raw["ts"]), px, raw["size"], side,
                                      strict=True)]


def ohlcv_records(raw: dict[str, np.ndarray], instrument_id: int = 1) -> list:
    """OHLCV-1m records; DBN stamps a bar with its *open* (= our close − 60 s)."""
    cols = [_px(raw[k]) for k in ("open", "high", "low", "close")]
    return [dbn.OHLCVMsg(rtype=dbn.RType.OHLCV_1M, publisher_id=1, instrument_id=instrument_id,
                         ts_event=int(raw["ts"][i] - 60 * NS), open=int(cols[0][i]),
                         high=int(cols[1][i]), low=int(cols[2][i]), close=int(cols[3][i]),
                         volume=int(raw["volume"][i]))
            for i in range(raw["ts"].shape[0])]


def write_dbn(path: Path, schema: str, raw: dict[str, np.ndarray], compress: bool = False,
              ts_out: bool = False) -> Path:
    make = {"mbp-10": (dbn.Schema.MBP_10, mbp10_records),
            "trades": (dbn.Schema.TRADES, trade_records),
            "ohlcv-1m": (dbn.Schema.OHLCV_1M, ohlcv_records)}[schema]
    path.write_bytes(encode_dbn(make[0], make[1](raw), compress, ts_out))
    return path
