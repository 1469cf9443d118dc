"""Seconds of each phase of ``structures.HCLT`` on the default device: the data set, the soft-binned mutual
information (first and second call, with the durations of JAX's compile events in each), the Chow-Liu tree,
the circuit's nodes, and ``jaxpc.compile``.

    python benchmarks/hclt_build.py [--samples 2000] [--latents 256] [--phases]

``--phases``: first the compile seconds of each of the estimator's executables on their own (the bins alone, the
soft bins, the variables' entropies, the row entropies as the library compiles them and with XLA's default
options, and the matrix product alone).
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


def compile_phases(x) -> dict:
    """Seconds to lower and compile each executable of ``hclt.mutual_information`` for data ``x`` on its own."""
    import functools

    import jax
    import jax.numpy as jnp

    from jaxpc.structures import hclt

    nb, rows = 32, 64
    n = -(-x.shape[1] // rows) * rows
    xs = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    p = jax.ShapeDtypeStruct((x.shape[0], n * nb), jnp.float32)
    start = jax.ShapeDtypeStruct((), jnp.int32)
    entropy = jax.jit(functools.partial(hclt._row_entropy, num_bins=nb, rows=rows))
    product = jax.jit(lambda p, s: jnp.dot(jax.lax.dynamic_slice_in_dim(p, s * nb, rows * nb, axis=1).T, p))
    bins = jnp.linspace(0.0, 1.0, nb)
    p_only = jax.jit(lambda xs: jnp.exp(-0.5 * jnp.square(xs[:, :, None] - bins) / (0.5 / nb) ** 2).reshape(
        xs.shape[0], -1))
    phases = {
        "bins_alone": lambda: p_only.lower(xs).compile(),
        "soft_bins": lambda: hclt._soft_bins.lower(xs, num_bins=nb, sigma=0.5 / nb, num_vars=x.shape[1]).compile(),
        "entropies": lambda: hclt._entropies.lower(p, num_bins=nb).compile(),
        "row_entropy_library": lambda: hclt._row_entropy_exe.__wrapped__(p.shape, nb, rows, jax.default_backend(),
                                                                         None),
        "row_entropy_xla_defaults": lambda: entropy.lower(p, start).compile(),
        "product_alone": lambda: product.lower(p, start).compile(),
    }
    out = {}
    for name, make in phases.items():
        t = time.perf_counter()
        make()
        out[f"{name}_compile_s"] = round(time.perf_counter() - t, 3)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--latents", type=int, default=256)
    p.add_argument("--phases", action="store_true", help="compile each executable of the estimator on its own first")
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
    if args.phases:
        out.update(compile_phases(x))
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
