"""A chain's (HMM's) forward and backward messages as persistent Pallas kernels: one launch for both directions
(or one per direction).

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

* :func:`forward_backward`: both in one launch, half the programs each way, the backward normalized step by step so
  that it does not read the forward's scales: the two chains run side by side instead of one after the other.

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


def grid_barrier(cnt_ref, target, interpret: bool, slot: int = 0) -> None:
    """Wait until every program of a group has arrived ``target // G`` times (counter ``slot`` reaches
    ``target``)."""
    if not interpret:
        plgpu.debug_barrier()  # every thread's stores of this step come before the release below
    seen = plgpu.atomic_add(cnt_ref, jnp.int32(slot), jnp.int32(1)) + 1
    # polled with atomic reads (acquire): volatile loads and one atomic read after them gave stale messages on the H200.
    # Index and value traced from the carry: the interpreter's while-loop discharge takes no constants
    lax.while_loop(lambda v: v < target, lambda v: plgpu.atomic_add(cnt_ref, v * 0 + slot, v * 0), seen)


def _forward_steps(a_ref, et_ref, p_ref, cnt_ref, i, G, *, R, bm, precision, interpret, slot=0):
    """Program ``i`` of the ``G`` that run the forward messages (barriers on counter ``slot``)."""
    rows = pl.ds(i * bm, bm)
    a = plgpu.load(a_ref.at[rows, :])  # [bm, K]: the program's rows of A, in registers for all steps
    plgpu.store(p_ref.at[jnp.int32(0), rows, :], plgpu.load(et_ref.at[jnp.int32(0), rows, :]))
    grid_barrier(cnt_ref, G, interpret, slot)

    def step(r, carry):
        s = plgpu.load(p_ref.at[r])  # [K, B]: every program's rows of the previous step
        tot = jnp.sum(s, axis=0, keepdims=True)
        tot = jnp.where(tot == 0, 1.0, tot)  # an impossible sample: the state stays zero
        plgpu.store(p_ref.at[r + 1, rows, :], mm(a, s, precision) / tot * plgpu.load(et_ref.at[r + 1, rows, :]))
        grid_barrier(cnt_ref, (r + 2) * G, interpret, slot)
        return carry

    lax.fori_loop(0, R, step, 0)


def _backward_steps(at_ref, e_ref, b_ref, beta_ref, dy_ref, cnt_ref, i, G, *, R, bm, precision, interpret,
                    normalized=False, slot=0):
    """Program ``i`` of the ``G`` that run the backward messages (barriers on counter ``slot``); ``normalized``:
    each step's product divided by the column sums of the message it multiplies (:func:`forward_backward`)."""
    rows = pl.ds(i * bm, bm)
    at = plgpu.load(at_ref.at[rows, :])  # [bm, K]: the program's rows of A^T
    last = jnp.int32(R)
    beta = plgpu.load(b_ref.at[rows, :])
    plgpu.store(beta_ref.at[last, rows, :], beta)
    plgpu.store(dy_ref.at[last, rows, :], beta * plgpu.load(e_ref.at[last, rows, :]))
    grid_barrier(cnt_ref, G, interpret, slot)

    def step(j, carry):
        r = R - 1 - j
        s = plgpu.load(dy_ref.at[r + 1])  # [K, B]: every program's rows of dy
        beta = mm(at, s, precision)  # [bm, B]
        if normalized:
            tot = jnp.sum(s, axis=0, keepdims=True)
            beta = beta / jnp.where(tot == 0, 1.0, tot)
        plgpu.store(beta_ref.at[r, rows, :], beta)
        plgpu.store(dy_ref.at[r, rows, :], beta * plgpu.load(e_ref.at[r, rows, :]))
        grid_barrier(cnt_ref, (j + 2) * G, interpret, slot)
        return carry

    lax.fori_loop(0, R, step, 0)


def _forward_kernel(a_ref, et_ref, cnt_in, p_ref, cnt_ref, *, R, bm, precision, interpret):
    del cnt_in  # aliased to cnt_ref
    _forward_steps(a_ref, et_ref, p_ref, cnt_ref, pl.program_id(0), pl.num_programs(0), R=R, bm=bm,
                   precision=precision, interpret=interpret)


def _backward_kernel(at_ref, ec_ref, b_ref, cnt_in, beta_ref, dy_ref, cnt_ref, *, R, bm, precision, interpret):
    del cnt_in
    _backward_steps(at_ref, ec_ref, b_ref, beta_ref, dy_ref, cnt_ref, pl.program_id(0), pl.num_programs(0), R=R,
                    bm=bm, precision=precision, interpret=interpret)


def _both_kernel(a_ref, at_ref, et_ref, b_ref, cnt_in, p_ref, beta_ref, dy_ref, cnt_ref, *, R, bm, precision,
                 interpret):
    """Programs ``[0, G)`` run the forward messages, ``[G, 2 G)`` the normalized backward ones, side by side."""
    del cnt_in
    i = pl.program_id(0)
    G = pl.num_programs(0) // 2
    kw = dict(R=R, bm=bm, precision=precision, interpret=interpret)

    @pl.when(i < G)
    def _():
        _forward_steps(a_ref, et_ref, p_ref, cnt_ref, i, G, slot=0, **kw)

    @pl.when(i >= G)
    def _():
        _backward_steps(at_ref, et_ref, b_ref, beta_ref, dy_ref, cnt_ref, i - G, G, normalized=True, slot=1, **kw)


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


@functools.cache
def _multiprocessors() -> int:
    """The first device's streaming multiprocessors (0 where JAX does not say)."""
    try:
        return int(getattr(jax.devices()[0], "core_count", 0) or 0)
    except Exception:  # noqa: BLE001 - no device description: the side-by-side kernel is not used
        return 0


def fits_both(K: int, B: int) -> bool:
    """Whether :func:`forward_backward` runs: :func:`fits`, and its two groups of programs resident at once (twice
    a direction's programs within the device's multiprocessors; always in interpret mode, one program each)."""
    if not fits(K, B):
        return False
    if interpret_mode():
        return True
    return 2 * _grid(_sizes(K, B)[0], False)[0] <= _multiprocessors()


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


def _launch(body, shape: tuple, precision: str, inputs, messages: int, groups: int = 1) -> tuple:
    """One launch of kernel ``body`` over messages of ``shape`` (``[R+1, K, B]``): ``groups`` groups of programs
    with a barrier counter each (aliased in), ``inputs(Kp, Bp)`` the padded inputs, ``messages`` outputs of the
    padded shape. Returns the messages, unpadded."""
    R1, K, B = shape
    Kp, Bp = _sizes(K, B)
    interpret = interpret_mode()
    G, bm = _grid(Kp, interpret)
    kernel = functools.partial(body, R=R1 - 1, bm=bm, precision=precision, interpret=interpret)
    args = inputs(Kp, Bp)
    msg = jax.ShapeDtypeStruct((R1, Kp, Bp), jnp.float32)
    out = call_kernel(kernel, _CONFIG, grid=(groups * G,),
                      out_shape=(msg,) * messages + (jax.ShapeDtypeStruct((groups,), jnp.int32),),
                      input_output_aliases={len(args): messages})(*args, jnp.zeros((groups,), jnp.int32))
    return tuple(o[:, :K, :B] for o in out[:messages])


def _f32(x: Array, K: int, B: int, value: float) -> Array:
    return _padded(x.astype(jnp.float32), K, B, value)


@functools.cache
def _forward_call(precision: str):
    def call(A, Et):
        return _launch(_forward_kernel, Et.shape, precision,
                       lambda K, B: (_f32(A, K, K, 0.0), _f32(Et, K, B, 1.0)), 1)[0]

    return unbatched(call)


@functools.cache
def _backward_call(precision: str):
    def call(A, Ec, beta_R):
        return _launch(_backward_kernel, Ec.shape, precision,
                       lambda K, B: (_f32(A.T, K, K, 0.0), _f32(Ec, K, B, 1.0), _f32(beta_R, K, B, 0.0)), 2)

    return unbatched(call)


@functools.cache
def _both_call(precision: str):
    def call(A, Et, g):
        def inputs(K, B):
            a = _f32(A, K, K, 0.0)
            return a, a.T, _f32(Et, K, B, 1.0), jnp.broadcast_to(_f32(g[:, None], K, 1, 0.0), (K, B))

        return _launch(_both_kernel, Et.shape, precision, inputs, 3, groups=2)

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


def forward_backward(A: Array, Et: Array, g: Array, precision: str) -> tuple[Array, Array, Array]:
    """:func:`forward`'s states ``P`` and backward messages that need no forward scales, from one launch whose two
    halves run side by side (:func:`fits_both`): ``beta'_R = g`` (``[K]``, every sample), ``dy'_t = beta'_t *
    Et_t``, ``beta'_r = (A^T dy'_{r+1}) / n_{r+1}`` with ``n_t = sum_k dy'_t`` (1 where 0). They are
    :func:`backward`'s messages for ``beta_R = g groot`` up to one factor per step and sample: ``beta_r = beta'_r
    F_r``, ``dy_t = dy'_t F_t / c_t``, ``F_r = groot prod_{s > r} n_s / c_s`` (``c``: the forward's scales), so
    the backward no longer waits for the forward. Returns ``(P, beta', dy')``, float32 ``[R+1, K, B]`` each."""
    return _both_call(precision)(A, Et, g)


__all__ = ["MAX_PROGRAMS", "MAX_TILE", "available", "backward", "fits", "fits_both", "forward", "forward_backward",
           "grid_barrier", "unbatched"]
