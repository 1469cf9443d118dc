"""jaxpc.optim: normalization of logits, EM as optax-style transformations, gradient training that
stays normalized, and whole-epoch fit executables against Python loops of the circuit's methods."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpc
from jaxpc import distributions, optim

from .random_circuits import Generator

DISCRETE = ("categorical", "bernoulli", "masked", "indicator", "literal", "logistic")


def _perturb(params, seed, scale=1.0):
    rng = np.random.default_rng(seed)

    def f(leaf):
        a = np.asarray(leaf)
        return jnp.asarray(np.where(np.isfinite(a), a + scale * rng.standard_normal(a.shape), a).astype(a.dtype))

    return jax.tree_util.tree_map(f, params)


def _maxdiff(a, b):
    """Largest absolute difference over all leaves (entries that are -inf in both count as equal)."""
    out = 0.0
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        assert u.shape == v.shape
        same = (u == v) | (np.isnan(u) & np.isnan(v))
        with np.errstate(invalid="ignore"):
            d = np.where(same, 0.0, np.abs(u - v))
        out = max(out, float(d.max()) if d.size else 0.0)
    return out


def _sum_node_totals(circuit, params):
    """Each sum node's total weight, from the parameter groups and their segment tables (numpy)."""
    out = []
    for g in circuit.layout.sum_groups:
        w = np.exp(np.asarray(params["sum"][g.key], np.float64))
        tot = np.zeros((g.num_segments, g.Kp))
        np.add.at(tot, np.asarray(circuit.tables["groups"][g.key]["seg"]), w.sum(2))
        out.append(tot.ravel())
    return np.concatenate(out)


def _small_circuit():
    a = jaxpc.inputs(0, 2, 2, distributions.Categorical(3))
    b = jaxpc.inputs(1, 2, 2, distributions.Categorical(3))
    c = jaxpc.inputs(2, 2, 2, distributions.Bernoulli())
    inner = jaxpc.summate(jaxpc.multiply(b, c), num_node_blocks=2, block_size=2)
    root = jaxpc.summate(jaxpc.multiply(a, inner), jaxpc.multiply(a.duplicate(0), inner), num_nodes=1)
    circuit = jaxpc.compile(root)
    X = np.asarray(list(itertools.product(range(3), range(3), range(2))), np.int32)
    rng = np.random.default_rng(0)
    data = rng.integers(0, [3, 3, 2], size=(150, 3)).astype(np.int32)
    data[:90, 1] = data[:90, 0]  # a dependency the circuit can learn
    return circuit, X, data


@pytest.mark.parametrize("seed", [1])
@pytest.mark.slow
def test_normalize_turns_any_logits_into_a_distribution(seed):
    gen = Generator(seed, num_vars=3, kinds=DISCRETE)
    circuit = jaxpc.compile(gen.circuit())
    X = gen.all_assignments()[0].astype(np.int32)
    logits = _perturb(circuit.params, seed, scale=2.0)
    p = optim.normalize(circuit, logits)
    total = float(jnp.sum(jnp.exp(circuit.log_prob(p, X))))
    assert total == pytest.approx(1.0, abs=1e-4)
    # the logits themselves are not normalized, and log_prob(normalize=True) renormalizes them
    assert abs(float(jnp.sum(jnp.exp(optim.log_prob(circuit, logits, X, normalize=False)))) - 1.0) > 1e-3
    np.testing.assert_allclose(optim.log_prob(circuit, logits, X), circuit.log_prob(p, X), rtol=1e-5, atol=1e-6)
    # normalized params are a fixed point
    assert _maxdiff(optim.normalize(circuit, circuit.params), circuit.params) < 1e-5
    # each sum node's weights sum to one
    np.testing.assert_allclose(_sum_node_totals(circuit, p), 1.0, rtol=1e-5)


def test_masked_categorical_keeps_forbidden_values_at_zero():
    mask = np.array([[0, 2], [1, 3]])
    a = jaxpc.inputs(0, 1, 2, distributions.MaskedCategorical(3, "range"), params={"mask": mask})
    root = jaxpc.summate(a, num_nodes=1)
    c = jaxpc.compile(root)
    logits = jax.tree_util.tree_map(lambda w: jnp.where(jnp.isfinite(w), w, 5.0), c.params)  # revive -inf
    p = optim.normalize(c, logits)
    probs = np.asarray(c.get_node_params(p, a)["probs"])
    assert probs[0, 2] == 0 and probs[1, 0] == 0
    np.testing.assert_allclose(probs.sum(1), 1.0, rtol=1e-6)


@pytest.mark.slow
def test_gradient_training_keeps_gaussian_sigma_at_min_sigma():
    """Logits of a Gaussian's scale are normalized to ``sigma >= min_sigma``, EM's floor: adam on data at two point
    masses stops where EM does (sigma 0.1, not 0.02 below the distribution's floor), and the trained values are
    valid parameters of the distribution."""
    leaves = [jaxpc.inputs(v, num_nodes=2, dist=distributions.Gaussian(min_sigma=0.1)) for v in range(2)]
    c = jaxpc.compile(jaxpc.summate(jaxpc.multiply(*leaves), num_nodes=1), seed=0)
    rng = np.random.default_rng(0)
    x = (np.concatenate([np.full((100, 2), -1.0), np.full((100, 2), 1.0)])
         + 1e-3 * rng.normal(size=(200, 2))).astype(np.float32)
    res = optim.fit(c, c.params, x, 60, 50, optimizer=optax.adam(0.1), key=jax.random.key(0), progress=False)
    em = optim.fit(c, c.params, x, 60, 50, step_size=1.0, pseudocount=0.0, key=jax.random.key(0), progress=False)
    for leaf in leaves:
        sigma = np.asarray(c.get_node_params(res.params, leaf)["sigma"])
        np.testing.assert_allclose(sigma, 0.1, rtol=1e-5)
        jaxpc.inputs(0, num_nodes=2, dist=distributions.Gaussian(min_sigma=0.1),
                     params={k: np.asarray(v) for k, v in c.get_node_params(res.params, leaf).items()})
    np.testing.assert_allclose(res.epoch_ll[-1], em.epoch_ll[-1], atol=0.02)


@pytest.mark.slow
def test_adam_on_logits_stays_normalized_and_improves_ll():
    circuit, X, data = _small_circuit()
    layout, tables = circuit.layout, circuit.tables
    x = jnp.asarray(data)
    tx = optax.adam(0.05)

    @jax.jit
    def step(params, state):
        def loss_fn(p):
            return optim.mean_nll(layout, tables, p, x, None, None, jaxpc.Options())[0]

        loss, g = jax.value_and_grad(loss_fn)(params)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    params, state = circuit.params, tx.init(circuit.params)
    losses = []
    for _ in range(60):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    p = optim.normalize(circuit, params)  # raw adam steps leave the normalized set; normalize maps back
    assert float(jnp.sum(jnp.exp(circuit.log_prob(p, X)))) == pytest.approx(1.0, abs=1e-5)
    ll0 = float(jnp.mean(circuit.log_prob(circuit.params, data)))
    ll1 = float(jnp.mean(circuit.log_prob(p, data)))
    assert ll1 > ll0 + 0.1
    assert losses[0] == pytest.approx(-ll0, abs=1e-5) and losses[-1] < losses[0] - 0.1


@pytest.mark.slow
def test_em_transformation_is_em_step_and_its_deltas_are_optax_updates():
    circuit, _, data = _small_circuit()
    params = circuit.params
    tx = optim.em(circuit, step_size=0.3, pseudocount=0.5)
    state = tx.init(params)
    flows = circuit.flows(params, data[:40])
    new, state1 = tx.step(flows, state, params)
    ref = circuit.em_step(params, data[:40], step_size=0.3, pseudocount=0.5)
    assert _maxdiff(new, ref) < 1e-6
    assert int(state1.count) == 1
    updates, _ = tx.update(flows, state, params)
    assert _maxdiff(optax.apply_updates(params, updates), ref) < 1e-6
    p2, _ = optim.apply(tx, flows, state, params)
    assert _maxdiff(p2, new) == 0.0
    # and optim.apply runs an optax transformation the optax way
    adam = optax.adam(0.1)
    g = jax.jit(jax.grad(lambda p: optim.mean_nll(circuit.layout, circuit.tables, p, jnp.asarray(data), None, None,
                                                  jaxpc.Options())[0]))(params)
    p3, _ = optim.apply(adam, g, adam.init(params), params)
    u, _ = adam.update(g, adam.init(params), params)
    assert _maxdiff(p3, optax.apply_updates(params, u)) == 0.0


def test_em_deltas_keep_zero_weights_finite():
    mask = np.array([[0, 2], [1, 3]])
    a = jaxpc.inputs(0, 1, 2, distributions.MaskedCategorical(3, "range"), params={"mask": mask})
    root = jaxpc.summate(a, num_nodes=1)
    c = jaxpc.compile(root)
    tx = optim.em(c, 0.5, 1.0)
    x = np.array([[0], [1], [2]])
    updates, _ = tx.update(c.flows(c.params, x), tx.init(c.params), c.params)
    assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree_util.tree_leaves(updates))
    new = optax.apply_updates(c.params, updates)
    assert _maxdiff(new, c.em_step(c.params, x, step_size=0.5, pseudocount=1.0)) < 1e-6


@pytest.mark.slow
def test_anemone_is_a_per_node_proximal_em_step():
    circuit, _, data = _small_circuit()
    params = circuit.params
    xb = data[:30]
    flows = circuit.flows(params, xb)
    eta, pc = 2.0, 0.3
    tx = optim.anemone(circuit, step_size=eta, pseudocount=pc)
    new, _ = tx.step(flows, tx.init(params), params)
    # closed form, per node n with children c: (F_nc + pc / nch + (B / eta) theta_nc) / (F_n + pc + B / eta)
    lam = len(xb) / eta
    for ns in circuit.nodes:
        if ns.is_sum() and not ns.is_tied():
            th = np.asarray(circuit.get_node_params(params, ns), np.float64)
            F = np.asarray(circuit.get_node_flows(flows, ns), np.float64)
            connected = th > 0
            nch = connected.sum(1, keepdims=True)
            want = np.where(connected, F + pc / nch + lam * th, 0.0) / (F.sum(1, keepdims=True) + pc + lam)
            np.testing.assert_allclose(np.asarray(circuit.get_node_params(new, ns)), want, rtol=2e-5, atol=1e-7)
        if ns.is_input() and not ns.is_tied() and isinstance(ns.dist, distributions.Categorical):
            th = np.asarray(circuit.get_node_params(params, ns), np.float64)
            F = np.asarray(circuit.get_node_flows(flows, ns), np.float64)
            if th.ndim == 1:  # Bernoulli returns p
                continue
            K = th.shape[1]
            want = (F + pc / K + lam * th) / (F.sum(1, keepdims=True) + pc + lam)
            np.testing.assert_allclose(np.asarray(circuit.get_node_params(new, ns)), want, rtol=2e-5, atol=1e-7)
    # the batch size is read from the root flows; passing it explicitly gives the same update
    new2, _ = tx.step(flows, tx.init(params), params, num_samples=len(xb))
    assert _maxdiff(new, new2) < 1e-6


@pytest.mark.slow
def test_fit_equals_a_python_loop_of_em_steps():
    circuit, _, data = _small_circuit()
    key = jax.random.key(7)
    sched = optax.linear_schedule(0.4, 0.05, 9)
    res = optim.fit(circuit, circuit.params, data, 3, 64, step_size=sched, pseudocount=0.2, key=key, progress=False)
    params, lls, step = circuit.params, [], 0
    for e in range(3):
        idx, w = optim.epoch_batches(key, e, len(data), 64)
        idx = np.asarray(idx)
        assert w is not None and idx.shape == (3, 64)  # 150 = 64 + 64 + 22 (padded with zero weights)
        tot = 0.0
        for i in range(idx.shape[0]):
            rows = idx[i][np.asarray(w[i]) > 0]
            params, ll = circuit.em_step(params, data[rows], step_size=float(sched(step)), pseudocount=0.2,
                                         return_ll=True)
            tot += float(jnp.sum(ll))
            step += 1
        lls.append(tot / len(data))
    assert _maxdiff(res.params, params) < 2e-6
    np.testing.assert_allclose(res.epoch_ll, lls, rtol=1e-5)
    assert int(res.opt_state.count) == 9
    assert res.epoch_ll.shape == (3,) and res.epoch_ll[-1] > res.epoch_ll[0]


@pytest.mark.slow
def test_fit_reuses_its_epoch_executable_across_calls():
    """fit(epochs=1) in a loop (checkpointing every epoch) compiles its epoch once per configuration."""
    circuit, _, data = _small_circuit()
    before = circuit.cache_info().misses
    r1 = optim.fit(circuit, circuit.params, data, 1, 64, step_size=0.2, progress=False)
    r2 = optim.fit(circuit, r1.params, data, 1, 64, step_size=0.2, opt_state=r1.opt_state, start_epoch=1,
                   progress=False)
    assert circuit.cache_info().misses == before + 1  # the epoch lives in the circuit's executable cache
    both = optim.fit(circuit, circuit.params, data, 2, 64, step_size=0.2, progress=False)
    assert _maxdiff(both.params, r2.params) < 1e-6  # resumed equals uninterrupted
    assert circuit.cache_info().misses == before + 1
    optim.fit(circuit, circuit.params, data, 1, 64, step_size=0.3, progress=False)
    assert circuit.cache_info().misses == before + 2


@pytest.mark.slow
def test_fit_full_batch_em_equals_circuit_full_batch_em():
    circuit, _, data = _small_circuit()
    tx = optim.full_batch_em(circuit, num_batches=3, pseudocount=0.1)
    res = optim.fit(circuit, circuit.params, data, 2, 64, optimizer=tx, shuffle=False, progress=False)
    ref, ll0 = circuit.full_batch_em(circuit.params, data, batch_size=64, pseudocount=0.1, return_ll=True)
    ref, ll1 = circuit.full_batch_em(ref, data, batch_size=64, pseudocount=0.1, return_ll=True)
    assert _maxdiff(res.params, ref) < 1e-6
    np.testing.assert_allclose(res.epoch_ll, [float(ll0), float(ll1)], rtol=1e-5)


@pytest.mark.slow
def test_fit_with_optax_and_anemone_learn_and_stay_normalized():
    circuit, X, data = _small_circuit()
    for tx in (optax.adam(0.05), optim.anemone(circuit, step_size=1.0, pseudocount=0.1)):
        res = optim.fit(circuit, circuit.params, data, 4, 50, optimizer=tx, key=jax.random.key(1), progress=False)
        assert res.epoch_ll[-1] > res.epoch_ll[0]
        assert float(jnp.sum(jnp.exp(circuit.log_prob(res.params, X)))) == pytest.approx(1.0, abs=1e-5)


def test_fit_and_transformations_reject_bad_arguments():
    circuit, _, data = _small_circuit()
    with pytest.raises(ValueError, match="step_size"):
        optim.em(circuit, step_size=1.5)
    with pytest.raises(ValueError, match="pseudocount"):
        optim.anemone(circuit, pseudocount=-1.0)
    with pytest.raises(ValueError, match="num_batches"):
        optim.full_batch_em(circuit, num_batches=0)
    with pytest.raises(ValueError, match="with optimizer"):
        optim.fit(circuit, circuit.params, data, 1, 10, step_size=0.1, optimizer=optax.sgd(0.1))
    with pytest.raises(ValueError, match="epochs"):
        optim.fit(circuit, circuit.params, data, -1, 10)
    with pytest.raises(TypeError, match="optimizer"):
        optim.fit(circuit, circuit.params, data, 1, 10, optimizer=object())
    other = jaxpc.compile(jaxpc.summate(jaxpc.inputs(0, 1, 2, distributions.Categorical(3)), num_nodes=1))
    with pytest.raises(ValueError, match="another circuit"):
        optim.fit(circuit, circuit.params, data, 1, 10, optimizer=optim.em(other))


@pytest.mark.slow
def test_em_transformations_ignore_node_flows():
    """``Options(node_flows=True)`` adds the node totals to the flows under ``"node"``; EM reads the parameter flows
    only, so the full-batch transformation (which accumulates flows in its state) and ``fit`` with those options
    give the update of the plain flows."""
    circuit, _, data = _small_circuit()
    params = circuit.params
    tx = optim.full_batch_em(circuit, 2, pseudocount=0.1)
    plain = [circuit.flows(params, data[i:i + 20]) for i in (0, 20)]
    outs = []
    for node in (False, True):
        p, state = params, tx.init(params)
        for fl in plain:
            p, state = optim.apply(tx, {**fl, "node": fl["sum"]} if node else fl, state, p)
        outs.append(p)
    assert _maxdiff(outs[0], params) > 1e-3 and _maxdiff(outs[1], outs[0]) == 0.0
    res = optim.fit(circuit, params, data[:40], 1, 20, optimizer=tx, shuffle=False, progress=False,
                    options=jaxpc.Options(node_flows=True))
    assert _maxdiff(res.params, outs[0]) < 1e-6


def test_transformations_reject_non_finite_arguments_and_take_numpy_ints():
    circuit, _, _ = _small_circuit()
    for make, kw, name in ((optim.em, {"pseudocount": float("inf")}, "pseudocount"),
                           (optim.em, {"step_size": float("nan")}, "step_size"),
                           (optim.anemone, {"step_size": float("inf")}, "step_size"),
                           (optim.anemone, {"pseudocount": float("inf")}, "pseudocount"),
                           (functools.partial(optim.full_batch_em, num_batches=2), {"pseudocount": float("inf")},
                            "pseudocount")):
        with pytest.raises(ValueError, match=f"{name} must be finite, got (inf|nan)"):
            make(circuit, **kw)
    tx = optim.full_batch_em(circuit, np.int64(2))
    assert tx.config.num_batches == 2 and type(tx.config.num_batches) is int
    with pytest.raises(ValueError, match="num_batches must be a positive int, got True"):
        optim.full_batch_em(circuit, True)
    assert optim.sharded.data_mesh(np.int64(1)).devices.size == 1


def test_fit_names_a_bad_key_opt_state_or_mesh_batch():
    circuit, _, data = _small_circuit()
    params = circuit.params
    with pytest.raises(TypeError, match="fit: key must be a PRNG key"):
        optim.fit(circuit, params, data, 1, 10, key=0, progress=False)
    with pytest.raises(ValueError, match=r"opt_state is not a state of this optimizer \(got tuple, expected EMState\)"):
        optim.fit(circuit, params, data, 1, 10, opt_state=optax.adam(0.1).init(params), progress=False)
    with pytest.raises(ValueError, match=r"\(got dict, expected EMState\).*optimizer.init\(params\) as its template"):
        optim.fit(circuit, params, data, 1, 10, opt_state={"count": np.int32(3)}, progress=False)
    with pytest.raises(ValueError, match=r"\(got EMState, expected tuple\)"):
        optim.fit(circuit, params, data, 1, 10, optimizer=optax.adam(0.1), opt_state=optim.em(circuit).init(params),
                  progress=False)
    tx = optim.full_batch_em(circuit, 15)  # (150 rows in batches of 10)
    state = tx.init(params)
    state = state._replace(flows=jax.tree_util.tree_map(lambda a: a[..., :1], state.flows))
    with pytest.raises(ValueError, match=r"opt_state.flows\[.*has shape"):
        optim.fit(circuit, params, data, 1, 10, optimizer=tx, opt_state=state, progress=False)
    if len(jax.devices()) >= 4:
        mesh = optim.sharded.data_mesh(4)
        with pytest.raises(ValueError, match="fit: batch_size=6 must be a multiple of the 4 devices"):
            optim.fit(circuit, params, data[:30], 1, 6, mesh=mesh, progress=False)


def test_fit_with_validate_sync_checks_the_params():
    """``fit(validate="sync")`` checks the parameters' values before training, as ``em_step``'s does: a NaN
    parameter raises a ``ValueError`` naming it (not a NaN epoch after a whole run)."""
    circuit, _, data = _small_circuit()
    g = next(iter(circuit.params["sum"]))
    bad = {**circuit.params, "sum": {**circuit.params["sum"], g: circuit.params["sum"][g].at[0, 0, 1].set(jnp.nan)}}
    with pytest.raises(ValueError, match=rf"params\['sum'\]\['{g}'\]\[0, 0, 1\] is nan \(fit, checked with "
                                         r"validate='sync'\)"):
        optim.fit(circuit, bad, data, 1, 64, validate="sync", progress=False)
