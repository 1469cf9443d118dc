"""The node buffer's first rows from categorical leaves as raw Triton kernels through jax-triton
(``Options(impl="triton")``): :func:`jaxpc.ops.pallas_leaf.categorical_buffer`'s buffer, one launch per input
layer. The first launch writes every row of the buffer it covers (the zero and ``-inf`` padding, its layer's
values, zeros elsewhere); each further layer's launch writes its own rows into that buffer in place. A program
covers a tile of rows by a tile of samples, the batch tiles of a row tile one after the other (the parameter rows
they gather from stay in L2)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from .pallas_leaf import LeafConfig, LeafLayer, check_buffer_args
from .pallas_sum import p2
from .triton_base import Launch, cdiv, out_shapes, run
from .triton_sum import NAN, NEG, tl, triton

Array = jax.Array
DEFAULT_CONFIG = LeafConfig()

__all__ = ["LeafConfig", "LeafLayer", "categorical_buffer", "buffer_launches"]

if triton is not None:
    @triton.jit
    def _leaf_kernel(xt_ptr, mt_ptr, lp_ptr, rows_ptr, vars_ptr, marg_ptr, buf_ptr, out_ptr, B: tl.constexpr,
                     FIRST: tl.constexpr, TOP: tl.constexpr, OFFSET: tl.constexpr, N: tl.constexpr,
                     K: tl.constexpr, KMAX: tl.constexpr, TR: tl.constexpr, TB: tl.constexpr, NB: tl.constexpr,
                     MISSING: tl.constexpr, ALL_ROWS: tl.constexpr):
        pid = tl.program_id(0)
        cols = (pid % NB) * TB + tl.arange(0, TB)
        r = FIRST + (pid // NB) * TR + tl.arange(0, TR)
        cmask = cols < B
        loc = r - OFFSET
        inl = (loc >= 0) & (loc < N)
        loc = tl.where(inl, loc, 0)
        m2 = inl[:, None] & cmask[None, :]
        prow = tl.load(rows_ptr + loc, mask=inl, other=0)
        var = tl.load(vars_ptr + loc, mask=inl, other=0)
        xi = tl.load(xt_ptr + var[:, None] * B + cols[None, :], mask=m2, other=0)
        if MISSING:
            miss = tl.load(mt_ptr + var[:, None] * B + cols[None, :], mask=m2, other=0) != 0
            xi = tl.where(miss, 0, xi)
        bad = (xi < 0) | (xi >= K)
        v = tl.load(lp_ptr + prow[:, None] * K + tl.minimum(tl.maximum(xi, 0), K - 1), mask=m2, other=0.0)
        v = tl.where(bad, NAN, v)
        if MISSING:
            marg = tl.load(marg_ptr + loc, mask=inl, other=0.0)
            v = tl.where(miss, marg[:, None], v)
        rmask = r < TOP
        if ALL_ROWS:  # padding: rows [KMAX, 2 KMAX) -inf, every other row outside the layer zero
            pad = ((r >= KMAX) & (r < 2 * KMAX))[:, None] & cmask[None, :]
            v = tl.where(m2, v, tl.where(pad, NEG, 0.0))
        else:
            rmask = rmask & inl
        tl.store(out_ptr + r[:, None] * B + cols[None, :], v, mask=rmask[:, None] & cmask[None, :])


def buffer_launches(xt: Array, layers: Sequence[LeafLayer], tabs: Sequence[tuple], *, num_rows: int, kmax: int,
                    missing: Array | None = None, config: LeafConfig = DEFAULT_CONFIG, zero_above: bool = True):
    """The launches of :func:`categorical_buffer`, in order, as functions of the buffer so far (None for the
    first, which makes it)."""
    check_buffer_args(xt, layers, tabs, num_rows, kmax, missing)
    if not layers:
        raise ValueError("categorical_buffer on Triton needs at least one input layer")
    B = xt.shape[1]
    top = num_rows if zero_above else max([2 * kmax] + [s.offset + s.num_nodes for s in layers])
    TB = min(config.block_b, p2(B))
    NB = cdiv(B, TB)
    xt = xt.astype(jnp.int32)
    mt = jnp.zeros((1,), jnp.int32) if missing is None else missing.astype(jnp.int32)
    order = sorted(zip(layers, tabs), key=lambda st: st[0].offset)
    out = out_shapes([(num_rows, B)])
    launches = []
    for j, (spec, (lp, rows, vars_, marg)) in enumerate(order):
        first, span = (0, top) if j == 0 else (spec.offset, spec.num_nodes)
        TR = max(1, min(config.block_e // TB, p2(span)))
        meta = dict(B=B, FIRST=first, TOP=top, OFFSET=spec.offset, N=spec.num_nodes, K=spec.num_cats, KMAX=kmax,
                    TR=TR, TB=TB, NB=NB, MISSING=missing is not None, ALL_ROWS=j == 0)
        args = (xt, mt, lp.reshape(-1), rows.astype(jnp.int32), vars_.astype(jnp.int32),
                jnp.zeros((1,), jnp.float32) if missing is None else marg.astype(jnp.float32))

        grid = cdiv(span, TR) * NB

        def launch(buf, args=args, meta=meta, grid=grid, j=j) -> Launch:
            aliases = {} if j == 0 else {6: 0}
            return Launch(_leaf_kernel, grid, (*args, jnp.zeros((1,), jnp.float32) if buf is None else buf), out,
                          aliases, meta, "jaxpc_triton_categorical_buffer", config.num_warps, config.num_stages)

        launches.append(launch)
    return launches


def categorical_buffer(xt: Array, layers: Sequence[LeafLayer], tabs: Sequence[tuple], *, num_rows: int, kmax: int,
                       missing: Array | None = None, config: LeafConfig = DEFAULT_CONFIG,
                       zero_above: bool = True) -> Array:
    """:func:`jaxpc.ops.pallas_leaf.categorical_buffer` on Triton (the same arguments and buffer)."""
    buf = None
    for launch in buffer_launches(xt, layers, tabs, num_rows=num_rows, kmax=kmax, missing=missing, config=config,
                                  zero_above=zero_above):
        (buf,) = run(launch(buf))
    return buf
