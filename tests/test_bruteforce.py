"""Compiled circuits against brute-force enumeration and the float64 oracle, on random circuits."""

import jax
import numpy as np
import pytest

import jaxpc
from jaxpc import distributions
from jaxpc.nodes import topological_order

from . import oracle
from .random_circuits import Generator
from .tiers import cases

# Seeds whose random circuits together hold every distribution, tied sums and inputs, sparse edges, block sizes 1-4
# (test_generator_covers_everything checks these), sums over sums, products of three, fan-ins of 1 to 6 child blocks,
# dense and blockwise partitions and 2 to 4 variables: 0 and 16 in the fast tier, the rest slow.
SEEDS = [0, 16, 1, 8, 11, 14]
B = 16  # one batch size everywhere: tests share the circuit's compiled executables


def make(seed, **kw):
    gen = Generator(seed, num_vars=2 + seed % 3, **kw)
    root = gen.circuit()
    circuit = jaxpc.compile(root, seed=seed)
    return gen, circuit


def as_input(gen, x):
    return x if "gaussian" in gen.kinds else x.astype(np.int32)


@pytest.fixture(scope="module", params=cases(SEEDS, fast=[0, 16]))
def case(request):
    gen, circuit = make(request.param)
    return gen, circuit


def test_generator_covers_everything():
    """The circuits of SEEDS (as :func:`make` builds them) hold every feature of the generator."""
    kinds, tied_sum, tied_in, sparse, bsizes = set(), 0, 0, 0, set()
    for s in SEEDS:
        gen = Generator(s, num_vars=2 + s % 3)
        kinds |= set(gen.kinds)
        for ns in topological_order(gen.circuit()):
            bsizes.add(ns.block_size)
            tied_sum += ns.is_sum() and ns.is_tied()
            tied_in += ns.is_input() and ns.is_tied()
            if ns.is_sum() and ns.edge_ids.shape[1] < ns.num_node_blocks * ns.num_ch_node_blocks:
                sparse += 1
    assert kinds == {"categorical", "bernoulli", "masked", "indicator", "literal", "gaussian", "logistic"}
    assert tied_sum > 0 and tied_in > 0 and sparse > 0
    assert bsizes >= {1, 2, 3, 4}


def test_log_prob_matches_oracle(case):
    gen, c = case
    x = gen.sample_data(B)
    ll = np.asarray(c.log_prob(c.params, as_input(gen, x)))
    _, ref = oracle.forward(c, c.params, x)
    np.testing.assert_allclose(ll, ref, rtol=1e-5, atol=1e-5)


def test_sums_to_one(case):
    gen, c = case
    x, miss = gen.all_assignments()
    m = np.broadcast_to(miss, x.shape) if miss.any() else None
    ll = np.asarray(c.log_prob(c.params, as_input(gen, x), missing=m), dtype=np.float64)
    assert abs(np.exp(ll).sum() - 1.0) < 1e-5


def test_missing_marginals_equal_sums(case):
    gen, c = case
    x, miss = gen.all_assignments()
    V = x.shape[1]
    rng = np.random.default_rng(0)
    hide = rng.random(V) < 0.5
    hide |= miss
    full = np.asarray(c.log_prob(c.params, as_input(gen, x), missing=np.broadcast_to(miss, x.shape) if miss.any()
                                 else None), dtype=np.float64)
    m = np.broadcast_to(hide, x.shape)
    marg = np.asarray(c.log_prob(c.params, as_input(gen, x), missing=m), dtype=np.float64)
    # group assignments by their observed part
    keys = [tuple(r) for r in x[:, ~hide]]
    groups = {}
    for k, ll in zip(keys, full):
        groups[k] = groups.get(k, 0.0) + np.exp(ll)
    expect = np.log(np.array([groups[k] for k in keys]))
    np.testing.assert_allclose(marg, expect, rtol=1e-5, atol=1e-5)
    # the [V] form of the mask gives the same values
    marg_v = np.asarray(c.log_prob(c.params, as_input(gen, x), missing=hide))
    np.testing.assert_allclose(marg_v, marg, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["MPE", "GeneralLL"])
def test_mpe_and_general_ll_match_oracle(case, mode):
    gen, c = case
    x = gen.sample_data(B)
    rng = np.random.default_rng(1)
    miss = rng.random(x.shape) < 0.4
    alpha = 2.5 if mode == "GeneralLL" else None
    got = np.asarray(c.log_prob(c.params, as_input(gen, x), missing=miss, propagation=mode, alpha=alpha))
    _, ref = oracle.forward(c, c.params, x, miss, mode=mode, alpha=alpha)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def check_flows_and_ll(gen, c, options=None, *, flow_rtol: float = 0.0, ll_atol: float = 0.0):
    """Flows with missing values and per-sample weights, and their log-likelihoods, against the oracle; ``flow_rtol``
    and ``ll_atol`` widen the tolerances by a bound of a reduced precision's own error."""
    x = gen.sample_data(B)
    rng = np.random.default_rng(2)
    miss = rng.random(x.shape) < 0.3
    w = rng.uniform(0.5, 2.0, x.shape[0])
    fl, got = c.flows(c.params, as_input(gen, x), missing=miss, ll_weights=w, options=options, return_ll=True)
    totals, in_totals, edge = oracle.flow_totals(c, c.params, x, miss, weights=w)
    assert oracle.check_flows(c, fl, totals, in_totals, rtol=1e-4 + flow_rtol) > 0
    _, ref = oracle.forward(c, c.params, x, miss)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5 + ll_atol)
    return x, miss, w, edge


def test_flows_match_exact_expected_counts(case):
    gen, c = case
    x, miss, w, edge = check_flows_and_ll(gen, c)
    # the flows out of the root sum to the total weight of the possible samples
    _, ll = oracle.forward(c, c.params, x, miss)
    np.testing.assert_allclose(edge[c.root.id].sum(), w[np.isfinite(ll)].sum(), rtol=1e-9)


def test_full_batch_em_closed_form_and_monotone(case):
    gen, c = case
    x = gen.sample_data(3 * B - 5)
    xin = as_input(gen, x)
    step, pc = 1.0, 0.0
    new, before = c.full_batch_em(c.params, xin, batch_size=B, step_size=step, pseudocount=pc, return_ll=True)
    sums, ins, _ = oracle.flow_totals(c, c.params, x)
    for ns in c.nodes:
        if ns.source is not ns:
            continue
        if ns.is_sum():
            W = np.asarray(c.get_node_params(c.params, ns), np.float64)
            mask = oracle.edge_mask(ns)
            ref = oracle.em_sum_update(W, sums[ns.id], mask, ns.ch_block_size, step, pc)
            np.testing.assert_allclose(np.asarray(c.get_node_params(new, ns)), ref, rtol=1e-4, atol=1e-5)
        elif ns.is_input() and ns.id in ins:
            ref = oracle.em_input_update(ns.dist, c.get_node_params(c.params, ns), ins[ns.id], step, pc)
            got = c.get_node_params(new, ns)
            if isinstance(ref, dict):
                for k in ref:
                    np.testing.assert_allclose(np.asarray(got[k]), ref[k], rtol=2e-4, atol=1e-4)
            else:
                np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-4, atol=1e-5)
    _, ref_ll = oracle.forward(c, c.params, x)
    np.testing.assert_allclose(float(before), ref_ll.mean(), rtol=1e-5, atol=1e-5)
    _, after = c.full_batch_em(new, xin, batch_size=B, return_ll=True)
    if "logistic" not in gen.kinds:  # moment matching is not an exact M-step
        assert float(after) >= float(before) - 1e-5


def test_em_update_blends_with_pseudocount(case):
    gen, c = case
    x = gen.sample_data(B)
    step, pc = 0.3, 0.7
    fl = c.flows(c.params, as_input(gen, x), ll_weights=np.ones(B))  # the signature full_batch_em compiled
    new = c.em_update(c.params, fl, step_size=step, pseudocount=pc)
    edge, _, _ = oracle.flows(c, c.params, x)
    sums = oracle.tied_edge_flows(c, edge)
    for ns in c.nodes:
        if ns.is_sum() and ns.source is ns:
            W = np.asarray(c.get_node_params(c.params, ns), np.float64)
            mask = oracle.edge_mask(ns)
            ref = oracle.em_sum_update(W, sums[ns.id], mask, ns.ch_block_size, step, pc)
            np.testing.assert_allclose(np.asarray(c.get_node_params(new, ns)), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", cases([3, 7, 11], fast=[3]))
@pytest.mark.slow
def test_em_step_is_flows_then_update(seed):
    gen, c = make(seed)
    x = as_input(gen, gen.sample_data(B))
    new, ll = c.em_step(c.params, x, step_size=0.4, pseudocount=0.2, return_ll=True)
    ref = c.em_update(c.params, c.flows(c.params, x), step_size=0.4, pseudocount=0.2)
    for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ll), np.asarray(c.log_prob(c.params, x)), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# deterministic circuits: max-product equals the max over assignments
# ---------------------------------------------------------------------------------------------

def deterministic_circuit(seed, num_vars=4, card=3):
    """Each sum splits on the value of one variable (children carry disjoint indicator supports)."""
    rng = np.random.default_rng(seed)

    def region(vars_):
        if len(vars_) == 1:
            v = vars_[0]
            p = rng.random((1, card)) + 0.1
            return jaxpc.inputs(v, 1, 1, distributions.Categorical(card), params=p / p.sum())
        v, rest = vars_[0], vars_[1:]
        prods = []
        for k in range(card):
            ind = jaxpc.inputs(v, 1, 1, distributions.Literal(k))
            prods.append(jaxpc.multiply(ind, region(rest)))
        w = rng.random(card) + 0.1
        return jaxpc.summate(*prods, num_node_blocks=1, params=(w / w.sum())[None, :])

    return region(list(rng.permutation(num_vars)))


@pytest.mark.parametrize("seed", cases(range(4), fast=[0, 1]))
def test_mpe_is_exact_map_on_deterministic_circuits(seed):
    root = deterministic_circuit(seed)
    c = jaxpc.compile(root)
    import itertools
    x = np.asarray(list(itertools.product(range(3), repeat=4)), dtype=np.int32)
    ll = np.asarray(c.log_prob(c.params, x), np.float64)
    assert abs(np.exp(ll).sum() - 1) < 1e-5
    mpe_all = float(c.log_prob(c.params, x[:1], missing=np.ones(4, bool), propagation="MPE")[0])
    assert abs(mpe_all - ll.max()) < 1e-5
    # conditional: fix variable 0, maximize the rest
    miss = np.array([False, True, True, True])
    for v0 in range(3):
        got = float(c.log_prob(c.params, np.array([[v0, 0, 0, 0]]), missing=miss, propagation="MPE")[0])
        assert abs(got - ll[x[:, 0] == v0].max()) < 1e-5


def test_oracle_on_hand_computed_circuit():
    """The oracle itself against numbers worked out by hand."""
    a = jaxpc.inputs(0, 1, 2, distributions.Categorical(2), params=np.array([[0.9, 0.1], [0.2, 0.8]]))
    b = jaxpc.inputs(1, 1, 2, distributions.Categorical(2), params=np.array([[0.6, 0.4], [0.3, 0.7]]))
    root = jaxpc.summate(jaxpc.multiply(a, b), num_nodes=1, params=np.array([[0.25, 0.75]]))
    c = jaxpc.compile(root)
    x = np.array([[0, 1]])
    expect = np.log(0.25 * 0.9 * 0.4 + 0.75 * 0.2 * 0.7)
    _, ref = oracle.forward(c, c.params, x)
    assert abs(ref[0] - expect) < 1e-6  # parameters are stored in float32
    assert abs(float(c.log_prob(c.params, x)[0]) - expect) < 1e-6
    edge, _, _ = oracle.flows(c, c.params, x)
    p1, p2 = 0.25 * 0.9 * 0.4, 0.75 * 0.2 * 0.7
    np.testing.assert_allclose(edge[root.id], [[p1 / (p1 + p2), p2 / (p1 + p2)]])


@pytest.mark.parametrize("seed", cases([9, 14], fast=[9]))  # a small circuit, and one with every feature
@pytest.mark.parametrize("prop", ["LL", "MPE", "GeneralLL"])
def test_top_down_flows_equal_autodiff(seed, prop):
    """The custom top-down backward against JAX's autodiff through the forward, for every propagation."""
    gen, c = make(seed)
    x = gen.sample_data(B)
    miss = np.random.default_rng(5).random(x.shape) < 0.3
    opts = dict(propagation=prop, alpha=1.7 if prop == "GeneralLL" else None)
    # impossible samples get zero flow from the top-down pass; autodiff of max would route them anywhere
    ok = np.isfinite(np.asarray(c.log_prob(c.params, as_input(gen, x), miss, **opts)))
    x, miss = x[ok], miss[ok]
    a = c.flows(c.params, as_input(gen, x), miss, options=jaxpc.Options(backward="flows", **opts))
    b = c.flows(c.params, as_input(gen, x), miss, options=jaxpc.Options(backward="autodiff", **opts))
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=2e-4, atol=2e-5)
