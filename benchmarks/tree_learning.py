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
    """The library's estimator at JAX's default precision, and the same under exact float32 products."""
    import jax

    from jaxpc.structures.hclt import mutual_information

    def exact(x):
        with jax.default_matmul_precision("highest"):  # part of jit's key: its own executables
            return mutual_information(x)

    return {"library": mutual_information, "exact_fp32": exact}


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
