"""Pallas kernel: the double-Q action and the target distribution at s′, in one pass.

The C51 and IQN targets bootstrap from s′ with double-Q selection: per branch ``d``, the online
network picks ``a* = argmax_a E[Q_online(s′, a)]`` and the target network's distribution at
``a*`` is projected. Written with the heads' logits (the plain-JAX path,
:func:`reference`), XLA runs that as a chain of kernels over ``[B, A_d, Z]`` tensors: it adds
the value stream to each advantage stream and writes every action's logits of both networks,
reads the online ones back for the expected Q (one reduction per branch), and reads the target
ones again to select ``a*`` and take the softmax.

This kernel starts from the heads' **output-layer products**
(:class:`jdqn.networks.heads.HeadStreams`: the products before their bias adds, which the head
returns with ``streams=True``) and writes only what the losses read: ``a* [B, D]`` and the target's probabilities at ``a*`` ``[B, D, Zb]``.
Each program owns ``rows`` samples and, per branch, walks the actions in order: it loads the
action's online atoms, adds the biases and the value stream, and keeps the running argmax of
``E[Q] = Σ softmax·z`` (the first maximum wins, as ``jnp.argmax``); then it gathers the target
network's atoms at ``a*`` only — one action's columns per row, not all of them — and writes
their softmax. The logits never reach device memory.

Layout: the atom axis of a head's product is padded to ``Zp``
(:func:`jdqn.networks.heads.pad_atoms`, a multiple of 4 — not a power of two, which Triton's blocks need), so the kernel
reads its inputs with explicit, masked ``[rows, Zb]`` gathers (``Zb`` the next power of two
≥ Z; columns at or beyond Z are masked and their addresses clamped). The output's atoms are
padded to ``Zb`` with zeros — the row layout the projection kernel reads
(:class:`jdqn.pallas.projection.Layout`), so the target goes to it without a re-layout.

The oracle is :func:`reference`, the plain-JAX computation the loss runs without the kernel;
the kernel agrees with it to float32 rounding (the softmax and the expected Q are Triton's
sums), so an action whose expected Q ties another's to rounding may be chosen differently.
Grad-free: the outputs are constants of the loss (the target side of the TD error), so the
function has no VJP. Float32 products (the heads' logits are float32 under bf16 matmuls too).
:func:`expected_q_streams` is the online half for one branch — its expected Q from the
products — which the grad-free head uses for the direction's Q that conditions the magnitude
stream, so that no logits are written there either.

Measured on the H200 (B = 16384, jax 0.11.2): alone, the pair's products → ``a*`` and the
probabilities in 54.6 µs at 16 rows per program on 4 warps (73.5–118.5 µs at four other tiles)
against 177.3 µs for XLA's kernels, no action differing, bitwise repeatable
(``kernels_h200_double_q.json``); the update 2.622–2.641 against 2.695–2.716 ms (float32, two
machine sessions), then with :func:`expected_q_streams` 2.637–2.650 against 2.650–2.661 ms, and
bf16 1.757–1.767 against 1.796–1.802 ms (``docs/model.md``, "Kernels").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jdqn.networks.heads import HeadStreams, expected_q, make_support, stream_logits

Array = jax.Array

ROWS_PER_PROGRAM = 16
NUM_WARPS = 4
_NEG = -1.0e30  # a masked atom's logit: probability 0, no inf arithmetic


def _pair(streams: HeadStreams, i: int) -> HeadStreams:
    return jax.tree.map(lambda x: x[i], streams)


def _padded_atoms(z: int) -> int:
    return 1 << (z - 1).bit_length()


def reference(online: HeadStreams, target: HeadStreams | None, z: int, v_min: float,
              v_max: float) -> tuple[Array, Array]:
    """The oracle in plain JAX: ``(a* int32 [B, D], probs float32 [B, D, Zb])`` — the online
    network's greedy action per branch and the target network's softmax at it, atoms padded
    with zeros to ``Zb`` (the next power of two ≥ Z). ``target=None``: ``online`` holds the
    pair (every leaf ``[2, ...]``, online first)."""
    from jdqn.losses.batch import select

    if target is None:
        online, target = _pair(online, 0), _pair(online, 1)
    lo, lt = stream_logits(online, z), stream_logits(target, z)
    support = make_support(v_min, v_max, z, dtype=lo[0].dtype)
    actions = [jnp.argmax(expected_q(x, support), axis=-1) for x in lo]
    probs = jnp.stack([jax.nn.softmax(select(t, a), axis=-1) for t, a in zip(lt, actions,
                                                                              strict=True)], 1)
    zb = _padded_atoms(z)
    return (jnp.stack(actions, 1).astype(jnp.int32),
            jnp.pad(probs.astype(jnp.float32), ((0, 0), (0, 0), (0, zb - z))))


def _load(ref, rows: Array, cols: Array, mask: Array) -> Array:
    """``ref[rows, cols]`` (broadcast index arrays) as float32, 0 where ``mask`` is false."""
    return pl_triton.load(ref.at[rows, cols], mask=mask, other=0.0).astype(jnp.float32)


def _tile(rows: int, b: int, z: int, v_min: float, dz: float):
    """A program's indices: its rows ``[R, 1]`` (those past the batch read the last row; their
    outputs are sliced off), the atom mask ``[1, Zb]``, the atom columns clamped in bounds
    (masked columns keep valid addresses: the interpreter gathers every address), the mask
    broadcast to ``[R, Zb]`` and the support ``[1, Zb]``."""
    r = pl.program_id(0) * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    r = jnp.minimum(r, b - 1)
    j = jax.lax.broadcasted_iota(jnp.int32, (1, _padded_atoms(z)), 1)
    valid = j < z
    return (r, valid, jnp.minimum(j, z - 1), jnp.broadcast_to(valid, (rows, j.shape[1])),
            v_min + j.astype(jnp.float32) * dz)


def _kernel(*refs, b: int, z: int, zp: int, sizes: tuple[int, ...], v_min: float, dz: float,
            offsets: tuple[int, int], bias_rows: tuple[int, int]):
    n_branches = len(sizes)
    vo, vbo, vt, vbt = refs[:4]
    adv = refs[4:4 + 4 * n_branches]
    a_ref, p_ref = refs[4 + 4 * n_branches:]
    rows, zb = p_ref.shape[0], p_ref.shape[1] // n_branches
    r, valid, jc, full, support = _tile(rows, b, z, v_min, dz)
    row_o, row_t = r + offsets[0], r + offsets[1]
    brow_o = jnp.full((1, 1), bias_rows[0], jnp.int32)
    brow_t = jnp.full((1, 1), bias_rows[1], jnp.int32)
    value_o = _load(vo, row_o, jc, full) + _load(vbo, brow_o, jc, valid)  # [R, Zb]
    value_t = _load(vt, row_t, jc, full) + _load(vbt, brow_t, jc, valid)
    col = jax.lax.broadcasted_iota(jnp.int32, (1, n_branches), 1)
    chosen = jnp.zeros((rows, n_branches), jnp.int32)
    for d, n_act in enumerate(sizes):
        ao, abo, at, abt = adv[4 * d:4 * d + 4]
        best_q = best_a = None
        for a, q in _expected_q(  # in order: the first maximum wins, as jnp.argmax
                lambda: value_o,
                lambda a, ao=ao, abo=abo: (_load(ao, row_o, a * zp + jc, full)
                                           + _load(abo, brow_o, a * zp + jc, valid)),
                n_act, valid, support):
            best_q, best_a = running_argmax(best_q, best_a, q, a)
        cols = best_a * zp + jc  # [R, Zb]: each row's own action
        lg = value_t + _load(at, row_t, cols, full) + _load(abt, brow_t, cols, full)
        p_ref[:, pl.ds(d * zb, zb)] = softmax_atoms(lg, valid)
        chosen = jnp.where(col == d, best_a, chosen)
    a_ref[...] = chosen


def running_argmax(best_q: Array | None, best_a: Array | None, q: Array,
                   a: int) -> tuple[Array, Array]:
    """In a kernel: the running ``(max, argmax)`` ``[R, 1]`` over actions taken in order, with
    action ``a``'s ``q`` ``[R, 1]`` (``best_q = None`` before the first): a strictly larger Q
    wins, so the first maximum is kept, as ``jnp.argmax`` keeps it."""
    if best_q is None:
        return q, jnp.zeros(q.shape, jnp.int32)
    better = q > best_q
    return jnp.where(better, q, best_q), jnp.where(better, a, best_a)


def _shifted_exp(lg: Array, valid: Array) -> Array:
    """``exp(lg − max lg)`` per row of logits ``[R, Zb]``, 0 where ``valid`` is false."""
    lg = jnp.where(valid, lg, _NEG)
    return jnp.exp(lg - jnp.max(lg, axis=1, keepdims=True))


def softmax_atoms(lg: Array, valid: Array) -> Array:
    """In a kernel: the softmax over the atoms of logits ``[R, Zb]``, 0 where ``valid``
    ``[1, Zb]`` is false."""
    e = _shifted_exp(lg, valid)
    return e / jnp.sum(e, axis=1, keepdims=True)


def expected_atoms(lg: Array, valid: Array, support: Array) -> Array:
    """In a kernel: ``E[Q] = Σ softmax·z`` ``[R, 1]`` of logits ``[R, Zb]`` (atoms where
    ``valid`` is false left out), as ``Σ e·z / Σ e``."""
    e = _shifted_exp(lg, valid)
    return jnp.sum(e * support, axis=1, keepdims=True) / jnp.sum(e, axis=1, keepdims=True)


def _expected_q(load_value, load_adv, n_act: int, valid: Array, support: Array):
    """Per action ``a`` (in order) the online logits' ``E[Q] = Σ softmax·z`` [R, 1], from
    ``load_value()`` [R, Zb] and ``load_adv(a)`` [R, Zb] (masked atoms set to −∞ here)."""
    value = load_value()
    for a in range(n_act):
        yield a, expected_atoms(value + load_adv(a), valid, support)


def _q_kernel(v_ref, vb_ref, a_ref, ab_ref, q_ref, *, b: int, z: int, zp: int, n_act: int,
              v_min: float, dz: float):
    rows, ap = q_ref.shape
    r, valid, jc, full, support = _tile(rows, b, z, v_min, dz)
    zero = jnp.zeros((1, 1), jnp.int32)
    col = jax.lax.broadcasted_iota(jnp.int32, (1, ap), 1)
    out = jnp.zeros((rows, ap), jnp.float32)
    for a, q in _expected_q(
            lambda: _load(v_ref, r, jc, full) + _load(vb_ref, zero, jc, valid),
            lambda a: (_load(a_ref, r, a * zp + jc, full)
                       + _load(ab_ref, zero, a * zp + jc, valid)), n_act, valid, support):
        out = jnp.where(col == a, q, out)
    q_ref[...] = out


def expected_q_streams(value: Array, value_bias: Array, adv: Array, adv_bias: Array, z: int,
                       v_min: float, v_max: float, interpret: bool = False,
                       rows: int = ROWS_PER_PROGRAM,
                       num_warps: int = NUM_WARPS) -> Array:
    """One branch's expected Q ``[B, A]`` from its :class:`~jdqn.networks.heads.HeadStreams`
    parts — the value product ``[B, Zp]`` and bias ``[Zp]``, the advantage product
    ``[B, A·Zp]`` and bias ``[A·Zp]`` — without writing its ``[B, A, Z]`` logits: the same as
    ``expected_q(stream_logits(...)[d], support)`` to float32 rounding. The head's
    conditioning of the magnitude stream on the direction's expected Q reads it where the head
    returns its streams (grad-free). Works under ``vmap`` (the paired forward). No gradient."""
    b, zp = value.shape
    n_act = adv.shape[-1] // zp
    if b == 0:
        return jnp.zeros((0, n_act), jnp.float32)
    ap = 1 << max(n_act - 1, 0).bit_length()
    bp = pl.cdiv(b, rows) * rows
    args = jax.lax.stop_gradient((value, value_bias.reshape(1, -1), adv,
                                  adv_bias.reshape(1, -1)))
    q = pl.pallas_call(
        functools.partial(_q_kernel, b=b, z=z, zp=zp, n_act=n_act, v_min=float(v_min),
                          dz=float((v_max - v_min) / (z - 1))),
        out_shape=jax.ShapeDtypeStruct((bp, ap), jnp.float32),
        grid=(bp // rows,),
        out_specs=pl.BlockSpec((rows, ap), lambda i: (i, 0)),
        compiler_params=None if interpret else pl_triton.CompilerParams(num_warps=num_warps),
        interpret=interpret,
        name="expected_q_streams",
    )(*args)
    return q[:b, :n_act]


def _operands(online: HeadStreams, target: HeadStreams | None):
    """The kernel's inputs as 2-D arrays, with each network's row offset and bias row: the pair
    (``target=None``) is passed as its ``[2B, C]`` reshape, read at rows ``b`` and ``B + b``
    (no copy); two networks each as their own arrays."""
    if target is None:
        b = online.value.shape[1]
        o, t, offsets, bias_rows = online, online, (0, b), (0, 1)
    else:
        b = online.value.shape[0]
        o, t, offsets, bias_rows = online, target, (0, 0), (0, 0)

    def flat(x):
        return x.reshape(-1, x.shape[-1])

    args = [flat(o.value), flat(o.value_bias), flat(t.value), flat(t.value_bias)]
    for d in range(len(o.adv)):
        args += [flat(o.adv[d]), flat(o.adv_bias[d]), flat(t.adv[d]), flat(t.adv_bias[d])]
    return b, args, offsets, bias_rows


@functools.partial(jax.jit, static_argnames=("z", "v_min", "v_max", "interpret", "rows",
                                             "num_warps"))
def double_q_next(online: HeadStreams, target: HeadStreams | None, z: int, v_min: float,
                  v_max: float, interpret: bool = False, rows: int = ROWS_PER_PROGRAM,
                  num_warps: int = NUM_WARPS) -> tuple[Array, Array]:
    """Same contract as :func:`reference`: ``(a* int32 [B, D], probs float32 [B, D, Zb])``
    from the online and target networks' :class:`~jdqn.networks.heads.HeadStreams` (``target=None``: ``online``
    holds the pair, leaves ``[2, ...]``, online first). No gradient flows through it (the
    outputs are targets). ``interpret=True`` runs Pallas' interpreter (CPU)."""
    sizes = tuple(x.shape[-1] // online.value.shape[-1] for x in online.adv)
    zp, zb, n_branches = online.value.shape[-1], _padded_atoms(z), len(sizes)
    if n_branches & (n_branches - 1):
        raise ValueError(f"double_q_next: {n_branches} branches; the kernel's output blocks "
                         "need a power of two")
    if online.value.shape[-2] == 0:
        return reference(online, target, z, v_min, v_max)
    b, args, offsets, bias_rows = _operands(online, target)
    args = jax.lax.stop_gradient(args)
    kernel = functools.partial(_kernel, b=b, z=z, zp=zp, sizes=sizes, v_min=float(v_min),
                               dz=float((v_max - v_min) / (z - 1)), offsets=offsets,
                               bias_rows=bias_rows)
    return selection_call(kernel, args, b, n_branches, zb, rows, num_warps, interpret,
                          "double_q_next")


def selection_call(kernel, args: list[Array], b: int, n_branches: int, zb: int, rows: int,
                   num_warps: int, interpret: bool, name: str,
                   num_stages: int | None = None) -> tuple[Array, Array]:
    """Run a double-Q selection ``kernel`` over ``b`` rows, ``rows`` per program: its outputs
    ``(a* int32 [B, D], probs float32 [B, D, Zb])``, each program writing its rows' blocks."""
    bp = pl.cdiv(b, rows) * rows
    a, p = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((bp, n_branches), jnp.int32),
                   jax.ShapeDtypeStruct((bp, n_branches * zb), jnp.float32)),
        grid=(bp // rows,),
        out_specs=(pl.BlockSpec((rows, n_branches), lambda i: (i, 0)),
                   pl.BlockSpec((rows, n_branches * zb), lambda i: (i, 0))),
        compiler_params=None if interpret else pl_triton.CompilerParams(num_warps=num_warps,
                                                                        num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*args)
    return a[:b], p[:b].reshape(b, n_branches, zb)
