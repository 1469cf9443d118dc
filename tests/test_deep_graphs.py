"""Node graphs of any depth: pickling and ``copy.deepcopy`` rebuild the whole graph without deep recursion,
keeping shared vectors shared, ties, gates and parameters; RAT-SPN leaf regions over the same variables share one
product."""

import copy
import pickle
import sys
from collections import Counter

import numpy as np
import pytest

import jaxpc
from jaxpc import distributions, structures
from jaxpc.nodes import topological_order

from .random_circuits import Generator
from .test_io import _assert_same_graph, _gated_root

DEPTH = 5_000


def _pickled(obj):
    return pickle.loads(pickle.dumps(obj))


@pytest.fixture(scope="module")
def chain():
    """A sum over a product of an input and the previous sum, ``DEPTH`` times (``3 * DEPTH - 1`` vectors), each
    input and sum with parameters of its own (stored in canonical form, unchecked, to build fast)."""
    cat = distributions.Categorical(3)
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(3), (DEPTH, 2))
    weights = rng.dirichlet(np.ones(2), (DEPTH, 2)).reshape(DEPTH, 4, 1, 1)  # [edge blocks, 1, 1], parent-major
    prev = None
    for v in range(DEPTH):
        leaf = jaxpc.inputs(v, 2, dist=cat)
        leaf.load_params({"probs": probs[v]})
        prev = jaxpc.summate(leaf if prev is None else jaxpc.multiply(leaf, prev), num_node_blocks=2)
        prev.load_params(weights[v])
    return prev


def _check_chain(root, loaded):
    """``loaded`` has ``root``'s structure and parameters, every vector a new object with a new id."""
    assert loaded is not root
    a, b = topological_order(root), topological_order(loaded)
    assert len(a) == len(b) == 3 * DEPTH - 1
    assert not {ns.id for ns in a} & {ns.id for ns in b}
    ia = {ns.id: i for i, ns in enumerate(a)}
    ib = {ns.id: i for i, ns in enumerate(b)}
    for x, y in zip(a, b):
        assert type(x) is type(y) and x.name == y.name and x.scope == y.scope
        assert (x.num_node_blocks, x.block_size) == (y.num_node_blocks, y.block_size)
        assert [ia[c.id] for c in x.children] == [ib[c.id] for c in y.children]
        if x.is_input():
            assert x.var == y.var and x.dist == y.dist
            assert np.array_equal(x.own_params["probs"], y.own_params["probs"])
        else:
            assert np.array_equal(x.edge_ids, y.edge_ids)
            assert not x.is_sum() or np.array_equal(x.own_params, y.own_params)


def test_pickling_a_5000_deep_chain_needs_no_deeper_recursion(chain):
    limit = sys.getrecursionlimit()
    assert limit < DEPTH  # (the default limit: recursing per level would fail)
    _check_chain(chain, _pickled(chain))
    assert sys.getrecursionlimit() == limit


def test_deepcopy_of_a_5000_deep_chain_needs_no_deeper_recursion(chain):
    _check_chain(chain, copy.deepcopy(chain))


def _down(ns, k: int):
    """The sum ``k`` levels under ``ns`` in a chain."""
    for _ in range(k):
        ns = ns.children[0].children[1]
    return ns


def test_vectors_pickled_together_stay_one_object_in_any_order():
    """Vectors listed before or after the root, children first or parents first, load as the vectors of the loaded
    graph (each pickled once, not once per reference)."""
    cat = distributions.Categorical(3)
    levels = [jaxpc.summate(jaxpc.inputs(0, 1, dist=cat), num_nodes=1)]  # levels[k + 1]: the sum over levels[k]
    for v in range(1, 300):
        levels.append(jaxpc.summate(jaxpc.multiply(jaxpc.inputs(v, 1, dist=cat), levels[-1]), num_nodes=1))
    one = len(pickle.dumps(levels[-1]))
    for got in (_pickled(levels), _pickled(levels[::-1])[::-1], copy.deepcopy(levels)):
        assert all(upper.children[0].children[1] is lower for lower, upper in zip(got, got[1:]))
    mid, top, bottom = _pickled([levels[100], levels[-1], levels[0]])
    assert _down(top, 199) is mid and _down(mid, 100) is bottom
    assert len(pickle.dumps(levels)) < 1.1 * one and len(pickle.dumps(levels[::-1])) < 1.1 * one


def _dag():
    """A product shared by two sums, a tied input, a tied sum, gates read from another vector, set parameters."""
    cat = distributions.Categorical(3)
    rng = np.random.default_rng(1)
    a = jaxpc.inputs(0, 2, 2, cat, params=rng.dirichlet(np.ones(3), 4), name="a")
    b = jaxpc.inputs(1, 2, 2, cat, name="b")
    b2 = b.duplicate(2, tie_params=True, name="b2")  # b's parameters, over variable 2
    shared = jaxpc.multiply(a, b, name="shared")
    s1 = jaxpc.summate(shared, num_node_blocks=2, block_size=2, params=rng.random((4, 4)) + 0.1, name="s1")
    s2 = s1.duplicate(tie_params=True, name="s2")  # over the same shared product
    s3 = jaxpc.summate(shared, num_node_blocks=1, block_size=2, name="s3").set_gates(1)
    s1.set_gates(tie_to=s2.set_gates())
    top = jaxpc.summate(s1, s2, num_node_blocks=2, block_size=2, name="top")
    mid = jaxpc.summate(jaxpc.multiply(top, b2, edge_ids=[[0, 0]]), jaxpc.multiply(s3, b2, edge_ids=[[0, 0]]),
                        num_node_blocks=1, block_size=2, name="mid")
    return jaxpc.summate(jaxpc.multiply(mid, jaxpc.inputs(3, 1, 2, cat, name="c")), num_nodes=1, name="root")


def _by_name(root):
    return {ns.name: ns for ns in topological_order(root, follow_ties=True)}


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_dag_keeps_shared_vectors_ties_gates_and_parameters(how):
    root = _dag()
    loaded = _pickled(root) if how == "pickle" else copy.deepcopy(root)
    _assert_same_graph(root, loaded)
    old, new = _by_name(root), _by_name(loaded)
    assert not {ns.id for ns in old.values()} & {ns.id for ns in new.values()}
    assert new["s1"].children[0] is new["s2"].children[0] is new["s3"].children[0] is new["shared"]
    assert new["s2"].tied_to is new["s1"] and new["b2"].tied_to is new["b"]
    assert new["s1"].gates.tie_to is new["s2"] and new["s3"].gates.tie_to is None
    assert new["s1"].get_params() is new["s2"].get_params()  # one array, as tied vectors share it
    new["b"].set_params(np.full((4, 3), 1 / 3))  # a tie of the loaded graph, not of the original
    np.testing.assert_array_equal(new["b2"].get_params()["probs"], np.full((4, 3), 1 / 3))
    assert old["b"].get_params() is None and old["b2"].get_params() is None
    assert all(ns.dist is new["a"].dist for ns in new.values() if ns.is_input())  # one distribution object
    assert jaxpc.multiply(new["s1"], new["c"], edge_ids=[[0, 0], [1, 0]]).scope == 0b1011  # usable as built


def test_a_tie_source_outside_the_graph_comes_along():
    template = jaxpc.inputs(5, 1, 2, distributions.Categorical(3), params=np.full((2, 3), 1 / 3))
    a, b = template.duplicate(0, tie_params=True), template.duplicate(1, tie_params=True)
    loaded = _pickled(jaxpc.summate(jaxpc.multiply(a, b), num_nodes=1))
    la, lb = loaded.children[0].children
    assert la.tied_to is lb.tied_to and la.tied_to is not template and la.source.var == 5


@pytest.mark.parametrize("which", ["random", "gated"])
def test_a_loaded_graph_computes_what_the_original_does(which):
    """Every distribution, ties and block-sparse edges (a random circuit), and gates read across vectors: the
    compiled log-likelihoods of the loaded graph equal the original's."""
    rng = np.random.default_rng(0)
    if which == "random":
        gen = Generator(5, num_vars=4)
        root, x, ev = gen.circuit(), gen.sample_data(6), None
    else:
        root, x = _gated_root(), rng.integers(0, 3, (5, 4)).astype(np.int32)
    loaded = _pickled(root)
    _assert_same_graph(root, loaded)
    c1, c2 = jaxpc.compile(root, seed=0), jaxpc.compile(loaded, seed=0)
    if which == "gated":
        ev = {"sum_gates": rng.normal(size=(5, c1.num_gates)).astype(np.float32)}
    np.testing.assert_array_equal(np.asarray(c1.log_prob(c1.params, x, evidence=ev)),
                                  np.asarray(c2.log_prob(c2.params, x, evidence=ev)))


def test_a_shallow_copy_is_unchanged():
    """``copy.copy`` makes a new object with the same attributes, as it did before vectors pickled as graphs."""
    root = _dag()
    dup = copy.copy(root)
    assert dup is not root and dup.__dict__ == root.__dict__ and dup.children is root.children


# ----------------------------------------------------------------------------------------------
# RAT_SPN
# ----------------------------------------------------------------------------------------------

def _repeated_products(root):
    """How many product vectors multiply the same children as an earlier one (the same values, computed again)."""
    keys = Counter(tuple(sorted(c.id for c in ns.children)) for ns in topological_order(root) if ns.is_prod())
    return sum(n - 1 for n in keys.values())


def _num_regions(n: int, d: int, depth: int, pieces: int) -> int:
    if d >= depth or n < pieces:
        return 1
    q, r = divmod(n, pieces)
    return 1 + sum(_num_regions(q + (i < r), d + 1, depth, pieces) for i in range(pieces))


@pytest.mark.parametrize("args", [(8, 2, 3, 4, 2), (4, 2, 9, 3, 2), (2, 2, 3, 3, 2), (5, 2, 2, 3, 3), (7, 2, 1, 4, 4)])
def test_rat_spn_builds_each_leaf_product_once(args):
    """Leaf regions over the same variables (a region smaller than ``num_pieces``, or at ``depth``) multiply the
    same shared input vectors, so they share one product; each region keeps a sum vector of its own."""
    nv, nl, depth, reps, pieces = args
    root = structures.RAT_SPN(nv, nl, depth, reps, num_pieces=pieces, input_dist=distributions.Categorical(2),
                              seed=3)
    assert _repeated_products(root) == 0
    num_sums = sum(ns.is_sum() for ns in topological_order(root))
    assert num_sums == 1 + reps * (_num_regions(nv, 0, depth, pieces) - 1)  # (the root sums the top products)
