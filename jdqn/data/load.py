"""``load_bars(cfg.data) -> Bars``: dispatch on ``data.source``."""

from __future__ import annotations

import warnings
from importlib import resources
from pathlib import Path

import numpy as np

from jdqn.config import DataConfig
from jdqn.data.bars import Bars
from jdqn.errors import DataError

BUILTIN = {"es_ticks": "es_ticks.csv.gz"}  # 'builtin:<name>' → file in jdqn/data/samples/


def resolve_path(path: str) -> Path:
    """A data path, with 'builtin:<name>' mapped to the sample shipped inside the package."""
    if path.startswith("builtin:"):
        name = path.split(":", 1)[1]
        if name not in BUILTIN:
            raise DataError(f"data.path = {path!r}: unknown builtin sample; available: "
                            + ", ".join(f"builtin:{k}" for k in BUILTIN))
        return Path(str(resources.files("jdqn.data").joinpath("samples", BUILTIN[name])))
    if not path:
        raise DataError("data.path is empty; set it to the input file")
    return Path(path).expanduser()


def require_file(path: Path, configured: str) -> None:
    """Refuse a data path that is not a file, saying whether it is missing or a folder."""
    if path.is_file():
        return
    what = "is a folder, not a data file" if path.is_dir() else "data file not found"
    raise DataError(f"{path}: {what} (data.path = {configured!r})")


def load_bars(cfg: DataConfig) -> Bars:
    """Load the configured input into the canonical bar table."""
    if cfg.source == "synthetic":
        from jdqn.data.synthetic import generate

        return generate(cfg.synthetic)
    path = resolve_path(cfg.path)
    require_file(path, cfg.path)
    if cfg.source == "ticks":
        from jdqn.data.tables import load_ticks as load
    elif cfg.source == "ohlcv":
        from jdqn.data.tables import load_ohlcv as load
    elif cfg.source == "dbn":
        from jdqn.data.dbn import load_dbn as load
    else:
        raise DataError(f"data.source = {cfg.source!r}: expected synthetic, ticks, ohlcv or dbn")
    bars = load(path, cfg)
    check_jumps(bars, cfg.max_jump, str(path))
    warn_long_gaps(bars, str(path))
    return bars


LONG_GAP_DAYS = 30  # no exchange closes a futures market this long: a bar after it is suspect


def warn_long_gaps(bars: Bars, source: str) -> None:
    """Warn (naming the first) about bars that close more than :data:`LONG_GAP_DAYS` days after
    the previous bar: one mistyped stamp (a year too late) becomes a bar after a gap of months,
    and every bar-count statistic spans it; a sample that really has such holes (separate
    contract periods) loads as it is."""
    if len(bars.ts) < 2:
        return
    gap = (bars.ts[1:] - bars.ts[:-1]) / (86_400 * 1e9)
    long = np.flatnonzero(gap > LONG_GAP_DAYS)
    if long.size:
        i = int(long[0]) + 1
        when = np.datetime_as_string(np.datetime64(int(bars.ts[i]), "ns"), unit="s")
        warnings.warn(f"{source}: bar {i} (close {when} UTC) closes {gap[i - 1]:.0f} days after "
                      f"the bar before it ({long.size} gaps over {LONG_GAP_DAYS} days): a "
                      "mistyped timestamp? The series is used as it is", stacklevel=3)


def check_jumps(bars: Bars, max_jump: float, source: str) -> None:
    """Refuse a bar whose open, high, low or close lies beyond a factor ``1 + max_jump`` up or
    down from the previous bar's close (the first bar: its own open); 0.25 = above +25 % or
    below −20 %, symmetric in log price. A single bad print (a price typed ×10, a stray tick)
    would otherwise widen a bar's range, feed the range and volatility features, and fill limit
    orders that no market would have filled. ``max_jump = 0`` accepts everything."""
    if max_jump <= 0 or len(bars.close) == 0:
        return
    ref = np.concatenate([bars.open[:1], bars.close[:-1]])
    prices = np.stack([bars.open, bars.high, bars.low, bars.close])
    move = np.max(np.abs(np.log(prices / ref)), axis=0)
    bad = np.flatnonzero(move > np.log1p(max_jump))
    if bad.size:
        i = int(bad[0])
        k = int(np.argmax(np.abs(np.log(prices[:, i] / ref[i]))))
        name = ("open", "high", "low", "close")[k]
        when = np.datetime_as_string(np.datetime64(int(bars.ts[i]), "ns"), unit="s")
        raise DataError(
            f"{source}: bar {i} (close {when} UTC): {name} {prices[k, i]:g} is "
            f"{prices[k, i] / ref[i] - 1:+.1%} from the previous close {ref[i]:g} "
            f"({bad.size} bar{'s' if bad.size > 1 else ''} beyond the limit); a bad print? "
            f"Clean the data, or raise "
            f"data.max_jump = {max_jump:g} (0 accepts any move)")
