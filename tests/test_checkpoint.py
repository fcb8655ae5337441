"""Orbax checkpoints: exact round trips, async saves, retention, layout and corruption checks."""

from __future__ import annotations

import glob
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct

from jdqn.config import TrainConfig
from jdqn.errors import CheckpointError
from jdqn.train.checkpoint import Checkpointer, layout_fingerprint
from jdqn.train.optim import adam_state, make_optimizer, set_learning_rate


@struct.dataclass
class State:
    params: Any
    opt_state: Any
    key: jax.Array
    env_keys: jax.Array
    step: jax.Array
    halted: jax.Array
    half: jax.Array


def _state(seed: int = 0, width: int = 8) -> State:
    k = jax.random.key(seed)
    params = {"dense": {"kernel": jax.random.normal(k, (4, width)), "bias": jnp.zeros(width)}}
    opt = make_optimizer(TrainConfig(lr=1e-3))
    opt_state = set_learning_rate(opt.init(params), 7e-4)
    _, opt_state = opt.update(jax.tree.map(jnp.ones_like, params), opt_state, params)
    return State(params=params, opt_state=opt_state, key=jax.random.fold_in(k, 1),
                 env_keys=jax.random.split(jax.random.key(seed + 5), 3),
                 step=jnp.int32(1234), halted=jnp.bool_(False),
                 half=jnp.arange(3, dtype=jnp.bfloat16))


def _raw(x: jax.Array) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def _assert_bitwise_equal(a: Any, b: Any) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(_raw(x), _raw(y))


def test_round_trip_is_bitwise_with_optax_types_and_typed_keys(tmp_path):
    st = _state()
    with Checkpointer(tmp_path / "ck", fingerprint="features-v1") as ck:
        ck.save(10, st, {"val_sharpe": 1.5}, {"fold": 1, "epoch": 4, "best_sharpe": 1.5,
                                              "bad_epochs": np.int64(2)})
        ck.wait()
        for target in (st, jax.eval_shape(lambda: _state())):  # concrete or abstract target
            got, extra = ck.restore(10, target)
            _assert_bitwise_equal(got, st)
            assert type(got.opt_state) is type(st.opt_state)
            assert type(adam_state(got.opt_state)) is optax.ScaleByAdamState
            assert jax.dtypes.issubdtype(got.key.dtype, jax.dtypes.prng_key)
            assert extra == {"fold": 1, "epoch": 4, "best_sharpe": 1.5, "bad_epochs": 2}
    # The restored key draws the same numbers.
    np.testing.assert_array_equal(jax.random.uniform(got.key, (4,)),
                                  jax.random.uniform(st.key, (4,)))


def test_a_directory_orbax_cannot_restore_from_is_refused(tmp_path):
    from jdqn.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"exp\[1\]/ck: the path holds '\[' '\]'"):
        Checkpointer(tmp_path / "exp[1]" / "ck")
    assert not (tmp_path / "exp[1]").exists()


def test_async_save_then_restore_while_the_state_moves_on(tmp_path):
    st = _state(1)
    expected = _state(1)  # the same values in separate buffers
    ck = Checkpointer(tmp_path / "ck", async_save=True)
    ck.save(1, st, {"val_sharpe": 0.3})
    # Training continues: donate and overwrite the saved state's buffers while the write runs.
    step = jax.jit(lambda s: s.replace(params=jax.tree.map(lambda p: p + 1.0, s.params),
                                       step=s.step + 1), donate_argnums=0)
    for _ in range(5):
        st = step(st)
    ck.save(2, st, {"val_sharpe": 0.1})
    ck.wait()
    got, _ = ck.restore(1, st)
    _assert_bitwise_equal(got, expected)
    got2, _ = ck.restore(None, st)  # latest
    _assert_bitwise_equal(got2, st)
    ck.close()


def test_a_failed_save_names_both_steps_and_a_full_disk_is_an_os_error(tmp_path, monkeypatch):
    """An asynchronous save's failure surfaces at the next save: the error names that step and
    the one before. A full disk (an OSError anywhere in orbax's chain of causes) stays an
    OSError, which the CLI reports with exit code 1, not as bad input (2)."""
    from jdqn.errors import CheckpointError

    st = _state()
    ck = Checkpointer(tmp_path / "ck", async_save=True)
    ck.save(1, st, {"val_sharpe": 0.3})
    ck.wait()

    def full(*a, **k):
        try:
            raise OSError(28, "No space left on device", str(tmp_path / "ck" / "2"))
        except OSError as e:
            raise RuntimeError("the background write failed") from e

    monkeypatch.setattr(ck._mngr, "save", full)
    with pytest.raises(OSError, match=r"cannot save checkpoint step 2 \(or finish the "
                                      r"asynchronous save of step 1\) in .*ck: No space left"
                       ) as info:
        ck.save(2, st, {"val_sharpe": 0.1})
    assert info.value.errno == 28 and not isinstance(info.value, CheckpointError)

    def broken(*a, **k):
        raise ValueError("a serialiser's complaint")

    monkeypatch.setattr(ck._mngr, "save", broken)
    with pytest.raises(CheckpointError, match=r"cannot save checkpoint step 2 \(or finish the "
                                              r"asynchronous save of step 1\).*complaint"):
        ck.save(2, st, {"val_sharpe": 0.1})
    # the last asynchronous save failing while the run waits for it (at the end of training):
    # a full disk is the machine's error, naming the step, not a bad checkpoint (exit 1, not 2)
    monkeypatch.setattr(ck._mngr, "wait_until_finished", full)
    with pytest.raises(OSError, match=r"the asynchronous save of checkpoint step 1 in .*ck "
                                      r"failed: No space left") as info:
        ck.wait()
    assert info.value.errno == 28 and not isinstance(info.value, CheckpointError)
    monkeypatch.setattr(ck._mngr, "wait_until_finished", broken)
    with pytest.raises(CheckpointError, match=r"step 1 in .*ck failed: ValueError"):
        ck.wait()

    def full_tensorstore(*a, **k):  # tensorstore reports the OS error inside a ValueError
        raise ValueError('RESOURCE_EXHAUSTED: Error writing "params/0" in OCDBT database: '
                         'Failed writing: "/ck/1/d/x": Failed to write 183 bytes to file 15: '
                         "No space left on device [os_error_code='28']")

    monkeypatch.setattr(ck._mngr, "save", full_tensorstore)
    with pytest.raises(OSError, match=r"cannot save checkpoint step 2 .*: No space left on "
                                      r"device") as info:
        ck.save(2, st, {"val_sharpe": 0.1})
    assert info.value.errno == 28 and info.value.filename == "/ck/1/d/x"
    monkeypatch.undo()
    ck.close()


def test_retention_keeps_best_n_by_sharpe_plus_latest_n(tmp_path):
    st = _state()
    sharpes = [0.5, 2.0, -1.0, float("nan"), 1.5, 0.1, 0.2]
    ck = Checkpointer(tmp_path / "ck", keep_best=2, keep_latest=2, async_save=True)
    for s, v in enumerate(sharpes):
        ck.save(s, st, {"val_sharpe": v, "loss": 1.0})
    ck.wait()
    assert ck.all_steps() == [1, 4, 5, 6]  # best two: 1 (2.0), 4 (1.5); latest two: 5, 6
    assert ck.best_step() == 1 and ck.latest_step() == 6
    ck.close()
    # A new process sees the same, reading the metrics from disk.
    ck = Checkpointer(tmp_path / "ck", keep_best=2, keep_latest=2)
    assert ck.best_step() == 1
    ck.save(7, st, {"val_sharpe": 3.0})
    ck.wait()
    assert ck.all_steps() == [1, 6, 7] and ck.best_step() == 7
    ck.close()


def test_a_changed_metrics_file_cannot_promote_its_checkpoint(tmp_path):
    import json
    import warnings

    st = _state()
    ck = Checkpointer(tmp_path / "ck", keep_best=3, keep_latest=1, async_save=False)
    for s, v in enumerate([1.0, 2.0, 0.5]):
        ck.save(s, st, {"val_sharpe": v})
    ck.close()
    f = tmp_path / "ck" / "2" / "metrics" / "metrics"  # orbax's metrics file of step 2
    saved = json.loads(f.read_text())
    assert saved["val_sharpe"] == 0.5 and "sha256" in saved
    f.write_text(json.dumps({**saved, "val_sharpe": 99.0}))  # edited after writing
    ck = Checkpointer(tmp_path / "ck", keep_best=3, keep_latest=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ck.best_step() == 1  # not the edited step 2
    assert any("do not match the digest" in str(w.message) for w in caught)
    ck.close()


def test_best_n_ranks_within_the_latest_fold(tmp_path):
    # Validation Sharpes of different folds come from different windows: a great fold-0 score
    # must not outrank the later fold's checkpoints (it did while ranking was by Sharpe alone).
    st = _state()
    ck = Checkpointer(tmp_path / "ck", keep_best=2, keep_latest=1, async_save=False)
    for step, (fold, v) in enumerate([(0, 50.0), (0, 40.0), (1, -3.0), (1, 2.0), (1, 1.0),
                                      (1, 0.5), (1, 60.0 - 100.0)]):
        ck.save(step, st, {"val_sharpe": v, "fold": fold})
    # best two of fold 1: step 3 (2.0), step 4 (1.0); latest: 6
    assert ck.all_steps() == [3, 4, 6] and ck.best_step() == 3
    ck.close()
    # Within one fold the order is the Sharpe's, also for large and close values.
    ck = Checkpointer(tmp_path / "ck2", keep_best=1, keep_latest=1, async_save=False)
    for step, v in enumerate([85.0, 86.0, float("inf"), 85.5]):
        ck.save(step, st, {"val_sharpe": v, "fold": 2})
    assert ck.all_steps() == [1, 3] and ck.best_step() == 1
    ck.close()


def test_foreign_layout_is_refused_with_a_clear_message(tmp_path):
    d = tmp_path / "ck"
    with Checkpointer(d, fingerprint="features-v1") as ck:
        ck.save(3, _state(), {"val_sharpe": 1.0})
    with Checkpointer(d, fingerprint="features-v2") as ck, pytest.raises(CheckpointError) as e:
        ck.restore(3, _state())
    msg = str(e.value)
    assert str(d / "3") in msg and "'features-v1'" in msg and "'features-v2'" in msg
    with Checkpointer(d, fingerprint="features-v1") as ck:
        with pytest.raises(CheckpointError) as e:
            ck.restore(3, _state(width=16))
        msg = str(e.value)
        assert str(d / "3") in msg and ".params['dense']['kernel']: [4, 8] float32" in msg
        assert "[4, 16] float32 expected" in msg
        bigger = {"state": _state(), "extra_leaf": jnp.zeros(2)}
        with pytest.raises(CheckpointError, match="missing from the checkpoint"):
            ck.restore(3, bigger)
        with pytest.raises(CheckpointError, match=r"no checkpoint for step 9 .*available: \[3\]"):
            ck.restore(9, _state())


def test_checkpoint_of_other_data_or_config_is_refused_naming_the_part(tmp_path):
    d = tmp_path / "ck"
    with Checkpointer(d, fingerprint="features=a1;data=d1;config=c1") as ck:
        ck.save(1, _state(), {"val_sharpe": 1.0})
    for want, names in (("features=a1;data=d2;config=c1", ["market data (d1 in the checkpoint vs d2 now)"]),
                        ("features=a1;data=d2;config=c2", ["market data", "config (c1"])):
        with Checkpointer(d, fingerprint=want) as ck, pytest.raises(CheckpointError) as e:
            ck.restore(1, _state())
        assert "written for other" in str(e.value)
        assert all(n in str(e.value) for n in names), str(e.value)


@pytest.mark.parametrize("damage", ["data", "layout", "metadata"])
def test_corrupted_checkpoint_is_refused_naming_the_path(tmp_path, damage):
    d = tmp_path / "ck"
    with Checkpointer(d) as ck:
        ck.save(5, _state(), {"val_sharpe": 1.0})
    if damage == "data":  # same-size garbage in every data file (OCDBT checksums catch it)
        files = glob.glob(str(d / "5" / "state" / "**" / "d" / "*"), recursive=True)
        assert files
        for f in files:
            with open(f, "r+b") as fh:
                fh.write(os.urandom(os.path.getsize(f)))
    elif damage == "layout":
        (d / "5" / "layout" / "metadata").write_text("{truncated")
    else:
        (d / "5" / "state" / "_METADATA").write_text("garbage")
    with Checkpointer(d) as ck, pytest.raises(CheckpointError, match=rf"checkpoint {d / '5'} is "
                                                "unreadable"):
        ck.restore(5, _state())


def test_orbax_read_failures_left_unretrieved_are_not_printed_again(tmp_path):
    """A corrupt checkpoint is reported once, as the CheckpointError: orbax's sibling read
    tasks that failed too, never retrieved, are dropped from asyncio's log; every other record
    passes."""
    import logging

    from jdqn.train.checkpoint import OrphanedReadFailureFilter

    def raised_in(filename: str) -> BaseException:
        ns: dict = {}
        code = compile("def boom():\n    raise ValueError('bad chunk')\n", filename, "exec")
        exec(code, ns)  # noqa: S102 - a function whose frames name this file
        try:
            ns["boom"]()
        except ValueError as e:
            return e
        raise AssertionError("boom did not raise")

    def record(msg: str, exc: BaseException | None) -> logging.LogRecord:
        info = (type(exc), exc, exc.__traceback__) if exc is not None else None
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, msg, None, info)

    f = OrphanedReadFailureFilter()
    orbax_exc = raised_in("/site-packages/orbax/checkpoint/_src/serialization/x.py")
    other_exc = raised_in("/site-packages/mylib/reader.py")
    orphan = "Task exception was never retrieved\nfuture: <Task finished ...>"
    assert f.filter(record(orphan, orbax_exc)) is False
    assert f.filter(record(orphan, other_exc)) is True
    gathering = "_GatheringFuture exception was never retrieved\nfuture: <_GatheringFuture …>"
    assert f.filter(record(gathering, orbax_exc)) is False  # a failed save's gathered writes
    assert f.filter(record(orphan, None)) is True
    assert f.filter(record("Unclosed client session", orbax_exc)) is True
    # a restore installs it on asyncio's logger, once
    d = tmp_path / "ck"
    with Checkpointer(d) as ck:
        ck.save(1, _state(), {"val_sharpe": 1.0})
        ck.restore(1, _state())
        ck.restore(1, _state())
    installed = [x for x in logging.getLogger("asyncio").filters
                 if isinstance(x, OrphanedReadFailureFilter)]
    assert len(installed) == 1


def test_bad_extra_json_and_fingerprint_contents(tmp_path):
    with Checkpointer(tmp_path / "ck") as ck, pytest.raises(CheckpointError, match="JSON-s"):
        ck.save(1, _state(), {"val_sharpe": 1.0}, {"fn": object()})
    fp = layout_fingerprint(_state(), "s")
    assert fp["schema"] == "s" and len(fp["sha256"]) == 64
    assert [".key", [], "key<fry>"] in fp["leaves"]
    assert layout_fingerprint(jax.eval_shape(lambda: _state()), "s") == fp


def test_a_flipped_bit_in_the_array_data_is_never_restored_silently(tmp_path):
    # Orbax alone restores such a checkpoint with the altered values when the flip lands in a
    # compressed block's literals (found by a probe: restore succeeded, arrays differed).
    # One bit is flipped at several places of the largest data file, each in a fresh copy:
    # every copy must be refused, and the checksum must be what refuses some of them.
    import shutil

    st = _state()
    big = jax.random.normal(jax.random.key(3), (50_000,), jnp.float32)
    st = st.replace(params={**st.params, "big": big})
    d = tmp_path / "ck"
    with Checkpointer(d) as ck:
        ck.save(5, st, {"val_sharpe": 1.0})
    with Checkpointer(d) as ck:  # intact: restores bitwise
        _assert_bitwise_equal(ck.restore(5, st)[0], st)
    files = glob.glob(str(d / "5" / "state" / "**" / "d" / "*"), recursive=True)
    largest = max(files, key=os.path.getsize)
    size = os.path.getsize(largest)
    outcomes = []
    for i in range(1, 8):
        trial = tmp_path / f"trial{i}"
        shutil.copytree(d, trial)
        f = trial / os.path.relpath(largest, d)
        data = bytearray(f.read_bytes())
        data[size * i // 8] ^= 0x10
        f.write_bytes(bytes(data))
        with Checkpointer(trial) as ck:
            try:
                ck.restore(5, st)
                outcomes.append("restored")
            except CheckpointError as e:
                msg = str(e)
                if "content checksum" in msg:
                    assert f"checkpoint {trial / '5'} is corrupt" in msg, msg
                    assert ".params['big']" in msg and "dense" not in msg, msg  # the leaf hit
                    outcomes.append("checksum")
                else:
                    assert "unreadable" in msg, msg
                    outcomes.append("unreadable")
    assert "restored" not in outcomes and "checksum" in outcomes, outcomes


def test_a_checkpoint_without_checksums_restores_with_a_warning(tmp_path):
    import json

    d = tmp_path / "ck"
    with Checkpointer(d) as ck:
        ck.save(5, _state(), {"val_sharpe": 1.0})
    f = d / "5" / "layout" / "metadata"
    layout = json.loads(f.read_text())
    assert set(layout["checksums"]) == {p for p, *_ in layout["leaves"]}
    del layout["checksums"]
    f.write_text(json.dumps(layout))
    with Checkpointer(d) as ck, pytest.warns(UserWarning, match="no content checksums"):
        _assert_bitwise_equal(ck.restore(5, _state())[0], _state())


@pytest.mark.parametrize("dtype", ["bool", "uint8", "int16", "bfloat16", "float16", "float32",
                                   "int32", "uint32", "float64", "int64", "complex64"])
def test_checksums_agree_on_device_and_host_and_catch_every_single_bit_flip(dtype):
    from helpers import x64

    from jdqn.train import checkpoint as ck_lib

    with x64():
        rng = np.random.default_rng(0)
        raw = rng.integers(0, 256, size=(37, 5))
        x = (np.asarray(raw % 2, bool) if dtype == "bool"
             else np.frombuffer(rng.bytes(37 * 5 * np.dtype(jnp.dtype(dtype)).itemsize),
                                jnp.dtype(dtype)).reshape(37, 5))
        dev = ck_lib.leaf_checksums({"x": jnp.asarray(x)})
        host = ck_lib.leaf_checksums({"x": x}, on_device=False)
        assert dev == host
        b = bytearray(x.tobytes())
        for pos in (0, len(b) // 3, len(b) - 1):
            for bit in (0, 7) if dtype != "bool" else (0,):
                y = bytearray(b)
                y[pos] ^= 1 << bit
                flipped = np.frombuffer(bytes(y), x.dtype).reshape(x.shape)
                assert ck_lib.leaf_checksums({"x": flipped}, on_device=False) != host
        # Two words swapped is damage too (the mixing depends on the position).
        if x.size > 1 and x.reshape(-1)[0] != x.reshape(-1)[1]:
            sw = x.copy().reshape(-1)
            sw[[0, 1]] = sw[[1, 0]]
            assert ck_lib.leaf_checksums({"x": sw.reshape(x.shape)}, on_device=False) != host


@pytest.mark.parametrize("group_words", [1 << 24, 40])
def test_checksums_of_many_leaves_summed_in_groups_are_each_leafs_own(monkeypatch, group_words):
    # The device sums small leaves in one pass over their concatenation (in groups of at most
    # _GROUP_MAX_WORDS words) and big ones alone: each leaf must still get its own checksum,
    # the host's, whatever its dtype, size (empty, scalar) and place in a group; damage to a
    # leaf's first or last word must move that leaf's checksum and no other.
    from helpers import x64

    from jdqn.train import checkpoint as ck_lib

    monkeypatch.setattr(ck_lib, "_GROUP_LEAF_WORDS", 64)  # leaves over 64 words go alone
    monkeypatch.setattr(ck_lib, "_GROUP_MAX_WORDS", group_words)
    rng = np.random.default_rng(3)

    def leaf(shape, dtype):
        dt = np.dtype(jnp.dtype(dtype))
        if dt == np.bool_:
            return rng.integers(0, 2, size=shape).astype(bool)
        n = int(np.prod(shape)) * dt.itemsize
        return np.frombuffer(rng.bytes(n), dt).reshape(shape).copy()

    with x64():
        tree = {"a": leaf((7, 5), "float32"), "b": leaf((0,), "float32"), "c": leaf((), "int32"),
                "d": leaf((7, 3), "bool"), "e": leaf((11,), "float64"),
                "f": leaf((5, 2), "complex64"), "g": leaf((9,), "bfloat16"),
                "h": leaf((13,), "uint8"), "i": leaf((3,), "complex128"),
                "j": leaf((65,), "float32"), "k": leaf((4, 4), "int64"), "l": leaf((2,), "int16"),
                "m": leaf((0, 3), "int64"), "n": leaf((1,), "uint32")}
        groups, alone = ck_lib._groups(list(tree.values()))
        assert [list(tree)[i] for i in alone] == ["j"]
        assert len(groups) == (1 if group_words > 1000 else 6)
        host = ck_lib.leaf_checksums(tree, on_device=False)
        assert ck_lib.leaf_checksums({k: jnp.asarray(v) for k, v in tree.items()}) == host
        # The program other backends run (every leaf alone) gives the same lanes.
        dev = [jnp.asarray(v) for v in tree.values()]
        np.testing.assert_array_equal(ck_lib._checksums_over(None, False)(dev),
                                      ck_lib._checksums_over(None, True)(dev))
        assert len(set(host.values())) == len(host) - 1  # the two empty leaves sum to 0
        for name in ("a", "c", "e", "h", "j", "k", "n"):
            for pos in (0, -1):
                hit = dict(tree)
                raw = bytearray(tree[name].tobytes())
                raw[pos] ^= 0x10
                hit[name] = np.frombuffer(bytes(raw), tree[name].dtype).reshape(
                    tree[name].shape)
                got = ck_lib.leaf_checksums({k: jnp.asarray(v) for k, v in hit.items()})
                assert got == ck_lib.leaf_checksums(hit, on_device=False)
                assert [k for k in host if got[k] != host[k]] == [f"['{name}']"]


def test_checksums_catch_structured_damage_a_weighted_sum_misses():
    # Σ (2i + 1)·w_i (the first version) cannot see two flips of bit 31 (two float32 sign
    # flips): 2³¹·(2i + 1) + 2³¹·(2j + 1) ≡ 0 mod 2³². Nor the same low bit flipped in words
    # i, j with i + j + 1 ≡ 0 mod 2^(31 − bit).
    from jdqn.train import checkpoint as ck_lib

    x = np.random.default_rng(1).normal(size=4096).astype(np.float32)
    weighted = lambda v: int(np.sum(v * (2 * np.arange(v.size, dtype=np.uint32) + 1),
                                    dtype=np.uint32))
    for i, j, bit in [(3, 700, 31), (0, 2047, 20), (5, 10, 0)]:
        words = x.view(np.uint32).copy()
        words[[i, j]] &= ~np.uint32(1 << bit)  # both bits 0 in the intact copy ...
        hit = words.copy()
        hit[[i, j]] |= np.uint32(1 << bit)  # ... and both flipped to 1 by the damage
        if bit:  # the weighted sum really is blind to these two
            assert weighted(hit) == weighted(words)
        assert (ck_lib.leaf_checksums({"x": hit.view(np.float32)}, on_device=False)
                != ck_lib.leaf_checksums({"x": words.view(np.float32)}, on_device=False))


def test_loop_state_damage_and_unreadable_dtypes_are_refused(tmp_path):
    import json

    d = tmp_path / "ck"
    with Checkpointer(d) as ck:
        ck.save(5, _state(), {"val_sharpe": 1.0}, {"fold": 2, "epoch": 7, "best": 1.25})
    f = d / "5" / "extra" / "metadata"
    extra = json.loads(f.read_text())
    assert extra["fold"] == 2
    f.write_text(f.read_text().replace('"fold": 2', '"fold": 3'))  # still valid JSON
    with Checkpointer(d) as ck, pytest.raises(CheckpointError, match="loop state .extra."):
        ck.restore(5, _state())
    with Checkpointer(tmp_path / "ck4") as ck, pytest.raises(CheckpointError,
                                                             match=r"\['q'\] \(int4\)"):
        ck.save(1, {"q": jnp.zeros(4, jnp.int4)}, {"val_sharpe": 0.0})


def test_orbax_error_records_keep_their_line_and_lose_the_traceback():
    """A full disk during an asynchronous save: each orbax thread logged its traceback (600
    lines around our one-line error); the filter keeps each record's line only, and leaves
    everyone else's records alone."""
    import logging

    from jdqn.train.checkpoint import OrbaxTracebackFilter

    try:
        raise OSError(28, "No space left on device")
    except OSError as e:
        info = (type(e), e, e.__traceback__)
    f = OrbaxTracebackFilter()
    for path, kept in (("/site-packages/orbax/checkpoint/_src/futures/future.py", False),
                       ("/site-packages/mylib/x.py", True)):
        rec = logging.LogRecord("absl", logging.ERROR, path, 1, "thread raised", None, info)
        assert f.filter(rec) is True and rec.getMessage() == "thread raised"
        assert (rec.exc_info is not None) is kept
