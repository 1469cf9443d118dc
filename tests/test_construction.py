"""Building circuits from nodes: odd but valid circuits against brute-force enumeration, and invalid ones refused
with an error that names the node."""

import itertools

import numpy as np
import pytest

import jaxpc
from jaxpc import distributions
from jaxpc.nodes import InputNodes, topological_order

from . import oracle

Cat = distributions.Categorical


def _all_values(cats):
    return np.array(list(itertools.product(*[range(k) for k in cats])), dtype=np.int32)


def _odd_circuit():
    """One circuit of the odd but valid shapes: a sum over a single child, a product of a single child, a sum whose
    children are an input, a product and a sum over one scope, the same child listed twice, products that reuse a
    child block and sparse sum edges that leave child blocks unread, block sizes 3, 5 and 7 that do not divide each
    other, a mixed-leaf variable and single-node layers."""
    a = jaxpc.inputs(0, num_node_blocks=2, block_size=3, dist=Cat(3))
    b = jaxpc.inputs(1, num_node_blocks=3, block_size=3, dist=Cat(2))
    only = jaxpc.summate(jaxpc.multiply(a), num_node_blocks=2, block_size=3)  # a product of one child
    mixed = jaxpc.summate(a, only, jaxpc.summate(a, a, num_node_blocks=1, block_size=3), num_node_blocks=2,
                          block_size=3)
    p = jaxpc.multiply(mixed, b, edge_ids=[[0, 0], [0, 1], [1, 2], [1, 0]])
    s = jaxpc.summate(p, edge_ids=[[0, 0, 1], [0, 3, 3]], block_size=5)
    c = jaxpc.summate(jaxpc.inputs(2, num_node_blocks=1, block_size=5, dist=Cat(2)),
                      jaxpc.inputs(2, num_node_blocks=1, block_size=5, dist=distributions.Bernoulli()),
                      num_node_blocks=2, block_size=5)
    q = jaxpc.multiply(s, c)
    s7 = jaxpc.summate(q, num_node_blocks=1, block_size=7)
    one = jaxpc.summate(s7, num_nodes=1)
    return jaxpc.summate(one, num_nodes=1), [3, 2, 2]  # a sum over one single-node child


@pytest.mark.slow
def test_odd_valid_circuit_matches_enumeration():
    root, cats = _odd_circuit()
    c = jaxpc.compile(root)
    x = _all_values(cats)
    ll = np.asarray(c.log_prob(c.params, x))
    _, ref = oracle.forward(c, c.params, x)
    np.testing.assert_allclose(ll, ref, atol=1e-5)
    np.testing.assert_allclose(np.log(np.exp(ref).sum()), 0.0, atol=1e-6)
    miss = np.array([False, True, False])
    _, mref = oracle.forward(c, c.params, x, miss=np.broadcast_to(miss, x.shape))
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x, missing=miss)), mref, atol=1e-5)
    sums, ins, _ = oracle.flow_totals(c, c.params, x)
    assert oracle.check_flows(c, c.flows(c.params, x), sums, ins) >= 8


@pytest.mark.parametrize("root_kind", ["input", "product"])
def test_a_leaf_or_a_product_as_the_root_matches_enumeration(root_kind):
    a = jaxpc.inputs(0, num_nodes=1, dist=Cat(3))
    root = a if root_kind == "input" else jaxpc.multiply(a, jaxpc.inputs(1, num_nodes=1, dist=Cat(2)))
    cats = [3] if root_kind == "input" else [3, 2]
    c = jaxpc.compile(root)
    x = _all_values(cats)
    _, ref = oracle.forward(c, c.params, x)
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x)), ref, atol=1e-6)
    sums, ins, _ = oracle.flow_totals(c, c.params, x)
    assert oracle.check_flows(c, c.flows(c.params, x), sums, ins) == len(cats)


def test_a_cycle_of_children_is_named_at_compile():
    a = jaxpc.inputs(0, num_nodes=2, dist=Cat(2))
    b = jaxpc.inputs(1, num_nodes=2, dist=Cat(2))
    low = jaxpc.summate(a, num_nodes=2, name="low")
    high = jaxpc.summate(jaxpc.multiply(low, b), num_nodes=2, name="high")
    low.children = (high,)  # made by hand: the building functions cannot make a cycle
    with pytest.raises(ValueError, match="cycle: low has the child high, which is low or one of its ancestors"):
        jaxpc.compile(jaxpc.summate(high, num_nodes=1))
    loop = jaxpc.summate(a, num_nodes=1, name="loop")
    loop.children = (loop,)
    with pytest.raises(ValueError, match="cycle: loop has the child loop"):
        jaxpc.compile(loop)


def test_tied_to_refuses_a_cycle_of_ties_and_non_nodes():
    a = jaxpc.inputs(0, num_nodes=2, dist=Cat(2))
    s1 = jaxpc.summate(a, num_nodes=1, name="s1")
    s2 = s1.duplicate(tie_params=True, name="s2")
    s3 = s2.duplicate(tie_params=True, name="s3")
    with pytest.raises(ValueError, match="s1.tied_to = s3 would tie s1 to itself"):
        s1.tied_to = s3  # source, compile and get_params looped forever on the ring
    with pytest.raises(ValueError, match="would tie s1 to itself"):
        s1.tied_to = s1
    with pytest.raises(TypeError, match="s1.tied_to must be a node vector or None, got int"):
        s1.tied_to = 3
    with pytest.raises(TypeError, match="leaf.tied_to must be a node vector or None, got str"):
        InputNodes(1, 2, 1, Cat(2), source="a", name="leaf")
    assert s1.tied_to is None and s3.source is s1
    s3.tied_to = None
    assert s3.source is s3


def test_a_child_given_twice_to_multiply_is_named():
    a = jaxpc.inputs(0, 1, dist=Cat(2), name="leaf")
    b = jaxpc.inputs(1, 1, dist=Cat(2))
    with pytest.raises(ValueError, match=r"leaf shares variables \[0\] with leaf \(children 0 and 2\)"):
        jaxpc.multiply(a, b, a)


def test_sum_params_that_are_not_real_numbers_name_the_vector():
    a = jaxpc.inputs(0, 2, dist=Cat(2))
    for bad in ([["x", "y"]], [[1 + 1j, 1.0]], [[1.0, 2.0], [3.0]]):
        with pytest.raises(TypeError, match="weights: params must be an array of real, non-negative weights"):
            jaxpc.summate(a, num_nodes=1, params=bad, name="weights")


def test_duplicate_onto_other_objects_is_a_type_error():
    a = jaxpc.inputs(0, 2, dist=Cat(2))
    s = jaxpc.summate(a, num_nodes=1, name="s")
    with pytest.raises(TypeError, match="duplicate of s: children must be node vectors, got int for child 0"):
        s.duplicate(3)
    with pytest.raises(TypeError, match="children must be node vectors, got str"):
        jaxpc.duplicate(jaxpc.multiply(a), "a")


def test_set_gates_refuses_a_bool_block_size():
    s = jaxpc.summate(jaxpc.inputs(0, 2, dist=Cat(2)), num_node_blocks=1, block_size=2)
    with pytest.raises(ValueError, match="block_size must be a positive divisor.*got True"):
        s.set_gates(True)


def test_a_copy_of_a_tied_vector_keeps_its_sources_parameters():
    probs, weights = np.array([[0.9, 0.1], [0.2, 0.8]]), np.array([[0.3, 0.7]])
    a = jaxpc.inputs(0, num_nodes=2, dist=Cat(2), params=probs)
    a_copy = a.duplicate(1, tie_params=True).duplicate(2)
    s = jaxpc.summate(a, num_nodes=1, params=weights)
    s_copy = s.duplicate(a.duplicate(3), tie_params=True).duplicate(a_copy)
    assert not a_copy.is_tied() and not s_copy.is_tied()
    np.testing.assert_allclose(a_copy.get_params()["probs"], probs)
    c = jaxpc.compile(s_copy)
    np.testing.assert_allclose(np.asarray(c.get_node_params(c.params, s_copy)), weights, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(c.get_node_params(c.params, a_copy)), probs, rtol=1e-6)


def test_a_tied_input_built_on_its_source_is_not_a_cycle():
    src = jaxpc.inputs(0, 2, dist=Cat(2))
    tied = InputNodes(1, 2, 1, Cat(2), source=src)
    root = jaxpc.summate(jaxpc.multiply(src, tied), num_nodes=1)
    assert topological_order(root, follow_ties=True)[-1] is root


def test_sum_weights_near_the_float64_maximum_normalize():
    a = jaxpc.inputs(0, 2, dist=Cat(2))
    s = jaxpc.summate(a, a, num_node_blocks=2, block_size=1,
                      params=[[1e308, 1e308, 0.0, 1e308], [1.0, 3.0, 0.0, 0.0]])  # their sums overflowed to 0 weights
    np.testing.assert_allclose(s.get_params().reshape(2, 4), [[1 / 3, 1 / 3, 0, 1 / 3], [0.25, 0.75, 0, 0]],
                               rtol=1e-15)


def test_compile_names_a_bad_scan_min_repeats():
    root = jaxpc.summate(jaxpc.inputs(0, 2, dist=Cat(2)), num_nodes=1)
    for bad, err in ((-1, ValueError), (2.5, TypeError), ("3", TypeError), (True, TypeError)):
        with pytest.raises(err, match="compile: scan_min_repeats must be an int >= 0"):
            jaxpc.compile(root, scan_min_repeats=bad)
