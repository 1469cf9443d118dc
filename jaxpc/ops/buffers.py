"""Buffers whose every element is written before it is read."""

from __future__ import annotations

import math
from typing import Final

import jax
import jax.numpy as jnp
from jax import lax

# on a GPU, buffers of fewer elements start as zeros by default (their memset takes microseconds;
# Options.tuning.min_unset)
MIN_UNSET: Final = 2**24


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def starts_unset(shape: tuple, min_unset: int = MIN_UNSET) -> bool:
    """Whether :func:`uninitialized` gives a buffer of ``shape`` unset (NaN off a GPU), not zeros."""
    return not _on_gpu() or (math.prod(shape) >= min_unset and hasattr(lax, "empty"))


def uninitialized(shape: tuple, dtype, min_unset: int = MIN_UNSET) -> jax.Array:
    """A buffer for code that writes each element before reading it: on a GPU uninitialized memory
    (``lax.empty``: no kernel, where zeros cost a memset of the whole buffer; zeros below ``min_unset``
    elements), NaN elsewhere (an integer type's least value), so that a read before a write shows in the CPU
    tests (as Pallas' interpret mode fills the outputs a kernel leaves unwritten)."""
    if not starts_unset(shape, min_unset):
        return jnp.zeros(shape, dtype)
    if _on_gpu():
        return lax.empty(shape, dtype)
    return jnp.full(shape, jnp.iinfo(dtype).min if jnp.issubdtype(dtype, jnp.integer) else jnp.nan, dtype)
