"""Build + compile time of the benchmark workloads: on the host (runs anywhere) and, with --first-calls, the
first calls on the device with the persistent compilation cache cold and warm.

    python benchmarks/compile_time.py [--hclt-rows 1000]
    python benchmarks/compile_time.py --first-calls [--workloads hclt,pd,hmm,codd]
                                      [--calls flows:16,flows:128,flows:512,log_prob:128,em_step:128]
                                      [--variant default|tuned] [--budget-s 470] [--json out.json]

Host part: per workload, structure construction time, ``jaxpc.compile`` time, nodes and edges, index-table
and parameter bytes, and the growth of the process's peak RSS during compile.

``--first-calls``: per workload, two fresh child processes share one empty temporary cache directory
(``JAXPC_CACHE_DIR``; where the installed jaxpc does not set JAX's cache directory by itself on import, the
child calls ``jaxpc.enable_persistent_cache`` with it before anything compiles and says so): the first
(cold) compiles every executable, the second (warm) should load them. Each child reports its structure
build and ``jaxpc.compile`` seconds, then the seconds of the first call of each ``entry:B`` in ``--calls`` (and
the wait until its optimized executable replaced the quick first compile, ``Tuning.quick_first_compile``)
(``--variant default``: the default call, ``c.flows(params, x)``, ``c.log_prob(params, x)``,
``c.em_step(params, x, step_size=0.1, pseudocount=0.1)``; ``tuned``: with
``options=jaxpc.Options(precision="tf32"), validate=False``), its ``cache_info()`` and the files in the
cache directory. ``codd`` runs ``codd.py``'s loop (batch sizes 10..26, two bucket executables) cold and
warm. Children run one at a time, each with a timeout, within ``--budget-s`` in all; results are JSON
lines (``RESULT {...}``) and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jaxpc  # noqa: E402
from _data import blurred_noise_images  # noqa: E402
from jaxpc import distributions, structures  # noqa: E402


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _nbytes(tree) -> int:
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(tree))


def measure(name, build):
    t0 = time.perf_counter()
    root = build()
    t1 = time.perf_counter()
    rss0 = _rss_mb()
    c = jaxpc.compile(root)
    jax.block_until_ready(c.params)
    t2 = time.perf_counter()
    print(f"{name:10s} build {t1 - t0:7.2f} s | jaxpc.compile {t2 - t1:6.2f} s | {c.num_nodes:>9,} nodes "
          f"{c.num_edges:>12,} edges | tables {_nbytes(c.tables) / 2**20:7.1f} MiB | params "
          f"{_nbytes(c.params) / 2**20:7.1f} MiB | peak RSS +{_rss_mb() - rss0:7.1f} MiB | "
          f"{len(c.layout.steps)} steps")
    return c


WORKLOADS = {"hclt": "HCLT-256", "pd": "PD-128", "hmm": "HMM-1024", "codd": "CoDD"}
DEFAULT_CALLS = "flows:16,flows:128,flows:512,log_prob:128,em_step:128"


def _builder(w: str, latents: int | None, small: bool):
    """``(name, build, data(B))`` of a workload (``--small``: T=16, V=256 and 1,000 images)."""
    if w == "hmm":
        L = latents or 1024
        T, V = (16, 256) if small else (64, 4096)
        return (f"HMM-{L}", lambda: structures.HMM(T, L, V),
                lambda b: np.random.default_rng(b).integers(0, V, (b, T)).astype(np.int32))
    imgs = blurred_noise_images(1_000 if small else 10_000)
    cat = distributions.Categorical(num_cats=256)
    data = lambda b: imgs[np.random.default_rng(b).integers(0, len(imgs), b)]  # noqa: E731
    if w == "hclt":
        L = latents or 256
        return f"HCLT-{L}", lambda: structures.HCLT(imgs, L, input_dist=cat), data
    L = latents or 128
    return f"PD-{L}", lambda: structures.PD((28, 28), L, split_intervals=(4, 4), input_dist=cat), data


def _cache_setup(directory: str) -> dict:
    """Point the persistent compilation cache at ``directory`` before anything compiles: jaxpc's own setting
    where importing it set JAX's cache directory (from ``JAXPC_CACHE_DIR``), else ``enable_persistent_cache``."""
    if jax.config.jax_compilation_cache_dir:
        mode = "jaxpc default (JAXPC_CACHE_DIR)"
    else:
        jaxpc.enable_persistent_cache(directory)
        mode = "explicit jaxpc.enable_persistent_cache"
    return dict(cache_mode=mode, cache_dir_used=jax.config.jax_compilation_cache_dir,
                min_compile_s=jax.config.jax_persistent_cache_min_compile_time_secs,
                min_entry_bytes=jax.config.jax_persistent_cache_min_entry_size_bytes)


def _files(directory: str) -> int:
    return sum(len(f) for _, _, f in os.walk(directory))


def child(args) -> dict:
    """One process's first calls (see the module docstring); prints and returns the result."""
    out = dict(workload=args.child, state=args.state, jax=jax.__version__)
    out.update(_cache_setup(args.cache_dir))  # (before anything compiles: jax.devices() starts the backend)
    out["device"] = jax.devices()[0].device_kind
    if args.child == "codd":
        import codd

        small = ["--latents", "16", "--vocab", "64", "--topk", "8", "--seq", "8"]
        codd_args = ["--steps", str(args.codd_steps)] + (small if args.small else [])
        r = codd.main(codd_args)
        out.update(first_call_s=r["first_call_s"], executables=r["executables"], median_ms=r["median_ms"])
    else:
        name, build, data = _builder(args.child, args.latents, args.small)
        t0 = time.perf_counter()
        root = build()
        t1 = time.perf_counter()
        c = jaxpc.compile(root)
        jax.block_until_ready(c.params)
        out.update(name=name, build_s=t1 - t0, jaxpc_compile_s=time.perf_counter() - t1)
        kw = {} if args.variant == "default" else dict(options=jaxpc.Options(precision="tf32"), validate=False)
        calls, upgrades = {}, {}
        for spec in args.calls.split(","):
            entry, b = spec.split(":")
            x = jax.device_put(data(int(b)))
            fn = {"log_prob": lambda: c.log_prob(c.params, x, **kw), "flows": lambda: c.flows(c.params, x, **kw),
                  "em_step": lambda: c.em_step(c.params, x, step_size=0.1, pseudocount=0.1, **kw)}[entry]
            t = time.perf_counter()
            jax.block_until_ready(fn())
            calls[spec] = time.perf_counter() - t
            t = time.perf_counter()
            c.wait_compiled()  # the optimized executable replacing the quick first compile
            upgrades[spec] = time.perf_counter() - t
            print(f"  {name} {args.state}: first {spec} {calls[spec]:.2f} s, optimized {upgrades[spec]:.2f} s later",
                  flush=True)
        out["first_call_s"] = calls
        out["upgrade_wait_s"] = upgrades
        out["cache_info"] = c.cache_info()._asdict()
    out["cache_files"] = _files(args.cache_dir)
    print("RESULT " + json.dumps(out), flush=True)
    return out


def first_calls(args) -> list:
    """Cold and warm children per workload, within the budget; a table and JSON."""
    t_end = time.perf_counter() + args.budget_s
    results = []
    for w in args.workloads.split(","):
        if w not in WORKLOADS:
            raise SystemExit(f"unknown workload {w!r}; choose from {sorted(WORKLOADS)}")
        with tempfile.TemporaryDirectory(prefix="jaxpc-cache-") as d:
            for state in ("cold", "warm"):
                left = t_end - time.perf_counter()
                if left < 10:
                    results.append(dict(workload=w, state=state, error="skipped: --budget-s spent"))
                    print(f"== {w} {state}: skipped, budget spent", flush=True)
                    continue
                timeout = min(left, args.child_timeout)
                cmd = [sys.executable, __file__, "--child", w, "--state", state, "--cache-dir", d,
                       "--calls", args.calls, "--variant", args.variant, "--codd-steps", str(args.codd_steps)]
                cmd += (["--small"] if args.small else []) + (["--latents", str(args.latents)] if args.latents else [])
                env = dict(os.environ, JAXPC_CACHE_DIR=d)
                env.pop("JAXPC_PERSISTENT_CACHE", None)
                print(f"== {w} {state} (child, timeout {timeout:.0f} s)", flush=True)
                t = time.perf_counter()
                try:
                    p = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
                    got = [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
                    sys.stdout.write("".join(line + "\n" for line in p.stdout.splitlines()
                                             if line.startswith("  ") or line.startswith("RESULT ")))
                    r = got[-1] if got else dict(workload=w, state=state,
                                                 error=f"exit {p.returncode}: {p.stderr.strip()[-800:]}")
                except subprocess.TimeoutExpired as e:
                    partial = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                    r = dict(workload=w, state=state, error=f"stopped after {timeout:.0f} s",
                             partial=[line for line in partial.splitlines() if line.startswith("  ")])
                r["process_s"] = time.perf_counter() - t
                results.append(r)
                if "error" in r:
                    print(f"== {w} {state}: {r['error']}", flush=True)
    return results


def table(results) -> str:
    """Markdown: one line per workload, each call's cold / warm first-call seconds."""
    out = ["| workload | build s | jaxpc.compile s | first call s, cold / warm | executables (cold) | cache files | "
           "cache |", "| --- | ---: | ---: | --- | ---: | ---: | --- |"]
    for w in dict.fromkeys(r["workload"] for r in results):
        cold = next((r for r in results if r["workload"] == w and r["state"] == "cold"), {})
        warm = next((r for r in results if r["workload"] == w and r["state"] == "warm"), {})
        if w == "codd":
            calls = (f"loop's executables {cold.get('first_call_s', float('nan')):.2f} / "
                     f"{warm.get('first_call_s', float('nan')):.2f}")
            n = cold.get("executables", "-")
        else:
            fc, fw = cold.get("first_call_s", {}), warm.get("first_call_s", {})
            calls = "; ".join(f"{k} {fc[k]:.2f} / " + (f"{fw[k]:.2f}" if k in fw else "-") for k in fc)
            n = cold.get("cache_info", {}).get("misses", "-")
        err = "; ".join(r["error"] for r in (cold, warm) if "error" in r)
        out.append(f"| {cold.get('name', WORKLOADS[w])} | {_g(cold.get('build_s'))} "
                   f"| {_g(cold.get('jaxpc_compile_s'))} "
                   f"| {calls or '-'}{' (' + err + ')' if err else ''} | {n} | {warm.get('cache_files', '-')} "
                   f"| {cold.get('cache_mode', '-')} |")
    return "\n".join(out)


def _g(v):
    return "-" if v is None else f"{v:.2f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hclt-rows", type=int, default=1000, help="images used to learn the Chow-Liu tree (host part)")
    p.add_argument("--first-calls", action="store_true", help="time first calls on the device, cache cold and warm")
    p.add_argument("--workloads", default="hclt,pd,hmm,codd", help="--first-calls workloads: hclt, pd, hmm, codd")
    p.add_argument("--calls", default=DEFAULT_CALLS, help="--first-calls entry:batch pairs, in call order")
    p.add_argument("--variant", default="default", choices=["default", "tuned"],
                   help="the default call, or options=Options(precision='tf32'), validate=False")
    p.add_argument("--codd-steps", type=int, default=16, help="steps of the CoDD loop")
    p.add_argument("--budget-s", type=float, default=470.0, help="seconds for all --first-calls children")
    p.add_argument("--child-timeout", type=float, default=240.0, help="seconds for one child")
    p.add_argument("--latents", type=int, default=None, help="every workload with this many latents (smoke runs)")
    p.add_argument("--small", action="store_true", help="small HMM, CoDD and image set (smoke runs)")
    p.add_argument("--json", default=None, help="write the --first-calls results here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--state", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}")
    if args.first_calls:
        results = first_calls(args)
        print("\n" + table(results) + "\n\nFirst call: the seconds of the first call of each `entry:B` in a fresh "
              "process (trace, compile or cache load, run). Cold: empty cache directory; warm: the same directory "
              "again. " + ("Default call, no options." if args.variant == "default" else
                          "Tuned path: options=jaxpc.Options(precision='tf32'), validate=False."), flush=True)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"results": results, "table": table(results), "args": vars(args)}, f, indent=1)
        return results
    x = blurred_noise_images(args.hclt_rows)
    cat = distributions.Categorical(num_cats=256)
    measure("HMM-1024", lambda: structures.HMM(64, 1024, 4096))
    measure("HCLT-256", lambda: structures.HCLT(x, 256, input_dist=cat))
    measure("HCLT-128", lambda: structures.HCLT(x, 128, input_dist=cat))
    measure("PD-128", lambda: structures.PD((28, 28), 128, split_intervals=(4, 4), input_dist=cat))


if __name__ == "__main__":
    main()
