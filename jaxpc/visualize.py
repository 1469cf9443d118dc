"""Looking at circuits: :func:`plot_circuit` draws a small node graph with matplotlib (a networkx
graph laid out in layers by the compiler's topological level, inputs at the bottom, the root on
top) and :func:`summary` tabulates a compiled circuit's layers.

matplotlib and networkx are imported when :func:`plot_circuit` is called, so importing this module
costs nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .compiler.layout import ScanSpec, StageSpec
from .nodes import CircuitNodes, topological_order

__all__ = ["plot_circuit", "summary"]

_STYLE = {  # kind -> (marker, color)
    "input": ("s", "#4c9a2a"),
    "prod": ("o", "#e07b00"),
    "sum": ("o", "#2a6fba"),
}


def _levels(nodes):
    level = {}
    for ns in nodes:
        level[ns.id] = 0 if ns.is_input() else 1 + max(level[c.id] for c in ns.children)
    return level


def _graph(nodes, granularity: str, max_nodes: int):
    """(networkx graph with a 'layer' per node, node kinds, node labels, edges, edge vectors)."""
    import networkx as nx

    level = _levels(nodes)
    G = nx.DiGraph()
    kinds, labels, edges, edge_owner = {}, {}, [], []
    if granularity == "vector":
        for ns in nodes:
            G.add_node(ns.id, layer=level[ns.id])
            kinds[ns.id] = ns.kind
            tag = f"x{ns.var}" if ns.is_input() else ("×" if ns.is_prod() else "+")
            labels[ns.id] = f"{tag}\n{ns.num_node_blocks}x{ns.block_size}"
        for ns in nodes:
            for c in dict.fromkeys(ch.id for ch in ns.children):
                edges.append((ns.id, c))
                edge_owner.append((ns, None))
        G.add_edges_from(edges)
        return G, kinds, labels, edges, edge_owner
    total = sum(ns.num_nodes for ns in nodes)
    if total > max_nodes:
        raise ValueError(f"plot_circuit: the circuit has {total} nodes, more than max_nodes={max_nodes}; use "
                         f"granularity='vector' or raise max_nodes")
    for ns in nodes:
        for i in range(ns.num_nodes):
            key = (ns.id, i)
            G.add_node(key, layer=level[ns.id])
            kinds[key] = ns.kind
            if ns.is_input():
                labels[key] = f"x{ns.var}"
    for ns in nodes:
        if ns.is_prod():
            K = ns.block_size
            for j, c in enumerate(ns.children):
                rows = (ns.edge_ids[:, j][:, None] * K + np.arange(K)).reshape(-1)
                for i, r in enumerate(rows):
                    edges.append(((ns.id, i), (c.id, int(r))))
                    edge_owner.append((ns, None))
        elif ns.is_sum():
            Kp, Kc = ns.block_size, ns.ch_block_size
            ch_nodes = [(c.id, i) for c in ns.children for i in range(c.num_nodes)]
            for p, c in ns.edge_ids.T:
                for a in range(Kp):
                    for bb in range(Kc):
                        edges.append(((ns.id, int(p) * Kp + a), ch_nodes[int(c) * Kc + bb]))
                        edge_owner.append((ns, (int(p) * Kp + a, int(c) * Kc + bb)))
    G.add_edges_from(edges)
    return G, kinds, labels, edges, edge_owner


def _layered_layout(G, sweeps: int = 2) -> dict:
    """Positions of a layered DAG: ``y`` = layer, ``x`` = rank within the layer (centered), ranks
    from insertion order refined by barycenter sweeps (children's mean rank bottom-up, then parents'
    top-down), which untangles most crossings of tree-like circuits."""
    layers: dict[int, list] = {}
    for v, lv in G.nodes(data="layer"):
        layers.setdefault(lv, []).append(v)
    rank = {v: float(i) for vs in layers.values() for i, v in enumerate(vs)}

    def reorder(lv, neighbors):
        vs = layers[lv]
        keyed = []
        for i, v in enumerate(vs):
            nb = [rank[u] for u in neighbors(v)]
            keyed.append((float(np.mean(nb)) if nb else rank[v], i, v))
        layers[lv] = [v for _, _, v in sorted(keyed)]
        for i, v in enumerate(layers[lv]):
            rank[v] = float(i)

    order = sorted(layers)
    for _ in range(sweeps):
        for lv in order[1:]:
            reorder(lv, G.successors)  # edges point parent -> child
        for lv in reversed(order[:-1]):
            reorder(lv, G.predecessors)
    width = max(len(vs) for vs in layers.values())
    pos = {}
    for lv, vs in layers.items():
        off = (width - len(vs)) / 2.0
        for i, v in enumerate(vs):
            pos[v] = np.array([(off + i) / max(width - 1, 1), float(lv)])
    return pos


def plot_circuit(obj, params=None, *, granularity: str = "vector", ax=None, figsize=None, labels: bool = True,
                 max_nodes: int = 400):
    """Draw a small circuit, layered by topological level (inputs at the bottom, the root on top).

    Args:
        obj: a root node vector or a compiled :class:`jaxpc.Circuit`.
        params: with a circuit and ``granularity="node"``: sum edges are drawn with opacity and width
            growing with their weight, normalized over the parent node's edges (default: the circuit's
            ``params``; ignored for vectors).
        granularity: ``"vector"``: one marker per node vector (label: variable or ``×`` / ``+`` and
            ``num_node_blocks x block_size``) and one line per parent-child vector pair;
            ``"node"``: one marker per node and one line per edge (every sum edge of every block and
            every product edge), so the line count is ``circuit.num_edges``.
        ax: an existing matplotlib Axes (default: a new figure).
        figsize: size of a new figure.
        labels: draw the text labels.
        max_nodes: refuse ``granularity="node"`` above this many nodes (a ``ValueError``).

    Returns:
        the matplotlib Figure. Its artists carry gids: ``"jaxpc-input"``, ``"jaxpc-prod"`` and
        ``"jaxpc-sum"`` (scatter collections, one point per drawn node) and ``"jaxpc-edges"`` (a
        ``LineCollection``, one segment per drawn edge).
    """
    import matplotlib.pyplot as plt

    if granularity not in ("vector", "node"):
        raise ValueError(f"plot_circuit: granularity must be 'vector' or 'node', got {granularity!r}")
    if not isinstance(max_nodes, (int, np.integer)) or isinstance(max_nodes, bool) or max_nodes < 1:
        raise ValueError(f"plot_circuit: max_nodes must be a positive int, got {max_nodes!r}")
    if ax is not None:
        from matplotlib.axes import Axes

        if not isinstance(ax, Axes):
            raise TypeError(f"plot_circuit: ax must be a matplotlib Axes, got {type(ax).__name__}")
    circuit, root = _plot_target(obj, params)
    nodes = topological_order(root)
    G, kinds, text, edges, owners = _graph(nodes, granularity, max_nodes)
    pos = _layered_layout(G)

    if ax is None:
        n_layers = 1 + max(d["layer"] for _, d in G.nodes(data=True))
        width = max(len([1 for _, d in G.nodes(data=True) if d["layer"] == lv]) for lv in range(n_layers))
        fig, ax = plt.subplots(figsize=figsize or (min(2.0 + 0.6 * width, 24.0), min(1.5 + 1.2 * n_layers, 18.0)))
    else:
        fig = ax.figure
    weighted = granularity == "node" and circuit is not None
    ax.add_collection(_edge_lines(edges, pos, _edge_weights(circuit, params, owners) if weighted else None))
    size = 500 if granularity == "vector" else 60
    for kind, (marker, color) in _STYLE.items():
        keys = [k for k in G.nodes if kinds[k] == kind]
        xy = np.asarray([pos[k] for k in keys]).reshape(-1, 2)
        sc = ax.scatter(xy[:, 0], xy[:, 1], s=size, marker=marker, c=color, edgecolors="black", linewidths=0.6,
                        zorder=2, label=kind)
        sc.set_gid(f"jaxpc-{kind}")
    if labels:
        _draw_labels(ax, text, pos, granularity)
    ax.set_axis_off()
    ax.margins(0.08)
    ax.autoscale_view()
    ax.legend(loc="upper left", fontsize=7, frameon=False, markerscale=0.5)
    return fig


def _plot_target(obj, params) -> tuple[Any, CircuitNodes]:
    """``(circuit or None, root)`` of :func:`plot_circuit`'s first argument; ``params`` need a circuit."""
    if _is_circuit(obj):
        return obj, obj.root
    if isinstance(obj, CircuitNodes):
        if params is not None:
            raise ValueError("plot_circuit: params= needs a compiled circuit as the first argument")
        return None, obj
    raise TypeError(f"plot_circuit: expected a node vector or a jaxpc.Circuit, got {type(obj).__name__}")


def _edge_weights(circuit, params, owners) -> np.ndarray:
    """The weight of each drawn edge (:func:`_graph`'s edge owners), in [0, 1]: its sum weight under ``params``
    (default ``circuit.params``) divided by the total weight of its parent node (parameters need not be normalized,
    e.g. after gradient training), 1 for product edges. Non-finite weights raise a ``ValueError``."""
    p = circuit.params if params is None else params
    dense = {}
    w = np.ones(len(owners))
    for i, (ns, ij) in enumerate(owners):
        if ij is None:
            continue
        if ns.id not in dense:
            d = np.asarray(circuit.get_node_params(p, ns), dtype=np.float64)  # [num_nodes, num_ch_nodes]
            if not np.all(np.isfinite(d)) or np.any(d < 0):
                raise ValueError(f"plot_circuit: the weights of {ns.name} under params are not finite and "
                                 f"non-negative; pass finite parameters")
            tot = d.sum(axis=1, keepdims=True)
            dense[ns.id] = d / np.where(tot > 0, tot, 1.0)
        w[i] = dense[ns.id][ij]
    return w


def _edge_lines(edges, pos, weights):
    """The edges as one ``LineCollection`` (gid ``"jaxpc-edges"``): gray, or with ``weights`` black lines whose
    width and opacity grow with the weight."""
    from matplotlib.collections import LineCollection

    segs = np.asarray([[pos[a], pos[b]] for a, b in edges]).reshape(-1, 2, 2)
    if weights is None:
        lc = LineCollection(segs, linewidths=0.8, colors="0.45", alpha=0.5, zorder=1)
    else:
        colors = np.zeros((len(edges), 4))
        colors[:, 3] = 0.15 + 0.85 * weights
        lc = LineCollection(segs, linewidths=0.3 + 2.0 * weights, colors=colors, alpha=None, zorder=1)
    lc.set_gid("jaxpc-edges")
    return lc


def _draw_labels(ax, text: dict, pos: dict, granularity: str) -> None:
    """The node labels (gid ``"jaxpc-label"``): inside a vector's marker, below a node's."""
    fs = 7 if granularity == "vector" else 6
    for k, t in text.items():
        x, y = pos[k]
        if granularity == "vector":
            ax.text(x, y, t, ha="center", va="center", fontsize=fs, color="white", zorder=3, gid="jaxpc-label")
        else:
            ax.text(x, y - 0.12, t, ha="center", va="top", fontsize=fs, zorder=3, gid="jaxpc-label")


# ----------------------------------------------------------------------------------------------
# summary
# ----------------------------------------------------------------------------------------------

def _fmt_set(values) -> str:
    vals = sorted(set(values), key=lambda v: (len(str(v)), str(v)))
    if len(vals) > 4:
        return ",".join(map(str, vals[:3])) + f",..({len(vals)})"
    return ",".join(map(str, vals)) if vals else "-"


def _stage_rows(stage: StageSpec, tab: dict, ninf_row: int, step: str) -> list[dict[str, Any]]:
    """Rows of one stage; ``tab``'s arrays may carry a leading repeat axis (a scan)."""
    rows = []
    if stage.prods:
        rows.append({
            "step": step, "kind": "prod", "parts": len(stage.prods),
            "nodes": sum(p.n * p.K for p in stage.prods),
            "edges": sum(p.n * p.K * p.m for p in stage.prods), "params": 0,
            "fan-in": _fmt_set(p.m for p in stage.prods), "blocks": _fmt_set(p.K for p in stage.prods)})
    if stage.sums:
        edges, params = 0, 0
        seen: dict[str, set] = {}
        reps = 1
        for part, t in zip(stage.sums, tab["sums"]):
            ch = np.asarray(t["ch"])
            pid = np.asarray(t["pid"])
            if ch.ndim == 3:
                reps = ch.shape[0]
            real = ch != ninf_row
            edges += int(real.sum()) * part.Kp * part.Kc
            seen.setdefault(part.group, set()).update(np.unique(pid[real]).tolist())
        for g, ids in seen.items():
            kp, kc = (int(v) for v in g.split("x"))
            params += len(ids) * kp * kc
        rows.append({
            "step": step, "kind": "sum", "parts": len(stage.sums),
            "nodes": sum(s.n * s.Kp for s in stage.sums), "edges": edges // reps, "params": params,
            "fan-in": _fmt_set(s.C for s in stage.sums), "blocks": _fmt_set(f"{s.Kp}x{s.Kc}" for s in stage.sums)})
    return rows


def summary(circuit) -> str:
    """A table of a compiled circuit's layers, one row per input layer and per product / sum half of
    every stage (a topological level).

    Columns: ``step`` (index into ``circuit.layout.steps``; a scanned run of stages reads ``i.j xR``:
    stage ``j`` of the period of step ``i``, repeated ``R`` times, with per-repetition numbers);
    ``kind``; ``parts`` (vectors of an input layer; partitions of a stage, each one gather of one
    block shape and fan-in); ``nodes``; ``edges`` (sum edges without fan-in padding, product edges);
    ``params`` (parameters the row reads: an input layer's rows times fields, a stage's distinct sum
    weights; tied rows read the same ones); ``fan-in`` (product arity / padded sum fan-in in blocks);
    ``blocks`` (block sizes; sums ``parent x child``). The last line totals nodes and edges over all
    repetitions (``circuit.num_nodes``, ``circuit.num_edges``) and gives ``circuit.num_parameters``.
    """
    if not _is_circuit(circuit):
        raise TypeError(f"summary: expected a compiled jaxpc.Circuit, got {type(circuit).__name__}")
    layout = circuit.layout
    rows: list[dict[str, Any]] = []
    by_layer: dict[tuple, list] = {}
    for ns in circuit.nodes:
        if ns.is_input():
            by_layer.setdefault(ns.dist.layer_key(), []).append(ns)
    for spec in layout.input_layers:
        members = by_layer.get(spec.dist.layer_key(), [])
        n_par = sum(int(np.prod(a.shape)) for a in circuit.params["input"][spec.key].values())
        rows.append({"step": "in", "kind": f"input:{spec.key}", "parts": len(members), "nodes": spec.num_nodes,
                     "edges": 0, "params": n_par, "fan-in": "-", "blocks": _fmt_set(ns.block_size for ns in members),
                     "repeat": 1})
    ninf = layout.ninf_row
    for i, (step, tab) in enumerate(zip(layout.steps, circuit.tables["steps"])):
        if isinstance(step, ScanSpec):
            for j, (stage, t) in enumerate(zip(step.period, tab)):
                for r in _stage_rows(stage, t, ninf, f"{i}.{j} x{step.repeats}"):
                    r["repeat"] = step.repeats
                    rows.append(r)
        else:
            for r in _stage_rows(step, tab, ninf, str(i)):
                r["repeat"] = 1
                rows.append(r)
    tot_nodes = sum(r["nodes"] * r["repeat"] for r in rows)
    tot_edges = sum(r["edges"] * r["repeat"] for r in rows)
    cols = ["step", "kind", "parts", "nodes", "edges", "params", "fan-in", "blocks"]
    table = [["-" if c == "edges" and r["kind"].startswith("input") else str(r[c]) for c in cols] for r in rows]
    total = ["total", "", "", str(tot_nodes), str(tot_edges), str(circuit.num_parameters), "", ""]
    widths = [max(len(c), *(len(t[k]) for t in table + [total])) for k, c in enumerate(cols)]
    right = {"parts", "nodes", "edges", "params"}

    def line(cells):
        return "  ".join(cell.rjust(w) if c in right else cell.ljust(w)
                         for c, cell, w in zip(cols, cells, widths)).rstrip()

    scans = sum(1 for s in layout.steps if isinstance(s, ScanSpec))
    head = (f"Circuit: {circuit.num_vars} variables, {len(layout.input_layers)} input layers, "
            f"{len(layout.steps)} steps ({scans} scanned)")
    sep = "-" * len(line(cols))
    return "\n".join([head, line(cols), sep, *(line(t) for t in table), sep, line(total)])


def _is_circuit(obj) -> bool:
    """A compiled circuit (anything with its root, layout and node vectors: :class:`jaxpc.Circuit`), recognized
    without importing the shell module that defines it."""
    return all(hasattr(obj, a) for a in ("root", "layout", "nodes", "num_parameters"))
