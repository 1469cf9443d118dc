"""Collapse vectors over one scope into one vector (:func:`merge`), same function."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..nodes import CircuitNodes, InputNodes, SumNodes, multiply, summate
from ..nodes.nodes import scope_str
from ._graph import check_root, indicator_concat_ok, levels, tie_groups
from ._params import Builder, Params, check_gate_target, set_input_params, set_sum_params

# A unit of the merged graph: ("v", old id) for a vector kept as is, ("g", group index) for a merged group.
_Unit = tuple[str, int]


def merge(root: CircuitNodes, groups=None, *, circuit=None, params=None) -> CircuitNodes:
    """Collapse groups of vectors over one scope into single vectors (nodes concatenated in group
    order); the parents' edges are remapped, so the function is unchanged.

    * sums: same scope and block sizes; the merged sum's children are the union of the members'
      children (first-appearance order) and its weights the members' weights.
    * products: same children scopes; at every scope, all members must read the same vector after
      merging (merge the children first, e.g. in the same call).
    * inputs: same variable, distribution and block size; parameters concatenated.

    Merged vectors own their parameters (a tied member keeps its values but no longer shares them).

    Sum gates are kept: the merged vector's gate columns are its members' in group order, so the
    members need the same gates (none, or one gate block size with columns of their own, or reading with
    ``tie_to`` the vectors of one other merged vector at the same edge blocks); other gates, or a vector
    reading the gates of a vector merged with others, raise a ``ValueError`` naming them.

    Args:
        root: the root vector.
        groups: a list of groups (lists of at least two vectors of the graph). Default: merge every
            set of untied, non-root vectors with one kind, scope, block size(s), gate block size and
            level (the compiler's topological level; products also need the same children up to
            merging), as PyJuice merges by region; sums with gate ties are left as they are.
        circuit, params: take parameters from a compiled circuit (see :mod:`jaxpc.edit`).

    Returns:
        the new root.
    """
    fn = "merge"
    nodes = check_root(root, fn)
    reader = Params(fn, circuit, params)
    level = levels(nodes)
    if groups is None:
        groups = _auto_merge_groups(nodes, root, level, reader)
    else:
        in_graph = {ns.id for ns in nodes}
        if isinstance(groups, (CircuitNodes, str, bytes)) or not isinstance(groups, Sequence):
            raise ValueError(f"{fn}: groups must be a list of lists of node vectors")
        groups = [_check_merge_group(g, fn, in_graph, root) for g in groups]
    members_of = _units(nodes, groups, fn)
    order = _merged_order(nodes, members_of, fn)
    return _build_merged(order, members_of, reader, fn)[root.id][0]


# ----------------------------------------------------------------------------------------------
# the groups
# ----------------------------------------------------------------------------------------------

def _merge_signature(ns: CircuitNodes, rep: Callable[[CircuitNodes], Any], level: int, reader: Params):
    # vectors with and without parameters cannot share one vector: keep them apart
    has = ns.is_prod() or reader.circuit is not None or ns.source.own_params is not None
    if ns.is_input():
        fields = tuple(sorted(ns.source.own_params)) if has and reader.circuit is None else has
        return ("input", ns.var, ns.dist, ns.block_size, fields)
    if ns.is_sum():
        gates = None if ns.gates is None else ns.gates.block_size
        return ("sum", ns.scope, ns.block_size, ns.ch_block_size, level, has, gates)
    by_scope = sorted((c.scope, rep(c)) for c in ns.children)
    return ("prod", ns.scope, ns.block_size, level, tuple(by_scope))


def _auto_merge_groups(nodes, root, level, reader: Params) -> list[list[CircuitNodes]]:
    """Vectors with one signature (kind, scope, block sizes, level; products: also the same children up
    to merging), except the root and tied vectors."""
    tie_size = {k: len(v) for k, v in tie_groups(nodes).items()}
    gate_tied = set()
    for ns in nodes:
        if ns.is_sum() and ns.gates is not None and ns.gates.tie_to is not None:
            gate_tied.update((ns.id, ns.gates.tie_to.id))
    group_of: dict[int, int] = {}

    def rep(c):
        return ("g", group_of[c.id]) if c.id in group_of else ("v", c.id)

    groups: list[list[CircuitNodes]] = []

    def collect(cands):
        by_sig: dict[Any, list[CircuitNodes]] = defaultdict(list)
        for ns in cands:
            by_sig[_merge_signature(ns, rep, level[ns.id], reader)].append(ns)
        for members in by_sig.values():
            if len(members) > 1:
                for ns in members:
                    group_of[ns.id] = len(groups)
                groups.append(members)

    def eligible(ns):
        if ns is root:
            return False
        if ns.is_input() and not indicator_concat_ok(ns):
            return False
        return ns.is_prod() or (not ns.is_tied() and tie_size.get(ns.id, 1) == 1 and ns.id not in gate_tied)

    collect([ns for ns in nodes if not ns.is_prod() and eligible(ns)])
    prods = sorted((ns for ns in nodes if ns.is_prod() and eligible(ns)), key=lambda ns: level[ns.id])
    for lv in sorted({level[p.id] for p in prods}):  # children's groups are final before their parents'
        collect([p for p in prods if level[p.id] == lv])
    return groups


def _check_merge_group(group, fn: str, in_graph: set[int], root) -> list[CircuitNodes]:
    if isinstance(group, (CircuitNodes, str, bytes)) or not isinstance(group, Sequence):
        raise ValueError(f"{fn}: groups must be a list of lists of node vectors, got {type(group).__name__}")
    members = list(group)
    if len(members) < 2:
        raise ValueError(f"{fn}: every group needs at least two vectors, got {len(members)}")
    for ns in members:
        if not isinstance(ns, CircuitNodes):
            raise TypeError(f"{fn}: groups must hold node vectors, got {type(ns).__name__}")
        if ns.id not in in_graph:
            raise ValueError(f"{fn}: {ns.name} is not reachable from the root")
        if ns is root:
            raise ValueError(f"{fn}: the root ({root.name}) cannot be merged (it must stay a single node)")
    _check_mergeable(members, fn)
    return members


def _check_mergeable(members: list[CircuitNodes], fn: str) -> None:
    """Every member has the first's kind, scope, block sizes, distribution and children's scopes."""
    first = members[0]
    for ns in members[1:]:
        if ns.kind != first.kind:
            raise ValueError(f"{fn}: cannot merge {first.name} ({first.kind}) with {ns.name} ({ns.kind})")
        if ns.scope != first.scope:
            raise ValueError(f"{fn}: cannot merge {first.name} (scope {scope_str(first.scope)}) with {ns.name} "
                             f"(scope {scope_str(ns.scope)}): merged vectors need one scope")
        if ns.block_size != first.block_size:
            raise ValueError(f"{fn}: cannot merge {first.name} (block_size={first.block_size}) with {ns.name} "
                             f"(block_size={ns.block_size}); unblockify first")
        if ns.is_input() and ns.dist != first.dist:
            raise ValueError(f"{fn}: cannot merge {first.name} ({first.dist!r}) with {ns.name} ({ns.dist!r})")
    for ns in members[:-1]:
        if ns.is_input() and not indicator_concat_ok(ns):
            raise ValueError(f"{fn}: cannot merge {ns.name}: it has {ns.num_nodes} Indicator nodes, not a multiple of "
                             f"num_states={ns.dist.num_states}, so the nodes after it would indicate other values")
    for ns in members[1:]:
        if ns.is_sum() and ns.ch_block_size != first.ch_block_size:
            raise ValueError(f"{fn}: cannot merge {first.name} (children's block_size={first.ch_block_size}) with "
                             f"{ns.name} (children's block_size={ns.ch_block_size})")
        if ns.is_prod() and sorted(c.scope for c in ns.children) != sorted(c.scope for c in first.children):
            raise ValueError(f"{fn}: cannot merge products {first.name} and {ns.name}: their children's scopes "
                             f"differ")


# ----------------------------------------------------------------------------------------------
# the merged graph's units and their order
# ----------------------------------------------------------------------------------------------

def _units(nodes: Sequence[CircuitNodes], groups: list[list[CircuitNodes]],
           fn: str) -> dict[_Unit, list[CircuitNodes]]:
    """``{unit: its old vectors}`` (a group's in the given order, the order of concatenation); a vector
    in two groups is a ``ValueError``."""
    unit: dict[int, _Unit] = {ns.id: ("v", ns.id) for ns in nodes}
    for gi, members in enumerate(groups):
        for ns in members:
            if unit[ns.id][0] == "g":
                raise ValueError(f"{fn}: {ns.name} appears more than once in groups")
            unit[ns.id] = ("g", gi)
    members_of: dict[_Unit, list[CircuitNodes]] = defaultdict(list)
    for ns in nodes:
        if unit[ns.id][0] == "v":
            members_of[unit[ns.id]].append(ns)
    for gi, members in enumerate(groups):
        members_of[("g", gi)] = list(members)
    return members_of


def _merged_order(nodes: Sequence[CircuitNodes], members_of: dict[_Unit, list[CircuitNodes]],
                  fn: str) -> list[_Unit]:
    """A topological order of the merged graph (Kahn); merges that would create a cycle raise."""
    unit = {ns.id: u for u, members in members_of.items() for ns in members}
    deps: dict[_Unit, set] = {u: set() for u in members_of}
    users: dict[_Unit, set] = defaultdict(set)
    for ns in nodes:
        u = unit[ns.id]
        for c in ns.children:
            cu = unit[c.id]
            if cu == u:
                raise ValueError(f"{fn}: cannot merge {ns.name} with its descendant {c.name}")
            deps[u].add(cu)
            users[cu].add(u)
    pos = {ns.id: i for i, ns in enumerate(nodes)}
    ready = sorted((u for u, d in deps.items() if not d), key=lambda u: pos[members_of[u][0].id])
    order = []
    missing = {u: len(d) for u, d in deps.items()}
    while ready:
        u = ready.pop()
        order.append(u)
        for p in users[u]:
            missing[p] -= 1
            if missing[p] == 0:
                ready.append(p)
    if len(order) != len(members_of):
        stuck = [members_of[u][0].name for u in members_of if missing[u] > 0][:4]
        raise ValueError(f"{fn}: these groups would create a cycle (one member is an ancestor of another's "
                         f"child); involved: {', '.join(stuck)}")
    return order


# ----------------------------------------------------------------------------------------------
# the new vectors
# ----------------------------------------------------------------------------------------------

# {old id: (new vector, block offset of the old vector's nodes in it)}
_Placed = dict[int, tuple[CircuitNodes, int]]


def _build_merged(order: list[_Unit], members_of: dict[_Unit, list[CircuitNodes]], reader: Params, fn: str) -> _Placed:
    b = Builder(fn)
    new: _Placed = {}
    for u in order:
        members = members_of[u]
        if u[0] == "v":
            new[members[0].id] = (_copy_vector(members[0], new, b, reader), 0)
            continue
        offsets = np.concatenate([[0], np.cumsum([m.num_node_blocks for m in members])])
        name = f"{members[0].name}+{len(members) - 1}"
        if members[0].is_input():
            out = _merged_input(members, int(offsets[-1]), name, reader, fn)
        elif members[0].is_sum():
            out = _merged_sum(members, offsets, name, new, reader, fn)
        else:
            out = _merged_prod(members, name, new, fn)
        for m, o in zip(members, offsets):
            new[m.id] = (out, int(o))
    _set_merged_gates(members_of, new, fn)
    return new


def _gates_str(ns: SumNodes) -> str:
    if ns.gates is None:
        return "no gates"
    tie = "" if ns.gates.tie_to is None else f" read from {ns.gates.tie_to.name}"
    return f"gates of block size {ns.gates.block_size}{tie}"


def _set_merged_gates(members_of: dict[_Unit, list[CircuitNodes]], new: _Placed, fn: str) -> None:
    """Give every new sum the gates of the old sums it holds (checked alike, see :func:`merge`); set once
    every vector exists, since a ``tie_to`` may point at a later one."""
    in_graph = set(new)
    edge_off: dict[int, int] = {}  # old sum id: offset of its edge blocks in its new vector
    for members in members_of.values():
        if members[0].is_sum():
            offs = np.cumsum([0] + [m.edge_ids.shape[1] for m in members])
            edge_off.update((m.id, int(o)) for m, o in zip(members, offs))
    for members in members_of.values():
        first = members[0]
        if not first.is_sum() or all(m.gates is None for m in members):
            continue
        for m in members[1:]:
            if (first.gates is None or m.gates is None or first.gates.block_size != m.gates.block_size
                    or (first.gates.tie_to is None) != (m.gates.tie_to is None)):
                raise ValueError(f"{fn}: cannot merge {first.name} ({_gates_str(first)}) with {m.name} "
                                 f"({_gates_str(m)}): merged sums need the same gates")
        out = new[first.id][0]
        target = None
        for m in members if first.gates.tie_to is not None else ():
            tie = m.gates.tie_to
            check_gate_target(m, tie, in_graph, fn)
            t_out, _ = new[tie.id]
            if t_out is out:
                raise ValueError(f"{fn}: {m.name} reads the gates of {tie.name}, and both would become {out.name}; "
                                 f"a vector cannot read its own gates")
            E, Et = m.edge_ids.shape[1], tie.edge_ids.shape[1]
            if ((target is not None and t_out is not target) or edge_off[m.id] != edge_off[tie.id]
                    or t_out.edge_ids.shape[1] != out.edge_ids.shape[1]):
                raise ValueError(
                    f"{fn}: {m.name} reads the gates of {tie.name}, but merged its edge blocks would be "
                    f"{edge_off[m.id]}..{edge_off[m.id] + E - 1} of {out.name} ({out.edge_ids.shape[1]} edge blocks) "
                    f"and {tie.name}'s {edge_off[tie.id]}..{edge_off[tie.id] + Et - 1} of {t_out.name} "
                    f"({t_out.edge_ids.shape[1]}); merge the vectors whose gates they read alike, in the same order")
            target = t_out
        out.set_gates(first.gates.block_size, tie_to=target)


def _sum_children(old_sums: list[CircuitNodes], new: _Placed):
    """New children (deduplicated) and the new child block of every edge of every old sum."""
    chs, start, mapped = [], {}, []
    for s in old_sums:
        idx = []
        for c in s.children:
            nc, off = new[c.id]
            if nc.id not in start:
                start[nc.id] = sum(x.num_node_blocks for x in chs)
                chs.append(nc)
            idx.append(start[nc.id] + off + np.arange(c.num_node_blocks))
        mapped.append(np.concatenate(idx)[s.edge_ids[1]])
    return chs, mapped


def _copy_vector(ns: CircuitNodes, new: _Placed, b: Builder, reader: Params) -> CircuitNodes:
    """A vector outside every group, over its children's new vectors."""
    if ns.is_input():
        return b.input(ns, ns.var, ns.num_node_blocks, ns.block_size, lambda: reader.input_natural(ns))
    if ns.is_prod():
        chs = [new[c.id][0] for c in ns.children]
        e = ns.edge_ids + np.asarray([new[c.id][1] for c in ns.children])[None, :]
        return multiply(*chs, edge_ids=e, name=ns.name)
    chs, (e1,) = _sum_children([ns], new)
    return b.sum(ns, chs, ns.num_node_blocks, ns.block_size, np.stack([ns.edge_ids[0], e1]),
                 lambda: reader.sum_blocks(ns))


def _merged_input(members: list[CircuitNodes], num_node_blocks: int, name: str, reader: Params,
                  fn: str) -> InputNodes:
    first = members[0]
    nats = [reader.input_natural(m) for m in members]
    out = InputNodes(first.var, num_node_blocks, first.block_size, first.dist, name=name)
    set_input_params(out, _concat_params(nats, members, fn, "input"))
    return out


def _merged_sum(members: list[CircuitNodes], offsets: np.ndarray, name: str, new: _Placed, reader: Params,
                fn: str) -> CircuitNodes:
    chs, mapped = _sum_children(members, new)
    edges = np.concatenate([np.stack([m.edge_ids[0] + o, e1]) for m, o, e1 in zip(members, offsets, mapped)],
                           axis=1)
    out = summate(*chs, num_node_blocks=int(offsets[-1]), block_size=members[0].block_size, edge_ids=edges,
                  name=name)
    blocks = _concat_params([reader.sum_blocks(m) for m in members], members, fn, "sum")
    if blocks is not None:
        set_sum_params(out, blocks)
    return out


def _merged_prod(members: list[CircuitNodes], name: str, new: _Placed, fn: str) -> CircuitNodes:
    scopes = [c.scope for c in members[0].children]
    chs, rows = [], []
    for sc in scopes:
        picks = [next(c for c in m.children if c.scope == sc) for m in members]
        nvs = {new[c.id][0].id for c in picks}
        if len(nvs) > 1:
            raise ValueError(f"{fn}: cannot merge products {', '.join(m.name for m in members[:4])}: at "
                             f"scope {scope_str(sc)} they read different vectors "
                             f"({', '.join(c.name for c in picks[:4])}); merge those too")
        chs.append(new[picks[0].id][0])
    for m in members:
        cols = []
        for sc in scopes:
            j = next(i for i, c in enumerate(m.children) if c.scope == sc)
            cols.append(m.edge_ids[:, j] + new[m.children[j].id][1])
        rows.append(np.stack(cols, axis=1))
    return multiply(*chs, edge_ids=np.concatenate(rows), name=name)


def _concat_params(parts, members, fn, kind):
    have = [p is not None for p in parts]
    if not any(have):
        return None
    if not all(have):
        a = members[have.index(True)].name
        bname = members[have.index(False)].name
        raise ValueError(f"{fn}: {a} has parameters but {bname} has none; pass circuit= (and params=) to merge "
                         f"the compiled parameters")
    if kind == "sum":
        return np.concatenate(parts)
    keys = set(parts[0])
    for p, m in zip(parts, members):
        if set(p) != keys:
            raise ValueError(f"{fn}: {members[0].name} and {m.name} carry different parameter fields "
                             f"({sorted(keys)} vs {sorted(p)}); pass circuit= to merge the compiled parameters")
    return {k: np.concatenate([p[k] for p in parts]) for k in keys}
