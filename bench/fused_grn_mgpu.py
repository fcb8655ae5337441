"""A whole GRN block's grad-free forward as one Mosaic GPU (wgmma + TMA) kernel (research).

The Hopper-native counterpart of ``bench/fused_grn.py``'s Triton kernel, the route
``docs/model.md`` ("Kernels") names for the update's H200 targets: keep η and the GLU product
on chip, with the matmuls on Hopper's warpgroup MMA instead of Triton's dots. bf16 only
(wgmma's float32 path is TF32 with K-major operands; the model's weights are not). Per CTA, one
warpgroup and a tile of ``tm`` rows of one parameter set:

1. TMA: the block's vectors (``b_fc | b | scale | offset``, float32, in boxes of 256) and
   the ``x`` tile (as ``h / 64`` column chunks, 128-byte swizzle) into shared memory.
2. η = ELU(x W_fc + b_fc): ``W_fc`` streamed in 64-row chunks through a ``stages``-deep
   pipeline, wgmma into a ``[tm, h]`` float32 accumulator; η formed in registers with the
   model's roundings (product, bias add and ELU each stored as bf16,
   ``grn_block.eta_from_product``). The residual's float32 copy of ``x`` is written to the buffer of
   s, and ``x``'s own buffer is released (a scoped allocation), which leaves room for a
   two-deep pipeline in the next phase.
3. Per 64 output columns (``W``'s gate and value halves streamed as two ``[h, 64]`` blocks,
   ``stages2`` deep): g and v by wgmma with η as the register operand (``eta_in = "regs"``;
   ``"smem"`` stores η to shared memory for it instead), rounded to bf16 (the
   model stores the product so), ``s = x + (v + b_v)·σ(g + b_g)`` in float32 in shared
   memory, the row sums of s and s² carried in registers.
4. LayerNorm from those sums (the model's ``E[s²] − E[s]²`` form), scaled and offset, into a
   staging buffer of its own, stored by TMA.

Only for ``h`` a multiple of 64 and ``M`` a multiple of ``tm`` (a multiple of 64; one
warpgroup per CTA, measured at 64): enough for the bench's question (the default model's width
256 at B = 16384), not a model path. Runs off the GPU in JAX's GPU interpreter
(``interpret=True``), which the tests use for the values, with ``eta_in = "smem"`` only (the
interpreter's wgmma reads A from shared memory): the register path's values are checked on
the GPU, where the bench compares every variant with XLA's path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jdqn.pallas import grn_block
from jdqn.pallas.grn_block import _interpret_params, _transforms, eta_from_product

F32 = jnp.float32
PROBES = grn_block.PROBES
ETA_IN = ("regs", "smem")




def fused(x, w_fc, b_fc, w, b, scale, offset, *, eps: float, tm: int = 64, c2: int = 64,
          stages: int = 2, stages2: int | None = None, eta_in: str = "regs",
          probe: str = "", interpret: bool = False):
    """The block for ``P`` parameter sets at once: ``x [P, M, h]`` bf16, ``w_fc [P, h, h]``,
    ``w [P, h, 2h]`` (cast to bf16), the vectors ``[P, ·]`` (float32). Returns ``[P, M, h]``.
    ``stages``/``stages2``: the pipelines' depths for ``W_fc`` and ``W`` (``stages2`` defaults
    to ``stages``). ``probe`` (timing only, wrong values): ``"no_act"`` drops the ELU's and the
    gate's ``exp`` (η = z, σ(g) → g), ``"no_ln"`` writes s unnormalised, ``"mm_only"`` both —
    where the kernel's time goes."""
    p, m, h = x.shape
    dt = x.dtype
    if dt != jnp.bfloat16:
        raise ValueError(f"the Mosaic GPU block runs bf16 only, not {dt}")
    kc = 64
    if h % kc or m % tm or tm % 64:
        raise ValueError(f"shape M={m}, h={h} does not tile by tm={tm} and 64")
    if c2 != kc:  # x's chunks, η's and W's blocks share the 128-byte swizzle
        raise ValueError(f"c2 = {c2}: the output columns go by 64 (lowering rejects others)")
    nk = h // kc
    nv = -(-5 * h // 256)  # the vectors' copies
    vec = jnp.concatenate([b_fc, b, scale, offset], axis=-1).astype(F32)  # [P, 5h]
    tr_x = _transforms(kc, dt)
    tr_s = _transforms(32, F32)
    if probe not in PROBES:
        raise ValueError(f"probe must be one of {PROBES}, not {probe!r}")
    if eta_in not in ETA_IN:
        raise ValueError(f"eta_in must be one of {ETA_IN}, not {eta_in!r}")
    if interpret and eta_in == "regs":
        raise ValueError("eta_in = 'regs' runs on the GPU only: the GPU interpreter's wgmma "
                         "takes its A operand from shared memory (eta_in = 'smem')")
    if stages < 1 or (stages2 is not None and stages2 < 1):
        raise ValueError(f"stages = {stages}, stages2 = {stages2}: pipelines are 1 deep or more")

    def load(ref, layout):  # the whole ref into registers laid out as ``layout``
        # JAX's GPU interpreter (jax 0.10) has no rule for plgpu.load: a plain read there
        return ref[...] if interpret else grn_block.mgpu_load(ref, layout, plgpu)

    def cast(value, layout):  # nor for layout_cast
        return value if interpret else plgpu.layout_cast(value, layout)

    def body(x_g, wfc_g, w_g, vec_g, out_g, s_s, vec_s, bars, eta_s=None):
        pi, mi = lax.axis_index("p"), lax.axis_index("m")
        rows = pl.ds(mi * tm, tm)
        for q in range(nv):  # TMA boxes are at most 256 elements along each axis
            piece = pl.ds(q * 256, min(256, 5 * h - q * 256))
            plgpu.copy_gmem_to_smem(vec_g.at[pi, piece], vec_s.at[piece], bars.at[nk + q])

        def row_vec(start, n):  # a [n] slice of the vectors, broadcast over the tile's rows
            v = load(vec_s.at[pl.ds(start, n)], plgpu.Layout.WGMMA.reduce(0))
            return lax.broadcast_in_dim(v, (tm, n), [1])

        # 2. η = ELU(x W_fc + b_fc), W_fc streamed by 64-row chunks; x lives in shared memory
        # only for this phase: s starts as x in float32 (the residual), which frees x's bytes
        # for the deeper pipeline of phase 3
        def phase1(x_s):
            for k in range(nk):
                plgpu.copy_gmem_to_smem(x_g.at[pi, rows, pl.ds(k * kc, kc)], x_s.at[k],
                                        bars.at[k])
            for k in range(nk + nv):
                plgpu.barrier_wait(bars.at[k])

            def gemm1(acc_ref):
                def step(idx, wfc_s):
                    (k,) = idx
                    plgpu.wgmma(acc_ref, x_s.at[k], wfc_s)
                    plgpu.wgmma_wait(0)

                plgpu.emit_pipeline(
                    step, grid=(nk,),
                    in_specs=[plgpu.BlockSpec((kc, h), lambda k: (k, 0), transforms=tr_x)],
                    max_concurrent_steps=min(stages, nk))(wfc_g.at[pi])
                return acc_ref[...]

            acc = pl.run_scoped(gemm1, plgpu.ACC((tm, h), F32))
            for k in range(nk):
                s_s[k] = load(x_s.at[k], plgpu.Layout.WGMMA).astype(F32)
            plgpu.commit_smem()  # the reads of x done before its bytes take TMA writes
            return acc

        eta = pl.run_scoped(phase1, plgpu.SMEM((nk, tm, kc), dt, transforms=tr_x))
        act = probe not in ("no_act", "mm_only")
        eta = eta_from_product(eta, row_vec(0, h), dt) if act else \
            (eta + row_vec(0, h)).astype(dt)
        if eta_in == "smem":  # as the A operand of the products below
            for k in range(nk):
                eta_s[k] = eta[:, k * kc:(k + 1) * kc]
            plgpu.commit_smem()

        # 3. per 64 output columns: g, v, s = x + v·σ(g) in shared memory, row sums carried
        def step2(idx, wg_s, wv_s, carry):
            (j,) = idx
            s1, s2 = carry

            def mm(g_ref, v_ref):  # two wgmmas, one wait (the ACC reads)
                if eta_in == "regs":
                    plgpu.wgmma(g_ref, eta, wg_s)
                    plgpu.wgmma(v_ref, eta, wv_s)
                else:  # K in 64-column chunks of η
                    for k in range(nk):
                        plgpu.wgmma(g_ref, eta_s.at[k], wg_s.at[pl.ds(k * kc, kc)])
                        plgpu.wgmma(v_ref, eta_s.at[k], wv_s.at[pl.ds(k * kc, kc)])
                return g_ref[...], v_ref[...]

            g, v = pl.run_scoped(mm, plgpu.ACC((tm, kc), F32), plgpu.ACC((tm, kc), F32))
            g = g.astype(dt).astype(F32) + row_vec(h + j * kc, kc)
            v = v.astype(dt).astype(F32) + row_vec(2 * h + j * kc, kc)
            s = load(s_s.at[j], plgpu.Layout.WGMMA) + (v / (1.0 + jnp.exp(-g)) if act
                                                            else v * g)
            s_s[j] = s
            return s1 + s.sum(axis=1), s2 + (s * s).sum(axis=1)

        init = (cast(jnp.zeros((tm,), F32), plgpu.Layout.WGMMA.reduce(1)),) * 2
        s1, s2 = plgpu.emit_pipeline(
            step2, grid=(nk,),
            in_specs=[plgpu.BlockSpec((h, kc), lambda j: (0, j), transforms=tr_x),
                      plgpu.BlockSpec((h, kc), lambda j: (0, nk + j), transforms=tr_x)],
            max_concurrent_steps=min(stages if stages2 is None else stages2, nk),
            init_carry=init)(w_g.at[pi], w_g.at[pi])

        # 4. LayerNorm into a staging buffer of its own, stored by TMA
        mean = s1 / h
        var = jnp.maximum(s2 / h - mean * mean, 0.0)
        mean_b = lax.broadcast_in_dim(mean, (tm, kc), [0])
        rstd_b = lax.broadcast_in_dim(lax.rsqrt(var + eps), (tm, kc), [0])

        def phase4(o_s):
            for j in range(nk):
                s = load(s_s.at[j], plgpu.Layout.WGMMA)
                out = s if probe in ("no_ln", "mm_only") else \
                    (s - mean_b) * (rstd_b * row_vec(3 * h + j * kc, kc)) \
                    + row_vec(4 * h + j * kc, kc)
                o_s[j] = out.astype(dt)
            plgpu.commit_smem()
            for k in range(nk):
                plgpu.copy_smem_to_gmem(o_s.at[k], out_g.at[pi, rows, pl.ds(k * kc, kc)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(phase4, plgpu.SMEM((nk, tm, kc), dt, transforms=tr_x))

    scratch = {"s_s": plgpu.SMEM((nk, tm, kc), F32, transforms=tr_s),
               "vec_s": plgpu.SMEM((5 * h,), F32),
               "bars": plgpu.Barrier(num_barriers=nk + nv)}
    if eta_in == "smem":
        scratch["eta_s"] = plgpu.SMEM((nk, tm, kc), dt, transforms=tr_x)
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((p, m, h), dt),
        grid=(p, m // tm),
        grid_names=("p", "m"),
        scratch_types=scratch,
        interpret=_interpret_params() if interpret else None,
    )
    return kernel(x, w_fc.astype(dt), w.astype(dt), vec)


def fused_one(x, w_fc, b_fc, w, b, scale, offset, **kw):
    """:func:`fused` for one parameter set (no leading ``P``)."""
    return fused(*(a[None] for a in (x, w_fc, b_fc, w, b, scale, offset)), **kw)[0]



def fused_rs(x, w_fc, b_fc, w, b, scale, offset, *, eps: float, stages: int | None = None,
             stages2: int = 3, probe: str = "", approx: bool = False,
             interpret: bool = False, semantics: str = "lane"):
    """The block with s in registers and ~100 KB of shared memory, two CTAs per SM: the
    model's kernel (``jdqn.pallas.grn_block``, which describes it; bf16, or float32 as TF32)
    with its settings open — the rings' slots (``stages`` None: the dtype's default), the
    timing ``probe`` and ``approx`` (Mosaic GPU's approximate ``exp``, which the model takes;
    the precise one by default here, as first measured) and Mosaic GPU's lowering
    ``semantics`` (the model's lane, or warpgroup)."""
    return grn_block._kernel(x, w_fc, b_fc, w, b, scale, offset, eps=eps, stages=stages,
                             stages2=stages2, probe=probe, approx=approx, interpret=interpret,
                             semantics=semantics)
