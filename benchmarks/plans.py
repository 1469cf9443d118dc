"""Time jaxpc's evaluation plans of one circuit side by side, each checked against the layer path.

    python benchmarks/plans.py [--workloads hclt,pd] [--batches 16,512] [--plans layers,fold,fused]
                               [--latents hclt=256,pd=128] [--precision tf32] [--reps 25] [--memory]
                               [--same-batch]

Plans (all ``backward="flows"``):

* ``layers``: the full layout, XLA sum layers (``Options(fold_products=False, impl="xla")``);
* ``fold``: the folded plan, ``impl="auto"`` (``Options()``, the default: on a GPU the Pallas forward for
  partitions with several child blocks per parent block, XLA elsewhere);
* ``xla``: the folded plan, XLA sum layers everywhere (``Options(impl="xla")``);
* ``fused``: the folded plan with the Pallas kernels writing the node and flow buffers in place
  (``Options(fold_products=True, impl="pallas")``): one kernel per sum level forward, three backward
  (a tree level's child flows computed once per parent and written to each row block of its child);
* ``fusedfwd``: the folded plan with the in-place Pallas forward kernels and the XLA backward
  (``Options(fold_products=True, impl="pallas_forward")``);
* ``pallas``: the full layout with the Pallas kernels (``Options(impl="pallas", fold_products=False)``);
* ``<plan>-noleaf``: any of these with the node buffer's leaves from XLA's gather and concatenation instead
  of the leaf kernel (``Options(leaf_kernel=False)``);
* ``<plan>-deftiles``: any of these with every Pallas partition on ``KernelConfig()``'s tiles (through
  ``Options.kernels``) instead of ``pallas_sum.forward_config``'s smaller tiles for small grids;
* ``<plan>-unrolled``: any of these with the repeated stages unrolled (``Options(scan_stages=False)``);
* ``<plan>-noshifts``: any of these with the flow pass recomputing the blocks' shifts instead of reading
  those the in-place forward kernels kept (``Options(kernel_shifts=False)``; e.g. ``fold-noshifts`` against
  ``fold``);
* ``<plan>-adds``: any of these on a tree (``Layout.single_reader``, e.g. HCLT) with the flow pass's XLA scatters
  adding the child flows into the flow buffer instead of writing them (a copy of the circuit whose layouts claim
  no single reader);
* ``<plan>-zeros``: any of these with the rows that are written before they are read zeroed first, as before
  ``Options(tuning=Tuning(unset_rows=False))`` (the flow buffer of a single-reader layout, the leaf kernel's rows above
  the leaves);
* ``<plan>-inline`` / ``<plan>-batched``: the parameter flows computed level by level with the element flows, or
  after them in one batched product per block shape (``Options(param_flow_pass=...)``; the default, ``auto``,
  batches at batches of at most ``Options().tuning.pflow_batch``).

One circuit per workload, the same input batches for every plan. Per (plan, batch): compile seconds of the
flows executable, the relative error of log-likelihoods and of every flow array against the first plan
listed (e.g. ``layers``) at the same precision, and median milliseconds of ``flows`` (forward + flows; each call
synchronized, and ``pipelined``: calls dispatched back to back, synchronized once, as in a training loop) and
``log_prob`` (4 rotating input batches; ``--same-batch``: one, as a CUDA-graph replay's static inputs); with
``--memory`` also XLA's memory analysis of the flows executable. Rows go to
``$OUT/plans.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jaxpc  # noqa: E402
from _data import blurred_noise_images  # noqa: E402
from bench_engine import cached_mib, median_ms, save_rows  # noqa: E402
from jaxpc import distributions, structures  # noqa: E402
from jaxpc.engine import routing  # noqa: E402

PLANS = {"layers": {"fold_products": False, "impl": "xla"}, "fold": {"fold_products": True},
         "xla": {"fold_products": True, "impl": "xla"},
         "fused": {"fold_products": True, "impl": "pallas"},
         "fusedfwd": {"fold_products": True, "impl": "pallas_forward"},
         "pallas": {"impl": "pallas", "fold_products": False}}
PLANS.update({f"{k}-noleaf": {**v, "leaf_kernel": False} for k, v in list(PLANS.items())})
PLANS.update({f"{k}-deftiles": {**v, "deftiles": True} for k, v in list(PLANS.items())})
PLANS.update({f"{k}-unrolled": {**v, "scan_stages": False} for k, v in list(PLANS.items())})
PLANS.update({f"{k}-noshifts": {**v, "kernel_shifts": False} for k, v in list(PLANS.items())})
PLANS.update({f"{k}-adds": {**v, "adds": True} for k, v in list(PLANS.items())})
PLANS.update({f"{k}-zeros": {**v, "zeros": True} for k, v in list(PLANS.items())})
PLANS.update({f"{k}-{m}": {**v, "param_flow_pass": m} for k, v in list(PLANS.items()) for m in ("inline", "batched")})


def options(c, B: int, plan: dict, precision: str) -> jaxpc.Options:
    """The plan's options at batch ``B``; ``deftiles``: each Pallas partition named in ``kernels`` with the default
    tiles."""
    deftiles = plan.pop("deftiles", False)
    opts = jaxpc.Options(precision=precision, **plan)
    if not deftiles:
        return opts
    from jaxpc.ops import pallas_sum

    layout = routing.buffer_plan(c.layout, opts, B)
    d = pallas_sum.KernelConfig()
    kernels = []
    for spec in layout.stages():
        for part in spec.sums:
            impl = routing.kernel_choice(opts, part, B)[0]
            if impl != "xla":
                kernels.append((routing.partition_key(part, B), (impl, d.block_b, d.block_k, d.num_warps)))
    return opts.replace(kernels=tuple(dict(kernels).items()))


def fresh(c, adds: bool = False):
    """A copy of circuit ``c`` with its own executables; ``adds``: whose layouts (full and folded) claim no single
    reader."""
    import copy
    import dataclasses
    import functools

    from jaxpc.circuit import _ENTRIES
    from jaxpc.runtime import Entry, Runtime

    out = copy.copy(c)
    if adds:
        fold = c.layout.fold and dataclasses.replace(c.layout.fold, single_reader=False)
        out.layout = dataclasses.replace(c.layout, single_reader=False, fold=fold)
    out.runtime = Runtime(c.runtime.var_info, c.dtype)
    for name, (fn, rows) in _ENTRIES.items():
        out.runtime.register(name, Entry(functools.partial(fn, out.layout), rows))
    return out


def build(workload: str, latents: int, imgs):
    cat = distributions.Categorical(num_cats=256)
    if workload == "hclt":
        return structures.HCLT(imgs, latents, input_dist=cat)
    if workload == "pd":
        return structures.PD((28, 28), latents, split_intervals=(4, 4), input_dist=cat)
    raise ValueError(f"unknown workload {workload!r} (hclt, pd)")


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="hclt,pd")
    p.add_argument("--batches", default="16,512")
    p.add_argument("--plans", default="layers,fold,fused")
    p.add_argument("--latents", default="hclt=256,pd=128")
    p.add_argument("--precision", default="tf32", choices=["fp32", "tf32", "bf16"])
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--memory", action="store_true")
    p.add_argument("--no-pack", action="store_true", help="executables take the index tables unpacked")
    p.add_argument("--same-batch", action="store_true",
                   help="time every call on the same input array (a CUDA-graph replay's static inputs) instead of 4")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    latents = dict(kv.split("=") for kv in args.latents.split(","))
    jaxpc.executables.PACK_TABLES = not args.no_pack
    plans = args.plans.split(",")
    for name in plans:
        if name not in PLANS:
            raise SystemExit(f"unknown plan {name!r}; plans: {sorted(PLANS)}")
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    t = time.perf_counter()
    imgs = blurred_noise_images(10_000)
    print(f"images {time.perf_counter() - t:.1f}s", flush=True)
    rows = []
    for w in args.workloads.split(","):
        t = time.perf_counter()
        c = circuit = jaxpc.compile(build(w, int(latents[w]), imgs))
        fold = c.layout.fold
        print(f"{w}-{latents[w]}: built and compiled in {time.perf_counter() - t:.1f}s; rows {c.layout.num_rows} "
              f"({len(list(c.layout.stages()))} stages), folded {fold.num_rows if fold else '-'} "
              f"({len(list(fold.stages())) if fold else '-'} stages)", flush=True)
        for B in [int(b) for b in args.batches.split(",")]:
            xs = [jnp.asarray(imgs[np.random.default_rng(s).integers(0, len(imgs), B)]) for s in range(4)]
            base, base_name = None, "-"
            for name in plans:
                plan = dict(PLANS[name])
                adds, zeros = plan.pop("adds", False), plan.pop("zeros", False)
                c = fresh(circuit, adds) if adds or zeros else circuit
                opts = options(c, B, plan, args.precision)
                opts = opts.replace(tuning=jaxpc.Tuning(unset_rows=not zeros))
                try:
                    t = time.perf_counter()
                    got = jax.block_until_ready(c.flows(c.params, xs[0], options=opts, return_ll=True, validate=False))
                    t_compile = time.perf_counter() - t
                    c.wait_compiled()  # time the optimized executable (Tuning.quick_first_compile)
                    if base is None:  # the answers are checked against the first plan's
                        base, base_name = got, name
                    errs = (rel(got[1], base[1]), max(rel(a, b) for a, b in zip(jax.tree_util.tree_leaves(got[0]),
                                                                               jax.tree_util.tree_leaves(base[0])))
                            ) if base is not None else (float("nan"), float("nan"))
                    xt = xs[:1] if args.same_batch else xs
                    flows = median_ms(lambda xb: c.flows(c.params, xb, options=opts, validate=False), xt, args.reps)
                    t = time.perf_counter()  # steps dispatched back to back, synchronized once: host and device overlap
                    for i in range(args.reps):
                        out = c.flows(c.params, xt[i % len(xt)], options=opts, validate=False)
                    jax.block_until_ready(out)
                    pipelined = 1e3 * (time.perf_counter() - t) / args.reps
                    fwd = median_ms(lambda xb: c.log_prob(c.params, xb, options=opts, validate=False), xt, args.reps)
                    mem = float("nan")
                    if args.memory:
                        mem = cached_mib(c, "flows")
                except Exception as e:  # noqa: BLE001 - one failing plan is reported, the others still run
                    print(f"{w} B={B} {name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
                    continue
                row = dict(workload=f"{w}-{latents[w]}", B=B, plan=name, precision=args.precision, fwd_ms=fwd,
                           flows_ms=flows, flows_pipelined_ms=pipelined, mem_mib=mem, compile_s=t_compile,
                           ll_err=errs[0], flow_err=errs[1])
                rows.append(row)
                print(f"{w}-{latents[w]} B={B:4d} {name:7s} fwd {fwd:7.3f} ms | fwd+flows {flows:7.3f} ms "
                      f"(pipelined {pipelined:6.3f}) | mem {mem:7.1f} MiB | compile {t_compile:5.1f}s "
                      f"| vs {base_name}: ll {errs[0]:.1e} flows {errs[1]:.1e}",
                      flush=True)
    save_rows(args.out, "plans.json", rows)
    return rows


if __name__ == "__main__":
    main()
