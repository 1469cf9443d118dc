"""A run of tree levels (:class:`~jaxpc.compiler.layout.TreeSpec`, an HCLT's) as persistent raw Triton kernels
called through jax-triton: one launch per direction, the loads that depend on no other program issued ahead.

The levels, tasks and barriers are those of :mod:`jaxpc.ops.pallas_tree` (whose docstring has the scheme): ``G``
resident programs deal each level's tasks in turn (task ``t`` to program ``t mod G``) and meet at a grid-wide
barrier after each level: a counter in global memory, arrived at with a release atomic add (after a barrier of the
program's threads) and polled with acquire atomic reads. What differs is the order of the loads:

* A task's static loads (its weights and table entries; in the backward also the forward's values it reads, which
  do not change during the backward, and the parameter-flow tile it adds to) are issued between a program's
  arrival at the barrier and its wait, for its first task of the next level, whose table entries come from a
  schedule row (:func:`schedule`) loaded a level ahead. After the barrier a forward task loads only its child values
  (the level below's outputs) and a backward task its parents' flows (the level above's).
* A program with several tasks in one level (the wide levels near the leaves) issues each task's loads before the
  previous task's arithmetic.
* The backward first computes every block's shift (its children's max per sample, from the forward's values) in a
  pre-pass over all blocks, one barrier, so that a task reads one vector instead of its whole child block.

Every task holds whole blocks: a forward task ``KT`` parents by all ``Kc`` children, a backward task all ``Kp``
parents by ``KT`` children, the batch whole (:func:`fits` bounds the tiles to registers). The arithmetic is
:mod:`jaxpc.ops.triton_sum`'s (``_level_kernel`` for the backward; at ``precision="fp32"`` the local sums are
recomputed over the whole child block, else taken from the parents' stored values).

In Triton's interpreter (the CPU tests) one program runs every task (``G = 1``) and the barriers pass at once:
the same kernel code as on the GPU. :func:`jaxpc.engine.routing.tree_kernel` takes these kernels where jax-triton
runs and the levels fit, else :mod:`jaxpc.ops.pallas_tree`'s; both are off by default (``Tuning.tree_kernel_batch``,
docs/performance.md has the figures).
"""

from __future__ import annotations

import functools
from typing import Final

import jax
import jax.numpy as jnp

from .pallas_chain import unbatched
from .pallas_sum import p2
from .triton_base import PRECISION_CODES, Launch, interpreting, load_triton, out_shapes, run

triton, tl = load_triton()

Array = jax.Array

MAX_BATCH: Final = 64  # samples: the whole batch is one tile of each program
MAX_PROGRAMS: Final = 128  # programs of one persistent kernel (at most the GPU's multiprocessors, all resident)
MAX_TILE: Final = 8192  # values of a task's largest register tile (a block's parents or children by the batch)
FORWARD_WARPS: Final = 8
BACKWARD_WARPS: Final = 8
TASK_NODES: Final = 16  # a forward task's parents, a backward task's children


def programs() -> int:
    """``G``: 1 in Triton's interpreter, else :data:`MAX_PROGRAMS` capped by the device's multiprocessor count."""
    if interpreting():
        return 1
    cores = getattr(jax.devices()[0], "core_count", None)
    return max(1, min(MAX_PROGRAMS, int(cores))) if cores else 64


def fits(spec, B: int) -> bool:
    """Whether the kernels take ``spec``'s levels at a batch of ``B`` samples: the batch whole in each program, a
    block's parents or children by the batch within :data:`MAX_TILE` values."""
    BB, KP, KC = (max(16, p2(n)) for n in (B, spec.Kp, spec.Kc))
    return 1 <= B <= MAX_BATCH and max(KP, KC) * BB <= MAX_TILE and spec.M * KC * BB <= 4 * MAX_TILE


if triton is not None:
    from .triton_sum import NEG, dot, load_tile, log_sum, split, store_tile, weight_tile

    @triton.jit
    def _arrive(cnt_ptr):
        """Add this program's arrival at the barrier (every thread's stores before it: the thread barrier, then the
        release)."""
        tl.debug_barrier()
        tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")

    @triton.jit
    def _wait(cnt_ptr, target):
        """Wait until the counter reaches ``target`` (acquire: the other programs' stores before their arrivals
        are visible to this program's loads after it)."""
        seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")

    @triton.jit
    def _start(starts, s, MP: tl.constexpr):
        """Entry ``s`` of the row-block starts ``starts [MP]``."""
        return tl.sum(tl.where(tl.arange(0, MP) == s, starts, 0), axis=0)

    @triton.jit
    def _rows(buf_ptr, starts, kc, cols, cmask, B: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
              Kc: tl.constexpr):
        """The sum of the ``M`` row blocks at ``starts``, nodes ``kc``: ``[len(kc), BB]`` (masked entries -inf)."""
        rmask = kc < Kc
        x = load_tile(buf_ptr, _start(starts, 0, MP) + kc, cols, rmask, cmask, NEG, B)
        for s in tl.static_range(1, M):
            x += load_tile(buf_ptr, _start(starts, s, MP) + kc, cols, rmask, cmask, 0.0, B)
        return x

    @triton.jit
    def _task(lev_ptr, prow_ptr, ch_ptr, pid_ptr, lv, t, NK: tl.constexpr, M: tl.constexpr, MP: tl.constexpr):
        """Task ``t`` of level ``lv`` from the tables: ``(valid, block, node tile, first parent row, parameter block,
        child row-block starts [MP])`` (where there is none, a task of the level to load from)."""
        b0 = tl.load(lev_ptr + lv)
        tasks = (tl.load(lev_ptr + lv + 1) - b0) * NK
        tt = tl.maximum(tl.minimum(t, tasks - 1), 0)
        i = b0 + tt // NK
        starts = tl.load(ch_ptr + i * M + tl.arange(0, MP), mask=tl.arange(0, MP) < M, other=0)
        return t < tasks, i, tt % NK, tl.load(prow_ptr + i), tl.load(pid_ptr + i), starts

    @triton.jit
    def _first_task(sched_ptr, lv, g, G, M: tl.constexpr, MP: tl.constexpr):
        """Program ``g``'s first task of level ``lv`` from its schedule row (one round of loads; :func:`schedule`),
        as :func:`_task` returns it."""
        row = sched_ptr + (lv * G + g) * (5 + M)
        starts = tl.load(row + 5 + tl.arange(0, MP), mask=tl.arange(0, MP) < M, other=0)
        return (tl.load(row + 3) > 0, tl.load(row + 4), tl.load(row + 1), tl.load(row), tl.load(row + 2), starts)

    @triton.jit
    def _fwd_static(w_ptr, valid, k, pid, Kp: tl.constexpr, Kc: tl.constexpr, KT: tl.constexpr, KC: tl.constexpr,
                    ALPHA: tl.constexpr):
        """A forward task's weights ``[KT, KC]`` and parent nodes (the loads no other program writes)."""
        kp = k * KT + tl.arange(0, KT)
        return kp, weight_tile(w_ptr, pid, kp, tl.arange(0, KC), valid, Kp, Kc, ALPHA)

    @triton.jit
    def _fwd_compute(buf_ptr, x, kp, first, w, cols, cmask, B: tl.constexpr, Kp: tl.constexpr, ALPHA: tl.constexpr,
                     PREC: tl.constexpr):
        """Parents ``first + kp``'s values from their child block's values ``x [KC, BB]`` and weights ``w``."""
        m = tl.max(x, axis=0)
        acc = dot(w, tl.exp(ALPHA * (x - tl.where(m == NEG, 0.0, m)[None, :])), PREC)
        store_tile(buf_ptr, first + kp, cols, log_sum(acc, m, ALPHA), kp < Kp, cmask, B)

    @triton.jit
    def _forward_kernel(lev_ptr, prow_ptr, ch_ptr, pid_ptr, w_ptr, sched_ptr, buf_in, cnt_in, buf_ptr, cnt_ptr,
                        L: tl.constexpr, B: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, Kp: tl.constexpr,
                        Kc: tl.constexpr, KT: tl.constexpr, KC: tl.constexpr, BB: tl.constexpr, NK: tl.constexpr,
                        ALPHA: tl.constexpr, PREC: tl.constexpr):
        g = tl.program_id(0)
        G = tl.num_programs(0)
        cols = tl.arange(0, BB)
        cmask = cols < B
        kc = tl.arange(0, KC)
        valid, _, k, first, pid, starts = _first_task(sched_ptr, 0, g, G, M, MP)
        kp, w = _fwd_static(w_ptr, valid, k, pid, Kp, Kc, KT, KC, ALPHA)
        for lv in range(0, L):
            # the next level's schedule row, loaded while this level runs
            nvalid, _, nk, nfirst, npid, nstarts = _first_task(sched_ptr, tl.minimum(lv + 1, L - 1), g, G, M, MP)
            # the first task's weights were loaded before the barrier below this level; its child values are the
            # level below's outputs. Each further task's loads are issued before the previous task's arithmetic.
            x = _rows(buf_ptr, starts, kc, cols, cmask & valid, B, M, MP, Kc)
            t = g + G
            while valid:
                valid2, _, k2, first2, pid2, starts2 = _task(lev_ptr, prow_ptr, ch_ptr, pid_ptr, lv, t, NK, M, MP)
                kp2, w2 = _fwd_static(w_ptr, valid2, k2, pid2, Kp, Kc, KT, KC, ALPHA)
                x2 = _rows(buf_ptr, starts2, kc, cols, cmask & valid2, B, M, MP, Kc)
                _fwd_compute(buf_ptr, x, kp, first, w, cols, cmask, B, Kp, ALPHA, PREC)
                valid, kp, first, starts, w, x = valid2, kp2, first2, starts2, w2, x2
                t += G
            _arrive(cnt_ptr)
            valid, first, starts = nvalid & (lv + 1 < L), nfirst, nstarts
            kp, w = _fwd_static(w_ptr, valid, nk, npid, Kp, Kc, KT, KC, ALPHA)
            _wait(cnt_ptr, (lv + 1) * G)

    @triton.jit
    def _bwd_static(buf_ptr, sh_ptr, w_ptr, dp_ptr, valid, i, k, first, p, starts, cols, cmask, B: tl.constexpr,
                    M: tl.constexpr, MP: tl.constexpr, Kp: tl.constexpr, Kc: tl.constexpr, KT: tl.constexpr,
                    KP: tl.constexpr, KC: tl.constexpr, KR: tl.constexpr, BB: tl.constexpr, ALPHA: tl.constexpr,
                    PREC: tl.constexpr, RECOMPUTE: tl.constexpr, PMODE: tl.constexpr):
        """A backward task's loads that no other program writes during the level loop: its child nodes' ``y =
        exp(x - shift)`` ``[KT, BB]`` (the block's shift from the pre-pass), the parents' local sums ``[KP, BB]``
        (recomputed over the child block in chunks of ``KR`` with ``RECOMPUTE``), the weights ``[KP, KT]`` and the
        parameter-flow tile it adds to."""
        m = tl.load(sh_ptr + i * BB + cols)
        safe = tl.where(m == NEG, 0.0, m)
        kc = k * KT + tl.arange(0, KT)
        y = tl.exp(ALPHA * (_rows(buf_ptr, starts, kc, cols, cmask & valid, B, M, MP, Kc) - safe[None, :]))
        kp = tl.arange(0, KP)
        if RECOMPUTE:  # the local sums over the whole child block (exact)
            s = tl.zeros([KP, BB], tl.float32)
            for r in range(0, KC, KR):
                kr = r + tl.arange(0, KR)
                yr = tl.exp(ALPHA * (_rows(buf_ptr, starts, kr, cols, cmask & valid, B, M, MP, Kc) - safe[None, :]))
                s += dot(weight_tile(w_ptr, p, kp, kr, valid, Kp, Kc, ALPHA), yr, PREC)
        else:  # from the parents' stored values
            s = tl.exp(ALPHA * (load_tile(buf_ptr, first + kp, cols, kp < Kp, cmask & valid, NEG, B) - safe[None, :]))
        w = weight_tile(w_ptr, p, kp, kc, valid, Kp, Kc, ALPHA)
        if PMODE > 0:
            d = tl.load(dp_ptr + _pf_at(p, kp, kc, Kp, Kc), mask=_pf_mask(kp, kc, Kp, Kc) & valid, other=0.0)
        else:
            d = tl.zeros([KP, KT], tl.float32)
        return kc, y, s, w, d

    @triton.jit
    def _pf_at(p, kp, kc, Kp: tl.constexpr, Kc: tl.constexpr):
        return (p * Kp + kp[:, None]) * Kc + kc[None, :]

    @triton.jit
    def _pf_mask(kp, kc, Kp: tl.constexpr, Kc: tl.constexpr):
        return (kp[:, None] < Kp) & (kc[None, :] < Kc)

    @triton.jit
    def _bwd_compute(flow_ptr, dp_ptr, fp, kc, starts, p, y, s, w, d, cols, cmask, B: tl.constexpr,
                     M: tl.constexpr, MP: tl.constexpr, Kp: tl.constexpr, Kc: tl.constexpr, KP: tl.constexpr,
                     PREC: tl.constexpr, FIRST_ROW: tl.constexpr, PMODE: tl.constexpr, OVERWRITE: tl.constexpr):
        """A backward task from its parents' flows ``fp [KP, BB]`` and its static loads: the parameter flows and
        the child flows into every row block of the folded child."""
        kp = tl.arange(0, KP)
        a = split(fp, s)
        if PMODE > 0:  # the whole batch is in this program: no reduction across programs
            tl.store(dp_ptr + _pf_at(p, kp, kc, Kp, Kc), d + w * dot(a, tl.trans(y), PREC),
                     mask=_pf_mask(kp, kc, Kp, Kc))
        cf = y * dot(tl.trans(w), a, PREC)
        for j in tl.static_range(0, M):  # every row block of the folded child; padding rows get nothing
            r0 = _start(starts, j, MP)
            rmask = (kc < Kc) & (r0 >= FIRST_ROW)
            if OVERWRITE:  # rows of no other reader: their flows are unset until now
                store_tile(flow_ptr, r0 + kc, cols, cf, rmask, cmask, B)
            else:
                old = load_tile(flow_ptr, r0 + kc, cols, rmask, cmask, 0.0, B)
                store_tile(flow_ptr, r0 + kc, cols, old + cf, rmask, cmask, B)

    @triton.jit
    def _backward_kernel(lev_ptr, prow_ptr, ch_ptr, pid_ptr, w_ptr, buf_ptr, sched_ptr, fl_in, dp_in, cnt_in,
                         flow_ptr, dp_ptr, cnt_ptr, sh_ptr, L: tl.constexpr, B: tl.constexpr, M: tl.constexpr,
                         MP: tl.constexpr, Kp: tl.constexpr, Kc: tl.constexpr, KT: tl.constexpr, KP: tl.constexpr,
                         KC: tl.constexpr, KR: tl.constexpr, BB: tl.constexpr, NK: tl.constexpr, ALPHA: tl.constexpr,
                         PREC: tl.constexpr, RECOMPUTE: tl.constexpr, PMODE: tl.constexpr, FIRST_ROW: tl.constexpr,
                         OVERWRITE: tl.constexpr):
        g = tl.program_id(0)
        G = tl.num_programs(0)
        cols = tl.arange(0, BB)
        cmask = cols < B
        kp = tl.arange(0, KP)
        b = g
        while b < tl.load(lev_ptr + L):  # pre-pass: every block's shift, the max of its child values per sample
            starts = tl.load(ch_ptr + b * M + tl.arange(0, MP), mask=tl.arange(0, MP) < M, other=0)
            tl.store(sh_ptr + b * BB + cols, tl.max(_rows(buf_ptr, starts, tl.arange(0, KC), cols, cmask, B, M, MP,
                                                          Kc), axis=0))
            b += G
        _arrive(cnt_ptr)
        valid, i, k, first, p, starts = _first_task(sched_ptr, L - 1, g, G, M, MP)
        _wait(cnt_ptr, G)
        kc, y, s, w, d = _bwd_static(buf_ptr, sh_ptr, w_ptr, dp_ptr, valid, i, k, first, p, starts, cols, cmask, B, M,
                                     MP, Kp, Kc, KT, KP, KC, KR, BB, ALPHA, PREC, RECOMPUTE, PMODE)
        for j in range(0, L):
            lv = L - 1 - j
            # the next level's schedule row, loaded while this level runs
            nvalid, ni, nk, nfirst, np_, nstarts = _first_task(sched_ptr, tl.maximum(lv - 1, 0), g, G, M, MP)
            # the first task's static loads were issued before the barrier above this level; its parents' flows
            # are the level above's outputs. Each further task's loads are issued before the previous task's
            # arithmetic.
            fp = load_tile(flow_ptr, first + kp, cols, kp < Kp, cmask & valid, 0.0, B)
            t = g + G
            while valid:
                valid2, i2, k2, first2, p2_, starts2 = _task(lev_ptr, prow_ptr, ch_ptr, pid_ptr, lv, t, NK, M, MP)
                kc2, y2, s2, w2, d2 = _bwd_static(buf_ptr, sh_ptr, w_ptr, dp_ptr, valid2, i2, k2, first2, p2_, starts2,
                                                  cols, cmask, B, M, MP, Kp, Kc, KT, KP, KC, KR, BB, ALPHA, PREC,
                                                  RECOMPUTE, PMODE)
                fp2 = load_tile(flow_ptr, first2 + kp, cols, kp < Kp, cmask & valid2, 0.0, B)
                _bwd_compute(flow_ptr, dp_ptr, fp, kc, starts, p, y, s, w, d, cols, cmask, B, M, MP, Kp, Kc, KP, PREC,
                             FIRST_ROW, PMODE, OVERWRITE)
                valid, kc, first, starts, p, y, s, w, d, fp = valid2, kc2, first2, starts2, p2_, y2, s2, w2, d2, fp2
                t += G
            _arrive(cnt_ptr)
            valid, first, p, starts = nvalid & (lv > 0), nfirst, np_, nstarts
            kc, y, s, w, d = _bwd_static(buf_ptr, sh_ptr, w_ptr, dp_ptr, valid, ni, nk, first, p, starts, cols, cmask,
                                         B, M, MP, Kp, Kc, KT, KP, KC, KR, BB, ALPHA, PREC, RECOMPUTE, PMODE)
            _wait(cnt_ptr, (j + 2) * G)


def schedule(tab: dict, spec, G: int, NK: int) -> Array:
    """Each program's first task of each level, ``[L, G, 5 + M]`` int32 rows ``(first parent row, node tile,
    parameter block, valid, block, child row-block starts...)``: program ``g`` runs task ``g`` of a level's ``blocks
    * NK`` tasks first (where there is none, the level's last task, not valid). The kernels read a row in one round
    of loads, a level ahead, where the tables take two."""
    lev = tab["lev"]
    b0, tasks = lev[:-1], (lev[1:] - lev[:-1]) * NK
    g = jnp.arange(G, dtype=jnp.int32)
    t = jnp.maximum(jnp.minimum(g[None, :], tasks[:, None] - 1), 0)
    i = b0[:, None] + t // NK
    cols = [tab["prow"][i], t % NK, tab["pid"][i], (g[None, :] < tasks[:, None]).astype(jnp.int32), i]
    return jnp.concatenate([jnp.stack(cols, -1), tab["ch"][i]], -1).astype(jnp.int32)


def _meta(spec, B: int, precision: str) -> dict:
    return dict(L=spec.levels, B=B, M=spec.M, MP=max(2, p2(spec.M)), Kp=spec.Kp, Kc=spec.Kc, KC=max(16, p2(spec.Kc)),
                BB=max(16, p2(B)),
                ALPHA=1.0, PREC=PRECISION_CODES[precision])


def _check(buf: Array, logw: Array, spec, name: str) -> None:
    if buf.dtype != jnp.float32 or buf.ndim != 2:
        raise TypeError(f"triton_tree.{name} needs a float32 node buffer [R, B], got {buf.dtype}{list(buf.shape)}")
    if not fits(spec, buf.shape[1]):
        raise ValueError(f"triton_tree.{name} holds whole blocks and the whole batch in each program: 1 to "
                         f"{MAX_BATCH} samples and blocks of at most {MAX_TILE} values by the batch, got "
                         f"{buf.shape[1]} samples of {spec.Kp} x {spec.Kc} blocks")
    if logw.size >= 2**31:
        raise ValueError(f"triton_tree.{name} addresses the weights with int32 offsets: fewer than 2^31 values, got "
                         f"{logw.size:,}")


def forward_launch(buf: Array, tab: dict, logw: Array, spec, precision: str, G: int) -> Launch:
    """The launch of :func:`forward` (outputs: the node buffer, the barrier counter)."""
    meta = _meta(spec, buf.shape[1], precision)
    KT = max(16, min(TASK_NODES, p2(spec.Kp)))
    meta |= dict(KT=KT, NK=-(-spec.Kp // KT))
    return Launch(_forward_kernel, G, (tab["lev"], tab["prow"], tab["ch"], tab["pid"], logw.astype(jnp.float32),
                                       schedule(tab, spec, G, meta["NK"]), buf, jnp.zeros((1,), jnp.int32)),
                  out_shapes([buf.shape]) + out_shapes([(1,)], jnp.int32), {6: 0, 7: 1}, meta,
                  "jaxpc_tree_forward", FORWARD_WARPS, 1)


def backward_launch(values: Array, flows: Array, dparams: Array, pflows: bool, tab: dict, logw: Array, spec,
                    precision: str, first_row: int, overwrite: bool, G: int) -> Launch:
    """The launch of :func:`backward` (outputs: the flow buffer, the parameter-flow buffer, the barrier counter, the
    blocks' shifts)."""
    meta = _meta(spec, values.shape[1], precision)
    KT = max(16, min(TASK_NODES, p2(spec.Kc)))
    KP = max(16, p2(spec.Kp))
    recompute = precision == "fp32"
    KR = max(16, min(meta["KC"], MAX_TILE // KP))  # the recomputed local sums' child chunk: a [KP, KR] weight tile
    meta |= dict(KT=KT, KP=KP, KR=KR, NK=-(-spec.Kc // KT), RECOMPUTE=recompute, PMODE=int(pflows),
                 FIRST_ROW=int(first_row), OVERWRITE=bool(overwrite))
    return Launch(_backward_kernel, G, (tab["lev"], tab["prow"], tab["ch"], tab["pid"], logw.astype(jnp.float32),
                                        values, schedule(tab, spec, G, meta["NK"]), flows, dparams,
                                        jnp.zeros((1,), jnp.int32)),
                  out_shapes([flows.shape, dparams.shape]) + out_shapes([(1,)], jnp.int32)
                  + out_shapes([(spec.blocks, meta["BB"])]), {7: 0, 8: 1, 9: 2}, meta, "jaxpc_tree_backward",
                  BACKWARD_WARPS, 1)


@functools.cache
def _forward_call(spec, precision: str, G: int):
    def call(buf, lev, prow, ch, pid, logw):
        tab = dict(lev=lev, prow=prow, ch=ch, pid=pid)
        return run(forward_launch(buf, tab, logw, spec, precision, G))[0]

    return unbatched(call)


@functools.cache
def _backward_call(spec, precision: str, pflows: bool, first_row: int, overwrite: bool, G: int):
    def call(values, flows, dparams, lev, prow, ch, pid, logw):
        tab = dict(lev=lev, prow=prow, ch=ch, pid=pid)
        fl, dp, _, _ = run(backward_launch(values, flows, dparams, pflows, tab, logw, spec, precision, first_row,
                                        overwrite, G))
        return fl, dp

    return unbatched(call)


def forward(buf: Array, tab: dict, logw: Array, spec, precision: str, G: int | None = None) -> Array:
    """:func:`jaxpc.ops.pallas_tree.forward` on jax-triton: the node buffer ``buf`` (float32 ``[R, B]``) with the
    parent rows of every level of ``spec`` written, from its tables ``tab`` and the log-weights ``logw [P, Kp,
    Kc]``. ``G``: programs (default :func:`programs`)."""
    _check(buf, logw, spec, "forward")
    G = G or programs()
    return _forward_call(spec, precision, G)(buf, tab["lev"], tab["prow"], tab["ch"].reshape(-1, spec.M),
                                             tab["pid"].reshape(-1), logw.astype(jnp.float32))


def backward(values: Array, flows: Array, dparams: Array | None, tab: dict, logw: Array, spec, precision: str,
             first_row: int, overwrite: bool = False, G: int | None = None) -> tuple[Array, Array | None]:
    """:func:`jaxpc.ops.pallas_tree.backward` on jax-triton: ``(flows, dparams)``, the child flows of every level
    added into (``overwrite``: stored into) the flow buffer and the parameter flows added into ``dparams`` (None:
    none)."""
    _check(values, logw, spec, "backward")
    G = G or programs()
    dp = jnp.zeros((1, 1, 1), jnp.float32) if dparams is None else dparams.astype(jnp.float32)
    fl, dp = _backward_call(spec, precision, dparams is not None, int(first_row), bool(overwrite), G)(
        values, flows.astype(jnp.float32), dp, tab["lev"], tab["prow"], tab["ch"].reshape(-1, spec.M),
        tab["pid"].reshape(-1), logw.astype(jnp.float32))
    return fl, (None if dparams is None else dp.astype(dparams.dtype))


__all__ = ["MAX_BATCH", "MAX_PROGRAMS", "backward", "backward_launch", "fits", "forward", "forward_launch",
           "programs"]
