// NVFP4 W4A16 GEMM for Hopper (sm_90a) in CUDA C++: y[M, N] = x[M, K] @ (e2m1(W) * s)^T * gs (+ bias).
// Token tiles BT 16..256; two consumer warpgroups up to BT 128 (at 256 their 128 accumulators, two A sets and
// the decode do not fit 232 registers: ptxas serializes the wgmma, C7512); three at BT 128 on the fixed grid,
// each with one A set (`one_a_set`).
//
// Why CUDA C++ (bench/NOTES.md): the Gluon kernel (wgmma.py) cannot keep a chunk's wgmma in flight while the
// next chunk decodes into registers (its operand copies are not the registers the HGMMA reads: a constant
// trip count races, a runtime one is serialized by ptxas). Here the two A-operand register sets are arrays
// this code owns, and the SASS check in tests/kernels/test_nvfp4_cuda.py pins that no instruction writes an
// in-flight operand register.
//
// The product is the swapped one of the Gluon kernel: acc[n, t] = sum_k W[n, k] x[t, k]; the weights are
// wgmma's A operand (64 rows per consumer warpgroup), a tile of BT tokens its B operand (K-major, 128-byte
// swizzle). One CTA: NWG consumer warpgroups (BN = 64 NWG weight rows) and a producer (one warp beside one
// or three consumer warpgroups, a warpgroup beside two: cta_threads) that issues bulk copies (cp.async.bulk or
// tensor-map copies, completion on an mbarrier; the producer's forms below) into a ring of STAGES slots; a
// slot holds one 128-wide K chunk: x [2][BT][64] (already column-permuted and swizzled by `prep_x`), the
// tiled128 words of NWG * 4 16-row blocks (1 KB each) and their scale bytes (128 B each).
// Consumer thread (warp w of its warpgroup, lane = 4g + t) owns weight rows 16w + g and 16w + g + 8 and words
// 4t..4t+3 of each: two 16-byte shared loads per chunk. Word 4t + b decodes (the decode kernels' shift
// decoder, tile.word_asm) into the pairs of physical k = 16t + 4b + 2p + e (low half of the chunk, p = 0, 1)
// and 64 + the same (high half): the A registers of k-step b (and 4 + b) at operand position 16b + 8p + 2t
// + e, so x's columns are permuted the same way (`rs_columns` in wgmma.py) and the product is unchanged.
// Per chunk: wait for the slot, decode into the free A set, fence, 8 async wgmma (m64nBTk16), commit, wait
// until only this chunk's group is in flight (so the previous chunk's A set and slot are free), release the
// previous slot (with one A set: wait until no group is in flight, release this chunk's slot). Epilogue:
// gs * 2^7 (the decoder's weights are e2m1 * s * 2^-7), bias, one rounding.
// Split-K: fp32 partials per consumer thread; the last CTA of a tile sums them in split order, finishes the
// tile and resets the counter. The counter is CUTLASS's semaphore pattern: a barrier orders the CTA's partial
// stores before one thread's acq_rel atomic (release, cumulative over what the barrier ordered; acquire for
// the last CTA's reads after the second barrier), not a seq_cst fence in every thread (ncu put 15% of a split
// launch's samples on those fences; the acq_rel form ran 1.02-1.03x at the split configs, bench/RESULTS.md).
// PDL (programmatic stream serialization, where the host's pdl_helps says so; K3RUN_SM90_PDL): the weights and
// scales do not depend on the previous kernel, so the producer copies the codes and scales of the ring's first
// slots, then waits for the previous kernel (griddepcontrol.wait) before the first x copy; every consumer
// waits too before anything it reads or writes in global memory. The producer lets the next kernel launch
// once it has issued its last copy (CUTLASS triggers after its main loop too): a trigger at the CTA's start
// lets back-to-back GEMMs launch one another in a cascade whose weight prefetches slow the running one
// (bench/NOTES.md).
// Stream-K (sk > 0 CTAs, one wave): the tiles' 128-wide chunks in pairs, tile-major, tiles x CH / 2 units cut
// into sk contiguous ranges of (nearly) equal length; a CTA walks its range as segments (one tile's chunks each),
// writes a whole tile directly and a tile it shares as a partial in the tile's segment order, the last of the
// tile's CTAs summing them as split-K does. Every slot of the wave works whatever the tile count, where the
// fixed split leaves slots idle (bench/NOTES.md: 224 CTAs in 396 slots at 16 rows of 7168^2).

#include <cuda.h>  // CUtensorMap (the tensor producer's copies)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

namespace k3w {

constexpr int CHUNK = 128;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {  // bar: a shared-window address
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Spins on an mbarrier phase. A wait longer than 10 s (read from %globaltimer every 1024 polls; any copy or
// wgmma takes microseconds) traps, so a protocol error fails the launch ("unspecified launch failure") instead
// of hanging the GPU.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {  // bar: a shared-window address
  uint32_t done, polls = 0;
  uint64_t t0 = 0;
  do {
    if ((++polls & 1023u) == 0) {
      uint64_t now;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      if (t0 == 0)
        t0 = now;
      else if (now - t0 > 10000000000ull)
        __trap();
    }
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

// The same two by one elected lane of a converged warp (every lane calls them with the same operands): each
// stays one predicated instruction of the warp, with no ELECT / BRA.U.ANY loop around it (the loop ptxas
// puts around a copy issued inside a one-thread branch).
__device__ __forceinline__ void mbar_expect_tx_elect(uint32_t bar, uint32_t bytes) {
  asm volatile(
      "{\n.reg .pred p;\nelect.sync _|p, 0xffffffff;\n"
      "@p mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n}" ::"r"(bar),
      "r"(bytes)
      : "memory");
}
__device__ __forceinline__ void bulk_g2s_elect(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "{\n.reg .pred p;\nelect.sync _|p, 0xffffffff;\n"
      "@p cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n}" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// Shared stores by threads, read next by wgmma (the async proxy): each writer fences before the threads meet.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void sts128(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d)
               : "memory");
}

// A 3-D tensor-map copy (box at coordinates {c0, c1, c2}, innermost first) by one elected lane of a converged
// warp; `map` is a __grid_constant__ kernel parameter.
__device__ __forceinline__ void tensor_g2s_elect(uint32_t dst, const CUtensorMap& map, int c0, int c1, int c2,
                                                 uint32_t bar) {
  asm volatile(
      "{\n.reg .pred p;\nelect.sync _|p, 0xffffffff;\n"
      "@p cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, "
      "%4}], [%5];\n}" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// A 2-D tensor-map copy (box at {c0, c1}, innermost first) by one elected lane of a converged warp.
__device__ __forceinline__ void tensor2d_g2s_elect(uint32_t dst, const CUtensorMap& map, int c0, int c1,
                                                   uint32_t bar) {
  asm volatile(
      "{\n.reg .pred p;\nelect.sync _|p, 0xffffffff;\n"
      "@p cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
      "[%4];\n}" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// Programmatic dependent launch (both no-ops in a grid launched without it): wait until the previous kernel on
// the stream has completed and its writes are visible; let the next kernel's CTAs be scheduled.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

template <int N>
__device__ __forceinline__ void fence_regs(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// consumer warpgroups only (named barrier 1; the producer warpgroup never joins it)
__device__ __forceinline__ void consumer_sync(int threads) {
  asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory");
}

// K-major B operand in the 128-byte swizzle: rows of 128 B, 8-row atoms 1024 B apart (SBO), LBO unused;
// `addr` a shared-window address (smem_u32).
__device__ __forceinline__ uint64_t b_desc(uint32_t addr) {
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

// Shared-memory loads from 32-bit shared-window addresses (LDS, not the generic path's 64-bit LD).
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void sts32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t lds16(uint32_t addr) {
  uint16_t v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr) : "memory");
  return v;
}

// The scale pair of a thread's 4 words (low nibbles' E4M3 scale in the low byte): (sl, sh) = each scale
// times 2^119 (bf16) or 2^7 (fp16) duplicated in both halves (tile.word_asm's scale asm).
template <bool BF16>
__device__ __forceinline__ void scale_pair(uint32_t s16, uint32_t& sl, uint32_t& sh) {
  uint32_t sc;
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}" : "=r"(sc) : "r"(s16));
  sc = BF16 ? (sc >> 3) + 0x73807380u : sc + 0x1C001C00u;
  // each half duplicated as PTX register halves: ptxas reads them as the multiplies' .H0_H0 / .H1_H1 operand
  // selectors, no instruction of their own
  asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %2;\nmov.b32 %0, {lo, lo};\nmov.b32 %1, {hi, hi};\n}"
      : "=r"(sl), "=r"(sh)
      : "r"(sc));
}

__device__ __forceinline__ uint32_t mul2(uint32_t a, uint32_t b, bool bf16) {
  uint32_t d;
  if (bf16)
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  else
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// One tiled128 word -> its 4 packed pairs (TILED_PAIR_BITS: pair j's sign and magnitude placed for shifts).
template <bool BF16>
__device__ __forceinline__ void decode_word(uint32_t q, uint32_t sl, uint32_t sh, uint32_t (&o)[4]) {
  if (BF16) {
    o[0] = q & 0x81C081C0u;
    o[1] = (q << 6) & 0x81C081C0u;
    o[2] = ((q << 5) & 0x80008000u) | ((q << 3) & 0x01C001C0u);
    o[3] = ((q << 4) & 0x80008000u) | ((q >> 6) & 0x01C001C0u);
  } else {
    o[0] = (q & 0x80008000u) | ((q << 3) & 0x0E000E00u);
    o[1] = ((q << 6) & 0x80008000u) | ((q << 9) & 0x0E000E00u);
    o[2] = ((q << 5) & 0x80008000u) | ((q << 6) & 0x0E000E00u);
    o[3] = ((q << 4) & 0x80008000u) | ((q >> 3) & 0x0E000E00u);
  }
  o[0] = mul2(o[0], sl, BF16);
  o[1] = mul2(o[1], sl, BF16);
  o[2] = mul2(o[2], sh, BF16);
  o[3] = mul2(o[3], sh, BF16);
}

// One chunk's words and scales of this consumer thread's two rows (at shared-window addresses wb, sb) decoded
// into the A set `a`: k-step b (the chunk's low 64 columns) and 4 + b (high) as {row g p0, row g+8 p0, row g
// p1, row g+8 p1}.
template <bool BF16>
__device__ __forceinline__ void decode_chunk(uint32_t wb, uint32_t sb, uint32_t (&a)[32]) {
  const uint4 q0 = lds128(wb);
  const uint4 q1 = lds128(wb + 8 * 64);  // rows g + 8
  const uint32_t s0 = lds16(sb);
  const uint32_t s1 = lds16(sb + 8 * 8);
  uint32_t sl0, sh0, sl1, sh1;
  scale_pair<BF16>(s0, sl0, sh0);
  scale_pair<BF16>(s1, sl1, sh1);
  const uint32_t qa[4] = {q0.x, q0.y, q0.z, q0.w};
  const uint32_t qb[4] = {q1.x, q1.y, q1.z, q1.w};
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    uint32_t d0[4], d1[4];
    decode_word<BF16>(qa[b], sl0, sh0, d0);
    decode_word<BF16>(qb[b], sl1, sh1, d1);
    a[4 * b + 0] = d0[0];
    a[4 * b + 1] = d1[0];
    a[4 * b + 2] = d0[1];
    a[4 * b + 3] = d1[1];
    a[16 + 4 * b + 0] = d0[2];
    a[16 + 4 * b + 1] = d1[2];
    a[16 + 4 * b + 2] = d0[3];
    a[16 + 4 * b + 3] = d1[3];
  }
}

template <int BT, bool BF16>
struct Wgmma;

// explicit conversions: torch builds extensions with __CUDA_NO_HALF_CONVERSIONS__ / _BFLOAT16_CONVERSIONS__
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}

//@@WGMMA@@

// A chunk's 8 wgmma (m64nBTk16) on the A set `a` and the chunk's x tile (`x_off` bytes past the tile of B
// descriptor `desc0`) as one group, then a wait until at most IN_FLIGHT groups are in flight: 1, this one (the
// previous chunk's A set and slot are free); 0 where a warpgroup has one A set.
template <int BT, bool BF16, int IN_FLIGHT = 1>
__device__ __forceinline__ void issue_chunk(uint64_t desc0, uint32_t x_off, float (&acc)[BT / 2],
                                            uint32_t (&a)[32]) {
  fence_regs(a);
  fence_regs(acc);
  wgmma_fence();
  // lane 0's value: ptxas then keeps the descriptors in uniform registers (without the shuffle it cannot
  // see that the offset is the same in every lane, and moves each of the 16 descriptors with two R2UR)
  const uint64_t xdesc = desc0 + __shfl_sync(0xffffffffu, x_off / 16, 0);
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const uint64_t desc = xdesc + ((k / 4) * (BT * 128) + (k % 4) * 32) / 16;
    Wgmma<BT, BF16>::mma(acc, a[4 * k], a[4 * k + 1], a[4 * k + 2], a[4 * k + 3], desc);
  }
  wgmma_commit();
  wgmma_wait<IN_FLIGHT>();
  fence_regs(acc);
}

// One CTA's piece of one tile: chunks [c_lo, c_hi) of tile `tile`.
struct Seg {
  int tile, c_lo, c_hi;
};

// Stream-K's units are chunk pairs (CH even), so every segment holds whole pairs: an odd last chunk inside the
// segment loop made ptxas serialize every wgmma (C7512). tiles * CH / 2 units over sk CTAs in order: the first
// r of them q + x units, the rest q (q, r, x from the host: kernel parameters, no registers held across the
// loop). x = 1 is stream-K's even split; the tail split has r CTAs of whole tiles (q + x = CH / 2), then
// the remaining tiles' CTAs, s to a tile (q = CH / 2 / s).
struct SkSplit {
  int q, r, per_tile, x;  // per_tile = CH / 2
  __device__ __forceinline__ int begin(int b) const { return b * q + min(b, r) * x; }
  __device__ __forceinline__ int owner(int u) const {
    const int big = r * (q + x);
    return u < big ? u / (q + x) : r + (u - big) / q;
  }
  // this CTA's piece index among the CTAs sharing `tile` (the partials' summation order) and their count
  __device__ __forceinline__ void piece(int tile, int& seg, int& nseg) const {
    const int first = owner(tile * per_tile);
    seg = int(blockIdx.x) - first;
    nseg = owner(tile * per_tile + per_tile - 1) - first + 1;
  }
};

// Calls f(seg) for this CTA's stream-K segments in order. The producer and the consumers walk the same
// segments, so the ring's slots line up.
template <typename F>
__device__ __forceinline__ void for_each_sk_segment(const SkSplit& sp, F&& f) {
  const int b = blockIdx.x;
  for (int u = sp.begin(b); u < sp.begin(b + 1);) {
    const int tile = u / sp.per_tile;
    const int p_lo = u - tile * sp.per_tile;
    const int p_hi = min(sp.per_tile, p_lo + (sp.begin(b + 1) - u));
    f(Seg{tile, 2 * p_lo, 2 * p_hi});
    u += p_hi - p_lo;
  }
}

// This CTA's segments in order: one (its split's chunks of its tile) on the fixed grid, stream-K's otherwise.
template <bool SK, typename F>
__device__ __forceinline__ void for_each_segment(int nch, int CH, int sk_q, int sk_r, int sk_x, F&& f) {
  if constexpr (!SK)
    f(Seg{int(blockIdx.x), int(blockIdx.y) * nch, int(blockIdx.y) * nch + nch});
  else
    for_each_sk_segment(SkSplit{sk_q, sk_r, CH / 2, sk_x}, f);
}

// What the producer copies for a segment: its tile's first 16-row block, how many of its NWG * 4 exist, the
// bytes a chunk brings (x tile, codes, scales) and the tile's prepared x.
struct SegSrc {
  int rb0, nrb;
  uint32_t bytes;
  const uint8_t* xsrc;
};
template <int NWG, int X>
__device__ __forceinline__ SegSrc seg_src(const Seg& sg, int n_tiles, int row_blocks, int CH,
                                          const uint8_t* xt) {
  const int rb0 = (sg.tile % n_tiles) * NWG * 4;
  const int nrb = min(NWG * 4, row_blocks - rb0);
  return SegSrc{rb0, nrb, uint32_t(X + nrb * (1024 + 128)), xt + size_t(sg.tile / n_tiles) * CH * X};
}

template <int BT, int NWG>
struct Smem {
  static constexpr int X = 2 * BT * 128;  // one slot's x: two 64-column halves of BT rows, 128 B each
  static constexpr int W = NWG * 4 * 1024;
  static constexpr int S = NWG * 4 * 128;
  static constexpr int per_stage = X + W + S;
  static int bytes(int stages) { return 1024 + stages * per_stage + 2 * stages * 8 + 16; }
};

// The consumer's view of the ring as shared-window addresses, so no chunk converts a generic pointer (~12
// instructions: the CTA's shared window read and aligned again): this thread's words and scales of slot 0 (already offset to its rows and columns), the
// barriers, and slot 0's B descriptor (a slot's is it plus the slot's offset / 16).
struct Ring {
  uint32_t w0, s0, full, empty;
  uint64_t desc0;
  int stages, lane;
  uint32_t x0;  // slot 0's x
  int gather;   // the slots' x as the x gather's copies bring it: permuted by the consumers (permute_x)
};

// The slot and phase of the next chunk, kept incrementally: no division by the runtime ring depth per chunk
// (~15 instructions).
struct Slot {
  int st = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance(int stages) {
    if (++st == stages) {
      st = 0;
      phase ^= 1u;
    }
  }
};

// The x gather (K3RUN_SM90_X_GATHER; the fixed grid, one consumer warpgroup, BT <= 32): no prep_x launch.
// The producer copies each chunk of x [M, K] itself with two tensor-map copies (tm_x: x as 16-bit [M, K], a
// box of 64 columns x BT rows, the 128-byte swizzle, zero past M and K), on the slot's barrier like the
// codes. The slot then holds x's columns in their own order; the consumers permute it in place into prep_x's
// order before the wgmma reads it: consumer thread q < 2 * BT takes row half q (row q / 2, 64-column half
// q % 2; 128 bytes, 8 units, unit u at u ^ (row % 8) in both layouts): natural unit 2t + j (half columns 16t +
// 8j) holds in its word e columns 16t + 4b + 2p (+0, +1) with b = 2j + e / 2, p = e % 2, i.e. word t of
// stored unit 4j + e (operand position 16b + 8p + 2t holds column 16t + 4b + 2p). Each permuting thread then
// fences its stores (fence.proxy.async: the wgmma reads through the async proxy) and the warpgroup meets at a
// named barrier before the wgmma, after the chunk's decode. On an H100 this runs 1.15-1.37x slower than prep_x
// + the GEMM at 16-32 rows: the permute adds to the consumer's chunk time, which the kernel's time follows
// (with no permute the same launch runs 0.89-0.91x), so it is off by default (K3RUN_SM90_X_GATHER); the
// permuting designs that lost are in bench/NOTES.md.
// Three consumer warpgroups (BT 128, 192 weight rows a CTA; the fixed grid): 13 warps leave each thread 128
// registers (a quarter of the SM's registers a scheduler, and 4 warps on one of them), which the 64
// accumulators and two A sets do not fit (ptxas serializes the wgmma, C7511). So each warpgroup decodes into
// one A set and waits for its chunk's group before the next decode; the other two warpgroups' groups keep
// the tensor core busy meanwhile (on an H100 a three-warpgroup CTA did 1.5x a two-warpgroup tile's work in
// 1.48x its time: bench/NOTES.md).
template <int NWG>
__host__ __device__ constexpr bool one_a_set() {
  return NWG == 3;
}
template <int BT, int NWG, bool SK>
__host__ __device__ constexpr bool gather_ok() {
  return !SK && NWG == 1 && BT <= 32;
}
template <int BT>
__device__ __forceinline__ void permute_x(uint32_t slot) {
  const int q = threadIdx.x;  // one consumer warpgroup: 0..127
  if (q < 2 * BT) {
    const int row = q >> 1, h = q & 1;
    const uint32_t base = slot + h * (BT * 128) + row * 128;
    auto unit = [&](int u) { return base + ((u ^ (row & 7)) * 16); };
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) v[u] = lds128(unit(u));
#pragma unroll
    for (int j = 0; j < 2; ++j) {  // stored unit 4j + e: word e of natural units j, 2 + j, 4 + j, 6 + j
      sts128(unit(4 * j + 0), v[j].x, v[2 + j].x, v[4 + j].x, v[6 + j].x);
      sts128(unit(4 * j + 1), v[j].y, v[2 + j].y, v[4 + j].y, v[6 + j].y);
      sts128(unit(4 * j + 2), v[j].z, v[2 + j].z, v[4 + j].z, v[6 + j].z);
      sts128(unit(4 * j + 3), v[j].w, v[2 + j].w, v[4 + j].w, v[6 + j].w);
    }
    fence_proxy_async_smem();
  }
}

// The CTA's c-th chunk (counted over all its segments; in slot `sl`) on the consumer side, decoding into the A
// set `a` (the other set may still be read by chunk c - 1's wgmma): wait for the slot, decode, issue, keep
// only this chunk's group in flight, release chunk c - 1's slot.
template <int BT, int NWG, bool BF16, bool GATHER>
__device__ __forceinline__ void consume(const Ring& r, int c, const Slot& sl, float (&acc)[BT / 2],
                                        uint32_t (&a)[32]) {
  using SM = Smem<BT, NWG>;
  const int st = sl.st;
  mbar_wait(r.full + 8 * st, sl.phase);
  if (GATHER && r.gather) permute_x<BT>(r.x0 + st * SM::X);
  decode_chunk<BF16>(r.w0 + st * SM::W, r.s0 + st * SM::S, a);
  if (GATHER && r.gather) consumer_sync(128);  // every permuting thread has fenced its stores
  // one A set: this chunk's group waited for, so its slot is free now; two: chunk c - 1's
  constexpr bool ONE = one_a_set<NWG>();
  issue_chunk<BT, BF16, ONE ? 0 : 1>(r.desc0, uint32_t(st * SM::X), acc, a);
  if (ONE || c > 0) {
    __syncwarp();
    if (r.lane == 0) mbar_arrive(r.empty + 8 * (ONE ? st : st == 0 ? r.stages - 1 : st - 1));
  }
}

// The producer's forms (kernel parameter `producer`; K3RUN_SM90_PRODUCER): one thread issuing every copy; the
// whole warp with one elected lane issuing; that and tensor-map copies of a chunk's NWG * 4 row blocks.
constexpr int PRODUCER_THREAD = 0, PRODUCER_WARP = 1, PRODUCER_TENSOR = 2;
static_assert(PRODUCER_THREAD < PRODUCER_WARP && PRODUCER_WARP < PRODUCER_TENSOR, "producer forms in order");

// Threads of a CTA: NWG consumer warpgroups, then the producer. With two consumer warpgroups the producer is a
// whole warpgroup (setmaxnreg, which moves its registers to the consumers, acts on warpgroups); with one it is
// a single warp, so a CTA holds 5 warps and more CTAs fit an SM: the consumers' decode is latency-bound (ncu:
// ~2 warps a scheduler at 2 CTAs of 256 threads), and 3 CTAs of 160 threads fit. With three it is a single warp
// too: ptxas allocates the launch's register cap to every thread whatever setmaxnreg moves later (512
// threads: 128, serialized wgmma), so the producer warpgroup's registers would only be lost.
template <int NWG>
constexpr int cta_threads() {
  return NWG == 1 ? 160 : NWG == 3 ? 3 * 128 + 32 : (NWG + 1) * 128;
}
// CTAs an SM asked of ptxas (it caps the registers to fit them): 3 for one consumer warpgroup up to BT 64
// (<= 136 registers; 99-122 used), one otherwise. 4 at BT 16 (<= 102) makes ptxas (CUDA 13.0) serialize the
// wgmma for registers (C7512). The stream-K kernel (SK) holds its segment loop's state across the K loop:
// at BT 64 it spills under the 3-CTA cap, so 2 there.
template <int BT, int NWG, bool SK = false>
constexpr int min_ctas() {
  return NWG == 1 && BT <= 64 ? (SK && BT == 64 ? 2 : 3) : 1;
}

// SK: the stream-K kernel (sk > 0 CTAs over chunk-pair segments, an even chunk count; one consumer warpgroup,
// or two at BT 128: the tail split's form), else the fixed grid (tiles x split_k); two instantiations, so the
// fixed grid's code is what it is without the segment loop.
template <int BT, int NWG, bool BF16, bool SK>
__global__ void __launch_bounds__(cta_threads<NWG>(), min_ctas<BT, NWG, SK>())
    w4a16_kernel(const uint8_t* __restrict__ xt, const uint8_t* __restrict__ w, const uint8_t* __restrict__ s,
                 const float* __restrict__ gs, int per_col_gs, const void* __restrict__ bias, void* __restrict__ y,
                 int ldy, float* __restrict__ ws, int* __restrict__ cnt, int M, int N, int row_blocks, int CH,
                 int nch, int stages, int tiles, int producer, int sk, int sk_q, int sk_r, int sk_x, int gather,
                 const __grid_constant__ CUtensorMap tm_w, const __grid_constant__ CUtensorMap tm_s,
                 const __grid_constant__ CUtensorMap tm_x) {
  using T = typename std::conditional<BF16, __nv_bfloat16, __half>::type;
  using SM = Smem<BT, NWG>;
  constexpr int ACC = BT / 2;
  constexpr bool GATHER = gather_ok<BT, NWG, SK>();
  extern __shared__ uint8_t smem_raw[];  // no static shared memory: all of it counts toward the 227 KB
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* xs = smem;                             // stages * X (each 1024-aligned)
  uint8_t* wsm = xs + stages * SM::X;             // stages * W
  uint8_t* ssm = wsm + stages * SM::W;            // stages * S
  uint64_t* full = reinterpret_cast<uint64_t*>(ssm + stages * SM::S);
  uint64_t* empty = full + stages;
  // the split-K "last CTA" flag, by its shared-window address: one register held, not a generic pointer's two
  const uint32_t last_flag = smem_u32(empty + stages);

  const int n_tiles = (N + NWG * 64 - 1) / (NWG * 64);
  const int wg = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int i = 0; i < stages; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], NWG * 4);
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (wg == NWG) {  // ---- producer (a warpgroup, or one warp: cta_threads)
    // 56 registers: at 40 ptxas spilled the warp forms' loop (the consumers use <= 155 of their 224; the
    // SASS test pins no spill)
    if constexpr (NWG == 2) asm volatile("setmaxnreg.dec.sync.aligned.u32 56;");
    if (producer != PRODUCER_THREAD) {
      // The producer warp's 32 lanes walk the ring together (the same waits, the same indices) and one
      // elected lane issues each copy: in SASS a predicated UBLKCP with no loop around it, the copies'
      // address work interleaved. Where one thread walks it (below), every copy is a serial ELECT /
      // BRA.U.ANY loop. PRODUCER_TENSOR also moves the CTA's NWG * 4 row blocks' codes (and their scales)
      // of a chunk in one tensor-map copy each (the map's box is that many blocks), three copies a chunk
      // instead of 1 + 2 * NWG * 4. With two consumer warpgroups the producer warpgroup's first warp walks
      // the ring. K3RUN_SM90_PRODUCER chooses; bench/NOTES.md has why a lone CTA waits on its one-thread
      // producer.
      if (threadIdx.x / 32 == NWG * 4) {
        const uint32_t xs0 = smem_u32(xs), wsm0 = smem_u32(wsm), ssm0 = smem_u32(ssm);
        const uint32_t full0 = smem_u32(full), empty0 = smem_u32(empty);
        const bool tensor = producer == PRODUCER_TENSOR;
        // a chunk's codes and scales into slot st (completing on `bar`)
        auto copy_ws = [&](const SegSrc& g, int c, int st, uint32_t bar) {
          if (tensor) {
            tensor_g2s_elect(wsm0 + st * SM::W, tm_w, 0, c, g.rb0, bar);
            tensor_g2s_elect(ssm0 + st * SM::S, tm_s, 0, c, g.rb0, bar);
          } else {
            for (int rb = 0; rb < g.nrb; ++rb) {
              const size_t blk = size_t(g.rb0 + rb) * CH + c;
              bulk_g2s_elect(wsm0 + st * SM::W + rb * 1024, w + blk * 1024, 1024, bar);
              bulk_g2s_elect(ssm0 + st * SM::S + rb * 128, s + blk * 128, 128, bar);
            }
          }
        };
        // a box past the last row block is zero-filled and still counted in full
        auto slot_bytes = [&](const SegSrc& g) { return tensor ? SM::X + SM::W + SM::S : g.bytes; };
        // Before the previous kernel is done: the first `stages` chunks' codes and scales, each slot's
        // transaction count set for all its bytes (the x copy below completes it).
        int i = 0;
        for_each_segment<SK>(nch, CH, sk_q, sk_r, sk_x, [&](const Seg& sg) {
          const SegSrc g = seg_src<NWG, SM::X>(sg, n_tiles, row_blocks, CH, xt);
          for (int c = sg.c_lo; c < sg.c_hi && i < stages; ++c, ++i) {
            mbar_expect_tx_elect(full0 + 8 * i, slot_bytes(g));
            copy_ws(g, c, i, full0 + 8 * i);
          }
        });
        const int early = i;  // chunks whose codes and scales are already on their way
        pdl_wait();
        Slot sl;
        i = 0;  // chunks issued so far, over all segments
        for_each_segment<SK>(nch, CH, sk_q, sk_r, sk_x, [&](const Seg& sg) {
          const SegSrc g = seg_src<NWG, SM::X>(sg, n_tiles, row_blocks, CH, xt);
          for (int c = sg.c_lo; c < sg.c_hi; ++c, ++i, sl.advance(stages)) {
            const int st = sl.st;
            const uint32_t bar = full0 + 8 * st;
            if (i >= stages) mbar_wait(empty0 + 8 * st, sl.phase ^ 1u);
            if (i >= early) mbar_expect_tx_elect(bar, slot_bytes(g));
            if (GATHER && gather) {  // x [M, K] itself: its two halves as they are (the consumers permute)
              const int x_row0 = int(blockIdx.x) / n_tiles * BT;
              tensor2d_g2s_elect(xs0 + st * SM::X, tm_x, c * 128, x_row0, bar);
              tensor2d_g2s_elect(xs0 + st * SM::X + BT * 128, tm_x, c * 128 + 64, x_row0, bar);
            } else {
              bulk_g2s_elect(xs0 + st * SM::X, g.xsrc + size_t(c) * SM::X, SM::X, bar);
            }
            if (i >= early) copy_ws(g, c, st, bar);
            __syncwarp();
          }
        });
        pdl_launch_dependents();
      }
      return;
    }
    if (threadIdx.x == NWG * 128) {  // one thread issues every copy
      pdl_wait();
      Slot sl;
      int i = 0;  // chunks issued so far, over all segments
      for_each_segment<SK>(nch, CH, sk_q, sk_r, sk_x, [&](const Seg& sg) {
        const SegSrc g = seg_src<NWG, SM::X>(sg, n_tiles, row_blocks, CH, xt);
        for (int c = sg.c_lo; c < sg.c_hi; ++c, ++i, sl.advance(stages)) {
          const int st = sl.st;
          if (i >= stages) mbar_wait(smem_u32(&empty[st]), sl.phase ^ 1u);
          mbar_expect_tx(&full[st], g.bytes);
          bulk_g2s(xs + st * SM::X, g.xsrc + size_t(c) * SM::X, SM::X, &full[st]);
          for (int rb = 0; rb < g.nrb; ++rb) {
            const size_t blk = size_t(g.rb0 + rb) * CH + c;
            bulk_g2s(wsm + st * SM::W + rb * 1024, w + blk * 1024, 1024, &full[st]);
            bulk_g2s(ssm + st * SM::S + rb * 128, s + blk * 128, 128, &full[st]);
          }
        }
      });
      pdl_launch_dependents();
    }
    return;
  }

  // ---- consumer warpgroups
  if constexpr (NWG == 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 224;");
  pdl_wait();  // before the epilogue's global reads and writes (the ring's x arrives after it anyway)
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int rb = wg * 4 + warp;  // this warp's 16-row block within the CTA
  const int w_off0 = rb * 1024 + g * 64 + t * 16;                     // rows g (+ 8 * 64: rows g + 8)
  const int s_off0 = rb * 128 + g * 8 + 4 * (t & 1) + 2 * (t >> 1);  // (+ 8 * 8: rows g + 8)

  float acc[ACC];
  uint32_t a0[32], a1[32];
  const Ring ring{smem_u32(wsm) + w_off0, smem_u32(ssm) + s_off0, smem_u32(full), smem_u32(empty),
                  b_desc(smem_u32(xs)), stages, lane, smem_u32(xs), GATHER ? gather : 0};
  const int nthreads = NWG * 128;
  const int ctid = threadIdx.x;  // consumer thread index 0 .. NWG*128-1
  T* out = reinterpret_cast<T*>(y);
  const T* bp = reinterpret_cast<const T*>(bias);
  Slot sl;
  int i = 0;  // chunks consumed so far, over all segments
  // the segment's chunk pairs (the pair's second chunk decodes into the other A set while the first's wgmma
  // runs); returns the first chunk left over (c_hi, or c_hi - 1 for an odd count)
  auto pairs = [&](int c_lo, int c_hi) {
#pragma unroll
    for (int j = 0; j < ACC; ++j) acc[j] = 0.f;
    int c = c_lo;
    for (; c + 1 < c_hi; c += 2, i += 2) {
      consume<BT, NWG, BF16, GATHER>(ring, i, sl, acc, a0);
      sl.advance(stages);
      consume<BT, NWG, BF16, GATHER>(ring, i + 1, sl, acc, one_a_set<NWG>() ? a0 : a1);
      sl.advance(stages);
    }
    return c;
  };
  // after the segment's chunks: wait for every group (acc final, both A sets free for the next segment), then
  // the epilogue: the tile's output, or its partial and, for the tile's last CTA, the sum of the partials
  auto finish = [&](int pid, int seg, int nseg) {
    wgmma_wait<0>();
    fence_regs(acc);
    if (nseg > 1) {
      float* mine = ws + ((size_t(seg) * tiles + pid) * nthreads + ctid) * ACC;
#pragma unroll
      for (int j = 0; j < ACC; j += 4)
        *reinterpret_cast<float4*>(mine + j) = make_float4(acc[j], acc[j + 1], acc[j + 2], acc[j + 3]);
      consumer_sync(nthreads);
      if (ctid == 0) {
        int old;
        asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(cnt + pid) : "memory");
        sts32(last_flag, old == nseg - 1);
      }
      consumer_sync(nthreads);
      if (!lds32(last_flag)) return;
#pragma unroll
      for (int j = 0; j < ACC; ++j) acc[j] = 0.f;
      for (int p = 0; p < nseg; ++p) {
        const float* part = ws + ((size_t(p) * tiles + pid) * nthreads + ctid) * ACC;
#pragma unroll
        for (int j = 0; j < ACC; j += 4) {
          const float4 v = __ldcg(reinterpret_cast<const float4*>(part + j));
          acc[j] += v.x;
          acc[j + 1] += v.y;
          acc[j + 2] += v.z;
          acc[j + 3] += v.w;
        }
      }
      if (ctid == 0) cnt[pid] = 0;
    }
    const int row_base = (pid % n_tiles) * NWG * 64 + wg * 64 + warp * 16 + g;
    const int tok_base = (pid / n_tiles) * BT + 2 * t;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = row_base + 8 * h;
      if (n >= N) continue;
      const float scale = (per_col_gs ? gs[n] : gs[0]) * 128.0f;
      const float bv = bp ? to_float(bp[n]) : 0.0f;
#pragma unroll
      for (int q = 0; q < BT / 8; ++q) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int tok = tok_base + 8 * q + e;
          if (tok < M) out[size_t(tok) * ldy + n] = from_float<T>(acc[4 * q + 2 * h + e] * scale + bv);
        }
      }
    }
  };
  if constexpr (!SK) {  // one segment, of any chunk count: an odd last chunk after the pairs, outside any loop
    const int c0 = int(blockIdx.y) * nch;
    if (pairs(c0, c0 + nch) < c0 + nch) {
      consume<BT, NWG, BF16, GATHER>(ring, i, sl, acc, a0);
      sl.advance(stages);
      ++i;
    }
    finish(int(blockIdx.x), int(blockIdx.y), int(gridDim.y));
  } else {  // whole chunk pairs only
    const SkSplit sp{sk_q, sk_r, CH / 2, sk_x};
    for_each_sk_segment(sp, [&](const Seg& sg) {
      pairs(sg.c_lo, sg.c_hi);
      int seg, nseg;
      sp.piece(sg.tile, seg, nseg);  // after the loop: nothing more held across it
      finish(sg.tile, seg, nseg);
    });
  }
}

// x [M, K] (row stride ldx, 4-byte aligned rows) -> xt [t_tiles][CH][2][BT][64]: each 64-column half of a
// chunk in the A registers' column order (operand position 16b + 8p + 2t + e holds column 16t + 4b + 2p + e),
// stored in the 128-byte swizzle (16-byte unit u of row r at u ^ (r % 8)); rows past M and columns past K 0.
template <typename T>
__global__ void prep_x_kernel(const T* __restrict__ x, int ldx, int M, int K, int BT, int CH, T* __restrict__ xt,
                              int total_units) {
  // with PDL the GEMM after this launch may start (its weight copies need nothing from here); x is read only
  // after the previous kernel is done
  pdl_launch_dependents();
  pdl_wait();
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= total_units) return;
  const int u = idx % 8;  // stored 16-byte unit of the row
  int rest = idx / 8;
  const int r = rest % BT;
  rest /= BT;
  const int h = rest % 2;
  rest /= 2;
  const int c = rest % CH;
  const int tt = rest / CH;
  const int lu = u ^ (r % 8);
  const int b = lu >> 1, p = lu & 1;
  const int row = tt * BT + r;
  uint32_t v[4] = {0, 0, 0, 0};
  if (row < M) {
    const T* src = x + size_t(row) * ldx;
#pragma unroll
    for (int tq = 0; tq < 4; ++tq) {
      const int col = c * CHUNK + h * 64 + 16 * tq + 4 * b + 2 * p;
      if (col < K) v[tq] = *reinterpret_cast<const uint32_t*>(src + col);
    }
  }
  *reinterpret_cast<uint4*>(xt + size_t(idx) * 8) = make_uint4(v[0], v[1], v[2], v[3]);
}

// ---- The decode GEMV (M <= 16): mma.sync on registers loaded straight from global memory ----
// y[M, N] = x[M, K] @ (e2m1(W) * s)^T * gs (+ bias) for up to 16 tokens (BT 8 or 16: one or two n-tiles of
// mma.sync m16n8k16), the weights the A operand as in the GEMM above. One warp a 16-row block and K split
// (blockIdx.y of `split`); no shared memory, no CTA barrier. Lane 4g + t owns two weight rows (rows g and
// g + 8 of its block) and words 4t..4t+3 of each row's chunk: tiled128 stores a row's 16 words of a chunk
// contiguously, so one 16-byte load a row a chunk, straight into registers, the next chunk's issued before
// this one's decode; decode_chunk's A set (k-step b: physical k 16t + 4b + 2p + e, low half; 4 + b: the
// same + 64). The B operand of k-step b for token n = 8j + g (n-tile j) is x[n][16t + 4b + 0..3]: the lane
// loads x[n][16t .. 16t + 15] and x[n][64 + 16t ..] (four 16-byte loads an n-tile a chunk), and k-step b's
// two B registers are words 2b and 2b + 1 of the first pair (4 + b: of the second), with no register moves.
// The low and high halves accumulate apart (two chains of 4 mma a chunk an n-tile, not one of 8) and are
// added at the end. Token columns past M re-read the last token and are never stored.
// Modes (blockIdx.z): dense (z = 0); one routed pick a z (`ids`: its local expert, outside [0, E): another
// rank's, a zero row; x row z / slot_div, y row z; one token); one group of `expert_groups`' table a z (its
// expert, then up to BT picks: the tokens x[pick / slot_div] into y rows pick; an unused group returns). The
// experts' weights, scales and global scales are E stacked tiled128 matrices (the *_estride offsets).
// `act` (GEMM1 of gated experts, its 2I rows gate then up): warp rb's rows are gate rows 8rb + g and up rows
// half_n + 8rb + g, so each lane holds a gate value and its up value for the same token: both scaled and
// rounded to y's dtype (what GEMM1 stores on the separate path), then h = act(gate, up) in fp32 (moe_ops'
// gated kernel's formulas) into y column 8rb + g.
// Split-K as the GEMM's: fp32 partials [z][split][rows][BT], the warp's __syncwarp orders its stores before
// lane 0's acq_rel arrival on the (z, row block) counter; the last arrival sums the partials in split order,
// finishes, resets the counter. PDL: dense, the first chunk's codes and scales are loaded before
// griddepcontrol.wait (they do not depend on the previous kernel), x and every write after it; the expert
// modes wait first (the ids or the table are the previous kernel's output). The next kernel may launch once
// the K loop is done.
__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {  // read once: keep L1 for x
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t ldg_u16(const uint16_t* p) {
  uint16_t v;
  asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
template <bool BF16>
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  if (BF16)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// moe_ops' tanh for the SiTU activations: the series to x^9 near 0 (the exp formula cancels there)
__device__ __forceinline__ float tanh_g(float v) {
  const float v2 = v * v;
  const float series =
      v * (1.f + v2 * (-1.f / 3.f + v2 * (2.f / 15.f + v2 * (-17.f / 315.f + v2 * (62.f / 2835.f)))));
  return fabsf(v) < 0.2f ? series : 1.f - 2.f / (__expf(2.f * v) + 1.f);
}

constexpr int GEMV_DENSE = 0, GEMV_PICKS = 1, GEMV_GROUPS = 2;
struct GemvArgs {
  const uint4* w;      // tiled128 codes (uint4 units); experts: E stacked, w_estride apart
  const uint16_t* s;   // tiled128 scales (uint16 units), s_estride apart
  const uint4* x;      // [T, K] with rows of ldx16 uint4
  const float* gs;     // [1] or [rows]; experts [E, 1 or N_pad], gs_estride apart
  const void* bias;    // dense only; y's dtype
  void* y;
  float* ws;
  int* cnt;
  const void* ids;     // GEMV_PICKS: int32 / int64 [P]; GEMV_GROUPS: the int32 table [G, 1 + BT]
  long long w_estride, s_estride;
  int ldx16, per_col_gs, ldy, M, N, row_blocks, CH, nch, split, mode, ids64, n_experts, slot_div, gs_estride;
  int act, half_n;  // act: 0 none, 1 SiLU, 2 SiTU, 3 SiTU with the up half capped
  float beta, rbeta, lbeta, rlbeta;
};

// Warps a CTA of the GEMV (one 16-row block each) and CTAs an SM asked of ptxas (it caps the registers to fit).
constexpr int GEMV_WARPS = 1;
template <int BT>
constexpr int gemv_min_ctas() {
  return BT == 8 ? 32 : 24;
}

// ACT (a template flag: its two rows sit in different row blocks, two code pointers where one serves the
// rows g and g + 8 of a block; only the 8-token tile has it, the 16-token one would spill)
template <int BT, bool BF16, bool ACT>
__global__ void __launch_bounds__(32 * GEMV_WARPS, gemv_min_ctas<BT>())
    gemv_kernel(const __grid_constant__ GemvArgs a) {
  using T = typename std::conditional<BF16, __nv_bfloat16, __half>::type;
  constexpr int NT = BT / 8;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int rb = blockIdx.x * GEMV_WARPS + int(threadIdx.x >> 5);
  if (rb >= a.row_blocks) return;  // a whole warp: nothing below waits for another warp
  const int z = blockIdx.z;
  // this lane's two weight rows: rows g, g + 8 of block rb, or with `act` the gate and up rows of column 8rb + g
  static_assert(!ACT || BT == 8, "the activation epilogue runs the 8-token tile");
  const int r_lo = ACT ? 8 * rb + g : 16 * rb + g;
  const int r_hi = ACT ? a.half_n + 8 * rb + g : 16 * rb + g + 8;
  const uint4* w = a.w;
  const uint16_t* s = a.s;
  const float* gs = a.gs;
  int M = a.M, xrow[NT];
  if (a.mode == GEMV_DENSE) {
#pragma unroll
    for (int j = 0; j < NT; ++j) xrow[j] = min(8 * j + g, M - 1);
  } else {
    pdl_wait();  // the ids or the table: the previous kernel's output
    int e;
    if (a.mode == GEMV_PICKS) {
      const long long id = a.ids64 ? static_cast<const long long*>(a.ids)[z] : static_cast<const int*>(a.ids)[z];
      if (id < 0 || id >= a.n_experts) {  // another rank's expert: a zero row (written by split 0's warps)
        if (blockIdx.y == 0) {
          T* yz = static_cast<T*>(a.y) + size_t(z) * a.ldy;
          const int c0 = ACT ? 8 * rb : 16 * rb, width = ACT ? 8 : 16, limit = ACT ? a.half_n : a.N;
          if (lane < width && c0 + lane < limit) yz[c0 + lane] = from_float<T>(0.f);
        }
        return;
      }
      e = int(id);
      M = 1;
#pragma unroll
      for (int j = 0; j < NT; ++j) xrow[j] = z / a.slot_div;
    } else {
      const int* grp = static_cast<const int*>(a.ids) + size_t(z) * (BT + 1);
      e = grp[0];
      if (e < 0) return;  // an unused group
      M = 0;
#pragma unroll
      for (int n = 0; n < BT; ++n) M += grp[1 + n] >= 0;  // the group's picks fill columns 0 .. M - 1
#pragma unroll
      for (int j = 0; j < NT; ++j) xrow[j] = grp[1 + min(8 * j + g, M - 1)] / a.slot_div;
    }
    w += size_t(e) * a.w_estride;
    s += size_t(e) * a.s_estride;
    gs += size_t(e) * a.gs_estride;
  }
  const int c0 = int(blockIdx.y) * a.nch;
  // a 16-row block's chunk: 1 KB of words (64 uint4; row r's at 4r..4r+3) and 128 B of scales (64 uint16;
  // row r's 8 bytes at 4r..4r+3, TILED_SCALE_ORDER: groups t and t + 4, this lane's pair, at uint16 4r + so)
  const int so = (t & 1) * 2 + (t >> 1);
  // the second row: 8 rows (32 uint4, 32 uint16) past the first in its block, or with ACT its own pointer
  const uint4* wlo = w + (size_t(r_lo >> 4) * a.CH + c0) * 64 + 4 * (r_lo & 15) + t;
  const uint16_t* slo = s + (size_t(r_lo >> 4) * a.CH + c0) * 64 + 4 * (r_lo & 15) + so;
  const uint4* whi = ACT ? w + (size_t(r_hi >> 4) * a.CH + c0) * 64 + 4 * (r_hi & 15) + t : nullptr;
  const uint16_t* shi = ACT ? s + (size_t(r_hi >> 4) * a.CH + c0) * 64 + 4 * (r_hi & 15) + so : nullptr;
  const uint4* xp[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) xp[j] = a.x + size_t(xrow[j]) * a.ldx16 + size_t(c0) * 16 + 2 * t;

  float acc[NT][2][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[j][h][i] = 0.f;
  // one chunk: x loads, the next chunk's codes and scales into (na, nb, ns0, ns1) where `more`, the decode
  // and the mma of the chunk in (qa, qb, s0, s1); every pointer advances by a chunk
  auto chunk = [&](const uint4& qa, const uint4& qb, uint32_t s0, uint32_t s1, uint4& na, uint4& nb,
                   uint32_t& ns0, uint32_t& ns1, bool more) {
    uint4 xv[NT][4];  // per n-tile: x[n][16t ..+7], [+8 ..+15], [64 + 16t ..], [64 + 16t + 8 ..]
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      xv[j][0] = __ldg(xp[j]);
      xv[j][1] = __ldg(xp[j] + 1);
      xv[j][2] = __ldg(xp[j] + 8);
      xv[j][3] = __ldg(xp[j] + 9);
      xp[j] += 16;
    }
    wlo += 64;
    slo += 64;
    if (ACT) {
      whi += 64;
      shi += 64;
    }
    if (more) {
      na = ldg_stream(wlo);
      nb = ldg_stream(ACT ? whi : wlo + 32);
      ns0 = ldg_u16(slo);
      ns1 = ldg_u16(ACT ? shi : slo + 32);
    }
    uint32_t sl0, sh0, sl1, sh1;
    scale_pair<BF16>(s0, sl0, sh0);
    scale_pair<BF16>(s1, sl1, sh1);
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      uint32_t d0[4], d1[4];
      decode_word<BF16>(word_of(qa, b), sl0, sh0, d0);
      decode_word<BF16>(word_of(qb, b), sl1, sh1, d1);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const uint4& lo = xv[j][b >> 1];  // words 2b, 2b + 1 of the low run
        const uint4& hi = xv[j][2 + (b >> 1)];
        const int q = 2 * (b & 1);
        mma16816<BF16>(acc[j][0], d0[0], d1[0], d0[1], d1[1], word_of(lo, q), word_of(lo, q + 1));
        mma16816<BF16>(acc[j][1], d0[2], d1[2], d0[3], d1[3], word_of(hi, q), word_of(hi, q + 1));
      }
    }
  };
  // two register sets for the codes and scales, alternating, so no chunk copies one into the other
  uint4 qa = ldg_stream(wlo), qb = ldg_stream(ACT ? whi : wlo + 32), ra, rbq;
  uint32_t s0 = ldg_u16(slo), s1 = ldg_u16(ACT ? shi : slo + 32), r0, r1;
  if (a.mode == GEMV_DENSE) pdl_wait();
  const int nch = a.nch;
  int c = 0;
#pragma unroll 1
  for (; c + 2 <= nch; c += 2) {
    chunk(qa, qb, s0, s1, ra, rbq, r0, r1, true);
    chunk(ra, rbq, r0, r1, qa, qb, s0, s1, c + 2 < nch);
  }
  if (c < nch) chunk(qa, qb, s0, s1, ra, rbq, r0, r1, false);
  pdl_launch_dependents();

  // accumulator i of n-tile j: row r_lo (i < 2) or r_hi, token 8j + 2t + (i & 1)
  float v[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) v[j][i] = acc[j][0][i] + acc[j][1][i];
  if (a.split > 1) {
    const int rows = a.row_blocks * 16;
    float* ws = a.ws + size_t(z) * a.split * rows * BT;
    int* cnt = a.cnt + size_t(z) * a.row_blocks + rb;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        ws[(size_t(blockIdx.y) * rows + rb * 16 + g + 8 * (i >> 1)) * BT + 8 * j + 2 * t + (i & 1)] = v[j][i];
    __syncwarp();
    int last = 0;
    if (lane == 0) {
      int old;
      asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(cnt) : "memory");
      last = old == a.split - 1;
    }
    last = __shfl_sync(0xffffffffu, last, 0);
    if (!last) return;
    __syncwarp();
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const size_t at = size_t(rb * 16 + g + 8 * (i >> 1)) * BT + 8 * j + 2 * t + (i & 1);
        // in split order, four partials' loads issued together (a loop of single loads to a runtime bound
        // waits for each in turn: an L2 round trip a split)
        float sum = 0.f;
        for (int p0 = 0; p0 < a.split; p0 += 4) {
          float part[4];
#pragma unroll
          for (int q = 0; q < 4; ++q)
            part[q] = p0 + q < a.split ? __ldcg(ws + size_t(p0 + q) * rows * BT + at) : 0.f;
#pragma unroll
          for (int q = 0; q < 4; ++q) sum += part[q];
        }
        v[j][i] = sum;
      }
    if (lane == 0) *cnt = 0;  // the next launch reads it only after this one completes
  }
  T* yp = static_cast<T*>(a.y);
  // the y row of token column n and the token count, formed again here (not registers held over the loop)
  const int* grp = static_cast<const int*>(a.ids) + size_t(z) * (BT + 1);
  M = a.M;
  if (a.mode == GEMV_PICKS) M = 1;
  if (a.mode == GEMV_GROUPS) {
    M = 0;
#pragma unroll
    for (int n = 0; n < BT; ++n) M += grp[1 + n] >= 0;
  }
  auto yrow = [&](int n) { return a.mode == GEMV_DENSE ? n : a.mode == GEMV_PICKS ? z : grp[1 + n]; };
  const float out = 128.f;  // the decoder's weights are e2m1 * s * 2^-7
  if (ACT) {
    const float fg = gs[a.per_col_gs ? r_lo : 0] * out, fu = gs[a.per_col_gs ? r_hi : 0] * out;
    const int col = 8 * rb + g;
    if (col >= a.half_n) return;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int n = 8 * j + 2 * t + e;
        if (n >= M) continue;
        const float gv = to_float(from_float<T>(v[j][e] * fg));
        float uv = to_float(from_float<T>(v[j][2 + e] * fu));
        const float sig = 1.f / (1.f + __expf(-gv));
        float h;
        if (a.act == 1) {
          h = gv * sig * uv;
        } else {
          if (a.act == 3) uv = a.lbeta * tanh_g(uv * a.rlbeta);
          h = a.beta * tanh_g(gv * a.rbeta) * sig * uv;
        }
        yp[size_t(yrow(n)) * a.ldy + col] = from_float<T>(h);
      }
    return;
  }
  const T* bp = static_cast<const T*>(a.bias);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = h ? r_hi : r_lo;
    if (r >= a.N) continue;
    const float f = gs[a.per_col_gs ? r : 0] * out;
    const float b0 = bp ? to_float(bp[r]) : 0.f;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int n = 8 * j + 2 * t + e;
        if (n < M) yp[size_t(yrow(n)) * a.ldy + r] = from_float<T>(v[j][2 * h + e] * f + b0);
      }
  }
}

}  // namespace k3w

#ifndef K3W_STANDALONE
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <mutex>
#include <unordered_map>

namespace k3w {

// The tensor producer's maps: the tiled128 codes as uint32 [row_blocks][CH][256] (a 16-row block's 128-wide
// chunk is 1 KB, blocks of a row block consecutive) and the scales as [row_blocks][CH][32]; a box is one chunk
// of a CTA's `box_rows` row blocks, rows past the last block zero-filled.
using TensorMapEncode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                     const cuuint64_t*, const cuuint32_t*, const cuuint32_t*,
                                     CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                     CUtensorMapFloatOOBfill);
static TensorMapEncode tensor_map_encoder() {
  static const TensorMapEncode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
#if CUDART_VERSION >= 12050
    C10_CUDA_CHECK(
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
#else  // toolkits 12.0-12.4 have only the unversioned query
    C10_CUDA_CHECK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found));
#endif
    TORCH_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr,
                "w4a16_gemm: the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<TensorMapEncode>(fn);
  }();
  return encode;
}

static CUtensorMap encode_tensor_map(void* base, int row_blocks, int CH, int words, int box_rows) {
  const TensorMapEncode encode = tensor_map_encoder();
  CUtensorMap map;
  const cuuint64_t dims[3] = {cuuint64_t(words), cuuint64_t(CH), cuuint64_t(row_blocks)};
  const cuuint64_t strides[2] = {cuuint64_t(words) * 4, cuuint64_t(words) * 4 * CH};
  const cuuint32_t box[3] = {cuuint32_t(words), 1, cuuint32_t(box_rows)};
  const cuuint32_t unit[3] = {1, 1, 1};
  const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT32, 3, base, dims, strides, box, unit,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "w4a16_gemm: cuTensorMapEncodeTiled failed (CUresult ", int(r), ")");
  return map;
}

// The maps by (base, row blocks, chunks, words, box rows): a map holds only the address, the shape and the
// box, so one encoded once serves every later launch on the same weight (the encode is host work each eager
// call otherwise).
static CUtensorMap tensor_map(void* base, int row_blocks, int CH, int words, int box_rows) {
  struct Key {
    uintptr_t base;
    int row_blocks, CH, words, box_rows;
    bool operator==(const Key& o) const {
      return base == o.base && row_blocks == o.row_blocks && CH == o.CH && words == o.words &&
             box_rows == o.box_rows;
    }
  };
  struct Hash {
    size_t operator()(const Key& k) const {
      return std::hash<uintptr_t>()(k.base) ^ (size_t(k.row_blocks) << 1) ^ (size_t(k.CH) << 21) ^
             (size_t(k.words) << 41) ^ (size_t(k.box_rows) << 53);
    }
  };
  static std::mutex lock;
  static std::unordered_map<Key, CUtensorMap, Hash> maps;
  const Key key{reinterpret_cast<uintptr_t>(base), row_blocks, CH, words, box_rows};
  std::lock_guard<std::mutex> guard(lock);
  auto it = maps.find(key);
  if (it != maps.end()) return it->second;
  if (maps.size() >= 4096) maps.clear();  // bounded: weights come and go
  return maps.emplace(key, encode_tensor_map(base, row_blocks, CH, words, box_rows)).first->second;
}

// The x gather's map: x [M, K] as 16-bit elements (rows x.stride(0) apart), a box of 64 columns x BT rows in
// the 128-byte swizzle, zero past M and K. Encoded each launch (host work only; x moves between calls).
static CUtensorMap x_tensor_map(const torch::Tensor& x, int BT) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {cuuint64_t(x.size(1)), cuuint64_t(x.size(0))};
  const cuuint64_t strides[1] = {cuuint64_t(x.stride(0)) * 2};
  const cuuint32_t box[2] = {64, cuuint32_t(BT)};
  const cuuint32_t unit[2] = {1, 1};
  const CUresult r = tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, x.data_ptr(), dims, strides,
                                          box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "w4a16_gemm: cuTensorMapEncodeTiled failed for x (CUresult ", int(r), ")");
  return map;
}

// A launch on `stream`, with programmatic stream serialization (PDL) when `pdl`: the kernel may be scheduled
// before the previous kernel on the stream completes (its griddepcontrol.wait orders what depends on it).
template <typename... P, typename... A>
static void launch_kernel(void (*kern)(P...), dim3 grid, int threads, int smem, cudaStream_t stream, bool pdl,
                          A&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, std::forward<A>(args)...));
}

template <int BT, int NWG, bool BF16, bool SK>
static void launch(const torch::Tensor& xt, const torch::Tensor& w, const torch::Tensor& s,
                   const torch::Tensor& gs, const c10::optional<torch::Tensor>& bias, torch::Tensor& y,
                   const torch::Tensor& ws, const torch::Tensor& cnt, int M, int N, int CH, int split,
                   int stages, int t_tiles, int producer, int sk, int sk_whole, bool gather, bool pdl,
                   cudaStream_t stream) {
  auto kern = w4a16_kernel<BT, NWG, BF16, SK>;
  const int smem = Smem<BT, NWG>::bytes(stages);
  static int configured = 0;
  if (configured < smem) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    configured = smem;
  }
  const int n_tiles = (N + NWG * 64 - 1) / (NWG * 64);
  const dim3 grid = sk > 0 ? dim3(sk, 1) : dim3(n_tiles * t_tiles, split);
  const bool partials = sk > 1 || split > 1;  // one stream-K CTA owns every tile whole
  CUtensorMap tm_w{}, tm_s{}, tm_x{};
  if (gather) tm_x = x_tensor_map(xt, BT);
  if (producer == PRODUCER_TENSOR) {  // a box is the CTA's NWG * 4 row blocks of one chunk
    tm_w = tensor_map(w.data_ptr(), int(w.size(0) / 16), CH, 256, NWG * 4);
    tm_s = tensor_map(s.data_ptr(), int(w.size(0) / 16), CH, 32, NWG * 4);
  }
  const uint8_t* xtp = static_cast<const uint8_t*>(xt.data_ptr());
  const void* bp = bias.has_value() ? bias->data_ptr() : nullptr;
  float* wsp = partials ? ws.data_ptr<float>() : nullptr;
  int* cntp = partials ? cnt.data_ptr<int>() : nullptr;
  const int tiles = n_tiles * t_tiles;
  // stream-K's even split, or the tail split: sk_whole CTAs of whole tiles, then the other tiles s CTAs each
  int sk_q = sk > 0 ? tiles * (CH / 2) / sk : 0, sk_r = sk > 0 ? tiles * (CH / 2) % sk : 0, sk_x = 1;
  if (sk_whole > 0) {
    const int s = (sk - sk_whole) / (tiles - sk_whole);
    sk_q = CH / 2 / s;
    sk_r = sk_whole;
    sk_x = CH / 2 - sk_q;
  }
  launch_kernel(kern, grid, cta_threads<NWG>(), smem, stream, pdl, xtp, w.data_ptr<uint8_t>(),
                s.data_ptr<uint8_t>(), gs.data_ptr<float>(), int(gs.numel() != 1), bp, y.data_ptr(),
                int(y.stride(0)), wsp, cntp, M, N, int(w.size(0) / 16), CH, sk > 0 ? CH : CH / split, stages, tiles,
                producer, sk, sk_q, sk_r, sk_x, int(gather), tm_w, tm_s, tm_x);
}

}  // namespace k3w

int w4a16_smem_bytes(int64_t bt, int64_t nwg, int64_t stages) {
#define K3W_SMEM(B, G) \
  if (bt == B && nwg == G) return k3w::Smem<B, G>::bytes(int(stages));
  K3W_SMEM(16, 1) K3W_SMEM(32, 1) K3W_SMEM(64, 1) K3W_SMEM(128, 1) K3W_SMEM(256, 1)
  K3W_SMEM(16, 2) K3W_SMEM(32, 2) K3W_SMEM(64, 2) K3W_SMEM(128, 2) K3W_SMEM(128, 3)
#undef K3W_SMEM
  return -1;
}

torch::Tensor w4a16_prep_x(torch::Tensor x, int64_t bt, int64_t chunks, bool pdl) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "w4a16_prep_x: x must be 2-D with unit stride along K");
  TORCH_CHECK(x.stride(0) % 2 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0,
              "w4a16_prep_x: x rows must be 4-byte aligned");
  const int M = x.size(0), K = x.size(1);
  const int t_tiles = (M + bt - 1) / bt;
  auto xt = torch::empty({t_tiles, chunks, 2, bt, 64}, x.options());
  const int units = t_tiles * chunks * 2 * bt * 8;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int threads = 256;
  const dim3 grid((units + threads - 1) / threads);
  if (x.scalar_type() == at::kBFloat16)
    k3w::launch_kernel(k3w::prep_x_kernel<__nv_bfloat16>, grid, threads, 0, stream, pdl,
                       reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), int(x.stride(0)), M, K, int(bt),
                       int(chunks), reinterpret_cast<__nv_bfloat16*>(xt.data_ptr()), units);
  else
    k3w::launch_kernel(k3w::prep_x_kernel<__half>, grid, threads, 0, stream, pdl,
                       reinterpret_cast<const __half*>(x.data_ptr()), int(x.stride(0)), M, K, int(bt),
                       int(chunks), reinterpret_cast<__half*>(xt.data_ptr()), units);
  return xt;
}

void w4a16_gemm(torch::Tensor xt, torch::Tensor w, torch::Tensor s, torch::Tensor gs,
                c10::optional<torch::Tensor> bias, torch::Tensor y, torch::Tensor ws, torch::Tensor cnt,
                int64_t M, int64_t N, int64_t bt, int64_t nwg, int64_t split, int64_t stages, int64_t producer,
                bool gather, int64_t sk_whole, int64_t sk, bool pdl) {
  // xt: prep_x's tiles [t_tiles][CH][2][BT][64], or with `gather` x [M, K] itself (the kernel reads it)
  const int CH = gather ? int(w.size(1) / 64) : int(xt.size(1));
  const int t_tiles = gather ? int((M + bt - 1) / bt) : int(xt.size(0));
  if (gather)
    TORCH_CHECK(sk == 0 && nwg == 1 && bt <= 32 && producer != k3w::PRODUCER_THREAD && xt.dim() == 2 &&
                    xt.stride(1) == 1 && xt.stride(0) % 8 == 0 && xt.size(1) % 8 == 0 && xt.size(0) == M &&
                    xt.size(1) <= int64_t(CH) * 128 && reinterpret_cast<uintptr_t>(xt.data_ptr()) % 16 == 0,
                "w4a16_gemm: the x gather takes the fixed grid, one consumer warpgroup, BT <= 32, the warp or "
                "tensor producer, and x [M, K <= chunks * 128] with 16-byte aligned rows and K % 8 == 0");
  TORCH_CHECK(sk > 0 || (split >= 1 && CH % split == 0), "w4a16_gemm: split_k ", split,
              " must divide the ", CH, " chunks");
  TORCH_CHECK(sk == 0 || (CH % 2 == 0 && sk <= int64_t((N + nwg * 64 - 1) / (nwg * 64)) * t_tiles * CH / 2),
              "w4a16_gemm: stream-K over ", sk, " CTAs needs an even chunk count (", CH,
              ") and at least one chunk pair a CTA");
  if (sk_whole > 0) {  // the tail split: the tiles past the first sk_whole in s pieces of CH / 2 / s pairs each
    const int64_t tiles = int64_t((N + nwg * 64 - 1) / (nwg * 64)) * t_tiles, rest = tiles - sk_whole;
    const int64_t s = rest > 0 ? (sk - sk_whole) / rest : 0;
    TORCH_CHECK(rest > 0 && s >= 2 && sk == sk_whole + rest * s && (CH / 2) % s == 0,
                "w4a16_gemm: the tail split of ", tiles, " tiles (", CH, " chunks) over ", sk, " CTAs with ",
                sk_whole, " whole-tile CTAs needs the other tiles in s >= 2 pieces each, s dividing the pairs");
  }
  TORCH_CHECK(producer >= k3w::PRODUCER_THREAD && producer <= k3w::PRODUCER_TENSOR,
              "w4a16_gemm: producer form ", producer, " is not 0 (thread), 1 (warp) or 2 (tensor)");
  // every bulk and tensor copy reads 16-byte aligned sources
  TORCH_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(s.data_ptr()) % 16 == 0,
              "w4a16_gemm: the codes and scales must start 16-byte aligned");
  const bool bf16 = y.scalar_type() == at::kBFloat16;
  auto stream = c10::cuda::getCurrentCUDAStream();
#define K3W_RUN(B, G, K)                                                                                       \
  if (bf16)                                                                                                    \
    k3w::launch<B, G, true, K>(xt, w, s, gs, bias, y, ws, cnt, M, N, CH, split, stages, t_tiles,               \
                               int(producer), sk, sk_whole, gather, pdl, stream);                            \
  else                                                                                                         \
    k3w::launch<B, G, false, K>(xt, w, s, gs, bias, y, ws, cnt, M, N, CH, split, stages, t_tiles,              \
                                int(producer), sk, sk_whole, gather, pdl, stream);                           \
  return;
#define K3W_CASE(B, G)                                                                                         \
  if (bt == B && nwg == G && sk == 0) {                                                                        \
    K3W_RUN(B, G, false)                                                                                       \
  }
#define K3W_SK_CASE(B, G)                                                                                      \
  if (bt == B && nwg == G && sk > 0) {                                                                         \
    K3W_RUN(B, G, true)                                                                                        \
  }
  K3W_CASE(16, 1) K3W_CASE(32, 1) K3W_CASE(64, 1) K3W_CASE(128, 1) K3W_CASE(256, 1)
  K3W_CASE(16, 2) K3W_CASE(32, 2) K3W_CASE(64, 2) K3W_CASE(128, 2) K3W_CASE(128, 3)
  K3W_SK_CASE(16, 1) K3W_SK_CASE(32, 1) K3W_SK_CASE(64, 1) K3W_SK_CASE(128, 1) K3W_SK_CASE(256, 1)
  K3W_SK_CASE(128, 2)
#undef K3W_SK_CASE
#undef K3W_CASE
#undef K3W_RUN
  TORCH_CHECK(false, "w4a16_gemm: no kernel for BT ", bt, " and ", nwg, " consumer warpgroups",
              sk > 0 ? " with stream-K (one warpgroup, or two at BT 128)" : "");
}
void w4a16_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor s, torch::Tensor gs,
                c10::optional<torch::Tensor> bias, torch::Tensor y, torch::Tensor ws, torch::Tensor cnt,
                int64_t split, bool pdl, int64_t mode, c10::optional<torch::Tensor> ids, int64_t items,
                int64_t bt, int64_t slot_div, int64_t rows, int64_t act, double beta, double lbeta) {
  // x [T, K] (K = the chunks * 128 exactly, 16-byte aligned rows); w, s: tiled128 as uint8, [N_pad, K_pad / 2]
  // or E experts [E, N_pad, K_pad / 2] (the modes with ids); rows: the weight rows computed (2I with act)
  const bool experts = mode != k3w::GEMV_DENSE;
  const int K = int(x.size(1));
  const int n_pad = int(w.size(w.dim() - 2)), CH = int(w.size(w.dim() - 1) / 64);
  TORCH_CHECK(mode >= k3w::GEMV_DENSE && mode <= k3w::GEMV_GROUPS && w.dim() == (experts ? 3 : 2),
              "w4a16_gemv: mode ", mode, " with a ", w.dim(), "-D weight");
  TORCH_CHECK(bt == 8 || bt == 16, "w4a16_gemv: token tile ", bt, " (expected 8 or 16)");
  TORCH_CHECK(rows >= 1 && rows <= n_pad && (act == 0 || (rows % 16 == 0 && act <= 3)),
              "w4a16_gemv: ", rows, " rows of ", n_pad, (act ? " (with the activation: 2I, a multiple of 16)" : ""));
  TORCH_CHECK(K == CH * 128 && x.stride(1) == 1 && x.stride(0) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              "w4a16_gemv: x must be [T, ", CH * 128, "] (the weight's K, a multiple of 128) with 16-byte "
              "aligned rows, got ", x.sizes(), " stride ", x.strides());
  TORCH_CHECK(split >= 1 && CH % split == 0, "w4a16_gemv: split_k ", split, " must divide the ", CH, " chunks");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(s.data_ptr()) % 16 == 0,
              "w4a16_gemv: the codes and scales must start 16-byte aligned");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "w4a16_gemv: x and y must have one dtype");
  const int row_blocks = act ? int(rows / 16) : (int(rows) + 15) / 16;
  TORCH_CHECK(split == 1 || (ws.numel() >= items * split * row_blocks * 16 * bt && cnt.numel() >= items * row_blocks),
              "w4a16_gemv: split-K needs ", items * split * row_blocks * 16 * bt, " partials and ",
              items * row_blocks, " counters");
  k3w::GemvArgs a{};
  a.w = reinterpret_cast<const uint4*>(w.data_ptr());
  a.s = reinterpret_cast<const uint16_t*>(s.data_ptr());
  a.x = reinterpret_cast<const uint4*>(x.data_ptr());
  a.gs = gs.data_ptr<float>();
  a.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  a.y = y.data_ptr();
  a.ws = split > 1 ? ws.data_ptr<float>() : nullptr;
  a.cnt = split > 1 ? cnt.data_ptr<int>() : nullptr;
  a.ids = ids.has_value() ? ids->data_ptr() : nullptr;
  a.ids64 = ids.has_value() && ids->scalar_type() == at::kLong;
  a.w_estride = experts ? w.stride(0) / 16 : 0;
  a.s_estride = experts ? s.stride(0) / 2 : 0;
  a.gs_estride = experts ? int(gs.size(1)) : 0;
  a.per_col_gs = experts ? int(gs.size(1) != 1) : int(gs.numel() != 1);
  a.n_experts = experts ? int(w.size(0)) : 0;
  a.ldx16 = int(x.stride(0) / 8);
  a.ldy = int(y.stride(0));
  a.M = experts ? int(bt) : int(x.size(0));
  a.N = int(rows);
  a.row_blocks = row_blocks;
  a.CH = CH;
  a.nch = CH / int(split);
  a.split = int(split);
  a.mode = int(mode);
  a.slot_div = int(slot_div);
  a.act = int(act);
  a.half_n = int(rows / 2);
  a.beta = float(beta);
  a.rbeta = 1.f / float(beta);
  a.lbeta = float(lbeta);
  a.rlbeta = 1.f / float(lbeta);
  TORCH_CHECK(experts || (x.size(0) >= 1 && x.size(0) <= bt && y.size(0) == x.size(0)),
              "w4a16_gemv: 1..", bt, " rows of x and y, got x ", x.sizes(), ", y ", y.sizes());
  TORCH_CHECK(!experts || (ids.has_value() && items >= 1 && slot_div >= 1),
              "w4a16_gemv: the expert modes need ids / the group table, items and slot_div");
  const bool bf16 = y.scalar_type() == at::kBFloat16;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid((row_blocks + k3w::GEMV_WARPS - 1) / k3w::GEMV_WARPS, int(split), int(experts ? items : 1));
  TORCH_CHECK(act == 0 || bt == 8, "w4a16_gemv: the activation epilogue runs the 8-token tile, not ", bt);
#define K3W_GEMV(B, F, A) \
  k3w::launch_kernel(k3w::gemv_kernel<B, F, A>, grid, 32 * k3w::GEMV_WARPS, 0, stream, pdl, a);
  if (act && bf16) K3W_GEMV(8, true, true)
  else if (act) K3W_GEMV(8, false, true)
  else if (bt == 8 && bf16) K3W_GEMV(8, true, false)
  else if (bt == 8) K3W_GEMV(8, false, false)
  else if (bf16) K3W_GEMV(16, true, false)
  else K3W_GEMV(16, false, false)
#undef K3W_GEMV
}
#endif

#ifdef K3W_STANDALONE
// Every kernel instantiated, for a compile without torch (tests/kernels/test_nvfp4_sm90.py reads its SASS).
#define K3W_INST(B, G, F, K)                                                                                  \
  template __global__ void k3w::w4a16_kernel<B, G, F, K>(const uint8_t*, const uint8_t*, const uint8_t*,     \
                                                          const float*, int, const void*, void*, int, float*, \
                                                          int*, int, int, int, int, int, int, int, int, int, int, \
                                                          int, int, int, \
                                                          const __grid_constant__ CUtensorMap, \
                                                          const __grid_constant__ CUtensorMap, \
                                                          const __grid_constant__ CUtensorMap);
K3W_INST(16, 1, true, false) K3W_INST(32, 1, true, false) K3W_INST(64, 1, true, false)
K3W_INST(128, 1, true, false) K3W_INST(256, 1, true, false)
K3W_INST(16, 2, true, false) K3W_INST(32, 2, true, false) K3W_INST(64, 2, true, false)
K3W_INST(128, 2, true, false) K3W_INST(64, 2, false, false) K3W_INST(128, 2, false, false)
K3W_INST(128, 3, true, false)
K3W_INST(16, 1, true, true) K3W_INST(32, 1, true, true) K3W_INST(64, 1, true, true)
K3W_INST(128, 1, true, true) K3W_INST(256, 1, true, true) K3W_INST(128, 2, true, true)
template __global__ void k3w::prep_x_kernel<__nv_bfloat16>(const __nv_bfloat16*, int, int, int, int, int,
                                                            __nv_bfloat16*, int);
template __global__ void k3w::gemv_kernel<8, true, false>(const __grid_constant__ k3w::GemvArgs);
template __global__ void k3w::gemv_kernel<16, true, false>(const __grid_constant__ k3w::GemvArgs);
template __global__ void k3w::gemv_kernel<8, true, true>(const __grid_constant__ k3w::GemvArgs);
#undef K3W_INST
#endif
