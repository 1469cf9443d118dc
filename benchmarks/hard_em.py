"""Hard EM's flow pass on the max-plus kernels or XLA's reductions, its first maximizers kept or searched again.

    python benchmarks/hard_em.py [--workloads hclt,pd,hmm] [--batches 128,512] [--reps 20] [--json out.json]
                                 [--variants default,kernels,xla,searched] [--reductions] [--pyjuice]

``c.flows(c.params, x, options=o)`` with ``o = Options(propagation="MPE")`` in up to four variants (``--variants``):
``default``, the options as they are (``Tuning.max_product_kernels=None``: Pallas's max-plus kernels where
:func:`jaxpc.engine.routing.max_product_auto` takes them, else XLA's reductions); ``kernels``, the kernels for every
layer that is not dense (``max_product_kernels=True``); ``xla``, XLA's reductions only (``False``), which keep each
parent's first maximizing child for the flow pass as the kernels do (``Options.kernel_shifts``); and ``searched``, XLA
with ``kernel_shifts=False``, where the flow pass searches each parent's terms again. On HCLT-256, PD-128 and HMM-1024
as ``profile_step.py`` builds them. Per workload and batch: each variant's first call (s), then the variants
alternated, median ms of synchronized calls, and whether their flows equal the first variant's (they must, bit for
bit: all pass each parent's flow to its first maximizer). ``--reductions``: instead, the max-product layer's
reductions alone on terms ``log w + x`` of ``[n, Kp, C*Kc, B]`` (never written out) at five shapes: the max
(``sum_layer.first_max``), the max with its first maximizers in one reduction (``sum_layer.max_and_first``, what the
flow pass's forward runs) and the max followed by the search for them (``sum_layer.first_maximizer``, what the flow
pass ran before), median ms. ``--pyjuice``: first, PyJuice 2.6.3's hard-EM flow pass on the same workloads and
batches in a child process, on its fastest path (``_pyjuice.MPE_CALL``: forward and backward with
``propagation_alg="MPE"``, CUDA graphs replayed), then jaxpc's rows with PyJuice's time beside them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _children  # noqa: E402
import jaxpc  # noqa: E402
from profile_step import build  # noqa: E402

sum_layer = importlib.import_module("jaxpc.ops.sum_layer")  # the module: jaxpc.ops exports its function

LATENTS = {"hclt": 256, "pd": 128, "hmm": 1024}
VARIANTS = {"default": jaxpc.Options(propagation="MPE"),
            "kernels": jaxpc.Options(propagation="MPE", tuning=jaxpc.Tuning(max_product_kernels=True)),
            "xla": jaxpc.Options(propagation="MPE", tuning=jaxpc.Tuning(max_product_kernels=False)),
            "searched": jaxpc.Options(propagation="MPE", kernel_shifts=False,
                                      tuning=jaxpc.Tuning(max_product_kernels=False))}


def run(workload: str, batches: list[int], reps: int, latents: int | None = None,
        variants: tuple = tuple(VARIANTS)) -> list[dict]:
    """The rows of one workload: per batch, each variant's first call and median ms, and whether they agree."""
    c, data = build(workload, latents or LATENTS[workload])
    rows = []
    for B in batches:
        xs = [jnp.asarray(data[i * B:(i + 1) * B]) for i in range(2)]
        row = {"workload": f"{workload}-{latents or LATENTS[workload]}", "batch": B}
        outs = {}
        for name, o in ((v, VARIANTS[v]) for v in variants):
            t = time.perf_counter()
            outs[name] = jax.block_until_ready(c.flows(c.params, xs[0], options=o))
            row[f"{name}_first_s"] = time.perf_counter() - t
            jax.block_until_ready(c.flows(c.params, xs[1], options=o))
            c.wait_compiled()
            outs[name] = jax.block_until_ready(c.flows(c.params, xs[0], options=o))
        row["equal"] = all(bool(np.array_equal(np.asarray(a), np.asarray(b)))
                           for name in variants[1:]
                           for a, b in zip(jax.tree_util.tree_leaves(outs[variants[0]]),
                                           jax.tree_util.tree_leaves(outs[name])))
        times = {name: [] for name in variants}
        for i in range(reps):
            for name, o in ((v, VARIANTS[v]) for v in variants):
                t = time.perf_counter()
                jax.block_until_ready(c.flows(c.params, xs[i % 2], options=o))
                times[name].append(time.perf_counter() - t)
        for name in variants:
            row[f"{name}_ms"] = 1e3 * float(np.median(times[name]))
        print(f"{row['workload']} B={B}: " + ", ".join(
            f"{name} {row[name + '_ms']:.2f} ms (first {row[name + '_first_s']:.1f} s)" for name in variants)
            + f"; flows equal: {row['equal']}", flush=True)
        rows.append(row)
    return rows


def pyjuice_rows(workload: str, batches: list[int], reps: int, latents: int | None) -> list[dict]:
    """PyJuice's rows of one workload (``_pyjuice.run_mpe_flows``), on the data ``side_by_side.py`` gives it."""
    import _pyjuice

    reason = _pyjuice.available()
    if reason is not None:
        print(f"pyjuice skipped: {reason}", flush=True)
        return [dict(system="pyjuice", workload=workload, error=reason)]
    from _data import blurred_noise_images

    images = None if workload == "hmm" else blurred_noise_images(10_000)
    rows = _pyjuice.run_mpe_flows(workload, batches, latents=latents or LATENTS[workload], reps=reps, images=images)
    for r in rows:
        print("pyjuice", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "calls"},
              flush=True)
    return rows


SHAPES = ((64, 256, 512, 512), (8, 256, 512, 512), (256, 32, 64, 512), (128, 256, 256, 128), (1, 1024, 1024, 512))


def reductions(reps: int) -> list[dict]:
    """Median ms of the three reductions at each of ``SHAPES`` (``n, Kp, C*Kc, B``), random terms."""
    def terms(x, lw):
        return sum_layer.max_product_terms(x, lw, False)

    def searched(x, lw):
        vp = sum_layer.first_max(terms(x, lw))
        return vp, sum_layer.first_maximizer(terms(x, lw), vp)

    fns = {"max": lambda x, lw: sum_layer.first_max(terms(x, lw)),
           "max_and_first": lambda x, lw: sum_layer.max_and_first(terms(x, lw)), "max_then_search": searched}
    rng = np.random.default_rng(0)
    rows = []
    for n, Kp, CK, B in SHAPES:
        x = jnp.asarray(rng.normal(size=(n, CK, B)).astype(np.float32))
        lw = jnp.asarray(rng.normal(size=(n, Kp, CK)).astype(np.float32))
        row, outs = {"shape": [n, Kp, CK, B]}, {}
        for name, f in fns.items():
            f = jax.jit(f)
            outs[name] = jax.block_until_ready(f(x, lw))
            ts = []
            for _ in range(reps):
                t = time.perf_counter()
                jax.block_until_ready(f(x, lw))
                ts.append(time.perf_counter() - t)
            row[f"{name}_ms"] = 1e3 * float(np.median(ts))
        row["equal"] = all(bool(np.array_equal(np.asarray(a), np.asarray(b)))
                           for a, b in zip(outs["max_and_first"], outs["max_then_search"]))
        print(f"[n, Kp, C*Kc, B] = {row['shape']}: max {row['max_ms']:.3f} ms, max and first "
              f"{row['max_and_first_ms']:.3f}, max then search {row['max_then_search_ms']:.3f}; equal: {row['equal']}",
              flush=True)
        rows.append(row)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="hclt,pd,hmm")
    p.add_argument("--batches", default="128,512")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--latents", type=int, default=None, help="every workload's latents (default: 256 / 128 / 1024)")
    p.add_argument("--json", default=None)
    p.add_argument("--reductions", action="store_true", help="time the max-product reductions alone instead")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--pyjuice", action="store_true", help="PyJuice's hard-EM flow pass beside (a child process)")
    p.add_argument("--child-timeout", type=float, default=400.0)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--rows-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        _children.append_rows(args.rows_file, pyjuice_rows(args.child, batches, args.reps, args.latents))
        return
    rows = []
    if args.reductions:
        rows = reductions(args.reps)
    else:
        pj = {}
        for w in args.workloads.split(",") if args.pyjuice else ():
            argv_child = ["--batches", args.batches, "--reps", str(args.reps)]
            argv_child += ["--latents", str(args.latents)] if args.latents else []
            got, err = _children.run(__file__, argv_child, w, f"pyjuice {w}", time.perf_counter() + 3600,
                                     args.child_timeout)
            rows += got + ([dict(system="pyjuice", workload=w, error=err)] if err else [])
            pj.update({(w, r["B"]): r.get("mpe_flows_ms") for r in got if "B" in r})
        for w in args.workloads.split(","):
            got = run(w, batches, args.reps, args.latents, tuple(args.variants.split(",")))
            for r in got:
                r["pyjuice_ms"] = pj.get((w, r["batch"]))
            rows += got
        if pj:
            print("\n| workload | B | jaxpc default, ms | PyJuice graphs, ms | PyJuice / jaxpc |\n"
                  "| --- | ---: | ---: | ---: | ---: |", flush=True)
            for r in rows:
                if r.get("pyjuice_ms") and "default_ms" in r:
                    print(f"| {r['workload']} | {r['batch']} | {r['default_ms']:.2f} | {r['pyjuice_ms']:.2f} | "
                          f"{r['pyjuice_ms'] / r['default_ms']:.2f}x |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(jax.devices()[0].device_kind), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
