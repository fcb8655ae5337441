"""The learner's objective: blended C51 + IQN + MoE load balance, over a batch.

Axes: ``B`` batch, ``W`` state width, ``D`` branches, ``K`` experts, ``N``/``N′`` quantile
samples.

    loss = mean_b w_b·mean_d td[b, d]                      (warm-up blend of MSE and C51)
         + iqn_weight · mean_b w_b·mean_d iqn[b, d]        (when ModelConfig.iqn)
         + λ_eff · K · Σ_k (mean_b g[b, k])²               (MoE load balance, gate at s)

``w_b`` are the prioritised-replay importance weights. The per-sample loss returned for
priorities is ``Σ_d td[b, d]`` — the blended TD loss **summed over branches**, without importance
weights, IQN or load balance (SPEC §5).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp

from jdqn.config import ModelConfig, TrainConfig
from jdqn.losses.batch import branching_iqn_loss_batch, branching_td_loss_batch
from jdqn.losses.moe import (
    MoEState,
    entropy,
    entropy_target,
    gate_utilisation,
    lambda_eff,
    load_balance_loss,
    update_moe_state,
)
from jdqn.networks.heads import DIRECTION, expected_q, make_support, q_gap
from jdqn.networks.model import BranchingQNetwork, NetOutput, iqn_quantiles
from jdqn.pallas import use_pallas

Array = jax.Array


class Batch(NamedTuple):
    """A batch of n-step transitions (the replay's output after rebuilding observations)."""

    obs: Array  # f32 [B, W] state s
    action: Array  # int32 [B, D] action taken per branch
    reward: Array  # f32 [B] n-step discounted return
    discount: Array  # f32 [B] γⁿ·(1 − done)
    next_obs: Array  # f32 [B, W] state s′ (n steps later)
    weight: Array  # f32 [B] importance weights (ones without PER)


def warmup_alpha(step: Array, warmup_blend_steps: int) -> Array:
    """α of the MSE → C51 blend: ramps linearly 0 → 1 over ``warmup_blend_steps`` updates."""
    if warmup_blend_steps <= 0:
        return jnp.ones((), jnp.float32)
    return jnp.clip(jnp.asarray(step, jnp.float32) / warmup_blend_steps, 0.0, 1.0)


def _rows(out: NetOutput, sl: slice) -> NetOutput:
    return NetOutput(
        logits=tuple(x[sl] for x in out.logits), q=tuple(x[sl] for x in out.q),
        q_var=tuple(x[sl] for x in out.q_var), gate=out.gate[sl], quantiles=out.quantiles,
        aux={"selection": out.aux["selection"][sl]},  # batch statistics are not sliceable
        features=out.features[sl])


def pairs_next_state_forwards(cfg: ModelConfig) -> bool:
    """Whether :func:`total_loss` runs the online and target forwards at s′ as one paired pass
    (:func:`next_state_forwards` with ``twin=True``): with the separate online forward at s
    (``fuse_next_obs = false``) under float32 matmuls, where the pairing was measured faster."""
    return not cfg.fuse_next_obs and cfg.matmul_dtype == "float32"


def next_state_forwards(net: BranchingQNetwork, params: Any, target_params: Any,
                        next_obs: Array, taus_prime: Array | None,
                        twin: bool = True) -> tuple[NetOutput, NetOutput]:
    """The online network (action selection) and the target network at s′, no gradient:
    ``(online_next, target)``, each what ``net.apply`` returns for ``next_obs`` — the target's
    with IQN quantiles at ``taus_prime`` (when given), the online one's without. Both run
    ``grad_free`` (the GRN blocks' tails as kernels where ``cfg.impl`` selects them).

    ``twin=True``: both read the same s′, so they run as **one** forward vmapped over the two
    parameter trees stacked on a leading axis, s′ shared (not broadcast) — every trunk and
    C51-head matmul is one matmul for both networks instead of two (batched over the pair, or,
    where it reads s′ itself, s′ against both weights side by side) — and the target's IQN head
    then runs alone on the target's trunk features. ``twin=False``: two ``net.apply`` calls.
    The same function either way, to rounding (tested). :func:`total_loss` takes the twin pass
    for float32 matmuls, where it was measured faster, and two passes for bf16, where it was
    not (H200, update at B = 16384: float32 3.50–3.55 vs 3.62–3.68 ms, 3.49–3.50 with s′ shared
    rather than broadcast; bf16 2.32 vs 2.29–2.30 ms, and again without XLA's DotMerger
    1.624–1.628 vs 1.615–1.622 ms; with the whole-block GRN kernel, which folds the pair into
    one launch, 1.845–1.865 vs 1.814–1.818 ms on the H100; ``docs/model.md``).
    """
    params, target_params = jax.lax.stop_gradient((params, target_params))
    if not twin:
        return (net.apply(params, next_obs, grad_free=True),
                net.apply(target_params, next_obs, taus_prime, grad_free=True))
    pair = jax.tree.map(lambda p, t: jnp.stack([p, t]), params, target_params)
    # s′ shared, not broadcast: each matmul reading s′ itself (the variable-selection layer, the
    # MoE gate's first layer) becomes one matmul against both networks' weights side by side
    both = jax.vmap(functools.partial(net.apply, grad_free=True), in_axes=(0, None))(
        pair, next_obs)
    online_next = jax.tree.map(lambda x: x[0], both)
    target = jax.tree.map(lambda x: x[1], both)
    # The online network's expected Q from its own logits, not sliced out of the pair's: XLA
    # computes a reduction before the slice that follows it, so the pair's Q would be computed
    # for the target network too and half of it dropped (three 14 µs kernels at B = 16384 in
    # the H200's serial-graph profile)
    support = make_support(net.cfg.v_min, net.cfg.v_max, net.cfg.n_atoms,
                           dtype=online_next.logits[0].dtype)
    online_next = online_next._replace(q=tuple(expected_q(lg, support)
                                                for lg in online_next.logits))
    if taus_prime is not None:
        target = target._replace(quantiles=iqn_quantiles(
            net, target_params, target.features, taus_prime, grad_free=True))
    return online_next, target


def double_q_applies(cfg: ModelConfig) -> bool:
    """Whether :func:`total_loss` selects the double-Q action and the target distribution at s′
    with the kernel of :mod:`jdqn.pallas.double_q` (:func:`next_state_double_q`): where
    ``cfg.impl`` selects it, and the online forward at s′ is a forward of its own (not under
    ``fuse_next_obs``, where it is part of the differentiated forward)."""
    return not cfg.fuse_next_obs and use_pallas(cfg.impl, "double_q")


def _heads_select(online: Any, target: Any, z: int, v_min: float, v_max: float,
                  interpret: bool, *, mgpu: bool, triton: bool) -> tuple[Array, Array]:
    """The double-Q selection from the heads' inputs (``head_streams="inputs"``): the Mosaic
    GPU kernel (:mod:`jdqn.pallas.double_q_heads_mgpu`) where it is switched on (``mgpu``) and
    takes these shapes, else the Triton kernel (:mod:`jdqn.pallas.double_q_heads`) where its
    switch is on (``triton``), else the heads' products
    (:func:`~jdqn.networks.heads.streams_from_inputs`) through the double-Q kernel."""
    from jdqn.networks.heads import streams_from_inputs
    from jdqn.pallas import double_q, double_q_heads, double_q_heads_mgpu

    pair = target is None
    compiled = not interpret  # on a GPU: only the shapes compiled there (COMPILED_ON_GPU)
    if mgpu and double_q_heads_mgpu.eligible(online, z, pair, compiled) and (
            pair or double_q_heads_mgpu.eligible(target, z, False, compiled)):
        return double_q_heads_mgpu.double_q_heads_mgpu(online, target, z, v_min, v_max,
                                                       interpret)
    if triton:
        return double_q_heads.double_q_heads(online, target, z, v_min, v_max, interpret)
    if pair:
        both = jax.vmap(lambda s: streams_from_inputs(s, z, v_min, v_max, interpret))(online)
        return double_q.double_q_next(both, None, z, v_min, v_max, interpret)
    return double_q.double_q_next(streams_from_inputs(online, z, v_min, v_max, interpret),
                                  streams_from_inputs(target, z, v_min, v_max, interpret),
                                  z, v_min, v_max, interpret)


def next_state_double_q(net: BranchingQNetwork, params: Any, target_params: Any,
                        next_obs: Array, taus_prime: Array | None,
                        twin: bool = True) -> tuple[Array, Array, tuple[Array, ...] | None]:
    """What the targets read from s′, through the double-Q kernel: ``(a* int32 [B, D], the
    target network's probabilities at a* [B, D, Zb] (zero beyond Z), the target's IQN
    quantiles per branch [B, A_d, N′] or None)``. The same forwards as
    :func:`next_state_forwards` (``twin`` likewise), with the C51 heads returning their
    output-layer products (``head_streams``), from which
    :func:`jdqn.pallas.double_q.double_q_next` computes the online expected Q, its argmax and
    the target's softmax there without writing either network's logits. The same function as
    selecting from :func:`next_state_forwards`' outputs, to float32 rounding (tested)."""
    from jdqn.pallas import double_q, double_q_heads, double_q_heads_mgpu

    c = net.cfg
    params, target_params = jax.lax.stop_gradient((params, target_params))
    interpret = jax.default_backend() != "gpu"
    mgpu = (double_q_heads_mgpu.device_supported()
            and use_pallas(c.impl, double_q_heads_mgpu.kernel_name(c.matmul_dtype)))
    triton = use_pallas(c.impl, double_q_heads.kernel_name(c.matmul_dtype))
    apply = functools.partial(net.apply, grad_free=True,
                              head_streams="inputs" if mgpu or triton else True)
    select = functools.partial(_heads_select, mgpu=mgpu, triton=triton) if mgpu or triton \
        else double_q.double_q_next
    if twin:
        pair = jax.tree.map(lambda p, t: jnp.stack([p, t]), params, target_params)
        both = jax.vmap(apply, in_axes=(0, None))(pair, next_obs)
        action, probs = select(both.streams, None, c.n_atoms, c.v_min, c.v_max, interpret)
        features = both.features[1]
        quantiles = None if taus_prime is None else iqn_quantiles(
            net, target_params, features, taus_prime, grad_free=True)
    else:
        online = apply(params, next_obs)
        target = apply(target_params, next_obs, taus_prime)
        action, probs = select(online.streams, target.streams, c.n_atoms, c.v_min, c.v_max,
                               interpret)
        quantiles = target.quantiles
    return action, probs, quantiles


def q_stats_stride(batch_rows: int, q_stats_rows: int) -> int:
    """Every how-many-th row of a batch of ``batch_rows`` the update's Q statistics read
    (``TrainConfig.q_stats_rows``; 0 or a batch no larger: every row)."""
    if q_stats_rows <= 0 or batch_rows <= q_stats_rows:
        return 1
    return batch_rows // q_stats_rows


def total_loss(params: Any, target_params: Any, batch: Batch, key: Array, moe_state: MoEState,
               alpha: Array, *, net: BranchingQNetwork, train_cfg: TrainConfig,
               axis_name: str | None = None) -> tuple[Array, tuple[dict, Array, MoEState, dict]]:
    """Total loss and everything the learner needs from one batch.

    ``target_params`` is the one target tree (trunk, C51 heads **and** the IQN head). ``key``
    draws the τ samples (online N at s, target N′ at s′); pass a fresh key per update. ``alpha``
    is the warm-up blend weight (:func:`warmup_alpha`). Differentiate with
    ``jax.value_and_grad(total_loss, has_aux=True)`` w.r.t. ``params``.

    Returns:
      ``(loss [], (components, per_sample_loss [B], new_moe_state, diagnostics))`` where
      ``components`` holds the scalar terms (``td``, ``c51``, ``mse``, ``iqn``, ``moe_balance``,
      ``total``; IS-weighted batch means) and ``diagnostics`` per-branch Q statistics
      (``q_mean``/``q_std`` [D]) and ``q_gap`` — over every row of a batch of up to
      ``train_cfg.q_stats_rows`` rows, else over every ``B // q_stats_rows``-th row
      (:func:`q_stats_stride`) —, ``target_mean`` [D], ``td_per_branch`` [D], ``gate_util``
      [K], ``gate_entropy``, ``util_entropy``, ``lambda_eff`` and ``logits_finite`` (bool [],
      every row's taken-action logits finite: with the Q statistics, the finite check's
      ``logits``).

    Data parallel (``axis_name``, inside ``shard_map``; ``batch`` is this device's share):
    the batch-mean terms are this shard's means, and the caller averages the gradients over
    devices (equal shares: the global mean). The load balance is a square of a batch mean, which
    does not average that way: it uses the global utilisation ``ū`` (a ``pmean``, no gradient
    through it) in ``λ·K·Σ_k [ū_k² + 2ū_k·(u_k − sg(u_k))]``, whose value is the global term and
    whose gradient, averaged over devices, is the global term's gradient. The MoE state's EMA
    reads ``ū``. The Q mean and spread diagnostics are the global batch's; the other returned
    components and diagnostics are this shard's means (the caller averages them).
    """
    cfg = net.cfg
    chex.assert_rank([batch.obs, batch.action, batch.reward, batch.discount, batch.next_obs,
                      batch.weight], [2, 2, 1, 1, 2, 1])
    chex.assert_type(batch.action, int)
    b = batch.obs.shape[0]
    k_online, k_target = jax.random.split(key)
    taus = taus_prime = None
    if cfg.iqn:  # [N] shared by the batch, [G, N] by groups of B/G rows, [B, N] per sample
        groups = cfg.iqn_tau_groups if cfg.iqn_taus == "batch" else b  # (ModelConfig.iqn_taus)
        if b % groups:
            raise ValueError(f"model.iqn_tau_groups = {groups} does not divide the batch of {b} "
                             "rows: each group of fractions covers an equal share")
        rows = () if groups == 1 else (groups,)
        taus = jax.random.uniform(k_online, (*rows, cfg.iqn_n), jnp.float32)
        taus_prime = jax.random.uniform(k_target, (*rows, cfg.iqn_n_prime), jnp.float32)

    # Online network at s (with gradient) and at s′ (action selection only); target at s′.
    next_action = next_probs = None
    if double_q_applies(cfg):  # the double-Q selection as one kernel on the heads' products
        online = net.apply(params, batch.obs, taus)
        next_action, next_probs, target_quantiles = next_state_double_q(
            net, params, target_params, batch.next_obs, taus_prime,
            twin=pairs_next_state_forwards(cfg))
    elif cfg.fuse_next_obs:
        both = net.apply(params, jnp.concatenate([batch.obs, batch.next_obs], axis=0), taus,
                         tau_rows=b)
        online, online_next = _rows(both, slice(0, b)), _rows(both, slice(b, 2 * b))
        target = net.apply(jax.lax.stop_gradient(target_params), batch.next_obs, taus_prime,
                           grad_free=True)
    else:
        online = net.apply(params, batch.obs, taus)
        online_next, target = next_state_forwards(net, params, target_params, batch.next_obs,
                                                  taus_prime, twin=pairs_next_state_forwards(cfg))
    if next_probs is None:
        online_next = jax.lax.stop_gradient(online_next)
        target = jax.lax.stop_gradient(target)
        target_logits, q_selector = target.logits, online_next.q
        target_quantiles = target.quantiles
    else:
        target_logits = q_selector = None

    td = branching_td_loss_batch(online.logits, batch.action, batch.reward, batch.discount,
                                 target_logits, q_selector, cfg.v_min, cfg.v_max,
                                 jnp.asarray(alpha, online.logits[0].dtype),
                                 impl=cfg.impl, next_probs=next_probs)  # dict of [B, D]
    w = batch.weight
    td_loss = jnp.mean(w * jnp.mean(td["td"], axis=1))
    components = {
        "td": td_loss,
        "c51": jnp.mean(w * jnp.mean(td["ce"], axis=1)),
        "mse": jnp.mean(w * jnp.mean(td["sq"], axis=1)),
    }

    iqn_loss = jnp.zeros((), td_loss.dtype)
    if cfg.iqn:
        taus_b = (jnp.broadcast_to(taus, (b, cfg.iqn_n)) if taus.ndim == 1  # each sample's
                  else jnp.repeat(taus, b // taus.shape[0], axis=0))  # fractions
        iqn = branching_iqn_loss_batch(online.quantiles, taus_b, batch.action, batch.reward,
                                       batch.discount, jax.lax.stop_gradient(target_quantiles),
                                       q_selector, cfg.v_min, cfg.v_max,
                                       next_action=next_action)  # [B, D]
        iqn_loss = jnp.mean(w * jnp.mean(iqn, axis=1))
    components["iqn"] = iqn_loss

    # MoE load balance on the gate at s (s′ rows carry no gradient).
    util_all = None
    if axis_name is not None:
        util_all = jax.lax.pmean(jax.lax.stop_gradient(gate_utilisation(online.gate)), axis_name)
    new_moe_state = update_moe_state(moe_state, online.gate, train_cfg.moe_entropy_decay,
                                     util=util_all)
    h_target = entropy_target(cfg.n_experts, train_cfg.moe_entropy_target)
    lam = lambda_eff(new_moe_state.entropy_ema, train_cfg.moe_lambda_floor,
                     train_cfg.moe_lambda_extra, h_target)
    balance = load_balance_loss(online.gate, lam.astype(online.gate.dtype), util_all)
    components["moe_balance"] = balance

    loss = td_loss + train_cfg.iqn_weight * iqn_loss + balance
    components["total"] = loss
    # [B], for priorities: KL ≥ 0 up to rounding, clamped so that no slot is starved at 0
    per_sample_loss = jax.lax.stop_gradient(
        jnp.maximum(jnp.sum(td["td_kl"], axis=1), 0.0) if train_cfg.per_priority == "kl"
        else jnp.sum(td["td"], axis=1))

    util = (jax.lax.stop_gradient(gate_utilisation(online.gate)) if util_all is None
            else util_all)
    # The Q statistics read every `stride`-th row (a systematic sample of the batch, whose
    # replay indices are sorted), computed here from those rows' logits: over all rows, the
    # expected Q of every action was 31 µs bf16 / 58 µs float32 of a 16384-row update on an
    # H200 (`bench/train.py --probe no_q_diagnostics`), for diagnostics alone.
    stride = q_stats_stride(b, train_cfg.q_stats_rows)
    support = make_support(cfg.v_min, cfg.v_max, cfg.n_atoms, dtype=online.logits[0].dtype)
    qs = [jax.lax.stop_gradient(expected_q(lg if stride == 1 else lg[::stride], support))
          for lg in online.logits]
    if axis_name is None:
        q_mean = jnp.stack([jnp.mean(q) for q in qs])
        q_std = jnp.stack([jnp.std(q) for q in qs])
    else:  # over the global batch: the mean and spread of all devices' Q together
        q_mean = jax.lax.pmean(jnp.stack([jnp.mean(q) for q in qs]), axis_name)
        q_sq = jax.lax.pmean(jnp.stack([jnp.mean(jnp.square(q)) for q in qs]), axis_name)
        q_std = jnp.sqrt(jnp.maximum(q_sq - jnp.square(q_mean), 0.0))
    diagnostics = {
        "q_mean": q_mean,
        "q_std": q_std,
        "q_gap": jnp.mean(q_gap(qs[DIRECTION])),
        "target_mean": jnp.mean(td["target_mean"], axis=0),
        "td_per_branch": jnp.mean(td["td"], axis=0),
        "gate_util": util,
        "gate_entropy": jnp.mean(entropy(jax.lax.stop_gradient(online.gate))),
        "util_entropy": entropy(util),
        "lambda_eff": lam,
        # every row's taken-action logits finite (bool; the update's finite check pops it)
        "logits_finite": jnp.all(td["logits_finite"]),
    }
    diagnostics = jax.tree.map(jax.lax.stop_gradient, diagnostics)
    return loss, (components, per_sample_loss, new_moe_state, diagnostics)
