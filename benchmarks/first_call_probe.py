"""Where a first call's seconds go: one fresh process per configuration, each timing the first default call of
an entry point, split by JAX's compile events (tracing, lowering to MLIR, XLA's backend compile), and then a
second process on the same persistent cache (warm).

    python benchmarks/first_call_probe.py [--workload hclt|pd|hmm|deep] [--levels 50] [--batch 16] [--entry flows]
        [--timeout 200]
        [--configs "default|autotune0=--xla_gpu_autotune_level=0|xla={\\"impl\\": \\"reference\\"}"] [--warm]
        [--profile N] [--xla-timers N] [--host-trace N] [--quick-only] [--one-call]

A configuration is ``name=XLA_FLAGS`` or ``name={options as JSON}`` (``jaxpc.Options`` fields, ``"tuning"`` a dict of
``jaxpc.Tuning`` fields); ``default``
is the plain default call. ``deep`` is a circuit of ``--levels`` distinct levels (:func:`deep_chain`: no two
neighbouring levels of one shape, so nothing scans), the worst case of a first call per level. Prints one JSON
line per process: seconds of the structure build, ``jaxpc.compile``,
the first call (``store_s``: of it, the executable store's digests and loads; ``--profile N``: its N functions
of most cumulative time under cProfile; ``--host-trace N``: the first call under ``jax.profiler.trace``, the N host
events of most summed time, named with their count, threads and wall span, which places XLA's passes, LLVM and
ptxas on the call's timeline), the median of the calls right after it (``first_steps_ms``: the quick
compile's while the optimized one compiles in the background, ``Tuning.quick_first_compile``), the wait for the
optimized executable, the median of calls on it (``step_ms``), and the summed durations of JAX's compile events.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def deep_chain(levels: int, seed: int = 0):
    """A chain of ``levels`` sum levels, each over the products of the level below and a new Categorical(3)
    variable's leaves: 2 node blocks a level of a random block size from 1 to 5, never its neighbour's."""
    import numpy as np

    import jaxpc
    from jaxpc.distributions import Categorical

    rng = np.random.default_rng(seed)
    ks = [int(rng.integers(1, 6))]
    for _ in range(levels):
        ks.append(int(rng.choice([k for k in range(1, 6) if k != ks[-1]])))

    def leaves(v, k):
        return jaxpc.inputs(v, num_node_blocks=2, block_size=k, dist=Categorical(num_cats=3))

    s = jaxpc.summate(leaves(0, ks[0]), num_node_blocks=2, block_size=ks[0])
    for i in range(1, levels + 1):
        m = jaxpc.multiply(s, leaves(i, ks[i - 1]))
        s = jaxpc.summate(m, num_node_blocks=1 if i == levels else 2, block_size=1 if i == levels else ks[i])
    return s


def child(workload: str, batch: int, entry: str, options: dict, levels: int = 50) -> None:
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    import jax
    import numpy as np

    events: dict = collections.defaultdict(float)
    jax.monitoring.register_event_duration_secs_listener(lambda name, secs, **kw: events.__setitem__(
        name, events[name] + secs))

    import jaxpc
    from _data import blurred_noise_images
    from jaxpc import distributions, structures

    cat = distributions.Categorical(256)
    t0 = time.perf_counter()
    if workload == "deep":
        root = deep_chain(levels)
        x = np.random.default_rng(0).integers(0, 3, (batch, levels + 1)).astype(np.int32)
    elif workload == "hmm":
        root = structures.HMM(64, 1024, 4096)
        x = np.random.default_rng(0).integers(0, 4096, (batch, 64)).astype(np.int32)
    else:
        imgs = blurred_noise_images(max(batch, 2_000))
        root = (structures.PD((28, 28), 128, split_intervals=(4, 4), input_dist=cat) if workload == "pd"
                else structures.HCLT(imgs, 256, input_dist=cat))
        x = imgs[:batch]
    t1 = time.perf_counter()
    c = jaxpc.compile(root)
    t2 = time.perf_counter()
    xd = jax.device_put(x)
    if isinstance(options.get("tuning"), dict):  # {"tuning": {Tuning fields}}
        options = {**options, "tuning": jaxpc.Tuning(**options["tuning"])}
    opts = jaxpc.Options(**options) if options else None
    kw = {} if opts is None else {"options": opts}
    call = {"flows": lambda: c.flows(c.params, xd, **kw), "log_prob": lambda: c.log_prob(c.params, xd, **kw),
            "em_step": lambda: c.em_step(c.params, xd, **kw)}[entry]
    from _timing import timed
    from jaxpc import executables

    store_s = collections.defaultdict(float)  # seconds in the executable store's digest and load
    for name in ("fingerprints", "load", "save"):
        setattr(executables.ExecutableStore, name, timed(store_s, name, getattr(executables.ExecutableStore, name)))
    prof = None
    if os.environ.get("PROBE_PROFILE"):
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    trace_dir = tempfile.mkdtemp(prefix="probe-trace-") if os.environ.get("PROBE_HOST_TRACE") else None
    if trace_dir:
        jax.profiler.start_trace(trace_dir)
    t3 = time.perf_counter()
    jax.block_until_ready(call())
    t4 = time.perf_counter()
    host = []
    if trace_dir:
        jax.profiler.stop_trace()
        host = host_events(trace_dir, int(os.environ["PROBE_HOST_TRACE"]))
    top = []
    if prof is not None:
        import pstats
        prof.disable()
        st = pstats.Stats(prof)
        rows = sorted(st.stats.items(), key=lambda kv: -kv[1][3])[:int(os.environ["PROBE_PROFILE"])]
        top = [f"{v[3]:.3f}s cum {v[2]:.3f}s own {Path(k[0]).name}:{k[1]}({k[2]})" for k, v in rows]

    def step_ms():
        steps = []
        for _ in range(20):
            t = time.perf_counter()
            jax.block_until_ready(call())
            steps.append(time.perf_counter() - t)
        return round(1e3 * float(np.median(steps[5:])), 3)

    name = f"deep{levels}" if workload == "deep" else workload
    first = dict(workload=name, batch=batch, entry=entry, build_s=round(t1 - t0, 2), compile_s=round(t2 - t1, 2),
                 first_call_s=round(t4 - t3, 3))
    if os.environ.get("PROBE_ONE_CALL"):  # a script that calls once and ends: the parent times its exit
        print("RESULT " + json.dumps(dict(**first, store_s={k: round(v, 3) for k, v in store_s.items()},
                                          result_at=time.time())), flush=True)
        return
    first_steps = step_ms()  # the quick compile's, where the optimized one is still compiling
    quick_only = bool(os.environ.get("PROBE_QUICK_ONLY"))
    quick = c.compiled(entry)  # (a background upgrade may swap it out before the report)
    t5 = time.perf_counter()
    if not quick_only:
        c.wait_compiled()
    upgrade = time.perf_counter() - t5
    ev = {k.rsplit("/", 1)[-1]: round(v, 3) for k, v in events.items() if v > 0.01}
    print("RESULT " + json.dumps(dict(**first, first_steps_ms=first_steps, upgrade_wait_s=round(upgrade, 2),
                                      step_ms=None if quick_only else step_ms(), events=ev,
                                      store_s={k: round(v, 3) for k, v in store_s.items()}, profile=top,
                                      host_trace=host,
                                      cache=str(c.cache_info()),
                                      kernels=kernel_counts(quick if quick_only else c.compiled(entry)))),
          flush=True)
    if quick_only:
        os._exit(0)  # (not waiting for the optimized compile at exit)


def host_events(trace_dir: str, n: int) -> list[str]:
    """The ``n`` host event names of a profiler trace with the most summed seconds (nested events count in their
    parents too): ``"<sum>s x<count> <threads>t span <first start .. last end, s after the trace's start> <name>"``,
    then its ``n // 4`` longest events other than Python calls, with their thread and arguments."""
    from profile_step import load_trace
    trace = load_trace(trace_dir)
    if trace is None:
        return ["no trace written"]
    events, gpu_pids = trace
    host = [e for e in events if e.get("ph") == "X" and e.get("pid") not in gpu_pids and "dur" in e]
    if not host:
        return ["no host events"]
    t0 = min(float(e["ts"]) for e in host)
    by = collections.defaultdict(lambda: [0.0, 0, set(), float("inf"), 0.0])
    for e in host:
        name = e.get("name", "?")[:100]
        b, ts, dur = by[name], float(e["ts"]), float(e["dur"])
        b[0] += dur
        b[1] += 1
        b[2].add(e.get("tid"))
        b[3] = min(b[3], ts - t0)
        b[4] = max(b[4], ts - t0 + dur)
    top = sorted(by.items(), key=lambda kv: -kv[1][0])[:n]
    longest = sorted((e for e in host if not e.get("name", "").startswith("$")), key=lambda e: -float(e["dur"]))
    return ([f"{v[0] / 1e6:.3f}s x{v[1]} {len(v[2])}t span {v[3] / 1e6:.2f}..{v[4] / 1e6:.2f} {k}" for k, v in top]
            + [f"longest: {float(e['dur']) / 1e6:.3f}s at {(float(e['ts']) - t0) / 1e6:.2f} t{e.get('tid')} "
               f"{e.get('name', '?')[:80]} {json.dumps(e.get('args', {}))[:160]}" for e in longest[:n // 4]])


def kernel_counts(compiled) -> dict:
    """Triton custom calls in an executable's optimized HLO (how many, how many distinct kernels) and its GEMMs
    (cuBLAS calls, Triton GEMM fusions)."""
    import re
    if compiled is None:
        return {}
    try:
        text = compiled.as_text()
    except Exception as e:  # noqa: BLE001 - a loaded executable may not keep its HLO text
        return {"error": type(e).__name__}
    calls = [ln for ln in text.splitlines() if "custom_call_target=\"__gpu$xla.gpu.triton\"" in ln]
    configs = {re.sub(r"^.*?backend_config=", "", ln) for ln in calls}
    cublas = sum('custom_call_target="__cublas$gemm"' in ln for ln in text.splitlines())
    triton_gemm = sum('"kind":"__triton_gemm"' in ln for ln in text.splitlines())
    return {"triton_calls": len(calls), "triton_distinct": len(configs), "cublas_gemms": cublas,
            "triton_gemm_fusions": triton_gemm, "hlo_lines": len(text.splitlines())}


def dedupe_probe(n_calls: int = 24) -> None:
    """Does XLA compile a Pallas kernel once when an executable calls it many times with one shape, and once per
    shape when the shapes differ? Compile seconds of a chain of ``n_calls`` kernels of one shape and of distinct
    shapes, against one call."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.tanh(x_ref[...]) * 1.5 + 0.25

    def call(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              grid=(x.shape[0] // 16,), in_specs=[pl.BlockSpec((16, 128), lambda i: (i, 0))],
                              out_specs=pl.BlockSpec((16, 128), lambda i: (i, 0)))(x)

    def chain(sizes):
        def f(*xs):
            return [call(x) for x in xs]
        args = [jnp.ones((n, 128), jnp.float32) for n in sizes]
        t = time.perf_counter()
        jax.jit(f).lower(*args).compile()
        return round(time.perf_counter() - t, 3)

    out = {"one": chain([64]), f"same_x{n_calls}": chain([64] * n_calls),
           f"distinct_x{n_calls}": chain([16 * (i + 1) for i in range(n_calls)])}
    print("RESULT " + json.dumps({"dedupe_compile_s": out}), flush=True)


XLA_TIMER_MODULES = ("gpu_compiler=1,nvptx_compiler=1,compile_module_to_llvm_ir=1,ir_emitter_unnested=1,"
                     "triton_fusion_emitter=1,gpu_executable=1,autotuner_util=1")


def xla_timers(stderr: str, n: int) -> list[str]:
    """The ``n`` longest of XLA's scoped timers in a process's log (lines ``<label> time: <duration> ...``), with
    the seconds of each, summed over repeats of one label."""
    import re
    total: dict = collections.defaultdict(float)
    units = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, "min": 60.0}
    for line in stderr.splitlines():
        m = re.search(r"\] (.*?) time: ([0-9.]+) ?(min|ms|us|ns|s)\b", line)
        if m:
            label = re.sub(r"\d+", "#", m.group(1))[:120]
            total[label] += float(m.group(2)) * units[m.group(3)]
    return [f"{v:.3f}s {k}" for k, v in sorted(total.items(), key=lambda kv: -kv[1])[:n]]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="hclt", choices=["pd", "hclt", "hmm", "deep"])
    p.add_argument("--levels", type=int, default=50, help="the deep workload's levels")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--entry", default="flows", choices=["flows", "log_prob", "em_step"])
    p.add_argument("--timeout", type=float, default=200)
    p.add_argument("--configs", default="default")
    p.add_argument("--warm", action="store_true", help="run each configuration a second time on the same cache")
    p.add_argument("--profile", type=int, default=0,
                   help="profile each first call (cProfile) and report its N functions of most cumulative time")
    p.add_argument("--dedupe", action="store_true", help="only probe whether XLA compiles repeated kernels once")
    p.add_argument("--quick-only", action="store_true",
                   help="stop after the calls on the quick executable (no optimized compile; JAX's events then"
                        " hold the quick compile alone, and the process does not wait for the optimized one)")
    p.add_argument("--one-call", action="store_true",
                   help="end each process right after its first call, as a script that calls once does, and report"
                        " the seconds from that call's result to the process's exit (exit_s: the wait for the"
                        " optimized compiles and the store's writes)")
    p.add_argument("--host-trace", type=int, default=0,
                   help="trace the first call with jax.profiler and report its N host events of most summed time")
    p.add_argument("--xla-timers", type=int, default=0,
                   help="log XLA's scoped compile timers (TF_CPP_VMODULE) and report the N longest of each process")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dedupe:
        return dedupe_probe()
    if args.child is not None:
        return child(args.workload, args.batch, args.entry, json.loads(args.child), args.levels)
    for cfg in args.configs.split("|"):
        name, _, spec = cfg.partition("=")
        options, flags = ({}, "") if not spec else ((json.loads(spec), "") if spec.startswith("{") else ({}, spec))
        cache = tempfile.mkdtemp(prefix="jaxpc-probe-")
        env = dict(os.environ, JAXPC_CACHE_DIR=cache)
        if args.profile:
            env["PROBE_PROFILE"] = str(args.profile)
        if args.quick_only:
            env["PROBE_QUICK_ONLY"] = "1"
        if args.one_call:
            env["PROBE_ONE_CALL"] = "1"
        if args.host_trace:
            env["PROBE_HOST_TRACE"] = str(args.host_trace)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
        if args.xla_timers:
            env.update(TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE=XLA_TIMER_MODULES)
        for run in ("cold", "warm") if args.warm else ("cold",):
            cmd = [sys.executable, __file__, "--workload", args.workload, "--levels", str(args.levels), "--batch",
                   str(args.batch), "--entry",
                   args.entry, "--child", json.dumps(options)]
            t = time.perf_counter()
            try:
                r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
                ended = time.time()
                lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
                res = json.loads(lines[-1][7:]) if lines else {"error": r.stderr[-1500:]}
                if args.xla_timers:
                    res["xla_timers"] = xla_timers(r.stderr, args.xla_timers)
            except subprocess.TimeoutExpired:
                res = {"error": f"timeout after {args.timeout}s"}
            res.update(config=name, run=run, process_s=round(time.perf_counter() - t, 1))
            if "result_at" in res:
                res["exit_s"] = round(ended - res.pop("result_at"), 2)
                res["exit_notice"] = [ln for ln in r.stderr.splitlines() if ln.startswith("jaxpc: ")]
            print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
