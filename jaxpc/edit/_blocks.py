"""Change block sizes without changing the function: :func:`blockify` (larger blocks) and
:func:`unblockify` (smaller blocks)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from ..nodes import CircuitNodes, ProdNodes, SumNodes, multiply
from ._graph import as_real, check_root, tie_groups
from ._params import Builder, Params


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

    Sum gates keep their gate block size (it divides the larger block size) and their ``tie_to``
    (gate-tied vectors share one factor, as tied vectors do); a coarse edge block has the gate
    columns of its ``m * block_size`` rows, which scale every sub-block it contains.

    Args:
        root: the root vector.
        sparsity_tolerance: largest admissible fraction of padded sub-blocks per sum, in ``[0, 1)``.
        max_block_size: largest block size to create (blocks already larger are kept).
        circuit, params: take parameters from a compiled circuit (see :mod:`jaxpc.edit`).

    Returns:
        the new root.
    """
    nodes = check_root(root, "blockify")
    tol = as_real(sparsity_tolerance)
    if tol is None or not 0.0 <= tol < 1.0:
        raise ValueError(f"blockify: sparsity_tolerance must be a float in [0, 1), got {sparsity_tolerance!r}")
    if not isinstance(max_block_size, (int, np.integer)) or isinstance(max_block_size, bool) or max_block_size < 1:
        raise ValueError(f"blockify: max_block_size must be a positive int, got {max_block_size!r}")
    reader = Params("blockify", circuit, params)
    uf = _factor_classes(nodes)
    factor = _largest_factors(nodes, uf, max_block_size)
    _shrink_to_tolerance(nodes, uf, factor, tol)
    return _build_coarse(nodes, {ns.id: factor[uf.find(ns.id)] for ns in nodes}, reader)[root.id]


def _factor_classes(nodes: Sequence[CircuitNodes]) -> _UnionFind:
    """Classes of vectors that must share one grouping factor: a product and its children, the children
    of a sum, the members of a tie group and gate-tied sums (and their children, for sums)."""
    uf = _UnionFind()
    for ns in nodes:
        uf.find(ns.id)
        if ns.is_prod():
            for c in ns.children:
                uf.union(ns.id, c.id)
        elif ns.is_sum():
            for c in ns.children[1:]:
                uf.union(ns.children[0].id, c.id)
    for members in tie_groups(nodes).values():
        for m in members[1:]:
            uf.union(members[0].id, m.id)
            if m.is_sum():
                uf.union(members[0].children[0].id, m.children[0].id)
    in_graph = {ns.id for ns in nodes}
    for ns in nodes:
        tie = ns.gates.tie_to if ns.is_sum() and ns.gates is not None else None
        if tie is not None and tie.id in in_graph and tie.is_sum():
            uf.union(ns.id, tie.id)
            uf.union(ns.children[0].id, tie.children[0].id)
    return uf


def _largest_factors(nodes: Sequence[CircuitNodes], uf: _UnionFind, max_block_size: int) -> dict[int, int]:
    """``{class id: factor}``: the largest power of two that divides every member's ``num_node_blocks``,
    keeps ``factor * block_size <= max_block_size`` and keeps every product of the class aligned."""
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
    return factor


def _shrink_to_tolerance(nodes: Sequence[CircuitNodes], uf: _UnionFind, factor: dict[int, int],
                         sparsity_tolerance: float) -> None:
    """Halve factors in place until every sum's padding is within the tolerance (monotone: halving a
    factor never lowers the fill, and factors of 1 need no padding)."""
    sums = [members[0] for members in tie_groups(nodes).values() if members[0].is_sum()]
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


def _build_coarse(nodes: Sequence[CircuitNodes], factor: dict[int, int], reader: Params) -> dict[int, CircuitNodes]:
    """The new vectors, ``{old id: new vector}``, with ``factor[old id]`` old blocks per new block."""
    b = Builder("blockify")
    new: dict[int, CircuitNodes] = {}
    for ns in nodes:
        m = factor[ns.id]
        nb, K = ns.num_node_blocks // m, ns.block_size * m
        chs = [new[c.id] for c in ns.children]
        if ns.is_input():
            new[ns.id] = b.input(ns, ns.var, nb, K, lambda: reader.input_natural(ns))
        elif ns.is_prod():
            e = ns.edge_ids.reshape(nb, m, -1)[:, 0, :] // m
            new[ns.id] = multiply(*chs, edge_ids=e, name=ns.name)
        else:
            new[ns.id] = _coarse_sum(ns, chs, m, factor[ns.children[0].id], b, reader)
    b.set_gates(nodes)
    return new


def _coarse_sum(ns: SumNodes, chs: list[CircuitNodes], m: int, mc: int, b: Builder, reader: Params) -> SumNodes:
    """The sum ``ns`` over groups of ``m`` of its blocks and ``mc`` of its children's; sub-blocks that
    were not edges get zero weights."""
    edges, inv = _coarse_sum_edges(ns.edge_ids, m, mc, ns.num_ch_node_blocks)

    def blocks():
        old = reader.sum_blocks(ns)
        if old is None:
            return None
        Kp, Kc = ns.block_size, ns.ch_block_size
        out = np.zeros((edges.shape[1], m, Kp, mc, Kc))
        out[inv, ns.edge_ids[0] % m, :, ns.edge_ids[1] % mc, :] = old
        return out.reshape(edges.shape[1], m * Kp, mc * Kc)

    return b.sum(ns, chs, ns.num_node_blocks // m, ns.block_size * m, edges, blocks, edge_map=inv)


def unblockify(root: CircuitNodes, block_size: int = 1, *, circuit=None, params=None) -> CircuitNodes:
    """An equivalent graph with smaller blocks: every vector's block size ``K`` becomes
    ``gcd(K, block_size)`` (all 1 by default); a sum's edge block becomes the grid of the smaller
    blocks it contains, with the same weights. Node order and the function are unchanged.

    Sum gates keep their gate block size and ``tie_to``, each smaller edge block reading the gates of
    its rows; a ``ValueError`` names a vector whose gate block size does not divide its new block size
    (pass a ``block_size`` that is a multiple of it).

    Args:
        root: the root vector.
        block_size: the target block size (a positive int).
        circuit, params: take parameters from a compiled circuit (see :mod:`jaxpc.edit`).

    Returns:
        the new root.
    """
    nodes = check_root(root, "unblockify")
    if not isinstance(block_size, (int, np.integer)) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"unblockify: block_size must be a positive int, got {block_size!r}")
    reader = Params("unblockify", circuit, params)
    b = Builder("unblockify")
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
            new[ns.id] = _fine_sum(ns, chs, r, K, math.gcd(ns.ch_block_size, block_size), b, reader)
    b.set_gates(nodes)
    return new[root.id]


def _fine_sum(ns: SumNodes, chs: list[CircuitNodes], r: int, K: int, Kc: int, b: Builder,
              reader: Params) -> SumNodes:
    """The sum ``ns`` with blocks of ``K = block_size / r`` nodes and children's blocks of ``Kc``: every
    edge block becomes the ``r x (ch_block_size / Kc)`` grid of the smaller blocks it contains."""
    rc = ns.ch_block_size // Kc
    E = ns.edge_ids.shape[1]
    par = ns.edge_ids[0][:, None, None] * r + np.arange(r)[None, :, None]
    ch = ns.edge_ids[1][:, None, None] * rc + np.arange(rc)[None, None, :]
    edges = np.stack([np.broadcast_to(par, (E, r, rc)).reshape(-1),
                      np.broadcast_to(ch, (E, r, rc)).reshape(-1)])

    def blocks():
        old = reader.sum_blocks(ns)
        if old is None:
            return None
        E = old.shape[0]
        return old.reshape(E, r, K, rc, Kc).transpose(0, 1, 3, 2, 4).reshape(E * r * rc, K, Kc)

    return b.sum(ns, chs, ns.num_node_blocks * r, K, edges, blocks, edge_map=np.arange(E * r * rc).reshape(E, -1))
