"""optim.fit's per-row weights (``ll_weights``): an integer weight is that many copies of its row and a weight of 0
no row (against fit on the repeated data), zero-weight batches take no step, bad weights raise naming them, and the
mesh path weighs as one device does."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxpc import optim, parallel

from .test_optim import _maxdiff, _small_circuit


def _weighted_and_repeated(n=30, seed=0):
    circuit, _, data = _small_circuit()
    data = data[:n]
    w = np.random.default_rng(seed).integers(0, 4, n)
    w[:3] = (0, 1, 3)  # a dropped row, a single one and a tripled one at least
    return circuit, data, w, np.repeat(data, w, axis=0)


@pytest.mark.slow
def test_fit_weights_are_repeated_rows_and_zero_weights_dropped_rows():
    """Full-batch EM (one batch per epoch, step size 1) on weights in {0, 1, 2, 3} equals it on the data with each row
    repeated its weight's number of times (rows of weight 0 dropped): the parameters of every epoch and the weighted
    mean log-likelihoods."""
    circuit, data, w, rep = _weighted_and_repeated()
    kw = dict(step_size=1.0, pseudocount=0.1, progress=False)
    got = optim.fit(circuit, circuit.params, data, 2, 1000, ll_weights=w, **kw)
    want = optim.fit(circuit, circuit.params, rep, 2, 1000, **kw)
    assert _maxdiff(got.params, want.params) < 2e-6
    np.testing.assert_allclose(got.epoch_ll, want.epoch_ll, rtol=1e-6)
    assert int(got.opt_state.count) == int(want.opt_state.count) == 2


def test_fit_names_bad_weights():
    circuit, data, w, _ = _weighted_and_repeated()
    p = circuit.params
    for bad, match in ((w[:-1], r"fit: ll_weights must have shape \[30\] \(one weight per row of data\), got \(29,\)"),
                       (w[:, None], r"must have shape \[30\].*got \(30, 1\)"),
                       (np.where(np.arange(30) == 4, -1.0, w), r"fit: ll_weights must be >= 0; ll_weights\[4\] is -1"),
                       (np.where(np.arange(30) >= 7, np.nan, w), r"must be finite; ll_weights\[7\] is nan \(23 such"),
                       (np.where(np.arange(30) == 2, np.inf, w), r"must be finite; ll_weights\[2\] is inf"),
                       (np.zeros(30), "fit: ll_weights are all zero, so no row of data takes part")):
        with pytest.raises(ValueError, match=match):
            optim.fit(circuit, p, data, 1, 10, ll_weights=bad, progress=False)
    with pytest.raises(TypeError, match="fit: ll_weights must be numbers, got dtype <U1"):
        optim.fit(circuit, p, data, 1, 10, ll_weights=np.array(["a"] * 30), progress=False)
    # device weights are checked on the device alongside the first epoch, then raise in fit
    dev = jnp.asarray(np.where(np.arange(30) == 5, np.nan, w), jnp.float32)
    with pytest.raises(ValueError, match=r"must be finite; ll_weights\[5\] is nan \(checked on the device"):
        optim.fit(circuit, p, data, 2, 10, ll_weights=dev, progress=False)
    with pytest.raises(ValueError, match="all zero.*checked on the device"):
        optim.fit(circuit, p, data, 1, 10, ll_weights=jnp.zeros(30), progress=False)
    if len(jax.devices()) >= 2:
        elsewhere = jax.device_put(jnp.asarray(w, jnp.float32), jax.devices()[1])
        with pytest.raises(ValueError, match=r"ll_weights is committed to devices \[1\], but the call runs on "
                                             r"devices \[0\] \(fit: "):
            optim.fit(circuit, p, data, 1, 10, ll_weights=elsewhere, progress=False)
        key = jax.device_put(jax.random.key(0), jax.devices()[1])
        with pytest.raises(ValueError, match=r"key is committed to devices \[1\], but the call runs on devices \[0\] "
                                             r"\(fit: "):
            optim.fit(circuit, p, data, 1, 10, key=key, progress=False)


def test_fit_checks_host_weights_once(monkeypatch):
    """Host weights (numpy, lists) are checked once, by fit's own rule, not again by the runtime's (which every
    value fit accepts passes), and train as the same weights on the device do."""
    from jaxpc import runtime
    from jaxpc.optim import train

    circuit, data, w, _ = _weighted_and_repeated()
    seen = []
    for module, name in ((runtime, "_raise_bad_weights"), (train, "_raise_bad_fit_weights")):
        check = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _c=check, _n=name, **k: seen.append(_n) or _c(*a, **k))
    kw = dict(step_size=0.5, pseudocount=0.1, progress=False)
    host = optim.fit(circuit, circuit.params, data, 1, 10, ll_weights=list(w), **kw)
    assert seen == ["_raise_bad_fit_weights"]
    dev = optim.fit(circuit, circuit.params, data, 1, 10, ll_weights=jnp.asarray(w, jnp.float32), **kw)
    assert _maxdiff(host.params, dev.params) == 0.0


@pytest.mark.slow
@pytest.mark.full
def test_fit_weights_equal_repeated_rows_for_full_batch_em_and_adam():
    """Over several batches, full-batch EM (flows summed over the epoch's batches) on weights equals it on the
    repeated rows, and so does adam on one batch per epoch (the weighted mean log-likelihood's gradient)."""
    circuit, data, w, rep = _weighted_and_repeated()
    nb = -(-len(data) // 8)
    got = optim.fit(circuit, circuit.params, data, 2, 8, ll_weights=w, progress=False,
                    optimizer=optim.full_batch_em(circuit, nb, pseudocount=0.1))
    want = optim.fit(circuit, circuit.params, rep, 2, 8, progress=False,
                     optimizer=optim.full_batch_em(circuit, -(-len(rep) // 8), pseudocount=0.1))
    assert _maxdiff(got.params, want.params) < 2e-6
    np.testing.assert_allclose(got.epoch_ll, want.epoch_ll, rtol=1e-6)
    got = optim.fit(circuit, circuit.params, data, 3, 1000, ll_weights=w, optimizer=optax.adam(0.05), progress=False)
    want = optim.fit(circuit, circuit.params, rep, 3, 1000, optimizer=optax.adam(0.05), progress=False)
    assert _maxdiff(got.params, want.params) < 1e-5
    np.testing.assert_allclose(got.epoch_ll, want.epoch_ll, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.full  # (in CI: the other weighted fits)
def test_fit_skips_batches_whose_rows_all_weigh_zero():
    """A batch of zero-weight rows takes no step: mini-batch EM with a pseudocount and a step-size schedule, and adam,
    on 90 rows in order whose first 30 weigh 0 equal them on the last 60 rows (their step counts too); without the
    skip the pseudocount would pull the first batch's parameters toward uniform (and adam's gradient be 0 / 0)."""
    circuit, _, data = _small_circuit()
    data = data[:90]
    w = np.r_[np.zeros(30), np.ones(60)]
    sched = optax.linear_schedule(0.5, 0.1, 4)
    for kw in (dict(step_size=sched, pseudocount=0.5), dict(optimizer=optax.adam(0.05))):
        got = optim.fit(circuit, circuit.params, data, 2, 30, ll_weights=w, shuffle=False, progress=False, **kw)
        want = optim.fit(circuit, circuit.params, data[30:], 2, 30, shuffle=False, progress=False, **kw)
        assert _maxdiff(got.params, want.params) < 1e-6, kw
        assert _maxdiff(got.opt_state, want.opt_state) < 1e-6, kw
        np.testing.assert_allclose(got.epoch_ll, want.epoch_ll, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.full  # (in CI: test_parallel.py's fit on a mesh)
def test_fit_weights_on_a_mesh_equal_one_device():
    """Over a 4-device mesh, weights (numpy, and device weights replicated on the mesh) give one device's result,
    the last batch of each epoch padded (30 rows in batches of 8); weights committed elsewhere raise."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    circuit, data, w, _ = _weighted_and_repeated()
    mesh = parallel.data_mesh(4)
    kw = dict(step_size=0.5, pseudocount=0.1, key=jax.random.key(3), progress=False)
    one = optim.fit(circuit, circuit.params, data, 2, 8, ll_weights=w, **kw)
    four = optim.fit(circuit, circuit.params, data, 2, 8, ll_weights=w, mesh=mesh, **kw)
    assert _maxdiff(one.params, four.params) < 1e-5
    np.testing.assert_allclose(one.epoch_ll, four.epoch_ll, rtol=1e-5)
    on_mesh = jax.device_put(jnp.asarray(w, jnp.float32),
                             jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    again = optim.fit(circuit, circuit.params, data, 2, 8, ll_weights=on_mesh, mesh=mesh, **kw)
    assert _maxdiff(again.params, four.params) < 1e-6
    with pytest.raises(ValueError, match=r"ll_weights is committed to devices \[1\], but the mesh is over devices "
                                         r"\[0, 1, 2, 3\]"):
        optim.fit(circuit, circuit.params, data, 1, 8, ll_weights=jax.device_put(jnp.asarray(w), jax.devices()[1]),
                  mesh=mesh, **kw)


@pytest.mark.slow
@pytest.mark.full  # (in CI: the other weighted fits)
def test_fit_weights_follow_their_rows_into_shuffled_batches():
    """Mini-batch EM with weights and a step-size schedule, shuffled into 3 batches with the last one padded, equals
    a Python loop of ``em_step`` on each batch's rows and their weights (:func:`optim.epoch_batches`)."""
    circuit, data, w, _ = _weighted_and_repeated(40, seed=2)
    key, sched = jax.random.key(4), optax.linear_schedule(0.6, 0.1, 6)
    res = optim.fit(circuit, circuit.params, data, 2, 16, step_size=sched, pseudocount=0.2, key=key, ll_weights=w,
                    progress=False)
    params, lls, step = circuit.params, [], 0
    for e in range(2):
        idx, pad = optim.epoch_batches(key, e, len(data), 16)
        tot = 0.0
        for rows, keep in zip(np.asarray(idx), np.asarray(pad) > 0):
            rows = rows[keep]
            params, ll = circuit.em_step(params, data[rows], step_size=float(sched(step)), pseudocount=0.2,
                                         ll_weights=w[rows], return_ll=True)
            tot += float(np.sum(w[rows] * np.asarray(ll, np.float64)))
            step += 1
        lls.append(tot / w.sum())
    assert _maxdiff(res.params, params) < 2e-6
    np.testing.assert_allclose(res.epoch_ll, lls, rtol=1e-5)


@pytest.mark.slow
def test_fit_with_weights_is_float64_em_in_numpy():
    """In float64, fit (full-batch EM with a pseudocount and a step size below 1, and full-batch EM over 4 padded
    batches) on weighted data equals EM written in numpy for a mixture of two categorical products, to 1e-12."""
    import jaxpc
    from jaxpc import distributions

    K = 3
    with jax.enable_x64(True):
        a = jaxpc.inputs(0, num_nodes=K, dist=distributions.Categorical(4))
        b = jaxpc.inputs(1, num_nodes=K, dist=distributions.Categorical(3))
        root = jaxpc.summate(jaxpc.multiply(a, b), num_nodes=1)
        c = jaxpc.compile(root, seed=1, dtype=jnp.float64)
        rng = np.random.default_rng(0)
        x = np.stack([rng.integers(0, 4, 37), rng.integers(0, 3, 37)], 1).astype(np.int32)
        x[:20, 1] = x[:20, 0] % 3
        w = rng.integers(0, 3, 37).astype(np.float64)

        def read(p):
            return [np.asarray(c.get_node_params(p, n), np.float64).reshape(K, -1) for n in (root, a, b)]

        def numpy_em(theta, pc, s, epochs):
            pi, A, B = theta[0].ravel(), theta[1], theta[2]
            lls = []
            for _ in range(epochs):
                joint = pi[None] * A[:, x[:, 0]].T * B[:, x[:, 1]].T  # [N, K]
                lls.append(np.sum(w * np.log(joint.sum(1))) / w.sum())
                r = joint / joint.sum(1, keepdims=True) * w[:, None]
                ca, cb = np.zeros_like(A), np.zeros_like(B)
                for k in range(K):
                    np.add.at(ca[k], x[:, 0], r[:, k])
                    np.add.at(cb[k], x[:, 1], r[:, k])
                new = [(r.sum(0) + pc / K)[None], ca + pc / A.shape[1], cb + pc / B.shape[1]]
                pi, A, B = ((1 - s) * old + s * n / n.sum(1, keepdims=True) for old, n in zip((pi[None], A, B), new))
                pi = pi.ravel()
            return [pi.reshape(K, -1), A, B], np.array(lls)

        one_batch = optim.fit(c, c.params, x, 4, 1000, step_size=0.6, pseudocount=0.3, ll_weights=w, progress=False)
        four = optim.fit(c, c.params, x, 4, 10, optimizer=optim.full_batch_em(c, 4, pseudocount=0.3), ll_weights=w,
                         progress=False)
        for res, step in ((one_batch, 0.6), (four, 1.0)):
            want, want_ll = numpy_em(read(c.params), 0.3, step, 4)
            assert res.epoch_ll.dtype == np.float64
            for got, ref in zip(read(res.params), want):
                np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-14)
            np.testing.assert_allclose(res.epoch_ll, want_ll, rtol=1e-12)
