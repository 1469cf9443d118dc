"""The interface every input distribution implements.

An input layer holds all input nodes whose distributions share a ``layer_key``. Its
parameters live in *rows* (tied input vectors share rows) as a dict of arrays with a leading
row axis: the *internal* form, which is what ``circuit.params`` holds and what gradients are
taken with respect to. Users give and get parameters in the *natural* form (probabilities,
means, standard deviations) through ``inputs(..., params=...)`` and
``circuit.get_node_params``.

Static per-row metadata (an indicator's value, a masked categorical's mask) lives in
``tables``: int/bool device arrays passed into jitted functions, never trained.

Shapes: ``P`` rows, ``N`` nodes of the layer, ``B`` batch. ``rows`` is ``int32[N]`` (row of
each node); ``xv`` is ``[N, B]`` (value of each node's variable per sample); ``mv`` is
``bool[N, B]`` or None (True where the variable is marginalized).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import host_init

Array = jax.Array

_HOST_CHUNK = 1 << 20  # host draws per chunk (8 MiB of float64)


def is_real_dtype(dt: np.dtype) -> bool:
    """Whether arrays of ``dt`` hold real numbers: integers or floats (bfloat16 and the other ml_dtypes floats too),
    not booleans, complex numbers, strings, dates or objects."""
    return dt.kind in "iuf" or (dt.kind == "V" and bool(jnp.issubdtype(dt, jnp.floating)))


def real_array(value: Any, what: str, ragged: type[Exception] = ValueError) -> np.ndarray:
    """``value`` as a float64 array where it holds real numbers (integers or floats); else an error whose message
    starts with ``what`` (the rule broken, e.g. ``"w: params must hold real numbers"``): booleans, strings and
    other non-numbers a ``TypeError``, ragged nested sequences ``ragged``."""
    try:
        raw = np.asarray(value)
    except ValueError as e:
        raise ragged(f"{what}, got ragged nested sequences, not a rectangular array ({e})") from None
    if raw.dtype == bool:
        raise TypeError(f"{what}, got booleans (dtype bool); give numbers, e.g. np.asarray(value, float)")
    if not is_real_dtype(raw.dtype):
        raise TypeError(f"{what}, got an array of dtype {raw.dtype}")
    return raw.astype(np.float64)


def float_field(value: Any, field: str, dist: Any, where: str) -> np.ndarray:
    """``value``, the natural parameter ``field`` of ``dist`` given to node vector ``where``, as a float64 array
    (:func:`real_array`: a ``TypeError`` for non-numbers, booleans included, a ``ValueError`` for ragged nested
    sequences, each naming ``where``, the field and the distribution)."""
    return real_array(value, f"{where}: params field {field!r} of {dist!r} must hold real numbers")


class Distribution:
    """Base class. Subclasses are small frozen-value objects (equality by configuration)."""

    #: short name used for the params pytree key of the layer
    name: str = "dist"
    #: whether values are category ids (int) or reals (float)
    discrete: bool = True
    #: natural parameter fields, in order; a single field is given/returned as a bare array
    natural_fields: tuple[str, ...] = ()
    stat_fields: tuple[str, ...] = ()  # the keys of :meth:`suff_stats` (a layer's entry of the flows)

    # ---- identity -------------------------------------------------------------------------
    def config(self) -> tuple:
        """The configuration that makes two instances equal (and share an input layer)."""
        return ()

    def layer_key(self) -> tuple:
        return (type(self).__name__,) + self.config()

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.config() == other.config()

    def __hash__(self) -> int:
        return hash(self.layer_key())

    def __repr__(self) -> str:
        return type(self).__name__

    # ---- data -----------------------------------------------------------------------------
    def value_range(self) -> tuple[int, int | None] | None:
        """``(lo, hi)`` for discrete values (``hi`` exclusive, None for unbounded), None for reals."""
        return None

    def num_values(self) -> int | None:
        """How many values a discrete leaf can put mass on (``0 .. n-1``); None for reals."""
        r = self.value_range()
        return None if r is None else r[1]

    def describe_values(self) -> str:
        r = self.value_range()
        if r is None:
            return "finite real values"
        lo, hi = r
        return f"integers >= {lo}" if hi is None else f"integers in [{lo}, {hi - 1}]"

    # ---- host-side parameters -------------------------------------------------------------
    def canonical_params(self, params: Any, num_nodes: int, where: str) -> dict[str, np.ndarray]:
        """Validate user parameters for ``num_nodes`` nodes; return the natural dict (float64). ``where`` names the
        node vector in errors: a field that does not hold numbers is a ``TypeError``, ragged nested lists a
        ``ValueError``, both naming ``where`` and the field (:func:`float_field`)."""
        if not self.natural_fields:
            raise ValueError(f"{where}: {self!r} has no parameters")
        if isinstance(params, dict):
            unknown = set(params) - set(self.natural_fields)
            if unknown:
                raise ValueError(f"{where}: unknown parameter(s) {sorted(unknown)} for {self!r}; "
                                 f"expected {list(self.natural_fields)}")
            out = {k: float_field(v, k, self, where) for k, v in params.items()}
        elif len(self.natural_fields) == 1:
            out = {self.natural_fields[0]: float_field(params, self.natural_fields[0], self, where)}
        else:
            raise ValueError(f"{where}: {self!r} takes params as a dict with keys {list(self.natural_fields)}")
        return self._check_natural(out, num_nodes, where)

    def _check_natural(self, natural: dict[str, np.ndarray], num_nodes: int, where: str) -> dict[str, np.ndarray]:
        return natural

    def row_tables(self, num_nodes: int, natural: dict[str, np.ndarray] | None, where: str) -> dict[str, np.ndarray]:
        """Static per-row metadata for a vector of ``num_nodes`` nodes."""
        return {}

    def natural_to_internal(self, natural: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def has_full_params(self, natural: dict[str, np.ndarray] | None) -> bool:
        """Whether ``natural`` defines the trainable parameters (not only metadata such as masks)."""
        return natural is not None

    # ---- traced ---------------------------------------------------------------------------
    def init(self, rs: RandomSource, num_rows: int, tables: dict[str, Array]) -> dict[str, Array]:
        """Random internal parameters for ``num_rows`` rows (math through ``rs.xp``)."""
        return {}

    def internal_to_natural(self, p: dict[str, Array], tables: dict[str, Array]) -> dict[str, Array]:
        raise NotImplementedError

    def log_prob(self, p: dict[str, Array], tables: dict[str, Array], rows: Array, xv: Array, mv: Array | None,
                 options) -> Array:
        """``[N, B]`` node values (log-probabilities; marginalized per ``options`` where ``mv``)."""
        raise NotImplementedError

    def value_table(self, p: dict[str, Array]) -> Array | None:
        """``[P, K]`` float log-values such that :meth:`log_prob` of node ``i`` (parameter row ``rows[i]``) is
        ``table[rows[i], x]`` for ``x`` in ``[0, K)``, NaN outside it and ``reduce_missing(table)[rows[i]]`` where
        ``x`` is missing: the form the leaf kernel (:mod:`jaxpc.ops.pallas_leaf`) computes. None (the default)
        when the values are computed otherwise."""
        return None

    # ---- discrete leaves: the pmf as a table; sampling and modes -------------------------------
    def log_pmf(self, p: dict[str, Array], tables: dict[str, Array], rows: Array, num_values: int) -> Array:
        """``[len(rows), num_values]`` log-probabilities of the values ``0 .. num_values-1`` (discrete only)."""
        raise TypeError(f"{self!r} is not a discrete distribution")

    def log_prob_soft(self, p: dict[str, Array], tables: dict[str, Array], rows: Array, q: Array, options) -> Array:
        """Node values under soft evidence: ``reduce_k(log pmf[n, k] + log q[n, k, b])`` with the LL / MPE /
        GeneralLL reduction (:func:`soft_reduce`); ``q`` is ``[N, K, B]`` non-negative weights of each node's
        variable."""
        return soft_reduce(self.log_pmf(p, tables, rows, q.shape[1])[:, :, None], q, options)

    def sample(self, key: Array, p: dict[str, Array], tables: dict[str, Array], prow: Array, num_values: int) -> Array:
        """One draw per entry of ``prow`` (param rows, any shape)."""
        lp = self.log_pmf(p, tables, prow.reshape(-1), num_values)
        return jax.random.categorical(key, lp, axis=-1).reshape(prow.shape).astype(jnp.int32)

    def mode(self, p: dict[str, Array], tables: dict[str, Array], prow: Array, num_values: int) -> Array:
        """The most probable value per entry of ``prow`` (lowest value on ties)."""
        lp = self.log_pmf(p, tables, prow.reshape(-1), num_values)
        return jnp.argmax(lp, axis=-1).reshape(prow.shape).astype(jnp.int32)

    def log_prob_evidence(self, p: dict[str, Array], tables: dict[str, Array], rows: Array, vars_: Array, pos: Array,
                          xv: Array, mv: Array | None, evidence: dict, options) -> Array:
        """Node values given per-call ``evidence`` (see :mod:`jaxpc.distributions.evidence`); leaves that
        read no evidence use :meth:`log_prob`."""
        return self.log_prob(p, tables, rows, xv, mv, options)

    def suff_stats(self, p: dict[str, Array], tables: dict[str, Array], rows: Array, xv: Array, mv: Array | None,
                   flows: Array, num_rows: int) -> dict[str, Array]:
        """Expected sufficient statistics per row from node flows ``[N, B]``."""
        return {}

    def marginalized_params(self, p: dict[str, Array], options) -> dict[str, Array]:
        """The parameters whose distribution a marginalized value's statistics follow under ``options``' propagation
        (what :meth:`suff_stats` and :meth:`log_suff_stats` read for missing values): ``p`` itself, the posterior
        of EM. Distributions whose max-product value of a missing variable is one value (a mode) return, under
        ``propagation="MPE"``, parameters that put all the mass there, or that name the value for their statistics
        to read, so that hard EM counts a missing value as the value the decoding takes observed."""
        return p

    def marginalized_under_evidence(self, p: dict[str, Array], tables: dict[str, Array], rows: Array, vars_: Array,
                                    evidence: dict, options) -> dict[str, Array]:
        """:meth:`marginalized_params` ``p`` given per-call ``evidence`` that reweights the node's values per sample
        (``rows``, ``vars_``: the layer's nodes' parameter rows and variables), what :meth:`suff_stats` and
        :meth:`log_suff_stats` read for missing values: ``p`` itself (the default) where the evidence changes nothing
        of how a missing value counts."""
        return p

    def decoded_under_evidence(self, p: dict[str, Array], tables: dict[str, Array], rows: Array, vars_: Array,
                               evidence: dict, options) -> Array | None:
        """``[N, B]``: each node's value of a missing variable under ``options``' propagation given per-call
        ``evidence`` that reweights the node's values per sample, for hard EM to count as observed (where the one
        value of :meth:`marginalized_params` is not the decoding's); None (the default) where the evidence changes
        nothing of the decoding, or the propagation is not ``"MPE"``."""
        return None

    def log_suff_stats(self, p: dict[str, Array], tables: dict[str, Array], rows: Array, xv: Array, mv: Array | None,
                       log_flows: Array, num_rows: int) -> dict[str, Array]:
        """The logarithms of :meth:`suff_stats` from log node flows ``[N, B]`` (``Options(logspace_flows=True)``),
        computed in the log domain. Distributions without statistics return {}; statistics that can be negative
        (moments) have no logarithm, and their distributions raise."""
        if type(self).suff_stats is Distribution.suff_stats:
            return {}
        raise ValueError(f"logspace_flows: the expected statistics of {self!r} leaves are moments, which have no "
                         f"logarithm; use logspace_flows=False for circuits with such leaves")

    def suff_stats_runs(self, p: dict[str, Array], tables: dict[str, Array], xg: Array, mg: Array | None,
                        flows: Array, run: int, options) -> dict[str, Array]:
        """:meth:`suff_stats` of a layer whose node ``i`` reads row ``i`` and whose nodes come in runs of ``run``
        over one variable (:attr:`jaxpc.compiler.InputLayerSpec.run`): ``xg`` / ``mg`` are ``[N / run, B]``,
        one row per run. Distributions with a faster form for this layout override it."""
        xv = jnp.repeat(xg, run, axis=0)
        mv = None if mg is None else jnp.repeat(mg, run, axis=0)
        return self.suff_stats(p, tables, jnp.arange(flows.shape[0], dtype=jnp.int32), xv, mv, flows, flows.shape[0])

    def em_update(self, p: dict[str, Array], tables: dict[str, Array], stats: dict[str, Array], step_size,
                  pseudocount) -> dict[str, Array]:
        return p


class RandomSource:
    """Uniform and normal draws for parameter initialization, from a JAX key (traceable, vmappable)
    or a numpy ``Generator`` (host side: no XLA compilation when a circuit is built).
    ``xp`` is ``jax.numpy`` or ``numpy`` accordingly, so one ``init`` serves both."""

    def __init__(self, key: Array | None = None, rng: np.random.Generator | None = None, dtype=np.float32):
        if (key is None) == (rng is None):
            raise ValueError("RandomSource needs exactly one of key and rng")
        self._key, self._rng, self.dtype = key, rng, dtype
        self.xp = jnp if key is not None else np

    def _next(self):
        self._key, sub = jax.random.split(self._key)
        return sub

    def _host_draw(self, draw, shape):
        """``draw(n)`` (float64) cast to ``self.dtype`` chunk by chunk: the values of one ``draw(size)``
        call, without its full float64 temporary (8 bytes per parameter at hundreds of millions)."""
        out = np.empty(shape, self.dtype)
        flat = out.reshape(-1)
        for i in range(0, flat.size, _HOST_CHUNK):
            flat[i:i + _HOST_CHUNK] = draw(min(_HOST_CHUNK, flat.size - i))
        return out

    def uniform(self, shape, lo: float = 0.0, hi: float = 1.0):
        if self._rng is not None:
            return self._host_draw(lambda n: self._rng.uniform(lo, hi, n), shape)
        return jax.random.uniform(self._next(), shape, self.dtype, lo, hi)

    def normal(self, shape):
        if self._rng is not None:
            return self._host_draw(self._rng.standard_normal, shape)
        return jax.random.normal(self._next(), shape, self.dtype)

    def log_weights(self, shape, seg=None, num_segments: int = 0, mask=None):
        """Random normalized log-weights ``log(w / total)``, ``w = exp(-2 u)`` with ``u`` uniform in ``[0, 1)``:
        for ``shape = [N, K]`` the total of each row; for ``[N, Kp, Kc]`` with ``seg [N]`` (the segment of each
        block) the total of row ``r`` over the blocks of each of the ``num_segments`` segments. ``mask`` (the
        shape of ``w``): ``w`` is 0 where False (a log-weight of ``-inf``). The host draw runs on several
        threads (:func:`jaxpc.distributions.host_init.log_weights`, the same values)."""
        if self._rng is not None:
            return host_init.log_weights(self._rng, shape, self.dtype, seg, num_segments, mask)
        w = jnp.exp(-2.0 * self.uniform(shape))
        if mask is not None:
            w = jnp.where(mask, w, 0.0)
        if seg is None:
            return jnp.log(w / jnp.sum(w, axis=1, keepdims=True))
        tot = jnp.zeros((num_segments, shape[1]), w.dtype).at[seg].add(w.sum(axis=2))
        return jnp.log(w / tot[seg][:, :, None])


def segment_sum(values: Array, rows: Array, num_rows: int) -> Array:
    """Sum node-level values ``[N, ...]`` into rows ``[P, ...]``."""
    return jax.ops.segment_sum(values, rows, num_segments=num_rows)


def block_totals(values: Array, seg: Array, num_segments: int) -> Array:
    """``[S, Kp]``: parameter blocks' ``values [P, Kp, Kc]`` summed over their ``Kc`` children and over the blocks of
    each segment ``seg [P]`` (a sum node block's edge blocks, which the M-step normalizes together). The sum over the
    children is a reduction of its own, kept apart from the scatter-add by an optimization barrier: fused into it,
    XLA's scatter reads the ``[P, Kp, Kc]`` array at a fraction of the bandwidth of a reduction."""
    rows = jax.lax.optimization_barrier(jnp.sum(values, axis=2))
    return jax.ops.segment_sum(rows, seg, num_segments=num_segments)


def parent_totals(values: Array, seg: Array, group) -> Array:
    """``[P, Kp]``: for each parameter block of ``group`` (a :class:`~jaxpc.compiler.layout.SumGroupSpec`), the
    total of its parent nodes: ``values [P, Kp, Kc]`` summed over the children and over the blocks of its segment
    (:func:`block_totals`, read back per block). Where every segment is one block (``group.single_segments``), the
    block's own sum over its children, with no scatter and no gather."""
    if group.single_segments:
        return jnp.sum(values, axis=2)
    return block_totals(values, seg, group.num_segments)[seg]


def log_weights(q: Array) -> Array:
    """``log q``: -inf where ``q == 0``, with a zero gradient there (not ``0 * inf``); NaN where ``q`` is negative
    or NaN, as ``log`` gives."""
    pos = q > 0
    return jnp.where(pos, jnp.log(jnp.where(pos, q, jnp.ones((), q.dtype))),
                     jnp.where(q == 0, -jnp.inf, jnp.nan).astype(q.dtype))


@jax.custom_jvp
def soft_logsumexp(logpmf: Array, q: Array) -> Array:
    """``log sum_k exp(logpmf[n, k, .]) q[n, k, b]`` ``[N, B]`` (``logpmf`` ``[N, K, 1 or B]``, ``q`` ``[N, K, B]``
    non-negative), computed in log space. Its derivative by ``q`` is ``p_k / sum`` (``exp(logpmf - out)``), finite
    where ``q_k = 0`` (one-hot evidence, a softmax that underflows), where ``log q``'s chain rule gives ``0 * inf``;
    rows whose sum is 0 get zero derivatives."""
    return jax.nn.logsumexp(logpmf + log_weights(q), axis=1)


@soft_logsumexp.defjvp
def _soft_logsumexp_jvp(primals, tangents):
    logpmf, q = primals
    dlogpmf, dq = tangents
    out = soft_logsumexp(logpmf, q)
    finite = jnp.isfinite(out)[:, None, :]
    shifted = logpmf - jnp.where(finite, out[:, None, :], jnp.zeros((), out.dtype))
    post = jnp.where(finite, jnp.exp(shifted + log_weights(q)), 0.0)  # each value's share of the sum
    per_q = jnp.where(finite, jnp.exp(shifted), 0.0)  # d out / d q_k = p_k / sum
    return out, jnp.sum(post * dlogpmf, axis=1) + jnp.sum(per_q * dq, axis=1)


def soft_reduce(logpmf: Array, q: Array, options) -> Array:
    """A discrete leaf's values under soft evidence ``q`` ``[N, K, B]`` (non-negative weights) over axis 1:
    :func:`soft_logsumexp` (LL), else :func:`reduce_missing` of ``logpmf + log q`` (``log q``'s gradient 0 where
    ``q = 0``: a value that takes no part in the max or the tempered sum)."""
    if options.propagation == "LL":
        return soft_logsumexp(logpmf, q)
    return reduce_missing(logpmf + log_weights(q), options, axis=1)


def reduce_missing(logp: Array, options, axis: int = -1) -> Array:
    """Marginalize (LL), maximize (MPE) or temper (GeneralLL) a discrete log-pmf over ``axis``."""
    if options.propagation == "MPE":
        return jnp.max(logp, axis=axis)
    if options.propagation == "GeneralLL":
        a = options.alpha
        return jax.nn.logsumexp(a * logp, axis=axis) / a
    return jax.nn.logsumexp(logp, axis=axis)


def decoded_observations(dist: Distribution, p: dict[str, Array], tables: dict, xv: Array, mv: Array | None,
                         evidence: dict | None, options) -> tuple[Array, Array | None]:
    """``(xv, mv)``, an input layer's values ``[N, B]`` and missing mask as its statistics read them: where per-call
    ``evidence`` sets the value a missing variable decodes to per node and sample
    (:meth:`Distribution.decoded_under_evidence`, hard EM), the missing entries at those values and ``mv`` None (all
    observed); else unchanged. ``tables``: the layer's tables (``"rows"``, ``"vars"``, ``"meta"``)."""
    if mv is None or not evidence:
        return xv, mv
    dec = dist.decoded_under_evidence(p, tables["meta"], tables["rows"], tables["vars"], evidence, options)
    if dec is None:
        return xv, mv
    return jnp.where(mv, dec.astype(xv.dtype), xv), None


def blend(old: Array, new: Array, step_size) -> Array:
    return (1.0 - step_size) * old + step_size * new


def has_mass(total: Array) -> Array:
    """Where a node's ``total`` (flows and pseudocount) moves its parameters: ``total > 0``, and NaN. Only a total of
    exactly 0 means "no mass" (the node is uniform, or keeps its parameters); a NaN in the flows makes NaN parameters,
    which the parameter checks report, never a silent keep."""
    return ~(total <= 0)
