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
    """(static plan, numpy tables) for re-evaluating everything whose scope meets ``variables``."""
    bad = [v for v in variables if not isinstance(v, numbers.Integral) or isinstance(v, bool)]
    if bad:
        raise TypeError(f"partial evaluation: variables must be ints, got {bad[0]!r}")
    vs = sorted({int(v) for v in variables})
    if not vs:
        raise ValueError("partial evaluation needs at least one variable")
    V = struct.layout.num_vars
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
