"""Step size schedules' values: out of their range (EM: ``[0, 1]``; anemone's eta: finite and >= 0) they raise a
``ValueError`` naming the count and value (``fit``: before training; ``update``/``step``: from the circuit's next
call) and make the update's parameters NaN (inside a ``jit`` of the caller's own); a warm-up starting at 0 is a
no-op step, not an error."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpc
from jaxpc import distributions, optim
from jaxpc.optim import check_schedule, transforms


@pytest.fixture(scope="module")
def case():
    a = jaxpc.inputs(0, 2, 2, distributions.Categorical(3))
    b = jaxpc.inputs(1, 2, 2, distributions.Categorical(3))
    circuit = jaxpc.compile(jaxpc.summate(jaxpc.multiply(a, b), num_nodes=1), seed=0)
    data = np.random.default_rng(0).integers(0, 3, size=(40, 2)).astype(np.int32)
    circuit.flows(circuit.params, data)  # (compiled once, outside the tests' timings)
    check_schedule(optim.em(circuit, lambda t: 0.5), 0, 1)
    return circuit, data


def _after(count, value, before=0.5):
    """A schedule that returns ``before`` up to ``count - 1`` and ``value`` from ``count`` on."""
    return lambda t: jnp.where(t >= count, value, before)


def _leaves(params):
    return [np.asarray(a) for a in jax.tree_util.tree_leaves(params)]


def _all_nan(params):
    return all(np.isnan(a).all() for a in _leaves(params))


def _close(p, q):
    """Equal up to the rounding of a step of 0 (the exponentials' logarithms)."""
    return all(np.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(_leaves(p), _leaves(q)))


@pytest.mark.parametrize("value", [1.5, -0.1, math.nan])
def test_fit_names_the_first_count_whose_step_size_is_out_of_range(case, value):
    """-0.1 used to train silently to finite but wrong parameters, 1.5 and NaN to NaN ones after a warning. The
    error comes before any training, for the default optimizer's schedule and for an EM optimizer's."""
    circuit, data = case
    for kw in ({"step_size": _after(6, value)}, {"optimizer": optim.em(circuit, _after(6, value))}):
        with pytest.raises(ValueError, match=rf"fit: the step_size schedule of em returns {value} at count 6 .*"
                                             r"must be in \[0, 1\]"):
            optim.fit(circuit, circuit.params, data, 2, 10, progress=False, **kw)


@pytest.mark.slow
def test_fit_checks_the_counts_of_its_updates_from_the_state_it_resumes(case):
    """Two epochs of 4 batches use counts 0..7: a schedule bad from count 8 on trains; resumed from that state, the
    next epoch's first update uses count 8."""
    circuit, data = case
    tx = optim.em(circuit, _after(8, 1.5))
    res = optim.fit(circuit, circuit.params, data, 2, 10, optimizer=tx, progress=False)
    assert int(res.opt_state.count) == 8
    assert all(np.isfinite(a[a > -np.inf]).all() for a in _leaves(res.params))
    with pytest.raises(ValueError, match=r"returns 1.5 at count 8 "):
        optim.fit(circuit, res.params, data, 1, 10, optimizer=tx, opt_state=res.opt_state, start_epoch=2,
                  progress=False)


def test_fit_checks_full_batch_em_and_anemone_schedules(case):
    """full_batch_em's schedule is checked at its EM updates' k only (not at the k = -1 its accumulating updates
    evaluate), anemone's eta against its own rule (> 1 is fine, negative or infinite is not)."""
    circuit, data = case
    fb = optim.full_batch_em(circuit, 4, step_size=lambda k: jnp.where(k < 0, 7.0, jnp.where(k >= 1, 2.0, 1.0)))
    with pytest.raises(ValueError, match=r"fit: the step_size schedule of full_batch_em returns 2.0 at EM update k=1"):
        optim.fit(circuit, circuit.params, data, 2, 10, optimizer=fb, progress=False)
    for value in (-1.0, math.inf):
        with pytest.raises(ValueError, match=rf"schedule of anemone returns {value} at count 2 .*finite and >= 0"):
            optim.fit(circuit, circuit.params, data, 1, 10, optimizer=optim.anemone(circuit, _after(2, value, 3.0)),
                      progress=False)


@pytest.mark.slow
def test_a_warm_up_from_zero_is_a_no_op_step(case):
    """A schedule that starts at 0 is legitimate: its first update keeps the parameters, in fit and in a loop."""
    circuit, data = case
    res = optim.fit(circuit, circuit.params, data, 1, 40, step_size=optax.linear_schedule(0.0, 0.5, 10),
                    progress=False)
    assert _close(res.params, circuit.params) and int(res.opt_state.count) == 1
    tx = optim.em(circuit, optax.linear_schedule(0.0, 0.5, 10))
    new, state = tx.step(circuit.flows(circuit.params, data), tx.init(circuit.params), circuit.params)
    circuit.raise_pending()
    assert _close(new, circuit.params)
    new, state = tx.step(circuit.flows(new, data), state, new)
    circuit.raise_pending()
    assert not _close(new, circuit.params)


@pytest.mark.parametrize("how", ["step", "update"])
def test_an_update_with_a_bad_value_is_nan_and_the_next_call_raises(case, how):
    """In a loop of the caller's own, the update's parameters are NaN and the circuit's next call raises the error
    that names the count (or the transformation's next update, or raise_pending)."""
    circuit, data = case
    tx = optim.em(circuit, _after(1, 1.5))
    params, state = circuit.params, tx.init(circuit.params)
    for _ in range(2):  # counts 0 and 1: the second update is bad
        flows = circuit.flows(params, data)
        if how == "step":
            params, state = tx.step(flows, state, params)
        else:
            updates, state = tx.update(flows, state, params)
            params = optim.apply_updates(params, updates)
    assert _all_nan(params)
    with pytest.raises(ValueError, match=r"em: the step_size schedule of em returns 1.5 at count 1 .*checked on the "
                                         r"device after that update"):
        circuit.log_prob(circuit.params, data)
    circuit.raise_pending()  # (the error clears the flag)
    tx = optim.em(circuit, _after(0, math.nan))
    state = tx.init(circuit.params)
    params, state = tx.step(circuit.flows(circuit.params, data), state, circuit.params)
    with pytest.raises(ValueError, match=r"returns nan at count 0"):
        tx.step(circuit.flows(circuit.params, data), state, circuit.params)
    circuit.raise_pending()


def test_full_batch_em_flags_only_its_em_updates(case):
    """The accumulating updates of full_batch_em evaluate the schedule at k = -1 but take no step: no error, no NaN;
    its EM update with a bad value does."""
    circuit, data = case
    tx = optim.full_batch_em(circuit, 2, step_size=lambda k: jnp.where(k < 0, 7.0, 1.5))
    flows = circuit.flows(circuit.params, data)
    p, state = tx.step(flows, tx.init(circuit.params), circuit.params)
    circuit.raise_pending()
    assert _close(p, circuit.params)
    p, state = tx.step(flows, state, p)
    assert _all_nan(p)
    with pytest.raises(ValueError, match=r"full_batch_em returns 1.5 at EM update k=0"):
        circuit.raise_pending()


@pytest.mark.slow
def test_inside_a_jit_the_update_is_nan(case):
    """Traced, nothing can raise: the update's parameters are all NaN (and a good count's are finite)."""
    circuit, data = case
    flows = circuit.flows(circuit.params, data)
    for make in (lambda s: optim.em(circuit, s), lambda s: optim.anemone(circuit, s),
                 lambda s: optim.full_batch_em(circuit, 1, step_size=s)):
        tx = make(_after(1, -0.25))
        step = jax.jit(tx.step)
        p0, s0 = step(flows, tx.init(circuit.params), circuit.params)
        p1, _ = step(flows, s0, p0)
        circuit.raise_pending()  # (no check was recorded)
        assert not _all_nan(p0) and all(np.isfinite(a[a > -np.inf]).all() for a in _leaves(p0))
        assert _all_nan(p1)


def test_make_step_takes_the_nan_rule(case):
    """The pure step of make_step (fit's, parallel's) makes NaN parameters from a bad value too."""
    circuit, data = case
    tx = optim.em(circuit, lambda t: 2.0)
    step = jax.jit(optim.make_step(circuit.layout, tx))
    p, _, _ = step(circuit.tables, circuit.params, tx.init(circuit.params), jnp.asarray(data), None, None)
    assert _all_nan(p)


def test_check_schedule_and_host_counts(case):
    """check_schedule evaluates a range of counts, a chunk at a time (the first bad count of a later chunk is named);
    a state whose count is on the host is checked at once; constants and optax transformations pass."""
    circuit, data = case
    bad = transforms._CHUNK + 5
    tx = optim.em(circuit, _after(bad, 1.01))
    check_schedule(tx, 0, bad)
    with pytest.raises(ValueError, match=rf"em: the step_size schedule of em returns 1.01 at count {bad} "):
        check_schedule(tx, 0, bad + 1)
    with pytest.raises(ValueError, match=rf"at count {bad} "):
        check_schedule(tx, bad - 1, 5)
    check_schedule(optim.em(circuit, 0.5), 0, 10)
    check_schedule(optax.adam(1e-2), 0, 10)
    flows = circuit.flows(circuit.params, data)
    with pytest.raises(ValueError, match=rf"returns 1.01 at count {bad}"):
        tx.step(flows, optim.EMState(np.int32(bad)), circuit.params)
    circuit.raise_pending()


def test_pseudocount_is_not_a_schedule(case):
    circuit, _ = case
    with pytest.raises(TypeError, match="pseudocount must be a float"):
        optim.em(circuit, 0.5, pseudocount=lambda t: 0.1)


@pytest.mark.slow
def test_a_data_parallel_train_step_checks_its_schedule(case):
    """parallel.train_step takes the update's rule: NaN parameters, and the circuit's next call raises (with
    validate='sync' this one; with validate=False nothing is checked)."""
    from jaxpc import parallel

    circuit, data = case
    mesh = parallel.data_mesh(2)
    tx = optim.em(circuit, _after(1, 1.5))
    state = tx.init(circuit.params)
    p, state, _ = parallel.train_step(circuit, tx, circuit.params, state, data, mesh=mesh)
    circuit.raise_pending()
    p, _, _ = parallel.train_step(circuit, tx, p, state, data, mesh=mesh)
    assert _all_nan(p)
    with pytest.raises(ValueError, match=r"returns 1.5 at count 1 "):
        circuit.log_prob(circuit.params, data)
    with pytest.raises(ValueError, match=r"returns 1.5 at count 1 "):
        parallel.train_step(circuit, tx, circuit.params, state, data, mesh=mesh, validate="sync")
    parallel.train_step(circuit, tx, circuit.params, state, data, mesh=mesh, validate=False)
    circuit.raise_pending()


def _any_nan(params):
    return any(np.isnan(np.asarray(a)).any() for a in jax.tree_util.tree_leaves(params))


def test_linear_decay_to_zero_keeps_parameters_finite(case):
    circuit, data = case
    tx = optim.em(circuit, optax.linear_schedule(0.5, 0.0, 10))
    state, params = tx.init(circuit.params), circuit.params
    flows = circuit.flows(params, data)
    for _ in range(11):  # the last update reads the schedule's end value, 0
        params, state = tx.step(flows, state, params)
    circuit.raise_pending()
    assert not _any_nan(params)


def _decay_end(t):
    """The values of ``optax.linear_schedule(0.5, 0.0, 10)`` under an optimized ``jit``, where ``0.5 * (1 - t / 10)``
    becomes a fused multiply-add and ends at ``-2**-27``, not 0."""
    return jnp.where(t >= 10, jnp.float32(-(2.0 ** -27)), 0.5 * (1 - t / 10))


def test_fit_accepts_a_rounding_below_zero(case):
    circuit, data = case
    out = optim.fit(circuit, circuit.params, data, epochs=3, batch_size=4, progress=False,
                    optimizer=optim.em(circuit, _decay_end))
    assert not _any_nan(out.params)


def test_schedule_check_still_refuses_real_negatives(case):
    circuit, _ = case
    with pytest.raises(ValueError, match="returns -0.001 at count 4"):
        optim.check_schedule(optim.em(circuit, lambda t: jnp.where(t > 3, -1e-3, 0.5)), 0, 20)
