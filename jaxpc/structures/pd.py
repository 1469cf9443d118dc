"""Poon-Domingos (PD) region structures for images and sequences, and PD with HCLT leaves.

A region is a hypercube of the data grid. Every split point inside it (per axis) yields a
product of the two halves; the region's sum mixes those products. Hypercubes without split
points become leaf regions: by default a block-diagonal sum over the product of one input
vector per variable. Variables are numbered row-major (``var = i0 * W + i1`` for ``(H, W)``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import numpy as np

from .. import distributions
from ..nodes import CircuitNodes, inputs, multiply, summate
from ..nodes.nodes import check_dist
from ._util import check_bool, check_int, check_latents, check_numbers, check_seed
from .hclt import HCLT

__all__ = ["PD", "PDHCLT"]

STRUCTURE_TYPES = ("sum_dominated", "prod_dominated")


def _split_points(data_shape, split_intervals, split_points, where: str = "PD"):
    n_axes = len(data_shape)
    if split_intervals is not None and split_points is not None:
        raise ValueError(f"{where}: give split_intervals or split_points, not both")
    if split_intervals is not None:
        if isinstance(split_intervals, numbers.Integral):
            split_intervals = (split_intervals,) * n_axes
        if not isinstance(split_intervals, (tuple, list, np.ndarray)) or len(split_intervals) != n_axes or any(
                not isinstance(s, numbers.Integral) or isinstance(s, (bool, np.bool_)) or s < 1
                for s in split_intervals):
            raise ValueError(f"{where}: split_intervals must be a positive int or one per axis ({n_axes}), "
                             f"got {split_intervals!r}")
        split_intervals = tuple(int(s) for s in split_intervals)
        return [list(range(split_intervals[a], data_shape[a], split_intervals[a])) for a in range(n_axes)]
    if split_points is None:
        raise ValueError(f"{where}: give split_intervals or split_points")
    if not isinstance(split_points, (tuple, list, np.ndarray)) or len(split_points) != n_axes or any(
            not isinstance(pts, (tuple, list, np.ndarray)) for pts in split_points):
        raise ValueError(f"{where}: split_points needs one list of split positions per axis ({n_axes}), such as "
                         f"{[[1]] * n_axes}, got {split_points!r}")
    for a, pts in enumerate(split_points):
        for p in pts:
            if not isinstance(p, numbers.Integral) or isinstance(p, bool) or not 0 < p < data_shape[a]:
                raise ValueError(f"{where}: split point {p!r} of axis {a} must be an int in (0, {data_shape[a]})")
        if len(set(int(p) for p in pts)) != len(pts):
            raise ValueError(f"{where}: split points of axis {a} must be distinct, got {list(pts)}")
    return [sorted(int(p) for p in pts) for pts in split_points]


def _check_shape(where: str, data_shape) -> tuple[int, ...]:
    """``data_shape`` as a tuple of ints, where it is a sequence of positive ints (not bools)."""
    if not isinstance(data_shape, (tuple, list, np.ndarray)) or np.ndim(data_shape) != 1 or not len(data_shape) or any(
            not isinstance(d, numbers.Integral) or isinstance(d, (bool, np.bool_)) or d < 1 for d in data_shape):
        raise ValueError(f"{where}: data_shape must be a tuple of positive ints, such as (28, 28) or (T,), "
                         f"got {data_shape!r}")
    return tuple(int(d) for d in data_shape)


def _cube_vars(cube, data_shape) -> list[int]:
    lo, hi = cube
    grids = np.meshgrid(*[np.arange(a, b) for a, b in zip(lo, hi)], indexing="ij")
    return np.ravel_multi_index([g.ravel() for g in grids], data_shape).tolist()


def PD(data_shape, num_latents: int, split_intervals=None, split_points=None, max_split_depth: int | None = None,
       max_prod_block_conns: int = 4, structure_type: str = "sum_dominated",
       input_dist: distributions.Distribution | None = None, tie_homogeneous_params: bool = False,
       block_size: int | None = None, leaf_fn=None, seed: int = 0) -> CircuitNodes:
    """A PD circuit over a grid ``data_shape`` (``(H, W)``, ``(H, W, C)``, ``(T,)``, ...).

    Args:
        data_shape: the grid's size per axis, a tuple of positive ints; the circuit has ``prod(data_shape)``
            variables, numbered row-major (``var = i0 * W + i1`` for ``(H, W)``).
        num_latents: nodes per region.
        split_intervals: split every ``k`` cells per axis (an int or one per axis), or
        split_points: explicit split positions per axis.
        max_split_depth: regions deeper than this become leaf regions.
        max_prod_block_conns: a sum with more candidate products connects each of its blocks to
            this many randomly chosen products (``seed``) instead of all.
        structure_type: ``"sum_dominated"`` (products share child sums) or ``"prod_dominated"``
            (each product gets its own copies of the child sums).
        input_dist: leaf distribution (default ``Categorical(num_cats=256)``).
        tie_homogeneous_params: tie sums and leaves of regions with the same shape (a bool, else a ``TypeError``).
        block_size: default: largest power of two dividing ``num_latents``, at most 16 (32 for
            ``num_latents > 32``).
        leaf_fn: optional ``f(variables, num_latents, block_size) -> node vector`` for leaf regions: a callable
            (else a ``TypeError``) returning a node vector (else a ``TypeError``) over exactly ``variables`` (else
            a ``ValueError``).
        seed: seed (an int >= 0) of the random choice of products under ``max_prod_block_conns`` (the structure
            only: the parameters are drawn by :func:`jaxpc.compile`'s own ``seed``); the same arguments and seed
            build the same structure.
    """
    return _pd("PD", data_shape, num_latents, split_intervals, split_points, max_split_depth, max_prod_block_conns,
               structure_type, input_dist, tie_homogeneous_params, block_size, leaf_fn, seed)


def _pd(where: str, data_shape, num_latents, split_intervals, split_points, max_split_depth, max_prod_block_conns,
        structure_type, input_dist, tie_homogeneous_params, block_size, leaf_fn, seed) -> CircuitNodes:
    """:func:`PD` with its errors naming ``where`` (the public builder called: ``"PD"`` or ``"PDHCLT"``)."""
    data_shape = _check_shape(where, data_shape)
    if structure_type not in STRUCTURE_TYPES:
        raise ValueError(f"{where}: structure_type must be one of {STRUCTURE_TYPES}, got {structure_type!r}")
    max_prod_block_conns = check_int(where, "max_prod_block_conns", max_prod_block_conns)
    if max_split_depth is not None:
        max_split_depth = check_int(where, "max_split_depth", max_split_depth, lo=0)
    num_latents = check_int(where, "num_latents", num_latents)  # (before the cap below compares it)
    bs, nb = check_latents(where, num_latents, block_size, 16 if num_latents <= 32 else 32)
    dist = check_dist(where, "input_dist", input_dist, distributions.Categorical(num_cats=256))
    tie = check_bool(where, "tie_homogeneous_params", tie_homogeneous_params)
    if leaf_fn is not None and not callable(leaf_fn):
        raise TypeError(f"{where}: leaf_fn must be a callable f(variables, num_latents, block_size) or None, got "
                        f"{type(leaf_fn).__name__}")
    builder = _PDBuilder(data_shape, _split_points(data_shape, split_intervals, split_points, where), num_latents,
                         bs, nb, dist, max_split_depth=max_split_depth, max_prod_block_conns=max_prod_block_conns,
                         structure_type=structure_type, tie=tie, leaf_fn=leaf_fn,
                         rng=np.random.default_rng(check_seed(where, seed)), where=where)
    root = builder.region(builder.root_cube, 1)
    if root.num_nodes != 1:  # the whole grid was a single leaf region
        root = summate(root, num_node_blocks=1, block_size=1)
    return root


@dataclasses.dataclass
class _PDBuilder:
    """The region nodes of one PD (see :func:`PD` for the arguments), memoized by hypercube ``(lo, hi)``; with
    ``tie``, the first sum of each region signature and the first input vector are the sources of the rest."""

    data_shape: tuple[int, ...]
    points: list[list[int]]  # split points per axis
    num_latents: int
    bs: int
    nb: int
    dist: distributions.Distribution
    max_split_depth: int | None
    max_prod_block_conns: int
    structure_type: str
    tie: bool
    leaf_fn: Any
    rng: np.random.Generator
    where: str = "PD"
    sources: dict = dataclasses.field(default_factory=dict)
    memo: dict = dataclasses.field(default_factory=dict)

    @property
    def root_cube(self) -> tuple:
        return (0,) * len(self.data_shape), self.data_shape

    def region(self, cube, depth: int) -> CircuitNodes:
        """The node vector of region ``cube`` at split depth ``depth``: the root's single sum, an inner region's
        sum over its split products, or a leaf region."""
        if cube in self.memo:
            return self.memo[cube]
        prods = self._split_products(cube, depth)
        if not prods:
            ns = self._leaf_region(cube)
        elif cube == self.root_cube:
            ns = summate(*prods, num_node_blocks=1, block_size=1)
        else:
            shape = (tuple(b - a for a, b in zip(*cube)), len(prods))
            ns = self._tied_sum(("inner", shape), prods, edge_ids=self._sparse_edges(len(prods)))
        self.memo[cube] = ns
        return ns

    def _split_products(self, cube, depth: int) -> list[CircuitNodes]:
        """One product of the two halves per split point inside ``cube`` (none below ``max_split_depth``)."""
        lo, hi = cube
        prods = []
        if self.max_split_depth is None or depth <= self.max_split_depth:
            for a in range(len(self.data_shape)):
                for sp in self.points[a]:
                    if lo[a] < sp < hi[a]:
                        left = (lo, hi[:a] + (sp,) + hi[a + 1:])
                        right = (lo[:a] + (sp,) + lo[a + 1:], hi)
                        c1, c2 = self.region(left, depth + 1), self.region(right, depth + 1)
                        if self.structure_type == "prod_dominated":
                            c1, c2 = c1.duplicate(), c2.duplicate()
                        prods.append(multiply(c1, c2))
        return prods

    def _sparse_edges(self, num_prods: int) -> np.ndarray | None:
        """Edges of a sum over ``num_prods`` products: None (all of them) up to ``max_prod_block_conns``, else each
        block joined to that many products drawn at random."""
        k = self.max_prod_block_conns
        if num_prods <= k:
            return None
        nb = self.nb
        chosen = np.argsort(self.rng.random((nb, num_prods)), axis=1)[:, :k]
        par = np.repeat(np.arange(nb), k * nb)
        ch = (chosen[:, :, None] * nb + np.arange(nb)[None, None, :]).reshape(-1)
        return np.stack([par, ch])

    def _tied_sum(self, sig, children, **kw) -> CircuitNodes:
        if self.tie and sig in self.sources:
            return self.sources[sig].duplicate(*children, tie_params=True)
        ns = summate(*children, num_node_blocks=self.nb, block_size=self.bs, **kw)
        if self.tie:
            self.sources[sig] = ns
        return ns

    def _leaf_region(self, cube) -> CircuitNodes:
        """``leaf_fn`` over the region's variables, or a block-diagonal sum over the product of one input vector
        per variable."""
        vs = _cube_vars(cube, self.data_shape)
        if self.leaf_fn is not None:
            ns = self.leaf_fn(vs, self.num_latents, self.bs)
            if not isinstance(ns, CircuitNodes):
                raise TypeError(f"{self.where}: leaf_fn must return a node vector, got {type(ns).__name__} for the "
                                f"variables {vs}")
            if ns.scope != sum(1 << v for v in vs):
                raise ValueError(f"{self.where}: leaf_fn returned {ns.name} over the variables {ns.scope_vars}, but "
                                 f"its leaf region holds the variables {vs}")
            return ns
        leaves = []
        for v in vs:
            if self.tie and "input" in self.sources:
                leaves.append(self.sources["input"].duplicate(v, tie_params=True))
            else:
                ns = inputs(v, num_node_blocks=self.nb, block_size=self.bs, dist=self.dist)
                self.sources.setdefault("input", ns)
                leaves.append(ns)
        prod = multiply(*leaves)
        shape = tuple(b - a for a, b in zip(*cube))
        return self._tied_sum(("leaf", shape), [prod], edge_ids=np.stack([np.arange(self.nb)] * 2))


def PDHCLT(data, data_shape, num_latents: int, split_intervals=None, split_points=None,
           max_split_depth: int | None = None, max_prod_block_conns: int = 4, structure_type: str = "sum_dominated",
           input_dist: distributions.Distribution | None = None, hclt_kwargs: dict | None = None,
           block_size: int | None = None, seed: int = 0) -> CircuitNodes:
    """A PD whose leaf regions are HCLTs learned from ``data`` ``[N, prod(data_shape)]``.

    Args:
        data: numbers ``[N, prod(data_shape)]``, the variables numbered row-major as in :func:`PD`; each leaf
            region's HCLT is learned from its columns (:func:`jaxpc.structures.HCLT`).
        data_shape, num_latents, split_intervals, split_points, max_split_depth, max_prod_block_conns,
            structure_type, block_size, seed: as for :func:`PD` (errors name ``PDHCLT``).
        input_dist: leaf distribution of the HCLTs (default ``Categorical(num_cats=256)``).
        hclt_kwargs: more arguments of each leaf region's :func:`~jaxpc.structures.HCLT` (default
            ``num_bins=32, sigma=0.5 / 32, chunk_size=32``).
    """
    data = np.asarray(data)
    check_numbers("PDHCLT", "data", data)
    data_shape = _check_shape("PDHCLT", data_shape)
    n_vars = math.prod(data_shape)
    if data.ndim != 2 or data.shape[1] != n_vars or data.shape[0] < 2:
        raise ValueError(f"PDHCLT: data must be [num_samples >= 2, {n_vars}] for data_shape {tuple(data_shape)}, "
                         f"got {data.shape}")
    kw = {"num_bins": 32, "sigma": 0.5 / 32, "chunk_size": 32, **(hclt_kwargs or {})}
    dist = input_dist or distributions.Categorical(num_cats=256)

    def leaf_fn(vs, L, bs):
        return HCLT(data[:, vs], L, input_dist=dist, num_root_ns=L, block_size=bs, variables=vs, **kw)

    return _pd("PDHCLT", data_shape, num_latents, split_intervals, split_points, max_split_depth,
               max_prod_block_conns, structure_type, dist, False, block_size, leaf_fn, seed)
