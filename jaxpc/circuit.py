"""The compiled circuit: a thin shell that bundles the static layout, the index tables and
the jitted pure functions of :mod:`jaxpc.engine`.

Everything a ``Circuit`` method does is also available as a pure function
``f(layout, tables, params, ...)``; the methods validate inputs, build the frozen
:class:`~jaxpc.Options`, and call the jitted executable.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import checks, distributions
from .compiler import compile as _compile
from .compiler.layout import Layout, ScanSpec
from .distributions.base import RandomSource
from .engine import em, forward, partial, routing, stages
from .engine.logflows import LogFlows
from .executables import BucketPolicy, CacheInfo, ExecutableCache
from .nodes import CircuitNodes
from .options import Options
from .runtime import ENTRY_POINTS, LOG_FLOWS, VALIDATE, Entry, Runtime, check_em_args, declare_entries

Array = jax.Array
Params = dict

__all__ = ["Circuit", "compile"]


def compile(root: CircuitNodes, *, seed: int = 0, dtype=jnp.float32, scan_min_repeats: int = 3,
            max_executables: int = 128, max_layouts_per_entry: int = 8, buckets="pow2", min_bucket: int = 8,
            compile_after: int = 1) -> Circuit:
    """Compile a node graph into a :class:`Circuit` (host side, once).

    Args:
        root: the root node vector (a single node).
        seed: seed of the random initial parameters of nodes created without ``params=``.
        dtype: floating dtype of parameters and node values.
        scan_min_repeats: stages whose shapes repeat at least this many times in a row run under
            ``lax.scan`` (keeps trace/compile time flat for deep HMMs); 0 disables scanning.
        max_executables: executables the circuit keeps (least recently used dropped first).
        max_layouts_per_entry: after this many layouts of one entry point, warn once naming the
            component of the key that keeps changing.
        buckets: batch padding policy: ``"pow2"`` (next power of two, at least ``min_bucket``),
            ``"exact"`` (no padding) or a sequence of sizes (the smallest that fits; larger batches use multiples
            of the largest). Anything else is a ``ValueError``.
        min_bucket: the smallest padded batch of ``buckets="pow2"`` (default 8: batches of 1 to 8 rows share one
            executable); unused by the other policies. A positive int, else a ``ValueError``.
        compile_after: compile a new layout on its ``compile_after``-th sighting; before that, run it
            on an already compiled larger bucket when one exists (cheap one-off shapes).
    """
    seed = _compile.check_seed(seed)
    struct = _compile.build(root, scan_min_repeats=scan_min_repeats)
    return Circuit(root, struct, seed=seed, dtype=dtype,
                   cache=ExecutableCache(max_executables, max_layouts_per_entry, compile_after),
                   buckets=BucketPolicy(buckets, min_bucket))


@functools.partial(jax.jit, static_argnames=("num", "nb", "ncb", "exp", "fill"))
def _dense_blocks(group: Array, start, rows: Array, cols: Array, *, num: int, nb: int, ncb: int, exp: bool,
                  fill: float = 0.0) -> Array:
    """``num`` blocks ``[Kp, Kc]`` of ``group`` from ``start`` (``exp``: their exponentials) at block rows ``rows`` and
    columns ``cols`` of a dense ``[nb * Kp, ncb * Kc]`` matrix, ``fill`` elsewhere."""
    blocks = lax.dynamic_slice_in_dim(group, start, num, axis=0)
    blocks = jnp.exp(blocks) if exp else blocks
    Kp, Kc = blocks.shape[1:]
    dense = jnp.full((nb, ncb, Kp, Kc), fill, blocks.dtype).at[rows, cols].set(blocks)
    return dense.transpose(0, 2, 1, 3).reshape(nb * Kp, ncb * Kc)


class Circuit:
    """A compiled probabilistic circuit, built by :func:`jaxpc.compile`, which passes the constructor's arguments:
    ``root``, ``struct`` (the compiled structure), ``seed``, ``dtype``, ``cache`` (the executable cache) and
    ``buckets`` (the batch padding policy). Build circuits with ``compile``, not with the constructor.

    Attributes:
        params: the initial parameters (the values set on the nodes, seeded random elsewhere).
        layout: static :class:`~jaxpc.compiler.layout.Layout`.
        tables: pytree of ``int32`` index tables (device arrays).
        num_vars: number of variables (columns of ``x``).
    """

    def __init__(self, root: CircuitNodes, struct: _compile.CompiledStructure, *, seed: int = 0,
                 dtype=jnp.float32, cache: ExecutableCache | None = None, buckets: BucketPolicy | None = None):
        self.root = root
        self._struct = struct
        self.layout: Layout = struct.layout
        self.dtype = jnp.dtype(dtype)
        if not jnp.issubdtype(self.dtype, jnp.floating):
            raise TypeError(f"compile: dtype must be a floating dtype, got {self.dtype}")
        if jax.dtypes.canonicalize_dtype(self.dtype) != self.dtype:
            raise ValueError(f"compile: dtype={self.dtype} needs 64-bit JAX: "
                             "jax.config.update('jax_enable_x64', True) before compiling")
        # one batched transfer (jnp.asarray of a numpy array compiles an identity executable per shape)
        tables = _compile.shared_kernel_tables(_compile.finalize_tables(struct.tables, self.layout), self.layout)
        self.tables = jax.device_put(routing.cluster_tables(self.layout, tables))
        self.num_vars = self.layout.num_vars
        self._var_info = checks.VarInfo.from_var_dists(self.num_vars, struct.var_dists)
        self.runtime = Runtime(self._var_info, self.dtype, cache, buckets)
        fold = self.tables.get("fold")
        self.runtime.clusters = isinstance(fold, dict) and "clusters" in fold.get("tree", {})
        # (a chain's propagations run its own scans, not the stages)
        self.runtime.cache.scans = self.layout.chain is None and any(
            isinstance(s, ScanSpec) for plan in (self.layout, self.layout.fold) if plan is not None for s in plan.steps)
        for name, (fn, rows) in _ENTRIES.items():
            self.runtime.register(name, Entry(functools.partial(fn, self.layout), rows))
        self.runtime.register("init", Entry(lambda tables, key: self._init_params_fn(
            tables, RandomSource(key=key, dtype=self.dtype)), None))
        # (before the initial draw, which takes seconds on the host for a large circuit: the loads overlap it)
        self.runtime.load_ahead("circuit", self.layout, str(self.dtype))
        self.params: Params = self._initial_params(seed)
        self.runtime.set_params(self.params)
        self.runtime.stat_fields = {spec.key: spec.dist.stat_fields for spec in self.layout.input_layers}

    # ------------------------------------------------------------------------------------------
    # parameters
    # ------------------------------------------------------------------------------------------
    def _init_params_fn(self, tables: dict, rs: RandomSource) -> Params:
        layout = self.layout
        sums = {g.key: rs.log_weights((g.num_blocks, g.Kp, g.Kc), tables["groups"][g.key]["seg"], g.num_segments)
                for g in layout.sum_groups}
        ins = {}
        for spec, tab in zip(layout.input_layers, tables["inputs"]):
            ins[spec.key] = spec.dist.init(rs, spec.num_rows, tab["meta"])
        return {"sum": sums, "input": ins}

    def init_params(self, key: Array) -> Params:
        """A fresh random draw of all parameters (normalized), keyed by ``key`` (jittable, vmappable)."""
        checks.check_key(key, "init_params: ")
        return self.runtime.run("init", {}, {"tables": self.tables, "key": key})

    def _initial_params(self, seed: int) -> Params:
        """Node-given parameters, with a host-side seeded random draw elsewhere (no XLA compile), on the device:
        one batched transfer; on a CPU the aligned arrays (the large draws) become device arrays without a copy."""
        return jax.device_put(self._host_params(seed))

    def _host_params(self, seed: int) -> dict:
        """The initial parameters as numpy arrays of the circuit's dtype."""
        # the groups' and input layers' tables, which finalize_tables leaves as they are
        p = self._init_params_fn(self._struct.tables, RandomSource(rng=np.random.default_rng(seed),
                                                                    dtype=np.dtype(self.dtype)))
        st = self._struct
        for sid, pl in st.sum_placement.items():
            blocks = st.sources[sid].own_params
            if blocks is not None:
                with np.errstate(divide="ignore"):
                    p["sum"][pl.group][pl.start:pl.start + pl.num_edge_blocks] = np.log(blocks)
        for sid, pl in st.input_placement.items():
            src = st.sources[sid]
            if src.dist.has_full_params(src.own_params):
                internal = src.dist.natural_to_internal(src.own_params)
                for name, val in internal.items():
                    p["input"][pl.key][name][pl.row_start:pl.row_start + pl.num_nodes] = val
        return jax.tree_util.tree_map(lambda a: np.asarray(a, dtype=self.dtype), p)

    def get_node_params(self, params: Params, node: CircuitNodes):
        """The parameters of ``node`` in its natural dense form, read from ``params`` (a params pytree of this
        circuit; another structure or shape is a ``ValueError``).

        Sum nodes: ``[num_nodes, num_ch_nodes]`` weights, the exponentials of ``params["sum"]`` (zero between
        unconnected blocks): each node's sum to one after EM, not after gradient training of unnormalized
        log-weights (``jaxpc.optim.normalize`` gives the normalized ones). Input nodes: the distribution's natural
        parameters (``Categorical``: ``[num_nodes, num_cats]`` probabilities; multi-field distributions: a dict).
        Tied vectors return their source's values.
        """
        st = self._struct
        src = _node_arg(node, "get_node_params").source
        if src.id not in st.sources:
            raise ValueError(f"get_node_params: {node.name} is not part of this circuit")
        checks.check_params(self.runtime.params_spec, params)
        if node.is_sum():
            return self._dense_sum(params, src, exp=True)
        if node.is_input():
            pl = st.input_placement[src.id]
            tab = self.tables["inputs"][pl.layer]["meta"]
            sl = slice(pl.row_start, pl.row_start + pl.num_nodes)
            p = {k: v[sl] for k, v in params["input"][pl.key].items()}
            nat = src.dist.internal_to_natural(p, {k: v[sl] for k, v in tab.items()})
            fields = src.dist.natural_fields
            return nat[fields[0]] if len(fields) == 1 else nat  # parameter-free leaves: {"value": ...}
        raise ValueError(f"get_node_params: {node.name} is a product vector; products have no parameters")

    def _dense_sum(self, tree: dict, src, exp: bool, fill: float = 0.0) -> Array:
        """Sum vector ``src``'s blocks of ``tree["sum"]`` (``exp``: of their exponentials) laid out dense, ``fill``
        where it has no edge: one executable per block shape and count, the blocks' place an argument (eager ops
        compiled each of them per vector)."""
        pl = self._struct.sum_placement[src.id]
        rows, cols = (np.asarray(e, np.int32) for e in src.edge_ids)
        return _dense_blocks(tree["sum"][pl.group], pl.start, rows, cols, num=pl.num_edge_blocks,
                             nb=src.num_node_blocks, ncb=src.num_ch_node_blocks, exp=exp, fill=fill)

    def get_node_flows(self, flows: dict, node: CircuitNodes, *, logspace: bool | None = None):
        """The flows of ``node`` in the dense form of :meth:`get_node_params`.

        Sum nodes: expected edge counts ``[num_nodes, num_ch_nodes]``. Input nodes: the distribution's
        expected sufficient statistics for the node's rows (``Categorical``: counts ``[num_nodes, num_cats]``;
        ``Bernoulli`` too, ``[num_nodes, 2]``, though its parameters read ``[num_nodes]``, the probability of 1).
        Tied vectors share flows: the value is the total over all of them.
        ``logspace``: ``flows`` are log flows (``Options(logspace_flows=True)``), so a sum vector's missing edges
        read ``-inf`` (a zero count), not 0. Default None: True for :class:`~jaxpc.engine.logflows.LogFlows` (what
        ``flows`` returns with ``logspace_flows``), False for other dicts; False with ``LogFlows`` is a
        ``ValueError``.
        """
        st = self._struct
        src = _node_arg(node, "get_node_flows").source
        is_log = isinstance(flows, LogFlows)
        if logspace is None:
            logspace = is_log
        elif checks.check_bool("get_node_flows", "logspace", logspace) is False and is_log:
            raise ValueError("get_node_flows: flows are log flows (Options(logspace_flows=True)), but logspace=False "
                             "reads them as counts: leave logspace out (or pass True)")
        if src.id not in st.sources:
            raise ValueError(f"get_node_flows: {node.name} is not part of this circuit")
        self.runtime.check_flows(flows, ("sum",) if node.is_sum() else ("input",) if node.is_input() else (),
                                 stats=False)
        if node.is_sum():
            return self._dense_sum(flows, src, exp=False, fill=-np.inf if logspace else 0.0)
        if node.is_input():
            pl = st.input_placement[src.id]
            sl = slice(pl.row_start, pl.row_start + pl.num_nodes)
            stats = {k: v[sl] for k, v in flows["input"][pl.key].items()}
            return next(iter(stats.values())) if len(stats) == 1 else stats
        raise ValueError(f"get_node_flows: {node.name} is a product vector; products have no parameters")

    # ---- per-sample sum parameters -------------------------------------------------------------
    @property
    def num_gates(self) -> int:
        """Columns of ``evidence["sum_gates"]`` ``[B, num_gates]``: the gates of the sum vectors declared with
        :meth:`~jaxpc.nodes.SumNodes.set_gates` (0 when there are none)."""
        return self.layout.num_gates

    def gate_slice(self, node: CircuitNodes) -> slice:
        """The columns of ``evidence["sum_gates"]`` that gated sum vector ``node`` reads: ``[E, Kp // gate block]``
        row-major (``E`` its edge blocks in the order of ``node.edge_ids``' columns, ``Kp`` its block size), so
        ``gates[:, circuit.gate_slice(ns)] = g.reshape(B, -1)`` sets them from ``g [B, E, Kp // gate block]``.
        Vectors tied with ``tie_to`` return their owner's columns."""
        st = self._struct
        if _node_arg(node, "gate_slice").source.id not in st.sources:
            raise ValueError(f"gate_slice: {node.name} is not part of this circuit")
        pl = st.gate_placement.get(node.id)
        if not node.is_sum():
            raise ValueError(f"gate_slice: {node.name} is not a sum vector; only sum vectors have gates")
        if pl is None:
            raise ValueError(f"gate_slice: {node.name} has no gates; declare them with {node.name}.set_gates() "
                             f"before jaxpc.compile")
        return slice(pl.start, pl.stop)

    def param_slice(self, node: CircuitNodes) -> tuple[str, slice]:
        """``(group, blocks)``: where sum vector ``node``'s parameter blocks lie, ``params["sum"][group][blocks]``
        (``[E, Kp, Kc]``, its edge blocks in the order of ``node.edge_ids``' columns); the rows of the per-block
        evidence (``sum_lowrank``, ``sum_gates {group: [B, P]}``) that it reads. Tied vectors share them."""
        st = self._struct
        if not _node_arg(node, "param_slice").is_sum() or node.source.id not in st.sum_placement:
            raise ValueError(f"param_slice: {node.name} is not a sum vector of this circuit")
        pl = st.sum_placement[node.source.id]
        return pl.group, slice(pl.start, pl.start + pl.num_edge_blocks)

    # ------------------------------------------------------------------------------------------
    # evaluation
    # ------------------------------------------------------------------------------------------
    def cache_info(self) -> CacheInfo:
        """``CacheInfo(hits, misses, compile_seconds, live)`` of this circuit's executables."""
        return self.runtime.cache.info()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait until this circuit's executables compiling in the background are done: on a GPU a new executable
        first runs a quick compile and is swapped for the fully optimized one when that is ready
        (``Tuning.quick_first_compile``). Optimized executables that run scanned stages unrolled
        (``Tuning.unroll_optimized``) are traced here first, on this thread, where the key's second call has not
        done it yet. True when none is left; False when ``timeout`` seconds passed first. Benchmarks call it
        before timing; training loops need not."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)):
            raise TypeError(f"wait_compiled: timeout must be None or seconds >= 0, got {timeout!r}")
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"wait_compiled: timeout must be None or seconds >= 0, got {timeout!r}")
        return self.runtime.cache.wait_upgrades(timeout)

    def compiled(self, entry: str = "flows"):
        """The most recently used compiled executable of entry point ``entry`` (``"log_prob"``, ``"flows"``,
        ``"em_step"``, ``"conditional"``, ``"parallel.em_step"``, ``"optim.fit"``, ...), a ``jax.stages.Compiled``
        for inspection (``.memory_analysis()``: the step's temporaries, arguments and outputs; ``.as_text()``: its
        optimized HLO), or None before its first call. A name that is no entry point raises a ``ValueError``
        listing them."""
        if not isinstance(entry, str) or entry not in ENTRY_POINTS:
            raise ValueError(f"compiled: {entry!r} is not an entry point; entry points: {sorted(ENTRY_POINTS)}")
        return self.runtime.cache.latest(entry)

    def raise_pending(self) -> None:
        """Wait for the input checks of earlier calls on device arrays and raise the first failure now.

        With ``validate=True`` (the default) a device array's values are checked inside the executable; a
        failed check is raised by the circuit's next call, or here (see :mod:`jaxpc.runtime`)."""
        self.runtime.raise_pending()

    EVIDENCE_KEYS = ("categorical_logp", "categorical_topk", "external", "latent", "sum_gates", "sum_lowrank")

    def check_params(self, params) -> None:
        """Raise a ``ValueError`` where ``params`` are not this circuit's: another structure or shape, a dtype that is
        not floating point, or an entry that is NaN or +inf (named with its leaf and index; log-weights may be
        -inf). The values are reduced on the device and read on the host only where one is bad. Calls check shapes
        and dtypes themselves but not the parameters' values (that would read them all on every call), except with
        ``validate="sync"``; a NaN parameter otherwise gives NaN outputs."""
        checks.check_params(self.runtime.params_spec, params)
        self.runtime.check_params_now(params, where="")

    def check_evidence(self, evidence: dict | None, batch: int) -> dict | None:
        """Validate per-call evidence; every array's leading axis is the batch.

        Keys: ``categorical_logp [B, V, K]`` or ``categorical_topk {"ids" int[B, V, k], "logp" [B, V, k],
        "mask" bool[B, V, k] optional}`` (``SoftEvidenceCategorical`` leaves); ``external [B, V, M]``
        (``External`` leaves, node ``j`` of a vector over ``v`` reading ``[:, v, j]``; ``M``: the most nodes of such a
        vector); ``latent [B, V, M]`` (added to node ``j`` of each leaf vector over ``v``; ``M``: the most nodes of
        any leaf vector);
        ``sum_gates [B, G]`` (BlockScale log-gates of the sum vectors declared with
        :meth:`~jaxpc.nodes.SumNodes.set_gates`, G = :attr:`num_gates`, each vector's columns at :meth:`gate_slice`)
        or ``sum_gates {group: [B, P]}`` (one log-gate per parameter block of ``params["sum"][group]``, every sum
        vector reading that block); ``sum_lowrank {group: {"u": [B, P, Kp, r], "v": [B, P, r, Kc]}}`` (non-negative
        LowRank factors per parameter block, :meth:`param_slice`).

        Values: log-values (``categorical_logp``, ``external``, ``latent``, ``sum_gates``, the top-k ``logp``) must
        not be NaN or +inf (-inf is a zero); LowRank factors must be finite and non-negative; top-k ids must be values
        of the soft evidence leaves (``[0, num_cats)``) and distinct among a row's unmasked entries. This method checks
        the shapes and dtypes of every array and the values of host (numpy) arrays, raising a ``ValueError`` that
        names the key, the first bad index and its value, and their number. The values of concrete device arrays
        are checked by the entry points that take ``evidence=`` (:meth:`log_prob`, :meth:`flows`, :meth:`em_step`,
        :mod:`jaxpc.parallel`, :func:`jaxpc.optim.fit`), as a device batch's are (see :mod:`jaxpc.runtime`): one
        small reduction on the device whose flag the circuit's next call reads (``validate=True``, the default),
        or this call (``validate="sync"``; ``fit`` reads it after its first epoch), raising the same error;
        ``validate=False`` checks none. Unlike a bad row of ``x``, bad evidence is not cleaned or left out: the
        outputs of the call that took it are not valid (NaN, or wrong for an out-of-range id). Tracers (the evidence
        inside a user's ``jax.jit`` or ``jax.grad``) are not checked: nothing can raise from a trace.
        """
        if isinstance(batch, bool) or not isinstance(batch, numbers.Integral):
            raise TypeError(f"check_evidence: batch must be an int >= 0, got {batch!r}")
        if batch < 0:
            raise ValueError(f"check_evidence: batch must be an int >= 0, got {batch!r}")
        return self._check_evidence(evidence, int(batch))[0]

    def prepare_evidence(self, evidence: dict | None, batch, where: str) -> tuple:
        """``(checked, record)``: the evidence :meth:`check_evidence` returns for a call on ``batch``
        (:meth:`Runtime.prepare`), and a function of no arguments that records the value check of its concrete
        device arrays (:meth:`Runtime.deferred_check`; ``where`` names the call in its error): call it right after
        the call's work is dispatched. It follows the batch's ``validate``: the circuit's next call raises the error
        (True), this one (``"sync"``), or nothing is checked (False, or a traced batch)."""
        ev, device, num_cats = self._check_evidence(evidence, batch.n)
        if not device:  # (the default call's path: nothing built)
            return ev, self.runtime.deferred_check(batch, "evidence_flag", None, {}, None)
        check = checks.EvidenceCheck(tuple(rule for _, rule, _ in device), num_cats)
        explain = functools.partial(checks.explain_bad_evidence, device, num_cats, where)
        return ev, self.runtime.deferred_check(batch, "evidence_flag", check,
                                               {"arrays": tuple(arrays for _, _, arrays in device)}, explain)

    @functools.cached_property
    def _node_widths(self) -> dict[str, int]:
        """The last axis of ``evidence["latent"]`` and ``evidence["external"]``: the most nodes of a leaf vector
        (of an ``External`` one), whose node ``j`` reads entry ``j``."""
        widths = {"latent": 0, "external": 0}
        for spec, tab in zip(self.layout.input_layers, self._struct.tables["inputs"]):
            w = int(np.max(tab["pos"])) + 1 if len(tab["pos"]) else 0
            widths["latent"] = max(widths["latent"], w)
            if isinstance(spec.dist, distributions.External):
                widths["external"] = max(widths["external"], w)
        return widths

    def _check_evidence(self, evidence: dict | None, batch: int) -> tuple[dict | None, list, int | None]:
        """:meth:`check_evidence`'s evidence, the concrete device arrays whose values are still to be checked
        (``(name, rule, arrays)`` per group, :class:`jaxpc.checks.EvidenceCheck`) and the soft evidence leaves'
        number of values (the top-k ids' bound; None without such leaves)."""
        if evidence is None:
            return None, [], None
        if not isinstance(evidence, dict):
            raise TypeError(f"evidence must be a dict, got {type(evidence).__name__}")
        unknown = set(evidence) - set(self.EVIDENCE_KEYS)
        if unknown:
            raise ValueError(f"unknown evidence key(s) {sorted(unknown)}; valid keys: {list(self.EVIDENCE_KEYS)}")
        V = self.num_vars
        soft = {spec.dist.num_cats for spec in self.layout.input_layers
                if isinstance(spec.dist, distributions.SoftEvidenceCategorical)}
        num_cats = max(soft) if soft else None
        if evidence.get("categorical_logp") is not None and evidence.get("categorical_topk") is not None:
            raise ValueError("evidence holds both evidence['categorical_logp'] (dense) and "
                             "evidence['categorical_topk'] soft evidence: give one of them")
        out, device = {}, []
        readers = {"categorical_logp": distributions.SoftEvidenceCategorical,
                   "categorical_topk": distributions.SoftEvidenceCategorical, "external": distributions.External}
        for key, val in evidence.items():
            if val is None:
                continue
            if key in readers and not any(isinstance(spec.dist, readers[key]) for spec in self.layout.input_layers):
                raise ValueError(f"evidence['{key}'] is read by {readers[key].__name__} leaves, and this circuit has "
                                 f"none")
            if key in ("categorical_logp", "external", "latent"):
                a = _evidence_array(key, val, batch, 3, values="log", device=device)
                if a.shape[1] != V:
                    raise ValueError(f"evidence['{key}'] must have shape [{batch}, {V}, ...], got {tuple(a.shape)}")
                if key == "categorical_logp" and a.shape[2] != num_cats:
                    raise ValueError(f"evidence['{key}'] must have shape [{batch}, {V}, {num_cats}] (the "
                                     f"SoftEvidenceCategorical leaves' largest num_cats last; a leaf of fewer values "
                                     f"reads the first num_cats), got {tuple(a.shape)}")
                if key != "categorical_logp" and a.shape[2] != self._node_widths[key]:
                    whose = "External leaf vector" if key == "external" else "leaf vector"
                    raise ValueError(f"evidence['{key}'] must have shape [{batch}, {V}, "
                                     f"{self._node_widths[key]}] (entry j for node j of each {whose} over a "
                                     f"variable; the largest has {self._node_widths[key]} nodes), got "
                                     f"{tuple(a.shape)}")
                out[key] = a
            elif key == "categorical_topk":
                out[key] = _check_topk_evidence(val, batch, num_cats, device, V)
            else:  # sum_gates / sum_lowrank
                out[key] = _check_sum_evidence(key, val, batch, {g.key: g for g in self.layout.sum_groups},
                                               self.num_gates, device)
        # float evidence computes in the circuit's dtype (float64 numpy evidence under x64 widened a float32 circuit)
        out = jax.tree_util.tree_map(
            lambda a: a.astype(self.dtype) if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != self.dtype else a,
            out)
        return out or None, device, num_cats

    # ---- evaluation ----------------------------------------------------------------------------
    def log_prob(self, params: Params, x, missing=None, *, propagation: str | None = None,
                 alpha: float | None = None, options: Options | None = None, validate: bool | str = True,
                 evidence: dict | None = None) -> Array:
        """Log-likelihood (or max-product value) of each sample.

        Args:
            params: a params pytree of this circuit.
            x: ``int[B, V]`` category ids (floats where a variable is continuous).
            missing: ``bool[B, V]`` or ``bool[V]``; True marks a variable to marginalize
                (maximize under MPE).
            propagation: ``"LL"`` (default), ``"MPE"`` or ``"GeneralLL"`` (with ``alpha``).
            alpha: the GeneralLL exponent, a positive finite float: sum nodes compute
                ``(1/alpha) log sum_c (w_c p_c)^alpha`` (``alpha=1`` is LL). Required with, and only allowed with,
                ``propagation="GeneralLL"`` (else a ``ValueError``); default None.
            options: a full :class:`Options` (keyword overrides apply on top).
            validate: ``True`` (default): numpy values are checked before running and raise at once; a device
                array's are checked inside the executable (bad rows give NaN; the error is raised by the
                circuit's next call or :meth:`raise_pending`). ``"sync"``: raise at once, and check the parameters'
                values too (:meth:`check_params`). ``False``: no check.
                See :mod:`jaxpc.runtime`.
            evidence: per-call evidence (see :meth:`check_evidence`): soft evidence for
                ``SoftEvidenceCategorical`` leaves, values of ``External`` leaves, latent log-potentials,
                per-sample sum parameters (BlockScale gates, LowRank factors). Traced: new evidence
                never recompiles; differentiable with ``jax.grad``. Its values are checked under ``validate`` as
                ``x``'s are: numpy arrays at once, device arrays by a flag that the next call (``"sync"``: this
                one) reads.

        Returns:
            ``float[B]``.

        Reverse-mode derivatives (``jax.grad``, ``jax.hessian``) run the flow pass; forward mode (``jax.jvp``,
        ``jax.jacfwd``) needs ``options=jaxpc.Options(backward="autodiff")``, since the flow pass is a custom VJP.
        """
        replay = None
        if evidence is None:
            replay = ("log_prob", options, propagation, alpha, validate)
            rt = self.runtime
            if rt.clusters:
                opts_of = functools.partial(Options.make, options, propagation=propagation, alpha=alpha)
                out = rt.replay(replay, x, missing, params=params,
                                tree_weights=rt.tree_weights_later(self.layout, params, x, replay[:4], opts_of, False))
            else:
                out = rt.replay(replay, x, missing, params=params)
            if out is not None:
                return out
        opts = Options.make(options, propagation=propagation, alpha=alpha)
        batch = self.runtime.prepare(x, missing, validate)
        ev, record = self.prepare_evidence(evidence, batch, "circuit.log_prob")
        args = {"tables": self.tables, "params": params, "evidence": ev}
        if ev is None:
            args = self.runtime.with_tree_weights(args, self.layout, batch, ("log_prob", options, propagation, alpha),
                                                  opts, False)
        out = self.runtime.run("log_prob", {}, args, batch, options=opts, batched={"evidence": 0}, replay=replay,
                               free=("params", "tree_weights"))
        record()  # the device evidence's values (the circuit's next call raises a failure; this one with "sync")
        return out

    def node_values(self, params: Params, x, missing=None, *, options: Options | None = None,
                    validate: bool | str = True) -> Array:
        """The value of every node, ``[R, B]`` (the buffer partial evaluation starts from; ``R`` the layout's rows).

        ``params``, ``x`` ``[B, V]`` and ``missing`` (``bool[B, V]`` or ``bool[V]``, True: marginalized) as for
        :meth:`log_prob`; ``options``: a full :class:`Options` (its propagation applies); ``validate``: ``True``
        (default), ``"sync"`` or ``False``, as for :meth:`log_prob` (a bad value raises a ``ValueError`` naming the
        variable, at once for numpy inputs; anything else raises a ``ValueError``)."""
        batch = self.runtime.prepare(x, missing, validate)
        return self.runtime.run("node_values", {}, {"tables": self.tables, "params": params}, batch,
                                options=Options.make(options))

    def partial(self, variables) -> PartialEvaluation:
        """A plan that re-evaluates only the nodes whose scope meets ``variables`` (host side, once).

        ``plan.log_prob(params, x, values)`` returns ``(ll, values)``: the log-likelihoods of ``x`` and the
        updated node buffer, reading every other node from ``values`` (e.g. from :meth:`node_values` or a
        previous partial call). The plan is part of the executable key."""
        from .compiler.partial import build_plan

        plan, tabs = build_plan(self._struct, variables)
        tabs = _compile.finalize_tables(tabs, self.layout)
        dev = jax.tree_util.tree_map(jnp.asarray, tabs)
        dev["meta"] = [t["meta"] for t in self.tables["inputs"]]
        return PartialEvaluation(self, plan, dev, tuple(sorted({int(v) for v in variables})))

    def flows(self, params: Params, x, missing=None, *, ll_weights=None, options: Options | None = None,
              validate: bool | str = True, return_ll: bool = False, evidence: dict | None = None,
              return_evidence_grad: bool = False):
        """Expected counts: a pytree like ``params`` (sum groups: expected edge counts ``[P, Kp, Kc]``;
        input layers: their distribution's expected sufficient statistics), obtained with ``jax.grad``.

        ``params``, ``x`` ``[B, V]``, ``missing``, ``validate`` and ``evidence`` as for :meth:`log_prob`.
        ``ll_weights`` ``[B]`` weights each sample (finite; their values checked under ``validate`` as ``x``'s are:
        numpy at once, device arrays by the next call). With ``return_ll`` returns ``(flows, ll)``. With
        ``return_evidence_grad`` (``evidence`` given) also returns, last, the gradient of the weighted
        log-likelihood ``sum_b w_b log p(x_b)`` with respect to ``evidence``: a pytree like the checked evidence,
        None at its integer leaves (top-k ids), computed in the same executable (the CoDD step: log-likelihoods,
        evidence gradient and parameter flows in one call).
        ``options=Options(node_flows=True)`` adds ``"node"``, the M-step's denominators (each parameter block's
        parent totals ``[P, Kp]``, each input row's total ``[rows]``: ``flows["sum"][g] / flows["node"]["sum"][g][...,
        None]`` is EM's update without pseudocount); ``Options(logspace_flows=True)`` returns the logarithm of every
        flow, computed in the log domain (no underflow; exactly zero is ``-inf``; not with ``return_evidence_grad``),
        as a :class:`~jaxpc.engine.logflows.LogFlows` (a dict of the same keys, which :meth:`em_update` refuses:
        :func:`jaxpc.engine.logflows.to_counts` converts). See :class:`Options`. The flows are differentiable
        (``jax.grad`` of a function of them, ``jax.jvp``; :meth:`em_step` by ``jax.grad``) on every route: where a
        layer runs a kernel, by XLA's route's derivative at the same point (:func:`jaxpc.engine.em.flows_and_ll`).
        """
        replay = None
        if ll_weights is None and evidence is None and not return_evidence_grad:
            replay = ("flows", options, validate)
            rt = self.runtime
            if rt.clusters:
                out = rt.replay(replay, x, missing, params=params, tree_weights=rt.tree_weights_later(
                    self.layout, params, x, replay[:2], lambda: Options.make(options), True))
            else:
                out = rt.replay(replay, x, missing, params=params)
            if out is not None:
                return out if return_ll else out[0]
        opts = Options.make(options)
        batch = self.runtime.prepare(x, missing, validate)
        ev, record = self.prepare_evidence(evidence, batch, "circuit.flows")
        nonnegative = LOG_FLOWS if opts.logspace_flows else False
        w = self.runtime.weights(ll_weights, batch.n, nonnegative=nonnegative)
        record_w = self.runtime.weights_check(ll_weights, w, batch, nonnegative, "circuit.flows")
        args = {"tables": self.tables, "params": params, "evidence": ev}
        if return_evidence_grad:
            if ev is None:
                raise ValueError("return_evidence_grad=True needs evidence= (the gradient is with respect to it)")
            fl, ll, g = self.runtime.run("flows_evidence_grad", {}, args, batch, options=opts,
                                         batched={"evidence": 0}, weights=w)
            record()
            record_w()
            return (fl, ll, g) if return_ll else (fl, g)
        if ev is None:
            args = self.runtime.with_tree_weights(args, self.layout, batch, ("flows", options), opts, True)
        fl, ll = self.runtime.run("flows", {}, args, batch, options=opts, batched={"evidence": 0}, weights=w,
                                  replay=replay, free=("params", "tree_weights"))
        record()
        record_w()
        return (fl, ll) if return_ll else fl

    def em_step(self, params: Params, x, missing=None, *, step_size: float = 1.0, pseudocount: float = 0.0,
                ll_weights=None, options: Options | None = None, validate: bool | str = True, return_ll: bool = False,
                keep_zero_params: bool = False, rescale: str = "none", evidence: dict | None = None):
        """One mini-batch EM step in a single executable:
        ``theta <- (1 - step_size) theta + step_size * normalize(flows + pseudocount)``.

        ``pseudocount`` is spread evenly over each node's children (values, for categoricals).
        Variants: ``keep_zero_params`` (zero parameters stay zero); ``rescale="tdp"`` (new parameters
        ``normalize(step_size * flows / batch + (1 - step_size) * TDP)``, TDP the model's top-down
        probabilities); ``options=Options(propagation="MPE")`` (hard / Viterbi EM from max-product
        flows: each sum node's flow goes to its first maximizing child, the one :meth:`mpe` decodes, and a
        missing variable counts as the value :meth:`mpe` decodes for it observed);
        ``Options(pflow_temperature=T)`` (tempered EM). ``Options(logspace_flows=True)`` is refused: EM takes
        linear flows.

        ``params``, ``x`` ``[B, V]``, ``missing``, ``options`` and ``validate`` as for :meth:`log_prob`.
        ``step_size`` must be a finite float in (0, 1] and ``pseudocount`` a finite float >= 0 (else a
        ``ValueError``; a non-number a ``TypeError``). ``ll_weights`` ``[B]`` (default None: all 1) weights each
        sample's expected counts; they must be finite and >= 0 (a negative weight makes negative counts), checked as
        ``x``'s values are (numpy at once, device arrays by the next call), and a wrong shape is a ``ValueError``.
        ``evidence``: per-call evidence as for :meth:`log_prob` (:meth:`check_evidence`); not with
        ``rescale="tdp"`` (a ``ValueError``), whose top-down probabilities are the model's own; ``rescale`` other
        than ``"none"`` / ``"tdp"`` is a ``ValueError``.
        Returns the new params (and the batch's log-likelihoods under the old ones with ``return_ll``).
        With device-resident inputs a step makes no host transfer but its input check's one-byte flag (none with
        ``validate=False``); rows with bad values take no part in the update.
        """
        keep_zero_params = checks.check_bool("em_step", "keep_zero_params", keep_zero_params)
        rt = self.runtime
        step, pseudo = rt.em_scalars(step_size, pseudocount)
        replay = None
        if ll_weights is None and evidence is None:  # (a step size schedule replays too)
            replay = ("em_step", options, validate, keep_zero_params, rescale)
            out = rt.replay(replay, x, missing, params=params, step_size=step, pseudocount=pseudo)
            if out is not None:
                return out if return_ll else out[0]
        if rescale not in ("none", "tdp"):
            raise ValueError(f"rescale must be 'none' or 'tdp', got {rescale!r}")
        opts = Options.make(options)
        em.check_em_options(opts, "em_step")
        batch = self.runtime.prepare(x, missing, validate)
        ev, record = self.prepare_evidence(evidence, batch, "circuit.em_step")
        if ev is not None and rescale == "tdp":
            raise ValueError("rescale='tdp' uses the model's own top-down probabilities: it takes no evidence")
        w = self.runtime.weights(ll_weights, batch.n, nonnegative=True)
        record_w = self.runtime.weights_check(ll_weights, w, batch, True, "circuit.em_step")
        new, ll = rt.run("em_step", {"keep_zero_params": keep_zero_params, "rescale": rescale},
                         {"tables": self.tables, "params": params, "step_size": step, "pseudocount": pseudo,
                          "evidence": ev}, batch,
                         options=opts, batched={"evidence": 0}, weights=w, replay=replay,
                         free=("params", "step_size", "pseudocount"))
        record()
        record_w()
        return (new, ll) if return_ll else new

    def em_update(self, params: Params, flows: dict, *, step_size: float = 1.0, pseudocount: float = 0.0,
                  update_sums: bool = True, keep_zero_params: bool = False, validate: bool | str = True) -> Params:
        """The EM M-step from accumulated flows (e.g. summed over batches):
        ``theta <- (1 - step_size) theta + step_size * normalize(flows + pseudocount)``.

        Args:
            params: a params pytree of this circuit (the parameters the flows were taken under).
            flows: expected counts, a pytree like :meth:`flows` returns with linear flows (e.g. summed over
                batches). Log flows (``Options(logspace_flows=True)``, a :class:`~jaxpc.engine.logflows.LogFlows`)
                raise a ``ValueError``: convert them with :func:`jaxpc.engine.logflows.to_counts`.
            step_size: the blend of old and new parameters, a finite float in (0, 1] (default 1: plain EM).
            pseudocount: added to the counts, spread evenly over each node's children (values, for categoricals);
                a finite float >= 0 (default 0). Out of range: ``ValueError``; not a number: ``TypeError``.
            update_sums: ``True`` (default) updates sum and input parameters; ``False`` keeps every sum parameter
                and refits only the input distributions.
            keep_zero_params: parameters that are exactly zero stay zero (they get no pseudocount); default
                ``False``.
            validate: ``True`` (default), ``"sync"`` or ``False``. The counts among the flows (sum edges, the
                input layers' counts) must be >= 0: negated flows (``jax.grad`` of a negative log-likelihood,
                ``Options(negate_flows=True)``) are refused with a ``ValueError`` naming the first negative entry.
                Numpy flows are checked at once; device arrays by one reduction on the device whose flag the
                circuit's next call reads (``"sync"``: this one), as a device batch's (see :mod:`jaxpc.runtime`);
                tracers and ``False``: not checked. NaN flows are not refused: they give NaN parameters. Log flows
                rebuilt into a plain dict (``dict(flows)``, a dict comprehension) are no ``LogFlows``: the check
                refuses their negative entries, naming ``to_counts``; unchecked they are read as counts, giving wrong
                parameters.

        Sum nodes whose flows (plus pseudocount) are all zero keep their parameters.
        """
        check_em_args(step_size, pseudocount)
        update_sums = checks.check_bool("em_update", "update_sums", update_sums)
        keep_zero_params = checks.check_bool("em_update", "keep_zero_params", keep_zero_params)
        if validate not in VALIDATE:
            raise ValueError(f"validate must be True, False or 'sync', got {validate!r}")
        em.check_linear_flows(flows, "circuit.em_update")
        rt = self.runtime
        record = self._counts_check(flows, validate) if validate else None
        out = rt.run("em_update", {"update_sums": update_sums, "keep_zero_params": keep_zero_params},
                     {"tables": self.tables, "params": params, "flows": flows,
                      "step_size": rt.scalar(step_size), "pseudocount": rt.scalar(pseudocount)})
        if record is not None:
            record()
        return out

    def _counts_check(self, flows, validate: bool | str):
        """The value check of ``flows``' counts (:func:`jaxpc.engine.em.count_leaves`) for :meth:`em_update`: numpy
        arrays raise here; returns a function of no arguments that records the check of the concrete device arrays
        (:meth:`Runtime.record_check`, to call right after the update is dispatched), or None where there are none
        (tracers are not checked). The flows' structure is checked first (:meth:`Runtime.check_flows`)."""
        self.runtime.check_flows(flows)
        names, arrays = em.count_leaves(flows)
        host = [(n, a) for n, a in zip(names, arrays) if not isinstance(a, (jax.Array, jax.core.Tracer))]
        if host:
            em.raise_negative_counts(*zip(*host), "circuit.em_update")
        device = [(n, a) for n, a in zip(names, arrays) if checks.is_device_array(a)]
        if not device:
            return None
        dn, da = zip(*device)
        explain = functools.partial(_explain_negative_counts, dn, da)
        return functools.partial(self.runtime.record_check, "counts_flag", em.any_negative_counts,
                                 {"counts": da}, explain, validate == "sync")

    def full_batch_em(self, params: Params, data, missing=None, *, batch_size: int = 512, step_size: float = 1.0,
                      pseudocount: float = 0.0, validate: bool | str = True, return_ll: bool = False):
        """One full-batch EM step over ``data`` ``[N, V]``: flows are summed over all batches, then one
        update. The last partial batch is padded with zero-weight rows (its bucket's executable).
        With ``return_ll`` also returns the mean log-likelihood of ``data`` under ``params``.

        Args:
            params: a params pytree of this circuit.
            data: ``[N, V]`` samples, as ``x`` of :meth:`log_prob`.
            missing: ``bool[N, V]`` or ``bool[V]`` (default None: nothing missing); True marks a variable to
                marginalize.
            batch_size: samples per :meth:`flows` call (default 512; at most ``N`` are used); a positive int, else
                a ``ValueError``.
            step_size: as for :meth:`em_update`: a finite float in (0, 1] (default 1).
            pseudocount: as for :meth:`em_update`: a finite float >= 0 (default 0).
            validate: ``True`` (default), ``"sync"`` or ``False``, as for :meth:`log_prob`; host (numpy)
                ``data`` is checked once, before the first batch, device data by each batch's call.
            return_ll: also return the mean log-likelihood (see above).
        """
        check_em_args(step_size, pseudocount)
        if not isinstance(batch_size, numbers.Integral) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"full_batch_em: batch_size must be a positive int, got {batch_size!r}")
        batch = self.runtime.prepare(data, missing, validate)
        data_j, miss_j, n = batch.x, batch.missing, batch.n
        validate = validate if batch.report else False  # host data: checked already
        bs = int(min(batch_size, n))
        total, ll_sum = None, 0.0
        for start in range(0, n, bs):
            xb = data_j[start:start + bs]
            mb = miss_j if miss_j is None or miss_j.ndim == 1 else miss_j[start:start + bs]
            fl, ll = self.flows(params, xb, mb, validate=validate, return_ll=True)
            total = fl if total is None else _tree_add(total, fl)
            ll_sum = ll_sum + jnp.sum(ll)
        # (the circuit's own linear flows: counts, nothing to check)
        new = self.em_update(params, total, step_size=step_size, pseudocount=pseudocount, validate=False)
        return (new, ll_sum / n) if return_ll else new

    # ------------------------------------------------------------------------------------------
    # queries (see jaxpc.queries)
    # ------------------------------------------------------------------------------------------
    def marginal(self, params: Params, x=None, missing=None, **kw) -> Array:
        """:func:`jaxpc.queries.marginal` of this circuit: ``params``, ``x``, ``missing`` and the keywords
        (``soft_evidence``, ``propagation``, ``alpha``, ``options``, ``validate``) as there."""
        from . import queries
        return queries.marginal(self, params, x, missing, **kw)

    def conditional(self, params: Params, x, missing=None, **kw) -> Array:
        """:func:`jaxpc.queries.conditional` of this circuit: ``params``, ``x``, ``missing`` and the keywords
        (``target_vars``, ``options``, ``validate``) as there."""
        from . import queries
        return queries.conditional(self, params, x, missing, **kw)

    def sample(self, params: Params, key: Array, num_samples: int | None = None, **kw) -> Array:
        """:func:`jaxpc.queries.sample` of this circuit: ``params``, ``key``, ``num_samples`` and the keywords
        (``x``, ``missing``, ``options``, ``validate``) as there."""
        from . import queries
        return queries.sample(self, params, key, num_samples, **kw)

    def mpe(self, params: Params, x=None, missing=None, **kw):
        """:func:`jaxpc.queries.mpe` of this circuit: ``params``, ``x``, ``missing`` and the keywords
        (``num_samples``, ``options``, ``validate``) as there."""
        from . import queries
        return queries.mpe(self, params, x, missing, **kw)

    # ------------------------------------------------------------------------------------------
    # introspection
    # ------------------------------------------------------------------------------------------
    @property
    def structure(self) -> _compile.CompiledStructure:
        """What :func:`jaxpc.compile` built on the host: the node vectors, their placement in the layout's
        parameter groups and rows, the host index tables."""
        return self._struct

    @property
    def nodes(self) -> list[CircuitNodes]:
        """All node vectors, children before parents."""
        return list(self._struct.nodes)

    @property
    def num_nodes(self) -> int:
        return sum(ns.num_nodes for ns in self._struct.nodes)

    @property
    def num_edges(self) -> int:
        """Sum edges plus product edges."""
        n = 0
        for ns in self._struct.nodes:
            if ns.is_sum():
                n += ns.num_edges
            elif ns.is_prod():
                n += ns.num_nodes * len(ns.children)
        return n

    @property
    def num_parameters(self) -> int:
        return sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(self.params))

    def summary(self) -> str:
        """A per-layer table: stages, partitions, nodes, edges, parameters, fan-in, block sizes."""
        from . import visualize
        return visualize.summary(self)

    def __str__(self) -> str:
        return self.summary()

    def __reduce_ex__(self, protocol):
        raise TypeError("jaxpc.Circuit cannot be pickled or deep-copied (it holds compiled executables and device "
                        "tables): save its structure with jaxpc.io.save_structure(circuit, path) and its parameters "
                        "with jaxpc.io.save_params, then jaxpc.compile(jaxpc.io.load_structure(path))")

    def __copy__(self) -> Circuit:
        """A shallow copy, sharing this circuit's executables and tables."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __repr__(self) -> str:
        scans = sum(1 for s in self.layout.steps if isinstance(s, ScanSpec))
        return (f"Circuit(num_vars={self.num_vars}, num_nodes={self.num_nodes}, num_edges={self.num_edges}, "
                f"num_parameters={self.num_parameters}, input_layers={len(self.layout.input_layers)}, "
                f"steps={len(self.layout.steps)} ({scans} scanned))")


class PartialEvaluation:
    """A partial evaluation plan of a circuit (see :meth:`Circuit.partial`)."""

    def __init__(self, circuit: Circuit, plan, tables: dict, variables: tuple[int, ...]):
        self.circuit, self.plan, self.tables, self.variables = circuit, plan, tables, variables

    def log_prob(self, params: Params, x, values: Array, missing=None, *, options: Options | None = None,
                 validate: bool | str = True) -> tuple[Array, Array]:
        """``(ll [B], values [R, B])``: re-evaluate the plan's nodes on ``x`` on top of ``values``."""
        c = self.circuit
        batch = c.runtime.prepare(x, missing, validate)
        if not hasattr(values, "shape") or not hasattr(values, "dtype"):
            raise TypeError(f"values must be the node buffer that circuit.node_values returns, got "
                            f"{type(values).__name__}")
        if values.dtype != c.dtype:
            raise TypeError(f"values must be the node buffer of dtype {c.dtype} (circuit.node_values), got dtype "
                            f"{values.dtype}")
        if values.shape != (c.layout.num_rows, batch.n):
            raise ValueError(f"values must be the node buffer [{c.layout.num_rows}, {batch.n}] (circuit.node_values), "
                             f"got {tuple(values.shape)}")
        return c.runtime.run("partial", {"plan": self.plan},
                             {"tables": c.tables, "params": params, "values": values, "plan_tables": self.tables},
                             batch, options=Options.make(options), batched={"values": 1})

    def __repr__(self):
        return f"PartialEvaluation(variables={list(self.variables)[:8]}{'...' if len(self.variables) > 8 else ''})"


# ---- entry points (pure; the layout is bound per circuit) --------------------------------------

def _e_log_prob(layout, tables, params, x, missing, evidence, tree_weights=None, *, options):
    return forward.log_prob(layout, stages.with_kept_weights(tables, tree_weights), params, x, missing, options,
                            evidence=evidence)


def _e_node_values(layout, tables, params, x, missing, *, options):
    return forward.node_values(layout, tables, params, x, missing, options)


def _e_partial(layout, tables, params, x, missing, values, plan_tables, *, options, plan):
    buf = partial.partial_values(layout, plan, plan_tables, params, x, missing, values, options)
    return buf[layout.root_row], buf


def _e_flows(layout, tables, params, x, missing, weights, evidence, tree_weights=None, *, options):
    return em.flows_and_ll(layout, stages.with_kept_weights(tables, tree_weights), params, x, missing, weights, options,
                           evidence)


def _e_flows_evidence_grad(layout, tables, params, x, missing, weights, evidence, *, options):
    return em.flows_and_ll(layout, tables, params, x, missing, weights, options, evidence, evidence_grad=True)


def _e_em_step(layout, tables, params, x, missing, weights, step_size, pseudocount, evidence, *, options,
               keep_zero_params, rescale):
    return em.em_step(layout, tables, params, x, missing, weights, step_size, pseudocount, options,
                      keep_zero_params, rescale, evidence)


def _e_em_update(layout, tables, params, flows, step_size, pseudocount, *, update_sums, keep_zero_params):
    return em.em_update(layout, tables, params, flows, step_size, pseudocount, update_sums, keep_zero_params)


# name -> (pure function of the layout and keyword arguments, batch axis of each output: see runtime.Entry)
_ENTRIES = {"log_prob": (_e_log_prob, 0), "node_values": (_e_node_values, 1), "partial": (_e_partial, (0, 1)),
            "flows": (_e_flows, (None, 0)), "flows_evidence_grad": (_e_flows_evidence_grad, (None, 0, 0)),
            "em_step": (_e_em_step, (None, 0)), "em_update": (_e_em_update, None)}
declare_entries("init", *_ENTRIES)


def _node_arg(node, who: str) -> CircuitNodes:
    """``node``, where it is a node vector; else a ``TypeError`` naming what was given."""
    if not isinstance(node, CircuitNodes):
        hint = " (pass one of its nodes, e.g. circuit.root)" if isinstance(node, Circuit) else ""
        raise TypeError(f"{who}: node must be a node vector (jaxpc.CircuitNodes), got {type(node).__name__}{hint}")
    return node


def _explain_negative_counts(names: tuple, counts: tuple) -> None:
    """The error of device flows whose counts the device check found negative."""
    with jax.transfer_guard_device_to_host("allow"):  # (an error's message, not the call's data path)
        host = tuple(np.asarray(a) for a in counts)
    em.raise_negative_counts(names, host, "circuit.em_update",
                             " (checked on the device: that call's parameters are not valid)")
    raise ValueError("circuit.em_update: the device check found negative flows; the host check found none")


def _tree_add(a, b):
    return jax.tree_util.tree_map(jnp.add, a, b)


def _evidence_array(name: str, a, batch: int, ndim: int, last=None, values: str | None = None,
                    device: list | None = None):
    """``evidence[name]`` as an array of ``ndim`` axes, the batch first and the rest ``last`` when given. A host
    (numpy) array's ``values`` are checked before anything runs: ``"log"`` log-values (not NaN, not +inf; -inf is
    a zero), ``"nonnegative"`` finite and >= 0 (:func:`jaxpc.checks.raise_bad_evidence`); a concrete device array
    of floats with ``values`` is appended to ``device`` as ``(name, values, (a,))``, checked on the device by the
    call (:meth:`Circuit.prepare_evidence`: its values on the host would cost a round trip); tracers pass."""
    host = None if isinstance(a, (jax.Array, jax.core.Tracer)) else np.asarray(a)
    dtype = a.dtype if host is None else host.dtype
    if not any(jnp.issubdtype(dtype, kind) for kind in (jnp.floating, jnp.integer, jnp.bool_)):
        raise TypeError(f"evidence['{name}'] must hold real numbers, got dtype {dtype}")
    a = a if host is None else jnp.asarray(host)
    if a.ndim != ndim or a.shape[0] != batch:
        raise ValueError(f"evidence['{name}'] must have {ndim} axes with the batch ({batch}) first, got "
                         f"shape {tuple(a.shape)}")
    if last is not None and tuple(a.shape[1:]) != tuple(last):
        raise ValueError(f"evidence['{name}'] must have shape {[batch, *last]}, got {tuple(a.shape)}")
    if values is not None:
        if host is not None:
            checks.raise_bad_evidence(name, host, values)
        elif device is not None and checks.is_device_array(a) and jnp.issubdtype(a.dtype, jnp.floating):
            device.append((name, values, (a,)))
    return a


def _check_topk_evidence(val, batch: int, num_cats: int | None, device: list | None = None,
                         num_vars: int | None = None) -> dict:
    """``evidence["categorical_topk"]``: integer ``ids [B, V, k]`` (as int32, ``k >= 1``; ``V`` is ``num_vars``
    where given), ``logp`` and an optional boolean ``mask`` of the same shape, no other key. Ids must lie in
    ``[0, num_cats)`` (the soft leaves' values) and be distinct among a row's unmasked entries: checked here for
    host ids (:func:`jaxpc.checks.raise_bad_topk_ids`); concrete device ids are appended to ``device`` (as
    ``_evidence_array`` does) with their mask, as given."""
    if not isinstance(val, dict) or not {"ids", "logp"} <= set(val) or set(val) - {"ids", "logp", "mask"}:
        got = list(val) if isinstance(val, dict) else type(val).__name__
        raise ValueError("evidence['categorical_topk'] must be {'ids': int[B, V, k], 'logp': [B, V, k], "
                         f"'mask': bool[B, V, k] (optional)}}, got {got}")
    ids = _evidence_array("categorical_topk.ids", val["ids"], batch, 3)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"evidence['categorical_topk']['ids'] must be integers, got {ids.dtype}")
    if (num_vars is not None and ids.shape[1] != num_vars) or ids.shape[2] == 0:
        raise ValueError(f"evidence['categorical_topk']['ids'] must have shape [{batch}, "
                         f"{'V' if num_vars is None else num_vars}, k] with k >= 1 candidates per position, got "
                         f"{tuple(ids.shape)}")
    topk = {"ids": ids.astype(jnp.int32),
            "logp": _evidence_array("categorical_topk.logp", val["logp"], batch, 3, ids.shape[1:], values="log",
                                    device=device)}
    if val.get("mask") is not None:
        mask = _evidence_array("categorical_topk.mask", val["mask"], batch, 3, ids.shape[1:])
        if jnp.issubdtype(mask.dtype, jnp.floating):
            raise TypeError(f"evidence['categorical_topk']['mask'] must be booleans, got {mask.dtype}")
        topk["mask"] = mask.astype(bool)
    if not isinstance(val["ids"], (jax.Array, jax.core.Tracer)):
        checks.raise_bad_topk_ids(np.asarray(val["ids"], np.int64), val.get("mask"), num_cats)
    elif (device is not None and checks.is_device_array(val["ids"])
          and not isinstance(topk.get("mask"), jax.core.Tracer)):
        device.append(("categorical_topk.ids", "ids", (val["ids"], topk.get("mask"))))  # (ids in their own type)
    return topk


def _check_sum_evidence(key: str, val, batch: int, groups: dict, num_gates: int, device: list | None = None):
    """``evidence["sum_gates"]`` (gate columns ``[B, num_gates]``, or ``[B, P]`` per sum group) or
    ``evidence["sum_lowrank"]`` (``u [B, P, Kp, r]`` and ``v [B, P, r, Kc]`` per sum group), by group key;
    ``groups``: the circuit's sum groups by key; ``device``: as for :func:`_evidence_array`."""
    if key == "sum_gates" and not isinstance(val, dict):
        if not num_gates:
            raise ValueError("evidence['sum_gates'] is an array of gate columns, but no sum vector of this circuit "
                             "has gates: declare them with ns.set_gates() before jaxpc.compile, or give "
                             f"{{group: [B, P]}} (one gate per parameter block; groups {sorted(groups)})")
        return _evidence_array(key, val, batch, 2, (num_gates,), values="log", device=device)
    if not isinstance(val, dict):
        raise TypeError(f"evidence['{key}'] must map sum groups {sorted(groups)} to arrays")
    sub = {}
    for gk, gv in val.items():
        if gk not in groups:
            raise ValueError(f"evidence['{key}'] names sum group {gk!r}; this circuit's groups are "
                             f"{sorted(groups)}")
        g = groups[gk]
        if key == "sum_gates":
            sub[gk] = _evidence_array(f"{key}.{gk}", gv, batch, 2, (g.num_blocks,), values="log", device=device)
            continue
        if not isinstance(gv, dict) or set(gv) != {"u", "v"}:
            raise ValueError(f"evidence['{key}']['{gk}'] must be {{'u': [B, P, Kp, r], 'v': [B, P, r, Kc]}}, got "
                             f"{sorted(gv) if isinstance(gv, dict) else type(gv).__name__}")
        u = _evidence_array(f"{key}.{gk}.u", gv["u"], batch, 4, values="nonnegative", device=device)
        r = u.shape[3]
        sub[gk] = {"u": _evidence_array(f"{key}.{gk}.u", u, batch, 4, (g.num_blocks, g.Kp, r)),
                   "v": _evidence_array(f"{key}.{gk}.v", gv["v"], batch, 4, (g.num_blocks, r, g.Kc),
                                        values="nonnegative", device=device)}
    return sub
