"""Random and tensorized SPNs (Peharz et al., 2020)."""

from __future__ import annotations

import numpy as np

from .. import distributions
from ..nodes import CircuitNodes, inputs, multiply, summate
from ..nodes.nodes import check_dist
from ._util import check_int, check_latents, check_seed

__all__ = ["RAT_SPN"]


def RAT_SPN(num_vars: int, num_latents: int, depth: int, num_repetitions: int, num_pieces: int = 2,
            input_dist: distributions.Distribution | None = None, block_size: int | None = None,
            seed: int = 0) -> CircuitNodes:
    """A RAT-SPN: ``num_repetitions`` random recursive partitions of the variables, each split into
    ``num_pieces`` near-equal parts down to ``depth`` (or until a scope is smaller than
    ``num_pieces``); every region has ``num_latents`` sum nodes over the product of its parts, and the
    root mixes the repetitions.

    Args:
        num_vars: number of variables (ids ``0 .. num_vars - 1``), an int >= ``num_pieces``: fewer could not be
            split at all, and every repetition would be the same product of all the leaves (a ``ValueError``).
        num_latents: sum nodes per region, and nodes of each variable's input vector (node ``i`` of a region's
            product multiplies node ``i`` of each of its parts).
        depth: levels of splits, an int >= 1: the variables are split into ``num_pieces`` parts, each part again,
            ``depth`` times in all; the regions at the last level (or smaller than ``num_pieces``) are leaf
            regions, a sum over the product of their variables' input vectors. Leaf regions over the same variables
            (in several repetitions, or single variables) share that product, which would compute the same values
            again, and each keep a sum vector of their own. ``depth=0`` would split nothing and
            make every repetition the same product of all the leaves, so it raises a ``ValueError``.
        num_repetitions: random partitions (drawn one after the other from ``seed``), mixed by the root's single
            sum node over the ``num_repetitions * num_latents`` top products; a positive int.
        num_pieces: parts of each split, an int >= 2 (2: binary splits; the first ``len(scope) % num_pieces``
            parts get one variable more). A region of fewer than ``num_pieces`` variables is not split (it is a
            leaf region, as PyJuice builds it), so levels past those where every region is that small add
            nothing.
        input_dist: leaf distribution (default ``Categorical(num_cats=256)``); one input vector per
            variable is shared by all repetitions.
        block_size: default: largest power of two dividing ``num_latents``, at most 256.
        seed: seed of the random partitions, an int >= 0.
    """
    num_vars, depth, num_repetitions, num_pieces = (
        check_int("RAT_SPN", name, v, lo) for name, v, lo in (
            ("num_vars", num_vars, 1), ("depth", depth, 0), ("num_repetitions", num_repetitions, 1),
            ("num_pieces", num_pieces, 2)))
    if depth == 0:
        raise ValueError("RAT_SPN: depth must be >= 1 (the levels of splits), got 0: depth=0 splits nothing, so every "
                         "repetition would be the same product of all the leaves")
    if num_vars < num_pieces:
        raise ValueError(f"RAT_SPN: num_vars={num_vars} is fewer than num_pieces={num_pieces}: the variables cannot "
                         f"be split, so every repetition would be the same product of all the leaves; give "
                         f"num_pieces <= num_vars")
    bs, nb = check_latents("RAT_SPN", num_latents, block_size, 256)
    dist = check_dist("RAT_SPN", "input_dist", input_dist, distributions.Categorical(num_cats=256))
    rng = np.random.default_rng(check_seed("RAT_SPN", seed))
    leaves = [inputs(v, num_node_blocks=nb, block_size=bs, dist=dist) for v in range(num_vars)]
    leaf_products: dict[frozenset[int], CircuitNodes] = {}  # one product per set of variables: the same values

    def region(scope: list[int], d: int):
        if d >= depth or len(scope) < num_pieces:
            key = frozenset(scope)
            if key not in leaf_products:
                leaf_products[key] = multiply(*[leaves[v] for v in scope])
            return summate(leaf_products[key], num_node_blocks=nb, block_size=bs)
        order = [scope[i] for i in rng.permutation(len(scope))]
        q, r = divmod(len(order), num_pieces)
        parts, start = [], 0
        for i in range(num_pieces):
            end = start + q + (i < r)
            parts.append(order[start:end])
            start = end
        return summate(multiply(*[region(p, d + 1) for p in parts]), num_node_blocks=nb, block_size=bs)

    tops = [region(list(range(num_vars)), 0).children[0] for _ in range(num_repetitions)]
    return summate(*tops, num_node_blocks=1, block_size=1)
