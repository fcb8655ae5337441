"""Trunk: variable selection → input projection → GRN blocks → Mixture-of-Experts.

Axes: ``B`` batch, ``W`` state width (128), ``H`` trunk width (256), ``K`` experts,
``E`` expert bottleneck (64), ``G`` gate hidden (64).

Precision policy (shared with :mod:`jdqn.networks.heads`): parameters are always float32.

* ``matmul_dtype = "float32"``: no cast is inserted anywhere, so the whole model follows its
  input dtype (the gradient tests run it in float64).
* ``matmul_dtype = "bfloat16"`` (mixed precision): layer matmuls read bf16 and accumulate in
  float32; **activations are stored in bf16** (the hidden layers, GLU gates, the residual stream,
  the MoE hidden layer, the IQN features), because the update is bound by activation traffic,
  not by matmul FLOPs. LayerNorm statistics are computed in float32 (flax does this for bf16
  inputs). Bias adds and broadcast products run in float32 and round once
  (:func:`add_bias`, :func:`mul_f32`), so bias gradients and other batch sums reduce in float32.
  Everything a loss or a decision reads is float32: the MoE gate logits and softmax, the C51
  logits (the heads' output layers accumulate and return float32), the IQN quantiles and every
  loss.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jdqn.pallas import use_pallas

Array = jax.Array


def compute_dtype(matmul_dtype: str) -> Any:
    """``ModelConfig.matmul_dtype`` → the dtype matmul inputs and stored activations are cast to
    (None = no cast: the model follows its input dtype)."""
    return jnp.bfloat16 if matmul_dtype == "bfloat16" else None


def act_dtype(matmul_dtype: str, x: Array) -> Any:
    """Dtype of stored activations: bf16 under bf16 matmuls, else ``x``'s dtype."""
    return jnp.bfloat16 if matmul_dtype == "bfloat16" else x.dtype


def wide_dtype(matmul_dtype: str, x: Array) -> Any:
    """Dtype of what losses and decisions read (logits, gate, quantiles): float32 under bf16
    matmuls, else ``x``'s dtype."""
    return jnp.float32 if matmul_dtype == "bfloat16" else x.dtype


_LECUN_NORMAL = nn.initializers.lecun_normal()


class DenseParams(nn.Module):
    """The ``kernel [n_in, n_out]`` and ``bias [n_out]`` of a dense layer, created exactly as
    ``nn.Dense`` creates them (same names, initialisers and draw order) but not applied, so the
    caller controls the precision of the product (and may apply several as one matmul)."""

    n_in: int
    n_out: int
    kernel_init: Any = _LECUN_NORMAL

    @nn.compact
    def __call__(self) -> tuple[Array, Array]:
        kernel = self.param("kernel", self.kernel_init, (self.n_in, self.n_out), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (self.n_out,), jnp.float32)
        return kernel, bias


def matmul(x: Array, w: Array, matmul_dtype: str, out_dtype: Any = None) -> Array:
    """``x @ w`` (contracting x's last axis) for a weight ``w [K, N]``; for a stack ``w [G, K,
    N]`` and ``x [G, M, K]``, one product per leading index (``[G, M, N]``). With
    ``"bfloat16"`` the inputs are cast to bf16, the product accumulates in float32 and the GEMM
    writes ``out_dtype`` (default float32; bf16 for stored activations, so no separate convert
    kernel rereads a float32 copy). Otherwise ``w`` follows ``x``'s dtype and ``out_dtype`` is
    ignored."""
    product = jnp.dot if w.ndim == 2 else jnp.matmul
    if matmul_dtype == "bfloat16":
        return product(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                       preferred_element_type=out_dtype or jnp.float32)
    return product(x, w.astype(x.dtype))


def add_bias(y: Array, bias: Array, impl: str = "xla") -> Array:
    """``y + bias`` in ``y``'s dtype. For a bf16 ``y`` the add runs in float32 and rounds once:
    the bias keeps its precision and, more importantly, its gradient — a sum of B cotangents —
    is reduced in float32 (a bf16 sum over 16384 rows loses ~3 % of it). The converts fuse
    into the elementwise kernel that reads ``y``, so nothing extra is stored.

    ``impl`` (``ModelConfig.impl``) selecting the ``"reductions"`` kernel: the same values, and
    the bias gradient is summed in the fixed tree order of :mod:`jdqn.pallas.reduce`."""
    if use_pallas(impl, "reductions"):
        from jdqn.pallas import reduce

        return reduce.add_bias(y, bias, jax.default_backend() != "gpu")
    return add_bias_values(y, bias)


def add_bias_values(y: Array, bias: Array) -> Array:
    """The operations of :func:`add_bias` (also the forward pass of the tree-sum variant,
    :func:`jdqn.pallas.reduce.add_bias`, so both give the same bits)."""
    if y.dtype == jnp.bfloat16:
        return (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(jnp.bfloat16)
    return y + bias.astype(y.dtype)


def mul_f32(a: Array, b: Array, out_dtype: Any) -> Array:
    """``a * b`` computed in float32 when ``out_dtype`` is bf16 (rounded once), so a gradient
    that sums the product over a broadcast axis reduces in float32; plain ``a * b`` otherwise."""
    if out_dtype == jnp.bfloat16:
        return (a.astype(jnp.float32) * b.astype(jnp.float32)).astype(jnp.bfloat16)
    return a.astype(out_dtype) * b.astype(out_dtype)


def dense(x: Array, features: int, matmul_dtype: str, name: str,
          kernel_init: Any = _LECUN_NORMAL, wide: bool = False, impl: str = "xla") -> Array:
    """A dense layer under the precision policy (call inside a ``@nn.compact`` method). Params
    land at ``<name>/kernel`` and ``<name>/bias`` with ``nn.Dense``'s initialisation. The result
    is stored as an activation (bf16 under bf16 matmuls) or, with ``wide=True``, in float32
    (outputs a loss or a softmax reads); the bias is added as in :func:`add_bias` (``impl``:
    see there)."""
    kernel, bias = DenseParams(x.shape[-1], features, kernel_init, name=name)()
    out = wide_dtype(matmul_dtype, x) if wide else act_dtype(matmul_dtype, x)
    return add_bias(matmul(x, kernel, matmul_dtype, out), bias, impl)


class GRNBlock(nn.Module):
    """Gated residual network block (Lim et al. 2021, Temporal Fusion Transformers, eq. 2–5).

    ``x [B, H] → LayerNorm(x + GLU(W1 · ELU(W2 x + b2) + b1))``, GLU(γ) = σ(W4 γ + b4) ⊙
    (W5 γ + b5). W4 and W5 are one ``H → 2H`` layer (``glu``), and since nothing separates it
    from ``W1`` (``fc``) the two are applied as one: ``[W4; W5]·(W1 η + b1) + b45 =
    ([W4; W5]·W1)·η + ([W4; W5]·b1 + b45)``, the ``[H, 2H]`` product of the weights formed
    per forward (in float32 at full precision; a few hundred kFLOP per column against B rows).
    The parameters are unchanged (``fc`` and ``glu`` as ``nn.Dense`` creates them); the batch
    skips one ``[B, H] × [H, H]`` matmul forward and two backward, and the ``[B, H]`` η1
    activation. The same function to rounding (tested against the three separate layers,
    values and gradients, in float64).
    """

    width: int
    matmul_dtype: str = "float32"
    impl: str = "xla"  # ModelConfig.impl (the bias gradients' reduction, see add_bias)
    # no gradient taken: the tail may be jdqn.pallas.grn_tail's kernel ("grn_tail"), or the
    # whole block jdqn.pallas.grn_block's ("grn_block_bf16", "grn_block_f32": TF32); with a
    # gradient, the tail kernel and its backward kernel under "grn_tail_grad" (float32
    # matmuls) or "grn_tail_grad_bf16" (bf16 matmuls), switches measured apart
    grad_free: bool = False

    @nn.compact
    def __call__(self, x: Array) -> Array:
        md, impl = self.matmul_dtype, self.impl
        hi = jax.lax.Precision.HIGHEST  # parameter-sized products: exact float32
        whole = "grn_block_bf16" if md == "bfloat16" else "grn_block_f32"
        if self.grad_free and use_pallas(impl, whole):
            from jdqn.pallas import grn_block, grn_tail

            # the whole block: one Mosaic GPU kernel (Hopper only)
            if grn_block.eligible(x, self.width) and grn_block.device_supported():
                w_fc, b_fc = DenseParams(x.shape[-1], self.width, name="fc_elu")()
                w1, b1 = DenseParams(self.width, self.width, name="fc")()
                w45, b45 = DenseParams(self.width, 2 * self.width, name="glu")()
                scale, offset = _LayerNormParams(x.shape[-1], name="norm")()
                return grn_block.grn_block(
                    x, w_fc, b_fc, jnp.dot(w1, w45, precision=hi),
                    jnp.dot(b1, w45, precision=hi) + b45, scale, offset, grn_tail.EPSILON,
                    jax.default_backend() != "gpu")
        eta2 = nn.elu(dense(x, self.width, md, "fc_elu", impl=impl))
        w1, b1 = DenseParams(eta2.shape[-1], self.width, name="fc")()
        w45, b45 = DenseParams(self.width, 2 * self.width, name="glu")()
        w = jnp.dot(w1, w45, precision=hi)  # [H, 2H]
        b = jnp.dot(b1, w45, precision=hi) + b45
        product = matmul(eta2, w, md, act_dtype(md, eta2))
        # with a gradient, a switch per matmul dtype: under bf16 the backward kernel measured
        # slower than XLA's while XLA's DotMerger joined the forwards at s and s′
        # (train_h200_bf16_grn_tail_grad_ab.json), faster without it
        # (train_h200_bf16_grn_tail_grad_ab2.json)
        with_grad = use_pallas(impl, "grn_tail_grad" if md == "float32"
                               else "grn_tail_grad_bf16")
        if use_pallas(impl, "grn_tail") and (self.grad_free or with_grad):
            from jdqn.pallas import grn_tail

            if grn_tail.eligible(product, x):  # bias, GLU, residual and LayerNorm: one kernel
                scale, offset = _LayerNormParams(x.shape[-1], name="norm")()
                return grn_tail.grn_tail(product, b, x, scale, offset, grn_tail.EPSILON,
                                         jax.default_backend() != "gpu")
        gate, value = jnp.split(add_bias(product, b, impl), 2, axis=-1)
        return nn.LayerNorm(dtype=compute_dtype(self.matmul_dtype), param_dtype=jnp.float32,
                            name="norm")(x + nn.sigmoid(gate) * value)


class _LayerNormParams(nn.Module):
    """The ``scale`` and ``bias`` of ``nn.LayerNorm`` (the same names, shapes and
    initialisers), not applied: :class:`GRNBlock`'s fused tail reads them."""

    features: int

    @nn.compact
    def __call__(self) -> tuple[Array, Array]:
        return (self.param("scale", nn.initializers.ones, (self.features,), jnp.float32),
                self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32))


def _trunk_input_kernels(impl: str, matmul_dtype: str, grad_free: bool, obs: Array,
                         width: int | None = None) -> bool:
    """Whether a grad-free trunk reads ``obs`` through :mod:`jdqn.pallas.trunk_input`'s
    kernels (the switch ``"trunk_input_bf16"`` or ``"trunk_input_f32"`` by matmul dtype)."""
    if not grad_free:
        return False
    switch = "trunk_input_bf16" if matmul_dtype == "bfloat16" else "trunk_input_f32"
    if not use_pallas(impl, switch):
        return False
    from jdqn.pallas import trunk_input

    return trunk_input.eligible(obs, width)


class _SelectionParams(nn.Module):
    """:class:`VariableSelection`'s parameters (``select/kernel``, ``select/bias``) created as
    it creates them, not applied: the grad-free trunk's kernel reads them."""

    features: int

    @nn.compact
    def __call__(self) -> tuple[Array, Array]:
        return DenseParams(self.features, self.features, name="select")()


def _selection_weights(obs: Array, kernel: Array, bias: Array, matmul_dtype: str,
                       impl: str) -> Array:
    """The variable-selection weights ``σ(obs·V + c)`` in the activations' dtype (the
    ``select`` layer as :func:`dense` applies it)."""
    return nn.sigmoid(add_bias(matmul(obs, kernel, matmul_dtype, act_dtype(matmul_dtype, obs)),
                               bias, impl))


class VariableSelection(nn.Module):
    """Sigmoid variable-selection gate over the ``W`` inputs: ``x ⊙ σ(V x + c)``.

    Sigmoid, not softmax: a softmax over W inputs makes the weights sum to one, which divides the
    signal by the width (the predecessor's version did exactly that); independent sigmoids let
    every input pass at full strength. Returns the gated inputs and the weights ``[B, W]``.
    """

    matmul_dtype: str = "float32"
    impl: str = "xla"  # ModelConfig.impl (the bias gradient's reduction, see add_bias)

    @nn.compact
    def __call__(self, obs: Array) -> tuple[Array, Array]:
        kernel, bias = DenseParams(obs.shape[-1], obs.shape[-1], name="select")()
        weights = _selection_weights(obs, kernel, bias, self.matmul_dtype, self.impl)
        return obs.astype(weights.dtype) * weights, weights.astype(
            wide_dtype(self.matmul_dtype, obs))


class MoEOutput(NamedTuple):
    h: Array  # [B, H] mixture output Σ_k g_k e_k
    gate: Array  # [B, K] gate probabilities (softmax)
    gate_logits: Array  # [B, K]


def moe_mixture_reference(gate: Array, expert_out: Array) -> Array:
    """Reference mixture ``h[b] = Σ_k gate[b, k] · expert_out[b, k]``.

    gate: [B, K]; expert_out: [B, K, H] → [B, H]. The layer itself never materialises
    ``expert_out`` (see :class:`MixtureOfExperts`); this is the oracle for tests and kernels.
    """
    return jnp.einsum("bk,bkh->bh", gate, expert_out)


class ExpertWeights(nn.Module):
    """Stacked weights of K dense layers: ``kernel [K, n_in, n_out]``, ``bias [K, n_out]``
    (named like ``nn.Dense``'s, so name-based weight-decay masks treat them alike)."""

    n_experts: int
    n_in: int
    n_out: int

    @nn.compact
    def __call__(self) -> tuple[Array, Array]:
        shape = (self.n_experts, self.n_in, self.n_out)
        kernel = self.param("kernel", nn.initializers.lecun_normal(batch_axis=(0,)), shape,
                            jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (self.n_experts, self.n_out),
                          jnp.float32)
        return kernel, bias


class MixtureOfExperts(nn.Module):
    """K expert MLPs ``H → E → H`` (ReLU) mixed by a softmax gate on the raw state.

    Experts are evaluated densely, with stacked weights ``experts_in/kernel [K, H, E]`` and
    ``experts_out/kernel [K, E, H]`` (w1, w2 below), as
    two batched contractions and no Python loop over experts. The mixture is folded into the
    second contraction::

        h = Σ_k g_k (relu(x w1_k + b1_k) w2_k + b2_k)
          = einsum('bke,keh->bh', g[..., None] · hidden, w2) + g · b2

    which never writes the ``[B, K, H]`` expert outputs (K·H floats per sample, the dominant
    activation traffic of a naive dense MoE) but only the ``[B, K, E]`` hidden layer.

    The gate (``W → G → K``) reads the raw observation, not the trunk feature, so its routing
    is interpretable in terms of the state. Its last layer is zero-initialised: the model starts
    with a uniform gate (output = mean of the experts) and balanced load.
    """

    n_experts: int
    hidden: int
    gate_hidden: int
    matmul_dtype: str = "float32"
    # ModelConfig.impl: "pallas" runs the mixture as jdqn.pallas.moe's kernels; a kernel set
    # holding "moe_gate_grad" but not "moe" differentiates the gated hidden layer through
    # jdqn.pallas.moe_gate's backward kernel (float32)
    impl: str = "xla"
    # no gradient taken: the gate may be jdqn.pallas.trunk_input's kernel ("trunk_input_bf16",
    # "trunk_input_f32")
    grad_free: bool = False

    @nn.compact
    def __call__(self, x: Array, obs: Array) -> MoEOutput:
        k, e, h_dim = self.n_experts, self.hidden, x.shape[-1]
        w1, b1 = ExpertWeights(k, h_dim, e, name="experts_in")()
        w2, b2 = ExpertWeights(k, e, h_dim, name="experts_out")()

        if _trunk_input_kernels(self.impl, self.matmul_dtype, self.grad_free, obs,
                                self.gate_hidden):
            from jdqn.pallas import trunk_input

            # the gate as one kernel (obs read once, its hidden layer kept on chip)
            gw1, gb1 = DenseParams(obs.shape[-1], self.gate_hidden, name="gate_fc")()
            gw2, gb2 = DenseParams(self.gate_hidden, k, nn.initializers.zeros,
                                   name="gate_out")()
            gate_logits, gate = trunk_input.gate(obs, gw1, gb1, gw2, gb2, self.matmul_dtype,
                                                 jax.default_backend() != "gpu")
        else:
            g_hidden = nn.relu(dense(obs, self.gate_hidden, self.matmul_dtype, "gate_fc",
                                     impl=self.impl))
            gate_logits = dense(g_hidden, k, self.matmul_dtype, "gate_out",
                                kernel_init=nn.initializers.zeros, wide=True, impl=self.impl)
            gate = jax.nn.softmax(gate_logits, axis=-1)

        md, act = self.matmul_dtype, act_dtype(self.matmul_dtype, x)
        pre = _einsum("bh,khe->bke", x, w1, md, act)  # [B, K, E]
        if md == "float32" and x.dtype == jnp.float32 and use_pallas(self.impl, "moe"):
            from jdqn.pallas.moe import moe_mixture_pallas  # the same function, fused

            h, gate = moe_mixture_pallas(gate_logits, nn.relu(add_bias(pre, b1, self.impl)),
                                         w2, b2, jax.default_backend() != "gpu")
            return MoEOutput(h=h, gate=gate, gate_logits=gate_logits)
        if md == "float32" and use_pallas(self.impl, "moe_gate_grad"):
            from jdqn.pallas import moe_gate

            rows = (x.shape[0], k * e)
            if moe_gate.eligible(pre.reshape(rows), gate):  # the gradient: one Pallas kernel
                weighted = moe_gate.gated_hidden(pre.reshape(rows), b1.reshape(-1), gate,
                                                 jax.default_backend() != "gpu")
                h = _mix_with_bias(weighted, gate, w2.reshape(k * e, h_dim), b2)
                return MoEOutput(h=h, gate=gate, gate_logits=gate_logits)
        hidden = nn.relu(add_bias(pre, b1, self.impl))  # [B, K, E]
        weighted = mul_f32(gate[..., None], hidden, act)  # d gate sums over E in float32
        if md == "float32":  # the output bias rides in the mixture's product
            h = _mix_with_bias(weighted.reshape(x.shape[0], k * e), gate.astype(act),
                               w2.reshape(k * e, h_dim).astype(act), b2.astype(act))
            return MoEOutput(h=h, gate=gate, gate_logits=gate_logits)
        # bf16: the output bias rides in the product too, split into bf16 halves (see there)
        h = _mix_with_bias_bf16(weighted.reshape(x.shape[0], k * e), gate,
                                w2.reshape(k * e, h_dim), b2)
        return MoEOutput(h=h, gate=gate, gate_logits=gate_logits)


@jax.custom_jvp
def _mix_with_bias(weighted: Array, gate: Array, w2: Array, b2: Array) -> Array:
    """The float32 MoE output ``weighted @ w2 + gate @ b2`` (weighted [B, K·E], gate [B, K],
    w2 [K·E, H], b2 [K, H]) as **one** product, ``[weighted, gate] @ [w2; b2]``: the bias
    ``Σ_k g_k b2_k`` is accumulated by the GEMM instead of added by a separate pass over the
    ``[B, H]`` output (H200, B = 16384, serial-graph profile: the MoE's forward kernels 278 →
    230 µs per update). The derivative is that of the two separate products (a custom JVP, so
    forward mode works too, and reverse mode transposes it into ``dh·w2ᵀ``, ``dh·b2ᵀ``,
    ``weightedᵀ·dh`` and ``gateᵀ·dh``, the products the unfused layer had): differentiating
    the concatenated form runs the weight gradient as one ``[K·E + K, B] × [B, H]`` product,
    whose odd row count (520) cuBLAS tiles badly (43 µs against 29 for the 512 rows; the MoE's
    backward kernels 196 → 217 µs). The same function (tested, values and derivatives, also
    vmapped over the parameters)."""
    return jnp.dot(jnp.concatenate([weighted, gate], axis=-1), jnp.concatenate([w2, b2]))


@_mix_with_bias.defjvp
def _mix_with_bias_jvp(primals, tangents):
    weighted, gate, w2, b2 = primals
    d_weighted, d_gate, d_w2, d_b2 = tangents
    tangent = d_weighted @ w2 + d_gate @ b2 + weighted @ d_w2 + gate @ d_b2
    return _mix_with_bias(weighted, gate, w2, b2), tangent


def _split_bf16(x: Array) -> tuple[Array, Array]:
    """``x`` (float32) as two bf16 halves, ``hi + lo`` equal to ``x`` to ~2⁻¹⁶ of its size."""
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(x.dtype)).astype(jnp.bfloat16)


@jax.custom_jvp
def _mix_with_bias_bf16(weighted: Array, gate: Array, w2: Array, b2: Array) -> Array:
    """The bf16 MoE output ``weighted @ w2 + gate @ b2`` (weighted [B, K·E] bf16, gate [B, K]
    float32, w2 [K·E, H], b2 [K, H] float32) as **one** bf16 GEMM that accumulates in float32
    and writes bf16: ``[weighted, g_hi, g_hi, g_lo] · [w2; b_hi; b_lo; b_hi]``, the gate and the
    bias each split into bf16 halves (:func:`_split_bf16`), so the bias term keeps ~16
    significant bits (the dropped ``g_lo·b_lo`` is ~2⁻¹⁸ of it) where bf16 operands alone would
    keep 8.

    Where the separate form — the mixture as a bf16 GEMM writing bf16, ``gate @ b2`` in
    float32, added in float32 and rounded once — ran a float32 ``[B, K] × [K, H]`` product
    writing a float32 ``[B, H]`` and a pass adding it to the GEMM's bf16 output
    (twice per update at s′, once at s), this is K·E + 3K contraction columns in the GEMM,
    the halves written beside the gated hidden layer by the kernel that computes it, and the
    sum rounded to bf16 once instead of twice. The derivative is the separate form's
    (a custom JVP: reverse mode transposes it into the same products as before, float32 for
    the bias). Tested against float64 and for the derivative."""
    g_hi, g_lo = _split_bf16(gate)
    b_hi, b_lo = _split_bf16(b2.astype(jnp.float32))
    lhs = jnp.concatenate([weighted.astype(jnp.bfloat16), g_hi, g_hi, g_lo], axis=-1)
    rhs = jnp.concatenate([w2.astype(jnp.bfloat16), b_hi, b_lo, b_hi])
    return jnp.dot(lhs, rhs, preferred_element_type=jnp.bfloat16)


@_mix_with_bias_bf16.defjvp
def _mix_with_bias_bf16_jvp(primals, tangents):
    """The separate form's tangent (the test's oracle,
    ``tests/test_networks.py::_mix_separate_bf16``), written out."""
    weighted, gate, w2, b2 = primals
    d_weighted, d_gate, d_w2, d_b2 = tangents
    mix = (_einsum("bk,kh->bh", d_weighted, w2, "bfloat16", jnp.bfloat16)
           + _einsum("bk,kh->bh", weighted, d_w2, "bfloat16", jnp.bfloat16))
    bias = d_gate @ b2.astype(gate.dtype) + gate @ d_b2.astype(gate.dtype)
    return (_mix_with_bias_bf16(*primals),
            (mix.astype(jnp.float32) + bias).astype(jnp.bfloat16))


def expert_outputs(moe_params: Any, x: Array, matmul_dtype: str = "float32") -> Array:
    """All expert outputs ``e [B, K, H]`` from the MoE's params (tests and diagnostics only)."""
    w1, b1 = moe_params["experts_in"]["kernel"], moe_params["experts_in"]["bias"]
    w2, b2 = moe_params["experts_out"]["kernel"], moe_params["experts_out"]["bias"]
    act = act_dtype(matmul_dtype, x)
    hidden = nn.relu(add_bias(_einsum("bh,khe->bke", x, w1, matmul_dtype, act), b1))
    return add_bias(_einsum("bke,keh->bkh", hidden, w2, matmul_dtype, act), b2)


def _einsum(spec: str, a: Array, b: Array, matmul_dtype: str, out_dtype: Any = None) -> Array:
    """einsum under the precision policy (see :func:`matmul`)."""
    if compute_dtype(matmul_dtype) is None:
        return jnp.einsum(spec, a, b)
    return jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                      preferred_element_type=out_dtype or jnp.float32)


class TrunkOutput(NamedTuple):
    h: Array  # [B, H] trunk feature h_s2 (MoE output) fed to the heads
    gate: Array  # [B, K] MoE gate probabilities
    selection: Array  # [B, W] variable-selection weights in (0, 1)


class Trunk(nn.Module):
    """``obs [B, W]`` → variable selection → ``Dense(H)`` → ``n_grn_blocks`` GRN blocks
    (``h_s1``) → MoE (``h_s2``)."""

    width: int
    n_grn_blocks: int
    n_experts: int
    expert_hidden: int
    gate_hidden: int
    matmul_dtype: str = "float32"
    impl: str = "xla"
    grad_free: bool = False  # see BranchingQNetwork

    @nn.compact
    def __call__(self, obs: Array) -> TrunkOutput:
        md = self.matmul_dtype
        if _trunk_input_kernels(self.impl, md, self.grad_free, obs, self.width):
            from jdqn.pallas import trunk_input

            # variable selection and the input layer as one kernel; the selection weights
            # (diagnostics only) by XLA, which drops them where nothing reads them
            sel_w, sel_b = _SelectionParams(obs.shape[-1], name="selection")()
            proj_w, proj_b = DenseParams(obs.shape[-1], self.width, name="proj")()
            h = trunk_input.selection_input(obs, sel_w, sel_b, proj_w, proj_b, md,
                                            jax.default_backend() != "gpu")
            selection = _selection_weights(obs, sel_w, sel_b, md, self.impl).astype(
                wide_dtype(md, obs))
        else:
            x, selection = VariableSelection(md, self.impl, name="selection")(obs)
            h = dense(x, self.width, md, "proj", impl=self.impl)
        for i in range(self.n_grn_blocks):
            h = GRNBlock(self.width, self.matmul_dtype, self.impl, self.grad_free,
                         name=f"grn_{i}")(h)
        moe = MixtureOfExperts(self.n_experts, self.expert_hidden, self.gate_hidden,
                               self.matmul_dtype, self.impl, self.grad_free, name="moe")(h, obs)
        return TrunkOutput(h=moe.h, gate=moe.gate, selection=selection)
