"""Seconds to learn an HCLT's tree on the default device: the soft-binned mutual information of 784 variables
(first call, compile included, then a second call) and the Chow-Liu tree; the library's estimator (JAX's
default precision: TF32 on NVIDIA GPUs) beside the same products in exact float32.

    python benchmarks/tree_learning.py [--samples 2000] [--vars 784]

Each formulation runs once cold (its own executables) and once warm; the answers are checked against the first.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def formulations():
    import jax
    import jax.numpy as jnp

    hi = jax.lax.Precision.HIGHEST

    def soft(xs, nb, sigma):
        bins = jnp.linspace(0.0, 1.0, nb)
        return jnp.exp(-0.5 * jnp.square(xs[:, :, None] - bins[None, None, :]) / (sigma * sigma))

    def entropy(joint):  # [c, nb, V, nb] -> [c, V]
        total = jnp.sum(joint, axis=(1, 3), keepdims=True)
        joint = joint / jnp.where(total > 0, total, 1.0)
        return -jnp.sum(joint * jnp.log(joint + 1e-4), axis=(1, 3))

    def rows_dot(precision):
        @jax.jit
        def row_entropy(a, p2, nb):
            B = a.shape[0]
            c, V = a.shape[1] // nb.shape[0], p2.shape[1] // nb.shape[0]
            joint = jnp.dot(a.T, p2, precision=precision) / B
            return entropy(joint.reshape(c, nb.shape[0], V, nb.shape[0]))

        def mi(x, nb=32, sigma=0.5 / 32, chunk=64):
            B, V = x.shape
            xs = jnp.asarray(x, jnp.float32)
            p = soft(xs, nb, sigma)
            marg = jnp.mean(p / jnp.sum(p, axis=2, keepdims=True), axis=0)
            h1 = np.asarray(-jnp.sum(marg * jnp.log(marg + 1e-4), axis=1))
            n = -(-V // chunk) * chunk
            p2 = jnp.pad(p, ((0, 0), (0, n - V), (0, 0))).reshape(B, n * nb)
            tag = jnp.zeros((nb,))
            h12 = np.concatenate([np.asarray(row_entropy(p2[:, i * nb:(i + chunk) * nb], p2, tag))
                                  for i in range(0, n, chunk)])[:V, :n][:, :V]
            h12 = np.where(np.triu(np.ones((V, V), bool)), h12, h12.T)
            return h1[:, None] + h1[None, :] - h12
        return mi

    from jaxpc.structures.hclt import mutual_information
    return {"library": lambda x: mutual_information(x), "exact_fp32": rows_dot(hi)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--vars", type=int, default=784)
    args = p.parse_args(argv)
    import jax

    from _data import blurred_noise_images
    from jaxpc.structures.hclt import chow_liu_tree
    x = blurred_noise_images(args.samples)[:, :args.vars].astype(np.float32)
    x = (x - x.min()) / (x.max() - x.min() + 1e-8)
    ref = None
    for name, fn in formulations().items():
        t = time.perf_counter()
        mi = fn(x)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        mi = fn(x)
        warm = time.perf_counter() - t
        t = time.perf_counter()
        tree = chow_liu_tree(mi)
        tree_s = time.perf_counter() - t
        ref = (mi, tree) if ref is None else ref
        print(json.dumps(dict(formulation=name, cold_s=round(cold, 2), warm_s=round(warm, 3), tree_s=round(tree_s, 3),
                              max_err=float(np.abs(mi - ref[0]).max()), same_tree=tree == ref[1],
                              device=str(jax.devices()[0]))), flush=True)


if __name__ == "__main__":
    main()
