"""Flows (expected counts) from ``jax.grad`` and the EM parameter update.

* Sum-edge flows: the gradient of ``sum_b w_b log p(x_b)`` with respect to the log-weights,
  which is ``sum_b w_b P(edge used | x_b)``, in linear space (no log of a gradient).
* Input flows: the gradient with respect to an additive zero on each input layer's values
  (node flows ``[N, B]``), turned into each distribution's expected sufficient statistics.

The flows pytree mirrors ``params``: ``{"sum": {group: [P, Kp, Kc]}, "input": {layer: stats}}``. Log flows
(``Options(logspace_flows=True)``) are a :class:`~jaxpc.engine.logflows.LogFlows` of the same shape, which the EM
update refuses (:func:`check_linear_flows`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..compiler.layout import Layout
from ..distributions.base import blend, decoded_observations, has_mass, log_weights, parent_totals
from ..ops.rows import take_rows
from . import forward, logflows, routing
from .logflows import LogFlows

Array = jax.Array


def flows_and_ll(layout: Layout, tables: dict, params: dict, x: Array, missing: Array | None,
                 weights: Array | None, options, evidence: dict | None = None,
                 evidence_grad: bool = False) -> tuple:
    """``(flows, ll [B])``; ``weights`` ``[B]`` scales each sample's contribution (None = 1). With per-sample
    sum parameters in ``evidence``, sum flows are the posterior edge counts under the per-sample weights.

    With ``evidence_grad``: ``(flows, ll, g)``, ``g`` the gradient of ``sum_b w_b log p(x_b)`` with respect to
    ``evidence``, a pytree like it with None for its integer leaves (top-k ids).
    ``options.logspace_flows``: every flow a logarithm (:func:`jaxpc.engine.logflows.flows_and_ll`);
    ``options.node_flows``: the flows also hold the M-step's denominators under ``"node"``.

    Where a layer may run a kernel (:func:`jaxpc.engine.routing.may_run_kernels`), the values come from the
    kernels and every derivative of them (``jax.jvp``, ``jax.grad`` of a function of the flows, an unrolled EM
    step) is XLA's route's at the same point (:func:`jaxpc.engine.routing.xla_only`): the kernels have no derivative
    of their own (in-place buffers, barriers). Where the tree's cluster kernels run
    (:func:`jaxpc.engine.routing.holds_refs`: their buffers are JAX refs), reverse mode only."""
    options = routing.within_int32(layout, options, x.shape[0], evidence)
    if options.logspace_flows and evidence_grad:
        raise ValueError("logspace_flows=True computes flows only: the evidence gradient comes with linear "
                         "flows (logspace_flows=False)")
    if evidence_grad and evidence is None:
        raise ValueError("evidence_grad needs evidence")
    if not routing.may_run_kernels(options):
        return _flows_and_ll(layout, tables, params, x, missing, weights, options, evidence, evidence_grad)
    reference = routing.xla_only(options)

    def on(opts):
        return lambda *args: _flows_and_ll(layout, *args[:5], opts, args[5], evidence_grad)

    # the kernels' call jitted: inside a custom derivative its constants would be inlined into the module; under a
    # jit they stay arguments, as at the top level, and the trace and lowering cost what they cost without it (not
    # the reference, which is differentiated: a jit would end the trace its inner custom derivatives close over)
    kernels = jax.jit(on(options))

    args = (tables, params, x, missing, weights, evidence)
    if routing.holds_refs(layout, options, x.shape[0], routing.param_dtype(params), evidence):
        # (a custom_jvp cannot hold refs: JAX has no rule to discharge them through it)
        run = jax.custom_vjp(kernels)
        run.defvjp(lambda *a: (kernels(*a), a), lambda a, ct: jax.vjp(on(reference), *a)[1](ct))
        return run(*args)
    run = jax.custom_jvp(kernels)

    @run.defjvp
    def _jvp(primals, tangents):
        _, tangent = jax.jvp(on(reference), primals, tangents)
        return run(*primals), tangent

    return run(*args)


def _flows_and_ll(layout, tables, params, x, missing, weights, options, evidence, evidence_grad):
    """:func:`flows_and_ll` on the routes of ``options`` (checked), differentiated through them."""
    if options.logspace_flows:
        return logflows.flows_and_ll(layout, tables, params, x, missing, weights, options, evidence)
    if evidence_grad:
        ll, g_sum, g_eps, buffered, g_ev = _grads_with_evidence(layout, tables, params, x, missing, weights,
                                                                options, evidence)
    else:
        ll, g_sum, g_eps, buffered = _grads(layout, tables, params, x, missing, weights, options, evidence)
    out = _assemble_flows(layout, tables, params, x, missing, options, g_sum, g_eps, buffered, evidence)
    return (out, ll, g_ev) if evidence_grad else (out, ll)


def _objective(layout, tables, weights, options, evidence):
    """``(sum_params, vals) -> (sum_b w_b ll_b, ll)``: zero-weight rows (padding) contribute exactly nothing,
    even where their ll is not finite. The mask is on that product alone (``0 * inf``), not on the weight: the
    cotangent of a finite ll is its weight, so the flows' derivative in a weight of 0 is the sample's own flows."""
    def objective(sum_params, vals):
        ll = forward.evaluate(layout, tables, sum_params, vals, options, evidence, counts=True)
        if weights is None:
            return jnp.sum(ll), ll
        return weighted_ll_sum(ll, weights.astype(ll.dtype)), ll
    return objective


def weighted_ll_sum(ll: Array, w: Array) -> Array:
    """``sum_b w_b ll_b`` where a zero-weight row whose ``ll`` is not finite (an impossible padding row) adds 0, and
    0 to the derivatives (never ``0 * inf``). The mask is on that case alone, not on the weight: the derivative in
    a weight of 0 is the row's ``ll``, and the cotangent of a finite ``ll`` is its weight."""
    undefined = (w == 0) & ~jnp.isfinite(ll)
    return jnp.sum(jnp.where(undefined, 0.0, ll) * w)  # (undefined rows have w = 0: their product is 0)


def _leaves(layout, tables, params, x, missing, options, evidence):
    """The input layers' values (:func:`forward.leaf_values`) in the parameters' dtype, and whether they are the
    flow pass's node buffer."""
    vals = forward.leaf_values(layout, tables, params, x, missing, options, evidence=evidence)
    if isinstance(vals, jax.Array):
        return vals, True
    dtype = routing.param_dtype(params)
    return [v.astype(dtype) for v in vals], False


def _grads(layout, tables, params, x, missing, weights, options, evidence):
    vals, buffered = _leaves(layout, tables, params, x, missing, options, evidence)
    objective = _objective(layout, tables, weights, options, evidence)
    (_, ll), (g_sum, g_eps) = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(params["sum"], vals)
    return ll, g_sum, g_eps, buffered


def _grads_with_evidence(layout, tables, params, x, missing, weights, options, evidence):
    """:func:`_grads` and the gradient with respect to the floating leaves of ``evidence``: through the sum
    layers (per-sample sum parameters) and, by the chain rule on the leaves' node flows, through the input
    layers (soft evidence, external values)."""
    leaves, treedef = jax.tree_util.tree_flatten(evidence)
    floating = [i for i, a in enumerate(leaves) if jnp.issubdtype(a.dtype, jnp.floating)]

    def rebuild(values):
        full = list(leaves)
        for i, v in zip(floating, values):
            full[i] = v
        return jax.tree_util.tree_unflatten(treedef, full)

    fl_ev = [leaves[i] for i in floating]
    vals, leaf_vjp = jax.vjp(lambda e: _leaves(layout, tables, params, x, missing, options, rebuild(e))[0], fl_ev)
    buffered = isinstance(vals, jax.Array)

    def objective(sum_params, vals, e):
        return _objective(layout, tables, weights, options, rebuild(e))(sum_params, vals)

    (_, ll), (g_sum, g_eps, g_direct) = jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True)(
        params["sum"], vals, fl_ev)
    g_leaf, = leaf_vjp(g_eps)
    g = [a + b for a, b in zip(g_direct, g_leaf)]
    full = [None] * len(leaves)
    for i, v in zip(floating, g):
        full[i] = v
    return ll, g_sum, g_eps, buffered, jax.tree_util.tree_unflatten(treedef, full)


def _assemble_flows(layout, tables, params, x, missing, options, g_sum, g_eps, buffered, evidence=None) -> dict:
    """The flows pytree from the sum parameters' gradient and the input layers' node flows."""
    if not options.compute_param_flows:
        g_sum = jax.tree_util.tree_map(jnp.zeros_like, g_sum)
    # per input layer: its node flows, and (buffer, first row) where they lie in a larger array
    if buffered:  # the flow buffer: the input layers' node flows are its input rows
        at = [(g_eps, s.offset) for s in layout.input_layers]
        g_eps = [jax.lax.slice_in_dim(g_eps, s.offset, s.offset + s.num_nodes) for s in layout.input_layers]
    else:
        at = [(f, 0) for f in g_eps]

    xt = x.T
    mt = forward.missing_t(missing)
    g_in = {}
    for spec, tab, node_flows, where in zip(layout.input_layers, tables["inputs"], g_eps, at):
        # a missing value counts under the propagation's own distribution of it (hard EM: the decoded value; under
        # evidence, the reweighted one)
        p = params["input"][spec.key] if mt is None else spec.dist.marginalized_params(params["input"][spec.key],
                                                                                        options)
        with jax.named_scope(f"jaxpc/input_stats/{spec.key}"):
            if evidence and mt is not None:  # hard EM under evidence: missing values decoded per node and sample
                xv, mv = decoded_observations(spec.dist, params["input"][spec.key], tab, take_rows(xt, tab["vars"]),
                                              take_rows(mt, tab["vars"]), evidence, options)
                if mv is None:
                    g_in[spec.key] = spec.dist.suff_stats(params["input"][spec.key], tab["meta"], tab["rows"], xv,
                                                          None, node_flows, spec.num_rows)
                    continue
                p = spec.dist.marginalized_under_evidence(p, tab["meta"], tab["rows"], tab["vars"], evidence, options)
            if spec.run > 1:
                gv = tab["vars"][::spec.run]
                # the kernel reads the flows where they lie (a slice of the buffer would be copied first)
                kw = {"kernel": where} if routing.counts_kernel(spec, options, node_flows) else {}
                mv = None if mt is None else take_rows(mt, gv)
                g_in[spec.key] = spec.dist.suff_stats_runs(p, tab["meta"], take_rows(xt, gv), mv, node_flows, spec.run,
                                                           options, **kw)
                continue
            xv = take_rows(xt, tab["vars"])
            mv = None if mt is None else take_rows(mt, tab["vars"])
            g_in[spec.key] = spec.dist.suff_stats(p, tab["meta"], tab["rows"], xv, mv, node_flows, spec.num_rows)
    out = {"sum": g_sum, "input": g_in}
    if options.node_flows:
        out["node"] = logflows.node_totals(layout, tables, g_sum, g_eps)
    if options.negate_flows:
        out = jax.tree_util.tree_map(jnp.negative, out)
    return out


def check_em_options(options, where: str) -> None:
    """Raise unless ``options`` give the flows an EM update takes: linear (not ``Options.logspace_flows``) and not
    negated (``Options.negate_flows``)."""
    if options.negate_flows:
        raise ValueError(f"{where} needs flows, not negated flows (options.negate_flows=True)")
    if options.logspace_flows:
        raise ValueError(f"{where}: Options(logspace_flows=True) gives log flows, but EM's update takes linear flows "
                         f"(the M-step from log flows: exp(log flows - log node flows), see Options.node_flows)")


def check_linear_flows(flows, where: str) -> None:
    """Raise a ``ValueError`` where ``flows`` are log flows (:class:`~jaxpc.engine.logflows.LogFlows`): an EM update
    reads its flows as counts, and would read logarithms as counts silently."""
    if isinstance(flows, LogFlows):
        raise ValueError(f"{where}: flows are log flows (Options(logspace_flows=True)), but EM's update takes linear "
                         f"expected counts: pass jaxpc.engine.logflows.to_counts(flows) (their exponentials; a count "
                         f"below the dtype's smallest number becomes 0), or flows computed without logspace_flows")


# the input statistics that are expected counts (>= 0 wherever the flows are): the others are moments
COUNT_STATS = ("counts", "s0")


def count_leaves(flows: dict) -> tuple[tuple[str, ...], tuple]:
    """``(names, arrays)``: the entries of ``flows`` that are expected counts, every sum group's edge flows and the
    input layers' :data:`COUNT_STATS`, each named as it is read (``flows['sum']['g0']``)."""
    names, arrays = [], []
    for k in sorted(flows.get("sum") or {}):
        names.append(f"flows['sum'][{k!r}]")
        arrays.append(flows["sum"][k])
    for k in sorted(flows.get("input") or {}):
        stats = flows["input"][k]
        for f in COUNT_STATS if isinstance(stats, dict) else ():
            if f in stats:
                names.append(f"flows['input'][{k!r}][{f!r}]")
                arrays.append(stats[f])
    return tuple(names), tuple(arrays)


def any_negative_counts(counts: tuple) -> jax.Array:
    """Whether any of the ``counts`` arrays (:func:`count_leaves`) holds an entry below 0 (-inf too; NaN is not
    negative: NaN flows make NaN parameters, which the parameter checks report): a scalar bool."""
    bad = jnp.zeros((), bool)
    for a in counts:
        bad = bad | jnp.any(a < 0)
    return bad


def raise_negative_counts(names: tuple, counts: tuple, where: str, when: str = "") -> None:
    """The ``ValueError`` of counts (host values of :func:`count_leaves`) that hold a negative entry: the first, its
    index and value, and their number; return where there is none. Counts with a ``-inf`` or with positive entries
    beside the negative ones are no negated flows (those are all ``<= 0`` and finite) but, most likely, log flows
    in a plain dict (``dict(flows)`` or a dict comprehension drops the :class:`~jaxpc.engine.logflows.LogFlows`
    type that the EM update refuses): the error says so."""
    for name, a in zip(names, counts):
        host = np.asarray(a)
        neg = np.argwhere(host < 0)
        if len(neg):
            at = ", ".join(str(int(i)) for i in neg[0])
            more = f" ({len(neg)} negative entries in that array)" if len(neg) > 1 else ""
            head = f"{where}: flows must be expected counts (>= 0); {name}[{at}] is {host[tuple(neg[0])]}{more}{when}"
            if _look_like_log_flows(counts):
                raise ValueError(f"{head}. These look like log flows (a -inf, or positive beside negative counts: "
                                 f"Options(logspace_flows=True)) in a plain dict, as dict(flows) or a dict "
                                 f"comprehension makes of circuit.flows' LogFlows: pass "
                                 f"jaxpc.engine.logflows.to_counts(flows) of the LogFlows (or of LogFlows(flows)); "
                                 f"flows.copy() and jax.tree.map keep the type")
            raise ValueError(f"{head}. Negated flows (jax.grad of a negative log-likelihood, "
                             f"Options(negate_flows=True)) or log flows (Options(logspace_flows=True)) are no counts: "
                             f"pass what circuit.flows returns with the default options, or "
                             f"jaxpc.engine.logflows.to_counts of log flows")


def _look_like_log_flows(counts: tuple) -> bool:
    """Whether host counts hold a ``-inf`` or both positive and negative entries, which negated flows never do."""
    pos = neg = False
    for a in counts:
        host = np.asarray(a)
        if np.isneginf(host).any():
            return True
        pos, neg = pos or bool((host > 0).any()), neg or bool((host < 0).any())
    return pos and neg


def normalize_sum_params(layout: Layout, tables: dict, sum_counts: dict, pseudocount, keep: dict | None = None) -> dict:
    """``(counts + c / num_children) / (node total + c)`` per node, in linear space; nodes with no
    mass keep a uniform distribution over their children. ``keep`` (per group, bool like the counts)
    restricts each node to those children: the others get exactly zero and no pseudocount."""
    return normalized_with_totals(layout, tables, sum_counts, pseudocount, keep)[0]


def normalized_with_totals(layout: Layout, tables: dict, sum_counts: dict, pseudocount,
                           keep: dict | None = None) -> tuple[dict, dict]:
    """:func:`normalize_sum_params` and each group's node totals per parameter block ``[P, Kp]`` (counts and
    pseudocount: the total of the block's parent nodes, :func:`jaxpc.distributions.base.parent_totals`)."""
    out, totals = {}, {}
    for g in layout.sum_groups:
        t = tables["groups"][g.key]
        seg = t["seg"]
        dtype = sum_counts[g.key].dtype
        if keep is None:  # a node's children: Kc where its segment is one block
            nch = jnp.asarray(g.Kc, dtype) if g.single_segments else t["nch"].astype(dtype)[seg][:, None, None]
            mask = None
        else:
            mask = keep[g.key]
            nch = jnp.maximum(parent_totals(mask.astype(dtype), seg, g), 1.0)[:, :, None]
        counts = sum_counts[g.key] + pseudocount / nch
        if mask is not None:
            counts = jnp.where(mask, counts, 0.0)
            tot = parent_totals(counts, seg, g)  # [P, Kp]
        else:  # each row of a segment holds nch entries, pseudocount / nch each: the reduction reads the flows alone
            tot = parent_totals(sum_counts[g.key], seg, g) + pseudocount
        tot_e = tot[:, :, None]
        uniform = 1.0 / nch if mask is None else jnp.where(mask, 1.0 / nch, 0.0)
        mass = has_mass(tot_e)
        out[g.key] = jnp.where(mass, counts / jnp.where(mass, tot_e, 1.0), uniform)
        totals[g.key] = tot
    return out, totals


def em_update(layout: Layout, tables: dict, params: dict, flows: dict, step_size, pseudocount,
              update_sums: bool = True, keep_zero_params: bool = False) -> dict:
    """One EM update: ``theta <- (1 - s) theta + s * normalize(flows + pseudocount)``.

    Sum nodes whose flows are all zero (and pseudocount 0) keep their parameters; a sum node whose flows hold a NaN
    gets NaN parameters (:func:`has_mass`); with ``update_sums`` False all sum parameters are kept (only the leaves
    are refitted); with ``keep_zero_params`` parameters that are exactly zero stay zero (no pseudocount on them).
    ``flows`` are linear counts: log flows (:class:`~jaxpc.engine.logflows.LogFlows`) raise a ``ValueError``
    (:func:`check_linear_flows`); their values are not checked here (``Circuit.em_update`` checks them): log flows
    in a plain dict (``dict(flows)`` drops the ``LogFlows`` type) are read as counts, giving wrong parameters (NaN
    where a negative count meets a positive total)."""
    check_linear_flows(flows, "em_update")
    new_sum = {}
    keep = {g.key: jnp.isfinite(params["sum"][g.key]) for g in layout.sum_groups} if keep_zero_params else None
    targets, totals = normalized_with_totals(layout, tables, flows["sum"], pseudocount, keep)
    for g in layout.sum_groups if update_sums else ():
        t = tables["groups"][g.key]
        old = jnp.exp(params["sum"][g.key])
        if keep is None:  # the node totals of the counts and pseudocount: one pass over the flows, not two
            tot = totals[g.key]
        else:
            tot = parent_totals(flows["sum"][g.key], t["seg"], g) + pseudocount
        new = jnp.where(has_mass(tot)[:, :, None], blend(old, targets[g.key], step_size), old)
        new_sum[g.key] = log_weights(new)  # a zero parameter: -inf, with a zero (never NaN) derivative
    if not update_sums:
        new_sum = dict(params["sum"])
    new_in = {}
    for spec, tab in zip(layout.input_layers, tables["inputs"]):
        p, meta = params["input"][spec.key], tab["meta"]
        if keep_zero_params and "log_probs" in p:  # categorical leaves: zero probabilities stay zero
            meta = {**meta, "mask": jnp.isfinite(p["log_probs"]) & meta.get("mask", True)}
        new_in[spec.key] = spec.dist.em_update(p, meta, flows["input"][spec.key], step_size, pseudocount)
    return {"sum": new_sum, "input": new_in}


def top_down_probabilities(layout: Layout, tables: dict, params: dict, options) -> dict:
    """The model's own expected counts for one sample: flows with every variable marginalized (the
    probability that each edge lies in a sample's induced tree; leaves: expected statistics)."""
    from ..options import Options

    V = layout.num_vars
    x0 = jnp.zeros((1, V), jnp.int32)
    leaves = [spec.dist for spec in layout.input_layers]
    if any(not d.discrete for d in leaves):
        x0 = x0.astype(routing.param_dtype(params))
    opts = Options(precision=options.concrete_precision, impl=options.impl, kernels=options.kernels,
                   chain_scan=options.chain_scan, fold_products=options.fold_products)
    fl, _ = flows_and_ll(layout, tables, params, x0, jnp.ones((V,), bool), None, opts)
    return fl


def em_step(layout: Layout, tables: dict, params: dict, x: Array, missing: Array | None, weights: Array | None,
            step_size, pseudocount, options, keep_zero_params: bool = False, rescale: str = "none",
            evidence: dict | None = None) -> tuple[dict, Array]:
    """Forward, flows and update in one function (one executable when jitted). Returns ``(params, ll)``.

    ``rescale="tdp"``: instead of blending parameters, the new parameters are
    ``normalize(s * flows / total_weight + (1 - s) * TDP + pseudocount)`` with ``TDP`` the model's own
    top-down probabilities (:func:`top_down_probabilities`): nodes the batch rarely reaches move less."""
    check_em_options(options, "em_step")
    fl, ll = flows_and_ll(layout, tables, params, x, missing, weights, options, evidence)
    if rescale == "tdp":
        tdp = top_down_probabilities(layout, tables, params, options)
        total = jnp.asarray(x.shape[0], ll.dtype) if weights is None else jnp.sum(weights)
        total = jnp.where(total > 0, total, jnp.ones((), total.dtype))  # weights all 0: zero flows, no data term
        mixed = jax.tree_util.tree_map(lambda f, t: step_size * f / total + (1.0 - step_size) * t, fl, tdp)
        return em_update(layout, tables, params, mixed, 1.0, pseudocount, options.compute_param_flows,
                         keep_zero_params), ll
    return em_update(layout, tables, params, fl, step_size, pseudocount, options.compute_param_flows,
                     keep_zero_params), ll
