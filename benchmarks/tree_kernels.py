"""Time the persistent tree kernels (``jaxpc.ops.triton_tree``, ``jaxpc.ops.pallas_tree``) alone on HCLT-256's tree
levels, and their barriers.

    python benchmarks/tree_kernels.py [--batch 16] [--routes triton,pallas] [--variants 16:8:8,32:8:8]
                                      [--programs 32,64,128] [--reps 50]
                                      [--warps N]

For each route and program count ``G``: the median milliseconds of its ``forward`` and ``backward`` (default
precision's route: local sums from the stored values, parameter flows in place, child flows stored) on the node buffer
of one forward, of both kernels with every level empty (the level table all zeros: the ``L`` grid-wide barriers and
what a program loads for a task it does not run), and with the levels of more than 8 blocks emptied. On a GPU only
(interpret mode elsewhere would time the interpreter).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import jaxpc  # noqa: E402
from jaxpc import distributions, structures  # noqa: E402
from jaxpc.ops import mosaic_tree, pallas_tree, triton_tree  # noqa: E402
from kernels_check import bench, piped  # noqa: E402


def main(argv=None) -> None:
    from _data import blurred_noise_images

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--programs", default="32,64,128")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--routes", default="triton,pallas", help="kernel modules: triton (jax-triton), pallas, mosaic "
                   "(clusters; forward only: each --splits value, against the level-by-level forward)")
    p.add_argument("--splits", default="auto,0", help="mosaic route: the level where the second launch starts "
                   "(auto: balanced; 0: one launch on one cluster)")
    p.add_argument("--profile", default="", help="mosaic route: record each variant's Mosaic GPU profile under "
                   "this folder and print its scopes' medians")
    p.add_argument("--exact-math", action="store_true", help="mosaic route: also time exact exp and log")
    p.add_argument("--tiles", default="64", help="mosaic route: parent rows a task (16, 32, 64)")
    p.add_argument("--clusters", type=int, default=mosaic_tree.CLUSTERS, help="mosaic route: clusters of the "
                   "first launch")
    p.add_argument("--variants", default="", help="triton route: task nodes:forward warps:backward warps, comma "
                   "separated (default: the module's)")
    p.add_argument("--warps", type=int, default=0, help="warps of the Pallas kernels' programs (default: the module's)")
    args = p.parse_args(argv)
    if args.warps:
        import dataclasses

        pallas_tree._FORWARD = dataclasses.replace(pallas_tree._FORWARD, num_warps=args.warps)
        pallas_tree._BACKWARD = dataclasses.replace(pallas_tree._BACKWARD, num_warps=args.warps)
    imgs = blurred_noise_images(2000)
    c = jaxpc.compile(structures.HCLT(imgs, 256, input_dist=distributions.Categorical(256)))
    fold, tree = c.layout.fold, c.layout.fold.tree
    tab = {k: jnp.asarray(v) for k, v in c.tables["fold"]["tree"].items()}
    empty = {**tab, "lev": jnp.zeros_like(tab["lev"])}
    widths = np.diff(np.asarray(tab["lev"]))
    narrow_w = np.where(widths <= 8, widths, 0)
    narrow = {**tab, "lev": jnp.asarray(np.concatenate([[0], np.cumsum(narrow_w)]).astype(np.int32))}
    logw = c.params["sum"][tree.group]
    x = jnp.asarray(imgs[:args.batch].astype(np.int32))
    args._x = x
    opts = jaxpc.Options()
    vals = jax.jit(lambda p: jaxpc.engine.stages.forward_buffer(
        fold, c.tables["fold"], p["sum"], jaxpc.engine.forward.input_values(c.layout, c.tables, p, x, None, opts),
        opts))(c.params)
    flows = jnp.zeros_like(vals).at[fold.root_row].set(1.0)
    dp = jnp.zeros_like(logw)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; HCLT-256 tree {tree.levels} levels, "
          f"{tree.blocks} blocks; B={args.batch}", flush=True)
    variants = [tuple(int(v) for v in spec.split(":")) for spec in filter(None, args.variants.split(","))]
    runs = [(route, v) for route in args.routes.split(",") for v in (variants if route == "triton" and variants
                                                                     else [None])]
    if "mosaic" in args.routes.split(","):
        mosaic(args, fold, c, tab, logw, vals)
    for route, variant in runs:
        if route == "mosaic":
            continue
        mod = {"triton": triton_tree, "pallas": pallas_tree}[route]
        if variant:
            triton_tree.TASK_NODES, triton_tree.FORWARD_WARPS, triton_tree.BACKWARD_WARPS = variant
        for G in (int(g) for g in args.programs.split(",")):
            fwd = jax.jit(lambda b, t, lw, G=G, mod=mod: mod.forward(b, t, lw, tree, "tf32", G=G))
            bwd = jax.jit(lambda v, f, d, t, lw, G=G, mod=mod: mod.backward(v, f, d, t, lw, tree, "tf32",
                                                                             2 * fold.kmax, True, G=G))
            ms = [bench(lambda: fwd(vals, tab, logw), args.reps),
                  bench(lambda: bwd(vals, flows, dp, tab, logw), args.reps),
                  bench(lambda: fwd(vals, empty, logw), args.reps),
                  bench(lambda: bwd(vals, flows, dp, empty, logw), args.reps),
                  bench(lambda: fwd(vals, narrow, logw), args.reps),
                  bench(lambda: bwd(vals, flows, dp, narrow, logw), args.reps)]
            name = route + (" task nodes {} warps {}/{}".format(*variant) if variant else "")
            print(f"{name} G={G}: forward {ms[0]:.3f} ms, backward {ms[1]:.3f} ms; barriers only ({tree.levels} "
                  f"levels): forward {ms[2]:.3f} ms, backward {ms[3]:.3f} ms; the {int((narrow_w > 0).sum())} levels "
                  f"of at most 8 blocks alone: forward {ms[4]:.3f} ms, backward {ms[5]:.3f} ms", flush=True)

def mosaic(args, fold, c, tab, logw, vals) -> None:
    """The forward on clusters against the default route's level-by-level forward (``forward_buffer`` from the
    input values: the tree levels and the root), and its largest difference from that forward's tree rows."""
    tree = fold.tree
    opts = jaxpc.Options()
    x = jnp.asarray(np.asarray(vals))  # the forward's buffer: the input rows are what both routes read
    level = jax.jit(lambda p, iv: jaxpc.engine.stages.forward_buffer(fold, c.tables["fold"], p["sum"], iv, opts))
    inputs = jax.jit(lambda p, xb: jaxpc.engine.forward.input_values(c.layout, c.tables, p, xb, None, opts))
    iv = inputs(c.params, jnp.asarray(args._x))
    def lv():
        return level(c.params, iv)

    print(f"level by level (forward_buffer): {bench(lv, args.reps):.3f} ms synchronized, {piped(lv, args.reps):.3f} "
          "pipelined", flush=True)
    rows = (np.asarray(tab["prow"])[:, None] + np.arange(tree.Kp)).ravel()
    start = x.at[rows].set(0.0)
    for split in args.splits.split(","):
        for tile in (int(t) for t in args.tiles.split(",")):
            mosaic_variant(args, tree, tab, logw, x, start, rows, split, tile)


def mosaic_variant(args, tree, tab, logw, x, start, rows, split, tile) -> None:
    host = {k: np.asarray(v) for k, v in tab.items()}
    tabs = jax.tree.map(jnp.asarray, mosaic_tree.schedule(host, tree, clusters=args.clusters, tile=tile,
                                                          split=None if split == "auto" else int(split)))
    fwd = jax.jit(lambda b, t, lw: mosaic_tree.forward(b, t, lw, tree, tile=tile))
    lin = jax.jit(lambda b, t, w: mosaic_tree.forward(b, t, None, tree, weights=w, tile=tile))
    w = mosaic_tree.tf32_weights(logw)
    out = np.asarray(lin(start, tabs, w))
    ref = np.asarray(x)[rows]
    err = float(np.max(np.abs(out[rows] - ref) / np.maximum(1.0, np.abs(ref))))
    print(f"mosaic split {split}, {tile} rows a task: launches {[tuple(t.shape[:3]) for t in tabs['tasks']]} "
          f"(clusters, blocks, steps); largest relative difference from the level-by-level rows {err:.2e}", flush=True)
    empty = {**tabs, "tasks": [jnp.full_like(t, -1) for t in tabs["tasks"]]}
    one = [{**empty, "tasks": [t if i == j else t[:, :, :1] for i, t in enumerate(empty["tasks"])]}
           for j in range(len(empty["tasks"]))]
    variants = [("log-weights", lambda: fwd(start, tabs, logw))] if tile == mosaic_tree.TILE else []
    variants += [("weights", lambda: lin(start, tabs, w)), ("no tasks (barriers, XLA's copies)",
                                                            lambda: lin(start, empty, w))]
    variants += [(f"no tasks, launch {j} alone has its steps", lambda e=e: lin(start, e, w)) for j, e in enumerate(one)]
    if args.exact_math:
        mosaic_tree.APPROX_MATH = False
        exact = jax.jit(lambda b, t, w: mosaic_tree.forward(b, t, None, tree, weights=w, tile=tile))
        jax.block_until_ready(exact(start, tabs, w))
        mosaic_tree.APPROX_MATH = True
        variants.append(("weights, exact exp and log", lambda: exact(start, tabs, w)))
    for name, fn in variants:
        print(f"  {name}: {bench(fn, args.reps):.3f} ms synchronized, {piped(fn, args.reps):.3f} pipelined",
              flush=True)
    if "btasks" in tabs and tile <= 32:
        mosaic_backward(args, tree, tab, logw, x, start, rows, tabs, w, tile)
    if args.profile:
        out_dir = Path(args.profile) / f"split{split}-tile{tile}"
        out_dir.mkdir(parents=True, exist_ok=True)
        mosaic_tree.PROFILE_DIR = str(out_dir)
        try:
            jax.block_until_ready(jax.jit(lambda b, t, w: mosaic_tree.forward(b, t, None, tree, weights=w, tile=tile))(
                start, tabs, w))
            jax.effects_barrier()
        finally:
            mosaic_tree.PROFILE_DIR = None
        for f in sorted(out_dir.glob("*.json")):
            print(f"  profile {f.name}: {profile_summary(f)}", flush=True)


def mosaic_backward(args, tree, tab, logw, x, start, rows, tabs, w, tile) -> None:
    """The backward on clusters from random flows of the tree's top blocks, against the persistent Pallas backward
    at fp32 (child flows recomputed exactly), and timed alone, with the forward that keeps its copies, and the
    transposed weights alone."""
    rng = np.random.default_rng(1)
    top_rows = rows.reshape(-1, tree.Kp)[np.asarray(tabs["top"])].ravel()
    flows = jnp.zeros_like(x).at[top_rows].set(
        jnp.asarray(rng.uniform(0.1, 1.0, (len(top_rows), x.shape[1])).astype(np.float32)))
    fwd = jax.jit(lambda b, t, w: mosaic_tree.forward(b, t, None, tree, weights=w, tile=tile, keep=True))
    bwd = jax.jit(lambda f, cp, t, wt: mosaic_tree.backward(f, cp, t, wt, tree, tile=tile))
    both = jax.jit(lambda b, f, t, w, wt: mosaic_tree.backward(
        f, mosaic_tree.forward(b, t, None, tree, weights=w, tile=tile, keep=True)[1], t, wt, tree, tile=tile))
    transpose = jax.jit(mosaic_tree.tf32_weights_t)
    copies_both = jax.jit(lambda lw: (mosaic_tree.tf32_weights(lw), mosaic_tree.tf32_weights_t(lw)))
    wt = transpose(logw)
    _, copies = fwd(start, tabs, w)
    mine = np.asarray(bwd(flows, copies, tabs, wt))
    first_row = 2 * max(tree.Kp, tree.Kc)
    ref = np.asarray(pallas_tree.backward(x, flows, None, tab, logw, tree, "fp32", first_row, overwrite=True)[0])
    nz = np.flatnonzero(np.abs(ref).sum(axis=1) + np.abs(mine).sum(axis=1))
    err = float(np.max(np.abs(mine[nz] - ref[nz]) / np.maximum(1e-3, np.abs(ref[nz]))))
    print(f"  backward: {len(nz)} flow rows, largest relative difference from the persistent Pallas backward at "
          f"fp32 {err:.2e}", flush=True)
    for name, fn in [("backward", lambda: bwd(flows, copies, tabs, wt)),
                     ("forward (copies kept) + backward", lambda: both(start, flows, tabs, w, wt)),
                     ("transposed weights (tf32_weights_t)", lambda: transpose(logw)),
                     ("both weight copies in one function", lambda: copies_both(logw))]:
        print(f"  {name}: {bench(fn, args.reps):.3f} ms synchronized, {piped(fn, args.reps):.3f} pipelined",
              flush=True)


def profile_summary(path) -> str:
    """Median microseconds of each named scope of a Mosaic GPU profile (per block and step), and of a block's step
    (from one cluster barrier's end to the next)."""
    import json
    from collections import defaultdict

    events = json.loads(Path(path).read_text())["traceEvents"]
    spans, open_, ends = defaultdict(list), {}, defaultdict(list)
    for e in events:
        key = (e["tid"], e["name"])
        if e["ph"] == "B":
            open_[key] = e["ts"]
        elif key in open_:
            spans[e["name"]].append(e["ts"] - open_.pop(key))
            if e["name"] == "cluster_barrier":
                ends[e["tid"]].append(e["ts"])
    steps = [b - a for t in ends.values() for a, b in zip(t, t[1:])]
    parts = ", ".join(f"{n} {np.median(v):.2f}" for n, v in sorted(spans.items()))
    return f"step {np.median(steps):.2f} us; per scope (us, median): {parts}"


if __name__ == "__main__":
    main()
