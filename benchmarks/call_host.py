"""The host time of the default call before its executable starts, with and without the replay of a repeated call.

    python benchmarks/call_host.py [--workload digits|hclt|hmm] [--latents 16] [--batch 16] [--reps 3000]
                                   [--entries flows,log_prob,em_step] [--host]

A small batch's step waits for this time: nothing runs on the device until the call reaches its executable. Per
entry point (``c.flows(c.params, x)``, ``c.log_prob(c.params, x)``, ``c.em_step(c.params, x, step_size=0.1,
pseudocount=0.1)``) on device batches (``--host``: numpy batches, checked on the host and moved by the call), four in
turn, each call waited for, medians over ``--reps`` calls, in microseconds: ``pre``, from the call to the start of
the entry's compiled executable (timed by wrapping ``jax.stages.Compiled.__call__``; a batch short of its bucket,
e.g. ``--batch 12``, is padded by a helper executable first); ``return``, until the call returns (on a CPU this
includes much of the work); ``sync``, until its outputs are ready (``jax.block_until_ready``). Each for the call as
users make it (``replay``: ``Runtime.replay`` repeats the previous call's executable) and with every call on the
full call path (``full``), alternated in blocks of 200 calls. ``digits`` is the demo's HCLT on scikit-learn's
digits (runs in seconds on a CPU); ``hclt`` / ``hmm`` are the benchmarks' HCLT on 28x28 images with 256 levels and
HMM (T=64, V=4096).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def build(workload: str, latents: int):
    import jaxpc
    from jaxpc import distributions, structures

    if workload == "digits":
        from jaxpc.demo import load_digits_split

        train, _ = load_digits_split(0)
        cat = distributions.Categorical(num_cats=17)
        return jaxpc.compile(structures.HCLT(train, num_latents=latents, input_dist=cat)), train
    from profile_step import build as build_step

    return build_step(workload, latents)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="digits", choices=["digits", "hclt", "hmm"])
    p.add_argument("--latents", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--reps", type=int, default=3000)
    p.add_argument("--entries", default="flows,log_prob,em_step")
    p.add_argument("--host", action="store_true", help="numpy batches instead of device arrays")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    c, data = build(args.workload, args.latents)
    put = np.asarray if args.host else jnp.asarray
    xs = [put(data[i * args.batch:(i + 1) * args.batch]) for i in range(4)]
    calls = {"flows": lambda x: c.flows(c.params, x), "log_prob": lambda x: c.log_prob(c.params, x),
             "em_step": lambda x: c.em_step(c.params, x, step_size=0.1, pseudocount=0.1)}
    stamps: list[tuple[int, float]] = []
    original = jax.stages.Compiled.__call__

    def stamped(self, *a, **k):  # the entry's executable takes the most arguments (the call path's helpers 1-2)
        stamps.append((len(a), time.perf_counter()))
        return original(self, *a, **k)

    replay = c.runtime.replay
    full = lambda *a, **k: None  # noqa: E731 - Runtime.replay's "nothing to repeat"
    out = {}
    kind = "numpy" if args.host else "device"
    print(f"{args.workload}-{args.latents} B={args.batch} ({kind} batches) on {jax.devices()[0].device_kind}, "
          f"jax {jax.__version__}, medians of {args.reps} calls, us", flush=True)
    for name in args.entries.split(","):
        call = calls[name]
        for mode in (replay, full, replay):
            c.runtime.replay = mode
            for i in range(8):
                jax.block_until_ready(call(xs[i % 4]))
            c.wait_compiled()
        times = {m: ([], [], []) for m in ("replay", "full")}
        jax.stages.Compiled.__call__ = stamped
        try:
            for block in range(0, args.reps, 200):
                for mode, fn in (("replay", replay), ("full", full)):
                    c.runtime.replay = fn
                    pre, ret, done = times[mode]
                    for i in range(block, min(block + 200, args.reps)):
                        stamps.clear()
                        t = time.perf_counter()
                        o = call(xs[i % 4])
                        r = time.perf_counter()
                        jax.block_until_ready(o)
                        pre.append(max(stamps)[1] - t)
                        ret.append(r - t)
                        done.append(time.perf_counter() - t)
        finally:
            jax.stages.Compiled.__call__ = original
            c.runtime.replay = replay
        row = {m: {k: 1e6 * statistics.median(v) for k, v in zip(("pre", "return", "sync"), t)}
               for m, t in times.items()}
        out[name] = row
        print(f"  c.{name}: " + " | ".join(f"{k} {row['replay'][k]:.1f} (full path {row['full'][k]:.1f})"
                                           for k in ("pre", "return", "sync")), flush=True)
    return out


if __name__ == "__main__":
    main()
