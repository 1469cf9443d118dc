"""Data-parallel flows, EM and gradient steps over the devices of one host (``jax.shard_map``).

The batch is split along a ``'data'`` mesh axis; every device evaluates the whole circuit on its
shard (parameters and index tables are replicated), and the per-device flows (or gradients) are
summed with exactly one ``psum``. The EM update then runs replicated, so every device ends with the
same parameters, identical to one device's result up to the order of the additions.

Why exactly one psum, and ``check_vma=False``: flows are ``jax.grad`` of the summed log-likelihood
with respect to the (replicated) parameters. Under ``shard_map``'s default ``check_vma=True`` JAX
tracks that the parameters are device-invariant and already sums their gradient over the axis, so an
explicit ``psum`` on top would double the flows. The bodies here run with ``check_vma=False``, where
the gradient stays per device, and add one ``psum``. ``tests/test_parallel.py`` checks the total root
flow equals the batch size, which a doubled (or missing) psum breaks.

A batch whose size is not a multiple of the device count is padded with zero-weight rows (they
contribute exactly nothing; the returned log-likelihoods are cut back to the batch). Per-call ``evidence``
(soft evidence, external leaf values, per-sample sum parameters; see :meth:`jaxpc.Circuit.check_evidence`)
has the batch first in every leaf: it is checked like ``Circuit.flows`` checks it (the values of device arrays
too, under ``validate``), padded and split with the batch.

``jax.pmap``. The same step written by hand: the per-device body calls the engine's pure
:func:`jaxpc.engine.em.flows_and_ll` and sums the flows with one ``jax.lax.psum`` (``pmap`` runs its body
as ``shard_map`` does here, with ``check_vma=False``, so the gradient of the replicated parameters stays
per device), and :func:`split_batch` lays a checked batch out as ``[devices, B / devices, ...]`` with the
padding rows weighing zero. ``docs/design.md`` has the recipe; ``tests/test_parallel.py`` runs it.

Models too large for one device (not built; how it would go). Data parallelism replicates the
parameters and the node buffer ``[R, B/n]``; when the parameters or the buffer of one sample no longer
fit, partition the *layers* instead. The compiled layout is a sequence of stages, each a set of
independent product and sum partitions that read rows of earlier stages only. A layer-partitioned
engine would

1. give each device a contiguous range of every stage's output rows (balanced by edge count), and the
   parameter blocks ``params["sum"][group][pid]`` those rows use (``pid`` tables are split with them,
   so each device holds ``1/n`` of the weights; tied blocks used by several devices are replicated and
   their flows ``psum``-ed over the devices that use them);
2. after each stage, ``all_gather`` only the rows that later stages on *other* devices read (the
   compiler knows every child row of every partition, so it can emit the exchange lists statically);
   for PD/HCLT-like structures most reads are local once rows are assigned by region;
3. run the top-down flow pass in reverse with the transposed exchange (``psum_scatter`` of child
   flows into their owners), so parameter flows are produced where the parameters live and the EM
   update needs no communication at all.

Combined with the ``'data'`` axis this is a 2-D mesh ``('data', 'model')``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .engine import em
from .optim.sharded import AXIS, check_mesh, check_on_mesh, data_mesh, sharded_flows_and_ll, sharded_loss_and_grad
from .optim.train import check_step_state
from .optim.transforms import EMTransformation, check_circuit, record_step_check
from .options import Options
from .runtime import LOG_FLOWS, declare_entries, pad_args

Array = jax.Array

__all__ = ["AXIS", "data_mesh", "sharded_flows_and_ll", "sharded_loss_and_grad", "flows", "em_step",
           "loss_and_grad", "train_step", "DeviceBatch", "split_batch"]


# ---- circuit-level functions ----------------------------------------------------------------------
# Each goes through the circuit's runtime (jaxpc.runtime): checked inputs, batches padded to a bucket that is a
# multiple of the mesh's devices (padding rows weigh zero), one cached executable per (mesh, options, shapes). A step
# that repeats the previous one's arguments other than the batch and the ``free`` ones (params, optimizer state, EM's
# step size and pseudocount), without weights or evidence, replays its executable (``Runtime.replay``).

def _mesh(mesh):
    return data_mesh() if mesh is None else check_mesh(mesh)


def _ndim(m):
    return None if m is None else m.ndim


def _p_flows(layout, tables, params, x, missing, weights, evidence, *, mesh, options):
    f = sharded_flows_and_ll(layout, mesh, options, _ndim(missing))
    return f(tables, params, x, *(() if missing is None else (missing,)), weights, evidence=evidence)


def _p_em_step(layout, tables, params, x, missing, weights, evidence, step_size, pseudocount, *, mesh, options):
    em.check_em_options(options, "parallel.em_step")
    fl, ll = _p_flows(layout, tables, params, x, missing, weights, evidence, mesh=mesh, options=options)
    return em.em_update(layout, tables, params, fl, step_size, pseudocount, options.compute_param_flows), ll


def _p_grad(layout, tables, params, x, missing, weights, evidence, *, mesh, options, normalize):
    f = sharded_loss_and_grad(layout, mesh, options, _ndim(missing), normalize)
    (loss, ll), g = f(tables, params, x, *(() if missing is None else (missing,)), weights, evidence=evidence)
    return (loss, g), ll


def _p_train_step(layout, tables, params, opt_state, x, missing, weights, evidence, *, mesh, options, normalize,
                  tx):
    from .optim.train import make_step

    step = make_step(layout, tx, normalize=normalize, options=options, mesh=mesh, missing_ndim=_ndim(missing))
    p, s, ll = step(tables, params, opt_state, x, missing, weights, evidence)
    return (p, s), ll


# name -> (pure function, batch axis of each output)
_ENTRIES = {"parallel.flows": (_p_flows, (None, 0)), "parallel.em_step": (_p_em_step, (None, 0)),
            "parallel.grad": (_p_grad, ((None, None), 0)), "parallel.train_step": (_p_train_step, ((None, None), 0))}
declare_entries(*_ENTRIES)


def _run(circuit, name, static, args, x, missing, ll_weights, evidence, validate, mesh, options, free=("params",)):
    check_circuit(circuit, "parallel.loss_and_grad" if name == "parallel.grad" else name)
    rt = circuit.runtime
    replay = None
    if ll_weights is None and evidence is None:  # a repeated step replays (Runtime.replay)
        replay = (name, mesh, *sorted(static.items()), options, validate)
        out = rt.replay(replay, x, missing, **{k: args[k] for k in free})
        if out is not None:
            return out
    rt.entry(name, *_ENTRIES[name], circuit.layout)
    mesh = _mesh(mesh)
    batch = rt.prepare(x, missing, validate)
    check_on_mesh(mesh, batch.x, batch.missing, args.get("params"))
    ev, record = circuit.prepare_evidence(evidence, batch, name)
    nonnegative = (True if name == "parallel.em_step" else
                   LOG_FLOWS if name == "parallel.flows" and Options.make(options).logspace_flows else False)
    w = rt.weights(ll_weights, batch.n, nonnegative=nonnegative)
    record_w = rt.weights_check(ll_weights, w, batch, nonnegative, name)
    if name == "parallel.grad" or (name == "parallel.train_step" and not isinstance(static["tx"], EMTransformation)):
        where = "parallel.loss_and_grad" if name == "parallel.grad" else name
        record_w = _and(record_w, _check_weight_total(rt, ll_weights, w, batch, where))
    args = {"tables": rt.replicated(circuit.tables, NamedSharding(mesh, P())), **args, "evidence": ev}
    out = rt.run(name, {"mesh": mesh, **static}, args, batch, options=Options.make(options), batched={"evidence": 0},
                 weights=w, multiple=mesh.shape[AXIS], sharding=NamedSharding(mesh, P(AXIS)), replay=replay,
                 free=free)
    record()  # the device evidence's and weights' values, as the circuit's own calls check them
    record_w()
    return out


def _and(*records):
    """One record function that calls each of ``records``."""
    def record():
        for r in records:
            r()
    return record


def _bad_total(w: Array) -> Array:
    """Whether the weights of a weighted mean sum to no positive total: a scalar bool."""
    return ~(jnp.sum(w) > 0)


def _raise_bad_total(host: np.ndarray, where: str, when: str = "") -> None:
    """The ``ValueError`` of ``ll_weights`` whose total is not positive (host values)."""
    total = float(np.sum(host.astype(np.float64)))
    if not total > 0:
        raise ValueError(f"{where}: ll_weights must sum to a positive total (the loss is the weighted mean "
                         f"log-likelihood, divided by it), got a sum of {total}{when}")


def _explain_bad_total(w: Array, where: str) -> None:
    """The error of device weights whose total the device check found not positive."""
    with jax.transfer_guard_device_to_host("allow"):  # (an error's message, not the call's data path)
        host = np.asarray(w)
    _raise_bad_total(host, where, " (checked on the device: that call's outputs are not valid)")
    raise ValueError(f"{where}: the device check found ll_weights' total not positive; the host check did not")


def _check_weight_total(rt, ll_weights, w, batch, where: str):
    """The weights of a weighted mean (the loss of a gradient step) must sum to a positive total: host weights are
    checked at once, device weights by a deferred check (the circuit's next call raises); returns its record
    function (a no-op for host weights, None and tracers)."""
    if ll_weights is None or isinstance(ll_weights, jax.core.Tracer):
        return lambda: None
    if not isinstance(ll_weights, jax.Array):
        _raise_bad_total(np.asarray(ll_weights), where)
        return lambda: None
    return rt.deferred_check(batch, "parallel_weight_total_flag", _bad_total, {"w": w},
                             functools.partial(_explain_bad_total, w, where))


def flows(circuit, params: dict, x, missing=None, *, mesh: Mesh | None = None, ll_weights=None,
          options: Options | None = None, validate: bool | str = True, return_ll: bool = False,
          evidence: dict | None = None):
    """``circuit.flows`` with the batch split over ``mesh`` (default: all devices). Returns the flows
    (replicated), and ``ll`` ``[B]`` with ``return_ll``.

    ``evidence``: per-call evidence as for :meth:`jaxpc.Circuit.flows` (checked by
    :meth:`~jaxpc.Circuit.check_evidence`); every leaf's leading batch axis is padded and split with ``x``.
    ``circuit``, ``params``, ``x``, ``missing``, ``mesh``, ``options`` and ``validate`` as for :func:`em_step`;
    ``ll_weights`` ``[B]``: finite per-sample weights, as for :meth:`jaxpc.Circuit.flows`. With
    ``Options(logspace_flows=True)`` the devices' log flows are added in the log domain and returned as a
    :class:`~jaxpc.engine.logflows.LogFlows`, which EM updates refuse (as :meth:`jaxpc.Circuit.flows`' log flows)."""
    fl, ll = _run(circuit, "parallel.flows", {}, {"params": params}, x, missing, ll_weights, evidence, validate, mesh,
                  options)
    return (fl, ll) if return_ll else fl


def em_step(circuit, params: dict, x, missing=None, *, mesh: Mesh | None = None, step_size: float = 1.0,
            pseudocount: float = 0.0, ll_weights=None, options: Options | None = None, validate: bool | str = True,
            return_ll: bool = False, evidence: dict | None = None):
    """``circuit.em_step`` data-parallel: sharded flows, one psum, the update replicated on every device.
    ``evidence``: as for :func:`flows`.

    Args:
        circuit: a compiled :class:`jaxpc.Circuit` (anything else is a ``TypeError``).
        params: a params pytree of ``circuit`` (replicated over the mesh).
        x: ``[B, V]`` samples, as for :meth:`jaxpc.Circuit.em_step`; any ``B``: the batch is padded with zero-weight
            rows to a multiple of the mesh's devices.
        missing: ``bool[B, V]`` or ``bool[V]``, or None (default); True marks a variable to marginalize.
        mesh: a :class:`jax.sharding.Mesh` with a ``'data'`` axis to split the batch over (default None:
            :func:`data_mesh`, all devices); another type is a ``TypeError``, a mesh without the axis a
            ``ValueError``, as is an ``x``, ``missing`` or ``params`` committed to other devices.
        step_size: as for :meth:`jaxpc.Circuit.em_step`: a finite float in (0, 1] (default 1).
        pseudocount: as for :meth:`jaxpc.Circuit.em_step`: a finite float >= 0 (default 0).
        ll_weights: optional ``[B]`` per-sample weights, finite and >= 0 (default None: all 1), checked as for
            :meth:`jaxpc.Circuit.em_step`.
        options: a full :class:`jaxpc.Options` (``logspace_flows`` is refused: EM takes linear flows).
        validate: ``True`` (default), ``"sync"`` or ``False``, as for :meth:`jaxpc.Circuit.log_prob`.
        return_ll: also return the batch's log-likelihoods ``[B]`` under ``params``: ``(new_params, ll)``.
        evidence: per-call evidence, as for :func:`flows`.
    """
    check_circuit(circuit, "parallel.em_step")  # (before its runtime is read)
    step, pseudo = circuit.runtime.em_scalars(step_size, pseudocount)
    new, ll = _run(circuit, "parallel.em_step", {}, {"params": params, "step_size": step, "pseudocount": pseudo},
                   x, missing, ll_weights, evidence, validate, mesh, options, ("params", "step_size", "pseudocount"))
    return (new, ll) if return_ll else new


def loss_and_grad(circuit, params: dict, x, missing=None, *, mesh: Mesh | None = None, normalize: bool = True,
                  ll_weights=None, options: Options | None = None, validate: bool | str = True,
                  evidence: dict | None = None):
    """``(loss, grads)``: the mean negative log-likelihood of ``normalize(params)`` (``params`` are logits) and
    its gradient with respect to ``params``, data-parallel over ``mesh``. ``evidence``: as for :func:`flows`.
    ``normalize``: renormalize the logits first (default ``True``; ``False``: ``params`` are log-parameters taken as
    they are). ``ll_weights`` ``[B]``: finite per-sample weights of the mean (default None: all 1) with a positive
    total (the mean divides by it; else a ``ValueError``, for device weights at the circuit's next call).
    ``circuit``, ``x``, ``missing``, ``options`` and ``validate`` as for :func:`em_step`."""
    (loss, g), _ = _run(circuit, "parallel.grad", {"normalize": bool(normalize)}, {"params": params}, x, missing,
                        ll_weights, evidence, validate, mesh, options)
    return loss, g


def train_step(circuit, tx, params: dict, opt_state, x, missing=None, *, mesh: Mesh | None = None,
               normalize: bool = True, ll_weights=None, options: Options | None = None, validate: bool | str = True,
               evidence: dict | None = None):
    """One data-parallel optimizer step with an EM transformation (:mod:`jaxpc.optim`) or any optax
    transformation: ``(params, opt_state, ll [B])``. See :func:`jaxpc.optim.make_step`. ``evidence``: as for
    :func:`flows`.

    ``opt_state``: ``tx.init(params)`` for the first step, then the state the previous step returned (checked as
    :func:`jaxpc.optim.fit` checks it: None or another optimizer's state raises a ``ValueError``).
    ``tx``: the transformation; ``normalize``: as for :func:`jaxpc.optim.make_step` (default ``True``); ``ll_weights``
    ``[B]``: finite per-sample weights (default None: all 1; with an optax ``tx`` their total must be positive, as for
    :func:`loss_and_grad`). ``circuit``, ``params``, ``x``, ``missing``, ``mesh``, ``options`` and ``validate`` as for
    :func:`em_step`; with ``validate``, an EM step size schedule's value is checked as the batch's values are (outside
    its rule, the step's parameters are NaN and the circuit's next call raises; see :mod:`jaxpc.optim.transforms`)."""
    check_circuit(circuit, "parallel.train_step")
    check_step_state(circuit, tx, params, opt_state, "parallel.train_step")
    (p, s), ll = _run(circuit, "parallel.train_step", {"normalize": bool(normalize), "tx": tx},
                      {"params": params, "opt_state": opt_state}, x, missing, ll_weights, evidence, validate, mesh,
                      options, ("params", "opt_state"))
    if validate:
        record_step_check(circuit.runtime, tx, opt_state, params, sync=validate == "sync")
    return p, s, ll


# ---- a batch laid out for jax.pmap ------------------------------------------------------------------

class DeviceBatch(NamedTuple):
    """A checked batch laid out for ``jax.pmap`` (:func:`split_batch`): ``D`` devices, ``b`` rows each.

    Attributes:
        x: ``[D, b, V]``.
        missing: None, ``bool[D, b, V]``, or ``bool[V]`` shared by every sample (pass it with ``in_axes=None``).
        weights: ``[D, b]``: the samples' weights (one without ``ll_weights``), zero on the padding rows.
        evidence: None, or the checked evidence with every leaf ``[D, b, ...]``.
        n: rows of the caller's batch: ``ll.reshape(-1)[:n]`` are its log-likelihoods.
    """

    x: Array
    missing: Array | None
    weights: Array
    evidence: dict | None
    n: int


def split_batch(circuit, x, missing=None, *, num_devices: int | None = None, evidence: dict | None = None,
                ll_weights=None, validate: bool | str = True) -> DeviceBatch:
    """``x`` ``[B, V]`` (with its ``missing`` mask, per-call ``evidence`` and ``ll_weights``) checked as
    :meth:`jaxpc.Circuit.flows` checks them, padded to the circuit's bucket rounded up to a multiple of
    ``num_devices`` (default: ``jax.local_device_count()``) and reshaped to ``[num_devices, bucket /
    num_devices, ...]`` for a ``jax.pmap``-ed step. Padding rows copy the first row and weigh zero, so a step
    that weights its samples (``flows_and_ll(..., weights, ...)``) ignores them; batch sizes of one bucket share
    one shape (one pmap executable).

    ``circuit``: a compiled :class:`jaxpc.Circuit` (anything else is a ``TypeError``); ``num_devices``: a positive
    int (else a ``ValueError``).
    ``validate``: as for ``Circuit.flows``, except that the values of a device ``x`` are not checked (its
    shape and dtype are): only the circuit's own entry points run the in-executable check. The values of device
    ``evidence`` are (:meth:`jaxpc.Circuit.check_evidence`): the circuit's next call raises a failure (with
    ``validate="sync"``, this one).
    """
    check_circuit(circuit, "parallel.split_batch")
    d = jax.local_device_count() if num_devices is None else num_devices
    if not isinstance(d, (int, np.integer)) or isinstance(d, bool) or d < 1:
        raise ValueError(f"split_batch: num_devices must be a positive int, got {num_devices!r}")
    rt = circuit.runtime
    batch = rt.prepare(x, missing, validate)
    n = batch.n
    ev, record = circuit.prepare_evidence(evidence, batch, "parallel.split_batch")
    w = rt.weights(ll_weights, n)
    record_w = rt.weights_check(ll_weights, w, batch, False, "parallel.split_batch")
    args = {"x": batch.x, "missing": batch.missing, "evidence": ev,
            "weights": jnp.asarray(np.ones((n,), rt.dtype)) if w is None else w}
    b = rt.bucket(n, int(d))
    args = pad_args(args, n, b, {"evidence": 0}, rt.dtype)

    def per_device(a):
        return a.reshape(int(d), b // int(d), *a.shape[1:])

    record()
    record_w()
    m = args["missing"]
    return DeviceBatch(per_device(args["x"]), m if m is None or m.ndim == 1 else per_device(m),
                       per_device(args["weights"]), jax.tree_util.tree_map(per_device, args["evidence"]), n)
