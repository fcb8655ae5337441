"""The deterministic tree-reduction kernel (SPEC §8, kernel 3; jdqn/pallas/reduce.py), in
Pallas' interpreter: bitwise equal to its plain-JAX oracle, in the documented order, accurate,
and, as the bias gradient of every dense layer under ``impl = "pallas"``, the same gradient."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import x64

from jdqn.config import ModelConfig
from jdqn.networks import trunk
from jdqn.networks.model import BranchingQNetwork, init_params
from jdqn.pallas import reduce


def _bits(a) -> np.ndarray:
    """Bit patterns, so the comparisons tell +0 from −0."""
    a = np.asarray(a)
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


SHAPES = [(1, 3), (2, 1), (3, 5), (31, 7), (32, 256), (33, 257), (1000, 51), (2049, 204),
          (77, 640)]


def _x(m, n, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    # mixed magnitudes, so different summation orders round differently
    x = rng.standard_normal((m, n)) * np.exp(rng.uniform(-6, 6, (m, n)))
    return jnp.asarray(x.astype(dtype))


@pytest.mark.parametrize("m,n", SHAPES)
def test_kernel_is_bitwise_its_reference_and_close_to_the_exact_sum(m, n):
    x = _x(m, n, seed=m * 1000 + n)
    got = reduce.tree_sum(x, interpret=True)
    want = reduce.tree_sum_reference(x)
    assert got.shape == (n,) and got.dtype == jnp.float32
    np.testing.assert_array_equal(_bits(got), _bits(want))
    exact = np.sum(np.asarray(x, np.float64), axis=0)
    # a pairwise sum: error ≲ depth · eps · Σ|x|
    bound = (np.ceil(np.log2(max(m, 2))) + 1) * 2**-23 * np.sum(np.abs(np.asarray(x, np.float64)),
                                                                 axis=0)
    assert np.all(np.abs(np.asarray(got, np.float64) - exact) <= bound)


@pytest.mark.parametrize("rows,cols", [(2, 1), (4, 8), (8, 64), (64, 128)])
def test_tiling_never_changes_the_result_and_rows_set_the_order(rows, cols):
    x = _x(300, 70, seed=rows + cols)
    base = _bits(reduce.tree_sum(x, interpret=True, rows=rows))
    np.testing.assert_array_equal(
        _bits(reduce.tree_sum(x, interpret=True, rows=rows, cols=cols)), base)
    np.testing.assert_array_equal(_bits(reduce.tree_sum_reference(x, rows=rows)), base)


def test_the_order_is_the_documented_halving_tree():
    # Rows 0 and 2 cancel exactly, rows 1 and 3 add: the tree (x0 + x2) + (x1 + x3) gives 2.
    # A running sum gives ((1e8 + 1) − 1e8) + 1 = 1 (1e8 + 1 rounds to 1e8 in float32), and
    # pairing neighbours, (x0 + x1) + (x2 + x3), gives 0.
    x = jnp.asarray([[1e8], [1.0], [-1e8], [1.0]], jnp.float32)
    assert float(reduce.tree_sum(x, interpret=True, rows=4)[0]) == 2.0
    assert float(reduce.tree_sum_reference(x, rows=4)[0]) == 2.0
    # rows = 2 makes two levels: (x0 + x1), (x2 + x3), then their sum: 1e8 + (1 − 1e8) = 0
    assert float(reduce.tree_sum(x, interpret=True, rows=2)[0]) == 0.0
    # Two levels against one: with rows = 4, blocks (1e8 + 1) + (1 + 1) → 1e8 and
    # (−1e8 + 0) + (0 + 0), then their sum, 0; with rows = 8, one block: (1e8 − 1e8) + (1 + 0)
    # + (1 + 0) + (1 + 0) in halving order, 3.
    y = jnp.asarray([[1e8], [1.0], [1.0], [1.0], [-1e8], [0.0], [0.0], [0.0]], jnp.float32)
    for rows, want in ((4, 0.0), (8, 3.0)):
        assert float(reduce.tree_sum(y, interpret=True, rows=rows)[0]) == want
        assert float(reduce.tree_sum_reference(y, rows=rows)[0]) == want
    # a partial last block is completed with zero rows: 5 rows, rows = 4 → blocks
    # [1e8, 1, -1e8, 1] (sum 2) and [3, 0, 0, 0] (sum 3)
    z = jnp.asarray([[1e8], [1.0], [-1e8], [1.0], [3.0]], jnp.float32)
    assert float(reduce.tree_sum(z, interpret=True, rows=4)[0]) == 5.0


def test_the_same_under_jit_and_vmap_and_for_other_dtypes():
    x = _x(513, 33, seed=5)
    f = jax.jit(lambda a: reduce.tree_sum(a, interpret=True))
    np.testing.assert_array_equal(_bits(f(x)), _bits(reduce.tree_sum_reference(x)))
    xs = jnp.stack([x, 2 * x, -x])
    got = jax.vmap(lambda a: reduce.tree_sum(a, interpret=True))(xs)
    for i in range(3):
        np.testing.assert_array_equal(_bits(got[i]), _bits(reduce.tree_sum_reference(xs[i])))
    xb = x.astype(jnp.bfloat16)  # summed in float32
    out = reduce.tree_sum(xb, interpret=True)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(_bits(out), _bits(reduce.tree_sum_reference(xb)))
    with x64():
        xd = jnp.asarray(np.asarray(x, np.float64))
        out = reduce.tree_sum(xd, interpret=True)
        assert out.dtype == jnp.float64
        np.testing.assert_array_equal(_bits(out), _bits(reduce.tree_sum_reference(xd)))


def test_tree_sum_is_differentiable_in_reverse_mode():
    x = _x(70, 9, seed=3)
    w = jnp.arange(9.0)
    g = jax.grad(lambda a: jnp.sum(w * reduce.tree_sum(a, interpret=True)))(x)
    np.testing.assert_array_equal(g, jnp.broadcast_to(w, x.shape))
    # a gradient of a gradient through the tree-sum bias add
    y, bias = _x(6, 4, seed=4), jnp.ones(4)

    def inner(b):
        return jnp.sum(jnp.sin(reduce.add_bias(y, b, True)))

    outer = jax.grad(lambda b: jnp.sum(jax.grad(inner)(b) ** 2))(bias)
    want = jax.grad(lambda b: jnp.sum(jax.grad(
        lambda c: jnp.sum(jnp.sin(trunk.add_bias(y, c))))(b) ** 2))(bias)
    np.testing.assert_allclose(outer, want, rtol=1e-5, atol=1e-5)


def test_empty_and_bad_inputs():
    for shape, n in (((0, 4), 4), ((5, 0), 0)):
        out = reduce.tree_sum(jnp.zeros(shape), interpret=True)
        assert out.shape == (n,) and out.dtype == jnp.float32 and not np.any(out)
        np.testing.assert_array_equal(out, reduce.tree_sum_reference(jnp.zeros(shape)))
    with pytest.raises(ValueError, match="trailing axes"):
        reduce.add_bias(jnp.zeros((4, 1)), jnp.zeros(3), True)
    with pytest.raises(ValueError, match="2-D"):
        reduce.tree_sum(jnp.zeros(5), interpret=True)
    with pytest.raises(ValueError, match="float"):
        reduce.tree_sum(jnp.zeros((5, 2), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        reduce.tree_sum(jnp.zeros((5, 2)), interpret=True, rows=6)
    with pytest.raises(ValueError, match="power of two"):
        reduce.tree_sum(jnp.zeros((5, 2)), interpret=True, cols=3)


@pytest.mark.parametrize("y_shape,b_shape,dtype", [((37, 24), (24,), jnp.float32),
                                                   ((9, 4, 16), (16,), jnp.float32),
                                                   ((11, 3, 5), (3, 5), jnp.float32),
                                                   ((37, 24), (24,), jnp.bfloat16)])
def test_add_bias_values_are_bitwise_and_its_gradient_is_the_tree_sum(y_shape, b_shape, dtype):
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    y = jax.random.normal(k1, y_shape).astype(dtype)
    bias = jax.random.normal(k2, b_shape)
    g = jax.random.normal(k3, y_shape).astype(dtype)

    def run(fn):
        out, vjp = jax.vjp(fn, y, bias)
        return out, *vjp(g)

    out_k, dy_k, db_k = run(lambda a, b: reduce.add_bias(a, b, True))
    out_x, dy_x, db_x = run(trunk.add_bias)
    np.testing.assert_array_equal(_bits(out_k.astype(jnp.float32)),
                                  _bits(out_x.astype(jnp.float32)))
    np.testing.assert_array_equal(dy_k, dy_x)
    assert db_k.dtype == bias.dtype == db_x.dtype
    flat = g.astype(jnp.float32).reshape(-1, int(np.prod(b_shape)))
    np.testing.assert_array_equal(_bits(db_k),
                                  _bits(reduce.tree_sum_reference(flat).reshape(b_shape)))
    np.testing.assert_allclose(db_k, db_x, rtol=1e-5, atol=1e-5)
    # the dispatch: impl = "pallas" takes the kernel, "xla" the plain add
    np.testing.assert_array_equal(trunk.add_bias(y, bias, "pallas"), out_x)
    _, vjp = jax.vjp(lambda a, b: trunk.add_bias(a, b, "pallas"), y, bias)
    np.testing.assert_array_equal(vjp(g)[1], db_k)


def test_every_bias_gradient_of_the_network_takes_the_tree_sum_under_pallas(monkeypatch):
    """Under impl = "pallas" each dense layer's bias gradient is the tree sum (counted: one
    per bias, trunk, heads and IQN head), and the gradients match the XLA network's."""
    cfg = ModelConfig(width=16, n_grn_blocks=1, n_experts=2, expert_hidden=4, gate_hidden=4,
                      head_hidden=8, n_atoms=5, v_min=-2.0, v_max=2.0, iqn=True, iqn_embed=4,
                      iqn_n=2, iqn_n_prime=2)
    obs = jax.random.normal(jax.random.key(2), (6, 12))
    taus = jax.random.uniform(jax.random.key(3), (6, 2))
    calls = []
    real = reduce.sum_leading
    monkeypatch.setattr(reduce, "sum_leading", lambda g, n, i=False: calls.append(g.shape)
                        or real(g, n, i))
    grads = {}
    for impl in ("xla", "pallas"):
        net = BranchingQNetwork(dataclasses.replace(cfg, impl=impl), (2, 5))
        params = init_params(net, jax.random.key(4), 12)

        def loss(p, net=net):
            out = net.apply(p, obs, taus)
            return (sum(jnp.sum(jnp.sin(lg)) for lg in out.logits)
                    + sum(jnp.sum(jnp.cos(q)) for q in out.quantiles))

        grads[impl] = jax.jit(jax.grad(loss))(params)
    biases = [jax.tree_util.keystr(path) for path, _ in
              jax.tree_util.tree_leaves_with_path(grads["xla"]) if path[-1].key == "bias"]
    assert len(biases) == 23
    # Every dense bias is one tree sum, except: LayerNorm's (not a dense layer), the MoE's
    # output bias (a gate-weighted sum: a matmul), the τ embedding's (the modulation kernel
    # reduces it), the C51 heads' five first-layer biases, which are one add (one matmul),
    # the GRN block's `fc` bias, folded into its `glu` layer's (its gradient a small product),
    # and that folded `glu` bias, whose gradient the GRN tail's backward kernel sums.
    assert len(calls) == 23 - 1 - 1 - 1 - 4 - 1 - 1
    assert (6, 5 * 8) in calls  # the heads' first layer
    assert (6, 2, 4) in calls  # the experts' hidden layer: a [K, E] bias
    for a, b in zip(jax.tree.leaves(grads["pallas"]), jax.tree.leaves(grads["xla"]),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
