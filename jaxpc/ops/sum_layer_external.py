"""Sum layers whose weights are modified per sample (external parameterizations, as in CoDD):

* **BlockScale**: log-gates ``g[b]`` per sample on the parent rows of each edge block (one gate per edge block,
  or one per group of parent nodes inside it): ``w'(b)[i, j] = w[i, j] * exp(g[b, i, e(j)]) / Z_i(b)``,
  renormalized per node.
* **LowRank**: a non-negative rank-``r`` correction per sample and parameter block,
  ``w'(b) = (w + U[b, e] @ V[b, e]) / Z(b)`` with ``U [Kp, r]``, ``V [r, Kc]``, renormalized per node
  (combined with BlockScale gates when both are given: ``(w + U V) * exp(g)``).

Both are computed from per-block partial sums ``W_e @ y_e`` and ``V_e @ y_e``: no per-sample dense
weight matrix ``[B, Kp, Kc]`` is ever formed. Every product runs at the given ``precision`` (as
:func:`jaxpc.ops.sum_layer.matmul`). Padded slots of a partition (those reading ``pad_row``) take no part in the
normalizer. Gradients with respect to the per-sample tensors come from JAX's autodiff. With ``counts=True``
(used for EM flows) the normalizer's dependence on the shared weights is cut, so the gradient with respect to the
shared log-weights is each edge's posterior count times the shared weight's share of its effective weight,
``w / (w + U V)`` (1 without LowRank).
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


def _gate_shift(gates: Array, ch: Array, pad_row: int | None) -> Array:
    """``[n, 1, Kp, B]``: each parent row's largest log-gate over its real slots (0 where it has none finite). A
    parent row's gates scale both its sum and its normalizer, so subtracting it changes nothing but keeps
    ``exp(gates)`` within range (log-gates far above 0 would overflow, far below underflow to a zero row)."""
    live = gates if pad_row is None else jnp.where((ch != pad_row)[:, :, None, None], gates, -jnp.inf)
    m = lax.stop_gradient(jnp.max(live, axis=1, keepdims=True))
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _lowrank_terms(lowrank: dict, pid: Array, y: Array, eg: Array | None, keep: Array, precision: str):
    """The LowRank corrections' parts of the sums and normalizers, ``[n, Kp, B]`` each: ``sum_c g U (V y)`` and
    ``sum_c g U (V 1)`` over the real slots (``keep [n, C]``), ``g = exp(gates)`` (``eg [n, C, Kp, B]``) or 1."""
    U = lowrank["u"][:, pid]  # [B, n, C, Kp, r]
    Vv = lowrank["v"][:, pid]  # [B, n, C, r, Kc]
    t = matmul("bncrk,nckb->bncr", Vv, y, precision)
    tz = jnp.sum(Vv, axis=4) * keep[None, :, :, None]  # [B, n, C, r]
    if eg is None:
        return matmul("bncpr,bncr->npb", U, t, precision), matmul("bncpr,bncr->npb", U, tz, precision)
    q = matmul("bncpr,bncr->bncp", U, t, precision)
    qz = matmul("bncpr,bncr->bncp", U, tz, precision)
    return matmul("bncp,ncpb->npb", q, eg, precision), matmul("bncp,ncpb->npb", qz, eg, precision)


def sum_layer_external_reference(buf: Array, ch: Array, pid: Array, logw: Array, *, Kp: int, Kc: int, dense: bool,
                                 gates: Array | None = None, lowrank: dict | None = None, counts: bool = False,
                                 precision: str = "fp32", pad_row: int | None = None) -> Array:
    """``[n * Kp, B]`` values of a sum partition (``ch``, ``pid`` ``[n, C]``) under per-sample weights.

    ``gates``: ``[n, C, Kp, B]`` log-gates of each slot's parent rows; ``lowrank``: ``{"u": [B, P, Kp, r],
    "v": [B, P, r, Kc]}`` (non-negative) by parameter block; ``pad_row``: the row that padded slots read."""
    n, C = ch.shape
    y, m = _child_terms(buf, ch, Kc, dense)
    lw = logw[pid]  # [n, C, Kp, Kc]
    w = jnp.exp(lw)
    keep = jnp.ones((n, C), w.dtype) if pad_row is None else (ch != pad_row).astype(w.dtype)
    w_z = (jnp.exp(lax.stop_gradient(lw)) if counts else w) * keep[:, :, None, None]
    part = matmul("ncpk,nckb->npcb", w, y, precision)  # per-block sums [n, Kp, C, B]
    rows = jnp.sum(w_z, axis=3)  # [n, C, Kp]
    eg = None if gates is None else jnp.exp(gates - _gate_shift(gates, ch, pad_row))
    if eg is None:
        s = jnp.sum(part, axis=2)
        Z = jnp.sum(rows, axis=1)[:, :, None]
    else:
        s = matmul("npcb,ncpb->npb", part, eg, precision)
        Z = matmul("ncp,ncpb->npb", rows, eg, precision)
    if lowrank is not None:
        ds, dz = _lowrank_terms(lowrank, pid, y, eg, keep, precision)
        s, Z = s + ds, Z + dz
    zero = s == 0
    out = jnp.where(zero, -jnp.inf, jnp.log(jnp.where(zero, 1.0, s)) + m - jnp.log(Z))
    return out.reshape(n * Kp, -1)


def dense_weights_reference(logw_blocks: Array, gates: Array | None, lowrank: dict | None) -> Array:
    """The per-sample effective weights ``[B, E, Kp, Kc]`` of the edge blocks (for tests), unnormalized."""
    w = jnp.exp(logw_blocks)[None]
    if lowrank is not None:
        w = w + jnp.einsum("bepr,berk->bepk", lowrank["u"], lowrank["v"], precision=lax.Precision.HIGHEST)
    if gates is not None:
        w = w * jnp.exp(gates)[:, :, None, None]
    return w
