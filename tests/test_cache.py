"""Feature cache: hit on the second call with identical arrays, rebuild when a setting or the
input changes, refusal of a file from another schema version."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

from jdqn.config import Config, DataConfig, FeaturesConfig, SyntheticConfig
from jdqn.data import cache, load_or_build
from jdqn.data import testing as tk
from jdqn.errors import CacheError, DataError


def _cfg(tmp_path: Path, **data) -> Config:
    d = DataConfig(cache_dir=str(tmp_path / "cache"), synthetic=SyntheticConfig(n_bars=600),
                   **data)
    return Config(data=d)


def _same(a, b) -> None:
    for k, v in a[0].arrays().items():
        np.testing.assert_array_equal(v, b[0].arrays()[k], err_msg=k)
    assert a[0].bar_seconds == b[0].bar_seconds and a[0].source == b[0].source
    np.testing.assert_array_equal(a[1].values, b[1].values)
    assert (a[1].names, a[1].flow_idx, a[1].warmup) == (b[1].names, b[1].flow_idx, b[1].warmup)


def test_second_call_hits_with_identical_arrays(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    first = load_or_build(cfg)
    second = load_or_build(cfg)
    assert first[2] is False and second[2] is True
    _same(first, second)
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 1
    assert not list((tmp_path / "cache").glob("*.tmp"))  # atomic write left nothing behind


def test_changing_a_setting_rebuilds(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    load_or_build(cfg)
    changed = dataclasses.replace(cfg, features=FeaturesConfig(ofi_window=7))
    out = load_or_build(changed)
    assert out[2] is False and "flow_imb_7" in out[1].names
    assert load_or_build(changed)[2] is True
    seed = dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, synthetic=SyntheticConfig(n_bars=600, seed=1)))
    assert load_or_build(seed)[2] is False
    # settings that do not change bars or features share the cache entry
    assert load_or_build(dataclasses.replace(cfg, env=dataclasses.replace(
        cfg.env, n_envs=3)))[2] is True


def test_a_cache_written_by_other_loader_code_is_rebuilt(tmp_path: Path, monkeypatch) -> None:
    """A loader fix (a file now refused, rows now ordered otherwise) is not bypassed by a cache
    the old code wrote: the key carries a digest of jdqn/data's sources and the parsing
    libraries' versions, so another code version's entry is stale and overwritten."""
    cfg = _cfg(tmp_path)
    monkeypatch.setattr(cache, "_package_digest", lambda: "the old loader")
    assert load_or_build(cfg)[2] is False
    assert load_or_build(cfg)[2] is True
    monkeypatch.undo()
    assert load_or_build(cfg)[2] is False  # the current code's key: rebuilt, not served
    assert load_or_build(cfg)[2] is True
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 1  # the old entry overwritten


def test_the_code_digest_follows_every_source_file_and_the_parsers(tmp_path: Path,
                                                                    monkeypatch) -> None:
    src = Path(cache.__file__).parent
    copy = tmp_path / "data"
    copy.mkdir()
    for f in src.glob("*.py"):
        (copy / f.name).write_bytes(f.read_bytes())
    assert cache.code_digest(copy) == cache.code_digest() == cache.code_digest(src)
    tables = copy / "tables.py"
    tables.write_bytes(tables.read_bytes() + b"\n")  # one byte in one loader file
    changed = cache.code_digest(copy)
    assert changed != cache.code_digest()
    (copy / "extra.py").write_text("")  # a new module
    assert cache.code_digest(copy) not in (changed, cache.code_digest())
    real = cache.importlib.metadata.version
    monkeypatch.setattr(cache.importlib.metadata, "version",
                        lambda lib: "0.0" if lib == "pandas" else real(lib))
    assert cache.code_digest(src) != cache.code_digest()  # another pandas


def test_a_changed_input_file_is_stale_and_rebuilt(tmp_path: Path) -> None:
    raw = tk.random_ticks(np.random.default_rng(0), 4000, 600.0)
    path = tk.write_ticks_csv(raw, tmp_path / "t.csv")
    cfg = _cfg(tmp_path, source="ticks", path=str(path), bar_size="1s")
    assert load_or_build(cfg)[2] is False
    assert load_or_build(cfg)[2] is True
    raw["price"][-1] += 0.25  # same size, different content and mtime
    tk.write_ticks_csv(raw, path)
    os.utime(path, ns=(1, 1))
    out = load_or_build(cfg)
    assert out[2] is False and out[0].close[-1] == raw["price"][-1]
    assert len(list((tmp_path / "cache").glob("*.npz"))) == 1  # stale entry overwritten


def test_foreign_schema_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg(tmp_path)
    monkeypatch.setattr(cache, "SCHEMA_VERSION", 999)
    load_or_build(cfg)
    monkeypatch.undo()
    with pytest.raises(CacheError) as e:
        load_or_build(cfg)
    msg = str(e.value)
    assert ".npz" in msg and "999" in msg and str(cache.SCHEMA_VERSION) in msg
    path = next((tmp_path / "cache").glob("*.npz"))
    with np.load(path) as z:
        assert json.loads(z["meta"].tobytes())["schema_version"] == 999


def test_unreadable_cache_is_rebuilt_with_a_warning(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    load_or_build(cfg)
    next((tmp_path / "cache").glob("*.npz")).write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="unreadable feature cache"):
        assert load_or_build(cfg)[2] is False
    assert load_or_build(cfg)[2] is True


def test_empty_cache_dir_disables_the_cache(tmp_path: Path) -> None:
    cfg = Config(data=DataConfig(cache_dir="", synthetic=SyntheticConfig(n_bars=600)))
    assert load_or_build(cfg)[2] is False and load_or_build(cfg)[2] is False


def test_a_cache_dir_that_cannot_be_written_names_the_setting(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a folder cannot be made under a file
    cfg = Config(data=DataConfig(cache_dir=str(blocker / "cache"),
                                 synthetic=SyntheticConfig(n_bars=600)))
    with pytest.raises(CacheError, match=r"data.cache_dir = '.*file/cache': cannot write the "
                                         r"feature cache .*; point it at a writable folder"):
        load_or_build(cfg)


def test_missing_input_is_a_data_error_not_a_traceback(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, source="ticks", path=str(tmp_path / "nope.csv"))
    with pytest.raises(DataError, match=r"nope\.csv: data file not found"):
        load_or_build(cfg)



def _array(name: str, change):
    def corrupt(a: dict, m: dict) -> dict:
        a[name] = change(a[name])
        return m
    return corrupt


def _no_close(a: dict, m: dict) -> dict:
    del a["bars.close"]
    return m


def _nan_last(v: np.ndarray) -> np.ndarray:
    v = v.copy()
    v[-1, 0] = np.nan
    return v


# each changes the arrays in place and returns the meta to write (the key still matches)
CORRUPTIONS = {
    "missing array": _no_close,
    "meta not an object": lambda a, m: [m],
    "non-numeric bar_seconds": lambda a, m: {**m, "bar_seconds": "1min"},
    "missing names": lambda a, m: {k: v for k, v in m.items() if k != "names"},
    "flow_idx out of range": lambda a, m: {**m, "flow_idx": [999]},
    "100 feature rows": _array("features.values", lambda v: v[:100]),
    "non-finite feature": _array("features.values", _nan_last),
    "descending bar times": _array("bars.ts", lambda v: v[::-1]),
    "short bar field": _array("bars.volume", lambda v: v[:-1]),
}


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS))
def test_inconsistent_cache_with_matching_key_is_rebuilt_with_a_warning(tmp_path: Path,
                                                                        corrupt: str) -> None:
    """A file whose key matches but whose parts are missing or disagree used to raise a
    TypeError/KeyError/AttributeError traceback or be used as it was (loading skipped
    Bars.check)."""
    cfg = _cfg(tmp_path)
    fresh = load_or_build(cfg)
    path = next((tmp_path / "cache").glob("*.npz"))
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    meta = CORRUPTIONS[corrupt](arrays, json.loads(arrays["meta"].tobytes()))
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    with pytest.warns(UserWarning, match=r"\.npz: unreadable feature cache .*rebuilding"):
        rebuilt = load_or_build(cfg)
    assert rebuilt[2] is False
    _same(fresh, rebuilt)
    assert load_or_build(cfg)[2] is True


def test_an_edit_in_the_middle_that_keeps_size_and_mtime_is_stale(tmp_path: Path) -> None:
    """The key hashes the whole file: a same-size edit far from both ends, with the mtime put
    back, is still seen (the earlier key read only the first and last MiB and the mtime)."""
    raw = tk.random_ticks(np.random.default_rng(1), 120_000, 3600.0)
    path = tk.write_ticks_csv(raw, tmp_path / "t.csv")
    assert path.stat().st_size > 3 * (1 << 20)
    cfg = _cfg(tmp_path, source="ticks", path=str(path), bar_size="1s")
    first = load_or_build(cfg)
    assert first[2] is False and load_or_build(cfg)[2] is True
    st = path.stat()
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    nl = data.index(b"\n", mid) + 1  # the start of a line in the middle of the file
    row = data[nl:data.index(b"\n", nl)].decode()
    fields = row.split(",")
    head, frac = fields[1].split(".")  # the price: one point up, same width, on the tick grid
    fields[1] = head[:-1] + str((int(head[-1]) + 1) % 10) + "." + frac
    edited = ",".join(fields).encode()
    assert len(edited) == len(row)
    data[nl:nl + len(edited)] = edited
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    out = load_or_build(cfg)
    assert out[2] is False  # rebuilt from the edited file
    assert not np.array_equal(out[0].close, first[0].close) or not np.array_equal(
        out[0].high, first[0].high) or not np.array_equal(out[0].low, first[0].low)
