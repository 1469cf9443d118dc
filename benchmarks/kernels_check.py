"""Check the Pallas sum-layer kernels against the reference on the GPU and time them per partition.

    python benchmarks/kernels_check.py [--no-timing] [--leaves] [--levels] [--triton] [--chain] [--fanin] [--products]
                                       [--tree [--tree-tuning FIELD=VALUE+...] [--batches 8,16]]
                                       [--repeats [--calls 40] [--tunings tree_clusters=1,] [--batches 16] [--no-fences]
                                                  [--circuits hclt-256]]

1. Correctness: forward, child flows and parameter flows of ``jaxpc.ops.pallas_sum`` against the
   plain-jnp reference on the device, over the shapes of ``tests/test_kernels.py`` plus large ones, and
   the tree-level backwards (``backward_exclusive``, and ``backward_level`` up to its batch) on folded tree levels
   (relative error ||got - ref|| / ||ref||; fp32 must be ~1e-6), and the batched parameter-flow kernel
   (``param_flows_after``, tf32); the leaf kernels (``jaxpc.ops.pallas_leaf``) at HCLT-256's size (equal buffers,
   counts against the one-hot product).
2. Speed: median device milliseconds of forward and forward+backward of one sum partition shaped like
   the benchmark workloads (HMM-1024 dense 1024x1024, HCLT-256 blocks 256x256 with fan-in 1, PD-128
   blocks 32x32 with fan-in 16), reference (XLA) vs each kernel configuration; the batched parameter flows of
   HCLT-256's 577 blocks at batch 16 and 32 (XLA's gather, product and weight multiply against the kernel); the
   node buffer with HCLT-256's leaves written at batch 16, 128 and 512 (XLA's gather and concatenation against
   the leaf kernel per tile) and HCLT-256's leaf counts (XLA's one-hot products against the counts kernel per
   tile). ``--leaves``: the leaf kernels only.
3. ``--levels`` (alone): HCLT-256 end to end with its tree levels evened into scans against the same circuit
   without them (:func:`check_evened_levels`).
4. ``--triton`` (alone): the jax-triton route (``jaxpc.ops.triton_sum``, ``jaxpc.ops.triton_leaf``): whether it
   runs here and why not, its sum-layer kernels against the reference over the shapes of 1. (fp32 and tf32) and
   its tree-level backwards on the levels of 1., its leaf buffer at HCLT-256's size, and the median milliseconds
   of one partition's forward and forward + backward, Pallas against jax-triton, shaped like HCLT-256's and
   PD-128's (:func:`check_triton`).
5. ``--chain`` (alone): HMM-1024's and HMM-256's default ``flows`` call on the persistent chain kernels
   (``jaxpc.ops.pallas_chain``) against the scans (``Tuning(chain_kernel_batch=0)``) and against the kernels one
   direction per launch (``Tuning(chain_side_by_side=False)``): relative error of each leaf
   at fp32 and at the default precision, and the median milliseconds of both calls per batch
   (:func:`check_chain`).
6. ``--fanin`` (alone): PD-128's default ``flows`` call, whose fan-in partitions run the one-kernel backward
   (``pallas_sum.backward_atomic``), against XLA's backward for them (``Tuning(fanin_kernel_batch=0)``): relative
   error of each leaf and the median milliseconds of both calls at batch 16, 128 and 512 (:func:`check_fanin`).
7. ``--tree`` (alone): HCLT-256's ``flows`` call on the persistent tree kernels (``jaxpc.ops.pallas_tree``,
   ``Tuning(tree_kernel_batch=64)``), or on the route ``--tree-tuning`` spells (such as
   ``tree_forward_tile=32+tree_backward_tile=32``), against the default call: relative error of each leaf at fp32
   and at the default precision, and the median milliseconds of both ``flows`` and ``em_step`` calls at batch 8 to
   64 (:func:`check_tree`).
8. ``--products`` (alone): PD-128's full layout with its product layers on ``jaxpc.ops.pallas_product`` against
   the same layout on XLA's product layers: relative error of each leaf at fp32 and the default precision, and the
   median milliseconds of both calls and of the folded plan (:func:`check_products`).
9. ``--mpe`` (alone): the max-plus forward (``pallas_sum.forward(..., propagation="MPE")``) against the reference
   over the shapes of 1. (it must be exact), then HCLT-256's and PD-128's ``mpe`` and hard-EM ``flows``
   (``propagation="MPE"``) calls with ``Tuning(max_product_kernels=True)`` and by default against XLA's reductions
   (``False``): whether the answers are equal and the median milliseconds of the calls per batch (:func:`check_mpe`).
10. ``--repeats`` (alone): whether the persistent routes are exact on every call: HCLT-256's, HMM-1024's and
   PD-128's (``--circuits``) ``log_prob`` and ``flows`` called ``--calls`` times per route (``--tunings``; default:
   the default call (on a Hopper GPU, the tree's levels on thread-block clusters with 64-row tasks up to batch 32),
   the same without XLA's concurrent command-buffer order, with 32-row tasks, and the levels one by one) and batch,
   each call against ``precision="fp32"`` on XLA (:func:`check_repeats`); ``--no-fences`` runs the cluster kernels
   without their steps' fences (``jaxpc.ops.mosaic_tree.FENCES``), which on an H100 gets some calls wrong.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jaxpc.ops import pallas_leaf, pallas_sum, pallas_tree  # noqa: E402
from jaxpc.ops.sum_layer import (  # noqa: E402
    child_rows,
    sum_layer_backward_reference,
    sum_layer_param_flows_reference,
    sum_layer_reference,
)
from tests.test_kernels import AFTER, SHAPES, make_after_case, make_partition, make_tree_level  # noqa: E402


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ok = np.isfinite(b)
    if not np.array_equal(np.isfinite(a), ok):
        return float("inf")
    return float(np.linalg.norm((a - b)[ok]) / max(np.linalg.norm(b[ok]), 1e-30))


def check(shape, precision, kernels=pallas_sum):
    """Relative errors (forward, child flows, parameter flows) of the sum-layer kernels of module ``kernels``
    (``pallas_sum`` or ``triton_sum``: the same functions) against the fp32 reference on one partition."""
    Kp, Kc, n, C, B = shape[:5]
    buf, t, logw, R = make_partition(*shape)
    ref = sum_layer_reference(buf, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc, dense=False, precision="fp32")
    out = kernels.forward(buf, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc, precision=precision)
    full = jnp.concatenate([buf, ref])
    flows = jnp.zeros_like(full).at[R:].set(jnp.where(jnp.isfinite(ref), 1.0, 0.0))
    cf_r, pf_r = sum_layer_backward_reference(full, flows, t["ch"], t["pid"], logw, R, Kp=Kp, Kc=Kc, dense=False)
    want = jnp.zeros_like(full).at[child_rows(t["ch"], Kc, False)].add(cf_r)
    a, m, pf = kernels.backward_parents(full, flows, R, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc, precision=precision)
    cf = kernels.backward_children(full, a, m, t["uch"], t["par"], t["ppid"], logw, Kp=Kp, Kc=Kc,
                                   precision=precision)
    got = jnp.zeros_like(full).at[(t["uch"][:, None] + jnp.arange(Kc)).reshape(-1)].add(cf)
    k = max(Kp, Kc)
    keep = np.r_[0:k, 2 * k:full.shape[0]]
    return rel(out, ref), rel(np.asarray(got)[keep], np.asarray(want)[keep]), rel(pf, pf_r)


def check_shapes(kernels, label: str) -> float:
    """:func:`check` of module ``kernels`` over the test shapes and two large ones, at fp32 and tf32, printed one
    line each; returns the worst fp32 error (inf where a shape fails)."""
    worst = 0.0
    for shape in SHAPES + [(64, 64, 8, 4, 256, 0.1, 0.1), (256, 256, 2, 1, 128, 0.0, 0.0)]:
        for precision in ("fp32", "tf32"):
            try:
                errs = check(shape, precision, kernels)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{label} {shape[:5]} {precision}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
                worst = float("inf")
                continue
            if precision == "fp32":
                worst = max(worst, max(errs))
            print(f"{label} Kp={shape[0]} Kc={shape[1]} n={shape[2]} C={shape[3]} B={shape[4]} {precision}: "
                  f"fwd {errs[0]:.1e} child flows {errs[1]:.1e} param flows {errs[2]:.1e}", flush=True)
    return worst


def check_levels(kernels, label: str) -> float:
    """The tree-level backwards of module ``kernels`` (``backward_exclusive``, and ``backward_level`` up to its
    batch: child flows into the M row blocks of folded children) against the reference on five levels, fp32 and
    tf32, printed one line each; returns the worst fp32 error."""
    worst = 0.0
    levels = [(16, 32, 2, 4, 19), (256, 256, 4, 3, 128), (64, 64, 8, 2, 600), (256, 256, 5, 3, 16), (1, 256, 1, 2, 64)]
    for Kp, Kc, n, M, B in levels:
        for precision in ("fp32", "tf32"):
            out, flows0, t, logw, off, base, want, pf_ref = make_tree_level(Kp, Kc, n, M, B)
            fns = {"exclusive": kernels.backward_exclusive}
            if B <= kernels.LEVEL_BATCH:
                fns["level"] = kernels.backward_level
            for kname, kernel in fns.items():
                try:
                    got, pf = kernel(out, flows0, off, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc, first_row=base,
                                     precision=precision)
                    errs = (rel(got, want), rel(pf, pf_ref))
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"{label} {kname} {(Kp, Kc, n, M, B)} {precision}: FAILED {type(e).__name__}: "
                          f"{str(e)[:300]}", flush=True)
                    errs = (float("inf"),)
                if precision == "fp32":
                    worst = max(worst, max(errs))
                print(f"{label} ({kname}) Kp={Kp} Kc={Kc} n={n} M={M} B={B} {precision}: flows "
                      f"{errs[0]:.1e} param flows {errs[-1]:.1e}", flush=True)
    return worst


def bench(fn, reps=30):
    for _ in range(3):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t)
    return 1e3 * float(np.median(ts))


def piped(fn, reps=30):
    """Milliseconds per call of ``reps`` calls dispatched back to back and waited for once: the device's time where
    it exceeds the host's dispatch (a synchronized call of a kernel of a few hundred microseconds is mostly the
    host's dispatch and wake-up on the H200's machine)."""
    jax.block_until_ready(fn())
    t = time.perf_counter()
    for _ in range(reps):
        out = fn()
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - t) / reps


def partition(Kp, Kc, n, C, B, dense, seed=0):
    rng = np.random.default_rng(seed)
    nch = C if dense else n * C
    R = nch * Kc + n * Kp + 2 * max(Kp, Kc)
    buf = jnp.asarray(rng.normal(size=(R, B)).astype(np.float32))
    base = 2 * max(Kp, Kc)
    if dense:
        ch = np.tile(base + np.arange(C) * Kc, (n, 1))
    else:
        ch = base + (np.arange(n * C) * Kc).reshape(n, C)
    pid = np.arange(n * C).reshape(n, C)
    from jaxpc.compiler.compile import inverse_tables
    inv = inverse_tables(ch, pid)
    t = {k: jnp.asarray(v, jnp.int32) for k, v in {"ch": ch, "pid": pid, **inv}.items()}
    logw = jnp.asarray(np.log(rng.random((n * C, Kp, Kc)) + 1e-3).astype(np.float32))
    off = R - n * Kp
    return buf, t, logw, off


def time_partition(name, Kp, Kc, n, C, dense, B, precision, configs, kernels=pallas_sum):
    buf, t, logw, off = partition(Kp, Kc, n, C, B, dense)
    flows = jnp.zeros_like(buf).at[off:].set(1.0)

    @jax.jit
    def ref_fwd(buf, logw):
        return sum_layer_reference(buf, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc, dense=dense, precision=precision)

    @jax.jit
    def ref_bwd(buf, flows, logw):
        cf, pf = sum_layer_backward_reference(buf, flows, t["ch"], t["pid"], logw, off, Kp=Kp, Kc=Kc, dense=dense,
                                              precision=precision)
        return flows.at[child_rows(t["ch"], Kc, dense)].add(cf), pf

    row = {"ref": (bench(lambda: ref_fwd(buf, logw)), bench(lambda: ref_bwd(buf, flows, logw)))}
    for cfg in configs:
        @jax.jit
        def k_fwd(buf, logw, cfg=cfg):
            return kernels.forward(buf, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc, precision=precision, config=cfg)

        @jax.jit
        def k_bwd(buf, flows, logw, cfg=cfg):
            a, m, pf = kernels.backward_parents(buf, flows, off, t["ch"], t["pid"], logw, Kp=Kp, Kc=Kc,
                                                precision=precision, config=cfg)
            cf = kernels.backward_children(buf, a, m, t["uch"], t["par"], t["ppid"], logw, Kp=Kp, Kc=Kc,
                                           precision=precision, config=cfg)
            return flows.at[(t["uch"][:, None] + jnp.arange(Kc)).reshape(-1)].add(cf), pf

        try:
            row[f"b{cfg.block_b}k{cfg.block_k}w{cfg.num_warps}"] = (bench(lambda: k_fwd(buf, logw)),
                                                     bench(lambda: k_bwd(buf, flows, logw)))
        except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
            row[f"b{cfg.block_b}k{cfg.block_k}w{cfg.num_warps}"] = (float("nan"), float("nan"))
            print(f"  {name} B={B} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    best = min((k for k in row if k != "ref"), key=lambda k: row[k][0] + row[k][1])
    mod = kernels.__name__.split(".")[-1]
    print(f"{name:10s} {mod} {precision} B={B:4d} ref fwd {row['ref'][0]:.3f} bwd {row['ref'][1]:.3f} ms | "
          f"best kernel {best}: fwd {row[best][0]:.3f} bwd {row[best][1]:.3f} ms | "
          + " ".join(f"{k}={v[0]:.3f}/{v[1]:.3f}" for k, v in row.items() if k not in ("ref", best)), flush=True)
    return row


def check_after() -> float:
    """The batched parameter-flow kernel (tf32: local sums from the stored values; kept shifts, every third
    recomputed) against the reference over ``AFTER`` plus HCLT-256-like blocks; the largest relative error."""
    worst = 0.0
    for shape in AFTER + [(256, 256, 24, 1, 2, 16), (256, 256, 24, 1, 1, 128), (32, 32, 40, 4, 2, 100)]:
        Kp, Kc = shape[:2]
        try:
            vals, fl, shifts, srow, prow, ch, pid, logw = make_after_case(*shape)
            want = sum_layer_param_flows_reference(vals, fl, ch, pid, logw, prow, Kp=Kp, Kc=Kc, precision="tf32")
            got = pallas_sum.param_flows_after(vals, fl, shifts, srow, prow, ch, pid, logw, Kp=Kp, Kc=Kc)
            err = rel(got, want)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"check param_flows_after {shape}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            err = float("inf")
        print(f"check param_flows_after Kp={Kp} Kc={Kc} n={shape[2]} C={shape[3]} M={shape[4]} B={shape[5]} "
              f"tf32: param flows {err:.1e}", flush=True)
        worst = max(worst, err)
    return worst


def time_after(B, configs, n=577):
    """The batched parameter flows of ``n`` HCLT-256 blocks (256 x 256, fan-in 1, folded children of 2 row
    blocks, every shift kept), tf32: XLA's gather, max, product and weight multiply against the kernel per
    configuration (ms)."""
    vals, fl, shifts, srow, prow, ch, pid, logw = make_after_case(256, 256, n, 1, 2, B, unkept=0)
    ref = jax.jit(lambda v, f, lw: sum_layer_param_flows_reference(v, f, ch, pid, lw, prow, Kp=256, Kc=256,
                                                                   precision="tf32"))
    line = [f"xla {bench(lambda: ref(vals, fl, logw)):.3f}"]
    for cfg in configs:
        k = jax.jit(lambda v, f, lw, cfg=cfg: pallas_sum.param_flows_after(v, f, shifts, srow, prow, ch, pid, lw,
                                                                          Kp=256, Kc=256, config=cfg))
        try:
            line.append(f"{cfg.block_b}/{cfg.block_k}/{cfg.num_warps} {bench(lambda: k(vals, fl, logw)):.3f}")
        except Exception as e:  # noqa: BLE001 - a configuration the compiler refuses
            line.append(f"{cfg.block_b}/{cfg.block_k}/{cfg.num_warps} failed ({type(e).__name__})")
    print(f"time param_flows_after HCLT-256 n={n} B={B} tf32 (ms): " + " | ".join(line), flush=True)


def leaf_case(B, missing=False, V=784, K=256, run=256, R=348_161, kmax=256, seed=0):
    """HCLT-256's input layer: ``V`` variables with ``run`` categorical leaves of ``K`` categories each, node ``i``
    reading parameter row ``i``, in a buffer of ``R`` rows (the folded plan's)."""
    rng = np.random.default_rng(seed)
    N = V * run
    lp = jnp.asarray(np.log(rng.dirichlet(np.ones(K), N)).astype(np.float32))
    tab = (lp, jnp.arange(N, dtype=jnp.int32), jnp.repeat(jnp.arange(V, dtype=jnp.int32), run),
           jnp.asarray(rng.normal(size=N), jnp.float32))
    xt = jnp.asarray(rng.integers(0, K, (V, B)), jnp.int32)
    miss = jnp.asarray(rng.random((V, B)) < 0.2) if missing else None
    return xt, [pallas_leaf.LeafLayer(2 * kmax, N, K)], [tab], miss, dict(num_rows=R, kmax=kmax)


def check_leaves() -> bool:
    """The leaf kernel against the reference at HCLT-256's size: the buffers must be equal."""
    ok = True
    for B in (16, 77, 512):
        for missing in (False, True):
            xt, layers, tabs, miss, kw = leaf_case(B, missing)
            got = pallas_leaf.categorical_buffer(xt, layers, tabs, missing=miss, **kw)
            ref = pallas_leaf.categorical_buffer_reference(xt, layers, tabs, missing=miss, **kw)
            same = bool(np.array_equal(np.asarray(got), np.asarray(ref), equal_nan=True))
            ok &= same
            print(f"check leaf buffer HCLT-256 B={B} missing={missing}: {'equal' if same else 'DIFFERENT'}", flush=True)
    return ok


def time_leaves(B, configs):
    """The node buffer with HCLT-256's leaves written: XLA's gather and concatenation against the kernel per
    configuration (ms, and the buffer's bytes per ms as TB/s)."""
    xt, layers, tabs, _, kw = leaf_case(B)
    tb = kw["num_rows"] * B * 4 / 1e9
    ref = jax.jit(lambda x: pallas_leaf.categorical_buffer_reference(x, layers, tabs, **kw))
    t = bench(lambda: ref(xt))
    line = [f"xla {t:.3f} ({tb / t:.2f} TB/s)"]
    for cfg in configs:
        k = jax.jit(lambda x, cfg=cfg: pallas_leaf.categorical_buffer(x, layers, tabs, config=cfg, **kw))
        try:
            t = bench(lambda: k(xt))
            line.append(f"{cfg.block_b}/{cfg.block_e}/{cfg.num_warps} {t:.3f} ({tb / t:.2f})")
        except Exception as e:  # noqa: BLE001 - a configuration the compiler refuses
            line.append(f"{cfg.block_b}/{cfg.block_e}/{cfg.num_warps} failed ({type(e).__name__})")
    print(f"time leaf buffer HCLT-256 B={B} ({tb * 1e3:.0f} MB) ms: " + " | ".join(line), flush=True)


def counts_case(B, V=784, K=256, run=256, seed=0):
    """HCLT-256's input layer's node flows ``[V * run, B]`` and values ``[V, B]``."""
    rng = np.random.default_rng(seed)
    flows = jnp.asarray(rng.random((V * run, B)) / run, jnp.float32)
    return flows, jnp.asarray(rng.integers(0, K, (V, B)), jnp.int32)


def check_counts() -> float:
    """The counts kernel against the one-hot product at HCLT-256's size: relative error (fp32 must be ~1e-7)."""
    worst = 0.0
    for B in (16, 77, 512):
        flows, xg = counts_case(B)
        for precision in ("fp32", "tf32"):
            got = pallas_leaf.categorical_counts(flows, xg, run=256, num_cats=256, precision=precision)
            ref = pallas_leaf.categorical_counts_reference(flows, xg, run=256, num_cats=256, precision="fp32")
            err = rel(got, ref)
            if precision == "fp32":
                worst = max(worst, err)
            print(f"check leaf counts HCLT-256 B={B} {precision}: {err:.1e}", flush=True)
    return worst


def time_counts(B, configs):
    """HCLT-256's leaf counts as the step computes them: XLA's one-hot products (``Categorical.suff_stats_runs``,
    chunked, concatenated) against the kernel per configuration (ms, and TFLOP/s of the product)."""
    from jaxpc import Options, distributions

    flows, xg = counts_case(B)
    dist, opts = distributions.Categorical(256), Options(precision="tf32")
    tf = 2 * flows.shape[0] * B * 256 / 1e9
    ref = jax.jit(lambda f, x: dist.suff_stats_runs({}, None, x, None, f, 256, opts)["counts"])
    t = bench(lambda: ref(flows, xg))
    line = [f"xla {t:.3f} ({tf / t:.0f} TFLOP/s)"]
    for cfg in configs:
        k = jax.jit(lambda f, x, cfg=cfg: pallas_leaf.categorical_counts(f, x, run=256, num_cats=256, config=cfg))
        try:
            t = bench(lambda: k(flows, xg))
            line.append(f"{cfg.block_r}/{cfg.block_k}/{cfg.block_b}/{cfg.num_warps}/{cfg.num_stages} {t:.3f} "
                        f"({tf / t:.0f})")
        except Exception as e:  # noqa: BLE001 - a configuration the compiler refuses
            line.append(f"{cfg.block_r}/{cfg.block_k}/{cfg.block_b}/{cfg.num_warps} failed ({type(e).__name__})")
    print(f"time leaf counts HCLT-256 B={B} ms: " + " | ".join(line), flush=True)


COUNTS_CONFIGS = [pallas_leaf.CountsConfig(), pallas_leaf.CountsConfig(128, 256, 32, 8),
                  pallas_leaf.CountsConfig(128, 128, 64, 4), pallas_leaf.CountsConfig(64, 256, 32, 4, 3),
                  pallas_leaf.CountsConfig(128, 256, 64, 8, 3), pallas_leaf.CountsConfig(64, 128, 128, 4),
                  pallas_leaf.CountsConfig(256, 128, 32, 8)]

LEAF_CONFIGS = [pallas_leaf.LeafConfig(), pallas_leaf.LeafConfig(64, 4096), pallas_leaf.LeafConfig(128, 8192, 8),
                pallas_leaf.LeafConfig(256, 8192, 8), pallas_leaf.LeafConfig(512, 8192, 8),
                pallas_leaf.LeafConfig(512, 16384, 8), pallas_leaf.LeafConfig(16, 16384, 8),
                pallas_leaf.LeafConfig(16, 2048, 4), pallas_leaf.LeafConfig(16, 1024, 2)]


def check_evened_levels(batches=(16, 128, 512), timing: bool = True, reps: int = 40) -> float:
    """HCLT-256 with its tree levels evened into scans (``jaxpc.compiler.levels``, the default) against the same
    circuit compiled without them (``scan_min_repeats=0``): the default call's log-likelihoods and flows, relative
    error of each leaf at fp32 and at the default precision, and (``timing``) the default call ``c.flows(params,
    x)`` of each (on a GPU the evened circuit's optimized executable runs its levels unrolled:
    ``Tuning.unroll_optimized``) and the evened circuit's with its levels kept in scans
    (``Tuning(unroll_optimized=False)``), timed in turns. Returns the worst fp32 error."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import jaxpc
    from _data import blurred_noise_images
    from jaxpc import distributions, structures

    imgs = blurred_noise_images(2000)
    root = structures.HCLT(imgs, 256, input_dist=distributions.Categorical(256))
    even, plain = jaxpc.compile(root), jaxpc.compile(root, scan_min_repeats=0)
    worst = 0.0
    for B in batches:
        x = jax.device_put(imgs[:B].astype(np.int32))
        for precision in ("fp32", "default") if B == batches[0] else ("default",):  # (the timed executables)
            opts = jaxpc.Options(precision=precision)
            got = even.flows(even.params, x, options=opts, return_ll=True)
            want = plain.flows(plain.params, x, options=opts, return_ll=True)
            err = max(rel(a, b) for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))
            if precision == "fp32":
                worst = max(worst, err)
            print(f"check evened HCLT-256 levels B={B} {precision}: worst leaf {err:.1e}", flush=True)
        if timing:
            scanned = jaxpc.Options(tuning=jaxpc.Tuning(unroll_optimized=False))
            calls = {"evened": lambda: even.flows(even.params, x), "plain": lambda: plain.flows(plain.params, x),
                     "evened scanned": lambda: even.flows(even.params, x, options=scanned)}
            for f in calls.values():
                jax.block_until_ready(f())
            even.wait_compiled()
            plain.wait_compiled()  # (the optimized executables, not the quick first compiles)
            ms = {k: [] for k in calls}
            for _ in range(3):  # in turns, so that clocks and caches treat all alike
                for k, f in calls.items():
                    ms[k].append(bench(f, reps))
            print(f"time HCLT-256 B={B} c.flows(params, x) ms: "
                  + " | ".join(f"{k} {min(v):.3f}" for k, v in ms.items()), flush=True)
            last = even.compiled("flows").as_text()  # (the variant timed last)
            print(f"loops in the scanned variant's executable: {last.count(' while(')}", flush=True)
    return worst


def check_triton(timing: bool = True) -> float:
    """The jax-triton route on this machine: its status, its kernels against the reference (the shapes of
    :func:`check`, fp32 and tf32), its leaf buffer at HCLT-256's size against the reference, and (``timing``)
    one partition's forward and forward + backward on Pallas and on jax-triton (HCLT-like 256 x 256 blocks of
    fan-in 1, PD-like 32 x 32 blocks of fan-in 16, at batches 16 and 512). Returns the worst fp32 error."""
    from jaxpc.ops import triton_base, triton_leaf, triton_sum

    ok, reason = triton_base.status()
    print(f"jax-triton route: {'runs' if ok else 'does not run'} ({reason})", flush=True)
    if not ok:
        return float("inf")
    worst = max(check_shapes(triton_sum, "check triton"), check_levels(triton_sum, "check triton tree level"))
    for B in (16, 512):
        for missing in (False, True):
            xt, layers, tabs, miss, kw = leaf_case(B, missing)
            got = triton_leaf.categorical_buffer(xt, layers, tabs, missing=miss, **kw)
            ref = pallas_leaf.categorical_buffer_reference(xt, layers, tabs, missing=miss, **kw)
            same = bool(np.array_equal(np.asarray(got), np.asarray(ref), equal_nan=True))
            worst = worst if same else float("inf")
            print(f"check triton leaf buffer HCLT-256 B={B} missing={missing}: {'equal' if same else 'DIFFERENT'}",
                  flush=True)
        if timing:
            xt, layers, tabs, _, kw = leaf_case(B)
            ms = {}
            for name, mod in (("pallas", pallas_leaf), ("triton", triton_leaf)):
                f = jax.jit(lambda x, mod=mod: mod.categorical_buffer(x, layers, tabs, **kw))
                ms[name] = bench(lambda f=f: f(xt))
            print(f"time leaf buffer HCLT-256 B={B} ms: " + " | ".join(f"{k} {v:.3f}" for k, v in ms.items()),
                  flush=True)
    if timing:
        cfg = [pallas_sum.KernelConfig()]
        for B in (16, 512):
            for kernels in (pallas_sum, triton_sum):
                time_partition("HCLT-like", 256, 256, 8, 1, False, B, "tf32", cfg, kernels)
                time_partition("PD-like", 32, 32, 256, 16, False, B, "tf32", cfg, kernels)
    return worst


def check_chain(cases=((1024, (8, 16, 32)), (256, (16, 32, 64, 128))), reps=30) -> float:
    """HMMs of 64 steps and 4,096 symbols, ``(latents, batches)`` per case: the default call (persistent kernels
    where ``jaxpc.engine.chain.persistent`` says so) against the scans; returns the worst fp32 relative error."""
    import jaxpc
    from jaxpc import structures

    rng = np.random.default_rng(0)
    worst = 0.0
    for L, batches in cases:
        worst = max(worst, _check_chain(jaxpc.compile(structures.HMM(64, L, 4096)), L, batches, reps, rng))
    return worst


def _check_chain(c, L, batches, reps, rng) -> float:
    import jaxpc

    inputs = {B: jax.device_put(rng.integers(0, 4096, (B, 64)).astype(np.int32)) for B in batches}
    worst = compare_routes(c, f"chain HMM-{L}", inputs, (jaxpc.Tuning(), jaxpc.Tuning(chain_kernel_batch=0)),
                           ("kernels", "scans"), reps)
    return max(worst, compare_routes(c, f"chain HMM-{L}", inputs, (jaxpc.Tuning(),
                                                                   jaxpc.Tuning(chain_side_by_side=False)),
                                     ("side by side", "one way"), reps))


def compare_routes(c, label: str, inputs: dict, tunings: tuple, names: tuple, reps: int, em_step: bool = False
                   ) -> float:
    """``c.flows`` on two routes (``Options(tuning=t)`` for each of ``tunings``) at each batch of ``inputs`` (batch:
    device array), at fp32 and at the default precision: the worst relative error of any leaf of the first against
    the second, and at the default precision the median milliseconds of both calls (and of both ``em_step`` calls).
    Both answers come from the optimized executables (after ``c.wait_compiled()``): a first call runs the quick
    compile, which takes neither the cluster route nor its options. Returns the worst fp32 error."""
    import jaxpc

    worst = 0.0
    for B, x in inputs.items():
        for precision in ("fp32", "default"):
            opts = [jaxpc.Options(precision=precision, tuning=t) for t in tunings]
            for o in opts:
                jax.block_until_ready(c.flows(c.params, x, options=o, return_ll=True))
            c.wait_compiled()
            got, want = (c.flows(c.params, x, options=o, return_ll=True) for o in opts)
            err = max(rel(a, b) for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))
            if precision == "fp32":
                worst = max(worst, err)
            line = f"check {label} B={B} {precision}: worst leaf {err:.1e}"
            if precision == "default":
                c.wait_compiled()
                ms = [bench(lambda o=o: c.flows(c.params, x, options=o), reps) for o in opts]
                line += f"; flows ms {names[0]} {ms[0]:.3f} {names[1]} {ms[1]:.3f}"
                if em_step:  # each route's optimized executable, not the quick one its first call runs
                    for o in opts:
                        jax.block_until_ready(c.em_step(c.params, x, options=o))
                    c.wait_compiled()
                    em = [bench(lambda o=o: c.em_step(c.params, x, options=o), reps) for o in opts]
                    line += f"; em_step ms {em[0]:.3f} / {em[1]:.3f}"
            print(line, flush=True)
    return worst


def check_tree(batches=(8, 16, 32, 64), reps=30, against: str = "") -> float:
    """HCLT-256's ``flows`` call with its tree levels on the persistent kernels (``jaxpc.ops.triton_tree`` where
    jax-triton runs and the levels fit, else ``jaxpc.ops.pallas_tree``; ``Tuning(tree_kernel_batch=64)``,
    ``jaxpc.engine.routing.tree_kernel``), or with the tuning ``against`` spells (``field=value`` joined by ``+``),
    against the default call: relative error of each leaf (log-likelihoods, flows) at fp32 and at the default
    precision, and the median milliseconds of both calls and of both ``em_step`` calls per batch. Returns the worst
    fp32 error."""
    import jaxpc
    from jaxpc import distributions, structures

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _data import blurred_noise_images

    imgs = blurred_noise_images(2000)
    c = jaxpc.compile(structures.HCLT(imgs, 256, input_dist=distributions.Categorical(256)))
    tree = c.layout.fold.tree
    print(f"HCLT-256 tree: {tree.levels} levels, {tree.blocks} blocks of {tree.Kp}x{tree.Kc}, M={tree.M}; "
          f"programs {pallas_tree.programs(False)}", flush=True)
    inputs = {B: jax.device_put(imgs[:B].astype(np.int32)) for B in batches}
    from jaxpc.engine import routing

    routes = {B: routing.tree_kernel(c.layout.fold, jaxpc.Options(tuning=jaxpc.Tuning(tree_kernel_batch=64)), B,
                                     jnp.float32) for B in batches}
    print(f"tree kernels' route per batch: {routes}", flush=True)
    clusters = c.tables["fold"]["tree"].get("clusters")
    if clusters is not None:  # the clusters' steps per launch (jaxpc.ops.mosaic_tree.schedule)
        print("clusters' steps per launch: " + ", ".join(
            f"{k} {[int(t.shape[2]) for t in clusters[k]]}" for k in ("tasks", "wide_tasks") if k in clusters),
              flush=True)
    if against:
        from _options import tuning

        return compare_routes(c, "tree HCLT-256", inputs, (tuning(against), jaxpc.Tuning()), (against, "default"),
                              reps, em_step=True)
    return compare_routes(c, "tree HCLT-256", inputs, (jaxpc.Tuning(tree_kernel_batch=64), jaxpc.Tuning()),
                          ("tree kernels", "per level"), reps, em_step=True)


def check_summed(batches=(16, 32, 64), n=577, K=256, reps=40) -> float:
    """:func:`jaxpc.ops.mosaic_tree.summed_param_flows` (``Tuning.pflow_sum_batch``) against XLA's matrix product
    and multiplication by the weights (the batched pass's default) on ``n`` blocks of ``K x K`` (HCLT-256's tree):
    ms of each (median synchronized, and dispatched back to back), the kernel's largest relative difference (TF32
    operands on both). Returns the worst."""
    from jaxpc.ops import mosaic_tree

    rng = np.random.default_rng(0)
    logw = jax.device_put(rng.normal(size=(n, K, K)).astype(np.float32))
    xla = jax.jit(lambda s, y, lw: jnp.exp(lw) * jnp.einsum("nkb,ncb->nkc", s, y))
    kernel = jax.jit(lambda s, y, lw: mosaic_tree.summed_param_flows(s, y, lw, 0))
    worst = 0.0
    for B in batches:
        s, y = (jax.device_put(rng.random((n, K, B)).astype(np.float32)) for _ in range(2))
        err = rel(np.asarray(kernel(s, y, logw)), np.asarray(xla(s, y, logw)))
        worst = max(worst, err)
        ms = [(bench(f, reps), piped(f, reps)) for f in (lambda: xla(s, y, logw), lambda: kernel(s, y, logw))]
        print(f"summed pflows B={B}: XLA {ms[0][0]:.3f} ms (back to back {ms[0][1]:.3f}), kernel {ms[1][0]:.3f} ms "
              f"(back to back {ms[1][1]:.3f}), rel diff {err:.1e}", flush=True)
    return worst


def check_fanin(batches=(16, 128, 512), reps=30, latents=128) -> float:
    """PD-``latents`` (28x28, splits (4, 4)): the default call, whose fan-in partitions run
    ``pallas_sum.backward_atomic`` (``jaxpc.engine.routing.atomic_backward``) on tables padded to their kernel
    class's shape (``jaxpc.compiler.compile.shared_kernel_tables``), against XLA's backward for them
    (``Tuning(fanin_kernel_batch=0)``), both at JAX's default precision; returns the worst relative error of any
    leaf (log-likelihoods, flows) and prints both calls' ms, and the worst error against the whole call on XLA
    (``impl="xla"``: the partitions' own tables, forward included)."""
    import jaxpc
    from jaxpc import distributions, structures

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _data import blurred_noise_images

    c = jaxpc.compile(structures.PD((28, 28), latents, split_intervals=(4, 4),
                                    input_dist=distributions.Categorical(256)))
    data = blurred_noise_images(max(batches) * 4)
    worst = 0.0
    for B in batches:
        xs = [jax.device_put(data[i * B:(i + 1) * B]) for i in range(4)]
        kern, xla = jaxpc.Options(), jaxpc.Options(tuning=jaxpc.Tuning(fanin_kernel_batch=0))
        got = c.flows(c.params, xs[0], options=kern, return_ll=True)
        want = c.flows(c.params, xs[0], options=xla, return_ll=True)
        on_xla = c.flows(c.params, xs[0], options=jaxpc.Options(impl="xla"), return_ll=True)
        err = max(rel(a, b) for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))
        err_xla = max(rel(a, b) for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(on_xla)))
        worst = max(worst, err)
        c.wait_compiled()
        ms = [bench(lambda o=o: c.flows(c.params, xs[0], options=o), reps) for o in (kern, xla)]
        print(f"check fan-in PD-{latents} B={B}: worst leaf {err:.1e} ({err_xla:.1e} against impl='xla'); flows ms "
              f"atomic kernel {ms[0]:.3f} XLA {ms[1]:.3f}", flush=True)
    return worst


def check_products(batches=(16, 128, 512), reps=20, latents=128) -> float:
    """PD-``latents`` (28x28, splits (4, 4)) on its full layout with the product kernels
    (``jaxpc.ops.pallas_product``; ``Tuning(full_layout_reads=1)`` makes the flow pass take it), against the same
    layout with XLA's product layers (``Options(fold_products=False)`` with ``Tuning(product_kernel_batch=0)``),
    at fp32 and at the default precision: relative error of each leaf and the median milliseconds of both calls and
    of the folded plan's (the default) per batch. Returns the worst fp32 error."""
    import jaxpc
    from jaxpc import distributions, structures

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _data import blurred_noise_images

    c = jaxpc.compile(structures.PD((28, 28), latents, split_intervals=(4, 4),
                                    input_dist=distributions.Categorical(256)))
    data = blurred_noise_images(max(batches))
    worst = 0.0
    for B in batches:
        x = jax.device_put(data[:B])
        for precision in ("fp32", "default"):
            kern = jaxpc.Options(precision=precision, tuning=jaxpc.Tuning(full_layout_reads=1))
            xla = jaxpc.Options(precision=precision, fold_products=False, tuning=jaxpc.Tuning(product_kernel_batch=0))
            got, want = (c.flows(c.params, x, options=o, return_ll=True) for o in (kern, xla))
            err = max(rel(a, b) for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))
            line = f"check products PD-{latents} B={B} {precision}: worst leaf {err:.1e}"
            if precision == "fp32":
                worst = max(worst, err)
            else:
                c.wait_compiled()
                ms = [bench(lambda o=o: c.flows(c.params, x, options=o), reps) for o in (kern, xla, jaxpc.Options())]
                line += f"; flows ms product kernels {ms[0]:.3f} XLA's products {ms[1]:.3f} folded plan {ms[2]:.3f}"
            print(line, flush=True)
    return worst


def check_mpe(batches=(16, 128, 512), reps=30) -> bool:
    """The max-plus forward kernel against the reference on the shapes of ``tests/test_kernels.py`` (values and first
    maximizers, exact), then
    ``c.mpe`` (a third of the variables unobserved) and ``c.flows`` under ``propagation="MPE"`` of HCLT-256 and
    PD-128 with the kernels (``Tuning(max_product_kernels=True)``) and by default against without
    (``max_product_kernels=False``); prints each call's largest difference and the three routes' median ms.
    Returns whether every answer was equal."""
    import jaxpc

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from profile_step import build

    equal = True
    for shape in SHAPES:
        Kp, Kc, n, C, B = shape[:5]
        buf, t, logw, _ = make_partition(*shape)
        R = buf.shape[0]
        f = jax.jit(lambda b, ch, pid, lw, Kp=Kp, Kc=Kc, R=R: (
            *pallas_sum.forward(jnp.concatenate([b, jnp.zeros((ch.shape[0] * Kp, b.shape[1]))]), ch, pid, lw, Kp=Kp,
                                Kc=Kc, propagation="MPE", out_offset=R,
                                firsts=jnp.zeros((R + ch.shape[0] * Kp, b.shape[1]), jnp.int32)),
            *sum_layer_reference(b, ch, pid, lw, Kp=Kp, Kc=Kc, dense=False, propagation="MPE", with_first=True)))
        got, first, want, want_first = (np.asarray(a) for a in f(buf, t["ch"], t["pid"], logw))
        same = np.array_equal(got[R:], want) and np.array_equal(first[R:], want_first)
        equal &= same
        print(f"check max-plus Kp={Kp} Kc={Kc} n={n} C={C} B={B}: {'equal' if same else 'DIFFERENT'}", flush=True)
    on = jaxpc.Options(tuning=jaxpc.Tuning(max_product_kernels=True))
    off = jaxpc.Options(tuning=jaxpc.Tuning(max_product_kernels=False))
    for name, latents in (("hclt", 256), ("pd", 128)):
        c, data = build(name, latents, (4, 4))
        miss = jnp.asarray(np.arange(c.num_vars) % 3 == 0)
        for B in batches:
            x = jax.device_put(data[:B])
            calls = {"mpe": lambda o: c.mpe(c.params, x, miss, options=o),
                     "flows MPE": lambda o: c.flows(c.params, x, options=o.replace(propagation="MPE"), return_ll=True)}
            for call_name, call in calls.items():
                routes = (on, off, jaxpc.Options())
                for o in routes:
                    jax.block_until_ready(call(o))
                c.wait_compiled()
                want = call(off)
                diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0.0))
                           for o in (on, jaxpc.Options())
                           for a, b in zip(jax.tree_util.tree_leaves(call(o)), jax.tree_util.tree_leaves(want)))
                equal &= diff == 0.0
                ms = [bench(lambda o=o: call(o), reps) for o in routes]
                print(f"check {name}-{latents} {call_name} B={B}: largest difference {diff:.1e}; ms max-plus kernels "
                      f"{ms[0]:.3f} XLA {ms[1]:.3f} default {ms[2]:.3f}", flush=True)
    return equal


def check_repeats(batches=(8, 16, 32, 64), calls=40, tunings: str = "", only: str = "") -> int:
    """Whether a route is exact on every call, not only on one: HCLT-256's, HMM-1024's and PD-128's default ``log_prob``
    and ``flows`` (each with ``Options(tuning=t)`` for each of ``tunings``, ``field=value`` pairs joined by ``+``,
    comma-separated; default: the default call, the same without XLA's concurrent command-buffer order, the cluster
    route with 32-row tasks, and the levels one by one; ``only``: the circuits' names, comma-separated, default all
    three: the cluster kernels, the chain's grid barriers and PD's atomic fan-in backward) called ``calls`` times over 4
    rotating batches, against ``precision="fp32"`` on XLA (``impl="xla"``). A call is wrong where a log-likelihood
    differs by more than 0.05 nats (TF32's error is about 2e-3 here) or is finite on one side only, or a leaf of its
    flows by more than 1e-2 (:func:`rel`, which counts that too as wrong). Prints per route and batch the wrong calls
    and their pattern (``x`` wrong, ``.`` right); returns the number of wrong calls."""
    import jaxpc
    from jaxpc import structures

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _options import tuning
    from profile_step import build

    specs = tunings.split(",") if tunings else [
        "", "concurrent_batch=0", "tree_forward_tile=32+tree_backward_tile=32", "tree_clusters=0"]
    ref_o = jaxpc.Options(precision="fp32", impl="xla")
    rng = np.random.default_rng(0)
    known = ("hclt-256", "hmm-1024", "pd-128")
    names = only.split(",") if only else known
    unknown = set(names) - set(known)
    if unknown:
        raise ValueError(f"unknown circuits {sorted(unknown)}; known: {list(known)}")
    circuits = {}
    for name in names:
        if name == "hmm-1024":
            circuits[name] = (jaxpc.compile(structures.HMM(64, 1024, 4096)),
                              lambda B, i: rng.integers(0, 4096, (B, 64)).astype(np.int32))
        else:
            c, data = build(name.split("-")[0], int(name.split("-")[1]), (4, 4))
            circuits[name] = (c, lambda B, i, data=data: data[i * B:(i + 1) * B])
    wrong_total = 0
    for name, (c, batch) in circuits.items():
        for B in batches:
            xs = [jax.device_put(batch(B, i)) for i in range(4)]
            refs = [c.flows(c.params, x, options=ref_o, return_ll=True) for x in xs]
            refs = [(jax.tree_util.tree_leaves(f), np.asarray(ll, np.float64)) for f, ll in refs]
            for spec in specs:
                opts = jaxpc.Options(tuning=tuning(spec)) if spec else jaxpc.Options()
                for entry in ("log_prob", "flows"):
                    pattern = []
                    for i in range(calls):
                        if entry == "log_prob":
                            ll, leaves = c.log_prob(c.params, xs[i % 4], options=opts), None
                        else:
                            f, ll = c.flows(c.params, xs[i % 4], options=opts, return_ll=True)
                            leaves = jax.tree_util.tree_leaves(f)
                        want_f, want_ll = refs[i % 4]
                        got_ll, ok = np.asarray(ll, np.float64), np.isfinite(want_ll)
                        bad = (not np.array_equal(np.isfinite(got_ll), ok)
                               or float(np.max(np.abs(got_ll - want_ll)[ok], initial=0.0)) > 0.05)
                        if leaves is not None:
                            bad |= max(rel(a, b) for a, b in zip(leaves, want_f)) > 1e-2
                        pattern.append("x" if bad else ".")
                    wrong = pattern.count("x")
                    wrong_total += wrong
                    print(f"repeats {name} B={B} {entry} [{spec or 'default'}]: {wrong}/{calls} calls wrong "
                          f"{''.join(pattern)}", flush=True)
    return wrong_total


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-timing", action="store_true", help="correctness only")
    p.add_argument("--leaves", action="store_true", help="only the leaf kernel (pallas_leaf): check and time")
    p.add_argument("--levels", action="store_true", help="only the evened tree levels of HCLT-256, end to end")
    p.add_argument("--chain", action="store_true", help="only HMM-1024 and HMM-256 on the chain kernels, end to end")
    p.add_argument("--triton", action="store_true", help="only the jax-triton route: check and time")
    p.add_argument("--fanin", action="store_true", help="only PD-128's fan-in backward kernel, end to end")
    p.add_argument("--products", action="store_true", help="only PD-128's full layout on the product kernels")
    p.add_argument("--mpe", action="store_true", help="only the max-plus forward kernel: check and time")
    p.add_argument("--tree", action="store_true", help="only HCLT-256 on the persistent tree kernels, end to end")
    p.add_argument("--summed", action="store_true", help="only the summed parameter-flow kernel against XLA's")
    p.add_argument("--repeats", action="store_true", help="only the persistent routes called many times against "
                   "fp32: whether every call is exact")
    p.add_argument("--calls", type=int, default=40, help="with --repeats: calls per route, batch and entry point")
    p.add_argument("--no-fences", dest="fences", action="store_false", help="with --repeats, --tree: the cluster "
                   "kernels without their steps' fences (jaxpc.ops.mosaic_tree.FENCES; run with "
                   "JAXPC_PERSISTENT_CACHE=0)")
    p.add_argument("--circuits", default="", help="with --repeats: some of hclt-256, hmm-1024, pd-128 (default: all)")
    p.add_argument("--tunings", default="", help="with --repeats: the routes, jaxpc.Tuning spellings (field=value "
                   "joined by +) separated by commas; an empty one is the default call")
    p.add_argument("--tree-programs", type=int, default=0, help="with --tree: programs of the tree kernels "
                   "(pallas_tree.MAX_PROGRAMS)")
    p.add_argument("--batches", default=None, help="with --tree, --repeats: batches (default 8,16,32,64); with "
                   "--mpe: batches (default 16,128,512)")
    p.add_argument("--tree-tuning", default="", help="with --tree: the route to check against the default call, "
                   "a jaxpc.Tuning as field=value pairs joined by + (default: tree_kernel_batch=64)")
    args = p.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    if not args.fences:
        from jaxpc.ops import mosaic_tree

        mosaic_tree.FENCES = False
    if args.tree:
        if args.tree_programs:
            pallas_tree.MAX_PROGRAMS = args.tree_programs
        batches = tuple(int(b) for b in (args.batches or "8,16,32,64").split(","))
        print(f"worst fp32 relative error of the tree kernels: {check_tree(batches, against=args.tree_tuning):.2e}",
              flush=True)
        return
    if args.repeats:
        batches = tuple(int(b) for b in (args.batches or "8,16,32,64").split(","))
        print(f"wrong calls in all: {check_repeats(batches, args.calls, args.tunings, args.circuits)}", flush=True)
        return
    if args.summed:
        print(f"worst relative difference of the summed parameter flows: {check_summed():.2e}", flush=True)
        return
    if args.triton:
        print(f"worst fp32 relative error of the jax-triton kernels: {check_triton(not args.no_timing):.2e}",
              flush=True)
        return
    if args.fanin:
        print(f"worst relative error of the fan-in backward kernel: {check_fanin():.2e}", flush=True)
        return
    if args.chain:
        print(f"worst fp32 relative error of the chain kernels: {check_chain():.2e}", flush=True)
        return
    if args.mpe:
        batches = tuple(int(b) for b in (args.batches or "16,128,512").split(","))
        print(f"max-plus kernels equal to XLA everywhere: {check_mpe(batches)}", flush=True)
        return
    if args.products:
        print(f"worst fp32 relative error of the product kernels: {check_products():.2e}", flush=True)
        return
    if args.levels:
        print(f"worst fp32 relative error of the evened levels: {check_evened_levels(timing=not args.no_timing):.2e}",
              flush=True)
        return
    leaves_ok = check_leaves()
    counts_err = check_counts()
    if args.leaves:
        for B in (16, 128, 512):
            time_leaves(B, LEAF_CONFIGS)
            time_counts(B, COUNTS_CONFIGS)
        return
    print(f"leaf buffers equal: {leaves_ok}; leaf counts' fp32 relative error {counts_err:.1e}", flush=True)
    worst = check_shapes(pallas_sum, "check")
    worst = max(worst, check_levels(pallas_sum, "check tree level"))
    print(f"worst fp32 relative error: {worst:.2e}", flush=True)
    print(f"worst tf32 relative error of the batched parameter-flow kernel: {check_after():.2e}", flush=True)
    if args.no_timing:
        return
    for B in (16, 128, 512):
        time_leaves(B, LEAF_CONFIGS)
        time_counts(B, COUNTS_CONFIGS)
    for B in (16, 32):
        time_after(B, [pallas_sum.KernelConfig(32, 64, 4), pallas_sum.KernelConfig(16, 64, 4),
                               pallas_sum.KernelConfig(32, 32, 4), pallas_sum.KernelConfig(64, 64, 8),
                               pallas_sum.KernelConfig(16, 128, 8)])
    configs = [pallas_sum.KernelConfig(16, 32, 4), pallas_sum.KernelConfig(32, 64, 4),
               pallas_sum.KernelConfig(64, 64, 8), pallas_sum.KernelConfig(32, 32, 4)]
    for B in (16, 512):
        for precision in ("tf32",):
            time_partition("HMM-dense", 1024, 1024, 1, 1, True, B, precision, configs)
            time_partition("HCLT-like", 256, 256, 8, 1, False, B, precision, configs)
            time_partition("PD-like", 32, 32, 256, 16, False, B, precision, configs)


if __name__ == "__main__":
    main()
