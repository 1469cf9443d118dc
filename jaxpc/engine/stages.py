"""The forward pass over the node buffer ``[R, B]``, stage by stage.

The buffer before the first stage (padding rows, the input layers' values), one stage's rows (products; sums on
XLA in pieces, on external per-sample parameters, or as in-place Pallas kernels, which may keep their blocks'
shifts for the flow pass) and the loop over the stages (:func:`run_stages`), which the flow pass, selection and
partial evaluation run too. The routes come from :mod:`jaxpc.engine.routing`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..compiler.layout import Layout, ScanSpec, StageSpec
from ..ops import pallas_product, product_layer, sum_layer
from ..ops import tables as table_places
from ..ops.buffers import uninitialized
from ..ops.pieces import in_order
from ..ops.rows import put_rows
from ..ops.sum_layer import sum_kernels, sum_layer_reference
from ..ops.sum_layer_external import sum_layer_external_reference
from . import routing

Array = jax.Array


# ---- the buffer before the first stage --------------------------------------------------------------

def _padding(layout: Layout, B: int, dtype) -> list:
    """The buffer's first ``2 * kmax`` rows: ``kmax`` zero rows, then ``kmax`` rows of ``-inf``."""
    return [jnp.zeros((layout.kmax, B), dtype), jnp.full((layout.kmax, B), -jnp.inf, dtype)]


def empty_buffer(layout: Layout, B: int, dtype) -> Array:
    """``[R, B]`` zeros with the ``-inf`` padding rows set."""
    return jnp.concatenate(_padding(layout, B, dtype) + [jnp.zeros((layout.num_rows - 2 * layout.kmax, B), dtype)])


def write_inputs(layout: Layout, buf: Array, vals: list) -> Array:
    """``buf`` with the input layers' values ``vals`` (``[N, B]`` each) written at their rows."""
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


# ---- one stage ----------------------------------------------------------------------------------------

def in_pieces(spans, tab: dict, step, carry):
    """``carry = step(carry, a, b, tables of blocks [a, b))`` over ``spans``, one piece after the other
    (:func:`jaxpc.ops.pieces.in_order`: a piece's gather cannot start before the previous piece is done)."""
    return in_order(spans, lambda a, b: {k: tab[k][a:b] for k in ("ch", "pid")}, step, carry)


def _product_rows(buf: Array, spec: StageSpec, tab: dict, offset, index,
                  in_place: bool) -> tuple[Array, list, object]:
    """``(buf, [(row, values)] of the stage's product partitions, the first row above them)``: with ``in_place``
    the products are written into ``buf`` by the kernels of :mod:`jaxpc.ops.pallas_product` and the list is empty."""
    outs, row = [], offset
    for j, (part, t) in enumerate(zip(spec.prods, tab["prods"])):
        with jax.named_scope(f"jaxpc/stage{index}/prod{j}"):
            if in_place:
                buf = pallas_product.forward(buf, t["ch"], row, K=part.K)
            else:
                outs.append((row, product_layer(buf, t["ch"], K=part.K)))
        row = row + part.num_rows
    return buf, outs, row


def _slot_gates(gates, part, t: dict) -> Array | None:
    """``[n, C, Kp, B]`` log-gates of each slot's parent rows of a sum partition, or None when it runs ungated:
    ``gates`` is ``evidence["sum_gates"]``, the gate columns ``[B, G]`` (read through the partition's ``gid``
    table; column ``G`` is a zero log-gate) or ``{group: [B, P]}``, one log-gate per parameter block."""
    if gates is None:
        return None
    if isinstance(gates, dict):
        g = gates.get(part.group)
        if g is None:
            return None
        g = jnp.transpose(g[:, t["pid"]], (1, 2, 0))[:, :, None, :]  # [n, C, 1, B]
        return jnp.broadcast_to(g, g.shape[:2] + (part.Kp,) + g.shape[3:])
    if not part.gated:
        return None
    cols = jnp.concatenate([gates, jnp.zeros((gates.shape[0], 1), gates.dtype)], axis=1)
    return jnp.transpose(cols[:, t["gid"]], (1, 2, 3, 0))


def _external_sum(buf: Array, part, t: dict, logw: Array, options, gates, lowrank, counts: bool, pad_row):
    """A sum partition's values on per-sample parameters (``sum_gates`` / ``sum_lowrank`` evidence; ``gates``:
    :func:`_slot_gates`)."""
    if options.propagation != "LL":
        raise ValueError("external sum parameters (sum_gates / sum_lowrank) support propagation='LL'")
    return sum_layer_external_reference(buf, t["ch"], t["pid"], logw, Kp=part.Kp, Kc=part.Kc, dense=part.dense,
                                        gates=gates, lowrank=lowrank, counts=counts,
                                        precision=options.concrete_precision, pad_row=pad_row)


def _xla_sum(buf: Array, part, t: dict, logw: Array, options, impl: str, cfg, row, shifts: Array | None, unit: int,
             firsts: Array | None = None):
    """``(values [n * Kp, B], shifts, firsts)`` of a sum partition that does not write the buffer in place, in
    pieces (:func:`jaxpc.engine.routing.pieces`); where :func:`jaxpc.engine.routing.writes_shift` holds, XLA's
    shifts (one per block) are kept for the flow pass, written into ``shifts`` at rows of ``unit``; a max-product
    partition given ``firsts`` (int32 ``[R, B]``) writes its parents' first maximizing children at its rows."""
    keep = shifts is not None and routing.writes_shift(options, part, buf)
    kept_first = firsts is not None

    def piece(done, a, b, sub):
        kw = dict(Kp=part.Kp, Kc=part.Kc, dense=part.dense, propagation=options.propagation,
                  alpha=options.alpha, precision=options.concrete_precision)
        if keep or kept_first:
            return done + [sum_layer_reference(buf, sub["ch"], sub["pid"], logw, with_shift=keep,
                                               with_first=kept_first, **kw)]
        return done + [(sum_layer(buf, sub["ch"], sub["pid"], logw, impl=impl, config=cfg, **kw), None)]

    done = in_pieces(routing.pieces(part, buf.shape[1], options.gather_chunk), t, piece, [])
    out, m = (d[0] if len(d) == 1 or d[0] is None else jnp.concatenate(d, axis=0) for d in zip(*done))
    if keep:
        shifts = put_rows(shifts, (row + jnp.arange(part.n) * part.Kp) // unit, m, unique_indices=True)
    if kept_first:
        firsts = lax.dynamic_update_slice_in_dim(firsts, m, row, axis=0)
    return out, shifts, firsts


def _sum_rows(buf: Array, spec: StageSpec, tab: dict, sum_params: dict, options, row, index, evidence: dict | None,
              counts: bool, shifts: Array | None, unit: int, pad_row: int | None, firsts: Array | None = None):
    """``(outs, inplace, shifts, firsts)`` for the stage's sum partitions, from ``row`` on: ``outs`` the ``(row,
    values)`` that updates write, ``inplace`` the ``(row, index, part, tables, config)`` that the in-place kernels
    write. ``pad_row``: the row that padded slots read (``Layout.ninf_row``)."""
    outs, inplace = [], []
    evidence = evidence or {}
    lowrank = evidence.get("sum_lowrank") or {}
    for j, (part, t) in enumerate(zip(spec.sums, tab["sums"])):
        with jax.named_scope(f"jaxpc/stage{index}/sum{j}"):
            logw = sum_params[part.group]
            gates = _slot_gates(evidence.get("sum_gates"), part, t)
            if gates is not None or part.group in lowrank:
                outs.append((row, _external_sum(buf, part, t, logw, options, gates, lowrank.get(part.group), counts,
                                                pad_row)))
            else:
                impl, cfg = routing.kernel_choice(options, part, buf.shape[1], buf.dtype)
                if routing.runs_inplace(impl, options, buf):
                    inplace.append((row, j, part, t, impl, cfg))
                else:
                    out, shifts, firsts = _xla_sum(buf, part, t, logw, options, impl, cfg, row, shifts, unit, firsts)
                    outs.append((row, out))
        row = row + part.num_rows
    return outs, inplace, shifts, firsts


def _inplace_sums(buf: Array, inplace: list, sum_params: dict, options, index, shifts: Array | None, unit: int,
                  packed=None, firsts: Array | None = None):
    """``(buf, shifts, firsts)`` with the in-place kernels' partitions written (and their shifts where
    :func:`jaxpc.engine.routing.writes_shift` holds, their first maximizers into ``firsts`` where given: the
    max-plus kernels). A stage's partitions read lower rows only: the order of
    the kernels does not matter. ``packed``: the executable's packed table arrays, from which the Pallas kernels
    read their tables where they lie whole in one (:func:`jaxpc.engine.routing.kernel_source`)."""
    for r, j, part, t, impl, cfg in inplace:
        kernels = sum_kernels(impl)
        with jax.named_scope(f"jaxpc/stage{index}/sum{j}"):
            a = options.alpha if options.propagation == "GeneralLL" else 1.0
            ch, pid, _, extent = routing.kernel_tables(t, part, impl)
            source = routing.kernel_source(t, impl, packed)
            # tiles from the (class-padded) table's block count: a class's partitions share one kernel
            config = routing.fanin_forward_config(options, part, buf.shape[1], impl,
                                                  kernels.forward_config(ch.shape[0], part.Kp, buf.shape[1], cfg),
                                                  tuned=cfg is not None)
            # (max-product layers run in place on Pallas's kernel only: jax-triton's takes no propagation)
            kw = dict(Kp=part.Kp, Kc=part.Kc, alpha=a, precision=options.concrete_precision, config=config,
                      out_offset=r, **extent, **({"source": source} if source is not None else {}),
                      **({"propagation": "MPE"} if options.propagation == "MPE" else {}))
            if shifts is not None and routing.writes_shift(options, part, buf):
                buf, shifts = kernels.forward(buf, ch, pid, sum_params[part.group], shifts=shifts, unit=unit, **kw)
            elif firsts is not None:
                buf, firsts = kernels.forward(buf, ch, pid, sum_params[part.group], firsts=firsts, **kw)
            else:
                buf = kernels.forward(buf, ch, pid, sum_params[part.group], **kw)
    return buf, shifts, firsts


def _stage(buf: Array, spec: StageSpec, tab: dict, sum_params: dict, options, offset, index,
           evidence: dict | None = None, counts: bool = False, shifts: Array | None = None, unit: int = 0,
           pad_row: int | None = None, firsts: Array | None = None):
    """The node buffer with one stage's rows written; ``(buf, shifts)`` when given ``shifts``, into which the
    partitions that keep them (the in-place kernels and XLA's) also write their blocks' shifts (rows of
    ``unit``, see :func:`jaxpc.engine.routing.shift_unit`); ``(buf, firsts)`` when given ``firsts``, into which
    XLA's max-product partitions write their first maximizers. ``pad_row``: ``Layout.ninf_row``."""
    buf, outs, row = _product_rows(buf, spec, tab, offset, index,
                                   bool(spec.prods) and routing.product_kernels(options, buf))
    sums, inplace, shifts, firsts = _sum_rows(buf, spec, tab, sum_params, options, row, index, evidence, counts,
                                              shifts, unit, pad_row, firsts)
    outs += sums
    if outs and not inplace:  # one write for the stage's rows from the first out on (contiguous)
        out = outs[0][1] if len(outs) == 1 else jnp.concatenate([o for _, o in outs], axis=0)
        buf = lax.dynamic_update_slice_in_dim(buf, out.astype(buf.dtype), outs[0][0], axis=0)
    else:
        for r, out in outs:
            buf = lax.dynamic_update_slice_in_dim(buf, out.astype(buf.dtype), r, axis=0)
        if inplace:
            buf, shifts, firsts = _inplace_sums(buf, inplace, sum_params, options, index, shifts, unit,
                                                tab.get("packed"), firsts)
    if firsts is not None:
        return buf, firsts
    return buf if shifts is None else (buf, shifts)


# ---- every stage ----------------------------------------------------------------------------------------

def run_stages(layout, tables: dict, buf: Array, stage_fn, reverse: bool = False, scan: bool = True,
               span: tuple[int, int] | None = None):
    """Apply ``stage_fn(carry, spec, tab, offset, name)`` to every stage in order (or in reverse), running
    repeated stages under ``lax.scan`` (``scan=False``: unrolled, one stage after the other with its slice
    of the stacked tables). ``carry`` is any pytree (the node buffer, or buffers plus accumulators).
    ``layout`` is anything with ``steps`` (a Layout or a partial-evaluation plan); ``span``: only steps
    ``[start, stop)``. Unrolled, a repeated stage's first row is a constant (``ScanSpec.offsets``): XLA slices and
    updates the buffers at static rows, and the in-place kernels' row operands are constants, not a kernel each."""
    steps = list(enumerate(zip(layout.steps, tables["steps"])))
    packed = tables.get("packed") if isinstance(tables, dict) else None
    if span is not None:
        steps = steps[span[0]:span[1]]
    for si, (step, tab) in (reversed(steps) if reverse else steps):
        if isinstance(step, ScanSpec):
            period = list(enumerate(zip(step.period, range(len(step.period)))))

            def body(b, t, step=step, si=si, period=period, offsets=None):
                for j, (st, _) in (reversed(period) if reverse else period):
                    tj = t[j] if offsets is None else _with_packed(t[j], packed)
                    b = stage_fn(b, st, tj, t[j]["out"] if offsets is None else offsets[j], f"{si}.{j}")
                return b, None

            with jax.named_scope(f"jaxpc/scan{si}"):
                if scan:
                    buf, _ = lax.scan(body, buf, tab, reverse=reverse)
                else:
                    trips = range(step.repeats)
                    for i in (reversed(trips) if reverse else trips):
                        buf, _ = body(buf, table_places.take_step(tab, i),
                                      offsets=step.offsets[i] if step.offsets else None)
        else:
            buf = stage_fn(buf, step, _with_packed(tab, packed), step.offset, si)
    return buf


def _with_packed(tab: dict, packed) -> dict:
    """A stage's tables with the executable's packed table arrays (``"packed"``, where it has them), from which
    its in-place kernels read their tables (:func:`jaxpc.ops.tables.kernel_source`)."""
    return tab if packed is None or not isinstance(tab, dict) else {**tab, "packed": packed}


def _weight_copy(part: str):
    def make(logw):
        from ..ops import mosaic_tree

        return (mosaic_tree.tf32_weights if part == "w" else mosaic_tree.tf32_weights_t)(logw)
    return jax.jit(make)


# the tree's weight copies that the call path keeps per parameter array (:func:`kept_weights`)
WEIGHT_COPIES = {"w": _weight_copy("w"), "wt": _weight_copy("wt")}


def with_kept_weights(tables: dict, kept: dict | None) -> dict:
    """``tables`` with the tree's kept weight copies (``Runtime.tree_weights``) beside the folded plan's tree tables,
    where :func:`kept_weights` reads them."""
    if not kept:
        return tables
    fold = tables["fold"]
    return {**tables, "fold": {**fold, "tree": {**fold["tree"], "weights": kept}}}


def kept_weights(tables: dict, part: str, make):
    """The tree's weight copy ``part`` (``"w"``: :func:`jaxpc.ops.mosaic_tree.tf32_weights`, ``"wt"``: its transpose)
    from the call's arguments (``tables["tree"]["weights"]``, made once per parameter array by
    :meth:`jaxpc.runtime.Runtime.kept`), else ``make()`` (made inside the executable)."""
    given = tables["tree"].get("weights") or {}
    return given[part] if part in given else make()


def tree_span(layout, tree) -> tuple[int, int]:
    """The steps ``[start, stop)`` that the tree's persistent kernels run in place of :func:`run_stages` (``tree``:
    ``layout.tree`` where :func:`jaxpc.engine.routing.tree_kernel` takes that route, else None: no steps)."""
    return (tree.start, tree.stop) if tree is not None else (len(layout.steps), len(layout.steps))


def forward_buffer(layout: Layout, tables: dict, sum_params: dict, input_vals, options,
                   evidence: dict | None = None, counts: bool = False, keep_shifts: bool = False):
    """The node buffer ``[R, B]`` from the input layers' values (plain forward, differentiable by autodiff), or
    from the buffer with the leaves written (:func:`jaxpc.engine.forward.leaf_values`, an array in place of the
    list). With ``keep_shifts``: ``(buf, shifts or None, tree copies or None, firsts or None)``, the shifts of the
    blocks that keep them (:func:`jaxpc.engine.routing.writes_shift`: ``[ceil(R / unit), B]``, see
    :func:`jaxpc.engine.routing.shift_unit`; None when the layout's unit is too small), where the tree's levels
    run on clusters, the sample-major copies their backward reads (:func:`jaxpc.ops.mosaic_tree.forward` with
    ``keep``) and, in a max-product pass (``propagation="MPE"``), each sum partition's parents' first maximizing
    child, int32 ``[R, B]`` at the parents' rows (the hard-EM flow pass reads them instead of searching the terms
    again; written by XLA's reductions and the max-plus kernels alike)."""
    dtype = routing.param_dtype({"sum": sum_params, "v": input_vals})
    buf = input_vals if isinstance(input_vals, jax.Array) else input_buffer(layout, input_vals, dtype)
    kind = routing.tree_kernel(layout, options, buf.shape[1], dtype, evidence)
    unit = routing.shift_unit(layout) if keep_shifts and dtype == jnp.float32 and kind != "mosaic" else 0
    if unit and not any(routing.writes_shift(options, p, buf) for spec in layout.stages() for p in spec.sums):
        unit = 0  # no kernel would write a shift (e.g. no GPU, or max-product; the clusters' kernels keep none)
    keep_firsts = keep_shifts and options.propagation == "MPE"
    barrier = 0 < options.tuning.stage_barrier_batch <= buf.shape[1]

    def stage(carry, spec, tab, offset, name):  # carry: the buffer, or it with the shifts or the first maximizers
        b, s, f = carry, None, None
        if unit:
            b, s = carry
        elif keep_firsts:
            b, f = carry
        out = _stage(b, spec, tab, sum_params, options, offset, name, evidence, counts, s, unit, layout.ninf_row, f)
        return lax.optimization_barrier(out) if barrier else out

    if unit:
        carry = (buf, jnp.zeros((-(-layout.num_rows // unit), buf.shape[1]), jnp.float32))
    elif keep_firsts:  # (every row that the flow pass reads is written)
        carry = (buf, uninitialized(buf.shape, jnp.int32, options.tuning.min_unset))
    else:
        carry = buf
    tree = layout.tree if kind else None
    start, stop = tree_span(layout, tree)
    carry = run_stages(layout, tables, carry, stage, scan=options.scan_stages, span=(0, start))
    copies = None
    if kind == "mosaic":
        from ..ops import mosaic_tree

        with jax.named_scope("jaxpc/tree/clusters"):
            logw = sum_params[tree.group]
            in_kernel = options.tuning.tree_log_weights
            tabs, tile = routing.cluster_forward(options, tables["tree"]["clusters"], buf.shape[1])
            weights = None if in_kernel else kept_weights(tables, "w", lambda: mosaic_tree.tf32_weights(logw))
            carry = mosaic_tree.forward(carry, tabs, logw if in_kernel else None, tree, tile=tile,
                                        interpret=not routing.on_gpu(), keep=keep_shifts, weights=weights)
        if keep_shifts:
            carry, copies = carry
    elif tree is not None:
        with jax.named_scope("jaxpc/tree"):
            b = routing.tree_module(kind).forward(carry[0] if unit else carry, tables["tree"], sum_params[tree.group],
                                                  tree, options.concrete_precision)
        carry = (b, carry[1]) if unit else b
    carry = run_stages(layout, tables, carry, stage, scan=options.scan_stages, span=(stop, len(layout.steps)))
    if not keep_shifts:
        return carry
    if keep_firsts:
        return carry[0], None, copies, carry[1]
    return (*carry, copies, None) if unit else (carry, None, copies, None)
