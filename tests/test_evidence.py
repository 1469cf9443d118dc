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


@pytest.mark.parametrize("homogeneous", cases([True, False], fast=[False]))
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
    ids = np.tile(np.arange(V)[None, None, 1:], (B, T, 1)).astype(np.int32)
    ids[:, :, 0] = x  # make the observed value a candidate
    lp = rng.normal(size=ids.shape)

    def dense_total(ee):
        return jnp.sum(c.log_prob(c.params, x, evidence={"categorical_logp": jnp.asarray(ee, jnp.float32)}))

    def topk_total(ll):
        return jnp.sum(c.log_prob(c.params, x, evidence={"categorical_topk": {"ids": ids,
                                                                                "logp": jnp.asarray(ll, jnp.float32)}}))

    gd = np.asarray(jax.grad(dense_total)(jnp.asarray(e, jnp.float32)))
    gt = np.asarray(jax.grad(topk_total)(jnp.asarray(lp, jnp.float32)))
    for idx in [(0, 1, 2), (1, 3, int(x[1, 3])), (1, 0, 5)]:
        assert gd[idx] == pytest.approx(_fd(dense_total, e, idx), rel=2e-2, abs=2e-3)
    for idx in [(0, 2, 0), (1, 1, 3)]:
        assert gt[idx] == pytest.approx(_fd(topk_total, lp, idx), rel=2e-2, abs=2e-3)
    # latent potentials and external leaf values
    lat = rng.normal(size=(B, T, L))

    def latent_total(pp):
        return jnp.sum(c.log_prob(c.params, x, evidence={"categorical_logp": jnp.asarray(e, jnp.float32),
                                                         "latent": jnp.asarray(pp, jnp.float32)}))

    gl = np.asarray(jax.grad(latent_total)(jnp.asarray(lat, jnp.float32)))
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
    g = np.asarray(jax.grad(lambda q: jnp.sum(c.log_prob(c.params, x, evidence={"external": q})))(jnp.asarray(ext)))
    post = w[None] * np.exp(ext.sum(1))
    np.testing.assert_allclose(g, np.repeat((post / post.sum(1, keepdims=True))[:, None, :], V, 1), rtol=1e-4)
    with pytest.raises(ValueError, match="External leaves need evidence"):
        c.log_prob(c.params, x)


# ---- per-sample sum parameters -----------------------------------------------------------------------

def _per_sample_reference(c, params, x, gates, lowrank):
    """Dense per-sample reference: materialize every sample's normalized weights, evaluate one by one."""
    out = []
    for s in range(x.shape[0]):
        w = {}
        for grp in c.layout.sum_groups:
            k = grp.key
            gt = None if gates is None or k not in gates else jnp.asarray(gates[k][s:s + 1])
            lr = None if lowrank is None or k not in lowrank else {n: jnp.asarray(v[s:s + 1])
                                                                   for n, v in lowrank[k].items()}
            w[k] = dense_weights_reference(params["sum"][k], gt, lr)[0]
        sums = jax.tree_util.tree_map(jnp.log, em.normalize_sum_params(c.layout, c.tables, w, 0.0))
        out.append(float(c.log_prob({"sum": sums, "input": params["input"]}, x[s:s + 1])[0]))
    return np.array(out)


@pytest.mark.parametrize("kind", cases(["gates", "lowrank", "both"], fast=[]))
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
        grad = np.asarray(jax.grad(f)(jnp.asarray(gates[key])))
        idx = (2, 0)
        assert grad[idx] == pytest.approx(_fd(f, gates[key].astype(np.float64), idx), rel=2e-2, abs=2e-3)
    if "sum_lowrank" in ev:
        def f(u):
            lr = {**lowrank, key: {"u": jnp.asarray(u, jnp.float32), "v": lowrank[key]["v"]}}
            return jnp.sum(c.log_prob(c.params, x, evidence={**ev, "sum_lowrank": lr}))
        grad = np.asarray(jax.grad(f)(jnp.asarray(lowrank[key]["u"])))
        idx = (1, 0, 0, 1)
        assert grad[idx] == pytest.approx(_fd(f, lowrank[key]["u"].astype(np.float64), idx), rel=2e-2, abs=2e-3)


def test_shared_parameters_train_by_em_under_gates():
    c = jaxpc.compile(structures.HMM(5, 4, 6, block_size=2))
    rng = np.random.default_rng(6)
    x = rng.integers(0, 6, (16, 5)).astype(np.int32)
    zero = {g.key: np.zeros((16, g.num_blocks), np.float32) for g in c.layout.sum_groups}
    # zero gates are no gates at all
    for u, v in zip(jax.tree_util.tree_leaves(c.em_step(c.params, x, evidence={"sum_gates": zero})),
                    jax.tree_util.tree_leaves(c.em_step(c.params, x))):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6)
    gates = {g.key: rng.normal(size=(16, g.num_blocks)).astype(np.float32) for g in c.layout.sum_groups}
    fl = c.flows(c.params, x, evidence={"sum_gates": gates})
    # the flows are posterior edge counts: each sum node's outgoing flow totals the batch for the root
    assert float(np.asarray(c.get_node_flows(fl, c.root)).sum()) == pytest.approx(16, rel=1e-5)
    new = c.em_step(c.params, x, evidence={"sum_gates": gates}, pseudocount=0.1)
    np.testing.assert_allclose(np.asarray(c.get_node_params(new, c.root)).sum(), 1.0, rtol=1e-5)


@pytest.mark.parametrize("name", cases(["hmm_untied", "hclt", "pd", "rat"], fast=["hclt"]))
def test_evidence_on_every_structure_with_cache_and_jit_grad(name):
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


def test_evidence_errors():
    c = jaxpc.compile(structures.HMM(3, 2, 4))
    x = np.zeros((2, 3), np.int32)
    with pytest.raises(ValueError, match=r"unknown evidence key\(s\) \['soft'\]"):
        c.log_prob(c.params, x, evidence={"soft": np.zeros((2, 3, 4))})
    with pytest.raises(ValueError, match=r"evidence\['latent'\] must have 3 axes with the batch \(2\) first"):
        c.log_prob(c.params, x, evidence={"latent": np.zeros((3, 3, 2))})
    with pytest.raises(ValueError, match="names sum group '9x9'"):
        c.log_prob(c.params, x, evidence={"sum_gates": {"9x9": np.zeros((2, 1))}})
    with pytest.raises(TypeError, match="'ids'\\] must be integers"):
        c.log_prob(c.params, x,
                   evidence={"categorical_topk": {"ids": np.zeros((2, 3, 2)), "logp": np.zeros((2, 3, 2))}})


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
    for method in ("dense", "gather", "auto"):
        got = _topk_logz(jnp.asarray(lt), jnp.asarray(ids), jnp.asarray(lp), jnp.asarray(mask), jnp.asarray(rows),
                         jnp.asarray(vars_), method=method, budget=8)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=method)
    with pytest.raises(ValueError, match="unknown top-k evidence method"):
        _topk_logz(jnp.asarray(lt), jnp.asarray(ids), jnp.asarray(lp), None, jnp.asarray(rows), jnp.asarray(vars_),
                   method="sparse")


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
