"""A whole GRN block's grad-free forward as one Pallas kernel against XLA's path (research).

The question it answers: do kernels that keep activations on chip across consecutive layers —
the route ``docs/model.md`` names for the update's H200 targets — beat XLA's one-GEMM-per-layer
path at the update's shapes when written in Pallas (Triton lowering)? The block
(:class:`jdqn.networks.trunk.GRNBlock`, grad-free as in the paired forward at s′)::

    η   = ELU(x W_fc + b_fc)                 [M, H]
    y   = η W + b                            [M, 2H]   (W = W1·W45, the fold the model forms)
    out = LayerNorm(x + σ(y_g) ⊙ y_v)         [M, H]

XLA's path (what the model runs on the GPU): a GEMM with the bias + ELU fused after it, the
folded GEMM, and the tail as ``jdqn.pallas.grn_tail``'s kernel. The fused kernel reads ``x``
and writes ``out`` once per row tile; η and y never leave the chip: per chunk of ``chunk``
hidden columns it forms η's chunk (one dot over all H inputs), then adds that chunk's share of
both GLU halves into two ``[rows, H]`` float32 accumulators, and ends with the tail. Operands
are the model's (bf16 under bf16 matmuls, η rounded to bf16 as the model stores it; float32 at
default precision, TF32 on Hopper). ``--pair`` vmaps both over two parameter sets (the online
and target networks), as the update does.

Prints JSON: µs per call for XLA's path and per tile (rows/warps/chunk/stages), with the largest
difference from XLA's path and a bitwise repeat. ``--interpret`` runs the kernel in Pallas'
interpreter off the GPU (tests: the values, not the times)."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton
from timing import emit, seconds_per_call

from jdqn.pallas import grn_tail
from jdqn.pallas.grn_block import eta_from_product


def xla_path(x, w_fc, b_fc, w, b, scale, offset, *, interpret=False):
    """The model's grad-free block: GEMM + bias + ELU, the folded GEMM, the tail kernel (its
    reference off the GPU unless ``interpret``)."""
    dt = x.dtype
    eta = eta_from_product(jnp.dot(x, w_fc.astype(dt), preferred_element_type=jnp.float32),
                           b_fc, dt)
    y = jnp.dot(eta, w.astype(dt), preferred_element_type=jnp.float32).astype(dt)
    if jax.default_backend() == "gpu" or interpret:
        return grn_tail.grn_tail(y, b, x, scale, offset, grn_tail.EPSILON, interpret)
    return grn_tail.reference(y, b, x, scale, offset)


def _kernel(x_ref, wfc_ref, bfc_ref, w_ref, b_ref, scale_ref, offset_ref, o_ref, *,
            chunk: int, eps: float):
    f32 = jnp.float32
    x = x_ref[...]
    h = x.shape[1]
    rows = x.shape[0]
    dt = x.dtype
    acc_g = jnp.zeros((rows, h), f32)
    acc_v = jnp.zeros((rows, h), f32)
    for c in range(h // chunk):  # unrolled: the chunks of η's columns (the second contraction)
        cols = pl.ds(c * chunk, chunk)
        eta = eta_from_product(jnp.dot(x, wfc_ref[:, cols], preferred_element_type=f32),
                               bfc_ref[:, cols], dt)
        acc_g += jnp.dot(eta, w_ref[cols, pl.ds(0, h)], preferred_element_type=f32)
        acc_v += jnp.dot(eta, w_ref[cols, pl.ds(h, h)], preferred_element_type=f32)
    if dt == jnp.bfloat16:  # the model stores the product as bf16 before the tail
        acc_g, acc_v = acc_g.astype(dt).astype(f32), acc_v.astype(dt).astype(f32)
    g = acc_g + b_ref[:, pl.ds(0, h)]
    v = acc_v + b_ref[:, pl.ds(h, h)]
    s = x.astype(f32) + v / (1.0 + jnp.exp(-g))
    mean = jnp.sum(s, axis=1, keepdims=True) / h
    var = jnp.maximum(jnp.sum(s * s, axis=1, keepdims=True) / h - mean * mean, 0.0)
    out = (s - mean) * (jax.lax.rsqrt(var + eps) * scale_ref[...]) + offset_ref[...]
    o_ref[...] = out.astype(o_ref.dtype)


def fused(x, w_fc, b_fc, w, b, scale, offset, *, rows=64, warps=4, chunk=64, stages=3,
          interpret=False):
    """The block as one kernel per tile of ``rows`` rows (M a multiple of ``rows``)."""
    m, h = x.shape
    dt = x.dtype
    full = lambda shape: pl.BlockSpec(shape, lambda r: (0, 0))
    row = lambda a: a.astype(jnp.float32).reshape(1, -1)
    return pl.pallas_call(
        functools.partial(_kernel, chunk=chunk, eps=grn_tail.EPSILON),
        out_shape=jax.ShapeDtypeStruct((m, h), dt),
        grid=(m // rows,),
        in_specs=[pl.BlockSpec((rows, h), lambda r: (r, 0)), full((h, h)), full((1, h)),
                  full((h, 2 * h)), full((1, 2 * h)), full((1, h)), full((1, h))],
        out_specs=pl.BlockSpec((rows, h), lambda r: (r, 0)),
        interpret=interpret,
        name="grn_block",
        compiler_params=pl_triton.CompilerParams(num_warps=warps, num_stages=stages),
    )(x, w_fc.astype(dt), row(b_fc), w.astype(dt), row(b), row(scale), row(offset))


def make_args(m: int, h: int, pair: int, dtype: str):
    ks = jax.random.split(jax.random.key(0), 7)
    dt = jnp.dtype(dtype)
    lead = (pair,) if pair else ()
    x = jax.random.normal(ks[0], (*lead, m, h)).astype(dt)
    w_fc = jax.random.normal(ks[1], (*lead, h, h)) / np.sqrt(h)
    b_fc = 0.1 * jax.random.normal(ks[2], (*lead, h))
    w = jax.random.normal(ks[3], (*lead, h, 2 * h)) / np.sqrt(h)
    b = 0.1 * jax.random.normal(ks[4], (*lead, 2 * h))
    scale = 1.0 + 0.1 * jax.random.normal(ks[5], (*lead, h))
    offset = 0.1 * jax.random.normal(ks[6], (*lead, h))
    # the bias first: the timing loop perturbs its first argument, and perturbing x would add a
    # pass over it to the time (bench/kernels.py, bench_grn_tail)
    return b_fc, x, w_fc, w, b, scale, offset


def model_args(m: int, h: int, pair: int, dtype: str, block: int, obs_width: int = 128,
               x_block: int | None = None, x_scale: float = 1.0):
    """:func:`make_args`' tuple for GRN block ``block`` of the model itself (``width = h``,
    ``matmul_dtype = dtype``, two GRN blocks, initialised parameters): its parameters with the
    fold the network forms (``W = W1·W45``, ``b = b1·W45 + b45``) and, as ``x``, what the
    block reads in the network's grad-free forward of ``m`` random observations — the input
    layer's output for block 0, block 0's output for block 1. With ``pair``, one such set per
    parameter initialisation (seeds 0, 1, …), stacked. These are the update's blocks' values
    at initialisation, on random observations, to rounding (block 1's input comes from XLA's
    path for block 0, which the GPU's kernel matches to the last bf16 bit), rather than
    :func:`make_args`' normal ones (the kernel's time may depend on them: a question the
    profiles raised, ``docs/model.md``). ``x_block``: ``x`` from that block instead (block
    ``block``'s parameters with the other block's input, to tell the two apart); ``x_scale``
    multiplies ``x`` (rounded back to ``dtype``)."""
    from flax import linen as nn

    from jdqn.config import ModelConfig
    from jdqn.networks.model import BranchingQNetwork, init_params
    from jdqn.networks.trunk import GRNBlock

    x_block = block if x_block is None else x_block
    for flag, value in (("--block", block), ("--x-block", x_block)):
        if not 0 <= value < 2:
            raise SystemExit(f"{flag} {value}: the model has GRN blocks 0 and 1")
    if not (np.isfinite(x_scale) and x_scale > 0):
        raise SystemExit(f"--x-scale {x_scale}: must be a positive finite number")
    net = BranchingQNetwork(ModelConfig(width=h, n_grn_blocks=2, matmul_dtype=dtype,
                                        impl="xla"))
    obs = jax.random.normal(jax.random.key(99), (m, obs_width))
    hi = jax.lax.Precision.HIGHEST
    sets = []
    for seed in range(max(pair, 1)):
        params = init_params(net, jax.random.key(seed), obs_width)
        seen = {}

        def record(next_fun, args, kwargs, context, seen=seen):
            if isinstance(context.module, GRNBlock) and context.method_name == "__call__":
                seen.setdefault(context.module.name, args[0])
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(record):
            net.apply(params, obs, grad_free=True)
        p = params["params"]["trunk"][f"grn_{block}"]
        w1, w45 = p["fc"]["kernel"], p["glu"]["kernel"]
        x = seen[f"grn_{x_block}"]
        if x_scale != 1.0:
            x = (x.astype(jnp.float32) * x_scale).astype(x.dtype)
        sets.append((p["fc_elu"]["bias"], x, p["fc_elu"]["kernel"],
                     jnp.dot(w1, w45, precision=hi),
                     jnp.dot(p["fc"]["bias"], w45, precision=hi) + p["glu"]["bias"],
                     p["norm"]["scale"], p["norm"]["bias"]))
    if not pair:
        return sets[0]
    return tuple(jnp.stack(a) for a in zip(*sets, strict=True))


def _mgpu_bias_first(b_fc, x, w_fc, *rest, pair, kw, design="fused"):
    """A Mosaic GPU kernel (``fused_grn_mgpu.<design>``) in the timing loop's argument order;
    it takes the pair itself."""
    import fused_grn_mgpu
    fn = getattr(fused_grn_mgpu, design)
    args = (x, w_fc, b_fc, *rest)
    if pair:
        return fn(*args, **kw)
    return fn(*(a[None] for a in args), **kw)[0]


def run(m: int, h: int, pair: int, dtype: str, tiles, reps: int, interpret: bool,
        mgpu_tiles=(), mgpu_rs=(), block: int | None = None, x_block: int | None = None,
        x_scale: float = 1.0, evict_mb: float = 0.0) -> dict:
    """``block`` None: random inputs (:func:`make_args`); else that GRN block's inputs in the
    model (:func:`model_args`, with its ``x_block`` and ``x_scale``). ``evict_mb``: each
    kernel is also timed with that many MB rewritten before every call (``us_cold``: the L2
    cache evicted, the rewrite's own time, ``evict_us``, subtracted)."""
    args = make_args(m, h, pair, dtype) if block is None else \
        model_args(m, h, pair, dtype, block, x_block=x_block, x_scale=x_scale)

    def bias_first(fn):
        f = lambda b_fc, x, *rest: fn(x, rest[0], b_fc, *rest[1:])
        return jax.vmap(f) if pair else f

    fns = {"xla": bias_first(functools.partial(xla_path, interpret=interpret))}
    for tm, c2, stages, eta_in, stages2, probe in mgpu_tiles:
        kw = {"eps": grn_tail.EPSILON, "tm": tm, "c2": c2, "stages": stages,
              "stages2": stages2, "eta_in": eta_in, "probe": probe, "interpret": interpret}
        fn = functools.partial(_mgpu_bias_first, pair=pair, kw=kw)
        fns[f"mgpu_tm{tm}_c{c2}_s{stages}{'' if stages2 is None else f'-{stages2}'}"
            f"_{eta_in}{f'_probe_{probe}' if probe else ''}"] = fn
    for stages, stages2, probe, approx, semantics in mgpu_rs:
        kw = {"eps": grn_tail.EPSILON, "stages": stages, "stages2": stages2, "probe": probe,
              "approx": approx, "interpret": interpret, "semantics": semantics}
        fns[f"mgpu_rs_s{stages}-{stages2}{f'_probe_{probe}' if probe else ''}"
            f"{'_approx' if approx else ''}{'_wg' if semantics == 'warpgroup' else ''}"] = \
            functools.partial(_mgpu_bias_first, pair=pair, kw=kw, design="fused_rs")
    for rows, warps, chunk, stages in tiles:
        fns[f"fused_r{rows}_w{warps}_c{chunk}_s{stages}"] = bias_first(functools.partial(
            fused, rows=rows, warps=warps, chunk=chunk, stages=stages, interpret=interpret))
    ref = np.asarray(jax.jit(fns["xla"])(*args).astype(jnp.float32))
    results = {}
    evict_bytes = int(evict_mb * 2**20)
    evict_us = 0.0
    if evict_mb and not interpret:
        evict_us = 1e6 * seconds_per_call(lambda b_fc, *rest: b_fc, args, reps, evict_bytes)
    for name, fn in fns.items():
        if name.startswith(("fused", "mgpu")) and jax.default_backend() != "gpu" \
                and not interpret:
            results[name] = {"skipped": "needs a GPU (or --interpret)"}
            continue
        try:
            one = jax.jit(fn)
            a, a2 = (np.asarray(jax.block_until_ready(one(*args)).astype(jnp.float32))
                     for _ in range(2))
            results[name] = {"max_abs_diff": float(np.max(np.abs(a - ref))),
                             "frac_diff": float(np.mean(a != ref)),
                             "bitwise_repeat": bool(np.array_equal(a, a2))}
            if not interpret:
                results[name]["us"] = round(1e6 * seconds_per_call(fn, args, reps), 1)
                if evict_mb:
                    results[name]["us_cold"] = round(
                        1e6 * seconds_per_call(fn, args, reps, evict_bytes) - evict_us, 1)
        except Exception as e:  # noqa: BLE001 — a tile Triton rejects is a result too
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
        print(name, results[name], file=sys.stderr, flush=True)
    stats = {"x_std": float(jnp.std(args[1].astype(jnp.float32))),
             "x_abs_max": float(jnp.max(jnp.abs(args[1].astype(jnp.float32))))}
    return {"bench": "fused_grn", "rows": m, "width": h, "pair": pair, "dtype": dtype,
            "inputs": "random" if block is None else f"model block {block}",
            **({} if block is None else {"x_block": block if x_block is None else x_block,
                                         "x_scale": x_scale}), **stats,
            "interpret": interpret, "reps": reps,
            **({"evict_mb": evict_mb, "evict_us": round(evict_us, 1)} if evict_mb else {}),
            "results": results}


def _mgpu_tile(text: str) -> tuple:
    """``tm/c2/stages/eta_in[/stages2[/probe]]`` → the kernel's settings (SystemExit naming
    the entry and the field when one is not valid)."""
    from fused_grn_mgpu import ETA_IN, PROBES

    form = "tm/c2/stages/eta_in[/stages2[/probe]]"
    f = text.split("/")
    if not 4 <= len(f) <= 6:
        raise SystemExit(f"--mgpu-tiles: {text!r} is not {form}")
    ints = []
    for name, value in zip(("tm", "c2", "stages", "stages2"), (*f[:3], *f[4:5])):
        if value == "" and name == "stages2":
            ints.append(None)
            continue
        if not value.isdigit() or int(value) < 1:
            raise SystemExit(f"--mgpu-tiles: {text!r}: {name} = {value!r} is not a positive "
                             f"integer ({form})")
        ints.append(int(value))
    if f[3] not in ETA_IN:
        raise SystemExit(f"--mgpu-tiles: {text!r}: eta_in = {f[3]!r} is not one of {ETA_IN}")
    probe = f[5] if len(f) > 5 else ""
    if probe not in PROBES:
        raise SystemExit(f"--mgpu-tiles: {text!r}: probe = {probe!r} is not one of {PROBES[1:]}")
    return ints[0], ints[1], ints[2], f[3], ints[3] if len(ints) > 3 else None, probe


def _mgpu_rs(text: str) -> tuple:
    """``stages/stages2[/options]`` → :func:`fused_grn_mgpu.fused_rs`'s settings; options
    joined by ``+``: a probe, ``approx`` and/or ``wg`` (Mosaic GPU's warpgroup lowering
    semantics, not the model's lane; SystemExit naming the entry and the field when one is
    not valid)."""
    from fused_grn_mgpu import PROBES

    form = "stages/stages2[/options]"
    f = text.split("/")
    if not 2 <= len(f) <= 3:
        raise SystemExit(f"--mgpu-rs: {text!r} is not {form}")
    for name, value in zip(("stages", "stages2"), f):
        if not value.isdigit() or int(value) < 1:
            raise SystemExit(f"--mgpu-rs: {text!r}: {name} = {value!r} is not a positive "
                             f"integer ({form})")
    options = f[2].split("+") if len(f) > 2 else []
    approx, wg = "approx" in options, "wg" in options
    probes = [o for o in options if o not in ("approx", "wg")]
    if len(probes) > 1 or (probes and probes[0] not in PROBES[1:]):
        raise SystemExit(f"--mgpu-rs: {text!r}: options {f[2]!r} are not a probe "
                         f"{PROBES[1:]}, 'approx' and/or 'wg'")
    return (int(f[0]), int(f[1]), probes[0] if probes else "", approx,
            "warpgroup" if wg else "lane")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--pair", type=int, default=2, help="parameter sets vmapped (0: none)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--tiles", default="64/4/64/3,64/8/64/3,128/8/64/3,32/4/64/3,64/4/32/3,"
                                       "64/8/128/2,128/4/64/2",
                    help="rows/warps/chunk/stages, comma-separated")
    ap.add_argument("--mgpu-tiles", default="",
                    help="the Mosaic GPU kernel (bf16; bench/fused_grn_mgpu.py): "
                         "tm/c2/stages/eta_in (regs|smem)[/stages2[/probe]], comma-separated; "
                         "a probe (no_act|no_ln|mm_only) drops work for timing")
    ap.add_argument("--mgpu-rs", default="",
                    help="the Mosaic GPU kernel with s in registers, two CTAs per SM, the "
                         "product's (jdqn.pallas.grn_block via fused_grn_mgpu.fused_rs; bf16, "
                         "or float32 as TF32): stages/stages2[/options], comma-separated; "
                         "options joined by +: a probe, approx (approximate exp), wg "
                         "(warpgroup lowering semantics, not the model's lane)")
    ap.add_argument("--inputs", choices=("random", "model"), default="random",
                    help="random normal x and weights, or a GRN block's parameters and input "
                         "in the model itself (--block)")
    ap.add_argument("--block", type=int, default=0, help="with --inputs model: GRN block 0 or 1")
    ap.add_argument("--x-block", type=int, default=None,
                    help="with --inputs model: x from this block's input instead (default "
                         "--block's), the parameters staying --block's")
    ap.add_argument("--x-scale", type=float, default=1.0,
                    help="with --inputs model: multiply x by this")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--evict-l2-mb", type=float, default=0.0,
                    help="also time each kernel with this many MB rewritten before every call "
                         "(twice the L2 cache, e.g. 120 on the H100/H200: us_cold, the "
                         "rewrite's time subtracted)")
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    tiles = [tuple(int(v) for v in t.split("/")) for t in a.tiles.split(",") if t]
    mgpu = [_mgpu_tile(t) for t in a.mgpu_tiles.split(",") if t]
    rs = [_mgpu_rs(t) for t in a.mgpu_rs.split(",") if t]
    if not (np.isfinite(a.evict_l2_mb) and a.evict_l2_mb >= 0):
        raise SystemExit(f"--evict-l2-mb {a.evict_l2_mb}: must be a finite number >= 0")
    if mgpu and a.dtype != "bfloat16":
        raise SystemExit(f"--mgpu-tiles: the Mosaic GPU kernel runs bf16 only, not --dtype "
                         f"{a.dtype}")
    emit(run(a.batch, a.width, a.pair, a.dtype, tiles, a.reps, a.interpret, mgpu, rs,
             a.block if a.inputs == "model" else None, a.x_block, a.x_scale,
             a.evict_l2_mb), a.out)


if __name__ == "__main__":
    main()
