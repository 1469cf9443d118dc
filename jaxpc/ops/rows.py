"""Gathers and scatters through the compiled index tables, whose entries are never negative.

``x[idx]`` and ``x.at[idx]`` wrap negative indices (a compare, an add and a select per index array in the
trace and in the executable); the tables need no wrap, so these leave it out. Out-of-range indices keep JAX's
meaning: gathers clamp, scatters drop (``mode`` overrides either)."""

from __future__ import annotations

import jax

Array = jax.Array


def take_rows(x: Array, idx, **kw) -> Array:
    """``x[idx]`` (numpy's own indexing for a numpy ``x``)."""
    if not isinstance(x, jax.Array):
        return x[idx]
    return x.at[idx].get(wrap_negative_indices=False, **kw)


def put_rows(x: Array, idx, v, **kw) -> Array:
    """``x.at[idx].set(v)``."""
    return x.at[idx].set(v, wrap_negative_indices=False, **kw)


def add_rows(x: Array, idx, v, **kw) -> Array:
    """``x.at[idx].add(v)``."""
    return x.at[idx].add(v, wrap_negative_indices=False, **kw)
