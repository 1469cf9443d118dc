"""XLA compiler options A/B in one process: the same ``Circuit.flows`` step compiled under several option sets,
timed in interleaved rounds (so a process's host speed, which moves synchronized small-batch steps by up to
0.45 ms between processes, is shared by every set).

    python benchmarks/xla_options.py [--workload hclt] [--latents 256] [--batch 16] [--rounds 40]
                                     [--sets "|xla_gpu_graph_min_graph_size=1"] [--block 1]

Each ``|``-separated set is ``name=value`` pairs (comma-separated; empty: XLA's defaults), given to every executable
of the circuit through ``Options(tuning=Tuning(compiler_options=...))`` (part of the executable's key).
Per set: the median of
``--rounds`` synchronized calls (inputs rotating over 4 batches, one call of each set per round, in turn; ``--block``
calls of each set in a row, after 3 untimed ones, so that switching sets re-records no timed call), the
median time until the call returns (host launch), and a pipelined loop (calls back to back, synchronized once).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parse_set(text: str) -> dict:
    out = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        k, v = pair.split("=", 1)
        out[k] = int(v) if v.lstrip("-").isdigit() else v
    return out


def main(argv=None):
    import jax
    import jax.numpy as jnp

    import jaxpc
    from profile_step import build

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="hclt")
    p.add_argument("--latents", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--precision", default="tf32")
    p.add_argument("--sets", default="|xla_gpu_graph_min_graph_size=1")
    p.add_argument("--block", type=int, default=1, help="calls of one set in a row per round (after 3 untimed ones "
                   "when above 1: the first calls after another set's re-record the command buffers)")
    args = p.parse_args(argv)
    c0, data = build(args.workload, args.latents)
    opts = jaxpc.Options(precision=args.precision)
    xs = [jnp.asarray(data[i * args.batch:(i + 1) * args.batch]) for i in range(4)]
    sets = [parse_set(s) for s in args.sets.split("|")]
    c = c0
    set_opts = [opts.replace(tuning=jaxpc.Tuning(compiler_options=tuple(sorted((s or {}).items())))) for s in sets]
    for s, o in zip(sets, set_opts):
        t = time.perf_counter()
        jax.block_until_ready(c.flows(c.params, xs[0], options=o, validate=False))
        print(f"set {s or '(defaults)'}: compiled in {time.perf_counter() - t:.1f}s", flush=True)
    c.wait_compiled()  # the optimized executables, not the quick first compiles they replace

    def leaves(o):
        return [np.asarray(v, np.float64) for v in jax.tree_util.tree_leaves(
            c.flows(c.params, xs[0], options=o, validate=False, return_ll=True))]

    def rel(got, ref):  # the largest difference of a leaf relative to that leaf's largest magnitude
        return max(float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)) for a, b in zip(got, ref))

    ref = leaves(set_opts[0])
    print(f"flows and log-likelihoods, relative difference: the first set run again {rel(leaves(set_opts[0]), ref):.1e}"
          + "".join(f", set {j} {rel(leaves(o), ref):.1e}" for j, o in enumerate(set_opts[1:], 1)), flush=True)
    walls = [[] for _ in sets]
    disp = [[] for _ in sets]
    warm = 5 if args.block == 1 else 0  # untimed rounds
    skip = 3 if args.block > 1 else 0  # untimed calls at a block's start: they re-record the command buffers
    for r in range(args.rounds + warm):
        for j, so in enumerate(set_opts):
            for k in range(skip + args.block):
                t = time.perf_counter()
                o = c.flows(c.params, xs[(r + k) % 4], options=so, validate=False)
                d = time.perf_counter()
                jax.block_until_ready(o)
                if r >= warm and k >= skip:
                    walls[j].append(time.perf_counter() - t)
                    disp[j].append(d - t)
                del o
    for j, (s, so) in enumerate(zip(sets, set_opts)):
        t = time.perf_counter()
        for i in range(args.rounds):
            out = c.flows(c.params, xs[i % 4], options=so, validate=False)
        jax.block_until_ready(out)
        pipe = 1e3 * (time.perf_counter() - t) / args.rounds
        print(f"{args.workload}-{args.latents} B={args.batch} {s or '(defaults)'}: fwd+flows "
              f"{1e3 * np.median(walls[j]):.3f} ms (dispatch {1e3 * np.median(disp[j]):.3f}) | pipelined {pipe:.3f} ms",
              flush=True)


if __name__ == "__main__":
    main()
