"""jaxpc.edit options as a researcher passes them: numpy and 0-d array scalars (a fraction computed with numpy,
a noise level read from a config array) act as the equal Python numbers, and malformed options raise errors
naming the option."""

import numpy as np
import pytest

import jaxpc
from jaxpc import distributions, edit
from jaxpc.nodes import topological_order


def _root():
    """Block-sparse sums with parameters on every vector (prune and blockify have something to choose)."""
    rng = np.random.default_rng(0)
    cat = distributions.Categorical(3)
    a = jaxpc.inputs(0, 4, 2, cat, params=rng.random((8, 3)) + 0.1)
    b = jaxpc.inputs(1, 4, 2, cat, params=rng.random((8, 3)) + 0.1)
    m = jaxpc.multiply(a, b)
    s = jaxpc.summate(m, num_node_blocks=2, block_size=2, edge_ids=[[0, 0, 0, 1, 1], [0, 1, 2, 2, 3]])
    s.set_params(rng.random((5, 2, 2)) + 0.05)
    root = jaxpc.summate(s, num_nodes=1)
    root.set_params(rng.random((1, 4)) + 0.05)
    return a, root


def _blocks(root):
    """Every vector's shape, edges and parameters, in topological order."""
    out = []
    for ns in topological_order(root):
        p = ns.source.own_params
        if isinstance(p, dict):
            p = sorted((k, v.tolist()) for k, v in p.items())
        elif p is not None:
            p = p.tolist()
        out.append((ns.kind, ns.num_node_blocks, ns.block_size, None if ns.is_input() else ns.edge_ids.tolist(), p))
    return out


@pytest.mark.parametrize("wrap", [np.float32, np.float64, np.asarray])
def test_numpy_scalar_options_act_as_python_numbers(wrap):
    a, root = _root()
    c = jaxpc.compile(root)
    s = root.children[0]
    sc = {s: np.array([0.5, 2.0, 1.0, 3.0, 0.25])}
    assert _blocks(edit.prune(root, c, scores=sc, keep_frac=wrap(0.5))) == \
        _blocks(edit.prune(root, c, scores=sc, keep_frac=0.5))
    assert _blocks(edit.prune(root, c, scores=sc, threshold=np.int64(1))) == \
        _blocks(edit.prune(root, c, scores=sc, threshold=1.0))
    assert _blocks(edit.prune(root, c, scores=sc, threshold=1.0)) != _blocks(root)
    assert _blocks(edit.blockify(root, wrap(0.25), np.int64(4))) == _blocks(edit.blockify(root, 0.25, 4))
    assert _blocks(edit.grow(root, np.int64(1), wrap(0.25), seed=np.int64(3))) == \
        _blocks(edit.grow(root, 1, 0.25, seed=3))
    z = np.random.default_rng(2).integers(0, 8, (5, 1))
    assert _blocks(edit.lvd_init(root, [a], z, pseudocount=wrap(0.5))) == \
        _blocks(edit.lvd_init(root, [a], z, pseudocount=0.5))


def test_malformed_options_name_the_option():
    a, root = _root()
    c = jaxpc.compile(root)
    for bad in (True, "0.5", np.zeros(2), np.float32(np.nan)):
        with pytest.raises(ValueError, match="prune: keep_frac must be a float in"):
            edit.prune(root, c, flows={}, keep_frac=bad)
        with pytest.raises(ValueError, match="grow: noise must be a finite float"):
            edit.grow(root, 1, bad)
    with pytest.raises(TypeError, match=r"prune: scores must be a dict \{sum vector: \[num_edge_blocks\] scores\}, got "
                                        r"list"):
        edit.prune(root, c, keep_frac=0.5, scores=[np.ones(5)])
    for seed in ("a", -1, 1.5, None):
        with pytest.raises(ValueError, match=f"grow: seed must be a non-negative int, got {seed!r}"):
            edit.grow(root, 1, 0.1, seed=seed)


def test_lvd_names_a_non_finite_value_of_x():
    """A NaN or inf value not marked missing is named (it would otherwise surface as a Gaussian with a NaN mean,
    naming neither lvd_init nor x); marked missing, it is skipped."""
    g0 = jaxpc.inputs(0, 1, 2, distributions.Gaussian(), params={"mu": np.zeros(2), "sigma": np.ones(2)})
    g1 = jaxpc.inputs(1, 1, 2, distributions.Gaussian(), params={"mu": np.zeros(2), "sigma": np.ones(2)})
    m = jaxpc.multiply(g0, g1)
    root = jaxpc.summate(m, num_nodes=1, params=np.ones((1, 2)))
    z = np.array([[0], [1], [1]])
    x = np.array([[0.0, 1.0], [2.0, np.nan], [4.0, 3.0]])
    for bad in (np.nan, np.inf):
        with pytest.raises(ValueError, match=rf"lvd_init: x\[1, 1\] = {bad} is not finite; mark unknown values with "
                                             r"missing="):
            edit.lvd_init(root, [m], z, np.where(np.isnan(x), bad, x), pseudocount=0.0)
    new = edit.lvd_init(root, [m], z, x, np.isnan(x), pseudocount=0.0)
    n1 = next(ns for ns in topological_order(new) if ns.is_input() and ns.var == 1)
    np.testing.assert_allclose(n1.own_params["mu"], [1.0, 3.0])  # node 1 saw x[2, 1] only


def test_prune_refuses_negative_flows():
    """Negated flows (``Options(negate_flows=True)``) or log flows below 0 would keep the lowest counts; prune names
    them instead of pruning by them."""
    _, root = _root()
    c = jaxpc.compile(root)
    counts = {"sum": {k: np.ones(v.shape, np.float32) for k, v in c.params["sum"].items()}}
    edit.prune(root, c, flows=counts, keep_frac=0.5)
    for sign in (-1.0, -np.inf):
        flows = {"sum": {k: sign * v for k, v in counts["sum"].items()}}
        with pytest.raises(ValueError, match=r"prune: the flows of .* are negative at edge block\(s\) \[0, 1, 2"):
            edit.prune(root, c, flows=flows, keep_frac=0.5)


def test_short_var_mapping_is_named_once():
    """A ``var_mapping`` array too short for the circuit's variables names it, without a second prefix around it."""
    _, root = _root()
    with pytest.raises(ValueError, match=r"^deepcopy: var_mapping has 1 entries but the circuit uses variable 1$"):
        edit.deepcopy(root, var_mapping=[1])


def test_lvd_names_a_bool_column_and_non_integer_values():
    """``regions={True: vector}`` is no column id (numpy would read ``latents[:, True]`` as a mask and fail with an
    IndexError), and a categorical value that is no integer is named as such."""
    a, root = _root()
    z = np.zeros((4, 2), np.int64)
    for col in (True, np.bool_(False)):
        with pytest.raises(ValueError, match=rf"lvd_init: regions names column {col!r}, but latents has 2 columns"):
            edit.lvd_init(root, {col: a}, z)
    x = np.zeros((4, 2))
    x[1, 0] = 0.5
    with pytest.raises(ValueError, match=r"lvd_init: x holds \[0.5\] for .*Categorical\(num_cats=3\)\), which takes "
                                         r"the integers 0..2"):
        edit.lvd_init(root, [a], z[:, :1], x)
