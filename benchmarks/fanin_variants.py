"""A PD's fan-in kernels with their tiles overridden per variant: the whole ``em_step`` timed, its parameter flows
against the first variant's, and (``--registers``) each Pallas sum kernel's registers, shared memory and busy time
from a ``jax.profiler`` trace of one step.

    python benchmarks/fanin_variants.py [--latents 512] [--split-intervals 2,7] [--batch 512] [--reps 5]
                                        [--variants default,fblock_b=64+fspan=1,bgroup=2+bprefetch=1] [--registers]

A variant is ``field=value`` pairs joined by ``+`` (``default``: none). Fields starting with ``f`` set the in-place
fan-in forward's :class:`jaxpc.ops.pallas_sum.KernelConfig` after :func:`jaxpc.engine.routing.fanin_forward_config`
chose it (``fblock_b``, ``fnum_warps``, ``fnum_stages``, ``fspan``, ``fprefetch``; fan-in partitions only); fields
starting with ``b`` the atomic backward's (``bblock_b``, ``bnum_warps``, ``bnum_stages``) and its arguments
(``bprefetch``, ``bgroup``). Each variant compiles its own executables (a distinct ``Options`` value, the kernels'
cache cleared). Unlike ``pd_tiles.py`` (which sets ``Options.kernels`` for the folded plan's partitions), this also
reaches the full layout's partitions (PD-512 and PD-768 by default), and sets forward and backward apart.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import tempfile
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jaxpc  # noqa: E402
from _data import blurred_noise_images  # noqa: E402
from jaxpc import distributions, structures  # noqa: E402
from jaxpc.engine import routing  # noqa: E402
from jaxpc.ops import pallas_sum  # noqa: E402
from pd_tiles import measure  # noqa: E402

FORWARD = ("fblock_b", "fnum_warps", "fnum_stages", "fspan", "fprefetch")
BACKWARD_CONFIG = ("bblock_b", "bnum_warps", "bnum_stages")
BACKWARD_ARGS = ("bprefetch", "bgroup")


def parse(variant: str) -> dict:
    spec = {}
    for kv in filter(None, variant.split("+")):
        if kv == "default":
            continue
        key, _, value = kv.partition("=")
        if key not in FORWARD + BACKWARD_CONFIG + BACKWARD_ARGS or not value:
            raise ValueError(f"unknown variant field {kv!r}; fields: {FORWARD + BACKWARD_CONFIG + BACKWARD_ARGS}")
        spec[key] = int(value)
    return spec


def patch(spec: dict, backward, forward_config) -> None:
    """Route :func:`pallas_sum.backward_atomic` and :func:`routing.fanin_forward_config` through ``spec``."""

    def bwd(*a, **kw):
        cfg = kw.get("config") or pallas_sum.KernelConfig()
        kw["config"] = dataclasses.replace(cfg, **{k[1:]: v for k, v in spec.items() if k in BACKWARD_CONFIG})
        if "bprefetch" in spec:
            kw["prefetch"] = bool(spec["bprefetch"])
        if "bgroup" in spec:
            kw["group"] = spec["bgroup"]
        return backward(*a, **kw)

    def fwd(options, part, B, impl, config, tuned=False):
        cfg = forward_config(options, part, B, impl, config, tuned)
        if part.C < 2 or part.dense:
            return cfg
        return dataclasses.replace(cfg, **{k[1:]: (bool(v) if k == "fprefetch" else v)
                                           for k, v in spec.items() if k in FORWARD})

    pallas_sum.backward_atomic, routing.fanin_forward_config = bwd, fwd
    pallas_sum._KERNELS.clear()


def registers(step) -> list[tuple[str, str, float]]:
    """``(kernel, its launch details, ms)`` of the Pallas sum kernels in a trace of ``step()``."""
    from profile_step import device_events

    trace = tempfile.mkdtemp()
    with jax.profiler.trace(trace):
        jax.block_until_ready(step())
    seen = collections.OrderedDict()
    for e in device_events(trace):
        name = e.get("name", "")
        if name.startswith("jaxpc_sum"):
            key = (name.split("__")[0], e.get("args", {}).get("kernel_details", "").split(" grid")[0])
            seen[key] = seen.get(key, 0.0) + e.get("dur", 0.0) / 1e3
    return [(name, details, ms) for (name, details), ms in seen.items()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--latents", type=int, default=512)
    p.add_argument("--split-intervals", default="2,7")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--variants", default="default,fblock_b=64+fspan=1")
    p.add_argument("--registers", action="store_true", help="also each sum kernel's registers and time per variant")
    args = p.parse_args(argv)
    B, split = args.batch, tuple(int(s) for s in args.split_intervals.split(","))
    variants = [(v, parse(v)) for v in args.variants.split(",")]
    c = jaxpc.compile(structures.PD((28, 28), args.latents, split_intervals=split,
                                    input_dist=distributions.Categorical(num_cats=256)))
    imgs = blurred_noise_images(4 * B)
    xs = [jax.device_put(imgs[i * B:(i + 1) * B]) for i in range(4)]
    # off a GPU the fan-in kernels run in interpret mode only on Pallas's route at TF32
    extra = {} if jax.default_backend() == "gpu" else dict(precision="tf32", impl="pallas_forward")
    backward, forward_config = pallas_sum.backward_atomic, routing.fanin_forward_config
    kw = dict(step_size=0.1, pseudocount=0.1)
    ref = None
    for j, (name, spec) in enumerate(variants):
        patch(spec, backward, forward_config)
        opts = jaxpc.Options(tuning=jaxpc.Tuning(leaf_batch=jaxpc.Tuning().leaf_batch + 1 + j), **extra)
        try:
            med, low, err, first, leaves = measure(c, xs, opts, "em_step", args.reps, ref)
            ref = leaves if ref is None else ref
            print(f"PD-{args.latents} B={B} {name:44s} em_step {1e3 * med:8.2f} ms (min {1e3 * low:.2f}), "
                  f"param flows max rel diff {err:.1e}, first flows {first:.1f} s", flush=True)
            if args.registers:
                for kernel, details, ms in registers(lambda: c.em_step(c.params, xs[1], options=opts, **kw)):
                    print(f"    {kernel:36s} {details:60s} {ms:7.2f} ms", flush=True)
        except Exception as e:  # noqa: BLE001 - a variant that does not compile or run is reported, not fatal
            print(f"{name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        jax.clear_caches()
    pallas_sum.backward_atomic, routing.fanin_forward_config = backward, forward_config


if __name__ == "__main__":
    main()
