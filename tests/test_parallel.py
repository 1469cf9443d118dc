"""jaxpc.parallel on 2 and 4 fake CPU devices (conftest sets --xla_force_host_platform_device_count=4):
data-parallel flows, EM and gradient steps equal one device's, and flows are summed exactly once."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpc
from jaxpc import optim, parallel, structures

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


def test_vma_checked_gradients_are_already_summed():
    """The fact the module relies on: with check_vma=True the gradient of replicated parameters is summed
    over the axis already, so a psum on top would double the flows; check_vma=False needs exactly one."""
    from jax.sharding import PartitionSpec as P

    from jaxpc.engine import em

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
    loss_ref, g_ref = jax.value_and_grad(
        lambda p: optim.mean_nll(ref.layout, ref.tables, p, jnp.asarray(data), None, None, xla)[0])(ref.params)
    assert float(loss) == pytest.approx(float(loss_ref), rel=1e-5)
    assert _rel(g, g_ref) < 1e-5
