"""Time jaxpc's executables on the benchmark workloads (BENCHMARKS.md) on the current device.

    python benchmarks/bench_engine.py [--workloads hmm,hclt,pd] [--batches 16,128,512] [--reps 25]

For each workload it first checks the answer at the first and the last batch size (HMM: against a float64 numpy
forward algorithm; HCLT/PD: log-likelihoods and flows against float32 products), then
reports median milliseconds of ``log_prob`` (forward), ``flows`` (forward + flows) and
``em_step`` over rotating input batches, the flows executable's memory (XLA's memory analysis),
edges x samples per second, and compile seconds. The HMM row also times a plain ``lax.scan``
forward algorithm under ``jit(value_and_grad)`` (the 20-line baseline of BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jaxpc  # noqa: E402
from jaxpc import dists, structures  # noqa: E402
from _data import blurred_noise_images  # noqa: E402


IMPL = "auto"
FOLD = True  # Options.fold_products (--no-fold: False)


def median_ms(fn, batches, reps, warmup=5):
    for i in range(warmup):
        jax.block_until_ready(fn(batches[i % len(batches)]))
    times = []
    for i in range(reps):
        xb = batches[i % len(batches)]
        t = time.perf_counter()
        jax.block_until_ready(fn(xb))
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


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


def run(name, root_fn, data_fn, batches, reps, check, precision):
    t0 = time.perf_counter()
    root = root_fn()
    c = jaxpc.compile(root)
    t_compile = time.perf_counter() - t0
    sum_edges = sum(ns.num_edges for ns in c.nodes if ns.is_sum())
    rows = []
    for B in batches:
        xs = [jnp.asarray(data_fn(B, seed)) for seed in range(4)]
        # the answer at the smallest and the largest batch (the routes that depend on the batch, e.g. the leaf
        # kernels from B=64 on a GPU, are checked at both ends)
        err = check(c, xs[0]) if B in (batches[0], batches[-1]) else float("nan")
        opts = jaxpc.Options(precision=precision, impl=IMPL, fold_products=FOLD)
        t = time.perf_counter()
        jax.block_until_ready(c.log_prob(c.params, xs[0], options=opts, validate=False))
        t_fwd_compile = time.perf_counter() - t
        t = time.perf_counter()
        jax.block_until_ready(c.flows(c.params, xs[0], options=opts, validate=False))
        t_flows_compile = time.perf_counter() - t
        fwd = median_ms(lambda xb: c.log_prob(c.params, xb, options=opts, validate=False), xs, reps)
        flows = median_ms(lambda xb: c.flows(c.params, xb, options=opts, validate=False), xs, reps)
        em = median_ms(lambda xb: c.em_step(c.params, xb, step_size=0.1, pseudocount=0.1, options=opts,
                                            validate=False), xs, reps)
        mem = cached_mib(c, "flows")
        row = dict(workload=name, precision=precision, impl=IMPL, fold=FOLD, B=B, fwd_ms=fwd, flows_ms=flows, em_ms=em, mem_mib=mem,
                   gedges_per_s=sum_edges * B / (flows * 1e-3) / 1e9, rel_err=err,
                   jaxpc_compile_s=t_compile, xla_fwd_s=t_fwd_compile, xla_flows_s=t_flows_compile)
        rows.append(row)
        print(f"{name:9s} {precision} {IMPL[:3]} B={B:4d} fwd {fwd:8.3f} ms | fwd+flows {flows:8.3f} ms | em {em:8.3f} ms | "
              f"mem {mem:8.1f} MiB | {row['gedges_per_s']:7.1f} Gedge*sample/s | err {err:.1e} | "
              f"compile jaxpc {t_compile:.1f}s xla fwd {t_fwd_compile:.1f}s flows {t_flows_compile:.1f}s", flush=True)
    return c, rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workloads", default="hmm,hclt,pd")
    p.add_argument("--batches", default="16,128,512")
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "bf16"])
    p.add_argument("--impl", default="auto", choices=["auto", "reference", "pallas", "pallas_forward"])
    p.add_argument("--no-fold", dest="fold", action="store_false",
                   help="Options(fold_products=False): the full layout instead of the folded plan")
    p.add_argument("--check-autodiff", action="store_true",
                   help="check the flows against float32 autodiff through the full layout (slow to compile for PD)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    global IMPL, FOLD
    IMPL = args.impl
    FOLD = args.fold
    dev = jax.devices()[0]
    print(f"jax {jax.__version__} on {dev.device_kind}; default matmul precision "
          f"{jax.config.jax_default_matmul_precision}", flush=True)
    rows = []
    work = args.workloads.split(",")
    cat256 = dists.Categorical(num_cats=256)

    def rel_check(c, x):
        """The larger relative error of the log-likelihoods and of the flows (every array) against the same plan
        on the XLA path with float32 products (``--check-autodiff``: the flows by JAX's autodiff through the full layout's
        forward, another code path; its executable took over 5 minutes to compile for PD-128 on the H200)."""
        opts = jaxpc.Options(precision=args.precision, impl=IMPL, fold_products=args.fold)
        fl, lo = c.flows(c.params, x, options=opts, return_ll=True, validate=False)
        ref = (jaxpc.Options(precision="fp32", backward="autodiff", fold_products=False) if args.check_autodiff
               else jaxpc.Options(precision="fp32", fold_products=args.fold, impl="reference"))
        fl_ref, hi = c.flows(c.params, x, options=ref, return_ll=True, validate=False)
        errs = [np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64)) / np.linalg.norm(np.asarray(b))
                for a, b in zip(jax.tree_util.tree_leaves((lo, fl)), jax.tree_util.tree_leaves((hi, fl_ref)))]
        return float(max(errs))

    if "hmm" in work:
        L, T, V = 1024, 64, 4096

        def hmm_data(B, seed):
            return np.random.default_rng(seed).integers(0, V, (B, T)).astype(np.int32)

        def hmm_check(c, x):
            trans = [ns for ns in c.nodes if ns.name.startswith("trans")][0]
            emit = [ns for ns in c.nodes if ns.name.startswith("emit")][0]
            a = np.asarray(c.get_node_params(c.params, trans), np.float64)
            b = np.asarray(c.get_node_params(c.params, emit), np.float64)
            g = np.asarray(c.get_node_params(c.params, c.root), np.float64)[0]
            xn = np.asarray(x)[:16]
            ref = hmm_forward_np(a, b, g, xn)
            got = np.asarray(c.log_prob(c.params, x, options=jaxpc.Options(precision=args.precision),
                                        validate=False))[:16]
            return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))

        c, r = run("HMM-1024", lambda: structures.HMM(T, L, V), hmm_data, batches, args.reps, hmm_check,
                   args.precision)
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
            rows.append(dict(workload="scan-HMM", B=B, fwd_ms=f, flows_ms=g))
            print(f"scan-HMM  B={B:4d} fwd {f:8.3f} ms | fwd+grad  {g:8.3f} ms", flush=True)

    if "hclt" in work or "pd" in work:
        imgs = blurred_noise_images(10_000)

        def img_data(B, seed):
            return imgs[np.random.default_rng(seed).integers(0, len(imgs), B)]

        if "hclt" in work:
            rows += run("HCLT-256", lambda: structures.HCLT(imgs, 256, input_dist=cat256), img_data, batches,
                        args.reps, rel_check, args.precision)[1]
        if "pd" in work:
            rows += run("PD-128", lambda: structures.PD((28, 28), 128, split_intervals=(4, 4), input_dist=cat256),
                        img_data, batches, args.reps, rel_check, args.precision)[1]

    save_rows(args.out, "bench_engine.json", rows)
    return rows


if __name__ == "__main__":
    main()
