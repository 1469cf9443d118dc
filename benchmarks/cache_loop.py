"""Executables in place of CUDA graphs: a CoDD-like loop and first-call costs.

    python benchmarks/cache_loop.py [--steps 120] [--persistent-dir DIR]

1. CoDD-like loop: HMM with 1024 latents (64 steps, vocabulary 4096), a batch size drawn from 10..26
   every step, 120 steps of forward + flows. Reports the median ms per step with buckets (default
   powers of two) and with a fixed batch of 26, the executables compiled and the compile seconds.
2. First call at a new batch bucket (trace + compile) for HMM-1024, HCLT-256 and PD-128, in this
   process; with ``--persistent-dir`` run it twice in fresh processes sharing JAX's persistent
   compilation cache and report the second process's first-step time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jaxpc  # noqa: E402
from jaxpc import distributions, structures  # noqa: E402


def codd_loop(steps: int, buckets, fixed: int | None):
    c = jaxpc.compile(structures.HMM(64, 1024, 4096), buckets=buckets)
    rng = np.random.default_rng(0)
    sizes = [fixed or int(rng.integers(10, 27)) for _ in range(steps)]
    xs = [jnp.asarray(rng.integers(0, 4096, (b, 64)).astype(np.int32)) for b in sizes]
    times = []
    for x in xs:
        t = time.perf_counter()
        jax.block_until_ready(c.flows(c.params, x, validate=False))
        times.append(time.perf_counter() - t)
    info = c.cache_info()
    return {"median_ms": 1e3 * float(np.median(times)), "first_ms": 1e3 * times[0], "executables": info.misses,
            "compile_s": info.compile_seconds}


def first_calls(names=("HMM-1024", "HCLT-256", "PD-128")):
    from _data import blurred_noise_images

    imgs = blurred_noise_images(2000)
    cat = distributions.Categorical(num_cats=256)
    out = {}
    for name, build, data in (
            ("HMM-1024", lambda: structures.HMM(64, 1024, 4096),
             lambda b: np.random.default_rng(0).integers(0, 4096, (b, 64)).astype(np.int32)),
            ("HCLT-256", lambda: structures.HCLT(imgs, 256, input_dist=cat), lambda b: imgs[:b]),
            ("PD-128", lambda: structures.PD((28, 28), 128, split_intervals=(4, 4), input_dist=cat),
             lambda b: imgs[:b])):
        if name not in names:
            continue
        c = jaxpc.compile(build())
        row = {}
        for b in (16, 128):
            x = jnp.asarray(data(b))
            t = time.perf_counter()
            jax.block_until_ready(c.flows(c.params, x, validate=False))
            row[f"first_flows_s_B{b}"] = time.perf_counter() - t
        row["compile_s"] = c.cache_info().compile_seconds
        out[name] = row
        print(name, row, flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--persistent-dir", default=None)
    p.add_argument("--first-calls", default="HMM-1024,HCLT-256,PD-128")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    if args.child:
        jaxpc.enable_persistent_cache(args.persistent_dir)
        print(json.dumps(first_calls(args.first_calls.split(","))))
        return
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    res = {"bucketed": codd_loop(args.steps, "pow2", None), "fixed_26": codd_loop(args.steps, "exact", 26),
           "exact_varying": codd_loop(args.steps, "exact", None)}
    for k, v in res.items():
        print(f"CoDD-like loop, {k:13s}: median {v['median_ms']:.3f} ms/step, first step {v['first_ms']:.0f} ms, "
              f"{v['executables']} executables, {v['compile_s']:.1f} s compiling", flush=True)
    if args.persistent_dir:
        runs = []
        for i in range(2):
            out = subprocess.run([sys.executable, __file__, "--child", "--persistent-dir", args.persistent_dir,
                                  "--first-calls", args.first_calls],
                                 capture_output=True, text=True, check=True).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
            print(f"process {i + 1} (persistent cache {'cold' if i == 0 else 'warm'}): {runs[-1]}", flush=True)
        res["first_calls"] = runs
    else:
        res["first_calls"] = [first_calls(args.first_calls.split(","))]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(Path(args.out) / "cache_loop.json", "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
