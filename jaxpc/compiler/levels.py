"""Even tree levels: pad runs of similar tree levels of the folded plan to one shape, so that they run under one
``lax.scan`` body (:func:`jaxpc.compiler.compile.group_scans`) instead of one traced, lowered and compiled stage
each.

A tree's levels (an HCLT's: one sum partition per level, each parent block reading one child block, every child
row block read once) shrink from the leaves to the root, and few have the same shape: HCLT-256 has 61 levels of
20 shapes. Here a run of consecutive levels whose block counts lie within :data:`RATIO` of each other (and at
least ``min_repeats`` long) is padded to the run's largest block count ``n``, fold depth ``M`` and inverse-table
size ``U``. Rules that keep every pass exact:

* a padding block's children are all row 0 (the zero rows: its value is ``log sum_c w_c``, finite); it has no
  parent, so its rows are flow gaps (``Layout.flow_gaps``) whose flows are zero, and every flow it sends down
  (to row 0, below the first row the flow pass writes) or to its parameters is zero;
* its parameter block is a block of the same group that no other block of its level uses (``unique_pid`` holds,
  so the in-place parameter-flow kernels never see two programs on one block), taken from the other levels;
* the batched parameter-flow pass (:func:`jaxpc.compiler.compile._pflow_plan`) leaves padding blocks out
  (:func:`is_padding`);
* a padded fold column is row 0, as for the shorter products of a level.

Rows above a padded level move up by its padding (:func:`_remap`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .layout import StageSpec

RATIO = 1.5  # the largest block count of a padded run over its smallest


def is_padding(ch: np.ndarray) -> np.ndarray:
    """``[n]`` whether each block of a sum partition's ``ch`` (``[n, C]`` or ``[n, C, M]``) is a padding block: every
    child row 0. A real block's first child is a row above the padding or the ``-inf`` marker."""
    c = ch.reshape(ch.shape[0], -1)
    return np.all(c == 0, axis=1)


def tree_level(spec: StageSpec):
    """The one sum partition of a tree-level stage (fan-in one block, every child row block read once, its own
    parameter blocks, neither dense nor gated), which may be padded, or None."""
    if spec.prods or len(spec.sums) != 1:
        return None
    p = spec.sums[0]
    if p.C != 1 or p.D != 1 or p.dense or p.gated or not p.unique_pid:
        return None
    return p


def _runs(stages, min_repeats: int) -> list[tuple[int, int]]:
    """``[start, stop)`` runs of consecutive candidate stages of one group and block shape, block counts within
    :data:`RATIO`, at least ``min_repeats`` long and not all of one shape already."""
    out, i, S = [], 0, len(stages)
    while i < S:
        p = tree_level(stages[i])
        if p is None:
            i += 1
            continue
        j, lo, hi = i + 1, p.n, p.n
        while j < S:
            q = tree_level(stages[j])
            if q is None or (q.group, q.Kp, q.Kc) != (p.group, p.Kp, p.Kc):
                break
            if max(hi, q.n) > RATIO * min(lo, q.n):
                break
            lo, hi = min(lo, q.n), max(hi, q.n)
            j += 1
        if j - i >= min_repeats and len({stages[k].signature for k in range(i, j)}) > 1:
            out.append((i, j))
        i = j
    return out


def _remap(rows: np.ndarray, ends: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """Rows moved up by the padding of the stages that end at or below them (``ends``: the stages' last rows + 1
    in order; ``shift[s]``: the padding rows of stages ``0 .. s``). Rows below the first stage (zero rows, inputs,
    the ``-inf`` marker -2) stay."""
    r = np.asarray(rows)
    k = np.searchsorted(ends, r, side="right")
    return r + np.where(k > 0, shift[np.maximum(k - 1, 0)], 0)


def even_levels(stages: list, tabs: list, num_rows: int, root_row: int, group_blocks: dict, min_repeats: int,
                inverse_tables):
    """``(stages, tables, num_rows, root_row)`` with the runs of :func:`_runs` padded to one shape each (see the
    module docstring). ``group_blocks``: parameter blocks per sum group; ``inverse_tables(ch, pid)``: a padded
    partition's inverse tables (:func:`jaxpc.compiler.compile.inverse_tables`). Unchanged when nothing pads."""
    runs = _runs(stages, min_repeats) if min_repeats else []
    if not runs:
        return stages, tabs, num_rows, root_row
    target: dict[int, tuple[int, int, int]] = {}
    for a, b in runs:
        parts = [stages[s].sums[0] for s in range(a, b)]
        n, M = max(p.n for p in parts), max(p.M for p in parts)
        for s in range(a, b):
            target[s] = (n, M)
    extra = np.asarray([(target[s][0] - st.sums[0].n) * st.sums[0].Kp if s in target else 0
                        for s, st in enumerate(stages)], np.int64)
    ends = np.asarray([st.offset + st.num_rows for st in stages], np.int64)
    shift = np.cumsum(extra)
    used: dict[str, set] = {}
    for st, tab in zip(stages, tabs):
        for p, t in zip(st.sums, tab["sums"]):
            used.setdefault(p.group, set()).update(np.unique(t["pid"]).tolist())

    new_stages, new_tabs = [], []
    for s, (st, tab) in enumerate(zip(stages, tabs)):
        offset = int(_remap(np.int64(st.offset), ends, shift))
        sums, sum_tabs = [], []
        for p, t in zip(st.sums, tab["sums"]):
            ch = _remap(t["ch"], ends, shift)
            pid = t["pid"]
            if s in target:
                n, M = target[s]
                ch = ch if ch.ndim == 3 else ch[:, :, None]
                ch = np.pad(ch, ((0, n - p.n), (0, 0), (0, M - ch.shape[2])))
                own = set(np.unique(pid).tolist())
                spare = np.fromiter((q for q in sorted(used.get(p.group, ())) if q not in own), np.int64)
                if spare.size < n - p.n:
                    spare = np.setdiff1d(np.arange(group_blocks[p.group]), np.asarray(sorted(own)))
                pid = np.concatenate([pid, spare[:n - p.n, None].astype(pid.dtype)])
                if M == 1:
                    ch = ch[:, :, 0]
                inv = inverse_tables(ch, pid)
                t = {**{k: v for k, v in t.items() if k not in ("uch", "par", "ppid", "pcol")}, "ch": ch, "pid": pid,
                     **inv}
                p = dataclasses.replace(p, n=n, M=M, U=int(inv["par"].shape[0]), D=int(inv["par"].shape[1]))
            else:
                t = {**t, "ch": ch}
                if "uch" in t:
                    t["uch"] = _remap(t["uch"], ends, shift).astype(t["uch"].dtype)
            sums.append(p)
            sum_tabs.append(t)
        new_stages.append(StageSpec(st.prods, tuple(sums), offset))
        new_tabs.append({**tab, "sums": sum_tabs, "out": np.int32(offset)})
    # one inverse-table size per run
    for a, b in runs:
        U = max(new_stages[s].sums[0].U for s in range(a, b))
        for s in range(a, b):
            p, t = new_stages[s].sums[0], new_tabs[s]["sums"][0]
            if p.U < U:
                t = dict(t)
                t["uch"] = np.pad(t["uch"], (0, U - p.U))
                for k in ("par", "ppid", "pcol"):
                    if k in t:
                        t[k] = np.pad(t[k], ((0, U - p.U), (0, 0)), constant_values=-1)
                new_tabs[s]["sums"] = [t]
                new_stages[s] = dataclasses.replace(new_stages[s], sums=(dataclasses.replace(p, U=U),))
    return new_stages, new_tabs, num_rows + int(shift[-1]), int(_remap(np.int64(root_row), ends, shift))
