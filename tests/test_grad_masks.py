"""Gradients through masked infinities: where a value is -inf (a pruned sum weight, a category of probability 0, an
impossible sample, a padding row) and the result masks it, ``jax.grad`` is finite and equals float64 central
differences (``0 * inf`` never reaches a derivative), and the values are unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc import Options, distributions
from jaxpc.ops import logspace


def _circuit():
    def mix():
        a = jaxpc.inputs(0, 2, 2, distributions.Categorical(3))
        b = jaxpc.inputs(1, 2, 2, distributions.Categorical(3))
        return jaxpc.summate(jaxpc.multiply(a, b), num_node_blocks=1, block_size=2)

    return jaxpc.compile(jaxpc.summate(mix(), mix(), num_node_blocks=1, block_size=1), seed=0, dtype=jnp.float64)


@pytest.fixture(scope="module")
def model():
    """A float64 circuit whose value 2 has probability 0 in every leaf and whose first sum edge is pruned (log-weight
    -inf), with a batch holding an impossible row (row 1 observes value 2) and missing values."""
    with jax.enable_x64(True):
        c = _circuit()
        p = c.params
        lp = p["input"]["categorical"]["log_probs"].at[:, 2].set(-jnp.inf)
        lp = lp - jax.nn.logsumexp(lp, axis=1, keepdims=True)
        sums = dict(p["sum"])
        k = sorted(sums)[0]
        sums[k] = sums[k].at[(0,) * sums[k].ndim].set(-jnp.inf)
        p = {"input": {"categorical": {"log_probs": lp}}, "sum": sums}
        x = np.array([[0, 1], [2, 0], [1, 1], [1, 0]], np.int32)
        miss = np.array([[False, False], [False, True], [True, False], [True, True]])
        yield c, p, x, miss


def _finite_sum(tree):
    """A weighted sum of the finite entries of ``tree`` (the -inf and NaN ones masked out)."""
    leaves = jax.tree_util.tree_leaves(tree)
    return sum(0.37 * (i + 1) * jnp.sum(jnp.where(jnp.isfinite(a), a, 0.0)) for i, a in enumerate(leaves))


def _check_central(f, params, rng, per_leaf=3, h=1e-6, value_and_grad=None):
    """``jax.grad(f)`` is finite everywhere and equals central differences at ``per_leaf`` random finite entries of
    each leaf of ``params``. ``value_and_grad``: ``jax.value_and_grad(f)`` where the caller has it jitted."""
    # one jitted program for the values and the gradient (op by op, every operation would compile)
    value_and_grad = value_and_grad or jax.jit(jax.value_and_grad(f))
    grads = jax.tree_util.tree_leaves(value_and_grad(params)[1])
    leaves, tdef = jax.tree_util.tree_flatten(params)
    for i, leaf in enumerate(leaves):
        leaf = np.asarray(leaf)
        assert np.all(np.isfinite(np.asarray(grads[i]))), f"non-finite gradient in leaf {i}: {grads[i]}"
        finite = np.argwhere(np.isfinite(leaf))
        for idx in finite[rng.choice(len(finite), size=min(per_leaf, len(finite)), replace=False)]:
            idx = tuple(idx)

            def at(d, i=i, idx=idx):
                moved = [np.array(a) for a in leaves]
                moved[i][idx] += d
                return float(value_and_grad(jax.tree_util.tree_unflatten(tdef, [jnp.asarray(a) for a in moved]))[0])

            fd = (at(h) - at(-h)) / (2 * h)
            assert float(np.asarray(grads[i])[idx]) == pytest.approx(fd, rel=1e-5, abs=1e-7), (i, idx)


@pytest.mark.slow  # compiles several float64 executables and their gradients
def test_em_step_without_pseudocount_has_finite_gradients_through_its_zero_parameters(model):
    """A pruned edge (and a category without counts) stays at log-parameter -inf under EM without pseudocount; the
    gradient of the finite new parameters equals central differences."""
    c, p, x, miss = model
    with jax.enable_x64(True):
        new = c.em_step(p, x[[0, 2, 3]], miss[[0, 2, 3]], step_size=0.5, pseudocount=0.0)
        assert np.isneginf(np.asarray(new["input"]["categorical"]["log_probs"][:, 2])).all()
        assert np.isneginf(np.asarray(jax.tree_util.tree_leaves(new["sum"])[0])).any()
        _check_central(lambda q: _finite_sum(c.em_step(q, x[[0, 2, 3]], miss[[0, 2, 3]], step_size=0.5,
                                                       pseudocount=0.0)), p, np.random.default_rng(0))


@pytest.mark.slow  # compiles several float64 executables and their gradients
def test_anemone_update_has_finite_gradients_through_its_zero_parameters(model):
    c, p, x, miss = model
    with jax.enable_x64(True):
        def f(q):
            fl = c.flows(q, x[[0, 2, 3]], miss[[0, 2, 3]])
            return _finite_sum(jaxpc.optim.anemone_update(c.layout, c.tables, q, fl, 0.5, 0.0, 3.0))

        _check_central(f, p, np.random.default_rng(1))


@pytest.mark.slow  # compiles several float64 executables and their gradients
def test_mean_nll_gradient_by_the_zero_weight_of_an_impossible_row_is_finite(model):
    """A padding row (weight 0) whose log-likelihood is -inf adds nothing to ``mean_nll`` nor to its gradient by
    the weights: the other weights' derivatives equal central differences, the padding row's is finite. A possible
    row of weight 0 (row 2) has the derivative of its weight, not 0."""
    c, p, x, miss = model
    with jax.enable_x64(True):
        w = jnp.array([1.0, 0.0, 0.0, 0.5])
        opts = Options.make(None)
        assert np.isneginf(float(c.log_prob(p, x, miss)[1]))

        def loss(q, ww):
            return jaxpc.optim.mean_nll(c.layout, c.tables, q, x, miss, ww, opts, normalize=False)[0]

        # the loss and its gradients by both arguments: one jitted program (op by op, every operation would compile)
        value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        ref = -(w @ jnp.where(w == 0, 0.0, c.log_prob(p, x, miss))) / jnp.sum(w)
        value, (_, gw) = value_and_grad(p, w)
        assert float(value) == float(ref)
        gw = np.asarray(gw)
        assert np.all(np.isfinite(gw)), gw
        for b in (0, 2, 3):
            e = jnp.zeros(4).at[b].set(1e-6)
            fd = (float(value_and_grad(p, w + e)[0]) - float(value_and_grad(p, w - e)[0])) / 2e-6
            assert gw[b] == pytest.approx(fd, rel=1e-6)
        _check_central(lambda q: loss(q, w), p, np.random.default_rng(2),
                       value_and_grad=lambda q: (lambda v, g: (v, g[0]))(*value_and_grad(q, w)))


@pytest.mark.slow  # compiles several float64 executables and their gradients
@pytest.mark.full  # (in CI: test_logflows_edges.py's log-flow derivatives)
def test_logspace_flows_have_finite_gradients_with_pruned_edges_and_impossible_rows(model):
    """Log-space flows (also the node totals) of a pruned edge and of a category of probability 0 are -inf; the
    gradient of the finite ones equals central differences."""
    c, p, x, miss = model
    with jax.enable_x64(True):
        opts = Options(logspace_flows=True, node_flows=True)
        _check_central(lambda q: _finite_sum(c.flows(q, x, miss, options=opts)), p, np.random.default_rng(3))


@pytest.mark.slow  # compiles several float64 executables and their gradients
def test_conditional_gradient_is_finite_where_the_nan_of_an_impossible_row_is_masked(model):
    c, p, x, miss = model
    with jax.enable_x64(True):
        out = np.asarray(c.conditional(p, x, miss))
        assert np.isnan(out[1, 1]).all() and np.isfinite(np.delete(out, 1, axis=0)).all()
        _check_central(lambda q: _finite_sum(c.conditional(q, x, miss)[:, :, :2] * jnp.arange(1.0, 5.0)[:, None, None]),
                       p, np.random.default_rng(4))


def test_logspace_helpers_keep_values_and_give_zero_derivatives_to_empty_sums():
    """``logsumexp`` equals ``jax.nn.logsumexp`` (bit for bit, -inf where every term is -inf) and
    ``segment_logsumexp`` is -inf on an empty segment; both with derivative 0 there."""
    a = jnp.array([[-jnp.inf, -jnp.inf, -jnp.inf], [0.5, -jnp.inf, 2.0], [1.0, 2.0, 3.0]], jnp.float32)
    # (each in one jitted program: op by op, every operation would compile)
    pairs = jax.jit(lambda a: [(logspace.logsumexp(a, axis=axis), jax.nn.logsumexp(a, axis=axis))
                               for axis in (1, (1,))])(a)
    for out, ref in pairs:
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    assert jax.eval_shape(lambda a: logspace.logsumexp(a, axis=1, keepdims=True), a).shape == (3, 1)
    g = jax.jit(jax.grad(lambda t: jnp.sum(jnp.where(jnp.isfinite(u := logspace.logsumexp(t, axis=1)), u, 0.0))))(a)
    soft = jax.jit(lambda a: jax.nn.softmax(a[1:], axis=1))(a)
    np.testing.assert_allclose(np.asarray(g), np.vstack([np.zeros((1, 3)), np.asarray(soft)]), rtol=1e-6)
    ids = jnp.array([0, 0, 2])
    t = jnp.array([[1.0], [-jnp.inf], [-jnp.inf]])
    seg = jax.jit(logspace.segment_logsumexp, static_argnums=2)(t, ids, 3)
    np.testing.assert_array_equal(np.asarray(seg[:, 0]), [1.0, -np.inf, -np.inf])
    gs = jax.jit(jax.grad(lambda u: jnp.sum(jnp.where(jnp.isfinite(v := logspace.segment_logsumexp(u, ids, 3)), v,
                                                       0.0))))(t)
    np.testing.assert_array_equal(np.asarray(gs[:, 0]), [1.0, 0.0, 0.0])
