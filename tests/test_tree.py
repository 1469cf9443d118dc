"""The folded plan's run of tree levels (:mod:`jaxpc.compiler.tree`) on the persistent kernels of
:mod:`jaxpc.ops.pallas_tree` (interpret mode off a GPU) and :mod:`jaxpc.ops.triton_tree` (Triton's interpreter, the
jax-triton route taken as running): the detected table, log-likelihoods and flows against the float64 oracle, EM
steps and parameter-flow variants against the per-level kernels, the two modules' kernels against each other, and
the route's conditions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc.compiler import ScanSpec
from jaxpc.compiler.levels import is_padding
from jaxpc.engine import routing
from jaxpc.ops import pallas_tree, triton_base, triton_tree

from . import oracle
from .test_levels import CAT, tree_circuit
from .tiers import cases, slow

LEVELS = jaxpc.Options(fold_products=True, impl="pallas")  # the default: the Pallas kernels, one level at a time
PALLAS = LEVELS.replace(tuning=jaxpc.Tuning(tree_kernel_batch=64))  # the tree's levels on the persistent kernels
TRITON = PALLAS.replace(impl="triton")  # on jax-triton's (with the route taken as running: `interpreted_triton`)


@pytest.fixture
def interpreted_triton(monkeypatch):
    """The jax-triton route taken as running, its kernels in Triton's interpreter (``TRITON_INTERPRET=1``, set by
    tests/conftest.py): the launches jax-triton would make on a GPU, run on the host."""
    if not triton_base.interpreting():
        pytest.skip("Triton's interpreter (triton installed, TRITON_INTERPRET=1)")
    monkeypatch.setattr(triton_base, "status", lambda: (True, "Triton's interpreter"))


@pytest.fixture(scope="module")
def deep():
    """Chains of up to 7 nodes under the root, evened into scans (padding blocks among the levels)."""
    c, V, _ = tree_circuit(lengths=(2, 3, 5, 6, 7, 7))
    data = np.random.default_rng(5).integers(0, CAT, (40, V)).astype(np.int32)
    return c, data


def _real_blocks(c):
    """``(first parent row, level)`` of every real (not padding) block of the folded plan's tree levels."""
    out, level = [], 0
    tree = c.layout.fold.tree
    for step, tab in zip(c.layout.fold.steps[tree.start:tree.stop], c.tables["fold"]["steps"][tree.start:tree.stop]):
        reps = [(tab[0], r) for r in range(step.repeats)] if isinstance(step, ScanSpec) else [(tab, None)]
        for t, r in reps:
            ch = np.asarray(t["sums"][0]["ch"] if r is None else t["sums"][0]["ch"][r])
            first = int(np.asarray(t["out"]) if r is None else np.asarray(t["out"])[r])
            for i in np.flatnonzero(~is_padding(ch)):
                out.append((first + i * tree.Kp, level))
            level += 1
    return out


def test_the_tree_table_lists_every_real_block_level_by_level(deep):
    c, _ = deep
    tree = c.layout.fold.tree
    assert tree is not None and tree.levels >= 6 and (tree.Kp, tree.Kc) == (4, 4)
    assert c.layout.fold.single_reader  # the backward stores its child flows (rows of no other reader)
    assert any(isinstance(s, ScanSpec) for s in c.layout.fold.steps[tree.start:tree.stop])  # padded levels inside
    tab = {k: np.asarray(v) for k, v in c.tables["fold"]["tree"].items()}
    real = _real_blocks(c)
    assert tree.blocks == len(real) == tab["prow"].shape[0] and tab["ch"].shape == (tree.blocks, 1, tree.M)
    assert tab["lev"][0] == 0 and tab["lev"][-1] == tree.blocks and np.all(np.diff(tab["lev"]) > 0)
    level_of = np.repeat(np.arange(tree.levels), np.diff(tab["lev"]))
    assert [(int(r), int(lv)) for r, lv in zip(tab["prow"], level_of)] == real
    assert len(set(tab["pid"][:, 0].tolist())) == tree.blocks  # a parameter block of its own each
    # a level's children were written by lower levels or are inputs
    for b in range(tree.blocks):
        lower = tab["prow"][level_of < level_of[b]]
        for r in tab["ch"][b, 0]:
            assert r < tab["prow"].min() or r in lower or r < 2 * c.layout.kmax


def test_no_tree_without_a_run_of_levels():
    c, _, _ = tree_circuit(lengths=(1, 2))  # two levels below the top
    assert c.layout.fold.tree is None


@pytest.mark.parametrize("batch,precision,route", cases(
    [(8, "fp32", "pallas"), (33, "tf32", "pallas"), (8, "fp32", "triton"), (33, "tf32", "triton")],
    fast=[(8, "fp32", "pallas"), (33, "tf32", "triton")], unpack=True))
@pytest.mark.slow
def test_flows_and_ll_on_the_tree_kernels_match_the_oracle(deep, batch, precision, route, request):
    """With missing values and per-sample weights; fp32 recomputes the local sums, tf32's route takes them from the
    stored values (exact on a CPU). 33 samples: a batch tile of 64 with padding."""
    if route == "triton":
        request.getfixturevalue("interpreted_triton")
    c, data = deep
    rng = np.random.default_rng(batch)
    x = np.resize(data, (batch, data.shape[1]))
    miss = rng.random(x.shape) < 0.2
    w = rng.uniform(0.5, 2.0, batch)
    totals, in_totals, _ = oracle.flow_totals(c, c.params, x, miss, weights=w)
    _, ref = oracle.forward(c, c.params, x, miss)
    opts = (TRITON if route == "triton" else PALLAS).replace(precision=precision)
    assert routing.tree_kernel(c.layout.fold, opts, batch, jnp.float32) == route
    fl, ll = c.flows(c.params, x, missing=miss, ll_weights=w, options=opts, return_ll=True)
    assert oracle.check_flows(c, fl, totals, in_totals) > 0
    np.testing.assert_allclose(np.asarray(ll), ref, rtol=1e-5, atol=1e-5)


def test_the_tree_kernels_run_one_launch_each_way(deep):
    c, data = deep
    x = jnp.asarray(data[:8])

    def loss(p):
        return jnp.sum(c.log_prob(p, x, options=PALLAS))

    text = str(jax.make_jaxpr(jax.grad(loss))(c.params))
    assert text.count("jaxpc_tree_forward") == 1 and text.count("jaxpc_tree_backward") == 1
    text = str(jax.make_jaxpr(jax.grad(lambda p: jnp.sum(c.log_prob(p, x, options=LEVELS))))(c.params))
    assert "jaxpc_tree" not in text


@slow
@pytest.mark.full  # an opt-in route's or tuning's variants
def test_flow_variants_equal_the_per_level_kernels(deep):
    """Without parameter flows (the backward's other mode) and with the batched parameter-flow pass forced (which
    leaves the tree's group to the kernel). The default flows: the oracle test above; an EM step reads them."""
    c, data = deep
    x = data[:8]  # the batch of the vmap test below: the same reference executable
    ref = c.flows(c.params, x, options=LEVELS, return_ll=True)
    for opts in (PALLAS.replace(compute_param_flows=False), PALLAS.replace(param_flow_pass="batched")):
        got = c.flows(c.params, x, options=opts, return_ll=True)
        keep = (lambda t: t) if opts.compute_param_flows else (lambda t: (t[0]["input"], t[1]))
        for a, b in zip(jax.tree_util.tree_leaves(keep(got)), jax.tree_util.tree_leaves(keep(ref))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
        if not opts.compute_param_flows:  # returned as zeros
            assert all(not np.asarray(f).any() for f in jax.tree_util.tree_leaves(got[0]["sum"]))


def test_the_route_takes_small_float32_sum_product_batches_only(deep):
    c, _ = deep
    fold = c.layout.fold
    f32 = jnp.float32
    assert routing.tree_kernel(fold, PALLAS, 64, f32)
    assert not routing.tree_kernel(fold, PALLAS, 65, f32)  # the whole batch is one tile of each program
    assert not routing.tree_kernel(fold, PALLAS.replace(tuning=jaxpc.Tuning(tree_kernel_batch=16)), 17, f32)
    assert not routing.tree_kernel(fold, LEVELS, 8, f32)  # off by default
    assert not routing.tree_kernel(fold, PALLAS, 8, jnp.float64)
    assert not routing.tree_kernel(fold, PALLAS.replace(impl="xla"), 8, f32)
    assert not routing.tree_kernel(fold, PALLAS.replace(propagation="MPE"), 8, f32)
    assert not routing.tree_kernel(fold, PALLAS.replace(pflow_temperature=2.0), 8, f32)
    assert not routing.tree_kernel(fold, PALLAS, 8, f32, evidence={"sum_gates": {fold.tree.group: jnp.zeros((8, 3))}})
    # impl="auto" runs it on a GPU only
    assert bool(routing.tree_kernel(fold, PALLAS.replace(impl="auto"), 8, f32)) == (jax.default_backend() == "gpu")
    assert not routing.tree_kernel(c.layout, PALLAS, 8, f32)  # the unfolded layout has no tree


def test_the_route_takes_jax_tritons_kernels_where_they_run_and_fit(deep, monkeypatch):
    c, _ = deep
    fold, f32 = c.layout.fold, jnp.float32
    monkeypatch.setattr(triton_base, "status", lambda: (False, "no GPU"))
    monkeypatch.setattr(triton_base, "_WARNED", [True])  # impl="triton"'s fallback warning: tests/test_triton.py
    # impl="triton" where it does not run is "auto", which runs tree kernels on a GPU only
    assert bool(routing.tree_kernel(fold, TRITON, 8, f32)) == (jax.default_backend() == "gpu")
    monkeypatch.setattr(triton_base, "status", lambda: (True, "Triton's interpreter"))
    assert routing.tree_kernel(fold, TRITON, 8, f32) == "triton"
    assert routing.tree_kernel(fold, PALLAS, 8, f32) == "pallas"  # impl="pallas" asks for Pallas's
    assert routing.tree_module("triton") is triton_tree and routing.tree_module("pallas") is pallas_tree
    monkeypatch.setattr(triton_tree, "MAX_TILE", 8 * 16)  # blocks too large for its register tiles
    assert not triton_tree.fits(fold.tree, 8)
    assert routing.tree_kernel(fold, TRITON, 8, f32) == "pallas"


@pytest.mark.slow
@pytest.mark.full  # an opt-in route's or tuning's variants
def test_the_triton_tree_backward_adds_child_flows_as_pallas_does(deep, interpreted_triton):
    """The backward's mode that no circuit here takes (an HCLT's rows have one reader: its flows are stored, with
    parameter flows added, as the oracle test above checks): child flows added to what the rows held, no parameter
    flows, against :mod:`jaxpc.ops.pallas_tree`'s."""
    c, data = deep
    fold, spec = c.layout.fold, c.layout.fold.tree
    tab = {k: jnp.asarray(v) for k, v in c.tables["fold"]["tree"].items()}
    logw = c.params["sum"][spec.group]
    opts = jaxpc.Options(precision="tf32")

    @jax.jit  # (one executable: eagerly, each of the engine's ops would compile its own)
    def forward(tables, params, x):
        inputs = jaxpc.engine.forward.input_values(c.layout, tables, params, x, None, opts)
        return jaxpc.engine.stages.forward_buffer(fold, tables["fold"], params["sum"], inputs, opts)

    values = forward(c.tables, c.params, jnp.asarray(data[:8]))
    rows = (np.asarray(tab["prow"])[:, None] + np.arange(spec.Kp)).ravel()
    top = (np.asarray(tab["prow"])[np.asarray(tab["lev"])[-2]:][:, None] + np.arange(spec.Kp)).ravel()
    flows = np.asarray(np.random.default_rng(1).random(values.shape), np.float32)
    flows[np.setdiff1d(rows, top)] = 0.0  # earlier flows everywhere but the levels' rows below the top
    got, want = (jax.jit(lambda v, f, t, w, m=m: m.backward(v, f, None, t, w, spec, "tf32", 2 * fold.kmax))(
        values, jnp.asarray(flows), tab, logw) for m in (triton_tree, pallas_tree))
    assert got[1] is None and want[1] is None
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(got[0])[rows], flows[rows])  # the levels' flows arrived


@slow
@pytest.mark.full  # an opt-in route's or tuning's variants
def test_the_tree_kernels_under_vmap_over_parameter_sets(deep):
    """``jit(vmap)`` over two parameter sets: one launch per set (a batched grid would break the barrier)."""
    c, data = deep
    x = data[:8]
    p2 = jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b]), c.params, c.init_params(jax.random.PRNGKey(7)))
    got = jax.jit(jax.vmap(lambda p: c.flows(p, x, options=PALLAS, return_ll=True)))(p2)
    for i in range(2):
        pi = jax.tree_util.tree_map(lambda a, i=i: a[i], p2)
        ref = c.flows(pi, x, options=LEVELS, return_ll=True)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
            np.testing.assert_allclose(np.asarray(a)[i], np.asarray(b), rtol=2e-5, atol=1e-6)


def test_the_tree_kernels_lower_to_triton_for_the_h200(deep):
    """Cross-lowered for CUDA with 128 programs (the CPU runs them in interpret mode): both directions, the local sums
    recomputed (fp32) and from the stored values (tf32), child flows added and stored."""
    from unittest import mock

    from jaxpc.ops import pallas_sum, pallas_tree

    c, _ = deep
    spec = c.layout.fold.tree
    tab = {k: jnp.asarray(v) for k, v in c.tables["fold"]["tree"].items()}
    logw = c.params["sum"][spec.group]
    buf = jnp.zeros((c.layout.fold.num_rows, 16))
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    with mock.patch.object(pallas_sum, "interpret_mode", lambda: False), \
            mock.patch.object(pallas_tree, "interpret_mode", lambda: False), \
            jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        for precision, overwrite in (("tf32", True), ("fp32", False)):
            fns = (lambda b, lw: pallas_tree.forward(b, tab, lw, spec, precision, G=128),
                   lambda b, lw: pallas_tree.backward(b, b, lw, tab, lw, spec, precision, 8, overwrite, G=128))
            for f in fns:
                text = jax.jit(f).trace(buf, logw).lower(lowering_platforms=("cuda",)).as_text()
                assert "__gpu$xla.gpu.triton" in text


def test_the_triton_tree_kernels_refuse_buffers_they_cannot_hold(deep):
    c, _ = deep
    spec, R = c.layout.fold.tree, c.layout.fold.num_rows
    tab = {k: jnp.asarray(v) for k, v in c.tables["fold"]["tree"].items()}
    logw = c.params["sum"][spec.group]
    with pytest.raises(TypeError, match="float32 node buffer"):
        triton_tree.forward(jnp.zeros((R, 8), jnp.int32), tab, logw, spec, "tf32")
    with pytest.raises(ValueError, match="1 to 64 samples"):
        triton_tree.backward(jnp.zeros((R, 65)), jnp.zeros((R, 65)), None, tab, logw, spec, "tf32", 8)
