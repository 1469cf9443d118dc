"""Compile-time detection of a run of tree levels in the folded plan (an HCLT's).

A *tree level* is a stage holding one sum partition whose parent blocks read one child block each (``C = 1``),
whose child row blocks have one reader each (``D = 1``), with a parameter block of its own per parent block,
neither dense nor gated. An HCLT's folded plan is such levels from the leaves to the top of its tree (where its
last, single-block levels are dense), each level's child blocks the sums of the row blocks of a folded product.

:func:`detect_tree` finds the longest run of consecutive steps (scanned periods counted repeat by repeat) made
of tree levels of one parameter group and block shape, and lists their blocks level by level in one table
(:class:`~jaxpc.compiler.layout.TreeSpec`), which the persistent kernels of :mod:`jaxpc.ops.pallas_tree` walk
in one launch per direction.
"""

from __future__ import annotations

from typing import Final

import numpy as np

from .layout import ScanSpec, TreeSpec
from .levels import is_padding, tree_level

__all__ = ["MIN_LEVELS", "TreeSpec", "detect_tree"]

MIN_LEVELS: Final = 4  # shorter runs stay on the per-level kernels


def _step_levels(step, tab) -> list | None:
    """``[(part, first row, ch [n, M], pid [n])]`` of each stage of a step in evaluation order, or None when one of
    them is not a tree level."""
    if isinstance(step, ScanSpec):
        stages = [(spec, tab[j], r) for r in range(step.repeats) for j, spec in enumerate(step.period)]
    else:
        stages = [(step, tab, None)]
    out = []
    for spec, t, r in stages:
        p = tree_level(spec)
        if p is None:
            return None
        s = t["sums"][0]
        pick = (lambda a: np.asarray(a)) if r is None else (lambda a, r=r: np.asarray(a)[r])
        ch = pick(s["ch"]).reshape(p.n, -1)
        out.append((p, int(pick(t["out"])), ch, pick(s["pid"]).reshape(p.n)))
    return out


def detect_tree(steps: list, step_tables: list) -> tuple[TreeSpec, dict] | None:
    """``(TreeSpec, tables)`` of the longest run of at least :data:`MIN_LEVELS` tree levels of one group and block
    shape in ``steps`` (with their numpy ``step_tables``), or None."""
    best, i, S = None, 0, len(steps)
    while i < S:
        levels = _step_levels(steps[i], step_tables[i])
        if levels is None:
            i += 1
            continue
        key = (levels[0][0].group, levels[0][0].Kp, levels[0][0].Kc)
        run, j = list(levels), i + 1
        while j < S:
            nxt = _step_levels(steps[j], step_tables[j])
            if nxt is None or any((p.group, p.Kp, p.Kc) != key for p, *_ in nxt):
                break
            run += nxt
            j += 1
        if all((p.group, p.Kp, p.Kc) == key for p, *_ in run) and (best is None or len(run) > len(best[2])):
            best = (i, j, run)
        i = j
    if best is None or len(best[2]) < MIN_LEVELS:
        return None
    start, stop, run = best
    M = max(ch.shape[1] for _, _, ch, _ in run)
    lev, prow, chs, pids = [0], [], [], []
    for p, first, ch, pid in run:
        real = ~is_padding(ch)
        rows = first + np.arange(p.n, dtype=np.int64) * p.Kp
        prow.append(rows[real])
        chs.append(np.pad(ch[real], ((0, 0), (0, M - ch.shape[1]))))  # zero rows: adding zeros changes nothing
        pids.append(pid[real])
        lev.append(lev[-1] + int(real.sum()))
    part = run[0][0]
    spec = TreeSpec(start=start, stop=stop, levels=len(run), blocks=lev[-1], group=part.group, Kp=part.Kp,
                    Kc=part.Kc, M=M)
    tables = {"lev": np.asarray(lev, np.int32), "prow": np.concatenate(prow).astype(np.int32),
              "ch": np.concatenate(chs)[:, None, :].astype(np.int32),
              "pid": np.concatenate(pids)[:, None].astype(np.int32)}
    return spec, tables
