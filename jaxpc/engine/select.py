"""Top-down selection (ancestral sampling and max-product decoding) as one pass from the root down.

Given the node values of a forward pass (LL for sampling, max-product for MPE), every sum node chooses one child:
``argmax_c (log w_c + value_c)`` for decoding (the first child on ties: lowest child block, then lowest node of the
block), or an exact draw from the node's posterior for sampling (Gumbel-max over groups of children, then within the
chosen group). The
pass runs the stages in reverse, as the flow pass does: a buffer ``[R, B]`` counts, for each node and sample, the
paths from the root that reach it through chosen edges. A product adds its count to every child, a sum to its
chosen child, by a scatter into the buffer that the stages carry (the gradient of a forward pass in which each sum
copies its chosen child gives the same counts, but autodiff builds each stage's scatter into a fresh zero buffer and
adds it: a copy of the whole buffer per stage).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from ..compiler.layout import Layout, StageSpec
from ..ops.product_layer import product_layer_backward_reference as product_layer_backward
from ..ops.rows import add_rows
from ..ops.sum_layer import child_rows, gather_children, gather_weights
from . import stages

Array = jax.Array


def group_size(num_children: int) -> int:
    """The children per group of a sampled choice (:func:`chosen_children`): the largest divisor of
    ``num_children`` that is at most its square root (1: no groups)."""
    return max(d for d in range(1, math.isqrt(num_children) + 1) if num_children % d == 0)


def sample_children(lw: Array, x: Array, key: Array) -> Array:
    """``[n, Kp, B]``: each parent's child index, an exact draw with probabilities ``exp(lw + x)`` normalized over
    the children, by the Gumbel-max trick in two levels: a group of ``S`` children (:func:`group_size`) by
    Gumbel-max on the groups' log-sum-exps, then a child of that group by Gumbel-max on its scores. ``G + S``
    Gumbel draws per parent and sample instead of ``G * S``. ``lw [n, Kp, C]``, ``x [n, C, B]``."""
    n, Kp, C = lw.shape
    B = x.shape[-1]
    S = group_size(C)
    G = C // S
    kg, kc = jax.random.split(key)
    if S == 1:
        scores = lw[:, :, :, None] + x[:, None]
        return jnp.argmax(scores + jax.random.gumbel(kc, scores.shape, scores.dtype), axis=2)
    lwg, xg = lw.reshape(n, Kp, G, S), x.reshape(x.shape[0], G, S, B)
    totals = jax.nn.logsumexp(lwg[..., None] + xg[:, None], axis=3)  # [n, Kp, G, B]
    g = jnp.argmax(totals + jax.random.gumbel(kg, totals.shape, totals.dtype), axis=2)  # [n, Kp, B]
    i, k = jnp.arange(n)[:, None, None, None], jnp.arange(Kp)[None, :, None, None]
    s, b = jnp.arange(S)[None, None, :, None], jnp.arange(B)[None, None, None, :]
    gi = g[:, :, None, :]  # the chosen group's scores, gathered: [n, Kp, S, B]
    within = lwg[i, k, gi, s] + xg[i if xg.shape[0] == n else 0, gi, s, b]
    c = jnp.argmax(within + jax.random.gumbel(kc, within.shape, within.dtype), axis=2)
    return g * S + c


def chosen_children(values: Array, ch: Array, pid: Array, logw: Array, *, Kp: int, Kc: int, dense: bool,
                    key: Array | None) -> Array:
    """``int [n, Kp, B]``: the buffer row of the child each parent of a sum partition chooses for each sample
    (``key``: a draw from the parent's posterior, :func:`sample_children`; None: the argmax, the first child on
    ties)."""
    x = gather_children(values, ch, Kc, dense)  # [n, C*Kc, B] (or [C*Kc, B])
    lw = gather_weights(logw, pid)  # [n, Kp, C*Kc]
    x = x[None] if dense else x
    if key is None:
        idx = jnp.argmax(lw[:, :, :, None] + x[:, None], axis=2)  # [n, Kp, B]
    else:
        idx = sample_children(lw, x, key)
    n = ch.shape[0]
    rows = jnp.broadcast_to(child_rows(ch, Kc, dense), (n, ch.shape[1] * Kc))  # [n, C*Kc]
    return jnp.take_along_axis(rows[:, None, :], idx.reshape(n, 1, -1), axis=2).reshape(idx.shape)


def _select_stage(counts: Array, spec: StageSpec, tab: dict, values: Array, params: dict, key: Array | None,
                  offset, name) -> Array:
    """``counts`` with the counts of one stage's nodes (rows from ``offset``: products, then sums) added to the rows
    of the children they reach."""
    row = offset
    for j, (part, t) in enumerate(zip(spec.prods, tab["prods"])):
        with jax.named_scope(f"jaxpc/select{name}/prod{j}"):
            rows, cf = product_layer_backward(counts, t["ch"], row, K=part.K)
            counts = add_rows(counts, rows, cf)
        row = row + part.num_rows
    B = counts.shape[1]
    for j, (part, t) in enumerate(zip(spec.sums, tab["sums"])):
        with jax.named_scope(f"jaxpc/select{name}/sum{j}"):
            k = None if key is None else jax.random.fold_in(jax.random.fold_in(key, offset), j)
            chosen = chosen_children(values, t["ch"], t["pid"], params["sum"][part.group], Kp=part.Kp, Kc=part.Kc,
                                     dense=part.dense, key=k)
            mine = lax.dynamic_slice_in_dim(counts, row, part.num_rows, axis=0).reshape(chosen.shape)
            counts = add_rows(counts, (chosen, jnp.arange(B)[None, None, :]), mine)
        row = row + part.num_rows
    return counts


def reached_leaves(layout: Layout, tables: dict, params: dict, values: Array, key: Array | None) -> list[Array]:
    """Per input layer ``[N, B]``: how many chosen paths from the root reach each leaf in each sample (positive
    exactly on the leaves of each sample's selected sub-circuit).

    ``values``: the ``[R, B]`` node buffer the choices are based on; ``key``: Gumbel noise (sampling)
    or None (decoding)."""
    values = lax.stop_gradient(values)
    counts = jnp.zeros_like(values).at[layout.root_row].set(1.0)

    def stage(c, spec, tab, offset, name):
        return _select_stage(c, spec, tab, values, params, key, offset, name)

    counts = stages.run_stages(layout, tables, counts, stage, reverse=True)
    return [lax.dynamic_slice_in_dim(counts, spec.offset, spec.num_nodes, axis=0) for spec in layout.input_layers]


def leaf_choice(layout: Layout, tables: dict, reached: list[Array], num_vars: int):
    """For each input layer: ``[V, B]`` index of the reached node of each variable (``-1`` if none)."""
    out = []
    for spec, tab, r in zip(layout.input_layers, tables["inputs"], reached):
        cand = jnp.where(r > 0.5, jnp.arange(spec.num_nodes, dtype=jnp.int32)[:, None], -1)
        best = jax.ops.segment_max(cand, tab["vars"], num_segments=num_vars)
        out.append(jnp.maximum(best, -1))
    return out
