"""Latent variable distillation (:func:`lvd_init`): parameters from counts of latent assignments;
:func:`hclt_latent_regions` finds the vectors of an HCLT's latents."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from .. import distributions
from ..nodes import CircuitNodes, ProdNodes, SumNodes
from ._copy import copy_graph
from ._graph import as_real, check_root, tie_groups
from ._params import Params, normalize_blocks, set_input_params


def hclt_latent_regions(root: CircuitNodes) -> dict[int, ProdNodes]:
    """``{variable: product vector}`` for a circuit built by :func:`jaxpc.structures.HCLT`: node ``k``
    of the product vector of variable ``v`` stands for ``z_v = k`` (it multiplies ``P(x_v | z_v = k)``
    with the subtrees' sums). Variables at the leaves of the Chow-Liu tree have no such vector (their
    latent is summed into the parent's input vector). Found as the products whose last child is an
    input vector (HCLT's construction order).

    Raises a ``ValueError`` where the graph has no such product (not an HCLT, e.g. an HMM, or an HCLT of a single
    variable): give :func:`lvd_init` the regions of other structures yourself. The rule reads HCLT's construction
    and does not recognize one: the leaf regions of a PD or RAT-SPN (products of input vectors) match it too.
    ``root``: the circuit's root vector (not a node vector: a ``TypeError``)."""
    nodes = check_root(root, "hclt_latent_regions")
    out: dict[int, ProdNodes] = {}
    for ns in nodes:
        if ns.is_prod() and ns.children[-1].is_input():
            out.setdefault(ns.children[-1].var, ns)
    if not out:
        raise ValueError(f"hclt_latent_regions: no HCLT latent products found: no product vector of the graph of "
                         f"{root.name} has an input vector as its last child, as jaxpc.structures.HCLT builds them "
                         "(is it an HCLT of 2 or more variables?); for other structures pass lvd_init the regions "
                         "yourself")
    return out


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

    Counts of tied vectors are pooled (like flows), so a tied group gets one estimate. Sum gates are kept
    as :func:`deepcopy` keeps them.

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
        circuit, params: copy the other parameters from a compiled circuit (see :mod:`jaxpc.edit`).

    Returns:
        the new root.
    """
    fn = "lvd_init"
    nodes = check_root(root, fn)
    reader = Params(fn, circuit, params)
    pc = as_real(pseudocount)
    if pc is None or not math.isfinite(pc) or pc < 0:
        raise ValueError(f"{fn}: pseudocount must be a finite float >= 0, got {pseudocount!r}")
    z_all = np.asarray(latents)
    if z_all.ndim != 2 or not (np.issubdtype(z_all.dtype, np.integer)):
        raise ValueError(f"{fn}: latents must be an int array [num_samples, num_columns], got dtype {z_all.dtype} "
                         f"and shape {z_all.shape}")
    assign = _derive_assignments(nodes, _given_assignments(nodes, regions, z_all, fn), z_all.shape[0])
    xa, missing = _check_data(nodes, x, missing, z_all.shape[0], fn)
    new_root, new = copy_graph(root, reader, lambda v: v, fn)
    for members in tie_groups(nodes).values():
        _distill_group(members, new, assign, xa, missing, reader, pc, fn)
    return new_root


def _given_assignments(nodes: Sequence[CircuitNodes], regions, z_all: np.ndarray, fn: str) -> dict[int, np.ndarray]:
    """``{vector id: int64 [N]}`` from ``regions`` (a sequence or ``{column: vector}``) and the columns
    of ``z_all``."""
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
        if (not isinstance(col, (int, np.integer)) or isinstance(col, (bool, np.bool_))
                or not 0 <= col < z_all.shape[1]):
            raise ValueError(f"{fn}: regions names column {col!r}, but latents has {z_all.shape[1]} columns")
        if ns.id in given:
            raise ValueError(f"{fn}: {ns.name} is listed twice in regions")
        z = z_all[:, col].astype(np.int64)
        if z.size and (z.min() < 0 or z.max() >= ns.num_nodes):
            raise ValueError(f"{fn}: latents[:, {col}] holds values in [{z.min()}, {z.max()}], but {ns.name} has "
                             f"{ns.num_nodes} nodes")
        given[ns.id] = z
    return given


def _derive_assignments(nodes: Sequence[CircuitNodes], given: dict[int, np.ndarray],
                        N: int) -> dict[int, np.ndarray]:
    """The given assignments, 0 for single-node vectors, and those products pass down to their children."""
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
    return assign


def _check_data(nodes: Sequence[CircuitNodes], x, missing, N: int, fn: str):
    """``x`` as float64 ``[N, num_vars]`` and ``missing`` as bool of its shape (each None when not given)."""
    if x is None:
        if missing is not None:
            raise ValueError(f"{fn}: missing= needs x=")
        return None, None
    xa = np.asarray(x, dtype=np.float64)
    max_var = max((ns.var for ns in nodes if ns.is_input()), default=-1)
    if xa.ndim != 2 or xa.shape[0] != N or xa.shape[1] <= max_var:
        raise ValueError(f"{fn}: x must have shape [num_samples, num_vars] = [{N}, >{max_var}], got {xa.shape}")
    if missing is not None:
        missing = np.asarray(missing, dtype=bool)
        if missing.shape != xa.shape:
            raise ValueError(f"{fn}: missing must have the shape of x {xa.shape}, got {missing.shape}")
    used = sorted({ns.var for ns in nodes if ns.is_input()})
    bad = ~np.isfinite(xa[:, used]) & (True if missing is None else ~missing[:, used])
    if bad.any():
        i, j = (int(k[0]) for k in np.nonzero(bad))
        raise ValueError(f"{fn}: x[{i}, {used[j]}] = {xa[i, used[j]]} is not finite; mark unknown values with "
                         f"missing=")
    return xa, missing


def _distill_group(members: list[CircuitNodes], new: dict[int, CircuitNodes], assign: dict[int, np.ndarray],
                   x: np.ndarray | None, missing: np.ndarray | None, reader: Params, pc: float, fn: str) -> None:
    """Set the parameters of the new vector of the tie group ``members`` from the pooled counts of its
    assigned members (nothing to count: left as copied)."""
    first = members[0]
    used = [m for m in members if m.id in assign]
    if first.is_sum():
        used = [m for m in used if any(c.id in assign for c in m.children)]
        if used:
            counts = _sum_counts(first, used, assign)
            new[first.id].set_params(normalize_blocks(counts + pc, first.edge_ids[0], first.num_node_blocks))
    elif first.is_input() and x is not None and used:
        zs, vs = [], []
        for m in used:
            keep = np.ones(x.shape[0], bool) if missing is None else ~missing[:, m.var]
            zs.append(assign[m.id][keep])
            vs.append(x[keep, m.var])
        old = reader.input_natural(first)
        if isinstance(first.dist, distributions.MaskedCategorical) and old is None:
            raise ValueError(f"{fn}: {first.name} is a MaskedCategorical vector without its mask")
        nat = _lvd_input(first.dist, np.concatenate(zs), np.concatenate(vs), first.num_nodes, pc, first.name, old)
        if nat is not None:
            set_input_params(new[first.id], nat)


def _sum_counts(first: SumNodes, used: list[SumNodes], assign: dict[int, np.ndarray]) -> np.ndarray:
    """Co-occurrence counts ``[num_edge_blocks, Kp, Kc]`` of the assignments of the sums ``used`` (a tie
    group, edges of ``first``) and their assigned children; pairs outside the edges are dropped."""
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
    return counts


def _lvd_input(dist, z: np.ndarray, vals: np.ndarray, n: int, pc: float, where: str, old):
    """Natural parameters of ``n`` input nodes from the latent ``z`` ``[M]`` and values ``vals`` ``[M]``."""
    if isinstance(dist, (distributions.Literal, distributions.Indicator)):
        return None
    if isinstance(dist, distributions.Categorical):  # also Bernoulli and MaskedCategorical
        return _categorical_params(dist, z, vals, n, pc, where, old)
    if isinstance(dist, (distributions.Gaussian, distributions.DiscreteLogistic)):
        return _moment_params(dist, z, vals, n, pc)
    raise ValueError(f"lvd_init: no counting rule for {dist!r} ({where})")


def _categorical_params(dist, z: np.ndarray, vals: np.ndarray, n: int, pc: float, where: str, old):
    """``P(x = k | node i) propto count(z = i, x = k) + pc`` (a ``MaskedCategorical`` keeps ``old["mask"]``)."""
    K = dist.num_cats
    if np.any(vals != np.round(vals)) or np.any(vals < 0) or np.any(vals >= K):
        bad = vals[(vals != np.round(vals)) | (vals < 0) | (vals >= K)][:3].tolist()
        raise ValueError(f"lvd_init: x holds {bad} for {where} ({dist!r}), which takes the integers 0..{K - 1}")
    counts = np.zeros((n, K))
    np.add.at(counts, (z, vals.astype(np.int64)), 1.0)
    counts += pc
    if isinstance(dist, distributions.MaskedCategorical):
        mask = old["mask"]
        counts = np.where(mask, counts, 0.0)
        tot = counts.sum(axis=1, keepdims=True)
        probs = np.where(tot > 0, counts / np.where(tot > 0, tot, 1.0), mask / mask.sum(axis=1, keepdims=True))
        return {"mask": mask, "probs": probs}
    tot = counts.sum(axis=1, keepdims=True)
    probs = np.where(tot > 0, counts / np.where(tot > 0, tot, 1.0), 1.0 / K)
    if isinstance(dist, distributions.Bernoulli):
        return {"p": probs[:, 1]}
    return {"probs": probs}


def _moment_params(dist, z: np.ndarray, vals: np.ndarray, n: int, pc: float):
    """Per-node mean and standard deviation (discretized logistic: of the bin centers), with ``pc``
    pseudo-samples at the global moments."""
    if isinstance(dist, distributions.DiscreteLogistic):
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
    if isinstance(dist, distributions.DiscreteLogistic):
        return {"mu": mu, "s": std * math.sqrt(3.0) / math.pi}
    return {"mu": mu, "sigma": std}

