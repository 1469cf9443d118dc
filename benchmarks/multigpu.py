"""Per-step time of data-parallel training on 1 device vs all visible devices (jaxpc.parallel).

    python benchmarks/multigpu.py [--workload hclt|pd|hmm] [--batch 512] [--reps 20] [--latents 64]
                                  [--structure pd5] [--steps em,adam] [--json out.json]

``--structure`` builds one of ``benchmarks/scale.py``'s structures instead (``pd1`` ... ``pd5``, ``hclt1`` ...
``hclt5``: PyJuice's runtime table), e.g. the largest ones at the batch of that table, on 2 GPUs:
``--structure pd5 --batch 256 --steps em`` and ``--structure hclt5 --batch 1024 --steps em``.

For each step kind it times (median of ``--reps`` steps after warm-up, parameters chained from step
to step, batches already on the devices):

* ``1 dev``: the step on one device with the global batch;
* ``N dev, same global batch`` (strong scaling): the batch split over all devices;
* ``N dev, N x batch`` (weak scaling): every device keeps the one-device batch.

Before timing it checks that the data-parallel flows equal the one-device flows (relative 1e-4).
Step kinds: ``em`` (mini-batch EM: flows, one psum, replicated update) and ``adam`` (gradient of the
renormalized logits, one psum, optax.adam). On a CPU host, try
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` to exercise the code paths.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jaxpc  # noqa: E402
from _data import blurred_noise_images  # noqa: E402
from jaxpc import distributions, optim, parallel, structures  # noqa: E402


def build(workload: str, latents: int, seed: int = 0, structure: str = ""):
    if structure:
        from scale import SPECS, TREE_ROWS, build_root

        if structure not in SPECS:
            raise SystemExit(f"unknown structure {structure!r}; one of {sorted(SPECS)}")
        data = blurred_noise_images(max(4096, TREE_ROWS), (28, 28), 256, seed)
        return jaxpc.compile(build_root(structure, data), seed=seed), data
    if workload == "hclt":
        data = blurred_noise_images(4096, (28, 28), 256, seed)
        root = structures.HCLT(data[:2000], num_latents=latents, input_dist=distributions.Categorical(256))
    elif workload == "pd":
        data = blurred_noise_images(4096, (28, 28), 256, seed)
        root = structures.PD((28, 28), latents, split_intervals=(7, 7), input_dist=distributions.Categorical(256))
    elif workload == "hmm":
        rng = np.random.default_rng(seed)
        data = rng.integers(0, 1024, size=(4096, 256)).astype(np.int32)
        root = structures.HMM(256, latents, 1024)
    else:
        raise SystemExit(f"unknown workload {workload!r}")
    return jaxpc.compile(root, seed=seed), data


def median_ms(step, state, batches, reps: int, warmup: int = 3):
    for i in range(warmup):
        state = step(state, batches[i % len(batches)])
    jax.block_until_ready(state)
    times = []
    for i in range(reps):
        t = time.perf_counter()
        state = step(state, batches[i % len(batches)])
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def rel_err(a, b) -> float:
    out = 0.0
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        out = max(out, float(np.max(np.abs(u - v)) / max(np.max(np.abs(u)), 1e-30)))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="hclt", choices=["hclt", "pd", "hmm"])
    p.add_argument("--latents", type=int, default=64)
    p.add_argument("--structure", default="", help="one of scale.py's structures (pd1-pd5, hclt1-hclt5) instead")
    p.add_argument("--batch", type=int, default=512, help="global batch of the one-device run")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--steps", default="em,adam")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    devs = jax.devices()
    n = len(devs)
    print(f"jax {jax.__version__}, {n} x {devs[0].device_kind} ({devs[0].platform})")
    t0 = time.perf_counter()
    circuit, data = build(args.workload, args.latents, structure=args.structure)
    name = args.structure or f"{args.workload}-{args.latents}"
    print(f"{name}: {circuit.num_nodes:,} nodes, {circuit.num_edges:,} edges, "
          f"{circuit.num_parameters:,} params (built in {time.perf_counter() - t0:.1f} s)")
    B = args.batch
    if B % n:
        raise SystemExit(f"--batch {B} must be a multiple of the {n} devices")
    mesh = parallel.data_mesh()
    one = parallel.data_mesh(1)
    sharded = NamedSharding(mesh, P(parallel.AXIS))
    rng = np.random.default_rng(0)

    host = [data[rng.integers(0, len(data), B * n)] for _ in range(4)]
    single = [jax.device_put(jnp.asarray(h[:B]), devs[0]) for h in host]
    strong = [jax.device_put(jnp.asarray(h[:B]), sharded) for h in host]
    weak = [jax.device_put(jnp.asarray(h), sharded) for h in host]

    # correctness first
    ref = circuit.flows(circuit.params, single[0], validate=False)
    got = parallel.flows(circuit, circuit.params, strong[0], mesh=mesh, validate=False)
    err = rel_err(ref, got)
    print(f"data-parallel flows vs one device: max relative difference {err:.2e}")
    if err > 1e-4:
        raise SystemExit("flows differ: not timing")

    results = {"workload": name, "latents": args.latents, "devices": n, "device_kind": devs[0].device_kind,
               "batch": B, "flows_rel_err": err, "steps": {}}
    for kind in [s for s in args.steps.split(",") if s]:
        if kind == "em":
            tx = optim.em(circuit, 0.1, 0.1)
        elif kind == "adam":
            import optax

            tx = optax.adam(1e-2)
        else:
            raise SystemExit(f"unknown step kind {kind!r}")
        row = {}
        for label, m, bs in (("1 dev", one, single), (f"{n} dev, batch {B}", mesh, strong),
                             (f"{n} dev, batch {B * n}", mesh, weak)):
            def step(state, xb, m=m):
                params, opt_state = state
                params, opt_state, _ = parallel.train_step(circuit, tx, params, opt_state, xb, mesh=m, validate=False)
                return params, opt_state

            ms = median_ms(step, (circuit.params, tx.init(circuit.params)), bs, args.reps)
            size = int(bs[0].shape[0])
            row[label] = {"ms": ms, "samples_per_s": size / ms * 1e3}
            print(f"  {kind:5s} {label:>22s}: {ms:9.2f} ms/step  {size / ms * 1e3:12,.0f} samples/s")
        base = row["1 dev"]["ms"]
        row["strong_speedup"] = base / row[f"{n} dev, batch {B}"]["ms"]
        row["weak_efficiency"] = base / row[f"{n} dev, batch {B * n}"]["ms"]
        print(f"  {kind:5s} strong-scaling speedup {row['strong_speedup']:.2f}x on {n} devices, "
              f"weak-scaling efficiency {100 * row['weak_efficiency']:.0f}%")
        results["steps"][kind] = row
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
