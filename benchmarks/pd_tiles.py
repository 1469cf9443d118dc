"""PD's fan-in kernels at training batches: the whole step with every fan-in partition's kernel tiles set through
``Options.kernels``, against the default tiles, each variant's flows checked against the default's.

    python benchmarks/pd_tiles.py [--latents 256] [--split-intervals 2,7] [--batch 1024] [--reps 10]
                                  [--configs 64:64:4,64:64:8,128:64:8] [--entry em_step]
                                  [--tunings fanin_group_batch=0,fanin_prefetch=0+fanin_order_batch=1024]
                                  [--options fold_products=0+tuning.product_kernel_batch=0] [--no-atomics]
                                  [--own-tables] [--no-weight-exp]

A configuration ``bb:bk:warps`` sets ``KernelConfig(block_b=bb, block_k=bk, num_warps=warps)`` for the Pallas
forward of every partition whose blocks have several child blocks (``impl="auto"``'s fan-in route) and for its
one-kernel atomic backward: ``bb`` the batch tile both loop over, ``bk`` the forward's parent-node tile and the
backward's child-node tile. A tuning ``field=value`` (several joined by ``+``) is a variant with those
:class:`jaxpc.Tuning` fields set (e.g. the kernels' launch orders); an option ``field=value`` (several joined by ``+``)
a variant with those :class:`jaxpc.Options` fields (ints; ``fold_products=0``: the full layout, each product's values
written once to the node buffer and read from there by its parents, instead of the folded plan's sums of the
products' child rows in every read). Prints one line per variant: median ms of
``--entry`` (``em_step`` or ``flows``) at ``--batch``, and the largest relative difference of its parameter flows
from the default's. ``--no-atomics`` (a diagnostic: its flows are wrong) adds the default with the atomic
backward's adds made plain stores, which tells what the atomic adds cost. ``--own-tables`` adds the default on each
partition's own tables instead of its fan-in class's padded ones (``jaxpc.compiler.compile.shared_kernel_tables``):
what the padding's idle programs cost, against one kernel per partition shape. ``--no-weight-exp`` (a diagnostic:
wrong values) adds the default with the kernels' weight tiles used as loaded, without ``exp(alpha * log w)``: what
exponentiating each weight tile in every program costs, against weights made linear once per step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jaxpc  # noqa: E402
from _data import blurred_noise_images  # noqa: E402
from _options import options, tuning  # noqa: E402
from jaxpc import autotune, distributions, structures  # noqa: E402
from jaxpc.engine import routing  # noqa: E402


def fanin_keys(circuit, B: int) -> list[tuple]:
    """``Options.kernels`` keys of the folded plan's partitions that ``impl="auto"`` runs on the fan-in route."""
    plan, tables = circuit.layout.fold, circuit.tables["fold"]
    keys = []
    for part, _, _ in autotune._sum_partitions(plan, tables):
        if not part.dense and part.C > 1:
            key = routing.partition_key(part, B)
            if key not in keys:
                keys.append(key)
    return keys


def own_tables(tables: dict) -> dict:
    """``tables`` without the fan-in classes' padded tables (``kch``, ``kpid``, ``keorder``)."""
    def strip(t):
        if isinstance(t, dict):
            return {k: strip(v) for k, v in t.items() if k not in ("kch", "kpid", "keorder")}
        if isinstance(t, list):
            return [strip(v) for v in t]
        return t
    return strip(tables)


def measure(c, xs: list, opts, entry: str, reps: int, ref: list | None) -> tuple:
    """``(median s, min s, parameter flows' largest relative difference from ref, first flows call s, flows)``:
    one ``flows`` call (compiling, its leaves against ``ref``; 0 where None), then ``entry`` (``em_step`` or
    ``flows``) warmed once and timed ``reps`` times over the batches ``xs``."""
    t = time.perf_counter()
    pf = c.flows(c.params, xs[0], options=opts)
    jax.block_until_ready(pf)
    c.wait_compiled()
    first = time.perf_counter() - t
    leaves = [np.asarray(a, np.float64) for a in jax.tree_util.tree_leaves(pf)]
    err = 0.0 if ref is None else max(float(np.max(np.abs(a - r)) / max(np.max(np.abs(r)), 1e-30))
                                      for a, r in zip(leaves, ref))
    fn = getattr(c, entry)
    kw = dict(step_size=0.1, pseudocount=0.1) if entry == "em_step" else {}
    jax.block_until_ready(fn(c.params, xs[0], options=opts, **kw))
    ts = []
    for i in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(c.params, xs[i % len(xs)], options=opts, **kw))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)), float(np.min(ts)), err, first, leaves


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--latents", type=int, default=256)
    p.add_argument("--split-intervals", default="2,7")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--configs", default="64:64:4,64:64:8,128:64:8,32:32:4")
    p.add_argument("--tunings", default="", help="variants of jaxpc.Tuning fields: a=1+b=0,c=2")
    p.add_argument("--options", default="", help="variants of jaxpc.Options fields (ints): a=0+b=1,c=2")
    p.add_argument("--entry", default="em_step", choices=["em_step", "flows"])
    p.add_argument("--no-atomics", action="store_true",
                   help="diagnostic: also the default with the atomic backward's adds as plain stores (wrong flows)")
    p.add_argument("--own-tables", action="store_true",
                   help="also the default on each partition's own tables (no kernels shared by a fan-in class)")
    p.add_argument("--no-weight-exp", action="store_true",
                   help="diagnostic: also the default with the kernels' weight tiles not exponentiated (wrong values)")
    args = p.parse_args(argv)
    B = args.batch
    split = tuple(int(s) for s in args.split_intervals.split(","))
    cat = distributions.Categorical(num_cats=256)
    t = time.perf_counter()
    c = jaxpc.compile(structures.PD((28, 28), args.latents, split_intervals=split, input_dist=cat))
    print(f"PD-{args.latents} {split}: built and compiled in {time.perf_counter() - t:.1f} s", flush=True)
    imgs = blurred_noise_images(4 * B)
    xs = [jax.device_put(imgs[i * B:(i + 1) * B]) for i in range(4)]
    keys = fanin_keys(c, B)
    print(f"{len(keys)} fan-in partitions: " + ", ".join(f"n={k[0]} C={k[1]} Kp={k[2]} Kc={k[3]}" for k in keys),
          flush=True)
    variants = {"default": jaxpc.Options()}
    for cfg in filter(None, args.configs.split(",")):
        variants[cfg] = jaxpc.Options(kernels=tuple((k, ("pallas_forward", *(int(v) for v in cfg.split(":"))))
                                                    for k in keys))
    for spec in filter(None, args.tunings.split(",")):
        variants[spec] = jaxpc.Options(tuning=tuning(spec))
    for spec in filter(None, args.options.split(",")):
        variants[spec] = options(spec)
    if args.no_atomics:  # a distinct Options value, so that its executable is compiled after the patch
        variants["no-atomics"] = jaxpc.Options(tuning=jaxpc.Tuning(leaf_batch=jaxpc.Tuning().leaf_batch + 1))
    if args.own_tables:
        variants["own-tables"] = jaxpc.Options()
    if args.no_weight_exp:  # last: the patch stays for the variants after it
        variants["no-weight-exp"] = jaxpc.Options(tuning=jaxpc.Tuning(leaf_batch=jaxpc.Tuning().leaf_batch + 2))
    shared = c.tables
    ref = None
    for name, opts in variants.items():
        c.tables = own_tables(shared) if name == "own-tables" else shared
        if name == "no-atomics":
            from jaxpc.ops import pallas_sum
            pallas_sum.add_tile = lambda ref, rows, cols, val, rmask, cmask: pallas_sum.store_tile(
                ref, rows, cols, val, rmask, cmask)
            pallas_sum._KERNELS.clear()
        if name == "no-weight-exp":
            from jaxpc.ops import pallas_sum
            from weight_exp import plain_load_w

            pallas_sum._load_w = plain_load_w
            pallas_sum._KERNELS.clear()
        try:
            med, low, err, first, leaves = measure(c, xs, opts, args.entry, args.reps, ref)
            ref = leaves if ref is None else ref
            print(f"{name:20s} {args.entry} B={B}: {1e3 * med:8.2f} ms (min {1e3 * low:.2f}), "
                  f"param flows max rel diff {err:.1e}, first call {first:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - a variant that does not compile or run is reported, not fatal
            print(f"{name:10s} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        jax.clear_caches()


if __name__ == "__main__":
    main()
