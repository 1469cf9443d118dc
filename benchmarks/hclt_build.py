"""Seconds of each phase of ``structures.HCLT`` on the default device: the data set, the soft-binned mutual
information (first and second call, with the durations of JAX's compile events in each), the Chow-Liu tree,
the circuit's nodes, and ``jaxpc.compile``.

    python benchmarks/hclt_build.py [--samples 2000] [--latents 256]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--latents", type=int, default=256)
    args = p.parse_args(argv)
    import collections

    import jax

    import jaxpc
    from _data import blurred_noise_images
    from jaxpc import distributions
    from jaxpc.structures import hclt

    events: dict = collections.defaultdict(float)
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: events.__setitem__(name.rsplit("/", 1)[-1], events[name.rsplit("/", 1)[-1]] + secs))
    out, t = {}, time.perf_counter()
    jax.numpy.zeros(1).block_until_ready()
    out["jax_init_s"] = time.perf_counter() - t
    t = time.perf_counter()
    x = blurred_noise_images(args.samples)
    out["data_s"] = time.perf_counter() - t
    for k in ("mi_first_s", "mi_second_s"):
        before = dict(events)
        t = time.perf_counter()
        mi = hclt.mutual_information(x)
        out[k] = time.perf_counter() - t
        out[k[:-2] + "_events"] = {n: round(v - before.get(n, 0.0), 3) for n, v in events.items()
                                           if v - before.get(n, 0.0) > 0.01}
    t = time.perf_counter()
    children, root = hclt.chow_liu_tree(mi)
    out["tree_s"] = time.perf_counter() - t
    t = time.perf_counter()
    nodes = hclt.hidden_tree_circuit(children, root, args.latents, list(range(x.shape[1])),
                                     distributions.Categorical(256))
    out["nodes_s"] = time.perf_counter() - t
    t = time.perf_counter()
    c = jaxpc.compile(nodes)
    out["compile_s"] = time.perf_counter() - t
    out = {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}
    print(json.dumps(dict(out, samples=args.samples, latents=args.latents,
                          edges=c.num_edges, device=str(jax.devices()[0]))), flush=True)


if __name__ == "__main__":
    main()
