"""Time dependent chains of 256 x 256 log-space sum levels as Pallas Mosaic GPU kernels: one kernel per level (with
and without programmatic dependent launch), or many levels in one kernel on thread-block clusters.

    python benchmarks/level_probe.py [--levels 64] [--reps 50] [--sets 1] [--rows 64] [--batch-rows 64]
                                     [--variants pdl,plain,xla,cluster16,grid8x16] [--json out.json]

Per level ``l``: ``y[b, r] = m_b + log(sum_k exp(x[b, k] - m_b) W_l[r, k])`` (``m_b`` the row's max) for ``r, k <
256``; samples padded to the tensor cores' 64 rows (``x`` is ``[64, 256]``, sample-major). Variants, each one
jitted chain of ``--levels`` levels and one of 1 level, so the step is ``(t_L - t_1) / (L - 1)``:

- ``plain``: a kernel per level of ``256 / rows`` blocks of one warpgroup; each block copies its ``[rows, 256]``
  slice of ``W_l`` into shared memory (TMA), copies ``x``, takes the row maxima and exponentials, multiplies on the
  tensor cores (TF32 operands, truncated) and stores its ``[64, rows]`` columns of ``y``;
- ``pdl``: the same, each kernel calling ``griddepcontrol.launch_dependents`` first and ``griddepcontrol.wait``
  after its weight copy (programmatic dependent launch);
- ``xla``: the chain in ``jnp`` (a ``dot`` and the max / exp / log fusions), XLA's TF32;
- ``clusterN``: all levels in one kernel on one cluster of ``N`` blocks, each owning ``256 / N`` rows; a level's
  rows go through global memory (TMA store, wait, cluster barrier, every block's TMA load), the next level's weights
  copied while the current one computes;
- ``gridCxN``: ``C`` clusters of ``N`` blocks, cluster ``g`` computing node ``g`` of each level from node ``g + 1``
  of the level below, so every level waits for another cluster: a barrier of all clusters per level (each
  cluster's first block signals every cluster's semaphore in global memory and waits for its own) between two
  cluster barriers.

``--batch-rows`` (cluster and grid variants): the rows of ``x`` moved between levels (the samples; the rest stay
padding). ``--sets N`` rotates N chains with their own weights, so that the weights come from HBM rather than L2.
Reported: median synchronized ms per call and per step, pipelined (calls dispatched back to back) per step, and the
largest difference from a float64 NumPy chain over the moved rows. ``--lower-only`` lowers for CUDA on any machine.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

K, M = 256, 64


def level_kernel(rows: int, pdl: bool):
    """One level ``x [M, K] -> y [M, K]`` as a Mosaic GPU kernel of ``K // rows`` blocks."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    f32 = jnp.float32
    swizzled = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))

    def body(x_gmem, w_gmem, o_gmem, w_smem, x_smem, e_smem, o_smem, bars):
        blk = lax.axis_index("blk")
        if pdl:
            plgpu.griddepcontrol_launch_dependents()
        plgpu.copy_gmem_to_smem(w_gmem.at[pl.ds(blk * rows, rows), :], w_smem, bars.at[0])
        if pdl:
            plgpu.griddepcontrol_wait()
        plgpu.copy_gmem_to_smem(x_gmem, x_smem, bars.at[1])
        plgpu.barrier_wait(bars.at[1])
        x = x_smem[...]
        m = jnp.max(x, axis=1)
        e_smem[...] = jnp.exp(x - lax.broadcast_in_dim(m, (M, K), [0]))
        plgpu.commit_smem()
        plgpu.barrier_wait(bars.at[0])

        def product(acc):
            plgpu.wgmma(acc, e_smem, w_smem.T)
            return acc[...]

        acc = pl.run_scoped(product, plgpu.ACC((M, rows), f32))
        o_smem[...] = jnp.log(acc) + lax.broadcast_in_dim(m, (M, rows), [0])
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[:, pl.ds(blk * rows, rows)])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((M, K), f32), grid=(K // rows,), grid_names=("blk",),
        scratch_types=[plgpu.SMEM((rows, K), f32, transforms=swizzled), plgpu.SMEM((M, K), f32),
                       plgpu.SMEM((M, K), f32, transforms=swizzled), plgpu.SMEM((M, rows), f32),
                       plgpu.Barrier(num_barriers=2)])


def cluster_chain(levels: int, nclusters: int, nc: int, batch_rows: int):
    """``levels`` levels in one kernel on ``nclusters`` clusters of ``nc`` blocks, each block owning ``K // nc``
    output rows; a level's output goes through global memory (TMA store, then a cluster barrier, then every block's
    TMA load). With several clusters, each level holds ``nclusters`` nodes, cluster ``g`` computing node ``g`` from
    node ``g + 1`` of the level below: every level waits for another cluster, at a barrier of all clusters (each
    cluster's first block signals every cluster's semaphore in global memory and waits for its own) between two
    cluster barriers."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    f32 = jnp.float32
    rows = K // nc
    C = nclusters
    swizzled = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))

    def body(x_gmem, w_gmem, tmp_gmem, w_smem, x_smem, o_smem, wbar, xbar, cbar):
        g = lax.axis_index("g")
        c = lax.axis_index("c")
        sems = pl.get_global(plgpu.SemaphoreType.REGULAR((C,))) if C > 1 else None
        mine = pl.ds(c * rows, rows)
        src = lax.rem(g + 1, C)
        plgpu.copy_gmem_to_smem(w_gmem.at[0, g, mine, :], w_smem.at[0], wbar.at[0])
        plgpu.copy_gmem_to_smem(x_gmem.at[src, :batch_rows], x_smem.at[:batch_rows], xbar)

        def cluster_barrier():
            plgpu.barrier_arrive(cbar)
            plgpu.barrier_wait(cbar)

        def level(i, carry):
            slot = i % 2

            @pl.when(i + 1 < levels)
            def _():
                plgpu.copy_gmem_to_smem(w_gmem.at[i + 1, g, mine, :], w_smem.at[1 - slot], wbar.at[1 - slot])

            plgpu.barrier_wait(xbar)
            x = x_smem[...]
            m = jnp.max(x, axis=1)
            x_smem[...] = jnp.exp(x - lax.broadcast_in_dim(m, (M, K), [0]))
            plgpu.commit_smem()
            plgpu.barrier_wait(wbar.at[slot])

            def product(acc):
                plgpu.wgmma(acc, x_smem, w_smem.at[slot].T)
                return acc[...]

            acc = pl.run_scoped(product, plgpu.ACC((M, rows), f32))
            o_smem[...] = jnp.log(acc) + lax.broadcast_in_dim(m, (M, rows), [0])
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem.at[:batch_rows], tmp_gmem.at[slot, g, :batch_rows, mine])
            plgpu.wait_smem_to_gmem(0)
            cluster_barrier()
            if C > 1:
                @pl.when(c == 0)
                def _():
                    for j in range(C):
                        plgpu.semaphore_signal(sems.at[j], 1, memory_scope="gpu")
                    plgpu.semaphore_wait(sems.at[g], C, memory_scope="gpu")

                cluster_barrier()

            @pl.when(i + 1 < levels)
            def _():
                plgpu.copy_gmem_to_smem(tmp_gmem.at[slot, src, :batch_rows], x_smem.at[:batch_rows], xbar)
            return carry

        lax.fori_loop(0, levels, level, 0)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((2, C, M, K), f32), grid=(C,), grid_names=("g",), cluster=(nc,),
        cluster_names=("c",),
        scratch_types=[plgpu.SMEM((2, rows, K), f32, transforms=swizzled),
                       plgpu.SMEM((M, K), f32, transforms=swizzled), plgpu.SMEM((M, rows), f32),
                       plgpu.Barrier(num_barriers=2), plgpu.Barrier(),
                       plgpu.ClusterBarrier(collective_axes=("c",))])

    @jax.jit
    def run(x, ws):
        n = ws.shape[0]
        if n != levels:
            return cluster_chain(n, C, nc, batch_rows)(x, ws)
        return kernel(jnp.broadcast_to(x, (C, M, K)), jnp.broadcast_to(ws[:, None], (n, C, K, K)))[(n - 1) % 2, 0]
    return run


def xla_level(x, w):
    m = jnp.max(x, axis=1, keepdims=True)
    return jnp.log(jnp.dot(jnp.exp(x - m), w.T, precision=lax.Precision.DEFAULT)) + m


def chain(variant: str, rows: int, levels: int = 0, batch_rows: int = M):
    if variant.startswith("grid"):
        nclusters, nc = map(int, variant[len("grid"):].split("x"))
        return cluster_chain(levels, nclusters, nc, batch_rows)
    if variant.startswith("cluster"):
        return cluster_chain(levels, 1, int(variant[len("cluster"):]), batch_rows)
    step = xla_level if variant == "xla" else level_kernel(rows, variant == "pdl")

    @jax.jit
    def run(x, ws):
        for i in range(ws.shape[0]):
            x = step(x, ws[i])
        return x
    return run


def reference(x, ws):
    x = x.astype(np.float64)
    for w in ws.astype(np.float64):
        m = x.max(axis=1, keepdims=True)
        x = np.log(np.exp(x - m) @ w.T) + m
    return x


def median_ms(fn, args_list, reps):
    out = fn(*args_list[0])
    jax.block_until_ready(out)
    ts = []
    for i in range(reps):
        args = args_list[i % len(args_list)]
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    t = time.perf_counter()
    outs = [fn(*args_list[i % len(args_list)]) for i in range(reps)]
    jax.block_until_ready(outs)
    piped = (time.perf_counter() - t) / reps
    return 1e3 * float(np.median(ts)), 1e3 * piped


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", type=int, default=64)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--sets", type=int, default=1)
    ap.add_argument("--rows", type=int, default=64, help="output rows per block (the product's N)")
    ap.add_argument("--variants", default="pdl,plain,xla",
                    help="pdl, plain, xla, clusterN (one kernel on a cluster of N blocks), gridCxN (C clusters of N "
                         "blocks, a barrier of all clusters per level)")
    ap.add_argument("--batch-rows", type=int, default=M,
                    help="rows of x a cluster kernel moves between levels (the samples; the rest stay padding)")
    ap.add_argument("--lower-only", action="store_true", help="lower for CUDA on this machine and stop")
    ap.add_argument("--json")
    a = ap.parse_args()

    rng = np.random.default_rng(0)
    x0 = rng.normal(size=(M, K)).astype(np.float32)
    sets = [rng.uniform(0.0, 1.0, size=(a.levels, K, K)).astype(np.float32) for _ in range(a.sets)]
    sets = [w / w.sum(axis=2, keepdims=True) for w in sets]
    ref = reference(x0, sets[0])
    results = {}
    for variant in a.variants.split(","):
        run = chain(variant, a.rows, a.levels, a.batch_rows)
        if a.lower_only:
            txt = run.trace(jax.ShapeDtypeStruct((M, K), jnp.float32),
                            jax.ShapeDtypeStruct((a.levels, K, K), jnp.float32)).lower(
                lowering_platforms=("cuda",)).as_text()
            print(variant, "lowered", len(txt), "chars; custom calls:", txt.count("custom_call"))
            continue
        x = jnp.asarray(x0)
        dev = [(x, jnp.asarray(w)) for w in sets]
        one = [(x, w[:1]) for _, w in dev]
        br = a.batch_rows if variant.startswith(("cluster", "grid")) else M
        err = float(np.max(np.abs(np.asarray(run(*dev[0]), np.float64)[:br] - ref[:br])))
        t_l, p_l = median_ms(run, dev, a.reps)
        t_1, p_1 = median_ms(run, one, a.reps)
        step = (t_l - t_1) / (a.levels - 1)
        results[variant] = dict(ms=t_l, ms_one=t_1, step_us=1e3 * step,
                                piped_step_us=1e3 * (p_l - p_1) / (a.levels - 1), max_err=err)
        print(f"{variant:6s} {a.levels} levels {t_l:.3f} ms, 1 level {t_1:.3f} ms: {1e3 * step:.2f} us/level "
              f"(pipelined {results[variant]['piped_step_us']:.2f}); max |err| vs float64 {err:.2e}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), device=str(jax.devices()[0]), results=results), f, indent=1)


if __name__ == "__main__":
    main()
