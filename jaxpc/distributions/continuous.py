"""Gaussian and discretized logistic leaves.

Both keep ``{"mu": [P], "log_scale": [P]}`` internally and are fitted by EM from the
flow-weighted moments ``(sum F, sum F x, sum F x^2)`` of their node flows ``F`` and the second
moment about the current mean, ``sum F (x - mu)^2``, from which the M-step takes the variance.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from .base import Distribution, blend, has_mass, reduce_missing, segment_sum

_LOG_2PI = math.log(2.0 * math.pi)
_SIGMA_RTOL = 1e-5  # how far below Gaussian.min_sigma a given sigma may sit: float32 rounding of exp(log_scale)


def _finite_real(v) -> bool:
    """Whether ``v`` is a finite real number (a Python or NumPy number, not a bool)."""
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_)) and math.isfinite(v)


def _positive_real(v) -> bool:
    """Whether ``v`` is a finite real number > 0 (a Python or NumPy number, not a bool)."""
    return _finite_real(v) and v > 0


def _moments(values, mu, var, rows, mv, flows, num_rows):
    """Flow-weighted moments per row: ``s0 = sum F``, ``s1 = sum F x``, ``s2 = sum F x^2`` and ``m2 = sum F (x -
    mu)^2`` about each node's current mean ``mu`` (``[N]``, with variance ``var``). The M-step reads its variance from
    ``m2``: a float32 ``s2`` of values far from zero loses it (values 1e4 +- 1: ``s2 / s0 - mean^2`` is rounding
    noise), ``m2`` keeps it once ``mu`` is near the mean. A marginalized value contributes the current
    distribution's own moments."""
    dev = values - mu[:, None]
    if mv is not None:
        values = jnp.where(mv, mu[:, None], values)
        sq = jnp.where(mv, (mu * mu + var)[:, None], values * values)
        dsq = jnp.where(mv, var[:, None], dev * dev)
    else:
        sq, dsq = values * values, dev * dev
    def total(v):  # a sample of no flow adds nothing, also where its square overflows (|x| > 1.8e19 in float32);
        # masked on the value, not the flow, so the moments stay linear in the flows (their derivative in a flow of
        # 0 is the value)
        return segment_sum(jnp.sum(jnp.where((flows == 0) & ~jnp.isfinite(v), 0.0, flows * v), axis=1), rows,
                           num_rows)

    return {"s0": total(1.0), "s1": total(values), "s2": total(sq), "m2": total(dsq)}


def _moment_update(mu, var, stats, pseudocount, min_std):
    """M-step from moments, with ``pseudocount`` pseudo-observations drawn from the current fit: the new variance is
    the second moment about the current mean less the squared shift of the mean,
    ``(m2 + c var) / (s0 + c) - (mu' - mu)^2`` (``= E[x^2] - mu'^2``)."""
    s0 = stats["s0"] + pseudocount
    ok = has_mass(s0)
    safe = jnp.where(ok, s0, 1.0)
    new_mu = (stats["s1"] + pseudocount * mu) / safe
    shift = new_mu - mu
    new_var = (stats["m2"] + pseudocount * var) / safe - shift * shift
    new_std = jnp.sqrt(jnp.maximum(new_var, min_std * min_std))
    return jnp.where(ok, new_mu, mu), jnp.where(ok, new_std, jnp.sqrt(var))


class Gaussian(Distribution):
    """Normal density with mean ``mu`` and standard deviation ``sigma >= min_sigma``.

    ``Gaussian(mu=None, sigma=None, min_sigma=0.01)``: ``mu`` and ``sigma`` give the data's approximate mean and
    standard deviation (PyJuice's names), the scale of the random initialization: each node draws its mean from
    ``N(mu, sigma^2)`` and its standard deviation from ``sigma * U[0.5, 1.5)``, lifted to ``min_sigma`` (defaults 0
    and 1). Natural params: ``{"mu": [num_nodes], "sigma": [num_nodes]}``; a given ``sigma`` below ``min_sigma`` is
    an error.
    EM: ``mu' = (S1 + c mu) / (S0 + c)``, ``sigma'^2 = (M2 + c sigma^2) / (S0 + c) - (mu' - mu)^2`` with ``M2 =
    sum F (x - mu)^2`` (which equals ``(S2 + c (mu^2 + sigma^2)) / (S0 + c) - mu'^2``), clipped at ``min_sigma``, then
    ``mu, sigma`` blended with the step size.
    """

    name = "gaussian"
    discrete = False
    natural_fields = ("mu", "sigma")
    stat_fields = ("s0", "s1", "s2", "m2")

    def __init__(self, mu: float | None = None, sigma: float | None = None, min_sigma: float = 0.01):
        if mu is not None and not _finite_real(mu):
            raise ValueError(f"Gaussian: mu (the data's approximate mean) must be a finite float or None, got {mu!r}")
        if sigma is not None and not _positive_real(sigma):
            raise ValueError(f"Gaussian: sigma (the data's approximate standard deviation) must be a positive finite "
                             f"float or None, got {sigma!r}")
        if not _positive_real(min_sigma):
            raise ValueError(f"Gaussian: min_sigma must be a positive finite float, got {min_sigma!r}")
        self.mu = None if mu is None else float(mu)
        self.sigma = None if sigma is None else float(sigma)
        self.min_sigma = float(min_sigma)

    def config(self):
        return (self.mu, self.sigma, self.min_sigma)

    def __repr__(self):
        hints = "".join(f"{k}={v}, " for k, v in (("mu", self.mu), ("sigma", self.sigma)) if v is not None)
        return f"Gaussian({hints}min_sigma={self.min_sigma})"

    def _check_natural(self, natural, num_nodes, where):
        if set(natural) != {"mu", "sigma"}:
            raise ValueError(f"{where}: Gaussian params need both 'mu' and 'sigma'")
        for k in ("mu", "sigma"):
            if natural[k].shape != (num_nodes,):
                raise ValueError(f"{where}: Gaussian {k} must have shape [{num_nodes}], got {natural[k].shape}")
            if not np.all(np.isfinite(natural[k])):
                raise ValueError(f"{where}: Gaussian {k} must be finite")
        sigma = natural["sigma"]
        if np.any(sigma <= 0):
            raise ValueError(f"{where}: Gaussian sigma must be positive")
        # sigmas read back from float32 parameters may sit a rounding error below min_sigma: those are lifted to it
        low = np.nonzero(sigma < self.min_sigma * (1.0 - _SIGMA_RTOL))[0]
        if low.size:
            raise ValueError(f"{where}: Gaussian sigma must be >= min_sigma={self.min_sigma}, got "
                             f"{sigma[low[:5]].tolist()} at node(s) {low[:5].tolist()}"
                             f"{f' (and {low.size - 5} more)' if low.size > 5 else ''}; lower min_sigma or raise sigma")
        return natural

    def natural_to_internal(self, natural):
        return {"mu": natural["mu"], "log_scale": np.log(np.maximum(natural["sigma"], self.min_sigma))}

    def init(self, rs, num_rows, tables):
        loc = 0.0 if self.mu is None else self.mu
        scale = 1.0 if self.sigma is None else self.sigma
        sigma = rs.xp.maximum(scale * rs.uniform((num_rows,), 0.5, 1.5), self.min_sigma)
        return {"mu": loc + scale * rs.normal((num_rows,)), "log_scale": rs.xp.log(sigma)}

    def internal_to_natural(self, p, tables):
        return {"mu": p["mu"], "sigma": jnp.exp(p["log_scale"])}

    def log_prob(self, p, tables, rows, xv, mv, options):
        mu = p["mu"][rows][:, None]
        ls = p["log_scale"][rows][:, None]
        x = xv.astype(mu.dtype)
        if mv is not None:
            x = jnp.where(mv, mu, x)
        z = (x - mu) * jnp.exp(-ls)
        out = -0.5 * z * z - ls - 0.5 * _LOG_2PI
        if mv is not None:
            if options.propagation == "MPE":
                marg = -ls - 0.5 * _LOG_2PI  # the density's maximum
            elif options.propagation == "GeneralLL":
                a = options.alpha  # (1/a) log int N(x)^a dx
                marg = ((1.0 - a) * (ls + 0.5 * _LOG_2PI) - 0.5 * math.log(a)) / a
            else:
                marg = jnp.zeros_like(ls)
            out = jnp.where(mv, marg, out)
        return out

    def log_pmf(self, p, tables, rows, num_values):
        raise TypeError("Gaussian leaves are continuous: they have no pmf (no soft evidence or conditionals)")

    def log_prob_soft(self, p, tables, rows, logq, options):
        raise TypeError("soft evidence needs discrete variables, but a Gaussian leaf was given soft evidence")

    def sample(self, key, p, tables, prow, num_values):
        return p["mu"][prow] + jnp.exp(p["log_scale"][prow]) * jax.random.normal(key, prow.shape, p["mu"].dtype)

    def mode(self, p, tables, prow, num_values):
        return p["mu"][prow]

    def marginalized_params(self, p, options):
        """Under ``propagation="MPE"``, a point mass at each node's mean (the value max-product decoding takes for a
        missing variable: no variance); else ``p``."""
        if options.propagation != "MPE":
            return p
        return {**p, "log_scale": jnp.full_like(p["log_scale"], -jnp.inf)}

    def suff_stats(self, p, tables, rows, xv, mv, flows, num_rows):
        mu = p["mu"][rows]
        var = jnp.exp(2.0 * p["log_scale"][rows])
        return _moments(xv.astype(flows.dtype), mu, var, rows, mv, flows, num_rows)

    def em_update(self, p, tables, stats, step_size, pseudocount):
        mu, sigma = p["mu"], jnp.exp(p["log_scale"])
        new_mu, new_sigma = _moment_update(mu, sigma * sigma, stats, pseudocount, self.min_sigma)
        return {"mu": blend(mu, new_mu, step_size), "log_scale": jnp.log(blend(sigma, new_sigma, step_size))}


class DiscreteLogistic(Distribution):
    """A logistic distribution discretized into ``num_cats`` equal bins over ``val_range``.

    Value ``i`` is the bin ``[lo + i w, lo + (i + 1) w)`` with ``w = (hi - lo) / num_cats``; the first
    and last bins extend to -inf and +inf, so the bins sum to one. The bin mass is computed as
    ``log sigmoid(b) + log sigmoid(-a) + log(-expm1(a - b))`` with ``a, b`` the standardized bin
    edges, which never subtracts two close CDF values.

    Natural params: ``{"mu": [num_nodes], "s": [num_nodes]}`` (location, scale).
    EM (moment matching on bin centers, as PyJuice does): mean and standard deviation of the
    flow-weighted bin centers, ``s = max(std, min_std) * sqrt(3) / pi``. A missing value counts the current
    distribution's moments; under hard EM (``propagation="MPE"``), the center of the node's first most probable bin
    (the value ``mpe`` decodes), as that bin observed counts.
    """

    name = "discrete_logistic"
    natural_fields = ("mu", "s")
    stat_fields = ("s0", "s1", "s2", "m2")

    def __init__(self, val_range: tuple[float, float], num_cats: int, min_std: float = 0.01):
        pair = (not isinstance(val_range, (str, bytes)) and hasattr(val_range, "__len__") and len(val_range) == 2
                and all(_finite_real(v) for v in val_range))
        if not (pair and float(val_range[1]) > float(val_range[0])):
            raise ValueError(f"DiscreteLogistic: val_range must be finite (lo, hi) with hi > lo, got {val_range!r}")
        lo, hi = float(val_range[0]), float(val_range[1])
        if not isinstance(num_cats, (int, np.integer)) or isinstance(num_cats, bool) or num_cats < 2:
            raise ValueError(f"DiscreteLogistic: num_cats must be an int >= 2, got {num_cats!r}")
        if not _positive_real(min_std):
            raise ValueError(f"DiscreteLogistic: min_std must be a positive finite float, got {min_std!r}")
        self.lo, self.hi, self.num_cats, self.min_std = lo, hi, int(num_cats), float(min_std)
        self.width = (hi - lo) / self.num_cats

    def config(self):
        return (self.lo, self.hi, self.num_cats, self.min_std)

    def __repr__(self):
        return f"DiscreteLogistic(val_range=({self.lo}, {self.hi}), num_cats={self.num_cats}, min_std={self.min_std})"

    def value_range(self):
        return (0, self.num_cats)

    def _check_natural(self, natural, num_nodes, where):
        if set(natural) != {"mu", "s"}:
            raise ValueError(f"{where}: DiscreteLogistic params need both 'mu' and 's'")
        for k in ("mu", "s"):
            if natural[k].shape != (num_nodes,) or not np.all(np.isfinite(natural[k])):
                raise ValueError(f"{where}: DiscreteLogistic {k} must be finite with shape [{num_nodes}]")
        if np.any(natural["s"] <= 0):
            raise ValueError(f"{where}: DiscreteLogistic s must be positive")
        return natural

    def natural_to_internal(self, natural):
        return {"mu": natural["mu"], "log_scale": np.log(natural["s"])}

    def init(self, rs, num_rows, tables):
        mu = rs.uniform((num_rows,), self.lo, self.hi)
        s = (self.hi - self.lo) / 4.0 * rs.uniform((num_rows,), 0.5, 1.5)
        return {"mu": mu, "log_scale": rs.xp.log(s)}

    def internal_to_natural(self, p, tables):
        return {"mu": p["mu"], "s": jnp.exp(p["log_scale"])}

    def _bin_logp(self, mu, log_s, xi):
        """log P(bin xi) for broadcastable ``mu``, ``log_s`` and int ``xi``."""
        inv_s = jnp.exp(-log_s)
        lo_edge = self.lo + xi * self.width
        a = jnp.where(xi <= 0, -jnp.inf, (lo_edge - mu) * inv_s)
        b = jnp.where(xi >= self.num_cats - 1, jnp.inf, (lo_edge + self.width - mu) * inv_s)
        gap = jnp.where((xi <= 0) | (xi >= self.num_cats - 1), -jnp.inf, -self.width * inv_s)
        return jax.nn.log_sigmoid(b) + jax.nn.log_sigmoid(-a) + jnp.log(-jnp.expm1(gap))

    def _centers(self, xi, dtype):
        return (self.lo + (xi.astype(dtype) + 0.5) * self.width)

    def log_prob(self, p, tables, rows, xv, mv, options):
        mu = p["mu"][rows]
        ls = p["log_scale"][rows]
        xi = xv.astype(jnp.int32)
        if mv is not None:
            xi = jnp.where(mv, 0, xi)
        out = self._bin_logp(mu[:, None], ls[:, None], jnp.clip(xi, 0, self.num_cats - 1))
        out = jnp.where((xi < 0) | (xi >= self.num_cats), jnp.nan, out)
        if mv is not None:
            if options.propagation == "LL":
                marg = jnp.zeros_like(mu)
            else:
                allbins = self._bin_logp(mu[:, None], ls[:, None], jnp.arange(self.num_cats)[None, :])
                marg = reduce_missing(allbins, options)
            out = jnp.where(mv, marg[:, None], out)
        return out

    def log_pmf(self, p, tables, rows, num_values):
        bins = jnp.arange(num_values)[None, :]
        lp = self._bin_logp(p["mu"][rows][:, None], p["log_scale"][rows][:, None], jnp.clip(bins, 0, self.num_cats - 1))
        return jnp.where(bins < self.num_cats, lp, -jnp.inf)

    def marginalized_params(self, p, options):
        """Under ``propagation="MPE"``, ``p`` with each row's first most probable bin under ``"decoded"`` (the value
        max-product decoding takes for a missing variable), which :meth:`suff_stats` counts as that bin observed: its
        center, with no spread (the moments stay about the current mean, so no ``mu`` and scale can stand for it);
        else ``p``."""
        if options.propagation != "MPE":
            return p
        bins = jnp.arange(self.num_cats)[None, :]
        decoded = jnp.argmax(self._bin_logp(p["mu"][:, None], p["log_scale"][:, None], bins), axis=1)
        return {**p, "decoded": decoded.astype(jnp.int32)}

    def suff_stats(self, p, tables, rows, xv, mv, flows, num_rows):
        mu = p["mu"][rows]
        var = (jnp.exp(p["log_scale"][rows]) * math.pi) ** 2 / 3.0
        xi = jnp.clip(xv.astype(jnp.int32), 0, self.num_cats - 1)
        if mv is not None and "decoded" in p:  # a missing value counts as its decoded bin observed
            xi = jnp.where(mv, p["decoded"][rows][:, None], xi)
            mv = None
        return _moments(self._centers(xi, flows.dtype), mu, var, rows, mv, flows, num_rows)

    def em_update(self, p, tables, stats, step_size, pseudocount):
        mu, s = p["mu"], jnp.exp(p["log_scale"])
        var = (s * math.pi) ** 2 / 3.0
        new_mu, new_std = _moment_update(mu, var, stats, pseudocount, self.min_std)
        new_s = new_std * math.sqrt(3.0) / math.pi
        return {"mu": blend(mu, new_mu, step_size), "log_scale": jnp.log(blend(s, new_s, step_size))}
