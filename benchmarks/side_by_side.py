"""jaxpc's default call beside its tuned path and PyJuice 2.6.3's fastest path on the same GPU, in one run.

    python benchmarks/side_by_side.py [--workloads hmm,hclt,pd] [--batches 16,128,512] [--reps 20]
                                      [--precision tf32] [--tuned-entries flows,log_prob]
                                      [--pyjuice-modes graph,graph_hook,eager] [--systems jaxpc,pyjuice,dynamax]
                                      [--codd] [--impl auto] [--no-fold] [--budget-s 560] [--json out.json]

The headline is jaxpc's **default call**, what a user writes: ``c.flows(params, x)`` (also
``c.log_prob(params, x)`` and ``c.em_step(params, x, step_size=0.1, pseudocount=0.1)``), no options, inputs
validated. Beside it: jaxpc's tuned path (the same calls with ``options=jaxpc.Options(precision="tf32")``
and ``validate=False``; ``--precision``, ``--impl`` and ``--no-fold`` change its options) and the ratio
default / tuned; PyJuice on its fastest path (``graph``: an explicit forward then
``pc.backward(x, flows_memory=1.0)``, CUDA graphs recorded in one dry run and replayed), its autograd hook
(``graph_hook``: ``pc(x).mean().backward()`` on the same graphs) and its eager README loop (``eager``); for
the HMM also dynamax 1.0.3's ``hmm_filter`` (vmapped, ``value_and_grad`` w.r.t. the log-parameters: the same
flows) and a plain ``lax.scan``. The headline ratio is PyJuice fastest / jaxpc default. A legend under the
tables gives the exact call behind every column.

Each system runs in its own child process per workload (``bench_engine.py`` for jaxpc, which checks its
answers against a reference first and reports its executables' memory; ``_pyjuice.py`` for PyJuice, with
torch's max allocated memory), one after the other, within ``--budget-s`` seconds in all; a child that
overruns is stopped and reported, and one that exits with an error before its first row runs once more
(``--crash-retries``; the crash stays among the reported errors). ``--codd`` adds the CoDD workload (``codd.py`` beside
``_pyjuice.run_codd``). Absent packages (pyjuice, dynamax) are reported and skipped. The workloads are those
of BENCHMARKS.md: HMM-1024 (T=64, V=4096), HCLT-256 and PD-128 on 28x28 images with 256 levels.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _children  # noqa: E402

LATENTS = {"hmm": 1024, "hclt": 256, "pd": 128}
NAMES = {"hmm": "HMM", "hclt": "HCLT", "pd": "PD"}


# ---------------------------------------------------------------------------------------------------------
# children: one system on one workload, rows appended as JSON lines to --rows-file
# ---------------------------------------------------------------------------------------------------------
def child_jaxpc(args, w: str) -> list:
    import jax

    import bench_engine

    with tempfile.TemporaryDirectory() as d:
        rows = bench_engine.main(
            ["--workloads", w, "--batches", args.batches, "--reps", str(args.reps), "--precision", args.precision,
             "--impl", args.impl, "--tuned-entries", args.tuned_entries, "--compile-threads",
             str(args.compile_threads), "--json", str(Path(d) / "rows.json")]
            + ([] if args.fold else ["--no-fold"]) + (["--small"] if args.small else [])
            + (["--latents", str(args.latents)] if args.latents else []))
    dev = dict(device=jax.devices()[0].device_kind, jax=jax.__version__)
    out = []
    for r in rows:
        scan = r["workload"] == "scan-HMM"
        out.append(dict(r, **dev, system="scan" if scan else "jaxpc", workload=w, name=r["workload"]))
    return out


def child_dynamax(args, w: str, T=64, V=4096) -> list:
    """dynamax's filter on the same HMM: forward, and forward + gradient w.r.t. the log-parameters, at JAX's
    default precision (TF32 on NVIDIA GPUs) and, with ``--precision fp32``, at ``highest``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import bench_engine

    try:
        from dynamax.hidden_markov_model.inference import hmm_filter
    except Exception as e:  # noqa: BLE001 - report any broken install
        return [dict(system="dynamax", workload=w, error=f"import failed: {e!r}")]
    L = args.latents or LATENTS["hmm"]
    if args.small:
        T, V = 16, 256
    rng = np.random.default_rng(0)
    la = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(L, L)), jnp.float32), axis=1)
    lb = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(L, V)), jnp.float32), axis=1)
    lg = jax.nn.log_softmax(jnp.asarray(rng.normal(size=L), jnp.float32))

    def total_ll(la, lb, lg, x):
        def one(xs):
            return hmm_filter(jnp.exp(lg), jnp.exp(la), lb[:, xs].T).marginal_loglik
        return jnp.sum(jax.vmap(one)(x))

    prec = "highest" if args.precision == "fp32" else "default"
    call = (f"jax.jit(jax.value_and_grad(total_ll, argnums=(0, 1, 2))) over vmapped hmm_filter, "
            f"jax.default_matmul_precision({prec!r})")
    rows = []
    for B in [int(b) for b in args.batches.split(",")]:
        xs = [jnp.asarray(rng.integers(0, V, (B, T)).astype(np.int32)) for _ in range(4)]
        with jax.default_matmul_precision(prec):
            fwd = jax.jit(total_ll)
            vg = jax.jit(jax.value_and_grad(total_ll, argnums=(0, 1, 2)))
            f = bench_engine.median_ms(lambda xb: fwd(la, lb, lg, xb), xs, args.reps)
            g = bench_engine.median_ms(lambda xb: vg(la, lb, lg, xb), xs, args.reps)
        rows.append(dict(system="dynamax", workload=w, B=B, precision=prec, fwd_ms=f, flows_ms=g,
                         calls={"flows": call}))
        print(f"dynamax   B={B:4d} fwd {f:8.3f} ms | fwd+grad  {g:8.3f} ms", flush=True)
    return rows


def child_pyjuice(args, w: str) -> list:
    import _pyjuice

    reason = _pyjuice.available()
    if reason is not None:
        print(f"pyjuice   skipped: {reason}", flush=True)
        return [dict(system="pyjuice", workload=w, error=reason)]
    import torch

    images = None
    if w != "hmm":
        from _data import blurred_noise_images
        images = blurred_noise_images(1_000 if args.small else 10_000)
    hmm = dict(hmm_seq=16, hmm_vocab=256) if args.small else {}
    rows = _pyjuice.run_structure(w, [int(b) for b in args.batches.split(",")], latents=args.latents or LATENTS[w],
                                  reps=args.reps, modes=tuple(args.pyjuice_modes.split(",")), images=images, **hmm)
    for r in rows:
        r.update(device=torch.cuda.get_device_name(), torch=torch.__version__, latents=args.latents or LATENTS[w])
        print("pyjuice  ", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "calls"},
              flush=True)
    return rows


def child_codd(args, system: str) -> list:
    if system == "jaxpc":
        import codd
        return [codd.main(["--precision", args.precision])]
    import _pyjuice
    reason = _pyjuice.available()
    r = dict(system="pyjuice", workload="codd", error=reason) if reason else _pyjuice.run_codd()
    print("pyjuice   codd", r, flush=True)
    return [r]


CHILDREN = {"jaxpc": child_jaxpc, "dynamax": child_dynamax, "pyjuice": child_pyjuice}


# ---------------------------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------------------------
def _find(rows, system, w, B, mode=None):
    for r in rows:
        if (r.get("system") == system and r.get("workload") == w and r.get("B") == B
                and (mode is None or r.get("mode") == mode) and "error" not in r):
            return r
    return None


def _f(v, nd=2):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"


def _ratio(a, b):
    return "-" if a is None or b is None or not b else f"{a / b:.2f}x"


def tables(rows) -> tuple[str, str]:
    """The markdown tables (forward + flows; forward and EM step) and their legend."""
    get = lambda r, k: None if r is None else r.get(k)  # noqa: E731
    t1 = ["| workload | B | jaxpc default [A] | jaxpc tuned [B] | A / B | PyJuice fastest [C] | PyJuice hook [D] "
          "| PyJuice eager [E] | **C / A** | E / A | jaxpc MiB A / B | PyJuice MiB C | rel. err A / B "
          "| dynamax [F] | scan [G] |",
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    t2 = ["| workload | B | jaxpc log_prob default [H] | tuned [I] | PyJuice fwd fastest [J] | eager [K] | **J / H** "
          "| jaxpc em_step default [L] | tuned [M] | PyJuice EM fastest [N] | hook [O] | eager [P] | **N / L** |",
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    heads = []
    for w in LATENTS:
        for B in sorted({r["B"] for r in rows if r.get("workload") == w and "B" in r}):
            j = _find(rows, "jaxpc", w, B)
            pg, ph, pe = (_find(rows, "pyjuice", w, B, m) for m in ("graph", "graph_hook", "eager"))
            dx, sc = _find(rows, "dynamax", w, B), _find(rows, "scan", w, B)
            name = get(j, "name") or f"{NAMES[w]}-{get(pg or pe, 'latents') or LATENTS[w]}"
            a = get(j, "flows_ms")
            t1.append(f"| {name} | {B} | {_f(a)} | {_f(get(j, 'tuned_flows_ms'))} "
                      f"| {_pair(j) or _ratio(a, get(j, 'tuned_flows_ms'))} "
                      f"| {_f(get(pg, 'fwdbwd_ms'))} | {_f(get(ph, 'fwdbwd_ms'))} | {_f(get(pe, 'fwdbwd_ms'))} "
                      f"| **{_ratio(get(pg, 'fwdbwd_ms'), a)}** | {_ratio(get(pe, 'fwdbwd_ms'), a)} "
                      f"| {_f(get(j, 'mem_mib'), 0)} / {_f(get(j, 'tuned_mem_mib'), 0)} "
                      f"| {_f(get(pg or pe, 'peak_mib'), 0)} "
                      f"| {_e(get(j, 'rel_err'))} / {_e(get(j, 'tuned_rel_err'))} "
                      f"| {_f(get(dx, 'flows_ms'))} | {_f(get(sc, 'flows_ms'))} |")
            t2.append(f"| {name} | {B} | {_f(get(j, 'fwd_ms'))} | {_f(get(j, 'tuned_fwd_ms'))} "
                      f"| {_f(get(pg, 'fwd_ms'))} "
                      f"| {_f(get(pe, 'fwd_ms'))} | **{_ratio(get(pg, 'fwd_ms'), get(j, 'fwd_ms'))}** "
                      f"| {_f(get(j, 'em_ms'))} | {_f(get(j, 'tuned_em_ms'))} | {_f(get(pg, 'em_ms'))} "
                      f"| {_f(get(ph, 'em_ms'))} | {_f(get(pe, 'em_ms'))} "
                      f"| **{_ratio(get(pg, 'em_ms'), get(j, 'em_ms'))}** |")
            if a and get(pg, "fwdbwd_ms"):
                heads.append(f"{name} B={B}: {get(pg, 'fwdbwd_ms') / a:.2f}x")
    return "\n".join(t1), "\n".join(t2), heads


def _pair(j):
    """A / B from [A] and [B] called alternately (``bench_engine.paired_ms``), or None where not measured."""
    r = None if j is None else j.get("paired_ratio")
    return None if r is None else f"{r:.2f}x"


def _e(v):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1e}"


def legend(rows) -> list[str]:
    import _pyjuice

    jc = next((r["calls"] for r in rows if r.get("system") == "jaxpc" and "calls" in r), None)
    dc = next((r["calls"]["flows"] for r in rows if r.get("system") == "dynamax" and "calls" in r), None)
    sc = next((r["calls"]["flows"] for r in rows if r.get("system") == "scan" and "calls" in r), None)
    P = _pyjuice.CALLS
    lines = ["Milliseconds: medians of synchronized calls over 4 rotating device-resident batches; `c` the compiled "
             "jaxpc circuit, `pc` PyJuice's, `opt = juice.optim.MiniBatchEM(pc, step_size=0.1, pseudocount=0.1)`."]
    if jc:
        lines += [f"- [A] `{jc['default']['flows']}`", f"- [B] `{jc['tuned']['flows']}`",
                  f"- [H] `{jc['default']['log_prob']}`", f"- [I] `{jc['tuned']['log_prob']}`",
                  f"- [L] `{jc['default']['em_step']}`", f"- [M] `{jc['tuned']['em_step']}`",
                  "- A / B: the ratio of the medians of [A] and [B] called alternately in one loop (twice the "
                  "repetitions; the two calls see the same clocks), else of their separate timings",
                  "- jaxpc MiB: XLA's memory analysis of the flows executable (temporaries + arguments + outputs); "
                  "rel. err: largest relative l2 error of log-likelihoods and flows against the float32 reference "
                  "(HMM: log-likelihoods against float64 numpy)"]
    lines += [f"- [C] {P['graph']['fwdbwd']}, after {P['graph']['setup']}",
              f"- [D] {P['graph_hook']['fwdbwd']}, {P['graph_hook']['setup']}",
              f"- [E] {P['eager']['fwdbwd']}, {P['eager']['setup']}",
              f"- [J] {P['graph']['fwd']} replaying the graph; [K] {P['eager']['fwd']} eager",
              f"- [N] {P['graph']['em']} (graph); [O] {P['graph_hook']['em']} (graph); [P] {P['eager']['em']} (eager)",
              "- PyJuice MiB: `torch.cuda.max_memory_allocated()` during the [C] timing ([E] where [C] is missing)"]
    if dc:
        lines.append(f"- [F] dynamax: `{dc}`")
    if sc:
        lines.append(f"- [G] `{sc}`")
    return lines


# ---------------------------------------------------------------------------------------------------------
# parent
# ---------------------------------------------------------------------------------------------------------
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="hmm,hclt,pd")
    p.add_argument("--batches", default="16,128,512")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--precision", default="tf32", choices=["fp32", "tf32", "bf16"], help="the tuned path's precision")
    p.add_argument("--tuned-entries", default="flows,log_prob",
                   help="jaxpc entry points also timed on the tuned path (em_step too: one more executable per batch)")
    p.add_argument("--pyjuice-modes", default="graph,graph_hook,eager",
                   help="PyJuice modes (see _pyjuice.CALLS); 'default' is an old name of 'eager'")
    p.add_argument("--systems", default="jaxpc,pyjuice,dynamax",
                   help="which systems to run (split a long comparison over several calls)")
    p.add_argument("--codd", action="store_true", help="also run the CoDD workload in both systems")
    p.add_argument("--impl", default="auto", choices=["auto", "xla", "pallas", "pallas_forward", "triton"],
                   help="the tuned path's Options.impl")
    p.add_argument("--no-fold", dest="fold", action="store_false",
                   help="the tuned path with Options(fold_products=False) (the full layout)")
    p.add_argument("--compile-threads", type=int, default=6, help="jaxpc executables compiled at a time")
    p.add_argument("--budget-s", type=float, default=560.0, help="seconds for all children together")
    p.add_argument("--child-timeout", type=float, default=300.0, help="seconds for one child")
    p.add_argument("--crash-retries", type=int, default=1,
                   help="times a child that exits with an error before its first row runs again (each crash is "
                        "kept among the errors)")
    p.add_argument("--latents", type=int, default=None, help="every workload with this many latents (smoke runs)")
    p.add_argument("--small", action="store_true", help="small HMM (T=16, V=256) and 1,000 images (smoke runs)")
    p.add_argument("--json", default=None, help="write rows, tables and legend here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--rows-file", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:
        system, w = args.child.split(":")
        rows = child_codd(args, system) if w == "codd" else CHILDREN[system](args, w)
        _children.append_rows(args.rows_file, rows)
        return rows

    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(CHILDREN)
    if unknown:
        raise SystemExit(f"unknown --systems {sorted(unknown)}; choose from {sorted(CHILDREN)}")
    jobs = []
    for w in args.workloads.split(","):
        if w not in LATENTS:
            raise SystemExit(f"unknown workload {w!r}; choose from {sorted(LATENTS)}")
        jobs += [(s, w) for s in ("jaxpc", "dynamax", "pyjuice") if s in systems and (s != "dynamax" or w == "hmm")]
    if args.codd:
        jobs += [(s, "codd") for s in ("jaxpc", "pyjuice") if s in systems]
    passthrough = ["--batches", args.batches, "--reps", str(args.reps), "--precision", args.precision,
                   "--tuned-entries", args.tuned_entries, "--pyjuice-modes", args.pyjuice_modes, "--impl", args.impl,
                   "--compile-threads", str(args.compile_threads)]
    passthrough += ([] if args.fold else ["--no-fold"]) + (["--small"] if args.small else [])
    passthrough += ["--latents", str(args.latents)] if args.latents else []
    t_end = time.perf_counter() + args.budget_s
    rows = []
    for s, w in jobs:
        got, err = _children.run(__file__, passthrough, f"{s}:{w}", f"{s} {w}", t_end, args.child_timeout)
        for _ in range(args.crash_retries):
            if got or not (err or "").startswith("child exited"):
                break
            rows.append(dict(system=s, workload=w, error=f"{err} before its first row; run again"))
            got, err = _children.run(__file__, passthrough, f"{s}:{w}", f"{s} {w} (again)", t_end,
                                     args.child_timeout)
        rows += got
        if err:
            rows.append(dict(system=s, workload=w, error=err))
    t1, t2, heads = tables(rows)
    leg = legend(rows)
    print("\n### Forward + flows (ms)\n\n" + t1 + "\n\n### Forward and EM step (ms)\n\n" + t2 + "\n\n" + "\n".join(leg),
          flush=True)
    if heads:
        print("\nheadline, PyJuice fastest / jaxpc default call, forward + flows: " + "; ".join(heads), flush=True)
    for r in rows:
        if "error" in r:
            print(f"error: {r.get('system')} {r.get('workload')} B={r.get('B', '-')} {r.get('mode', '')}: {r['error']}",
                  flush=True)
    codd_rows = [r for r in rows if r.get("workload") == "codd"]
    for r in codd_rows:
        print(f"CoDD {r.get('system')}: " + json.dumps({k: v for k, v in r.items() if k != "workload"}, default=float),
              flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "forward_flows_table": t1, "forward_em_table": t2, "legend": leg,
                       "headline": heads, "args": vars(args)}, f, indent=1, default=float)
    return rows


if __name__ == "__main__":
    main()
