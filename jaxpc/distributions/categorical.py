"""Categorical, Bernoulli and MaskedCategorical leaves.

Internal parameters: ``{"log_probs": [P, K]}`` (log-probabilities; ``-inf`` where a
masked categorical forbids a value). The gradient of the log-likelihood with respect to
``log_probs`` is the expected count of each value, so EM statistics and ``jax.grad`` agree.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..ops.logspace import logsumexp, segment_logsumexp
from ..ops.pieces import in_order, ranges
from .base import Distribution, blend, float_field, has_mass, log_weights, reduce_missing, segment_sum


def _check_probs(probs: np.ndarray, num_nodes: int, num_cats: int, where: str, allowed: np.ndarray | None = None):
    if probs.shape != (num_nodes, num_cats):
        raise ValueError(f"{where}: probabilities must have shape [num_nodes, num_cats] = [{num_nodes}, {num_cats}], "
                         f"got {probs.shape}")
    if not np.all(np.isfinite(probs)) or np.any(probs < 0):
        raise ValueError(f"{where}: probabilities must be finite and non-negative")
    if allowed is not None:
        if np.any(probs[~allowed] > 0):
            raise ValueError(f"{where}: probabilities must be zero on values the mask forbids")
    top = probs.max(axis=1, keepdims=True)
    if np.any(top <= 0):
        raise ValueError(f"{where}: node {int(np.argmin(top))} has probabilities summing to zero")
    scaled = probs / top  # each row's largest weight 1: unnormalized weights near the float64 maximum sum finitely
    return scaled / scaled.sum(axis=1, keepdims=True)


class Categorical(Distribution):
    """``P(x = k) = probs[k]`` for ``k`` in ``[0, num_cats)``.

    Natural params: probabilities ``[num_nodes, num_cats]`` (rows are normalized).
    EM: ``probs <- (1 - s) probs + s (counts + c / K) / (sum(counts) + c)`` with pseudocount ``c``.
    """

    name = "categorical"
    natural_fields = ("probs",)
    stat_fields = ("counts",)

    def __init__(self, num_cats: int):
        if not isinstance(num_cats, (int, np.integer)) or isinstance(num_cats, bool) or num_cats < 1:
            raise ValueError(f"{type(self).__name__}: num_cats must be a positive int, got {num_cats!r}")
        self.num_cats = int(num_cats)

    def config(self) -> tuple:
        return (self.num_cats,)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_cats={self.num_cats})"

    def value_range(self):
        return (0, self.num_cats)

    # host
    def _check_natural(self, natural, num_nodes, where):
        return {"probs": _check_probs(natural["probs"], num_nodes, self.num_cats, where)}

    def natural_to_internal(self, natural):
        with np.errstate(divide="ignore"):
            return {"log_probs": np.log(natural["probs"])}

    # traced
    def _mask(self, tables):
        m = tables.get("mask")
        return None if m is None or m is True else m

    def init(self, rs, num_rows, tables):
        return {"log_probs": rs.log_weights((num_rows, self.num_cats), mask=self._mask(tables))}

    def internal_to_natural(self, p, tables):
        return {"probs": jnp.exp(p["log_probs"])}

    def _values(self, xv, mv):
        xi = xv.astype(jnp.int32) if xv.dtype != jnp.int32 else xv
        return xi if mv is None else jnp.where(mv, 0, xi)

    def _flat(self, rows, xi):
        """``[N, B]`` indices into the flattened ``[P * K]`` table: one flat index per (node, sample), no
        ``[N, B, 2]`` index array (which was the layer's largest buffer)."""
        return rows[:, None] * self.num_cats + xi

    def log_prob(self, p, tables, rows, xv, mv, options):
        lp = p["log_probs"]
        xi = self._values(xv, mv)
        out = lp.reshape(-1)[self._flat(rows, jnp.clip(xi, 0, self.num_cats - 1))]
        # out-of-range values reach here only when validation was switched off: poison, never clamp silently
        out = jnp.where((xi < 0) | (xi >= self.num_cats), jnp.nan, out)
        if mv is not None:
            marg = reduce_missing(lp, options)[rows]
            out = jnp.where(mv, marg[:, None], out)
        return out

    def marginalized_params(self, p, options):
        """Under ``propagation="MPE"``, all the mass on each node's first most probable value (the value
        max-product decoding takes for a missing variable); else ``p``."""
        if options.propagation != "MPE":
            return p
        lp = p["log_probs"]
        first = jnp.argmax(lp, axis=1)[:, None] == jnp.arange(lp.shape[1])
        return {**p, "log_probs": jnp.where(first, jnp.zeros((), lp.dtype), jnp.array(-jnp.inf, lp.dtype))}

    def value_table(self, p):
        # a subclass with its own log_prob (evidence leaves) computes its values otherwise
        return p["log_probs"] if type(self).log_prob is Categorical.log_prob else None

    def log_pmf(self, p, tables, rows, num_values):
        lp = p["log_probs"][rows]
        K = self.num_cats
        if num_values > K:
            lp = jnp.concatenate([lp, jnp.full((lp.shape[0], num_values - K), -jnp.inf, lp.dtype)], axis=1)
        return lp[:, :num_values]

    def suff_stats(self, p, tables, rows, xv, mv, flows, num_rows):
        xi = jnp.clip(self._values(xv, mv), 0, self.num_cats - 1)
        obs = flows if mv is None else jnp.where(mv, 0.0, flows)
        counts = jnp.zeros((num_rows * self.num_cats,), flows.dtype).at[self._flat(rows, xi)].add(obs)
        counts = counts.reshape(num_rows, self.num_cats)
        if mv is not None:
            counts = counts + self._marginalized(p, jnp.sum(jnp.where(mv, flows, 0.0), axis=1), rows, num_rows)
        return {"counts": counts}

    def log_suff_stats(self, p, tables, rows, xv, mv, log_flows, num_rows):
        """:meth:`suff_stats` in the log domain: ``{"counts": log counts}``, each a ``log sum exp`` of the log flows
        of the (node, sample) pairs that observed the value, and for marginalized values their log flows plus the
        node's log-probabilities."""
        K = self.num_cats
        xi = jnp.clip(self._values(xv, mv), 0, K - 1)
        obs = log_flows if mv is None else jnp.where(mv, -jnp.inf, log_flows)
        counts = segment_logsumexp(obs.reshape(-1), self._flat(rows, xi).reshape(-1), num_rows * K)
        counts = counts.reshape(num_rows, K)
        if mv is not None:
            miss = logsumexp(jnp.where(mv, log_flows, -jnp.inf), axis=1)  # [N]
            counts = jnp.logaddexp(counts, segment_logsumexp(miss[:, None] + p["log_probs"][rows], rows, num_rows))
        return {"counts": counts}

    def _marginalized(self, p, miss, rows=None, num_rows=None):
        """Counts of the marginalized values: each contributes its posterior under the current parameters,
        ``miss [N]`` (node ``i``'s flow summed over the samples that miss its variable) times node ``i``'s
        probabilities, added up per parameter row (``rows``; None: node ``i`` reads row ``i``)."""
        probs = jnp.exp(p["log_probs"])
        if rows is None:
            return miss[:, None] * probs
        return segment_sum(miss[:, None] * probs[rows], rows, num_rows)

    def suff_stats_runs(self, p, tables, xg, mg, flows, run, options, kernel: tuple | None = None):
        """Counts as one batched product per run of nodes over a variable: ``counts[g, j, k] = sum_b
        flows[g, j, b] [x[g, b] = k]`` (``flows`` viewed ``[G, run, B]``), a matrix product with a one-hot
        matrix instead of a scatter of ``N * B`` single values (HCLT-256 at B=512: 100 million). The one-hot
        side is exact in any matmul precision; with ``precision="fp32"`` the flows are split into a TF32-exact
        high part and the remainder, so two default-precision products give float32 counts. ``kernel``:
        ``(array, row)``, the flows as rows ``row + [0, N)`` of ``array`` (e.g. the flow pass's buffer), read
        there by one Pallas kernel that makes the one-hot matrices in registers
        (:func:`jaxpc.ops.pallas_leaf.categorical_counts`) instead of XLA's one-hot matrices in memory."""
        N, B = flows.shape
        G, K = N // run, self.num_cats
        xi = jnp.clip(self._values(xg, mg), 0, K - 1)
        if kernel is not None:
            from ..ops import pallas_leaf

            xk = xi if mg is None else jnp.where(mg, -1, xi)  # a missing value counts nowhere
            counts = pallas_leaf.categorical_counts(kernel[0], xk, run=run, num_cats=K,
                                                    precision=options.concrete_precision,
                                                    offset=kernel[1])
            return {"counts": self._with_marginalized(p, counts.reshape(N, K), flows, mg, run)}
        obs = flows.reshape(G, run, B)
        if mg is not None:
            obs = jnp.where(mg[:, None, :], 0.0, obs)
        split = options.concrete_precision == "fp32" and flows.dtype == jnp.float32

        def product(o, xc):  # [g, run, B] x one-hot [g, B, K]
            onehot = (xc[:, :, None] == jnp.arange(K, dtype=xc.dtype)).astype(flows.dtype)
            if split:
                hi = lax.bitcast_convert_type(lax.bitcast_convert_type(o, jnp.uint32) & jnp.uint32(0xFFFFE000),
                                              jnp.float32)
                return (jnp.einsum("grb,gbk->grk", hi, onehot, preferred_element_type=flows.dtype)
                        + jnp.einsum("grb,gbk->grk", o - hi, onehot, preferred_element_type=flows.dtype))
            return jnp.einsum("grb,gbk->grk", o, onehot, preferred_element_type=flows.dtype)

        # one-hot matrices of at most Options.tuning.onehot_chunk elements at a time (HCLT-256 at B=512: 784 x 512 x 256
        # floats, 411 MB, would otherwise be the step's largest temporary). The chunks are unrolled: a loop would be a
        # device-side while loop, which the GPU runtime runs outside the step's command buffer, synchronizing with the
        # host on every trip (2 ms per step on an H200). A barrier orders them: the next chunk's values come out of it
        # together with this chunk's counts, so one one-hot matrix is alive at a time
        parts = in_order(ranges(G, options.tuning.onehot_chunk // (B * K)), lambda a, b: xi[a:b],
                         lambda done, a, b, xc: done + [product(obs[a:b], xc)], [])
        counts = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
        return {"counts": self._with_marginalized(p, counts.reshape(N, K), flows, mg, run)}

    def _with_marginalized(self, p, counts, flows, mg, run):
        """``counts [N, K]`` of a layer in runs plus the counts of its missing values (:meth:`_marginalized`)."""
        if mg is None:
            return counts
        N, B = flows.shape
        miss = jnp.sum(jnp.where(mg[:, None, :], flows.reshape(N // run, run, B), 0.0), axis=2).reshape(N)
        return counts + self._marginalized(p, miss)

    def em_update(self, p, tables, stats, step_size, pseudocount):
        counts = stats["counts"]
        mask = self._mask(tables)
        if mask is None:
            k_eff = self.num_cats
            pc = pseudocount / k_eff
        else:
            k_eff = jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1)
            pc = jnp.where(mask, pseudocount / k_eff, 0.0)
            counts = jnp.where(mask, counts, 0.0)
        tot = jnp.sum(counts, axis=1, keepdims=True) + pseudocount
        old = jnp.exp(p["log_probs"])
        mass = has_mass(tot)
        new = blend(old, jnp.where(mass, (counts + pc) / jnp.where(mass, tot, 1.0), old), step_size)
        # zeros (forbidden values) become -inf without a log of 0, whose derivative is NaN whatever the cotangent
        return {"log_probs": log_weights(new)}


class Bernoulli(Categorical):
    """``P(x = 1) = p``. Natural params: ``p`` of shape ``[num_nodes]``; values 0/1 (or bool)."""

    name = "bernoulli"
    natural_fields = ("p",)

    def __init__(self):
        super().__init__(2)

    def config(self) -> tuple:
        return ()

    def __repr__(self) -> str:
        return "Bernoulli()"

    def _check_natural(self, natural, num_nodes, where):
        p = natural["p"]
        if p.shape != (num_nodes,):
            raise ValueError(f"{where}: Bernoulli params must have shape [num_nodes] = [{num_nodes}], got {p.shape}")
        if not np.all((p >= 0) & (p <= 1)):
            raise ValueError(f"{where}: Bernoulli probabilities must lie in [0, 1]")
        return {"p": p}

    def natural_to_internal(self, natural):
        p = natural["p"]
        with np.errstate(divide="ignore"):
            return {"log_probs": np.stack([np.log1p(-p), np.log(p)], axis=1)}  # log1p: exact log(1 - p) near p = 0

    def internal_to_natural(self, p, tables):
        return {"p": jnp.exp(p["log_probs"][:, 1])}


class MaskedCategorical(Categorical):
    """A categorical restricted to a per-node set of allowed values.

    ``mask_mode``: ``"range"`` (natural ``mask`` ``[num_nodes, 2]``: values in ``[lo, hi)`` allowed),
    ``"rev_range"`` (values in ``[lo, hi)`` forbidden) or ``"full_mask"`` (``bool[num_nodes, num_cats]``,
    True = allowed). Params are a dict with the required ``mask`` and optional ``probs``. Forbidden
    values have probability exactly zero (log-probability ``-inf``).
    """

    name = "masked_categorical"
    natural_fields = ("probs", "mask")
    MODES = ("range", "rev_range", "full_mask")

    def __init__(self, num_cats: int, mask_mode: str = "range"):
        super().__init__(num_cats)
        if mask_mode not in self.MODES:
            raise ValueError(f"MaskedCategorical: mask_mode must be one of {self.MODES}, got {mask_mode!r}")
        self.mask_mode = mask_mode

    def config(self) -> tuple:
        return (self.num_cats,)  # the mode only shapes the host-side mask; one layer serves all modes

    def __eq__(self, other):
        return type(self) is type(other) and (self.num_cats, self.mask_mode) == (other.num_cats, other.mask_mode)

    def __hash__(self):
        return hash((type(self).__name__, self.num_cats, self.mask_mode))

    def __repr__(self):
        return f"MaskedCategorical(num_cats={self.num_cats}, mask_mode={self.mask_mode!r})"

    def canonical_params(self, params, num_nodes, where):
        if not isinstance(params, dict) or "mask" not in params:
            raise ValueError(f"{where}: MaskedCategorical needs params={{'mask': ..., 'probs': optional}}")
        raw = np.asarray(params["mask"])
        allowed = self._allowed(raw, num_nodes, where)
        out = {"mask": allowed}
        if params.get("probs") is not None:
            out["probs"] = _check_probs(float_field(params["probs"], "probs", self, where), num_nodes, self.num_cats,
                                        where, allowed)
        extra = set(params) - {"mask", "probs"}
        if extra:
            raise ValueError(f"{where}: unknown parameter(s) {sorted(extra)} for {self!r}")
        return out

    def _allowed(self, raw, num_nodes, where):
        K = self.num_cats
        if raw.dtype.kind not in "biuf":
            raise ValueError(f"{where}: MaskedCategorical mask must be numeric, got dtype {raw.dtype}")
        if self.mask_mode == "full_mask":
            if raw.shape != (num_nodes, K):
                raise ValueError(f"{where}: full_mask must have shape [{num_nodes}, {K}], got {raw.shape}")
            if not np.all((raw == 0) | (raw == 1)):
                raise ValueError(f"{where}: full_mask must be boolean (True or 1 = allowed, False or 0 = forbidden)")
            allowed = raw.astype(bool)
        else:
            if raw.shape != (num_nodes, 2):
                raise ValueError(f"{where}: {self.mask_mode} mask must have shape [{num_nodes}, 2] (lo, hi), "
                                 f"got {raw.shape}")
            if raw.dtype.kind == "b" or not np.all(np.isfinite(raw) & (raw == np.round(raw))):
                raise ValueError(f"{where}: {self.mask_mode} mask bounds (lo, hi) must be integers")
            lo, hi = raw[:, :1].astype(np.int64), raw[:, 1:].astype(np.int64)
            if np.any(lo < 0) or np.any(hi > K) or np.any(lo > hi):
                raise ValueError(f"{where}: mask ranges must satisfy 0 <= lo <= hi <= {K}")
            ar = np.arange(K)[None, :]
            inside = (ar >= lo) & (ar < hi)
            allowed = inside if self.mask_mode == "range" else ~inside
        if np.any(~allowed.any(axis=1)):
            raise ValueError(f"{where}: node {int(np.argmin(allowed.any(axis=1)))} allows no value")
        return allowed

    def row_tables(self, num_nodes, natural, where):
        if natural is None or "mask" not in natural:
            raise ValueError(f"{where}: MaskedCategorical needs params={{'mask': ...}} at construction")
        return {"mask": natural["mask"]}

    def has_full_params(self, natural):
        return natural is not None and "probs" in natural

    def natural_to_internal(self, natural):
        with np.errstate(divide="ignore"):
            return {"log_probs": np.log(natural["probs"])}

    def internal_to_natural(self, p, tables):
        return {"probs": jnp.exp(p["log_probs"]), "mask": tables["mask"]}
