"""Input checks without a host round trip, and the default precision (jaxpc.runtime).

A device array's values are checked inside the executable: bad rows give NaN log-likelihoods and take no
part in flows or EM, and the named error is raised by the circuit's next call (or ``raise_pending``);
``validate="sync"`` raises at once; numpy data raise before anything runs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc import distributions, optim, parallel, structures
from jaxpc.options import resolve_precision

from .conftest import assert_same_result
from .tiers import cases

MSG = r"x\[2, 3\] = 7 is out of range: variable 3 \(Categorical"


@pytest.fixture
def hmm():
    return jaxpc.compile(structures.HMM(6, 4, 5), seed=1)


def _data(n=6, seed=0):
    return np.random.default_rng(seed).integers(0, 5, (n, 6)).astype(np.int32)


def _close(a, b, tol=1e-5):
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=tol, atol=tol)


def test_bad_device_row_is_nan_and_the_next_call_raises(hmm):
    x = _data()
    xd = jnp.asarray(x).at[2, 3].set(7)
    good = np.asarray(hmm.log_prob(hmm.params, np.delete(x, 2, axis=0), validate=False))
    ll = np.asarray(hmm.log_prob(hmm.params, xd))  # no error yet: the check's flag is read by the next call
    assert np.isnan(ll[2]) and np.isfinite(np.delete(ll, 2)).all()
    np.testing.assert_allclose(np.delete(ll, 2), good, rtol=1e-6)
    with pytest.raises(ValueError, match=MSG + r".*circuit\.log_prob"):
        hmm.log_prob(hmm.params, x)
    hmm.log_prob(hmm.params, x)  # raised once, then cleared


def test_a_replayed_call_names_the_batchs_bad_entries_not_its_padding(hmm):
    """A repeated call (``Runtime.replay``) pads the batch to its bucket: the error counts the batch's own bad
    entries (one here, so no count), not the padding rows' copies of them."""
    x = jnp.asarray(_data(2))
    for _ in range(3):
        hmm.log_prob(hmm.params, x)
    hmm.log_prob(hmm.params, x.at[0, 0].set(9))
    with pytest.raises(ValueError, match=r"x\[0, 0\] = 9 is out of range") as e:
        hmm.raise_pending()
    assert "in all" not in str(e.value)


def test_the_flag_is_written_to_pinned_host_memory(hmm):
    """The host reads a flag in pinned host memory without a device-to-host copy."""
    hmm.log_prob(hmm.params, jnp.asarray(_data()))
    (pending,) = hmm.runtime._pending
    assert pending.flag.sharding.memory_kind == "pinned_host"
    hmm.raise_pending()


@pytest.mark.parametrize("value", cases([7, -1], fast=[]))
def test_bad_rows_take_no_part_in_flows_and_em(hmm, value):
    x = _data(8, seed=3)
    xd = jnp.asarray(x).at[2, 3].set(value)
    keep = np.delete(x, 2, axis=0)
    ref = hmm.flows(hmm.params, keep, validate=False)
    ref_new = hmm.em_step(hmm.params, keep, step_size=0.5, validate=False)
    fl, ll = hmm.flows(hmm.params, xd, return_ll=True)
    assert np.isnan(np.asarray(ll)[2])
    _close(fl, ref)
    with pytest.raises(ValueError, match=r"x\[2, 3\] = " + str(value)):
        hmm.raise_pending()
    new, ll = hmm.em_step(hmm.params, xd, step_size=0.5, return_ll=True)
    _close(new, ref_new)
    assert all(np.isfinite(np.asarray(jnp.exp(a))).all() for a in jax.tree_util.tree_leaves(new))
    with pytest.raises(ValueError, match=r"x\[2, 3\] = " + str(value) + r".*circuit\.em_step"):
        hmm.raise_pending()


@pytest.mark.slow
def test_all_rows_bad_leave_the_parameters_unchanged(hmm):
    xd = jnp.full((4, 6), 9, jnp.int32)
    new = hmm.em_step(hmm.params, xd)
    _close(new, hmm.params, tol=1e-6)
    with pytest.raises(ValueError, match=r"x\[0, 0\] = 9 is out of range.*\(24 bad entries in all\)"):
        hmm.raise_pending()


@pytest.mark.slow
def test_missing_entries_are_not_checked(hmm):
    x = jnp.asarray(_data()).at[2, 3].set(7)
    missing = jnp.zeros((6, 6), bool).at[2, 3].set(True)
    ll = hmm.log_prob(hmm.params, x, missing)
    assert np.isfinite(np.asarray(ll)).all()
    hmm.raise_pending()


def test_sync_raises_at_once_and_numpy_raises_before_running(hmm):
    x = _data()
    xd = jnp.asarray(x).at[2, 3].set(7)
    with pytest.raises(ValueError, match=MSG):
        hmm.flows(hmm.params, xd, validate="sync")
    hmm.raise_pending()  # nothing left
    before = hmm.cache_info()
    bad = x.copy()
    bad[2, 3] = 7
    for call in (lambda: hmm.log_prob(hmm.params, bad), lambda: hmm.flows(hmm.params, bad),
                 lambda: hmm.em_step(hmm.params, bad), lambda: hmm.mpe(hmm.params, bad),
                 lambda: hmm.conditional(hmm.params, bad)):
        with pytest.raises(ValueError, match=MSG):
            call()
    after = hmm.cache_info()
    assert (after.hits, after.misses) == (before.hits, before.misses), "host data must raise before running"
    with pytest.raises(ValueError, match="validate must be True, False or 'sync'"):
        hmm.log_prob(hmm.params, x, validate="yes")


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64])
def test_the_host_checks_integer_bounds_agree_with_the_entrywise_rule(dtype):
    """Integer ids are checked against each variable's bounds in their own type (``VarInfo.int_limits``, no copies;
    viewed as unsigned where every variable starts at 0, ``VarInfo.unsigned_tops``): the same verdict and message as
    the entry-wise rule (``bad_entries`` in int64) for every integer type and byte order, with and without
    ``missing``, at the types' extremes, for variables that no leaf reads, for ranges wider than the type and for
    variables that all share one range."""
    from jaxpc.checks import VarInfo, check_host_values

    def verdict(info, x, m, entrywise):
        info._int_limits.clear()
        info._unsigned_tops.clear()
        if entrywise:
            info._int_limits[x.dtype] = info._unsigned_tops[x.dtype] = None
        try:
            check_host_values(info, x, m, "x")
        except ValueError as e:
            return str(e)
        finally:
            info._int_limits.clear()
            info._unsigned_tops.clear()
        return None

    cat = distributions.Categorical
    infos = [VarInfo.from_var_dists(5, {v: [cat(num_cats=k)] for v, k in enumerate([2, 3, 200, 256, 300])}),
             VarInfo.from_var_dists(5, {v: [cat(num_cats=4)] for v in (0, 2, 4)}),  # variables 1 and 3 unread
             VarInfo.from_var_dists(5, {v: [cat(num_cats=3)] for v in range(5)})]  # one range: one maximum
    assert isinstance(infos[2].unsigned_tops(np.dtype(dtype)), int)
    assert (infos[1].unsigned_tops(np.dtype(dtype)) is None) == (np.dtype(dtype).kind == "i")  # unread: any int
    t, rng = np.iinfo(dtype), np.random.default_rng(0)
    values = np.array([v for v in (t.min, t.max, -1, 0, 1, 2, 3, 4, 199, 200, 255, 256, 299, 300)
                       if t.min <= v <= t.max], dtype)
    raised = 0
    for info in infos:
        for trial in range(60):
            x = rng.integers(0, 2, size=(3, 5)).astype(dtype)
            x.flat[rng.choice(15, size=trial % 4, replace=False)] = rng.choice(values, size=trial % 4)
            m = None if trial % 2 else rng.random((3, 5)) < 0.3
            if trial % 5 == 4:
                x = x.astype(x.dtype.newbyteorder())  # the same values in the other byte order
            fast = verdict(info, x, m, False)
            assert fast == verdict(info, x, m, True), (x, m)
            raised += fast is not None
    assert 0 < raised < 180


@pytest.mark.slow
def test_queries_mark_bad_rows(hmm):
    xd = jnp.asarray(_data()).at[2, 3].set(7)
    assign, value = hmm.mpe(hmm.params, xd)
    assert (np.asarray(assign)[2] == -1).all() and np.isnan(np.asarray(value)[2])
    assert np.isfinite(np.asarray(value)[[0, 1, 3, 4, 5]]).all()
    with pytest.raises(ValueError, match=MSG + r".*circuit\.mpe"):
        hmm.raise_pending()
    cond = np.asarray(hmm.conditional(hmm.params, xd, target_vars=[0, 1]))
    assert np.isnan(cond[2]).all() and np.isfinite(cond[[0, 1, 3]]).all()
    with pytest.raises(ValueError, match=MSG + r".*circuit\.conditional"):
        hmm.sample(hmm.params, jax.random.key(0), x=jnp.asarray(_data()))


@pytest.mark.slow
def test_inside_a_user_jit_bad_rows_are_nan(hmm):
    f = jax.jit(lambda p, x: hmm.log_prob(p, x))
    ll = np.asarray(f(hmm.params, jnp.asarray(_data()).at[2, 3].set(7)))
    assert np.isnan(ll[2]) and np.isfinite(np.delete(ll, 2)).all()
    hmm.raise_pending()  # nothing can be reported from inside a trace


@pytest.mark.slow
def test_fit_and_parallel_check_device_data(hmm):
    data = jnp.asarray(_data(16, seed=5)).at[5, 3].set(7)
    with pytest.raises(ValueError, match=r"data\[5, 3\] = 7 is out of range.*optim\.fit"):
        optim.fit(hmm, hmm.params, data, epochs=1, batch_size=8, progress=False)
    mesh = parallel.data_mesh(2)
    ref = hmm.flows(hmm.params, np.delete(np.asarray(data), 5, axis=0), validate=False)
    fl, ll = parallel.flows(hmm, hmm.params, data, mesh=mesh, return_ll=True)
    assert np.isnan(np.asarray(ll)[5])
    _close(fl, ref)
    with pytest.raises(ValueError, match=r"x\[5, 3\] = 7.*circuit\.parallel\.flows"):
        hmm.raise_pending()


def test_default_precision_follows_jax():
    assert jaxpc.Options().precision == "default"
    with jax.default_matmul_precision(None):  # JAX's own default (tests/conftest.py sets "highest" on a GPU)
        expected = "tf32" if jax.default_backend() == "gpu" else "fp32"
        assert resolve_precision("default") == expected
    exact = jax.config.jax_default_matmul_precision in ("highest", "float32")  # the suite's setting, as it stands
    assert resolve_precision("default") == ("fp32" if exact else expected)
    with jax.default_matmul_precision("highest"):
        assert resolve_precision("default") == "fp32"
    assert resolve_precision("bf16") == "bf16"


@pytest.mark.slow
def test_changing_jax_matmul_precision_does_not_replay_an_executable():
    with jax.default_matmul_precision(None):  # from JAX's own default (tests/conftest.py sets "highest" on a GPU)
        c = jaxpc.compile(structures.HCLT(_data(50, seed=1), 4, input_dist=distributions.Categorical(5)))
        x = jnp.asarray(_data(8, seed=2))
        c.flows(c.params, x)
        misses = c.cache_info().misses
        c.flows(c.params, x)
        assert c.cache_info().misses == misses
        with jax.default_matmul_precision("highest"):
            c.flows(c.params, x)
        assert c.cache_info().misses == misses + 1, "a new JAX matmul setting must compile its own executable"
        with jax.default_matmul_precision("tensorfloat32"):
            c.flows(c.params, x)
        assert c.cache_info().misses == misses + 2
        c.flows(c.params, x, options=jaxpc.Options(precision="fp32"))  # explicit: JAX's setting is not read
        with jax.default_matmul_precision("highest"):
            c.flows(c.params, x, options=jaxpc.Options(precision="fp32"))
        assert c.cache_info().misses == misses + 3


def test_impl_reference_is_a_deprecated_name_of_xla():
    with pytest.warns(DeprecationWarning, match="impl='xla'"):
        old = jaxpc.Options(impl="reference")
    assert old == jaxpc.Options(impl="xla")
    sig = (1, 1, 2, 2, 1, 1, 16)
    with pytest.warns(DeprecationWarning):
        tuned = jaxpc.Options(kernels=((sig, ("reference",)),))
    assert tuned.kernels == ((sig, ("xla",)),)



def _on(a, device) -> bool:
    return all(leaf.devices() == {device} for leaf in jax.tree_util.tree_leaves(a))


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 (fake) devices")
def test_a_key_or_a_step_size_committed_to_another_device_is_refused_naming_it(hmm):
    """Data and parameters decide where a call runs (:meth:`jaxpc.runtime.Runtime.placement`); a PRNG key or a step
    size committed to other devices is refused before anything compiles, naming it (JAX's own error named
    positional arguments)."""
    d1 = jax.devices()[1]
    with pytest.raises(ValueError, match=r"step_size is committed to devices \[1\], but the call runs on devices \[0"):
        hmm.em_step(hmm.params, _data(8), step_size=jax.device_put(jnp.float32(0.5), d1))
    key = jax.device_put(jax.random.key(0), d1)
    with pytest.raises(ValueError, match=r"key is committed to devices \[1\], but the call runs on devices \[0"):
        hmm.sample(hmm.params, key, 8)
    with pytest.raises(ValueError, match=r"key is committed to devices \[1\], but the call runs on devices \[0"):
        hmm.init_params(key)
    if len(jax.devices()) >= 3:  # over a mesh: its devices
        mesh = parallel.data_mesh(devices=jax.devices()[1:3])
        with pytest.raises(ValueError, match=r"step_size is committed to devices \[1\], but the call runs on devices "
                                             r"\[1, 2\] \(the mesh's\)"):
            parallel.em_step(hmm, hmm.params, _data(8), mesh=mesh, step_size=jax.device_put(jnp.float32(0.5), d1))
    assert hmm.cache_info().misses == 0


@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 (fake) devices")
def test_a_step_size_committed_to_another_device_is_refused_by_the_first_call_and_the_replay(hmm):
    """Data and parameters decide where a call runs; a step size committed to other devices is refused, naming it,
    by the first call and by the replay of a remembered call alike (JAX's own error named positional arguments)."""
    x, step = _data(8), jax.device_put(jnp.float32(0.5), jax.devices()[1])
    msg = r"step_size is committed to devices \[1\], but the call runs on devices \[0\]"
    with pytest.raises(ValueError, match=msg):
        hmm.em_step(hmm.params, x, step_size=step)
    hmm.em_step(hmm.params, x, step_size=0.5)  # remembered: the next step replays it
    with pytest.raises(ValueError, match=msg):
        hmm.em_step(hmm.params, x, step_size=step)


@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 (fake) devices")
def test_arguments_committed_where_the_call_runs_are_taken_and_a_replay_runs_where_the_full_call_would(hmm):
    """A step size and a PRNG key committed where the data or the parameters are are taken as they are (first call
    and replay); a key committed elsewhere is refused, naming it, by the first call and the replay alike (a
    remembered call moved it silently). A replay runs where the full call would: an uncommitted batch after one
    committed to another device runs on the tables' device (the remembered call's device took it)."""
    d0, d1 = jax.devices()[:2]
    x, step = _data(8), jax.device_put(jnp.float32(0.5), d1)
    want = hmm.em_step(hmm.params, x, step_size=0.5)
    x1 = jax.device_put(x, d1)
    for _ in range(2):  # the full call, then its replay
        got = hmm.em_step(hmm.params, x1, step_size=step)
        assert _on(got, d1)
        assert_same_result(got, want)
    with pytest.raises(ValueError, match=r"step_size is committed to devices \[0\], but the call runs on devices \[1"):
        hmm.em_step(hmm.params, x1, step_size=jax.device_put(jnp.float32(0.5), d0))
    assert _on(hmm.em_step(hmm.params, jnp.asarray(x), step_size=0.5), d0)
    key = jax.device_put(jax.random.key(0), d1)
    msg = r"key is committed to devices \[1\], but the call runs on devices \[0\]"
    with pytest.raises(ValueError, match=msg):
        hmm.sample(hmm.params, key, 8)
    with pytest.raises(ValueError, match=msg):
        hmm.init_params(key)
    drawn = np.asarray(hmm.sample(hmm.params, jax.random.key(0), 8))  # remembered: the next call replays it
    with pytest.raises(ValueError, match=msg):
        hmm.sample(hmm.params, key, 8)
    on1 = hmm.sample(jax.device_put(hmm.params, d1), key, 8)
    assert _on(on1, d1)
    np.testing.assert_array_equal(np.asarray(on1), drawn)
