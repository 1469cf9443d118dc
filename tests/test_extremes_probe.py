"""Degenerate and extreme shapes as a user meets them: a root that is an input vector, one child per sum, block size
1 everywhere at a batch of one, tens of thousands of categories, very wide and very deep sums, and batches in unusual
numpy layouts, checked against the float64 oracle (tests/oracle.py); data that the circuit's dtype cannot hold is
refused with an error naming the entry."""

import numpy as np
import pytest

import jaxpc
from jaxpc import checks, distributions

from . import oracle
from .random_circuits import Generator

Cat = distributions.Categorical


def _check_against_oracle(c, x, miss=None, atol=2e-5):
    """log_prob and flows of ``c`` on ``x`` (``miss``: ``bool[V]`` or ``[B, V]``) equal the float64 oracle's; returns
    how many source vectors' flows were compared."""
    m = None if miss is None else np.broadcast_to(miss, x.shape)
    _, ref = oracle.forward(c, c.params, x, m)
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x, miss)), ref, atol=atol)
    sums, ins, _ = oracle.flow_totals(c, c.params, x, m)
    return oracle.check_flows(c, c.flows(c.params, x, miss), sums, ins)


def _pair(K, block_size=2):
    """A mixture of ``block_size`` products of two ``Categorical(K)`` leaves (variables 0 and 1)."""
    a = jaxpc.inputs(0, 1, block_size, Cat(K))
    b = jaxpc.inputs(1, 1, block_size, Cat(K))
    return jaxpc.summate(jaxpc.multiply(a, b), num_node_blocks=1, block_size=1)


# ---------------------------------------------------------------------------------------------
# circuits without sums, sums of one child
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dist, params, x", [
    (Cat(3), np.array([[0.2, 0.3, 0.5]]), np.array([[2], [0], [1]])),
    (distributions.Bernoulli(), np.array([0.3]), np.array([[1], [0]])),
    (distributions.Gaussian(), {"mu": np.array([0.3]), "sigma": np.array([1.5])},
     np.array([[0.7], [-2.0]], np.float32)),
], ids=["categorical", "bernoulli", "gaussian"])
def test_a_root_that_is_one_input_node_is_a_circuit_without_sums(dist, params, x):
    c = jaxpc.compile(jaxpc.inputs(0, 1, 1, dist, params=params))
    assert c.params["sum"] == {}
    assert _check_against_oracle(c, x, np.array([[False], [True]] + [[False]] * (len(x) - 2))) == 1


def test_em_on_a_root_input_node_is_the_empirical_distribution():
    c = jaxpc.compile(jaxpc.inputs(0, 1, 1, Cat(3), params=np.array([[0.2, 0.3, 0.5]])))
    new = c.em_step(c.params, np.array([[0], [2], [2], [2]]))
    np.testing.assert_allclose(np.asarray(c.get_node_params(new, c.root)), [[0.25, 0.0, 0.75]], atol=1e-6)


def test_a_root_that_is_an_input_vector_of_several_nodes_is_refused():
    with pytest.raises(ValueError, match="the root must be a single node.*has 3 nodes"):
        jaxpc.compile(jaxpc.inputs(0, 1, 3, Cat(3)))


def test_a_sum_of_one_child_block_matches_the_oracle():
    c = jaxpc.compile(jaxpc.summate(jaxpc.inputs(0, 1, 4, Cat(3)), num_node_blocks=1, block_size=1))
    x, miss = np.array([[1], [2]]), np.array([[False], [True]])
    _, ref = oracle.forward(c, c.params, x, miss)
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x, miss)), ref, atol=2e-5)


@pytest.mark.full  # (no bug found: the full tier)
@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_block_size_one_everywhere_at_a_batch_of_one(seed):
    gen = Generator(seed, num_vars=3, kinds=("categorical", "bernoulli", "masked"), block_sizes=(1,))
    c = jaxpc.compile(gen.circuit(), seed=seed)
    assert _check_against_oracle(c, gen.sample_data(1).astype(np.int32)) > 1


# ---------------------------------------------------------------------------------------------
# extreme sizes
# ---------------------------------------------------------------------------------------------

@pytest.mark.full  # (no bug found: the full tier)
@pytest.mark.slow
def test_seventy_thousand_categories_match_the_oracle_and_bound_the_range():
    c = jaxpc.compile(_pair(70_000))
    x = np.array([[0, 69_999], [12_345, 1]], np.int32)
    assert _check_against_oracle(c, x, np.array([True, False]), atol=1e-4) == 3
    with pytest.raises(ValueError, match=r"x\[0, 0\] = 70000 is out of range.*\[0, 69999\]"):
        c.log_prob(c.params, np.array([[70_000, 0]], np.int32))
    with pytest.raises(ValueError, match=r"x\[0, 1\] = 70000 is out of range"):
        c.log_prob(c.params, np.array([[0, 70_000]], np.uint32))


@pytest.mark.full  # (no bug found: the full tier)
@pytest.mark.slow
def test_a_sum_of_ten_thousand_child_vectors_matches_the_oracle():
    children = [jaxpc.inputs(0, 1, 1, Cat(3)) for _ in range(10_000)]
    c = jaxpc.compile(jaxpc.summate(*children, num_node_blocks=1, block_size=1))
    assert _check_against_oracle(c, np.array([[0], [2]]), atol=1e-4) == 10_001


@pytest.mark.full  # (no bug found: the full tier)
@pytest.mark.slow
def test_a_chain_of_two_thousand_sums_is_one_scan_and_matches_the_oracle():
    n = jaxpc.inputs(0, 1, 2, Cat(3))
    for i in range(2000):
        n = jaxpc.summate(n, num_node_blocks=1, block_size=2 if i < 1999 else 1)
    c = jaxpc.compile(n)
    assert "x1999" in c.summary()
    assert _check_against_oracle(c, np.array([[0], [1], [2]]), atol=1e-4) == 2001


# ---------------------------------------------------------------------------------------------
# batches in unusual numpy forms
# ---------------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_matrix_broadcast_memmap_and_tuple_batches_give_the_same_answers(tmp_path):
    c = jaxpc.compile(_pair(5, block_size=4))
    x = np.array([[0, 3], [4, 1]], np.int32)
    want = np.asarray(c.log_prob(c.params, x))
    mm = np.memmap(tmp_path / "x.dat", dtype=np.int32, mode="w+", shape=x.shape)
    mm[:] = x
    for form in (np.matrix(x), mm, tuple(map(tuple, x.tolist()))):
        np.testing.assert_array_equal(np.asarray(c.log_prob(c.params, form)), want)
    np.testing.assert_array_equal(np.asarray(c.log_prob(c.params, np.broadcast_to(x[:1], (3, 2)))), want[[0, 0, 0]])


def test_booleans_are_category_ids_zero_and_one():
    c = jaxpc.compile(_pair(1))
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, np.array([[False, False]]))), [0.0], atol=1e-6)
    with pytest.raises(ValueError, match=r"x\[0, 1\] = True is out of range.*Categorical\(num_cats=1\)"):
        c.log_prob(c.params, np.array([[False, True]]))


# ---------------------------------------------------------------------------------------------
# float64 data for a float32 circuit
# ---------------------------------------------------------------------------------------------

def _mixed():
    g = jaxpc.inputs(0, 1, 2, distributions.Gaussian())
    h = jaxpc.inputs(1, 1, 2, Cat(3))
    return jaxpc.compile(jaxpc.summate(jaxpc.multiply(g, h), num_node_blocks=1, block_size=1))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_float64_data_that_overflow_float32_are_named():
    c = _mixed()
    good = np.array([[0.5, 1.0], [0.25, 2.0]])
    bad = np.array([[1e300, 1.0], [0.25, 2.0]])
    for _ in range(2):  # the first call, then its replay
        np.testing.assert_array_equal(np.isfinite(np.asarray(c.log_prob(c.params, good))), True)
        with pytest.raises(ValueError, match=r"x\[0, 0\] = 1e\+300 overflows the circuit's float32.*Gaussian"):
            c.log_prob(c.params, bad)
    np.testing.assert_array_equal(np.isfinite(np.asarray(c.log_prob(c.params, bad, np.array([True, False])))), True)


def test_a_row_of_probability_zero_with_a_huge_gaussian_value_leaves_em_finite():
    g = jaxpc.inputs(0, 1, 2, distributions.Gaussian(), params={"mu": np.array([0.0, 1.0]), "sigma": np.ones(2)})
    c = jaxpc.compile(jaxpc.summate(g, num_node_blocks=1, block_size=1))
    x = np.array([[1e20], [0.5]], np.float32)  # finite, but its square is not: the row's density underflows to 0
    ll = np.asarray(c.log_prob(c.params, x))
    assert ll[0] == -np.inf and np.isfinite(ll[1])
    new = c.get_node_params(c.em_step(c.params, x), g)
    np.testing.assert_allclose(np.asarray(new["mu"]), [0.5, 0.5], atol=1e-6)  # the other row alone
    assert np.isfinite(np.asarray(new["sigma"])).all()


def test_general_ll_at_a_tiny_alpha_keeps_a_single_term_exact():
    """Each parent here has one possible child per sample, so every alpha gives its term's value exactly."""
    a = jaxpc.inputs(0, 1, 2, Cat(3), params=np.array([[1.0, 0, 0], [0, 1.0, 0]]))
    b = jaxpc.inputs(1, 1, 2, Cat(3), params=np.array([[0.5, 0.5, 0], [0, 0.3, 0.7]]))
    c = jaxpc.compile(jaxpc.summate(jaxpc.multiply(a, b), num_node_blocks=1, block_size=1))
    x = np.array([[0, 0], [1, 1]])
    _, ref = oracle.forward(c, c.params, x)
    got = np.asarray(c.log_prob(c.params, x, propagation="GeneralLL", alpha=1e-7))
    np.testing.assert_allclose(got, ref, atol=1e-5)


def test_host_check_accepts_values_that_round_to_the_largest_float():
    a = jaxpc.inputs(0, 1, 1, distributions.Gaussian())
    b = jaxpc.inputs(1, 1, 1, distributions.Gaussian())
    circuit = jaxpc.compile(jaxpc.summate(jaxpc.multiply(a, b), num_nodes=1), seed=0)
    x = np.array([[float(np.finfo(np.float32).max) * (1 + 1e-9), 0.0]])
    assert np.isfinite(x.astype(np.float32)).all()
    checks.check_host_values(circuit.runtime.var_info, x, None, "x", np.float32)
