"""Partial evaluation plans: re-evaluate only the nodes whose scope meets a set of variables.

A plan keeps, of every input layer and every stage partition, the nodes (blocks) whose scope
intersects the given variables; everything else is read from a previous node buffer. Reduced
stages with identical shapes are folded into ``lax.scan`` again (an HMM re-evaluated from step
``t`` scans over the steps it touches).

The plan's static part (:class:`PlanLayout`, hashable) is part of the executable key; its index
tables are traced arguments.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable

import numpy as np

from .compile import CompiledStructure, group_scans, inverse_tables
from .layout import StageSpec


@dataclasses.dataclass(frozen=True)
class PlanInput:
    layer: int  # index of the input layer
    num_nodes: int  # nodes re-evaluated


@dataclasses.dataclass(frozen=True)
class PlanLayout:
    inputs: tuple[PlanInput, ...]
    steps: tuple  # StageSpec | ScanSpec over the reduced stages
    root_row: int


def build_plan(struct: CompiledStructure, variables) -> tuple[PlanLayout, dict]:
    """(static plan, numpy tables) for re-evaluating everything whose scope meets ``variables``, a non-empty
    sequence of variable ids (ints in ``0 .. num_vars - 1``; else a ``TypeError`` or ``ValueError``)."""
    V = struct.layout.num_vars
    if hasattr(variables, "__array__") and not isinstance(variables, (str, bytes, numbers.Number)):
        a = np.asarray(variables)  # a NumPy or JAX array of ids
        variables = a.tolist() if a.ndim == 1 and a.dtype.kind in "iu" else a
    if isinstance(variables, (str, bytes, numbers.Number, np.ndarray)) or not isinstance(variables, Iterable):
        what = (f"an array of dtype {variables.dtype} and shape {variables.shape}" if isinstance(variables, np.ndarray)
                else f"{type(variables).__name__} {variables!r}")
        raise TypeError(f"partial evaluation: variables must be a sequence of variable ids (ints), got {what}; e.g. "
                        f"circuit.partial([v]) for variable v alone (ids 0..{V - 1})")
    if iter(variables) is variables:  # read more than once (here and by the caller)
        raise TypeError(f"partial evaluation: variables must be a sequence of variable ids (ints), got a one-shot "
                        f"{type(variables).__name__}; pass a list, e.g. list(...) of it")
    bad = [v for v in variables if not isinstance(v, numbers.Integral) or isinstance(v, bool)]
    if bad:
        raise TypeError(f"partial evaluation: variables must be ints, got {bad[0]!r} ({type(bad[0]).__name__}) "
                        "among them; pass a sequence of variable ids")
    vs = sorted({int(v) for v in variables})
    if not vs:
        raise ValueError("partial evaluation needs at least one variable")
    bad = [v for v in vs if not 0 <= v < V]
    if bad:
        raise ValueError(f"partial evaluation: variable {bad[0]} is not in the circuit (variables 0..{V - 1})")
    mask = 0
    for v in vs:
        mask |= 1 << v
    var_set = np.zeros(V, bool)
    var_set[vs] = True

    inputs, in_tabs = [], []
    for li, (spec, tab) in enumerate(zip(struct.layout.input_layers, struct.tables["inputs"])):
        idx = np.nonzero(var_set[tab["vars"]])[0]
        if idx.size == 0:
            continue
        inputs.append(PlanInput(li, int(idx.size)))
        in_tabs.append({"vars": tab["vars"][idx], "rows": tab["rows"][idx],
                        "write": (spec.offset + idx).astype(np.int32)})

    stages, stage_tabs = [], []
    for spec, tab, owners in zip(struct.stages, struct.stage_tables, struct.stage_owners):
        prods, sums, ptabs, stabs = [], [], [], []
        row = spec.offset
        for part, t, own in zip(spec.prods, tab["prods"], owners["prods"]):
            sel = np.nonzero([bool(o.scope & mask) for o in own])[0]
            if sel.size:
                prods.append(dataclasses.replace(part, n=int(sel.size)))
                ptabs.append({"ch": t["ch"][sel], "write": (row + sel * part.K).astype(np.int32)})
            row += part.num_rows
        for part, t, own in zip(spec.sums, tab["sums"], owners["sums"]):
            sel = np.nonzero([bool(o.scope & mask) for o in own])[0]
            if sel.size:
                inv = inverse_tables(t["ch"][sel], t["pid"][sel])
                # partial evaluation takes no evidence: no gate tables
                sums.append(dataclasses.replace(part, n=int(sel.size), U=inv["par"].shape[0], D=inv["par"].shape[1],
                                                gated=False))
                stabs.append({"ch": t["ch"][sel], "pid": t["pid"][sel],
                              "write": (row + sel * part.Kp).astype(np.int32), **inv})
            row += part.num_rows
        if prods or sums:
            stages.append(StageSpec(tuple(prods), tuple(sums), 0))
            stage_tabs.append({"prods": ptabs, "sums": stabs, "out": np.int32(0)})
    steps, step_tabs = group_scans(stages, stage_tabs, 3)
    plan = PlanLayout(tuple(inputs), tuple(steps), struct.layout.root_row)
    return plan, {"inputs": in_tabs, "steps": step_tabs}
