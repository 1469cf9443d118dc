"""Every input distribution against exact answers in float64: log-probabilities against ``scipy.stats`` at ordinary
and extreme parameters, marginalized leaves, the EM update against its closed form computed from the posteriors of a
two-component mixture, samples against the distribution (chi-square / Kolmogorov-Smirnov with loose bounds, fixed
keys), leaf modes, soft evidence against enumeration, and the dtype of leaf values under 64-bit JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.stats as st
from scipy.special import expit

import jaxpc
from jaxpc import distributions as D
from jaxpc import optim

from .tiers import cases, slow

W = np.array([0.3, 0.7])  # the mixture weights of the two leaves of :func:`_mixture`


def _mixture(dist, params, dtype=jnp.float64):
    """``(circuit, leaf)``: a sum with weights ``W`` over a vector of two ``dist`` nodes of variable 0."""
    leaf = jaxpc.inputs(0, 2, dist=dist, params=params)
    return jaxpc.compile(jaxpc.summate(leaf, num_nodes=1, params=W[None]), dtype=dtype), leaf


def _node_values(dist, params, x, missing=None, propagation="LL", alpha=None):
    """``[N, B]`` values of the ``N`` nodes of one ``dist`` vector (natural ``params``) over variable 0 at ``x [B]``:
    the distribution's own ``log_prob`` on the parameters ``jaxpc.compile`` makes (float64)."""
    n = len(next(iter(params.values()))) if isinstance(params, dict) else len(params)
    leaf = jaxpc.inputs(0, n, dist=dist, params=params)
    c = jaxpc.compile(jaxpc.summate(leaf, num_nodes=1), dtype=jnp.float64)
    tab = c.tables["inputs"][0]
    xv = jnp.broadcast_to(jnp.asarray(x)[None, :], (n, len(x)))
    mv = None if missing is None else jnp.broadcast_to(jnp.asarray(missing)[None, :], (n, len(x)))
    opts = jaxpc.Options(propagation=propagation, alpha=alpha)
    fn = jax.jit(lambda p, meta, rows, xv, mv: dist.log_prob(p, meta, rows, xv, mv, opts))  # one program, not op by op
    return np.asarray(fn(c.params["input"][c.layout.input_layers[0].key], tab["meta"], tab["rows"], xv, mv))


def _logistic_bins(mu, s, lo, hi, K):
    """``[len(mu), K]`` float64 log-masses of :class:`DiscreteLogistic` bins from the logistic CDF (``log(cdf(b) -
    cdf(a)) = log(sf(a) - sf(b))``, each side in its stable form)."""
    edges = lo + (hi - lo) / K * np.arange(K + 1.0)
    edges[0], edges[-1] = -np.inf, np.inf
    out = np.empty((len(mu), K))
    for i, (m, sc) in enumerate(zip(mu, s)):
        a, b = (edges[:-1] - m) / sc, (edges[1:] - m) / sc
        left = b <= 0  # both edges at or below the location: the CDF is small and exact
        with np.errstate(divide="ignore"):
            out[i] = np.where(left, np.log(np.maximum(expit(b) - expit(a), 0.0)),
                              np.log(np.maximum(expit(-a) - expit(-b), 0.0)))
    return out


# ---- log-probabilities against scipy.stats, float64 -----------------------------------------------------------------

def test_categorical_and_bernoulli_log_probs_at_extreme_probabilities():
    with jax.enable_x64(True):
        K = 2000  # many categories, with masses from 1e-300 to near one
        p = np.random.default_rng(0).dirichlet(np.full(K, 0.05), size=2)
        p = np.maximum(p, 1e-300)
        p /= p.sum(axis=1, keepdims=True)
        x = np.arange(K)
        np.testing.assert_allclose(_node_values(D.Categorical(K), p, x), np.log(p), rtol=1e-13)
        probs = np.array([1e-300, 1e-12, 0.3, 1.0 - 1e-12])
        got = _node_values(D.Bernoulli(), probs, np.array([0, 1]))
        want = st.bernoulli(probs[:, None]).logpmf(np.array([0, 1])[None, :])
        # log(1 - p) near p = 0 is log1p(-p): log(1.0 - 1e-12) is 2e-5 off in relative terms
        np.testing.assert_allclose(got, want, rtol=1e-13)
        edge = _node_values(D.Bernoulli(), np.array([0.0, 1.0]), np.array([0, 1]))
        np.testing.assert_array_equal(edge, [[0.0, -np.inf], [-np.inf, 0.0]])


def test_gaussian_log_probs_at_tiny_and_huge_sigma():
    with jax.enable_x64(True):
        mu = np.array([0.0, 0.0, 1e10, -3.0])
        sigma = np.array([1e-8, 1e8, 1.0, 2.5])
        g = D.Gaussian(min_sigma=1e-9)
        for z in (0.0, 1.0, -3.0, 40.0):
            x = mu + z * sigma  # one point per node at z standard deviations
            got = np.diagonal(_node_values(g, {"mu": mu, "sigma": sigma}, x))
            np.testing.assert_allclose(got, st.norm(mu, sigma).logpdf(x), rtol=1e-13)


@pytest.mark.parametrize("lo,hi,K", cases([(0.0, 1.0, 10), (0.0, 256.0, 256), (-5.0, 5.0, 3), (-1.0, 1.0, 1000)],
                                          fast=[(-1.0, 1.0, 1000)], unpack=True))
def test_discrete_logistic_log_probs_match_the_logistic_cdf(lo, hi, K):
    """Bins deep in either tail, a scale far below and far above the bin width, a location outside the range: the
    float64 bin masses equal the CDF differences and sum to one."""
    with jax.enable_x64(True):
        w = (hi - lo) / K
        mu = np.array([lo + 0.37 * (hi - lo), lo - 40 * (hi - lo), hi + 3 * w, (lo + hi) / 2, lo + 0.5 * w])
        s = np.array([0.7 * w, 2.0 * w, 0.5 * w, 1e4 * (hi - lo), 1e-3 * w])
        d = D.DiscreteLogistic((lo, hi), K, min_std=1e-12)
        got = _node_values(d, {"mu": mu, "s": s}, np.arange(K))
        want = _logistic_bins(mu, s, lo, hi, K)
        assert not np.isnan(got).any()
        fin = want > -700  # past that, the CDF difference itself underflows in the reference
        np.testing.assert_allclose(got[fin], want[fin], rtol=1e-9, atol=1e-12)
        assert np.all(got[~fin] < -600)
        np.testing.assert_allclose(np.exp(got).sum(axis=1), 1.0, rtol=1e-12)


_MASKED = {"mask": np.array([[1, 4], [0, 6]]),
           "probs": np.array([[0.0, 0.2, 0.5, 0.3, 0.0, 0.0], np.arange(1.0, 7.0) / 21.0])}
MISSING_CASES = [
    pytest.param(D.Categorical(6), np.tile(np.arange(1.0, 7.0) / 21.0, (2, 1)), id="categorical", marks=slow),
    pytest.param(D.Bernoulli(), np.array([0.2, 0.9]), id="bernoulli", marks=slow),
    pytest.param(D.MaskedCategorical(6, "range"), _MASKED, id="masked"),
    pytest.param(D.DiscreteLogistic((0.0, 6.0), 6), {"mu": np.array([1.2, 7.0]), "s": np.array([0.4, 2.0])},
                 id="logistic", marks=slow)]


@pytest.mark.parametrize("dist,params", MISSING_CASES)
def test_missing_values_marginalize_discrete_leaves(dist, params):
    """A marginalized leaf is log 1 under LL, the mode's value under MPE and ``(1/a) log sum p^a`` under GeneralLL;
    a masked categorical's forbidden values take no part."""
    a = 2.5
    with jax.enable_x64(True):
        pm = np.exp(_node_values(dist, params, np.arange(dist.num_cats)))
        for prop, alpha, want in (("LL", None, np.zeros(2)), ("MPE", None, np.log(pm.max(axis=1))),
                                  ("GeneralLL", a, np.log(np.sum(pm ** a, axis=1)) / a)):
            got = _node_values(dist, params, np.array([0, 0]), np.array([True, False]), prop, alpha)
            np.testing.assert_allclose(got[:, 0], want, rtol=1e-12, atol=1e-14, err_msg=prop)
            with np.errstate(divide="ignore"):  # observed: log p(0), -inf where the mask forbids 0
                np.testing.assert_allclose(got[:, 1], np.log(pm[:, 0]), rtol=1e-12, err_msg=prop)


def test_missing_values_marginalize_gaussians_and_indicators():
    """A Gaussian marginalizes to log 1 (LL), the density's maximum (MPE) and ``(1/a) log int N(x)^a dx``
    (GeneralLL); indicators to 0 under all three."""
    a = 2.5
    miss = np.array([True, False])
    with jax.enable_x64(True):
        mu, sigma = np.array([0.5, -2.0]), np.array([0.3, 4.0])
        for prop, alpha, want in (("LL", None, np.zeros(2)), ("MPE", None, st.norm(mu, sigma).logpdf(mu)),
                                  ("GeneralLL", a, ((1 - a) / 2 * np.log(2 * np.pi * sigma ** 2) - 0.5 * np.log(a))
                                   / a)):
            got = _node_values(D.Gaussian(), {"mu": mu, "sigma": sigma}, np.array([0.0, 1.5]), miss, prop, alpha)
            np.testing.assert_allclose(got[:, 0], want, rtol=1e-12, err_msg=prop)
            np.testing.assert_allclose(got[:, 1], st.norm(mu, sigma).logpdf(1.5), rtol=1e-12, err_msg=prop)
        # column 0 missing, column 1 observed x = 1: Indicator(3)'s nodes are x == 0 and x == 1, Literal(2)'s x == 2
        for dist, want in ((D.Indicator(3), [[0.0, -np.inf], [0.0, 0.0]]), (D.Literal(2), [[0.0, -np.inf]] * 2)):
            leaf = jaxpc.inputs(0, 2, dist=dist)
            c = jaxpc.compile(jaxpc.summate(leaf, num_nodes=1), dtype=jnp.float64)
            tab = c.tables["inputs"][0]
            for prop, alpha in (("LL", None), ("MPE", None), ("GeneralLL", a)):
                got = dist.log_prob({}, tab["meta"], tab["rows"], jnp.array([[2, 1]] * 2, jnp.int32),
                                    jnp.array([[True, False]] * 2), jaxpc.Options(propagation=prop, alpha=alpha))
                np.testing.assert_array_equal(np.asarray(got), want)


# ---- leaves without parameters; dtypes -------------------------------------------------------------------------------

def test_external_leaves_take_part_in_normalize_params():
    """``optim.normalize_params`` (gradient training with ``optim.fit(optimizer=optax...)``) leaves the parameter-free
    ``External`` layer as it is; it was read as a categorical (``KeyError: 'log_probs'``)."""
    ext = jaxpc.inputs(0, 2, dist=D.External())
    cat = jaxpc.inputs(1, 2, dist=D.Categorical(3))
    c = jaxpc.compile(jaxpc.summate(jaxpc.multiply(ext, cat), num_nodes=1), seed=0)
    got = jax.jit(lambda t, p: optim.normalize_params(c.layout, t, p))(c.tables, c.params)
    assert got["input"]["external"] == {}
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6), got,
                           c.params)


def test_indicator_leaves_keep_a_float32_circuit_float32_under_x64():
    """Indicator values are exact in float32: under ``jax_enable_x64`` a float32 circuit with ``Indicator`` /
    ``Literal`` leaves computes and returns float32 (it ran in float64), and a float64 circuit float64."""
    a = jaxpc.inputs(0, 2, dist=D.Indicator(2))
    b = jaxpc.inputs(1, 2, dist=D.Literal(1))
    cat = jaxpc.inputs(2, 2, dist=D.Categorical(3), params=[[0.2, 0.3, 0.5], [0.6, 0.3, 0.1]])
    root = jaxpc.summate(jaxpc.multiply(a, b, cat), num_nodes=1, params=W[None])
    x = np.array([[0, 1, 2], [1, 1, 0], [1, 0, 0]], np.int32)
    want = np.log([0.3 * 0.5, 0.7 * 0.6, 1.0]) + [0.0, 0.0, -np.inf]
    with jax.enable_x64(True):
        for dtype in (jnp.float32, jnp.float64):
            c = jaxpc.compile(root, dtype=dtype)
            ll = c.log_prob(c.params, x)
            assert ll.dtype == dtype
            np.testing.assert_allclose(np.asarray(ll), want, rtol=1e-6 if dtype == jnp.float32 else 1e-14)
            i = [spec.key for spec in c.layout.input_layers].index("indicator")
            pmf = D.Indicator(2).log_pmf({}, c.tables["inputs"][i]["meta"], jnp.arange(2), 3)
            assert pmf.dtype == jnp.float32


# ---- EM against the closed form --------------------------------------------------------------------------------------

def _posteriors(lik, miss, lw):
    """``[B, 2]`` weighted posteriors ``lw_b W_i p_i(x_b) / sum_j W_j p_j(x_b)`` of the two leaves (likelihood 1 where
    missing); rows of likelihood zero take no part (zero)."""
    joint = W * np.where(miss[:, None], 1.0, lik)
    tot = joint.sum(axis=1, keepdims=True)
    return np.where(tot > 0, joint / np.where(tot > 0, tot, 1.0), 0.0) * lw[:, None]


def _category_counts(post, x, miss, probs):
    """``[2, K]`` expected counts: observed values count their posterior, missing ones the posterior times the
    leaf's probabilities."""
    counts = np.zeros_like(probs)
    for b in range(len(x)):
        counts += post[b][:, None] * (probs if miss[b] else np.eye(probs.shape[1])[x[b]])
    return counts


def _moments_update(post, values, miss, mu, var, pc):
    """The moment M-step: ``mu' = (S1 + c mu) / (S0 + c)``, ``var' = (S2 + c (mu^2 + var)) / (S0 + c) - mu'^2``,
    missing values contributing the current moments; returns ``(mu', sqrt(var'))`` (not yet blended)."""
    S0 = post.sum(axis=0)
    S1 = (post * np.where(miss[:, None], mu, values[:, None])).sum(axis=0)
    S2 = (post * np.where(miss[:, None], mu ** 2 + var, values[:, None] ** 2)).sum(axis=0)
    new_mu = (S1 + pc * mu) / (S0 + pc)
    new_std = np.sqrt((S2 + pc * (mu ** 2 + var)) / (S0 + pc) - new_mu ** 2)
    return new_mu, new_std


EM_CASES = ["categorical", pytest.param("bernoulli", marks=slow), pytest.param("masked", marks=slow), "gaussian",
            pytest.param("logistic", marks=slow)]


@pytest.mark.parametrize("kind", EM_CASES)
def test_em_step_matches_the_closed_form(kind):
    """One ``em_step`` with per-sample weights, missing values, a pseudocount and a step size below one equals the
    M-step computed by hand from the exact posteriors of a two-leaf mixture (float64)."""
    rng = np.random.default_rng(1)
    B, step, pc = 40, 0.4, 2.5
    lw = rng.random(B) * 2
    miss = rng.random(B) < 0.25
    with jax.enable_x64(True):
        if kind in ("categorical", "bernoulli", "masked"):
            K = {"categorical": 4, "bernoulli": 2, "masked": 5}[kind]
            if kind == "categorical":
                probs = rng.dirichlet(np.ones(K), size=2)
                dist, params = D.Categorical(K), probs
            elif kind == "bernoulli":
                probs = np.array([[0.8, 0.2], [0.1, 0.9]])
                dist, params = D.Bernoulli(), probs[:, 1]
            else:
                probs = np.array([[0.0, 0.2, 0.3, 0.5, 0.0], [0.6, 0.4, 0.0, 0.0, 0.0]])
                dist, params = D.MaskedCategorical(K, "range"), {"mask": [[1, 4], [0, 2]], "probs": probs}
            x = rng.integers(0, K, B)
            c, leaf = _mixture(dist, params)
            new = c.get_node_params(c.em_step(c.params, x[:, None].astype(np.int32), miss[:, None], step_size=step,
                                              pseudocount=pc, ll_weights=lw), leaf)
            post = _posteriors(probs[:, x].T, miss, lw)
            counts = _category_counts(post, x, miss, probs)
            allowed = probs > 0 if kind == "masked" else np.ones_like(probs, bool)
            prior = np.where(allowed, pc / allowed.sum(axis=1, keepdims=True), 0.0)
            want = (1 - step) * probs + step * (counts + prior) / (counts.sum(axis=1, keepdims=True) + pc)
            got = {"categorical": lambda g: g, "bernoulli": lambda g: np.stack([1 - g, g], 1),
                   "masked": lambda g: g["probs"]}[kind](np.asarray(new) if kind != "masked" else new)
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-15)
            np.testing.assert_allclose(np.asarray(got).sum(axis=1), 1.0, rtol=1e-13)
            return
        if kind == "gaussian":
            mu, sd = np.array([-1.0, 2.0]), np.array([0.7, 1.3])
            x = rng.normal(0.5, 2.0, B)
            c, leaf = _mixture(D.Gaussian(min_sigma=1e-3), {"mu": mu, "sigma": sd})
            lik, values, var = st.norm(mu, sd).pdf(x[:, None]), x, sd ** 2
            names = ("mu", "sigma")
        else:
            mu, sd = np.array([3.0, 7.0]), np.array([1.0, 2.0])
            x = rng.integers(0, 10, B)
            c, leaf = _mixture(D.DiscreteLogistic((0.0, 10.0), 10, min_std=1e-3), {"mu": mu, "s": sd})
            lik = np.exp(_logistic_bins(mu, sd, 0.0, 10.0, 10))[:, x].T
            values, var = x + 0.5, (sd * np.pi) ** 2 / 3  # bin centers; the logistic's variance
            names = ("mu", "s")
        xin = x[:, None].astype(np.int32 if kind == "logistic" else np.float64)
        new = c.get_node_params(c.em_step(c.params, xin, miss[:, None], step_size=step, pseudocount=pc,
                                          ll_weights=lw), leaf)
        new_mu, new_std = _moments_update(_posteriors(lik, miss, lw), values, miss, mu, var, pc)
        new_scale = new_std if kind == "gaussian" else new_std * np.sqrt(3) / np.pi  # the logistic's s from its std
        np.testing.assert_allclose(np.asarray(new[names[0]]), (1 - step) * mu + step * new_mu, rtol=1e-12)
        np.testing.assert_allclose(np.asarray(new[names[1]]), (1 - step) * sd + step * new_scale, rtol=1e-12)


# ---- sampling, modes, soft evidence ----------------------------------------------------------------------------------

SAMPLE_CASES = [
    pytest.param(D.Categorical(4), np.array([[0.1, 0.2, 0.3, 0.4], [0.7, 0.0, 0.2, 0.1]]), id="categorical",
                 marks=slow),
    pytest.param(D.Bernoulli(), np.array([0.3, 1e-9]), id="bernoulli", marks=slow),
    pytest.param(D.MaskedCategorical(5, "rev_range"), {"mask": np.array([[1, 3], [0, 4]]),
                                                       "probs": np.array([[0.2, 0, 0, 0.3, 0.5], [0, 0, 0, 0, 1.0]])},
                 id="masked", marks=slow),
    pytest.param(D.DiscreteLogistic((0.0, 8.0), 8), {"mu": np.array([3.1, -20.0]), "s": np.array([1.2, 0.5])},
                 id="logistic", marks=slow),
    pytest.param(D.Gaussian(min_sigma=1e-4), {"mu": np.array([3.0, -1.0]), "sigma": np.array([0.5, 1e-3])},
                 id="gaussian", marks=slow)]


def _row(params, i):
    """Node ``i``'s natural parameters (a one-node vector's)."""
    if isinstance(params, dict):
        return {k: np.asarray(v)[i:i + 1] for k, v in params.items()}
    return np.asarray(params)[i:i + 1]


@pytest.mark.parametrize("dist,params", SAMPLE_CASES)
@pytest.mark.slow
def test_samples_and_modes_follow_the_leaf(dist, params):
    """Samples (fixed key) of the mixture ``W`` of two leaves (variable 0) and of each leaf alone (variables 1, 2)
    against the pmf (chi-square) or cdf (Kolmogorov-Smirnov), with a loose bound (p > 1e-4); values of zero mass are
    never drawn. ``mpe`` with every variable missing decodes each lone leaf's mode (its most probable value, lowest
    on ties, or its mean) with the value ``max_i (log W_i + max log p_i) + max log p_0 + max log p_1``."""
    n = 20000
    with jax.enable_x64(True):
        mix = jaxpc.summate(jaxpc.inputs(0, 2, dist=dist, params=params), num_nodes=1, params=W[None])
        alone = [jaxpc.inputs(1 + i, 1, dist=dist, params=_row(params, i)) for i in range(2)]
        c = jaxpc.compile(jaxpc.summate(jaxpc.multiply(mix, *alone), num_nodes=1), dtype=jnp.float64)
        s = np.asarray(c.sample(c.params, jax.random.key(0), n))
        a, v = c.mpe(c.params, np.zeros((1, 3), np.int32 if dist.discrete else np.float64), np.ones(3, bool))
        a, v = np.asarray(a)[0], float(np.asarray(v)[0])
        if dist.discrete:
            K = dist.num_cats
            x = np.zeros((2 * K, 3), np.int32)
            x[:K, 1] = x[K:, 2] = np.arange(K)
            miss = np.ones((2 * K, 3), bool)
            miss[:K, 1] = miss[K:, 2] = False
            lp = np.asarray(c.log_prob(c.params, x, miss)).reshape(2, K)  # each leaf's pmf, the others marginalized
            pm = np.exp(lp)
            for col, p in ((0, W @ pm), (1, pm[0]), (2, pm[1])):
                cnt = np.bincount(s[:, col].astype(np.int64), minlength=K)
                assert cnt.size == K and cnt[p == 0].sum() == 0
                big = n * p >= 5  # the bins of the test (the others hold too few draws)
                if big.sum() > 1:
                    assert st.chisquare(cnt[big], p[big] / p[big].sum() * cnt[big].sum()).pvalue > 1e-4
                else:  # all mass but at most 5 / n on one value
                    assert cnt[big].sum() >= n - 50
            np.testing.assert_array_equal(a[1:], np.argmax(lp, axis=1))
            best = lp.max(axis=1)
        else:
            mu, sd = params["mu"], params["sigma"]

            def cdf(t):
                return W @ st.norm(mu[:, None], sd[:, None]).cdf(np.atleast_1d(t)[None])

            assert st.kstest(s[:, 0], cdf).pvalue > 1e-4
            for i in range(2):
                assert st.kstest(s[:, 1 + i], st.norm(mu[i], sd[i]).cdf).pvalue > 1e-4
            np.testing.assert_array_equal(a[1:], mu)
            best = st.norm(mu, sd).logpdf(mu)
        np.testing.assert_allclose(v, np.max(np.log(W) + best) + best.sum(), rtol=1e-12)


@slow
def test_soft_evidence_of_discrete_leaves_equals_enumeration():
    """``marginal(soft_evidence=q)`` of every discrete leaf is ``log sum_k p(k) q_k`` (LL) and ``max_k log p(k) q_k``
    (MPE), with zero weights and more weights than the leaf has values (ignored beyond them)."""
    rng = np.random.default_rng(3)
    leaves = [(D.Categorical(4), [[0.1, 0.2, 0.3, 0.4]]), (D.Bernoulli(), [0.3]),
              (D.DiscreteLogistic((0.0, 8.0), 8), {"mu": [3.0], "s": [1.2]}),
              (D.MaskedCategorical(5, "range"), {"mask": [[1, 4]], "probs": [[0, 0.2, 0.3, 0.5, 0]]}),
              (D.Literal(2), None)]
    with jax.enable_x64(True):
        roots, K = [], 8
        for v, (dist, params) in enumerate(leaves):
            roots.append(jaxpc.inputs(v, 1, dist=dist, params=params))
        c = jaxpc.compile(jaxpc.summate(jaxpc.multiply(*roots), num_nodes=1), dtype=jnp.float64)
        q = rng.random((3, len(leaves), K))
        q[0, :, 0] = 0.0
        q[1, :, 2] = 0.0
        ll = np.asarray(c.marginal(c.params, soft_evidence=q))
        mpe = np.asarray(c.marginal(c.params, soft_evidence=q, propagation="MPE"))
        want_ll, want_mpe = np.zeros(3), np.zeros(3)
        for v, (dist, _) in enumerate(leaves):
            n = dist.num_values()
            x = np.zeros((n, len(leaves)), np.int32)
            x[:, v] = np.arange(n)
            miss = np.ones(len(leaves), bool)
            miss[v] = False
            pm = np.exp(np.asarray(c.log_prob(c.params, x, miss)))  # the leaf's pmf: the others marginalized
            with np.errstate(divide="ignore"):
                want_ll += np.log(q[:, v, :n] @ pm)
                want_mpe += np.max(np.log(q[:, v, :n]) + np.log(pm), axis=1)
        np.testing.assert_allclose(ll, want_ll, rtol=1e-12)
        np.testing.assert_allclose(mpe, want_mpe, rtol=1e-12)


def test_bad_leaf_arguments_are_clear_errors():
    """Masks, indicator sizes and value ranges that were silently reinterpreted (fractional range bounds truncated,
    a float ``full_mask`` read as truthiness, ``Indicator(True)`` as one state) or failed with an unrelated error
    (a ``val_range`` of three values: "too many values to unpack") raise a ``ValueError`` naming the argument."""
    with pytest.raises(ValueError, match=r"m: range mask bounds \(lo, hi\) must be integers"):
        jaxpc.inputs(0, 1, dist=D.MaskedCategorical(5), params={"mask": [[0.5, 2.7]]}, name="m")
    with pytest.raises(ValueError, match="rev_range mask bounds"):
        jaxpc.inputs(0, 1, dist=D.MaskedCategorical(5, "rev_range"), params={"mask": np.array([[True, True]])})
    with pytest.raises(ValueError, match="full_mask must be boolean"):
        jaxpc.inputs(0, 1, dist=D.MaskedCategorical(3, "full_mask"), params={"mask": [[0.3, 0.0, 0.7]]})
    with pytest.raises(ValueError, match="mask must be numeric"):
        jaxpc.inputs(0, 1, dist=D.MaskedCategorical(3), params={"mask": [["0", "2"]]})
    with pytest.raises(ValueError, match="Indicator: num_states must be a positive int, got True"):
        D.Indicator(True)
    for bad in ((0.0, 1.0, 2.0), "ab", 3.0, (0.0, float("nan")), (1.0, 1.0), ("0", "1")):
        with pytest.raises(ValueError, match=r"DiscreteLogistic: val_range must be finite \(lo, hi\) with hi > lo"):
            D.DiscreteLogistic(bad, 4)
    # what stays accepted: integral float bounds, 0/1 masks, numpy pairs
    leaf = jaxpc.inputs(0, 2, dist=D.MaskedCategorical(4), params={"mask": np.array([[0.0, 2.0], [1, 4]])})
    c = jaxpc.compile(jaxpc.summate(leaf, num_nodes=1))
    assert c.get_node_params(c.params, leaf)["mask"].tolist() == [[True, True, False, False], [False, True, True, True]]
    jaxpc.inputs(0, 1, dist=D.MaskedCategorical(3, "full_mask"), params={"mask": [[1, 0, 1]]})
    assert D.DiscreteLogistic(np.array([0, 255]), 256).hi == 255.0


def test_params_that_are_not_numbers_name_the_node_vector_and_the_field():
    """Strings, objects and ragged nested lists as leaf parameters raised numpy's own message ("could not convert
    string to float") naming neither the node vector nor the field: a ``TypeError`` (not numbers) or a
    ``ValueError`` (ragged) naming both."""
    with pytest.raises(TypeError, match=r"leaf: params field 'probs' of Categorical\(num_cats=2\) must hold real "
                                        r"numbers, got an array of dtype <U1"):
        jaxpc.inputs(0, num_nodes=2, dist=D.Categorical(2), params=[["a", "b"]] * 2, name="leaf")
    with pytest.raises(ValueError, match=r"leaf: params field 'probs' of Categorical\(num_cats=2\) must hold "
                                         r"real numbers, got ragged"):
        jaxpc.inputs(0, num_nodes=2, dist=D.Categorical(2), params=[[0.5], [0.5, 0.5]], name="leaf")
    with pytest.raises(TypeError, match=r"g: params field 'mu' of Gaussian.* dtype object"):
        jaxpc.inputs(0, num_nodes=2, dist=D.Gaussian(), params={"mu": [object(), 1.0], "sigma": [1.0, 1.0]}, name="g")
    with pytest.raises(ValueError, match=r"g: params field 'sigma' of Gaussian.* ragged"):
        jaxpc.inputs(0, num_nodes=2, dist=D.Gaussian(), params={"mu": [0.0, 1.0], "sigma": [[1.0], 1.0]}, name="g")
    with pytest.raises(TypeError, match=r"m: params field 'probs' of MaskedCategorical.* dtype <U1"):
        jaxpc.inputs(0, num_nodes=1, dist=D.MaskedCategorical(2), params={"mask": [[0, 2]], "probs": [["a", "b"]]},
                     name="m")
    with pytest.raises(TypeError, match=r"InputNodes#\d+: params field 'probs'"):  # unnamed: the default name
        jaxpc.inputs(0, num_nodes=1, dist=D.Categorical(2), params=[["x", "y"]])
    # booleans and numeric strings were read as numbers (True as 1, "0.5" as 0.5)
    with pytest.raises(TypeError, match=r"leaf: params field 'probs' of Categorical\(num_cats=2\) must hold real "
                                        r"numbers, got booleans"):
        jaxpc.inputs(0, num_nodes=2, dist=D.Categorical(2), params=[[True, False], [False, True]], name="leaf")
    with pytest.raises(TypeError, match=r"g: params field 'mu' of Gaussian.* got booleans"):
        jaxpc.inputs(0, num_nodes=2, dist=D.Gaussian(), params={"mu": [True, False], "sigma": [1.0, 1.0]}, name="g")
    with pytest.raises(TypeError, match=r"b: params field 'p' of Bernoulli.* dtype <U3"):
        jaxpc.inputs(0, num_nodes=2, dist=D.Bernoulli(), params=["0.5", "0.2"], name="b")
    # numbers in any container stay accepted
    leaf = jaxpc.inputs(0, num_nodes=2, dist=D.Categorical(2), params=[(0.25, 0.75), np.array([1, 1])])
    np.testing.assert_allclose(leaf.get_params()["probs"], [[0.25, 0.75], [0.5, 0.5]])


@pytest.mark.parametrize("form", ["dense", pytest.param("topk", marks=slow), pytest.param("grad", marks=slow)])
def test_soft_evidence_leaf_with_no_weight_at_the_observed_value(form):
    """Evidence that gives the observed value weight zero (``-inf``) makes the row impossible: log-likelihood
    ``-inf``, also where no value has weight (``0 / 0``: it was NaN) or the candidates' probabilities are zero, dense
    or top-k, and EM leaves such rows out (it wrote NaN into the sum parameters): the step equals the step on the
    other rows; the evidence gradient is finite (``"grad"``: the dense evidence's)."""
    K, B = 4, 5
    rng = np.random.default_rng(4)
    probs = np.array([[0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]])
    leaf = jaxpc.inputs(0, 2, dist=D.SoftEvidenceCategorical(K), params=probs)
    other = jaxpc.inputs(1, 2, dist=D.Categorical(3), params=[[0.2, 0.3, 0.5], [0.6, 0.3, 0.1]])
    x = np.array([[0, 1], [3, 2], [2, 0], [1, 1], [2, 2]], np.int32)
    if form != "topk":
        e = rng.normal(size=(B, 2, K))
        e[0, 0, :] = -np.inf  # no weight anywhere
        e[2, 0, :] = [-np.inf, -np.inf, 0.5, -np.inf]  # weight only on x = 2; node 0 gives it probability zero
        e[4, 0, 2] = -np.inf  # no weight at the observed value
        evidence, dead = {"categorical_logp": e}, [0, 4]
    else:
        ids = np.tile(np.array([0, 2], np.int32), (B, 2, 1))
        topk = {"ids": ids, "logp": rng.normal(size=(B, 2, 2)), "mask": np.ones((B, 2, 2), bool)}
        topk["mask"][0, 0] = False  # row 0: every candidate masked; rows 1, 3: x = 3, 1 are no candidates
        evidence, dead = {"categorical_topk": topk}, [0, 1, 3]
    with jax.enable_x64(True):
        c = jaxpc.compile(jaxpc.summate(jaxpc.multiply(leaf, other), num_nodes=1, params=W[None]), dtype=jnp.float64)
        if form == "grad":
            _, g = c.flows(c.params, x, evidence=evidence, return_evidence_grad=True)
            assert np.all(np.isfinite(np.asarray(g["categorical_logp"])))
            return
        ll = np.asarray(c.log_prob(c.params, x, evidence=evidence))
        assert np.all(ll[dead] == -np.inf) and np.all(np.isfinite(np.delete(ll, dead)))
        live = np.setdiff1d(np.arange(B), dead)
        sub = jax.tree_util.tree_map(lambda a: np.asarray(a)[live], evidence)
        new = c.em_step(c.params, x, step_size=0.5, pseudocount=0.1, evidence=evidence)
        want = c.em_step(c.params, x[live], step_size=0.5, pseudocount=0.1, evidence=sub)
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12),
                               new, want)
        if form == "dense":
            # row 2, x = (2, 0): only node 1 (weight 0.7) has mass at 2; with all the evidence's weight on 2 its value
            # is log 1, and node 1 of the other leaf gives p(0) = 0.6
            np.testing.assert_allclose(ll[2], np.log(0.7 * 0.6), rtol=1e-12)


def test_unnormalized_categorical_weights_near_the_float64_maximum():
    """Given weights are normalized per row without overflow: ``[1e308, 1e308]`` summed to inf and became
    probabilities ``[0, 0]`` (every value impossible); subnormal weights normalize too."""
    weights = [[1e308, 1e308], [1e308, 1e100], [1e-320, 0.0]]
    leaf = jaxpc.inputs(0, 3, dist=D.Categorical(2), params=weights)
    masked = jaxpc.inputs(1, 3, dist=D.MaskedCategorical(2), params={"mask": [[0, 2]] * 3, "probs": weights})
    with jax.enable_x64(True):
        c = jaxpc.compile(jaxpc.summate(jaxpc.multiply(leaf, masked), num_nodes=1), dtype=jnp.float64)
        for node in (leaf, masked):
            got = c.get_node_params(c.params, node)
            got = got["probs"] if isinstance(got, dict) else got
            np.testing.assert_allclose(np.asarray(got), [[0.5, 0.5], [1.0, 1e-208], [1.0, 0.0]], rtol=1e-14)


# ---- initialization and constraints ----------------------------------------------------------------------------------

def _leaf_zoo():
    """``(root, leaves)``: a product of one vector of 3 nodes of every trainable leaf kind (variables 0..3)."""
    leaves = [jaxpc.inputs(0, 3, dist=D.Gaussian(min_sigma=0.2)), jaxpc.inputs(1, 3, dist=D.Categorical(4)),
              jaxpc.inputs(2, 3, dist=D.DiscreteLogistic((2.0, 6.0), 4)),
              jaxpc.inputs(3, 3, dist=D.MaskedCategorical(4, "range"), params={"mask": [[0, 2], [1, 4], [3, 4]]})]
    return jaxpc.summate(jaxpc.multiply(*leaves), num_nodes=1), leaves


def _check_constraints(c, params, leaves):
    g, cat, dl, mc = (c.get_node_params(params, leaf) for leaf in leaves)
    assert np.all(np.asarray(g["sigma"]) >= 0.2 * (1 - 1e-6))
    np.testing.assert_allclose(np.asarray(cat).sum(axis=1), 1.0, rtol=1e-5)
    assert np.all(np.asarray(dl["s"]) > 0)
    probs, mask = np.asarray(mc["probs"]), np.asarray(mc["mask"])
    assert np.all(probs[~mask] == 0) and np.all(probs[mask] > 0)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)


@slow
def test_initialization_keeps_every_leaf_valid():
    """Seeded host draws (``jaxpc.compile``) and device draws (``init_params``): sigma at least ``min_sigma``,
    categorical rows normalized, masked values zero, logistic locations inside ``val_range`` with scales a quarter of
    its width times ``U[0.5, 1.5)``."""
    root, leaves = _leaf_zoo()
    c = jaxpc.compile(root, seed=2)
    for p in (c.params, c.init_params(jax.random.key(5))):
        _check_constraints(c, p, leaves)
        dl = c.get_node_params(p, leaves[2])
        assert np.all((np.asarray(dl["mu"]) >= 2.0) & (np.asarray(dl["mu"]) < 6.0))
        assert np.all((np.asarray(dl["s"]) >= 0.5 * (1 - 1e-6)) & (np.asarray(dl["s"]) < 1.5 * (1 + 1e-6)))


@slow
def test_em_and_gradient_training_keep_leaf_constraints():
    """``optim.fit`` by EM (step size below one, a pseudocount) and by Adam on renormalized logits: data that pull a
    Gaussian's sigma to zero leave it at ``min_sigma``, categorical rows stay normalized, masked values stay zero."""
    root, leaves = _leaf_zoo()
    c = jaxpc.compile(root, seed=0)
    rng = np.random.default_rng(0)
    N = 128
    x = np.stack([np.full(N, 0.5), rng.integers(0, 4, N), rng.integers(0, 4, N), rng.integers(1, 2, N)], 1)
    x = x.astype(np.float32)
    for kw in ({"step_size": 0.5, "pseudocount": 0.1}, {"optimizer": optax.adam(0.3)}):
        res = optim.fit(c, c.params, x, 15, 64, progress=False, **kw)
        _check_constraints(c, res.params, leaves)
        assert np.isfinite(res.epoch_ll).all()
        c.check_params(res.params)
    g = c.get_node_params(res.params, leaves[0])
    assert np.any(np.asarray(g["sigma"]) < 0.2 * (1 + 1e-5))  # some sigma was pulled to the floor


@pytest.mark.parametrize("dist, params, field", [
    (D.Categorical(num_cats=3), np.array([[0.2, 0.3, 0.5], [0.6, 0.3, 0.1]]), "counts"),
    (D.Gaussian(), {"mu": np.array([-1.0, 2.0]), "sigma": np.array([1.0, 0.5])}, "s0")])
def test_nan_leaf_statistics_give_nan_parameters_not_a_silent_keep(dist, params, field):
    """A leaf's M-step reads a total of exactly 0 as "no mass" (the node keeps its parameters), and NaN statistics as
    NaN parameters, which ``check_params`` names; the other node updates as with clean statistics."""
    c, leaf = _mixture(dist, params, dtype=jnp.float32)
    x = np.array([[0], [2], [1], [2]]) if isinstance(dist, D.Categorical) else np.array([[-1.2], [0.3], [2.5]])
    fl = c.flows(c.params, x.astype(np.int32 if isinstance(dist, D.Categorical) else np.float32))
    kind = dist.name
    bad = jax.tree_util.tree_map(lambda a: a, fl)
    stats = dict(bad["input"][kind])
    stats[field] = stats[field].at[0].set(jnp.nan)
    bad["input"] = {**bad["input"], kind: stats}
    clean, new = c.em_update(c.params, fl, step_size=0.5), c.em_update(c.params, bad, step_size=0.5)
    got = jax.tree_util.tree_leaves(new["input"][kind])
    want = jax.tree_util.tree_leaves(clean["input"][kind])
    for g, w in zip(got, want):
        g = np.asarray(g)
        assert np.isnan(g[0]).all()
        np.testing.assert_allclose(g[1:], np.asarray(w)[1:], rtol=1e-6)
    with pytest.raises(ValueError, match="is nan"):
        c.check_params(new)
