"""The canonical bar table and the vectorised event → bar aggregation.

Axis names: ``T`` bars, ``N`` events (ticks/trades or book updates), ``L`` book levels.

Boundary convention (the one rule every bar builder and OFI obeys)
-----------------------------------------------------------------
A bar is labelled by its **close** time ``ts[t]`` and contains exactly the events with
``ts[t-1] < event_ts <= ts[t]`` (``ts[-1] = -inf``): the half-open formation interval
``(close(t-1), close(t)]``. Time bars close on a UTC-epoch grid of ``bar_ns``: an event at
``ts`` belongs to the bar that closes at ``ceil(ts / bar_ns) * bar_ns``, so an event exactly on a
grid point closes that bar (pandas ``resample(closed='right', label='right')``). Grid intervals
without a trade produce **no bar** (no zero-volume fake bars); the book events of such an
interval fall into the next bar's formation interval, which starts at the previous *existing*
bar's close. Volume/dollar bars close at the last event of the timestamp at which cumulative
volume (dollar value) crosses the next multiple of the threshold, so their ``ts`` are unique too.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np

from jdqn.errors import DataError

NS = 1_000_000_000
CLOSURE_GAP_S = 1800.0  # s: a longer gap between event bars (and > 50× the median) is a closure

_UNITS = {"s": 1, "sec": 1, "min": 60, "m": 60, "t": 60, "h": 3600, "hour": 3600, "d": 86400,
          "day": 86400}


def event_bar_seconds(close_ts: np.ndarray) -> float:
    """Mean spacing of volume/dollar bars **inside trading sessions**, for annualisation
    (``periods_per_year = sessions_per_year · session_hours · 3600 / bar_seconds``, the same
    convention as time bars). Closures — the daily maintenance break, nights of a day-session
    market, weekends, holidays — are gaps longer than ``max(30 min, 50 × the median spacing)``
    and are left out: counting them (the whole-series mean) would put trading-session seconds
    over calendar seconds and understate every Sharpe by up to √1.5. One bar (or only closure
    gaps) gives 1.0."""
    inside = session_gaps(close_ts)
    return float(inside.mean()) if inside.size and inside.mean() > 0 else 1.0


def session_gaps(close_ts: np.ndarray) -> np.ndarray:
    """Seconds between consecutive (ascending) bar closes, closures left out: gaps longer than
    ``max(30 min, 50 × the median gap)`` (see :func:`event_bar_seconds`). float64."""
    gaps = np.diff(np.asarray(close_ts, np.int64)).astype(np.float64) / NS
    if gaps.size == 0:
        return gaps
    limit = max(CLOSURE_GAP_S, 50.0 * float(np.median(gaps)))
    return gaps[gaps <= limit]


def parse_bar_size(text: str) -> int:
    """'30s', '1min', '5min', '1h', '1d' → bar length in nanoseconds (1 s … 1 d)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]+)\s*", text or "")
    if m and m.group(2) == "M":  # pandas' month, not our minute
        raise DataError(f"data.bar_size = {text!r}: 'M' is ambiguous (pandas reads it as "
                        "month); write 'min' for minutes")
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise DataError(f"data.bar_size = {text!r}: expected a number and a unit, e.g. '30s', "
                        "'1min', '5min', '1h', '1d'")
    seconds = int(m.group(1)) * _UNITS[unit]
    if not 1 <= seconds <= 86400:
        raise DataError(f"data.bar_size = {text!r}: time bars must be between 1s and 1d")
    return seconds * NS


@dataclass(frozen=True)
class Bars:
    """One instrument's bars, ascending with unique close times. Arrays have length ``T``.

    ``buy_volume``/``sell_volume`` are NaN when the input carries no aggressor information
    (OHLCV without those columns). ``n_trades`` is 0 when unknown (OHLCV).
    ``ofi``/``book_depth``/``depth_imbalance`` exist only for MBP-10 input.
    """

    ts: np.ndarray  # int64 [T] bar close, ns since epoch UTC
    start_ts: np.ndarray  # int64 [T] first event of the bar (OHLCV: close − bar length)
    open: np.ndarray  # float64 [T]
    high: np.ndarray
    low: np.ndarray
    close: np.ndarray
    volume: np.ndarray  # float64 [T]
    buy_volume: np.ndarray  # float64 [T] aggressor-buy volume (NaN = unknown)
    sell_volume: np.ndarray  # float64 [T]
    n_trades: np.ndarray  # int64 [T]
    bar_seconds: float  # nominal bar length (annualisation); volume bars: mean duration
    source: str  # human-readable origin (file name or 'synthetic(seed=0)')
    ofi: np.ndarray | None = None  # float64 [T, L] Cont–Kukanov–Stoikov OFI per level
    book_depth: np.ndarray | None = None  # float64 [T, L] mean (bid+ask)/2 size per level
    depth_imbalance: np.ndarray | None = None  # float64 [T] (Σbid−Σask)/(Σbid+Σask) at close

    def __len__(self) -> int:
        return int(self.ts.shape[0])

    @property
    def has_book(self) -> bool:
        return self.ofi is not None

    @property
    def has_flow(self) -> bool:
        return bool(len(self)) and not bool(np.isnan(self.buy_volume).any())

    def take(self, index: slice | np.ndarray) -> Bars:
        """The bars at ``index`` (a slice or index array), same metadata."""
        kw = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            kw[f.name] = v[index] if isinstance(v, np.ndarray) else v
        return Bars(**kw)

    def arrays(self) -> dict[str, np.ndarray]:
        """The array fields by name (None fields left out)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), np.ndarray)}

    def check(self) -> Bars:
        """Assert the table's invariants (ascending unique ts, shapes, aggressor volumes known
        for every bar or for none); returns self."""
        t = len(self)
        for name, v in self.arrays().items():
            if v.shape[0] != t:
                raise DataError(f"{self.source}: bar field {name} has {v.shape[0]} rows, not {t}")
        if t and not (self.ts[1:] > self.ts[:-1]).all():  # not np.diff: int64 can wrap
            raise DataError(f"{self.source}: bar close times are not strictly ascending")
        # Whether the order-flow features exist is decided for the whole series (has_flow): a
        # bar of unknown aggressor volume after bar t would switch them off at t too, a
        # dependence on the future. So the volumes are known everywhere or nowhere.
        for name in ("buy_volume", "sell_volume"):
            unknown = np.isnan(getattr(self, name))
            if unknown.any() and not unknown.all():
                first = int(np.flatnonzero(unknown)[0])
                raise DataError(f"{self.source}: {name} is unknown (NaN) at bar {first} but "
                                f"known at others: the aggressor volumes must be known for "
                                f"every bar or for none")
        # the aggressor volumes are shares of the volume: more is a mislabelled column
        over = np.flatnonzero(self.buy_volume + self.sell_volume
                              > self.volume * (1 + 1e-9) + 1e-9)  # NaN compares False
        if over.shape[0]:
            i = int(over[0])
            raise DataError(f"{self.source}: bar {i}: buy_volume + sell_volume = "
                            f"{self.buy_volume[i] + self.sell_volume[i]:g} exceeds the bar's "
                            f"volume {self.volume[i]:g} ({over.shape[0]} bars do): the "
                            "aggressor volumes are parts of the volume — check which columns "
                            "data.columns maps")
        return self


# --------------------------------------------------------------------------------------------
# aggressor side
# --------------------------------------------------------------------------------------------


def carry_forward_nonzero(x: np.ndarray) -> np.ndarray:
    """x with every zero replaced by the last non-zero value before it (0 if none). Causal."""
    idx = np.where(x != 0, np.arange(x.shape[0]), 0)
    np.maximum.accumulate(idx, out=idx)
    return x[idx]


def trade_signs(price: np.ndarray, side: np.ndarray | None) -> np.ndarray:
    """Aggressor sign per trade: +1 buy, −1 sell, 0 unknown. int8 [N].

    ``side`` (+1/−1/0) wins where known; elsewhere the tick rule: the sign of the price change
    from the previous trade, carried forward over zero changes. Trades before the first price
    change stay 0 (their volume is split half/half).
    """
    d = np.zeros(price.shape[0], np.int8)
    if price.shape[0] > 1:
        d[1:] = np.sign(np.diff(price)).astype(np.int8)
    tick = carry_forward_nonzero(d)
    if side is None:
        return tick
    return np.where(side != 0, side, tick).astype(np.int8)


# --------------------------------------------------------------------------------------------
# events → bars
# --------------------------------------------------------------------------------------------


def bar_starts(ts: np.ndarray, size: np.ndarray, price: np.ndarray, bar_type: str, bar_ns: int,
               threshold: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Segment sorted events into bars.

    Returns ``(starts, ends, close_ts)``: event index ranges ``[starts[t], ends[t])`` and the bar
    labels. Events after the last complete volume/dollar bar are dropped (incomplete bar); the
    last time bar is kept (it closes at its grid point even if the data stops before it).
    """
    n = ts.shape[0]
    if n == 0:
        e = np.zeros(0, np.int64)
        return e, e, e
    if bar_type == "time":
        bucket = -((-ts) // bar_ns)  # ceil: an event on a grid point closes that bar
        cut = np.flatnonzero(bucket[1:] != bucket[:-1]) + 1
        starts = np.concatenate([[0], cut]).astype(np.int64)
        ends = np.concatenate([cut, [n]]).astype(np.int64)
        return starts, ends, bucket[starts] * bar_ns
    if bar_type not in ("volume", "dollar"):
        raise DataError(f"data.bar_type = {bar_type!r}: expected 'time', 'volume' or 'dollar'")
    if not threshold > 0:
        raise DataError(f"data.bar_threshold = {threshold}: {bar_type} bars need a positive "
                        "threshold")
    amount = size if bar_type == "volume" else size * price
    level = np.floor(np.cumsum(amount) / threshold)
    prev = np.concatenate([[0.0], level[:-1]])
    cross = np.flatnonzero(level > prev)
    # close at the last event sharing the crossing event's timestamp: labels stay unique and
    # the bar is exactly the interval (close(t-1), close(t)]
    last = np.searchsorted(ts, ts[cross], side="right") - 1
    ends = np.unique(last) + 1
    starts = np.concatenate([[0], ends[:-1]])[:ends.shape[0]].astype(np.int64)  # [] if no bar
    return starts, ends.astype(np.int64), ts[ends - 1]


def events_to_bars(ts: np.ndarray, price: np.ndarray, size: np.ndarray, sign: np.ndarray, *,
                   bar_type: str = "time", bar_ns: int = 60 * NS, threshold: float = 0.0,
                   source: str = "") -> Bars:
    """Aggregate sorted trades (``ts`` int64 ns, ``price``, ``size``, aggressor ``sign``) to bars.

    Vectorised: one ``reduceat`` per field, no Python loop over events.
    """
    starts, ends, close_ts = bar_starts(ts, size, price, bar_type, bar_ns, threshold)
    if starts.shape[0] == 0:
        hint = "" if bar_type == "time" else \
            f" (data.bar_threshold = {threshold:g} is more than the whole input's {bar_type})"
        raise DataError(f"{source}: no complete bar could be formed from {ts.shape[0]} "
                        f"events{hint}")
    n_used = int(ends[-1])
    ts, price, size, sign = ts[:n_used], price[:n_used], size[:n_used], sign[:n_used]
    buy = size * (sign.astype(np.float64) + 1.0) * 0.5  # sign 0 → half the volume each way
    volume = np.add.reduceat(size, starts)
    buy_volume = np.add.reduceat(buy, starts)
    bar_seconds = bar_ns / NS if bar_type == "time" else event_bar_seconds(close_ts)
    return Bars(
        ts=close_ts.astype(np.int64),
        start_ts=ts[starts].astype(np.int64),
        open=price[starts].astype(np.float64),
        high=np.maximum.reduceat(price, starts).astype(np.float64),
        low=np.minimum.reduceat(price, starts).astype(np.float64),
        close=price[ends - 1].astype(np.float64),
        volume=volume,
        buy_volume=buy_volume,
        sell_volume=volume - buy_volume,
        n_trades=(ends - starts).astype(np.int64),
        bar_seconds=float(bar_seconds),
        source=source,
    )


def ohlc_inconsistent(o: np.ndarray, h: np.ndarray, lo: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Mask of bars whose high/low do not bracket their open and close (bool [T])."""
    return (h < lo) | (h < np.maximum(o, c) * (1 - 1e-12)) | (lo > np.minimum(o, c) * (1 + 1e-12))


def check_ticks(ts: np.ndarray, price: np.ndarray, size: np.ndarray, source: str) -> None:
    """Cheap whole-array sanity checks (the readers report the exact row first)."""
    if not np.isfinite(price).all() or not (price > 0).all():
        bad = int(np.flatnonzero(~(np.isfinite(price) & (price > 0)))[0])
        raise DataError(f"{source}: event {bad + 1}, field 'price': NaN or non-positive price "
                        f"{price[bad]!r}")
    if not np.isfinite(size).all() or (size < 0).any():
        bad = int(np.flatnonzero(~(np.isfinite(size) & (size >= 0)))[0])
        raise DataError(f"{source}: event {bad + 1}, field 'size': NaN or negative size "
                        f"{size[bad]!r}")
    back = np.flatnonzero(ts[1:] < ts[:-1])  # not np.diff: int64 differences can wrap
    if back.shape[0]:
        raise DataError(f"{source}: event timestamps are not ascending (event {back[0] + 2} is "
                        f"before event {back[0] + 1})")


def ticks_to_bars(ts: np.ndarray, price: np.ndarray, size: np.ndarray,
                  side: np.ndarray | None = None, *, bar_type: str = "time",
                  bar_ns: int = 60 * NS, threshold: float = 0.0, source: str = "") -> Bars:
    """Ticks/trades (sorted by ``ts``) → bars, aggressor side from ``side`` or the tick rule."""
    check_ticks(ts, price, size, source)
    sign = trade_signs(price, side)
    return events_to_bars(ts, price, size, sign, bar_type=bar_type, bar_ns=bar_ns,
                          threshold=threshold, source=source)


# --------------------------------------------------------------------------------------------
# book events (MBP-10) → per-bar OFI, depth, depth imbalance
# --------------------------------------------------------------------------------------------


def book_event_ofi(bid_px: np.ndarray, bid_sz: np.ndarray, ask_px: np.ndarray,
                   ask_sz: np.ndarray) -> np.ndarray:
    """Per-event, per-level order-flow imbalance e_n^m (Cont, Kukanov & Stoikov 2014; multi-level
    form of Xu, Gould & Howison 2018). Inputs ``[N, L]`` book *after* event n; output ``[N, L]``.

    e_n = q^b_n·1{P^b_n ≥ P^b_{n−1}} − q^b_{n−1}·1{P^b_n ≤ P^b_{n−1}}
          − q^a_n·1{P^a_n ≤ P^a_{n−1}} + q^a_{n−1}·1{P^a_n ≥ P^a_{n−1}},  e_0 = 0.
    Empty levels must carry bid price −inf-like / ask price +inf-like sentinels and size 0.
    """
    e = np.zeros(bid_sz.shape, np.float64)
    if bid_sz.shape[0] < 2:
        return e
    bp, bp0 = bid_px[1:], bid_px[:-1]
    ap, ap0 = ask_px[1:], ask_px[:-1]
    bq, bq0 = bid_sz[1:].astype(np.float64), bid_sz[:-1].astype(np.float64)
    aq, aq0 = ask_sz[1:].astype(np.float64), ask_sz[:-1].astype(np.float64)
    e[1:] = (bq * (bp >= bp0) - bq0 * (bp <= bp0) - aq * (ap <= ap0) + aq0 * (ap >= ap0))
    return e


def attach_book(bars: Bars, ev_ts: np.ndarray, bid_px: np.ndarray, bid_sz: np.ndarray,
                ask_px: np.ndarray, ask_sz: np.ndarray) -> Bars:
    """Add OFI summed over each bar's formation interval ``(close(t−1), close(t)]``, the mean
    level depth over that interval, and the depth imbalance of the last book at or before the
    close. Book events after the last bar's close are ignored (they belong to a future bar).
    """
    t, n_lev = len(bars), bid_sz.shape[1]
    e = book_event_ofi(bid_px, bid_sz, ask_px, ask_sz)
    # bar index of each event: first t with close[t] >= ev_ts  ⇔  ev_ts in (close[t-1], close[t]]
    k = np.searchsorted(bars.ts, ev_ts, side="left")
    depth = 0.5 * (bid_sz.astype(np.float64) + ask_sz.astype(np.float64))
    count = np.bincount(k, minlength=t + 1)[:t].astype(np.float64)
    ofi = np.empty((t, n_lev))
    mean_depth = np.empty((t, n_lev))
    for m in range(n_lev):  # L ≤ 10 passes, each vectorised over events
        ofi[:, m] = np.bincount(k, weights=e[:, m], minlength=t + 1)[:t]
        mean_depth[:, m] = np.bincount(k, weights=depth[:, m], minlength=t + 1)[:t]
    last = np.searchsorted(ev_ts, bars.ts, side="right") - 1  # last book state ≤ close
    has = last >= 0
    lastc = np.maximum(last, 0)
    sb = bid_sz[lastc].astype(np.float64).sum(axis=1)
    sa = ask_sz[lastc].astype(np.float64).sum(axis=1)
    tot = sb + sa
    imb = np.where(has & (tot > 0), (sb - sa) / np.where(tot > 0, tot, 1.0), 0.0)
    close_depth = np.where(has[:, None], depth[lastc], 0.0)
    mean_depth = np.where(count[:, None] > 0, mean_depth / np.maximum(count, 1.0)[:, None],
                          close_depth)
    return dataclasses.replace(bars, ofi=ofi, book_depth=mean_depth, depth_imbalance=imb)
