"""Time the persistent tree kernels (``jaxpc.ops.pallas_tree``) alone on HCLT-256's tree levels, and their barriers.

    python benchmarks/tree_kernels.py [--batch 16] [--programs 32,64,128] [--reps 50] [--warps N]

For each program count ``G``: the median milliseconds of ``pallas_tree.forward`` and ``pallas_tree.backward`` (default
precision's route: local sums from the stored values, parameter flows in place, child flows stored) on the node buffer
of one forward, and of both kernels with every level empty (the level table all zeros: the ``L`` grid-wide barriers
and nothing else). On a GPU only (interpret mode elsewhere would time the interpreter).
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
from jaxpc.ops import pallas_tree  # noqa: E402
from kernels_check import bench  # noqa: E402


def main(argv=None) -> None:
    from _data import blurred_noise_images

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--programs", default="32,64,128")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--warps", type=int, default=0, help="warps of both kernels' programs (default: the module's)")
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
    for G in (int(g) for g in args.programs.split(",")):
        fwd = jax.jit(lambda b, t, lw, G=G: pallas_tree.forward(b, t, lw, tree, "tf32", G=G))
        bwd = jax.jit(lambda v, f, d, t, lw, G=G: pallas_tree.backward(v, f, d, t, lw, tree, "tf32", 2 * fold.kmax,
                                                                        True, G=G))
        ms = [bench(lambda: fwd(vals, tab, logw), args.reps), bench(lambda: bwd(vals, flows, dp, tab, logw), args.reps),
              bench(lambda: fwd(vals, empty, logw), args.reps),
              bench(lambda: bwd(vals, flows, dp, empty, logw), args.reps)]
        print(f"G={G}: forward {ms[0]:.3f} ms, backward {ms[1]:.3f} ms; barriers only ({tree.levels} levels): "
              f"forward {ms[2]:.3f} ms, backward {ms[3]:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
