"""Pallas kernels against their XLA references at production shapes: speed, parity, determinism.

Prints one JSON object. For the C51 target projection (``jdqn.pallas.projection``) at
B = 16384, D = 4, Z = 51 it times the plain-JAX reference (``jdqn.losses.batch.project_uniform``),
the Pallas kernel and three other XLA formulations that were tried and rejected (an unrolled sum
over source atoms, an einsum over materialised hat weights, a "two-hot" compare form), and for
each reports the largest difference from the reference and whether two runs are bitwise equal.

    python bench/kernels.py                 # GPU (the Pallas kernel needs one)
    python bench/kernels.py --batch 2048    # smaller; on CPU the Pallas row is skipped
    python bench/kernels.py --kernel c51_loss   # the fused C51 loss terms, forward + backward
    python bench/kernels.py --kernel iqn        # the fused IQN stack (forward), tile sweep
    python bench/kernels.py --kernel moe        # the MoE mixture kernels, forward + backward
    python bench/kernels.py --kernel modulation # the IQN modulation's backward kernel
    python bench/kernels.py --kernel reduce     # the deterministic tree sum vs jnp.sum
    python bench/kernels.py --kernel grn_tail   # a GRN block's tail (GLU + residual + LN)
    python bench/kernels.py --kernel grn_tail_grad  # the tail's gradient (backward kernel)
    python bench/kernels.py --kernel double_q   # the double-Q action + target softmax at s′
    python bench/kernels.py --kernel double_q_heads --dtype bfloat16  # with the heads' output layers
    python bench/kernels.py --kernel double_q_heads --dtype bfloat16 --double-q-heads-mgpu 2,1
        # the same in Mosaic GPU (Hopper), ring depths 2 and 1
    python bench/kernels.py --kernel iqn_tail   # the IQN output stage (bias, ReLU, W2)
    python bench/kernels.py --kernel iqn_tail_grad  # its gradient (backward kernel)
    python bench/kernels.py --kernel moe_gate_grad  # the MoE gated hidden layer's gradient
    python bench/kernels.py --kernel trunk_input --dtype bfloat16  # selection+input, MoE gate

Each timing is a ``lax.fori_loop`` of ``--reps`` projections inside one jit (inputs perturbed
per iteration so nothing is hoisted, the whole output consumed), after a warm-up call.

``--out FILE`` writes the record to a file too. The kernels that sweep settings rewrite it
after every setting (``"complete": false``, ``rows_so_far``), so a remote run capped by
``timeout`` returns what it measured before the setting that ran past the cap.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
from timing import seconds_per_call

from jdqn.losses.batch import project_uniform
from jdqn.pallas.projection import project_uniform_pallas


def _atoms(tz, v_min, v_max, z):
    dz = (v_max - v_min) / (z - 1)
    return (jnp.clip(tz, v_min, v_max) - v_min) / jnp.asarray(dz, tz.dtype)


def unrolled(tz, probs, v_min, v_max):
    z = probs.shape[-1]
    x, i = _atoms(tz, v_min, v_max, z), jnp.arange(z, dtype=tz.dtype)
    acc = 0.0
    for j in range(z):
        acc = acc + probs[:, :, j:j + 1] * jnp.maximum(0.0, 1.0 - jnp.abs(x[:, None, j:j + 1] - i))
    return acc


def einsum(tz, probs, v_min, v_max):
    z = probs.shape[-1]
    x, i = _atoms(tz, v_min, v_max, z), jnp.arange(z, dtype=tz.dtype)
    w = jnp.maximum(0.0, 1.0 - jnp.abs(x[:, None, :] - i[:, None]))
    return jnp.einsum("bij,bdj->bdi", w, probs, precision="highest")


def twohot(tz, probs, v_min, v_max):
    z = probs.shape[-1]
    x, i = _atoms(tz, v_min, v_max, z), jnp.arange(z, dtype=tz.dtype)
    lo = jnp.floor(x)
    f = x - lo
    w = ((lo[:, None, :] == i[:, None]) * (1 - f)[:, None, :]
         + (lo[:, None, :] + 1 == i[:, None]) * f[:, None, :])
    return jnp.sum(w[:, None] * probs[:, :, None, :], axis=-1)


def pallas_rows(tz, probs, v_min, v_max):
    return project_uniform_pallas(tz, probs, v_min=v_min, v_max=v_max, layout="rows")


def pallas_lanes(tz, probs, v_min, v_max):  # the default layout
    return project_uniform_pallas(tz, probs, v_min=v_min, v_max=v_max, layout="lanes")


VARIANTS = {"xla_reference": project_uniform, "pallas_lanes": pallas_lanes,
            "pallas_rows": pallas_rows,
            "xla_unrolled": unrolled, "xla_einsum": einsum, "xla_twohot": twohot}


def bench_c51_loss(b: int, d: int, z: int, reps: int) -> dict:
    """``(sq, ce, tm, kl)`` and the gradient w.r.t. the taken logits: Pallas (custom VJP) vs
    XLA."""
    from jdqn.pallas.c51_loss import c51_terms_pallas, c51_terms_reference

    v_min, v_max = -25.0, 25.0
    k = jax.random.split(jax.random.key(0), 4)
    taken = jax.random.normal(k[0], (b, d, z)) * 2
    nxt = jax.random.normal(k[1], (b, d, z)) * 2
    tz = (jax.random.normal(k[2], (b, 1)) * 10
          + jax.random.uniform(k[3], (b, 1)) * jnp.linspace(v_min, v_max, z))
    fns = {"xla_reference": lambda t, n, x: c51_terms_reference(t, n, x, v_min, v_max),
           "pallas": lambda t, n, x: c51_terms_pallas(t, n, x, v_min, v_max, False)}

    def value_and_grad(fn):
        def loss(t, n, x):
            sq, ce, _, _ = fn(t, n, x)
            return jnp.sum(0.3 * sq + 0.7 * ce)
        return jax.value_and_grad(loss)

    ref = jax.jit(value_and_grad(fns["xla_reference"]))(taken, nxt, tz)
    results = {}
    for name, fn in fns.items():
        if name == "pallas" and jax.default_backend() != "gpu":
            results[name] = {"skipped": "needs a GPU (tests run it in interpret mode)"}
            continue
        vg = value_and_grad(fn)
        one = jax.jit(vg)
        a, a2 = (jax.block_until_ready(one(taken, nxt, tz)) for _ in range(2))
        sec = seconds_per_call(vg, (taken, nxt, tz), reps)
        results[name] = {"us_fwd_bwd": round(1e6 * sec, 1),
                         "loss_rel_diff": float(abs(a[0] - ref[0]) / abs(ref[0])),
                         "grad_max_abs_diff": float(jnp.max(jnp.abs(a[1] - ref[1]))),
                         "bitwise_repeat": bool(jnp.array_equal(a[1], a2[1])
                                                and a[0] == a2[0])}
    return results


def bench_iqn(b: int, reps: int, dtype: str) -> dict:
    """The IQN dense stack (forward only, as the target network runs it) at the default model
    sizes: the plain-JAX stack vs the fused kernel over a few tile shapes."""
    from jdqn.networks.heads import iqn_features
    from jdqn.pallas import iqn as iqn_kernel

    q, h, m, f, o = 8, 256, 64, 128, 14
    k = jax.random.split(jax.random.key(0), 8)
    act = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    args = (jax.random.normal(k[0], (b, h)).astype(act), jax.random.uniform(k[1], (b, q)),
            jax.random.normal(k[2], (m, h)) / 8, jax.random.normal(k[3], (h,)) * 0.1,
            jax.random.normal(k[4], (h, f)) / 16, jax.random.normal(k[5], (f,)) * 0.1,
            jax.random.normal(k[6], (f, o)) / 11, jax.random.normal(k[7], (o,)) * 0.1)
    fns = {"xla_reference": lambda *a: iqn_features(*a, dtype)}
    if jax.default_backend() == "gpu":
        for rows, chunk, warps in [(64, 64, None), (32, 64, None), (128, 64, 8),
                                   (64, 128, 8), (32, 32, None)]:
            fns[f"pallas_r{rows}_c{chunk}_w{warps or 'def'}"] = functools.partial(
                lambda *a, r, c, w: iqn_kernel._forward(*a, dtype, False, r, c, w),
                r=rows, c=chunk, w=warps)
    ref = jax.jit(fns["xla_reference"])(*args)
    results = {}
    for name, fn in fns.items():
        try:
            one = jax.jit(fn)
            a1, a2 = (jax.block_until_ready(one(*args)) for _ in range(2))
            results[name] = {"us": round(1e6 * seconds_per_call(fn, args, reps), 1),
                             "max_abs_diff": float(jnp.max(jnp.abs(a1 - ref))),
                             "max_abs_ref": float(jnp.max(jnp.abs(ref))),
                             "bitwise_repeat": bool(jnp.array_equal(a1, a2))}
        except Exception as e:  # noqa: BLE001 — a tile shape Triton rejects is a result too
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(dtype, name, json.dumps(results[name]), file=sys.stderr, flush=True)
    return {"batch": b, "quantiles": q, "dtype": dtype, "results": results}


def bench_moe(b: int, reps: int, tiles: list[tuple[int, int, int, int]], k: int = 8,
              e: int = 64, h: int = 256) -> dict:
    """The MoE mixture (gate softmax + weighted expert output layer), forward + backward (all
    four gradients): the Pallas kernels (custom VJP) vs the layer's XLA path."""
    from jdqn.pallas.moe import moe_mixture_pallas, moe_mixture_reference

    ks = jax.random.split(jax.random.key(0), 5)
    args = (jax.random.normal(ks[0], (b, k)) * 2,
            jax.nn.relu(jax.random.normal(ks[1], (b, k, e))),
            jax.random.normal(ks[2], (k, e, h)) / np.sqrt(e),
            jax.random.normal(ks[3], (k, h)) * 0.1)
    ct = jax.random.normal(ks[4], (b, h))
    from jdqn.pallas import moe as moe_lib

    fns = {"xla_reference": moe_mixture_reference}
    for rows, hc, brows, warps in tiles:
        def fn(*a, rows=rows, hc=hc, brows=brows, warps=warps):
            old = moe_lib.ROWS, moe_lib.H_CHUNK, moe_lib.BWD_ROWS, moe_lib.NUM_WARPS
            (moe_lib.ROWS, moe_lib.H_CHUNK, moe_lib.BWD_ROWS, moe_lib.NUM_WARPS) = (
                rows, hc, brows, warps)
            try:  # the tile constants are read when the kernels are traced (under jit)
                return moe_mixture_pallas(*a, False)
            finally:
                moe_lib.ROWS, moe_lib.H_CHUNK, moe_lib.BWD_ROWS, moe_lib.NUM_WARPS = old
        fns[f"pallas_rows{rows}_h{hc}_bwd{brows}_w{warps}"] = fn

    def value_and_grad(fn):
        def loss(*a):
            out, gate = fn(*a)
            return jnp.sum(out * ct) + 0.1 * jnp.sum(jnp.square(jnp.mean(gate, 0)))
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))

    ref = jax.jit(value_and_grad(fns["xla_reference"]))(*args)
    results = {}
    for name, fn in fns.items():
        if name.startswith("pallas") and jax.default_backend() != "gpu":
            results[name] = {"skipped": "needs a GPU (tests run it in interpret mode)"}
            continue
        vg = value_and_grad(fn)
        one = jax.jit(vg)
        a, a2 = (jax.block_until_ready(one(*args)) for _ in range(2))
        sec = seconds_per_call(vg, args, reps)
        rel = [float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y))) for x, y in zip(a[1], ref[1])]
        results[name] = {"us_fwd_bwd": round(1e6 * sec, 1),
                         "loss_rel_diff": float(abs(a[0] - ref[0]) / abs(ref[0])),
                         "grad_max_rel_diff": dict(zip(("logits", "hidden", "w2", "b2"), rel)),
                         "bitwise_repeat": bool(a[0] == a2[0] and all(
                             jnp.array_equal(x, y) for x, y in zip(a[1], a2[1])))}
    return results


def bench_modulation(b: int, reps: int, tiles: list[tuple[int, int]], q: int = 8,
                     h: int = 256) -> dict:
    """The backward pass of the IQN τ modulation ``h ⊙ relu(pre + be)`` (what the update runs
    for the online network): XLA's autodiff of the reference vs the one-pass kernel, over tiles
    (samples per program, warps); the gradients' largest relative difference and a bitwise
    repeat. Each row times ``(dh, dpre, dbe)`` from a given cotangent."""
    from jdqn.pallas import modulation

    ks = jax.random.split(jax.random.key(0), 4)
    args = (jax.random.normal(ks[0], (b, h)), jax.random.normal(ks[1], (b, q, h)),
            jax.random.normal(ks[2], (h,)) * 0.1, jax.random.normal(ks[3], (b, q, h)))

    def xla(hh, pre, be, g):
        return jax.vjp(modulation.reference, hh, pre, be)[1](g)

    fns = {"xla_reference": xla}
    for rows, warps in tiles:
        def fn(hh, pre, be, g, rows=rows, warps=warps):
            old = modulation.ROWS, modulation.NUM_WARPS
            modulation.ROWS, modulation.NUM_WARPS = rows, warps
            try:  # the tile constants are read when the kernel is traced (under jit)
                return modulation.backward(g, hh, pre, be, False)
            finally:
                modulation.ROWS, modulation.NUM_WARPS = old
        fns[f"pallas_rows{rows}_w{warps}"] = fn
    ref = jax.jit(xla)(*args)

    def compare(a, a2):
        rel = [float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y))) for x, y in zip(a, ref)]
        return {"max_rel_diff": dict(zip(("dh", "dpre", "dbe"), rel)),
                "bitwise_repeat": all(bool(jnp.array_equal(x, y)) for x, y in zip(a, a2))}

    return {"quantiles": q, "width": h, "results": _time_tiles(fns, args, reps, compare)}


# --out: the file the record goes to, and the record's head (bench, kernel, device, …) that
# each partial rewrite carries; set by main().
_OUT: dict = {"path": None, "head": {}}


def _write_out(record: dict) -> None:
    if _OUT["path"]:
        Path(_OUT["path"]).write_text(json.dumps(record) + "\n")


def _emit(record: dict) -> None:
    """The finished record: printed (the last line of stdout) and, with ``--out``, written
    over the partial one, ``complete`` true."""
    record = {**record, "complete": True}
    print(json.dumps(record))
    _write_out(record)


def _time_tiles(fns: dict, args: tuple, reps: int, compare, interpret: bool = False) -> dict:
    """Per named function: µs per call (``seconds_per_call``) and what ``compare(a, a2)`` says
    of two runs' outputs; Pallas rows off the GPU are skipped unless they run in the
    interpreter (``interpret``), and a tile Triton rejects is recorded as its error. Each row is
    also printed to stderr as it completes and, with ``--out``, the file rewritten with the rows
    so far (``complete`` false): a setting that compiles or runs past a ``timeout`` leaves the
    rows before it in the file."""
    results = {}
    for name, fn in fns.items():
        if name.startswith("pallas") and jax.default_backend() != "gpu" and not interpret:
            results[name] = {"skipped": "needs a GPU (tests run it in interpret mode)"}
            continue
        try:
            one = jax.jit(fn)
            a, a2 = (jax.block_until_ready(one(*args)) for _ in range(2))
            results[name] = {"us": round(1e6 * seconds_per_call(fn, args, reps), 1),
                             **compare(a, a2)}
        except Exception as e:  # noqa: BLE001 — a tile Triton rejects is a result too
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(name, json.dumps(results[name]), file=sys.stderr, flush=True)
        _write_out({**_OUT["head"], "complete": False, "rows_so_far": results})
    return results


def bench_grn_tail(b: int, reps: int, tiles: list[tuple[int, int]], h: int = 256,
                   pair: int = 2, interpret: bool = False) -> dict:
    """A GRN block's tail where no gradient is taken (``jdqn.pallas.grn_tail``), at the shape
    of the update's paired online/target forward at s′ (``pair`` parameter sets vmapped over
    one batch of ``b`` rows, width ``h``): XLA's kernels for the reference against the Pallas
    kernel over tiles (rows per program, warps); the largest difference and a bitwise repeat.
    The timing loop perturbs the first argument per iteration, so the bias ``[pair, 2H]`` comes
    first here: perturbing the ``[pair, B, 2H]`` product instead would add a 67 MB pass to the
    kernel's time that XLA fuses into its own kernels (the first timings of 2026-12-02,
    ``kernels_h200_grn_tail.json``, carry it: 88–118 µs against 70 for XLA). ``interpret``:
    the kernel rows in Pallas' interpreter (off the GPU; for tests — the times mean nothing)."""
    from jdqn.pallas import grn_tail

    ks = jax.random.split(jax.random.key(0), 5)
    args = (jax.random.normal(ks[1], (pair, 2 * h)), jax.random.normal(ks[0], (pair, b, 2 * h)),
            jax.random.normal(ks[2], (pair, b, h)),
            1.0 + 0.1 * jax.random.normal(ks[3], (pair, h)),
            0.1 * jax.random.normal(ks[4], (pair, h)))

    def bias_first(fn):
        return jax.vmap(lambda bias, y, *rest: fn(y, bias, *rest))

    fns = {"xla_reference": bias_first(grn_tail.reference)}
    for rows, warps in tiles:
        fns[f"pallas_rows{rows}_w{warps}"] = bias_first(functools.partial(
            grn_tail.grn_tail, eps=grn_tail.EPSILON, interpret=interpret, rows=rows,
            warps=warps))
    ref = np.asarray(jax.jit(fns["xla_reference"])(*args))

    def compare(a, a2):
        a, a2 = np.asarray(a), np.asarray(a2)
        return {"max_abs_diff": float(np.max(np.abs(a - ref))),
                "bitwise_repeat": bool(np.array_equal(a, a2))}

    return {"width": h, "pair": pair, "interpret": interpret,
            "results": _time_tiles(fns, args, reps, compare, interpret)}


def bench_grn_tail_grad(b: int, reps: int, tiles: list[tuple[int, int]], h: int = 256,
                        interpret: bool = False) -> dict:
    """A GRN block's tail differentiated (the online forward at s, ``jdqn.pallas.grn_tail``'s
    backward kernel) at the update's shape: the gradients of ``Σ out · ct`` with respect to the
    product, its bias, the residual and the LayerNorm parameters, from the inputs and the
    output's cotangent — XLA's autodiff of the reference (its forward residuals included, as
    in the update) against the backward kernel over tiles (rows per program, warps); the
    largest relative difference per gradient and a bitwise repeat. The cotangent comes first
    (the timing loop perturbs the first argument: a ``[B, H]`` pass both sides pay).
    ``interpret``: the kernel rows in Pallas' interpreter (off the GPU; for tests)."""
    from jdqn.pallas import grn_tail

    ks = jax.random.split(jax.random.key(0), 6)
    args = (jax.random.normal(ks[5], (b, h)), jax.random.normal(ks[0], (b, 2 * h)),
            jax.random.normal(ks[1], (2 * h,)), jax.random.normal(ks[2], (b, h)),
            1.0 + 0.1 * jax.random.normal(ks[3], (h,)), 0.1 * jax.random.normal(ks[4], (h,)))

    def grads_of(fn):
        def grads(ct, *operands):
            return jax.vjp(fn, *operands)[1](ct)
        return grads

    fns = {"xla_reference": grads_of(grn_tail.reference)}
    for rows, warps in tiles:
        fns[f"pallas_rows{rows}_w{warps}"] = grads_of(functools.partial(
            grn_tail.grn_tail, eps=grn_tail.EPSILON, interpret=interpret,
            bwd_rows=rows, bwd_warps=warps))
    ref = [np.asarray(g) for g in jax.jit(fns["xla_reference"])(*args)]

    def compare(a, a2):
        rel = [float(np.max(np.abs(np.asarray(x) - y)) / np.max(np.abs(y)))
               for x, y in zip(a, ref)]
        return {"max_rel_diff": dict(zip(("dy", "db", "dx", "dscale", "doffset"), rel)),
                "bitwise_repeat": all(bool(np.array_equal(x, y)) for x, y in zip(a, a2))}

    return {"width": h, "interpret": interpret,
            "results": _time_tiles(fns, args, reps, compare, interpret)}


def bench_iqn_tail(b: int, reps: int, tiles: list[tuple[int, ...]], grad: bool, q: int = 8,
                   f: int = 128, o: int = 14, interpret: bool = False,
                   dtype: str = "float32") -> dict:
    """The IQN head's output stage (``jdqn.pallas.iqn_tail``) at the update's shape, rows
    ``b · q`` of ``f`` hidden features and ``o`` outputs. Forward (``grad=False``; tiles
    rows/warps): XLA's kernels for the reference against the kernel, the bias ``b1`` first
    (the timing loop perturbs the first argument). Backward (``grad=True``; tiles
    rows/steps/warps): the gradients of ``Σ out · ct`` for pre, b1, W2 and b2 — XLA's autodiff
    of the reference (its forward residuals included, as in the update) against the backward
    kernel — the cotangent first. The largest relative difference and a bitwise repeat.
    ``interpret``: the kernel rows in Pallas' interpreter (off the GPU; for tests).
    ``dtype``: ``pre``'s (``"bfloat16"``: the stage under bf16 matmuls, as the reference and
    the kernel compute it for a bf16 ``pre``)."""
    from jdqn.pallas import iqn_tail

    m = b * q
    ks = jax.random.split(jax.random.key(0), 5)
    pre = jax.random.normal(ks[0], (m, f)).astype(dtype)
    b1 = 0.1 * jax.random.normal(ks[1], (f,))
    w2 = jax.random.normal(ks[2], (f, o)) / np.sqrt(f)
    b2 = 0.1 * jax.random.normal(ks[3], (o,))
    if grad:
        args = (jax.random.normal(ks[4], (m, o)), pre, b1, w2, b2)

        def wrap(fn):
            return lambda ct, *operands: jax.vjp(fn, *operands)[1](ct)
        names = ("dpre", "db1", "dw2", "db2")
    else:
        args = (b1, pre, w2, b2)

        def wrap(fn):
            return lambda bias, p, *rest: (fn(p, bias, *rest),)
        names = ("out",)
    fns = {"xla_reference": wrap(iqn_tail.reference)}
    for tile in tiles:
        if grad:
            rows, steps, warps = tile
            kernel = functools.partial(iqn_tail.iqn_tail, interpret=interpret, bwd_rows=rows,
                                       bwd_steps=steps, bwd_warps=warps)
            fns[f"pallas_rows{rows}_steps{steps}_w{warps}"] = wrap(kernel)
        else:
            rows, warps = tile
            kernel = functools.partial(iqn_tail.iqn_tail, interpret=interpret, rows=rows,
                                       warps=warps)
            fns[f"pallas_rows{rows}_w{warps}"] = wrap(kernel)
    ref = [np.asarray(g) for g in jax.jit(fns["xla_reference"])(*args)]

    def compare(a, a2):
        rel = [float(np.max(np.abs(np.asarray(x, np.float32) - y.astype(np.float32)))
                     / np.max(np.abs(y.astype(np.float32)))) for x, y in zip(a, ref)]
        return {"max_rel_diff": dict(zip(names, rel)),
                "bitwise_repeat": all(bool(np.array_equal(x, y)) for x, y in zip(a, a2))}

    return {"rows": m, "hidden": f, "outputs": o, "dtype": dtype, "interpret": interpret,
            "results": _time_tiles(fns, args, reps, compare, interpret)}


def bench_moe_gate_grad(b: int, reps: int, tiles: list[tuple[int, int]], k: int = 8,
                        e: int = 64, interpret: bool = False) -> dict:
    """The MoE gated hidden layer's gradient (``jdqn.pallas.moe_gate``) at the update's shape:
    the gradients of ``Σ w · ct`` for ``w = g ⊗ relu(pre + b1)`` with respect to pre, b1 and
    the gate — XLA's autodiff of the reference (its forward residuals included, as in the
    update) against the backward kernel over tiles (rows per program / warps), the cotangent
    first; the largest relative difference and a bitwise repeat. ``interpret``: the kernel rows
    in Pallas' interpreter (off the GPU; for tests)."""
    from jdqn.pallas import moe_gate

    ks = jax.random.split(jax.random.key(0), 4)
    args = (jax.random.normal(ks[3], (b, k * e)), jax.random.normal(ks[0], (b, k * e)),
            0.1 * jax.random.normal(ks[1], (k * e,)),
            jax.nn.softmax(jax.random.normal(ks[2], (b, k)), axis=-1))

    def grads_of(fn):
        return lambda ct, *operands: jax.vjp(fn, *operands)[1](ct)

    fns = {"xla_reference": grads_of(moe_gate.reference)}
    for rows, warps in tiles:
        fns[f"pallas_rows{rows}_w{warps}"] = grads_of(functools.partial(
            moe_gate.gated_hidden, interpret=interpret, rows=rows, warps=warps))
    ref = [np.asarray(g) for g in jax.jit(fns["xla_reference"])(*args)]

    def compare(a, a2):
        rel = [float(np.max(np.abs(np.asarray(x) - y)) / np.max(np.abs(y)))
               for x, y in zip(a, ref)]
        return {"max_rel_diff": dict(zip(("dpre", "db1", "dgate"), rel)),
                "bitwise_repeat": all(bool(np.array_equal(x, y)) for x, y in zip(a, a2))}

    return {"experts": k, "expert_hidden": e, "interpret": interpret,
            "results": _time_tiles(fns, args, reps, compare, interpret)}


def bench_trunk_input(b: int, reps: int, tiles: list[tuple[int, int]], dtype: str,
                      pair: int = 1, w: int = 128, h: int = 256, g: int = 64, k: int = 8,
                      interpret: bool = False) -> dict:
    """The trunk's two grad-free readers of the observation (``jdqn.pallas.trunk_input``:
    variable selection + the input layer → h0, the MoE gate → logits and probabilities) at the
    update's shape: ``pair`` parameter sets vmapped over one shared ``obs [b, w]`` (1: the bf16
    forwards at s′, run apart; 2: the float32 twin pass), matmuls in ``dtype``. XLA's kernels for
    the oracles (the trunk's layers) against both kernels over tiles (rows per program / warps,
    the same for both); the largest differences and a bitwise repeat. The timing loop perturbs
    the first argument, the selection bias, so no ``[b, ·]`` pass is added to either side.
    ``interpret``: the kernel rows in Pallas' interpreter (off the GPU; for tests)."""
    from jdqn.pallas import trunk_input

    ks = jax.random.split(jax.random.key(0), 9)
    norm = lambda key, shape, n: jax.random.normal(key, (pair, *shape)) / np.sqrt(n)
    obs = jax.random.normal(ks[0], (b, w))
    params = (0.1 * jax.random.normal(ks[1], (pair, w)), norm(ks[2], (w, w), w),
              norm(ks[3], (w, h), w), 0.1 * jax.random.normal(ks[4], (pair, h)),
              norm(ks[5], (w, g), w), 0.1 * jax.random.normal(ks[6], (pair, g)),
              norm(ks[7], (g, k), g), 0.1 * jax.random.normal(ks[8], (pair, k)))

    def both(sel, gate):
        def one(sel_b, sel_w, proj_w, proj_b, w1, b1, w2, b2, obs):
            return (sel(obs, sel_w, sel_b, proj_w, proj_b), *gate(obs, w1, b1, w2, b2))
        return jax.vmap(one, in_axes=(0,) * 8 + (None,))

    fns = {"xla_reference": both(
        functools.partial(trunk_input.selection_input_reference, matmul_dtype=dtype),
        functools.partial(trunk_input.gate_reference, matmul_dtype=dtype))}
    for rows, warps in tiles:
        fns[f"pallas_rows{rows}_w{warps}"] = both(
            lambda *a, rows=rows, warps=warps: trunk_input.selection_input(
                *a, dtype, interpret, rows, warps),
            lambda *a, rows=rows, warps=warps: trunk_input.gate(*a, dtype, interpret, rows,
                                                                warps))
    args = (*params, obs)
    ref = [np.asarray(x.astype(jnp.float32)) for x in jax.jit(fns["xla_reference"])(*args)]

    def compare(a, a2):
        a = [np.asarray(x.astype(jnp.float32)) for x in a]
        diff = {n: float(np.max(np.abs(x - y))) for n, x, y in zip(("h0", "logits", "gate"),
                                                                    a, ref)}
        return {"max_abs_diff": diff,
                "h0_elements_differing": float(np.mean(a[0] != ref[0])),
                "bitwise_repeat": all(bool(np.array_equal(x, np.asarray(y.astype(jnp.float32))))
                                      for x, y in zip(a, a2))}

    return {"dtype": dtype, "pair": pair, "obs_width": w, "width": h, "gate_hidden": g,
            "experts": k, "interpret": interpret,
            "results": _time_tiles(fns, args, reps, compare, interpret)}


def bench_double_q(b: int, z: int, reps: int, tiles: list[tuple[int, int]],
                   sizes: tuple[int, ...] = (4, 3, 3, 3), interpret: bool = False) -> dict:
    """The double-Q selection at s′ (``jdqn.pallas.double_q``) at the update's shape: the
    paired online/target heads' output products (``[2, B, A_d·Zp]`` per branch, ``Zp`` = Z
    rounded up to a multiple of 4) → the online greedy action and the target's softmax there.
    XLA's kernels for the reference (the loss's path without the kernel: logits, expected Q,
    argmax, selection, softmax) against the Pallas kernel over tiles (rows per program, warps):
    the actions that differ from the reference's, the largest probability difference and a
    bitwise repeat. The value stream's bias comes first (the timing loop perturbs the first
    argument, and a small one adds no pass). ``interpret``: the kernel rows in Pallas'
    interpreter (off the GPU; for tests — the times mean nothing)."""
    from jdqn.networks.heads import ATOM_ALIGN, HeadStreams
    from jdqn.pallas import double_q

    zp = -(-z // ATOM_ALIGN) * ATOM_ALIGN
    ks = iter(jax.random.split(jax.random.key(0), 2 + 2 * len(sizes)))

    def normal(*shape):
        return jax.random.normal(next(ks), (2, *shape), jnp.float32)

    value_bias = normal(zp)
    streams = HeadStreams(normal(b, zp), value_bias, tuple(normal(b, a * zp) for a in sizes),
                          tuple(normal(a * zp) for a in sizes))

    def bias_first(fn):
        return lambda bias, s: fn(s._replace(value_bias=bias))

    fns = {"xla_reference": bias_first(lambda s: double_q.reference(s, None, z, -10.0, 10.0))}
    for rows, warps in tiles:
        fns[f"pallas_rows{rows}_w{warps}"] = bias_first(functools.partial(
            double_q.double_q_next, target=None, z=z, v_min=-10.0, v_max=10.0,
            interpret=interpret, rows=rows, num_warps=warps))
    ref_a, ref_p = (np.asarray(x) for x in jax.jit(fns["xla_reference"])(value_bias, streams))

    def compare(a, a2):
        return {"actions_differing": int(np.sum(np.asarray(a[0]) != ref_a)),
                "max_abs_diff": float(np.max(np.abs(np.asarray(a[1]) - ref_p))),
                "bitwise_repeat": all(bool(jnp.array_equal(x, y)) for x, y in zip(a, a2))}

    return {"branch_sizes": list(sizes), "pair": 2, "interpret": interpret,
            "results": _time_tiles(fns, (value_bias, streams), reps, compare, interpret)}


def bench_double_q_heads(b: int, reps: int, tiles: list[tuple[int, ...]], dtype: str,
                         interpret: bool = False, mgpu_stages: tuple[str, ...] = (),
                         head_hidden: int = 0) -> dict:
    """The C51 heads' output layers and the double-Q selection at s′ in one kernel
    (``jdqn.pallas.double_q_heads``) at the update's shape: the default model's heads (two
    initialisations: online and target, the output layers scaled ×4 so that the logits spread
    over a few units, as a trained head's do), their :class:`~jdqn.networks.heads.HeadInputs`
    at ``b`` rows of s′ under ``dtype`` matmuls → the online greedy action and the target's
    softmax there. Rows: the path the loss takes without the kernel (XLA's output GEMMs,
    ``expected_q_streams`` and the double-Q kernel, ``xla_products_double_q``) and the kernel
    over tiles (rows per program, warps, and with a third number the loop form's pipeline
    stages; without it each branch's actions unrolled): actions differing from the first
    row's, the largest probability difference, a bitwise repeat; then, per ring depth in
    ``mgpu_stages``, the Mosaic GPU kernel in ``dtype`` (``jdqn.pallas.double_q_heads_mgpu``,
    ``pallas_mgpu_s{k}``). ``pre`` comes first (the timing loop perturbs
    the first argument: an elementwise pass over it, in every row). ``interpret``: the kernel
    rows in Pallas' interpreter (off the GPU; for tests — the times mean nothing).
    ``head_hidden``: the dueling streams' width (0: the default model's)."""
    from jdqn.config import ModelConfig
    from jdqn.networks import BranchingQNetwork, init_params
    from jdqn.networks.heads import streams_from_inputs
    from jdqn.pallas import double_q, double_q_heads

    cfg = ModelConfig(matmul_dtype=dtype,
                      **({"head_hidden": head_hidden} if head_hidden else {}))
    width, flow_idx = 32, tuple(range(16, 24))  # the GPU configs' 24 features, 8 of order flow
    net = BranchingQNetwork(cfg, flow_idx=flow_idx)
    obs = jax.random.normal(jax.random.key(2), (b, width))
    inputs = []
    for seed in (0, 1):
        params = init_params(net, jax.random.key(seed), width)
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: x * 4.0 if "_out" in jax.tree_util.keystr(path) else x, params)
        inputs.append(jax.jit(lambda p, o: net.apply(p, o, grad_free=True,
                                                     head_streams="inputs").streams)(params,
                                                                                     obs))
    z, lo, hi = cfg.n_atoms, cfg.v_min, cfg.v_max
    pre_o = inputs[0].pre

    def pre_first(fn):
        return lambda pre, o, t: fn(o._replace(pre=pre), t)

    fns = {"xla_products_double_q": pre_first(lambda o, t: double_q.double_q_next(
        streams_from_inputs(o, z, lo, hi, interpret), streams_from_inputs(t, z, lo, hi,
                                                                          interpret),
        z, lo, hi, interpret))}
    for rows, warps, *stages in tiles:  # a third number: the loop form, pipelined that deep
        fns[f"pallas_rows{rows}_w{warps}" + "".join(f"_s{k}" for k in stages)] = pre_first(
            functools.partial(double_q_heads.double_q_heads, z=z, v_min=lo, v_max=hi,
                              interpret=interpret, rows=rows, num_warps=warps,
                              stages=stages[0] if stages else None))
    if mgpu_stages:
        from jdqn.pallas.double_q_heads_mgpu import double_q_heads_mgpu

        # "2": ring depth 2; "-2": each branch's actions unrolled; "w3": the wide layout
        # (compact=False: one CTA per SM); "g2": lowered under Mosaic GPU's warpgroup
        # semantics (layout inference) instead of the kernel's lane semantics; "2:mm_only": a
        # timing probe
        for spec in mgpu_stages:
            k, _, probe = str(spec).partition(":")
            flags = k[:len(k) - len(k.lstrip("wg"))]
            wide, warpgroup = "w" in flags, "g" in flags
            k = int(k.lstrip("wg"))
            name = f"pallas_mgpu_s{abs(k)}" + ("_unrolled" if k < 0 else "") + \
                ("_wide" if wide else "") + ("_warpgroup" if warpgroup else "") + \
                (f"_{probe}" if probe else "")
            fns[name] = pre_first(functools.partial(
                double_q_heads_mgpu, z=z, v_min=lo, v_max=hi, interpret=interpret,
                stages=abs(k), loop=k > 0, probe=probe, compact=not wide,
                semantics="warpgroup" if warpgroup else "lane"))
    ref_a, ref_p = (np.asarray(x) for x in jax.jit(fns["xla_products_double_q"])(
        pre_o, *inputs))

    def compare(a, a2):
        return {"actions_differing": int(np.sum(np.asarray(a[0]) != ref_a)),
                "max_abs_diff": float(np.max(np.abs(np.asarray(a[1]) - ref_p))),
                "bitwise_repeat": all(bool(jnp.array_equal(x, y)) for x, y in zip(a, a2))}

    return {"dtype": dtype, "branch_sizes": list(cfg.branch_sizes), "hidden": cfg.head_hidden,
            "flow_features": len(flow_idx), "interpret": interpret,
            "results": _time_tiles(fns, (pre_o, *inputs), reps, compare, interpret)}


# Bias-gradient reductions of the default model's update at B = 16384 (rows, columns): the
# variable selection, trunk width, GLU, experts' hidden layer, MoE gate, the heads' joint first
# layer and their output layers, and the IQN head's three dense layers over B·Q rows (the τ
# embedding's, [131072, 256], unless the modulation kernel reduces it).
REDUCE_SHAPES = ((16384, 128), (16384, 256), (16384, 512), (16384, 64), (16384, 8),
                 (16384, 640), (16384, 51), (16384, 204), (16384, 153), (131072, 256),
                 (131072, 128), (131072, 14))


def _bits(a: np.ndarray) -> np.ndarray:
    """The bit patterns of a float array (so ±0 and NaN payloads count as different)."""
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def bench_reduce(reps: int, tiles: list[tuple[int, int, int]], b: int = 16384,
                 dtype: str = "float32", interpret: bool = False) -> dict:
    """The deterministic tree sum (``jdqn.pallas.reduce``) against XLA's ``jnp.sum`` over the
    rows, at each bias gradient's shape of the default model's update (``REDUCE_SHAPES``, rows
    scaled by ``b / 16384``), over tiles (rows, cols, warps; the rows set the tree, so each rows
    value has its own reference), for float32 or bf16 inputs (bf16 cotangents, summed in
    float32). Per row: µs, the error against a float64 sum (relative to Σ|x|), whether the
    kernel is bitwise (bit patterns) its plain-JAX reference run by XLA on the same device, and
    bitwise repeatable. Both read a materialised input (an optimisation barrier, as a cotangent
    the matmuls also read is in the update). ``interpret``: run the kernel rows in Pallas'
    interpreter (off the GPU; for tests — the times then mean nothing)."""
    from jdqn.pallas import reduce

    results = {}
    for m, n in REDUCE_SHAPES:
        m = max(1, m * b // 16384)
        x = (jax.random.normal(jax.random.key(m + n), (m, n)) * jnp.exp(
            jax.random.uniform(jax.random.key(n), (m, n), minval=-4, maxval=4))).astype(dtype)
        x64 = np.asarray(x.astype(jnp.float32), np.float64)
        exact, scale = x64.sum(0), np.abs(x64).sum(0)
        fns = {"xla_sum": lambda a: jnp.sum(jax.lax.optimization_barrier(a), axis=0)}
        refs = {}
        for rows, cols, warps in tiles:
            fns[f"pallas_r{rows}_c{cols}_w{warps}"] = (
                lambda a, rows=rows, cols=cols, warps=warps: reduce.tree_sum(
                    jax.lax.optimization_barrier(a), interpret, rows=rows, cols=cols,
                    num_warps=warps))
            refs[rows] = np.asarray(jax.jit(lambda a, rows=rows: reduce.tree_sum_reference(
                a, rows))(x))
        row = {}
        for name, fn in fns.items():
            if (name.startswith("pallas") and jax.default_backend() != "gpu"
                    and not interpret):
                row[name] = {"skipped": "needs a GPU (tests run it in interpret mode)"}
                continue
            try:
                one = jax.jit(fn)
                a, a2 = (np.asarray(jax.block_until_ready(one(x))) for _ in range(2))
                r = {"us": round(1e6 * seconds_per_call(fn, (x,), reps), 1),
                     "max_err_over_abs_sum": float(np.max(np.abs(a - exact) / scale)),
                     "bitwise_repeat": bool(np.array_equal(_bits(a), _bits(a2)))}
                if name.startswith("pallas"):
                    rows = int(name.split("_r")[1].split("_")[0])
                    r["bitwise_reference"] = bool(np.array_equal(_bits(a), _bits(refs[rows])))
                row[name] = r
            except Exception as e:  # noqa: BLE001 — a tile Triton rejects is a result too
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{m}x{n}", name, json.dumps(row[name]), file=sys.stderr, flush=True)
        results[f"{m}x{n}"] = row
    return results


def _tiles(spec: str) -> list[tuple[int, ...]]:
    """A tile list option (``"64/4,32/2"``; ``""``: none) as tuples of ints."""
    return [tuple(int(v) for v in t.split("/")) for t in spec.split(",") if t.strip()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=("c51_projection", "c51_loss", "iqn", "moe",
                                         "modulation", "reduce", "grn_tail", "grn_tail_grad",
                                         "double_q", "iqn_tail", "iqn_tail_grad",
                                         "moe_gate_grad", "trunk_input", "double_q_heads"),
                    default="c51_projection")
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--branches", type=int, default=4)
    ap.add_argument("--atoms", type=int, default=51)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--moe-tiles", default="64/64/32/4",
                    help="MoE kernel tiles to time: rows/h_chunk/bwd_rows/num_warps, comma-separated")
    ap.add_argument("--modulation-tiles", default="4/4,8/8,2/4,8/4,16/8",
                    help="modulation kernel tiles to time: rows/num_warps, comma-separated")
    ap.add_argument("--reduce-tiles", default="32/128/4,32/256/4,16/128/4,64/128/8",
                    help="tree-sum tiles to time: rows/cols/num_warps, comma-separated")
    ap.add_argument("--grn-tiles", default="4/1,2/1,8/1,8/2,16/4,32/4",
                    help="GRN tail kernel tiles to time: rows/num_warps, comma-separated")
    ap.add_argument("--grn-grad-tiles", default="8/4,8/2,4/2,16/4,16/8",
                    help="GRN tail backward kernel tiles to time: rows/num_warps, comma-separated")
    ap.add_argument("--iqn-tail-tiles", default="64/4,64/2,128/4,128/8,32/2",
                    help="IQN output-stage kernel tiles to time: rows/num_warps, comma-separated")
    ap.add_argument("--iqn-tail-grad-tiles", default="32/4/4,32/2/4,32/8/4,16/8/4,64/4/4",
                    help="IQN output-stage backward kernel tiles to time: "
                         "rows/steps/num_warps, comma-separated")
    ap.add_argument("--moe-gate-tiles", default="16/4,8/4,32/4,16/8,8/2",
                    help="MoE gated-hidden backward kernel tiles to time: rows/num_warps, "
                         "comma-separated")
    ap.add_argument("--double-q-tiles", default="16/4,32/4,8/2,4/1,64/4",
                    help="double-Q kernel tiles to time: rows/num_warps, comma-separated")
    ap.add_argument("--double-q-heads-mgpu", default="",
                    help="double_q_heads: ring depths of the Mosaic GPU kernel to time as well "
                         "(comma-separated, in --dtype; Hopper); a negative depth: that depth "
                         "with each branch's actions unrolled instead of a loop (pass it as "
                         "--double-q-heads-mgpu=-3); a leading w: the "
                         "wide shared-memory layout (one CTA per SM); a leading g: lowered "
                         "under Mosaic GPU's warpgroup semantics (its layout inference) "
                         "instead of the kernel's lane semantics; DEPTH:PROBE a timing "
                         "probe (mm_only: no max/exp passes, wrong values)")
    ap.add_argument("--double-q-heads-tiles", default="64/4,64/4/2,64/4/3,32/4/2",
                    help="fused heads + double-Q kernel tiles to time: rows/num_warps "
                         "(actions unrolled) or rows/num_warps/stages (the loop form, "
                         "pipelined), comma-separated")
    ap.add_argument("--head-hidden", type=int, default=0,
                    help="double_q_heads: the dueling streams' width (0: the default model's)")
    ap.add_argument("--trunk-input-tiles", default="64/4,32/4,128/4,64/8,128/8",
                    help="trunk input kernels' tiles to time: rows/num_warps, comma-separated")
    ap.add_argument("--pair", type=int, default=1,
                    help="--kernel trunk_input: parameter sets vmapped over one obs (2: the "
                         "float32 twin forward at s′)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="--kernel reduce: the summed array's dtype; --kernel iqn_tail(_grad): "
                         "the hidden layer's pre-activation's (bf16 matmuls); --kernel "
                         "trunk_input / double_q_heads: the matmuls'")
    ap.add_argument("--interpret", action="store_true",
                    help="--kernel reduce / grn_tail(_grad) / double_q(_heads) / "
                         "iqn_tail(_grad) / moe_gate_grad / trunk_input: run the kernel in "
                         "Pallas' interpreter "
                         "(tests)")
    ap.add_argument("--out", type=Path, default=None,
                    help="also write the record to this file, rewritten after every timed "
                         "setting while the script runs (\"complete\": false, the rows so "
                         "far), so a run cut short keeps what it measured")
    args = ap.parse_args(argv)
    if args.out is not None and not args.out.parent.is_dir():
        ap.error(f"--out {args.out}: its folder {args.out.parent} does not exist")
    b, d, z, v_min, v_max = args.batch, args.branches, args.atoms, -25.0, 25.0
    dev = jax.devices()[0]
    meta = {"batch": b, "branches": d, "atoms": z,
            "device": getattr(dev, "device_kind", str(dev)), "jax": jax.__version__,
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
    _OUT.update(path=args.out, head={"bench": "kernels", "kernel": args.kernel, **meta})
    if args.kernel == "iqn":
        _emit({"bench": "kernels", "kernel": "iqn",
               "float32": bench_iqn(b, args.reps, "float32"),
               "bfloat16": bench_iqn(b, args.reps, "bfloat16"), **meta})
        return
    if args.kernel == "moe":
        _emit({"bench": "kernels", "kernel": "moe",
               "results": bench_moe(b, args.reps, _tiles(args.moe_tiles)), **meta})
        return
    if args.kernel == "modulation":
        _emit({"bench": "kernels", "kernel": "modulation",
               **bench_modulation(b, args.reps, _tiles(args.modulation_tiles)),
               **meta})
        return
    if args.kernel == "grn_tail":
        _emit({"bench": "kernels", "kernel": "grn_tail",
               **bench_grn_tail(b, args.reps, _tiles(args.grn_tiles),
                                interpret=args.interpret),
               **meta})
        return
    if args.kernel == "grn_tail_grad":
        _emit({"bench": "kernels", "kernel": "grn_tail_grad",
               **bench_grn_tail_grad(b, args.reps, _tiles(args.grn_grad_tiles),
                                     interpret=args.interpret),
               **meta})
        return
    if args.kernel in ("iqn_tail", "iqn_tail_grad"):
        grad = args.kernel == "iqn_tail_grad"
        tiles = args.iqn_tail_grad_tiles if grad else args.iqn_tail_tiles
        _emit({"bench": "kernels", "kernel": args.kernel,
               **bench_iqn_tail(b, args.reps, _tiles(tiles), grad,
                                interpret=args.interpret, dtype=args.dtype),
               **meta})
        return
    if args.kernel == "moe_gate_grad":
        _emit({"bench": "kernels", "kernel": "moe_gate_grad",
               **bench_moe_gate_grad(b, args.reps, _tiles(args.moe_gate_tiles),
                                     interpret=args.interpret),
               **meta})
        return
    if args.kernel == "trunk_input":
        _emit({"bench": "kernels", "kernel": "trunk_input",
               **bench_trunk_input(b, args.reps, _tiles(args.trunk_input_tiles),
                                   args.dtype, args.pair,
                                   interpret=args.interpret), **meta})
        return
    if args.kernel == "double_q_heads":
        _emit({"bench": "kernels", "kernel": "double_q_heads",
               **bench_double_q_heads(b, args.reps,
                                      _tiles(args.double_q_heads_tiles), args.dtype,
                                      interpret=args.interpret, head_hidden=args.head_hidden,
                                      mgpu_stages=tuple(k.strip() for k in
                                                        args.double_q_heads_mgpu.split(",")
                                                        if k.strip())), **meta})
        return
    if args.kernel == "double_q":
        _emit({"bench": "kernels", "kernel": "double_q",
               **bench_double_q(b, z, args.reps, _tiles(args.double_q_tiles),
                                interpret=args.interpret), **meta})
        return
    if args.kernel == "reduce":
        _emit({"bench": "kernels", "kernel": "reduce",
               "dtype": args.dtype, "interpret": args.interpret,
               "results": bench_reduce(args.reps, _tiles(args.reduce_tiles), b,
                                       args.dtype, args.interpret), **meta})
        return
    if args.kernel == "c51_loss":
        _emit({"bench": "kernels", "kernel": "c51_loss",
               "results": bench_c51_loss(b, d, z, args.reps), **meta})
        return
    k = jax.random.split(jax.random.key(0), 3)
    tz = (jax.random.normal(k[0], (b, 1)) * 10
          + jax.random.uniform(k[1], (b, 1)) * jnp.linspace(v_min, v_max, z))
    probs = jax.nn.softmax(jax.random.normal(k[2], (b, d, z)) * 2, -1)
    ref = np.asarray(jax.jit(project_uniform, static_argnums=(2, 3))(tz, probs, v_min, v_max))
    results = {}
    for name, fn in VARIANTS.items():
        if name.startswith("pallas") and jax.default_backend() != "gpu":
            results[name] = {"skipped": "needs a GPU (tests run it in interpret mode)"}
            continue
        f = jax.jit(lambda t, p, fn=fn: fn(t, p, v_min, v_max))
        a, a2 = (np.asarray(jax.block_until_ready(f(tz, probs))) for _ in range(2))
        sec = seconds_per_call(lambda t, p, fn=fn: fn(t, p, v_min, v_max), (tz, probs), args.reps)
        results[name] = {"us": round(1e6 * sec, 1),
                         "max_abs_diff_vs_reference": float(np.max(np.abs(a - ref))),
                         "bitwise_repeat": bool(np.array_equal(a, a2))}
    _emit({"bench": "kernels", "kernel": "c51_projection", "results": results,
           **meta})


if __name__ == "__main__":
    main()
