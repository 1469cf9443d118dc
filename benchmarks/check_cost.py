"""What the default call's input check costs per call: HCLT-256 (or HMM-1024) at one batch, the default
call against the tuned one, and the default call with parts of the flag handling left out.

    python benchmarks/check_cost.py [--workload hclt] [--batch 16] [--reps 40]

Variants: ``tuned`` (tf32, validate=False), ``default``, ``unchecked`` (default precision, validate=False:
the same computation as ``tuned`` in an executable compiled and autotuned on its own), ``early-copy`` (the
flag copied to the host asynchronously as soon as it is dispatched), ``no-read`` (the check runs in the
executable, the flag is never read), ``sync``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import _timing  # noqa: E402
import jaxpc  # noqa: E402
from _data import blurred_noise_images  # noqa: E402
from jaxpc import distributions, runtime, structures  # noqa: E402

WARMUP = 5  # calls of each variant not counted


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workload", default="hclt", choices=["hclt", "hmm", "pd"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--reps", type=int, default=40, help="timed calls per variant; the first WARMUP (5) are not counted")
    p.add_argument("--entries", default="log_prob,flows")
    p.add_argument("--host-profile", action="store_true", help="also split the default call's host time")
    args = p.parse_args(argv)
    if args.reps <= WARMUP:
        p.error(f"--reps must be more than {WARMUP}: the first {WARMUP} calls of each variant are warm-up, not counted")
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

    def early_copy(self, flag, batch, where):  # noqa: D401 - the flag copied to the host as soon as dispatched
        with jax.transfer_guard_device_to_host("allow"):
            flag.copy_to_host_async()
        record(self, flag, batch, where)

    variants = {"tuned": (tuned, None), "default": ({}, None), "unchecked": (dict(validate=False), None),
                "early-copy": ({}, early_copy),
                "no-read": ({}, lambda self, flag, batch, where: None), "sync": (dict(validate="sync"), None)}
    for entry in args.entries.split(","):
        fn = getattr(c, entry)
        for name, (kw, rec) in variants.items():
            runtime.Runtime._record = rec or record
            out = fn(c.params, xs[0], **kw)
            jax.block_until_ready(out)
            c.wait_compiled()
            ts = []
            for i in range(args.reps):
                t = time.perf_counter()
                out = fn(c.params, xs[i % 4], **kw)
                jax.block_until_ready(out)
                ts.append(time.perf_counter() - t)
                del out
            runtime.Runtime._record = record
            print(f"{args.workload} B={B} {entry:9s} {name:9s} {1e3 * np.median(ts[WARMUP:]):7.3f} ms "
                  f"(min {1e3 * np.min(ts[WARMUP:]):.3f})", flush=True)
    del settle
    if args.host_profile:
        host_profile(c, xs, args.reps)


def host_profile(c, xs, reps: int) -> None:
    """Host microseconds per default ``flows`` call spent in each part of the check's flag handling: the flag
    executable's dispatch, the asynchronous copy and the read of the previous call's flag."""
    import collections
    spent: dict = collections.defaultdict(float)
    rt = c.runtime

    def timed(name, fn):
        return _timing.timed(spent, name, fn)

    helpers_run, record, settle = rt._helpers.run, rt._record, rt._settle
    rt._helpers.run, rt._record, rt._settle = (timed("flag dispatch", helpers_run), timed("record", record),
                                               timed("settle", settle))
    run = timed("whole call", c.flows)
    for i in range(reps):
        jax.block_until_ready(run(c.params, xs[i % 4]))
    rt._helpers.run, rt._record, rt._settle = helpers_run, record, settle
    print("host us per call: " + ", ".join(f"{k} {1e6 * v / reps:.1f}" for k, v in spent.items()), flush=True)


if __name__ == "__main__":
    main()
