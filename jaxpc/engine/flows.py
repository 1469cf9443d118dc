"""The flow pass: the circuit's root values with a top-down flow pass as their VJP.

:func:`root_values` returns ``[B]`` root values; its backward is PyJuice's: node flows pushed top-down stage by
stage into one ``[R, B]`` flow buffer (:func:`flow_buffer`), each sum partition on XLA's backward in pieces or on
the Pallas backward kernels (:func:`pallas_sum_backward`), its parameter flows reduced on the way or, for the
partitions gathered block by block, after it in one batched product per block shape (:func:`batched_pflows`).
The routes come from :mod:`jaxpc.engine.routing`; the forward is :func:`jaxpc.engine.stages.forward_buffer`.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..compiler.layout import Layout, StageSpec
from ..ops import pallas_product
from ..ops.buffers import starts_unset, uninitialized
from ..ops.pieces import in_order, ranges
from ..ops.product_layer import product_layer_backward_reference as product_layer_backward
from ..ops.rows import add_rows, put_rows, take_rows
from ..ops.sum_layer import child_rows, child_terms, param_flow_factors, sum_kernels
from ..ops.sum_layer import sum_layer_backward_reference as sum_layer_backward
from ..ops.sum_layer import sum_layer_param_flows_reference as sum_layer_param_flows
from ..options import Options
from . import routing, stages

Array = jax.Array


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4, 5))
def root_values(layout: Layout, tables: dict, sum_params: dict, input_vals, options, buffered: bool = False) -> Array:
    """Root values ``[B]`` as a function of the sum log-weights and the input layers' values (or the node buffer
    with them written, ``buffered``, whose cotangent is then the whole flow buffer: meaningful at the input rows).
    Its VJP is PyJuice's backward: node flows pushed top-down layer by layer into one ``[R, B]`` buffer, with the
    parameter flows of each sum partition reduced on the way (no per-layer cotangent buffers)."""
    return stages.forward_buffer(layout, tables, sum_params, input_vals, options)[layout.root_row]


def _root_fwd(layout, tables, sum_params, input_vals, options, buffered):
    # the barrier makes the saved buffer a materialized array: without it XLA's GPU compiler may fuse the
    # whole chain of stage writes into every backward gather (PD-128: each gather re-deriving the buffer
    # through 27 nested updates; a flows executable that did not finish compiling in 170 s, 10 s with it)
    # (with the tree's levels on clusters, their sample-major copies are kept for the backward, which otherwise
    # rebuilds them from the buffer: four kernels between the forward and the backward)
    out = stages.forward_buffer(layout, tables, sum_params, input_vals, options, keep_shifts=options.kernel_shifts)
    kept = out if options.kernel_shifts else (out, None, None, None)
    kept = lax.optimization_barrier(kept)
    return kept[0][layout.root_row], (tables, sum_params, *kept)


class _Pass(NamedTuple):
    """What every stage of one flow pass reads."""

    layout: Layout
    options: Options
    sum_params: dict
    values: Array  # the forward's node buffer [R, B]
    shifts: Array | None  # the forward's kept shifts [ceil(R / unit), B], or None
    unit: int  # node-buffer rows per shift row; 0 without kept shifts
    batched: frozenset  # the PFlowSpec keys of the batched parameter-flow pass
    stored: frozenset = frozenset()  # the groups whose parameter flows are stored, not added (:func:`_stored_groups`)
    firsts: Array | None = None  # the forward's kept first maximizers [R, B] (a max-product pass)

    def batched_part(self, part) -> bool:
        """Whether a sum partition's parameter flows come from the batched pass after the flow pass."""
        return part.blockwise and part.pflow_key in self.batched

    def atomic_part(self, part) -> bool:
        """Whether a sum partition's backward is :func:`jaxpc.ops.pallas_sum.backward_atomic` (else the backward
        kernels of its route or XLA's)."""
        impl, _ = routing.kernel_choice(self.options, part, self.values.shape[1], self.values.dtype)
        return (not routing.runs_kernel_backward(impl, self.options) and bool(self.unit)
                and not self.batched_part(part) and routing.atomic_backward(self.options, part, self.values))


def _stored_groups(ps: _Pass, tree_group: str | None) -> frozenset:
    """The parameter groups whose flows the pass stores instead of adding, their accumulators starting unset
    (``Tuning.unset_rows``): untied groups (each parameter block one edge block's) whose every partition writes its
    blocks' flows once (:func:`_stores`) and some partition runs :func:`jaxpc.ops.pallas_sum.backward_atomic`
    with them in place, which then skips reading the accumulator."""
    options = ps.options
    if not (options.compute_param_flows and options.tuning.unset_rows and ps.unit):
        return frozenset()
    parts: dict = {}
    for spec in ps.layout.stages():
        for p in spec.sums:
            parts.setdefault(p.group, []).append(p)
    return frozenset(g.key for g in ps.layout.sum_groups
                     if g.untied and g.key in parts and g.key != tree_group
                     and ps.sum_params[g.key].dtype == jnp.float32
                     and all(p.unique_pid and _stores(ps, p) for p in parts[g.key])
                     and any(ps.atomic_part(p) for p in parts[g.key]))


def _stores(ps: _Pass, part) -> bool:
    """Whether a sum partition's parameter flows reach the accumulator by a write per block: the atomic backward's
    in place, XLA's backward's inline scatter or the batched pass's (not the backward kernels' accumulation)."""
    if ps.batched_part(part):
        return any(spec.key == part.pflow_key and spec.unique for spec in ps.layout.pflows)
    impl, _ = routing.kernel_choice(ps.options, part, ps.values.shape[1], ps.values.dtype)
    return not routing.runs_kernel_backward(impl, ps.options)


def _root_bwd(layout, options, buffered, res, g):
    tables, sum_params, values, shifts, copies, firsts = res
    unit = routing.shift_unit(layout) if shifts is not None else 0
    flows = flow_buffer(layout, options, values).at[layout.root_row].set(g.astype(values.dtype))
    pflows = batched_pflows(layout, tables, options, values.shape[1], values.dtype)
    common = (layout, options, sum_params, values, shifts, unit, frozenset(spec.key for spec, _ in pflows))
    kind = routing.tree_kernel(layout, options, values.shape[1], values.dtype)
    tree = layout.tree if kind else None
    in_place = tree is not None and kind != "mosaic"  # the tree's kernel adds its parameter flows in place
    ps = _Pass(*common, _stored_groups(_Pass(*common), tree.group if in_place else None), firsts)
    # a group whose every partition is batched gets its parameter-flow buffer after the flow pass, not carried
    inline = {p.group for spec in layout.stages() for p in spec.sums if not ps.batched_part(p)}
    dparams = {k: (uninitialized(v.shape, v.dtype, options.tuning.min_unset) if k in ps.stored else jnp.zeros_like(v))
               for k, v in sum_params.items() if k in inline}

    def stage(carry, spec, tab, offset, name):
        return _stage_flows(ps, carry, spec, tab, offset, name)

    start, stop = stages.tree_span(layout, tree)
    flows, dparams = stages.run_stages(layout, tables, (flows, dparams), stage, reverse=True,
                                       scan=options.scan_stages, span=(stop, len(layout.steps)))
    if kind == "mosaic":  # element flows only: the tree's parameter flows come from the batched pass
        from ..ops import mosaic_tree

        with jax.named_scope("jaxpc/tree/clusters/backward"):
            tabs = tables["tree"]["clusters"]
            kept = copies if copies is not None else mosaic_tree.copies(values, tabs, tree)
            btabs, tile, ratios = routing.cluster_backward(options, tabs, tree, values.shape[1])
            wt = stages.kept_weights(tables, "wt", lambda: mosaic_tree.tf32_weights_t(sum_params[tree.group]))
            flows = mosaic_tree.backward(flows, kept, btabs, wt, tree, tile=tile, interpret=not routing.on_gpu(),
                                         ratios=ratios)
    elif tree is not None:
        with jax.named_scope("jaxpc/tree/backward"):
            dp_in = dparams[tree.group] if options.compute_param_flows else None
            flows, dp = routing.tree_module(kind).backward(values, flows, dp_in, tables["tree"], sum_params[tree.group],
                                                           tree, options.concrete_precision, 2 * layout.kmax,
                                                           layout.single_reader)
        if dp is not None:
            dparams = {**dparams, tree.group: dp}
    flows, dparams = stages.run_stages(layout, tables, (flows, dparams), stage, reverse=True,
                                       scan=options.scan_stages, span=(0, start))
    dparams = _after_pass(ps, pflows, flows, dparams)
    dparams = {k: dparams.get(k, jnp.zeros_like(v)) for k, v in sum_params.items()}
    if buffered:
        return None, dparams, flows
    d_inputs = [lax.dynamic_slice_in_dim(flows, spec.offset, spec.num_nodes, axis=0)
                for spec in layout.input_layers]
    return None, dparams, d_inputs


root_values.defvjp(_root_fwd, _root_bwd)


def _stage_flows(ps: _Pass, carry: tuple, spec: StageSpec, tab: dict, offset, name) -> tuple:
    """``(flows, dparams)`` with the flows of one stage's nodes pushed to their children's rows and its sum
    partitions' inline parameter flows added."""
    fl, dp = carry
    row = offset
    kernels = bool(spec.prods) and routing.product_kernels(ps.options, fl)
    for j, (part, t) in enumerate(zip(spec.prods, tab["prods"])):
        with jax.named_scope(f"jaxpc/stage{name}/prod{j}/backward"):
            if kernels:
                fl = pallas_product.backward(fl, t["ch"], row, K=part.K, first_row=2 * ps.layout.kmax)
            else:
                rows, cf = product_layer_backward(fl, t["ch"], row, K=part.K)
                if ps.layout.single_reader:  # the rows' one reader: their flows are still zero
                    fl = put_rows(fl, rows, cf, unique_indices=True)
                else:
                    fl = add_rows(fl, rows, cf)
        row = row + part.num_rows
    for j, (part, t) in enumerate(zip(spec.sums, tab["sums"])):
        with jax.named_scope(f"jaxpc/stage{name}/sum{j}/backward"):
            impl, cfg = routing.kernel_choice(ps.options, part, ps.values.shape[1], ps.values.dtype)
            if routing.runs_kernel_backward(impl, ps.options):
                fl, dp = _sum_flows_kernels(ps, fl, dp, part, t, row, impl, cfg)
            elif ps.atomic_part(part):
                fl, dp = _sum_flows_atomic(ps, fl, dp, part, t, row, cfg)
            else:
                fl, dp = _sum_flows_xla(ps, fl, dp, part, t, row)
        row = row + part.num_rows
    return fl, dp


def _sum_flows_kernels(ps: _Pass, fl: Array, dp: dict, part, t: dict, row, impl: str, cfg) -> tuple:
    """A sum partition's child flows and parameter flows by the backward kernels of ``impl`` (Pallas's or
    jax-triton's)."""
    options = ps.options
    a = 1.0 if options.propagation == "LL" else options.alpha
    pflows = options.compute_param_flows and not ps.batched_part(part)  # else the batched pass computes them
    fl, g = pallas_sum_backward(ps.values, fl, row, t, ps.sum_params[part.group], part, alpha=a,
                                precision=options.concrete_precision, first_row=2 * ps.layout.kmax, config=cfg,
                                param_flows=pflows, dparams=dp[part.group] if pflows else None, impl=impl)
    if g is not None:
        dp = {**dp, part.group: g}
    return fl, dp


def _sum_flows_atomic(ps: _Pass, fl: Array, dp: dict, part, t: dict, row, cfg=None) -> tuple:
    """A sum partition's child flows and parameter flows by one Pallas kernel reading the forward's kept shifts
    (:func:`jaxpc.ops.pallas_sum.backward_atomic`; route: :func:`jaxpc.engine.routing.atomic_backward`), with the
    partition's tuned kernel configuration ``cfg`` where ``Options.kernels`` gives one."""
    from ..ops import pallas_sum

    options = ps.options
    ch, pid, eorder, extent = routing.kernel_tables(t, part, "pallas")
    # parameter flows added into the group's in place where no two of the partition's edge blocks share a block
    g = dp.get(part.group) if options.compute_param_flows and part.unique_pid else None
    into = g if g is not None and g.dtype == jnp.float32 else None
    ordered = routing.child_order(options, ps.values)
    group = math.gcd(routing.fanin_group(options, part, ps.values), ch.shape[1])  # (padded tables: both fan-ins)
    cfg = cfg or pallas_sum.KernelConfig(num_stages=options.tuning.fanin_backward_stages)
    fl, pf = pallas_sum.backward_atomic(ps.values, fl, ps.shifts, row, ch, pid, ps.sum_params[part.group],
                                        Kp=part.Kp, Kc=part.Kc, unit=ps.unit, first_row=2 * ps.layout.kmax,
                                        alpha=1.0 if options.propagation == "LL" else options.alpha,
                                        precision=options.concrete_precision, config=cfg,
                                        order=eorder if ordered else None,
                                        prefetch=options.tuning.fanin_prefetch and group == 1, group=group,
                                        dparams=into, overwrite=part.group in ps.stored, **extent)
    if into is not None:
        return fl, {**dp, part.group: pf}
    return fl, (add_param_flows(dp, part, t["pid"], pf) if options.compute_param_flows else dp)


def _sum_flows_xla(ps: _Pass, fl: Array, dp: dict, part, t: dict, row) -> tuple:
    """A sum partition's child flows by XLA's backward, in pieces, reading the forward's kept shifts where it kept
    them; its parameter flows inline unless the batched pass computes them."""
    options, values, unit = ps.options, ps.values, ps.unit
    kept = unit and routing.writes_shift(options, part, values)  # its shifts were kept
    kept_first = ps.firsts is not None  # (a max-product pass: every partition's forward kept them)
    inline_pf = options.compute_param_flows and not ps.batched_part(part)

    def piece(carry, a, b, sub):
        fl, dp = carry
        m = take_rows(ps.shifts, (row + (a + jnp.arange(b - a)) * part.Kp) // unit) if kept else None
        first = None
        if kept_first:
            first = lax.dynamic_slice_in_dim(ps.firsts, row + a * part.Kp, (b - a) * part.Kp, axis=0)
            first = first.reshape(b - a, part.Kp, values.shape[1])
        cf, pf = sum_layer_backward(values, fl, sub["ch"], sub["pid"], ps.sum_params[part.group],
                                    row + a * part.Kp, Kp=part.Kp, Kc=part.Kc, dense=part.dense,
                                    propagation=options.propagation, alpha=options.alpha,
                                    precision=options.concrete_precision, param_flows=inline_pf,
                                    pflow_temperature=options.pflow_temperature,
                                    eflow_temperature=options.eflow_temperature, shift=m, first=first)
        fl = scatter_child_flows(fl, cf, sub["ch"], part, 2 * ps.layout.kmax, ps.layout.single_reader)
        return fl, (dp if pf is None else add_param_flows(dp, part, sub["pid"], pf, store=part.group in ps.stored))

    return stages.in_pieces(routing.pieces(part, values.shape[1], options.gather_chunk), t, piece, (fl, dp))


def _after_pass(ps: _Pass, pflows: list, flows: Array, dparams: dict) -> dict:
    """``dparams`` with the batched parameter-flow pass's groups (:func:`batched_pflows`) computed from the
    finished flow buffer, reading the forward's kept shifts where every member partition kept them."""
    options, values = ps.options, ps.values
    B, dtype = values.shape[1], values.dtype
    for spec, tab in pflows:
        members = ps.layout.pflow_members(spec.key)
        kept = tuple(bool(ps.unit) and routing.writes_shift(options, p, values) for p in members)
        by_kernel = any(k and routing.runs_inplace(routing.kernel_choice(options, p, B, dtype)[0], options, values)
                        for k, p in zip(kept, members))
        logw = ps.sum_params[spec.group]
        with jax.named_scope(f"jaxpc/param_flows/{spec.group}_C{spec.C}"):
            dparams[spec.group] = _batched_param_flows(values, flows, dparams.get(spec.group), logw, spec, tab,
                                                       options, ps.shifts, ps.unit, kept, by_kernel,
                                                       store=spec.group in ps.stored)
    return dparams


def flow_buffer(layout, options, values: Array) -> Array:
    """The flow pass's ``[R, B]`` buffer before the root's flow is written: zeros, or, in a single-reader layout
    (:attr:`Layout.flow_gaps` set) whose flow pass runs on XLA's scatters alone (``Options.tuning.unset_rows``; the
    Pallas backwards and product kernels add in place), an :func:`uninitialized` buffer with the gaps zeroed: every
    other row but the root's is written by its one reader's backward before it is read. Zeros also where the unset
    buffer would start as zeros anyway (on a GPU, below ``Options.tuning.min_unset`` elements)."""
    gaps = layout.flow_gaps
    B, dtype = values.shape[1], values.dtype
    if (not options.tuning.unset_rows or gaps is None or not layout.single_reader
            or 2 * sum(b - a for a, b in gaps) > layout.num_rows
            or any(routing.runs_kernel_backward(routing.kernel_choice(options, p, B, dtype)[0], options)
                   or routing.atomic_backward(options, p, values) for spec in layout.stages() for p in spec.sums)
            or (routing.product_kernels(options, values) and any(spec.prods for spec in layout.stages()))
            or not starts_unset(values.shape, options.tuning.min_unset)):
        return jnp.zeros_like(values)
    # one scatter zeroes every gap (a slice update per gap is a kernel each: 28 in HCLT-256's folded plan)
    rows = np.concatenate([np.arange(a, b, dtype=np.int32) for a, b in gaps])
    return put_rows(uninitialized(values.shape, dtype, options.tuning.min_unset), rows, jnp.zeros((), dtype),
                    unique_indices=True, indices_are_sorted=True, mode="promise_in_bounds")


# ---- parameter flows ------------------------------------------------------------------------------------

def batched_pflows(layout, tables: dict, options, B: int, dtype) -> list:
    """The batched parameter-flow pass's ``(PFlowSpec, tables)`` for a flow pass at batch ``B``
    (``Options.param_flow_pass``): the sum-product partitions gathered block by block, by block shape and fan-in
    (``"auto"``: fan-in 1, tree levels, at batches up to ``Options.tuning.pflow_batch``), unless one of them runs on the
    Pallas backward or on the tree's persistent kernel (:func:`jaxpc.engine.routing.tree_kernel`), which reduce their
    parameter flows inside their kernels."""
    mode = options.param_flow_pass
    if (not options.compute_param_flows or options.propagation == "MPE" or mode == "inline"
            or (mode == "auto" and B > options.tuning.pflow_batch)):
        return []
    on_pallas = {p.pflow_key for spec in layout.stages() for p in spec.sums
                 if p.blockwise and routing.runs_kernel_backward(routing.kernel_choice(options, p, B, dtype)[0],
                                                                 options)}
    tree_key = None if layout.tree is None else layout.tree.pflow_key
    kind = routing.tree_kernel(layout, options, B, dtype)
    if kind == "mosaic":  # the clusters' kernels leave the tree's parameter flows to this pass
        on_pallas.discard(tree_key)
    elif kind:  # the tree's kernel adds its levels' flows in place
        on_pallas.add(tree_key)
    return [(spec, tab) for spec, tab in zip(layout.pflows, tables["pflows"])
            if (mode == "batched" or spec.C == 1) and spec.key not in on_pallas]


def _batched_param_flows(values: Array, flows: Array, dp: Array | None, logw: Array, spec, tab: dict, options,
                         shifts: Array | None = None, unit: int = 0, kept: tuple = (), by_kernel: bool = False,
                         store: bool = False) -> Array:
    """The parameter-flow buffer ``dp`` of ``spec.group`` (None: zeros) with the flows of the blocks of ``spec``
    added (one batched product, in pieces of at most ``options.gather_chunk`` gathered elements): to one slice
    of it when their parameter ids are consecutive (``spec.start``), the whole buffer when they cover it.
    ``shifts`` (rows of ``unit``): the forward's kept shifts; ``kept``: per member partition
    (``Layout.pflow_members``), whether its blocks' are there; ``by_kernel``: some of them were kept by the
    in-place kernels. ``store`` (blocks of ``spec.unique`` that no other edge block of the pass writes, ``dp``
    possibly unset): the flows are written, not added. Then, where :func:`jaxpc.engine.routing.pflow_kernel`
    allows, one Pallas kernel for the whole table (it gathers nothing), which recomputes the others' (on the H200 it
    is faster than XLA's pass where the forward ran the kernels, at batches up to 32: see
    :func:`jaxpc.engine.routing.pflow_kernel`; at 128, where the tree levels' forward runs on XLA, HCLT-256's step
    took 3.15-3.30 ms with it against 2.92-3.10 without). Elsewhere, where
    :func:`jaxpc.engine.routing.summed_pflow_kernel` allows, XLA gathers each piece's factors and
    :func:`jaxpc.ops.mosaic_tree.summed_param_flows` takes their product and the weights' multiplication in one
    kernel (reading the log-weights itself: the gathered weights go unused). XLA's
    pass reads the kept shifts when every member kept them, else recomputes them all."""
    C, Kp, Kc = spec.C, spec.Kp, spec.Kc
    kernel = shifts is not None and by_kernel and routing.pflow_kernel(options, values.dtype)
    read = shifts is not None and all(kept) and not kernel
    B = values.shape[1]
    by_sum_kernel = not kernel and routing.summed_pflow_kernel(options, spec, B)
    spans = [(0, spec.n)] if kernel else ranges(spec.n, options.gather_chunk // max(1, C * Kc * B))

    def flows_of(sub, a=0):  # [n', C, Kp, Kc]; ``a``: the first block's index in ``spec``
        if by_sum_kernel:
            from ..ops import mosaic_tree

            _, y, scale = param_flow_factors(values, flows, sub["ch"], sub["pid"], logw, sub["prow"], Kp=Kp, Kc=Kc,
                                             precision=options.concrete_precision,
                                             shift=take_rows(shifts, sub["prow"] // unit) if read else None)
            pf = mosaic_tree.summed_param_flows(scale, y, logw, spec.start + a, interpret=not routing.on_gpu())
            return pf[:, None].astype(logw.dtype)
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
                                       shift=take_rows(shifts, sub["prow"] // unit) if read else None)
        return pf.astype(logw.dtype)

    if dp is None and spec.start == 0 and spec.n * C == logw.shape[0] and len(spans) == 1:
        return flows_of(tab).reshape(logw.shape)  # every block of the group, in order
    dp = jnp.zeros_like(logw) if dp is None else dp

    def step(acc, a, b, sub):
        pf = flows_of(sub, a)
        if spec.start >= 0:
            lo, hi = spec.start + a * C, spec.start + b * C
            new = pf.reshape(-1, Kp, Kc) if store else acc[lo:hi] + pf.reshape(-1, Kp, Kc)
            return lax.dynamic_update_slice_in_dim(acc, new, lo, axis=0)
        if store:
            return put_rows(acc, sub["pid"], pf, unique_indices=True)
        return add_rows(acc, sub["pid"], pf, unique_indices=spec.unique)

    pieces_of = ("prow", "ch", "pid", "part")
    return in_order(spans, lambda a, b: {k: tab[k][a:b] for k in pieces_of}, step, dp)


def add_param_flows(dp: dict, part, pid: Array, pf: Array, store: bool = False) -> dict:
    """``dp`` with the parameter flows ``pf`` (``[n, C, Kp, Kc]``) of partition ``part`` added at blocks ``pid``
    (``store``: written there, blocks that no other edge block of the pass writes)."""
    if store:
        return {**dp, part.group: put_rows(dp[part.group], pid, pf.astype(dp[part.group].dtype), unique_indices=True)}
    return {**dp, part.group: _add_flows(dp[part.group], part, pid, pf)}


def _add_flows(dparams: Array | None, part, pid: Array, pf: Array | None):
    """``pf`` added into ``dparams`` at blocks ``pid`` (``pf`` itself without ``dparams``; None without ``pf``)."""
    if dparams is None or pf is None:
        return pf
    return add_rows(dparams, pid, pf.astype(dparams.dtype), unique_indices=part.unique_pid)


# ---- child flows ------------------------------------------------------------------------------------------

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
            return put_rows(fl, rows, cf.astype(fl.dtype), mode="drop", unique_indices=True)
        return add_rows(fl, rows, cf.astype(fl.dtype), mode="drop", unique_indices=True)
    return add_rows(fl, rows, cf.astype(fl.dtype))


def pallas_sum_backward(values, flows, row, t, logw, part, *, alpha, precision, first_row: int, config=None,
                        param_flows: bool = True, dparams: Array | None = None, impl: str = "pallas"):
    """The backward kernels of one sum partition ``part`` (folded or not) whose parents sit at ``row``:
    ``(flows with the child flows added, param flows)``. A float32 flow buffer is updated in place;
    ``first_row``: the first row above the padding (``2 * kmax``). The parameter flows are ``[n, C, Kp, Kc]``
    (None without ``param_flows``), or, given ``dparams`` (the group's parameter-flow buffer), that buffer with
    them added at the partition's blocks (in place by the kernel where it can). A tree level at a batch of at
    most :data:`jaxpc.ops.pallas_sum.LEVEL_BATCH` runs as one kernel (:func:`~jaxpc.ops.pallas_sum.backward_level`).
    ``impl``: the kernels' module (:func:`jaxpc.ops.sum_layer.sum_kernels`: Pallas's, or jax-triton's for
    ``"triton"``, which has the same functions)."""
    kernels = sum_kernels(impl)
    cfg = config or kernels.KernelConfig()
    Kp, Kc = part.Kp, part.Kc
    if routing.exclusive(part) and flows.dtype == jnp.float32 and flows.shape[1] <= kernels.LEVEL_BATCH:
        inplace = param_flows and dparams is not None and part.unique_pid and dparams.dtype == jnp.float32
        fl, pf = kernels.backward_level(values, flows, row, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc,
                                        first_row=first_row, alpha=alpha, precision=precision, config=cfg,
                                        param_flows=param_flows, dparams=dparams if inplace else None)
        return fl, (pf if inplace else _add_flows(dparams, part, t["pid"], pf))
    if routing.exclusive(part) and flows.dtype == jnp.float32:
        fl, pf = kernels.backward_exclusive(values, flows, row, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc,
                                            first_row=first_row, alpha=alpha, precision=precision, config=cfg,
                                            param_flows=param_flows)
        return fl, _add_flows(dparams, part, t["pid"], pf)
    return _parents_then_children(kernels, values, flows, row, t, logw, part, cfg, alpha=alpha,
                                  precision=precision, param_flows=param_flows, dparams=dparams)


def _parents_then_children(kernels, values, flows, row, t, logw, part, cfg, *, alpha, precision, param_flows,
                           dparams):
    """The parent-side kernels, then the child-side one (through the inverse tables) of module ``kernels``."""
    Kp, Kc = part.Kp, part.Kc
    a, m, pf = kernels.backward_parents(values, flows, row, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc, alpha=alpha,
                                        precision=precision, config=cfg, param_flows=param_flows)
    pf = _add_flows(dparams, part, t["pid"], pf)
    args = (values, a, m, t["uch"], t["par"], t["ppid"], logw)
    kw = dict(Kp=Kp, Kc=Kc, alpha=alpha, precision=precision, config=cfg, ch=t["ch"], pcol=t.get("pcol"))
    if flows.dtype == jnp.float32:
        return kernels.backward_children(*args, flows=flows, **kw), pf
    cf = kernels.backward_children(*args, **kw)
    rows = (t["uch"][:, None] + jnp.arange(Kc, dtype=t["uch"].dtype)).reshape(-1)
    return add_rows(flows, rows, cf.astype(flows.dtype)), pf
