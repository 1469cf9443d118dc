"""Per-call evidence (the CoDD workload): soft-evidence leaves (dense and top-k), External leaves, latent
log-potentials, BlockScale and LowRank per-sample sum parameters; references, finite differences, the
executable cache and jit(grad(...))."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc import distributions, structures
from jaxpc.engine import em
from jaxpc.ops.sum_layer_external import dense_weights_reference

from . import oracle
from .random_circuits import Generator
from .test_hmm import forward_backward
from .tiers import cases


def _hmm_params(c):
    trans = {int(ns.name[5:]): ns for ns in c.nodes if ns.name.startswith("trans")}
    emit = {int(ns.name[4:]): ns for ns in c.nodes if ns.name.startswith("emit")}
    T = len(emit)
    a = [np.asarray(c.get_node_params(c.params, trans[t]), np.float64) for t in range(T - 1)]
    b = [np.asarray(c.get_node_params(c.params, emit[t]), np.float64) for t in range(T)]
    g = np.asarray(c.get_node_params(c.params, c.root), np.float64)[0]
    return a, b, g


def _reweighted_forward(a, b, g, x, e):
    """Forward algorithm with emissions theta_i[x] e[x] / sum_k theta_ik e^{e_k} (per sample and step)."""
    B, T = x.shape
    out = []
    for s in range(B):
        bt = []
        for t in range(T):
            w = b[t] * np.exp(e[s, t])[None, :]
            bt.append(w / w.sum(1, keepdims=True))
        out.append(forward_backward(a, bt, g, x[s:s + 1])[0][0])
    return np.array(out)


@pytest.mark.slow  # (the slow tier runs its first case: the inhomogeneous HMM)
@pytest.mark.parametrize("homogeneous", [False, True])
def test_soft_evidence_hmm_dense_and_topk(homogeneous):
    rng = np.random.default_rng(0)
    T, L, V, B = 5, 4, 7, 3
    c = jaxpc.compile(structures.GeneralizedHMM(T, L, distributions.SoftEvidenceCategorical(V), homogeneous=homogeneous,
                                                block_size=2), seed=2)
    a, b, g = _hmm_params(c)
    x = rng.integers(0, V, (B, T)).astype(np.int32)
    e = rng.normal(size=(B, T, V)).astype(np.float32)
    ref = _reweighted_forward(a, b, g, x, e.astype(np.float64))
    got = c.log_prob(c.params, x, evidence={"categorical_logp": e})
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5)
    # top-k: the observed token plus 3 others; dense evidence that is -inf off the candidates is the same evidence
    k = 4
    ids = np.stack([np.stack([np.concatenate([[x[s, t]], rng.choice(np.setdiff1d(np.arange(V), [x[s, t]]), k - 1,
                                                                     replace=False)]) for t in range(T)])
                    for s in range(B)]).astype(np.int32)
    perm = rng.permuted(np.tile(np.arange(k), (B, T, 1)), axis=2)  # the observed token is in no fixed slot
    ids = np.take_along_axis(ids, perm, 2)
    lp = np.take_along_axis(e, ids, 2)
    dense = np.full_like(e, -np.inf)
    np.put_along_axis(dense, ids, lp, 2)
    top = c.log_prob(c.params, x, evidence={"categorical_topk": {"ids": ids, "logp": lp}})
    dense_ll = c.log_prob(c.params, x, evidence={"categorical_logp": dense})
    np.testing.assert_allclose(np.asarray(top), np.asarray(dense_ll), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(top), _reweighted_forward(a, b, g, x, dense.astype(np.float64)), rtol=1e-5)
    # a value mask drops candidates exactly like -inf evidence does
    mask = rng.random(ids.shape) < 0.7
    mask |= ids == x[:, :, None]
    masked = np.where(mask, lp, -np.inf)
    dense2 = np.full_like(e, -np.inf)
    np.put_along_axis(dense2, ids, masked, 2)
    np.testing.assert_allclose(
        np.asarray(c.log_prob(c.params, x, evidence={"categorical_topk": {"ids": ids, "logp": lp, "mask": mask}})),
        np.asarray(c.log_prob(c.params, x, evidence={"categorical_logp": dense2})), rtol=1e-5)


def test_every_position_reads_its_own_evidence():
    """Fails if evidence (or parameters) of every variable were taken from the first one."""
    rng = np.random.default_rng(1)
    T, L, V = 4, 2, 5
    c = jaxpc.compile(structures.GeneralizedHMM(T, L, distributions.SoftEvidenceCategorical(V), homogeneous=False))
    a, b, g = _hmm_params(c)
    x = rng.integers(0, V, (2, T)).astype(np.int32)
    e = np.zeros((2, T, V), np.float32)
    e[:, 2, :] = rng.normal(size=(2, V)) * 3  # evidence on one position only
    got = np.asarray(c.log_prob(c.params, x, evidence={"categorical_logp": e}))
    np.testing.assert_allclose(got, _reweighted_forward(a, b, g, x, e.astype(np.float64)), rtol=1e-5)
    shifted = np.roll(e, 1, axis=1)
    assert not np.allclose(got, np.asarray(c.log_prob(c.params, x, evidence={"categorical_logp": shifted})))


def _fd(f, arr, idx, h=1e-2):
    up, dn = arr.copy(), arr.copy()
    up[idx] += h
    dn[idx] -= h
    return (float(f(up)) - float(f(dn))) / (2 * h)


@pytest.mark.slow
def test_evidence_gradients_equal_finite_differences():
    rng = np.random.default_rng(2)
    T, L, V, B = 4, 4, 6, 2
    c = jaxpc.compile(structures.GeneralizedHMM(T, L, distributions.SoftEvidenceCategorical(V), block_size=2))
    x = rng.integers(0, V, (B, T)).astype(np.int32)
    e = rng.normal(size=(B, T, V))
    # V - 1 distinct candidates per position, the observed value first
    ids = np.array([[np.concatenate([[v], np.setdiff1d(np.arange(V), [v])])[:V - 1] for v in row] for row in x],
                   np.int32)
    lp = rng.normal(size=ids.shape)

    def dense_total(ee):
        return jnp.sum(c.log_prob(c.params, x, evidence={"categorical_logp": jnp.asarray(ee, jnp.float32)}))

    def topk_total(ll):
        return jnp.sum(c.log_prob(c.params, x, evidence={"categorical_topk": {"ids": ids,
                                                                                "logp": jnp.asarray(ll, jnp.float32)}}))

    gd = np.asarray(jax.jit(jax.grad(dense_total))(jnp.asarray(e, jnp.float32)))  # jit: no op-by-op autodiff
    gt = np.asarray(jax.jit(jax.grad(topk_total))(jnp.asarray(lp, jnp.float32)))
    for idx in [(0, 1, 2), (1, 3, int(x[1, 3])), (1, 0, 5)]:
        assert gd[idx] == pytest.approx(_fd(dense_total, e, idx), rel=2e-2, abs=2e-3)
    for idx in [(0, 2, 0), (1, 1, 3)]:
        assert gt[idx] == pytest.approx(_fd(topk_total, lp, idx), rel=2e-2, abs=2e-3)
    # latent potentials and external leaf values
    lat = rng.normal(size=(B, T, L))

    def latent_total(pp):
        return jnp.sum(c.log_prob(c.params, x, evidence={"categorical_logp": jnp.asarray(e, jnp.float32),
                                                         "latent": jnp.asarray(pp, jnp.float32)}))

    gl = np.asarray(jax.jit(jax.grad(latent_total))(jnp.asarray(lat, jnp.float32)))
    assert gl[0, 2, 1] == pytest.approx(_fd(latent_total, lat, (0, 2, 1)), rel=2e-2, abs=2e-3)


def test_latent_potentials_on_an_hmm():
    rng = np.random.default_rng(3)
    T, L, V, B = 5, 3, 4, 3
    c = jaxpc.compile(structures.HMM(T, L, V))
    a, b, g = _hmm_params(c)
    x = rng.integers(0, V, (B, T)).astype(np.int32)
    phi = rng.normal(size=(B, T, L))
    got = np.asarray(c.log_prob(c.params, x, evidence={"latent": phi.astype(np.float32)}))
    for s in range(B):  # unnormalized: emissions times exp(phi)
        bt = [b[t] * np.exp(phi[s, t])[:, None] for t in range(T)]
        assert got[s] == pytest.approx(forward_backward(a, bt, g, x[s:s + 1])[0][0], rel=1e-5)


def test_external_leaves():
    rng = np.random.default_rng(4)
    V, L = 3, 4
    leaves = [jaxpc.inputs(v, num_nodes=L, dist=distributions.External()) for v in range(V)]
    root = jaxpc.summate(jaxpc.multiply(*leaves), num_nodes=1)
    c = jaxpc.compile(root)
    ext = rng.normal(size=(2, V, L)).astype(np.float32)
    x = np.zeros((2, V), np.int32)
    w = np.asarray(c.get_node_params(c.params, root))[0]
    ref = np.log(np.einsum("l,bl->b", w, np.exp(ext.sum(1))))
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x, evidence={"external": ext})), ref, rtol=1e-5)
    g = np.asarray(jax.jit(jax.grad(lambda q: jnp.sum(c.log_prob(c.params, x, evidence={"external": q}))))(
        jnp.asarray(ext)))
    post = w[None] * np.exp(ext.sum(1))
    np.testing.assert_allclose(g, np.repeat((post / post.sum(1, keepdims=True))[:, None, :], V, 1), rtol=1e-4)
    with pytest.raises(ValueError, match=r"evidence\['external'\] must have shape \[2, 3, 4\] .* External leaf"):
        c.log_prob(c.params, x, evidence={"external": ext[:, :, :1]})
    with pytest.raises(ValueError, match="External leaves need evidence"):
        c.log_prob(c.params, x)


# ---- per-sample sum parameters -----------------------------------------------------------------------

def _per_sample_reference(c, params, x, gates, lowrank):
    """Dense per-sample reference: materialize every sample's normalized weights, evaluate one by one. (The weights
    of a sample in one jitted program, the same for every sample: op by op, each operation would compile.)"""

    @jax.jit
    def log_weights(sum_params, gates, lowrank):  # one sample's: gates and lowrank sliced to [1, ...]
        w = {}
        for grp in c.layout.sum_groups:
            k = grp.key
            gt = None if gates is None or k not in gates else gates[k]
            lr = None if lowrank is None or k not in lowrank else lowrank[k]
            w[k] = dense_weights_reference(sum_params[k], gt, lr)[0]
        return jax.tree_util.tree_map(jnp.log, em.normalize_sum_params(c.layout, c.tables, w, 0.0))

    def row(d, s):  # sample s's slice [1, ...] of every array of d
        return None if d is None else jax.tree_util.tree_map(lambda v: jnp.asarray(v[s:s + 1]), d)

    out = []
    for s in range(x.shape[0]):
        sums = log_weights(params["sum"], row(gates, s), row(lowrank, s))
        out.append(float(c.log_prob({"sum": sums, "input": params["input"]}, x[s:s + 1])[0]))
    return np.array(out)


@pytest.mark.parametrize("kind", cases(["both"], fast=[]))  # the granularities: the test of gate columns below
@pytest.mark.full
def test_blockscale_and_lowrank_match_dense_per_sample_reference(kind):
    gen = Generator(8, 4, kinds=("categorical", "bernoulli"))  # ragged: sparse edges, ties, mixed blocks
    c = jaxpc.compile(gen.circuit())
    x = gen.sample_data(5).astype(np.int32)
    rng = np.random.default_rng(5)
    gates = {g.key: rng.normal(size=(5, g.num_blocks)).astype(np.float32) for g in c.layout.sum_groups}
    lowrank = {g.key: {"u": rng.random((5, g.num_blocks, g.Kp, 2)).astype(np.float32),
                       "v": rng.random((5, g.num_blocks, 2, g.Kc)).astype(np.float32)} for g in c.layout.sum_groups}
    ev = {"gates": {"sum_gates": gates}, "lowrank": {"sum_lowrank": lowrank},
          "both": {"sum_gates": gates, "sum_lowrank": lowrank}}[kind]
    got = np.asarray(c.log_prob(c.params, x, evidence=ev))
    ref = _per_sample_reference(c, c.params, x, ev.get("sum_gates"), ev.get("sum_lowrank"))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    # gradients w.r.t. the per-sample tensors: finite differences
    key = c.layout.sum_groups[-1].key
    if "sum_gates" in ev:
        def f(gk):
            return jnp.sum(c.log_prob(c.params, x, evidence={**ev, "sum_gates": {**gates, key: jnp.asarray(gk)}}))
        grad = np.asarray(jax.jit(jax.grad(f))(jnp.asarray(gates[key])))  # jit: no op-by-op autodiff
        idx = (2, 0)
        assert grad[idx] == pytest.approx(_fd(f, gates[key].astype(np.float64), idx), rel=2e-2, abs=2e-3)
    if "sum_lowrank" in ev:
        def f(u):
            lr = {**lowrank, key: {"u": jnp.asarray(u, jnp.float32), "v": lowrank[key]["v"]}}
            return jnp.sum(c.log_prob(c.params, x, evidence={**ev, "sum_lowrank": lr}))
        grad = np.asarray(jax.jit(jax.grad(f))(jnp.asarray(lowrank[key]["u"])))
        idx = (1, 0, 0, 1)
        assert grad[idx] == pytest.approx(_fd(f, lowrank[key]["u"].astype(np.float64), idx), rel=2e-2, abs=2e-3)


# ---- the dense per-sample reference: every sample's own weight matrices, node by node in float64 -------------

def _sum_edges(c, params, ns):
    """Host data of sum vector ``ns``: shared weights ``w [Np, Nc]``, its edge blocks ``(rows, cols)`` and its
    parameter blocks ``(group, first block)``."""
    Kp, Kc = ns.block_size, ns.ch_block_size
    rows = [slice(int(i) * Kp, (int(i) + 1) * Kp) for i in ns.edge_ids[0]]
    cols = [slice(int(j) * Kc, (int(j) + 1) * Kc) for j in ns.edge_ids[1]]
    group, blocks = c.param_slice(ns)
    return np.asarray(c.get_node_params(params, ns), np.float64), list(zip(rows, cols)), (group, blocks.start)


def _gate_columns(c, ns, edges, gates):
    """``(key, cols [Np, Nc])``: which log-gate each weight of ``ns`` reads in ``gates`` (``key`` None: the
    gate columns ``[B, G]``; a group: ``{group: [B, P]}``), -1 where none; None when ``ns`` runs ungated."""
    w_shape = (ns.num_nodes, ns.num_ch_nodes)
    if isinstance(gates, dict):
        group, blocks = c.param_slice(ns)
        if group not in gates:
            return None
        cols = np.full(w_shape, -1)
        for e, (r, q) in enumerate(edges):
            cols[r, q] = blocks.start + e
        return group, cols
    if gates is None or ns.gates is None:
        return None
    sl, gb = c.gate_slice(ns), ns.gates.block_size
    per = ns.block_size // gb
    cols = np.full(w_shape, -1)
    for e, (r, q) in enumerate(edges):
        cols[r, q] = (sl.start + e * per + np.arange(ns.block_size) // gb)[:, None]
    return None, cols


def _effective(vec, b, gates, lowrank):
    """Sample ``b``'s unnormalized weights of one sum vector: ``((w + U V) * exp(g), U V)``."""
    w, edges, (group, start), gcols = vec
    uv = np.zeros_like(w)
    if lowrank is not None and group in lowrank:
        u, v = (np.asarray(lowrank[group][k], np.float64)[b] for k in ("u", "v"))
        for e, (r, q) in enumerate(edges):
            uv[r, q] = u[start + e] @ v[start + e]
    a = w + uv
    if gcols is not None:
        key, cols = gcols
        g = np.asarray(gates if key is None else gates[key], np.float64)[b]
        a = a * np.where(cols >= 0, np.exp(g[np.maximum(cols, 0)]), 1.0)
    return a, uv


def _safe_div(a, b):
    """``a / b`` where ``b`` is not 0, else 0 (a node of zero effective weights: weights 0, value 0)."""
    return np.where(b != 0, a / np.where(b != 0, b, 1.0), 0.0)


def _dense_reference(c, params, x, gates=None, lowrank=None):
    """An independent reference for per-sample sum parameters: each sample's own normalized weight matrices
    (``(w + U V) * exp(g)`` per sum vector, renormalized per node), the circuit evaluated node by node and flows
    passed top-down in float64. Returns ``ll [B]``, ``flows`` (per source sum vector id, the shared weights' flows
    ``[Np, Nc]``: each edge's posterior count times ``w / (w + U V)``, pooled over tied vectors) and ``grads``
    (``d sum_b log p_b`` by the evidence: ``{"sum_gates": like gates, "sum_lowrank": like lowrank}``). A node of zero
    effective weights has the value 0; a sample of probability 0 adds no flows and no gradients."""
    nodes = c.nodes
    vecs = {}
    for ns in nodes:
        if ns.is_sum():
            w, edges, pl = _sum_edges(c, params, ns)
            vecs[ns.id] = (w, edges, pl, _gate_columns(c, ns, edges, gates))
    leaf_p = {ns.id: np.asarray(c.get_node_params(params, ns), np.float64) for ns in nodes if ns.is_input()}
    flows = {ns.source.id: np.zeros((ns.num_nodes, ns.num_ch_nodes)) for ns in nodes if ns.is_sum()}
    grads = {"sum_gates": jax.tree_util.tree_map(lambda a: np.zeros(np.shape(a)), gates),
             "sum_lowrank": jax.tree_util.tree_map(lambda a: np.zeros(np.shape(a)), lowrank)}
    ll = []
    for b in range(x.shape[0]):
        vals, wts = _dense_forward(nodes, vecs, leaf_p, x[b], b, gates, lowrank)
        p = vals[c.root.id][0]
        with np.errstate(divide="ignore"):
            ll.append(np.log(p))
        if p > 0:  # a sample of probability 0 adds no flows and no gradients
            _dense_backward(c, nodes, vecs, vals, wts, b, lowrank, flows, grads)
    return np.array(ll), flows, grads


def _dense_forward(nodes, vecs, leaf_p, xb, b, gates, lowrank):
    """Node values (linear space) of one sample and, per sum vector, ``(normalized weights, U V)``."""
    vals, wts = {}, {}
    for ns in nodes:
        if ns.is_input():
            vals[ns.id] = leaf_p[ns.id][:, xb[ns.var]]
        elif ns.is_prod():
            K = ns.block_size
            vals[ns.id] = np.prod([vals[ch.id][(ns.edge_ids[:, j][:, None] * K + np.arange(K)).ravel()]
                                   for j, ch in enumerate(ns.children)], axis=0)
        else:
            a, uv = _effective(vecs[ns.id], b, gates, lowrank)
            wts[ns.id] = (_safe_div(a, a.sum(1, keepdims=True)), uv)
            vals[ns.id] = wts[ns.id][0] @ np.concatenate([vals[ch.id] for ch in ns.children])
    return vals, wts


def _dense_backward(c, nodes, vecs, vals, wts, b, lowrank, flows, grads):
    """Add one sample's shared-weight flows and evidence gradients to ``flows`` and ``grads``: with ``E`` the edge
    posteriors and ``F`` the parents' flows, ``d log p / d log a = E - F w'`` for each unnormalized weight ``a``."""
    F = {ns.id: np.zeros(ns.num_nodes) for ns in nodes}
    F[c.root.id][:] = 1.0
    for ns in reversed(nodes):
        f = F[ns.id]
        if ns.is_prod():
            K = ns.block_size
            for j, ch in enumerate(ns.children):
                np.add.at(F[ch.id], (ns.edge_ids[:, j][:, None] * K + np.arange(K)).ravel(), f)
            continue
        if not ns.is_sum():
            continue
        wp, uv = wts[ns.id]
        w, edges, (group, start), gcols = vecs[ns.id]
        vc = np.concatenate([vals[ch.id] for ch in ns.children])
        edge = _safe_div(f[:, None] * wp * vc[None, :], vals[ns.id][:, None])
        wuv = np.where(w + uv > 0, w + uv, 1.0)
        flows[ns.source.id] += edge * w / wuv
        d = edge - f[:, None] * wp
        if gcols is not None:
            key, cols = gcols
            g = grads["sum_gates"] if key is None else grads["sum_gates"][key]
            g[b] += np.bincount(cols[cols >= 0], d[cols >= 0], minlength=g.shape[1])
        if lowrank is not None and group in lowrank:  # d a / d U = exp(g) V: d log p / d U = (d / (w + U V)) V^T
            u, v = (np.asarray(lowrank[group][k], np.float64)[b] for k in "uv")
            m, gl = d / wuv, grads["sum_lowrank"][group]
            for e, (r, q) in enumerate(edges):
                gl["u"][b, start + e] += m[r, q] @ v[start + e].T
                gl["v"][b, start + e] += u[start + e].T @ m[r, q]
        off = 0
        for ch in ns.children:
            F[ch.id] += edge.sum(0)[off:off + ch.num_nodes]
            off += ch.num_nodes


def _gated_circuit(case: str):
    """Four categorical variables; at one level four sum vectors of 4-node blocks over products: ``s01`` (dense),
    ``s23`` (its parameter-tied copy), ``r01`` and ``r23`` (fan-ins 1, 2, 3, 5 and 6: padded partitions); a root
    over their products. ``case`` declares the gates: ``"edge_block"`` one per edge block on two chosen vectors,
    ``"rows"`` a gate per 2 or per 1 parent nodes (``s23`` its own gates on ``s01``'s parameters, the root too),
    ``"tied"`` gate columns shared by ``s01``/``s23`` and by ``r01``/``r23``; anything else none."""
    cat = distributions.Categorical(3)
    leaves = [jaxpc.inputs(v, num_node_blocks=6, block_size=2, dist=cat) for v in range(4)]
    p01, p23 = jaxpc.multiply(leaves[0], leaves[1]), jaxpc.multiply(leaves[2], leaves[3])
    s01 = jaxpc.summate(p01, num_node_blocks=2, block_size=4, name="s01")
    s23 = s01.duplicate(p23, tie_params=True, name="s23")
    fan = [1, 2, 3, 5, 6]
    edges = np.array([[p for p, f in enumerate(fan) for _ in range(f)],
                      [(k + 2 * p) % 6 for p, f in enumerate(fan) for k in range(f)]])
    r01 = jaxpc.summate(p01, edge_ids=edges, block_size=4, name="r01")
    r23 = jaxpc.summate(p23, edge_ids=edges, block_size=4, name="r23")
    root = jaxpc.summate(jaxpc.multiply(s01, s23), jaxpc.multiply(r01, r23), num_nodes=1, name="root")
    if case == "edge_block":
        s01.set_gates()
        r23.set_gates()
    elif case == "rows":
        s01.set_gates(2)
        s23.set_gates(1)
        r01.set_gates(1)
        root.set_gates()
    elif case == "tied":
        s01.set_gates(2)
        s23.set_gates(tie_to=s01)
        r01.set_gates(4)
        r23.set_gates(tie_to=r01)
    return jaxpc.compile(root, seed=3)


def _check_against_dense(c, params, x, ev, rtol=1e-4):
    """LL, shared-parameter flows per parameter and evidence gradients of ``c`` under evidence ``ev``
    (``sum_gates`` / ``sum_lowrank``) against :func:`_dense_reference`; returns the reference flows."""
    gates, lowrank = ev.get("sum_gates"), ev.get("sum_lowrank")
    ll_ref, fl_ref, g_ref = _dense_reference(c, params, x, gates, lowrank)
    fl, ll = c.flows(params, x, evidence=ev, return_ll=True)
    np.testing.assert_allclose(np.asarray(ll), ll_ref, rtol=1e-5, atol=1e-5)
    for ns in c.nodes:
        if ns.is_sum() and ns.source is ns:
            np.testing.assert_allclose(np.asarray(c.get_node_flows(fl, ns)), fl_ref[ns.id], rtol=rtol, atol=1e-5,
                                       err_msg=ns.name)
    grad = jax.jit(jax.grad(lambda e: jnp.sum(c.log_prob(params, x, evidence=e))))  # jitted: one executable
    got = grad(jax.tree_util.tree_map(jnp.asarray, ev))
    for key in ev:
        for u, v in zip(jax.tree_util.tree_leaves(got[key]), jax.tree_util.tree_leaves(g_ref[key])):
            np.testing.assert_allclose(np.asarray(u), v, rtol=rtol, atol=1e-5, err_msg=key)
    return fl_ref


# LowRank with gates per row and alone; every gate granularity without it
GRANULARITIES = [("rows", True), ("tied", False), ("edge_block", False), ("rows", False), ("legacy", False),
                 ("none", True)]


@pytest.mark.parametrize("case,lowrank", cases(GRANULARITIES, fast=[("tied", False)], unpack=True))
@pytest.mark.slow
@pytest.mark.full
def test_gates_and_lowrank_match_dense_per_sample_reference(case, lowrank):
    """Gates per edge block, per group of parent nodes, on chosen vectors only, tied across vectors, and per
    parameter block (``{group: [B, P]}``), with and without LowRank, on padded partitions: LL, every shared
    parameter's flow and the gradients by the gates and factors equal the dense per-sample reference."""
    c = _gated_circuit(case)
    rng = np.random.default_rng(11)
    B = 4
    x = rng.integers(0, 3, (B, 4)).astype(np.int32)
    ev = {}
    if case == "legacy":
        ev["sum_gates"] = {g.key: rng.normal(size=(B, g.num_blocks)) for g in c.layout.sum_groups}
    elif case != "none":
        ev["sum_gates"] = rng.normal(size=(B, c.num_gates))
    if lowrank:
        ev["sum_lowrank"] = {g.key: {"u": rng.random((B, g.num_blocks, g.Kp, 2)),
                                     "v": rng.random((B, g.num_blocks, 2, g.Kc))} for g in c.layout.sum_groups}
    ev = jax.tree_util.tree_map(lambda a: a.astype(np.float32), ev)
    _check_against_dense(c, c.params, x, ev)


def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs inside its equations (scans, jitted calls)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for val in eqn.params.values():
            for sub in val if isinstance(val, (tuple, list)) else (val,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def test_gate_and_lowrank_products_run_at_the_options_precision():
    """Under ``Options(precision="fp32")`` every product of the gated and LowRank sum layers asks for exact
    float32 (``lax.Precision.HIGHEST``) like the engine's other matmuls, and under ``"bf16"`` multiplies
    bfloat16 operands: with the gate columns and with one gate per parameter block."""
    from jaxpc.engine import forward

    c = _gated_circuit("rows")
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.integers(0, 3, (2, 4)).astype(np.int32))
    lowrank = {g.key: {"u": rng.random((2, g.num_blocks, g.Kp, 2)), "v": rng.random((2, g.num_blocks, 2, g.Kc))}
               for g in c.layout.sum_groups}
    per_block = {g.key: rng.normal(size=(2, g.num_blocks)) for g in c.layout.sum_groups}
    for gates in (rng.normal(size=(2, c.num_gates)), per_block):
        ev = c.check_evidence(jax.tree_util.tree_map(lambda a: a.astype(np.float32),
                                                     {"sum_gates": gates, "sum_lowrank": lowrank}), 2)
        for prec in ("fp32", "bf16"):
            opts = jaxpc.Options(precision=prec)
            jaxpr = jax.make_jaxpr(lambda p, e, o=opts: forward.log_prob(c.layout, c.tables, p, x, None, o,
                                                                          evidence=e))(c.params, ev)
            dots = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
            assert len(dots) >= 8  # per layer: the shared weights, gates (2), LowRank (4 or 6)
            for e in dots:
                if prec == "fp32":
                    assert e.params["precision"] == (jax.lax.Precision.HIGHEST,) * 2, e
                else:
                    assert all(v.aval.dtype == jnp.bfloat16 for v in e.invars), e


@pytest.mark.slow
@pytest.mark.parametrize("form", ["columns", "per_block"])
@pytest.mark.full
def test_shared_parameters_train_by_em_under_gates(form):
    """A homogeneous HMM (tied transitions) whose transition steps each read their own gate columns (one gate per
    parent node and edge block): zero gates are no gates; under random gates (``form``: the columns, or one per
    parameter block) with LowRank corrections every shared parameter's flow, the LL and the evidence gradients
    equal the dense per-sample reference, and one EM step moves each weight to its normalized reference flow."""
    root = structures.HMM(5, 4, 6, block_size=2)
    for ns in jaxpc.nodes.topological_order(root):
        if ns.name.startswith("trans"):
            ns.set_gates(1)
    c = jaxpc.compile(root)
    rng = np.random.default_rng(6)
    B = 16
    x = rng.integers(0, 6, (B, 5)).astype(np.int32)
    zero = np.zeros((B, c.num_gates), np.float32)
    for u, v in zip(jax.tree_util.tree_leaves(c.em_step(c.params, x, evidence={"sum_gates": zero})),
                    jax.tree_util.tree_leaves(c.em_step(c.params, x))):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6)
    lowrank = {g.key: {"u": rng.random((B, g.num_blocks, g.Kp, 2)) * 0.3,
                       "v": rng.random((B, g.num_blocks, 2, g.Kc)) * 0.3} for g in c.layout.sum_groups}
    if form == "columns":
        gates = rng.normal(size=(B, c.num_gates))
    else:
        gates = {g.key: rng.normal(size=(B, g.num_blocks)) for g in c.layout.sum_groups}
    ev = jax.tree_util.tree_map(lambda a: a.astype(np.float32), {"sum_gates": gates, "sum_lowrank": lowrank})
    fl_ref = _check_against_dense(c, c.params, x, ev)
    new = c.em_step(c.params, x, evidence=ev, pseudocount=0.1)
    for ns in c.nodes:
        if ns.is_sum() and ns.source is ns:  # every HMM sum is dense: (flows + 0.1 / children) / (total + 0.1)
            f = fl_ref[ns.id]
            want = (f + 0.1 / f.shape[1]) / (f.sum(1, keepdims=True) + 0.1)
            np.testing.assert_allclose(np.asarray(c.get_node_params(new, ns)), want, rtol=1e-4, err_msg=ns.name)


@pytest.mark.parametrize("name", cases(["hmm_untied", "hclt", "pd", "rat"], fast=["hclt"]))
@pytest.mark.slow
def test_evidence_on_every_structure_with_cache_and_jit_grad(name, monkeypatch):
    """Dense soft evidence with latent potentials and gates: no recompilation for new evidence, jit(grad) against
    finite differences; then (on a tree and on a DAG: the routes are the leaves') top-k evidence by each of its
    routes (the dense product, and the gather per node in chunks that leave padding) against the same evidence
    given densely."""
    from jaxpc.distributions import evidence as evidence_leaves

    rng = np.random.default_rng(7)
    sec = distributions.SoftEvidenceCategorical(3)
    data = rng.integers(0, 3, (200, 4))
    root = {"hmm_untied": lambda: structures.GeneralizedHMM(4, 4, sec, homogeneous=False, block_size=2),
            "hclt": lambda: structures.HCLT(data, 4, input_dist=sec, block_size=2),
            "pd": lambda: structures.PD((2, 2), 4, split_intervals=1, input_dist=sec, block_size=2),
            "rat": lambda: structures.RAT_SPN(4, 4, 2, 2, input_dist=sec)}[name]()
    c = jaxpc.compile(root)
    x = data[:6].astype(np.int32)
    g0 = c.layout.sum_groups[0]

    def ev(s):
        r = np.random.default_rng(s)
        return {"categorical_logp": r.normal(size=(6, 4, 3)).astype(np.float32),
                "latent": r.normal(size=(6, 4, 4)).astype(np.float32) * 0.1,
                "sum_gates": {g0.key: r.normal(size=(6, g0.num_blocks)).astype(np.float32)}}

    c.log_prob(c.params, x, evidence=ev(0))
    misses = c.cache_info().misses
    for s in range(1, 4):  # fresh evidence every call: no recompilation
        ll = c.log_prob(c.params, x, evidence=ev(s))
        assert np.all(np.isfinite(np.asarray(ll)))
    assert c.cache_info().misses == misses

    @jax.jit
    def loss(q):
        e = ev(9)
        e["categorical_logp"] = q
        return -jnp.mean(c.log_prob(c.params, x, evidence=e))

    q = jnp.asarray(ev(9)["categorical_logp"])
    g = jax.grad(loss)(q)
    idx = (0, 1, 2)
    fd = _fd(lambda a: loss(jnp.asarray(a, jnp.float32)), np.asarray(q, np.float64), idx)
    assert float(g[idx]) == pytest.approx(fd, rel=3e-2, abs=3e-3)
    if name not in ("hclt", "pd"):
        return

    # top-k evidence k = 2 (the observed value, and another one masked at random) and the same evidence given
    # densely (-inf off the unmasked candidates)
    e = ev(9)
    dense = e.pop("categorical_logp")
    ids = np.stack([x, (x + rng.integers(1, 3, x.shape)) % 3], axis=2).astype(np.int32)
    mask = np.stack([np.ones(x.shape, bool), rng.random(x.shape) < 0.7], axis=2)
    topk = {"ids": ids, "logp": np.take_along_axis(dense, ids, axis=2), "mask": mask}
    same = np.full_like(dense, -np.inf)
    np.put_along_axis(same, ids, np.where(mask, topk["logp"], -np.inf), axis=2)
    off = np.ones(same.shape, bool)  # where the evidence has no weight
    np.put_along_axis(off, ids, ~mask, axis=2)

    def step(c, key, val):  # log-likelihoods, flows, and the gradient of the log-likelihood in the evidence
        def total(v):
            return jnp.sum(c.log_prob(c.params, x, evidence={**e, key: val(v)}))

        fl, ll = c.flows(c.params, x, evidence={**e, key: val(None)}, return_ll=True)
        return ll, fl, jax.jit(jax.grad(total))(jnp.asarray(topk["logp"] if key != "categorical_logp" else same))

    topk_logz = evidence_leaves._topk_logz
    for method in ("dense", "gather"):  # a fresh circuit each: the route is traced into its executables
        monkeypatch.setattr(evidence_leaves, "_topk_logz", lambda *a, m=method, **k: topk_logz(
            *a, **k, method=m, budget=3 * x.shape[0] * 2))  # gather: 3 nodes per chunk, the last one padded
        c = jaxpc.compile(root)
        llk, fk, gk = step(c, "categorical_topk", lambda v: topk if v is None else {**topk, "logp": v})
        lld, fd, gd = step(c, "categorical_logp", lambda v: same if v is None else v)
        np.testing.assert_allclose(np.asarray(llk), np.asarray(lld), rtol=1e-5, atol=1e-5)
        for u, v in zip(jax.tree_util.tree_leaves(fk), jax.tree_util.tree_leaves(fd), strict=True):
            np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-4, atol=1e-5)
        gd = np.asarray(gd)
        np.testing.assert_allclose(np.asarray(gk), np.take_along_axis(gd, ids, axis=2), rtol=1e-4, atol=1e-6)
        assert np.all(gd[off] == 0)


def test_evidence_errors():
    c = jaxpc.compile(structures.HMM(3, 2, 4))
    x = np.zeros((2, 3), np.int32)
    with pytest.raises(ValueError, match=r"unknown evidence key\(s\) \['soft'\]"):
        c.log_prob(c.params, x, evidence={"soft": np.zeros((2, 3, 4))})
    with pytest.raises(ValueError, match=r"evidence\['latent'\] must have 3 axes with the batch \(2\) first"):
        c.log_prob(c.params, x, evidence={"latent": np.zeros((3, 3, 2))})
    with pytest.raises(ValueError, match="names sum group '9x9'"):
        c.log_prob(c.params, x, evidence={"sum_gates": {"9x9": np.zeros((2, 1))}})
    soft = "SoftEvidenceCategorical"
    for key, leaves in (("categorical_logp", soft), ("categorical_topk", soft), ("external", "External")):
        with pytest.raises(ValueError, match=rf"evidence\['{key}'\] is read by {leaves} leaves, and this circuit"):
            c.log_prob(c.params, x, evidence={key: np.zeros((2, 3, 4), np.float32)})
    for width in (1, 3):  # one entry per latent (2): fewer would be read clamped, more ignored
        with pytest.raises(ValueError, match=rf"evidence\['latent'\] must have shape \[2, 3, 2\] \(entry j for "
                                             rf"node j .* got \(2, 3, {width}\)"):
            c.log_prob(c.params, x, evidence={"latent": np.zeros((2, 3, width), np.float32)})
    lat = np.zeros((2, 3, 2), np.float32)
    lat[1, 2, 0] = np.nan
    with pytest.raises(ValueError, match=r"evidence\['latent'\]\[1, 2, 0\] = nan: log-values must not be NaN"):
        c.em_step(c.params, x, evidence={"latent": lat})
    with pytest.raises(ValueError, match=r"evidence\['sum_gates.*= inf: log-values must not be NaN or \+inf"):
        g = next(iter(c.params["sum"]))
        c.log_prob(c.params, x, evidence={"sum_gates": {g: np.full((2, c.params["sum"][g].shape[0]), np.inf)}})


def test_soft_evidence_values_are_checked():
    """Host soft evidence: log-values without NaN or +inf, top-k ids that are values of the leaves and distinct in
    a row (masked entries aside), dense evidence of the leaves' number of values."""
    c = jaxpc.compile(structures.GeneralizedHMM(3, 2, distributions.SoftEvidenceCategorical(num_cats=4)))
    x = np.zeros((2, 3), np.int32)
    ids = np.tile(np.arange(3, dtype=np.int32), (2, 3, 1))
    lp = np.zeros((2, 3, 3), np.float32)
    lp[0, 1, 2] = -np.inf  # a zero: fine
    c.log_prob(c.params, x, evidence={"categorical_topk": {"ids": ids, "logp": lp}})
    dup = ids.copy()
    dup[1, 2, 2] = 0
    with pytest.raises(ValueError, match=r"\['ids'\]\[1, 2\] holds the id 0 more than once"):
        c.log_prob(c.params, x, evidence={"categorical_topk": {"ids": dup, "logp": lp}})
    mask = np.ones(ids.shape, bool)
    mask[1, 2, 2] = False  # the repeated id masked out
    c.log_prob(c.params, x, evidence={"categorical_topk": {"ids": dup, "logp": lp, "mask": mask}})
    far = ids.copy()
    far[0, 0, 1] = 4
    with pytest.raises(ValueError, match=r"\['ids'\]\[0, 0, 1\] = 4 is not a value .* \[0, 3\]"):
        c.flows(c.params, x, evidence={"categorical_topk": {"ids": far, "logp": lp}})
    with pytest.raises(ValueError, match=r"categorical_logp'\] must have shape \[2, 3, 4\]"):
        c.log_prob(c.params, x, evidence={"categorical_logp": np.zeros((2, 3, 3), np.float32)})
    with pytest.raises(ValueError, match=r"categorical_logp'\]\[0, 0, 0\] = nan"):
        c.log_prob(c.params, x, evidence={"categorical_logp": np.full((2, 3, 4), np.nan, np.float32)})
    with pytest.raises(TypeError, match="'ids'\\] must be integers"):
        c.log_prob(c.params, x, evidence={"categorical_topk": {"ids": ids.astype(np.float32), "logp": lp}})


def test_gate_declaration_and_evidence_errors():
    """Bad gate declarations and bad per-sample sum evidence raise a ValueError naming what is wrong."""
    cat = distributions.Categorical(3)

    def vectors():
        a, b = (jaxpc.inputs(v, num_node_blocks=2, block_size=2, dist=cat) for v in range(2))
        m = jaxpc.multiply(a, b)
        s1 = jaxpc.summate(m, num_node_blocks=2, block_size=4, name="s1")
        s2 = jaxpc.summate(m, num_node_blocks=2, block_size=4, name="s2")
        return s1, s2, jaxpc.summate(s1, s2, num_nodes=1, name="top")

    s1, s2, top = vectors()
    with pytest.raises(ValueError, match="block_size must be a positive divisor of s1's block size 4, got 3"):
        s1.set_gates(3)
    with pytest.raises(ValueError, match="s1 .4 edge blocks of 4 nodes. cannot read the gates of top"):
        s1.set_gates(tie_to=top)
    s2.set_gates(2, tie_to=s1)
    with pytest.raises(ValueError, match="s2 reads the gates of s1, which has no gates"):
        jaxpc.compile(top)
    s1.set_gates(4)
    with pytest.raises(ValueError, match="s2 .gate block size 2. cannot read the gates of s1 .gate block size 4."):
        jaxpc.compile(top)
    outside, _, _ = vectors()
    s2.set_gates(tie_to=outside.set_gates())
    with pytest.raises(ValueError, match=f"s2 reads the gates of {outside.name}, which is not part of this circuit"):
        jaxpc.compile(top)
    s2.set_gates(tie_to=s1)
    c = jaxpc.compile(top)
    assert c.num_gates == 4 and c.gate_slice(s1) == c.gate_slice(s2) == slice(0, 4)
    with pytest.raises(ValueError, match="gate_slice: top has no gates; declare them with top.set_gates()"):
        c.gate_slice(top)
    with pytest.raises(ValueError, match=f"gate_slice: {outside.name} is not part of this circuit"):
        c.gate_slice(outside)
    with pytest.raises(ValueError, match="gate_slice: .* is not a sum vector"):
        c.gate_slice(c.nodes[0])
    x = np.zeros((2, 2), np.int32)
    with pytest.raises(ValueError, match=r"evidence\['sum_gates'\] must have shape \[2, 4\], got \(2, 5\)"):
        c.log_prob(c.params, x, evidence={"sum_gates": np.zeros((2, 5), np.float32)})
    ungated = jaxpc.compile(vectors()[2])
    with pytest.raises(ValueError, match="no sum vector of this circuit has gates: declare them with ns.set_gates"):
        ungated.log_prob(ungated.params, x, evidence={"sum_gates": np.zeros((2, 4), np.float32)})
    g = ungated.layout.sum_groups[0]
    with pytest.raises(ValueError, match=rf"evidence\['sum_lowrank'\]\['{g.key}'\] must be .*, got \['u'\]"):
        ungated.log_prob(ungated.params, x, evidence={"sum_lowrank": {g.key: {"u": np.zeros((2, 1, 1, 1))}}})
    with pytest.raises(ValueError, match="param_slice: .* is not a sum vector of this circuit"):
        ungated.param_slice(ungated.nodes[0])


def test_topk_logz_dense_and_gather_paths_agree():
    """Both ways of summing top-k evidence (scatter to dense + one matrix product; gather per node) equal a
    float64 loop, with masked candidates, -inf log-weights and rows shared across variables."""
    from jaxpc.distributions.evidence import _topk_logz

    rng = np.random.default_rng(3)
    B, V, K, k, P = 3, 4, 9, 4, 5
    ids = np.stack([[rng.choice(K, k, replace=False) for _ in range(V)] for _ in range(B)]).astype(np.int32)
    lp = rng.normal(size=(B, V, k)).astype(np.float32)
    lp[0, 1, 2] = -np.inf
    mask = rng.random((B, V, k)) > 0.25
    mask[:, :, 0] = True
    lt = np.log(rng.dirichlet(np.ones(K), P)).astype(np.float32)
    rows = np.array([0, 1, 2, 3, 4, 0, 1], np.int32)
    vars_ = np.array([0, 0, 1, 2, 3, 3, 1], np.int32)
    want = np.zeros((len(rows), B))
    for n, (r, v) in enumerate(zip(rows, vars_)):
        for b in range(B):
            want[n, b] = np.log(sum(np.exp(float(lt[r, ids[b, v, j]]) + float(lp[b, v, j]))
                                    for j in range(k) if mask[b, v, j]))
    topk_logz = jax.jit(_topk_logz, static_argnames=("method", "budget"))  # (op by op, every operation would compile)
    for method in ("dense", "gather", "auto"):
        got = topk_logz(jnp.asarray(lt), jnp.asarray(ids), jnp.asarray(lp), jnp.asarray(mask), jnp.asarray(rows),
                        jnp.asarray(vars_), method=method, budget=8)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=method)
    with pytest.raises(ValueError, match="unknown top-k evidence method"):
        _topk_logz(jnp.asarray(lt), jnp.asarray(ids), jnp.asarray(lp), None, jnp.asarray(rows), jnp.asarray(vars_),
                   method="sparse")


@pytest.mark.slow  # an EM step's executable with gates and LowRank factors
def test_gated_lowrank_em_step_moves_no_host_data():
    """A steady-state EM step with BlockScale gates and LowRank corrections on device-resident data makes no
    host transfer (its input check's flag is the runtime's own, read under its own permission), and its
    parameters stay normalized and finite."""
    c = jaxpc.compile(structures.HMM(5, 4, 6, block_size=2))
    rng = np.random.default_rng(7)
    x = jax.device_put(rng.integers(0, 6, (16, 5)).astype(np.int32))
    ev = {"sum_gates": {g.key: jax.device_put(rng.normal(size=(16, g.num_blocks)).astype(np.float32))
                        for g in c.layout.sum_groups},
          "sum_lowrank": {g.key: {"u": jax.device_put(rng.random((16, g.num_blocks, g.Kp, 2)).astype(np.float32)),
                                  "v": jax.device_put(rng.random((16, g.num_blocks, 2, g.Kc)).astype(np.float32))}
                          for g in c.layout.sum_groups}}
    step, pc = c.runtime.scalar(0.1), c.runtime.scalar(0.1)
    params = c.em_step(c.params, x, evidence=ev, step_size=step, pseudocount=pc)  # compiles, makes constants
    with jax.transfer_guard("disallow"):
        for _ in range(2):
            params = c.em_step(params, x, evidence=ev, step_size=step, pseudocount=pc)
        jax.block_until_ready(params)
    c.raise_pending()
    assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree_util.tree_leaves(params))
    np.testing.assert_allclose(np.asarray(c.get_node_params(params, c.root)).sum(), 1.0, rtol=1e-5)


def test_external_leaves_in_runs_have_no_statistics():
    """External leaves in runs over one variable (several nodes per variable) have no statistics, like those one
    to a variable: em_update takes the flows that flows returned, and equals em_step."""
    a = jaxpc.inputs(0, num_node_blocks=2, block_size=1, dist=distributions.External())
    b = jaxpc.inputs(1, num_node_blocks=2, block_size=1, dist=distributions.Categorical(3))
    c = jaxpc.compile(jaxpc.summate(jaxpc.multiply(a, b), num_node_blocks=1, block_size=1))
    x = np.array([[0, 1], [0, 2]], np.int32)
    ev = {"external": np.random.default_rng(0).normal(size=(2, 2, 2)).astype(np.float32)}
    fl = c.flows(c.params, x, evidence=ev)
    assert fl["input"]["external"] == {}
    new = c.em_update(c.params, fl, step_size=0.5)
    ref = c.em_step(c.params, x, step_size=0.5, evidence=ev)
    for u, v in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-6, atol=1e-7)


# ---- device evidence's values: checked on the device, raised by the next call (or this one with "sync") -------

@pytest.fixture(scope="module")
def evidence_circuits():
    """An HMM (latent potentials, per-block gates, LowRank factors) and a GeneralizedHMM over 4-valued soft evidence
    leaves (dense and top-k evidence), with a batch of two."""
    return {"hmm": jaxpc.compile(structures.HMM(3, 2, 4)),
            "soft": jaxpc.compile(structures.GeneralizedHMM(3, 2, distributions.SoftEvidenceCategorical(num_cats=4)))}


def _bad_evidence(c, rule: str):
    """``(good, bad, error pattern)``: host evidence of ``c`` and a copy that breaks ``rule`` in one or two
    entries."""
    rng = np.random.default_rng(12)
    B = 2
    if rule in ("log_nan", "log_inf"):
        g = c.layout.sum_groups[0]
        good = {"latent": rng.normal(size=(B, 3, 2)).astype(np.float32),
                "sum_gates": {g.key: rng.normal(size=(B, g.num_blocks)).astype(np.float32)}}
        bad = jax.tree_util.tree_map(np.copy, good)
        if rule == "log_nan":
            bad["latent"][1, 2, 0] = bad["latent"][1, 0, 1] = np.nan
            return good, bad, (r"evidence\['latent'\]\[1, 0, 1\] = nan: log-values must not be NaN or \+inf "
                               r"\(-inf is a zero\) \(2 such entries in all\)")
        bad["sum_gates"][g.key][0, -1] = np.inf
        bad["latent"][0, 0, 0] = -np.inf  # a zero: fine
        return good, bad, rf"evidence\['sum_gates.{g.key}'\]\[0, {g.num_blocks - 1}\] = inf: log-values must not"
    if rule in ("lowrank_u", "lowrank_v"):
        lowrank = {g.key: {"u": rng.random((B, g.num_blocks, g.Kp, 2)).astype(np.float32),
                           "v": rng.random((B, g.num_blocks, 2, g.Kc)).astype(np.float32)}
                   for g in c.layout.sum_groups}
        good = {"sum_lowrank": lowrank}
        bad = jax.tree_util.tree_map(np.copy, good)
        key = c.layout.sum_groups[-1].key
        if rule == "lowrank_u":
            bad["sum_lowrank"][key]["u"][1, 0, 0, 1] = -0.5
            return good, bad, (rf"evidence\['sum_lowrank.{key}.u'\]\[1, 0, 0, 1\] = -0.5: values must be finite and "
                               r"non-negative")
        bad["sum_lowrank"][key]["v"][0, 0, 1, 0] = np.nan
        return good, bad, rf"evidence\['sum_lowrank.{key}.v'\]\[0, 0, 1, 0\] = nan: values must be finite"
    ids = np.tile(np.arange(3, dtype=np.int32), (B, 3, 1))
    good = {"categorical_topk": {"ids": ids, "logp": rng.normal(size=ids.shape).astype(np.float32)}}
    bad = jax.tree_util.tree_map(np.copy, good)
    if rule == "ids_range":
        bad["categorical_topk"]["ids"][0, 2, 1] = 4
        bad["categorical_topk"]["ids"][1, 1, 0] = -1
        return good, bad, (r"evidence\['categorical_topk'\]\['ids'\]\[0, 2, 1\] = 4 is not a value of the soft "
                           r"evidence leaves \(integers in \[0, 3\]\) \(2 such entries in all\)")
    if rule == "ids_repeated":
        bad["categorical_topk"]["ids"][1, 2, 2] = 0
        return good, bad, r"evidence\['categorical_topk'\]\['ids'\]\[1, 2\] holds the id 0 more than once"
    assert rule == "topk_logp_nan"
    bad["categorical_topk"]["logp"][1, 1, 1] = np.nan
    return good, bad, r"evidence\['categorical_topk.logp'\]\[1, 1, 1\] = nan: log-values must not be NaN"


def _call(c, entry: str, x, ev, validate=True):
    """One call of ``entry`` with evidence ``ev``: its outputs as numpy arrays (a list)."""
    if entry == "log_prob":
        out = c.log_prob(c.params, x, evidence=ev, validate=validate)
    elif entry == "flows":
        out = c.flows(c.params, x, evidence=ev, validate=validate, return_ll=True)
    elif entry == "evidence_grad":
        out = c.flows(c.params, x, evidence=ev, validate=validate, return_evidence_grad=True)
    else:
        out = c.em_step(c.params, x, evidence=ev, validate=validate, step_size=0.5, return_ll=True)
    return [np.asarray(a) for a in jax.tree_util.tree_leaves(out)]


# rule, circuit, entry point
DEVICE_RULES = [("log_nan", "hmm", "log_prob"), ("log_inf", "hmm", "flows"), ("lowrank_u", "hmm", "em_step"),
                ("lowrank_v", "hmm", "log_prob"), ("ids_range", "soft", "log_prob"),
                ("ids_repeated", "soft", "em_step"), ("topk_logp_nan", "soft", "evidence_grad")]


@pytest.mark.parametrize("rule,circuit,entry", DEVICE_RULES)
def test_device_evidence_values_are_checked(evidence_circuits, rule, circuit, entry):
    """Device evidence breaking a value rule (log-values NaN or +inf, LowRank factors negative or NaN, top-k ids out
    of range or repeated) raises the host check's error, on the device: at the call with ``validate="sync"``, at the
    circuit's next call by default (the call itself returns), never with ``validate=False``. Good device evidence
    gives bitwise what the same host evidence gives."""
    c = evidence_circuits[circuit]
    x = np.array([[0, 1, 2], [3, 0, 1]], np.int32)
    good, bad, pattern = _bad_evidence(c, rule)
    device = jax.tree_util.tree_map(jnp.asarray, bad)
    with pytest.raises(ValueError, match=pattern) as host_error:  # numpy: at once, before anything runs
        _call(c, entry, x, bad)
    host_message = str(host_error.value)
    with pytest.raises(ValueError, match=pattern) as sync_error:
        _call(c, entry, x, device, validate="sync")
    assert str(sync_error.value).startswith(host_message)  # the same error, and where it was found
    assert "checked on the device" in str(sync_error.value)
    c.raise_pending()  # (raised once)
    _call(c, entry, x, device)  # the default: the flag is read by the next call
    with pytest.raises(ValueError, match=pattern):
        c.log_prob(c.params, x)
    c.raise_pending()
    _call(c, entry, x, device, validate=False)  # no check at all
    c.raise_pending()
    np.asarray(c.log_prob(c.params, x))
    # good evidence: the device array's result is the host array's, bit for bit; nothing is raised later
    want = _call(c, entry, x, good)
    got = _call(c, entry, x, jax.tree_util.tree_map(jnp.asarray, good), validate="sync")
    for u, v in zip(got, want):
        np.testing.assert_array_equal(u, v)
    _call(c, entry, x, jax.tree_util.tree_map(jnp.asarray, good))
    c.raise_pending()


def test_device_evidence_checks_masks_tracers_and_mixed_arrays(evidence_circuits):
    """A repeated top-k id in a masked entry is fine on the device as on the host; evidence traced by a user's
    ``jax.jit`` is not checked (nothing can raise from a trace); with host and device arrays in one call the host
    ones raise at once and the device ones on the device."""
    c = evidence_circuits["soft"]
    x = np.array([[0, 1, 2], [3, 0, 1]], np.int32)
    good, bad, pattern = _bad_evidence(c, "ids_repeated")
    mask = np.ones(good["categorical_topk"]["ids"].shape, bool)
    mask[1, 2, 2] = False  # the repeated id masked out
    masked = {"categorical_topk": {**bad["categorical_topk"], "mask": mask}}
    want = np.asarray(c.log_prob(c.params, x, evidence=masked))
    got = np.asarray(c.log_prob(c.params, x, evidence=jax.tree_util.tree_map(jnp.asarray, masked), validate="sync"))
    np.testing.assert_array_equal(got, want)
    mask[0, 0, 0] = False  # a mask on the device too, the repeated id live again
    mask[1, 2, 2] = True
    with pytest.raises(ValueError, match=pattern):
        c.log_prob(c.params, x, evidence={"categorical_topk": {**bad["categorical_topk"], "mask": jnp.asarray(mask)}},
                   validate="sync")
    device = jax.tree_util.tree_map(jnp.asarray, bad)
    out = jax.jit(lambda e: c.log_prob(c.params, x, evidence=e))(device)
    assert np.asarray(out).shape == (2,)
    c.raise_pending()  # nothing recorded from inside the trace
    # the ids on the host (raised at once), the log-values on the device (checked there)
    mixed = {"categorical_topk": {"ids": bad["categorical_topk"]["ids"],
                                  "logp": jnp.asarray(good["categorical_topk"]["logp"])}}
    with pytest.raises(ValueError, match=pattern):
        c.log_prob(c.params, x, evidence=mixed)
    lp = good["categorical_topk"]["logp"].copy()
    lp[0, 0, 0] = np.inf
    c.log_prob(c.params, x, evidence={"categorical_topk": {"ids": good["categorical_topk"]["ids"],
                                                          "logp": jnp.asarray(lp)}})
    with pytest.raises(ValueError, match=r"categorical_topk.logp'\]\[0, 0, 0\] = inf: .*in circuit.log_prob"):
        c.raise_pending()


@pytest.mark.slow  # parallel.em_step's and optim.fit's executables
@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 (fake) devices")
def test_device_evidence_values_are_checked_in_parallel_and_fit(evidence_circuits):
    """``jaxpc.parallel``'s steps and ``split_batch`` check device evidence as the circuit's calls do (``"sync"``:
    at once; by default at the next call; not with ``validate=False``); ``optim.fit`` raises after its first
    epoch."""
    from jaxpc import optim, parallel

    c = evidence_circuits["hmm"]
    x = np.array([[0, 1, 2], [3, 0, 1]], np.int32)
    _, bad, pattern = _bad_evidence(c, "lowrank_u")
    device = jax.tree_util.tree_map(jnp.asarray, bad)
    mesh = parallel.data_mesh(2)
    with pytest.raises(ValueError, match=pattern + r".*in parallel.em_step, checked on the device"):
        parallel.em_step(c, c.params, x, mesh=mesh, evidence=device, validate="sync")
    parallel.em_step(c, c.params, x, mesh=mesh, evidence=device, validate=False)
    c.raise_pending()
    parallel.em_step(c, c.params, x, mesh=mesh, evidence=device)
    with pytest.raises(ValueError, match=pattern):
        c.raise_pending()
    with pytest.raises(ValueError, match=pattern + r".*in parallel.split_batch"):
        parallel.split_batch(c, x, evidence=device, num_devices=2, validate="sync")
    with pytest.raises(ValueError, match=pattern + r".*in optim.fit"):
        optim.fit(c, c.params, x, epochs=2, batch_size=2, evidence=device, progress=False)
    optim.fit(c, c.params, x, epochs=1, batch_size=2, evidence=device, progress=False, validate=False)
    c.raise_pending()


class _Reweighted:
    """A circuit whose soft-evidence leaves read the reweighted pmf ``theta_n(k) exp(e[v, k]) / Z`` of one row's
    evidence ``e [V, K]`` as plain categorical parameters (``oracle.forward`` reads parameters through it)."""

    def __init__(self, c, e):
        self.root, self.c, self.e = c.root, c, np.asarray(e, np.float64)

    def get_node_params(self, params, ns):
        p = np.asarray(self.c.get_node_params(params, ns), np.float64)
        if not ns.is_input():
            return p
        w = p * np.exp(self.e[ns.var])[None, :]
        tot = w.sum(1, keepdims=True)
        return np.where(tot > 0, w / np.where(tot > 0, tot, 1.0), 0.0)


def _soft_missing_case(kind):
    """A non-homogeneous soft-evidence HMM over 3 variables of 4 values, 3 rows of evidence ``e [B, T, K]`` (dense, or
    every value a top-k candidate in a shuffled order with the ``-inf`` ones masked), 2 missing variables per row;
    row 2 gives no value of variable 1 weight."""
    rng = np.random.default_rng(3)
    T, K, B = 3, 4, 3
    c = jaxpc.compile(structures.GeneralizedHMM(T, 2, distributions.SoftEvidenceCategorical(K), homogeneous=False),
                      seed=5)
    e = rng.normal(size=(B, T, K))
    e[0, 1, 2] = -np.inf
    e[2, 1, :] = -np.inf
    x = rng.integers(0, K, (B, T)).astype(np.int32)
    miss = np.array([[False, True, True], [True, True, False], [True, True, False]])
    if kind == "dense":
        ev = {"categorical_logp": e.astype(np.float32)}
    else:
        ids = rng.permuted(np.tile(np.arange(K), (B, T, 1)), axis=2).astype(np.int32)
        lp = np.take_along_axis(e, ids, axis=2)
        ev = {"categorical_topk": {"ids": ids, "logp": np.where(np.isfinite(lp), lp, 0.0).astype(np.float32),
                                   "mask": np.isfinite(lp)}}
    return c, e, x, miss, ev


def _check_soft_missing(c, e, x, miss, ev, props):
    got = {}
    for prop, alpha in props:
        got[prop] = np.asarray(c.log_prob(c.params, x, miss, propagation=prop, alpha=alpha, evidence=ev), np.float64)
        for b in range(len(x)):
            _, ref = oracle.forward(_Reweighted(c, e[b]), c.params, x[b:b + 1], miss[b:b + 1], mode=prop, alpha=alpha)
            np.testing.assert_allclose(got[prop][b], ref[0], rtol=1e-5, err_msg=f"{prop}, row {b}")
        assert got[prop][2] == -np.inf
    return got


def test_soft_evidence_missing_reduces_the_reweighted_pmf():
    """A missing variable of a soft-evidence leaf contributes the reduction over its values of the leaf's reweighted
    log-pmf, as a categorical's missing variable does: 0 under LL, the max under MPE; -inf where the evidence gives
    every value weight zero (no value is possible, so neither is the marginal). Against the float64 oracle run on
    the reweighted categorical."""
    _check_soft_missing(*_soft_missing_case("dense"), (("LL", None), ("MPE", None)))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "topk"])
def test_soft_evidence_missing_against_enumeration(kind):
    """:func:`test_soft_evidence_missing_reduces_the_reweighted_pmf` for dense and top-k evidence and under
    GeneralLL too; LL and MPE also against enumeration of the missing values: LL sums the completions'
    likelihoods, MPE maximizes their values."""
    c, e, x, miss, ev = _soft_missing_case(kind)
    got = _check_soft_missing(c, e, x, miss, ev, (("LL", None), ("MPE", None), ("GeneralLL", 0.5)))
    B, T = x.shape
    K = e.shape[2]
    full = np.array([np.where(miss[b], 0, x[b]) + np.isin(np.arange(T), np.flatnonzero(miss[b])[0]) * i
                     + np.isin(np.arange(T), np.flatnonzero(miss[b])[1]) * j
                     for b in range(B) for i in range(K) for j in range(K)], np.int32)
    rep = jax.tree_util.tree_map(lambda a: np.repeat(a, K * K, axis=0), ev)
    for prop, reduce in (("LL", np.logaddexp.reduce), ("MPE", np.max)):
        joint = np.asarray(c.log_prob(c.params, full, propagation=prop, evidence=rep), np.float64).reshape(B, -1)
        np.testing.assert_allclose(got[prop], reduce(joint, axis=1), rtol=1e-5, err_msg=prop)


def test_soft_evidence_out_of_range_value_unchecked_is_nan():
    """With validation off, an out-of-range value of a soft-evidence leaf poisons its row with NaN, as a
    categorical's does (never the value of a clamped category); the other rows are unchanged, and a checked call
    raises naming the variable."""
    c = jaxpc.compile(structures.GeneralizedHMM(3, 2, distributions.SoftEvidenceCategorical(4)), seed=1)
    ev = {"categorical_logp": np.random.default_rng(0).normal(size=(3, 3, 4)).astype(np.float32)}
    x = np.array([[0, 4, 1], [0, -1, 1], [0, 3, 1]], np.int32)
    got = np.asarray(c.log_prob(c.params, x, evidence=ev, validate=False))
    assert np.isnan(got[:2]).all()
    ref = np.asarray(c.log_prob(c.params, x[2:], evidence={"categorical_logp": ev["categorical_logp"][2:]}))
    np.testing.assert_allclose(got[2], ref[0], rtol=1e-6)
    with pytest.raises(ValueError, match="variable 1"):
        c.log_prob(c.params, x, evidence=ev)
