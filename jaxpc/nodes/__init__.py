"""Symbolic node vectors and the functions that build them."""

from .nodes import (
    CircuitNodes,
    Gates,
    InputNodes,
    ProdNodes,
    SumNodes,
    duplicate,
    inputs,
    multiply,
    scope_vars,
    summate,
)
from .traversal import topological_order

__all__ = ["CircuitNodes", "InputNodes", "ProdNodes", "SumNodes", "Gates", "inputs", "multiply", "summate",
           "duplicate", "scope_vars", "topological_order"]
