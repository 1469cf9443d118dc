"""Sum layers whose weights are modified per sample (external parameterizations, as in CoDD):

* **BlockScale**: log-gates ``g[b]`` per sample on the parent rows of each edge block (one gate per edge block,
  or one per group of parent nodes inside it): ``w'(b)[i, j] = w[i, j] * exp(g[b, i, e(j)]) / Z_i(b)``,
  renormalized per node.
* **LowRank**: a non-negative rank-``r`` correction per sample and parameter block,
  ``w'(b) = (w + U[b, e] @ V[b, e]) / Z(b)`` with ``U [Kp, r]``, ``V [r, Kc]``, renormalized per node
  (combined with BlockScale gates when both are given: ``(w + U V) * exp(g)``).

Both are computed from per-block partial sums ``W_e @ y_e`` and ``V_e @ y_e``: no per-sample dense weight matrix
``[B, Kp, Kc]`` is ever formed. Each parent row's sum and normalizer are divided by a common scale (its largest
slot's gate and LowRank magnitude), so that any finite gates and factors give the exact normalized weights, also
where ``U V`` or ``exp(g)`` lie beyond the float range. A node whose effective weights are all zero (every gate
-inf) has the value -inf and passes no gradient, as a node of zero shared weights. Every product runs at the given
``precision`` (as :func:`jaxpc.ops.sum_layer.matmul`). Padded slots of a partition (those reading ``pad_row``) take
no part in the normalizer. Gradients with respect to the per-sample tensors come from JAX's autodiff. With
``counts=True`` (used for EM flows) the normalizer's dependence on the shared weights is cut, so the gradient with
respect to the shared log-weights is each edge's posterior count times the shared weight's share of its effective
weight, ``w / (w + U V)`` (1 without LowRank).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .sum_layer import gather_children, matmul

Array = jax.Array


def _child_terms(buf: Array, ch: Array, Kc: int, dense: bool) -> tuple[Array, Array]:
    """``(y [n, C, Kc, B], m [n, 1, B])``: the children's values ``exp(x - m)`` under a per-block max shift."""
    n, C = ch.shape
    x = gather_children(buf, ch, Kc, dense)
    if dense:
        x = jnp.broadcast_to(x[None], (n,) + x.shape)
    m = lax.stop_gradient(jnp.max(x, axis=1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    return jnp.exp(x - m).reshape(n, C, Kc, x.shape[-1]), m


def _lowrank_scales(U: Array, Vv: Array) -> tuple[Array, Array]:
    """``(lam [B, n, C, Kp], lv [B, n, C, r])``, no gradient: ``lam`` the log of each parent row's largest LowRank
    term ``max_r U[i, r] max_k V[r, k]`` (-inf where the row has none), ``lv`` the log of each ``V`` row's largest
    entry (0 where that row is zero, so that ``V / exp(lv)`` keeps its gradient)."""
    U, Vv = lax.stop_gradient(U), lax.stop_gradient(Vv)
    sv = jnp.max(Vv, axis=4)
    lam = jnp.max(jnp.log(U) + jnp.log(sv)[:, :, :, None, :], axis=4)
    return lam, jnp.where(sv > 0, jnp.log(jnp.where(sv > 0, sv, 1.0)), 0.0)


def _row_scales(rows: Array, keep: Array, gates: Array | None, lam: Array | None) -> tuple[Array, Array]:
    """``(kappa [n, C, Kp, B or 1], shift [n, 1, Kp, B or 1])``, no gradient. ``kappa``: the log-scale of each
    slot's part of a parent row, ``max(0, lam)`` (``lam``: :func:`_lowrank_scales`, transposed) where the slot has
    weight (shared or LowRank), -inf where it has none. ``shift``: each parent row's largest ``gate + kappa`` over its
    real slots (``keep [n, C]``), 0 where none is finite. A parent row's scale multiplies both its sum and its
    normalizer, so dividing by ``exp(shift)`` changes nothing but keeps every slot's part within range: log-gates
    far above 0 and LowRank products beyond the float range would overflow, and far below underflow to a zero row,
    while a slot without weight takes no part in the shift."""
    has = (rows > 0)[..., None]
    kappa = jnp.zeros(has.shape, rows.dtype) if lam is None else jnp.maximum(lam, 0.0)
    if lam is not None:
        has = has | (lam > -jnp.inf)
    kappa = jnp.where(has, kappa, -jnp.inf)
    level = kappa if gates is None else lax.stop_gradient(gates) + kappa
    level = jnp.where(keep[:, :, None, None] > 0, level, -jnp.inf)
    shift = jnp.max(level, axis=1, keepdims=True)
    return kappa, jnp.where(jnp.isfinite(shift), shift, 0.0)


def _lowrank_terms(U: Array, Vv: Array, y: Array, eg: Array, keep: Array, precision: str) -> tuple[Array, Array]:
    """The LowRank corrections' parts of the sums and normalizers, ``[n, Kp, B]`` each: ``sum_c eg U (V y)`` and
    ``sum_c eg U (V 1)`` over the real slots (``keep [n, C]``; ``U [B, n, C, Kp, r]``, ``V [B, n, C, r, Kc]``,
    ``eg [n, C, Kp, B]``)."""
    t = matmul("bncrk,nckb->bncr", Vv, y, precision)
    tz = jnp.sum(Vv, axis=4) * keep[None, :, :, None]  # [B, n, C, r]
    q = matmul("bncpr,bncr->bncp", U, t, precision)
    qz = matmul("bncpr,bncr->bncp", U, tz, precision)
    return matmul("bncp,ncpb->npb", q, eg, precision), matmul("bncp,ncpb->npb", qz, eg, precision)


def sum_layer_external_reference(buf: Array, ch: Array, pid: Array, logw: Array, *, Kp: int, Kc: int, dense: bool,
                                 gates: Array | None = None, lowrank: dict | None = None, counts: bool = False,
                                 precision: str = "fp32", pad_row: int | None = None) -> Array:
    """``[n * Kp, B]`` values of a sum partition (``ch``, ``pid`` ``[n, C]``) under per-sample weights.

    ``gates``: ``[n, C, Kp, B]`` log-gates of each slot's parent rows; ``lowrank``: ``{"u": [B, P, Kp, r],
    "v": [B, P, r, Kc]}`` (non-negative) by parameter block; ``pad_row``: the row that padded slots read.
    A node whose effective weights are all zero (every gate -inf, or no shared and no LowRank weight) has the value
    -inf, as a node of zero weights, and passes no gradient."""
    n, C = ch.shape
    y, m = _child_terms(buf, ch, Kc, dense)
    lw = logw[pid]  # [n, C, Kp, Kc]
    w = jnp.exp(lw)
    keep = jnp.ones((n, C), w.dtype) if pad_row is None else (ch != pad_row).astype(w.dtype)
    w_z = (jnp.exp(lax.stop_gradient(lw)) if counts else w) * keep[:, :, None, None]
    part = matmul("ncpk,nckb->npcb", w, y, precision)  # per-block sums [n, Kp, C, B]
    rows = jnp.sum(w_z, axis=3)  # [n, C, Kp]
    if gates is None and lowrank is None:
        s = jnp.sum(part, axis=2)
        Z = jnp.sum(rows, axis=1)[:, :, None]
    else:
        U = Vv = lam = None
        if lowrank is not None:
            U, Vv = lowrank["u"][:, pid], lowrank["v"][:, pid]  # [B, n, C, Kp, r], [B, n, C, r, Kc]
            lam, lv = _lowrank_scales(U, Vv)
            lam = jnp.transpose(lam, (1, 2, 3, 0))
        kappa, shift = _row_scales(lax.stop_gradient(rows), keep, gates, lam)
        live = (keep[:, :, None, None] > 0) & jnp.isfinite(kappa)  # real slots with weight; the others are zeros
        g = 0.0 if gates is None else gates
        eg = jnp.exp(jnp.where(live, g - shift, -jnp.inf))  # [n, C, Kp, B]: the shared weights' scale
        s = matmul("npcb,ncpb->npb", part, eg, precision)
        Z = matmul("ncp,ncpb->npb", rows, eg, precision)
        if lowrank is not None:  # U V = (U exp(lv - kappa)) (V exp(-lv)) exp(kappa): both factors at most 1
            ks = jnp.where(jnp.isfinite(kappa), kappa, 0.0)
            Uh = U * jnp.exp(lv[:, :, :, None, :] - jnp.transpose(ks, (3, 0, 1, 2))[..., None])
            Vh = Vv * jnp.exp(-lv)[..., None]
            egl = jnp.exp(jnp.where(live, g + ks - shift, -jnp.inf))
            ds, dz = _lowrank_terms(Uh, Vh, y, egl, keep, precision)
            s, Z = s + ds, Z + dz
    dead = (s == 0) | (Z == 0)
    out = jnp.where(dead, -jnp.inf, jnp.log(jnp.where(dead, 1.0, s)) + m - jnp.log(jnp.where(dead, 1.0, Z)))
    return out.reshape(n * Kp, -1)


def dense_weights_reference(logw_blocks: Array, gates: Array | None, lowrank: dict | None) -> Array:
    """The per-sample effective weights ``[B, E, Kp, Kc]`` of the edge blocks (for tests), unnormalized."""
    w = jnp.exp(logw_blocks)[None]
    if lowrank is not None:
        w = w + jnp.einsum("bepr,berk->bepk", lowrank["u"], lowrank["v"], precision=lax.Precision.HIGHEST)
    if gates is not None:
        w = w * jnp.exp(gates)[:, :, None, None]
    return w
