"""Checkpoints on orbax-checkpoint 0.12: async saves, best-N + latest-N retention, a layout
fingerprint checked before every restore, and clear errors for foreign or corrupt checkpoints.

Each checkpoint step ``<directory>/<step>/`` holds three items:

* ``state``  — the whole train-state pytree (``StandardSave``), with typed PRNG keys stored as
  their raw ``key_data`` (uint32) and wrapped back on restore, so key round-trips do not depend
  on how a given orbax version handles extended dtypes;
* ``extra``  — a JSON dict of host-side loop state (fold index, epoch, best Sharpe, early-stop
  counter, …);
* ``layout`` — the layout fingerprint (JSON): every leaf's path, shape and dtype, the caller's
  feature-schema string and their SHA-256; plus a content checksum per leaf (below).

**Content checksums.** Orbax restores a checkpoint whose array bytes were altered after writing
(a flipped bit on disk, a damaged copy) without complaint, and the run would resume from wrong
numbers. Each leaf's stored bytes, as little-endian 32-bit words ``w_i`` (1- and 2-byte elements
widened, 8-byte ones split into two words, complex ones as their two parts), get two 32-bit
lanes ``Σ_i fmix32(w_i ⊕ fmix32(a·i + c)) mod 2³²`` (``fmix32`` MurmurHash3's finaliser, one
``(a, c)`` per lane), stored as one 64-bit number. The sums are taken on the device when saving
(exact integer arithmetic, so any reduction order gives the same number: deterministic on the
GPU and across data-parallel shards; small leaves are summed in one pass over their concatenation,
big ones alone), and again on the restored arrays; a mismatch refuses the
checkpoint, naming the leaves. (The NumPy version, the same numbers, is the tests' oracle.) ``fmix32`` is a bijection, so any change confined to one word —
every single-bit flip — is always caught; other damage escapes only if both lanes' sums collide
by chance, about 2⁻⁶⁴ (a plain weighted sum ``Σ (2i + 1)·w_i``, the first version, missed
structured damage such as two sign flips). The ``extra`` item (the loop state) is covered by a
SHA-256 of its JSON, also stored with the layout.

and orbax's metrics file (``metrics``, e.g. ``{"val_sharpe": 1.3}``) used for retention, with
the SHA-256 of its content under ``sha256``: a metrics file changed after it was written ranks
lowest (with a warning) instead of promoting its checkpoint.

Retention keeps the union of the ``keep_best`` checkpoints with the highest ``metric`` (higher is
better; a missing or non-finite value ranks lowest) and the ``keep_latest`` most recent ones.
With a ``group`` key (default ``"fold"``) in the metrics, checkpoints of a later group rank above
every checkpoint of an earlier one and the metric ranks within a group: validation Sharpes of
different walk-forward folds come from different windows and are not comparable, so "best" means
best on the latest fold's validation window
(``BestN`` + ``LatestN`` under ``AnyPreservationPolicy``; orbax ≥ 0.11.x, present in 0.12.4 and
0.12.8).

Async: :meth:`Checkpointer.save` returns once the device→host copy is done; writing goes on in
a background thread. The caller may then donate/overwrite the state buffers. :meth:`wait`
blocks until every pending write is committed (call it before reading a checkpoint back and
before the process exits; :meth:`close` does).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jdqn.config import checkpoint_path_problem
from jdqn.errors import CheckpointError

PyTree = Any


# ---------------------------------------------------------------------------------------------
# layout fingerprint
# ---------------------------------------------------------------------------------------------


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)


def layout_fingerprint(state: PyTree, schema: str = "") -> dict[str, Any]:
    """Paths, shapes and dtypes of every leaf of ``state`` (concrete or abstract) plus the
    caller's feature-schema string, and a SHA-256 over all of it."""
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    leaves = [[jax.tree_util.keystr(p), [int(d) for d in np.shape(x)], str(x.dtype)]
              for p, x in flat]
    body = {"schema": schema, "leaves": leaves}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    return {**body, "sha256": digest}


_SCHEMA_PARTS = {"features": "the features", "data": "the market data",
                 "config": "the config", "devices": "the device count"}


def _schema_diff(saved: str, want: str) -> str:
    """Which part of a ``k=v;k=v`` schema string differs (the job's: features, data, config)."""
    def parts(text: str) -> dict[str, str]:
        return dict(kv.split("=", 1) for kv in text.split(";") if "=" in kv)

    a, b = parts(saved), parts(want)
    if not a or not b:
        return f"feature schema {saved!r} in the checkpoint vs {want!r} expected"
    for x in (a, b):  # one-device runs write no devices part
        x.setdefault("devices", "1")
    named = [f"{_SCHEMA_PARTS.get(k, k)} ({a.get(k)} in the checkpoint vs {b.get(k)} now)"
             for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return "it was written for other " + " and ".join(
        n.removeprefix("the ") for n in named)


def _layout_diff(saved: dict[str, Any], want: dict[str, Any], limit: int = 6) -> str:
    out = []
    if saved.get("schema") != want["schema"]:
        out.append(_schema_diff(str(saved.get("schema")), str(want["schema"])))
    a = {p: (s, d) for p, s, d in saved.get("leaves", [])}
    b = {p: (s, d) for p, s, d in want["leaves"]}
    only_a, only_b = [p for p in a if p not in b], [p for p in b if p not in a]
    changed = [f"{p}: {a[p][0]} {a[p][1]} in the checkpoint vs {b[p][0]} {b[p][1]} expected"
               for p in a if p in b and a[p] != b[p]]

    def some(xs: list[str]) -> str:
        return ", ".join(xs[:limit]) + (f" (+{len(xs) - limit} more)" if len(xs) > limit else "")

    if only_a:
        out.append(f"{len(only_a)} leaves only in the checkpoint: {some(only_a)}")
    if only_b:
        out.append(f"{len(only_b)} leaves missing from the checkpoint: {some(only_b)}")
    if changed:
        out.append(f"{len(changed)} leaves changed: {some(changed)}")
    if not out and list(a) != list(b):
        out.append("same leaves in a different order (the tree structure changed)")
    return "; ".join(out) or "fingerprint differs"


# ---------------------------------------------------------------------------------------------
# typed PRNG keys
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# content checksums
# ---------------------------------------------------------------------------------------------


def _readable(dt: np.dtype) -> bool:
    """Whether an array of ``dt`` can be read as whole little-endian words (not e.g. int4)."""
    return dt.kind == "c" or (dt.itemsize in (1, 2, 4, 8)
                              and (dt.kind in "biuf" or "float" in dt.name))


def _words(x: Any, xp: Any) -> Any:
    """The uint32 words of an array's little-endian bytes, flat (``xp`` = numpy or jax.numpy;
    the two give the same words)."""
    dt = np.dtype(x.dtype)
    if dt == np.bool_:
        return x.reshape(-1).astype(xp.uint8).astype(xp.uint32)
    if dt.kind == "c":  # complex: real and imaginary parts, interleaved as stored
        part = xp.stack([xp.real(x), xp.imag(x)], axis=-1)
        return _words(part, xp)
    if not _readable(dt):
        raise TypeError(f"cannot checksum dtype {dt}")
    if xp is np:
        w = np.ascontiguousarray(x).reshape(-1).view(f"<u{dt.itemsize}")
    else:
        w = jax.lax.bitcast_convert_type(x.reshape(-1), getattr(jnp, f"uint{8 * dt.itemsize}"))
    if dt.itemsize == 8:  # low and high halves (exact in both numpy and 64-bit JAX)
        return xp.concatenate([(w & 0xFFFFFFFF).astype(xp.uint32), (w >> 32).astype(xp.uint32)])
    return w.astype(xp.uint32)


def _fmix32(h: Any, xp: Any) -> Any:
    """MurmurHash3's 32-bit finaliser: a bijection of uint32 that mixes every input bit into
    every output bit (wrapping uint32 arithmetic, the same in NumPy and XLA)."""
    h = h ^ (h >> 16)
    h = h * xp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * xp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


_LANES = ((0x9E3779B9, 1), (0x7F4A7C15, 0x632BE5AB))  # (index multiplier, offset) per lane


def _checksum(x: Any, xp: Any) -> tuple[Any, Any]:
    """Two 32-bit lanes ``Σ_i fmix32(w_i ⊕ fmix32(a·i + c)) mod 2³²`` over the words."""
    w = _words(x, xp)
    i = xp.arange(w.shape[0], dtype=xp.uint32)
    return tuple(xp.sum(_fmix32(w ^ _fmix32(i * xp.uint32(a) + xp.uint32(c), xp), xp),
                        dtype=xp.uint32) for a, c in _LANES)


# On the CPU, leaves of at most this many words share one pass (concatenated, summed per leaf);
# bigger ones (the replay's arrays) are summed alone, so the pass never copies them. A group is
# closed at _GROUP_MAX_WORDS words. On other backends every leaf is summed alone: on the H200
# the gpu.toml state's grouped pass took 10.5-10.7 ms against 3.75 ms one program per leaf
# (a version with blocked sums instead of the long segment sum: 13 ms; the cost is the
# many-operand concatenation), while there the per-leaf program's compile is not what a run
# waits for.
_GROUP_LEAF_WORDS = 1 << 20
_GROUP_MAX_WORDS = 1 << 24


def _n_words(x: Any) -> int:
    """How many words :func:`_words` makes of ``x`` (from its shape and dtype alone)."""
    return int(np.prod(np.shape(x), dtype=np.int64)) * max(1, np.dtype(x.dtype).itemsize // 4)


def _groups(leaves: list[Any]) -> tuple[list[list[int]], list[int]]:
    """Leaf indices in groups summed in one pass, and the indices summed alone."""
    groups: list[list[int]] = []
    alone: list[int] = []
    n = 0
    for i, x in enumerate(leaves):
        w = _n_words(x)
        if w > _GROUP_LEAF_WORDS:
            alone.append(i)
            continue
        if not groups or n + w > _GROUP_MAX_WORDS:
            groups.append([])
            n = 0
        groups[-1].append(i)
        n += w
    return groups, alone


def _grouped_checksums(words: list[jax.Array]) -> jax.Array:
    """:func:`_checksum` of each flat word vector of ``words`` (uint32 ``[k, 2]``) in one pass
    over their concatenation: each word is mixed with its index within its own leaf, and the
    mixed words are summed per leaf (a segment sum: uint32 addition is exact in any order, so
    these are the numbers each leaf summed alone gives). One pass instead of one per leaf: on
    the quickstart's 253 leaves the CPU program took 1.9 s to trace and compile instead of
    10.3 s."""
    w = jnp.concatenate(words)
    i = jnp.concatenate([jnp.arange(x.shape[0], dtype=jnp.uint32) for x in words])
    seg = jnp.concatenate([jnp.full((x.shape[0],), k, jnp.int32) for k, x in enumerate(words)])
    mixed = jnp.stack([_fmix32(w ^ _fmix32(i * jnp.uint32(a) + jnp.uint32(c), jnp), jnp)
                       for a, c in _LANES], axis=-1)
    return jax.ops.segment_sum(mixed, seg, num_segments=len(words), indices_are_sorted=True)


def _checksum_lanes(leaves: list[jax.Array], grouped: bool = True) -> jax.Array:
    """Every leaf's two checksum lanes, uint32 ``[n, 2]`` in leaf order; ``grouped``: small
    leaves in one pass (:func:`_groups`), else every leaf alone."""
    if not leaves:
        return jnp.zeros((0, 2), jnp.uint32)
    groups, alone = _groups(leaves) if grouped else ([], list(range(len(leaves))))
    parts = [_grouped_checksums([_words(leaves[i], jnp) for i in g]) for g in groups]
    parts += [jnp.stack(_checksum(leaves[i], jnp))[None] for i in alone]
    order = [i for g in groups for i in g] + alone
    return jnp.concatenate(parts)[np.argsort(np.array(order))]


def _device_checksums(leaves: list[jax.Array]) -> jax.Array:
    """All leaves' checksum lanes as one uint32 ``[n, 2]`` array (one device→host transfer).
    Over a mesh that spans processes, the result is asked for replicated, so that every
    process can read it (XLA would otherwise be free to leave it split)."""
    mesh = next((x.sharding.mesh for x in leaves
                 if isinstance(x.sharding, jax.sharding.NamedSharding)
                 and not x.sharding.is_fully_addressable), None)
    platform = next(iter(leaves[0].devices())).platform if leaves else "cpu"
    return _checksums_over(mesh, platform == "cpu")(leaves)


@functools.cache
def _checksums_over(mesh: jax.sharding.Mesh | None, grouped: bool):
    fn = functools.partial(_checksum_lanes, grouped=grouped)
    if mesh is None:
        return jax.jit(fn)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.jit(fn, out_shardings=rep)


def compile_checksums(abstract_state: PyTree) -> None:
    """Compile the checksum program :meth:`Checkpointer.save` runs on a one-device state of
    these shapes (``jax.ShapeDtypeStruct`` leaves, typed keys included), without running it
    (:mod:`jdqn.train.ahead`)."""
    leaves = jax.tree.leaves(jax.eval_shape(_encode_keys, abstract_state))
    _checksums_over(None, jax.default_backend() == "cpu").lower(leaves).compile()


def leaf_checksums(tree: PyTree, on_device: bool = True) -> dict[str, int]:
    """``{leaf path: 64-bit checksum}`` of a pytree of arrays (typed keys already as key data).
    Raises TypeError for a dtype it cannot read as words (e.g. int4)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    bad = [f"{p} ({x.dtype})" for p, (_, x) in zip(paths, flat, strict=True)
           if not _readable(np.dtype(x.dtype))]
    if bad:
        raise TypeError(f"cannot checksum {', '.join(bad[:4])}: not a whole-byte numeric dtype")
    if on_device:
        lanes = np.asarray(jax.device_get(_device_checksums([x for _, x in flat]))).tolist()
    else:
        lanes = [[int(v) for v in _checksum(np.asarray(x), np)] for _, x in flat]
    return {p: int(lo) | (int(hi) << 32) for p, (lo, hi) in zip(paths, lanes, strict=True)}


METRICS_DIGEST = "sha256"  # key of the digest stored in each checkpoint's metrics


def extra_digest(extra: dict[str, Any]) -> str:
    """SHA-256 of the ``extra`` item's JSON (sorted keys): the loop state is checked too."""
    return hashlib.sha256(json.dumps(extra, sort_keys=True).encode()).hexdigest()


def _encode_keys(state: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, state)


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    """Restore target of one leaf: shape/dtype (key → its uint32 data) and a sharding."""
    sharding = getattr(x, "sharding", None)
    if _is_key(x):  # its data takes the key's layout (a spec leaves the trailing axis whole)
        x = jax.eval_shape(jax.random.key_data, x)
    if sharding is None:  # e.g. from jax.eval_shape: place on the first local device
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def _key_impls(state: PyTree) -> dict[str, str]:
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    return {jax.tree_util.keystr(p): str(jax.random.key_impl(x)) for p, x in flat if _is_key(x)}


def _decode_keys(restored: PyTree, abstract_state: PyTree, impls: dict[str, str]) -> PyTree:
    """Typed PRNG keys back from their saved key data; every one-device array re-made
    *uncommitted* (as a fresh run's arrays are: orbax returns arrays committed to a device, and
    committedness is part of jit's cache key, so the first epoch after a resume would compile
    the whole program a second time)."""
    flat_abs, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    # (Arrays restored over several devices stay as they are: a fresh data-parallel state is
    # committed to the same layout.)
    flat_new = [x if len(x.sharding.device_set) > 1 else jnp.asarray(np.asarray(x))
                for x in treedef.flatten_up_to(restored)]
    out = []
    for (p, a), x in zip(flat_abs, flat_new, strict=True):
        if _is_key(a):
            out.append(jax.random.wrap_key_data(x, impl=impls.get(jax.tree_util.keystr(p),
                                                                  "threefry2x32")))
        else:
            out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)


# ---------------------------------------------------------------------------------------------
# the checkpointer
# ---------------------------------------------------------------------------------------------


def _os_error_in(e: BaseException) -> OSError | None:
    """The first OSError in ``e``'s chain of causes (orbax wraps its writers' errors), or one
    made from the first error of tensorstore's that carries an operating-system error code
    (``… No space left on device [os_error_code='28']`` in a ValueError)."""
    import re

    seen, chain = set(), []
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    for err in chain:
        code = re.search(r"\[os_error_code='(\d+)'\]", str(err))
        if code:
            path = re.search(r'Failed writing: "([^"]+)"', str(err))
            n = int(code.group(1))
            return OSError(n, os.strerror(n), path.group(1) if path else None)
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def _jsonable(d: dict[str, Any] | None, what: str) -> dict[str, Any]:
    def default(o: Any) -> Any:
        if isinstance(o, (np.generic, jax.Array)) and np.ndim(o) == 0:
            return np.asarray(o).item()
        if isinstance(o, (np.ndarray, jax.Array)):
            return np.asarray(o).tolist()
        raise TypeError(f"{type(o).__name__} is not JSON serialisable")

    try:
        return json.loads(json.dumps(d or {}, default=default))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {what} must be JSON-serialisable: {e}") from None


_QUIET_HOOK_INSTALLED = False


def _quiet_failed_reads() -> None:
    """Keep a failed read's report to our one-line error. Installed once, before any read:

    * when a restore fails, tensorstore may still deliver read callbacks to orbax's event loop
      after orbax closed it, during or after the failing call; each raises
      ``RuntimeError('Event loop is closed')`` as an "unraisable" exception whose traceback
      would bury the error — a ``sys.unraisablehook`` drops exactly those and passes
      everything else to the previous hook;
    * orbax's sibling read tasks that failed too are never retrieved, and asyncio would log
      each with a traceback: :class:`OrphanedReadFailureFilter` on the ``asyncio`` logger."""
    global _QUIET_HOOK_INSTALLED
    if _QUIET_HOOK_INSTALLED:
        return
    logging.getLogger("asyncio").addFilter(OrphanedReadFailureFilter())
    logging.getLogger("absl").addFilter(OrbaxTracebackFilter())
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        exc = unraisable.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        previous(unraisable)

    sys.unraisablehook = hook
    _QUIET_HOOK_INSTALLED = True


class OrbaxTracebackFilter(logging.Filter):
    """Keeps orbax's own error records to their one line: a failed asynchronous save (a full
    disk) made each of orbax's background threads log its traceback — 600 lines around the
    one-line error :meth:`Checkpointer.wait` raises, which names the step and the folder.
    Records from elsewhere pass untouched."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "orbax" in (record.pathname or "") and record.exc_info:
            record.exc_info = None
            record.exc_text = None
        return True


class OrphanedReadFailureFilter(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" reports of orbax's read tasks.

    When arrays of a corrupt checkpoint fail to read, orbax raises the first failure — which
    :meth:`Checkpointer.restore` reports as a :class:`CheckpointError` naming the checkpoint —
    and leaves its sibling read tasks' failures unretrieved; asyncio then logs each one, with a
    traceback, whenever the task is collected (during the error message, or at exit). Those
    say nothing the error does not. Every other record passes: other messages, and unretrieved
    task failures whose traceback does not run through orbax."""

    def filter(self, record: logging.LogRecord) -> bool:
        first = str(record.msg).split("\n", 1)[0]
        if not first.endswith("exception was never retrieved"):  # a Task's or a Future's
            return True
        exc = record.exc_info[1] if record.exc_info else None
        tb = exc.__traceback__ if exc is not None else None
        while tb is not None:
            if "orbax" in tb.tb_frame.f_code.co_filename:
                return False
            tb = tb.tb_next
        return True


class Checkpointer:
    """Async orbax checkpoints with best-N/latest-N retention and a layout check on restore.

    ``fingerprint`` is the caller's feature-schema string (e.g. the feature cache's schema hash
    plus the state width); it is combined with the state's tree layout into the stored layout
    fingerprint. ``metric`` names the key of ``metrics`` ranked for best-N (higher is better).
    """

    def __init__(self, directory: str | Path, keep_best: int = 2, keep_latest: int = 2,
                 async_save: bool = True, fingerprint: str = "", metric: str = "val_sharpe",
                 group: str = "fold"):
        self.directory = Path(directory).absolute()
        self._async = async_save
        self._last_started: int | None = None
        _quiet_failed_reads()  # and failed writes: orbax's threads' tracebacks (a full disk)
        problem = checkpoint_path_problem(self.directory)
        if problem:
            raise CheckpointError(f"checkpoint directory {self.directory}: {problem}; use a "
                                  "folder whose path has none")
        self.schema = fingerprint
        self.metric = metric
        self.group = group
        self._metrics: dict[int, dict[str, Any]] = {}
        policy = ocp.checkpoint_managers.AnyPreservationPolicy([
            ocp.checkpoint_managers.LatestN(n=keep_latest),
            ocp.checkpoint_managers.BestN(get_metric_fn=self._rank, n=keep_best, reverse=False,
                                          keep_checkpoints_without_metrics=False),
        ])
        # best_fn is set as well only so that orbax writes the metrics to disk (it does so only
        # when it "tracks the best"): without them a restarted run would see the old
        # checkpoints as metric-less and BestN would delete the best ones at the next save.
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policy, best_fn=self._rank, best_mode="max",
            enable_async_checkpointing=async_save, create=True)
        try:
            self._mngr = ocp.CheckpointManager(self.directory, options=options)
        except Exception as e:  # any orbax failure becomes a user-facing error
            raise CheckpointError(f"cannot open checkpoint directory {self.directory}: "
                                  f"{_first_line(e)}") from e

    def _rank(self, metrics: Any) -> float:
        """``group + ½ + atan(metric)/π``: the group orders first (an integer ≥ 0; absent = 0),
        the metric, squeezed monotonically into (0, 1), within it; −inf without a finite
        metric."""
        if not isinstance(metrics, dict):
            return -math.inf
        if METRICS_DIGEST in metrics:  # written with a digest: a changed value ranks lowest
            body = {k: x for k, x in metrics.items() if k != METRICS_DIGEST}
            if metrics[METRICS_DIGEST] != extra_digest(body):
                warnings.warn(f"checkpoint metrics {body} in {self.directory} do not match the "
                              "digest stored with them (the file changed after it was "
                              "written): ranked lowest for retention", stacklevel=2)
                return -math.inf
        try:
            v = float(metrics.get(self.metric))
            g = float(metrics.get(self.group, 0))
        except (TypeError, ValueError):
            return -math.inf
        if not (math.isfinite(v) and math.isfinite(g)):
            return -math.inf
        return g + 0.5 + math.atan(v) / math.pi

    # -- queries ---------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        return sorted(self._mngr.all_steps())

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def metrics(self, step: int) -> dict[str, Any] | None:
        if step in self._metrics:
            return self._metrics[step]
        try:
            return self._mngr.metrics(step)
        except (OSError, ValueError, KeyError, TypeError):  # unreadable metrics rank lowest
            return None

    def best_step(self) -> int | None:
        """The retained step with the highest ``metric`` (ties: the later step); None if no
        retained checkpoint has a finite value."""
        best, best_v = None, -math.inf
        for s in self.all_steps():
            v = self._rank(self.metrics(s) or {})
            if v > -math.inf and v >= best_v:
                best, best_v = s, v
        return best

    # -- save / restore ----------------------------------------------------------------------

    def save(self, step: int, state: PyTree, metrics: dict[str, Any] | None = None,
             extra_json: dict[str, Any] | None = None) -> None:
        """Start saving ``state`` at ``step``; returns after the device→host copy."""
        metrics = _jsonable(metrics, "metrics")
        # Orbax's metrics file ranks retention: it carries a digest too (checked in _rank).
        metrics = {**metrics, METRICS_DIGEST: extra_digest(metrics)}
        extra = _jsonable(extra_json, "extra_json")
        layout = layout_fingerprint(state, self.schema)
        layout["key_impls"] = _key_impls(state)
        encoded = _encode_keys(state)
        layout["extra_sha256"] = extra_digest(extra)
        try:
            layout["checksums"] = leaf_checksums(encoded)
        except TypeError as e:
            raise CheckpointError(f"cannot save checkpoint step {step} in {self.directory}: "
                                  f"{e}") from e
        args = ocp.args.Composite(state=ocp.args.StandardSave(encoded),
                                  extra=ocp.args.JsonSave(extra),
                                  layout=ocp.args.JsonSave(layout))
        try:
            self._mngr.save(int(step), args=args, metrics=metrics, force=True)
        except Exception as e:
            # An asynchronous save's failure surfaces at the next save: name both steps.
            prev = self._last_started
            what = f"checkpoint step {step}" + (
                f" (or finish the asynchronous save of step {prev})"
                if self._async and prev is not None else "")
            os_error = _os_error_in(e)
            if os_error is not None:  # the machine, not the input: the CLI's exit code 1
                raise OSError(os_error.errno, f"cannot save {what} in {self.directory}: "
                              f"{os_error.strerror or os_error}", os_error.filename) from e
            raise CheckpointError(f"cannot save {what} in {self.directory}: "
                                  f"{_first_line(e)}") from e
        self._last_started = int(step)
        self._metrics[int(step)] = metrics

    def _step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def read_layout(self, step: int) -> dict[str, Any]:
        """The stored layout fingerprint of ``step`` (raises CheckpointError if unreadable)."""
        self._check_step(step)
        _quiet_failed_reads()
        try:
            out = self._mngr.restore(step, args=ocp.args.Composite(layout=ocp.args.JsonRestore()))
            layout = out["layout"]
            if not isinstance(layout, dict) or "sha256" not in layout:
                raise ValueError("no layout fingerprint")
            return layout
        except Exception as e:
            raise CheckpointError(f"checkpoint {self._step_dir(step)} is unreadable (corrupt, "
                                  f"incomplete or not a jdqn checkpoint): {_first_line(e)}") from e

    def _check_step(self, step: int) -> None:
        if step not in self._mngr.all_steps():
            have = self.all_steps()
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory} "
                                  f"(available: {have or 'none'})")

    def restore(self, step: int | None, abstract_state: PyTree) -> tuple[PyTree, dict[str, Any]]:
        """Restore ``step`` (None = latest) into the layout of ``abstract_state`` (a concrete
        state or ``jax.eval_shape`` of one; its shardings are used where present).

        Raises CheckpointError, naming the checkpoint directory, when there is no such step, the
        layout fingerprint differs (listing what differs) or the files are corrupt.
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"no checkpoint to restore in {self.directory}")
        step = int(step)
        self.wait()
        saved = self.read_layout(step)
        want = layout_fingerprint(abstract_state, self.schema)
        if saved["sha256"] != want["sha256"]:
            raise CheckpointError(f"checkpoint {self._step_dir(step)} does not match this run's "
                                  f"state layout: {_layout_diff(saved, want)}")
        target = jax.tree.map(_abstract, abstract_state)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                  extra=ocp.args.JsonRestore())
        _quiet_failed_reads()
        try:
            out = self._mngr.restore(step, args=args)
        except Exception as e:
            raise CheckpointError(f"checkpoint {self._step_dir(step)} is unreadable (corrupt or "
                                  f"incomplete): {_first_line(e)}") from e
        sums = saved.get("checksums")
        if isinstance(sums, dict):
            got = leaf_checksums(out["state"])  # on the device the arrays came back to
            bad = [p for p in got if p in sums and int(sums[p]) != got[p]][:4]
            missing = [p for p in got if p not in sums][:4]
            if bad or missing:
                what = (f"{', '.join(bad)} {'does' if len(bad) == 1 else 'do'} not match the "
                        f"content checksum stored with it" if bad else
                        f"no content checksum is stored for {', '.join(missing)}")
                raise CheckpointError(
                    f"checkpoint {self._step_dir(step)} is corrupt: {what} (its files changed "
                    f"after they were written); delete that step's folder to resume from the "
                    f"checkpoint before it, or start anew")
            digest = saved.get("extra_sha256")
            if digest is not None and digest != extra_digest(dict(out["extra"] or {})):
                raise CheckpointError(
                    f"checkpoint {self._step_dir(step)} is corrupt: its loop state (extra) "
                    f"does not match the digest stored with it (its files changed after they "
                    f"were written); delete that step's folder to resume from the checkpoint "
                    f"before it, or start anew")
        else:
            warnings.warn(f"checkpoint {self._step_dir(step)} has no content checksums "
                          f"(written by an older jdqn): its arrays cannot be verified",
                          stacklevel=2)
        state = _decode_keys(out["state"], abstract_state, saved.get("key_impls", {}))
        return state, dict(out["extra"] or {})

    def wait(self) -> None:
        """Block until every pending asynchronous save is committed."""
        try:
            self._mngr.wait_until_finished()
        except Exception as e:
            what = ("an asynchronous checkpoint save" if self._last_started is None else
                    f"the asynchronous save of checkpoint step {self._last_started}")
            os_error = _os_error_in(e)
            if os_error is not None:  # a full disk, a vanished folder: the CLI's exit code 1
                raise OSError(os_error.errno, f"{what} in {self.directory} failed: "
                              f"{os_error.strerror or os_error}", os_error.filename) from e
            raise CheckpointError(f"{what} in {self.directory} failed: {_first_line(e)}") from e

    def close(self) -> None:
        self.wait()
        self._mngr.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
