"""``load_bars(cfg.data) -> Bars``: dispatch on ``data.source``."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

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
        from jdqn.data.tables import load_ticks

        return load_ticks(path, cfg)
    if cfg.source == "ohlcv":
        from jdqn.data.tables import load_ohlcv

        return load_ohlcv(path, cfg)
    if cfg.source == "dbn":
        from jdqn.data.dbn import load_dbn

        return load_dbn(path, cfg)
    raise DataError(f"data.source = {cfg.source!r}: expected synthetic, ticks, ohlcv or dbn")
