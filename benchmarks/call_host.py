"""The host time of the default call before its executable starts, with and without the replay of a repeated call.

    python benchmarks/call_host.py [--workload digits|hclt|hmm] [--latents 16] [--batch 16] [--reps 3000]
                                   [--entries flows,log_prob,em_step] [--host [--dtype int64]]
    python benchmarks/call_host.py --pieces [--batches 16,128,512]

A small batch's step waits for this time: nothing runs on the device until the call reaches its executable. Per
entry point (``c.flows(c.params, x)``, ``c.log_prob(c.params, x)``, ``c.em_step(c.params, x, step_size=0.1,
pseudocount=0.1)``; with ``--entries`` also ``c.conditional(c.params, x, m)``, ``c.mpe(c.params, x, m)``,
``c.sample(c.params, key, x=x, missing=m)`` with a third of the variables in ``m``, and ``marginal_soft``,
``c.marginal(c.params, soft_evidence=q)`` with ``x`` one-hot in ``q``) on device batches (``--host``: numpy batches
of the data's integer type or ``--dtype``, checked on the host and moved by the call), four in turn, each call
waited for, medians over ``--reps`` calls, in microseconds: ``pre``, from the call to the start of the entry's
compiled executable (timed by wrapping ``jax.stages.Compiled.__call__``; a batch short of its bucket, e.g. ``--batch
12``, is padded by a helper executable first); ``return``, until the call returns (on a CPU this includes much of
the work); ``sync``, until its outputs are ready (``jax.block_until_ready``). Each for the call as users make it
(``replay``: ``Runtime.replay`` repeats the previous call's executable) and with every call on the full call path
(``full``), alternated in blocks of 200 calls.
``digits`` is the demo's HCLT on scikit-learn's digits (runs in seconds on a CPU); ``hclt`` / ``hmm`` are the
benchmarks' HCLT on 28x28 images with 256 levels and HMM (T=64, V=4096).

``--pieces``: what a numpy batch ``[B, 784]`` of 256 levels costs the host, per integer type, medians of 300 in
microseconds: the host check (``checks.check_host_values``, and the same without its unsigned view: ``old``), the copy
to int32 that the call hands to its executable, ``jax.device_put`` (until it returns and until the array is ready),
and a trivial jitted function called with the numpy array and with the same array on the device (synchronized).
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
    p.add_argument("--dtype", default=None, help="the numpy batches' type (--host; default the data's)")
    p.add_argument("--pieces", action="store_true", help="time the host pieces of a numpy batch's call instead")
    p.add_argument("--batches", default="16,128,512", help="batch sizes of --pieces")
    args = p.parse_args(argv)
    if args.pieces:
        return pieces([int(b) for b in args.batches.split(",")])

    import jax
    import jax.numpy as jnp
    import numpy as np

    from _options import query_calls

    c, data = build(args.workload, args.latents)
    put = (lambda a: np.asarray(a, dtype=args.dtype)) if args.host else jnp.asarray
    xs = [put(data[i * args.batch:(i + 1) * args.batch]) for i in range(4)]
    levels = int(c.runtime.var_info.card.max())
    soft = {id(x): put(np.eye(levels, dtype=np.float32)[np.asarray(x)]) for x in xs}  # one-hot: x as soft evidence
    calls = {"flows": lambda x: c.flows(c.params, x), "log_prob": lambda x: c.log_prob(c.params, x),
             "em_step": lambda x: c.em_step(c.params, x, step_size=0.1, pseudocount=0.1),
             **query_calls(c, put),
             "marginal_soft": lambda x: c.marginal(c.params, soft_evidence=soft[id(x)])}
    stamps: list[tuple[int, float]] = []
    original = jax.stages.Compiled.__call__

    def stamped(self, *a, **k):  # the entry's executable takes the most arguments (the call path's helpers 1-2)
        stamps.append((len(a), time.perf_counter()))
        return original(self, *a, **k)

    replay = c.runtime.replay
    full = lambda *a, **k: None  # noqa: E731 - Runtime.replay's "nothing to repeat"
    out = {}
    kind = f"numpy {xs[0].dtype}" if args.host else "device"
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


def pieces(batches: list[int], num_vars: int = 784, reps: int = 300) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpc import checks, distributions

    leaf = distributions.Categorical(num_cats=256)
    info = checks.VarInfo.from_var_dists(num_vars, {v: [leaf] for v in range(num_vars)})

    def med(fn) -> float:
        for _ in range(10):
            fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return 1e6 * statistics.median(times)

    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: a numpy batch's host pieces, medians of {reps}, us",
          flush=True)
    trivial = jax.jit(lambda x: x.astype(jnp.int32).sum(0))
    rng, out = np.random.default_rng(0), {}
    for b in batches:
        for dtype in (np.int64, np.int32, np.uint8):
            x = rng.integers(0, 256, (b, num_vars)).astype(dtype)
            row = {"check": med(lambda: checks.check_host_values(info, x, None, "x"))}
            info._unsigned_tops[np.dtype(dtype)] = None  # the column minima and maxima in the batch's own type
            row["check_old"] = med(lambda: checks.check_host_values(info, x, None, "x"))
            info._unsigned_tops.clear()
            row["copy"] = med(lambda: np.asarray(x).astype(np.int32))
            row["put_sync"] = med(lambda: jax.device_put(x).block_until_ready())
            row["put_return"] = med(lambda: jax.device_put(x))
            on_device = jax.device_put(x)
            row["trivial_numpy"] = med(lambda: trivial(x).block_until_ready())
            row["trivial_device"] = med(lambda: trivial(on_device).block_until_ready())
            out[f"{b}/{np.dtype(dtype).name}"] = row
            print(f"  B={b} {np.dtype(dtype).name}: check {row['check']:.1f} (old {row['check_old']:.1f}) | copy to "
                  f"int32 {row['copy']:.1f} | device_put {row['put_return']:.1f} (ready {row['put_sync']:.1f}) | "
                  f"trivial jit numpy {row['trivial_numpy']:.1f}, device {row['trivial_device']:.1f}", flush=True)
    return out


if __name__ == "__main__":
    main()
