"""Does memory come back after a large batch? HMM-1024 EM steps at B=16, one at B=4096, then B=16 again, one fresh
process per allocator setting, jaxpc and PyJuice side by side.

    python benchmarks/memory_return.py [--small 16] [--large 4096] [--steps 5] [--systems jaxpc,pyjuice]
        [--allocators "default|no-prealloc|platform"]

Each jaxpc process runs ``circuit.em_step(params, x)`` (the default call) and prints, after the first small steps,
after the large step and after the small steps that follow: the bytes held by live arrays (``bytes_in_use``), the
allocator's pool (``pool_bytes``: what the process holds on the device; with preallocation a fixed 75% of it) and
the peak, and the GPU's used memory as ``nvidia-smi`` reports it. Allocators: ``default`` (JAX's BFC allocator,
preallocating), ``no-prealloc``
(``XLA_PYTHON_CLIENT_PREALLOCATE=false``: the pool grows on demand and keeps what it got) and ``platform``
(``XLA_PYTHON_CLIENT_ALLOCATOR=platform``: every buffer is allocated and freed on the device, nothing pooled) and
``cuda-async`` (``XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async``: CUDA's stream-ordered allocator, not preallocating).
PyJuice runs ``pc(x)``, ``pc.backward(x, flows_memory=1.0)`` and ``pc.mini_batch_em`` and reports
``torch.cuda.memory_allocated`` and ``memory_reserved``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ALLOCATORS = {"default": {}, "no-prealloc": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
              "platform": {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"},
              "cuda-async": {"XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}}
GB = 2 ** 30


def device_used() -> float | None:
    """GB of device memory in use on the GPU (nvidia-smi: every process's, the driver's share included)."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
        return round(float(r.stdout.split()[0]) / 1024, 3)
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def jaxpc_child(small: int, large: int, steps: int) -> dict:
    sys.path.insert(0, str(HERE.parent))
    import jax
    import numpy as np

    import jaxpc
    from jaxpc import structures

    c = jaxpc.compile(structures.HMM(64, 1024, 4096))
    rng = np.random.default_rng(0)
    xs = jax.device_put(rng.integers(0, 4096, (small, 64)).astype(np.int32))
    xl = jax.device_put(rng.integers(0, 4096, (large, 64)).astype(np.int32))
    dev = jax.devices()[0]
    out, params = {}, c.params

    def phase(name, x, n):
        nonlocal params
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            params = jax.block_until_ready(c.em_step(params, x))
            ts.append(time.perf_counter() - t)
        c.raise_pending()
        s = dev.memory_stats() or {}
        out[name] = {k: round(s.get(k, 0) / GB, 3) for k in ("bytes_in_use", "pool_bytes", "peak_bytes_in_use")}
        out[name]["device_used"] = device_used()
        out[name]["last_step_ms"] = round(1e3 * ts[-1], 3)

    phase(f"B={small} before", xs, steps)
    phase(f"B={large}", xl, 1)
    del xl
    phase(f"B={small} after", xs, steps)
    return out


def pyjuice_child(small: int, large: int, steps: int) -> dict:
    import pyjuice as juice
    import torch

    pc = juice.compile(juice.structures.HMM(seq_length=64, num_latents=1024, num_emits=4096, homogeneous=True),
                       verbose=False).to("cuda")
    out = {}

    def phase(name, b, n):
        for _ in range(n):
            x = torch.randint(0, 4096, (b, 64), device="cuda")
            pc.init_param_flows(flows_memory=0.0)
            pc(x)
            pc.backward(x, flows_memory=1.0)
            pc.mini_batch_em(step_size=0.1, pseudocount=0.1)
        torch.cuda.synchronize()
        out[name] = {"allocated": round(torch.cuda.memory_allocated() / GB, 3),
                     "reserved": round(torch.cuda.memory_reserved() / GB, 3),
                     "peak_allocated": round(torch.cuda.max_memory_allocated() / GB, 3), "device_used": device_used()}

    phase(f"B={small} before", small, steps)
    phase(f"B={large}", large, 1)
    phase(f"B={small} after", small, steps)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", type=int, default=16)
    p.add_argument("--large", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--systems", default="jaxpc,pyjuice")
    p.add_argument("--allocators", default="|".join(ALLOCATORS))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        fn = jaxpc_child if args.child == "jaxpc" else pyjuice_child
        print("RESULT " + json.dumps(fn(args.small, args.large, args.steps)), flush=True)
        return
    runs = [("pyjuice", "torch")] if "pyjuice" in args.systems else []
    runs = [("jaxpc", a) for a in args.allocators.split("|") if "jaxpc" in args.systems] + runs
    for system, alloc in runs:
        env = {**os.environ, **ALLOCATORS.get(alloc, {})}
        cmd = [sys.executable, __file__, "--child", system, "--small", str(args.small), "--large", str(args.large),
               "--steps", str(args.steps)]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [ln[7:] for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        res = json.loads(lines[-1]) if lines else {"error": (r.stderr or r.stdout).strip().splitlines()[-1:]}
        print(json.dumps({"system": system, "allocator": alloc, **res}), flush=True)


if __name__ == "__main__":
    main()
