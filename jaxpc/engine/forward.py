"""Pure forward evaluation: ``f(layout, tables, params, x, missing, options) -> log-values``.

``layout`` is static (closed over by the jitted functions); ``tables`` and ``params`` are pytrees
of device arrays; ``options`` is the frozen :class:`jaxpc.Options` (a static argument).

Shapes: ``x [B, V]``, ``missing`` None, ``bool[V]`` or ``bool[B, V]``, buffer ``[R, B]``.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Final

import jax
import jax.numpy as jnp
from jax import lax

from ..compiler.layout import Layout, ScanSpec, StageSpec
from ..ops import product_layer, sum_layer
from ..ops.buffers import uninitialized
from ..ops.pieces import in_order, ranges
from ..ops.product_layer import product_layer_backward_reference as product_layer_backward
from ..ops.sum_layer import child_rows, child_terms, sum_layer_reference
from ..ops.sum_layer import sum_layer_backward_reference as sum_layer_backward
from ..ops.sum_layer import sum_layer_param_flows_reference as sum_layer_param_flows
from ..ops.sum_layer_external import sum_layer_external_reference
from ..options import PALLAS_FORWARD, Tuning
from . import chain

Array = jax.Array


def missing_t(missing: Array | None) -> Array | None:
    """Missing mask laid out ``[V, B]`` (or ``[V, 1]``)."""
    if missing is None:
        return None
    return missing.T if missing.ndim == 2 else missing[:, None]


def input_values(layout: Layout, tables: dict, params: dict, x: Array, missing: Array | None, options,
                 soft: Array | None = None, evidence: dict | None = None) -> list:
    """Per input layer ``[N, B]`` node values. ``soft``: optional ``[B, V, K]`` log-weights of soft evidence,
    used by the discrete leaves in place of ``x``/``missing``. ``evidence``: per-call evidence for the
    leaves that read it (:mod:`jaxpc.distributions.evidence`) and ``evidence["latent"]`` ``[B, V, M]``, an
    additive log-potential on node ``j`` of every leaf vector over variable ``v``."""
    xt = x.T
    mt = missing_t(missing)
    qt = None if soft is None else jnp.transpose(soft, (1, 2, 0))  # [V, K, B]
    outs = []
    for i, (spec, tab) in enumerate(zip(layout.input_layers, tables["inputs"])):
        with jax.named_scope(f"jaxpc/input{i}/{spec.key}"):
            p = params["input"][spec.key]
            if qt is not None and spec.dist.discrete:
                outs.append(spec.dist.log_prob_soft(p, tab["meta"], tab["rows"], qt[tab["vars"]], options))
                continue
            xv = xt[tab["vars"]]
            mv = None if mt is None else mt[tab["vars"]]
            if evidence:
                v = spec.dist.log_prob_evidence(p, tab["meta"], tab["rows"], tab["vars"], tab["pos"], xv, mv,
                                                evidence, options)
                if evidence.get("latent") is not None:
                    v = v + evidence["latent"][:, tab["vars"], tab["pos"]].T.astype(v.dtype)
                outs.append(v)
            else:
                outs.append(spec.dist.log_prob(p, tab["meta"], tab["rows"], xv, mv, options))
    return outs



def _leaf_route(options, batch: int | None) -> bool:
    """The options' part of the leaf kernels' routes (:func:`leaf_kernel`, :func:`counts_kernel`):
    ``Options(leaf_kernel=True)`` and ``impl`` ``"pallas"`` / ``"pallas_forward"`` (interpret mode off a GPU) or
    ``"auto"`` on a GPU at a ``batch`` of at least ``Options.tuning.leaf_batch`` (None: any)."""
    if not options.leaf_kernel or options.impl == "xla":
        return False
    return options.impl != "auto" or (on_gpu() and (batch is None or batch >= options.tuning.leaf_batch))


def leaf_kernel(layout: Layout, params: dict, options, soft: Array | None = None,
                evidence: dict | None = None, batch: int | None = None) -> bool:
    """Whether the node buffer's first rows come from one kernel (:func:`leaf_values`) instead of the input
    layers' values and a concatenation: when :func:`evaluate` runs the flow pass's buffer (``backward="flows"``,
    not as a chain, no per-call evidence or soft evidence), every input layer is a table of log-values
    (``Distribution.value_table``: categorical leaves), laid out above the padding, the parameters float32,
    and ``Options.impl`` is ``"pallas"`` / ``"pallas_forward"`` (interpret mode off a GPU) or ``"auto"`` on a GPU at
    a ``batch`` of at least ``Options.tuning.leaf_batch``, unless ``Options(leaf_kernel=False)``. HCLT-256's
    buffer on the H200: 0.39 against XLA's 0.73 ms at batch 512, 0.18 against 0.28 at 128, but 0.16-0.23 against
    0.14 at 16, where a program's gathers from its rows of parameters are too few (docs/performance.md)."""
    if (not _leaf_route(options, batch) or soft is not None or evidence or not runs_node_buffer(layout, options)
            or param_dtype(params) != jnp.float32):
        return False
    row = 2 * layout.kmax
    for spec in sorted(layout.input_layers, key=lambda s: s.offset):
        if spec.offset < row or spec.dist.value_table(params["input"][spec.key]) is None:
            return False
        row = spec.offset + spec.num_nodes
    return kernels_available()


def counts_kernel(spec, options, flows: Array) -> bool:
    """Whether the expected counts of input layer ``spec`` (categorical leaves in runs over one variable,
    ``InputLayerSpec.run``) come from one Pallas kernel (:func:`jaxpc.ops.pallas_leaf.categorical_counts`, the
    one-hot matrices in registers) instead of XLA's products with one-hot matrices in memory: float32 node flows
    ``[N, B]``, and the routes of :func:`leaf_kernel` (:func:`_leaf_route`)."""
    from ..distributions.categorical import Categorical

    if (not _leaf_route(options, flows.shape[1]) or spec.run < 2 or flows.dtype != jnp.float32
            or type(spec.dist).suff_stats_runs is not Categorical.suff_stats_runs):
        return False
    return kernels_available()


def runs_node_buffer(layout: Layout, options, evidence: dict | None = None) -> bool:
    """Whether :func:`evaluate` runs the flow pass over the node buffer (:func:`root_values`): ``backward="flows"``,
    no per-sample sum parameters in ``evidence``, and not as a chain."""
    externals = has_sum_externals(evidence)
    return options.backward == "flows" and not externals and not chain.applies(layout, options, externals)


def buffer_plan(layout: Layout, options) -> Layout:
    """The plan whose node buffer the flow pass runs: the folded one (``Options.fold_products``) or the layout."""
    return layout.fold if layout.fold is not None and options.fold_products else layout


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5))
def _leaf_buffer(plan: Layout, in_tables: list, in_params: dict, x: Array, missing: Array | None, options) -> Array:
    from ..distributions.base import reduce_missing
    from ..ops import pallas_leaf

    xt = x.T if jnp.issubdtype(x.dtype, jnp.integer) else x.T.astype(jnp.int32)  # as Categorical._values casts
    mt = None if missing is None else jnp.broadcast_to(missing_t(missing), xt.shape)
    specs, tabs = [], []
    for spec, tab in zip(plan.input_layers, in_tables):
        lp = spec.dist.value_table(in_params[spec.key])
        marg = None if mt is None else reduce_missing(lp, options)[tab["rows"]]
        specs.append(pallas_leaf.LeafLayer(spec.offset, spec.num_nodes, lp.shape[1]))
        tabs.append((lp, tab["rows"], tab["vars"], marg))
    # the stages write every row above the leaves before reading it: those rows are left unset
    # (Options.tuning.unset_rows)
    return pallas_leaf.categorical_buffer(xt, specs, tabs, num_rows=plan.num_rows, kmax=plan.kmax, missing=mt,
                                          zero_above=not options.tuning.unset_rows)


def _leaf_buffer_fwd(plan, in_tables, in_params, x, missing, options):
    return _leaf_buffer(plan, in_tables, in_params, x, missing, options), (in_tables, in_params, x, missing)


def _leaf_buffer_bwd(plan, options, res, g):
    """The parameters' cotangent: the VJP of the input layers' values (XLA's gather) at the buffer's input rows."""
    in_tables, in_params, x, missing = res
    vals, vjp = jax.vjp(lambda p: input_values(plan, {"inputs": in_tables}, {"input": p}, x, missing, options),
                        in_params)
    (d,) = vjp([lax.slice_in_dim(g, s.offset, s.offset + s.num_nodes).astype(v.dtype)
                for s, v in zip(plan.input_layers, vals)])
    return None, d, None, None


_leaf_buffer.defvjp(_leaf_buffer_fwd, _leaf_buffer_bwd)


def leaf_values(layout: Layout, tables: dict, params: dict, x: Array, missing: Array | None, options,
                soft: Array | None = None, evidence: dict | None = None):
    """What :func:`evaluate` takes for the input layers: the node buffer of :func:`buffer_plan` with the leaves
    written (float32 ``[R, B]``, one Pallas kernel, differentiable in the input parameters) where
    :func:`leaf_kernel` applies, else the list of the layers' values (:func:`input_values`)."""
    if leaf_kernel(layout, params, options, soft, evidence, x.shape[0]):
        with jax.named_scope("jaxpc/leaf_buffer"):
            return _leaf_buffer(buffer_plan(layout, options), tables["inputs"], params["input"], x, missing, options)
    return input_values(layout, tables, params, x, missing, options, soft, evidence)


def has_sum_externals(evidence: dict | None) -> bool:
    return bool(evidence) and bool(evidence.get("sum_gates") or evidence.get("sum_lowrank"))


def partition_key(part, B: int) -> tuple:
    """A sum partition's key in ``Options.kernels``: ``(n, C, Kp, Kc, U, D, B)``, with ``M`` appended for a
    folded partition (``M > 1``)."""
    sig = (part.n, part.C, part.Kp, part.Kc, part.U, part.D, B)
    return sig + (part.M,) if part.M > 1 else sig


def kernel_choice(options, part, B: int, dtype=jnp.float32):
    """``(impl, KernelConfig or None)`` for a sum partition: the tuned choice in ``options.kernels`` for this
    partition and batch, else ``options.impl`` (``"auto"``: :func:`auto_impl` for a ``dtype`` node buffer)
    with the default kernel configuration. Without the Pallas Triton backend every choice is the reference
    (with one warning per process)."""
    impl, cfg = _kernel_choice(options, part, B, dtype)
    if impl in PALLAS_FORWARD and not kernels_available():
        return "xla", None
    return impl, cfg


_WARNED_UNAVAILABLE = []


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


def _kernel_choice(options, part, B: int, dtype):
    sig = partition_key(part, B)
    for s, choice in options.kernels:
        if s == sig:
            if choice[0] in PALLAS_FORWARD:
                from ..ops.pallas_sum import KernelConfig
                return choice[0], KernelConfig(*choice[1:])
            return "xla", None
    if options.impl == "auto":
        return auto_impl(part, dtype, B, options.tuning.small_batch), None
    return options.impl, None


def on_gpu() -> bool:
    """Whether traced code runs on a GPU, where the Pallas kernels compile to Triton."""
    return jax.default_backend() == "gpu"



def auto_impl(part, dtype=jnp.float32, B: int | None = None, small_batch: int = Tuning.small_batch) -> str:
    """``Options(impl="auto")``'s choice for a sum partition at batch ``B``: on a GPU the Pallas forward (XLA
    backward) when its blocks have several child blocks, which XLA would gather into an ``[n, C*Kc, B]``
    tensor and read twice (PD-128 on the H200: forward 3.1 against 7.1 ms at batch 512, forward + flows 11.7
    against 12.3), and for tree levels (``C == 1``) at batches of at most ``Options.tuning.small_batch``, where one
    kernel per level replaces XLA's four (HCLT-256 at batch 16: forward + flows 3.18 against 3.29-3.57 ms
    synchronized, 2.27 against 2.67 in a pipelined loop; at batch 128 XLA's 4.53 against 4.67 ms, at 512
    8.16 against 9.31). The XLA path for dense layers, buffers other than float32 and on backends without
    Triton. (Forwards differentiated by autodiff run on XLA: :func:`evaluate`.)"""
    if part.dense or jnp.dtype(dtype) != jnp.float32 or not on_gpu():
        return "xla"
    if part.C > 1 or (B is not None and B <= small_batch):
        return "pallas_forward"
    return "xla"


def pieces(part, B: int, limit: int) -> list[tuple[int, int]]:
    """Ranges ``[a, b)`` of parent blocks, of near-equal sizes, whose gathered children (``C * Kc * B`` floats per
    block) stay within ``limit`` elements (``Options.gather_chunk``); one range for a dense partition."""
    if part.dense:
        return [(0, part.n)]
    return ranges(part.n, limit // max(1, part.C * part.Kc * B))


def _in_pieces(spans, tab: dict, step, carry):
    """``carry = step(carry, a, b, tables of blocks [a, b))`` over ``spans``, one piece after the other
    (:func:`jaxpc.ops.pieces.in_order`: a piece's gather cannot start before the previous piece is done)."""
    return in_order(spans, lambda a, b: {k: tab[k][a:b] for k in ("ch", "pid")}, step, carry)


def _inplace(impl: str, options, buf: Array) -> bool:
    """Whether a sum partition runs as a Pallas kernel writing the (float32) buffer in place."""
    return impl in PALLAS_FORWARD and options.propagation != "MPE" and buf.dtype == jnp.float32


def _stage(buf: Array, spec: StageSpec, tab: dict, sum_params: dict, options, offset, index,
           evidence: dict | None = None, counts: bool = False, shifts: Array | None = None, unit: int = 0):
    """The node buffer with one stage's rows written; ``(buf, shifts)`` when given ``shifts``, into which the
    partitions that keep them (the in-place kernels and XLA's) also write their blocks' shifts (rows of
    ``unit``, see :func:`shift_unit`)."""
    outs, inplace = [], []  # (row, values) written by updates; (row, index, part, tables, config) written by kernels
    row = offset
    for j, (part, t) in enumerate(zip(spec.prods, tab["prods"])):
        with jax.named_scope(f"jaxpc/stage{index}/prod{j}"):
            outs.append((row, product_layer(buf, t["ch"], K=part.K)))
        row = row + part.num_rows
    gates = (evidence or {}).get("sum_gates") or {}
    lowrank = (evidence or {}).get("sum_lowrank") or {}
    for j, (part, t) in enumerate(zip(spec.sums, tab["sums"])):
        with jax.named_scope(f"jaxpc/stage{index}/sum{j}"):
            if part.group in gates or part.group in lowrank:
                if options.propagation != "LL":
                    raise ValueError("external sum parameters (sum_gates / sum_lowrank) support propagation='LL'")
                outs.append((row, sum_layer_external_reference(
                    buf, t["ch"], t["pid"], sum_params[part.group], Kp=part.Kp, Kc=part.Kc, dense=part.dense,
                    gates=gates.get(part.group), lowrank=lowrank.get(part.group), counts=counts,
                    precision=options.concrete_precision)))
            else:
                impl, cfg = kernel_choice(options, part, buf.shape[1], buf.dtype)
                if _inplace(impl, options, buf):
                    inplace.append((row, j, part, t, cfg))
                else:
                    keep = shifts is not None and _writes_shift(options, part, buf)

                    def piece(done, a, b, sub, part=part, impl=impl, cfg=cfg, keep=keep):
                        kw = dict(Kp=part.Kp, Kc=part.Kc, dense=part.dense, propagation=options.propagation,
                                  alpha=options.alpha, precision=options.concrete_precision)
                        if keep:  # XLA's: its shifts (one per block) kept for the flow pass
                            return done + [sum_layer_reference(buf, sub["ch"], sub["pid"], sum_params[part.group],
                                                               with_shift=True, **kw)]
                        return done + [(sum_layer(buf, sub["ch"], sub["pid"], sum_params[part.group], impl=impl,
                                                  config=cfg, **kw), None)]

                    done = _in_pieces(pieces(part, buf.shape[1], options.gather_chunk), t, piece, [])
                    out, m = (d[0] if len(d) == 1 or d[0] is None else jnp.concatenate(d, axis=0)
                              for d in zip(*done))
                    outs.append((row, out))
                    if keep:
                        shifts = shifts.at[(row + jnp.arange(part.n) * part.Kp) // unit].set(m, unique_indices=True)
        row = row + part.num_rows
    if outs and not inplace:  # one write for the whole stage
        out = outs[0][1] if len(outs) == 1 else jnp.concatenate([o for _, o in outs], axis=0)
        buf = lax.dynamic_update_slice_in_dim(buf, out.astype(buf.dtype), offset, axis=0)
        return buf if shifts is None else (buf, shifts)
    for r, out in outs:
        buf = lax.dynamic_update_slice_in_dim(buf, out.astype(buf.dtype), r, axis=0)
    for r, j, part, t, cfg in inplace:  # parts of a stage read lower rows only: the order does not matter
        from ..ops import pallas_sum

        with jax.named_scope(f"jaxpc/stage{index}/sum{j}"):
            a = 1.0 if options.propagation == "LL" else options.alpha
            kw = dict(Kp=part.Kp, Kc=part.Kc, alpha=a, precision=options.concrete_precision,
                      config=pallas_sum.forward_config(part.n, part.Kp, buf.shape[1], cfg), out_offset=r)
            if shifts is not None and _writes_shift(options, part, buf):
                buf, shifts = pallas_sum.forward(buf, t["ch"], t["pid"], sum_params[part.group], shifts=shifts,
                                                 unit=unit, **kw)
            else:
                buf = pallas_sum.forward(buf, t["ch"], t["pid"], sum_params[part.group], **kw)
    return buf if shifts is None else (buf, shifts)


SHIFT_MIN_UNIT: Final = 8  # Options.kernel_shifts: blocks of at least this many nodes keep their shifts


def _keeps_shift(part) -> bool:
    """Whether a sum partition may keep its blocks' shifts in the forward (``Options.kernel_shifts``): blocks of at
    least :data:`SHIFT_MIN_UNIT` nodes gathered block by block (not dense, or one block: a tree's top levels)."""
    return part.blockwise and part.Kp >= SHIFT_MIN_UNIT


def _pallas_backward(impl: str, options) -> bool:
    """Whether the flow pass runs a sum partition routed to ``impl`` on the Pallas backward kernels (else XLA's)."""
    tempered = options.pflow_temperature != 1.0 or options.eflow_temperature != 1.0
    return impl == "pallas" and options.propagation != "MPE" and not tempered


def _writes_shift(options, part, buf: Array) -> bool:
    """Whether sum partition ``part`` keeps its blocks' shifts in the forward (the in-place kernel's or XLA's) for
    the XLA flow pass (the Pallas backward recomputes them): blocks of at least :data:`SHIFT_MIN_UNIT` nodes of a
    sum-product layer in a float32 buffer. The one test by which the forward decides to carry a shift buffer and
    to write a partition's shifts, and the flow pass decides to read them."""
    impl = kernel_choice(options, part, buf.shape[1], buf.dtype)[0]
    return (_keeps_shift(part) and options.propagation != "MPE" and buf.dtype == jnp.float32
            and not _pallas_backward(impl, options))


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


def _padding(layout: Layout, B: int, dtype) -> list:
    """The buffer's first ``2 * kmax`` rows: ``kmax`` zero rows, then ``kmax`` rows of ``-inf``."""
    return [jnp.zeros((layout.kmax, B), dtype), jnp.full((layout.kmax, B), -jnp.inf, dtype)]


def empty_buffer(layout: Layout, B: int, dtype) -> Array:
    """``[R, B]`` zeros with the ``-inf`` padding rows set."""
    return jnp.concatenate(_padding(layout, B, dtype) + [jnp.zeros((layout.num_rows - 2 * layout.kmax, B), dtype)])


def write_inputs(layout: Layout, buf: Array, vals: list) -> Array:
    for spec, v in zip(layout.input_layers, vals):
        buf = lax.dynamic_update_slice_in_dim(buf, v.astype(buf.dtype), spec.offset, axis=0)
    return buf


def input_buffer(layout: Layout, vals: list, dtype) -> Array:
    """The node buffer before the first stage: padding rows, the input layers' values, zeros above. Built
    as one concatenation (one kernel that computes the leaves and writes the whole buffer on a GPU) when the
    input layers fill the rows right after the padding, as the compiler lays them out."""
    B = vals[0].shape[1]
    specs = sorted(zip(layout.input_layers, vals), key=lambda sv: sv[0].offset)
    row = 2 * layout.kmax
    for spec, _ in specs:
        if spec.offset != row:
            return write_inputs(layout, empty_buffer(layout, B, dtype), vals)
        row += spec.num_nodes
    parts = _padding(layout, B, dtype) + [v.astype(dtype) for _, v in specs]
    if layout.num_rows > row:
        parts.append(jnp.zeros((layout.num_rows - row, B), dtype))
    return jnp.concatenate(parts)


def run_stages(layout, tables: dict, buf: Array, stage_fn, reverse: bool = False, scan: bool = True):
    """Apply ``stage_fn(carry, spec, tab, offset, name)`` to every stage in order (or in reverse), running
    repeated stages under ``lax.scan`` (``scan=False``: unrolled, one stage after the other with its slice
    of the stacked tables). ``carry`` is any pytree (the node buffer, or buffers plus accumulators).
    ``layout`` is anything with ``steps`` (a Layout or a partial-evaluation plan)."""
    steps = list(enumerate(zip(layout.steps, tables["steps"])))
    for si, (step, tab) in (reversed(steps) if reverse else steps):
        if isinstance(step, ScanSpec):
            period = list(enumerate(zip(step.period, range(len(step.period)))))

            def body(b, t, step=step, si=si, period=period):
                for j, (st, _) in (reversed(period) if reverse else period):
                    b = stage_fn(b, st, t[j], t[j]["out"], f"{si}.{j}")
                return b, None

            with jax.named_scope(f"jaxpc/scan{si}"):
                if scan:
                    buf, _ = lax.scan(body, buf, tab, reverse=reverse)
                else:
                    trips = range(step.repeats)
                    for i in (reversed(trips) if reverse else trips):
                        buf, _ = body(buf, jax.tree_util.tree_map(lambda a, i=i: a[i], tab))
        else:
            buf = stage_fn(buf, step, tab, step.offset, si)
    return buf


def forward_buffer(layout: Layout, tables: dict, sum_params: dict, input_vals, options,
                   evidence: dict | None = None, counts: bool = False, keep_shifts: bool = False):
    """The node buffer ``[R, B]`` from the input layers' values (plain forward, differentiable by autodiff), or
    from the buffer with the leaves written (:func:`leaf_values`, an array in place of the list). With
    ``keep_shifts``: ``(buf, shifts or None)``, the shifts of the blocks that keep them (:func:`_writes_shift`:
    ``[ceil(R / unit), B]``, see :func:`shift_unit`; None when the layout's unit is too small)."""
    dtype = param_dtype({"sum": sum_params, "v": input_vals})
    buf = input_vals if isinstance(input_vals, jax.Array) else input_buffer(layout, input_vals, dtype)
    unit = shift_unit(layout) if keep_shifts and dtype == jnp.float32 else 0
    if unit and not any(_writes_shift(options, p, buf) for spec in layout.stages() for p in spec.sums):
        unit = 0  # no kernel would write a shift (e.g. no GPU, or max-product)

    def stage(carry, spec, tab, offset, name):  # carry: the buffer, or (buffer, shifts) with a shift buffer
        b, s = carry if unit else (carry, None)
        return _stage(b, spec, tab, sum_params, options, offset, name, evidence, counts, s, unit)

    carry = (buf, jnp.zeros((-(-layout.num_rows // unit), buf.shape[1]), jnp.float32)) if unit else buf
    carry = run_stages(layout, tables, carry, stage, scan=options.scan_stages)
    if not keep_shifts:
        return carry
    return carry if unit else (carry, None)


# ---- the circuit's root value with a top-down flow pass as its VJP ---------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4, 5))
def root_values(layout: Layout, tables: dict, sum_params: dict, input_vals, options, buffered: bool = False) -> Array:
    """Root values ``[B]`` as a function of the sum log-weights and the input layers' values (or the node buffer
    with them written, ``buffered``, whose cotangent is then the whole flow buffer: meaningful at the input rows).
    Its VJP is PyJuice's backward: node flows pushed top-down layer by layer into one ``[R, B]`` buffer, with the
    parameter flows of each sum partition reduced on the way (no per-layer cotangent buffers)."""
    return forward_buffer(layout, tables, sum_params, input_vals, options)[layout.root_row]


def _root_fwd(layout, tables, sum_params, input_vals, options, buffered):
    # the barrier makes the saved buffer a materialized array: without it XLA's GPU compiler may fuse the
    # whole chain of stage writes into every backward gather (PD-128: each gather re-deriving the buffer
    # through 27 nested updates; a flows executable that did not finish compiling in 170 s, 10 s with it)
    out = forward_buffer(layout, tables, sum_params, input_vals, options, keep_shifts=options.kernel_shifts)
    buf, shifts = lax.optimization_barrier(out if options.kernel_shifts else (out, None))
    return buf[layout.root_row], (tables, sum_params, buf, shifts)


def _root_bwd(layout, options, buffered, res, g):
    tables, sum_params, values, shifts = res
    unit = shift_unit(layout) if shifts is not None else 0
    flows = flow_buffer(layout, options, values).at[layout.root_row].set(g.astype(values.dtype))
    B = values.shape[1]
    pflows = batched_pflows(layout, tables, options, B, values.dtype)
    keys = {spec.key for spec, _ in pflows}

    def batched(part) -> bool:  # its parameter flows come from the batched pass after the flow pass
        return part.blockwise and part.pflow_key in keys

    # a group whose every partition is batched gets its parameter-flow buffer after the flow pass, not carried
    inline = {p.group for spec in layout.stages() for p in spec.sums if not batched(p)}
    dparams = {k: jnp.zeros_like(v) for k, v in sum_params.items() if k in inline}

    def stage(carry, spec, tab, offset, name):
        fl, dp = carry
        row = offset
        for j, (part, t) in enumerate(zip(spec.prods, tab["prods"])):
            with jax.named_scope(f"jaxpc/stage{name}/prod{j}/backward"):
                rows, cf = product_layer_backward(fl, t["ch"], row, K=part.K)
                if layout.single_reader:  # the rows' one reader: their flows are still zero
                    fl = fl.at[rows].set(cf, unique_indices=True)
                else:
                    fl = fl.at[rows].add(cf)
            row = row + part.num_rows
        for j, (part, t) in enumerate(zip(spec.sums, tab["sums"])):
            with jax.named_scope(f"jaxpc/stage{name}/sum{j}/backward"):
                impl, cfg = kernel_choice(options, part, values.shape[1], values.dtype)
                if _pallas_backward(impl, options):
                    a = 1.0 if options.propagation == "LL" else options.alpha
                    fl, g = pallas_sum_backward(values, fl, row, t, sum_params[part.group], part, alpha=a,
                                                precision=options.concrete_precision, first_row=2 * layout.kmax,
                                                config=cfg, param_flows=options.compute_param_flows,
                                                dparams=dp[part.group])
                    if g is not None:
                        dp = {**dp, part.group: g}
                else:
                    kept = unit and _writes_shift(options, part, values)  # its shifts were kept
                    inline_pf = options.compute_param_flows and not batched(part)

                    def piece(carry, a, b, sub, part=part, row=row, kept=kept, inline_pf=inline_pf):
                        fl, dp = carry
                        m = shifts[(row + (a + jnp.arange(b - a)) * part.Kp) // unit] if kept else None
                        cf, pf = sum_layer_backward(values, fl, sub["ch"], sub["pid"], sum_params[part.group],
                                                    row + a * part.Kp, Kp=part.Kp, Kc=part.Kc, dense=part.dense,
                                                    propagation=options.propagation, alpha=options.alpha,
                                                    precision=options.concrete_precision, param_flows=inline_pf,
                                                    pflow_temperature=options.pflow_temperature,
                                                    eflow_temperature=options.eflow_temperature, shift=m)
                        fl = scatter_child_flows(fl, cf, sub["ch"], part, 2 * layout.kmax, layout.single_reader)
                        return fl, (dp if pf is None else add_param_flows(dp, part, sub["pid"], pf))

                    fl, dp = _in_pieces(pieces(part, values.shape[1], options.gather_chunk), t, piece, (fl, dp))
            row = row + part.num_rows
        return fl, dp

    flows, dparams = run_stages(layout, tables, (flows, dparams), stage, reverse=True, scan=options.scan_stages)
    for spec, tab in pflows:
        members = layout.pflow_members(spec.key)
        kept = tuple(bool(unit) and _writes_shift(options, p, values) for p in members)
        by_kernel = any(k and _inplace(kernel_choice(options, p, B, values.dtype)[0], options, values)
                        for k, p in zip(kept, members))
        with jax.named_scope(f"jaxpc/param_flows/{spec.group}_C{spec.C}"):
            dparams[spec.group] = _batched_param_flows(values, flows, dparams.get(spec.group),
                                                       sum_params[spec.group], spec, tab, options, shifts, unit,
                                                       kept, by_kernel)
    dparams = {k: dparams.get(k, jnp.zeros_like(v)) for k, v in sum_params.items()}
    if buffered:
        return None, dparams, flows
    d_inputs = [lax.dynamic_slice_in_dim(flows, spec.offset, spec.num_nodes, axis=0)
                for spec in layout.input_layers]
    return None, dparams, d_inputs


root_values.defvjp(_root_fwd, _root_bwd)


def flow_buffer(layout, options, values: Array) -> Array:
    """The flow pass's ``[R, B]`` buffer before the root's flow is written: zeros, or, in a single-reader layout
    (:attr:`Layout.flow_gaps` set) whose flow pass runs on XLA's scatters alone (``Options.tuning.unset_rows``, no
    partition on the Pallas backward, which adds in place), an :func:`uninitialized` buffer with the gaps zeroed: every
    other row but the root's is written by its one reader's backward before it is read."""
    gaps = layout.flow_gaps
    B, dtype = values.shape[1], values.dtype
    if (not options.tuning.unset_rows or gaps is None or not layout.single_reader
            or 2 * sum(b - a for a, b in gaps) > layout.num_rows
            or any(_pallas_backward(kernel_choice(options, p, B, dtype)[0], options)
                   for spec in layout.stages() for p in spec.sums)):
        return jnp.zeros_like(values)
    fl = uninitialized(values.shape, dtype, options.tuning.min_unset)
    for a, b in gaps:  # the padding rows (compiled circuits have no other gaps: one root, unpadded blocks)
        fl = lax.dynamic_update_slice_in_dim(fl, jnp.zeros((b - a, B), dtype), a, axis=0)
    return fl



def batched_pflows(layout, tables: dict, options, B: int, dtype) -> list:
    """The batched parameter-flow pass's ``(PFlowSpec, tables)`` for a flow pass at batch ``B``
    (``Options.param_flow_pass``): the sum-product partitions gathered block by block, by block shape and fan-in
    (``"auto"``: fan-in 1, tree levels, at batches up to ``Options.tuning.pflow_batch``), unless one of them runs on the
    Pallas backward (which reduces its parameter flows inside its kernels)."""
    mode = options.param_flow_pass
    if (not options.compute_param_flows or options.propagation == "MPE" or mode == "inline"
            or (mode == "auto" and B > options.tuning.pflow_batch)):
        return []
    on_pallas = {p.pflow_key for spec in layout.stages() for p in spec.sums
                 if p.blockwise and _pallas_backward(kernel_choice(options, p, B, dtype)[0], options)}
    return [(spec, tab) for spec, tab in zip(layout.pflows, tables["pflows"])
            if (mode == "batched" or spec.C == 1) and spec.key not in on_pallas]


def pflow_kernel(options, dtype) -> bool:
    """Whether the batched parameter-flow pass may run :func:`jaxpc.ops.pallas_sum.param_flows_after` (one kernel
    per block shape: the weights' product in its epilogue, nothing of the gathered children's size in memory)
    instead of XLA's gather, product and multiply, for the block shapes of which some partition kept its shifts
    in an in-place forward kernel (:func:`_writes_shift`; HCLT-256's 577 tree-level blocks at batch 16 on the
    H200: 0.24 against 0.32 ms): float32 buffers, local sums from the stored values (``precision`` below ``"fp32"``,
    untempered parameter flows), ``Options.impl`` ``"auto"`` on a GPU or ``"pallas"`` / ``"pallas_forward"``
    (interpret mode off a GPU); never with ``"xla"``."""
    if (jnp.dtype(dtype) != jnp.float32 or options.impl == "xla" or options.concrete_precision == "fp32"
            or options.pflow_temperature != 1.0 or not kernels_available()):
        return False
    return options.impl != "auto" or on_gpu()


def _batched_param_flows(values: Array, flows: Array, dp: Array | None, logw: Array, spec, tab: dict, options,
                         shifts: Array | None = None, unit: int = 0, kept: tuple = (), by_kernel: bool = False
                         ) -> Array:
    """The parameter-flow buffer ``dp`` of ``spec.group`` (None: zeros) with the flows of the blocks of ``spec``
    added (one batched product, in pieces of at most ``options.gather_chunk`` gathered elements): to one slice
    of it when their parameter ids are consecutive (``spec.start``), the whole buffer when they cover it.
    ``shifts`` (rows of ``unit``): the forward's kept shifts; ``kept``: per member partition
    (``Layout.pflow_members``), whether its blocks' are there; ``by_kernel``: some of them were kept by the
    in-place kernels. Then, where :func:`pflow_kernel` allows, one Pallas kernel for the whole table (it gathers
    nothing), which recomputes the others' (on the H200 it is faster than XLA's pass where the forward ran the
    kernels, at batches up to 32: see :func:`pflow_kernel`; at 128, where the tree levels' forward runs on XLA,
    HCLT-256's step took 3.15-3.30 ms with it against 2.92-3.10 without). XLA's pass reads the kept shifts when
    every member kept them, else recomputes them all."""
    C, Kp, Kc = spec.C, spec.Kp, spec.Kc
    kernel = shifts is not None and by_kernel and pflow_kernel(options, values.dtype)
    read = shifts is not None and all(kept) and not kernel
    spans = [(0, spec.n)] if kernel else ranges(spec.n, options.gather_chunk // max(1, C * Kc * values.shape[1]))

    def flows_of(sub):  # [n', C, Kp, Kc]
        if kernel:
            from ..ops import pallas_sum

            srow = jnp.where(jnp.asarray(kept)[sub["part"]], sub["prow"] // unit, -1)
            pf = pallas_sum.param_flows_after(values, flows, shifts, srow, sub["prow"], sub["ch"], sub["pid"], logw,
                                              Kp=Kp, Kc=Kc, precision=options.concrete_precision,
                                              alpha=1.0 if options.propagation == "LL" else options.alpha)
        else:
            pf = sum_layer_param_flows(values, flows, sub["ch"], sub["pid"], logw, sub["prow"], Kp=Kp, Kc=Kc,
                                       propagation=options.propagation, alpha=options.alpha,
                                       precision=options.concrete_precision, temperature=options.pflow_temperature,
                                       shift=shifts[sub["prow"] // unit] if read else None)
        return pf.astype(logw.dtype)

    if dp is None and spec.start == 0 and spec.n * C == logw.shape[0] and len(spans) == 1:
        return flows_of(tab).reshape(logw.shape)  # every block of the group, in order
    dp = jnp.zeros_like(logw) if dp is None else dp

    def step(acc, a, b, sub):
        pf = flows_of(sub)
        if spec.start >= 0:
            lo, hi = spec.start + a * C, spec.start + b * C
            return lax.dynamic_update_slice_in_dim(acc, acc[lo:hi] + pf.reshape(-1, Kp, Kc), lo, axis=0)
        return acc.at[sub["pid"]].add(pf, unique_indices=spec.unique)

    pieces_of = ("prow", "ch", "pid", "part")
    return in_order(spans, lambda a, b: {k: tab[k][a:b] for k in pieces_of}, step, dp)


def add_param_flows(dp: dict, part, pid: Array, pf: Array) -> dict:
    """``dp`` with the parameter flows ``pf`` (``[n, C, Kp, Kc]``) of partition ``part`` added at blocks ``pid``."""
    return {**dp, part.group: _add_flows(dp[part.group], part, pid, pf)}


def scatter_child_flows(fl: Array, cf: Array, ch: Array, part, first_row: int, overwrite: bool = False) -> Array:
    """Add the child flows of sum partition ``part`` (``[n, C*Kc, B]``, the reference backward's) into the flow
    buffer ``fl``; a folded product's flow goes to each of its row blocks, in one scatter. When every child row
    block above the padding (rows from ``first_row``) is read once in the partition (``part.D == 1``), the
    scatter runs without atomic adds, the padding rows' updates dropped. ``overwrite`` (``Layout.single_reader``:
    no other block reads these rows, so their flows are unset, see :func:`flow_buffer`; a dense partition is then
    one block) writes the flows instead of adding them, which spares reading the rows first."""
    terms = child_terms(ch)
    if len(terms) > 1:
        rows = jnp.stack([child_rows(c, part.Kc, part.dense) for c in terms])
        cf = jnp.broadcast_to(cf, (len(terms),) + cf.shape)
    else:
        rows = child_rows(terms[0], part.Kc, part.dense)
    if (part.D == 1 and not part.dense) or overwrite:
        rows = jnp.where(rows < first_row, fl.shape[0], rows)  # out of range: dropped
        if overwrite:
            return fl.at[rows].set(cf.astype(fl.dtype), mode="drop", unique_indices=True)
        return fl.at[rows].add(cf.astype(fl.dtype), mode="drop", unique_indices=True)
    return fl.at[rows].add(cf.astype(fl.dtype))


def exclusive(part) -> bool:
    """Whether a sum partition is a tree level: one child block per parent block and one parent per child
    row block. The Pallas backward then computes each parent's child flows once and writes them to every row
    block of its (folded) child (:func:`jaxpc.ops.pallas_sum.backward_exclusive`)."""
    return part.C == 1 and part.D == 1


def pallas_sum_backward(values, flows, row, t, logw, part, *, alpha, precision, first_row: int, config=None,
                        param_flows: bool = True, dparams: Array | None = None):
    """The backward kernels of one sum partition ``part`` (folded or not) whose parents sit at ``row``:
    ``(flows with the child flows added, param flows)``. A float32 flow buffer is updated in place;
    ``first_row``: the first row above the padding (``2 * kmax``). The parameter flows are ``[n, C, Kp, Kc]``
    (None without ``param_flows``), or, given ``dparams`` (the group's parameter-flow buffer), that buffer with
    them added at the partition's blocks (in place by the kernel where it can). A tree level at a batch of at
    most :data:`jaxpc.ops.pallas_sum.LEVEL_BATCH` runs as one kernel (:func:`~jaxpc.ops.pallas_sum.backward_level`)."""
    from ..ops import pallas_sum

    cfg = config or pallas_sum.KernelConfig()
    Kp, Kc = part.Kp, part.Kc
    if exclusive(part) and flows.dtype == jnp.float32 and flows.shape[1] <= pallas_sum.LEVEL_BATCH:
        inplace = param_flows and dparams is not None and part.unique_pid and dparams.dtype == jnp.float32
        fl, pf = pallas_sum.backward_level(values, flows, row, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc,
                                           first_row=first_row, alpha=alpha, precision=precision, config=cfg,
                                           param_flows=param_flows, dparams=dparams if inplace else None)
        return fl, (pf if inplace else _add_flows(dparams, part, t["pid"], pf))
    if exclusive(part) and flows.dtype == jnp.float32:
        fl, pf = pallas_sum.backward_exclusive(values, flows, row, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc,
                                               first_row=first_row, alpha=alpha, precision=precision, config=cfg,
                                               param_flows=param_flows)
        return fl, _add_flows(dparams, part, t["pid"], pf)
    a, m, pf = pallas_sum.backward_parents(values, flows, row, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc, alpha=alpha,
                                           precision=precision, config=cfg, param_flows=param_flows)
    pf = _add_flows(dparams, part, t["pid"], pf)
    args = (values, a, m, t["uch"], t["par"], t["ppid"], logw)
    kw = dict(Kp=Kp, Kc=Kc, alpha=alpha, precision=precision, config=cfg, ch=t["ch"], pcol=t.get("pcol"))
    if flows.dtype == jnp.float32:
        return pallas_sum.backward_children(*args, flows=flows, **kw), pf
    cf = pallas_sum.backward_children(*args, **kw)
    rows = (t["uch"][:, None] + jnp.arange(Kc, dtype=t["uch"].dtype)).reshape(-1)
    return flows.at[rows].add(cf.astype(flows.dtype)), pf


def _add_flows(dparams: Array | None, part, pid: Array, pf: Array | None):
    """``pf`` added into ``dparams`` at blocks ``pid`` (``pf`` itself without ``dparams``; None without ``pf``)."""
    if dparams is None or pf is None:
        return pf
    return dparams.at[pid].add(pf.astype(dparams.dtype), unique_indices=part.unique_pid)


def node_values(layout: Layout, tables: dict, params: dict, x: Array, missing: Array | None, options,
                soft: Array | None = None, evidence: dict | None = None) -> Array:
    """The whole node buffer ``[R, B]`` (plain forward)."""
    vals = input_values(layout, tables, params, x, missing, options, soft, evidence)
    return forward_buffer(layout, tables, params["sum"], vals, options, evidence)


def evaluate(layout: Layout, tables: dict, sum_params: dict, input_vals, options,
             evidence: dict | None = None, counts: bool = False) -> Array:
    """Root values from input values (:func:`leaf_values`: a list of ``[N, B]`` values, or the node buffer of
    :func:`buffer_plan` with them written where :func:`leaf_kernel` applies), differentiated by the top-down
    flow pass (``options.backward == "flows"``; chain-structured circuits, i.e. HMMs, by the forward-backward scan of
    :mod:`jaxpc.engine.chain` unless ``options.chain_scan`` is False; on the folded plan ``layout.fold``
    when ``options.fold_products``) or by JAX's autodiff through the
    forward (``"autodiff"``, the reference; also used when ``evidence`` carries per-sample sum
    parameters, whose gradients autodiff provides)."""
    buffered = isinstance(input_vals, jax.Array)  # leaf_values chose the flow pass's buffer
    if buffered and not runs_node_buffer(layout, options, evidence):
        raise ValueError("a node buffer with the leaves written (leaf_values) is evaluated by the flow pass "
                         "only: backward='flows', not as a chain, without per-sample sum parameters")
    if options.backward == "autodiff" or has_sum_externals(evidence):
        if options.pflow_temperature != 1.0 or options.eflow_temperature != 1.0:
            raise ValueError("tempered flows need backward='flows' and no per-sample sum parameters")
        if options.impl != "xla" or options.kernels:  # the in-place Pallas kernels have no autodiff rule:
            options = options.replace(impl="xla", kernels=())  # reverse mode differentiates XLA's layers
        return forward_buffer(layout, tables, sum_params, input_vals, options, evidence, counts)[layout.root_row]
    if chain.applies(layout, options, has_sum_externals(evidence)):
        with jax.named_scope("jaxpc/chain"):
            return chain.root_values(layout.chain, tables["chain"], sum_params, input_vals, options)
    plan = buffer_plan(layout, options)
    return root_values(plan, tables if plan is layout else tables["fold"], sum_params, input_vals, options, buffered)


def log_prob(layout: Layout, tables: dict, params: dict, x: Array, missing: Array | None, options,
             soft: Array | None = None, evidence: dict | None = None) -> Array:
    """Root log-value per sample, ``[B]``."""
    vals = leaf_values(layout, tables, params, x, missing, options, soft, evidence)
    return evaluate(layout, tables, params["sum"], vals, options, evidence)


def param_dtype(params) -> jnp.dtype:
    leaves = jax.tree_util.tree_leaves(params)
    floats = [a.dtype for a in leaves if jnp.issubdtype(a.dtype, jnp.floating)]
    return jnp.result_type(*floats) if floats else jnp.float32


# ---- partial evaluation -----------------------------------------------------------------------

def partial_values(layout: Layout, plan, plan_tables: dict, params: dict, x: Array, missing: Array | None,
                   values: Array, options) -> Array:
    """Re-evaluate the nodes of ``plan`` (see :mod:`jaxpc.compiler.partial`) on top of a previous node
    buffer ``values`` ``[R, B]``; returns the updated buffer."""
    xt = x.T
    mt = missing_t(missing)
    buf = values
    untuned = options.replace(kernels=())  # the tuned routes name the full plan's partitions, not these
    for pin, tab in zip(plan.inputs, plan_tables["inputs"]):
        spec = layout.input_layers[pin.layer]
        xv = xt[tab["vars"]]
        mv = None if mt is None else mt[tab["vars"]]
        v = spec.dist.log_prob(params["input"][spec.key], plan_tables["meta"][pin.layer], tab["rows"], xv, mv, options)
        buf = buf.at[tab["write"]].set(v.astype(buf.dtype))

    def stage(b, spec, tab, offset, name):
        for j, (part, t) in enumerate(zip(spec.prods, tab["prods"])):
            with jax.named_scope(f"jaxpc/partial{name}/prod{j}"):
                out = product_layer(b, t["ch"], K=part.K)
            b = b.at[(t["write"][:, None] + jnp.arange(part.K)).reshape(-1)].set(out.astype(b.dtype))
        impls = [kernel_choice(untuned, part, b.shape[1], b.dtype)[0] for part in spec.sums]
        for j, (part, t) in enumerate(zip(spec.sums, tab["sums"])):
            with jax.named_scope(f"jaxpc/partial{name}/sum{j}"):
                out = sum_layer(b, t["ch"], t["pid"], params["sum"][part.group], Kp=part.Kp, Kc=part.Kc,
                                dense=part.dense, propagation=options.propagation, alpha=options.alpha,
                                precision=options.concrete_precision, impl=impls[j])
            b = b.at[(t["write"][:, None] + jnp.arange(part.Kp)).reshape(-1)].set(out.astype(b.dtype))
        return b

    return run_stages(plan, plan_tables, buf, stage, scan=options.scan_stages)
