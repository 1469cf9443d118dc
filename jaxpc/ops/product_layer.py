"""Product layer: each of ``n`` blocks of ``K`` nodes is the element-wise sum (log domain) of ``m``
child blocks whose first buffer rows are ``ch[i, :]``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def product_layer_reference(buf: Array, ch: Array, *, K: int) -> Array:
    """Returns ``[n * K, B]`` (block-major rows)."""
    n, m = ch.shape
    rows = ch[:, :, None] + jnp.arange(K, dtype=ch.dtype)  # [n, m, K]
    return jnp.sum(buf[rows], axis=1).reshape(n * K, buf.shape[1])


def product_layer(buf: Array, ch: Array, *, K: int, impl: str = "xla") -> Array:
    if impl != "xla":
        raise ValueError(f"unknown product-layer impl {impl!r}")
    return product_layer_reference(buf, ch, K=K)


def product_layer_backward_reference(flows: Array, ch: Array, out_offset, *, K: int) -> tuple[Array, Array]:
    """Each product passes its flow to every child. Returns ``(rows [n, m, K], child_flows [n, m, K, B])``."""
    n, m = ch.shape
    B = flows.shape[1]
    fp = jax.lax.dynamic_slice_in_dim(flows, out_offset, n * K, axis=0).reshape(n, 1, K, B)
    rows = ch[:, :, None] + jnp.arange(K, dtype=ch.dtype)
    return rows, jnp.broadcast_to(fp, (n, m, K, B))
