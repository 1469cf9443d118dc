"""Renormalizing unconstrained log-parameters, so that gradient training stays a distribution.

``circuit.params`` holds *normalized* log-parameters (each sum node's weights and each
categorical row sum to one). A gradient optimizer moves them off that set. Treat them as
*logits* instead: :func:`normalize_params` maps any logits to normalized log-parameters,

* sum groups ``[P, Kp, Kc]``: a log-softmax per sum node over all of its children, i.e. over
  the ``Kc`` entries of every parameter block whose row of ``tables["groups"][key]["seg"]``
  names the same parent block (a segment), separately for each of the ``Kp`` parent nodes;
* categorical leaves (``Categorical``, ``Bernoulli``, ``MaskedCategorical``) ``[P, K]``: a
  log-softmax per row (forbidden values of a masked categorical stay ``-inf``);
* ``Gaussian`` (``mu``, ``log_scale``): ``log_scale`` lifted to ``log(min_sigma)``, the distribution's floor (below
  it the loss does not depend on it);
* ``DiscreteLogistic`` (``mu``, ``log_scale``; every scale is a valid distribution, ``min_std`` is EM's floor
  only) and indicator leaves: unchanged.

It is idempotent up to rounding, and gradients flow through it (the shift by the maximum is a
stop-gradient, as in every log-softmax). A user distribution can take part by defining
``normalize_internal(p, tables) -> p``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from ..compiler.layout import Layout
from ..distributions import Categorical, DiscreteLogistic, Gaussian
from ..distributions.base import block_totals
from ..distributions.indicator import IndicatorLeaf
from ..engine import em, forward
from ..options import Options
from ..runtime import declare_entries
from .transforms import check_circuit

Array = jax.Array

__all__ = ["normalize_params", "normalize", "normalized_log_prob", "log_prob", "mean_nll"]


def _finite_or_zero(m: Array) -> Array:
    return jnp.where(jnp.isfinite(m), m, 0.0)


def segment_log_softmax(logits: Array, seg: Array, num_segments: int) -> Array:
    """Log-softmax of ``logits`` ``[P, Kp, Kc]`` over the ``Kc`` entries of all blocks ``p`` that share a
    segment ``seg[p]`` (``int32[P]``, ids in ``[0, num_segments)``), for each of the ``Kp`` rows. Returns
    ``[P, Kp, Kc]``."""
    m = jax.ops.segment_max(jnp.max(logits, axis=2), seg, num_segments=num_segments)  # [S, Kp]
    m = lax.stop_gradient(_finite_or_zero(m))
    tot = block_totals(jnp.exp(logits - m[seg][:, :, None]), seg, num_segments)  # [S, Kp]
    lse = jnp.log(tot) + m
    return logits - lse[seg][:, :, None]


def _row_log_softmax(logits: Array, axis: int = 1) -> Array:
    m = lax.stop_gradient(_finite_or_zero(jnp.max(logits, axis=axis, keepdims=True)))
    return logits - (jnp.log(jnp.sum(jnp.exp(logits - m), axis=axis, keepdims=True)) + m)


def normalize_input(dist, p: dict, tables: dict) -> dict:
    """Normalized internal parameters of one input layer (see the module docstring)."""
    custom = getattr(dist, "normalize_internal", None)
    if custom is not None:
        return custom(p, tables)
    if isinstance(dist, Categorical):
        logits = p["log_probs"]
        mask = tables.get("mask")
        if mask is not None:  # forbidden values take no part in the softmax and stay at probability zero
            logits = jnp.where(mask, logits, -jnp.inf)
        return {**p, "log_probs": _row_log_softmax(logits)}
    if isinstance(dist, Gaussian):
        floor = jnp.asarray(math.log(dist.min_sigma), p["log_scale"].dtype)
        return {**p, "log_scale": jnp.maximum(p["log_scale"], floor)}
    if isinstance(dist, (DiscreteLogistic, IndicatorLeaf)):
        return p
    raise TypeError(f"normalize: no normalization is known for {dist!r}; give it a method "
                    f"normalize_internal(p, tables) -> p")


def normalize_params(layout: Layout, tables: dict, params: dict) -> dict:
    """Normalized log-parameters from unconstrained ones (pure; jit, grad and vmap freely).

    Args:
        layout: ``circuit.layout``.
        tables: ``circuit.tables``.
        params: a pytree shaped like ``circuit.params`` (sum groups ``[P, Kp, Kc]``, input layers'
            internal fields) holding arbitrary finite or ``-inf`` logits.

    Returns:
        the same structure, each sum node's weights and each categorical row summing to one.
    """
    sums = {}
    for g in layout.sum_groups:
        logits = params["sum"][g.key]
        sums[g.key] = (_row_log_softmax(logits, axis=2) if g.single_segments  # a segment is one block's rows
                       else segment_log_softmax(logits, tables["groups"][g.key]["seg"], g.num_segments))
    ins = {}
    for spec, tab in zip(layout.input_layers, tables["inputs"]):
        ins[spec.key] = normalize_input(spec.dist, params["input"][spec.key], tab["meta"])
    return {"sum": sums, "input": ins}


def normalized_log_prob(layout: Layout, tables: dict, params: dict, x: Array, missing: Array | None, options,
                        soft: Array | None = None, normalize: bool = True, evidence: dict | None = None) -> Array:
    """``log p(x)`` ``[B]`` of the circuit whose parameters are ``normalize_params(params)`` (pure).

    ``layout``, ``tables``: ``circuit.layout`` and ``circuit.tables``; ``params``: logits shaped like
    ``circuit.params``; ``x`` ``[B, V]`` and ``missing`` (``bool[B, V]``, ``bool[V]`` or None) already checked
    (:meth:`jaxpc.Circuit.log_prob` checks them; nothing is checked here); ``options``: a :class:`jaxpc.Options`.
    ``soft``: optional ``[B, V, K]`` non-negative weights of soft evidence (see :func:`jaxpc.queries.marginal`);
    ``normalize``: False evaluates ``params`` as they are (default ``True``);
    ``evidence``: per-call evidence as :meth:`jaxpc.Circuit.check_evidence` returns it."""
    p = normalize_params(layout, tables, params) if normalize else params
    return forward.log_prob(layout, tables, p, x, missing, options, soft=soft, evidence=evidence)


def mean_nll(layout: Layout, tables: dict, params: dict, x: Array, missing: Array | None, weights: Array | None,
             options, normalize: bool = True, evidence: dict | None = None) -> tuple[Array, Array]:
    """``(loss, ll)``: the weighted mean negative log-likelihood ``-sum_b w_b ll_b / sum_b w_b`` (scalar) and
    the per-sample log-likelihoods ``ll`` ``[B]`` (under the per-call ``evidence``, when given). Zero-weight
    rows (padding) contribute exactly nothing, also where their ll is -inf (:func:`jaxpc.engine.em.weighted_ll_sum`).
    ``weights`` ``[B]`` or None (the plain mean); ``layout``, ``tables``, ``params``, ``x``, ``missing``,
    ``options`` and ``normalize`` as for :func:`normalized_log_prob` (pure: nothing is checked)."""
    ll = normalized_log_prob(layout, tables, params, x, missing, options, normalize=normalize, evidence=evidence)
    if weights is None:
        return -jnp.mean(ll), ll
    w = weights.astype(ll.dtype)
    return -em.weighted_ll_sum(ll, w) / jnp.sum(w), ll


# ---- circuit-level wrappers ---------------------------------------------------------------------

def _normalize_entry(layout, tables, params):
    return normalize_params(layout, tables, params)


def _log_prob_entry(layout, tables, params, x, missing, *, options, normalize):
    return normalized_log_prob(layout, tables, params, x, missing, options, normalize=normalize)


declare_entries("optim.normalize", "optim.log_prob")


def normalize(circuit, params: dict) -> dict:
    """:func:`normalize_params` for ``circuit`` (one cached executable per circuit) of ``params``, logits shaped
    like ``circuit.params``. A ``circuit`` that is not a :class:`jaxpc.Circuit` is a ``TypeError``."""
    check_circuit(circuit, "optim.normalize")
    circuit.runtime.entry("optim.normalize", _normalize_entry, None, circuit.layout)
    return circuit.runtime.run("optim.normalize", {}, {"tables": circuit.tables, "params": params})


def log_prob(circuit, params: dict, x, missing=None, *, normalize: bool = True, options: Options | None = None,
             validate: bool | str = True) -> Array:
    """``circuit.log_prob`` on unconstrained logits: the forward renormalizes ``params`` first.

    Args:
        circuit: a compiled :class:`jaxpc.Circuit` (anything else is a ``TypeError``).
        params: logits shaped like ``circuit.params`` (normalized params give the same values as
            ``circuit.log_prob`` up to rounding).
        x: ``[B, V]``; missing: ``bool[V]`` or ``bool[B, V]`` or None.
        normalize: False evaluates ``params`` as they are (``circuit.log_prob``).
        options: a full :class:`jaxpc.Options` for the forward (default None: ``Options()``), as for
            :meth:`jaxpc.Circuit.log_prob`; not an ``Options``: a ``TypeError``.
        validate: ``True`` (default), ``"sync"`` or ``False``, as for :meth:`jaxpc.Circuit.log_prob` (see
            :mod:`jaxpc.runtime`).

    Returns:
        ``float[B]``.
    """
    check_circuit(circuit, "optim.log_prob")
    circuit.runtime.entry("optim.log_prob", _log_prob_entry, 0, circuit.layout)
    batch = circuit.runtime.prepare(x, missing, validate)
    return circuit.runtime.run("optim.log_prob", {"normalize": bool(normalize)},
                               {"tables": circuit.tables, "params": params}, batch, options=Options.make(options))
