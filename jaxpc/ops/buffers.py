"""Buffers whose every element is written before it is read."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

# on a GPU, buffers of fewer elements start as zeros: their memset takes microseconds, and leaving HCLT-256's flow
# buffer at batch 16 (5.6M elements) unset gained nothing (synchronized steps 1.91-2.13 ms unset, 1.78-2.14 zeroed,
# as processes vary; pipelined 1.39-1.44 both)
MIN_UNSET = 2**24


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def uninitialized(shape: tuple, dtype) -> jax.Array:
    """A buffer for code that writes each element before reading it: on a GPU uninitialized memory
    (``lax.empty``: no kernel, where zeros cost a memset of the whole buffer; zeros below :data:`MIN_UNSET`
    elements), NaN elsewhere, so that a read before a write shows in the CPU tests (as Pallas' interpret mode
    fills the outputs a kernel leaves unwritten)."""
    if _on_gpu():
        if math.prod(shape) < MIN_UNSET or not hasattr(lax, "empty"):
            return jnp.zeros(shape, dtype)
        return lax.empty(shape, dtype)
    return jnp.full(shape, jnp.nan, dtype)
