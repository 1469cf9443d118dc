"""Sums of exponentials kept in the log domain: the accumulators of log-space flows.

A :class:`LogSum` holds ``log sum_i exp(t_i)`` of terms scattered into it as a running max ``m`` and the sum ``s``
of ``exp(t_i - m)``, so terms far below the dtype's range (1e-38 in float32, 1e-45 with subnormals) still add up
to their exact logarithm, and a sum of no terms (or of ``-inf`` terms only) is ``-inf``. Every update touches only the
indexed entries (scatters and gathers, no pass over the whole accumulator).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array


class LogSum(NamedTuple):
    """``log sum exp`` of the terms added so far, elementwise: ``m + log(s)`` (:func:`log_sum_value`)."""

    m: Array  # the largest term so far (-inf: none)
    s: Array  # sum of exp(term - m); 0 with no term


def log_sum_zeros(shape, dtype) -> LogSum:
    """An accumulator of ``shape`` holding no terms (value ``-inf``)."""
    return LogSum(jnp.full(shape, -jnp.inf, dtype), jnp.zeros(shape, dtype))


def log_sum_add(acc: LogSum, idx: Array, terms: Array) -> LogSum:
    """``acc`` with ``terms [M, ...]`` added at the leading indices ``idx [M]``; repeated indices add up."""
    terms = terms.astype(acc.m.dtype)
    m = acc.m.at[idx].max(terms)
    new = m[idx]
    live = ~jnp.isneginf(new)  # NaN stays live and propagates
    # every repeat of an index writes the same rescaled value, so the set is well defined; entries that are not
    # live exponentiate 0, never -inf - -inf, so their derivatives are 0, not NaN
    s = acc.s.at[idx].set(jnp.where(live, acc.s[idx] * jnp.exp(jnp.where(live, acc.m[idx] - new, 0.0)), 0.0))
    return LogSum(m, s.at[idx].add(jnp.where(live, jnp.exp(jnp.where(live, terms - new, 0.0)), 0.0)))


def log_sum_value(acc: LogSum) -> Array:
    """The accumulated ``log sum exp`` (``-inf``, with a zero derivative, where no finite term was added)."""
    empty = acc.s == 0
    return jnp.where(empty, -jnp.inf, acc.m + jnp.log(jnp.where(empty, 1.0, acc.s)))


def logsumexp(a: Array, axis, keepdims: bool = False) -> Array:
    """:func:`jax.nn.logsumexp` over ``axis`` (an int or a tuple), the same values; where every term is ``-inf``
    (value ``-inf``) its derivative is 0, not NaN."""
    dead = jnp.all(jnp.isneginf(a), axis=axis, keepdims=True)
    out = jnp.where(dead, -jnp.inf, jax.nn.logsumexp(jnp.where(dead, 0.0, a), axis=axis, keepdims=True))
    return out if keepdims else jnp.squeeze(out, axis)


def log_sum_rows(acc: LogSum, start, size: int) -> Array:
    """:func:`log_sum_value` of rows ``[start, start + size)`` (``start`` may be traced)."""
    return log_sum_value(LogSum(lax.dynamic_slice_in_dim(acc.m, start, size, axis=0),
                                lax.dynamic_slice_in_dim(acc.s, start, size, axis=0)))


def segment_logsumexp(terms: Array, ids: Array, num_segments: int) -> Array:
    """``[num_segments, ...]``: ``log sum exp`` of the ``terms [M, ...]`` of each segment ``ids [M]`` (``-inf``
    for a segment without finite terms)."""
    acc = log_sum_zeros((num_segments,) + terms.shape[1:], terms.dtype)
    return log_sum_value(log_sum_add(acc, ids, terms))


def log_psum(tree, axis_name: str):
    """The elementwise ``log sum exp`` of a pytree of log-values over a mapped axis (the log-domain ``psum``)."""
    def one(a):
        m = lax.pmax(a, axis_name)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        return m + jnp.log(lax.psum(jnp.exp(a - m), axis_name))

    return jax.tree_util.tree_map(one, tree)
