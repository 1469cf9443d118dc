"""Edges of log-space flows (``Options(logspace_flows=True)``) and of what EM reads as counts: the derivative of log
flows with respect to a sample weight of exactly 0, log flows rebuilt into a plain dict and handed to the EM update,
and soft EM's counts of a missing soft-evidence categorical under per-call evidence."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc import distributions
from jaxpc.engine import em
from jaxpc.engine.logflows import LogFlows, to_counts

from .tiers import slow

LIN = jaxpc.Options()
LOG = jaxpc.Options(logspace_flows=True)


@functools.cache
def small():
    cat = distributions.Categorical(num_cats=3)
    a = jaxpc.inputs(0, num_node_blocks=2, block_size=2, dist=cat)
    b = jaxpc.inputs(1, num_node_blocks=2, block_size=2, dist=cat)
    s = jaxpc.summate(jaxpc.multiply(a, b), num_node_blocks=2, block_size=2)
    return jaxpc.compile(jaxpc.summate(s, num_node_blocks=1, block_size=1), seed=0)


# row 1 (weight 0 below) shares its value of variable 1 with row 3 and is alone with value 2 of variable 0
X = np.array([[0, 1], [2, 0], [1, 2], [0, 0], [1, 1]], np.int32)
W = np.array([1.0, 0.0, 2.0, 0.5, 1.5], np.float32)


def _flows(c, params, w, options):
    fl, _ = em.flows_and_ll(c.layout, c.tables, params, jnp.asarray(X), None, w, options)
    return to_counts(fl) if options.logspace_flows else fl


def _at(tree, path):
    return np.asarray(functools.reduce(lambda t, k: t[k.key], path, tree))


@slow
def test_log_flows_derivative_in_a_zero_weight_is_the_samples_flows():
    """The counts are linear in the weights, so ``d counts / d w_b`` is sample ``b``'s flows (its counts at weight
    1), also at ``w_b = 0``, where ``log w_b`` at the root made it ``0 * inf = NaN``. A count that only the
    zero-weight sample reaches is 0 with derivative 0 (the log domain's derivative at ``-inf``)."""
    c = small()

    @jax.jit
    def run(w):
        log = functools.partial(_flows, c, c.params, options=LOG)
        per_sample = jax.vmap(functools.partial(_flows, c, c.params, options=LIN))(jnp.eye(len(W), dtype=w.dtype))
        return log(w), per_sample, jax.jacrev(log)(w)

    counts, per_sample, jac = run(jnp.asarray(W))
    for path, g in jax.tree_util.tree_flatten_with_path(jac)[0]:
        where = jax.tree_util.keystr(path)
        np.testing.assert_allclose(_at(counts, path), np.tensordot(W, _at(per_sample, path), 1), rtol=1e-5,
                                   atol=1e-6, err_msg=where)
        assert np.isfinite(np.asarray(g)).all(), where
        want = np.moveaxis(np.where(_at(counts, path) > 0, _at(per_sample, path), 0.0), 0, -1)
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-4, atol=1e-6, err_msg=where)
    # the zero-weight sample's count of value 2 of variable 0 is such a count (its sum-edge flows are not)
    assert (np.asarray(counts["input"]["categorical"]["counts"])[:4, 2] == 0).all()
    assert (np.asarray(jac["sum"][next(iter(counts["sum"]))])[..., 1] > 0).any()


@slow
def test_log_flows_params_derivative_with_a_zero_weight():
    """The derivative of the counts with respect to the parameters stays finite with a zero weight, and is the
    linear flows' (the zero-weight sample takes no part)."""
    c = small()

    @jax.jit
    def grads(params, w):
        def total(params, options):
            return sum(jnp.sum(a) for a in jax.tree.leaves(_flows(c, params, w, options)))
        return jax.grad(total)(params, LOG), jax.grad(total)(params, LIN)

    got, want = grads(c.params, jnp.asarray(W))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@slow
def test_em_update_names_log_flows_in_a_plain_dict():
    """Log flows rebuilt into a plain dict (``dict(flows)``, a dict comprehension) lose the ``LogFlows`` type; the
    count check refuses their negative entries and says they look like log flows, naming ``to_counts``, on the
    device and on the host. Negated flows (all ``<= 0``) keep the message that names both."""
    c = small()
    log = c.flows(c.params, X, options=LOG)
    match = r"flows must be expected counts \(>= 0\).*look like log flows.*to_counts"
    for plain in (dict(log), {k: v for k, v in log.items()}):
        assert type(plain) is dict
        with pytest.raises(ValueError, match=r"checked on the device.*look like log flows.*to_counts"):
            c.em_update(c.params, plain, validate="sync")
    with pytest.raises(ValueError, match=match):
        c.em_update(c.params, jax.tree.map(np.asarray, dict(log)))
    want = c.em_update(c.params, c.flows(c.params, X))  # what the message says to do
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(c.em_update(c.params, to_counts(LogFlows(dict(log)))))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)
    neg = jax.tree.map(lambda a: -np.asarray(a), c.flows(c.params, X))
    with pytest.raises(ValueError, match=r"Negated flows .* or log flows"):
        c.em_update(c.params, neg)


# ---- soft EM: a missing soft-evidence categorical under per-call evidence -----------------------------------

THETA = np.array([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3]])


@functools.cache
def soft_circuit(runs: bool):
    """A soft-evidence categorical over variable 0 beside a categorical over variable 1 (nodes in runs over one
    variable: the counts of runs), or soft-evidence leaves over both variables, one node each (the counts' scatter)."""
    soft = distributions.SoftEvidenceCategorical(3)
    if runs:
        a = jaxpc.inputs(0, 1, 2, soft, params=THETA)
        h = jaxpc.inputs(1, 1, 2, distributions.Categorical(3), params=np.array([[0.3, 0.5, 0.2], [0.6, 0.2, 0.2]]))
        root = jaxpc.summate(jaxpc.multiply(a, h), num_nodes=1, params=np.array([[0.45, 0.55]]))
    else:
        leaf = [jaxpc.inputs(v, 1, 1, soft, params=THETA[i:i + 1]) for v, i in ((0, 0), (1, 1), (1, 0), (0, 1))]
        root = jaxpc.summate(jaxpc.multiply(leaf[0], leaf[1]), jaxpc.multiply(leaf[3], leaf[2]), num_nodes=1,
                             params=np.array([[0.45, 0.55]]))
    c = jaxpc.compile(root)
    assert {s.run for s in c.layout.input_layers} == ({2} if runs else {1})
    return c


def _evidence(form: str):
    e = np.log(np.array([[0.05, 0.15, 0.8], [0.7, 0.05, 0.25], [0.3, 0.3, 0.4], [0.02, 0.08, 0.9]]))
    e = np.stack([e, e[::-1]], axis=1)  # [B, V, K]
    if form == "dense":
        return {"categorical_logp": e.astype(np.float32)}
    ids = np.array([[2, 0, 1]] * 4, np.int32)[:, None, :].repeat(2, axis=1)  # candidates out of value order
    mask = np.ones((4, 2, 3), bool)
    mask[1, 0, 2] = False  # row 1, variable 0: value 1 has no weight
    return {"categorical_topk": {"ids": ids, "logp": np.take_along_axis(e, ids, 2).astype(np.float32), "mask": mask}}


def _brute_counts(c, x, miss, ev):
    """Soft EM's expected counts by enumeration: every completion of a row's missing values, observed (its values'
    counts), weighted by its posterior ``p(completion, observed) / p(observed)`` under the same evidence (every
    leaf is normalized, so the missing row's likelihood is the sum over its completions)."""
    B, V = x.shape
    ll = np.asarray(c.log_prob(c.params, x, miss, evidence=ev), np.float64)
    rows, xs, ws = [], [], []
    for b in range(B):
        free = np.flatnonzero(miss[b])
        for vals in itertools.product(range(3), repeat=len(free)):
            xb = x[b].copy()
            xb[free] = vals
            rows.append(b)
            xs.append(xb)
    xs = np.array(xs, np.int32)
    rep = jax.tree.map(lambda a: np.asarray(a)[rows], ev)
    llc = np.asarray(c.log_prob(c.params, xs, evidence=rep), np.float64)
    ws = np.exp(llc - ll[rows]).astype(np.float32)
    assert np.allclose(np.bincount(rows, ws), 1.0, atol=1e-5)
    return c.flows(c.params, xs, ll_weights=ws, evidence=rep)


@slow
@pytest.mark.parametrize("runs", [True, False], ids=["runs", "scatter"])
@pytest.mark.parametrize("form", ["dense", "topk"])
def test_soft_em_counts_a_missing_soft_evidence_value_by_its_reweighted_pmf(runs, form, monkeypatch):
    """A missing soft-evidence categorical's value is ``log sum_k q(k)`` with ``q(k) = theta[k] exp(e[k]) / Z``
    (0 under ``"LL"`` whatever ``theta``), so soft EM counts each (node, sample)'s flow times ``q``, its value's
    posterior, as enumerating the completions observed does; it counted ``theta`` instead, the evidence ignored.
    Linear and log flows; the scatter's layer of 4 nodes makes ``q`` in chunks of 3 nodes (one padded)."""
    if not runs:
        monkeypatch.setattr("jaxpc.distributions.evidence.CHUNK_BUDGET", 3 * 4 * 3)
    c = soft_circuit(runs)
    x = np.array([[0, 1], [0, 0], [2, 1], [0, 1]], np.int32)
    miss = np.array([[True, False], [True, True], [False, False], [False, True]])
    ev = _evidence(form)
    want = _brute_counts(c, x, miss, ev)["input"]
    got = c.flows(c.params, x, miss, evidence=ev)["input"]
    log = to_counts(c.flows(c.params, x, miss, evidence=ev, options=LOG))["input"]
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]["counts"]), np.asarray(want[k]["counts"]), rtol=1e-5,
                                   atol=1e-6, err_msg=k)
        np.testing.assert_allclose(np.asarray(log[k]["counts"]), np.asarray(want[k]["counts"]), rtol=1e-5,
                                   atol=1e-6, err_msg=f"log {k}")
