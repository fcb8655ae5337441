"""On-disk feature cache: ``load_or_build(cfg) -> (bars, features, cache_hit)``.

One ``.npz`` per (input, data settings, feature settings) in ``cfg.data.cache_dir``. The file
name hashes the input's *location* and the settings; inside, the file stores ``SCHEMA_VERSION``
and the full key, which adds the input's *identity* (absolute path, size and a SHA-256 of its
whole content; or the synthetic config). So:

* same input and settings → hit (arrays identical to a fresh build);
* the input file changed, or a setting that affects bars/features changed → stale → rebuilt and
  overwritten (a changed setting simply maps to another file);
* another version of the code that builds them (``jdqn/data``'s sources, or numpy, pandas,
  pyarrow or databento-dbn upgraded) → stale → rebuilt: a loader fix — such as a file it now
  refuses, or rows it now orders differently — is never bypassed by a cache the old code wrote;
* a file written by another ``SCHEMA_VERSION`` → refused with :class:`CacheError` naming the file
  and both versions (delete it, or point ``data.cache_dir`` elsewhere); a file that cannot be
  read at all is rebuilt with a warning.

Writes are atomic (temporary file in the same folder + ``os.replace``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from jdqn.config import DataConfig, FeaturesConfig, to_dict
from jdqn.data.bars import Bars
from jdqn.data.features import FeatureSet, build_features
from jdqn.data.load import load_bars, require_file, resolve_path
from jdqn.errors import CacheError, DataError

SCHEMA_VERSION = 3  # bump when bars/features change meaning or layout (2: event-bar bar_seconds;
#                    3: synthetic high/low from a Brownian bridge)


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def input_identity(cfg: DataConfig) -> dict[str, Any]:
    """What identifies the input's content: a SHA-256 of every byte of the file (about
    1.7 GB/s with the CPU's SHA extensions, well under the cost of parsing it) with its
    absolute path and size, or the synthetic config. An edit anywhere in the file, whatever it
    does to the size and mtime, changes the key."""
    if cfg.source == "synthetic":
        return {"synthetic": to_dict(cfg.synthetic)}
    path = resolve_path(cfg.path).resolve()
    require_file(path, cfg.path)
    try:
        st = path.stat()
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
    except OSError as e:
        raise DataError(f"{path}: cannot read the data file: {e.strerror or e}") from None
    return {"path": str(path), "size": st.st_size, "sha256": digest}


_LIBRARIES = ("numpy", "pandas", "pyarrow", "databento-dbn")


def code_digest(folder: Path | None = None) -> str:
    """What identifies the code that turns an input into bars and features: a SHA-256 of every
    ``.py`` file in ``folder`` (default: this package, ``jdqn/data``), by name and content, and
    the versions of the libraries that parse and compute them. Part of the cache key, so a
    cache written by another version of the loader is rebuilt, not served."""
    if folder is None:
        return _package_digest()
    h = hashlib.sha256()
    for f in sorted(Path(folder).glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    for lib in _LIBRARIES:
        try:
            version = importlib.metadata.version(lib)
        except importlib.metadata.PackageNotFoundError:
            version = "absent"
        h.update(f"{lib}={version}\0".encode())
    return h.hexdigest()


@functools.cache
def _package_digest() -> str:
    return code_digest(Path(__file__).parent)


def _settings(data: DataConfig, features: FeaturesConfig) -> dict[str, Any]:
    """Data settings that change the bars (not the cache folder) and all feature settings."""
    d = to_dict(data)
    d.pop("cache_dir")
    if data.source != "synthetic":
        d.pop("synthetic")
    return {"data": d, "features": to_dict(features)}


def cache_path(data: DataConfig, features: FeaturesConfig) -> Path:
    where = {"source": data.source, "path": data.path, **_settings(data, features)}
    stem = "synthetic" if data.source == "synthetic" else Path(data.path.split(":")[-1]).name
    stem = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in stem)[:40]
    return Path(data.cache_dir).expanduser() / f"{stem}-{_sha(where)[:16]}.npz"


def cache_key(data: DataConfig, features: FeaturesConfig) -> str:
    return _sha({"schema": SCHEMA_VERSION, "code": code_digest(), "input": input_identity(data),
                 **_settings(data, features)})


def save(path: Path, key: str, bars: Bars, feats: FeatureSet) -> None:
    meta = {"schema_version": SCHEMA_VERSION, "key": key, "bar_seconds": bars.bar_seconds,
            "source": bars.source, "names": list(feats.names), "flow_idx": list(feats.flow_idx),
            "warmup": feats.warmup}
    arrays = {f"bars.{k}": v for k, v in bars.arrays().items()}
    arrays["features.values"] = feats.values
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: Path, key: str) -> tuple[Bars, FeatureSet] | None:
    """The cached (bars, features), or None if stale/unreadable; CacheError if foreign schema.

    A file whose key matches but whose contents are incomplete or inconsistent (a missing array
    or meta field, shapes that disagree) counts as unreadable: it is rebuilt with a warning."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(z["meta"].tobytes().decode())
            if not isinstance(meta, dict):
                raise TypeError("meta is not a JSON object")
            if meta.get("schema_version") != SCHEMA_VERSION:
                raise CacheError(f"{path}: feature cache written with schema version "
                                 f"{meta.get('schema_version')!r}, this jdqn reads version "
                                 f"{SCHEMA_VERSION}; delete the file or set data.cache_dir "
                                 "to another folder")
            if meta.get("key") != key:
                return None
            arrays = {k.split(".", 1)[1]: z[k] for k in z.files if k.startswith("bars.")}
            values = z["features.values"]
        bars, feats = _unpack(meta, arrays, values)
    except CacheError:
        raise
    except (OSError, ValueError, KeyError, TypeError, IndexError, EOFError,
            zipfile.BadZipFile) as e:
        # truncated, foreign or inconsistent file (DataError is a ValueError): rebuilding is safe
        warnings.warn(f"{path}: unreadable feature cache ({type(e).__name__}: {e}); rebuilding",
                      stacklevel=3)
        return None
    return bars, feats


def _unpack(meta: dict[str, Any], arrays: dict[str, np.ndarray], values: np.ndarray
            ) -> tuple[Bars, FeatureSet]:
    """Bars and features from a cache file's parts, with the checks a fresh build passes."""
    fields = {f.name for f in dataclasses.fields(Bars)} - {"bar_seconds", "source"}
    book = {"ofi", "book_depth", "depth_imbalance"}
    missing = sorted(fields - book - arrays.keys())
    if missing or len(book & arrays.keys()) not in (0, len(book)):
        raise ValueError(f"bar arrays missing: {', '.join(missing or sorted(book - arrays.keys()))}")
    bar_seconds, source, names, flow_idx, warmup = (
        meta[k] for k in ("bar_seconds", "source", "names", "flow_idx", "warmup"))
    if isinstance(bar_seconds, bool) or not isinstance(bar_seconds, (int, float)) \
            or not 0 < bar_seconds < float("inf"):
        raise ValueError(f"bar_seconds {bar_seconds!r} is not a positive number")
    if not isinstance(source, str) or not isinstance(names, list) \
            or not all(isinstance(n, str) for n in names):
        raise ValueError("source or feature names are not text")
    bars = Bars(**{k: v for k, v in arrays.items() if k in fields},
                bar_seconds=float(bar_seconds), source=source).check()
    if values.dtype != np.float32 or values.shape != (len(bars), len(names)):
        raise ValueError(f"features are {values.dtype} {values.shape}, expected float32 "
                         f"({len(bars)}, {len(names)})")
    if not np.isfinite(values).all():
        raise ValueError("non-finite feature values")
    if not isinstance(flow_idx, list) or not all(
            type(i) is int and 0 <= i < len(names) for i in flow_idx) \
            or type(warmup) is not int or not 0 <= warmup <= len(bars):
        raise ValueError(f"flow_idx {flow_idx!r} or warmup {warmup!r} out of range")
    return bars, FeatureSet(values=values, names=tuple(names), flow_idx=tuple(flow_idx),
                            warmup=warmup)


def load_or_build(cfg: Any) -> tuple[Bars, FeatureSet, bool]:
    """Bars and features for ``cfg`` (a :class:`jdqn.config.Config`), from the cache if valid.

    Returns ``(bars, features, cache_hit)``. ``data.cache_dir = ''`` disables the cache.
    """
    data, features = cfg.data, cfg.features
    if not data.cache_dir:
        bars = load_bars(data)
        return bars, build_features(bars, features), False
    folder = Path(data.cache_dir).expanduser()
    if folder.exists() and not folder.is_dir():
        raise CacheError(f"data.cache_dir = {data.cache_dir!r} is a file, not a folder; point "
                         "it at a folder (or '' for no cache)")
    path = cache_path(data, features)
    key = cache_key(data, features)
    if path.is_file():
        hit = load(path, key)
        if hit is not None:
            return hit[0], hit[1], True
    bars = load_bars(data)
    feats = build_features(bars, features)
    try:
        save(path, key, bars, feats)
    except OSError as e:  # a folder that cannot be made or written: name the setting
        raise CacheError(f"data.cache_dir = {data.cache_dir!r}: cannot write the feature cache "
                         f"{e.filename or path} ({e.strerror or e}); point it at a writable "
                         "folder, or '' for no cache") from None
    return bars, feats, False
