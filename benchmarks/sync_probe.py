"""Time the building blocks of persistent kernels on the GPU: grid-wide barriers, flag hand-offs between programs,
and one program's dependent chain of 256 x 256 sum blocks.

    python benchmarks/sync_probe.py [--reps 30]

Raw Triton kernels launched from PyTorch (the GPU image's torch and triton; no JAX), each timed as the median of
``--reps`` launches with CUDA events:

* ``barrier``: ``L = 61`` empty levels, each a grid-wide barrier of ``G`` programs, by mode: ``atomic`` (arrive with an
  acquire-release atomic add, poll with acquire atomic adds of zero: ``jaxpc.ops.pallas_chain.grid_barrier``),
  ``ld_acquire`` (arrive with a release atomic, poll with ``ld.acquire.gpu``), ``ld_relaxed`` (poll with
  ``ld.relaxed.gpu``, then one acquire fence).
* ``ring``: a token passed ``R`` times round ``G`` programs (program ``g`` waits for the counter to reach its turn and
  adds one): the latency of one hand-off from a release by one program to the acquire of the next.
* ``chain``: ``N`` dependent sum blocks in each program: ``y = log(exp(W_n) @ exp(x - m)) + m`` for a ``[256, 256]``
  log-weight block per step and a ``[256, B]`` value tile, in parent chunks of ``BP`` rows (what one program of a
  tree kernel does per node on a level's critical path).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _wait(cnt_ptr, target, MODE: tl.constexpr):
    if MODE == 0:
        seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    elif MODE == 1:
        seen = tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [cnt_ptr], dtype=tl.int32,
                                         is_pure=False, pack=1)
        while seen < target:
            seen = tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [cnt_ptr],
                                             dtype=tl.int32, is_pure=False, pack=1)
    else:
        seen = tl.inline_asm_elementwise("ld.relaxed.gpu.global.b32 $0, [$1];", "=r,l", [cnt_ptr], dtype=tl.int32,
                                         is_pure=False, pack=1)
        while seen < target:
            seen = tl.inline_asm_elementwise("ld.relaxed.gpu.global.b32 $0, [$1];", "=r,l", [cnt_ptr],
                                             dtype=tl.int32, is_pure=False, pack=1)
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def _arrive(cnt_ptr, MODE: tl.constexpr):
    tl.debug_barrier()
    if MODE == 0:
        tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    else:
        tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")


@triton.jit
def barrier_kernel(cnt_ptr, L, MODE: tl.constexpr):
    G = tl.num_programs(0)
    for j in range(L):
        _arrive(cnt_ptr, MODE)
        _wait(cnt_ptr, (j + 1) * G, MODE)


@triton.jit
def ring_kernel(cnt_ptr, R, MODE: tl.constexpr):
    g = tl.program_id(0)
    G = tl.num_programs(0)
    for r in range(R):
        _wait(cnt_ptr, r * G + g, MODE)
        _arrive(cnt_ptr, MODE)


@triton.jit
def chain_kernel(w_ptr, x_ptr, y_ptr, N, B: tl.constexpr, K: tl.constexpr, BP: tl.constexpr):
    g = tl.program_id(0)
    rows = tl.arange(0, K)
    cols = tl.arange(0, B)
    xo = x_ptr + g * K * B + rows[:, None] * B + cols[None, :]
    for n in range(N):
        x = tl.load(xo)  # [K, B], written by this program's previous step
        m = tl.max(x, axis=0)
        e = tl.exp(x - m[None, :])
        wb = w_ptr + (g * N + n) * K * K
        for p in range(0, K, BP):
            pr = p + tl.arange(0, BP)
            w = tl.exp(tl.load(wb + pr[:, None] * K + rows[None, :]))
            y = tl.log(tl.dot(w, e)) + m[None, :]
            tl.store(x_ptr + g * K * B + pr[:, None] * B + cols[None, :], y)
        tl.debug_barrier()
    tl.store(y_ptr + g * K * B + rows[:, None] * B + cols[None, :], tl.load(xo))


def median_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name(0)}, {sms} SMs",
          flush=True)
    rows = []
    L = 61
    for mode, name in enumerate(("atomic", "ld_acquire", "ld_relaxed")):
        for G in (16, 64, 128):
            for warps in (1, 4):
                cnt = torch.zeros(1, dtype=torch.int32, device=dev)

                def run():
                    cnt.zero_()
                    barrier_kernel[(G,)](cnt, L, MODE=mode, num_warps=warps)

                ms = median_ms(run, args.reps)
                assert int(cnt.item()) == L * G, (name, G, int(cnt.item()))
                rows.append(dict(test="barrier", mode=name, G=G, warps=warps, us_per_level=1e3 * ms / L))
                print(rows[-1], flush=True)
    R = 50
    for mode, name in enumerate(("atomic", "ld_acquire", "ld_relaxed")):
        for G in (2, 16):
            cnt = torch.zeros(1, dtype=torch.int32, device=dev)

            def run():
                cnt.zero_()
                ring_kernel[(G,)](cnt, R, MODE=mode, num_warps=4)

            ms = median_ms(run, args.reps)
            rows.append(dict(test="ring", mode=name, G=G, us_per_hop=1e3 * ms / (R * G)))
            print(rows[-1], flush=True)
    K, N = 256, 61
    for B in (16,):
        for G in (1, 128):
            w = torch.randn(G * N, K, K, device=dev) * 0.1 - 5.5
            x0 = torch.randn(G, K, B, device=dev)
            for BP in (16, 32, 64):
                for warps in (4, 8):
                    x = x0.clone()
                    y = torch.empty_like(x)

                    def run():
                        x.copy_(x0)
                        chain_kernel[(G,)](w, x, y, N, B=B, K=K, BP=BP, num_warps=warps)

                    ms = median_ms(run, args.reps)
                    rows.append(dict(test="chain", B=B, G=G, BP=BP, warps=warps, us_per_block=1e3 * ms / N))
                    print(rows[-1], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
