"""Top-down selection (ancestral sampling and max-product decoding) as the gradient of a
forward pass.

Given the node values of a forward pass (LL for sampling, max-product for MPE), every sum
node chooses one child: ``argmax_c (log w_c + value_c + g_c)`` with ``g`` Gumbel noise for
sampling (an exact draw from the node's posterior) or zero for decoding (the first child on
ties: lowest child block, then lowest node of the block). A second forward pass in which each
sum node *copies* its chosen child's value, and each product sums its children's, is linear
in the leaf values; its gradient with respect to them is 1 on exactly the leaves of each
sample's selected sub-circuit and 0 elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..compiler.layout import Layout, StageSpec
from ..ops.product_layer import product_layer
from ..ops.sum_layer import gather_children, gather_weights
from . import stages

Array = jax.Array


def _choose(z: Array, values: Array, ch: Array, pid: Array, logw: Array, *, Kp: int, Kc: int, dense: bool,
            key: Array | None) -> Array:
    """``[n * Kp, B]``: each parent copies the ``z`` row of its chosen child."""
    x = gather_children(values, ch, Kc, dense)  # [n, C*Kc, B] (or [C*Kc, B])
    lw = gather_weights(logw, pid)  # [n, Kp, C*Kc]
    scores = lw[:, :, :, None] + (x[None, None] if dense else x[:, None])
    if key is not None:
        scores = scores + jax.random.gumbel(key, scores.shape, scores.dtype)
    idx = jnp.argmax(scores, axis=2)  # [n, Kp, B]
    n, C = ch.shape
    rows = (ch[:, :, None] + jnp.arange(Kc, dtype=ch.dtype)).reshape(n, C * Kc)  # [n, C*Kc]
    chosen = jnp.take_along_axis(rows[:, None, :], idx.reshape(n, 1, -1), axis=2).reshape(idx.shape)
    B = z.shape[1]
    return z[chosen, jnp.arange(B)[None, None, :]].reshape(n * Kp, B)


def _select_stage(z: Array, spec: StageSpec, tab: dict, values: Array, params: dict, key: Array | None, offset,
                  name) -> Array:
    outs = []
    for j, (part, t) in enumerate(zip(spec.prods, tab["prods"])):
        with jax.named_scope(f"jaxpc/select{name}/prod{j}"):
            outs.append(product_layer(z, t["ch"], K=part.K))
    for j, (part, t) in enumerate(zip(spec.sums, tab["sums"])):
        with jax.named_scope(f"jaxpc/select{name}/sum{j}"):
            k = None if key is None else jax.random.fold_in(jax.random.fold_in(key, offset), j)
            outs.append(_choose(z, values, t["ch"], t["pid"], params["sum"][part.group], Kp=part.Kp, Kc=part.Kc,
                                dense=part.dense, key=k))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
    return jax.lax.dynamic_update_slice_in_dim(z, out, offset, axis=0)


def reached_leaves(layout: Layout, tables: dict, params: dict, values: Array, key: Array | None) -> list[Array]:
    """Per input layer ``[N, B]`` indicators of the leaves each sample's selection reaches.

    ``values``: the ``[R, B]`` node buffer the choices are based on; ``key``: Gumbel noise (sampling)
    or None (decoding)."""
    values = jax.lax.stop_gradient(values)
    B = values.shape[1]
    eps = [jnp.zeros((spec.num_nodes, B), values.dtype) for spec in layout.input_layers]

    def total(eps):
        z = stages.write_inputs(layout, jnp.zeros_like(values), eps)

        def stage(b, spec, tab, offset, name):
            return _select_stage(b, spec, tab, values, params, key, offset, name)

        return jnp.sum(stages.run_stages(layout, tables, z, stage)[layout.root_row])

    return jax.grad(total)(eps)


def leaf_choice(layout: Layout, tables: dict, reached: list[Array], num_vars: int):
    """For each input layer: ``[V, B]`` index of the reached node of each variable (``-1`` if none)."""
    out = []
    for spec, tab, r in zip(layout.input_layers, tables["inputs"], reached):
        cand = jnp.where(r > 0.5, jnp.arange(spec.num_nodes, dtype=jnp.int32)[:, None], -1)
        best = jax.ops.segment_max(cand, tab["vars"], num_segments=num_vars)
        out.append(jnp.maximum(best, -1))
    return out
