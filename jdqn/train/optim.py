"""The optimiser: global-norm clip + AdamW (decoupled weight decay, Loshchilov & Hutter 2019) with
a weight-decay mask, and a learning-rate schedule evaluated from the step count inside the jit.

Schedule (``s`` = updates since the optimiser state was created, ``W`` = ``lr_warmup_steps``,
``P`` = ``lr_restart_period``, ``ρ`` = ``lr_min_ratio``):

    lr(s) = base_lr · (s + 1) / W                                   for s < W   (linear warm-up)
    lr(s) = base_lr · (ρ + (1 − ρ) · ½ (1 + cos(π · ((s − W) mod P) / P)))   otherwise

i.e. cosine annealing with warm restarts (SGDR, Loshchilov & Hutter 2017) every ``P`` updates,
from ``base_lr`` down towards ``ρ·base_lr``.

``base_lr`` is a *leaf of the optimiser state* (``optax.inject_hyperparams``), not a Python
constant baked into the compiled program: :func:`set_learning_rate` changes it and the jitted
update runs again without recompiling (the predecessor spent 100 minutes re-capturing CUDA graphs
for a learning-rate change).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jdqn.config import TrainConfig

PyTree = Any

# Leaf names that never get weight decay: biases and normalisation scales/offsets (Flax Linen
# LayerNorm/RMSNorm call them 'scale' and 'bias'). Anything with fewer than 2 dimensions is
# exempt as well, whatever its name.
NO_DECAY_NAMES = ("bias", "scale", "norm", "layernorm", "ln")


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def weight_decay_mask(params: PyTree) -> PyTree:
    """``True`` where a leaf is decayed: ≥ 2-D and no path component names a bias or a norm."""

    def decay(path: tuple, leaf: Any) -> bool:
        names = [_key_name(k).lower() for k in path]
        if jnp.ndim(leaf) < 2:
            return False
        if names and names[-1] in ("bias", "scale"):
            return False
        return not any(n in NO_DECAY_NAMES or "norm" in n for n in names[:-1])

    return jax.tree_util.tree_map_with_path(decay, params)


def lr_multiplier(cfg: TrainConfig, step: jax.Array | int) -> jax.Array:
    """The schedule's factor on ``base_lr`` at update ``step`` (jittable)."""
    s = jnp.asarray(step, jnp.float32)
    warm = float(cfg.lr_warmup_steps)
    period = float(cfg.lr_restart_period)
    rho = cfg.lr_min_ratio
    phase = jnp.mod(jnp.maximum(s - warm, 0.0), period) / period
    cosine = rho + (1.0 - rho) * 0.5 * (1.0 + jnp.cos(jnp.pi * phase))
    if cfg.lr_warmup_steps == 0:
        return cosine
    return jnp.where(s < warm, (s + 1.0) / warm, cosine)


def global_norm(tree: PyTree) -> jax.Array:
    """``‖tree‖₂`` over every leaf, computed as **one** reduction over the concatenation of the
    leaves (float32). The value is ``optax.tree.norm``'s up to summation order; optax's form (a
    reduction per leaf, then a sum) compiles on the GPU into one reduction kernel per parameter
    leaf (54 at the default model, every update), where XLA fuses the concatenation into a
    single reduction."""
    leaves = [jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(tree)]
    if not leaves:
        return jnp.zeros((), jnp.float32)
    return jnp.sqrt(jnp.sum(jnp.square(jnp.concatenate(leaves))))


def clip_by_global_norm(max_norm: jax.Array | float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` (same rule and the same empty state) with the norm of
    :func:`global_norm`: updates with ``‖g‖ ≥ max_norm`` are scaled by ``max_norm / ‖g‖``."""

    def update(updates, state, params=None):
        del params
        g = global_norm(updates)
        keep = g < max_norm

        def clip(t):
            return jnp.where(keep, t, (t / g.astype(t.dtype)) * jnp.asarray(max_norm, t.dtype))

        return jax.tree.map(clip, updates), state

    return optax.GradientTransformation(lambda params: optax.ClipByGlobalNormState(), update)


def make_optimizer(cfg: TrainConfig, params: PyTree | None = None,
                   b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
                   ) -> optax.GradientTransformation:
    """clip_by_global_norm(clip_norm) → Adam → decoupled weight decay (masked) → −lr(step).

    Clip and Adam run on the parameters concatenated into one vector (``optax.flatten``): the
    same arithmetic as optax's per-leaf chain (``test_optim``) in a few fused loops, where XLA's
    CPU backend compiles several per parameter leaf (the quickstart's epoch program: 729 → 630
    kernels, compiled in 21 s instead of 24). Adam's moments are two ``f32 [P]`` leaves
    (:func:`adam_state`).

    ``params`` is accepted for symmetry and not needed: the decay mask is a function of the
    parameter tree and is evaluated on whatever tree ``init``/``update`` receive.
    The state's ``hyperparams`` hold ``base_lr``, ``weight_decay`` and ``clip_norm`` as f32
    leaves; the schedule's step count lives in the inner state (it restarts when the optimiser
    state is reset, and with it the warm-up).
    """
    del params

    def factory(base_lr: jax.Array, weight_decay: jax.Array,
                clip_norm: jax.Array) -> optax.GradientTransformation:
        return optax.chain(
            optax.flatten(optax.chain(  # on the leaves concatenated (see the docstring)
                clip_by_global_norm(clip_norm), optax.scale_by_adam(b1=b1, b2=b2, eps=eps))),
            optax.add_decayed_weights(weight_decay, mask=weight_decay_mask),
            optax.scale_by_schedule(lambda count: -base_lr * lr_multiplier(cfg, count)),
        )

    return optax.inject_hyperparams(factory, hyperparam_dtype=jnp.float32)(
        base_lr=cfg.lr, weight_decay=cfg.weight_decay, clip_norm=cfg.clip_norm)


def adam_state(opt_state: optax.OptState) -> optax.ScaleByAdamState:
    """Adam's state inside :func:`make_optimizer`'s: ``count`` and the moments ``mu``/``nu``,
    each one float32 vector over every parameter (the leaves concatenated in tree order)."""
    return opt_state.inner_state[0][1]


def set_learning_rate(opt_state: optax.OptState, lr: float | jax.Array) -> optax.OptState:
    """A copy of ``opt_state`` with a new base learning rate (same dtype: no recompilation).

    Works on the state of :func:`make_optimizer` (an ``InjectStatefulHyperparamsState``), also
    inside a jitted function with a traced ``lr``.
    """
    hp = dict(opt_state.hyperparams)
    hp["base_lr"] = jnp.asarray(lr, dtype=jnp.asarray(hp["base_lr"]).dtype)
    return opt_state._replace(hyperparams=hp)


def learning_rate(cfg: TrainConfig, opt_state: optax.OptState) -> jax.Array:
    """The learning rate the *next* update will use (for logging)."""
    count = opt_state.inner_state[-1].count  # the ScaleByScheduleState
    return opt_state.hyperparams["base_lr"] * lr_multiplier(cfg, count)


def opt_state_reset_rules() -> dict[str, Any]:
    """Fold-boundary rules for this optimiser's state (a prefix dict for :mod:`jdqn.train.reset`):
    zero Adam's moments and every step count (the warm-up restarts, Adam's bias correction stays
    consistent with the zeroed moments) but **keep the hyperparameters** — a blanket ``Zero()``
    over the whole optimiser state would set the learning rate to 0 and silently stop learning.
    """
    from jdqn.train.reset import Keep, Zero

    return {"count": Zero(), "hyperparams": Keep(), "hyperparams_states": Keep(),
            "inner_state": Zero()}
