"""The frozen options object: the one path by which an option reaches traced code.

Every jitted entry point takes an :class:`Options` as a static argument, so its hash is part
of the executable's key: changing any field can never replay an executable compiled for
another value.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import warnings
from typing import Any

import jax

__all__ = ["Options", "Tuning", "PROPAGATIONS", "resolve_precision"]

PROPAGATIONS = ("LL", "MPE", "GeneralLL")
BACKWARDS = ("flows", "autodiff")
PRECISIONS = ("default", "fp32", "tf32", "bf16")
IMPLS = ("xla", "pallas", "pallas_forward", "triton")
IMPL_CHOICES = ("auto",) + IMPLS  # Options.impl: "auto" picks one of IMPLS per sum partition
PARAM_FLOW_PASSES = ("auto", "inline", "batched")
PALLAS_FORWARD = ("pallas", "pallas_forward")  # the impls whose sum layers run the Pallas forward kernel
KERNEL_IMPLS = PALLAS_FORWARD + ("triton",)  # the impls whose sum layers run a forward kernel in place


def _fields_hash(self) -> int:
    """The hash of a frozen options dataclass's fields, computed once per object: every call of the API hashes its
    options (an executable's key), and a field-by-field hash of :class:`Options` with its :class:`Tuning` takes
    microseconds."""
    h = self.__dict__.get("_hash")
    if h is None:
        h = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
        object.__setattr__(self, "_hash", h)
    return h


def _state(self) -> dict:
    """The pickled state: the fields without the cached hash (string hashes differ between processes)."""
    return {k: v for k, v in self.__dict__.items() if k != "_hash"}


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Performance knobs of :class:`Options` (``Options(tuning=Tuning(...))``): they choose how an executable
    computes, never what it computes (same values and flows up to rounding). Defaults were measured on an H200;
    the figures behind each are in ``benchmarks/RESULTS.md``.

    Attributes:
        leaf_batch: ``impl="auto"`` on a GPU: the leaf kernel that writes the node buffer's leaf rows
            (``Options.leaf_kernel``) runs from this many samples on.
        counts_batch: ``impl="auto"`` on a GPU: categorical leaves' expected counts come from their Pallas kernel
            (the one-hot matrices in registers) from this many samples on, below it from XLA's products.
        small_batch: ``impl="auto"`` on a GPU: up to this many samples, tree levels (fan-in one block) run the
            Pallas forward too.
        pflow_batch: ``param_flow_pass="auto"``: tree levels' parameter flows are batched up to this many samples.
        pflow_sum_batch: up to this many samples, on a Hopper GPU, the batched parameter-flow pass computes the
            blocks of fan-in 1 with consecutive weights (an HCLT's tree, a PD's) by one Mosaic GPU kernel that
            multiplies the product by the weights in its epilogue (:func:`jaxpc.engine.routing.summed_pflow_kernel`)
            instead of XLA's matrix product, written out and read back by the multiplication; 0: never.
        chain_unroll: steps per loop iteration of the HMM chain's scans (from ``chain_unroll_batch`` samples on;
            one step below).
        chain_unroll_batch: see ``chain_unroll``.
        chain_kernel_batch: up to this many samples, a tied chain's scans run as one persistent Pallas kernel each
            way (:mod:`jaxpc.ops.pallas_chain`) where ``impl`` is ``"auto"`` on a GPU or ``"pallas"`` and the
            messages fit a program's registers (1,024 latents up to 16 samples, 256 up to 64); 0: never.
        chain_side_by_side: where the persistent kernels run, the flows' forward runs the backward messages in the
            same launch, beside the forward ones (normalized on their own, rescaled afterwards), so that the
            backward does not wait for the forward; both halves must fit the device at once
            (:func:`jaxpc.ops.pallas_chain.fits_both`).
        product_kernel_batch: from this many samples, a node buffer's product layers run as in-place Pallas
            kernels (:mod:`jaxpc.ops.pallas_product`; :func:`jaxpc.engine.routing.product_kernels`) where the sum
            layers may run Pallas kernels; 0: never.
        full_layout_reads: with ``fold_products``, the flow pass runs the full layout instead of the folded plan
            where the circuit's products have at least this many reading edge blocks per block
            (:func:`jaxpc.engine.routing.full_layout_pays`) and run as kernels (``product_kernel_batch``); 0: never.
        chain_stack_limit: a tied chain's transition flows come from one product over all steps while its stacked
            messages (steps x latents x samples) stay at most this many values; step by step beyond.
        unset_rows: buffers whose rows are all written before they are read start unset (``lax.empty``) instead of
            zeroed.
        min_unset: on a GPU, buffers of fewer elements start as zeros even where they could start unset.
        onehot_chunk: the most elements of the one-hot matrices that XLA's leaf counts build at a time.
        quick_first_compile: on a GPU, a new executable is compiled first without XLA's Triton GEMM fusions,
            autotuning and LLVM's expensive passes (seconds instead of tens of seconds), runs at once, and is
            replaced by the fully optimized compile from a background thread
            (:func:`jaxpc.executables.quick_options`; ``Circuit.wait_compiled``).
        unroll_optimized: that optimized compile runs the scanned stages unrolled (no loop overhead per step;
            :func:`jaxpc.executables.optimized_options`) and without Triton GEMM fusions (cuBLAS is faster on
            the unrolled levels' products: :func:`jaxpc.executables.optimized_xla`); the quick one keeps the scans,
            and so do ``mpe`` and ``sample``, whose top-down selection runs slower unrolled.
        max_product_kernels: max-product sum layers (``propagation="MPE"``: ``mpe``, hard EM) run Pallas's
            max-plus forward in place where a Pallas impl is chosen (True; ``"auto"``: on a GPU, for every layer
            that is not dense) instead of XLA's reductions, with the same values and first maximizers bit for bit
            (:func:`jaxpc.engine.routing.max_product_kernel`). None (the default): ``impl="auto"`` takes them
            where they were faster on an H100 (:func:`jaxpc.engine.routing.max_product_auto`: layers of several
            child blocks at batches of 128 and more, tree levels at 512 where the stages run unrolled; hard EM's
            flows at B=512 12.6 ms against 21.4 on HCLT-256, 14.2 against 24.7 on PD-128); False: never.
        compiler_options: XLA options for the executables, ``((name, value), ...)`` (e.g.
            ``(("xla_gpu_autotune_level", 0),)``); values are hashable (str, bool, int or float), else a
            ``TypeError``.
        concurrent_batch: on a GPU, executables of batches up to this many samples order their command buffers'
            kernels by data dependencies (XLA's ``xla_gpu_command_buffer_scheduling_mode=CONCURRENT``) instead of
            its latency-hiding schedule, unless ``compiler_options`` sets that option
            (:func:`jaxpc.executables.batch_xla`); 0: never.
        tree_kernel_batch: up to this many samples (at most 64), the folded plan's run of tree levels (an HCLT's:
            :class:`jaxpc.compiler.layout.TreeSpec`) runs as one persistent kernel each way where ``impl`` is
            ``"auto"`` on a GPU, ``"triton"``, or ``"pallas"`` / ``"pallas_forward"``: jax-triton's
            (:mod:`jaxpc.ops.triton_tree`) where that route runs and the levels fit, else Pallas's
            (:mod:`jaxpc.ops.pallas_tree`); 0 (the default): never, as it was no faster than the levels one by
            one on the H200 and its first call compiles seconds longer.
        tree_clusters: the folded plan's run of tree levels runs on thread-block clusters
            (:mod:`jaxpc.ops.mosaic_tree`: Pallas Mosaic GPU kernels, two launches each way, the tree's parameter
            flows left to the batched pass) where the blocks are square, the batch a multiple of 8 up to 64,
            ``precision`` below ``"fp32"`` and ``impl`` ``"auto"`` on a GPU or ``"pallas"`` /
            ``"pallas_forward"`` (Pallas's GPU interpreter off a GPU); it takes precedence over
            ``tree_kernel_batch``. None (the default): on where ``impl`` is ``"auto"`` on a Hopper GPU (compute
            capability 9.x: clusters of 16 blocks, wgmma), else off; True: wherever the conditions above hold (other
            GPUs cannot compile its kernels); False: never (docs/design.md, "Tree levels on thread-block
            clusters").
        tree_log_weights: on the clusters' route, the forward's kernels read the log-weights and exponentiate each
            task's tile in shared memory while its child loads, instead of reading a copy of the weights made
            before the forward (off by default: not faster on the H200).
        tree_forward_tile: parent rows of a task of the clusters' forward: 32 or 64, which takes twice the rows of
            a level a step (HCLT-256: 60 steps against 90), each step's product and weight tile twice as large.
            None (the default): 64 at batches up to 16, else 32.
        tree_backward_tile: parent rows of a task of the clusters' backward: 32, or 64 (fewer steps, as
            ``tree_forward_tile``) where a block's shared memory holds them (256-node blocks: batches up to 16),
            on a kernel that reads each parent's ``exp(shift - value)`` and the child's ``exp(child - shift)`` made
            before the call instead of computing them in its steps. None (the default): 64 at batches up to 16
            where it fits, else 32.
        fanin_kernel_batch: from this many samples on, a sum partition whose child row blocks are read by several
            parent blocks (a PD's fan-ins) and whose forward kept its shifts runs its whole backward as one Pallas
            kernel, the child flows added by atomic adds (:func:`jaxpc.engine.routing.atomic_backward`); 0: never.
        fanin_group: from ``fanin_group_batch`` samples on, each of that kernel's programs takes this many children
            of its parent block (the largest power of two up to it that divides the fan-in and keeps the program's
            tiles within four 32 x 32 edge blocks: :func:`jaxpc.engine.routing.fanin_group`), which read the
            parents' tiles and split their flows once for all of them.
        fanin_group_batch: see ``fanin_group``; 0: one child per program at every batch (except as below).
        fanin_group_blocks: ``fanin_group`` also applies below ``fanin_group_batch`` in partitions of at least this
            many edge blocks (parent blocks x fan-in), whose grids stay wide with several children per program; 0:
            never. The largest PDs' partitions reach it (PD-512, PD-768); PD-128's keep one child below batch 1,024.
        fanin_prefetch: where a program of that kernel takes one child, its batch loop issues the next tile's loads
            before each tile's arithmetic (with several children the loads held in flight cost more than they hide).
        fanin_order_batch: from this many samples on, that kernel takes one child per program and runs its edge
            blocks child by child (the partition's ``eorder`` table: the parents of a child read it and add to it
            together, while it is in L2), each starting its batch loop at another tile; 0 (the default): never.
        fanin_forward_prefetch_batch: from this many samples on, the Pallas forward of those partitions issues the
            next child chunk's loads before each chunk's arithmetic (``KernelConfig.prefetch``); 0: never. At small
            batches the loads held in flight cost more than they hide.
        fanin_forward_span: child blocks per step of that forward's loop over the children
            (``KernelConfig.span``, a power of two; blocks of a power-of-two size, at most 64 child nodes a step:
            :func:`jaxpc.ops.pallas_sum.forward_span`): one running max, one rescale
            and one product per ``span`` blocks, their loads in flight together; 1: one block per step.
        fanin_forward_wide_tile: in partitions of at least ``fanin_group_blocks`` edge blocks, that forward takes
            batch tiles of this many samples (a power of two) and one child block per step, unless
            ``Options.kernels`` tunes the partition; 0: the tiles and ``fanin_forward_span`` of the others (two
            blocks a step of 64-sample tiles would take 212 registers a thread against 128).

            ``benchmarks/pd_tiles.py`` times the fan-in settings above against each other.
        fanin_backward_stages: software-pipeline stages of the atomic backward's loop over batch tiles
            (``KernelConfig.num_stages``), unless ``Options.kernels`` tunes the partition.
        stage_barrier_batch: from this many samples on, the forward's node buffer passes an optimization barrier
            after each stage's writes, so that XLA fuses no stage's writes into the next stage's reductions (an
            unrolled HCLT's fused writes re-read the whole buffer per stage); 0: never. Below 128 samples the
            barriers cost a few microseconds and save nothing.
    """

    leaf_batch: int = 64
    counts_batch: int = 64
    small_batch: int = 32
    pflow_batch: int = 128
    pflow_sum_batch: int = 64
    chain_unroll: int = 8
    chain_unroll_batch: int = 128
    chain_kernel_batch: int = 64
    chain_side_by_side: bool = True
    product_kernel_batch: int = 1
    full_layout_reads: int = 8
    chain_stack_limit: int = 4 * 2**20
    unset_rows: bool = True
    min_unset: int = 2**24
    onehot_chunk: int = 1 << 25
    quick_first_compile: bool = True
    unroll_optimized: bool = True
    max_product_kernels: bool | None = None
    compiler_options: tuple = ()
    concurrent_batch: int = 32
    fanin_kernel_batch: int = 1
    tree_kernel_batch: int = 0
    tree_clusters: bool | None = None
    tree_log_weights: bool = False
    tree_forward_tile: int | None = None
    tree_backward_tile: int | None = None
    fanin_group: int = 4
    fanin_group_batch: int = 1024
    fanin_group_blocks: int = 16384
    fanin_prefetch: bool = True
    fanin_order_batch: int = 0
    fanin_forward_prefetch_batch: int = 128
    fanin_forward_span: int = 2
    fanin_forward_wide_tile: int = 64
    fanin_backward_stages: int = 3
    stage_barrier_batch: int = 128

    __hash__ = _fields_hash
    __getstate__ = _state

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("unset_rows", "quick_first_compile", "unroll_optimized", "max_product_kernels",
                          "fanin_prefetch", "chain_side_by_side", "tree_clusters",
                          "tree_log_weights"):
                nullable = f.name in ("tree_clusters", "max_product_kernels")
                if not isinstance(v, bool) and not (nullable and v is None):
                    raise TypeError(f"Tuning.{f.name} must be a bool{' or None' * nullable}, got {v!r}")
            elif f.name == "compiler_options":
                if not isinstance(v, tuple) or not all(isinstance(e, tuple) and len(e) == 2 and isinstance(e[0], str)
                                                       for e in v):
                    raise TypeError(f"Tuning.compiler_options must be a tuple of (name, value) pairs, got {v!r}")
                for name, value in v:
                    try:
                        hash(value)
                    except TypeError:
                        raise TypeError(f"Tuning.compiler_options values must be hashable (str, bool, int or float: "
                                        f"they key executables), got {name}={value!r}") from None
            elif f.name in ("tree_forward_tile", "tree_backward_tile"):
                if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v not in (32, 64)):
                    raise ValueError(f"Tuning.{f.name} must be None, 32 or 64, got {v!r}")
                if v is not None:
                    object.__setattr__(self, f.name, int(v))
            elif isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ValueError(f"Tuning.{f.name} must be a non-negative int, got {v!r}")
            else:
                object.__setattr__(self, f.name, int(v))  # (a NumPy integer keys executables as the int would)
        if self.fanin_forward_span < 1 or self.fanin_forward_span & (self.fanin_forward_span - 1):
            raise ValueError(f"Tuning.fanin_forward_span must be a power of two, got {self.fanin_forward_span!r}")
        if self.fanin_backward_stages < 1:
            raise ValueError(f"Tuning.fanin_backward_stages must be at least 1, got {self.fanin_backward_stages!r}")
        if self.fanin_forward_wide_tile & (self.fanin_forward_wide_tile - 1):
            raise ValueError(f"Tuning.fanin_forward_wide_tile must be 0 or a power of two, got "
                             f"{self.fanin_forward_wide_tile!r}")


@dataclasses.dataclass(frozen=True)
class Options:
    """How a circuit is evaluated.

    Attributes:
        propagation: ``"LL"`` (sum-product, log-likelihoods), ``"MPE"`` (max-product) or
            ``"GeneralLL"`` (sum nodes compute ``(1/alpha) log sum_c (w_c p_c)^alpha``; ``alpha=1``
            is LL, ``alpha -> inf`` approaches MPE).
        alpha: the GeneralLL exponent (required for, and only allowed with, GeneralLL). From 1e-3 up to 1 the sum
            layers compute ``(w_c p_c)^alpha`` as factored matrix products (on the kernels where ``impl`` routes
            them); above 1, where those factors underflow in float32, and below 1e-3, where their sum rounds to
            within ``alpha`` of 1, from the terms ``log w_c + log p_c`` shifted by each
            node's largest, on XLA whatever ``impl`` and ``kernels`` say (no term underflows at any ``alpha``; the
            terms' float32 rounding, which ``alpha`` multiplies, bounds the flows' relative error by about
            ``alpha * |log w_c + log p_c| * 6e-8``).
        backward: how gradients (flows) are computed: ``"flows"`` (a top-down pass over the node
            buffer, PyJuice's backward; default) or ``"autodiff"`` (JAX's reverse mode through the
            forward pass; a reference, slower and more memory-hungry; it differentiates XLA's sum layers
            whatever ``impl`` and ``kernels`` say, since the in-place kernels have no autodiff rule).
        precision: matrix products of the sum layers and of the soft-evidence leaves: ``"default"`` (the
            default: JAX's default matmul precision, :func:`resolve_precision`: ``"tf32"`` on NVIDIA GPUs,
            ``"fp32"`` on CPUs and wherever ``jax.default_matmul_precision`` is ``"highest"``/``"float32"``),
            ``"fp32"`` (exact float32), ``"tf32"`` (the GPU's tensor-float-32: about 2e-5 relative error per
            product) or ``"bf16"`` (bfloat16 operands, float32 accumulation: about 3e-3). Below fp32 the flow
            pass takes each sum node's local sum from its stored value instead of recomputing it (one matrix
            product fewer per layer), which adds about ``|value| * 6e-8`` relative error per layer. The
            measured errors of each setting are in ``docs/performance.md``.
        compute_param_flows: with False, ``flows`` skips the sum-edge flows (returned as zeros) and
            ``em_step`` leaves the sum parameters untouched (only the leaves are refitted).
        negate_flows: return ``-flows`` (for contrastive objectives); EM refuses negated flows.
        logspace_flows: ``flows`` returns the logarithm of every expected count (sum edges, categorical counts,
            ``node_flows``), from a flow pass run in the log domain (:mod:`jaxpc.engine.logflows`, PyJuice's
            ``logspace_flows``): a count far below float32's smallest number is still a finite log, and a count
            that is exactly zero is ``-inf``. The node values come from the plain forward on the full layout; the
            flow pass is one XLA pass over it without matrix products (``kernels``, ``fold_products``,
            ``chain_scan`` and ``backward`` do not apply to it). Leaves whose statistics are moments (Gaussian,
            DiscreteLogistic) have no log form and raise. EM takes linear flows: ``em_step`` refuses it.
        node_flows: ``flows`` also returns, under ``"node"``, each node's flow summed over the batch, the
            denominators of the M-step (PyJuice's ``cum_pflows``): ``{"sum": {group: [P, Kp]}, "input": {layer:
            [rows]}}``, for every parameter block the total of its parent nodes' edge flows (pooled over tied
            blocks, as the M-step normalizes them) and for every input parameter row the total flow of its
            nodes. ``flows["sum"][g] / node["sum"][g][..., None]`` is EM's update without pseudocount. Needs
            ``compute_param_flows``.
        impl: implementation of the sum layers: ``"auto"`` (default: per sum partition, on a GPU the Pallas
            forward and the XLA backward for partitions whose blocks have several child blocks, where the
            kernel's in-register gather beats XLA's materialized one, and at batches of at most
            ``Tuning.small_batch`` for tree levels too (one kernel per level instead of four), the XLA path
            elsewhere (tree levels at larger batches and dense layers, where XLA was as fast or faster); the XLA
            path on other backends), ``"xla"`` (plain jnp, XLA; ``"reference"``, its
            name before 0.2, is still accepted with a ``DeprecationWarning``),
            ``"pallas_forward"`` (the Pallas forward kernel, writing the node buffer in place, and the XLA
            backward), ``"pallas"`` (the Pallas kernels of :mod:`jaxpc.ops.pallas_sum`: Triton on GPU,
            interpret mode elsewhere; a tree level's backward one kernel at batches of at most 64) or
            ``"triton"`` (raw Triton kernels through jax-triton, :mod:`jaxpc.ops.triton_sum` and the leaf buffer
            of :mod:`jaxpc.ops.triton_leaf`, forward and backward, where jax-triton runs: checked once per process
            by :func:`jaxpc.ops.triton_base.status`; elsewhere one warning with the reason and ``"auto"``'s
            routes). Max-product layers always use the XLA path.
        kernels: per-partition overrides of ``impl`` found by :func:`jaxpc.autotune.tune_circuit`:
            pairs ``((n, C, Kp, Kc, U, D, batch[, M]), choice)`` (``M`` for folded partitions), ``choice``
            ``("xla",)`` or ``(impl, block_b, block_k, num_warps)``; partitions not named use ``impl``. Each
            partition is named once (else a ``ValueError``); the pairs are kept sorted by signature, so the same
            routes given in any order are equal options (one executable).
        pflow_temperature: parameter flows split each sum node's flow by the tempered posterior
            ``(w_c p_c)^(1/T) / sum_c' (w_c' p_c')^(1/T)`` (T < 1 sharpens toward hard EM, which T -> 0 reaches
            where every sum's children have the same values under LL as under MPE: a mixture of products); 1 is
            EM. The flow pass of tempered flows runs on XLA's sum layers; for T < 1 each share is computed from the
            terms shifted by the node's largest, so no flow is lost at any T. Needs ``backward="flows"`` (else a
            ``ValueError``: autodiff differentiates the untempered log-likelihood).
        eflow_temperature: the same tempering for the flows passed down to the children.
        chain_scan: evaluate chain-structured circuits (HMMs: a chain of dense sum layers over one input
            layer, found by :func:`jaxpc.compile`) by the rescaled forward-backward scan of
            :mod:`jaxpc.engine.chain` (same values and flows, one matrix product per step each way, no
            node buffer; at small batches one persistent Pallas kernel each way, ``Tuning.chain_kernel_batch``)
            for ``propagation="LL"`` with ``backward="flows"`` and untempered flows; False
            runs them layer by layer like any circuit (``impl`` and ``kernels`` apply only then).
        fold_products: evaluate log-likelihoods and flows on the circuit's folded plan (``layout.fold``;
            default): every product folded into the gathers of the sums that read it, so the node buffer
            holds input and sum rows only and each tree level is one sum stage (same values and flows;
            PD-128's buffer has a third of the rows). ``kernels`` route the partitions of whichever plan
            runs; node values, queries and autodiff use the full layout; False evaluates the full layout. Where
            the products have many readers the flow pass runs the full layout anyway (``Tuning.full_layout_reads``).
            Folded, HCLT-256 and PD-128 run faster and compile sooner than on the full layout.
        gather_chunk: the most elements of one XLA sum layer's gathered children (``[n, C*Kc, B]``); a larger
            partition runs in pieces of parent blocks, one after the other, forward and backward, so the
            sum layers' temporaries stay within a few pieces (default ``2**24`` floats: 64 MiB pieces).
            At most 16 pieces per partition (``jaxpc.engine.routing.MAX_PIECES``): beyond, pieces grow.
        kernel_shifts: the forward of the flow pass (the in-place Pallas kernels and XLA's sum layers) keeps each
            parent block's shift, the max over its children's values per sample, for the XLA flow pass (not
            for partitions whose flows run on the Pallas backward, which recomputes it), whose element flows
            and batched parameter flows then read it instead of gathering the children once more to recompute
            it (a buffer of ``R / unit`` rows, ``unit`` the greatest common divisor of the first rows and sizes
            of the blocks of at least 8 nodes gathered block by block; none when that is below 8). With
            ``propagation="MPE"`` it keeps each max-product parent's first maximizing child instead (int32, a
            buffer of ``R`` rows), which hard EM's flow pass then reads instead of searching the terms again.
            Same values and flows. Default True: faster at every batch measured.
        param_flow_pass: where the XLA flow pass computes the sum parameters' flows (LL and GeneralLL):
            ``"inline"``, each partition's together with its element flows, level by level; ``"batched"``,
            after the element flows, from the final node values and flows, one batched product for all the
            partitions of one block shape and fan-in (a tree's levels in one, in pieces of ``gather_chunk``,
            written straight into the group's array when they cover it in order), which takes two kernels
            per level out of the flow pass's chain and gathers the children once more; ``"auto"`` (default):
            tree levels (one child block per parent block) batched at batches of at most
            ``tuning.pflow_batch``, everything else inline (batched, the tree levels were faster up to that batch
            and slower above it; a PD's fan-ins were slower batched). Same flows up to rounding. Below
            ``precision="fp32"``, block shapes whose shifts the in-place forward kept (``impl="auto"`` on a GPU:
            tree levels at batches up to ``Tuning.small_batch``) run the batched pass as one Pallas kernel
            (:func:`jaxpc.engine.routing.pflow_kernel`).
        leaf_kernel: where every input layer is a table of log-values (categorical and Bernoulli leaves) and
            ``impl`` is ``"auto"`` on a GPU or ``"pallas"`` / ``"pallas_forward"``, the flow pass's node buffer is
            written by one Pallas kernel that gathers the leaves' values in registers
            (:func:`jaxpc.engine.routing.leaf_kernel`, :mod:`jaxpc.ops.pallas_leaf`) instead of XLA's gather
            into an ``[N, B]`` array and a concatenation into the buffer, and the expected counts of categorical
            leaves in runs over one variable come from one kernel that makes the one-hot matrices in registers
            (:func:`jaxpc.engine.routing.counts_kernel`), instead of XLA's one-hot matrices in memory. Default True;
            False: XLA's. Same values and counts; ``jax.grad`` through the buffer differentiates XLA's gather.
        tuning: performance knobs (:class:`Tuning`), grouped apart from the fields above that say what is computed.
        scan_stages: run the stages :func:`jaxpc.compile` grouped into repeats (``scan_min_repeats``) under
            ``lax.scan``; False unrolls them into the executable (a longer trace, no device-side loop; no
            faster for HCLT-256 on the H200).
    """

    propagation: str = "LL"
    alpha: float | None = None
    backward: str = "flows"
    precision: str = "default"
    compute_param_flows: bool = True
    negate_flows: bool = False
    logspace_flows: bool = False
    node_flows: bool = False
    impl: str = "auto"
    kernels: tuple = ()
    pflow_temperature: float = 1.0
    eflow_temperature: float = 1.0
    chain_scan: bool = True
    fold_products: bool = True
    scan_stages: bool = True
    gather_chunk: int = 1 << 24
    kernel_shifts: bool = True
    param_flow_pass: str = "auto"
    leaf_kernel: bool = True
    tuning: Tuning = Tuning()

    __hash__ = _fields_hash
    __getstate__ = _state

    def __post_init__(self):
        for name in ("pflow_temperature", "eflow_temperature"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive finite float, got {v!r}")
            object.__setattr__(self, name, float(v))
            if v != 1.0 and self.propagation != "LL":
                raise ValueError(f"{name} applies to propagation='LL' flows, got propagation={self.propagation!r}")
        if not isinstance(self.kernels, tuple):
            raise TypeError(f"kernels must be a tuple of (partition signature, choice) pairs, got "
                            f"{type(self.kernels).__name__}")
        if self.impl == "reference" or any(isinstance(e, tuple) and len(e) == 2 and e[1] == ("reference",)
                                           for e in self.kernels):
            warnings.warn("jaxpc: impl='reference' is now impl='xla' (the XLA route; '*_reference' names the "
                          "oracles); the old name goes in the next release", DeprecationWarning, stacklevel=3)
            if self.impl == "reference":
                object.__setattr__(self, "impl", "xla")
            object.__setattr__(self, "kernels", tuple(
                (e[0], ("xla",)) if isinstance(e, tuple) and len(e) == 2 and e[1] == ("reference",) else e
                for e in self.kernels))
        object.__setattr__(self, "kernels", _checked_kernels(self.kernels))
        for name, allowed in (("backward", BACKWARDS), ("precision", PRECISIONS), ("impl", IMPL_CHOICES),
                              ("param_flow_pass", PARAM_FLOW_PASSES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("compute_param_flows", "negate_flows", "logspace_flows", "node_flows", "chain_scan",
                     "fold_products", "scan_stages", "kernel_shifts", "leaf_kernel"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.backward == "autodiff":
            for name in ("pflow_temperature", "eflow_temperature"):
                if getattr(self, name) != 1.0:
                    raise ValueError(f"{name}={getattr(self, name)!r} needs backward='flows' (autodiff differentiates "
                                     f"the untempered log-likelihood), got backward='autodiff'")
        if self.logspace_flows and self.negate_flows:
            raise ValueError("logspace_flows=True returns logarithms of flows, which negate_flows=True cannot negate")
        if self.node_flows and not self.compute_param_flows:
            raise ValueError("node_flows=True needs compute_param_flows=True (a sum node's flow is the total of its "
                             "edge flows)")
        if not isinstance(self.tuning, Tuning):
            raise TypeError(f"tuning must be a jaxpc.Tuning, got {type(self.tuning).__name__}")
        if (isinstance(self.gather_chunk, bool) or not isinstance(self.gather_chunk, numbers.Integral)
                or self.gather_chunk < 1):
            raise ValueError(f"gather_chunk must be a positive int (elements), got {self.gather_chunk!r}")
        object.__setattr__(self, "gather_chunk", int(self.gather_chunk))
        if self.propagation not in PROPAGATIONS:
            raise ValueError(f"propagation must be one of {PROPAGATIONS}, got {self.propagation!r}")
        if self.propagation == "GeneralLL":
            if self.alpha is None:
                raise ValueError("propagation='GeneralLL' needs alpha (a positive float)")
            if isinstance(self.alpha, bool) or not isinstance(self.alpha, numbers.Real) or not (
                    math.isfinite(self.alpha) and self.alpha > 0):
                raise ValueError(f"alpha must be a positive finite float, got {self.alpha!r}")
            object.__setattr__(self, "alpha", float(self.alpha))
        elif self.alpha is not None:
            raise ValueError(f"alpha is only used with propagation='GeneralLL' (got propagation="
                             f"{self.propagation!r}, alpha={self.alpha!r})")

    @property
    def concrete_precision(self) -> str:
        """``precision`` with ``"default"`` resolved (:func:`resolve_precision`), as traced code reads it."""
        return self.precision if self.precision != "default" else resolve_precision("default")

    def replace(self, **changes: Any) -> Options:
        """A copy with ``changes`` applied, checked as the constructor checks them; unknown names raise a
        ``TypeError`` listing the valid ones."""
        unknown = changes.keys() - _field_names(type(self))
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}; valid options: {sorted(_field_names(type(self)))}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def make(cls, options: Options | None = None, **overrides: Any) -> Options:
        """``options`` (default ``Options()``) with the non-None keyword overrides applied; unknown
        names raise a ``TypeError`` listing the valid ones."""
        # (every call of the API comes here: the default options and the field names are made once)
        base = _default(cls) if options is None else options
        if not isinstance(base, cls):
            raise TypeError(f"options must be a jaxpc.Options, got {type(base).__name__}")
        names = _field_names(cls)
        unknown = overrides.keys() - names
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}; valid options: {sorted(names)}")
        changes = {k: v for k, v in overrides.items() if v is not None}
        if "propagation" in changes and changes["propagation"] != "GeneralLL" and "alpha" not in changes:
            changes["alpha"] = None
        return dataclasses.replace(base, **changes) if changes else base


def matmul_setting() -> str | None:
    """JAX's current default matmul precision setting (``jax.default_matmul_precision``), or None."""
    v = jax.config.jax_default_matmul_precision
    return None if v is None else str(v)


@functools.cache
def _platform() -> str:
    return jax.default_backend()


def resolve_precision(precision: str) -> str:
    """The concrete precision of ``precision``: ``"default"`` follows JAX's default matmul precision, which is
    TF32 (``"tf32"``) for float32 products on NVIDIA GPUs and exact (``"fp32"``) on CPUs, and exact wherever
    ``jax.default_matmul_precision`` is ``"highest"`` or ``"float32"``."""
    if precision != "default":
        return precision
    if matmul_setting() in ("highest", "float32"):
        return "fp32"
    return "tf32" if _platform() == "gpu" else "fp32"


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _checked_kernels(kernels: tuple) -> tuple:
    """``Options.kernels`` checked (each entry ``((n, C, Kp, Kc, U, D, B[, M]), choice)`` with non-negative ints in
    the signature and ``choice`` ``("xla",)`` or ``(impl, block_b, block_k, num_warps)``, each partition named once),
    its NumPy integers as ints and sorted by signature: the same routes in any order key one executable."""
    routes = {}
    for entry in kernels:
        sig, choice = entry if isinstance(entry, tuple) and len(entry) == 2 else (None, None)
        ok = (isinstance(sig, tuple) and len(sig) in (7, 8) and all(_is_int(v) and v >= 0 for v in sig)
              and isinstance(choice, tuple)
              and (choice == ("xla",) or (len(choice) == 4 and isinstance(choice[0], str)
                                          and choice[0] in KERNEL_IMPLS
                                          and all(_is_int(v) and v > 0 for v in choice[1:]))))
        if not ok:
            raise ValueError(f"kernels entry {entry!r} is not ((n, C, Kp, Kc, U, D, B[, M]), ('xla',) or "
                             f"(impl, block_b, block_k, num_warps)) with non-negative ints in the signature, "
                             f"positive ints in the configuration and impl one of {KERNEL_IMPLS}")
        sig = tuple(int(v) for v in sig)
        if sig in routes:
            raise ValueError(f"kernels names partition {sig} twice ({routes[sig]!r} and {choice!r}); give each "
                             f"partition one route")
        routes[sig] = choice[:1] + tuple(int(v) for v in choice[1:])
    return tuple(sorted(routes.items()))


@functools.cache
def _field_names(cls) -> frozenset:
    return frozenset(f.name for f in dataclasses.fields(cls))


@functools.cache
def _default(cls):
    return cls()  # frozen: one shared instance
