"""Linear flows are linear in the samples' weights (``ll_weights``): the derivative of the flows with respect to
sample ``b``'s weight is sample ``b``'s own flows (its flows at weight 1), at every weight, 0 included. A mask on a
zero weight or a zero flow (rather than on what makes a value undefined: a zero local sum, a -inf log-likelihood)
turns that derivative into a silent 0. Impossible samples (ll = -inf) have zero flows, and a zero derivative,
without NaN, at a weight of 0 or not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc import Options, distributions, structures
from jaxpc.engine import chain as chain_engine

from .tiers import slow


def _per_sample(c, p, x, w, options):
    """``(jacobian, one-hot flows, ll)``: ``jax.jacrev`` of the flows at the weights ``w``, its sample axis first,
    the flows of each sample alone at weight 1 and the samples' log-likelihoods."""
    def flows(w):
        return c.flows(p, x, ll_weights=w, validate=False, options=options, return_ll=True)

    @jax.jit  # (one executable)
    def both(w):
        jac = jax.jacrev(lambda w: flows(w)[0])(w)
        alone, ll = jax.vmap(flows)(jnp.eye(len(w), dtype=w.dtype))
        return jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, -1, 0), jac), alone, ll[0]

    jac, alone, ll = both(w)
    return jac, alone, np.asarray(ll)


def _check(c, p, x, w, options=None, impossible=()):
    """The jacobian of the flows in the weights equals each sample's own flows, NaN-free, at weights with zeros; the
    ``impossible`` samples have ll = -inf and zero flows."""
    w = jnp.asarray(w, jnp.float32)
    assert (np.asarray(w) == 0).any()
    jac, alone, ll = _per_sample(c, p, x, w, options)
    # TF32 products (a GPU's default) round the two sides' differently ordered sums apart by ~1e-3 of the largest
    rel = 2e-3 if jax.default_backend() == "gpu" and Options.make(options).concrete_precision != "fp32" else 2e-5
    assert sorted(np.flatnonzero(np.isneginf(ll))) == sorted(impossible), ll
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(jac), jax.tree_util.tree_leaves(alone)):
        a, b, name = np.asarray(a), np.asarray(b), jax.tree_util.keystr(path)
        assert np.isfinite(a).all() and np.isfinite(b).all(), name
        for i in impossible:
            assert not a[i].any() and not b[i].any(), (name, i)
        tol = rel * max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(a, b, rtol=0, atol=tol, err_msg=name)
        assert np.abs(b[np.asarray(w) == 0]).max(initial=0) > 0, name  # (a zero weight, a nonzero derivative)


def _mixture(zero_category: bool = True):
    """A small hand-built circuit (two Categorical(3) mixtures of products under a root sum) whose value 2 has
    probability 0 in every leaf (explicit parameters): a sample that observes it is impossible."""
    def mix():
        a = jaxpc.inputs(0, 2, 2, distributions.Categorical(3))
        b = jaxpc.inputs(1, 2, 2, distributions.Categorical(3))
        return jaxpc.summate(jaxpc.multiply(a, b), num_node_blocks=1, block_size=2)

    c = jaxpc.compile(jaxpc.summate(mix(), mix(), num_node_blocks=1, block_size=1), seed=0)
    p = c.params
    if zero_category:
        lp = p["input"]["categorical"]["log_probs"].at[:, 2].set(-jnp.inf)
        p = {**p, "input": {"categorical": {"log_probs": lp - jax.nn.logsumexp(lp, axis=1, keepdims=True)}}}
    return c, p


X_MIX = np.array([[0, 1], [2, 0], [1, 1], [1, 0], [0, 2]], np.int32)  # rows 1 and 4 observe the impossible value


@pytest.mark.parametrize("options", [None, *(pytest.param(o, marks=slow) for o in (
    Options(param_flow_pass="batched"), Options(param_flow_pass="inline"), Options(backward="autodiff"),
    Options(node_flows=True)))], ids=["default", "batched", "inline", "autodiff", "node_flows"])
def test_hand_built_circuit(options):
    c, p = _mixture()
    _check(c, p, X_MIX, [0.0, 0.0, 2.0, 0.0, 1.5], options, impossible=(1, 4))


@pytest.mark.parametrize("options", [Options(propagation="GeneralLL", alpha=2.0), Options(precision="tf32"),
                                     pytest.param(Options(propagation="GeneralLL", alpha=2.0, precision="tf32"),
                                                  marks=slow),
                                     pytest.param(Options(pflow_temperature=0.5, eflow_temperature=2.0), marks=slow),
                                     Options(propagation="MPE")],
                         ids=["terms", "stored_sums", "terms_stored_sums", "tempered", "hard_em"])
def test_hand_built_circuit_flow_variants(options):
    """The sum layers' other splits: from the terms (an exponent above 1, shares from the stored values below fp32
    precision), tempered factored flows and the max-product flows."""
    c, p = _mixture()
    _check(c, p, X_MIX, [0.0, 0.0, 2.0, 0.0, 1.5], options, impossible=(1, 4))


def test_missing_values():
    c, p = _mixture()
    miss = np.array([[False, True], [False, False], [True, True], [False, False], [True, False]])
    w = jnp.asarray([0.0, 0.0, 1.0, 0.5, 0.0])

    def flows(w):
        return c.flows(p, X_MIX, miss, ll_weights=w, validate=False)

    jac = jax.tree_util.tree_map(lambda a: jnp.moveaxis(a, -1, 0), jax.jit(jax.jacrev(flows))(w))
    alone = jax.jit(jax.vmap(flows))(jnp.eye(5))
    for a, b in zip(jax.tree_util.tree_leaves(jac), jax.tree_util.tree_leaves(alone)):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-5)
        assert np.abs(np.asarray(b)[0]).max() > 0  # row 0 (weight 0) is possible: its flows are not zero


def test_forward_mode():
    """``jax.jacfwd`` (forward over the flow pass) gives the same derivative as ``jax.jacrev``."""
    c, p = _mixture()
    w = jnp.asarray([0.0, 0.0, 2.0, 0.0, 1.5])

    def flows(w):
        return c.flows(p, X_MIX, ll_weights=w, validate=False)

    fwd = jax.jit(jax.jacfwd(flows))(w)
    rev = jax.jit(jax.jacrev(flows))(w)
    for a, b in zip(jax.tree_util.tree_leaves(fwd), jax.tree_util.tree_leaves(rev)):
        assert np.abs(np.asarray(a)[..., 0]).max() > 0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-5)


def _hmm():
    """An HMM whose emission 2 has probability 0 in every state (``beta``), and a batch with two samples that
    observe it."""
    beta = np.ones((4, 3))
    beta[:, 2] = 0.0
    c = jaxpc.compile(structures.HMM(5, 4, 3, beta=beta, block_size=2), seed=0)
    x = np.array([[0, 1, 1, 0, 1], [1, 0, 2, 0, 1], [1, 1, 0, 0, 0], [0, 2, 1, 1, 0], [1, 0, 1, 0, 0]], np.int32)
    return c, x


# impl="xla": the scan's own derivative; on a GPU the default route at this batch is the persistent Pallas kernels,
# which have no second derivative (test_kernel_routes_raise_or_agree)
XLA_CHAIN = (Options(impl="xla"), pytest.param(Options(impl="xla", chain_scan=False), marks=slow))


@pytest.mark.parametrize("options", XLA_CHAIN, ids=["chain_scan", "layers"])
def test_hmm(options):
    c, x = _hmm()
    opts = Options.make(options)
    assert c.layout.chain is not None
    assert chain_engine.applies(c.layout, opts, False) == opts.chain_scan
    assert not chain_engine.persistent(c.layout.chain, x.shape[0], jnp.float32, opts)
    _check(c, c.params, x, [0.0, 0.0, 1.5, 2.0, 0.0], options, impossible=(1, 3))


@slow
def test_hclt():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 3, (50, 5))
    c = jaxpc.compile(structures.HCLT(data, 4, input_dist=distributions.Categorical(3)), seed=0)
    lp = c.params["input"]["categorical"]["log_probs"].at[:, 2].set(-jnp.inf)  # value 2: probability 0
    p = {**c.params, "input": {"categorical": {"log_probs": lp - jax.nn.logsumexp(lp, axis=1, keepdims=True)}}}
    x = np.array([[0, 1, 1, 0, 1], [1, 0, 2, 0, 1], [1, 1, 0, 0, 0], [0, 0, 1, 2, 0]], np.int32)
    _check(c, p, x, [0.0, 0.0, 1.0, 2.0], Options(fold_products=True), impossible=(1, 3))


@slow
def test_pd():
    c = jaxpc.compile(structures.PD((2, 3), 4, split_intervals=1, input_dist=distributions.Categorical(3)), seed=0)
    x = np.random.default_rng(1).integers(0, 3, (4, 6)).astype(np.int32)
    _check(c, c.params, x, [0.0, 1.0, 0.0, 2.0])


@slow
@pytest.mark.parametrize("impl", ["pallas", "pallas_forward"])
def test_kernel_routes(impl):
    """The Pallas kernels (interpret mode on the CPU; the HMM's persistent chain kernels) have no derivative of their
    own: the flows' derivative is XLA's route's at the same point."""
    c, x = _hmm()
    opts = Options(impl=impl)
    assert chain_engine.persistent(c.layout.chain, x.shape[0], jnp.float32, opts)
    _check(c, c.params, x, [0.0, 0.0, 1.5, 2.0, 0.0], opts, impossible=(1, 3))


@pytest.mark.parametrize("options", XLA_CHAIN, ids=["chain_scan", "layers"])
def test_gaussian_emissions(options):
    """The Gaussian leaves' moments (``s0``, ``s1``, ``s2``, ``m2``) are linear in the flows too; a value whose
    square overflows (|x| > 1.8e19 in float32: ll = -inf) has zero moments, without NaN, at a weight of 0 or not."""
    c = jaxpc.compile(structures.GeneralizedHMM(4, 4, distributions.Gaussian(), block_size=2), seed=0)
    x = np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32)
    x[1, 2] = x[3, 0] = 1e20
    _check(c, c.params, x, [0.0, 0.0, 1.0, 2.0], options, impossible=(1, 3))
