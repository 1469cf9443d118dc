"""Compiled circuits as pure functions under JAX's transformations, as a user composes them: ``jax.grad`` by the
parameters and by continuous data against central differences in float64, forward mode (``jax.jvp``,
``jax.jacfwd``), Hessian-vector products through an HMM's chain, ``lax.scan``, ``jax.checkpoint`` and a user's
``jax.jit`` around several methods, and a ``flax.linen`` model trained by ``optax.adam``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

import jaxpc
from jaxpc import distributions, structures

from .random_circuits import Generator

# every test here traces and compiles several executables (seconds on a CPU): the slow tier
pytestmark = pytest.mark.slow


def _central(f, params, rng, per_leaf=3, h=1e-6):
    """``[(analytic, central difference)]`` of scalar ``f`` at ``per_leaf`` random entries of each parameter leaf
    (``f`` jitted: one trace for all the differences)."""
    grads = jax.tree_util.tree_leaves(jax.grad(f)(params))
    f = jax.jit(f)
    leaves, tdef = jax.tree_util.tree_flatten(params)
    out = []
    for i, leaf in enumerate(leaves):
        leaf = np.asarray(leaf)
        assert np.all(np.isfinite(np.asarray(grads[i]))), f"non-finite gradient in leaf {i}"
        idxs = [tuple(int(rng.integers(0, s)) for s in leaf.shape) for _ in range(per_leaf)]
        for idx in idxs:
            if not np.isfinite(leaf[idx]):
                continue

            def at(d, i=i, idx=idx):
                moved = [np.array(a) for a in leaves]
                moved[i][idx] += d
                return float(f(jax.tree_util.tree_unflatten(tdef, moved)))

            out.append((float(np.asarray(grads[i])[idx]), (at(h) - at(-h)) / (2 * h)))
    return out


def _close(pairs, tol=1e-7):
    for got, fd in pairs:
        assert got == pytest.approx(fd, abs=tol, rel=tol), pairs


def _random_circuit(seed, num_vars):
    gen = Generator(seed, num_vars=num_vars)
    return gen, jaxpc.compile(gen.circuit(), seed=seed, dtype=jnp.float64)


@pytest.mark.full  # (no bug found: the full tier)
def test_parameter_and_data_gradients_in_float64_equal_central_differences():
    """A random circuit with tied sums and inputs, Bernoulli, Gaussian, Literal and MaskedCategorical leaves: the
    gradient of ``log_prob`` (with missing values, and under GeneralLL) by the parameters and by the Gaussian
    column of ``x``, and of a weighted sum of ``flows`` by the parameters, equal central differences."""
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        gen, c = _random_circuit(14, 4)
        x = gen.sample_data(4)
        miss = rng.random(x.shape) < 0.3
        _close(_central(lambda q: c.log_prob(q, x, miss).sum(), c.params, rng))
        _close(_central(lambda q: c.log_prob(q, x, propagation="GeneralLL", alpha=0.6).sum(), c.params, rng))
        w = jax.tree_util.tree_map(lambda a: jnp.asarray(rng.normal(size=a.shape)), c.flows(c.params, x))
        _close(_central(lambda q: sum(jnp.sum(a * b) for a, b in zip(jax.tree_util.tree_leaves(c.flows(q, x)),
                                                                      jax.tree_util.tree_leaves(w))), c.params, rng))
        v = gen.kinds.index("gaussian")
        gx = np.asarray(jax.jit(jax.grad(lambda xx: c.log_prob(c.params, xx).sum()))(jnp.asarray(x)))
        assert np.all(gx[:, [u for u in range(4) if u != v]] == 0)
        for b in range(4):
            e = np.zeros_like(x)
            e[b, v] = 1e-6
            fd = (float(c.log_prob(c.params, x + e).sum()) - float(c.log_prob(c.params, x - e).sum())) / 2e-6
            assert gx[b, v] == pytest.approx(fd, abs=1e-7)


@pytest.mark.full  # (no bug found: the full tier)
def test_forward_mode_needs_the_autodiff_backward_and_then_agrees_with_reverse_mode():
    """The default flow pass is a custom VJP: ``jax.jvp`` raises JAX's TypeError naming it (as ``log_prob``'s
    docstring says). With ``Options(backward="autodiff")``, ``jax.jvp`` equals the gradient's inner product with the
    tangent and ``jax.jacfwd`` equals ``jax.jacrev``, on an HMM's chain and on its layers."""
    c = jaxpc.compile(structures.HMM(4, 4, 3), seed=0)
    x = np.random.default_rng(0).integers(0, 3, (3, 4)).astype(np.int32)
    t = jax.tree_util.tree_map(lambda a: jnp.asarray(np.random.default_rng(1).normal(size=a.shape), a.dtype),
                               c.params)
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda q: c.log_prob(q, x).sum(), (c.params,), (t,))
    g = jax.grad(lambda q: c.log_prob(q, x).sum())(c.params)
    dot = sum(float(jnp.vdot(a, b)) for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(t)))
    for chain in (True, False):
        ad = jaxpc.Options(backward="autodiff", chain_scan=chain)
        _, tan = jax.jvp(lambda q, ad=ad: c.log_prob(q, x, options=ad).sum(), (c.params,), (t,))
        assert float(tan) == pytest.approx(dot, rel=1e-5)
        fwd = jax.jacfwd(lambda q, ad=ad: c.log_prob(q, x, options=ad))(c.params)
        rev = jax.jacrev(lambda q: c.log_prob(q, x))(c.params)
        for a, b in zip(jax.tree_util.tree_leaves(fwd), jax.tree_util.tree_leaves(rev)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.full  # (no bug found: the full tier)
@pytest.mark.parametrize("homogeneous", [True, False], ids=["tied", "untied"])
def test_hessian_vector_products_through_the_chain_equal_differences_of_gradients(homogeneous):
    """Forward over reverse (``jax.jvp`` of ``jax.grad``: the chain's custom VJP differentiated) in float64 equals
    central differences of the gradient, and ``jax.hessian`` of a tiny circuit is symmetric."""
    with jax.enable_x64(True):
        c = jaxpc.compile(structures.HMM(4, 3, 3, homogeneous=homogeneous), seed=0, dtype=jnp.float64)
        x = np.random.default_rng(0).integers(0, 3, (3, 4)).astype(np.int32)
        miss = np.array([False, True, False, False])
        t = jax.tree_util.tree_map(lambda a: jnp.asarray(np.random.default_rng(2).normal(size=a.shape)), c.params)
        grad = jax.grad(lambda q: c.log_prob(q, x, miss).sum())
        hv = jax.jvp(grad, (c.params,), (t,))[1]
        moved = [grad(jax.tree_util.tree_map(lambda a, b, s=s: a + s * 1e-5 * b, c.params, t)) for s in (1, -1)]
        for a, p, m in zip(*(jax.tree_util.tree_leaves(u) for u in [hv] + moved)):
            np.testing.assert_allclose(np.asarray(a), (np.asarray(p) - np.asarray(m)) / 2e-5, atol=1e-7)
        flat, unravel = ravel_pytree(c.params)
        H = np.asarray(jax.hessian(lambda v: c.log_prob(unravel(v), x, miss).sum())(flat))
        np.testing.assert_allclose(H, H.T, atol=1e-9)


@pytest.mark.full  # (no bug found: the full tier)
def test_scan_checkpoint_and_a_user_jit_around_several_methods_equal_the_plain_calls():
    """``lax.scan`` over batches calling ``flows`` and ``log_prob``, ``jax.grad`` of a ``jax.checkpoint``-ed loss,
    ``jax.eval_shape`` of ``em_step``, and one ``jax.jit`` around ``log_prob``, ``flows``, ``em_step`` and
    ``conditional`` equal the same calls made one by one."""
    a = jaxpc.inputs(0, 2, 2, distributions.Categorical(3))
    b = jaxpc.inputs(1, 2, 2, distributions.Gaussian())
    c = jaxpc.compile(jaxpc.summate(jaxpc.multiply(a, b), num_node_blocks=1, block_size=1), seed=0)
    rng = np.random.default_rng(0)
    xs = np.stack([rng.integers(0, 3, (3, 5)), rng.normal(size=(3, 5))], axis=2).astype(np.float32)  # [3 batches]
    miss = np.array([False, True])

    def body(carry, xb):
        fl = c.flows(c.params, xb)
        return jax.tree_util.tree_map(jnp.add, carry, fl), c.log_prob(c.params, xb)

    zero = jax.tree_util.tree_map(jnp.zeros_like, c.flows(c.params, xs[0]))
    total, lls = jax.lax.scan(body, zero, jnp.asarray(xs))
    want = jax.tree_util.tree_map(lambda *f: sum(f), *[c.flows(c.params, xb) for xb in xs])
    for g, w in zip(jax.tree_util.tree_leaves(total), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lls), np.stack([c.log_prob(c.params, xb) for xb in xs]), rtol=1e-6)

    def loss(q):
        return -c.log_prob(q, xs[0]).mean()

    for g, w in zip(jax.tree_util.tree_leaves(jax.grad(jax.checkpoint(loss))(c.params)),
                    jax.tree_util.tree_leaves(jax.grad(loss)(c.params))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7)
    shapes = jax.eval_shape(lambda q: c.em_step(q, xs[0]), c.params)
    assert jax.tree_util.tree_map(lambda s: (s.shape, s.dtype), shapes) == \
        jax.tree_util.tree_map(lambda s: (s.shape, s.dtype), c.params)

    @jax.jit
    def user(q, xb):
        return c.log_prob(q, xb), c.flows(q, xb), c.em_step(q, xb, step_size=0.5), c.marginal(q, xb, miss)

    got = user(c.params, jnp.asarray(xs[1]))
    want = (c.log_prob(c.params, xs[1]), c.flows(c.params, xs[1]), c.em_step(c.params, xs[1], step_size=0.5),
            c.marginal(c.params, xs[1], miss))
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


@pytest.mark.full  # (no bug found: the full tier)
def test_a_circuit_inside_a_flax_linen_model_trains_with_optax_adam():
    """A ``flax.linen`` module holding a circuit's parameters as ``self.param`` beside a Dense layer that maps
    features to soft evidence: ``init`` / ``apply`` give the circuit's marginal, and ``optax.adam`` on the NLL lowers
    it and moves both the Dense kernel and the circuit's parameters."""
    nn = pytest.importorskip("flax.linen")
    a = jaxpc.inputs(0, 2, 2, distributions.Categorical(3))
    b = jaxpc.inputs(1, 2, 2, distributions.Categorical(3))
    c = jaxpc.compile(jaxpc.summate(jaxpc.multiply(a, b), num_node_blocks=1, block_size=1), seed=4)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, feats):
            q = jax.nn.softmax(nn.Dense(6)(feats).reshape(-1, 2, 3))
            params = self.param("pc", lambda key: c.init_params(key))
            return c.marginal(params, soft_evidence=q)

    feats = jax.random.normal(jax.random.key(0), (16, 4))
    model = Model()
    variables = model.init(jax.random.key(1), feats)
    ll = model.apply(variables, feats)
    q = jax.nn.softmax(nn.Dense(6).apply({"params": variables["params"]["Dense_0"]}, feats).reshape(-1, 2, 3))
    np.testing.assert_allclose(np.asarray(ll), np.asarray(c.marginal(variables["params"]["pc"], soft_evidence=q)),
                               rtol=1e-6)
    opt = optax.adam(0.05)
    state = opt.init(variables)

    @jax.jit
    def step(v, s):
        loss, g = jax.value_and_grad(lambda u: -jnp.mean(model.apply(u, feats)))(v)
        upd, s = opt.update(g, s, v)
        return optax.apply_updates(v, upd), s, loss

    v, state, loss0 = step(variables, state)
    for _ in range(30):
        v, state, loss = step(v, state)
    assert float(loss) < float(loss0) - 0.1
    for key in ("Dense_0", "pc"):
        moved = jax.tree_util.tree_map(lambda x, y: float(jnp.abs(x - y).max()), v["params"][key],
                                       variables["params"][key])
        assert max(jax.tree_util.tree_leaves(moved)) > 1e-3, key


def _mixture64(a, b):
    """A float64 circuit of one sum over the product of node vectors ``a`` and ``b`` (call under x64)."""
    return jaxpc.compile(jaxpc.summate(jaxpc.multiply(a, b), num_node_blocks=1, block_size=1), seed=0,
                         dtype=jnp.float64)


def test_conditional_gradients_by_the_parameters_are_finite_with_indicator_leaves():
    """``jax.grad`` of ``conditional`` by the parameters, for a circuit with Indicator leaves, equals central
    differences in float64 (NaN in every leaf before)."""
    a = jaxpc.inputs(0, 2, 2, distributions.Categorical(3))
    b = jaxpc.inputs(1, 2, 2, distributions.Indicator(2))
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        c = _mixture64(a, b)
        x = np.array([[0, 1], [2, 0], [1, 1]], np.int32)
        miss = np.array([True, False])
        _close(_central(lambda q: c.conditional(q, x, miss)[:, 0, 0].sum(), c.params, rng))


def test_em_step_gradients_are_finite_with_masked_categorical_leaves():
    """``jax.grad`` through ``em_step`` (a weighted sum of its finite outputs) of a circuit with MaskedCategorical
    leaves equals central differences in float64."""
    m = distributions.MaskedCategorical(3, "range")
    a = jaxpc.inputs(0, 2, 2, m, params={"mask": np.array([[0, 2], [1, 3], [0, 3], [0, 1]])})
    b = jaxpc.inputs(1, 2, 2, distributions.Categorical(3))
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        c = _mixture64(a, b)
        x = np.array([[0, 1], [2, 0], [1, 2]], np.int32)
        w = jax.tree_util.tree_map(lambda p: jnp.asarray(rng.normal(size=p.shape)), c.params)

        def f(q):
            new = c.em_step(q, x, step_size=0.5, pseudocount=0.1)
            return sum(jnp.sum(jnp.where(jnp.isfinite(u), u, 0.0) * v)
                       for u, v in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(w)))

        _close(_central(f, c.params, rng))
