"""Mosaic GPU kernel: the C51 heads' output layers at s′ and the double-Q selection (Hopper).

The same contract as :func:`jdqn.pallas.double_q_heads.double_q_heads` (the Triton kernel) and
its oracle :func:`jdqn.pallas.double_q_heads.reference`: from the online and target networks'
:class:`~jdqn.networks.heads.HeadInputs` (the heads' joint first layer's output ``pre [B,
5·hidden]`` with its bias, the output layers, the conditioning rows), ``(a* int32 [B, D],
probs float32 [B, D, Zb])`` — the online network's greedy action per branch and the target
network's softmax at it. No output-layer product reaches device memory.

The Triton kernel runs one ``[rows, hidden] × [hidden, Zb]`` dot per action in a chain that
nothing overlaps and ties XLA's path (269 against 264 µs for the pair on the H100). This one
runs them as warpgroup MMAs (wgmma) from shared memory, one warpgroup and 64 rows per CTA,
the online network first, then the target network:

1. TMA brings the network's vectors (the output biases with the padded atoms at −1e30, the
   conditioning and order-flow rows, the support), the order flow of the CTA's rows, and its
   rows of ``pre`` stream by stream (``hidden / 64`` column chunks each, 128-byte swizzle)
   through a ring of two streams, a slot refilled with the next stream once the wgmmas
   reading it have retired; the output layers stream by ``[hidden, 64]`` action blocks (each
   action's atoms re-padded from ``Zp`` to 64 columns) through a ``stages``-slot ring, refilled
   the same way. The second network's vectors replace the first's when it is done.
2. Each stream's A operand is formed in place: the chunk read into registers, the order flow
   (order type, urgency) or the direction's expected Q (magnitude) added through their rows
   in float32 and rounded to bf16 as the head rounds it (:func:`jdqn.networks.heads.
   streams_from_inputs`), the ReLU, and stored back for the wgmma.
3. Per action block: the ``[64, 64]`` float32 accumulator, the bias, the value stream's
   logits added (``value + (product + bias)``, the Triton kernel's order), the expected Q
   ``Σ e·z / Σ e`` with ``e = exp(x − max)``. The online network keeps each branch's running
   argmax (a strictly larger Q wins: the first maximum, as ``jnp.argmax``) and writes ``a*``;
   the target network keeps each branch's logits at the online choice and writes their
   softmax. Each branch's actions run as a loop (``lax.fori_loop``), not unrolled.

Two choices carry the speed (H100, bf16, B = 16384, the pair's heads; ``bench/results/
kernels_h100_bf16_double_q_heads_mgpu*.json``): the loop over actions (unrolled, ~28 copies of
the block's code: **246 µs**; as loops: **181 µs**) and the compact shared memory (~98 KB at
two slots and hidden 128, so two CTAs share an SM — at hidden 192 or 256, ~135 or ~172 KB:
one; with all five streams, both networks' vectors and two
branches' staging resident, ~190 KB and one CTA per SM: the 181 µs): **116.5 µs** against
**252 µs** for XLA's path (its output GEMMs, ``expected_q_streams`` and the double-Q kernel);
a probe without the max/exp passes takes 104.5, so the wgmma and TMA chain is most of it. In
the update (``"double_q_heads_mgpu"``, the online and target heads at s′ under bf16) **1.582–
1.609 ms against 1.630–1.656** over four alternated rounds in two machine sessions
(``train_h100_bf16_double_q_heads_mgpu_ab{,2}.json``), so ``"auto"`` takes it on a Hopper GPU.

The kernel writes every layout out and is lowered under Mosaic GPU's **lane** semantics, named
in its compiler parameters (:func:`jdqn.pallas.grn_block.compiler_params`): jax 0.10 lowers
that by default, jax 0.11 lowers ``warpgroup`` semantics by default, which re-derives the
layouts by a search that recursed past Python's limit on the float32 form and runs at every
lowering, before the compile cache is consulted. Measured on the H100 with jax 0.11.2
(``kernels_h100_bf16_double_q_heads_mgpu_lane_vs_warpgroup.json``,
``train_h100_bf16_double_q_heads_mgpu_lane_ab.json``): the same values, 127.4 against 125.7 µs
alone, the update 1.587–1.601 against 1.578–1.588 ms over two alternated rounds (within their
spread), and the bench's whole run 19.6 against 24.9 s with the compile cache warm.

``exp`` is Mosaic GPU's approximate one (``approx_math``), as in :mod:`jdqn.pallas.grn_block`;
the expected Q differs from the oracle's in its last bits, so an action whose expected Q ties
another's to rounding may be chosen differently (as with the Triton kernel), and where the
magnitude, order-type or urgency stream's conditioned input (summed in float32 in the
kernel's order, not the product's) lands by a last bit on the other side of a bf16 rounding
midpoint (a few elements in 100,000) that row's probabilities move by up to ~1e-3 (at B =
16384 on the H100: no action different, probabilities within 1.2e-4 of XLA's path; at 1024
rows in the GPU test, one row's order type by 1.0e-3 from the exact oracle; bitwise
repeatable).

**float32** (``"double_q_heads_mgpu_f32"``; not taken on a GPU, see :data:`COMPILED_ON_GPU`:
on the H100 with jax 0.11.2 it compiles under lane semantics but is no faster than XLA's path
— 296.1 against 301.5 µs for the pair's heads — and chose 50 of 65,536 actions differently
from it, 1 of 4,096 from the exact oracle, likely wgmma's TF32 reading of the float32
operands by truncation where XLA and Triton round; the interpreter runs it): wgmma's float32
path is TF32 with both
operands K-major in shared memory, so each action block of the output layers goes in
transposed (``[64, hidden]``, a parameter-sized XLA transpose) and is read through a
transposed view, as in :mod:`jdqn.pallas.grn_block`; a chunk is 32 columns; one output-layer
slot, ~126 KB of shared memory at hidden 128 (one CTA per SM). Under float32 the trainer's
forwards at s′ are the online/target pair, which the kernel reads in place
(``target=None``). Eligible only where XLA's float32 matmuls may be TF32 (under
``"highest"`` the heads keep XLA's path). In the interpreter its products are exact float32
(probabilities within 1e-5 of the oracle).

Shapes: ``hidden`` a multiple of 64 up to 256 (float32: 192), ``Zb = 64`` (Z from 33 to
64), B a positive multiple of 64, at most 8 order-flow features, the head's four branches
(:func:`eligible`; otherwise the loss takes the products path). On a GPU the trainer takes
it only at the shapes compiled and checked there and faster than XLA's path
(:data:`COMPILED_ON_GPU`: bf16, hidden 64 or 128; bf16 at 192 and 256 compiles and passes
the check but only ties or loses, one CTA per SM); the interpreter's tests cover the rest.
Each network reads its own order flow. Under ``vmap`` (seeds) the sets fold into the
kernel's set axis: one launch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jdqn.networks.heads import HeadInputs
from jdqn.pallas import double_q
from jdqn.pallas.grn_block import (_interpret_params, _transforms, compiler_params,
                                   device_supported, fold_sets, mgpu_load)

Array = jax.Array
F32 = jnp.float32
ROWS = 64  # one warpgroup's wgmma tile
KC = 64  # the chunk of hidden columns every dtype's blocks tile by (a bf16 swizzle row)
ZB = 64  # atoms per action block (one wgmma N)
OUT_COLS = 32  # a float32 chunk of the probabilities: 128 bytes
STAGES = {"bfloat16": 2, "float32": 1}  # the output layers' ring: ~98 KB / ~126 KB of smem
NEG = double_q._NEG  # a padded atom's bias: probability 0, no inf arithmetic
MAX_FLOW = 8
PROBES = ("", "mm_only")  # timing probes (bench/kernels.py), wrong values: no max/exp pass

__all__ = ["double_q_heads_mgpu", "eligible", "device_supported", "kernel_name"]
KERNEL_NAME = "double_q_heads_mgpu"  # bf16 (in "auto")
KERNEL_NAME_F32 = "double_q_heads_mgpu_f32"  # float32 as TF32 (not taken on a GPU)
# The widest hidden per dtype the trainer takes on a Hopper GPU: compiled there, checked
# against the oracle and faster than XLA's path. bf16 at 64 and 128 (jax 0.11.2, H100,
# 2026-12-07, under both semantics): the kernel alone 127.4 against 258.0 µs at 128. bf16 at
# 192 and 256 compiles and passes the same check (compact layout; one CTA per SM) but gains
# nothing: 279.4 against 279.5 µs at 192, 348.7 against 340.6 at 256 (bench/kernels.py
# --head-hidden). float32 at hidden 128 compiles under lane semantics but failed the check
# (1 of 4,096 actions off the exact oracle's, 50 of 65,536 off XLA's path) and gains nothing
# (296.1 against 301.5 µs). None of those is taken.
COMPILED_ON_GPU = {"bfloat16": 128}


def kernel_name(matmul_dtype: str) -> str:
    """The kernel's switch for ``use_pallas`` under ``ModelConfig.matmul_dtype``."""
    return KERNEL_NAME if matmul_dtype == "bfloat16" else KERNEL_NAME_F32


def _chunk(dtype) -> int:
    """Columns of one 128-byte swizzled row: 64 bf16, 32 float32."""
    return 128 // jnp.dtype(dtype).itemsize


def eligible(inputs: HeadInputs, z: int, pair: bool, compiled: bool = False) -> bool:
    """Whether the kernel takes these heads' inputs (see the module docstring): float32 only
    where XLA's own float32 matmuls may be TF32 (the kernel's products are; under
    ``"highest"`` precision the heads keep XLA's path), as :mod:`jdqn.pallas.grn_block`.
    ``compiled`` (the trainer's selection on a GPU, not the interpreter): only the dtypes and
    widths compiled and checked on a Hopper GPU (:data:`COMPILED_ON_GPU`)."""
    pre = inputs.pre
    rows = pre.shape[-2]
    hid = inputs.cond_kernel.shape[-1]
    n_flow = inputs.flow.shape[-1]
    if pre.dtype == F32:
        from jdqn.pallas.iqn import _precision  # the Pallas kernels' one reading of it

        if _precision() != jax.lax.Precision.DEFAULT:
            return False
    # float32's shared memory outgrows the SM's 227 KB past hidden 192 (2 streams of pre)
    widest = 256 if pre.dtype == jnp.bfloat16 else 192
    if compiled:
        widest = min(widest, COMPILED_ON_GPU.get(jnp.dtype(pre.dtype).name, 0))
    return (pre.dtype in (jnp.bfloat16, F32) and pre.ndim == (3 if pair else 2)
            and len(inputs.out_kernel) == 5  # value and the four branches the head has
            and double_q._padded_atoms(z) == ZB and rows > 0 and rows % ROWS == 0
            and hid % KC == 0 and KC <= hid <= widest and n_flow <= MAX_FLOW)


def _network_operands(inp: HeadInputs, sizes: tuple[int, ...], z: int, v_min: float,
                      dz: float, dtype) -> tuple[Array, Array]:
    """One network's ``(w [nb, hidden, 64] dtype, vec [L] float32)``: every action block of
    the output layers (value first, then each branch's actions) re-padded to 64 atoms, and the
    vectors: the blocks' biases (padded atoms NEG), the conditioning rows, the two streams'
    order-flow rows (``MAX_FLOW`` rows each, zeros past the features) and the support."""
    hid = inp.cond_kernel.shape[-1]
    zp = inp.out_bias[0].shape[-1]
    blocks, biases = [], []
    for k, n in enumerate((1, *sizes)):
        w = inp.out_kernel[k].reshape(hid, n, zp)[..., :z]
        blocks.append(jnp.pad(jnp.moveaxis(w, 1, 0), ((0, 0), (0, 0), (0, ZB - z))))
        b = inp.out_bias[k].reshape(n, zp)[:, :z].astype(F32)
        biases.append(jnp.pad(b, ((0, 0), (0, ZB - z)), constant_values=NEG))
    w = jnp.concatenate(blocks).astype(dtype)
    flow_rows = [jnp.pad(fk.astype(F32), ((0, MAX_FLOW - fk.shape[0]), (0, 0)))
                 for fk in inp.flow_kernel]
    j = jnp.arange(ZB)
    support = jnp.where(j < z, v_min + j.astype(F32) * dz, 0.0).astype(F32)
    vec = jnp.concatenate([jnp.concatenate(biases).reshape(-1),
                           inp.cond_kernel.astype(F32).reshape(-1),
                           *(r.reshape(-1) for r in flow_rows), support])
    return w, vec


def _kernel(pre_o, pre_t, w, vec, flow, *, offsets: tuple[int, int], sizes: tuple[int, ...],
            hid: int, n_flow: int, q_scale: float, stages: int, interpret: bool,
            loop: bool = True, probe: str = "", compact: bool = True,
            semantics: str = "lane"):
    """For ``P`` independent sets at once (seeds): ``pre_o``/``pre_t [P, ·, 5·hid]`` bf16 or
    float32 (the networks' rows start at ``offsets`` and run for ``b`` rows), ``w [P, 2, nb,
    hid, 64]`` in ``pre``'s dtype (float32 on the GPU: ``[P, 2, nb, 64, hid]``, each block
    transposed, as TF32 wgmma reads B K-major), ``vec [P, 2, L]`` float32, ``flow [P, 2, F,
    b]`` float32 (each network's order flow) → ``(probs [P, b, D·64] float32, a* [P, D, b]
    int32)``. ``stages``: the output layers' ring slots. ``loop``: each branch's actions as a
    ``fori_loop`` (else unrolled: ~3× the code, slower). ``compact``: two streams' rows of
    ``pre``, one network's vectors and one branch's probabilities in shared memory at a time
    (bf16 ~98 KB at ``stages = 2``: two CTAs per SM; float32 ~126 KB at ``stages = 1``: one),
    else all five streams, both networks' vectors and two branches (~190 KB: one CTA per
    SM). ``probe`` (timing only, wrong values): ``"mm_only"`` drops the max/exp passes.
    ``semantics``: Mosaic GPU's lowering semantics (:data:`~jdqn.pallas.grn_block.SEMANTICS`)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if probe not in PROBES:
        raise ValueError(f"probe must be one of {PROBES}, not {probe!r}")
    params = compiler_params(True, semantics)  # (refuses an unknown semantics by name)
    p, b = flow.shape[0], flow.shape[3]
    tm, nd = ROWS, len(sizes)
    dt = pre_o.dtype
    kc = _chunk(dt)  # a chunk's columns: 64 bf16, 32 float32
    kmajor = dt == F32 and not interpret  # TF32: the weights' blocks read transposed
    nh = hid // kc  # chunks per stream
    nb = 1 + sum(sizes)  # action blocks per network
    total = 2 * nb
    s_ = min(stages, total)
    ns = 1 + nd  # streams per network
    n_use = 2 * ns  # stream uses: network n's stream k is use n·ns + k
    r_ = 2 if compact else ns  # slots of pre's ring (by stream)
    n_vbuf = 1 if compact else 2  # networks' vectors held at once
    n_oslot = 1 if compact else 2  # branches' probabilities staged at once
    n_vec = vec.shape[2]
    a0 = sizes[0]
    # vec offsets
    o_bias, o_cond = 0, nb * ZB
    o_flow = o_cond + a0 * hid
    o_sup = o_flow + 2 * MAX_FLOW * hid
    tr = _transforms(kc, dt)
    tr_out = _transforms(OUT_COLS, F32)
    row_l = plgpu.Layout.WGMMA.reduce(1)  # a per-row vector (layouts: GPU only)

    def load(ref, layout):
        return ref[...] if interpret else mgpu_load(ref, layout, plgpu)

    def cast(value, layout):
        return value if interpret else plgpu.layout_cast(value, layout)

    def double_q_heads_kernel(pre_o_g, pre_t_g, w_g, vec_g, flow_g, probs_g, a_g, pre_s, vec_s,
                              flow_s, ring, out_s, a_s, qd_s, bar_pre, bar_vec, bar_vec1,
                              bar_w):
        pi, mi = lax.axis_index("p"), lax.axis_index("m")
        pres = (pre_o_g, pre_t_g)

        def fetch_pre(u):  # stream use u (network u // ns, stream u % ns) into its slot
            if u >= n_use:
                return
            n, k = divmod(u, ns)
            rows = pl.ds(offsets[n] + mi * tm, tm)
            for c in range(nh):
                plgpu.copy_gmem_to_smem(pres[n].at[pi, rows, pl.ds((k * nh + c) * kc, kc)],
                                        pre_s.at[(u % r_) * nh + c], bar_pre.at[u % r_])

        def fetch_w(t):  # t a Python int or traced (inside a loop over actions)
            n, i = t // nb, t % nb
            for c in range(nh):
                src = w_g.at[pi, n, i, :, pl.ds(c * kc, kc)] if kmajor else \
                    w_g.at[pi, n, i, pl.ds(c * kc, kc)]
                plgpu.copy_gmem_to_smem(src, ring.at[t % s_, c], bar_w.at[t % s_])

        def fetch_vec(n, bar):
            for q in range(0, n_vec, 256):
                part = pl.ds(q, min(256, n_vec - q))
                plgpu.copy_gmem_to_smem(vec_g.at[pi, n, part], vec_s.at[n % n_vbuf, part], bar)

        for n in range(n_vbuf):
            fetch_vec(n, bar_vec.at[0])
        for n in range(2):
            for f in range(n_flow):
                plgpu.copy_gmem_to_smem(flow_g.at[pi, n, f, pl.ds(mi * tm, tm)],
                                        flow_s.at[n, f], bar_vec.at[0])
        for u in range(r_):
            fetch_pre(u)
        for t in range(s_):
            fetch_w(t)
        plgpu.barrier_wait(bar_vec.at[0])  # every vector piece and flow row (one barrier)

        def row_vec(n, start, width=ZB):  # a vector of network n's as [tm, width] rows
            v = load(vec_s.at[n % n_vbuf, pl.ds(start, width)], plgpu.Layout.WGMMA.reduce(0))
            return lax.broadcast_in_dim(v, (tm, width), [1])

        def col(v, width=kc):  # a per-row [tm] vector broadcast over columns
            return lax.broadcast_in_dim(v, (tm, width), [0])

        def prepare(n, k, add=None):
            """Stream k's A operand in place: (pre + add) rounded to pre's dtype, ReLU'd."""
            u = n * ns + k
            plgpu.barrier_wait(bar_pre.at[u % r_])
            for c in range(nh):
                slot = (u % r_) * nh + c
                x = load(pre_s.at[slot], plgpu.Layout.WGMMA)
                if add is not None:
                    x = (x.astype(F32) + add(c)).astype(dt)
                pre_s[slot] = jnp.maximum(x, jnp.zeros((), dt))
            plgpu.commit_smem()

        def flow_add(n, d):  # order type (d = 2) or urgency (d = 3): Σ_f flow_f·W_f
            def add(c):
                out = None
                for f in range(n_flow):
                    start = o_flow + ((d - 2) * MAX_FLOW + f) * hid + c * kc
                    t = col(load(flow_s.at[n, f], row_l)) * row_vec(n, start, kc)
                    out = t if out is None else out + t
                return out
            return add

        def cond_add(n, q_dir):  # magnitude: Σ_a (q_a / q_scale)·W_cond[a]
            def add(c):
                out = None
                for a in range(a0):
                    t = col(q_dir[a] / q_scale) * row_vec(n, o_cond + a * hid + c * kc, kc)
                    out = t if out is None else out + t
                return out
            return add

        def product(t, k):  # action block t's [tm, 64] float32 product (stream k)
            slot = t % s_
            ps = ((t // nb) * ns + k) % r_  # the stream's slot in pre's ring
            plgpu.barrier_wait(bar_w.at[slot])

            def mm(acc_ref):
                for c in range(nh):
                    b_op = ring.at[slot, c]  # B [K, N]: float32's through a transposed view
                    plgpu.wgmma(acc_ref, pre_s.at[ps * nh + c],
                                b_op.transpose((1, 0)) if kmajor else b_op)
                return acc_ref[...]

            acc = pl.run_scoped(mm, plgpu.ACC((tm, ZB), F32))
            nxt = t + s_  # the slot's next block, once the wgmma reading it has retired
            if isinstance(nxt, int):
                if nxt < total:
                    fetch_w(nxt)
            else:
                pl.when(nxt < total)(lambda: fetch_w(nxt))
            return acc

        def shifted_exp(lg):
            if probe == "mm_only":
                return lg
            m = jnp.max(lg, axis=1)
            return jnp.exp(lg - col(m, ZB))

        def expected(n, lg):
            if probe == "mm_only":
                return jnp.sum(lg, axis=1)
            e = shifted_exp(lg)
            return jnp.sum(e * row_vec(n, o_sup), axis=1) / jnp.sum(e, axis=1)

        def over_actions(n_act, step, init):
            if not loop:  # unrolled: straight-line code
                carry = init
                for a in range(n_act):
                    carry = step(a, carry)
                return carry
            return lax.fori_loop(0, n_act, step, init)

        chosen = None
        for n in range(2):
            t0 = n * nb
            if n and n_vbuf == 1:  # network 1's vectors over network 0's, read by now
                plgpu.commit_smem()
                fetch_vec(1, bar_vec1.at[0])
                plgpu.barrier_wait(bar_vec1.at[0])
            prepare(n, 0)
            value = product(t0, 0) + row_vec(n, o_bias)
            fetch_pre(n * ns + r_)  # stream 0's slot is free: the use r_ after it
            tb = t0 + 1  # the branch's first block
            picks = []
            for d, n_act in enumerate(sizes):
                k = d + 1
                if d == 1:
                    prepare(n, 2, cond_add(n, [load(qd_s.at[a], row_l) for a in range(a0)]))
                elif d >= 2:
                    prepare(n, k, flow_add(n, d) if n_flow else None)
                else:
                    prepare(n, k)

                def logits(a, tb=tb, k=k, value=value, n=n, t0=t0):
                    t = tb + a
                    return value + (product(t, k) + row_vec(n, o_bias + (t - t0) * ZB))

                if n == 0:  # the online network: the running argmax (a strictly larger Q)
                    def step(a, carry, logits=logits, d=d, n=n):
                        best_q, best_a = carry
                        q = expected(n, logits(a))
                        if d == 0:
                            qd_s[a] = q
                        better = q > best_q
                        af = jnp.asarray(a, jnp.int32).astype(F32)
                        return (jnp.where(better, q, best_q),
                                jnp.where(better, jnp.full((tm,), af, F32), best_a))

                    # the action carried as float32 (exact for these counts): the loop's
                    # index is an unsigned integer to the lowering, the store's a signed one
                    init = (cast(jnp.full((tm,), -jnp.inf, F32), row_l),
                            cast(jnp.zeros((tm,), F32), row_l))
                    best_a = over_actions(n_act, step, init)[1]
                    picks.append(best_a)
                    a_s[d] = best_a.astype(jnp.int32)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(a_s.at[d], a_g.at[pi, d, pl.ds(mi * tm, tm)])
                else:  # the target network: its logits at the online choice
                    def step(a, sel, logits=logits, d=d, n=n):
                        lg = logits(a)
                        if d == 0:
                            qd_s[a] = expected(n, lg)
                        af = jnp.asarray(a, jnp.int32).astype(F32)
                        return jnp.where(col(chosen[d], ZB) == af, lg, sel)

                    init = cast(jnp.zeros((tm, ZB), F32), plgpu.Layout.WGMMA)
                    sel = over_actions(n_act, step, init)
                    e = shifted_exp(sel)
                    p = e / col(jnp.sum(e, axis=1), ZB)
                    slot = d % n_oslot
                    if d >= n_oslot:  # the slot's earlier copies have read it
                        plgpu.wait_smem_to_gmem(ZB // OUT_COLS * (n_oslot - 1),
                                                wait_read_only=True)
                    for h in range(ZB // OUT_COLS):
                        out_s[slot, h] = p[:, h * OUT_COLS:(h + 1) * OUT_COLS]
                    plgpu.commit_smem()
                    for h in range(ZB // OUT_COLS):
                        plgpu.copy_smem_to_gmem(
                            out_s.at[slot, h],
                            probs_g.at[pi, pl.ds(mi * tm, tm),
                                       pl.ds(d * ZB + h * OUT_COLS, OUT_COLS)])
                tb += n_act
                # the wgmmas on stream k have retired: its slot takes the use r_ after it
                fetch_pre(n * ns + k + r_)
            if n == 0:
                chosen = picks
        plgpu.wait_smem_to_gmem(0)

    n_pieces = -(-n_vec // 256)  # a network's vector pieces
    kernel = plgpu.kernel(
        double_q_heads_kernel,
        out_type=(jax.ShapeDtypeStruct((p, b, nd * ZB), F32),
                  jax.ShapeDtypeStruct((p, nd, b), jnp.int32)),
        grid=(p, b // tm),
        grid_names=("p", "m"),
        scratch_types={"pre_s": plgpu.SMEM((r_ * nh, tm, kc), dt, transforms=tr),
                       "vec_s": plgpu.SMEM((n_vbuf, n_vec), F32),
                       "flow_s": plgpu.SMEM((2, max(n_flow, 1), tm), F32),
                       "ring": plgpu.SMEM((s_, nh, ZB, kc) if kmajor else (s_, nh, kc, ZB), dt,
                                          transforms=tr),
                       "out_s": plgpu.SMEM((n_oslot, ZB // OUT_COLS, tm, OUT_COLS), F32,
                                           transforms=tr_out),
                       "a_s": plgpu.SMEM((nd, tm), jnp.int32),
                       "qd_s": plgpu.SMEM((a0, tm), F32),
                       "bar_pre": plgpu.Barrier(num_arrivals=nh, num_barriers=r_),
                       "bar_vec": plgpu.Barrier(num_arrivals=n_vbuf * n_pieces + 2 * n_flow,
                                                num_barriers=1),
                       "bar_vec1": plgpu.Barrier(num_arrivals=n_pieces, num_barriers=1),
                       "bar_w": plgpu.Barrier(num_arrivals=nh, num_barriers=s_)},
        compiler_params=params,
        interpret=_interpret_params() if interpret else None,
    )
    return kernel(pre_o, pre_t, w, vec, flow)


@functools.partial(jax.jit, static_argnames=("z", "v_min", "v_max", "interpret", "stages",
                                             "loop", "probe", "compact", "semantics"))
def double_q_heads_mgpu(online: HeadInputs, target: HeadInputs | None, z: int, v_min: float,
                        v_max: float, interpret: bool = False, stages: int | None = None,
                        loop: bool = True, probe: str = "", compact: bool = True,
                        semantics: str = "lane") -> tuple[Array, Array]:
    """Same contract as :func:`jdqn.pallas.double_q_heads.double_q_heads`: ``(a* int32
    [B, D], probs float32 [B, D, 64])``; ``target=None``: ``online`` holds the pair (leaves
    ``[2, ...]``, online first; its ``pre`` read in place). Check :func:`eligible` first.
    Grad-free (the inputs go through ``stop_gradient``). ``interpret=True``: JAX's GPU
    interpreter (off the GPU). ``stages``: the output layers' ring slots (None: the dtype's,
    :data:`STAGES`). ``semantics``: Mosaic GPU's lowering semantics
    (:data:`~jdqn.pallas.grn_block.SEMANTICS`; ``"warpgroup"`` for comparison in
    ``bench/kernels.py``)."""
    pair = target is None
    if not eligible(online, z, pair) or (not pair and not eligible(target, z, False)):
        raise ValueError("double_q_heads_mgpu: inputs outside the kernel's shapes (bf16 or "
                         "float32 pre — float32 under a TF32 matmul precision — with rows a "
                         "multiple of 64, hidden 64–256 by 64, Zb = 64, at most "
                         f"{MAX_FLOW} order-flow features)")
    nets = [jax.tree.map(lambda x, i=i: x[i], online) for i in (0, 1)] if pair \
        else [online, target]
    one = nets[0]
    b, hid = one.pre.shape[0], one.cond_kernel.shape[-1]
    zp = one.out_bias[0].shape[-1]
    sizes = tuple(x.shape[-1] // zp for x in one.out_bias[1:])
    dz = float((v_max - v_min) / (z - 1))
    dt = one.pre.dtype
    stages = STAGES["bfloat16" if dt == jnp.bfloat16 else "float32"] if stages is None \
        else stages
    ops = [_network_operands(inp, sizes, z, float(v_min), dz, dt) for inp in nets]
    w = jnp.stack([o[0] for o in ops])
    if dt == F32 and not interpret:  # TF32 wgmma reads B K-major: each block transposed
        w = jnp.swapaxes(w, -1, -2)
    vec = jnp.stack([o[1] for o in ops])
    n_flow = one.flow.shape[-1]
    # each network's own order flow (the trainer's two read the same s′; nothing assumes it)
    flow = jnp.stack([jnp.swapaxes(inp.flow.astype(F32), 0, 1) if n_flow else
                      jnp.zeros((1, b), F32) for inp in nets])
    if pair:
        pre = online.pre.reshape(2 * b, -1)  # a free reshape: both networks' rows in place
        pre_o = pre_t = pre
        offsets = (0, b)
    else:
        pre_o, pre_t, offsets = online.pre, target.pre, (0, 0)
    args = lax.stop_gradient((pre_o, pre_t, w, vec, flow))
    run = _batched(offsets, sizes, hid, n_flow, float(max(abs(v_min), abs(v_max))), stages,
                   interpret, loop, probe, compact, semantics)
    probs, a = run(*(x[None] for x in args))
    return a[0].T, probs[0].reshape(b, len(sizes), ZB)


@functools.cache
def _batched(offsets, sizes, hid, n_flow, q_scale, stages, interpret, loop, probe, compact,
             semantics):
    """The kernel over a leading axis of sets, each further batch axis (the trainer's seeds)
    folded into that one (:func:`jdqn.pallas.grn_block.fold_sets`): one launch, each set's
    rows with its own weights."""
    return fold_sets(lambda pre_o, pre_t, w, vec, flow: _kernel(
        pre_o, pre_t, w, vec, flow, offsets=offsets, sizes=sizes, hid=hid, n_flow=n_flow,
        q_scale=q_scale, stages=stages, interpret=interpret, loop=loop, probe=probe,
        compact=compact, semantics=semantics))
