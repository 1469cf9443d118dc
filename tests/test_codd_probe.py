"""Per-call evidence (CoDD) as a user drives it, against a float64 node-by-node oracle and brute-force enumeration:
soft evidence (dense and top-k), External leaves, latent potentials, BlockScale gates (per parent node, per edge
block, tied, per parameter block) and LowRank factors, all in one circuit evaluated in float64 under
``jax.enable_x64``; gradients by the evidence against central finite differences; EM with evidence; batch sizes 1
and odd; the errors of malformed evidence; and the executable cache."""

from __future__ import annotations

import importlib.util
import itertools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpc
from jaxpc import distributions, structures
from jaxpc.nodes import topological_order

from .tiers import cases

# ---- a float64 oracle: every sample's own weights and leaf values, node by node ---------------------------------


def _gate_cols(c, ns, gates):
    """``(key, cols [Np, Nc])``: the log-gate each weight of ``ns`` reads (key None: the gate columns; a group:
    ``{group: [B, P]}``), -1 where none; None when ``ns`` runs ungated."""
    Kp, Kc = ns.block_size, ns.ch_block_size
    cols = np.full((ns.num_nodes, ns.num_ch_nodes), -1)
    if isinstance(gates, dict):
        group, blocks = c.param_slice(ns)
        if group not in gates:
            return None
        for e, (i, j) in enumerate(ns.edge_ids.T):
            cols[i * Kp:(i + 1) * Kp, j * Kc:(j + 1) * Kc] = blocks.start + e
        return group, cols
    if gates is None or ns.gates is None:
        return None
    sl, gb = c.gate_slice(ns), ns.gates.block_size
    for e, (i, j) in enumerate(ns.edge_ids.T):
        cols[i * Kp:(i + 1) * Kp, j * Kc:(j + 1) * Kc] = (sl.start + e * (Kp // gb) + np.arange(Kp) // gb)[:, None]
    return None, cols


def _weights(c, params, ns, ev, b):
    """Sample ``b``'s normalized weights of sum vector ``ns``: ``(w + U V) * exp(g)``, renormalized per node."""
    Kp, Kc = ns.block_size, ns.ch_block_size
    a = np.asarray(c.get_node_params(params, ns), np.float64).copy()
    lowrank = ev.get("sum_lowrank")
    group, blocks = c.param_slice(ns)
    if lowrank is not None and group in lowrank:
        u, v = (np.asarray(lowrank[group][k], np.float64)[b] for k in "uv")
        for e, (i, j) in enumerate(ns.edge_ids.T):
            a[i * Kp:(i + 1) * Kp, j * Kc:(j + 1) * Kc] += u[blocks.start + e] @ v[blocks.start + e]
    gc = _gate_cols(c, ns, ev.get("sum_gates"))
    if gc is not None:
        key, cols = gc
        g = np.asarray(ev["sum_gates"] if key is None else ev["sum_gates"][key], np.float64)[b]
        g = g - g.max()  # (exp(g) of each node's row is renormalized: a constant cancels)
        a = a * np.where(cols >= 0, np.exp(g[np.maximum(cols, 0)]), 1.0)
    return a / a.sum(1, keepdims=True)


def _leaf(c, params, ns, ev, xb, missing: bool, b, mode):
    """Log-values ``[n]`` of input vector ``ns`` for sample ``b``."""
    n, v, d = ns.num_nodes, ns.var, ns.dist
    if isinstance(d, distributions.External):
        out = np.asarray(ev["external"], np.float64)[b, v, :n]
    else:
        with np.errstate(divide="ignore"):
            lt = np.log(np.asarray(c.get_node_params(params, ns), np.float64))
        soft = isinstance(d, distributions.SoftEvidenceCategorical)
        if soft and ("categorical_logp" in ev or "categorical_topk" in ev):
            if "categorical_logp" in ev:
                e = np.asarray(ev["categorical_logp"], np.float64)[b, v, :d.num_cats]
            else:
                t = ev["categorical_topk"]
                ids, lp = np.asarray(t["ids"])[b, v], np.asarray(t["logp"], np.float64)[b, v]
                if t.get("mask") is not None:
                    lp = np.where(np.asarray(t["mask"])[b, v], lp, -np.inf)
                e = np.full(d.num_cats, -np.inf)
                inside = ids < d.num_cats  # a candidate that is no value of the leaves has no weight
                e[ids[inside]] = lp[inside]
            with np.errstate(divide="ignore", invalid="ignore"):
                lq = lt + e[None, :]
                z = np.log(np.exp(lq).sum(1, keepdims=True))
                lq = np.where(np.isfinite(z), lq - z, -np.inf)
            if missing:
                out = np.where(np.isfinite(z[:, 0]), 0.0, -np.inf) if mode == "LL" else lq.max(1)
            else:
                out = lq[:, int(xb)]
        elif missing:
            out = np.zeros(n) if mode == "LL" else lt.max(1)
        else:
            out = lt[:, int(xb)]
    if ev.get("latent") is not None:
        out = out + np.asarray(ev["latent"], np.float64)[b, v, :n]
    return out


def oracle(c, params, x, ev=None, missing=None, mode="LL"):
    """float64 ``log p(x_b)`` ``[B]`` (or the max-product value, ``mode="MPE"``) under per-call evidence ``ev``."""
    ev = ev or {}
    order = topological_order(c.root)
    out = []
    for b in range(len(x)):
        vals = {}
        for ns in order:
            if ns.is_input():
                miss = missing is not None and bool(np.asarray(missing)[b, ns.var])
                with np.errstate(over="ignore"):
                    vals[ns.id] = np.exp(_leaf(c, params, ns, ev, x[b, ns.var], miss, b, mode))
            elif ns.is_prod():
                K = ns.block_size
                vals[ns.id] = np.prod([vals[ch.id][(ns.edge_ids[:, j][:, None] * K + np.arange(K)).ravel()]
                                       for j, ch in enumerate(ns.children)], axis=0)
            else:
                w = _weights(c, params, ns, ev, b)
                ch = np.concatenate([vals[ch.id] for ch in ns.children])
                vals[ns.id] = w @ ch if mode == "LL" else np.max(w * ch[None, :], axis=1)
        with np.errstate(divide="ignore"):
            out.append(np.log(vals[c.root.id][0]))
    return np.array(out)


# ---- the circuit: every kind of evidence reader at once --------------------------------------------------------

def _root():
    """Four variables: soft evidence leaves over 0 and 3, a categorical over 1, External leaves over 2, and a second,
    smaller vector over each variable (latent entry j reaches node j of both); ``s01`` gated per parent node,
    ``s23`` its parameter-tied copy reading its gate columns, ``t`` gated per edge block, ``u`` and the root
    ungated."""
    sec, cat = distributions.SoftEvidenceCategorical(3), distributions.Categorical(3)
    a = [jaxpc.inputs(v, num_node_blocks=2, block_size=2, dist=d)
         for v, d in enumerate((sec, cat, distributions.External(), sec))]
    small = [jaxpc.inputs(v, num_node_blocks=1, block_size=2, dist=d)
             for v, d in enumerate((sec, cat, distributions.External(), sec))]
    s01 = jaxpc.summate(jaxpc.multiply(a[0], a[1]), num_node_blocks=2, block_size=2, name="s01")
    s23 = s01.duplicate(jaxpc.multiply(a[2], a[3]), tie_params=True, name="s23")
    s01.set_gates(1)
    s23.set_gates(tie_to=s01)
    t = jaxpc.summate(jaxpc.multiply(s01, s23), num_node_blocks=1, block_size=2, name="t").set_gates()
    u = jaxpc.summate(jaxpc.multiply(*small), num_node_blocks=1, block_size=2, name="u")
    return jaxpc.summate(t, u, num_nodes=1, name="root")


def _evidence(c, rng, B, dtype=np.float64, soft="dense", x=None):
    """Random evidence of every kind for a batch of ``B``; top-k: two candidates per position, the first the value
    of ``x`` (default: random ones)."""
    ev = {"external": rng.normal(size=(B, 4, 4)), "latent": rng.normal(size=(B, 4, 4)) * 0.3,
          "sum_gates": rng.normal(size=(B, c.num_gates)),
          "sum_lowrank": {g.key: {"u": rng.random((B, g.num_blocks, g.Kp, 2)),
                                  "v": rng.random((B, g.num_blocks, 2, g.Kc))} for g in c.layout.sum_groups}}
    if soft == "dense":
        ev["categorical_logp"] = rng.normal(size=(B, 4, 3))
    else:
        first = rng.integers(0, 3, (B, 4)) if x is None else x
        ids = np.stack([first, (first + rng.integers(1, 3, (B, 4))) % 3], axis=2).astype(np.int32)
        ev["categorical_topk"] = {"ids": ids, "logp": rng.normal(size=(B, 4, 2))}
    return jax.tree_util.tree_map(lambda a: a if a.dtype.kind == "i" else a.astype(dtype), ev)


@pytest.fixture(scope="module")
def c64():
    with jax.enable_x64(True):
        yield jaxpc.compile(_root(), seed=1, dtype=jnp.float64)


@pytest.fixture(scope="module")
def c32():
    return jaxpc.compile(_root(), seed=1)


@pytest.mark.parametrize("soft", cases(["dense", "topk"], fast=[]))
def test_every_evidence_kind_at_once_matches_the_float64_oracle(c64, soft):
    """Soft evidence, External values, latent potentials, gates (per parent node, tied, per edge block) and LowRank
    factors in one float64 call equal the oracle to rounding, at batch sizes 1 and 3 (one bucket: one
    executable for all of them, whatever the evidence)."""
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        misses = None
        for B in (1, 3):
            x = rng.integers(0, 3, (B, 4)).astype(np.int32)
            ev = _evidence(c64, rng, B, soft=soft)
            got = np.asarray(c64.log_prob(c64.params, x, evidence=ev))
            assert got.dtype == np.float64
            np.testing.assert_allclose(got, oracle(c64, c64.params, x, ev), rtol=1e-12, atol=1e-12)
            misses = c64.cache_info().misses if misses is None else misses
            assert c64.cache_info().misses == misses, B


@pytest.mark.full
def test_evidence_gradients_in_float64_equal_central_differences(c64):
    """``jax.grad`` (op by op and jitted) and ``flows(..., return_evidence_grad=True)`` by every evidence tensor
    equal central differences of the float64 oracle to 1e-7, and the flows' evidence gradient holds None for the
    top-k ids."""
    rng = np.random.default_rng(1)
    B = 3
    x = rng.integers(0, 3, (B, 4)).astype(np.int32)
    with jax.enable_x64(True):
        for soft in ("dense", "topk"):
            ev = _evidence(c64, rng, B, soft=soft, x=x)
            dev = jax.tree_util.tree_map(jnp.asarray, ev)

            def total(e):
                return jnp.sum(c64.log_prob(c64.params, x, evidence=e))

            grads = [jax.grad(total, allow_int=True)(dev), jax.jit(jax.grad(total, allow_int=True))(dev),
                     c64.flows(c64.params, x, evidence=ev, return_evidence_grad=True)[1]]
            if soft == "topk":
                assert grads[2]["categorical_topk"]["ids"] is None
            leaves, tdef = jax.tree_util.tree_flatten(ev)
            for i, leaf in enumerate(leaves):
                if leaf.dtype.kind == "i":
                    continue
                for idx in [tuple(int(rng.integers(0, s)) for s in leaf.shape) for _ in range(3)]:
                    def at(h, i=i, idx=idx):
                        moved = [a.copy() for a in leaves]
                        moved[i][idx] += h
                        return oracle(c64, c64.params, x, jax.tree_util.tree_unflatten(tdef, moved)).sum()

                    fd = (at(1e-6) - at(-1e-6)) / 2e-6
                    for g in grads:
                        got = jax.tree_util.tree_flatten(g, is_leaf=lambda a: a is None)[0][i]
                        assert float(np.asarray(got)[idx]) == pytest.approx(fd, abs=1e-7), (i, idx)


@pytest.mark.slow
def test_missing_and_mpe_under_evidence_against_enumeration(c64):
    """A missing variable under top-k soft evidence, latent potentials, External values, gates and LowRank: the LL
    equals the log-sum over its completions of the same call (every value of the missing variables); MPE without
    per-sample sum parameters equals the oracle's max-product; MPE with gates is a ValueError naming them."""
    rng = np.random.default_rng(2)
    B = 4
    x = rng.integers(0, 3, (B, 4)).astype(np.int32)
    missing = np.array([[True, False, False, True], [False, True, True, False], [True, True, False, True],
                        [False, False, False, False]])
    with jax.enable_x64(True):
        ev = _evidence(c64, rng, B, soft="topk")
        got = np.asarray(c64.log_prob(c64.params, x, missing, evidence=ev))
        np.testing.assert_allclose(got, oracle(c64, c64.params, x, ev, missing), rtol=1e-12)
        rows, owner = [], []
        for b in range(B):
            free = [v for v in range(4) if missing[b, v] and v != 2]  # (External leaves read no x)
            for vals in itertools.product(range(3), repeat=len(free)):
                row = x[b].copy()
                row[free] = vals
                rows.append(row)
                owner.append(b)
        owner = np.array(owner)
        rep = jax.tree_util.tree_map(lambda a: np.asarray(a)[owner], ev)
        joint = np.asarray(c64.log_prob(c64.params, np.array(rows), missing[owner] & (np.arange(4) == 2),
                                        evidence=rep))
        np.testing.assert_allclose(got, [np.logaddexp.reduce(joint[owner == b]) for b in range(B)], rtol=1e-12)
        leaf_only = {k: ev[k] for k in ("categorical_topk", "external", "latent")}
        mpe = np.asarray(c64.log_prob(c64.params, x, missing, evidence=leaf_only, propagation="MPE"))
        np.testing.assert_allclose(mpe, oracle(c64, c64.params, x, leaf_only, missing, mode="MPE"), rtol=1e-12)
        with pytest.raises(ValueError, match=r"sum_gates / sum_lowrank\) support propagation='LL'"):
            c64.log_prob(c64.params, x, evidence=ev, propagation="MPE")


@pytest.mark.slow
@pytest.mark.full
def test_em_with_evidence_and_the_cache(c32):
    """``em_step(..., evidence=)`` equals ``em_update`` of ``flows(..., evidence=)``; ``log_prob``, ``flows`` (with
    the evidence gradient too) and ``em_step`` compile once each for fresh evidence, host or device, at batch sizes of
    one bucket; log-space flows equal the log of the flows under leaf evidence."""
    rng = np.random.default_rng(3)

    def ev(B):
        return _evidence(c32, rng, B, dtype=np.float32)

    x = rng.integers(0, 3, (5, 4)).astype(np.int32)
    e = ev(5)
    fl = c32.flows(c32.params, x, evidence=e)
    want = c32.em_update(c32.params, fl, step_size=0.7, pseudocount=0.1)
    got = c32.em_step(c32.params, x, evidence=e, step_size=0.7, pseudocount=0.1)
    for u, v in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-6, atol=1e-7)
    calls = (lambda x, e: c32.log_prob(c32.params, x, evidence=e),
             lambda x, e: c32.flows(c32.params, x, evidence=e, return_ll=True),
             lambda x, e: c32.flows(c32.params, x, evidence=e, return_evidence_grad=True),
             lambda x, e: c32.em_step(c32.params, x, evidence=e, step_size=0.5))
    for call in calls:
        call(x, ev(5))
        misses = c32.cache_info().misses
        call(x, ev(5))
        call(x, jax.tree_util.tree_map(jnp.asarray, ev(5)))
        call(x[:3], ev(3))
        assert c32.cache_info().misses == misses
    leaf_only = {k: e[k] for k in ("categorical_logp", "external", "latent")}
    lin = c32.flows(c32.params, x, evidence=leaf_only)
    log = c32.flows(c32.params, x, evidence=leaf_only, options=jaxpc.Options(logspace_flows=True))
    for u, v in zip(jax.tree_util.tree_leaves(log), jax.tree_util.tree_leaves(lin), strict=True):
        np.testing.assert_allclose(np.exp(np.asarray(u, np.float64)), np.asarray(v), rtol=1e-4, atol=1e-6)



@pytest.mark.slow
@pytest.mark.full  # (in CI: the Flax soft-evidence notebook trains under evidence)
def test_fit_trains_logits_by_gradient_under_evidence():
    """``optim.fit`` with an optax optimizer and per-row evidence (dense soft evidence, latent potentials, one gate
    per parameter block) over one batch of 7 rows takes the step of ``jax.grad`` of the mean negative
    log-likelihood of the renormalized logits under the same evidence; with EM and batches of 3 (the last one
    padded) it equals ``em_step`` on each batch's rows and evidence."""
    optax = pytest.importorskip("optax")
    from jaxpc import optim
    from jaxpc.optim.normalize import normalize_params

    c = jaxpc.compile(structures.GeneralizedHMM(3, 2, distributions.SoftEvidenceCategorical(4)), seed=0)
    rng = np.random.default_rng(7)
    x = rng.integers(0, 4, (7, 3)).astype(np.int32)
    ev = {"categorical_logp": rng.normal(size=(7, 3, 4)).astype(np.float32),
          "latent": rng.normal(size=(7, 3, 2)).astype(np.float32),
          "sum_gates": {g.key: rng.normal(size=(7, g.num_blocks)).astype(np.float32) for g in c.layout.sum_groups}}
    res = optim.fit(c, c.params, x, epochs=1, batch_size=7, shuffle=False, optimizer=optax.sgd(0.1), evidence=ev,
                    progress=False)

    def loss(p):
        return -jnp.mean(c.log_prob(normalize_params(c.layout, c.tables, p), x, evidence=ev))

    g = jax.jit(jax.grad(loss))(c.params)
    want = normalize_params(c.layout, c.tables, jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, c.params, g))
    for u, v in zip(jax.tree_util.tree_leaves(res.params), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6)
    res = optim.fit(c, c.params, x, epochs=1, batch_size=3, shuffle=False, step_size=0.5, evidence=ev,
                    progress=False)
    p, lls = c.params, []
    for rows in (slice(0, 3), slice(3, 6), slice(6, 7)):
        p, ll = c.em_step(p, x[rows], evidence=jax.tree_util.tree_map(lambda a, r=rows: a[r], ev), step_size=0.5,
                          return_ll=True)
        lls.append(np.asarray(ll))
    for u, v in zip(jax.tree_util.tree_leaves(res.params), jax.tree_util.tree_leaves(p), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-6, atol=1e-7)
    assert float(res.epoch_ll[0]) == pytest.approx(float(np.concatenate(lls).mean()), rel=1e-5)

# ---- bugs found (each test fails without its fix) ---------------------------------------------------------------

@pytest.mark.slow  # a float32 executable and its float64 oracle
def test_gates_are_shift_invariant_per_sample(c32):
    """Adding one constant to every log-gate of a sample changes nothing (each node's gated weights are
    renormalized), however large: +100 (exp overflows float32) and -200 (exp underflows to 0) give the gates' own
    values, the oracle's (with LowRank factors too)."""
    rng = np.random.default_rng(4)
    B = 3
    x = rng.integers(0, 3, (B, 4)).astype(np.int32)
    ev = _evidence(c32, rng, B, dtype=np.float32)
    ev.pop("categorical_logp")
    want = np.asarray(c32.log_prob(c32.params, x, evidence=ev))
    np.testing.assert_allclose(want, oracle(c32, c32.params, x, ev), rtol=1e-5)
    for shift in (100.0, -200.0):
        moved = {**ev, "sum_gates": (ev["sum_gates"] + np.float32(shift)).astype(np.float32)}
        np.testing.assert_allclose(np.asarray(c32.log_prob(c32.params, x, evidence=moved)), want, rtol=1e-5,
                                   err_msg=f"shift {shift}")


@pytest.fixture(scope="module")
def soft_hmm():
    return jaxpc.compile(structures.GeneralizedHMM(3, 2, distributions.SoftEvidenceCategorical(4)), seed=0)


def _topk(B=2, V=3, k=2):
    return {"ids": np.tile(np.arange(k, dtype=np.int32), (B, V, 1)), "logp": np.zeros((B, V, k), np.float32)}


def test_dense_and_topk_soft_evidence_together_is_an_error(soft_hmm):
    x = np.zeros((2, 3), np.int32)
    dense = np.random.default_rng(0).normal(size=(2, 3, 4)).astype(np.float32)
    with pytest.raises(ValueError, match=r"both evidence\['categorical_logp'\].*'categorical_topk'\]"):
        soft_hmm.log_prob(soft_hmm.params, x, evidence={"categorical_logp": dense, "categorical_topk": _topk()})


@pytest.mark.parametrize("dtype", [np.complex64, np.str_])
def test_evidence_of_no_real_dtype_is_a_type_error(soft_hmm, dtype):
    x = np.zeros((2, 3), np.int32)
    e = np.zeros((2, 3, 4)).astype(dtype)
    with pytest.raises(TypeError, match=r"evidence\['categorical_logp'\] must hold real numbers, got dtype"):
        soft_hmm.log_prob(soft_hmm.params, x, evidence={"categorical_logp": e})


def test_topk_evidence_shape_keys_and_mask_are_checked(soft_hmm):
    x = np.zeros((2, 3), np.int32)
    lp = soft_hmm.log_prob
    for V, k in ((2, 2), (4, 2), (3, 0)):
        with pytest.raises(ValueError, match=rf"\['ids'\] must have shape \[2, 3, k\] with k >= 1 .*got \(2, {V}, "
                                             rf"{k}\)"):
            lp(soft_hmm.params, x, evidence={"categorical_topk": _topk(V=V, k=k)})
    with pytest.raises(ValueError, match=r"categorical_topk'\] must be .*got \['ids', 'logp', 'Mask'\]"):
        lp(soft_hmm.params, x, evidence={"categorical_topk": {**_topk(), "Mask": np.zeros((2, 3, 2), bool)}})
    with pytest.raises(TypeError, match=r"\['mask'\] must be booleans, got float32"):
        lp(soft_hmm.params, x, evidence={"categorical_topk": {**_topk(), "mask": np.full((2, 3, 2), 0.5, np.float32)}})
    lp(soft_hmm.params, x, evidence={"categorical_topk": {**_topk(), "mask": np.ones((2, 3, 2), np.int32)}})


def test_soft_evidence_leaves_of_different_num_cats():
    """Variable 0's leaves have 3 values, variable 1's 5: dense evidence ``[B, V, 5]`` (variable 0 reading its first
    3) and top-k candidates 3 and 4 of variable 0 (no values of its leaves: no weight) against the oracle."""
    a = jaxpc.inputs(0, num_node_blocks=1, block_size=2, dist=distributions.SoftEvidenceCategorical(3))
    b = jaxpc.inputs(1, num_node_blocks=1, block_size=2, dist=distributions.SoftEvidenceCategorical(5))
    c = jaxpc.compile(jaxpc.summate(jaxpc.multiply(a, b), num_nodes=1), seed=0)
    rng = np.random.default_rng(5)
    x = np.array([[0, 4], [2, 1]], np.int32)
    dense = rng.normal(size=(2, 2, 5)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x, evidence={"categorical_logp": dense})),
                               oracle(c, c.params, x, {"categorical_logp": dense}), rtol=1e-5)
    with pytest.raises(ValueError, match=r"must have shape \[2, 2, 5\] \(the SoftEvidenceCategorical leaves' "
                                         r"largest num_cats"):
        c.log_prob(c.params, x, evidence={"categorical_logp": dense[:, :, :3]})
    topk = {"ids": np.array([[[0, 4, 1], [3, 4, 1]], [[2, 3, 0], [1, 0, 2]]], np.int32),
            "logp": rng.normal(size=(2, 2, 3)).astype(np.float32)}
    np.testing.assert_allclose(np.asarray(c.log_prob(c.params, x, evidence={"categorical_topk": topk})),
                               oracle(c, c.params, x, {"categorical_topk": topk}), rtol=1e-5)


@pytest.mark.slow
def test_codd_benchmark_runs():
    spec = importlib.util.spec_from_file_location(
        "codd_benchmark", pathlib.Path(__file__).parents[1] / "benchmarks" / "codd.py")
    codd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codd)
    out = codd.main(["--latents", "4", "--vocab", "64", "--topk", "16", "--seq", "4", "--steps", "3"])
    assert out["check_err"] < 1e-3 and out["steps"] >= 1


@pytest.mark.slow
@pytest.mark.full
def test_flax_module_with_per_call_evidence(c32):
    """``CircuitModule(c)(x, evidence=ev)`` is ``c.log_prob(..., evidence=ev)``, differentiable in the evidence
    under ``nnx.jit``; ``em_step(x, evidence=ev)`` is ``c.em_step``'s; bad evidence is the circuit's error."""
    nnx = pytest.importorskip("flax.nnx")
    import jaxpc.nn

    rng = np.random.default_rng(6)
    x = rng.integers(0, 3, (3, 4)).astype(np.int32)
    ev = _evidence(c32, rng, 3, dtype=np.float32)
    m = jaxpc.nn.CircuitModule(c32)
    np.testing.assert_allclose(np.asarray(m(x, evidence=ev)), np.asarray(c32.log_prob(c32.params, x, evidence=ev)),
                               rtol=1e-5, atol=1e-6)

    @nnx.jit
    def grad(m, lat):
        return jax.grad(lambda q: jnp.sum(m(x, evidence={**ev, "latent": q})))(lat)

    want = jax.jit(jax.grad(lambda q: jnp.sum(c32.log_prob(c32.params, x, evidence={**ev, "latent": q}))))(
        jnp.asarray(ev["latent"]))
    np.testing.assert_allclose(np.asarray(grad(m, jnp.asarray(ev["latent"]))), np.asarray(want), rtol=1e-4,
                               atol=1e-6)
    with pytest.raises(ValueError, match=r"evidence\['external'\] must have shape"):
        m(x, evidence={**ev, "external": ev["external"][:, :, :1]})
    with pytest.raises(ValueError, match="not both"):
        m(soft_evidence=np.ones((3, 4, 3), np.float32), evidence=ev)
    ll = m.em_step(x, evidence=ev, step_size=0.5)
    new, want_ll = c32.em_step(c32.params, x, evidence=ev, step_size=0.5, return_ll=True)
    np.testing.assert_allclose(np.asarray(ll), np.asarray(want_ll), rtol=1e-5, atol=1e-6)
    for u, v in zip(jax.tree_util.tree_leaves(m.get_params()), jax.tree_util.tree_leaves(new), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # compiles log_prob and flows again under x64
def test_float64_evidence_keeps_a_float32_circuit_float32(c32):
    """Under x64, numpy evidence is float64 by default: it widened a float32 circuit's computation and outputs to
    float64. Float evidence now computes in the circuit's dtype (the values as with float32 evidence)."""
    rng = np.random.default_rng(3)
    x = rng.integers(0, 3, (5, 4)).astype(np.int32)
    ev = _evidence(c32, rng, 5)
    want = np.asarray(c32.log_prob(c32.params, x, evidence=_evidence_as(ev, np.float32)))
    with jax.enable_x64(True):
        got = c32.log_prob(c32.params, x, evidence=ev)
        assert got.dtype == jnp.float32
        fl = c32.flows(c32.params, x, evidence=ev)
        assert {a.dtype for a in jax.tree_util.tree_leaves(fl)} == {jnp.dtype(jnp.float32)}
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def _evidence_as(ev, dtype):
    return jax.tree_util.tree_map(lambda a: a if a.dtype.kind == "i" else a.astype(dtype), ev)
