"""Dueling branching categorical (C51) heads, the IQN quantile head, and Q-value helpers.

Axes: ``B`` batch, ``H`` trunk width, ``D`` branches (4), ``A_d`` actions of branch d, ``Z``
atoms (51), ``Q`` quantile samples, ``F_o`` order-flow features, ``M`` IQN cosine basis size.

Branches, in order: direction (short, hold, long, flat), magnitude (quarter, half, full),
order type (market, limit at touch, passive limit), urgency.

Conditioning (SPEC §4):
* the **magnitude** stream reads ``[h, stop_gradient(E[Q_dir]) / q_scale]``, the expected Q of
  the four direction actions from the same network, scaled by ``max(|v_min|, |v_max|)`` into
  [-1, 1]. Gradient policy: the conditioning is a stop-gradient, so the magnitude loss cannot move
  the direction advantage stream or the value stream *through the conditioning*; it still
  trains the shared trunk through ``h`` like every other branch.
* the **order-type** and **urgency** streams read ``[h, obs[:, flow_idx]]``, the raw order-flow
  features of the state (``flow_idx`` may be empty; then they read ``h`` only).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jdqn.networks.trunk import (
    DenseParams,
    act_dtype,
    add_bias,
    matmul,
    mul_f32,
    wide_dtype,
)
from jdqn.pallas import use_pallas

Array = jax.Array

DIRECTION, MAGNITUDE, ORDER_TYPE, URGENCY = 0, 1, 2, 3
BRANCH_NAMES = ("direction", "magnitude", "order_type", "urgency")


def make_support(v_min: float, v_max: float, n_atoms: int, dtype: Any = jnp.float32) -> Array:
    """Atom values ``z = linspace(v_min, v_max, n_atoms)``: [Z]."""
    return jnp.linspace(v_min, v_max, n_atoms, dtype=dtype)


def dueling_logits(value: Array, advantage: Array) -> Array:
    """``logits[b, a, z] = V[b, z] + A[b, a, z] − mean_a A[b, a, z]`` (Wang et al. 2016, eq. 9,
    applied per atom as in Rainbow).

    value: [B, Z]; advantage: [B, A_d, Z] → [B, A_d, Z].
    """
    return value[:, None, :] + advantage - jnp.mean(advantage, axis=1, keepdims=True)


def centre_actions(kernel: Array, bias: Array, n_actions: int) -> tuple[Array, Array]:
    """An advantage stream's output layer ``kernel [n_in, A·Z]``, ``bias [A·Z]`` (columns
    action-major) with the mean over its A actions subtracted.

    The layer is linear, so ``x·K_c + b_c = (x·K + b) − mean_a (x·K + b)``: the dueling
    centring ``A − mean_a A`` (:func:`dueling_logits`) done on the parameters (a few KB) instead
    of on the ``[B, A, Z]`` activations, where the mean over the middle axis cost XLA transposes
    and a reduction in the forward pass and a broadcast-sum in the backward pass. The same
    function; the gradient reaching ``kernel`` is centred the same way (the map is a
    projection)."""
    n_in = kernel.shape[0]
    k = kernel.reshape(n_in, n_actions, -1)
    c = bias.reshape(n_actions, -1)
    return ((k - jnp.mean(k, axis=1, keepdims=True)).reshape(n_in, -1),
            (c - jnp.mean(c, axis=0, keepdims=True)).reshape(-1))


ATOM_ALIGN = 4  # output-layer columns per action: Z rounded up to a multiple of this


def pad_atoms(kernel: Array, bias: Array, n_actions: int) -> tuple[Array, Array, int]:
    """An output layer ``kernel [n_in, A·Z]``, ``bias [A·Z]`` (columns action-major) with each
    action's Z columns padded by zero columns to ``Zp`` = Z rounded up to a multiple of
    :data:`ATOM_ALIGN`: ``(kernel [n_in, A·Zp], bias [A·Zp], Zp)``. The caller slices the
    product's ``[B, A, Zp]`` back to ``[:, :, :Z]`` — the same values, and the padded columns'
    gradients are dropped by that slice.

    Why: with Z = 51 a float32 row of one action's atoms is 204 bytes, so the output-layer
    GEMMs write ``[B, A·51]`` results whose per-action blocks start off 16-byte boundaries
    (and for A = 3 whole rows do); padded to 52 columns they align, for 2 % more columns.
    Measured on the H200 (the update at B = 16384, float32, alternated with the unpadded
    layers in three machine sessions): the mean 16–20 µs lower in each (2.741–2.773 ms over
    eleven runs, against 2.765–2.792 over eight); padding to 56 or 64 columns gained less, so
    it is the alignment, not a wider tile, that pays. bf16: the same to within noise then
    (1.834–1.846 ms either way); re-measured on the H100 on 2026-12-06 (two alternated rounds),
    unpadded under bf16 was slower, 1.697–1.705 against 1.647–1.657 ms. ``docs/model.md`` has
    the runs."""
    n_in, cols = kernel.shape
    z = cols // n_actions
    zp = -(-z // ATOM_ALIGN) * ATOM_ALIGN
    if zp == z:
        return kernel, bias, z
    kernel = jnp.pad(kernel.reshape(n_in, n_actions, z), ((0, 0), (0, 0), (0, zp - z)))
    bias = jnp.pad(bias.reshape(n_actions, z), ((0, 0), (0, zp - z)))
    return kernel.reshape(n_in, n_actions * zp), bias.reshape(-1), zp


def expected_q(logits: Array, support: Array) -> Array:
    """``E[Q] = Σ_z softmax(logits)_z · z``. logits: [..., Z]; support: [Z] → [...].

    Computed as ``Σ e·z / Σ e`` with ``e = exp(logits − max)``: both sums read ``e`` in one
    pass after the maximum's, where normalising first (``softmax``, then ``Σ p·z``) takes a
    third pass over the logits."""
    e = jnp.exp(logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True)))
    return jnp.sum(e * support, axis=-1) / jnp.sum(e, axis=-1)


def q_variance(logits: Array, support: Array) -> Array:
    """``Var[Q] = Σ_z p_z (z − E[Q])²`` (≥ 0 by construction). [..., Z] → [...]."""
    p = jax.nn.softmax(logits, axis=-1)
    mean = jnp.sum(p * support, axis=-1, keepdims=True)
    return jnp.sum(p * jnp.square(support - mean), axis=-1)


def q_gap(q: Array) -> Array:
    """Best minus second-best Q of a branch: q [B, A] → [B] (≥ 0). Used with the direction
    branch's Q as the env's conviction / opportunity-cost signal."""
    top2 = jax.lax.top_k(q, 2)[0]
    return top2[..., 0] - top2[..., 1]


class HeadStreams(NamedTuple):
    """The dueling C51 head's output-layer products, before their bias adds (what
    :class:`DuelingBranchingHead` returns with ``streams=True``, for the double-Q kernel
    :mod:`jdqn.pallas.double_q`).

    Per stream, the product ``relu(hidden) · W`` with the stream's weights centred over the
    actions (advantages, :func:`jdqn.networks.heads.centre_actions`) and each action's atoms
    padded to ``Zp`` columns (:func:`pad_atoms`), and the matching bias.
    Branch ``d``'s logits are ``(value + value_bias)[:, None, :Z] + (adv[d] + adv_bias[d])
    .reshape(B, A_d, Zp)[:, :, :Z]`` (:func:`stream_logits`). Under ``vmap`` (the paired online/target
    forward) every leaf has the pair axis in front."""

    value: Array  # [B, Zp]
    value_bias: Array  # [Zp]
    adv: tuple[Array, ...]  # per branch [B, A_d·Zp]
    adv_bias: tuple[Array, ...]  # per branch [A_d·Zp]


def stream_logits(streams: HeadStreams, z: int) -> tuple[Array, ...]:
    """Per branch ``[B, A_d, Z]`` logits of one network's :class:`HeadStreams` (the head's
    own arithmetic: bias adds, then the value stream added to each action's atoms)."""
    b, zp = streams.value.shape
    value = (streams.value + streams.value_bias)[:, :z]
    return tuple(value[:, None, :] + (adv + bias).reshape(b, adv.shape[-1] // zp, zp)[:, :, :z]
                 for adv, bias in zip(streams.adv, streams.adv_bias, strict=True))


class HeadInputs(NamedTuple):
    """What the dueling C51 head computes its output-layer products from, past its joint first
    layer (what :class:`DuelingBranchingHead` returns with ``streams="inputs"``, for the fused
    double-Q kernel :mod:`jdqn.pallas.double_q_heads`): the five streams' first-layer outputs
    with their bias (``pre``, streams side by side in the order value, direction, magnitude,
    order type, urgency), the order-flow features of the state, each stream's output layer as
    the head applies it (advantages centred over the actions, atoms padded to ``Zp``), and the
    conditioning rows of the magnitude (direction's expected Q) and of the order-type and
    urgency streams (order flow). :func:`streams_from_inputs` is the head's own arithmetic from
    here on. Under ``vmap`` (the paired online/target forward) every leaf has the pair axis in
    front."""

    pre: Array  # [B, 5·hidden], the stored activations' dtype
    flow: Array  # [B, F_o] (float32 under bf16 matmuls), F_o ≥ 0
    out_kernel: tuple[Array, ...]  # per stream [hidden, n_s·Zp]
    out_bias: tuple[Array, ...]  # per stream [n_s·Zp]
    cond_kernel: Array  # [A_direction, hidden]: the magnitude stream's conditioning rows
    flow_kernel: tuple[Array, Array]  # [F_o, hidden]: order type's and urgency's flow rows


def _conditioned(pre_mag: Array, pre_flow: tuple[Array, Array], q_dir: Array,
                 cond_kernel: Array, flow: Array, flow_kernel: tuple[Array, Array], wide: Any,
                 act: Any) -> tuple[Array, tuple[Array, Array]]:
    """The conditioned streams' inputs, each rounded to the stored dtype ``act`` once: the
    magnitude stream's first-layer output plus the direction's scaled expected Q ``q_dir``
    through its conditioning rows, and the order-type and urgency streams' plus the order flow
    through theirs (as they are when there is no flow). The sums run in ``wide``."""
    mag = (pre_mag.astype(wide) + _small_matmul(q_dir, cond_kernel)).astype(act)
    if not flow.shape[-1]:
        return mag, pre_flow
    return mag, tuple((x.astype(wide) + _small_matmul(flow, w)).astype(act)
                      for x, w in zip(pre_flow, flow_kernel, strict=True))


def streams_from_inputs(inputs: HeadInputs, z: int, v_min: float, v_max: float,
                        interpret: bool | None = None) -> HeadStreams:
    """The head's output-layer products (:class:`HeadStreams`) from its :class:`HeadInputs`:
    per stream ``relu(x)·W`` under the model's precision policy, where the magnitude stream's
    ``x`` carries the direction's expected Q (from the value and direction products, through
    :func:`jdqn.pallas.double_q.expected_q_streams`) and the order-type and urgency streams'
    the order flow — what the grad-free head computes (``streams=True`` returns this)."""
    from jdqn.pallas.double_q import expected_q_streams

    md = "bfloat16" if inputs.pre.dtype == jnp.bfloat16 else "float32"  # (stored in bf16 then)
    act, wide = act_dtype(md, inputs.pre), wide_dtype(md, inputs.pre)
    hid = inputs.cond_kernel.shape[-1]
    pre = [inputs.pre[:, k * hid:(k + 1) * hid] for k in range(len(inputs.out_kernel))]
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret

    def product(k: int, x: Array) -> Array:
        return matmul(nn.relu(x), inputs.out_kernel[k], md, wide)

    value, direction = product(0, pre[0]), product(1, pre[1])
    q_dir = expected_q_streams(value, inputs.out_bias[0], direction, inputs.out_bias[1], z,
                               v_min, v_max, interpret).astype(wide)
    mag, rest = _conditioned(pre[2], (pre[3], pre[4]), q_dir / max(abs(v_min), abs(v_max)),
                             inputs.cond_kernel, inputs.flow, inputs.flow_kernel, wide, act)
    products = (direction, product(2, mag), product(3, rest[0]), product(4, rest[1]))
    return HeadStreams(value, inputs.out_bias[0], products, tuple(inputs.out_bias[1:]))


def _small_matmul(x: Array, w: Array) -> Array:
    """``x [B, k] @ w [k, n]`` for a handful of inputs (k ≤ 8) as a sum of broadcasts, which XLA
    fuses into its consumer instead of launching a matmul with a tiny contraction; a plain
    matmul above that (e.g. the 14 order-flow features of MBP-10 data). Always in the input
    dtype, also under bf16 matmuls: these contractions are a few inputs wide."""
    if x.shape[-1] > 8:
        return jnp.dot(x, w.astype(x.dtype))
    w = w.astype(x.dtype)
    out = x[:, 0:1] * w[0]
    for k in range(1, x.shape[-1]):
        out = out + x[:, k:k + 1] * w[k]
    return out


class DuelingBranchingHead(nn.Module):
    """Dueling, branching, categorical head: ``(h [B, H], obs [B, W])`` → per-branch logits
    ``tuple of [B, A_d, Z]``. One shared value stream over atoms, one advantage stream per
    branch; each stream is ``Dense(hidden) → ReLU → Dense(out)``.

    Parameters are those of five pairs of ``nn.Dense`` layers (``<stream>_fc``, ``<stream>_out``;
    the magnitude, order-type and urgency ``_fc`` kernels have extra input rows for their
    conditioning). The computation is arranged for the accelerator: the five first layers read
    the same trunk feature ``h``, so they run as **one** ``[H, 5·hidden]`` matmul (and one in
    each direction of the backward pass, instead of five plus a five-way sum of cotangents);
    the conditioning rows are added on top as small products, so ``[h, q_dir]`` and
    ``[h, flow]`` are never concatenated; the dueling centring ``A − mean_a A`` is applied to
    the advantage streams' output weights (:func:`centre_actions`), not to the ``[B, A_d, Z]``
    advantages; the output layers write each action's atoms padded to a 16-byte multiple
    (:func:`pad_atoms`). Mathematically this is the same network (tested against the textbook
    form, values and gradients).

    ``streams=True`` (grad-free forwards at s′): returns the output layers' products and biases
    (:class:`HeadStreams`) for the double-Q kernel instead of the logits, and the direction's
    expected Q that conditions the magnitude stream comes from the products through a kernel
    (:func:`jdqn.pallas.double_q.expected_q_streams`), so no logits are written at all
    (:func:`streams_from_inputs`). ``streams="inputs"``: returns what those products are
    computed from (:class:`HeadInputs`: the first layers' output and the output layers), for
    the kernel that computes the products and the double-Q selection in one pass
    (:mod:`jdqn.pallas.double_q_heads`).
    """

    branch_sizes: tuple[int, ...]
    n_atoms: int
    hidden: int
    v_min: float
    v_max: float
    flow_idx: tuple[int, ...] = ()
    matmul_dtype: str = "float32"
    impl: str = "xla"  # ModelConfig.impl (the bias gradients' reduction, trunk.add_bias)
    # True: return the output layers' products (HeadStreams), not the logits; "inputs": what
    # they are computed from (HeadInputs)
    streams: bool | str = False

    @nn.compact
    def __call__(self, h: Array, obs: Array) -> tuple[Array, ...] | HeadStreams | HeadInputs:
        if self.streams not in (False, True, "inputs"):
            raise ValueError(f"streams = {self.streams!r}: expected False, True or 'inputs'")
        b, z, hid, md = h.shape[0], self.n_atoms, self.hidden, self.matmul_dtype
        width, n_flow = h.shape[-1], len(self.flow_idx)
        act, wide = act_dtype(md, h), wide_dtype(md, h)  # hidden layers / logits
        support = make_support(self.v_min, self.v_max, z, dtype=wide)
        extra_in = {"value": 0, BRANCH_NAMES[DIRECTION]: 0,
                    BRANCH_NAMES[MAGNITUDE]: self.branch_sizes[DIRECTION],
                    BRANCH_NAMES[ORDER_TYPE]: n_flow, BRANCH_NAMES[URGENCY]: n_flow}
        out_size = {"value": z, **{BRANCH_NAMES[d]: self.branch_sizes[d] * z
                                   for d in range(len(self.branch_sizes))}}
        streams = tuple(extra_in)
        fc = {s: DenseParams(width + extra_in[s], hid, name=f"{s}_fc")() for s in streams}
        out = {s: DenseParams(hid, out_size[s], name=f"{s}_out")() for s in streams}

        # First layers of all five streams on h: one matmul.
        w1 = jnp.concatenate([fc[s][0][:width] for s in streams], axis=1)  # [H, 5·hidden]
        b1 = jnp.concatenate([fc[s][1] for s in streams])
        pre = add_bias(matmul(h, w1, md, act), b1, self.impl)

        def out_layer(s: str, a: int = 0) -> tuple[Array, Array, int]:  # as the head applies it
            w, bias = out[s]
            if a:  # an advantage stream: centred over its A_d actions (the dueling form)
                w, bias = centre_actions(w, bias, a)
            return pad_atoms(w, bias, max(a, 1))

        flow = (obs[:, np.asarray(self.flow_idx)] if n_flow else obs[:, :0]).astype(wide)
        cond_kernel = fc[BRANCH_NAMES[MAGNITUDE]][0][width:]
        flow_kernel = tuple(fc[BRANCH_NAMES[d]][0][width:] for d in (ORDER_TYPE, URGENCY))
        if self.streams:  # grad-free: the products (or their inputs), no logits at all
            layers = [out_layer(s, a) for s, a in zip(streams, (0, *self.branch_sizes),
                                                      strict=True)]
            inputs = HeadInputs(pre, flow, tuple(w for w, _, _ in layers),
                                tuple(bias for _, bias, _ in layers), cond_kernel, flow_kernel)
            if self.streams == "inputs":
                return inputs
            return streams_from_inputs(inputs, z, self.v_min, self.v_max)
        pre = {s: pre[:, k * hid:(k + 1) * hid] for k, s in enumerate(streams)}

        def second(s: str, x: Array, a: int = 0) -> Array:  # [B, max(a, 1), Z], in `wide`
            n = max(a, 1)
            w, bias, zp = out_layer(s, a)
            y = matmul(nn.relu(x), w, md, wide)
            return add_bias(y, bias, self.impl).reshape(b, n, zp)[:, :, :z]

        def logits(d: int, x: Array) -> Array:
            adv = second(BRANCH_NAMES[d], x, self.branch_sizes[d])  # centred: Σ_a adv = 0
            return value[:, None, :] + adv  # = dueling_logits(value, uncentred advantage)

        value = second("value", pre["value"])[:, 0]  # [B, Z]
        direction = logits(DIRECTION, pre[BRANCH_NAMES[DIRECTION]])
        q_scale = max(abs(self.v_min), abs(self.v_max))
        q_dir = jax.lax.stop_gradient(expected_q(direction, support)) / q_scale  # [B, 4]
        mag, rest = _conditioned(pre[BRANCH_NAMES[MAGNITUDE]],
                                 tuple(pre[BRANCH_NAMES[d]] for d in (ORDER_TYPE, URGENCY)),
                                 q_dir, cond_kernel, flow, flow_kernel, wide, act)
        return (direction, logits(MAGNITUDE, mag),
                *(logits(d, x) for d, x in zip((ORDER_TYPE, URGENCY), rest, strict=True)))


def cosine_embedding(taus: Array, n_basis: int) -> Array:
    """IQN's τ embedding basis ``cos(π i τ)``, i = 0..M−1 (Dabney et al. 2018, eq. 4).
    taus: [B, Q] → [B, Q, M]."""
    i = jnp.arange(n_basis, dtype=taus.dtype)
    return jnp.cos(jnp.pi * i * taus[..., None])


def _modulation_applies(h: Array, pre: Array) -> bool:
    from jdqn.pallas import modulation  # (only when asked: it imports Pallas)

    return h.dtype == jnp.float32 and modulation.eligible(pre)


def iqn_features(h: Array, taus: Array, we: Array, be: Array, w1: Array, b1: Array, w2: Array,
                 b2: Array, matmul_dtype: str, modulation_kernel: bool = False,
                 impl: str = "xla") -> Array:
    """The IQN head's dense stack, plain JAX (the reference of the fused kernel
    :mod:`jdqn.pallas.iqn`): ``out[b, q] = W2·relu(W1·(h_b ⊙ relu(We·cos(π i τ_bq) + be)) + b1)
    + b2``. h [B, H], taus [B, Q] → [B, Q, O] (float32, or the input dtype), under the precision
    policy of :mod:`jdqn.networks.trunk`. ``modulation_kernel``: the τ modulation
    ``h ⊙ relu(·)``'s backward pass runs as one Pallas kernel (:mod:`jdqn.pallas.modulation`)
    where it applies (float32, Q and H powers of two); the values are the same either way.
    ``impl`` selects how the bias gradients are reduced (:func:`jdqn.networks.trunk.add_bias`)."""
    md = matmul_dtype
    emb = cosine_embedding(taus.astype(wide_dtype(md, h)), we.shape[0])  # [B, Q, M]
    pre = matmul(emb, we, md, act_dtype(md, emb))  # [B, Q, H]
    if modulation_kernel and _modulation_applies(h, pre):
        from jdqn.pallas import modulation

        x = modulation.modulate(h, pre, be, jax.default_backend() != "gpu")
    else:
        phi = nn.relu(add_bias(pre, be, impl))
        x = mul_f32(h[:, None, :], phi, phi.dtype)  # dh sums over Q in float32
    hid = nn.relu(add_bias(matmul(x, w1, md, act_dtype(md, x)), b1, impl))
    return add_bias(matmul(hid, w2, md, wide_dtype(md, hid)), b2, impl)  # [B, Q, O]


def iqn_features_shared(h: Array, taus: Array, we: Array, be: Array, w1: Array, b1: Array,
                        w2: Array, b2: Array, matmul_dtype: str, impl: str = "xla",
                        bias_in_product: bool = False, tail_kernel: bool = False) -> Array:
    """The IQN head's dense stack for fractions **shared by groups of rows**: h [B, H], taus [Q]
    (one set for every row) or [G, Q] (group g = rows ``g·B/G … (g+1)·B/G − 1``; G divides B)
    → [B, Q, O], the same function as :func:`iqn_features` with each row given its group's
    fractions (tested, values and gradients).

    φ(τ) = relu(We·cos(π i τ) + be) does not depend on the row, so the modulated feature's first
    layer is ``W1·(h ⊙ φ(τ_q)) = (diag φ(τ_q) W1)ᵀ h``: the modulation moves onto the weights,
    one ``[H, Q·F]`` matrix per group (Q·H·F numbers, 1 MB at the default sizes), and the
    ``[B, Q, H]`` modulated features — the largest tensors of the per-row form, 134 MB each at
    B = 16384 in float32, written and read several times forward and backward — are never
    formed: the first layer is one ``[B, H] × [H, Q·F]`` matmul straight from the trunk feature
    (G > 1: one batched ``[G, B/G, H] × [G, H, Q·F]`` matmul, the same FLOPs). φ and the folded
    weights are computed in float32 (the ``wide`` dtype) also under bf16 matmuls.

    ``bias_in_product`` (float32 matmuls, and not under the Pallas bias reductions): the hidden
    layer's bias ``b1`` becomes a weight row read by a constant-1 input column (h padded with
    ``[1, 0 × 7]``, so the contraction stays a multiple of 8), and the hidden layer is
    ``relu(pre)``: no broadcast bias add between the two products over the ``[B, Q·F]``
    activations (67 MB at B = 16384), which leaves XLA a plain elementwise producer to fuse.
    Under TF32 matmuls (the GPU's default precision) ``b1`` is then rounded like the weights.
    The network asks for it where no gradient is taken (the target network's quantiles at
    s′): measured on the H200, update 2.763–2.774 ms against 2.770–2.788 without it (five runs
    each, one machine session); used with a gradient as well it was slower (2.799–2.809 ms: the
    weight gradient becomes an ``[H + 8, Q·F]`` product). The same function to rounding
    (tested, values and gradients).

    ``tail_kernel``: the hidden bias, ReLU and output layer after the first product run as one
    Pallas kernel, differentiated by a second (:mod:`jdqn.pallas.iqn_tail`; float32 matmuls,
    or bf16 ones with the same rounding points); it takes the hidden bias itself, so
    ``bias_in_product`` is then ignored."""
    md = matmul_dtype
    wide = wide_dtype(md, h)
    tail_kernel = tail_kernel and (h.dtype == jnp.float32 or md == "bfloat16")
    groups, n_q = (1, taus.shape[0]) if taus.ndim == 1 else taus.shape
    b, width, f = h.shape[0], h.shape[-1], w1.shape[1]
    if b % groups:
        raise ValueError(f"{groups} groups of IQN fractions do not divide the {b} rows")
    emb = cosine_embedding(taus.reshape(-1).astype(wide), we.shape[0])  # [G·Q, M]
    phi = nn.relu(jnp.dot(emb, we.astype(wide)) + be.astype(wide))  # [G·Q, H]
    phi = jnp.swapaxes(phi.reshape(groups, n_q, width), 1, 2)  # [G, H, Q]
    w1_tau = (phi[..., None] * w1.astype(wide)[None, :, None, :]).reshape(
        groups, width, n_q * f)  # [G, H, Q·F]: group g's diag φ(τ_gq)·W1, side by side
    fold = (bias_in_product and md == "float32" and not use_pallas(impl, "reductions")
            and not tail_kernel)
    if fold:  # b1 as a weight row read by a constant-1 input column
        h = jnp.concatenate([h, jnp.ones((b, 1), h.dtype), jnp.zeros((b, 7), h.dtype)], -1)
        rows = jnp.zeros((groups, 8, n_q * f), w1_tau.dtype).at[:, 0].set(
            jnp.tile(b1.astype(w1_tau.dtype), n_q))
        w1_tau = jnp.concatenate([w1_tau, rows], axis=1)
        width += 8
    if groups == 1:  # one [B, H] × [H, Q·F] product
        pre = matmul(h, w1_tau[0], md, act_dtype(md, h))
    else:  # one batched [G, B/G, H] × [G, H, Q·F] product
        pre = matmul(h.reshape(groups, b // groups, width), w1_tau, md, act_dtype(md, h))
    if tail_kernel:  # bias, ReLU and the output layer: one kernel over [B·Q, F] rows
        from jdqn.pallas import iqn_tail

        out = iqn_tail.iqn_tail(pre.reshape(b * n_q, f), b1, w2, b2,
                                jax.default_backend() != "gpu")
        return out.reshape(b, n_q, -1)
    pre = pre.reshape(b, n_q, f)
    hid = nn.relu(pre if fold else add_bias(pre, b1, impl))
    return add_bias(matmul(hid, w2, md, wide_dtype(md, hid)), b2, impl)  # [B, Q, O]


class IQNHead(nn.Module):
    """Implicit quantile head: ``φ(τ) = ReLU(Dense_H(cos(π i τ)))``, feature ``h ⊙ φ(τ)``,
    then a dueling per-branch output ``Dense(hidden) → ReLU → Dense(1 + Σ A_d)``.

    (h [B, H], taus [Q], [G, Q] or [B, Q]) → tuple of quantile values ``[B, A_d, Q]``:
    ``value + A_d − mean_a A_d``, the centring done on the output layer's columns
    (:func:`centre_actions`). The IQN branches read the trunk feature only (no direction/flow
    conditioning): the head is an auxiliary distributional loss that shapes the shared trunk.

    ``taus [Q]``: one set of fractions for every row; ``taus [G, Q]`` with G < B dividing B: one
    set per group of B/G consecutive rows — both computed as :func:`iqn_features_shared` (the
    modulation folded into the first layer's weights); ``taus [B, Q]``: fractions per row,
    computed as :func:`iqn_features`. The same function for equal fractions.

    ``fused=True`` (per-row fractions only) runs the dense stack as one Pallas kernel
    (:mod:`jdqn.pallas.iqn`: the ``[B·Q, H]`` intermediates never reach device memory). Its
    backward pass recomputes through the plain-JAX stack, so the caller asks for it where no
    gradient is taken (the target network's quantiles at s′); the result is the same function
    either way. ``bias_in_product`` (shared fractions): the hidden layer's bias inside the first
    product (:func:`iqn_features_shared`), asked for where no gradient is taken.
    ``tail_kernel`` (shared fractions): the hidden bias, ReLU and output layer as
    :mod:`jdqn.pallas.iqn_tail`'s kernels (forward and backward).
    """

    branch_sizes: tuple[int, ...]
    n_basis: int
    hidden: int
    matmul_dtype: str = "float32"
    fused: bool = False
    modulation_kernel: bool = False  # see iqn_features
    impl: str = "xla"  # ModelConfig.impl (the bias gradients' reduction, trunk.add_bias)
    bias_in_product: bool = False  # shared fractions: b1 inside the first product (grad-free)
    tail_kernel: bool = False  # shared fractions: jdqn.pallas.iqn_tail's kernels

    @nn.compact
    def __call__(self, h: Array, taus: Array) -> tuple[Array, ...]:
        we, be = DenseParams(self.n_basis, h.shape[-1], name="tau_embed")()
        w1, b1 = DenseParams(h.shape[-1], self.hidden, name="fc")()
        w2, b2 = DenseParams(self.hidden, 1 + sum(self.branch_sizes), name="out")()
        # the dueling centring per branch, on the output columns (see centre_actions)
        cols, bias, start = [w2[:, :1]], [b2[:1]], 1
        for a in self.branch_sizes:
            wc, bc = centre_actions(w2[:, start:start + a], b2[start:start + a], a)
            cols.append(wc)
            bias.append(bc)
            start += a
        w2, b2 = jnp.concatenate(cols, axis=1), jnp.concatenate(bias)
        if taus.ndim == 1 or taus.shape[0] < h.shape[0]:  # shared by every row or by groups
            out = iqn_features_shared(h, taus, we, be, w1, b1, w2, b2, self.matmul_dtype,
                                      self.impl, self.bias_in_product, self.tail_kernel)
        elif self.fused:
            from jdqn.pallas.iqn import iqn_features_pallas

            out = iqn_features_pallas(h, taus, we, be, w1, b1, w2, b2, self.matmul_dtype,
                                      jax.default_backend() != "gpu")
        else:
            out = iqn_features(h, taus, we, be, w1, b1, w2, b2, self.matmul_dtype,
                               self.modulation_kernel, self.impl)
        value, adv = out[..., :1], out[..., 1:]  # [B, Q, 1+ΣA]
        result, start = [], 0
        for a in self.branch_sizes:
            adv_d = adv[..., start:start + a]  # [B, Q, A_d]
            start += a
            q_d = value + adv_d  # centred in w2, b2: value + A − mean_a A
            result.append(jnp.swapaxes(q_d, 1, 2))  # [B, A_d, Q]
        return tuple(result)
