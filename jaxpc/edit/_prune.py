"""Drop sum edge blocks with low flows or scores (:func:`prune`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import checks
from ..nodes import CircuitNodes, SumNodes, multiply
from ._graph import as_real, check_root, tie_groups
from ._params import Builder, Params, node_totals, rescale_blocks


def prune(root: CircuitNodes, circuit, params=None, flows=None, *, keep_frac: float | None = None,
          threshold: float | None = None, scores: Mapping[CircuitNodes, Any] | None = None,
          renormalize: bool = True) -> CircuitNodes:
    """Drop sum edge blocks with low scores and (by default) renormalize the remaining weights.

    The score of an edge block is its total flow (expected count, summed over the ``Kp x Kc`` edges of
    the block) from ``circuit.get_node_flows(flows, node)``, or ``scores[node]`` ``[num_edge_blocks]``.
    A tied group is pruned once: its score is the pooled flow (or the sum of its members' scores) and
    every member keeps the same edges. Every parent block keeps at least its best edge block, so
    nodes keep at least one child. Children a sum no longer reaches are dropped from its children, and
    vectors no longer reachable disappear from the graph.

    With ``renormalize=True`` (the default) every node's kept weights are scaled up to the node's old total
    weight (one for normalized parameters), so a normalized circuit stays normalized; a node whose kept weights
    are all zero spreads its old total evenly over its kept edges. The mass of the dropped edges moves to the
    kept ones, so ``log_prob`` changes even where the dropped edges carried no flow, unless their weights were
    zero. With ``renormalize=False`` the kept weights stay as they are: ``log_prob`` of a sample is unchanged
    where the dropped edges carried none of its flow and lower where they carried some, and a normalized
    circuit then sums to less than one.

    Sum gates follow the kept edge blocks: a pruned vector's gate columns are those of its remaining
    edge blocks, same gate block size; a ``tie_to`` is kept where both vectors keep the same edge blocks
    (parameter-tied vectors always do), otherwise the vector gets gate columns of its own.

    Args:
        root: the root vector the circuit was compiled from.
        circuit: the compiled circuit.
        params: its parameters (default ``circuit.params``).
        flows: a flows pytree of the circuit (``circuit.flows(...)``, summed over batches: expected counts,
            not log-space or negated ones); required unless ``scores`` is given.
        keep_frac: keep the ``ceil(keep_frac * total)`` highest-scoring edge blocks of all scored sums
            (ties: earlier edges first), plus the per-parent minimum.
        threshold: or keep edge blocks with score ``>= threshold`` (plus the per-parent minimum).
        scores: optional ``{sum vector: [num_edge_blocks]}``; sums without a score are not pruned.
        renormalize: give each node's dropped weight to its kept edges (default True, see above); False keeps
            the kept weights as they are.

    Returns:
        the new root.
    """
    fn = "prune"
    nodes = check_root(root, fn)
    if circuit is None:
        raise ValueError(f"{fn}: needs the compiled circuit (and its params and flows)")
    reader = Params(fn, circuit, params)
    keep_frac, threshold = _check_selection(keep_frac, threshold, flows, scores, fn)
    renormalize = checks.check_bool(fn, "renormalize", renormalize)
    groups = {k: v for k, v in tie_groups(nodes).items() if v[0].is_sum()}
    if scores is not None:
        group_scores = _given_scores(nodes, scores, fn)
    else:
        group_scores = _flow_scores(groups, flows, reader, fn)
    kept = _kept_edges(groups, group_scores, keep_frac, threshold)
    alive = _alive(nodes, root, kept)
    return _build_pruned(nodes, alive, kept, reader, renormalize)[root.id]


def _check_selection(keep_frac, threshold, flows, scores, fn: str) -> tuple[float | None, float | None]:
    """``(keep_frac, threshold)`` as floats (one of them None)."""
    if (keep_frac is None) == (threshold is None):
        raise ValueError(f"{fn}: give exactly one of keep_frac and threshold")
    frac = None if keep_frac is None else as_real(keep_frac)
    if keep_frac is not None and (frac is None or not 0.0 < frac <= 1.0):
        raise ValueError(f"{fn}: keep_frac must be a float in (0, 1], got {keep_frac!r}")
    thr = None if threshold is None else as_real(threshold)
    if threshold is not None and (thr is None or math.isnan(thr)):
        raise ValueError(f"{fn}: threshold must be a number, got {threshold!r}")
    if flows is None and scores is None:
        raise ValueError(f"{fn}: give flows= (circuit.flows(params, x)) or scores=")
    if scores is not None and not isinstance(scores, Mapping):
        raise TypeError(f"{fn}: scores must be a dict {{sum vector: [num_edge_blocks] scores}}, got "
                        f"{type(scores).__name__}")
    return frac, thr


def _given_scores(nodes: Sequence[CircuitNodes], scores: Mapping, fn: str) -> dict[int, np.ndarray]:
    """``{tie group source id: [num_edge_blocks]}``, the sum of the members' ``scores``."""
    group_scores: dict[int, np.ndarray] = {}
    in_graph = {ns.id for ns in nodes}
    for ns, sc in scores.items():
        if not isinstance(ns, SumNodes) or ns.id not in in_graph:
            raise ValueError(f"{fn}: scores has a key that is not a sum vector of this graph: {ns!r}")
        sc = np.asarray(sc, dtype=np.float64)
        if sc.shape != (ns.edge_ids.shape[1],):
            raise ValueError(f"{fn}: scores[{ns.name}] must have shape [num_edge_blocks] = "
                             f"[{ns.edge_ids.shape[1]}], got shape {sc.shape}")
        bad = np.nonzero(~np.isfinite(sc))[0]
        if bad.size:
            raise ValueError(f"{fn}: scores[{ns.name}] has non-finite values {sc[bad[:5]].tolist()} at edge "
                             f"block(s) {bad[:5].tolist()}; scores must be finite")
        k = ns.source.id
        group_scores[k] = group_scores.get(k, 0.0) + sc
    return group_scores


def _flow_scores(groups: dict[int, list[CircuitNodes]], flows, reader: Params, fn: str) -> dict[int, np.ndarray]:
    """``{tie group source id: [num_edge_blocks]}``: ``circuit.get_node_flows(flows, src)`` summed over
    each edge block, read from host copies of the flows."""
    reader.check_flows(flows)
    group_scores: dict[int, np.ndarray] = {}
    host: dict[str, np.ndarray] = {}
    for k, members in groups.items():
        src = members[0].source
        pl = reader.placement(src, reader.circuit.structure.sum_placement)
        if pl.group not in host:
            try:
                host[pl.group] = np.asarray(flows["sum"][pl.group], dtype=np.float64)
            except (KeyError, TypeError, IndexError):
                raise ValueError(f"{fn}: flows has no entry ['sum'][{pl.group!r}]; pass a flows pytree of the "
                                 f"circuit (circuit.flows(params, x))") from None
        block = host[pl.group][pl.start:pl.start + pl.num_edge_blocks]
        neg = np.nonzero(np.any(block < 0, axis=(1, 2)))[0]
        if neg.size:
            raise ValueError(f"{fn}: the flows of {src.name} (flows['sum'][{pl.group!r}]) are negative at edge "
                             f"block(s) {neg[:5].tolist()}; pruning needs expected counts (>= 0), as circuit.flows "
                             f"returns them without Options(logspace_flows=True) or negate_flows=True")
        bad = np.nonzero(~np.all(np.isfinite(block), axis=(1, 2)))[0]
        if bad.size:
            raise ValueError(f"{fn}: the flows of {src.name} (flows['sum'][{pl.group!r}]) are non-finite (NaN or "
                             f"inf) at edge block(s) {bad[:5].tolist()}; pruning needs finite flows (a batch "
                             f"with a NaN log-likelihood makes NaN flows)")
        group_scores[k] = block.sum(axis=(1, 2))
    return group_scores


def _kept_edges(groups: dict[int, list[CircuitNodes]], group_scores: dict[int, np.ndarray],
                keep_frac: float | None, threshold: float | None) -> dict[int, np.ndarray]:
    """``{tie group source id: bool[num_edge_blocks]}``: the selected edge blocks of every scored group,
    plus the best edge block of each parent block that lost all of its."""
    keys = list(group_scores)
    flat = np.concatenate([group_scores[k] for k in keys]) if keys else np.zeros(0)
    if keep_frac is not None:
        n_keep = int(math.ceil(keep_frac * flat.size - 1e-9))
        order = np.argsort(-flat, kind="stable")
        keep_flat = np.zeros(flat.size, bool)
        keep_flat[order[:n_keep]] = True
    else:
        keep_flat = flat >= threshold
    kept: dict[int, np.ndarray] = {}
    start = 0
    for k in keys:
        sc = group_scores[k]
        keep = keep_flat[start:start + sc.size].copy()
        start += sc.size
        src = groups[k][0]
        par = src.edge_ids[0]
        has = np.zeros(src.num_node_blocks, bool)
        has[par[keep]] = True
        for p in np.nonzero(~has)[0]:
            cand = np.nonzero(par == p)[0]
            keep[cand[np.argmax(sc[cand])]] = True
        kept[k] = keep
    return kept


def _kept_children(ns: SumNodes, kept: dict[int, np.ndarray]) -> list[int]:
    """Indices of the children of ``ns`` that a kept edge still reaches."""
    keep = kept.get(ns.source.id)
    if keep is None:
        return list(range(len(ns.children)))
    used = np.zeros(ns.num_ch_node_blocks, bool)
    used[ns.edge_ids[1][keep]] = True
    out, o = [], 0
    for j, c in enumerate(ns.children):
        if used[o:o + c.num_node_blocks].any():
            out.append(j)
        o += c.num_node_blocks
    return out


def _alive(nodes: Sequence[CircuitNodes], root: CircuitNodes, kept: dict[int, np.ndarray]) -> set[int]:
    """Ids of the vectors still reachable from the root over kept edges."""
    alive = {root.id}
    for ns in reversed(nodes):
        if ns.id not in alive:
            continue
        idx = _kept_children(ns, kept) if ns.is_sum() else range(len(ns.children))
        for j in idx:
            alive.add(ns.children[j].id)
    return alive


def _build_pruned(nodes: Sequence[CircuitNodes], alive: set[int], kept: dict[int, np.ndarray],
                  reader: Params, renormalize: bool) -> dict[int, CircuitNodes]:
    b = Builder("prune")
    new: dict[int, CircuitNodes] = {}
    for ns in nodes:
        if ns.id not in alive:
            continue
        if ns.is_input():
            new[ns.id] = b.input(ns, ns.var, ns.num_node_blocks, ns.block_size, lambda: reader.input_natural(ns))
        elif ns.is_prod():
            new[ns.id] = multiply(*[new[c.id] for c in ns.children], edge_ids=ns.edge_ids.copy(), name=ns.name)
        else:
            new[ns.id] = _pruned_sum(ns, kept, new, b, reader, renormalize)
    b.set_gates(nodes)
    return new


def _pruned_sum(ns: SumNodes, kept: dict[int, np.ndarray], new: dict[int, CircuitNodes], b: Builder,
                reader: Params, renormalize: bool) -> SumNodes:
    """The sum ``ns`` over its kept edges and surviving children, each node's kept weights scaled to its old
    total (``renormalize``) or left as they are."""
    keep = kept.get(ns.source.id)
    if keep is None:
        keep = np.ones(ns.edge_ids.shape[1], bool)
    idx = _kept_children(ns, kept)
    remap = np.full(ns.num_ch_node_blocks, -1, dtype=np.int64)
    n = 0
    offs = np.concatenate([[0], np.cumsum([c.num_node_blocks for c in ns.children])])
    for j in idx:
        c = ns.children[j]
        remap[offs[j]:offs[j + 1]] = n + np.arange(c.num_node_blocks)
        n += c.num_node_blocks
    edges = np.stack([ns.edge_ids[0][keep], remap[ns.edge_ids[1][keep]]])

    def blocks():
        old = reader.sum_blocks(ns)
        if old is None:
            return None
        if not renormalize:
            dead = node_totals(old[keep], ns.edge_ids[0][keep], ns.num_node_blocks) <= 0
            if dead.any():
                blk, k = (int(i) for i in np.argwhere(dead)[0])
                raise ValueError(f"prune: with renormalize=False, node {blk * ns.block_size + k} of {ns.name} keeps "
                                 f"only zero weights; keep more edge blocks or pass renormalize=True")
            return old[keep]
        return rescale_blocks(old[keep], ns.edge_ids[0][keep], node_totals(old, ns.edge_ids[0], ns.num_node_blocks))

    edge_map = np.where(keep, np.cumsum(keep) - 1, -1)
    return b.sum(ns, [new[ns.children[j].id] for j in idx], ns.num_node_blocks, ns.block_size, edges, blocks,
                 edge_map=edge_map)
