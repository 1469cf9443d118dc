"""Sum layers whose weights are modified per sample (external parameterizations, as in CoDD):

* **BlockScale**: a log-gate ``g[b, e]`` per sample and parameter block ``e``:
  ``w'(b) = w * exp(g[b, e]) / Z(b)``, renormalized per node.
* **LowRank**: a non-negative rank-``r`` correction per sample and parameter block,
  ``w'(b) = (w + U[b, e] @ V[b, e]) / Z(b)`` with ``U [Kp, r]``, ``V [r, Kc]``, renormalized per node
  (combined with BlockScale gates when both are given: ``(w + U V) * exp(g)``).

Both are computed from per-block partial sums ``W_e @ y_e`` and ``V_e @ y_e``: no per-sample dense
weight matrix ``[B, Kp, Kc]`` is ever formed. Gradients with respect to the per-sample tensors come
from JAX's autodiff. With ``counts=True`` (used for EM flows) the normalizer's dependence on the
shared weights is cut, so the gradient with respect to the shared log-weights is the posterior edge
count under the per-sample weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .sum_layer import gather_children, matmul

Array = jax.Array


def sum_layer_external_reference(buf: Array, ch: Array, pid: Array, logw: Array, *, Kp: int, Kc: int, dense: bool,
                                 gates: Array | None = None, lowrank: dict | None = None, counts: bool = False,
                                 precision: str = "fp32") -> Array:
    """``[n * Kp, B]`` values. ``gates``: ``[B, P]`` log-gates; ``lowrank``: ``{"u": [B, P, Kp, r],
    "v": [B, P, r, Kc]}`` (non-negative)."""
    n, C = ch.shape
    B = buf.shape[1]
    x = gather_children(buf, ch, Kc, dense)
    if dense:
        x = jnp.broadcast_to(x[None], (n,) + x.shape)
    m = lax.stop_gradient(jnp.max(x, axis=1, keepdims=True))  # [n, 1, B]
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    y = jnp.exp(x - m).reshape(n, C, Kc, B)
    lw = logw[pid]  # [n, C, Kp, Kc]
    w = jnp.exp(lw)
    w_z = jnp.exp(lax.stop_gradient(lw)) if counts else w
    part = matmul("ncpk,nckb->npcb", w, y, precision)  # per-block sums [n, Kp, C, B]
    rows = jnp.sum(w_z, axis=3)  # [n, C, Kp]
    if gates is not None:
        eg = jnp.exp(jnp.transpose(gates[:, pid], (1, 2, 0)))  # [n, C, B]
        s = jnp.einsum("npcb,ncb->npb", part, eg)
        Z = jnp.einsum("ncp,ncb->npb", rows, eg)
    else:
        eg = None
        s = jnp.sum(part, axis=2)
        Z = jnp.sum(rows, axis=1)[:, :, None]
    if lowrank is not None:
        U = lowrank["u"][:, pid]  # [B, n, C, Kp, r]
        Vv = lowrank["v"][:, pid]  # [B, n, C, r, Kc]
        t = jnp.einsum("bncrk,nckb->bncr", Vv, y)
        tz = jnp.sum(Vv, axis=4)  # [B, n, C, r]
        if eg is not None:
            g_b = jnp.transpose(eg, (2, 0, 1))[..., None]  # [B, n, C, 1]
            t, tz = t * g_b, tz * g_b
        s = s + jnp.einsum("bncpr,bncr->npb", U, t)
        Z = Z + jnp.einsum("bncpr,bncr->npb", U, tz)
    zero = s == 0
    out = jnp.where(zero, -jnp.inf, jnp.log(jnp.where(zero, 1.0, s)) + m - jnp.log(Z))
    return out.reshape(n * Kp, B)


def dense_weights_reference(logw_blocks: Array, gates: Array | None, lowrank: dict | None) -> Array:
    """The per-sample effective weights ``[B, E, Kp, Kc]`` of the edge blocks (for tests), unnormalized."""
    w = jnp.exp(logw_blocks)[None]
    if lowrank is not None:
        w = w + jnp.einsum("bepr,berk->bepk", lowrank["u"], lowrank["v"])
    if gates is not None:
        w = w * jnp.exp(gates)[:, :, None, None]
    return w
