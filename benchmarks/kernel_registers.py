"""Registers, spills and shared memory of the fan-in kernels for CUDA, on any host: each kernel's Triton IR as the
Pallas Triton lowering builds it (an H200 as the abstract device, as in ``cross_lower.py``), compiled for sm_90 by
the ``triton`` package and its ``ptxas -v``.

    pip install --target /tmp/tsite "triton==3.6.0"   # once; not a dependency of jaxpc
    PYTHONPATH=/tmp/tsite python benchmarks/kernel_registers.py [--batch 512] [--blocks 1000] [--fanin 64]
        [--block 32] [--rows 1] [--kernels forward:32:2,backward:4,backward:4:noadd] [--stages 1,2] [--num-warps 4]

A kernel spec is ``forward:BB:SPAN`` (the in-place fan-in forward with batch tile ``BB`` and ``SPAN`` child blocks
per step, prefetching) or ``backward:G[:prefetch][:noadd]`` (the atomic backward with ``G`` children per program, its
parameter flows added in place; ``noadd``, a diagnostic: the child flows' atomic adds left out). Prints one line
per kernel and ``num_stages``. This is a proxy: XLA compiles the same IR with its own Triton and ptxas. At the
defaults (PD-512's largest fan-in partitions at batch 512) it gives 128 registers and 16,384 bytes of shared
memory for ``forward:32:2`` (the H200 under XLA, from Nsight Compute and ``jax.profiler``'s kernel details: 128 /
16,384), 121 / 12,288 for ``forward:64:1`` (128 / 12,288), 255 / 24,576 with a 704-byte stack frame of spills at one
stage and 255 / 20,608 without spills at two for ``backward:4`` (255 / 24,832, with spills), 197 for
``backward:4:noadd``, 128 / 20,480 for ``backward:1:prefetch`` (168 / 12,288): a guide to the direction of a change,
not a measurement of the H200's kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cross_lower import as_on_gpu  # noqa: E402
from jaxpc.ops import pallas_sum  # noqa: E402


def triton_ir(fn, *args) -> str:
    """The Triton IR (text) of the last Pallas kernel that lowering ``fn(*args)`` for CUDA builds."""
    from jax._src.pallas.triton import lowering

    captured, original = [], lowering.lower_jaxpr_to_triton_module

    def capture(*a, **kw):
        out = original(*a, **kw)
        captured.append(out.module.operation.get_asm(enable_debug_info=False))
        return out

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        with as_on_gpu():
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    return captured[-1]


def kernel_fn(spec: str, B: int, n: int, C: int, K: int, M: int = 1):
    """``(fn, args)`` whose lowering builds the kernel of ``spec`` (children the sums of ``M`` row blocks)."""
    S, R = jax.ShapeDtypeStruct, 64 * K + 2 * n * C * K
    kind, *rest = spec.split(":")
    tables = (S((n, C, M) if M > 1 else (n, C), jnp.int32), S((n, C), jnp.int32), S((n * C, K, K), jnp.float32))
    if kind == "forward":
        cfg = dataclasses.replace(pallas_sum.KernelConfig(), block_b=int(rest[0]), span=int(rest[1]), prefetch=True)

        def fn(buf, shifts, ch, pid, w):
            return pallas_sum.forward(buf, ch, pid, w, Kp=K, Kc=K, precision="tf32", config=cfg, out_offset=2 * K,
                                      shifts=shifts, unit=K)
        return fn, (S((R, B), jnp.float32), S((R // K, B), jnp.float32), *tables)
    if kind != "backward":
        raise ValueError(f"unknown kernel spec {spec!r}")
    flags = set(rest[1:])

    def fn(values, flows, shifts, ch, pid, w, dp):
        if "noadd" in flags:
            pallas_sum.add_tile = lambda *a, **k: None
        try:
            return pallas_sum.backward_atomic(values, flows, shifts, 2 * K, ch, pid, w, Kp=K, Kc=K, unit=K,
                                              first_row=2 * K, precision="tf32", group=int(rest[0]),
                                              prefetch="prefetch" in flags, dparams=dp)
        finally:
            pallas_sum.add_tile = ADD_TILE
    return fn, (S((R, B), jnp.float32), S((R, B), jnp.float32), S((R // K, B), jnp.float32), *tables,
                S((n * C, K, K), jnp.float32))


ADD_TILE = pallas_sum.add_tile


def ptxas_report(ir: str, num_warps: int, num_stages: int) -> str:
    """``ptxas -v``'s register, spill and stack line for ``ir`` compiled for sm_90, with Triton's shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia import compiler as nvidia

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "kernel.ttir"
        src.write_text(ir)
        k = triton.compile(str(src), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": num_warps, "num_stages": num_stages})
        ptx = Path(d) / "kernel.ptx"
        ptx.write_text(k.asm["ptx"])
        out = subprocess.run([nvidia.get_ptxas(90).path, "-v", "-arch=sm_90a", str(ptx), "-o", "/dev/null"],
                             capture_output=True, text=True, check=True)
    lines = [ln.split(":", 1)[-1].strip() for ln in out.stderr.splitlines() if "Used" in ln or "spill" in ln]
    return f"shared {k.metadata.shared} B; " + "; ".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--blocks", type=int, default=1000, help="parent blocks")
    p.add_argument("--fanin", type=int, default=64, help="child blocks per parent block")
    p.add_argument("--block", type=int, default=32, help="nodes per block (parents and children)")
    p.add_argument("--rows", type=int, default=1, help="row blocks per child (2: the folded plan's products)")
    p.add_argument("--kernels",
                   default="forward:32:2,forward:64:1,backward:4,backward:4:noadd,backward:2,backward:1:prefetch")
    p.add_argument("--stages", default="1,2")
    p.add_argument("--num-warps", type=int, default=4)
    args = p.parse_args(argv)
    for spec in args.kernels.split(","):
        fn, fargs = kernel_fn(spec, args.batch, args.blocks, args.fanin, args.block, args.rows)
        pallas_sum._KERNELS.clear()  # each spec traces its kernel afresh (``noadd`` patches its body)
        jax.clear_caches()
        ir = triton_ir(fn, *fargs)
        for stages in (int(s) for s in args.stages.split(",")):
            print(f"{spec:24s} num_stages={stages}: {ptxas_report(ir, args.num_warps, stages)}", flush=True)


if __name__ == "__main__":
    main()
