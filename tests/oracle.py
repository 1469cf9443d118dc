"""A float64 numpy oracle that evaluates node graphs directly (no compiler, no JAX).

It reads parameters through ``circuit.get_node_params`` (itself checked against the values
given at construction) and implements the textbook recursions: sum-product / max-product /
tempered forward passes, top-down flows, and the EM updates in closed form.
"""

from __future__ import annotations

import math

import numpy as np

from jaxpc import distributions
from jaxpc.nodes import topological_order


def _np(a):
    if isinstance(a, dict):
        return {k: np.asarray(v, dtype=np.float64) for k, v in a.items()}
    return np.asarray(a, dtype=np.float64)


def _lse(a, axis):
    m = np.max(a, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return np.squeeze(np.log(np.sum(np.exp(a - m), axis=axis, keepdims=True)) + m, axis=axis)


def _reduce(logp, mode, alpha, axis=-1):
    if mode == "MPE":
        return np.max(logp, axis=axis)
    if mode == "GeneralLL":
        return _lse(alpha * logp, axis) / alpha
    return _lse(logp, axis)


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def category_table(dist, params, n):
    """``[n, K]`` log-pmf of a discrete leaf vector (None for Gaussians)."""
    with np.errstate(divide="ignore"):
        if isinstance(dist, distributions.Bernoulli):
            p = _np(params)
            return np.log(np.stack([1 - p, p], axis=1))
        if isinstance(dist, distributions.MaskedCategorical):
            return np.log(_np(params["probs"]))
        if isinstance(dist, distributions.Categorical):
            return np.log(_np(params))
        if isinstance(dist, distributions.DiscreteLogistic):
            mu, s = _np(params["mu"])[:, None], _np(params["s"])[:, None]
            i = np.arange(dist.num_cats)[None, :]
            lo = dist.lo + i * dist.width
            cdf_hi = np.where(i == dist.num_cats - 1, 1.0, _sigmoid((lo + dist.width - mu) / s))
            cdf_lo = np.where(i == 0, 0.0, _sigmoid((lo - mu) / s))
            return np.log(cdf_hi - cdf_lo)
        if isinstance(dist, distributions.Literal):
            t = np.full((n, max(2, dist.lit + 1)), -np.inf)  # (the variable takes at least the values 0, 1)
            t[:, dist.lit] = 0.0
            return t
        if isinstance(dist, distributions.Indicator):
            t = np.full((n, dist.num_states), -np.inf)
            t[np.arange(n), np.arange(n) % dist.num_states] = 0.0
            return t
    return None


def leaf_values(ns, params, x, miss, mode, alpha):
    """``[n, B]`` values of an input vector."""
    n = ns.num_nodes
    col = x[:, ns.var]
    mcol = np.zeros(col.shape, bool) if miss is None else miss[:, ns.var]
    table = category_table(ns.dist, params, n)
    if table is not None:
        xi = np.where(mcol, 0, col).astype(np.int64)
        if isinstance(ns.dist, distributions.Literal):
            # a literal accepts any non-negative value; pad the table to cover x
            width = max(int(xi.max()) + 1, table.shape[1])
            t2 = np.full((n, width), -np.inf)
            t2[:, :table.shape[1]] = table
            table = t2
        vals = table[:, xi]
        if isinstance(ns.dist, (distributions.Literal, distributions.Indicator)):
            marg = np.zeros(n)
        else:
            marg = _reduce(table, mode, alpha)
        return np.where(mcol[None, :], marg[:, None], vals)
    # Gaussian
    mu, sigma = _np(params["mu"])[:, None], _np(params["sigma"])[:, None]
    z = (np.where(mcol, 0.0, col)[None, :] - mu) / sigma
    vals = -0.5 * z * z - np.log(sigma) - 0.5 * math.log(2 * math.pi)
    if mode == "MPE":
        marg = -np.log(sigma[:, 0]) - 0.5 * math.log(2 * math.pi)
    elif mode == "GeneralLL":  # numerical integral of N(x)^alpha
        marg = np.empty(n)
        for i in range(n):
            grid = np.linspace(mu[i, 0] - 15 * sigma[i, 0], mu[i, 0] + 15 * sigma[i, 0], 200001)
            dens = np.exp(-0.5 * ((grid - mu[i, 0]) / sigma[i, 0]) ** 2) / (sigma[i, 0] * math.sqrt(2 * math.pi))
            marg[i] = math.log(np.trapezoid(dens ** alpha, grid)) / alpha
    else:
        marg = np.zeros(n)
    return np.where(mcol[None, :], marg[:, None], vals)


def forward(circuit, params, x, miss=None, mode="LL", alpha=None):
    """Dict ``node id -> [num_nodes, B]`` float64 values, plus the root values ``[B]``."""
    x = np.asarray(x, dtype=np.float64)
    vals = {}
    for ns in topological_order(circuit.root):
        if ns.is_input():
            vals[ns.id] = leaf_values(ns, circuit.get_node_params(params, ns), x, miss, mode, alpha)
        elif ns.is_prod():
            K = ns.block_size
            out = np.zeros((ns.num_nodes, x.shape[0]))
            for j, c in enumerate(ns.children):
                rows = (ns.edge_ids[:, j][:, None] * K + np.arange(K)).reshape(-1)
                out = out + vals[c.id][rows]
            vals[ns.id] = out
        else:
            W = _np(circuit.get_node_params(params, ns))
            X = np.concatenate([vals[c.id] for c in ns.children])
            with np.errstate(divide="ignore"):
                t = np.log(W)[:, :, None] + X[None, :, :]
            if mode == "MPE":
                vals[ns.id] = np.max(t, axis=1)
            elif mode == "GeneralLL":
                vals[ns.id] = _lse(alpha * t, 1) / alpha
            else:
                vals[ns.id] = _lse(t, 1)
    return vals, vals[circuit.root.id][0]


def edge_mask(ns):
    """``bool[num_nodes, num_ch_nodes]``: which weights of a sum vector exist (its block edges)."""
    mask = np.zeros((ns.num_node_blocks, ns.num_ch_node_blocks), bool)
    mask[ns.edge_ids[0], ns.edge_ids[1]] = True
    return np.repeat(np.repeat(mask, ns.block_size, 0), ns.ch_block_size, 1)


def _split(W, X, f, T):
    """``[n, nch, B]``: each parent's flow ``f`` split over its children by ``(w x)^(1/T)`` normalized;
    parents that are impossible (all children -inf) pass nothing."""
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (np.log(W)[:, :, None] + X[None]) / T
        top = np.max(t, axis=1, keepdims=True)
        p = np.exp(t - np.where(np.isfinite(top), top, 0.0))
        p = p / p.sum(1, keepdims=True)
    return np.where(np.isfinite(top), f[:, None, :] * p, 0.0)


def _split_first_max(W, X, f):
    """``[n, nch, B]``: each parent's flow ``f`` given whole to its first child whose ``log w + x`` is the parent's
    max-product value (hard EM); impossible parents pass nothing."""
    with np.errstate(divide="ignore"):
        t = np.log(W)[:, :, None] + X[None]
    top = t.max(axis=1)  # [n, B]
    first = np.argmax(t == top[:, None, :], axis=1)  # [n, B]
    e = np.zeros_like(t)
    i, b = np.nonzero(np.isfinite(top))
    e[i, first[i, b], b] = f[i, b]
    return e


def flows(circuit, params, x, miss=None, weights=None, tp: float = 1.0, te: float = 1.0, alpha: float | None = None,
          hard: bool = False):
    """Top-down LL flows (``GeneralLL(alpha)``'s where ``alpha`` is given: each split by ``(w x)^alpha``
    normalized; with ``hard``, max-product flows, each node's flow to its first maximizing child). Returns (sum edge
    flows by node id ``[n, nch]``, input node flows by node id ``[n, B]``, the node values), float64 and per vector
    (not yet summed over tied vectors). ``tp``/``te``: temperatures of the parameter flows and of the flows passed
    down (1: EM)."""
    mode = "MPE" if hard else "LL" if alpha is None else "GeneralLL"
    vals, root = forward(circuit, params, x, miss, mode=mode, alpha=alpha)
    if alpha is not None:
        tp, te = tp / alpha, te / alpha
    B = np.asarray(x).shape[0]
    w = np.ones(B) if weights is None else np.asarray(weights, np.float64)
    order = topological_order(circuit.root)
    F = {ns.id: np.zeros((ns.num_nodes, B)) for ns in order}
    F[circuit.root.id][0] = w
    edge = {}
    for ns in reversed(order):
        f = F[ns.id]
        if ns.is_sum():
            W = _np(circuit.get_node_params(params, ns))
            X = np.concatenate([vals[c.id] for c in ns.children])
            ef = _split_first_max(W, X, f) if hard else _split(W, X, f, tp)  # [n, nch, B]
            edge[ns.id] = ef.sum(axis=2)
            chf = (ef if hard or te == tp else _split(W, X, f, te)).sum(axis=0)
            start = 0
            for c in ns.children:
                F[c.id] += chf[start:start + c.num_nodes]
                start += c.num_nodes
        elif ns.is_prod():
            K = ns.block_size
            for j, c in enumerate(ns.children):
                rows = (ns.edge_ids[:, j][:, None] * K + np.arange(K)).reshape(-1)
                np.add.at(F[c.id], rows, f)
    return edge, {ns.id: F[ns.id] for ns in order if ns.is_input()}, vals


def tied_edge_flows(circuit, edge):
    """Edge flows of :func:`flows` summed over tied sum vectors: ``{source node id: [n, nch]}`` (what
    ``circuit.get_node_flows`` reports for the source vector)."""
    out = {}
    for ns in circuit.nodes:
        if ns.is_sum():
            out[ns.source.id] = out.get(ns.source.id, 0) + edge[ns.id]
    return out


def flow_totals(circuit, params, x, miss=None, weights=None):
    """What ``circuit.flows`` reports, from :func:`flows`: ``(sum edge flows, input statistics)`` by source
    vector id, summed over tied vectors (input vectors without statistics are left out)."""
    edge, node_flows, _ = flows(circuit, params, x, miss, weights=weights)
    sums, ins = {}, {}
    for ns in circuit.nodes:
        sid = ns.source.id
        if ns.is_sum():
            sums[sid] = sums.get(sid, 0) + edge[ns.id]
        elif ns.is_input():
            st = input_stats(ns, circuit.get_node_params(params, ns), x, miss, node_flows[ns.id])
            if st is not None:
                ins[sid] = st if sid not in ins else (
                    {k: ins[sid][k] + st[k] for k in st} if isinstance(st, dict) else ins[sid] + st)
    return sums, ins, edge


def check_flows(circuit, fl, sums, ins, rtol=1e-4, atol=1e-5) -> int:
    """Assert ``circuit.flows``' result ``fl`` equals :func:`flow_totals`' ``(sums, ins)``; returns how many
    source vectors were checked."""
    checked = 0
    for ns in circuit.nodes:
        if ns.source is not ns:
            continue
        if ns.is_sum():
            np.testing.assert_allclose(np.asarray(circuit.get_node_flows(fl, ns)), sums[ns.id], rtol=rtol, atol=atol)
            checked += 1
        elif ns.is_input() and ns.id in ins:
            got = circuit.get_node_flows(fl, ns)
            ref = ins[ns.id]
            if isinstance(ref, dict):
                for k in ref:
                    np.testing.assert_allclose(np.asarray(got[k]), ref[k], rtol=rtol, atol=max(atol, 1e-4))
            else:
                np.testing.assert_allclose(np.asarray(got), ref, rtol=rtol, atol=atol)
            checked += 1
    return checked


def input_stats(ns, params, x, miss, node_flows):
    """Expected sufficient statistics of one input vector, in the form ``get_node_flows`` returns."""
    x = np.asarray(x, np.float64)
    col = x[:, ns.var]
    mcol = np.zeros(col.shape, bool) if miss is None else np.asarray(miss)[:, ns.var]
    F = node_flows
    d = ns.dist
    if isinstance(d, distributions.Categorical):
        K = d.num_cats
        counts = np.zeros((ns.num_nodes, K))
        xi = np.where(mcol, 0, col).astype(np.int64)
        for k in range(K):
            counts[:, k] = (F * ((xi == k) & ~mcol)[None, :]).sum(1)
        probs = np.exp(category_table(d, params, ns.num_nodes))
        counts += (F * mcol[None, :]).sum(1)[:, None] * probs
        return counts
    if isinstance(d, (distributions.Gaussian, distributions.DiscreteLogistic)):
        if isinstance(d, distributions.Gaussian):
            mu, var = _np(params["mu"]), _np(params["sigma"]) ** 2
            v = np.where(mcol, 0.0, col)
        else:
            mu, var = _np(params["mu"]), (_np(params["s"]) * math.pi) ** 2 / 3
            v = d.lo + (np.where(mcol, 0, col) + 0.5) * d.width
        vals = np.where(mcol[None, :], mu[:, None], v[None, :])
        sq = np.where(mcol[None, :], (mu * mu + var)[:, None], v[None, :] ** 2)
        return {"s0": F.sum(1), "s1": (F * vals).sum(1), "s2": (F * sq).sum(1)}
    return None


def em_sum_update(W, counts, edge_mask, ch_block_size, step, pc):
    """Closed-form EM update of one sum vector's dense weights ``[n, nch]``."""
    nch = edge_mask.sum(1, keepdims=True).astype(np.float64)
    c = np.where(edge_mask, counts + pc / nch, 0.0)
    tot = c.sum(1, keepdims=True)
    new = np.where(tot > 0, c / np.where(tot > 0, tot, 1), W)
    return (1 - step) * W + step * new


def _blend_counts(probs, counts, step):
    """Normalize counts per row (rows without mass keep ``probs``) and blend with the step size."""
    tot = counts.sum(1, keepdims=True)
    new = np.where(tot > 0, counts / np.where(tot > 0, tot, 1), probs)
    return (1 - step) * probs + step * new


def em_input_update(d, params, stats, step, pc):
    """Closed-form EM update of one input vector's natural params (as get_node_params returns them)."""
    if isinstance(d, distributions.MaskedCategorical):
        probs = _np(params["probs"])
        mask = np.asarray(params["mask"], bool)
        k_eff = mask.sum(1, keepdims=True)
        c = np.where(mask, stats + pc / k_eff, 0.0)
        return {"probs": _blend_counts(probs, c, step)}
    if isinstance(d, distributions.Bernoulli):
        p = _np(params)
        probs = np.stack([1 - p, p], 1)
        return _blend_counts(probs, stats + pc / 2, step)[:, 1]
    if isinstance(d, distributions.Categorical):
        return _blend_counts(_np(params), stats + pc / d.num_cats, step)
    if isinstance(d, (distributions.Gaussian, distributions.DiscreteLogistic)):
        mu = _np(params["mu"])
        if isinstance(d, distributions.Gaussian):
            scale = _np(params["sigma"])
            var, min_std = scale ** 2, d.min_sigma
        else:
            scale = _np(params["s"])
            var, min_std = (scale * math.pi) ** 2 / 3, d.min_std
        s0 = stats["s0"] + pc
        ok = s0 > 0  # nodes that received no flow keep their parameters
        safe = np.where(ok, s0, 1.0)
        nmu = np.where(ok, (stats["s1"] + pc * mu) / safe, mu)
        ex2 = (stats["s2"] + pc * (mu * mu + var)) / safe
        nstd = np.where(ok, np.sqrt(np.maximum(ex2 - nmu * nmu, min_std ** 2)), np.sqrt(var))
        if isinstance(d, distributions.DiscreteLogistic):
            nscale = nstd * math.sqrt(3) / math.pi
            return {"mu": (1 - step) * mu + step * nmu, "s": (1 - step) * scale + step * nscale}
        return {"mu": (1 - step) * mu + step * nmu, "sigma": (1 - step) * scale + step * nstd}
    return None
