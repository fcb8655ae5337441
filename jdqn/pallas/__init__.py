"""Pallas GPU kernels (SPEC §8) and the switch between them and the plain-JAX reference.

``ModelConfig.impl`` picks the implementation: ``"pallas"``, ``"xla"`` or ``"auto"`` (Pallas on
GPU, XLA elsewhere). Every kernel has a plain-JAX oracle it is tested against on the CPU (in
Pallas' interpreter) and on the GPU (parity, bitwise determinism, speed: ``bench/kernels.py``).

Kernels in this version:

* :func:`jdqn.pallas.projection.project_uniform_pallas` — the categorical L2 projection of the
  branching C51 target (all branches at once), the oracle being
  :func:`jdqn.losses.batch.project_uniform`. Measured on the H200: 65 µs vs 225 µs for XLA.
* :func:`jdqn.pallas.c51_loss.c51_terms_pallas` — the branching C51 loss terms (target softmax +
  projection + cross-entropy + warm-up MSE + target mean) fused in one forward kernel, with a
  custom VJP; the oracle is :func:`jdqn.pallas.c51_loss.c51_terms_reference`. Measured on the
  H200: faster alone (358 vs 524 µs), slower in the whole update (4.47 vs 4.27 ms).
* :func:`jdqn.pallas.iqn.iqn_features_pallas` — the IQN head's dense stack in one kernel, for
  grad-free forwards (the target network's quantiles); the oracle is
  :func:`jdqn.networks.heads.iqn_features`. Measured on the H200: slower than XLA's cuBLAS
  matmuls (415 vs 257 µs alone, 4.45 vs 4.27 ms per update).

* :func:`jdqn.pallas.moe.moe_mixture_pallas` — the MoE mixture (gate softmax + the experts'
  weighted output layer), forward and backward kernels with a custom VJP, float32; the oracle
  is :func:`jdqn.pallas.moe.moe_mixture_reference`. Measured on the H200: slower than XLA's
  two cuBLAS GEMMs (551 vs 137 µs forward + backward, 5.08 vs 4.19 ms per update).

* :func:`jdqn.pallas.modulation.modulate` — the IQN head's τ modulation ``h ⊙ relu(pre + be)``
  with its backward pass (``dh``, ``dpre`` and the bias gradient) in one kernel, float32; the
  oracle is :func:`jdqn.pallas.modulation.reference`. Measured on the H200: no faster in the
  update (3.53 vs 3.54 ms); 218 µs alone against 234 µs for XLA (re-timed 2026-12-01).

* :func:`jdqn.pallas.reduce.tree_sum` — deterministic fixed-order tree reductions (SPEC §8,
  kernel 3): a sum over rows in an order fixed by the shapes alone, bitwise equal to its
  plain-JAX oracle :func:`jdqn.pallas.reduce.tree_sum_reference` on the same backend; it reduces
  every dense layer's bias gradient (:func:`jdqn.pallas.reduce.add_bias`). Measured on the
  H200: alone, 439 vs 404 µs for XLA's ``jnp.sum`` over the update's twelve bias shapes (0.9× to
  3× per shape); slower in the update (3.70–3.76 vs 3.50–3.56 ms float32, 2.46 vs 2.35 bf16).

* :func:`jdqn.pallas.grn_tail.grn_tail` — a GRN block's tail (the GLU's bias and gate, the
  residual add and the LayerNorm) in one pass, where no gradient is taken (the online and target
  forwards at s′, acting); the oracle is :func:`jdqn.pallas.grn_tail.reference`.
  Measured on the H200: the update 2.706–2.738 against 2.744–2.802 ms (float32, three machine
  sessions), 1.779–1.790 against 1.807–1.814 ms (bf16). Its gradient is a backward kernel
  (``"grn_tail_grad"``: the tail in the differentiated forward at s, float32 matmuls): the
  update 2.556–2.563 against 2.589–2.602 ms (2.587–2.599 against 2.613–2.622 in another
  session with an earlier version). Under bf16 matmuls (``"grn_tail_grad_bf16"``) it measured
  slower (1.752–1.757 against 1.743–1.747) while XLA's DotMerger joined the forwards at s and
  s′, and faster once the training programs compiled without it: 1.602–1.603 against
  1.614–1.618 ms over four alternated rounds.

* :func:`jdqn.pallas.double_q.double_q_next` — the double-Q selection at s′ (the online
  expected Q, its argmax per branch, the target's softmax at it) from the C51 heads'
  output-layer products, writing no logits; with :func:`jdqn.pallas.double_q.expected_q_streams`
  (the magnitude stream's conditioning in the grad-free heads). The oracle is
  :func:`jdqn.pallas.double_q.reference`. Measured on the H200: 54.6 vs 177.3 µs alone; the
  update 2.622–2.641 against 2.695–2.716 ms (float32, two machine sessions), then 2.637–2.650
  against 2.650–2.661 with the conditioning kernel; bf16 1.757–1.767 against 1.796–1.802 ms.

* :func:`jdqn.pallas.double_q_heads.double_q_heads` — one step earlier: the C51 heads'
  output layers at s′ (both networks, from their first layers' outputs,
  :class:`jdqn.networks.heads.HeadInputs`) and the double-Q selection in one pass, so that
  no output product is written (``"double_q_heads_bf16"``, ``"double_q_heads_f32"``). The
  oracle is :func:`jdqn.pallas.double_q_heads.reference` (the head's own products, then the
  double-Q oracle). On the H100 (2026-12-06) it compiles and agrees (every action the same,
  probabilities within 3e-5, bitwise repeatable). Unrolled it takes 403 µs at 64 rows / 4
  warps; as a Triton-pipelined loop over each branch's actions (the default), 269 µs, level
  with the 264 µs of XLA's output GEMMs, ``expected_q_streams`` and the double-Q kernel
  (``kernels_h100_bf16_double_q_heads_{rejected,loop}.json``). In the update it is ~30 µs
  slower (``train_h100_bf16_double_q_heads_ab_rejected.json``), so ``"auto"`` does not take
  it.

* :func:`jdqn.pallas.double_q_heads_mgpu.double_q_heads_mgpu` — the same step (the heads'
  output layers at s′ and the double-Q selection, no product written) in Pallas' Mosaic GPU
  dialect for Hopper (wgmma from shared memory, TMA rings for the streams of ``pre`` and the
  output layers' action blocks, each branch's actions a loop, ~98 KB of shared memory so two
  CTAs share an SM), bf16 (``"double_q_heads_mgpu"``). The oracle is the same. On the H100
  (2026-12-07) 116.5 µs against 252 µs for XLA's path at the pair's shape, no action
  differing; the update 1.582–1.609 against 1.630–1.656 ms over four alternated rounds
  (``train_h100_bf16_double_q_heads_mgpu_ab{,2}.json``), so ``"auto"`` takes it on Hopper.
  On a GPU only the shapes that have compiled there are taken (``COMPILED_ON_GPU``: bf16,
  hidden 64 or 128). It is lowered under lane semantics on both JAX versions (jax 0.11's
  default, warpgroup, recursed past Python's limit in its layout search on the float32 form).
  Its float32 form (TF32, ``"double_q_heads_mgpu_f32"``) is tested in the interpreter and
  compiles on the H100, but ties XLA's path there (296.1 against 301.5 µs) and chose 1 of
  4,096 actions differently from the exact oracle: no GPU run takes it.

* :func:`jdqn.pallas.iqn_tail.iqn_tail` — the IQN head's output stage (hidden bias, ReLU,
  output layer) over its first product's ``[B·Q, F]`` rows, with a backward kernel; float32
  or bf16.
  The oracle is :func:`jdqn.pallas.iqn_tail.reference`. Measured on the H200: forward 46 vs
  68 µs, backward 115–120 vs 154–158 µs alone; in the online head at s (``"iqn_tail_grad"``)
  the update 2.532–2.534 against 2.576–2.589 ms float32; in the target's grad-free head as
  well (``"iqn_tail"``, in place of its hidden bias riding in the first product) slower than
  the online head alone when first measured (2.556–2.566 against 2.550–2.553), faster when
  re-measured against the code of the seventh session of 2026-12-03: 2.466–2.472 against
  2.477–2.485 ms over six alternated rounds in two calls.
  Under bf16 matmuls (``"iqn_tail_grad_bf16"``, ``"iqn_tail_bf16"``: bf16 ``pre``, the bf16
  path's rounding points) in both heads: 1.688–1.703 against 1.733–1.738 ms.

* :func:`jdqn.pallas.moe_gate.gated_hidden` — the MoE's gated hidden layer
  ``g ⊗ relu(pre + b1)`` (XLA's forward) with its gradient as one backward kernel (``d pre``,
  the gate's gradient, the bias gradient's per-program partial sums); float32. The oracle is
  :func:`jdqn.pallas.moe_gate.reference`. Measured on the H200: 71 vs 73 µs alone; in the
  update (``"moe_gate_grad"``) 2.508–2.516 against 2.534–2.546 ms float32, and 2.511–2.515
  against 2.540–2.542 in two more rounds (under ``"pallas"`` the MoE runs
  :mod:`jdqn.pallas.moe` instead).

* :func:`jdqn.pallas.per_sums.block_cumsums` — the prioritised replay's sampling masses and
  their cumulative sums within blocks, one program per block (``"per_sums"``; it serves
  :func:`jdqn.replay.per.sample`). The oracle is :func:`jdqn.pallas.per_sums.reference` (the
  replay's XLA path; the same sums to float32 rounding). Measured on the H200 at 4 M slots:
  30 vs 85 µs alone, ``sample`` 74 vs 104 µs; the update 2.492–2.502 against 2.504–2.516 ms
  (float32) and 2.474–2.490 against 2.491–2.501 in another call; bf16 1.723–1.731 against
  1.743–1.757.

* :func:`jdqn.pallas.grn_block.grn_block` — a whole GRN block's grad-free forward (both
  GEMMs, the ELU, the GLU, the residual and the LayerNorm) as one Mosaic GPU kernel (TMA,
  wgmma; sm_90, bf16 matmuls: ``"grn_block_bf16"``), η and the GLU product kept on chip; with
  a batching rule that folds vmapped parameter sets into one launch. The oracle is the block
  with its tail kernel (to bf16 rounding). Measured on the H100: 39.3 vs 49.8 µs alone for one
  parameter set at B = 16384; the update (bf16, its four grad-free blocks: the online and
  target networks' two at s′) 1.830–1.842 against 1.871–1.878 ms over three alternated rounds.
  Its float32 form (TF32 products, ``"grn_block_f32"``) made the float32 update slower on the
  H200 (2.558–2.563 against 2.451–2.471 ms), so ``"auto"`` does not take it.

* :func:`jdqn.pallas.trunk_input.selection_input` and :func:`jdqn.pallas.trunk_input.gate` —
  the grad-free trunk's two readers of the observation (variable selection with the input
  layer; the MoE gate with its softmax), one Triton kernel each, float32 or bf16 with the
  model's rounding points. The oracles are :func:`jdqn.pallas.trunk_input.selection_input_reference`
  and :func:`jdqn.pallas.trunk_input.gate_reference`. Measured on the H100 (no H200 lent that
  day): bf16, one parameter set, 37.5 against 46.9 µs alone, but the update no faster
  (1.800–1.807 against 1.798–1.804 ms); float32 at the twin pass's shape slower alone (111–127
  against 92.8 µs) and in the update (2.894–2.902 against 2.889–2.897). ``"auto"`` does not
  take them (``"trunk_input_bf16"``, ``"trunk_input_f32"``).

``"auto"`` uses a kernel on the GPU only where it has been measured there to make the update
faster (:data:`GPU_VALIDATED`); ``"pallas"`` uses every kernel (on the CPU in the
interpreter). See ``docs/model.md``, "Kernels".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


# Kernels measured on the H200 to speed up the update (bench/results/: the projection, the
# GRN tail in grad-free forwards, train_h200_f32_grn_tail_ab*.json, its backward kernel in the
# differentiated forward, train_h200_f32_grn_tail_grad*_ab.json, the double-Q selection at s′,
# train_h200_*_double_q_*ab*.json, the IQN output stage in the online head at s,
# train_h200_f32_iqn_tail_ab*.json, and in the target's head at s′,
# train_h200_f32_iqn_tail_target_ab*.json, the MoE gated hidden layer's gradient,
# train_h200_f32_moe_gate_*ab*.json, the replay's block cumulative sums,
# train_h200_f32_per_sums_ab*.json, and under bf16 matmuls the IQN output stage in both
# heads, train_h200_bf16_iqn_tail_ab*.json, and the GRN tail's backward kernel,
# train_h200_bf16_grn_tail_grad_ab2.json, and the whole grad-free GRN block,
# train_h100_bf16_grn_block_ab.json: measured on an H100, none being lent). Not listed, measured slower in the update:
# "c51_loss", "iqn", "moe", "reductions", "grn_block_f32"
# (train_h200_f32_grn_block_f32_rejected_ab.json); no faster: "iqn_modulation",
# "trunk_input_bf16", "trunk_input_f32" (train_h100_*_trunk_input_rejected_ab.json).
GPU_VALIDATED = frozenset({"projection", "grn_tail", "grn_tail_grad", "double_q",
                           "iqn_tail", "iqn_tail_grad", "moe_gate_grad", "per_sums",
                           "iqn_tail_bf16", "iqn_tail_grad_bf16", "grn_tail_grad_bf16",
                           "grn_block_bf16", "double_q_heads_mgpu"})


def use_pallas(impl: str, kernel: str = "projection") -> bool:
    """Whether ``impl`` (``ModelConfig.impl``) selects the Pallas version of ``kernel``.
    ``"auto"`` looks at the default backend (the trainer places everything there) and takes
    only kernels in :data:`GPU_VALIDATED`; ``"pallas"`` takes every kernel, and off the GPU
    runs it in Pallas' interpreter, which is correct but slow — meant for tests."""
    if impl not in ("auto", "pallas", "xla"):
        raise ValueError(f"model.impl = {impl!r}: expected 'auto', 'pallas' or 'xla'")
    return impl == "pallas" or (impl == "auto" and jax.default_backend() == "gpu"
                                and kernel in GPU_VALIDATED)


def project_uniform(tz: Array, probs: Array, v_min: float, v_max: float, impl: str) -> Array:
    """The C51 target projection (see :func:`jdqn.losses.batch.project_uniform`) through the
    implementation ``impl`` selects. Off the GPU the Pallas kernel runs in interpret mode.
    ``probs`` may carry more atoms than ``tz`` (zeros, as the double-Q kernel pads them): only
    the first Z are projected."""
    from jdqn.losses.batch import project_uniform as reference

    if not use_pallas(impl, "projection"):
        return reference(tz, probs[..., :tz.shape[-1]], v_min, v_max)
    from jdqn.pallas.projection import project_uniform_pallas

    return project_uniform_pallas(tz, probs, v_min=v_min, v_max=v_max,
                                  interpret=jax.default_backend() != "gpu")


def c51_terms(taken: Array, nxt: Array | None, tz: Array, v_min: float, v_max: float,
              impl: str, probs: Array | None = None) -> tuple[Array, Array, Array, Array]:
    """The branching C51 loss terms ``(sq, ce, tm, kl)`` [B, D] (see
    :func:`jdqn.pallas.c51_loss.c51_terms_pallas`) through the implementation ``impl`` selects;
    the XLA path is the reference with the projection dispatched by :func:`project_uniform`.
    ``probs`` [B, D, ≥ Z] (zero beyond Z): the target's probabilities at the double-Q action,
    given instead of its logits ``nxt`` (the double-Q kernel's output; pass ``nxt=None``)."""
    from jdqn.pallas import c51_loss

    z = taken.shape[-1]
    if use_pallas(impl, "c51_loss"):
        if probs is not None:  # the kernel takes logits: softmax(log p) = p
            nxt = jnp.log(jax.lax.stop_gradient(probs[..., :z]))
        return c51_loss.c51_terms_pallas(taken, nxt, tz, v_min, v_max,
                                         jax.default_backend() != "gpu")
    support = jnp.linspace(v_min, v_max, z, dtype=taken.dtype)
    probs = jax.lax.stop_gradient(jax.nn.softmax(nxt, axis=-1) if probs is None else probs)
    target = jax.lax.stop_gradient(project_uniform(jax.lax.stop_gradient(tz), probs, v_min,
                                                   v_max, impl))
    # Two passes over the logits: their maximum, then every sum that reads exp(x − max) —
    # Σ e, Σ e·z and Σ m·(x − max) — at once; CE = Σm·log Σe − Σ m·(x − max), the cross-entropy
    # −Σ m·log_softmax(x) without the third pass that log_softmax's normalised values take.
    shifted = taken - jax.lax.stop_gradient(jnp.max(taken, axis=-1, keepdims=True))
    e = jnp.exp(shifted)
    sum_e = jnp.sum(e, axis=-1)
    ce = jnp.sum(target, axis=-1) * jnp.log(sum_e) - jnp.sum(target * shifted, axis=-1)
    tm = jnp.sum(target * support, axis=-1)
    q = jnp.sum(e * support, axis=-1) / sum_e
    return jnp.square(q - tm), ce, tm, kl_from_ce(ce, target)


def kl_from_ce(ce: Array, target: Array) -> Array:
    """``KL(m ‖ p) = CE(m, p) − H(m) = ce + Σ_z m_z log m_z`` per row of the projected target
    ``m [..., Z]`` (``0 log 0 = 0``): the C51 loss less the target's own entropy, which no
    parameter can lower (Rainbow's priority, Hessel et al. 2018)."""
    m = jax.lax.stop_gradient(target)
    return ce + jnp.sum(jax.scipy.special.xlogy(m, m), axis=-1)
