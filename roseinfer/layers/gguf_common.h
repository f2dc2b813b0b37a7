// What the GGUF block kernels share (gguf_blocks.cpp, gguf_interleaved.h): the kinds,
// their scales, x rounded to int8 per block, and the SIMD forms' integer dot.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__F16C__)
#define GGUF_VNNI 1
#define GGUF_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GGUF_SIMD 1
#endif
#ifdef GGUF_SIMD
#include <immintrin.h>
#endif

namespace {
constexpr int QK = 32;
// Sixteen rows interleaved (gguf_linear.interleave), per group of 16 rows and block: the
// rows' 16 scales, then their levels, 64-byte vectors whose 32-bit lane r holds row r's
// bytes 4j .. 4j + 3 in the j-th; the same bytes a row and block as the kind stored.
// - Q4_0_X16 (of Q4_0), Q4_1_X16 (Q4_1), F32_Q4_X16 (kind 100): 16 d (fp16, or float32 for
//   kind 100), Q4_1's and kind 100's 16 m, then four vectors of nibble bytes (weights
//   4j .. 4j + 3 low, 16 + 4j .. 19 + 4j high); Q4_0's m is -8 d.
// - Q8_0_X16: 16 fp16 d, then eight vectors of each weight plus 128 (u8: d (u - 128), the
//   minimum -128 d).
constexpr int64_t Q4_1_X16 = 102, Q8_0_X16 = 103, Q4_0_X16 = 104, F32_Q4_X16 = 105;

// The kind an interleaved kind holds (-1: not interleaved), and its scales' bytes
constexpr int64_t x16_of(int64_t kind) {
  return kind == Q4_1_X16 ? 3 : kind == Q8_0_X16 ? 8 : kind == Q4_0_X16 ? 2
       : kind == F32_Q4_X16 ? 100 : -1;
}
constexpr int64_t x16_head(int64_t kind) {
  return x16_of(kind) == 100 ? 128 : x16_of(kind) == 3 ? 64 : 32;
}
// How far ahead the interleaved kernels ask for their blocks: one core's misses alone read
// about 8 GB/s on the 2-core Intel VM, 1.04-1.4x that with this (docs/kernels.md)
#ifndef GGUF_PREFETCH
#define GGUF_PREFETCH 2048  // docs/bench/cpu_gguf_prefetch.py builds others
#endif
constexpr int64_t PREFETCH = GGUF_PREFETCH;

constexpr bool interleaved(int64_t kind) { return x16_of(kind) >= 0; }
// bytes a row and block of an interleaved kind: the stored kind's
constexpr int64_t block_bytes_x16(int64_t kind) {
  return x16_of(kind) == 8 ? 34 : x16_of(kind) == 3 ? 20 : x16_of(kind) == 2 ? 18 : 24;
}

// Row r's level of weight w (0-31) in an interleaved block o, and the block's d and m
inline int x16_level(int64_t kind, const uint8_t* o, int r, int w) {
  if (kind == Q8_0_X16) return o[32 + 64 * (w / 4) + 4 * r + w % 4];
  const uint8_t nib = o[x16_head(kind) + 64 * ((w % 16) / 4) + 4 * r + w % 4];
  return w < 16 ? nib & 15 : nib >> 4;
}

int64_t block_bytes(int64_t kind) {
  if (interleaved(kind)) return block_bytes_x16(kind);
  switch (kind) {
    case 2: return 18;
    case 3: return 20;
    case 8: return 34;
    case 100: return 24;
    case 101: return 44;
  }
  TORCH_CHECK(false, "GGUF kind ", kind, " is not one of Q4_0 (2), Q4_1 (3), Q8_0 (8), "
              "100 to 105 (repacked)");
}

float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

float f32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

inline void x16_scale(int64_t kind, const uint8_t* o, int r, float& d, float& m) {
  const int64_t of = x16_of(kind);
  d = of == 100 ? f32(o + 4 * r) : half(o + 2 * r);
  m = of == 100 ? f32(o + 64 + 4 * r) : of == 3 ? half(o + 32 + 2 * r)
    : (of == 8 ? -128.f : -8.f) * d;
}

// x's rows rounded to int8 per block: q, the scale d, and d * sum(q) (what x's block sums
// to, for a block's minimum).
struct Rows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

Rows quantize_rows(const float* x, int64_t m, int64_t k) {
  const int64_t nb = k / QK;
  Rows r{std::vector<int8_t>(m * k), std::vector<float>(m * nb), std::vector<float>(m * nb)};
  for (int64_t i = 0; i < m * nb; ++i) {
    const float* v = x + i * QK;
    float amax = 0.f;
    for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127.f, id = d ? 1.f / d : 0.f;
    int sum = 0;
    for (int j = 0; j < QK; ++j) {
      const int q = (int)std::nearbyint(v[j] * id);
      r.q[i * QK + j] = (int8_t)q;
      sum += q;
    }
    r.d[i] = d;
    r.s[i] = d * (float)sum;
  }
  return r;
}

// A Q4 block's scale and the minimum it adds to each weight.
inline void q4_scale(int64_t kind, const uint8_t* blk, float& d, float& m) {
  if (kind == 100) {
    d = f32(blk);
    m = f32(blk + 4);
    return;
  }
  d = half(blk);
  m = kind == 3 ? half(blk + 2) : -8.f * d;
}

#ifdef GGUF_SIMD
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// u8 x s8 products of 32 bytes, summed four at a time into eight int32 lanes
inline __m256i dot32(__m256i u, __m256i v) {
#ifdef GGUF_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, v);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1));
#endif
}

#endif
}  // namespace
