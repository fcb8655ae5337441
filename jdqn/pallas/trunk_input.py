"""Pallas kernels: the trunk's two readers of the observation, grad-free, one pass each.

Everything the network computes from the raw observation ``obs [M, W]`` before the GRN blocks
is two small stacks of dense layers (:class:`jdqn.networks.trunk.Trunk`)::

    variable selection + input layer   w = σ(obs·V + c);  x = obs ⊙ w;  h0 = x·P + p   [M, H]
    the MoE's gate                     g = softmax(relu(obs·G1 + b1)·G2 + b2)         [M, K]

XLA runs them as a chain of small kernels — a GEMM per layer (K = W = 128 contractions, 64 or
8 output columns for the gate), the sigmoid and the product with ``obs`` as an elementwise
pass, the gate's softmax as another — each paying a launch and a round trip of its ``[M, ·]``
activation through memory; on the H200 at B = 16384 the bf16 profile shows ~25 µs of such
kernels per grad-free forward. Here each stack is one kernel per tile of rows: it reads
``obs`` once and writes only ``h0`` (:func:`selection_input`) or the gate's logits and
probabilities (:func:`gate`); the layers' activations stay in registers.

Grad-free only (the forwards at s′ and acting, :class:`jdqn.networks.trunk.Trunk` with
``grad_free``): a derivative asked through either kernel raises ``TypeError`` (symbolic-zero
tangents, i.e. inputs under ``stop_gradient``, pass). Float32 or bf16 matmuls, with the model's
roundings under bf16 (every stored activation rounded to bf16 where the XLA path stores it;
bias adds in float32, then rounded; the gate's logits and softmax in float32). Float32
products use JAX's default precision (TF32-class on Hopper, as XLA's float32 GEMMs) unless
``jax_default_matmul_precision`` asks for more (:func:`jdqn.pallas.iqn._precision`).

The oracles are :func:`selection_input_reference` and :func:`gate_reference` (the trunk's own
layers, written out; on the CPU they give the XLA network's bits). On the GPU kernel and XLA
agree to the last bit of the stored dtype, not bitwise: Triton's ``exp`` and the dots'
summation order are not XLA's, and XLA's GPU fusions keep float32 between the program's bf16
roundings (``xla_allow_excess_precision``) where the kernel rounds as the program says — on
the H100, h0 one bf16 step from XLA's in 60 % of its elements (max 0.023). Under ``vmap``
(the trainer's seeds, the float32 pair of online and target networks at s′) ``pallas_call``'s
batching rule adds a grid axis: one launch.

Measured (2026-12-05, H100: no H200 could be had; ``bench/kernels.py --kernel trunk_input``,
B = 16384, W = 128, H = 256): bf16, one parameter set, **37.5 µs** at 64 rows on 4 warps
against 46.9 for XLA's kernels; float32 at the twin pass's shape (two sets) 111–127 µs against
92.8 (XLA reads obs once against both networks' weights side by side). In the update no gain:
bf16 1.800 / 1.807 ms against 1.798 / 1.804, float32 2.894 / 2.902 against 2.889 / 2.897 over
two alternated rounds (``bench/results/train_h100_*_trunk_input_rejected_ab.json``). The gate's
chain depends on obs alone and runs beside the GRN blocks under concurrent CUDA graphs, off the
update's critical path. ``"auto"`` does not take them; ``impl = "pallas"`` does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jdqn.pallas.grn_tail import _row
from jdqn.pallas.iqn import _pow2, _precision

Array = jax.Array
F32 = jnp.float32

ROWS = 64  # rows of obs per program (both kernels)
WARPS = 4


def _act(matmul_dtype: str):
    return jnp.bfloat16 if matmul_dtype == "bfloat16" else F32


def _stored(y: Array, bf16: bool) -> Array:
    """Where the XLA path stores a bf16 activation, round here too (a no-op in float32)."""
    return y.astype(jnp.bfloat16).astype(F32) if bf16 else y


def _dense(a: Array, w: Array, b: Array, bf16: bool, wide: bool = False) -> Array:
    """``dense`` of :mod:`jdqn.networks.trunk` in float32 registers: the product rounded as
    the GEMM writes it (bf16 unless ``wide``), the bias added in float32 and rounded again."""
    act = jnp.bfloat16 if bf16 else F32
    y = jnp.dot(a.astype(act), w.astype(act), preferred_element_type=F32)
    y = y if wide else _stored(y, bf16)
    return y + b.astype(F32) if wide else _stored(y + b.astype(F32), bf16)


def _sigmoid(z: Array, bf16: bool) -> Array:
    """``σ(z)`` as XLA computes the model's ``nn.sigmoid`` of a stored activation: under bf16
    its logistic is expanded to ``1 / (1 + exp(−z))`` with each step rounded to bf16 (the
    exponential, the sum, the quotient); in float32 the plain quotient."""
    if not bf16:
        return 1.0 / (1.0 + jnp.exp(-z))
    return _stored(1.0 / _stored(1.0 + _stored(jnp.exp(-z), True), True), True)


def selection_input_reference(obs: Array, sel_w: Array, sel_b: Array, proj_w: Array,
                              proj_b: Array, matmul_dtype: str) -> Array:
    """``h0 = (obs ⊙ σ(obs·V + c))·P + p`` as :class:`jdqn.networks.trunk.Trunk` computes it
    (float32 operands in float32; under ``"bfloat16"`` the bf16 roundings): obs [M, W], V
    [W, W], c [W], P [W, H], p [H] → [M, H] (bf16 or float32)."""
    bf16 = matmul_dtype == "bfloat16"
    w = _sigmoid(_dense(obs, sel_w, sel_b, bf16), bf16)
    x = _stored(_stored(obs.astype(F32), bf16) * w, bf16)
    return _dense(x, proj_w, proj_b, bf16).astype(_act(matmul_dtype))


def gate_reference(obs: Array, w1: Array, b1: Array, w2: Array, b2: Array,
                   matmul_dtype: str) -> tuple[Array, Array]:
    """The MoE gate ``(logits, softmax(logits))`` [M, K] float32 from obs [M, W], ``gate_fc``
    (w1 [W, G], b1 [G]) and ``gate_out`` (w2 [G, K], b2 [K]), as the trunk computes them."""
    bf16 = matmul_dtype == "bfloat16"
    hidden = jax.nn.relu(_dense(obs, w1, b1, bf16))
    logits = _dense(hidden, w2, b2, bf16, wide=True)
    return logits, jax.nn.softmax(logits, axis=-1)


def eligible(obs: Array, width: int | None = None) -> bool:
    """Whether the kernels take ``obs``: float32 ``[M, W]`` with M a positive multiple of 64
    (every program a whole tile), W a power of two from 16 to 256 (Triton's block rule; the
    trunk's default 128), and a ``width`` — the input layer's H for :func:`selection_input`,
    the gate's hidden width G for :func:`gate` — that is a power of two from 16 to 512.
    Float32 products only where XLA's own float32 matmuls may be TF32 (the kernels' products
    are then the same class); under ``"highest"`` the trunk keeps XLA's path."""
    if obs.ndim != 2 or obs.dtype != F32 or _precision() != jax.lax.Precision.DEFAULT:
        return False
    m, w = obs.shape
    pow2 = lambda n, hi: 16 <= n <= hi and n & (n - 1) == 0
    return (m > 0 and m % ROWS == 0 and pow2(w, 256)
            and (width is None or pow2(width, 512)))


def _selection_kernel(obs_ref, sw_ref, sb_ref, pw_ref, pb_ref, h_ref, *, bf16: bool,
                      chunk: int):
    obs = obs_ref[...]
    w = _sigmoid(_dense(obs, sw_ref[...], sb_ref[...], bf16), bf16)
    x = _stored(_stored(obs, bf16) * w, bf16)
    for c in range(h_ref.shape[1] // chunk):
        cols = pl.ds(c * chunk, chunk)
        h_ref[:, cols] = _dense(x, pw_ref[:, cols], pb_ref[:, cols], bf16).astype(h_ref.dtype)


def _gate_kernel(obs_ref, w1_ref, b1_ref, w2_ref, b2_ref, logits_ref, gate_ref, *, bf16: bool,
                 k: int):
    hidden = jax.nn.relu(_dense(obs_ref[...], w1_ref[...], b1_ref[...], bf16))
    logits = _dense(hidden, w2_ref[...], b2_ref[...], bf16, wide=True)  # [rows, Kp]
    col = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    masked = jnp.where(col < k, logits, -jnp.inf)  # the padded columns take no mass
    e = jnp.exp(masked - jnp.max(masked, axis=1, keepdims=True))
    logits_ref[...] = logits
    gate_ref[...] = e / jnp.sum(e, axis=1, keepdims=True)


def _whole(shape: tuple[int, int]) -> pl.BlockSpec:
    """A parameter every program reads whole."""
    return pl.BlockSpec(shape, lambda r: (0, 0))


def _selection_call(obs, sel_w, sel_b, proj_w, proj_b, matmul_dtype, interpret, rows, warps):
    m, w = obs.shape
    h = proj_w.shape[1]
    act = _act(matmul_dtype)
    bf16 = act == jnp.bfloat16
    chunk = min(h, 128)  # the input layer's columns per dot (bounds the registers it holds)
    return pl.pallas_call(
        functools.partial(_selection_kernel, bf16=bf16, chunk=chunk),
        out_shape=jax.ShapeDtypeStruct((m, h), act),
        grid=(m // rows,),
        in_specs=[pl.BlockSpec((rows, w), lambda r: (r, 0)), _whole((w, w)), _whole((1, w)),
                  _whole((w, h)), _whole((1, h))],
        out_specs=pl.BlockSpec((rows, h), lambda r: (r, 0)),
        interpret=interpret,
        name="trunk_selection_input",
        compiler_params=pl_triton.CompilerParams(num_warps=warps),
    )(obs, sel_w.astype(act), _row(sel_b), proj_w.astype(act), _row(proj_b))


def _gate_call(obs, w1, b1, w2, b2, matmul_dtype, interpret, rows, warps):
    m, w = obs.shape
    g, k = w2.shape
    kp = _pow2(k)  # Triton's dots are at least 16 wide: zero columns, masked in the softmax
    act = _act(matmul_dtype)
    block = pl.BlockSpec((rows, kp), lambda r: (r, 0))
    logits, gate = pl.pallas_call(
        functools.partial(_gate_kernel, bf16=act == jnp.bfloat16, k=k),
        out_shape=(jax.ShapeDtypeStruct((m, kp), F32),) * 2,
        grid=(m // rows,),
        in_specs=[pl.BlockSpec((rows, w), lambda r: (r, 0)), _whole((w, g)), _whole((1, g)),
                  _whole((g, kp)), _whole((1, kp))],
        out_specs=(block, block),
        interpret=interpret,
        name="trunk_moe_gate",
        compiler_params=pl_triton.CompilerParams(num_warps=warps),
    )(obs, w1.astype(act), _row(b1), jnp.pad(w2, ((0, 0), (0, kp - k))).astype(act),
      _row(jnp.pad(b2, (0, kp - k))))
    return logits[:, :k], gate[:, :k]


def _refuse(name: str):
    raise TypeError(
        f"jdqn.pallas.trunk_input.{name}: the kernel has no derivative; a gradient was asked "
        "through it. The trunk takes it only with grad_free=True (inputs and parameters under "
        "stop_gradient); differentiate with impl='xla' or without the 'trunk_input_*' switch")


@functools.partial(jax.custom_jvp, nondiff_argnums=(5, 6, 7, 8))
def selection_input(obs: Array, sel_w: Array, sel_b: Array, proj_w: Array, proj_b: Array,
                    matmul_dtype: str = "float32", interpret: bool = False, rows: int = ROWS,
                    warps: int = WARPS) -> Array:
    """:func:`selection_input_reference` as one kernel per ``rows`` rows of float32 ``obs``
    (check :func:`eligible`): ``h0 [M, H]`` bf16 under ``"bfloat16"``, else float32.
    ``interpret=True`` runs Pallas' interpreter (CPU tests). No derivative."""
    return _selection_call(obs, sel_w, sel_b, proj_w, proj_b, matmul_dtype, interpret, rows,
                           warps)


@functools.partial(jax.custom_jvp, nondiff_argnums=(5, 6, 7, 8))
def gate(obs: Array, w1: Array, b1: Array, w2: Array, b2: Array,
         matmul_dtype: str = "float32", interpret: bool = False, rows: int = ROWS,
         warps: int = WARPS) -> tuple[Array, Array]:
    """:func:`gate_reference` as one kernel per ``rows`` rows of float32 ``obs`` (check
    :func:`eligible`): ``(logits, gate)`` [M, K] float32. No derivative."""
    return _gate_call(obs, w1, b1, w2, b2, matmul_dtype, interpret, rows, warps)


selection_input.defjvp(lambda *_: _refuse("selection_input"))
gate.defjvp(lambda *_: _refuse("gate"))
