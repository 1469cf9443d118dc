"""Routes: which kernel or pass each part of an evaluation runs on.

Predicates of the options, the layout and the shapes, computing nothing on the device: the implementation
and kernel configuration of a sum partition (:func:`kernel_choice`), its pieces, whether it runs as an in-place
Pallas kernel or on the Pallas backward, which blocks keep their shifts for the flow pass (:func:`shift_unit`),
which plan the flow pass runs, and whether the leaves, their expected counts and the batched parameter flows
come from one kernel. The forward (:mod:`~jaxpc.engine.stages`), the flow pass (:mod:`~jaxpc.engine.flows`)
and partial evaluation read their routes here, so that each decision is taken by one function.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Final

import jax
import jax.numpy as jnp
import numpy as np

from ..compiler.layout import Layout, ScanSpec
from ..ops import tables as table_places
from ..ops.pieces import ranges
from ..ops.sum_layer import factored
from ..ops.triton_base import route_impl, triton_route
from ..options import KERNEL_IMPLS, PALLAS_FORWARD, Tuning
from . import chain

Array = jax.Array


def on_gpu() -> bool:
    """Whether traced code runs on a GPU, where the Pallas kernels compile to Triton."""
    return jax.default_backend() == "gpu"


@functools.cache
def _compute_capability() -> str:
    """The default device's compute capability ("9.0" on a Hopper GPU; "" on devices without one, such as CPUs).
    Read from the device alone, so that a patched :func:`on_gpu` does not decide what the process caches."""
    return str(getattr(jax.devices()[0], "compute_capability", "") or "")


def on_hopper() -> bool:
    """Whether traced code runs on a Hopper GPU (compute capability 9.x): thread-block clusters of 16 blocks and
    wgmma, which :mod:`jaxpc.ops.mosaic_tree`'s kernels need."""
    return _compute_capability().startswith("9.")


def tree_clusters(options, impl: str | None = None) -> bool:
    """Whether ``Tuning.tree_clusters`` asks for the tree's levels on clusters: its value, or where None (the
    default) whether ``impl`` (:func:`route_impl`) is ``"auto"`` on a Hopper GPU."""
    asked = options.tuning.tree_clusters
    if asked is None:
        return (impl or route_impl(options)) == "auto" and on_hopper()
    return asked


_WARNED_UNAVAILABLE = []
_WARNED_CLUSTERS = []  # the cluster route's missing-backend warning, once per process


def kernels_available() -> bool:
    """Whether the Pallas sum-layer kernels can run (Pallas and its Triton backend import); warns once if not."""
    try:
        from ..ops import pallas_sum

        ok = pallas_sum.available()
    except ImportError:
        ok = False
    if not ok and not _WARNED_UNAVAILABLE:
        _WARNED_UNAVAILABLE.append(True)
        warnings.warn("jaxpc: the Pallas Triton backend (jax.experimental.pallas.triton) is not available in this "
                      "jax; sum layers run on XLA (impl='reference')", RuntimeWarning, stacklevel=2)
    return ok


def param_dtype(params) -> jnp.dtype:
    """The floating dtype of a parameter pytree: the node buffer's."""
    leaves = jax.tree_util.tree_leaves(params)
    floats = [a.dtype for a in leaves if jnp.issubdtype(a.dtype, jnp.floating)]
    return jnp.result_type(*floats) if floats else jnp.float32


def has_sum_externals(evidence: dict | None) -> bool:
    """Whether ``evidence`` carries per-sample sum parameters (``sum_gates`` / ``sum_lowrank``)."""
    if not evidence:
        return False
    gates = evidence.get("sum_gates")  # gate columns [B, G], or {group: [B, P]}
    return (gates is not None and (not isinstance(gates, dict) or bool(gates))) or bool(evidence.get("sum_lowrank"))


# ---- the flow pass's plan and the leaf kernels ----------------------------------------------------

def runs_node_buffer(layout: Layout, options, evidence: dict | None = None) -> bool:
    """Whether :func:`jaxpc.engine.forward.evaluate` runs the flow pass over the node buffer
    (:func:`jaxpc.engine.flows.root_values`): ``backward="flows"``, no per-sample sum parameters in ``evidence``,
    and not as a chain."""
    externals = has_sum_externals(evidence)
    return options.backward == "flows" and not externals and not chain.applies(layout, options, externals)


def buffer_plan(layout: Layout, options, batch: int) -> Layout:
    """The plan whose node buffer the flow pass runs at ``batch`` samples: the folded one (``Options.fold_products``)
    unless the full layout pays (:func:`full_layout_pays`), else the layout."""
    if layout.fold is None or not options.fold_products or full_layout_pays(layout, options, batch):
        return layout
    return layout.fold


def full_layout_pays(layout: Layout, options, batch: int) -> bool:
    """Whether the flow pass runs the full layout although ``options.fold_products`` asks for the folded plan: its
    products have at least ``Options.tuning.full_layout_reads`` reading edge blocks per block
    (:attr:`Layout.product_reads`), which the folded plan would read two child rows each for, where the full layout
    writes each product once and reads one row (PD-512 / PD-768 on the H200: 9.5 / 14.2 readers, `em_step` 3.5% /
    4.7% faster; PD-256: 4.7, 20% slower with XLA's products); its products run as kernels (:func:`product_routes`),
    its buffer stays within the kernels' int32 offsets at ``batch``, and its node and flow buffers (products
    stored: PD-512's 3.8M rows, its folded plan's under 1.1M) within a quarter of the device's memory."""
    reads = options.tuning.full_layout_reads
    return (layout.fold is not None and 0 < reads <= layout.product_reads
            and 0 < options.tuning.product_kernel_batch <= batch and product_routes(options)
            and layout.num_rows * batch < INT32_ELEMENTS
            and (not device_memory() or 8 * layout.num_rows * batch <= device_memory() // 4))


@functools.cache
def device_memory() -> int:
    """Bytes that JAX may allocate on the first device, 0 where it does not say (the CPU)."""
    try:
        return int((jax.devices()[0].memory_stats() or {}).get("bytes_limit", 0))
    except Exception:  # noqa: BLE001 - no memory statistics: no bound from them
        return 0


INT32_ELEMENTS: Final = 2**31  # the Pallas kernels address the node buffer with int32 offsets


def buffer_rows(layout: Layout, options, batch: int, evidence: dict | None = None) -> int:
    """Rows of the node buffer that a call with ``options`` runs on: the flow pass's plan (:func:`buffer_plan`, the
    folded one by default) where :func:`runs_node_buffer`, else the layout's (the plain forward, autodiff, per-sample
    sum parameters, log-space flows, chains)."""
    if runs_node_buffer(layout, options, evidence) and not options.logspace_flows:
        return buffer_plan(layout, options, batch).num_rows
    return layout.num_rows


def within_int32(layout: Layout, options, batch: int, evidence: dict | None = None, rows: int | None = None):
    """``options`` for a call of ``batch`` samples: where the node buffer the call runs on (``rows`` rows, by default
    :func:`buffer_rows`) reaches :data:`INT32_ELEMENTS` elements, which the Pallas kernels' int32 offsets cannot
    address, every layer runs on XLA (64-bit indexing): ``impl="auto"`` and tuned kernels fall back, and an explicit
    Pallas ``impl`` is refused with the sizes (a 2B-edge PD's folded plan of 1.4M rows at a batch of 1,536 and
    more)."""
    rows = buffer_rows(layout, options, batch, evidence) if rows is None else rows
    if rows * batch < INT32_ELEMENTS or (options.impl == "xla" and not options.kernels and not options.leaf_kernel):
        return options
    if options.impl in KERNEL_IMPLS:
        raise ValueError(f"impl={options.impl!r}: the node buffer of {rows:,} rows x {batch:,} samples has "
                         f"{rows * batch:,} elements, more than the kernels' int32 offsets address (2^31); "
                         f"use impl='auto' or 'xla', or smaller batches")
    return xla_only(options)


def xla_only(options):
    """``options`` with every layer on XLA: no Pallas, Triton or Mosaic kernel, tuned or not."""
    return options.replace(impl="xla", kernels=(), leaf_kernel=False)


def may_run_kernels(options) -> bool:
    """Whether a layer may run a kernel under ``options``: tuned kernel choices, an explicit kernel ``impl``
    (interpret mode off a GPU), or ``impl="auto"`` on a GPU. False means every layer runs on XLA."""
    if options.kernels:
        return True
    impl = route_impl(options)
    return impl != "xla" and (impl != "auto" or on_gpu())


def holds_refs(layout: Layout, options, batch: int, dtype, evidence: dict | None = None) -> bool:
    """Whether the flow pass at ``batch`` samples runs the tree's cluster kernels (:func:`tree_kernel`'s
    ``"mosaic"``), whose buffers are JAX refs (``jax.new_ref``)."""
    plans = {id(p): p for p in (layout, buffer_plan(layout, options, batch))}.values()
    return any(tree_kernel(p, options, batch, dtype, evidence) == "mosaic" for p in plans)


def _leaf_route(options, batch: int | None, least: int) -> bool:
    """The options' part of the leaf kernels' routes (:func:`leaf_kernel`, :func:`counts_kernel`):
    ``Options(leaf_kernel=True)`` and ``impl`` ``"pallas"`` / ``"pallas_forward"`` (interpret mode off a GPU) or
    ``"auto"`` on a GPU at a ``batch`` of at least ``least`` samples (None: any), or ``"triton"`` where the jax-triton
    route runs (else as ``"auto"``)."""
    impl = route_impl(options)
    if not options.leaf_kernel or impl == "xla":
        return False
    return impl != "auto" or (on_gpu() and (batch is None or batch >= least))


def leaf_kernel(layout: Layout, params: dict, options, soft: Array | None = None,
                evidence: dict | None = None, batch: int | None = None) -> bool:
    """Whether the node buffer's first rows come from one kernel (:func:`jaxpc.engine.forward.leaf_values`) instead
    of the input layers' values and a concatenation: when :func:`jaxpc.engine.forward.evaluate` runs the flow pass's
    buffer (``backward="flows"``, not as a chain, no per-call evidence or soft evidence), every input layer is a table
    of log-values (``Distribution.value_table``: categorical leaves), laid out above the padding, the parameters
    float32, and ``Options.impl`` is ``"pallas"`` / ``"pallas_forward"`` (interpret mode off a GPU) or ``"auto"`` on a
    GPU at a ``batch`` of at least ``Options.tuning.leaf_batch``, unless ``Options(leaf_kernel=False)``. HCLT-256's
    buffer on the H200: 0.39 against XLA's 0.73 ms at batch 512, 0.18 against 0.28 at 128, but 0.16-0.23 against
    0.14 at 16, where a program's gathers from its rows of parameters are too few (docs/performance.md)."""
    if (not _leaf_route(options, batch, options.tuning.leaf_batch) or soft is not None or evidence
            or not runs_node_buffer(layout, options)
            or param_dtype(params) != jnp.float32):
        return False
    row = 2 * layout.kmax
    for spec in sorted(layout.input_layers, key=lambda s: s.offset):
        if spec.offset < row or spec.dist.value_table(params["input"][spec.key]) is None:
            return False
        row = spec.offset + spec.num_nodes
    return leaf_triton(options) or kernels_available()


def leaf_triton(options) -> bool:
    """Whether the leaf kernel of :func:`leaf_kernel` is the jax-triton one (:mod:`jaxpc.ops.triton_leaf`): with
    ``impl="triton"`` where that route runs."""
    return options.impl == "triton" and triton_route(options)


def counts_kernel(spec, options, flows: Array) -> bool:
    """Whether the expected counts of input layer ``spec`` (categorical leaves in runs over one variable,
    ``InputLayerSpec.run``) come from one Pallas kernel (:func:`jaxpc.ops.pallas_leaf.categorical_counts`, the
    one-hot matrices in registers) instead of XLA's products with one-hot matrices in memory: float32 node flows
    ``[N, B]``, and the routes of :func:`leaf_kernel` (:func:`_leaf_route`), from ``Options.tuning.counts_batch``
    samples on (``"auto"`` on a GPU)."""
    from ..distributions.categorical import Categorical

    if (not _leaf_route(options, flows.shape[1], options.tuning.counts_batch) or leaf_triton(options) or spec.run < 2
            or flows.dtype != jnp.float32
            or type(spec.dist).suff_stats_runs is not Categorical.suff_stats_runs):
        return False
    return kernels_available()


# ---- a tree's levels as persistent kernels -------------------------------------------------------------

CLUSTER_TILE = 32  # parent rows of a task of the tree's kernels on clusters (the backward's shared memory bounds it)
CLUSTER_WIDE_TILE = 64  # parent rows of a forward task under Tuning.tree_forward_tile=64
CLUSTER_WIDE_BATCH = 16  # the largest batch whose tasks are CLUSTER_WIDE_TILE rows by default (the tiles' None)


def tree_kernel(layout: Layout, options, B: int, dtype, evidence: dict | None = None) -> str | None:
    """Which persistent kernels run ``layout.tree``'s levels (a folded plan's run of tree levels, an HCLT's), one
    launch each way, instead of level by level: ``"triton"`` (:mod:`jaxpc.ops.triton_tree`) where the jax-triton
    route runs (:func:`jaxpc.ops.triton_base.status`) and the levels fit its tiles
    (:func:`jaxpc.ops.triton_tree.fits`), else ``"pallas"`` (:mod:`jaxpc.ops.pallas_tree`), or None (level by level).
    They need a float32 buffer of at most ``Options.tuning.tree_kernel_batch`` samples (and the kernels'
    ``MAX_BATCH``), sum-product propagation with untempered flows, no per-sample sum parameters, no tuned kernel
    choices (``Options.kernels``), and ``impl`` ``"auto"`` on a GPU, ``"triton"``, or ``"pallas"`` /
    ``"pallas_forward"`` (interpret mode off a GPU: the Pallas kernels); ``"triton"`` where the jax-triton route
    does not run counts as ``"auto"``. Before these, ``"mosaic"`` (:mod:`jaxpc.ops.mosaic_tree`, the levels on
    thread-block clusters) where :func:`tree_clusters` asks for it (by default on Hopper GPUs), this JAX can build
    its kernels (:func:`jaxpc.ops.mosaic_tree.status`; where not, it warns once and the levels run as below) and they
    apply:
    square blocks, a batch that is a multiple of 8 up to 64, ``precision`` below ``"fp32"``, the tree's parameter
    flows on the batched pass and a single-reader layout. The forward and the flow pass ask it alike: the one
    decides for both."""
    if (layout.tree is None or jnp.dtype(dtype) != jnp.float32 or options.propagation != "LL"
            or options.pflow_temperature != 1.0 or options.eflow_temperature != 1.0 or options.kernels
            or has_sum_externals(evidence)
            or not (options.tuning.tree_clusters is not False or 0 < B <= options.tuning.tree_kernel_batch)):
        return None
    from ..ops import mosaic_tree, pallas_tree, triton_base

    impl = route_impl(options)
    gpu = on_gpu()
    clusters = tree_clusters(options, impl)
    batched = not options.compute_param_flows or (options.param_flow_pass == "batched" or (
        options.param_flow_pass == "auto" and B <= options.tuning.pflow_batch))  # the tree's parameter flows
    if (clusters and options.concrete_precision != "fp32" and batched
            and (impl in PALLAS_FORWARD or (impl == "auto" and gpu))
            and mosaic_tree.fits(layout.tree, B, CLUSTER_TILE) and layout.tree.Kp == layout.tree.Kc
            and layout.single_reader):
        ok, reason = mosaic_tree.status()
        if ok:
            return "mosaic"
        if not _WARNED_CLUSTERS:
            _WARNED_CLUSTERS.append(True)
            warnings.warn(f"jaxpc: the tree's levels cannot run on thread-block clusters with this JAX ({reason}); "
                          "they run level by level (Tuning.tree_clusters=False silences this)", RuntimeWarning,
                          stacklevel=2)
    if not 0 < B <= options.tuning.tree_kernel_batch:
        return None
    if not (impl in PALLAS_FORWARD or impl == "triton" or (impl == "auto" and gpu)):
        return None
    if (impl == "triton" or (impl == "auto" and gpu)) and triton_base.available():
        from ..ops import triton_tree  # imports triton: only where the jax-triton route runs

        if triton_tree.fits(layout.tree, B):
            return "triton"
    return "pallas" if pallas_tree.fits(B) and kernels_available() else None


def tree_weight_copies(layout: Layout, options, B: int, dtype, flows: bool) -> tuple[str, tuple[str, ...]] | None:
    """Where a call of ``B`` samples without evidence (``options`` resolved) runs the folded plan's tree levels on
    clusters (:func:`tree_kernel`): the tree's parameter group and the copies of its weights that the kernels read,
    ``"w"`` (the forward's, unless ``Tuning.tree_log_weights``) and, for the flows (``flows``), ``"wt"`` (the
    backward's, transposed); else None. The call path makes them once per parameter array
    (:meth:`jaxpc.runtime.Runtime.kept`) and hands them to the executable (``tables["fold"]["tree"]["weights"]``,
    :func:`jaxpc.engine.stages.kept_weights`), where a call would otherwise make them anew."""
    options = within_int32(layout, options, B)
    if layout.fold is None or not runs_node_buffer(layout, options) or (flows and options.logspace_flows):
        return None
    plan = buffer_plan(layout, options, B)
    if plan is not layout.fold or tree_kernel(plan, options, B, dtype) != "mosaic":
        return None
    parts = (() if options.tuning.tree_log_weights else ("w",)) + (("wt",) if flows else ())
    return (plan.tree.group, parts) if parts else None


def cluster_tables(layout: Layout, tables: dict) -> dict:
    """``tables`` (finalized, numpy) with the schedules of the tree's kernels on clusters
    (:func:`jaxpc.ops.mosaic_tree.schedule`) under ``tables["fold"]["tree"]["clusters"]``, where the folded plan has
    a run of tree levels those kernels take (square blocks of ``CLUSTER_TILE``-row tiles), and the task tables of
    ``CLUSTER_WIDE_TILE``-row tiles each way (``wide_tasks``, ``wide_btasks``; :func:`cluster_forward`,
    :func:`cluster_backward`) where those fit."""
    from ..ops import mosaic_tree

    fold = layout.fold
    tree = fold.tree if fold is not None else None
    if tree is None or tree.Kp != tree.Kc or not mosaic_tree.fits(tree, 8, CLUSTER_TILE):
        return tables
    tree_tabs = tables["fold"]["tree"]
    tree_np = {k: np.asarray(v) for k, v in tree_tabs.items()}
    schedule = mosaic_tree.schedule(tree_np, tree, tile=CLUSTER_TILE)
    if mosaic_tree.fits(tree, 8, CLUSTER_WIDE_TILE):
        wide = mosaic_tree.schedule(tree_np, tree, tile=CLUSTER_WIDE_TILE)
        schedule["wide_tasks"], schedule["wide_btasks"] = wide["tasks"], wide["btasks"]
    return {**tables, "fold": {**tables["fold"], "tree": {**tree_tabs, "clusters": schedule}}}


def _wide(tile: int | None, B: int) -> bool:
    """Whether ``Tuning.tree_forward_tile`` / ``tree_backward_tile`` ``tile`` asks for ``CLUSTER_WIDE_TILE``-row
    tasks at batch ``B``: where it says so, or where it is None and ``B`` is at most :data:`CLUSTER_WIDE_BATCH`."""
    return tile == CLUSTER_WIDE_TILE or (tile is None and B <= CLUSTER_WIDE_BATCH)


def cluster_forward(options, tabs: dict, B: int) -> tuple[dict, int]:
    """The clusters' tables and tile the forward runs at batch ``B`` under ``Tuning.tree_forward_tile``: the wide
    tasks where it asks for them (:func:`_wide`) and :func:`cluster_tables` made them. The backward's tables hold for
    either: it reads the forward's copies, which no schedule changes."""
    if _wide(options.tuning.tree_forward_tile, B) and "wide_tasks" in tabs:
        return {**tabs, "tasks": tabs["wide_tasks"]}, CLUSTER_WIDE_TILE
    return tabs, CLUSTER_TILE


def cluster_backward(options, tabs: dict, spec, B: int) -> tuple[dict, int, bool]:
    """The clusters' tables, tile and kernel (``ratios``: :func:`jaxpc.ops.mosaic_tree.backward` from the ratios
    made before the call) the backward runs under ``Tuning.tree_backward_tile``: the wide tasks on the ratios'
    kernel where it asks for them (:func:`_wide`), :func:`cluster_tables` made them and a block's shared memory holds
    them (256-node blocks: batches up to 16), else the ``CLUSTER_TILE``-row tasks."""
    from ..ops import mosaic_tree

    if _wide(options.tuning.tree_backward_tile, B) and "wide_btasks" in tabs:
        steps = max(t.shape[2] for t in tabs["wide_btasks"])
        if mosaic_tree.backward_smem(spec, B, CLUSTER_WIDE_TILE, steps, True) <= mosaic_tree.SMEM:
            return {**tabs, "btasks": tabs["wide_btasks"]}, CLUSTER_WIDE_TILE, True
    return tabs, CLUSTER_TILE, False


def tree_module(kind: str):
    """The kernel module of :func:`tree_kernel`'s answer (``"triton"`` or ``"pallas"``; the engine calls
    :mod:`jaxpc.ops.mosaic_tree` for ``"mosaic"`` itself: its functions take other arguments)."""
    from ..ops import pallas_tree, triton_tree

    return triton_tree if kind == "triton" else pallas_tree


# ---- sum partitions ---------------------------------------------------------------------------------

def partition_key(part, B: int) -> tuple:
    """A sum partition's key in ``Options.kernels``: ``(n, C, Kp, Kc, U, D, B)``, with ``M`` appended for a
    folded partition (``M > 1``)."""
    sig = (part.n, part.C, part.Kp, part.Kc, part.U, part.D, B)
    return sig + (part.M,) if part.M > 1 else sig


def kernel_choice(options, part, B: int, dtype=jnp.float32):
    """``(impl, KernelConfig or None)`` for a sum partition: the tuned choice in ``options.kernels`` for this
    partition and batch, else ``options.impl`` (``"auto"``: :func:`auto_impl` for a ``dtype`` node buffer)
    with the default kernel configuration. ``"triton"`` where the jax-triton route does not run is ``"auto"``'s choice
    (:func:`triton_route`). Without the Pallas Triton backend every Pallas choice is the reference (with one warning
    per process). Where the forward's exponent is above 1 (:func:`factored_forward`) every choice is XLA's, whose
    sum layers compute it from the terms, and so it is for a node buffer other than float32 (the kernels compute in
    float32: a float64 circuit would lose its precision to a choice that should change how, never what)."""
    if not factored_forward(options) or jnp.dtype(dtype) != jnp.float32:
        return "xla", None
    impl, cfg = _kernel_choice(options, part, B, dtype)
    if impl == "triton" and not triton_route(options):
        impl = auto_impl(part, dtype, B, options.tuning.small_batch)
    if impl in PALLAS_FORWARD and not kernels_available():
        return "xla", None
    return impl, cfg


def factored_forward(options) -> bool:
    """Whether the sum-product exponent of ``options`` (GeneralLL's ``alpha``, LL's 1) is one the kernels compute
    (:func:`jaxpc.ops.sum_layer.factored`: at most 1). Above 1 their factored products underflow in float32 (the
    weights' factor ``exp(alpha log w)`` and the children's ``exp(alpha (x - m))``, ``m`` a block's largest child
    value): such a forward and its flow pass run on XLA (:func:`kernel_choice`, :func:`runs_kernel_backward`,
    :func:`pflow_kernel`), whose sum layers compute them from the terms shifted per parent and sample."""
    return options.propagation != "GeneralLL" or factored(options.alpha)


def _kernel_choice(options, part, B: int, dtype):
    if (options.propagation == "MPE" and options.impl == "auto" and options.tuning.max_product_kernels is None
            and not max_product_auto(options, part, B)):
        return "xla", None  # (XLA's reductions, whatever the sum-product layers' route)
    sig = partition_key(part, B)
    for s, choice in options.kernels:
        if s == sig:
            if choice[0] in KERNEL_IMPLS:
                from ..ops.pallas_sum import KernelConfig
                return choice[0], KernelConfig(*choice[1:])
            return "xla", None
    if options.impl == "auto":
        max_product = options.propagation == "MPE" and options.tuning.max_product_kernels is not False
        return auto_impl(part, dtype, B, options.tuning.small_batch, max_product), None
    return options.impl, None


MAX_PRODUCT_BATCH: Final = 512  # the max-plus kernels' least batch for layers of one child block (tree levels)
MAX_PRODUCT_FANIN_BATCH: Final = 128  # and for layers of several child blocks


def max_product_auto(options, part, B: int) -> bool:
    """``Tuning(max_product_kernels=None)``'s choice for a max-product sum partition under ``impl="auto"``: Pallas's
    max-plus forward (each program runs its children one by one, so small batches leave it bound by that loop's
    latency) for layers of several child blocks at batches of at least :data:`MAX_PRODUCT_FANIN_BATCH`, and for
    layers of one (tree levels) at :data:`MAX_PRODUCT_BATCH` in executables whose stages run unrolled
    (``scan_stages=False``: the flow pass's optimized compile; in place inside a scan, as in ``mpe``'s, they ran
    slower than XLA's reductions). On an H100 (``benchmarks/kernels_check.py --mpe``, kernels against XLA, ms): hard
    EM's flows of HCLT-256 at B = 16 / 128 / 512 6.73 / 6.68 / 12.64 against 2.01 / 6.45 / 21.37, of PD-128 2.09 /
    4.75 / 14.23 against 1.44 / 6.73 / 24.72; ``mpe`` of PD-128 1.59 / 3.86 / 10.11 against 1.14 / 4.10 / 15.66, of
    HCLT-256 (scanned) 8.80 / 11.94 / 14.49 against 2.01 / 4.22 / 11.81."""
    if part.C > 1:
        return B >= MAX_PRODUCT_FANIN_BATCH
    return not options.scan_stages and B >= MAX_PRODUCT_BATCH


def auto_impl(part, dtype=jnp.float32, B: int | None = None, small_batch: int = Tuning.small_batch,
              max_product: bool = False) -> str:
    """``Options(impl="auto")``'s choice for a sum partition at batch ``B``: on a GPU the Pallas forward (XLA
    backward) when its blocks have several child blocks, which XLA would gather into an ``[n, C*Kc, B]``
    tensor and read twice (PD-128 on the H200: forward 3.1 against 7.1 ms at batch 512, forward + flows 11.7
    against 12.3), and for tree levels (``C == 1``) at batches of at most ``Options.tuning.small_batch``, where one
    kernel per level replaces XLA's four (HCLT-256 at batch 16: forward + flows 3.18 against 3.29-3.57 ms
    synchronized, 2.27 against 2.67 in a pipelined loop; at batch 128 XLA's 4.53 against 4.67 ms, at 512
    8.16 against 9.31). ``max_product``: a max-product layer on the max-plus kernel (:func:`max_product_kernel`),
    which takes every such partition, at any batch. The XLA path for dense layers, buffers other than float32 and on
    backends without Triton. (Forwards differentiated by autodiff run on XLA: :func:`jaxpc.engine.forward.evaluate`.)"""
    if part.dense or jnp.dtype(dtype) != jnp.float32 or not on_gpu():
        return "xla"
    if max_product or part.C > 1 or (B is not None and B <= small_batch):
        return "pallas_forward"
    return "xla"


MAX_PIECES: Final = 16  # pieces of one partition: each is traced and compiled on its own


def pieces(part, B: int, limit: int) -> list[tuple[int, int]]:
    """Ranges ``[a, b)`` of parent blocks, of near-equal sizes, whose gathered children (``C * Kc * B`` floats per
    block) stay within ``limit`` elements (``Options.gather_chunk``), but at most :data:`MAX_PIECES` of them (the
    pieces then outgrow the limit: a 2B-edge PD's stages at a batch of 8,192 would take hundreds of pieces each,
    and as many traced copies of the layer); one range for a dense partition."""
    if part.dense:
        return [(0, part.n)]
    return ranges(part.n, max(limit // max(1, part.C * part.Kc * B), -(-part.n // MAX_PIECES)))


def runs_inplace(impl: str, options, buf: Array) -> bool:
    """Whether a sum partition routed to ``impl`` runs as a kernel (Pallas or jax-triton:
    :func:`jaxpc.ops.sum_layer.sum_kernels`) writing the (float32) buffer in place: sum-product layers, and
    max-product ones where :func:`max_product_kernel` holds."""
    return (impl in KERNEL_IMPLS and buf.dtype == jnp.float32
            and (options.propagation != "MPE" or max_product_kernel(impl, options)))


def max_product_kernel(impl: str, options) -> bool:
    """Whether a max-product (``propagation="MPE"``) sum partition routed to ``impl`` runs Pallas's max-plus
    forward (:func:`jaxpc.ops.pallas_sum.forward` with ``propagation="MPE"``) instead of XLA's reductions:
    ``Tuning.max_product_kernels`` (None: under ``impl="auto"``, which picks ``"pallas_forward"`` for such layers
    on a GPU where :func:`max_product_auto` takes the kernels, else ``"xla"``: :func:`kernel_choice`) and a Pallas
    impl. Its values and first maximizers are the reference's exactly, so the MPE flow pass reads them as it reads
    XLA's."""
    on = options.tuning.max_product_kernels
    return (on or (on is None and options.impl == "auto")) and impl in PALLAS_FORWARD


def runs_kernel_backward(impl: str, options) -> bool:
    """Whether the flow pass runs a sum partition routed to ``impl`` on backward kernels (Pallas's or jax-triton's:
    :func:`jaxpc.ops.sum_layer.sum_kernels`), else on XLA's: sum-product flows, untempered, of an exponent the
    kernels compute (:func:`factored_forward`)."""
    tempered = options.pflow_temperature != 1.0 or options.eflow_temperature != 1.0
    return (impl in ("pallas", "triton") and options.propagation != "MPE" and not tempered
            and factored_forward(options))


def exclusive(part) -> bool:
    """Whether a sum partition is a tree level: one child block per parent block and one parent per child
    row block. The Pallas backward then computes each parent's child flows once and writes them to every row
    block of its (folded) child (:func:`jaxpc.ops.pallas_sum.backward_exclusive`)."""
    return part.C == 1 and part.D == 1


# ---- kept shifts --------------------------------------------------------------------------------------

SHIFT_MIN_UNIT: Final = 8  # Options.kernel_shifts: blocks of at least this many nodes keep their shifts


def _keeps_shift(part) -> bool:
    """Whether a sum partition may keep its blocks' shifts in the forward (``Options.kernel_shifts``): blocks of at
    least :data:`SHIFT_MIN_UNIT` nodes gathered block by block (not dense, or one block: a tree's top levels)."""
    return part.blockwise and part.Kp >= SHIFT_MIN_UNIT


def writes_shift(options, part, buf: Array) -> bool:
    """Whether sum partition ``part`` keeps its blocks' shifts in the forward (the in-place kernel's or XLA's) for
    the XLA flow pass (the Pallas backward recomputes them): blocks of at least :data:`SHIFT_MIN_UNIT` nodes of a
    sum-product layer of an exponent computed by factored products (:func:`factored_forward`; larger ones are
    shifted per parent and sample) in a float32 buffer. The one test by which the forward decides to carry a shift
    buffer and to write a partition's shifts, and the flow pass decides to read them."""
    impl = kernel_choice(options, part, buf.shape[1], buf.dtype)[0]
    return (_keeps_shift(part) and options.propagation != "MPE" and buf.dtype == jnp.float32
            and factored_forward(options) and not runs_kernel_backward(impl, options))


def shift_unit(layout: Layout) -> int:
    """Rows of the node buffer per row of the shift buffer (``Options.kernel_shifts``): the greatest common
    divisor of the first rows and block sizes of the partitions that keep shifts (:func:`_keeps_shift`) and of
    the scanned periods' rows, so every such block starts at a multiple of it; 0 (no shifts kept) when that is
    below :data:`SHIFT_MIN_UNIT`."""
    unit = 0
    for step in layout.steps:
        scanned = isinstance(step, ScanSpec)
        specs = step.period if scanned else (step,)
        kept = False
        for spec in specs:
            row = spec.offset + sum(p.num_rows for p in spec.prods)
            for part in spec.sums:
                if _keeps_shift(part):
                    unit, kept = math.gcd(unit, row, part.Kp), True
                row += part.num_rows
        if scanned and kept:  # the later repeats sit whole periods further
            unit = math.gcd(unit, sum(spec.num_rows for spec in specs))
    return unit if unit >= SHIFT_MIN_UNIT else 0


def child_order(options, values) -> bool:
    """Whether :func:`jaxpc.ops.pallas_sum.backward_atomic` runs its edge blocks child by child at this batch
    (``Tuning.fanin_order_batch``)."""
    n = options.tuning.fanin_order_batch
    return bool(n) and values.shape[1] >= n


def wide_fanin(options, part) -> bool:
    """Whether sum partition ``part`` has at least ``Tuning.fanin_group_blocks`` edge blocks (parent blocks x
    fan-in): its fan-in kernels' grids stay wide with several children per program and larger batch tiles."""
    return 0 < options.tuning.fanin_group_blocks <= part.n * part.C


GROUP_ELEMENTS: Final = 4 * 32 * 32  # a grouped atomic-backward program's edge-block tiles: four 32 x 32 ones fit


def fanin_group(options, part, values) -> int:
    """Children per program of :func:`jaxpc.ops.pallas_sum.backward_atomic` for sum partition ``part`` at this
    batch: one in child order, or below ``Tuning.fanin_group_batch`` in a partition of fewer than
    ``Tuning.fanin_group_blocks`` edge blocks; else the largest power of two up to ``Tuning.fanin_group`` that
    divides its fan-in and keeps the program's weight and accumulator tiles within :data:`GROUP_ELEMENTS` elements
    each (eight 32 x 32 edge blocks ran out of registers on the H200)."""
    from ..ops.pallas_sum import KernelConfig, p2

    tuning, g = options.tuning, 1
    batch = 0 < tuning.fanin_group_batch <= values.shape[1]
    if child_order(options, values) or not (batch or wide_fanin(options, part)):
        return g
    tile = p2(part.Kp) * min(KernelConfig.block_k, p2(part.Kc))
    while 2 * g <= tuning.fanin_group and part.C % (2 * g) == 0 and 2 * g * tile <= GROUP_ELEMENTS:
        g *= 2
    return g


def _kernel_table_names(t: dict, impl: str) -> tuple[str, str, str]:
    """The keys of :func:`kernel_tables`'s ``(ch, pid, eorder)`` in a partition's tables ``t``."""
    if impl == "triton" or "kch" not in t:
        return "ch", "pid", "eorder"
    return "kch", "kpid", "keorder"


def kernel_tables(t: dict, part, impl: str) -> tuple:
    """``(ch, pid, eorder, extent)`` that the Pallas kernels of sum partition ``part`` read: the tables padded to
    their kernel class's shape and ``extent = {"blocks": n, "fanin": C}``, the partition's own shape in them, where
    it has them (:func:`jaxpc.compiler.compile.shared_kernel_tables`), else its own tables and ``{}``. jax-triton's
    kernels read the partition's own."""
    ch, pid, eorder = _kernel_table_names(t, impl)
    extent = {} if ch == "ch" else {"blocks": part.n, "fanin": part.C}
    return t[ch], t[pid], t.get(eorder), extent


def kernel_source(t: dict, impl: str, packed):
    """Where :func:`kernel_tables`'s ``ch`` and ``pid`` lie whole in the executable's packed table arrays
    ``packed`` (:func:`jaxpc.ops.tables.kernel_source`), for a Pallas kernel to read them there; None on
    jax-triton's kernels, or where they do not."""
    if impl == "triton":
        return None
    return table_places.kernel_source(t, packed, _kernel_table_names(t, impl)[:2])


def fanin_forward_config(options, part, B: int, impl: str, config, tuned: bool = False):
    """``config`` (the in-place forward's tiles) for sum partition ``part`` at batch ``B``: a fan-in of several
    child blocks on Pallas's kernel (not jax-triton's) prefetches its next child chunk from
    ``Tuning.fanin_forward_prefetch_batch`` samples on and takes ``Tuning.fanin_forward_span`` child blocks per
    step (:attr:`jaxpc.ops.pallas_sum.KernelConfig.span`), or, unless ``config`` is ``tuned`` (from
    ``Options.kernels``), in a wide partition (:func:`wide_fanin`) batch tiles of ``Tuning.fanin_forward_wide_tile``
    samples and one child block per step; other partitions keep ``config``."""
    if part.C < 2 or part.dense or impl == "triton":
        return config
    tuning = options.tuning
    prefetch = config.prefetch or 0 < tuning.fanin_forward_prefetch_batch <= B
    if tuning.fanin_forward_wide_tile and wide_fanin(options, part) and not tuned:
        return dataclasses.replace(config, prefetch=prefetch, span=1, block_b=tuning.fanin_forward_wide_tile)
    return dataclasses.replace(config, prefetch=prefetch, span=tuning.fanin_forward_span)


def atomic_backward(options, part, values: Array) -> bool:
    """Whether the flow pass runs sum partition ``part`` as :func:`jaxpc.ops.pallas_sum.backward_atomic` (its
    parameter flows and its child flows in one kernel, the child flows added by atomic adds) instead of XLA's
    backward, which writes ``W^T a`` for every edge block and scatters its products by atomic adds of its own:
    child row blocks read by several parent blocks (``D > 1``), blocks of at most
    :data:`~jaxpc.ops.pallas_sum.ATOMIC_MAX_KP` nodes, the forward's shifts kept (:func:`writes_shift`), local sums
    from the stored values (:func:`pflow_kernel`'s routes), parameter flows inline (not the batched pass), a
    batch of at least ``Options.tuning.fanin_kernel_batch`` samples, and on a GPU its atomic adds lowered relaxed
    (:func:`jaxpc.ops.pallas_sum.relaxed_atomics`)."""
    from ..ops import pallas_sum

    B, tuning = values.shape[1], options.tuning
    return (0 < tuning.fanin_kernel_batch <= B and part.D > 1 and not part.dense
            and part.Kp <= pallas_sum.ATOMIC_MAX_KP and options.eflow_temperature == 1.0
            and writes_shift(options, part, values) and pflow_kernel(options, values.dtype)
            and (pallas_sum.interpret_mode() or pallas_sum.relaxed_atomics()))


def product_kernels(options, buf: Array) -> bool:
    """Whether a node buffer's product partitions run as the in-place kernels of :mod:`jaxpc.ops.pallas_product`
    (forward and flow pass) instead of XLA's gathers, updates and scatters, which copy each stage's products and
    their flows through temporaries: a float32 buffer of at least ``Options.tuning.product_kernel_batch`` samples,
    ``impl`` ``"pallas"`` / ``"pallas_forward"``, or ``"auto"`` / ``"triton"`` on a GPU, the Pallas Triton backend
    present, and on a GPU the kernels' atomic adds lowered relaxed (:func:`jaxpc.ops.pallas_sum.relaxed_atomics`).
    Forwards that autodiff differentiates run on XLA (:func:`jaxpc.engine.forward.evaluate`)."""
    return (buf.dtype == jnp.float32 and 0 < options.tuning.product_kernel_batch <= buf.shape[1]
            and product_routes(options))


def product_routes(options) -> bool:
    """:func:`product_kernels`' conditions on the options and the backend alone."""
    from ..ops import pallas_sum

    if not (options.impl in PALLAS_FORWARD or (options.impl in ("auto", "triton") and on_gpu())):
        return False
    return kernels_available() and (pallas_sum.interpret_mode() or pallas_sum.relaxed_atomics())


def summed_pflow_kernel(options, spec, B: int) -> bool:
    """Whether the batched parameter-flow pass computes ``spec``'s blocks by
    :func:`jaxpc.ops.mosaic_tree.summed_param_flows` (the product and the weights' multiplication in one kernel)
    at batch ``B``: up to ``Tuning.pflow_sum_batch`` samples, blocks of fan-in 1 with consecutive weights,
    sum-product flows at ``precision`` below ``"fp32"`` (the product takes TF32 operands), untempered, blocks and
    batch the kernel takes, on a Hopper GPU (wgmma) where ``impl`` is ``"auto"``, ``"pallas"`` or
    ``"pallas_forward"``, or off a GPU with those two (on Pallas's interpreter)."""
    from ..ops import mosaic_tree

    tuning, impl = options.tuning, route_impl(options)
    return (B <= tuning.pflow_sum_batch and spec.C == 1 and spec.start >= 0
            and options.propagation == "LL" and options.concrete_precision != "fp32"
            and options.pflow_temperature == 1.0 and mosaic_tree.summed_fits(spec.Kp, spec.Kc, B)
            and ((impl in ("auto", *PALLAS_FORWARD) and on_hopper()) or (impl in PALLAS_FORWARD and not on_gpu())))


def pflow_kernel(options, dtype) -> bool:
    """Whether the batched parameter-flow pass may run :func:`jaxpc.ops.pallas_sum.param_flows_after` (one kernel
    per block shape: the weights' product in its epilogue, nothing of the gathered children's size in memory)
    instead of XLA's gather, product and multiply, for the block shapes of which some partition kept its shifts
    in an in-place forward kernel (:func:`writes_shift`; HCLT-256's 577 tree-level blocks at batch 16 on the
    H200: 0.24 against 0.32 ms): float32 buffers, local sums from the stored values (``precision`` below ``"fp32"``,
    untempered parameter flows of an exponent the kernels compute: :func:`factored_forward`), ``Options.impl``
    ``"auto"`` on a GPU or ``"pallas"`` / ``"pallas_forward"`` (interpret mode off a GPU); never with ``"xla"``."""
    impl = route_impl(options)
    if (jnp.dtype(dtype) != jnp.float32 or impl in ("xla", "triton") or options.concrete_precision == "fp32"
            or options.pflow_temperature != 1.0 or not factored_forward(options) or not kernels_available()):
        return False
    return impl != "auto" or on_gpu()
