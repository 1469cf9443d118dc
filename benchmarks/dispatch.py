"""Where the host time of a synchronized step goes: ``Circuit.flows`` under buffer-address conditions and XLA flags.

    python benchmarks/dispatch.py [--workload hclt] [--latents 256] [--batches 16,512] [--impl auto]
                                  [--flags "|--xla_gpu_enable_command_buffer="] [--trace] [--timeline] [--floor]
                                  [--unrolled] [--entry flows|log_prob] [--default-call] [--tuning field=value]
                                  [--env "|TF_CUDA_PLATFORM_GPU_DEVICE_SCHEDULE=spin"] [--no-replay]

Each ``|``-separated entry of ``--flags`` runs in its own process with those ``XLA_FLAGS`` (the empty entry:
none), once per ``|``-separated entry of ``--env`` (environment settings, e.g. the CUDA context's wait mode). Per
process and batch size, medians over ``--reps`` synchronized ``flows`` (``--entry``) calls
(``validate=False``, the library's call path: packed tables, cached executable; ``--default-call``: the call with
no options), on the optimized executable (after ``c.wait_compiled()``), in four loops:

* ``rotate``: 4 input batches in turn, the previous outputs freed before the call (the benchmarks' loop);
* ``same``: one input batch every call, outputs freed: every buffer the step reads or writes can land at
  the address it had in the previous call;
* ``held``: 4 batches in turn, the previous outputs alive during the call (they cannot be reused);
* ``pipelined``: calls dispatched back to back, synchronized once.

For each: wall ms and ``dispatch`` (until the call returns). XLA's GPU runtime re-records a command buffer
whose buffers moved, so ``rotate - same`` is what moving inputs cost. ``--trace`` also prints the host
events (XLA's, not Python's) of a profiler trace of the ``rotate`` loop by total time per step (the trace's
device tracing slows the launches it records: compare event against event, not with the wall times), and
the compiled step's entry computation by opcode. An XLA flag the installed jaxlib does not know fails that
process only (reported, the others run).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def hlo_census(text: str) -> str:
    """The instructions of the entry computation of optimized HLO text by opcode (the kernels and loops the
    runtime launches; this XLA forms its command buffers from the thunks, so the HLO does not show them: the
    trace's ``command_buffer`` events do)."""
    entry = text[text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    ops = collections.Counter(m.group(1) for m in re.finditer(r"^\s*(?:ROOT )?%?[\w.-]+ = .*?\s([a-z][\w-]*)\(",
                                                              entry, re.M))
    for skip in ("parameter", "get-tuple-element", "tuple", "bitcast", "constant"):
        ops.pop(skip, None)
    return "entry computation: " + (", ".join(f"{k} {v}" for k, v in ops.most_common()) or "nothing")


def host_events(trace_dir: str, steps: int, top: int = 12) -> list[str]:
    from profile_step import load_trace

    trace = load_trace(trace_dir)
    if trace is None:
        return ["(no trace written)"]
    events, device = trace
    per = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("ph") == "X" and e.get("pid") not in device and not str(e.get("name", "")).startswith("$"):
            name = re.sub(r"[:#]\d+.*$|\.\d+$", "", str(e.get("name", "?")))[:70]
            per[name][0] += 1
            per[name][1] += float(e.get("dur", 0.0))
    return [f"  {us / steps / 1e3:8.3f} ms  x{n / steps:6.1f}  {name}"
            for name, (n, us) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]]


def timeline(trace_dir: str, steps: int, show: int = 1, min_us: float = 4.0) -> list[str]:
    """Per ``jaxpc_step`` annotation of the trace: the time from the call to its first kernel, the kernels' span and
    the time from the last kernel to the step's end (all under the profiler, which slows launches); for the last
    ``show`` steps also the host events of at least ``min_us`` in order, as offsets from the call."""
    from profile_step import load_trace

    trace = load_trace(trace_dir)
    if trace is None:
        return ["(no trace written)"]
    events, device = trace
    marks = sorted((e for e in events if e.get("ph") == "X" and e.get("name") == "jaxpc_step"), key=lambda e: e["ts"])
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("pid") in device), key=lambda e: e["ts"])
    host = sorted((e for e in events if e.get("ph") == "X" and e.get("pid") not in device
                   and e.get("name") != "jaxpc_step"), key=lambda e: e["ts"])
    out = []
    for j, m in enumerate(marks[-steps:]):
        t0, t1 = m["ts"], m["ts"] + m["dur"]
        ks = [k for k in kernels if t0 <= k["ts"] <= t1]
        if not ks:
            out.append(f"  step {j}: {m['dur'] / 1e3:.3f} ms, no kernels in it")
            continue
        first, last = ks[0]["ts"], max(k["ts"] + k["dur"] for k in ks)
        out.append(f"  step {j}: {m['dur'] / 1e3:.3f} ms: call to first kernel {(first - t0) / 1e3:.3f} ms "
                   f"({ks[0]['name'][:40]}), "
                   f"kernels' span {(last - first) / 1e3:.3f} ms ({len(ks)} kernels), last kernel to return "
                   f"{(t1 - last) / 1e3:.3f} ms")
        if j >= steps - show:
            for e in host:
                if t0 <= e["ts"] <= t1 and e.get("dur", 0) >= min_us:
                    out.append(f"    +{(e['ts'] - t0) / 1e3:7.3f} ms {e['dur'] / 1e3:7.3f} ms  {str(e['name'])[:90]}")
    return out


def calls(fn, reps: int, *, free: bool = True, warm: int = 0, wait=None) -> str:
    """``wall ms (dispatch ms)``: medians over ``reps`` synchronized calls ``fn(i)`` (after ``warm`` untimed ones),
    ``dispatch`` until the call returns; ``wait`` (default ``jax.block_until_ready``) waits for the outputs;
    ``free``: the previous outputs are deleted before the next call, else held while it runs."""
    import jax

    wait = wait or jax.block_until_ready
    out, walls, disp = None, [], []
    for i in range(warm + reps):
        if free and out is not None:
            for leaf in jax.tree_util.tree_leaves(out):
                leaf.delete()
            out = None
        t = time.perf_counter()
        o = fn(i)
        d = time.perf_counter()
        wait(o)
        if i >= warm:
            walls.append(time.perf_counter() - t)
            disp.append(d - t)
        out = o
    return f"{1e3 * np.median(walls):.3f} ms (dispatch {1e3 * np.median(disp):.3f})"


def floor(c, call, xs, reps: int) -> dict:
    """``--floor``: what bounds a synchronized call from below, medians over ``reps`` calls, each ``wall ms
    (dispatch ms)``: ``raw``, the step's compiled executable called directly on the arguments the API gave it for
    ``xs[0]`` (no ``Circuit`` Python: compare with ``same``); ``spin``, the API's call waited for by polling its
    outputs' ``is_ready()`` instead of ``jax.block_until_ready``; ``trivial``, a jitted ``x + 1`` of the input
    batch (a call's fixed cost)."""
    import jax

    from jaxpc import executables

    got = {}
    run = executables.ExecutableCache.run

    def spy(self, entry, fn, static, a, fallback=None):
        got.setdefault("args", self._call_args(a))
        return run(self, entry, fn, static, a, fallback)

    executables.ExecutableCache.run = spy
    replay = c.runtime.replay
    c.runtime.replay = lambda *a, **k: None  # the full call, whose arguments the spy sees
    try:
        jax.block_until_ready(call(xs[0]))
    finally:
        executables.ExecutableCache.run = run
        c.runtime.replay = replay
    c.wait_compiled()  # the optimized executable, not the quick first compile (Tuning.quick_first_compile)
    exe, raw_args = c.compiled("flows"), got["args"]
    inc = jax.jit(lambda x: x + 1)

    def spin(o):
        leaves = jax.tree_util.tree_leaves(o)
        while not all(leaf.is_ready() for leaf in leaves):
            pass

    out = {"raw": calls(lambda i: exe(*raw_args), reps, warm=3),
           "spin": calls(lambda i: call(xs[i % 4]), reps, warm=3, wait=spin),
           "trivial": calls(lambda i: inc(xs[i % 4]), reps, warm=3)}
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for i in range(reps):
        jax.block_until_ready(call(xs[i % 4]))
    prof.disable()
    st = pstats.Stats(prof).stats  # {(file, line, name): (calls, primitive calls, tottime, cumtime, callers)}
    rows = sorted(st.items(), key=lambda kv: -kv[1][3])[:24]
    print(f"  cProfile of {reps} synchronized calls, us per call (own / with callees):\n" + "\n".join(
        f"    {1e6 * v[2] / reps:8.1f} {1e6 * v[3] / reps:8.1f}  x{v[0] / reps:4.1f}  {Path(k[0]).name}:{k[1]}({k[2]})"
        for k, v in rows), flush=True)
    return out


def measure(args):
    import jax
    import jax.numpy as jnp

    import jaxpc
    from _options import tuning
    from profile_step import build

    c, data = build(args.workload, args.latents, tuple(int(v) for v in args.split_intervals.split(",")))
    opts = jaxpc.Options(precision=args.precision, impl=args.impl, scan_stages=not args.unrolled)
    flags = os.environ.get("XLA_FLAGS", "") or "(none)"
    for batch in (int(b) for b in args.batches.split(",")):
        xs = [jnp.asarray(data[i * batch:(i + 1) * batch]) for i in range(4)]

        kw = {"options": jaxpc.Options(tuning=tuning(args.tuning))} if args.tuning else {}  # made once, as users do

        def call(x):
            if args.default_call:
                return getattr(c, args.entry)(c.params, x, **kw)
            if args.entry == "log_prob":
                return c.log_prob(c.params, x, options=opts, validate=False)
            return c.flows(c.params, x, options=opts, validate=False, return_ll=True)

        if args.no_replay:
            c.runtime.replay = lambda *a, **k: None
        for i in range(5):
            jax.block_until_ready(call(xs[i % 4]))
        c.wait_compiled()  # time the optimized executable, not the quick first compile it replaces
        for i in range(5):
            jax.block_until_ready(call(xs[i % 4]))

        def loop(pick, free: bool):
            return calls(lambda i: call(pick(i)), args.reps, free=free)

        res = {"rotate": loop(lambda i: xs[i % 4], True), "same": loop(lambda i: xs[0], True),
               "held": loop(lambda i: xs[i % 4], False)}
        if args.floor:
            res.update(floor(c, call, xs, args.reps))
        t = time.perf_counter()
        for i in range(args.reps):
            out = call(xs[i % 4])
        jax.block_until_ready(out)
        res["pipelined"] = f"{1e3 * (time.perf_counter() - t) / args.reps:.3f} ms"
        opt = f", options=Options(tuning=Tuning({args.tuning}))" if args.tuning else ""
        what = f"c.{args.entry}(c.params, x{opt})" if args.default_call else f"{args.entry} {args.impl}"
        what += " (no replay)" if args.no_replay else ""
        print(f"{args.workload}-{args.latents} B={batch} {what}{' unrolled' * args.unrolled} XLA_FLAGS={flags}: "
              + " | ".join(f"{k} {v}" for k, v in res.items()), flush=True)
        if args.trace:
            print("  HLO: " + hlo_census(c.compiled(args.entry).as_text()), flush=True)
            with tempfile.TemporaryDirectory() as d:
                with jax.profiler.trace(d):
                    for i in range(5):
                        jax.block_until_ready(call(xs[i % 4]))
                print("  host events per step (rotate loop):\n" + "\n".join(host_events(d, 5)), flush=True)
        if args.timeline:
            with tempfile.TemporaryDirectory() as d:
                with jax.profiler.trace(d):
                    for i in range(6):
                        with jax.profiler.TraceAnnotation("jaxpc_step"):
                            jax.block_until_ready(call(xs[i % 4]))
                print("  timeline (rotate loop, under the profiler):\n" + "\n".join(timeline(d, 5)), flush=True)


def main(argv=None):
    from profile_step import add_step_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_args(p)
    p.add_argument("--batches", default="16,512")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--unrolled", action="store_true", help="Options(scan_stages=False): repeated stages unrolled")
    p.add_argument("--trace", action="store_true", help="host events of a profiler trace and the HLO census")
    p.add_argument("--floor", action="store_true",
                   help="also the compiled executable called directly, outputs polled, and a trivial executable")
    p.add_argument("--timeline", action="store_true",
                   help="per step of a profiler trace: call to first kernel, kernels' span, last kernel to return, "
                        "and the last step's host events in order")
    p.add_argument("--entry", default="flows", choices=["flows", "log_prob"], help="the entry point timed")
    p.add_argument("--default-call", action="store_true",
                   help="time the default call (no options, inputs validated) instead of validate=False")
    p.add_argument("--no-replay", action="store_true",
                   help="every call takes the full call path (Runtime.replay off), to time what the replay saves")
    p.add_argument("--tuning", default="",
                   help="with --default-call: the call with Options(tuning=Tuning(...)) (field=value joined by +)")
    p.add_argument("--flags", default="", help="'|'-separated XLA_FLAGS settings, one process each")
    p.add_argument("--env", default="",
                   help="'|'-separated environment settings (NAME=VALUE, several joined by ','), one process each "
                        "with every --flags entry, e.g. 'TF_CUDA_PLATFORM_GPU_DEVICE_SCHEDULE=spin' (the CUDA "
                        "context's wait: spin, yield or blocking_sync)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return measure(args)
    base = [f"--workload={args.workload}", f"--latents={args.latents}", f"--batches={args.batches}",
            f"--precision={args.precision}", f"--impl={args.impl}", f"--reps={args.reps}"]
    base += (["--trace"] * args.trace + ["--timeline"] * args.timeline + ["--floor"] * args.floor
             + ["--unrolled"] * args.unrolled + [f"--entry={args.entry}"] + ["--default-call"] * args.default_call
             + [f"--tuning={args.tuning}"] * bool(args.tuning) + ["--no-replay"] * args.no_replay)
    for extra in args.env.split("|"):
        settings = env_settings(extra)
        for flags in args.flags.split("|"):
            env = {**os.environ, **settings, "XLA_FLAGS": flags}
            r = subprocess.run([sys.executable, __file__, "--child", *base], env=env, capture_output=True, text=True)
            out = (r.stdout + r.stderr).strip()
            where = f"{extra + ' ' if extra else ''}XLA_FLAGS={flags!r}"
            if r.returncode == 0:
                if extra:
                    print(f"environment: {extra}", flush=True)
                print("\n".join(line for line in r.stdout.splitlines() if line.strip()), flush=True)
            else:
                print(f"{where}: failed (rc {r.returncode}): " + " | ".join(out.splitlines()[-3:])[-600:], flush=True)


def env_settings(text: str) -> dict[str, str]:
    """``NAME=VALUE`` settings joined by ``,`` as a dict (the empty string: none)."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise SystemExit(f"--env: expected NAME=VALUE, got {item!r}")
        out[name] = value
    return out


if __name__ == "__main__":
    main()
