"""Parameters of the vectors an edit reads and writes: :class:`Params` reads them (from the vectors or
from a compiled circuit), :class:`Builder` creates the new vectors and keeps their tie groups and gates."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .. import checks, distributions
from ..nodes import CircuitNodes, InputNodes, SumNodes, summate


def node_totals(blocks: np.ndarray, par: np.ndarray, num_node_blocks: int) -> np.ndarray:
    """Every node's total weight ``[num_node_blocks, Kp]`` of block weights ``[E, Kp, Kc]`` (parent block
    ``par[e]``)."""
    blocks = np.asarray(blocks, dtype=np.float64)
    totals = np.zeros((num_node_blocks, blocks.shape[1]))
    np.add.at(totals, par, blocks.sum(axis=2))
    return totals


def normalize_blocks(blocks: np.ndarray, par: np.ndarray, num_node_blocks: int) -> np.ndarray:
    """Normalize block weights ``[E, Kp, Kc]`` per node (parent block ``par[e]``, row); a node whose
    weights are all zero gets a uniform distribution over its edges."""
    return rescale_blocks(blocks, par, np.ones((num_node_blocks, np.shape(blocks)[1])))


def rescale_blocks(blocks: np.ndarray, par: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Block weights ``[E, Kp, Kc]`` scaled so that every node's weights sum to ``totals[block, row]``
    (``[num_node_blocks, Kp]``); a node whose weights are all zero gets ``totals`` spread evenly over its edges."""
    blocks = np.asarray(blocks, dtype=np.float64)
    have = node_totals(blocks, par, totals.shape[0])
    dead = have[par] <= 0  # [E, Kp]
    if np.any(dead):
        blocks = np.where(dead[:, :, None], 1.0, blocks)
        have = node_totals(blocks, par, totals.shape[0])
    return blocks * (totals / have)[par][:, :, None]


class ParamError(ValueError):
    """A parameter lookup failed (raised as is, never re-worded as a structure error)."""


class Params:
    """Reads the parameters of node vectors: their own, or a compiled circuit's (cached per tie group)."""

    def __init__(self, fn: str, circuit=None, params=None):
        if params is not None and circuit is None:
            raise ValueError(f"{fn}: params= is a pytree of a compiled circuit; pass that circuit as circuit= too")
        if circuit is not None:
            from ..circuit import Circuit
            if not isinstance(circuit, Circuit):
                raise TypeError(f"{fn}: circuit must be a jaxpc.Circuit, got {type(circuit).__name__}")
        self.fn = fn
        self.circuit = circuit
        self.params = circuit.params if circuit is not None and params is None else params
        if params is not None:  # values are read at placements of circuit's layout: params must have its shapes
            self._named(checks.check_params, circuit.runtime.params_spec, params)
        self._sums: dict[int, np.ndarray | None] = {}
        self._inputs: dict[int, dict | None] = {}
        self._host_cache: dict[tuple, Any] = {}

    def check_flows(self, flows) -> None:
        """A :class:`ParamError` where ``flows['sum']`` does not have the structure and shapes of the circuit's (the
        flows of another circuit), or ``flows['input']``, where given, does not hold statistics (params given for
        flows)."""
        self._named(self.circuit.runtime.check_flows, flows, parts=("sum",), stats=False)

    def _named(self, check, *args, **kw) -> None:
        """``check(*args, **kw)``, its error re-raised as a :class:`ParamError` naming ``fn``."""
        try:
            check(*args, **kw)
        except (TypeError, ValueError) as e:
            raise ParamError(f"{self.fn}: {e}") from None

    def placement(self, src, table: dict):
        """The placement of tie group source ``src`` in ``table`` (a ``circuit.structure`` placement dict)."""
        pl = table.get(src.id)
        if pl is None:
            raise ParamError(f"{self.fn}: {src.name} is not part of the circuit passed as circuit= (was it compiled "
                             f"from this root?)")
        return pl

    def _host(self, kind: str, key: str):
        """A cached host copy of ``params[kind][key]`` (numpy, no per-node device work)."""
        ck = (kind, key)
        if ck not in self._host_cache:
            try:
                tree = self.params[kind][key]
            except (KeyError, TypeError, IndexError):
                raise ParamError(f"{self.fn}: params has no entry [{kind!r}][{key!r}]; pass a params pytree of the "
                                 f"circuit given as circuit=") from None
            self._host_cache[ck] = jax.tree_util.tree_map(np.asarray, tree)
        return self._host_cache[ck]

    def sum_blocks(self, ns: SumNodes) -> np.ndarray | None:
        """The weights ``[num_edge_blocks, block_size, ch_block_size]`` (float64) of the tie group of ``ns`` as
        the circuit computes with them (not renormalized: after gradient training a node's weights need not sum
        to one), or None when unknown. From a circuit: the exponentials of ``params["sum"]`` at the edge blocks,
        read straight from the parameter array; a NaN or ``+inf`` log-weight is a :class:`ParamError`."""
        src = ns.source
        if src.id not in self._sums:
            if self.circuit is None:
                b = None if src.own_params is None else np.array(src.own_params, dtype=np.float64)
            else:
                pl = self.placement(src, self.circuit.structure.sum_placement)
                logw = self._host("sum", pl.group)[pl.start:pl.start + pl.num_edge_blocks].astype(np.float64)
                bad = np.isnan(logw) | (logw == np.inf)
                if bad.any():
                    e = int(np.nonzero(bad.any(axis=(1, 2)))[0][0])
                    raise ParamError(f"{self.fn}: the log-weights of {src.name} (params['sum'][{pl.group!r}]) are NaN "
                                     f"or +inf at edge block {e}; an edit needs finite weights")
                b = np.exp(logw)
                dead = node_totals(b, src.edge_ids[0], src.num_node_blocks) <= 0
                if dead.any():
                    blk, k = (int(i) for i in np.argwhere(dead)[0])
                    raise ParamError(f"{self.fn}: node {blk * src.block_size + k} of {src.name} has all its weights "
                                     f"zero (log-weights -inf) in params['sum'][{pl.group!r}]; a node vector needs "
                                     f"a positive weight per node")
                if not np.all(np.isfinite(b)):
                    raise ParamError(f"{self.fn}: the weights of {src.name} overflow float64 (log-weights up to "
                                     f"{logw.max():.4g}); pass params=jaxpc.optim.normalize(circuit, params) to edit "
                                     f"the normalized circuit")
            self._sums[src.id] = b
        b = self._sums[src.id]
        return None if b is None else b.copy()

    def input_natural(self, ns: InputNodes) -> dict[str, np.ndarray] | None:
        """Natural parameters of the tie group of ``ns`` as a dict of arrays with a leading node axis
        (``MaskedCategorical``: the boolean ``mask [n, K]`` and, when known, ``probs``), or None. From a circuit,
        categorical probabilities are those the circuit computes with (rows need not sum to one); values that a
        node vector cannot hold (a Bernoulli row that does not sum to one, a Gaussian ``sigma`` below
        ``min_sigma``) are a :class:`ParamError`."""
        src = ns.source
        if src.id not in self._inputs:
            nat = None
            if src.dist.natural_fields:
                if self.circuit is None:
                    nat = None if src.own_params is None else dict(src.own_params)
                else:
                    nat = self._circuit_natural(src)
            if nat is not None:
                nat = {k: (np.array(v, dtype=bool) if k == "mask" else np.array(v, dtype=np.float64))
                       for k, v in nat.items()}
            self._inputs[src.id] = nat
        nat = self._inputs[src.id]
        return None if nat is None else {k: v.copy() for k, v in nat.items()}

    def _circuit_natural(self, src: InputNodes) -> dict[str, np.ndarray]:
        """``circuit.get_node_params(params, src)``, from host copies of the layer's arrays, checked storable."""
        dist = src.dist
        pl = self.placement(src, self.circuit.structure.input_placement)
        sl = slice(pl.row_start, pl.row_start + pl.num_nodes)
        p = {k: v[sl] for k, v in self._host("input", pl.key).items()}
        meta = {k: np.asarray(v)[sl] for k, v in self.circuit.tables["inputs"][pl.layer]["meta"].items()}
        where = f"{src.name} (params['input'][{pl.key!r}])"
        if isinstance(dist, distributions.Bernoulli):
            probs = np.exp(np.asarray(p["log_probs"], np.float64))
            tot = probs.sum(axis=1)
            off = np.nonzero(~(np.abs(tot - 1.0) <= _ROW_SLOP))[0]
            if off.size:
                raise ParamError(f"{self.fn}: the probabilities of {where} sum to {tot[off[:3]].tolist()} at node(s) "
                                 f"{off[:3].tolist()}, not one; a Bernoulli vector holds one probability per node, "
                                 f"so it cannot keep them. {_NORMALIZE_HINT}")
            return {"p": probs[:, 1] / tot}  # (float32 rounding)
        val = dist.internal_to_natural(p, meta)
        nat = {k: np.asarray(v) for k, v in val.items() if k in dist.natural_fields}
        if "mask" in nat and "probs" in nat:  # forbidden values have probability zero
            nat["probs"] = np.where(np.asarray(nat["mask"], bool), nat["probs"], 0.0)
        check = (distributions.MaskedCategorical(dist.num_cats, "full_mask")
                 if isinstance(dist, distributions.MaskedCategorical) else dist)  # (the mask as read: full)
        try:
            check.canonical_params(dict(nat), src.num_nodes, where)
        except (TypeError, ValueError) as e:
            raise ParamError(f"{self.fn}: {e}. {_NORMALIZE_HINT}") from None
        return nat


_ROW_SLOP = 1e-4  # how far from one a Bernoulli row read from float32 parameters may sum (rounding)
_NORMALIZE_HINT = ("Pass params=jaxpc.optim.normalize(circuit, params) to edit the normalized circuit (the one "
                   "jaxpc.optim.log_prob evaluates)")


def set_input_params(ns: InputNodes, nat: dict[str, np.ndarray] | None) -> None:
    """Store natural parameters (as :meth:`Params.input_natural` returns them) on a new vector, checked as
    ``set_params`` checks them; categorical probabilities are stored as given (rows are not renormalized, so the
    vector computes what the vector or circuit they were read from computed)."""
    if nat is None:
        return
    dist = ns.dist
    n = ns.num_nodes
    for k, v in nat.items():
        if v.shape[0] != n:
            raise AssertionError(f"{ns.name}: parameter {k} has {v.shape[0]} rows for {n} nodes")
    if isinstance(dist, distributions.MaskedCategorical):
        out = {"mask": nat["mask"].astype(bool)}
        if "probs" in nat:
            out["probs"] = np.where(out["mask"], nat["probs"], 0.0)
            distributions.MaskedCategorical(dist.num_cats, "full_mask").canonical_params(out, n, ns.name)
        ns.source.load_params(out)
    else:
        ns.set_params(nat)
        if "probs" in nat:
            ns.source.load_params({**ns.source.own_params, "probs": np.asarray(nat["probs"], np.float64)})


def set_sum_params(ns: SumNodes, blocks: np.ndarray) -> None:
    """Store block weights ``[num_edge_blocks, block_size, ch_block_size]`` on a new vector as they are (checked as
    ``set_params`` checks them, not renormalized: the vector computes with the weights it was given)."""
    ns.set_params(blocks)
    ns.load_params(np.array(blocks, dtype=np.float64))


class Builder:
    """Creates new vectors and keeps tie groups (keyed by the old source id): the first new vector of a
    group owns the parameters; later ones are tied to it when their shapes and edges agree. Sum gates are
    set by :meth:`set_gates` once every vector exists (a gate tie may point at a later vector)."""

    def __init__(self, fn: str):
        self.fn = fn
        self.sources: dict[int, CircuitNodes] = {}
        # old gated sum id: (old vector, its new vector, new edge block ids of every old edge block [E_old, k])
        self.gated: dict[int, tuple[SumNodes, SumNodes, np.ndarray]] = {}

    def input(self, old: InputNodes, var: int, num_node_blocks: int, block_size: int,
              natural: Callable[[], dict | None], tie: bool = True) -> InputNodes:
        key = old.source.id
        src = self.sources.get(key) if tie else None
        if src is not None and (src.num_node_blocks, src.block_size) == (num_node_blocks, block_size):
            return InputNodes(var, num_node_blocks, block_size, old.dist, source=src, name=old.name)
        ns = InputNodes(var, num_node_blocks, block_size, old.dist, name=old.name)
        set_input_params(ns, natural())
        if tie and key not in self.sources:
            self.sources[key] = ns
        return ns

    def sum(self, old: SumNodes, children: Sequence[CircuitNodes], num_node_blocks: int, block_size: int,
            edge_ids: np.ndarray, blocks: Callable[[], np.ndarray | None], tie: bool = True,
            name: str | None = None, edge_map: np.ndarray | None = None) -> SumNodes:
        """The new sum replacing ``old``. ``edge_map [E_old, k]``: the new edge blocks each old edge block
        became (-1: dropped; default: the same edge block), which decides whether a gate tie is kept."""
        if old.gates is not None:
            check_gate_block(old, block_size, self.fn)
        key = old.source.id
        ns = summate(*children, num_node_blocks=num_node_blocks, block_size=block_size, edge_ids=edge_ids,
                     name=old.name if name is None else name)
        if old.gates is not None:
            m = np.arange(old.edge_ids.shape[1])[:, None] if edge_map is None else np.asarray(edge_map)
            self.gated[old.id] = (old, ns, m.reshape(old.edge_ids.shape[1], -1))
        src = self.sources.get(key) if tie else None
        if src is not None and _same_sum_shape(src, ns):
            ns.tied_to = src
            return ns
        b = blocks()
        if b is not None:
            set_sum_params(ns, b)
        if tie and key not in self.sources:
            self.sources[key] = ns
        return ns

    def set_gates(self, nodes: Sequence[CircuitNodes]) -> None:
        """Give each new sum the gates of the old gated sum it replaces (``nodes``: the old graph): the same
        gate block size, and a ``tie_to`` mapped to the new vector of the old target. The tie is kept only
        where both new vectors have the same block size and their edge blocks came from the same old edge
        blocks (equal edge maps); otherwise the new vector gets gate columns of its own, as it does when its
        target was pruned away."""
        in_graph = {ns.id for ns in nodes}
        for old, ns, emap in self.gated.values():
            target = None
            tie = old.gates.tie_to
            if tie is not None:
                check_gate_target(old, tie, in_graph, self.fn)
                rec = self.gated.get(tie.id)
                if rec is not None:
                    t_ns, t_map = rec[1], rec[2]
                    if (t_ns.block_size == ns.block_size and t_ns.edge_ids.shape[1] == ns.edge_ids.shape[1]
                            and np.array_equal(t_map, emap)):
                        target = t_ns
            ns.set_gates(old.gates.block_size, tie_to=target)


def check_gate_block(old: SumNodes, block_size: int, fn: str) -> None:
    """A ``ValueError`` when ``old``'s gate block size does not divide the block size it gets."""
    gb = old.gates.block_size
    if block_size % gb:
        raise ValueError(f"{fn}: {old.name} has gates of block size {gb}, which does not divide its new block size "
                         f"{block_size}; declare its gates with a block size that divides {block_size} "
                         f"({old.name}.set_gates(...)) before the edit")


def check_gate_target(old: SumNodes, tie: SumNodes, in_graph: set[int], fn: str) -> None:
    """A ``ValueError`` when the vector whose gates ``old`` reads is outside the graph or has no gates (the
    old graph would not compile either)."""
    if tie.id not in in_graph:
        raise ValueError(f"{fn}: {old.name} reads the gates of {tie.name}, which is not reachable from the root")
    if not tie.is_sum() or tie.gates is None:
        raise ValueError(f"{fn}: {old.name} reads the gates of {tie.name}, which has no gates")


def _same_sum_shape(a: SumNodes, b: SumNodes) -> bool:
    return ((a.num_node_blocks, a.block_size, a.ch_block_size) == (b.num_node_blocks, b.block_size, b.ch_block_size)
            and len(a.children) == len(b.children)
            and all((x.num_node_blocks, x.block_size) == (y.num_node_blocks, y.block_size)
                    for x, y in zip(a.children, b.children))
            and np.array_equal(a.edge_ids, b.edge_ids))
