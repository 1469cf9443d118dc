"""Chain-structured circuits (HMMs) as a rescaled linear-space scan: the forward-backward algorithm.

For a chain found at compile time (:mod:`jaxpc.compiler.chain`) with emission log-values ``E_t``
(``[K, B]``, chain position ``t = 0 .. R``), transition matrices ``A_r`` (``[K, K]``, parents by
children, ``exp`` of the sum log-weights) and root weights ``g``, the root value is

    log p = log g^T (e_R * A_{R-1} (... e_1 * A_0 e_0)),   e_t = exp(E_t).

The forward pass keeps one ``[K, B]`` state: ``u_0 = e~_0 / c_0``, ``u_{r+1} = (A_r u_r) * e~_{r+1} / c_r``
with ``e~_t = exp(E_t - max_k E_t)`` and ``c_r`` the state's sum, so ``log p = log g^T u_R + sum log c +
sum max E`` (exact; nothing under- or overflows). Its VJP is the backward algorithm with the same
scales: ``beta_R = g / g^T u_R``, ``beta_r = A_r^T ((beta_{r+1} / c_r) * e~_{r+1})``; the input flows are
the posteriors ``beta_t * u_t`` and the transition flows ``A_r * sum_b dy_r u_r^T`` (``dy_r`` the scaled
backward message), reduced in one matrix product over all steps and samples when the transitions are
tied. Per step the scan runs one matrix product forward and one backward, where the layer-by-layer path
runs a gather, a max, a product and a scatter per layer through the ``[R, B]`` node buffer.

A latent state whose forward share underflows to exactly 0 (float32: a share below ~1e-38 of its step's, as
with identity or left-to-right transitions and emissions of 0.001 against 0.999 over a dozen steps) has no
posterior, and its backward message is set to 0 there (:func:`_live`): left alone it grows by the inverse of the
lost shares until it overflows, and ``inf * 0`` made every flow of the sample NaN.

At small batches (:func:`persistent`) the two scans run as one persistent Pallas kernel each
(:mod:`jaxpc.ops.pallas_chain`: every step in one launch, a grid-wide barrier between steps), and the posteriors
and transition flows come after them from the stacked messages; on the H200, HMM-1024's forward + flows at batch 16
took 1.28 against 1.75 ms on the scans, HMM-256's at batches 16 to 64 0.90-0.98 against 1.81-1.90. The backward
kernel passes nothing back through states whose forward share is 0, as the scan does; the backward half of the
side-by-side launch (:func:`side_by_side`) runs before the forward's states exist and cannot: where its messages
and the forward's lose different states to underflow, some step's posteriors no longer sum to the sample's
cotangent (:func:`posteriors_hold`, checked on the device), and the one-way backward kernel runs instead.

Same flows as :func:`jaxpc.engine.flows.root_values` (tests compare the two paths and the forward
algorithm); used by :func:`jaxpc.engine.forward.evaluate` when ``options.chain_scan`` allows it.
"""

from __future__ import annotations

import functools
from typing import Final

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..compiler.layout import ChainSpec
from ..ops import pallas_chain
from ..ops.buffers import uninitialized
from ..ops.rows import add_rows, take_rows
from ..ops.sum_layer import matmul
from ..ops.triton_base import route_impl

Array = jax.Array

def _unroll(B: int, tuning):
    """Steps per iteration of the scans' loops: ``tuning.chain_unroll`` from ``tuning.chain_unroll_batch``
    samples on, one below."""
    return tuning.chain_unroll if B >= tuning.chain_unroll_batch else 1


def applies(layout, options, evidence_externals: bool) -> bool:
    """Whether ``layout``'s root value may be computed by this module under ``options``."""
    return (layout.chain is not None and options.chain_scan and options.backward == "flows"
            and options.propagation == "LL" and options.pflow_temperature == 1.0
            and options.eflow_temperature == 1.0 and not evidence_externals)


def _on_gpu() -> bool:
    """Whether traced code runs on a GPU (:func:`jaxpc.engine.routing.on_gpu`'s answer; routing imports this
    module, so it asks here)."""
    return jax.default_backend() == "gpu"


def persistent(spec: ChainSpec, B: int, dtype, options) -> bool:
    """Whether the scans run as the persistent kernels of :mod:`jaxpc.ops.pallas_chain` (one launch each way): a
    tied float32 chain at most ``tuning.chain_kernel_batch`` samples wide whose messages fit the kernels' tiles
    (:func:`jaxpc.ops.pallas_chain.fits`: 1,024 latents up to 16 samples), with ``impl="auto"`` on a GPU or
    ``"pallas"`` / ``"pallas_forward"`` anywhere (interpret mode off a GPU); ``"triton"`` where the jax-triton
    route does not run counts as ``"auto"`` (:func:`jaxpc.ops.triton_base.route_impl`). Not in interpret mode under
    ``jax_enable_x64``: Pallas's interpreter runs the kernels' grid with 64-bit program ids, which their int32
    indices do not mix with (on a GPU they lower from a 32-bit trace, :mod:`jaxpc.ops.x32`)."""
    if not (spec.tied and B <= options.tuning.chain_kernel_batch and jnp.dtype(dtype) == jnp.float32
            and pallas_chain.available() and pallas_chain.fits(spec.K, B)):
        return False
    impl = route_impl(options)
    if not _on_gpu():
        return impl in ("pallas", "pallas_forward") and not jax.config.jax_enable_x64
    return impl in ("pallas", "pallas_forward", "auto")


def _matrix(logw: Array, pid: Array, K: int) -> Array:
    """``[K, K]`` linear weights (parents by children) of one dense sum partition with blocks ``pid [n, C]``."""
    w = jnp.exp(take_rows(logw, pid))  # [n, C, Kp, Kc]
    return w.transpose(0, 2, 1, 3).reshape(K, K)


def _blocks(full: Array, n: int, C: int, Kp: int, Kc: int) -> Array:
    """Inverse of :func:`_matrix`'s layout: ``[..., K, K]`` -> ``[..., n, C, Kp, Kc]``."""
    lead = full.shape[:-2]
    b = full.reshape(*lead, n, Kp, C, Kc)
    return jnp.moveaxis(b, -2, -3)


def _safe(c: Array) -> Array:
    return jnp.where(c == 0, 1.0, c)


def _live(beta: Array, u: Array) -> Array:
    """The backward message ``beta`` where the forward state ``u`` is positive, 0 where it is 0. A state whose
    forward share underflowed to 0 carries no posterior (``beta * u``), while its backward message grows by the
    inverse of the shares it lost (by 1e3 a step for an emission of 0.001 against 0.999) until it overflows, and
    ``inf * 0`` would make every flow NaN: the backward algorithm differentiates the forward that was computed,
    in which that state's paths are gone."""
    return jnp.where(u > 0, beta, jnp.zeros((), beta.dtype))


POSTERIOR_TOLERANCE: Final = {"fp32": 1e-2, "tf32": 1e-2, "bf16": 1e-1}  # |sum_k post / gbar - 1| allowed


def posteriors_hold(post: Array, gbar: Array, precision: str) -> Array:
    """Whether every step's posteriors ``post [R+1, K, B]`` (scaled by the sample's cotangent ``gbar [B]``) sum to
    ``gbar`` within :data:`POSTERIOR_TOLERANCE`, as exact messages' do: a scalar bool. The side-by-side launch's
    backward messages are normalized on their own; where they lose to underflow a state that the forward keeps
    (or the reverse) a step's posteriors sum to 0, inf or NaN, and the one-way backward replaces them."""
    s = jnp.sum(post, axis=1)  # [R+1, B]
    return jnp.all(jnp.abs(s - gbar[None, :]) <= POSTERIOR_TOLERANCE[precision] * jnp.abs(gbar)[None, :])


def _shifts(E: Array) -> Array:
    """Each position's max over the latents of its emission log-values ``E [R+1, K, B]``: ``[R+1, B]``."""
    m = jnp.max(E, axis=1)
    return jnp.where(jnp.isfinite(m), m, 0.0)  # an all -inf step gives e~ = 0: log p = -inf, zero flows


def _root_weights(spec: ChainSpec, ctab: dict, sum_params: dict) -> Array:
    """The root sum's linear weights ``[K]``."""
    return jnp.exp(take_rows(sum_params[spec.root_group], ctab["root_pid"])).reshape(spec.K)  # [1, C, 1, Kc] -> [K]


def _forward(spec: ChainSpec, ctab: dict, sum_params: dict, vals: Array, precision: str, tuning):
    """The scan. ``vals``: the input layer's ``[N, B]`` values, read in place as ``R + 1`` blocks (chain
    position ``t`` is block ``spec.order[t]``); the emission scales ``e~`` are recomputed where needed."""
    logw = sum_params[spec.group]
    K, B = spec.K, vals.shape[1]
    E = vals.reshape(spec.R + 1, K, B)
    m = _shifts(E)
    order = jnp.asarray(spec.order, jnp.int32)
    e0 = jnp.exp(E[spec.order[0]] - m[spec.order[0]])
    c0 = jnp.sum(e0, axis=0)
    u0 = e0 / _safe(c0)
    A = _matrix(logw, ctab["pid"], K) if spec.tied else None

    def step(u, xs):
        blk, pid = xs
        a = A if pid is None else _matrix(logw, pid, K)
        p = matmul("kj,jb->kb", a, u, precision) * jnp.exp(E[blk] - m[blk])
        c = jnp.sum(p, axis=0)
        return p / _safe(c), (u, c)

    uR, (U, cs) = lax.scan(step, u0, (order[1:], None if spec.tied else ctab["pid"]), unroll=_unroll(B, tuning))
    g = _root_weights(spec, ctab, sum_params)
    rl = matmul("k,kb->b", g, uR, precision)
    ll = jnp.log(rl) + jnp.log(c0) + jnp.sum(jnp.log(cs), axis=0) + jnp.sum(m, axis=0)
    return ll, (E, m, u0, U, uR, cs, rl, A, g)


def side_by_side(spec: ChainSpec, B: int, dtype, options) -> bool:
    """Whether the flows' forward runs the backward messages beside the forward ones in one persistent kernel
    (:func:`jaxpc.ops.pallas_chain.forward_backward`; ``Tuning.chain_side_by_side``): where the persistent kernels
    run (:func:`persistent`) and both halves of the launch fit the device at once."""
    return (options.tuning.chain_side_by_side and persistent(spec, B, dtype, options)
            and pallas_chain.fits_both(spec.K, B))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def root_values(spec: ChainSpec, ctab: dict, sum_params: dict, input_vals: list, options) -> Array:
    """Root log-values ``[B]`` of a chain from its sum log-weights and its input layer's values."""
    return _forward_pass(spec, ctab, sum_params, input_vals, options)[0]


def _forward_pass(spec, ctab, sum_params, input_vals, options, backward: bool = False):
    """``(log-values, residuals)``; ``backward``: for the flows, whose backward messages then come from the forward's
    launch where :func:`side_by_side`."""
    vals = input_vals[0]
    if persistent(spec, vals.shape[1], vals.dtype, options):
        return _forward_kernels(spec, ctab, sum_params, vals, options.concrete_precision,
                                backward and side_by_side(spec, vals.shape[1], vals.dtype, options))
    return _forward(spec, ctab, sum_params, vals, options.concrete_precision, options.tuning)


def _fwd(spec, ctab, sum_params, input_vals, options):
    ll, res = _forward_pass(spec, ctab, sum_params, input_vals, options, backward=True)
    return ll, (ctab, sum_params, ll, res)


def _bwd(spec, options, saved, gbar):
    if persistent(spec, gbar.shape[0], saved[2].dtype, options):
        return _bwd_kernels(spec, options, saved, gbar)
    ctab, sum_params, ll, (E, m, u0, U, uR, cs, rl, A, g) = saved
    K, R, B = spec.K, spec.R, u0.shape[1]
    prec = options.concrete_precision
    logw = sum_params[spec.group]
    gbar = jnp.where(ll == -jnp.inf, 0.0, gbar.astype(ll.dtype))  # impossible samples: zero flows, never NaN
    betaR = g[:, None] * (gbar / _safe(rl))[None, :]
    want_params = options.compute_param_flows
    stack = want_params and (not spec.tied or R * K * B <= options.tuning.chain_stack_limit)
    order = jnp.asarray(spec.order, jnp.int32)

    def step(carry, xs):
        beta, u_next, dA, d_in = carry
        blk, u, c, pid = xs
        beta = _live(beta, u_next)
        e = lax.dynamic_index_in_dim(d_in if over_e else E, blk, 0, keepdims=False)  # read before it is written
        d_in = lax.dynamic_update_index_in_dim(d_in, beta * u_next, blk, 0)  # the emission's posterior
        dy = (beta / _safe(c)[None, :]) * jnp.exp(e - m[blk])
        a = A if pid is None else _matrix(logw, pid, K)
        beta_prev = matmul("kj,kb->jb", a, dy, prec)
        if dA is not None:
            dA = dA + matmul("kb,jb->kj", dy, u, prec)
        return (beta_prev, u, dA, d_in), (dy if stack else None)

    dA0 = jnp.zeros((K, K), u0.dtype) if (want_params and not stack) else None
    xs = (order[1:], U, cs, None if spec.tied else ctab["pid"])
    # each step writes its block's posteriors (order: every block once). An unrolled loop keeps more temporaries
    # alive; there the input flows overwrite the emission values E block by block (each step reads its block
    # first), so that the two are not in memory side by side (HMM-1024 at B=512, 8 steps per iteration: 477
    # against 605 MiB). One step per iteration, XLA copies E into the carry instead (81 -> 85 MiB at B=16 on the
    # H200): the flows then go to an unset buffer (zeros while small: uninitialized).
    unroll = _unroll(B, options.tuning)
    over_e = unroll != 1
    d_in = E if over_e else uninitialized(E.shape, E.dtype, options.tuning.min_unset)
    (beta0, _, dA, d_in), dY = lax.scan(step, (betaR, uR, dA0, d_in), xs, reverse=True, unroll=unroll)
    d_in = lax.dynamic_update_index_in_dim(d_in, _live(beta0, u0) * u0, spec.order[0], 0)

    dparams = {k: jnp.zeros_like(v) for k, v in sum_params.items()}
    if want_params:
        if spec.tied:
            if stack:
                dA = matmul("rkb,rjb->kj", dY, U, prec)
        else:
            Ar = jax.vmap(lambda p: _matrix(logw, p, K))(ctab["pid"])
            dA = Ar * matmul("rkb,rjb->rkj", dY, U, prec)
        dparams = _param_flows(spec, ctab, dparams, A, dA, g, uR, gbar / _safe(rl), prec)
    return None, dparams, [d_in.reshape(-1, B)]


def _param_flows(spec: ChainSpec, ctab: dict, dparams: dict, A, dA, g, uR, groot, prec) -> dict:
    """``dparams`` with the transitions' flows (``A * dA`` for a tied chain; per step ``dA [R, K, K]``, already
    times its matrix, otherwise) and the root's (``g * uR groot``) added into their parameter blocks."""
    K = spec.K
    n, C = K // spec.Kp, K // spec.Kc
    blocks = _blocks(A * dA if spec.tied else dA, n, C, spec.Kp, spec.Kc)
    dparams[spec.group] = add_rows(dparams[spec.group], ctab["pid"], blocks.astype(dparams[spec.group].dtype))
    dg = g * matmul("kb,b->k", uR, groot, prec)  # [K]
    rg = spec.root_group
    rblocks = dg.reshape(1, K // spec.root_Kc, 1, spec.root_Kc)
    dparams[rg] = add_rows(dparams[rg], ctab["root_pid"], rblocks.astype(dparams[rg].dtype))
    return dparams


def _forward_kernels(spec: ChainSpec, ctab: dict, sum_params: dict, vals: Array, precision: str,
                     backward: bool = False):
    """:func:`_forward` on the persistent kernel: the states ``P`` of all positions at once (chain order); with
    ``backward``, the backward messages up to their factors from the same launch
    (:func:`jaxpc.ops.pallas_chain.forward_backward`)."""
    K, B = spec.K, vals.shape[1]
    E = vals.reshape(spec.R + 1, K, B)[jnp.asarray(spec.order, jnp.int32)]
    m = _shifts(E)
    Et = jnp.exp(E - m[:, None, :])
    A = _matrix(sum_params[spec.group], ctab["pid"], K)
    g = _root_weights(spec, ctab, sum_params)
    if backward:  # (the emissions stay for the one-way backward that replaces a launch whose posteriors fail)
        P, beta, dy = pallas_chain.forward_backward(A, Et, g, precision)
    else:
        P, beta, dy = pallas_chain.forward(A, Et, precision), None, None
    c = jnp.sum(P, axis=1)  # [R+1, B]: the scales
    U = P / _safe(c)[:, None, :]
    rl = matmul("k,kb->b", g, U[-1], precision)
    ll = jnp.log(rl) + jnp.sum(jnp.log(c), axis=0) + jnp.sum(m, axis=0)
    return ll, (Et, c, U, rl, A, g, beta, dy)


def _bwd_kernels(spec: ChainSpec, options, saved, gbar):
    """:func:`_bwd` on the persistent kernels: all backward messages at once (from the backward kernel, or, where
    the forward's launch computed them, scaled by each step's and sample's factor ``F`` of
    :func:`jaxpc.ops.pallas_chain.forward_backward`, from the two chains' column sums), then the posteriors and the
    transition flows in one product over steps and samples."""
    ctab, sum_params, ll, (Et, c, U, rl, A, g, beta, dY) = saved
    prec = options.concrete_precision
    gbar = jnp.where(ll == -jnp.inf, 0.0, gbar.astype(ll.dtype))
    groot = gbar / _safe(rl)

    def one_way():  # (a state whose forward share is 0 passes nothing back: _live)
        Ec = jnp.where(U > 0, Et / _safe(c)[:, None, :], jnp.zeros((), Et.dtype))
        b, d = pallas_chain.backward(A, Ec, _live(g[:, None] * groot[None, :], U[-1]), prec)
        return _live(b, U) * U, d

    if beta is None:
        post, dY = one_way()
    else:  # (messages computed without the forward's states, which _live needs: see the module docstring)
        lr = jnp.log(_safe(jnp.sum(dY, axis=1))) - jnp.log(_safe(c))  # [R+1, B]: log(n_s / c_s)
        after = jnp.cumsum(lr[::-1], axis=0)[::-1] - lr  # sum over s > r
        ea = jnp.exp(after)  # impossible samples (groot 0): zero flows, never 0 * inf; linear in groot
        F = jnp.where((groot == 0) & ~jnp.isfinite(ea), 0.0, groot * ea)  # [R+1, B]
        post, dY = _live(beta * F[:, None, :], U) * U, dY * (F / _safe(c))[:, None, :]
        kept = (post, dY)  # (the one-way kernel runs only where the check fails)
        post, dY = lax.cond(posteriors_hold(post, gbar, prec), lambda: kept, one_way)
    inverse = np.argsort(np.asarray(spec.order))  # chain position of each emission block
    d_in = post[jnp.asarray(inverse, jnp.int32)].reshape(-1, U.shape[2])
    dparams = {k: jnp.zeros_like(v) for k, v in sum_params.items()}
    if options.compute_param_flows:
        dA = matmul("rkb,rjb->kj", dY[1:], U[:-1], prec)
        dparams = _param_flows(spec, ctab, dparams, A, dA, g, U[-1], groot, prec)
    return None, dparams, [d_in]


root_values.defvjp(_fwd, _bwd)
