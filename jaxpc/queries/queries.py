"""Marginals, conditionals, sampling and MPE assignments.

Each query is a pure function ``f(circuit, params, ...)``: the circuit only supplies its static
layout and index tables; everything per call (evidence, masks, targets, PRNG keys) is a traced
argument, so new evidence never recompiles. All of them jit, ``vmap`` over parameter sets and
work for every structure. They are also methods of :class:`jaxpc.Circuit`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .. import checks
from ..engine import forward, routing, select, stages
from ..options import Options
from ..runtime import VALIDATE, Batch, declare_entries, mask_key

Array = jax.Array

__all__ = ["marginal", "conditional", "sample", "mpe"]


# ---------------------------------------------------------------------------------------------
# pure implementations (jitted per circuit; layout static, everything else traced)
# ---------------------------------------------------------------------------------------------

def _marginal_impl(layout, tables, params, x, missing, soft, options, *, check: bool = False):
    """``soft``: per-value weights ``q`` ``[B, V, K]``; with ``check`` a row holding a negative or non-finite
    weight gives NaN (the others are exact)."""
    dtype = routing.param_dtype(params)
    q = soft.astype(dtype)
    bad = checks.bad_soft_rows(q) if check else None
    if check:
        q = jnp.where(bad[:, None, None], jnp.ones((), dtype), q)
    ll = forward.log_prob(layout, tables, params, x, missing, options, soft=q)
    return ll if bad is None else jnp.where(bad, jnp.asarray(jnp.nan, ll.dtype), ll)


def _conditional_impl(layout, tables, params, x, missing, targets, tree_weights=None, *, num_values: int, options):
    tables = stages.with_kept_weights(tables, tree_weights)
    B = x.shape[0]
    V = layout.num_vars
    dtype = routing.param_dtype(params)
    vals = [v.astype(dtype) for v in forward.input_values(layout, tables, params, x, missing, options)]

    def total(vals):
        return jnp.sum(forward.evaluate(layout, tables, params["sum"], vals, options))

    flows = jax.grad(total)(vals)
    # d log p(e) / d lambda[b, v, k] = sum over leaves n of v: flow[n, b] * p_n(k) / p_n(evidence)
    acc = jnp.zeros((V, B, num_values), dtype)
    read = jnp.zeros((V,), bool)  # the variables some discrete leaf reads; the others' rows stay 0
    for spec, tab, F, val in zip(layout.input_layers, tables["inputs"], flows, vals):
        if not spec.dist.discrete:
            continue
        read = read.at[tab["vars"]].set(True)
        G = F * jnp.exp(-jnp.where(F == 0, 0.0, val))  # a leaf without flow (value 0: -inf) adds 0, also to derivatives
        P = jnp.exp(spec.dist.log_pmf(params["input"][spec.key], tab["meta"], tab["rows"], num_values))
        if spec.run > 1:  # runs of r nodes over one variable: one product per run, no [N, B, K] temporary
            r = spec.run
            part = jnp.einsum("nrb,nrk->nbk", G.reshape(-1, r, B), P.reshape(-1, r, num_values),
                              precision=jax.lax.Precision.HIGHEST)
            acc = acc + jax.ops.segment_sum(part, tab["vars"][::r], num_segments=V)
        else:
            acc = acc + jax.ops.segment_sum(G[:, :, None] * P[:, None, :], tab["vars"], num_segments=V)
    tot = jnp.sum(acc, axis=2, keepdims=True)
    empty = tot == 0  # a row of probability 0: NaN conditionals, whose derivatives are 0 (never NaN) where masked
    acc = jnp.where(empty, jnp.nan, acc / jnp.where(empty, jnp.ones((), dtype), tot))
    acc = jnp.where(read[:, None, None], acc, 0)
    # observed variables are known: their conditional is the indicator of the observed value
    observed = jnp.ones((V, B), bool) if missing is None else ~forward.missing_t(missing) & jnp.ones((V, B), bool)
    onehot = jax.nn.one_hot(x.T.astype(jnp.int32), num_values, dtype=dtype)
    out = jnp.where((observed & read[:, None])[:, :, None], onehot, acc)  # [V, B, K]
    return jnp.transpose(out[targets], (1, 0, 2))


def _select_plan(layout, tables):
    """The plan that MPE and sampling run on, and its tables: the folded one where the circuit has it (half the
    stages of the full layout, with repeated levels scanned), one level at a time (the tree's persistent kernels
    serve the flow pass, not these queries)."""
    if layout.fold is None:
        return layout, tables
    return dataclasses.replace(layout.fold, tree=None), {**tables["fold"], "inputs": tables["inputs"]}


def _fill_leaves(layout, tables, params, x, missing, key, options, *, num_values: int, decode: bool):
    """Choose leaves top-down from the node values of a forward pass with ``options`` (``propagation="MPE"`` for
    ``decode``); fill the missing entries of ``x`` from the reached leaves. Returns ``(filled x, root values)``."""
    V = layout.num_vars
    plan, ptables = _select_plan(layout, tables)
    values = forward.node_values(plan, ptables, params, x, missing, options, nodes_only=True)
    sel_key = None
    if not decode:
        key, sel_key = jax.random.split(key)
    reached = select.reached_leaves(plan, ptables, params, values, sel_key, scan=options.scan_stages)
    choice = select.leaf_choice(layout, tables, reached, V)
    out = x.T
    mt = jnp.broadcast_to(forward.missing_t(missing), out.shape)
    for li, (spec, tab, sel) in enumerate(zip(layout.input_layers, tables["inputs"], choice)):
        prow = tab["rows"][jnp.maximum(sel, 0)]  # [V, B]
        p = params["input"][spec.key]
        if decode:
            draw = spec.dist.mode(p, tab["meta"], prow, num_values)
        else:  # drawn batch-major ([B, V]): a sample's values do not depend on the batch's padded size
            draw = spec.dist.sample(jax.random.fold_in(key, li), p, tab["meta"], prow.T, num_values).T
        out = jnp.where((sel >= 0) & mt, draw.astype(out.dtype), out)
    return out.T, values[plan.root_row]


def _mark_impossible(out: Array, root: Array, missing: Array | None) -> Array:
    """``out`` with the missing entries of rows whose evidence has probability 0 (root value -inf) or no value (NaN:
    an unchecked bad entry) at -1 (NaN for floats): nothing is drawn or decoded from such a row."""
    if missing is None:  # nothing filled
        return out
    mark = jnp.asarray(jnp.nan if jnp.issubdtype(out.dtype, jnp.floating) else -1, out.dtype)
    impossible = ~(root > -jnp.inf)[:, None] & jnp.broadcast_to(forward.missing_t(missing).T, out.shape)
    return jnp.where(impossible, mark, out)


def _sample_impl(layout, tables, params, key, x, missing, *, num_values: int, options):
    out, root = _fill_leaves(layout, tables, params, x, missing, key, options, num_values=num_values, decode=False)
    return _mark_impossible(out, root, missing)


def _mpe_impl(layout, tables, params, x, missing, *, num_values: int, options):
    out, root = _fill_leaves(layout, tables, params, x, missing, None, options, num_values=num_values, decode=True)
    return _mark_impossible(out, root, missing), root


# ---------------------------------------------------------------------------------------------
# public functions
# ---------------------------------------------------------------------------------------------

# name -> (pure implementation, batch axis of each output)
_QUERY_ENTRIES = {"marginal_soft": (_marginal_impl, 0), "conditional": (_conditional_impl, 0),
                  "sample": (_sample_impl, 0), "mpe": (_mpe_impl, (0, 0))}
# entries whose optimized compile keeps the scanned stages: their top-down selection runs slower unrolled, because
# XLA fuses the unrolled steps of a level into slow transposes (benchmarks/RESULTS.md, "scanned or unrolled")
_SCANNED = frozenset({"sample", "mpe"})
declare_entries(*_QUERY_ENTRIES)


def _run(circuit, entry: str, static: dict, args: dict, batch: Batch, **kw):
    circuit.runtime.entry(entry, *_QUERY_ENTRIES[entry], circuit.layout, unroll=entry not in _SCANNED)
    return circuit.runtime.run(entry, static, {"tables": circuit.tables, **args}, batch, **kw)


def _all_missing_batch(circuit, n: int, validate: bool | str = True) -> Batch:
    """A batch of ``n`` fully unobserved rows, made on device (no host transfer; no value to check). With
    ``validate="sync"`` the call still checks its parameters' values."""
    if validate not in VALIDATE:
        raise ValueError(f"validate must be True, False or 'sync', got {validate!r}")
    rt = circuit.runtime
    dtype = jnp.int32 if rt.var_info.all_discrete else circuit.dtype
    missing = rt.constant("all_missing", lambda: jnp.ones((circuit.num_vars,), bool))
    return Batch(_no_evidence(circuit, n, dtype), missing, n, check=False, report=False, sync=validate == "sync",
                 traced=False, mkey=mask_key(missing))


def _no_evidence(circuit, n: int, dtype):
    """Zeros ``[n, V]`` of ``dtype``: the ``x`` of a query without hard evidence, a device constant made once per
    size (a jitted call per query took ~0.1 ms of host time)."""
    return circuit.runtime.constant(("no_evidence", n, jnp.dtype(dtype).name),
                                    lambda: jnp.zeros((n, circuit.num_vars), dtype))


def _check_soft(circuit, soft, check_values: bool):
    """Soft evidence's shape and dtype (:func:`jaxpc.checks.check_soft_evidence`); the values of host (numpy) soft
    evidence with ``check_values`` (a device array's are checked by the executable: no host round trip). Returns it
    as an array of its own dtype."""
    soft = checks.check_soft_evidence(circuit.runtime.var_info, soft, "circuit.marginal")
    if not isinstance(soft, np.ndarray):
        return soft
    if check_values:
        checks.raise_bad_soft(soft, "circuit.marginal", "checked on the host")
    return jnp.asarray(soft)


def _check_circuit(circuit, where: str) -> None:
    """A ``TypeError`` naming ``where`` unless ``circuit`` is a compiled circuit (e.g. its params were passed in its
    place). Duck-typed: :mod:`jaxpc.circuit` imports this module, so this module does not import it."""
    if not (hasattr(circuit, "runtime") and hasattr(circuit, "layout") and hasattr(circuit, "log_prob")):
        hint = "; pass the compiled circuit (what jaxpc.compile returns), not its params" if isinstance(
            circuit, dict) else ""
        raise TypeError(f"{where}: circuit must be a jaxpc.Circuit, got {type(circuit).__name__}{hint}")


def marginal(circuit, params, x=None, missing=None, *, soft_evidence=None, propagation: str | None = None,
             alpha: float | None = None, options: Options | None = None, validate: bool | str = True) -> Array:
    """``log p(evidence)`` per sample, ``[B]``.

    Hard evidence: ``x`` ``[B, V]`` with ``missing`` (``bool[B, V]`` or ``[V]``) marking marginalized
    variables. Soft evidence: ``soft_evidence`` ``[B, V, K]`` non-negative per-value weights ``q``; a
    leaf ``n`` over ``v`` then contributes ``sum_k p_n(k) q[b, v, k]`` (all ones marginalizes,
    one-hot is hard evidence). Differentiable with respect to the soft evidence.

    ``validate`` (see :mod:`jaxpc.runtime`) checks soft evidence as it checks ``x``: numpy weights on the host
    (a negative or non-finite weight raises at once); a device array's inside the executable, with no host round
    trip (its row gives NaN, and the circuit's next call raises the ``ValueError``; ``"sync"``: this one).
    ``options``: a full :class:`jaxpc.Options` (``propagation`` and ``alpha`` apply on top), as for ``log_prob``.
    ``circuit``: a compiled :class:`jaxpc.Circuit` (anything else is a ``TypeError``); ``params``: a params pytree
    of it.
    """
    _check_circuit(circuit, "marginal")
    opts = Options.make(options, propagation=propagation, alpha=alpha)
    if soft_evidence is not None:
        if x is not None or missing is not None:
            raise ValueError("give either x (with missing) or soft_evidence, not both")
        if validate not in VALIDATE:
            raise ValueError(f"validate must be True, False or 'sync', got {validate!r}")
        q = _check_soft(circuit, soft_evidence, bool(validate))
        n = q.shape[0]
        traced = isinstance(q, jax.core.Tracer)
        batch = Batch(_no_evidence(circuit, n, jnp.int32), None, n, check=False, report=False, sync=False,
                      traced=traced)
        on_device = bool(validate) and checks.is_device_array(soft_evidence)
        out = _run(circuit, "marginal_soft", {"check": bool(validate)}, {"params": params, "soft": q}, batch,
                   options=opts, batched={"soft": 0})
        if on_device:  # its values were not seen on the host: flagged now, raised by the next call
            circuit.runtime.record_check("soft_evidence_flag", checks.any_bad_soft, {"q": q},
                                         lambda: checks.explain_bad_soft(q, "circuit.marginal"),
                                         sync=validate == "sync")
        return out
    if x is None:
        raise ValueError("marginal needs x (hard evidence) or soft_evidence")
    return circuit.log_prob(params, x, missing, options=opts, validate=validate)


def conditional(circuit, params, x, missing=None, *, target_vars=None, options: Options | None = None,
                validate: bool | str = True) -> Array:
    """``p(x_v = k | evidence)`` for target variables ``v``: ``[B, len(target_vars) or V, K]``, normalized over
    ``k`` (``K``: the largest number of values of any variable; impossible values get 0). Without ``target_vars``
    every variable is a target, and the rows of continuous variables are all 0 (a density is no pmf over ``k``;
    naming one in ``target_vars`` raises). A variable that no leaf reads (a gap in the variable ids, outside the
    circuit's scope) has no distribution: a target that is one raises a ``ValueError`` naming it, also as one of
    the default targets. Evidence of probability 0 gives NaN rows for the unobserved variables.

    Evidence is ``x`` on the variables not marked ``missing``. All targets come from one backward
    pass: the gradient of ``log p(evidence)`` with respect to the leaves' indicators. An observed
    target's conditional is the indicator of its observed value. ``options``: the forward's
    :class:`jaxpc.Options` (``precision``, ``impl``, ``tuning``; ``propagation`` must stay ``"LL"``).

    ``circuit``: a compiled :class:`jaxpc.Circuit` (else a ``TypeError``); ``params``: a params pytree of it; ``x``
    ``[B, V]`` (required: None is a ``ValueError``) and ``missing`` (``bool[B, V]`` or ``bool[V]``) as for
    :meth:`jaxpc.Circuit.log_prob`. ``target_vars``: a 1-D sequence of variable ids (default None: every variable);
    empty, out of range, continuous or unread ones raise a ``ValueError``, a boolean mask a ``TypeError``. ``validate``:
    ``True`` (default), ``"sync"`` or ``False``, as for :meth:`jaxpc.Circuit.log_prob` (see :mod:`jaxpc.runtime`): numpy
    evidence is checked at once, a device array's values inside the executable (the circuit's next call raises;
    ``"sync"``: this one), nothing with ``False``; a bad value raises a ``ValueError`` naming the variable, and any
    other ``validate`` a ``ValueError``.
    """
    _check_circuit(circuit, "conditional")
    if x is None:
        raise ValueError(f"conditional needs evidence x [B, {circuit.num_vars}] (for the prior p(x_v = k): any x with "
                         f"missing=np.ones({circuit.num_vars}, bool))")
    rt = circuit.runtime
    replay = None
    targets_key = _targets_key(target_vars)
    if targets_key is not False:  # a repeated query replays (Runtime.replay)
        replay = ("conditional", targets_key, options, validate)
        out = rt.replay(replay, x, missing, params=params, tree_weights=rt.tree_weights_later(
            circuit.layout, params, x, ("conditional", options), lambda: Options.make(options), True)) \
            if rt.clusters else rt.replay(replay, x, missing, params=params)
        if out is not None:
            return out
    info = rt.var_info
    batch = rt.prepare(x, missing, validate)
    if target_vars is None:
        targets = np.arange(circuit.num_vars)
    else:
        targets = np.asarray(target_vars)
        if targets.ndim == 1 and targets.size == 0:
            raise ValueError("target_vars is empty: name at least one variable (None: every variable)")
        if targets.dtype == np.bool_:
            raise TypeError("target_vars must be variable ids, got a boolean mask (np.flatnonzero(mask) gives its "
                            "ids)")
        if targets.ndim != 1 or not np.issubdtype(targets.dtype, np.integer):
            raise TypeError(f"target_vars must be a 1-D sequence of variable ids, got {target_vars!r}")
        bad = targets[(targets < 0) | (targets >= circuit.num_vars)]
        if bad.size:
            raise ValueError(f"target_vars holds {int(bad[0])}, but variables are 0..{circuit.num_vars - 1}")
    if target_vars is not None:
        cont = targets[info.continuous[targets]]
        if cont.size:
            raise ValueError(f"conditional needs discrete target variables; variable {int(cont[0])} is continuous")
    unread = targets[~(info.discrete[targets] | info.continuous[targets])]
    if unread.size:
        read = np.flatnonzero(info.discrete).tolist()
        hint = "" if target_vars is not None else (
            f"; without target_vars every variable is a target: name the ones to condition (the discrete variables "
            f"that leaves read: {read[:8]}{'...' if len(read) > 8 else ''})")
        raise ValueError(f"conditional: no leaf reads variable {int(unread[0])} ({unread.size} such target(s)); "
                         f"the circuit puts no distribution on it{hint}")
    K = int(info.card.max())
    # the targets as a device constant made once per set (an eager conversion per call took ~0.1 ms of host time)
    dev = rt.constant(("targets", None if target_vars is None else targets.astype(np.int32).tobytes()),
                      lambda: jnp.asarray(targets, jnp.int32))
    opts = _likelihood_options(options, "conditional")
    args = rt.with_tree_weights({"params": params, "targets": dev}, circuit.layout, batch, ("conditional", options),
                                opts, True)
    return _run(circuit, "conditional", {"num_values": K}, args, batch, replay=replay, options=opts,
                free=("params", "tree_weights"))


def _likelihood_options(options: Options | None, query: str) -> Options:
    """The options of a query whose forward computes likelihoods (``conditional``, ``sample``): ``propagation``
    other than ``"LL"`` raises."""
    opts = Options.make(options)
    if opts.propagation != "LL":
        raise ValueError(f"{query} runs a sum-product (propagation='LL') forward; options.propagation="
                         f"{opts.propagation!r} does not apply to it")
    return opts


def _targets_key(target_vars):
    """``conditional``'s targets in its replay's key: None for all variables, their type, shape and bytes for a list,
    tuple or numpy array (the full call checks them), False for anything else (not replayed)."""
    if target_vars is None:
        return None
    if not isinstance(target_vars, (list, tuple, np.ndarray)):
        return False
    a = np.asarray(target_vars)
    return a.dtype.str, a.shape, a.tobytes()


def sample(circuit, params, key: Array, num_samples: int | None = None, *, x=None, missing=None,
           options: Options | None = None, validate: bool | str = True) -> Array:
    """Ancestral samples ``[num_samples, V]`` (int for discrete circuits, float with continuous variables).

    Conditional sampling: pass evidence ``x`` ``[B, V]`` and ``missing``; observed entries are kept and the
    missing ones drawn from ``p(missing | evidence)``. Pure and keyed by ``key``: each sum node picks a child
    by Gumbel-max on ``log w + child log-likelihood``, then every reached leaf draws its value. Row ``b``'s draw
    depends on ``key``, ``b`` and its own evidence only, not on the batch's size, padding or ``jax.jit`` (with JAX's
    default ``jax_threefry_partitionable``): ``sample(key, 5)`` is ``sample(key, 9)[:5]``. A variable that no
    leaf reads keeps its entry of ``x`` (0 without ``x``). Where the evidence of a row has probability 0, or its
    log-likelihood is NaN (a bad entry of ``x`` with ``validate=False``), its missing entries read -1 (NaN when the
    samples are floats). ``options``: the
    forward's :class:`jaxpc.Options` (``precision``, ``impl``, ``tuning``; ``propagation`` must stay ``"LL"``).

    ``circuit``: a compiled :class:`jaxpc.Circuit` (else a ``TypeError``); ``params``: a params pytree of it;
    ``key``: one PRNG key (``jax.random.key(0)``, or a raw ``uint32[2]``; anything else is a ``TypeError``).
    ``num_samples``: without ``x``, the number of unconditional samples (a positive int, else a ``ValueError``;
    required); with ``x``, None or ``x``'s number of rows (one sample per row). ``missing`` without ``x`` is a
    ``ValueError``. ``validate``: ``True`` (default), ``"sync"`` or ``False``, as for :meth:`jaxpc.Circuit.log_prob`
    (see :mod:`jaxpc.runtime`): numpy evidence is checked at once, a device array's values inside the executable
    (the circuit's next call raises; ``"sync"``: this one), nothing with ``False``; a bad value raises a
    ``ValueError`` naming the variable, and any other ``validate`` a ``ValueError``.
    """
    _check_circuit(circuit, "sample")
    checks.check_key(key)
    replay = _replay_query(circuit, "sample", x, missing, num_samples, options, validate, params=params, key=key)
    if replay[1] is not None:
        return replay[1]
    opts = _likelihood_options(options, "sample")
    batch = _query_batch(circuit, x, missing, num_samples, validate)
    K = max(int(circuit.runtime.var_info.card.max()), 1)
    return _run(circuit, "sample", {"num_values": K}, {"params": params, "key": key}, batch, replay=replay[0],
                free=("params", "key"), options=opts)


def mpe(circuit, params, x=None, missing=None, *, num_samples: int | None = None, options: Options | None = None,
        validate: bool | str = True) -> tuple[Array, Array]:
    """Max-product decoding: ``(assignment [B, V], log-value [B])``.

    Fills the missing (or, without ``x``, all) variables with the joint maximizer of the max-product
    recursion over values *and* sum-node choices: the Viterbi path for an HMM, the exact MAP assignment
    for deterministic circuits. For general circuits exact MAP is NP-hard; this returns the best
    assignment of the best single induced tree, and its value is a lower bound on the MAP value.
    Ties go to the first child (lowest child block, then lowest node in the block) and to the lowest value of a leaf; a
    continuous leaf decodes to its mean; a variable that no leaf reads keeps its entry of ``x`` (0 without ``x``). Where
    the evidence of a row has probability 0 (log-value -inf), or its log-value is NaN (a bad entry of ``x`` with
    ``validate=False``), its missing entries read -1 (NaN when the assignment is float). Without ``x``, ``num_samples``
    (default 1) rows of the unconditional decoding; with it, one row per row of ``x``. ``options``: the forward's
    :class:`jaxpc.Options` (``precision``, ``impl``, ``tuning``); its ``propagation`` is ``"MPE"`` whatever it says,
    except ``"GeneralLL"``, which raises.

    ``circuit``: a compiled :class:`jaxpc.Circuit` (else a ``TypeError``); ``params``: a params pytree of it; ``x``
    ``[B, V]`` and ``missing`` (``bool[B, V]`` or ``bool[V]``, True: decoded; default None: with ``x``, nothing
    decoded) as for :meth:`jaxpc.Circuit.log_prob`; ``missing`` without ``x`` is a ``ValueError``. ``num_samples``:
    without ``x``, the rows of the unconditional decoding (default None: 1; a positive int, else a ``ValueError``);
    with ``x``, None or ``x``'s number of rows (else a ``ValueError``). ``validate``: ``True`` (default), ``"sync"``
    or ``False``, as for :meth:`jaxpc.Circuit.log_prob` (see :mod:`jaxpc.runtime`): numpy evidence is checked at
    once, a device array's values inside the executable (the circuit's next call raises; ``"sync"``: this one),
    nothing with ``False``; a bad value raises a ``ValueError`` naming the variable, and any other ``validate`` a
    ``ValueError``.
    """
    _check_circuit(circuit, "mpe")
    num_samples = 1 if x is None and num_samples is None else num_samples
    replay = _replay_query(circuit, "mpe", x, missing, num_samples, options, validate, params=params)
    if replay[1] is not None:
        return replay[1]
    opts = Options.make(options)
    if opts.propagation == "GeneralLL":
        raise ValueError("mpe decodes by max-product; options.propagation='GeneralLL' does not apply to it")
    batch = _query_batch(circuit, x, missing, num_samples, validate)
    K = max(int(circuit.runtime.var_info.card.max()), 1)
    return _run(circuit, "mpe", {"num_values": K}, {"params": params}, batch, replay=replay[0],
                options=opts.replace(propagation="MPE"))


def _replay_query(circuit, name: str, x, missing, num_samples, options, validate, **free) -> tuple:
    """``(key, outputs)`` of ``sample`` / ``mpe``'s replay (:meth:`Runtime.replay`): the key the full call remembers
    itself under (None: not replayed) and the replayed call's outputs (None: take the full call). Without ``x`` the
    batch is the circuit's constant all-missing rows of a valid ``num_samples``; with it the call's evidence and its
    mask, or the constant all-observed one that the full call puts in place of none."""
    rt = circuit.runtime
    if x is None:
        if missing is not None or type(num_samples) is not int or num_samples < 1:
            return None, None  # (the full call raises)
        call = (name, "all missing", num_samples, options, validate)
        batch = _all_missing_batch(circuit, num_samples, validate)
        return call, rt.replay(call, batch.x, batch.missing, **free)
    call = (name, num_samples, options, validate)
    return call, rt.replay(call, x, _none_missing(circuit) if missing is None else missing, **free)


def _query_batch(circuit, x, missing, num_samples: int | None, validate) -> Batch:
    """The batch of ``sample`` / ``mpe``: ``num_samples`` all-missing rows without ``x``, else ``x``'s rows (then
    ``num_samples``, if given, must be their number)."""
    if x is None:
        if missing is not None:
            raise ValueError("missing is only meaningful with evidence x")
        if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
        return _all_missing_batch(circuit, int(num_samples), validate)
    batch = _observed(circuit, x, missing, validate)
    if num_samples is not None and num_samples != batch.n:
        raise ValueError(f"num_samples={num_samples} but the evidence has {batch.n} rows (one sample per row)")
    return batch


def _observed(circuit, x, missing, validate) -> Batch:
    """The checked evidence batch of ``sample`` / ``mpe``, with an explicit all-observed mask when none is given."""
    batch = circuit.runtime.prepare(x, missing, validate)
    if batch.missing is None:
        batch.missing = _none_missing(circuit)
        batch.mkey = mask_key(batch.missing)  # (the replay passes it for none)
    return batch


def _none_missing(circuit):
    """The all-observed mask ``bool[V]``, a device constant."""
    return circuit.runtime.constant("none_missing", lambda: jnp.zeros((circuit.num_vars,), bool))
