"""Log-space flows and node flows (``Options(logspace_flows=True)``, ``Options(node_flows=True)``) against the
float64 oracle's brute-force flows on random circuits (tied sums and leaves, missing values, sample weights), the
M-step computed from them, flows far below float32's range, and their errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc import distributions, structures

from . import oracle
from .random_circuits import CARD, Generator
from .tiers import cases

B = 16
DISCRETE = ("categorical", "bernoulli", "masked", "indicator", "literal")  # leaves whose statistics are counts
LOG = jaxpc.Options(logspace_flows=True, node_flows=True)
LIN = jaxpc.Options(node_flows=True)


@functools.cache
def make(seed):
    """One compiled circuit per seed for the whole module: its tests share the executables."""
    gen = Generator(seed, num_vars=2 + seed % 3, kinds=DISCRETE)
    return gen, jaxpc.compile(gen.circuit(), seed=seed)


def batch(gen, seed=2):
    """``(x, missing, weights)`` of ``B`` samples, the same whatever ran before."""
    rng = np.random.default_rng(seed)
    x = np.stack([rng.integers(0, CARD[k], B) for k in gen.kinds], axis=1).astype(np.int32)
    return x, rng.random(x.shape) < 0.3, rng.uniform(0.5, 2.0, B)


def dense_node_totals(c, node_tree, ns):
    """The node flows of a source vector: sum nodes ``[num_nodes, num_ch_nodes]`` (each parent's total on its
    edges), input nodes ``[num_nodes]``, through ``get_node_flows``."""
    if ns.is_sum():
        sums = {g: jnp.broadcast_to(v[..., None], v.shape + (c.params["sum"][g].shape[2],))
                for g, v in node_tree["sum"].items()}
        return np.asarray(c.get_node_flows({"sum": sums}, ns), np.float64)
    return np.asarray(c.get_node_flows({"input": {k: {"t": v} for k, v in node_tree["input"].items()}}, ns))


def oracle_totals(c, x, miss, w):
    """``(edge flows, input statistics, node flows)`` by source vector, float64, pooled over tied vectors."""
    sums, ins, _ = oracle.flow_totals(c, c.params, x, miss, weights=w)
    _, node_flows, _ = oracle.flows(c, c.params, x, miss, weights=w)
    nodes = {sid: f.sum(1, keepdims=True) * np.ones_like(f) for sid, f in sums.items()}
    for ns in c.nodes:
        if ns.is_input():
            nodes[ns.source.id] = nodes.get(ns.source.id, 0) + node_flows[ns.id].sum(1)
    return sums, ins, nodes


def assert_log_close(got, ref, mask=None, atol=2e-4):
    """``got`` equals ``log(ref)``: ``-inf`` exactly where ``ref`` is zero, else within ``atol``."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if mask is not None:
        got, ref = got[mask], ref[mask]
    np.testing.assert_array_equal(np.isneginf(got), ref == 0)
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(got[ref > 0], np.log(ref[ref > 0]), atol=atol, rtol=0)


@pytest.mark.parametrize("seed", cases([0, 2, 4], fast=[]))
def test_log_and_node_flows_match_brute_force(seed):
    """Seed 8 has tied leaves and tied sums, and with 0, 2 and 4 every block size, fan-ins of 1 to 3 child blocks,
    dense and blockwise partitions and sparse edges; every batch has missing values and sample weights."""
    gen, c = make(seed)
    x, miss, w = batch(gen)
    sums, ins, nodes = oracle_totals(c, x.astype(np.float64), miss, w)
    lin = c.flows(c.params, x, miss, ll_weights=w, options=LIN)
    lg, ll = c.flows(c.params, x, miss, ll_weights=w, options=LOG, return_ll=True)
    _, ref_ll = oracle.forward(c, c.params, x.astype(np.float64), miss)
    np.testing.assert_allclose(np.asarray(ll), ref_ll, rtol=1e-5, atol=1e-5)
    assert oracle.check_flows(c, lin, sums, ins) > 0
    for ns in c.nodes:
        if ns.source is not ns or not (ns.is_sum() or ns.id in nodes):
            continue
        mask = oracle.edge_mask(ns) if ns.is_sum() else np.ones(ns.num_nodes, bool)
        np.testing.assert_allclose(dense_node_totals(c, lin["node"], ns)[mask], nodes[ns.id][mask], rtol=1e-4,
                                   atol=1e-5)
        assert_log_close(dense_node_totals(c, lg["node"], ns), nodes[ns.id], mask)
        if ns.is_sum():
            assert_log_close(c.get_node_flows(lg, ns), sums[ns.id], mask)
        elif ns.id in ins:
            assert_log_close(c.get_node_flows(lg, ns), ins[ns.id])


# one seed: its circuit holds tied sums and leaves, a sum over a sum, sparse edges, block sizes 1-4, fan-ins of 1 to 3
# child blocks, dense and blockwise partitions and products of three (the update reads only the sums' flows)
@pytest.mark.parametrize("seed", cases([8], fast=[]))
@pytest.mark.full
def test_m_step_from_node_flows_is_em_update(seed):
    """EM's update is ``(flows + c / children) / (node flows + c)``, from linear flows or from log flows."""
    gen, c = make(seed)
    x, miss, w = batch(gen, seed=4)
    lin = c.flows(c.params, x, miss, ll_weights=w, options=LIN)
    lg = c.flows(c.params, x, miss, ll_weights=w, options=LOG)
    checked = 0
    for pc in (0.0, 0.5):
        new = c.em_update(c.params, {"sum": lin["sum"], "input": lin["input"]}, step_size=1.0, pseudocount=pc)
        for ns in c.nodes:
            if not ns.is_sum() or ns.source is not ns:
                continue
            mask = oracle.edge_mask(ns)
            nch = mask.sum(1, keepdims=True)
            ref, old = np.asarray(c.get_node_params(new, ns)), np.asarray(c.get_node_params(c.params, ns))
            F, D = np.asarray(c.get_node_flows(lin, ns)), dense_node_totals(c, lin["node"], ns)
            live = mask & (D + pc > 0)  # nodes without mass keep their weights
            with np.errstate(invalid="ignore", divide="ignore"):
                np.testing.assert_allclose(np.where(live, (F + pc / nch) / (D + pc), old), ref, rtol=1e-4, atol=1e-6)
                if pc == 0:
                    logF, logD = np.asarray(c.get_node_flows(lg, ns)), dense_node_totals(c, lg["node"], ns)
                    np.testing.assert_allclose(np.where(live, np.exp(logF - logD), old), ref, rtol=1e-4, atol=1e-6)
            checked += 1
    assert checked > 2


def underflow_circuit():
    """A root over two products; the first one's leaves give the data (values 1 and 2) probabilities of about
    1e-30 each, so its branch (and the sum below it) carries flows of about 1e-60 per sample: zero in float32,
    about -138 as logarithms."""
    def leaf(v, p):
        return jaxpc.inputs(v, 1, 1, distributions.Categorical(3), params=np.array([[1.0 - 2 * p, p, p]]))

    a, b1, b2 = leaf(0, 1e-30), leaf(1, 1e-30), leaf(1, 2e-30)
    inner = jaxpc.summate(b1, b2, num_node_blocks=1, params=np.array([[0.3, 0.7]]))
    c0 = jaxpc.inputs(0, 1, 1, distributions.Categorical(3), params=np.array([[0.1, 0.45, 0.45]]))
    c1 = jaxpc.inputs(1, 1, 1, distributions.Categorical(3), params=np.array([[0.1, 0.45, 0.45]]))
    root = jaxpc.summate(jaxpc.multiply(a, inner), jaxpc.multiply(c0, c1), num_node_blocks=1,
                         params=np.array([[0.5, 0.5]]))
    return jaxpc.compile(root), inner


@pytest.mark.slow
def test_log_flows_survive_underflow():
    c, inner = underflow_circuit()
    x = np.array([[1, 1], [2, 2], [1, 2]], np.int32)
    sums, _, nodes = oracle_totals(c, x.astype(np.float64), None, None)
    assert 0 < sums[inner.id].max() < 1e-50
    lin = c.flows(c.params, x, options=LIN)
    assert float(jnp.max(c.get_node_flows(lin, inner))) == 0.0  # underflowed
    lg = c.flows(c.params, x, options=LOG)
    assert_log_close(c.get_node_flows(lg, inner), sums[inner.id])
    assert_log_close(dense_node_totals(c, lg["node"], inner), nodes[inner.id])
    # the M-step from log flows moves the rarely used sum to its posterior ratio; linear EM keeps it
    target = np.exp(np.asarray(c.get_node_flows(lg, inner)) - dense_node_totals(c, lg["node"], inner))
    np.testing.assert_allclose(target, sums[inner.id] / sums[inner.id].sum(), rtol=1e-4)
    kept = c.em_update(c.params, {"sum": lin["sum"], "input": lin["input"]})
    np.testing.assert_allclose(np.asarray(c.get_node_params(kept, inner)), [[0.3, 0.7]], rtol=1e-6)


# (the tempered flows: both temperatures at once, element and parameter flows each tempered by its own)
VARIANTS = [dict(propagation="MPE"), dict(propagation="GeneralLL", alpha=1.7),
            dict(eflow_temperature=2.0, pflow_temperature=0.7)]


@pytest.mark.parametrize("opts", cases(VARIANTS, fast=[]), ids=["mpe", "general-ll", "tempered-both"])
def test_log_flows_equal_linear_flows_for_every_propagation(opts):
    """exp(log flows) equals the linear flow pass (checked against autodiff and the oracle elsewhere), on a small
    circuit with tied sums (seed 8's, tied leaves too, compiles in twice the time)."""
    gen, c = make(3)
    x, miss, w = batch(gen, seed=5)
    lin = c.flows(c.params, x, miss, ll_weights=w, options=jaxpc.Options(node_flows=True, **opts))
    lg = c.flows(c.params, x, miss, ll_weights=w, options=jaxpc.Options(logspace_flows=True, node_flows=True, **opts))
    check_exp_equal(lin, lg)


def check_exp_equal(lin, lg, rtol=2e-4, atol=1e-6):
    a, b = jax.tree_util.tree_leaves_with_path(lin), jax.tree_util.tree_leaves_with_path(lg)
    assert [p for p, _ in a] == [p for p, _ in b]
    for (path, u), (_, v) in zip(a, b):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        np.testing.assert_allclose(np.exp(v), u, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hmm", "hclt", "pd"])
def test_log_flows_on_structures(name):
    """On the structures' layouts (an HMM's chain, whose linear flows come from the forward-backward scan; a tree;
    a PD's fan-ins) with soft evidence on an HMM, the log pass in pieces of one parent block (``gather_chunk=1``:
    the HMM's dense layers too)."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 3, (100, 4))
    sec = distributions.SoftEvidenceCategorical(3)
    root = {"hmm": lambda: structures.GeneralizedHMM(4, 4, sec, block_size=2),
            "hclt": lambda: structures.HCLT(data, 4, input_dist=distributions.Categorical(3), block_size=2),
            "pd": lambda: structures.PD((2, 2), 4, split_intervals=1, input_dist=distributions.Categorical(3),
                                        block_size=2)}[name]()
    c = jaxpc.compile(root)
    x = data[:8].astype(np.int32)
    ev = {"categorical_logp": rng.normal(size=(8, 4, 3)).astype(np.float32)} if name == "hmm" else None
    check_exp_equal(c.flows(c.params, x, options=LIN, evidence=ev),
                    c.flows(c.params, x, options=LOG.replace(gather_chunk=1), evidence=ev))


@pytest.mark.slow
@pytest.mark.full
def test_log_flows_on_a_mesh():
    """The data-parallel flows add log flows across devices in the log domain."""
    gen, c = make(8)
    x, miss, w = batch(gen)
    mesh = jaxpc.parallel.data_mesh()
    got = jaxpc.parallel.flows(c, c.params, x, miss, ll_weights=w, mesh=mesh, options=LOG)
    check_exp_equal(c.flows(c.params, x, miss, ll_weights=w, options=LIN), got)


def test_flow_variant_errors():
    with pytest.raises(TypeError, match="logspace_flows must be a bool, got 'yes'"):
        jaxpc.Options(logspace_flows="yes")
    with pytest.raises(TypeError, match="node_flows must be a bool, got 1"):
        jaxpc.Options(node_flows=1)
    with pytest.raises(ValueError, match="logspace_flows=True returns logarithms.*negate_flows"):
        jaxpc.Options(logspace_flows=True, negate_flows=True)
    with pytest.raises(ValueError, match="node_flows=True needs compute_param_flows=True"):
        jaxpc.Options(node_flows=True, compute_param_flows=False)
    gen, c = make(8)
    x, _, _ = batch(gen)
    with pytest.raises(ValueError, match=r"em_step: Options\(logspace_flows=True\) gives log flows"):
        c.em_step(c.params, x, options=LOG)
    g = jaxpc.compile(structures.HMM(3, 2, 4))
    gates = {"sum_gates": {g.layout.sum_groups[0].key: np.zeros((2, g.layout.sum_groups[0].num_blocks), np.float32)}}
    with pytest.raises(ValueError, match="logspace_flows: per-sample sum parameters"):
        g.flows(g.params, np.zeros((2, 3), np.int32), options=LOG, evidence=gates)
    with pytest.raises(ValueError, match="logspace_flows=True computes flows only"):
        g.flows(g.params, np.zeros((2, 3), np.int32), options=LOG, evidence=gates, return_evidence_grad=True)
    a = jaxpc.inputs(0, 1, 2, distributions.Gaussian())
    b = jaxpc.inputs(1, 1, 2, distributions.Gaussian())
    gc = jaxpc.compile(jaxpc.summate(jaxpc.multiply(a, b), num_node_blocks=1))
    with pytest.raises(ValueError, match=r"logspace_flows: the expected statistics of Gaussian.* are moments"):
        gc.flows(gc.params, np.zeros((2, 2), np.float32), options=LOG)


@pytest.mark.slow
def test_dense_log_flows_read_minus_inf_where_a_vector_has_no_edge():
    """``get_node_flows(..., logspace=True)``: a sum vector's edges that do not exist are zero counts, -inf in log
    space (linear flows: 0)."""
    cat = distributions.Categorical(num_cats=3)
    a = jaxpc.inputs(0, num_node_blocks=2, block_size=2, dist=cat)
    b = jaxpc.inputs(1, num_node_blocks=2, block_size=2, dist=cat)
    s = jaxpc.summate(jaxpc.multiply(a, b), num_node_blocks=2, block_size=2, edge_ids=np.array([[0, 1, 1], [0, 0, 1]]))
    c = jaxpc.compile(jaxpc.summate(s, num_node_blocks=1, block_size=1))
    x = np.array([[0, 1], [2, 2], [1, 0]], np.int32)
    lin = np.asarray(c.get_node_flows(c.flows(c.params, x), s))
    log = np.asarray(c.get_node_flows(c.flows(c.params, x, options=jaxpc.Options(logspace_flows=True)), s,
                                      logspace=True))
    assert np.isneginf(log[:2, 2:]).all() and (lin[:2, 2:] == 0).all()
    np.testing.assert_allclose(np.exp(log), lin, rtol=1e-5, atol=1e-7)
