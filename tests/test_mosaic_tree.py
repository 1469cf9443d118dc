"""The tree levels on thread-block clusters (:mod:`jaxpc.ops.mosaic_tree`): its schedules' invariants, its forward
in Pallas's Mosaic GPU interpreter (the kernel the GPU runs) against the level-by-level forward, and its backward
against the child flows in float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc import distributions
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


def tree_flows(tab, spec, vals, logw, flows):
    """The flow buffer ``flows`` (given at the top blocks' rows) with every tree block's child flows written, level
    by level from the top, in float64: ``sum_r F_r W_rk exp(x_k - y_r)`` into each of the child's row blocks."""
    lev, prow, pid, ch = tab["lev"], tab["prow"], tab["pid"][:, 0], tab["ch"][:, 0, :]
    w = np.exp(np.asarray(logw, np.float64))
    v = np.asarray(vals, np.float64)
    out = np.asarray(flows, np.float64).copy()
    for lv in reversed(range(len(lev) - 1)):
        for b in range(lev[lv], lev[lv + 1]):
            f, y = out[prow[b]:prow[b] + spec.Kp], v[prow[b]:prow[b] + spec.Kp]
            x = sum(v[r:r + spec.Kc] for r in ch[b])
            g = np.einsum("rb,rk,rkb->kb", f, w[pid[b]], np.exp(x[None] - y[:, None]))
            for r in ch[b][ch[b] != 0]:  # row 0: the padding's zeros
                out[r:r + spec.Kc] = g
    return out


def test_the_cluster_backward_matches_the_child_flows(tree):
    """Two launches (the levels below 2 on two clusters, 32-row tasks) each way. The forward from the weights
    matches the level-by-level one; from flows given at the tree's top blocks, the backward writes every tree
    block's flows and those of its child's input-layer rows: against :func:`tree_flows`, within the TF32 operands'
    error."""
    c, spec, tab, vals = tree
    tabs = jax.tree.map(jnp.asarray, mosaic_tree.schedule(tab, spec, clusters=2, split=2, tile=32))
    logw = c.params["sum"][spec.group]
    rows = np.asarray(tabs["rows"])
    out, copies = mosaic_tree.forward(jnp.asarray(vals).at[rows].set(jnp.nan), tabs, None, spec,
                                      weights=mosaic_tree.tf32_weights(logw), tile=32, keep=True)
    np.testing.assert_allclose(np.asarray(out), vals, rtol=1e-4, atol=1e-3)  # the forward from the weights
    top = rows.reshape(-1, spec.Kp)[np.asarray(tabs["top"])].ravel()
    given = np.random.default_rng(1).uniform(0.1, 1.0, (len(top), vals.shape[1])).astype(np.float32)
    flows = jnp.zeros(vals.shape, jnp.float32).at[top].set(given)
    got = np.asarray(mosaic_tree.backward(flows, copies, tabs, mosaic_tree.tf32_weights_t(logw), spec, tile=32))
    want = tree_flows(tab, spec, vals, logw, flows)
    written = np.abs(want).sum(axis=1) > 0
    assert written[rows].all() and written.sum() > len(rows)  # the tree's rows and input-layer rows
    np.testing.assert_array_equal(got[~written], 0.0)
    np.testing.assert_allclose(got[written], want[written], rtol=1e-3, atol=1e-6)


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


def test_the_cluster_forward_matches_the_level_by_level_forward(tree):
    """The interpreter's kernel (TF32 operands rounded to nearest) against the float32 levels: one launch on one
    cluster from the log-weights (the backward's test runs two launches from the weights)."""
    c, spec, tab, vals = tree
    tabs = jax.tree.map(jnp.asarray, mosaic_tree.schedule(tab, spec, split=0))
    logw = c.params["sum"][spec.group]
    rows = tabs["rows"]
    start = jnp.asarray(vals).at[rows].set(jnp.nan)  # every parent row must be written
    out = mosaic_tree.forward(start, tabs, logw, spec)
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
    with pytest.raises(ValueError, match="take the weights"):
        mosaic_tree.forward(jnp.asarray(vals), tabs, logw, spec, tile=16)
