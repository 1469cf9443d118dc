"""EM as optax-style gradient transformations, so EM and gradient training share one loop.

Convention. An optax transformation maps *gradients* to *updates*. An EM transformation maps
*flows* to updates: the "updates" fed into ``update`` are the expected counts of the current
parameters, ``circuit.flows(params, x)`` or ``jaxpc.engine.em.flows_and_ll(...)[0]`` (a pytree
shaped like ``params``), and what comes out are deltas that ``optax.apply_updates(params, updates)``
adds to the parameters::

    tx = jaxpc.optim.em(circuit, step_size=0.1, pseudocount=0.1)   # or optax.adam(1e-2)
    state = tx.init(params)
    flows = circuit.flows(params, x)                                # or jax.grad(loss)(params)
    updates, state = tx.update(flows, state, params)
    params = optax.apply_updates(params, updates)

Deltas are ``new - old`` (0 where both are equal, e.g. a ``-inf`` zero weight that stays zero), so
the sum reproduces the EM parameters up to one float rounding per entry. :func:`apply` returns the
EM parameters themselves, with no delta in between: the update ``circuit.em_update`` makes of the same
flows. ``circuit.em_step`` computes its flows and update in one executable, where XLA fuses the two, so its
parameters equal these up to float rounding (an ulp in a few entries), not bit for bit. :func:`apply` runs
any optax transformation the usual way, so one loop serves both::

    params, state = jaxpc.optim.apply(tx, feed, state, params)

The one thing deltas cannot express is a zero weight (``-inf``) that EM revives (a weight set to 0 at
construction with ``pseudocount > 0``): its delta is ``+inf`` and ``apply_updates`` gives NaN; use
:func:`apply` (or ``fit``) there.

EM reads the parameter flows, ``flows["sum"]`` and ``flows["input"]``: the node totals that
``Options(node_flows=True)`` adds under ``"node"`` are ignored (and not accumulated by :func:`full_batch_em`).

Variants:

* :func:`em`: mini-batch EM, ``theta <- (1 - s_t) theta + s_t normalize(flows + pseudocount)`` with
  a constant step size or a schedule ``s_t = step_size(t)`` (any ``count -> float`` callable,
  e.g. ``optax.linear_schedule``: step-size annealing).
* :func:`full_batch_em`: accumulate the flows of ``num_batches`` updates, then one EM update (and
  zero deltas in between): full-batch EM over an epoch of ``num_batches`` mini-batches.
* :func:`anemone`: mini-batch EM with a per-node step size (after Liu, Shao & Van den Broeck,
  "Rethinking Probabilistic Circuit Parameter Learning", 2025). Our reading of the method: each node
  solves the EM objective of the batch linearized around the current parameters with a KL
  proximity term ``(B / eta) KL(theta_n || theta_n')``; the closed form is a blend with the node's own
  step ``s_n = eta t_n / (1 + eta t_n)``, ``t_n = (F_n + pseudocount) / B`` the node's mean top-down
  probability (its flow per sample). Nodes the batch barely reaches move little, nodes every sample
  passes through move with ``eta / (1 + eta)``; ``eta`` may be a schedule (annealing). This is written
  from the paper's description, not checked against the authors' code.

**Schedules' values.** A constant step size is checked when the transformation is made, a schedule's values as the
updates use them: EM's (:func:`em`, :func:`full_batch_em`) must lie in ``[0, 1]``, :func:`anemone`'s ``eta`` must be
finite and ``>= 0`` (NaN is neither); 0, e.g. the start of a warm-up, keeps the parameters (up to the rounding of
their logarithms). ``fit`` evaluates the schedule at every count its updates will use before it trains and raises a
``ValueError`` naming the first bad count and value (:func:`check_schedule`). An update whose value breaks the rule
makes every parameter NaN (:func:`em_apply`, so also inside a ``jit`` of your own, where nothing can raise);
``update`` and ``step`` called outside a trace also check the value on the device, as the circuit checks a device
batch's values (:mod:`jaxpc.runtime`): the circuit's next call (its ``flows``, ``raise_pending()``, or the
transformation's next ``update``/``step``) raises the ``ValueError``. Pseudocounts are floats, not schedules.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import checks
from ..circuit import Circuit
from ..distributions.base import blend, log_weights
from ..engine import em as em_engine
from ..options import Options

_LL = Options()

Array = jax.Array

__all__ = ["EMTransformation", "EMState", "FullBatchEMState", "em", "full_batch_em", "anemone", "apply",
           "apply_updates", "deltas", "check_schedule"]


class EMState(NamedTuple):
    """State of :func:`em` and :func:`anemone`: ``count``, the number of updates done (``int32[]``)."""

    count: Array


class FullBatchEMState(NamedTuple):
    """State of :func:`full_batch_em`: ``count``, the updates seen (``int32[]``), and ``flows``, the flows
    accumulated since the last EM update (a pytree shaped like ``params``)."""

    count: Array
    flows: Any


@dataclasses.dataclass(frozen=True, eq=False)
class EMConfig:
    """Static description of an EM transformation (hashable by identity).

    Attributes:
        kind: ``"em"`` (:func:`em`), ``"full_batch"`` (:func:`full_batch_em`) or ``"anemone"`` (:func:`anemone`).
        step_size: a float, or a schedule ``count -> float``.
        pseudocount: added to the counts (a float >= 0).
        num_batches: batches accumulated per update (``"full_batch"``; 1 otherwise).
        root: ``(group, start, num_edge_blocks)`` of the root sum vector's parameter blocks, from which
            ``"anemone"`` reads the batch's size; None where the root is not a sum.
        layout: the circuit's layout (a transformation belongs to one circuit structure).
    """

    kind: str  # "em" | "full_batch" | "anemone"
    step_size: Any  # float or callable count -> float
    pseudocount: float
    num_batches: int = 1
    root: tuple | None = None  # (group, start, num_edge_blocks) of the root sum, for anemone's batch size
    layout: Any = None  # the circuit's layout (a transformation belongs to one circuit structure)


class EMTransformation(NamedTuple):
    """An EM optimizer with optax's ``init``/``update`` protocol plus a ``step`` that returns the new parameters.

    Attributes:
        init: ``params -> state``.
        update: ``(flows, state, params, *, num_samples=None) -> (deltas, state)`` (optax protocol).
        step: ``(flows, state, params, *, num_samples=None) -> (new_params, state)``: the EM parameters themselves,
            with no delta's rounding.
        config: the static :class:`EMConfig` (also names the circuit's layout).
    """

    init: Callable
    update: Callable
    step: Callable
    config: EMConfig


def check_circuit(circuit, where: str) -> None:
    """Raise a ``TypeError`` naming ``where`` unless ``circuit`` is a compiled :class:`jaxpc.Circuit` (e.g. its params
    were passed in its place)."""
    if not isinstance(circuit, Circuit):
        hint = "; pass the compiled circuit (what jaxpc.compile returns), not its params" if isinstance(
            circuit, dict) else ""
        raise TypeError(f"{where}: circuit must be a jaxpc.Circuit, got {type(circuit).__name__}{hint}")


def _check_schedule(step_size, where: str) -> None:
    """Raise where the schedule ``step_size`` does not map the update count (an ``int32`` scalar, traced: the updates
    run under ``jit``) to a float scalar: its shapes are traced once, nothing is evaluated (its values are checked
    as the updates use them, see the module docstring)."""
    try:
        out = jax.eval_shape(step_size, jax.ShapeDtypeStruct((), jnp.int32))
    except Exception as e:  # any failure of the user's function: raised again, naming its cause
        raise TypeError(f"{where}: step_size is a schedule count -> float, but calling it on a traced int32 count "
                        f"failed: {type(e).__name__}: {e}") from e
    shape, dtype = getattr(out, "shape", None), getattr(out, "dtype", None)
    if shape != () or not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        got = f"shape {shape} and dtype {dtype}" if shape is not None else type(out).__name__
        raise ValueError(f"{where}: a step_size schedule must return a scalar float for each count, got {got}")


def _check_args(step_size, pseudocount, where: str) -> None:
    if callable(step_size):
        _check_schedule(step_size, where)
    else:
        try:
            s = float(step_size)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{where}: step_size must be a float or a schedule count -> float, got "
                            f"{type(step_size).__name__}") from e
        if not math.isfinite(s):
            raise ValueError(f"{where}: step_size must be finite, got {step_size!r}")
        if not 0.0 < s <= 1.0 and where != "anemone":
            raise ValueError(f"{where}: step_size must be in (0, 1], got {step_size!r}")
        if where == "anemone" and not s > 0.0:
            raise ValueError(f"anemone: step_size (eta) must be positive, got {step_size!r}")
    try:
        pc = float(pseudocount)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{where}: pseudocount must be a float, got {type(pseudocount).__name__}") from e
    if not math.isfinite(pc):
        raise ValueError(f"{where}: pseudocount must be finite, got {pseudocount!r}")
    if not pc >= 0.0:
        raise ValueError(f"{where}: pseudocount must be >= 0, got {pseudocount!r}")


# a schedule's value this close outside its range is rounding (a few float32 ulps of 1), and counts as the bound
_SNAP = 16 * 2.0 ** -23


def _step_value(step_size, count: Array, dtype, kind: str = "em") -> Array:
    """The step size at ``count`` as ``dtype``; a schedule's value within :data:`_SNAP` outside ``kind``'s range
    (:func:`_step_ok`) is moved onto it (under ``jit``, ``optax.linear_schedule(0.5, 0.0, n)`` ends at -7e-9)."""
    if not callable(step_size):
        return jnp.asarray(step_size, dtype)
    s = jnp.asarray(step_size(count), dtype)
    s = jnp.where((s < 0) & (s >= -_SNAP), jnp.zeros_like(s), s)
    if kind != "anemone":
        s = jnp.where((s > 1) & (s <= 1 + _SNAP), jnp.ones_like(s), s)
    return s


def _step_ok(kind: str, s):
    """Whether the schedule's values ``s`` (NumPy or JAX) obey its rule: in ``[0, 1]`` for EM, finite and ``>= 0`` for
    anemone's ``eta`` (NaN fails both)."""
    if kind == "anemone":
        return (s >= 0) & (s < math.inf)
    return (s >= 0) & (s <= 1)


def _step_rule(kind: str) -> str:
    if kind == "anemone":
        return "anemone's step size (eta) must be finite and >= 0"
    return "an EM step size must be in [0, 1]"


def _nan_unless(ok: Array, params: dict) -> dict:
    """``params`` where ``ok`` (a scalar bool), else every float entry NaN."""
    return jax.tree_util.tree_map(
        lambda a: jnp.where(ok, a, jnp.asarray(jnp.nan, a.dtype)) if jnp.issubdtype(a.dtype, jnp.floating) else a,
        params)


def _schedule_range(config: EMConfig, count: int, num_updates: int) -> tuple[int, int]:
    """``(first, n)``: the schedule's arguments ``first .. first + n - 1`` that the ``num_updates`` updates after state
    count ``count`` pass it (full-batch EM: the EM updates among them, counted in EM updates)."""
    if config.kind != "full_batch":
        return count, num_updates
    nb = config.num_batches
    first = -(-(count + 1) // nb) - 1  # the EM update that the first multiple of nb after count makes
    return first, max((count + num_updates) // nb - first, 0)


_CHUNK = 1 << 18  # schedule values evaluated per call of the host check's executable


def _first_bad_chunk(start, n, *, fn, kind: str, dtype):
    """``(any bad, index, value)`` of the first of ``fn(start + i)``, ``i < min(n, _CHUNK)``, that breaks the rule."""
    i = jnp.arange(_CHUNK, dtype=jnp.int32)
    vals = lax.optimization_barrier(jax.vmap(lambda c: _step_value(fn, c, dtype, kind))(start + i))
    bad = ~_step_ok(kind, vals) & (i < n)
    at = jnp.argmax(bad)
    return jnp.any(bad), at, vals[at]


_first_bad_chunk_jit = jax.jit(_first_bad_chunk, static_argnames=("fn", "kind", "dtype"))


def _first_bad_step(step_size, kind: str, first: int, n: int, dtype) -> tuple[int, np.floating] | None:
    """``(argument, value)`` of the first of ``step_size(first .. first + n - 1)`` (as ``dtype``) that breaks the
    rule of ``kind``'s step size, or None: evaluated vectorized, ``_CHUNK`` arguments per call, read on the host."""
    try:
        hash(step_size)
        run = functools.partial(_first_bad_chunk_jit, fn=step_size, kind=kind, dtype=jnp.dtype(dtype))
    except TypeError:  # an unhashable schedule: compiled for this check
        run = jax.jit(functools.partial(_first_bad_chunk, fn=step_size, kind=kind, dtype=jnp.dtype(dtype)))
    with jax.transfer_guard("allow"):  # (a few scalars per chunk, read before or after the call's work)
        for start in range(first, first + n, _CHUNK):
            bad, at, value = run(jnp.asarray(start, jnp.int32), jnp.asarray(first + n - start, jnp.int32))
            if bool(bad):
                return start + int(at), np.asarray(value)[()]
    return None


def check_schedule(tx, count: int = 0, num_updates: int = 1, *, dtype=jnp.float32, where: str | None = None) -> None:
    """Raise a ``ValueError`` where the step size schedule of the EM transformation ``tx`` breaks its rule (see the
    module docstring) at one of the ``num_updates`` updates after state count ``count``; the message names the first
    such count and value. A constant step size (checked when ``tx`` was made), an optax transformation and
    ``num_updates`` 0 pass. ``dtype``: the parameters' (the values are rounded to it, as the update rounds them);
    ``where``: the caller named in the message (default: the transformation). The schedule is evaluated on the
    counts vectorized, a chunk at a time, and read on the host: ``fit`` calls it with its updates before training.
    """
    if not isinstance(tx, EMTransformation) or not callable(tx.config.step_size) or num_updates <= 0:
        return
    config = tx.config
    first, n = _schedule_range(config, int(count), int(num_updates))
    hit = _first_bad_step(config.step_size, config.kind, first, n, dtype)
    if hit is None:
        return
    k, value = hit
    name = _NAMES[config.kind]
    what = (f"EM update k={k} (the EM updates done before it)" if config.kind == "full_batch"
            else f"count {k} (the updates done before it)")
    raise ValueError(f"{where or name}: the step_size schedule of {name} returns {value!s} at {what}; "
                     f"{_step_rule(config.kind)} (0 keeps the parameters)")


def _bad_step(config: EMConfig, dtype, count: Array) -> Array:
    """Whether the update from state count ``count`` takes a schedule value that breaks its rule (a scalar bool; the
    device check of ``update``/``step``)."""
    if config.kind == "full_batch":
        after = count + 1
        s = _step_value(config.step_size, after // config.num_batches - 1, dtype, config.kind)
        return ((after % config.num_batches) == 0) & ~_step_ok(config.kind, s)
    return ~_step_ok(config.kind, _step_value(config.step_size, count, dtype, config.kind))


def _explain_step(tx, dtype, count: Array) -> None:
    """The error of an update whose device check found a bad schedule value."""
    with jax.transfer_guard_device_to_host("allow"):  # (an error's message, not the call's data path)
        c = int(np.asarray(count))
    try:
        check_schedule(tx, c, 1, dtype=dtype)
    except ValueError as e:
        raise ValueError(f"{e}; checked on the device after that update, whose parameters are NaN") from None
    raise ValueError(f"{_NAMES[tx.config.kind]}: the step_size schedule's value at count {c} was rejected by the "
                     "device check; the host check found none")


def record_step_check(runtime, tx, state, params, sync: bool = False) -> None:
    """Check the schedule's value of the update ``tx`` just made from ``state`` (its state before the update) on the
    device, as :meth:`jaxpc.runtime.Runtime.record_check` checks values: the circuit's next call raises the
    ``ValueError`` (this one with ``sync``). A constant step size, an optax transformation and a traced count pass; a
    count on the host (a Python or NumPy int) is checked here, at once. Call it right after the update is
    dispatched."""
    if not isinstance(tx, EMTransformation) or not callable(tx.config.step_size):
        return
    count = getattr(state, "count", None)
    if count is None or isinstance(count, jax.core.Tracer):
        return
    dtype = _dtype(params)
    if not checks.is_device_array(count):
        check_schedule(tx, int(np.asarray(count)), 1, dtype=dtype)
        return
    runtime.record_check(f"{_NAMES[tx.config.kind]}_step_size_flag", _step_checks(tx.config, dtype),
                         {"count": count}, functools.partial(_explain_step, tx, dtype, count), sync)


@functools.lru_cache(maxsize=256)
def _step_checks(config: EMConfig, dtype) -> Callable:
    """:func:`_bad_step` of ``config`` and ``dtype``, one function per pair (the flag's executable is cached under
    it)."""
    return functools.partial(_bad_step, config, dtype)


def _dtype(params: dict):
    leaves = [a for a in jax.tree_util.tree_leaves(params) if jnp.issubdtype(a.dtype, jnp.floating)]
    return leaves[0].dtype if leaves else jnp.float32


def _root_info(circuit) -> tuple | None:
    root = circuit.root.source
    pl = circuit.structure.sum_placement.get(root.id)
    if pl is None:
        return None
    return (pl.group, pl.start, pl.num_edge_blocks)


def _num_samples(config: EMConfig, flows: dict, num_samples) -> Array:
    if num_samples is not None:
        return jnp.asarray(num_samples)
    if config.root is None:
        raise ValueError("anemone: the root is not a sum node, so the batch size cannot be read from the flows; "
                         "pass num_samples=... to update/step")
    g, start, n = config.root
    return jnp.sum(flows["sum"][g][start:start + n])


# ---- the updates (pure) ---------------------------------------------------------------------------

def anemone_update(layout, tables, params: dict, flows: dict, eta, pseudocount, num_samples,
                   update_sums: bool = True) -> dict:
    """The per-node-step EM update of :func:`anemone` (pure).

    Args:
        layout, tables: ``circuit.layout`` and ``circuit.tables``.
        params: normalized log-parameters; flows: their expected counts on a batch of ``num_samples``
            samples (total weight); eta: the base step size (scalar); update_sums: False keeps the sum
            parameters (flows computed with ``Options(compute_param_flows=False)``).
        pseudocount: added to each node's counts (scalar >= 0; not checked here, see :func:`anemone`).
    """
    dtype = _dtype(params)
    eta = jnp.asarray(eta, dtype)
    pc = jnp.asarray(pseudocount, dtype)
    n = jnp.maximum(jnp.asarray(num_samples, dtype), jnp.finfo(dtype).tiny)

    def node_step(mass):
        t = eta * mass / n
        return t / (1.0 + t)

    targets, totals = em_engine.normalized_with_totals(layout, tables, flows["sum"], pc)  # totals: flows + pc
    new_sum = {} if update_sums else dict(params["sum"])
    for g in layout.sum_groups if update_sums else ():
        s = node_step(totals[g.key])[:, :, None]
        old = jnp.exp(params["sum"][g.key])
        new = blend(old, targets[g.key], s)
        new_sum[g.key] = log_weights(new)  # a zero parameter: -inf, with a zero (never NaN) derivative
    new_in = {}
    for spec, tab in zip(layout.input_layers, tables["inputs"]):
        stats = flows["input"][spec.key]
        if "counts" in stats:  # categorical family: [P, K]
            s = node_step(jnp.sum(stats["counts"], axis=1, keepdims=True) + pc)
        elif "s0" in stats:  # moment-matched leaves: [P]
            s = node_step(stats["s0"] + pc)
        elif not stats:  # parameter-free leaves
            s = jnp.zeros((), dtype)
        else:
            raise TypeError(f"anemone: cannot read the per-row flow of {spec.dist!r} from its statistics "
                            f"{sorted(stats)}; expected 'counts' or 's0'")
        new_in[spec.key] = spec.dist.em_update(params["input"][spec.key], tab["meta"], stats, s, pc)
    return {"sum": new_sum, "input": new_in}


def em_apply(layout, tables, config: EMConfig, flows: dict, state, params: dict, num_samples=None,
             update_sums: bool = True):
    """``(new_params, new_state)`` of an EM transformation (pure: ``tables`` may be traced): the transformation
    described by ``config`` (:class:`EMConfig`) applied to ``params`` with ``flows`` and its ``state``
    (:class:`EMState`, or :class:`FullBatchEMState` for ``"full_batch"``); ``layout``, ``tables``:
    ``circuit.layout`` and ``circuit.tables``. ``num_samples``: the batch's total weight, read by ``"anemone"`` only
    (default None: the root's flow; a ``ValueError`` where the root is not a sum node). A step size schedule's value
    outside its rule (see the module docstring) makes every parameter of the update NaN.

    The update reads the parameter flows, ``flows["sum"]`` and ``flows["input"]``; other entries (the node
    totals of ``Options(node_flows=True)``) are ignored, and :func:`full_batch_em` does not accumulate them.
    ``update_sums`` False keeps the sum parameters (flows of ``Options(compute_param_flows=False)``, whose sum
    flows are zeros: with a pseudocount they would make every sum node uniform). Log flows
    (``Options(logspace_flows=True)``, :class:`~jaxpc.engine.logflows.LogFlows`) are refused with a ``ValueError``:
    EM takes linear counts."""
    em_engine.check_linear_flows(flows, "jaxpc.optim EM update")  # (before the dict below drops their type)
    flows = {"sum": flows["sum"], "input": flows["input"]}
    dtype = _dtype(params)
    pc = jnp.asarray(config.pseudocount, dtype)
    checked = callable(config.step_size)  # (a constant was checked when the transformation was made)
    if config.kind == "em":
        s = _step_value(config.step_size, state.count, dtype, "em")
        new = em_engine.em_update(layout, tables, params, flows, s, pc, update_sums)
        return _nan_unless(_step_ok("em", s), new) if checked else new, EMState(state.count + 1)
    if config.kind == "anemone":
        eta = _step_value(config.step_size, state.count, dtype, "anemone")
        new = anemone_update(layout, tables, params, flows, eta, pc, _num_samples(config, flows, num_samples),
                             update_sums)
        return _nan_unless(_step_ok("anemone", eta), new) if checked else new, EMState(state.count + 1)
    if config.kind == "full_batch":
        acc = jax.tree_util.tree_map(jnp.add, state.flows, flows)
        count = state.count + 1
        done = (count % config.num_batches) == 0
        s = _step_value(config.step_size, count // config.num_batches - 1, dtype, "full_batch")

        def do_update(operands):
            p, a = operands
            new = em_engine.em_update(layout, tables, p, a, s, pc, update_sums)
            return (_nan_unless(_step_ok("full_batch", s), new) if checked else new,
                    jax.tree_util.tree_map(jnp.zeros_like, a))

        def keep(operands):
            return operands

        new, acc = jax.lax.cond(done, do_update, keep, (params, acc))
        return new, FullBatchEMState(count, acc)
    raise ValueError(f"unknown EM kind {config.kind!r}")


def zero_flows(layout, tables, params: dict, x_dtype=jnp.int32) -> dict:
    """Zeros shaped like the flows of ``params`` (sum groups like ``params``, input layers like their
    sufficient statistics), from the shapes alone (nothing is evaluated)."""
    x = jax.ShapeDtypeStruct((1, layout.num_vars), x_dtype)
    shapes = jax.eval_shape(lambda t, p, xx: em_engine.flows_and_ll(layout, t, p, xx, None, None, _LL)[0],
                            tables, params, x)
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def deltas(old: dict, new: dict) -> dict:
    """``new - old`` per entry, 0 where they are equal (so ``-inf`` entries that stay ``-inf`` give 0)."""
    return jax.tree_util.tree_map(lambda a, b: jnp.where(a == b, jnp.zeros_like(a), b - a), old, new)


def _deltas_and_state(new_and_state, params):
    new, state = new_and_state
    return deltas(params, new), state


def apply_updates(params: dict, updates: dict) -> dict:
    """``params + updates`` per leaf in the parameters' dtype (``optax.apply_updates`` without optax)."""
    return jax.tree_util.tree_map(lambda p, u: jnp.asarray(p + u).astype(jnp.asarray(p).dtype), params, updates)


def _make(circuit, config: EMConfig) -> EMTransformation:
    layout, tables = circuit.layout, circuit.tables
    config = dataclasses.replace(config, layout=layout)

    xdtype = jnp.int32 if circuit.runtime.var_info.all_discrete else circuit.dtype

    def init(params):
        count = jnp.zeros((), jnp.int32)
        if config.kind == "full_batch":
            return FullBatchEMState(count, zero_flows(layout, tables, params, xdtype))
        return EMState(count)

    # jitted with the tables as an argument (inlined when called inside a user's jit)
    jit_step = jax.jit(lambda t, fl, st, p, n: em_apply(layout, t, config, fl, st, p, n))
    jit_update = jax.jit(lambda t, fl, st, p, n: _deltas_and_state(em_apply(layout, t, config, fl, st, p, n), p))

    name = _NAMES[config.kind]
    runtime = circuit.runtime
    tx = None  # this transformation (made below), which the schedule's device check names
    state_type = FullBatchEMState if config.kind == "full_batch" else EMState

    def check(flows, state):
        if not (isinstance(flows, dict) and "sum" in flows and "input" in flows):
            raise ValueError(f"{name}: flows must be the expected counts of circuit.flows(params, x) (a dict with "
                             f"'sum' and 'input'), got {type(flows).__name__}"
                             f"{' with keys ' + str(sorted(flows)) if isinstance(flows, dict) else ''}")
        if not isinstance(state, state_type):
            raise ValueError(f"{name}: state must be this optimizer's {state_type.__name__} (its init(params), then "
                             f"the state its previous update returned), got {type(state).__name__}")

    def checked_run(fn, flows, state, params, num_samples):
        out = fn(tables, flows, state, params, num_samples)
        if callable(config.step_size):  # the earlier updates' flags, read while this one runs; then this one's
            runtime.raise_pending()
            record_step_check(runtime, tx, state, params)
        return out

    def step(flows, state, params, *, num_samples=None, **_):
        check(flows, state)
        return checked_run(jit_step, flows, state, params, num_samples)

    def update(flows, state, params=None, *, num_samples=None, **_):
        if params is None:
            raise ValueError("EM transformations need params: call update(flows, state, params)")
        check(flows, state)
        return checked_run(jit_update, flows, state, params, num_samples)

    tx = EMTransformation(init, update, step, config)
    return tx


_NAMES = {"em": "em", "full_batch": "full_batch_em", "anemone": "anemone"}


def em(circuit, step_size=0.1, pseudocount: float = 0.0) -> EMTransformation:
    """Mini-batch EM: each update moves every node ``step_size`` of the way to the batch's EM estimate.

    Args:
        circuit: a compiled :class:`jaxpc.Circuit`.
        step_size: a float in ``(0, 1]`` (1 = plain EM on the batch) or a schedule ``count -> float``
            (``count``: updates done so far), e.g. ``optax.linear_schedule(0.2, 0.02, total_steps)``, whose values
            must lie in ``[0, 1]`` (0: the update keeps the parameters). A value outside, or NaN, makes
            that update's parameters NaN and raises a ``ValueError`` naming the count: before training in ``fit``,
            from the circuit's next call after ``update``/``step`` (see the module docstring).
        pseudocount: Laplace smoothing, spread evenly over each node's children (values).
    """
    check_circuit(circuit, "em")
    _check_args(step_size, pseudocount, "em")
    return _make(circuit, EMConfig("em", step_size, float(pseudocount)))


def full_batch_em(circuit, num_batches: int, pseudocount: float = 0.0, step_size=1.0) -> EMTransformation:
    """Full-batch EM over ``num_batches`` mini-batches: flows are accumulated and every ``num_batches``-th
    update performs one EM update (``step_size`` 1 = classical EM; a schedule counts EM updates);
    the updates in between are zero.

    Args:
        circuit: a compiled :class:`jaxpc.Circuit`.
        num_batches: mini-batches per full pass over the data (``ceil(N / batch_size)``, or ``N // batch_size``
            with ``fit(..., drop_remainder=True)``): updates ``1 .. num_batches - 1`` of each pass only add their
            flows to the state (``FullBatchEMState.flows``) and leave the parameters as they are; update
            ``num_batches`` applies one EM update to the sum of the pass's flows and starts a new sum. ``fit``
            refuses another count; in a loop of your own, a count other than the batches of an epoch makes the EM
            updates straddle epochs.
        pseudocount: Laplace smoothing added once to the summed flows of each EM update, spread evenly over each
            node's children (values), as in :func:`em`.
        step_size: a float in ``(0, 1]`` (1: the parameters become the EM estimate of the pass) or a schedule
            ``k -> float`` called with ``k`` the number of EM updates done before this one (not the mini-batches),
            whose values at the EM updates must lie in ``[0, 1]``, checked as :func:`em` checks them.
    """
    check_circuit(circuit, "full_batch_em")
    if not isinstance(num_batches, numbers.Integral) or isinstance(num_batches, bool) or num_batches < 1:
        raise ValueError(f"full_batch_em: num_batches must be a positive int, got {num_batches!r}")
    _check_args(step_size, pseudocount, "full_batch_em")
    return _make(circuit, EMConfig("full_batch", step_size, float(pseudocount), int(num_batches)))


def anemone(circuit, step_size=1.0, pseudocount: float = 0.0) -> EMTransformation:
    """Mini-batch EM with a per-node step ``eta t_n / (1 + eta t_n)`` (see the module docstring).

    Args:
        circuit: a compiled :class:`jaxpc.Circuit`.
        step_size: ``eta > 0``, a finite float (not bounded by 1: a node's own step ``eta t_n / (1 + eta t_n)``
            stays below 1) or a schedule ``count -> float`` (``count``: updates done so far) for annealing, whose
            values must be finite and ``>= 0`` (0: the update keeps the parameters), checked as
            :func:`em` checks them.
        pseudocount: Laplace smoothing as in :func:`em`; it is also added to each node's flow ``F_n`` in its
            step, so with ``pseudocount > 0`` a node the batch does not reach still moves a little (towards
            uniform).

    ``update``/``step`` read the batch size ``B`` from the root's flows (the total weight of the batch); pass
    ``num_samples=`` when the root is not a sum node.
    """
    check_circuit(circuit, "anemone")
    _check_args(step_size, pseudocount, "anemone")
    return _make(circuit, EMConfig("anemone", step_size, float(pseudocount), root=_root_info(circuit)))


def apply(tx, feed: dict, state, params: dict, **extra):
    """One optimizer update: ``(new_params, new_state)``.

    ``tx`` is an EM transformation (``feed``: flows; the new parameters come from its ``step``, not from deltas) or
    any optax-style transformation (``feed``: gradients of a loss with respect to ``params``, so a pytree of the
    structure of ``params``; ``params + updates``). Flows given to an optax transformation raise a ``ValueError``.
    ``state``: the transformation's state (``tx.init(params)``, then what the previous call returned); ``extra``:
    keyword arguments of ``tx``'s update (``num_samples=`` for :func:`anemone`)."""
    if isinstance(tx, EMTransformation):
        return tx.step(feed, state, params, **extra)
    _check_gradients(feed, params)
    updates, state = tx.update(feed, state, params, **extra)
    return apply_updates(params, updates), state


def _check_gradients(feed, params) -> None:
    """Raise a ``ValueError`` where ``feed``, the gradients of an optax step, does not have the pytree structure of
    ``params``, naming flows (:meth:`jaxpc.Circuit.flows`: statistics in place of the input layers' parameters)
    when it holds them."""
    if jax.tree_util.tree_structure(feed) == jax.tree_util.tree_structure(params):
        return
    flows_like = _flows_layer(feed, params)
    if flows_like is not None:
        key, got, want = flows_like
        raise ValueError(
            f"apply: feed looks like flows (circuit.flows: feed['input']['{key}'] holds the statistics {got} where "
            f"params hold {want}), but optax transformations take gradients of a loss with respect to params, not "
            "flows: pass e.g. jax.grad(lambda p: -jaxpc.optim.log_prob(circuit, p, x).mean())(params) or the "
            "gradients of jaxpc.parallel.loss_and_grad; to train on flows use an EM transformation "
            "(jaxpc.optim.em(circuit))")
    raise ValueError("apply: feed must be gradients with the pytree structure of params (an optax transformation "
                     f"updates params from them), got {jax.tree_util.tree_structure(feed)} for params "
                     f"{jax.tree_util.tree_structure(params)}")


def _flows_layer(feed, params) -> tuple[str, list, list] | None:
    """``(layer key, feed's field names, params' field names)`` of the first input layer whose fields differ
    between circuit-params-shaped ``feed`` and ``params`` (flows hold statistics where params hold parameters), or
    None where either is not shaped like a circuit's params."""
    if not (isinstance(feed, dict) and isinstance(params, dict)):
        return None
    fin, pin = feed.get("input"), params.get("input")
    if not (isinstance(fin, dict) and isinstance(pin, dict)):
        return None
    for key, p in pin.items():
        f = fin.get(key)
        if isinstance(f, dict) and isinstance(p, dict) and set(f) != set(p):
            return key, sorted(f), sorted(p)
    return None
