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
// Sixteen rows interleaved (gguf_linear.interleave), per group of 16 rows and block:
// - Q4_1_X16: their 16 fp16 d (32 bytes), 16 fp16 m (32), then four 64-byte vectors, the
//   j-th holding in its 32-bit lane r row r's nibble bytes 4j .. 4j + 3 (weights 4j .. 4j + 3
//   low, 16 + 4j .. 19 + 4j high); 20 bytes a row and block, as Q4_1.
// - Q8_0_X16: their 16 fp16 d, then eight 64-byte vectors, the j-th holding in lane r row
//   r's weights 4j .. 4j + 3 plus 128 (u8: d (u - 128), the minimum -128 d); 34 bytes a row
//   and block, as Q8_0.
constexpr int64_t Q4_1_X16 = 102, Q8_0_X16 = 103;
// How far ahead the interleaved kernels ask for their blocks: one core's misses alone read
// about 8 GB/s on the 2-core Intel VM, 1.2-1.4x that with this (docs/kernels.md)
#ifndef GGUF_PREFETCH
#define GGUF_PREFETCH 2048  // docs/bench/cpu_gguf_prefetch.py builds others
#endif
constexpr int64_t PREFETCH = GGUF_PREFETCH;

constexpr bool interleaved(int64_t kind) { return kind == Q4_1_X16 || kind == Q8_0_X16; }

// Row r's level of weight w (0-31) in an interleaved block o, and the block's d and m
inline int x16_level(int64_t kind, const uint8_t* o, int r, int w) {
  if (kind == Q8_0_X16) return o[32 + 64 * (w / 4) + 4 * r + w % 4];
  const uint8_t nib = o[64 + 64 * ((w % 16) / 4) + 4 * r + w % 4];
  return w < 16 ? nib & 15 : nib >> 4;
}

int64_t block_bytes(int64_t kind) {
  switch (kind) {
    case 2: return 18;
    case 3: return 20;
    case 8: return 34;
    case 100: return 24;
    case 101: return 44;
    case Q4_1_X16: return 20;
    case Q8_0_X16: return 34;
  }
  TORCH_CHECK(false, "GGUF kind ", kind, " is not one of Q4_0 (2), Q4_1 (3), Q8_0 (8), "
              "100, 101, 102 or 103 (repacked)");
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
  d = half(o + 2 * r);
  m = kind == Q8_0_X16 ? -128.f * d : half(o + 32 + 2 * r);
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
