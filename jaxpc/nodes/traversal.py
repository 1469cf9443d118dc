"""Graph traversal over node vectors (iterative: deep circuits such as 10,000-step HMMs
exceed Python's recursion limit)."""

from __future__ import annotations

from .nodes import CircuitNodes


def topological_order(root: CircuitNodes, follow_ties: bool = False) -> list[CircuitNodes]:
    """All node vectors reachable from ``root``, children before parents (deterministic). With
    ``follow_ties``, a tied vector's parameter source counts as a dependency too (and is included even
    when it is not part of the graph). A ``ValueError`` names a vector that is its own descendant (a cycle)."""
    order: list[CircuitNodes] = []
    seen: set[int] = set()
    done: set[int] = set()  # seen and not done: on the path from the root to the vector being expanded
    stack: list[tuple[CircuitNodes, bool]] = [(root, False)]
    while stack:
        ns, expanded = stack.pop()
        if expanded:
            order.append(ns)
            done.add(ns.id)
            continue
        if ns.id in seen:
            continue
        seen.add(ns.id)
        stack.append((ns, True))
        deps = list(ns.children)
        if follow_ties and ns.tied_to is not None:
            deps.append(ns.tied_to)
        for c in reversed(deps):
            if c.id not in seen:
                stack.append((c, False))
            elif c.id not in done:
                how = "is tied to" if follow_ties and c is ns.tied_to and c not in ns.children else "has the child"
                raise ValueError(f"the circuit has a cycle: {ns.name} {how} {c.name}, which is {ns.name} or one of "
                                 f"its ancestors")
    return order
