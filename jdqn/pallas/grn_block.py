"""Mosaic GPU kernel: a whole GRN block's grad-free forward in one pass (bf16, Hopper).

A GRN block (:class:`jdqn.networks.trunk.GRNBlock`) with its two linear layers folded is::

    η   = ELU(x W_fc + b_fc)                 [M, H]
    y   = η W + b                            [M, 2H]   (W = W1·W45, b its bias)
    out = LayerNorm(x + σ(y_g) ⊙ y_v)         [M, H]

XLA runs that as two cuBLAS GEMMs with the bias + ELU fused after the first, and the tail as
:mod:`jdqn.pallas.grn_tail`'s kernel: η and y go to memory and come back. This kernel reads
``x`` and writes ``out`` once per tile of 64 rows; η, y and the pre-norm sum s never leave the
SM. Written in Pallas' Mosaic GPU dialect (TMA copies, warpgroup MMA: sm_90), for bf16 and,
measured slower than XLA's path and not taken by ``"auto"`` (below), float32 as TF32. Per CTA
one warpgroup and 64 rows, ~100 KB of shared memory so that two CTAs share an SM and each
one's waits hide behind the other's work:

1. TMA: the vectors (``b_fc | b | scale | offset``, float32) and the ``x`` tile (``H / 64``
   column chunks, 128-byte swizzle); ``W_fc`` by ``[64, H]`` row chunks through a
   ``stages``-slot ring; x W_fc accumulated by wgmma in registers (float32).
2. η with the model's roundings (:func:`eta_from_product`: the product, the bias add and the
   ELU each stored as bf16) written over ``x``'s buffer, the A operand of the products below.
3. ``W``'s gate and value halves as ``[64, 64]`` blocks, column block j by contraction chunk
   k, through a ``stages2``-slot ring in the same bytes as ``W_fc``'s (a ``RefUnion``), with
   ``x``'s column blocks beside them for the residual; per column block g and v rounded to
   bf16 (the model stores the product so), ``s_j = x_j + (v + b_v)·σ(g + b_g)`` kept in
   registers (float32) with its row sums of s and s².
4. The LayerNorm from those sums (flax's ``E[s²] − E[s]²``), scaled and offset, into ``x``'s
   buffer again, stored by TMA.

The loops are unrolled (s's column blocks are separate register values; 255 registers a thread
at H = 256, no spills at the default rings). A ring's slot is refilled once the wgmma reading
it has retired. ``exp`` is Mosaic GPU's approximate one (``ex2.approx`` of ``x·log2 e``, as
Triton's ``exp`` in the tail kernel), and with it the LayerNorm's ``rsqrt`` (``approx_math``
covers both); the division is IEEE. That is jax 0.11's Mosaic GPU (the GPU image's); jax
0.10's ``exp(approx=True)`` multiplies by ``log2 e`` but then takes the precise ``exp2``, so
the kernel's ``exp`` bits can differ between the two versions (both read in their sources).
The kernel writes every layout out and names Mosaic GPU's **lane** semantics
(:func:`compiler_params`, :data:`SEMANTICS`), so both JAX versions compile the same program;
jax 0.11's default, warpgroup, re-derives the layouts by a search. On the H100 (jax 0.11.2,
the pair at B = 16384, H = 256, bf16) the two gave the same differences from XLA's path, at
78.2 / 69.8 / 68.7 µs lane against 76.8 / 68.6 / 68.5 warpgroup in three runs, and the bf16
update 1.604 / 1.587 ms against 1.589 / 1.589 over two alternated rounds (within their spread;
``bench/results/kernels_h100_bf16_grn_block_lane_vs_warpgroup*.json``,
``train_h100_bf16_grn_block_lane_ab.json``); its GPU tests pass under lane at every width.

**float32** (``"grn_block_f32"``, taken only under ``impl = "pallas"``): wgmma's float32 path
is TF32 and reads both operands K-major from shared memory, so the weights go in transposed
(parameter-sized XLA transposes) and their blocks are read through transposed views; a chunk
is 32 columns (the same 128-byte swizzle), η and x take 64 KB, and the gate's and value's
column blocks run as one N = 64 product (two N = 32 products leave wgmma bound by shared
memory's reads: 198.5 against 181.2 µs for the pair on the H100, XLA's path 177.8 and 177.2
in those two machine sessions). Eligible only where XLA's
own float32 matmuls may be TF32 (:func:`eligible`). Measured (``bench/fused_grn.py --dtype
float32 --mgpu-rs``, the pair at B = 16384, H = 256, the model's block-0 inputs): on the H200
**165.4 µs against 144.5** for XLA's path (its GEMMs and the tail kernel), 105.1 with the
matmuls and copies alone (``mm_only``); on the H100 181.2 against 177.2. In the update (H200,
float32, three alternated rounds) **2.558–2.563 ms against 2.451–2.471** without it: one
warpgroup per CTA serialises the TF32 products with the exponentials and the LayerNorm, and
two CTAs per SM cannot hide that (``bench/results/train_h200_f32_grn_block_f32_rejected_ab.json``).
Against float64, the kernel's root-mean-square error is 7.8e-4 where XLA's TF32 path's is
5.3e-4 (16384 rows of normal inputs, H = 256): the two convert the float32 operands to TF32
differently (not examined further).

The oracle is the model's block (:class:`jdqn.networks.trunk.GRNBlock` with ``impl = "xla"``
or its tail kernel); off the GPU the kernel runs in JAX's GPU interpreter (tests). The results
agree to bf16 rounding, not bitwise: on the H100 14.6 % of the elements differ from the
model's GPU path in their last bit (max 0.031 at values up to ~6), the float32 order of the row
sums and the exp/division instructions differing from XLA's and Triton's; the kernel's own
results are bitwise repeatable. Shapes: ``H`` 64 to 256 by 64, ``M`` a positive multiple of 64
(:func:`eligible`), on a Hopper GPU (:func:`device_supported`); the block falls back to
XLA's path otherwise. Any number of parameter sets
at once (``[P, M, H]``): under ``vmap`` (the trainer's seeds, the twin forward's pair) the
batch axes become that leading axis (:func:`grn_block`'s batching rule), one launch.

Measured on the H100 (B = 16384, H = 256, ``bench/fused_grn.py --mgpu-rs``): one parameter
set 39.3 µs against 49.8 for XLA's path, the pair 73.7 against 96.5; with the precise ``exp``
43.9 and 85.4. The network takes it under ``"grn_block_bf16"`` in grad-free forwards under bf16
matmuls (:data:`jdqn.pallas.GPU_VALIDATED`): the update at B = 16384 (its four grad-free blocks,
the online and target networks' two at s′) 1.830–1.842 against 1.871–1.878 ms on the H100
(``bench/ab.py``, three alternated rounds; ``docs/model.md``, "Kernels"), 1.571–1.588 against
1.583–1.595 ms on the H200; two bf16 ``gpu.toml`` runs with it bitwise identical
(``determinism_h100_bf16_grn_block.json``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array
F32 = jnp.float32
ROWS = 64  # one warpgroup's wgmma tile
CHUNK = 64  # H and the phases' column blocks tile by this
CHUNK_BYTES = 128  # the swizzle every block shares: a chunk is 64 bf16 or 32 float32 columns
MAX_WIDTH = 256  # wgmma's largest N (the first product's full width)
PROBES = ("", "no_act", "no_ln", "mm_only")  # timing probes (bench/fused_grn.py), wrong values
# Mosaic GPU's lowering semantics: "lane", a kernel's own (every layout written out, as this
# module's and jdqn.pallas.double_q_heads_mgpu's are), or "warpgroup", which re-derives them by
# Mosaic GPU's layout inference, a recursive search run at every lowering. jax 0.10 defaults to
# lane, jax 0.11 to warpgroup (whose search recursed past Python's limit on the heads kernel's
# float32 form). Both kernels name lane, so the two JAX versions compile the same program.
SEMANTICS = ("lane", "warpgroup")


def _elu(z):
    return jnp.where(z > 0, z, jnp.exp(jnp.minimum(z, 0.0)) - 1.0)


def eta_from_product(acc: Array, b_fc: Array, dt) -> Array:
    """η from the first layer's float32 product as the model forms it under ``dt``: the
    product stored in ``dt``, the bias added in float32 and rounded to ``dt``
    (``jdqn.networks.trunk.add_bias``), the ELU of that stored in ``dt`` (no-ops in float32)."""
    z = (acc.astype(dt).astype(F32) + b_fc).astype(dt).astype(F32)
    return _elu(z).astype(dt)


def eligible(x: Array, width: int) -> bool:
    """Whether the kernel takes the block's input: bf16 or float32 ``x [M, width]`` with M a
    positive multiple of 64 and the width 64, 128, 192 or 256 (the first product is one wgmma
    N = width wide, at most 256; wider fails to lower). float32 only where XLA's own float32
    matmuls may run as TF32 (``jax_default_matmul_precision`` unset or a fast value, as
    :mod:`jdqn.pallas.iqn` reads it): the kernel's products are TF32, so under ``"highest"``
    the block keeps XLA's full-precision path."""
    if x.dtype == F32:
        from jdqn.pallas.iqn import _precision  # the Pallas kernels' one reading of it

        if _precision() != jax.lax.Precision.DEFAULT:
            return False
    return (x.ndim == 2 and x.dtype in (jnp.bfloat16, F32) and x.shape[-1] == width
            and x.shape[0] > 0 and x.shape[0] % ROWS == 0 and width % CHUNK == 0
            and CHUNK <= width <= MAX_WIDTH)


def device_supported() -> bool:
    """Whether the kernel can run here: on a Hopper GPU (compute capability 9.x: wgmma and
    TMA as sm_90a has them; not Ampere, Ada or Blackwell), or off the GPU in JAX's GPU
    interpreter. Elsewhere (a Colab T4 or A100, say) the block takes XLA's path."""
    if jax.default_backend() != "gpu":
        return True
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")


def mgpu_load(ref, layout, plgpu=None) -> Array:
    """``ref`` whole into registers laid out as ``layout`` (``plgpu.load``) on either supported
    JAX: jax 0.10's ``load(src, idx, *, layout)`` takes the index, jax 0.11's deprecates it
    (``jax-pallas-mgpu-load-idx``: index the ref first), so the index is passed only where the
    signature still requires it. ``plgpu``: the Mosaic GPU module (a test passes a stand-in)."""
    import inspect

    if plgpu is None:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    idx = inspect.signature(plgpu.load).parameters.get("idx")
    if idx is not None and idx.default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def _transforms(cols: int, dtype) -> tuple:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    width = cols * jnp.dtype(dtype).itemsize
    swizzle = min(128, width)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle)


def compiler_params(approx: bool, semantics: str = "lane"):
    """Mosaic GPU's compiler parameters for these kernels: ``approx_math`` (``exp`` and
    ``rsqrt`` approximate) and the lowering ``semantics`` named (:data:`SEMANTICS`; anything
    else is refused by name)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if semantics not in SEMANTICS:
        raise ValueError(f"semantics must be one of {SEMANTICS}, not {semantics!r}")
    return plgpu.CompilerParams(approx_math=approx, lowering_semantics=getattr(
        plgpu.LoweringSemantics, semantics.capitalize()))


def _interpret_params():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


def _kernel(x, w_fc, b_fc, w, b, scale, offset, *, eps: float, stages: int | None = None,
            stages2: int = 3, probe: str = "", approx: bool = True, interpret: bool = False,
            semantics: str = "lane"):
    """The block for ``P`` parameter sets at once: ``x [P, M, H]`` bf16 or float32,
    ``w_fc [P, H, H]``, ``w [P, H, 2H]`` (cast to ``x``'s dtype), the vectors ``[P, ·]``
    (float32) → ``[P, M, H]`` in ``x``'s dtype. ``stages``/``stages2``: the rings' slots for
    ``W_fc``'s chunks and ``W``'s blocks (at H = 256, bf16's 2 and 3 and float32's 1 and 3 keep
    two CTAs on an SM; ``stages`` None: that dtype's).
    ``probe`` (timing only, wrong values): ``"no_act"`` drops the ELU's and the gate's ``exp``
    (η = z, σ(g) → g), ``"no_ln"`` writes s unnormalised, ``"mm_only"`` both.
    ``approx=False``: the precise ``exp``. ``semantics``: Mosaic GPU's lowering semantics
    (:data:`SEMANTICS`).

    float32 runs wgmma's TF32 path, whose operands must be K-major in shared memory: ``x`` and
    η are (rows of the contraction), the weights are not, so they go in transposed (``W_fcᵀ``,
    ``Wᵀ``: parameter-sized XLA transposes) and each shared-memory block is read through a
    transposed view. A chunk is 128 bytes of a row either way: 64 bf16 or 32 float32 columns
    (the swizzle), so float32 has twice the chunks and column blocks of half the width. The
    interpreter has no transposed wgmma operand: there the float32 weights go in as they are."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    p, m, h = x.shape
    dt, tm = x.dtype, ROWS
    if dt not in (jnp.bfloat16, F32):
        raise ValueError(f"the Mosaic GPU block runs bf16 or float32, not {dt}")
    kc = CHUNK_BYTES // jnp.dtype(dt).itemsize  # one swizzled row: 64 bf16, 32 float32
    stages = (2 if dt == jnp.bfloat16 else 1) if stages is None else stages
    if h % CHUNK or m % tm or not h:
        raise ValueError(f"shape M={m}, h={h} does not tile by tm={tm} and 64")
    if probe not in PROBES:
        raise ValueError(f"probe must be one of {PROBES}, not {probe!r}")
    if stages < 1 or stages2 < 1:
        raise ValueError(f"stages = {stages}, stages2 = {stages2}: rings are 1 slot or more")
    params = compiler_params(approx, semantics)
    kmajor = dt == F32 and not interpret  # TF32: the weights' blocks read transposed
    # float32: the gate's and value's column blocks as one N = 2·kc product (N = 32 alone
    # leaves wgmma bound by shared memory's reads)
    fuse_gv = dt == F32
    nk = h // kc
    nv = -(-5 * h // 256)
    vec = jnp.concatenate([b_fc, b, scale, offset], axis=-1).astype(F32)
    tr = _transforms(kc, dt)
    s1_ = min(stages, nk)
    steps = [(j, k) for j in range(nk) for k in range(nk)]  # phase 3: column block, chunk
    s2_ = min(stages2, len(steps))
    act = probe not in ("no_act", "mm_only")
    norm = probe not in ("no_ln", "mm_only")

    def load(ref, layout):
        return ref[...] if interpret else mgpu_load(ref, layout, plgpu)

    def cast(value, layout):
        return value if interpret else plgpu.layout_cast(value, layout)

    def operand(ref):  # a weight block as wgmma's B [K, N]
        return ref.transpose((1, 0)) if kmajor else ref

    def grn_block_kernel(x_g, wfc_g, w_g, vec_g, out_g, xe_s, vec_s, ring, bars, bar_fc,
                         bar_w, bar_x):  # (the kernel's name in jaxprs and profiles)
        wfc_r, (w_r, xr_r) = ring
        pi, mi = lax.axis_index("p"), lax.axis_index("m")
        rows = pl.ds(mi * tm, tm)
        for k in range(nk):
            plgpu.copy_gmem_to_smem(x_g.at[pi, rows, pl.ds(k * kc, kc)], xe_s.at[k],
                                    bars.at[k])
        for q in range(nv):
            piece = pl.ds(q * 256, min(256, 5 * h - q * 256))
            plgpu.copy_gmem_to_smem(vec_g.at[pi, piece], vec_s.at[piece], bars.at[nk + q])

        def fetch_fc(k):
            src = wfc_g.at[pi, :, pl.ds(k * kc, kc)] if kmajor else \
                wfc_g.at[pi, pl.ds(k * kc, kc)]
            plgpu.copy_gmem_to_smem(src, wfc_r.at[k % s1_], bar_fc.at[k % s1_])

        for k in range(s1_):
            fetch_fc(k)

        def row_vec(start, n):
            v = load(vec_s.at[pl.ds(start, n)], plgpu.Layout.WGMMA.reduce(0))
            return lax.broadcast_in_dim(v, (tm, n), [1])

        # 1. x W_fc, the ring refilled once the wgmma reading a slot has retired
        def gemm1(acc_ref):
            for k in range(nk + nv):
                plgpu.barrier_wait(bars.at[k])
            for k in range(nk):
                plgpu.barrier_wait(bar_fc.at[k % s1_])
                plgpu.wgmma(acc_ref, xe_s.at[k], operand(wfc_r.at[k % s1_]))
                # a slot is refilled once the wgmma reading it has retired: the one before
                # this step's (still in flight) with two slots or more, this step's with one
                lag = min(1, s1_ - 1)
                if k >= lag and k - lag + s1_ < nk:
                    plgpu.wgmma_wait(lag)
                    fetch_fc(k - lag + s1_)
            return acc_ref[...]

        acc = pl.run_scoped(gemm1, plgpu.ACC((tm, h), F32))

        # the ring's bytes now hold W's blocks and x's column blocks: start them flying
        def fetch_w(t):
            j, k = steps[t]
            for half in range(2):
                cols = pl.ds(half * h + j * kc, kc)
                src = w_g.at[pi, cols, pl.ds(k * kc, kc)] if kmajor else \
                    w_g.at[pi, pl.ds(k * kc, kc), cols]
                dst = w_r.at[t % s2_, half] if not fuse_gv else \
                    w_r.at[t % s2_, pl.ds(half * kc, kc)] if kmajor else \
                    w_r.at[t % s2_, :, pl.ds(half * kc, kc)]
                plgpu.copy_gmem_to_smem(src, dst, bar_w.at[t % s2_])

        def fetch_x(j):
            plgpu.copy_gmem_to_smem(x_g.at[pi, rows, pl.ds(j * kc, kc)], xr_r.at[j % 2],
                                    bar_x.at[j % 2])

        for t in range(s2_):
            fetch_w(t)
        for j in range(min(2, nk)):
            fetch_x(j)

        # 2. η over x's buffer (its wgmma reads have retired with the accumulator's read)
        eta = eta_from_product(acc, row_vec(0, h), dt) if act else \
            (acc + row_vec(0, h)).astype(dt)
        for k in range(nk):
            xe_s[k] = eta[:, k * kc:(k + 1) * kc]
        plgpu.commit_smem()

        # 3. per column block: g, v over the chunks of η; s_j in registers
        s_blocks = []
        s1 = s2 = cast(jnp.zeros((tm,), F32), plgpu.Layout.WGMMA.reduce(1))
        for j in range(nk):
            def mm(*accs, j=j):  # (g, v), or with fuse_gv one [g | v] accumulator
                for k in range(nk):
                    t = j * nk + k
                    plgpu.barrier_wait(bar_w.at[t % s2_])
                    if fuse_gv:  # one [K, 2·kc] operand: the gate's columns, then the value's
                        plgpu.wgmma(accs[0], xe_s.at[k], operand(w_r.at[t % s2_]))
                    else:
                        for half, acc_ref in enumerate(accs):
                            plgpu.wgmma(acc_ref, xe_s.at[k], operand(w_r.at[t % s2_, half]))
                    lag = min(1, s2_ - 1)  # as in phase 1; one wgmma group per accumulator
                    if t >= lag and t - lag + s2_ < len(steps):
                        plgpu.wgmma_wait(len(accs) * lag)
                        fetch_w(t - lag + s2_)
                if fuse_gv:
                    gv = accs[0][...]
                    return gv[:, :kc], gv[:, kc:]
                return accs[0][...], accs[1][...]

            shapes = [(tm, 2 * kc)] if fuse_gv else [(tm, kc)] * 2
            g, v = pl.run_scoped(mm, *(plgpu.ACC(shape, F32) for shape in shapes))
            plgpu.barrier_wait(bar_x.at[j % 2])
            xj = load(xr_r.at[j % 2], plgpu.Layout.WGMMA).astype(F32)
            if j + 2 < nk:
                plgpu.commit_smem()  # the read done before TMA rewrites the slot
                fetch_x(j + 2)
            g = g.astype(dt).astype(F32) + row_vec(h + j * kc, kc)
            v = v.astype(dt).astype(F32) + row_vec(2 * h + j * kc, kc)
            s = xj + (v / (1.0 + jnp.exp(-g)) if act else v * g)
            s_blocks.append(s)
            s1, s2 = s1 + s.sum(axis=1), s2 + (s * s).sum(axis=1)

        # 4. LayerNorm into x's buffer (η's wgmma reads retired with the last accumulator's)
        mean = s1 / h
        var = jnp.maximum(s2 / h - mean * mean, 0.0)
        mean_b = lax.broadcast_in_dim(mean, (tm, kc), [0])
        rstd_b = lax.broadcast_in_dim(lax.rsqrt(var + eps), (tm, kc), [0])
        for j, s in enumerate(s_blocks):
            out = (s - mean_b) * (rstd_b * row_vec(3 * h + j * kc, kc)) \
                + row_vec(4 * h + j * kc, kc) if norm else s
            xe_s[j] = out.astype(dt)
        plgpu.commit_smem()
        for j in range(nk):
            plgpu.copy_smem_to_gmem(xe_s.at[j], out_g.at[pi, rows, pl.ds(j * kc, kc)])
        plgpu.wait_smem_to_gmem(0)

    ring = (plgpu.SMEM((s1_, h, kc) if kmajor else (s1_, kc, h), dt, transforms=tr),
            [plgpu.SMEM((s2_, 2, kc, kc) if not fuse_gv else (s2_, 2 * kc, kc) if kmajor
                        else (s2_, kc, 2 * kc), dt, transforms=tr),
             plgpu.SMEM((2, tm, kc), dt, transforms=tr)])
    # the interpreter has no aliased refs; its separate buffers give the same values
    ring = ring if interpret else plgpu.RefUnion(*ring)
    kernel = plgpu.kernel(
        grn_block_kernel,
        out_type=jax.ShapeDtypeStruct((p, m, h), dt),
        grid=(p, m // tm),
        grid_names=("p", "m"),
        scratch_types={"xe_s": plgpu.SMEM((nk, tm, kc), dt, transforms=tr),
                       "vec_s": plgpu.SMEM((5 * h,), F32),
                       "ring": ring,
                       "bars": plgpu.Barrier(num_barriers=nk + nv),
                       "bar_fc": plgpu.Barrier(num_barriers=s1_),
                       "bar_w": plgpu.Barrier(num_arrivals=2, num_barriers=s2_),
                       "bar_x": plgpu.Barrier(num_barriers=2)},
        compiler_params=params,
        interpret=_interpret_params() if interpret else None,
    )
    w_fc, w = w_fc.astype(dt), w.astype(dt)
    if kmajor:
        w_fc, w = jnp.swapaxes(w_fc, 1, 2), jnp.swapaxes(w, 1, 2)
    return kernel(x, w_fc, w, vec)


def fold_sets(kernel):
    """``kernel`` (every argument and output with a leading axis of ``P`` independent sets)
    as a ``custom_vmap`` whose rule folds each further batch axis into that one: under
    ``vmap`` (the trainer's seeds, a paired forward) still one launch, each set with its own
    operands (unbatched arguments broadcast). Outputs: an array or a tuple of arrays."""

    @jax.custom_batching.custom_vmap
    def run(*args):
        return kernel(*args)

    @run.def_vmap
    def rule(axis_size, in_batched, *args):
        args = [a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
                for a, batched in zip(args, in_batched)]
        p = args[0].shape[1]
        out = run(*(a.reshape(axis_size * p, *a.shape[2:]) for a in args))
        unfold = jax.tree.map(lambda o: o.reshape(axis_size, p, *o.shape[1:]), out)
        return unfold, jax.tree.map(lambda _: True, out)

    return run


@functools.cache
def _batched(eps: float, interpret: bool):
    """The kernel over a leading axis of parameter sets, as a ``custom_vmap`` whose rule
    folds each further batch axis into that one (one launch for seeds × pair)."""

    run = fold_sets(lambda x, w_fc, b_fc, w, b, scale, offset: _kernel(
        x, w_fc, b_fc, w, b, scale, offset, eps=eps, interpret=interpret))

    @jax.custom_jvp
    def block(*args):
        return run(*args)

    @block.defjvp
    def no_derivative(primals, tangents):
        # reached with any tangent that is not a symbolic zero: stop_gradient must sit on the
        # kernel's inputs themselves, after any stacking (as the model's grad-free forwards
        # do); an explicit zeros tangent (jax.jvp with zeros_like) also lands here
        raise TypeError(
            "jdqn.pallas.grn_block: the whole-block kernel has no derivative; a gradient was "
            "asked through it. GRNBlock takes it only with grad_free=True (inputs and "
            "parameters under stop_gradient); differentiate the block with impl='xla' or "
            "without 'grn_block_bf16'")

    return block


def grn_block(x: Array, w_fc: Array, b_fc: Array, w: Array, b: Array, scale: Array,
              offset: Array, eps: float, interpret: bool = False) -> Array:
    """The grad-free block ``x [M, H]`` (bf16) → ``[M, H]`` bf16: ``w_fc [H, H]``,
    ``b_fc [H]``, the folded ``w [H, 2H]`` and ``b [2H]``, the LayerNorm's ``scale`` and
    ``offset`` [H] (float32). Check :func:`eligible` first. Under ``vmap`` the batch axes
    become the kernel's parameter-set axis. No derivative: any tangent reaching it that is not
    a symbolic zero (a gradient asked through it, or an explicit zeros tangent) raises
    ``TypeError`` naming the kernel; inputs under ``stop_gradient`` are fine."""
    run = _batched(float(eps), bool(interpret))
    return run(*(a[None] for a in (x, w_fc, b_fc, w, b, scale, offset)))[0]
