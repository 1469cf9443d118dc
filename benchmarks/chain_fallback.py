"""The side-by-side chain launch's posterior check (``jaxpc.engine.chain.posteriors_hold``): its margin and its cost.

    python benchmarks/chain_fallback.py [--sizes 1024,256] [--batch 16] [--reps 50] [--impl auto]

The flows' forward at small batches runs the HMM's backward messages beside the forward ones in one persistent
kernel; the backward half is normalized on its own, so where the two lose different states to underflow the
launch's posteriors are wrong, and the check (every step's posteriors sum to the sample's cotangent) sends the
backward to the one-way kernel. For each HMM (T=64, V=4096, ``--sizes`` latents) at ``--batch``:

1. the largest ``|sum_k posterior / cotangent - 1|`` of the launch at each precision, on random parameters and
   data, against ``POSTERIOR_TOLERANCE`` (a check that fails on healthy data would run both backwards);
2. whether a sample whose forward shares underflow (sharp emissions, the tests' case scaled up) takes the
   one-way kernel and gives finite flows equal to ``Tuning(chain_side_by_side=False)``'s;
3. forward + flows median ms of ``jax.jit(jax.grad(sum log_prob))`` at JAX's default precision, alternated in one
   loop: the launch with the check (the default), without it (``posteriors_hold`` replaced by ``True``), and the
   one-way kernels (``Tuning(chain_side_by_side=False)``); then each one's largest error against the launch
   without the check on healthy data.

Off a GPU, ``--impl pallas`` runs the kernels in interpret mode (a smoke run: ``--sizes 32 --batch 4 --reps 3``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAXPC_PERSISTENT_CACHE", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jaxpc  # noqa: E402
from jaxpc import structures  # noqa: E402
from jaxpc.engine import chain, forward  # noqa: E402

T, V = 64, 4096


def _grad_fn(c, options):
    """``jax.jit(jax.grad)`` of the summed log-likelihoods: traced anew per call of this function, so a replaced
    ``posteriors_hold`` takes effect."""
    return jax.jit(jax.grad(lambda p, x: jnp.sum(forward.log_prob(c.layout, c.tables, p, x, None, options))))


def _deviation(c, x, base, precision):
    """The launch's largest ``|sum_k post / gbar - 1|`` over steps and samples, and the check's verdict."""
    seen = []
    hold = chain.posteriors_hold

    def spy(post, gbar, prec):
        s = jnp.sum(post, axis=1)
        dev = jnp.max(jnp.abs(s / jnp.where(gbar == 0, 1.0, gbar)[None, :] - 1.0))
        ok = hold(post, gbar, prec)
        jax.debug.callback(lambda d, o: seen.append((float(d), bool(o))), dev, ok)
        return ok

    chain.posteriors_hold = spy
    try:
        g = _grad_fn(c, base.replace(precision=precision))(c.params, x)
        jax.block_until_ready(g)
    finally:
        chain.posteriors_hold = hold
    return seen[-1] if seen else (None, None), g


def _median_ms(fns, args, reps):
    times = {k: [] for k in fns}
    for f in fns.values():
        jax.block_until_ready(f(*args[0]))
    for i in range(reps):
        for k, f in fns.items():
            a = args[i % len(args)]
            t = time.perf_counter()
            jax.block_until_ready(f(*a))
            times[k].append((time.perf_counter() - t) * 1e3)
    return {k: float(np.median(v)) for k, v in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1024,256")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--impl", default="auto", help="Options.impl (default: the default call's)")
    args = p.parse_args(argv)
    base = jaxpc.Options(impl=args.impl)
    B = args.batch
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    for K in [int(k) for k in args.sizes.split(",")]:
        c = jaxpc.compile(structures.HMM(T, K, V), seed=0)
        spec = c.layout.chain
        uses = spec is not None and chain.side_by_side(spec, B, np.dtype(np.float32), base)
        print(f"HMM-{K} B={B}: side-by-side launch {uses}", flush=True)
        xs = [jnp.asarray(np.random.default_rng(s).integers(0, V, (B, T)).astype(np.int32)) for s in range(4)]
        for prec in ("fp32", "tf32", "bf16"):
            (dev, ok), _ = _deviation(c, xs[0], base, prec)
            if dev is None:
                print(f"  {prec}: the launch does not run here", flush=True)
                continue
            print(f"  {prec}: largest |sum post / gbar - 1| {dev:.2e}, tolerance "
                  f"{chain.POSTERIOR_TOLERANCE[prec]:.0e}, check holds {ok}", flush=True)

        # sharp emissions: each latent emits its own symbol with 1 - 1e-3; the data switch symbols half way
        beta = np.full((K, V), 1e-3 / (V - 1))
        beta[np.arange(K), np.arange(K) % V] = 1 - 1e-3
        sharp = jaxpc.compile(structures.HMM(T, K, V, alpha=np.eye(K), beta=beta, gamma=np.full(K, 1.0 / K)))
        xu = np.zeros((B, T), np.int32)
        xu[:, T // 2:] = 1
        ref = _grad_fn(sharp, base.replace(precision="fp32", tuning=jaxpc.Tuning(chain_side_by_side=False)))(
            sharp.params, jnp.asarray(xu))
        (dev, ok), g = _deviation(sharp, jnp.asarray(xu), base, "fp32")
        finite = all(bool(jnp.isfinite(a).all()) for a in jax.tree_util.tree_leaves(g))
        err = max(float(jnp.max(jnp.abs(a - b)) / (float(jnp.max(jnp.abs(b))) or 1.0))
                  for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(ref)))
        print(f"  underflowing sample: check holds {ok} (deviation {dev}), flows finite {finite}, "
              f"largest error against one-way {err:.1e}", flush=True)

        fns = {"with check (default)": _grad_fn(c, base)}
        hold = chain.posteriors_hold
        chain.posteriors_hold = lambda *a: jnp.bool_(True)
        try:
            fns["without check"] = _grad_fn(c, base)
            jax.block_until_ready(fns["without check"](c.params, xs[0]))
        finally:
            chain.posteriors_hold = hold
        fns["one-way kernels"] = _grad_fn(c, base.replace(tuning=jaxpc.Tuning(chain_side_by_side=False)))
        want = fns["without check"](c.params, xs[1])
        for k, f in fns.items():  # healthy data: every variant gives the launch's flows
            err = max(float(jnp.max(jnp.abs(a - b)) / (float(jnp.max(jnp.abs(b))) or 1.0))
                      for a, b in zip(jax.tree_util.tree_leaves(f(c.params, xs[1])), jax.tree_util.tree_leaves(want)))
            print(f"  {k}: largest error against the launch without check {err:.1e}", flush=True)
        ms = _median_ms(fns, [(c.params, x) for x in xs], args.reps)
        print("  forward + flows ms: " + ", ".join(f"{k} {v:.3f}" for k, v in ms.items()), flush=True)


if __name__ == "__main__":
    main()
