"""Pure forward evaluation: ``f(layout, tables, params, x, missing, options) -> log-values``.

``layout`` is static (closed over by the jitted functions); ``tables`` and ``params`` are pytrees
of device arrays; ``options`` is the frozen :class:`jaxpc.Options` (a static argument).

Shapes: ``x [B, V]``, ``missing`` None, ``bool[V]`` or ``bool[B, V]``, buffer ``[R, B]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..compiler.layout import Layout, ScanSpec, StageSpec
from ..ops import product_layer, sum_layer

Array = jax.Array


def _missing_t(missing: Array | None) -> Array | None:
    """Missing mask laid out ``[V, B]`` (or ``[V, 1]``)."""
    if missing is None:
        return None
    return missing.T if missing.ndim == 2 else missing[:, None]


def input_values(layout: Layout, tables: dict, params: dict, x: Array, missing: Array | None, options) -> list:
    """Per input layer ``[N, B]`` node values."""
    xt = x.T
    mt = _missing_t(missing)
    outs = []
    for i, (spec, tab) in enumerate(zip(layout.input_layers, tables["inputs"])):
        with jax.named_scope(f"jaxpc/input{i}/{spec.key}"):
            xv = xt[tab["vars"]]
            mv = None if mt is None else mt[tab["vars"]]
            outs.append(spec.dist.log_prob(params["input"][spec.key], tab["meta"], tab["rows"], xv, mv, options))
    return outs


def _stage(buf: Array, spec: StageSpec, tab: dict, params: dict, options, offset, index) -> Array:
    outs = []
    for j, (part, t) in enumerate(zip(spec.prods, tab["prods"])):
        with jax.named_scope(f"jaxpc/stage{index}/prod{j}"):
            outs.append(product_layer(buf, t["ch"], K=part.K))
    for j, (part, t) in enumerate(zip(spec.sums, tab["sums"])):
        with jax.named_scope(f"jaxpc/stage{index}/sum{j}"):
            outs.append(sum_layer(buf, t["ch"], t["pid"], params["sum"][part.group], Kp=part.Kp, Kc=part.Kc,
                                  dense=part.dense, propagation=options.propagation, alpha=options.alpha))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
    return lax.dynamic_update_slice(buf, out.astype(buf.dtype), (offset, 0))


def node_values(layout: Layout, tables: dict, params: dict, x: Array, missing: Array | None, options,
                input_eps: list | None = None) -> Array:
    """The whole node buffer ``[R, B]``. ``input_eps`` (one ``[N, B]`` per input layer) is added to the
    input values; its gradient is the input nodes' flows."""
    dtype = _param_dtype(params)
    B = x.shape[0]
    kmax = layout.kmax
    buf = jnp.concatenate([jnp.zeros((kmax, B), dtype), jnp.full((kmax, B), -jnp.inf, dtype),
                           jnp.zeros((layout.num_rows - 2 * kmax, B), dtype)])
    vals = input_values(layout, tables, params, x, missing, options)
    for i, (spec, v) in enumerate(zip(layout.input_layers, vals)):
        v = v.astype(dtype)
        if input_eps is not None:
            v = v + input_eps[i]
        buf = lax.dynamic_update_slice(buf, v, (spec.offset, 0))
    for si, (step, tab) in enumerate(zip(layout.steps, tables["steps"])):
        if isinstance(step, ScanSpec):
            def body(b, t, step=step, si=si):
                for j, (st, tj) in enumerate(zip(step.period, t)):
                    b = _stage(b, st, tj, params, options, tj["out"], f"{si}.{j}")
                return b, None

            with jax.named_scope(f"jaxpc/scan{si}"):
                buf, _ = lax.scan(body, buf, tab)
        else:
            buf = _stage(buf, step, tab, params, options, step.offset, si)
    return buf


def log_prob(layout: Layout, tables: dict, params: dict, x: Array, missing: Array | None, options,
             input_eps: list | None = None) -> Array:
    """Root log-value per sample, ``[B]``."""
    return node_values(layout, tables, params, x, missing, options, input_eps)[layout.root_row]


def _param_dtype(params: dict):
    leaves = jax.tree_util.tree_leaves(params)
    floats = [l.dtype for l in leaves if jnp.issubdtype(l.dtype, jnp.floating)]
    return jnp.result_type(*floats) if floats else jnp.float32
