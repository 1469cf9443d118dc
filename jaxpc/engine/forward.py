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


def input_values(layout: Layout, tables: dict, params: dict, x: Array, missing: Array | None, options,
                 soft: Array | None = None) -> list:
    """Per input layer ``[N, B]`` node values. ``soft``: optional ``[B, V, K]`` log-weights of soft evidence,
    used by the discrete leaves in place of ``x``/``missing``."""
    xt = x.T
    mt = _missing_t(missing)
    qt = None if soft is None else jnp.transpose(soft, (1, 2, 0))  # [V, K, B]
    outs = []
    for i, (spec, tab) in enumerate(zip(layout.input_layers, tables["inputs"])):
        with jax.named_scope(f"jaxpc/input{i}/{spec.key}"):
            p = params["input"][spec.key]
            if qt is not None and spec.dist.discrete:
                outs.append(spec.dist.log_prob_soft(p, tab["meta"], tab["rows"], qt[tab["vars"]], options))
                continue
            xv = xt[tab["vars"]]
            mv = None if mt is None else mt[tab["vars"]]
            outs.append(spec.dist.log_prob(p, tab["meta"], tab["rows"], xv, mv, options))
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


def empty_buffer(layout: Layout, B: int, dtype) -> Array:
    """``[R, B]`` zeros with the ``-inf`` padding rows set."""
    kmax = layout.kmax
    return jnp.concatenate([jnp.zeros((kmax, B), dtype), jnp.full((kmax, B), -jnp.inf, dtype),
                            jnp.zeros((layout.num_rows - 2 * kmax, B), dtype)])


def write_inputs(layout: Layout, buf: Array, vals: list) -> Array:
    for spec, v in zip(layout.input_layers, vals):
        buf = lax.dynamic_update_slice(buf, v.astype(buf.dtype), (spec.offset, 0))
    return buf


def run_stages(layout: Layout, tables: dict, buf: Array, stage_fn) -> Array:
    """Apply ``stage_fn(buf, spec, tab, offset, name)`` to every stage in order, scanning repeated ones."""
    for si, (step, tab) in enumerate(zip(layout.steps, tables["steps"])):
        if isinstance(step, ScanSpec):
            def body(b, t, step=step, si=si):
                for j, (st, tj) in enumerate(zip(step.period, t)):
                    b = stage_fn(b, st, tj, tj["out"], f"{si}.{j}")
                return b, None

            with jax.named_scope(f"jaxpc/scan{si}"):
                buf, _ = lax.scan(body, buf, tab)
        else:
            buf = stage_fn(buf, step, tab, step.offset, si)
    return buf


def node_values(layout: Layout, tables: dict, params: dict, x: Array, missing: Array | None, options,
                input_eps: list | None = None, soft: Array | None = None) -> Array:
    """The whole node buffer ``[R, B]``. ``input_eps`` (one ``[N, B]`` per input layer) is added to the
    input values; its gradient is the input nodes' flows."""
    buf = empty_buffer(layout, x.shape[0], _param_dtype(params))
    vals = input_values(layout, tables, params, x, missing, options, soft)
    if input_eps is not None:
        vals = [v.astype(buf.dtype) + e for v, e in zip(vals, input_eps)]
    buf = write_inputs(layout, buf, vals)

    def stage(b, spec, tab, offset, name):
        return _stage(b, spec, tab, params, options, offset, name)

    return run_stages(layout, tables, buf, stage)


def log_prob(layout: Layout, tables: dict, params: dict, x: Array, missing: Array | None, options,
             input_eps: list | None = None, soft: Array | None = None) -> Array:
    """Root log-value per sample, ``[B]``."""
    return node_values(layout, tables, params, x, missing, options, input_eps, soft)[layout.root_row]


def _param_dtype(params: dict):
    leaves = jax.tree_util.tree_leaves(params)
    floats = [l.dtype for l in leaves if jnp.issubdtype(l.dtype, jnp.floating)]
    return jnp.result_type(*floats) if floats else jnp.float32
