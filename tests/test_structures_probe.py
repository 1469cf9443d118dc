"""The ready structures and the node builders as a user meets them: edge-case sizes checked against exact float64
answers (brute-force enumeration through tests/oracle.py, the HMM forward algorithm), and bad arguments refused
with an error that names them."""

import itertools

import numpy as np
import pytest

import jaxpc
from jaxpc import distributions, structures
from jaxpc.nodes import ProdNodes, SumNodes

from . import oracle

Cat = distributions.Categorical


def _all_values(cards):
    return np.array(list(itertools.product(*[range(k) for k in cards])), dtype=np.int32)


def _check_normalized(root, cards, seed=1):
    """``root`` compiles to a circuit whose float64 oracle sums to 1 over every assignment (up to the float32
    rounding of the drawn parameters) and whose compiled log-likelihoods match the oracle's."""
    c = jaxpc.compile(root, seed=seed)
    assert c.num_vars == len(cards)
    x = _all_values(cards)
    _, ref = oracle.forward(c, c.params, x)
    assert np.exp(ref).sum() == pytest.approx(1.0, abs=1e-6)
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x)), ref, atol=2e-5)
    return c


# ---------------------------------------------------------------------------------------------
# every structure is a normalized circuit, down to its smallest sizes
# ---------------------------------------------------------------------------------------------

def _hclt_data(cols):
    rng = np.random.default_rng(0)
    z = rng.integers(0, 3, (60, 1))
    x = (z + rng.integers(0, 2, (60, 4))) % 3
    return np.concatenate([x, np.zeros((60, 1), int), x[:, :1]], axis=1)[:, cols]  # a constant and a copied column


TINY = {
    "hmm_one_step": lambda: (structures.HMM(1, 2, 3), [3]),
    "hmm_one_state": lambda: (structures.HMM(3, 1, 2), [2] * 3),
    "hmm_one_emit": lambda: (structures.HMM(3, 2, 1), [1] * 3),
    "hmm_untied": lambda: (structures.HMM(3, 4, 2, homogeneous=False, block_size=2), [2] * 3),
    "hmm_bernoulli": lambda: (structures.GeneralizedHMM(3, 2, distributions.Bernoulli()), [2] * 3),
    "rat_spn_one_latent": lambda: (structures.RAT_SPN(3, 1, 2, 2, input_dist=Cat(2)), [2] * 3),
    "rat_spn_uneven_pieces": lambda: (structures.RAT_SPN(5, 2, 2, 2, num_pieces=3, input_dist=Cat(2)), [2] * 5),
    "rat_spn_as_many_vars_as_pieces": lambda: (structures.RAT_SPN(2, 2, 3, 3, input_dist=Cat(3)), [3] * 2),
    "pd_one_cell": lambda: (structures.PD((1,), 2, split_intervals=1, input_dist=Cat(3)), [3]),
    "pd_no_splits": lambda: (structures.PD((2, 2), 2, split_points=[[], []], input_dist=Cat(2)), [2] * 4),
    "pd_depth_0": lambda: (structures.PD((2, 2), 2, split_intervals=1, max_split_depth=0, input_dist=Cat(2)),
                           [2] * 4),
    "pd_3d_prod_dominated": lambda: (structures.PD((1, 2, 2), 2, split_intervals=1, structure_type="prod_dominated",
                                                   max_prod_block_conns=1, input_dist=Cat(2)), [2] * 4),
    "pd_sparse_products": lambda: (structures.PD((1, 4), 2, split_intervals=1, max_prod_block_conns=1, block_size=1,
                                                 input_dist=Cat(2)), [2] * 4),
    "pd_tied_one_latent": lambda: (structures.PD((1, 4), 1, split_intervals=1, tie_homogeneous_params=True,
                                                 input_dist=Cat(2)), [2] * 4),
    "hclt_one_var": lambda: (structures.HCLT(_hclt_data([0]), 2, input_dist=Cat(3)), [3]),
    "hclt_one_latent": lambda: (structures.HCLT(_hclt_data([0, 1, 2]), 1, input_dist=Cat(3)), [3] * 3),
    "hclt_constant_and_copied_columns": lambda: (structures.HCLT(_hclt_data([0, 1, 4, 5]), 2, input_dist=Cat(3)),
                                                 [3] * 4),
    "hclt_one_category": lambda: (structures.HCLT(np.zeros((10, 3), int), 2, input_dist=Cat(1)), [1] * 3),
}


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_structures_are_normalized(name):
    root, cards = TINY[name]()
    _check_normalized(root, cards)


# ---------------------------------------------------------------------------------------------
# HMM against the forward algorithm
# ---------------------------------------------------------------------------------------------

def _forward_algorithm(alpha, beta, gamma, x, miss=None):
    """log p(x) of an HMM by the forward recursion in float64 (missing emissions marginalized: a factor of 1)."""
    out = np.empty(len(x))
    for b, seq in enumerate(x):
        em = beta[:, seq].T.copy()  # [T, L]
        if miss is not None:
            em[miss[b]] = 1.0
        f = gamma * em[0]
        for t in range(1, len(seq)):
            f = (f @ alpha) * em[t]
        out[b] = np.log(f.sum())
    return out


@pytest.mark.parametrize("homogeneous,L,block_size", [(True, 3, None), (False, 3, None), (True, 4, 2)])
def test_hmm_matches_the_forward_algorithm(homogeneous, L, block_size):
    rng = np.random.default_rng(0)
    T, V = 5, 4
    alpha, beta, gamma = rng.dirichlet(np.ones(L), L), rng.dirichlet(np.ones(V), L), rng.dirichlet(np.ones(L))
    c = jaxpc.compile(structures.HMM(T, L, V, homogeneous=homogeneous, block_size=block_size, alpha=alpha * 3,
                                     beta=beta, gamma=gamma))  # (alpha's rows renormalized)
    x = rng.integers(0, V, (16, T)).astype(np.int32)
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x)), _forward_algorithm(alpha, beta, gamma, x),
                               rtol=1e-5)
    miss = rng.random(x.shape) < 0.4
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x, missing=miss)),
                               _forward_algorithm(alpha, beta, gamma, x, miss), rtol=1e-5)


def test_hmm_sums_to_one_over_all_sequences_by_the_forward_algorithm():
    rng = np.random.default_rng(1)
    L, V = 2, 3
    alpha, beta, gamma = rng.dirichlet(np.ones(L), L), rng.dirichlet(np.ones(V), L), rng.dirichlet(np.ones(L))
    c = jaxpc.compile(structures.HMM(4, L, V, alpha=alpha, beta=beta, gamma=gamma))
    x = _all_values([V] * 4)
    ref = _forward_algorithm(alpha, beta, gamma, x)
    assert np.exp(ref).sum() == pytest.approx(1.0, abs=1e-12)
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x)), ref, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------------------------

def test_sum_params_refuse_booleans_and_other_non_numbers():
    a = jaxpc.inputs(0, 2, dist=Cat(2))
    for bad in ([[True, False]], np.array([[True, True]])):
        with pytest.raises(TypeError, match="w: params must be an array of real, non-negative weights, got booleans"):
            jaxpc.summate(a, num_nodes=1, params=bad, name="w")
    for bad in ([["1", "2"]], [[np.datetime64("2020"), 1]], [[None, 1.0]]):
        with pytest.raises(TypeError, match="w: params must be an array of real, non-negative weights, got an array"):
            jaxpc.summate(a, num_nodes=1, params=bad, name="w")
    s = jaxpc.summate(a, num_nodes=1)
    with pytest.raises(TypeError, match="got booleans"):
        s.set_params([[False, True]])
    import jax.numpy as jnp

    for good in ([[1, 3]], np.array([[1, 3]], np.uint8), jnp.array([[1, 3]], jnp.bfloat16)):
        np.testing.assert_allclose(jaxpc.summate(a, num_nodes=1, params=good).get_params().ravel(), [0.25, 0.75])


def test_node_constructors_check_what_the_builders_check():
    """ProdNodes and SumNodes built directly refuse what multiply and summate refuse."""
    a, a2, b = (jaxpc.inputs(v, 1, dist=Cat(2)) for v in (0, 0, 1))
    with pytest.raises(ValueError, match="multiply: children must have disjoint scopes"):
        ProdNodes([a, a2], np.zeros((1, 2), np.int64))
    with pytest.raises(ValueError, match="summate: children must share one scope"):
        SumNodes([a, b], 1, 1, np.array([[0, 0], [0, 1]]))
    with pytest.raises(ValueError, match=r"summate: edge_ids\[1\] must be child blocks in \[0, 1\)"):
        SumNodes([a], 1, 1, np.array([[0], [5]]))
    with pytest.raises(ValueError, match="multiply: children must share a block size"):
        ProdNodes([a, jaxpc.inputs(1, 1, 3, dist=Cat(2))], np.zeros((1, 2), np.int64))
    with pytest.raises(ValueError, match="summate: needs at least one child"):
        SumNodes([], 1, 1, np.array([[0], [0]]))
    assert SumNodes([a, a], 2, 1, None).edge_ids.tolist() == [[0, 0, 1, 1], [0, 1, 0, 1]]


def test_compile_names_a_vector_whose_children_changed():
    a, b, c = (jaxpc.inputs(v, 1, dist=Cat(2)) for v in range(3))
    s = jaxpc.summate(a, num_nodes=1, name="s")
    s.children = (b,)  # made by hand: the builders refuse such circuits
    with pytest.raises(ValueError, match=r"invalid: s has scope \{0\}, but its children's is \{1\}"):
        jaxpc.compile(jaxpc.summate(jaxpc.multiply(s, c), num_nodes=1))
    mix = jaxpc.summate(a, a, num_nodes=1, name="mix")
    mix.children = (a, b)
    with pytest.raises(ValueError, match=r"not smooth: mix sums .* of scope \{0\} and .* of scope \{1\}"):
        jaxpc.compile(mix)
    p = jaxpc.multiply(a, b, name="p")
    p.children = (a, a)
    with pytest.raises(ValueError, match=r"not decomposable: p multiplies .* \(child 1\), which shares variables "
                                         r"\[0\]"):
        jaxpc.compile(jaxpc.summate(p, num_nodes=1))
    p.children = (a, "b")
    with pytest.raises(TypeError, match="p has a child that is not a node vector: str"):
        jaxpc.compile(jaxpc.summate(p, num_nodes=1))


def test_inputs_name_a_distribution_class_and_a_name_that_is_not_a_string():
    with pytest.raises(TypeError, match=r"inputs: dist must be a distribution instance, got the class Categorical"):
        jaxpc.inputs(0, 1, dist=Cat)
    with pytest.raises(TypeError, match="name must be a str or None, got int 3"):
        jaxpc.inputs(0, 1, dist=Cat(2), name=3)


def test_rat_spn_refuses_fewer_variables_than_pieces():
    """Fewer variables than pieces cannot be split: every repetition would be the same product of all the leaves
    (the paper's rule leaves a region of fewer variables than pieces unsplit), so it is an error, as ``depth=0``."""
    for nv, pieces in ((1, 2), (2, 3), (3, 4)):
        with pytest.raises(ValueError, match=f"RAT_SPN: num_vars={nv} is fewer than num_pieces={pieces}"):
            structures.RAT_SPN(nv, 2, 1, 3, num_pieces=pieces, input_dist=Cat(2))


def test_rat_spn_depth_past_single_variables_adds_nothing():
    """Regions of fewer variables than pieces are leaf regions, so a depth past that builds the same circuit."""
    sizes = []
    for depth in (2, 9):
        c = jaxpc.compile(structures.RAT_SPN(4, 2, depth, 3, input_dist=Cat(2), seed=5), seed=1)
        sizes.append(sum(ns.num_nodes for ns in c.nodes))
        prods = [ns for ns in c.root.children]
        assert len({tuple(ch.id for ch in p.children) for p in prods}) == 3  # no repetition repeats another
    assert sizes[0] == sizes[1]


def test_structures_name_bad_seeds_distributions_and_flags():
    x = np.random.default_rng(0).integers(0, 2, (20, 4))
    cases = [
        (lambda: structures.RAT_SPN(4, 2, 1, 2, seed=-1), ValueError, "RAT_SPN: seed must be an int >= 0, got -1"),
        (lambda: structures.RAT_SPN(4, 2, 1, 2, seed=1.5), ValueError, "RAT_SPN: seed must be an int >= 0"),
        (lambda: structures.RAT_SPN(4, 2, 1, 2, input_dist=Cat), TypeError,
         "RAT_SPN: input_dist must be a distribution instance, got the class Categorical"),
        (lambda: structures.RAT_SPN(4, 2, 1, 2, block_size=0), ValueError,
         r"RAT_SPN: block_size must be a positive int dividing num_latents=2 \(or None\), got 0"),
        (lambda: structures.PD((2, 3), 2, split_intervals=1, seed=-1), ValueError, "PD: seed must be an int >= 0"),
        (lambda: structures.PD((2, 2), 2, split_intervals=1, input_dist="cat"), TypeError,
         "PD: input_dist must be a jaxpc.distributions.Distribution, got str"),
        (lambda: structures.PD((2, 2), 2, split_intervals=1, tie_homogeneous_params="no"), TypeError,
         "PD: tie_homogeneous_params must be True or False, got str 'no'"),
        (lambda: structures.HMM(3, 2, 3, homogeneous="no"), TypeError, "HMM: homogeneous must be True or False"),
        (lambda: structures.GeneralizedHMM(3, 2, distributions.Gaussian), TypeError,
         "HMM: input_dist must be a distribution instance, got the class Gaussian"),
        (lambda: structures.GeneralizedHMM(3, 2, None), TypeError, "HMM: input_dist must be a jaxpc.distributions"),
        (lambda: structures.HCLT(x, 2, input_dist="cat"), TypeError, "HCLT: input_dist must be a jaxpc"),
        (lambda: structures.HCLT(x, 2, input_dist=Cat(2), tie_input_params="yes"), TypeError,
         "HCLT: tie_input_params must be True or False"),
    ]
    for make, err, match in cases:
        with pytest.raises(err, match=match):
            make()


def test_hmm_names_bad_probabilities():
    ok = np.full((2, 2), 0.5)
    cases = [
        (dict(alpha=[[True, False], [False, True]]), TypeError, "HMM: alpha must hold real numbers"),
        (dict(gamma=["1", "2"]), TypeError, "HMM: gamma must hold real numbers"),
        (dict(beta=[[True, False], [False, True]]), TypeError, "HMM: beta must hold real numbers"),
        (dict(alpha=[[-1, 2], [1, 1]]), ValueError, "HMM: alpha must be finite and non-negative"),
        (dict(alpha=[[0, 0], [1, 1]]), ValueError, r"HMM: alpha row 0 sums to zero"),
        (dict(beta=[[1, 1], [0, 0]]), ValueError, r"HMM: beta row 1 sums to zero"),
        (dict(gamma=[0, 0], alpha=ok), ValueError, "HMM: gamma sums to zero"),
        (dict(gamma=[[0.5, 0.5]]), ValueError, r"HMM: gamma must have shape \[num_latents\] = \[2\]"),
    ]
    for kw, err, match in cases:
        with pytest.raises(err, match=match):
            structures.HMM(3, 2, 2, **kw)
    with pytest.raises(ValueError, match="HMM: num_latents must be a positive int, got '2'"):
        structures.HMM(3, "2", 2, beta=ok)


def test_hclt_checks_its_data_and_variables():
    x = np.random.default_rng(0).integers(0, 3, (30, 4))
    cat = Cat(3)
    cases = [
        (lambda: structures.HCLT(x[:, :0], 2, input_dist=cat), r"HCLT: x must be \[num_samples >= 2, num_vars >= 1\], "
                                                               r"got shape \(30, 0\)"),
        (lambda: structures.HCLT(x, 2, input_dist=cat, variables=[0, 0, 1, 2]), "variables must be distinct, but 0"),
        (lambda: structures.HCLT(x, 2, input_dist=cat, variables=[0.5, 1, 2, 3]), "variables must be ints >= 0, "
                                                                                  "got 0.5"),
        (lambda: structures.HCLT(x, 2, input_dist=cat, variables=[True, False, 2, 3]), "must be ints >= 0, got True"),
        (lambda: structures.HCLT(x, 2, input_dist=cat, variables="abcd"), "one variable id per column of x"),
        (lambda: structures.HCLT(x, 2, input_dist=cat, variables=[0, 1, 2]), "one variable id per column of x"),
        (lambda: structures.HCLT(x, 2, input_dist=cat, sigma=True), "sigma must be a positive float, got True"),
        (lambda: structures.mutual_information(x[:0]), r"mutual_information: x must be \[num_samples >= 1"),
    ]
    for make, match in cases:
        with pytest.raises(ValueError, match=match):
            make()
    root = structures.HCLT(x, 2, input_dist=cat, variables=np.array([7, 3, 5, 1]))
    assert sorted(root.scope_vars) == [1, 3, 5, 7]


def test_hclt_takes_wide_float64_and_boolean_data():
    """float64 data past float32's range is scaled before it is rounded (it was refused as infinite); booleans and
    boolean scores are numbers."""
    x = np.random.default_rng(0).normal(size=(40, 3))
    x[0, 1] = 1e39
    assert structures.HCLT(x, 2, input_dist=distributions.Gaussian()).scope == 0b111
    children, root = structures.chow_liu_tree(np.eye(3, dtype=bool))
    assert sum(len(ch) for ch in children) == 2 and 0 <= root < 3
    assert structures.HCLT(np.random.default_rng(1).random((30, 3)) < 0.5, 2, input_dist=Cat(2)).scope == 0b111


def test_pd_checks_its_splits_and_leaf_fn():
    cases = [
        (lambda: structures.PD((2, 2), 2, split_intervals=1.0), ValueError,
         r"PD: split_intervals must be a positive int or one per axis \(2\), got 1.0"),
        (lambda: structures.PD((2, 2), 2, split_points=5), ValueError,
         r"PD: split_points needs one list of split positions per axis \(2\)"),
        (lambda: structures.PD((2, 2), 2, split_points=[1, 1]), ValueError, "split_points needs one list"),
        (lambda: structures.PD((2, 2), 2, split_intervals=1, leaf_fn=3), TypeError, "PD: leaf_fn must be a callable"),
        (lambda: structures.PD((2, 2), 2, split_intervals=1, leaf_fn=lambda vs, L, bs: 3), TypeError,
         r"PD: leaf_fn must return a node vector, got int for the variables \[0\]"),
        (lambda: structures.PD((2, 2), 2, split_intervals=1,
                               leaf_fn=lambda vs, L, bs: jaxpc.inputs(0, L // bs, bs, dist=Cat(2))), ValueError,
         r"PD: leaf_fn returned .* over the variables \[0\], but its leaf region holds the variables \[1\]"),
        (lambda: structures.PDHCLT(np.zeros((1, 4), int), (2, 2), 2, split_intervals=1), ValueError,
         r"PDHCLT: data must be \[num_samples >= 2, 4\]"),
    ]
    for make, err, match in cases:
        with pytest.raises(err, match=match):
            make()
    root = structures.PD((2, 2), 2, split_points=np.array([[1], [1]]), input_dist=Cat(2))
    assert root.scope == 0b1111


def test_hclt_checks_its_sizes_before_learning_the_tree(monkeypatch):
    """A bad ``num_latents``, ``block_size`` or ``num_root_ns`` is named before the mutual information (the costly
    part on large data) is computed."""
    from jaxpc.structures import hclt

    def no_mi(*args, **kwargs):
        raise AssertionError("the tree was learned before the sizes were checked")

    monkeypatch.setattr(hclt, "mutual_information", no_mi)
    x = np.random.default_rng(0).integers(0, 2, (10, 3))
    for kw, match in ((dict(num_latents=0), "HCLT: num_latents must be a positive int, got 0"),
                      (dict(num_latents=4, block_size=3), "HCLT: num_latents=4 must be a multiple of block_size=3"),
                      (dict(num_latents=4, num_root_ns=6), "HCLT: num_root_ns=6 must be 1 or a multiple of "
                                                           "block_size=4")):
        with pytest.raises(ValueError, match=match):
            structures.HCLT(x, input_dist=Cat(2), **kw)


def test_structures_refuse_zero_and_negative_sizes():
    x = np.random.default_rng(0).integers(0, 2, (10, 3))
    cat = Cat(2)
    cases = [
        (lambda v: structures.HMM(v, 2, 2), "HMM: seq_length must be a positive int"),
        (lambda v: structures.HMM(3, v, 2), "HMM: num_latents must be a positive int"),
        (lambda v: structures.HMM(3, 2, v), "HMM: num_emits must be a positive int"),
        (lambda v: structures.RAT_SPN(v, 2, 1, 2, input_dist=cat), "RAT_SPN: num_vars must be a positive int"),
        (lambda v: structures.RAT_SPN(4, v, 1, 2, input_dist=cat), "RAT_SPN: num_latents must be a positive int"),
        (lambda v: structures.RAT_SPN(4, 2, 1, v, input_dist=cat), "RAT_SPN: num_repetitions must be a positive int"),
        (lambda v: structures.PD((2, 2), v, split_intervals=1, input_dist=cat), "PD: num_latents must be a positive"),
        (lambda v: structures.PD((2, v), 2, split_intervals=1, input_dist=cat), "PD: data_shape must be a tuple of "
                                                                               "positive ints"),
        (lambda v: structures.HCLT(x, v, input_dist=cat), "HCLT: num_latents must be a positive int"),
        (lambda v: structures.HCLT(x, 2, input_dist=cat, chunk_size=v), "chunk_size must be a positive int"),
    ]
    for make, match in cases:
        for v in (0, -2):
            with pytest.raises(ValueError, match=match):
                make(v)
