"""A run of tree levels (:class:`~jaxpc.compiler.layout.TreeSpec`, an HCLT's) on thread-block clusters, as Pallas
Mosaic GPU kernels: the forward and the flows' backward.

A level handed to the next through a kernel boundary or a grid-wide barrier costs 7-10 us on the H200, whatever the
route; a cluster of up to 16 thread blocks meets at a hardware barrier in a fraction of a microsecond. So each
cluster here walks its own part of the tree, level by level, and never waits for another cluster:

* The kernels work on sample-major copies: ``prod [B, blocks * Kc]``, each block's child (the sum of its ``M`` row
  blocks), which starts as the sum of the rows from outside the tree (the input layer's) and to which every block
  adds its own values when it has them (a TMA store with addition), and ``vals [B, blocks * Kp]``, the blocks'
  values. The tensor cores take TF32 operands only with the contracted dimension contiguous, and the node buffer
  ``[R, B]`` has the samples contiguous; these copies put the samples first (the product's ``M``, padded to 64).
* A task is one slice of ``tile`` rows (32 or 64) of one parent block: the exponentials of its child (shifted by
  their max per sample) times its ``[tile, Kc]`` weights (``exp`` of the log-weights, taken in the kernel or from a
  copy made before it), both rounded to TF32, then the log and the
  shift back, stored into ``vals`` and added into the parent's child in ``prod``. Each block of a cluster runs one
  task per step; after each step the cluster's blocks meet at a cluster barrier, which orders the next step's loads
  after this step's stores. A block copies the next step's weights while it computes.
* :func:`schedule` splits the tree into launches: all but the last run on ``clusters`` clusters, each owning whole
  subtrees (its tasks read only what it wrote itself or what was there before the launch), and the last runs the
  levels above on one cluster. Within a cluster a step takes the blocks whose children are done, those farthest
  below the top first (Hu's order, the fewest steps for a forest of unit tasks): where a level holds more blocks
  than a step takes, blocks of the levels above share its last step (HCLT-256 with 64-row tasks: 17 + 43 steps
  over its 59 levels, against 29 + 39 one level a step).

Before the kernels XLA gathers ``prod``'s start from the node buffer; after them it writes ``vals`` into the
parent rows. The samples are a multiple of 8 up to :data:`MAX_BATCH`. The products take TF32 operands (rounded to
nearest, not truncated) and the exponentials and logarithms are the GPU's approximate ones (``APPROX_MATH``), so the
kernels serve ``precision`` ``"tf32"`` and ``"bf16"``. In interpret mode (CPU) the same kernel runs on Pallas's GPU
interpreter, which has no TMA store with addition: there a block adds into its parent's child by a load, an addition
and a store, which :func:`schedule` keeps race-free (one child of a parent a step).

:func:`backward` walks the same launches and steps in reverse. A task multiplies the block's flows divided by its
values (times ``exp`` of the forward's shift, kept per block in ``shift``) by a ``TILE``-column slice of its
transposed weights (:func:`tf32_weights_t`: the tensor cores contract over the parent rows only from a copy with
them contiguous) and the child's exponentials, and stores the child's flows, which the child blocks read as their
own. A second backward kernel reads each parent's ``1 / value`` and the child's exponentials made before the call
(:func:`backward_ratios`), which leaves its steps without exponentials and lets 64-row tasks fit a block's shared
memory at small batches. The parameter flows are left to the batched pass, which computes the tree's blocks (and
any of fan-in 1 with consecutive weights) by :func:`summed_param_flows` up to ``Tuning.pflow_sum_batch`` samples:
the product over the samples on the tensor cores with the weights' exponentials multiplied in its epilogue, so that
the ``[blocks, Kp, Kc]`` product is never written out and read back (HCLT-256 at batch 16 on the H200: 88 us in the
step for its 302 MB; synchronized calls alone 0.189 ms against 0.243 for XLA's product and multiplication).

:func:`jaxpc.engine.routing.tree_kernel` routes a tree here where ``Tuning.tree_clusters`` asks for it (by
default where ``impl="auto"`` runs on a Hopper GPU; the variants above: ``Tuning.tree_log_weights``,
``tree_forward_tile``, ``tree_backward_tile``).

The steps hand a block's values to its parent's block through global memory: TMA stores, then the cluster barrier,
then the peers' TMA loads. The barrier alone does not order them: Mosaic GPU's cluster barrier arrives on the peers'
barriers with ``mbarrier.arrive`` at its default scope (the CTA), which the PTX memory model does not make a release
to the other blocks of the cluster, and the TMA copies run in the async proxy. So each step's hand-off is fenced
(:data:`FENCES`, :func:`_meet`): ``fence.proxy.async.global`` and ``fence.acq_rel.cluster`` before the barrier, the
same after it. Without the fences, on an H100, HCLT-256 at batch 16 was wrong on 9 of 80 calls of ``log_prob`` and
``flows`` (in an earlier run, log-likelihoods off by 14 to about 190 nats: a child's contribution missing from its
parent); with them, on 0 of 200 calls at batches 8 to 64 (``benchmarks/kernels_check.py --repeats``,
``--no-fences``).

On the H200, HCLT-256's tree at batch 16 takes 0.29-0.33 ms forward and 0.34 backward (32-row tasks, from weight
copies made before the call: 0.12 ms for both) against about 0.46 and 0.61 level by level (docs/design.md, "Tree
levels on thread-block clusters").
"""

from __future__ import annotations

import functools
from typing import Final

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array

TILE: Final = 64  # the padded samples (the product's M); the most parent rows of a task (its N)
CLUSTER: Final = 16  # blocks of a cluster (the H200's largest, non-portable size)
CLUSTERS: Final = 7  # clusters of 16 blocks resident at once on the H200
MAX_BATCH: Final = 64  # samples: the product's M
_TASK: Final = 4  # a task row: weight row, the block's child column, its value column, its parent's child column
_BTASK: Final = 8  # a backward task row (:func:`_backward_tables`; 5 used, rows of 16-byte multiples)
SMEM: Final = 232448  # bytes of shared memory a block may use on the H200
_SHIFT: Final = 8  # columns of a block's shift (its child's max per sample) in the forward's ``shift`` copy
APPROX_MATH: bool = True  # the GPU's approximate exp and log (False: the exact ones, about twice as slow)
PROFILE_DIR: str | None = None  # where set, the GPU kernels record Mosaic GPU's profile of their named scopes there
FENCES: bool = True  # each step's hand-off fenced at cluster scope and across proxies (:func:`_meet`); False: unfenced


_STATUS: list = []  # :func:`status`'s answer, once per process
_PLGPU_NEEDS = ("kernel", "inline_mgpu", "ClusterBarrier", "Barrier", "barrier_arrive", "barrier_wait",
                "copy_gmem_to_smem", "copy_smem_to_gmem", "commit_smem", "wait_smem_to_gmem", "wgmma", "SMEM",
                "CompilerParams")  # what the kernels use of Pallas's Mosaic GPU module; off a GPU, InterpretGPUParams


def status() -> tuple[bool, str]:
    """``(usable, reason)``: whether this JAX has what the kernels use (Pallas's Mosaic GPU backend with inline
    Mosaic GPU code, and MLIR's LLVM dialect for the fences' inline PTX, :func:`_meet`; off a GPU, the interpreter's
    parameters too), checked once per process; the reason names what is missing (or the JAX that has it all)."""
    if not _STATUS:
        try:
            from jax._src.lib.mlir import ir
            from jax._src.lib.mlir.dialects import llvm
            from jax.experimental.mosaic.gpu import utils as mgpu_utils
            from jax.experimental.pallas import mosaic_gpu as plgpu
        except Exception as e:  # noqa: BLE001 - any failure to import means the kernels cannot be built
            _STATUS.append((False, f"{type(e).__name__}: {e}"))
            return _STATUS[0]
        needs = _PLGPU_NEEDS + ("InterpretGPUParams",) * _interpreted(None)
        missing = ([f"mosaic_gpu.{a}" for a in needs if not hasattr(plgpu, a)]
                   + ["llvm.inline_asm"] * (not hasattr(llvm, "inline_asm"))
                   + ["mlir.ir.Type.parse"] * (not hasattr(getattr(ir, "Type", None), "parse"))
                   + ["mosaic.gpu.utils.warpgroup_barrier"] * (not hasattr(mgpu_utils, "warpgroup_barrier")))
        _STATUS.append((not missing, f"missing {', '.join(missing)}" if missing else f"jax {jax.__version__}"))
    return _STATUS[0]


def fits(spec, B: int, tile: int = TILE) -> bool:
    """Whether the kernels take ``spec``'s blocks at a batch of ``B`` samples, ``tile`` parent rows a task."""
    return (B % 8 == 0 and 8 <= B <= MAX_BATCH and tile in (16, 32, 64) and spec.Kp % tile == 0
            and CLUSTER % (spec.Kp // tile) == 0 and spec.Kc % 32 == 0 and spec.Kc <= 256)


def _levels_of(lev: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(len(lev) - 1), np.diff(lev))


def _steps(blocks: list[int], level: np.ndarray, parent: np.ndarray, per_step: int) -> list[list[int]]:
    """``blocks``, an in-forest under ``parent`` whose other children ran before, in steps of at most ``per_step``:
    a block runs once its children among ``blocks`` ran in earlier steps, those farthest below their top first (Hu's
    order, which takes the fewest steps for a forest of unit tasks), and no two with one parent in a step (one block
    at a time adds into a parent's child). Blocks of several levels share a step where their children are done."""
    group = set(blocks)
    waiting = dict.fromkeys(blocks, 0)
    depth = {}
    for b in sorted(blocks, key=lambda b: -level[b]):  # parents first: a parent's level is above its children's
        p = int(parent[b])
        depth[b] = depth[p] + 1 if p in group else 0
        if p in group:
            waiting[p] += 1
    ready = [b for b in blocks if waiting[b] == 0]
    out = []
    while ready:
        ready.sort(key=lambda b: (-depth[b], level[b], b))
        step, seen, rest = [], set(), []
        for b in ready:
            p = int(parent[b])
            if len(step) < per_step and (p < 0 or p not in seen):
                step.append(b)
                seen.add(p)
            else:
                rest.append(b)
        for b in step:
            p = int(parent[b])
            if p in group:
                waiting[p] -= 1
                if waiting[p] == 0:
                    rest.append(p)
        out.append(step)
        ready = rest
    return out


def _fewest_steps(counts: np.ndarray, per_step: int) -> np.ndarray:
    """The fewest steps of in-forests holding ``counts[..., d]`` blocks at depth ``d`` below their tops, ``per_step``
    a step: for every ``d``, those at depth ``d`` and below (``ceil(N / per_step)`` steps), then the ``d`` steps up to
    the tops. :func:`_steps` reaches it or comes within a step or two (the one-child-a-step rule)."""
    tail = np.cumsum(counts[..., ::-1], axis=-1)[..., ::-1]
    d = np.arange(counts.shape[-1])
    return np.max(np.where(tail > 0, d + -(-tail // per_step), 0), axis=-1, initial=0)


def schedule(tab: dict, spec, clusters: int = CLUSTERS, split: int | None = None, tile: int = TILE) -> dict:
    """The kernels' tables from the tree's (numpy ``tables["tree"]``): ``tasks``, a list of int32 ``[G, CLUSTER, S,
    4]`` task tables, one per launch (cluster, block, step; ``-1`` weight rows: no task); ``inputs [blocks, Mi]``,
    each block's child rows from outside the tree (``-1``: none); ``rows [blocks * Kp]``, the blocks' parent rows.

    Levels below ``split`` go to the first launch, their subtrees dealt to ``clusters`` clusters (largest first, to
    the cluster with the fewest steps); the levels from ``split`` up to the second, on one cluster. Default: the
    split with the fewest steps in all; ``split=0``: the whole tree in one launch on one cluster."""
    lev, prow = np.asarray(tab["lev"]), np.asarray(tab["prow"])
    pid, ch = np.asarray(tab["pid"])[:, 0], np.asarray(tab["ch"])[:, 0, :]
    n, L = len(prow), spec.levels
    level = _levels_of(lev)
    block_of = {int(r): i for i, r in enumerate(prow)}
    kids = [[block_of[int(r)] for r in row if int(r) in block_of] for row in ch]
    parent = np.full(n, -1, np.int64)
    for p, cs in enumerate(kids):
        parent[cs] = p
    tiles = spec.Kp // tile
    per_step = CLUSTER // tiles

    # depth below the tree's tops, and each block's subtree as a range of a preorder (children below parents)
    depth, order, end = np.zeros(n, np.int64), [], np.zeros(n, np.int64)
    pos = np.zeros(n, np.int64)
    for top in np.flatnonzero(parent < 0):
        stack = [(int(top), False)]
        while stack:
            b, closing = stack.pop()
            if closing:
                end[b] = len(order)
                continue
            pos[b] = len(order)
            order.append(b)
            stack.append((b, True))
            for k in kids[b]:
                depth[k] = depth[b] + 1
                stack.append((k, False))
    order = np.asarray(order, np.int64)
    D = int(depth.max()) + 1

    def below(r):  # blocks at each depth of r's subtree, from r
        return np.bincount(depth[order[pos[r]:end[r]]] - depth[r], minlength=D)

    def first_launch(s):
        roots = [b for b in range(n) if level[b] < s and (parent[b] < 0 or level[parent[b]] >= s)]
        roots.sort(key=lambda b: -(end[b] - pos[b]))
        load = np.zeros((clusters, D), np.int64)
        owner = {}
        for r in roots:
            sub = below(r)
            g = int(np.argmin(_fewest_steps(load + sub, per_step)))
            load[g] += sub
            owner[r] = g
        return owner, int(_fewest_steps(load, per_step).max())

    def second_launch(s):  # the levels from s up: an in-forest under the tops
        return int(_fewest_steps(np.bincount(depth[level >= s], minlength=D), per_step))

    if split is None:
        cost = [(first_launch(s)[1] if s else 0) + second_launch(s) for s in range(L + 1)]
        split = int(np.argmin(cost))
    launches = []
    if split > 0:
        owner, _ = first_launch(split)
        groups: list[list[int]] = [[] for _ in range(clusters)]
        for b in range(n):
            if level[b] < split:
                r = b
                while r not in owner:
                    r = int(parent[r])
                groups[owner[r]].append(b)
        launches.append([_steps(g, level, parent, per_step) for g in groups])
    launches.append([_steps([b for b in range(n) if level[b] >= split], level, parent, per_step)])
    tasks = []
    for launch in launches:
        S = max(1, max(len(st) for st in launch))
        t = np.full((len(launch), CLUSTER, S, _TASK), -1, np.int32)
        for g, st in enumerate(launch):
            for s, blocks in enumerate(st):
                for j, b in enumerate(blocks):
                    for k in range(tiles):
                        t[g, j * tiles + k, s] = (pid[b] * spec.Kp + k * tile, b * spec.Kc, b * spec.Kp + k * tile,
                                                  -1 if parent[b] < 0 else parent[b] * spec.Kc + k * tile)
        tasks.append(t)
    outside = [[int(r) for r in row if r != 0 and int(r) not in block_of] for row in ch]  # row 0: padding (zeros)
    Mi = max(1, max(len(o) for o in outside))
    inputs = np.array([o + [-1] * (Mi - len(o)) for o in outside], np.int32)
    rows = (prow[:, None] + np.arange(spec.Kp)).ravel().astype(np.int32)
    out = {"tasks": tasks, "inputs": inputs, "rows": rows, "child": ch.astype(np.int32)}
    if spec.Kp == spec.Kc:
        out.update(_backward_tables(launches, parent, pid, spec, tile, tiles))
    return out


def _backward_tables(launches: list, parent: np.ndarray, pid: np.ndarray, spec, tile: int, tiles: int) -> dict:
    """The backward's tables: ``btasks``, the forward's launches and steps in reverse (parents before children), a
    task row ``(transposed-weight row, the block's flows' column, its values' column, its child's column, its
    child's tile column)`` into ``wt [P * Kc, Kp]``, ``pf`` (the children's flows: block ``b``'s at ``b * Kc``, the
    given flows of the ``top`` blocks, those without a parent in the tree, after the ``n`` blocks'), ``vals`` and
    ``prod``; ``top``, those blocks; ``fin [blocks * Kp]``, the column of ``pf`` holding each parent row's
    flow."""
    n = len(parent)
    top = np.flatnonzero(parent < 0)
    slot = np.full(n, -1, np.int64)
    slot[top] = n + np.arange(len(top))
    fin = np.where(parent >= 0, parent, slot) * spec.Kc
    btasks = []
    for launch in reversed(launches):
        S = max(1, max(len(st) for st in launch))
        t = np.full((len(launch), CLUSTER, S, _BTASK), -1, np.int32)
        for g, st in enumerate(launch):
            for s, blocks in enumerate(reversed(st)):
                for j, b in enumerate(blocks):
                    for k in range(tiles):
                        t[g, j * tiles + k, s, :5] = (pid[b] * spec.Kc + k * tile, fin[b], b * spec.Kp,
                                                      b * spec.Kc, b * spec.Kc + k * tile)
        btasks.append(t)
    cols = (fin[:, None] + np.arange(spec.Kp)).ravel().astype(np.int32)
    return {"btasks": btasks, "top": top.astype(np.int32), "fin": cols}


def _interpreted(interpret: bool | None) -> bool:
    """Whether the kernels run on Pallas's GPU interpreter: as asked, by default everywhere but on a GPU."""
    return jax.default_backend() != "gpu" if interpret is None else bool(interpret)


def _round_tf32(x: Array) -> Array:
    """``x`` rounded to TF32's 10 mantissa bits, to nearest (the tensor cores would truncate)."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return lax.bitcast_convert_type((bits + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000), jnp.float32)


def tf32_weights(logw: Array) -> Array:
    """``exp(logw)`` rounded to TF32, the weights :func:`forward` takes in place of the log-weights."""
    return _round_tf32(jnp.exp(logw.astype(jnp.float32)))


def _task_start(tasks, w, task_smem, w_smem, tbar, wbar, S: int, N: int):
    """In a kernel body: copies the block's task table into shared memory (at most 256 rows a copy), starts the copy
    of step 0's ``N`` weight rows (task column 0) and returns the function that starts step ``s``'s into
    ``w_smem[s % 2]``."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    g, c = lax.axis_index("g"), lax.axis_index("c")
    for k in range(0, S, 256):
        n = min(256, S - k)
        plgpu.copy_gmem_to_smem(tasks.at[g, c, pl.ds(k, n)], task_smem.at[pl.ds(k, n)], tbar)
        plgpu.barrier_wait(tbar)

    def fetch(s):
        @pl.when(task_smem[s, 0] >= 0)
        def _():
            rows = _at(task_smem[s, 0], N)
            plgpu.copy_gmem_to_smem(w.at[rows, :], w_smem.at[s % 2], wbar.at[s % 2])

    fetch(0)
    return fetch


def _at(v, width: int):
    """In a kernel body: the slice of ``width`` columns from ``v`` (a multiple of ``min(width, 32)``)."""
    from jax.experimental import pallas as pl

    return pl.ds(pl.multiple_of(v, min(width, 32)), width)


def _swizzled() -> tuple:
    """The transforms of the shared-memory tiles the tensor cores read: 8 x 32 tiles, 128-byte swizzle."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)


def _product(a_smem, w, N: int) -> Array:
    """In a kernel body: ``a_smem @ w.T`` on the tensor cores (TF32 operands in shared memory, ``w`` with the
    contracted axis contiguous), float32 ``[TILE, N]``."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def run(acc):
        plgpu.wgmma(acc, a_smem, w.T)
        return acc[...]

    return pl.run_scoped(run, plgpu.ACC((TILE, N), jnp.float32))


def _store(src, dst) -> None:
    """In a kernel body: ``src`` (shared memory just written) copied to ``dst``, waited for."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(src, dst)
    plgpu.wait_smem_to_gmem(0)


def _fence(ptx: str) -> None:
    """In a kernel body: the PTX fences ``ptx`` in every thread, then the warpgroup's threads meet (so that no
    thread arrives at the cluster barrier before the thread that issued the TMA copies has fenced)."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @plgpu.inline_mgpu()
    def emit(_):
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [], ptx, "", has_side_effects=True)
        mgpu_utils.warpgroup_barrier()

    emit()


def _meet(cbar, fences: bool) -> None:
    """In a kernel body: the cluster's blocks meet (orders the next step's loads after this step's stores). With
    ``fences`` (:data:`FENCES`), the step's TMA stores (already waited for) are ordered before the barrier for every
    block of the cluster, and the barrier before the next step's TMA loads: the cluster barrier's remote arrive
    alone releases at the CTA's scope, and the TMA copies run in the async proxy."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if fences:
        _fence("fence.proxy.async.global;\n\tfence.acq_rel.cluster;")
    plgpu.barrier_arrive(cbar)
    plgpu.barrier_wait(cbar)
    if fences:
        _fence("fence.acq_rel.cluster;\n\tfence.proxy.async.global;")


def _cluster_kernel(body, G: int, scratch: list, interpret: bool, params, fences: bool):
    """``body`` as a Mosaic GPU kernel of ``G`` clusters of ``CLUSTER`` blocks (``params``: its compiler
    parameters), or on the interpreter (which skips the inline fences of ``fences``)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    extra = ({"interpret": plgpu.InterpretGPUParams(**({"inline_mgpu": "ignore"} if fences else {}))} if interpret
             else {"compiler_params": params()})
    return plgpu.kernel(body, out_type=(), grid=(G,), grid_names=("g",), cluster=(CLUSTER,), cluster_names=("c",),
                        scratch_types=scratch, **extra)


@functools.cache
def _forward_kernel(G: int, S: int, Kp: int, Kc: int, B: int, N: int, interpret: bool, log_weights: bool,
                    profile_dir: str | None, approx: bool, fences: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    f32 = jnp.float32
    swizzled = _swizzled()

    def col(v):
        return pl.ds(pl.multiple_of(v, N), N)

    def body(tasks, logw, prod, vals, shift, task_smem, w_smem, x_smem, o_smem, s_smem, tbar, wbar, xbar, cbar,
             *emulated):
        fetch_weights = _task_start(tasks, logw, task_smem, w_smem, tbar, wbar, S, N)

        def step(s, carry):
            @pl.when(task_smem[s, 0] >= 0)
            def _():
                plgpu.copy_gmem_to_smem(prod.at[:, pl.ds(pl.multiple_of(task_smem[s, 1], 32), Kc)],
                                        x_smem.at[:B], xbar)

            @pl.when(s + 1 < S)
            def _():
                fetch_weights(s + 1)

            @pl.when(task_smem[s, 0] >= 0)
            def _():
                w = w_smem.at[s % 2]
                with jax.named_scope("weights_wait"):
                    plgpu.barrier_wait(wbar.at[s % 2])
                if log_weights:
                    with jax.named_scope("weights_exp"):
                        # the swizzled copy's own layout: layout inference finds none for tiles under 64 rows
                        v = plgpu.load(w, layout=plgpu.Layout.SMEM_GMEM_COPY((N, Kc), f32, 128))
                        w[...] = _round_tf32(jnp.exp(v))
                with jax.named_scope("child_wait"):
                    plgpu.barrier_wait(xbar)
                with jax.named_scope("child_exp"):
                    x = x_smem[...]
                    mx = jnp.maximum(jnp.max(x, axis=1), jnp.float32(-3e38))
                    x_smem[...] = _round_tf32(jnp.exp(x - lax.broadcast_in_dim(mx, (TILE, Kc), [0])))
                    plgpu.commit_smem()

                @pl.when(lax.rem(task_smem[s, 2], jnp.int32(Kp)) == 0)  # the block's first tile keeps its shift
                def _():
                    s_smem[...] = lax.broadcast_in_dim(mx, (TILE, _SHIFT), [0])
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(s_smem.at[:B], shift.at[:, pl.ds(
                        pl.multiple_of(lax.div(task_smem[s, 2], jnp.int32(Kp)) * _SHIFT, _SHIFT), _SHIFT)])

                with jax.named_scope("product"):
                    acc = _product(x_smem, w, N)
                with jax.named_scope("log"):
                    o_smem[...] = jnp.log(acc) + lax.broadcast_in_dim(mx, (TILE, N), [0])
                    plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[:B], vals.at[:, col(task_smem[s, 2])])

                @pl.when(task_smem[s, 3] >= 0)
                def _():
                    parent = prod.at[:, col(task_smem[s, 3])]
                    if not emulated:
                        plgpu.copy_smem_to_gmem(o_smem.at[:B], parent, reduction_op="add")
                        return
                    # The interpreter has no TMA store with addition; one block a step adds into a parent.
                    p_smem, pbar = emulated
                    plgpu.copy_gmem_to_smem(parent, p_smem.at[:B], pbar)
                    plgpu.barrier_wait(pbar)
                    p_smem[...] = p_smem[...] + o_smem[...]
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(p_smem.at[:B], parent)

                with jax.named_scope("store_wait"):
                    plgpu.wait_smem_to_gmem(0)

            with jax.named_scope("cluster_barrier"):
                _meet(cbar, fences)
            return carry

        lax.fori_loop(0, S, step, 0)

    profile = dict(profile_space=16 * S + 64, profile_dir=profile_dir) if profile_dir else {}
    return _cluster_kernel(body, G, [
        plgpu.SMEM((S, _TASK), jnp.int32), plgpu.SMEM((2, N, Kc), f32, transforms=swizzled),
        plgpu.SMEM((TILE, Kc), f32, transforms=swizzled), plgpu.SMEM((TILE, N), f32), plgpu.SMEM((TILE, _SHIFT), f32),
        plgpu.Barrier(), plgpu.Barrier(num_barriers=2), plgpu.Barrier(), plgpu.ClusterBarrier(collective_axes=("c",)),
        *([plgpu.SMEM((TILE, N), f32), plgpu.Barrier()] if interpret else [])],
        interpret, lambda: plgpu.CompilerParams(approx_math=approx, **profile), fences)


@functools.cache
def _backward_kernel(G: int, S: int, Kp: int, Kc: int, B: int, N: int, interpret: bool, approx: bool,
                     fences: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    f32 = jnp.float32
    swizzled = _swizzled()

    def body(tasks, wt, pf, vals, prod, shift, task_smem, w_smem, g_smem, f_smem, x_smem, o_smem, s_smem, tbar, wbar,
             lbar, cbar):
        fetch_weights = _task_start(tasks, wt, task_smem, w_smem, tbar, wbar, S, N)

        def step(s, carry):
            @pl.when(task_smem[s, 0] >= 0)
            def _():
                plgpu.copy_gmem_to_smem(pf.at[:, _at(task_smem[s, 1], Kp)], f_smem.at[:B], lbar.at[0])
                plgpu.copy_gmem_to_smem(vals.at[:, _at(task_smem[s, 2], Kp)], g_smem.at[:B], lbar.at[1])
                plgpu.copy_gmem_to_smem(prod.at[:, _at(task_smem[s, 4], N)], x_smem.at[:B], lbar.at[2])
                plgpu.copy_gmem_to_smem(shift.at[:, pl.ds(pl.multiple_of(
                    lax.div(task_smem[s, 3], jnp.int32(Kc)) * _SHIFT, _SHIFT), _SHIFT)], s_smem.at[:B], lbar.at[3])

            @pl.when(s + 1 < S)
            def _():
                fetch_weights(s + 1)

            @pl.when(task_smem[s, 0] >= 0)
            def _():
                for i in range(4):
                    plgpu.barrier_wait(lbar.at[i])
                mx = jnp.max(s_smem[...], axis=1)  # the forward's shift (every column holds it)
                ratio = f_smem[...] * jnp.exp(lax.broadcast_in_dim(mx, (TILE, Kp), [0]) - g_smem[...])
                g_smem[...] = _round_tf32(ratio)  # flow / value of each parent, times exp(shift)
                plgpu.commit_smem()
                w = w_smem.at[s % 2]
                plgpu.barrier_wait(wbar.at[s % 2])

                acc = _product(g_smem, w, N)
                o_smem[...] = acc * jnp.exp(x_smem[...] - lax.broadcast_in_dim(mx, (TILE, N), [0]))
                _store(o_smem.at[:B], pf.at[:, _at(task_smem[s, 4], N)])

            _meet(cbar, fences)
            return carry

        lax.fori_loop(0, S, step, 0)

    return _cluster_kernel(body, G, [
        plgpu.SMEM((S, _BTASK), jnp.int32), plgpu.SMEM((2, N, Kp), f32, transforms=swizzled),
        plgpu.SMEM((TILE, Kp), f32, transforms=swizzled), plgpu.SMEM((TILE, Kp), f32, transforms=swizzled),
        plgpu.SMEM((TILE, N), f32), plgpu.SMEM((TILE, N), f32), plgpu.SMEM((TILE, _SHIFT), f32), plgpu.Barrier(),
        plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=4), plgpu.ClusterBarrier(collective_axes=("c",))],
        interpret, lambda: plgpu.CompilerParams(approx_math=approx), fences)


@functools.cache
def _backward_ratio_kernel(G: int, S: int, Kp: int, Kc: int, B: int, N: int, interpret: bool, approx: bool,
                           fences: bool):
    """:func:`_backward_kernel` from the ratios and exponentials made before the call (:func:`backward_ratios`):
    a task loads its parents' flows (``B`` rows), multiplies them by their ``1 / value`` ratios (loaded into the
    product's operand) and scales the product by the child's exponentials in place, with no exponential in the
    chain of steps and no ``shift`` or 64-row flow tile in shared memory, so that 64-row tasks of 256-node
    blocks fit at batches up to 16."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    f32 = jnp.float32
    swizzled = _swizzled()
    rows = plgpu.Layout.SMEM_GMEM_COPY((B, Kp), f32, 128)

    def body(tasks, wt, pf, ratios, exps, w_smem, g_smem, f_smem, x_smem, task_smem, tbar, wbar, lbar, cbar):
        fetch_weights = _task_start(tasks, wt, task_smem, w_smem, tbar, wbar, S, N)

        def step(s, carry):
            @pl.when(task_smem[s, 0] >= 0)
            def _():
                plgpu.copy_gmem_to_smem(pf.at[:, _at(task_smem[s, 1], Kp)], f_smem, lbar.at[0])
                plgpu.copy_gmem_to_smem(ratios.at[:, _at(task_smem[s, 2], Kp)], g_smem.at[:B], lbar.at[1])
                plgpu.copy_gmem_to_smem(exps.at[:, _at(task_smem[s, 4], N)], x_smem.at[:B], lbar.at[2])

            @pl.when(s + 1 < S)
            def _():
                fetch_weights(s + 1)

            @pl.when(task_smem[s, 0] >= 0)
            def _():
                for i in range(3):
                    plgpu.barrier_wait(lbar.at[i])
                g = g_smem.at[:B]
                g[...] = _round_tf32(plgpu.load(f_smem, layout=rows) * plgpu.load(g, layout=rows))
                plgpu.commit_smem()
                w = w_smem.at[s % 2]
                plgpu.barrier_wait(wbar.at[s % 2])

                x_smem[...] = _product(g_smem, w, N) * x_smem[...]  # the rows past B: whatever the operand held
                _store(x_smem.at[:B], pf.at[:, _at(task_smem[s, 4], N)])

            _meet(cbar, fences)
            return carry

        lax.fori_loop(0, S, step, 0)

    return _cluster_kernel(body, G, [
        plgpu.SMEM((2, N, Kp), f32, transforms=swizzled),  # (the swizzled tiles first: aligned)
        plgpu.SMEM((TILE, Kp), f32, transforms=swizzled), plgpu.SMEM((B, Kp), f32, transforms=swizzled),
        plgpu.SMEM((TILE, N), f32, transforms=swizzled), plgpu.SMEM((S, _BTASK), jnp.int32), plgpu.Barrier(),
        plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=3), plgpu.ClusterBarrier(collective_axes=("c",))],
        interpret, lambda: plgpu.CompilerParams(approx_math=approx), fences)


def backward_ratios(copies: dict, spec) -> tuple[Array, Array]:
    """What :func:`backward` with ``ratios`` reads in place of the forward's values, child and shift: each block's
    parents' ``exp(shift - value)`` (``[B, blocks * Kp]``, ``1 / value`` times the shift's exponential) and its
    child's ``exp(child - shift)`` (``[B, blocks * Kc]``), made by XLA in one pass outside the chain of steps."""
    B = copies["vals"].shape[0]
    shift = copies["shift"].reshape(B, -1, _SHIFT)[:, :, :1]  # [B, n, 1]
    n = shift.shape[1]
    ratios = jnp.exp(shift - copies["vals"].reshape(B, n, spec.Kp)).reshape(B, n * spec.Kp)
    exps = jnp.exp(copies["prod"].reshape(B, n, spec.Kc) - shift).reshape(B, n * spec.Kc)
    return ratios, exps


def copies(values: Array, tabs: dict, spec) -> dict:
    """The sample-major copies :func:`backward` reads (as :func:`forward` with ``keep`` returns them), rebuilt from
    the forward's node buffer ``values`` ``[R, B]``: each block's values, its child (the sum of its row blocks,
    ``tabs["child"]``) and the child's max per sample."""
    n, B = tabs["child"].shape[0], values.shape[1]
    rows = tabs["child"][:, :, None] + jnp.arange(spec.Kc, dtype=jnp.int32)  # [n, M, Kc]
    prod = values[rows].sum(axis=1)  # [n, Kc, B]
    shift = jnp.maximum(jnp.max(prod, axis=1), jnp.float32(-3e38))  # [n, B]
    return {"vals": values[tabs["rows"]].T, "prod": prod.transpose(2, 0, 1).reshape(B, n * spec.Kc),
            "shift": jnp.repeat(shift.T, _SHIFT, axis=1)}


def tf32_weights_t(logw: Array) -> Array:
    """The transposed weights :func:`backward` takes: ``exp(logw)`` ``[P, Kc, Kp]`` rounded to TF32."""
    return jnp.swapaxes(tf32_weights(logw), 1, 2)


def _check_smem(kernel: str, smem: int, tile: int, K: int, steps: int) -> None:
    """Raises where a block of ``kernel`` (``"forward"`` / ``"backward"``) would take more than ``SMEM`` bytes."""
    if smem > SMEM:
        raise ValueError(f"mosaic_tree.{kernel}: {tile}-row tasks of {K}-node blocks over {steps} steps need {smem} "
                         f"bytes of shared memory, more than {SMEM}: schedule smaller tasks")


def backward_smem(spec, B: int, tile: int, steps: int, ratios: bool) -> int:
    """Bytes of shared memory a block of :func:`backward`'s kernels takes (at most ``SMEM`` on the H200)."""
    K = spec.Kc
    if ratios:
        return 4 * (2 * tile * K + TILE * K + B * K + TILE * tile + steps * _BTASK)
    return 4 * (2 * tile * K + 2 * TILE * K + 2 * TILE * tile + TILE * _SHIFT + steps * _BTASK)


def backward(flows: Array, copies: dict, tabs: dict, weights_t: Array, spec, tile: int = TILE,
             interpret: bool | None = None, ratios: bool = False) -> Array:
    """The flow buffer ``flows`` (float32 ``[R, B]``, the rows of the tree's top blocks holding their flows) with the
    flows of every tree block's parent rows and of the rows from outside the tree that their children read (the
    input layer's) written, from :func:`forward`'s ``copies`` (``keep=True``), :func:`schedule`'s tables and the
    transposed weights (:func:`tf32_weights_t`). The parameter flows are left to the batched pass. With ``ratios``,
    the kernels read :func:`backward_ratios` instead of the copies' (:func:`_backward_ratio_kernel`: 64-row tasks of
    256-node blocks fit at batches up to 16). Needs ``Kp == Kc``."""
    if spec.Kp != spec.Kc or "btasks" not in tabs:
        raise ValueError(f"mosaic_tree.backward: needs square blocks, got Kp={spec.Kp}, Kc={spec.Kc}")
    interpret = _interpreted(interpret)
    K, steps = spec.Kc, max(t.shape[2] for t in tabs["btasks"])
    R, B = flows.shape
    if not interpret:
        _check_smem("backward", backward_smem(spec, B, tile, steps, ratios), tile, K, steps)
    inputs = tabs["inputs"]
    n = inputs.shape[0]
    parent_rows = tabs["rows"].reshape(n, K)
    given = flows[parent_rows[tabs["top"]].reshape(-1)]  # [T * K, B]
    pf = jnp.concatenate([jnp.zeros((B, n * K), jnp.float32), given.T], axis=1)
    pf = jax.new_ref(pf)
    wt = weights_t.astype(jnp.float32).reshape(-1, K)
    if ratios:
        r, e = backward_ratios(copies, spec)
        for t in tabs["btasks"]:
            _backward_ratio_kernel(t.shape[0], t.shape[2], K, K, B, tile, interpret, APPROX_MATH, FENCES)(
                t, wt, pf, r, e)
    else:
        for t in tabs["btasks"]:
            _backward_kernel(t.shape[0], t.shape[2], K, K, B, tile, interpret, APPROX_MATH, FENCES)(
                t, wt, pf, copies["vals"], copies["prod"], copies["shift"])
    pf = jax.freeze(pf)
    flows = flows.at[tabs["rows"]].set(pf[:, tabs["fin"]].T, unique_indices=True)
    child = pf[:, :n * K].T.reshape(n, 1, K, B)  # each block's child's flows, to its rows from outside the tree
    rows = jnp.where(inputs >= 0, inputs, R)[:, :, None] + jnp.arange(K, dtype=jnp.int32)
    flows = flows.at[rows].set(jnp.broadcast_to(child, rows.shape + (B,)), mode="drop")
    return flows


SUM_ROWS: Final = 64  # parent rows of a program of :func:`summed_param_flows` (the product's M)
SUM_COLS: Final = 128  # the most child columns of a program (its N: the product and the weights in registers)


def summed_fits(Kp: int, Kc: int, B: int) -> bool:
    """Whether :func:`summed_param_flows` takes blocks of ``Kp x Kc`` at a batch of ``B`` samples."""
    return 0 < B <= MAX_BATCH and Kp % SUM_ROWS == 0 and Kc % 32 == 0 and (Kc <= SUM_COLS or Kc % SUM_COLS == 0)


@functools.cache
def _summed_kernel(n: int, Kp: int, Kc: int, K: int, start: int, interpret: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    f32 = jnp.float32
    swizzled = _swizzled()
    N = min(Kc, SUM_COLS)

    def body(scale, y, logw, out, s_smem, y_smem, o_smem, bar):
        i, t, h = lax.axis_index("i"), lax.axis_index("t"), lax.axis_index("h")
        rows = pl.ds(pl.multiple_of(t * SUM_ROWS, SUM_ROWS), SUM_ROWS)
        cols = pl.ds(pl.multiple_of(h * N, N), N)
        plgpu.copy_gmem_to_smem(scale.at[i, rows], s_smem, bar.at[0])
        plgpu.copy_gmem_to_smem(y.at[i, cols], y_smem, bar.at[1])
        plgpu.copy_gmem_to_smem(logw.at[start + i, rows, cols], o_smem, bar.at[2])
        for k in range(3):
            plgpu.barrier_wait(bar.at[k])
        o_smem[...] = jnp.exp(o_smem[...]) * _product(s_smem, y_smem, N)
        _store(o_smem, out.at[i, rows, cols])

    extra = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((n, Kp, Kc), f32),
                        grid=(n, Kp // SUM_ROWS, Kc // N), grid_names=("i", "t", "h"), scratch_types=[
                            plgpu.SMEM((SUM_ROWS, K), f32, transforms=swizzled),
                            plgpu.SMEM((N, K), f32, transforms=swizzled),
                            plgpu.SMEM((SUM_ROWS, N), f32, transforms=swizzled), plgpu.Barrier(num_barriers=3)],
                        **extra)


def summed_param_flows(scale: Array, y: Array, logw: Array, start: int, interpret: bool | None = None) -> Array:
    """``exp(logw[start + i]) * (scale[i] @ y[i].T)`` for each of ``n`` blocks (float32 ``[n, Kp, Kc]``): the
    parameter flows of blocks whose weights are consecutive from ``start``, from each parent's flow over its local
    sum ``scale [n, Kp, B]`` and the children's shifted values ``y [n, Kc, B]``. One Mosaic GPU kernel, a program
    per block, :data:`SUM_ROWS` parents and :data:`SUM_COLS` children: the product on the tensor cores (TF32
    operands, the samples padded with zeros to a multiple of 32), the weights' exponentials multiplied in its
    epilogue, so that the product is never written out and read back (:func:`summed_fits`)."""
    n, Kp, B = scale.shape
    Kc = y.shape[1]
    if not summed_fits(Kp, Kc, B) or y.shape != (n, Kc, B) or logw.shape[1:] != (Kp, Kc):
        raise ValueError(f"mosaic_tree.summed_param_flows: needs scale [n, Kp, B], y [n, Kc, B] and log-weights "
                         f"[P, Kp, Kc] with Kp a multiple of {SUM_ROWS}, Kc a multiple of 32 up to {SUM_COLS} or of "
                         f"{SUM_COLS}, and B up to {MAX_BATCH}, got {list(scale.shape)}, {list(y.shape)}, "
                         f"{list(logw.shape)}")
    if not 0 <= start <= logw.shape[0] - n:
        raise ValueError(f"mosaic_tree.summed_param_flows: blocks {start}..{start + n} outside the "
                         f"{logw.shape[0]} weight blocks")
    K = -(-B // 32) * 32
    pad = ((0, 0), (0, 0), (0, K - B))
    s, yy = (jnp.pad(a.astype(jnp.float32), pad) for a in (scale, y))
    return _summed_kernel(n, Kp, Kc, K, int(start), _interpreted(interpret))(
        _round_tf32(s), _round_tf32(yy), logw.astype(jnp.float32))


def forward(buf: Array, tabs: dict, logw: Array | None, spec, interpret: bool | None = None,
            weights: Array | None = None, tile: int = TILE, keep: bool = False):
    """The node buffer ``buf`` (float32 ``[R, B]``) with the parent rows of every level of ``spec`` written, from
    :func:`schedule`'s tables ``tabs`` (device arrays) and the group's log-weights ``logw [P, Kp, Kc]``, or instead
    its ``weights`` (``exp(logw)``, rounded to TF32 by :func:`tf32_weights`). ``tile``: the schedule's. With
    ``keep``: ``(buf, copies)``, ``copies`` the sample-major ``prod`` and ``vals`` that :func:`backward` reads."""
    if buf.dtype != jnp.float32 or buf.ndim != 2 or not fits(spec, buf.shape[1], tile):
        raise ValueError(f"mosaic_tree.forward: needs a float32 node buffer [R, B] with B a multiple of 8 up to "
                         f"{MAX_BATCH} and blocks of {TILE}-row tiles, got {buf.dtype}{list(buf.shape)} for "
                         f"Kp={spec.Kp}, Kc={spec.Kc}")
    interpret = _interpreted(interpret)
    steps = max(t.shape[2] for t in tabs["tasks"])
    if not interpret:
        _check_smem("forward", 4 * (2 * tile * spec.Kc + TILE * spec.Kc + TILE * tile + TILE * _SHIFT + steps * _TASK),
                    tile, spec.Kc, steps)
    B = buf.shape[1]
    inputs = tabs["inputs"]
    n = inputs.shape[0]
    rows = jnp.maximum(inputs, 0)[:, :, None] + jnp.arange(spec.Kc, dtype=jnp.int32)
    start = jnp.where((inputs >= 0)[:, :, None, None], buf[rows], 0.0).sum(axis=1)  # [n, Kc, B]
    prod = jax.new_ref(start.transpose(2, 0, 1).reshape(B, n * spec.Kc))
    vals = jax.new_ref(jnp.zeros((B, n * spec.Kp), jnp.float32))
    shift = jax.new_ref(jnp.zeros((B, n * _SHIFT), jnp.float32))
    w = (logw if weights is None else weights).astype(jnp.float32).reshape(-1, spec.Kc)
    for t in tabs["tasks"]:
        _forward_kernel(t.shape[0], t.shape[2], spec.Kp, spec.Kc, B, tile, interpret, weights is None,
                        None if interpret else PROFILE_DIR, APPROX_MATH, FENCES)(t, w, prod, vals, shift)
    vals = jax.freeze(vals)
    out = buf.at[tabs["rows"]].set(vals.T, unique_indices=True)
    copies = {"prod": jax.freeze(prod), "vals": vals, "shift": jax.freeze(shift)}
    return (out, copies) if keep else out


__all__ = ["CLUSTER", "CLUSTERS", "MAX_BATCH", "SMEM", "TILE", "backward", "backward_ratios",
           "backward_smem", "copies", "fits", "forward", "schedule", "summed_fits",
           "summed_param_flows", "tf32_weights", "tf32_weights_t"]
