"""Flow variants: log-space flows (``Options(logspace_flows=True)``) and node flows (``Options(node_flows=True)``).

**Log-space flows** are PyJuice's ``logspace_flows`` (``pyjuice/model/tensorcircuit.py``, ``backward``): the
flow pass keeps each node's flow per sample as a logarithm, the root's starting at ``log(ll_weights)`` and
every other at ``-inf``, so a flow far below the dtype's smallest number stays a finite log. PyJuice then adds
the parameter flows up in linear space; here they are added up in the log domain too and returned as
logarithms, so the expected counts themselves cannot underflow. A sum node passes each child

    ``log f_c += log f_n + a (log w_nc + v_c) - log sum_c' exp(a (log w_nc' + v_c'))``

(``a`` = 1 for LL, ``alpha`` for GeneralLL, ``1 / T`` for tempered flows; for MPE ``log f_n`` to the first
maximizing child), a product node passes ``log f_n`` to each child, and every sum is a ``log sum exp``
kept as a running max and a scaled sum (:mod:`jaxpc.ops.logspace`): nothing is the log of an underflowed linear
value, and a flow that is exactly zero is ``-inf``. The pass runs on the full layout with XLA, a parent block's
terms ``[Kp, C * Kc, B]`` at a time in pieces of at most ``Options.gather_chunk`` elements.

**Node flows** are the denominators of the M-step, PyJuice's ``cum_pflows`` (``pyjuice/model/backend/
par_update.py``): for a sum node, the total of its edge flows pooled over the nodes that share its parameters
(as EM normalizes them); for an input parameter row, the total flow of the nodes that read it.

Log flows come back as :class:`LogFlows`, a ``dict`` that JAX keeps as a pytree node of its own: read it as the
flows' dict, and it stays a ``LogFlows`` through ``jax.jit`` and ``jax.tree.map``, so the EM update, which takes
linear counts, recognizes and refuses it (:func:`to_counts` converts).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from ..compiler.layout import Layout, StageSpec
from ..distributions.base import decoded_observations, parent_totals, segment_sum
from ..ops.logspace import LogSum, log_sum_add, log_sum_rows, log_sum_value, log_sum_zeros, logsumexp, segment_logsumexp
from ..ops.pieces import ranges
from ..ops.sum_layer import child_rows, child_terms, first_maximizer, gather_children, gather_weights, max_product_terms
from ..options import Options
from . import forward, routing, stages

Array = jax.Array


# ---- the log flows' type ---------------------------------------------------------------------------------

class LogFlows(dict):
    """The flows of ``Options(logspace_flows=True)``: the logarithm of every expected count (``-inf``: zero), a
    ``dict`` like the linear flows (``flows["sum"][group]``, ``flows["input"][layer]``, ``flows["node"]``).

    A pytree node of its own type: ``jax.tree.map`` over log flows returns log flows (combine two batches' with
    ``jnp.logaddexp``, not ``jnp.add``), and mapping linear and log flows together is a structure mismatch. EM
    updates take linear counts and refuse it: :func:`to_counts` gives the counts (their exponentials, where a
    count below the dtype's smallest number becomes 0), or compute the M-step's targets in log space
    (``exp(log flows - log node flows)``, ``Options(node_flows=True)``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"LogFlows({dict.__repr__(self)})"

    def copy(self) -> LogFlows:
        """A shallow copy that stays :class:`LogFlows` (``dict.copy`` returns a plain dict)."""
        return LogFlows(self)


def _flatten_with_keys(flows: LogFlows):
    keys = tuple(sorted(flows))
    return tuple((jax.tree_util.DictKey(k), flows[k]) for k in keys), keys


def _flatten(flows: LogFlows):
    keys = tuple(sorted(flows))
    return tuple(flows[k] for k in keys), keys


def _unflatten(keys: tuple, children) -> LogFlows:
    return LogFlows(zip(keys, children))


jax.tree_util.register_pytree_with_keys(LogFlows, _flatten_with_keys, _unflatten, _flatten)


def to_counts(flows: LogFlows) -> dict:
    """The linear flows (expected counts) of log flows ``flows``: a plain dict of their exponentials, what
    ``Options(logspace_flows=False)`` returns up to rounding, except that a count below the dtype's smallest number
    is 0. Anything but :class:`LogFlows` is a ``TypeError`` (exponentiating linear flows would be silently
    wrong)."""
    if not isinstance(flows, LogFlows):
        raise TypeError(f"to_counts takes log flows (LogFlows, from Options(logspace_flows=True)), got "
                        f"{type(flows).__name__}")
    return jax.tree_util.tree_map(jnp.exp, dict(flows))


# ---- node flows (linear and log) ---------------------------------------------------------------------

def node_totals(layout: Layout, tables: dict, sum_flows: dict, input_flows: list, log: bool = False) -> dict:
    """The ``"node"`` entry of the flows (``Options.node_flows``): ``{"sum": {group: [P, Kp]}, "input": {layer:
    [rows]}}``, every parameter block's parent totals (its edge flows ``[P, Kp, Kc]`` summed over the children
    and over the blocks of its segment, the blocks the M-step normalizes together) and every input row's total
    (its nodes' flows ``input_flows`` ``[N, B]`` per layer, summed over the samples and the nodes that read the
    row). With ``log``, the flows are logarithms and so are the totals."""
    out = {"sum": {}, "input": {}}
    for g in layout.sum_groups:
        seg = tables["groups"][g.key]["seg"]
        f = sum_flows[g.key]
        if log:
            rows = logsumexp(f, axis=2)
            out["sum"][g.key] = rows if g.single_segments else segment_logsumexp(rows, seg, g.num_segments)[seg]
        else:
            out["sum"][g.key] = parent_totals(f, seg, g)
    for spec, tab, f in zip(layout.input_layers, tables["inputs"], input_flows):
        if log:
            out["input"][spec.key] = segment_logsumexp(logsumexp(f, axis=1), tab["rows"], spec.num_rows)
        else:
            out["input"][spec.key] = segment_sum(jnp.sum(f, axis=1), tab["rows"], spec.num_rows)
    return out


# ---- log-space flows ------------------------------------------------------------------------------------

def flows_and_ll(layout: Layout, tables: dict, params: dict, x: Array, missing: Array | None,
                 weights: Array | None, options, evidence: dict | None = None) -> tuple[dict, Array]:
    """``(log flows, ll [B])``: :func:`jaxpc.engine.em.flows_and_ll` with every flow a logarithm (``-inf``: zero),
    computed in the log domain, as :class:`LogFlows`. ``weights`` must be non-negative (a zero weight is a row
    without flow).

    The derivative with respect to ``weights`` is that of the logarithm of the linear flows, which are linear in
    the weights: ``d log f / d w_b = f_b / f`` (``f_b`` sample ``b``'s flow at weight 1), finite also at
    ``w_b = 0``, where the pass's own ``log w_b`` would make it ``0 * inf`` (:func:`_weights_jvp`). Where a log
    flow is ``-inf`` (every sample that reaches it has weight 0) its derivative is 0, as at every ``-inf`` of the
    log domain (the one-sided limit there is ``+inf``; a count's is the sample's flow, which ``exp`` of a log flow
    cannot carry)."""
    if routing.has_sum_externals(evidence):
        raise ValueError("logspace_flows: per-sample sum parameters (sum_gates, sum_lowrank) have no log-space "
                         "flow pass; use logspace_flows=False")
    if weights is None:
        return _flows_and_ll(layout, tables, params, x, missing, None, options, evidence)

    def run(p, w, e):
        return _flows_and_ll(layout, tables, p, x, missing, w, options, e)

    weighted = jax.custom_jvp(run)
    weighted.defjvp(functools.partial(_weights_jvp, run), symbolic_zeros=True)
    return weighted(params, weights, evidence)


def _is_zero(t) -> bool:
    return isinstance(t, SymbolicZero)


def _instantiate(tree):
    """``tree`` of tangents with every symbolic zero an array of zeros."""
    def one(t):
        if not _is_zero(t):
            return t
        return np.zeros(t.shape, t.dtype) if t.dtype == jax.dtypes.float0 else jnp.zeros(t.shape, t.dtype)
    return jax.tree_util.tree_map(one, tree, is_leaf=_is_zero)


def _weights_jvp(run, primals, tangents):
    """The JVP of ``run(params, weights, evidence)`` (:func:`flows_and_ll`). The params' and evidence's part is
    ``run``'s own at ``weights``. The weights' part uses that the linear flows ``f(w)`` are linear in ``w``:
    ``d log f(w) [dw] = f(dw) / f(w) = exp(log f(v) - log f(w)) d log f(v) [dw]`` at any positive ``v``, here
    ``w`` with its zeros set to 1, where ``log v`` has a finite derivative; 0 where ``log f(w)`` is ``-inf``."""
    params, w, ev = primals
    dp, dw, de = tangents
    if all(_is_zero(t) for t in jax.tree_util.tree_leaves((dp, de), is_leaf=_is_zero)):
        out = run(params, w, ev)
        t_out = jax.tree_util.tree_map(jnp.zeros_like, out)
    else:
        out, t_out = jax.jvp(lambda p, e: run(p, w, e), (params, ev), (_instantiate(dp), _instantiate(de)))
    if _is_zero(dw):
        return out, t_out
    v = jnp.where(w > 0, w, jnp.ones((), w.dtype))
    (log_v, _), (t_v, _) = jax.jvp(lambda u: run(params, u, ev), (v,), (dw,))

    def add(lw, lv, t, tv):
        dead = jnp.isneginf(lw) | jnp.isneginf(lv)
        return t + jnp.where(dead, 0.0, jnp.exp(jnp.where(dead, 0.0, lv - lw))) * tv

    return out, (jax.tree_util.tree_map(add, out[0], log_v, t_out[0], t_v), t_out[1])


def _flows_and_ll(layout: Layout, tables: dict, params: dict, x: Array, missing: Array | None,
                  weights: Array | None, options, evidence: dict | None) -> tuple[dict, Array]:
    """:func:`flows_and_ll` without its checks and its derivative with respect to ``weights``."""
    values = forward.node_values(layout, tables, params, x, missing, options, evidence=evidence)
    log_nodes, log_sums = _log_pass(layout, tables, params["sum"], values, weights, options)
    xt, mt = x.T, forward.missing_t(missing)
    stats, node_flows = {}, []
    for spec, tab in zip(layout.input_layers, tables["inputs"]):
        lf = lax.slice_in_dim(log_nodes, spec.offset, spec.offset + spec.num_nodes)
        node_flows.append(lf)
        with jax.named_scope(f"jaxpc/input_log_stats/{spec.key}"):
            p = params["input"][spec.key] if mt is None else spec.dist.marginalized_params(params["input"][spec.key],
                                                                                            options)
            xv, mv = decoded_observations(spec.dist, params["input"][spec.key], tab, xt[tab["vars"]],
                                          None if mt is None else mt[tab["vars"]], evidence, options)
            if evidence and mv is not None:
                p = spec.dist.marginalized_under_evidence(p, tab["meta"], tab["rows"], tab["vars"], evidence, options)
            stats[spec.key] = spec.dist.log_suff_stats(p, tab["meta"], tab["rows"], xv, mv, lf, spec.num_rows)
    out = LogFlows({"sum": log_sums, "input": stats})
    if options.node_flows:
        out["node"] = node_totals(layout, tables, log_sums, node_flows, log=True)
    return out, values[layout.root_row]


class _Pass(NamedTuple):
    """What every stage of one log-space flow pass reads."""

    options: Options
    sum_params: dict
    values: Array  # the forward's node buffer [R, B]


def _log_pass(layout: Layout, tables: dict, sum_params: dict, values: Array, weights: Array | None,
              options) -> tuple[Array, dict]:
    """``(log node flows [R, B], {group: log edge flows [P, Kp, Kc]})``: the flow pass in the log domain."""
    R, B = values.shape
    dtype = values.dtype
    root = jnp.zeros((B,), dtype) if weights is None else jnp.log(weights.astype(dtype))
    acc = log_sum_zeros((R, B), dtype)
    acc = LogSum(acc.m.at[layout.root_row].set(root), acc.s.at[layout.root_row].set(1.0))
    groups = {k: log_sum_zeros(v.shape, dtype) for k, v in sum_params.items()} if options.compute_param_flows else {}
    ps = _Pass(options, sum_params, values)

    def stage(carry, spec, tab, offset, name):
        return _stage(ps, carry, spec, tab, offset, name)

    acc, groups = stages.run_stages(layout, tables, (acc, groups), stage, reverse=True, scan=options.scan_stages)
    log_sums = {k: log_sum_value(groups[k]) if k in groups else jnp.full(v.shape, -jnp.inf, v.dtype)
                for k, v in sum_params.items()}
    return log_sum_value(acc), log_sums


def _stage(ps: _Pass, carry: tuple, spec: StageSpec, tab: dict, offset, name) -> tuple:
    """``(node accumulator, group accumulators)`` with one stage's log flows pushed to its children."""
    acc, groups = carry
    B = ps.values.shape[1]
    row = offset
    for j, (part, t) in enumerate(zip(spec.prods, tab["prods"])):
        with jax.named_scope(f"jaxpc/stage{name}/prod{j}/log_backward"):
            n, m = t["ch"].shape
            lf = log_sum_rows(acc, row, part.num_rows).reshape(n, 1, part.K, B)
            rows = t["ch"][:, :, None] + jnp.arange(part.K, dtype=t["ch"].dtype)
            acc = log_sum_add(acc, rows.reshape(-1), jnp.broadcast_to(lf, (n, m, part.K, B)).reshape(-1, B))
        row = row + part.num_rows
    for j, (part, t) in enumerate(zip(spec.sums, tab["sums"])):
        with jax.named_scope(f"jaxpc/stage{name}/sum{j}/log_backward"):
            acc, groups = _sum_part(ps, acc, groups, part, t, row)
        row = row + part.num_rows
    return acc, groups


def _sum_part(ps: _Pass, acc: LogSum, groups: dict, part, t: dict, row) -> tuple:
    """One sum partition's log child flows and log edge flows, a piece of parent blocks at a time."""
    B = ps.values.shape[1]
    spans = ranges(part.n, ps.options.gather_chunk // max(1, part.Kp * part.C * part.Kc * B))

    def piece(carry, a, b, sub):
        acc, groups = carry
        terms = child_terms(sub["ch"])
        if len(terms) != 1:
            raise ValueError("log-space flows run on the full layout, whose sum children are single row blocks")
        lf = log_sum_rows(acc, row + a * part.Kp, (b - a) * part.Kp).reshape(b - a, part.Kp, B)
        cf, pf = log_split(ps.values, lf, sub["ch"], sub["pid"], ps.sum_params[part.group], row + a * part.Kp,
                           part, ps.options, param_flows=part.group in groups)
        acc = log_sum_add(acc, child_rows(terms[0], part.Kc, part.dense).reshape(-1), cf.reshape(-1, B))
        if pf is not None:
            groups = {**groups, part.group: log_sum_add(groups[part.group], sub["pid"].reshape(-1),
                                                        pf.reshape(-1, part.Kp, part.Kc))}
        return acc, groups

    return stages.in_pieces(spans, t, piece, (acc, groups))


def log_split(values: Array, lf: Array, ch: Array, pid: Array, logw: Array, row, part, options, *,
              param_flows: bool = True) -> tuple[Array, Array | None]:
    """The log flows ``lf [n, Kp, B]`` of ``n`` sum blocks (parents at rows ``row + [0, n * Kp)``) split over their
    children: ``(log child flows [n, C*Kc, B] ([C*Kc, B] when dense), log edge flows [n, C, Kp, Kc] or None)``."""
    n, C = ch.shape[:2]
    Kp, Kc, B = part.Kp, part.Kc, values.shape[1]
    x = gather_children(values, ch, part.Kc, part.dense)
    t = max_product_terms(x, gather_weights(logw, pid), part.dense)  # [n, Kp, CK, B]
    vp = lax.dynamic_slice_in_dim(values, row, n * Kp, axis=0).reshape(n, Kp, 1, B)
    dead = jnp.isneginf(lf)[:, :, None]  # parents without flow pass nothing (never -inf + inf)

    def terms(temperature: float) -> Array:
        if options.propagation == "MPE":  # the whole flow to the first maximizer, as the linear pass
            first = first_maximizer(t, vp[:, :, 0])[:, :, None]
            split = jnp.where(lax.broadcasted_iota(jnp.int32, t.shape, 2) == first, 0.0, -jnp.inf)
        else:
            z = ((1.0 if options.propagation == "LL" else options.alpha) / temperature) * t
            norm = logsumexp(z, axis=2, keepdims=True)
            split = jnp.where(jnp.isfinite(norm), z - norm, -jnp.inf)  # impossible parents pass nothing
        return jnp.where(dead, -jnp.inf, lf[:, :, None] + split)

    ce = terms(options.eflow_temperature)
    cf = logsumexp(ce, axis=(0, 1) if part.dense else 1)
    if not param_flows:
        return cf, None
    cp = ce if options.pflow_temperature == options.eflow_temperature else terms(options.pflow_temperature)
    pf = logsumexp(cp, axis=3).reshape(n, Kp, C, Kc).transpose(0, 2, 1, 3)
    return cf, pf
