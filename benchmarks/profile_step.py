"""Where a forward + flows step spends its GPU time: a ``jax.profiler`` trace, summarized per layer kind.

    python benchmarks/profile_step.py [--workload hclt|hmm|pd] [--latents 256] [--batch 16] [--split-intervals 4,4]
                                      [--precision tf32] [--impl auto] [--no-fold] [--unrolled] [--steps 5]
                                      [--param-flow-pass auto|inline|batched] [--top 15] [--json out.json]
                                      [--hlo out.hlo] [--public log_prob|flows|em_step|mpe|...]
                                      [--no-validate] [--propagation LL|MPE]
                                      [--tuning field=value+xla.option=value] [--neighbors NAME] [--timeline]

Runs ``circuit.flows`` under ``jax.profiler.trace`` and reads the trace's device events. Every kernel
is attributed by the ``jaxpc/...`` named scope in its HLO metadata to one of: ``input`` (leaf layers),
``prod fwd``, ``sum fwd``, ``prod bwd``, ``sum bwd``, ``chain scan`` (HMMs), ``select`` (the top-down choices
of ``mpe`` and ``sample``), ``other`` (buffer set-up, parameter-flow
scatter, gradient of the leaves). Prints per step: wall time, kernel count, summed kernel time
(``busy``) and the idle time between kernels (``wall - busy``: launch gaps, what a kernel count costs),
then the table by kind and the ``--top`` most expensive kernels with the HLO op each computes. ``--tuning``: the call
with ``Options(tuning=Tuning(...))`` (:func:`_options.tuning`'s spelling). ``--neighbors NAME``: for the first
occurrences of kernels whose name holds ``NAME`` in one step, the kernels just before and after (what a kernel that
carries no HLO op, such as a library's helper, belongs to). ``--timeline``: the last step's kernels in start order,
each with its start and end (us after the step's first kernel), its stream and its HLO op (which kernels overlap,
and the gaps between them). On a CPU host the trace has no device events and the
script says so.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jaxpc  # noqa: E402
from _data import blurred_noise_images  # noqa: E402
from _options import query_calls, tuning  # noqa: E402
from jaxpc import distributions, structures  # noqa: E402

SCOPE = re.compile(r"jaxpc/(input\d+|chain|select|partial[\d.]+|stage[\d.]+/(prod|sum)\d+(/backward)?)")


def build(workload: str, latents: int, split_intervals: tuple[int, int] = (4, 4)):
    """The workload's compiled circuit and data (PD: ``split_intervals``; ``(2, 7)`` gives ``scale.py``'s PDs)."""
    cat = distributions.Categorical(num_cats=256)
    if workload == "hmm":
        root = structures.HMM(64, latents, 4096)
        data = np.random.default_rng(0).integers(0, 4096, (4096, 64)).astype(np.int32)
    else:
        data = blurred_noise_images(10_000)
        if workload == "hclt":
            root = structures.HCLT(data, latents, input_dist=cat)
        else:
            root = structures.PD((28, 28), latents, split_intervals=split_intervals, input_dist=cat)
    return jaxpc.compile(root), data


def op_names(hlo_text: str) -> dict:
    """Instruction name -> ``op_name`` metadata (carries the ``jaxpc/...`` named scopes) of a compiled module."""
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.-]+) = .*?op_name=\"([^\"]*)\"", hlo_text, re.M):
        out[_norm(m.group(1))] = m.group(2)
    return out


def _norm(name: str) -> str:
    """Kernel names spell an instruction's ``.``/``-`` as ``_`` (``fusion.12`` runs as ``fusion_12``)."""
    return re.sub(r"[.\-]", "_", name)


def kind_of(event: dict, names: dict) -> str:
    kname = event.get("name", "")
    if kname.startswith("jaxpc_sum_"):  # the Pallas kernels carry their own names
        return "sum fwd" if kname.startswith("jaxpc_sum_forward") else "sum bwd"
    args = event.get("args", {})
    text = (names.get(_norm(str(args.get("hlo_op", ""))), "") or names.get(_norm(event.get("name", "")), "")
            or json.dumps(args) + " " + event.get("name", ""))
    m = SCOPE.search(text)
    if m is None:
        return "other"
    s = m.group(1)
    if s.startswith("input"):
        return "input"
    if s == "chain":
        return "chain scan"
    if s == "select":
        return "select"
    layer = "prod" if m.group(2) == "prod" else "sum"
    return f"{layer} {'bwd' if m.group(3) else 'fwd'}"


def print_timeline(ev: list[dict], names: dict) -> None:
    """The last step of the start-ordered kernel events ``ev`` (steps split at gaps over 200 us), one line each."""
    first = len(ev) - 1
    while first > 0 and float(ev[first]["ts"]) - max(float(e["ts"]) + float(e.get("dur", 0.0))
                                                     for e in ev[:first]) <= 200:
        first -= 1
    t0, last_end = float(ev[first]["ts"]), float(ev[first]["ts"])
    print(f"timeline of the last step ({len(ev) - first} kernels; start / end us, gap after the previous end):")
    for e in ev[first:]:
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        op = names.get(_norm(str(e.get("args", {}).get("hlo_op", ""))), "") or names.get(_norm(e.get("name", "")), "")
        print(f"  {ts - t0:8.1f} {ts + dur - t0:8.1f} {ts - last_end:+7.1f}  s{e.get('tid')} "
              f"{e.get('name', '?')[:48]:48s} {op[-70:]}")
        last_end = max(last_end, ts + dur)


def load_trace(trace_dir: str) -> tuple[list[dict], set] | None:
    """``(events, the GPU devices' process ids)`` of the last trace written under ``trace_dir``, or None."""
    files = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "*.trace.json.gz"))
    if not files:
        return None
    events = json.load(gzip.open(sorted(files)[-1]))["traceEvents"]
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "/device:" in str(e.get("args", {}).get("name", "")) and "CPU" not in str(e["args"]["name"])}
    return events, gpu_pids


def device_events(trace_dir: str, host: bool = False) -> list[dict]:
    """The trace's kernel events (``host``: the CPU backend's thunks instead, to try the script on a CPU)."""
    trace = load_trace(trace_dir)
    if trace is None:
        return []
    events, gpu_pids = trace
    if host:
        return [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]
    stream_tids = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
                   and e.get("pid") in gpu_pids and "stream" in str(e.get("args", {}).get("name", "")).lower()
                   and "memcpy" not in str(e["args"]["name"]).lower()}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids
            and (not stream_tids or (e["pid"], e.get("tid")) in stream_tids)]


def print_neighbors(ev: list[dict], needle: str, names: dict, per_step: int, shown: int = 8) -> None:
    """The kernels just before and after the first ``shown`` kernels of one step (``ev``: time-ordered) whose name
    holds ``needle``, each with its HLO op where it has one."""
    def label(e):
        hlo = str(e.get("args", {}).get("hlo_op", ""))
        op = names.get(_norm(hlo), "") or names.get(_norm(e.get("name", "")), "")
        return f"{e.get('name', '?')[:50]} {float(e.get('dur', 0.0)):.1f}us [{hlo or '-'}] {op[-70:]}"

    hits = [i for i, e in enumerate(ev[:per_step]) if needle in e.get("name", "")]
    print(f"{len(hits)} kernels named *{needle}* in the first step; around the first {min(shown, len(hits))}:")
    for i in hits[:shown]:
        for j in range(max(0, i - 2), min(len(ev), i + 3)):
            print(("  > " if j == i else "    ") + label(ev[j]))
        print("    --")


def add_step_args(p: argparse.ArgumentParser):
    """The step's workload, size, batch, precision and sum-layer impl (shared with ``dispatch.py``)."""
    p.add_argument("--workload", default="hclt", choices=["hclt", "hmm", "pd"])
    p.add_argument("--latents", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--precision", default="tf32", choices=["fp32", "tf32", "bf16"])
    p.add_argument("--impl", default="auto", choices=["auto", "xla", "pallas", "pallas_forward", "triton"])
    p.add_argument("--split-intervals", default="4,4",
                   help="PD's split intervals a,b (2,7 with --latents 256 --batch 1024: scale.py's pd3)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_args(p)
    p.add_argument("--no-fold", dest="fold", action="store_false",
                   help="Options(fold_products=False): the full layout instead of the folded plan")
    p.add_argument("--unrolled", action="store_true", help="Options(scan_stages=False): repeated stages unrolled")
    p.add_argument("--param-flow-pass", default="auto", choices=["auto", "inline", "batched"],
                   help="Options.param_flow_pass")
    p.add_argument("--public", default=None, choices=["log_prob", "flows", "em_step", "conditional", "mpe", "sample"],
                   help="profile this entry point's default public call (c.log_prob(c.params, x), ...) instead")
    p.add_argument("--no-validate", dest="validate", action="store_false",
                   help="with --public: the call with validate=False (no input check in the executable)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=15, help="how many of the most expensive kernels to print")
    p.add_argument("--json", default=None, help="also write the summary and every kernel's time here")
    p.add_argument("--hlo", default=None, help="also write the compiled step's HLO text here")
    p.add_argument("--tuning", default="", help="the call with Options(tuning=Tuning(...)): a=1+xla.b=true")
    p.add_argument("--propagation", default="LL", choices=["LL", "MPE"],
                   help="Options.propagation: MPE profiles the max-product forward and, for flows, hard EM's")
    p.add_argument("--no-kernel-shifts", dest="kernel_shifts", action="store_false",
                   help="Options(kernel_shifts=False): the flow pass recomputes shifts and searches first maximizers")
    p.add_argument("--neighbors", default=None, help="print the kernels around those whose name holds this")
    p.add_argument("--timeline", action="store_true", help="print the last step's kernels with start and end")
    args = p.parse_args(argv)
    c, data = build(args.workload, args.latents, tuple(int(v) for v in args.split_intervals.split(",")))
    opts = jaxpc.Options(precision=args.precision, impl=args.impl, fold_products=args.fold,
                         scan_stages=not args.unrolled, param_flow_pass=args.param_flow_pass,
                         propagation=args.propagation, kernel_shifts=args.kernel_shifts)
    extra = {}
    if args.tuning or args.propagation != "LL" or not args.kernel_shifts:
        extra["options"] = jaxpc.Options(tuning=tuning(args.tuning) if args.tuning else jaxpc.Tuning(),
                                         propagation=args.propagation, kernel_shifts=args.kernel_shifts)
        opts = opts.replace(tuning=extra["options"].tuning)
    xs = [jnp.asarray(data[i * args.batch:(i + 1) * args.batch]) for i in range(4)]
    if args.public:
        entry = getattr(c, args.public)
        call = query_calls(c, jnp.asarray, validate=args.validate, **extra).get(args.public)
        if call is None:
            def call(x):
                return entry(c.params, x, validate=args.validate, **extra)

        t = time.perf_counter()
        jax.block_until_ready(call(xs[0]))
        first = time.perf_counter() - t
        jax.block_until_ready(call(xs[1]))  # (traces the optimized executable where the first call ran a quick one)
        c.wait_compiled()
        print(f"c.{args.public}: first call {first:.1f} s (trace, compile and run); the optimized executable "
              f"{time.perf_counter() - t - first:.1f} s after")
        text = c.compiled(args.public).as_text()
    else:
        step = jax.jit(lambda t, p, x: jaxpc.engine.em.flows_and_ll(c.layout, t, p, x, None, None, opts))
        exe = step.lower(c.tables, c.params, xs[0]).compile()
        text = exe.as_text()

        def call(x):
            return exe(c.tables, c.params, x)

    names = op_names(text)
    if args.hlo:
        Path(args.hlo).write_text(text)
    for x in xs:
        jax.block_until_ready(call(x))
    walls = []
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for i in range(args.steps):
                t = time.perf_counter()
                jax.block_until_ready(call(xs[i % 4]))
                walls.append(time.perf_counter() - t)
        events = device_events(d, os.environ.get("JAXPC_PROFILE_HOST") == "1")
    wall = 1e3 * float(np.median(walls))
    head = (f"{args.workload}-{args.latents} B={args.batch} "
            + (f"c.{args.public}(c.params, x{'' if args.validate else ', validate=False'})" if args.public
               else f"{args.precision} {args.impl}")
            + f": wall {wall:.2f} ms/step")
    if not events:
        print(head + "; the trace holds no device kernels (CPU host?)")
        return
    per_kind = collections.defaultdict(lambda: [0, 0.0])
    per_name = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        k = per_kind[kind_of(e, names)]
        k[0] += 1
        k[1] += float(e.get("dur", 0.0))
        n = per_name[(kind_of(e, names), e.get("name", "?"))]
        n[0] += 1
        n[1] += float(e.get("dur", 0.0))
    steps = args.steps
    busy = sum(v[1] for v in per_kind.values()) / steps / 1e3
    count = sum(v[0] for v in per_kind.values()) / steps
    print(f"{head}; {count:.0f} kernels/step, busy {busy:.2f} ms, idle {wall - busy:.2f} ms "
          f"({1e3 * (wall - busy) / max(count, 1):.1f} us per kernel)")
    # device span of a step: first kernel start to last kernel end (steps split at gaps over 200 us)
    ev = sorted(events, key=lambda e: float(e["ts"]))
    spans, start, end = [], float(ev[0]["ts"]), float(ev[0]["ts"]) + float(ev[0].get("dur", 0.0))
    for e in ev[1:]:
        ts = float(e["ts"])
        if ts - end > 200:
            spans.append(end - start)
            start = ts
        end = max(end, ts + float(e.get("dur", 0.0)))
    spans.append(end - start)
    span = float(np.median(spans)) / 1e3
    print(f"device span {span:.2f} ms/step (first kernel start to last kernel end): gaps inside the step "
          f"{span - busy:.2f} ms ({1e3 * (span - busy) / max(count, 1):.1f} us per kernel), "
          f"host time {wall - span:.2f} ms")
    print(f"{'kind':9s} {'kernels/step':>12s} {'ms/step':>8s} {'us/kernel':>9s}")
    for kind, (n, us) in sorted(per_kind.items(), key=lambda kv: -kv[1][1]):
        print(f"{kind:9s} {n / steps:12.0f} {us / steps / 1e3:8.3f} {us / max(n, 1):9.1f}")
    print("most expensive kernels (per step; [the HLO op they compute]):")
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][1])
    for (kind, name), (n, us) in ranked[:args.top]:
        op = names.get(_norm(name), "")
        tail = f"  [{op[-90:]}]" if op else ""
        print(f"  {us / steps / 1e3:7.3f} ms  x{n / steps:5.0f}  {kind:8s} {name[:60]}{tail}")
    if args.neighbors:
        print_neighbors(ev, args.neighbors, names, len(ev) // steps)
    if args.timeline:
        print_timeline(ev, names)
    other = [e for e in events if kind_of(e, names) == "other"]
    print(f"unattributed kernels: {len(other) / steps:.0f}/step; e.g.", json.dumps(other[:2])[:600])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), wall_ms=wall, kernels_per_step=count, busy_ms=busy, span_ms=span,
                           per_kind={k: dict(kernels=v[0] / steps, ms=v[1] / steps / 1e3) for k, v in per_kind.items()},
                           kernels=[dict(kind=kind, name=name, op=names.get(_norm(name), ""), calls=n / steps,
                                         ms=us / steps / 1e3) for (kind, name), (n, us) in ranked]),
                      f, indent=1)


if __name__ == "__main__":
    main()
