"""Where the host time of a synchronized step goes: the flows executable called directly, under XLA flags.

    python benchmarks/dispatch.py [--workload hclt] [--latents 256] [--batch 16] [--impl auto]
                                  [--flags "|--xla_gpu_enable_command_buffer="]

Each ``|``-separated entry of ``--flags`` runs in its own process with those ``XLA_FLAGS`` (the empty entry:
none). Per process, medians over ``--reps`` steps of the compiled flows executable (no ``Circuit`` API work):

* ``held``: each step synchronized while the previous step's outputs are still alive (a training loop that
  keeps its last result): the outputs land at new addresses every call;
* ``freed``: the previous outputs deleted before the call, so the allocator can hand back the same addresses;
* ``dispatch``: how long the call takes to return (host work before the device runs), in both loops;
* ``pipelined``: steps dispatched back to back, synchronized once.

A large ``held - freed`` gap is the command buffers' update for moved buffers; a large ``dispatch`` is host
work per call. An XLA flag the installed jaxlib does not know fails that process only (reported, the others
run): jax 0.11.2 has no ``--xla_gpu_command_buffer_update_mode``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def measure(args):
    import jax
    import jax.numpy as jnp

    import jaxpc
    from profile_step import build

    c, data = build(args.workload, args.latents)
    opts = jaxpc.Options(precision=args.precision, impl=args.impl)
    xs = [jnp.asarray(data[i * args.batch:(i + 1) * args.batch]) for i in range(4)]
    exe = jax.jit(lambda t, p, x: jaxpc.engine.em.flows_and_ll(c.layout, t, p, x, None, None, opts)).lower(
        c.tables, c.params, xs[0]).compile()
    out = None
    for i in range(5):
        out = jax.block_until_ready(exe(c.tables, c.params, xs[i % 4]))

    def loop(free: bool):
        nonlocal out
        walls, disp = [], []
        for i in range(args.reps):
            if free:
                for leaf in jax.tree_util.tree_leaves(out):
                    leaf.delete()
                out = None
            t = time.perf_counter()
            o = exe(c.tables, c.params, xs[i % 4])
            d = time.perf_counter()
            jax.block_until_ready(o)
            walls.append(time.perf_counter() - t)
            disp.append(d - t)
            out = o
        return 1e3 * np.median(walls), 1e3 * np.median(disp)

    held, held_d = loop(False)
    freed, freed_d = loop(True)
    t = time.perf_counter()
    for i in range(args.reps):
        out = exe(c.tables, c.params, xs[i % 4])
    jax.block_until_ready(out)
    pipelined = 1e3 * (time.perf_counter() - t) / args.reps
    flags = os.environ.get("XLA_FLAGS", "") or "(none)"
    print(f"{args.workload}-{args.latents} B={args.batch} {args.impl} XLA_FLAGS={flags}: held {held:.3f} ms "
          f"(dispatch {held_d:.3f}) | freed {freed:.3f} ms (dispatch {freed_d:.3f}) | pipelined {pipelined:.3f} ms",
          flush=True)


def main(argv=None):
    from profile_step import add_step_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_args(p)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--flags", default="", help="'|'-separated XLA_FLAGS settings, one process each")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return measure(args)
    base = [f"--workload={args.workload}", f"--latents={args.latents}", f"--batch={args.batch}",
            f"--precision={args.precision}", f"--impl={args.impl}", f"--reps={args.reps}"]
    for flags in args.flags.split("|"):
        env = {**os.environ, "XLA_FLAGS": flags}
        r = subprocess.run([sys.executable, __file__, "--child", *base], env=env,
                           capture_output=True, text=True)
        lines = [l for l in (r.stdout + r.stderr).splitlines() if l.strip()]
        print(lines[-1] if r.returncode == 0 and lines else f"XLA_FLAGS={flags!r}: failed (rc {r.returncode}): "
              + " | ".join(lines[-3:])[-600:], flush=True)


if __name__ == "__main__":
    main()
