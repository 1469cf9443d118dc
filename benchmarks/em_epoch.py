"""Mini-batch EM epochs through ``jaxpc.optim.fit`` (BENCHMARKS.md: HCLT-256, 60,000 images, batch 512).

    python benchmarks/em_epoch.py [--workload hclt|pd] [--latents 256] [--images 60000] [--batch 512]
                                  [--epochs 3] [--precision tf32] [--impl auto] [--no-fold]
                                  [--tunings tree_clusters=0,...]

The data are Gaussian-blurred noise images (28x28, 256 levels), the structure is learned from the first
10,000. First the answer: one epoch of ``fit`` (no shuffling, the last partial batch dropped, as PyJuice's
117 steps) against the same batches stepped one by one with ``circuit.em_step``; the relative difference
of every parameter array is printed (``FAILED`` above 1e-3). Then the time: a first ``fit`` of one epoch
compiles the epoch executable (timed apart), a second call runs ``--epochs`` epochs on it; seconds per
epoch with the epoch log-likelihoods. Bar: < 1.1 s per epoch for HCLT-256 (PyJuice graph 1.69 s on the
same GPU). ``--tunings``: the same again for each entry (``field=value`` pairs of :class:`jaxpc.Tuning` joined by
``+``), on the same circuit, its epoch log-likelihoods beside the first's.
"""

from __future__ import annotations

import argparse
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
from _options import tuning  # noqa: E402
from jaxpc import distributions, optim, structures  # noqa: E402


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="hclt", choices=["hclt", "pd"])
    p.add_argument("--latents", type=int, default=256)
    p.add_argument("--images", type=int, default=60_000)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--step-size", type=float, default=0.1)
    p.add_argument("--precision", default="tf32", choices=["fp32", "tf32", "bf16"])
    p.add_argument("--impl", default="auto", choices=["auto", "xla", "pallas", "pallas_forward", "triton"])
    p.add_argument("--no-fold", dest="fold", action="store_false")
    p.add_argument("--tunings", default="", help="more runs: Tuning fields a=1+b=0,c=2 (comma-separated runs)")
    args = p.parse_args(argv)
    if args.epochs < 1:
        raise SystemExit("--epochs must be at least 1")
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    data = blurred_noise_images(args.images)
    cat = distributions.Categorical(num_cats=256)
    t = time.perf_counter()
    if args.workload == "hclt":
        root = structures.HCLT(data[:10_000], args.latents, input_dist=cat)
    else:
        root = structures.PD((28, 28), args.latents, split_intervals=(4, 4), input_dist=cat)
    c = jaxpc.compile(root)
    print(f"{args.workload}-{args.latents}: built and compiled in {time.perf_counter() - t:.1f}s", flush=True)
    x = jax.device_put(jnp.asarray(data, jnp.int32))
    base = jaxpc.Options(precision=args.precision, impl=args.impl, fold_products=args.fold)
    for spec in ["", *filter(None, args.tunings.split(","))]:
        run(c, x, base.replace(tuning=tuning(spec)) if spec else base, spec or "default", args)


def run(c, x, opts, name: str, args):
    """fit's answer against em_step, then its seconds per epoch, with ``opts``."""
    kw = dict(step_size=args.step_size, drop_remainder=True, options=opts, progress=False, validate=False)

    # the answer: fit's scan against em_step on the same batches
    got = optim.fit(c, c.params, x, 1, args.batch, shuffle=False, **kw).params
    ref = c.params
    steps = args.images // args.batch
    for i in range(steps):
        ref = c.em_step(ref, x[i * args.batch:(i + 1) * args.batch], step_size=args.step_size, options=opts,
                        validate=False)
    errs = [rel(np.exp(a), np.exp(b)) for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref))]
    worst = max(errs)
    print(f"[{name}] fit against {steps} em_step calls: parameter relative difference {worst:.1e}"
          + ("  FAILED" if worst > 1e-3 else ""), flush=True)

    # the time: a first call compiles the epoch (and is timed apart), the next runs --epochs epochs on it
    t = time.perf_counter()
    jax.block_until_ready(optim.fit(c, c.params, x, 1, args.batch, **kw).params)
    first = time.perf_counter() - t
    c.wait_compiled()  # the epochs run the optimized executable (Tuning.quick_first_compile)
    t = time.perf_counter()
    res = optim.fit(c, c.params, x, args.epochs, args.batch, **kw)
    jax.block_until_ready(res.params)
    per_epoch = (time.perf_counter() - t) / args.epochs
    print(f"[{name}] {args.workload}-{args.latents} B={args.batch} {args.precision} impl={args.impl} "
          f"fold={args.fold}: {per_epoch:.3f} s per epoch of {steps} steps ({1e3 * per_epoch / steps:.2f} ms per "
          f"step); first call (compiling) {first:.2f} s; epoch LL {np.asarray(res.epoch_ll)}", flush=True)


if __name__ == "__main__":
    main()
