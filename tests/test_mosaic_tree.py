"""The tree levels on thread-block clusters (:mod:`jaxpc.ops.mosaic_tree`): its schedules' invariants, its forward
in Pallas's Mosaic GPU interpreter (the kernel the GPU runs) against the level-by-level forward, and the route
(``Tuning.tree_clusters``): when it is taken, and its flows against XLA's."""

import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc import distributions
from jaxpc.engine import routing
from jaxpc.ops import mosaic_tree
from jaxpc.structures.hclt import hidden_tree_circuit

from .test_levels import chains_tree

LATENTS = 64


@pytest.fixture(scope="module")
def tree():
    """A circuit of 64-node blocks whose tree levels hold 1 to 7 blocks (chains of up to 5 under the root, and
    leaves hanging from some chain nodes), its tree tables and a forward buffer at batch 16."""
    children, root = chains_tree((2, 3, 4, 5, 5))
    V = len(children)
    c = jaxpc.compile(hidden_tree_circuit(children, root, LATENTS, list(range(V)), distributions.Categorical(3),
                                          block_size=LATENTS), seed=2, scan_min_repeats=0)
    fold = c.layout.fold
    assert fold.tree is not None and fold.tree.Kp == fold.tree.Kc == LATENTS
    x = jnp.asarray(np.random.default_rng(0).integers(0, 3, (16, V)).astype(np.int32))
    opts = jaxpc.Options(precision="fp32")
    vals = jax.jit(lambda p: jaxpc.engine.stages.forward_buffer(
        fold, c.tables["fold"], p["sum"], jaxpc.engine.forward.input_values(c.layout, c.tables, p, x, None, opts),
        opts))(c.params)
    tab = {k: np.asarray(v) for k, v in c.tables["fold"]["tree"].items()}
    return c, fold.tree, tab, np.asarray(vals)


@pytest.mark.parametrize("split,tile,clusters", [(0, 64, 1), (None, 32, 2), (2, 16, 3)])
def test_a_schedule_runs_every_task_once_after_its_children(tree, split, tile, clusters):
    _, spec, tab, _ = tree
    tabs = mosaic_tree.schedule(tab, spec, clusters=clusters, split=split, tile=tile)
    prow, pid = tab["prow"], tab["pid"][:, 0]
    block_of = {int(r): i for i, r in enumerate(prow)}
    kids = [[block_of[int(r)] for r in row if int(r) in block_of] for row in tab["ch"][:, 0]]
    parent = {k: p for p, ks in enumerate(kids) for k in ks}
    when = {}  # (block, tile offset) -> (launch, cluster, step)
    for li, t in enumerate(tabs["tasks"]):
        assert t.shape[1] == mosaic_tree.CLUSTER and t.dtype == np.int32
        for g, c, s in zip(*np.nonzero(t[..., 0] >= 0)):
            w, child, out, up = (int(v) for v in t[g, c, s])
            b, k = divmod(out, spec.Kp)
            assert (w, child) == (pid[b] * spec.Kp + k, b * spec.Kc) and k % tile == 0
            assert up == (parent[b] * spec.Kc + k if b in parent else -1)
            assert (b, k) not in when
            when[b, k] = (li, g, s)
    assert set(when) == {(b, k) for b in range(len(prow)) for k in range(0, spec.Kp, tile)}
    for (b, k), (li, g, s) in when.items():
        for ch in kids[b]:  # children earlier: in an earlier launch, or earlier in the same cluster
            cl, cg, cs = when[ch, k]
            assert cl < li or (cl == li and cg == g and cs < s)
        sib = [o for o in kids[parent[b]] if o != b] if b in parent else []
        assert all(when[o, k] != (li, g, s) for o in sib)  # one block a step adds into a parent
    assert np.array_equal(tabs["rows"], (prow[:, None] + np.arange(spec.Kp)).ravel())


@pytest.mark.parametrize("seed", range(4))
def test_steps_take_every_ready_block_they_have_room_for(seed):
    """:func:`mosaic_tree._steps` on random forests (chains and bushes, several tops): every block once, after its
    children, no two children of one parent in a step, and a step with room left leaves out only blocks that are not
    ready or whose sibling it holds (the list scheduling that lets levels share steps); within two steps of the
    fewest any order could take."""
    rng = np.random.default_rng(seed)
    n, per_step = 300, 4
    parent = np.array([int(rng.integers(b + 1, min(n, b + 1 + rng.choice([1, 8])))) if b < n - 4 and rng.random() < 0.97
                       else -1 for b in range(n)])
    level = np.zeros(n, np.int64)
    for b in range(n):  # parents come after their children
        if parent[b] >= 0:
            level[parent[b]] = max(level[parent[b]], level[b] + 1)
    steps = mosaic_tree._steps(list(range(n)), level, parent, per_step)
    when = {b: s for s, blocks in enumerate(steps) for b in blocks}
    assert sorted(when) == list(range(n)) and sum(map(len, steps)) == n
    kids = {b: [k for k in range(n) if parent[k] == b] for b in range(n)}
    for s, blocks in enumerate(steps):
        assert len(blocks) <= per_step
        assert all(when[k] < s for b in blocks for k in kids[b])
        ups = [parent[b] for b in blocks if parent[b] >= 0]
        assert len(ups) == len(set(ups))
        if len(blocks) < per_step:
            ready = [b for b in range(n) if when[b] > s and all(when[k] < s for k in kids[b])]
            assert all(parent[b] >= 0 and parent[b] in ups for b in ready), (s, ready)
    depth = np.zeros(n, np.int64)
    for b in range(n - 1, -1, -1):  # parents first
        depth[b] = depth[parent[b]] + 1 if parent[b] >= 0 else 0
    fewest = int(mosaic_tree._fewest_steps(np.bincount(depth), per_step))
    assert fewest <= len(steps) <= fewest + 2, (fewest, len(steps))


@pytest.mark.slow
def test_the_cluster_forward_matches_the_level_by_level_forward(tree):
    """The interpreter's kernel (TF32 operands rounded to nearest) against the float32 levels: one launch on one
    cluster from the log-weights (the backward's test runs two launches from the weights)."""
    c, spec, tab, vals = tree
    tabs = jax.tree.map(jnp.asarray, mosaic_tree.schedule(tab, spec, split=0))
    logw = c.params["sum"][spec.group]
    rows = tabs["rows"]
    start = jnp.asarray(vals).at[rows].set(jnp.nan)  # every parent row must be written

    @jax.jit  # one program (op by op, each operation would compile on its own)
    def run(start, logw):
        out, kept = mosaic_tree.forward(start, tabs, logw, spec, keep=True)
        return out, kept, mosaic_tree.copies(out, tabs, spec)

    out, kept, rebuilt = run(start, logw)
    # the copies the flow pass keeps for the backward equal those it rebuilds without them (kernel_shifts=False)
    for k in ("prod", "vals", "shift"):
        np.testing.assert_allclose(np.asarray(kept[k]), np.asarray(rebuilt[k]), rtol=1e-6, atol=1e-5)
    out, rows = np.asarray(out), np.asarray(rows)
    others = np.setdiff1d(np.arange(len(vals)), rows)
    np.testing.assert_array_equal(out[others], vals[others])
    np.testing.assert_allclose(out[rows], vals[rows], rtol=1e-4, atol=1e-3)


def test_the_cluster_forward_rejects_what_it_cannot_run(tree):
    c, spec, tab, vals = tree
    tabs = jax.tree.map(jnp.asarray, mosaic_tree.schedule(tab, spec, tile=16))
    logw = c.params["sum"][spec.group]
    with pytest.raises(ValueError, match="B a multiple of 8"):
        mosaic_tree.forward(jnp.asarray(vals[:, :12]), tabs, logw, spec)


@pytest.mark.slow
def test_the_wide_forward_tasks_write_what_the_narrow_ones_write(tree):
    """``Tuning.tree_forward_tile=64`` (and by default at batches up to 16): the forward's tasks of 64 rows
    (``wide_tasks``, fewer steps) write the values and copies that 32-row tasks write, which the backward's tables
    read either way."""
    c, spec, _, vals = tree
    tabs = c.tables["fold"]["tree"]["clusters"]
    wide, tile = routing.cluster_forward(CLUSTERS.replace(tuning=jaxpc.Tuning(tree_forward_tile=64)), tabs, 64)
    steps = [sum(t.shape[2] for t in ts["tasks"]) for ts in (wide, tabs)]
    assert tile == 64 and steps[0] <= steps[1]  # (fewer where a level holds more blocks than a step takes)
    assert not np.array_equal(np.asarray(wide["tasks"][-1]), np.asarray(tabs["tasks"][-1]))
    assert routing.cluster_forward(CLUSTERS, tabs, 16) == (wide, 64)
    assert routing.cluster_forward(CLUSTERS, tabs, 24) == (tabs, routing.CLUSTER_TILE)
    narrow = CLUSTERS.replace(tuning=jaxpc.Tuning(tree_forward_tile=32))
    assert routing.cluster_forward(narrow, tabs, 16) == (tabs, routing.CLUSTER_TILE)
    @jax.jit  # one program (op by op, each operation would compile on its own)
    def run(buf, logw):
        w = mosaic_tree.tf32_weights(logw)
        return [mosaic_tree.forward(buf, t, None, spec, tile=k, weights=w, keep=True)
                for t, k in ((wide, 64), (tabs, 32))]

    got, want = run(jnp.asarray(vals), c.params["sum"][spec.group])
    # the same sums over other tiles: float32 rounding in another order, compounded over the tree's levels (up to
    # 3.4e-6 relative on an AVX2 CPU, 28 float32 ulps)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
    with pytest.raises(ValueError, match="tree_forward_tile must be None, 32 or 64"):
        jaxpc.Tuning(tree_forward_tile=16)


@pytest.mark.slow
@pytest.mark.full  # an opt-in route's or tuning's variants
def test_the_cluster_forward_from_log_weights_equals_it_from_weights(tree):
    """Tasks of 32 rows (the route's) exponentiating their log-weight tiles in the kernel (``Tuning.tree_log_weights``)
    write what they write from the TF32 weights made before the call, bit for bit, over two launches."""
    c, spec, tab, vals = tree
    tabs = jax.tree.map(jnp.asarray, mosaic_tree.schedule(tab, spec, clusters=2, tile=32))
    logw = c.params["sum"][spec.group]
    got = mosaic_tree.forward(jnp.asarray(vals), tabs, logw, spec, tile=32)
    want = mosaic_tree.forward(jnp.asarray(vals), tabs, None, spec, tile=32, weights=mosaic_tree.tf32_weights(logw))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.slow
@pytest.mark.full  # against the unfenced variant (CI checks the fences in the lowering: test_x64.py)
def test_fenced_steps_write_the_same_values_and_lower_their_fences_for_cuda(tree, monkeypatch):
    """``mosaic_tree.FENCES`` (on by default): the interpreter skips the inline fences, so the forward and backward
    write what they write without them; lowered for an H200, the kernel's module holds the cluster-scope and proxy
    fences, and without them it does not."""
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    c, spec, tab, vals = tree
    tabs = jax.tree.map(jnp.asarray, mosaic_tree.schedule(tab, spec, clusters=2))
    w = mosaic_tree.tf32_weights(c.params["sum"][spec.group])
    flows = jnp.asarray(np.abs(vals))

    def run(buf):
        out, kept = mosaic_tree.forward(buf, tabs, None, spec, weights=w, keep=True)
        return out, mosaic_tree.backward(flows, kept, tabs, mosaic_tree.tf32_weights_t(c.params["sum"][spec.group]),
                                         spec)

    assert mosaic_tree.FENCES
    got = run(jnp.asarray(vals))
    monkeypatch.setattr(mosaic_tree, "FENCES", False)
    want = run(jnp.asarray(vals))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    h200 = AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    texts = {}
    for fences in (True, False):
        monkeypatch.setattr(mosaic_tree, "FENCES", fences)
        with use_abstract_mesh(AbstractMesh((), (), abstract_device=h200)):
            fn = jax.jit(lambda b: mosaic_tree.forward(b, tabs, None, spec, weights=w, interpret=False))
            texts[fences] = fn.trace(jnp.asarray(vals)).lower(lowering_platforms=("cuda",)).as_text()
    assert "fence.acq_rel.cluster" in texts[True] and "fence.proxy.async.global" in texts[True]
    assert "fence.acq_rel.cluster" not in texts[False]


@pytest.mark.slow
@pytest.mark.full  # an opt-in route's variants (CI runs the route in test_the_cluster_route_with_tree_blocks_*)
def test_task_widths_and_mixed_levels_write_what_one_level_steps_write(tree):
    """Three schedules of the same tree write the same values and flows, within TF32 rounding. Where a level holds
    more blocks than a step takes, blocks of the levels above whose children are done share its steps (Hu's
    order): 16-row tasks (four blocks a step) mix levels here, and their forward and backward write what the 32-row
    tasks (eight blocks a step, one level a step) write, up to the order in which a parent's children add into it.
    :func:`mosaic_tree.backward` with ``ratios`` (each parent's ``exp(shift - value)`` and the child's ``exp(child
    - shift)`` made before the call) on 64-row tasks (``Tuning.tree_backward_tile=64``) writes the flows that the
    copies' kernel writes on the route's 32-row tasks over two launches: every row the tree's blocks and their
    children read."""
    c, spec, tab, vals = tree
    logw = c.params["sum"][spec.group]
    level = mosaic_tree._levels_of(tab["lev"])
    schedules = {tile: mosaic_tree.schedule(tab, spec, clusters=2, tile=tile) for tile in (16, 32, 64)}

    def levels_per_step(tasks):
        return [len({int(level[v // spec.Kp]) for v in t[g, :, s, 2][t[g, :, s, 0] >= 0]})
                for t in tasks for g in range(t.shape[0]) for s in range(t.shape[2])]

    assert max(levels_per_step(schedules[16]["tasks"])) > 1
    assert max(levels_per_step(schedules[32]["tasks"])) == 1
    flows = jnp.asarray(np.random.default_rng(3).random(vals.shape).astype(np.float32))
    values, got = {}, {}
    for tile, tabs in schedules.items():
        tabs = jax.tree.map(jnp.asarray, tabs)
        values[tile], kept = mosaic_tree.forward(jnp.asarray(vals), tabs, logw, spec, tile=tile, keep=True)
        got[tile] = np.asarray(mosaic_tree.backward(flows, kept, tabs, mosaic_tree.tf32_weights_t(logw), spec,
                                                    tile=tile, ratios=tile == 64))
    assert (np.abs(got[32] - np.asarray(flows)).max(axis=1) > 0).sum() > len(schedules[32]["rows"])
    for tile in (16, 64):
        np.testing.assert_allclose(np.asarray(values[tile]), np.asarray(values[32]), rtol=3e-5, atol=3e-5)
        # products of other shapes sum in another order, and a flow's operands are rounded to TF32 (2^-11): an
        # operand an ulp apart can round the other way (up to 5.6e-5 relative on an AVX2 CPU)
        np.testing.assert_allclose(got[tile], got[32], rtol=5e-4, atol=1e-6)


CLUSTERS = jaxpc.Options(impl="pallas", precision="tf32", tuning=jaxpc.Tuning(tree_clusters=True))


def test_the_wide_backward_is_taken_where_shared_memory_holds_it(tree):
    """``Tuning.tree_backward_tile=64`` (and the default, None) takes the wide tasks on the ratios' kernel where a
    block's shared memory holds them: 256-node blocks at batches up to 16; else the 32-row tasks."""
    import dataclasses

    spec = dataclasses.replace(tree[1], Kp=256, Kc=256)
    tabs = {"btasks": [np.zeros((1, 16, 48, 8), np.int32)], "wide_btasks": [np.zeros((1, 16, 39, 8), np.int32)]}
    wide = CLUSTERS.replace(tuning=jaxpc.Tuning(tree_backward_tile=64))
    for B, want in [(8, 64), (16, 64), (24, 32), (64, 32)]:
        got, tile, ratios = routing.cluster_backward(wide, tabs, spec, B)
        assert (tile, ratios, got["btasks"] is tabs["wide_btasks"]) == (want, want == 64, want == 64), B
    assert routing.cluster_backward(CLUSTERS, tabs, spec, 16)[1:] == (64, True)
    narrow = CLUSTERS.replace(tuning=jaxpc.Tuning(tree_backward_tile=32))
    assert routing.cluster_backward(narrow, tabs, spec, 16) == (tabs, routing.CLUSTER_TILE, False)
    assert routing.cluster_backward(wide, {"btasks": tabs["btasks"]}, spec, 16)[1] == routing.CLUSTER_TILE


def test_the_cluster_route_is_taken_where_its_kernels_apply(tree):
    fold = tree[0].layout.fold
    f32 = jnp.float32
    assert routing.tree_kernel(fold, CLUSTERS, 16, f32) == "mosaic"
    auto = CLUSTERS.replace(impl="auto")  # the kernels' route on a GPU only
    assert (routing.tree_kernel(fold, auto, 16, f32) == "mosaic") == (jax.default_backend() == "gpu")
    with mock.patch.object(routing, "on_gpu", lambda: False):
        assert routing.tree_kernel(fold, auto, 16, f32) != "mosaic"  # off a GPU, whatever runs the test
    for opts, B in [(CLUSTERS, 12), (CLUSTERS, 72), (CLUSTERS.replace(precision="fp32"), 16),
                    (CLUSTERS.replace(param_flow_pass="inline"), 16), (jaxpc.Options(impl="pallas"), 16)]:
        assert routing.tree_kernel(fold, opts, B, f32) != "mosaic", (opts, B)


@pytest.mark.parametrize("hopper", [True, False])
def test_the_default_call_takes_the_cluster_route_on_hopper_gpus_only(tree, hopper):
    """``Tuning.tree_clusters=None`` (the default): on where ``impl="auto"`` runs on a Hopper GPU; False: never; the
    first, quick compile traces the levels one by one (``executables.quick_trace_options``)."""
    from jaxpc import executables

    fold, f32 = tree[0].layout.fold, jnp.float32
    default = jaxpc.Options(precision="tf32")  # what "default" resolves to on a GPU
    off = default.replace(tuning=jaxpc.Tuning(tree_clusters=False))
    with mock.patch.object(routing, "on_gpu", lambda: True), mock.patch.object(routing, "on_hopper", lambda: hopper):
        assert (routing.tree_kernel(fold, default, 16, f32) == "mosaic") == hopper
        assert routing.tree_kernel(fold, off, 16, f32) != "mosaic"
        assert routing.tree_kernel(fold, default.replace(impl="xla"), 16, f32) != "mosaic"
        quick = executables.quick_trace_options(default)
        assert quick.tuning.tree_clusters is False and routing.tree_kernel(fold, quick, 16, f32) != "mosaic"
    assert executables.quick_trace_options(off) == off.replace(leaf_kernel=False)
    with pytest.raises(TypeError, match="tree_clusters must be a bool or None"):
        jaxpc.Tuning(tree_clusters=1)


MISSING = [(False, "missing mosaic_gpu.inline_mgpu")]  # mosaic_tree.status() where this JAX lacks a part


def test_without_the_cluster_kernels_the_route_is_not_taken_and_warns_once(tree):
    """Where this JAX lacks what the cluster kernels use (``mosaic_tree.status``), the route asked for (by default on
    a Hopper GPU, or by ``Tuning.tree_clusters=True``) is not taken: the levels run one by one, and one warning per
    process names what is missing."""
    fold, f32 = tree[0].layout.fold, jnp.float32
    assert mosaic_tree.status()[0]  # this JAX builds them (tests/test_x64.py lowers them for CUDA)
    default = jaxpc.Options(precision="tf32")
    with (mock.patch.object(mosaic_tree, "_STATUS", MISSING), mock.patch.object(routing, "_WARNED_CLUSTERS", []),
          mock.patch.object(routing, "on_gpu", lambda: True), mock.patch.object(routing, "on_hopper", lambda: True)):
        with pytest.warns(RuntimeWarning, match="cannot run on thread-block clusters.*mosaic_gpu.inline_mgpu"):
            assert routing.tree_kernel(fold, default, 16, f32) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert routing.tree_kernel(fold, CLUSTERS, 16, f32) is None
            assert routing.tree_kernel(fold, default.replace(tuning=jaxpc.Tuning(tree_clusters=False)), 16, f32) is None


def test_the_interpreters_parameters_are_needed_only_off_a_gpu(monkeypatch):
    """``mosaic_tree.status`` asks for ``InterpretGPUParams`` only where the kernels run on the interpreter (off a
    GPU): a JAX without it still builds them for a GPU."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    monkeypatch.delattr(plgpu, "InterpretGPUParams")
    for backend, usable in (("cpu", False), ("gpu", True)):
        monkeypatch.setattr(mosaic_tree, "_STATUS", [])
        monkeypatch.setattr(jax, "default_backend", lambda backend=backend: backend)
        ok, reason = mosaic_tree.status()
        assert ok == usable and ("mosaic_gpu.InterpretGPUParams" in reason) != usable, (backend, reason)


@pytest.mark.slow
def test_without_the_cluster_kernels_the_flows_are_the_level_by_level_ones(tree):
    """The route asked for where its kernels cannot be built: the flows and log-likelihoods are those of the levels
    one by one (``Tuning.tree_clusters=False``), bit for bit."""
    c = tree[0]
    x = jnp.asarray(np.random.default_rng(5).integers(0, 3, (8, c.num_vars)).astype(np.int32))
    asked = CLUSTERS  # (no other test calls it at this batch, whose executable would be cached on the route)
    with (mock.patch.object(mosaic_tree, "_STATUS", MISSING), mock.patch.object(routing, "_WARNED_CLUSTERS", [True])):
        got = c.flows(c.params, x, options=asked, return_ll=True)
    want = c.flows(c.params, x, options=asked.replace(tuning=jaxpc.Tuning(tree_clusters=False)), return_ll=True)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
@pytest.mark.full  # (in CI the route runs end to end in test_the_cluster_route_with_tree_blocks_outside_the_tree)
def test_the_cluster_route_matches_xla(tree):
    """Log-likelihoods and flows (the input layer's counts, the sum parameters': the tree's from the batched pass)
    on the clusters' kernels in the interpreter against XLA's, within the TF32 operands' error."""
    c, _, _, _ = tree
    x = jnp.asarray(np.random.default_rng(3).integers(0, 3, (16, c.num_vars)).astype(np.int32))
    want, ll_want = c.flows(c.params, x, options=jaxpc.Options(impl="xla"), return_ll=True)
    got, ll_got = c.flows(c.params, x, options=CLUSTERS, return_ll=True)
    np.testing.assert_allclose(np.asarray(ll_got), np.asarray(ll_want), rtol=1e-4)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=2e-3 * float(np.max(np.abs(b))))


def test_the_forward_keeps_the_copies_the_flow_pass_reads(tree):
    """The forward returns the sample-major copies the backward reads (``forward_buffer(keep_shifts=True)``, traced
    only), so the flow pass's executable has no gathers that rebuild them from the node buffer (the copies' values:
    ``test_the_cluster_forward_matches_the_level_by_level_forward``)."""
    c, spec, _, _ = tree
    fold = c.layout.fold
    x = jnp.zeros((16, c.num_vars), jnp.int32)
    buf, shifts, kept, firsts = jax.eval_shape(lambda p: jaxpc.engine.stages.forward_buffer(
        fold, c.tables["fold"], p["sum"], jaxpc.engine.forward.input_values(c.layout, c.tables, p, x, None, CLUSTERS),
        CLUSTERS, keep_shifts=True), c.params)
    assert shifts is None and firsts is None and {k: v.shape for k, v in kept.items()} == {
        k: v.shape for k, v in mosaic_tree.copies(jnp.zeros(buf.shape), c.tables["fold"]["tree"]["clusters"],
                                                  spec).items()}

    def gathers(options):
        jaxpr = jax.make_jaxpr(lambda p: c.flows(p, x, options=options))(c.params)
        return str(jaxpr).count("gather[")

    assert gathers(CLUSTERS) < gathers(CLUSTERS.replace(kernel_shifts=False))


@pytest.mark.slow
@pytest.mark.full  # an opt-in route's or tuning's variants
def test_the_wide_tasks_and_log_weights_write_what_the_narrow_route_writes(tree):
    """At a batch of 16 the route takes 64-row tasks each way by default (``Tuning.tree_forward_tile``,
    ``Tuning.tree_backward_tile``); they, and the forward exponentiating its weights in the kernel
    (``Tuning.tree_log_weights``, which makes no copy of the weights for the forward), write every flow that 32-row
    tasks from the weights' copies write, within TF32 rounding."""
    c, _, _, _ = tree
    x = jnp.asarray(np.random.default_rng(4).integers(0, 3, (16, c.num_vars)).astype(np.int32))
    narrow = CLUSTERS.replace(tuning=jaxpc.Tuning(tree_clusters=True, tree_forward_tile=32, tree_backward_tile=32))
    in_kernel = CLUSTERS.replace(tuning=jaxpc.Tuning(tree_clusters=True, tree_log_weights=True))

    def weight_copies(options):  # the forward's copy and the backward's transposed one, traced
        with mock.patch.object(mosaic_tree, "tf32_weights", wraps=mosaic_tree.tf32_weights) as made:
            jax.make_jaxpr(lambda p: c.flows(p, x, options=options))(c.params)
        return made.call_count

    assert (weight_copies(CLUSTERS), weight_copies(in_kernel)) == (2, 1)
    want = c.flows(c.params, x, options=narrow)
    # 64-row tasks: products of another shape, whose TF32-rounded operands can round the other way (up to 8.9e-6
    # relative on an AVX2 CPU)
    for options, tol in ((CLUSTERS, 1e-4), (in_kernel, 1e-4)):
        got = c.flows(c.params, x, options=options)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol * float(np.max(np.abs(b))))


@pytest.fixture(scope="module")
def hclt():
    """An HCLT of 32-node blocks whose group of tree blocks also holds a block outside the tree, and a batch of
    16."""
    data = np.random.default_rng(0).integers(0, 2, (300, 36)).astype(np.int32)
    c = jaxpc.compile(jaxpc.structures.HCLT(data, 32, input_dist=distributions.Categorical(2)))
    tree = c.layout.fold.tree
    assert c.params["sum"][tree.group].shape[0] > tree.blocks
    return c, jnp.asarray(data[:16])


@pytest.mark.slow
@pytest.mark.full
def test_the_cluster_route_with_tree_blocks_outside_the_tree(hclt):
    """The route end to end on an HCLT: a partition of the tree's group outside the tree, on the Pallas backward,
    leaves its parameter flows to the batched pass like the tree's blocks (it asked for the group's accumulator,
    which the batched pass does not carry: a KeyError); log-likelihoods and flows equal XLA's within TF32's
    rounding."""
    c, x = hclt
    want, ll_want = c.flows(c.params, x, options=jaxpc.Options(impl="xla", precision="fp32"), return_ll=True)
    batched, ll = c.flows(c.params, x, options=CLUSTERS, return_ll=True)
    np.testing.assert_allclose(np.asarray(ll), np.asarray(ll_want), rtol=1e-4)
    for a, b in zip(jax.tree_util.tree_leaves(batched), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-3 * float(np.max(np.abs(b))))


@pytest.mark.parametrize("n,Kp,Kc,B,start", [(3, 64, 32, 16, 1), (2, 128, 64, 11, 0), (2, 64, 256, 40, 1)])
def test_the_summed_param_flow_kernel_multiplies_the_product_by_the_weights(n, Kp, Kc, B, start):
    """:func:`mosaic_tree.summed_param_flows` (on the interpreter): ``exp(logw[start + i]) * scale[i] @ y[i].T`` per
    block, within TF32's rounding of the operands, with child columns split over programs (``Kc`` 256), samples
    padded (11, 40) and weights read from ``start``; bad shapes and ranges are refused by name."""
    rng = np.random.default_rng(n + Kc)
    scale = jnp.asarray(rng.random((n, Kp, B)), jnp.float32)
    y = jnp.asarray(rng.random((n, Kc, B)), jnp.float32)
    logw = jnp.asarray(rng.normal(size=(start + n + 1, Kp, Kc)), jnp.float32)
    got = mosaic_tree.summed_param_flows(scale, y, logw, start, interpret=True)
    ref = jnp.exp(logw[start:start + n]) * jnp.einsum("nkb,ncb->nkc", scale, y, precision="highest")
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-3)
    with pytest.raises(ValueError, match="outside the"):
        mosaic_tree.summed_param_flows(scale, y, logw, start + 2, interpret=True)
    with pytest.raises(ValueError, match="needs scale"):
        mosaic_tree.summed_param_flows(scale[:, :32], y, logw[:, :32], start, interpret=True)
    with pytest.raises(ValueError, match="needs scale"):
        mosaic_tree.summed_param_flows(scale, y[:1], logw, start, interpret=True)


@pytest.mark.slow
@pytest.mark.full
def test_repeated_calls_read_the_weight_copies_kept_for_their_parameters(tree):
    """Where the tree's levels run on clusters, ``log_prob``, ``flows`` and ``conditional`` read the weights' TF32
    copies made once per parameter array (``Runtime.kept``): a repeated call (replayed) makes none, new parameters
    make new ones, and every answer is bit for bit the one of a traced call, which makes its copies inside its
    executable."""
    c = tree[0]
    x = jnp.asarray(np.random.default_rng(6).integers(0, 3, (16, c.num_vars)).astype(np.int32))
    group = c.layout.fold.tree.group
    made = []

    def counted(part):
        make = jaxpc.engine.stages.WEIGHT_COPIES[part]
        return lambda logw: made.append(part) or make(logw)

    m = np.zeros(c.num_vars, bool)
    m[::3] = True

    # no kept copies: calls inside a trace (each jitted once, its executable making its copies for any parameters)
    traced_flows = jax.jit(lambda p: c.flows(p, x, options=CLUSTERS, return_ll=True))
    traced_log_prob = jax.jit(lambda p: c.log_prob(p, x, options=CLUSTERS))
    traced_conditional = jax.jit(lambda p: c.conditional(p, x, m, options=CLUSTERS))

    def traced(params):
        fl, ll = traced_flows(params)
        return fl, ll, traced_log_prob(params), traced_conditional(params)

    def called(params):
        fl, ll = c.flows(params, x, options=CLUSTERS, return_ll=True)
        return fl, ll, c.log_prob(params, x, options=CLUSTERS), c.conditional(params, x, m, options=CLUSTERS)

    # new arrays of c.params' values: the module's other tests may have kept copies for c.params itself
    first = jax.tree_util.tree_map(lambda a: a + 0, c.params)
    logw = first["sum"][group]
    other = {**first, "sum": {**first["sum"], group: jax.nn.log_softmax(
        logw + jnp.asarray(np.random.default_rng(7).normal(0, 0.5, logw.shape), logw.dtype), axis=-1)}}
    want = {}  # the traced answers, once per parameter set (the same executables on the same values)
    with mock.patch.dict(jaxpc.engine.stages.WEIGHT_COPIES, {p: counted(p) for p in ("w", "wt")}):
        for name, params, makes in (("first", first, ["w", "wt"]), ("first", first, []),
                                    ("other", other, ["w", "wt"]), ("other", other, [])):
            made.clear()
            got = called(params)
            assert sorted(made) == makes
            if name not in want:
                want[name] = traced(params)
            for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want[name])):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the executable reads the kept copies (halved weights: every log-likelihood lower by log 2 per tree level)
    third = jax.tree_util.tree_map(lambda a: a + 0, c.params)  # new arrays (no kept copies), c.params' values
    halved = {p: (lambda make: lambda logw: make(logw) * 0.5)(make) for p, make in
              jaxpc.engine.stages.WEIGHT_COPIES.items()}
    with mock.patch.object(jaxpc.engine.stages, "WEIGHT_COPIES", halved):
        ll = c.log_prob(third, x, options=CLUSTERS)
    assert np.all(np.asarray(ll) < np.asarray(want["first"][2]) - 0.5)  # (the traced log_prob of those values)


def test_the_weight_copies_are_kept_only_where_the_call_reads_them(tree, monkeypatch):
    """``Runtime.tree_weights``: the forward's copy for ``log_prob``, both for ``flows`` (only the transposed one
    where the forward exponentiates in its kernel), none off the cluster route (a larger batch, the levels one by
    one), for traced parameters, above ``KEPT_WEIGHT_BYTES`` or without the clusters' schedules; the copies are the
    ones the executable would make."""
    c = tree[0]
    logw = c.params["sum"][c.layout.fold.tree.group]

    def kept(entry, options, B=16, params=None):
        route = (entry, options) if entry == "flows" else (entry, options, None, None)
        out = c.runtime.tree_weights(c.layout, c.params if params is None else params, B, route, lambda: options,
                                     entry == "flows")
        return None if out is None else sorted(out)

    assert (kept("flows", CLUSTERS), kept("log_prob", CLUSTERS)) == (["w", "wt"], ["w"])
    got = c.runtime.tree_weights(c.layout, c.params, 16, ("flows", CLUSTERS), lambda: CLUSTERS, True)
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(mosaic_tree.tf32_weights(logw)))
    np.testing.assert_array_equal(np.asarray(got["wt"]), np.asarray(mosaic_tree.tf32_weights_t(logw)))
    in_kernel = CLUSTERS.replace(tuning=jaxpc.Tuning(tree_clusters=True, tree_log_weights=True))
    assert (kept("flows", in_kernel), kept("log_prob", in_kernel)) == (["wt"], None)
    level_by_level = CLUSTERS.replace(tuning=jaxpc.Tuning(tree_clusters=False))
    assert kept("flows", CLUSTERS, B=128) is None and kept("flows", level_by_level) is None
    seen = []
    jax.make_jaxpr(lambda p: seen.append(kept("flows", CLUSTERS, params=p)))(c.params)
    assert seen == [None]
    monkeypatch.setattr(jaxpc.runtime, "KEPT_WEIGHT_BYTES", 2 * logw.nbytes - 1)
    assert kept("flows", CLUSTERS) is None and kept("log_prob", CLUSTERS) == ["w"]
    assert c.runtime.clusters  # (a circuit whose tables hold no cluster schedules looks for none)
    monkeypatch.setattr(c.runtime, "clusters", False)
    assert kept("log_prob", CLUSTERS) is None
