"""One invariant suite inherited by every structure (and hand-built circuits)."""

import itertools

import jax
import numpy as np
import pytest

import jaxpc
from jaxpc import distributions, structures

from .random_circuits import Generator

_BUILT: dict = {}


class StructureInvariants:
    """Subclasses define ``build()`` -> (root, num_cats per variable or None for reals) and may set
    ``region_complete`` when every sum vector is reached by every sample (HMM, HCLT)."""

    region_complete = False
    em_rounds = 3

    def build(self):
        raise NotImplementedError

    @pytest.fixture
    def setup(self):
        """(circuit, cards, data), built once per class (the circuit keeps its compiled executables). The data has
        as many rows as the circuit has joint states, and the samples too: the enumeration, the data and the
        samples share one ``log_prob`` executable."""
        if type(self) not in _BUILT:
            root, cards = self.build()
            c = jaxpc.compile(root)
            rng = np.random.default_rng(0)
            data = np.stack([rng.integers(0, k, int(np.prod(cards))) for k in cards], axis=1).astype(np.int32)
            _BUILT[type(self)] = (c, cards, data)
        return _BUILT[type(self)]

    def test_sums_to_one(self, setup):
        c, cards, _ = setup
        x = np.asarray(list(itertools.product(*[range(k) for k in cards])), dtype=np.int32)
        ll = np.asarray(c.log_prob(c.params, x), np.float64)
        assert abs(np.exp(ll).sum() - 1.0) < 1e-5

    def test_log_prob_finite(self, setup):
        c, _, data = setup
        assert np.all(np.isfinite(np.asarray(c.log_prob(c.params, data))))

    def test_flows_conserve_batch(self, setup):
        c, _, data = setup
        B = data.shape[0]
        fl = c.flows(c.params, data)
        root_total = float(np.asarray(c.get_node_flows(fl, c.root)).sum())
        assert root_total == pytest.approx(B, rel=1e-5)
        # every sample's induced tree holds exactly one leaf per variable
        per_var = np.zeros(c.num_vars)
        counted = set()
        for ns in c.nodes:
            if ns.is_input() and ns.source.id not in counted:
                counted.add(ns.source.id)
                per_var[ns.var] += float(np.asarray(c.get_node_flows(fl, ns)).sum())
        tied_vars = {ns.var for ns in c.nodes if ns.is_input() and ns.is_tied()}
        if not tied_vars:
            np.testing.assert_allclose(per_var, B, rtol=1e-4)
        else:  # tied leaves pool their flows
            assert per_var.sum() == pytest.approx(B * c.num_vars, rel=1e-4)
        if self.region_complete:
            for ns in c.nodes:
                if ns.is_sum() and not ns.is_tied() and not any(
                        m.is_sum() and m.is_tied() and m.source is ns for m in c.nodes):
                    assert float(np.asarray(c.get_node_flows(fl, ns)).sum()) == pytest.approx(B, rel=1e-4)

    def test_conditionals_sum_to_one(self, setup):
        c, _, data = setup
        miss = np.random.default_rng(3).random(data[:8].shape) < 0.5
        cond = np.asarray(c.conditional(c.params, data[:8], miss))
        np.testing.assert_allclose(cond.sum(-1), 1.0, rtol=1e-5)
        assert np.all(cond >= 0)

    def test_mpe_assignment_attains_its_value(self, setup):
        c, _, data = setup
        miss = np.random.default_rng(4).random(data[:8].shape) < 0.5
        assign, value = c.mpe(c.params, data[:8], miss)
        np.testing.assert_allclose(np.asarray(c.log_prob(c.params, assign, propagation="MPE")), np.asarray(value),
                                   atol=1e-4)
        assert np.all(np.asarray(assign)[~miss] == data[:8][~miss])

    def test_samples_are_valid(self, setup):
        c, cards, data = setup
        n = len(data)  # as many as the joint states
        s = np.asarray(c.sample(c.params, jax.random.key(0), n))
        assert s.shape == (n, len(cards))
        assert np.all((s >= 0) & (s < np.asarray(cards)[None, :]))
        assert np.all(np.isfinite(np.asarray(c.log_prob(c.params, s))))  # validated as data, possible under the model

    def test_em_raises_training_ll(self, setup):
        c, _, data = setup
        params = c.params
        lls = []
        n = len(data)
        batch_size = n // next(p for p in range(2, n + 1) if n % p == 0)  # several whole batches: one executable
        for _ in range(self.em_rounds):
            params, ll = c.full_batch_em(params, data, batch_size=batch_size, pseudocount=0.01, return_ll=True)
            lls.append(float(ll))
        lls.append(float(np.mean(np.asarray(c.log_prob(params, data)))))
        assert lls[-1] > lls[0] + 1e-3
        assert all(b >= a - 1e-4 for a, b in zip(lls, lls[1:]))


class TestHMMTied(StructureInvariants):
    region_complete = True

    def build(self):
        return structures.HMM(4, 3, 3), [3] * 4


@pytest.mark.slow
class TestHMMUntied(StructureInvariants):
    region_complete = True

    def build(self):
        return structures.HMM(4, 4, 3, homogeneous=False, block_size=2), [3] * 4


class TestHCLT(StructureInvariants):
    region_complete = True

    def build(self):
        rng = np.random.default_rng(1)
        z = rng.integers(0, 3, (300, 1))
        x = (z + rng.integers(0, 2, (300, 5))) % 3
        return structures.HCLT(x, 4, input_dist=distributions.Categorical(3), block_size=2), [3] * 5


@pytest.mark.slow
class TestPD(StructureInvariants):
    def build(self):
        return structures.PD((2, 3), 4, split_intervals=1, input_dist=distributions.Categorical(2)), [2] * 6


@pytest.mark.slow
class TestPDProdDominated(StructureInvariants):
    def build(self):
        return structures.PD((2, 3), 2, split_intervals=1, structure_type="prod_dominated",
                             input_dist=distributions.Categorical(2), max_prod_block_conns=1), [2] * 6


@pytest.mark.slow
class TestPDTied(StructureInvariants):
    def build(self):
        return structures.PD((3, 2), 4, split_points=([1, 2], [1]), tie_homogeneous_params=True,
                             input_dist=distributions.Categorical(2), block_size=2), [2] * 6


@pytest.mark.slow
class TestRATSPN(StructureInvariants):
    def build(self):
        return structures.RAT_SPN(5, 4, depth=2, num_repetitions=3, input_dist=distributions.Categorical(3)), [3] * 5


@pytest.mark.slow
class TestPDHCLT(StructureInvariants):
    def build(self):
        rng = np.random.default_rng(2)
        data = rng.integers(0, 2, (200, 6))
        root = structures.PDHCLT(data, (2, 3), 2, split_intervals=(1, 2), input_dist=distributions.Categorical(2))
        return root, [2] * 6


@pytest.mark.slow
class TestHandBuilt(StructureInvariants):
    def build(self):
        gen = Generator(5, 4, kinds=("categorical", "bernoulli"))  # full-support leaves: all data possible
        cards = [3 if k == "categorical" else 2 for k in gen.kinds]
        return gen.circuit(), cards


# ---------------------------------------------------------------------------------------------
# structure-specific checks
# ---------------------------------------------------------------------------------------------

def test_hmm_scans_all_steps_and_compiles_flat():
    c = jaxpc.compile(structures.HMM(1024, 8, 5))
    assert len(c.layout.steps) <= 4  # the 1023 repeated steps are one lax.scan
    assert c.num_vars == 1024


def test_hmm_given_matrices_become_params():
    rng = np.random.default_rng(0)
    L, V = 3, 4
    alpha = rng.dirichlet(np.ones(L), L)
    beta = rng.dirichlet(np.ones(V), L)
    gamma = rng.dirichlet(np.ones(L))
    root = structures.HMM(5, L, V, alpha=alpha, beta=beta, gamma=gamma)
    c = jaxpc.compile(root)
    np.testing.assert_allclose(np.asarray(c.get_node_params(c.params, root)), gamma[None], rtol=1e-6)
    trans = root.children[0].children[1]
    emit = root.children[0].children[0]
    np.testing.assert_allclose(np.asarray(c.get_node_params(c.params, trans)), alpha, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(c.get_node_params(c.params, emit)), beta, rtol=1e-6)


def test_generalized_hmm_gaussian_emissions():
    root = structures.GeneralizedHMM(6, 4, distributions.Gaussian(), beta={"mu": np.arange(4.0), "sigma": np.ones(4)})
    c = jaxpc.compile(root)
    x = np.random.default_rng(0).normal(1.5, 1, (20, 6))
    p = c.params
    for _ in range(3):
        p, ll = c.full_batch_em(p, x, return_ll=True)
    assert np.isfinite(float(ll))
    assert float(np.mean(np.asarray(c.log_prob(p, x)))) > float(np.mean(np.asarray(c.log_prob(c.params, x))))


def test_hclt_learns_the_chain():
    """Data from a Markov chain x0 -> x1 -> ... : the Chow-Liu tree recovers the chain's edges."""
    rng = np.random.default_rng(0)
    n, V = 3000, 6
    x = np.zeros((n, V), np.int64)
    x[:, 0] = rng.integers(0, 4, n)
    for v in range(1, V):
        flip = rng.random(n) < 0.15
        x[:, v] = np.where(flip, rng.integers(0, 4, n), x[:, v - 1])
    mi = structures.mutual_information(x, num_bins=8, sigma=0.1)
    children, root = structures.chow_liu_tree(mi)
    edges = {tuple(sorted((p, c))) for p in range(V) for c in children[p]}
    assert edges == {(v, v + 1) for v in range(V - 1)}
    assert root in (2, 3)  # the center of a 6-chain


def test_hclt_names_data_that_its_discrete_leaves_do_not_admit():
    """The data an HCLT learns its tree from must hold values of its leaves where they are discrete (integers in
    their range, in any dtype): else a ``ValueError`` names the first bad entry and counts them; continuous leaves
    take any finite value."""
    x = np.random.default_rng(0).integers(0, 5, (50, 4))
    cat = distributions.Categorical(num_cats=5)
    for data in (x, x.astype(np.uint8), x.astype(np.float32)):
        assert structures.HCLT(data, num_latents=2, input_dist=cat) is not None
    bad = x.copy()
    bad[3, 2] = 5
    with pytest.raises(ValueError, match=r"HCLT: x\[3, 2\] = 5 is not a value of the leaves "
                                         r"\(Categorical\(num_cats=5\) accepts integers in \[0, 4\]\)$"):
        structures.HCLT(bad, num_latents=2, input_dist=cat)
    with pytest.raises(ValueError, match=r"x\[0, 0\] = -1 .*\(200 bad entries in all\)"):
        structures.HCLT(x - 5, num_latents=2, input_dist=cat)
    with pytest.raises(ValueError, match=r"x\[1, 3\] = 0.5 is not a value"):
        frac = x.astype(np.float64)
        frac[1, 3] = 0.5
        structures.HCLT(frac, num_latents=2, input_dist=cat)
    with pytest.raises(ValueError, match=r"x\[0, 0\] = 30\d .*Categorical\(num_cats=256\)"):  # the default leaves
        structures.HCLT(x + 300, num_latents=2)
    with pytest.raises(ValueError, match="PDHCLT|HCLT: x"):  # through the PD's regions
        structures.PDHCLT(bad, data_shape=(2, 2), num_latents=2, split_intervals=(1, 1), input_dist=cat)
    gauss = np.random.default_rng(1).normal(size=(50, 4))
    assert structures.HCLT(gauss, num_latents=2, input_dist=distributions.Gaussian()) is not None


@pytest.mark.parametrize("chunk_size", [3, 4, 5, 64])
def test_mutual_information_equals_the_soft_binned_formula_for_every_block_split(chunk_size):
    """Blocks of ``chunk_size`` variables (4, 3 with padding, 2 and 1 of them for 10 variables) each pair with
    about half of the others; every pair's information equals the soft-binned histogram's, computed pair by pair."""
    x = np.random.default_rng(2).integers(0, 5, (400, 10))
    nb, sigma = 6, 0.15
    s = (x - x.min()) / (x.max() - x.min() + 1e-8)
    p = np.exp(-0.5 * np.square(s[:, :, None] - np.linspace(0, 1, nb)[None, None, :]) / sigma ** 2)
    marg = (p / p.sum(axis=2, keepdims=True)).mean(axis=0)
    h1 = -np.sum(marg * np.log(marg + 1e-4), axis=1)
    want = np.zeros((10, 10))
    for i in range(10):
        for j in range(10):
            joint = np.einsum("ba,bc->ac", p[:, i], p[:, j]) / len(x)
            joint /= joint.sum()
            want[i, j] = h1[i] + h1[j] + np.sum(joint * np.log(joint + 1e-4))
    got = structures.mutual_information(x, num_bins=nb, sigma=sigma, chunk_size=chunk_size)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(got, got.T)


def test_mutual_information_is_the_same_with_x64_enabled():
    """Under ``jax_enable_x64`` the soft bins are float32 as without it (the compiled pairwise product takes
    float32), so the information is the same."""
    x = np.random.default_rng(1).integers(0, 4, (300, 10))
    want = structures.mutual_information(x, num_bins=8, sigma=0.1)
    with jax.enable_x64(True):
        got = structures.mutual_information(x, num_bins=8, sigma=0.1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_pd_structure_sizes_and_vars():
    root = structures.PD((4, 4), 8, split_intervals=2, input_dist=distributions.Categorical(2))
    c = jaxpc.compile(root)
    assert c.num_vars == 16
    leaves = sorted({ns.var for ns in c.nodes if ns.is_input()})
    assert leaves == list(range(16))
    with pytest.raises(ValueError, match="structure_type must be one of"):
        structures.PD((4, 4), 8, split_intervals=2, structure_type="mixed")
    with pytest.raises(ValueError, match="split point 9 of axis 0"):
        structures.PD((4, 4), 8, split_points=([9], [1]))
    with pytest.raises(ValueError, match="num_latents=12 must be a multiple of block_size=8"):
        structures.PD((4, 4), 12, split_intervals=2, block_size=8)


@pytest.mark.slow
def test_products_no_edge_joins_get_no_flow():
    """A sparse sum (as PD builds past ``max_prod_block_conns``) may join none of a product's blocks: that product
    and what only it reaches get exactly zero flow (the likelihood's gradient there is zero), so one EM step moves
    their weights towards the pseudocount's uniform target alone."""
    cat, bs = distributions.Categorical(3), 4
    leaf = [jaxpc.inputs(v, num_node_blocks=2, block_size=bs, dist=cat) for v in range(2)]
    dead_sum = jaxpc.summate(jaxpc.multiply(*leaf), num_node_blocks=2, block_size=bs)
    dead = jaxpc.multiply(dead_sum)
    live = jaxpc.multiply(*[jaxpc.summate(n, num_node_blocks=2, block_size=bs) for n in leaf])
    # both blocks of the root region join blocks 2 and 3 (the live product's) only
    top = jaxpc.summate(dead, live, num_node_blocks=2, block_size=bs, edge_ids=np.array([[0, 0, 1, 1], [2, 3, 2, 3]]))
    root = jaxpc.summate(top, num_node_blocks=1, block_size=1)
    c = jaxpc.compile(root, seed=1)
    x = np.random.default_rng(0).integers(0, 3, (16, 2)).astype(np.int32)
    fl = c.flows(c.params, x)
    logf = {"sum": {k: jax.numpy.log(v) for k, v in fl["sum"].items()}, "input": c.params["input"]}
    assert float(np.sum(c.get_node_params(logf, dead_sum))) == 0.0
    assert float(np.sum(c.get_node_params(logf, top))) == pytest.approx(len(x), rel=1e-5)
    step, pc = 0.3, 0.2
    new = c.em_step(c.params, x, step_size=step, pseudocount=pc)
    old_w = np.asarray(c.get_node_params(c.params, dead_sum))
    np.testing.assert_allclose(np.asarray(c.get_node_params(new, dead_sum)),
                               (1 - step) * old_w + step / (2 * bs), rtol=1e-5)


def test_rat_spn_is_seeded():
    a = jaxpc.compile(structures.RAT_SPN(8, 4, 2, 2, input_dist=distributions.Categorical(2), seed=3))
    b = jaxpc.compile(structures.RAT_SPN(8, 4, 2, 2, input_dist=distributions.Categorical(2), seed=3))
    x = np.random.default_rng(0).integers(0, 2, (5, 8)).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(a.log_prob(a.params, x)), np.asarray(b.log_prob(b.params, x)))


@pytest.mark.slow
def test_structures_train_under_jit_and_vmap():
    c = jaxpc.compile(structures.HMM(5, 4, 3))
    x = np.random.default_rng(0).integers(0, 3, (8, 5)).astype(np.int32)
    keys = jax.random.split(jax.random.key(1), 2)
    lls = jax.vmap(lambda k: c.log_prob(c.init_params(k), x))(keys)
    assert lls.shape == (2, 8) and np.all(np.isfinite(np.asarray(lls)))


def _shapes(circuit):
    return jax.tree_util.tree_map(lambda a: a.shape, circuit.params)


def test_structures_take_numpy_integers_and_refuse_bools():
    """Sizes given as NumPy integers (read from arrays or configs) build the circuit Python ints build; a bool is not
    a size."""
    i = np.int64
    cat = distributions.Categorical(3)
    x = np.random.default_rng(0).integers(0, 3, (20, 4))
    pairs = [(structures.HMM(4, 2, 3), structures.HMM(i(4), i(2), i(3), block_size=i(2))),
             (structures.RAT_SPN(4, 2, 1, 2, input_dist=cat),
              structures.RAT_SPN(i(4), i(2), i(1), i(2), num_pieces=i(2), input_dist=cat)),
             (structures.PD((2, 2), 2, split_intervals=1, input_dist=cat),
              structures.PD((i(2), i(2)), i(2), split_intervals=i(1), max_prod_block_conns=i(4), input_dist=cat)),
             (structures.HCLT(x, 2, num_bins=8, chunk_size=2, input_dist=cat),
              structures.HCLT(x, i(2), num_bins=i(8), chunk_size=i(2), input_dist=cat))]
    for a, b in pairs:
        ca, cb = jaxpc.compile(a, seed=1), jaxpc.compile(b, seed=1)
        assert _shapes(ca) == _shapes(cb)
    hmm_a, hmm_b = (jaxpc.compile(pairs[0][k], seed=1) for k in (0, 1))
    for u, v in zip(jax.tree_util.tree_leaves(hmm_a.params), jax.tree_util.tree_leaves(hmm_b.params)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    for make, match in ((lambda: structures.HMM(True, 2, 3), "HMM: seq_length must be a positive int, got True"),
                        (lambda: structures.HMM(4, 2, np.int64(0)), "HMM: num_emits must be a positive int"),
                        (lambda: structures.RAT_SPN(4, 2, True, 2), "RAT_SPN: depth must be an int >= 0, got True"),
                        (lambda: structures.PD((2, 2), 2, split_intervals=True), "PD: split_intervals must be"),
                        (lambda: structures.HMM(4, 2, 3, block_size=True),
                         r"HMM: block_size must be a positive int dividing num_latents=2 \(or None\), got True")):
        with pytest.raises(ValueError, match=match):
            make()


def test_compile_seed_check_names_seed():
    from jaxpc.compiler.compile import check_seed

    assert check_seed(np.int64(3)) == 3 and type(check_seed(np.int64(3))) is int
    with pytest.raises(ValueError, match="compile: seed must be an int >= 0, got -1"):
        check_seed(-1)
    for bad in (True, 1.5, "0"):
        with pytest.raises(TypeError, match="compile: seed must be an int >= 0"):
            check_seed(bad)
    with pytest.raises(ValueError, match="compile: seed must be an int >= 0, got -1"):
        jaxpc.compile(structures.HMM(3, 2, 2), seed=-1)


def test_pd_split_points_and_depth_are_checked():
    with pytest.raises(ValueError, match=r"PD: split point 1.5 of axis 0 must be an int in \(0, 4\)"):
        structures.PD((4, 2), 2, split_points=[[1.5], [1]])
    with pytest.raises(ValueError, match=r"PD: split points of axis 0 must be distinct, got \[2, 1, 1\]"):
        structures.PD((4, 2), 2, split_points=[[2, 1, 1], [1]])
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="PD: max_split_depth must be an int >= 0"):
            structures.PD((4, 2), 2, split_intervals=1, max_split_depth=bad)
    assert jaxpc.compile(structures.PD((4, 2), 2, split_points=[[np.int64(2)], [1]], max_split_depth=1)).num_vars == 8


def test_pd_data_shape_is_checked():
    """A data shape is a sequence of positive ints: a float is not truncated to one, and an int alone is named."""
    for bad in (6, (2.5, 3), (True, 2), (0, 3), (), np.zeros((2, 2), int)):
        with pytest.raises(ValueError, match="PD: data_shape must be a tuple of positive ints"):
            structures.PD(bad, 2, split_intervals=1)
    with pytest.raises(ValueError, match="PDHCLT: data_shape must be a tuple of positive ints"):
        structures.PDHCLT(np.zeros((4, 6), int), 6, 2, split_intervals=1)
    assert structures.PD(np.array([2, 3]), 2, split_intervals=1).scope == (1 << 6) - 1
