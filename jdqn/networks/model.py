"""The branching distributional Q-network: trunk + dueling C51 heads + optional IQN head.

Axes: ``B`` batch, ``W`` state width, ``K`` experts, ``D`` branches, ``A_d`` actions of branch
d, ``Z`` atoms, ``Q`` quantile samples.

Usage::

    net = BranchingQNetwork(cfg.model, flow_idx=features.flow_idx)
    params = init_params(net, key, obs_width=layout.width)      # float32 pytree
    out = net.apply(params, obs)                                 # NetOutput
    q_gap, q_var = policy_aux(out, action[:, 0])                 # for env.step's PolicyAux

All parameters (trunk, C51 heads and IQN head) live in one tree, so the target network
(a copy of that tree) always includes the IQN target: no head can be forgotten at a sync.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jdqn.config import ModelConfig
from jdqn.networks.heads import (
    DIRECTION,
    DuelingBranchingHead,
    HeadInputs,
    HeadStreams,
    IQNHead,
    expected_q,
    make_support,
    q_gap,
    q_variance,
)
from jdqn.networks.trunk import Trunk
from jdqn.pallas import use_pallas

Array = jax.Array


class NetOutput(NamedTuple):
    logits: tuple[Array, ...]  # per branch [B, A_d, Z] (float32, or the input dtype)
    q: tuple[Array, ...]  # per branch [B, A_d]: E[Q] under softmax(logits)
    q_var: tuple[Array, ...]  # per branch [B, A_d]: Var[Q] under softmax(logits)
    gate: Array  # [B, K] MoE gate probabilities
    quantiles: tuple[Array, ...] | None  # per branch [B_τ, A_d, Q] when taus were given
    aux: dict[str, Array]  # diagnostics: 'selection' [B, W] variable-selection weights,
    #                        'gate_util' [K] = mean_b gate, 'gate_entropy' [] = mean_b H(gate[b])
    features: Array  # [B, H] the trunk's output h (what the heads read; see iqn_quantiles)
    # head_streams=True: the C51 head's output products (then logits, q and q_var are empty);
    # head_streams="inputs": what it computes them from
    streams: HeadStreams | HeadInputs | None = None


def _iqn_head(c: ModelConfig, grad_free: bool, **kw: Any) -> IQNHead:
    """The IQN head of ``c``. Where no gradient is taken: its fused kernel if ``c.impl`` says so,
    and the hidden layer's bias inside the first product (:func:`iqn_features_shared`). The
    output stage's kernels (:mod:`jdqn.pallas.iqn_tail`) under ``"iqn_tail"`` where no
    gradient is taken and ``"iqn_tail_grad"`` where one is; under bf16 matmuls the switches
    are ``"iqn_tail_bf16"`` and ``"iqn_tail_grad_bf16"`` (measured apart on the GPU)."""
    kernel = "iqn_tail" if grad_free else "iqn_tail_grad"
    tail = use_pallas(c.impl, kernel if c.matmul_dtype == "float32" else f"{kernel}_bf16")
    return IQNHead(tuple(c.branch_sizes), c.iqn_embed, c.head_hidden, c.matmul_dtype,
                   grad_free and use_pallas(c.impl, "iqn"),
                   use_pallas(c.impl, "iqn_modulation"), c.impl, bias_in_product=grad_free,
                   tail_kernel=tail, **kw)


class BranchingQNetwork(nn.Module):
    """``apply(params, obs [B, W], taus [G, Q] | [Q] | None, grad_free=False, tau_rows=None)
    -> NetOutput``.

    The IQN fractions cover the first ``tau_rows ≤ B`` rows of ``obs`` (the loss may run one
    forward over the concatenated ``[s; s′]`` batch and need quantiles at ``s`` only):
    ``taus [Q]`` are one set shared by those rows (default: all rows;
    ``ModelConfig.iqn_taus = "batch"``); ``taus [G, Q]`` are one set per group of
    ``tau_rows / G`` consecutive rows (``ModelConfig.iqn_tau_groups``; G = ``tau_rows``:
    fractions per row, ``iqn_taus = "sample"``). ``flow_idx`` are the
    static column indices of the order-flow features in the observation. ``grad_free=True``
    declares that no gradient will be taken through this call (the forwards at s′, acting): it
    may then use kernels whose backward pass is a recomputation (each GRN block's tail,
    :mod:`jdqn.pallas.grn_tail`, and the fused IQN stack, when ``cfg.impl`` selects them); the
    values are the same function either way, to rounding. Such a call
    supports reverse-mode differentiation (``jax.grad``) but not forward mode (``jax.jvp``,
    ``jax.jacfwd``: a ``custom_vjp`` has no JVP) — except under bf16 matmuls on a Hopper GPU
    with ``"grn_block_bf16"`` (which ``"auto"`` takes), whose whole-block kernel
    (:mod:`jdqn.pallas.grn_block`) has no derivative at all: there a gradient through the call
    raises, and its parameters and input must be under ``stop_gradient``, as the loss's
    forwards at s′ put them. The same holds for every call under
    ``impl = "pallas"`` (the MoE mixture and the IQN modulation then have custom VJPs) and for
    kernels ``"auto"`` takes on the GPU. ``head_streams=True``: the output carries the C51
    head's output-layer products (``NetOutput.streams``, for the double-Q kernel
    :mod:`jdqn.pallas.double_q`) instead of logits, Q and Var[Q] (empty tuples);
    ``head_streams="inputs"``: what the head computes those products from
    (:class:`~jdqn.networks.heads.HeadInputs`, for :mod:`jdqn.pallas.double_q_heads`).
    """

    cfg: ModelConfig
    flow_idx: tuple[int, ...] = ()

    @nn.compact
    def __call__(self, obs: Array, taus: Array | None = None,
                 grad_free: bool = False, tau_rows: int | None = None,
                 head_streams: bool | str = False) -> NetOutput:
        c = self.cfg
        trunk = Trunk(c.width, c.n_grn_blocks, c.n_experts, c.expert_hidden, c.gate_hidden,
                      c.matmul_dtype, c.impl, grad_free, name="trunk")(obs)
        head = DuelingBranchingHead(tuple(c.branch_sizes), c.n_atoms, c.head_hidden, c.v_min,
                                    c.v_max, tuple(self.flow_idx), c.matmul_dtype, c.impl,
                                    streams=head_streams, name="c51")(trunk.h, obs)
        streams, logits = (head, ()) if head_streams else (None, head)
        support = make_support(c.v_min, c.v_max, c.n_atoms,
                               dtype=logits[0].dtype if logits else jnp.float32)
        quantiles = None
        if taus is not None:
            if not c.iqn:
                raise ValueError("taus given but ModelConfig.iqn is false (no IQN head)")
            if taus.ndim == 2:
                rows = obs.shape[0] if tau_rows is None else tau_rows
                if rows % taus.shape[0]:
                    raise ValueError(f"tau_rows = {rows} is not a multiple of the "
                                     f"{taus.shape[0]} rows (groups) of taus")
            elif taus.ndim == 1:
                rows = obs.shape[0] if tau_rows is None else tau_rows
            else:
                raise ValueError(f"taus must be [Q], [G, Q] or [B, Q], got shape {taus.shape}")
            if rows > obs.shape[0]:
                raise ValueError(f"taus cover {rows} rows but obs has {obs.shape[0]}")
            quantiles = _iqn_head(c, grad_free, name="iqn")(trunk.h[:rows], taus)
        return NetOutput(
            logits=logits,
            q=tuple(expected_q(lg, support) for lg in logits),
            q_var=tuple(q_variance(lg, support) for lg in logits),
            gate=trunk.gate,
            quantiles=quantiles,
            aux={"selection": trunk.selection,
                 "gate_util": jnp.mean(trunk.gate, axis=0),
                 "gate_entropy": jnp.mean(-jnp.sum(trunk.gate * jnp.log(trunk.gate + 1e-12),
                                                   axis=-1))},
            features=trunk.h,
            streams=streams,
        )


@functools.partial(jax.jit, static_argnums=(0, 2))
def init_params(net: BranchingQNetwork, key: Array, obs_width: int) -> Any:
    """Initialise every parameter (the IQN head too when ``cfg.iqn``): a float32 pytree
    ``{'params': ...}``. Jitted (``net`` and ``obs_width`` static), so it compiles once."""
    obs = jnp.zeros((1, obs_width), jnp.float32)
    taus = jnp.full((1, 1), 0.5, jnp.float32) if net.cfg.iqn else None
    return net.init(key, obs, taus)


@functools.partial(jax.jit, static_argnums=(0, 2))
def init_params_batched(net: BranchingQNetwork, keys: Array, obs_width: int) -> Any:
    """One parameter tree per key, stacked on a leading seed axis: keys [S] → leaves [S, ...].
    Each seed gets its own key, so the seeds' parameters differ."""
    return jax.vmap(lambda k: init_params(net, k, obs_width))(keys)


def iqn_quantiles(net: BranchingQNetwork, params: Any, features: Array, taus: Array,
                  grad_free: bool = False) -> tuple[Array, ...]:
    """The IQN head alone on trunk features ``[B, H]`` (``NetOutput.features``) at ``taus
    [B, Q]`` (per row), ``[G, Q]`` (per group of B/G rows) or ``[Q]`` (shared by every row): per
    branch ``[B, A_d, Q]``, the same values as
    ``net.apply(params, obs, taus).quantiles`` for the features of ``obs``. ``grad_free`` as in
    :class:`BranchingQNetwork`."""
    c = net.cfg
    if not c.iqn:
        raise ValueError("iqn_quantiles: ModelConfig.iqn is false (no IQN head)")
    return _iqn_head(c, grad_free).apply({"params": params["params"]["iqn"]}, features, taus)


def quantiles(net: BranchingQNetwork, params: Any, obs: Array, taus: Array) -> tuple[Array, ...]:
    """IQN quantile values per branch ``[B, A_d, Q]`` at ``taus [B, Q]`` or ``[Q]``."""
    return net.apply(params, obs, taus).quantiles


def policy_aux(out: NetOutput, direction: Array) -> tuple[Array, Array]:
    """What the env's sizing chain needs from the heads, for the chosen direction ``[B]``:

    * ``q_gap [B]``: best − second-best expected Q of the direction branch (conviction and
      opportunity cost);
    * ``q_var [B]``: Var[Q] of the direction branch at the chosen direction action.
    """
    q_dir, var_dir = out.q[DIRECTION], out.q_var[DIRECTION]
    var = jnp.take_along_axis(var_dir, direction[:, None].astype(jnp.int32), axis=1)[:, 0]
    return q_gap(q_dir), var


def greedy_action(out: NetOutput) -> Array:
    """Per-branch argmax of expected Q: ``int32 [B, D]``."""
    return jnp.stack([jnp.argmax(q, axis=-1) for q in out.q], axis=-1).astype(jnp.int32)


def count_params(cfg: ModelConfig, obs_width: int, flow_idx: tuple[int, ...] = ()) -> int:
    """Number of trainable scalars of the online network (shape-only, nothing is computed)."""
    net = BranchingQNetwork(cfg, tuple(flow_idx))
    shapes = jax.eval_shape(lambda k: init_params(net, k, obs_width), jax.random.key(0))
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(shapes)))


def flops_per_sample(cfg: ModelConfig, obs_width: int, n_flow: int = 0,
                     n_quantiles: int = 0, shared_taus: bool = False) -> int:
    """Analytic forward matmul FLOPs (2 per multiply-add) for one observation, with the IQN head
    evaluated at ``n_quantiles`` τ samples (0 = no IQN). Elementwise ops, norms and softmaxes are
    left out (they are < 2 % of the total at the default sizes). ``shared_taus``: the fractions
    are shared by the batch or by groups of its rows (``ModelConfig.iqn_taus = "batch"``), so
    the τ embedding's matmul runs once per group (``iqn_tau_groups`` times per batch), not per
    observation, and is not counted."""
    w, h, k, e, g = obs_width, cfg.width, cfg.n_experts, cfg.expert_hidden, cfg.gate_hidden
    hh, z, sizes = cfg.head_hidden, cfg.n_atoms, cfg.branch_sizes
    macs = w * w + w * h  # variable selection, projection
    # GRN: the ELU layer, then fc and GLU (2H) applied as one H → 2H product of their weights
    # (trunk.GRNBlock; the product of the weights is per batch, not counted)
    macs += cfg.n_grn_blocks * (h * h + h * 2 * h)
    macs += w * g + g * k + 2 * h * k * e + k * h  # gate, experts (both layers), mixture bias
    macs += h * hh + hh * z  # value stream
    extra_in = (0, sizes[0], n_flow, n_flow)  # direction Q conditioning, order-flow features
    macs += sum((h + x) * hh + hh * a * z for a, x in zip(sizes, extra_in, strict=True))
    macs += n_quantiles * ((0 if shared_taus else cfg.iqn_embed * h) + h * hh
                           + hh * (1 + sum(sizes)))
    return 2 * macs


def train_flops_per_sample(cfg: ModelConfig, obs_width: int, n_flow: int = 0) -> int:
    """Useful FLOPs of one ``value_and_grad(total_loss)`` per transition: online forward at s
    (with N quantiles) × 3 for forward + backward, online forward at s′ (action selection) and
    target forward at s′ (with N′ quantiles). Work wasted on zero cotangents is not counted."""
    n, n_prime = (cfg.iqn_n, cfg.iqn_n_prime) if cfg.iqn else (0, 0)
    shared = cfg.iqn_taus == "batch"
    return (3 * flops_per_sample(cfg, obs_width, n_flow, n, shared)
            + flops_per_sample(cfg, obs_width, n_flow, 0)
            + flops_per_sample(cfg, obs_width, n_flow, n_prime, shared))


def decay_mask(params: Any) -> Any:
    """Weight-decay mask for ``optax.adamw(mask=...)``: True for matmul kernels (leaf names
    starting with ``kernel``), False for biases and LayerNorm scales/offsets."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: str(getattr(path[-1], "key", "")).startswith("kernel"), params)
