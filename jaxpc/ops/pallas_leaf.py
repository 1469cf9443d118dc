"""The node buffer's first rows from categorical leaves as one Pallas kernel (Triton on GPU, interpret mode on CPU).

A categorical input node ``i`` over variable ``vars[i]`` with parameter row ``rows[i]`` has the value
``log_probs[rows[i], x[b, vars[i]]]`` for sample ``b`` (and ``marg[i]``, its marginal, where the variable is
missing). The flow pass's node buffer ``[R, B]`` starts as ``kmax`` zero rows, ``kmax`` rows of ``-inf``, the
input layers' values at their offsets and zeros above. XLA builds it as a gather of the leaves' values (a
``[N, B]`` temporary) and a concatenation that writes all ``R`` rows again. :func:`categorical_buffer` writes the
whole buffer once, each program a tile of rows and samples, the leaves' values gathered in registers, the batch
tiles of a row tile one after the other (their parameter rows stay in L2): on the H200 HCLT-256's 713 MB
buffer at batch 512 in 0.39 ms against XLA's 0.73 (`benchmarks/kernels_check.py --leaves`). The flow pass has
it leave the rows above the leaves unwritten, since its stages write each of them before reading it.

:func:`categorical_buffer_reference` is the same buffer from ``jnp`` gathers and one concatenation.

:func:`categorical_counts` gives the flow pass's expected counts of categorical leaves in runs over one variable
(HCLT's and PD's vectors of latents per pixel) as products of the node flows with one-hot matrices of the
variables' values that it makes in registers: on the H200 HCLT-256's at batch 512 in 0.48 ms alone against 1.06
for XLA's one-hot matrices in memory (0.31 against 0.54 inside the step); :func:`categorical_counts_reference` is
the one-hot product in ``jnp``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .pallas_sum import available, block_grid, block_ids, call_kernel, mm, p2, plgpu

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class LeafConfig:
    """Tiles of :func:`categorical_buffer`: ``block_b`` samples by ``block_e // block_b`` rows per program."""

    block_b: int = 128
    block_e: int = 4096
    num_warps: int = 4
    num_stages: int = 1


@dataclasses.dataclass(frozen=True)
class LeafLayer:
    """One input layer of the buffer (static): its first row, nodes and categories."""

    offset: int
    num_nodes: int
    num_cats: int


def check_buffer_args(xt: Array, layers: Sequence[LeafLayer], tabs: Sequence[tuple], num_rows: int, kmax: int,
           missing: Array | None):
    if xt.ndim != 2 or not jnp.issubdtype(xt.dtype, jnp.integer):
        raise TypeError(f"categorical_buffer takes the batch transposed as integers [V, B], got {xt.dtype} "
                        f"{xt.shape}")
    if missing is not None and missing.shape != xt.shape:
        raise ValueError(f"categorical_buffer's missing mask must be [V, B] = {xt.shape}, got {missing.shape}")
    if len(layers) != len(tabs):
        raise ValueError(f"categorical_buffer got {len(layers)} layers and {len(tabs)} tables")
    row = 2 * kmax
    for spec in sorted(layers, key=lambda s: s.offset):
        if spec.offset < row or spec.offset + spec.num_nodes > num_rows:
            raise ValueError(f"categorical_buffer's layers must lie above the {2 * kmax} padding rows, apart and "
                             f"inside the {num_rows} rows: a layer of {spec.num_nodes} nodes at row {spec.offset}")
        row = spec.offset + spec.num_nodes
    for spec, (lp, rows, vars_, marg) in zip(layers, tabs):
        if lp.dtype != jnp.float32 or lp.ndim != 2 or lp.shape[1] != spec.num_cats:
            raise TypeError(f"categorical_buffer takes float32 log-probabilities [P, K={spec.num_cats}], got "
                            f"{lp.dtype} {lp.shape}")
        if rows.shape != (spec.num_nodes,) or vars_.shape != (spec.num_nodes,):
            raise ValueError(f"categorical_buffer's rows and vars must be [{spec.num_nodes}], got {rows.shape} and "
                             f"{vars_.shape}")
        if missing is not None and (marg is None or marg.shape != (spec.num_nodes,)):
            raise ValueError(f"categorical_buffer with a missing mask needs each layer's marginals [{spec.num_nodes}]")


def categorical_buffer_reference(xt: Array, layers: Sequence[LeafLayer], tabs: Sequence[tuple], *, num_rows: int,
                                 kmax: int, missing: Array | None = None) -> Array:
    """:func:`categorical_buffer` from ``jnp`` gathers and one concatenation (the layers in row order, the gaps
    between them zero)."""
    check_buffer_args(xt, layers, tabs, num_rows, kmax, missing)
    B = xt.shape[1]
    parts, row = [jnp.zeros((kmax, B), jnp.float32), jnp.full((kmax, B), -jnp.inf, jnp.float32)], 2 * kmax
    for spec, (lp, rows, vars_, marg) in sorted(zip(layers, tabs), key=lambda st: st[0].offset):
        xi = xt[vars_].astype(jnp.int32)
        miss = None if missing is None else missing[vars_]
        if miss is not None:
            xi = jnp.where(miss, 0, xi)
        v = lp[rows[:, None], jnp.clip(xi, 0, spec.num_cats - 1)]
        v = jnp.where((xi < 0) | (xi >= spec.num_cats), jnp.nan, v)
        if miss is not None:
            v = jnp.where(miss, marg[:, None], v)
        parts += [jnp.zeros((spec.offset - row, B), jnp.float32), v]
        row = spec.offset + spec.num_nodes
    parts.append(jnp.zeros((num_rows - row, B), jnp.float32))
    return jnp.concatenate(parts)


def _kernel(xt_ref, *refs, layers, missing, R, B, kmax, TR, TB):
    out_ref = refs[-1]
    mt_ref = refs[0] if missing else None
    tab_refs = refs[1 if missing else 0:-1]
    cols = pl.program_id(0) * TB + jnp.arange(TB)  # the batch tiles of one row tile run one after the other:
    r = pl.program_id(1) * TR + jnp.arange(TR)  # the parameter rows they gather from stay in L2
    cmask = cols < B
    pad = ((r >= kmax) & (r < 2 * kmax))[:, None] & cmask[None, :]
    val = jnp.where(pad, -jnp.inf, jnp.zeros((TR, TB), jnp.float32))
    per = 4 if missing else 3
    for j, spec in enumerate(layers):
        lp_ref, rows_ref, vars_ref = tab_refs[per * j:per * j + 3]
        loc = r - spec.offset
        inl = (loc >= 0) & (loc < spec.num_nodes)
        loc = jnp.where(inl, loc, 0)
        m2 = inl[:, None] & cmask[None, :]
        prow = plgpu.load(rows_ref.at[loc], mask=inl, other=0)
        var = plgpu.load(vars_ref.at[loc], mask=inl, other=0)
        xi = plgpu.load(xt_ref.at[var[:, None], cols[None, :]], mask=m2, other=0)
        if missing:
            miss = plgpu.load(mt_ref.at[var[:, None], cols[None, :]], mask=m2, other=0) != 0
            xi = jnp.where(miss, 0, xi)
        bad = (xi < 0) | (xi >= spec.num_cats)
        flat = prow[:, None] * spec.num_cats + jnp.clip(xi, 0, spec.num_cats - 1)
        v = plgpu.load(lp_ref.at[flat], mask=m2, other=0.0)
        v = jnp.where(bad, jnp.nan, v)
        if missing:
            marg = plgpu.load(tab_refs[per * j + 3].at[loc], mask=inl, other=0.0)
            v = jnp.where(miss, marg[:, None], v)
        val = jnp.where(m2, v, val)
    plgpu.store(out_ref.at[r[:, None], cols[None, :]], val, mask=(r < R)[:, None] & cmask[None, :])


def categorical_buffer(xt: Array, layers: Sequence[LeafLayer], tabs: Sequence[tuple], *, num_rows: int, kmax: int,
                       missing: Array | None = None, config: LeafConfig = LeafConfig(),
                       zero_above: bool = True) -> Array:
    """The node buffer ``[num_rows, B]`` (float32) before the first stage: rows ``[0, kmax)`` zero, ``[kmax,
    2 kmax)`` ``-inf``, each layer's ``num_nodes`` rows from ``offset`` its categorical leaves' log-values, every
    other row zero, in one kernel. ``xt``: the batch transposed, integers ``[V, B]``; ``tabs``: per layer
    ``(log_probs [P, K] float32, rows [N], vars [N], marg [N] or None)``; ``missing``: None or bool ``[V, B]``,
    where a leaf takes its ``marg``. A value outside ``[0, K)`` (not missing) gives NaN, as the reference does.
    ``zero_above=False`` leaves the rows above the last layer unwritten (uninitialized memory on a GPU, NaN in
    interpret mode), for a caller whose stages write each of them before reading it."""
    check_buffer_args(xt, layers, tabs, num_rows, kmax, missing)
    B = xt.shape[1]
    top = num_rows if zero_above else max([2 * kmax] + [s.offset + s.num_nodes for s in layers])
    TB = min(config.block_b, p2(B))
    TR = max(1, min(config.block_e // TB, p2(top)))
    args = [xt.astype(jnp.int32)]
    if missing is not None:
        args.append(missing.astype(jnp.int32))
    for lp, rows, vars_, marg in tabs:
        args += [lp.reshape(-1), rows.astype(jnp.int32), vars_.astype(jnp.int32)]
        if missing is not None:
            args.append(marg.astype(jnp.float32))
    kernel = functools.partial(_kernel, layers=tuple(layers), missing=missing is not None, R=top, B=B,
                               kmax=kmax, TR=TR, TB=TB)
    return call_kernel(kernel, config, grid=(pl.cdiv(B, TB), pl.cdiv(top, TR)),
                 out_shape=jax.ShapeDtypeStruct((num_rows, B), jnp.float32),
                 name="jaxpc_categorical_buffer")(*args)


@dataclasses.dataclass(frozen=True)
class CountsConfig:
    """Tiles of :func:`categorical_counts`: ``block_r`` nodes of a run by ``block_k`` categories per program, the
    batch read ``block_b`` samples at a time."""

    block_r: int = 64
    block_k: int = 256
    block_b: int = 64
    num_warps: int = 4
    num_stages: int = 2


def _counts_kernel(x_ref, f_ref, out_ref, *, offset, run, K, B, TR, TK, TB, split):
    g, ri, ki = block_ids(3)  # the programs of one variable run one after the other (its values stay in L2)
    r = ri * TR + jnp.arange(TR)
    k = ki * TK + jnp.arange(TK)
    rmask = r < run
    rows = offset + g * run + r

    def step(t, acc):
        cols = t * TB + jnp.arange(TB)
        cmask = cols < B
        f = plgpu.load(f_ref.at[rows[:, None], cols[None, :]], mask=rmask[:, None] & cmask[None, :], other=0.0)
        xv = plgpu.load(x_ref.at[g, cols], mask=cmask, other=-1)
        onehot = (xv[:, None] == k[None, :]).astype(jnp.float32)  # [TB, TK], exact in any matmul precision
        if split:  # float32 flows as a TF32-exact high part and the remainder: two products
            hi = lax.bitcast_convert_type(lax.bitcast_convert_type(f, jnp.uint32) & jnp.uint32(0xFFFFE000),
                                          jnp.float32)
            return acc + mm(hi, onehot, "tf32") + mm(f - hi, onehot, "tf32")
        return acc + mm(f, onehot, "tf32")

    acc = lax.fori_loop(0, pl.cdiv(B, TB), step, jnp.zeros((TR, TK), jnp.float32))
    plgpu.store(out_ref.at[g, r[:, None], k[None, :]], acc, mask=rmask[:, None] & (k < K)[None, :])


def categorical_counts_reference(flows: Array, xg: Array, *, run: int, num_cats: int, precision: str = "tf32",
                                 offset: int = 0) -> Array:
    """:func:`categorical_counts` as a product with a one-hot matrix in ``jnp``."""
    _check_counts(flows, xg, run, offset)
    G, B = xg.shape
    onehot = (xg[:, :, None] == jnp.arange(num_cats, dtype=xg.dtype)).astype(jnp.float32)
    f = lax.slice_in_dim(flows, offset, offset + G * run).reshape(G, run, B)
    prec = lax.Precision.HIGHEST if precision == "fp32" else lax.Precision.DEFAULT
    return jnp.einsum("grb,gbk->grk", f, onehot, precision=prec, preferred_element_type=jnp.float32)


def _check_counts(flows: Array, xg: Array, run: int, offset: int = 0):
    if flows.dtype != jnp.float32 or flows.ndim != 2:
        raise TypeError(f"categorical_counts takes float32 node flows [N, B], got {flows.dtype} {flows.shape}")
    if xg.ndim != 2 or not jnp.issubdtype(xg.dtype, jnp.integer):
        raise TypeError(f"categorical_counts takes one row of integer values per run [G, B], got {xg.dtype} "
                        f"{xg.shape}")
    G, B = xg.shape
    if run < 1 or offset < 0 or flows.shape[1] != B or flows.shape[0] < offset + G * run:
        raise ValueError(f"categorical_counts: flows must hold rows [{offset}, {offset + G * run}) of {B} samples "
                         f"(offset + G * run for values {list(xg.shape)} and runs of {run}), got {list(flows.shape)}")


def categorical_counts(flows: Array, xg: Array, *, run: int, num_cats: int, precision: str = "tf32",
                       offset: int = 0, config: CountsConfig = CountsConfig()) -> Array:
    """Expected counts of categorical leaves whose nodes come in runs of ``run`` over one variable:
    ``counts[g, j, k] = sum_b flows[offset + g * run + j, b] [xg[g, b] = k]`` (``[G, run, num_cats]`` float32;
    ``offset``: the layer's first row in ``flows``, e.g. the flow pass's buffer, read in place), one
    program per tile of a run's nodes and categories, the one-hot matrix of the variable's values made in
    registers batch chunk by batch chunk (XLA builds it in memory, ``G * B * K`` floats, and concatenates the
    products of its chunks). A value outside ``[0, num_cats)`` (e.g. -1 for a missing one) counts nowhere.
    ``precision``: ``"fp32"`` splits the flows into a TF32-exact high part and the remainder (two products,
    float32 counts); otherwise one TF32 product (the one-hot side is exact)."""
    _check_counts(flows, xg, run, offset)
    G, B = xg.shape
    TR = min(config.block_r, p2(run))
    TK = min(config.block_k, p2(num_cats))
    TB = min(config.block_b, p2(B))
    kernel = functools.partial(_counts_kernel, offset=int(offset), run=run, K=num_cats, B=B, TR=TR, TK=TK, TB=TB,
                               split=precision == "fp32")
    return call_kernel(kernel, config, grid=block_grid(G, pl.cdiv(run, TR), pl.cdiv(num_cats, TK)),
                 out_shape=jax.ShapeDtypeStruct((G, run, num_cats), jnp.float32),
                 name="jaxpc_categorical_counts")(xg.astype(jnp.int32), flows)


__all__ = ["CountsConfig", "LeafConfig", "LeafLayer", "available", "categorical_buffer", "categorical_buffer_reference",
           "categorical_counts", "categorical_counts_reference"]
