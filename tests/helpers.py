"""Small configs for training tests (seconds, not minutes, on 2 CPU cores)."""

from __future__ import annotations

import contextlib

from jdqn.config import Config, apply_overrides, config_from_dict

TINY = {
    "data": {"source": "synthetic", "cache_dir": "", "synthetic": {"n_bars": 3000, "seed": 0}},
    "features": {"state_width": 32},
    "env": {"n_envs": 16, "episode_length": 64},
    "model": {"width": 32, "n_grn_blocks": 1, "n_experts": 2, "expert_hidden": 16,
              "gate_hidden": 16, "head_hidden": 32, "n_atoms": 21, "v_min": -5.0, "v_max": 5.0,
              "iqn": True, "iqn_embed": 8, "iqn_n": 4, "iqn_n_prime": 4},
    "train": {"seeds": [0], "n_folds": 2, "epochs_per_fold": 2, "patience": 5,
              "collect_steps": 4, "updates_per_iter": 2, "iters_per_epoch": 8,
              "batch_size": 32, "replay_capacity": 2048, "min_replay": 128,
              "lr_warmup_steps": 4, "warmup_blend_steps": 10, "eps_decay_steps": 100,
              "purge_bars": 5},
    "checkpoint": {"keep_best": 1, "keep_latest": 2},
    "logging": {"progress": False, "tensorboard": True},
}


def tiny_config(*overrides: str) -> Config:
    return config_from_dict(apply_overrides(TINY, list(overrides)))


def tiny_toml(*overrides: str) -> str:
    from jdqn.config import dumps_toml

    return dumps_toml(tiny_config(*overrides))


def x64():
    """Context manager enabling float64 (``jax.enable_x64`` on new JAX, experimental on old)."""
    import jax

    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64  # pragma: no cover

    return enable_x64()


LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILED = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def jax_events(event: str = LOWERED):
    """The names of the functions (``jit(step)``, …) for which JAX recorded ``event`` inside
    the block: :data:`LOWERED`, a lowering to XLA, with which every compilation starts (also one
    the persistent compilation cache then supplies), or :data:`COMPILED`, XLA's own compile.
    Compile counts are taken this way, not from jit's dispatch cache (``_cache_size``), which
    may keep no entry depending on what else the process ran before (a test file failed on
    that after others had run on the same worker)."""
    from jax import monitoring

    names: list[str] = []

    def listen(name, duration, **kw):
        if name == event:
            names.append(kw.get("fun_name", "?"))

    monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        monitoring.unregister_event_duration_listener(listen)


def all_eqns(jaxpr):
    """Every equation of a jaxpr, those of its sub-jaxprs (jit, scan, cond, custom rules, ...)
    included, depth first."""
    import jax.extend.core

    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from all_eqns(sub)


def dot_contractions(jaxpr) -> list[tuple[int, tuple[int, ...]]]:
    """``(contraction length, output shape)`` of every ``dot_general`` of a jaxpr, sub-jaxprs
    included; the length is the product over the contracted axes."""
    out = []
    for e in all_eqns(jaxpr):
        if e.primitive.name == "dot_general":
            lhs = e.invars[0].aval.shape
            n = 1
            for d in e.params["dimension_numbers"][0][0]:
                n *= lhs[d]
            out.append((n, tuple(e.outvars[0].aval.shape)))
    return out


def pallas_kernel_names(jaxpr) -> list[str]:
    """The names of the Pallas kernels a jaxpr calls, sub-jaxprs included (the parameter is
    ``name`` or, on other JAX versions, ``name_and_src_info``)."""
    return [str(e.params.get("name") or e.params.get("name_and_src_info"))
            for e in all_eqns(jaxpr) if e.primitive.name == "pallas_call"]


def assert_grads_close(got, want, names, rel: float = 2e-6, dtype=None) -> None:
    """Each gradient in ``got`` within ``rel`` times the largest entry of its float64 oracle in
    ``want`` (named ``names``, in order); with ``dtype``, each also of that dtype."""
    import numpy as np

    for name, a, b in zip(names, got, want, strict=True):
        assert dtype is None or a.dtype == dtype, (name, a.dtype)
        scale = max(float(np.max(np.abs(b), initial=0.0)), 1e-30)
        np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=0, atol=rel * scale,
                                   err_msg=name)


def assert_loss_and_grads_close(loss, reference, params, tol: float) -> None:
    """``loss(params)`` and ``reference(params)`` (each returning ``(value, aux)``) agree: the
    values to ``tol`` relative, every gradient leaf to ``tol`` times the reference's largest
    gradient entry (a kernel path against the XLA network's)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    (got, _), g_got = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    (want, _), g_want = jax.jit(jax.value_and_grad(reference, has_aux=True))(params)
    np.testing.assert_allclose(got, want, rtol=tol)
    flat_got, flat_want = jax.tree.leaves(g_got), jax.tree.leaves(g_want)
    scale = max(float(jnp.max(jnp.abs(g))) for g in flat_want)
    for a, b in zip(flat_got, flat_want, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * scale)


def random_bars(t_len: int, n_feat: int, seed: int = 0, *, start: float = 1600.0,
                step_sd: float = 1.0, open_sd: float = 0.3, max_wick_ticks: int = 2):
    """Random OHLC bars on the 0.25 tick grid (exact in float32) plus random features.

    Returns ``(features f32 [T, F], open, high, low, close)``.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    c = start + np.round(np.cumsum(rng.normal(0, step_sd, t_len)) * 4) / 4
    o = np.r_[c[0], c[:-1]] + np.round(rng.normal(0, open_sd, t_len) * 4) / 4
    h = np.maximum(o, c) + 0.25 * rng.integers(0, max_wick_ticks + 1, t_len)
    lo = np.minimum(o, c) - 0.25 * rng.integers(0, max_wick_ticks + 1, t_len)
    return rng.normal(size=(t_len, n_feat)).astype(np.float32), o, h, lo, c


def random_biases(params, key, scale: float = 0.5):
    """``params`` with every ``bias`` leaf drawn from N(0, scale²) (keys folded from ``key``
    per leaf). A model initialises its biases at zero, where a bias that a kernel forgot to add
    (or added twice) would pass unseen."""
    import jax

    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    out = [scale * jax.random.normal(jax.random.fold_in(key, i), x.shape, x.dtype)
           if jax.tree_util.keystr(path).endswith("['bias']") else x
           for i, (path, x) in enumerate(leaves)]
    return jax.tree_util.tree_unflatten(tree, out)
