"""The options and the circuit's surface as a user meets them: bad values named by their field, equal options keying
one executable and different ones another, and the circuit's argument checks."""

import copy
import pickle

import numpy as np
import pytest

import jaxpc
from jaxpc import Options, Tuning, distributions

from . import oracle

SIG = (1, 1, 2, 2, 1, 1, 16)  # a partition signature of Options.kernels: (n, C, Kp, Kc, U, D, B)


@pytest.fixture(scope="module")
def small():
    """A two-variable circuit (two sum layers) and a batch."""
    a = jaxpc.inputs(0, 2, 2, distributions.Categorical(3))
    b = jaxpc.inputs(1, 2, 2, distributions.Categorical(3))
    s = jaxpc.summate(jaxpc.multiply(a, b), num_node_blocks=1, block_size=2)
    c = jaxpc.compile(jaxpc.summate(s, num_nodes=1))
    x = np.random.default_rng(0).integers(0, 3, (7, 2)).astype(np.int32)
    return c, s, x


# ---- Options: bad values name their field --------------------------------------------------------------------------

@pytest.mark.parametrize("kernels, msg", [
    (((1, [2], 2, 2, 1, 1, 16), ("xla",)), r"kernels entry"),  # an unhashable signature failed when keyed
    (((1, 1, 2, 2, True, 1, 16), ("xla",)), r"kernels entry"),
    ((SIG[:3], ("xla",)), r"kernels entry"),
    ((SIG, ("xla", 16, 16, 4)), r"kernels entry"),  # the XLA route has no kernel configuration
    ((SIG, ("pallas", True, 16, 4)), r"kernels entry"),
    ((SIG, ("pallas", 16, 0, 4)), r"kernels entry"),
    ((SIG, ("cuda", 16, 16, 4)), r"kernels entry"),
])
def test_bad_kernels_entries_name_the_field(kernels, msg):
    with pytest.raises(ValueError, match=msg):
        Options(kernels=(kernels,))


def test_kernels_name_each_partition_once_and_key_in_any_order():
    """A partition named twice had its first route win silently; the same routes in another order were other options
    (another executable). NumPy integers are the ints they equal, as in Tuning."""
    other = (1, 2, 4, 4, 2, 1, 16, 2)
    with pytest.raises(ValueError, match=r"kernels names partition \(1, 1, 2, 2, 1, 1, 16\) twice"):
        Options(kernels=((SIG, ("xla",)), (SIG, ("pallas", 16, 16, 4))))
    a = Options(kernels=((SIG, ("xla",)), (other, ("pallas_forward", 16, 32, 4))))
    b = Options(kernels=((other, ("pallas_forward", np.int64(16), 32, 4)), (tuple(np.int64(v) for v in SIG), ("xla",))))
    assert a == b and hash(a) == hash(b) and a.kernels == tuple(sorted(a.kernels))
    assert all(type(v) is int for sig, ch in b.kernels for v in sig + ch[1:])


def test_kernels_type_is_checked_before_the_deprecated_name():
    """``impl="reference"`` with malformed kernels raised ``too many values to unpack``, and turned a list into a
    tuple silently where any other impl refuses it."""
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="kernels entry"):
        Options(impl="reference", kernels=((1, 2, 3),))
    with pytest.raises(TypeError, match="kernels must be a tuple of .* got list"):
        Options(impl="reference", kernels=[(SIG, ("reference",))])


def test_tempered_flows_with_autodiff_are_refused_when_built():
    """Tempered flows with ``backward="autodiff"`` built, and every call with them (``log_prob`` too) then raised
    from the trace; the options name both fields."""
    for name in ("pflow_temperature", "eflow_temperature"):
        with pytest.raises(ValueError, match=rf"{name}=0.5 needs backward='flows'"):
            Options(backward="autodiff", **{name: 0.5})
        with pytest.raises(ValueError, match=rf"{name}=0.5 needs backward='flows'"):
            Options(**{name: 0.5}).replace(backward="autodiff")
    assert Options(backward="autodiff", pflow_temperature=1).pflow_temperature == 1.0  # untempered: fine


def test_replace_names_unknown_options():
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['precison'\]; valid options: \['alpha', "):
        Options().replace(precison="fp32")
    assert Options().replace(precision="fp32") == Options(precision="fp32")


def test_unhashable_compiler_options_are_refused_when_built():
    """An unhashable value raised ``unhashable type: 'list'`` from the executable's key, at the first call."""
    with pytest.raises(TypeError, match=r"Tuning.compiler_options .* hashable.*xla_flag"):
        Tuning(compiler_options=(("xla_flag", [1]),))
    t = Tuning(compiler_options=(("xla_gpu_autotune_level", 0),))
    assert hash(Options(tuning=t)) == hash(Options(tuning=Tuning(compiler_options=(("xla_gpu_autotune_level", 0),))))


# ---- Options: equality is the executable's key ---------------------------------------------------------------------

def test_equal_options_share_an_executable_and_different_ones_do_not(small):
    c, _, x = small
    ll = np.asarray(c.log_prob(c.params, x))
    _, ref = oracle.forward(c, c.params, x)
    np.testing.assert_allclose(ll, ref, rtol=1e-5)
    misses = c.cache_info().misses
    equal = [None, Options(), Options(tuning=Tuning()), pickle.loads(pickle.dumps(Options())),
             copy.deepcopy(Options()), Options(propagation="MPE").replace(propagation="LL"),
             Options(gather_chunk=np.int64(1 << 24)), Options.make(Options(), propagation=None)]
    for o in equal:
        np.testing.assert_array_equal(np.asarray(c.log_prob(c.params, x, options=o)), ll)
    assert c.cache_info().misses == misses  # one executable for all of them
    for o in (Options(precision="bf16"), Options(tuning=Tuning(small_batch=8))):
        assert o != Options() and hash(o) != hash(Options())
        c.log_prob(c.params, x, options=o)
        misses, before = c.cache_info().misses, misses
        assert misses == before + 1, o


def test_options_pickle_and_copy_keep_equality_and_hash():
    o = Options(propagation="GeneralLL", alpha=2, kernels=((SIG, ("xla",)),), tuning=Tuning(leaf_batch=np.int64(8)))
    h = hash(o)
    for other in (pickle.loads(pickle.dumps(o)), copy.copy(o), copy.deepcopy(o)):
        assert other == o and hash(other) == h and other.alpha == 2.0 and type(other.tuning.leaf_batch) is int
    assert "_hash" not in o.__getstate__()  # (string hashes differ between processes)


# ---- the circuit's surface -----------------------------------------------------

def test_circuit_pickling_is_refused_with_a_way_out(small):
    """A circuit holds compiled executables and device tables: pickling or deep-copying it raises a ``TypeError``
    that says how to save one (its structure and its parameters); a shallow copy shares its executables."""
    c, _, x = small
    for how in (pickle.dumps, copy.deepcopy):
        with pytest.raises(TypeError, match=r"jaxpc.Circuit cannot be pickled.*jaxpc.io.save_structure"):
            how(c)
    shallow = copy.copy(c)
    np.testing.assert_array_equal(np.asarray(shallow.log_prob(c.params, x)), np.asarray(c.log_prob(c.params, x)))


@pytest.mark.parametrize("method, kw", [("em_step", {"keep_zero_params": "False"}),
                                        ("em_update", {"keep_zero_params": "False"}),
                                        ("em_update", {"update_sums": "no"})])
def test_em_switches_must_be_bools(small, method, kw):
    c, _, x = small
    args = (x,) if method == "em_step" else (c.flows(c.params, x),)
    name = next(iter(kw))
    with pytest.raises(TypeError, match=rf"{method}: {name} must be a bool, got '"):
        getattr(c, method)(c.params, *args, **kw)


def test_wait_compiled_negative_timeout_is_a_value_error(small):
    c, _, _ = small
    with pytest.raises(ValueError, match=r"wait_compiled: timeout must be None or seconds >= 0, got -1"):
        c.wait_compiled(-1)
    with pytest.raises(TypeError, match=r"wait_compiled: timeout must be None or seconds >= 0, got 'x'"):
        c.wait_compiled("x")
    assert c.wait_compiled(None) is True  # (0 s may leave a GPU's optimized compile pending: False)


def test_check_evidence_checks_the_batch(small):
    c, _, _ = small
    with pytest.raises(TypeError, match=r"check_evidence: batch must be an int >= 0, got '2'"):
        c.check_evidence({"latent": np.zeros((2, 2, 4))}, "2")


def test_em_numbers_and_fit_switches_refuse_booleans_and_strings(small):
    """``step_size=True`` read as 1 (and, through the scalars' memo, hit a step of ``step_size=1``), ``"0.1"`` as
    0.1, and ``fit(shuffle=None)`` as no shuffle: each is now a ``TypeError`` naming the argument."""
    from jaxpc import optim

    c, _, x = small
    c.em_step(c.params, x, step_size=1, pseudocount=0)  # fills the memo with (1, 0)
    for kw, name in (({"step_size": True, "pseudocount": 0}, "step_size"),
                     ({"step_size": 1, "pseudocount": False}, "pseudocount"),
                     ({"step_size": "0.1", "pseudocount": 0.1}, "step_size")):
        with pytest.raises(TypeError, match=rf"{name} must be a float, got (bool|str)"):
            c.em_step(c.params, x, **kw)
    for flag in ("shuffle", "drop_remainder", "normalize", "progress"):
        with pytest.raises(TypeError, match=rf"fit: {flag} must be a bool, got None"):
            optim.fit(c, c.params, x, 1, 4, step_size=0.5, pseudocount=0.1, **{flag: None})
