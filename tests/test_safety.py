"""Safety: finite checks on named tensors and the Q-drift halt."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdqn.errors import TrainingHalted
from jdqn.train.safety import (
    NaNMonitor,
    check_finite,
    check_q_drift,
    finite_flags,
    monitor_init,
    q_drift_exceeded,
    raise_if_halted,
)

NAMES = ("rewards", "logits", "loss", "grads", "params")


def _tensors(step: jax.Array, poison: dict[str, int]) -> dict:
    """Finite tensors, except that tensor ``name`` gets a NaN from step ``poison[name]`` on."""
    base = {"rewards": jnp.ones(8), "logits": jnp.ones((8, 4, 51)), "loss": jnp.float32(1.0),
            "grads": {"w": jnp.ones((4, 4)), "b": jnp.ones(4), "count": jnp.int32(3)},
            "params": {"w": jnp.ones((4, 4)), "key": jax.random.key(0)}}
    out = {}
    for name in NAMES:
        bad = step >= poison.get(name, 1 << 30)
        out[name] = jax.tree.map(
            lambda x, bad=bad: jnp.where(bad, jnp.nan, x)
            if jnp.issubdtype(x.dtype, jnp.floating) else x, base[name])
    return out


def _run(poison: dict[str, int], steps: int = 50, fold: int = 1) -> NaNMonitor:
    def body(mon, step):
        return check_finite(mon, _tensors(step, poison), step, fold), None

    return jax.jit(lambda m: jax.lax.scan(body, m, jnp.arange(steps, dtype=jnp.int32))[0])(
        monitor_init())


def test_finite_flags_in_name_order():
    flags = finite_flags(_tensors(jnp.int32(5), {"loss": 0, "params": 3}))
    np.testing.assert_array_equal(np.asarray(flags), [True, True, False, True, False])


@pytest.mark.parametrize("bad", [None, ("a", 0, np.nan), ("b", 3, np.inf), ("c", 7, -np.inf),
                                 ("c", 0, np.nan)])
def test_every_floating_leaf_of_every_dtype_is_checked(bad):
    """A tensor's leaves are checked as one reduction per dtype over their concatenation: a bad
    value anywhere in any floating leaf (float32, bfloat16, float16; first or last element)
    flags the tensor; integer, bool and key leaves are skipped."""
    tree = {"a": jnp.ones((3, 4), jnp.float32), "b": jnp.ones((4,), jnp.bfloat16),
            "c": jnp.ones((2, 4), jnp.float16), "i": jnp.arange(5), "m": jnp.array([True]),
            "k": jax.random.key(0), "e": jnp.zeros((0,), jnp.float32)}
    if bad is not None:
        name, i, v = bad
        tree[name] = tree[name].reshape(-1).at[i].set(v).reshape(tree[name].shape)
    flags = finite_flags({"t": tree, "ints": {"i": jnp.arange(3)}, "empty": {}})
    np.testing.assert_array_equal(np.asarray(flags), [bad is None, True, True])


def test_a_nan_in_one_tensor_is_reported_by_name_and_step():
    mon = _run({"grads": 37})
    with pytest.raises(TrainingHalted, match=r"non-finite values in 'grads' at step 37 of fold 1$"):
        raise_if_halted(mon, NAMES)
    raise_if_halted(_run({}), NAMES)  # nothing planted: no halt


def test_first_occurrence_wins():
    # params go bad later; grads and loss go bad at the same step 20: loss is listed first.
    mon = _run({"params": 30, "grads": 20, "loss": 20})
    with pytest.raises(TrainingHalted, match="'loss' at step 20"):
        raise_if_halted(mon, NAMES)
    mon = _run({"rewards": 45, "logits": 12})
    with pytest.raises(TrainingHalted, match="'logits' at step 12"):
        raise_if_halted(mon, NAMES)


def test_monitor_batched_over_seeds():
    mons = jax.vmap(lambda s: check_finite(monitor_init(), _tensors(s, {"rewards": 2}), s, 0))(
        jnp.arange(4, dtype=jnp.int32))
    with pytest.raises(TrainingHalted, match=r"'rewards' at step 2 of fold 0 \(seed index 2\)"):
        raise_if_halted(mons, NAMES)
    with pytest.raises(TrainingHalted, match=r"of fold 0 \(seed 30\)"):  # named by its value
        raise_if_halted(mons, NAMES, seeds=(10, 20, 30, 40))


def test_q_drift_triggers_above_the_floor_only():
    assert bool(q_drift_exceeded(12.0, 30.0, factor=2.0, floor=10.0))
    assert not bool(q_drift_exceeded(12.0, 20.0, factor=2.0, floor=10.0))  # exactly 2×: no
    assert not bool(q_drift_exceeded(0.1, 5.0, factor=2.0, floor=10.0))  # 50×, below the floor
    assert bool(q_drift_exceeded(1.0, float("nan")))
    with pytest.raises(TrainingHalted) as e:
        check_q_drift(12.0, 30.0, epoch=7, factor=2.0, floor=10.0, fold=2)
    msg = str(e.value)
    assert "epoch 7 of fold 2" in msg and "12" in msg and "30" in msg and "floor 10" in msg
    check_q_drift(0.1, 5.0, epoch=3, floor=10.0)  # no halt below the floor
    check_q_drift(None, 1e6, epoch=0)  # first epoch: no previous value
    with pytest.raises(TrainingHalted, match="not finite"):
        check_q_drift(None, float("inf"), epoch=0)
    with pytest.raises(TrainingHalted, match=r"epoch 7 of fold 2 \(seed 5\)"):
        check_q_drift(12.0, 30.0, epoch=7, factor=2.0, floor=10.0, fold=2, seed=5)
