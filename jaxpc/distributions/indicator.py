"""Parameter-free indicator leaves: ``Literal`` and ``Indicator``.

Both put probability one on a single value: node value ``0`` where ``x`` equals the node's
value, ``-inf`` elsewhere, and ``0`` when the variable is marginalized (under LL, MPE and
GeneralLL alike). They share one input layer; the node's value is a static table. Their values (0, ``-inf``, NaN)
are float32, exact in every floating dtype, so that they promote to the circuit's dtype and never widen it (with
64-bit types on, a float32 circuit stays float32).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .base import Distribution


class IndicatorLeaf(Distribution):
    name = "indicator"

    def layer_key(self) -> tuple:
        return ("indicator",)

    def natural_to_internal(self, natural):
        return {}

    def internal_to_natural(self, p, tables):
        return {"value": tables["value"]}

    def has_full_params(self, natural):
        return True

    def log_pmf(self, p, tables, rows, num_values):
        val = tables["value"][rows][:, None]
        return jnp.where(jnp.arange(num_values)[None, :] == val, 0.0, -jnp.inf).astype(jnp.float32)

    def log_prob(self, p, tables, rows, xv, mv, options):
        val = tables["value"][rows][:, None]
        xi = xv.astype(jnp.int32)
        out = jnp.where(xi == val, 0.0, -jnp.inf).astype(jnp.float32)
        out = jnp.where(xi < 0, jnp.nan, out)
        if mv is not None:
            out = jnp.where(mv, 0.0, out)
        return out


class Literal(IndicatorLeaf):
    """``P(x = lit) = 1`` (a literal of a binary or categorical variable)."""

    def __init__(self, lit: int | bool):
        if isinstance(lit, (bool, np.bool_)):
            lit = int(lit)
        if not isinstance(lit, (int, np.integer)) or lit < 0:
            raise ValueError(f"Literal: lit must be a non-negative int (or bool), got {lit!r}")
        self.lit = int(lit)

    def config(self):
        return (self.lit,)

    def __repr__(self):
        return f"Literal(lit={self.lit})"

    def value_range(self):
        return (0, None)

    def num_values(self):
        return max(self.lit + 1, 2)

    def row_tables(self, num_nodes, natural, where):
        return {"value": np.full(num_nodes, self.lit, dtype=np.int32)}


class Indicator(IndicatorLeaf):
    """``num_states`` indicators of one variable: node ``j`` of a vector is ``[x == j % num_states]``."""

    def __init__(self, num_states: int):
        if not isinstance(num_states, (int, np.integer)) or isinstance(num_states, (bool, np.bool_)) or num_states < 1:
            raise ValueError(f"Indicator: num_states must be a positive int, got {num_states!r}")
        self.num_states = int(num_states)

    def config(self):
        return (self.num_states,)

    def __repr__(self):
        return f"Indicator(num_states={self.num_states})"

    def value_range(self):
        return (0, self.num_states)

    def row_tables(self, num_nodes, natural, where):
        return {"value": (np.arange(num_nodes) % self.num_states).astype(np.int32)}
