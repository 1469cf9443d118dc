"""What the default call's input check costs per call: HCLT-256 (or HMM-1024) at one batch, the default
call against the tuned one, and the default call with parts of the flag handling left out.

    python benchmarks/check_cost.py [--workload hclt] [--batch 16] [--reps 40]

Variants: ``tuned`` (tf32, validate=False), ``default``, ``unchecked`` (default precision, validate=False:
the same computation as ``tuned`` in an executable compiled and autotuned on its own), ``early-copy`` (the
flag copied to the host asynchronously as soon as it is dispatched), ``no-read`` (the check runs in the
executable, the flag is never read), ``sync``, ``device-flag`` (the flag left in device memory instead of the
pinned host memory it is written to), ``poll`` (only flags already computed are read; never waits).

``--read-latency`` times the host's read of a computed one-byte flag while the device runs a call, and idle.
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

import _timing  # noqa: E402
import jaxpc  # noqa: E402
from _data import blurred_noise_images  # noqa: E402
from jaxpc import checks, distributions, runtime, structures  # noqa: E402

WARMUP = 5  # calls of each variant not counted


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workload", default="hclt", choices=["hclt", "hmm", "pd"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--reps", type=int, default=40, help="timed calls per variant; the first WARMUP (5) are not counted")
    p.add_argument("--entries", default="log_prob,flows")
    p.add_argument("--host-profile", action="store_true", help="also split the default call's host time")
    p.add_argument("--read-latency", action="store_true", help="also time reads of a computed flag")
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
                "no-read": ({}, lambda self, flag, batch, where: None), "sync": (dict(validate="sync"), None),
                "device-flag": ({}, None), "poll": ({}, None)}
    pinned_host = runtime._pinned_host
    for entry in args.entries.split(","):
        fn = getattr(c, entry)
        for name, (kw, rec) in variants.items():
            runtime.Runtime._record = rec or record
            runtime._pinned_host = (lambda x: False) if name == "device-flag" else pinned_host
            c.runtime._flag_exes.clear()  # (stored per batch layout, whichever memory they write to)
            runtime.Runtime._settle = _poll_settle if name == "poll" else settle
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
            runtime.Runtime._record, runtime.Runtime._settle, runtime._pinned_host = record, settle, pinned_host
            c.runtime._flag_exes.clear()
            c.raise_pending()
            print(f"{args.workload} B={B} {entry:9s} {name:9s} {1e3 * np.median(ts[WARMUP:]):7.3f} ms "
                  f"(min {1e3 * np.min(ts[WARMUP:]):.3f})", flush=True)
    if args.host_profile:
        host_profile(c, xs, args.reps)
    if args.read_latency:
        read_latency(c, xs, args.reps)


def _poll_settle(self):
    """``Runtime._settle`` that reads only flags already computed, in call order, and never waits."""
    while True:
        with self._lock:
            if not self._pending or not self._pending[0].flag.is_ready():
                return
            p = self._pending.popleft()
        with jax.transfer_guard_device_to_host("allow"):
            bad = bool(np.asarray(p.flag))
        if bad:
            self._pending.clear()
            checks.raise_bad_values(self.var_info, p.x, p.missing, "x", f"circuit.{p.where}")


def read_latency(c, xs, reps: int) -> None:
    """Microseconds to read a computed one-byte flag (device or pinned host memory): idle, and right after a
    ``flows`` call has been dispatched (the device busy)."""
    dev = next(iter(xs[0].devices()))
    flags = {"device": jax.jit(lambda x: x.sum() < 0)(xs[0]),
             "pinned": jax.jit(lambda x: x.sum() < 0, out_shardings=jax.sharding.make_single_device_sharding(
                 dev, memory_kind="pinned_host"))(xs[0])}
    opts = dict(options=jaxpc.Options(precision="tf32"), validate=False)
    for kind, f in flags.items():
        jax.block_until_ready(f)
        for busy in (False, True):
            ts, tr = [], []
            for i in range(reps):
                out = c.flows(c.params, xs[i % 4], **opts) if busy else None
                f2 = jax.device_put(f, f.sharding)  # a new array each time: no cached host copy
                jax.block_until_ready(f2)
                if busy:
                    out = c.flows(c.params, xs[i % 4], **opts)
                t = time.perf_counter()
                ready = f2.is_ready()
                tr.append(time.perf_counter() - t)
                t = time.perf_counter()
                with jax.transfer_guard_device_to_host("allow"):
                    bool(np.asarray(f2))
                ts.append(time.perf_counter() - t)
                jax.block_until_ready(out)
            print(f"read {kind:6s} {'busy' if busy else 'idle'}: read {1e6 * np.median(ts):.1f} us "
                  f"(max {1e6 * np.max(ts):.1f}), is_ready {1e6 * np.median(tr):.1f} us, ready={ready}", flush=True)


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
