"""Product layers as Pallas kernels on the node buffer, in place.

A product partition of ``n`` blocks of ``K`` nodes (tables ``ch [n, m]``: the first buffer row of each child block)
is the element-wise sum of its children's rows in log space. XLA's gather and update write a stage's products to
a temporary and copy it into the buffer (the update's operand is also read by the gather, so it cannot run in
place), and the flow pass copies the products' flow rows out before scattering them into the same buffer.
Here one program per (block, batch tile) reads and writes the buffer itself:

* :func:`forward`: the products' rows ``= sum_j buf[ch[i, j] + k]``.
* :func:`backward`: each product's flow is added into every child's rows by atomic adds (children are shared by
  several products), lowered with relaxed order (:func:`jaxpc.ops.pallas_sum.relaxed_atomics`): no program reads
  the rows it adds to. Rows below ``first_row`` (the padding rows that shorter products read) stay untouched.

Off a GPU the kernels run in Pallas's interpret mode.
"""

from __future__ import annotations

import functools
from typing import Final

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import pallas_sum as ps

Array = jax.Array

BLOCK_ELEMENTS: Final = 4096  # values of a program's tile (K nodes by a batch tile)
_CONFIG: Final = ps.KernelConfig(num_warps=4, num_stages=1)


def _tiles(K: int, B: int) -> tuple[int, int]:
    KT = ps.p2(K)
    return KT, min(ps.p2(B), max(16, BLOCK_ELEMENTS // KT))


def _fwd_kernel(off_ref, ch_ref, buf_ref, out_ref, *, m, K, KT, BB, B):
    i, t = ps.block_ids(2)
    k, cols = jnp.arange(KT), t * BB + jnp.arange(BB)
    kmask, cmask = k < K, cols < B
    x = ps.load_tile(buf_ref, ch_ref[i, 0] + k, cols, kmask, cmask, 0.0)
    for j in range(1, m):
        x = x + ps.load_tile(buf_ref, ch_ref[i, j] + k, cols, kmask, cmask, 0.0)
    ps.store_tile(out_ref, off_ref[0] + i * K + k, cols, x, kmask, cmask)


def _bwd_kernel(off_ref, ch_ref, flow_ref, out_ref, *, m, K, KT, BB, B, first_row):
    i, t = ps.block_ids(2)
    k, cols = jnp.arange(KT), t * BB + jnp.arange(BB)
    kmask, cmask = k < K, cols < B
    f = ps.load_tile(flow_ref, off_ref[0] + i * K + k, cols, kmask, cmask, 0.0)
    for j in range(m):
        r0 = ch_ref[i, j]
        ps.add_tile(out_ref, r0 + k, cols, f, kmask & (r0 >= first_row), cmask)


def _check(buf: Array, ch: Array, K: int) -> None:
    if buf.dtype != jnp.float32 or ch.ndim != 2 or K < 1:
        raise ValueError(f"pallas_product: a float32 [R, B] buffer, tables ch [n, m] and K >= 1, got {buf.dtype}, "
                         f"ch {ch.shape}, K={K}")


def forward(buf: Array, ch: Array, out_offset, *, K: int) -> Array:
    """``buf`` with the ``n * K`` rows from ``out_offset`` (an int or a traced scalar) set to the products of the
    partition with tables ``ch [n, m]``, in place."""
    _check(buf, ch, K)
    (n, m), B = ch.shape, buf.shape[1]
    KT, BB = _tiles(K, B)
    kernel = functools.partial(_fwd_kernel, m=m, K=K, KT=KT, BB=BB, B=B)
    call = ps.call_kernel(kernel, _CONFIG, grid=ps.block_grid(n, pl.cdiv(B, BB)),
                          out_shape=jax.ShapeDtypeStruct(buf.shape, buf.dtype), input_output_aliases={2: 0},
                          name="jaxpc_product_forward")
    return call(ps.block_offsets(out_offset, (n, m)), ch.astype(jnp.int32), buf)


def backward(flows: Array, ch: Array, out_offset, *, K: int, first_row: int) -> Array:
    """``flows`` with the flows of the partition's products (rows from ``out_offset``) added into their children's
    rows (from ``first_row`` on), in place; the order of the atomic adds makes the last bits vary from run to run."""
    _check(flows, ch, K)
    ps.relaxed_atomics()
    (n, m), B = ch.shape, flows.shape[1]
    KT, BB = _tiles(K, B)
    kernel = functools.partial(_bwd_kernel, m=m, K=K, KT=KT, BB=BB, B=B, first_row=int(first_row))
    call = ps.call_kernel(kernel, _CONFIG, grid=ps.block_grid(n, pl.cdiv(B, BB)),
                          out_shape=jax.ShapeDtypeStruct(flows.shape, flows.dtype), input_output_aliases={2: 0},
                          name="jaxpc_product_backward")
    return call(ps.block_offsets(out_offset, (n, m)), ch.astype(jnp.int32), flows)


__all__ = ["backward", "forward"]
