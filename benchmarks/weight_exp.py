"""What the Pallas kernels' exponentials cost (a diagnostic).

    python benchmarks/weight_exp.py [--workload hclt] [--latents 256] [--batches 16] [--reps 100] [--rounds 2]
                                    [--variants default,linear-weights,no-exp-logw,exp2]

The Pallas sum kernels load each weight tile as log-weights and exponentiate it in every program
(``pallas_sum._load_w``). Here the default ``log_prob`` and ``flows`` calls of HCLT (or PD) are timed (median of
synchronized calls over 4 rotating batches) in these ways, in ``--rounds`` alternating rounds in one process:

* ``default``: as shipped;
* ``linear-weights``: the kernels' weight loads made plain and the sum parameters exponentiated once before the
  call, so that the Pallas kernels see linear weights (their values exact: the log-likelihood printed beside it is
  that of a circuit with the same structure whose XLA layers read the exponentiated weights as log-weights); what
  weights made linear once per step would save, less that step's exponentials of the sum parameters;
* ``no-exp-logw``: the plain loads on the log-weights (wrong values, NaN log-likelihoods): the loads alone;
* ``exp2``: the kernels' ``exp`` and ``log`` (``pallas_sum._exp``, ``pallas_sum._log``) as ``exp2(x log2 e)`` and
  ``log2(x) ln 2``, which Triton lowers to the GPU's approximate instructions where ``exp`` and ``log`` call
  libdevice's accurate ``expf`` and ``logf``.

GPU only (elsewhere the sum layers run on XLA and the variants do not differ). PD's fan-in kernels:
``pd_tiles.py --no-weight-exp``.
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
from jaxpc import distributions, structures  # noqa: E402
from jaxpc.ops import pallas_sum  # noqa: E402


def plain_load_w(w_ref, p, kp, kc, Kp, Kc, alpha, valid=True):
    """``pallas_sum._load_w`` without the exponential: the weight tile as stored."""
    mask = (kp[:, None] < Kp) & (kc[None, :] < Kc) & valid
    return pallas_sum.plgpu.load(w_ref.at[p, kp[:, None], kc[None, :]], mask=mask, other=0.0)


def exp2_exp(x):
    return jnp.exp2(x * np.float32(np.log2(np.e)))


def log2_log(x):
    return jnp.log2(x) * np.float32(np.log(2.0))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latents", type=int, default=256)
    p.add_argument("--batches", default="16")
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workload", default="hclt", choices=("hclt", "pd"))
    p.add_argument("--variants", default="default,linear-weights,no-exp-logw")
    args = p.parse_args(argv)
    imgs = blurred_noise_images(4096)
    cat = distributions.Categorical(256)
    if args.workload == "hclt":
        c = jaxpc.compile(structures.HCLT(imgs[:2000], args.latents, input_dist=cat))
    else:
        c = jaxpc.compile(structures.PD((28, 28), args.latents, split_intervals=(4, 4), input_dist=cat))
    linear = {**c.params, "sum": jax.tree_util.tree_map(jnp.exp, c.params["sum"])}
    shipped = pallas_sum._load_w
    shipped_math = pallas_sum._exp, pallas_sum._log
    leaf_batch = jaxpc.Tuning().leaf_batch
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {args.workload.upper()}-{args.latents}",
          flush=True)

    def run(name, params, patched, key, fast_math=False):
        pallas_sum._load_w = plain_load_w if patched else shipped
        pallas_sum._exp, pallas_sum._log = (exp2_exp, log2_log) if fast_math else shipped_math
        pallas_sum._KERNELS.clear()
        jax.clear_caches()
        # a distinct Options value per variant and round: its executables are traced after the patch
        opts = jaxpc.Options(tuning=jaxpc.Tuning(leaf_batch=leaf_batch + key))
        for B in (int(b) for b in args.batches.split(",")):
            xs = [jax.device_put(imgs[i * B:(i + 1) * B]) for i in range(4)]
            for entry in ("log_prob", "flows"):
                fn = getattr(c, entry)
                jax.block_until_ready(fn(params, xs[0], options=opts))
                c.wait_compiled()
                for i in range(10):
                    jax.block_until_ready(fn(params, xs[i % 4], options=opts))
                ts = []
                for i in range(args.reps):
                    t = time.perf_counter()
                    jax.block_until_ready(fn(params, xs[i % 4], options=opts))
                    ts.append(time.perf_counter() - t)
                ll = float(c.log_prob(params, xs[0], options=opts)[0])
                print(f"{name:15s} {entry:8s} B={B}: {1e3 * np.median(ts):.3f} ms (min {1e3 * np.min(ts):.3f}); "
                      f"ll[0] {ll:.4f}", flush=True)

    variants = {"default": (c.params, False, False), "linear-weights": (linear, True, False),
                "no-exp-logw": (c.params, True, False), "exp2": (c.params, False, True)}
    for r in range(args.rounds):
        for k, name in enumerate(args.variants.split(",")):
            params, patched, fast = variants[name]
            run(name, params, patched, 10 * r + k, fast)
    pallas_sum._load_w = shipped
    pallas_sum._exp, pallas_sum._log = shipped_math


if __name__ == "__main__":
    main()
