"""Top-down selection (ancestral sampling and max-product decoding) as one pass from the root down.

Given the node values of a forward pass (LL for sampling, max-product for MPE), a sum node that a sample reaches
chooses one child: ``argmax_c (log w_c + value_c)`` for decoding (the first child on ties: lowest child block, then
lowest node of the block), or an exact draw from the node's posterior for sampling (Gumbel-max). Only reached nodes
choose, and a block has at most one (:func:`reached_parents`), so a block's choice costs its children, not its
children times its nodes. The pass runs the stages in reverse, as the flow pass does: a buffer ``[R, B]`` counts,
for each node and sample, the paths from the root that reach it through chosen edges. A product adds its count to
every child, a sum to its chosen child (on a folded plan, to each child of the chosen folded product), by a scatter
into the buffer that the stages carry (the gradient of a forward pass in which each sum copies its chosen child
gives the same counts, but autodiff builds each stage's scatter into a fresh zero buffer and adds it: a copy of the
whole buffer per stage).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..compiler.layout import Layout, ScanSpec, StageSpec
from ..ops.product_layer import product_layer_backward_reference as product_layer_backward
from ..ops.rows import add_rows
from ..ops.sum_layer import child_rows, child_terms, gather_children
from . import stages

Array = jax.Array


def reached_parents(counts: Array) -> tuple[Array, Array]:
    """``(k, w)``, each ``[n, B]``: the parent of each block that a sample reaches and its count (0: no parent of
    the block reached), from a partition's counts ``[n, Kp, B]``. The nodes of a block share one scope, and in a
    decomposable circuit a chosen sub-circuit reaches a scope at most once, so at most one parent of a block is
    reached per sample."""
    return jnp.argmax(counts, axis=1), jnp.max(counts, axis=1)


def chosen_children(values: Array, ch: Array, pid: Array, logw: Array, parent: Array, *, Kc: int, dense: bool,
                    key: Array | None, noise: Array | None = None) -> list[Array]:
    """``int [n, B]`` per term of the child: the buffer row of the child that parent ``parent [n, B]`` of each block
    of a sum partition chooses for each sample (``key``: an exact draw from the parent's posterior by the Gumbel-max
    trick; None: the argmax, the first child on ties). One term for a table ``ch [n, C]``; for a folded table
    ``ch [n, C, M]`` the rows of the chosen product's ``M`` children (:func:`child_terms`), each of which the
    choice reaches. ``noise``: the draw's Gumbel noise ``[B, n, C * Kc]``, given in place of ``key``."""
    x = gather_children(values, ch, Kc, dense)  # [n, C*Kc, B] (or [C*Kc, B])
    n, C = pid.shape
    # the chosen parent's log-weights: logw[pid[i, c], parent[i, b], j] as [n, B, C*Kc]
    lw = logw[pid[:, None, :, None], parent[:, :, None, None], jnp.arange(Kc)].reshape(n, -1, C * Kc)
    scores = jnp.swapaxes(lw, 1, 2) + (x[None] if dense else x)  # [n, C*Kc, B]
    if noise is None and key is not None:  # drawn batch-major: a sample's noise does not depend on the batch's size
        noise = jax.random.gumbel(key, (scores.shape[2], *scores.shape[:2]), scores.dtype)
    if noise is not None:
        scores = scores + jnp.moveaxis(noise.astype(scores.dtype), 0, -1)
    idx = jnp.argmax(scores, axis=1)  # [n, B]
    return [jnp.take_along_axis(jnp.broadcast_to(child_rows(t, Kc, dense), (n, C * Kc)), idx, axis=1)
            for t in child_terms(ch)]


def _select_stage(counts: Array, spec: StageSpec, tab: dict, values: Array, params: dict, key: Array | None,
                  offset, name, noise: dict | None = None) -> Array:
    """``counts`` with the counts of one stage's nodes (rows from ``offset``: products, then sums) added to the rows
    of the children they reach. ``noise``: Gumbel noise drawn ahead per ``(first row, partition)``
    (:func:`_shared_noise`); a partition without an entry draws its own from ``key``."""
    row = offset
    for j, (part, t) in enumerate(zip(spec.prods, tab["prods"])):
        with jax.named_scope(f"jaxpc/select{name}/prod{j}"):
            rows, cf = product_layer_backward(counts, t["ch"], row, K=part.K)
            counts = add_rows(counts, rows, cf)
        row = row + part.num_rows
    B = counts.shape[1]
    for j, (part, t) in enumerate(zip(spec.sums, tab["sums"])):
        with jax.named_scope(f"jaxpc/select{name}/sum{j}"):
            pre = _noise_for(noise, offset, j)
            k = None if key is None or pre is not None else jax.random.fold_in(jax.random.fold_in(key, offset), j)
            mine = lax.dynamic_slice_in_dim(counts, row, part.num_rows, axis=0).reshape(part.n, part.Kp, B)
            parent, reached = reached_parents(mine)
            chosen = chosen_children(values, t["ch"], t["pid"], params["sum"][part.group], parent, Kc=part.Kc,
                                     dense=part.dense, key=k, noise=pre)
            rows = chosen[0] if len(chosen) == 1 else jnp.concatenate(chosen)
            counts = add_rows(counts, (rows, jnp.arange(B)[None, :]), jnp.tile(reached, (len(chosen), 1)))
        row = row + part.num_rows
    return counts


def _noise_for(noise: dict | None, offset, j: int) -> Array | None:
    """The noise drawn ahead for partition ``j`` of the stage at first row ``offset`` (a constant), or None."""
    if not noise or not isinstance(offset, (int, np.integer)):
        return None
    return noise.get((int(offset), j))


NOISE_BUFFERS = 4  # the shared Gumbel draw of a selection pass holds at most this many node buffers' values


def _shared_noise(layout: Layout, tables: dict, key: Array, limit: int, B: int, dtype) -> dict:
    """Gumbel noise for the sum partitions of the stages that run once (not under a scan), drawn in one call
    (``{(first row, partition): [B, n, C * Kc]}``) instead of one per partition: each draw is a kernel of its own
    that XLA compiles, and a deep circuit of distinct levels has hundreds. Partitions are taken from the root down
    while their noise stays within ``limit`` values per sample; the rest draw their own. The shared draw folds in
    ``layout.num_rows``, the partitions' own draws their stage's first row (below it): the streams are distinct.
    Drawn batch-major, as every draw here."""
    parts, total = [], 0
    for step, tab in reversed(list(zip(layout.steps, tables["steps"]))):
        if isinstance(step, ScanSpec):
            continue
        for j, (part, t) in enumerate(zip(step.sums, tab["sums"])):
            n, C = t["pid"].shape
            size = n * C * part.Kc
            if total + size > limit:
                continue
            parts.append((int(step.offset), j, n, C * part.Kc, total))
            total += size
    if len(parts) < 2:
        return {}
    g = jax.random.gumbel(jax.random.fold_in(key, layout.num_rows), (B, total), dtype)
    return {(o, j): lax.slice_in_dim(g, a, a + n * w, axis=1).reshape(B, n, w) for o, j, n, w, a in parts}


def reached_leaves(layout: Layout, tables: dict, params: dict, values: Array, key: Array | None,
                   scan: bool = True) -> list[Array]:
    """Per input layer ``[N, B]``: how many chosen paths from the root reach each leaf in each sample (positive
    exactly on the leaves of each sample's selected sub-circuit).

    ``values``: the ``[R, B]`` node buffer the choices are based on; ``key``: Gumbel noise (sampling)
    or None (decoding); ``scan``: repeated stages under ``lax.scan`` (False: unrolled, as
    ``Options.scan_stages``)."""
    values = lax.stop_gradient(values)
    counts = jnp.zeros_like(values).at[layout.root_row].set(1.0)
    noise = None if key is None else _shared_noise(layout, tables, key, NOISE_BUFFERS * values.shape[0],
                                                   values.shape[1], values.dtype)

    def stage(c, spec, tab, offset, name):
        return _select_stage(c, spec, tab, values, params, key, offset, name, noise)

    counts = stages.run_stages(layout, tables, counts, stage, reverse=True, scan=scan)
    return [lax.dynamic_slice_in_dim(counts, spec.offset, spec.num_nodes, axis=0) for spec in layout.input_layers]


def leaf_choice(layout: Layout, tables: dict, reached: list[Array], num_vars: int):
    """For each input layer: ``[V, B]`` index of the reached node of each variable (``-1`` if none). A layer of runs
    of ``r`` nodes over one variable (``InputLayerSpec.run``) takes each run's maximum first: a scatter of ``N / r``
    rows instead of ``N``, and where every run has a variable of its own (``InputLayerSpec.distinct_runs``), a
    plain write of each run's row."""
    out = []
    for spec, tab, r in zip(layout.input_layers, tables["inputs"], reached):
        cand = jnp.where(r > 0.5, jnp.arange(spec.num_nodes, dtype=jnp.int32)[:, None], -1)
        seg = tab["vars"]
        if spec.run > 1:
            cand, seg = jnp.max(cand.reshape(-1, spec.run, cand.shape[1]), axis=1), seg[::spec.run]
        if spec.distinct_runs:
            best = jnp.full((num_vars, cand.shape[1]), -1, cand.dtype).at[seg].set(cand, unique_indices=True)
        else:
            best = jnp.maximum(jax.ops.segment_max(cand, seg, num_segments=num_vars), -1)
        out.append(best)
    return out
