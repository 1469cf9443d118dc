"""A run of tree levels (:class:`~jaxpc.compiler.layout.TreeSpec`, an HCLT's) as persistent Pallas kernels: one launch
per direction.

At small batches a tree level is a few microseconds of work, and an HCLT's 60 dependent levels run one kernel
each forward and several backward: the launches set the pace. Here the levels of one direction run in one
kernel whose ``G`` programs stay resident. A task is one (parent block, node tile); level by level, the level's
tasks are dealt to the programs in turn, each program runs the per-level kernels' program body on its tasks
(:func:`jaxpc.ops.pallas_sum.forward_tile`, :func:`jaxpc.ops.pallas_sum.level_backward_tile`) and then waits at
a grid-wide barrier (:func:`jaxpc.ops.pallas_chain.grid_barrier`) until every program is done with the level,
which orders the next level's loads after this level's stores.

* :func:`forward`: the levels from the leaves up, each parent block's values written into the node buffer in
  place.
* :func:`backward`: the levels from the top down. A program splits its block's parent flows by the local sums
  (from the stored values below fp32, recomputed at fp32), adds its tile's parameter flows into the group's
  parameter-flow buffer and its child flows into every row block of the folded child, all in place (stored, not
  added, where no other block of the circuit reads the rows).

The whole batch is one tile of every program (at most :data:`MAX_BATCH` samples). Every program must be resident
at once: ``G`` is at most :data:`MAX_PROGRAMS` and the GPU's multiprocessor count (one program per multiprocessor;
on the H200 twice as many programs of the backward did not all fit and never finished). In interpret mode (CPU)
the programs run one after the other, so there one program runs every task (``G = 1``) and the barriers pass at
once: the same kernel code, tested in CI. The route is off by default (``Tuning.tree_kernel_batch``): on the H200
HCLT-256's levels took longer this way than level by level (docs/design.md).
"""

from __future__ import annotations

import functools
from typing import Final

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .pallas_chain import grid_barrier, unbatched
from .pallas_sum import (
    KernelConfig,
    available,
    call_kernel,
    forward_tile,
    interpret_mode,
    level_backward_tile,
    p2,
)

Array = jax.Array

MAX_BATCH: Final = 64  # samples: the whole batch is one tile of each program
MAX_PROGRAMS: Final = 128  # programs of one persistent kernel (at most the GPU's multiprocessors, all resident)
_FORWARD: Final = KernelConfig(num_warps=4, num_stages=1)
_BACKWARD: Final = KernelConfig(num_warps=8, num_stages=1)


def programs(interpret: bool) -> int:
    """``G``: 1 in interpret mode, else :data:`MAX_PROGRAMS` capped by the device's multiprocessor count."""
    if interpret:
        return 1
    cores = getattr(jax.devices()[0], "core_count", None)
    return max(1, min(MAX_PROGRAMS, int(cores))) if cores else 64


def fits(B: int) -> bool:
    """Whether the kernels take a batch of ``B`` samples (whole in each program)."""
    return 1 <= B <= MAX_BATCH


TILE: Final = 4096  # values of a task's larger tiles (a child block's chunk, the parent flows' chunk)


def _tiles(spec, B: int, precision: str) -> dict:
    """Static tile sizes: the batch tile; the node tile of a task (16 parents forward, 16 children backward: many
    short tasks); the child chunk of the forward's running sum and of the backward's block max, and the backward's
    parent chunk, whole blocks at batch 16 (one round of loads per task: a level's time is its loads' latency). At
    fp32 the backward recomputes the local sums from weight tiles of a parent chunk by a child chunk, which stay
    within ``2 * TILE`` values (shared memory)."""
    BB = max(16, p2(B))
    KC = min(max(16, 2 * TILE // BB), p2(spec.Kc))
    KPT = min(max(16, TILE // BB), p2(spec.Kp))
    if precision == "fp32":
        KPT = min(KPT, max(16, 2 * TILE // KC))
    return dict(BB=BB, KTF=min(16, p2(spec.Kp)), KCF=KC, KT=min(16, p2(spec.Kc)), KC=KC, KPT=KPT)


def _levels(lev_ref, cnt_ref, L: int, tiles: int, body, interpret: bool, reverse: bool) -> None:
    """Run ``body(block, tile)`` on every (block, tile) task of each of the ``L`` levels (in reverse with
    ``reverse``), a level's tasks dealt to the programs in turn, with a grid-wide barrier after each level."""
    g = pl.program_id(0)
    G = pl.num_programs(0)

    def level(j, carry):
        lv = L - 1 - j if reverse else j
        b0 = lev_ref[lv]
        tasks = (lev_ref[lv + 1] - b0) * tiles

        def task(r, c):
            t = g + r * G
            body(b0 + lax.div(t, jnp.int32(tiles)), lax.rem(t, jnp.int32(tiles)))
            return c

        lax.fori_loop(0, lax.div(jnp.maximum(tasks - g + G - 1, 0), G), task, 0)
        grid_barrier(cnt_ref, (j + 1) * G, interpret)
        return carry

    lax.fori_loop(0, L, level, 0)


def _forward_kernel(lev_ref, prow_ref, ch_ref, pid_ref, w_ref, buf_in, cnt_in, buf_ref, cnt_ref, *, L, M, Kp, Kc,
                    BB, B, KTF, KCF, precision, interpret, **_):
    del buf_in, cnt_in  # aliased to buf_ref and cnt_ref
    cols = jnp.arange(BB)
    cmask = cols < B

    def task(i, k):
        forward_tile(i, prow_ref[i], k * KTF + jnp.arange(KTF), cols, cmask, ch_ref, pid_ref, w_ref, buf_ref, buf_ref,
                     C=1, M=M, Kp=Kp, Kc=Kc, KC=KCF, alpha=1.0, precision=precision)

    _levels(lev_ref, cnt_ref, L, pl.cdiv(Kp, KTF), task, interpret, reverse=False)


def _backward_kernel(lev_ref, prow_ref, ch_ref, pid_ref, w_ref, buf_ref, fl_in, dp_in, cnt_in, fl_ref, dp_ref, cnt_ref,
                     *, L, M, Kp, Kc, BB, B, KT, KC, KPT, precision, first_row, pmode, overwrite, interpret, **_):
    del fl_in, dp_in, cnt_in  # aliased to the outputs

    def task(i, k):
        level_backward_tile(i, k, prow_ref[i], ch_ref, pid_ref, w_ref, buf_ref, fl_ref, dp_ref, fl_ref, dp_ref, M=M,
                            Kp=Kp, Kc=Kc, KT=KT, KPT=KPT, KC=KC, BB=BB, B=B, alpha=1.0, precision=precision,
                            first_row=first_row, recompute=precision == "fp32", pmode=pmode, overwrite=overwrite)

    _levels(lev_ref, cnt_ref, L, pl.cdiv(Kc, KT), task, interpret, reverse=True)


def _static(spec, B: int, precision: str) -> dict:
    interpret = interpret_mode()
    return dict(L=spec.levels, M=spec.M, Kp=spec.Kp, Kc=spec.Kc, B=B, precision=precision, interpret=interpret,
                **_tiles(spec, B, precision))


def _check(buf: Array, name: str) -> None:
    if buf.dtype != jnp.float32 or buf.ndim != 2:
        raise TypeError(f"pallas_tree.{name} needs a float32 node buffer [R, B], got {buf.dtype}{list(buf.shape)}")
    if not fits(buf.shape[1]):
        raise ValueError(f"pallas_tree.{name} holds the whole batch in each program: 1 to {MAX_BATCH} samples, "
                         f"got {buf.shape[1]}")


@functools.cache
def _forward_call(spec, precision: str, G: int):
    def call(buf, lev, prow, ch, pid, logw):
        kernel = functools.partial(_forward_kernel, **_static(spec, buf.shape[1], precision))
        out, _ = call_kernel(kernel, _FORWARD, grid=(G,),
                             out_shape=(jax.ShapeDtypeStruct(buf.shape, jnp.float32),
                                        jax.ShapeDtypeStruct((1,), jnp.int32)),
                             input_output_aliases={5: 0, 6: 1}, name="jaxpc_tree_forward")(
            lev, prow, ch, pid, logw, buf, jnp.zeros((1,), jnp.int32))
        return out

    return unbatched(call)


@functools.cache
def _backward_call(spec, precision: str, pflows: bool, first_row: int, overwrite: bool, G: int):
    def call(values, flows, dparams, lev, prow, ch, pid, logw):
        kernel = functools.partial(_backward_kernel, first_row=first_row, pmode="add" if pflows else "",
                                   overwrite=overwrite, **_static(spec, values.shape[1], precision))
        fl, dp, _ = call_kernel(kernel, _BACKWARD, grid=(G,),
                                out_shape=(jax.ShapeDtypeStruct(flows.shape, jnp.float32),
                                           jax.ShapeDtypeStruct(dparams.shape, jnp.float32),
                                           jax.ShapeDtypeStruct((1,), jnp.int32)),
                                input_output_aliases={6: 0, 7: 1, 8: 2}, name="jaxpc_tree_backward")(
            lev, prow, ch, pid, logw, values, flows, dparams, jnp.zeros((1,), jnp.int32))
        return fl, dp

    return unbatched(call)


def forward(buf: Array, tab: dict, logw: Array, spec, precision: str, G: int | None = None) -> Array:
    """The node buffer ``buf`` (float32 ``[R, B]``) with the parent rows of every level of ``spec`` (a
    :class:`jaxpc.compiler.layout.TreeSpec`) written, from its tables ``tab`` (``tables["tree"]``) and the group's
    log-weights ``logw [P, Kp, Kc]``. ``G``: programs (default :func:`programs`)."""
    _check(buf, "forward")
    G = G or programs(interpret_mode())
    return _forward_call(spec, precision, G)(buf, tab["lev"], tab["prow"], tab["ch"], tab["pid"],
                                             logw.astype(jnp.float32))


def backward(values: Array, flows: Array, dparams: Array | None, tab: dict, logw: Array, spec,
             precision: str, first_row: int, overwrite: bool = False, G: int | None = None
             ) -> tuple[Array, Array | None]:
    """``(flows, dparams)``: the flow buffer (float32 ``[R, B]``) with the child flows of every level of ``spec``
    added, from the top level down (the levels' child rows must hold zeros), or stored with ``overwrite`` (their
    rows have no other reader in the circuit, ``Layout.single_reader``: they may hold anything), and the group's
    parameter-flow buffer ``dparams`` (float32 ``[P, Kp, Kc]``, or None: no parameter flows) with the levels'
    parameter flows added at their blocks. ``values``: the forward's node buffer; rows below ``first_row``
    (padding) get no flows."""
    _check(values, "backward")
    G = G or programs(interpret_mode())
    dp = jnp.zeros((1, 1, 1), jnp.float32) if dparams is None else dparams.astype(jnp.float32)
    fl, dp = _backward_call(spec, precision, dparams is not None, int(first_row), bool(overwrite), G)(
        values, flows.astype(jnp.float32), dp, tab["lev"], tab["prow"], tab["ch"], tab["pid"],
        logw.astype(jnp.float32))
    return fl, (None if dparams is None else dp.astype(dparams.dtype))


__all__ = ["MAX_BATCH", "MAX_PROGRAMS", "available", "backward", "fits", "forward", "programs"]
