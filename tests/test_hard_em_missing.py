"""Hard EM (``Options(propagation="MPE")``) with missing values, leaf by leaf: a missing variable counts what the same
variable observed at its decoded value (``circuit.mpe``) counts, sum flows and leaf statistics alike; soft EM keeps
counting a missing value's whole distribution."""

import math

import jax
import numpy as np
import pytest

import jaxpc
from jaxpc import distributions, structures

HARD = jaxpc.Options(propagation="MPE")
W = np.array([1.0, 2.0, 0.5, 1.5, 0.75])


def _leaves():
    """One vector of two nodes over each of variables ``0 ..``, a leaf type each (indicators through a sum over them),
    and each variable's values per row: every input distribution's hard-EM statistics in one circuit."""
    cat = np.array([[0.2, 0.5, 0.3], [0.4, 0.2, 0.4]])
    spec = [(distributions.Categorical(3), cat, [1, 0, 2, 1, 1]),
            (distributions.Bernoulli(), np.array([0.3, 0.6]), [1, 0, 0, 1, 1]),
            (distributions.MaskedCategorical(4, "full_mask"), {"mask": np.array([[0, 1, 1, 1], [1, 1, 0, 1]]),
                                                               "probs": np.array([[0.0, 0.2, 0.3, 0.5],
                                                                                  [0.1, 0.6, 0.0, 0.3]])},
             [1, 3, 0, 1, 2]),
            (distributions.SoftEvidenceCategorical(3), cat[::-1], [2, 0, 1, 1, 0]),
            (distributions.Gaussian(), {"mu": np.array([-1.0, 2.0]), "sigma": np.array([0.5, 1.5])},
             [0.3, -2.0, 1.1, 0.0, 2.5]),
            # node 0's most probable bin, 0, is not the bin that holds its mean
            (distributions.DiscreteLogistic((0.0, 8.0), 8), {"mu": np.array([1.3, 6.6]), "s": np.array([0.7, 2.0])},
             [3, 0, 6, 1, 7])]
    vecs = [jaxpc.inputs(v, 1, 2, d, params=p) for v, (d, p, _) in enumerate(spec)]
    ind = jaxpc.inputs(len(spec), 1, 3, distributions.Indicator(3))
    mix = np.array([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3]])
    vecs.append(jaxpc.summate(ind, num_node_blocks=1, block_size=2, params=mix))
    vals = [v for _, _, v in spec] + [[2, 0, 1, 1, 0]]
    return vecs, np.array(vals, np.float32).T


@pytest.mark.slow
@pytest.mark.full
def test_hard_em_counts_a_missing_value_as_its_decoded_value_observed():
    """Every input distribution: hard EM's update with missing values equals its update with the values ``mpe``
    decodes observed, with sample weights, a step size and a pseudocount. The circuit is a two-component mixture of
    a product of one leaf vector per variable, so that rows decode through either component."""
    vecs, x = _leaves()
    c = jaxpc.compile(jaxpc.summate(jaxpc.multiply(*vecs), num_nodes=1, params=np.array([[0.45, 0.55]])))
    miss = np.random.default_rng(1).random(x.shape) < 0.5
    miss[3] = True
    _assert_same_step(c, c.params, x, miss, step_size=0.7, pseudocount=0.1)


def _mixture():
    """A two-component mixture of ``discrete logistic(v0) x categorical(v1)``."""
    d = distributions.DiscreteLogistic((0.0, 8.0), 8)  # node 0's most probable bin, 0, is not its mean's
    g = jaxpc.inputs(0, 1, 2, d, params={"mu": np.array([1.3, 5.9]), "s": np.array([0.7, 1.6])})
    h = jaxpc.inputs(1, 1, 2, distributions.Categorical(2), params=np.array([[0.3, 0.7], [0.8, 0.2]]))
    c = jaxpc.compile(jaxpc.summate(jaxpc.multiply(g, h), num_nodes=1, params=np.array([[0.45, 0.55]])))
    x = np.array([[3, 1], [0, 0], [6, 1], [0, 0], [1, 1]], np.int32)
    miss = np.array([[True, False], [True, False], [False, False], [True, True], [False, True]])
    return c, g, x, miss


def _assert_same_step(c, params, x, miss, weights=W, **kw):
    """Hard EM with ``miss`` equals hard EM on the decoded completion of ``x`` with nothing missing."""
    decoded = np.asarray(c.mpe(params, x, miss)[0])
    np.testing.assert_array_equal(decoded[~miss], x[~miss])
    got = c.em_step(params, x, miss, ll_weights=weights, options=HARD, **kw)
    want = c.em_step(params, decoded, ll_weights=weights, options=HARD, **kw)
    flat_got, flat_want = (jax.tree_util.tree_flatten_with_path(t)[0] for t in (got, want))
    for (path, a), (_, b) in zip(flat_got, flat_want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7,
                                   err_msg=jax.tree_util.keystr(path))


def test_hard_em_counts_a_missing_discrete_logistic_at_its_decoded_bin():
    """A missing discretized logistic under hard EM counts the center of its first most probable bin (an edge bin
    can be it while the mean lies in another) with no spread: ``s1 += F c``, ``s2 += F c^2`` and ``m2 +=
    F (c - mu)^2``, as that bin observed counts; the trained update is the decoded completion's."""
    c, leaf, x, miss = _mixture()
    decoded = np.asarray(c.mpe(c.params, x, miss)[0])
    assert decoded[0, 0] == 0 or decoded[3, 0] == 0  # a decoded bin that is not the mean's
    got = c.flows(c.params, x, miss, ll_weights=W, options=HARD)
    want = c.flows(c.params, decoded, ll_weights=W, options=HARD)
    for k in ("s0", "s1", "s2", "m2"):
        np.testing.assert_allclose(np.asarray(c.get_node_flows(got, leaf)[k]),
                                   np.asarray(c.get_node_flows(want, leaf)[k]), rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.slow
def test_hard_em_of_tied_discrete_logistic_emissions_counts_decoded_bins():
    """An HMM whose discretized logistic emissions are tied across steps (statistics by ``suff_stats`` over shared
    rows, not by runs): hard EM with missing steps equals hard EM on the ``mpe`` completion, with edge bins decoded
    (the modes of wide nodes) that do not hold their node's mean."""
    c = jaxpc.compile(structures.GeneralizedHMM(4, 2, distributions.DiscreteLogistic((-2.0, 2.0), 5)), seed=2)
    assert [s.run for s in c.layout.input_layers] == [1]
    rng = np.random.default_rng(0)
    x = rng.integers(0, 5, (6, 4)).astype(np.int32)
    miss = rng.random((6, 4)) < 0.4
    miss[0] = True
    decoded = np.asarray(c.mpe(c.params, x, miss)[0])
    assert set(decoded[miss].tolist()) & {0, 4}
    _assert_same_step(c, c.params, x, miss, weights=np.ones(6), pseudocount=0.1)


def test_hard_em_of_a_missing_discrete_logistic_matches_the_decoded_bins_moments():
    """The statistics of a lone discretized logistic leaf with every value missing, against the formulas: hard EM
    counts each node's first most probable bin's center ``c``, soft EM the current distribution's moments (``s1 = F
    mu``, ``s2 = F (mu^2 + var)``, ``m2 = F var``, ``var = (pi s)^2 / 3``)."""
    mu, s = np.array([1.3, 6.6, 4.2]), np.array([0.7, 2.0, 0.3])
    d = distributions.DiscreteLogistic((0.0, 8.0), 8)
    leaf = jaxpc.inputs(0, 1, 3, d, params={"mu": mu, "s": s})
    c = jaxpc.compile(jaxpc.summate(leaf, num_nodes=1, params=np.array([[0.2, 0.3, 0.5]])))
    x = np.zeros((2, 1), np.int32)
    miss = np.ones((2, 1), bool)
    edges = np.concatenate([[-np.inf], np.arange(1.0, 8.0), [np.inf]])
    cdf = 1.0 / (1.0 + np.exp(-(edges[None, :] - mu[:, None]) / s[:, None]))
    centers = 0.5 + np.arange(8.0)
    c_hat = centers[np.argmax(np.diff(cdf, axis=1), axis=1)]
    np.testing.assert_array_equal(c_hat, [0.5, 7.5, 4.5])  # the first two: not the bin that holds the mean
    var = (math.pi * s) ** 2 / 3.0
    for opts, (s1, s2, m2) in ((HARD, (c_hat, c_hat ** 2, (c_hat - mu) ** 2)),
                               (jaxpc.Options(), (mu, mu ** 2 + var, var))):
        fl = c.flows(c.params, x, miss, options=opts)
        F = np.asarray(c.get_node_flows(fl, leaf)["s0"], np.float64)
        got = c.get_node_flows(fl, leaf)
        for k, want in (("s1", s1), ("s2", s2), ("m2", m2)):
            np.testing.assert_allclose(np.asarray(got[k]), F * want, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{opts.propagation} {k}")


@pytest.mark.slow
@pytest.mark.parametrize("form", ["dense", "topk"])
def test_hard_em_under_soft_evidence_counts_the_reweighted_decoding(form):
    """A missing soft-evidence categorical under hard EM with per-call evidence counts the value the max-product pass
    takes, the first most probable value of the reweighted pmf ``theta[k] exp(e[k])`` per sample (here never the
    node's own most probable value), as that value observed under the same evidence counts; log-space flows too.
    The decoded value is found by enumeration: the completion of largest max-product value."""
    theta = np.array([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])
    a = jaxpc.inputs(0, 1, 2, distributions.SoftEvidenceCategorical(3), params=theta)
    h = jaxpc.inputs(1, 1, 2, distributions.Categorical(2), params=np.array([[0.3, 0.7], [0.8, 0.2]]))
    c = jaxpc.compile(jaxpc.summate(jaxpc.multiply(a, h), num_nodes=1, params=np.array([[0.45, 0.55]])))
    B = 4
    x = np.array([[0, 1], [0, 0], [2, 1], [0, 1]], np.int32)
    miss = np.array([[True, False], [True, False], [False, False], [True, True]])
    e = np.log(np.array([[0.05, 0.15, 0.8], [0.7, 0.05, 0.25], [0.3, 0.3, 0.4], [0.02, 0.08, 0.9]]))
    if form == "dense":
        ev = {"categorical_logp": e[:, None, :].repeat(2, axis=1).astype(np.float32)}
    else:  # candidates out of value order, one masked
        ids = np.array([[2, 0, 1]] * B, np.int32)[:, None, :].repeat(2, axis=1)
        mask = np.ones((B, 2, 3), bool)
        mask[1, 0, 2] = False  # row 1: value 1 has no weight
        ev = {"categorical_topk": {"ids": ids, "logp": np.take_along_axis(e[:, None, :].repeat(2, 1), ids, 2)
                                   .astype(np.float32), "mask": mask}}
    best = np.stack([np.asarray(c.log_prob(c.params, np.where(miss, [k, 0], x).astype(np.int32),
                                           miss & [False, True], propagation="MPE", evidence=ev)) for k in range(3)])
    decoded = np.where(miss, [0, 0], x)
    decoded[:, 0] = np.where(miss[:, 0], np.argmax(best, axis=0), x[:, 0])
    assert (decoded[miss[:, 0], 0] != 0).all()  # each node's own most probable value is 0 or 1, not the decoding's
    got = c.flows(c.params, x, miss, options=HARD, evidence=ev)
    want = c.flows(c.params, decoded, miss & [False, True], options=HARD, evidence=ev)
    np.testing.assert_allclose(np.asarray(c.get_node_flows(got, a)), np.asarray(c.get_node_flows(want, a)),
                               rtol=1e-6, atol=1e-7)
    log = jaxpc.Options(propagation="MPE", logspace_flows=True)
    np.testing.assert_allclose(np.exp(np.asarray(c.get_node_flows(c.flows(c.params, x, miss, options=log,
                                                                          evidence=ev), a))),
                               np.asarray(c.get_node_flows(want, a)), rtol=1e-5, atol=1e-7)
