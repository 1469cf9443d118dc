"""Leaves that read per-call evidence: ``SoftEvidenceCategorical`` and ``External``.

Per-call evidence travels in the ``evidence`` pytree of ``log_prob`` / ``flows`` / ``em_step``
(traced arguments: new evidence never recompiles):

* ``evidence["categorical_logp"]``: dense ``[B, V, K]`` log-weights ``e`` of every value (``K`` the largest
  ``num_cats`` of the circuit's soft evidence leaves; a leaf of fewer values reads the first ``num_cats``), or
  ``evidence["categorical_topk"] = {"ids": int[B, V, k], "logp": [B, V, k], "mask": bool[B, V, k]
  (optional)}``: ``k`` candidate values per position (unique per row) with their log-weights; values
  outside the candidates (or masked) get weight zero, and so do candidates that are no value of a leaf.
* ``evidence["external"]``: ``[B, V, M]`` log-values of ``External`` leaves (node ``j`` of a vector
  over variable ``v`` reads ``[:, v, j]``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..ops.logspace import log_sum_add, log_sum_value, log_sum_zeros
from ..ops.sum_layer import matmul
from .base import reduce_missing
from .categorical import Categorical

Array = jax.Array

#: the most (node, sample, value) entries made at a time by the top-k totals' gathers and by soft EM's counts of
#: missing values (both run over chunks of nodes: :func:`_node_chunks`)
CHUNK_BUDGET = 1 << 24


def _shift(lp: Array) -> tuple[Array, Array]:
    """``(exp(lp - m), m)`` with ``m`` the finite max over the last axis (0 where all are ``-inf``)."""
    m = jnp.max(lp, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    return jnp.exp(lp - m), m


def _topk_mask(topk: dict, num_cats: int) -> Array:
    """``[B, V, k]``: the top-k candidates that carry weight: a value of the leaves (``ids < num_cats``) and not
    masked out by ``topk["mask"]``."""
    live = topk["ids"] < num_cats
    return live if topk.get("mask") is None else live & topk["mask"]


def _reweighted(lt: Array, rows: Array, vars_: Array, dense: Array | None, ids: Array | None = None,
                logp: Array | None = None) -> Array:
    """``[N, B, K]`` (dense evidence ``[B, V, K]``) or ``[N, B, k]`` (top-k candidates ``ids`` with log-weights
    ``logp``, ``[B, V, k]``): ``log theta[row(n), value] + e[b, var(n), value]``, each node's reweighted pmf up to
    its normalizer."""
    if dense is not None:
        return lt[rows][:, None, :] + jnp.transpose(dense[:, vars_, :], (1, 0, 2))
    return (lt[rows[:, None, None], jnp.transpose(ids[:, vars_, :], (1, 0, 2))]
            + jnp.transpose(logp[:, vars_, :], (1, 0, 2)))


def _node_chunks(N: int, per_node: int, budget: int, *columns) -> tuple[int, list]:
    """``(size, chunks)``: the chunk size, at most ``budget // per_node`` nodes (at least 1), and each ``(array, fill)``
    of ``columns`` (node-major, ``[N, ...]``) padded with ``fill`` to whole chunks, ``[N / size, size, ...]``."""
    size = max(1, min(N, budget // per_node))
    pad = (-N) % size
    return size, [jnp.concatenate([a, jnp.full((pad,) + a.shape[1:], fill, a.dtype)]).reshape(-1, size, *a.shape[1:])
                  for a, fill in columns]


def _log_total(Z: Array) -> Array:
    """``log Z`` of non-negative totals: ``-inf`` where ``Z == 0`` (no value has weight), with a zero gradient there
    (not ``0 * inf``)."""
    pos = Z > 0
    return jnp.where(pos, jnp.log(jnp.where(pos, Z, jnp.ones((), Z.dtype))), -jnp.inf)


def _linear_logz(log_theta: Array, E: Array, emax: Array, rows: Array, vars_: Array, precision: str) -> Array:
    """``[N, B]``: ``log sum_k theta[row(n), k] E[b, var(n), k] + emax[b, var(n)]``. One matmul over all
    parameter rows and (sample, variable) pairs, ``[P, K] @ [K, B*V]``, then a gather: no ``[N, B, K]``
    intermediate (rows are shared across variables when the parameters are tied, as in a homogeneous HMM)."""
    B, V, K = E.shape
    Z = matmul("pk,qk->pq", jnp.exp(log_theta), E.reshape(B * V, K), precision).reshape(-1, B, V)  # [P, B, V]
    Zn = Z[rows[:, None], jnp.arange(B)[None, :], vars_[:, None]]  # [N, B]
    return _log_total(Zn) + emax[:, vars_, 0].T


def _dense_logz(log_theta: Array, e: Array, rows: Array, vars_: Array, precision: str = "fp32") -> Array:
    """``[N, B]``: ``log sum_k theta[row(n), k] exp(e[b, var(n), k])`` for dense evidence ``e [B, V, K]``."""
    E, emax = _shift(e)
    return _linear_logz(log_theta, E, emax, rows, vars_, precision)


def _topk_logz(log_theta: Array, ids: Array, logp: Array, mask: Array | None, rows: Array, vars_: Array,
               precision: str = "fp32", method: str = "auto", budget: int = CHUNK_BUDGET) -> Array:
    """``[N, B]``: ``log sum_j theta[row(n), ids[b, v, j]] exp(logp[b, v, j])``.

    ``method="dense"`` scatters the candidates' weights into a dense ``[B, V, K]`` (zeros elsewhere) and
    takes the matrix product of :func:`_linear_logz` (``2 P K B V`` flops on tensor cores: the fast path when
    parameter rows are shared, as in a homogeneous HMM); ``"gather"`` gathers ``theta`` at the candidates of
    every node (``N B k`` scattered reads, in chunks of nodes so that at most ``budget`` exist at a time: the
    path for untied rows, ``P ~ N``). ``"auto"`` takes the dense product when ``P K V <= 256 N k``."""
    lp = logp if mask is None else jnp.where(mask, logp, -jnp.inf)
    W, emax = _shift(lp)  # [B, V, k]
    B, V, k = ids.shape
    P, K = log_theta.shape
    N = rows.shape[0]
    if method == "auto":
        method = "dense" if P * K * V <= 256 * N * k else "gather"
    if method == "dense":
        E = jnp.zeros((B, V, K), W.dtype).at[jnp.arange(B)[:, None, None], jnp.arange(V)[None, :, None], ids].add(W)
        return _linear_logz(log_theta, E, emax, rows, vars_, precision)
    if method != "gather":
        raise ValueError(f"unknown top-k evidence method {method!r}")
    theta = jnp.exp(log_theta)
    _, (r, v) = _node_chunks(N, B * k, budget, (rows, 0), (vars_, 0))

    def one(rv):
        rr, vv = rv
        th = theta[rr[None, :, None], ids[:, vv, :]]  # [B, s, k]
        return jnp.sum(th * W[:, vv, :], axis=2).T  # [s, B]

    Z = jax.lax.map(one, (r, v)).reshape(-1, B)[:N]
    return _log_total(Z) + emax[:, vars_, 0].T


class SoftEvidenceCategorical(Categorical):
    """A categorical reweighted by per-call soft evidence (PyJuice's normalized semantics).

    With evidence log-weights ``e`` for the node's variable, the node's value at the observed ``x`` is
    ``log theta[x] + e[x] - log sum_k theta[k] exp(e[k])`` (the sum over all values, or over the top-k
    candidates), ``-inf`` where ``theta[x] exp(e[x])`` is zero (even where every value's weight is): the leaf is the
    categorical of the reweighted pmf ``q(k) = theta[k] exp(e[k]) / Z``. A missing ``x`` reduces that pmf over its
    values as :class:`Categorical` reduces its own: ``log sum_k q(k)``, 0, under ``"LL"``; ``max_k log q(k)`` under
    ``"MPE"``; the tempered sum under ``"GeneralLL"``; and ``-inf`` under each where no value has weight. An out of
    range ``x`` (only reached with validation off) gives NaN. Without evidence it is a plain categorical.
    EM refits ``theta`` from the counts of the observed values, the evidence entering through the flows; a missing
    value counts as the reweighted pmf ``q`` (soft EM: its posterior, :meth:`marginalized_under_evidence`) or as the
    value max-product decoding takes (hard EM: :meth:`decoded_under_evidence`).
    ``num_cats``: the number of values, as for :class:`Categorical` (a positive int, else a ``ValueError``); the
    dense evidence ``categorical_logp`` is ``[B, V, num_cats]``.
    """

    name = "soft_evidence_categorical"

    def log_prob_evidence(self, p, tables, rows, vars_, pos, xv, mv, evidence, options):
        dense = evidence.get("categorical_logp")
        topk = evidence.get("categorical_topk")
        if dense is None and topk is None:
            return self.log_prob(p, tables, rows, xv, mv, options)
        lt = p["log_probs"]
        if dense is not None:
            dense = dense[:, :, :self.num_cats]
        else:  # a candidate that is no value of these leaves has no weight (as a masked one)
            topk = {**topk, "mask": _topk_mask(topk, self.num_cats)}
        xr = self._values(xv, mv)
        xi = jnp.clip(xr, 0, self.num_cats - 1)  # [N, B]
        B = xv.shape[1]
        bidx = jnp.arange(B)[None, :]
        if dense is not None:
            logz = _dense_logz(lt, dense, rows, vars_, options.concrete_precision)
            ex = dense[bidx, vars_[:, None], xi]  # [N, B]
        else:
            ids, logp, mask = topk["ids"], topk["logp"], topk.get("mask")
            logz = _topk_logz(lt, ids, logp, mask, rows, vars_, options.concrete_precision)
            # the evidence at the observed value, once per (sample, variable), then read by every node
            xvar = jnp.zeros((ids.shape[1], B), xi.dtype).at[vars_].set(xi).T  # [B, V]
            hit = ids == xvar[:, :, None]
            if mask is not None:
                hit = hit & mask
            exv = jnp.where(jnp.any(hit, axis=2), jnp.sum(jnp.where(hit, logp, 0.0), axis=2), -jnp.inf)  # [B, V]
            ex = exv[:, vars_].T  # [N, B]
        out = _normalized(lt[rows[:, None], xi] + ex, logz)
        # out-of-range values reach here only when validation was switched off: poison, never clamp silently
        out = jnp.where((xr < 0) | (xr >= self.num_cats), jnp.nan, out)
        if mv is not None:
            out = jnp.where(mv, self._missing(lt, rows, vars_, logz, dense, topk, options), out)
        return out

    def decoded_under_evidence(self, p, tables, rows, vars_, evidence, options):
        """Under ``"MPE"`` with categorical evidence, each node's first most probable value of the reweighted pmf per
        sample ``[N, B]`` (the lowest value on ties, among the top-k candidates with top-k evidence; 0 where no
        value has weight): the value that the max-product pass takes for a missing variable. None otherwise."""
        dense = evidence.get("categorical_logp")
        topk = evidence.get("categorical_topk")
        if options.propagation != "MPE" or (dense is None and topk is None):
            return None
        lt = p["log_probs"]
        if dense is not None:
            num = _reweighted(lt, rows, vars_, dense[:, :, :self.num_cats])  # [N, B, K]
            return jnp.argmax(num, axis=2).astype(jnp.int32)
        ids = topk["ids"]
        idn = jnp.transpose(ids[:, vars_, :], (1, 0, 2))  # [N, B, k]
        num = jnp.where(jnp.transpose(_topk_mask(topk, self.num_cats)[:, vars_, :], (1, 0, 2)),
                        _reweighted(lt, rows, vars_, None, jnp.clip(ids, 0, self.num_cats - 1), topk["logp"]),
                        -jnp.inf)
        best = jnp.max(num, axis=2, keepdims=True)
        first = jnp.min(jnp.where((num == best) & (best > -jnp.inf), idn, self.num_cats), axis=2)
        return jnp.where(first < self.num_cats, first, 0).astype(jnp.int32)

    def marginalized_under_evidence(self, p, tables, rows, vars_, evidence, options):
        """Under ``"LL"`` and ``"GeneralLL"`` with categorical evidence, ``p`` with ``"missing_evidence"``: what a
        missing value counts by, each node's reweighted pmf ``q(k) = theta[k] exp(e[k]) / Z`` per sample, its
        posterior under the normalized leaf, whose value ``log sum_k q(k)`` does not depend on ``theta``
        (:meth:`_missing_counts`). Else ``p`` (hard EM counts the decoded value: :meth:`decoded_under_evidence`)."""
        dense = evidence.get("categorical_logp")
        topk = evidence.get("categorical_topk")
        if options.propagation == "MPE" or (dense is None and topk is None):
            return p
        lt = p["log_probs"]
        if dense is not None:
            dense = dense[:, :, :self.num_cats]
            m = {"dense": dense, "logz": _dense_logz(lt, dense, rows, vars_, options.concrete_precision)}
        else:  # a candidate that is no value of these leaves, or masked, has no weight
            mask = _topk_mask(topk, self.num_cats)
            m = {"ids": jnp.clip(topk["ids"], 0, self.num_cats - 1), "logp": jnp.where(mask, topk["logp"], -jnp.inf),
                 "logz": _topk_logz(lt, topk["ids"], topk["logp"], mask, rows, vars_, options.concrete_precision)}
        return {**p, "missing_evidence": {**m, "rows": rows, "vars": vars_}}

    def _missing_counts(self, p, mv, flows, num_rows, log: bool = False):
        """``[num_rows, K]``: the counts of the missing values (``mv [N, B]``) by their reweighted pmf ``q``
        (:meth:`marginalized_under_evidence`), each (node, sample)'s flow ``flows [N, B]`` times ``q``; with ``log``,
        log flows and log counts. ``q`` is made for chunks of nodes of at most :data:`CHUNK_BUDGET` (node, sample,
        value) entries at a time."""
        m = p["missing_evidence"]
        lt, K = p["log_probs"], self.num_cats
        N, B = flows.shape
        k = K if "dense" in m else m["ids"].shape[2]
        terms = jnp.where(mv, flows, -jnp.inf if log else 0.0)

        def chunk(rows, vars_, logz, f):  # [s] nodes: flat indices and their terms [s, B, k]
            if "dense" in m:
                ids = jnp.broadcast_to(jnp.arange(K, dtype=rows.dtype), (rows.shape[0], B, K))
            else:
                ids = jnp.transpose(m["ids"][:, vars_, :], (1, 0, 2))
            num = _reweighted(lt, rows, vars_, m.get("dense"), m.get("ids"), m.get("logp"))
            lq = _normalized(num, logz[:, :, None]).astype(f.dtype)
            return (rows[:, None, None] * K + ids).reshape(-1), (f[:, :, None] + lq if log else f[:, :, None]
                                                                 * jnp.exp(lq)).reshape(-1)

        _, parts = _node_chunks(N, B * k, CHUNK_BUDGET, (m["rows"], 0), (m["vars"], 0), (m["logz"], -jnp.inf),
                                (terms, -jnp.inf if log else 0.0))
        zero = log_sum_zeros((num_rows * K,), flows.dtype) if log else jnp.zeros((num_rows * K,), flows.dtype)

        def add(acc, c):
            idx, val = chunk(*c)
            return (log_sum_add(acc, idx, val) if log else acc.at[idx].add(val)), None

        if len(parts[0]) == 1:  # one chunk: no loop (a device-side while loop)
            acc, _ = add(zero, [a[0] for a in parts])
        else:
            acc, _ = lax.scan(add, zero, parts)
        return (log_sum_value(acc) if log else acc).reshape(num_rows, K)

    def suff_stats(self, p, tables, rows, xv, mv, flows, num_rows):
        if mv is None or "missing_evidence" not in p:
            return super().suff_stats(p, tables, rows, xv, mv, flows, num_rows)
        counts = super().suff_stats(p, tables, rows, xv, mv, jnp.where(mv, 0.0, flows), num_rows)["counts"]
        return {"counts": counts + self._missing_counts(p, mv, flows, num_rows)}

    def _with_marginalized(self, p, counts, flows, mg, run):
        if mg is None or "missing_evidence" not in p:
            return super()._with_marginalized(p, counts, flows, mg, run)
        return counts + self._missing_counts(p, jnp.repeat(mg, run, axis=0), flows, flows.shape[0])

    def log_suff_stats(self, p, tables, rows, xv, mv, log_flows, num_rows):
        if mv is None or "missing_evidence" not in p:
            return super().log_suff_stats(p, tables, rows, xv, mv, log_flows, num_rows)
        counts = super().log_suff_stats(p, tables, rows, xv, mv, jnp.where(mv, -jnp.inf, log_flows),
                                        num_rows)["counts"]
        return {"counts": jnp.logaddexp(counts, self._missing_counts(p, mv, log_flows, num_rows, log=True))}

    def _missing(self, lt, rows, vars_, logz, dense, topk, options):
        """``[N, B]``: the value of a missing variable, the reweighted log-pmf reduced over its values
        (:func:`jaxpc.distributions.base.reduce_missing`); under ``"LL"`` exactly 0 where some value has weight."""
        if options.propagation == "LL":
            return jnp.where(logz == -jnp.inf, -jnp.inf, jnp.zeros((), logz.dtype))
        if dense is not None:  # every value: [N, B, K]
            num = _reweighted(lt, rows, vars_, dense)
        else:  # the candidates, unique per (sample, variable); masked ones have no weight: [N, B, k]
            mask = topk.get("mask")
            lpv = topk["logp"] if mask is None else jnp.where(mask, topk["logp"], -jnp.inf)
            num = _reweighted(lt, rows, vars_, None, topk["ids"], lpv)
        return reduce_missing(_normalized(num, logz[:, :, None]), options)


def _normalized(num: Array, logz: Array) -> Array:
    """``num - logz``: a value's reweighted log-probability; ``-inf`` where its weight ``num`` or the total ``logz``
    is (zero weight is probability zero, also where no value has weight: 0 / 0, or a total that underflows)."""
    return jnp.where((num == -jnp.inf) | (logz == -jnp.inf), -jnp.inf, num - logz)


class External(Categorical):
    """Leaves whose values the caller supplies per call: node ``j`` of a vector over variable ``v`` takes
    ``evidence["external"][b, v, j]`` (a log-value). No parameters; gradients flow to the caller's
    tensor. The variable's column of ``x`` is not read, nor its ``missing`` mask: the caller's log-values stand for
    the variable however it is marked (give 0 where a missing variable should marginalize a normalized leaf)."""

    name = "external"
    natural_fields = ()
    stat_fields = ()

    def __init__(self):
        super().__init__(1)

    def config(self):
        return ()

    def __repr__(self):
        return "External()"

    def value_range(self):
        return (0, None)

    def num_values(self):
        return None

    def canonical_params(self, params, num_nodes, where):
        raise ValueError(f"{where}: External leaves have no parameters (their values come with each call)")

    def has_full_params(self, natural):
        return True

    def natural_to_internal(self, natural):
        return {}

    def internal_to_natural(self, p, tables):
        return {}

    def init(self, rs, num_rows, tables):
        return {}

    def normalize_internal(self, p, tables):
        """No parameters, nothing to renormalize (:func:`jaxpc.optim.normalize_params`)."""
        return p

    def log_prob(self, p, tables, rows, xv, mv, options):
        raise ValueError("External leaves need evidence={'external': [B, V, M]} log-values with every call")

    def log_prob_evidence(self, p, tables, rows, vars_, pos, xv, mv, evidence, options):
        ext = evidence.get("external")
        if ext is None:
            return self.log_prob(p, tables, rows, xv, mv, options)
        return ext[:, vars_, pos].T  # [N, B]

    def suff_stats(self, p, tables, rows, xv, mv, flows, num_rows):
        return {}

    def suff_stats_runs(self, p, tables, xg, mg, flows, run, options, kernel=None):
        return {}

    def log_suff_stats(self, p, tables, rows, xv, mv, log_flows, num_rows):
        return {}

    def em_update(self, p, tables, stats, step_size, pseudocount):
        return p

    def log_pmf(self, p, tables, rows, num_values):
        raise TypeError("External leaves have no pmf")

    def sample(self, key, p, tables, prow, num_values):
        raise TypeError("External leaves cannot be sampled (their values come from the caller)")

    mode = sample


__all__ = ["SoftEvidenceCategorical", "External"]
