"""Structure transformations of node graphs and latent variable distillation.

Every function here is pure: it reads the graph reachable from ``root`` and returns the root
of a *new* graph; the input vectors (their edges, parameters and ties) are never modified.
Sharing is kept (a vector used by several parents is copied once) and so are parameter ties:
the first new vector of an old tie group (in topological order) owns the parameters and the
others are tied to it. A tie is dropped only where a transformation makes the edges of the tied
vectors differ (then each keeps its own copy of the parameters, and the function is unchanged).

Parameters come from the vectors themselves (``params=`` given to ``inputs``/``summate``) or,
when a compiled ``circuit`` (and optionally a ``params`` pytree of it, default
``circuit.params``) is passed, from ``circuit.get_node_params(params, node)``, so a trained
circuit can be transformed. Sum weights are carried over in the block form
``[num_edge_blocks, block_size, ch_block_size]`` and renormalized per node. Vectors without
parameters (neither given on the node nor a circuit passed) stay without; ``jaxpc.compile``
then draws them at random.

Functions:

* :func:`deepcopy`: copy a graph, optionally renaming variables.
* :func:`blockify` / :func:`unblockify`: larger / smaller block sizes, same function.
* :func:`merge`: collapse vectors over one scope into one vector, same function.
* :func:`prune`: drop sum edge blocks with low flows (or any score).
* :func:`grow`: duplicate every vector, with multiplicative noise on the copies' parameters.
* :func:`lvd_init`: latent variable distillation, sum and input parameters from counts of
  latent assignments (e.g. k-means cluster ids); :func:`hclt_latent_regions` finds the
  vectors of an HCLT's latents.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from . import distributions as dists
from .nodes import CircuitNodes, InputNodes, ProdNodes, SumNodes, multiply, summate
from .nodes.nodes import scope_str
from .nodes.traversal import topological_order

__all__ = ["deepcopy", "blockify", "unblockify", "merge", "prune", "grow", "lvd_init", "hclt_latent_regions"]


# ----------------------------------------------------------------------------------------------
# shared helpers: argument checks, parameter access, building new vectors with ties
# ----------------------------------------------------------------------------------------------

def _check_root(root, fn: str) -> list[CircuitNodes]:
    if not isinstance(root, CircuitNodes):
        raise TypeError(f"{fn}: root must be a node vector, got {type(root).__name__}")
    return topological_order(root)


def _levels(nodes: Sequence[CircuitNodes]) -> dict[int, int]:
    """The compiler's levels: inputs 0, other vectors one more than their highest child."""
    level: dict[int, int] = {}
    for ns in nodes:
        level[ns.id] = 0 if ns.is_input() else 1 + max(level[c.id] for c in ns.children)
    return level


def _tie_groups(nodes: Sequence[CircuitNodes]) -> dict[int, list[CircuitNodes]]:
    """Members in the graph of every tie group, keyed by the group's source id (topological order)."""
    groups: dict[int, list[CircuitNodes]] = defaultdict(list)
    for ns in nodes:
        if not ns.is_prod():
            groups[ns.source.id].append(ns)
    return groups


def _block_view(dense: np.ndarray, ns: SumNodes) -> np.ndarray:
    """``[num_nodes, num_ch_nodes]`` -> ``[num_edge_blocks, Kp, Kc]`` at the edge blocks of ``ns``."""
    d4 = dense.reshape(ns.num_node_blocks, ns.block_size, ns.num_ch_node_blocks, ns.ch_block_size)
    return d4[ns.edge_ids[0], :, ns.edge_ids[1], :]


def _normalize_blocks(blocks: np.ndarray, par: np.ndarray, num_node_blocks: int) -> np.ndarray:
    """Normalize block weights ``[E, Kp, Kc]`` per node (parent block ``par[e]``, row); a node whose
    weights are all zero gets a uniform distribution over its edges."""
    blocks = np.asarray(blocks, dtype=np.float64)
    totals = np.zeros((num_node_blocks, blocks.shape[1]))
    np.add.at(totals, par, blocks.sum(axis=2))
    dead = totals[par] <= 0  # [E, Kp]
    if np.any(dead):
        blocks = np.where(dead[:, :, None], 1.0, blocks)
        totals = np.zeros((num_node_blocks, blocks.shape[1]))
        np.add.at(totals, par, blocks.sum(axis=2))
    return blocks / totals[par][:, :, None]


class _ParamError(ValueError):
    """A parameter lookup failed (raised as is, never re-worded as a structure error)."""


class _Params:
    """Reads the parameters of node vectors: their own, or a compiled circuit's (cached per tie group)."""

    def __init__(self, fn: str, circuit=None, params=None):
        if params is not None and circuit is None:
            raise ValueError(f"{fn}: params= is a pytree of a compiled circuit; pass that circuit as circuit= too")
        if circuit is not None:
            from .circuit import Circuit
            if not isinstance(circuit, Circuit):
                raise TypeError(f"{fn}: circuit must be a jaxpc.Circuit, got {type(circuit).__name__}")
        self.fn = fn
        self.circuit = circuit
        self.params = circuit.params if circuit is not None and params is None else params
        self._sums: dict[int, np.ndarray | None] = {}
        self._inputs: dict[int, dict | None] = {}
        self._host_cache: dict[tuple, Any] = {}

    def _placement(self, src, table: dict):
        pl = table.get(src.id)
        if pl is None:
            raise _ParamError(f"{self.fn}: {src.name} is not part of the circuit passed as circuit= (was it compiled "
                             f"from this root?)")
        return pl

    def _host(self, kind: str, key: str):
        """A cached host copy of ``params[kind][key]`` (numpy, no per-node device work)."""
        ck = (kind, key)
        if ck not in self._host_cache:
            try:
                tree = self.params[kind][key]
            except (KeyError, TypeError, IndexError):
                raise _ParamError(f"{self.fn}: params has no entry [{kind!r}][{key!r}]; pass a params pytree of the "
                                 f"circuit given as circuit=") from None
            self._host_cache[ck] = jax.tree_util.tree_map(np.asarray, tree)
        return self._host_cache[ck]

    def sum_blocks(self, ns: SumNodes) -> np.ndarray | None:
        """Normalized weights ``[num_edge_blocks, block_size, ch_block_size]`` (float64) of the tie group
        of ``ns``, or None when unknown. From a circuit: ``circuit.get_node_params(params, node)`` at the
        edge blocks, read straight from the parameter array."""
        src = ns.source
        if src.id not in self._sums:
            if self.circuit is None:
                b = None if src.own_params is None else np.array(src.own_params, dtype=np.float64)
            else:
                pl = self._placement(src, self.circuit.structure.sum_placement)
                logw = self._host("sum", pl.group)[pl.start:pl.start + pl.num_edge_blocks]
                b = np.exp(logw.astype(np.float64))
            self._sums[src.id] = None if b is None else _normalize_blocks(b, src.edge_ids[0], src.num_node_blocks)
        b = self._sums[src.id]
        return None if b is None else b.copy()

    def input_natural(self, ns: InputNodes) -> dict[str, np.ndarray] | None:
        """Natural parameters of the tie group of ``ns`` as a dict of arrays with a leading node axis
        (``MaskedCategorical``: the boolean ``mask [n, K]`` and, when known, ``probs``), or None."""
        src = ns.source
        if src.id not in self._inputs:
            dist = src.dist
            nat = None
            if dist.natural_fields:
                if self.circuit is None:
                    nat = None if src.own_params is None else dict(src.own_params)
                else:
                    # circuit.get_node_params(params, src), from host copies of the layer's arrays
                    pl = self._placement(src, self.circuit.structure.input_placement)
                    sl = slice(pl.row_start, pl.row_start + pl.num_nodes)
                    p = {k: v[sl] for k, v in self._host("input", pl.key).items()}
                    meta = {k: np.asarray(v)[sl] for k, v in self.circuit.tables["inputs"][pl.layer]["meta"].items()}
                    val = dist.internal_to_natural(p, meta)
                    nat = {k: np.asarray(v) for k, v in val.items() if k in dist.natural_fields}
            if nat is not None:
                nat = {k: (np.array(v, dtype=bool) if k == "mask" else np.array(v, dtype=np.float64))
                       for k, v in nat.items()}
                if "probs" in nat:  # float32 slop from a circuit
                    nat["probs"] = nat["probs"] / nat["probs"].sum(axis=1, keepdims=True)
            self._inputs[src.id] = nat
        nat = self._inputs[src.id]
        return None if nat is None else {k: v.copy() for k, v in nat.items()}


def _set_input_params(ns: InputNodes, nat: dict[str, np.ndarray] | None) -> None:
    """Store natural parameters (as :meth:`_Params.input_natural` returns them) on a new vector."""
    if nat is None:
        return
    dist = ns.dist
    n = ns.num_nodes
    for k, v in nat.items():
        if v.shape[0] != n:
            raise AssertionError(f"{ns.name}: parameter {k} has {v.shape[0]} rows for {n} nodes")
    if isinstance(dist, dists.MaskedCategorical):
        out = {"mask": nat["mask"].astype(bool)}
        if "probs" in nat:
            p = np.where(out["mask"], nat["probs"], 0.0)
            out["probs"] = p / p.sum(axis=1, keepdims=True)
        ns.source.load_params(out)
    else:
        ns.set_params(nat)


class _Builder:
    """Creates new vectors and keeps tie groups (keyed by the old source id): the first new vector of a
    group owns the parameters; later ones are tied to it when their shapes and edges agree."""

    def __init__(self):
        self.sources: dict[int, CircuitNodes] = {}

    def input(self, old: InputNodes, var: int, num_node_blocks: int, block_size: int,
              natural: Callable[[], dict | None], tie: bool = True) -> InputNodes:
        key = old.source.id
        src = self.sources.get(key) if tie else None
        if src is not None and (src.num_node_blocks, src.block_size) == (num_node_blocks, block_size):
            return InputNodes(var, num_node_blocks, block_size, old.dist, source=src, name=old.name)
        ns = InputNodes(var, num_node_blocks, block_size, old.dist, name=old.name)
        _set_input_params(ns, natural())
        if tie and key not in self.sources:
            self.sources[key] = ns
        return ns

    def sum(self, old: SumNodes, children: Sequence[CircuitNodes], num_node_blocks: int, block_size: int,
            edge_ids: np.ndarray, blocks: Callable[[], np.ndarray | None], tie: bool = True,
            name: str | None = None) -> SumNodes:
        key = old.source.id
        ns = summate(*children, num_node_blocks=num_node_blocks, block_size=block_size, edge_ids=edge_ids,
                     name=old.name if name is None else name)
        src = self.sources.get(key) if tie else None
        if src is not None and _same_sum_shape(src, ns):
            ns.tied_to = src
            return ns
        b = blocks()
        if b is not None:
            ns.set_params(b)
        if tie and key not in self.sources:
            self.sources[key] = ns
        return ns


def _same_sum_shape(a: SumNodes, b: SumNodes) -> bool:
    return ((a.num_node_blocks, a.block_size, a.ch_block_size) == (b.num_node_blocks, b.block_size, b.ch_block_size)
            and len(a.children) == len(b.children)
            and all((x.num_node_blocks, x.block_size) == (y.num_node_blocks, y.block_size)
                    for x, y in zip(a.children, b.children))
            and np.array_equal(a.edge_ids, b.edge_ids))


# ----------------------------------------------------------------------------------------------
# deepcopy
# ----------------------------------------------------------------------------------------------

def _var_map(var_mapping, fn: str) -> Callable[[int], int]:
    if var_mapping is None:
        return lambda v: v
    if isinstance(var_mapping, Mapping):
        m = {}
        for k, v in var_mapping.items():
            for what, val in (("key", k), ("value", v)):
                if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val < 0:
                    raise ValueError(f"{fn}: var_mapping {what}s must be non-negative variable ids, got {val!r}")
            m[int(k)] = int(v)
        return lambda v: m.get(v, v)
    arr = np.asarray(var_mapping)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer) or np.any(arr < 0):
        raise ValueError(f"{fn}: var_mapping must be a dict {{old var: new var}} or a 1-D array of non-negative "
                         f"ints indexed by the old variable id")

    def f(v):
        if v >= arr.size:
            raise ValueError(f"{fn}: var_mapping has {arr.size} entries but the circuit uses variable {v}")
        return int(arr[v])
    return f


def _copy(root: CircuitNodes, reader: _Params, var_map: Callable[[int], int], fn: str):
    """Copy the graph. Returns (new root, {old id: new vector})."""
    nodes = topological_order(root)
    b = _Builder()
    new: dict[int, CircuitNodes] = {}
    for ns in nodes:
        chs = [new[c.id] for c in ns.children]
        try:
            if ns.is_input():
                new[ns.id] = b.input(ns, var_map(ns.var), ns.num_node_blocks, ns.block_size,
                                     lambda: reader.input_natural(ns))
            elif ns.is_prod():
                new[ns.id] = multiply(*chs, edge_ids=ns.edge_ids.copy(), name=ns.name)
            else:
                new[ns.id] = b.sum(ns, chs, ns.num_node_blocks, ns.block_size, ns.edge_ids.copy(),
                                   lambda: reader.sum_blocks(ns))
        except _ParamError:
            raise
        except ValueError as e:
            raise ValueError(f"{fn}: copying {ns.name} failed (check var_mapping): {e}") from None
    return new[root.id], new


def deepcopy(root: CircuitNodes, var_mapping=None, circuit=None, params=None) -> CircuitNodes:
    """A copy of the graph under ``root``: new vectors with the same shapes, edges, sharing and ties.

    Args:
        root: the root vector.
        var_mapping: optional ``{old var: new var}`` (unlisted variables keep their id) or an int array
            indexed by the old variable id. A mapping that breaks decomposability or smoothness raises
            a ``ValueError`` naming the vector.
        circuit, params: take parameters from a compiled circuit (default ``circuit.params``) instead
            of the vectors; every parameter of the copy is then set.

    Returns:
        the new root.
    """
    _check_root(root, "deepcopy")
    reader = _Params("deepcopy", circuit, params)
    return _copy(root, reader, _var_map(var_mapping, "deepcopy"), "deepcopy")[0]


# ----------------------------------------------------------------------------------------------
# blockify / unblockify
# ----------------------------------------------------------------------------------------------

class _UnionFind:
    def __init__(self):
        self.parent: dict[int, int] = {}

    def find(self, a: int) -> int:
        self.parent.setdefault(a, a)
        root = a
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[a] != root:
            self.parent[a], a = root, self.parent[a]
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def _prod_aligned(ns: ProdNodes, m: int) -> bool:
    """Whether groups of ``m`` consecutive product blocks read ``m`` consecutive, aligned blocks of every
    child (then the product is a product of the coarser blocks)."""
    if m == 1:
        return True
    e = ns.edge_ids.reshape(ns.num_node_blocks // m, m, -1)
    return bool(np.all(e[:, 0, :] % m == 0) and np.all(e - e[:, :1, :] == np.arange(m)[None, :, None]))


def _coarse_sum_edges(edge_ids: np.ndarray, mp: int, mc: int, num_ch_blocks: int):
    """Edge blocks after grouping ``mp`` parent and ``mc`` child blocks: (new edge_ids, new edge of
    every old edge)."""
    ncb = num_ch_blocks // mc
    keys = (edge_ids[0] // mp) * ncb + edge_ids[1] // mc
    uniq, inv = np.unique(keys, return_inverse=True)
    return np.stack([uniq // ncb, uniq % ncb]).astype(np.int64), inv.reshape(-1)


def _sum_fill(ns: SumNodes, mp: int, mc: int) -> float:
    """Fraction of the coarse edge blocks' sub-blocks that are edges of ``ns`` (1 = no padding)."""
    new_edges, _ = _coarse_sum_edges(ns.edge_ids, mp, mc, ns.num_ch_node_blocks)
    return ns.edge_ids.shape[1] / (new_edges.shape[1] * mp * mc)


def blockify(root: CircuitNodes, sparsity_tolerance: float = 0.25, max_block_size: int = 32, *, circuit=None,
             params=None) -> CircuitNodes:
    """An equivalent graph with larger blocks: groups of ``m`` consecutive blocks (``m`` a power of two)
    become one block of ``m * block_size`` nodes. Node order is unchanged, so every node computes the
    same function (the root's likelihood is unchanged).

    Constraints, solved for all vectors together: a product and its children share one factor and its
    edges must map groups of blocks onto aligned groups of child blocks; the children of a sum share one
    factor; tied vectors share one; ``m`` divides ``num_node_blocks`` and ``m * block_size <=
    max_block_size``. A sum's coarse edge blocks may contain sub-blocks that were not edges: they are
    padded with zero weights, and a sum accepts the coarser blocks only while the padded fraction of
    its coarse edge blocks is at most ``sparsity_tolerance`` (otherwise the larger of the two factors
    is halved until it fits).

    Zero-weight padding stays zero under EM only without a pseudocount (jaxpc has no per-weight
    masks); for parameterless vectors the compiled result draws the padding at random like any weight.

    Args:
        root: the root vector.
        sparsity_tolerance: largest admissible fraction of padded sub-blocks per sum, in ``[0, 1)``.
        max_block_size: largest block size to create (blocks already larger are kept).
        circuit, params: take parameters from a compiled circuit (see the module docstring).

    Returns:
        the new root.
    """
    nodes = _check_root(root, "blockify")
    if not isinstance(sparsity_tolerance, (int, float)) or not 0.0 <= sparsity_tolerance < 1.0:
        raise ValueError(f"blockify: sparsity_tolerance must be a float in [0, 1), got {sparsity_tolerance!r}")
    if not isinstance(max_block_size, (int, np.integer)) or isinstance(max_block_size, bool) or max_block_size < 1:
        raise ValueError(f"blockify: max_block_size must be a positive int, got {max_block_size!r}")
    reader = _Params("blockify", circuit, params)

    # classes of vectors that must share one grouping factor
    uf = _UnionFind()
    for ns in nodes:
        uf.find(ns.id)
        if ns.is_prod():
            for c in ns.children:
                uf.union(ns.id, c.id)
        elif ns.is_sum():
            for c in ns.children[1:]:
                uf.union(ns.children[0].id, c.id)
    for members in _tie_groups(nodes).values():
        for m in members[1:]:
            uf.union(members[0].id, m.id)
            if m.is_sum():
                uf.union(members[0].children[0].id, m.children[0].id)
    classes: dict[int, list[CircuitNodes]] = defaultdict(list)
    for ns in nodes:
        classes[uf.find(ns.id)].append(ns)

    factor: dict[int, int] = {}
    for cid, members in classes.items():
        K = members[0].block_size
        g = 0
        for ns in members:
            g = math.gcd(g, ns.num_node_blocks)
        m = 1
        while g % (2 * m) == 0 and K * 2 * m <= max_block_size:
            m *= 2
        prods = [ns for ns in members if ns.is_prod()]
        while m > 1 and not all(_prod_aligned(p, m) for p in prods):
            m //= 2
        factor[cid] = m

    # sums: shrink factors until every sum's padding is within the tolerance (monotone: halving a
    # factor never lowers the fill, and factors of 1 need no padding)
    sums = [members[0] for members in _tie_groups(nodes).values() if members[0].is_sum()]
    changed = True
    while changed:
        changed = False
        for s in sums:
            cp, cc = uf.find(s.id), uf.find(s.children[0].id)
            mp, mc = factor[cp], factor[cc]
            if mp * mc > 1 and _sum_fill(s, mp, mc) < 1.0 - sparsity_tolerance - 1e-12:
                target = cp if mp >= mc else cc
                factor[target] //= 2
                changed = True

    b = _Builder()
    new: dict[int, CircuitNodes] = {}
    for ns in nodes:
        m = factor[uf.find(ns.id)]
        nb, K = ns.num_node_blocks // m, ns.block_size * m
        chs = [new[c.id] for c in ns.children]
        if ns.is_input():
            new[ns.id] = b.input(ns, ns.var, nb, K, lambda: reader.input_natural(ns))
        elif ns.is_prod():
            e = ns.edge_ids.reshape(nb, m, -1)[:, 0, :] // m
            new[ns.id] = multiply(*chs, edge_ids=e, name=ns.name)
        else:
            mc = factor[uf.find(ns.children[0].id)]
            edges, inv = _coarse_sum_edges(ns.edge_ids, m, mc, ns.num_ch_node_blocks)

            def blocks(ns=ns, m=m, mc=mc, edges=edges, inv=inv):
                old = reader.sum_blocks(ns)
                if old is None:
                    return None
                Kp, Kc = ns.block_size, ns.ch_block_size
                out = np.zeros((edges.shape[1], m, Kp, mc, Kc))
                out[inv, ns.edge_ids[0] % m, :, ns.edge_ids[1] % mc, :] = old
                return out.reshape(edges.shape[1], m * Kp, mc * Kc)

            new[ns.id] = b.sum(ns, chs, nb, K, edges, blocks)
    return new[root.id]


def unblockify(root: CircuitNodes, block_size: int = 1, *, circuit=None, params=None) -> CircuitNodes:
    """An equivalent graph with smaller blocks: every vector's block size ``K`` becomes
    ``gcd(K, block_size)`` (all 1 by default); a sum's edge block becomes the grid of the smaller
    blocks it contains, with the same weights. Node order and the function are unchanged.

    Args:
        root: the root vector.
        block_size: the target block size (a positive int).
        circuit, params: take parameters from a compiled circuit (see the module docstring).

    Returns:
        the new root.
    """
    nodes = _check_root(root, "unblockify")
    if not isinstance(block_size, (int, np.integer)) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"unblockify: block_size must be a positive int, got {block_size!r}")
    reader = _Params("unblockify", circuit, params)
    b = _Builder()
    new: dict[int, CircuitNodes] = {}
    for ns in nodes:
        K = math.gcd(ns.block_size, block_size)
        r = ns.block_size // K
        nb = ns.num_node_blocks * r
        chs = [new[c.id] for c in ns.children]
        if ns.is_input():
            new[ns.id] = b.input(ns, ns.var, nb, K, lambda: reader.input_natural(ns))
        elif ns.is_prod():
            e = (ns.edge_ids[:, None, :] * r + np.arange(r)[None, :, None]).reshape(nb, -1)
            new[ns.id] = multiply(*chs, edge_ids=e, name=ns.name)
        else:
            Kc = math.gcd(ns.ch_block_size, block_size)
            rc = ns.ch_block_size // Kc
            E = ns.edge_ids.shape[1]
            par = ns.edge_ids[0][:, None, None] * r + np.arange(r)[None, :, None]
            ch = ns.edge_ids[1][:, None, None] * rc + np.arange(rc)[None, None, :]
            edges = np.stack([np.broadcast_to(par, (E, r, rc)).reshape(-1),
                              np.broadcast_to(ch, (E, r, rc)).reshape(-1)])

            def blocks(ns=ns, r=r, rc=rc, K=K, Kc=Kc):
                old = reader.sum_blocks(ns)
                if old is None:
                    return None
                E = old.shape[0]
                return old.reshape(E, r, K, rc, Kc).transpose(0, 1, 3, 2, 4).reshape(E * r * rc, K, Kc)

            new[ns.id] = b.sum(ns, chs, nb, K, edges, blocks)
    return new[root.id]


# ----------------------------------------------------------------------------------------------
# merge
# ----------------------------------------------------------------------------------------------

def _merge_signature(ns: CircuitNodes, rep: Callable[[CircuitNodes], Any], level: int, reader: _Params):
    # vectors with and without parameters cannot share one vector: keep them apart
    has = ns.is_prod() or reader.circuit is not None or ns.source.own_params is not None
    if ns.is_input():
        fields = tuple(sorted(ns.source.own_params)) if has and reader.circuit is None else has
        return ("input", ns.var, ns.dist, ns.block_size, fields)
    if ns.is_sum():
        return ("sum", ns.scope, ns.block_size, ns.ch_block_size, level, has)
    by_scope = sorted((c.scope, rep(c)) for c in ns.children)
    return ("prod", ns.scope, ns.block_size, level, tuple(by_scope))


def _indicator_concat_ok(ns: InputNodes) -> bool:
    """Whether nodes placed after ``ns``'s keep their values (an ``Indicator`` node's value is its
    position modulo ``num_states``)."""
    return not isinstance(ns.dist, dists.Indicator) or ns.num_nodes % ns.dist.num_states == 0


def _auto_merge_groups(nodes, root, level, reader: _Params) -> list[list[CircuitNodes]]:
    """Vectors with one signature (kind, scope, block sizes, level; products: also the same children up
    to merging), except the root and tied vectors."""
    tie_size = {k: len(v) for k, v in _tie_groups(nodes).items()}
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
        if ns.is_input() and not _indicator_concat_ok(ns):
            return False
        return ns.is_prod() or (not ns.is_tied() and tie_size.get(ns.id, 1) == 1)

    collect([ns for ns in nodes if not ns.is_prod() and eligible(ns)])
    prods = sorted((ns for ns in nodes if ns.is_prod() and eligible(ns)), key=lambda ns: level[ns.id])
    for lv in sorted({level[p.id] for p in prods}):  # children's groups are final before their parents'
        collect([p for p in prods if level[p.id] == lv])
    return groups


def _check_merge_group(group, fn: str, in_graph: set[int], root) -> list[CircuitNodes]:
    if isinstance(group, CircuitNodes) or not isinstance(group, Sequence):
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
        if ns.is_input() and not _indicator_concat_ok(ns):
            raise ValueError(f"{fn}: cannot merge {ns.name}: it has {ns.num_nodes} Indicator nodes, not a multiple of "
                             f"num_states={ns.dist.num_states}, so the nodes after it would indicate other values")
    for ns in members[1:]:
        if ns.is_sum() and ns.ch_block_size != first.ch_block_size:
            raise ValueError(f"{fn}: cannot merge {first.name} (children's block_size={first.ch_block_size}) with "
                             f"{ns.name} (children's block_size={ns.ch_block_size})")
        if ns.is_prod() and sorted(c.scope for c in ns.children) != sorted(c.scope for c in first.children):
            raise ValueError(f"{fn}: cannot merge products {first.name} and {ns.name}: their children's scopes "
                             f"differ")
    return members


def merge(root: CircuitNodes, groups=None, *, circuit=None, params=None) -> CircuitNodes:
    """Collapse groups of vectors over one scope into single vectors (nodes concatenated in group
    order); the parents' edges are remapped, so the function is unchanged.

    * sums: same scope and block sizes; the merged sum's children are the union of the members'
      children (first-appearance order) and its weights the members' weights.
    * products: same children scopes; at every scope, all members must read the same vector after
      merging (merge the children first, e.g. in the same call).
    * inputs: same variable, distribution and block size; parameters concatenated.

    Merged vectors own their parameters (a tied member keeps its values but no longer shares them).

    Args:
        root: the root vector.
        groups: a list of groups (lists of at least two vectors of the graph). Default: merge every
            set of untied, non-root vectors with one kind, scope, block size(s) and level (the
            compiler's topological level; products also need the same children up to merging), as
            PyJuice merges by region.
        circuit, params: take parameters from a compiled circuit (see the module docstring).

    Returns:
        the new root.
    """
    fn = "merge"
    nodes = _check_root(root, fn)
    reader = _Params(fn, circuit, params)
    level = _levels(nodes)
    if groups is None:
        groups = _auto_merge_groups(nodes, root, level, reader)
    else:
        in_graph = {ns.id for ns in nodes}
        if isinstance(groups, CircuitNodes) or not isinstance(groups, Sequence):
            raise ValueError(f"{fn}: groups must be a list of lists of node vectors")
        groups = [_check_merge_group(g, fn, in_graph, root) for g in groups]
    unit: dict[int, Any] = {ns.id: ("v", ns.id) for ns in nodes}
    for gi, members in enumerate(groups):
        for ns in members:
            if unit[ns.id][0] == "g":
                raise ValueError(f"{fn}: {ns.name} appears in more than one group")
            unit[ns.id] = ("g", gi)

    # topological order of the merged graph (Kahn), rejecting merges that would create a cycle
    members_of: dict[Any, list[CircuitNodes]] = defaultdict(list)
    for ns in nodes:
        if unit[ns.id][0] == "v":
            members_of[unit[ns.id]].append(ns)
    for gi, members in enumerate(groups):
        members_of[("g", gi)] = list(members)  # concatenation in the given order
    deps: dict[Any, set] = {u: set() for u in members_of}
    users: dict[Any, set] = defaultdict(set)
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

    b = _Builder()
    new: dict[int, tuple[CircuitNodes, int]] = {}  # old id -> (new vector, block offset)

    def sum_children(old_sums):
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

    for u in order:
        members = members_of[u]
        first = members[0]
        if u[0] == "v":
            ns = first
            if ns.is_input():
                out = b.input(ns, ns.var, ns.num_node_blocks, ns.block_size, lambda: reader.input_natural(ns))
            elif ns.is_prod():
                chs = [new[c.id][0] for c in ns.children]
                e = ns.edge_ids + np.asarray([new[c.id][1] for c in ns.children])[None, :]
                out = multiply(*chs, edge_ids=e, name=ns.name)
            else:
                chs, (e1,) = sum_children([ns])
                out = b.sum(ns, chs, ns.num_node_blocks, ns.block_size, np.stack([ns.edge_ids[0], e1]),
                            lambda: reader.sum_blocks(ns))
            new[ns.id] = (out, 0)
            continue

        offsets = np.concatenate([[0], np.cumsum([m.num_node_blocks for m in members])])
        name = f"{first.name}+{len(members) - 1}"
        if first.is_input():
            nats = [reader.input_natural(m) for m in members]
            out = InputNodes(first.var, int(offsets[-1]), first.block_size, first.dist, name=name)
            _set_input_params(out, _concat_params(nats, members, fn, "input"))
        elif first.is_sum():
            chs, mapped = sum_children(members)
            edges = np.concatenate([np.stack([m.edge_ids[0] + o, e1]) for m, o, e1 in zip(members, offsets, mapped)],
                                   axis=1)
            out = summate(*chs, num_node_blocks=int(offsets[-1]), block_size=first.block_size, edge_ids=edges,
                          name=name)
            blocks = _concat_params([reader.sum_blocks(m) for m in members], members, fn, "sum")
            if blocks is not None:
                out.set_params(blocks)
        else:
            scopes = [c.scope for c in first.children]
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
            out = multiply(*chs, edge_ids=np.concatenate(rows), name=name)
        for m, o in zip(members, offsets):
            new[m.id] = (out, int(o))
    return new[root.id][0]


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


# ----------------------------------------------------------------------------------------------
# prune
# ----------------------------------------------------------------------------------------------

def prune(root: CircuitNodes, circuit, params=None, flows=None, *, keep_frac: float | None = None,
          threshold: float | None = None, scores: Mapping[CircuitNodes, Any] | None = None) -> CircuitNodes:
    """Drop sum edge blocks with low scores and renormalize the remaining weights.

    The score of an edge block is its total flow (expected count, summed over the ``Kp x Kc`` edges of
    the block) from ``circuit.get_node_flows(flows, node)``, or ``scores[node]`` ``[num_edge_blocks]``.
    A tied group is pruned once: its score is the pooled flow (or the sum of its members' scores) and
    every member keeps the same edges. Every parent block keeps at least its best edge block, so
    nodes keep at least one child. Children a sum no longer reaches are dropped from its children, and
    vectors no longer reachable disappear from the graph. Kept weights are renormalized per node (a node
    whose kept weights are all zero becomes uniform over its kept edges).

    Args:
        root: the root vector the circuit was compiled from.
        circuit: the compiled circuit.
        params: its parameters (default ``circuit.params``).
        flows: a flows pytree of the circuit (``circuit.flows(...)``, summed over batches); required
            unless ``scores`` is given.
        keep_frac: keep the ``ceil(keep_frac * total)`` highest-scoring edge blocks of all scored sums
            (ties: earlier edges first), plus the per-parent minimum.
        threshold: or keep edge blocks with score ``>= threshold`` (plus the per-parent minimum).
        scores: optional ``{sum vector: [num_edge_blocks]}``; sums without a score are not pruned.

    Returns:
        the new root.
    """
    fn = "prune"
    nodes = _check_root(root, fn)
    if circuit is None:
        raise ValueError(f"{fn}: needs the compiled circuit (and its params and flows)")
    reader = _Params(fn, circuit, params)
    if (keep_frac is None) == (threshold is None):
        raise ValueError(f"{fn}: give exactly one of keep_frac and threshold")
    if keep_frac is not None and (not isinstance(keep_frac, (int, float)) or not 0.0 < keep_frac <= 1.0):
        raise ValueError(f"{fn}: keep_frac must be a float in (0, 1], got {keep_frac!r}")
    if threshold is not None and (not isinstance(threshold, (int, float, np.floating)) or math.isnan(threshold)):
        raise ValueError(f"{fn}: threshold must be a number, got {threshold!r}")
    if flows is None and scores is None:
        raise ValueError(f"{fn}: give flows= (circuit.flows(params, x)) or scores=")

    groups = {k: v for k, v in _tie_groups(nodes).items() if v[0].is_sum()}
    group_scores: dict[int, np.ndarray] = {}
    if scores is not None:
        in_graph = {ns.id for ns in nodes}
        for ns, sc in scores.items():
            if not isinstance(ns, SumNodes) or ns.id not in in_graph:
                raise ValueError(f"{fn}: scores has a key that is not a sum vector of this graph: {ns!r}")
            sc = np.asarray(sc, dtype=np.float64)
            if sc.shape != (ns.edge_ids.shape[1],) or not np.all(np.isfinite(sc)):
                raise ValueError(f"{fn}: scores[{ns.name}] must be finite with shape [num_edge_blocks] = "
                                 f"[{ns.edge_ids.shape[1]}], got shape {sc.shape}")
            k = ns.source.id
            group_scores[k] = group_scores.get(k, 0.0) + sc
    else:
        # circuit.get_node_flows(flows, src) at the edge blocks, read from host copies of the flows
        host: dict[str, np.ndarray] = {}
        for k, members in groups.items():
            src = members[0].source
            pl = reader._placement(src, circuit.structure.sum_placement)
            if pl.group not in host:
                try:
                    host[pl.group] = np.asarray(flows["sum"][pl.group], dtype=np.float64)
                except (KeyError, TypeError, IndexError):
                    raise ValueError(f"{fn}: flows has no entry ['sum'][{pl.group!r}]; pass a flows pytree of the "
                                     f"circuit (circuit.flows(params, x))") from None
            group_scores[k] = host[pl.group][pl.start:pl.start + pl.num_edge_blocks].sum(axis=(1, 2))

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
        for p in np.nonzero(~has)[0]:  # keep the best edge block of a parent block that lost all
            cand = np.nonzero(par == p)[0]
            keep[cand[np.argmax(sc[cand])]] = True
        kept[k] = keep

    # surviving children of every sum, and the vectors still reachable
    def kept_children(ns):
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

    alive = {root.id}
    for ns in reversed(nodes):
        if ns.id not in alive:
            continue
        idx = kept_children(ns) if ns.is_sum() else range(len(ns.children))
        for j in idx:
            alive.add(ns.children[j].id)

    b = _Builder()
    new: dict[int, CircuitNodes] = {}
    for ns in nodes:
        if ns.id not in alive:
            continue
        if ns.is_input():
            new[ns.id] = b.input(ns, ns.var, ns.num_node_blocks, ns.block_size, lambda: reader.input_natural(ns))
        elif ns.is_prod():
            new[ns.id] = multiply(*[new[c.id] for c in ns.children], edge_ids=ns.edge_ids.copy(), name=ns.name)
        else:
            keep = kept.get(ns.source.id)
            if keep is None:
                keep = np.ones(ns.edge_ids.shape[1], bool)
            idx = kept_children(ns)
            remap = np.full(ns.num_ch_node_blocks, -1, dtype=np.int64)
            n = 0
            offs = np.concatenate([[0], np.cumsum([c.num_node_blocks for c in ns.children])])
            for j in idx:
                c = ns.children[j]
                remap[offs[j]:offs[j + 1]] = n + np.arange(c.num_node_blocks)
                n += c.num_node_blocks
            edges = np.stack([ns.edge_ids[0][keep], remap[ns.edge_ids[1][keep]]])

            def blocks(ns=ns, keep=keep):
                old = reader.sum_blocks(ns)
                return None if old is None else _normalize_blocks(old[keep], ns.edge_ids[0][keep],
                                                                  ns.num_node_blocks)

            new[ns.id] = b.sum(ns, [new[ns.children[j].id] for j in idx], ns.num_node_blocks, ns.block_size,
                               edges, blocks)
    return new[root.id]


# ----------------------------------------------------------------------------------------------
# grow
# ----------------------------------------------------------------------------------------------

def _perturb_input(dist, nat: dict[str, np.ndarray], copies: int, noise: float, rng) -> dict[str, np.ndarray]:
    """Tile natural params ``copies`` times along the node axis; perturb every copy but the first."""
    out = {k: np.concatenate([v] * copies) for k, v in nat.items()}
    if noise == 0.0 or copies == 1:
        return out
    n = next(iter(nat.values())).shape[0]
    if "probs" in out:
        eps = rng.standard_normal(out["probs"].shape)
        eps[:n] = 0.0
        p = out["probs"] * np.exp(noise * eps)
        out["probs"] = p / p.sum(axis=1, keepdims=True)
    elif isinstance(dist, dists.Bernoulli):
        eps = rng.standard_normal((out["p"].shape[0], 2))
        eps[:n] = 0.0
        q = np.stack([1.0 - out["p"], out["p"]], axis=1) * np.exp(noise * eps)
        out["p"] = q[:, 1] / q.sum(axis=1)
    elif "mu" in out:
        scale = out["sigma"] if "sigma" in out else out["s"]
        eps = rng.standard_normal(out["mu"].shape)
        eps[:n] = 0.0
        out["mu"] = out["mu"] + noise * scale * eps
    return out


def grow(root: CircuitNodes, num_duplicates: int = 1, noise: float = 0.0, *, seed: int = 0, circuit=None,
         params=None) -> CircuitNodes:
    """Grow the circuit: every vector but the root gets ``num_duplicates`` extra copies of its blocks
    (``num_node_blocks`` times ``1 + num_duplicates``), as in PyJuice's ``grow`` (Liu et al., 2023).

    With ``t = 1 + num_duplicates``: copy ``a`` of a product multiplies copy ``a`` of its children; copy
    ``a`` of a sum connects to every copy ``b`` of its children with the old weights times
    ``exp(noise * eps)``, ``eps ~ N(0, 1)`` per weight (``eps = 0`` for the original pair ``a = b = 0``),
    renormalized; the root connects to every copy of its children. Input copies ``1..t-1`` get
    perturbed parameters (categorical-like: probabilities times ``exp(noise * eps)``, renormalized;
    Gaussian / discretized logistic: ``mu + noise * scale * eps``). With ``noise=0`` every copy computes
    the original function, so the likelihood is unchanged. Ties are kept (one draw per tie group).

    Args:
        root: the root vector.
        num_duplicates: extra copies per vector (a positive int).
        noise: scale of the multiplicative perturbation (>= 0).
        seed: seed of the perturbation (numpy, host side).
        circuit, params: take parameters from a compiled circuit (see the module docstring). Vectors
            without parameters stay without (the compiled result draws them at random).

    Returns:
        the new root.
    """
    fn = "grow"
    nodes = _check_root(root, fn)
    if not isinstance(num_duplicates, (int, np.integer)) or isinstance(num_duplicates, bool) or num_duplicates < 1:
        raise ValueError(f"{fn}: num_duplicates must be a positive int, got {num_duplicates!r}")
    if not isinstance(noise, (int, float)) or not math.isfinite(noise) or noise < 0:
        raise ValueError(f"{fn}: noise must be a finite float >= 0, got {noise!r}")
    reader = _Params(fn, circuit, params)
    rng = np.random.default_rng(seed)
    t = int(num_duplicates) + 1
    b = _Builder()
    new: dict[int, CircuitNodes] = {}
    for ns in nodes:
        chs = [new[c.id] for c in ns.children]
        g = 1 if ns is root else t  # copies of this vector
        nb = ns.num_node_blocks * g
        if ns.is_input():
            if g > 1 and not _indicator_concat_ok(ns):
                raise ValueError(f"{fn}: {ns.name} has {ns.num_nodes} Indicator nodes, not a multiple of num_states="
                                 f"{ns.dist.num_states}, so its copies would indicate other values")

            def nat(ns=ns, g=g):
                v = reader.input_natural(ns)
                return None if v is None else _perturb_input(ns.dist, v, g, float(noise), rng)
            new[ns.id] = b.input(ns, ns.var, nb, ns.block_size, nat)
        elif ns.is_prod():
            cnb = np.asarray([c.num_node_blocks for c in ns.children])
            e = np.concatenate([ns.edge_ids + a * cnb[None, :] for a in range(g)])
            new[ns.id] = multiply(*chs, edge_ids=e, name=ns.name)
        else:
            cnb = np.asarray([c.num_node_blocks for c in ns.children])
            offs = np.concatenate([[0], np.cumsum(cnb)])
            which = np.searchsorted(offs, ns.edge_ids[1], side="right") - 1  # child of every edge
            local = ns.edge_ids[1] - offs[which]
            E = ns.edge_ids.shape[1]
            a_idx, b_idx = np.meshgrid(np.arange(g), np.arange(t), indexing="ij")  # [g, t]
            par = (a_idx[:, :, None] * ns.num_node_blocks + ns.edge_ids[0][None, None, :]).reshape(-1)
            ch = (t * offs[which][None, None, :] + b_idx[:, :, None] * cnb[which][None, None, :]
                  + local[None, None, :]).reshape(-1)

            def blocks(ns=ns, g=g, E=E):
                old = reader.sum_blocks(ns)
                if old is None:
                    return None
                eps = rng.standard_normal((g, t) + old.shape)
                eps[0, 0] = 0.0
                w = old[None, None] * np.exp(float(noise) * eps)
                return w.reshape(g * t * E, *old.shape[1:])

            new[ns.id] = b.sum(ns, chs, nb, ns.block_size, np.stack([par, ch]), blocks)
    return new[root.id]


# ----------------------------------------------------------------------------------------------
# latent variable distillation
# ----------------------------------------------------------------------------------------------

def hclt_latent_regions(root: CircuitNodes) -> dict[int, ProdNodes]:
    """``{variable: product vector}`` for a circuit built by :func:`jaxpc.structures.HCLT`: node ``k``
    of the product vector of variable ``v`` stands for ``z_v = k`` (it multiplies ``P(x_v | z_v = k)``
    with the subtrees' sums). Variables at the leaves of the Chow-Liu tree have no such vector (their
    latent is summed into the parent's input vector). Found as the products whose last child is an
    input vector (HCLT's construction order)."""
    nodes = _check_root(root, "hclt_latent_regions")
    out: dict[int, ProdNodes] = {}
    for ns in nodes:
        if ns.is_prod() and ns.children[-1].is_input():
            out.setdefault(ns.children[-1].var, ns)
    return out


def _lvd_input(dist, z: np.ndarray, vals: np.ndarray, n: int, pc: float, where: str, old):
    """Natural parameters of ``n`` input nodes from the latent ``z`` ``[M]`` and values ``vals`` ``[M]``."""
    if isinstance(dist, (dists.Literal, dists.Indicator)):
        return None
    if isinstance(dist, dists.Categorical):  # also Bernoulli and MaskedCategorical
        K = dist.num_cats
        if np.any(vals != np.round(vals)) or np.any(vals < 0) or np.any(vals >= K):
            raise ValueError(f"lvd_init: x holds values outside [0, {K}) for {where} ({dist!r})")
        counts = np.zeros((n, K))
        np.add.at(counts, (z, vals.astype(np.int64)), 1.0)
        counts += pc
        if isinstance(dist, dists.MaskedCategorical):
            mask = old["mask"]
            counts = np.where(mask, counts, 0.0)
            tot = counts.sum(axis=1, keepdims=True)
            probs = np.where(tot > 0, counts / np.where(tot > 0, tot, 1.0), mask / mask.sum(axis=1, keepdims=True))
            return {"mask": mask, "probs": probs}
        tot = counts.sum(axis=1, keepdims=True)
        probs = np.where(tot > 0, counts / np.where(tot > 0, tot, 1.0), 1.0 / K)
        if isinstance(dist, dists.Bernoulli):
            return {"p": probs[:, 1]}
        return {"probs": probs}
    if isinstance(dist, (dists.Gaussian, dists.DiscreteLogistic)):
        if isinstance(dist, dists.DiscreteLogistic):
            vals = dist.lo + (np.clip(vals, 0, dist.num_cats - 1) + 0.5) * dist.width
            min_std = dist.min_std
        else:
            min_std = dist.min_sigma
        gmu, gvar = (float(vals.mean()), float(vals.var())) if vals.size else (0.0, 1.0)
        s0 = np.bincount(z, minlength=n).astype(np.float64) + pc
        s1 = np.bincount(z, weights=vals, minlength=n) + pc * gmu
        s2 = np.bincount(z, weights=vals * vals, minlength=n) + pc * (gvar + gmu * gmu)
        ok = s0 > 0
        mu = np.where(ok, s1 / np.where(ok, s0, 1.0), gmu)
        var = np.where(ok, s2 / np.where(ok, s0, 1.0) - mu * mu, gvar)
        std = np.sqrt(np.maximum(var, min_std ** 2))
        if isinstance(dist, dists.DiscreteLogistic):
            return {"mu": mu, "s": std * math.sqrt(3.0) / math.pi}
        return {"mu": mu, "sigma": std}
    raise ValueError(f"lvd_init: no counting rule for {dist!r} ({where})")


def lvd_init(root: CircuitNodes, regions, latents, x=None, missing=None, *, pseudocount: float = 0.1,
             circuit=None, params=None) -> CircuitNodes:
    """Latent variable distillation (Liu et al., 2023; PyJuice's counting backend): a copy of the graph
    whose parameters are set from co-occurrence counts of latent assignments.

    An *assignment* of a vector is, per sample, the index of the node (``0 .. num_nodes-1``) that
    explains the sample, e.g. a k-means cluster id of the sample's features of that region.

    * Given: column ``r`` of ``latents`` is the assignment of ``regions[r]``.
    * Derived, top-down: a product with an assignment passes to each child without one the child node
      its assigned node multiplies (for identity edges: the same index), so in an HCLT the sum and
      input vectors under the product of ``z_v`` take ``z_v``; a child reached from several products
      takes the first in top-down order. Vectors of a single node (the root) are always assigned 0.
    * Sums with an assignment ``a``: ``w[i, j] propto count(a = i, a_c = j) + pseudocount`` over the edges
      to assigned children ``c`` (node ``j`` over the concatenated children); edges to children without
      an assignment get the pseudocount only; co-occurrences outside the edges are dropped. A node
      without counts (and ``pseudocount=0``) becomes uniform over its edges. Sums without an assignment,
      or whose children have none, keep their parameters.
    * Inputs with an assignment, when ``x`` is given: categorical-like leaves
      ``P(x = k | node i) propto count(a = i, x = k) + pseudocount``; Gaussian / discretized logistic
      leaves the per-node mean and standard deviation of their values (bin centers), with
      ``pseudocount`` pseudo-samples at the global moments of the variable. Samples whose value is
      marked ``missing`` are skipped. Literal / indicator leaves have nothing to set.

    Counts of tied vectors are pooled (like flows), so a tied group gets one estimate.

    HCLT: pass ``regions=hclt_latent_regions(root)`` and per-variable latents ``[N, num_vars]``.
    PD-like circuits (a region's sum over the products of its splits): give each region's sum vector
    and each product vector an assignment (a product's nodes pair equal indices of its children, so
    its assignment is not implied by the regions'); edges to unassigned products get the pseudocount.

    Args:
        root: the root vector.
        regions: a sequence of ``R`` vectors of the graph (column ``r`` <-> ``regions[r]``) or a dict
            ``{column: vector}`` (e.g. :func:`hclt_latent_regions` with ``latents`` ``[N, num_vars]``).
        latents: int ``[N, num_columns]`` assignments.
        x: optional data ``[N, num_vars]`` for the input vectors.
        missing: optional ``bool[N, num_vars]`` mask of ``x``.
        pseudocount: added to every count (>= 0).
        circuit, params: copy the other parameters from a compiled circuit (see the module docstring).

    Returns:
        the new root.
    """
    fn = "lvd_init"
    nodes = _check_root(root, fn)
    reader = _Params(fn, circuit, params)
    if not isinstance(pseudocount, (int, float)) or not math.isfinite(pseudocount) or pseudocount < 0:
        raise ValueError(f"{fn}: pseudocount must be a finite float >= 0, got {pseudocount!r}")
    z_all = np.asarray(latents)
    if z_all.ndim != 2 or not (np.issubdtype(z_all.dtype, np.integer)):
        raise ValueError(f"{fn}: latents must be an int array [num_samples, num_columns], got dtype {z_all.dtype} "
                         f"and shape {z_all.shape}")
    N = z_all.shape[0]
    if isinstance(regions, Mapping):
        items = list(regions.items())
    elif isinstance(regions, Sequence) and not isinstance(regions, CircuitNodes):
        items = list(enumerate(regions))
    else:
        raise ValueError(f"{fn}: regions must be a sequence of node vectors or a dict {{column: vector}}")
    in_graph = {ns.id: ns for ns in nodes}
    given: dict[int, np.ndarray] = {}
    for col, ns in items:
        if not isinstance(ns, CircuitNodes) or ns.id not in in_graph:
            raise ValueError(f"{fn}: regions[{col!r}] is not a vector of this graph: {ns!r}")
        if not isinstance(col, (int, np.integer)) or not 0 <= col < z_all.shape[1]:
            raise ValueError(f"{fn}: regions names column {col!r}, but latents has {z_all.shape[1]} columns")
        if ns.id in given:
            raise ValueError(f"{fn}: {ns.name} is listed twice in regions")
        z = z_all[:, col].astype(np.int64)
        if z.size and (z.min() < 0 or z.max() >= ns.num_nodes):
            raise ValueError(f"{fn}: latents[:, {col}] holds values in [{z.min()}, {z.max()}], but {ns.name} has "
                             f"{ns.num_nodes} nodes")
        given[ns.id] = z

    assign = dict(given)
    for ns in nodes:
        if ns.num_nodes == 1 and ns.id not in assign:
            assign[ns.id] = np.zeros(N, np.int64)
    for ns in reversed(nodes):  # parents before children
        if ns.is_prod() and ns.id in assign:
            a = assign[ns.id]
            K = ns.block_size
            for j, c in enumerate(ns.children):
                if c.id not in assign:
                    assign[c.id] = ns.edge_ids[a // K, j] * K + a % K

    xa = None
    if x is not None:
        xa = np.asarray(x, dtype=np.float64)
        max_var = max((ns.var for ns in nodes if ns.is_input()), default=-1)
        if xa.ndim != 2 or xa.shape[0] != N or xa.shape[1] <= max_var:
            raise ValueError(f"{fn}: x must have shape [num_samples, num_vars] = [{N}, >{max_var}], got {xa.shape}")
        if missing is not None:
            missing = np.asarray(missing, dtype=bool)
            if missing.shape != xa.shape:
                raise ValueError(f"{fn}: missing must have the shape of x {xa.shape}, got {missing.shape}")
    elif missing is not None:
        raise ValueError(f"{fn}: missing= needs x=")

    new_root, new = _copy(root, reader, lambda v: v, fn)

    for members in _tie_groups(nodes).values():
        first = members[0]
        used = [m for m in members if m.id in assign]
        if first.is_sum():
            used = [m for m in used if any(c.id in assign for c in m.children)]
            if not used:
                continue
            E, Kp, Kc = first.edge_ids.shape[1], first.block_size, first.ch_block_size
            ncb = first.num_ch_node_blocks
            keys = first.edge_ids[0] * ncb + first.edge_ids[1]
            order = np.argsort(keys)
            counts = np.zeros((E, Kp, Kc))
            for m in used:
                a = assign[m.id]
                o = 0
                for c in m.children:
                    if c.id in assign:
                        ac = assign[c.id] + o * Kc  # node index over the concatenated children
                        k = (a // Kp) * ncb + ac // Kc
                        pos = np.searchsorted(keys, k, sorter=order)
                        pos = np.minimum(pos, E - 1)
                        hit = keys[order[pos]] == k
                        np.add.at(counts, (order[pos[hit]], (a % Kp)[hit], (ac % Kc)[hit]), 1.0)
                    o += c.num_node_blocks
            new[first.id].set_params(_normalize_blocks(counts + pseudocount, first.edge_ids[0],
                                                       first.num_node_blocks))
        elif first.is_input() and xa is not None and used:
            zs, vs = [], []
            for m in used:
                keep = np.ones(N, bool) if missing is None else ~missing[:, m.var]
                zs.append(assign[m.id][keep])
                vs.append(xa[keep, m.var])
            old = reader.input_natural(first)
            if isinstance(first.dist, dists.MaskedCategorical) and old is None:
                raise ValueError(f"{fn}: {first.name} is a MaskedCategorical vector without its mask")
            nat = _lvd_input(first.dist, np.concatenate(zs), np.concatenate(vs), first.num_nodes,
                             float(pseudocount), first.name, old)
            if nat is not None:
                _set_input_params(new[first.id], nat)
    return new_root
