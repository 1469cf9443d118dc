"""Data-parallel building blocks: a ``'data'`` mesh and the pure sharded flows and gradient functions.

They are pure functions of the layout (``jax.shard_map`` over the mesh's ``'data'`` axis); the circuit-level
steps of :mod:`jaxpc.parallel` and :func:`jaxpc.optim.fit` with a mesh are built on them. Why exactly one psum
and ``check_vma=False``: see :mod:`jaxpc.parallel`.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from .. import checks
from ..engine import em
from ..ops.logspace import log_psum
from ..options import Options
from .normalize import normalized_log_prob

AXIS = "data"

__all__ = ["AXIS", "data_mesh", "check_mesh", "check_on_mesh", "sharded_flows_and_ll", "sharded_loss_and_grad"]


def check_mesh(mesh) -> Mesh:
    """``mesh`` if it is a mesh with a ``'data'`` axis (the batch is split over it), else a ``TypeError`` /
    ``ValueError`` naming what it is."""
    if not isinstance(mesh, Mesh):
        raise TypeError("mesh must be a jax.sharding.Mesh (e.g. jaxpc.parallel.data_mesh()), got "
                        f"{type(mesh).__name__}")
    if AXIS not in mesh.axis_names:
        raise ValueError(f"mesh must have a '{AXIS}' axis to split the batch over (jaxpc.parallel.data_mesh()), "
                         f"got axes {tuple(mesh.axis_names)}")
    return mesh


def check_on_mesh(mesh: Mesh, x, missing, params, *, weights=None) -> None:
    """A ``ValueError`` naming the devices where ``x``, ``missing``, ``params`` (a pytree: its first leaf) or the
    per-sample ``weights`` were committed to devices other than ``mesh``'s: a data-parallel step moves no committed
    array (JAX refuses one), and the batch goes where the mesh splits it."""
    devices = set(mesh.devices.flat)
    for what, a in (("x", x), ("missing", missing), ("params", next(iter(jax.tree_util.tree_leaves(params)), None)),
                    ("ll_weights", weights)):
        if checks.is_device_array(a) and a.committed \
                and a.sharding.device_set != devices:
            fix = "NamedSharding(mesh, P())" if what == "params" else f"NamedSharding(mesh, P('{AXIS}'))"
            raise ValueError(f"{what} is committed to devices {sorted(d.id for d in a.sharding.device_set)}, but the "
                             f"mesh is over devices {sorted(d.id for d in devices)}: pass it uncommitted (numpy, "
                             f"jnp.asarray) or jax.device_put it with {fix}")


def data_mesh(num_devices: int | None = None, *, devices=None) -> Mesh:
    """A 1-D mesh with axis ``'data'`` over the first ``num_devices`` devices (default: all), or over
    ``devices``. Its axis is of type ``Auto``, so un-annotated inputs are resharded automatically."""
    if devices is None:
        avail = jax.devices()
        n = len(avail) if num_devices is None else num_devices
        if not isinstance(n, numbers.Integral) or isinstance(n, bool) or not 1 <= n <= len(avail):
            raise ValueError(f"data_mesh: num_devices must be an int in [1, {len(avail)}], got {num_devices!r}")
        devices = avail[:int(n)]
    devices = list(devices)
    if not devices:
        raise ValueError("data_mesh: devices is empty")
    return jax.make_mesh((len(devices),), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)


def _missing_spec(missing_ndim: int | None):
    return () if missing_ndim is None else ((P() if missing_ndim == 1 else P(AXIS)),)


def _split(rest, missing_ndim):
    """``(missing, weights, evidence)`` from the arguments after ``x``: ``[missing,] weights[, evidence]``."""
    if missing_ndim is None:
        rest = (None, *rest)
    return rest[0], rest[1], (rest[2] if len(rest) > 2 else None)


def _data_parallel(body, mesh: Mesh, missing_ndim: int | None, out_specs):
    """``f(tables, params, x, [missing,] weights, evidence=None)``: ``body`` under ``shard_map`` with the tables
    and parameters replicated and the batch split over ``'data'``: ``x``, ``weights``, a ``[B, V]`` missing
    mask and every leaf of ``evidence`` (batch first, as :meth:`jaxpc.Circuit.check_evidence` returns it)."""
    specs = (P(), P(), P(AXIS)) + _missing_spec(missing_ndim) + (P(AXIS),)
    plain = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_specs, check_vma=False)
    with_evidence = jax.shard_map(body, mesh=mesh, in_specs=specs + (P(AXIS),), out_specs=out_specs,
                                  check_vma=False)

    def f(*args, evidence=None):
        return plain(*args) if evidence is None else with_evidence(*args, evidence)
    return f


def sharded_flows_and_ll(layout, mesh: Mesh, options: Options, missing_ndim: int | None):
    """A pure ``f(tables, params, x, [missing,] weights, evidence=None) -> (flows, ll)``:
    :func:`jaxpc.engine.em.flows_and_ll` with the batch (``x`` ``[B, V]``, ``weights`` ``[B]``, a ``[B, V]``
    missing mask, every leaf of the per-call ``evidence`` pytree) split over the mesh's ``'data'`` axis and the
    flows summed once (log flows, ``options.logspace_flows``, by a log-domain sum). ``B`` must be a multiple of
    the axis size; ``missing`` is left out when ``missing_ndim`` is None.

    ``layout``: ``circuit.layout``; ``mesh``: a mesh with a ``'data'`` axis (:func:`data_mesh`); ``options``: a
    :class:`jaxpc.Options`; ``missing_ndim``: the missing mask's axes: None (no mask), 1 (``bool[V]``, replicated)
    or 2 (``bool[B, V]``, split with ``x``). Nothing is checked here (:func:`jaxpc.parallel.flows` checks)."""

    def body(tables, params, x, *rest):
        m, w, ev = _split(rest, missing_ndim)
        fl, ll = em.flows_and_ll(layout, tables, params, x, m, w, options, ev)
        return (log_psum(fl, AXIS) if options.logspace_flows else jax.lax.psum(fl, AXIS)), ll

    return _data_parallel(body, mesh, missing_ndim, (P(), P(AXIS)))


def sharded_loss_and_grad(layout, mesh: Mesh, options: Options, missing_ndim: int | None, normalize: bool = True):
    """A pure ``f(tables, params, x, [missing,] weights, evidence=None) -> ((loss, ll), grads)``: the weighted mean
    negative log-likelihood of the (renormalized, with ``normalize``) parameters and its gradient, data-parallel
    (per-device sums, one ``psum`` each for the loss, the weight and the gradient). ``layout``, ``mesh``,
    ``options`` and ``missing_ndim`` as for :func:`sharded_flows_and_ll`; ``normalize``: as for
    :func:`jaxpc.optim.normalized_log_prob` (default ``True``)."""

    def body(tables, params, x, *rest):
        m, w, ev = _split(rest, missing_ndim)

        def local(p):
            ll = normalized_log_prob(layout, tables, p, x, m, options, normalize=normalize, evidence=ev)
            return -em.weighted_ll_sum(ll, w.astype(ll.dtype)), ll

        (nll, ll), g = jax.value_and_grad(local, has_aux=True)(params)
        total = jax.lax.psum(jnp.sum(w), AXIS)
        nll = jax.lax.psum(nll, AXIS) / total
        g = jax.tree_util.tree_map(lambda a: a / total.astype(a.dtype), jax.lax.psum(g, AXIS))
        return (nll, ll), g

    return _data_parallel(body, mesh, missing_ndim, ((P(), P(AXIS)), P()))
