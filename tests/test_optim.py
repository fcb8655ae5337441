"""The optimiser: schedule, weight-decay mask, learning-rate changes without recompilation."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import jax_events

from jdqn.config import TrainConfig
from jdqn.train.optim import (
    adam_state,
    learning_rate,
    lr_multiplier,
    make_optimizer,
    set_learning_rate,
    weight_decay_mask,
)

CFG = TrainConfig(lr=1e-3, lr_warmup_steps=10, lr_restart_period=100, lr_min_ratio=0.1,
                  weight_decay=0.5, clip_norm=1.0)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm()(nn.Dense(8)(x))
        return nn.Dense(2)(x)


def _params():
    return Net().init(jax.random.key(0), jnp.zeros((1, 4)))["params"]


@pytest.mark.parametrize(("step", "want"), [
    (0, 0.1), (4, 0.5), (9, 1.0),  # warm-up (s + 1) / W
    (10, 1.0),  # cosine starts at the top
    (60, 0.1 + 0.9 * 0.5),  # half a period
    (85, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.75))),
    (109, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.99))),  # near the floor
    (110, 1.0), (210, 1.0),  # warm restarts
])
def test_schedule_values(step, want):
    assert float(lr_multiplier(CFG, step)) == pytest.approx(want, rel=1e-5)


def test_schedule_without_warmup_starts_at_the_top():
    cfg = TrainConfig(lr_warmup_steps=0, lr_restart_period=4, lr_min_ratio=0.0)
    got = [float(lr_multiplier(cfg, s)) for s in range(5)]
    np.testing.assert_allclose(got, [1.0, 0.5 + 0.5 * math.cos(math.pi / 4), 0.5,
                                     0.5 + 0.5 * math.cos(3 * math.pi / 4), 1.0], atol=1e-6)


def test_no_weight_decay_on_biases_and_norms():
    mask = weight_decay_mask(_params())
    assert mask == {"Dense_0": {"kernel": True, "bias": False},
                    "LayerNorm_0": {"scale": False, "bias": False},
                    "Dense_1": {"kernel": True, "bias": False}}
    # And the optimiser really applies it: zero gradient, past warm-up → only decay moves.
    cfg = TrainConfig(lr=0.1, lr_warmup_steps=0, weight_decay=0.5)
    params = _params()
    opt = make_optimizer(cfg, params)
    upd, _ = opt.update(jax.tree.map(jnp.zeros_like, params), opt.init(params), params)
    np.testing.assert_allclose(upd["Dense_0"]["kernel"], -0.1 * 0.5 * params["Dense_0"]["kernel"],
                               rtol=1e-6)
    for leaf in (upd["Dense_0"]["bias"], upd["LayerNorm_0"]["scale"], upd["LayerNorm_0"]["bias"]):
        assert float(jnp.abs(leaf).max()) == 0.0


def test_gradients_are_clipped_by_global_norm():
    cfg = TrainConfig(lr=1.0, lr_warmup_steps=0, weight_decay=0.0, clip_norm=1.0)
    p = {"w": jnp.zeros((2, 2))}
    opt = make_optimizer(cfg, p)
    st = opt.init(p)
    clip_only = adam_state(opt.update({"w": jnp.full((2, 2), 100.0)}, st, p)[1]).mu
    # Adam's first moment after one step = (1 − b1)·clipped grad; clipped grad has norm 1.
    np.testing.assert_allclose(clip_only, 0.1 * 0.5 * np.ones(4), rtol=1e-5)


def test_the_flat_optimizer_is_optaxs_per_leaf_chain():
    """Clip and Adam run on the concatenated parameters (one vector, few compiled loops); the
    updates are those of optax's own per-leaf chain with the same rules — the weight-decay mask
    kept per leaf (Dense kernels decayed, biases and the LayerNorm not) — over steps that clip
    and steps that do not, through the warm-up into the cosine."""
    params = _params()
    opt = make_optimizer(CFG, params)
    ref = optax.chain(
        optax.clip_by_global_norm(CFG.clip_norm), optax.scale_by_adam(),
        optax.add_decayed_weights(CFG.weight_decay, mask=weight_decay_mask),
        optax.scale_by_schedule(lambda n: -CFG.lr * lr_multiplier(CFG, n)))
    rng = np.random.default_rng(0)
    p_ours, p_ref = params, params
    s_ours, s_ref = opt.init(params), ref.init(params)
    for i in range(25):
        scale = 10.0 if i % 3 == 0 else 0.01  # above and below clip_norm = 1
        g = jax.tree.map(lambda x, s=scale: jnp.asarray(rng.normal(size=x.shape) * s, x.dtype),
                         params)
        u_ours, s_ours = opt.update(g, s_ours, p_ours)
        u_ref, s_ref = ref.update(g, s_ref, p_ref)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-9),
                     u_ours, u_ref)
        p_ours, p_ref = optax.apply_updates(p_ours, u_ours), optax.apply_updates(p_ref, u_ref)
    assert jax.tree.structure(u_ours) == jax.tree.structure(params)
    n = sum(x.size for x in jax.tree.leaves(params))
    moments = adam_state(s_ours)
    assert moments.mu.shape == moments.nu.shape == (n,) and int(moments.count) == 25
    np.testing.assert_allclose(moments.mu, jnp.concatenate(
        [x.ravel() for x in jax.tree.leaves(s_ref[1].mu)]), rtol=2e-5, atol=1e-9)
    # The mask reached the decay: a kernel moved by weight decay, a bias did not.
    decay_only = opt.update(jax.tree.map(jnp.zeros_like, params), opt.init(params), params)[0]
    assert float(jnp.abs(decay_only["Dense_0"]["kernel"]).max()) > 0
    assert float(jnp.abs(decay_only["Dense_0"]["bias"]).max()) == 0


def test_flat_global_norm_clip_matches_optax():
    # global_norm is one reduction over the leaves' concatenation (one GPU kernel instead of one
    # per leaf); it must give optax's norm and optax's clipping, leaf by leaf.
    from jdqn.train.optim import clip_by_global_norm, global_norm

    rng = np.random.default_rng(3)
    tree = {"a": jnp.asarray(rng.normal(size=(7, 5)), jnp.float32),
            "b": {"c": jnp.asarray(rng.normal(size=(11,)), jnp.float32),
                  "d": jnp.asarray(rng.normal(size=(2, 3, 4)), jnp.float32)}}
    np.testing.assert_allclose(global_norm(tree), optax.tree.norm(tree), rtol=1e-6)
    assert float(global_norm({})) == 0.0
    norm = float(optax.tree.norm(tree))
    for max_norm in (0.5 * norm, 2.0 * norm):  # clipped, then untouched
        ours = clip_by_global_norm(jnp.float32(max_norm))
        ref = optax.clip_by_global_norm(max_norm)
        got, st = ours.update(tree, ours.init(tree))
        want, _ = ref.update(tree, ref.init(tree))
        assert jax.tree.structure(st) == jax.tree.structure(ref.init(tree))
        jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6), got, want)


def test_changing_the_learning_rate_never_recompiles():
    params = _params()
    opt = make_optimizer(CFG, params)
    traces = []

    @jax.jit
    def step(params, opt_state, grads):
        traces.append(1)  # Python side effect: runs only when jax traces (compiles) again
        upd, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, upd

    grads = jax.tree.map(jnp.ones_like, params)
    st = opt.init(params)
    sizes = []
    with jax_events() as lowered:
        for lr in (1e-3, 5e-4, 2e-3, 1e-3):
            st = set_learning_rate(st, lr)
            _, _, upd = step(params, st, grads)
            sizes.append(float(jnp.abs(upd["Dense_0"]["kernel"]).max()))
            sizes.append(float(learning_rate(CFG, st)))
    assert len(traces) == 1 and lowered.count("jit(step)") == 1, lowered
    # And the new rate is really used: the update scales with it.
    np.testing.assert_allclose(sizes[2] / sizes[0], 0.5, rtol=1e-4)
    np.testing.assert_allclose(sizes[4] / sizes[0], 2.0, rtol=1e-4)

    # Also inside a jitted program with a traced LR (e.g. set by a host-side scheduler).
    @jax.jit
    def set_lr(s, lr):
        return set_learning_rate(s, lr)

    with jax_events() as lowered:
        jax.block_until_ready((set_lr(st, 1e-3), set_lr(st, 3e-3)))
    assert lowered.count("jit(set_lr)") == 1, lowered


def test_schedule_advances_with_the_step_count_inside_jit():
    params = {"w": jnp.zeros((2, 2))}
    opt = make_optimizer(CFG, params)

    def body(carry, _):
        p, s = carry
        upd, s = opt.update({"w": jnp.ones((2, 2))}, s, p)
        return (optax.apply_updates(p, upd), s), learning_rate(CFG, s)

    _, lrs = jax.jit(lambda c: jax.lax.scan(body, c, None, length=20))(
        (params, opt.init(params)))
    want = [1e-3 * float(lr_multiplier(CFG, s)) for s in range(1, 21)]
    np.testing.assert_allclose(np.asarray(lrs), want, rtol=1e-5)
