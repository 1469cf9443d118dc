"""Graph facts the edits share: the root check, the compiler's levels, tie groups, and where an
``Indicator`` vector may be followed by other nodes."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from .. import distributions
from ..nodes import CircuitNodes, InputNodes
from ..nodes.traversal import topological_order


def check_root(root, fn: str) -> list[CircuitNodes]:
    """The vectors under ``root`` in topological order; a ``TypeError`` naming ``fn`` if ``root`` is no vector."""
    if not isinstance(root, CircuitNodes):
        raise TypeError(f"{fn}: root must be a node vector, got {type(root).__name__}")
    return topological_order(root)


def levels(nodes: Sequence[CircuitNodes]) -> dict[int, int]:
    """The compiler's levels: inputs 0, other vectors one more than their highest child."""
    level: dict[int, int] = {}
    for ns in nodes:
        level[ns.id] = 0 if ns.is_input() else 1 + max(level[c.id] for c in ns.children)
    return level


def tie_groups(nodes: Sequence[CircuitNodes]) -> dict[int, list[CircuitNodes]]:
    """Members in the graph of every tie group, keyed by the group's source id (topological order)."""
    groups: dict[int, list[CircuitNodes]] = defaultdict(list)
    for ns in nodes:
        if not ns.is_prod():
            groups[ns.source.id].append(ns)
    return groups


def indicator_concat_ok(ns: InputNodes) -> bool:
    """Whether nodes placed after ``ns``'s keep their values (an ``Indicator`` node's value is its
    position modulo ``num_states``)."""
    return not isinstance(ns.dist, distributions.Indicator) or ns.num_nodes % ns.dist.num_states == 0


def as_real(value) -> float | None:
    """``value`` as a float when it is one real number (a Python or numpy scalar or a 0-d array of ints or
    floats, not a bool), else None."""
    if isinstance(value, (bool, np.bool_)) or isinstance(value, (str, bytes)):
        return None
    try:
        a = np.asarray(value)
    except (TypeError, ValueError, OverflowError):
        return None
    if a.ndim != 0 or a.dtype.kind not in "iuf":
        return None
    return float(a)
