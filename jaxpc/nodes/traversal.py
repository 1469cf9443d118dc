"""Graph traversal over node vectors (iterative: deep circuits such as 10,000-step HMMs
exceed Python's recursion limit)."""

from __future__ import annotations

from .nodes import CircuitNodes, first_off_scope, first_overlap, scope_str, scope_vars, union_scope


def topological_order(root: CircuitNodes, follow_ties: bool = False) -> list[CircuitNodes]:
    """All node vectors reachable from ``root``, children before parents (deterministic). With
    ``follow_ties``, a tied vector's parameter source counts as a dependency too (and is included even
    when it is not part of the graph). A ``ValueError`` names a vector that is its own descendant (a cycle), and a
    vector that no longer fits its children (:func:`check_vector`: children changed after it was built)."""
    order: list[CircuitNodes] = []
    seen: set[int] = set()
    done: set[int] = set()  # seen and not done: on the path from the root to the vector being expanded
    stack: list[tuple[CircuitNodes, bool]] = [(root, False)]
    while stack:
        ns, expanded = stack.pop()
        if expanded:
            check_vector(ns)
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
            if not isinstance(c, CircuitNodes):
                raise TypeError(f"{ns.name} has a child that is not a node vector: {type(c).__name__}")
            if c.id not in seen:
                stack.append((c, False))
            elif c.id not in done:
                how = "is tied to" if follow_ties and c is ns.tied_to and c not in ns.children else "has the child"
                raise ValueError(f"the circuit has a cycle: {ns.name} {how} {c.name}, which is {ns.name} or one of "
                                 f"its ancestors")
    return order


def check_vector(ns: CircuitNodes) -> None:
    """Raise a ``ValueError`` naming ``ns`` where it does not fit its children as :func:`~jaxpc.multiply` and
    :func:`~jaxpc.summate` build them: a product's children of one block size with disjoint scopes
    (decomposability), a sum's children of one scope (smoothness) and block size, each vector's scope the one its
    children give and its edges within their blocks."""
    if ns.is_input():
        return
    chs = ns.children
    if not chs:
        raise ValueError(f"the circuit is invalid: {ns.name} ({ns.kind} vector) has no children")
    scope = union_scope(chs) if ns.is_prod() else chs[0].scope
    if ns.is_prod():
        hit = first_overlap(chs)
        if hit is not None:
            j, shared = hit
            raise ValueError(f"the circuit is not decomposable: {ns.name} multiplies {chs[j].name} (child {j}), which "
                             f"shares variables {scope_vars(shared)[:6]} with an earlier child")
        for c in chs:
            if c.block_size != ns.block_size:
                raise ValueError(f"the circuit is invalid: {ns.name} (block size {ns.block_size}) multiplies "
                                 f"{c.name} of block size {c.block_size}")
        bad = [j for j, c in enumerate(chs) if ns.edge_ids.shape[1] != len(chs) or
               ns.edge_ids[:, j].max() >= c.num_node_blocks]
        if bad:
            raise ValueError(f"the circuit is invalid: {ns.name}'s edge_ids do not fit its children (child "
                             f"{bad[0]}, {chs[bad[0]].name})")
    else:
        c = first_off_scope(chs)
        if c is not None:
            raise ValueError(f"the circuit is not smooth: {ns.name} sums {chs[0].name} of scope "
                             f"{scope_str(scope)} and {c.name} of scope {scope_str(c.scope)}")
        if any(c.block_size != ns.ch_block_size for c in chs) or \
                sum(c.num_node_blocks for c in chs) != ns.num_ch_node_blocks:
            raise ValueError(f"the circuit is invalid: {ns.name} was built over {ns.num_ch_node_blocks} child blocks "
                             f"of {ns.ch_block_size} nodes, but its children now have other sizes")
    if scope != ns.scope:
        raise ValueError(f"the circuit is invalid: {ns.name} has scope {scope_str(ns.scope)}, but its children's is "
                         f"{scope_str(scope)}")
