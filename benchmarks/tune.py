"""Tune a workload's sum partitions on the current device and time the tuned plan against the default.

    python benchmarks/tune.py [--workloads hclt,pd] [--batches 512] [--latents hclt=256,pd=128]
                              [--precision tf32] [--reps 25] [--candidates "pallas:32,64,4;pallas_forward:32,64,4"]

Per (workload, batch): :func:`jaxpc.autotune.tune_circuit` (``impl="auto"``'s choice against the XLA path
and the Pallas candidates, forward + backward of each partition alone, then the whole step with the default
options against the tuned ones; seconds spent tuning), each partition's key and choice with its timings (ms:
the heuristic's and the winner's) and the whole step's, then forward and forward + flows medians
of the default options and of the tuned options (4 rotating input batches), XLA's memory analysis of both
flows executables and the tuned answer's relative error against the default's (log-likelihoods and every
flow array, same precision). Rows go to ``$OUT/tune.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jaxpc  # noqa: E402
from _data import blurred_noise_images  # noqa: E402
from bench_engine import cached_mib, median_ms, save_rows  # noqa: E402
from jaxpc.autotune import DEFAULT_CANDIDATES, Autotuner, tune_circuit  # noqa: E402
from plans import build, rel  # noqa: E402


def parse_candidates(text: str | None):
    """``impl:block_b,block_k,num_warps`` separated by ``;`` or the library's defaults."""
    if not text:
        return DEFAULT_CANDIDATES
    out = []
    for item in text.split(";"):
        impl, cfg = item.split(":")
        out.append((impl, *(int(v) for v in cfg.split(","))))
    return tuple(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="hclt,pd")
    p.add_argument("--batches", default="512")
    p.add_argument("--latents", default="hclt=256,pd=128")
    p.add_argument("--precision", default="tf32", choices=["fp32", "tf32", "bf16"])
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--candidates", default=None,
                   help="e.g. 'pallas:32,64,4;pallas_forward:64,64,8' (default: the library's candidates)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    latents = dict(kv.split("=") for kv in args.latents.split(","))
    cands = parse_candidates(args.candidates)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {len(cands)} candidates", flush=True)
    imgs = blurred_noise_images(10_000)
    rows = []
    for w in args.workloads.split(","):
        c = jaxpc.compile(build(w, int(latents[w]), imgs))
        for B in [int(b) for b in args.batches.split(",")]:
            xs = [jnp.asarray(imgs[np.random.default_rng(s).integers(0, len(imgs), B)]) for s in range(4)]
            tuner = Autotuner()
            log = []
            tune = tuner.tune

            def logged(shape_key, heuristic, candidates, run, tune=tune, log=log):
                choice = tune(shape_key, heuristic, candidates, run)
                t = tuner.last_timings.get("full", {})
                configs = [heuristic] + [x for x in candidates if x != heuristic]
                win = configs.index(choice)
                plan = shape_key[0] == "plan"  # the whole step: the default options against the tuned ones
                log.append(dict(key=["whole step"] if plan else list(shape_key[1]),
                                choice=["tuned" if win else "default"] if plan else list(choice),
                                heuristic=["default"] if plan else list(heuristic),
                                ref_ms=1e3 * t.get(0, float("nan")), win_ms=1e3 * t.get(win, float("nan"))))
                return choice

            tuner.tune = logged
            t = time.perf_counter()
            tuned = tune_circuit(c, c.params, xs[0], precision=args.precision, candidates=cands, tuner=tuner)
            t_tune = time.perf_counter() - t
            print(f"{w}-{latents[w]} B={B}: tuned in {t_tune:.1f}s", flush=True)
            for e in log:
                print(f"  {tuple(e['key'])}: {e['choice']} "
                      f"({e['heuristic']} {e['ref_ms']:.3f} -> {e['win_ms']:.3f} ms)",
                      flush=True)
            default = jaxpc.Options(precision=args.precision)
            res = {}
            for name, opts in (("default", default), ("tuned", tuned)):
                got = jax.block_until_ready(c.flows(c.params, xs[0], options=opts, return_ll=True, validate=False))
                fwd = median_ms(lambda xb: c.log_prob(c.params, xb, options=opts, validate=False), xs, args.reps)
                flows = median_ms(lambda xb: c.flows(c.params, xb, options=opts, validate=False), xs, args.reps)
                res[name] = dict(got=got, fwd_ms=fwd, flows_ms=flows, mem_mib=cached_mib(c, "flows"))
            a, b = res["tuned"]["got"], res["default"]["got"]
            err = max([rel(a[1], b[1])] + [rel(u, v) for u, v in zip(jax.tree_util.tree_leaves(a[0]),
                                                                        jax.tree_util.tree_leaves(b[0]))])
            for name in ("default", "tuned"):
                r = res[name]
                print(f"  {name:8s} fwd {r['fwd_ms']:8.3f} ms | fwd+flows {r['flows_ms']:8.3f} ms | "
                      f"mem {r['mem_mib']:8.1f} MiB", flush=True)
            print(f"  tuned vs default: rel err {err:.1e}", flush=True)
            rows.append(dict(workload=f"{w}-{latents[w]}", B=B, precision=args.precision, tune_s=t_tune,
                             partitions=log, rel_err=err,
                             **{f"{n}_{k}": v for n, r in res.items() for k, v in r.items() if k != "got"}))
    save_rows(args.out, "tune.json", rows)
    return rows


if __name__ == "__main__":
    main()
