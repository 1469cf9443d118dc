"""Duplicate every vector, with multiplicative noise on the copies' parameters (:func:`grow`)."""

from __future__ import annotations

import math

import numpy as np

from .. import distributions
from ..nodes import CircuitNodes, InputNodes, ProdNodes, SumNodes, multiply
from ._graph import as_real, check_root, indicator_concat_ok
from ._params import Builder, Params, node_totals, rescale_blocks


def grow(root: CircuitNodes, num_duplicates: int = 1, noise: float = 0.0, *, seed: int = 0, circuit=None,
         params=None) -> CircuitNodes:
    """Grow the circuit: every vector but the root gets ``num_duplicates`` extra copies of its blocks
    (``num_node_blocks`` times ``1 + num_duplicates``), as in PyJuice's ``grow`` (Liu et al., 2023).

    With ``t = 1 + num_duplicates``: copy ``a`` of a product multiplies copy ``a`` of its children; copy
    ``a`` of a sum connects to every copy ``b`` of its children with the old weights times
    ``exp(noise * eps)``, ``eps ~ N(0, 1)`` per weight (``eps = 0`` for the original pair ``a = b = 0``),
    scaled so that each node keeps its old total weight (one for normalized weights; weights read from a
    circuit trained by gradient need not sum to one); the root connects to every copy of its children. Input
    copies ``1..t-1`` get perturbed parameters (categorical-like: probabilities times ``exp(noise * eps)``,
    scaled back to the row's old total; Gaussian / discretized logistic: ``mu + noise * scale * eps``). With
    ``noise=0`` every copy computes the original function, so ``log_prob`` is unchanged. Ties are kept (one
    draw per tie group), and so are sum gates: a sum's new edge blocks are its old ``E`` repeated ``g * t``
    times (``g = 1`` at the root, else ``t``; copy ``(a, b)`` of edge block ``e`` at ``(a * t + b) * E + e``),
    each with gate columns of its own, so its old gates tiled ``g * t`` times keep the function; a ``tie_to``
    between the root and another vector no longer matches, and the reading vector gets columns of its own.

    Args:
        root: the root vector: a sum or input vector (a product root could read only one copy of its children,
            a ``ValueError``).
        num_duplicates: extra copies per vector (a positive int).
        noise: scale of the multiplicative perturbation (>= 0).
        seed: seed of the perturbation (numpy, host side).
        circuit, params: take parameters from a compiled circuit (see :mod:`jaxpc.edit`). Vectors
            without parameters stay without (the compiled result draws them at random).

    Returns:
        the new root.
    """
    fn = "grow"
    nodes = check_root(root, fn)
    if not isinstance(num_duplicates, (int, np.integer)) or isinstance(num_duplicates, bool) or num_duplicates < 1:
        raise ValueError(f"{fn}: num_duplicates must be a positive int, got {num_duplicates!r}")
    scale = as_real(noise)
    if scale is None or not math.isfinite(scale) or scale < 0:
        raise ValueError(f"{fn}: noise must be a finite float >= 0, got {noise!r}")
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"{fn}: seed must be a non-negative int, got {seed!r}")
    if root.is_prod():
        raise ValueError(f"{fn}: the root {root.name} is a product vector, which reads one copy of its children, so "
                         f"their copies would go unused; grow a root sum over it (jaxpc.summate({root.name}, "
                         f"num_nodes=1)) instead")
    grower = _Grower(Params(fn, circuit, params), int(num_duplicates) + 1, scale, np.random.default_rng(int(seed)))
    new: dict[int, CircuitNodes] = {}
    for ns in nodes:
        chs = [new[c.id] for c in ns.children]
        g = 1 if ns is root else grower.t  # copies of this vector
        if ns.is_input():
            if g > 1 and not indicator_concat_ok(ns):
                raise ValueError(f"{fn}: {ns.name} has {ns.num_nodes} Indicator nodes, not a multiple of num_states="
                                 f"{ns.dist.num_states}, so its copies would indicate other values")
            new[ns.id] = grower.input(ns, g)
        elif ns.is_prod():
            new[ns.id] = _grown_prod(ns, chs, g)
        else:
            new[ns.id] = grower.sum(ns, chs, g)
    grower.builder.set_gates(nodes)
    return new[root.id]


class _Grower:
    """Builds ``g`` copies of input and sum vectors whose children have ``t`` copies each; parameters
    are drawn from one generator, in the order the vectors are built (one draw per tie group)."""

    def __init__(self, reader: Params, t: int, noise: float, rng: np.random.Generator):
        self.reader, self.t, self.noise, self.rng = reader, t, noise, rng
        self.builder = Builder("grow")

    def input(self, ns: InputNodes, g: int) -> InputNodes:
        def nat():
            v = self.reader.input_natural(ns)
            return None if v is None else _perturb_input(ns.dist, v, g, self.noise, self.rng)
        return self.builder.input(ns, ns.var, ns.num_node_blocks * g, ns.block_size, nat)

    def sum(self, ns: SumNodes, chs: list[CircuitNodes], g: int) -> SumNodes:
        """Copy ``a`` of ``ns`` connects to every copy ``b`` of its children."""
        t = self.t
        cnb = np.asarray([c.num_node_blocks for c in ns.children])
        offs = np.concatenate([[0], np.cumsum(cnb)])
        which = np.searchsorted(offs, ns.edge_ids[1], side="right") - 1  # child of every edge
        local = ns.edge_ids[1] - offs[which]
        E = ns.edge_ids.shape[1]
        a_idx, b_idx = np.meshgrid(np.arange(g), np.arange(t), indexing="ij")  # [g, t]
        par = (a_idx[:, :, None] * ns.num_node_blocks + ns.edge_ids[0][None, None, :]).reshape(-1)
        ch = (t * offs[which][None, None, :] + b_idx[:, :, None] * cnb[which][None, None, :]
              + local[None, None, :]).reshape(-1)

        def blocks():
            old = self.reader.sum_blocks(ns)
            if old is None:
                return None
            eps = self.rng.standard_normal((g, t) + old.shape)
            eps[0, 0] = 0.0
            w = old[None, None] * np.exp(self.noise * eps)
            totals = node_totals(old, ns.edge_ids[0], ns.num_node_blocks)  # each copy of a node keeps its total
            return rescale_blocks(w.reshape(g * t * E, *old.shape[1:]), par, np.tile(totals, (g, 1)))

        return self.builder.sum(ns, chs, ns.num_node_blocks * g, ns.block_size, np.stack([par, ch]), blocks,
                                edge_map=np.arange(g * t * E).reshape(g * t, E).T)


def _grown_prod(ns: ProdNodes, chs: list[CircuitNodes], g: int) -> ProdNodes:
    """Copy ``a`` of ``ns`` multiplies copy ``a`` of its children."""
    cnb = np.asarray([c.num_node_blocks for c in ns.children])
    e = np.concatenate([ns.edge_ids + a * cnb[None, :] for a in range(g)])
    return multiply(*chs, edge_ids=e, name=ns.name)


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
        out["probs"] = p * (out["probs"].sum(axis=1, keepdims=True) / p.sum(axis=1, keepdims=True))
    elif isinstance(dist, distributions.Bernoulli):
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
