"""Block-sparse sum layer as Pallas kernels (Triton backend on GPU, interpret mode on CPU).

Kernels reading children straight out of the node buffer through the index tables
(no materialized ``[n, C*Kc, B]`` gather). A child block is the sum of ``M`` row blocks (``ch
[n, C, M]``; ``M = 1`` for ``ch [n, C]``): the folded plan's products are added up in the loads.
Weights enter as log-weights and are exponentiated per loaded tile (never the whole group).

* ``forward``: per (parent block, node tile, batch tile): an online log-sum-exp over the child
  blocks, ``acc = acc * exp(m_old - m_new) + W_c @ exp(x_c - m_new)``, then ``log(acc) + m``
  (``KernelConfig.span`` whole child blocks per step, gathered into one tile).
  With ``out_offset`` it writes the parents' rows of the node buffer in place (aliased output).
* ``backward_parents``: (1) per (parent block, node tile, batch tile): recompute the max ``m`` and
  the local sum ``s`` (never ``exp(m - value)``, which loses ``|value| * eps``) and write ``a =
  flow / s`` and ``m``; (2) per (parent block, child, node tile, child-node tile): the parameter
  flows ``W_c * (a @ y_c^T)``, reduced over the batch inside the program.
* ``backward_children``: per distinct child row block and batch tile, through the partition's
  inverse (parent) tables: ``flow_child = sum_parents exp(x - m_parent) * (W^T @ a_parent)``.
  Each program owns its output rows: no atomics, no per-edge intermediate. With ``flows`` it adds
  them into the flow buffer in place (aliased output).
* ``backward_exclusive``: a tree level (one child block per parent, one parent per child row block):
  the parent kernels, then per parent block ``W^T a`` once, added to all ``M`` row blocks of its
  folded child in place (``backward_children`` would recompute it per row block).
* ``backward_level``: a tree level at a batch of at most ``LEVEL_BATCH`` in one kernel: per (parent
  block, child-node tile) the block's shift, ``a``, the tile's parameter flows (the whole batch is in the
  program: no reduction across programs; added into the parameter-flow buffer in place) and its child
  flows into every row block of the folded child.

``forward`` and ``backward_atomic`` also run on tables padded to a kernel class's shape
(:func:`jaxpc.compiler.compile.shared_kernel_tables`) with the partition's own ``blocks`` and ``fanin`` in their
offsets operand: the programs of padding blocks return at once and the forward reads its fan-in at run time, so the
partitions of one class share one traced, lowered and compiled kernel.

Shapes are padded to powers of two inside the kernels (masked loads and stores); products with
all dimensions >= 16 use the tensor cores (``pl.dot`` at the requested precision), smaller ones
a broadcast multiply-add in float32.

GeneralLL's exponent ``alpha`` enters as the factors ``exp(alpha log w)`` and ``exp(alpha (x - m))``, ``m`` a
block's largest child value: accurate for ``1e-3 <= alpha <= 1`` (:func:`jaxpc.ops.sum_layer.factored`); above 1
they underflow in float32, below 1e-3 their sum rounds to within ``alpha`` of 1, and the routes send such layers to
XLA's terms (:func:`jaxpc.engine.routing.factored_forward`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Final

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from .x32 import x32

try:  # the Triton backend's memory ops (jax >= 0.11 keeps them here)
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - reported by available()
    plgpu = None

Array = jax.Array
_NEG = -jnp.inf


def _exp(x: Array) -> Array:
    """The kernels' exponential: libdevice's accurate one (``benchmarks/weight_exp.py --variants exp2`` times the
    approximate one in its place)."""
    return jnp.exp(x)


def _log(x: Array) -> Array:
    """The kernels' logarithm (as :func:`_exp`)."""
    return jnp.log(x)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tuning knobs (static; part of the executable key through the options' impl)."""

    block_b: int = 32  # batch tile
    block_k: int = 64  # tile of parent nodes (forward, parent backward) / child nodes (child backward)
    num_warps: int = 4
    num_stages: int = 2
    block_c: int = 0  # chunk of the reduced dimension (child nodes / parent nodes); 0: block_r elements per tile
    block_r: int = 8192  # (with block_c=0) elements of a weight tile: the chunk is block_r // tile, capped by the size
    prefetch: bool = False  # forward: each step over the children issues the next chunk's loads before its arithmetic
    span: int = 1  # forward: child blocks per step over the children (blocks of a power-of-two size, read whole)


def available() -> bool:
    return plgpu is not None


def interpret_mode() -> bool:
    """Whether the kernels run in Pallas's interpret mode: everywhere but on a GPU."""
    return jax.default_backend() != "gpu"


def p2(n: int) -> int:
    return max(1, pl.next_power_of_2(int(n)))


def _compiler_params(cfg: KernelConfig):
    return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


DIALECTS_WITHOUT_MODULES: Final = ("tt",)  # MLIR dialects that the kernels' lowering builds with no Python module


def cache_missing_dialect_modules(namespaces=DIALECTS_WITHOUT_MODULES) -> None:
    """Record as missing (``None`` in ``sys.modules``) the Python modules that MLIR's bindings look for, and do
    not find, for each operation of dialects ``namespaces`` that a lowering builds: one module per dialect search
    prefix (``jaxlib.mlir.dialects.tt`` and three more under jax 0.12). MLIR keeps only the modules it found, so
    without this every Triton operation of a Pallas kernel's lowering walks the import path for each prefix again
    (PD-128's flows at B=16, cross-lowered for CUDA on the CPU: 4,912 failed imports, lowering 0.46-0.54 against
    0.25-0.33 s with them recorded). Modules that exist are left alone; the first lookup of a recorded name raises
    ``ModuleNotFoundError`` at once, as the search did."""
    import importlib.util
    import sys

    try:
        from jaxlib.mlir._mlir_libs import _mlir
        prefixes = list(_mlir.globals.dialect_search_modules)
    except (ImportError, AttributeError):
        return
    for ns in namespaces:
        for prefix in prefixes:
            name = f"{prefix}.{ns}"
            if name in sys.modules:
                continue
            try:
                found = importlib.util.find_spec(name) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                sys.modules[name] = None


def call_kernel(kernel, cfg: KernelConfig, **kw):
    """``pl.pallas_call(kernel, ...)`` under ``jax.jit``, one jitted function per kernel and settings: calls with
    equal settings and argument shapes (an unrolled tree's levels of one shape, the entry points of one batch
    bucket) share one trace of the kernel and, within an executable, one lowering. Settings that do not hash
    (none of this module's) get a plain ``pallas_call``. Outside interpret mode the kernel lowers to Triton, so
    :func:`cache_missing_dialect_modules` runs first."""
    interp = interpret_mode()
    if not interp:
        cache_missing_dialect_modules()

    def make():
        return pl.pallas_call(kernel, compiler_params=None if interp else _compiler_params(cfg), interpret=interp,
                              **kw)
    try:
        key = (_partial_key(kernel), cfg, interp, tuple(sorted((k, _hashable(v)) for k, v in kw.items())))
        fn = _KERNELS.get(key)
    except TypeError:
        return x32(make())
    if fn is None:
        if len(_KERNELS) >= 4096:
            _KERNELS.clear()
        fn = _KERNELS[key] = x32(jax.jit(make()))
    return fn


def _partial_key(kernel):
    if isinstance(kernel, functools.partial):
        return (kernel.func, kernel.args, tuple(sorted(kernel.keywords.items())))
    return kernel


def _hashable(v):
    if isinstance(v, dict):
        return tuple(sorted(v.items()))
    if isinstance(v, list):
        return tuple(v)
    return v


_KERNELS: dict = {}  # call_kernel's jitted pallas_calls by kernel and settings


def mm(a, b, precision: str, trans_a: bool = False, trans_b: bool = False):
    """``op(a) @ op(b)`` inside a kernel (``op`` transposes when asked), float32 result."""
    M, K = (a.shape[1], a.shape[0]) if trans_a else a.shape
    N = b.shape[0] if trans_b else b.shape[1]
    if min(M, K, N) >= 16:
        a2 = a.T if trans_a else a
        b2 = b.T if trans_b else b
        if precision == "bf16":
            return jnp.dot(a2.astype(jnp.bfloat16), b2.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
        prec = lax.Precision.HIGHEST if precision == "fp32" else lax.Precision.DEFAULT
        return jnp.dot(a2, b2, precision=prec, preferred_element_type=jnp.float32)
    a3 = a.T[:, :, None] if trans_a else a[:, :, None]  # [M, K, 1]
    b3 = b.T[None, :, :] if trans_b else b[None, :, :]  # [1, K, N]
    return jnp.sum(a3 * b3, axis=1)


def block_grid(n: int, *tiles: int) -> tuple:
    """Launch grid over ``n`` blocks and ``tiles`` programs per block, the block axis last: the Triton backend
    runs the first grid axis fastest, so the programs of one block run one after the other and all but the
    first read its weights and children from L2 (with the block axis first, the programs running together
    belong to different blocks and each fetches its tiles from HBM). :func:`block_ids` reads the ids back."""
    return (*tiles, n)


def block_ids(ndim: int) -> tuple:
    """``(block, *tile ids)`` of a program of a :func:`block_grid` grid of ``ndim`` axes."""
    return (pl.program_id(ndim - 1), *(pl.program_id(a) for a in range(ndim - 1)))


def load_tile(ref, rows, cols, rmask, cmask, other):
    return plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=rmask[:, None] & cmask[None, :], other=other)


def store_tile(ref, rows, cols, val, rmask, cmask):
    plgpu.store(ref.at[rows[:, None], cols[None, :]], val, mask=rmask[:, None] & cmask[None, :])


def add_tile(ref, rows, cols, val, rmask, cmask):
    """``ref[rows, cols] += val`` by atomic adds (other programs add to the same entries); in interpret mode, where
    the programs run one by one (and Pallas has no masked atomics), a load and a store."""
    if interpret_mode():
        store_tile(ref, rows, cols, load_tile(ref, rows, cols, rmask, cmask, 0.0) + val, rmask, cmask)
    else:
        plgpu.atomic_add(ref, (rows[:, None], cols[None, :]), val, mask=rmask[:, None] & cmask[None, :])


def _split(fp, s):
    """The parents' flows per unit of their local sums, ``fp / s``: 0 for parents that carry no flow or are
    impossible, never ``0 / 0``."""
    return jnp.where((fp == 0) | (s == 0), 0.0, fp / jnp.where(s == 0, 1.0, s))


def _stored_split(buf_ref, flow_ref, rows, cols, rmask, cmask, safe, alpha):
    """:func:`_split` of the parents at ``rows`` with the local sums from their stored values, ``exp(alpha (value -
    shift))`` (``safe``: the block's finite shift per sample): ``[len(rows), BB]``."""
    s = _exp(alpha * (load_tile(buf_ref, rows, cols, rmask, cmask, _NEG) - safe[None, :]))
    return _split(load_tile(flow_ref, rows, cols, rmask, cmask, 0.0), s)


def _load_child(buf_ref, ch_ref, i, c, kc, cols, cmask, *, M, Kc):
    """Values ``[len(kc), BB]`` of child block ``c`` of parent block ``i``: the sum of its ``M`` row blocks
    (masked entries ``-inf``)."""
    return _load_rows(buf_ref, [ch_ref[i, c, m] for m in range(M)], kc, cols, cmask, Kc)


def _load_rows(buf_ref, starts, kc, cols, cmask, Kc, valid=True):
    """The sum of the row blocks that begin at ``starts`` (a folded child's; scalars, or a start per node), nodes
    ``kc``: ``[len(kc), BB]`` (``-inf`` where masked; ``valid``: a further mask per node)."""
    rmask = (kc < Kc) & valid
    x = load_tile(buf_ref, starts[0] + kc, cols, rmask, cmask, _NEG)
    for r0 in starts[1:]:
        x = x + load_tile(buf_ref, r0 + kc, cols, rmask, cmask, 0.0)
    return x


def _load_w(w_ref, p, kp, kc, Kp, Kc, alpha, valid=True):
    """``exp(alpha * log w)`` of the ``[len(kp), len(kc)]`` tile of weight block ``p`` (a scalar, or ``[1,
    len(kc)]``: a block per child node; 0 where masked, ``valid`` a scalar or per child node)."""
    mask = (kp[:, None] < Kp) & (kc[None, :] < Kc) & valid
    return _exp(alpha * plgpu.load(w_ref.at[p, kp[:, None], kc[None, :]], mask=mask, other=_NEG))


def _online_sum(i, ch_ref, pid_ref, w_ref, buf_ref, cols, cmask, kp, *, C, M, Kp, Kc, KC, alpha, precision,
                prefetch=False, span=1):
    """Running max ``m [BB]`` and sum ``acc [len(kp), BB]`` over the ``C`` children (static, or a traced count) of
    parent block ``i`` for the parent nodes ``kp`` of the block. Child blocks are read in chunks of ``KC`` nodes, or
    with ``span > 1`` ``span`` whole blocks per step (:func:`_span_tiles`); with ``prefetch`` each step issues the
    next chunk's loads before its own arithmetic."""
    if span > 1:
        steps = lax.div(C + span - 1, jnp.int32(span)) if isinstance(C, jax.Array) else -(-C // span)

        def fetch(s, live=True):
            return _span_tiles(i, s, ch_ref, pid_ref, w_ref, buf_ref, cols, cmask, kp, live, C=C, M=M, Kp=Kp,
                               Kc=Kc, span=span, alpha=alpha)
    else:
        nq = -(-Kc // KC)
        steps = C * nq

        def fetch(cq, live=True):
            c, q = lax.div(cq, jnp.int32(nq)), lax.rem(cq, jnp.int32(nq))  # (jnp's // and % don't lower)
            mask = cmask
            if live is not True:  # the step after the last one (prefetch) reads nothing
                c, mask = jnp.minimum(c, C - 1), cmask & live
            kc = q * KC + jnp.arange(KC)
            x = _load_child(buf_ref, ch_ref, i, c, kc, cols, mask, M=M, Kc=Kc)
            return x, _load_w(w_ref, pid_ref[i, c], kp, kc, Kp, Kc, alpha, live)

    def add(carry, x, w):
        m, acc = carry
        m_new = jnp.maximum(m, jnp.max(x, axis=0))
        safe = jnp.where(m_new == _NEG, 0.0, m_new)
        rescale = jnp.where(m == _NEG, 0.0, _exp(alpha * (m - safe)))
        y = _exp(alpha * (x - safe[None, :]))
        return m_new, acc * rescale[None, :] + mm(w, y, precision)

    init = (jnp.full(cols.shape, _NEG, jnp.float32), jnp.zeros((kp.shape[0], cols.shape[0]), jnp.float32))
    if not prefetch:
        return lax.fori_loop(0, steps, lambda cq, carry: add(carry, *fetch(cq)), init)

    def body(cq, carry):
        carry, tiles = carry
        nxt = fetch(cq + 1, cq + 1 < steps)
        return add(carry, *tiles), nxt

    return lax.fori_loop(0, steps, body, (init, fetch(0)))[0]


MAX_UNROLL: Final = 8  # child nodes a step of the max-plus forward's loop (:func:`_online_max`), unrolled
MAX_FILL: Final = 264  # two programs per SM of an H100 (132): the max-plus forward's grid with 128-row tiles


def max_tiles(n: int, Kp: int, Kc: int, B: int) -> tuple[int, int, int]:
    """``(samples, parent nodes, child nodes a step)`` of a program of the max-plus forward (:func:`_online_max`):
    tiles of 64 samples by 128 parent nodes, 64 where the grid would then hold fewer than :data:`MAX_FILL` programs.
    On an H100, max and first maximizers of 64 blocks of ``[256, 512]`` at B=512: 1.30 ms with 128 parent nodes,
    1.69 with 64 (XLA's reduction 2.59); one block of ``[1024, 1024]``: 0.50 and 0.30 (XLA 0.51)."""
    BB = min(64, p2(B))
    KT = min(128, p2(Kp))
    if KT > 64 and n * pl.cdiv(Kp, KT) * pl.cdiv(B, BB) < MAX_FILL:
        KT = 64
    return BB, KT, min(MAX_UNROLL if KT <= 64 else MAX_UNROLL // 2, p2(Kc))


def _online_max(i, ch_ref, pid_ref, w_ref, buf_ref, cols, cmask, kp, *, C, M, Kp, Kc, U, first=False):
    """``max_{c, j} (log w[pid[i, c], kp, j] + x_c[j])``: the max-product values ``[len(kp), BB]`` of parent nodes
    ``kp`` of block ``i`` over its ``C`` child blocks (static, or a traced count), one child node at a time (``U``
    a step, unrolled): each term, the one float32 sum that the reference's ``max`` reduces (masked terms ``-inf``),
    enters the running max as a rank-one update of the tile (no ``[parents, children, samples]`` tile to reduce).
    With ``first``, ``(values, first maximizers)``: each parent's first child in ``c * Kc + j`` order whose term is
    its value, ``C * Kc`` where the value is not finite (as :func:`jaxpc.ops.sum_layer.max_and_first`)."""
    nq = -(-Kc // U)

    def step(cq, carry):
        acc, idx = carry
        c, q = lax.div(cq, jnp.int32(nq)), lax.rem(cq, jnp.int32(nq))
        p = pid_ref[i, c]
        starts = [ch_ref[i, c, m] for m in range(M)]
        for u in range(U):
            j = q * U + u
            valid = j < Kc
            x = plgpu.load(buf_ref.at[starts[0] + j, cols], mask=cmask & valid, other=_NEG)
            for r0 in starts[1:]:
                x = x + plgpu.load(buf_ref.at[r0 + j, cols], mask=cmask & valid, other=0.0)
            t = plgpu.load(w_ref.at[p, kp, j], mask=(kp < Kp) & valid, other=_NEG)[:, None] + x[None, :]
            if first:  # a later child replaces the maximizer only where its term is strictly larger
                idx = jnp.where(t > acc, c * Kc + j, idx)
            acc = jnp.maximum(acc, t)
        return acc, idx

    shape = (kp.shape[0], cols.shape[0])
    init = (jnp.full(shape, _NEG, jnp.float32), jnp.zeros(shape, jnp.int32))
    acc, idx = lax.fori_loop(0, C * nq, step, init)
    if not first:
        return acc
    return acc, jnp.where(jnp.isfinite(acc), idx, C * Kc)


def _table_vec(tab, idx: tuple, mask):
    """Entries of an index table (a ref, or a :class:`FlatTable`) at ``idx`` (scalars and one vector), 0 where not
    ``mask``: one gathering load."""
    if isinstance(tab, FlatTable):
        return plgpu.load(tab.ref.at[tab.flat(idx)], mask=mask, other=0)
    return plgpu.load(tab.at[idx], mask=mask, other=0)


def _span_tiles(i, s, ch_ref, pid_ref, w_ref, buf_ref, cols, cmask, kp, live, *, C, M, Kp, Kc, span, alpha):
    """Step ``s`` of :func:`_online_sum` over ``span`` whole child blocks of parent block ``i`` (children ``s * span``
    on, those from ``C`` on masked): their values ``[span * Kc, BB]`` (the sum of their ``M`` row blocks, gathered
    row by row) and the weights ``exp(alpha log w)`` ``[len(kp), span * Kc]``. One step's tiles span several blocks:
    fewer, larger steps (one max and one product per ``span`` blocks, their loads in flight together)."""
    j = jnp.arange(span * Kc)
    c = s * span + lax.div(j, jnp.int32(Kc))
    r = lax.rem(j, jnp.int32(Kc))
    valid = (c < C) & live
    x = _load_rows(buf_ref, [_table_vec(ch_ref, (i, c, m), valid) for m in range(M)], r, cols, cmask, Kc, valid)
    return x, _load_w(w_ref, _table_vec(pid_ref, (i, c), valid)[None, :], kp, r, Kp, Kc, alpha, valid)


def tables3(ch: Array) -> Array:
    return ch if ch.ndim == 3 else ch[:, :, None]


def check_extent(n: int, C: int, blocks: int | None, fanin: int | None, out_offset) -> tuple[int, int]:
    """``(blocks, fanin)``: the partition's parent blocks and fan-in in tables of ``n`` blocks of ``C`` children (all of
    them by default); padded tables run in place only."""
    b, f = n if blocks is None else int(blocks), C if fanin is None else int(fanin)
    if not (0 < b <= n and 0 < f <= C) or ((b, f) != (n, C) and out_offset is None):
        raise ValueError(f"blocks and fanin must be in [1, {n}] and [1, {C}] (the tables' shape), below it in place "
                         f"only; got {blocks} and {fanin}")
    return b, f


def block_offsets(out_offset, extent: tuple[int, int], tables: tuple[int, ...] = ()) -> Array:
    """The int32 operand of the fan-in kernels: the partition's first row, then its parent blocks and fan-in in the
    tables (:func:`check_extent`; the programs of padding blocks return at once), then ``tables``, the offsets of
    its tables in a packed table array. A constant for a static ``out_offset``; for a traced one, one select (a
    stack of the scalar and constants is a concatenation, which XLA runs as a kernel and device copies)."""
    rest = np.array([0, extent[0], extent[1], *tables], np.int32)
    if isinstance(out_offset, (int, np.integer, np.ndarray)):
        rest[0] = int(out_offset)
        return jnp.asarray(rest)
    return jnp.where(jnp.arange(rest.size) == 0, jnp.asarray(out_offset, jnp.int32).reshape(()), rest)


class FlatTable:
    """An index table of static ``shape`` read at element ``base`` of a flat ref (a packed table array): indexed
    like the table's own ref, one scalar per index tuple."""

    def __init__(self, ref, base, shape: tuple[int, ...]):
        self.ref, self.base = ref, base
        self.strides = tuple(int(np.prod(shape[k + 1:], dtype=np.int64)) for k in range(len(shape)))

    def flat(self, idx):
        """The element offsets of ``idx`` (scalars or arrays) in the flat ref."""
        idx = idx if isinstance(idx, tuple) else (idx,)
        flat = self.base
        for i, stride in zip(idx, self.strides):
            flat = flat + i * stride
        return flat

    def __getitem__(self, idx):
        return self.ref[self.flat(idx)]


def _chunk(config: KernelConfig, tile: int, K: int) -> int:
    """Chunk of the reduced dimension (of size ``K``) next to a ``tile``: fewer, larger steps keep a program's
    serial chain of loads short."""
    c = config.block_c or max(16, config.block_r // tile)
    return min(p2(c), p2(K))


def tiles(config: KernelConfig, B: int, Kp: int, Kc: int):
    """(batch tile, parent-node tile, child-node chunk)."""
    KT = min(config.block_k, p2(Kp))
    return min(config.block_b, p2(B)), KT, _chunk(config, KT, Kc)


FILL_PROGRAMS: Final = 128  # about the H200's 132 SMs: a forward grid with fewer programs leaves SMs idle


def forward_config(n: int, Kp: int, B: int, config: KernelConfig | None = None) -> KernelConfig:
    """The forward kernel's tiles for ``n`` parent blocks of ``Kp`` nodes at batch ``B``: ``config`` where given (a
    tuned one), else :class:`KernelConfig`'s defaults, except where the whole batch is one batch tile and the grid
    has fewer than :data:`FILL_PROGRAMS` programs (a tree level of a few large blocks at a small batch, which
    leaves most of the GPU's SMs idle): the parent-node tile is halved, down to 16 nodes, until it has (more
    programs, each shorter), with chunks of 64 child nodes next to a 32-node tile and of 256 next to a 16-node one.
    HCLT-256 at batch 16 on the H200 (``benchmarks/plans.py``, ``fold`` against ``fold-deftiles``, two runs each):
    forward 0.85-0.87 against 1.11-1.13 ms, forward + flows in a pipelined loop 1.43-1.44 against 1.53-1.57. (A
    variant with 32-node tiles and 256-node chunks below 32 programs only, chosen from single-level timings,
    gave 1.01 ms and 1.44-1.45.)"""
    if config is not None:
        return config
    cfg = KernelConfig()
    BB, KT0 = min(cfg.block_b, p2(B)), min(cfg.block_k, p2(Kp))
    if B > BB:
        return cfg
    KT = KT0
    while KT > 16 and n * pl.cdiv(Kp, KT) < FILL_PROGRAMS:
        KT //= 2
    if KT == KT0:
        return cfg
    return dataclasses.replace(cfg, block_k=KT, block_c=64 if KT >= 32 else 256)


# ---- forward -------------------------------------------------------------------------------------

SPAN_NODES: Final = 64  # the most child nodes per step of a spanning forward loop


def forward_span(config: KernelConfig, C: int, Kc: int) -> int:
    """Child blocks per step of the forward's loop: ``config.span`` (a power of two) up to the fan-in's and to
    :data:`SPAN_NODES` child nodes a step, for blocks of a power-of-two size (read whole); else 1. On the H200 a
    PD-256's step took 62.6 ms with 64 child nodes a step, 65.0 with 128 and 64.1 with 32."""
    if config.span < 1 or config.span & (config.span - 1):
        raise ValueError(f"KernelConfig.span must be a power of two, got {config.span}")
    if Kc != p2(Kc) or C < 2:
        return 1
    return max(1, min(config.span, p2(C), SPAN_NODES // Kc))


def forward_tile(i, first, kp, cols, cmask, ch_ref, pid_ref, w_ref, buf_ref, out_ref, *, C, M, Kp, Kc, KC, alpha,
                 precision, prefetch=False, span=1, mpe=False, firsts_ref=None):
    """The values of parent nodes ``kp`` of block ``i`` (rows ``first + kp``) for samples ``cols``, read from
    ``buf_ref`` and stored into ``out_ref``; returns the block's shift (its children's max) per sample. ``mpe``:
    max-product values (:func:`_online_max`, ``KC`` child nodes a step), and no shift (None); with ``firsts_ref``
    each parent's first maximizing child stored there too, at the parents' rows."""
    if mpe:
        out = _online_max(i, ch_ref, pid_ref, w_ref, buf_ref, cols, cmask, kp, C=C, M=M, Kp=Kp, Kc=Kc, U=KC,
                          first=firsts_ref is not None)
        if firsts_ref is not None:
            out, idx = out
            store_tile(firsts_ref, first + kp, cols, idx, kp < Kp, cmask)
        store_tile(out_ref, first + kp, cols, out, kp < Kp, cmask)
        return None
    m, acc = _online_sum(i, ch_ref, pid_ref, w_ref, buf_ref, cols, cmask, kp, C=C, M=M, Kp=Kp, Kc=Kc, KC=KC,
                         alpha=alpha, precision=precision, prefetch=prefetch, span=span)
    safe = jnp.where(m == _NEG, 0.0, m)
    pos = acc > 0
    # an empty sum is -inf; a NaN child (a value out of range with validation off) stays NaN, never -inf
    out = jnp.where(pos, _log(jnp.where(pos, acc, 1.0)) / alpha + safe[None, :], jnp.where(acc == 0, _NEG, jnp.nan))
    store_tile(out_ref, first + kp, cols, out, kp < Kp, cmask)
    return m


def _fwd_kernel(off_ref, ch_ref, pid_ref, w_ref, buf_ref, *refs, C, M, Kp, Kc, KT, KC, BB, B, alpha, precision,
                unit, prefetch, flat=None, span=1, mpe=False, firsts=False):
    # with shifts: (shifts in, buf, shifts); with first maximizers: (firsts in, buf, firsts)
    out_ref, shift_ref = (refs[1], refs[2]) if unit or firsts else (refs[0], None)
    firsts_ref, shift_ref = (shift_ref, None) if firsts else (None, shift_ref)
    if flat is not None:  # ch_ref and pid_ref: a packed table array, the tables at off_ref[3] and off_ref[4]
        ch_ref, pid_ref = FlatTable(ch_ref, off_ref[3], flat), FlatTable(pid_ref, off_ref[4], flat[:2])
    i, k, t = block_ids(3)
    C = off_ref[2] if C is None else C  # padded tables: the partition's fan-in, read at run time

    @pl.when(i < off_ref[1])  # the tables' real blocks; the programs of padding blocks do nothing
    def _():
        cols = t * BB + jnp.arange(BB)
        cmask = cols < B
        kp = k * KT + jnp.arange(KT)
        m = forward_tile(i, off_ref[0] + i * Kp, kp, cols, cmask, ch_ref, pid_ref, w_ref, buf_ref, out_ref, C=C,
                         M=M, Kp=Kp, Kc=Kc, KC=KC, alpha=alpha, precision=precision, prefetch=prefetch, span=span,
                         mpe=mpe, firsts_ref=firsts_ref)
        if unit:  # the block's shift, the children's max, at shift row (first parent row) / unit
            plgpu.store(shift_ref.at[lax.div(off_ref[0] + i * Kp, jnp.int32(unit)), cols], m, mask=cmask & (k == 0))


def forward(buf: Array, ch: Array, pid: Array, w: Array, *, Kp: int, Kc: int, alpha: float = 1.0,
            precision: str = "fp32", config: KernelConfig = KernelConfig(), out_offset=None, shifts=None,
            unit: int = 0, blocks: int | None = None, fanin: int | None = None, source=None,
            propagation: str = "LL", firsts=None):
    """Sum-layer values. ``ch [n, C]`` or ``[n, C, M]``, ``w``: log-weights ``[P, Kp, Kc]`` (exponentiated per
    tile). Returns ``[n * Kp, B]``; with ``out_offset`` (a float32 ``buf``) the buffer with the parents'
    rows ``out_offset + [0, n * Kp)`` written in place. With ``shifts`` (float32 ``[ceil(R / unit), B]``,
    ``out_offset`` and every parent block's first row multiples of ``unit``) it returns ``(buf, shifts)``,
    ``shifts`` updated in place with each parent block's shift: the max over its children's values per sample
    (``-inf`` when they all are), at row ``first parent row / unit``. ``blocks`` and ``fanin`` (in place only):
    padded tables (:func:`jaxpc.compiler.compile.shared_kernel_tables`), of which the first ``blocks`` parent blocks
    and the first ``fanin`` children of each are the partition's; the programs of padding blocks write nothing. With
    ``fanin`` the kernel reads the fan-in at run time: one kernel serves tables of one shape. ``source`` (in place
    only): ``(packed, (ch offset, pid offset))``, an int32 array in which ``ch`` and ``pid`` lie whole at those
    offsets (:func:`jaxpc.ops.tables.kernel_source`), which the kernel then reads instead of copies of them.
    ``propagation="MPE"``: max-product values, ``max_{c, j} (log w + x)`` (:func:`_online_max`; the reference's
    terms, each the same float32 sum), without shifts (``alpha``, ``precision`` and ``config``'s tiles do not apply:
    :func:`max_tiles`); with ``firsts`` (in place, int32 ``[R, B]``) it returns ``(buf, firsts)``, ``firsts``
    updated in place with each parent's first maximizing child at the parent's row (``C * Kc`` where its value is
    not finite; :func:`jaxpc.ops.sum_layer.max_and_first`)."""
    if propagation not in ("LL", "GeneralLL", "MPE"):
        raise ValueError(f"unknown propagation {propagation!r}")
    mpe = propagation == "MPE"
    ch = tables3(ch)
    n, C, M = ch.shape
    R, B = buf.shape
    extent, dynamic = check_extent(n, C, blocks, fanin, out_offset), fanin is not None
    BB, KT, KC = max_tiles(n, Kp, Kc, B) if mpe else tiles(config, B, Kp, Kc)
    if mpe:  # (no pipelined loads: the loop holds no matrix product)
        config = dataclasses.replace(config, num_warps=4, num_stages=1)
    keep = shifts is not None
    if keep and (mpe or out_offset is None or unit < 1 or Kp % unit):
        raise ValueError(f"shifts are kept by the in-place sum-product forward with a unit dividing Kp={Kp}, got "
                         f"unit={unit}{' and propagation=MPE' * mpe}")
    if firsts is not None and (not mpe or out_offset is None or firsts.shape != buf.shape
                               or firsts.dtype != jnp.int32):
        raise ValueError(f"firsts are kept by the in-place max-product forward in an int32 buffer of the node "
                         f"buffer's shape {list(buf.shape)}, got {list(firsts.shape)} {firsts.dtype} with "
                         f"propagation={propagation!r}, out_offset={out_offset}")
    flat = (n, C, M) if source is not None and out_offset is not None else None
    kernel = functools.partial(_fwd_kernel, C=None if dynamic else C, M=M, Kp=Kp, Kc=Kc, KT=KT, KC=KC, BB=BB, B=B,
                               alpha=float(alpha), precision=precision, unit=unit if keep else 0,
                               prefetch=config.prefetch and not mpe, flat=flat,
                               span=1 if mpe else forward_span(config, C, Kc), mpe=mpe, firsts=firsts is not None)
    grid = block_grid(n, pl.cdiv(Kp, KT), pl.cdiv(B, BB))
    if out_offset is None:
        off = block_offsets(0, extent)
        return call_kernel(kernel, config, grid=grid, out_shape=jax.ShapeDtypeStruct((n * Kp, B), jnp.float32),
                     name="jaxpc_sum_forward")(off, ch, pid, w, buf.astype(jnp.float32))
    if buf.dtype != jnp.float32:
        raise TypeError(f"in-place sum layer needs a float32 buffer, got {buf.dtype}")
    off = block_offsets(out_offset, extent, () if flat is None else tuple(source[1]))
    if flat is not None:
        ch = pid = source[0]
    if keep or firsts is not None:
        kept = shifts if keep else firsts
        return call_kernel(kernel, config, grid=grid, out_shape=(jax.ShapeDtypeStruct((R, B), jnp.float32),
                                                           jax.ShapeDtypeStruct(kept.shape, kept.dtype)),
                     input_output_aliases={4: 0, 5: 1}, name="jaxpc_sum_forward_inplace")(off, ch, pid, w, buf, kept)
    return call_kernel(kernel, config, grid=grid, out_shape=jax.ShapeDtypeStruct((R, B), jnp.float32),
                 input_output_aliases={4: 0}, name="jaxpc_sum_forward_inplace")(off, ch, pid, w, buf)


# ---- backward: parent side -------------------------------------------------------------------------

def _scale_kernel(off_ref, ch_ref, pid_ref, w_ref, buf_ref, flow_ref, a_ref, m_ref, *, C, M, Kp, Kc, KT, KC, BB, B,
                  alpha, precision):
    i, k, t = block_ids(3)
    cols = t * BB + jnp.arange(BB)
    cmask = cols < B
    kp = k * KT + jnp.arange(KT)
    m, s = _online_sum(i, ch_ref, pid_ref, w_ref, buf_ref, cols, cmask, kp, C=C, M=M, Kp=Kp, Kc=Kc, KC=KC,
                       alpha=alpha, precision=precision)
    a = _split(load_tile(flow_ref, off_ref[0] + i * Kp + kp, cols, kp < Kp, cmask, 0.0), s)
    store_tile(a_ref, i * Kp + kp, cols, a, kp < Kp, cmask)
    plgpu.store(m_ref.at[i, cols], m, mask=cmask & (k == 0))


def _pflow_kernel(ch_ref, pid_ref, w_ref, buf_ref, a_ref, m_ref, pf_ref, *, C, M, Kp, Kc, KT, KC, BB, B, alpha,
                  precision):
    ic, k, q = block_ids(3)
    i, c = lax.div(ic, jnp.int32(C)), lax.rem(ic, jnp.int32(C))
    kp = k * KT + jnp.arange(KT)
    kc = q * KC + jnp.arange(KC)

    def tile(t, acc):
        cols = t * BB + jnp.arange(BB)
        cmask = cols < B
        a = load_tile(a_ref, i * Kp + kp, cols, kp < Kp, cmask, 0.0)
        m = plgpu.load(m_ref.at[i, cols], mask=cmask, other=0.0)
        safe = jnp.where(m == _NEG, 0.0, m)
        y = _exp(alpha * (_load_child(buf_ref, ch_ref, i, c, kc, cols, cmask, M=M, Kc=Kc) - safe[None, :]))
        return acc + mm(a, y, precision, trans_b=True)

    acc = lax.fori_loop(0, pl.cdiv(B, BB), tile, jnp.zeros((KT, KC), jnp.float32))
    w = _load_w(w_ref, pid_ref[i, c], kp, kc, Kp, Kc, alpha)
    plgpu.store(pf_ref.at[i, c, kp[:, None], kc[None, :]], w * acc, mask=(kp[:, None] < Kp) & (kc[None, :] < Kc))


def backward_parents(buf: Array, flows: Array, out_offset, ch: Array, pid: Array, w: Array, *, Kp: int, Kc: int,
                     alpha: float = 1.0, precision: str = "fp32", config: KernelConfig = KernelConfig(),
                     param_flows: bool = True):
    """``(a [n*Kp, B], m [n, B], param_flows [n, C, Kp, Kc] or None)`` of one sum partition whose parents
    sit at rows ``out_offset + [0, n * Kp)``."""
    ch = tables3(ch)
    n, C, M = ch.shape
    B = buf.shape[1]
    BB, KT, KC = tiles(config, B, Kp, Kc)
    static = dict(C=C, M=M, Kp=Kp, Kc=Kc, KT=KT, KC=KC, BB=BB, B=B, alpha=float(alpha), precision=precision)
    off = jnp.asarray(out_offset, jnp.int32).reshape(1)
    buf = buf.astype(jnp.float32)
    grid = block_grid(n, pl.cdiv(Kp, KT), pl.cdiv(B, BB))
    a, m = call_kernel(functools.partial(_scale_kernel, **static), config, grid=grid,
                 out_shape=(jax.ShapeDtypeStruct((n * Kp, B), jnp.float32), jax.ShapeDtypeStruct((n, B), jnp.float32)),
                 name="jaxpc_sum_backward_scale")(off, ch, pid, w, buf, flows.astype(jnp.float32))
    if not param_flows:
        return a, m, None
    KC2 = min(config.block_k, p2(Kc))  # the parameter-flow tile is [KT, KC2], reduced over the batch
    static.update(KC=KC2)
    grid = block_grid(n * C, pl.cdiv(Kp, KT), pl.cdiv(Kc, KC2))
    pf = call_kernel(functools.partial(_pflow_kernel, **static), config, grid=grid,
               out_shape=jax.ShapeDtypeStruct((n, C, Kp, Kc), jnp.float32),
               name="jaxpc_sum_backward_param_flows")(ch, pid, w, buf, a, m)
    return a, m, pf


def _pflow_after_kernel(prow_ref, srow_ref, ch_ref, pid_ref, w_ref, buf_ref, flow_ref, shift_ref, pf_ref, *, C, M, Kp,
                        Kc, KT, KC, KS, BB, B, alpha, precision):
    ic, k, q = block_ids(3)
    i, c = lax.div(ic, jnp.int32(C)), lax.rem(ic, jnp.int32(C))
    kp = k * KT + jnp.arange(KT)
    kc = q * KC + jnp.arange(KC)
    rows = prow_ref[i] + kp
    srow = srow_ref[i]
    nq = -(-Kc // KS)

    def tile(t, acc):
        cols = t * BB + jnp.arange(BB)
        cmask = cols < B
        own = cmask & (srow < 0)  # a block without a kept shift: its children's max, here (else no loads)

        def child_max(cq, m):
            c2, q2 = lax.div(cq, jnp.int32(nq)), lax.rem(cq, jnp.int32(nq))
            x = _load_child(buf_ref, ch_ref, i, c2, q2 * KS + jnp.arange(KS), cols, own, M=M, Kc=Kc)
            return jnp.maximum(m, jnp.max(x, axis=0))

        kept = plgpu.load(shift_ref.at[jnp.maximum(srow, 0), cols], mask=cmask & (srow >= 0), other=0.0)
        m = jnp.where(srow < 0, lax.fori_loop(0, C * nq, child_max, jnp.full((BB,), _NEG, jnp.float32)), kept)
        safe = jnp.where(m == _NEG, 0.0, m)
        a = _stored_split(buf_ref, flow_ref, rows, cols, kp < Kp, cmask, safe, alpha)
        y = _exp(alpha * (_load_child(buf_ref, ch_ref, i, c, kc, cols, cmask, M=M, Kc=Kc) - safe[None, :]))
        return acc + mm(a, y, precision, trans_b=True)

    acc = lax.fori_loop(0, pl.cdiv(B, BB), tile, jnp.zeros((KT, KC), jnp.float32))
    w = _load_w(w_ref, pid_ref[i, c], kp, kc, Kp, Kc, alpha)
    plgpu.store(pf_ref.at[i, c, kp[:, None], kc[None, :]], w * acc, mask=(kp[:, None] < Kp) & (kc[None, :] < Kc))


def param_flows_after(values: Array, flows: Array, shifts: Array, srow: Array, prow: Array, ch: Array, pid: Array,
                      w: Array, *, Kp: int, Kc: int, alpha: float = 1.0, precision: str = "tf32",
                      config: KernelConfig = KernelConfig()) -> Array:
    """Parameter flows ``[n, C, Kp, Kc]`` of ``n`` sum blocks from the final node values and flows (float32
    ``[R, B]``), as :func:`jaxpc.ops.sum_layer.sum_layer_param_flows_reference` computes them below float32
    precision (local sums from the parents' stored values; untempered, ``alpha`` the propagation's exponent):
    block ``i``'s parents at rows ``prow[i] + [0, Kp)``, its children ``ch[i]``, its log-weights ``w[pid[i]]``,
    its shift (its children's max per sample) the one the in-place forward kept at row ``srow[i]`` of ``shifts``
    (``[S, B]``), or, where ``srow[i] < 0``, recomputed. One kernel, per (block and child, parent tile, child
    tile) program ``exp(alpha log W) * (a @ y^T)`` over the batch in chunks, ``a = flow / local sum`` and
    ``y = exp(alpha (x - shift))`` made in the program: nothing of the gathered children's size in memory, the
    weights' product in the epilogue."""
    ch = tables3(ch)
    n, C, M = ch.shape
    B = values.shape[1]
    if values.dtype != jnp.float32 or flows.dtype != jnp.float32 or shifts.dtype != jnp.float32:
        raise TypeError(f"param_flows_after needs float32 node values, flows and shifts, got {values.dtype}, "
                        f"{flows.dtype} and {shifts.dtype}")
    if precision == "fp32" or shifts.ndim != 2 or shifts.shape[1] != B or srow.shape != (n,):
        raise ValueError(f"param_flows_after takes the local sums from the stored values (precision below fp32, "
                         f"got {precision!r}), shifts [S, B={B}] (got {shifts.shape}) and srow [n={n}] (got "
                         f"{srow.shape})")
    BB, KT, KS = tiles(config, B, Kp, Kc)
    KC = min(config.block_k, p2(Kc))
    kernel = functools.partial(_pflow_after_kernel, C=C, M=M, Kp=Kp, Kc=Kc, KT=KT, KC=KC, KS=KS, BB=BB, B=B,
                               alpha=float(alpha), precision=precision)
    return call_kernel(kernel, config, grid=block_grid(n * C, pl.cdiv(Kp, KT), pl.cdiv(Kc, KC)),
                 out_shape=jax.ShapeDtypeStruct((n, C, Kp, Kc), jnp.float32),
                 name="jaxpc_param_flows_after")(prow.astype(jnp.int32), srow.astype(jnp.int32), ch, pid, w, values,
                                                 flows, shifts)


# ---- backward of a fan-in partition from the kept shifts: one kernel, child flows by atomic adds --------

ATOMIC_MAX_KP: Final = 64  # backward_atomic: the most parent nodes per block (one program holds the block's)
RELAXED_KERNELS: Final = ("jaxpc_sum_backward_atomic", "jaxpc_product_backward")  # atomic adds lowered relaxed
_RELAXED: list = []  # [installed: bool], once per process


def relaxed_atomics() -> bool:
    """Whether the atomic adds of the kernels named in :data:`RELAXED_KERNELS` are lowered with relaxed memory order
    (installed on the first call). Pallas's Triton lowering gives every atomic acquire-release order, a fence per
    element: :func:`backward_atomic` then ran slower than XLA's backward (PD-128's flows at batch 512 on the H200,
    12.44 against 10.95 ms), and with relaxed adds faster (8.29 against 11.23). Their adds need no order: no
    program reads the rows they add to. Atomics of every other kernel keep their order (the chain kernels'
    grid barrier needs it). The lowering rule of Pallas's atomics is wrapped to set the order of the ops it
    emits for those kernels; False where this JAX's lowering has another shape (the fan-in route then stays off
    on a GPU: :func:`jaxpc.engine.routing.atomic_backward`)."""
    if not _RELAXED:
        _RELAXED.append(_install_relaxed())
    return _RELAXED[0]


def _install_relaxed() -> bool:
    try:
        from jax._src.lib.mlir import ir
        from jax._src.pallas.triton import lowering as tl
        from jax._src.pallas.triton import primitives as tp

        rules, prim = tl.triton_lowering_rules, tp.atomic_rmw_p
        original = rules[prim]
        relaxed = ir.AttrBuilder.get("TT_MemSemanticAttr")
        order = tl.tt_dialect.MemSemantic.RELAXED
    except Exception:  # noqa: BLE001 - another JAX: the atomics keep Pallas's order
        return False
    if getattr(original, "jaxpc_relaxed", False):
        return True

    def rule(ctx, *args, **kw):
        out = original(ctx, *args, **kw)
        if ctx.context.name.startswith(RELAXED_KERNELS):
            op = out.owner
            op.attributes["sem"] = relaxed(order, context=op.context)
        return out

    rule.jaxpc_relaxed = True
    rules[prim] = rule
    return True


def _bwd_atomic_kernel(off_ref, ord_ref, ch_ref, pid_ref, w_ref, buf_ref, shift_ref, flow_ref, *refs, C, M, Kp, Kc,
                       KT, KC, BB, B, alpha, precision, unit, first_row, ordered, prefetch, G, into, overwrite):
    out_ref, pf_ref = refs[-2:]  # (with into: the parameter flows in, then the aliased flows and parameter flows)
    e, q = block_ids(2)
    ic = ord_ref[e] if ordered else e * G  # the program's first edge block; G children of one parent block
    i, c0 = lax.div(ic, jnp.int32(C)), lax.rem(ic, jnp.int32(C))

    @pl.when((i < off_ref[1]) & (c0 < off_ref[2]))  # the partition's edge blocks; padding programs do nothing
    def _():
        kp = jnp.arange(KT)
        kc = q * KC + jnp.arange(KC)
        pmask, kmask = kp < Kp, kc < Kc
        first = off_ref[0] + i * Kp  # the block's first parent row; its kept shift at row first / unit
        srow = lax.div(first, jnp.int32(unit))
        ws = [_load_w(w_ref, pid_ref[i, c0 + j], kp, kc, Kp, Kc, alpha) for j in range(G)]  # [KT, KC] each
        rows = [[ch_ref[i, c0 + j, r] for r in range(M)] for j in range(G)]  # each child's row blocks, read once
        T = pl.cdiv(B, BB)
        # in child order, the programs of one child start at different batch tiles: their adds meet no one else's
        rot = lax.rem(e, jnp.int32(T)) if ordered else 0

        def fetch(s, live=True):
            """The batch tile of step ``s``: its columns, the parents' shift, values and flows, the children's
            values."""
            t = lax.rem(s + rot, jnp.int32(T)) if ordered else s
            cols = t * BB + jnp.arange(BB)
            cmask = cols < B if live is True else (cols < B) & live
            m = plgpu.load(shift_ref.at[srow, cols], mask=cmask, other=0.0)
            v = load_tile(buf_ref, first + kp, cols, pmask, cmask, _NEG)
            f = load_tile(flow_ref, first + kp, cols, pmask, cmask, 0.0)
            return cols, cmask, m, v, f, [_load_rows(buf_ref, rj, kc, cols, cmask, Kc) for rj in rows]

        def use(tile, accs):
            cols, cmask, m, v, f, xs = tile
            safe = jnp.where(m == _NEG, 0.0, m)
            a = _split(f, _exp(alpha * (v - safe[None, :])))  # [KT, BB]
            out = []
            for w, rj, x, acc in zip(ws, rows, xs, accs):
                y = _exp(alpha * (x - safe[None, :]))
                cf = y * mm(w, a, precision, trans_a=True)  # [KC, BB]: this edge block's share of the child's flows
                for r0 in rj:  # into every row block of the (folded) child; other parents add to the same rows
                    add_tile(out_ref, r0 + kc, cols, cf, kmask & (r0 >= first_row), cmask)
                out.append(acc + mm(a, y, precision, trans_b=True))
            return tuple(out)

        accs = tuple(jnp.zeros((KT, KC), jnp.float32) for _ in range(G))
        if prefetch:  # the next tile's loads are issued before this tile's arithmetic: they overlap it
            def step(s, carry):
                accs, tile = carry
                nxt = fetch(s + 1, s + 1 < T)
                return use(tile, accs), nxt

            accs, _ = lax.fori_loop(0, T, step, (accs, fetch(0)))
        else:
            accs = lax.fori_loop(0, T, lambda s, accs: use(fetch(s), accs), accs)
        # the weights read again, not the loop's: both live through the batch loop spill registers
        ws = [_load_w(w_ref, pid_ref[i, c0 + j], kp, kc, Kp, Kc, alpha) for j in range(G)]
        for j, (w, acc) in enumerate(zip(ws, accs)):
            mask = pmask[:, None] & kmask[None, :]
            if into:  # added to the edge block's parameter block, which no other program of the kernel writes
                at = pf_ref.at[pid_ref[i, c0 + j], kp[:, None], kc[None, :]]
                old = 0.0 if overwrite else plgpu.load(at, mask=mask, other=0.0)
                plgpu.store(at, old + w * acc, mask=mask)
            else:
                plgpu.store(pf_ref.at[i, c0 + j, kp[:, None], kc[None, :]], w * acc, mask=mask)


def check_atomic_args(Kp: int, values: Array, flows: Array, shifts: Array, precision: str, unit: int) -> None:
    """The arguments :func:`backward_atomic` refuses: blocks of more than :data:`ATOMIC_MAX_KP` parents, buffers
    other than float32, fp32 precision (it takes the local sums from the stored values), a shift unit that does not
    divide the block size."""
    if Kp > ATOMIC_MAX_KP:
        raise ValueError(f"backward_atomic holds a block's parents in one program: at most {ATOMIC_MAX_KP}, "
                         f"got Kp={Kp}")
    if values.dtype != jnp.float32 or flows.dtype != jnp.float32 or shifts.dtype != jnp.float32:
        raise TypeError(f"backward_atomic needs float32 node values, flows and shifts, got {values.dtype}, "
                        f"{flows.dtype} and {shifts.dtype}")
    if precision == "fp32" or unit < 1 or Kp % unit:
        raise ValueError(f"backward_atomic takes the local sums from the stored values (precision below fp32, got "
                         f"{precision!r}) and the kept shifts (a unit dividing Kp={Kp}, got {unit})")


def backward_atomic(values: Array, flows: Array, shifts: Array, out_offset, ch: Array, pid: Array, w: Array, *, Kp: int,
                    Kc: int, unit: int, first_row: int, alpha: float = 1.0, precision: str = "tf32",
                    config: KernelConfig = KernelConfig(), order: Array | None = None, prefetch: bool = False,
                    group: int = 1, blocks: int | None = None, fanin: int | None = None, dparams: Array | None = None,
                    overwrite: bool = False):
    """The whole backward of a sum partition whose forward kept its shifts (the in-place forward's, at rows ``first
    parent row / unit`` of ``shifts``) in one kernel, for local sums from the parents' stored values (precision
    below fp32; untempered): one program per (parent block and child, child-node tile) loops over the batch,
    splits the parents' flows (``a = flow / exp(alpha (value - shift))``), reduces the edge block's parameter
    flows ``W * (a @ y^T)`` and adds its share of the child flows, ``y * (W^T a)``, into every row block of the
    (folded) child by atomic adds (several parent blocks share a child). Nothing of the gathered children's size
    is written: XLA's backward writes ``W^T a`` and scatters its products by atomic adds of its own. Rows below
    ``first_row`` (padding) stay untouched.

    ``order`` (``[n * C]``, a permutation of the edge blocks ``i * C + c``; the partition's ``eorder`` table): the
    programs run the edge blocks in this order (by default parent by parent), and in it each program starts its
    batch loop at tile ``position mod tiles``. ``prefetch``: each step of the batch loop issues the next tile's
    loads before its own arithmetic (with more than one batch tile). ``group``: each program takes that many
    children of its parent block (dividing ``C``; not with ``order``), which read the parents' tiles and split
    their flows once for all of them. ``blocks`` and ``fanin``: padded tables (as in :func:`forward`; ``group``
    divides both fan-ins, ``order`` indexes the padded edge blocks and lists the padding's last). Returns ``(flows
    with the child flows added in place, param flows [blocks, fanin, Kp, Kc])``; the order of the atomic adds makes
    the child flows' last bits vary from run to run. With ``dparams`` (float32 ``[P, Kp, Kc]``; the partition's
    parameter blocks ``pid`` distinct) the parameter flows are added into it in place instead, and it is returned
    in their stead: no ``[n, C, Kp, Kc]`` array and no scatter. ``overwrite`` (with ``dparams``): the parameter
    flows are stored into it instead, for an accumulator whose blocks no other edge block of the pass writes (its
    rows may start unset)."""
    ch = tables3(ch)
    n, C, M = ch.shape
    blocks, fanin = extent = check_extent(n, C, blocks, fanin, out_offset)
    into = dparams is not None
    if into and (dparams.dtype != jnp.float32 or dparams.shape[1:] != (Kp, Kc)):
        raise TypeError(f"backward_atomic: dparams must be float32 [P, {Kp}, {Kc}], got {dparams.dtype} "
                        f"{dparams.shape}")
    B = values.shape[1]
    check_atomic_args(Kp, values, flows, shifts, precision, unit)
    relaxed_atomics()
    BB = min(config.block_b, p2(B))
    KT, KC = p2(Kp), min(config.block_k, p2(Kc))
    if order is not None and order.shape != (n * C,):
        raise ValueError(f"backward_atomic: order must list the {n * C} edge blocks, got shape {order.shape}")
    if group < 1 or C % group or fanin % group or (group > 1 and order is not None):
        raise ValueError(f"backward_atomic: group must divide the fan-in C={C} (and {fanin}) and go without order, "
                         f"got {group}")
    kernel = functools.partial(_bwd_atomic_kernel, C=C, M=M, Kp=Kp, Kc=Kc, KT=KT, KC=KC, BB=BB, B=B,
                               alpha=float(alpha), precision=precision, unit=int(unit), first_row=int(first_row),
                               ordered=order is not None, prefetch=bool(prefetch) and B > BB, G=int(group), into=into,
                               overwrite=into and bool(overwrite))
    off = block_offsets(out_offset, extent)
    order = jnp.zeros((1,), jnp.int32) if order is None else order.astype(jnp.int32)
    pf_shape = dparams.shape if into else (n, C, Kp, Kc)
    fl, pf = call_kernel(kernel, config, grid=block_grid(n * C // group, pl.cdiv(Kc, KC)),
                         out_shape=(jax.ShapeDtypeStruct(flows.shape, jnp.float32),
                                    jax.ShapeDtypeStruct(pf_shape, jnp.float32)),
                         input_output_aliases={7: 0, 8: 1} if into else {7: 0},
                         name="jaxpc_sum_backward_atomic")(off, order, ch, pid, w, values, shifts, flows,
                                                           *((dparams,) if into else ()))
    return fl, (pf if into or extent == (n, C) else pf[:blocks, :fanin])


# ---- backward: child side ---------------------------------------------------------------------------

def _wt_a(a_ref, w_ref, i, p, kc, cols, cmask, valid, *, Kp, Kc, KPT, alpha, precision):
    """``W_p^T @ a_i`` for the child nodes ``kc``: ``[len(kc), BB]``, over chunks of ``KPT`` parent nodes of parent
    block ``i`` (zero where not ``valid``)."""

    def chunk(q, wa):
        kp = q * KPT + jnp.arange(KPT)
        a = load_tile(a_ref, i * Kp + kp, cols, (kp < Kp) & valid, cmask, 0.0)
        return wa + mm(_load_w(w_ref, p, kp, kc, Kp, Kc, alpha, valid), a, precision, trans_a=True)

    return lax.fori_loop(0, pl.cdiv(Kp, KPT), chunk, jnp.zeros((kc.shape[0], cols.shape[0]), jnp.float32))


def child_tiles(config: KernelConfig, B: int, Kp: int, Kc: int):
    """(batch tile, child-node tile, parent-node chunk) of the child-side kernels."""
    KT = min(config.block_k, p2(Kc))
    return min(config.block_b, p2(B)), KT, _chunk(config, KT, Kp)


def child_side_tables(ch: Array | None, par: Array, pcol: Array | None) -> tuple[Array, Array, int]:
    """``(ch [n, C, M], pcol, M)`` as the child-side kernels read them: a placeholder table where ``ch`` is None
    (unfolded: the children are the row blocks themselves), ``par`` standing in for ``pcol`` there; a folded
    partition (``ch [n, C, M]``, ``M > 1``) must give ``pcol``."""
    M = 1 if ch is None or ch.ndim == 2 else ch.shape[2]
    if M > 1 and pcol is None:
        raise ValueError("a folded partition (ch [n, C, M]) needs pcol")
    return (jnp.zeros((1, 1, 1), jnp.int32) if ch is None else tables3(ch)), (par if pcol is None else pcol), M


def _bwd_child_kernel(uch_ref, par_ref, pcol_ref, ppid_ref, ch_ref, w_ref, buf_ref, a_ref, m_ref, flow_ref, out_ref,
                      *, D, M, Kp, Kc, KT, KPT, BB, B, alpha, precision, accumulate):
    u, k, t = block_ids(3)
    cols = t * BB + jnp.arange(BB)
    cmask = cols < B
    kc = k * KT + jnp.arange(KT)
    rows = uch_ref[u] + kc
    own = load_tile(buf_ref, rows, cols, kc < Kc, cmask, _NEG) if M == 1 else None

    def body(d, acc):
        i, e = par_ref[u, d], ppid_ref[u, d]
        valid = i >= 0
        ii, ee = jnp.maximum(i, 0), jnp.maximum(e, 0)
        if M == 1:
            x = own
        else:  # the folded product this row block belongs to under parent ii
            x = _load_child(buf_ref, ch_ref, ii, jnp.maximum(pcol_ref[u, d], 0), kc, cols, cmask, M=M, Kc=Kc)
        m = plgpu.load(m_ref.at[ii, cols], mask=cmask & valid, other=0.0)
        safe = jnp.where(m == _NEG, 0.0, m)
        wa = _wt_a(a_ref, w_ref, ii, ee, kc, cols, cmask, valid, Kp=Kp, Kc=Kc, KPT=KPT, alpha=alpha,
                   precision=precision)
        return acc + _exp(alpha * (x - safe[None, :])) * wa

    acc = lax.fori_loop(0, D, body, jnp.zeros((KT, BB), jnp.float32))
    if accumulate:
        acc = acc + load_tile(flow_ref, rows, cols, kc < Kc, cmask, 0.0)
        store_tile(out_ref, rows, cols, acc, kc < Kc, cmask)
    else:
        store_tile(out_ref, u * Kc + kc, cols, acc, kc < Kc, cmask)


def backward_children(buf: Array, a: Array, m: Array, uch: Array, par: Array, ppid: Array, w: Array, *, Kp: int,
                      Kc: int, alpha: float = 1.0, precision: str = "fp32", config: KernelConfig = KernelConfig(),
                      ch: Array | None = None, pcol: Array | None = None, flows: Array | None = None) -> Array:
    """Flows of the partition's ``U`` distinct child row blocks (rows ``uch[u] + [0, Kc)``), through the inverse
    tables ``par``/``ppid`` ``[U, D]`` (parent block and parameter block; -1 pads). A folded partition (``ch
    [n, C, M]``) also needs ``pcol [U, D]``, the child position under each parent. Returns ``[U * Kc, B]``;
    with ``flows`` (float32 ``[R, B]``) the flow buffer with them added to the child rows in place."""
    U, D = par.shape
    B = buf.shape[1]
    ch, pcol, M = child_side_tables(ch, par, pcol)
    BB, KT, KPT = child_tiles(config, B, Kp, Kc)
    kernel = functools.partial(_bwd_child_kernel, D=D, M=M, Kp=Kp, Kc=Kc, KT=KT, KPT=KPT, BB=BB, B=B,
                               alpha=float(alpha), precision=precision, accumulate=flows is not None)
    grid = block_grid(U, pl.cdiv(Kc, KT), pl.cdiv(B, BB))
    args = (uch, par, pcol, ppid, ch, w, buf.astype(jnp.float32), a, m)
    if flows is None:
        return call_kernel(kernel, config, grid=grid, out_shape=jax.ShapeDtypeStruct((U * Kc, B), jnp.float32),
                     name="jaxpc_sum_backward_children")(*args, jnp.zeros((1, 1), jnp.float32))
    if flows.dtype != jnp.float32:
        raise TypeError(f"in-place child flows need a float32 flow buffer, got {flows.dtype}")
    return call_kernel(kernel, config, grid=grid, out_shape=jax.ShapeDtypeStruct(flows.shape, jnp.float32),
                 input_output_aliases={9: 0}, name="jaxpc_sum_backward_children_inplace")(*args, flows)


# ---- backward of an exclusive partition (a tree level): child flows per parent, written to every row block --

def _add_to_row_blocks(flow_ref, out_ref, ch_ref, i, kc, cols, cmask, cf, *, M, Kc, first_row, overwrite=False):
    """Add child flows ``cf [len(kc), BB]`` into every row block of parent block ``i``'s (folded) child, in place:
    the calling program is their only writer; rows below ``first_row`` (padding) are left alone. ``overwrite``:
    store them instead (the rows have no other reader in the whole circuit: their flows are unset until now)."""
    for s in range(M):
        r0 = ch_ref[i, 0, s]
        rmask = (kc < Kc) & (r0 >= first_row)
        new = cf if overwrite else load_tile(flow_ref, r0 + kc, cols, rmask, cmask, 0.0) + cf
        store_tile(out_ref, r0 + kc, cols, new, rmask, cmask)


def _bwd_slots_kernel(ch_ref, pid_ref, w_ref, buf_ref, a_ref, m_ref, flow_ref, out_ref, *, M, Kp, Kc, KT, KPT, BB, B,
                      alpha, precision, first_row):
    i, k, t = block_ids(3)
    cols = t * BB + jnp.arange(BB)
    cmask = cols < B
    kc = k * KT + jnp.arange(KT)
    x = _load_child(buf_ref, ch_ref, i, 0, kc, cols, cmask, M=M, Kc=Kc)
    m = plgpu.load(m_ref.at[i, cols], mask=cmask, other=0.0)
    safe = jnp.where(m == _NEG, 0.0, m)
    wa = _wt_a(a_ref, w_ref, i, pid_ref[i, 0], kc, cols, cmask, True, Kp=Kp, Kc=Kc, KPT=KPT, alpha=alpha,
               precision=precision)  # once for all M row blocks
    cf = _exp(alpha * (x - safe[None, :])) * wa
    _add_to_row_blocks(flow_ref, out_ref, ch_ref, i, kc, cols, cmask, cf, M=M, Kc=Kc, first_row=first_row)


def check_exclusive_args(ch: Array, flows: Array) -> Array:
    """``ch`` as ``[n, 1, M]`` for :func:`backward_exclusive`, which refuses more than one child block per parent
    block and flow buffers other than float32."""
    ch = tables3(ch)
    if ch.shape[1] != 1:
        raise ValueError(f"backward_exclusive needs one child block per parent block, got C={ch.shape[1]}")
    if flows.dtype != jnp.float32:
        raise TypeError(f"in-place child flows need a float32 flow buffer, got {flows.dtype}")
    return ch


def backward_exclusive(buf: Array, flows: Array, out_offset, ch: Array, pid: Array, w: Array, *, Kp: int, Kc: int,
                       first_row: int, alpha: float = 1.0, precision: str = "fp32",
                       config: KernelConfig = KernelConfig(), param_flows: bool = True):
    """Backward of a partition whose parent blocks have one child block each (``C = 1``) and whose child row
    blocks have one parent each (inverse tables with ``D = 1``: a tree's levels). After the parent kernels of
    :func:`backward_parents`, one program per (parent block, child-node tile, batch tile) computes ``W^T a``
    once and adds the child flows into every row block of the (folded) child in place, where
    :func:`backward_children` would recompute it per row block. Rows below ``first_row`` are padding and stay
    untouched. Returns ``(flows, param_flows [n, 1, Kp, Kc] or None)``."""
    ch = check_exclusive_args(ch, flows)
    n, C, M = ch.shape
    B = buf.shape[1]
    buf = buf.astype(jnp.float32)
    a, m, pf = backward_parents(buf, flows, out_offset, ch, pid, w, Kp=Kp, Kc=Kc, alpha=alpha, precision=precision,
                                config=config, param_flows=param_flows)
    BB, KT, KPT = child_tiles(config, B, Kp, Kc)
    kernel = functools.partial(_bwd_slots_kernel, M=M, Kp=Kp, Kc=Kc, KT=KT, KPT=KPT, BB=BB, B=B,
                               alpha=float(alpha), precision=precision, first_row=int(first_row))
    flows = call_kernel(kernel, config, grid=block_grid(n, pl.cdiv(Kc, KT), pl.cdiv(B, BB)),
                  out_shape=jax.ShapeDtypeStruct(flows.shape, jnp.float32), input_output_aliases={6: 0},
                  name="jaxpc_sum_backward_slots_inplace")(ch, pid, w, buf, a, m, flows)
    return flows, pf


# ---- backward of a tree level at a small batch: one kernel ------------------------------------------------

LEVEL_BATCH: Final = 64  # backward_level: the most samples (the whole batch is one tile of each program)


def level_tiles(config: KernelConfig, B: int, Kp: int, Kc: int):
    """(batch tile, child-node tile, parent-node chunk, child-node chunk of the max) of :func:`backward_level`:
    the batch tile is the whole batch, at least 16 wide (the tensor cores' smallest side)."""
    KT = min(config.block_k, p2(Kc))
    return max(16, p2(B)), KT, min(config.block_c or 64, p2(Kp)), min(128, p2(Kc))


def _bwd_level_kernel(off_ref, ch_ref, pid_ref, w_ref, buf_ref, flow_ref, dp_ref, out_ref, *pf_refs, M, Kp, Kc, KT,
                      KPT, KC, BB, B, alpha, precision, first_row, recompute, pmode):
    i, k = block_ids(2)
    level_backward_tile(i, k, off_ref[0] + i * Kp, ch_ref, pid_ref, w_ref, buf_ref, flow_ref, dp_ref, out_ref,
                        pf_refs[0] if pf_refs else None, M=M, Kp=Kp, Kc=Kc, KT=KT, KPT=KPT, KC=KC, BB=BB, B=B,
                        alpha=alpha, precision=precision, first_row=first_row, recompute=recompute, pmode=pmode)


def level_backward_tile(i, k, first, ch_ref, pid_ref, w_ref, buf_ref, flow_ref, dp_ref, out_ref, pf_ref, *, M, Kp,
                        Kc, KT, KPT, KC, BB, B, alpha, precision, first_row, recompute, pmode, overwrite=False):
    """:func:`backward_level`'s program for parent block ``i`` (parent rows ``first + [0, Kp)``) and child-node tile
    ``k``: reads values from ``buf_ref`` and flows from ``flow_ref``, adds the child flows through ``out_ref``
    (``overwrite``: stores them, see :func:`_add_to_row_blocks`); the parameter flows go to ``pf_ref`` (``pmode``
    ``"add"``: at the block's ``pid``, added to ``dp_ref``'s; ``"new"``: at ``i``; ``""``: none)."""
    cols = jnp.arange(BB)
    cmask = cols < B

    def child_exp(kc, safe):  # exp(alpha (x - m)) of the child nodes kc: [len(kc), BB], 0 where masked
        return _exp(alpha * (_load_child(buf_ref, ch_ref, i, 0, kc, cols, cmask, M=M, Kc=Kc) - safe[None, :]))

    def block_max(q, m):
        x = _load_child(buf_ref, ch_ref, i, 0, q * KC + jnp.arange(KC), cols, cmask, M=M, Kc=Kc)
        return jnp.maximum(m, jnp.max(x, axis=0))

    m = lax.fori_loop(0, pl.cdiv(Kc, KC), block_max, jnp.full((BB,), _NEG, jnp.float32))  # the forward's shift
    safe = jnp.where(m == _NEG, 0.0, m)
    kc = k * KT + jnp.arange(KT)
    y = child_exp(kc, safe)
    p = pid_ref[i, 0]

    def chunk(q, wa):
        kp = q * KPT + jnp.arange(KPT)
        pmask = kp < Kp
        fp = load_tile(flow_ref, first + kp, cols, pmask, cmask, 0.0)
        if recompute:  # the local sums, recomputed over the whole child block (exact; see sum_layer_backward)
            def local(r, s):
                kr = r * KC + jnp.arange(KC)
                return s + mm(_load_w(w_ref, p, kp, kr, Kp, Kc, alpha), child_exp(kr, safe), precision)

            s = lax.fori_loop(0, pl.cdiv(Kc, KC), local, jnp.zeros((KPT, BB), jnp.float32))
        else:  # from the parents' stored values
            s = _exp(alpha * (load_tile(buf_ref, first + kp, cols, pmask, cmask, _NEG) - safe[None, :]))
        a = _split(fp, s)
        w = _load_w(w_ref, p, kp, kc, Kp, Kc, alpha)
        if pmode:  # the batch is whole in this program: the parameter flows need no reduction across programs
            pf = w * mm(a, y, precision, trans_b=True)
            tmask = pmask[:, None] & (kc[None, :] < Kc)
            if pmode == "add":  # into the parameter-flow buffer, in place (distinct blocks per parent)
                at = dp_ref.at[p, kp[:, None], kc[None, :]]
                plgpu.store(pf_ref.at[p, kp[:, None], kc[None, :]], plgpu.load(at, mask=tmask, other=0.0) + pf,
                            mask=tmask)
            else:
                plgpu.store(pf_ref.at[i, kp[:, None], kc[None, :]], pf, mask=tmask)
        return wa + mm(w, a, precision, trans_a=True)

    wa = lax.fori_loop(0, pl.cdiv(Kp, KPT), chunk, jnp.zeros((KT, BB), jnp.float32))
    cf = y * wa
    _add_to_row_blocks(flow_ref, out_ref, ch_ref, i, kc, cols, cmask, cf, M=M, Kc=Kc, first_row=first_row,
                       overwrite=overwrite)


def check_level_args(C: int, B: int, flows: Array, dparams: Array | None, Kp: int, Kc: int) -> None:
    """The arguments :func:`backward_level` refuses: more than one child block per parent, more than
    :data:`LEVEL_BATCH` samples, buffers other than float32, a parameter-flow buffer of other blocks."""
    if C != 1:
        raise ValueError(f"backward_level needs one child block per parent block, got C={C}")
    if B > LEVEL_BATCH:
        raise ValueError(f"backward_level holds the whole batch in each program: at most {LEVEL_BATCH} samples, "
                         f"got {B}")
    if flows.dtype != jnp.float32 or (dparams is not None and dparams.dtype != jnp.float32):
        raise TypeError(f"in-place flows need float32 buffers, got flows {flows.dtype}"
                        + ("" if dparams is None else f" and dparams {dparams.dtype}"))
    if dparams is not None and dparams.shape[1:] != (Kp, Kc):
        raise ValueError(f"dparams must be [P, {Kp}, {Kc}], got {list(dparams.shape)}")


def backward_level(buf: Array, flows: Array, out_offset, ch: Array, pid: Array, w: Array, *, Kp: int, Kc: int,
                   first_row: int, alpha: float = 1.0, precision: str = "fp32", config: KernelConfig = KernelConfig(),
                   param_flows: bool = True, dparams: Array | None = None):
    """The whole backward of a tree level (as :func:`backward_exclusive`: ``C = 1``, one parent per child row
    block) in one kernel, for a batch of at most :data:`LEVEL_BATCH` samples, which each program holds whole.
    One program per (parent block, child-node tile) recomputes its block's shift, splits the parents' flows by
    the local sums (recomputed at ``precision="fp32"``, else taken from the parents' stored values, as
    :func:`jaxpc.ops.sum_layer.sum_layer_backward_reference` does), reduces the parameter flows of its tile over
    the batch and adds the child flows into every row block of the (folded) child, all in place.

    Returns ``(flows, param flows)``: with ``dparams`` (float32 ``[P, Kp, Kc]``; the partition's parameter
    blocks ``pid`` must be distinct) that buffer with the parameter flows added at ``pid`` in place, else
    ``[n, 1, Kp, Kc]`` (None without ``param_flows``)."""
    ch = tables3(ch)
    n, C, M = ch.shape
    R, B = buf.shape
    check_level_args(C, B, flows, dparams, Kp, Kc)
    BB, KT, KPT, KC = level_tiles(config, B, Kp, Kc)
    pmode = "" if not param_flows else ("add" if dparams is not None else "new")
    kernel = functools.partial(_bwd_level_kernel, M=M, Kp=Kp, Kc=Kc, KT=KT, KPT=KPT, KC=KC, BB=BB, B=B,
                               alpha=float(alpha), precision=precision, first_row=int(first_row),
                               recompute=precision == "fp32", pmode=pmode)
    off = jnp.asarray(out_offset, jnp.int32).reshape(1)
    dp = dparams if pmode == "add" else jnp.zeros((1, 1, 1), jnp.float32)
    shapes = [jax.ShapeDtypeStruct((R, B), jnp.float32)]
    aliases = {5: 0}
    if pmode == "add":
        shapes.append(jax.ShapeDtypeStruct(dp.shape, jnp.float32))
        aliases[6] = 1
    elif pmode == "new":
        shapes.append(jax.ShapeDtypeStruct((n, Kp, Kc), jnp.float32))
    outs = call_kernel(kernel, config, grid=block_grid(n, pl.cdiv(Kc, KT)), out_shape=tuple(shapes),
                 input_output_aliases=aliases,
                 name="jaxpc_sum_backward_level")(off, ch, pid, w, buf.astype(jnp.float32), flows, dp)
    if not pmode:
        return outs[0], None
    return outs[0], (outs[1] if pmode == "add" else outs[1].reshape(n, 1, Kp, Kc))
