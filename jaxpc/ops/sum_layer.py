"""Block-sparse sum layer.

For ``n`` parent blocks of ``Kp`` nodes, each with ``C`` child blocks of ``Kc`` nodes (rows
``ch[i, c] + [0, Kc)`` of the node buffer) and weight blocks ``logw[pid[i, c]]`` (``[Kp, Kc]``):

* LL: ``out[i, k, b] = m + log sum_{c, j} w[i, k, c, j] exp(x[i, c, j, b] - m)``, ``m`` the max over
  the block's children (a batched matmul in linear space, as in PyJuice).
* GeneralLL(alpha): ``out = m + (1/alpha) log sum w^alpha exp(alpha (x - m))`` for ``1e-3 <= alpha <= 1``
  (:func:`factored`); outside, ``out = M + (1/alpha) log sum exp(alpha (t - M))`` over the terms ``t = log w + x``
  with ``M`` each parent's largest term (:func:`tempered_log_sum`).
* MPE: ``out = max_{c, j} (log w + x)``; its flows go to the first maximizing child (:func:`first_max`).

An exponent ``a`` (``alpha``, or ``alpha / T`` for flows tempered by ``T``) is computed as the factored product
``exp(a log w) @ exp(a (x - m))`` only where :func:`factored` holds (``a <= 1``): above 1 both factors underflow
in float32 (at ``a = 1000`` a weight below 0.9, or a child value below 0.9 times its block's largest, gives 0),
so larger exponents are computed from the terms, shifted per parent and sample, on XLA (the routes never send them
to the kernels: :func:`jaxpc.engine.routing.factored_forward`).

``m`` is a stop-gradient shift, so ``d out / d x`` and ``d out / d log w`` are exactly the
normalized edge posteriors: ``jax.grad`` of the root log-likelihood yields flows. Zero sums
give ``-inf`` with zero (not NaN) gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..options import IMPLS, KERNEL_IMPLS
from .rows import take_rows

Array = jax.Array


def child_rows(ch: Array, Kc: int, dense: bool) -> Array:
    """Buffer rows of the children: ``[n, C*Kc]`` (``[C*Kc]`` when ``dense``) for a table ``ch [n, C]``."""
    ar = jnp.arange(Kc, dtype=ch.dtype)
    if dense:
        return (ch[0][:, None] + ar).reshape(-1)
    n, C = ch.shape
    return (ch[:, :, None] + ar).reshape(n, C * Kc)


def child_terms(ch: Array) -> list[Array]:
    """The ``[n, C]`` tables whose rows add up to the children: ``[ch]``, or one per slice of a folded
    table ``ch [n, C, M]`` (each child block the sum of ``M`` row blocks: a folded product's children)."""
    return [ch] if ch.ndim == 2 else [ch[:, :, m] for m in range(ch.shape[2])]


def gather_children(buf: Array, ch: Array, Kc: int, dense: bool) -> Array:
    """``[n, C*Kc, B]`` child values (``[C*Kc, B]`` when ``dense``)."""
    terms = child_terms(ch)
    x = take_rows(buf, child_rows(terms[0], Kc, dense))
    for t in terms[1:]:
        x = x + take_rows(buf, child_rows(t, Kc, dense))
    return x


def gather_weights(logw: Array, pid: Array) -> Array:
    """``[n, Kp, C*Kc]`` log-weights of each parent block."""
    w = take_rows(logw, pid)  # [n, C, Kp, Kc]
    n, C, Kp, Kc = w.shape
    return w.transpose(0, 2, 1, 3).reshape(n, Kp, C * Kc)


def matmul(subscripts: str, a: Array, b: Array, precision: str) -> Array:
    """``einsum`` at a precision: ``"fp32"`` exact, ``"tf32"`` the backend default, ``"bf16"`` bfloat16
    operands with accumulation in the operands' dtype."""
    if precision == "bf16":
        out = a.dtype
        return jnp.einsum(subscripts, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=out)
    prec = lax.Precision.HIGHEST if precision == "fp32" else lax.Precision.DEFAULT
    return jnp.einsum(subscripts, a, b, precision=prec)


def factored(a: float) -> bool:
    """Whether a sum-product exponent ``a`` (GeneralLL's ``alpha``; a flow's ``alpha / T`` or ``1 / T``) may be
    computed as the factored product ``exp(a log w) @ exp(a (x - m))``, ``m`` the max over a block's children
    alone (XLA's matrix products and the kernels): ``1e-3 <= a <= 1``, where each factor is at least the untempered
    one. Above 1 the weights' factor and the children's underflow in float32; below 1e-3 the factored sum rounds to
    within ``a`` of 1, and ``log(sum) / a`` turns its float32 rounding into an error of ``6e-8 / a`` (0.2 at
    ``a = 1e-7``, where one finite term must give its own value exactly). Such exponents are computed from the terms
    (:func:`tempered_log_sum`, :func:`tempered_split`)."""
    return 1e-3 <= a <= 1.0


def _finite_max(x: Array, axis: int) -> Array:
    """The shift of a log-sum over ``axis`` of ``x``: its max there (kept as an axis of 1, no gradient), 0 where that
    is not finite. Over a block's children's values ``[n, C*Kc, B]`` (axis 1, or 0 for a dense ``[C*Kc, B]``), the
    factored products' block shift; over each parent's terms ``[n, Kp, C*Kc, B]`` (axis 2), the terms' shift."""
    m = lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _log_sum(lw: Array, x: Array, dense: bool, alpha: float, precision: str) -> tuple[Array, Array]:
    """``(log-sums, shifts)``: ``[n, Kp, B]`` and the max-shifts ``[n, 1, B]`` (``[1, B]`` when ``dense``)."""
    m = _finite_max(x, 0 if dense else 1)
    y = jnp.exp(alpha * (x - m)) if alpha != 1.0 else jnp.exp(x - m)
    w = jnp.exp(alpha * lw) if alpha != 1.0 else jnp.exp(lw)
    s = matmul("nkc,cb->nkb" if dense else "nkc,ncb->nkb", w, y, precision)
    zero = s == 0  # (NaN stays NaN: bad input is never turned into a plausible value)
    logs = jnp.log(jnp.where(zero, 1.0, s))
    if alpha != 1.0:
        logs = logs / alpha
    return jnp.where(zero, -jnp.inf, logs + m), m


def tempered_log_sum(t: Array, a: float) -> Array:
    """``[n, Kp, B]``: ``(1/a) log sum_c exp(a t_c)`` over axis 2 of the terms ``t [n, Kp, C*Kc, B]``
    (:func:`max_product_terms`, which XLA fuses into the reductions), shifted by each parent's largest term, so
    that term contributes exactly 1 to the sum at any exponent ``a``. Its gradient with respect to ``t`` is the
    tempered share ``exp(a t_c) / sum_c' exp(a t_c')``; ``-inf`` with zero (not NaN) gradients where every term
    is ``-inf``, NaN where a term is."""
    m = _finite_max(t, 2)
    s = jnp.sum(jnp.exp(a * (t - m)), axis=2)
    zero = s == 0
    return jnp.where(zero, -jnp.inf, jnp.log(jnp.where(zero, 1.0, s)) / a + m[:, :, 0])


def tempered_split(t: Array, fp: Array, a: float, dense: bool, child_flows: bool = True, param_flows: bool = True,
                   vp: Array | None = None) -> tuple[Array | None, Array | None]:
    """The parents' flows ``fp [n, Kp, B]`` split over their terms ``t [n, Kp, C*Kc, B]`` (:func:`max_product_terms`)
    by the tempered shares ``exp(a t_c) / sum_c' exp(a t_c')``, each computed shifted by the parent's largest term
    (exact at any exponent ``a``; :func:`factored`'s product for ``a <= 1`` is faster): ``(child flows [n, C*Kc, B]
    ([C*Kc, B] when ``dense``), parameter flows [n, Kp, C*Kc])``, the edge flows reduced over the parents and over
    the samples (None where not asked for). Given the parents' stored values ``vp [n, Kp, B]`` (the forward's
    exponent ``a``: ``a vp`` is the log local sum) the shares are ``exp(a (t_c - vp))``, one reduction fewer, with
    ``a |vp| * 6e-8`` more relative error (the precisions below ``"fp32"``, as :func:`flow_split`'s). Parents that
    carry no flow or are impossible pass nothing."""
    if vp is None:
        e = jnp.exp(a * (t - _finite_max(t, 2)))  # a possible parent's largest term gives 1: its local sum is >= 1
        s = jnp.sum(e, axis=2)
        scale = _flow_scale(fp, s)  # [n, Kp, B]
    else:
        live = jnp.isfinite(vp)
        e = jnp.exp(a * (t - jnp.where(live, vp, jnp.inf)[:, :, None, :]))  # 0 where the parent is impossible
        scale = jnp.where(live, fp, 0.0)
    edges = scale[:, :, None, :] * e  # [n, Kp, CK, B], fused into the reductions below
    cf = (jnp.sum(edges, axis=(0, 1)) if dense else jnp.sum(edges, axis=1)) if child_flows else None
    return cf, (jnp.sum(edges, axis=3) if param_flows else None)


def sum_layer_reference(buf: Array, ch: Array, pid: Array, logw: Array, *, Kp: int, Kc: int, dense: bool,
                        propagation: str = "LL", alpha: float | None = None, precision: str = "fp32",
                        with_shift: bool = False, with_first: bool = False):
    """Plain-jnp sum layer (GeneralLL's ``alpha`` above 1 from the terms: :func:`factored`, ``precision`` then does
    not apply). Returns ``[n * Kp, B]`` (block-major rows); with ``with_shift`` (LL and GeneralLL,
    not ``dense`` unless of one block) also each parent block's shift ``[n, B]``, the max over its children's
    values (finite, else 0), which :func:`sum_layer_backward_reference` then reads instead of recomputing it; with
    ``with_first`` (MPE) also each parent's first maximizing child, int32 ``[n * Kp, B]`` (:func:`max_and_first`),
    which the hard-EM flow pass then reads instead of searching for it."""
    x = gather_children(buf, ch, Kc, dense)
    lw = gather_weights(logw, pid)
    if with_shift and ((dense and ch.shape[0] != 1) or propagation == "MPE"):
        raise ValueError("with_shift: the shifts of blockwise (not dense, or one block) sum-product layers (LL, "
                         f"GeneralLL), got dense={dense} with {ch.shape[0]} blocks, propagation={propagation!r}")
    if with_first and propagation != "MPE":
        raise ValueError(f"with_first: the first maximizers of max-product layers, got propagation={propagation!r}")
    if with_first:
        out, first = max_and_first(max_product_terms(x, lw, dense))
        return out.reshape(-1, buf.shape[1]), first.reshape(-1, buf.shape[1])
    a = float(alpha) if propagation == "GeneralLL" else 1.0
    if propagation == "MPE":
        out = first_max(max_product_terms(x, lw, dense))
        m = None
    elif factored(a):
        out, m = _log_sum(lw, x, dense, a, precision)
    else:
        out = tempered_log_sum(max_product_terms(x, lw, dense), a)
        m = _finite_max(x, 0 if dense else 1) if with_shift else None
    out = out.reshape(-1, buf.shape[1])
    return (out, m.reshape(-1, buf.shape[1])) if with_shift else out


def sum_kernels(impl: str):
    """The kernel module of a sum partition routed to ``impl``: :mod:`jaxpc.ops.triton_sum` for ``"triton"``, else
    :mod:`jaxpc.ops.pallas_sum` (the same functions and arguments)."""
    if impl == "triton":
        from . import triton_sum

        return triton_sum
    from . import pallas_sum

    return pallas_sum


def sum_layer(buf: Array, ch: Array, pid: Array, logw: Array, *, Kp: int, Kc: int, dense: bool,
              propagation: str = "LL", alpha: float | None = None, precision: str = "fp32",
              impl: str = "xla", config=None) -> Array:
    """Dispatching sum layer: ``impl="pallas"`` or ``"pallas_forward"`` runs the Pallas kernel, ``"triton"`` the
    jax-triton one (LL, and GeneralLL with ``alpha`` at most 1: :func:`factored`; max-product layers and larger
    exponents always use the reference), ``"xla"`` the plain-jnp version."""
    a = float(alpha) if propagation == "GeneralLL" else 1.0
    if impl in KERNEL_IMPLS and propagation != "MPE" and factored(a):
        kernels = sum_kernels(impl)
        cfg = config or kernels.KernelConfig()
        return kernels.forward(buf, ch, pid, logw, Kp=Kp, Kc=Kc, alpha=a, precision=precision,
                               config=cfg).astype(buf.dtype)
    if impl not in IMPLS:
        raise ValueError(f"unknown sum-layer impl {impl!r}")
    return sum_layer_reference(buf, ch, pid, logw, Kp=Kp, Kc=Kc, dense=dense, propagation=propagation,
                               alpha=alpha, precision=precision)


def sum_layer_backward_reference(values: Array, flows: Array, ch: Array, pid: Array, logw: Array, out_offset, *,
                                 Kp: int, Kc: int, dense: bool, propagation: str = "LL",
                                 alpha: float | None = None, precision: str = "fp32",
                                 param_flows: bool = True, pflow_temperature: float = 1.0,
                                 eflow_temperature: float = 1.0, shift: Array | None = None,
                                 first: Array | None = None) -> tuple[Array, Array | None]:
    """Flows of one sum partition, top-down (PyJuice's element-flow and parameter-flow passes): each parent's
    flow split over its children by its terms ``(w x)^a`` normalized, ``a`` the propagation's exponent (1, or
    ``alpha``) over the flows' temperature, by factored products where :func:`factored`, else from the terms
    (:func:`tempered_split`).

    Args:
        values: ``[R, B]`` node values of the forward pass.
        flows: ``[R, B]`` node flows accumulated so far (the partition's parents are final).
        out_offset: first row of the partition's ``n * Kp`` parents.
        shift: ``[n, B]`` the forward's shifts (each parent block's max over its children's values), which
            the factored products then read instead of recomputing them (not ``dense``, unless of one block).
        first: int32 ``[n, Kp, B]`` (MPE) each parent's first maximizing child as the forward kept it
            (:func:`sum_layer_reference` with ``with_first``), then not searched for again.

    Returns:
        ``(child_flows, param_flows)``: ``[n, C*Kc, B]`` (``[C*Kc, B]`` when ``dense``) flows to add to the
        children's rows, and ``[n, C, Kp, Kc]`` flows to add to the parameter blocks ``pid``.
    """
    if shift is not None and ((dense and ch.shape[0] != 1) or shift.shape != (ch.shape[0], values.shape[1])):
        raise ValueError(f"shift must be [n, B] = {[ch.shape[0], values.shape[1]]} for a partition that is not dense "
                         f"or of one block, got {list(shift.shape)} (dense={dense}, {ch.shape[0]} blocks)")
    n, C = ch.shape[:2]
    B = values.shape[1]
    if first is not None and (propagation != "MPE" or first.shape != (n, Kp, B)):
        raise ValueError(f"first must be [n, Kp, B] = {[n, Kp, B]} for a max-product partition, got "
                         f"{list(first.shape)} with propagation={propagation!r}")
    x = gather_children(values, ch, Kc, dense)
    lw = gather_weights(logw, pid)  # [n, Kp, CK]
    vp = jax.lax.dynamic_slice_in_dim(values, out_offset, n * Kp, axis=0).reshape(n, Kp, B)
    fp = jax.lax.dynamic_slice_in_dim(flows, out_offset, n * Kp, axis=0).reshape(n, Kp, B)
    if propagation == "MPE":
        cf, pf = mpe_split(x, lw, vp, fp, dense, param_flows, first)
    else:
        base = 1.0 if propagation == "LL" else float(alpha)
        ae = base / eflow_temperature
        ap = base / pflow_temperature if param_flows else None
        sharp_e, sharp_p = not factored(ae), ap is not None and not factored(ap)
        cf = pf = None
        if not sharp_e or (ap is not None and not sharp_p):
            cf, pf = _factored_flows(x, lw, vp, fp, shift, None if sharp_e else ae, None if sharp_p else ap, base,
                                     dense, precision)
        if sharp_e or sharp_p:  # exponents above 1: from the terms
            t = max_product_terms(x, lw, dense)
            shared = sharp_e and sharp_p and ap == ae
            if sharp_e:
                cf, pe = tempered_split(t, fp, ae, dense, param_flows=shared, vp=_stored(vp, ae, base, precision))
            if sharp_p:
                pf = pe if shared else tempered_split(t, fp, ap, dense, child_flows=False,
                                                      vp=_stored(vp, ap, base, precision))[1]
    if pf is None:
        return cf, None
    pf = pf.reshape(n, Kp, C, Kc).transpose(0, 2, 1, 3)
    return cf, pf


def _stored(vp: Array, a: float, base: float, precision: str) -> Array | None:
    """``vp``, the parents' stored values, where :func:`tempered_split` takes the local sums from them (as
    :func:`flow_split` does): untempered flows (``a`` the forward's exponent ``base``) at a precision below
    ``"fp32"``; else None (recomputed)."""
    return vp if precision != "fp32" and a == base else None


def _factored_flows(x: Array, lw: Array, vp: Array, fp: Array, shift: Array | None, ae: float | None,
                    ap: float | None, base: float, dense: bool, precision: str) -> tuple[Array | None, Array | None]:
    """``(child flows, parameter flows)`` of :func:`sum_layer_backward_reference` by :func:`flow_split`'s factored
    products, the child flows at exponent ``ae`` and the parameter flows at ``ap`` (each :func:`factored`, or None:
    not computed); ``shift``: the forward's kept shifts, or None."""
    m = jnp.max(x, axis=0 if dense else 1, keepdims=True) if shift is None else (shift if dense else shift[:, None, :])
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    cf = pf = None
    if ae is not None:
        w, y, scale = flow_split(x, lw, vp, fp, m, ae, base, dense, precision)
        cf = y * matmul("nkc,nkb->cb" if dense else "nkc,nkb->ncb", w, scale, precision)
    if ap is not None:
        if ap != ae:
            w, y, scale = flow_split(x, lw, vp, fp, m, ap, base, dense, precision)
        pf = w * matmul("nkb,cb->nkc" if dense else "nkb,ncb->nkc", scale, y, precision)
    return cf, pf


def max_product_terms(x: Array, lw: Array, dense: bool) -> Array:
    """``[n, Kp, C*Kc, B]``: each parent's terms ``log w + x`` from its gathered log-weights ``lw [n, Kp, C*Kc]``
    and its children's values ``x`` (``[n, C*Kc, B]``, ``[C*Kc, B]`` when ``dense``)."""
    return lw[:, :, :, None] + (x[None, None] if dense else x[:, None])


@jax.custom_jvp
def first_max(t: Array) -> Array:
    """``max`` over axis 2 of ``t [n, Kp, C*Kc, B]`` (a max-product layer's terms), differentiated as a choice:
    the derivative flows to the first maximizing term only (the lowest child block, then the lowest node), the
    child that :mod:`jaxpc.engine.select` decodes and :func:`mpe_split` passes the flow to, where ``jax.grad``
    of ``max`` would split it over tied terms."""
    return jnp.max(t, axis=2)


@first_max.defjvp
def _first_max_jvp(primals, tangents):
    (t,), (dt,) = primals, tangents
    first = jnp.argmax(t, axis=2)[:, :, None]
    return jnp.take_along_axis(t, first, axis=2)[:, :, 0], jnp.take_along_axis(dt, first, axis=2)[:, :, 0]


def _first_of_two(a, b):
    """The reducer of :func:`max_and_first`: of two ``(value, index)`` pairs the larger value (``lax.max``: NaN
    wins, as in ``jnp.max``) and the index of the larger of two numbers, the lower of two equal ones (a total order
    on numbers, so the reduction is associative wherever no NaN makes its index moot)."""
    (va, ia), (vb, ib) = a, b
    b_wins = (vb > va) | ((vb == va) & (ib < ia))
    return lax.max(va, vb), lax.select(b_wins, ib, ia)


@jax.custom_jvp
def max_and_first(t: Array) -> tuple[Array, Array]:
    """``(max, first)`` over axis 2 of ``t [n, Kp, C*Kc, B]`` (a max-product layer's terms) in one reduction:
    the max-product values, bit for bit :func:`first_max`'s, and each parent's first maximizing child, as
    :func:`first_maximizer` finds it from the values (``C*Kc`` where the value is not finite). On an H100 it
    takes 1.0-1.7 times a plain max, the max and :func:`first_maximizer` after it 1.35-2.0 times. Differentiated
    as :func:`first_max` (JAX has no derivative of a reduction over pairs)."""
    CK = t.shape[2]
    out, first = lax.reduce((t, lax.broadcasted_iota(jnp.int32, t.shape, 2)),
                            (jnp.array(-jnp.inf, t.dtype), jnp.int32(CK)), _first_of_two, (2,))
    return out, jnp.where(jnp.isfinite(out), first, CK)


@max_and_first.defjvp
def _max_and_first_jvp(primals, tangents):
    """The value's tangent is the first maximizing term's (the first term's where the value is not finite, as
    :func:`first_max`'s); the indices have none."""
    (t,), (dt,) = primals, tangents
    out, first = max_and_first(t)
    pick = jnp.where(first == t.shape[2], 0, first)[:, :, None]
    return (out, first), (jnp.take_along_axis(dt, pick, axis=2)[:, :, 0], np.zeros(first.shape, jax.dtypes.float0))


def first_maximizer(t: Array, vp: Array) -> Array:
    """``int32 [n, Kp, B]``: each parent's first child (in ``C*Kc`` order) whose term (``t``,
    :func:`max_product_terms`) equals its max-product value ``vp [n, Kp, B]``; ``C*Kc`` where there is none (``vp``
    not finite: an impossible parent). One min-reduction over the terms, which XLA fuses into it."""
    CK = t.shape[2]
    hit = (t == vp[:, :, None, :]) & jnp.isfinite(vp)[:, :, None, :]
    return jnp.min(jnp.where(hit, lax.broadcasted_iota(jnp.int32, t.shape, 2), CK), axis=2)


def mpe_split(x: Array, lw: Array, vp: Array, fp: Array, dense: bool,
              param_flows: bool = True, first: Array | None = None) -> tuple[Array, Array | None]:
    """The max-product flows ``fp [n, Kp, B]`` of ``n`` parent blocks passed to each parent's first maximizing
    child (:func:`first_maximizer`; as the MPE decoding chooses, so hard EM counts the decoded paths): ``(child
    flows [n, C*Kc, B] ([C*Kc, B] when ``dense``), parameter flows [n, Kp, C*Kc] or None)``, by ``n * Kp * B``
    scattered additions each (impossible parents pass nothing). ``x``: the children's values, ``lw`` the gathered
    log-weights ``[n, Kp, C*Kc]``, ``vp`` the parents' values; ``first`` (int32 ``[n, Kp, B]``): the first
    maximizers the forward kept (:func:`max_and_first`), which are then not searched for again."""
    if first is None:
        first = first_maximizer(max_product_terms(x, lw, dense), vp)
    # the scatters read the parents' flows as an array of their own: with the flow buffer's slice fused into
    # them, XLA copies the whole buffer before the buffer's next in-place update
    fp = lax.optimization_barrier(fp)
    n, Kp, B = fp.shape
    CK = lw.shape[2]
    ni = jnp.arange(n, dtype=jnp.int32)[:, None, None]
    bi = jnp.arange(B, dtype=jnp.int32)[None, None, :]
    cf = (jnp.zeros((CK, B), fp.dtype).at[first, bi].add(fp, mode="drop") if dense
          else jnp.zeros((n, CK, B), fp.dtype).at[ni, first, bi].add(fp, mode="drop"))
    if not param_flows:
        return cf, None
    ki = jnp.arange(Kp, dtype=jnp.int32)[None, :, None]
    return cf, jnp.zeros((n, Kp, CK), fp.dtype).at[ni, ki, first].add(fp, mode="drop")


def flow_split(x: Array, lw: Array, vp: Array, fp: Array, m: Array, a: float, base: float, dense: bool,
               precision: str) -> tuple[Array, Array, Array]:
    """``(w, y, scale)``: the parents' flows ``fp`` split over their children by ``(w x)^a`` normalized (``a`` =
    ``base``: the posterior), as ``w^a`` ``[n, Kp, C*Kc]``, ``y = exp(a (x - m))`` and the per-parent factor
    ``fp / local sum`` ``[n, Kp, B]``; ``vp`` the parents' values, ``m`` the shifts."""
    y = jnp.exp(a * (x - m))  # [n, CK, B] or [CK, B]
    w = jnp.exp(a * lw)
    if precision == "fp32" or a != base:
        # the forward's local sum, recomputed: exp(vp - m) would lose |vp| * eps of precision per layer
        # (0.7% over a 10,000-step HMM in float32), the recomputed sum loses nothing
        s = matmul("nkc,cb->nkb" if dense else "nkc,ncb->nkb", w, y, precision)
    else:
        # at tf32 / bf16 the product's own rounding (2^-11 / 2^-8 per operand) is the larger error: the
        # local sum comes from the parent's stored value (one matrix product fewer, as in PyJuice)
        s = jnp.exp(a * (vp - m))
    return w, y, _flow_scale(fp, s)


def _flow_scale(fp: Array, s: Array) -> Array:
    """``fp / s``, each parent's flow over its local sum ``[n, Kp, B]``: 0 where the parent is impossible (``s == 0``,
    never ``0 / 0``) and where a parent that carries no flow has a NaN sum. The masks are on the sums: the flows
    are linear in ``fp`` (their derivative in a flow of 0, as in a sample's weight of 0, is ``1 / s``)."""
    zero = s == 0
    return jnp.where(zero | (jnp.isnan(s) & (fp == 0)), 0.0, fp / jnp.where(zero, 1.0, s))


def param_flow_factors(values: Array, flows: Array, ch: Array, pid: Array, logw: Array, prow: Array, *, Kp: int,
                       Kc: int, propagation: str = "LL", alpha: float | None = None, precision: str = "fp32",
                       temperature: float = 1.0, shift: Array | None = None) -> tuple[Array, Array, Array]:
    """The factors of :func:`sum_layer_param_flows_reference`'s flows: ``(w, y, scale)``, the blocks' weights
    ``[n, Kp, C*Kc]`` (raised to the flows' power), their children's shifted values ``[n, C*Kc, B]`` and each
    parent's flow over its local sum ``[n, Kp, B]``; the flows are ``w * (scale @ y^T)`` over the samples. Only
    for a :func:`factored` exponent (the propagation's over ``temperature``): above 1 the factors underflow."""
    if propagation == "MPE":
        raise ValueError("the batched parameter flows are those of sum-product layers (LL, GeneralLL), not MPE")
    base = 1.0 if propagation == "LL" else float(alpha)
    if not factored(base / temperature):
        raise ValueError(f"parameter-flow factors at exponent {base / temperature:g} (above 1) underflow in float32: "
                         f"sum_layer_param_flows_reference computes such flows from the terms")
    n = ch.shape[0]
    x = gather_children(values, ch, Kc, False)
    lw = gather_weights(logw, pid)
    rows = prow[:, None] + jnp.arange(Kp, dtype=prow.dtype)
    if shift is not None and shift.shape != (n, values.shape[1]):
        raise ValueError(f"shift must be [n, B] = {[n, values.shape[1]]}, got {list(shift.shape)}")
    m = jnp.max(x, axis=1, keepdims=True) if shift is None else shift[:, None, :]
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    return flow_split(x, lw, take_rows(values, rows), take_rows(flows, rows), m, base / temperature, base, False,
                      precision)


def sum_layer_param_flows_reference(values: Array, flows: Array, ch: Array, pid: Array, logw: Array, prow: Array, *,
                                    Kp: int, Kc: int, propagation: str = "LL", alpha: float | None = None,
                                    precision: str = "fp32", temperature: float = 1.0,
                                    shift: Array | None = None) -> Array:
    """Parameter flows of ``n`` sum blocks (not dense) after the flow pass: those of
    :func:`sum_layer_backward_reference`, from the final node values and flows. The blocks may come from
    different partitions and levels (one batched product for all of them): block ``i``'s parents are rows
    ``prow[i] + [0, Kp)``, its children ``ch[i]`` (``[n, C]`` or folded ``[n, C, M]``), its weights ``pid[i]``.
    ``temperature``: ``Options.pflow_temperature``; ``shift``: ``[n, B]`` the forward's shifts, which are then
    not recomputed (an exponent above 1, not :func:`factored`, is computed from the terms by
    :func:`tempered_split` and reads no shift). Returns ``[n, C, Kp, Kc]``."""
    n, C = ch.shape[:2]
    base = float(alpha) if propagation == "GeneralLL" else 1.0
    if propagation != "MPE" and not factored(base / temperature):
        t = max_product_terms(gather_children(values, ch, Kc, False), gather_weights(logw, pid), False)
        rows = prow[:, None] + jnp.arange(Kp, dtype=prow.dtype)
        vp = _stored(take_rows(values, rows), base / temperature, base, precision)
        _, pf = tempered_split(t, take_rows(flows, rows), base / temperature, False, child_flows=False, vp=vp)
        return pf.reshape(n, Kp, C, Kc).transpose(0, 2, 1, 3)
    w, y, scale = param_flow_factors(values, flows, ch, pid, logw, prow, Kp=Kp, Kc=Kc, propagation=propagation,
                                     alpha=alpha, precision=precision, temperature=temperature, shift=shift)
    pf = w * matmul("nkb,ncb->nkc", scale, y, precision)
    return pf.reshape(n, Kp, C, Kc).transpose(0, 2, 1, 3)
