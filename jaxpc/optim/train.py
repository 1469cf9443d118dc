"""One training step for EM and gradient optimizers alike, and whole-epoch executables.

:func:`make_step` builds a pure step ``(tables, params, state, x, missing, weights) -> (params, state,
ll)``: with an EM transformation it computes flows and applies the EM update (new parameters, not
deltas); with any optax transformation it differentiates the mean negative log-likelihood of the
renormalized parameters, applies the updates and renormalizes (so the parameters are a distribution
after every step).

:func:`fit` runs each epoch as ONE jitted ``lax.scan`` over the (shuffled) batches: no Python loop
around a jitted step, one device round trip per epoch for the progress bar.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ..checks import bad_params_entry, check_bool, check_key, raise_bad_values
from ..engine import em as em_engine
from ..engine import routing
from ..options import Options
from ..runtime import declare_entries, options_key
from . import sharded
from .normalize import mean_nll, normalize_params
from .transforms import EMTransformation, apply_updates, check_circuit, check_schedule, em, em_apply

Array = jax.Array

__all__ = ["make_step", "epoch_batches", "fit", "FitResult"]

declare_entries("optim.fit")


def _check_tx(tx, layout, options: Options | None = None) -> None:
    if isinstance(tx, EMTransformation):
        if tx.config.layout is not None and tx.config.layout != layout:
            raise ValueError("optimizer: this EM transformation was built for another circuit")
        if options is not None:
            em_engine.check_em_options(options, "an EM training step")
        return
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise TypeError(f"optimizer must be a jaxpc.optim EM transformation or an optax transformation "
                        f"(with init and update), got {type(tx).__name__}")


def make_step(layout, tx, *, normalize: bool = True, options: Options | None = None, mesh=None,
              missing_ndim: int | None = None):
    """A pure training step ``step(tables, params, state, x, missing, weights, evidence=None) -> (params, state,
    ll)``.

    Args:
        layout: ``circuit.layout``.
        tx: an EM transformation (:func:`jaxpc.optim.em`, ...) or an optax transformation.
        normalize: gradient training only: the loss renormalizes the logits (:func:`normalize_params`) and
            the parameters are renormalized after each update.
        options: :class:`jaxpc.Options` of the forward (default LL).
        mesh: a ``'data'`` mesh (:func:`jaxpc.parallel.data_mesh`) to split the batch over its devices
            (then the batch must be a multiple of the devices; another type is a ``TypeError``, a mesh without a
            ``'data'`` axis a ``ValueError``).
        missing_ndim: with a ``mesh``, the number of dimensions of the ``missing`` the step takes: None (no mask),
            1 (``bool[V]``) or 2 (``bool[B, V]``); another value is a ``ValueError``.

    Shapes: ``x`` ``[B, V]``, ``missing`` None / ``bool[V]`` / ``bool[B, V]``, ``weights`` None or ``[B]``
    (zero-weight rows are padding), ``evidence`` None or the per-call evidence of the batch (every leaf batch
    first, as :meth:`jaxpc.Circuit.check_evidence` returns it), ``ll`` ``[B]`` under the parameters before the
    step.
    """
    opts = Options.make(options)
    _check_tx(tx, layout, opts)
    if mesh is not None:
        sharded.check_mesh(mesh)
        if missing_ndim not in (None, 1, 2) or isinstance(missing_ndim, bool):
            raise ValueError(f"make_step: missing_ndim must be None, 1 or 2 (the dimensions of missing), got "
                             f"{missing_ndim!r}")
    if isinstance(tx, EMTransformation):
        if mesh is None:
            flows_fn = functools.partial(em_engine.flows_and_ll, layout, options=opts)
        else:
            split_flows = sharded.sharded_flows_and_ll(layout, mesh, opts, missing_ndim)

            def flows_fn(tables, params, x, missing, weights, evidence=None):
                return split_flows(tables, params, x, *(() if missing is None else (missing,)),
                                   _split_weights(weights, x, params), evidence=evidence)

        def step(tables, params, state, x, missing, weights, evidence=None):
            fl, ll = flows_fn(tables, params, x, missing, weights, evidence=evidence)
            n = x.shape[0] if weights is None else jnp.sum(weights)
            params, state = em_apply(layout, tables, tx.config, fl, state, params, n, opts.compute_param_flows)
            return params, state, ll

        return step

    if mesh is None:
        def grad_fn(tables, params, x, missing, weights, evidence):
            return jax.value_and_grad(
                lambda p: mean_nll(layout, tables, p, x, missing, weights, opts, normalize, evidence),
                has_aux=True)(params)
    else:
        split_grad = sharded.sharded_loss_and_grad(layout, mesh, opts, missing_ndim, normalize)

        def grad_fn(tables, params, x, missing, weights, evidence):
            return split_grad(tables, params, x, *(() if missing is None else (missing,)),
                              _split_weights(weights, x, params), evidence=evidence)

    def step(tables, params, state, x, missing, weights, evidence=None):
        (_, ll), g = grad_fn(tables, params, x, missing, weights, evidence)
        updates, state = tx.update(g, state, params)
        params = apply_updates(params, updates)
        if normalize:
            params = normalize_params(layout, tables, params)
        return params, state, ll

    return step


def _split_weights(weights, x, params):
    """The weights a data-parallel step splits with its batch: ``weights``, or ones for None (every row counts)."""
    if weights is not None:
        return weights
    dtype = next((a.dtype for a in jax.tree_util.tree_leaves(params) if jnp.issubdtype(a.dtype, jnp.floating)),
                 jnp.float32)
    return jnp.ones((x.shape[0],), dtype)


def epoch_batches(key: Array, epoch, num_samples: int, batch_size: int, *, shuffle: bool = True,
                  drop_remainder: bool = False):
    """The batches of one epoch of :func:`fit` (jittable; sizes static).

    Returns:
        ``(idx, weights)``: ``idx`` ``int32[num_batches, batch_size]`` rows of the data, drawn from
        ``jax.random.permutation(jax.random.fold_in(key, epoch), num_samples)`` (or in order without
        ``shuffle``); ``weights`` None when every batch is full, else ``[num_batches, batch_size]`` with
        zeros on the padding of the last batch.

    ``num_samples`` must be an int >= 0 and ``batch_size`` an int >= 1 (Python or NumPy integers: they set the
    shapes), else a ``ValueError``. ``drop_remainder``: leave the last partial batch out (default ``False``: it is
    padded with copies of the epoch's first row, weighing zero): ``num_samples // batch_size`` full batches and
    ``weights`` None; the ``num_samples % batch_size`` rows left over take no part in the epoch (with fewer than
    ``batch_size`` samples there is no batch at all).
    """
    _check_counts("epoch_batches", (("num_samples", num_samples, 0), ("batch_size", batch_size, 1)))
    n, bs = int(num_samples), int(batch_size)
    perm = jax.random.permutation(jax.random.fold_in(key, epoch), n) if shuffle else jnp.arange(n)
    perm = perm.astype(jnp.int32)
    if drop_remainder or n % bs == 0:
        nb = n // bs
        return perm[:nb * bs].reshape(nb, bs), None
    nb = math.ceil(n / bs)
    pad = nb * bs - n
    idx = jnp.concatenate([perm, jnp.full((pad,), perm[0], jnp.int32)]).reshape(nb, bs)
    w = jnp.concatenate([jnp.ones((n,)), jnp.zeros((pad,))]).reshape(nb, bs)
    return idx, w


class FitResult(NamedTuple):
    """What :func:`fit` returns.

    Attributes:
        params: the trained parameters.
        opt_state: the optimizer state (resume with ``fit(..., opt_state=..., start_epoch=...)``).
        epoch_ll: ``float[epochs]`` mean log-likelihood per sample of each epoch's training batches, each
            under the parameters before its step (the usual running training LL); with ``ll_weights`` the
            weighted mean.
    """

    params: dict
    opt_state: Any
    epoch_ll: np.ndarray


def _epoch_fn(layout, step, num_samples: int, batch_size: int, shuffle: bool, drop_remainder: bool,
              missing_ndim: int | None, dtype, check=None, skip_empty: bool = False):
    """One epoch ``run(...) -> (params, state, mean ll, bad)`` (pure: the caller compiles it). With ``check``
    (a :class:`jaxpc.checks.DeviceCheck`) the data's bad rows weigh zero and ``bad`` flags them. ``evidence``
    (None, or per-call evidence for every row of ``data``) is indexed with each batch's rows, as ``data`` is, and so
    are ``weights`` (None, or ``[N]`` per-row weights: each batch's rows weigh theirs). With ``skip_empty`` a batch
    of total weight 0 leaves the parameters and the optimizer state as they were (as if its rows were not there)."""
    def run(tables, params, state, data, missing, evidence, weights, key, epoch):
        idx, w = epoch_batches(key, epoch, num_samples, batch_size, shuffle=shuffle, drop_remainder=drop_remainder)
        wts = None if w is None else w.astype(dtype)
        if weights is not None:
            rows = weights.astype(dtype)[idx]
            wts = rows if wts is None else wts * rows
        bad = None
        if check is not None:
            data, bad_rows = check.apply(data, missing)
            ok = (~bad_rows).astype(dtype)[idx]
            wts = ok if wts is None else wts * ok
            bad = jnp.any(bad_rows)

        def body(carry, inp):
            params, state = carry
            ib, wb = inp
            xb = data[ib]
            mb = missing[ib] if missing_ndim == 2 else missing
            eb = None if evidence is None else jax.tree_util.tree_map(lambda a: a[ib], evidence)
            new_params, new_state, ll = step(tables, params, state, xb, mb, wb, eb)
            if skip_empty:  # a select, not a cond: no predicate read on the host; a NaN weight takes the step
                some = jnp.any(wb != 0)
                new_params, new_state = jax.tree_util.tree_map(lambda a, b: jnp.where(some, a, b),
                                                               (new_params, new_state), (params, state))
            tot = jnp.sum(ll) if wb is None else jnp.sum(jnp.where(wb == 0, 0.0, ll * wb))
            return (new_params, new_state), tot

        (params, state), sums = jax.lax.scan(body, (params, state), (idx, wts))
        count = idx.size if wts is None else jnp.sum(wts)
        return params, state, jnp.sum(sums) / count, bad

    return run


class _Same:
    """A static value equal only to itself (an optimizer: its functions are compared by identity anyway, and
    it may hold unhashable state); the key holds it, so its id is never reused while the executable lives."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Same) and other.value is self.value


def _epoch_entry(layout, tables, params, state, data, missing, evidence, weights, key, epoch, *, optimizer: _Same,
                 normalize: bool, options: Options, mesh, num_samples: int, batch_size: int, shuffle: bool,
                 drop_remainder: bool, missing_ndim: int | None, dtype, check, _matmul=None, _jax=None):
    """The epoch as an entry of the circuit's executable cache: every keyword is static (part of the key). With
    ``weights``, a batch of total weight 0 is skipped, except by full-batch EM (whose count of updates is the
    count of batches, and to whose sum such a batch adds nothing)."""
    del _matmul, _jax  # part of the key only
    step = make_step(layout, optimizer.value, normalize=normalize, options=options, mesh=mesh,
                     missing_ndim=missing_ndim)
    tx = optimizer.value
    skip_empty = weights is not None and not (isinstance(tx, EMTransformation) and tx.config.kind == "full_batch")
    run = _epoch_fn(layout, step, num_samples, batch_size, shuffle, drop_remainder, missing_ndim, dtype, check,
                    skip_empty)
    return run(tables, params, state, data, missing, evidence, weights, key, epoch)


def _default_em(circuit, step_size, pseudocount):
    """The EM optimizer of ``fit(..., step_size=, pseudocount=)``, one per configuration and circuit (in the
    circuit's bounded constant cache): the compiled epoch is cached under the optimizer, and a fresh one per
    call recompiled every call (``fit(epochs=1)`` in a loop that checkpoints)."""
    try:
        hash((step_size, pseudocount))
    except TypeError:  # an unhashable schedule: a new optimizer (and executable) per call
        return em(circuit, step_size, pseudocount)
    return circuit.runtime.constant(("fit_em", step_size, pseudocount), lambda: em(circuit, step_size, pseudocount))


def fit(circuit, params: dict, data, epochs: int, batch_size: int, *, step_size=None, pseudocount=None,
        key: Array | None = None, missing=None, optimizer=None, opt_state=None, start_epoch: int = 0,
        shuffle: bool = True, drop_remainder: bool = False, normalize: bool = True, mesh=None,
        options: Options | None = None, progress: bool = True, validate: bool | str = True,
        evidence: dict | None = None, ll_weights=None) -> FitResult:
    """Train ``params`` on ``data`` for ``epochs`` epochs; each epoch is one jitted ``lax.scan`` over batches.

    Args:
        circuit: a compiled :class:`jaxpc.Circuit`.
        params: its (normalized) parameters.
        data: ``[N, V]``; missing: None, ``bool[V]`` or ``bool[N, V]`` (marginalized entries).
        epochs: epochs to run now; batch_size: samples per batch (clipped to ``N``).
        step_size, pseudocount: mini-batch EM (:func:`jaxpc.optim.em`; default 0.1 and 0) when no
            ``optimizer`` is given; ``step_size`` a float or a schedule ``count -> step size``, ``pseudocount`` a
            float. A step size schedule (this one, or an EM ``optimizer``'s) is evaluated at every count this call's
            updates use (those after ``opt_state``'s count) before the first epoch: a value outside its rule
            (``[0, 1]``; anemone: finite and >= 0) raises a ``ValueError`` naming the first such count and value.
        key: shuffling key (default ``jax.random.key(0)``); epoch ``e`` uses ``fold_in(key, e)``, see
            :func:`epoch_batches`.
        optimizer: an EM transformation (:func:`jaxpc.optim.em`, :func:`~jaxpc.optim.full_batch_em`,
            :func:`~jaxpc.optim.anemone`) or any optax transformation (gradient training of the logits,
            renormalized after each step with ``normalize``).
        opt_state: the optimizer state to resume from (default ``optimizer.init(params)``).
        start_epoch: number of the first epoch (for resuming: the shuffles continue where they stopped, so
            a resumed run equals an uninterrupted one bit for bit).
        shuffle: reshuffle every epoch; drop_remainder: skip the last partial batch instead of padding it
            with zero-weight rows.
        normalize: gradient training (an optax ``optimizer``) only: the loss is the log-likelihood of
            :func:`normalize_params` of ``params`` (``params`` are unconstrained logits, and each sum node's and
            categorical row's parameters are renormalized in the loss) and the parameters are renormalized after
            every step, so they stay a distribution; False: the loss reads ``params`` as they are and nothing is
            renormalized (the optimizer must keep them normalized). EM optimizers ignore it (their parameters are
            normalized by construction).
        mesh: a ``'data'`` mesh (:func:`jaxpc.parallel.data_mesh`): each batch is split over its devices
            (``batch_size`` must be a multiple of the device count, or at least ``N``: then each epoch is one batch
            of every row, padded with zero-weight rows to a multiple of the devices, as without a mesh).
        options: :class:`jaxpc.Options` of every step's forward (and of its flows or gradient), e.g.
            ``precision``, ``impl`` or ``propagation``; default ``Options()`` (the log-likelihood). EM optimizers
            take only options whose flows are expected counts (a ``ValueError`` names the others, e.g.
            ``negate_flows``). Part of the epoch executable's key.
        progress: a tqdm bar across epochs showing the epoch's LL (when tqdm is installed).
        evidence: per-call evidence of every row of ``data`` (as for :meth:`jaxpc.Circuit.flows`, leaves
            ``[N, ...]``, checked by :meth:`~jaxpc.Circuit.check_evidence`); each batch takes the rows of its
            samples. It is an argument of the epoch's executable: it lives on the device with the data.
        validate: as for :meth:`jaxpc.Circuit.em_step`, except that the values of device ``data``, ``evidence``
            and ``ll_weights`` are checked on the device alongside the first epoch and a failure raises in ``fit``
            right after it (``True`` or ``"sync"``; ``False``: no check); ``"sync"`` also checks the values of
            ``params`` before the first epoch (NaN or +inf raise a ``ValueError`` naming the entry).
        ll_weights: ``[N]`` per-row weights of ``data`` (None: 1 each), finite and >= 0, not all 0 (a
            ``ValueError`` names a wrong shape or the first bad weight; numpy weights are checked at once, device
            weights as device ``data`` are). Each row's weight follows it through the shuffles into its batch and
            scales its flows (EM) or its term of the batch's weighted mean log-likelihood (gradient training), as
            :meth:`jaxpc.Circuit.em_step`'s ``ll_weights`` do; ``epoch_ll`` is the weighted mean. An integer weight
            ``k`` counts a row as ``k`` copies of it and a weight of 0 as no row: with one batch per epoch (or
            :func:`~jaxpc.optim.full_batch_em`) ``fit`` equals ``fit`` on the data with each row repeated its
            weight's number of times. A batch whose rows all weigh 0 takes no step (its parameters, optimizer
            state and step count stay), except under ``full_batch_em``, where it adds nothing to the pass. All
            of this holds over a ``mesh`` too.

    Returns:
        :class:`FitResult` ``(params, opt_state, epoch_ll [epochs])``.
    """
    check_circuit(circuit, "fit")
    for name, flag in (("shuffle", shuffle), ("drop_remainder", drop_remainder), ("normalize", normalize),
                       ("progress", progress)):
        check_bool("fit", name, flag)
    optimizer = _fit_optimizer(circuit, optimizer, step_size, pseudocount)
    batch, bs = _fit_batch(circuit, data, missing, validate, epochs=epochs, batch_size=batch_size,
                           start_epoch=start_epoch, mesh=mesh)
    drop_remainder = bool(drop_remainder) and bs < batch.n  # one batch that holds every row leaves none over
    if validate == "sync":  # as em_step's: the parameters' values too
        circuit.runtime.check_params_now(params, where=" (fit, checked with validate='sync')")
    _check_full_batch(optimizer, batch.n, bs, drop_remainder)
    ev, record_ev = circuit.prepare_evidence(evidence, batch, "optim.fit")
    weights, record_w = _fit_weights(circuit, ll_weights, batch)

    def record():
        record_ev()
        record_w()

    check = circuit.runtime.device_check if batch.report else None  # device data: checked inside the epoch
    if key is None:
        key = jax.random.key(0)
    check_key(key, "fit: ")
    fresh = opt_state is None
    if fresh:
        opt_state = optimizer.init(params)
    else:
        _check_opt_state(circuit, optimizer, params, opt_state)
    _check_fit_schedule(optimizer, opt_state, fresh, params, epochs, batch.n, bs, drop_remainder)
    run = _cached_epoch_fn(circuit, optimizer, options, normalize=normalize, mesh=mesh, num_samples=batch.n,
                           batch_size=bs, shuffle=shuffle, drop_remainder=drop_remainder,
                           missing_ndim=None if batch.missing is None else batch.missing.ndim, check=check)
    if mesh is None:  # where the parameters or data were put (parameters trained over a mesh: replicated there)
        tables, placed = circuit.runtime.placed_tables(circuit.tables, batch.x, params, batch.missing)
        devices = (jax.tree_util.tree_leaves(circuit.tables)[0].sharding if placed is None else placed).device_set
        circuit.runtime.check_devices({"ll_weights": weights, "key": key}, devices,
                                      "fit: where data and params were put, else where the circuit's tables are")
    else:
        sharded.check_on_mesh(mesh, batch.x, batch.missing, params, weights=weights)
        circuit.runtime.check_devices({"key": key}, set(mesh.devices.flat), "fit: the mesh's")
        tables = circuit.runtime.replicated(circuit.tables, NamedSharding(mesh, PartitionSpec()))
    return _run_epochs(circuit, run, tables, params, opt_state, batch, ev, weights, key,
                       range(start_epoch, start_epoch + int(epochs)), progress, record)


def _fit_weights(circuit, ll_weights, batch):
    """``fit``'s ``(weights, record)``: ``ll_weights`` checked and as an array ``[N]`` of the circuit's dtype (None
    for None), and a function of no arguments that records the device check of device weights (a no-op for others:
    host weights are checked here, once, by fit's own rule, which is stricter than ``Runtime.weights``': not all
    zero)."""
    if ll_weights is None:
        return None, _no_record
    shape = tuple(np.shape(ll_weights))
    if shape != (batch.n,):
        raise ValueError(f"fit: ll_weights must have shape [{batch.n}] (one weight per row of data), got {shape}")
    if isinstance(ll_weights, jax.core.Tracer):
        return ll_weights, _no_record
    if not isinstance(ll_weights, jax.Array):
        host = np.asarray(ll_weights)
        if host.dtype.kind not in "biuf" and not jnp.issubdtype(host.dtype, jnp.floating):  # (bfloat16: "V")
            raise TypeError(f"fit: ll_weights must be numbers, got dtype {host.dtype}")
        _raise_bad_fit_weights(host)
        return jnp.asarray(host, circuit.dtype), _no_record
    w = jnp.asarray(ll_weights, circuit.dtype)
    return w, circuit.runtime.deferred_check(batch, "fit_weights_flag", _bad_fit_weights, {"w": w},
                                             functools.partial(_explain_fit_weights, w))


def _no_record() -> None:
    """A record function with nothing to record."""


def _raise_bad_fit_weights(host: np.ndarray, where: str = "") -> None:
    """The ``ValueError`` of ``fit``'s ``ll_weights`` (host values) that hold a NaN, an infinity or a negative
    weight, or are all zero."""
    flat = host.astype(np.float64).ravel()
    for bad, what in ((~np.isfinite(flat), "finite"), (flat < 0, ">= 0")):
        at = np.flatnonzero(bad)
        if at.size:
            more = f" ({at.size} such weights in all)" if at.size > 1 else ""
            raise ValueError(f"fit: ll_weights must be {what}; ll_weights[{at[0]}] is {host.ravel()[at[0]]}{more}"
                             f"{where}")
    if not np.any(flat > 0):
        raise ValueError(f"fit: ll_weights are all zero, so no row of data takes part{where}")


def _bad_fit_weights(w: Array) -> Array:
    """Whether device weights break ``fit``'s rule (:func:`_raise_bad_fit_weights`): a scalar bool."""
    return ~(jnp.all(jnp.isfinite(w) & (w >= 0)) & jnp.any(w > 0))


def _explain_fit_weights(w: Array) -> None:
    """The error of device weights whose check found a bad value."""
    with jax.transfer_guard_device_to_host("allow"):  # (an error's message, not the call's data path)
        host = np.asarray(w)
    _raise_bad_fit_weights(host, " (checked on the device after the first epoch: fit's result is not valid)")
    raise ValueError("fit: ll_weights held a value that the device check rejected; the host check found none")


def _run_epochs(circuit, run, tables, params, opt_state, batch, ev, weights, key, epochs, progress: bool,
                record=None) -> FitResult:
    """``fit``'s loop: one executable call per epoch; the data's input flag is read once, after the first, and so are
    the flags of the device evidence's and weights' values (``record``: a function recording both checks, called
    after the first epoch is dispatched)."""
    epochs_iter, bar = _progress_bar(epochs, progress)
    lls = []
    for e in epochs_iter:
        params, opt_state, ll, bad = run(tables, params, opt_state, batch.x, batch.missing, ev, weights, key,
                                         jnp.asarray(e, jnp.int32))
        lls.append(ll)
        if bad is not None and len(lls) == 1 and bool(np.asarray(bad)):
            # the rows with bad values took no part
            raise_bad_values(circuit.runtime.var_info, batch.x, batch.missing, "data",
                             "optim.fit, which left those rows out")
        if record is not None and len(lls) == 1:
            # the device evidence's flag, read here as the data's is (the later epochs would train on bad values)
            record()
            circuit.runtime.raise_pending()
        if bar is not None:
            bar.set_postfix(ll=f"{float(ll):.4f}")
    epoch_ll = np.asarray(jnp.stack(lls)) if lls else np.zeros((0,), np.dtype(circuit.dtype))
    if np.isnan(epoch_ll).any():
        _warn_nan_epoch(params, int(np.flatnonzero(np.isnan(epoch_ll))[0]) + epochs.start)
    return FitResult(params, opt_state, epoch_ll)


def _warn_nan_epoch(params, epoch: int) -> None:
    """Warn that epoch ``epoch``'s log-likelihood was NaN, naming a NaN or +inf entry of the trained ``params``."""
    why = bad_params_entry(params) or "the parameters are finite"
    warnings.warn(f"optim.fit: epoch {epoch}'s mean log-likelihood is NaN ({why}); a smaller step size or learning "
                  "rate, or a pseudocount, keeps the parameters finite", RuntimeWarning, stacklevel=4)


def _fit_batch(circuit, data, missing, validate, *, epochs, batch_size, start_epoch, mesh):
    """``fit``'s checked arguments: ``(batch, batch size)``, the data prepared by the runtime and the batch size
    clipped to its rows. Over a mesh a batch size of at least the rows is one batch of every row, padded with
    zero-weight rows to a multiple of the mesh's devices (as one device trains on one batch of every row); a
    batch size within the data must be such a multiple."""
    _check_counts("fit", (("epochs", epochs, 0), ("batch_size", batch_size, 1), ("start_epoch", start_epoch, 0)))
    batch = circuit.runtime.prepare(data, missing, validate, what="data")
    if batch.n == 0:
        raise ValueError("fit: data has no rows")
    bs = int(min(batch_size, batch.n))
    if mesh is not None:
        nd = sharded.check_mesh(mesh).shape[sharded.AXIS]
        if batch_size >= batch.n:
            bs = -(-batch.n // nd) * nd
        elif bs % nd:
            raise ValueError(f"fit: batch_size={bs} must be a multiple of the {nd} devices of the mesh")
    return batch, bs


def _check_counts(where: str, items) -> None:
    """Raise a ``ValueError`` naming ``where`` and the argument unless each ``(name, value, lowest)`` of ``items`` is
    an int (Python or NumPy, not a bool) of at least ``lowest``."""
    for name, v, lo in items:
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{where}: {name} must be an int >= {lo}, got {v!r}")


def _check_full_batch(optimizer, n: int, bs: int, drop_remainder: bool) -> None:
    """Raise where a :func:`full_batch_em` optimizer's ``num_batches`` is not the number of batches of ``fit``'s
    epoch: its EM updates would straddle epochs (or come several per epoch), not be full passes."""
    if not (isinstance(optimizer, EMTransformation) and optimizer.config.kind == "full_batch"):
        return
    per_epoch = n // bs if drop_remainder else -(-n // bs)
    if optimizer.config.num_batches != per_epoch:
        how = f"{n} rows // batch_size {bs}" if drop_remainder else f"ceil({n} rows / batch_size {bs})"
        raise ValueError(f"fit: full_batch_em(num_batches={optimizer.config.num_batches}) does not match fit's "
                         f"{per_epoch} batches per epoch ({how}): pass num_batches={per_epoch} (another count makes "
                         "its EM updates straddle epochs)")


def _check_fit_schedule(optimizer, opt_state, fresh: bool, params, epochs: int, n: int, bs: int,
                        drop_remainder: bool) -> None:
    """Raise where the step size schedule of an EM ``optimizer`` breaks its rule at a count that ``fit``'s updates
    use (:func:`jaxpc.optim.transforms.check_schedule`): the ``epochs`` epochs' batches after ``opt_state``'s count
    (0 for a ``fresh`` state; a resumed state's count is read, one scalar). Batches that ``fit`` skips (total weight
    0) take no update, so the counts checked are those of every batch."""
    if not (isinstance(optimizer, EMTransformation) and callable(optimizer.config.step_size)):
        return
    count = opt_state.count
    if isinstance(count, jax.core.Tracer):
        return
    if fresh:
        start = 0
    else:
        with jax.transfer_guard_device_to_host("allow"):  # (one scalar, before the training's work)
            start = int(np.asarray(count))
    per_epoch = n // bs if drop_remainder else -(-n // bs)
    check_schedule(optimizer, start, int(epochs) * per_epoch, dtype=routing.param_dtype(params), where="fit")


def check_step_state(circuit, optimizer, params, opt_state, where: str) -> None:
    """Raise where ``optimizer`` is not an optimizer of ``circuit`` (:func:`fit`'s rule) or ``opt_state`` is not its
    state for ``params`` (``_check_opt_state``); ``where`` names the caller in the message."""
    _check_tx(optimizer, circuit.layout)
    _check_opt_state(circuit, optimizer, params, opt_state, where)


def _check_opt_state(circuit, optimizer, params, opt_state, where: str = "fit") -> None:
    """Raise a ``ValueError`` where ``opt_state`` is not a state of ``optimizer`` for ``params``: None, another pytree
    structure (another optimizer's state, or a checkpoint restored without a template) or another leaf shape. The
    expected state is ``optimizer.init(params)``'s structure and shapes, traced once per optimizer and parameter
    structure (a step's check then flattens ``opt_state`` only)."""
    if opt_state is None:
        raise ValueError(f"{where}: opt_state is None: pass the optimizer's init(params) for the first step, then "
                         "the state the previous step returned")
    treedef = jax.tree_util.tree_structure(params)

    def expected():
        want = jax.eval_shape(optimizer.init, params)
        leaves, tree = jax.tree_util.tree_flatten(want)
        return tree, tuple(tuple(w.shape) for w in leaves), type(want).__name__

    want_tree, want_shapes, want_type = circuit.runtime.constant(("fit_opt_state", _Same(optimizer), treedef),
                                                                 expected)
    got_leaves, got_tree = jax.tree_util.tree_flatten(opt_state)
    if got_tree == want_tree and all(tuple(np.shape(g)) == w for g, w in zip(got_leaves, want_shapes)):
        return
    hint = ("pass the state this optimizer returned (FitResult.opt_state, or the previous step's); a checkpoint "
            "restores it with optimizer.init(params) as its template")
    if got_tree != want_tree:
        got = type(opt_state).__name__
        detail = f"got {got}, expected {want_type}" if got != want_type else f"{got} of another pytree structure"
        raise ValueError(f"{where}: opt_state is not a state of this optimizer ({detail}): {hint}")
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(opt_state)[0], want_shapes):
        if tuple(np.shape(g)) != w:
            raise ValueError(f"{where}: opt_state{jax.tree_util.keystr(path)} has shape {tuple(np.shape(g))}, this "
                             f"optimizer's state has {w}: {hint}")


def _fit_optimizer(circuit, optimizer, step_size, pseudocount):
    """``fit``'s optimizer: ``optimizer``, or the default EM one configured by ``step_size`` and ``pseudocount``
    (which only it takes), checked against the circuit."""
    if optimizer is None:
        optimizer = _default_em(circuit, 0.1 if step_size is None else step_size,
                                0.0 if pseudocount is None else pseudocount)
    elif step_size is not None or pseudocount is not None:
        raise ValueError("fit: step_size and pseudocount configure the default EM optimizer; with optimizer=... set "
                         "them on the optimizer instead")
    _check_tx(optimizer, circuit.layout)
    return optimizer


def _cached_epoch_fn(circuit, optimizer, options, *, normalize: bool, mesh, num_samples: int, batch_size: int,
                     shuffle: bool, drop_remainder: bool, missing_ndim: int | None, check):
    """The epoch of this configuration as a function of its arrays, run through the circuit's executable cache
    (bounded, locked, counted in ``cache_info``) under everything that shapes it, so a repeated ``fit`` call
    reuses its executable."""
    static = dict(options_key(Options.make(options)), optimizer=_Same(optimizer), normalize=bool(normalize),
                  mesh=mesh, num_samples=int(num_samples), batch_size=int(batch_size), shuffle=bool(shuffle),
                  drop_remainder=bool(drop_remainder), missing_ndim=missing_ndim, dtype=circuit.dtype, check=check)
    fn = functools.partial(_epoch_entry, circuit.layout)
    cache = circuit.runtime.cache

    def run(tables, params, state, data, missing, evidence, weights, key, epoch):
        return cache.run("optim.fit", fn, static, {"tables": tables, "params": params, "state": state, "data": data,
                                                   "missing": missing, "evidence": evidence, "weights": weights,
                                                   "key": key, "epoch": epoch})
    return run


def _progress_bar(epochs_iter, progress: bool):
    """``(iterable, bar)``: the epochs wrapped in a tqdm bar when ``progress`` and tqdm is installed, else
    unchanged with bar None."""
    if not progress:
        return epochs_iter, None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the bar is optional (pip install tqdm)
        return epochs_iter, None
    bar = tqdm(epochs_iter, desc="fit", unit="epoch")
    return bar, bar
