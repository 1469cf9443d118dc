"""Index tables read in place from an executable's packed table array.

An executable takes a circuit's index tables packed into one flat array per dtype and slices each table out of it
(:class:`jaxpc.executables.PackedTables`). XLA fuses those slices into the operations that read them, but a kernel's
operand is a buffer of its own: each table that a Pallas kernel takes is first copied out of the packed array (a
device-to-device copy per table and call; HCLT-256's unrolled flows at B=16 made 120 of them per step, about
1 us each in the command buffer). Where a table is known to lie in the packed array, the kernel takes the packed
array itself and reads the table at its offset (:func:`kernel_source`).

The unpacked tables carry what a kernel needs for that: the packed arrays under ``"packed"`` (the top-level and the
folded plan's tables) and, beside each partition's kernel tables, a static :class:`TableAt` per table under ``"at"``
(no leaves: it passes through ``jit``, ``custom_vjp`` and ``scan`` unchanged). :func:`take_step` slices the stacked
tables of a scan's repetition, the ``TableAt`` with them.
"""

from __future__ import annotations

import dataclasses
import math

import jax

Array = jax.Array

KERNEL_TABLES = ("ch", "pid", "kch", "kpid")  # the partition tables that kernels take as operands
MAX_ELEMENTS = 2 ** 31 - 1  # a packed array the kernels index with int32 offsets


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class TableAt:
    """Table of shape ``shape`` at element ``offset`` of packed array ``array`` (the int32 array's index among the
    packed arrays)."""

    array: int
    offset: int
    shape: tuple[int, ...]

    def take(self, i: int) -> TableAt:
        """The table of row ``i`` of this (stacked) table."""
        return TableAt(self.array, self.offset + i * math.prod(self.shape[1:]), self.shape[1:])


def mark(tables, paths: list, slots: list, arrays: tuple):
    """``tables`` (freshly unflattened, mutable) with ``"packed"`` and the kernel tables' :class:`TableAt` added;
    ``paths[k]`` and ``slots[k] = (array, offset, shape)``: leaf ``k``'s key path and place in ``arrays``."""
    if not isinstance(tables, dict):
        return tables
    for path, (g, off, shape) in zip(paths, slots):
        keys = [getattr(p, "key", getattr(p, "idx", None)) for p in path]
        if len(keys) < 2 or keys[-1] not in KERNEL_TABLES or off + math.prod(shape) > MAX_ELEMENTS:
            continue
        parent = tables
        for k in keys[:-1]:
            parent = parent[k]
        if isinstance(parent, dict):
            parent.setdefault("at", {})[keys[-1]] = TableAt(g, off, tuple(shape))
    for d in (tables, tables.get("fold")):
        if isinstance(d, dict):
            d["packed"] = tuple(arrays)
    return tables


def take_step(tab, i: int):
    """Repetition ``i`` of a scan's stacked tables: every array's row ``i``, every :class:`TableAt` moved with it."""
    return jax.tree_util.tree_map(lambda a: a.take(i) if isinstance(a, TableAt) else a[i], tab,
                                  is_leaf=lambda a: isinstance(a, TableAt))


def kernel_source(t: dict, packed, names: tuple[str, ...]):
    """``(packed array, offsets)``: where the tables ``t[name]`` for ``names`` lie, when all of them lie whole in one
    int32 packed array (not sliced by a scan: each table's shape is its ``TableAt``'s); else None."""
    at = t.get("at")
    if packed is None or not at or any(n not in at for n in names):
        return None
    places = [at[n] for n in names]
    arrays = [t[n] for n in names]
    if len({p.array for p in places}) != 1 or any(tuple(a.shape) != p.shape for a, p in zip(arrays, places)):
        return None
    src = packed[places[0].array]
    if src.dtype != jax.numpy.int32 or any(a.dtype != src.dtype for a in arrays):
        return None
    return src, tuple(p.offset for p in places)
