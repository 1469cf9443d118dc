"""Sum partitions that repeat up to a shift: a long HMM's steps, a deep chain's levels.

A stage's sum tables are a function of its edges: the parent block of each edge, the buffer rows of its child
and its parameter block. When those are an earlier stage's rows and parameter blocks shifted by constants (and
the stage's own rows start at a shifted row), its tables are the earlier ones shifted the same way, so they are
copied and shifted instead of built again. The rules:

- child rows: every real row is positive (rows below ``2 * Kmax`` are the padding rows), and the tables mark
  padding with 0 (a folded product's zero rows) or -2 (a missing child); real rows shift, the marks do not;
- parameter blocks shift where the slot is real (``ch`` not -2; ``ppid``: not -1);
- parent indices, child orders and positions (``par``, ``pcol``, ``eorder``) do not change, nor does the
  partition's spec.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

_SHIFTED = ("ch", "pid", "uch", "ppid")
_KEPT = ("par", "pcol", "eorder")


@dataclasses.dataclass(frozen=True)
class Shift:
    """A stage's sum edges up to the shift: ``key`` identifies them; per shape key ``(Kp, Kc, M)``, ``rows`` holds
    the smallest real child row of each of the ``M`` columns and ``pids`` the smallest parameter block."""

    key: bytes
    rows: dict
    pids: dict


@dataclasses.dataclass
class _Built:
    shift: Shift
    parts: list
    tabs: list  # the sum tables as built, each its own dict
    owners: list  # per partition ``(shape key, item index per block)``
    columns: list | None  # per partition the column of each ``uch`` entry (None: in several), found on reuse
    blocks: list  # ``(shape key, item, block indices, rows from the stage's first sum row)`` per vector
    rows: int  # rows the partitions take


def shift_of(sum_items: dict) -> Shift:
    """The :class:`Shift` of a stage's sum edges (``_stage_members``' ``sum_items``)."""
    h = hashlib.blake2b(digest_size=20)
    rows, pids = {}, {}
    big = np.iinfo(np.int64).max
    for shape in sorted(sum_items):
        items = sum_items[shape]
        r_all = items[0][2] if len(items) == 1 else np.concatenate([it[2] for it in items])
        r0 = np.where(r_all > 0, r_all, big).min(axis=0)
        r0[r0 == big] = 0
        p0 = min(int(it[3].min()) for it in items)
        rows[shape], pids[shape] = r0, p0
        h.update(np.asarray([*shape, len(items)] + [n for ns, par, _, _ in items for n in (ns.num_node_blocks,
                                                                                          par.size)]).tobytes())
        norm = np.where(r_all > 0, r_all - (r0 - 1), r_all).ravel()
        h.update(np.concatenate([*(it[1] for it in items), norm, *(it[3] - p0 for it in items)]).astype(
            np.int64, copy=False).tobytes())
    return Shift(h.digest(), rows, pids)


class Repeats:
    """The last few stages' sum partitions, reused for a stage whose edges are theirs shifted."""

    def __init__(self, size: int = 8):
        self.size = size
        self._built: dict[bytes, _Built] = {}

    def get(self, shift: Shift, sum_items: dict, row: int, block_rows: dict):
        """``(parts, tables, owners, next row)`` as ``_sum_parts`` returns them, or None when no stage matches."""
        b = self._built.get(shift.key)
        if b is None:
            return None
        if b.columns is None:
            b.columns = [_columns(t) for t in b.tabs]
        tabs = []
        for t, (shape, _), col in zip(b.tabs, b.owners, b.columns):
            dr = shift.rows[shape] - b.shift.rows[shape]
            if col is None and np.any(dr != dr[0]):
                return None
            t = _shifted(t, dr, dr[0] if col is None else dr[col], shift.pids[shape] - b.shift.pids[shape])
            if t is None:
                return None
            tabs.append(t)
        owners = [[sum_items[shape][v][0] for v in idx] for shape, idx in b.owners]
        for shape, v, blk, rel in b.blocks:
            ns = sum_items[shape][v][0]
            br = block_rows.setdefault(ns.id, np.zeros(ns.num_node_blocks, dtype=np.int64))
            br[blk] = row + rel
        return list(b.parts), tabs, owners, row + b.rows

    def put(self, shift: Shift, sum_items: dict, row: int, result, block_rows: dict) -> None:
        """Record a stage's built partitions (``result``: ``_sum_parts``' return)."""
        parts, tabs, owners, end = result
        owner_idx, blocks = [], []
        for part, own in zip(parts, owners):
            shape = (part.Kp, part.Kc, part.M)
            index = {id(it[0]): v for v, it in enumerate(sum_items[shape])}
            owner_idx.append((shape, np.asarray([index[id(ns)] for ns in own], np.int64)))
        for shape, items in sum_items.items():
            for v, (ns, *_) in enumerate(items):
                blocks.append((shape, v, np.arange(ns.num_node_blocks), block_rows[ns.id] - row))
        if len(self._built) >= self.size:
            self._built.pop(next(iter(self._built)))
        self._built[shift.key] = _Built(shift, list(parts), [dict(t) for t in tabs], owner_idx, None, blocks,
                                        end - row)


def _columns(tab: dict) -> np.ndarray | None:
    """The column (of ``ch [n, C, M]``) that each of ``uch`` comes from; None when a row is in several."""
    ch, uch = tab["ch"], tab["uch"]
    col = np.full(uch.size, -1, np.int64)
    if ch.ndim == 2:
        return col + 1
    for m in range(ch.shape[2]):
        rows = ch[:, :, m]
        pos = np.searchsorted(uch, rows[rows > 0])
        if np.any((col[pos] >= 0) & (col[pos] != m)):
            return None
        col[pos] = m
    return col


def _shifted(tab: dict, dr: np.ndarray, duch, dp: int) -> dict | None:
    """A partition's tables with the real child rows of column ``m`` shifted by ``dr[m]`` (``duch``: the shift of
    each ``uch`` entry) and parameter blocks by ``dp``; None when the shifted rows change their order."""
    unknown = set(tab) - set(_SHIFTED) - set(_KEPT)
    if unknown:
        raise AssertionError(f"repeats: no shift rule for the tables {sorted(unknown)}")
    uch = tab["uch"] + duch
    if uch.size > 1 and not np.all(uch[1:] > uch[:-1]):
        return None
    ch = tab["ch"]
    real = (ch if ch.ndim == 2 else ch[:, :, 0]) != -2
    step = dr[0] if ch.ndim == 2 else dr
    out = {"ch": np.where(ch > 0, ch + step, ch).astype(ch.dtype),
           "pid": np.where(real, tab["pid"] + dp, tab["pid"]).astype(tab["pid"].dtype),
           "uch": uch.astype(tab["uch"].dtype),
           "ppid": np.where(tab["ppid"] >= 0, tab["ppid"] + dp, tab["ppid"]).astype(tab["ppid"].dtype)}
    out.update({k: tab[k].copy() for k in _KEPT if k in tab})
    return out
