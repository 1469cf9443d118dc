"""Block-sparse sum layer as Pallas kernels (Triton backend on GPU, interpret mode on CPU).

Three kernels, each reading children straight out of the node buffer through the index tables
(no materialized ``[n, C*Kc, B]`` gather):

Weights enter as log-weights and are exponentiated per loaded tile (never the whole group).

* ``forward``: per (parent block, batch tile): an online log-sum-exp over the ``C`` child blocks,
  ``acc = acc * exp(m_old - m_new) + W_c @ exp(x_c - m_new)``, then ``log(acc) + m``.
* ``backward_parents``: per parent block, looping over batch tiles: recompute the max ``m`` and
  the local sum ``s`` (never ``exp(m - value)``, which loses ``|value| * eps``), write
  ``a = flow / s`` and ``m``, and reduce the parameter flows ``W_c * (a @ y_c^T)`` over the batch
  inside the kernel.
* ``backward_children``: per distinct child block and batch tile, through the partition's
  inverse (parent) tables: ``flow_child = sum_parents exp(x - m_parent) * (W^T @ a_parent)``.
  Each program owns its output rows: no atomics, no per-edge intermediate.

Shapes are padded to powers of two inside the kernels (masked loads and stores); products with
all dimensions >= 16 use the tensor cores (``pl.dot`` at the requested precision), smaller ones
a broadcast multiply-add in float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # the Triton backend's memory ops (jax >= 0.11 keeps them here)
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - reported by available()
    plgpu = None

Array = jax.Array
_NEG = -jnp.inf


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tuning knobs (static; part of the executable key through the options' impl)."""

    block_b: int = 32
    block_k: int = 64  # tile of parent nodes (forward, parent backward) / child nodes (child backward)
    num_warps: int = 4
    num_stages: int = 2


def available() -> bool:
    return plgpu is not None


def _interpret() -> bool:
    return jax.default_backend() != "gpu"


def _p2(n: int) -> int:
    return max(1, pl.next_power_of_2(int(n)))


def _compiler_params(cfg: KernelConfig):
    return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _mm(a, b, precision: str, trans_a: bool = False, trans_b: bool = False):
    """``op(a) @ op(b)`` inside a kernel (``op`` transposes when asked), float32 result."""
    M, K = (a.shape[1], a.shape[0]) if trans_a else a.shape
    N = b.shape[0] if trans_b else b.shape[1]
    if min(M, K, N) >= 16:
        a2 = a.T if trans_a else a
        b2 = b.T if trans_b else b
        if precision == "bf16":
            return jnp.dot(a2.astype(jnp.bfloat16), b2.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
        prec = lax.Precision.HIGHEST if precision == "fp32" else lax.Precision.DEFAULT
        return jnp.dot(a2, b2, precision=prec, preferred_element_type=jnp.float32)
    a3 = a.T[:, :, None] if trans_a else a[:, :, None]  # [M, K, 1]
    b3 = b.T[None, :, :] if trans_b else b[None, :, :]  # [1, K, N]
    return jnp.sum(a3 * b3, axis=1)


def _load_tile(ref, rows, cols, rmask, cmask, other):
    return plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=rmask[:, None] & cmask[None, :], other=other)


def _store_tile(ref, rows, cols, val, rmask, cmask):
    plgpu.store(ref.at[rows[:, None], cols[None, :]], val, mask=rmask[:, None] & cmask[None, :])


def _online_sum(i, ch_ref, pid_ref, w_ref, buf_ref, cols, cmask, kp, *, C, Kp, Kc, KC, alpha, precision):
    """Running max ``m [BB]`` and sum ``acc [len(kp), BB]`` over the children of parent block ``i`` for the
    parent nodes ``kp`` of the block. Child blocks are read in chunks of ``KC`` nodes."""
    nq = -(-Kc // KC)

    def body(cq, carry):
        m, acc = carry
        c, q = lax.div(cq, jnp.int32(nq)), lax.rem(cq, jnp.int32(nq))  # (jnp's // and % don't lower)
        kc = q * KC + jnp.arange(KC)
        row, p = ch_ref[i, c], pid_ref[i, c]
        x = _load_tile(buf_ref, row + kc, cols, kc < Kc, cmask, _NEG)
        wmask = (kp[:, None] < Kp) & (kc[None, :] < Kc)
        w = jnp.exp(alpha * plgpu.load(w_ref.at[p, kp[:, None], kc[None, :]], mask=wmask, other=_NEG))
        m_new = jnp.maximum(m, jnp.max(x, axis=0))
        safe = jnp.where(m_new == _NEG, 0.0, m_new)
        rescale = jnp.where(m == _NEG, 0.0, jnp.exp(alpha * (m - safe)))
        y = jnp.exp(alpha * (x - safe[None, :]))
        return m_new, acc * rescale[None, :] + _mm(w, y, precision)

    init = (jnp.full(cols.shape, _NEG, jnp.float32), jnp.zeros((kp.shape[0], cols.shape[0]), jnp.float32))
    return lax.fori_loop(0, C * nq, body, init)


# ---- forward -------------------------------------------------------------------------------------

def _fwd_kernel(ch_ref, pid_ref, w_ref, buf_ref, out_ref, *, C, Kp, Kc, KT, KC, BB, B, alpha, precision):
    i, k, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = t * BB + jnp.arange(BB)
    cmask = cols < B
    kp = k * KT + jnp.arange(KT)
    m, acc = _online_sum(i, ch_ref, pid_ref, w_ref, buf_ref, cols, cmask, kp, C=C, Kp=Kp, Kc=Kc, KC=KC,
                         alpha=alpha, precision=precision)
    safe = jnp.where(m == _NEG, 0.0, m)
    pos = acc > 0
    out = jnp.where(pos, jnp.log(jnp.where(pos, acc, 1.0)) / alpha + safe[None, :], _NEG)
    _store_tile(out_ref, i * Kp + kp, cols, out, kp < Kp, cmask)


def forward(buf: Array, ch: Array, pid: Array, w: Array, *, Kp: int, Kc: int, alpha: float = 1.0,
            precision: str = "fp32", config: KernelConfig = KernelConfig()) -> Array:
    """``[n * Kp, B]`` sum-layer values. ``w``: log-weights ``[P, Kp, Kc]`` (exponentiated per tile)."""
    n, C = ch.shape
    B = buf.shape[1]
    BB = min(config.block_b, _p2(B))
    KT = min(config.block_k, _p2(Kp))
    kernel = functools.partial(_fwd_kernel, C=C, Kp=Kp, Kc=Kc, KT=KT, KC=min(config.block_k, _p2(Kc)), BB=BB, B=B,
                               alpha=float(alpha), precision=precision)
    interp = _interpret()
    return pl.pallas_call(kernel, grid=(n, pl.cdiv(Kp, KT), pl.cdiv(B, BB)),
                          out_shape=jax.ShapeDtypeStruct((n * Kp, B), jnp.float32),
                          compiler_params=None if interp else _compiler_params(config),
                          interpret=interp, name="jaxpc_sum_forward")(ch, pid, w, buf.astype(jnp.float32))


# ---- backward: parent side -------------------------------------------------------------------------

def _bwd_parent_kernel(off_ref, ch_ref, pid_ref, w_ref, buf_ref, flow_ref, a_ref, m_ref, pf_ref, *, C, Kp, Kc, KT,
                       KC, BB, B, alpha, precision):
    i, k = pl.program_id(0), pl.program_id(1)
    kp = k * KT + jnp.arange(KT)
    off = off_ref[0]
    nq = -(-Kc // KC)

    def chunk(q):
        kc = q * KC + jnp.arange(KC)
        return kc, (kp[:, None] < Kp) & (kc[None, :] < Kc)

    def zero(cq, carry):
        kc, pmask = chunk(lax.rem(cq, jnp.int32(nq)))
        plgpu.store(pf_ref.at[i, lax.div(cq, jnp.int32(nq)), kp[:, None], kc[None, :]], jnp.zeros((KT, KC), jnp.float32), mask=pmask)
        return carry

    lax.fori_loop(0, C * nq, zero, 0)

    def tile(t, carry):
        cols = t * BB + jnp.arange(BB)
        cmask = cols < B
        m, s = _online_sum(i, ch_ref, pid_ref, w_ref, buf_ref, cols, cmask, kp, C=C, Kp=Kp, Kc=Kc, KC=KC,
                           alpha=alpha, precision=precision)
        fp = _load_tile(flow_ref, off + i * Kp + kp, cols, kp < Kp, cmask, 0.0)
        a = jnp.where((fp == 0) | (s == 0), 0.0, fp / jnp.where(s == 0, 1.0, s))
        _store_tile(a_ref, i * Kp + kp, cols, a, kp < Kp, cmask)
        plgpu.store(m_ref.at[i, cols], m, mask=cmask & (k == 0))
        safe = jnp.where(m == _NEG, 0.0, m)

        def child(cq, carry2):
            c = lax.div(cq, jnp.int32(nq))
            kc, pmask = chunk(lax.rem(cq, jnp.int32(nq)))
            row, p = ch_ref[i, c], pid_ref[i, c]
            x = _load_tile(buf_ref, row + kc, cols, kc < Kc, cmask, _NEG)
            y = jnp.exp(alpha * (x - safe[None, :]))
            w = jnp.exp(alpha * plgpu.load(w_ref.at[p, kp[:, None], kc[None, :]], mask=pmask, other=_NEG))
            ay = _mm(a, y, precision, trans_b=True)  # [KP, KC]
            cur = plgpu.load(pf_ref.at[i, c, kp[:, None], kc[None, :]], mask=pmask, other=0.0)
            plgpu.store(pf_ref.at[i, c, kp[:, None], kc[None, :]], cur + w * ay, mask=pmask)
            return carry2

        lax.fori_loop(0, C * nq, child, 0)
        return carry

    lax.fori_loop(0, pl.cdiv(B, BB), tile, 0)


def backward_parents(buf: Array, flows: Array, out_offset, ch: Array, pid: Array, w: Array, *, Kp: int, Kc: int,
                     alpha: float = 1.0, precision: str = "fp32", config: KernelConfig = KernelConfig()):
    """``(a [n*Kp, B], m [n, B], param_flows [n, C, Kp, Kc])`` of one sum partition."""
    n, C = ch.shape
    B = buf.shape[1]
    BB = min(config.block_b, _p2(B))
    KT = min(config.block_k, _p2(Kp))
    kernel = functools.partial(_bwd_parent_kernel, C=C, Kp=Kp, Kc=Kc, KT=KT, KC=min(config.block_k, _p2(Kc)),
                               BB=BB, B=B,
                               alpha=float(alpha), precision=precision)
    interp = _interpret()
    off = jnp.asarray(out_offset, jnp.int32).reshape(1)
    return pl.pallas_call(
        kernel, grid=(n, pl.cdiv(Kp, KT)),
        out_shape=(jax.ShapeDtypeStruct((n * Kp, B), jnp.float32), jax.ShapeDtypeStruct((n, B), jnp.float32),
                   jax.ShapeDtypeStruct((n, C, Kp, Kc), jnp.float32)),
        compiler_params=None if interp else _compiler_params(config), interpret=interp,
        name="jaxpc_sum_backward_parents")(off, ch, pid, w, buf.astype(jnp.float32), flows.astype(jnp.float32))


# ---- backward: child side ---------------------------------------------------------------------------

def _bwd_child_kernel(uch_ref, par_ref, ppid_ref, w_ref, buf_ref, a_ref, m_ref, out_ref, *, D, Kp, Kc, KT, KPT, BB,
                      B, alpha, precision):
    u, k, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = t * BB + jnp.arange(BB)
    cmask = cols < B
    kc = k * KT + jnp.arange(KT)
    x = _load_tile(buf_ref, uch_ref[u] + kc, cols, kc < Kc, cmask, _NEG)

    def body(d, acc):
        i, e = par_ref[u, d], ppid_ref[u, d]
        valid = i >= 0
        ii, ee = jnp.maximum(i, 0), jnp.maximum(e, 0)
        m = plgpu.load(m_ref.at[ii, cols], mask=cmask & valid, other=0.0)
        safe = jnp.where(m == _NEG, 0.0, m)

        def chunk(q, wa):  # W^T @ a over chunks of the parent nodes
            kp = q * KPT + jnp.arange(KPT)
            a = _load_tile(a_ref, ii * Kp + kp, cols, (kp < Kp) & valid, cmask, 0.0)
            wmask = (kp[:, None] < Kp) & (kc[None, :] < Kc) & valid
            w = jnp.exp(alpha * plgpu.load(w_ref.at[ee, kp[:, None], kc[None, :]], mask=wmask, other=_NEG))
            return wa + _mm(w, a, precision, trans_a=True)

        wa = lax.fori_loop(0, pl.cdiv(Kp, KPT), chunk, jnp.zeros((KT, BB), jnp.float32))
        return acc + jnp.exp(alpha * (x - safe[None, :])) * wa

    acc = lax.fori_loop(0, D, body, jnp.zeros((KT, BB), jnp.float32))
    _store_tile(out_ref, u * Kc + kc, cols, acc, kc < Kc, cmask)


def backward_children(buf: Array, a: Array, m: Array, uch: Array, par: Array, ppid: Array, w: Array, *, Kp: int,
                      Kc: int, alpha: float = 1.0, precision: str = "fp32",
                      config: KernelConfig = KernelConfig()) -> Array:
    """``[U * Kc, B]`` flows of the partition's ``U`` distinct child blocks (rows ``uch[u] + [0, Kc)``),
    through the inverse tables ``par``/``ppid`` ``[U, D]`` (parent block and parameter block; -1 pads)."""
    U, D = par.shape
    B = buf.shape[1]
    BB = min(config.block_b, _p2(B))
    KT = min(config.block_k, _p2(Kc))
    KPT = min(config.block_k, _p2(Kp))
    kernel = functools.partial(_bwd_child_kernel, D=D, Kp=Kp, Kc=Kc, KT=KT, KPT=KPT, BB=BB, B=B,
                               alpha=float(alpha), precision=precision)
    interp = _interpret()
    return pl.pallas_call(kernel, grid=(U, pl.cdiv(Kc, KT), pl.cdiv(B, BB)),
                          out_shape=jax.ShapeDtypeStruct((U * Kc, B), jnp.float32),
                          compiler_params=None if interp else _compiler_params(config), interpret=interp,
                          name="jaxpc_sum_backward_children")(uch, par, ppid, w, buf.astype(jnp.float32), a, m)
