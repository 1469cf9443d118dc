"""Seeded host draws of normalized log-weights (the initial sum and categorical parameters), chunk by chunk on
several threads, equal bit for bit to one sequential draw.

The weights are ``w = exp(-2 u)`` with ``u`` the generator's next uniform doubles, cast to the parameter dtype,
each normalized by its *segment's* total: the blocks of one segment (``seg``) and the last axis. A chunk holds
whole blocks and draws its doubles from a copy of the generator advanced to its first draw (``PCG64.advance``
moves one step per double), so the values depend on neither the number of threads nor the chunk size. A chunk
that holds whole segments is normalized and logged while it is in cache; the others once every total is known.
Totals add the blocks of a segment in block order, as one ``np.add.at`` over all of them does.

Shapes: ``N`` blocks of ``Kp`` rows (``[N, Kp, Kc]``; a ``[N, K]`` array is ``N`` blocks of one row).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["aligned_empty", "log_weights"]

CHUNK = 1 << 20  # elements per chunk: whole blocks, so one block where a block is larger
MAX_THREADS = 16
_ALIGN = 64  # bytes: XLA's CPU client aliases such a numpy array on device_put instead of copying it
_JUMPABLE = (np.random.PCG64, np.random.PCG64DXSM)  # one state step per 64-bit output, and advance()


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialized array whose data starts on a 64-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    off = -raw.ctypes.data % _ALIGN
    return raw[off:off + nbytes].view(dtype).reshape(shape)


def num_threads() -> int:
    """The threads a draw uses: the CPUs this process may run on, at most :data:`MAX_THREADS`."""
    return max(1, min(MAX_THREADS, len(os.sched_getaffinity(0))))


class _Stream:
    """Doubles of ``rng`` by position: ``generator(offset)`` continues the stream at draw ``offset`` (a jumped
    copy for PCG64 generators; else ``rng`` itself, which then must be read in order, on one thread)."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.jumps = type(rng.bit_generator) in _JUMPABLE
        self.state = rng.bit_generator.state

    def generator(self, offset: int) -> np.random.Generator:
        if not self.jumps:
            return self.rng
        bg = type(self.rng.bit_generator)()
        bg.state = self.state
        return np.random.Generator(bg.advance(offset))

    def skip(self, n: int) -> None:
        """Move ``rng`` past the ``n`` doubles drawn from jumped copies (keeping its cached 32-bit half)."""
        if self.jumps:
            bg = self.rng.bit_generator
            bg.advance(n)
            state = bg.state
            state.update(has_uint32=self.state["has_uint32"], uinteger=self.state["uinteger"])
            bg.state = state


def _chunks(seg: np.ndarray | None, N: int, block_elems: int) -> list[tuple[int, int, bool]]:
    """``(first block, stop block, closed)`` per chunk of about :data:`CHUNK` elements. Cuts fall between
    segments where one is near (within four chunks' length); ``closed``: the chunk holds whole segments."""
    per = max(1, CHUNK // block_elems)
    if seg is None:  # every block a segment of its own
        return [(b, min(b + per, N), True) for b in range(0, N, per)]
    blocks = np.arange(N)
    first = np.full(int(seg.max()) + 1, N, np.int64)
    last = np.full(first.size, -1, np.int64)
    np.minimum.at(first, seg, blocks)
    np.maximum.at(last, seg, blocks)
    used = last >= 0
    opened = np.zeros(N + 1, np.int64)
    np.add.at(opened, first[used] + 1, 1)
    np.add.at(opened, last[used] + 1, -1)
    clean = np.cumsum(opened) == 0  # clean[b]: no segment has blocks on both sides of a cut before block b
    cuts = np.flatnonzero(clean)
    out, b = [], 0
    while b < N:
        j = int(np.searchsorted(cuts, b + per))
        stop = int(cuts[j]) if j < cuts.size and cuts[j] <= b + 4 * per else min(b + per, N)
        out.append((b, stop, bool(clean[b] and clean[stop])))
        b = stop
    return out


def _normalize(w: np.ndarray, sums: np.ndarray, seg: np.ndarray | None) -> None:
    """``w [n, Kp, Kc]`` (whole segments) divided by its segments' totals of the row ``sums [n, Kp]``, in place."""
    if seg is None:
        tot = sums
    else:
        ids, local = np.unique(seg, return_inverse=True)
        tot = np.zeros((ids.size, w.shape[1]), w.dtype)
        np.add.at(tot, local, sums)
        tot = tot[local]
    np.divide(w, tot[:, :, None], out=w)


def _log(w: np.ndarray) -> None:
    with np.errstate(divide="ignore"):  # log(0) = -inf where a mask forbids a value
        np.log(w, out=w)


class _Filler:
    """The per-chunk work of :func:`log_weights` over ``w [N, Kp, Kc]``."""

    def __init__(self, w, stream: _Stream, seg, mask, sums):
        self.w, self.stream, self.seg, self.mask = w, stream, seg, mask
        self.sums = sums  # [N, Kp] row totals of the blocks in open chunks (None when every chunk is closed)
        self._local = threading.local()

    def _buffer(self, n: int) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.size < n:
            buf = self._local.buf = np.empty(max(n, CHUNK))
        return buf[:n]

    def draw(self, chunk) -> None:
        """Weights of one chunk; closed chunks are finished (normalized, logged)."""
        b0, b1, closed = chunk
        w = self.w[b0:b1]
        flat = w.reshape(-1)
        rng = self.stream.generator(b0 * w.shape[1] * w.shape[2])
        if w.dtype == np.float64:
            rng.random(out=flat)
        else:
            buf = self._buffer(flat.size)
            rng.random(out=buf)
            flat[...] = buf
        np.exp(np.multiply(w, -2.0, out=w), out=w)
        if self.mask is not None:
            np.copyto(w, 0.0, where=~self.mask[b0:b1])
        sums = w.sum(axis=2)
        if closed:
            _normalize(w, sums, None if self.seg is None else self.seg[b0:b1])
            _log(w)
        else:
            self.sums[b0:b1] = sums

    def normalize_open(self, chunk, tot) -> None:
        b0, b1, _ = chunk
        w = self.w[b0:b1]
        np.divide(w, tot[self.seg[b0:b1]][:, :, None], out=w)
        _log(w)


def _map(fn, items, threads: int) -> None:
    """``fn`` over ``items`` on ``threads`` threads (in order on this one when 1)."""
    if threads == 1:
        for it in items:
            fn(it)
        return
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fn, items))


def log_weights(rng: np.random.Generator, shape, dtype, seg: np.ndarray | None = None, num_segments: int = 0,
                mask: np.ndarray | None = None) -> np.ndarray:
    """``log(w / total)``, ``w = exp(-2 u)`` with ``u`` the next ``prod(shape)`` uniform doubles of ``rng`` in
    ``[0, 1)`` cast to ``dtype``: for ``shape = [N, K]`` the total of each row; for ``[N, Kp, Kc]`` with ``seg
    [N]`` the total of row ``r`` over the blocks of each segment (``num_segments`` of them). ``mask``
    (broadcastable to ``shape``): ``w`` is 0 where False. The result is 64-byte aligned (:func:`aligned_empty`)."""
    out = aligned_empty(shape, dtype)
    if out.size == 0:
        return out
    w = out.reshape(shape[0], 1, shape[1]) if len(shape) == 2 else out
    m = None if mask is None else np.broadcast_to(np.asarray(mask, bool), shape).reshape(w.shape)
    seg = None if seg is None else np.asarray(seg, np.int64)
    stream = _Stream(rng)
    chunks = _chunks(seg, w.shape[0], w.shape[1] * w.shape[2])
    open_ = [c for c in chunks if not c[2]]
    filler = _Filler(w, stream, seg, m, np.zeros(w.shape[:2], w.dtype) if open_ else None)
    threads = min(num_threads(), len(chunks)) if stream.jumps else 1
    _map(filler.draw, chunks, threads)
    if open_:  # segments across chunks: their totals in block order, as one add.at over all blocks
        blocks = np.concatenate([np.arange(b0, b1) for b0, b1, _ in open_])
        tot = np.zeros((max(num_segments, int(seg.max()) + 1), w.shape[1]), w.dtype)
        np.add.at(tot, seg[blocks], filler.sums[blocks])
        _map(lambda c: filler.normalize_open(c, tot), open_, min(threads, len(open_)))
    stream.skip(out.size)
    return out
