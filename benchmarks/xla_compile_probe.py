"""Where does XLA spend a workload's compile? Compile one executable under several XLA flag sets, each
in a child process with a time limit, and report seconds or, on a timeout, the last HLO passes it ran.

    python benchmarks/xla_compile_probe.py [--workload pd] [--batch 128] [--timeout 150]
                                           [--configs "default|--xla_gpu_autotune_level=0"] [--dump DIR]

A config ``+dump`` adds ``--xla_dump_to`` with a dump after every HLO pass: on a timeout the newest dump
files name the pass (or, if ``*after_optimizations*`` exists, show that the HLO passes finished and the
time went to code generation / autotuning). Workloads: ``pd`` (PD-128), ``hclt`` (HCLT-256), ``hmm``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(workload: str, batch: int, entry: str) -> None:
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxpc
    from _data import blurred_noise_images
    from jaxpc import distributions, structures
    from jaxpc.engine import em, forward

    cat = distributions.Categorical(256)
    t = time.perf_counter()
    if workload == "hmm":
        c = jaxpc.compile(structures.HMM(64, 1024, 4096))
        x = np.zeros((batch, 64), np.int32)
    else:
        imgs = blurred_noise_images(2_000)
        root = (structures.PD((28, 28), 128, split_intervals=(4, 4), input_dist=cat) if workload == "pd"
                else structures.HCLT(imgs, 256, input_dist=cat))
        c = jaxpc.compile(root)
        x = imgs[:batch]
    print(f"jaxpc.compile {time.perf_counter() - t:.1f}s", flush=True)
    opts = jaxpc.Options(precision="tf32")
    if entry == "flows":
        fn = jax.jit(lambda tb, p, xx: em.flows_and_ll(c.layout, tb, p, xx, None, None, opts))
    else:
        fn = jax.jit(lambda tb, p, xx: forward.log_prob(c.layout, tb, p, xx, None, opts))
    t = time.perf_counter()
    lowered = fn.lower(c.tables, c.params, jnp.asarray(x))
    print(f"lowered {time.perf_counter() - t:.1f}s", flush=True)
    t = time.perf_counter()
    lowered.compile()
    print(f"COMPILED {time.perf_counter() - t:.1f}s", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="pd", choices=["pd", "hclt", "hmm"])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--entry", default="flows", choices=["flows", "forward"])
    p.add_argument("--timeout", type=float, default=150)
    p.add_argument("--configs", default="default|--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false")
    p.add_argument("--dump", default=os.environ.get("OUT", "/tmp") + "/xla_probe")
    p.add_argument("--child", action="store_true")
    args = p.parse_args(argv)
    if args.child:
        return child(args.workload, args.batch, args.entry)
    results = []
    for i, cfg in enumerate(args.configs.split("|")):
        flags = cfg.replace("default", "").replace("+dump", "").strip()
        env = dict(os.environ)
        dump = None
        if "+dump" in cfg:
            dump = Path(args.dump) / f"cfg{i}"
            dump.mkdir(parents=True, exist_ok=True)
            flags += f" --xla_dump_to={dump} --xla_dump_hlo_pass_re=.* --xla_dump_hlo_as_text"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
        cmd = [sys.executable, __file__, "--child", "--workload", args.workload, "--batch", str(args.batch),
               "--entry", args.entry]
        t = time.perf_counter()
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            out = r.stdout + r.stderr[-2000:]
            status = "ok" if "COMPILED" in r.stdout else f"rc={r.returncode}"
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            status = "timeout"
        secs = time.perf_counter() - t
        print(f"=== config {i} [{cfg}]: {status} after {secs:.0f}s", flush=True)
        print(out.strip()[-3000:], flush=True)
        if dump is not None:
            files = sorted(dump.glob("*"), key=lambda f: f.stat().st_mtime)
            print(f"  {len(files)} dump files; newest:", flush=True)
            for f in files[-8:]:
                print(f"    {f.name} ({f.stat().st_size // 1024} KiB)", flush=True)
            done = [f.name for f in files if "after_optimizations" in f.name]
            print(f"  after_optimizations present: {bool(done)}", flush=True)
        results.append((cfg, status, secs))
    print("summary:", results, flush=True)


if __name__ == "__main__":
    main()
