"""The one call path of every entry point: check, pad to the bucket, run the cached executable, slice.

A :class:`Runtime` belongs to one circuit and holds everything per circuit that outlives a call: the
variables' admissible values, the batch buckets, the executable cache, device constants and the input
checks still in flight. Every public entry point (the :class:`~jaxpc.Circuit` methods, queries,
``parallel``, ``optim`` and ``nn``) goes through :meth:`Runtime.prepare` and :meth:`Runtime.run`.

**Input checks.** ``validate`` takes three values:

* ``True`` (default): numpy (host) data are checked before anything runs and raise at once. Device
  arrays are checked inside the executable that does the work: a row with a bad value (an
  out-of-range or fractional category, a NaN or infinite observed value) gets a NaN log-likelihood
  (``-1`` for integer outputs), takes no part in flows and EM (its weight is zero, so parameters stay
  finite). A one-kernel executable dispatched right after the work computes the batch's flag (an output of
  the work's executable that the host holds on to would make XLA's runtime record that executable's kernels
  again for the next call's new output addresses) and writes it to pinned host memory, where reading it
  takes microseconds. The flag of a call is read by the circuit's **next call** (any entry point) right
  after that call's work has been dispatched, so the device never waits for the host
  (``benchmarks/check_cost.py`` measures the alternatives);
  that call then raises the ``ValueError`` naming the variable and the value. :meth:`Runtime.raise_pending`
  (``circuit.raise_pending()``) waits for and raises it at once. Other per-call values with a rule are checked the
  same way (:meth:`Runtime.record_check`, one small reduction per call: soft evidence's weights must be finite and
  non-negative; per-call ``evidence=`` must hold log-values without NaN or +inf, non-negative LowRank factors and
  top-k ids of the soft leaves' values, distinct in a row, :meth:`jaxpc.Circuit.check_evidence`; the counts among
  the flows of :meth:`jaxpc.Circuit.em_update` must be >= 0, which negated flows are not); their numpy values are
  checked on the host and raise at once, as a numpy batch's.
* ``"sync"``: the same check, then waits for the call's own flag and raises at once (for debugging); it also
  checks the parameters' values (:meth:`Runtime.check_params_now`: NaN or +inf, named with leaf and index), which
  the other modes do not read (a NaN parameter gives NaN outputs).
* ``False``: no value check at all (a bad value then gives NaN or a clamped value, unchecked).

Inside a user's ``jit`` (tracer inputs) the check still cleans the batch and marks its rows NaN, but
nothing can raise from inside a trace; traced evidence (or evidence of a traced batch) is not checked at all.

**Repeated calls.** A small batch's step waits for the host's work before its executable starts. A call of
``flows``, ``log_prob`` or ``em_step`` whose arguments other than ``params``, ``x`` and EM's step size and
pseudocount (of :mod:`jaxpc.parallel`'s steps, other than their ``free`` ones; of the queries ``conditional``,
``mpe`` and ``sample``, other than ``params``, ``x`` and the PRNG key) equal the previous such call's
(options, ``validate``; no weights or evidence), on a batch and a ``missing`` mask (or none) of the same kinds
(device array or numpy), shapes and dtypes, replays that call's executables (:meth:`Runtime.replay`; a batch short
of its bucket also its padding and the outputs' cut): no option resolution, batch checks or keys, the same input
check and outputs. A numpy batch's values are still checked on the host first (where the mask observes them), and
the executable takes a copy of it (JAX's transfer of a numpy array is a fraction of ``jnp.asarray``'s host time; on
a CPU the executable reads it in place while it runs, so never the caller's buffer, which may be refilled at once).
Anything else takes the full path.

**Devices.** A call runs where its data (``x``, ``missing``) and parameters were committed (``jax.device_put`` to a
device, or parameters replicated over a mesh by :mod:`jaxpc.parallel`), else where the circuit's tables are; the
tables follow it (placed there once), and uncommitted arguments (Python numbers, numpy, ``jnp.asarray``,
``jax.random.key``) go with it, as under ``jax.jit``. As ``jax.jit`` refuses committed arguments on different devices,
data and parameters committed to different devices raise a ``ValueError`` naming them, and so does any other argument
(a PRNG key, a step size, ``ll_weights``, evidence, flows) committed to devices other than where the call runs: on a
first call and on a repeated one alike (a replay whose committed arguments would place the full call elsewhere than
the remembered one takes the full path, which moves or refuses them). Where JAX's default backend has one device
there is nothing to check, and no call pays for it.

**Kept copies.** What a call derives from its parameters alone and would otherwise make anew on every call (the
tree's weights rounded to TF32 and transposed, where its levels run on clusters) is made once per parameter array
(:meth:`Runtime.kept`: arrays are immutable, so the copy stays true while the array lives) and handed to the
executable as an argument: a repeated call on the same parameters reads it; a step whose parameters changed makes
it again.

**Precision.** ``Options(precision="default")`` follows JAX's default matmul precision
(``jax.default_matmul_precision``): TF32 on NVIDIA GPUs, exact float32 elsewhere or when JAX's setting
is ``"highest"``/``"float32"``. The call resolves it before the key is made, and the key also holds
JAX's setting, so changing it never replays an executable compiled under another.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import checks
from .engine import routing, stages
from .executables import BucketPolicy, ExecutableCache, owner_digest, put_constant
from .options import Options, matmul_setting, resolve_precision

Array = jax.Array

__all__ = ["Runtime", "Batch", "Entry", "VALIDATE", "resolve_options", "options_key", "jax_settings",
           "resolve_precision", "check_em_args", "pad_args", "mask_key", "declare_entries", "ENTRY_POINTS"]

VALIDATE = (True, False, "sync")

# the names of all entry points whose modules are imported: what Circuit.compiled(name) may be asked for
ENTRY_POINTS: set[str] = set()


def declare_entries(*names: str) -> None:
    """Add ``names`` to :data:`ENTRY_POINTS` (each module that runs executables declares its entry points once, on
    import)."""
    ENTRY_POINTS.update(names)


@dataclasses.dataclass(frozen=True)
class Entry:
    """A pure entry point ``fn(**args, **static)`` and where its outputs hold the batch.

    ``rows``: a pytree prefix of the outputs giving each output's batch axis (None: no batch axis, e.g.
    flows or parameters). Outputs with a batch axis are sliced back to the caller's rows and, under the
    input check, set to NaN (floats) or -1 (integers) on bad rows.
    """

    fn: Callable
    rows: Any = 0


@dataclasses.dataclass
class Batch:
    """A checked batch: ``x`` ``[n, V]`` and ``missing`` as jnp arrays, ``n`` rows, and how its values are
    checked: ``check`` (the executable's device check runs) and ``report`` (its flag is read: the values
    were a device array and not checked on the host). ``host``: the dtype of the numpy array the caller passed
    (None for anything else); ``mkey``: :func:`mask_key` of the caller's ``missing``."""

    x: Array
    missing: Array | None
    n: int
    check: bool
    report: bool
    sync: bool
    traced: bool
    host: Any = None
    mkey: Any = None  # the mask's kind and shape for the replay's key (None: no mask; False: not replayable)


@dataclasses.dataclass
class _Pending:
    flag: Array
    x: Array
    missing: Array | None
    where: str
    explain: Callable[[], None] | None = None  # raises the error of a flag that is not about x (record_check)


@dataclasses.dataclass(frozen=True)
class _Replay:
    """A call that :meth:`Runtime.replay` repeats: the cache's entry whose executable it ran, that executable's
    other arguments (``values``, None at the positions of ``x`` (``ix``) and of the arguments in ``slots``: the
    remembered call's own are not kept alive) and the caches' generations then, the layout ``x`` must have
    (``xtype``: a concrete device array's type, or ``np.ndarray``: then ``host_check`` tells whether its values are
    checked on the host, and ``target`` is the dtype the executable takes), JAX's matmul setting the key holds
    (``_ANY``: none) and its other settings (:func:`jax_settings`), and how the input flag is handled."""

    entry: Any
    values: tuple
    generation: tuple
    slots: tuple  # (name, position) of each argument the replay takes anew besides x
    ix: int
    xtype: type
    dtype: Any
    matmul: Any
    settings: Any
    name: str
    report: bool
    sync: bool
    pad: Any = None  # a batch short of its bucket: the helpers' entries that pad x and cut the outputs back
    head: Any = None
    rows: Any = None
    host_check: bool = False
    target: Any = None
    im: int | None = None  # the mask's position among the executable's arguments (None: no mask)
    devices: Any = None  # the devices the call ran on (None: not known, or the default backend has one device)
    placed: bool = False  # whether committed data or parameters moved it off the tables' devices (placement)


_ANY = object()
KEPT_WEIGHT_BYTES: int = 2 << 30  # tree weight copies a circuit keeps between calls, at most (HCLT-512: 1.2 GB)
REPLAYS: int = 64  # replayable calls per circuit, at most (then forgotten at once)

_RESOLVED: dict = {}  # (options, JAX's matmul setting) -> resolved options (a replace reruns Options' checks)


def resolve_options(options: Options) -> Options:
    """``options`` with ``precision="default"`` resolved (:func:`resolve_precision`)."""
    if options.precision != "default":
        return options
    key = (options, matmul_setting())
    hit = _RESOLVED.get(key)
    if hit is None:
        if len(_RESOLVED) > 256:
            _RESOLVED.clear()
        hit = _RESOLVED[key] = options.replace(precision=resolve_precision("default"))
    return hit


def jax_settings() -> tuple:
    """JAX's settings besides the matmul precision that change what a traced function computes: 64-bit types, the
    PRNG implementation and its partitionable bits (``sample``'s draws), rank promotion."""
    c = jax.config
    return c.jax_enable_x64, c.jax_default_prng_impl, c.jax_threefry_partitionable, c.jax_numpy_rank_promotion


def options_key(options: Options) -> dict:
    """What an executable's key holds of ``options``: the resolved options, JAX's settings (``_jax``:
    :func:`jax_settings`) and, where the precision follows JAX's, JAX's matmul setting (``_matmul``); the last two
    in the key only (see :func:`checked`), so that changing one compiles anew as ``jax.jit`` does."""
    key = {"options": resolve_options(options), "_jax": jax_settings()}
    if options.precision == "default":
        key["_matmul"] = matmul_setting()
    return key


@functools.partial(jax.jit, static_argnames=("bucket", "axis"))
def pad_rows(a: Array, bucket: int, axis: int = 0) -> Array:
    """Pad ``axis`` to ``bucket`` with copies of the first row (valid data)."""
    pad = bucket - a.shape[axis]
    if pad <= 0:
        return a
    first = jax.lax.slice_in_dim(a, 0, 1, axis=axis)
    shape = list(a.shape)
    shape[axis] = pad
    return jnp.concatenate([a, jnp.broadcast_to(first, shape)], axis=axis)


@functools.partial(jax.jit, static_argnames=("n", "axis"))
def head(a: Array, n: int, axis: int = 0) -> Array:
    """The first ``n`` entries along ``axis`` (a compiled static slice: no host transfer)."""
    return jax.lax.slice_in_dim(a, 0, n, axis=axis)


def _valid_rows(bucket: int, n: int, dtype) -> np.ndarray:
    """Weights ``[bucket]``: one on the first ``n`` rows, zero on the padding (made on the host: no compile)."""
    return (np.arange(bucket) < n).astype(dtype)


@functools.partial(jax.jit, static_argnames=("bucket", "n", "dtype"))
def _pad_weights(w: Array, bucket: int, n: int, dtype) -> Array:
    w = w[:n].astype(dtype)
    return jnp.concatenate([w, jnp.zeros((bucket - n,), dtype)]) if bucket > n else w


def _mark_rows(out, rows, bad):
    """Outputs with bad rows set to NaN (floats) or -1 (integers), following the ``rows`` prefix."""
    def mark(axis, a):
        shape = [1] * a.ndim
        shape[axis] = a.shape[axis]
        fill = jnp.nan if jnp.issubdtype(a.dtype, jnp.floating) else -1
        return jnp.where(bad.reshape(shape), jnp.asarray(fill, a.dtype), a)
    return _map_rows(mark, rows, out)


def _map_rows(f, rows, out):
    """``f(axis, leaf)`` on every leaf of ``out`` under a ``rows`` prefix leaf that names a batch axis (the
    outputs under a None prefix leaf are left as they are)."""
    return jax.tree_util.tree_map(lambda axis, sub: sub if axis is None else jax.tree_util.tree_map(
        functools.partial(f, axis), sub), rows, out, is_leaf=lambda r: r is None)


def pad_args(args: dict, n: int, b: int, batched: dict | None, dtype) -> dict:
    """``args`` with their batch axes padded from ``n`` to ``b`` rows: ``x``, a per-sample ``missing``, the
    ``batched`` arguments (every leaf, along the named axis; e.g. ``{"evidence": 0}``) and ``weights`` (zero on
    the padding); the padding rows of the others are copies of the first row (valid data)."""
    out = dict(args)
    for k, axis in (("x", 0), ("missing", 0), *(batched or {}).items()):
        v = args.get(k)
        if v is None or (k == "missing" and v.ndim == 1):
            continue
        out[k] = jax.tree_util.tree_map(lambda t, ax=axis: pad_rows(t, b, ax), v)
    if args.get("weights") is not None:
        out["weights"] = _pad_weights(args["weights"], b, n, dtype)
    return out


def _pad_entry(*, n: int, b: int, batched: tuple, dtype, **args) -> dict:
    """:func:`pad_args` of the batch-carrying arguments as one executable (per batch size: one compile)."""
    return pad_args(args, n, b, dict(batched), dtype)


def _head_entry(parts: list, *, axes: tuple, n: int) -> list:
    """Each of ``parts`` (output subtrees) cut back to ``n`` rows along its axis in ``axes``, as one executable."""
    return [jax.tree_util.tree_map(lambda a, ax=ax: head(a, n, ax), p) for p, ax in zip(parts, axes)]


def _split_rows(out, rows):
    """``(subtrees with a batch axis, their axes, rebuild)`` of ``out`` under the ``rows`` prefix; ``rebuild(new)``
    puts ``new`` (one subtree per axis) back among the untouched ones."""
    axes, treedef = jax.tree_util.tree_flatten(rows, is_leaf=lambda r: r is None)
    subs = treedef.flatten_up_to(out)
    idx = [i for i, ax in enumerate(axes) if ax is not None]

    def rebuild(new):
        full = list(subs)
        for i, v in zip(idx, new):
            full[i] = v
        return jax.tree_util.tree_unflatten(treedef, full)
    return [subs[i] for i in idx], tuple(axes[i] for i in idx), rebuild


def mask_key(missing):
    """The kind and shape of a call's ``missing`` in the replay's key: None without one, False where the call is not
    replayed (a mask that is neither a numpy nor a concrete device array)."""
    if missing is None:
        return None
    if isinstance(missing, np.ndarray):
        return np.ndarray, missing.shape
    if checks.is_device_array(missing):
        return type(missing), missing.shape
    return False


def _row_axes(rows) -> tuple:
    """The batch axes of the outputs that ``rows`` names (:func:`_split_rows`' second value)."""
    axes = jax.tree_util.tree_leaves(rows, is_leaf=lambda r: r is None)
    return tuple(ax for ax in axes if ax is not None)


def checked(entry: Entry) -> Callable:
    """``entry.fn`` under the input check: ``f(**args, _check=..., **static) -> outputs`` with bad entries
    cleaned, bad rows weighing zero and their outputs marked. With ``_check=None`` it runs unchanged.
    (A partial of a module function: its digest names the stored executable, see ``jaxpc.executables``.)"""
    return functools.partial(_run_checked, entry)


def _run_checked(entry: Entry, *, _check=None, _matmul=None, _jax=None, **kw):
    del _matmul, _jax  # part of the key only
    if _check is None:
        return entry.fn(**kw)
    x, bad = _check.apply(kw["x"], kw.get("missing"))
    kw["x"] = x
    if kw.get("weights") is not None:
        kw["weights"] = jnp.where(bad, jnp.zeros((), kw["weights"].dtype), kw["weights"])
    return _mark_rows(entry.fn(**kw), entry.rows, bad)


def _any_bad(x, missing, *, check, host: bool):
    """The flag of a batch: whether any observed entry is bad (a one-kernel executable of its own, so the
    work's executable has no output that the host holds on to). ``host``: the flag is written to pinned host
    memory, where the host reads it in microseconds (a read from device memory takes 0.3-0.6 ms on the H200)."""
    bad = jnp.any(check.apply(x, missing)[1])
    return jax.device_put(bad, jax.memory.Space.Host) if host else bad


def _flag_of(*, bad: Callable, host: bool, **args):
    """:meth:`Runtime.record_check`'s executable: ``bad(**args)``, in pinned host memory where ``host``."""
    flag = bad(**args)
    return jax.device_put(flag, jax.memory.Space.Host) if host else flag


def _explain_params(params, where: str) -> None:
    """The error of parameters whose device check found NaN or +inf."""
    checks.raise_bad_params(params, where=where)
    raise ValueError("params held a value that the device check rejected; the host check found none")


def _raise_bad_weights(host: np.ndarray, nonnegative: bool | str, where: str = "") -> None:
    """The ``ValueError`` of ``ll_weights`` (host values) that are not finite, or negative where ``nonnegative`` (True:
    an EM step's weights; a str: whose weights they are, e.g. ``LOG_FLOWS``)."""
    flat = host.astype(np.float64).ravel()
    bad = np.flatnonzero(~np.isfinite(flat))
    more = f" ({bad.size} such weights in all)" if bad.size > 1 else ""
    if bad.size:
        raise ValueError(f"ll_weights must be finite; ll_weights[{bad[0]}] is {host.ravel()[bad[0]]}{more}{where}")
    neg = np.flatnonzero(flat < 0) if nonnegative else ()
    more = f" ({len(neg)} such weights in all)" if len(neg) > 1 else ""
    if len(neg):
        whose = nonnegative if isinstance(nonnegative, str) else "an EM step"
        raise ValueError(f"ll_weights of {whose} must be >= 0 (a negative weight makes negative expected "
                         f"counts); ll_weights[{neg[0]}] is {host.ravel()[neg[0]]}{more}{where}")


# whose weights must be non-negative besides an EM step's (``nonnegative`` of Runtime.weights): negative counts have
# no logarithm
LOG_FLOWS = "log-space flows (Options(logspace_flows=True))"


def _bad_weights(w: Array) -> Array:
    return ~jnp.all(jnp.isfinite(w))


def _bad_em_weights(w: Array) -> Array:
    return ~jnp.all(jnp.isfinite(w) & (w >= 0))


def _explain_weights(w: Array, nonnegative: bool | str, where: str) -> None:
    """The error of device weights whose check found a bad value."""
    with jax.transfer_guard_device_to_host("allow"):  # (an error's message, not the call's data path)
        host = np.asarray(w)
    _raise_bad_weights(host, nonnegative, f" (in {where}, checked on the device: that call's outputs are not valid)")
    raise ValueError("ll_weights held a value that the device check rejected; the host check found none")


def _no_check() -> None:
    """A :meth:`Runtime.deferred_check` with nothing to check."""


def _sharding(a):
    """A device array's sharding (part of the key of an executable it is passed to); None for other arrays."""
    return a.sharding if checks.is_device_array(a) else None


def _pinned_host(x: Array) -> bool:
    """Whether ``x`` lives on one device that has pinned host memory for the flag (GPUs and CPUs do)."""
    devices = x.devices()
    if len(devices) != 1:
        return False
    (device,) = devices
    try:
        return any(m.kind == "pinned_host" for m in device.addressable_memories())
    except Exception:  # noqa: BLE001 - a backend without memory kinds: the flag stays in device memory
        return False


_UNSEEN = object()
# the arguments that decide where a call runs (placement), or that are made where it runs (the tables, the kept copies)
_PLACING = frozenset({"tables", "x", "missing", "params", "tree_weights"})


def _placed_alike(r: _Replay, x, missing, free: dict) -> bool:
    """Whether the full call on ``x``, ``missing`` and the ``free`` values would run where the remembered call ``r``
    ran: every committed one sits on ``r``'s devices and, where the remembered call was moved off the tables'
    devices, the data or the parameters are committed there (else the full call runs on the tables' devices, or
    refuses an argument committed elsewhere: :meth:`Runtime.placement`)."""
    arrays = _array_types()
    moved = False
    for name, a in (("x", x), ("missing", missing), *free.items()):
        if type(a) is dict:
            a = _first_leaf(a)
        # (only a concrete device array is committed: not numpy, a number, a tracer or a function that makes a value)
        if type(a) not in arrays or not a.committed:
            continue
        if a.sharding.device_set != r.devices:
            return False
        moved = moved or name in ("x", "missing", "params")
    return moved or not r.placed


@functools.cache
def _several_devices() -> bool:
    """Whether JAX's default backend has more than one device: only then can an argument sit on another device than
    a remembered call's (a replay checks it there alone: :func:`_placed_alike`)."""
    return jax.device_count() > 1


@functools.cache
def _array_types() -> frozenset:
    """The concrete types of JAX's device arrays and typed PRNG keys (``jax.Array`` is abstract: an ``isinstance``
    against it is slow)."""
    # (made once, maybe first under a caller's guard, or inside a trace: concrete arrays all the same)
    with jax.transfer_guard("allow"), jax.ensure_compile_time_eval():
        return frozenset({type(jnp.zeros((), jnp.int32)), type(jax.random.key(0))})


def _first_leaf(tree):
    """The first array of a pytree of nested dicts (parameters), or None."""
    for _ in range(8):
        if type(tree) is not dict:
            return tree
        for v in tree.values():
            if type(v) is not dict or v:
                tree = v
                break
        else:
            return None
    return None


class Runtime:
    """Per-circuit state of the call path (see the module docstring)."""

    def __init__(self, var_info: checks.VarInfo, dtype, cache: ExecutableCache | None = None,
                 buckets: BucketPolicy | None = None):
        self.var_info = var_info
        self.dtype = jnp.dtype(dtype)
        self.cache = cache or ExecutableCache()
        self.buckets = buckets or BucketPolicy()
        self.device_check = checks.DeviceCheck(var_info)
        # the call path's own executables: the input flag (per bucket), padding and slicing (per batch size)
        self._helpers = ExecutableCache(max_executables=128, max_layouts_per_entry=1 << 30)  # one per size: no warning
        self._entries: dict[str, tuple[Entry, Callable]] = {}
        self._constants: dict = {}
        self._flag_exes: dict = {}  # layout -> the flag's executable
        self._pending: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self.params_spec: checks.ParamsSpec | None = None  # what an entry's ``params`` must look like (set_params)
        self._sum_spec: checks.ParamsSpec | None = None
        self._input_keys: list = []
        self._param_fields: dict = {}
        self.stat_fields: dict[str, tuple] = {}  # input layer -> its flows' statistics (Distribution.stat_fields)
        self.cache.check_args = self._check_args
        self._replays: dict = {}  # (call key, x's shape and kind, the mask's mask_key) -> _Replay
        self._em_scalars: dict = {}  # (step_size, pseudocount) -> their device scalars
        self._kept: dict = {}  # key -> (weak reference to the source array, what was made from it)
        self._weight_routes: dict = {}  # (call key, bucket) -> routing.tree_weight_copies
        self._placements: dict = {}  # a committed argument's sharding -> where the call runs (placement)
        self._home = None  # the devices of the circuit's tables
        # whether the circuit's tree may run on clusters (its tables hold their schedules): only then does a call look
        # for kept weight copies (:meth:`tree_weights`)
        self.clusters = False

    def set_params(self, params) -> None:
        """Take ``params``' structure and shapes, and the circuit's dtype, as what every entry's ``params`` argument
        must have, checked (:func:`jaxpc.checks.check_params`) before an executable is compiled or traced for it."""
        self.params_spec = checks.ParamsSpec.of(params, self.dtype)
        self._sum_spec = checks.ParamsSpec.of(params["sum"], self.dtype)
        self._input_keys = sorted(params["input"])
        self._param_fields = {k: sorted(v) for k, v in params["input"].items()}

    def _check_args(self, args: dict) -> None:
        if self.params_spec is None:
            return
        if "params" in args:
            checks.check_params(self.params_spec, args["params"])
        if "flows" in args:
            self.check_flows(args["flows"])

    def check_flows(self, flows, parts: tuple[str, ...] = ("sum", "input"), stats: bool = True) -> None:
        """Check the ``parts`` of ``flows`` against what the circuit's ``flows`` returns: ``"sum"``, the sum groups'
        flows shaped like their params (:func:`jaxpc.checks.check_params`); ``"input"``, one entry per input
        layer, with ``stats`` holding the layer's statistics (:attr:`Distribution.stat_fields`: what an EM update
        reads). Wherever ``flows`` has an input layer that holds its parameters' fields in place of its statistics,
        it is refused, whatever ``parts`` and ``stats`` say: params given for flows (their sum parts look alike)."""
        if self.params_spec is None:
            return
        layers = flows.get("input") if isinstance(flows, dict) else None
        for key, got in layers.items() if isinstance(layers, dict) else ():
            fields = sorted(self.stat_fields.get(key, ()))
            if isinstance(got, dict) and sorted(got) != fields and sorted(got) == self._param_fields.get(key):
                raise ValueError(f"flows['input'][{key!r}] holds the layer's parameters {sorted(got)}, not its "
                                 f"statistics {fields} (what circuit.flows returns): params given for flows?")
        if not isinstance(flows, dict) or not set(parts) <= set(flows):
            raise ValueError(f"flows must be what circuit.flows returns (a dict with {' and '.join(map(repr, parts))}"
                             "), got " + (f"keys {sorted(flows)}" if isinstance(flows, dict) else type(flows).__name__))
        if "sum" in parts:
            checks.check_params(self._sum_spec, flows["sum"], "flows['sum']")
        if "input" in parts and (not isinstance(flows["input"], dict) or sorted(flows["input"]) != self._input_keys):
            got = sorted(flows["input"]) if isinstance(flows["input"], dict) else type(flows["input"]).__name__
            raise ValueError(f"flows['input'] must have one entry per input layer {self._input_keys}, got {got}")
        for key, fields in self.stat_fields.items() if "input" in parts and stats else ():
            got = flows["input"][key]
            if not isinstance(got, dict) or sorted(got) != sorted(fields):
                have = sorted(got) if isinstance(got, dict) else type(got).__name__
                raise ValueError(f"flows['input'][{key!r}] must hold the layer's statistics {sorted(fields)} (what "
                                 f"circuit.flows returns), got {have}")

    def load_ahead(self, *owner) -> None:
        """Start loading the stored executables that earlier processes ran for the circuit named by ``owner`` (its
        entry points' and the call path's own, under the digest of ``owner`` computed once;
        :meth:`ExecutableCache.load_ahead`)."""
        self.cache.load_ahead(lambda: owner_digest(*owner))
        self._helpers.load_ahead(lambda: (name := self.cache.owner()) and f"{name}-call-path")

    # ---- entry points -------------------------------------------------------------------------
    def register(self, name: str, entry: Entry) -> None:
        """Make ``entry`` callable as ``name`` (idempotent for the same name)."""
        with self._lock:
            if name not in self._entries:
                self._entries[name] = (entry, checked(entry))

    def entry(self, name: str, fn: Callable, rows: Any, *bind, unroll: bool = True) -> None:
        """Register ``functools.partial(fn, *bind)`` (e.g. bound to the circuit's layout) as ``name`` on first use;
        later calls do nothing. ``unroll=False``: the entry's optimized compile keeps the scanned stages that it
        would run unrolled (:func:`jaxpc.executables.optimized_options`)."""
        if name not in self._entries:
            if not unroll:
                self.cache.scanned.add(name)
            self.register(name, Entry(functools.partial(fn, *bind), rows))

    # ---- checks -------------------------------------------------------------------------------
    def prepare(self, x, missing=None, validate=True, *, what: str = "x") -> Batch:
        """Check shapes and dtypes (and host values) of a batch; see the module docstring for ``validate``."""
        if validate not in VALIDATE:
            raise ValueError(f"validate must be True, False or 'sync', got {validate!r}")
        xj, mj, on_device = checks.check_batch(self.var_info, x, missing, check_values=bool(validate),
                                                    float_dtype=self.dtype, what=what)
        traced = isinstance(xj, jax.core.Tracer) or isinstance(mj, jax.core.Tracer)
        return Batch(xj, mj, int(xj.shape[0]), check=bool(validate), report=bool(validate) and on_device and not traced,
                     sync=validate == "sync", traced=traced, host=x.dtype if isinstance(x, np.ndarray) else None,
                     mkey=mask_key(missing))

    def raise_pending(self) -> None:
        """Wait for the input checks of earlier calls and raise the first failure (a ``ValueError`` naming the
        variable and the value); clears them."""
        self._settle()

    def _settle(self) -> None:
        """Read the pending flags in call order and raise the first failure."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                p = self._pending.popleft()
            with jax.transfer_guard_device_to_host("allow"):  # the flag's byte, not the user's data
                bad = bool(np.asarray(p.flag))
            if bad:
                with self._lock:
                    self._pending.clear()
                if p.explain is not None:
                    p.explain()
                checks.raise_bad_values(self.var_info, p.x, p.missing, "x",
                                        f"circuit.{p.where}, checked on the device; its rows gave NaN")

    def _flag(self, x: Array, missing: Array | None) -> Array:
        """The flag of a padded batch: one stored executable per layout and sharding (made through the call path's
        cache), then called directly."""
        key = (x.shape, x.dtype, _sharding(x), None if missing is None else (missing.shape, _sharding(missing)))
        exe = self._flag_exes.get(key)
        if exe is not None:
            return exe(x, missing)
        static, args = {"check": self.device_check, "host": _pinned_host(x)}, {"x": x, "missing": missing}
        out = self._helpers.run("input_flag", _any_bad, static, args)
        exe = self._helpers.executable("input_flag", static, args)
        with self._lock:
            if exe is not None and len(self._flag_exes) < 64:
                self._flag_exes[key] = exe
        return out

    def _record(self, flag: Array, batch: Batch, where: str) -> None:
        with self._lock:
            self._pending.append(_Pending(flag, batch.x, batch.missing, where))

    def record_check(self, name: str, bad: Callable, args: dict, explain: Callable[[], None], sync: bool) -> None:
        """Check arguments other than the batch on the device, as the batch's values are: ``bad(**args)``, a boolean
        scalar, runs as a one-kernel executable of the call path (``name`` its entry) that writes it to pinned host
        memory; the circuit's next call (or this one with ``sync``, or :meth:`raise_pending`) reads it and, where it
        is True, calls ``explain()``, which raises the ``ValueError``. Call it right after the call's work is
        dispatched."""
        x = next(iter(jax.tree_util.tree_leaves(args)))
        flag = self._helpers.run(name, _flag_of, {"bad": bad, "host": _pinned_host(x)}, args)
        with self._lock:
            self._pending.append(_Pending(flag, x, None, name, explain))
        if sync:
            self._settle()

    def check_params_now(self, params, where: str = " (checked with validate='sync')") -> None:
        """Raise the ``ValueError`` of :func:`jaxpc.checks.raise_bad_params` at once where ``params`` (device or
        numpy arrays; tracers and None pass) hold NaN or +inf: one reduction on the device, the parameters read on
        the host only where it finds one. Calls with ``validate="sync"`` run it after their own check."""
        leaves = jax.tree_util.tree_leaves(params)
        if not leaves or any(isinstance(v, jax.core.Tracer) for v in leaves):
            return
        if not all(isinstance(v, jax.Array) for v in leaves):  # (numpy parameters: read where they are)
            checks.raise_bad_params(params, where=where)
            return
        self.record_check("params_flag", checks.any_bad_params, {"params": params},
                          functools.partial(_explain_params, params, where), sync=True)

    # ---- constants ----------------------------------------------------------------------------
    def constant(self, key, make) -> Any:
        """A device constant made by ``make()`` once per ``key`` (bounded), concrete even when the call is traced
        (a call inside ``jax.jit`` would otherwise keep a tracer for the calls after it)."""
        hit = self._constants.get(key)
        if hit is not None:
            return hit
        with self._lock:
            if key not in self._constants:
                if len(self._constants) > 256:
                    self._constants.clear()
                with jax.ensure_compile_time_eval():
                    self._constants[key] = make()
            return self._constants[key]

    def kept(self, key, source: Array, make: Callable[[Array], Any]) -> Any:
        """``make(source)`` for the device array ``source``, made once while it lives: one copy per ``key``, which a
        new array under the same key replaces, and which goes when its array goes (a donated, deleted array is never
        read again)."""
        hit = self._kept.get(key)
        if hit is not None and hit[0]() is source and not source.is_deleted():
            return hit[1]
        value = make(source)
        me = weakref.ref(self)

        def forget(ref, key=key):
            rt = me()
            if rt is not None and rt._kept.get(key, (None,))[0] is ref:
                rt._kept.pop(key, None)

        self._kept[key] = (weakref.ref(source, forget), value)
        return value

    def tree_weights(self, layout, params, n: int, route: tuple, options: Callable[[], Options],
                     flows: bool) -> dict | None:
        """The tree's weight copies that a call of ``n`` samples on ``layout`` reads where its levels run on clusters
        (:func:`jaxpc.engine.routing.tree_weight_copies`; ``flows``: the call runs the flow pass too), decided once
        per ``route`` (the call's entry and options) and bucket, made once per parameter array (:meth:`kept`); None
        where the call makes none, where ``params`` are traced or not float32 device arrays, or where the copies
        would hold more than :data:`KEPT_WEIGHT_BYTES` (the call then makes them inside its executable and frees
        them after it)."""
        if not self.clusters:
            return None
        b = self.bucket(n)
        found = self._weight_routes.get((route, b), False)
        if found is False:
            if len(self._weight_routes) >= 256:
                self._weight_routes.clear()
            found = self._weight_routes[route, b] = routing.tree_weight_copies(
                layout, resolve_options(options()), b, self.dtype, flows)
        if found is None:
            return None
        group, parts = found
        source = params["sum"].get(group) if isinstance(params, dict) and isinstance(params.get("sum"), dict) else None
        if (not checks.is_device_array(source) or source.dtype != jnp.float32
                or source.is_deleted() or source.nbytes * len(parts) > KEPT_WEIGHT_BYTES):
            return None
        return {p: self.kept(("tree_weights", p), source, stages.WEIGHT_COPIES[p]) for p in parts}

    def with_tree_weights(self, args: dict, layout, batch: Batch, route: tuple, options: Options, flows: bool) -> dict:
        """``args`` with ``tree_weights``, the kept weight copies (:meth:`tree_weights`) that the call reads, where it
        reads any (a batch outside any trace)."""
        if self.clusters and not batch.traced:
            kept = self.tree_weights(layout, args["params"], batch.n, route, lambda: options, flows)
            if kept is not None:
                return {**args, "tree_weights": kept}
        return args

    def tree_weights_later(self, layout, params, x, route: tuple, options: Callable[[], Options],
                           flows: bool) -> Callable[[], dict | None]:
        """:meth:`tree_weights` for a call on ``x`` as a function of no arguments: what a replayed call passes as
        its ``tree_weights`` (:meth:`replay` calls it only where the remembered call took them)."""
        return lambda: self.tree_weights(layout, params, x.shape[0], route, options, flows)

    def replicated(self, tables, sharding) -> Any:
        """``tables`` (index tables) placed with ``sharding`` (a mesh's replicated sharding), made once: passed
        from one device they would be copied to every device on every call."""
        return self.constant(("replicated", id(tables), sharding),
                             lambda: jax.device_put(tables, sharding))

    def placed_tables(self, tables, x, params, missing=None) -> tuple[Any, Any]:
        """``(tables, sharding)``: ``tables`` where a call on ``x``, ``params`` and ``missing`` runs (:meth:`placement`:
        put there once, :meth:`replicated`) and that sharding; ``tables`` and None where nothing is placed."""
        placed = self.placement(tables, x, params, missing)
        return (tables, None) if placed is None else (self.replicated(tables, placed), placed)

    def placement(self, tables, x, params, missing=None) -> Any:
        """Where a call on ``x``, ``params`` and ``missing`` runs when any was committed to devices other than those of
        the circuit's ``tables`` (``jax.device_put`` to a device, parameters replicated over a mesh by
        :mod:`jaxpc.parallel`): their replicated sharding, with which the call places the tables (once) and its
        constants. None where all sit on the tables' devices or are uncommitted (the default: nothing is placed). A
        batch split over several devices, or data, mask and parameters committed to different devices, raise a
        ``ValueError`` naming where they are."""
        where = None
        for what, a in (("x", x), ("missing", missing), ("params", _first_leaf(params))):
            if isinstance(a, jax.core.Tracer) or not getattr(a, "committed", False):  # (uncommitted, numpy, None)
                continue
            s = a.sharding
            target = self._placements.get(s, _UNSEEN)
            if target is _UNSEEN:
                if self._home is None:
                    self._home = jax.tree_util.tree_leaves(tables)[0].sharding.device_set
                if len(self._placements) >= 64:
                    self._placements.clear()
                target = self._placements[s] = self._target(s, what)
            if where is not None and where[1] != target:
                ids = [sorted(d.id for d in t.device_set) for t in (where[2], s)]
                raise ValueError(f"{where[0]} and {what} are committed to different devices ({ids[0]} and {ids[1]}): "
                                 "jax.device_put them to the same ones")
            where = (what, target, s)
        return None if where is None else where[1]

    def _target(self, s, what: str) -> Any:
        """:meth:`placement`'s answer for one committed argument's sharding ``s``."""
        if s.device_set == self._home:
            return None
        if not s.is_fully_replicated:
            raise ValueError(f"{what} is split over devices {sorted(d.id for d in s.device_set)}: a circuit's own "
                             "methods run on one device or on replicated parameters; split a batch with "
                             "jaxpc.parallel (mesh=...) or pass it whole")
        if isinstance(s, NamedSharding):
            return NamedSharding(s.mesh, PartitionSpec())
        devices = sorted(s.device_set, key=lambda d: d.id)
        return NamedSharding(Mesh(np.array(devices), ("devices",)), PartitionSpec())

    def _home_devices(self, tables) -> Any:
        """The devices of the circuit's ``tables`` (where a call runs that nothing committed moves)."""
        if self._home is None:
            self._home = jax.tree_util.tree_leaves(tables)[0].sharding.device_set
        return self._home

    @staticmethod
    def check_devices(args: dict, devices, why: str) -> None:
        """Raise a ``ValueError`` naming the first argument other than the data, the mask, the parameters and the
        tables (a PRNG key, a step size, weights, evidence, flows) that is committed to devices other than
        ``devices``, where the call runs (:meth:`placement`; ``why``: which those are, for the message); uncommitted
        ones (Python numbers, numpy, ``jnp.asarray``) go there with the call."""
        for name, v in args.items():
            if name in _PLACING:
                continue
            a = _first_leaf(v)
            if isinstance(a, jax.core.Tracer) or not getattr(a, "committed", False):
                continue
            got = a.sharding.device_set
            if got != devices:
                raise ValueError(
                    f"{name} is committed to devices {sorted(d.id for d in got)}, but the call runs on devices "
                    f"{sorted(d.id for d in devices)} ({why}): pass {name} made without a device (a Python number, "
                    "numpy, jnp.asarray, jax.random.key) or jax.device_put it there")

    def scalar(self, value) -> Array:
        """A device scalar of the circuit's dtype for a Python number, made once per value."""
        if isinstance(value, (jax.Array, jax.core.Tracer)):
            return value.astype(self.dtype) if value.dtype != self.dtype else value
        key = float(value)
        return self.constant(("scalar", key), lambda: jnp.asarray(key, self.dtype))

    def em_scalars(self, step_size, pseudocount) -> tuple:
        """EM's ``step_size`` and ``pseudocount`` checked (:func:`check_em_args`) and as device scalars
        (:meth:`scalar`), memoized per pair of Python numbers (a repeated step pays a dict lookup)."""
        if step_size.__class__ is bool or pseudocount.__class__ is bool:  # (True == 1 would hit the memo)
            check_em_args(step_size, pseudocount)
        try:
            hit = self._em_scalars.get((step_size, pseudocount))
        except TypeError:  # arrays
            hit = None
        if hit is not None:
            return hit
        check_em_args(step_size, pseudocount)
        out = self.scalar(step_size), self.scalar(pseudocount)
        if isinstance(step_size, (int, float)) and isinstance(pseudocount, (int, float)):
            if len(self._em_scalars) >= 256:
                self._em_scalars.clear()
            self._em_scalars[step_size, pseudocount] = out
        return out

    def weights(self, ll_weights, n: int, nonnegative: bool | str = False):
        """Per-sample weights ``[n]`` of the circuit's dtype, or None. Host weights (numpy, lists) must be finite,
        and with ``nonnegative`` (True: an EM step's, a negative weight makes negative expected counts; a str: whose
        weights they are, ``LOG_FLOWS``) >= 0; device arrays' values are checked by :meth:`weights_check`."""
        if ll_weights is None:
            return None
        if not isinstance(ll_weights, jax.Array):
            host = np.asarray(ll_weights)
            if host.dtype.kind not in "biuf" and not jnp.issubdtype(host.dtype, jnp.floating):  # (bfloat16: "V")
                raise TypeError(f"ll_weights must be numbers, got dtype {host.dtype}")
            _raise_bad_weights(host, nonnegative)
        w = ll_weights if isinstance(ll_weights, jax.core.Tracer) else jnp.asarray(ll_weights, self.dtype)
        if w.shape != (n,):
            raise ValueError(f"ll_weights must have shape [{n}] (one weight per sample), got {tuple(w.shape)}")
        return w

    def weights_check(self, ll_weights, w, batch: Batch, nonnegative: bool | str, where: str) -> Callable[[], None]:
        """:meth:`deferred_check` of device weights ``ll_weights`` (``w``: :meth:`weights`' result). Host weights were
        checked by :meth:`weights`; tracers are not checked."""
        if not checks.is_device_array(ll_weights):
            return _no_check
        bad = _bad_em_weights if nonnegative else _bad_weights
        explain = functools.partial(_explain_weights, w, nonnegative, where)
        return self.deferred_check(batch, bad.__name__, bad, {"w": w}, explain)

    def deferred_check(self, batch: Batch, name: str, bad: Callable | None, args: dict,
                       explain: Callable[[], None] | None) -> Callable[[], None]:
        """A function of no arguments that runs :meth:`record_check` (``name``, ``bad``, ``args``, ``explain``) under
        the batch's ``validate`` (the circuit's next call raises a failure, this one with ``"sync"``; nothing with
        False or a traced batch, nor where ``bad`` is None: nothing to check). Call it right after the call's work is
        dispatched."""
        if bad is None or not batch.check or batch.traced:
            return _no_check
        return functools.partial(self.record_check, name, bad, args, explain, batch.sync)

    def bucket(self, n: int, multiple: int = 1) -> int:
        b = self.buckets(n)
        return -(-b // multiple) * multiple

    # ---- the call -----------------------------------------------------------------------------
    def run(self, name: str, static: dict, args: dict, batch: Batch | None = None, *, options: Options | None = None,
            batched: dict[str, int] | None = None, weights: Any = False, multiple: int = 1, sharding=None,
            replay: tuple | None = None, free: tuple[str, ...] = ("params",)):
        """Run entry ``name`` on ``args``: pad the batch to its bucket, run the cached executable (with the
        device check when ``batch.check``), slice the outputs back to ``batch.n`` rows, and settle the input
        checks of earlier calls.

        Args:
            static: static values of the key (besides ``options``).
            args: traced arguments; ``x`` and ``missing`` are taken from ``batch``.
            options: the call's :class:`Options` (``precision="default"`` is resolved here).
            batched: other arguments whose axis (the value) holds the batch and is padded with it (evidence
                pytrees: every leaf).
            weights: False (the entry takes none), or None / ``[n]`` weights: padded to the bucket (padding
                rows weigh 0; None: ones on the real rows).
            multiple: buckets are rounded up to a multiple of this (devices of a mesh).
            sharding: where the default weights are made (a mesh's batch sharding), so that a step moves
                nothing but the data.
            replay: the call's key for :meth:`replay` (hashable: everything the caller derived ``static``,
                ``options`` and the arguments other than ``x`` and the ``free`` ones from); the call is remembered
                under it where only those and the mask change between calls (no weights).
            free: the arguments that :meth:`replay` takes anew besides ``x`` (where the call has them).
        """
        entry, fn = self._entries[name]
        static = dict(static)
        static.update(options_key(options) if options is not None else {"_jax": jax_settings()})
        args = dict(args)
        devices = placed = None  # where the call runs (None: not decided here), and whether it was moved there
        if sharding is None and (batch is None or not batch.traced) and "tables" in args:
            # the call runs where its data or parameters were put, the tables with it; every other committed
            # argument must be there already
            x, missing = (batch.x, batch.missing) if batch is not None else (None, None)
            args["tables"], sharding = self.placed_tables(args["tables"], x, args.get("params"), missing)
            placed = sharding is not None
            if _several_devices():  # (one device: every argument is there)
                devices = sharding.device_set if placed else self._home_devices(args["tables"])
                self.check_devices({**args, "ll_weights": weights}, devices,
                                   "where x and params were put, else where the circuit's tables are")
        elif sharding is not None and (batch is None or not batch.traced):  # (a mesh's batch sharding)
            devices = sharding.device_set
            self.check_devices({**args, "ll_weights": weights}, devices, "the mesh's")
        n = batch.n if batch is not None else None
        b = n
        if batch is not None:
            static["_check"] = self.device_check if batch.check else None
            if not batch.traced:
                b = self.bucket(n, multiple)
            args["x"], args["missing"] = batch.x, batch.missing
            if weights is not False:
                args["weights"] = weights
            if b != n:
                args = self._pad(args, n, b, batched)
            if weights is None:
                args["weights"] = (jnp.ones((n,), self.dtype) if batch.traced else self.constant(
                    ("valid", b, n, sharding), lambda: put_constant(_valid_rows(b, n, self.dtype), sharding)))
        out = self.cache.run(name, fn, static, args, self._fallback(name, static, batched, multiple)
                                   if batch is not None and not batch.traced else None)
        padded = out
        if b != n:
            out = self._head(out, entry.rows, n)
        if replay is not None and batch is not None and not batch.traced and batch.mkey is not False \
                and (weights is None or weights is False) \
                and (batch.report or not batch.check or batch.host is not None):
            self._remember(replay, free, name, static, args, batch, b, batched, padded, devices, placed)
        if batch is None or batch.traced:
            return out
        # on the padded batch (padding rows copy the first row): one flag executable per bucket
        flag = self._flag(args["x"], args["missing"]) if batch.report else None
        self._settle()  # the earlier calls' flags, read while this call's work runs
        if flag is not None:
            self._record(flag, batch, name)
            if batch.sync:
                self._settle()
        if batch.sync:
            self.check_params_now(args.get("params"))
        return out

    def _remember(self, key: tuple, free: tuple, name: str, static: dict, args: dict, batch: Batch, b: int,
                  batched, out, devices, placed: bool | None) -> None:
        """Remember the call for :meth:`replay`: the executables of exactly its key (none where an argument, such as
        parameters under the caller's ``jax.grad``, holds a tracer) and, for a batch short of its bucket, those of
        its helpers, the one that cut back its padded outputs ``out`` among them; ``devices``: where it ran, ``placed``
        (True: moved there by committed data or parameters, :meth:`placement`)."""
        generation = self._generation()  # read before binding: an eviction in between makes the replay stale
        bound = self.cache.bind(name, static, args)
        if bound is None:
            return
        pad = head = rows = None
        if b != batch.n:  # the helpers that ran for this call: x padded alone, the outputs cut back
            padded = {"x": batch.x}
            if batch.missing is not None and batch.missing.ndim == 2:  # (the order _pad gives them)
                padded["missing"] = batch.missing
            pad = self._helpers.bind("pad", self._pad_static(batch.n, b, batched), padded)
            rows = self._entries[name][0].rows
            head = self._helpers.bind("head", {"axes": _row_axes(rows), "n": batch.n},
                                      {"parts": _split_rows(out, rows)[0]})
            if pad is None or head is None:
                return
            pad, head = pad.entry, head.entry
        if len(self._replays) >= REPLAYS:
            self._replays.clear()
        slots = tuple((k, bound.names.index(k)) for k in free if k in bound.names)
        ix = bound.names.index("x")
        im = bound.names.index("missing") if batch.missing is not None else None
        taken = {ix, im, *(i for _, i in slots)}
        values = tuple(None if i in taken else v for i, v in enumerate(bound.values))
        host = batch.host is not None
        xtype = np.ndarray if host else type(batch.x)
        self._replays[key, batch.x.shape, xtype, batch.mkey] = _Replay(
            bound.entry, values, generation, slots, ix, xtype, batch.host if host else batch.x.dtype,
            static.get("_matmul", _ANY), static.get("_jax", _ANY), name, batch.report, batch.sync, pad, head,
            rows, host_check=host and batch.check, target=np.dtype(batch.x.dtype) if host else None, im=im,
            devices=devices, placed=bool(placed))

    def _generation(self) -> tuple:
        return self.cache.generation, self._helpers.generation

    def replay(self, key: tuple, x, missing=None, /, **free):
        """Repeat the call remembered under ``key`` (:meth:`run`'s ``replay``) with a new ``x`` and new values of its
        ``free`` arguments (e.g. ``params``): the same outputs as the full call, for a fraction of its host time (the
        small batches' steps wait for it). None
        where there is nothing to repeat: no call under ``key`` yet, ``x`` of another type, shape or dtype, JAX's
        matmul setting changed, the executable left the cache, committed arguments that would run the full call on
        other devices (see the module docstring), or the executable refused the arguments (another pytree, shape,
        dtype or sharding, or tracers); the caller then takes the full call. A numpy ``x`` is checked on the
        host as the full call checks it (the same ``ValueError``) before anything runs. A ``free`` value may be a
        function of no arguments that makes it, called only where the remembered call took that argument."""
        xtype = np.ndarray if isinstance(x, np.ndarray) else type(x)  # (a memmap's slices are numpy batches too)
        mkey = mask_key(missing)
        try:
            r = self._replays.get((key, x.shape, xtype, mkey))
        except (TypeError, AttributeError):  # an unhashable key component, or no array
            return None
        if r is None or x.dtype != r.dtype or (missing is not None and missing.dtype != np.bool_):
            return None
        if r.generation != self._generation():  # an executable may have left its cache: let it go
            self._replays.pop((key, x.shape, xtype, mkey), None)
            return None
        if r.matmul is not _ANY and matmul_setting() != r.matmul:
            return None
        if r.settings is not _ANY and jax_settings() != r.settings:
            return None
        if r.devices is not None and not _placed_alike(r, x, missing, free):  # the full call moves or refuses it
            return None
        if r.target is not None:  # numpy: checked here, then a copy handed to the executable (JAX moves it)
            if r.host_check:
                checks.check_host_values(self.var_info, x, missing, "x", r.target)
            x = np.asarray(x).astype(r.target)  # (never the caller's buffer: a CPU executable reads it in place)
        if isinstance(missing, np.ndarray):
            missing = np.array(missing, dtype=bool)  # (a copy, as x's)
        values = list(r.values)
        for k, i in r.slots:
            v = free[k]
            values[i] = v() if callable(v) else v  # (a function makes a value only the remembered call took)
        e = r.entry
        try:
            mb = missing
            if r.pad is None:
                xb = x
            else:
                # a [B, V] mask is padded with x (its shape is in the key), a [V] one is not
                padded = r.pad.compiled(x, missing) if missing is not None and missing.ndim == 2 else r.pad.compiled(x)
                xb, mb = padded["x"], padded.get("missing", missing)
            values[r.ix] = xb
            if r.im is not None:
                values[r.im] = mb
            out = e.compiled(*values)
        except (TypeError, ValueError):  # refused before running
            return None
        self.cache.count_hit(e)
        flag = self._flag(xb, mb) if r.report else None
        if r.head is not None:
            parts, _, rebuild = _split_rows(out, r.rows)
            out = rebuild(r.head.compiled(parts))
        self._settle()
        if flag is not None:
            with self._lock:
                self._pending.append(_Pending(flag, x, missing, r.name))  # (the error names the batch's rows)
            if r.sync:
                self._settle()
        if r.sync:
            self.check_params_now(free.get("params"))
        return out

    def _pad(self, args: dict, n: int, b: int, batched: dict | None) -> dict:
        """:func:`pad_args` through the call path's own cache: one stored executable per batch size and bucket."""
        keys = ["x", *(k for k in (batched or {}) if args.get(k) is not None)]
        for k in ("missing", "weights"):
            if args.get(k) is not None and not (k == "missing" and args[k].ndim == 1):
                keys.append(k)
        padded = self._helpers.run("pad", _pad_entry, self._pad_static(n, b, batched), {k: args[k] for k in keys})
        return {**args, **padded}

    def _pad_static(self, n: int, b: int, batched: dict | None) -> dict:
        return {"n": n, "b": b, "batched": tuple(sorted((batched or {}).items())), "dtype": self.dtype}

    def _head(self, out, rows, n: int):
        """The outputs cut back to ``n`` rows along each batch axis that ``rows`` names, through the call path's own
        cache: one stored executable per batch size."""
        parts, axes, rebuild = _split_rows(out, rows)
        return rebuild(self._helpers.run("head", _head_entry, {"axes": axes, "n": n}, {"parts": parts}))

    def _fallback(self, name: str, static: dict, batched, multiple: int):
        """With ``compile_after > 1``: an early sighting of a key runs on a live executable of a larger bucket (of
        the same ``multiple``), its ``batched`` arguments padded with the batch."""
        if self.cache.compile_after <= 1:
            return None

        def fallback(a):
            b = a["x"].shape[0]
            for cand in sorted({self.bucket(b * k, multiple) for k in (2, 4, 8, 16)}):
                padded = pad_args(a, b, cand, batched, self.dtype)
                exe = self.cache.find(name, static, padded)
                if exe is not None:
                    return self._head(exe(*padded.values()), self._entries[name][0].rows, b)
            return None
        return fallback


def check_em_args(step_size, pseudocount) -> None:
    """Check EM's ``step_size`` in (0, 1] and ``pseudocount`` >= 0 (finite floats; tracers pass)."""
    for name, v in (("step_size", step_size), ("pseudocount", pseudocount)):
        if isinstance(v, jax.core.Tracer):
            continue
        if isinstance(v, (bool, np.bool_, str, bytes)):
            raise TypeError(f"{name} must be a float, got {type(v).__name__} {v!r}")
        try:
            f = float(v)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{name} must be a float, got {type(v).__name__}") from e
        if not math.isfinite(f):
            raise ValueError(f"{name} must be finite, got {v!r}")
    if not isinstance(step_size, jax.core.Tracer) and not 0.0 < float(step_size) <= 1.0:
        raise ValueError(f"step_size must be in (0, 1], got {step_size!r}")
    if not isinstance(pseudocount, jax.core.Tracer) and float(pseudocount) < 0:
        raise ValueError(f"pseudocount must be >= 0, got {pseudocount!r}")
