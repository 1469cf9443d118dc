"""Steps and compile seconds of one workload's flows (or ``--entry``'s) executable compiled each way: the
scanned or the unrolled stages, with or without XLA's Triton GEMM fusions and their autotuning. Tells whether the
optimized compile that the default call swaps in (``Tuning.quick_first_compile``, ``Tuning.unroll_optimized``) is
faster than the quick one it replaces, per batch size.

    python benchmarks/compile_variants.py [--workload hclt] [--entry flows] [--batches 128,512] [--reps 30]
                                          [--variants default,quick,scanned,unrolled,unrolled-notg,unrolled-quick]
                                          [--tunings xla.xla_gpu_enable_cublaslt=true,leaf_batch=0] [--paired]
                                          [--tree-images 10000]

Variants (``c.flows(params, x, options=...)``, or ``--entry``'s call: ``log_prob``, ``em_step_mpe`` (hard EM,
``c.em_step(params, x, step_size=0.1, pseudocount=0.1, options=Options(propagation="MPE", ...))``), and ``mpe``,
``sample``, ``conditional`` with a third of the variables unobserved; each its own executable, compiled one after
the other):

* ``default``: ``Options()`` (``--entry em_step_mpe``: ``Options(propagation="MPE")``), the default call, timed
  after ``c.wait_compiled()`` (the optimized executable);
* ``quick``: the scanned stages without Triton GEMM fusions at autotune level 0 (the default call's quick
  executable: ``Tuning(compiler_options=QUICK_XLA, quick_first_compile=False)``);
* ``scanned``: the scanned stages with XLA's default options (``Tuning(quick_first_compile=False)``);
* ``unrolled``: the unrolled stages with XLA's default options (the default call's optimized executable);
* ``unrolled-notg``: the unrolled stages without Triton GEMM fusions (autotuning on);
* ``unrolled-quick``: the unrolled stages with the quick executable's XLA options;
* ``general-ll-0.5``, ``general-ll-2``, ``tempered-0.5``: ``Options(propagation="GeneralLL", alpha=...)`` and
  ``Options(pflow_temperature=0.5)``, compiled as the default call is; exponents above 1 (and temperatures below 1)
  run the exact path that shifts each parent's terms, exponents up to 1 the factored products;
* each of ``--tunings`` (``field=value`` pairs of :class:`jaxpc.Tuning` joined by ``+``, ``xla.<option>=<value>``
  for an XLA option): ``Options(tuning=Tuning(...))``, compiled as the default call is (quick, then optimized),
  timed after ``c.wait_compiled()``.

The circuits are the side-by-side benchmark's (HCLT-256 learned from ``--tree-images`` noisy images, batches drawn
from them; PD-128). Per variant and batch: the first call's seconds (trace, lower, compile, run), the median ms of
synchronized calls over 4 rotating device-resident batches, XLA's memory analysis of the executable timed (MiB:
temporaries, arguments and outputs), and the largest relative difference of its log-likelihoods and flows
from the first variant's. One JSON line per variant and batch. ``--paired``: then, per batch, every variant's median ms
over ``--reps`` rounds that call the variants one after the other (``bench_engine.paired_ms``: the same clocks and
host state for all, which the variants timed one after the other do not share), and each one's ratio to the first
variant's, in one more JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jaxpc  # noqa: E402
from _data import blurred_noise_images  # noqa: E402
from _options import query_calls, tuning  # noqa: E402
from bench_engine import compiled_mib, median_ms, paired_ms  # noqa: E402
from jaxpc import distributions, executables, structures  # noqa: E402

NO_TG = (("xla_gpu_enable_triton_gemm", False),)


SHARP = {"general-ll-0.5": {"propagation": "GeneralLL", "alpha": 0.5},
         "general-ll-2": {"propagation": "GeneralLL", "alpha": 2.0},
         "tempered-0.5": {"pflow_temperature": 0.5}}


def variant_options(name: str):
    """``jaxpc.Options`` of a variant (None: the default call)."""
    T = jaxpc.Tuning
    table = {
        "default": None,
        "quick": jaxpc.Options(tuning=T(compiler_options=executables.QUICK_XLA, quick_first_compile=False)),
        "scanned": jaxpc.Options(tuning=T(quick_first_compile=False)),
        "unrolled": jaxpc.Options(scan_stages=False, tuning=T(quick_first_compile=False)),
        "unrolled-notg": jaxpc.Options(scan_stages=False, tuning=T(compiler_options=NO_TG, quick_first_compile=False)),
        "unrolled-quick": jaxpc.Options(scan_stages=False, tuning=T(compiler_options=executables.QUICK_XLA,
                                                                    quick_first_compile=False)),
        # the sharp exponents and tempered flows, compiled as the default call is: GeneralLL with alpha above 1 and
        # pflow_temperature below 1 run the exact per-parent-shift path, alpha up to 1 the factored products
        **{name: jaxpc.Options(**kw) for name, kw in SHARP.items()},
    }
    if name not in table:
        raise SystemExit(f"unknown variant {name!r}; choose from {', '.join(table)}")
    return table[name]


ENTRIES = {  # the public call timed: (the executable's entry for ``c.compiled``, the variants' base options)
    "flows": ("flows", {}), "log_prob": ("log_prob", {}), "em_step_mpe": ("em_step", {"propagation": "MPE"}),
    "mpe": ("mpe", {}), "sample": ("sample", {}), "conditional": ("conditional", {})}


def entry_call(c, name: str):
    """``call(x, kw)`` of the public call ``name`` on ``c.params`` (``kw``: its ``options``). ``em_step_mpe``: hard EM,
    ``c.em_step(params, x, step_size=0.1, pseudocount=0.1, options=Options(propagation="MPE"))``; the queries as
    ``_options.query_calls`` makes them (a third of the variables unobserved)."""
    if name in ("flows", "log_prob"):
        return lambda x, kw: getattr(c, name)(c.params, x, **kw)
    if name == "em_step_mpe":
        return lambda x, kw: c.em_step(c.params, x, step_size=0.1, pseudocount=0.1, **kw)
    import jax.numpy as jnp
    made: dict = {}  # per options, the calls (their mask moved to the device once)

    def call(x, kw):
        key = kw.get("options")
        if key not in made:
            made[key] = query_calls(c, jnp.asarray, **kw)
        return made[key][name](x)
    return call


def with_base(options, base: dict):
    """``options`` (None: the default call) with the entry's base fields set."""
    if not base:
        return options
    return dataclasses.replace(options or jaxpc.Options(), **base)


def rel_diff(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ok = np.isfinite(a) & np.isfinite(b)
    return float(np.max(np.abs(a[ok] - b[ok]) / (np.abs(b[ok]) + 1e-6))) if ok.any() else 0.0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="hclt", choices=["hclt", "pd"])
    p.add_argument("--entry", default="flows", choices=list(ENTRIES), help="the public call timed")
    p.add_argument("--batches", default="128,512")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--variants", default="default,quick,scanned,unrolled,unrolled-notg,unrolled-quick")
    p.add_argument("--tunings", default="", help="more variants: Tuning fields a=1+xla.b=true,c=2")
    p.add_argument("--tree-images", type=int, default=10_000,
                   help="images the HCLT is learned from and batches are drawn from (side_by_side.py's 10,000)")
    p.add_argument("--paired", action="store_true", help="then time the variants alternately (paired_ms)")
    args = p.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    opts = {n: variant_options(n) for n in names}
    for spec in filter(None, args.tunings.split(",")):
        names.append(spec)
        opts[spec] = jaxpc.Options(tuning=tuning(spec))
    imgs = blurred_noise_images(args.tree_images)
    cat = distributions.Categorical(256)
    root = (structures.PD((28, 28), 128, split_intervals=(4, 4), input_dist=cat) if args.workload == "pd"
            else structures.HCLT(imgs, 256, input_dist=cat))
    c = jaxpc.compile(root)
    exe_name, base = ENTRIES[args.entry]
    entry = entry_call(c, args.entry)
    opts = {n: with_base(o, base) for n, o in opts.items()}
    for B in (int(b) for b in args.batches.split(",")):
        xs = [jax.device_put(imgs[np.random.default_rng(i).integers(0, len(imgs), B)]) for i in range(4)]
        ref, calls = None, []
        for n in names:
            kw = {} if opts[n] is None else {"options": opts[n]}

            def call(x, kw=kw):
                return entry(x, kw)
            t = time.perf_counter()
            out = jax.block_until_ready(call(xs[0]))
            first = time.perf_counter() - t
            if n == "default" or n in SHARP or n in args.tunings.split(","):  # compiled as the default call is
                c.wait_compiled()
                out = jax.block_until_ready(call(xs[0]))
            leaves = [np.asarray(v) for v in jax.tree_util.tree_leaves(out)]
            diff = 0.0 if ref is None else max(rel_diff(a, b) for a, b in zip(leaves, ref))
            ref = leaves if ref is None else ref
            ms = round(median_ms(call, xs, args.reps, warmup_s=1.0), 3)
            calls.append(call)
            print(json.dumps(dict(workload=args.workload, entry=args.entry, batch=B, variant=n,
                                  first_call_s=round(first, 2), ms=ms,
                                  mib=round(compiled_mib(c.compiled(exe_name)), 1),
                                  rel_diff_vs_first=float(f"{diff:.2e}"), device=jax.devices()[0].device_kind)),
                  flush=True)
        if args.paired:
            ms = paired_ms(calls, xs, args.reps, warmup_s=1.0)
            print(json.dumps(dict(workload=args.workload, batch=B,
                                  paired_ms={n: round(m, 3) for n, m in zip(names, ms)},
                                  ratio_to_first={n: round(m / ms[0], 3) for n, m in zip(names, ms)},
                                  device=jax.devices()[0].device_kind)), flush=True)


if __name__ == "__main__":
    main()
