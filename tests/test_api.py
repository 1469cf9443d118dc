"""The public API as a user meets it: the README example, parameters in and out, tying, scans,
and composition with jit / vmap / grad."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc import distributions
from jaxpc.compiler.layout import ScanSpec

from . import oracle


def test_readme_quick_start():
    a = jaxpc.inputs(0, num_node_blocks=2, block_size=4, dist=distributions.Categorical(num_cats=5))
    b = jaxpc.inputs(1, num_node_blocks=2, block_size=4, dist=distributions.Categorical(num_cats=5))
    m = jaxpc.multiply(a, b)
    root = jaxpc.summate(m, num_node_blocks=1, block_size=1)
    circuit = jaxpc.compile(root)
    params = circuit.params
    params = circuit.init_params(jax.random.key(0))
    x = np.asarray(list(itertools.product(range(5), range(5))), dtype=np.int32)
    ll = circuit.log_prob(params, x)
    assert ll.shape == (25,) and abs(float(jnp.exp(ll).sum()) - 1) < 1e-5
    mask = np.zeros((25, 2), bool)
    mask[:, 1] = True
    ll_m = circuit.log_prob(params, x, missing=mask)
    np.testing.assert_allclose(np.exp(ll_m[::5]), np.exp(ll).reshape(5, 5).sum(1), rtol=1e-5)
    mp = circuit.log_prob(params, x, propagation="MPE")
    assert np.all(np.asarray(mp) <= np.asarray(ll) + 1e-6)
    flows = circuit.flows(params, x)
    assert jax.tree_util.tree_structure(flows["sum"]) == jax.tree_util.tree_structure(params["sum"])
    new = circuit.em_step(params, x, step_size=0.1, pseudocount=0.1)
    assert np.asarray(circuit.get_node_params(new, root)).sum() == pytest.approx(1.0, abs=1e-5)


def test_init_params_is_random_and_normalized():
    a = jaxpc.inputs(0, 3, 2, distributions.Categorical(4))
    b = jaxpc.inputs(1, 3, 2, distributions.Categorical(4))
    root = jaxpc.summate(jaxpc.multiply(a, b), num_nodes=1)
    c = jaxpc.compile(root)
    p1, p2 = c.init_params(jax.random.key(1)), c.init_params(jax.random.key(2))
    assert not np.allclose(np.asarray(c.get_node_params(p1, a)), np.asarray(c.get_node_params(p2, a)))
    for p in (p1, p2, c.params):
        np.testing.assert_allclose(np.asarray(c.get_node_params(p, a)).sum(1), 1, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(c.get_node_params(p, root)).sum(1), 1, rtol=1e-5)
    # compile's seed gives reproducible initial params
    c2 = jaxpc.compile(root, seed=0)
    c3 = jaxpc.compile(root, seed=0)
    np.testing.assert_array_equal(np.asarray(c2.params["sum"]["1x2"]), np.asarray(c3.params["sum"]["1x2"]))


def _log_weights_reference(rng, shape, dtype, seg=None, num_segments=0, mask=None):
    """One sequential draw, normalized over the whole array at once (the formula of host_init.log_weights)."""
    w = rng.uniform(0.0, 1.0, int(np.prod(shape))).astype(dtype).reshape(shape)
    w = np.exp(-2.0 * w)
    if mask is not None:
        w = np.where(mask, w, 0.0)
    if seg is None:
        tot = w.sum(axis=1, keepdims=True)
    else:
        tot = np.zeros((num_segments, shape[1]), w.dtype)
        np.add.at(tot, seg, w.sum(axis=2))
        tot = tot[seg][:, :, None]
    with np.errstate(divide="ignore"):
        return np.log(w / tot)


@pytest.mark.parametrize("chunk,threads", [(1, 3), (40, 2), (1 << 20, 4)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_host_log_weights_equal_one_sequential_draw(monkeypatch, chunk, threads, dtype):
    """Chunks drawn from jumped copies of the generator on several threads give the sequential draw's bits, with
    segments inside and across chunks, masks, and the generator left where the sequential draw leaves it."""
    from jaxpc.distributions import host_init
    monkeypatch.setattr(host_init, "CHUNK", chunk)
    monkeypatch.setattr(host_init, "num_threads", lambda: threads)
    rng = np.random.default_rng(0)
    seg = np.concatenate([np.repeat(np.arange(12), rng.integers(1, 4, 12)), rng.integers(12, 16, 30),
                          np.arange(16, 20)])
    mask = rng.random((50, 7)) < 0.7
    mask[:, 0] = True
    cases = [((seg.size, 3, 5), dict(seg=seg, num_segments=21)), ((50, 7), dict(mask=mask)), ((50, 7), {}),
             ((4, 1, 1), dict(seg=np.zeros(4, np.int64), num_segments=1))]
    for shape, kw in cases:
        a, b = np.random.default_rng(7), np.random.default_rng(7)
        a.integers(0, 5, 3, dtype=np.int32)  # a cached 32-bit half stays for the next 32-bit draw
        b.integers(0, 5, 3, dtype=np.int32)
        assert a.bit_generator.state["has_uint32"] == 1
        got = host_init.log_weights(a, shape, dtype, **kw)
        want = _log_weights_reference(b, shape, dtype, **kw)
        assert got.dtype == dtype and got.ctypes.data % 64 == 0
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
        assert a.bit_generator.state == b.bit_generator.state
        assert a.integers(0, 2**31, 5, dtype=np.int32).tolist() == b.integers(0, 2**31, 5, dtype=np.int32).tolist()


def test_node_params_compile_once_per_block_shape():
    """``get_node_params`` / ``get_node_flows`` of sum vectors run one executable per block shape and count (the
    vectors' places are arguments): a PD's 100 sum vectors of a few shapes compile a few, the second pass none, and
    the dense form equals the blocks laid out by hand."""
    from jaxpc import circuit as circuit_module

    c = jaxpc.compile(jaxpc.structures.PD((4, 4), 4, split_intervals=(2, 2), input_dist=distributions.Categorical(3)))
    sums = [n for n in c.nodes if n.is_sum()]
    shapes = {(n.source.edge_ids.shape[1], n.source.num_node_blocks, n.source.num_ch_node_blocks, n.source.block_size,
               n.source.ch_block_size) for n in sums}
    before = circuit_module._dense_blocks._cache_size()
    dense = [np.asarray(c.get_node_params(c.params, n)) for n in sums]
    grown = circuit_module._dense_blocks._cache_size() - before
    assert len(sums) > 3 * len(shapes) and grown <= 2 * len(shapes)  # (per group's array shape, too)
    flows = c.flows(c.params, np.zeros((2, 16), np.int32))
    [c.get_node_flows(flows, n) for n in sums]  # the same blocks without exponentials
    [c.get_node_params(c.params, n) for n in sums]
    assert circuit_module._dense_blocks._cache_size() - before <= 4 * len(shapes)
    n = sums[len(sums) // 2]
    group, blocks = c.param_slice(n)
    src = n.source
    want = np.zeros((src.num_node_blocks, src.num_ch_node_blocks, src.block_size, src.ch_block_size))
    want[src.edge_ids[0], src.edge_ids[1]] = np.exp(np.asarray(c.params["sum"][group][blocks]))
    want = want.transpose(0, 2, 1, 3).reshape(dense[len(sums) // 2].shape)
    np.testing.assert_allclose(dense[len(sums) // 2], want, rtol=1e-6)


def test_params_round_trip_dense_and_block_forms():
    rng = np.random.default_rng(0)
    pa = rng.random((6, 3))
    a = jaxpc.inputs(0, 3, 2, distributions.Categorical(3), params=pa)
    b = jaxpc.inputs(1, 3, 2, distributions.Bernoulli(), params=np.linspace(0.1, 0.9, 6))
    g = jaxpc.inputs(2, 3, 2, distributions.Gaussian(), params={"mu": np.arange(6.0), "sigma": np.full(6, 0.5)})
    m = jaxpc.multiply(a, b, g)
    dense = rng.random((4, 6))
    dense[:2, 2:4] = 0.0  # parent block 0 not connected to child block 1
    edge_ids = np.array([[0, 0, 1, 1, 1], [0, 2, 0, 1, 2]])
    s = jaxpc.summate(m, num_node_blocks=2, block_size=2, edge_ids=edge_ids, params=dense)
    root = jaxpc.summate(s, num_nodes=1, params=np.array([[1.0, 2.0, 3.0, 4.0]]))
    c = jaxpc.compile(root)
    np.testing.assert_allclose(np.asarray(c.get_node_params(c.params, a)), pa / pa.sum(1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(c.get_node_params(c.params, b)), np.linspace(0.1, 0.9, 6), rtol=1e-6)
    gp = c.get_node_params(c.params, g)
    np.testing.assert_allclose(np.asarray(gp["mu"]), np.arange(6.0))
    np.testing.assert_allclose(np.asarray(gp["sigma"]), 0.5, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(c.get_node_params(c.params, s)), dense / dense.sum(1, keepdims=True),
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(c.get_node_params(c.params, root)), [[0.1, 0.2, 0.3, 0.4]], rtol=1e-6)
    # the block form gives the same node
    blocks = s.get_params()
    s2 = jaxpc.summate(m, num_node_blocks=2, block_size=2, edge_ids=edge_ids, params=blocks * 7.0)
    np.testing.assert_allclose(s2.get_params(), blocks)
    # after EM the dense form is still normalized and zero off the edges
    x = np.stack([rng.integers(0, 3, 20), rng.integers(0, 2, 20), rng.normal(2, 1, 20)], 1)
    new = c.em_step(c.params, x, step_size=0.5, pseudocount=0.1)
    W = np.asarray(c.get_node_params(new, s))
    np.testing.assert_allclose(W.sum(1), 1, rtol=1e-5)
    assert np.all(W[:2, 2:4] == 0)


@pytest.mark.slow
def test_tied_parameters_are_shared():
    a = jaxpc.inputs(0, 2, 2, distributions.Categorical(3))
    b = jaxpc.inputs(1, 2, 2, distributions.Categorical(3))
    a2 = a.duplicate(2, tie_params=True)
    b2 = b.duplicate(3, tie_params=True)
    s1 = jaxpc.summate(jaxpc.multiply(a, b), num_node_blocks=1, block_size=2)
    s2 = s1.duplicate(jaxpc.multiply(a2, b2), tie_params=True)
    root = jaxpc.summate(jaxpc.multiply(s1, s2), num_nodes=1)
    c = jaxpc.compile(root)
    untied = jaxpc.compile(jaxpc.summate(jaxpc.multiply(
        jaxpc.summate(jaxpc.multiply(a, b), num_node_blocks=1, block_size=2),
        jaxpc.summate(jaxpc.multiply(a.duplicate(2), b.duplicate(3)), num_node_blocks=1, block_size=2)),
        num_nodes=1))
    assert c.num_parameters < untied.num_parameters
    assert s2.is_tied() and s2.source is s1 and a2.source is a
    np.testing.assert_array_equal(np.asarray(c.get_node_params(c.params, s1)),
                                  np.asarray(c.get_node_params(c.params, s2)))
    x = np.random.default_rng(0).integers(0, 3, (30, 4)).astype(np.int32)
    new = c.em_step(c.params, x)
    np.testing.assert_array_equal(np.asarray(c.get_node_params(new, a)), np.asarray(c.get_node_params(new, a2)))
    # flows of tied vectors are pooled: the source's flows equal the sum of both uses
    fl = c.flows(c.params, x)
    assert float(np.asarray(c.get_node_flows(fl, s1)).sum()) == pytest.approx(60.0, rel=1e-5)
    # jaxpc.duplicate is the functional spelling
    a3 = jaxpc.duplicate(a, 5, tie_params=True)
    assert a3.var == 5 and a3.source is a


def hmm_like(T, L=3, V=4, seed=0, tied=True):
    """A hand-built HMM over T steps (PyJuice's construction) for scan tests."""
    rng = np.random.default_rng(seed)
    emit = jaxpc.inputs(T - 1, num_nodes=L, dist=distributions.Categorical(V))
    z = emit
    trans = None
    for t in range(T - 2, -1, -1):
        e = emit.duplicate(t, tie_params=tied)
        if trans is None:
            trans = jaxpc.summate(z, num_nodes=L, params=rng.random((L, L)))
            s = trans
        else:
            s = trans.duplicate(z, tie_params=tied)
        z = jaxpc.multiply(e, s)
    return jaxpc.summate(z, num_nodes=1, params=rng.random((1, L)))


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_scan_equals_unrolled(tied):
    root = hmm_like(9, tied=tied)
    scanned = jaxpc.compile(root)
    unrolled = jaxpc.compile(root, scan_min_repeats=0)
    assert any(isinstance(s, ScanSpec) for s in scanned.layout.steps)
    assert not any(isinstance(s, ScanSpec) for s in unrolled.layout.steps)
    x = np.random.default_rng(1).integers(0, 4, (11, 9)).astype(np.int32)
    miss = np.random.default_rng(2).random((11, 9)) < 0.3
    for prop in ("LL", "MPE"):
        np.testing.assert_allclose(np.asarray(scanned.log_prob(scanned.params, x, miss, propagation=prop)),
                                   np.asarray(unrolled.log_prob(unrolled.params, x, miss, propagation=prop)),
                                   rtol=1e-6, atol=1e-6)
    f1, f2 = scanned.flows(scanned.params, x, miss), unrolled.flows(unrolled.params, x, miss)
    for l1, l2 in zip(jax.tree_util.tree_leaves(f1), jax.tree_util.tree_leaves(f2)):
        np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), rtol=1e-5, atol=1e-6)
    _, ref = oracle.forward(scanned, scanned.params, x, miss)
    np.testing.assert_allclose(np.asarray(scanned.log_prob(scanned.params, x, miss)), ref, rtol=1e-5, atol=1e-5)
    # the same scans unrolled at trace time (Options(scan_stages=False)), on the full layout and the folded plan
    for fold in (False, True):
        opts = jaxpc.Options(chain_scan=False, fold_products=fold)
        plan = scanned.layout.fold if fold else scanned.layout
        assert any(isinstance(s, ScanSpec) for s in plan.steps)
        (g1, ll1), (g2, ll2) = (scanned.flows(scanned.params, x, miss, options=o, return_ll=True)
                                for o in (opts, opts.replace(scan_stages=False)))
        np.testing.assert_allclose(np.asarray(ll2), np.asarray(ll1), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(ll2), ref, rtol=1e-5, atol=1e-5)
        for l1, l2 in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2)):
            np.testing.assert_allclose(np.asarray(l2), np.asarray(l1), rtol=1e-5, atol=1e-6)
        # unrolled, a repetition's first rows are constants: the scans' offsets are the stacked tables' rows
        tabs = scanned.tables["fold"] if fold else scanned.tables
        for step, tab in zip(plan.steps, tabs["steps"]):
            if isinstance(step, ScanSpec):
                assert len(step.offsets) == step.repeats
                for j in range(len(step.period)):
                    np.testing.assert_array_equal([o[j] for o in step.offsets], np.asarray(tab[j]["out"]))


def test_kernel_row_operand_is_a_constant_or_one_select():
    """The fan-in kernels' ``[row, blocks, fan-in]`` operand: a constant for a static row; for a traced one a
    select, never a concatenation (XLA runs that as a kernel and two device copies)."""
    from jaxpc.ops import pallas_sum

    np.testing.assert_array_equal(np.asarray(pallas_sum.block_offsets(np.int32(7), (3, 2))), [7, 3, 2])
    np.testing.assert_array_equal(np.asarray(pallas_sum.block_offsets(7, (3, 2))), [7, 3, 2])
    fn = jax.jit(lambda r: pallas_sum.block_offsets(r, (3, 2)))
    np.testing.assert_array_equal(np.asarray(fn(jnp.int32(11))), [11, 3, 2])
    assert "concatenate" not in str(jax.make_jaxpr(fn)(jnp.int32(11)))


def test_dense_partition_fast_path():
    a = jaxpc.inputs(0, 3, 2, distributions.Categorical(3))
    b = jaxpc.inputs(1, 3, 2, distributions.Categorical(3))
    s = jaxpc.summate(jaxpc.multiply(a, b), num_node_blocks=4, block_size=2)
    c = jaxpc.compile(jaxpc.summate(s, num_nodes=1))
    assert any(p.dense and p.n == 4 for st in c.layout.steps for p in st.sums)
    x = np.asarray(list(itertools.product(range(3), range(3))), dtype=np.int32)
    _, ref = oracle.forward(c, c.params, x)
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x)), ref, rtol=1e-5, atol=1e-6)


def test_general_ll_alpha_one_is_ll():
    root = hmm_like(5)
    c = jaxpc.compile(root)
    x = np.random.default_rng(0).integers(0, 4, (6, 5)).astype(np.int32)
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x, propagation="GeneralLL", alpha=1.0)),
                               np.asarray(c.log_prob(c.params, x)), rtol=1e-6)


@pytest.mark.slow
def test_composes_with_jit_vmap_grad():
    c = jaxpc.compile(hmm_like(6))
    x = np.random.default_rng(0).integers(0, 4, (7, 6)).astype(np.int32)
    keys = jax.random.split(jax.random.key(0), 3)
    stacked = jax.vmap(c.init_params)(keys)
    lls = jax.vmap(lambda p: c.log_prob(p, x))(stacked)
    for i in range(3):
        p_i = jax.tree_util.tree_map(lambda a: a[i], stacked)
        np.testing.assert_allclose(np.asarray(lls[i]), np.asarray(c.log_prob(p_i, x)), rtol=1e-6)

    @jax.jit
    def loss(params, xb):
        return -jnp.mean(c.log_prob(params, xb))

    g = jax.grad(loss)(c.params, jnp.asarray(x))
    fl = c.flows(c.params, x)
    for k in g["sum"]:
        np.testing.assert_allclose(-np.asarray(g["sum"][k]) * x.shape[0], np.asarray(fl["sum"][k]), rtol=1e-4,
                                   atol=1e-6)


def test_a_call_inside_jit_leaves_no_tracer_for_later_calls():
    """A call traced with the parameters abstract and the data concrete (padded to its bucket: 13 samples to 16)
    makes the call path's constants concrete, so the eager calls after it run."""
    c = jaxpc.compile(hmm_like(6))
    x = jnp.asarray(np.random.default_rng(1).integers(0, 4, (13, 6)).astype(np.int32))
    traced = jax.jit(lambda p: c.flows(p, x))(c.params)
    eager = c.flows(c.params, x)
    for a, b in zip(jax.tree_util.tree_leaves(traced), jax.tree_util.tree_leaves(eager)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    jax.make_jaxpr(lambda p: c.log_prob(p, x))(c.params)
    assert np.all(np.isfinite(np.asarray(c.log_prob(c.params, x))))


def test_the_array_types_made_first_inside_a_trace_are_concrete():
    """The runtime's set of concrete array types, made once per process, is the same when a call inside a caller's
    ``jax.jit`` makes it first (there ``jnp.zeros`` gives a tracer, whose type would be taken for a device array's
    and whose ``.committed`` raises in a later replay's placement check)."""
    from jaxpc import runtime

    runtime._array_types.cache_clear()
    try:
        jax.jit(lambda a: (runtime._array_types(), a)[1])(1.0)
        assert runtime._array_types() == {type(jnp.zeros(())), type(jax.random.key(0))}
    finally:
        runtime._array_types.cache_clear()


def _largest_literal(hlo: str) -> int:
    """Element count of the largest non-splat array literal in StableHLO text."""
    sizes = [line.split("dense<[", 1)[1].split("]>", 1)[0].count(",") + 1
             for line in hlo.splitlines() if "constant dense<[" in line]
    return max(sizes, default=0)


def test_index_tables_are_arguments_not_constants():
    c = jaxpc.compile(hmm_like(12, L=8))
    x = jnp.zeros((4, 12), jnp.int32)
    fn = jax.jit(lambda t, p, xx: jaxpc.engine.forward.log_prob(c.layout, t, p, xx, None, jaxpc.Options()))
    hlo = fn.lower(c.tables, c.params, x).as_text()
    assert max(_largest_literal(hlo), 0) < 64, "index tables were baked into the executable"
    # the detector does see a baked table
    table = np.arange(100, dtype=np.int32)
    assert _largest_literal(jax.jit(lambda v: v[table]).lower(jnp.zeros(200)).as_text()) == 100
    n_table_leaves = len(jax.tree_util.tree_leaves(c.tables))
    assert n_table_leaves > 0


def test_print_circuit():
    c = jaxpc.compile(hmm_like(6))
    s = repr(c)
    assert "num_vars=6" in s and "scanned" in s


def test_parallel_em_step_checks_the_circuit():
    """Params in place of the circuit raised ``AttributeError: 'dict' object has no attribute 'runtime'`` from
    ``parallel.em_step`` (it read the runtime before checking), where the other parallel functions name it."""
    params = {"sum": {}, "input": {}}
    with pytest.raises(TypeError, match=r"^parallel.em_step: circuit must be a jaxpc.Circuit, got dict; pass the "
                                        r"compiled circuit"):
        jaxpc.parallel.em_step(params, params, np.zeros((2, 2), np.int32))


def test_queries_check_the_circuit():
    """Params in place of the circuit raised ``AttributeError: 'dict' object has no attribute 'runtime'`` (or
    ``'log_prob'``) from the query functions; they name the argument as :mod:`jaxpc.optim` does."""
    params, x = {"sum": {}, "input": {}}, np.zeros((2, 2), np.int32)
    calls = {"marginal": lambda: jaxpc.queries.marginal(params, params, x),
             "conditional": lambda: jaxpc.queries.conditional(params, params, x),
             "sample": lambda: jaxpc.queries.sample(params, params, jax.random.key(0), 2),
             "mpe": lambda: jaxpc.queries.mpe(params, params)}
    for where, call in calls.items():
        with pytest.raises(TypeError, match=rf"^{where}: circuit must be a jaxpc.Circuit, got dict; pass the "
                                            r"compiled circuit"):
            call()
