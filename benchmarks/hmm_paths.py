"""The HMM-1024 workload (T=64, V=4096) through each of jaxpc's evaluation paths, on the current device.

    python benchmarks/hmm_paths.py [--batches 16,128,512] [--reps 25] [--precision tf32]
                                   [--paths stacked,accumulated,layers] [--unrolls 1,8,all]

Paths: the chain scan (``jaxpc.engine.chain``) with the transition flows from one stacked matrix product
(``stacked``) or accumulated per step (``accumulated``), and the layer-by-layer flows pass
(``Options(chain_scan=False)``), those of ``--paths``; with ``--unrolls``, also the default chain path with its
scans unrolled that many steps per loop iteration at every batch (``Tuning.chain_unroll``; ``all``: no loop). Each
first checks its log-likelihoods and flows against the layer path at fp32; then reports forward + flows median
ms and the executable's memory (XLA's memory analysis). ``Tuning.chain_stack_limit`` picks between the two chain
variants by R * K * B; this script shows where each wins. A last row times ``circuit.flows`` (the default
path through the API): its excess is host time per call.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_engine  # noqa: E402
import jaxpc  # noqa: E402
from jaxpc import structures  # noqa: E402
from jaxpc.engine import em  # noqa: E402

T, L, V = 64, 1024, 4096


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="16,128,512")
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--precision", default="tf32", choices=["fp32", "tf32", "bf16"])
    p.add_argument("--paths", default="stacked,accumulated,layers")
    p.add_argument("--unrolls", default="", help="also the default chain path with these scan unrolls, e.g. 1,4,all")
    p.add_argument("--size", default=f"{T},{L},{V}", help="steps,latents,vocab (default: HMM-1024)")
    args = p.parse_args(argv)
    steps, latents, vocab = (int(v) for v in args.size.split(","))
    c = jaxpc.compile(structures.HMM(steps, latents, vocab))
    default = jaxpc.Tuning()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; chain {c.layout.chain is not None}", flush=True)
    paths = {"stacked": (jaxpc.Options(), 10**12, default.chain_unroll),
             "accumulated": (jaxpc.Options(), 0, default.chain_unroll),
             "layers": (jaxpc.Options(chain_scan=False), None, default.chain_unroll)}
    paths = {k: v for k, v in paths.items() if k in args.paths.split(",")}
    for u in args.unrolls.split(",") if args.unrolls else ():
        paths[f"chain-u{u}"] = (jaxpc.Options(), default.chain_stack_limit, 10**9 if u == "all" else int(u))
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        xs = [jnp.asarray(np.random.default_rng(s).integers(0, vocab, (B, steps)).astype(np.int32)) for s in range(4)]
        ref = None
        for name, (opts, limit, unroll) in paths.items():
            opts = opts.replace(tuning=jaxpc.Tuning(
                chain_stack_limit=default.chain_stack_limit if limit is None else limit, chain_unroll=unroll,
                chain_unroll_batch=0 if name.startswith("chain-u") else default.chain_unroll_batch))

            def make(o):
                return jax.jit(lambda t, p_, x: em.flows_and_ll(c.layout, t, p_, x, None, None, o))

            exact = make(opts)
            fl, ll = exact(c.tables, c.params, xs[0])
            if ref is None:
                ref = make(jaxpc.Options(chain_scan=False))(c.tables, c.params, xs[0])
            err_ll = float(jnp.max(jnp.abs(ll - ref[1]) / jnp.abs(ref[1])))
            err_fl = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
                         for a, b in zip(jax.tree_util.tree_leaves(fl), jax.tree_util.tree_leaves(ref[0])))
            fast = make(opts.replace(precision=args.precision))
            ms = bench_engine.median_ms(lambda xb: fast(c.tables, c.params, xb), xs, args.reps)
            mib = bench_engine.exec_mib(fast, c.tables, c.params, xs[0])
            rows.append(dict(path=name, B=B, flows_ms=ms, mem_mib=mib, err_ll=err_ll, err_flows=err_fl))
            print(f"B={B:4d} {name:12s} fwd+flows {ms:8.3f} ms | mem {mib:8.1f} MiB | fp32 vs layers: "
                  f"ll {err_ll:.1e} flows {err_fl:.1e}", flush=True)
        # the same default executable through the Circuit API: the difference is host time per call
        opts = jaxpc.Options(precision=args.precision)
        ms = bench_engine.median_ms(lambda xb: c.flows(c.params, xb, options=opts, validate=False), xs, args.reps)
        rows.append(dict(path="api", B=B, flows_ms=ms))
        print(f"B={B:4d} {'circuit.flows':12s} fwd+flows {ms:8.3f} ms (default path through the API)", flush=True)
    return rows


if __name__ == "__main__":
    main()
