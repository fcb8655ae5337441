"""Databento DBN: records written with databento_dbn → bars and OFI equal to a hand computation;
a larger multi-bar stream against an independent per-event reference; the real sample files."""

from __future__ import annotations

from pathlib import Path

import databento_dbn as dbn
import numpy as np
import pytest

from jdqn.config import DataConfig
from jdqn.data import load_bars
from jdqn.data import testing as tk
from jdqn.data.bars import NS
from jdqn.data.dbn import read_dbn
from jdqn.errors import DataError

DBN_DIR = Path(__file__).parents[1].parent / "shared" / "data" / "dbn"
needs_dbn_dir = pytest.mark.skipif(not DBN_DIR.is_dir(),
                                  reason=f"shared DBN files not at {DBN_DIR}")
T0 = tk.T0  # a whole second


def _book(bid0: tuple[float, int], ask0: tuple[float, int]) -> dict[str, np.ndarray]:
    """A 10-level book: level 0 as given, levels 1..9 fixed (bid 99.75−…, ask 100.75+…)."""
    lv = np.arange(1, 10)
    return {"bid_px": np.concatenate([[bid0[0]], 100.0 - 0.25 * lv]),
            "bid_sz": np.concatenate([[bid0[1]], 5 + lv]),
            "ask_px": np.concatenate([[ask0[0]], 100.5 + 0.25 * lv]),
            "ask_sz": np.concatenate([[ask0[1]], 7 + lv])}


# (time s, action, side, price, size, level-0 bid (px, sz), level-0 ask (px, sz)) — the book
# columns are the book *after* the event, as in MBP-10.
HAND = [
    (0.2, "A", "B", 100.00, 10, (100.00, 10), (100.25, 20)),  # first event: e = 0
    (0.5, "T", "B", 100.25, 5, (100.00, 10), (100.25, 20)),  # buy trade, book unchanged: 0
    (0.6, "C", "A", 100.25, 5, (100.00, 10), (100.25, 15)),  # ask size −5: e = +5
    (1.0, "A", "B", 100.00, 2, (100.00, 12), (100.25, 15)),  # bid +2 exactly at close: +2
    (1.0 + 1e-9, "C", "A", 100.25, 15, (100.00, 12), (100.50, 8)),  # ask level up: +15
    (1.5, "T", "A", 100.00, 2, (100.00, 12), (100.50, 8)),  # sell trade: 0
    (1.7, "C", "B", 100.00, 12, (99.75, 30), (100.50, 8)),  # bid level down: −12
]


def _hand_raw() -> dict[str, np.ndarray]:
    books = [_book(b, a) for *_, b, a in HAND]
    px = {k: np.stack([bk[k] for bk in books]) for k in books[0]}
    # the fixed deeper levels: same price on the bid side at level 1 as level 0 after the move is
    # harmless for OFI (each level is compared with itself)
    return {"ts": T0 + np.array([round(e[0] * NS) for e in HAND], np.int64),
            "action": np.array([e[1] for e in HAND]), "side": np.array([e[2] for e in HAND]),
            "price": np.array([e[3] for e in HAND]), "size": np.array([e[4] for e in HAND]),
            "bid_px": tk._px(px["bid_px"]), "ask_px": tk._px(px["ask_px"]),
            "bid_sz": px["bid_sz"].astype(np.int64), "ask_sz": px["ask_sz"].astype(np.int64)}


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "zstd"])
def test_mbp10_round_trip_matches_hand_computation(tmp_path: Path, compress: bool) -> None:
    path = tk.write_dbn(tmp_path / "hand.dbn", "mbp-10", _hand_raw(), compress=compress)
    b = load_bars(DataConfig(source="dbn", path=str(path), bar_size="1s"))
    np.testing.assert_array_equal(b.ts, T0 + np.array([1, 2]) * NS)
    np.testing.assert_array_equal(b.open, [100.25, 100.00])
    np.testing.assert_array_equal(b.close, [100.25, 100.00])
    np.testing.assert_array_equal(b.volume, [5.0, 2.0])
    np.testing.assert_array_equal(b.buy_volume, [5.0, 0.0])  # side 'B' = buy aggressor
    np.testing.assert_array_equal(b.sell_volume, [0.0, 2.0])  # side 'A' = sell aggressor
    np.testing.assert_array_equal(b.n_trades, [1, 1])
    # level-1 OFI: bar 0 = 0 + 0 + 5 + 2 = 7; bar 1 = 15 + 0 − 12 = 3; deeper levels constant
    np.testing.assert_array_equal(b.ofi[:, 0], [7.0, 3.0])
    np.testing.assert_array_equal(b.ofi[:, 1:], 0.0)
    # depth imbalance at each close: book after the last event ≤ close
    deep_bid, deep_ask = sum(5 + m for m in range(1, 10)), sum(7 + m for m in range(1, 10))
    sb0, sa0 = 12 + deep_bid, 15 + deep_ask  # event at exactly 1.0 s
    sb1, sa1 = 30 + deep_bid, 8 + deep_ask
    np.testing.assert_allclose(b.depth_imbalance, [(sb0 - sa0) / (sb0 + sa0),
                                                   (sb1 - sa1) / (sb1 + sa1)], rtol=1e-15)
    # mean level-1 depth over each bar's events: (bid + ask) / 2
    np.testing.assert_allclose(b.book_depth[:, 0], [np.mean([15, 15, 12.5, 13.5]),
                                                    np.mean([10, 10, 19])])


def _reference_bars(raw: dict[str, np.ndarray], bar_ns: int) -> dict[str, np.ndarray]:
    """Independent per-event loop: bars from trades, CKS OFI summed per bar."""
    closes: list[int] = []
    rows: dict[int, dict] = {}
    last_px = None
    last_sign = 0
    for i in range(raw["ts"].shape[0]):
        if raw["action"][i] != "T":
            continue
        t = int(raw["ts"][i])
        c = -(-t // bar_ns) * bar_ns
        p, s = float(raw["price"][i]), float(raw["size"][i])
        if last_px is not None and p != last_px:
            last_sign = 1 if p > last_px else -1
        last_px = p
        sign = {"B": 1, "A": -1}.get(str(raw["side"][i]), last_sign)
        if c not in rows:
            closes.append(c)
            rows[c] = {"open": p, "high": p, "low": p, "close": p, "volume": 0.0, "buy": 0.0}
        r = rows[c]
        r["high"], r["low"], r["close"] = max(r["high"], p), min(r["low"], p), p
        r["volume"] += s
        r["buy"] += s * (sign + 1) / 2
    ofi = np.zeros((len(closes), 10))
    for i in range(1, raw["ts"].shape[0]):
        t = int(raw["ts"][i])
        k = next((j for j, c in enumerate(closes) if t <= c), None)
        if k is None:
            continue
        for m in range(10):
            bp, bp0 = raw["bid_px"][i, m], raw["bid_px"][i - 1, m]
            ap, ap0 = raw["ask_px"][i, m], raw["ask_px"][i - 1, m]
            bq, bq0 = raw["bid_sz"][i, m], raw["bid_sz"][i - 1, m]
            aq, aq0 = raw["ask_sz"][i, m], raw["ask_sz"][i - 1, m]
            ofi[k, m] += (bq * (bp >= bp0) - bq0 * (bp <= bp0) - aq * (ap <= ap0)
                          + aq0 * (ap >= ap0))
    out = {k: np.array([rows[c][k] for c in closes]) for k in rows[closes[0]]}
    out["ts"] = np.array(closes)
    out["ofi"] = ofi
    return out


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "zstd"])
def test_mbp10_multi_bar_stream_matches_per_event_reference(tmp_path: Path,
                                                            compress: bool) -> None:
    raw = tk.random_mbp10(np.random.default_rng(7), 4000, 120.0)
    path = tk.write_dbn(tmp_path / "big.dbn", "mbp-10", raw, compress=compress)
    b = load_bars(DataConfig(source="dbn", path=str(path), bar_size="5s"))
    ref = _reference_bars(raw, 5 * NS)
    assert len(b) > 20
    np.testing.assert_array_equal(b.ts, ref["ts"])
    for k in ("open", "high", "low", "close", "volume"):
        np.testing.assert_array_equal(getattr(b, k), ref[k], err_msg=k)
    np.testing.assert_array_equal(b.buy_volume, ref["buy"])
    np.testing.assert_array_equal(b.ofi, ref["ofi"])


def test_numpy_record_view_matches_databento_decoder(tmp_path: Path) -> None:
    raw = tk.random_mbp10(np.random.default_rng(1), 50, 10.0)
    path = tk.write_dbn(tmp_path / "x.dbn", "mbp-10", raw)
    schema, rec = read_dbn(path)
    dec = dbn.DBNDecoder()
    dec.write(path.read_bytes())
    objs = dec.decode()[1:]
    assert schema == "mbp-10" and rec.shape[0] == len(objs) == 50
    for r, o in zip(rec, objs, strict=True):
        assert r["ts_recv"] == o.ts_recv and r["price"] == o.price and r["size"] == o.size
        assert r["action"].decode() == str(o.action.value)
        for m in (0, 9):
            assert r["levels"]["bid_px"][m] == o.levels[m].bid_px
            assert r["levels"]["ask_sz"][m] == o.levels[m].ask_sz


def test_dbn_trades_and_ohlcv_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    ticks = tk.random_ticks(rng, 2000, 100.0)
    b = load_bars(DataConfig(source="dbn", bar_size="1s",
                             path=str(tk.write_dbn(tmp_path / "t.dbn", "trades", ticks))))
    assert b.volume.sum() == ticks["size"].sum() and b.ofi is None
    bars = tk.random_ohlcv(rng, 50)
    o = load_bars(DataConfig(source="dbn", path=str(
        tk.write_dbn(tmp_path / "o.dbn.zst", "ohlcv-1m", bars, compress=True))))
    np.testing.assert_array_equal(o.ts, bars["ts"])  # DBN stamps the open; we label the close
    np.testing.assert_array_equal(o.close, bars["close"])
    assert o.bar_seconds == 60.0 and np.isnan(o.buy_volume).all()


def test_dbn_records_out_of_time_order_are_sorted_with_a_warning_naming_one(
        tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    ticks = tk.random_ticks(rng, 200, 100.0)
    stamps = ticks["ts"].copy()
    ticks["ts"][50] = stamps[120]  # one trade stamped late: records 51 … out of order
    path = tk.write_dbn(tmp_path / "t.dbn", "trades", ticks)
    with pytest.warns(UserWarning, match=r"t\.dbn: \d+ record\(s\) stamped before the record "
                                         r"they follow \(first: record 52, field 'ts_recv'"):
        b = load_bars(DataConfig(source="dbn", bar_size="1s", path=str(path)))
    assert (np.diff(b.ts) > 0).all() and b.volume.sum() == ticks["size"].sum()


@pytest.mark.parametrize("schema,bar_size", [("trades", "1s"), ("mbp-10", "2s")])
@pytest.mark.parametrize("layout", ["plain", "zstd", "with_system_msgs"])
def test_records_written_with_ts_out_read_as_without(tmp_path: Path, schema: str,
                                                     bar_size: str, layout: str,
                                                     capfd: pytest.CaptureFixture) -> None:
    """A live gateway's file (``Metadata.ts_out``: 8 more bytes after each record) gives the
    bars of the same records without them, on the direct read, the zstd read, and the walk
    over mixed record types (heartbeats between the trades); a file whose records do not have
    the size its header declares is refused, not misread."""
    rng = np.random.default_rng(5)
    raw = (tk.random_ticks(rng, 600, 60.0) if schema == "trades"
           else tk.random_mbp10(rng, 600, 60.0))
    make = tk.trade_records if schema == "trades" else tk.mbp10_records
    sch = dbn.Schema.TRADES if schema == "trades" else dbn.Schema.MBP_10
    recs = make(raw)
    if layout == "with_system_msgs":
        recs = [x for i, r in enumerate(recs)
                for x in ((r, dbn.SystemMsg(ts_event=r.ts_event, msg="Heartbeat"))
                          if i % 50 == 0 else (r,))]
    compress = layout == "zstd"
    plain, with_ts_out = tmp_path / "plain.dbn", tmp_path / "ts_out.dbn"
    plain.write_bytes(tk.encode_dbn(sch, recs, compress))
    with_ts_out.write_bytes(tk.encode_dbn(sch, recs, compress, ts_out=True))
    want, got = (load_bars(DataConfig(source="dbn", path=str(p), bar_size=bar_size))
                 for p in (plain, with_ts_out))
    assert len(want) > 20
    for k in ("ts", "open", "high", "low", "close", "volume", "buy_volume"):
        np.testing.assert_array_equal(getattr(got, k), getattr(want, k), err_msg=k)
    if schema == "mbp-10":
        np.testing.assert_array_equal(got.ofi, want.ofi)
    np.testing.assert_array_equal(read_dbn(with_ts_out)[1], read_dbn(plain)[1])
    if layout == "plain":  # a header and records that disagree about ts_out, both ways
        def header(ts):
            return tk.encode_dbn(sch, [], ts_out=ts)

        for ts in (True, False):
            bad = tmp_path / f"bad_{ts}.dbn"
            bad.write_bytes(header(ts) + tk.encode_dbn(sch, recs, ts_out=not ts)[
                len(header(not ts)):])
            with pytest.raises(DataError, match=r"bad_\w+\.dbn: .*(cannot decode|bytes)"):
                load_bars(DataConfig(source="dbn", path=str(bad), bar_size=bar_size))
        # the decoder's Rust panic message stays off stderr: the error is the one line
        assert "panicked" not in capfd.readouterr().err


def test_dbn_several_instruments_need_a_choice(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    a, c = tk.random_ticks(rng, 100, 10.0), tk.random_ticks(rng, 100, 10.0)
    recs = tk.trade_records(a, instrument_id=11) + tk.trade_records(c, instrument_id=22)
    path = tmp_path / "two.dbn"
    path.write_bytes(tk.encode_dbn(dbn.Schema.TRADES, recs))
    with pytest.raises(DataError, match="instrument_id"):
        load_bars(DataConfig(source="dbn", path=str(path), bar_size="1s"))
    b = load_bars(DataConfig(source="dbn", path=str(path), bar_size="1s", instrument_id=22))
    assert b.volume.sum() == c["size"].sum()


@needs_dbn_dir
@pytest.mark.parametrize("name", ["test_data.mbp-10.dbn", "test_data.mbp-10.v3.dbn.zst"])
def test_real_mbp10_files(name: str) -> None:
    schema, rec = read_dbn(DBN_DIR / name)
    assert schema == "mbp-10" and rec.shape[0] == 2
    assert rec["levels"]["bid_px"][0, 0] == 3720250000000  # 3720.25, as databento_dbn decodes
    # the two records are a cancel and an add, no trade: no bar can be built
    with pytest.raises(DataError, match="no trade records"):
        load_bars(DataConfig(source="dbn", path=str(DBN_DIR / name)))


@needs_dbn_dir
def test_real_trades_and_ohlcv_files() -> None:
    b = load_bars(DataConfig(source="dbn", path=str(DBN_DIR / "test_data.trades.v3.dbn.zst")))
    assert len(b) >= 1 and b.close[0] == 3720.25 and b.volume.sum() > 0
    o = load_bars(DataConfig(source="dbn", path=str(DBN_DIR / "test_data.ohlcv-1m.v3.dbn.zst")))
    assert len(o) == 2 and o.bar_seconds == 60.0
    assert o.ts[0] == 1609160400000000000 + 60 * NS  # the first interval opens 13:00 UTC


@needs_dbn_dir
@pytest.mark.parametrize("name", ["test_data.mbo.v3.dbn.zst", "test_data.definition.v3.dbn.zst"])
def test_real_unsupported_schemas_are_refused(name: str) -> None:
    with pytest.raises(DataError, match="not supported"):
        load_bars(DataConfig(source="dbn", path=str(DBN_DIR / name)))


def test_timestamp_past_int64_is_refused_not_wrapped(tmp_path: Path) -> None:
    """ts_recv = 2**63 + 5 turned negative as int64, and np.diff wrapped back to positive, so the
    file passed the ordering checks."""
    raw = tk.random_ticks(np.random.default_rng(0), 50, 10.0)
    recs = tk.trade_records(raw)
    r = recs[10]
    recs[10] = dbn.TradeMsg(publisher_id=1, instrument_id=1, ts_event=r.ts_event, price=r.price,
                            size=r.size, action=dbn.Action.TRADE, side=dbn.Side.BID, depth=0,
                            ts_recv=2**63 + 5)
    path = tmp_path / "late.dbn"
    path.write_bytes(tk.encode_dbn(dbn.Schema.TRADES, recs))
    with pytest.raises(DataError, match=r"late\.dbn: record 11, field 'ts_recv': timestamp "
                                        r"9223372036854775813 is undefined or out of range"):
        load_bars(DataConfig(source="dbn", path=str(path), bar_size="1s"))


def test_dbn_ohlcv_high_below_low_is_refused(tmp_path: Path) -> None:
    bars = tk.random_ohlcv(np.random.default_rng(3), 20)
    bars["high"][4] = bars["low"][4] - 1.0
    path = tk.write_dbn(tmp_path / "o.dbn", "ohlcv-1m", bars)
    with pytest.raises(DataError, match=r"o\.dbn: record 5, field 'high': high .* do not "
                                        "bracket open"):
        load_bars(DataConfig(source="dbn", path=str(path)))


@pytest.mark.parametrize("field,level", [("bid_px", 0), ("ask_px", 0), ("bid_px", 3)])
def test_mbp10_non_positive_book_price_is_refused(tmp_path: Path, field: str,
                                                  level: int) -> None:
    raw = tk.random_mbp10(np.random.default_rng(1), 50, 10.0)
    raw[field][7, level] = -tk._px(0.25)
    path = tk.write_dbn(tmp_path / "m.dbn", "mbp-10", raw)
    with pytest.raises(DataError, match=rf"m\.dbn: record 8, field '{field}' \(level {level}\): "
                                        "non-positive price -0.25"):
        load_bars(DataConfig(source="dbn", path=str(path), bar_size="1s"))


def test_mbp10_crossed_book_is_kept_with_a_warning(tmp_path: Path) -> None:
    """Real books cross or lock in pre-open and auctions: loaded, but never silently."""
    raw = tk.random_mbp10(np.random.default_rng(1), 50, 10.0)
    raw["bid_px"][[7, 9], 0] = raw["ask_px"][[7, 9], 0]  # locked
    raw["bid_px"][20, 0] = raw["ask_px"][20, 0] + tk._px(0.25)  # crossed
    raw["ask_px"][30, 0] = dbn.UNDEF_PRICE  # an empty ask side is not a crossed book
    path = tk.write_dbn(tmp_path / "m.dbn", "mbp-10", raw)
    with pytest.warns(UserWarning, match=r"m\.dbn: 3 of 50 records have a crossed or locked "
                                         r"book .*first: record 8"):
        b = load_bars(DataConfig(source="dbn", path=str(path), bar_size="1s"))
    assert b.has_book
