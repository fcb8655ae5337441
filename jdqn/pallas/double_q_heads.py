"""Pallas kernel: the C51 heads' output layers at s′ and the double-Q selection, in one pass.

:mod:`jdqn.pallas.double_q` starts from the heads' output-layer products
(:class:`~jdqn.networks.heads.HeadStreams`), which XLA computes first: five GEMMs per network
writing ``[B, n·Zp]`` float32 products (14 actions' and the value's atoms: ~59 MB per
network at B = 16384), a slicing pass over the first layers' output, and one
:func:`~jdqn.pallas.double_q.expected_q_streams` kernel per network for the direction's
expected Q that conditions the magnitude stream. This kernel starts one step earlier, from
what the products are computed from (:class:`~jdqn.networks.heads.HeadInputs`: the first
layers' output ``pre [B, 5·hidden]`` with its bias, the output layers, the conditioning rows),
and writes only what the losses read — ``a* [B, D]`` and the target network's probabilities
at ``a*`` ``[B, D, Zb]``, as :func:`jdqn.pallas.double_q.double_q_next` does. No product
reaches device memory.

Each program owns ``rows`` samples. For the online network, then the target network, it
loads each stream's slice of ``pre``, applies the ReLU and multiplies it by each action's
``[hidden, Zb]`` block of the output layer (one Triton dot per action, float32 accumulation),
adds the biases and the value stream and takes the expected Q ``Σ softmax·z`` — the value and
direction first, then the magnitude stream's input with the direction's expected Q added
through its conditioning rows (:func:`jdqn.networks.heads.streams_from_inputs`' arithmetic,
the rounding to the stored dtype included), then the order-type and urgency streams' with the
order flow. The online network keeps the running argmax per branch (the first maximum wins,
as ``jnp.argmax``); the target network keeps, per branch, the logits of the action the online
network chose in each row and writes each branch's softmax as soon as it is selected (one
branch's ``[rows, Zb]`` logits live at a time). ``stages=None`` unrolls each branch's actions
into straight-line code; ``stages=k`` runs them as a loop (action 0 first, then 1 … n−1) that
Triton software-pipelines ``k`` deep, prefetching the next action's output-layer block while
the current one's softmax runs — the same arithmetic in the same order.

Measured on the H100 (bf16, the pair at B = 16384, ``bench/results/
kernels_h100_bf16_double_q_heads_{rejected,loop}.json``): unrolled, 402–403 µs at 64 rows /
4 warps; as a loop, 269 µs with 3 stages (270 with 2), so the loop is the default — level
with, not below, the 257–264 µs of the path it replaces. In the update it costs ~30 µs
(1.670–1.675 against 1.633–1.651 ms, ``train_h100_bf16_double_q_heads_ab_rejected.json``), so
``impl = "auto"`` does not take it.

The oracle is :func:`reference`: :func:`~jdqn.networks.heads.streams_from_inputs` (the head's
own grad-free path) followed by :func:`jdqn.pallas.double_q.reference`. The kernel agrees to
float32 rounding (its dots sum in another order than XLA's GEMMs), so an action whose expected
Q ties another's to rounding may be chosen differently. Grad-free: the outputs are targets, no
VJP. Under bf16 matmuls the dots take bf16 operands, under float32 float32 ones.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jdqn.networks.heads import HeadInputs, streams_from_inputs
from jdqn.pallas import double_q

Array = jax.Array


def kernel_name(matmul_dtype: str) -> str:
    """The kernel's name for ``use_pallas`` under ``ModelConfig.matmul_dtype``."""
    return "double_q_heads_bf16" if matmul_dtype == "bfloat16" else "double_q_heads_f32"


ROWS_PER_PROGRAM = 64
NUM_WARPS = 4
STAGES = 3  # None: each branch's actions unrolled; k: a loop over them, k-stage pipelined


def reference(online: HeadInputs, target: HeadInputs | None, z: int, v_min: float,
              v_max: float) -> tuple[Array, Array]:
    """The oracle in plain JAX (with :func:`~jdqn.pallas.double_q.expected_q_streams` for the
    direction's conditioning, as the head runs it): ``(a* int32 [B, D], probs float32
    [B, D, Zb])``. ``target=None``: ``online`` holds the pair (leaves ``[2, ...]``)."""
    if target is None:
        online, target = (jax.tree.map(lambda x, i=i: x[i], online) for i in (0, 1))
    return double_q.reference(streams_from_inputs(online, z, v_min, v_max),
                              streams_from_inputs(target, z, v_min, v_max), z, v_min, v_max)


def _rezb(kernel: Array, bias: Array, n: int, zb: int, dtype) -> tuple[Array, Array]:
    """An output layer ``[hidden, n·Zp]``, ``[n·Zp]`` with each action's atoms re-padded with
    zeros to ``Zb`` (a power of two, Triton's blocks), the kernel cast to the dots' dtype."""
    hid, cols = kernel.shape
    zp = cols // n
    k = jnp.pad(kernel.reshape(hid, n, zp), ((0, 0), (0, 0), (0, zb - zp)))
    b = jnp.pad(bias.reshape(n, zp), ((0, 0), (0, zb - zp)))
    return k.reshape(hid, n * zb).astype(dtype), b.reshape(1, n * zb).astype(jnp.float32)


def _network_operands(inp: HeadInputs, sizes: tuple[int, ...], zb: int, dtype) -> list[Array]:
    """One network's weights in the kernel's order: per stream its output kernel and bias
    (atoms re-padded), then the conditioning rows and the two flow kernels (float32)."""
    args = []
    for k, n in enumerate((1, *sizes)):
        args += _rezb(inp.out_kernel[k], inp.out_bias[k], n, zb, dtype)
    args.append(inp.cond_kernel.astype(jnp.float32))
    # (no order flow: a row of zeros the kernel never reads, as no operand may be empty)
    args += [w.astype(jnp.float32) if w.shape[0] else jnp.zeros((1, w.shape[1]), jnp.float32)
             for w in inp.flow_kernel]
    return args


def _kernel(*refs, b: int, z: int, sizes: tuple[int, ...], hid: int, n_flow: int,
            v_min: float, dz: float, q_scale: float, offsets: tuple[int, int], act,
            loop: bool):
    pre_o, pre_t, flow_ref = refs[:3]
    per_net = 2 * (1 + len(sizes)) + 3
    nets = (refs[3:3 + per_net], refs[3 + per_net:3 + 2 * per_net])
    a_ref, p_ref = refs[3 + 2 * per_net:]
    rows, n_branches = a_ref.shape
    zb = p_ref.shape[1] // n_branches
    r = pl.program_id(0) * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    r = jnp.minimum(r, b - 1)  # rows past the batch read the last row (sliced off after)
    j = jax.lax.broadcasted_iota(jnp.int32, (1, zb), 1)
    valid = j < z
    support = v_min + j.astype(jnp.float32) * dz
    hcols = jax.lax.broadcasted_iota(jnp.int32, (1, hid), 1)
    flow = [pl_triton.load(flow_ref.at[r, jnp.full((1, 1), f, jnp.int32)]).astype(jnp.float32)
            for f in range(n_flow)]  # [R, 1] each

    def relu(x):  # in the stored dtype, as the head applies it
        return jnp.maximum(x, jnp.zeros((), x.dtype))

    def expected(lg):  # [R, Zb] logits (masked atoms ignored) → E[Q] [R, 1]
        return double_q.expected_atoms(lg, valid, support)

    dcol = jax.lax.broadcasted_iota(jnp.int32, (1, 1 << (sizes[0] - 1).bit_length()), 1)

    def over_actions(n, step, carry):  # step(a, carry) for a = 1 … n−1
        if not loop:  # unrolled: straight-line code, every slice static
            for a in range(1, n):
                carry = step(a, carry)
            return carry
        return jax.lax.fori_loop(1, n, step, carry)  # a loop Triton can software-pipeline

    chosen = None
    for net, (pre_ref, off) in enumerate(((pre_o, offsets[0]), (pre_t, offsets[1]))):
        w = nets[net]
        out_w, out_b = w[0:2 * (1 + n_branches):2], w[1:2 * (1 + n_branches):2]
        cond_w, flow_w = w[2 * (1 + n_branches)], w[2 * (1 + n_branches) + 1:]

        def pre(k, pre_ref=pre_ref, off=off):  # stream k's first-layer output [R, hid]
            return pl_triton.load(pre_ref.at[r + off, k * hid + hcols])

        def product(k, xr, a, out_w=out_w, out_b=out_b):  # stream k, action a: [R, Zb] + bias
            y = jnp.dot(xr, out_w[k][:, pl.ds(a * zb, zb)], preferred_element_type=jnp.float32)
            return y + out_b[k][:, pl.ds(a * zb, zb)]

        value = product(0, relu(pre(0)), 0)
        picks = []  # (online) per branch the argmax [R, 1]
        q_dir = None  # the direction's expected Q per action, [R, Dp] (columns past it −inf)
        for d, n_act in enumerate(sizes):
            if d == 0:
                x = pre(1)
            elif d == 1:  # the magnitude stream: conditioned on the direction's expected Q
                cond = None
                for a in range(sizes[0]):
                    q = jnp.max(jnp.where(dcol == a, q_dir, -jnp.inf), axis=1, keepdims=True)
                    t = (q / q_scale) * cond_w[pl.ds(a, 1), :]
                    cond = t if cond is None else cond + t
                x = (pre(2).astype(jnp.float32) + cond).astype(act)
            else:  # order type, urgency: the order flow
                x = pre(d + 1)
                if n_flow:
                    fw = flow_w[d - 2]
                    add = None
                    for f in range(n_flow):
                        t = flow[f] * fw[pl.ds(f, 1), :]
                        add = t if add is None else add + t
                    x = (x.astype(jnp.float32) + add).astype(act)
            xr = relu(x)

            def logits(a, xr=xr, d=d, value=value, product=product):
                return value + product(d + 1, xr, a)

            # action 0 starts each chain (the first maximum wins, as jnp.argmax), then the
            # rest in order: the online network's running argmax, the target's logits at the
            # online choice; the direction's expected Q kept per action for the conditioning
            lg = logits(0)
            q = expected(lg) if d == 0 or net == 0 else None
            qd = jnp.where(dcol == 0, q, -jnp.inf) if d == 0 else q_dir  # carried unchanged
            if net == 0:
                def step(a, c, logits=logits, d=d):
                    best_q, best_a, qd = c
                    q = expected(logits(a))
                    qd = jnp.where(dcol == a, q, qd) if d == 0 else qd
                    return (*double_q.running_argmax(best_q, best_a, q, a), qd)

                _, best_a, qd = over_actions(n_act, step, (q, jnp.zeros(q.shape, jnp.int32), qd))
                picks.append(best_a)
            else:
                def step(a, c, logits=logits, d=d, chosen=chosen):
                    sel, qd = c
                    lg = logits(a)
                    if d == 0:
                        qd = jnp.where(dcol == a, expected(lg), qd)
                    return jnp.where(chosen[d] == a, lg, sel), qd

                sel, qd = over_actions(n_act, step, (lg, qd))
                # written at once: one branch's [R, Zb] logits live at a time, not four
                p_ref[:, pl.ds(d * zb, zb)] = double_q.softmax_atoms(sel, valid)
            q_dir = qd
        if net == 0:
            chosen = picks
            col = jax.lax.broadcasted_iota(jnp.int32, (1, n_branches), 1)
            out = jnp.zeros((rows, n_branches), jnp.int32)
            for d in range(n_branches):
                out = jnp.where(col == d, chosen[d], out)
            a_ref[...] = out


@functools.partial(jax.jit, static_argnames=("z", "v_min", "v_max", "interpret", "rows",
                                             "num_warps", "stages"))
def double_q_heads(online: HeadInputs, target: HeadInputs | None, z: int, v_min: float,
                   v_max: float, interpret: bool = False, rows: int = ROWS_PER_PROGRAM,
                   num_warps: int = NUM_WARPS, stages: int | None = STAGES
                   ) -> tuple[Array, Array]:
    """Same contract as :func:`reference` (and :func:`jdqn.pallas.double_q.double_q_next`):
    ``(a* int32 [B, D], probs float32 [B, D, Zb])`` from the online and target networks'
    :class:`~jdqn.networks.heads.HeadInputs` (``target=None``: ``online`` holds the pair,
    leaves ``[2, ...]``, online first; its ``pre`` is read in place). No gradient flows through
    it. ``rows`` samples per program on ``num_warps`` warps; ``stages``: None unrolls each
    branch's actions, ``k`` loops over them pipelined ``k`` deep. ``interpret=True`` runs
    Pallas' interpreter (CPU)."""
    pair = target is None
    one = jax.tree.map(lambda x: x[0], online) if pair else online
    hid = one.cond_kernel.shape[-1]
    zp = one.out_bias[0].shape[-1]
    sizes = tuple(x.shape[-1] // zp for x in one.out_bias[1:])
    zb, n_branches, n_flow = double_q._padded_atoms(z), len(sizes), one.flow.shape[-1]
    if n_branches & (n_branches - 1):
        raise ValueError(f"double_q_heads: {n_branches} branches; the kernel's output blocks "
                         "need a power of two")
    if rows < 16 or rows & (rows - 1):
        raise ValueError(f"double_q_heads: rows = {rows}; Triton's dots need a power of two "
                         ">= 16")
    if stages is not None and stages < 1:
        raise ValueError(f"double_q_heads: stages = {stages}; None (unrolled) or 1 or more")
    b = one.pre.shape[0]
    if b == 0:
        return reference(online, target, z, v_min, v_max)
    act = one.pre.dtype  # bf16 exactly under bf16 matmuls: the dots' operands too
    if pair:
        pre = online.pre.reshape(2 * b, -1)  # a free reshape: both networks' rows, in place
        pre_o = pre_t = pre
        offsets = (0, b)
        nets = [one, jax.tree.map(lambda x: x[1], online)]
    else:
        pre_o, pre_t, offsets, nets = online.pre, target.pre, (0, 0), [online, target]
    args = [pre_o, pre_t, one.flow.astype(jnp.float32) if n_flow else
            jnp.zeros((b, 1), jnp.float32)]
    for inp in nets:
        args += _network_operands(inp, sizes, zb, act)
    args = jax.lax.stop_gradient(args)
    kernel = functools.partial(_kernel, b=b, z=z, sizes=sizes, hid=hid, n_flow=n_flow,
                               v_min=float(v_min), dz=float((v_max - v_min) / (z - 1)),
                               q_scale=float(max(abs(v_min), abs(v_max))), offsets=offsets,
                               act=act, loop=stages is not None)
    return double_q.selection_call(kernel, args, b, n_branches, zb, rows, num_warps,
                                   interpret, "double_q_heads", num_stages=stages)
