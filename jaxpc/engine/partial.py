"""Partial evaluation: re-evaluate the nodes of a plan (:mod:`jaxpc.compiler.partial`) on top of a node buffer.

The plan's input layers are evaluated again and its stages run over the previous buffer ``[R, B]``, every other
row read as it is; the sum partitions take the untuned routes of :func:`jaxpc.engine.routing.kernel_choice`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..compiler.layout import Layout
from ..ops import product_layer, sum_layer
from . import forward, routing, stages

Array = jax.Array


def partial_values(layout: Layout, plan, plan_tables: dict, params: dict, x: Array, missing: Array | None,
                   values: Array, options) -> Array:
    """Re-evaluate the nodes of ``plan`` (see :mod:`jaxpc.compiler.partial`) on top of a previous node
    buffer ``values`` ``[R, B]``; returns the updated buffer."""
    xt = x.T
    mt = forward.missing_t(missing)
    buf = values
    # the tuned routes name the full plan's partitions, not these; a buffer past int32 offsets runs on XLA
    untuned = routing.within_int32(layout, options.replace(kernels=()), values.shape[1], rows=values.shape[0])
    for pin, tab in zip(plan.inputs, plan_tables["inputs"]):
        spec = layout.input_layers[pin.layer]
        xv = xt[tab["vars"]]
        mv = None if mt is None else mt[tab["vars"]]
        v = spec.dist.log_prob(params["input"][spec.key], plan_tables["meta"][pin.layer], tab["rows"], xv, mv, options)
        buf = buf.at[tab["write"]].set(v.astype(buf.dtype))

    def stage(b, spec, tab, offset, name):
        for j, (part, t) in enumerate(zip(spec.prods, tab["prods"])):
            with jax.named_scope(f"jaxpc/partial{name}/prod{j}"):
                out = product_layer(b, t["ch"], K=part.K)
            b = b.at[(t["write"][:, None] + jnp.arange(part.K)).reshape(-1)].set(out.astype(b.dtype))
        impls = [routing.kernel_choice(untuned, part, b.shape[1], b.dtype)[0] for part in spec.sums]
        for j, (part, t) in enumerate(zip(spec.sums, tab["sums"])):
            with jax.named_scope(f"jaxpc/partial{name}/sum{j}"):
                out = sum_layer(b, t["ch"], t["pid"], params["sum"][part.group], Kp=part.Kp, Kc=part.Kc,
                                dense=part.dense, propagation=options.propagation, alpha=options.alpha,
                                precision=options.concrete_precision, impl=impls[j])
            b = b.at[(t["write"][:, None] + jnp.arange(part.Kp)).reshape(-1)].set(out.astype(b.dtype))
        return b

    return stages.run_stages(plan, plan_tables, buf, stage, scan=options.scan_stages)
