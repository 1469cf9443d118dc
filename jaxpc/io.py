"""Saving and loading: a portable file format for circuit structures, and orbax checkpoints of
parameters and optimizer states.

Structure files (:func:`save_structure` / :func:`load_structure`) are one ``.npz`` archive (no pickle:
it is read with ``allow_pickle=False``) holding

* ``__header__``: UTF-8 JSON, ``{"format": "jaxpc.structure", "version": 1, "root": i, "nodes": [...]}``.
  Nodes are listed children first (and a tied vector after the vector it is tied to); each entry has
  its ``kind`` (``input``/``prod``/``sum``), ``name``, ``num_node_blocks``, ``block_size``,
  ``children`` (indices), ``source`` (index of the vector it is tied to, or null), for inputs ``var``
  and ``dist`` (``{"type": "Categorical", "args": {"num_cats": 5}}``), and the names of its arrays;
* the arrays, named ``n<i>.edge_ids`` and ``n<i>.params.<field>`` (parameters given at construction,
  in float64 as the nodes hold them: sum blocks ``[E, Kp, Kc]``, input natural-parameter fields).

Loading rebuilds node vectors through :func:`jaxpc.inputs` / :func:`~jaxpc.multiply` /
:func:`~jaxpc.summate` (so a damaged file fails with their checks) with the same edges, block sizes,
ties, distributions and given parameters: compiling the loaded root gives the same ``circuit.params``
bit for bit. Readers refuse files of a newer ``version``. Distributions outside :mod:`jaxpc.distributions` can
take part through :func:`register_distribution`.

Checkpoints (:func:`save_params` / :func:`load_params`) go through orbax (``pip install
orbax-checkpoint``): a directory with the parameter pytree, an optional optimizer state (optax's or
:mod:`jaxpc.optim`'s) and an integer ``step``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .distributions import (
    Bernoulli,
    Categorical,
    DiscreteLogistic,
    Distribution,
    Gaussian,
    Indicator,
    Literal,
    MaskedCategorical,
)
from .nodes import CircuitNodes, InputNodes, ProdNodes, SumNodes, inputs, multiply, summate, topological_order
from .nodes.nodes import check_smooth

__all__ = ["FORMAT", "VERSION", "save_structure", "load_structure", "register_distribution", "save_params",
           "load_params", "Checkpoint"]

FORMAT = "jaxpc.structure"
VERSION = 1

# type name -> (class, encode(dist) -> JSON-able dict, decode(dict) -> dist)
_DISTS: dict[str, tuple[type, Callable, Callable]] = {}


def register_distribution(cls: type, encode: Callable[[Any], dict], decode: Callable[[dict], Any],
                          name: str | None = None) -> None:
    """Teach the structure format a distribution class: ``encode(dist)`` returns JSON-able constructor
    arguments, ``decode(args)`` rebuilds an equal distribution. ``name`` (default the class name) is
    what the file records."""
    if not (isinstance(cls, type) and issubclass(cls, Distribution)):
        raise TypeError(f"register_distribution: cls must be a Distribution subclass, got {cls!r}")
    _DISTS[name or cls.__name__] = (cls, encode, decode)


register_distribution(Categorical, lambda d: {"num_cats": d.num_cats}, lambda a: Categorical(**a))
register_distribution(Bernoulli, lambda d: {}, lambda a: Bernoulli())
register_distribution(MaskedCategorical, lambda d: {"num_cats": d.num_cats, "mask_mode": d.mask_mode},
                      lambda a: MaskedCategorical(**a))
register_distribution(Gaussian, lambda d: {"min_sigma": d.min_sigma}, lambda a: Gaussian(**a))
register_distribution(DiscreteLogistic,
                      lambda d: {"val_range": [d.lo, d.hi], "num_cats": d.num_cats, "min_std": d.min_std},
                      lambda a: DiscreteLogistic(tuple(a["val_range"]), a["num_cats"], a["min_std"]))
register_distribution(Indicator, lambda d: {"num_states": d.num_states}, lambda a: Indicator(**a))
register_distribution(Literal, lambda d: {"lit": d.lit}, lambda a: Literal(**a))


def _encode_dist(d) -> dict:
    for name, (cls, enc, _) in _DISTS.items():
        if type(d) is cls:
            return {"type": name, "args": enc(d)}
    raise TypeError(f"save_structure: no encoding for distribution {d!r} ({type(d).__module__}.{type(d).__qualname__});"
                    f" register one with jaxpc.io.register_distribution")


def _decode_dist(spec: dict, where: str):
    name = spec.get("type")
    if name not in _DISTS:
        raise ValueError(f"load_structure: {where} uses distribution {name!r}, which is not registered "
                         f"(known: {sorted(_DISTS)})")
    return _DISTS[name][2](spec.get("args", {}))


def save_structure(root_or_circuit, path) -> None:
    """Write the node graph of ``root_or_circuit`` (a root vector or a compiled :class:`jaxpc.Circuit`) to
    ``path`` (one ``.npz`` file, written exactly at ``path``). See the module docstring for the format."""
    from .circuit import Circuit

    if isinstance(root_or_circuit, Circuit):
        root = root_or_circuit.root
    elif isinstance(root_or_circuit, CircuitNodes):
        root = root_or_circuit
    else:
        raise TypeError(f"save_structure: expected a node vector or a jaxpc.Circuit, got "
                        f"{type(root_or_circuit).__name__}")
    order = topological_order(root, follow_ties=True)
    index = {ns.id: i for i, ns in enumerate(order)}
    arrays: dict[str, np.ndarray] = {}
    nodes = []
    for i, ns in enumerate(order):
        entry: dict[str, Any] = {
            "kind": ns.kind, "name": ns.name, "num_node_blocks": ns.num_node_blocks, "block_size": ns.block_size,
            "children": [index[c.id] for c in ns.children],
            "source": None if ns.tied_to is None else index[ns.tied_to.id],
        }
        if isinstance(ns, (ProdNodes, SumNodes)):
            arrays[f"n{i}.edge_ids"] = np.asarray(ns.edge_ids, np.int64)
        if isinstance(ns, InputNodes):
            entry["var"] = ns.var
            entry["dist"] = _encode_dist(ns.dist)
            if ns.own_params is not None:
                entry["params"] = sorted(ns.own_params)
                for k, v in ns.own_params.items():
                    arrays[f"n{i}.params.{k}"] = np.asarray(v)
        elif isinstance(ns, SumNodes) and ns.own_params is not None:
            entry["params"] = ["blocks"]
            arrays[f"n{i}.params.blocks"] = np.asarray(ns.own_params)
        nodes.append(entry)
    from . import __version__

    header = {"format": FORMAT, "version": VERSION, "jaxpc_version": __version__, "root": index[root.id],
              "nodes": nodes}
    arrays["__header__"] = np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8)
    with open(os.fspath(path), "wb") as f:
        np.savez_compressed(f, **arrays)


def load_structure(path) -> CircuitNodes:
    """Read a file written by :func:`save_structure`; returns the root vector (compile it with
    :func:`jaxpc.compile`)."""
    with np.load(os.fspath(path), allow_pickle=False) as z:
        if "__header__" not in z.files:
            raise ValueError(f"load_structure: {path} is not a jaxpc structure file (no __header__)")
        header = json.loads(bytes(z["__header__"]).decode("utf-8"))
        arrays = {k: z[k] for k in z.files if k != "__header__"}
    if header.get("format") != FORMAT:
        raise ValueError(f"load_structure: {path} has format {header.get('format')!r}, expected {FORMAT!r}")
    version = header.get("version")
    if not isinstance(version, int) or version > VERSION or version < 1:
        raise ValueError(f"load_structure: {path} has format version {version!r}; this jaxpc reads versions "
                         f"1..{VERSION} (upgrade jaxpc to read newer files)")
    built: list[CircuitNodes] = []
    for i, e in enumerate(header["nodes"]):
        where = f"node {i} ({e.get('name')!r})"
        children = [built[c] for c in e["children"]]
        src = None if e["source"] is None else built[e["source"]]
        nb, bs, name = int(e["num_node_blocks"]), int(e["block_size"]), e["name"]
        params = {k: arrays[f"n{i}.params.{k}"] for k in e.get("params", [])}
        if e["kind"] == "input":
            dist = _decode_dist(e["dist"], where)
            if src is None:
                ns = inputs(int(e["var"]), num_node_blocks=nb, block_size=bs, dist=dist, name=name)
            else:
                ns = InputNodes(int(e["var"]), nb, bs, dist, source=src, name=name)
            if params:
                ns.load_params(params)
        elif e["kind"] == "prod":
            ns = multiply(*children, edge_ids=arrays[f"n{i}.edge_ids"], name=name)
            if ns.block_size != bs or ns.num_node_blocks != nb:
                raise ValueError(f"load_structure: {where} does not match its recorded sizes")
        elif e["kind"] == "sum":
            edge_ids = arrays[f"n{i}.edge_ids"]
            if src is None:
                ns = summate(*children, num_node_blocks=nb, block_size=bs, edge_ids=edge_ids, name=name)
            else:
                ns = SumNodes(tuple(children), nb, bs, np.asarray(edge_ids, np.int64), source=src, name=name)
                check_smooth(ns)
            if params:
                blocks = np.asarray(params["blocks"], np.float64)
                if blocks.shape != (edge_ids.shape[1], bs, ns.ch_block_size) or not np.all(np.isfinite(blocks)) \
                        or np.any(blocks < 0):
                    raise ValueError(f"load_structure: {where} has invalid sum parameters")
                ns.load_params(blocks)
        else:
            raise ValueError(f"load_structure: {where} has unknown kind {e['kind']!r}")
        built.append(ns)
    return built[int(header["root"])]


# ---- orbax checkpoints ---------------------------------------------------------------------------

class Checkpoint(NamedTuple):
    """What :func:`load_params` returns."""

    params: Any
    opt_state: Any
    step: int | None


def _orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("jaxpc.io.save_params/load_params need orbax: pip install orbax-checkpoint") from e
    return ocp


def save_params(path, params, opt_state=None, *, step: int | None = None, overwrite: bool = False) -> None:
    """Save ``params`` (and an optimizer state, and an integer ``step``) as an orbax checkpoint directory.

    Args:
        path: the checkpoint directory (made absolute; it must not exist unless ``overwrite``).
        params: a params pytree (``circuit.params``-shaped, or an nnx state).
        opt_state: e.g. ``tx.init(params)`` of an optax or :mod:`jaxpc.optim` optimizer (NamedTuples are
            restored as such when :func:`load_params` is given a template).
        step: e.g. the number of epochs done (to resume ``fit`` with ``start_epoch=step``).
    """
    ocp = _orbax()
    if step is not None and (not isinstance(step, (int, np.integer)) or isinstance(step, bool)):
        raise TypeError(f"save_params: step must be an int, got {type(step).__name__}")
    tree = {"params": params, "step": np.asarray(-1 if step is None else step, np.int64)}
    if opt_state is not None:
        tree["opt_state"] = opt_state
    ck = ocp.StandardCheckpointer()
    ck.save(os.path.abspath(os.fspath(path)), tree, force=overwrite)
    ck.wait_until_finished()


def load_params(path, *, params=None, opt_state=None) -> Checkpoint:
    """Load a checkpoint written by :func:`save_params`.

    Args:
        params, opt_state: optional templates (e.g. ``circuit.params`` and ``tx.init(circuit.params)``): the
            restored values get their tree structure (NamedTuple optimizer states), shapes and dtypes.
            Without them the raw nested dicts/lists are returned.

    Returns:
        :class:`Checkpoint` ``(params, opt_state or None, step or None)``.
    """
    import jax

    ocp = _orbax()
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_params: no checkpoint directory at {path}")
    ck = ocp.StandardCheckpointer()
    meta = ck.metadata(path)
    tree_meta = getattr(meta, "item_metadata", meta)
    keys = set(tree_meta.keys()) if hasattr(tree_meta, "keys") else set()
    if "params" not in keys:
        raise ValueError(f"load_params: {path} is not a jaxpc checkpoint (no 'params' entry)")
    has_opt = "opt_state" in keys
    if params is None:
        raw = ck.restore(path)
        out_p, out_s = raw["params"], raw.get("opt_state")
        step = int(raw["step"])
    else:
        target = {"params": params, "step": np.zeros((), np.int64)}
        if has_opt:
            if opt_state is None:
                raise ValueError("load_params: the checkpoint holds an optimizer state; pass opt_state=<template> "
                                 "(e.g. tx.init(params)) to restore it")
            target["opt_state"] = opt_state
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
        raw = ck.restore(path, abstract)
        out_p, out_s = raw["params"], raw.get("opt_state")
        step = int(raw["step"])
    return Checkpoint(out_p, out_s if has_opt else None, None if step < 0 else step)
