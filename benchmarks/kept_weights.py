"""The tree's weight copies kept per parameter array: HCLT-256's default call with them and as before them.

    python benchmarks/kept_weights.py [--latents 256] [--batches 16,32,64,128] [--reps 200]

Where the tree's levels run on thread-block clusters (Hopper GPUs, batches up to 64), the kernels read the
log-weights' exponentials rounded to TF32 (``mosaic_tree.tf32_weights``) and, for the flows, their transpose
(``tf32_weights_t``). The call path makes both once per parameter array and hands them to the executable
(``Runtime.kept``); before, every call made them inside its executable. Per batch, for ``c.flows(c.params, x)`` and
``c.log_prob(c.params, x)``:

* check: the default call against the same call traced inside ``jax.jit`` (which makes its copies in the
  executable), the largest absolute difference of the log-likelihoods and of every flow (0 where bit for bit);
* time, ms per call, median of ``--reps`` synchronized calls and the mean of ``--reps`` pipelined ones (dispatched
  back to back, then waited for), alternated in blocks: ``kept`` (the default call), ``inside`` (the same call with
  the copies made inside the executable, as before: ``Runtime.tree_weights`` answering None) and ``changing`` (the
  default call on one of four parameter objects in turn, so each call makes its copies anew).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latents", type=int, default=256)
    p.add_argument("--batches", default="16,32,64,128")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import jaxpc
    from profile_step import build

    c, data = build("hclt", args.latents)
    group = c.layout.fold.tree.group if c.layout.fold is not None and c.layout.fold.tree is not None else None
    params = [c.params] + [{**c.params, "sum": {**c.params["sum"], group: c.params["sum"][group] + 0.0}}
                           for _ in range(3)] if group else [c.params]
    rt = c.runtime
    kept_weights = rt.tree_weights
    print(f"HCLT-{args.latents} on {jax.devices()[0].device_kind}, jax {jax.__version__}; tree group {group}",
          flush=True)
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        xs = [jnp.asarray(data[i * B:(i + 1) * B]) for i in range(4)]
        entries = {"flows": lambda p, x: c.flows(p, x, return_ll=True), "log_prob": lambda p, x: c.log_prob(p, x)}
        for name, call in entries.items():
            traced = jax.jit(call)
            diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
                jax.tree_util.tree_leaves(call(c.params, xs[0])), jax.tree_util.tree_leaves(traced(c.params, xs[0]))))
            kept = bool(rt.tree_weights(c.layout, c.params, B, (name, None), jaxpc.Options, name == "flows"))
            modes = {"kept": lambda i: call(c.params, xs[i % 4]),
                     "inside": lambda i: call(c.params, xs[i % 4]),
                     "changing": lambda i: call(params[i % len(params)], xs[i % 4])}
            sync = {m: [] for m in modes}
            piped = {m: [] for m in modes}
            for _ in range(4):
                for mode, fn in modes.items():
                    rt.tree_weights = (lambda *a, **k: None) if mode == "inside" else kept_weights
                    for i in range(8):
                        jax.block_until_ready(fn(i))
                    c.wait_compiled()
                    for i in range(args.reps // 4):
                        t = time.perf_counter()
                        jax.block_until_ready(fn(i))
                        sync[mode].append(time.perf_counter() - t)
                    t = time.perf_counter()
                    outs = [fn(i) for i in range(args.reps // 4)]
                    jax.block_until_ready(outs)
                    piped[mode].append((time.perf_counter() - t) / (args.reps // 4))
            rt.tree_weights = kept_weights
            row = {"batch": B, "entry": name, "kept_route": kept, "max_abs_diff_vs_traced": diff,
                   **{f"{m}_sync_ms": 1e3 * statistics.median(v) for m, v in sync.items()},
                   **{f"{m}_piped_ms": 1e3 * statistics.fmean(v) for m, v in piped.items()}}
            rows.append(row)
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "latents": args.latents, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
