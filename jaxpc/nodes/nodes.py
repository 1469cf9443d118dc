"""Symbolic circuit nodes.

A node object is a *vector* of ``num_node_blocks * block_size`` nodes that share one
scope and one edge pattern at block granularity, as in PyJuice:

* ``InputNodes``: leaves over one variable with a distribution from :mod:`jaxpc.distributions`.
* ``ProdNodes``: product block ``p`` multiplies block ``edge_ids[p, j]`` of child ``j``
  element-wise (node ``k`` of the block with node ``k`` of each child block).
* ``SumNodes``: every column ``[i, j]`` of ``edge_ids`` (shape ``[2, num_edges]``)
  fully connects parent block ``i`` with child block ``j``, where child blocks are
  numbered over the concatenation of all children.

Scopes are Python ints used as bitsets, so unions and disjointness checks stay cheap
on circuits over tens of thousands of variables. Smoothness (sum children share a
scope) and decomposability (product children have disjoint scopes) are checked when a
node is built; the error names the offending nodes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "CircuitNodes",
    "InputNodes",
    "ProdNodes",
    "SumNodes",
    "Gates",
    "inputs",
    "multiply",
    "summate",
    "duplicate",
    "scope_vars",
]

_ids = itertools.count()


def scope_vars(scope: int) -> list[int]:
    """The variable ids in a bitset scope, ascending."""
    out = []
    v = 0
    while scope:
        low = scope & -scope
        v = low.bit_length() - 1
        out.append(v)
        scope ^= low
    return out


def scope_str(scope: int, limit: int = 6) -> str:
    vs = scope_vars(scope)
    if len(vs) <= limit:
        return "{" + ", ".join(map(str, vs)) + "}"
    return "{" + ", ".join(map(str, vs[:limit])) + f", ... ({len(vs)} vars)" + "}"


def _as_int_array(a: Any, what: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.dtype == bool:
        raise TypeError(f"{what} must hold integer block ids, got a boolean array")
    if not np.issubdtype(arr.dtype, np.integer):
        if np.issubdtype(arr.dtype, np.floating) and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise TypeError(f"{what} must hold integer block ids, got dtype {arr.dtype}")
    return arr.astype(np.int64)


def _resolve_sizes(kind: str, num_node_blocks: int, num_nodes: int, block_size: int) -> tuple[int, int]:
    for name, val in (("num_node_blocks", num_node_blocks), ("num_nodes", num_nodes), ("block_size", block_size)):
        if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val < 0:
            raise ValueError(f"{kind}: {name} must be a non-negative int, got {val!r}")
    if num_nodes and num_node_blocks:
        raise ValueError(f"{kind}: give num_node_blocks or num_nodes, not both "
                         f"(got num_node_blocks={num_node_blocks}, num_nodes={num_nodes})")
    block_size = int(block_size) if block_size else 1
    if num_nodes:
        if num_nodes % block_size:
            raise ValueError(f"{kind}: num_nodes={num_nodes} is not a multiple of block_size={block_size}")
        num_node_blocks = num_nodes // block_size
    if not num_node_blocks:
        raise ValueError(f"{kind}: num_node_blocks (or num_nodes) must be positive")
    return int(num_node_blocks), block_size


class CircuitNodes:
    """Base class of node vectors. Identity (not value) equality: two calls build two vectors.

    A vector of ``num_node_blocks`` blocks of ``block_size`` nodes over the node vectors ``children``, with
    ``scope`` a bitset of variable ids; ``source``: the vector whose parameters it shares (:attr:`tied_to`), or
    None; ``name``: its name in error messages (default ``"<class>#<id>"``). Build vectors with :func:`inputs`,
    :func:`multiply`, :func:`summate` and :func:`duplicate`."""

    kind = "nodes"

    def __init__(self, num_node_blocks: int, block_size: int, children: Sequence[CircuitNodes], scope: int,
                 source: CircuitNodes | None = None, name: str | None = None):
        if name is not None and not isinstance(name, str):
            raise TypeError(f"{self.kind} vector: name must be a str or None, got {type(name).__name__} {name!r}")
        self.num_node_blocks = int(num_node_blocks)
        self.block_size = int(block_size)
        self.children = tuple(children)
        self.scope = scope
        self._source = None
        self.id = next(_ids)
        self.name = name if name is not None else f"{type(self).__name__}#{self.id}"
        self.tied_to = source

    @property
    def num_nodes(self) -> int:
        return self.num_node_blocks * self.block_size

    @property
    def scope_vars(self) -> list[int]:
        return scope_vars(self.scope)

    def is_input(self) -> bool:
        return False

    def is_prod(self) -> bool:
        return False

    def is_sum(self) -> bool:
        return False

    def is_tied(self) -> bool:
        """True when this vector shares its parameters with another one (``duplicate(tie_params=True)``)."""
        return self._source is not None

    @property
    def tied_to(self) -> CircuitNodes | None:
        """The vector this one was tied to (``duplicate(tie_params=True)``), or None; :attr:`source` follows the
        chain to the owner."""
        return self._source

    @tied_to.setter
    def tied_to(self, source: CircuitNodes | None) -> None:
        if source is not None and not isinstance(source, CircuitNodes):
            raise TypeError(f"{self.name}.tied_to must be a node vector or None, got {type(source).__name__}")
        ns = source
        while ns is not None:
            if ns is self:
                raise ValueError(f"{self.name}.tied_to = {source.name} would tie {self.name} to itself (a cycle of "
                                 f"ties)")
            ns = ns.tied_to
        self._source = source

    @property
    def own_params(self):
        """The parameters stored on this vector itself, in canonical form (None when unset or tied; see
        ``get_params`` for the owner's)."""
        return getattr(self, "_params", None)

    def load_params(self, params) -> None:
        """Store parameters that are already in canonical form (as :attr:`own_params` returns them), unchecked:
        for loaders and edits (jaxpc.edit) that produced them; ``set_params`` checks and converts user input."""
        self._params = params

    @property
    def source(self) -> CircuitNodes:
        """The vector that owns this vector's parameters (itself unless tied)."""
        ns = self
        while ns.tied_to is not None:
            ns = ns.tied_to
        return ns

    def __repr__(self) -> str:
        return (f"{self.name}(num_node_blocks={self.num_node_blocks}, block_size={self.block_size}, "
                f"scope={scope_str(self.scope)})")

    def __reduce__(self):
        """Pickle (and ``copy.deepcopy``) the graph reachable from this vector (children, tie sources, gate
        targets) as one flat list with references as indices, so that a graph of any depth pickles without deep
        recursion. Vectors pickled together (one ``pickle.dumps`` or ``copy.deepcopy`` call) stay one object where
        they were one; each loaded vector gets a new :attr:`id` and keeps its name."""
        graph = _Graph.covering(self)
        return _graph_member, (graph, graph.index[id(self)])

    def __copy__(self) -> CircuitNodes:
        """A shallow copy: a new object with the same attributes (children, parameters and :attr:`id` too)."""
        dup = object.__new__(type(self))
        dup.__dict__.update(self.__dict__)
        return dup


class InputNodes(CircuitNodes):
    """Leaves over one variable; ``dist`` is a :class:`jaxpc.distributions.Distribution`. Built by :func:`inputs`
    (``var``, ``num_node_blocks``, ``block_size``, ``dist``, ``params``, ``name`` as there) or by :func:`duplicate`
    (``source``: the vector whose parameters a tied copy shares)."""

    kind = "input"

    def __init__(self, var: int, num_node_blocks: int, block_size: int, dist, params=None,
                 source: InputNodes | None = None, name: str | None = None):
        if not isinstance(var, (int, np.integer)) or isinstance(var, bool) or var < 0:
            raise ValueError(f"inputs: var must be a non-negative int variable id, got {var!r}")
        check_dist("inputs", "dist", dist)
        super().__init__(num_node_blocks, block_size, (), 1 << int(var), source=source, name=name)
        self.var = int(var)
        self.dist = dist
        self._params = None
        if params is not None:
            self.set_params(params)

    def is_input(self) -> bool:
        return True

    def set_params(self, params) -> None:
        """Set the distribution parameters in the distribution's natural form (see its docs)."""
        if self._source is not None:
            self.source.set_params(params)
            return
        self._params = self.dist.canonical_params(params, self.num_nodes, where=self.name)

    def get_params(self):
        """The parameters given at construction (natural form), or None."""
        return self.source._params

    def duplicate(self, var: int | None = None, *, tie_params: bool = False, name: str | None = None) -> InputNodes:
        """A new vector of the same shape and distribution over ``var`` (default: same variable), with a copy of the
        parameters given to this vector (a tied vector's: its source's), or sharing them with ``tie_params=True``."""
        src = self.source if tie_params else None
        dup = InputNodes(self.var if var is None else var, self.num_node_blocks, self.block_size, self.dist,
                         source=src, name=name)
        own = self.get_params()  # a tied vector's are its source's
        if not tie_params and own is not None:
            dup._params = {k: v.copy() for k, v in own.items()}
        return dup


class ProdNodes(CircuitNodes):
    """Product nodes; built by :func:`multiply`, whose arguments (``children``, ``edge_ids``, ``name``) these
    are, with its checks."""

    kind = "prod"

    def __init__(self, children: Sequence[CircuitNodes], edge_ids=None, name: str | None = None):
        children = tuple(children)
        _check_children("multiply", children)
        scope = _disjoint_scope(children)
        edges = _prod_edges(children, edge_ids)
        super().__init__(edges.shape[0], children[0].block_size, children, scope, name=name)
        self.edge_ids = edges

    def is_prod(self) -> bool:
        return True

    def duplicate(self, *children: CircuitNodes, name: str | None = None) -> ProdNodes:
        """The same edge pattern over new children of matching shapes (default: the same children)."""
        chs = children or self.children
        _check_same_shapes(self, self.children, chs)
        return multiply(*chs, edge_ids=self.edge_ids.copy(), name=name)


@dataclasses.dataclass(frozen=True)
class Gates:
    """A sum vector's per-sample BlockScale gates (:meth:`SumNodes.set_gates`).

    Attributes:
        block_size: parent nodes per gate inside a node block (it divides the vector's ``block_size``).
        tie_to: the sum vector whose gate columns this one reads, or None for columns of its own.
    """

    block_size: int
    tie_to: SumNodes | None = None


class SumNodes(CircuitNodes):
    """Sum nodes; built by :func:`summate` (``children``, ``num_node_blocks``, ``block_size``, ``edge_ids``,
    ``params``, ``name`` as there, with its checks; ``num_node_blocks`` is required here) or by :func:`duplicate`
    (``source``: the vector whose parameters a tied copy shares)."""

    kind = "sum"

    def __init__(self, children: Sequence[CircuitNodes], num_node_blocks: int, block_size: int,
                 edge_ids, params=None, source: SumNodes | None = None, name: str | None = None):
        children = tuple(children)
        _check_children("summate", children)
        num_node_blocks, block_size = _resolve_sizes("summate", num_node_blocks, 0, block_size)
        edges = _sum_edges(edge_ids, num_node_blocks, sum(c.num_node_blocks for c in children))
        super().__init__(num_node_blocks, block_size, children, children[0].scope, source=source, name=name)
        check_smooth(self)
        self.edge_ids = edges
        self.ch_block_size = children[0].block_size
        self.num_ch_node_blocks = sum(c.num_node_blocks for c in children)
        self._params = None
        self.gates: Gates | None = None
        if params is not None:
            self.set_params(params)

    def is_sum(self) -> bool:
        return True

    def set_gates(self, block_size: int | None = None, *, tie_to: SumNodes | None = None) -> SumNodes:
        """Give this vector per-sample BlockScale gates, read from ``evidence["sum_gates"]`` (``[B, G]``, G =
        ``circuit.num_gates``); vectors without gates keep their shared weights.

        Each edge block ``e`` (column ``e`` of ``edge_ids``) gets one log-gate per ``block_size`` consecutive
        parent nodes of its node block (default: the vector's block size, one gate per edge block; 1: one per
        parent node). Sample ``b``'s weight of parent ``i`` and child ``j`` on edge block ``e`` is
        ``w[i, j] * exp(g[b, col(e, i)])``, renormalized over the node's children. The vector's columns form
        ``[num_edge_blocks, self.block_size // block_size]`` (row-major) at :meth:`jaxpc.Circuit.gate_slice`.
        ``tie_to``: read the columns of another gated sum vector with as many edge blocks, the same block size and
        gate block size (checked by :func:`jaxpc.compile`) instead of columns of its own. Declare gates before
        compiling; copies (:meth:`duplicate`) have none. Returns ``self``."""
        if tie_to is not None:
            if not isinstance(tie_to, SumNodes) or tie_to is self:
                raise ValueError(f"set_gates: tie_to must be another sum vector, got {tie_to!r}")
            if (tie_to.edge_ids.shape[1], tie_to.block_size) != (self.edge_ids.shape[1], self.block_size):
                raise ValueError(f"set_gates: {self.name} ({self.edge_ids.shape[1]} edge blocks of "
                                 f"{self.block_size} nodes) cannot read the gates of {tie_to.name} "
                                 f"({tie_to.edge_ids.shape[1]} edge blocks of {tie_to.block_size} nodes)")
            if block_size is None and tie_to.gates is not None:
                block_size = tie_to.gates.block_size
        bs = self.block_size if block_size is None else block_size
        if not isinstance(bs, (int, np.integer)) or isinstance(bs, bool) or bs < 1 or self.block_size % bs:
            raise ValueError(f"set_gates: block_size must be a positive divisor of {self.name}'s block size "
                             f"{self.block_size}, got {block_size!r}")
        self.gates = Gates(int(bs), tie_to)
        return self

    @property
    def num_ch_nodes(self) -> int:
        return self.num_ch_node_blocks * self.ch_block_size

    @property
    def num_edges(self) -> int:
        return self.edge_ids.shape[1] * self.block_size * self.ch_block_size

    def set_params(self, params) -> None:
        """Set the weights: dense ``[num_nodes, num_ch_nodes]``, or per edge block
        ``[num_edge_blocks, block_size, ch_block_size]`` (or ``[num_edge_blocks]`` when both block sizes
        are 1). Rows are normalized; weights outside the edges must be zero."""
        if self._source is not None:
            self.source.set_params(params)
            return
        self._params = _canonical_sum_params(self, params)

    def get_params(self):
        """The weights given at construction as ``[num_edge_blocks, block_size, ch_block_size]``, or None."""
        return self.source._params

    def duplicate(self, *children: CircuitNodes, tie_params: bool = False, name: str | None = None) -> SumNodes:
        """The same edge pattern over new children of matching shapes, with a copy of the weights given to this vector
        (a tied vector's: its source's), or sharing them with ``tie_params=True``."""
        chs = children or self.children
        _check_same_shapes(self, self.children, chs)
        src = self.source if tie_params else None
        dup = SumNodes(tuple(chs), self.num_node_blocks, self.block_size, self.edge_ids.copy(), source=src, name=name)
        own = self.get_params()  # a tied vector's are its source's
        if src is None and own is not None:
            dup._params = own.copy()
        return dup


# ----------------------------------------------------------------------------------------------
# Pickling: a graph as one flat list (CircuitNodes.__reduce__)
# ----------------------------------------------------------------------------------------------

# {id(vector): the live _Graph holding it}: while a pickler (or deepcopy's memo) keeps a graph alive, the vectors
# it holds pickle as members of that graph, so that every vector is loaded once however often it is referenced.
_COVERED: weakref.WeakValueDictionary[int, _Graph] = weakref.WeakValueDictionary()


def _link(value, ref):
    """An attribute ``value`` that refers to vectors (a vector, a tuple of them such as ``children``, gates that
    read another vector's) as a record of ``ref(vector)`` for each, or None for any other value."""
    if isinstance(value, CircuitNodes):
        return ("node", ref(value))
    if isinstance(value, tuple) and value and all(isinstance(c, CircuitNodes) for c in value):
        return ("nodes", tuple(ref(c) for c in value))
    if isinstance(value, Gates) and value.tie_to is not None:
        return ("gates", value.block_size, ref(value.tie_to))
    return None


class _Graph:
    """The vectors reachable from one vector, less those another live graph holds (iterative, any depth)."""

    def __init__(self, root: CircuitNodes):
        self.nodes: list[CircuitNodes] = []
        self.index: dict[int, int] = {}
        stack = [root]
        while stack:
            ns = stack.pop()
            if id(ns) in self.index or _COVERED.get(id(ns)) is not None:
                continue
            self.index[id(ns)] = len(self.nodes)
            self.nodes.append(ns)
            for v in ns.__dict__.values():
                _link(v, stack.append)
        for ns in self.nodes:
            _COVERED[id(ns)] = self

    @staticmethod
    def covering(ns: CircuitNodes) -> _Graph:
        """The live graph holding ``ns``, else a new one from ``ns``."""
        graph = _COVERED.get(id(ns))
        return graph if graph is not None else _Graph(ns)

    def __reduce__(self):
        """``(_rebuild_graph, (records, externals))``: per vector its class, plain attributes and references (as
        indices into its graph's vectors followed by ``externals``, the vectors of other graphs it refers to)."""
        externals: list[CircuitNodes] = []
        ext_index: dict[int, int] = {}

        def ref(ns: CircuitNodes) -> int:
            i = self.index.get(id(ns))
            if i is None:
                i = ext_index.get(id(ns))
                if i is None:
                    i = ext_index[id(ns)] = len(self.nodes) + len(externals)
                    externals.append(ns)
            return i

        records = []
        for ns in self.nodes:
            plain, links = {}, {}
            for k, v in ns.__dict__.items():
                if k != "id":
                    link = _link(v, ref)
                    if link is None:
                        plain[k] = v
                    else:
                        links[k] = link
            records.append((type(ns), plain, links))
        return _rebuild_graph, (records, tuple(externals))


def _rebuild_graph(records: list, externals: tuple) -> list[CircuitNodes]:
    """The vectors of a pickled :class:`_Graph`, each with a new id."""
    nodes = [cls.__new__(cls) for cls, _, _ in records]
    every = nodes + list(externals)
    for ns, (_, plain, links) in zip(nodes, records):
        state = dict(plain)
        for k, link in links.items():
            if link[0] == "node":
                state[k] = every[link[1]]
            elif link[0] == "nodes":
                state[k] = tuple(every[i] for i in link[1])
            else:
                state[k] = Gates(link[1], every[link[2]])
        state["id"] = next(_ids)
        ns.__dict__.update(state)
    return nodes


def _graph_member(nodes: list[CircuitNodes], i: int) -> CircuitNodes:
    return nodes[i]


def _check_same_shapes(ns: CircuitNodes, old: Sequence[CircuitNodes], new: Sequence[CircuitNodes]) -> None:
    if len(old) != len(new):
        raise ValueError(f"duplicate of {ns.name}: expected {len(old)} children, got {len(new)}")
    for i, (a, b) in enumerate(zip(old, new)):
        if not isinstance(b, CircuitNodes):
            raise TypeError(f"duplicate of {ns.name}: children must be node vectors, got {type(b).__name__} for "
                            f"child {i}")
        if (a.num_node_blocks, a.block_size) != (b.num_node_blocks, b.block_size):
            raise ValueError(
                f"duplicate of {ns.name}: child {i} ({b.name}) has num_node_blocks={b.num_node_blocks}, "
                f"block_size={b.block_size}; the original child {a.name} has "
                f"num_node_blocks={a.num_node_blocks}, block_size={a.block_size}")


_REQUIRED = object()


def check_dist(where: str, name: str, dist, default=_REQUIRED):
    """``dist``, which must be a :class:`jaxpc.distributions.Distribution` instance (a class or anything else is a
    ``TypeError`` naming ``where`` and ``name``); None gives ``default`` where one is given."""
    from ..distributions import Distribution  # local: distributions import nodes for typing only

    if dist is None and default is not _REQUIRED:
        return default
    if isinstance(dist, type) and issubclass(dist, Distribution):
        raise TypeError(f"{where}: {name} must be a distribution instance, got the class {dist.__name__}; call it, "
                        f"e.g. {dist.__name__}(...)")
    if not isinstance(dist, Distribution):
        got = "None" if dist is None else type(dist).__name__
        raise TypeError(f"{where}: {name} must be a jaxpc.distributions.Distribution, got {got}")
    return dist


def first_off_scope(children) -> CircuitNodes | None:
    """The first of ``children`` whose scope is not the first child's (a sum over them is not smooth), or None."""
    return next((c for c in children[1:] if c.scope != children[0].scope), None)


def union_scope(children) -> int:
    """The union of the children's scopes (a bit set of variables)."""
    return functools.reduce(operator.or_, (c.scope for c in children), 0)


def first_overlap(children) -> tuple[int, int] | None:
    """``(j, shared)``: the first child ``j`` that shares variables (the bit set ``shared``) with an earlier one (a
    product of them is not decomposable), or None."""
    scope = 0
    for j, c in enumerate(children):
        if scope & c.scope:
            return j, scope & c.scope
        scope |= c.scope
    return None


def check_smooth(ns: SumNodes) -> None:
    c = first_off_scope(ns.children)
    if c is not None:
        raise ValueError(
            f"summate: children must share one scope (smoothness), but {ns.children[0].name} has scope "
            f"{scope_str(ns.children[0].scope)} and {c.name} has scope {scope_str(c.scope)}")


def _check_children(kind: str, children: tuple) -> None:
    """Children of a product (``kind`` ``"multiply"``) or sum (``"summate"``) vector: at least one, all node vectors
    of one block size."""
    if not children:
        raise ValueError(f"{kind}: needs at least one child")
    for c in children:
        if not isinstance(c, CircuitNodes):
            raise TypeError(f"{kind}: children must be node vectors, got {type(c).__name__}")
    bs = children[0].block_size
    for c in children[1:]:
        if c.block_size != bs:
            raise ValueError(f"{kind}: children must share a block size, but {children[0].name} has "
                             f"block_size={bs} and {c.name} has block_size={c.block_size}")


def _disjoint_scope(children: tuple) -> int:
    """The union of the children's scopes, which must be pairwise disjoint (decomposability)."""
    hit = first_overlap(children)
    if hit is not None:
        j, shared = hit
        c = children[j]
        prev = [i for i, d in enumerate(children[:j]) if d.scope & c.scope]
        raise ValueError(
            f"multiply: children must have disjoint scopes (decomposability), but {c.name} shares variables "
            f"{scope_vars(shared)[:6]} with {', '.join(children[i].name for i in prev)} (children "
            f"{', '.join(map(str, prev))} and {j})")
    return union_scope(children)


def _prod_edges(children: tuple, edge_ids) -> np.ndarray:
    """A product vector's ``[num_prod_blocks, len(children)]`` child block ids (None: block ``i`` of every child)."""
    if edge_ids is None:
        nb = children[0].num_node_blocks
        for c in children[1:]:
            if c.num_node_blocks != nb:
                raise ValueError(
                    f"multiply: without edge_ids all children need the same num_node_blocks, but "
                    f"{children[0].name} has {nb} and {c.name} has {c.num_node_blocks}")
        return np.tile(np.arange(nb, dtype=np.int64)[:, None], (1, len(children)))
    edges = _as_int_array(edge_ids, "multiply: edge_ids")
    if edges.ndim != 2 or edges.shape[1] != len(children) or edges.shape[0] == 0:
        raise ValueError(f"multiply: edge_ids must have shape [num_prod_blocks, {len(children)}], got {edges.shape}")
    for j, c in enumerate(children):
        col = edges[:, j]
        if col.min() < 0 or col.max() >= c.num_node_blocks:
            bad = int(col[(col < 0) | (col >= c.num_node_blocks)][0])
            raise ValueError(f"multiply: edge_ids[:, {j}] holds block {bad}, but child {c.name} has "
                             f"{c.num_node_blocks} blocks")
    return edges


def _sum_edges(edge_ids, nb: int, num_ch_blocks: int) -> np.ndarray:
    """A sum vector's ``[2, num_edges]`` ``(parent block, child block)`` pairs for ``nb`` parent blocks over
    ``num_ch_blocks`` child blocks (None: all pairs): each parent block has an edge, no pair is listed twice."""
    if edge_ids is None:
        return np.stack([np.repeat(np.arange(nb), num_ch_blocks),
                         np.tile(np.arange(num_ch_blocks), nb)]).astype(np.int64)
    edges = _as_int_array(edge_ids, "summate: edge_ids")
    if edges.ndim != 2 or edges.shape[0] != 2 or edges.shape[1] == 0:
        raise ValueError(f"summate: edge_ids must have shape [2, num_edges], got {edges.shape}")
    if edges[0].min() < 0 or edges[0].max() >= nb:
        raise ValueError(f"summate: edge_ids[0] must be parent blocks in [0, {nb}), got values in "
                         f"[{edges[0].min()}, {edges[0].max()}]")
    if edges[1].min() < 0 or edges[1].max() >= num_ch_blocks:
        raise ValueError(f"summate: edge_ids[1] must be child blocks in [0, {num_ch_blocks}), got values in "
                         f"[{edges[1].min()}, {edges[1].max()}]")
    missing = np.setdiff1d(np.arange(nb), edges[0])
    if missing.size:
        raise ValueError(f"summate: parent blocks {missing[:6].tolist()} have no edges")
    keys = edges[0] * num_ch_blocks + edges[1]
    if np.unique(keys).size != keys.size:
        raise ValueError("summate: edge_ids lists the same (parent block, child block) pair twice")
    return edges


def _canonical_sum_params(ns: SumNodes, params) -> np.ndarray:
    from ..distributions.base import real_array  # local, as for Distribution above

    p = real_array(params, f"{ns.name}: params must be an array of real, non-negative weights", ragged=TypeError)
    E = ns.edge_ids.shape[1]
    Kp, Kc = ns.block_size, ns.ch_block_size
    if p.ndim == 2 and p.shape == (ns.num_nodes, ns.num_ch_nodes):
        dense = p.reshape(ns.num_node_blocks, Kp, ns.num_ch_node_blocks, Kc).transpose(0, 2, 1, 3)
        blocks = dense[ns.edge_ids[0], ns.edge_ids[1]]
        mask = np.zeros((ns.num_node_blocks, ns.num_ch_node_blocks), dtype=bool)
        mask[ns.edge_ids[0], ns.edge_ids[1]] = True
        off = dense[~mask]
        if off.size and np.any(off != 0):
            raise ValueError(f"{ns.name}: params has nonzero weights between blocks that edge_ids does not connect")
    elif p.ndim == 3 and p.shape == (E, Kp, Kc):
        blocks = p.copy()
    elif p.ndim == 1 and p.shape == (E,) and Kp == 1 and Kc == 1:
        blocks = p.reshape(E, 1, 1).copy()
    else:
        raise ValueError(
            f"{ns.name}: params must be dense [num_nodes, num_ch_nodes] = [{ns.num_nodes}, {ns.num_ch_nodes}] or "
            f"per edge block [num_edge_blocks, block_size, ch_block_size] = [{E}, {Kp}, {Kc}]; got shape {p.shape}")
    if not np.all(np.isfinite(blocks)) or np.any(blocks < 0):
        raise ValueError(f"{ns.name}: sum weights must be finite and non-negative")
    # each node's weights over its largest first, so that weights near the float64 maximum do not sum to inf
    top = np.zeros((ns.num_node_blocks, Kp))
    np.maximum.at(top, ns.edge_ids[0], blocks.max(axis=2))
    if np.any(top <= 0):
        blk, k = np.argwhere(top <= 0)[0]
        raise ValueError(f"{ns.name}: node {blk * Kp + k} has weights summing to zero")
    blocks = blocks / top[ns.edge_ids[0]][:, :, None]
    totals = np.zeros((ns.num_node_blocks, Kp))
    np.add.at(totals, ns.edge_ids[0], blocks.sum(axis=2))
    return blocks / totals[ns.edge_ids[0]][:, :, None]


# ----------------------------------------------------------------------------------------------
# Construction functions (PyJuice names and semantics)
# ----------------------------------------------------------------------------------------------

def inputs(var: int, num_node_blocks: int = 0, block_size: int = 0, dist=None, params=None, num_nodes: int = 0,
           name: str | None = None) -> InputNodes:
    """A vector of ``num_node_blocks * block_size`` input nodes over variable ``var``.

    Args:
        var: the variable id (column of ``x``).
        num_node_blocks: number of blocks (or give ``num_nodes``).
        block_size: nodes per block (default 1).
        dist: a distribution from :mod:`jaxpc.distributions`.
        params: optional parameters in the distribution's natural form (e.g. ``Categorical``:
            probabilities ``[num_nodes, num_cats]``).
        num_nodes: alternative to ``num_node_blocks``.
        name: optional name used in error messages and summaries.
    """
    if dist is None:
        raise ValueError("inputs: dist is required (e.g. jaxpc.distributions.Categorical(num_cats=...))")
    nb, bs = _resolve_sizes("inputs", num_node_blocks, num_nodes, block_size)
    return InputNodes(var, nb, bs, dist, params=params, name=name)


def multiply(*children: CircuitNodes, edge_ids=None, name: str | None = None) -> ProdNodes:
    """Product nodes over children with disjoint scopes and equal block sizes.

    Default edges pair the ``i``-th block of every child (all children then need the same
    ``num_node_blocks``); ``edge_ids[p, j]`` picks the block of child ``j`` for product block ``p``.

    Args:
        children: the child node vectors (at least one; disjoint scopes, one block size), else a ``ValueError``
            naming them (a ``TypeError`` for something that is not a node vector).
        edge_ids: optional integer ``[num_prod_blocks, len(children)]`` child block ids (default None: block ``i``
            of every child for product block ``i``); a wrong shape or an id out of a child's range is a
            ``ValueError``, non-integers a ``TypeError``.
        name: optional name used in error messages and summaries (default ``"ProdNodes#<id>"``).
    """
    return ProdNodes(children, edge_ids, name=name)


def summate(*children: CircuitNodes, num_node_blocks: int = 0, block_size: int = 0, edge_ids=None, params=None,
            num_nodes: int = 0, name: str | None = None) -> SumNodes:
    """Sum nodes over children with one shared scope and equal block sizes.

    Default edges connect every parent block with every child block (dense); ``edge_ids``
    (``[2, num_edges]``) lists ``(parent block, child block)`` pairs, child blocks numbered over the
    concatenation of the children. ``params``: dense ``[num_nodes, num_ch_nodes]`` weights or per edge
    block ``[num_edges, block_size, ch_block_size]``; normalized per node.

    Args:
        children: the child node vectors (at least one; one scope, one block size), else a ``ValueError`` naming
            them (a ``TypeError`` for something that is not a node vector).
        num_node_blocks: number of parent blocks (or give ``num_nodes``; not both, a ``ValueError``). Default 0:
            from ``num_nodes``, else ``edge_ids[0].max() + 1``; without ``edge_ids`` one of the two is required.
        block_size: parent nodes per block (default 0: 1). It need not equal the children's block size.
        edge_ids: optional integer ``[2, num_edges]`` ``(parent block, child block)`` pairs (default None: dense);
            a wrong shape, an id out of range, a parent block without edges or a repeated pair is a
            ``ValueError``.
        params: optional weights (see above), non-negative and finite, zero outside the edges, each node's
            summing to more than zero; else a ``ValueError`` (not real numbers, booleans included: a ``TypeError``).
        num_nodes: alternative to ``num_node_blocks``: ``num_nodes`` must be a multiple of ``block_size`` (else a
            ``ValueError``).
        name: optional name used in error messages and summaries (default ``"SumNodes#<id>"``).
    """
    _check_children("summate", children)
    if edge_ids is not None and not num_node_blocks and not num_nodes:
        edges = _as_int_array(edge_ids, "summate: edge_ids")
        if edges.ndim != 2 or edges.shape[0] != 2 or edges.shape[1] == 0:
            raise ValueError(f"summate: edge_ids must have shape [2, num_edges], got {edges.shape}")
        num_node_blocks = int(edges[0].max()) + 1
    nb, bs = _resolve_sizes("summate", num_node_blocks, num_nodes, block_size)
    ns = SumNodes(children, nb, bs, edge_ids, params=None, name=name)
    if params is not None:
        ns.set_params(params)
    return ns


def duplicate(ns: CircuitNodes, *args, tie_params: bool = False, name: str | None = None) -> CircuitNodes:
    """Copy a node vector onto new children (sum/product) or a new variable (input).

    ``tie_params=True`` makes the copy share parameters with ``ns`` (inputs and sums; a ``ValueError`` for
    products).

    Args:
        ns: the node vector to copy (else a ``TypeError``).
        args: sum and product vectors: new children of the same shapes as ``ns``'s (default: its children; another
            number or shape is a ``ValueError``); input vectors: at most one new variable id (default: its own).
        tie_params: share ``ns``'s parameters instead of copying them (default ``False``).
        name: optional name of the copy (default ``"<class name>#<id>"``).
    """
    if isinstance(ns, InputNodes):
        if len(args) > 1:
            raise ValueError("duplicate of input nodes takes one variable id")
        return ns.duplicate(*args, tie_params=tie_params, name=name)
    if isinstance(ns, SumNodes):
        return ns.duplicate(*args, tie_params=tie_params, name=name)
    if isinstance(ns, ProdNodes):
        if tie_params:
            raise ValueError("product nodes have no parameters to tie")
        return ns.duplicate(*args, name=name)
    raise TypeError(f"duplicate: expected a node vector, got {type(ns).__name__}")
