"""The circuit's values: ``f(layout, tables, params, x, missing, options) -> log-values``.

The input layers' values (or the flow pass's node buffer with the leaves written by one kernel), the root values
with the pass that differentiates them (:func:`evaluate`: the flow pass of :mod:`jaxpc.engine.flows`, the chain
scan of :mod:`jaxpc.engine.chain`, or autodiff through :mod:`jaxpc.engine.stages`) and every node's value.

``layout`` is static (closed over by the jitted functions); ``tables`` and ``params`` are pytrees
of device arrays; ``options`` is the frozen :class:`jaxpc.Options` (a static argument).

Shapes: ``x [B, V]``, ``missing`` None, ``bool[V]`` or ``bool[B, V]``, buffer ``[R, B]``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ..compiler.layout import Layout
from . import chain, flows, routing, stages

Array = jax.Array


def missing_t(missing: Array | None) -> Array | None:
    """Missing mask laid out ``[V, B]`` (or ``[V, 1]``)."""
    if missing is None:
        return None
    return missing.T if missing.ndim == 2 else missing[:, None]


def input_values(layout: Layout, tables: dict, params: dict, x: Array, missing: Array | None, options,
                 soft: Array | None = None, evidence: dict | None = None) -> list:
    """Per input layer ``[N, B]`` node values. ``soft``: optional ``[B, V, K]`` non-negative weights of soft
    evidence, used by the discrete leaves in place of ``x``/``missing``. ``evidence``: per-call evidence for the
    leaves that read it (:mod:`jaxpc.distributions.evidence`) and ``evidence["latent"]`` ``[B, V, M]``, an
    additive log-potential on node ``j`` of every leaf vector over variable ``v``."""
    xt = x.T
    mt = missing_t(missing)
    qt = None if soft is None else jnp.transpose(soft, (1, 2, 0))  # [V, K, B] weights
    outs = []
    for i, (spec, tab) in enumerate(zip(layout.input_layers, tables["inputs"])):
        with jax.named_scope(f"jaxpc/input{i}/{spec.key}"):
            p = params["input"][spec.key]
            if qt is not None and spec.dist.discrete:
                outs.append(spec.dist.log_prob_soft(p, tab["meta"], tab["rows"], qt[tab["vars"]], options))
                continue
            xv = xt[tab["vars"]]
            mv = None if mt is None else mt[tab["vars"]]
            if evidence:
                v = spec.dist.log_prob_evidence(p, tab["meta"], tab["rows"], tab["vars"], tab["pos"], xv, mv,
                                                evidence, options)
                if evidence.get("latent") is not None:
                    v = v + evidence["latent"][:, tab["vars"], tab["pos"]].T.astype(v.dtype)
                outs.append(v)
            else:
                outs.append(spec.dist.log_prob(p, tab["meta"], tab["rows"], xv, mv, options))
    return outs


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5))
def _leaf_buffer(plan: Layout, in_tables: list, in_params: dict, x: Array, missing: Array | None, options) -> Array:
    from ..distributions.base import reduce_missing
    from ..ops import pallas_leaf

    xt = x.T if jnp.issubdtype(x.dtype, jnp.integer) else x.T.astype(jnp.int32)  # as Categorical._values casts
    mt = None if missing is None else jnp.broadcast_to(missing_t(missing), xt.shape)
    specs, tabs = [], []
    for spec, tab in zip(plan.input_layers, in_tables):
        lp = spec.dist.value_table(in_params[spec.key])
        marg = None if mt is None else reduce_missing(lp, options)[tab["rows"]]
        specs.append(pallas_leaf.LeafLayer(spec.offset, spec.num_nodes, lp.shape[1]))
        tabs.append((lp, tab["rows"], tab["vars"], marg))
    # the stages write every row above the leaves before reading it: those rows are left unset
    # (Options.tuning.unset_rows)
    if routing.leaf_triton(options):
        from ..ops import triton_leaf as kernels
    else:
        kernels = pallas_leaf
    return kernels.categorical_buffer(xt, specs, tabs, num_rows=plan.num_rows, kmax=plan.kmax, missing=mt,
                                      zero_above=not options.tuning.unset_rows)


def _leaf_buffer_fwd(plan, in_tables, in_params, x, missing, options):
    return _leaf_buffer(plan, in_tables, in_params, x, missing, options), (in_tables, in_params, x, missing)


def _leaf_buffer_bwd(plan, options, res, g):
    """The parameters' cotangent: the VJP of the input layers' values (XLA's gather) at the buffer's input rows."""
    in_tables, in_params, x, missing = res
    vals, vjp = jax.vjp(lambda p: input_values(plan, {"inputs": in_tables}, {"input": p}, x, missing, options),
                        in_params)
    (d,) = vjp([lax.slice_in_dim(g, s.offset, s.offset + s.num_nodes).astype(v.dtype)
                for s, v in zip(plan.input_layers, vals)])
    return None, d, None, None


_leaf_buffer.defvjp(_leaf_buffer_fwd, _leaf_buffer_bwd)


def leaf_values(layout: Layout, tables: dict, params: dict, x: Array, missing: Array | None, options,
                soft: Array | None = None, evidence: dict | None = None, plan: Layout | None = None):
    """What :func:`evaluate` takes for the input layers: the node buffer of :func:`jaxpc.engine.routing.buffer_plan`
    (or of ``plan``) with the leaves written (float32 ``[R, B]``, one Pallas kernel, differentiable in the input
    parameters) where :func:`jaxpc.engine.routing.leaf_kernel` applies, else the list of the layers' values
    (:func:`input_values`)."""
    if routing.leaf_kernel(layout, params, options, soft, evidence, x.shape[0]):
        with jax.named_scope("jaxpc/leaf_buffer"):
            plan = routing.buffer_plan(layout, options, x.shape[0]) if plan is None else plan
            return _leaf_buffer(plan, tables["inputs"], params["input"], x, missing, options)
    return input_values(layout, tables, params, x, missing, options, soft, evidence)


def node_values(layout: Layout, tables: dict, params: dict, x: Array, missing: Array | None, options,
                soft: Array | None = None, evidence: dict | None = None, *, nodes_only: bool = False) -> Array:
    """The whole node buffer ``[R, B]`` (plain forward). ``nodes_only``: for a caller that reads the nodes' rows and
    no others; the leaves are then written into the buffer by one kernel where :func:`routing.leaf_kernel` applies
    (no concatenation of the input layers' values), the rows that no node owns left as the kernel leaves them."""
    options = routing.within_int32(layout, options, x.shape[0], rows=layout.num_rows)
    if nodes_only:
        vals = leaf_values(layout, tables, params, x, missing, options, soft, evidence, plan=layout)
    else:
        vals = input_values(layout, tables, params, x, missing, options, soft, evidence)
    return stages.forward_buffer(layout, tables, params["sum"], vals, options, evidence)


def evaluate(layout: Layout, tables: dict, sum_params: dict, input_vals, options,
             evidence: dict | None = None, counts: bool = False) -> Array:
    """Root values from input values (:func:`leaf_values`: a list of ``[N, B]`` values, or the node buffer of
    :func:`jaxpc.engine.routing.buffer_plan` with them written where :func:`jaxpc.engine.routing.leaf_kernel`
    applies), differentiated by the top-down flow pass (``options.backward == "flows"``,
    :func:`jaxpc.engine.flows.root_values`; chain-structured circuits, i.e. HMMs, by the forward-backward scan of
    :mod:`jaxpc.engine.chain` unless ``options.chain_scan`` is False; on the folded plan ``layout.fold``
    when ``options.fold_products``) or by JAX's autodiff through the
    forward (``"autodiff"``, the reference; also used when ``evidence`` carries per-sample sum
    parameters, whose gradients autodiff provides)."""
    buffered = isinstance(input_vals, jax.Array)  # leaf_values chose the flow pass's buffer
    if buffered and not routing.runs_node_buffer(layout, options, evidence):
        raise ValueError("a node buffer with the leaves written (leaf_values) is evaluated by the flow pass "
                         "only: backward='flows', not as a chain, without per-sample sum parameters")
    if options.backward == "autodiff" or routing.has_sum_externals(evidence):
        if options.pflow_temperature != 1.0 or options.eflow_temperature != 1.0:
            raise ValueError("tempered flows need backward='flows' and no per-sample sum parameters")
        if options.impl != "xla" or options.kernels:  # the in-place Pallas kernels have no autodiff rule:
            options = options.replace(impl="xla", kernels=())  # reverse mode differentiates XLA's layers
        return stages.forward_buffer(layout, tables, sum_params, input_vals, options, evidence, counts)[layout.root_row]
    if chain.applies(layout, options, routing.has_sum_externals(evidence)):
        with jax.named_scope("jaxpc/chain"):
            return chain.root_values(layout.chain, tables["chain"], sum_params, input_vals, options)
    plan = routing.buffer_plan(layout, options, (input_vals if buffered else input_vals[0]).shape[1])
    return flows.root_values(plan, tables if plan is layout else tables["fold"], sum_params, input_vals, options,
                             buffered)


def log_prob(layout: Layout, tables: dict, params: dict, x: Array, missing: Array | None, options,
             soft: Array | None = None, evidence: dict | None = None) -> Array:
    """Root log-value per sample, ``[B]``."""
    options = routing.within_int32(layout, options, x.shape[0], evidence)
    vals = leaf_values(layout, tables, params, x, missing, options, soft, evidence)
    return evaluate(layout, tables, params["sum"], vals, options, evidence)
