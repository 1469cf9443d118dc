"""The EM update's node totals: the reduction over each block's children apart from the scatter, or fused into it.

    python benchmarks/mstep.py [--latents 256] [--split-intervals 2,7] [--reps 20]

On PD's parameter groups (random positive flows of the parameters' shapes, the leaves' statistics of 16
samples), median milliseconds of:

* ``totals``: each group's node totals ``[S, Kp]`` as :func:`jaxpc.distributions.base.block_totals` computes them
  (the sum over the children a reduction of its own, then a scatter-add of ``[P, Kp]`` rows), against ``fused``
  (``segment_sum(sum(flows, axis=2), seg)`` as one expression, which XLA fuses into one scatter that reads the
  ``[P, Kp, Kc]`` flows);
* ``em_update``: the whole M-step (``jaxpc.engine.em.em_update``, step size and pseudocount 0.1) with either form;

and the largest relative difference of the updated parameters between the two forms.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jaxpc  # noqa: E402
from jaxpc import distributions, structures  # noqa: E402
from jaxpc.distributions.base import block_totals  # noqa: E402
from jaxpc.engine import em  # noqa: E402
from kernels_check import bench  # noqa: E402


def fused_totals(values, seg, num_segments):
    """The node totals as one expression (XLA fuses the reduction into the scatter-add)."""
    return jax.ops.segment_sum(jnp.sum(values, axis=2), seg, num_segments=num_segments)


def median_ms(fn, *args, reps: int) -> float:
    return bench(lambda: fn(*args), reps)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latents", type=int, default=256)
    p.add_argument("--split-intervals", default="2,7")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    split = tuple(int(s) for s in args.split_intervals.split(","))
    c = jaxpc.compile(structures.PD((28, 28), args.latents, split_intervals=split,
                                    input_dist=distributions.Categorical(256)))
    key = jax.random.key(0)
    x = np.random.default_rng(0).integers(0, 256, (16, 784)).astype(np.int32)
    flows = {"sum": {g: jax.random.uniform(jax.random.fold_in(key, i), a.shape, a.dtype)
                     for i, (g, a) in enumerate(c.params["sum"].items())},
             "input": c.flows(c.params, x)["input"]}  # the leaves' statistics of 16 samples
    edges = sum(int(np.prod(a.shape)) for a in c.params["sum"].values())
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; PD-{args.latents} {split}: {edges / 1e6:.1f}M sum "
          f"parameters in {len(c.params['sum'])} groups", flush=True)
    for g in c.layout.sum_groups:
        seg = c.tables["groups"][g.key]["seg"]
        a = flows["sum"][g.key]
        ms = [median_ms(jax.jit(fn, static_argnums=2), a, seg, g.num_segments, reps=args.reps)
              for fn in (block_totals, fused_totals)]
        print(f"group {g.key} {list(a.shape)}, {g.num_segments} segments: totals {ms[0]:.3f} ms, fused {ms[1]:.3f}",
              flush=True)

    def update(params, fl):
        return em.em_update(c.layout, c.tables, params, fl, 0.1, 0.1)

    got = jax.jit(update)(c.params, flows)
    split_ms = median_ms(jax.jit(update), c.params, flows, reps=args.reps)
    em.block_totals = fused_totals
    try:
        want = jax.jit(lambda params, fl: update(params, fl))(c.params, flows)
        fused_ms = median_ms(jax.jit(lambda params, fl: update(params, fl)), c.params, flows, reps=args.reps)
    finally:
        em.block_totals = block_totals
    diff = max(float(jnp.max(jnp.abs(x - y) / jnp.maximum(jnp.abs(y), 1e-30)))
               for x, y in zip(jax.tree_util.tree_leaves(got["sum"]), jax.tree_util.tree_leaves(want["sum"])))
    print(f"em_update: {split_ms:.3f} ms, fused totals {fused_ms:.3f} ms; parameters max rel diff {diff:.1e}",
          flush=True)


if __name__ == "__main__":
    main()
