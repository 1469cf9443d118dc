"""jaxpc beside PyJuice 2.6.3 (and dynamax for the HMM) on the same GPU, in one run.

    python benchmarks/side_by_side.py [--workloads hmm,hclt,pd] [--batches 16,128,512] [--reps 25]
                                      [--precision tf32] [--pyjuice-modes default,graph] [--codd]
                                      [--impl auto|reference|pallas|pallas_forward] [--no-fold] [--json out.json]

Per workload and batch size: jaxpc's forward, forward + flows and EM-step ms with its executable's
memory (``bench_engine.py``, which first checks its answer against a reference), PyJuice's forward,
forward + backward (parameter flows) and EM-step ms with its peak allocated memory in each mode
(``_pyjuice.py``: ``default`` = eager, ``graph`` = CUDA-graph replay, its fastest), for the HMM also
dynamax 1.0.3's ``hmm_filter`` (vmapped, ``value_and_grad`` with respect to the log-parameters, the
same flows), and the ratios PyJuice / jaxpc of forward + flows. ``--codd`` adds the CoDD workload
(``codd.py`` beside ``_pyjuice.run_codd``). Absent packages (pyjuice, dynamax) are reported and skipped.
The workloads are those of BENCHMARKS.md: HMM-1024 (T=64, V=4096), HCLT-256 and PD-128 on 28x28
images with 256 levels.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with PyTorch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_engine  # noqa: E402
import codd  # noqa: E402
import _pyjuice  # noqa: E402
from _data import blurred_noise_images  # noqa: E402

LATENTS = {"hmm": 1024, "hclt": 256, "pd": 128}
NAMES = {"hmm": "HMM-1024", "hclt": "HCLT-256", "pd": "PD-128"}


def dynamax_rows(batches, reps, precision, T=64, L=1024, V=4096):
    """dynamax's filter on the same HMM: forward, and forward + gradient w.r.t. the log-parameters."""
    try:
        from dynamax.hidden_markov_model.inference import hmm_filter
    except Exception as e:  # noqa: BLE001 - report any broken install
        return [dict(system="dynamax", workload="hmm", error=f"import failed: {e!r}")]
    rng = np.random.default_rng(0)
    la = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(L, L)), jnp.float32), axis=1)
    lb = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(L, V)), jnp.float32), axis=1)
    lg = jax.nn.log_softmax(jnp.asarray(rng.normal(size=L), jnp.float32))

    def total_ll(la, lb, lg, x):
        def one(xs):
            return hmm_filter(jnp.exp(lg), jnp.exp(la), lb[:, xs].T).marginal_loglik
        return jnp.sum(jax.vmap(one)(x))

    prec = "highest" if precision == "fp32" else "default"
    rows = []
    for B in batches:
        xs = [jnp.asarray(rng.integers(0, V, (B, T)).astype(np.int32)) for _ in range(4)]
        with jax.default_matmul_precision(prec):
            fwd = jax.jit(total_ll)
            vg = jax.jit(jax.value_and_grad(total_ll, argnums=(0, 1, 2)))
            f = bench_engine.median_ms(lambda xb: fwd(la, lb, lg, xb), xs, reps)
            g = bench_engine.median_ms(lambda xb: vg(la, lb, lg, xb), xs, reps)
        rows.append(dict(system="dynamax", workload="hmm", B=B, precision=precision, fwd_ms=f, fwdbwd_ms=g))
        print(f"dynamax   B={B:4d} fwd {f:8.3f} ms | fwd+grad  {g:8.3f} ms", flush=True)
    return rows


def table(rows):
    """Markdown table: one line per workload and batch size, with the PyJuice / jaxpc ratios."""
    out = ["| workload | B | jaxpc fwd / fwd+flows / EM ms | jaxpc MiB | PyJuice graph fwd / fwd+bwd / EM ms "
           "| PyJuice default fwd+bwd ms | PyJuice peak MiB | dynamax fwd+grad ms | graph / jaxpc | default / jaxpc |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

    def find(system, w, B, mode=None):
        for r in rows:
            if (r.get("system") == system and r.get("workload") == w and r.get("B") == B
                    and (mode is None or r.get("mode") == mode) and "error" not in r):
                return r
        return None

    def f(v):
        return "-" if v is None else f"{v:.2f}"

    for w in LATENTS:
        for B in sorted({r["B"] for r in rows if r.get("workload") == w and "B" in r}):
            j, pg, pd_, dx = (find("jaxpc", w, B), find("pyjuice", w, B, "graph"), find("pyjuice", w, B, "default"),
                              find("dynamax", w, B))
            if j is None:
                continue
            rg = pg["fwdbwd_ms"] / j["flows_ms"] if pg else None
            rd = pd_["fwdbwd_ms"] / j["flows_ms"] if pd_ else None
            out.append(f"| {NAMES[w]} | {B} | {f(j['fwd_ms'])} / {f(j['flows_ms'])} / {f(j['em_ms'])} | "
                       f"{j['mem_mib']:.0f} | "
                       + (f"{f(pg['fwd_ms'])} / {f(pg['fwdbwd_ms'])} / {f(pg.get('em_ms'))}" if pg else "-")
                       + f" | {f(pd_['fwdbwd_ms']) if pd_ else '-'} | "
                       + f"{f((pg or pd_ or {}).get('peak_mib'))} | "
                       + f"{f(dx['fwdbwd_ms']) if dx else '-'} | "
                       + (f"{rg:.2f}x" if rg else "-") + " | " + (f"{rd:.2f}x" if rd else "-") + " |")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="hmm,hclt,pd")
    p.add_argument("--batches", default="16,128,512")
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--precision", default="tf32", choices=["fp32", "tf32", "bf16"])
    p.add_argument("--pyjuice-modes", default="default,graph")
    p.add_argument("--systems", default="jaxpc,pyjuice,dynamax",
                   help="which systems to run (split a long comparison over several calls)")
    p.add_argument("--codd", action="store_true", help="also run the CoDD workload in both systems")
    p.add_argument("--impl", default="auto", choices=["auto", "reference", "pallas", "pallas_forward"],
                   help="jaxpc's sum layers: the per-partition choice (auto, the default), XLA, the Pallas "
                        "kernels, or the Pallas forward only")
    p.add_argument("--no-fold", dest="fold", action="store_false",
                   help="jaxpc with Options(fold_products=False) (the full layout)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    systems = set(args.systems.split(","))
    unknown = systems - {"jaxpc", "pyjuice", "dynamax"}
    if unknown:
        raise SystemExit(f"unknown --systems {sorted(unknown)}; choose from jaxpc, pyjuice, dynamax")
    reason = _pyjuice.available() if "pyjuice" in systems else "not requested"
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; pyjuice: {reason or 'available'}", flush=True)
    rows = []
    images = None
    for w in args.workloads.split(","):
        if "jaxpc" in systems:
            with tempfile.TemporaryDirectory() as d:
                for r in bench_engine.main(["--workloads", w, "--batches", args.batches, "--reps", str(args.reps),
                                            "--precision", args.precision, "--impl", args.impl, "--out", d]
                                           + ([] if args.fold else ["--no-fold"])):
                    scan = r["workload"] == "scan-HMM"
                    rows.append(dict(r, system="scan" if scan else "jaxpc", workload="scan-hmm" if scan else w))
        if w == "hmm" and "dynamax" in systems:
            for r in dynamax_rows(batches, args.reps, args.precision):
                rows.append(r)
                if "error" in r:
                    print("dynamax  ", r["error"], flush=True)
        if reason is None:
            if w != "hmm" and images is None:
                images = blurred_noise_images(10_000)
            for r in _pyjuice.run_structure(w, batches, latents=LATENTS[w], reps=args.reps,
                                            modes=tuple(args.pyjuice_modes.split(",")), images=images):
                rows.append(r)
                print("pyjuice  ", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    if args.codd:
        if "jaxpc" in systems:
            rows.append(codd.main(["--precision", args.precision]))
        if reason is None:
            r = _pyjuice.run_codd()
            rows.append(r)
            print("pyjuice   codd", r, flush=True)
    print(table(rows), flush=True)
    if args.json:
        bench_engine.save_rows(Path(args.json).parent, Path(args.json).name, rows)


if __name__ == "__main__":
    main()
