"""Structure edits (jaxpc.edit): exact edges on hand-built graphs, unchanged
likelihoods where the transformation preserves the function (a float64 evaluator over the nodes'
own parameters, plus compiled log_prob on a few graphs), purity, ties, and the documented
behaviour of prune, grow and latent variable distillation."""

import itertools

import numpy as np
import pytest

import jaxpc
from jaxpc import distributions, edit
from jaxpc.nodes import topological_order
from jaxpc.structures.hclt import hidden_tree_circuit

from . import oracle
from .random_circuits import Generator
from .test_api import hmm_like

# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def dense_weights(ns):
    """``[num_nodes, num_ch_nodes]`` weights from the vector's own block parameters."""
    b = ns.source.own_params
    d = np.zeros((ns.num_node_blocks, ns.num_ch_node_blocks, ns.block_size, ns.ch_block_size))
    d[ns.edge_ids[0], ns.edge_ids[1]] = b
    return d.transpose(0, 2, 1, 3).reshape(ns.num_nodes, ns.num_ch_nodes)


def node_ll(root, x, miss=None):
    """float64 log-likelihoods ``[B]`` of a graph whose vectors all carry parameters (no compile)."""
    x = np.asarray(x, np.float64)
    vals = {}
    for ns in topological_order(root):
        if ns.is_input():
            p = ns.source.own_params
            fields = ns.dist.natural_fields
            if fields:
                assert p is not None, f"{ns.name} has no parameters"
                p = p[fields[0]] if len(fields) == 1 else p
            vals[ns.id] = oracle.leaf_values(ns, p, x, miss, "LL", None)
        elif ns.is_prod():
            K = ns.block_size
            out = np.zeros((ns.num_nodes, x.shape[0]))
            for j, c in enumerate(ns.children):
                out += vals[c.id][(ns.edge_ids[:, j][:, None] * K + np.arange(K)).reshape(-1)]
            vals[ns.id] = out
        else:
            assert ns.source.own_params is not None, f"{ns.name} has no parameters"
            with np.errstate(divide="ignore"):
                lw = np.log(dense_weights(ns))
            X = np.concatenate([vals[c.id] for c in ns.children])
            vals[ns.id] = oracle._lse(lw[:, :, None] + X[None], 1)
    return vals[root.id][0]


def snapshot(root):
    """Everything a transformation must not modify."""
    out = []
    for ns in topological_order(root):
        p = ns._params if not ns.is_prod() else None
        p = {k: v.copy() for k, v in p.items()} if isinstance(p, dict) else (None if p is None else p.copy())
        out.append((ns.id, ns.num_node_blocks, ns.block_size, tuple(c.id for c in ns.children),
                    None if ns.is_input() else ns.edge_ids.copy(), p, ns.tied_to))
    return out


def assert_same_snapshot(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x[:4] == y[:4] and x[6] is y[6]
        if x[4] is not None:
            np.testing.assert_array_equal(x[4], y[4])
        if isinstance(x[5], dict):
            assert x[5].keys() == y[5].keys()
            for k in x[5]:
                np.testing.assert_array_equal(x[5][k], y[5][k])
        elif x[5] is not None:
            np.testing.assert_array_equal(x[5], y[5])


def materialized(seed, num_vars=4, **kw):
    """A random circuit (all kinds, ties, block sizes 1-4) with every parameter set on its nodes, and data."""
    g = Generator(seed, num_vars, **kw)
    root = g.circuit()
    c = jaxpc.compile(root, seed=seed)
    return g, edit.deepcopy(root, circuit=c), c


def cat_inputs(var, nb, bs, k=3, seed=0):
    rng = np.random.default_rng(seed + 17 * var)
    return jaxpc.inputs(var, nb, bs, distributions.Categorical(k), params=rng.random((nb * bs, k)) + 0.1)


def random_sum(children, nb, bs, edge_ids=None, seed=0):
    ns = jaxpc.summate(*children, num_node_blocks=nb, block_size=bs, edge_ids=edge_ids)
    rng = np.random.default_rng(seed)
    ns.set_params(rng.random((ns.edge_ids.shape[1], bs, ns.ch_block_size)) + 0.05)
    return ns


def all_x(num_vars, k=3):
    return np.asarray(list(itertools.product(range(k), repeat=num_vars)), dtype=np.int32)


# ----------------------------------------------------------------------------------------------
# function-preserving transformations on random circuits
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_edits_preserve_likelihood_on_random_circuits(seed):
    g, root, c = materialized(seed)
    x = g.sample_data(24)
    miss = np.random.default_rng(seed).random(x.shape) < 0.2
    ref = node_ll(root, x, miss)
    before = snapshot(root)
    variants = {
        "deepcopy": edit.deepcopy(root),
        "unblockify": edit.unblockify(root),
        "unblockify2": edit.unblockify(root, block_size=2),
        "blockify": edit.blockify(root, sparsity_tolerance=0.5, max_block_size=8),
        "blockify_strict": edit.blockify(root, sparsity_tolerance=0.0),
        "merge": edit.merge(root),
        "unblock_then_block": edit.blockify(edit.unblockify(root), sparsity_tolerance=0.9, max_block_size=4),
    }
    indicators = [ns for ns in topological_order(root)
                  if ns.is_input() and isinstance(ns.dist, distributions.Indicator)]
    if all(ns.num_nodes % ns.dist.num_states == 0 for ns in indicators):
        variants["grow"] = edit.grow(root, 2, noise=0.0)
    else:  # the copies of an odd-sized Indicator vector would indicate other values
        with pytest.raises(ValueError, match="Indicator"):
            edit.grow(root, 2)
    for name, new in variants.items():
        ids = {ns.id for ns in topological_order(new)}
        assert not ids & {ns.id for ns in topological_order(root)}, name
        np.testing.assert_allclose(node_ll(new, x, miss), ref, rtol=1e-9, atol=1e-9, err_msg=name)
        jaxpc.compile(new)  # valid: ties agree, roots single, edges in range
    unb = topological_order(variants["unblockify"])
    assert all(ns.block_size == 1 for ns in unb)
    assert all(ns.block_size in (1, 2) for ns in topological_order(variants["unblockify2"]))
    assert_same_snapshot(before, snapshot(root))


@pytest.mark.slow
def test_the_float64_evaluator_agrees_with_the_compiled_circuit():
    """:func:`node_ll`, the reference of the edits above, equals the compiled circuit's ``log_prob`` (seed 0's data
    and missing values)."""
    g, root, c = materialized(0)
    x = g.sample_data(24)
    miss = np.random.default_rng(0).random(x.shape) < 0.2
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x, miss)), node_ll(root, x, miss), rtol=1e-5,
                               atol=1e-5)


# ----------------------------------------------------------------------------------------------
# deepcopy
# ----------------------------------------------------------------------------------------------

def test_deepcopy_keeps_sharing_ties_and_maps_variables():
    a, b = cat_inputs(0, 2, 2), cat_inputs(1, 2, 2)
    a2 = a.duplicate(2, tie_params=True)
    b2 = b.duplicate(3, tie_params=True)
    s1 = random_sum([jaxpc.multiply(a, b)], 2, 2)
    s2 = s1.duplicate(jaxpc.multiply(a2, b2), tie_params=True)
    shared = jaxpc.multiply(s1, s2)
    root = random_sum([shared, jaxpc.multiply(s1, s2, edge_ids=[[1, 0], [0, 1]])], 1, 1)
    before = snapshot(root)

    new = edit.deepcopy(root)
    old_nodes, new_nodes = topological_order(root), topological_order(new)
    assert len(old_nodes) == len(new_nodes)
    old2new = dict(zip([n.id for n in old_nodes], new_nodes))
    for o, n in zip(old_nodes, new_nodes):
        assert (o.kind, o.num_node_blocks, o.block_size, o.scope) == (n.kind, n.num_node_blocks, n.block_size, n.scope)
        assert [old2new[c.id] for c in o.children] == list(n.children)
        if not o.is_input():
            np.testing.assert_array_equal(o.edge_ids, n.edge_ids)
        assert o.is_tied() == n.is_tied()
        if o.is_tied():
            assert n.source is old2new[o.source.id]
        if o.is_sum():
            np.testing.assert_allclose(n.get_params(), o.get_params())
    # the shared vectors stay shared: s1 has two parents in both graphs
    ns1 = old2new[s1.id]
    assert sum(ns1 in n.children for n in new_nodes) == 2
    assert_same_snapshot(before, snapshot(root))

    # variable renaming: the copy over permuted variables gives the same likelihood on permuted data
    perm = {0: 3, 1: 0, 2: 1, 3: 2}
    moved = edit.deepcopy(root, var_mapping=perm)
    assert sorted(ns.var for ns in topological_order(moved) if ns.is_input()) == [0, 1, 2, 3]
    x = all_x(4)
    xp = np.empty_like(x)
    for o, n in perm.items():
        xp[:, n] = x[:, o]
    np.testing.assert_allclose(node_ll(moved, xp), node_ll(root, x), rtol=1e-12)
    # an array works too
    arr = edit.deepcopy(root, var_mapping=np.array([3, 0, 1, 2]))
    np.testing.assert_allclose(node_ll(arr, xp), node_ll(root, x), rtol=1e-12)
    with pytest.raises(ValueError, match="deepcopy: copying .*decomposability"):
        edit.deepcopy(root, var_mapping={0: 1})


def test_deepcopy_from_trained_circuit_and_compiled_equality():
    root = hmm_like(5, L=3)
    c = jaxpc.compile(root)
    x = np.random.default_rng(0).integers(0, 4, (20, 5)).astype(np.int32)
    params = c.em_step(c.params, x, step_size=0.7, pseudocount=0.1)  # trained, not the nodes' values
    new = edit.deepcopy(root, circuit=c, params=params)
    c2 = jaxpc.compile(new)
    np.testing.assert_allclose(np.asarray(c2.log_prob(c2.params, x)), np.asarray(c.log_prob(params, x)),
                               rtol=1e-5, atol=1e-5)
    assert c2.num_parameters == c.num_parameters  # ties kept
    np.testing.assert_allclose(node_ll(new, x), np.asarray(c.log_prob(params, x)), rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# blockify / unblockify
# ----------------------------------------------------------------------------------------------

def _block_diag_circuit():
    """Inputs and product of 4 blocks of size 1; a sum whose 4 x 4 block pattern is 2 x 2 block diagonal."""
    a, b = cat_inputs(0, 4, 1), cat_inputs(1, 4, 1)
    m = jaxpc.multiply(a, b)
    edges = np.array([[0, 0, 1, 1, 2, 2, 3, 3], [0, 1, 0, 1, 2, 3, 2, 3]])
    s = random_sum([m], 4, 1, edge_ids=edges, seed=1)
    root = random_sum([s], 1, 1, seed=2)
    return a, b, m, s, root


def test_blockify_exact_edges_and_padding():
    a, b, m, s, root = _block_diag_circuit()
    W = dense_weights(s)
    x = all_x(2)
    ref = node_ll(root, x)

    # max 2: everything in blocks of 2; the sum's pattern is block diagonal, so no padding
    r2 = edit.blockify(root, sparsity_tolerance=0.0, max_block_size=2)
    s2 = r2.children[0]
    m2 = s2.children[0]
    a2, b2 = m2.children
    assert [(v.num_node_blocks, v.block_size) for v in (a2, b2, m2, s2)] == [(2, 2)] * 4
    np.testing.assert_array_equal(m2.edge_ids, [[0, 0], [1, 1]])
    np.testing.assert_array_equal(s2.edge_ids, [[0, 1], [0, 1]])
    np.testing.assert_allclose(dense_weights(s2), W)
    assert (r2.block_size, r2.ch_block_size) == (1, 2)
    np.testing.assert_array_equal(r2.edge_ids, [[0, 0], [0, 1]])
    np.testing.assert_allclose(node_ll(r2, x), ref, rtol=1e-12)

    # max 4 and no tolerance: one 4x4 block would be half padding, so the sum keeps 2x2 blocks
    r4 = edit.blockify(root, sparsity_tolerance=0.0, max_block_size=4)
    assert (r4.children[0].block_size, r4.children[0].ch_block_size) == (2, 2)

    # tolerance 0.5: one 4x4 edge block whose off-diagonal 2x2 blocks are zero-weight padding
    r4 = edit.blockify(root, sparsity_tolerance=0.5, max_block_size=4)
    s4 = r4.children[0]
    assert (s4.num_node_blocks, s4.block_size, s4.ch_block_size) == (1, 4, 4)
    np.testing.assert_array_equal(s4.edge_ids, [[0], [0]])
    np.testing.assert_allclose(s4.get_params()[0], W)
    assert np.all(s4.get_params()[0][:2, 2:] == 0) and np.all(s4.get_params()[0][2:, :2] == 0)

    # compiled before / after: same log_prob, and the layout uses the larger blocks
    c0, c4 = jaxpc.compile(root), jaxpc.compile(r4)
    assert "4x4" in c4.params["sum"]
    np.testing.assert_allclose(np.asarray(c4.log_prob(c4.params, x)), np.asarray(c0.log_prob(c0.params, x)),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(c0.log_prob(c0.params, x)), ref, rtol=1e-5)
    # EM without pseudocount keeps the padding at zero
    p1 = c4.em_step(c4.params, x, step_size=1.0)
    W1 = np.asarray(c4.get_node_params(p1, s4))
    assert np.all(W1[:2, 2:] == 0) and np.isfinite(np.asarray(c4.log_prob(p1, x))).all()

    # unblockify restores the block size 1 graph with identical edges
    back = edit.unblockify(r4)
    sb = back.children[0]
    assert sb.block_size == 1 and sb.ch_block_size == 1
    nz = dense_weights(sb) > 0
    np.testing.assert_array_equal(nz, W > 0)
    np.testing.assert_allclose(node_ll(back, x), ref, rtol=1e-12)


def test_blockify_respects_product_alignment_and_ties():
    # the product reads its children's blocks in reversed order: only factor 1 keeps the pairing
    a, b = cat_inputs(0, 4, 1), cat_inputs(1, 4, 1)
    m = jaxpc.multiply(a, b, edge_ids=np.array([[0, 3], [1, 2], [2, 1], [3, 0]]))
    root = random_sum([random_sum([m], 4, 1)], 1, 1)
    new = edit.blockify(root, sparsity_tolerance=0.9, max_block_size=8)
    assert new.children[0].children[0].block_size == 1
    np.testing.assert_allclose(node_ll(new, all_x(2)), node_ll(root, all_x(2)), rtol=1e-12)
    # pairs aligned in twos ([0,1] with [2,3] and [2,3] with [0,1]) allow blocks of 2
    m = jaxpc.multiply(a, b, edge_ids=np.array([[0, 2], [1, 3], [2, 0], [3, 1]]))
    root = random_sum([random_sum([m], 4, 1)], 1, 1)
    new = edit.blockify(root, sparsity_tolerance=0.9, max_block_size=8)
    m2 = new.children[0].children[0]
    assert m2.block_size == 2
    np.testing.assert_array_equal(m2.edge_ids, [[0, 1], [1, 0]])
    np.testing.assert_allclose(node_ll(new, all_x(2)), node_ll(root, all_x(2)), rtol=1e-12)

    # a tied HMM: every vector goes to blocks of L, the ties survive
    rng = np.random.default_rng(0)
    hmm = hmm_like(6, L=4, V=3)
    root = edit.deepcopy(hmm, circuit=jaxpc.compile(hmm))
    new = edit.blockify(root, max_block_size=16)
    nodes = topological_order(new)
    assert {ns.block_size for ns in nodes if ns is not new} == {4}
    assert sum(ns.is_tied() for ns in nodes) == sum(ns.is_tied() for ns in topological_order(root))
    x = rng.integers(0, 3, (10, 6))
    np.testing.assert_allclose(node_ll(new, x), node_ll(root, x), rtol=1e-12)
    c = jaxpc.compile(new)
    assert set(c.params["sum"]) == {"4x4", "1x4"}


def test_unblockify_exact_edges():
    a = cat_inputs(0, 1, 2)
    b = cat_inputs(1, 1, 2)
    s = random_sum([jaxpc.multiply(a, b)], 1, 2)  # one 2x2 edge block
    root = random_sum([s], 1, 1)
    W = dense_weights(s)
    new = edit.unblockify(root)
    s1 = new.children[0]
    assert (s1.num_node_blocks, s1.block_size, s1.ch_block_size) == (2, 1, 1)
    np.testing.assert_array_equal(s1.edge_ids, [[0, 0, 1, 1], [0, 1, 0, 1]])
    np.testing.assert_allclose(s1.get_params()[:, 0, 0], W.reshape(-1))
    m1 = s1.children[0]
    np.testing.assert_array_equal(m1.edge_ids, [[0, 0], [1, 1]])
    np.testing.assert_array_equal(new.edge_ids, [[0, 0], [0, 1]])
    np.testing.assert_allclose(node_ll(new, all_x(2)), node_ll(root, all_x(2)), rtol=1e-12)


# ----------------------------------------------------------------------------------------------
# merge
# ----------------------------------------------------------------------------------------------

def _two_region_circuit():
    a0, a1 = cat_inputs(0, 2, 1, seed=0), cat_inputs(0, 1, 1, seed=5)
    b = cat_inputs(1, 2, 1)
    s1 = random_sum([a0], 2, 1, seed=1)
    s2 = random_sum([a1], 3, 1, seed=2)
    p1 = jaxpc.multiply(s1, b)  # 2 blocks
    p2 = jaxpc.multiply(b, s2, edge_ids=np.array([[0, 2], [1, 0]]))  # children in the other order
    root = random_sum([p1, p2], 1, 1, seed=3)
    return a0, a1, b, s1, s2, p1, p2, root


def test_merge_by_region_exact_edges():
    a0, a1, b, s1, s2, p1, p2, root = _two_region_circuit()
    x = all_x(2)
    ref = node_ll(root, x)
    before = snapshot(root)
    new = edit.merge(root)
    P = new.children[0]
    assert len(new.children) == 1 and P.num_node_blocks == 4
    np.testing.assert_array_equal(new.edge_ids, [[0, 0, 0, 0], [0, 1, 2, 3]])  # p1's blocks, then p2's
    S, B = P.children  # in p1's (the first member's) order
    assert S.scope == 1 and B is not None and B.var == 1
    # S = [s1 (2 blocks), s2 (3 blocks)]; p2 read s2's blocks 2 and 0 -> 4 and 2
    np.testing.assert_array_equal(P.edge_ids, [[0, 0], [1, 1], [4, 0], [2, 1]])
    A = S.children[0]
    assert len(S.children) == 1 and A.num_node_blocks == 3 and A.var == 0  # a0 and a1 merged too
    np.testing.assert_array_equal(S.edge_ids, [[0, 0, 1, 1, 2, 3, 4], [0, 1, 0, 1, 2, 2, 2]])
    np.testing.assert_allclose(node_ll(new, x), ref, rtol=1e-12)
    assert_same_snapshot(before, snapshot(root))

    # explicit groups: only the sums; the products stay apart and read the merged sum at offsets
    new = edit.merge(root, [[s2, s1]])
    q1, q2 = new.children
    S = q1.children[0]
    assert S is q2.children[1] and S.num_node_blocks == 5
    np.testing.assert_array_equal(q1.edge_ids, [[3, 0], [4, 1]])
    np.testing.assert_array_equal(q2.edge_ids, [[0, 2], [1, 0]])
    assert [c.var for c in S.children] == [0, 0]  # a1 then a0, not merged
    np.testing.assert_allclose(node_ll(new, x), ref, rtol=1e-12)

    # compiled before / after
    c0, c1 = jaxpc.compile(root), jaxpc.compile(edit.merge(root))
    np.testing.assert_allclose(np.asarray(c1.log_prob(c1.params, x)), np.asarray(c0.log_prob(c0.params, x)),
                               rtol=1e-5, atol=1e-6)
    assert len(c1.nodes) < len(c0.nodes)


def test_merge_errors():
    a0, a1, b, s1, s2, p1, p2, root = _two_region_circuit()
    with pytest.raises(ValueError, match="cannot merge .* scope"):
        edit.merge(root, [[a0, b]])
    with pytest.raises(ValueError, match=r"cannot merge .*\(sum\) with .*\(input\)"):
        edit.merge(root, [[s1, b]])
    with pytest.raises(ValueError, match="root"):
        edit.merge(root, [[root, s1]])
    with pytest.raises(ValueError, match="read different vectors"):
        edit.merge(root, [[p1, p2]])  # their sum children were not merged
    with pytest.raises(ValueError, match="more than once in groups"):
        edit.merge(root, [[s1, s2], [s2, s1]])
    with pytest.raises(ValueError, match="more than once in groups"):  # twice in one group
        edit.merge(root, [[s1, s1, s2]])
    for bad in ("ab", ["ab", "cd"], [b"ab"]):  # strings are sequences, but not of vectors
        with pytest.raises(ValueError, match="merge: groups must be a list of lists of node vectors"):
            edit.merge(root, bad)
    with pytest.raises(ValueError, match="at least two"):
        edit.merge(root, [[s1]])
    inner = random_sum([a0], 2, 1)
    outer = random_sum([inner], 1, 1)
    r = random_sum([jaxpc.multiply(outer, cat_inputs(1, 1, 1))], 1, 1)
    with pytest.raises(ValueError, match="descendant"):
        edit.merge(r, [[inner, outer]])
    assert len(topological_order(edit.merge(r))) == len(topological_order(r))  # levels differ: nothing merged
    ind = [jaxpc.inputs(0, 3, 1, distributions.Indicator(2)), jaxpc.inputs(0, 2, 1, distributions.Indicator(2))]
    r = jaxpc.summate(*ind, num_node_blocks=1, block_size=1)
    with pytest.raises(ValueError, match="Indicator"):
        edit.merge(r, [ind])
    assert edit.merge(r, [ind[::-1]]).children[0].num_nodes == 5  # 2 indicators first: positions keep values


# ----------------------------------------------------------------------------------------------
# prune
# ----------------------------------------------------------------------------------------------

def _prune_circuit():
    rng = np.random.default_rng(3)
    a, b = cat_inputs(0, 3, 1), cat_inputs(1, 3, 1)
    c, d = cat_inputs(2, 3, 1), cat_inputs(3, 3, 1)
    m1, m2 = jaxpc.multiply(a, b), jaxpc.multiply(b, a, edge_ids=np.array([[1, 0], [2, 1], [0, 2]]))
    s1 = jaxpc.summate(m1, m2, num_node_blocks=2, block_size=1, params=rng.random((2, 6)) + 0.05)
    s2 = s1.duplicate(jaxpc.multiply(c, d), jaxpc.multiply(d, c, edge_ids=np.array([[1, 0], [2, 1], [0, 2]])),
                      tie_params=True)
    root = jaxpc.summate(jaxpc.multiply(s1, s2), num_node_blocks=1, block_size=1, params=np.array([[0.3, 0.7]]))
    return root, s1, s2


def test_prune_by_flows_keeps_ties_and_renormalizes():
    root, s1, s2 = _prune_circuit()
    circuit = jaxpc.compile(root)
    x = np.random.default_rng(0).integers(0, 3, (64, 4)).astype(np.int32)
    flows = circuit.flows(circuit.params, x)
    F = np.asarray(circuit.get_node_flows(flows, s1))  # pooled over s1 and s2: [2, 6]
    W = np.asarray(circuit.get_node_params(circuit.params, s1), np.float64)
    before = snapshot(root)

    new = edit.prune(root, circuit, flows=flows, keep_frac=0.25)
    # expected: the top ceil(0.25 * (12 + 2)) = 4 blocks over s1's 12 and the root's 2 ...
    scores = np.concatenate([F.reshape(-1), np.asarray(circuit.get_node_flows(flows, root)).reshape(-1)])
    top = set(np.argsort(-scores, kind="stable")[:4].tolist())
    keep = np.array([i in top for i in range(12)]).reshape(2, 6)
    for p in range(2):  # ... plus the best edge of a parent that lost all
        if not keep[p].any():
            keep[p, np.argmax(F[p])] = True
    n1, n2 = new.children[0].children
    assert n2.is_tied() and n2.source is n1
    np.testing.assert_array_equal(n1.edge_ids, n2.edge_ids)
    chs = [m for m in (0, 1) if keep[:, 3 * m:3 * m + 3].any()]
    assert len(n1.children) == len(chs)  # a product vector no edge reaches is dropped
    kept_dense = np.zeros((2, 3 * len(chs)), bool)
    kept_dense[n1.edge_ids[0], n1.edge_ids[1]] = True
    np.testing.assert_array_equal(kept_dense, np.concatenate([keep[:, 3 * m:3 * m + 3] for m in chs], 1))
    # kept weights: the old ones renormalized per node
    Wk = np.where(keep, W, 0.0)
    Wk = Wk / Wk.sum(1, keepdims=True)
    np.testing.assert_allclose(dense_weights(n1), np.concatenate([Wk[:, 3 * m:3 * m + 3] for m in chs], 1),
                               rtol=1e-6)
    c2 = jaxpc.compile(new)
    np.testing.assert_allclose(np.asarray(c2.get_node_params(c2.params, n1)).sum(1), 1, rtol=1e-6)
    assert np.isfinite(np.asarray(c2.log_prob(c2.params, x))).all()
    assert_same_snapshot(before, snapshot(root))

    # threshold above every score: each parent keeps exactly its best edge block
    new = edit.prune(root, circuit, flows=flows, threshold=1e9)
    n1 = new.children[0].children[0]
    assert n1.edge_ids.shape[1] == 2 and new.edge_ids.shape[1] == 1
    np.testing.assert_allclose(dense_weights(n1).sum(1), 1)
    # explicit scores (summed over the tie group): keep the first two edges of both parents' rows
    sc = np.zeros(12)
    sc[[0, 1, 6, 7]] = 1.0
    new = edit.prune(root, circuit, scores={s1: sc / 2, s2: sc / 2}, threshold=0.9)
    n1 = new.children[0].children[0]
    np.testing.assert_array_equal(n1.edge_ids, [[0, 0, 1, 1], [0, 1, 0, 1]])
    assert len(new.edge_ids[0]) == 2  # the root was not scored: untouched
    with pytest.raises(ValueError, match="exactly one of keep_frac and threshold"):
        edit.prune(root, circuit, flows=flows)
    with pytest.raises(ValueError, match="keep_frac"):
        edit.prune(root, circuit, flows=flows, keep_frac=0.0)
    with pytest.raises(ValueError, match=r"scores\[.*\] must have shape \[num_edge_blocks\] = \[12\], got shape"):
        edit.prune(root, circuit, scores={s1: np.ones(3)}, threshold=0.5)
    with pytest.raises(ValueError, match="prune: .* is not part of"):
        edit.prune(hmm_like(3), circuit, flows=flows, keep_frac=0.5)


def test_prune_rejects_non_finite_flows_and_scores():
    root, s1, _ = _prune_circuit()
    circuit = jaxpc.compile(root)
    flows = circuit.flows(circuit.params, np.zeros((2, 4), np.int32))
    pl = circuit.structure.sum_placement[s1.id]  # edge block 1 of s1 gets a NaN flow
    bad = dict(flows, sum=dict(flows["sum"], **{pl.group: flows["sum"][pl.group].at[pl.start + 1].set(np.nan)}))
    with pytest.raises(ValueError, match=r"flows of .* are non-finite \(NaN or inf\) at edge block\(s\) \[1\]"):
        edit.prune(root, circuit, flows=bad, keep_frac=0.5)
    sc = np.ones(12)
    sc[[2, 5]] = [np.nan, np.inf]
    with pytest.raises(ValueError, match=r"scores\[\S+\] has non-finite values \[nan, inf\] at edge block"):
        edit.prune(root, circuit, scores={s1: sc}, keep_frac=0.5)


# ----------------------------------------------------------------------------------------------
# grow
# ----------------------------------------------------------------------------------------------

def test_grow_exact_edges():
    a, b = cat_inputs(0, 2, 1), cat_inputs(1, 2, 1)
    m = jaxpc.multiply(a, b, edge_ids=np.array([[0, 1], [1, 0]]))
    s = random_sum([m], 2, 1, edge_ids=np.array([[0, 1, 1], [0, 0, 1]]))
    root = random_sum([s], 1, 1)
    new = edit.grow(root, num_duplicates=1)
    s2 = new.children[0]
    m2 = s2.children[0]
    a2, b2 = m2.children
    assert [v.num_node_blocks for v in (a2, b2, m2, s2, new)] == [4, 4, 4, 4, 1]
    np.testing.assert_allclose(a2.get_params()["probs"], np.tile(a.get_params()["probs"], (2, 1)))
    np.testing.assert_array_equal(m2.edge_ids, [[0, 1], [1, 0], [2, 3], [3, 2]])
    # parent copy p, child copy q: (p * 2 + parent block, q * 2 + child block)
    expect = {(pc * 2 + i, qc * 2 + j) for pc in (0, 1) for qc in (0, 1) for i, j in [(0, 0), (1, 0), (1, 1)]}
    assert set(map(tuple, s2.edge_ids.T.tolist())) == expect and s2.edge_ids.shape[1] == 12
    assert set(map(tuple, new.edge_ids.T.tolist())) == {(0, 0), (0, 1), (0, 2), (0, 3)}
    W, W2 = dense_weights(s), dense_weights(s2)
    np.testing.assert_allclose(W2, np.tile(W, (2, 2)) / 2)  # noise 0: each copy takes half the weight
    np.testing.assert_allclose(node_ll(new, all_x(2)), node_ll(root, all_x(2)), rtol=1e-12)


def test_grow_random_circuits_and_noise():
    kinds = ("categorical", "bernoulli", "gaussian", "masked", "logistic", "literal")
    g, root, _ = materialized(1, kinds=kinds)
    x = g.sample_data(16)
    before = snapshot(root)
    new = edit.grow(root, num_duplicates=2)
    for o, n in zip(topological_order(root), topological_order(new)):
        t = 1 if o is root else 3
        assert (n.num_node_blocks, n.block_size) == (t * o.num_node_blocks, o.block_size)
        if o.is_sum():
            assert n.edge_ids.shape[1] == t * 3 * o.edge_ids.shape[1]
        assert n.is_tied() == o.is_tied()
    np.testing.assert_allclose(node_ll(new, x), node_ll(root, x), rtol=1e-9, atol=1e-9)

    noisy = edit.grow(root, num_duplicates=1, noise=0.5, seed=3)
    again = edit.grow(root, num_duplicates=1, noise=0.5, seed=3)
    for n, n2 in zip(topological_order(noisy), topological_order(again)):
        if n.is_sum() and not n.is_tied():
            np.testing.assert_array_equal(n.get_params(), n2.get_params())
            np.testing.assert_allclose(dense_weights(n).sum(1), 1)
    diff = np.abs(node_ll(noisy, x) - node_ll(root, x))
    assert np.all(np.isfinite(diff)) and diff.max() > 1e-3
    c = jaxpc.compile(noisy)
    assert np.isfinite(np.asarray(c.log_prob(c.params, x))).all()
    assert_same_snapshot(before, snapshot(root))
    with pytest.raises(ValueError, match="num_duplicates"):
        edit.grow(root, 0)
    bad = jaxpc.summate(jaxpc.inputs(0, 3, 1, distributions.Indicator(2)), num_node_blocks=1, block_size=1)
    with pytest.raises(ValueError, match="Indicator"):
        edit.grow(bad)


# ----------------------------------------------------------------------------------------------
# latent variable distillation
# ----------------------------------------------------------------------------------------------

def test_lvd_counts_on_a_tiny_hclt():
    # tree 0 -> {1, 3}, 1 -> {2}; variables 2 and 3 are tree leaves
    L, N = 2, 40
    root = hidden_tree_circuit([[1, 3], [2], [], []], 0, L, [0, 1, 2, 3], distributions.Categorical(3))
    regions = edit.hclt_latent_regions(root)
    assert sorted(regions) == [0, 1]
    rng = np.random.default_rng(0)
    z = rng.integers(0, L, (N, 4))  # per-variable latents; columns 2, 3 are unused
    x = rng.integers(0, 3, (N, 4))
    pc = 0.5
    new = edit.lvd_init(root, regions, z, x, pseudocount=pc)

    def counts(a, b, na, nb):
        c = np.full((na, nb), pc)
        for i, j in zip(a, b):
            c[i, j] += 1
        return c / c.sum(1, keepdims=True)

    prod0 = new.children[0]
    sum1, leaf3, leaf0 = prod0.children
    prod1 = sum1.children[0]
    leaf2, leaf1 = prod1.children
    np.testing.assert_allclose(dense_weights(new), counts(np.zeros(N, int), z[:, 0], 1, L))  # P(z0)
    np.testing.assert_allclose(dense_weights(sum1), counts(z[:, 0], z[:, 1], L, L))  # P(z1 | z0)
    np.testing.assert_allclose(leaf0.get_params()["probs"], counts(z[:, 0], x[:, 0], L, 3))
    np.testing.assert_allclose(leaf3.get_params()["probs"], counts(z[:, 0], x[:, 3], L, 3))
    np.testing.assert_allclose(leaf1.get_params()["probs"], counts(z[:, 1], x[:, 1], L, 3))
    np.testing.assert_allclose(leaf2.get_params()["probs"], counts(z[:, 1], x[:, 2], L, 3))
    assert root.source._params is None  # the input graph is untouched
    c = jaxpc.compile(new)
    np.testing.assert_allclose(np.asarray(c.get_node_params(c.params, sum1)), dense_weights(sum1), rtol=1e-6)

    # a sequence of regions, with missing values skipped for the leaves
    miss = np.zeros(x.shape, bool)
    miss[:10, 1] = True
    new2 = edit.lvd_init(root, [regions[1], regions[0]], z[:, [1, 0]], x, miss, pseudocount=pc)
    l1 = new2.children[0].children[0].children[0].children[1]
    np.testing.assert_allclose(l1.get_params()["probs"], counts(z[10:, 1], x[10:, 1], L, 3))
    with pytest.raises(ValueError, match=r"latents\[:, \d\] holds values in \[5, 6\], but .* has 2 nodes"):
        edit.lvd_init(root, regions, z + 5, x)
    with pytest.raises(ValueError, match="not a vector of this graph"):
        edit.lvd_init(root, [hmm_like(3)], z[:, :1])


def test_lvd_blocks_ties_and_gaussians():
    # block size 2, a tied sum pair with pooled counts, Gaussian leaves from per-cluster moments
    N = 60
    rng = np.random.default_rng(1)
    g0 = jaxpc.inputs(0, 2, 2, distributions.Gaussian(min_sigma=0.01))
    g1 = g0.duplicate(1, tie_params=True)
    s0 = jaxpc.summate(g0, num_node_blocks=1, block_size=2, edge_ids=[[0], [1]])  # sparse: only child block 1
    s1 = s0.duplicate(g1, tie_params=True)
    root = jaxpc.summate(jaxpc.multiply(s0, s1), num_node_blocks=1, block_size=1)
    za, zb, zc, zd = (rng.integers(0, n, N) for n in (2, 4, 2, 4))
    x = rng.normal(0, 1, (N, 2))
    pc = 1.0
    new = edit.lvd_init(root, {0: s0, 1: g0, 2: s1, 3: g1}, np.stack([za, zb, zc, zd], 1), x, pseudocount=pc)
    n0, n1 = new.children[0].children
    assert n1.source is n0
    cnt = np.zeros((2, 4))
    for a, b in itertools.chain(zip(za, zb), zip(zc, zd)):
        cnt[a, b] += 1
    # only edges to child nodes 2, 3 (block 1) exist; co-occurrences with nodes 0, 1 are dropped
    w = cnt[:, 2:] + pc
    np.testing.assert_allclose(n0.get_params()[0], w / w.sum(1, keepdims=True))
    zz = np.concatenate([zb, zd])
    v = np.concatenate([x[:, 0], x[:, 1]])
    gm, gv = v.mean(), v.var()
    s0_ = np.bincount(zz, minlength=4) + pc
    mu = (np.bincount(zz, v, 4) + pc * gm) / s0_
    var = (np.bincount(zz, v * v, 4) + pc * (gv + gm * gm)) / s0_ - mu * mu
    gp = n0.children[0].get_params()
    np.testing.assert_allclose(gp["mu"], mu)
    np.testing.assert_allclose(gp["sigma"], np.sqrt(var))
    assert n0.children[0].source is n1.children[0].source
    jaxpc.compile(new)


def test_lvd_pd_like_region_with_unassigned_product():
    # a region sum over two products (two splits); only the first product has an assignment
    N, pc = 50, 0.25
    rng = np.random.default_rng(2)
    a, b = cat_inputs(0, 2, 1), cat_inputs(1, 2, 1)
    c, d = cat_inputs(0, 2, 1, seed=4), cat_inputs(1, 2, 1, seed=4)
    p1, p2 = jaxpc.multiply(a, b), jaxpc.multiply(c, d)
    region = random_sum([p1, p2], 3, 1)
    root = random_sum([region], 1, 1)
    zr, z1 = rng.integers(0, 3, N), rng.integers(0, 2, N)
    x = rng.integers(0, 3, (N, 2))
    old_c = c.get_params()["probs"].copy()
    new = edit.lvd_init(root, [region, p1], np.stack([zr, z1], 1), x, pseudocount=pc)
    R = new.children[0]
    cnt = np.full((3, 4), pc)
    for i, j in zip(zr, z1):
        cnt[i, j] += 1  # edges to p2's nodes (columns 2, 3) get the pseudocount only
    np.testing.assert_allclose(dense_weights(R), cnt / cnt.sum(1, keepdims=True))
    cnt_root = np.full((1, 3), pc) + np.bincount(zr, minlength=3)
    np.testing.assert_allclose(dense_weights(new), cnt_root / cnt_root.sum())
    na = R.children[0].children[0]
    ca = np.full((2, 3), pc)
    np.add.at(ca, (z1, x[:, 0]), 1)
    np.testing.assert_allclose(na.get_params()["probs"], ca / ca.sum(1, keepdims=True))
    nc = R.children[1].children[0]  # under the unassigned product: copied unchanged
    np.testing.assert_allclose(nc.get_params()["probs"], old_c)


def test_lvd_input_rules_per_distribution():
    N, pc = 30, 0.5
    rng = np.random.default_rng(5)
    z = rng.integers(0, 2, N)
    leaves = {
        "bernoulli": jaxpc.inputs(0, 2, 1, distributions.Bernoulli()),
        "masked": jaxpc.inputs(1, 2, 1, distributions.MaskedCategorical(3, "range"), params={"mask": [[0, 2], [1, 3]]}),
        "logistic": jaxpc.inputs(2, 2, 1, distributions.DiscreteLogistic((0.0, 1.0), 4, min_std=0.01)),
        "literal": jaxpc.inputs(3, 2, 1, distributions.Literal(1)),
    }
    root = jaxpc.summate(jaxpc.multiply(*leaves.values()), num_node_blocks=1, block_size=1)
    x = np.stack([rng.integers(0, 2, N), rng.integers(0, 3, N), rng.integers(0, 4, N), np.ones(N, int)], 1)
    x[:, 1] = np.where(z == 0, np.minimum(x[:, 1], 1), np.maximum(x[:, 1], 1))  # inside each node's mask
    new = edit.lvd_init(root, [root.children[0]], z[:, None], x, pseudocount=pc)
    nb, nm, nl, nlit = new.children[0].children
    c = np.full((2, 2), pc)
    np.add.at(c, (z, x[:, 0]), 1)
    np.testing.assert_allclose(nb.get_params()["p"], c[:, 1] / c.sum(1))
    c = np.full((2, 3), pc)
    np.add.at(c, (z, x[:, 1]), 1)
    c[0, 2] = c[1, 0] = 0.0  # forbidden values stay at zero
    np.testing.assert_allclose(nm.get_params()["probs"], c / c.sum(1, keepdims=True))
    centers = (x[:, 2] + 0.5) / 4
    for k in range(2):
        v = centers[z == k]
        gm, gv = centers.mean(), centers.var()
        mu = (v.sum() + pc * gm) / (v.size + pc)
        var = ((v * v).sum() + pc * (gv + gm * gm)) / (v.size + pc) - mu * mu
        assert nl.get_params()["mu"][k] == pytest.approx(mu)
        assert nl.get_params()["s"][k] == pytest.approx(np.sqrt(var) * np.sqrt(3) / np.pi)
    assert nlit.get_params() is None
    jaxpc.compile(new)


# ----------------------------------------------------------------------------------------------
# sum gates (SumNodes.set_gates) survive every edit
# ----------------------------------------------------------------------------------------------

def _named_sum(children, nb, bs, name, seed, edge_ids=None):
    ns = jaxpc.summate(*children, num_node_blocks=nb, block_size=bs, edge_ids=edge_ids, name=name)
    ns.set_params(np.random.default_rng(seed).random((ns.edge_ids.shape[1], bs, ns.ch_block_size)) + 0.05)
    return ns


def _gated_circuit(K=4, tie_params=True):
    """s01 and s23: sums of 2 blocks of ``K`` nodes over a product of 2 blocks (4 edge blocks each); s23 has
    one gate per 2 parent nodes and s01 reads them (declared first, a tie to a vector built after it); the
    root has one gate per edge block. Every parameter is on the nodes."""
    a, b, c, d = (cat_inputs(v, 2, K) for v in range(4))
    s01 = _named_sum([jaxpc.multiply(a, b)], 2, K, "s01", seed=1)
    if tie_params:
        s23 = s01.duplicate(jaxpc.multiply(c, d), tie_params=True, name="s23")
    else:
        s23 = _named_sum([jaxpc.multiply(c, d)], 2, K, "s23", seed=2)
    s01.set_gates(tie_to=s23.set_gates(2))
    root = _named_sum([jaxpc.multiply(s01, s23)], 1, 1, "root", seed=3).set_gates()
    return root, s01, s23


def _gated(root):
    """``{name: sum vector}`` of the gated sums under ``root``."""
    return {ns.name: ns for ns in topological_order(root) if ns.is_sum() and ns.gates is not None}


def _random_gates(root, B, seed=0):
    """``{name: [B, E, Kp // gate block]}`` log-gates of the gated sums with columns of their own."""
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=(B, ns.edge_ids.shape[1], ns.block_size // ns.gates.block_size))
            for k, ns in _gated(root).items() if ns.gates.tie_to is None}


def _gate_ll(root, gates, x):
    """Compiled log-likelihoods ``[B]`` of ``root`` with ``evidence["sum_gates"]`` built from ``gates``
    (``{name: [B, E, Kp // gate block]}``) at each vector's ``gate_slice``; every column must be set."""
    c = jaxpc.compile(root)
    g = np.full((x.shape[0], c.num_gates), np.nan)
    for ns in c.nodes:
        if ns.is_sum() and ns.gates is not None and ns.gates.tie_to is None:
            assert g[:, c.gate_slice(ns)].shape[1] == gates[ns.name][0].size
            g[:, c.gate_slice(ns)] = gates[ns.name].reshape(x.shape[0], -1)
    assert not np.isnan(g).any()
    return np.asarray(c.log_prob(c.params, x, evidence={"sum_gates": g.astype(np.float32)}))


def _x(B=7, num_vars=4, seed=0):
    return np.random.default_rng(seed).integers(0, 3, (B, num_vars)).astype(np.int32)


def test_deepcopy_and_lvd_keep_gates():
    root, s01, s23 = _gated_circuit()
    x = _x()
    gates = _random_gates(root, x.shape[0])
    assert jaxpc.compile(root).num_gates == 4 * 2 + 2  # s23: 4 edge blocks of 2 gates; the root: 2 edge blocks
    new = edit.deepcopy(root)
    g = _gated(new)
    assert set(g) == {"s01", "s23", "root"} and g["s01"].gates.tie_to is g["s23"]
    assert (g["s23"].gates.block_size, g["root"].gates.block_size) == (2, 1)
    assert jaxpc.compile(new).num_gates == 4 * 2 + 2
    np.testing.assert_allclose(_gate_ll(new, gates, x), _gate_ll(root, gates, x), rtol=1e-6, atol=1e-6)
    assert s01.gates.tie_to is s23  # the input graph is untouched

    # lvd_init copies the graph the same way
    hclt = hidden_tree_circuit([[1, 3], [2], [], []], 0, 2, [0, 1, 2, 3], distributions.Categorical(3))
    hclt.set_gates()
    next(ns for ns in topological_order(hclt) if ns.is_sum() and ns is not hclt).set_gates(1)
    z = np.random.default_rng(0).integers(0, 2, (20, 4))
    lvd = edit.lvd_init(hclt, edit.hclt_latent_regions(hclt), z)
    assert jaxpc.compile(lvd).num_gates == jaxpc.compile(hclt).num_gates > 0
    # a tie to a vector outside the graph is refused, as jaxpc.compile refuses it
    s01.set_gates(tie_to=_named_sum(s23.children, 2, 4, "outside", seed=4).set_gates(2))
    with pytest.raises(ValueError, match="deepcopy: s01 reads the gates of outside, which is not reachable"):
        edit.deepcopy(root)


def test_unblockify_blockify_keep_gates():
    root, _, _ = _gated_circuit(K=4)
    x = _x()
    gates = _random_gates(root, x.shape[0])
    ref = _gate_ll(root, gates, x)

    fine = edit.unblockify(root, block_size=2)
    g = _gated(fine)
    assert g["s23"].block_size == 2 and g["s23"].gates.block_size == 2 and g["s01"].gates.tie_to is g["s23"]
    # each old edge block became its 2 x 2 grid of smaller ones, reading the gates of their rows
    fine_gates = {"s23": np.repeat(gates["s23"][:, :, :, None], 2, axis=3).reshape(x.shape[0], 16, 1),
                  "root": np.repeat(gates["root"], 2, axis=1)}
    np.testing.assert_allclose(_gate_ll(fine, fine_gates, x), ref, rtol=1e-5, atol=1e-5)

    back = edit.blockify(fine, max_block_size=4, sparsity_tolerance=0.0)
    g = _gated(back)
    np.testing.assert_array_equal(g["s23"].edge_ids, root.children[0].children[1].edge_ids)
    assert g["s23"].block_size == 4 and g["s23"].gates.block_size == 2 and g["s01"].gates.tie_to is g["s23"]
    assert jaxpc.compile(back).num_gates == jaxpc.compile(root).num_gates
    np.testing.assert_allclose(_gate_ll(back, gates, x), ref, rtol=1e-5, atol=1e-5)

    with pytest.raises(ValueError, match="unblockify: s01 has gates of block size 2, which does not divide its "
                                         "new block size 1"):
        edit.unblockify(root, block_size=1)


def test_grow_keeps_gates():
    root, _, _ = _gated_circuit(K=2)
    x = _x()
    gates = _random_gates(root, x.shape[0])
    new = edit.grow(root, num_duplicates=1, noise=0.0)
    g = _gated(new)
    assert g["s01"].gates.tie_to is g["s23"] and g["s23"].gates.block_size == 2
    # copies of the old edge blocks in a row: 4 of a sum's (2 x 2), 2 of the root's
    grown = {"s23": np.tile(gates["s23"], (1, 4, 1)), "root": np.tile(gates["root"], (1, 2, 1))}
    np.testing.assert_allclose(_gate_ll(new, grown, x), _gate_ll(root, gates, x), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_prune_gates_follow_the_kept_edge_blocks():
    for tie_params in (True, False):
        root, s01, s23 = _gated_circuit(K=2, tie_params=tie_params)
        # edge blocks 1 and 2 (parent 0 - child 1, parent 1 - child 0) get zero weights, so pruning them keeps
        # the function
        for s in {s01.source, s23.source}:
            w = s.own_params.copy()
            w[[1, 2]] = 0.0
            s.set_params(w)
        circuit = jaxpc.compile(root)
        x = _x()
        gates = _random_gates(root, x.shape[0])
        sc = np.array([1.0, 0.0, 0.0, 1.0])
        new = edit.prune(root, circuit, scores={s01: sc, s23: sc}, threshold=0.5)
        g = _gated(new)
        np.testing.assert_array_equal(g["s23"].edge_ids, [[0, 1], [0, 1]])
        assert g["s01"].gates.tie_to is g["s23"]
        assert jaxpc.compile(new).num_gates == 2 + 2  # s23: 2 edge blocks of 1 gate; the root: 2
        kept = {"s23": gates["s23"][:, [0, 3]], "root": gates["root"]}
        np.testing.assert_allclose(_gate_ll(new, kept, x), _gate_ll(root, gates, x), rtol=1e-5, atol=1e-5)
    # s01 and s23 (untied parameters) keep as many but different edge blocks: s01 gets gate columns of its own
    new = edit.prune(root, circuit, scores={s01: sc, s23: 1.0 - sc}, threshold=0.5)
    g = _gated(new)
    assert g["s01"].gates.tie_to is None and g["s01"].gates.block_size == 2
    assert jaxpc.compile(new).num_gates == 2 + 2 + 2


def _gated_merge_circuit(gate_ties=True):
    """s1, s2 over one product and s3, s4 over another, one gate per parent node; s3 reads s1's gates and
    s4 reads s2's (without ``gate_ties``: s3 and s4 have no gates); a gated root over s1 x s3 and s2 x s4."""
    a, b, c, d = (cat_inputs(v, 1, 2) for v in range(4))
    p01, p23 = jaxpc.multiply(a, b), jaxpc.multiply(c, d)
    s1, s2 = (_named_sum([p01], 1, 2, f"s{i}", seed=i).set_gates(1) for i in (1, 2))
    s3, s4 = (_named_sum([p23], 1, 2, f"s{i}", seed=i) for i in (3, 4))
    if gate_ties:
        s3.set_gates(tie_to=s1)
        s4.set_gates(tie_to=s2)
    root = _named_sum([jaxpc.multiply(s1, s3), jaxpc.multiply(s2, s4)], 1, 1, "root", seed=5).set_gates()
    return root, s1, s2, s3, s4


def test_merge_keeps_gates():
    root, s1, s2, s3, s4 = _gated_merge_circuit()
    x = _x()
    gates = _random_gates(root, x.shape[0])
    new = edit.merge(root, [[s1, s2], [s3, s4]])
    g = _gated(new)
    assert set(g) == {"s1+1", "s3+1", "root"} and g["s3+1"].gates.tie_to is g["s1+1"]
    merged = {"s1+1": np.concatenate([gates["s1"], gates["s2"]], axis=1), "root": gates["root"]}
    np.testing.assert_allclose(_gate_ll(new, merged, x), _gate_ll(root, gates, x), rtol=1e-5, atol=1e-5)
    # by default, gate-tied sums are left as they are, and sums with one gate block size are merged
    assert jaxpc.compile(edit.merge(root)).num_gates == jaxpc.compile(root).num_gates
    untied = _gated_merge_circuit(gate_ties=False)[0]
    g = _gated(edit.merge(untied))
    assert set(g) == {"s1+1", "root"} and g["s1+1"].edge_ids.shape[1] == 2
    assert all(ns.gates.block_size == 1 and ns.gates.tie_to is None for ns in g.values())

    with pytest.raises(ValueError, match=r"merge: s3 reads the gates of s1, but merged its edge blocks would be "
                                         r"0\.\.0 of s3 \(1 edge blocks\) and s1's 0\.\.0 of s1\+1 \(2\)"):
        edit.merge(root, [[s1, s2]])
    with pytest.raises(ValueError, match="merge: s3 reads the gates of s1, but merged"):
        edit.merge(root, [[s3, s4]])
    with pytest.raises(ValueError, match="merge: s4 reads the gates of s2, but merged"):
        edit.merge(root, [[s1, s2], [s4, s3]])  # the ties would cross
    p = s1.children[0]
    other = [_named_sum([p], 1, 2, "g2", seed=6).set_gates(2), _named_sum([p], 1, 2, "plain", seed=7)]
    for o, what in zip(other, ["gates of block size 2", "no gates"]):
        r = _named_sum([s1, o], 1, 1, "r", seed=8)
        with pytest.raises(ValueError, match=f"merge: cannot merge s1 \\(gates of block size 1\\) with {o.name} "
                                             f"\\({what}\\): merged sums need the same gates"):
            edit.merge(r, [[s1, o]])


# ----------------------------------------------------------------------------------------------
# argument errors
# ----------------------------------------------------------------------------------------------

def test_argument_errors_name_the_argument():
    assert jaxpc.edit is edit and "edit" in jaxpc.__all__ and "visualize" in jaxpc.__all__
    _, _, _, s, root = _block_diag_circuit()
    with pytest.raises(TypeError, match="blockify: root must be a node vector"):
        edit.blockify("root")
    with pytest.raises(ValueError, match="sparsity_tolerance"):
        edit.blockify(root, sparsity_tolerance=1.0)
    with pytest.raises(ValueError, match="max_block_size"):
        edit.blockify(root, max_block_size=0)
    with pytest.raises(ValueError, match="unblockify: block_size"):
        edit.unblockify(root, block_size=0)
    with pytest.raises(ValueError, match="params= is a pytree of a compiled circuit"):
        edit.deepcopy(root, params={})
    with pytest.raises(ValueError, match="noise"):
        edit.grow(root, noise=-1.0)
    with pytest.raises(ValueError, match="pseudocount"):
        edit.lvd_init(root, [s], np.zeros((3, 1), int), pseudocount=-1)
    with pytest.raises(ValueError, match="latents must be an int array"):
        edit.lvd_init(root, [s], np.zeros((3, 1)))


def test_params_and_flows_of_another_circuit_are_named():
    """Parameters are read at the placements of the circuit passed as circuit=: params or flows of another circuit
    raise, even where their leaves happen to be large enough to read (they would give wrong parameters)."""
    cat = distributions.Categorical(2)
    root = jaxpc.summate(jaxpc.multiply(cat_inputs(0, 1, 2, k=2), cat_inputs(1, 1, 2, k=2)), num_nodes=1)
    c = jaxpc.compile(root)
    bigger = jaxpc.compile(jaxpc.summate(jaxpc.multiply(jaxpc.inputs(0, 4, 2, cat), jaxpc.inputs(1, 4, 2, cat)),
                                         num_nodes=1))
    with pytest.raises(ValueError, match=r"deepcopy: params\['input'\]\['categorical'\]\['log_probs'\] has shape"):
        edit.deepcopy(root, circuit=c, params=bigger.params)
    x = np.zeros((2, 2), np.int32)
    with pytest.raises(ValueError, match=r"prune: flows\['sum'\]\['1x2'\] has shape"):
        edit.prune(root, c, flows=bigger.flows(bigger.params, x), keep_frac=0.5)
    edit.prune(root, c, flows=c.flows(c.params, x), keep_frac=0.5)


# ----------------------------------------------------------------------------------------------
# parameters as the circuit computes with them (not renormalized)
# ----------------------------------------------------------------------------------------------

def _logits(c, seed, scale=0.7):
    """``c.params`` moved off the simplex as gradient training on logits moves them: every sum log-weight and
    categorical log-probability plus noise (Gaussian and logistic fields as they are)."""
    rng = np.random.default_rng(seed)

    def move(path, a):
        keys = [getattr(k, "key", None) for k in path]
        if keys[0] == "sum" or keys[-1] == "log_probs":
            return a + np.asarray(rng.normal(0.0, scale, a.shape), a.dtype)
        return a
    import jax
    return jax.tree_util.tree_map_with_path(move, c.params)


def _oracle_ll(c, params, x, miss=None):
    return oracle.forward(c, params, np.asarray(x, np.float64), miss)[1]


@pytest.mark.parametrize("seed", [2, pytest.param(0, marks=pytest.mark.slow), pytest.param(5, marks=pytest.mark.slow)])
def test_edits_keep_log_prob_of_unnormalized_params(seed):
    """Parameters off the simplex (logits after gradient training): every function-preserving edit keeps what
    ``log_prob`` computes (the float64 evaluator over the new nodes against the compiled circuit), and so what
    ``optim.log_prob`` computes."""
    g = Generator(seed, 3, kinds=("categorical", "masked", "gaussian", "logistic", "literal"))
    root = g.circuit()
    c = jaxpc.compile(root, seed=seed)
    p = _logits(c, seed)
    x = g.sample_data(12)
    xj = x if "gaussian" in g.kinds else x.astype(np.int32)
    miss = np.random.default_rng(seed).random(x.shape) < 0.2
    ref = np.asarray(c.log_prob(p, xj, miss), np.float64)
    totals = [np.exp(np.asarray(v, np.float64)).sum(-1) for v in p["sum"].values()]
    assert max(np.abs(t - 1).max() for t in totals) > 0.1  # really off the simplex (per block rows, at least)
    variants = {
        "deepcopy": edit.deepcopy(root, circuit=c, params=p),
        "unblockify": edit.unblockify(root, circuit=c, params=p),
        "blockify": edit.blockify(root, 0.5, 8, circuit=c, params=p),
        "merge": edit.merge(root, circuit=c, params=p),
        "grow": edit.grow(root, 2, circuit=c, params=p),
    }
    for name, new in variants.items():
        np.testing.assert_allclose(node_ll(new, x, miss), ref, rtol=1e-5, atol=1e-5, err_msg=name)
    c2 = jaxpc.compile(variants["deepcopy"])
    np.testing.assert_allclose(np.asarray(c2.log_prob(c2.params, xj, miss)), ref, rtol=1e-5, atol=1e-5)
    if seed != 2:  # and so what optim.log_prob computes (each node's weights renormalized) is kept too
        np.testing.assert_allclose(np.asarray(jaxpc.optim.log_prob(c2, c2.params, xj, miss)),
                                   np.asarray(jaxpc.optim.log_prob(c, p, xj, miss)), rtol=1e-5, atol=1e-5)


def test_grow_and_prune_keep_each_nodes_total_weight():
    """Where an edit sets new weights, every node keeps its old total: grow's copies share it (noise or not), and
    prune's kept edges take it over (or, with ``renormalize=False``, keep their own weights)."""
    root, s1, s2 = _prune_circuit()
    c = jaxpc.compile(root)
    p = _logits(c, 0)
    W = np.asarray(c.get_node_params(p, s1), np.float64)  # [2, 6], rows not summing to one
    R = np.asarray(c.get_node_params(p, root), np.float64)
    assert np.abs(W.sum(1) - 1).max() > 0.1
    for noise in (0.0, 0.4):
        new = edit.grow(root, 1, noise, circuit=c, params=p)
        np.testing.assert_allclose(dense_weights(new.children[0].children[0]).sum(1), np.tile(W.sum(1), 2),
                                   rtol=1e-6)
        np.testing.assert_allclose(dense_weights(new).sum(1), R.sum(1), rtol=1e-6)
    sc = np.zeros(12)
    sc[[0, 1, 6, 7, 9]] = 1.0
    keep = (sc > 0.5).reshape(2, 6)
    for renormalize in (True, False):
        new = edit.prune(root, c, p, scores={s1: sc}, threshold=0.5, renormalize=renormalize)
        Wk = np.where(keep, W, 0.0)
        if renormalize:
            Wk = Wk * (W.sum(1) / Wk.sum(1))[:, None]
        n1 = new.children[0].children[0]
        chs = [m for m in (0, 1) if keep[:, 3 * m:3 * m + 3].any()]
        np.testing.assert_allclose(dense_weights(n1), np.concatenate([Wk[:, 3 * m:3 * m + 3] for m in chs], 1),
                                   rtol=1e-6)
        np.testing.assert_allclose(dense_weights(new), R, rtol=1e-6)  # not scored: as it was
    with pytest.raises(TypeError, match="prune: renormalize must be a bool, got 'no'"):
        edit.prune(root, c, p, scores={s1: sc}, threshold=0.5, renormalize="no")
    # by enumeration of all 81 states: normalized parameters stay normalized under prune, and without renormalizing
    # the mass of the dropped edges is gone
    x = all_x(4)
    mass = {r: np.exp(node_ll(edit.prune(root, c, scores={s1: sc}, threshold=0.5, renormalize=r), x)).sum()
            for r in (True, False)}
    np.testing.assert_allclose(np.exp(_oracle_ll(c, c.params, x)).sum(), 1.0, rtol=1e-6)
    np.testing.assert_allclose(mass[True], 1.0, rtol=1e-6)
    assert mass[False] < 0.9


def test_prune_of_edges_without_flow_keeps_log_prob():
    """Dropping the edge blocks that carry no flow of the data leaves ``log_prob`` of the data unchanged: exactly
    when their weights are zero (either mode), and with ``renormalize=False`` also when their children are zero on
    the data (with the default the dropped mass moves to the kept edges, raising it)."""
    root, s1, _ = _prune_circuit()
    c = jaxpc.compile(root)
    p = _logits(c, 2)
    grp, sl = c.param_slice(s1)  # zero weights at three of s1's edge blocks (and so of s2's)
    p["sum"][grp] = p["sum"][grp].at[np.array([1, 4, 8]) + sl.start].set(-np.inf)
    x = np.random.default_rng(0).integers(0, 3, (16, 4)).astype(np.int32)
    ref = _oracle_ll(c, p, x)
    assert np.all(np.isfinite(ref))
    fl = c.flows(p, x)
    for renormalize in (True, False):
        new = edit.prune(root, c, p, fl, threshold=1e-6, renormalize=renormalize)
        assert new.children[0].children[0].edge_ids.shape[1] == 9
        np.testing.assert_allclose(node_ll(new, x), ref, rtol=1e-5)
    # children zero on the data: deterministic a, b (node k reads x = k); with x = (0, 0) only the root's first
    # edge (a0 * b0) is used
    lit = [jaxpc.inputs(v, 1, 1, distributions.Literal(k)) for v in (0, 1) for k in (0, 1)]
    a = jaxpc.summate(*lit[:2], num_nodes=2, edge_ids=[[0, 1], [0, 1]], params=np.ones((2, 1, 1)))
    b = jaxpc.summate(*lit[2:], num_nodes=2, edge_ids=[[0, 1], [0, 1]], params=np.ones((2, 1, 1)))
    m = jaxpc.multiply(a, b, edge_ids=np.array([[0, 0], [1, 1], [0, 1]]))
    root = jaxpc.summate(m, num_nodes=1, params=np.array([[0.5, 0.3, 0.2]]))
    c = jaxpc.compile(root)
    x0 = np.zeros((3, 2), np.int32)
    fl = c.flows(c.params, x0)
    np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, root)), [[3, 0, 0]], atol=1e-6)
    ref = _oracle_ll(c, c.params, x0)
    np.testing.assert_allclose(ref, np.log(0.5), rtol=1e-6)
    kept = edit.prune(root, c, flows=fl, threshold=1e-6, renormalize=False)
    assert kept.edge_ids.shape[1] == 1
    np.testing.assert_allclose(node_ll(kept, x0), ref, rtol=1e-6)
    moved = edit.prune(root, c, flows=fl, threshold=1e-6)
    np.testing.assert_allclose(node_ll(moved, x0), 0.0, atol=1e-6)  # the root's one edge has all its weight


def test_values_a_node_cannot_hold_are_named():
    """A Bernoulli row off the simplex or a Gaussian sigma below min_sigma cannot be stored on a node vector: the
    edit names the vector and the way out (the normalized circuit), which then edits as optim.log_prob reads it."""
    b0 = jaxpc.inputs(0, 2, 1, distributions.Bernoulli(), name="flips")
    g1 = jaxpc.inputs(1, 2, 1, distributions.Gaussian(), name="heights")
    root = jaxpc.summate(jaxpc.multiply(b0, g1), num_nodes=1)
    c = jaxpc.compile(root)
    p = _logits(c, 1)
    for f in (edit.deepcopy, edit.grow, edit.merge, edit.blockify, edit.unblockify):
        with pytest.raises(ValueError, match=rf"{f.__name__}: the probabilities of flips \(params\['input'\]"
                                             r"\['bernoulli'\]\) sum to .* not one.*jaxpc.optim.normalize"):
            f(root, circuit=c, params=p)
    low = {"sum": c.params["sum"], "input": dict(c.params["input"])}
    low["input"]["gaussian"] = dict(low["input"]["gaussian"], log_scale=low["input"]["gaussian"]["log_scale"] - 9)
    with pytest.raises(ValueError, match=r"deepcopy: heights \(params\['input'\]\['gaussian'\]\): Gaussian sigma "
                                         r"must be >= min_sigma.*jaxpc.optim.normalize"):
        edit.deepcopy(root, circuit=c, params=low)
    pn = jaxpc.optim.normalize(c, p)
    new = edit.grow(root, 1, circuit=c, params=pn)
    x = np.stack([np.arange(6) % 2, np.linspace(-1, 1, 6)], 1)
    np.testing.assert_allclose(node_ll(new, x), np.asarray(jaxpc.optim.log_prob(c, p, x)), rtol=1e-5, atol=1e-5)


def test_grow_refuses_a_product_root():
    """A product root reads one copy of each child, so the grown copies under it would never be used."""
    a, b = cat_inputs(0, 2, 1), cat_inputs(1, 2, 1)
    root = jaxpc.multiply(random_sum([a], 1, 1), random_sum([b], 1, 1))
    with pytest.raises(ValueError, match=r"grow: the root .* is a product vector, .* copies would go unused"):
        edit.grow(root, 1)
    top = jaxpc.summate(root, num_nodes=1, params=np.ones((1, 1)))
    new = edit.grow(top, 1)
    assert new.edge_ids.shape[1] == 2  # the sum on top reads both copies
    np.testing.assert_allclose(node_ll(new, all_x(2)), node_ll(top, all_x(2)), rtol=1e-12)


def test_prune_grow_merge_compose_on_trained_logits():
    """Edits chain: prune a circuit trained off the simplex, grow the result, merge that; ties survive every step,
    each result compiles, and grow and merge keep the pruned circuit's log_prob."""
    root, s1, s2 = _prune_circuit()
    c = jaxpc.compile(root)
    p = _logits(c, 3)
    x = np.random.default_rng(1).integers(0, 3, (16, 4)).astype(np.int32)
    pruned = edit.prune(root, c, p, scores={s1: np.random.default_rng(2).random(12)}, keep_frac=0.5)
    grown = edit.grow(pruned, 1)
    merged = edit.merge(grown)
    assert len(topological_order(merged)) < len(topological_order(grown))  # s1's (and s2's) products merged
    ref = node_ll(pruned, x)
    for name, new in (("grow", grown), ("merge", merged)):
        tied = [ns for ns in topological_order(new) if ns.is_sum() and ns.is_tied()]
        assert len(tied) == 1 and tied[0].source.is_sum(), name
        np.testing.assert_allclose(node_ll(new, x), ref, rtol=1e-9, err_msg=name)
    c3 = jaxpc.compile(merged)
    np.testing.assert_allclose(np.asarray(c3.log_prob(c3.params, x)), ref, rtol=1e-5, atol=1e-5)
