"""Where the host seconds of an HCLT's build and ``jaxpc.compile`` go, per phase, and whether they grow
linearly in the edges.

    python benchmarks/compile_phases.py [--latents 128,256,512,1024] [--pd 64,128,256,512] [--hclt-rows 1000]
                                        [--reps 1] [--profile 1024] [--json out.json] [--plot out.png]

The tree is learned once (mutual information and Chow-Liu tree, timed), then for each number of latents
the circuit over it is built (``structure``) and compiled; ``--pd``: PDs over 28x28 images too (the
hyper-parameters of ``benchmarks/scale.py``). ``jaxpc.compile``'s seconds are split by timing
the library's phase functions (each call counted once, in its outermost timed phase; ``other`` is the
rest): layering, placement of sums and inputs, the stages, scans, the single-reader check, the batched
parameter-flow tables, chain detection, the folded plan, ``finalize_tables``, the initial parameters' seeded
host draw (``Circuit._host_params``) and the ``device_put`` of the index tables and of the parameters (on a GPU
the transfer may finish later: ``other`` then holds the wait, as the compile is timed to ``block_until_ready``
of the parameters).
The process's resident memory is sampled every 2 ms: ``peak`` is its highest value during the compile above
the value before it. Each phase is printed as wall / CPU seconds (CPU: all threads). ``--profile L``: cProfile
of L's compile, top 25 by cumulative time. Each answer is checked: the parameters of every sum group are
normalized and the tables hold no padding marker.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import pstats
import resource
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jaxpc  # noqa: E402
from _data import blurred_noise_images  # noqa: E402
from jaxpc import circuit as _circuit  # noqa: E402
from jaxpc import distributions, structures  # noqa: E402
from jaxpc.compiler import compile as _compile  # noqa: E402
from jaxpc.structures import hclt  # noqa: E402

# (phase, owner, attribute): the functions timed inside jaxpc.compile
PHASES = (
    ("levels", _compile, "_levels"),
    ("sources", _compile, "_sources"),
    ("place sums", _compile, "_place_sums"),
    ("place inputs", _compile, "_place_inputs"),
    ("stages", _compile, "_build_stage"),
    ("gates", _compile, "_place_gates"),
    ("scans", _compile, "group_scans"),
    ("single reader", _compile, "_single_reader"),
    ("var dists", _compile, "_var_dists"),
    ("pflows", _compile, "_pflow_plan"),
    ("chain", _compile, "_with_chain"),
    ("fold", _compile, "_build_fold"),
    ("fold", _compile, "_with_fold"),
    ("finalize", _compile, "finalize_tables"),
    ("device_put", _circuit.jax, "device_put"),
    ("params (host)", _circuit.Circuit, "_host_params"),
)


def cpu_seconds() -> float:
    """User and system CPU seconds of the process, all threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class PhaseTimer:
    """Wraps the :data:`PHASES` functions while active; wall and CPU seconds per phase, each call counted in its
    outermost timed phase only."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self._depth = 0

    def _wrap(self, name, fn):
        def timed(*args, **kw):
            if self._depth:
                return fn(*args, **kw)
            self._depth += 1
            t, c = time.perf_counter(), cpu_seconds()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t
                self.cpu[name] = self.cpu.get(name, 0.0) + cpu_seconds() - c
                self._depth -= 1
        return timed

    @contextlib.contextmanager
    def active(self):
        saved = [(owner, attr, owner.__dict__[attr]) for _, owner, attr in PHASES if attr in owner.__dict__]
        for name, owner, attr in PHASES:
            if attr in owner.__dict__:
                setattr(owner, attr, self._wrap(name, getattr(owner, attr)))
        try:
            yield self
        finally:
            for owner, attr, fn in saved:
                setattr(owner, attr, fn)


class PeakRSS:
    """The process's resident memory sampled every 2 ms in a thread: ``peak_mb`` above the value at start."""

    def __init__(self):
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def peak_mb(self) -> float:
        return (self.peak - self.start) / 2**20


def check(c) -> None:
    """Every sum group's weights normalized per parent node (over its segment), no -2 left in the tables."""
    for g in c.layout.sum_groups:
        w = np.exp(np.asarray(c.params["sum"][g.key], np.float64)).sum(axis=2)
        seg = np.asarray(c.tables["groups"][g.key]["seg"])
        tot = np.zeros((g.num_segments, g.Kp))
        np.add.at(tot, seg, w)
        assert np.allclose(tot, 1.0, atol=1e-3), g.key
    assert all(int(np.asarray(a).min(initial=0)) != -2 for a in jax.tree_util.tree_leaves(c.tables))


def one(build, L: int, profile: bool, kind: str = "HCLT") -> dict:
    """Build (``build(L)``: the root node) and compile one circuit, timing each phase."""
    gc.collect()  # the last circuit's arrays (a Circuit is part of reference cycles)
    t = time.perf_counter()
    node = build(L)
    structure = time.perf_counter() - t
    prof = cProfile.Profile() if profile else None
    with PhaseTimer().active() as timer, PeakRSS() as mem:
        if prof:
            prof.enable()
        t, cpu = time.perf_counter(), cpu_seconds()
        c = jaxpc.compile(node)
        jax.block_until_ready(c.params)
        total, cpu = time.perf_counter() - t, cpu_seconds() - cpu
        if prof:
            prof.disable()
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    check(c)
    phases, phases_cpu = dict(timer.seconds), dict(timer.cpu)
    phases["other"] = total - sum(phases.values())
    phases_cpu["other"] = cpu - sum(phases_cpu.values())
    return dict(kind=kind, L=L, edges=c.num_edges, structure_s=structure, compile_s=total, compile_cpu_s=cpu,
                phases=phases, phases_cpu=phases_cpu, peak_mb=mem.peak_mb, s_per_medge=total / (c.num_edges / 1e6))


def summary(r: dict) -> str:
    """Two lines: the totals, then each phase's wall / CPU seconds, largest first."""
    split = ", ".join(f"{k} {v:.3f}/{r['phases_cpu'][k]:.3f}"
                      for k, v in sorted(r["phases"].items(), key=lambda kv: -kv[1]) if v >= 5e-4)
    return (f"{r['kind']}-{r['L']}: {r['edges'] / 1e6:.1f}M edges | structure {r['structure_s']:.3f} s | jaxpc.compile "
            f"{r['compile_s']:.2f} s, CPU {r['compile_cpu_s']:.2f} s ({r['s_per_medge'] * 1e3:.2f} ms per M edges) | "
            f"peak RSS +{r['peak_mb']:.0f} MiB\n  wall/CPU s: {split}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latents", default="128,256,512,1024")
    p.add_argument("--pd", default="", help="PD latents too (split_intervals=(2, 7), as benchmarks/scale.py)")
    p.add_argument("--hclt-rows", type=int, default=1000, help="images the tree is learned from")
    p.add_argument("--reps", type=int, default=1, help="compiles per size; the fastest is reported")
    p.add_argument("--profile", type=int, default=None, help="cProfile the compile of this many latents")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="write a log-log plot of compile seconds against edges here (PNG)")
    args = p.parse_args(argv)
    print(f"jax {jax.__version__}, numpy {np.__version__}, device {jax.devices()[0].device_kind}")
    x = blurred_noise_images(args.hclt_rows)
    t = time.perf_counter()
    mi = hclt.mutual_information(x)
    t_mi = time.perf_counter() - t
    children, root = hclt.chow_liu_tree(mi)
    t_tree = time.perf_counter() - t - t_mi
    print(f"tree learning ({args.hclt_rows} images, {x.shape[1]} variables): mutual information {t_mi:.2f} s, "
          f"Chow-Liu tree {t_tree:.2f} s")
    cat = distributions.Categorical(num_cats=256)
    builds = [("HCLT", int(v), lambda L: hclt.hidden_tree_circuit(children, root, L, list(range(len(children))), cat))
              for v in args.latents.split(",") if v]
    builds += [("PD", int(v), lambda L: structures.PD((28, 28), L, split_intervals=(2, 7), input_dist=cat))
               for v in args.pd.split(",") if v]
    results = []
    for kind, L, build in builds:
        runs = [one(build, L, args.profile == L and r == 0, kind) for r in range(args.reps)]
        best = min(runs, key=lambda r: r["compile_s"])
        results.append(best)
        print(summary(best), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(mutual_information_s=t_mi, tree_s=t_tree, results=results), f, indent=1)
    if args.plot:
        plot(results, args.plot)
    return results


def plot(results: list, path: str) -> None:
    """``jaxpc.compile``'s wall seconds against the edges, log-log, per structure beside the line through its
    smallest size that grows linearly in the edges: points on or under it grow at most linearly."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for kind, mark in (("HCLT", "o-"), ("PD", "s-")):
        rs = [r for r in results if r.get("kind", "HCLT") == kind]
        if not rs:
            continue
        edges = np.array([r["edges"] for r in rs], float)
        secs = np.array([r["compile_s"] for r in rs], float)
        line, = ax.loglog(edges, secs, mark, label=f"jaxpc.compile ({kind})")
        ax.loglog(edges, secs[0] * edges / edges[0], "--", color=line.get_color(), alpha=0.5,
                  label=f"linear from {kind}-{rs[0]['L']}")
        for r, e, s in zip(rs, edges, secs):
            ax.annotate(f"L={r['L']}", (e, s), textcoords="offset points", xytext=(4, -10), fontsize=8)
    ax.set_xlabel("edges")
    ax.set_ylabel("host seconds")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
