"""The error of each precision setting against float64, on the device it runs on.

    python benchmarks/precision_error.py [--workloads hclt,hmm] [--batch 128]
                                         [--precisions default,fp32,tf32,bf16,tf32+clusters,default+noclusters]
                                         [--latents N] [--small]
                                         [--compile-threads 6] [--json out.json]

For each workload one node graph is compiled twice: in float32 (``jaxpc.compile(root)``) and in float64
(``jaxpc.compile(root, dtype=jnp.float64)``, ``jax_enable_x64`` on) with the float32 parameters cast to
float64; the reference is the float64 circuit at ``Options(precision="fp32")`` (exact products). For each
precision setting ``p`` the float32 circuit runs with ``options=jaxpc.Options(precision=p)`` on the same
batch, and the table gives:

- log-likelihoods (``c.log_prob``): the largest relative error over the samples, ``max_b |ll_b - ref_b| / |ref_b|``;
- flows (``c.flows``): per group (each array of the flows pytree: a sum group ``[P, Kp, Kc]`` or an input
  layer's statistics) the largest absolute error divided by that group's largest reference flow, and the
  largest of these over the groups, with the group that attains it;
- one EM step (``c.em_step(..., step_size=0.1, pseudocount=0.1)``): the largest absolute error of the new
  normalized weights (sum weights, and the probabilities ``exp(log_probs)`` of categorical leaves), and where.

A setting the installed jaxpc does not accept is reported as such. The row marked "default call" is the
setting equal to ``Options()``, what ``c.flows(params, x)`` runs with no options.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jaxpc  # noqa: E402
from _data import blurred_noise_images  # noqa: E402
from bench_engine import compile_all  # noqa: E402
from jaxpc import distributions, structures  # noqa: E402

EM_KW = dict(step_size=0.1, pseudocount=0.1)


def _leaves(tree) -> list[tuple[str, np.ndarray]]:
    return [(jax.tree_util.keystr(path), np.asarray(leaf, np.float64))
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _weights(name: str, a: np.ndarray) -> np.ndarray:
    """Normalized weights of a parameter array: probabilities for arrays of log-probabilities."""
    return np.exp(a) if "log" in name else a


def errors(got: dict, ref: dict) -> dict:
    """The three error figures of one setting (``got`` and ``ref``: ``ll``, ``flows``, ``em`` outputs)."""
    ll, ll_ref = np.asarray(got["ll"], np.float64), np.asarray(ref["ll"], np.float64)
    out = dict(ll_max_rel=float(np.max(np.abs(ll - ll_ref) / np.maximum(np.abs(ll_ref), 1e-300))))
    worst = (-1.0, None)
    for (name, a), (_, b) in zip(_leaves(got["flows"]), _leaves(ref["flows"])):
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        e = float(np.max(np.abs(a - b))) / scale if scale > 0 else float(np.max(np.abs(a - b), initial=0.0))
        worst = max(worst, (e, name), key=lambda t: t[0])
    out.update(flows_max_rel_to_group_max=worst[0], flows_worst_group=worst[1])
    worst = (-1.0, None)
    for (name, a), (_, b) in zip(_leaves(got["em"]), _leaves(ref["em"])):
        e = float(np.max(np.abs(_weights(name, a) - _weights(name, b)), initial=0.0))
        worst = max(worst, (e, name), key=lambda t: t[0])
    out.update(em_max_abs=worst[0], em_worst_group=worst[1])
    return out


def run(name, root, x, precisions, threads) -> list[dict]:
    c32 = jaxpc.compile(root)
    c64 = jaxpc.compile(root, dtype=jnp.float64)
    p64 = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), c32.params)
    xj = jnp.asarray(x)
    settings = {}
    for p in precisions:
        try:  # "<precision>+clusters" / "+noclusters": the tree's levels on thread-block clusters or not
            prec, *extra = p.split("+")  # (Tuning.tree_clusters True / False; else the default, None)
            clusters = True if "clusters" in extra else False if "noclusters" in extra else None
            settings[p] = jaxpc.Options(precision=prec, tuning=jaxpc.Tuning(tree_clusters=clusters))
        except (ValueError, TypeError) as e:
            settings[p] = e
    ref_opts = jaxpc.Options(precision="fp32")

    def calls(c, params, opts):
        kw = dict(options=opts, validate=False)
        return {"ll": lambda: c.log_prob(params, xj, **kw), "flows": lambda: c.flows(params, xj, **kw),
                "em": lambda: c.em_step(params, xj, **EM_KW, **kw)}

    jobs = [(c64, p64, ref_opts)] + [(c32, c32.params, o) for o in settings.values() if isinstance(o, jaxpc.Options)]
    fns = [(c, pr, o, k, f) for c, pr, o in jobs for k, f in calls(c, pr, o).items()]
    compile_all([(lambda _x, f=f: f(), None) for *_, f in fns], threads)  # every executable compiled, a few at a time
    ref = {k: f() for k, f in calls(c64, p64, ref_opts).items()}
    default = jaxpc.Options()
    rows = []
    for p, o in settings.items():
        row = dict(workload=name, B=int(x.shape[0]), precision=p)
        if not isinstance(o, jaxpc.Options):
            row["error"] = f"not accepted by this jaxpc: {o}"
        else:
            row["default_call"] = o == default
            row.update(errors({k: f() for k, f in calls(c32, c32.params, o).items()}, ref))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if not any(r.get("default_call") for r in rows):  # Options() is none of the settings: measure it too
        row = dict(workload=name, B=int(x.shape[0]), precision=f"Options() = {default.precision!r}", default_call=True)
        row.update(errors({k: f() for k, f in calls(c32, c32.params, default).items()}, ref))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def table(rows) -> str:
    out = ["| workload | B | precision | log-lik. max rel. err | flows max err / group max (group) "
           "| EM step max abs err of weights (group) |", "| --- | ---: | --- | ---: | ---: | ---: |"]
    for r in rows:
        p = r["precision"] + (" (default call)" if r.get("default_call") else "")
        if "error" in r:
            out.append(f"| {r['workload']} | {r['B']} | {p} | {r['error']} | | |")
            continue
        out.append(f"| {r['workload']} | {r['B']} | {p} | {r['ll_max_rel']:.2e} "
                   f"| {r['flows_max_rel_to_group_max']:.2e} "
                   f"(`{r['flows_worst_group']}`) | {r['em_max_abs']:.2e} (`{r['em_worst_group']}`) |")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="hclt,hmm", help="any of hclt, hmm, pd")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--precisions", default="default,fp32,tf32,bf16")
    p.add_argument("--latents", type=int, default=None, help="every workload with this many latents (smoke runs)")
    p.add_argument("--small", action="store_true", help="a small HMM (T=16, V=256) and 1,000 images (smoke runs)")
    p.add_argument("--compile-threads", type=int, default=6, help="executables compiled at a time")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; reference: float64 circuit, precision 'fp32'",
          flush=True)
    rng = np.random.default_rng(0)
    B = args.batch
    cat = distributions.Categorical(num_cats=256)
    rows = []
    imgs = None
    for w in args.workloads.split(","):
        if w == "hmm":
            L = args.latents or 1024
            T, V = (16, 256) if args.small else (64, 4096)
            name, root, x = f"HMM-{L}", structures.HMM(T, L, V), rng.integers(0, V, (B, T)).astype(np.int32)
        elif w in ("hclt", "pd"):
            if imgs is None:
                imgs = blurred_noise_images(1_000 if args.small else 10_000)
            x = imgs[rng.integers(0, len(imgs), B)]
            if w == "hclt":
                L = args.latents or 256
                name, root = f"HCLT-{L}", structures.HCLT(imgs, L, input_dist=cat)
            else:
                L = args.latents or 128
                name, root = f"PD-{L}", structures.PD((28, 28), L, split_intervals=(4, 4), input_dist=cat)
        else:
            raise SystemExit(f"unknown workload {w!r}; choose from hclt, hmm, pd")
        rows += run(name, root, x, args.precisions.split(","), args.compile_threads)
    t = table(rows)
    print("\n" + t, flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows, "table": t},
                      f, indent=1)
    return rows


if __name__ == "__main__":
    main()
