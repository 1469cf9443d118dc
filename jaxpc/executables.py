"""Compiled executables in place of CUDA graphs.

Every public entry point of a :class:`~jaxpc.Circuit` runs an ahead-of-time compiled XLA
executable taken from a cache the circuit owns. The key is built *by construction* from
everything that can change the computation:

``(entry point, frozen options, partial-evaluation plan, the tree structure, shapes, dtypes and
shardings of every array argument)``

Options reach traced code only through the frozen :class:`~jaxpc.Options` object, which is part
of the key; everything else a call brings (evidence, masks, weights, PRNG keys, step sizes) is a
traced argument. The batch dimension is padded to a *bucket* (default: powers of two from 8), so
a loop whose batch size varies uses a handful of executables; padded rows get zero weight.

A call first tries the executable that the last call with the same entry point, static values and top-level
argument shapes ran (:meth:`ExecutableCache.run`): the executable checks its arguments' pytree, shapes, dtypes and
shardings itself (in C++) and refuses others before running anything, and only then is the full key built. A
training loop's step pays for neither the key's signature of every parameter leaf nor its hash.

The cache is bounded (least recently used executables are dropped first), thread-safe (a key
is compiled once even when several threads ask for it at the same time), and warns once per
entry point when one layout keeps being recompiled, naming the component of the key that keeps
changing.

Behind it, an :class:`ExecutableStore` on disk keeps serialized executables across processes under a
*fingerprint* of the key: a digest of the entry's function and bound layout, the static values, the
arguments' signatures, the XLA options, the jaxpc source, the JAX version and the device. A second process
loads its executables from there without tracing, lowering or compiling anything; where a key has a quick
executable beside its optimized one (:func:`quick_options`), it loads the smaller quick one first and the optimized
one on a background thread. Keys holding values that
have no stable digest (a local function, an unknown object) are compiled as usual.

The store also keeps an index per circuit (a digest of its layout and dtype): the executables its calls ran, most
recent first. A circuit of the same structure in a later process starts loading those on a background thread when it
is compiled (:meth:`ExecutableCache.load_ahead`), so that its first call finds them loaded or waits only for the rest
of that load.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import enum
import functools
import hashlib
import json
import os
import pickle
import sys
import tempfile
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Final, NamedTuple

import jax
import numpy as np
from jax import lax

from .ops import tables as table_places

__all__ = ["CacheInfo", "BucketPolicy", "ExecutableCache", "ExecutableStore", "enable_persistent_cache",
           "default_persistent_cache", "persistent_cache_dir"]


class CacheInfo(NamedTuple):
    """Counters of a circuit's executables: calls served from memory (``hits``), keys not in memory
    (``misses``), seconds spent compiling (``compile_seconds``: the first, quick compile of a key where
    :func:`quick_options` applies), executables in memory (``live``), misses served by loading a serialized
    executable from the disk store instead of compiling (``loaded``), and optimized executables still compiling in
    the background or waiting for their trace at the key's next call (``upgrading``; :func:`optimized_options`)."""

    hits: int
    misses: int
    compile_seconds: float
    live: int
    loaded: int = 0
    upgrading: int = 0  # optimized executables compiling in the background (quick_options)


class BucketPolicy:
    """Maps a batch size to the padded size an executable is compiled for.

    ``"pow2"`` (default): the next power of two, at least ``min_bucket`` (padding wastes < 2x).
    ``"exact"``: no padding. A sequence of ints: the smallest listed size that fits (larger batches use
    multiples of the largest).
    """

    def __init__(self, spec: str | Sequence[int] = "pow2", min_bucket: int = 8):
        if isinstance(spec, str):
            if spec not in ("pow2", "exact"):
                raise ValueError(f"buckets must be 'pow2', 'exact' or a sequence of sizes, got {spec!r}")
            self.sizes = None
        else:
            sizes = sorted({int(s) for s in spec})
            if not sizes or sizes[0] < 1:
                raise ValueError(f"bucket sizes must be positive ints, got {spec!r}")
            self.sizes = tuple(sizes)
        if not isinstance(min_bucket, int) or min_bucket < 1:
            raise ValueError(f"min_bucket must be a positive int, got {min_bucket!r}")
        self.spec = spec if isinstance(spec, str) else "list"
        self.min_bucket = min_bucket

    def __call__(self, n: int) -> int:
        if self.spec == "exact":
            return n
        if self.sizes is not None:
            for s in self.sizes:
                if n <= s:
                    return s
            top = self.sizes[-1]
            return -(-n // top) * top
        return max(self.min_bucket, 1 << (n - 1).bit_length())

    def __repr__(self):
        return f"BucketPolicy({self.sizes if self.sizes else self.spec!r}, min_bucket={self.min_bucket})"


def _leaf_sig(a) -> tuple:
    # dtype objects, not their names: str(dtype) costs ~10 us per leaf, and a step's key has hundreds of leaves
    if isinstance(a, jax.Array):
        try:
            sharding = a.sharding
        except Exception:  # noqa: BLE001 - tracers have none
            sharding = None
        return (a.shape, a.dtype, sharding)
    return (tuple(np.shape(a)), np.asarray(a).dtype, None)


def _array_sig(a) -> tuple:
    """A top-level array argument's shape and sharding (None for a tracer): :meth:`ExecutableCache.recent_key`."""
    return a.shape, None if isinstance(a, jax.core.Tracer) else a.sharding


def _tree_sig(val) -> tuple:
    leaves, tree = jax.tree_util.tree_flatten(val)
    return (tree, tuple(_leaf_sig(a) for a in leaves))


class _HashedSig:
    """A signature with its hash computed once (a table signature has hundreds of leaves; the key is
    hashed and compared on every call, and the memo hands out the same object, so equality is by identity)."""

    __slots__ = ("sig", "_hash")

    def __init__(self, sig: tuple):
        self.sig = sig
        self._hash = hash(sig)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, _HashedSig) and self._hash == other._hash and self.sig == other.sig)

    def __repr__(self) -> str:
        return repr(self.sig)


class _IdentityMemo:
    """``make(val)`` of index-table pytrees by object identity (their signature, their packed form). Tables
    belong to a circuit (or to a mesh's replicated copy) and are never modified in place, so one value per
    object serves every call; the memo holds the objects themselves, so an id is never reused while its
    entry lives. Each :class:`ExecutableCache` has its own (the tables it sees are its circuit's, which live as long
    as the circuit): a dropped circuit's tables go with it (a pytree of dicts has no weak reference to key by)."""

    def __init__(self, make=lambda val: _HashedSig(_tree_sig(val)), size: int = 64):
        self.size, self.make = size, make
        self._memo: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, val):
        hit = self._memo.get(id(val))  # (a dict read is atomic: the lock guards the writes below)
        if hit is not None and hit[0] is val:
            return hit[1]
        sig = self.make(val)
        with self._lock:
            self._memo[id(val)] = (val, sig)
            while len(self._memo) > self.size:
                self._memo.popitem(last=False)
        return sig


def put_constant(a: np.ndarray, sharding=None) -> jax.Array:
    """Host array ``a`` on the device(s) of ``sharding`` (default device: None): a constant of the call path,
    made once, so it is allowed under ``jax.transfer_guard("disallow")``."""
    with jax.transfer_guard_host_to_device("allow"):
        return jax.device_put(a, sharding)


class PackedTables:
    """An index-table pytree packed into one flat device array per dtype.

    A circuit's tables are hundreds of small arrays (HCLT-256: about 1,000), and dispatching an executable
    costs host time per argument (about 1 ms per call for 1,000 arguments); packed, the executable takes one
    argument per dtype and slices the tables out of it (static offsets) inside the trace. The packing is a
    function of the tables' signature, so an executable compiled for one tables object runs any other
    with the same signature (a mesh's replicated copy)."""

    def __init__(self, tables):
        with_paths, self.treedef = jax.tree_util.tree_flatten_with_path(tables)
        self.paths = [p for p, _ in with_paths]
        leaves = [leaf for _, leaf in with_paths]
        groups: dict = {}
        self.slots = []
        for i, leaf in enumerate(leaves):
            dt = np.dtype(leaf.dtype)
            g = groups.setdefault(dt, [len(groups), 0, []])
            size = int(np.prod(np.shape(leaf), dtype=np.int64))
            g[1] = -(-g[1] * dt.itemsize // TABLE_ALIGN) * TABLE_ALIGN // dt.itemsize
            self.slots.append((g[0], g[1], tuple(np.shape(leaf))))
            g[2].append((i, g[1]))
            g[1] += size
        # packed on the host (one transfer each way): packing on the device would compile one small
        # executable per distinct table shape, hundreds of compiles on a circuit's first call
        with jax.transfer_guard("allow"):
            host = jax.device_get(leaves)

        def packed(g):
            out = np.zeros(g[1], np.dtype(host[g[2][0][0]].dtype))
            for i, off in g[2]:
                out[off:off + np.size(host[i])] = np.ravel(host[i])
            return out

        # each packed array goes where its tables are (a mesh's replicated tables stay replicated)
        self.arrays = tuple(put_constant(packed(g), getattr(leaves[g[2][0][0]], "sharding", None))
                            for g in sorted(groups.values(), key=lambda g: g[0]))

    def unpack(self, arrays):
        """The tables pytree from (traced) packed arrays, with the packed arrays and the kernel tables' places in
        them (:func:`jaxpc.ops.tables.mark`: kernels read their tables there, not from copies of the slices)."""
        leaves = [lax.slice_in_dim(arrays[g], off, off + int(np.prod(shape, dtype=np.int64))).reshape(shape)
                  for g, off, shape in self.slots]
        return table_places.mark(jax.tree_util.tree_unflatten(self.treedef, leaves), self.paths, self.slots,
                                 tuple(arrays))


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # jaxpc/: warnings point past it
PACK_TABLES: Final = True  # executables take the index tables packed (PackedTables)
TABLE_ALIGN: Final = 256  # bytes: each packed table starts at a multiple (Mosaic GPU kernels take such operands)


@dataclasses.dataclass
class _Entry:
    compiled: Any
    ready: threading.Event
    error: BaseException | None = None
    used: int = 0  # the cache's call count at its last use (least recently used: smallest)
    # (lower, upgrade arguments): the optimized compile's trace, done by the key's next call (on its thread)
    pending: Any = None

    @property
    def usable(self) -> bool:
        """Compiled without error (``compiled`` is set before ``ready``)."""
        return self.ready.is_set() and self.error is None


@dataclasses.dataclass(frozen=True)
class Bound:
    """An executable bound to a call's arguments (:meth:`ExecutableCache.bind`): ``entry``'s ``compiled`` (read at each
    call: a background upgrade swaps it), the arguments' ``names`` and positional ``values``."""

    entry: _Entry
    names: list
    values: list


RECENT_KEYS: Final = 256  # ExecutableCache.run's first tries, at most (then forgotten at once)

QUICK_XLA: Final = (("xla_gpu_enable_triton_gemm", False), ("xla_gpu_autotune_level", 0),
                     ("xla_llvm_disable_expensive_passes", True))
UNROLLED_XLA: Final = (("xla_gpu_enable_triton_gemm", False),)


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


CONCURRENT_XLA: Final = ("xla_gpu_command_buffer_scheduling_mode", "CONCURRENT")


def batch_xla(options, xla: dict, args: dict) -> dict:
    """``xla`` with the XLA options that a key's batch size (its ``x``'s rows) sets on a GPU: up to
    ``Tuning.concurrent_batch`` samples, command buffers whose kernels XLA orders by their data dependencies
    (:data:`CONCURRENT_XLA`) instead of its latency-hiding schedule, so that kernels that do not depend on each other
    may overlap. That order is faster at small batches, gains nothing from 64 samples on, and its executables hold
    more memory, the more the larger the batch (twice as much at 512), hence the bound."""
    tuning = getattr(options, "tuning", None)
    x = args.get("x")
    if (tuning is None or CONCURRENT_XLA[0] in xla or getattr(x, "ndim", 0) < 1
            or not 0 < x.shape[0] <= tuning.concurrent_batch or not _on_gpu()):
        return xla
    return {**xla, CONCURRENT_XLA[0]: CONCURRENT_XLA[1]}


_UPGRADING: set[threading.Thread] = set()  # every cache's background compiles
_UPGRADING_LOCK = threading.Lock()
_EXITING = threading.Event()  # set at exit: loads ahead stop after the one in progress
_WAITING: weakref.WeakSet = weakref.WeakSet()  # caches with optimized compiles still to trace (optimized_options)
EXIT_WAIT_S: Final = 300.0
EXIT_NOTICE_S: Final = 1.0  # a process whose exit waits longer on running compiles says so on stderr
UPGRADE_THREAD: Final = "jaxpc-upgrade"  # the threads that compile or load optimized executables


@atexit.register  # registered after JAX's own exit hooks, so it runs before they tear the backends down
def _finish_upgrades() -> None:
    """At exit, trace and compile the optimized compiles still waiting for their trace whose executables the disk
    store keeps for the next process (the others are dropped: nothing would run them), and wait (at most
    :data:`EXIT_WAIT_S`) for the background compiles, so that none is cut off inside XLA while the process shuts
    down; a wait for either is announced by one line on stderr. Loads ahead (:meth:`ExecutableCache.load_ahead`)
    stop after the executable in progress."""
    _EXITING.set()
    end = time.perf_counter() + EXIT_WAIT_S
    with _UPGRADING_LOCK:
        waiting = list(_WAITING)
    traces = sum(cache.waiting_stored() for cache in waiting)
    if traces:
        _exit_notice(f"compiling {traces} optimized executable{'s' * (traces > 1)} for the persistent cache "
                     f"(at most {EXIT_WAIT_S:.0f} s; JAXPC_PERSISTENT_CACHE=0 turns the cache off)")
    for cache in waiting:
        cache.start_upgrades(background=False, stored_only=True)  # (no new threads at interpreter shutdown)
    with _UPGRADING_LOCK:
        pending = list(_UPGRADING)
    compiling = [thread for thread in pending if thread.name == UPGRADE_THREAD]
    if compiling and not traces:
        compiling[0].join(EXIT_NOTICE_S)
        left = sum(thread.is_alive() for thread in compiling)
        if left:
            _exit_notice(f"waiting for {left} optimized executable{'s' * (left > 1)} still compiling or loading in "
                         f"the background (at most {EXIT_WAIT_S:.0f} s)")
    for thread in pending:
        thread.join(max(0.0, end - time.perf_counter()))


def _stored(pending: tuple) -> bool:
    """Whether the disk store keeps the optimized compile of an entry's ``pending`` ``(lower, (xla, store, fp,
    fq, refresh))``: it has a fingerprint ``fp`` only where there is a store."""
    return pending[1][2] is not None


def _damaged(store: ExecutableStore | None, fp: str | None) -> bool:
    """Whether ``store`` holds a file under ``fp`` (asked after its load gave nothing: a file that fails to load)."""
    return store is not None and fp is not None and store.has(fp)


def _exit_notice(what: str) -> None:
    """One line on stderr for a process whose exit waits on jaxpc's compiles (the wait is otherwise silent)."""
    sys.stderr.write(f"jaxpc: before exit, {what}\n")
    sys.stderr.flush()


def quick_options(options, xla: dict) -> dict | None:
    """The XLA options of a key's first, quick compile, or None when a key compiles once.

    On a GPU, XLA's Triton GEMM fusions and its autotuning of them take most of a first compile but make the
    steps faster. A key whose options (``Tuning.quick_first_compile``, the default) allow it is compiled first
    without them and without LLVM's expensive passes (:data:`QUICK_XLA`; they slow the compile, not the steps),
    runs at once, and is compiled again with ``xla`` (the executable the disk
    store keeps) on a background thread that swaps the result in (:meth:`ExecutableCache.wait_upgrades`). Not
    where the caller sets one of these options, and not off a GPU, where the two compiles would be the same. A
    process that ends while an optimized compile runs waits for it at exit (it is stored for the next process)."""
    tuning = getattr(options, "tuning", None)
    if tuning is None or not tuning.quick_first_compile or not _on_gpu():
        return None
    if any(k in xla for k, _ in QUICK_XLA):
        return None
    return {**xla, **dict(QUICK_XLA)}


def optimized_options(options):
    """The options that a key's optimized compile traces (where :func:`quick_options` gives it a quick one
    first): with ``Tuning.unroll_optimized`` (the default) the stages that :func:`jaxpc.compile` grouped into
    scans run unrolled (``scan_stages=False``). XLA's loops cost an evened tree's steps on a GPU (XLA's own full
    unrolling leaves these loops alone); the quick compile keeps the scans, which trace, lower and compile in a
    fraction of the time. The unrolled trace runs on the key's next call (or :meth:`ExecutableCache.wait_upgrades`),
    on the caller's thread, and only its compile in the background (a process that ends first traces it at exit
    where the disk store keeps it), with :func:`optimized_xla`'s XLA options. ``options`` itself where nothing
    changes."""
    tuning = getattr(options, "tuning", None)
    if tuning is None or not tuning.unroll_optimized or not options.scan_stages:
        return options
    return options.replace(scan_stages=False)


def quick_trace_options(options):
    """The options that a key's quick compile traces where its optimized compile traces its own
    (:func:`optimized_options` changes them): the leaf layers on XLA's gathers and products instead of the leaf
    kernels (``Options.leaf_kernel``). XLA compiles the Triton kernels of an executable one after the other while it
    emits the module's IR, ahead of its parallel LLVM and ptxas work, so the two leaf kernels would lengthen a first
    call by their compiles; without them the quick executable's steps are somewhat slower until the optimized one,
    with the kernels, replaces it. A key whose optimized compile reuses the quick one's trace keeps its kernels:
    leaving them out there would cost a second trace. Likewise the tree's levels level by level instead of on
    clusters (``Tuning.tree_clusters``): the Mosaic GPU kernels' compile lengthens a first call by seconds."""
    if getattr(options, "leaf_kernel", False):
        options = options.replace(leaf_kernel=False)
    tuning = getattr(options, "tuning", None)
    if tuning is not None and tuning.tree_clusters is not False:
        options = options.replace(tuning=dataclasses.replace(tuning, tree_clusters=False))
    return options


def optimized_xla(xla: dict) -> dict:
    """The XLA options of an optimized compile that runs scanned stages unrolled (:func:`optimized_options`):
    ``xla`` without XLA's Triton GEMM fusions (:data:`UNROLLED_XLA`) unless it sets them. The unrolled levels of a
    tree hold many small products of distinct shapes, for which cuBLAS beats the autotuned Triton fusions at every
    batch, and autotuning those fusions was most of that compile's work."""
    if any(k in xla for k, _ in UNROLLED_XLA):
        return xla
    return {**xla, **dict(UNROLLED_XLA)}


def _signature(a):
    """An argument's shape, dtype and sharding: what lowering reads of it. An uncommitted array (made without a
    device: ``jnp.asarray``, the tables) has no sharding here: the executable runs where the committed arguments
    are, and moves it there."""
    if not hasattr(a, "shape"):
        return a
    committed = getattr(a, "committed", True)
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None) if committed else None)


def _lower(fn, static: dict, names: list, pack, sig: list):
    """``fn(**args, **static)`` traced and lowered for the arguments (or their signatures) ``sig``, in ``names``
    order; ``tables`` packed by ``pack`` when given."""
    def positional(*vals):
        kw = dict(zip(names, vals))
        if pack is not None:
            kw["tables"] = pack.unpack(kw["tables"])
        return fn(**kw, **static)
    return jax.jit(positional).lower(*sig)


class ExecutableCache:
    """A bounded LRU cache of compiled executables, keyed by construction (see the module docstring)."""

    def __init__(self, max_executables: int = 128, max_layouts_per_entry: int = 8, compile_after: int = 1):
        for name, v in (("max_executables", max_executables), ("max_layouts_per_entry", max_layouts_per_entry),
                        ("compile_after", compile_after)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.max_executables = max_executables
        self.max_layouts_per_entry = max_layouts_per_entry
        self.compile_after = compile_after
        self._lock = threading.RLock()
        self._entries: dict = {}  # key -> _Entry; recency is each entry's ``used``, not the dict's order
        self._recent: dict = {}  # recent_key -> the usable _Entry the last call of that key ran (run's first try)
        # check_args(args): raises on arguments that no executable should be compiled or traced for; called on a key
        # that has no executable yet (and on tracers), never on a hit
        self.check_args: Callable[[dict], None] | None = None
        self._sightings: collections.Counter = collections.Counter()
        self._layouts: dict[str, list[dict]] = collections.defaultdict(list)
        self._recompiled: collections.Counter = collections.Counter()
        self._warned: set[str] = set()
        self.hits = 0
        self.misses = 0
        self.loaded = 0
        self.compile_seconds = 0.0
        # changes whenever an executable leaves the cache: what :meth:`bind` handed out is stale
        self.generation = 0
        self._upgrades: set[threading.Thread] = set()
        # whether the executables may hold scanned stages for the optimized compile to unroll
        # (optimized_options); a circuit without them sets False and spares that compile a second trace
        self.scans = True
        # entries whose optimized compile keeps the scanned stages (Runtime.entry(..., unroll=False))
        self.scanned: set[str] = set()
        self._owner: str | None = None  # the circuit's name in the store's index (load_ahead)
        self._owner_ready = threading.Event()
        self._owner_ready.set()
        self._ahead: threading.Thread | None = None
        # the tables' signatures and packed forms by identity (each cache its own: they go with its circuit)
        self._table_sigs = _IdentityMemo()
        self._packed = _IdentityMemo(PackedTables)

    # ---- statistics ---------------------------------------------------------------------------
    def info(self) -> CacheInfo:
        with self._lock:
            waiting = sum(e.pending is not None for e in self._entries.values())
            return CacheInfo(self.hits, self.misses, self.compile_seconds, len(self._entries), self.loaded,
                             len(self._upgrades) + waiting)

    def wait_upgrades(self, timeout: float | None = None) -> bool:
        """Wait until the optimized executables compiling in the background (:func:`quick_options`) have replaced
        the quick ones; True when none is left (False: ``timeout`` seconds passed first). Optimized compiles
        still waiting for their trace (:func:`optimized_options`) are traced here first, on the caller's thread."""
        self.start_upgrades()
        end = None if timeout is None else time.perf_counter() + timeout
        while True:
            with self._lock:
                pending = list(self._upgrades)
            if not pending:
                return True
            left = None if end is None else end - time.perf_counter()
            if left is not None and left <= 0:
                return False
            pending[0].join(left)

    def load_ahead(self, name: Callable[[], str | None]) -> None:
        """Name the circuit whose executables this cache holds by ``name()`` (computed on a background thread: a
        digest such as :func:`owner_digest` of its layout and dtype; None: no name) and start loading there the
        stored executables that earlier processes ran for it (the store's index of the circuit, most recent first).
        A call that needs one of them then waits for that load instead of starting its own: a second process's
        first call loads nothing itself when it comes after the circuit's compile. Does nothing without the
        persistent store."""
        store = _STORE
        if store is None:
            return
        self._owner_ready.clear()

        def work():
            try:
                try:
                    self._owner = name()
                finally:
                    self._owner_ready.set()
                if self._owner is not None:
                    store.load_ahead(store.recent(self._owner))
            finally:
                with _UPGRADING_LOCK:
                    _UPGRADING.discard(threading.current_thread())

        thread = threading.Thread(target=work, name="jaxpc-load-ahead", daemon=True)
        with _UPGRADING_LOCK:  # the process's exit waits for it, as for the background compiles
            _UPGRADING.add(thread)
        self._ahead = thread
        thread.start()

    def owner(self, timeout: float | None = None) -> str | None:
        """The circuit's name in the store's index (:meth:`load_ahead`), waiting for it at most ``timeout``
        seconds (default :data:`OWNER_WAIT_S`); None where it has none (yet)."""
        self._owner_ready.wait(OWNER_WAIT_S if timeout is None else timeout)
        return self._owner if self._owner_ready.is_set() else None

    def wait_loaded_ahead(self, timeout: float | None = None) -> bool:
        """Wait for :meth:`load_ahead`'s thread; True when it has finished (or none was started)."""
        thread = self._ahead
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def _note(self, store: ExecutableStore, fps: list) -> None:
        """Put the executables of a call (its first one first) at the head of the circuit's index in the store."""
        owner = self.owner()
        if owner is not None:
            store.note(owner, [fp for fp in fps if fp is not None])

    def clear(self) -> None:
        with self._lock:
            self.generation += 1
            self._entries.clear()
            self._recent.clear()
            self._sightings.clear()
            self._layouts.clear()
            self._recompiled.clear()
            self._warned.clear()
            self.hits = self.misses = self.loaded = 0
            self.compile_seconds = 0.0

    # ---- keys ---------------------------------------------------------------------------------
    def describe(self, entry: str, static: dict, args: dict) -> dict:
        """Named components of a key: each option field, each static value, and the signature of each
        argument (the batch bucket shows up in the shapes)."""
        comp: dict[str, Any] = {}
        for name, val in static.items():
            if dataclasses.is_dataclass(val) and not isinstance(val, type):
                for f in dataclasses.fields(val):
                    comp[f"option '{f.name}'"] = getattr(val, f.name)
            else:
                comp[f"static argument '{name}'"] = val
        for name, val in args.items():
            comp[f"argument '{name}'"] = self._table_sigs.get(val) if name == "tables" else _tree_sig(val)
        return comp

    def key(self, entry: str, static: dict, args: dict) -> tuple | None:
        """The key of a call: ``(entry, static items, (name, signature) per argument)``, or None when an argument
        holds a tracer (the call is inside a user's trace). It holds what :meth:`describe` names (the options
        object as a whole: frozen, equal by value) without building the names: per call it costs a few
        microseconds, a sizeable share of a small batch's step (HCLT-256 at batch 16 on the H200's host)."""
        sig = [entry, tuple(static.items())]
        for name, val in args.items():
            if name == "tables":
                sig.append((name, self._table_sigs.get(val)))
            elif val is None:
                sig.append((name, None))
            elif isinstance(val, jax.Array) and not isinstance(val, jax.core.Tracer):
                sig.append((name, _leaf_sig(val)))
            else:
                leaves, tree = jax.tree_util.tree_flatten(val)
                if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
                    return None
                sig.append((name, (tree, tuple(_leaf_sig(leaf) for leaf in leaves))))
        return tuple(sig)

    def recent_key(self, entry: str, static: dict, args: dict) -> tuple:
        """What picks the executable :meth:`run` tries first: the entry point, the static values, the tables'
        signature (memoized by identity: packed tables of another layout could have the same packed shapes), and
        per other argument its shape and sharding where it is an array, else whether it is None. Cheap by design (no
        pytree is flattened): the executable checks the rest. (An executable moves an uncommitted array where its
        inputs go without refusing it: the sharding keeps a batch on one device from the executable of a batch split
        over several.)"""
        return (entry, tuple(static.items()),
                tuple(self._table_sigs.get(v) if k == "tables" else _array_sig(v) if isinstance(v, jax.Array)
                      else v is None for k, v in args.items()))

    # ---- running ------------------------------------------------------------------------------
    def run(self, entry: str, fn: Callable, static: dict, args: dict, fallback: Callable | None = None):
        """Run ``fn(**args, **static)`` through its compiled executable.

        ``static`` values (the options object, plans, small ints) are baked into the executable and part
        of the key; ``args`` are traced. ``fallback(args)``: with ``compile_after > 1``, called on the first
        sightings of a key instead of compiling (e.g. a larger bucket's executable); it returns None to
        compile after all. Arguments holding tracers (a call inside the caller's own trace) run ``fn`` inline.
        """
        recent = self.recent_key(entry, static, args)
        e = self._recent.get(recent)  # (a dict read is atomic)
        if e is not None:
            try:
                out = e.compiled(*self._call_args(args))
            except (TypeError, ValueError):  # refused before running: another pytree, shape, dtype or sharding
                pass
            else:
                self.count_hit(e)
                return out
        key = self.key(entry, static, args)
        if self.check_args is not None and (key is None or key not in self._entries):
            self.check_args(args)
        if key is None:
            return fn(**args, **static)
        owner, e = False, None
        with self._lock:
            e = self._entries.get(key)
            if e is not None:
                self.hits += 1
                e.used = self.hits + self.misses  # (a counter, not move_to_end: that hashes the key again)
            else:
                self._sightings[key] += 1
                if fallback is None or self._sightings[key] >= self.compile_after:
                    del self._sightings[key]  # (counted until the key compiles: the counter stays small)
                    self.misses += 1
                    e = _Entry(None, threading.Event(), used=self.hits + self.misses)
                    self._entries[key] = e
                    self._note_layout(entry, self.describe(entry, static, args))
                    self._evict()
                    owner = True
        if e is None:  # an early sighting: try the fallback first
            out = fallback(args)
            return out if out is not None else self.run(entry, fn, static, args)
        if owner:
            self._compile(e, entry, fn, static, args)
        elif not e.ready.is_set():  # (is_set: wait() takes the event's lock even when it is set)
            e.ready.wait()
        if e.error is not None:
            raise e.error
        out = e.compiled(*self._call_args(args))
        if e.pending is not None and not owner:  # traced while the device runs this call
            self._start_upgrade(e)
        if e.pending is None:
            with self._lock:
                if any(v is e for v in self._entries.values()):  # (not evicted meanwhile)
                    if len(self._recent) >= RECENT_KEYS:
                        self._recent.clear()
                    self._recent[recent] = e
        return out

    def count_hit(self, e: _Entry) -> None:
        """Count a call that ran ``e``'s executable (the statistics and ``e``'s recency)."""
        with self._lock:
            self.hits += 1
            e.used = self.hits + self.misses

    def bind(self, entry: str, static: dict, args: dict) -> Bound | None:
        """The executable of exactly this call's key (every argument's pytree, shapes and dtypes), bound to ``args``'
        values as its positional arguments (tables packed), for a caller that replays the call with some of them
        replaced; None where the call has none that is finished and final, or where an argument holds a tracer.
        The binding is stale once :attr:`generation` moves past its value read before the call."""
        key = self.key(entry, static, args)
        if key is None:
            return None
        with self._lock:
            e = self._entries.get(key)
            if e is None or not e.usable or e.pending is not None:
                return None
            return Bound(e, list(args), self._call_args(args))

    def find(self, entry: str, static: dict, args: dict):
        """The compiled executable for exactly this key, if live (no statistics change), as a function of the
        arguments' values in ``args``' order."""
        key = self.key(entry, static, args)
        with self._lock:
            e = self._entries.get(key)
        if e is None or not e.usable:
            return None
        names = list(args)
        return lambda *vals: e.compiled(*self._call_args(dict(zip(names, vals))))

    def executable(self, entry: str, static: dict, args: dict):
        """The compiled executable (``jax.stages.Compiled``, called with ``args``' values in order) for exactly this
        key, if live; for callers that call it again and again with arguments of the same layout."""
        key = self.key(entry, static, args)
        with self._lock:
            e = self._entries.get(key)
        return e.compiled if e is not None and e.usable else None

    def latest(self, entry: str):
        """The most recently used compiled executable of ``entry`` (a ``jax.stages.Compiled``: its
        ``memory_analysis()``, ``cost_analysis()``, ``as_text()``), or None when none is live."""
        with self._lock:
            live = [(e.used, e) for key, e in self._entries.items() if key[0] == entry and e.usable]
        return max(live, key=lambda ue: ue[0])[1].compiled if live else None

    def _compile(self, e: _Entry, entry: str, fn, static, args):
        try:
            names = list(args)
            pack = self._packed.get(args["tables"]) if "tables" in args and PACK_TABLES else None
            t = time.perf_counter()
            upgrade = None
            opts = static.get("options")  # XLA options come with the Options (part of the key) or not at all
            xla = dict(opts.tuning.compiler_options) if getattr(opts, "tuning", None) is not None else {}
            xla = batch_xla(opts, xla, args)
            store = _STORE
            quick = quick_options(opts, xla)
            full = optimized_options(opts) if quick is not None and self.scans and entry not in self.scanned else opts
            xla_full = optimized_xla(xla) if full is not opts else xla
            fp, fq = store.fingerprints(fn, static, args, xla_full, quick) if store is not None else (None, None)
            compiled = behind = None
            if fq is not None and store.has(fp):
                # both stored: the quick executable (the scanned stages: HCLT-256's flows 1 MB against 7 MB)
                # loads in a fraction of the optimized one's time; that one loads behind it
                compiled = store.load(fq)
                if compiled is not None:
                    behind = functools.partial(store.load, fp)
            if compiled is None and fp is not None:
                compiled = store.load(fp)
            if compiled is not None:
                with self._lock:
                    self.loaded += 1
            else:
                traced = {**static, "options": quick_trace_options(opts)} if full is not opts else static
                lowered = _lower(fn, traced, names, pack, self._call_args(args))
                # a stored file that failed to load above is written again: compiled past JAX's cache, whose
                # executables do not serialize whole (_compile)
                if quick is not None:
                    compiled = store.load(fq) if fq is not None else None
                    fresh = False
                    if compiled is None:
                        compiled, fresh = _compile(lowered, quick, refresh=_damaged(store, fq))
                    rest = (xla_full, store, fp, fq if fresh else None, _damaged(store, fp))
                    if full is opts:
                        upgrade = (lowered, *rest)
                    else:  # traced by the key's next call, on its own thread (not in the background)
                        sig = jax.tree_util.tree_map(_signature, self._call_args(args))
                        e.pending = (functools.partial(_lower, fn, {**static, "options": full}, names, pack, sig), rest)
                        with _UPGRADING_LOCK:
                            _WAITING.add(self)
                else:
                    compiled, fresh = _compile(lowered, xla, refresh=_damaged(store, fp))
                with self._lock:
                    self.compile_seconds += time.perf_counter() - t
                if fp is not None and quick is None and fresh:
                    store.save(fp, compiled)
            if fp is not None:
                self._note(store, [fq, fp])
            e.compiled = compiled
            if upgrade is not None:
                self._upgrade(e, compiled, *upgrade)
            elif behind is not None:
                self._in_background(e, behind)
        except BaseException as err:  # noqa: BLE001 - re-raised to every waiting caller
            e.error = err
            with self._lock:
                self.generation += 1
                for k, v in list(self._entries.items()):
                    if v is e:
                        del self._entries[k]
            raise
        finally:
            e.ready.set()

    def waiting_stored(self) -> int:
        """How many optimized compiles wait for their trace that the disk store would keep."""
        with self._lock:
            return sum(e.pending is not None and _stored(e.pending) for e in self._entries.values())

    def start_upgrades(self, background: bool = True, stored_only: bool = False) -> None:
        """Trace the optimized compiles still waiting for their trace (:func:`optimized_options`) on this thread and
        start their compiles (``background=False``: compile them here too). ``stored_only``: drop those that no
        disk store keeps (at exit, where only the store would use them)."""
        with self._lock:
            waiting = [e for e in self._entries.values() if e.pending is not None]
        for e in waiting:
            self._start_upgrade(e, background, stored_only)

    def _start_upgrade(self, e: _Entry, background: bool = True, stored_only: bool = False) -> None:
        """Trace and lower ``e``'s optimized compile on this thread (tracing stays off the background threads: JAX
        traces on two threads at once were seen to mix their variables), then compile it in the background
        (``background=False``: here). ``stored_only``: only where the store keeps it (else it is dropped; the
        quick executable stays)."""
        with self._lock:
            pending, e.pending = e.pending, None
        if pending is None:
            return
        lower, rest = pending
        if stored_only and not _stored(pending):
            return
        try:
            lowered = lower()
        except Exception as err:  # noqa: BLE001 - the quick executable stays; the calls go on
            warnings.warn(f"jaxpc: the optimized trace of an executable failed ({type(err).__name__}: {err}); it "
                          "keeps running its quick compile", RuntimeWarning, stacklevel=3)
            return
        self._upgrade(e, e.compiled, lowered, *rest, background=background)

    def _upgrade(self, e: _Entry, quick, lowered, xla: dict, store, fp: str | None, fq: str | None,
                 refresh: bool = False, background: bool = True) -> None:
        """Compile ``lowered`` with ``xla`` on a background thread (or this one), store it under ``fp`` (and the
        ``quick`` executable under ``fq``, for a process that starts before this one finishes) and swap it in.
        ``refresh``: the file stored under ``fp`` failed to load (:func:`_compile`'s ``refresh``)."""
        def work():
            if fq is not None:
                store.save(fq, quick)
            full, fresh = _compile(lowered, xla, refresh=refresh)
            if fp is not None and fresh:
                store.save(fp, full)
            return full

        self._in_background(e, work, background)

    def _in_background(self, e: _Entry, make: Callable, background: bool = True) -> None:
        """Swap ``make()`` (the optimized executable: compiled, or loaded from the store) in for ``e``'s quick one,
        on a background thread (``background=False``: this one) that :meth:`wait_upgrades` and the process's exit
        wait for. Where it fails or gives None, the quick executable stays."""
        def work():
            try:
                full = make()
                if full is not None:
                    e.compiled = full  # (one attribute store: a call reads either executable whole)
            except Exception as err:  # noqa: BLE001 - the quick executable stays; the calls go on
                warnings.warn(f"jaxpc: the optimized compile of an executable failed ({type(err).__name__}: {err});"
                              " it keeps running its quick compile", RuntimeWarning, stacklevel=1)
            finally:
                with self._lock:
                    self._upgrades.discard(threading.current_thread())
                with _UPGRADING_LOCK:
                    _UPGRADING.discard(threading.current_thread())

        if not background:
            work()  # (the discards in its finally find nothing)
            return
        thread = threading.Thread(target=work, name=UPGRADE_THREAD, daemon=True)
        with self._lock:
            self._upgrades.add(thread)
        with _UPGRADING_LOCK:
            _UPGRADING.add(thread)
        thread.start()

    def _call_args(self, args: dict) -> list:
        """An executable's arguments: ``args``' values with the index tables packed (:class:`PackedTables`)."""
        return [self._packed.get(v).arrays if k == "tables" and PACK_TABLES else v for k, v in args.items()]

    def _evict(self):
        while len(self._entries) > self.max_executables:
            self.generation += 1
            gone = self._entries.pop(min(self._entries, key=lambda k: self._entries[k].used))
            self._recent = {k: v for k, v in self._recent.items() if v is not gone}

    def _note_layout(self, entry: str, comp: dict):
        """Warn once per entry where it compiles for more than ``max_layouts_per_entry`` distinct layouts (naming
        what keeps changing), or compiles one it had already compiled as often (its executables were evicted: too
        small a cache). Keeps at most ``max_layouts_per_entry + 1`` layouts per entry."""
        if entry in self._warned:
            return
        seen = self._layouts[entry]
        if comp in seen:
            self._recompiled[entry] += 1
            if self._recompiled[entry] > self.max_layouts_per_entry:
                self._warned.add(entry)
                warnings.warn(
                    f"jaxpc: '{entry}' has compiled executables it had compiled before {self._recompiled[entry]} "
                    f"times: they were evicted from the circuit's cache of {self.max_executables}; raise it "
                    f"(jaxpc.compile(root, max_executables=...)) to keep them.", RuntimeWarning,
                    skip_file_prefixes=(_PACKAGE_DIR,))
            return
        seen.append(comp)
        if len(seen) > self.max_layouts_per_entry:
            self._warned.add(entry)
            changing = [k for k in comp if len({repr(s.get(k)) for s in seen}) > 1]
            counts = {k: len({repr(s.get(k)) for s in seen}) for k in changing}
            worst = max(changing, key=lambda k: counts[k]) if changing else "unknown"
            warnings.warn(
                f"jaxpc: '{entry}' has been compiled for {len(seen)} different layouts; {worst} keeps changing "
                f"({counts.get(worst, 0)} distinct values). Keep it fixed (or pad it yourself) to reuse executables; "
                f"batch sizes are bucketed (jaxpc.compile's buckets=) unless buckets='exact'.", RuntimeWarning,
                skip_file_prefixes=(_PACKAGE_DIR,))  # points at the user's call, however deep the call path


class _NoDigest(Exception):
    """A value with no digest that is stable across processes."""


_DIGEST_DEPTH: Final = 64


def _digest(h, obj, depth: int = 0) -> None:
    """Feed ``obj`` into hash ``h`` by value, the same way in every process (no ``id``, no ``hash()`` of
    strings, sets in sorted order); raise :class:`_NoDigest` for what has no such form."""
    if depth > _DIGEST_DEPTH:
        raise _NoDigest("nested too deeply")
    d = depth + 1
    h.update(type(obj).__qualname__.encode())
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        h.update(repr(obj).encode())
    elif isinstance(obj, (np.ndarray, np.generic)):
        a = np.ascontiguousarray(obj)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    elif isinstance(obj, np.dtype):
        h.update(obj.str.encode())
    elif isinstance(obj, (tuple, list)):
        h.update(str(len(obj)).encode())
        for v in obj:
            _digest(h, v, d)
    elif isinstance(obj, dict):
        items = sorted(obj.items(), key=lambda kv: repr(kv[0]))
        h.update(str(len(items)).encode())
        for k, v in items:
            _digest(h, k, d)
            _digest(h, v, d)
    elif isinstance(obj, (set, frozenset)):
        parts = []
        for v in obj:
            sub = hashlib.sha256()
            _digest(sub, v, d)
            parts.append(sub.digest())
        for part in sorted(parts):
            h.update(part)
    else:
        _digest_object(h, obj, d)


def _single_device(sharding) -> bool:
    """Whether ``sharding`` is JAX's single-device sharding: ``jax.sharding.is_single_device_sharding`` where JAX
    has it (0.12, which deprecates the class), else the class by name (0.11, which lacks the function)."""
    test = getattr(jax.sharding, "is_single_device_sharding", None)
    if test is not None:
        return bool(test(sharding))
    return type(sharding).__name__ == "SingleDeviceSharding"


def _digest_object(h, obj, d: int) -> None:
    """:func:`_digest` of what is not a scalar, an array or a container: code by its qualified name, jaxpc's
    objects by their state."""
    if isinstance(obj, enum.Enum):
        h.update(f"{type(obj).__module__}.{obj.name}".encode())
    elif isinstance(obj, functools.partial):
        _digest(h, obj.func, d)
        _digest(h, obj.args, d)
        _digest(h, obj.keywords, d)
    elif isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
        qual, mod = getattr(obj, "__qualname__", ""), getattr(obj, "__module__", None) or ""
        if "<locals>" in qual or "<lambda>" in qual or not _trusted(mod):
            raise _NoDigest(f"function or class {mod}.{qual}")
        h.update(f"{mod}.{qual}".encode())
    elif isinstance(obj, jax.tree_util.PyTreeDef):
        h.update(str(obj).encode())
    elif isinstance(obj, _HashedSig):
        _digest(h, obj.sig, d)
    elif isinstance(obj, jax.sharding.Sharding) and _single_device(obj):
        dev = next(iter(obj.device_set))
        h.update(f"{dev.platform}:{dev.id}".encode())
    elif isinstance(obj, jax.sharding.Sharding):
        raise _NoDigest("an executable of several devices")
    elif not _trusted(type(obj).__module__):
        raise _NoDigest(f"object of {type(obj).__module__}.{type(obj).__qualname__}")
    elif dataclasses.is_dataclass(obj):
        _digest(h, type(obj), d)
        for f in dataclasses.fields(obj):
            h.update(f.name.encode())
            _digest(h, getattr(obj, f.name), d)
    elif hasattr(obj, "__dict__"):  # its pickled state: what a class holds besides caches (``__getstate__``)
        _digest(h, type(obj), d)
        _digest(h, obj.__getstate__(), d)
    else:
        raise _NoDigest(f"no stable digest for {type(obj).__qualname__}")


def _trusted(module: str) -> bool:
    """Code whose version the fingerprint covers: jaxpc's (its source digest), JAX's and NumPy's (versions)."""
    return module.split(".", 1)[0] in ("jaxpc", "jax", "jaxlib", "numpy")


@functools.cache
def _source_digest() -> str:
    """A digest of jaxpc's own source: executables stored by another version of the code are never loaded."""
    h = hashlib.sha256()
    root = os.path.dirname(os.path.abspath(__file__))
    for dirpath, dirnames, files in sorted(os.walk(root)):
        dirnames.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


_JAX_SETTINGS: Final = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
                        "jax_threefry_partitionable", "jax_numpy_rank_promotion")


def _environment() -> tuple:
    """What besides the key decides the executable: versions, the device, JAX's settings, XLA's flags."""
    dev = jax.devices()[0]
    return (jax.__version__, jax.lib.__version__ if hasattr(jax.lib, "__version__") else "", _source_digest(),
            dev.platform, getattr(dev.client, "platform_version", ""), dev.device_kind,
            tuple(str(getattr(jax.config, k, None)) for k in _JAX_SETTINGS), os.environ.get("XLA_FLAGS", ""))


class ExecutableStore:
    """Serialized executables on disk, one file per fingerprint (see the module docstring).

    Writes are atomic (a temporary file renamed into place), so processes sharing the directory never read a
    partial file; a file that fails to load (another JAX, a damaged file) is compiled again and written
    again, past JAX's own cache (:func:`_compile`).
    Only executables of one device are stored (sharded ones use JAX's persistent cache alone).
    """

    def __init__(self, directory: str):
        self.directory = str(directory)
        self._lock = threading.Lock()
        self._slots: dict[str, _Slot] = {}  # fp -> a load in progress, or one done ahead and not yet taken
        self.loaded_ahead = 0  # executables that a call took from a load ahead (:meth:`load_ahead`)

    def fingerprint(self, fn: Callable, static: dict, args: dict, compiler_options: dict) -> str | None:
        """The hex digest naming the executable of ``fn`` for this key, or None when the key has no stable
        digest or runs on more than one device."""
        return self.fingerprints(fn, static, args, compiler_options)[0]

    def fingerprints(self, fn: Callable, static: dict, args: dict, *compiler_options: dict | None) -> list:
        """:meth:`fingerprint` of the key for each of several XLA option sets (None for a None set, and all None
        where the key has none), digesting the key once."""
        h = hashlib.sha256()
        try:
            _digest(h, _environment())
            _digest(h, PACK_TABLES)
            _digest(h, fn)
            _digest(h, static)
            for name, val in args.items():
                _digest(h, name)
                _digest(h, _tree_sig(val))
        except _NoDigest:
            return [None] * len(compiler_options)
        out = []
        for xla in compiler_options:
            if xla is None:
                out.append(None)
                continue
            g = h.copy()
            _digest(g, xla)
            out.append(g.hexdigest())
        return out

    def has(self, fp: str) -> bool:
        """Whether an executable is stored under ``fp`` (not whether it loads)."""
        return os.path.exists(self._path(fp))

    def _path(self, fp: str) -> str:
        return os.path.join(self.directory, fp[:2], fp + ".jaxpc-exe")

    def load(self, fp: str):
        """The stored executable (a ``jax.stages.Compiled``), or None. Where :meth:`load_ahead` is loading it or has
        loaded it, that load is waited for and taken; two threads asking at once load it once."""
        with self._lock:
            slot = self._slots.get(fp)
            mine = slot is None
            if mine:
                slot = self._slots[fp] = _Slot()
        if not mine:
            slot.done.wait()
            with self._lock:
                if self._slots.get(fp) is slot:
                    del self._slots[fp]
                    if slot.ahead and slot.compiled is not None:
                        self.loaded_ahead += 1
            return slot.compiled if slot.compiled is not None else self._load(fp)
        try:
            slot.compiled = self._load(fp)
        finally:
            with self._lock:
                self._slots.pop(fp, None)
            slot.done.set()
        return slot.compiled

    def load_ahead(self, fps: Sequence[str]) -> None:
        """Load the executables ``fps`` on this thread, one after the other, for the calls that will ask for them
        (:meth:`load`); each one that a call is already loading is skipped."""
        for fp in fps:
            if _EXITING.is_set():
                return
            with self._lock:
                if fp in self._slots:
                    continue
                slot = self._slots[fp] = _Slot(ahead=True)
            try:
                slot.compiled = self._load(fp)
            finally:
                slot.done.set()

    def recent(self, owner: str) -> list[str]:
        """The fingerprints that earlier processes ran for ``owner`` (:meth:`note`), most recent first."""
        try:
            with open(self._index_path(owner), encoding="utf-8") as f:
                fps = json.load(f)
            return [fp for fp in fps if isinstance(fp, str)][:RECENT_EXECUTABLES]
        except (OSError, ValueError):
            return []

    def note(self, owner: str, fps: Sequence[str]) -> None:
        """Put ``fps`` (the executables a call of ``owner`` runs, the first one first) at the head of ``owner``'s
        index, which keeps the :data:`RECENT_EXECUTABLES` most recent."""
        fps = [fp for fp in fps if fp]
        old = self.recent(owner)
        new = (fps + [fp for fp in old if fp not in fps])[:RECENT_EXECUTABLES]
        if new == old:
            return
        path = self._index_path(owner)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(new, f)
            os.replace(tmp, path)
        except OSError:  # the index is an optimization: never fail the call for it
            pass

    def _index_path(self, owner: str) -> str:
        return os.path.join(self.directory, "index", owner + ".json")

    def _load(self, fp: str):
        from jax.experimental import serialize_executable as ser
        try:
            with open(self._path(fp), "rb") as f:
                device_ids, (payload, in_tree, out_tree) = pickle.load(f)
            by_id = {d.id: d for d in jax.devices()}
            return ser.deserialize_and_load(payload, in_tree, out_tree,
                                            execution_devices=[by_id[i] for i in device_ids])
        except Exception:  # noqa: BLE001 - absent, or one we cannot load: compiled (again) and stored
            return None

    def save(self, fp: str, compiled) -> bool:
        """Store ``compiled``; False when it cannot be serialized or written (the executable still runs)."""
        from jax.experimental import serialize_executable as ser
        path = self._path(fp)
        try:
            shardings = jax.tree_util.tree_leaves(compiled.input_shardings)
            devices = sorted({d.id for d in shardings[0].device_set}) if shardings else [jax.devices()[0].id]
            if len(devices) != 1:
                return False
            blob = pickle.dumps((devices, ser.serialize(compiled)), protocol=pickle.HIGHEST_PROTOCOL)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
            return True
        except Exception:  # noqa: BLE001 - storing is an optimization: never fail the call for it
            return False


RECENT_EXECUTABLES: Final = 12  # executables a circuit's index keeps for the next process to load ahead
OWNER_WAIT_S: Final = 5.0  # the longest a compile waits for its circuit's name in the index (a digest)


@dataclasses.dataclass
class _Slot:
    """A load of one stored executable: in progress until ``done``; ``ahead``: by :meth:`ExecutableStore.load_ahead`."""
    ahead: bool = False
    compiled: Any = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)


def owner_digest(*parts) -> str | None:
    """A digest naming a circuit in the store's index (its layout and dtype, say), the same in every process of
    this environment; None where ``parts`` have no stable digest."""
    h = hashlib.sha256()
    try:
        _digest(h, _environment())
        _digest(h, parts)
    except _NoDigest:
        return None
    return h.hexdigest()


_JAX_CACHE_HITS = threading.local()  # per thread: executables JAX's persistent cache served


def _count_jax_cache_hit(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _JAX_CACHE_HITS.n = getattr(_JAX_CACHE_HITS, "n", 0) + 1


jax.monitoring.register_event_listener(_count_jax_cache_hit)


def _pickle_auto_layout_as_itself() -> None:
    """Make JAX's ``AutoLayout`` (the default layout that jax 0.12 keeps in every ``ShapedArray``) pickle as the
    module's one instance. Pickled by default, it comes back as a new instance, unequal to it: a stored executable
    loaded from the disk then makes arrays whose avals hold that copy, and ``jax.grad`` through a custom VJP of them
    (the flow pass's) fails with "the layouts do not match". Where the class already pickles itself, nothing
    changes."""
    try:
        from jax._src import layout
    except ImportError:  # (a JAX without it)
        return
    cls, one = getattr(layout, "AutoLayoutSingleton", None), getattr(layout, "AutoLayout", None)
    if cls is not None and isinstance(one, cls) and "__reduce__" not in vars(cls):
        cls.__reduce__ = lambda self: "AutoLayout"  # (a global's name: unpickled as layout.AutoLayout itself)


_pickle_auto_layout_as_itself()


def _compile(lowered, compiler_options: dict, *, refresh: bool = False):
    """``(compiled, fresh)``: ``lowered`` compiled with ``compiler_options``; ``fresh`` is False where JAX's own
    persistent cache served it. Only fresh executables go to the store: one that JAX deserialized does not
    serialize whole again (on jax 0.12's CPU backend the copy loads but fails at its first call with
    ``NOT_FOUND: Function ... not found``). ``refresh``: compiled by XLA past JAX's cache
    (:func:`_jax_cache_skipped`), for a key whose stored file failed to load and is to be written again."""
    before = getattr(_JAX_CACHE_HITS, "n", 0)
    if refresh:
        with _jax_cache_skipped():
            compiled = lowered.compile(compiler_options=compiler_options or None)
    else:
        compiled = lowered.compile(compiler_options=compiler_options or None)
    return compiled, getattr(_JAX_CACHE_HITS, "n", 0) == before


_SKIPPING = threading.Lock()  # one _jax_cache_skipped at a time


@contextlib.contextmanager
def _jax_cache_skipped():
    """JAX's persistent compilation cache neither read nor written by the compiles in this block: JAX decides once
    per process whether its cache is on (at the first compile after a reset), so the block resets that decision,
    makes it with the cache off for this thread, and resets it again at its end. Compiles of other threads meanwhile
    may skip JAX's cache too (they compile instead of loading, which changes none of their results), or decide first
    that it is on (then the block's compile may come from JAX's cache, and :func:`_compile` reports it)."""
    from jax._src import config as jax_config

    switch = getattr(jax_config, "enable_compilation_cache", None)
    if switch is None:  # (a JAX without it: the compile may come from its cache, and _compile reports it)
        yield
        return
    with _SKIPPING:
        _reset_jax_cache()
        try:
            with switch(False):
                yield
        finally:
            _reset_jax_cache()


_STORE: ExecutableStore | None = None  # set by enable_persistent_cache / default_persistent_cache


def enable_persistent_cache(directory: str, min_compile_seconds: float = 0.0) -> None:
    """Store compiled executables in ``directory`` for later processes: jaxpc's own executables serialized
    under ``directory/executables`` (loaded without tracing or lowering), and JAX's persistent compilation
    cache for every other jitted function. jaxpc turns one on by default (:func:`default_persistent_cache`);
    call this to choose another directory. ``min_compile_seconds`` (default 0: every one): JAX's persistent cache
    keeps only executables whose compile took at least this long (``jax_persistent_cache_min_compile_time_secs``);
    jaxpc's own store keeps every executable it compiles."""
    global _STORE
    _STORE = ExecutableStore(os.path.join(str(directory), "executables"))
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _reset_jax_cache()


def persistent_cache_dir() -> str | None:
    """The directory of jaxpc's default persistent compilation cache, or None when it is turned off.

    ``JAXPC_PERSISTENT_CACHE=0`` turns it off; ``JAXPC_CACHE_DIR`` sets the directory (default
    ``$XDG_CACHE_HOME/jaxpc/xla``, else ``~/.cache/jaxpc/xla``)."""
    if os.environ.get("JAXPC_PERSISTENT_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    d = os.environ.get("JAXPC_CACHE_DIR")
    if d:
        return d
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxpc", "xla")


def default_persistent_cache() -> str | None:
    """Turn on jaxpc's per-user persistent caches (run once, when jaxpc is imported).

    JAX's cache is left alone where the user has set JAX's own ``jax_compilation_cache_dir`` (config or the
    ``JAX_COMPILATION_CACHE_DIR`` variable); jaxpc's executable store stays in its own directory. Both are off
    with ``JAXPC_PERSISTENT_CACHE=0``. Returns the directory of JAX's cache when jaxpc set it, else None."""
    global _STORE
    d = persistent_cache_dir()
    if d is None:
        return None
    if jax.config.jax_compilation_cache_dir:
        _STORE = ExecutableStore(os.path.join(d, "executables"))
        return None
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        warnings.warn(f"jaxpc: persistent compilation cache off: cannot create {d} ({e}); set JAXPC_CACHE_DIR "
                      f"or JAXPC_PERSISTENT_CACHE=0", RuntimeWarning, stacklevel=2)
        return None
    enable_persistent_cache(d, min_compile_seconds=0.0)
    return d


def _reset_jax_cache() -> None:
    """Make JAX decide again at its next compile whether its persistent cache is on (it decides once): a cache
    directory set after JAX's first compile takes effect, and :func:`_jax_cache_skipped` turns the cache off."""
    try:
        from jax._src import compilation_cache
        compilation_cache.reset_cache()
    except Exception:  # noqa: BLE001 - a JAX without it reads the directory at its first compile
        pass
