"""Time a dependent chain of 256 x 256 sum blocks on one thread-block cluster, the hand-off between levels kept on
chip: what a tree level's step could cost if its blocks shared shared memory instead of global memory.

    python benchmarks/cluster_probe.py [--reps 30] [--levels 64] [--clusters 1,8] [--sizes 4,8] [--mma]
                                       [--no-compute] [--opt] [--json out.json]

A CUDA kernel compiled with NVRTC (the GPU image's, which PyTorch ships) and launched through the driver API on
PyTorch's stream and memory; no JAX. Per level ``l`` of a chain, ``x_{l+1}[r, b] = log(sum_k W_l[r, k] exp(x_l[k, b]
- m_b)) + m_b`` (``m_b`` the column's max) for ``r, k < 256`` and ``B = 16`` samples. A cluster of ``NC`` blocks
(``--sizes``; 16 is the H200's non-portable size) of 256 threads owns ``256 / NC`` rows each; every block keeps the
whole ``[256, 16]`` input in its shared memory, writes its rows of the output into every peer's shared memory
(``mapa`` + ``st.shared::cluster``) and meets them at one cluster barrier per level. Weights: ``resident`` (one matrix
for every level, loaded once: the floor) or ``streamed`` (a matrix per level, the next level's copied with
``cp.async`` into a second buffer while the current one computes). The product: FP32 FMAs, or with ``--mma`` TF32
``mma.sync`` (operands truncated to TF32: about 0.05 of absolute error after 64 levels of values near -40);
``--no-compute`` adds each size without its product (the column max, exponentials, logarithms, stores and
barrier), with only the copies of a block's rows into its peers and the barrier, and with the barrier alone.
``--opt``: each block sends the column max of its own rows along with them (no block reduces all 256 rows) and copies
them into its peers 16 bytes a store.

Per variant: the median microseconds per launch of a chain of 1 and of ``--levels`` levels (CUDA events, ``--reps``
launches), the step ``(t_L - t_1) / (L - 1)``, and the largest difference from a float64 PyTorch reference. With more
than one cluster each runs its own chain (the step with other clusters running).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sync_probe import median_ms  # noqa: E402

K, B = 256, 16

SOURCE = r"""
#define K 256
#define B 16
#define R (K / NC)
#define OUT_PER (R * B / 256)
#define BT (B / OUT_PER)
#define WS (K + 4)

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  unsigned a;
  asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void st_peer(unsigned local, unsigned peer, float v) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(peer));
  asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(remote), "f"(v) : "memory");
}
__device__ __forceinline__ void st_peer4(unsigned local, unsigned peer, float4 v) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(peer));
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" :: "r"(remote), "f"(v.x), "f"(v.y), "f"(v.z),
               "f"(v.w) : "memory");
}
__device__ __forceinline__ void copy_tile(float* dst, const float* src, int t) {
  // R rows of K floats into rows of WS floats, 16 bytes per copy
  for (int i = t; i < R * K / 4; i += 256) {
    int r = i / (K / 4), c = (i % (K / 4)) * 4;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(smem_addr(dst + r * WS + c)), "l"(src + r * K + c)
                 : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

extern "C" __global__ void __cluster_dims__(NC, 1, 1) __launch_bounds__(256)
chain(const float* __restrict__ W, const float* __restrict__ x0, float* __restrict__ out, int L) {
  extern __shared__ float smem[];
  float* X = smem;                  // [2][K][B] inputs, double-buffered
  float* Y = X + 2 * K * B;         // [K][B] exp(x - m)
  float* M = Y + K * B;             // [B] column max
  float* RED = M + B;               // [16][B] partial maxima
  float* Wt = RED + 16 * B;         // [2][R][WS] weight tiles
  float* PART = Wt + 2 * R * WS;    // [8][R][B] the warps' partial products (MMA)
  float* MX = PART + 8 * R * B;     // [2][NC][B] each block's column max of its rows (OPT)
  float* STG = MX + 2 * NC * B;     // [R][B] this block's output rows before their copies (OPT)
  unsigned rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  const int t = threadIdx.x, chain_id = blockIdx.x / NC;
  const float* xin = x0 + chain_id * K * B;
  for (int i = t; i < K * B; i += 256) X[i] = xin[i];
  copy_tile(Wt, W + rank * R * K, t);
#if OPT
  __syncthreads();
  if (t < B) {  // this block's rows' column max, into every peer
    float m = X[(rank * R) * B + t];
    for (int rr = 1; rr < R; ++rr) m = fmaxf(m, X[(rank * R + rr) * B + t]);
    const unsigned a = smem_addr(MX + rank * B + t);
    for (unsigned p = 0; p < NC; ++p) st_peer(a, p, m);
  }
#endif
  cluster_sync();  // every block of the cluster running before any writes into a peer's shared memory
  const int r = t / BT, b0 = (t % BT) * OUT_PER;
  for (int l = 0; l < L; ++l) {
    const float* cur = X + (l & 1) * K * B;
    float* nxt = X + ((l + 1) & 1) * K * B;
#if STAGE == 0  // the cluster barrier alone
    cluster_sync();
    continue;
#elif STAGE == 1  // each block's rows copied into every peer, then the barrier
    for (int j = 0; j < OUT_PER; ++j) {
      const unsigned a = smem_addr(nxt + (rank * R + r) * B + b0 + j);
      const float v = cur[(rank * R + r) * B + b0 + j];
      for (unsigned p = 0; p < NC; ++p) st_peer(a, p, v);
    }
    cluster_sync();
    continue;
#endif
    const float* w = Wt + (STREAMED ? (l & 1) : 0) * R * WS;
    if (STREAMED && l + 1 < L)  // the next level's tile, while this one computes
      copy_tile(Wt + ((l + 1) & 1) * R * WS, W + (size_t)(l + 1) * K * K + rank * R * K, t);
#if OPT
    {  // the column max from the blocks' maxima of their rows; a thread's elements share one column
      const float* MXc = MX + (l & 1) * NC * B;
      float mb = MXc[t % B];
      for (int q = 1; q < NC; ++q) mb = fmaxf(mb, MXc[q * B + t % B]);
      if (t < B) M[t] = mb;
      for (int i = t; i < K * B; i += 256) Y[i] = __expf(cur[i] - mb);
    }
#else
    {  // column max: 16 partial maxima of 16 rows each, then one per column
      const int b = t % B, q = t / B;
      float m = cur[(q * 16) * B + b];
      for (int k = 1; k < 16; ++k) m = fmaxf(m, cur[(q * 16 + k) * B + b]);
      RED[q * B + b] = m;
    }
    __syncthreads();
    if (t < B) {
      float m = RED[t];
      for (int q = 1; q < 16; ++q) m = fmaxf(m, RED[q * B + t]);
      M[t] = m;
    }
    __syncthreads();
    for (int i = t; i < K * B; i += 256) Y[i] = __expf(cur[i] - M[i % B]);
#endif
    if (STREAMED && l + 1 < L) asm volatile("cp.async.wait_group 1;" ::: "memory");
    else asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
    float acc[OUT_PER];
#pragma unroll
    for (int j = 0; j < OUT_PER; ++j) acc[j] = 0.f;
#if MMA
    {  // tensor cores (TF32 m16n8k8): warp q takes children [32 q, 32 q + 32) of every tile, then a sum over warps
      const int lane = t % 32, q = t / 32, g = lane / 4, c = lane % 4;
#pragma unroll
      for (int mt = 0; mt < R / 16; ++mt) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma unroll
          for (int ks = 0; ks < 4; ++ks) {
            const int k0 = q * 32 + ks * 8, r0 = mt * 16, n0 = nt * 8;
            unsigned a0 = __float_as_uint(w[(r0 + g) * WS + k0 + c]);
            unsigned a1 = __float_as_uint(w[(r0 + g + 8) * WS + k0 + c]);
            unsigned a2 = __float_as_uint(w[(r0 + g) * WS + k0 + c + 4]);
            unsigned a3 = __float_as_uint(w[(r0 + g + 8) * WS + k0 + c + 4]);
            unsigned b0_ = __float_as_uint(Y[(k0 + c) * B + n0 + g]);
            unsigned b1_ = __float_as_uint(Y[(k0 + c + 4) * B + n0 + g]);
            asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                         "{%0,%1,%2,%3};" : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
                         : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0_), "r"(b1_));
          }
          float* P = PART + q * R * B;
          P[(mt * 16 + g) * B + nt * 8 + 2 * c] = d0;
          P[(mt * 16 + g) * B + nt * 8 + 2 * c + 1] = d1;
          P[(mt * 16 + g + 8) * B + nt * 8 + 2 * c] = d2;
          P[(mt * 16 + g + 8) * B + nt * 8 + 2 * c + 1] = d3;
        }
      }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < OUT_PER; ++j)
        for (int qq = 0; qq < 8; ++qq) acc[j] += PART[qq * R * B + r * B + b0 + j];
    }
#else
#pragma unroll 8
    for (int k = 0; k < (COMPUTE ? K : 1); ++k) {
      const float wk = w[r * WS + k];
#pragma unroll
      for (int j = 0; j < OUT_PER; ++j) acc[j] = fmaf(wk, Y[k * B + b0 + j], acc[j]);
    }
#endif
#if OPT
#pragma unroll
    for (int j = 0; j < OUT_PER; ++j) STG[r * B + b0 + j] = __logf(acc[j]) + M[b0 + j];
    __syncthreads();
    if (t < B) {  // the rows' column max, into every peer
      float m = STG[t];
      for (int rr = 1; rr < R; ++rr) m = fmaxf(m, STG[rr * B + t]);
      const unsigned a = smem_addr(MX + ((l + 1) & 1) * NC * B + rank * B + t);
      for (unsigned p = 0; p < NC; ++p) st_peer(a, p, m);
    }
    for (int task = t; task < NC * (R * B / 4); task += 256) {  // the rows, 16 bytes a store
      const int p = task / (R * B / 4), c = task % (R * B / 4);
      st_peer4(smem_addr(nxt + rank * R * B + c * 4), p, reinterpret_cast<const float4*>(STG)[c]);
    }
#else
#pragma unroll
    for (int j = 0; j < OUT_PER; ++j) {
      const float v = __logf(acc[j]) + M[b0 + j];
      const unsigned a = smem_addr(nxt + (rank * R + r) * B + b0 + j);
      for (unsigned p = 0; p < NC; ++p) st_peer(a, p, v);
    }
#endif
    cluster_sync();
  }
  if (rank == 0) {
    const float* fin = X + (L & 1) * K * B;
    for (int i = t; i < K * B; i += 256) out[chain_id * K * B + i] = fin[i];
  }
}
"""


def _lib(patterns: list[str]) -> ctypes.CDLL:
    for pat in patterns:
        for path in sorted(glob.glob(pat), reverse=True) if "/" in pat else [pat]:
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    raise SystemExit(f"no library among {patterns}")


def _nvrtc() -> ctypes.CDLL:
    roots = [p for p in sys.path if os.path.isdir(os.path.join(p, "nvidia"))]
    pats = [os.path.join(r, "nvidia", "*", "lib", "libnvrtc.so*") for r in roots]
    pats += [os.path.join(os.path.dirname(torch.__file__), "lib", "libnvrtc*.so*"),
             "/usr/local/cuda*/lib64/libnvrtc.so*"]
    return _lib(pats)


def _check(res: int, what: str, nvrtc=None, prog=None) -> None:
    if res != 0:
        log = ""
        if nvrtc is not None and prog is not None:
            n = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
            buf = ctypes.create_string_buffer(n.value)
            nvrtc.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode()
        raise SystemExit(f"{what} failed with {res}\n{log}")


def compile_kernel(nc: int, streamed: bool, arch: str, compute: bool = True, mma: bool = False, stage: int = 2,
                   opt: bool = False):
    nvrtc = _nvrtc()
    torch.zeros(1, device="cuda")  # the driver loaded and PyTorch's context current on this thread
    cuda = _lib(["libcuda.so.1", "libcuda.so"])
    prog = ctypes.c_void_p()
    _check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), SOURCE.encode(), b"chain.cu", 0, None, None), "nvrtcCreate")
    defs = dict(NC=nc, STREAMED=int(streamed), COMPUTE=int(compute), MMA=int(mma), STAGE=stage, OPT=int(opt))
    opts = [f"-arch={arch}".encode(), b"-std=c++17", b"--use_fast_math"] + [f"-D{k}={v}".encode()
                                                                              for k, v in defs.items()]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    _check(nvrtc.nvrtcCompileProgram(prog, len(opts), arr), "nvrtcCompileProgram", nvrtc, prog)
    n = ctypes.c_size_t()
    _check(nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(n)), "nvrtcGetCUBINSize")
    cubin = ctypes.create_string_buffer(n.value)
    _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    ctx = ctypes.c_void_p()
    _check(cuda.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        raise SystemExit("no current CUDA context")
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    _check(cuda.cuModuleLoadData(ctypes.byref(mod), cubin), "cuModuleLoadData")
    _check(cuda.cuModuleGetFunction(ctypes.byref(fn), mod, b"chain"), "cuModuleGetFunction")
    R = K // nc
    smem = 4 * (2 * K * B + K * B + B + 16 * B + 2 * R * (K + 4) + 8 * R * B + 2 * nc * B + R * B)
    _check(cuda.cuFuncSetAttribute(fn, 8, smem), "cuFuncSetAttribute(max dynamic shared memory)")
    if nc > 8:  # clusters of 16 blocks: the H200's non-portable size
        _check(cuda.cuFuncSetAttribute(fn, 14, 1), "cuFuncSetAttribute(non-portable cluster size)")

    def launch(W, x0, out, L: int, clusters: int):
        args = [ctypes.c_uint64(W.data_ptr()), ctypes.c_uint64(x0.data_ptr()), ctypes.c_uint64(out.data_ptr()),
                ctypes.c_int(L)]
        params = (ctypes.c_void_p * 4)(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _check(cuda.cuLaunchKernel(fn, nc * clusters, 1, 1, 256, 1, 1, smem, stream, params, None), "cuLaunchKernel")

    return launch


def reference(W: torch.Tensor, x0: torch.Tensor, L: int, streamed: bool) -> torch.Tensor:
    x = x0.double()
    lw = W.double().log()
    for level in range(L):
        w = lw[level] if streamed else lw[0]
        x = torch.logsumexp(w[None, :, :, None] + x[:, None, :, :], dim=2)
    return x


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--levels", type=int, default=64)
    p.add_argument("--clusters", default="1,8")
    p.add_argument("--sizes", default="4,8", help="blocks per cluster (256 / size rows each)")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--no-compute", action="store_true",
                   help="also time each size without its product, with only the rows' copies into the peers and the "
                   "barrier, and with the barrier alone")
    p.add_argument("--mma", action="store_true", help="the product on the tensor cores (TF32 mma.sync) instead")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--opt", action="store_true", help="each block sends its rows' column max with its rows (no block "
                   "reduces all 256 rows) and copies them 16 bytes a store")
    args = p.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    L = args.levels
    W = torch.rand((L, K, K), device="cuda", generator=gen) + 0.05
    W = W / W.sum(-1, keepdim=True)
    rows = []
    sizes = [int(s) for s in args.sizes.split(",")]
    variants = [(nc, streamed, True, args.mma, 2) for nc in sizes for streamed in (False, True)]
    if args.no_compute:
        variants += [(nc, False, False, False, stage) for nc in sizes for stage in (2, 1, 0)]
    for nc, streamed, compute, mma, stage in variants:
        launch = compile_kernel(nc, streamed, args.arch, compute, mma, stage, args.opt and compute)
        for clusters in (int(c) for c in args.clusters.split(",")):
            x0 = torch.randn((clusters, K, B), device="cuda", generator=gen) * 3 - 40
            out = torch.empty_like(x0)
            launch(W, x0, out, L, clusters)
            torch.cuda.synchronize()
            err = (float((out.double() - reference(W, x0, L, streamed)).abs().max()) if compute and stage == 2
                   else float("nan"))
            t1 = 1e3 * median_ms(lambda: launch(W, x0, out, 1, clusters), args.reps)
            tl_ = 1e3 * median_ms(lambda: launch(W, x0, out, L, clusters), args.reps)
            row = dict(blocks_per_cluster=nc, weights="streamed" if streamed else "resident", clusters=clusters,
                       product=("mma" if mma else "fma") if compute else None,
                       step=("whole", "copies and barrier", "barrier")[2 - stage], opt=bool(args.opt and compute),
                       levels=L, us_one_level=round(t1, 2), us_all_levels=round(tl_, 2),
                       us_per_level=round((tl_ - t1) / (L - 1), 3), max_abs_err=float(f"{err:.2e}"),
                       device=torch.cuda.get_device_name())
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
