"""Copy a graph (:func:`deepcopy`), optionally renaming variables."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from ..nodes import CircuitNodes, multiply
from ..nodes.traversal import topological_order
from ._graph import check_root
from ._params import Builder, ParamError, Params


def _var_map(var_mapping, fn: str) -> Callable[[int], int]:
    """``var_mapping`` (None, a dict or an int array, see :func:`deepcopy`) as a function of the old id."""
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


def copy_graph(root: CircuitNodes, reader: Params, rename: Callable[[int], int], fn: str):
    """Copy the graph, variable ``v`` becoming ``rename(v)``. Returns (new root, {old id: new vector})."""
    nodes = topological_order(root)
    b = Builder(fn)
    new: dict[int, CircuitNodes] = {}
    for ns in nodes:
        chs = [new[c.id] for c in ns.children]
        var = rename(ns.var) if ns.is_input() else None  # (its own errors name var_mapping)
        try:
            if ns.is_input():
                new[ns.id] = b.input(ns, var, ns.num_node_blocks, ns.block_size, lambda: reader.input_natural(ns))
            elif ns.is_prod():
                new[ns.id] = multiply(*chs, edge_ids=ns.edge_ids.copy(), name=ns.name)
            else:
                new[ns.id] = b.sum(ns, chs, ns.num_node_blocks, ns.block_size, ns.edge_ids.copy(),
                                   lambda: reader.sum_blocks(ns))
        except ParamError:
            raise
        except ValueError as e:
            raise ValueError(f"{fn}: copying {ns.name} failed (check var_mapping): {e}") from None
    b.set_gates(nodes)
    return new[root.id], new


def deepcopy(root: CircuitNodes, var_mapping=None, circuit=None, params=None) -> CircuitNodes:
    """A copy of the graph under ``root``: new vectors with the same shapes, edges, sharing, ties and sum
    gates (:meth:`~jaxpc.nodes.SumNodes.set_gates`; a ``tie_to`` reads the copy of its old target).

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
    check_root(root, "deepcopy")
    reader = Params("deepcopy", circuit, params)
    return copy_graph(root, reader, _var_map(var_mapping, "deepcopy"), "deepcopy")[0]
