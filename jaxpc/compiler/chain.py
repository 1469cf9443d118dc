"""Compile-time detection of chain-structured circuits (hidden Markov models).

A circuit is a *chain* when its stages, in order, are

    S_0, P_0, S_1, P_1, ..., S_{R-1}, P_{R-1}, S_root

over a single input layer whose rows split into ``R + 1`` blocks of ``K`` nodes ``e_0 .. e_R``:

* ``S_r`` is one dense sum partition with ``K`` parents and ``K`` children, reading ``e_0`` (for
  ``r = 0``) or all of ``P_{r-1}``, in row order;
* ``P_r`` is one product partition of ``K`` nodes, node ``k`` multiplying node ``k`` of ``S_r``
  with node ``k`` of ``e_{r+1}``;
* ``S_root`` is the single root node, a dense sum over all of ``P_{R-1}``.

Every HMM built by :func:`jaxpc.structures.HMM` / ``GeneralizedHMM`` (tied or not, any emission
distribution) has this form. Such a circuit is ``log g^T diag(e_R) A_{R-1} ... diag(e_1) A_0 e_0``,
which :mod:`jaxpc.engine.chain` evaluates as a rescaled linear-space scan (the forward-backward
algorithm) instead of pushing every node through the ``[R, B]`` node buffer.
"""

from __future__ import annotations

import numpy as np

from .layout import ChainSpec, Layout, StageSpec

__all__ = ["ChainSpec", "detect_chain"]


def _rows(ch: np.ndarray, K: int) -> np.ndarray:
    """Buffer rows read by a table of first-child rows ``ch`` (any shape) with blocks of ``K`` rows."""
    return (np.asarray(ch, np.int64)[..., None] + np.arange(K)).reshape(-1)


def _is_range(rows: np.ndarray, start: int, size: int) -> bool:
    return rows.size == size and bool(np.array_equal(rows, np.arange(start, start + size)))


def _one_sum(spec: StageSpec):
    return spec.sums[0] if not spec.prods and len(spec.sums) == 1 and spec.sums[0].dense else None


def _emission_block(rows: np.ndarray, inp, K: int) -> int | None:
    """The ``b`` for which ``rows`` are exactly ``e_b`` (rows ``b K .. b K + K - 1`` of input layer ``inp``),
    else None."""
    start = int(rows[0]) - inp.offset if rows.size else -1
    if start < 0 or start % K or not _is_range(rows, inp.offset + start, K) or start + K > inp.num_nodes:
        return None
    return start // K


def _product_emission(spec: StageSpec, tab: dict, sum_row: int, inp, K: int) -> int | None:
    """The emission block ``b`` when stage ``spec`` is a ``P_r`` (see the module docstring): one product
    partition of ``K`` nodes multiplying the ``K`` rows from ``sum_row`` on (``S_r``) node by node with ``e_b``
    (in either order), else None."""
    if spec.sums or len(spec.prods) != 1 or spec.prods[0].m != 2 or spec.prods[0].n * spec.prods[0].K != K:
        return None
    cols = [_rows(tab["prods"][0]["ch"][:, j], spec.prods[0].K) for j in range(2)]
    if _is_range(cols[0], sum_row, K):
        return _emission_block(cols[1], inp, K)
    if _is_range(cols[1], sum_row, K):
        return _emission_block(cols[0], inp, K)
    return None


def _walk_chain(stages: list, stage_tables: list, inp, first, K: int):
    """Match the stages (without the root's) to ``S_0, P_0, ..., S_{R-1}, P_{R-1}``, every ``S_r`` shaped as
    ``first`` (the partition of ``S_0``). Returns ``(order, pids, prev)``: the emission block read by ``S_0`` and
    by each ``P_r``, each ``S_r``'s parameter blocks and the first row of ``P_{R-1}``; or None."""
    order = []
    pids = []
    prev = None  # rows [prev, prev + K) hold P_{r-1}
    for r in range(len(stages) // 2):
        s, st = stages[2 * r], stage_tables[2 * r]
        part = _one_sum(s)
        if part is None or (part.n, part.C, part.Kp, part.Kc, part.group) != (first.n, first.C, first.Kp, first.Kc,
                                                                              first.group):
            return None
        rows = _rows(st["sums"][0]["ch"][0], part.Kc)
        if r == 0:
            b = _emission_block(rows, inp, K)
            if b is None:
                return None
            order.append(b)
        elif not _is_range(rows, prev, K):
            return None
        pids.append(np.asarray(st["sums"][0]["pid"]))
        b = _product_emission(stages[2 * r + 1], stage_tables[2 * r + 1], s.offset, inp, K)
        if b is None:
            return None
        order.append(b)
        prev = stages[2 * r + 1].offset
    return order, pids, prev


def detect_chain(layout: Layout, stages: list, stage_tables: list) -> tuple[ChainSpec, dict] | None:
    """``(ChainSpec, numpy tables)`` when the circuit is a chain (see the module docstring), else None.
    ``stages`` / ``stage_tables``: every stage in order with its (unstacked, unfinalized) tables."""
    if len(layout.input_layers) != 1 or len(stages) < 3 or len(stages) % 2 == 0:
        return None
    inp = layout.input_layers[0]
    R = (len(stages) - 1) // 2
    first = _one_sum(stages[0])
    if first is None:
        return None
    K = first.n * first.Kp
    if first.C * first.Kc != K or inp.num_nodes != (R + 1) * K:
        return None
    walked = _walk_chain(stages[:-1], stage_tables[:-1], inp, first, K)
    if walked is None:
        return None
    order, pids, prev = walked
    root, rt = stages[-1], stage_tables[-1]
    rpart = _one_sum(root)
    if (rpart is None or rpart.n != 1 or rpart.Kp != 1 or rpart.C * rpart.Kc != K or layout.root_row != root.offset
            or not _is_range(_rows(rt["sums"][0]["ch"][0], rpart.Kc), prev, K)):
        return None
    if sorted(order) != list(range(R + 1)):
        return None
    tied = all(np.array_equal(p, pids[0]) for p in pids)
    spec = ChainSpec(K=K, R=R, group=first.group, Kp=first.Kp, Kc=first.Kc, root_group=rpart.group,
                     root_Kc=rpart.Kc, tied=tied, order=tuple(order))
    tables = {"pid": (pids[0] if tied else np.stack(pids)).astype(np.int32),
              "root_pid": np.asarray(rt["sums"][0]["pid"], np.int32)}
    return spec, tables
