"""A chain's (HMM's) forward and backward messages as persistent Pallas kernels: one launch per direction.

The scans of :mod:`jaxpc.engine.chain` run two or three kernels per step each way; at small batches a step's
work is a few microseconds and the launches set the pace. Here the ``R`` steps of one direction run in one
kernel whose programs stay resident: program ``i`` of ``G`` owns ``bm`` rows of the ``[K, B]`` message; per
step it reads the whole previous message, writes its rows of the next one, and waits at a grid-wide barrier
until every program has written its rows.

The barrier is a counter in global memory: after a step's stores (and a barrier of the program's threads), each
program adds one with an acquire-release atomic at GPU scope and polls it (atomic adds of zero, acquire) until it
reaches ``G`` times the number of steps done, which orders the loads of the other programs' rows after it.
This needs every program resident at once: ``G`` is at most
:data:`MAX_PROGRAMS`, far below an H200's 132 SMs, one program per SM at most. In interpret mode (CPU) the
grid runs one program after the other, so there one program owns all rows (``G = 1``) and the barrier passes
at once: the same kernel code, tested in CI.

Messages (``Et [R+1, K, B]`` the scaled emissions ``exp(E_t - max_k E_t)`` in chain order, ``A [K, K]`` the
transition matrix, parents by children):

* :func:`forward`: ``P_0 = Et_0``, ``P_{r+1} = (A P_r) / c_r * Et_{r+1}`` with ``c_r = sum_k P_r`` (so
  ``u_r = P_r / c_r`` are the scan's normalized states and ``c_r`` its scales).
* :func:`backward`: ``beta_R`` given, ``beta_r = A^T dy_{r+1}`` with ``dy_t = beta_t * Et_t / c_t``, the scan's
  backward messages; a program writes its rows of both, so that a step reads one message.

A program keeps its rows of ``A`` (or ``A^T``) in registers for all steps and reads each step's whole message
as one tile: :func:`fits` bounds both. ``K`` and ``B`` are padded to powers of two of at least 16 (zero rows of
``A`` and ``Et``; padding samples of ones, sliced off).
"""

from __future__ import annotations

import functools
from typing import Final

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .pallas_sum import KernelConfig, available, call_kernel, interpret_mode, mm, p2, plgpu

Array = jax.Array

MAX_PROGRAMS: Final = 64  # programs of one persistent kernel (all resident at once: well below the SMs)
MAX_TILE: Final = 16384  # values of one register tile of a program (eight warps: 64 registers per thread)
_CONFIG: Final = KernelConfig(num_warps=8, num_stages=1)


def _grid(K: int, interpret: bool) -> tuple[int, int]:
    """``(programs, rows per program)`` for ``K`` (a power of two of at least 16) message rows."""
    if interpret:
        return 1, K
    bm = max(16, K // MAX_PROGRAMS)
    return K // bm, bm


def grid_barrier(cnt_ref, target, interpret: bool) -> None:
    """Wait until every program has arrived ``target // G`` times (the counter reaches ``target``)."""
    if not interpret:
        plgpu.debug_barrier()  # every thread's stores of this step come before the release below
    seen = plgpu.atomic_add(cnt_ref, jnp.int32(0), jnp.int32(1)) + 1
    # polled with atomic reads (acquire): volatile loads and one atomic read after them gave stale messages on the H200.
    # Index and value traced from the carry: the interpreter's while-loop discharge takes no constants
    lax.while_loop(lambda v: v < target, lambda v: plgpu.atomic_add(cnt_ref, v * 0, v * 0), seen)


def _forward_kernel(a_ref, et_ref, cnt_in, p_ref, cnt_ref, *, R, bm, precision, interpret):
    del cnt_in  # aliased to cnt_ref
    i = pl.program_id(0)
    G = pl.num_programs(0)
    rows = pl.ds(i * bm, bm)
    a = plgpu.load(a_ref.at[rows, :])  # [bm, K]: the program's rows of A, in registers for all steps
    plgpu.store(p_ref.at[jnp.int32(0), rows, :], plgpu.load(et_ref.at[jnp.int32(0), rows, :]))
    grid_barrier(cnt_ref, G, interpret)

    def step(r, carry):
        s = plgpu.load(p_ref.at[r])  # [K, B]: every program's rows of the previous step
        tot = jnp.sum(s, axis=0, keepdims=True)
        tot = jnp.where(tot == 0, 1.0, tot)  # an impossible sample: the state stays zero
        plgpu.store(p_ref.at[r + 1, rows, :], mm(a, s, precision) / tot * plgpu.load(et_ref.at[r + 1, rows, :]))
        grid_barrier(cnt_ref, (r + 2) * G, interpret)
        return carry

    lax.fori_loop(0, R, step, 0)


def _backward_kernel(at_ref, ec_ref, b_ref, cnt_in, beta_ref, dy_ref, cnt_ref, *, R, bm, precision, interpret):
    del cnt_in
    i = pl.program_id(0)
    G = pl.num_programs(0)
    rows = pl.ds(i * bm, bm)
    at = plgpu.load(at_ref.at[rows, :])  # [bm, K]: the program's rows of A^T
    last = jnp.int32(R)
    beta = plgpu.load(b_ref.at[rows, :])
    plgpu.store(beta_ref.at[last, rows, :], beta)
    plgpu.store(dy_ref.at[last, rows, :], beta * plgpu.load(ec_ref.at[last, rows, :]))
    grid_barrier(cnt_ref, G, interpret)

    def step(j, carry):
        r = R - 1 - j
        beta = mm(at, plgpu.load(dy_ref.at[r + 1]), precision)  # [bm, B] from every program's rows of dy
        plgpu.store(beta_ref.at[r, rows, :], beta)
        plgpu.store(dy_ref.at[r, rows, :], beta * plgpu.load(ec_ref.at[r, rows, :]))
        grid_barrier(cnt_ref, (j + 2) * G, interpret)
        return carry

    lax.fori_loop(0, R, step, 0)


def _padded(x: Array, K: int, B: int, value: float) -> Array:
    """``x [..., k, b]`` padded to ``[..., K, B]``: zero rows, padding samples of ``value``."""
    pad = [(0, 0)] * (x.ndim - 2)
    x = jnp.pad(x, pad + [(0, K - x.shape[-2]), (0, 0)])
    return jnp.pad(x, pad + [(0, 0), (0, B - x.shape[-1])], constant_values=value)


def _sizes(K: int, B: int) -> tuple[int, int]:
    return max(16, p2(K)), max(16, p2(B))


def fits(K: int, B: int) -> bool:
    """Whether the kernels take ``K`` latents at ``B`` samples: a program holds its ``[bm, K]`` rows of the matrix
    and a whole ``[K, B]`` message in registers (each at most :data:`MAX_TILE` values, padded)."""
    Kp, Bp = _sizes(K, B)
    return Kp * Bp <= MAX_TILE and max(16, Kp // MAX_PROGRAMS) * Kp <= MAX_TILE


def unbatched(fn):
    """``fn`` (array arguments, array outputs) under ``vmap`` as a loop of unbatched calls. A batched
    ``pallas_call`` would add a grid axis, and the barrier counts programs of axis 0 only, with one counter for
    the whole grid."""
    fn = jax.custom_batching.custom_vmap(fn)

    @fn.def_vmap
    def _rule(axis_size, in_batched, *args):
        args = [a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in zip(args, in_batched)]
        out = lax.map(lambda xs: fn(*xs), tuple(args))
        return out, jax.tree_util.tree_map(lambda _: True, out)

    return fn


@functools.cache
def _forward_call(precision: str):
    def call(A, Et):
        R1, K, B = Et.shape
        Kp, Bp = _sizes(K, B)
        interpret = interpret_mode()
        G, bm = _grid(Kp, interpret)
        kernel = functools.partial(_forward_kernel, R=R1 - 1, bm=bm, precision=precision, interpret=interpret)
        P, _ = call_kernel(kernel, _CONFIG, grid=(G,),
                           out_shape=(jax.ShapeDtypeStruct((R1, Kp, Bp), jnp.float32),
                                      jax.ShapeDtypeStruct((1,), jnp.int32)),
                           input_output_aliases={2: 1})(
            _padded(A.astype(jnp.float32), Kp, Kp, 0.0), _padded(Et.astype(jnp.float32), Kp, Bp, 1.0),
            jnp.zeros((1,), jnp.int32))
        return P[:, :K, :B]

    return unbatched(call)


@functools.cache
def _backward_call(precision: str):
    def call(A, Ec, beta_R):
        R1, K, B = Ec.shape
        Kp, Bp = _sizes(K, B)
        interpret = interpret_mode()
        G, bm = _grid(Kp, interpret)
        kernel = functools.partial(_backward_kernel, R=R1 - 1, bm=bm, precision=precision, interpret=interpret)
        beta, dy, _ = call_kernel(kernel, _CONFIG, grid=(G,),
                                  out_shape=(jax.ShapeDtypeStruct((R1, Kp, Bp), jnp.float32),
                                             jax.ShapeDtypeStruct((R1, Kp, Bp), jnp.float32),
                                             jax.ShapeDtypeStruct((1,), jnp.int32)),
                                  input_output_aliases={3: 2})(
            _padded(A.T.astype(jnp.float32), Kp, Kp, 0.0), _padded(Ec.astype(jnp.float32), Kp, Bp, 1.0),
            _padded(beta_R.astype(jnp.float32), Kp, Bp, 0.0), jnp.zeros((1,), jnp.int32))
        return beta[:, :K, :B], dy[:, :K, :B]

    return unbatched(call)


def forward(A: Array, Et: Array, precision: str) -> Array:
    """The unnormalized states ``P [R+1, K, B]`` (module docstring) of transitions ``A [K, K]`` and scaled
    emissions ``Et [R+1, K, B]``, float32. Under ``vmap``: one launch per batch element."""
    return _forward_call(precision)(A, Et)


def backward(A: Array, Ec: Array, beta_R: Array, precision: str) -> tuple[Array, Array]:
    """The backward messages ``beta [R+1, K, B]`` (module docstring) from ``beta_R [K, B]`` and the scaled
    emissions over the scales, ``Ec_t = Et_t / c_t``; and ``dy = beta * Ec``, the messages each step multiplies
    by ``A^T`` (``dy[0]`` is unused). Float32. Under ``vmap``: one launch per batch element."""
    return _backward_call(precision)(A, Ec, beta_R)


__all__ = ["MAX_PROGRAMS", "MAX_TILE", "available", "backward", "fits", "forward", "grid_barrier", "unbatched"]
