"""Block-sparse sum layer as raw Triton kernels called through jax-triton (``Options(impl="triton")``).

The same layer, tiles and arithmetic as :mod:`jaxpc.ops.pallas_sum` (whose docstring has the math), written as
``triton.jit`` kernels over flat row-major buffers (``buf [R, B]``: element ``(r, b)`` at ``r * B + b``), each
launched on a one-axis grid whose programs run the node tiles of a block, then its batch tiles, then the next
block (the order of the Pallas kernels' grids, without their 65,535-program limit on the block axis):

* :func:`forward`: the online log-sum-exp over the child blocks, written in place at ``out_offset`` (and each
  block's shift with ``shifts``);
* :func:`backward_parents`: ``a = flow / local sum`` and the shift per parent block, then the parameter flows
  ``W * (a @ y^T)`` reduced over the batch inside each program;
* :func:`backward_children`: each distinct child row block's flows through the inverse tables, added into the
  flow buffer in place;
* tree levels (one child block per parent, one parent per child row block): :func:`backward_exclusive` (the
  parent-side kernels, then ``W^T a`` once per parent block, added into every row block of its folded child) and
  :func:`backward_level` (the whole backward in one kernel, the batch whole in each program, up to
  :data:`LEVEL_BATCH` samples).

Each public function builds a :class:`~jaxpc.ops.triton_base.Launch` (``*_launch``) and runs it
(:func:`jaxpc.ops.triton_base.run`); the tests run the same launches in Triton's interpreter
(:func:`jaxpc.ops.triton_base.interpret`). Offsets are int32, as the Pallas kernels' (the routes refuse buffers of
2^31 elements and more: :func:`jaxpc.engine.routing.within_int32`). Like theirs, the factored products take
GeneralLL's ``alpha`` up to 1 only (:func:`jaxpc.engine.routing.factored_forward`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .pallas_sum import (
    LEVEL_BATCH,
    KernelConfig,
    check_exclusive_args,
    check_level_args,
    child_side_tables,
    child_tiles,
    forward_config,
    level_tiles,
    p2,
    tables3,
    tiles,
)
from .triton_base import PRECISION_CODES, Launch, cdiv, load_triton, out_shapes, run

triton, tl = load_triton()
NEG = tl.constexpr(float("-inf")) if tl is not None else float("-inf")  # the kernels' constants
NAN = tl.constexpr(float("nan")) if tl is not None else float("nan")

Array = jax.Array
DEFAULT_CONFIG = KernelConfig()

__all__ = ["KernelConfig", "LEVEL_BATCH", "forward", "forward_config", "backward_parents", "backward_children",
           "backward_exclusive", "backward_level", "forward_launch", "parents_launches", "children_launch",
           "exclusive_launch", "level_launch"]


def _t(n: int) -> int:
    """A tile side of at least 16: every product in these kernels is a ``tl.dot`` (16 or more on each side; the
    masks cover the padding). Products of smaller tiles written as broadcast multiply-adds gave wrong values on
    the H200 with triton 3.6 (reduced sides of 2 to 16), though right ones in Triton's interpreter."""
    return max(16, n)


if triton is not None:
    @triton.jit
    def dot(a, b, PREC: tl.constexpr):
        """``a @ b`` in float32 on the tensor cores at PREC (0 exact, 1 TF32, 2 bfloat16 operands)."""
        if PREC == 2:
            out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), out_dtype=tl.float32)
        elif PREC == 1:
            out = tl.dot(a, b, input_precision="tf32", out_dtype=tl.float32)
        else:
            out = tl.dot(a, b, input_precision="ieee", out_dtype=tl.float32)
        return out

    @triton.jit
    def log_sum(acc, m, ALPHA: tl.constexpr):
        """``log(acc) / ALPHA + m`` of a running sum ``acc`` under shift ``m`` (per column): an empty sum is -inf; a
        NaN child (a value out of range with validation off) stays NaN."""
        safe = tl.where(m == NEG, 0.0, m)
        pos = acc > 0
        return tl.where(pos, tl.log(tl.where(pos, acc, 1.0)) / ALPHA + safe[None, :], tl.where(acc == 0, NEG, NAN))

    @triton.jit
    def split(fp, s):
        """The parents' flows per unit of their local sums, ``fp / s``: 0 for parents that carry no flow or are
        impossible, never ``0 / 0``."""
        return tl.where((fp == 0) | (s == 0), 0.0, fp / tl.where(s == 0, 1.0, s))

    @triton.jit
    def load_tile(ptr, rows, cols, rmask, cmask, other, B: tl.constexpr):
        return tl.load(ptr + rows[:, None] * B + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=other)

    @triton.jit
    def store_tile(ptr, rows, cols, val, rmask, cmask, B: tl.constexpr):
        tl.store(ptr + rows[:, None] * B + cols[None, :], val, mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def _child(buf_ptr, ch_ptr, i, c, kc, cols, cmask, B: tl.constexpr, C: tl.constexpr, M: tl.constexpr,
               Kc: tl.constexpr):
        """Values ``[len(kc), BB]`` of child block ``c`` of parent block ``i``: the sum of its ``M`` row blocks
        (masked entries -inf)."""
        rmask = kc < Kc
        base = (i * C + c) * M
        x = load_tile(buf_ptr, tl.load(ch_ptr + base) + kc, cols, rmask, cmask, NEG, B)
        for s in tl.static_range(1, M):
            x += load_tile(buf_ptr, tl.load(ch_ptr + base + s) + kc, cols, rmask, cmask, 0.0, B)
        return x

    @triton.jit
    def weight_tile(w_ptr, p, kp, kc, valid, Kp: tl.constexpr, Kc: tl.constexpr, ALPHA: tl.constexpr):
        """``exp(ALPHA * log w)`` of the ``[len(kp), len(kc)]`` tile of weight block ``p`` (0 where masked)."""
        mask = (kp[:, None] < Kp) & (kc[None, :] < Kc) & valid
        lw = tl.load(w_ptr + p * (Kp * Kc) + kp[:, None] * Kc + kc[None, :], mask=mask, other=NEG)
        return tl.exp(ALPHA * lw)

    @triton.jit
    def _online_sum(i, ch_ptr, pid_ptr, w_ptr, buf_ptr, cols, cmask, kp, B: tl.constexpr, C: tl.constexpr,
                    M: tl.constexpr, Kp: tl.constexpr, Kc: tl.constexpr, KT: tl.constexpr, KC: tl.constexpr,
                    BB: tl.constexpr, ALPHA: tl.constexpr, PREC: tl.constexpr):
        """Running max ``[BB]`` and sum ``[KT, BB]`` over the children of parent block ``i`` for its nodes
        ``kp``, the child blocks read ``KC`` nodes at a time."""
        NQ: tl.constexpr = (Kc + KC - 1) // KC
        m = tl.full([BB], NEG, tl.float32)
        acc = tl.zeros([KT, BB], tl.float32)
        for cq in range(0, C * NQ):
            c = cq // NQ
            kc = (cq % NQ) * KC + tl.arange(0, KC)
            x = _child(buf_ptr, ch_ptr, i, c, kc, cols, cmask, B, C, M, Kc)
            w = weight_tile(w_ptr, tl.load(pid_ptr + i * C + c), kp, kc, True, Kp, Kc, ALPHA)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            safe = tl.where(m_new == NEG, 0.0, m_new)
            rescale = tl.where(m == NEG, 0.0, tl.exp(ALPHA * (m - safe)))
            y = tl.exp(ALPHA * (x - safe[None, :]))
            acc = acc * rescale[None, :] + dot(w, y, PREC)
            m = m_new
        return m, acc

    @triton.jit
    def _program(NK: tl.constexpr, NB: tl.constexpr):
        """``(block, batch tile, node tile)`` of this program of a one-axis grid: the node tiles of a block run
        first, then its batch tiles, then the next block's."""
        pid = tl.program_id(0)
        return pid // (NK * NB), (pid // NK) % NB, pid % NK

    @triton.jit
    def _parent_tile(ch_ptr, pid_ptr, w_ptr, buf_ptr, B: tl.constexpr, C: tl.constexpr, M: tl.constexpr,
                     Kp: tl.constexpr, Kc: tl.constexpr, KT: tl.constexpr, KC: tl.constexpr, BB: tl.constexpr,
                     NK: tl.constexpr, NB: tl.constexpr, ALPHA: tl.constexpr, PREC: tl.constexpr):
        """This program's parent block ``i``, node tile ``k`` (its nodes ``kp``), columns and their mask, and its
        online sum ``(m, acc)``."""
        i, t, k = _program(NK, NB)
        cols = t * BB + tl.arange(0, BB)
        cmask = cols < B
        kp = k * KT + tl.arange(0, KT)
        m, acc = _online_sum(i, ch_ptr, pid_ptr, w_ptr, buf_ptr, cols, cmask, kp, B, C, M, Kp, Kc, KT, KC, BB,
                             ALPHA, PREC)
        return i, k, kp, cols, cmask, m, acc

    @triton.jit
    def _forward_kernel(off_ptr, ch_ptr, pid_ptr, w_ptr, buf_ptr, shift_in_ptr, out_ptr, shift_ptr,
                        B: tl.constexpr, C: tl.constexpr, M: tl.constexpr, Kp: tl.constexpr, Kc: tl.constexpr,
                        KT: tl.constexpr, KC: tl.constexpr, BB: tl.constexpr, NK: tl.constexpr, NB: tl.constexpr,
                        ALPHA: tl.constexpr, PREC: tl.constexpr, UNIT: tl.constexpr):
        i, k, kp, cols, cmask, m, acc = _parent_tile(ch_ptr, pid_ptr, w_ptr, buf_ptr, B, C, M, Kp, Kc, KT, KC, BB,
                                                     NK, NB, ALPHA, PREC)
        first = tl.load(off_ptr) + i * Kp
        store_tile(out_ptr, first + kp, cols, log_sum(acc, m, ALPHA), kp < Kp, cmask, B)
        if UNIT > 0:  # the block's shift, at shift row (first parent row) / UNIT
            tl.store(shift_ptr + (first // UNIT) * B + cols, m, mask=cmask & (k == 0))

    @triton.jit
    def _scale_kernel(off_ptr, ch_ptr, pid_ptr, w_ptr, buf_ptr, flow_ptr, a_ptr, m_ptr, B: tl.constexpr,
                      C: tl.constexpr, M: tl.constexpr, Kp: tl.constexpr, Kc: tl.constexpr, KT: tl.constexpr,
                      KC: tl.constexpr, BB: tl.constexpr, NK: tl.constexpr, NB: tl.constexpr, ALPHA: tl.constexpr,
                      PREC: tl.constexpr):
        i, k, kp, cols, cmask, m, s = _parent_tile(ch_ptr, pid_ptr, w_ptr, buf_ptr, B, C, M, Kp, Kc, KT, KC, BB,
                                                   NK, NB, ALPHA, PREC)
        fp = load_tile(flow_ptr, tl.load(off_ptr) + i * Kp + kp, cols, kp < Kp, cmask, 0.0, B)
        a = split(fp, s)
        store_tile(a_ptr, i * Kp + kp, cols, a, kp < Kp, cmask, B)
        tl.store(m_ptr + i * B + cols, m, mask=cmask & (k == 0))

    @triton.jit
    def _pflow_kernel(ch_ptr, pid_ptr, w_ptr, buf_ptr, a_ptr, m_ptr, pf_ptr, B: tl.constexpr, C: tl.constexpr,
                      M: tl.constexpr, Kp: tl.constexpr, Kc: tl.constexpr, KT: tl.constexpr, KC: tl.constexpr,
                      BB: tl.constexpr, NK: tl.constexpr, NQ: tl.constexpr, ALPHA: tl.constexpr,
                      PREC: tl.constexpr):
        ic, q, k = _program(NK, NQ)
        i = ic // C
        c = ic % C
        kp = k * KT + tl.arange(0, KT)
        kc = q * KC + tl.arange(0, KC)
        acc = tl.zeros([KT, KC], tl.float32)
        for t in range(0, (B + BB - 1) // BB):
            cols = t * BB + tl.arange(0, BB)
            cmask = cols < B
            a = load_tile(a_ptr, i * Kp + kp, cols, kp < Kp, cmask, 0.0, B)
            m = tl.load(m_ptr + i * B + cols, mask=cmask, other=0.0)
            safe = tl.where(m == NEG, 0.0, m)
            y = tl.exp(ALPHA * (_child(buf_ptr, ch_ptr, i, c, kc, cols, cmask, B, C, M, Kc) - safe[None, :]))
            acc += dot(a, tl.trans(y), PREC)
        w = weight_tile(w_ptr, tl.load(pid_ptr + i * C + c), kp, kc, True, Kp, Kc, ALPHA)
        tl.store(pf_ptr + (ic * Kp + kp[:, None]) * Kc + kc[None, :], w * acc,
                 mask=(kp[:, None] < Kp) & (kc[None, :] < Kc))

    @triton.jit
    def _children_kernel(uch_ptr, par_ptr, pcol_ptr, ppid_ptr, ch_ptr, w_ptr, buf_ptr, a_ptr, m_ptr, flow_ptr,
                         out_ptr, B: tl.constexpr, C: tl.constexpr, D: tl.constexpr, M: tl.constexpr,
                         Kp: tl.constexpr, Kc: tl.constexpr, KT: tl.constexpr, KPT: tl.constexpr, BB: tl.constexpr,
                         NK: tl.constexpr, NB: tl.constexpr, ALPHA: tl.constexpr, PREC: tl.constexpr,
                         ACCUMULATE: tl.constexpr):
        u, t, k = _program(NK, NB)
        cols = t * BB + tl.arange(0, BB)
        cmask = cols < B
        kc = k * KT + tl.arange(0, KT)
        rows = tl.load(uch_ptr + u) + kc
        own = load_tile(buf_ptr, rows, cols, kc < Kc, cmask, NEG, B)
        acc = tl.zeros([KT, BB], tl.float32)
        for d in range(0, D):
            i = tl.load(par_ptr + u * D + d)
            e = tl.load(ppid_ptr + u * D + d)
            valid = i >= 0
            ii = tl.maximum(i, 0)
            ee = tl.maximum(e, 0)
            if M == 1:
                x = own
            else:  # the folded product this row block belongs to under parent ii
                x = _child(buf_ptr, ch_ptr, ii, tl.maximum(tl.load(pcol_ptr + u * D + d), 0), kc, cols, cmask, B,
                           C, M, Kc)
            m = tl.load(m_ptr + ii * B + cols, mask=cmask & valid, other=0.0)
            safe = tl.where(m == NEG, 0.0, m)
            wa = tl.zeros([KT, BB], tl.float32)  # W_e^T @ a_ii over chunks of KPT parent nodes
            for q in range(0, (Kp + KPT - 1) // KPT):
                kp = q * KPT + tl.arange(0, KPT)
                a = load_tile(a_ptr, ii * Kp + kp, cols, (kp < Kp) & valid, cmask, 0.0, B)
                w = weight_tile(w_ptr, ee, kp, kc, valid, Kp, Kc, ALPHA)
                wa += dot(tl.trans(w), a, PREC)
            acc += tl.exp(ALPHA * (x - safe[None, :])) * wa
        if ACCUMULATE:
            acc += load_tile(flow_ptr, rows, cols, kc < Kc, cmask, 0.0, B)
            store_tile(out_ptr, rows, cols, acc, kc < Kc, cmask, B)
        else:
            store_tile(out_ptr, u * Kc + kc, cols, acc, kc < Kc, cmask, B)

    @triton.jit
    def _add_to_row_blocks(flow_ptr, out_ptr, ch_ptr, i, kc, cols, cmask, cf, B: tl.constexpr, M: tl.constexpr,
                           Kc: tl.constexpr, FIRST_ROW: tl.constexpr):
        """Add child flows ``cf [len(kc), BB]`` into every row block of parent block ``i``'s (folded) child
        (``ch [n, 1, M]``), in place: the calling program is their only writer; rows below ``FIRST_ROW``
        (padding) are left alone."""
        for s in tl.static_range(0, M):
            r0 = tl.load(ch_ptr + i * M + s)
            rmask = (kc < Kc) & (r0 >= FIRST_ROW)
            old = load_tile(flow_ptr, r0 + kc, cols, rmask, cmask, 0.0, B)
            store_tile(out_ptr, r0 + kc, cols, old + cf, rmask, cmask, B)

    @triton.jit
    def _slots_kernel(ch_ptr, pid_ptr, w_ptr, buf_ptr, a_ptr, m_ptr, flow_ptr, out_ptr, B: tl.constexpr,
                      M: tl.constexpr, Kp: tl.constexpr, Kc: tl.constexpr, KT: tl.constexpr, KPT: tl.constexpr,
                      BB: tl.constexpr, NK: tl.constexpr, NB: tl.constexpr, ALPHA: tl.constexpr, PREC: tl.constexpr,
                      FIRST_ROW: tl.constexpr):
        i, t, k = _program(NK, NB)
        cols = t * BB + tl.arange(0, BB)
        cmask = cols < B
        kc = k * KT + tl.arange(0, KT)
        x = _child(buf_ptr, ch_ptr, i, 0, kc, cols, cmask, B, 1, M, Kc)
        m = tl.load(m_ptr + i * B + cols, mask=cmask, other=0.0)
        safe = tl.where(m == NEG, 0.0, m)
        p = tl.load(pid_ptr + i)
        wa = tl.zeros([KT, BB], tl.float32)  # W^T a once for all M row blocks
        for q in range(0, (Kp + KPT - 1) // KPT):
            kp = q * KPT + tl.arange(0, KPT)
            a = load_tile(a_ptr, i * Kp + kp, cols, kp < Kp, cmask, 0.0, B)
            wa += dot(tl.trans(weight_tile(w_ptr, p, kp, kc, True, Kp, Kc, ALPHA)), a, PREC)
        cf = tl.exp(ALPHA * (x - safe[None, :])) * wa
        _add_to_row_blocks(flow_ptr, out_ptr, ch_ptr, i, kc, cols, cmask, cf, B, M, Kc, FIRST_ROW)

    @triton.jit
    def _level_kernel(off_ptr, ch_ptr, pid_ptr, w_ptr, buf_ptr, flow_ptr, dp_ptr, out_ptr, pf_ptr, B: tl.constexpr,
                      M: tl.constexpr, Kp: tl.constexpr, Kc: tl.constexpr, KT: tl.constexpr, KPT: tl.constexpr,
                      KC: tl.constexpr, BB: tl.constexpr, NK: tl.constexpr, ALPHA: tl.constexpr,
                      PREC: tl.constexpr, FIRST_ROW: tl.constexpr, RECOMPUTE: tl.constexpr, PMODE: tl.constexpr):
        pid = tl.program_id(0)
        i = pid // NK
        k = pid % NK
        cols = tl.arange(0, BB)
        cmask = cols < B
        m = tl.full([BB], NEG, tl.float32)  # the forward's shift: the block's children's max
        for q in range(0, (Kc + KC - 1) // KC):
            x = _child(buf_ptr, ch_ptr, i, 0, q * KC + tl.arange(0, KC), cols, cmask, B, 1, M, Kc)
            m = tl.maximum(m, tl.max(x, axis=0))
        safe = tl.where(m == NEG, 0.0, m)
        kc = k * KT + tl.arange(0, KT)
        y = tl.exp(ALPHA * (_child(buf_ptr, ch_ptr, i, 0, kc, cols, cmask, B, 1, M, Kc) - safe[None, :]))
        p = tl.load(pid_ptr + i)
        first = tl.load(off_ptr) + i * Kp  # the block's first parent row
        wa = tl.zeros([KT, BB], tl.float32)
        for q in range(0, (Kp + KPT - 1) // KPT):
            kp = q * KPT + tl.arange(0, KPT)
            pmask = kp < Kp
            fp = load_tile(flow_ptr, first + kp, cols, pmask, cmask, 0.0, B)
            if RECOMPUTE:  # the local sums over the whole child block (exact)
                s = tl.zeros([KPT, BB], tl.float32)
                for r in range(0, (Kc + KC - 1) // KC):
                    kr = r * KC + tl.arange(0, KC)
                    yr = tl.exp(ALPHA * (_child(buf_ptr, ch_ptr, i, 0, kr, cols, cmask, B, 1, M, Kc) - safe[None, :]))
                    s += dot(weight_tile(w_ptr, p, kp, kr, True, Kp, Kc, ALPHA), yr, PREC)
            else:  # from the parents' stored values
                s = tl.exp(ALPHA * (load_tile(buf_ptr, first + kp, cols, pmask, cmask, NEG, B) - safe[None, :]))
            a = split(fp, s)
            w = weight_tile(w_ptr, p, kp, kc, True, Kp, Kc, ALPHA)
            if PMODE > 0:  # the whole batch is in this program: no reduction across programs
                pf = w * dot(a, tl.trans(y), PREC)
                tmask = pmask[:, None] & (kc[None, :] < Kc)
                if PMODE == 1:  # added into the parameter-flow buffer at block p, in place
                    at = (p * Kp + kp[:, None]) * Kc + kc[None, :]
                    tl.store(pf_ptr + at, tl.load(dp_ptr + at, mask=tmask, other=0.0) + pf, mask=tmask)
                else:
                    tl.store(pf_ptr + (i * Kp + kp[:, None]) * Kc + kc[None, :], pf, mask=tmask)
            wa += dot(tl.trans(w), a, PREC)
        _add_to_row_blocks(flow_ptr, out_ptr, ch_ptr, i, kc, cols, cmask, y * wa, B, M, Kc, FIRST_ROW)


def forward_launch(buf: Array, ch: Array, pid: Array, w: Array, *, Kp: int, Kc: int, alpha: float = 1.0,
                   precision: str = "fp32", config: KernelConfig = DEFAULT_CONFIG, out_offset=None, shifts=None,
                   unit: int = 0) -> Launch:
    """The launch of :func:`forward` (outputs: the values or the buffer, then the shifts or a placeholder)."""
    ch = tables3(ch)
    n, C, M = ch.shape
    R, B = buf.shape
    BB, KT, KC = (_t(v) for v in tiles(config, B, Kp, Kc))
    keep = shifts is not None
    if keep and (out_offset is None or unit < 1 or Kp % unit):
        raise ValueError(f"shifts are kept by the in-place forward with a unit dividing Kp={Kp}, got unit={unit}")
    if out_offset is not None and buf.dtype != jnp.float32:
        raise TypeError(f"in-place sum layer needs a float32 buffer, got {buf.dtype}")
    NK, NB = cdiv(Kp, KT), cdiv(B, BB)
    meta = dict(B=B, C=C, M=M, Kp=Kp, Kc=Kc, KT=KT, KC=KC, BB=BB, NK=NK, NB=NB, ALPHA=float(alpha),
                PREC=PRECISION_CODES[precision], UNIT=unit if keep else 0)
    off = jnp.zeros((1,), jnp.int32) if out_offset is None else jnp.asarray(out_offset, jnp.int32).reshape(1)
    sh = shifts if keep else jnp.zeros((1,), jnp.float32)
    rows = n * Kp if out_offset is None else R
    aliases = ({4: 0} if out_offset is not None else {}) | ({5: 1} if keep else {})
    return Launch(_forward_kernel, n * NK * NB, (off, ch, pid, w, buf.astype(jnp.float32), sh),
                  out_shapes([(rows, B), sh.shape]), aliases, meta, "jaxpc_triton_sum_forward",
                  config.num_warps, config.num_stages)


def forward(buf: Array, ch: Array, pid: Array, w: Array, *, Kp: int, Kc: int, alpha: float = 1.0,
            precision: str = "fp32", config: KernelConfig = DEFAULT_CONFIG, out_offset=None, shifts=None,
            unit: int = 0):
    """:func:`jaxpc.ops.pallas_sum.forward` on Triton: ``[n * Kp, B]``; with ``out_offset`` the buffer with the
    parents' rows written in place; with ``shifts`` ``(buf, shifts)``."""
    out, sh = run(forward_launch(buf, ch, pid, w, Kp=Kp, Kc=Kc, alpha=alpha, precision=precision, config=config,
                                 out_offset=out_offset, shifts=shifts, unit=unit))
    return (out, sh) if shifts is not None else out


def parents_launches(buf: Array, flows: Array, out_offset, ch: Array, pid: Array, w: Array, *, Kp: int, Kc: int,
                     alpha: float = 1.0, precision: str = "fp32", config: KernelConfig = DEFAULT_CONFIG,
                     param_flows: bool = True):
    """``(scale launch, parameter-flow launch or None)`` of :func:`backward_parents`; the second reads the first's
    outputs ``(a, m)``, passed to it as ``pflow(a, m)`` (a function of them)."""
    ch = tables3(ch)
    n, C, M = ch.shape
    B = buf.shape[1]
    BB, KT, KC = (_t(v) for v in tiles(config, B, Kp, Kc))
    NK, NB = cdiv(Kp, KT), cdiv(B, BB)
    prec = PRECISION_CODES[precision]
    meta = dict(B=B, C=C, M=M, Kp=Kp, Kc=Kc, KT=KT, KC=KC, BB=BB, NK=NK, NB=NB, ALPHA=float(alpha), PREC=prec)
    off = jnp.asarray(out_offset, jnp.int32).reshape(1)
    buf = buf.astype(jnp.float32)
    scale = Launch(_scale_kernel, n * NK * NB, (off, ch, pid, w, buf, flows.astype(jnp.float32)),
                   out_shapes([(n * Kp, B), (n, B)]), {}, meta, "jaxpc_triton_sum_backward_scale",
                   config.num_warps, config.num_stages)
    if not param_flows:
        return scale, None
    KC2 = _t(min(config.block_k, p2(Kc)))  # the parameter-flow tile is [KT, KC2], reduced over the batch
    NQ = cdiv(Kc, KC2)
    meta2 = dict(B=B, C=C, M=M, Kp=Kp, Kc=Kc, KT=KT, KC=KC2, BB=BB, NK=NK, NQ=NQ, ALPHA=float(alpha), PREC=prec)

    def pflow(a, m) -> Launch:
        return Launch(_pflow_kernel, n * C * NK * NQ, (ch, pid, w, buf, a, m), out_shapes([(n, C, Kp, Kc)]), {},
                      meta2, "jaxpc_triton_sum_backward_param_flows", config.num_warps, config.num_stages)

    return scale, pflow


def backward_parents(buf: Array, flows: Array, out_offset, ch: Array, pid: Array, w: Array, *, Kp: int, Kc: int,
                     alpha: float = 1.0, precision: str = "fp32", config: KernelConfig = DEFAULT_CONFIG,
                     param_flows: bool = True):
    """:func:`jaxpc.ops.pallas_sum.backward_parents` on Triton: ``(a [n*Kp, B], m [n, B], param flows
    [n, C, Kp, Kc] or None)``."""
    scale, pflow = parents_launches(buf, flows, out_offset, ch, pid, w, Kp=Kp, Kc=Kc, alpha=alpha,
                                    precision=precision, config=config, param_flows=param_flows)
    a, m = run(scale)
    return a, m, (run(pflow(a, m))[0] if pflow is not None else None)


def children_launch(buf: Array, a: Array, m: Array, uch: Array, par: Array, ppid: Array, w: Array, *, Kp: int,
                    Kc: int, alpha: float = 1.0, precision: str = "fp32", config: KernelConfig = DEFAULT_CONFIG,
                    ch: Array | None = None, pcol: Array | None = None, flows: Array | None = None) -> Launch:
    """The launch of :func:`backward_children`."""
    U, D = par.shape
    B = buf.shape[1]
    ch, pcol, M = child_side_tables(ch, par, pcol)
    BB, KT, KPT = (_t(v) for v in child_tiles(config, B, Kp, Kc))
    NK, NB = cdiv(Kc, KT), cdiv(B, BB)
    meta = dict(B=B, C=ch.shape[1], D=D, M=M, Kp=Kp, Kc=Kc, KT=KT, KPT=KPT, BB=BB, NK=NK, NB=NB,
                ALPHA=float(alpha), PREC=PRECISION_CODES[precision], ACCUMULATE=flows is not None)
    args = (uch, par, pcol, ppid, ch, w, buf.astype(jnp.float32), a, m)
    if flows is None:
        return Launch(_children_kernel, U * NK * NB, (*args, jnp.zeros((1,), jnp.float32)),
                      out_shapes([(U * Kc, B)]), {}, meta, "jaxpc_triton_sum_backward_children",
                      config.num_warps, config.num_stages)
    if flows.dtype != jnp.float32:
        raise TypeError(f"in-place child flows need a float32 flow buffer, got {flows.dtype}")
    return Launch(_children_kernel, U * NK * NB, (*args, flows), out_shapes([flows.shape]), {9: 0}, meta,
                  "jaxpc_triton_sum_backward_children_inplace", config.num_warps, config.num_stages)


def backward_children(buf: Array, a: Array, m: Array, uch: Array, par: Array, ppid: Array, w: Array, *, Kp: int,
                      Kc: int, alpha: float = 1.0, precision: str = "fp32", config: KernelConfig = DEFAULT_CONFIG,
                      ch: Array | None = None, pcol: Array | None = None, flows: Array | None = None) -> Array:
    """:func:`jaxpc.ops.pallas_sum.backward_children` on Triton: ``[U * Kc, B]``, or with ``flows`` the flow
    buffer with the child flows added in place."""
    return run(children_launch(buf, a, m, uch, par, ppid, w, Kp=Kp, Kc=Kc, alpha=alpha, precision=precision,
                               config=config, ch=ch, pcol=pcol, flows=flows))[0]


def exclusive_launch(buf: Array, a: Array, m: Array, flows: Array, ch: Array, pid: Array, w: Array, *, Kp: int,
                     Kc: int, first_row: int, alpha: float = 1.0, precision: str = "fp32",
                     config: KernelConfig = DEFAULT_CONFIG) -> Launch:
    """The child-side launch of :func:`backward_exclusive` (after the parent-side ones' ``a``, ``m``)."""
    ch = check_exclusive_args(ch, flows)
    n, C, M = ch.shape
    B = buf.shape[1]
    BB, KT, KPT = (_t(v) for v in child_tiles(config, B, Kp, Kc))
    NK, NB = cdiv(Kc, KT), cdiv(B, BB)
    meta = dict(B=B, M=M, Kp=Kp, Kc=Kc, KT=KT, KPT=KPT, BB=BB, NK=NK, NB=NB, ALPHA=float(alpha),
                PREC=PRECISION_CODES[precision], FIRST_ROW=int(first_row))
    return Launch(_slots_kernel, n * NK * NB, (ch, pid, w, buf.astype(jnp.float32), a, m, flows),
                  out_shapes([flows.shape]), {6: 0}, meta, "jaxpc_triton_sum_backward_slots_inplace",
                  config.num_warps, config.num_stages)


def backward_exclusive(buf: Array, flows: Array, out_offset, ch: Array, pid: Array, w: Array, *, Kp: int, Kc: int,
                       first_row: int, alpha: float = 1.0, precision: str = "fp32",
                       config: KernelConfig = DEFAULT_CONFIG, param_flows: bool = True):
    """:func:`jaxpc.ops.pallas_sum.backward_exclusive` on Triton: ``(flows, param flows [n, 1, Kp, Kc] or
    None)``, the child flows computed once per parent block and added into every row block of its child."""
    check_exclusive_args(ch, flows)
    a, m, pf = backward_parents(buf, flows, out_offset, ch, pid, w, Kp=Kp, Kc=Kc, alpha=alpha, precision=precision,
                                config=config, param_flows=param_flows)
    (flows,) = run(exclusive_launch(buf, a, m, flows, ch, pid, w, Kp=Kp, Kc=Kc, first_row=first_row, alpha=alpha,
                                    precision=precision, config=config))
    return flows, pf


def level_launch(buf: Array, flows: Array, out_offset, ch: Array, pid: Array, w: Array, *, Kp: int, Kc: int,
                 first_row: int, alpha: float = 1.0, precision: str = "fp32", config: KernelConfig = DEFAULT_CONFIG,
                 param_flows: bool = True, dparams: Array | None = None) -> Launch:
    """The launch of :func:`backward_level` (outputs: the flow buffer, then the parameter flows, the parameter-flow
    buffer or a placeholder)."""
    ch = tables3(ch)
    n, C, M = ch.shape
    R, B = buf.shape
    check_level_args(C, B, flows, dparams, Kp, Kc)
    BB, KT, KPT, KC = (_t(v) for v in level_tiles(config, B, Kp, Kc))
    pmode = 0 if not param_flows else (1 if dparams is not None else 2)
    meta = dict(B=B, M=M, Kp=Kp, Kc=Kc, KT=KT, KPT=KPT, KC=KC, BB=BB, NK=cdiv(Kc, KT), ALPHA=float(alpha),
                PREC=PRECISION_CODES[precision], FIRST_ROW=int(first_row), RECOMPUTE=precision == "fp32",
                PMODE=pmode)
    off = jnp.asarray(out_offset, jnp.int32).reshape(1)
    dp = dparams if pmode == 1 else jnp.zeros((1,), jnp.float32)
    second = {0: (1,), 1: dp.shape, 2: (n, Kp, Kc)}[pmode]
    aliases = {5: 0} | ({6: 1} if pmode == 1 else {})
    return Launch(_level_kernel, n * meta["NK"], (off, ch, pid, w, buf.astype(jnp.float32), flows, dp),
                  out_shapes([(R, B), second]), aliases, meta, "jaxpc_triton_sum_backward_level",
                  config.num_warps, config.num_stages)


def backward_level(buf: Array, flows: Array, out_offset, ch: Array, pid: Array, w: Array, *, Kp: int, Kc: int,
                   first_row: int, alpha: float = 1.0, precision: str = "fp32", config: KernelConfig = DEFAULT_CONFIG,
                   param_flows: bool = True, dparams: Array | None = None):
    """:func:`jaxpc.ops.pallas_sum.backward_level` on Triton: a tree level's whole backward in one kernel at a
    batch of at most :data:`LEVEL_BATCH`; ``(flows, param flows)`` as that function returns them."""
    fl, second = run(level_launch(buf, flows, out_offset, ch, pid, w, Kp=Kp, Kc=Kc, first_row=first_row,
                                  alpha=alpha, precision=precision, config=config, param_flows=param_flows,
                                  dparams=dparams))
    if not param_flows:
        return fl, None
    n = tables3(ch).shape[0]
    return fl, (second if dparams is not None else second.reshape(n, 1, Kp, Kc))
