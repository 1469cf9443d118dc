"""Log flows (``Options(logspace_flows=True)``) come back as :class:`jaxpc.engine.logflows.LogFlows`, which the EM
update refuses instead of reading logarithms as counts; ``Circuit.em_update`` refuses negative counts (negated
flows) on the host and on the device."""

import copy
import functools
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc.engine import em
from jaxpc.engine.logflows import LogFlows, to_counts

LOG = jaxpc.Options(logspace_flows=True)


@functools.cache
def small():
    """``(circuit, s)``: a sum vector ``s`` with edges missing between its blocks, under a root sum; one per module
    (its tests share the executables)."""
    cat = jaxpc.distributions.Categorical(num_cats=3)
    a = jaxpc.inputs(0, num_node_blocks=2, block_size=2, dist=cat)
    b = jaxpc.inputs(1, num_node_blocks=2, block_size=2, dist=cat)
    s = jaxpc.summate(jaxpc.multiply(a, b), num_node_blocks=2, block_size=2, edge_ids=np.array([[0, 1, 1], [0, 0, 1]]))
    return jaxpc.compile(jaxpc.summate(s, num_node_blocks=1, block_size=1), seed=0), s


def data(n=8):
    return np.random.default_rng(0).integers(0, 3, (n, 2)).astype(np.int32)


@pytest.mark.slow
def test_log_flows_are_log_flows_through_jit_and_tree_map():
    c = small()[0]
    lin, log = c.flows(c.params, data()), c.flows(c.params, data(), options=LOG)
    assert type(lin) is dict and type(log) is LogFlows
    assert set(log) == {"sum", "input"} and set(log["sum"]) == set(lin["sum"])  # read as the flows' dict
    assert repr(log).startswith("LogFlows(")
    assert type(jax.jit(lambda f: f)(log)) is LogFlows
    both = jax.tree.map(jnp.logaddexp, log, log)  # two batches' log flows, added in the log domain
    assert type(both) is LogFlows
    g = next(iter(log["sum"]))
    np.testing.assert_allclose(np.asarray(both["sum"][g]), np.asarray(log["sum"][g]) + np.log(2.0), rtol=1e-5)
    with pytest.raises(ValueError):  # linear and log flows do not map together
        jax.tree.map(jnp.add, lin, log)
    _, treedef = jax.tree_util.tree_flatten(log)
    assert pickle.loads(pickle.dumps(treedef)) == treedef  # (stored executables pickle their output trees)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(log)[0]]
    assert any(p.startswith("['sum']") for p in paths)


def test_em_update_refuses_log_flows_and_to_counts_converts():
    c = small()[0]
    x = data()
    lin, log = c.flows(c.params, x), c.flows(c.params, x, options=LOG)
    with pytest.raises(ValueError, match=r"circuit.em_update: flows are log flows.*to_counts"):
        c.em_update(c.params, log)
    with pytest.raises(ValueError, match=r"em_update: flows are log flows"):  # the engine's pure update too
        jax.jit(lambda p, f: em.em_update(c.layout, c.tables, p, f, 1.0, 0.0))(c.params, log)
    counts = to_counts(log)
    assert type(counts) is dict
    want, got = c.em_update(c.params, lin), c.em_update(c.params, counts)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)
    with pytest.raises(TypeError, match="to_counts takes log flows"):
        to_counts(lin)


@pytest.mark.slow
def test_data_parallel_log_flows_are_refused_by_em_update():
    c = small()[0]
    log = jaxpc.parallel.flows(c, c.params, data(), options=LOG)
    assert type(log) is LogFlows
    with pytest.raises(ValueError, match="flows are log flows"):
        c.em_update(c.params, log)


def test_get_node_flows_reads_log_flows_as_logs():
    """A sum vector's missing edges read -inf from log flows without ``logspace=True``; ``logspace=False`` with log
    flows is refused."""
    c, s = small()
    log = c.flows(c.params, data(), options=LOG)
    got = np.asarray(c.get_node_flows(log, s))
    assert np.isneginf(got[:2, 2:]).all()
    np.testing.assert_array_equal(got, np.asarray(c.get_node_flows(log, s, logspace=True)))
    with pytest.raises(ValueError, match="logspace=False reads them as counts"):
        c.get_node_flows(log, s, logspace=False)
    with pytest.raises(TypeError, match="logspace must be a bool"):
        c.get_node_flows(log, s, logspace="yes")


def test_em_update_refuses_negated_flows():
    """Negated flows (the gradient of a negative log-likelihood) were read as counts; now a ``ValueError`` names the
    first negative entry: numpy flows at once, device flows at the circuit's next call (or this one, "sync")."""
    c = small()[0]
    x = data()
    lin = c.flows(c.params, x)
    neg = jax.tree.map(jnp.negative, lin)
    g = sorted(lin["sum"])[0]
    match = rf"circuit.em_update: flows must be expected counts \(>= 0\); flows\['sum'\]\['{g}'\]\[0, 0, 0\]"
    with pytest.raises(ValueError, match=match):
        c.em_update(c.params, jax.tree.map(np.asarray, neg))
    c.em_update(c.params, neg)
    with pytest.raises(ValueError, match=match + r".*checked on the device"):
        c.raise_pending()
    with pytest.raises(ValueError, match=match):
        c.em_update(c.params, neg, validate="sync")
    c.em_update(c.params, neg, validate=False)  # not checked
    c.raise_pending()
    with pytest.raises(ValueError, match="validate must be True, False or 'sync'"):
        c.em_update(c.params, lin, validate="yes")
    # input counts alone
    only_in = {"sum": lin["sum"], "input": jax.tree.map(jnp.negative, lin["input"])}
    with pytest.raises(ValueError, match=r"flows\['input'\]\[.*\]\['counts'\]"):
        c.em_update(c.params, only_in, validate="sync")
    c.em_update(c.params, lin, validate="sync")  # linear flows pass
    # inside a user's jit the flows are tracers: nothing to raise from
    jax.jit(lambda p, f: c.em_update(p, f))(c.params, neg)
    c.raise_pending()


def test_gaussian_moments_may_be_negative():
    """Only counts are checked: a Gaussian's first moment ``s1`` of negative data is negative and valid."""
    a = jaxpc.inputs(0, 1, 2, jaxpc.distributions.Gaussian())
    b = jaxpc.inputs(1, 1, 2, jaxpc.distributions.Gaussian())
    c = jaxpc.compile(jaxpc.summate(jaxpc.multiply(a, b), num_node_blocks=1))
    x = -np.abs(np.random.default_rng(0).normal(size=(8, 2))).astype(np.float32) - 1.0
    fl = c.flows(c.params, x)
    assert any(float(jnp.min(s["s1"])) < 0 for s in fl["input"].values())
    c.em_update(c.params, fl, validate="sync")


def test_optim_em_transformations_refuse_log_flows():
    """The EM transformations rebuild the flows' dict before their update: they refuse log flows first."""
    c = small()[0]
    log = c.flows(c.params, data(), options=LOG)
    for tx in (jaxpc.optim.em(c), jaxpc.optim.full_batch_em(c, 2), jaxpc.optim.anemone(c)):
        with pytest.raises(ValueError, match="jaxpc.optim EM update: flows are log flows"):
            tx.update(log, tx.init(c.params), c.params)


def test_log_flows_copy_keeps_the_marker():
    circuit = small()[0]
    log = circuit.flows(circuit.params, data(), options=LOG)
    with pytest.raises(ValueError, match="log flows"):
        circuit.em_update(circuit.params, log.copy(), validate=False)


def test_log_flows_round_trips():
    circuit = small()[0]
    log = circuit.flows(circuit.params, data(), options=jaxpc.Options(logspace_flows=True, node_flows=True))
    for got in (jax.device_get(log), pickle.loads(pickle.dumps(log)), copy.deepcopy(log),
                jax.tree.map(lambda a: a, log, is_leaf=lambda t: isinstance(t, dict) and "sum" in t)):
        assert type(got) is LogFlows
