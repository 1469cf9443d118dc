"""Parameters of the vectors an edit reads and writes: :class:`Params` reads them (from the vectors or
from a compiled circuit), :class:`Builder` creates the new vectors and keeps their tie groups and gates."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .. import checks, distributions
from ..nodes import CircuitNodes, InputNodes, SumNodes, summate


def normalize_blocks(blocks: np.ndarray, par: np.ndarray, num_node_blocks: int) -> np.ndarray:
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
        """Normalized weights ``[num_edge_blocks, block_size, ch_block_size]`` (float64) of the tie group
        of ``ns``, or None when unknown. From a circuit: ``circuit.get_node_params(params, node)`` at the
        edge blocks, read straight from the parameter array."""
        src = ns.source
        if src.id not in self._sums:
            if self.circuit is None:
                b = None if src.own_params is None else np.array(src.own_params, dtype=np.float64)
            else:
                pl = self.placement(src, self.circuit.structure.sum_placement)
                logw = self._host("sum", pl.group)[pl.start:pl.start + pl.num_edge_blocks]
                b = np.exp(logw.astype(np.float64))
            self._sums[src.id] = None if b is None else normalize_blocks(b, src.edge_ids[0], src.num_node_blocks)
        b = self._sums[src.id]
        return None if b is None else b.copy()

    def input_natural(self, ns: InputNodes) -> dict[str, np.ndarray] | None:
        """Natural parameters of the tie group of ``ns`` as a dict of arrays with a leading node axis
        (``MaskedCategorical``: the boolean ``mask [n, K]`` and, when known, ``probs``), or None."""
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
                if "probs" in nat:  # float32 slop from a circuit
                    nat["probs"] = nat["probs"] / nat["probs"].sum(axis=1, keepdims=True)
            self._inputs[src.id] = nat
        nat = self._inputs[src.id]
        return None if nat is None else {k: v.copy() for k, v in nat.items()}

    def _circuit_natural(self, src: InputNodes) -> dict[str, np.ndarray]:
        """``circuit.get_node_params(params, src)``, from host copies of the layer's arrays."""
        dist = src.dist
        pl = self.placement(src, self.circuit.structure.input_placement)
        sl = slice(pl.row_start, pl.row_start + pl.num_nodes)
        p = {k: v[sl] for k, v in self._host("input", pl.key).items()}
        meta = {k: np.asarray(v)[sl] for k, v in self.circuit.tables["inputs"][pl.layer]["meta"].items()}
        val = dist.internal_to_natural(p, meta)
        return {k: np.asarray(v) for k, v in val.items() if k in dist.natural_fields}


def set_input_params(ns: InputNodes, nat: dict[str, np.ndarray] | None) -> None:
    """Store natural parameters (as :meth:`Params.input_natural` returns them) on a new vector."""
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
            p = np.where(out["mask"], nat["probs"], 0.0)
            out["probs"] = p / p.sum(axis=1, keepdims=True)
        ns.source.load_params(out)
    else:
        ns.set_params(nat)


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
            ns.set_params(b)
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
