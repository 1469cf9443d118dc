"""Block-sparse sum layer.

For ``n`` parent blocks of ``Kp`` nodes, each with ``C`` child blocks of ``Kc`` nodes (rows
``ch[i, c] + [0, Kc)`` of the node buffer) and weight blocks ``logw[pid[i, c]]`` (``[Kp, Kc]``):

* LL: ``out[i, k, b] = m + log sum_{c, j} w[i, k, c, j] exp(x[i, c, j, b] - m)``, ``m`` the max over
  the block's children (a batched matmul in linear space, as in PyJuice).
* GeneralLL(alpha): ``out = m + (1/alpha) log sum w^alpha exp(alpha (x - m))``.
* MPE: ``out = max_{c, j} (log w + x)``.

``m`` is a stop-gradient shift, so ``d out / d x`` and ``d out / d log w`` are exactly the
normalized edge posteriors: ``jax.grad`` of the root log-likelihood yields flows. Zero sums
give ``-inf`` with zero (not NaN) gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array


def gather_children(buf: Array, ch: Array, Kc: int, dense: bool) -> Array:
    """``[n, C*Kc, B]`` child values (``[C*Kc, B]`` when ``dense``)."""
    ar = jnp.arange(Kc, dtype=ch.dtype)
    if dense:
        return buf[(ch[0][:, None] + ar).reshape(-1)]
    n, C = ch.shape
    return buf[(ch[:, :, None] + ar).reshape(n, C * Kc)]


def gather_weights(logw: Array, pid: Array) -> Array:
    """``[n, Kp, C*Kc]`` log-weights of each parent block."""
    w = logw[pid]  # [n, C, Kp, Kc]
    n, C, Kp, Kc = w.shape
    return w.transpose(0, 2, 1, 3).reshape(n, Kp, C * Kc)


def _log_sum(lw: Array, x: Array, dense: bool, alpha: float) -> Array:
    axis = 0 if dense else 1
    m = lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    y = jnp.exp(alpha * (x - m)) if alpha != 1.0 else jnp.exp(x - m)
    w = jnp.exp(alpha * lw) if alpha != 1.0 else jnp.exp(lw)
    if dense:
        s = jnp.einsum("nkc,cb->nkb", w, y)
    else:
        s = jnp.einsum("nkc,ncb->nkb", w, y)
    zero = s == 0  # (NaN stays NaN: bad input is never turned into a plausible value)
    logs = jnp.log(jnp.where(zero, 1.0, s))
    if alpha != 1.0:
        logs = logs / alpha
    return jnp.where(zero, -jnp.inf, logs + m)


def sum_layer_reference(buf: Array, ch: Array, pid: Array, logw: Array, *, Kp: int, Kc: int, dense: bool,
                        propagation: str = "LL", alpha: float | None = None) -> Array:
    """Plain-jnp sum layer. Returns ``[n * Kp, B]`` (block-major rows)."""
    x = gather_children(buf, ch, Kc, dense)
    lw = gather_weights(logw, pid)
    if propagation == "MPE":
        if dense:
            out = jnp.max(lw[:, :, :, None] + x[None, None, :, :], axis=2)
        else:
            out = jnp.max(lw[:, :, :, None] + x[:, None, :, :], axis=2)
    else:
        out = _log_sum(lw, x, dense, 1.0 if propagation == "LL" else float(alpha))
    return out.reshape(-1, buf.shape[1])


def sum_layer(buf: Array, ch: Array, pid: Array, logw: Array, *, Kp: int, Kc: int, dense: bool,
              propagation: str = "LL", alpha: float | None = None, impl: str = "reference") -> Array:
    """Dispatching sum layer; ``impl`` selects the implementation (``"reference"`` today)."""
    if impl != "reference":
        raise ValueError(f"unknown sum-layer impl {impl!r}")
    return sum_layer_reference(buf, ch, pid, logw, Kp=Kp, Kc=Kc, dense=dense, propagation=propagation,
                               alpha=alpha)
