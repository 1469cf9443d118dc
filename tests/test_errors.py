"""Bad input gets a clear error naming what is wrong: host data before anything runs, device arrays by the
rule of jaxpc.runtime (tests/test_checks.py)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc import distributions


@pytest.fixture(scope="module")
def cat_circuit():
    a = jaxpc.inputs(0, num_node_blocks=2, block_size=2, dist=distributions.Categorical(num_cats=5))
    b = jaxpc.inputs(1, num_node_blocks=2, block_size=2, dist=distributions.Categorical(num_cats=3))
    root = jaxpc.summate(jaxpc.multiply(a, b), num_nodes=1)
    return jaxpc.compile(root)


@pytest.fixture(scope="module")
def mixed_circuit():
    a = jaxpc.inputs(0, num_node_blocks=2, dist=distributions.Categorical(num_cats=4))
    b = jaxpc.inputs(1, num_node_blocks=2, dist=distributions.Gaussian())
    return jaxpc.compile(jaxpc.summate(jaxpc.multiply(a, b), num_nodes=1))


# ---- x ------------------------------------------------------------------------------------------

def test_wrong_rank(cat_circuit):
    with pytest.raises(ValueError, match=r"shape \[batch, num_vars\].*got shape \(2,\).*x\[None\]"):
        cat_circuit.log_prob(cat_circuit.params, np.array([1, 2]))
    with pytest.raises(ValueError, match=r"got shape \(1, 2, 1\)"):
        cat_circuit.log_prob(cat_circuit.params, np.zeros((1, 2, 1), np.int32))


def test_wrong_num_vars(cat_circuit):
    with pytest.raises(ValueError, match=r"has 3 variables.*circuit has 2"):
        cat_circuit.log_prob(cat_circuit.params, np.zeros((4, 3), np.int32))


def test_empty_batch(cat_circuit):
    with pytest.raises(ValueError, match="empty batch"):
        cat_circuit.log_prob(cat_circuit.params, np.zeros((0, 2), np.int32))


def test_float_x_for_discrete_circuit(cat_circuit):
    with pytest.raises(TypeError, match=r"dtype float32.*discrete.*integer category ids"):
        cat_circuit.log_prob(cat_circuit.params, np.zeros((2, 2), np.float32))


def test_non_numeric_x(cat_circuit):
    with pytest.raises(TypeError, match="dtype"):
        cat_circuit.log_prob(cat_circuit.params, np.array([["a", "b"]]))


@pytest.mark.parametrize("bad, where, var", [(5, (1, 0), 0), (-1, (0, 1), 1), (3, (2, 1), 1)])
def test_out_of_range_category(cat_circuit, bad, where, var):
    x = np.zeros((3, 2), np.int64)
    x[where] = bad
    msg = rf"x\[{where[0]}, {where[1]}\] = {bad} is out of range: variable {var} \(Categorical"
    with pytest.raises(ValueError, match=msg):
        cat_circuit.log_prob(cat_circuit.params, x)
    # the same check guards device arrays (validate="sync": at once), flows and EM
    with pytest.raises(ValueError, match=msg):
        cat_circuit.flows(cat_circuit.params, jnp.asarray(x), validate="sync")
    with pytest.raises(ValueError, match=msg):
        cat_circuit.em_step(cat_circuit.params, x)


def test_out_of_range_under_missing_is_fine(cat_circuit):
    x = np.array([[7, 1]])
    ll = cat_circuit.log_prob(cat_circuit.params, x, missing=np.array([True, False]))
    assert np.isfinite(np.asarray(ll)).all()


def test_unvalidated_out_of_range_is_nan_not_clamped(cat_circuit):
    ll = cat_circuit.log_prob(cat_circuit.params, jnp.array([[9, 1]]), validate=False)
    assert np.isnan(np.asarray(ll)).all()


def test_nan_in_continuous_variable(mixed_circuit):
    x = np.array([[1.0, np.nan], [2.0, 0.5]])
    with pytest.raises(ValueError, match=r"x\[0, 1\] = nan.*variable 1 \(Gaussian.*missing="):
        mixed_circuit.log_prob(mixed_circuit.params, x)
    ll = mixed_circuit.log_prob(mixed_circuit.params, x, missing=np.isnan(x))
    assert np.isfinite(np.asarray(ll)).all()


def test_nan_or_fraction_in_discrete_variable(mixed_circuit):
    with pytest.raises(ValueError, match=r"x\[1, 0\] = nan.*variable 0 \(Categorical.*missing= instead of NaN$"):
        mixed_circuit.log_prob(mixed_circuit.params, np.array([[1.0, 0.0], [np.nan, 0.5]]))
    with pytest.raises(ValueError, match=r"x\[1, 1\] = -inf.*missing= instead of -inf$"):  # (its own word for inf)
        mixed_circuit.log_prob(mixed_circuit.params, np.array([[1.0, 0.0], [1.0, -np.inf]]))
    with pytest.raises(ValueError, match=r"x\[0, 0\] = 1.5 is out of range"):
        mixed_circuit.log_prob(mixed_circuit.params, np.array([[1.5, 0.0]]))


def test_device_array_values_checked(mixed_circuit):
    with pytest.raises(ValueError, match=r"x\[0, 1\] = inf"):
        mixed_circuit.log_prob(mixed_circuit.params, jnp.array([[1.0, jnp.inf]]), validate="sync")


# ---- missing ------------------------------------------------------------------------------------

def test_missing_wrong_dtype(cat_circuit):
    with pytest.raises(TypeError, match="missing must be a boolean mask"):
        cat_circuit.log_prob(cat_circuit.params, np.zeros((2, 2), np.int32), missing=np.zeros((2, 2), np.int32))


def test_missing_wrong_shape(cat_circuit):
    with pytest.raises(ValueError, match=r"missing must have shape \[2\] or \[2, 2\].*got \(3,\)"):
        cat_circuit.log_prob(cat_circuit.params, np.zeros((2, 2), np.int32), missing=np.zeros(3, bool))


# ---- options and EM arguments ---------------------------------------------------------------------

def test_unknown_propagation(cat_circuit):
    with pytest.raises(ValueError, match=r"propagation must be one of \('LL', 'MPE', 'GeneralLL'\), got 'Max'"):
        cat_circuit.log_prob(cat_circuit.params, np.zeros((1, 2), np.int32), propagation="Max")


def test_unknown_param_flow_pass():
    msg = r"param_flow_pass must be one of \('auto', 'inline', 'batched'\), got 'later'"
    with pytest.raises(ValueError, match=msg):
        jaxpc.Options(param_flow_pass="later")


def test_general_ll_needs_positive_alpha(cat_circuit):
    x = np.zeros((1, 2), np.int32)
    with pytest.raises(ValueError, match="needs alpha"):
        cat_circuit.log_prob(cat_circuit.params, x, propagation="GeneralLL")
    with pytest.raises(ValueError, match="alpha must be a positive finite float, got -1"):
        cat_circuit.log_prob(cat_circuit.params, x, propagation="GeneralLL", alpha=-1.0)
    with pytest.raises(ValueError, match="alpha is only used with propagation='GeneralLL'"):
        cat_circuit.log_prob(cat_circuit.params, x, alpha=2.0)


@pytest.mark.parametrize("kw, msg", [({"leaf_batch": -1}, "Tuning.leaf_batch must be a non-negative int"),
                                     ({"fanin_prefetch": 1}, "Tuning.fanin_prefetch must be a bool"),
                                     ({"fanin_forward_span": 3}, "Tuning.fanin_forward_span must be a power of two"),
                                     ({"fanin_forward_wide_tile": 48}, "fanin_forward_wide_tile must be 0 or a power"),
                                     ({"fanin_backward_stages": 0}, "fanin_backward_stages must be at least 1"),
                                     ({"tree_forward_tile": 32.0}, "tree_forward_tile must be None, 32 or 64")])
def test_bad_tuning_values(kw, msg):
    with pytest.raises((TypeError, ValueError), match=msg):
        jaxpc.Tuning(**kw)


def test_numpy_numbers_in_options_key_as_python_numbers():
    """Options and Tuning take NumPy numbers (read from arrays or configs) as the Python numbers they equal, and key
    executables alike."""
    t = jaxpc.Tuning(leaf_batch=np.int64(64), tree_forward_tile=np.int32(32))
    assert t == jaxpc.Tuning(leaf_batch=64, tree_forward_tile=32) and type(t.leaf_batch) is int
    o = jaxpc.Options(pflow_temperature=np.float32(0.5), gather_chunk=np.int64(1 << 20), tuning=t)
    assert o == jaxpc.Options(pflow_temperature=0.5, gather_chunk=1 << 20, tuning=jaxpc.Tuning(leaf_batch=64,
                                                                                                tree_forward_tile=32))
    assert jaxpc.Options(propagation="GeneralLL", alpha=np.float64(2.0)).alpha == 2.0


def test_unknown_option_name():
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['precison'\]; valid options"):
        jaxpc.Options.make(precison="fp32")


@pytest.mark.parametrize("kw, msg", [({"step_size": 0.0}, "step_size must be in"),
                                     ({"step_size": 1.5}, "step_size must be in"),
                                     ({"pseudocount": -1.0}, "pseudocount must be >= 0"),
                                     ({"pseudocount": float("nan")}, "pseudocount must be finite"),
                                     ({"step_size": "big"}, "step_size must be a float")])
def test_bad_em_arguments(cat_circuit, kw, msg):
    with pytest.raises((ValueError, TypeError), match=msg):
        cat_circuit.em_step(cat_circuit.params, np.zeros((2, 2), np.int32), **kw)


def test_bad_ll_weights(cat_circuit):
    x = np.zeros((2, 2), np.int32)
    with pytest.raises(ValueError, match=r"ll_weights must have shape \[2\]"):
        cat_circuit.flows(cat_circuit.params, x, ll_weights=np.ones(3))
    half = np.asarray([1.0, 2.0], jnp.bfloat16)  # a NumPy array of JAX's bfloat16 (dtype kind "V"): numbers too
    np.testing.assert_array_equal(np.asarray(cat_circuit.log_prob(cat_circuit.params, x)),
                                  np.asarray(cat_circuit.flows(cat_circuit.params, x, ll_weights=half,
                                                               return_ll=True)[1]))
    with pytest.raises(ValueError, match=r"ll_weights\[1\] is nan"):
        cat_circuit.flows(cat_circuit.params, x, ll_weights=np.asarray([1.0, np.nan], jnp.bfloat16))


@pytest.mark.slow  # the checking executables of flows, em_step and parallel.em_step
def test_device_ll_weights_are_checked_as_device_data_is():
    """Device ``ll_weights`` with a NaN (or, in an EM step, a negative weight): ``"sync"`` raises at the call, the
    default at the circuit's next call, ``False`` never; good device weights give the host weights' result."""
    from jaxpc import parallel
    c = jaxpc.compile(jaxpc.summate(jaxpc.multiply(jaxpc.inputs(0, 2, dist=distributions.Categorical(3)),
                                                   jaxpc.inputs(1, 2, dist=distributions.Categorical(3))),
                                    num_nodes=1))
    x = np.array([[0, 1], [2, 2], [1, 0]], np.int32)
    p = c.params
    nan = jnp.asarray([1.0, np.nan, 1.0])
    neg = jnp.asarray([1.0, 1.0, -2.0])
    calls = [(lambda w, v: c.flows(p, x, ll_weights=w, validate=v), nan, r"ll_weights\[1\] is nan .in circuit.flows"),
             (lambda w, v: c.em_step(p, x, ll_weights=w, validate=v), neg,
              r"must be >= 0 .*ll_weights\[2\] is -2.0 .in circuit.em_step"),
             (lambda w, v: parallel.em_step(c, p, x, ll_weights=w, validate=v), neg, r"ll_weights\[2\] is -2.0")]
    for call, bad, msg in calls:
        with pytest.raises(ValueError, match=msg):
            call(bad, "sync")
        call(bad, True)
        with pytest.raises(ValueError, match=msg):
            c.log_prob(p, x)  # the next call
        call(bad, False)
        c.raise_pending()
        good = np.array([0.5, 2.0, 1.0], np.float32)
        for u, v in zip(jax.tree_util.tree_leaves(call(jnp.asarray(good), True)),
                        jax.tree_util.tree_leaves(call(good, True))):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    c.flows(p, x, ll_weights=neg)  # flows take negative weights (a weighted gradient); EM does not
    c.raise_pending()
    xd = jnp.asarray(x)
    c.flows(p, xd, ll_weights=nan)
    with jax.transfer_guard("disallow"), pytest.raises(ValueError, match=r"ll_weights\[1\] is nan"):
        c.log_prob(p, xd)  # the flag and the error's message read without a transfer the guard refuses


# ---- construction ---------------------------------------------------------------------------------

def test_decomposability_error_names_nodes():
    a = jaxpc.inputs(0, 1, dist=distributions.Categorical(2), name="leaf_a")
    b = jaxpc.inputs(0, 1, dist=distributions.Categorical(2), name="leaf_b")
    with pytest.raises(ValueError, match=r"decomposability.*leaf_b shares variables \[0\] with leaf_a"):
        jaxpc.multiply(a, b)


def test_smoothness_error_names_nodes():
    a = jaxpc.inputs(0, 1, dist=distributions.Categorical(2), name="on_x0")
    b = jaxpc.inputs(1, 1, dist=distributions.Categorical(2), name="on_x1")
    with pytest.raises(ValueError, match=r"smoothness.*on_x0 has scope \{0\} and on_x1 has scope \{1\}"):
        jaxpc.summate(a, b, num_nodes=1)


def test_block_size_mismatch():
    a = jaxpc.inputs(0, 1, 2, dist=distributions.Categorical(2), name="k2")
    b = jaxpc.inputs(1, 1, 4, dist=distributions.Categorical(2), name="k4")
    with pytest.raises(ValueError, match="share a block size.*k2 has block_size=2 and k4 has block_size=4"):
        jaxpc.multiply(a, b)


def test_edge_ids_errors():
    a = jaxpc.inputs(0, 2, dist=distributions.Categorical(2))
    b = jaxpc.inputs(1, 2, dist=distributions.Categorical(2))
    with pytest.raises(ValueError, match=r"edge_ids\[:, 1\] holds block 5"):
        jaxpc.multiply(a, b, edge_ids=np.array([[0, 5]]))
    m = jaxpc.multiply(a, b)
    with pytest.raises(ValueError, match=r"parent blocks \[1\] have no edges"):
        jaxpc.summate(m, num_node_blocks=2, edge_ids=np.array([[0, 0], [0, 1]]))
    with pytest.raises(ValueError, match="same .parent block, child block. pair twice"):
        jaxpc.summate(m, edge_ids=np.array([[0, 0], [1, 1]]))
    with pytest.raises(ValueError, match=r"edge_ids must have shape \[2, num_edges\]"):
        jaxpc.summate(m, edge_ids=np.array([0, 1]))


def test_sum_params_errors():
    a = jaxpc.inputs(0, 2, dist=distributions.Categorical(2))
    with pytest.raises(ValueError, match=r"params must be dense \[num_nodes, num_ch_nodes\] = \[1, 2\]"):
        jaxpc.summate(a, num_nodes=1, params=np.ones((2, 2)))
    with pytest.raises(ValueError, match="finite and non-negative"):
        jaxpc.summate(a, num_nodes=1, params=np.array([[1.0, -1.0]]))
    with pytest.raises(ValueError, match="nonzero weights between blocks that edge_ids does not connect"):
        jaxpc.summate(a, num_nodes=1, edge_ids=np.array([[0], [0]]), params=np.array([[0.5, 0.5]]))


def test_input_params_errors():
    with pytest.raises(ValueError, match=r"shape \[num_nodes, num_cats\] = \[2, 3\], got \(2, 2\)"):
        jaxpc.inputs(0, 2, dist=distributions.Categorical(3), params=np.ones((2, 2)))
    with pytest.raises(ValueError, match="Gaussian sigma must be positive"):
        jaxpc.inputs(0, 1, dist=distributions.Gaussian(), params={"mu": [0.0], "sigma": [0.0]})
    with pytest.raises(ValueError, match="MaskedCategorical needs params"):
        jaxpc.compile(jaxpc.summate(jaxpc.inputs(0, 2, dist=distributions.MaskedCategorical(3)), num_nodes=1))
    with pytest.raises(ValueError, match="has no parameters"):
        jaxpc.inputs(0, 1, dist=distributions.Literal(1), params=[1.0])


def test_bad_sizes_and_dists():
    with pytest.raises(ValueError, match="num_node_blocks .or num_nodes. must be positive"):
        jaxpc.inputs(0, dist=distributions.Categorical(2))
    with pytest.raises(ValueError, match="num_nodes=6 is not a multiple of block_size=4"):
        jaxpc.inputs(0, num_nodes=6, block_size=4, dist=distributions.Categorical(2))
    with pytest.raises(TypeError, match="dist must be a jaxpc.distributions.Distribution"):
        jaxpc.inputs(0, 1, dist="categorical")
    with pytest.raises(ValueError, match="var must be a non-negative int"):
        jaxpc.inputs(-1, 1, dist=distributions.Categorical(2))
    with pytest.raises(ValueError, match="num_cats must be a positive int"):
        distributions.Categorical(0)


def test_root_must_be_single_node():
    a = jaxpc.inputs(0, 2, dist=distributions.Categorical(2))
    with pytest.raises(ValueError, match="root must be a single node.*has 2 nodes"):
        jaxpc.compile(jaxpc.summate(a, num_nodes=2))


def test_duplicate_shape_mismatch():
    a = jaxpc.inputs(0, 2, dist=distributions.Categorical(2))
    s = jaxpc.summate(a, num_nodes=1)
    b = jaxpc.inputs(1, 3, dist=distributions.Categorical(2), name="wrong")
    with pytest.raises(ValueError, match="child 0 .wrong. has num_node_blocks=3"):
        s.duplicate(b, tie_params=True)


def test_a_tied_vector_must_match_its_source():
    """A tied input reads its source's parameter rows: another distribution, size or kind is named at compile time
    (rows past the source's were read before)."""
    from jaxpc.nodes import InputNodes
    cat = distributions.Categorical(3)
    src = jaxpc.inputs(0, num_node_blocks=1, block_size=2, dist=cat, name="src")
    wide = jaxpc.inputs(0, num_node_blocks=2, block_size=2, dist=cat)
    cases = [(InputNodes(1, 1, 2, distributions.Categorical(4), source=src, name="other_dist"), src,
              "other_dist .* is tied to src .*distribution and shape"),
             (InputNodes(1, 2, 2, cat, source=src, name="bigger"), wide, "bigger .* is tied to src .*distribution")]
    for tied, partner, msg in cases:
        with pytest.raises(ValueError, match=msg):
            jaxpc.compile(jaxpc.summate(jaxpc.multiply(partner, tied), num_node_blocks=1, block_size=1))
    a = jaxpc.inputs(1, num_node_blocks=1, block_size=2, dist=cat)
    s = jaxpc.summate(a, num_node_blocks=1, block_size=2)
    fake = InputNodes(2, 1, 2, cat, name="fake")
    fake.tied_to = s
    with pytest.raises(ValueError, match="fake .input vector. is tied to .*a sum vector"):
        jaxpc.compile(jaxpc.summate(jaxpc.multiply(src, fake), num_node_blocks=1, block_size=1))


def test_get_node_params_of_foreign_node(cat_circuit):
    other = jaxpc.inputs(0, 1, dist=distributions.Categorical(5), name="stranger")
    with pytest.raises(ValueError, match="stranger is not part of this circuit"):
        cat_circuit.get_node_params(cat_circuit.params, other)


# ---- params --------------------------------------------------------------------------------------

def test_params_of_another_shape_or_dtype_are_named(cat_circuit, mixed_circuit):
    """Params that do not fit the circuit raise before anything is compiled or traced, naming the leaf; the
    circuit's own params then still run (no executable was left behind for the bad ones)."""
    import jax

    x = np.zeros((2, 2), np.int32)
    with pytest.raises(ValueError, match=r"structure of this circuit's params \(missing params\['input'\]"):
        cat_circuit.log_prob({"sum": cat_circuit.params["sum"]}, x)
    with pytest.raises(ValueError, match=r"circuit's params.*unexpected params\['input'\]\['gaussian"):
        cat_circuit.flows(mixed_circuit.params, x)
    (g, w), = cat_circuit.params["sum"].items()
    wrong = {"sum": {g: jnp.concatenate([w, w])}, "input": cat_circuit.params["input"]}
    with pytest.raises(ValueError, match=rf"params\['sum'\]\['{g}'\] has shape \({2 * w.shape[0]}, "):
        cat_circuit.em_step(wrong, x)
    ints = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, jnp.int32), cat_circuit.params)
    with pytest.raises(TypeError, match=r"params\['input'\].* has dtype int32; parameters are floating point"):
        cat_circuit.log_prob(ints, x)
    with pytest.raises(TypeError, match="has dtype int32"):  # inside the user's jit too
        jax.jit(lambda p: cat_circuit.log_prob(p, x))(ints)
    misses = cat_circuit.cache_info().misses
    ll = cat_circuit.log_prob(cat_circuit.params, x)
    assert np.all(np.isfinite(np.asarray(ll)))
    assert cat_circuit.cache_info().misses <= misses + 1


def test_query_and_weight_arguments_are_checked(cat_circuit):
    x = np.zeros((3, 2), np.int32)
    with pytest.raises(ValueError, match="num_samples must be a positive int, got 0"):
        cat_circuit.mpe(cat_circuit.params, num_samples=0)
    with pytest.raises(ValueError, match="num_samples=5 but the evidence has 3 rows"):
        cat_circuit.mpe(cat_circuit.params, x, num_samples=5)
    assert cat_circuit.mpe(cat_circuit.params, num_samples=2)[0].shape == (2, 2)
    with pytest.raises(TypeError, match=r"key must be a PRNG key such as jax.random.key\(0\), got int"):
        cat_circuit.sample(cat_circuit.params, 0, 3)
    with pytest.raises(TypeError, match=r"init_params: key must be a PRNG key such as jax.random.key\(0\), got int"):
        cat_circuit.init_params(3)
    with pytest.raises(TypeError, match=r"got an array of keys of shape \(2,\) \(jax.vmap over them"):
        cat_circuit.init_params(jax.random.split(jax.random.key(0)))
    with pytest.raises(TypeError, match=r"got an array of dtype float32 and shape \(2,\)"):
        cat_circuit.sample(cat_circuit.params, np.zeros(2, np.float32), 3)
    assert cat_circuit.sample(cat_circuit.params, jax.random.PRNGKey(0), 3).shape == (3, 2)  # a raw key
    with pytest.raises(TypeError, match="wait_compiled: timeout must be None or seconds >= 0, got 'a'"):
        cat_circuit.wait_compiled("a")
    with pytest.raises(ValueError, match=r"ll_weights must be finite; ll_weights\[1\] is nan"):
        cat_circuit.flows(cat_circuit.params, x, ll_weights=[1.0, float("nan"), 1.0])
    with pytest.raises(TypeError, match="ll_weights must be numbers"):
        cat_circuit.em_step(cat_circuit.params, x, ll_weights=np.array(["a", "b", "c"]))
    with pytest.raises(ValueError, match=r"ll_weights of an EM step must be >= 0 .*ll_weights\[1\] is -5"):
        cat_circuit.em_step(cat_circuit.params, x, ll_weights=[1.0, -5.0, 1.0])
    cat_circuit.flows(cat_circuit.params, x, ll_weights=[1.0, -5.0, 1.0])  # flows may weigh a sample negatively


def test_flows_meshes_and_checkpoints_are_checked(cat_circuit, mixed_circuit, tmp_path):
    import jax

    from jaxpc import io, parallel

    x = np.zeros((3, 2), np.int32)
    with pytest.raises(ValueError, match=r"flows must be what circuit.flows returns .* got keys \['sum'\]"):
        cat_circuit.em_update(cat_circuit.params, {"sum": cat_circuit.params["sum"]})
    other = mixed_circuit.flows(mixed_circuit.params, np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match=r"flows\['sum'\] does not have the structure of this circuit's params"):
        cat_circuit.em_update(cat_circuit.params, other)
    with pytest.raises(ValueError, match=r"flows\['sum'\] does not have the structure of this circuit's params"):
        cat_circuit.get_node_flows(other, cat_circuit.root)
    own = cat_circuit.flows(cat_circuit.params, x)
    with pytest.raises(ValueError, match=r"flows\['input'\] must have one entry per input layer"):
        cat_circuit.em_update(cat_circuit.params, {"sum": own["sum"], "input": {}})
    with pytest.raises(ValueError, match=r"flows\['input'\]\['categorical.*'\] holds the layer's parameters "
                                         r"\['log_probs'\], not its statistics \['counts'\]"):
        cat_circuit.em_update(cat_circuit.params, cat_circuit.params)
    with pytest.raises(ValueError, match=r"flows\['input'\]\['categorical.*'\] must hold the layer's statistics "
                                         r"\['counts'\] \(what circuit.flows returns\), got \['n'\]"):
        cat_circuit.em_update(cat_circuit.params, {"sum": own["sum"], "input": {
            k: {"n": v["counts"]} for k, v in own["input"].items()}})
    for bad in (0, -1, None, 2.5):
        with pytest.raises(ValueError, match="full_batch_em: batch_size must be a positive int"):
            cat_circuit.full_batch_em(cat_circuit.params, x, batch_size=bad)
    with pytest.raises(ValueError, match="structure of this circuit's params"):
        cat_circuit.get_node_params({"sum": cat_circuit.params["sum"]}, cat_circuit.root)
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        parallel.flows(cat_circuit, cat_circuit.params, x, mesh="data")
    with pytest.raises(ValueError, match="ll_weights of an EM step must be >= 0"):
        parallel.em_step(cat_circuit, cat_circuit.params, x, mesh=parallel.data_mesh(1), ll_weights=[1.0, -1.0, 1.0])
    with pytest.raises(ValueError, match=r"mesh must have a 'data' axis .* got axes \('batch',\)"):
        jaxpc.optim.fit(cat_circuit, cat_circuit.params, x, 1, 2, mesh=jax.make_mesh((1,), ("batch",)),
                        progress=False)
    with pytest.raises(FileNotFoundError, match="no checkpoint directory at"):
        io.load_params(tmp_path / "nothing")


def test_structure_builders_name_bad_arguments():
    from jaxpc.structures import HCLT, PD

    x = np.tile(np.arange(4, dtype=np.float32), (8, 1))
    with pytest.raises(ValueError, match="num_bins must be an int >= 2, got 0"):
        HCLT(x, 4, num_bins=0)
    with pytest.raises(ValueError, match="sigma must be a positive float, got 0"):
        HCLT(x, 4, sigma=0)
    x[3, 2] = np.nan
    with pytest.raises(ValueError, match=r"x must be finite; x\[3, 2\] is nan"):
        HCLT(x, 4)
    with pytest.raises(ValueError, match="PD: num_latents must be a positive int, got '4'"):
        PD((4, 4), "4")


@pytest.mark.slow  # every entry point's checking executable, and optim.fit
def test_nan_or_infinite_params_are_named_by_check_params_and_sync_calls(cat_circuit):
    """``circuit.check_params`` and calls with ``validate="sync"`` name a NaN or +inf parameter (leaf and index),
    first calls and replayed ones alike; -inf (a zero weight) passes, and the circuit's own params pass."""
    import warnings

    from jaxpc import optim

    c, x = cat_circuit, np.array([[0, 1], [4, 2]], np.int32)
    c.check_params(c.params)
    (g, w), = c.params["sum"].items()
    zero = {**c.params, "sum": {g: w.at[0, 0, 0].set(-jnp.inf)}}
    c.check_params(zero)
    nan = {**c.params, "sum": {g: w.at[0, 0, 1].set(jnp.nan)}}
    with pytest.raises(ValueError, match=rf"params\['sum'\]\['{g}'\]\[0, 0, 1\] is nan: parameters must be finite"):
        c.check_params(nan)
    layer, field = "categorical_1", "log_probs"
    v = c.params["input"][layer][field]
    inf = {**c.params, "input": {**c.params["input"], layer: {field: v.at[1, 0].set(jnp.inf).at[2, 1].set(jnp.inf)}}}
    with pytest.raises(ValueError, match=rf"params\['input'\]\['{layer}'\]\['{field}'\]\[1, 0\] is inf and 1 more "
                                         r"entry of that leaf \(checked with validate='sync'\)"):
        c.flows(inf, jnp.asarray(x), validate="sync")
    for _ in range(2):  # the second call replays the first one's executable
        with pytest.raises(ValueError, match=r"\[0, 0, 1\] is nan \(checked with validate='sync'\)"):
            c.log_prob(nan, jnp.asarray(x), validate="sync")
    with pytest.raises(ValueError, match=r"\[0, 0, 1\] is nan \(checked with validate='sync'\)"):
        c.em_step(nan, x, step_size=0.1, pseudocount=0.1, validate="sync")
    for _ in range(2):  # queries without evidence check the parameters too, replayed or not
        with pytest.raises(ValueError, match=r"\[0, 0, 1\] is nan \(checked with validate='sync'\)"):
            c.sample(nan, jax.random.key(0), 3, validate="sync")
        with pytest.raises(ValueError, match=r"\[0, 0, 1\] is nan \(checked with validate='sync'\)"):
            c.mpe(nan, num_samples=2, validate="sync")
    with pytest.raises(ValueError, match="validate must be True, False or 'sync', got 'yes'"):
        c.sample(c.params, jax.random.key(0), 3, validate="yes")
    assert np.isnan(np.asarray(c.log_prob(nan, x))).all()  # the default call does not read the parameters' values
    np.testing.assert_array_equal(np.asarray(c.log_prob(zero, x, validate="sync")), np.asarray(c.log_prob(zero, x)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = optim.fit(c, nan, np.tile(x, (8, 1)), epochs=2, batch_size=8, progress=False)
    assert np.isnan(res.epoch_ll).all()
    (warning,) = [m for m in caught if issubclass(m.category, RuntimeWarning) and "optim.fit" in str(m.message)]
    # (EM spreads a NaN weight over its node and the nodes it feeds: the warning names one NaN entry of the result)
    assert re.search(r"epoch 0's mean log-likelihood is NaN \(params\['(sum|input)'\]\['\w+'\](\['\w+'\])?\[[\d, ]+\] "
                     r"is nan", str(warning.message))


def test_a_variable_takes_one_range_of_values():
    """Leaves of one variable that take different values are refused at compile time (sampling, decoding and the
    value checks would see only the values they share); a leaf that reads no value (External) goes with any."""
    from jaxpc.distributions import Categorical, External, Gaussian

    def over_var0(*dists):
        leaves = [jaxpc.inputs(0, num_nodes=1, dist=d) for d in dists]
        return jaxpc.summate(*leaves, num_nodes=1)

    with pytest.raises(ValueError, match=r"variable 0 is read by leaves that take different values: "
                                         r"Categorical\(num_cats=3\) takes integers in \[0, 2\]; "
                                         r"Categorical\(num_cats=5\) takes integers in \[0, 4\]; give them one range"):
        jaxpc.compile(over_var0(Categorical(num_cats=3), Categorical(num_cats=5)))
    with pytest.raises(ValueError, match="variable 0 is read by .* a variable is either discrete or real"):
        jaxpc.compile(over_var0(Categorical(num_cats=3), Gaussian()))
    c = jaxpc.compile(over_var0(Categorical(num_cats=3), External(), Categorical(num_cats=3)))
    with pytest.raises(ValueError, match=r"x\[0, 0\] = 3 is out of range"):
        c.log_prob(c.params, np.array([[3]], np.int32), evidence={"external": np.zeros((1, 1, 1), np.float32)})


def test_a_float64_circuit_needs_64_bit_jax():
    root = jaxpc.summate(jaxpc.inputs(0, num_nodes=2, dist=distributions.Categorical(num_cats=3)), num_nodes=1)
    with pytest.raises(ValueError, match=r"dtype=float64 needs 64-bit JAX: jax.config.update\('jax_enable_x64'"):
        jaxpc.compile(root, dtype=jnp.float64)
    with jax.enable_x64(True):
        c = jaxpc.compile(root, dtype=jnp.float64)
        assert c.log_prob(c.params, np.zeros((2, 1), np.int32)).dtype == jnp.float64



# ---- training, checkpoints, structures and edits: arguments named before anything runs ------------

def test_optax_apply_given_flows_names_gradients(cat_circuit):
    """An optax transformation fed flows (not gradients) names flows and the gradients it takes, not a pytree
    mismatch; gradients (a pytree of the params' structure) still step."""
    import optax

    from jaxpc import optim

    c, x = cat_circuit, np.zeros((3, 2), np.int32)
    tx = optax.adam(1e-2)
    state = tx.init(c.params)
    with pytest.raises(ValueError, match=r"apply: feed looks like flows .*\['counts'\] where params hold "
                                         r"\['log_probs'\].*optax transformations take gradients .*not flows.*"
                                         r"optim.log_prob.*parallel.loss_and_grad"):
        optim.apply(tx, c.flows(c.params, x), state, c.params)
    with pytest.raises(ValueError, match="apply: feed must be gradients with the pytree structure of params"):
        optim.apply(tx, {"sum": c.params["sum"]}, state, c.params)
    g = jax.jit(jax.grad(lambda p: -optim.log_prob(c, p, x).mean()))(c.params)  # jit: no op-by-op autodiff
    params, _ = optim.apply(tx, g, state, c.params)
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(c.params)


@pytest.mark.parametrize("num_samples, batch_size, msg", [(10, 0, "batch_size must be an int >= 1, got 0"),
                                                          (10, 2.5, "batch_size must be an int >= 1, got 2.5"),
                                                          (-1, 4, "num_samples must be an int >= 0, got -1"),
                                                          (10, True, "batch_size must be an int >= 1, got True")])
def test_epoch_batches_checks_its_sizes(num_samples, batch_size, msg):
    from jaxpc import optim

    with pytest.raises(ValueError, match=f"epoch_batches: {msg}"):
        optim.epoch_batches(jax.random.key(0), 0, num_samples, batch_size)
    idx, w = optim.epoch_batches(jax.random.key(0), 0, np.int64(10), np.int64(4))
    assert idx.shape == (3, 4) and w.shape == (3, 4)


def test_save_params_to_an_existing_path_says_overwrite(cat_circuit, tmp_path):
    """An existing path (a checkpoint or any file) raises naming ``overwrite=True`` and is left as it was;
    ``overwrite=True`` replaces it."""
    from jaxpc import io

    path = tmp_path / "ck"
    io.save_params(path, cat_circuit.params, step=1)
    with pytest.raises(ValueError, match=r"save_params: .*ck already exists; pass overwrite=True"):
        io.save_params(path, cat_circuit.params, step=2)
    assert io.load_params(path).step == 1
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="already exists; pass overwrite=True"):
        io.save_params(tmp_path / "file", cat_circuit.params)
    io.save_params(path, cat_circuit.params, step=3, overwrite=True)
    assert io.load_params(path).step == 3


def test_parallel_train_step_checks_the_optimizer_state(cat_circuit):
    """``parallel.train_step`` checks ``opt_state`` as ``optim.fit`` does: None or another optimizer's state is
    named before anything runs."""
    import optax

    from jaxpc import optim, parallel

    c, x, mesh = cat_circuit, np.zeros((2, 2), np.int32), parallel.data_mesh(1)
    with pytest.raises(ValueError, match=r"parallel.train_step: opt_state is None: pass the optimizer's "
                                         r"init\(params\)"):
        parallel.train_step(c, optax.adam(1e-2), c.params, None, x, mesh=mesh)
    em = optim.em(c, 0.1)
    with pytest.raises(ValueError, match=r"parallel.train_step: opt_state is not a state of this optimizer "
                                         r"\(got EMState, expected tuple\)"):
        parallel.train_step(c, optax.adam(1e-2), c.params, em.init(c.params), x, mesh=mesh)
    with pytest.raises(TypeError, match="optimizer must be a jaxpc.optim EM transformation or an optax"):
        parallel.train_step(c, "adam", c.params, None, x, mesh=mesh)
    p, s, ll = parallel.train_step(c, em, c.params, em.init(c.params), x, mesh=mesh)
    assert ll.shape == (2,)


def test_structure_builders_check_their_data(cat_circuit):
    """HCLT and mutual_information take numbers (a string array is named, not refused by a NumPy ufunc);
    chow_liu_tree takes a square matrix of finite scores."""
    from jaxpc import structures

    x = np.random.default_rng(0).integers(0, 3, (20, 4))
    for make, name in ((lambda a: structures.HCLT(a, 2), "HCLT: x"),
                       (lambda a: structures.mutual_information(a), "mutual_information: x"),
                       (lambda a: structures.PDHCLT(a, (2, 2), 2, split_intervals=1), "PDHCLT: data")):
        with pytest.raises(TypeError, match=rf"{name} must be numbers \(ints or floats\), got dtype <U"):
            make(x.astype(str))
    for bad in (np.ones((3, 4)), np.ones(3), np.ones((0, 0))):
        with pytest.raises(ValueError, match=rf"chow_liu_tree: mi must be a square \[V, V\] matrix .*got shape "
                                             rf"{re.escape(str(bad.shape))}"):
            structures.chow_liu_tree(bad)
    mi = np.eye(3)
    mi[0, 2] = np.nan
    with pytest.raises(ValueError, match=r"chow_liu_tree: mi must be finite; mi\[0, 2\] is nan"):
        structures.chow_liu_tree(mi)
    with pytest.raises(TypeError, match="chow_liu_tree: mi must be numbers"):
        structures.chow_liu_tree(np.array([["a"]]))
    children, root = structures.chow_liu_tree(structures.mutual_information(x, num_bins=4, chunk_size=2))
    assert sum(len(ch) for ch in children) == 3 and 0 <= root < 4
    structures.HCLT(x.astype(bool), 2, num_bins=4, chunk_size=2, input_dist=distributions.Categorical(3))


def test_partial_takes_a_sequence_of_variable_ids(cat_circuit):
    c = cat_circuit
    for bad, what in ((1, "int 1"), (np.int64(1), "int64"), ("01", "str '01'"),
                      (np.array([[0, 1]]), r"an array of dtype int64 and shape \(1, 2\)")):
        with pytest.raises(TypeError, match=rf"variables must be a sequence of variable ids \(ints\), got {what}"):
            c.partial(bad)
    with pytest.raises(TypeError, match=r"variables must be ints, got 0.5 \(float\) among them"):
        c.partial([0, 0.5])
    with pytest.raises(TypeError, match="got a one-shot generator; pass a list"):
        c.partial(v for v in (0, 1))
    with pytest.raises(ValueError, match=r"variable 2 is not in the circuit \(variables 0..1\)"):
        c.partial([0, 2])
    assert c.partial(np.array([1])).variables == (1,)
    assert c.partial(range(2)).variables == (0, 1)


def test_optim_functions_check_the_circuit(cat_circuit):
    """Params (or anything else) in place of the circuit are named by the optim and parallel functions."""
    from jaxpc import optim, parallel

    p, x = cat_circuit.params, np.zeros((2, 2), np.int32)
    calls = [("em", lambda: optim.em(p, 0.1)), ("full_batch_em", lambda: optim.full_batch_em(p, 2)),
             ("anemone", lambda: optim.anemone(p)), ("fit", lambda: optim.fit(p, p, x, 1, 2, progress=False)),
             ("parallel.flows", lambda: parallel.flows(p, p, x)),
             ("parallel.loss_and_grad", lambda: parallel.loss_and_grad(p, p, x)),
             ("parallel.train_step", lambda: parallel.train_step(p, optim.em(cat_circuit), p, None, x)),
             ("parallel.split_batch", lambda: parallel.split_batch(p, x)),
             ("optim.normalize", lambda: optim.normalize(p, p)), ("optim.log_prob", lambda: optim.log_prob(p, p, x))]
    for where, call in calls:
        with pytest.raises(TypeError, match=rf"^{where}: circuit must be a jaxpc.Circuit, got dict; pass the "
                                            r"compiled circuit"):
            call()
    with pytest.raises(TypeError, match=r"^em: circuit must be a jaxpc.Circuit, got str$"):
        optim.em("circuit")


def test_hclt_latent_regions_of_another_structure_raises():
    from jaxpc import edit, structures

    with pytest.raises(ValueError, match="hclt_latent_regions: no HCLT latent products found"):
        edit.hclt_latent_regions(structures.HMM(3, 2, 3))
    x = np.random.default_rng(0).integers(0, 3, (20, 3))
    hclt = structures.HCLT(x, 2, num_bins=4, chunk_size=2, input_dist=distributions.Categorical(3))
    assert edit.hclt_latent_regions(hclt)


def test_pdhclt_errors_name_pdhclt_and_rat_spn_needs_a_split():
    from jaxpc import structures

    x = np.random.default_rng(0).integers(0, 3, (20, 4))
    cat = distributions.Categorical(3)
    for kw, msg in (({"num_latents": 0}, "num_latents must be a positive int, got 0"),
                    ({"structure_type": "x"}, "structure_type must be one of"),
                    ({"split_intervals": 0}, "split_intervals must be a positive int"),
                    ({"max_prod_block_conns": 0}, "max_prod_block_conns must be a positive int"),
                    ({"block_size": 3}, "num_latents=2 must be a multiple of block_size=3")):
        args = {"num_latents": 2, "split_intervals": 1, "input_dist": cat, **kw}
        with pytest.raises(ValueError, match=f"^PDHCLT: {msg}"):
            structures.PDHCLT(x, (2, 2), **args)
    with pytest.raises(ValueError, match="^PD: num_latents must be a positive int, got 0"):
        structures.PD((2, 2), 0, split_intervals=1)
    with pytest.raises(ValueError, match=r"RAT_SPN: depth must be >= 1 \(the levels of splits\), got 0"):
        structures.RAT_SPN(4, 2, 0, 2)
    with pytest.raises(ValueError, match="RAT_SPN: depth must be an int >= 0, got -1"):
        structures.RAT_SPN(4, 2, -1, 2)
    assert jaxpc.compile(structures.RAT_SPN(4, 2, 1, 2, input_dist=cat)).num_vars == 4


def test_hmm_alpha_is_documented_as_built():
    """``HMM``'s docstring: ``alpha[i, j] = P(z_{t+1} = j | z_t = i)``, and unnormalized rows of alpha and beta, and
    gamma, are renormalized. Checked by enumerating every state path of a tiny HMM."""
    import itertools

    from jaxpc import structures

    T, L, V = 3, 2, 3
    alpha, beta, gamma = np.array([[0.9, 0.1], [0.3, 0.7]]), np.array([[0.6, 0.3, 0.1], [0.1, 0.2, 0.7]]), \
        np.array([0.8, 0.2])

    def brute(x):
        tot = 0.0
        for z in itertools.product(range(L), repeat=T):
            p = gamma[z[0]] * np.prod([beta[z[t], x[t]] for t in range(T)])
            tot += p * np.prod([alpha[z[t - 1], z[t]] for t in range(1, T)])
        return tot

    doc = structures.HMM.__doc__
    assert "alpha[i, j] = P(z_{t+1} = j | z_t = i)" in doc and "renormalized" in doc
    xs = np.array(list(itertools.product(range(V), repeat=T)), np.int32)
    rows = np.array([[3.0], [0.5]])
    c = jaxpc.compile(structures.HMM(T, L, V, alpha=alpha * rows, beta=beta * rows[::-1], gamma=gamma * 7))
    np.testing.assert_allclose(np.exp(np.asarray(c.log_prob(c.params, xs))), [brute(x) for x in xs], rtol=1e-5)
    with pytest.raises(ValueError, match="alpha row 0 sums to zero"):
        structures.HMM(T, L, V, alpha=np.array([[0.0, 0.0], [0.5, 0.5]]))


def test_docs_name_what_exists_and_every_argument():
    """docs/design.md cites pallas_sum functions that exist; the docstrings of these public functions document each
    of their arguments (an ``Args`` entry ``name:``, or ``name`` in a list of names ``a, name:``)."""
    import inspect
    import pathlib

    from jaxpc import io, optim, structures
    from jaxpc.ops import pallas_sum

    design = (pathlib.Path(__file__).parent.parent / "docs" / "design.md").read_text()
    for name in re.findall(r"pallas_sum\.(\w+)", design):
        assert hasattr(pallas_sum, name), f"docs/design.md cites pallas_sum.{name}, which does not exist"
    for fn in (optim.fit, optim.em, optim.full_batch_em, optim.anemone, io.save_params, structures.RAT_SPN,
               structures.PD, structures.PDHCLT):
        doc = inspect.getdoc(fn)
        for name in inspect.signature(fn).parameters:
            entry = rf"(^|\n)\s*([a-z_]+, *\n?\s*)*{name}(, *\n?\s*[a-z_]+)*:|; {name}:"
            assert re.search(entry, doc), f"{fn.__qualname__}'s docstring does not document {name}"


def test_node_arguments_params_dtype_and_params_for_flows_are_named(cat_circuit):
    """A circuit (or anything else) where a node vector is expected, params of another float dtype than the
    circuit's (float16 outputs, an EM step returning float32 before), and params passed where flows are expected
    (their sum parts look alike) are each named; float64 numpy params pass where 64-bit JAX is off (JAX stores them
    as float32)."""
    from jaxpc import edit

    c, x = cat_circuit, np.zeros((2, 2), np.int32)
    for where, call in (("get_node_params", lambda: c.get_node_params(c.params, c)),
                        ("get_node_flows", lambda: c.get_node_flows(c.flows(c.params, x), "root")),
                        ("gate_slice", lambda: c.gate_slice(c)), ("param_slice", lambda: c.param_slice(3))):
        with pytest.raises(TypeError, match=rf"^{where}: node must be a node vector \(jaxpc.CircuitNodes\), got "):
            call()
    with pytest.raises(TypeError, match=r"pass one of its nodes, e.g. circuit.root"):
        c.get_node_params(c.params, c)
    for dt in (jnp.float16, jnp.bfloat16):
        low = jax.tree_util.tree_map(lambda a: a.astype(dt), c.params)
        for call in (lambda: c.log_prob(low, x), lambda: c.em_step(low, x), lambda: c.check_params(low)):
            with pytest.raises(TypeError, match=rf"params\[.*\] has dtype {jnp.dtype(dt)}, but this circuit computes "
                                                r"in float32 .*astype\('float32'\)"):
                call()
    wide = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), c.params)
    np.testing.assert_allclose(np.asarray(c.log_prob(wide, x)), np.asarray(c.log_prob(c.params, x)), rtol=1e-6)
    want = r"flows\['input'\]\['categorical'\] holds the layer's parameters \['log_probs'\], not its statistics"
    with pytest.raises(ValueError, match=want):
        c.get_node_flows(c.params, c.root)
    with pytest.raises(ValueError, match=r"prune: " + want):
        edit.prune(c.root, c, c.params, flows=c.params, keep_frac=0.5)
    np.testing.assert_allclose(np.asarray(c.get_node_flows(c.flows(c.params, x), c.root)).sum(), 2.0, rtol=1e-5)
