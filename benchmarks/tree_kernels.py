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
from jaxpc.ops import pallas_tree, triton_tree  # noqa: E402
from kernels_check import bench  # noqa: E402


def main(argv=None) -> None:
    from _data import blurred_noise_images

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--programs", default="32,64,128")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--routes", default="triton,pallas", help="kernel modules: triton (jax-triton), pallas")
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
    for route, variant in runs:
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

if __name__ == "__main__":
    main()
