"""What the default call's input check costs per call: HCLT-256 (or HMM-1024) at one batch, the default
call against the tuned one, and the default call with parts of the flag handling left out.

    python benchmarks/check_cost.py [--workload hclt] [--batch 16] [--reps 40]

Variants: ``tuned`` (tf32, validate=False), ``default``, ``unchecked`` (default precision, validate=False:
the same computation as ``tuned`` in an executable compiled and autotuned on its own), ``no-async`` (the
flag read without the early asynchronous copy), ``no-read`` (the check runs in the executable, the flag is
never read), ``sync``."""

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
from jaxpc import distributions, runtime, structures  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workload", default="hclt", choices=["hclt", "hmm", "pd"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--entries", default="log_prob,flows")
    args = p.parse_args(argv)
    B = args.batch
    if args.workload == "hmm":
        c = jaxpc.compile(structures.HMM(64, 1024, 4096))
        xs = [jax.device_put(np.random.default_rng(s).integers(0, 4096, (B, 64)).astype(np.int32)) for s in range(4)]
    else:
        imgs = blurred_noise_images(2000)
        cat = distributions.Categorical(256)
        root = (structures.PD((28, 28), 128, split_intervals=(4, 4), input_dist=cat) if args.workload == "pd"
                else structures.HCLT(imgs, 256, input_dist=cat))
        c = jaxpc.compile(root)
        xs = [jax.device_put(imgs[s * B:(s + 1) * B]) for s in range(4)]
    tuned = dict(options=jaxpc.Options(precision="tf32"), validate=False)
    record, settle = runtime.Runtime._record, runtime.Runtime._settle

    def no_async(self, flag, batch, where):  # noqa: D401 - the flag read without the early copy
        with self._lock:
            self._pending.append(runtime._Pending(flag, batch.x, batch.missing, where))

    variants = {"tuned": (tuned, None), "default": ({}, None), "unchecked": (dict(validate=False), None),
                "no-async": ({}, no_async),
                "no-read": ({}, lambda self, flag, batch, where: None), "sync": (dict(validate="sync"), None)}
    for entry in args.entries.split(","):
        fn = getattr(c, entry)
        for name, (kw, rec) in variants.items():
            runtime.Runtime._record = rec or record
            out = fn(c.params, xs[0], **kw)
            jax.block_until_ready(out)
            ts = []
            for i in range(args.reps):
                t = time.perf_counter()
                out = fn(c.params, xs[i % 4], **kw)
                jax.block_until_ready(out)
                ts.append(time.perf_counter() - t)
                del out
            runtime.Runtime._record = record
            print(f"{args.workload} B={B} {entry:9s} {name:9s} {1e3 * np.median(ts[5:]):7.3f} ms "
                  f"(min {1e3 * np.min(ts[5:]):.3f})", flush=True)
    del settle


if __name__ == "__main__":
    main()
