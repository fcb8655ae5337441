"""The declarative fold-boundary reset policy."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct

from jdqn.config import TrainConfig
from jdqn.train.optim import adam_state, make_optimizer, opt_state_reset_rules
from jdqn.train.reset import (
    CopyFrom,
    Fill,
    Keep,
    Reinit,
    ResetPolicyError,
    ShrinkPerturb,
    Zero,
    apply_reset,
    check_policy_covers,
    describe,
)


class Counters(NamedTuple):
    step: jax.Array
    epoch: jax.Array


@struct.dataclass
class ToyState:
    params: Any
    target_params: Any
    opt_state: Any
    norm: dict
    key: jax.Array
    counters: Counters
    nan_flag: jax.Array
    iqn_target: Any = None


def _params(key: jax.Array) -> dict:
    k1, k2 = jax.random.split(key)
    return {"dense": {"kernel": jax.random.normal(k1, (3, 4)), "bias": jax.random.normal(k2, (4,))},
            "ln": {"scale": jnp.ones(4)}}


def _state(seed: int) -> ToyState:
    params = _params(jax.random.key(seed))
    opt = make_optimizer(TrainConfig(lr=1e-3))
    opt_state = opt.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = opt.update(grads, opt_state, params)  # non-zero moments and counts
    return ToyState(
        params=params,
        target_params=jax.tree.map(lambda x: x * 0.5, params),
        opt_state=opt_state,
        norm={"mean": jnp.full(3, 2.0), "var": jnp.full(3, 3.0)},
        key=jax.random.key(seed + 100),
        counters=Counters(jnp.int32(17), jnp.int32(3)),
        nan_flag=jnp.bool_(True),
    )


POLICY = ToyState(
    params=ShrinkPerturb(0.8, 0.1),
    target_params=CopyFrom("params"),
    opt_state=opt_state_reset_rules(),
    norm=Keep(),
    key=Keep(),
    counters=Counters(step=Keep(), epoch=Zero()),
    nan_flag=Zero(),
    iqn_target=Keep(),
)


def test_every_state_leaf_has_a_fold_reset_rule():
    check_policy_covers(POLICY, _state(0))
    assert len(describe(POLICY, _state(0))) == len(
        jax.tree.leaves(_state(0), is_leaf=lambda x: x is None))


def test_a_leaf_without_a_rule_is_named():
    @struct.dataclass
    class Grown(ToyState):
        readiness: jax.Array = None

    state = Grown(**{f: getattr(_state(0), f) for f in ToyState.__dataclass_fields__},
                  readiness=jnp.float32(0.3))
    with pytest.raises(ResetPolicyError, match="no rule for state leaf 'readiness'"):
        check_policy_covers(POLICY, state)
    # A dict policy missing a nested leaf names the full path, and a stray rule is named too.
    pol = {"params": Keep(), "target_params": Keep(), "opt_state": Keep(),
           "norm": {"mean": Keep(), "stdev": Keep()}, "key": Keep(), "counters": Keep(),
           "nan_flag": Keep(), "iqn_target": Keep()}
    with pytest.raises(ResetPolicyError) as e:
        check_policy_covers(pol, _state(0))
    assert "no rule for state leaf 'norm.var'" in str(e.value)
    assert "'norm.stdev' matches nothing" in str(e.value)


def test_none_component_needs_a_rule_and_non_rules_are_refused():
    pol = POLICY.replace(iqn_target=None)
    with pytest.raises(ResetPolicyError, match="no rule for state leaf 'iqn_target'"):
        check_policy_covers(pol, _state(0))
    with pytest.raises(ResetPolicyError, match="not rules"):
        check_policy_covers(POLICY.replace(norm=0.0), _state(0))


def test_each_rule_does_what_it_says():
    old, fresh = _state(0), _state(1)
    new = jax.jit(lambda s, f: apply_reset(POLICY, s, jax.random.key(9), f))(old, fresh)
    for a, b, c in zip(jax.tree.leaves(new.params), jax.tree.leaves(old.params),
                       jax.tree.leaves(fresh.params), strict=True):
        np.testing.assert_allclose(a, 0.8 * b + 0.1 * c, rtol=1e-6)
    np.testing.assert_array_equal(new.norm["var"], old.norm["var"])  # Keep
    assert jax.random.key_data(new.key).tolist() == jax.random.key_data(old.key).tolist()
    assert int(new.counters.step) == 17 and int(new.counters.epoch) == 0
    assert not bool(new.nan_flag)
    assert new.iqn_target is None
    # Optimiser: moments and counts zeroed, learning rate kept.
    adam = adam_state(new.opt_state)
    assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves((adam.mu, adam.nu)))
    assert int(new.opt_state.count) == 0 and int(adam.count) == 0
    assert float(new.opt_state.hyperparams["base_lr"]) == pytest.approx(1e-3)
    # Types come back as they were (optax NamedTuples, the dataclass).
    assert jax.tree.structure(new) == jax.tree.structure(old)


def test_fill_and_reinit():
    state = {"a": jnp.zeros(3), "b": jnp.ones((2, 2)), "c": jnp.arange(3)}
    fresh = {"a": jnp.full(3, 7.0), "b": jnp.zeros((2, 2)), "c": jnp.arange(3) + 1}
    pol = {"a": Reinit(), "b": Reinit(lambda k, x: jax.random.normal(k, x.shape)), "c": Fill(5)}
    new = apply_reset(pol, state, jax.random.key(0), fresh)
    np.testing.assert_array_equal(new["a"], fresh["a"])
    assert new["b"].shape == (2, 2) and float(jnp.std(new["b"])) > 0
    np.testing.assert_array_equal(new["c"], [5, 5, 5])
    assert new["c"].dtype == state["c"].dtype
    with pytest.raises(ResetPolicyError, match="need a fresh_state"):
        apply_reset(pol, state, jax.random.key(0))
    with pytest.raises(ResetPolicyError, match="PRNG key"):
        apply_reset({"k": Zero()}, {"k": jax.random.key(0)})


def test_copy_from_reads_the_new_source_after_its_own_rule():
    state = {"online": jnp.full(3, 2.0), "target": jnp.zeros(3), "iqn": jnp.zeros(3),
             "old_copy": jnp.zeros(3)}
    pol = {"online": Fill(5.0), "target": CopyFrom("online"), "iqn": CopyFrom("target"),
           "old_copy": CopyFrom("online", new=False)}
    new = apply_reset(pol, state)
    np.testing.assert_array_equal(new["target"], [5.0] * 3)  # the new online value
    np.testing.assert_array_equal(new["iqn"], [5.0] * 3)  # chains resolve in dependency order
    np.testing.assert_array_equal(new["old_copy"], [2.0] * 3)  # explicitly the old value


def test_copy_from_checks_structure_and_cycles():
    state = {"a": {"w": jnp.zeros(3)}, "b": {"w": jnp.zeros(3), "extra": jnp.zeros(1)}}
    with pytest.raises(ResetPolicyError, match="differ in structure"):
        apply_reset({"a": Keep(), "b": CopyFrom("a")}, state)
    with pytest.raises(ResetPolicyError, match="cycle"):
        apply_reset({"a": CopyFrom("b"), "b": CopyFrom("a")},
                    {"a": jnp.zeros(2), "b": jnp.zeros(2)})
    with pytest.raises(ResetPolicyError, match="source 'nope' is not in the state"):
        check_policy_covers({"a": CopyFrom("nope"), "b": Keep()}, state)


def test_abstract_states_can_be_checked():
    abstract = jax.eval_shape(lambda: _state(0))
    check_policy_covers(POLICY, abstract)
    assert isinstance(optax.tree_utils.tree_get(abstract.opt_state, "base_lr"),
                      jax.ShapeDtypeStruct)
