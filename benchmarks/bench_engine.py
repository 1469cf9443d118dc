"""Time jaxpc's default call and its tuned path on the benchmark workloads (BENCHMARKS.md) on the current device.

    python benchmarks/bench_engine.py [--workloads hmm,hclt,pd] [--batches 16,128,512] [--reps 25]
                                      [--precision tf32] [--tuned-entries flows,log_prob,em_step]
                                      [--compile-threads 4] [--small] [--latents N] [--json out.json]

Two variants of each entry point, each timed as the median of synchronized calls over 4 rotating
device-resident batches (``CALLS`` spells out the calls): the **default call**, what a user writes
(``c.flows(params, x)``, ``c.log_prob(params, x)``, ``c.em_step(params, x, step_size=0.1,
pseudocount=0.1)``: no options, inputs validated), and the **tuned path** (the same with
``options=jaxpc.Options(precision="tf32")`` and ``validate=False``; ``--precision``, ``--impl`` and
``--no-fold`` change its options). Every executable is compiled first, ``--compile-threads`` at a time
(the executable cache compiles distinct keys concurrently), and then timed one after the other.

Each variant's answer is checked at every batch size before it is timed. HMM: the log-likelihoods of the
first 16 rows against a float64 numpy forward algorithm. HCLT/PD: the log-likelihoods and flows of the
batch's first ``min(batches)`` rows (the other rows weighted 0 through ``ll_weights``, so the batch's own
executable runs) against one float32 reference executable at the smallest batch
(``Options(precision="fp32", impl="xla")``; ``--check-autodiff``: JAX's autodiff through the full
layout). Reported per variant: ms of ``log_prob``, ``flows`` and ``em_step``, the flows executable's memory
(XLA's memory analysis), edges x samples per second of flows, the relative error; per workload the host
build + ``jaxpc.compile`` seconds and the executable cache's compile seconds. The HMM also times a plain
``lax.scan`` forward algorithm under ``jit(value_and_grad)`` (the 20-line baseline of BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jaxpc  # noqa: E402
from _data import blurred_noise_images  # noqa: E402
from jaxpc import distributions, structures  # noqa: E402

IMPL = "auto"
FOLD = True  # Options.fold_products (--no-fold: False)


def median_ms(fn, batches, reps, warmup=5, warmup_s=0.5):
    """Median ms of ``reps`` synchronized calls over rotating ``batches``, after at least ``warmup`` calls and
    ``warmup_s`` seconds of them (after seconds of compiling, the GPU's clocks ramp up again first)."""
    return paired_ms([fn], batches, reps, warmup, warmup_s)[0]


def paired_ms(fns, batches, reps, warmup=5, warmup_s=0.5) -> list[float]:
    """Median ms of each of ``fns`` over ``reps`` rounds that call them one after the other (each synchronized,
    the same batch in a round): the calls share the GPU's clocks and the host's state, so the ratio of the
    medians compares the calls and not the moments they were timed at."""
    t0, i = time.perf_counter(), 0
    while i < warmup or time.perf_counter() - t0 < warmup_s:
        for fn in fns:
            jax.block_until_ready(fn(batches[i % len(batches)]))
        i += 1
    times = [[] for _ in fns]
    for i in range(reps):
        xb = batches[i % len(batches)]
        for k in (range(len(fns)) if i % 2 == 0 else reversed(range(len(fns)))):  # alternate which goes first
            t = time.perf_counter()
            jax.block_until_ready(fns[k](xb))
            times[k].append(time.perf_counter() - t)
    return [1e3 * float(np.median(t)) for t in times]


def compiled_mib(compiled) -> float:
    """XLA's memory analysis of a compiled executable in MiB: temporaries, arguments and outputs (NaN where the
    backend reports none)."""
    try:
        m = compiled.memory_analysis()
        return (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes) / 2**20
    except Exception:  # noqa: BLE001 - not every backend reports it
        return float("nan")


def exec_mib(jitted, *args, **kw):
    try:
        return compiled_mib(jitted.lower(*args, **kw).compile())
    except Exception:  # noqa: BLE001 - reported as NaN, as a missing analysis
        return float("nan")


def save_rows(out_dir, name: str, rows: list) -> None:
    """``rows`` with the device and jax version as JSON in ``out_dir/name``."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(out_dir) / name, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1)


def cached_mib(c, entry: str = "flows") -> float:
    """:func:`compiled_mib` of the circuit's most recently used ``entry`` executable (no compile)."""
    exe = c.compiled(entry)
    return float("nan") if exe is None else compiled_mib(exe)


def hmm_forward_np(alpha, beta, gamma, x):
    a = gamma[None] * beta[:, x[:, 0]].T
    ll = np.log(a.sum(1))
    a /= a.sum(1, keepdims=True)
    for t in range(1, x.shape[1]):
        a = (a @ alpha) * beta[:, x[:, t]].T
        s = a.sum(1)
        ll += np.log(s)
        a /= s[:, None]
    return ll


def scan_hmm(log_alpha, log_beta, log_gamma, x):
    """The plain lax.scan forward algorithm (log-space emissions, linear-space matmul)."""
    alpha, beta = jnp.exp(log_alpha), jnp.exp(log_beta)

    def step(carry, xt):
        a, ll = carry
        a = (a @ alpha) * beta[:, xt].T
        s = a.sum(1)
        return (a / s[:, None], ll + jnp.log(s)), None

    a0 = jnp.exp(log_gamma)[None] * beta[:, x[:, 0]].T
    s0 = a0.sum(1)
    (a, ll), _ = jax.lax.scan(step, (a0 / s0[:, None], jnp.log(s0)), x[:, 1:].T)
    return jnp.sum(ll)


ENTRIES = ("log_prob", "flows", "em_step")
EM_KW = dict(step_size=0.1, pseudocount=0.1)


def tuned_options(precision: str = "tf32"):
    """The tuned path's options (``IMPL`` and ``FOLD`` follow --impl and --no-fold)."""
    return jaxpc.Options(precision=precision, impl=IMPL, fold_products=FOLD)


def _opts_src(precision: str) -> str:
    extra = ("" if IMPL == "auto" else f", impl={IMPL!r}") + ("" if FOLD else ", fold_products=False")
    return f"jaxpc.Options(precision={precision!r}{extra})"


def calls(precision: str = "tuned") -> dict:
    """The exact call behind each figure: ``{variant: {entry: source}}``."""
    tail = f", options={_opts_src(precision)}, validate=False"
    em = ", step_size=0.1, pseudocount=0.1"
    return {"default": {"log_prob": "c.log_prob(params, x)", "flows": "c.flows(params, x)",
                        "em_step": f"c.em_step(params, x{em})"},
            "tuned": {"log_prob": f"c.log_prob(params, x{tail})", "flows": f"c.flows(params, x{tail})",
                      "em_step": f"c.em_step(params, x{em}{tail})"}}


def _entry_fn(c, entry: str, kw: dict):
    """``x -> c.<entry>(c.params, x, **kw)`` (em_step with step size and pseudocount 0.1)."""
    if entry == "log_prob":
        return lambda x: c.log_prob(c.params, x, **kw)
    if entry == "flows":
        return lambda x: c.flows(c.params, x, **kw)
    return lambda x: c.em_step(c.params, x, **EM_KW, **kw)


def compile_all(jobs, threads: int) -> float:
    """Run each ``(fn, x)`` of ``jobs`` once (compiling its executable), ``threads`` at a time; the wall seconds."""
    t = time.perf_counter()
    if threads <= 1:
        for fn, x in jobs:
            jax.block_until_ready(fn(x))
    else:
        with ThreadPoolExecutor(threads) as pool:
            for out in pool.map(lambda job: jax.block_until_ready(job[0](job[1])), jobs):
                del out
    return time.perf_counter() - t


def run(name, root_fn, data_fn, batches, reps, check, precision, tuned_entries=ENTRIES, threads=4, check_jobs=None):
    """Build and compile the circuit, compile every executable, then check and time each (B, variant).

    ``check(c, x, kw)`` returns the relative error of the call ``kw`` on batch ``x``; ``check_jobs(c, data)``
    the ``(fn, x)`` calls whose executables the checks need beyond the timed ones (compiled with them).
    Returns the circuit and one row per batch size."""
    t0 = time.perf_counter()
    root = root_fn()
    t1 = time.perf_counter()
    c = jaxpc.compile(root)
    jax.block_until_ready(c.params)
    t2 = time.perf_counter()
    sum_edges = sum(ns.num_edges for ns in c.nodes if ns.is_sum())
    variants = {"default": ({}, ENTRIES), "tuned": (dict(options=tuned_options(precision), validate=False),
                                                    tuple(e for e in ENTRIES if e in tuned_entries))}
    data = {B: [jnp.asarray(data_fn(B, seed)) for seed in range(4)] for B in batches}
    jobs = [(_entry_fn(c, e, kw), data[B][0]) for B in batches for kw, entries in variants.values() for e in entries]
    jobs += check_jobs(c, data) if check_jobs else []
    compile_wall = compile_all(jobs, threads)
    t = time.perf_counter()
    c.wait_compiled()  # the optimized executables replace the quick first compiles (Tuning.quick_first_compile)
    upgrade_wall = time.perf_counter() - t
    info = c.cache_info()
    print(f"{name:9s} build {t1 - t0:.1f} s, jaxpc.compile {t2 - t1:.1f} s; {info.misses} executables compiled in "
          f"{compile_wall:.1f} s wall ({threads} at a time; {info.compile_seconds:.1f} s summed), then "
          f"{upgrade_wall:.1f} s for the optimized compiles", flush=True)
    src = calls(precision)
    rows = []
    for B in batches:
        xs = data[B]
        row = dict(workload=name, B=B, precision=precision, impl=IMPL, fold=FOLD, build_s=t1 - t0,
                   jaxpc_compile_s=t2 - t1, compile_wall_s=compile_wall, xla_compile_s=info.compile_seconds,
                   executables=info.misses, compile_threads=threads, calls=src)
        for variant, (kw, entries) in variants.items():
            pre = "" if variant == "default" else "tuned_"
            row[pre + "rel_err"] = check(c, xs[0], kw)
            ms = {}
            for e in entries:
                ms[e] = median_ms(_entry_fn(c, e, kw), xs, reps)
                if e == "flows":
                    row[pre + "mem_mib"] = cached_mib(c, "flows")
            row[pre + "fwd_ms"], row[pre + "flows_ms"], row[pre + "em_ms"] = (ms.get(e) for e in ENTRIES)
        if "flows" in variants["tuned"][1]:  # default and tuned flows alternated: the A / B of side_by_side.py
            pair = paired_ms([_entry_fn(c, "flows", kw) for kw, _ in variants.values()], xs, 2 * reps)
            row["paired_flows_ms"], row["paired_ratio"] = pair, pair[0] / pair[1]
        row["gedges_per_s"] = sum_edges * B / (row["flows_ms"] * 1e-3) / 1e9
        rows.append(row)

        def f(v):
            return "       -" if v is None else f"{v:8.3f}"

        for variant in variants:
            pre = "" if variant == "default" else "tuned_"
            pair = row.get("paired_flows_ms")
            ratio = (f" | default/tuned flows {row['flows_ms'] / row['tuned_flows_ms']:.2f}x, alternated "
                     f"{pair[0]:.3f} / {pair[1]:.3f} ms = {row['paired_ratio']:.2f}x"
                     if variant == "tuned" and pair else "")
            print(f"{name:9s} B={B:4d} {variant:7s} fwd {f(row[pre + 'fwd_ms'])} ms | fwd+flows "
                  f"{f(row[pre + 'flows_ms'])} ms | em {f(row[pre + 'em_ms'])} ms | mem "
                  f"{row.get(pre + 'mem_mib', float('nan')):8.1f} MiB | err {row[pre + 'rel_err']:.1e}{ratio}",
                  flush=True)
    return c, rows


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="hmm,hclt,pd")
    p.add_argument("--batches", default="16,128,512")
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--precision", default="tf32", choices=["fp32", "tf32", "bf16"], help="the tuned path's precision")
    p.add_argument("--tuned-entries", default=",".join(ENTRIES),
                   help="entry points timed on the tuned path too (the default call times all three)")
    p.add_argument("--impl", default="auto", choices=["auto", "xla", "pallas", "pallas_forward", "triton"],
                   help="the tuned path's Options.impl")
    p.add_argument("--no-fold", dest="fold", action="store_false",
                   help="the tuned path with Options(fold_products=False): the full layout instead of the folded plan")
    p.add_argument("--check-autodiff", action="store_true",
                   help="check the flows against float32 autodiff through the full layout (slow to compile for PD)")
    p.add_argument("--compile-threads", type=int, default=4, help="executables compiled at a time before timing")
    p.add_argument("--latents", type=int, default=None, help="every workload with this many latents (smoke runs)")
    p.add_argument("--small", action="store_true", help="a small HMM (T=16, V=256) and 1,000 images (smoke runs)")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of bench_engine.json")
    p.add_argument("--json", default=None, help="write the rows here instead of OUT/bench_engine.json")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    tuned_entries = tuple(e for e in args.tuned_entries.split(",") if e)
    bad = set(tuned_entries) - set(ENTRIES)
    if bad:
        raise SystemExit(f"unknown --tuned-entries {sorted(bad)}; choose from {ENTRIES}")
    global IMPL, FOLD
    IMPL = args.impl
    FOLD = args.fold
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} on {dev.device_kind}; default matmul precision "
          f"{jax.config.jax_default_matmul_precision}", flush=True)
    rows = []
    work = args.workloads.split(",")
    cat256 = distributions.Categorical(num_cats=256)
    B0 = min(batches)
    ref_opts = (jaxpc.Options(precision="fp32", backward="autodiff", fold_products=False) if args.check_autodiff
                else jaxpc.Options(precision="fp32", fold_products=args.fold, impl="xla"))

    def rel_check(c, x, kw):
        """The largest relative error (l2 norms) of the log-likelihoods and of each flows array of the call ``kw``
        on the first ``B0`` rows of ``x`` (the rest weighted 0) against the reference on those rows alone."""
        n = x.shape[0]
        fl_ref, ll_ref = c.flows(c.params, x[:B0], options=ref_opts, return_ll=True, validate=False)
        w = jnp.zeros((n,), jnp.float32).at[:B0].set(1.0)
        fl, ll = c.flows(c.params, x, ll_weights=w, return_ll=True, **kw)
        errs = [_rel(a, b) for a, b in zip(jax.tree_util.tree_leaves((ll[:B0], fl)),
                                           jax.tree_util.tree_leaves((ll_ref, fl_ref)))]
        return max(errs)

    def rel_check_jobs(c, data):
        """The reference executable at the smallest batch."""
        return [(lambda x: c.flows(c.params, x, options=ref_opts, validate=False), data[B0][0][:B0])]

    if "hmm" in work:
        L = args.latents or 1024
        T, V = (16, 256) if args.small else (64, 4096)

        def hmm_data(B, seed):
            return np.random.default_rng(seed).integers(0, V, (B, T)).astype(np.int32)

        def hmm_check(c, x, kw):
            """Relative error of the first 16 log-likelihoods of the call ``kw`` against float64 numpy."""
            trans = [ns for ns in c.nodes if ns.name.startswith("trans")][0]
            emit = [ns for ns in c.nodes if ns.name.startswith("emit")][0]
            a = np.asarray(c.get_node_params(c.params, trans), np.float64)
            b = np.asarray(c.get_node_params(c.params, emit), np.float64)
            g = np.asarray(c.get_node_params(c.params, c.root), np.float64)[0]
            ref = hmm_forward_np(a, b, g, np.asarray(x)[:16])
            return _rel(np.asarray(c.log_prob(c.params, x, **kw))[:16], ref)

        c, r = run(f"HMM-{L}", lambda: structures.HMM(T, L, V), hmm_data, batches, args.reps, hmm_check,
                   args.precision, tuned_entries, args.compile_threads)
        rows += r
        trans = [ns for ns in c.nodes if ns.name.startswith("trans")][0]
        emit = [ns for ns in c.nodes if ns.name.startswith("emit")][0]
        la = jnp.log(c.get_node_params(c.params, trans))
        lb = jnp.log(c.get_node_params(c.params, emit))
        lg = jnp.log(c.get_node_params(c.params, c.root))[0]
        vg = jax.jit(jax.value_and_grad(scan_hmm, argnums=(0, 1, 2)))
        fw = jax.jit(scan_hmm)
        for B in batches:
            xs = [jnp.asarray(hmm_data(B, s)) for s in range(4)]
            f = median_ms(lambda xb: fw(la, lb, lg, xb), xs, args.reps)
            g = median_ms(lambda xb: vg(la, lb, lg, xb), xs, args.reps)
            rows.append(dict(workload="scan-HMM", B=B, fwd_ms=f, flows_ms=g,
                             calls={"flows": "jax.jit(jax.value_and_grad(scan_hmm, argnums=(0, 1, 2))) at JAX's "
                                             "default precision"}))
            print(f"scan-HMM  B={B:4d} fwd {f:8.3f} ms | fwd+grad  {g:8.3f} ms", flush=True)

    if "hclt" in work or "pd" in work:
        imgs = blurred_noise_images(1_000 if args.small else 10_000)

        def img_data(B, seed):
            return imgs[np.random.default_rng(seed).integers(0, len(imgs), B)]

        if "hclt" in work:
            L = args.latents or 256
            rows += run(f"HCLT-{L}", lambda: structures.HCLT(imgs, L, input_dist=cat256), img_data, batches,
                        args.reps, rel_check, args.precision, tuned_entries, args.compile_threads, rel_check_jobs)[1]
        if "pd" in work:
            L = args.latents or 128
            rows += run(f"PD-{L}", lambda: structures.PD((28, 28), L, split_intervals=(4, 4), input_dist=cat256),
                        img_data, batches, args.reps, rel_check, args.precision, tuned_entries,
                        args.compile_threads, rel_check_jobs)[1]

    if args.json:
        save_rows(Path(args.json).parent, Path(args.json).name, rows)
    else:
        save_rows(args.out, "bench_engine.json", rows)
    return rows


if __name__ == "__main__":
    main()
