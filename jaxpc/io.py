"""Saving and loading: a portable file format for circuit structures, and orbax checkpoints of
parameters and optimizer states.

Structure files (:func:`save_structure` / :func:`load_structure`) are one ``.npz`` archive (no pickle:
it is read with ``allow_pickle=False``) holding

* ``__header__``: UTF-8 JSON, ``{"format": "jaxpc.structure", "version": 2, "root": i, "nodes": [...]}``.
  Nodes are listed children first (and a tied vector after the vector it is tied to); each entry has
  its ``kind`` (``input``/``prod``/``sum``), ``name``, ``num_node_blocks``, ``block_size``,
  ``children`` (indices), ``source`` (index of the vector it is tied to, or null), for inputs ``var``
  and ``dist`` (``{"type": "Categorical", "args": {"num_cats": 5}}``), for sums with gates
  (:meth:`~jaxpc.nodes.SumNodes.set_gates`) ``gates`` (``{"block_size": b, "tie_to": index or null}``),
  and the names of its arrays;
* the arrays, named ``n<i>.edge_ids`` and ``n<i>.params.<field>`` (parameters given at construction,
  in float64 as the nodes hold them: sum blocks ``[E, Kp, Kc]``, input natural-parameter fields).

Loading rebuilds node vectors through :func:`jaxpc.inputs` / :func:`~jaxpc.multiply` /
:func:`~jaxpc.summate` (so a damaged file fails with their checks) with the same edges, block sizes,
ties, distributions and given parameters: compiling the loaded root gives the same ``circuit.params``
bit for bit, and the same sum gates (:attr:`jaxpc.Circuit.num_gates`, :meth:`~jaxpc.Circuit.gate_slice`).
A file that is not a structure file, or whose header is damaged, raises a ``ValueError`` naming the file
and the damage. Versions: 1 has no ``gates`` (its sums have none); 2 adds them. Readers read every older
version and refuse newer ones. Distributions outside :mod:`jaxpc.distributions` can take part through
:func:`register_distribution`.

Checkpoints (:func:`save_params` / :func:`load_params`) go through orbax (``pip install
orbax-checkpoint``): a directory with the parameter pytree, an optional optimizer state (optax's or
:mod:`jaxpc.optim`'s) and an integer ``step``.
"""

from __future__ import annotations

import json
import os
import zipfile
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from numpy.lib.npyio import NpzFile

from .distributions import (
    Bernoulli,
    Categorical,
    DiscreteLogistic,
    Distribution,
    External,
    Gaussian,
    Indicator,
    Literal,
    MaskedCategorical,
    SoftEvidenceCategorical,
)
from .nodes import CircuitNodes, InputNodes, ProdNodes, SumNodes, inputs, multiply, summate, topological_order
from .nodes.nodes import check_smooth

__all__ = ["FORMAT", "VERSION", "save_structure", "load_structure", "register_distribution", "save_params",
           "load_params", "Checkpoint"]

FORMAT = "jaxpc.structure"
VERSION = 2  # 2: sum gates

# type name -> (class, encode(dist) -> JSON-able dict, decode(dict) -> dist)
_DISTS: dict[str, tuple[type, Callable, Callable]] = {}


def register_distribution(cls: type, encode: Callable[[Any], dict], decode: Callable[[dict], Any],
                          name: str | None = None) -> None:
    """Teach the structure format a distribution class: ``encode(dist)`` returns JSON-able constructor
    arguments, ``decode(args)`` rebuilds an equal distribution. ``name`` (default the class name) is
    what the file records."""
    if not (isinstance(cls, type) and issubclass(cls, Distribution)):
        raise TypeError(f"register_distribution: cls must be a Distribution subclass, got {cls!r}")
    for what, f in (("encode", encode), ("decode", decode)):
        if not callable(f):
            raise TypeError(f"register_distribution: {what} must be callable, got {type(f).__name__}")
    if name is not None and (not isinstance(name, str) or not name):
        raise TypeError(f"register_distribution: name must be a non-empty str or None, got {name!r}")
    _DISTS[name or cls.__name__] = (cls, encode, decode)


register_distribution(Categorical, lambda d: {"num_cats": d.num_cats}, lambda a: Categorical(**a))
register_distribution(Bernoulli, lambda d: {}, lambda a: Bernoulli())
register_distribution(MaskedCategorical, lambda d: {"num_cats": d.num_cats, "mask_mode": d.mask_mode},
                      lambda a: MaskedCategorical(**a))
register_distribution(Gaussian, lambda d: {"mu": d.mu, "sigma": d.sigma, "min_sigma": d.min_sigma},
                      lambda a: Gaussian(**a))
register_distribution(DiscreteLogistic,
                      lambda d: {"val_range": [d.lo, d.hi], "num_cats": d.num_cats, "min_std": d.min_std},
                      lambda a: DiscreteLogistic(tuple(a["val_range"]), a["num_cats"], a["min_std"]))
register_distribution(Indicator, lambda d: {"num_states": d.num_states}, lambda a: Indicator(**a))
register_distribution(Literal, lambda d: {"lit": d.lit}, lambda a: Literal(**a))
register_distribution(SoftEvidenceCategorical, lambda d: {"num_cats": d.num_cats},
                      lambda a: SoftEvidenceCategorical(**a))
register_distribution(External, lambda d: {}, lambda a: External())


def _encode_dist(d) -> dict:
    for name, (cls, enc, _) in _DISTS.items():
        if type(d) is cls:
            return {"type": name, "args": enc(d)}
    raise TypeError(f"save_structure: no encoding for distribution {d!r} ({type(d).__module__}.{type(d).__qualname__});"
                    f" register one with jaxpc.io.register_distribution")


class _Damaged(ValueError):
    """A structure file's header or arrays do not describe a valid graph (re-raised naming the file)."""


def _decode_dist(spec, where: str):
    name = spec.get("type") if isinstance(spec, dict) else None
    if name not in _DISTS:
        raise ValueError(f"{where} uses distribution {name!r}, which is not registered with "
                         f"jaxpc.io.register_distribution (known: {sorted(_DISTS)})")
    args = spec.get("args", {})
    try:
        return _DISTS[name][2](args)
    except (TypeError, ValueError, KeyError) as e:
        raise _Damaged(f"{where} has invalid arguments {args!r} for distribution {name!r}: {e}") from None


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
        if isinstance(ns, SumNodes) and ns.gates is not None:
            entry["gates"] = {"block_size": ns.gates.block_size, "tie_to": _gate_tie_index(ns, index)}
        nodes.append(entry)
    from . import __version__

    header = {"format": FORMAT, "version": VERSION, "jaxpc_version": __version__, "root": index[root.id],
              "nodes": nodes}
    arrays["__header__"] = np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8)
    with open(os.fspath(path), "wb") as f:
        np.savez_compressed(f, **arrays)


def _gate_tie_index(ns: SumNodes, index: dict[int, int]) -> int | None:
    tie = ns.gates.tie_to
    if tie is None:
        return None
    if tie.id not in index:
        raise ValueError(f"save_structure: {ns.name} reads the gates of {tie.name}, which is not part of the saved "
                         f"graph (jaxpc.compile would reject it too)")
    return index[tie.id]


def _read_npz(path) -> tuple[dict, dict[str, np.ndarray]]:
    """``(header, arrays)`` of a structure file; a file that is not one raises ``ValueError``."""
    not_ours = f"load_structure: {path} is not a jaxpc structure file"
    try:
        z = np.load(os.fspath(path), allow_pickle=False)
    except (ValueError, EOFError, zipfile.BadZipFile):
        raise ValueError(f"{not_ours} (not an .npz archive)") from None
    if not isinstance(z, NpzFile):
        raise ValueError(f"{not_ours} (a single .npy array, not an .npz archive)")
    with z:
        if "__header__" not in z.files:
            raise ValueError(f"{not_ours} (no __header__)")
        try:
            header = json.loads(bytes(z["__header__"]).decode("utf-8"))
            arrays = {k: z[k] for k in z.files if k != "__header__"}
        except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
            raise ValueError(f"load_structure: {path} is damaged: unreadable header or arrays ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{not_ours} (its __header__ is not a JSON object)")
    return header, arrays


def _field(e: dict, key: str, where: str, types: type | tuple[type, ...], optional: bool = False):
    """``e[key]`` checked against ``types`` (bools are not ints); a missing or null field is damage unless
    ``optional`` (then it reads as None)."""
    v = e.get(key)
    if v is None:
        if optional:
            return None
        raise _Damaged(f"{where} has no {key!r} field")
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(v, types) and not (isinstance(v, bool) and bool not in types):
        return v
    raise _Damaged(f"{where} has an invalid {key!r} field: {v!r}")


def _ref(i: Any, upper: int, what: str, where: str, among: str = "a node listed before it") -> int:
    """A node index in ``[0, upper)``: children and sources are listed before the nodes that use them."""
    if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < upper:
        span = f"0..{upper - 1}" if upper else "there is none"
        raise _Damaged(f"{where} has {what} {i!r}, which is not the index of {among} ({span})")
    return i


def _array(arrays: dict[str, np.ndarray], key: str, where: str) -> np.ndarray:
    if key not in arrays:
        raise _Damaged(f"{where} misses its array {key!r}")
    return arrays[key]


def _input_params(dist, params: dict[str, np.ndarray], num_nodes: int, where: str) -> dict[str, np.ndarray]:
    """An input vector's stored parameters, checked as ``inputs(params=...)`` checks a user's (shapes, fields,
    finite values in the distribution's domain; a ``MaskedCategorical`` stores its mask in the boolean
    ``full_mask`` form) and returned as stored, so that they load bit for bit."""
    check = MaskedCategorical(dist.num_cats, "full_mask") if isinstance(dist, MaskedCategorical) else dist
    try:
        check.canonical_params(dict(params), num_nodes, where)
    except (TypeError, ValueError) as e:
        msg = str(e)
        raise _Damaged(msg if msg.startswith(where) else f"{where} has invalid parameters: {msg}") from None
    return params


def load_structure(path) -> CircuitNodes:
    """Read a file written by :func:`save_structure`; returns the root vector (compile it with
    :func:`jaxpc.compile`). A file that is not a structure file, or a damaged one, raises ``ValueError``.

    ``path``: the file (a ``str`` or path-like, read exactly at ``path``: no extension is added); a missing file
    raises ``FileNotFoundError``, a ``path`` of another type a ``TypeError``."""
    header, arrays = _read_npz(path)
    if header.get("format") != FORMAT:
        raise ValueError(f"load_structure: {path} has format {header.get('format')!r}, expected {FORMAT!r}")
    version = header.get("version")
    if not isinstance(version, int) or version > VERSION or version < 1:
        raise ValueError(f"load_structure: {path} has format version {version!r}; this jaxpc reads versions "
                         f"1..{VERSION} (upgrade jaxpc to read newer files)")
    try:
        return _build(header, arrays)
    except _Damaged as e:
        raise ValueError(f"load_structure: {path} is damaged: {e}") from None
    except (TypeError, ValueError) as e:  # an unregistered distribution, a check of the node constructors or set_gates
        raise ValueError(f"load_structure: {path}: {e}") from None


def _build(header: dict, arrays: dict[str, np.ndarray]) -> CircuitNodes:
    """The root vector of a structure file's header and arrays; damage raises :class:`_Damaged`."""
    entries = _field(header, "nodes", "the header", list)
    if not entries:
        raise _Damaged("the header lists no nodes")
    root = _ref(_field(header, "root", "the header", int), len(entries), "root", "the header", "a node of the file")
    built: list[CircuitNodes] = []
    gates: dict[int, dict] = {}
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise _Damaged(f"node {i} is not a JSON object: {e!r}")
        name = _field(e, "name", f"node {i}", str)
        where = f"node {i} ({name!r})"
        kind = _field(e, "kind", where, str)
        nb = _field(e, "num_node_blocks", where, int)
        bs = _field(e, "block_size", where, int)
        children = [built[_ref(c, i, "child", where)] for c in _field(e, "children", where, list)]
        source = _field(e, "source", where, int, optional=True)
        src = None if source is None else built[_ref(source, i, "source", where)]
        params = {k: _array(arrays, f"n{i}.params.{k}", where) for k in _field(e, "params", where, list, True) or []}
        if src is not None and src.kind != kind:
            raise _Damaged(f"{where} is a {kind} vector tied to node {source}, a {src.kind} vector")
        if src is not None and params:
            raise _Damaged(f"{where} is tied to node {source} but has parameters of its own")
        if kind == "input":
            if children:
                raise _Damaged(f"{where} is an input vector with children")
            var = _field(e, "var", where, int)
            dist = _decode_dist(_field(e, "dist", where, dict), where)
            if src is None:
                ns = inputs(var, num_node_blocks=nb, block_size=bs, dist=dist, name=name)
            else:
                if (dist, nb, bs) != (src.dist, src.num_node_blocks, src.block_size):
                    raise _Damaged(f"{where} is tied to node {source} but has another distribution or shape "
                                   f"({dist!r}, {nb} x {bs} nodes against {src.dist!r}, {src.num_node_blocks} x "
                                   f"{src.block_size})")
                ns = InputNodes(var, nb, bs, dist, source=src, name=name)
            if params:
                ns.load_params(_input_params(dist, params, ns.num_nodes, where))
        elif kind == "prod":
            ns = multiply(*children, edge_ids=_array(arrays, f"n{i}.edge_ids", where), name=name)
            if ns.block_size != bs or ns.num_node_blocks != nb:
                raise _Damaged(f"{where} does not match its recorded sizes")
        elif kind == "sum":
            edge_ids = np.asarray(_array(arrays, f"n{i}.edge_ids", where))
            if edge_ids.ndim != 2 or edge_ids.shape[0] != 2 or not np.issubdtype(edge_ids.dtype, np.integer):
                raise _Damaged(f"{where} has edge ids of shape {edge_ids.shape} and dtype {edge_ids.dtype}, "
                               f"expected integers of shape [2, num_edge_blocks]")
            if not children:
                raise _Damaged(f"{where} is a sum without children")
            if src is None:
                ns = summate(*children, num_node_blocks=nb, block_size=bs, edge_ids=edge_ids, name=name)
            else:
                ns = SumNodes(tuple(children), nb, bs, np.asarray(edge_ids, np.int64), source=src, name=name)
                check_smooth(ns)
            if params:
                if set(params) != {"blocks"}:
                    raise _Damaged(f"{where} has sum parameters {sorted(params)}, expected ['blocks']")
                blocks = np.asarray(params["blocks"], np.float64)
                if blocks.shape != (edge_ids.shape[1], bs, ns.ch_block_size):
                    raise _Damaged(f"{where} has invalid sum parameters")
                try:  # finite, non-negative, no node without weight
                    ns.set_params(blocks)
                except ValueError as e:
                    raise _Damaged(f"{where} has invalid sum parameters: {e}") from None
                ns.load_params(blocks)  # as stored, bit for bit (set_params renormalizes the rows)
            g = _field(e, "gates", where, dict, optional=True)
            if g is not None:
                gates[i] = g
        else:
            raise _Damaged(f"{where} has unknown kind {kind!r}")
        built.append(ns)
    # gate ties may point at a vector listed later, so gates are set once every vector exists
    for i, g in gates.items():
        where = f"node {i} ({built[i].name!r})"
        gbs = _field(g, "block_size", f"{where}'s gates", int)
        tie = _field(g, "tie_to", f"{where}'s gates", int, optional=True)
        tie_ns = None if tie is None else built[_ref(tie, len(built), "gates tied to", where, "a node of the file")]
        built[i].set_gates(gbs, tie_to=tie_ns)
    return built[root]


# ---- orbax checkpoints ---------------------------------------------------------------------------

class Checkpoint(NamedTuple):
    """What :func:`load_params` returns: ``params``, the restored parameters; ``opt_state``, the optimizer state
    or None where none was saved; ``step``, the saved ``step`` or None."""

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
        step: a non-negative int, e.g. the number of epochs done (to resume ``fit`` with ``start_epoch=step``).
        overwrite: where ``path`` exists, False (the default) raises a ``ValueError`` and leaves it as it is;
            True deletes it (the whole directory, whatever it holds) and writes the checkpoint in its place.
    """
    import jax

    ocp = _orbax()
    if not jax.tree_util.tree_leaves(params):
        raise ValueError(f"save_params: params holds no arrays (got {params!r}); pass a params pytree such as "
                         f"circuit.params")
    if step is not None and (not isinstance(step, (int, np.integer)) or isinstance(step, bool)):
        raise TypeError(f"save_params: step must be a non-negative int, got {type(step).__name__} {step!r}")
    if step is not None and step < 0:
        raise ValueError(f"save_params: step must be a non-negative int, got {step}")
    path = os.path.abspath(os.fspath(path))
    if not overwrite and os.path.lexists(path):
        raise ValueError(f"save_params: {path} already exists; pass overwrite=True to replace it (its contents are "
                         "deleted), or save to a new path")
    tree = {"params": params, "step": np.asarray(-1 if step is None else step, np.int64)}
    if opt_state is not None:
        tree["opt_state"] = opt_state
    ck = ocp.StandardCheckpointer()
    ck.save(path, tree, force=overwrite)
    ck.wait_until_finished()


def load_params(path, *, params=None, opt_state=None) -> Checkpoint:
    """Load a checkpoint written by :func:`save_params`.

    Args:
        path: the checkpoint directory :func:`save_params` wrote (a ``str`` or path-like, made absolute); where no
            directory is there, a ``FileNotFoundError``.
        params, opt_state: optional templates (e.g. ``circuit.params`` and ``tx.init(circuit.params)``): the
            restored values get their tree structure (NamedTuple optimizer states), shapes and dtypes.
            Without them the raw nested dicts/lists are returned; ``opt_state`` alone is a ``ValueError``. With
            ``params``, ``opt_state`` is needed exactly when the checkpoint holds an optimizer state (else a
            ``ValueError``). Templates of another circuit or optimizer (other leaves or shapes than the
            checkpoint's) raise a ``ValueError`` naming the leaves.

    Returns:
        :class:`Checkpoint` ``(params, opt_state or None, step or None)``.
    """
    import jax

    ocp = _orbax()
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_params: no checkpoint directory at {path}")
    if params is None and opt_state is not None:
        raise ValueError("load_params: opt_state=<template> needs params=<template> too (e.g. circuit.params); "
                         "without templates the raw nested dicts/lists are returned")
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
        elif opt_state is not None:
            raise ValueError(f"load_params: {path} holds no optimizer state (save_params was given none), but "
                             "opt_state=<template> asks for one; drop opt_state= and start the optimizer anew "
                             "(tx.init(params))")
        stored = getattr(tree_meta, "tree", tree_meta)
        _check_template(path, stored, target)
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, target)
        try:
            raw = ck.restore(path, abstract)
        except ValueError as e:  # orbax's tree mismatch suggests an option load_params does not have
            raise ValueError(_mismatch_message(path, stored, target, e)) from None
        out_p, out_s = raw["params"], raw.get("opt_state")
        step = int(raw["step"])
    return Checkpoint(out_p, out_s if has_opt else None, None if step < 0 else step)


def _leaf_shapes(tree) -> dict[str, tuple[int, ...] | None]:
    """``{"params.sum.4x4": shape}`` for the leaves of a pytree (dict keys, sequence indices and attribute names
    alike, as orbax stores them); None where a leaf has no shape."""
    import jax

    def part(k) -> str:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                return str(getattr(k, attr))
        return str(k)

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(part(k) for k in p): (tuple(leaf.shape) if hasattr(leaf, "shape") else None) for p, leaf in leaves}


def _mismatch_message(path: str, stored, target, err: Exception) -> str:
    """A ``load_params`` error naming the leaves that the checkpoint and the templates do not share (orbax's
    ``err`` where they share them all)."""
    have, want = set(_leaf_shapes(stored)), set(_leaf_shapes(target))
    first = {"params": 0, "opt_state": 1}  # the params' leaves first: they tell the circuits apart
    only_file, only_tmpl = (sorted(names, key=lambda n: (first.get(n.split(".")[0], 2), n))
                            for names in (have - want, want - have))
    if not only_file and not only_tmpl:
        return f"load_params: {path} could not be restored into the templates: {err}"

    def some(names):
        return ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "") if names else "none"
    return (f"load_params: {path} does not match the templates: leaves in the checkpoint but not in the templates: "
            f"{some(only_file)}; in the templates but not in the checkpoint: {some(only_tmpl)}; the templates must "
            f"come from the circuit (and optimizer) that the checkpoint was saved from")


def _check_template(path: str, stored, target) -> None:
    """Raise ``ValueError`` naming the first template leaf whose shape differs from the stored one (orbax would
    fail deep inside its restore); leaves the stored tree lacks are left to orbax."""
    have = _leaf_shapes(stored)
    for name, shape in _leaf_shapes(target).items():
        if name == "step" or shape is None or have.get(name) is None:
            continue
        if have[name] != shape:
            raise ValueError(f"load_params: {path} stores {name} with shape {list(have[name])}, but the template "
                             f"has shape {list(shape)}; the templates must come from the circuit (and optimizer) "
                             f"that the checkpoint was saved from")
