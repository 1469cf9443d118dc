"""Per-kernel device time of the Pallas sum-layer kernels for a set of tile configurations.

    python benchmarks/kernel_tiles.py [--batches 16,512] [--reps 20]

For partitions shaped like the folded plan's levels (HCLT-256: 256x256 blocks, fan-in 1, products of
3 terms, 2, 20 or 155 blocks per level; PD-128: 32x32 blocks, fan-in 16, products of 2 terms, up to 16
parents per child) each executable runs one kernel chain ``reps`` times back to back (unrolled, each
step consuming the previous one's output, as the levels of a circuit do), so the time per step is the
kernels' device time plus the launch gaps of a real step, without per-call host time. ``fwd``: the
in-place forward kernel; ``bwd``: scale + parameter-flow + in-place child kernels (a tree level's
``backward_exclusive``), ``<config>/level``: a tree level's one-kernel ``backward_level`` (batches up to
``LEVEL_BATCH``). ``xla``: the reference (plain-jnp) level, forward with its buffer update, backward with
its two scatters. Every backward adds its parameter flows into a parameter-flow buffer.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpc.compiler.compile import inverse_tables  # noqa: E402
from jaxpc.ops import pallas_sum  # noqa: E402
from jaxpc.ops.sum_layer import child_rows, sum_layer_backward_reference, sum_layer_reference  # noqa: E402

SHAPES = {  # name: (Kp, Kc, n, C, M, child row blocks)
    "hclt-n2": (256, 256, 2, 1, 3, 6),
    "hclt-n7": (256, 256, 7, 1, 3, 21),
    "hclt-n20": (256, 256, 20, 1, 3, 60),
    "hclt-n40": (256, 256, 40, 1, 3, 120),
    "hclt-n155": (256, 256, 155, 1, 3, 465),
    "pd-n460": (32, 32, 460, 16, 2, 920),
}
CONFIGS = {  # name: KernelConfig(block_b, block_k, num_warps, num_stages, block_c, block_r)
    "b32k64c64": pallas_sum.KernelConfig(32, 64, 4, 2, 64),
    "b32k64r8k": pallas_sum.KernelConfig(32, 64, 4, 2, 0, 8192),
    "b32k32r8k": pallas_sum.KernelConfig(32, 32, 4, 2, 0, 8192),
    "b64k64r16kw8": pallas_sum.KernelConfig(64, 64, 8, 2, 0, 16384),
    "b128k32r8kw8": pallas_sum.KernelConfig(128, 32, 8, 2, 0, 8192),
    "b16k16r4k": pallas_sum.KernelConfig(16, 16, 4, 2, 0, 4096),
    # backward_level reads block_k (child-node tile) and block_c (parent-node chunk, 0: 64)
    "k32c64": pallas_sum.KernelConfig(32, 32, 4, 2, 64),
    "k32c128w8": pallas_sum.KernelConfig(32, 32, 8, 2, 128),
    "k64c32": pallas_sum.KernelConfig(32, 64, 4, 2, 32),
    "k64c64w8": pallas_sum.KernelConfig(32, 64, 8, 2, 64),
    "k128c32w8": pallas_sum.KernelConfig(32, 128, 8, 2, 32),
    "k16c128": pallas_sum.KernelConfig(32, 16, 4, 2, 128),
    "k16c64": pallas_sum.KernelConfig(32, 16, 4, 2, 64),
    "k32c32": pallas_sum.KernelConfig(32, 32, 4, 2, 32),
    # forward chunks of whole 256-node child blocks (one step per child block)
    "k32c256": pallas_sum.KernelConfig(32, 32, 4, 2, 256),
    "k16c256": pallas_sum.KernelConfig(32, 16, 4, 2, 256),
    "k64c256w8": pallas_sum.KernelConfig(32, 64, 8, 2, 256),
    "k32c128": pallas_sum.KernelConfig(32, 32, 4, 2, 128),
    # large batches: wider batch tiles (each weight tile reused over more samples), short child chunks (on the
    # H200, tiles of 128 samples x 128 parents or 64 x 256, or 3 pipeline stages, exceed the shared memory)
    "b64k64c32": pallas_sum.KernelConfig(64, 64, 4, 2, 32),
    "b64k64c64": pallas_sum.KernelConfig(64, 64, 4, 2, 64),
    "b128k64c32w8": pallas_sum.KernelConfig(128, 64, 8, 2, 32),
    "b128k64c64w8": pallas_sum.KernelConfig(128, 64, 8, 2, 64),
    "b64k128c32w8": pallas_sum.KernelConfig(64, 128, 8, 2, 32),
}


def partition(Kp, Kc, n, C, M, nblk, B, seed=0):
    rng = np.random.default_rng(seed)
    kmax = max(Kp, Kc)
    base = 2 * kmax
    off = base + nblk * Kc
    R = off + n * Kp
    buf = np.zeros((R, B), np.float32)
    buf[kmax:2 * kmax] = -np.inf
    buf[base:off] = rng.normal(size=(nblk * Kc, B))
    if n * C * M <= nblk:  # every row block read once (a tree level's exclusive children)
        ch = base + Kc * rng.permutation(nblk)[:n * C * M].reshape(n, C, M)
    else:
        ch = base + Kc * rng.integers(0, nblk, (n, C, M))
    pid = np.arange(n * C).reshape(n, C)
    inv = inverse_tables(ch, pid)
    t = {k: jnp.asarray(v, jnp.int32) for k, v in {"ch": ch, "pid": pid, **inv}.items()}
    logw = jnp.asarray(np.log(rng.random((n * C, Kp, Kc)) + 1e-3), jnp.float32)
    return jnp.asarray(buf), t, logw, off


def timed(fn, *args, runs=7):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="16,512")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--precision", default="tf32")
    p.add_argument("--fwd-only", action="store_true", help="time the forward kernels only")
    args = p.parse_args(argv)
    reps, prec = args.reps, args.precision
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; us per step (kernel time + launch gaps)",
          flush=True)
    for sname in args.shapes.split(","):
        Kp, Kc, n, C, M, nblk = SHAPES[sname]
        for B in [int(b) for b in args.batches.split(",")]:
            buf, t, logw, off = partition(Kp, Kc, n, C, M, nblk, B)
            flows = jnp.zeros_like(buf).at[off:].set(1.0)
            kw = dict(Kp=Kp, Kc=Kc, precision=prec)

            @jax.jit
            def xla_fwd(b, lw):
                for _ in range(reps):
                    out = sum_layer_reference(b, t["ch"], t["pid"], lw, dense=False, **kw)
                    b = jax.lax.dynamic_update_slice(b, out, (off, 0))
                return b

            @jax.jit
            def xla_bwd(b, f, lw):
                dp = jnp.zeros_like(lw)
                for _ in range(reps):
                    cf, pf = sum_layer_backward_reference(b, f, t["ch"], t["pid"], lw, off, dense=False, **kw)
                    rows = jnp.stack([child_rows(t["ch"][:, :, m], Kc, False) for m in range(M)])
                    f = f.at[rows].add(jnp.broadcast_to(cf, (M,) + cf.shape))
                    dp = dp.at[t["pid"]].add(pf, unique_indices=True)
                return f, dp

            res = {"xla": (timed(xla_fwd, buf, logw),
                           float("nan") if args.fwd_only else timed(xla_bwd, buf, flows, logw))}
            for cname in args.configs.split(","):
                cfg = CONFIGS[cname]

                @jax.jit
                def k_fwd(b, lw, cfg=cfg):
                    for _ in range(reps):
                        b = pallas_sum.forward(b, t["ch"], t["pid"], lw, out_offset=off, config=cfg, **kw)
                    return b

                @jax.jit
                def k_bwd(b, f, lw, cfg=cfg):
                    dp = jnp.zeros_like(lw)
                    for _ in range(reps):
                        if C == 1:  # a tree level: the exclusive backward (or the one-kernel level backward)
                            f, pf = pallas_sum.backward_exclusive(b, f, off, t["ch"], t["pid"], lw,
                                                                  first_row=2 * max(Kp, Kc), config=cfg, **kw)
                        else:
                            a, m, pf = pallas_sum.backward_parents(b, f, off, t["ch"], t["pid"], lw, config=cfg, **kw)
                            f = pallas_sum.backward_children(b, a, m, t["uch"], t["par"], t["ppid"], lw, ch=t["ch"],
                                                             pcol=t["pcol"], flows=f, config=cfg, **kw)
                        dp = dp.at[t["pid"]].add(pf, unique_indices=True)
                    return f, dp

                @jax.jit
                def k_lvl(b, f, lw, cfg=cfg):
                    dp = jnp.zeros_like(lw)
                    for _ in range(reps):
                        f, dp = pallas_sum.backward_level(b, f, off, t["ch"], t["pid"], lw, first_row=2 * max(Kp, Kc),
                                                          config=cfg, dparams=dp, **kw)
                    return f, dp

                try:
                    if args.fwd_only:
                        res[cname] = (timed(k_fwd, buf, logw), float("nan"))
                        continue
                    res[cname] = (timed(k_fwd, buf, logw), timed(k_bwd, buf, flows, logw))
                    if C == 1 and B <= pallas_sum.LEVEL_BATCH:
                        res[cname + "/level"] = (float("nan"), timed(k_lvl, buf, flows, logw))
                except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                    print(f"  {sname} B={B} {cname}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            line = " | ".join(f"{k} {1e6 * v[0] / reps:6.1f} / {1e6 * v[1] / reps:6.1f}" for k, v in res.items())
            print(f"{sname:10s} B={B:4d} fwd / bwd: {line}", flush=True)


if __name__ == "__main__":
    main()
