"""Graph traversal over node vectors (iterative: deep circuits such as 10,000-step HMMs
exceed Python's recursion limit)."""

from __future__ import annotations

from .nodes import CircuitNodes


def topological_order(root: CircuitNodes) -> list[CircuitNodes]:
    """All node vectors reachable from ``root``, children before parents (deterministic)."""
    order: list[CircuitNodes] = []
    seen: set[int] = set()
    stack: list[tuple[CircuitNodes, bool]] = [(root, False)]
    while stack:
        ns, expanded = stack.pop()
        if expanded:
            order.append(ns)
            continue
        if ns.id in seen:
            continue
        seen.add(ns.id)
        stack.append((ns, True))
        for c in reversed(ns.children):
            if c.id not in seen:
                stack.append((c, False))
    return order
