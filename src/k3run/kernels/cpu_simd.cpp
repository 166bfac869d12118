// k3run's CPU kernels: kernels/cpu_simd.py builds this file with torch's load_inline at first use (it names the
// functions exported to Python) and documents each one where it is called.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

// one source, two instruction sets: each kernel function carries its target, the wrappers pick one per call
#define K3_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))
#define K3_AVX2 __attribute__((target("avx2,fma,f16c")))

static inline K3_AVX2 float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// R consecutive rows n .. n + R - 1 of y [M, N] fp32 = x [M, K] @ W^T (M, R compile-time): each 16-byte chunk
// of the R weight rows is decoded once, each x load serves the R rows (x sits in L2 at several token rows),
// and R rows stream at once (more memory requests in flight: 1.8-2.3x at one token, bench/RESULTS.md).
// x_even / x_odd fp32 [M, K/2] (x's even and odd columns), w uint8
// [N, K/2] (low nibble = even column), s uint8 [N, K/16] (E4M3 bytes), gs fp32 [N], st fp32 [256] (E4M3).
template <int M, int R>
static K3_AVX512 void nvfp4_rows(int64_t n, int64_t H, int64_t N, const float* xe, const float* xo,
                                 const uint8_t* wp, const uint8_t* sp, const float* gp, const float* st,
                                 float* yp) {
  const __m512 table = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                      -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f);
  const __m512i low4 = _mm512_set1_epi32(15);
  const int64_t G = H / 8;
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= H; j += 16) {  // 32 weights per row: scale groups j / 8 and j / 8 + 1
    __m512 wl[R], wh[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* row = wp + (n + r) * H;
      const uint8_t* srow = sp + (n + r) * G;
      __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + j)));
      __m512 sc = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(st[srow[j >> 3]]),
                                       _mm512_set1_ps(st[srow[(j >> 3) + 1]]));
      wl[r] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(b, low4), table), sc);
      wh[r] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table), sc);
    }
    for (int m = 0; m < M; ++m) {
      __m512 a = _mm512_loadu_ps(xe + m * H + j), c = _mm512_loadu_ps(xo + m * H + j);
      for (int r = 0; r < R; ++r) {
        acc[r][m] = _mm512_fmadd_ps(wl[r], a, acc[r][m]);
        acc[r][m] = _mm512_fmadd_ps(wh[r], c, acc[r][m]);
      }
    }
  }
  if (j < H) {  // the last 8 bytes (one scale group)
    const __mmask16 k8 = 0x00FF;
    __m512 wl[R], wh[R];
    for (int r = 0; r < R; ++r) {
      __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(0x00FF, wp + (n + r) * H + j));
      __m512 sc = _mm512_set1_ps(st[sp[(n + r) * G + (j >> 3)]]);
      wl[r] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(b, low4), table), sc);
      wh[r] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table), sc);
    }
    for (int m = 0; m < M; ++m) {
      __m512 a = _mm512_maskz_loadu_ps(k8, xe + m * H + j), c = _mm512_maskz_loadu_ps(k8, xo + m * H + j);
      for (int r = 0; r < R; ++r) {
        acc[r][m] = _mm512_fmadd_ps(wl[r], a, acc[r][m]);
        acc[r][m] = _mm512_fmadd_ps(wh[r], c, acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) yp[m * N + n + r] = _mm512_reduce_add_ps(acc[r][m]) * gp[n + r];
}

// rows [n0, n1): blocks of R rows (R * M <= 16 accumulators), then the rest one by one
template <int M>
static K3_AVX512 void nvfp4_range(int64_t n0, int64_t n1, int64_t H, int64_t N, const float* xe,
                                  const float* xo, const uint8_t* wp, const uint8_t* sp, const float* gp,
                                  const float* st, float* yp) {
  constexpr int R = M <= 2 ? 8 : (M <= 4 ? 4 : 2);
  int64_t n = n0;
  for (; n + R <= n1; n += R) nvfp4_rows<M, R>(n, H, N, xe, xo, wp, sp, gp, st, yp);
  for (; n < n1; ++n) nvfp4_rows<M, 1>(n, H, N, xe, xo, wp, sp, gp, st, yp);
}

// AVX2: 8 bytes (16 weights, one scale group) per step. vpermps on 8 lanes reads the low 3 bits of each
// code (the magnitude); the sign (bit 3 of the low nibble, bit 7 of the byte for the high one) is shifted
// to bit 31 and XORed in. R * M <= 8 accumulators of the 16 ymm registers.
template <int M, int R>
static K3_AVX2 void nvfp4_rows2(int64_t n, int64_t H, int64_t N, const float* xe, const float* xo,
                                const uint8_t* wp, const uint8_t* sp, const float* gp, const float* st,
                                float* yp) {
  const __m256 table = _mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const int64_t G = H / 8;
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t j = 0; j < H; j += 8) {
    __m256 a[M], c[M];  // x first, then one weight row at a time: fewer live registers
    for (int m = 0; m < M; ++m) {
      a[m] = _mm256_loadu_ps(xe + m * H + j);
      c[m] = _mm256_loadu_ps(xo + m * H + j);
    }
    for (int r = 0; r < R; ++r) {
      const __m128i* src = reinterpret_cast<const __m128i*>(wp + (n + r) * H + j);
      __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(src));
      __m256 sc = _mm256_set1_ps(st[sp[(n + r) * G + (j >> 3)]]);
      __m256 sl = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 28), sign));
      __m256 sh = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 24), sign));
      __m256 wl = _mm256_mul_ps(_mm256_xor_ps(_mm256_permutevar8x32_ps(table, b), sl), sc);
      __m256 mh = _mm256_permutevar8x32_ps(table, _mm256_srli_epi32(b, 4));
      __m256 wh = _mm256_mul_ps(_mm256_xor_ps(mh, sh), sc);
      for (int m = 0; m < M; ++m) {
        acc[r][m] = _mm256_fmadd_ps(wl, a[m], acc[r][m]);
        acc[r][m] = _mm256_fmadd_ps(wh, c[m], acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) yp[m * N + n + r] = hsum256(acc[r][m]) * gp[n + r];
}

template <int M>
static K3_AVX2 void nvfp4_range2(int64_t n0, int64_t n1, int64_t H, int64_t N, const float* xe,
                                 const float* xo, const uint8_t* wp, const uint8_t* sp, const float* gp,
                                 const float* st, float* yp) {
  constexpr int R = M == 1 ? 4 : (M == 2 ? 2 : 1);
  int64_t n = n0;
  for (; n + R <= n1; n += R) nvfp4_rows2<M, R>(n, H, N, xe, xo, wp, sp, gp, st, yp);
  for (; n < n1; ++n) nvfp4_rows2<M, 1>(n, H, N, xe, xo, wp, sp, gp, st, yp);
}

torch::Tensor nvfp4_gemv(torch::Tensor x_even, torch::Tensor x_odd, torch::Tensor w, torch::Tensor s,
                         torch::Tensor gs, torch::Tensor s_table, bool avx2) {
  const int64_t M = x_even.size(0), H = x_even.size(1), N = w.size(0);  // H = K / 2 bytes per row
  TORCH_CHECK(M >= 1 && M <= (avx2 ? 4 : 8), "nvfp4_gemv: 1..", avx2 ? 4 : 8, " rows, got ", M);
  TORCH_CHECK(H % 8 == 0, "nvfp4_gemv: K must be a multiple of 16");
  auto y = torch::empty({M, N}, x_even.options());
  const float* xe = x_even.data_ptr<float>();
  const float* xo = x_odd.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint8_t* sp = s.data_ptr<uint8_t>();
  const float* gp = gs.data_ptr<float>();
  const float* st = s_table.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  using Fn = void (*)(int64_t, int64_t, int64_t, int64_t, const float*, const float*, const uint8_t*,
                      const uint8_t*, const float*, const float*, float*);
  static const Fn fns[8] = {nvfp4_range<1>, nvfp4_range<2>, nvfp4_range<3>, nvfp4_range<4>,
                            nvfp4_range<5>, nvfp4_range<6>, nvfp4_range<7>, nvfp4_range<8>};
  static const Fn fns2[4] = {nvfp4_range2<1>, nvfp4_range2<2>, nvfp4_range2<3>, nvfp4_range2<4>};
  const Fn fn = avx2 ? fns2[M - 1] : fns[M - 1];
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { fn(n0, n1, H, N, xe, xo, wp, sp, gp, st, yp); });
  return y;
}

// The weight's codes times their block scales [N, K] as bf16, exactly (<= 6 significant bits, so the upper 16
// bits of the fp32 value), with each 32-column chunk stored as its 16 even columns then its 16 odd ones: the
// caller permutes x's columns the same way (`nvfp4_x_perm`). Needs K % 32 == 0.
static K3_AVX512 void dequant_rows(int64_t n0, int64_t n1, int64_t H, const uint8_t* wp, const uint8_t* sp,
                                   const float* st, uint16_t* op) {
  const int64_t G = H / 8;
  const __m512 table = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                      -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f);
  const __m512i low4 = _mm512_set1_epi32(15);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = wp + n * H;
    const uint8_t* srow = sp + n * G;
    uint16_t* orow = op + n * 2 * H;
    for (int64_t j = 0; j < H; j += 16) {
      __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + j)));
      __m512 sc = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(st[srow[j >> 3]]),
                                       _mm512_set1_ps(st[srow[(j >> 3) + 1]]));
      __m512 wl = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(b, low4), table), sc);
      __m512 wh = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table), sc);
      __m256i bl = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(wl), 16));
      __m256i bh = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(wh), 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + 2 * j), bl);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + 2 * j + 16), bh);
    }
  }
}

// AVX2: 8 bytes at a time; a 32-column chunk's even columns are its two 8-byte halves' low nibbles
static K3_AVX2 void dequant_rows2(int64_t n0, int64_t n1, int64_t H, const uint8_t* wp, const uint8_t* sp,
                                  const float* st, uint16_t* op) {
  const int64_t G = H / 8;
  const __m256 table = _mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = wp + n * H;
    const uint8_t* srow = sp + n * G;
    uint16_t* orow = op + n * 2 * H;
    for (int64_t j = 0; j < H; j += 16) {
      __m256i lo[2], hi[2];
      for (int h = 0; h < 2; ++h) {
        __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + j + 8 * h)));
        __m256 sc = _mm256_set1_ps(st[srow[(j >> 3) + h]]);
        __m256 sl = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 28), sign));
        __m256 sh = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 24), sign));
        __m256 wl = _mm256_mul_ps(_mm256_xor_ps(_mm256_permutevar8x32_ps(table, b), sl), sc);
        __m256 mh = _mm256_permutevar8x32_ps(table, _mm256_srli_epi32(b, 4));
        __m256 wh = _mm256_mul_ps(_mm256_xor_ps(mh, sh), sc);
        lo[h] = _mm256_srli_epi32(_mm256_castps_si256(wl), 16);
        hi[h] = _mm256_srli_epi32(_mm256_castps_si256(wh), 16);
      }
      // packus interleaves 128-bit lanes: [a0..3 b0..3 a4..7 b4..7] -> permute to [a0..7 b0..7]
      __m256i bl = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo[0], lo[1]), 0xD8);
      __m256i bh = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi[0], hi[1]), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + 2 * j), bl);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + 2 * j + 16), bh);
    }
  }
}

torch::Tensor nvfp4_dequant_bf16_perm(torch::Tensor w, torch::Tensor s, torch::Tensor s_table, bool avx2) {
  const int64_t N = w.size(0), H = w.size(1);
  TORCH_CHECK(H % 16 == 0, "nvfp4_dequant_bf16_perm: K must be a multiple of 32");
  auto out = torch::empty({N, 2 * H}, w.options().dtype(torch::kBFloat16));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint8_t* sp = s.data_ptr<uint8_t>();
  const float* st = s_table.data_ptr<float>();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const auto fn = avx2 ? dequant_rows2 : dequant_rows;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { fn(n0, n1, H, wp, sp, st, op); });
  return out;
}

// FP8_PB_WO: y [M, N] fp32 = sum_kb sx[m, kb] * sw[n / 128, kb] * sum_j qx[m, 128 kb + j] * w[n, 128 kb + j]
// qx fp32 [M, K] (the activation codes' values), sx fp32 [M, K/128], w uint8 [N, K] (E4M3 bytes), sw fp32
// [>= ceil(N/128), K/128]. E4M3 -> fp32 exactly through fp16: the sign moved to bit 15 and the exponent and
// mantissa bits to bits 13..7 make the fp16 of value * 2^-8 (subnormal codes as fp16 subnormals, which the
// conversion to fp32 keeps exactly); the 2^8 rides in the block's scale product (a power of two: exact).
template <int M, int R>
static K3_AVX512 void fp8_rows(int64_t n, int64_t K, int64_t N, const float* xp, const float* sxp,
                               const uint8_t* wp, const float* swp, float* yp) {
  const int64_t KB = K / 128;
  const __m256i m7f = _mm256_set1_epi16(0x7F), m80 = _mm256_set1_epi16(0x80);
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < KB; ++kb) {
    __m512 blk[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) blk[r][m] = _mm512_setzero_ps();
    for (int64_t j = kb * 128; j < kb * 128 + 128; j += 16) {
      __m512 v[R];
      for (int r = 0; r < R; ++r) {
        const __m128i* src = reinterpret_cast<const __m128i*>(wp + (n + r) * K + j);
        __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(src));
        __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, m7f), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(b, m80), 8));
        v[r] = _mm512_cvtph_ps(h);
      }
      for (int m = 0; m < M; ++m) {
        __m512 a = _mm512_loadu_ps(xp + m * K + j);
        for (int r = 0; r < R; ++r) blk[r][m] = _mm512_fmadd_ps(v[r], a, blk[r][m]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m)
        acc[r][m] = _mm512_fmadd_ps(
            blk[r][m], _mm512_set1_ps(sxp[m * KB + kb] * swp[((n + r) / 128) * KB + kb] * 256.f), acc[r][m]);
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) yp[m * N + n + r] = _mm512_reduce_add_ps(acc[r][m]);
}

template <int M>
static K3_AVX512 void fp8_range(int64_t n0, int64_t n1, int64_t K, int64_t N, const float* xp,
                                const float* sxp, const uint8_t* wp, const float* swp, float* yp) {
  constexpr int R = M == 1 ? 8 : (M == 2 ? 4 : (M <= 4 ? 2 : 1));  // 2 * R * M <= 16 accumulators
  int64_t n = n0;
  for (; n + R <= n1; n += R) fp8_rows<M, R>(n, K, N, xp, sxp, wp, swp, yp);
  for (; n < n1; ++n) fp8_rows<M, 1>(n, K, N, xp, sxp, wp, swp, yp);
}

// AVX2: the same per-block sums with 16 bytes decoded into two 8-lane halves (F16C conversions)
template <int M, int R>
static K3_AVX2 void fp8_rows2(int64_t n, int64_t K, int64_t N, const float* xp, const float* sxp,
                              const uint8_t* wp, const float* swp, float* yp) {
  const int64_t KB = K / 128;
  const __m256i m7f = _mm256_set1_epi16(0x7F), m80 = _mm256_set1_epi16(0x80);
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t kb = 0; kb < KB; ++kb) {
    __m256 blk[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) blk[r][m] = _mm256_setzero_ps();
    for (int64_t j = kb * 128; j < kb * 128 + 128; j += 16) {
      __m256 a0[M], a1[M];  // x first, then one weight row at a time: fewer live registers
      for (int m = 0; m < M; ++m) {
        a0[m] = _mm256_loadu_ps(xp + m * K + j);
        a1[m] = _mm256_loadu_ps(xp + m * K + j + 8);
      }
      for (int r = 0; r < R; ++r) {
        const __m128i* src = reinterpret_cast<const __m128i*>(wp + (n + r) * K + j);
        __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(src));
        __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, m7f), 7),
                                    _mm256_slli_epi16(_mm256_and_si256(b, m80), 8));
        __m256 v0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        __m256 v1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
        for (int m = 0; m < M; ++m) {
          blk[r][m] = _mm256_fmadd_ps(v0, a0[m], blk[r][m]);
          blk[r][m] = _mm256_fmadd_ps(v1, a1[m], blk[r][m]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m)
        acc[r][m] = _mm256_fmadd_ps(
            blk[r][m], _mm256_set1_ps(sxp[m * KB + kb] * swp[((n + r) / 128) * KB + kb] * 256.f), acc[r][m]);
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) yp[m * N + n + r] = hsum256(acc[r][m]);
}

template <int M>
static K3_AVX2 void fp8_range2(int64_t n0, int64_t n1, int64_t K, int64_t N, const float* xp,
                               const float* sxp, const uint8_t* wp, const float* swp, float* yp) {
  constexpr int R = M == 1 ? 4 : (M == 2 ? 2 : 1);  // 2 * R * M <= 8 accumulators
  int64_t n = n0;
  for (; n + R <= n1; n += R) fp8_rows2<M, R>(n, K, N, xp, sxp, wp, swp, yp);
  for (; n < n1; ++n) fp8_rows2<M, 1>(n, K, N, xp, sxp, wp, swp, yp);
}

// FP8_PB_WO rows: blocks of R rows share each x load (see nvfp4_rows).
torch::Tensor fp8_block_gemv(torch::Tensor qx, torch::Tensor sx, torch::Tensor w, torch::Tensor sw,
                             bool avx2) {
  const int64_t M = qx.size(0), K = qx.size(1), N = w.size(0);
  TORCH_CHECK(M >= 1 && M <= (avx2 ? 4 : 8), "fp8_block_gemv: 1..", avx2 ? 4 : 8, " rows, got ", M);
  TORCH_CHECK(K % 128 == 0, "fp8_block_gemv: K must be a multiple of 128");
  auto y = torch::empty({M, N}, qx.options());
  const float* xp = qx.data_ptr<float>();
  const float* sxp = sx.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* swp = sw.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  using Fn = void (*)(int64_t, int64_t, int64_t, int64_t, const float*, const float*, const uint8_t*,
                      const float*, float*);
  static const Fn fns[8] = {fp8_range<1>, fp8_range<2>, fp8_range<3>, fp8_range<4>,
                            fp8_range<5>, fp8_range<6>, fp8_range<7>, fp8_range<8>};
  static const Fn fns2[4] = {fp8_range2<1>, fp8_range2<2>, fp8_range2<3>, fp8_range2<4>};
  const Fn fn = avx2 ? fns2[M - 1] : fns[M - 1];
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { fn(n0, n1, K, N, xp, sxp, wp, swp, yp); });
  return y;
}

// ---- NVFP4 on int8 activations (AVX-512 VNNI), the "vnni16" layout of `nvfp4_vnni_pack` ----
// Weights: 16-row blocks; per (block, scale group g of 16 columns) 128 bytes = two 64-byte chunks whose low
// nibbles hold columns 16g + 8c + 0..3 and high nibbles 16g + 8c + 4..7 (c = chunk), byte 4l + j of a chunk
// being row l, column offset j: one vpdpbusd lane per row, its 4 bytes 4 consecutive columns. A vpshufb maps
// each code to 2 * e2m1 + 12 (0..24, unsigned); the +12 is taken back by starting each group's int32 sums at
// -12 * (the group's activation code sum). Scales: the 16 rows' E4M3 bytes per group, contiguous.
// Activations: per row m and group g, q = round(x * 127 / amax) in int8 with scale amax / 127.
//   y[m, n] = gs[n] * sum_g (e4m3(s[n, g]) / 2 * a[m, g]) * sum_{k in g} (2 e2m1(w[n, k])) * q[m, k]
// The inner sums are exact integers; each group's term is one fp32 product of the two scales times an exact
// integer, accumulated in fp32: the result is the fp32 reference's applied to the dequantized activations
// q * a, in another summation order. The only new rounding is the activations' to int8 (<= a / 2 each).
#define K3_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
#define K3_VBMI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,fma,f16c")))

static inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

static K3_VNNI void quant_act16(int64_t m0, int64_t m1, int64_t K, const float* x, int8_t* q, float* as,
                                int32_t* nc) {
  const int64_t G = K / 16;
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const __m512 v = _mm512_loadu_ps(x + m * K + 16 * g);
      const float amax = _mm512_reduce_max_ps(_mm512_abs_ps(v));
      const float total = _mm512_reduce_add_ps(v);  // not finite where v holds an inf or a NaN
      __m512i qi = _mm512_setzero_si512();
      float scale = 0.f;
      if (!std::isfinite(total)) {
        scale = std::numeric_limits<float>::quiet_NaN();  // poisons this group's outputs, as the reference
      } else if (amax > 0.f) {
        scale = amax / 127.f;
        qi = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(127.f / amax)));  // nearest, ties to even
        qi = _mm512_max_epi32(_mm512_min_epi32(qi, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + m * K + 16 * g), _mm512_cvtepi32_epi8(qi));
      as[m * G + g] = scale;
      nc[m * G + g] = -12 * _mm512_reduce_add_epi32(qi);
    }
}

// the 64 codes of a chunk's low (hi = false) or high nibbles as unsigned 2 * e2m1 + 12
static inline K3_VNNI __m512i codes_shuffle(__m512i v, __m512i table, bool hi) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  return _mm512_shuffle_epi8(table, _mm512_and_si512(hi ? _mm512_srli_epi16(v, 4) : v, low4));
}
// VBMI: vpermb reads 6 index bits, so with the 16-entry table repeated 4 times no mask is needed
static inline K3_VBMI __m512i codes_permb(__m512i v, __m512i table, bool hi) {
  return _mm512_permutexvar_epi8(hi ? _mm512_srli_epi16(v, 4) : v, table);
}

// rows 16 nb .. 16 (nb + RB) - 1 of y (RB row blocks of 16) for the MT tokens m0 ..; the E4M3 scales are
// positive (the pack moved signs into the codes), so E4M3 -> fp16 bits (value / 256) is one shift, exact with
// subnormals. With RB = 2 the two blocks share each token's activation broadcasts and scale product setup;
// every output row still sums its groups in order with the same operations, so the bits equal RB = 1's.
#define K3_VNNI_BLOCK(NAME, ATTR, DECODE) \
template <int MT, int RB> static ATTR void NAME(int64_t nb, int64_t m0, int64_t G, int64_t N, \
                               const uint8_t* wp, const uint8_t* sp, const float* gs, const int8_t* q, \
                               const float* as, const int32_t* nc, float* y) { \
  const __m512i table = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, \
                                                             12, 11, 10, 9, 8, 6, 4, 0)); \
  const int64_t K = 16 * G; \
  __m512 acc[RB][MT]; \
  for (int r = 0; r < RB; ++r) \
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps(); \
  for (int64_t g = 0; g < G; ++g) { \
    __m512i w[RB][4]; \
    __m512 ws[RB]; \
    for (int r = 0; r < RB; ++r) { \
      const uint8_t* wb = wp + (nb + r) * G * 128; \
      const uint8_t* sb = sp + (nb + r) * G * 16; \
      _mm_prefetch(reinterpret_cast<const char*>(wb + (g + 16) * 128), _MM_HINT_T0); \
      _mm_prefetch(reinterpret_cast<const char*>(wb + (g + 16) * 128 + 64), _MM_HINT_T0); \
      const __m512i v0 = _mm512_loadu_si512(wb + g * 128), v1 = _mm512_loadu_si512(wb + g * 128 + 64); \
      w[r][0] = DECODE(v0, table, false); \
      w[r][1] = DECODE(v0, table, true); \
      w[r][2] = DECODE(v1, table, false); \
      w[r][3] = DECODE(v1, table, true); \
      ws[r] = _mm512_cvtph_ps(_mm256_slli_epi16( \
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + g * 16))), 7)); \
    } \
    for (int m = 0; m < MT; ++m) { \
      const int8_t* qm = q + (m0 + m) * K + 16 * g; \
      const __m512i base = _mm512_set1_epi32(nc[(m0 + m) * G + g]); \
      const __m512i a0 = _mm512_set1_epi32(load_i32(qm)), a1 = _mm512_set1_epi32(load_i32(qm + 4)); \
      const __m512i a2 = _mm512_set1_epi32(load_i32(qm + 8)), a3 = _mm512_set1_epi32(load_i32(qm + 12)); \
      const __m512 am = _mm512_set1_ps(as[(m0 + m) * G + g]); \
      for (int r = 0; r < RB; ++r) { \
        __m512i d = _mm512_dpbusd_epi32(base, w[r][0], a0); \
        d = _mm512_dpbusd_epi32(d, w[r][1], a1); \
        d = _mm512_dpbusd_epi32(d, w[r][2], a2); \
        d = _mm512_dpbusd_epi32(d, w[r][3], a3); \
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(ws[r], am), acc[r][m]); \
      } \
    } \
  } \
  for (int r = 0; r < RB; ++r) { \
    const __m512 gv = _mm512_mul_ps(_mm512_loadu_ps(gs + (nb + r) * 16), _mm512_set1_ps(128.f)); \
    const int64_t rows = std::min<int64_t>(16, N - (nb + r) * 16); \
    const __mmask16 keep = rows >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << rows) - 1); \
    for (int m = 0; m < MT; ++m) \
      _mm512_mask_storeu_ps(y + (m0 + m) * N + (nb + r) * 16, keep, _mm512_mul_ps(acc[r][m], gv)); \
  } \
}
K3_VNNI_BLOCK(vnni_block_shuffle, K3_VNNI, codes_shuffle)
K3_VNNI_BLOCK(vnni_block_permb, K3_VBMI, codes_permb)

// the row blocks b0 .. b1 - 1 for MT tokens: in pairs for 2 .. PAIR_MT tokens. On a 2-core Zen 4 with the
// weights streamed from DRAM (bench/bench_cpu_int8_ab.py) pairs took 0.76-0.94x the time at 2-4 tokens on
// 7168x7168 and 12288x7168 and 0.95-1.16x at one token (within that box's noise), so one token keeps the
// single stream; above 4 tokens two blocks' MT accumulators would not fit the 32 vector registers.
constexpr int PAIR_MT = 4;
template <int MT, bool VBMI>
static void vnni_blocks(int64_t b0, int64_t b1, int64_t m0, int64_t G, int64_t N, const uint8_t* wp,
                        const uint8_t* sp, const float* gs, const int8_t* q, const float* as,
                        const int32_t* nc, float* y, bool pairs) {
  int64_t nb = b0;
  if (MT >= 2 && MT <= PAIR_MT && pairs)
    for (; nb + 1 < b1; nb += 2) {
      if (VBMI)
        vnni_block_permb<MT, 2>(nb, m0, G, N, wp, sp, gs, q, as, nc, y);
      else
        vnni_block_shuffle<MT, 2>(nb, m0, G, N, wp, sp, gs, q, as, nc, y);
    }
  for (; nb < b1; ++nb)
    if (VBMI)
      vnni_block_permb<MT, 1>(nb, m0, G, N, wp, sp, gs, q, as, nc, y);
    else
      vnni_block_shuffle<MT, 1>(nb, m0, G, N, wp, sp, gs, q, as, nc, y);
}

bool has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

static bool has_vbmi() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vbmi");
}

// x fp32 [M, K] rounded as the kernels round it: (q int8 [M, K], scales fp32 [M, K/16], -12 x the codes'
// sum int32 [M, K/16]), rows spread over the threads
static std::vector<torch::Tensor> quant_rows(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), G = K / 16;
  auto q = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto as = torch::empty({M, G}, x.options());
  auto nc = torch::empty({M, G}, x.options().dtype(torch::kInt32));
  int8_t* qp = q.data_ptr<int8_t>();
  float* ap = as.data_ptr<float>();
  int32_t* np = nc.data_ptr<int32_t>();
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) { quant_act16(m0, m1, K, xp, qp, ap, np); });
  return {q, as, nc};
}

// x fp32 [M, K] -> (q int8 [M, K], scales fp32 [M, K/16]): the activation rounding of nvfp4_vnni_gemm
std::vector<torch::Tensor> nvfp4_vnni_quant(torch::Tensor x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() && x.size(1) % 16 == 0,
              "nvfp4_vnni_quant: x fp32 [M, K] contiguous with K a multiple of 16");
  auto r = quant_rows(x);
  return {r[0], r[1]};
}

// the rows of x (checked by the callers) through E stacked vnni16 weights, rows op[e] .. op[e + 1] - 1
// through weight e; with `rows` (int64 [P], may be undefined) row p is x's row rows[p]: each of x's rows is
// rounded once, then the rounded rows gathered (a token picked by several experts is rounded once)
// (y given: written there, [P, N] contiguous fp32; else allocated)
static torch::Tensor vnni_rows(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& s,
                               const torch::Tensor& gs, int64_t E, int64_t NB, const int64_t* op, int64_t N,
                               int64_t flags, const torch::Tensor& rows = torch::Tensor(),
                               torch::Tensor y = torch::Tensor()) {
  const int64_t P = rows.defined() ? rows.size(0) : x.size(0), G = x.size(1) / 16;
  auto act = quant_rows(x);
  if (rows.defined())
    for (auto& t : act) t = t.index_select(0, rows);
  const int8_t* qp = act[0].data_ptr<int8_t>();
  const float* ap = act[1].data_ptr<float>();
  const int32_t* np = act[2].data_ptr<int32_t>();
  if (!y.defined()) y = torch::empty({P, N}, x.options());
  const bool pairs = !(flags & 2);
  const int64_t NI = pairs ? (NB + 1) / 2 : NB, BI = pairs ? 2 : 1;  // work items: BI row blocks each
  std::vector<int64_t> items;  // (expert, item) of the experts that have rows
  for (int64_t e = 0; e < E; ++e)
    if (op[e + 1] > op[e])
      for (int64_t it = 0; it < NI; ++it) items.push_back(e * NI + it);
  using Fn = void (*)(int64_t, int64_t, int64_t, int64_t, int64_t, const uint8_t*, const uint8_t*,
                      const float*, const int8_t*, const float*, const int32_t*, float*, bool);
#define K3_TILES(V)                                                                                   \
  {vnni_blocks<1, V>,  vnni_blocks<2, V>,  vnni_blocks<3, V>,  vnni_blocks<4, V>,  vnni_blocks<5, V>,  \
   vnni_blocks<6, V>,  vnni_blocks<7, V>,  vnni_blocks<8, V>,  vnni_blocks<9, V>,  vnni_blocks<10, V>, \
   vnni_blocks<11, V>, vnni_blocks<12, V>, vnni_blocks<13, V>, vnni_blocks<14, V>, vnni_blocks<15, V>, \
   vnni_blocks<16, V>}
  static const Fn plain[16] = K3_TILES(false);
  static const Fn vbmi[16] = K3_TILES(true);
  static const bool vbmi_ok = has_vbmi();
  const Fn* fns = vbmi_ok && !(flags & 1) ? vbmi : plain;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint8_t* sp = s.data_ptr<uint8_t>();
  const float* gp = gs.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {  // a block's 16 rows stay in L1 across the token tiles
      const int64_t e = items[i] / NI, nb = items[i] % NI * BI, nb1 = std::min(nb + BI, NB);
      for (int64_t m0 = op[e]; m0 < op[e + 1]; m0 += 16) {
        const int64_t mt = std::min<int64_t>(16, op[e + 1] - m0);
        fns[mt - 1](nb, nb1, m0, G, N, wp + e * NB * G * 128, sp + e * NB * G * 16, gp + e * NB * 16,
                    qp, ap, np, yp, pairs);
      }
    }
  });
  return y;
}

// Several experts' weights stacked [E, NB, G, 128] / [E, NB, G, 16] / gs [E, NB * 16]; the rows grouped by
// expert: rows offsets[e] .. offsets[e + 1] - 1 use expert e. The rows are x's, or with `rows` (int64 [P];
// empty: none) x's rows rows[0], rows[1], ... Each row's result is what the one-weight call gives for it
// alone (every token's sums are independent of the tile it shares).
torch::Tensor nvfp4_vnni_grouped(torch::Tensor x, torch::Tensor w, torch::Tensor s, torch::Tensor gs,
                                 torch::Tensor offsets, int64_t N, int64_t flags, torch::Tensor rows) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "nvfp4_vnni_grouped: x fp32 [T, K]");
  const bool gather = rows.numel() > 0;
  TORCH_CHECK(rows.dtype() == torch::kInt64 && rows.dim() == 1, "nvfp4_vnni_grouped: rows int64 [P]");
  if (gather) {
    TORCH_CHECK(rows.min().item<int64_t>() >= 0 && rows.max().item<int64_t>() < x.size(0),
                "nvfp4_vnni_grouped: rows must index x's ", x.size(0), " rows");
  }
  const int64_t P = gather ? rows.size(0) : x.size(0), K = x.size(1), G = K / 16, E = w.size(0),
                NB = w.size(1);
  TORCH_CHECK(K % 16 == 0 && w.dim() == 4 && w.size(2) == G && w.size(3) == 128 && w.is_contiguous(),
              "nvfp4_vnni_grouped: weight [E, NB, K/16, 128] for K = ", K);
  TORCH_CHECK(s.dim() == 4 && s.size(0) == E && s.size(1) == NB && s.size(2) == G && s.size(3) == 16 &&
              s.is_contiguous(), "nvfp4_vnni_grouped: scales [E, NB, K/16, 16]");
  TORCH_CHECK(gs.dtype() == torch::kFloat32 && gs.numel() == E * NB * 16 && gs.is_contiguous(),
              "nvfp4_vnni_grouped: gs fp32 [E, NB * 16]");
  TORCH_CHECK(N > (NB - 1) * 16 && N <= NB * 16, "nvfp4_vnni_grouped: N = ", N, " for ", NB, " row blocks");
  auto off = offsets.to(torch::kInt64).contiguous();
  TORCH_CHECK(off.numel() == E + 1, "nvfp4_vnni_grouped: offsets [E + 1]");
  const int64_t* op = off.data_ptr<int64_t>();
  TORCH_CHECK(op[0] == 0 && op[E] == P, "nvfp4_vnni_grouped: offsets must run from 0 to P");
  for (int64_t e = 0; e < E; ++e)
    TORCH_CHECK(op[e] <= op[e + 1], "nvfp4_vnni_grouped: offsets must not decrease");
  return vnni_rows(x, w, s, gs, E, NB, op, N, flags, gather ? rows.contiguous() : torch::Tensor());
}

// y fp32 [M, N] from x fp32 [M, K] and one vnni16 weight: packed uint8 [NB, G, 128], scales uint8
// [NB, G, 16], gs fp32 [NB * 16] (the global scale per row, padded): the grouped kernel with one expert,
// over at most `chunk` rows at a time (larger inputs overflow the L2 between the row blocks; each row's
// result does not depend on the rows beside it), written into one output
torch::Tensor nvfp4_vnni_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor s, torch::Tensor gs,
                              int64_t N, int64_t flags, int64_t chunk) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "nvfp4_vnni_gemm: x fp32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), G = K / 16, NB = w.size(0);
  TORCH_CHECK(K % 16 == 0 && w.dim() == 3 && w.size(1) == G && w.size(2) == 128 && w.is_contiguous(),
              "nvfp4_vnni_gemm: weight [NB, K/16, 128] for K = ", K);
  TORCH_CHECK(s.dim() == 3 && s.size(0) == NB && s.size(1) == G && s.size(2) == 16 && s.is_contiguous(),
              "nvfp4_vnni_gemm: scales [NB, K/16, 16]");
  TORCH_CHECK(gs.numel() == NB * 16 && gs.dtype() == torch::kFloat32 && gs.is_contiguous(),
              "nvfp4_vnni_gemm: gs fp32 [NB * 16]");
  TORCH_CHECK(N > (NB - 1) * 16 && N <= NB * 16, "nvfp4_vnni_gemm: N = ", N, " for ", NB, " row blocks");
  TORCH_CHECK(chunk > 0, "nvfp4_vnni_gemm: chunk must be positive");
  if (M <= chunk) {
    const int64_t op[2] = {0, M};
    return vnni_rows(x, w, s, gs, 1, NB, op, N, flags);
  }
  auto y = torch::empty({M, N}, x.options());
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t mc = std::min(chunk, M - m0);
    const int64_t op[2] = {0, mc};
    vnni_rows(x.narrow(0, m0, mc), w, s, gs, 1, NB, op, N, flags, torch::Tensor(), y.narrow(0, m0, mc));
  }
  return y;
}


// ---- KDA decode, one token per sequence, the recurrent states updated in place in the cache pool ----
// Per (sequence b, head h), S = pool[slots[b], h] [K, V] fp32 (zero where context_lens[b] == 0):
//   S *= decay[k] per key row; pred = k^T S; S += (beta k) (v - pred)^T; o = (scale q)^T S
// The reference's operations (recurrent_kda_seq) in two passes over S, which stays in L2 between them:
// one read and one write of each state from memory (the reference gathers, decays, updates and scatters
// it in ~8 passes). Sums over K in another order than the reference's einsum; products as the reference's,
// except that the compiler may fuse a multiply and an add into one FMA.
static K3_AVX2 void kda_head(float* S, const float* qs, const float* kn, const float* v, const float* decay,
                             float beta, bool fresh, int64_t K, int64_t V, float* o, float* pred) {
  if (fresh)
    for (int64_t i = 0; i < K * V; ++i) S[i] = 0.f;
  for (int64_t j = 0; j < V; ++j) pred[j] = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    float* row = S + k * V;
    const float d = decay[k], kk = kn[k];
    for (int64_t j = 0; j < V; ++j) {
      row[j] *= d;
      pred[j] += kk * row[j];
    }
  }
  for (int64_t j = 0; j < V; ++j) {
    pred[j] = v[j] - pred[j];
    o[j] = 0.f;
  }
  for (int64_t k = 0; k < K; ++k) {
    float* row = S + k * V;
    const float bk = beta * kn[k], qk = qs[k];
    for (int64_t j = 0; j < V; ++j) {
      row[j] += bk * pred[j];
      o[j] += qk * row[j];
    }
  }
}

// fn(b, h, i = b * H + h, pred) for every (sequence, head) pair in parallel; pred: a [V] scratch row a thread
template <typename F>
static void for_each_head(int64_t B, int64_t H, int64_t V, const F& fn) {
  at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> pred(V);
    for (int64_t i = i0; i < i1; ++i) fn(i / H, i % H, i, pred.data());
  });
}

// q_scaled, kn, decay [B, H, K]; v [B, H, V]; beta [B, H]; pool [S, H, K, V]; slots, context_lens [B] int64
torch::Tensor kda_decode_step(torch::Tensor q_scaled, torch::Tensor kn, torch::Tensor v, torch::Tensor decay,
                              torch::Tensor beta, torch::Tensor pool, torch::Tensor slots,
                              torch::Tensor context_lens) {
  const int64_t B = q_scaled.size(0), H = q_scaled.size(1), K = q_scaled.size(2), V = v.size(2);
  for (const auto& t : {q_scaled, kn, v, decay, beta, pool})
    TORCH_CHECK(t.dtype() == torch::kFloat32 && t.is_contiguous(), "kda_decode_step: fp32 contiguous inputs");
  TORCH_CHECK(pool.dim() == 4 && pool.size(1) == H && pool.size(2) == K && pool.size(3) == V,
              "kda_decode_step: pool [S, H, K, V]");
  auto sl = slots.to(torch::kInt64).contiguous(), cl = context_lens.to(torch::kInt64).contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t* cp = cl.data_ptr<int64_t>();
  const int64_t S = pool.size(0);
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(sp[b] >= 0 && sp[b] < S, "kda_decode_step: slot out of range");
  auto o = torch::empty({B, H, V}, v.options());
  float* pp = pool.data_ptr<float>();
  const float *qp = q_scaled.data_ptr<float>(), *kp = kn.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *dp = decay.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = o.data_ptr<float>();
  for_each_head(B, H, V, [&](int64_t b, int64_t h, int64_t i, float* pred) {
    kda_head(pp + (sp[b] * H + h) * K * V, qp + i * K, kp + i * K, vp + i * V, dp + i * K, bp[i], cp[b] == 0,
             K, V, op + i * V, pred);
  });
  return o;
}

// ---- KDA prefill, token by token over a varlen batch, one (sequence, head) state at a time ----
// q_scaled, kn, decay [T, H, K]; v [T, H, V]; beta [T, H]; state [B, H, K, V] (the initial states, replaced
// by the final ones); cu_seqlens [B + 1] int64. Each (b, h) task runs kda_head over its tokens with the
// state in L1/L2 throughout: the recurrent reference's operations (recurrent_kda_seq), not the chunked
// form's, and one read and write of each state from memory for the whole prompt.
torch::Tensor kda_prefill_recurrent(torch::Tensor q_scaled, torch::Tensor kn, torch::Tensor v,
                                    torch::Tensor decay, torch::Tensor beta, torch::Tensor state,
                                    torch::Tensor cu_seqlens) {
  const int64_t T = q_scaled.size(0), H = q_scaled.size(1), K = q_scaled.size(2), V = v.size(2);
  for (const auto& t : {q_scaled, kn, v, decay, beta, state})
    TORCH_CHECK(t.dtype() == torch::kFloat32 && t.is_contiguous(),
                "kda_prefill_recurrent: fp32 contiguous inputs");
  TORCH_CHECK(q_scaled.dim() == 3 && kn.sizes() == q_scaled.sizes() && decay.sizes() == q_scaled.sizes() &&
                  v.dim() == 3 && v.size(0) == T && v.size(1) == H && beta.dim() == 2 && beta.size(0) == T &&
                  beta.size(1) == H,
              "kda_prefill_recurrent: q, k, decay [T, H, K], v [T, H, V], beta [T, H]");
  auto cu = cu_seqlens.to(torch::kInt64).contiguous();
  const int64_t B = cu.numel() - 1;
  TORCH_CHECK(state.dim() == 4 && state.size(0) == B && state.size(1) == H && state.size(2) == K &&
                  state.size(3) == V, "kda_prefill_recurrent: state [B, H, K, V]");
  const int64_t* cp = cu.data_ptr<int64_t>();
  TORCH_CHECK(cp[0] == 0 && cp[B] == T, "kda_prefill_recurrent: cu_seqlens from 0 to T");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(cp[b] <= cp[b + 1], "kda_prefill_recurrent: cu_seqlens decreases");
  auto o = torch::empty({T, H, V}, v.options());
  float* sp = state.data_ptr<float>();
  const float *qp = q_scaled.data_ptr<float>(), *kp = kn.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *dp = decay.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = o.data_ptr<float>();
  for_each_head(B, H, V, [&](int64_t b, int64_t h, int64_t i, float* pred) {
    for (int64_t t = cp[b]; t < cp[b + 1]; ++t) {
      const int64_t r = t * H + h;
      kda_head(sp + i * K * V, qp + r * K, kp + r * K, vp + r * V, dp + r * K, bp[r], false, K, V, op + r * V,
               pred);
    }
  });
  return o;
}

// ---- KDA short conv, decode: one token per sequence, the windows updated in place in the cache pool ----
// Per (b, c): window = [pool[slots[b], c, :] (zeros where context_lens[b] == 0), x[b, c]] in x's dtype,
// acc = sum_j (weight[c, j] * window[j]) in fp32 in j order, each product and sum rounded on its own (no FMA
// contraction), as causal_conv1d_decode_ref computes it; pool[slots[b], c, :] = window[1:]. Returns acc
// [B, C] fp32 (the caller applies SiLU, as the reference does). x [B, C] with unit stride along C.
template <typename T>
__attribute__((optimize("fp-contract=off"))) static void conv_decode_rows(
    const T* xp, int64_t sx, const float* wp, T* pp, const int64_t* sp, const int64_t* cp, int64_t B,
    int64_t C, int64_t W, float* ap) {
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      T* row = pp + sp[b] * C * (W - 1);
      const bool fresh = cp[b] == 0;
      for (int64_t c = 0; c < C; ++c) {
        T* st = row + c * (W - 1);
        float acc = 0.f;
        for (int64_t j = 0; j < W - 1; ++j) {
          const float p = wp[c * W + j] * (fresh ? 0.f : static_cast<float>(st[j]));
          acc = acc + p;
        }
        const T xv = xp[b * sx + c];
        const float p = wp[c * W + W - 1] * static_cast<float>(xv);
        acc = acc + p;
        for (int64_t j = 0; j + 1 < W - 1; ++j) st[j] = fresh ? static_cast<T>(0.f) : st[j + 1];
        st[W - 2] = xv;
        ap[b * C + c] = acc;
      }
    }
  });
}

// the short conv's weight as both conv calls take it: fp32 contiguous [C, W >= 2]
static void check_conv_weight(const torch::Tensor& weight, int64_t C, const char* who) {
  TORCH_CHECK(weight.dtype() == torch::kFloat32 && weight.is_contiguous() && weight.dim() == 2 &&
                  weight.size(0) == C && weight.size(1) >= 2,
              who, ": weight fp32 contiguous [C, W >= 2]");
}

torch::Tensor conv_decode_in_place(torch::Tensor x, torch::Tensor weight, torch::Tensor pool,
                                   torch::Tensor slots, torch::Tensor context_lens) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "conv_decode_in_place: x [B, C] with unit stride along C");
  const int64_t B = x.size(0), C = x.size(1);
  check_conv_weight(weight, C, "conv_decode_in_place");
  const int64_t W = weight.size(1);
  TORCH_CHECK(pool.dtype() == x.dtype() && pool.is_contiguous() && pool.dim() == 3 && pool.size(1) == C &&
                  pool.size(2) == W - 1,
              "conv_decode_in_place: pool contiguous [S, C, W - 1] in x's dtype");
  auto sl = slots.to(torch::kInt64).contiguous(), cl = context_lens.to(torch::kInt64).contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const int64_t* cp = cl.data_ptr<int64_t>();
  TORCH_CHECK(sl.numel() == B && cl.numel() == B, "conv_decode_in_place: slots, context_lens [B]");
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(sp[b] >= 0 && sp[b] < pool.size(0), "conv_decode_in_place: slot out of range");
  auto acc = torch::empty({B, C}, x.options().dtype(torch::kFloat32));
  if (x.scalar_type() == torch::kFloat32)
    conv_decode_rows<float>(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(),
                            pool.data_ptr<float>(), sp, cp, B, C, W, acc.data_ptr<float>());
  else if (x.scalar_type() == torch::kBFloat16)
    conv_decode_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), x.stride(0), weight.data_ptr<float>(),
                                   pool.data_ptr<at::BFloat16>(), sp, cp, B, C, W, acc.data_ptr<float>());
  else
    TORCH_CHECK(false, "conv_decode_in_place: x fp32 or bf16, got ", x.scalar_type());
  return acc;
}

// ---- bf16 weights, decode-sized M: y fp32 [M, N] = x fp32 [M, K] @ W^T, W bf16 [N, K] ----
// bf16 -> fp32 is a 16-bit shift, exact; fp32 FMAs, R rows of W at a time so each x load serves R rows.
// The products of torch's bf16 matmul, accumulated in fp32 in another order; 1.6-2x torch's bf16 linear at
// one row on a 2-core AVX-512 box.
template <int M, int R>
static K3_AVX512 void bf16_rows(int64_t n, int64_t K, int64_t N, const float* xp, const uint16_t* wp,
                                float* yp) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j < K; j += 16) {
    const __mmask16 k = K - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - j)) - 1);
    __m512 w[R];
    for (int r = 0; r < R; ++r)
      w[r] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, wp + (n + r) * K + j)), 16));
    for (int m = 0; m < M; ++m) {
      const __m512 a = _mm512_maskz_loadu_ps(k, xp + m * K + j);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm512_fmadd_ps(w[r], a, acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) yp[m * N + n + r] = _mm512_reduce_add_ps(acc[r][m]);
}

template <int M>
static void bf16_range(int64_t n0, int64_t n1, int64_t K, int64_t N, const float* xp, const uint16_t* wp,
                       float* yp) {
  constexpr int R = M <= 2 ? 8 : (M <= 4 ? 4 : 2);
  int64_t n = n0;
  for (; n + R <= n1; n += R) bf16_rows<M, R>(n, K, N, xp, wp, yp);
  for (; n < n1; ++n) bf16_rows<M, 1>(n, K, N, xp, wp, yp);
}

torch::Tensor bf16_gemv(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "bf16_gemv: x fp32 [M, K]");
  TORCH_CHECK(w.dtype() == torch::kBFloat16 && w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
              "bf16_gemv: w bf16 [N, K] contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M >= 1 && M <= 8, "bf16_gemv: 1..8 rows, got ", M);
  auto y = torch::empty({M, N}, x.options());
  using Fn = void (*)(int64_t, int64_t, int64_t, int64_t, const float*, const uint16_t*, float*);
  static const Fn fns[8] = {bf16_range<1>, bf16_range<2>, bf16_range<3>, bf16_range<4>,
                            bf16_range<5>, bf16_range<6>, bf16_range<7>, bf16_range<8>};
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) { fns[M - 1](n0, n1, K, N, xp, wp, yp); });
  return y;
}

// ---- the routed experts' combine: out[tok[p]] += R(y[p]) * w[p] for p = 0, 1, ... in that order ----
// R rounds through the activation dtype (bf16 / fp16; float: none) as the per-expert loop rounds each
// expert's output before its weight multiplies it; the product and the add are two roundings (no FMA
// contraction), each element's additions in p's order: the bits of index_add_(0, tok, R(y) * w[:, None]).
// The columns are split over the threads.
template <typename R>
__attribute__((optimize("fp-contract=off"))) static void combine_cols(int64_t d0, int64_t d1, int64_t P,
                                                                       int64_t D, const float* yp,
                                                                       const int64_t* tp, const float* wp,
                                                                       float* op) {
  for (int64_t p = 0; p < P; ++p) {
    const float* yr = yp + p * D;
    float* orow = op + tp[p] * D;
    const float wv = wp[p];
    for (int64_t d = d0; d < d1; ++d) {
      const float prod = static_cast<float>(static_cast<R>(yr[d])) * wv;
      orow[d] = orow[d] + prod;
    }
  }
}

void moe_combine(torch::Tensor out, torch::Tensor y, torch::Tensor tok, torch::Tensor w, int64_t round) {
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.dim() == 2 && out.is_contiguous(),
              "moe_combine: out fp32 [T, D] contiguous");
  const int64_t T = out.size(0), D = out.size(1);
  TORCH_CHECK(y.dtype() == torch::kFloat32 && y.dim() == 2 && y.is_contiguous() && y.size(1) == D,
              "moe_combine: y fp32 [P, ", D, "] contiguous");
  const int64_t P = y.size(0);
  TORCH_CHECK(tok.dtype() == torch::kInt64 && tok.dim() == 1 && tok.size(0) == P && tok.is_contiguous(),
              "moe_combine: tok int64 [", P, "]");
  TORCH_CHECK(w.dtype() == torch::kFloat32 && w.dim() == 1 && w.size(0) == P && w.is_contiguous(),
              "moe_combine: w fp32 [", P, "]");
  TORCH_CHECK(round >= 0 && round <= 2, "moe_combine: round 0 (none), 1 (bf16) or 2 (fp16)");
  const int64_t* tp = tok.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p)
    TORCH_CHECK(tp[p] >= 0 && tp[p] < T, "moe_combine: tok[", p, "] = ", tp[p], " is not a row of out");
  const float* yp = y.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, D, 256, [&](int64_t d0, int64_t d1) {
    if (round == 1)
      combine_cols<c10::BFloat16>(d0, d1, P, D, yp, tp, wp, op);
    else if (round == 2)
      combine_cols<c10::Half>(d0, d1, P, D, yp, tp, wp, op);
    else
      combine_cols<float>(d0, d1, P, D, yp, tp, wp, op);
  });
}

// ---- KDA short conv over prompts (varlen), as causal_conv1d_ref computes it ----
// Sequence b's window is [init[b] (W-1 older inputs; zeros without init) | x[s_b .. e_b)] per channel;
// acc[t, c] = sum_j w[c, j] * window[t + j] (fp32, each product rounded, then added, j ascending: the
// reference's `acc += w[:, j] * window[:, j : j + n]`; no FMA contraction); final[b, c] = the window's last
// W-1 entries. Returns acc fp32 [T, C] (SiLU left to torch, as the reference applies it) and final [B, C,
// W-1] in x's dtype. Sequences and channel blocks are spread over the threads.
template <typename T>
__attribute__((optimize("fp-contract=off"))) static void conv_prefill_rows(
    const T* xp, int64_t sx, const float* wp, const T* ip, const int64_t* cu, int64_t B, int64_t C,
    int64_t W, float* ap, T* fp) {
  constexpr int64_t CB = 64;
  const int64_t nb = (C + CB - 1) / CB;
  at::parallel_for(0, B * nb, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / nb, c0 = i % nb * CB, c1 = std::min(C, c0 + CB);
      const int64_t s = cu[b], n = cu[b + 1] - cu[b];
      auto window = [&](int64_t c, int64_t k) -> T {  // window index k in [0, W - 1 + n)
        if (k >= W - 1) return xp[(s + k - (W - 1)) * sx + c];
        return ip ? ip[(b * C + c) * (W - 1) + k] : static_cast<T>(0.f);
      };
      for (int64_t t = 0; t < n; ++t)
        for (int64_t c = c0; c < c1; ++c) {
          float acc = 0.f;
          for (int64_t j = 0; j < W; ++j) {
            const float p = wp[c * W + j] * static_cast<float>(window(c, t + j));
            acc = acc + p;
          }
          ap[(s + t) * C + c] = acc;
        }
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t k = 0; k < W - 1; ++k) fp[(b * C + c) * (W - 1) + k] = window(c, n + k);
    }
  });
}

std::vector<torch::Tensor> conv_prefill(torch::Tensor x, torch::Tensor weight, torch::Tensor cu_seqlens,
                                        torch::Tensor init) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "conv_prefill: x [T, C] with unit stride along C");
  const int64_t T = x.size(0), C = x.size(1);
  check_conv_weight(weight, C, "conv_prefill");
  const int64_t W = weight.size(1);
  auto cu = cu_seqlens.to(torch::kInt64).contiguous();
  const int64_t B = cu.numel() - 1;
  const int64_t* cp = cu.data_ptr<int64_t>();
  TORCH_CHECK(B >= 1 && cp[0] == 0 && cp[B] == T, "conv_prefill: cu_seqlens must run from 0 to T = ", T);
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(cp[b] <= cp[b + 1], "conv_prefill: cu_seqlens must not decrease");
  const bool has_init = init.numel() > 0;
  if (has_init)
    TORCH_CHECK(init.dtype() == x.dtype() && init.is_contiguous() && init.dim() == 3 && init.size(0) == B &&
                    init.size(1) == C && init.size(2) == W - 1,
                "conv_prefill: initial state contiguous [B, C, W - 1] in x's dtype");
  auto acc = torch::empty({T, C}, x.options().dtype(torch::kFloat32));
  auto fin = torch::empty({B, C, W - 1}, x.options());
  if (x.scalar_type() == torch::kFloat32)
    conv_prefill_rows<float>(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(),
                             has_init ? init.data_ptr<float>() : nullptr, cp, B, C, W, acc.data_ptr<float>(),
                             fin.data_ptr<float>());
  else if (x.scalar_type() == torch::kBFloat16)
    conv_prefill_rows<at::BFloat16>(x.data_ptr<at::BFloat16>(), x.stride(0), weight.data_ptr<float>(),
                                    has_init ? init.data_ptr<at::BFloat16>() : nullptr, cp, B, C, W,
                                    acc.data_ptr<float>(), fin.data_ptr<at::BFloat16>());
  else
    TORCH_CHECK(false, "conv_prefill: x fp32 or bf16, got ", x.scalar_type());
  return {acc, fin};
}

// ---- absorbed MLA decode attention (one query row a sequence): o = softmax(q . lat^T * scale) . lat ----
// q fp32 [H, J] (the absorbed NoPE query joined with the RoPE query, J = L + R), lat bf16 [N, J] with row
// stride ld (the sequence's cached latents, read in place: bf16 -> fp32 is a 16-bit shift, exact). The N
// positions go in chunks over the threads; a chunk widens P rows at a time into a small buffer (8 with
// AVX-512, 4 with AVX2's 16 registers), forms two heads' scores at a time with fp32 FMAs, and keeps an
// online softmax per head (running max m, sum l, accumulator acc [L]); the wrapper merges the chunks by
// their maxima. fp32 sums in another order than the reference's einsums.
#define K3_INL inline __attribute__((always_inline))
// e^x for x <= 0 from a vector struct's members (Cephes' expf: n = round(x log2 e), r = x - n ln 2 in two
// parts, a degree-6 polynomial, times 2^n), within ~2 ulp of std::exp; 0 below -87.3 (-inf included), where
// e^x is under the normals. The struct gives clamp_tiny (x clamped, and its lanes below), round, and scale2
// (y 2^n, the clamped lanes 0)
#define K3_EXP_NEG_BODY                                                                                      \
  auto tiny = clamp_tiny(x);                                                                                 \
  const T n = round(mul(x, set1(1.44269504088896341f)));                                                     \
  T r = fnma(n, set1(0.693359375f), x);                                                                      \
  r = fnma(n, set1(-2.12194440e-4f), r);                                                                     \
  T y = set1(1.9875691500e-4f);                                                                              \
  y = fma(y, r, set1(1.3981999507e-3f));                                                                     \
  y = fma(y, r, set1(8.3334519073e-3f));                                                                     \
  y = fma(y, r, set1(4.1665795894e-2f));                                                                     \
  y = fma(y, r, set1(1.6666665459e-1f));                                                                     \
  y = fma(y, r, set1(5.0000001201e-1f));                                                                     \
  y = fma(y, mul(r, r), add(r, set1(1.f)));                                                                  \
  return scale2(y, n, tiny);
struct V512 {
  using T = __m512;
  static constexpr int W = 16;
  static K3_INL K3_AVX512 T zero() { return _mm512_setzero_ps(); }
  static K3_INL K3_AVX512 T load(const float* p) { return _mm512_loadu_ps(p); }
  static K3_INL K3_AVX512 void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static K3_INL K3_AVX512 T set1(float v) { return _mm512_set1_ps(v); }
  static K3_INL K3_AVX512 T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static K3_INL K3_AVX512 T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static K3_INL K3_AVX512 float sum(T v) { return _mm512_reduce_add_ps(v); }
  static K3_INL K3_AVX512 T add(T a, T b) { return _mm512_add_ps(a, b); }
  static K3_INL K3_AVX512 T fnma(T a, T b, T c) { return _mm512_fnmadd_ps(a, b, c); }
  static K3_INL K3_AVX512 T round(T v) {
    return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static K3_INL K3_AVX512 __mmask16 clamp_tiny(T& x) {
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    return tiny;
  }
  static K3_INL K3_AVX512 T scale2(T y, T n, __mmask16 tiny) {
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(y, n));
  }
  static K3_INL K3_AVX512 T exp_neg(T x) { K3_EXP_NEG_BODY }
  static K3_INL K3_AVX512 void widen(const uint16_t* src, float* dst) {
    _mm512_storeu_ps(dst, _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), 16)));
  }
};
struct V256 {
  using T = __m256;
  static constexpr int W = 8;
  static K3_INL K3_AVX2 T zero() { return _mm256_setzero_ps(); }
  static K3_INL K3_AVX2 T load(const float* p) { return _mm256_loadu_ps(p); }
  static K3_INL K3_AVX2 void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static K3_INL K3_AVX2 T set1(float v) { return _mm256_set1_ps(v); }
  static K3_INL K3_AVX2 T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static K3_INL K3_AVX2 T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static K3_INL K3_AVX2 float sum(T v) { return hsum256(v); }
  static K3_INL K3_AVX2 T add(T a, T b) { return _mm256_add_ps(a, b); }
  static K3_INL K3_AVX2 T fnma(T a, T b, T c) { return _mm256_fnmadd_ps(a, b, c); }
  static K3_INL K3_AVX2 T round(T v) {
    return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static K3_INL K3_AVX2 T clamp_tiny(T& x) {
    const T tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    return tiny;
  }
  static K3_INL K3_AVX2 T scale2(T y, T n, T tiny) {  // 2^n by the exponent bits
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
  }
  static K3_INL K3_AVX2 T exp_neg(T x) { K3_EXP_NEG_BODY }
  static K3_INL K3_AVX2 void widen(const uint16_t* src, float* dst) {
    _mm256_storeu_ps(dst, _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))), 16)));
  }
};

// HB heads (1 or 2) from head h against the P widened rows in buf: their scores (each query vector load
// serves P rows, each row vector load HB heads), online-softmax updates and weighted-row sums
#define K3_MLA_HEADS(V, HB, P)                                                                               \
  {                                                                                                          \
    using T = V::T;                                                                                          \
    T dot[HB][P];                                                                                            \
    for (int u = 0; u < HB; ++u)                                                                             \
      for (int r = 0; r < P; ++r) dot[u][r] = V::zero();                                                     \
    for (int64_t j = 0; j < J; j += V::W) {                                                                  \
      T a[HB];                                                                                               \
      for (int u = 0; u < HB; ++u) a[u] = V::load(q + (h + u) * J + j);                                      \
      for (int r = 0; r < P; ++r) {                                                                          \
        const T row = V::load(buf + r * J + j);                                                              \
        for (int u = 0; u < HB; ++u) dot[u][r] = V::fma(a[u], row, dot[u][r]);                               \
      }                                                                                                      \
    }                                                                                                        \
    float p[HB][P], alpha[HB];                                                                               \
    for (int u = 0; u < HB; ++u) {                                                                           \
      float top = m[h + u];                                                                                  \
      for (int r = 0; r < rows; ++r) {                                                                       \
        p[u][r] = V::sum(dot[u][r]) * scale;                                                                 \
        top = std::max(top, p[u][r]);                                                                        \
      }                                                                                                      \
      for (int r = 0; r < P; ++r) /* the exponents; rows past the block's end weigh 0 */                     \
        p[u][r] = r < rows ? p[u][r] - top : -std::numeric_limits<float>::infinity();                        \
      alpha[u] = std::exp(m[h + u] - top); /* 0 on a chunk's first rows (m = -inf) */                        \
      m[h + u] = top;                                                                                        \
    }                                                                                                        \
    if (HB * P == V::W) { /* every probability of the pass in one vector */                                  \
      V::store(&p[0][0], V::exp_neg(V::load(&p[0][0])));                                                     \
    } else {                                                                                                 \
      for (int u = 0; u < HB; ++u)                                                                           \
        for (int r = 0; r < P; ++r) p[u][r] = r < rows ? std::exp(p[u][r]) : 0.f;                            \
    }                                                                                                        \
    for (int u = 0; u < HB; ++u) {                                                                           \
      float add = 0.f;                                                                                       \
      for (int r = 0; r < P; ++r) add += p[u][r];                                                            \
      l[h + u] = l[h + u] * alpha[u] + add;                                                                  \
    }                                                                                                        \
    for (int64_t j = 0; j < L; j += V::W) {                                                                  \
      T x[HB];                                                                                               \
      for (int u = 0; u < HB; ++u) x[u] = V::mul(V::load(acc + (h + u) * L + j), V::set1(alpha[u]));         \
      for (int r = 0; r < P; ++r) {                                                                          \
        const T row = V::load(buf + r * J + j);                                                              \
        for (int u = 0; u < HB; ++u) x[u] = V::fma(V::set1(p[u][r]), row, x[u]);                             \
      }                                                                                                      \
      for (int u = 0; u < HB; ++u) V::store(acc + (h + u) * L + j, x[u]);                                    \
    }                                                                                                        \
  }

// one chunk of positions s0 .. s1 - 1: m [H], l [H], acc [H, L] of its online softmax; buf [P, J] scratch
#define K3_MLA_CHUNK(NAME, ATTR, V, P)                                                                       \
  static ATTR void NAME(int64_t s0, int64_t s1, int64_t H, int64_t J, int64_t L, int64_t ld, float scale,    \
                        const float* q, const uint16_t* lat, float* m, float* l, float* acc, float* buf) {   \
    for (int64_t h = 0; h < H; ++h) {                                                                        \
      m[h] = -std::numeric_limits<float>::infinity();                                                        \
      l[h] = 0.f;                                                                                            \
    }                                                                                                        \
    std::memset(acc, 0, sizeof(float) * H * L);                                                              \
    for (int64_t s = s0; s < s1; s += P) {                                                                   \
      const int rows = static_cast<int>(std::min<int64_t>(P, s1 - s));                                       \
      for (int r = 0; r < rows; ++r)                                                                         \
        for (int64_t j = 0; j < J; j += V::W) V::widen(lat + (s + r) * ld + j, buf + r * J + j);             \
      for (int r = rows; r < P; ++r) std::memset(buf + r * J, 0, sizeof(float) * J);                         \
      int64_t h = 0;                                                                                         \
      for (; h + 2 <= H; h += 2) K3_MLA_HEADS(V, 2, P)                                                       \
      for (; h < H; ++h) K3_MLA_HEADS(V, 1, P)                                                               \
    }                                                                                                        \
  }
K3_MLA_CHUNK(mla_chunk512, K3_AVX512, V512, 8)
K3_MLA_CHUNK(mla_chunk256, K3_AVX2, V256, 4)

// (m [C, H], l [C, H], acc [C, H, L]) of C chunks of `chunk` positions; the caller merges them
std::vector<torch::Tensor> mla_decode_chunks(torch::Tensor q, torch::Tensor lat, int64_t L, double scale,
                                             int64_t chunk, bool avx2) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.dim() == 2 && q.is_contiguous(), "mla_decode: q fp32 [H, J]");
  TORCH_CHECK(lat.dtype() == torch::kBFloat16 && lat.dim() == 2 && lat.stride(1) == 1 &&
                  lat.size(1) == q.size(1),
              "mla_decode: lat bf16 [N, J] with unit column stride, J = q's");
  const int64_t H = q.size(0), J = q.size(1), N = lat.size(0), ld = lat.stride(0);
  TORCH_CHECK(N >= 1 && chunk >= 1 && L >= 1 && L <= J && J % 16 == 0 && L % 16 == 0,
              "mla_decode: N, chunk >= 1; L <= J, both multiples of 16");
  const int64_t C = (N + chunk - 1) / chunk;
  auto opts = q.options();
  auto m = torch::empty({C, H}, opts), l = torch::empty({C, H}, opts), acc = torch::empty({C, H, L}, opts);
  const float* qp = q.data_ptr<float>();
  const uint16_t* lp = reinterpret_cast<const uint16_t*>(lat.data_ptr<at::BFloat16>());
  float *mp = m.data_ptr<float>(), *lsp = l.data_ptr<float>(), *ap = acc.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, C, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> buf(8 * J);  // P rows of J, P <= 8
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t s0 = c * chunk, s1 = std::min(N, s0 + chunk);
      if (avx2)
        mla_chunk256(s0, s1, H, J, L, ld, sc, qp, lp, mp + c * H, lsp + c * H, ap + c * H * L, buf.data());
      else
        mla_chunk512(s0, s1, H, J, L, ld, sc, qp, lp, mp + c * H, lsp + c * H, ap + c * H * L, buf.data());
    }
  });
  return {m, l, acc};
}
