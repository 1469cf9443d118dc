"""Flax NNX integration (``pip install flax``): a compiled circuit as an ``nnx.Module``.

:class:`CircuitModule` holds a compiled :class:`jaxpc.Circuit` (static: its structure never changes)
and the circuit's parameters as ``nnx.Param`` leaves (``module.params["sum"][group]``,
``module.params["input"][layer][field]``); the index tables ride along as a non-trainable
:class:`CircuitTables` variable, so jitted code receives them as arguments instead of constants.

The parameters are treated as *logits*: the forward renormalizes them (:func:`jaxpc.optim.normalize`),
so any optax optimizer driven by ``nnx.Optimizer`` keeps the circuit a normalized distribution, and
the module composes with other layers (e.g. an ``nnx.Linear`` producing soft evidence)::

    class Model(nnx.Module):
        def __init__(self, circuit, rngs):
            self.enc = nnx.Linear(F, V * K, rngs=rngs)
            self.pc = jaxpc.nn.CircuitModule(circuit)
        def __call__(self, feats):
            q = jax.nn.softmax(self.enc(feats).reshape(-1, V, K))   # soft evidence [B, V, K]
            return self.pc(soft_evidence=q)                          # log sum_x p(x) prod_v q[v, x_v]

    model = Model(circuit, nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

EM works on the module too (:meth:`CircuitModule.em_step`), in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import checks
from .engine import em as em_engine
from .optim.normalize import normalize_params, normalized_log_prob
from .options import Options
from .runtime import Batch, declare_entries

Array = jax.Array

__all__ = ["CircuitModule", "CircuitTables"]


def _log_prob_impl(layout, tables, params, x, missing, soft, evidence=None, *, options, normalize):
    return normalized_log_prob(layout, tables, params, x, missing, options, normalize=normalize, soft=soft,
                               evidence=evidence)


def _em_step_impl(layout, tables, params, x, missing, weights, step_size, pseudocount, evidence=None, *, options,
                  normalize):
    p = normalize_params(layout, tables, params) if normalize else params
    fl, ll = em_engine.flows_and_ll(layout, tables, p, x, missing, weights, options, evidence)
    return em_engine.em_update(layout, tables, p, fl, step_size, pseudocount, options.compute_param_flows), ll


# name -> (pure function, batch axis of each output); run through the circuit's runtime (jaxpc.runtime):
# inlined under nnx.jit / grad, a cached executable when called eagerly
_ENTRIES = {"nn.log_prob": (_log_prob_impl, 0), "nn.em_step": (_em_step_impl, (None, 0))}
declare_entries(*_ENTRIES)


def _run(circuit, name, static, args, batch, **kw):
    circuit.runtime.entry(name, *_ENTRIES[name], circuit.layout)
    return circuit.runtime.run(name, static, args, batch, **kw)


class CircuitTables(nnx.Variable):
    """The circuit's ``int32`` index tables: state, never trained (not an ``nnx.Param``)."""


def _wrap(tree):
    if isinstance(tree, dict):
        return nnx.Dict({k: _wrap(v) for k, v in tree.items()})
    return nnx.Param(tree)


def _unwrap(d) -> dict | Array:
    if isinstance(d, nnx.Variable):
        return d.get_value()
    return {k: _unwrap(v) for k, v in d.items()}


def _assign(d, tree) -> None:
    for k, v in tree.items():
        if isinstance(v, dict):
            _assign(d[k], v)
        else:
            d[k].set_value(v)


class CircuitModule(nnx.Module):
    """A probabilistic circuit as a Flax NNX module.

    Args:
        circuit: a compiled :class:`jaxpc.Circuit` (kept as static structure).
        params: its parameters (default ``circuit.params``), stored as ``nnx.Param`` leaves.
        normalize: treat the parameters as logits and renormalize them in every forward (default; needed for
            gradient training). With False they are used as they are (they must be normalized).
        options: :class:`jaxpc.Options` of every call of the module, the forward and :meth:`em_step` (e.g.
            ``precision``, ``impl``, ``tuning``; with ``propagation="MPE"`` the forward is max-product and the EM step
            hard (Viterbi) EM, as for :meth:`jaxpc.Circuit.em_step`).
    """

    def __init__(self, circuit, params: dict | None = None, *, normalize: bool = True,
                 options: Options | None = None):
        from .circuit import Circuit

        if not isinstance(circuit, Circuit):
            raise TypeError(f"CircuitModule: circuit must be a jaxpc.Circuit, got {type(circuit).__name__}")
        p = circuit.params if params is None else params
        checks.check_params(circuit.runtime.params_spec, p)
        self.circuit = circuit
        self.normalize = bool(normalize)
        self.options = Options.make(options)
        self.params = _wrap(p)
        self.tables = CircuitTables(circuit.tables)

    # ---- parameters --------------------------------------------------------------------------------
    def raw_params(self) -> dict:
        """The stored parameter values (logits when ``normalize``) as a plain ``circuit.params``-shaped pytree."""
        return _unwrap(self.params)

    def get_params(self) -> dict:
        """Normalized parameters, usable with every :class:`jaxpc.Circuit` method and query."""
        p = self.raw_params()
        return normalize_params(self.circuit.layout, self.tables.get_value(), p) if self.normalize else p

    def set_params(self, params: dict) -> None:
        """Overwrite the stored parameters (in place); a ``ValueError`` where ``params`` have another structure or
        leaf shape than ``circuit.params`` (:meth:`jaxpc.Circuit.check_params`' check, without reading values)."""
        checks.check_params(self.circuit.runtime.params_spec, params)
        _assign(self.params, params)

    # ---- evaluation --------------------------------------------------------------------------------
    def __call__(self, x=None, missing=None, *, soft_evidence=None, evidence=None) -> Array:
        """Log-likelihoods ``[B]``.

        Args:
            x: ``[B, V]`` hard evidence, with ``missing`` (``bool[V]`` or ``bool[B, V]``) marking marginalized
                variables; or
            soft_evidence: ``[B, V, K]`` non-negative weights ``q``: returns ``log sum_x p(x) prod_v q[b, v, x_v]``
                (all-ones rows marginalize a variable, one-hot rows are hard evidence). Differentiable in ``q``.
                Its values are checked as :meth:`jaxpc.Circuit.marginal` checks them: a host (numpy) array's at once,
                a device array's on the device (the circuit's next call raises); traced ones (under ``nnx.jit``) are
                not, and a negative or non-finite weight gives its row NaN.
            evidence: per-call evidence with ``x`` (soft evidence leaves, ``External`` leaves, latent potentials,
                per-sample sum parameters), as for :meth:`jaxpc.Circuit.log_prob` and checked as there; traced (new
                evidence never recompiles) and differentiable.
        """
        c = self.circuit
        tables = self.tables.get_value()
        raw = self.raw_params()
        if soft_evidence is not None:
            if x is not None or missing is not None or evidence is not None:
                raise ValueError("CircuitModule: give either x (with missing and evidence) or soft_evidence, not both")
            q = checks.check_soft_evidence(c.runtime.var_info, soft_evidence, "CircuitModule")
            if isinstance(q, np.ndarray):
                checks.raise_bad_soft(q, "CircuitModule", "checked on the host")
            qj = jnp.asarray(q).astype(c.dtype)
            traced = isinstance(qj, jax.core.Tracer)
            batch = Batch(jnp.zeros(q.shape[:2], jnp.int32), None, int(q.shape[0]), check=False, report=False,
                          sync=False, traced=traced)
            out = _run(c, "nn.log_prob", {"normalize": self.normalize},
                       {"tables": tables, "params": raw, "soft": qj},
                       batch, options=self.options, batched={"soft": 0})
            if checks.is_device_array(q):
                # its values were not seen on the host: flagged now, raised by the circuit's next call
                c.runtime.record_check("nn_soft_evidence_flag", checks.any_bad_soft, {"q": q},
                                       lambda: checks.explain_bad_soft(q, "CircuitModule"),
                                       sync=False)
            return out
        if x is None:
            raise ValueError("CircuitModule: needs x (hard evidence) or soft_evidence")
        batch = c.runtime.prepare(x, missing, True)
        ev, record = c.prepare_evidence(evidence, batch, "CircuitModule")
        out = _run(c, "nn.log_prob", {"normalize": self.normalize},
                   {"tables": tables, "params": raw, "soft": None, "evidence": ev},
                   batch, options=self.options, batched={"evidence": 0})
        record()
        return out

    # ---- EM ------------------------------------------------------------------------------------------
    def em_step(self, x, missing=None, *, step_size=1.0, pseudocount=0.0, ll_weights=None, evidence=None) -> Array:
        """One mini-batch EM step on the module's parameters, in place (works under ``nnx.jit``).

        The flows are those of the normalized parameters, under the module's options; the module then holds the
        EM parameters (normalized). ``step_size`` in ``(0, 1]`` and ``pseudocount >= 0`` are checked as
        :meth:`jaxpc.Circuit.em_step` checks them (finite; traced values pass). Returns the batch's log-likelihoods
        ``[B]`` before the step.

        ``x`` ``[B, V]`` with ``missing`` (``bool[V]`` or ``bool[B, V]``, True: marginalized; default None) as for
        :meth:`__call__`, checked as :meth:`jaxpc.Circuit.em_step` checks them with ``validate=True`` (numpy values
        at once, a device array's by the circuit's next call; traced ones under ``nnx.jit`` not at all).
        ``ll_weights``: optional ``[B]`` per-sample weights of the expected counts (default None: all 1), finite and
        >= 0, checked as for :meth:`jaxpc.Circuit.em_step` (a wrong shape is a ``ValueError``). ``evidence``:
        per-call evidence as for :meth:`__call__` (default None)."""
        em_engine.check_em_options(self.options, "CircuitModule.em_step")
        c = self.circuit
        step, pseudo = c.runtime.em_scalars(step_size, pseudocount)
        batch = c.runtime.prepare(x, missing, True)
        ev, record = c.prepare_evidence(evidence, batch, "CircuitModule.em_step")
        w = c.runtime.weights(ll_weights, batch.n, nonnegative=True)
        new, ll = _run(c, "nn.em_step", {"normalize": self.normalize},
                       {"tables": self.tables.get_value(), "params": self.raw_params(),
                        "step_size": step, "pseudocount": pseudo, "evidence": ev},
                       batch, options=self.options, weights=w, batched={"evidence": 0})
        record()
        c.runtime.weights_check(ll_weights, w, batch, True, "CircuitModule.em_step")()
        self.set_params(new)
        return ll
