// The kernels over sixteen interleaved rows (kinds 102 and 103: layers/gguf_linear.py,
// `interleave`; docs/kernels.md, "Sixteen rows interleaved"), each group of 16 rows
// against R rows of x at once.
#pragma once
#include "gguf_common.h"

namespace {
// The same sums a row at a time: for builds without the SIMD forms (which never interleave,
// gguf_linear.interleaves; this is for tests) and AVX2's Q8_0_X16
template <int64_t KIND, int R>
void group_dot_plain(const uint8_t* g, const int8_t* const* q, const float* const* d,
                     const float* const* s, int64_t nb, float* const* out) {
  constexpr int64_t bytes = 16 * block_bytes_x16(KIND);
  for (int t = 0; t < R; ++t)
    for (int r = 0; r < 16; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* o = g + b * bytes;
        int dot = 0;
        for (int w = 0; w < QK; ++w) dot += x16_level(KIND, o, r, w) * q[t][b * QK + w];
        float dw, mw;
        x16_scale(KIND, o, r, dw, mw);
        acc += dw * d[t][b] * (float)dot + mw * s[t][b];
      }
      out[t][r] = acc;
    }
}

#ifdef GGUF_SIMD
// The block PREFETCH bytes past the one at o (past the tensor's end: prefetches never fault)
inline void prefetch_ahead(const uint8_t* o, int64_t bytes) {
  for (int64_t l = 0; l < bytes; l += 64)
    _mm_prefetch((const char*)(o + PREFETCH + l), _MM_HINT_T0);
}
#endif

#ifdef GGUF_VNNI
// One group of 16 interleaved rows against R rows of x: each vpdpbusd takes four weights
// of all sixteen rows against four bytes of x broadcast, and a block's scales are one
// vector, so a block costs about 40 instructions for 16 rows where row_dot spends some 15
// on each (docs/kernels.md, "Sixteen rows interleaved").
template <int64_t KIND, int R>
void group_dot(const uint8_t* g, const int8_t* const* q, const float* const* d,
               const float* const* s, int64_t nb, float* const* out) {
  constexpr int64_t bytes = 16 * block_bytes_x16(KIND);
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* o = g + b * bytes;
    prefetch_ahead(o, bytes);
    __m512 dw, mw;
    if (x16_of(KIND) == 100) {
      dw = _mm512_loadu_ps(o);
      mw = _mm512_loadu_ps(o + 64);
    } else {
      dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)o));
      mw = KIND == Q4_1_X16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(o + 32)))
                            : _mm512_mul_ps(dw, _mm512_set1_ps(KIND == Q8_0_X16 ? -128.f : -8.f));
    }
    __m512i lv[8];  // lv[j]'s lane r: row r's levels of the weights x4[j] holds
    if (KIND == Q8_0_X16) {
      for (int j = 0; j < 8; ++j) lv[j] = _mm512_loadu_si512((const void*)(o + 32 + 64 * j));
    } else {
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512((const void*)(o + x16_head(KIND) + 64 * j));
        lv[j] = _mm512_and_si512(v, low);
        lv[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    }
    for (int t = 0; t < R; ++t) {
      int32_t x4[8];
      std::memcpy(x4, q[t] + b * QK, QK);
      __m512i dot = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) dot = _mm512_dpbusd_epi32(dot, lv[j], _mm512_set1_epi32(x4[j]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, _mm512_set1_ps(d[t][b])),
                               acc[t]);
      acc[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(s[t][b]), acc[t]);
    }
  }
  for (int t = 0; t < R; ++t) _mm512_storeu_ps(out[t], acc[t]);
}
#elif defined(GGUF_SIMD)
// AVX2: the Q4 kinds eight rows a 256-bit lane set (rows 8h .. 8h + 7 the h-th half of each
// vector), each four-weight dot a vpmaddubsw and a vpmaddwd (dot32). Q8_0_X16 gains nothing
// here (Q8_0 as stored needs no unpacking; its u8 levels would need a wider dot), so AVX2
// reads Q8_0 as stored.
template <int64_t KIND, int R>
void group_dot(const uint8_t* g, const int8_t* const* q, const float* const* d,
               const float* const* s, int64_t nb, float* const* out) {
  if (KIND == Q8_0_X16) return group_dot_plain<KIND, R>(g, q, d, s, nb, out);
  constexpr int64_t bytes = 16 * block_bytes_x16(KIND);
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int t = 0; t < R; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* o = g + b * bytes;
      prefetch_ahead(o, bytes);
      __m256 dw, mw;
      if (x16_of(KIND) == 100) {
        dw = _mm256_loadu_ps((const float*)o + 8 * h);
        mw = _mm256_loadu_ps((const float*)(o + 64) + 8 * h);
      } else {
        dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(o + 16 * h)));
        mw = KIND == Q4_1_X16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(o + 32 + 16 * h)))
                              : _mm256_mul_ps(dw, _mm256_set1_ps(-8.f));
      }
      __m256i lv[8];
      for (int j = 0; j < 4; ++j) {
        const __m256i v =
            _mm256_loadu_si256((const __m256i*)(o + x16_head(KIND) + 64 * j + 32 * h));
        lv[j] = _mm256_and_si256(v, low);
        lv[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      for (int t = 0; t < R; ++t) {
        int32_t x4[8];
        std::memcpy(x4, q[t] + b * QK, QK);
        __m256i dot = dot32(lv[0], _mm256_set1_epi32(x4[0]));
        for (int j = 1; j < 8; ++j)
          dot = _mm256_add_epi32(dot, dot32(lv[j], _mm256_set1_epi32(x4[j])));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                                 _mm256_mul_ps(dw, _mm256_set1_ps(d[t][b])), acc[t]);
        acc[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(s[t][b]), acc[t]);
      }
    }
    for (int t = 0; t < R; ++t) _mm256_storeu_ps(out[t] + 8 * h, acc[t]);
  }
}
#else
template <int64_t KIND, int R>
void group_dot(const uint8_t* g, const int8_t* const* q, const float* const* d,
               const float* const* s, int64_t nb, float* const* out) {
  group_dot_plain<KIND, R>(g, q, d, s, nb, out);
}
#endif

template <int64_t KIND, int R>
void group_tile(const uint8_t* w, const Rows& x, float* y, int64_t r0, int64_t n, int64_t k,
                int64_t g0, int64_t g1) {
  const int64_t nb = k / QK, bytes = 16 * block_bytes(KIND);
  const int8_t* q[R];
  const float* d[R];
  const float* s[R];
  float* out[R];
  for (int t = 0; t < R; ++t) {
    q[t] = x.q.data() + (r0 + t) * k;
    d[t] = x.d.data() + (r0 + t) * nb;
    s[t] = x.s.data() + (r0 + t) * nb;
  }
  for (int64_t g = g0; g < g1; ++g) {
    for (int t = 0; t < R; ++t) out[t] = y + (r0 + t) * n + g * 16;
    group_dot<KIND, R>(w + g * nb * bytes, q, d, s, nb, out);
  }
}

using GroupTile = void (*)(const uint8_t*, const Rows&, float*, int64_t, int64_t, int64_t,
                          int64_t, int64_t);

template <int R>
GroupTile group_tiles(int64_t kind) {
  switch (kind) {
    case Q4_1_X16: return group_tile<Q4_1_X16, R>;
    case Q8_0_X16: return group_tile<Q8_0_X16, R>;
    case Q4_0_X16: return group_tile<Q4_0_X16, R>;
    default: return group_tile<F32_Q4_X16, R>;
  }
}
}  // namespace
