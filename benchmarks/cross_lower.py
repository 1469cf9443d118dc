"""The Python phases of a first call on the GPU, measured on any host: the default ``flows`` call traced and lowered
for CUDA (an H200 as the abstract device), without compiling or running it.

    python benchmarks/cross_lower.py [--workload pd|hclt|hmm] [--latents 128] [--batch 128] [--reps 2]
                                     [--tunings fanin_prefetch=0+fanin_forward_prefetch_batch=0] [--profile 30]
                                     [--sort tottime] [--search-dialects]

A first call's host seconds on the GPU are JAX's tracing, its lowering (the Pallas kernels' Triton IR is built in
Python) and XLA's compile; the first two do not need a GPU. Each variant (the default options with the precision
they resolve to on an NVIDIA GPU, ``"tf32"``, then one per
``--tunings`` entry: ``field=value`` joined by ``+``, a :class:`jaxpc.Tuning`) is traced and lowered ``--reps`` times,
JAX's caches and the kernels' cache cleared before each. Prints seconds of the trace and of the lowering, the
number of Triton and Mosaic GPU kernel calls and the lowered module's size; ``--profile N``: cProfile of one
trace, the top N by cumulative time. Kernel routes are the H200's (``impl="auto"`` picks the kernels a Hopper GPU
would, the tree's levels on clusters among them), so a trace here runs the same kernel bodies as on the H200, and a
Mosaic GPU kernel that its layout inference refuses fails here.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jaxpc  # noqa: E402
from _options import tuning  # noqa: E402
from jaxpc.engine import chain, routing  # noqa: E402
from jaxpc.ops import buffers, pallas_sum  # noqa: E402
from profile_step import build  # noqa: E402

H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)


def as_on_gpu():
    """A context in which the kernels lower for CUDA and the routes are the H200's (a Hopper GPU)."""
    stack = [mock.patch.object(pallas_sum, "interpret_mode", lambda: False),
             mock.patch.object(routing, "on_gpu", lambda: True), mock.patch.object(routing, "on_hopper", lambda: True),
             mock.patch.object(chain, "_on_gpu", lambda: True), mock.patch.object(buffers, "_on_gpu", lambda: True),
             jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=H200))]

    class _Ctx:
        def __enter__(self):
            for s in stack:
                s.__enter__()

        def __exit__(self, *exc):
            for s in reversed(stack):
                s.__exit__(*exc)
    return _Ctx()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workload", default="pd", choices=["pd", "hclt", "hmm"])
    p.add_argument("--latents", type=int, default=None, help="default: PD 128, HCLT 256, HMM 1024")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--tunings", default="", help="variants: a=1+b=0,c=2")
    p.add_argument("--profile", type=int, default=0, help="cProfile of one trace: the top N by cumulative time")
    p.add_argument("--sort", default="cumulative", help="the profile's order: cumulative, tottime, ...")
    p.add_argument("--search-dialects", action="store_true",
                   help="leave MLIR's failed dialect-module lookups uncached (as before the kernels recorded them)")
    args = p.parse_args(argv)
    latents = args.latents or {"pd": 128, "hclt": 256, "hmm": 1024}[args.workload]
    c, data = build(args.workload, latents)
    x = jnp.asarray(data[:args.batch])
    base = jaxpc.Options(precision="tf32")  # what the default precision resolves to on an NVIDIA GPU
    variants = {"default": base}
    for spec in filter(None, args.tunings.split(",")):
        variants[spec] = base.replace(tuning=tuning(spec))
    print(f"{args.workload}-{latents} B={args.batch}, jax {jax.__version__} on {jax.default_backend()}, lowered for "
          f"CUDA ({H200.device_kind})", flush=True)
    if args.search_dialects:  # the kernels' calls record the missing modules; undo that
        mock.patch.object(pallas_sum, "cache_missing_dialect_modules", lambda *a, **k: None).start()
    with as_on_gpu():
        for name, opts in variants.items():
            fn = jax.jit(lambda params, x, opts=opts: c.flows(params, x, options=opts, validate=False))
            for _ in range(args.reps):
                jax.clear_caches()
                pallas_sum._KERNELS.clear()
                t0 = time.perf_counter()
                traced = fn.trace(c.params, x)
                t1 = time.perf_counter()
                text = traced.lower(lowering_platforms=("cuda",)).as_text()
                t2 = time.perf_counter()
                print(f"{name:24s} trace {t1 - t0:6.2f} s | lower {t2 - t1:6.2f} s | "
                      f"{text.count('__gpu$xla.gpu.triton'):3d} Triton calls | "
                      f"{text.count('custom_call @mosaic_gpu'):2d} Mosaic GPU calls | {len(text) / 1e6:5.1f} MB",
                      flush=True)
        if args.profile:
            jax.clear_caches()
            pallas_sum._KERNELS.clear()
            fn = jax.jit(lambda params, x: c.flows(params, x, options=base, validate=False))
            prof = cProfile.Profile()
            prof.enable()
            fn.trace(c.params, x)
            prof.disable()
            pstats.Stats(prof).sort_stats(args.sort).print_stats(args.profile)


if __name__ == "__main__":
    main()
