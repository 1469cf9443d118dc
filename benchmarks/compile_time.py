"""Host-side build + compile time and memory of the benchmark workloads (runs anywhere).

    python benchmarks/compile_time.py [--hclt-rows 1000]

Prints, per workload: structure construction time, ``jaxpc.compile`` time, nodes and edges,
index-table and parameter bytes, and the growth of the process's peak RSS during compile.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jaxpc  # noqa: E402
from jaxpc import dists, structures  # noqa: E402
from _data import blurred_noise_images  # noqa: E402


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _nbytes(tree) -> int:
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(tree))


def measure(name, build):
    t0 = time.perf_counter()
    root = build()
    t1 = time.perf_counter()
    rss0 = _rss_mb()
    c = jaxpc.compile(root)
    jax.block_until_ready(c.params)
    t2 = time.perf_counter()
    print(f"{name:10s} build {t1 - t0:7.2f} s | jaxpc.compile {t2 - t1:6.2f} s | {c.num_nodes:>9,} nodes "
          f"{c.num_edges:>12,} edges | tables {_nbytes(c.tables) / 2**20:7.1f} MiB | params "
          f"{_nbytes(c.params) / 2**20:7.1f} MiB | peak RSS +{_rss_mb() - rss0:7.1f} MiB | "
          f"{len(c.layout.steps)} steps")
    return c


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hclt-rows", type=int, default=1000, help="images used to learn the Chow-Liu tree")
    args = p.parse_args(argv)
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}")
    x = blurred_noise_images(args.hclt_rows)
    cat = dists.Categorical(num_cats=256)
    measure("HMM-1024", lambda: structures.HMM(64, 1024, 4096))
    measure("HCLT-256", lambda: structures.HCLT(x, 256, input_dist=cat))
    measure("HCLT-128", lambda: structures.HCLT(x, 128, input_dist=cat))
    measure("PD-128", lambda: structures.PD((28, 28), 128, split_intervals=(4, 4), input_dist=cat))


if __name__ == "__main__":
    main()
