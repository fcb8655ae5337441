"""Data-parallel training over the devices of one host (``parallel.n_devices``).

The epoch runs under ``jax.shard_map`` over a one-axis mesh ``("data",)`` of D devices. Each
device holds an equal share of what scales with the data, and a copy of everything else:

=======================================  ====================================================
sharded (a contiguous block per device)  replicated (identical on every device)
=======================================  ====================================================
env state (``N/D`` envs)                 params, target params, best params, optimiser state
n-step window carry (``N/D`` envs)       reward-normaliser statistics, MoE state, NaN monitor
replay items and priorities (``C/D``)    replay position, size and max priority, PRNG key,
                                         step counters
=======================================  ====================================================

A device collects from its own envs into its own replay shard and samples ``B/D`` transitions
from it; the gradient is the mean over all D shards (an all-reduce), so every device applies the
same optimiser step to the same params. What the single-device program computes over the whole
batch or all envs is computed over the global batch here too, with a collective:

* the gradient and the loss components: ``pmean`` (equal shares, so the mean of the shard means
  is the global mean);
* the MoE load-balance term ``λ·K·Σ_k ū_k²`` and the gate-entropy EMA: ``ū`` is the global
  utilisation (``pmean``); the loss is written so that its gradient after the all-reduce is
  exactly the global term's gradient (:func:`jdqn.losses.total.total_loss`);
* the reward normaliser: its quantiles are taken over the rewards of all envs (``all_gather``
  of N floats per step), so it is the statistic the single-device run would take;
* PER: each device samples its shard with probabilities ∝ p^α within the shard. The importance
  weight ``(n·P)^-β`` of a slot is the same whether written with the shard's or the global
  sampling probability (each shard contributes B/D of the batch), and the weights are divided
  by their maximum over the global batch (``pmax``), as one device would. New items get the
  global max priority (``pmax`` after every update), so a shard does not lag;
* the replay-readiness test (``min_replay``) counts sampleable slots over all shards; the
  finite-tensor flags are AND-ed over devices, so every device halts on the same update; the
  Q statistics behind the Q-drift halt and the diagnostics are global means and spreads.

The replay's position and size are replicated but are per-shard values (≤ C/D): every shard
inserts the same number of items per iteration, so they agree.

Exploration, env resets, PER draws and IQN τ samples draw from the replicated key folded with
the device index, so the shards explore differently and the key in the state stays replicated
(a checkpoint holds one key, as on one device).

This is not bit-for-bit the single-device program on the same global sizes (the PER draws and
the exploration noise are split differently), but it is the same algorithm on the same global
batch; the tests check the gradient against one device's on the same batch, the replicated
leaves for equality across devices, and bitwise repeatability (docs/training.md).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jdqn.config import Config, ConfigError, check_divides
from jdqn.train import xla_options

AXIS = "data"
Array = jax.Array


def resolve_n_devices(cfg: Config, devices: list[Any] | None = None) -> int:
    """The device count the job trains on (``parallel.n_devices``; 0 = every device JAX sees),
    checked against the devices present (``devices``, default ``jax.devices()``) and the sizes
    it must divide."""
    want = cfg.parallel.n_devices
    if cfg.parallel.distributed and devices is None and jax.process_count() > 1 \
            and want not in (0, jax.device_count()):
        raise ConfigError(f"parallel.n_devices = {want} with parallel.distributed = true: a "
                          f"multi-host job trains on every device of every process (here "
                          f"{jax.device_count()} on {jax.process_count()} processes); use 0")
    if want == 1:
        return 1
    devices = jax.devices() if devices is None else devices
    n = len(devices) if want == 0 else want
    if n > len(devices):
        raise ConfigError(f"parallel.n_devices = {want}, but JAX sees {len(devices)} "
                          f"{getattr(devices[0], 'platform', '')} device(s); lower n_devices "
                          "(0 = all of them)")
    # (config files are checked when loaded; a Config built in Python is checked here too, so
    # a batch that does not divide is never silently cut to D·(B // D))
    check_divides(cfg, n, f"parallel.n_devices = 0 (every device JAX sees: {n})" if want == 0
                  else f"parallel.n_devices = {n}")
    return n


def replicate(tree: Any, n_devices: int) -> Any:
    """``tree`` copied to each of the first ``n_devices`` devices (unchanged on one device):
    the env params the data-parallel epoch reads, placed once per fold rather than per call."""
    return tree if n_devices == 1 else put(tree, replicated(make_mesh(n_devices)))


def put(tree: Any, shardings: Any) -> Any:
    """``jax.device_put(tree, shardings)`` (one sharding or a tree of them) that also works
    across processes: there, an array held whole by this process (committed to one of its
    devices) goes through the host — every process holds the same value, and JAX takes each
    process's copy for its own shards. Arrays already laid out over the mesh move as usual."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)

    def one(x: Any, s: jax.sharding.Sharding) -> Any:
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            # typed keys are not plain arrays to device_put across processes: move their data
            return jax.random.wrap_key_data(one(jax.random.key_data(x), s),
                                            impl=jax.random.key_impl(x))
        if isinstance(x, jax.Array) and x.is_fully_addressable and not s.is_fully_addressable:
            x = np.asarray(x)
        return jax.device_put(x, s)

    return jax.tree.map(one, tree, shardings)


def on_first_device(tree: Any, n_devices: int) -> Any:
    """``tree`` on this process's first device only: a replicated array handed to a one-device
    program (the validation and test backtests) would make it run on every device of the mesh.
    Multi-host: through the host (a replicated array spanning processes cannot be moved to one
    device directly; each process holds the whole of it)."""
    if n_devices == 1:
        return tree
    if jax.process_count() > 1:
        tree = jax.tree.map(np.asarray, tree)
    return jax.device_put(tree, jax.local_devices()[0])


def make_mesh(n_devices: int) -> Mesh:
    """A one-axis mesh over the first ``n_devices`` devices."""
    return Mesh(np.asarray(jax.devices()[:n_devices]), (AXIS,))


# ---------------------------------------------------------------------------------------------
# collectives inside the program (axis None: one device, the identity)
# ---------------------------------------------------------------------------------------------


def pmean(x: Any, axis: str | None) -> Any:
    return x if axis is None else jax.lax.pmean(x, axis)


def psum(x: Any, axis: str | None) -> Any:
    return x if axis is None else jax.lax.psum(x, axis)


def pmax(x: Any, axis: str | None) -> Any:
    return x if axis is None else jax.lax.pmax(x, axis)


def all_true(flags: Array, axis: str | None) -> Array:
    """Booleans AND-ed over devices (a flag is True only if it is True everywhere)."""
    if axis is None:
        return flags
    return jax.lax.pmin(flags.astype(jnp.int32), axis) > 0


def device_key(key: Array, axis: str | None) -> Array:
    """The key folded with the device index (unchanged on one device): per-device randomness
    from a replicated key."""
    return key if axis is None else jax.random.fold_in(key, jax.lax.axis_index(axis))


def gather(x: Array, axis: str | None) -> Array:
    """The global array from each device's block along axis 0 (device order)."""
    return x if axis is None else jax.lax.all_gather(x, axis, tiled=True)


def local_block(x: Array, n_local: int, axis: str | None) -> Array:
    """This device's block of a global array (the inverse of :func:`gather`)."""
    if axis is None:
        return x
    start = jax.lax.axis_index(axis) * n_local
    return jax.lax.dynamic_slice_in_dim(x, start, n_local, axis=0)


# ---------------------------------------------------------------------------------------------
# placement of a multi-seed TrainState (leaves [S, ...])
# ---------------------------------------------------------------------------------------------


def state_specs(state: Any, seeded: bool = True) -> Any:
    """A ``PartitionSpec`` per leaf of a ``TrainState`` (multi-seed: leaves ``[S, ...]``; with
    ``seeded=False`` one seed's): env, n-step carry and the replay's items and priorities split
    along their env/capacity axis, the rest replicated."""
    s = 1 if seeded else 0

    def at(k: int):
        return lambda _: P(*([None] * k), AXIS)

    rep = jax.tree.map(lambda _: P(), state)
    replay = rep.replay.replace(storage=jax.tree.map(at(s), state.replay.storage),
                                priorities=at(s)(None))
    return rep.replace(env=jax.tree.map(at(s), state.env),
                       nstep=jax.tree.map(at(s + 1), state.nstep), replay=replay)


def state_shardings(state: Any, mesh: Mesh) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs(state),
                        is_leaf=lambda x: isinstance(x, P))


def on_devices(fn: Any, n_devices: int, extra_out: Any = None,
               gpu_graphs: str = "auto") -> Any:
    """``jax.jit(fn)`` for ``fn(one seed's state) -> state`` or ``-> (state, extra)``; with
    ``n_devices > 1`` under ``shard_map``, the state placed by :func:`state_specs` as the epoch
    places it (``extra`` is laid out by the spec ``extra_out``; ``P()`` returns device 0's).
    For benchmarks and tests that run pieces of the epoch (collect, train_step) alone; compiled
    with the GPU options ``gpu_graphs`` (``train.gpu_graphs``) resolves to for the trainer's
    epoch, so that a benchmark times the pieces as the epoch compiles them."""
    if n_devices == 1:
        return xla_options.jit(fn, gpu_graphs)
    mesh = make_mesh(n_devices)

    def sharded(st):
        specs = state_specs(st, seeded=False)
        out = specs if extra_out is None else (specs, extra_out)
        return jax.shard_map(fn, mesh=mesh, in_specs=(specs,), out_specs=out,
                             check_vma=False)(st)

    return xla_options.jit(sharded, gpu_graphs)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
