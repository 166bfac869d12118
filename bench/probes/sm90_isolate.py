"""What paces the CUDA C++ NVFP4 GEMM's consumer (w4a16_sm90.cu) with the ring, the producer and global
memory taken away: the consumer's chunk step from shared memory filled once, in three modes:

    mma      8 wgmma m64nBTk16 a chunk on A registers decoded once (the tensor core alone)
    decode   the chunk's LDS + FP4 decode into the A registers, no wgmma (the decode chain alone)
    both     LDS + decode + 8 wgmma, the previous chunk's group in flight (the GEMM's consumer, no barriers)

for BT 16 / 64 / 128, one or two consumer warpgroups a CTA, and 1..3 CTAs an SM (one wave: SMs x CTAs). It
prints per launch the cycles a chunk a warpgroup (clock64, median over warpgroups) and the SM's rate in 64x16
weight steps (one wgmma's A) per 100 cycles, beside the tensor core's bf16 peak for that BT (a 64 x BT x 16
wgmma in 64 * BT * 16 / 2048 cycles at 2048 FMA a cycle an SM). The GEMM itself ran ~1 step per 100 cycles an
SM at BT 16-128 (bench/NOTES.md, session 41): if `decode` alone sits there with one warpgroup and doubles with
two while `both` does not, the two warpgroups serialize on the tensor core; if `decode` does not double
either, on the decode's shared pipes.

    PYTHONPATH=src python3 bench/probes/sm90_isolate.py [--chunks 2048] [--out FILE]

Builds its own extension (~1 min, sm_90a) from the GEMM's device code (its decode_chunk and issue_chunk)
and a probe kernel of its own; needs an sm_90 GPU and nvcc.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

MODES = {"mma": 0, "decode": 1, "both": 2}
TILES = (16, 64, 128)

PROBE = r"""
}  // namespace k3w

namespace k3p {
using namespace k3w;

constexpr int SLOTS = 2;

template <int BT, int NWG>
struct Lay {
  static constexpr int X = 2 * BT * 128, W = NWG * 4 * 1024, S = NWG * 4 * 128;
  static constexpr int bytes = 1024 + SLOTS * (X + W + S);
};

// one chunk of one A set: decode (MODE 1, 2) and the chunk's wgmma group (MODE 0, 2). `zero` is a runtime
// 0: in MODE 0 the A set is rewritten with it (as the GEMM's decode rewrites the set the in-flight group does
// not read: kept constant, ptxas serializes the wgmma, C7511); in MODE 1 the decoded set is stored under it
// (never taken, but ptxas can neither drop the decode nor hoist its LDS out of the loop)
template <int BT, int MODE>
__device__ __forceinline__ void step(uint32_t wb, uint32_t sb, uint64_t desc0, uint32_t x_off,
                                     float (&acc)[BT / 2], uint32_t (&a)[32], uint32_t zero, uint32_t dump) {
  if constexpr (MODE != 0) {
    decode_chunk<true>(wb, sb, a);
  } else {
#pragma unroll
    for (int i = 0; i < 32; ++i) a[i] ^= zero;
  }
  if constexpr (MODE != 1) {
    issue_chunk<BT, true>(desc0, x_off, acc, a);
  } else if (zero) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(dump + 16 * j), "r"(a[4 * j]),
                   "r"(a[4 * j + 1]), "r"(a[4 * j + 2]), "r"(a[4 * j + 3])
                   : "memory");
  }
}

// the GEMM's register budget: capped for 3 CTAs an SM with one warpgroup up to BT 64 (min_ctas in the .cu)
template <int BT, int NWG>
constexpr int probe_min_ctas() {
  return NWG == 1 && BT <= 64 ? 3 : 1;
}

template <int BT, int NWG, int MODE>
__global__ void __launch_bounds__(NWG * 128, probe_min_ctas<BT, NWG>())
    isolate_kernel(int chunks, uint32_t zero, long long* cycles, uint32_t* sink) {
  using L = Lay<BT, NWG>;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t x0 = (raw + 1023u) & ~1023u;  // the 128-byte swizzle's atoms want 1024-byte alignment
  const uint32_t w0 = x0 + SLOTS * L::X, s0 = w0 + SLOTS * L::W;
  for (int i = threadIdx.x; i < SLOTS * (L::X + L::W + L::S) / 4; i += blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u + 0x9E3779B9u;
    h ^= h >> 15;
    // x: bf16 in [1, 2); codes: any nibble; scales: E4M3 bytes of 0.5..1.875 (no NaN)
    const uint32_t at = x0 + 4 * i;
    const uint32_t v =
        at < w0 ? (0x3F803F80u | (h & 0x007F007Fu)) : at < s0 ? h : (0x30303030u | (h & 0x0F0F0F0Fu));
    sts32(at, v);
  }
  __syncthreads();
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4, rb = wg * 4 + warp;
  const uint32_t wt = w0 + rb * 1024 + g * 64 + t * 16;
  const uint32_t stt = s0 + rb * 128 + g * 8 + 4 * (t & 1) + 2 * (t >> 1);
  const uint64_t desc0 = b_desc(x0);
  float acc[BT / 2];
#pragma unroll
  for (int j = 0; j < BT / 2; ++j) acc[j] = 0.f;
  uint32_t a0[32], a1[32];
  decode_chunk<true>(wt, stt, a0);
  decode_chunk<true>(wt + L::W, stt + L::S, a1);
  const uint32_t dump = x0 + threadIdx.x * 128;
  asm volatile("bar.sync 1, %0;" ::"r"(NWG * 128) : "memory");
  const long long c0 = clock64();
  for (int c = 0; c < chunks; c += 2) {
    step<BT, MODE>(wt, stt, desc0, 0, acc, a0, zero, dump);
    step<BT, MODE>(wt + L::W, stt + L::S, desc0, L::X, acc, a1, zero, dump);
  }
  wgmma_wait<0>();
  fence_regs(acc);
  const long long c1 = clock64();
  if (threadIdx.x % 128 == 0) cycles[blockIdx.x * NWG + wg] = c1 - c0;
  if (__float_as_uint(acc[0]) == 0x12345u) sink[0] = 1;  // keeps the wgmma live
}

}  // namespace k3p

#ifndef K3P_STANDALONE
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

// launches (ctas > 0) or only reports the CTAs an SM holds (ctas == 0); returns that count
template <int BT, int NWG, int MODE>
static int64_t launch(int ctas, int chunks, torch::Tensor cycles, torch::Tensor sink) {
  auto* k = k3p::isolate_kernel<BT, NWG, MODE>;
  const int bytes = k3p::Lay<BT, NWG>::bytes;
  C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k, NWG * 128, bytes));
  if (ctas > 0) {
    k<<<ctas, NWG * 128, bytes, c10::cuda::getCurrentCUDAStream()>>>(
        chunks, 0u, reinterpret_cast<long long*>(cycles.data_ptr<int64_t>()),
        reinterpret_cast<uint32_t*>(sink.data_ptr<int32_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return per_sm;
}

template <int BT, int NWG>
static int64_t by_mode(int64_t mode, int ctas, int chunks, torch::Tensor cycles, torch::Tensor sink) {
  if (mode == 0) return launch<BT, NWG, 0>(ctas, chunks, cycles, sink);
  if (mode == 1) return launch<BT, NWG, 1>(ctas, chunks, cycles, sink);
  return launch<BT, NWG, 2>(ctas, chunks, cycles, sink);
}

int64_t isolate(int64_t bt, int64_t nwg, int64_t mode, int64_t ctas, int64_t chunks, torch::Tensor cycles,
                torch::Tensor sink) {
  TORCH_CHECK(mode >= 0 && mode <= 2 && (nwg == 1 || nwg == 2), "isolate: mode 0..2, nwg 1 | 2");
  TORCH_CHECK(cycles.numel() >= ctas * nwg && cycles.dtype() == torch::kInt64,
              "isolate: cycles [ctas * nwg] int64");
  TORCH_CHECK(chunks % 2 == 0, "isolate: an even chunk count");
  const int c = int(ctas), n = int(chunks);
  if (bt == 16 && nwg == 1) return by_mode<16, 1>(mode, c, n, cycles, sink);
  if (bt == 16) return by_mode<16, 2>(mode, c, n, cycles, sink);
  if (bt == 64 && nwg == 1) return by_mode<64, 1>(mode, c, n, cycles, sink);
  if (bt == 64) return by_mode<64, 2>(mode, c, n, cycles, sink);
  TORCH_CHECK(bt == 128, "isolate: BT 16 | 64 | 128, got ", bt);
  if (nwg == 1) return by_mode<128, 1>(mode, c, n, cycles, sink);
  return by_mode<128, 2>(mode, c, n, cycles, sink);
}
#else
#define K3P_INST(B, G, M) \
  template __global__ void k3p::isolate_kernel<B, G, M>(int, uint32_t, long long*, uint32_t*);
#define K3P_MODES(B, G) K3P_INST(B, G, 0) K3P_INST(B, G, 1) K3P_INST(B, G, 2)
K3P_MODES(16, 1) K3P_MODES(16, 2) K3P_MODES(64, 1) K3P_MODES(64, 2) K3P_MODES(128, 1) K3P_MODES(128, 2)
#undef K3P_MODES
#undef K3P_INST
#endif
"""

# the GEMM's source up to its first kernel-side structure the probe does not use
CUT = "// One CTA's piece of one tile"


def probe_source() -> str:
    """The GEMM's device helpers (its source up to CUT, the wgmma wrappers in place) and the probe."""
    from k3run.kernels.nvfp4_gemm import w4a16_sm90 as sm90

    src = sm90.cuda_source()
    if CUT not in src:
        raise RuntimeError(f"sm90_isolate: the marker {CUT!r} is gone from w4a16_sm90.cu; move CUT")
    return src[: src.index(CUT)] + PROBE


def build():
    from torch.utils.cpp_extension import load_inline

    decl = (
        "int64_t isolate(int64_t bt, int64_t nwg, int64_t mode, int64_t ctas, int64_t chunks, "
        "torch::Tensor cycles, torch::Tensor sink);\n"
    )
    return load_inline(
        name="k3run_sm90_isolate",
        cpp_sources=decl,
        cuda_sources=probe_source(),
        functions=["isolate"],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"],
        verbose=False,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=2048)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("sm90_isolate: needs an sm_90 GPU")
    mod = build()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    rows = []
    print(f"{torch.cuda.get_device_name()}, {sms} SMs, {args.chunks} chunks a warpgroup")
    print("| BT | warpgroups | CTAs an SM | mode | cycles a chunk a warpgroup | steps / 100 cycles an SM | "
          "tensor peak | us |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for bt in TILES:
        for nwg in (1, 2):
            for per_sm in (1, 2, 3) if nwg == 1 else (1, 2):
                ctas = sms * per_sm
                for name, mode in MODES.items():
                    cycles = torch.zeros(ctas * nwg, dtype=torch.int64, device="cuda")
                    held = mod.isolate(bt, nwg, mode, 0, 2, cycles, sink)  # ctas 0: the CTAs an SM holds
                    if held < per_sm:
                        print(f"| {bt} | {nwg} | {per_sm} | {name} | (an SM holds {held}) | | | |")
                        continue
                    mod.isolate(bt, nwg, mode, ctas, 8, cycles, sink)  # warm-up
                    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t0.record()
                    mod.isolate(bt, nwg, mode, ctas, args.chunks, cycles, sink)
                    t1.record()
                    torch.cuda.synchronize()
                    per_chunk = statistics.median(cycles.tolist()) / args.chunks
                    # an SM's 64x16 steps (8 a chunk a warpgroup) per 100 of its cycles, all its warpgroups
                    rate = 100 * 8 * nwg * per_sm / per_chunk
                    peak = 100 * 2048 / (64 * bt * 16)
                    r = {"bt": bt, "nwg": nwg, "per_sm": per_sm, "mode": name, "cycles_per_chunk": per_chunk,
                         "steps_per_100": rate, "peak_per_100": peak,
                         "us": t0.elapsed_time(t1) * 1e3}  # fmt: skip
                    rows.append(r)
                    print(f"| {bt} | {nwg} | {per_sm} | {name} | {per_chunk:.0f} | {rate:.2f} | {peak:.2f} | "
                          f"{r['us']:.0f} |", flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
