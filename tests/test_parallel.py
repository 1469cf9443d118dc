"""jaxpc.parallel on 2, 3 and 4 fake CPU devices (conftest sets --xla_force_host_platform_device_count=4):
data-parallel flows, EM and gradient steps equal one device's, with and without per-call evidence, under
shard_map and under jax.pmap, and flows are summed exactly once."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpc
from jaxpc import distributions, optim, parallel, structures
from jaxpc.engine import em

from .test_optim import _maxdiff, _small_circuit
from .tiers import cases

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 (fake) devices")


def _rel(a, b):
    """Largest difference relative to the largest magnitude of each leaf."""
    out = 0.0
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        fin = np.isfinite(u) & np.isfinite(v)
        assert np.array_equal(np.isfinite(u), np.isfinite(v))
        if fin.any():
            out = max(out, float(np.max(np.abs(u - v)[fin]) / max(np.max(np.abs(u[fin])), 1.0)))
    return out


def _root_flow(circuit, flows):
    pl = circuit.structure.sum_placement[circuit.root.source.id]
    return float(np.asarray(flows["sum"][pl.group])[pl.start:pl.start + pl.num_edge_blocks].sum())


@pytest.fixture(scope="module")
def hmm():
    root = structures.HMM(5, 4, 6, homogeneous=False)
    circuit = jaxpc.compile(root, seed=3)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 6, size=(30, 5)).astype(np.int32)  # 30 rows: padded on 4 devices
    missing = rng.random((30, 5)) < 0.2
    return circuit, data, missing


@pytest.mark.parametrize("n", cases([2, 4], fast=[2]))
@pytest.mark.slow
def test_flows_and_em_step_equal_one_device(hmm, n):
    circuit, data, missing = hmm
    mesh = parallel.data_mesh(n)
    assert mesh.shape == {"data": n}
    params = circuit.params
    ref, ll_ref = circuit.flows(params, data, missing, return_ll=True)
    fl, ll = parallel.flows(circuit, params, data, missing, mesh=mesh, return_ll=True)
    assert _rel(fl, ref) < 1e-5
    np.testing.assert_allclose(ll, ll_ref, rtol=1e-5)
    # each sample sends a flow of exactly one through the root: a doubled (or missing) psum shows here
    assert _root_flow(circuit, fl) == pytest.approx(len(data), rel=1e-5)
    new = parallel.em_step(circuit, params, data, missing, mesh=mesh, step_size=0.7, pseudocount=0.1)
    want = circuit.em_step(params, data, missing, step_size=0.7, pseudocount=0.1)
    assert _maxdiff(new, want) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["device", "numpy"])
@pytest.mark.full
def test_a_repeated_step_replays_its_executable(hmm, kind):
    """A data-parallel step that repeats the previous one's options on a batch of the same kind and shape runs that
    step's executable again without the call path's checks and key (``Runtime.replay``): the same results as one
    device's, numpy batches still checked on the host, other step sizes and optimizer states taken anew, and the
    full call again for another batch size or the first call with a mask."""
    circuit, data, missing = hmm
    c = jaxpc.compile(circuit.root, seed=3)
    mesh = parallel.data_mesh(2)
    full = []
    prepare = c.runtime.prepare
    c.runtime.prepare = lambda *a, **k: full.append(1) or prepare(*a, **k)
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    tx = optax.adam(1e-2)
    want = jax.jit(optim.make_step(circuit.layout, tx))
    put = np.asarray if kind == "numpy" else (lambda a: jax.device_put(jnp.asarray(a), sharded))
    xs = [put(data[i:i + 8]) for i in (0, 8, 16)]
    state = tx.init(c.params)
    for k, x in enumerate(xs):
        step, pc = (0.7, 0.1) if k < 2 else (0.5, 0.0)
        fl, ll = parallel.flows(c, c.params, x, mesh=mesh, return_ll=True)
        ref, ll_ref = circuit.flows(circuit.params, np.asarray(x), return_ll=True)
        assert _rel(fl, ref) < 1e-5
        np.testing.assert_allclose(ll, ll_ref, rtol=1e-5)
        new = parallel.em_step(c, c.params, x, mesh=mesh, step_size=step, pseudocount=pc)
        assert _maxdiff(new, circuit.em_step(circuit.params, np.asarray(x), step_size=step, pseudocount=pc)) < 1e-5
        p1, s1, _ = parallel.train_step(c, tx, c.params, state, x, mesh=mesh)
        p2, s2, _ = parallel.train_step(c, tx, p1, s1, x, mesh=mesh)  # a new state replays too
        q1, t1, _ = want(circuit.tables, circuit.params, state, jnp.asarray(x), None, jnp.ones(8), None)
        q2, _, _ = want(circuit.tables, q1, t1, jnp.asarray(x), None, jnp.ones(8), None)
        assert _rel(p2, q2) < 1e-5
        if k == 0:
            count = len(full)
    assert len(full) == count, "the repeated steps took the full call"
    bad = data[:8].copy()
    bad[2, 1] = 9
    with pytest.raises(ValueError, match="out of range"):  # numpy: checked on the host, replayed or not
        parallel.em_step(c, c.params, bad, mesh=mesh, step_size=0.7, pseudocount=0.1)
    count = len(full)
    parallel.flows(c, c.params, data[:6], mesh=mesh)
    parallel.flows(c, c.params, data[:8], missing[:8], mesh=mesh)
    for i in (8, 16):  # masked steps replay too
        fl = parallel.flows(c, c.params, data[i:i + 8], missing[i:i + 8], mesh=mesh)
        assert _rel(fl, circuit.flows(circuit.params, data[i:i + 8], missing[i:i + 8])) < 1e-5
    assert len(full) == count + 2


@pytest.mark.slow
def test_vma_checked_gradients_are_already_summed():
    """The fact the module relies on: with check_vma=True the gradient of replicated parameters is summed
    over the axis already, so a psum on top would double the flows; check_vma=False needs exactly one."""
    from jax.sharding import PartitionSpec as P

    circuit, _, data = _small_circuit()
    mesh = parallel.data_mesh(2)
    x = jnp.asarray(data[:40])
    # plain autodiff: the engine's custom VJP declares no varying-axis types, so it needs check_vma=False
    opts = jaxpc.Options(backward="autodiff")

    def body(tables, params, x):
        return jax.lax.psum(em.flows_and_ll(circuit.layout, tables, params, x, None, None, opts)[0], "data")

    doubled = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P()))(
        circuit.tables, circuit.params, x)
    assert _root_flow(circuit, doubled) == pytest.approx(2 * 40, rel=1e-5)
    fl = parallel.flows(circuit, circuit.params, data[:40], mesh=mesh)
    assert _root_flow(circuit, fl) == pytest.approx(40, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("n", [4])
def test_gradient_and_optax_steps_equal_one_device(n):
    circuit, _, data = _small_circuit()
    mesh = parallel.data_mesh(n)
    logits = jax.tree_util.tree_map(lambda a: a * 1.3, circuit.params)  # unnormalized
    x = jnp.asarray(data[:50])
    loss_ref, g_ref = jax.jit(jax.value_and_grad(
        lambda p: optim.mean_nll(circuit.layout, circuit.tables, p, x, None, None, jaxpc.Options())[0]))(logits)
    loss, g = parallel.loss_and_grad(circuit, logits, data[:50], mesh=mesh)
    assert float(loss) == pytest.approx(float(loss_ref), rel=1e-5)
    assert _rel(g, g_ref) < 1e-5
    tx = optax.adam(0.05)
    state = tx.init(circuit.params)
    p1, s1, _ = parallel.train_step(circuit, tx, circuit.params, state, data[:50], mesh=mesh)
    step = jax.jit(optim.make_step(circuit.layout, tx))
    p2, s2, _ = step(circuit.tables, circuit.params, state, x, None, None)
    assert _maxdiff(p1, p2) < 1e-5


@pytest.mark.slow
def test_sharded_loss_derivative_in_a_zero_weight_equals_one_device():
    """The split loss's derivative in the samples' weights, zero weights included, equals ``mean_nll``'s on one
    device: a zero weight is not masked (its derivative is the row's ll over the total weight)."""
    circuit, _, data = _small_circuit()
    mesh = parallel.data_mesh(4)
    x = jnp.asarray(data[:16])
    w = jnp.asarray(np.r_[np.zeros(5), np.linspace(0.5, 2.0, 11)])
    opts = jaxpc.Options()
    split = parallel.sharded_loss_and_grad(circuit.layout, mesh, opts, None)
    g = jax.jit(jax.grad(lambda w: split(circuit.tables, circuit.params, x, w)[0][0]))(w)
    g_ref = jax.jit(jax.grad(lambda w: optim.mean_nll(circuit.layout, circuit.tables, circuit.params, x, None, w,
                                                      opts)[0]))(w)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-5, atol=1e-6)
    ll = np.asarray(circuit.log_prob(circuit.params, x), np.float64)
    loss = -(np.asarray(w) @ ll) / np.sum(w)
    np.testing.assert_allclose(np.asarray(g), (-ll - loss) / np.sum(w), rtol=1e-4, atol=1e-6)  # closed form


@pytest.mark.slow
def test_fit_on_a_mesh_equals_fit_on_one_device():
    circuit, _, data = _small_circuit()
    kw = dict(step_size=0.3, pseudocount=0.1, key=jax.random.key(2), progress=False)
    one = optim.fit(circuit, circuit.params, data, 2, 40, **kw)
    four = optim.fit(circuit, circuit.params, data, 2, 40, mesh=parallel.data_mesh(4), **kw)
    assert _maxdiff(one.params, four.params) < 1e-5
    np.testing.assert_allclose(one.epoch_ll, four.epoch_ll, rtol=1e-5)
    with pytest.raises(ValueError, match="multiple of the 4 devices"):
        optim.fit(circuit, circuit.params, data, 1, 30, mesh=parallel.data_mesh(4), **kw)


def test_data_mesh_rejects_bad_sizes():
    with pytest.raises(ValueError, match="num_devices"):
        parallel.data_mesh(len(jax.devices()) + 1)
    with pytest.raises(ValueError, match="num_devices"):
        parallel.data_mesh(0)


@pytest.mark.parametrize("options, match", [(jaxpc.Options(negate_flows=True), "not negated flows"),
                                             (jaxpc.Options(logspace_flows=True), "gives log flows")])
def test_every_em_step_refuses_flows_its_update_cannot_take(hmm, options, match):
    """EM's update takes linear, unnegated flows: each entry point that runs one raises on options that give
    other flows (negated flows would turn the counts' signs; log flows would be read as counts)."""
    circuit, data, _ = hmm
    mesh = parallel.data_mesh(2)
    x = data[:8]
    tx = optim.em(circuit, 0.1, 0.1)
    calls = [("em_step", lambda: circuit.em_step(circuit.params, x, options=options)),
             ("em_step", lambda: em.em_step(circuit.layout, circuit.tables, circuit.params, jnp.asarray(x), None, None,
                                            0.1, 0.0, options)),
             ("parallel.em_step", lambda: parallel.em_step(circuit, circuit.params, x, mesh=mesh, options=options)),
             ("an EM training step", lambda: parallel.train_step(circuit, tx, circuit.params, tx.init(circuit.params),
                                                                 x, mesh=mesh, options=options)),
             ("an EM training step", lambda: optim.fit(circuit, circuit.params, data, 1, 8, options=options,
                                                       progress=False))]
    for where, call in calls:  # each error names the step
        with pytest.raises(ValueError, match=f"{where}.*{match}"):
            call()


@pytest.mark.parametrize("kind", cases(["em", "adam"], fast=["adam"]))
def test_steady_state_step_moves_nothing_but_the_data(hmm, kind):
    """After the first call, a data-parallel step runs under jax.transfer_guard("disallow"): the index
    tables and the weights stay on the mesh (passed from one device, the tables' hundreds of small
    arrays would be copied to every device on every call)."""
    circuit, data, _ = hmm
    mesh = parallel.data_mesh(2)
    x = jax.device_put(jnp.asarray(data[:8]), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    tx = optim.em(circuit, 0.1, 0.1) if kind == "em" else optax.adam(1e-2)
    params, state, _ = parallel.train_step(circuit, tx, circuit.params, tx.init(circuit.params), x, mesh=mesh,
                                           validate=False)
    with jax.transfer_guard("disallow"):
        params, state, ll = parallel.train_step(circuit, tx, params, state, x, mesh=mesh, validate=False)
        fl = parallel.flows(circuit, params, x, mesh=mesh, validate=False)
    assert np.isfinite(np.asarray(ll)).all()
    assert _root_flow(circuit, fl) == pytest.approx(8.0, rel=1e-5)


@pytest.mark.slow
def test_auto_impl_kernels_under_shard_map(pallas_forward_calls):
    """With the GPU rule on (the Pallas kernels in interpret mode here), the default options run the in-place
    Pallas forward, keeping its shifts, inside ``shard_map``: data-parallel flows and gradients equal one
    device's XLA path."""
    calls = pallas_forward_calls
    root = structures.PD((6, 6), 4, split_intervals=(2, 2), input_dist=jaxpc.distributions.Categorical(3))
    data = np.random.default_rng(2).integers(0, 3, (12, 36)).astype(np.int32)
    c, ref = jaxpc.compile(root, seed=4), jaxpc.compile(root, seed=4)
    assert any(p.C > 1 and not p.dense for s in c.layout.fold.stages() for p in s.sums)
    xla = jaxpc.Options(impl="xla")
    mesh = parallel.data_mesh(2)
    fl, ll = parallel.flows(c, c.params, data, mesh=mesh, return_ll=True)
    assert calls and all(o is not None for o in calls)
    fl_ref, ll_ref = ref.flows(ref.params, data, options=xla, return_ll=True)
    np.testing.assert_allclose(ll, ll_ref, rtol=1e-5)
    assert _rel(fl, fl_ref) < 1e-5
    loss, g = parallel.loss_and_grad(c, c.params, data, mesh=mesh)
    loss_ref, g_ref = jax.jit(jax.value_and_grad(
        lambda p: optim.mean_nll(ref.layout, ref.tables, p, jnp.asarray(data), None, None, xla)[0]))(ref.params)
    assert float(loss) == pytest.approx(float(loss_ref), rel=1e-5)
    assert _rel(g, g_ref) < 1e-5


# ---- per-call evidence (CoDD: soft evidence per batch) ------------------------------------------------

@pytest.fixture(scope="module")
def soft_hmm():
    """A GeneralizedHMM over SoftEvidenceCategorical leaves, 30 samples (not a multiple of 4: padded), and their
    dense and top-k evidence."""
    T, L, V, B, k = 5, 4, 7, 30, 3
    c = jaxpc.compile(structures.GeneralizedHMM(T, L, distributions.SoftEvidenceCategorical(V), homogeneous=False,
                                                block_size=2), seed=2)
    rng = np.random.default_rng(5)
    x = rng.integers(0, V, (B, T)).astype(np.int32)
    # k distinct candidates per position, the observed token first
    offsets = np.argsort(rng.random((B, T, V - 1)), axis=2)[:, :, :k - 1] + 1
    ids = ((x[:, :, None] + np.concatenate([np.zeros((B, T, 1), int), offsets], axis=2)) % V).astype(np.int32)
    evidence = {"dense": {"categorical_logp": rng.normal(size=(B, T, V)).astype(np.float32)},
                "topk": {"categorical_topk": {"ids": ids, "logp": rng.normal(size=(B, T, k)).astype(np.float32)}}}
    return c, x, evidence


def _rows(evidence, rows):
    return jax.tree_util.tree_map(lambda a: a[rows], evidence)


def _misses(circuit):
    return circuit.cache_info().misses


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "topk"])
def test_evidence_flows_and_em_step_equal_one_device(soft_hmm, kind):
    """Evidence is split over the mesh with the batch and padded with it (30 rows on 4 devices: bucket 32), and
    two batch sizes of one bucket share one executable."""
    circuit, x, evs = soft_hmm
    ev = evs[kind]
    mesh = parallel.data_mesh(4)
    params = circuit.params
    ref, ll_ref = circuit.flows(params, x, evidence=ev, return_ll=True)
    assert _rel(ref, circuit.flows(params, x)) > 1e-2  # the evidence changes the flows
    fl, ll = parallel.flows(circuit, params, x, mesh=mesh, evidence=ev, return_ll=True)
    assert _rel(fl, ref) < 1e-5
    np.testing.assert_allclose(ll, ll_ref, rtol=1e-5)
    assert _root_flow(circuit, fl) == pytest.approx(len(x), rel=1e-5)
    # 27 rows: the same bucket, the same executable
    before = circuit.cache_info()
    fl27 = parallel.flows(circuit, params, x[:27], mesh=mesh, evidence=_rows(ev, slice(0, 27)))
    after = circuit.cache_info()
    assert (after.misses, after.hits) == (before.misses, before.hits + 1)
    assert _rel(fl27, circuit.flows(params, x[:27], evidence=_rows(ev, slice(0, 27)))) < 1e-5
    new, ll = parallel.em_step(circuit, params, x, mesh=mesh, evidence=ev, step_size=0.7, pseudocount=0.1,
                               return_ll=True)
    want = circuit.em_step(params, x, evidence=ev, step_size=0.7, pseudocount=0.1)
    assert _maxdiff(new, want) < 1e-5
    np.testing.assert_allclose(ll, ll_ref, rtol=1e-5)


def test_evidence_is_checked_like_circuit_flows(soft_hmm):
    circuit, x, evs = soft_hmm
    mesh = parallel.data_mesh(2)
    dense = evs["dense"]["categorical_logp"]
    with pytest.raises(ValueError, match=r"evidence\['categorical_logp'\] must have 3 axes with the batch \(30\)"):
        parallel.flows(circuit, circuit.params, x, mesh=mesh, evidence={"categorical_logp": dense[:20]})
    with pytest.raises(ValueError, match=r"unknown evidence key\(s\) \['soft'\]"):
        parallel.em_step(circuit, circuit.params, x, mesh=mesh, evidence={"soft": dense})
    topk = evs["topk"]["categorical_topk"]
    with pytest.raises(ValueError, match=r"categorical_topk.logp.*must have shape \[30, 5, 3\]"):
        parallel.loss_and_grad(circuit, circuit.params, x, mesh=mesh,
                               evidence={"categorical_topk": {"ids": topk["ids"], "logp": topk["logp"][..., :2]}})
    with pytest.raises(ValueError, match=r"evidence\['categorical_logp'\] must have 3 axes with the batch \(8\)"):
        parallel.split_batch(circuit, x[:8], evidence={"categorical_logp": dense}, num_devices=2)
    with pytest.raises(ValueError, match="num_devices"):
        parallel.split_batch(circuit, x, num_devices=0)


@pytest.mark.slow
def test_compile_after_fallback_pads_the_evidence(soft_hmm):
    """With compile_after=2 an early sighting of a small bucket runs on the live executable of a larger one: its
    evidence is padded with the batch. On 3 devices the larger bucket is a multiple of 3 (33 rows), not 32."""
    _, x, evs = soft_hmm
    ev = evs["topk"]
    circuit = jaxpc.compile(structures.GeneralizedHMM(5, 4, distributions.SoftEvidenceCategorical(7), homogeneous=False,
                                                      block_size=2), seed=2, compile_after=2)
    mesh = parallel.data_mesh(3)
    parallel.flows(circuit, circuit.params, x, mesh=mesh, evidence=ev)  # compiles bucket 33 (none larger)
    assert _misses(circuit) == 1
    small = _rows(ev, slice(0, 5))
    ref, ll_ref = circuit.flows(circuit.params, x[:5], evidence=small, return_ll=True)
    misses = _misses(circuit)
    fl, ll = parallel.flows(circuit, circuit.params, x[:5], mesh=mesh, evidence=small, return_ll=True)
    assert _misses(circuit) == misses  # the first sighting of bucket 9 ran on bucket 33
    assert _rel(fl, ref) < 1e-5
    np.testing.assert_allclose(ll, ll_ref, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.full  # (in CI: test_evidence.py's evidence checked in parallel and fit)
@pytest.mark.parametrize("optimizer", ["em", "adam"])
def test_gradient_and_train_steps_take_evidence(soft_hmm, optimizer):
    circuit, x, evs = soft_hmm
    ev = evs["topk"]
    mesh = parallel.data_mesh(4)
    logits = jax.tree_util.tree_map(lambda a: a * 1.3, circuit.params)
    checked = circuit.check_evidence(ev, len(x))
    loss_ref, g_ref = jax.jit(jax.value_and_grad(lambda p: optim.mean_nll(
        circuit.layout, circuit.tables, p, jnp.asarray(x), None, None, jaxpc.Options(), evidence=checked)[0]))(logits)
    loss, g = parallel.loss_and_grad(circuit, logits, x, mesh=mesh, evidence=ev)
    assert float(loss) == pytest.approx(float(loss_ref), rel=1e-5)
    assert _rel(g, g_ref) < 1e-5
    tx = optax.adam(0.05) if optimizer == "adam" else optim.em(circuit, 0.5, 0.1)
    state = tx.init(circuit.params)
    p1, _, ll1 = parallel.train_step(circuit, tx, circuit.params, state, x, mesh=mesh, evidence=ev)
    p2, _, ll2 = jax.jit(optim.make_step(circuit.layout, tx))(circuit.tables, circuit.params, state,
                                                               jnp.asarray(x), None, None, checked)
    assert _maxdiff(p1, p2) < 1e-5
    np.testing.assert_allclose(ll1, ll2, rtol=1e-5)


@pytest.mark.parametrize("n", cases([None, 2], fast=[2]))
@pytest.mark.slow
def test_fit_indexes_evidence_with_the_batch_rows(soft_hmm, n):
    """fit's evidence holds every sample's; each batch takes its rows (a Python loop of em_step on the same
    batches and their evidence is the reference), on one device and on a mesh."""
    circuit, x, evs = soft_hmm
    ev = evs["topk"]
    key = jax.random.key(3)
    mesh = None if n is None else parallel.data_mesh(n)
    res = optim.fit(circuit, circuit.params, x, 1, 8, step_size=0.5, pseudocount=0.1, key=key, mesh=mesh,
                    evidence=ev, progress=False)
    idx, w = optim.epoch_batches(key, 0, len(x), 8)
    params = circuit.params
    for rows, wr in zip(np.asarray(idx), np.asarray(w)):
        rows = rows[wr > 0]
        params = circuit.em_step(params, x[rows], evidence=_rows(ev, rows), step_size=0.5, pseudocount=0.1)
    assert _maxdiff(res.params, params) < 1e-5
    with pytest.raises(ValueError, match=r"must have 3 axes with the batch \(30\)"):
        optim.fit(circuit, circuit.params, x, 1, 8, evidence=_rows(ev, slice(0, 8)), progress=False)


# ---- jax.pmap: the documented recipe (docs/design.md, "Multiple GPUs") ---------------------------------

@pytest.mark.parametrize("n", cases([4, 2], fast=[4]))
@pytest.mark.slow
def test_pmap_step_from_the_engine_equals_one_device(soft_hmm, n):
    """Flows and one EM step under ``jax.pmap``, written with the engine's pure functions and one psum, on a
    batch laid out by ``parallel.split_batch`` (30 rows: padded), equal one device's."""
    circuit, x, evs = soft_hmm
    ev = evs["topk"]
    opts = jaxpc.Options()

    def step(tables, params, x, weights, evidence):  # one device's share of the batch
        fl, ll = em.flows_and_ll(circuit.layout, tables, params, x, None, weights, opts, evidence)
        fl = jax.lax.psum(fl, "data")
        return fl, em.em_update(circuit.layout, tables, params, fl, 0.7, 0.1), ll

    pstep = jax.pmap(step, axis_name="data", in_axes=(None, None, 0, 0, 0), out_axes=(None, None, 0))
    b = parallel.split_batch(circuit, x, evidence=ev, num_devices=n)
    assert b.x.shape == (n, 32 // n, x.shape[1]) and b.n == len(x)
    assert float(np.asarray(b.weights).sum()) == len(x)
    fl, new, ll = pstep(circuit.tables, circuit.params, b.x, b.weights, b.evidence)
    ref, ll_ref = circuit.flows(circuit.params, x, evidence=ev, return_ll=True)
    assert _rel(fl, ref) < 1e-5
    assert _root_flow(circuit, fl) == pytest.approx(len(x), rel=1e-5)  # summed exactly once
    np.testing.assert_allclose(np.asarray(ll).reshape(-1)[:b.n], ll_ref, rtol=1e-5)
    want = circuit.em_step(circuit.params, x, evidence=ev, step_size=0.7, pseudocount=0.1)
    assert _maxdiff(new, want) < 1e-5


@pytest.mark.slow
@pytest.mark.full
def test_circuit_methods_run_where_their_params_were_put(hmm):
    """Parameters trained over a mesh (replicated there) run the circuit's own methods where they are, with the
    same answers as on the default device."""
    circuit, data, _ = hmm
    c = jaxpc.compile(circuit.root, seed=3)
    trained = parallel.em_step(c, c.params, data[:28], mesh=parallel.data_mesh(4), step_size=0.5)
    host = jax.device_get(trained)
    assert len(jax.tree_util.tree_leaves(trained)[0].sharding.device_set) == 4
    for f in (lambda p: c.log_prob(p, data), lambda p: c.flows(p, data), lambda p: c.em_step(p, data),
              lambda p: c.sample(p, jax.random.key(0), 5), lambda p: c.mpe(p, data)[1],
              lambda p: optim.fit(c, p, data, 1, 8, progress=False).params):
        assert _rel(f(trained), f(host)) < 1e-6


def test_circuit_methods_run_where_their_data_was_put(hmm):
    """Data committed to another device runs the circuit's own methods there, with the same answers as on the
    default device; a batch split over devices and data and parameters on different devices are named errors.
    (Parameters trained over a mesh: the slow tier's ``test_circuit_methods_run_where_their_params_were_put``.)"""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    circuit, data, _ = hmm
    c = jaxpc.compile(circuit.root, seed=3)
    x1 = jax.device_put(data, jax.devices()[1])
    ll = c.log_prob(c.params, x1)
    assert ll.sharding.device_set == {jax.devices()[1]}
    np.testing.assert_array_equal(np.asarray(ll), np.asarray(c.log_prob(c.params, data)))
    split = jax.device_put(data[:28], NamedSharding(parallel.data_mesh(4), P("data")))
    with pytest.raises(ValueError, match=r"x is split over devices \[0, 1, 2, 3\].*jaxpc.parallel"):
        c.log_prob(c.params, split)
    with pytest.raises(ValueError, match="committed to different devices"):
        c.log_prob(jax.device_put(c.params, jax.devices()[2]), x1)


def test_a_split_batch_leaves_the_next_batch_of_its_size_on_one_device(hmm):
    """A call on a batch split over a mesh, padded to its bucket, does not hand its padding executable to the next
    call of the same size on one device (which would split that batch over the mesh too)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    circuit, data, _ = hmm
    c = jaxpc.compile(circuit.root, seed=3)
    split = jax.device_put(data[:28], NamedSharding(parallel.data_mesh(4), P("data")))
    parallel.flows(c, c.params, split)
    for x in (data[:28], jnp.asarray(data[:28])):
        ll = c.log_prob(c.params, x)
        assert len(ll.sharding.device_set) == 1
        np.testing.assert_array_equal(np.asarray(ll), np.asarray(circuit.log_prob(circuit.params, data[:28])))


@pytest.mark.slow
def test_a_batch_split_over_the_mesh_then_one_that_is_not(hmm):
    """The input check's flag executable is kept per sharding: a padded batch split over the mesh, then one on
    a single device with weights split over the mesh (padded to a replicated batch), both run and agree."""
    from jax.sharding import NamedSharding, PartitionSpec

    c, data, _ = hmm
    mesh = parallel.data_mesh(2)
    split = NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))
    x = data[:2]
    w = jax.device_put(jnp.asarray([1.0, 2.0]), split)
    a = parallel.flows(c, c.params, jax.device_put(jnp.asarray(x), split), mesh=mesh, ll_weights=w)
    b = parallel.flows(c, c.params, jnp.asarray(x), mesh=mesh, ll_weights=w)
    c.raise_pending()
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-6, atol=1e-7)


def test_steps_name_arrays_committed_off_their_mesh(hmm):
    """Data or parameters committed to devices other than the mesh's (a batch put on one device, parameters trained
    over another mesh) are named errors of the data-parallel steps and of fit, whatever the batch size."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    c, data, _ = hmm
    m4, m23 = parallel.data_mesh(4), parallel.data_mesh(devices=jax.devices()[2:4])
    x1 = jax.device_put(data[:16], jax.devices()[1])
    with pytest.raises(ValueError, match=r"x is committed to devices \[1\], but the mesh is over devices \[0, 1, 2"):
        parallel.flows(c, c.params, x1, mesh=m4)
    trained = jax.device_put(c.params, NamedSharding(m23, P()))
    with pytest.raises(ValueError, match=r"params is committed to devices \[2, 3\].*NamedSharding\(mesh, P\(\)\)"):
        parallel.em_step(c, trained, data[:13], mesh=m4)
    with pytest.raises(ValueError, match=r"x is committed to devices \[1\], but the mesh is over devices \[2, 3\]"):
        optim.fit(c, c.params, x1, 1, 4, mesh=m23, progress=False)


def test_circuit_methods_run_where_their_mask_was_put(hmm):
    """A missing mask committed to a device places the call there as data does, and a mask and data committed to
    different devices are a named error."""
    circuit, data, missing = hmm
    c = jaxpc.compile(circuit.root, seed=3)
    x, m = data[:16], missing[:16]
    m1 = jax.device_put(m, jax.devices()[1])
    ll = c.log_prob(c.params, x, m1)
    assert ll.sharding.device_set == {jax.devices()[1]}
    np.testing.assert_array_equal(np.asarray(ll), np.asarray(c.log_prob(c.params, x, m)))
    with pytest.raises(ValueError, match=r"x and missing are committed to different devices \(\[2\] and \[1\]\)"):
        c.em_step(c.params, jax.device_put(x, jax.devices()[2]), m1)
