"""Host-side compilation: node vectors -> (Layout, index tables, parameter placement).

Everything here is vectorized numpy over node *vectors* (never per node), so circuits with
hundreds of thousands of nodes compile in seconds.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections import defaultdict

import numpy as np

from ..nodes import CircuitNodes, InputNodes, ProdNodes, SumNodes, topological_order
from .chain import detect_chain
from .layout import InputLayerSpec, Layout, PFlowSpec, ProdPart, ScanSpec, StageSpec, SumGroupSpec, SumPart
from .levels import even_levels, is_padding
from .repeats import Repeats, shift_of
from .tree import detect_tree

__all__ = ["CompiledStructure", "build", "check_seed"]


def check_seed(seed) -> int:
    """``seed`` (of the initial parameters' random draw) as a Python int where it is an integer >= 0 (a Python or
    NumPy integer, not a bool), else a ``TypeError`` / ``ValueError`` naming ``seed``."""
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise TypeError(f"compile: seed must be an int >= 0, got {type(seed).__name__} {seed!r}")
    if seed < 0:
        raise ValueError(f"compile: seed must be an int >= 0, got {seed!r}")
    return int(seed)


@dataclasses.dataclass
class SumPlacement:
    group: str
    start: int  # first parameter block
    num_edge_blocks: int
    seg_start: int  # first normalization segment (parent block)


@dataclasses.dataclass(frozen=True)
class GatePlacement:
    """The gate columns of a gated sum vector (``SumNodes.set_gates``): ``[num_edge_blocks, per_block]`` row-major
    from column ``start``; ``block_size`` parent nodes share a gate. Vectors tied by ``tie_to`` share one."""

    start: int
    num_edge_blocks: int
    per_block: int
    block_size: int

    @property
    def stop(self) -> int:
        return self.start + self.num_edge_blocks * self.per_block


@dataclasses.dataclass
class InputPlacement:
    layer: int
    key: str
    row_start: int
    num_nodes: int


@dataclasses.dataclass
class CompiledStructure:
    layout: Layout
    tables: dict  # numpy pytree (int32 / bool); the Circuit puts it on device
    sum_placement: dict[int, SumPlacement]  # by source vector id
    input_placement: dict[int, InputPlacement]  # by source vector id
    sources: dict[int, CircuitNodes]  # source vectors by id
    nodes: list[CircuitNodes]  # topological order
    block_rows: dict[int, np.ndarray]  # first buffer row of each block, by vector id
    var_dists: dict[int, list]  # distributions per variable (for input validation)
    stages: list  # every stage in order (scans unrolled), for partial evaluation plans
    stage_tables: list  # their numpy tables
    stage_owners: list  # per stage {"prods": [...], "sums": [...]}: the node vector of each block
    gate_placement: dict[int, GatePlacement] = dataclasses.field(default_factory=dict)  # by gated vector id


def _fanin_buckets(fanins: np.ndarray, max_exact: int) -> np.ndarray:
    """Padded fan-in for each parent block: exact when there are few distinct fan-ins, else the next
    power of two (at most 2x padding)."""
    uniq = np.unique(fanins)
    if uniq.size <= max_exact:
        return fanins.copy()
    return (1 << np.ceil(np.log2(np.maximum(fanins, 1))).astype(np.int64)).astype(np.int64)


def build(root: CircuitNodes, *, scan_min_repeats: int = 3, max_exact_fanins: int = 4) -> CompiledStructure:
    """Compile the node graph under ``root`` (a single node) into its layout, index tables and parameter
    placement. ``scan_min_repeats``: see :func:`group_scans`; ``max_exact_fanins``: see :func:`_fanin_buckets`."""
    _check_root(root)
    if not isinstance(scan_min_repeats, numbers.Integral) or isinstance(scan_min_repeats, bool):
        raise TypeError(f"compile: scan_min_repeats must be an int >= 0, got {type(scan_min_repeats).__name__} "
                        f"{scan_min_repeats!r}")
    if scan_min_repeats < 0:
        raise ValueError(f"compile: scan_min_repeats must be an int >= 0 (0: no scans), got {scan_min_repeats!r}")
    nodes = topological_order(root)
    kmax = max(ns.block_size for ns in nodes)
    by_level = _levels(nodes)
    sources = _sources(nodes)
    sum_placement, sum_groups, group_tables = _place_sums(sources)
    tied = {sum_placement[ns.source.id].group for ns in nodes if ns.is_sum() and ns is not ns.source}
    sum_groups = tuple(dataclasses.replace(g, untied=g.key not in tied) for g in sum_groups)
    block_rows: dict[int, np.ndarray] = {}
    input_placement, input_specs, input_tables, inputs_end = _place_inputs(nodes, 2 * kmax, block_rows)
    input_rows = {ns.id: block_rows[ns.id] for ns in nodes if ns.is_input()}

    stages, stage_tables, stage_owners = [], [], []
    row = inputs_end
    repeats = Repeats()
    for members in by_level[1:]:
        spec, tab, row, owners = _build_stage(members, row, block_rows, sum_placement, max_exact_fanins,
                                              repeats=repeats)
        stages.append(spec)
        stage_tables.append(tab)
        stage_owners.append(owners)
    gate_placement, num_gates = _place_gates(nodes)
    if gate_placement:
        stages = _with_gate_tables(stages, stage_tables, stage_owners, gate_placement, sum_placement, num_gates)
    steps, step_tables = group_scans(stages, stage_tables, scan_min_repeats)

    root_row = int(block_rows[root.id][0])
    single, gaps = _single_reader(stages, stage_tables, 2 * kmax, row, root_row)
    var_dists = _var_dists(nodes)
    pflows, pflow_tables = _pflow_plan(steps, step_tables)
    layout = Layout(num_rows=row, kmax=kmax, input_layers=tuple(input_specs), steps=tuple(steps),
                    sum_groups=sum_groups, root_row=root_row, num_vars=max(var_dists) + 1, pflows=pflows,
                    single_reader=single, flow_gaps=gaps, num_gates=num_gates, product_reads=_product_reads(nodes))
    tables = {"inputs": input_tables, "steps": step_tables, "groups": group_tables, "pflows": pflow_tables}
    layout, tables = _with_chain(layout, tables, stages, stage_tables)
    fold = _build_fold(nodes, root, input_rows, inputs_end, 2 * kmax, sum_placement, max_exact_fanins,
                       scan_min_repeats)
    layout, tables = _with_fold(layout, tables, fold)
    return CompiledStructure(layout, tables, sum_placement, input_placement, sources, nodes, block_rows,
                             var_dists, stages, stage_tables, stage_owners, gate_placement)


def _product_reads(nodes) -> float:
    """:attr:`Layout.product_reads`: the sums' edge blocks whose child block is a product's, per product block."""
    blocks = reads = 0
    for ns in nodes:
        if ns.is_prod():
            blocks += ns.num_node_blocks
        elif ns.is_sum():
            prod = np.concatenate([np.full(c.num_node_blocks, c.is_prod()) for c in ns.children])
            reads += int(prod[ns.edge_ids[1]].sum())
    return reads / blocks if blocks else 0.0


def _check_root(root) -> None:
    if not isinstance(root, CircuitNodes):
        raise TypeError(f"compile: root must be a node vector, got {type(root).__name__}")
    if root.num_nodes != 1:
        raise ValueError(f"compile: the root must be a single node, but {root.name} has {root.num_nodes} nodes; "
                         f"add jaxpc.summate(..., num_nodes=1) on top")


def _levels(nodes: list[CircuitNodes]) -> list[list[CircuitNodes]]:
    """The inner (product and sum) vectors by level, in topological order within a level: inputs are level 0
    (left empty), every other vector one above its highest child."""
    level: dict[int, int] = {}
    for ns in nodes:
        level[ns.id] = 0 if ns.is_input() else 1 + max(level[c.id] for c in ns.children)
    by_level: list[list[CircuitNodes]] = [[] for _ in range(max(level.values()) + 1)]
    for ns in nodes:
        if not ns.is_input():
            by_level[level[ns.id]].append(ns)
    return by_level


def _sources(nodes: list[CircuitNodes]) -> dict[int, CircuitNodes]:
    """The source vector of every vector (itself unless tied), by id; a tied vector must be of its source's kind, a
    tied input of its distribution and shape, a tied sum of its edges."""
    sources: dict[int, CircuitNodes] = {}
    for ns in nodes:
        src = ns.source
        if src.id not in sources:
            sources[src.id] = src
        if ns is not src and ns.kind != src.kind:
            raise ValueError(f"compile: {ns.name} ({ns.kind} vector) is tied to {src.name}, a {src.kind} vector")
        if ns is not src and ns.is_input() and (ns.dist, ns.num_node_blocks, ns.block_size) != \
                (src.dist, src.num_node_blocks, src.block_size):
            raise ValueError(f"compile: {ns.name} ({ns.dist!r}, {ns.num_node_blocks} x {ns.block_size} nodes) is tied "
                             f"to {src.name} ({src.dist!r}, {src.num_node_blocks} x {src.block_size} nodes): a tied "
                             f"input must have its source's distribution and shape")
        if ns is not src and ns.is_sum():
            if (ns.num_node_blocks, ns.block_size, ns.ch_block_size) != (src.num_node_blocks, src.block_size,
                                                                          src.ch_block_size) or \
                    not np.array_equal(ns.edge_ids, src.edge_ids):
                raise ValueError(f"compile: {ns.name} is tied to {src.name} but their edges differ")
    return sources


def _place_sums(sources: dict[int, CircuitNodes]) -> tuple[dict[int, SumPlacement], tuple[SumGroupSpec, ...], dict]:
    """Parameter placement of the source sum vectors: one group per block shape ``"{Kp}x{Kc}"``, holding its
    vectors' edge blocks one after another. Returns ``(placement by vector id, group specs sorted by key, group
    tables)``; a group's tables give each edge block's normalization segment (``seg``, its parent block) and
    each parent block's number of child nodes (``nch``)."""
    sum_placement: dict[int, SumPlacement] = {}
    group_sizes: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # blocks, segments
    group_shapes: dict[str, tuple[int, int]] = {}
    seg_tables: dict[str, list[np.ndarray]] = defaultdict(list)
    nch_tables: dict[str, list[np.ndarray]] = defaultdict(list)
    for src in sources.values():
        if not src.is_sum():
            continue
        key = f"{src.block_size}x{src.ch_block_size}"
        group_shapes[key] = (src.block_size, src.ch_block_size)
        blocks, segs = group_sizes[key]
        E = src.edge_ids.shape[1]
        sum_placement[src.id] = SumPlacement(key, blocks, E, segs)
        seg_tables[key].append(segs + src.edge_ids[0])
        nch_tables[key].append(np.bincount(src.edge_ids[0], minlength=src.num_node_blocks) * src.ch_block_size)
        group_sizes[key] = [blocks + E, segs + src.num_node_blocks]
    group_tables = {
        k: {"seg": np.concatenate(seg_tables[k]).astype(np.int32),
            "nch": np.concatenate(nch_tables[k]).astype(np.int32)}
        for k in group_shapes}
    sum_groups = tuple(SumGroupSpec(k, *group_shapes[k], *group_sizes[k], single_segments=bool(np.all(
        np.bincount(group_tables[k]["seg"], minlength=group_sizes[k][1]) == 1))) for k in sorted(group_shapes))
    return sum_placement, sum_groups, group_tables


def _gate_owner(ns: SumNodes) -> SumNodes:
    """The vector whose gate columns ``ns`` reads: the end of its ``tie_to`` chain."""
    seen = {ns.id}
    while ns.gates is not None and ns.gates.tie_to is not None:
        ns = ns.gates.tie_to
        if ns.id in seen:
            raise ValueError(f"compile: the gate ties through {ns.name} form a cycle")
        seen.add(ns.id)
    return ns


def _place_gates(nodes: list[CircuitNodes]) -> tuple[dict[int, GatePlacement], int]:
    """``(placement by gated vector id, number of gate columns)``: the vectors with gates of their own get columns
    in topological order; a vector with ``tie_to`` shares its owner's (:func:`_gate_owner`), which must be a gated
    vector of this circuit with the same number of edge blocks, block size and gate block size."""
    placement: dict[int, GatePlacement] = {}
    G = 0
    gated = [ns for ns in nodes if ns.is_sum() and ns.gates is not None]
    for ns in gated:
        if ns.gates.tie_to is None:
            E, gb = ns.edge_ids.shape[1], ns.gates.block_size
            placement[ns.id] = GatePlacement(G, E, ns.block_size // gb, gb)
            G += E * (ns.block_size // gb)
    for ns in gated:
        owner = _gate_owner(ns)
        if owner.id not in placement:
            why = "has no gates" if owner.gates is None else "is not part of this circuit"
            raise ValueError(f"compile: {ns.name} reads the gates of {owner.name}, which {why}")
        pl = placement[owner.id]
        if (ns.edge_ids.shape[1], ns.block_size, ns.gates.block_size) != (pl.num_edge_blocks, owner.block_size,
                                                                         pl.block_size):
            raise ValueError(f"compile: {ns.name} (gate block size {ns.gates.block_size}) cannot read the gates of "
                             f"{owner.name} (gate block size {pl.block_size}): their gate columns differ in shape")
        placement[ns.id] = pl
    return placement, G


def _gate_ids(tab: dict, owners: list, Kp: int, gates: dict[int, GatePlacement], sum_placement, G: int):
    """``gid [n, C, Kp]``, the gate column of each slot's parent rows in one sum partition (``tab``, the vector of
    each block ``owners``): edge block ``e`` of a gated vector, row ``r`` reads column ``start + e * per_block +
    r // block_size``; blocks without gates and padded slots read column ``G`` (a zero log-gate). None when no
    block of the partition has gates."""
    oid = np.asarray([ns.id for ns in owners])
    if not any(i in gates for i in np.unique(oid)):
        return None
    pid, pad = tab["pid"], tab["ch"] == -2  # the main layout's partitions: ch [n, C]
    gid = np.full(pid.shape + (Kp,), G, dtype=np.int64)
    for ns in {ns.id: ns for ns in owners}.values():
        if ns.id in gates:
            pl = gates[ns.id]
            rows = np.nonzero(oid == ns.id)[0]
            e = pid[rows] - sum_placement[ns.source.id].start  # the column of ns.edge_ids
            cols = pl.start + e[:, :, None] * pl.per_block + (np.arange(Kp) // pl.block_size)[None, None, :]
            gid[rows] = np.where(pad[rows][:, :, None], G, cols)
    return gid.astype(np.int32)


def _with_gate_tables(stages: list, stage_tables: list, stage_owners: list, gates: dict[int, GatePlacement],
                      sum_placement, G: int) -> list:
    """The stages with every sum partition that holds a gated block marked ``gated``; their tables (in place) get
    :func:`_gate_ids`."""
    out = []
    for spec, tab, owners in zip(stages, stage_tables, stage_owners):
        sums = list(spec.sums)
        for j, (part, t, own) in enumerate(zip(spec.sums, tab["sums"], owners["sums"])):
            gid = _gate_ids(t, own, part.Kp, gates, sum_placement, G)
            if gid is not None:
                t["gid"] = gid
                sums[j] = dataclasses.replace(part, gated=True)
        out.append(dataclasses.replace(spec, sums=tuple(sums)))
    return out


def _input_layers(nodes: list[CircuitNodes]) -> list[list[InputNodes]]:
    """The input vectors grouped by their distribution's ``layer_key()``, layers and members in first-seen order."""
    layer_of_key: dict[tuple, int] = {}
    layers: list[list[InputNodes]] = []
    for ns in nodes:
        if ns.is_input():
            lk = ns.dist.layer_key()
            if lk not in layer_of_key:
                layer_of_key[lk] = len(layers)
                layers.append([])
            layers[layer_of_key[lk]].append(ns)
    return layers


def _place_inputs(nodes: list[CircuitNodes], first_row: int, block_rows: dict[int, np.ndarray]):
    """Lay the input layers out from buffer row ``first_row`` on, recording each input vector's block rows in
    ``block_rows``. Returns ``(placement by source id, layer specs, layer tables, first row after them)``; a
    layer's key is its distribution's name, suffixed ``_1``, ``_2``, ... when taken."""
    input_placement: dict[int, InputPlacement] = {}
    specs, tables = [], []
    row = first_row
    used_keys: set[str] = set()
    for li, members in enumerate(_input_layers(nodes)):
        name = members[0].dist.name
        key, i = name, 1
        while key in used_keys:
            key = f"{name}_{i}"
            i += 1
        used_keys.add(key)
        spec, tab = _input_layer(li, key, members, row, input_placement, block_rows)
        specs.append(spec)
        tables.append(tab)
        row += spec.num_nodes
    return input_placement, specs, tables, row


def _input_layer(li: int, key: str, members: list[InputNodes], offset: int,
                 input_placement: dict[int, InputPlacement], block_rows: dict[int, np.ndarray]):
    """One input layer (number ``li``) at buffer row ``offset``: its members' nodes in order, each source vector
    given parameter rows on first sight (``input_placement``). Returns ``(spec, tables)``: per node its
    variable, parameter row and position in its vector, and the distribution's per-row ``meta`` tables."""
    row = offset
    prow = 0
    node_vars, node_rows, node_pos, metas = [], [], [], []
    for ns in members:
        src = ns.source
        if src.id not in input_placement:
            input_placement[src.id] = InputPlacement(li, key, prow, src.num_nodes)
            metas.append(src.dist.row_tables(src.num_nodes, src.own_params, src.name))
            prow += src.num_nodes
        pl = input_placement[src.id]
        node_vars.append(np.full(ns.num_nodes, ns.var, dtype=np.int32))
        node_pos.append(np.arange(ns.num_nodes, dtype=np.int32))
        node_rows.append(pl.row_start + np.arange(ns.num_nodes, dtype=np.int32))
        block_rows[ns.id] = row + np.arange(ns.num_node_blocks, dtype=np.int64) * ns.block_size
        row += ns.num_nodes
    meta = {}
    if metas and metas[0]:
        meta = {k: np.concatenate([m[k] for m in metas]) for k in metas[0]}
    vars_, rows_ = np.concatenate(node_vars), np.concatenate(node_rows)
    run = _variable_run(vars_, rows_)
    distinct = run > 1 and np.unique(vars_[::run]).size == vars_.size // run
    spec = InputLayerSpec(key, members[0].dist, offset, row - offset, prow, run, bool(distinct))
    return spec, {"vars": vars_, "rows": rows_, "pos": np.concatenate(node_pos), "meta": meta}


def _var_dists(nodes: list[CircuitNodes]) -> dict[int, list]:
    """The distinct distributions of each variable's input vectors, by variable."""
    var_dists: dict[int, list] = defaultdict(list)
    for ns in nodes:
        if ns.is_input() and ns.dist not in var_dists[ns.var]:
            var_dists[ns.var].append(ns.dist)
    return dict(var_dists)


def _with_chain(layout: Layout, tables: dict, stages: list, stage_tables: list) -> tuple[Layout, dict]:
    """``layout`` and ``tables`` with the chain plan (:func:`detect_chain`) added when the circuit is a chain."""
    chain = detect_chain(layout, stages, stage_tables)
    if chain is None:
        return layout, tables
    return dataclasses.replace(layout, chain=chain[0]), {**tables, "chain": chain[1]}


def _with_fold(layout: Layout, tables: dict, fold) -> tuple[Layout, dict]:
    """``layout`` and ``tables`` with the folded plan (:func:`_build_fold`'s result, or None) added as
    ``layout.fold``, a layout of its own without chain or fold, and ``tables["fold"]``."""
    if fold is None:
        return layout, tables
    f_steps, f_tables, f_root, f_rows, (f_single, f_gaps) = fold
    f_pflows, f_pflow_tables = _pflow_plan(f_steps, f_tables)
    tree = detect_tree(f_steps, f_tables)
    folded = dataclasses.replace(layout, num_rows=f_rows, steps=tuple(f_steps), root_row=f_root, chain=None,
                                 fold=None, pflows=f_pflows, single_reader=f_single, flow_gaps=f_gaps,
                                 tree=None if tree is None else tree[0])
    f_tabs = {"steps": f_tables, "pflows": f_pflow_tables}
    if tree is not None:
        f_tabs["tree"] = tree[1]
    return dataclasses.replace(layout, fold=folded), {**tables, "fold": f_tabs}


def _build_stage(members, row, block_rows, sum_placement, max_exact_fanins, child_rows=None, repeats=None):
    """Partition one level's product and sum vectors; assign their rows; return (spec, tables, next row, owners).
    ``child_rows(ns)``: ``[child blocks, M]`` buffer rows whose values add up to each child block of sum
    vector ``ns`` (default: the children's own rows, ``M = 1``; the folded plan expands products).
    ``repeats``: a :class:`~jaxpc.compiler.repeats.Repeats` whose sum partitions a shifted repeat reuses."""
    offset = row
    prod_groups, sum_items = _stage_members(members, block_rows, sum_placement, child_rows)
    prods, prod_tabs, prod_owners, row = _prod_parts(prod_groups, row, block_rows)
    shift = shift_of(sum_items) if repeats is not None and sum_items else None
    reused = repeats.get(shift, sum_items, row, block_rows) if shift is not None else None
    if reused is None:
        reused = _sum_parts(sum_items, row, block_rows, max_exact_fanins)
        if shift is not None:
            repeats.put(shift, sum_items, row, reused, block_rows)
    sums, sum_tabs, sum_owners, row = reused
    spec = StageSpec(tuple(prods), tuple(sums), offset)
    owners = {"prods": prod_owners, "sums": sum_owners}
    return spec, {"prods": prod_tabs, "sums": sum_tabs, "out": np.int32(offset)}, row, owners


def _stage_members(members, block_rows, sum_placement, child_rows):
    """A level's vectors by partition shape: products by ``(K, arity)``; sums by ``(Kp, Kc, M)`` as
    ``(vector, parent block, child rows [E, M], parameter block)`` per edge, edges sorted by (parent, child)."""
    prod_groups: dict[tuple[int, int], list[ProdNodes]] = defaultdict(list)
    sum_items: dict[tuple[int, int, int], list] = defaultdict(list)
    for ns in members:
        if ns.is_prod():
            prod_groups[(ns.block_size, len(ns.children))].append(ns)
        else:
            pl = sum_placement[ns.source.id]
            if child_rows is None:
                ch_rows = np.concatenate([block_rows[c.id] for c in ns.children])[:, None]
            else:
                ch_rows = child_rows(ns)
            order = np.lexsort((ns.edge_ids[1], ns.edge_ids[0]))
            par = ns.edge_ids[0][order]
            rows_e = ch_rows[ns.edge_ids[1][order]]  # [E, M]
            pids = pl.start + order
            sum_items[(ns.block_size, ns.ch_block_size, ch_rows.shape[1])].append((ns, par, rows_e, pids))
    return prod_groups, sum_items


def _prod_parts(prod_groups, row, block_rows):
    """One product partition per ``(K, arity)``, from buffer row ``row`` on, recording each vector's block rows.
    Returns ``(parts, tables, owners, next row)``; owners: per partition the vector of each block."""
    parts, tabs, owners = [], [], []
    for (K, m) in sorted(prod_groups):
        chs, n, own = [], 0, []
        for ns in prod_groups[(K, m)]:
            cols = [block_rows[c.id][ns.edge_ids[:, j]] for j, c in enumerate(ns.children)]
            chs.append(np.stack(cols, axis=1))
            block_rows[ns.id] = row + (n + np.arange(ns.num_node_blocks)) * K
            n += ns.num_node_blocks
            own += [ns] * ns.num_node_blocks
        owners.append(own)
        parts.append(ProdPart(n, m, K))
        tabs.append({"ch": np.concatenate(chs).astype(np.int32)})
        row += n * K
    return parts, tabs, owners, row


@dataclasses.dataclass(frozen=True)
class _SumEdges:
    """The edges of one stage's sum vectors of one shape, their parent blocks numbered across the vectors
    (``P`` parent blocks, ``E`` edges sorted by parent)."""
    gpar: np.ndarray  # [E] parent block
    rows: np.ndarray  # [E, M] child rows
    pids: np.ndarray  # [E] parameter block
    pos: np.ndarray  # [E] position of the edge among its parent's
    owner: np.ndarray  # [P] the item (vector) of each parent block
    owner_blk: np.ndarray  # [P] its block in that vector
    fanins: np.ndarray  # [P]


def _sum_edges(items) -> _SumEdges:
    nbs = np.asarray([ns.num_node_blocks for ns, *_ in items], dtype=np.int64)
    par_off = np.concatenate([[0], np.cumsum(nbs)[:-1]])
    gpar = np.concatenate([par + o for (_, par, _, _), o in zip(items, par_off)])
    fanins = np.bincount(gpar, minlength=int(nbs.sum()))
    starts = np.concatenate([[0], np.cumsum(fanins)[:-1]])
    return _SumEdges(gpar=gpar, rows=np.concatenate([it[2] for it in items]),
                     pids=np.concatenate([it[3] for it in items]), pos=np.arange(gpar.size) - starts[gpar],
                     owner=np.repeat(np.arange(len(items)), nbs),
                     owner_blk=np.concatenate([np.arange(n) for n in nbs]), fanins=fanins)


def _sum_parts(sum_items, row, block_rows, max_exact_fanins):
    """The sum partitions, from buffer row ``row`` on: per shape ``(Kp, Kc, M)`` one partition per padded fan-in
    (:func:`_fanin_buckets`), recording each vector's block rows. Returns ``(parts, tables, owners, next row)``."""
    parts, tabs, owners = [], [], []
    for (Kp, Kc, M) in sorted(sum_items):
        items = sum_items[(Kp, Kc, M)]
        edges = _sum_edges(items)
        padded = _fanin_buckets(edges.fanins, max_exact_fanins)
        for C in np.unique(padded):
            sel = np.nonzero(padded == C)[0]
            part, tab = _sum_partition(edges, sel, padded[edges.gpar] == C, int(C), Kp, Kc, M)
            for v in np.unique(edges.owner[sel]):
                ns = items[v][0]
                mine = np.nonzero(edges.owner[sel] == v)[0]
                br = block_rows.setdefault(ns.id, np.zeros(ns.num_node_blocks, dtype=np.int64))
                br[edges.owner_blk[sel[mine]]] = row + mine * Kp
            owners.append([items[v][0] for v in edges.owner[sel]])
            parts.append(part)
            tabs.append(tab)
            row += sel.size * Kp
    return parts, tabs, owners, row


def _sum_partition(edges: _SumEdges, sel: np.ndarray, emask: np.ndarray, C: int, Kp: int, Kc: int, M: int):
    """The partition of parent blocks ``sel`` (fan-in padded to ``C``; ``emask``: their edges): ``(SumPart,
    tables)``, the child rows ``ch [n, C]`` (``[n, C, M]`` when ``M > 1``) padded with the -inf row (marked -2)
    plus zero rows, the parameter blocks ``pid [n, C]`` and the :func:`inverse_tables`."""
    local = np.full(edges.fanins.size, -1, dtype=np.int64)
    local[sel] = np.arange(sel.size)
    ch = np.zeros((sel.size, C, M), dtype=np.int64)
    ch[:, :, 0] = -2
    pid = np.zeros((sel.size, C), dtype=np.int64)
    ch[local[edges.gpar[emask]], edges.pos[emask]] = edges.rows[emask]
    pid[local[edges.gpar[emask]], edges.pos[emask]] = edges.pids[emask]
    has_pad = bool(np.any(ch[:, :, 0] == -2))
    dense = (not has_pad) and bool(np.all(ch == ch[:1]))
    if M == 1:
        ch = ch[:, :, 0]
    inv = inverse_tables(ch, pid)
    U, D = inv["par"].shape
    unique_pid = (not has_pad) and np.unique(pid).size == pid.size
    part = SumPart(int(sel.size), C, Kp, Kc, f"{Kp}x{Kc}", dense, U, D, M, bool(unique_pid))
    return part, {"ch": ch, "pid": pid.astype(np.int32), **inv}


def _variable_run(node_vars: np.ndarray, node_rows: np.ndarray) -> int:
    """The run length ``r`` of :attr:`InputLayerSpec.run`: node ``i`` on parameter row ``i`` and every aligned
    run of ``r`` nodes on one variable (the gcd of the lengths of the layer's maximal constant-variable runs);
    1 when rows are tied or shuffled, or the runs are single nodes."""
    n = len(node_vars)
    if n == 0 or not np.array_equal(node_rows, np.arange(n)):
        return 1
    starts = np.flatnonzero(np.diff(node_vars) != 0) + 1
    lengths = np.diff(np.concatenate([[0], starts, [n]]))
    return int(np.gcd.reduce(lengths))


def _build_fold(nodes, root, input_rows: dict, first_row: int, pad_rows: int, sum_placement, max_exact_fanins,
                scan_min_repeats):
    """The folded plan: the same circuit with every product vector folded into the gathers of the sums
    that read it (a sum's child block becomes the rows of the product's children, which the gather adds
    up), so the buffer holds input and sum rows only and every stage is a sum stage; its sum rows start at
    ``first_row``, the padding's ``pad_rows`` rows come before the inputs. Returns ``(steps, step tables, root
    row, num rows, (single reader, flow gaps))`` (:func:`_single_reader`, counting the input rows too: two
    partitions may read one input through their folded products), or None when the circuit has no products or
    its root is one."""
    if not root.is_sum() or not any(ns.is_prod() for ns in nodes):
        return None
    rows: dict[int, np.ndarray] = dict(input_rows)
    expanded: dict[int, np.ndarray] = {}

    def expand(ns) -> np.ndarray:
        """``[blocks, M]`` rows adding up to each block of ``ns`` (M = 1 for sums and inputs)."""
        if ns.id not in expanded:
            if not ns.is_prod():
                expanded[ns.id] = rows[ns.id][:, None]
            else:
                expanded[ns.id] = np.concatenate([expand(c)[ns.edge_ids[:, j]] for j, c in enumerate(ns.children)],
                                                 axis=1)
        return expanded[ns.id]

    def child_rows(ns, M: int) -> np.ndarray:
        # zero rows (0 .. Kmax) pad the shorter expansions: adding zeros leaves the log-value unchanged
        return _pad_columns([expand(c) for c in ns.children], M)

    level: dict[int, int] = {}
    for ns in nodes:
        if ns.is_input():
            level[ns.id] = 0
        elif ns.is_prod():
            level[ns.id] = max(level[c.id] for c in ns.children)
        else:
            level[ns.id] = 1 + max(level[c.id] for c in ns.children)
    by_level: dict[int, list] = defaultdict(list)
    for ns in nodes:
        if ns.is_sum():
            by_level[level[ns.id]].append(ns)
    stages, tabs = [], []
    row = first_row
    repeats = Repeats()
    for lv in sorted(by_level):
        # one term count per level, so products of different arity do not split a level into more partitions
        M = max(expand(c).shape[1] for ns in by_level[lv] for c in ns.children)
        spec, tab, row, _ = _build_stage(by_level[lv], row, rows, sum_placement, max_exact_fanins,
                                         lambda ns, M=M: child_rows(ns, M), repeats)
        stages.append(spec)
        tabs.append(tab)
    root_row = int(rows[root.id][0])
    group_blocks: dict[str, int] = {}
    for pl in sum_placement.values():
        group_blocks[pl.group] = max(group_blocks.get(pl.group, 0), pl.start + pl.num_edge_blocks)
    stages, tabs, row, root_row = even_levels(stages, tabs, row, root_row, group_blocks, scan_min_repeats,
                                               inverse_tables)
    steps, step_tables = group_scans(stages, tabs, scan_min_repeats)
    return steps, step_tables, root_row, row, _single_reader(stages, tabs, pad_rows, row, root_row)


def _pad_columns(parts: list[np.ndarray], M: int) -> np.ndarray:
    """``parts`` (``[n_i, m_i]``, ``m_i <= M``) one under the other in ``[sum n_i, M]``, zeros right of each."""
    out = np.zeros((sum(p.shape[0] for p in parts), M), np.result_type(*parts))
    r = 0
    for p in parts:
        out[r:r + p.shape[0], :p.shape[1]] = p
        r += p.shape[0]
    return out


def _read_blocks(stages, stage_tables, first_row: int) -> tuple[np.ndarray, np.ndarray]:
    """The row blocks the stages read above ``first_row`` (the padding): ``(starts, sizes)`` sorted by start, a
    folded child's ``M`` row blocks counted each."""
    starts, sizes = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for spec, tab in zip(stages, stage_tables):
        parts = [(p.K, t["ch"]) for p, t in zip(spec.prods, tab["prods"])]
        parts += [(p.Kc, t["ch"]) for p, t in zip(spec.sums, tab["sums"])]
        for K, ch in parts:
            s = np.asarray(ch).reshape(-1)
            s = s[s >= first_row]
            starts.append(s.astype(np.int64))
            sizes.append(np.full(s.size, K, np.int64))
    starts, sizes = np.concatenate(starts), np.concatenate(sizes)
    order = np.argsort(starts, kind="stable")
    return starts[order], sizes[order]


def _single_reader(stages, stage_tables, first_row: int, num_rows: int, root_row: int) -> tuple[bool, tuple | None]:
    """``(single reader, flow gaps)``. Single reader: every buffer row from ``first_row`` on (above the padding)
    is read by at most one block of one partition, counting each of a folded child's ``M`` row blocks
    (``Layout.single_reader``): a tree such as an HCLT, not a DAG such as a PD, whose nodes have several parents,
    nor a dense partition of several blocks. The row blocks read, sorted by first row, must not overlap. Flow
    gaps (``Layout.flow_gaps``, single reader only, else None): the ``(start, stop)`` row ranges that no block
    reads (the padding rows, a block's padded nodes, nodes without a parent) but the root's row."""
    starts, sizes = _read_blocks(stages, stage_tables, first_row)
    if not np.all(starts[1:] >= starts[:-1] + sizes[:-1]):
        return False, None
    edge = np.zeros(num_rows + 1, np.int64)  # +1 where a read block starts, -1 after it ends
    np.add.at(edge, starts, 1)
    np.add.at(edge, np.minimum(starts + sizes, num_rows), -1)
    covered = np.cumsum(edge[:-1]) > 0
    covered[root_row] = True
    change = np.flatnonzero(np.diff(np.concatenate([[True], covered, [True]]).astype(np.int8)))
    return True, tuple((int(a), int(b)) for a, b in zip(change[::2], change[1::2]))


def _pflow_plan(steps, step_tables) -> tuple[tuple[PFlowSpec, ...], list[dict]]:
    """The batched parameter-flow pass's tables (:class:`PFlowSpec`): the sum partitions gathered block by block
    (``SumPart.blockwise``), by (group, fan-in), every scanned repeat included, blocks sorted by parameter id."""
    acc: dict[tuple, dict] = {}
    for step, tab in zip(steps, step_tables):
        scanned = isinstance(step, ScanSpec)
        for j, spec in enumerate(step.period if scanned else (step,)):
            t = tab[j] if scanned else tab
            row = sum(p.num_rows for p in spec.prods)
            for part, pt in zip(spec.sums, t["sums"]):
                if part.blockwise:
                    a = acc.setdefault(part.pflow_key, {"prow": [], "ch": [], "pid": [], "part": []})
                    local = row + np.arange(part.n, dtype=np.int64) * part.Kp
                    prow = (np.atleast_1d(t["out"]).astype(np.int64)[:, None] + local).reshape(-1)
                    ch = pt["ch"].reshape((-1,) + pt["ch"].shape[(2 if scanned else 1):])
                    real = ~is_padding(ch)  # an evened level's padding blocks have no flows
                    a["prow"].append(prow[real])
                    a["part"].append(np.full(int(real.sum()), len(a["part"]), np.int32))
                    a["ch"].append((ch if ch.ndim == 3 else ch[:, :, None])[real])
                    a["pid"].append(pt["pid"].reshape(-1, part.C)[real])
                row += part.num_rows
    specs, tabs = [], []
    for (group, C, Kp, Kc), a in acc.items():
        M = max(c.shape[2] for c in a["ch"])
        # shorter products padded with row 0: the zero rows, which leave a sum of log-values unchanged
        ch = np.concatenate([np.pad(c, ((0, 0), (0, 0), (0, M - c.shape[2]))) for c in a["ch"]])
        pid = np.concatenate(a["pid"])
        order = np.argsort(pid[:, 0], kind="stable")
        ch, pid = ch[order], pid[order]
        prow, member = np.concatenate(a["prow"])[order], np.concatenate(a["part"])[order]
        flat = pid.reshape(-1)
        start = int(flat[0]) if np.array_equal(flat, flat[0] + np.arange(flat.size)) else -1
        unique = np.unique(flat).size == flat.size
        specs.append(PFlowSpec(group, C, Kp, Kc, M, int(pid.shape[0]), start, bool(unique)))
        tabs.append({"prow": prow.astype(np.int32), "ch": ch if M > 1 else ch[:, :, 0], "pid": pid.astype(np.int32),
                     "part": member})
    return tuple(specs), tabs


def inverse_tables(ch: np.ndarray, pid: np.ndarray) -> dict:
    """For each distinct child row block of a partition: its parents (local block index) and the parameter
    block of each edge, padded with -1 (``uch [U]``, ``par [U, D]``, ``ppid [U, D]``). For a folded table
    ``ch [n, C, M]`` every row block of a folded product is listed (the zero padding rows are not), and
    ``pcol [U, D]`` gives the child position under each parent. ``eorder [n * C]``: the edge blocks ``i * C + c``
    ordered by their child (its row blocks, padding last), then by parent: the atomic backward runs its programs in
    this order where ``Tuning.fanin_order_batch`` asks for it: the parents that share a child run together and read
    and add to it while it is in L2."""
    folded = ch.ndim == 3
    ch3 = ch if folded else ch[:, :, None]
    real = ch3 != -2  # -2 marks padding (the -inf rows)
    if folded:
        real &= ch3 != 0  # row 0: the zero rows that pad shorter products
    rr, cc, _ = np.nonzero(real)
    uniq, inv = np.unique(ch3[real], return_inverse=True)
    order = np.argsort(inv, kind="stable")
    inv_s = inv[order]
    deg = np.bincount(inv_s, minlength=uniq.size)
    starts = np.concatenate([[0], np.cumsum(deg)[:-1]])
    pos = np.arange(inv_s.size) - starts[inv_s]
    D = int(deg.max())
    par = np.full((uniq.size, D), -1, np.int32)
    ppid = np.full((uniq.size, D), -1, np.int32)
    par[inv_s, pos] = rr[order]
    ppid[inv_s, pos] = pid[rr[order], cc[order]]
    out = {"uch": uniq.astype(np.int32), "par": par, "ppid": ppid, "eorder": child_order(ch3)}
    if folded:
        pcol = np.full((uniq.size, D), -1, np.int32)
        pcol[inv_s, pos] = cc[order]
        out["pcol"] = pcol
    return out


def child_order(ch3: np.ndarray) -> np.ndarray:
    """``eorder`` of :func:`inverse_tables` for ``ch [n, C, M]`` (padding, -2, sorts last)."""
    n, C, M = ch3.shape
    key = np.where(ch3 == -2, np.iinfo(np.int64).max, ch3.astype(np.int64)).reshape(n * C, M)
    parent = np.repeat(np.arange(n), C)
    return np.lexsort((parent, *(key[:, m] for m in reversed(range(M))))).astype(np.int32)


def group_scans(stages, stage_tables, min_repeats):
    """Fold runs of stages whose shapes repeat with a period of 1 to 4 into ScanSpecs."""
    sigs = [s.signature for s in stages]
    steps, tabs = [], []
    i, S = 0, len(stages)
    while i < S:
        best = None
        if min_repeats:
            for p in (1, 2, 3, 4):
                k = 0
                while i + (k + 1) * p <= S and all(sigs[i + k * p + j] == sigs[i + j] for j in range(p)):
                    k += 1
                if k >= min_repeats and (best is None or k * p > best[0] * best[1]):
                    best = (p, k)
        if best is None:
            steps.append(stages[i])
            tabs.append(stage_tables[i])
            i += 1
            continue
        p, k = best
        period = tuple(stages[i:i + p])
        stacked = []
        for j in range(p):
            group = [stage_tables[i + r * p + j] for r in range(k)]
            stacked.append(_stack_tables(group))
        offsets = tuple(tuple(int(stage_tables[i + r * p + j]["out"]) for j in range(p)) for r in range(k))
        steps.append(ScanSpec(period, k, offsets))
        tabs.append(stacked)
        i += p * k
    return steps, tabs


def _stack_tables(group):
    """Stack the tables of stages with identical shapes along a new leading (scan) axis."""
    first = group[0]
    out = {kind: [{k: np.stack([g[kind][q][k] for g in group]) for k in first[kind][q]}
                  for q in range(len(first[kind]))] for kind in ("prods", "sums")}
    out["out"] = np.asarray([g["out"] for g in group], dtype=np.int32)
    return out


def shared_kernel_tables(tables: dict, layout: Layout) -> dict:
    """``tables`` with the sum partitions of one kernel class padded to one shape, so that the class traces, lowers
    and compiles one forward and one atomic-backward kernel instead of one per partition. A class: the fan-in
    partitions (several child blocks, not dense) of one plan's unscanned stages with the same parameter group, fold
    depth and block shape (PD-128's folded plan: eleven partitions of fan-ins 4 to 16 and 16 to 464 parent blocks).
    Where a class has partitions of different shapes, each member gets ``kch`` / ``kpid``, its ``ch`` / ``pid``
    padded to the class's largest block count and fan-in (that rounded up to a multiple of :data:`FANIN_MULTIPLE`;
    by repeating its last block and child), and ``keorder``,
    its ``eorder`` in the padded tables' edge-block numbering with the padding's edge blocks last. The kernels take
    the member's real block count and fan-in (``blocks`` and ``fanin`` of :func:`jaxpc.ops.pallas_sum.forward` and
    :func:`jaxpc.ops.pallas_sum.backward_atomic`): the programs of padding blocks return at once, and the forward
    reads its fan-in at run time. Other routes read ``ch`` and ``pid``."""
    out = {**tables, "steps": _shared_steps(layout.steps, tables["steps"])}
    if layout.fold is not None and "fold" in tables:
        out["fold"] = {**tables["fold"], "steps": _shared_steps(layout.fold.steps, tables["fold"]["steps"])}
    return out


FANIN_MULTIPLE = 4  # padded fan-ins are multiples of Tuning.fanin_group's default: a grouped backward stays grouped


def _shared_steps(steps, step_tables) -> list:
    classes: dict[tuple, list] = defaultdict(list)
    for s, step in enumerate(steps):
        if isinstance(step, ScanSpec):
            continue
        for j, part in enumerate(step.sums):
            if part.C > 1 and not part.dense:
                classes[(part.group, part.M, part.Kp, part.Kc)].append((s, j, part.n, part.C))
    out = list(step_tables)
    for members in classes.values():
        if len({(k, c) for _, _, k, c in members}) < 2:
            continue
        n, C = max(k for _, _, k, _ in members), -(-max(c for *_, c in members) // FANIN_MULTIPLE) * FANIN_MULTIPLE
        for s, j, k, c in members:
            t = out[s]["sums"][j]
            ch = t["ch"]
            pad = ((0, n - k), (0, C - c)) + ((0, 0),) * (ch.ndim - 2)
            padded = {"kch": np.pad(ch, pad, mode="edge"), "kpid": np.pad(t["pid"], pad[:2], mode="edge")}
            if "eorder" in t:
                e = t["eorder"].astype(np.int64)
                real = (e // c) * C + e % c
                idle = np.ones(n * C, bool)
                idle[real] = False
                padded["keorder"] = np.concatenate([real, np.flatnonzero(idle)]).astype(t["eorder"].dtype)
            sums = list(out[s]["sums"])
            sums[j] = {**t, **padded}
            out[s] = {**out[s], "sums": sums}
    return out


def finalize_tables(tables: dict, layout: Layout) -> dict:
    """Replace padding markers (-2) by the first ``-inf`` row and cast everything to int32."""

    def fix(t):
        out = {}
        for k, v in t.items():
            if isinstance(v, dict):
                out[k] = fix(v)
            elif isinstance(v, list):
                out[k] = [fix(x) if isinstance(x, dict) else x for x in v]
            elif k == "ch":
                a = np.where(v == -2, layout.ninf_row, v)
                out[k] = a.astype(np.int32)
            else:
                out[k] = v
        return out

    def steps(st):
        return [fix(s) if isinstance(s, dict) else [fix(x) for x in s] for s in st]

    out = dict(tables)
    out["steps"] = steps(tables["steps"])
    out["pflows"] = [fix(t) for t in tables.get("pflows", [])]
    if "fold" in tables:
        out["fold"] = {"steps": steps(tables["fold"]["steps"]),
                       "pflows": [fix(t) for t in tables["fold"].get("pflows", [])]}
        if "tree" in tables["fold"]:
            out["fold"]["tree"] = fix(tables["fold"]["tree"])
    return out
