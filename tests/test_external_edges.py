"""Edge cases of per-sample sum parameters (BlockScale gates, LowRank factors): parent rows whose gates are all -inf,
gates far outside exp's range, slots of zero shared weight under a large gate, padded slots, and LowRank products
beyond the float32 range. Every case against a float64 reference that builds each sample's effective weights
densely; a node whose effective weights are all zero has the value -inf and passes no gradient."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc.ops.sum_layer_external import sum_layer_external_reference

from .test_evidence import _dense_reference, _gate_columns, _safe_div, _sum_edges
from .test_evidence import _gated_circuit as _build_gated_circuit
from .tiers import cases

# one compiled circuit per gate case for the module (no test changes one): tests of the same evidence shapes and
# options share its executables
_gated_circuit = functools.cache(_build_gated_circuit)

ROUTES = {"default": jaxpc.Options(), "xla": jaxpc.Options(impl="xla"),
          "full_layout": jaxpc.Options(impl="xla", fold_products=False), "pallas": jaxpc.Options(impl="pallas"),
          "autodiff": jaxpc.Options(backward="autodiff")}


def _close(got, want, what, rtol=1e-4):
    """``got`` equals ``want`` (float64) to ``rtol`` of the largest entry: no NaN, -inf where -inf."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert not np.isnan(got).any(), f"{what}: NaN"
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=what)
    fin = np.isfinite(want)
    scale = max(1.0, float(np.max(np.abs(want[fin]), initial=0.0))) if what.startswith("ll") else \
        float(np.max(np.abs(want[fin]), initial=0.0))
    np.testing.assert_allclose(got[fin], want[fin], rtol=rtol, atol=rtol * scale + 1e-7, err_msg=what)


def _check(c, params, x, ev, options, em=True):
    """LL, shared-parameter flows, evidence gradients (``flows(return_evidence_grad=True)`` and ``jax.grad``) and
    one EM step of ``c`` under ``ev`` and ``options`` against :func:`test_evidence._dense_reference`."""
    ll_ref, fl_ref, g_ref = _dense_reference(c, params, x, ev.get("sum_gates"), ev.get("sum_lowrank"))
    _close(c.log_prob(params, x, evidence=ev, options=options), ll_ref, "ll")
    fl, ll, eg = c.flows(params, x, evidence=ev, options=options, return_ll=True, return_evidence_grad=True)
    _close(ll, ll_ref, "ll of flows")
    sources = [ns for ns in c.nodes if ns.is_sum() and ns.source is ns]
    for ns in sources:
        _close(c.get_node_flows(fl, ns), fl_ref[ns.id], f"flows of {ns.name}")
    grad = _ll_grad(c, options)(jax.tree_util.tree_map(jnp.asarray, ev), params, x, np.isfinite(ll_ref))
    for key in ev:
        for got, via, want in zip(jax.tree_util.tree_leaves(grad[key]), jax.tree_util.tree_leaves(eg[key]),
                                  jax.tree_util.tree_leaves(g_ref[key])):
            _close(got, want, f"jax.grad by {key}")
            _close(via, want, f"evidence grad of flows by {key}")
    if em:  # pseudocount 0: each node moves to its normalized flows, a node of no flow keeps its weights
        new = c.em_step(params, x, evidence=ev, options=options, pseudocount=0.0)
        for ns in sources:
            f = fl_ref[ns.id]
            tot = f.sum(1, keepdims=True)
            old = np.asarray(c.get_node_params(params, ns), np.float64)
            want = np.where(tot > 0, _safe_div(f, tot), old)
            _close(c.get_node_params(new, ns), want, f"em_step of {ns.name}")


@functools.cache
def _ll_grad(c, options):
    """``jax.grad`` of the LL summed over the samples of finite reference LL, by the evidence: one jitted function
    per circuit and options (the parameters, data and mask its arguments), so that tests of the same shapes share
    its executable."""
    def ll(e, params, x, finite):
        return jnp.sum(jnp.where(finite, c.log_prob(params, x, evidence=e, options=options), 0.0))
    return jax.jit(jax.grad(ll))


def _row_columns(c, ns, gates, row):
    """The gate columns that parent ``row`` of sum vector ``ns`` reads in ``gates`` (``(key, cols)``)."""
    key, cols = _gate_columns(c, ns, _sum_edges(c, c.params, ns)[1], gates)
    return key, np.unique(cols[row][cols[row] >= 0])


def _vectors(c):
    return {ns.name: ns for ns in c.nodes if ns.is_sum()}


# ---- all gates of a parent row -inf --------------------------------------------------------------------------

def _dead_row_evidence(c, form, where, lowrank, B=3):
    """Random gates (``form``: the gate columns or ``{group: [B, P]}``), every gate of one parent row of ``s01``
    (``where="inner"``: the LL stays finite) or of the root (``"root"``: the LL is -inf) -inf for sample 0, every
    gate of ``r01``'s row 1 -inf for sample 2; LowRank factors too with ``lowrank``."""
    rng = np.random.default_rng(3)
    if form == "columns":
        gates = rng.normal(size=(B, c.num_gates)).astype(np.float32)
    else:
        gates = {g.key: rng.normal(size=(B, g.num_blocks)).astype(np.float32) for g in c.layout.sum_groups}
    vec = _vectors(c)
    for b, name, row in ((0, "s01" if where == "inner" else "root", 0), (2, "r01", 1)):
        key, cols = _row_columns(c, vec[name], gates, row)
        (gates if key is None else gates[key])[b, cols] = -np.inf
    ev = {"sum_gates": gates}
    if lowrank:
        ev["sum_lowrank"] = {g.key: {"u": rng.random((B, g.num_blocks, g.Kp, 2)).astype(np.float32),
                                     "v": rng.random((B, g.num_blocks, 2, g.Kc)).astype(np.float32)}
                             for g in c.layout.sum_groups}
    return ev


@pytest.mark.parametrize("form,where,lowrank", cases(
    [("columns", "inner", False), ("columns", "root", False), ("columns", "inner", True),
     ("per_block", "inner", False), ("per_block", "root", True)], fast=[], unpack=True))
@pytest.mark.full
def test_a_parent_row_of_minus_inf_gates_is_a_zero_node(form, where, lowrank):
    """Every gate of a parent row -inf: its effective weights are all zero, so the node's value is -inf (as a node
    of zero weights) and it passes no gradient: the LL, flows, evidence gradients and EM step equal the float64
    reference, none NaN; where the root is that node the sample's LL is -inf and it adds nothing."""
    c = _gated_circuit("rows" if form == "columns" else "legacy")
    x = np.random.default_rng(4).integers(0, 3, (3, 4)).astype(np.int32)
    ev = _dead_row_evidence(c, form, where, lowrank)
    _check(c, c.params, x, ev, ROUTES["default"])


@pytest.mark.slow
@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.full
def test_minus_inf_gates_on_every_route(route):
    """The zero node of -inf gates, with LowRank factors, on every route the CPU runs (XLA on the folded and the
    full layout, Pallas in interpret mode for the ungated partitions, the autodiff backward)."""
    c = _gated_circuit("rows")
    x = np.random.default_rng(4).integers(0, 3, (3, 4)).astype(np.int32)
    _check(c, c.params, x, _dead_row_evidence(c, "columns", "root", True), ROUTES[route])


# ---- gates and factors beyond float32's range ------------------------------------------------------------------

@pytest.mark.slow
def test_gates_beyond_exp_range_and_zero_weight_slots():
    """Gates of +-200 (exp overflows or underflows float32) on padded partitions, and a slot of zero shared weight
    under a gate far above its row's others: only slots with weight set the row's scale, so the row's live slots do
    not underflow to a zero node."""
    c = _gated_circuit("rows")
    vec = _vectors(c)
    rng = np.random.default_rng(8)
    B = 3
    x = rng.integers(0, 3, (B, 4)).astype(np.int32)
    gates = rng.normal(size=(B, c.num_gates)).astype(np.float32)
    gates[0, c.gate_slice(vec["r01"])] -= 200.0  # every gate of the padded partitions far below 0
    gates[1, c.gate_slice(vec["r01"])] += 200.0
    # s01's parent rows 0 and 1 read one gate per edge block: zero the shared weights of edge block 0 for both rows
    s01 = vec["s01"]
    group, blocks = c.param_slice(s01)
    params = jax.tree_util.tree_map(lambda a: a, c.params)
    params["sum"][group] = params["sum"][group].at[blocks.start, :2].set(-jnp.inf)
    key, cols = _row_columns(c, s01, gates, 0)
    first = _gate_columns(c, s01, _sum_edges(c, params, s01)[1], gates)[1][0, :s01.ch_block_size][0]
    gates[2, cols] = -20.0
    gates[2, first] = 150.0  # the zero-weight slot's gate
    _check(c, params, x, {"sum_gates": gates}, ROUTES["default"], em=False)


def _big_lowrank(c, B, rng):
    """LowRank factors whose products reach 1e50 (beyond float32) in some blocks, with zero ``V`` rows and zero
    ``U`` rows elsewhere."""
    out = {}
    for g in c.layout.sum_groups:
        u = rng.random((B, g.num_blocks, g.Kp, 2))
        v = rng.random((B, g.num_blocks, 2, g.Kc))
        u[0] *= 1e25
        v[0] *= 1e25
        u[1, ::2] *= 1e30  # large U over small V: products within range
        v[1, ::2] *= 1e-30
        u[2, :, 0] = 0.0
        v[2, :, 1] = 0.0
        v[2, ::2] *= 1e20
        out[g.key] = {"u": u.astype(np.float32), "v": v.astype(np.float32)}
    return out


@pytest.mark.parametrize("gated", cases([False, True], fast=[]))
@pytest.mark.full
def test_lowrank_beyond_float32_range_is_exact(gated):
    """Finite LowRank factors whose products ``U V`` overflow float32 give the exact normalized weights: the LL,
    flows (each shared weight's share ``w / (w + U V)``, here nearly 0), the gradients by the factors (including
    those of zero ``V`` rows) and the gates equal the float64 reference, none NaN."""
    c = _gated_circuit("rows" if gated else "none")
    rng = np.random.default_rng(9)
    B = 3
    x = rng.integers(0, 3, (B, 4)).astype(np.int32)
    ev = {"sum_lowrank": _big_lowrank(c, B, rng)}
    if gated:
        ev["sum_gates"] = rng.normal(size=(B, c.num_gates)).astype(np.float32)
    _check(c, c.params, x, ev, ROUTES["default"])


# ---- the layer alone -----------------------------------------------------------------------------------------

def _layer_reference(y, w, keep, gates, u, v):
    """Float64 values ``[n, Kp, B]`` of one layer: ``y [n, C, Kc, B]`` children (linear), ``w [n, C, Kp, Kc]``,
    ``gates [n, C, Kp, B]``, ``u [B, n, C, Kp, r]``, ``v [B, n, C, r, Kc]``; a zero row is -inf."""
    a = w[..., None] + np.einsum("bncpr,bncrk->ncpkb", u, v)
    a = a * np.exp(gates)[:, :, :, None, :] * keep[:, :, None, None, None]
    s = np.einsum("ncpkb,nckb->npb", a, y)
    Z = a.sum(axis=(1, 3))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(Z > 0, np.log(s) - np.log(np.where(Z > 0, Z, 1.0)), -np.inf)


def test_layer_values_and_gradients_at_the_edges():
    """One padded partition alone: rows of all -inf gates, gates of -300 and +300, a padded slot whose gate is far
    above its row's, LowRank products of 1e60 and a zero ``V`` row: values equal the float64 reference, and
    ``jax.grad`` by the gates and factors is zero for the zero node and equals central differences of the
    reference."""
    rng = np.random.default_rng(1)
    n, C, Kp, Kc, B, r = 2, 3, 2, 2, 2, 2
    pad_row = 8  # rows 8, 9: -inf
    b64 = np.concatenate([rng.normal(size=(8, B)), np.full((2, B), -np.inf)])
    buf = jnp.asarray(b64, jnp.float32)
    ch = np.array([[0, 2, 4], [4, 6, pad_row]])
    pid = np.array([[0, 1, 2], [1, 2, 0]])
    logw = rng.normal(size=(3, Kp, Kc))
    gates = rng.normal(size=(n, C, Kp, B)).astype(np.float32)
    gates[0, :, 0, 0] = -np.inf  # node 0's row 0, sample 0: a zero node
    gates[1, :2, 1, 1] = -300.0  # node 1's row 1, sample 1: live slots far below 0, the padded slot at 50
    gates[1, 2, 1, 1] = 50.0
    gates[0, :, 1, 1] = 300.0 + np.arange(3)
    u = rng.random((B, 3, Kp, r)).astype(np.float32)
    v = rng.random((B, 3, r, Kc)).astype(np.float32)
    u[1, 2] *= 1e30
    v[1, 2] *= 1e30
    v[0, 1, 0] = 0.0
    lowrank = {"u": jnp.asarray(u), "v": jnp.asarray(v)}

    @jax.jit
    def layer(g, lr):
        return sum_layer_external_reference(buf, jnp.asarray(ch, jnp.int32), jnp.asarray(pid, jnp.int32),
                                            jnp.asarray(logw, jnp.float32), Kp=Kp, Kc=Kc, dense=False, gates=g,
                                            lowrank=lr, pad_row=pad_row).reshape(n, Kp, B)

    keep = (ch != pad_row).astype(np.float64)
    ys = np.exp(b64.astype(np.float32).astype(np.float64)[ch[:, :, None] + np.arange(Kc)])  # [n, C, Kc, B]
    w64 = np.exp(logw.astype(np.float32).astype(np.float64))[pid]
    u64, v64 = np.asarray(u, np.float64)[:, pid], np.asarray(v, np.float64)[:, pid]
    zeros = np.zeros_like(u64)
    for gt, lr, uu in ((gates, None, zeros), (None, lowrank, u64), (gates, lowrank, u64)):
        got = np.asarray(layer(None if gt is None else jnp.asarray(gt), lr), np.float64)
        want = _layer_reference(ys, w64, keep, np.zeros(gates.shape) if gt is None else gt.astype(np.float64), uu,
                                v64)
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
        fin = np.isfinite(want)
        np.testing.assert_allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5)
    assert np.isneginf(got[0, 0, 0])
    gg, gl = jax.jit(jax.grad(lambda g, lr: jnp.sum(jnp.where(jnp.isfinite(layer(g, lr)), layer(g, lr), 0.0)),
                              argnums=(0, 1)))(jnp.asarray(gates), lowrank)
    assert not np.asarray(gg[0, :, 0, 0]).any()  # the zero node passes no gradient
    # central differences of the float64 reference, by each gate and by each factor's log (or the factor at 0)
    g64 = gates.astype(np.float64)
    fin = np.isfinite(want)

    def loss(gt, uu, vv):
        return _layer_reference(ys, w64, keep, gt, uu[:, pid], vv[:, pid])[fin].sum()

    args = [g64, np.asarray(u, np.float64), np.asarray(v, np.float64)]
    for k, got in enumerate((gg, gl["u"], gl["v"])):
        got = np.asarray(got, np.float64)
        assert np.isfinite(got).all()
        a = args[k]
        for idx in zip(*np.nonzero(np.isfinite(a))):
            h = 1e-5 * (1.0 if k == 0 or a[idx] == 0 else abs(a[idx]))
            fd = []
            for sgn in (1, -1):
                moved = [b.copy() for b in args]
                moved[k][idx] += sgn * h
                fd.append(loss(*moved))
            d = (fd[0] - fd[1]) / (2 * h)
            scale = 1.0 if k == 0 or a[idx] == 0 else a[idx]
            assert got[idx] * scale == pytest.approx(d * scale, rel=1e-3, abs=1e-4), (k, idx)
