// GGUF's quantized blocks multiplied as they are stored, on the CPU (layers/gguf_linear.py).
//
// Each row of x is rounded to int8 per block of 32 first, as llama.cpp rounds its
// activations (Q8_0 / Q8_1): a block's product is then one integer dot, scaled. Kinds are
// ggml's type numbers: Q4_0 (2: fp16 d, 16 bytes of nibbles, w = d (q - 8)), Q4_1 (3: fp16
// d and m, 16 bytes of nibbles, w = d q + m) and Q8_0 (8: fp16 d, 32 int8, w = d q); and
// the other kinds repacked at load (layers/gguf_repack.py): 100 (float32 d and m, 16 bytes of
// nibbles) and 101 (float32 d of weights 0-15 and of 16-31, float32 m, 32 int8,
// w = d q + m). A block's low nibbles are its weights 0-15, the high ones 16-31.
//
// With AVX-512 VNNI a block's 32 products are one u8 x s8 `vpdpbusd`, two blocks a 512-bit
// step, four rows of x a pass over a weight row; with AVX2 (no VNNI) one block a 256-bit
// step, its dot a `vpmaddubsw` and a `vpmaddwd` (no int16 pair can saturate: |w| <= 128,
// |q_x| <= 127); elsewhere the same sums in plain C++. Q4_1 and Q8_0 regrouped by sixteen
// rows at load (kinds 102, 103) take the kernels of gguf_interleaved.h; what both share is
// in gguf_common.h.
#include "gguf_interleaved.h"

namespace {
#ifdef GGUF_SIMD
#ifdef GGUF_VNNI

// One weight row's dot with R rows of x, Q4_0, Q4_1 or kind 100: per block
// d_w d_x (levels . q_x) + m_w s_x. With several rows, sixteen blocks a pass: their eight
// two-block dots are summed a block each into one vector first (block_sums), so the
// per-block scales are a vector multiply and two FMAs for all sixteen, not scalar work
// each block and row.
// ORDER: the block each lane of block_sums holds.
alignas(64) constexpr int ORDER[16] = {0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15};

// v[i]: the dot of blocks 2i (lanes 0-7) and 2i + 1 (lanes 8-15); out: each block's sum,
// block ORDER[j] in lane j.
inline __m512i block_sums(const __m512i* v) {
  __m512i t[4], u[2];
  for (int i = 0; i < 4; ++i)  // per 128-bit chunk: pairs of lanes of v[2i] and v[2i + 1]
    t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                            _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {  // per chunk: its four lanes' sum of v[4i] .. v[4i + 3]
    u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]),
                            _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    // chunks 0 + 1 (the even blocks), 2 + 3 (the odd ones)
    u[i] = _mm512_add_epi32(u[i], _mm512_shuffle_i32x4(u[i], u[i], _MM_SHUFFLE(2, 3, 0, 1)));
  }
  return _mm512_shuffle_i32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0));
}

// Two blocks' levels as x's order: per 256 bits a block's 16 low nibbles, then its high ones
inline __m512i levels2(const uint8_t* b0, const uint8_t* b1, int64_t head) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i nib = _mm256_set_m128i(_mm_loadu_si128((const __m128i*)(b1 + head)),
                                       _mm_loadu_si128((const __m128i*)(b0 + head)));
  const __m256i lo = _mm256_and_si256(nib, low);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(nib, 4), low);
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(lo, hi, 0x20)),
                            _mm256_permute2x128_si256(lo, hi, 0x31), 1);
}

// Sixteen blocks' d and m, in ORDER
inline void q4_scales16(int64_t kind, const uint8_t* blk, const __m512i offsets, __m512& d,
                        __m512& m) {
  if (kind == 100) {
    d = _mm512_castsi512_ps(_mm512_i32gather_epi32(offsets, blk, 1));
    m = _mm512_castsi512_ps(_mm512_i32gather_epi32(offsets, blk + 4, 1));
    return;
  }
  const __m512i dm = _mm512_i32gather_epi32(offsets, blk, 1);  // fp16 d, then (Q4_1) m
  d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
  m = kind == 3 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)))
                : _mm512_mul_ps(d, _mm512_set1_ps(-8.f));
}

template <int R>
void q4_dot(int64_t kind, const uint8_t* row, const int8_t* const* q, const float* const* d,
            const float* const* s, int64_t nb, float* out) {
  const int64_t bytes = block_bytes(kind), head = bytes - 16;
  const __m512i order = _mm512_load_si512((const void*)ORDER);
  const __m512i offsets = _mm512_mullo_epi32(order, _mm512_set1_epi32((int)bytes));
  __m512 acc[R];
  float mins[R];
  for (int t = 0; t < R; ++t) { acc[t] = _mm512_setzero_ps(); mins[t] = 0.f; }
  int64_t b = 0;
  // One row of x gained nothing from it (the sixteen-block pass took 0.98-1.05x the pair
  // loop's time on the default model's shapes): it is for four rows a pass
  for (; R > 1 && b + 16 <= nb; b += 16) {
    const uint8_t* blk = row + b * bytes;
    __m512 dw, mw;
    q4_scales16(kind, blk, offsets, dw, mw);
    __m512i lv[8];
    for (int i = 0; i < 8; ++i)
      lv[i] = levels2(blk + 2 * i * bytes, blk + (2 * i + 1) * bytes, head);
    for (int t = 0; t < R; ++t) {
      __m512i dots[8];
      for (int i = 0; i < 8; ++i)
        dots[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lv[i], _mm512_loadu_si512(
            (const void*)(q[t] + (b + 2 * i) * QK)));
      const __m512 dx = _mm512_permutexvar_ps(order, _mm512_loadu_ps(d[t] + b));
      const __m512 sx = _mm512_permutexvar_ps(order, _mm512_loadu_ps(s[t] + b));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block_sums(dots)), _mm512_mul_ps(dw, dx),
                               acc[t]);
      acc[t] = _mm512_fmadd_ps(mw, sx, acc[t]);
    }
  }
  for (; b + 2 <= nb; b += 2) {
    const uint8_t* b0 = row + b * bytes;
    const uint8_t* b1 = b0 + bytes;
    float d0, m0, d1, m1;
    q4_scale(kind, b0, d0, m0);
    q4_scale(kind, b1, d1, m1);
    const __m512i lv = levels2(b0, b1, head);
    for (int t = 0; t < R; ++t) {
      const __m512i qx = _mm512_loadu_si512((const void*)(q[t] + b * QK));
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lv, qx);
      const __m512 sc = _mm512_insertf32x8(_mm512_set1_ps(d0 * d[t][b]),
                                           _mm256_set1_ps(d1 * d[t][b + 1]), 1);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc[t]);
      mins[t] += m0 * s[t][b] + m1 * s[t][b + 1];
    }
  }
  for (; b < nb; ++b) {  // an odd last block
    const uint8_t* b0 = row + b * bytes;
    float d0, m0;
    q4_scale(kind, b0, d0, m0);
    const __m128i nib = _mm_loadu_si128((const __m128i*)(b0 + head));
    const __m128i l4 = _mm_set1_epi8(0x0F);
    const __m256i lv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(nib, 4), l4),
                                        _mm_and_si128(nib, l4));
    for (int t = 0; t < R; ++t) {
      const __m256i qx = _mm256_loadu_si256((const __m256i*)(q[t] + b * QK));
      const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lv, qx);
      mins[t] += d0 * d[t][b] * (float)_mm512_reduce_add_epi32(_mm512_castsi256_si512(dot)) +
                 m0 * s[t][b];
    }
  }
  for (int t = 0; t < R; ++t) out[t] = _mm512_reduce_add_ps(acc[t]) + mins[t];
}
#else
// AVX2: Q4_0, Q4_1 or kind 100 a block at a time, its levels shared by the R rows of x.
template <int R>
void q4_dot(int64_t kind, const uint8_t* row, const int8_t* const* q, const float* const* d,
            const float* const* s, int64_t nb, float* out) {
  const int64_t bytes = block_bytes(kind), head = bytes - 16;
  const __m128i l4 = _mm_set1_epi8(0x0F);
  __m256 acc[R];
  float mins[R];
  for (int t = 0; t < R; ++t) { acc[t] = _mm256_setzero_ps(); mins[t] = 0.f; }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * bytes;
    float dw, mw;
    q4_scale(kind, blk, dw, mw);
    const __m128i nib = _mm_loadu_si128((const __m128i*)(blk + head));
    const __m256i lv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(nib, 4), l4),
                                        _mm_and_si128(nib, l4));
    for (int t = 0; t < R; ++t) {
      const __m256i qx = _mm256_loadu_si256((const __m256i*)(q[t] + b * QK));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(lv, qx)),
                               _mm256_set1_ps(dw * d[t][b]), acc[t]);
      mins[t] += mw * s[t][b];
    }
  }
  for (int t = 0; t < R; ++t) out[t] = hsum(acc[t]) + mins[t];
}
#endif

// Q8_0: signed x signed as |w| (u8) . (q_x with w's signs)
template <int R>
void q8_dot(const uint8_t* row, const int8_t* const* q, const float* const* d, int64_t nb,
            float* out) {
  __m256 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 34;
    const float dw = half(blk);
    const __m256i qw = _mm256_loadu_si256((const __m256i*)(blk + 2));
    const __m256i aw = _mm256_sign_epi8(qw, qw);
    for (int t = 0; t < R; ++t) {
      const __m256i qx = _mm256_loadu_si256((const __m256i*)(q[t] + b * QK));
      const __m256i dot = dot32(aw, _mm256_sign_epi8(qx, qw));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * d[t][b]), acc[t]);
    }
  }
  for (int t = 0; t < R; ++t) out[t] = hsum(acc[t]);
}

// Kind 101: a scale for each half of the block (the dot's lanes 0-3 and 4-7), a minimum.
template <int R>
void halves_dot(const uint8_t* row, const int8_t* const* q, const float* const* d,
                const float* const* s, int64_t nb, float* out) {
  __m256 acc[R];
  float mins[R];
  for (int t = 0; t < R; ++t) { acc[t] = _mm256_setzero_ps(); mins[t] = 0.f; }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 44;
    const __m256 dw = _mm256_set_m128(_mm_set1_ps(f32(blk + 4)), _mm_set1_ps(f32(blk)));
    const float mw = f32(blk + 8);
    const __m256i qw = _mm256_loadu_si256((const __m256i*)(blk + 12));
    const __m256i aw = _mm256_sign_epi8(qw, qw);
    for (int t = 0; t < R; ++t) {
      const __m256i qx = _mm256_loadu_si256((const __m256i*)(q[t] + b * QK));
      const __m256i dot = dot32(aw, _mm256_sign_epi8(qx, qw));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                               _mm256_mul_ps(dw, _mm256_set1_ps(d[t][b])), acc[t]);
      mins[t] += mw * s[t][b];
    }
  }
  for (int t = 0; t < R; ++t) out[t] = hsum(acc[t]) + mins[t];
}

template <int R>
void row_dot(int64_t kind, const uint8_t* row, const int8_t* const* q, const float* const* d,
             const float* const* s, int64_t nb, float* out) {
  if (kind == 8) q8_dot<R>(row, q, d, nb, out);
  else if (kind == 101) halves_dot<R>(row, q, d, s, nb, out);
  else q4_dot<R>(kind, row, q, d, s, nb, out);
}
#else
// The same sums without vector instructions: exact integer dots, one block at a time.
template <int R>
void row_dot(int64_t kind, const uint8_t* row, const int8_t* const* q, const float* const* d,
             const float* const* s, int64_t nb, float* out) {
  const int64_t bytes = block_bytes(kind);
  for (int t = 0; t < R; ++t) {
    float acc = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * bytes;
      const int8_t* qx = q[t] + b * QK;
      int dot = 0;
      if (kind == 8) {
        for (int j = 0; j < QK; ++j) dot += (int)(int8_t)blk[2 + j] * qx[j];
        acc += half(blk) * d[t][b] * (float)dot;
        continue;
      }
      if (kind == 101) {
        int hi = 0;
        for (int j = 0; j < 16; ++j) dot += (int)(int8_t)blk[12 + j] * qx[j];
        for (int j = 16; j < QK; ++j) hi += (int)(int8_t)blk[12 + j] * qx[j];
        acc += (f32(blk) * (float)dot + f32(blk + 4) * (float)hi) * d[t][b] +
               f32(blk + 8) * s[t][b];
        continue;
      }
      float dw, mw;
      q4_scale(kind, blk, dw, mw);
      const uint8_t* nib = blk + bytes - 16;
      for (int j = 0; j < 16; ++j) dot += (nib[j] & 15) * qx[j] + (nib[j] >> 4) * qx[j + 16];
      acc += dw * d[t][b] * (float)dot + mw * s[t][b];
    }
    out[t] = acc;
  }
}
#endif

template <int R>
void rows_tile(int64_t kind, const uint8_t* w, const Rows& x, float* y, int64_t r0, int64_t n,
               int64_t k, int64_t n0, int64_t n1) {
  const int64_t nb = k / QK, bytes = nb * block_bytes(kind);
  const int8_t* q[R];
  const float* d[R];
  const float* s[R];
  for (int t = 0; t < R; ++t) {
    q[t] = x.q.data() + (r0 + t) * k;
    d[t] = x.d.data() + (r0 + t) * nb;
    s[t] = x.s.data() + (r0 + t) * nb;
  }
  float out[R];
  for (int64_t col = n0; col < n1; ++col) {
    row_dot<R>(kind, w + col * bytes, q, d, s, nb, out);
    for (int t = 0; t < R; ++t) y[(r0 + t) * n + col] = out[t];
  }
}

void check(const at::Tensor& blocks, int64_t kind, int64_t k) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "GGUF blocks must be a contiguous uint8 [rows, bytes] tensor");
  TORCH_CHECK(k % QK == 0 && blocks.size(1) == k / QK * block_bytes(kind),
              "GGUF blocks of ", blocks.size(1), " bytes a row do not hold ", k, " weights");
  TORCH_CHECK(!interleaved(kind) || blocks.size(0) % 16 == 0,
              "interleaved blocks hold groups of 16 rows, not ", blocks.size(0));
}

// y = x @ W.T for W's rows as GGUF blocks ([N, K / 32 * block bytes]); x float32 [M, K].
at::Tensor mm(const at::Tensor& x, const at::Tensor& blocks, int64_t kind) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "x must be float32 [rows, K]");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), n = blocks.size(0);
  check(blocks, kind, k);
  at::Tensor y = at::empty({m, n}, xc.options());
  const Rows xr = quantize_rows(xc.data_ptr<float>(), m, k);
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (interleaved(kind)) {
    at::parallel_for(0, n / 16, 1, [&](int64_t g0, int64_t g1) {
      const auto tile = group_tiles<4>(kind);
      const auto one = group_tiles<1>(kind);
      int64_t r0 = 0;
      for (; r0 + 4 <= m; r0 += 4) tile(wp, xr, yp, r0, n, k, g0, g1);
      for (; r0 < m; ++r0) one(wp, xr, yp, r0, n, k, g0, g1);
    });
    return y;
  }
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    int64_t r0 = 0;
    for (; r0 + 4 <= m; r0 += 4) rows_tile<4>(kind, wp, xr, yp, r0, n, k, n0, n1);
    for (; r0 < m; ++r0) rows_tile<1>(kind, wp, xr, yp, r0, n, k, n0, n1);
  });
  return y;
}

// The weights the blocks hold, float32 [N, K].
at::Tensor dequantize(const at::Tensor& blocks, int64_t kind, int64_t k) {
  check(blocks, kind, k);
  const int64_t n = blocks.size(0), nb = k / QK, bytes = block_bytes(kind);
  at::Tensor w = at::empty({n, k}, blocks.options().dtype(at::kFloat));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* wp = w.data_ptr<float>();
  if (interleaved(kind)) {
    at::parallel_for(0, n / 16 * nb, 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {  // group i / nb, block i % nb
        const uint8_t* o = bp + i * 16 * bytes;
        for (int r = 0; r < 16; ++r) {
          float dw, mw;
          x16_scale(kind, o, r, dw, mw);
          float* out = wp + ((i / nb) * 16 + r) * k + (i % nb) * QK;
          for (int w = 0; w < QK; ++w) out[w] = dw * (float)x16_level(kind, o, r, w) + mw;
        }
      }
    });
    return w;
  }
  at::parallel_for(0, n * nb, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t* blk = bp + i * bytes;
      float* out = wp + i * QK;
      if (kind == 8) {
        const float dw = half(blk);
        for (int j = 0; j < QK; ++j) out[j] = dw * (float)(int8_t)blk[2 + j];
        continue;
      }
      if (kind == 101) {
        for (int j = 0; j < QK; ++j)
          out[j] = f32(blk + (j < 16 ? 0 : 4)) * (float)(int8_t)blk[12 + j] + f32(blk + 8);
        continue;
      }
      float dw, mw;
      q4_scale(kind, blk, dw, mw);
      const uint8_t* nib = blk + bytes - 16;
      for (int j = 0; j < 16; ++j) {
        out[j] = dw * (float)(nib[j] & 15) + mw;
        out[j + 16] = dw * (float)(nib[j] >> 4) + mw;
      }
    }
  });
  return w;
}

// The form this build's dots took: 2 AVX-512 VNNI, 1 AVX2, 0 plain C++ (gguf_linear reads it
// to choose the kinds it interleaves)
int64_t form() {
#if defined(GGUF_VNNI)
  return 2;
#elif defined(GGUF_SIMD)
  return 1;
#else
  return 0;
#endif
}

at::Tensor mm_meta(const at::Tensor& x, const at::Tensor& blocks, int64_t) {
  return at::empty({x.size(0), blocks.size(0)}, x.options());
}

at::Tensor dequantize_meta(const at::Tensor& blocks, int64_t, int64_t k) {
  return at::empty({blocks.size(0), k}, blocks.options().dtype(at::kFloat));
}
}  // namespace

// GGUF_NS: the ops' namespace; a build for another target (the tests' portable one) names
// its own, so that both load in one process. The indirection expands it before pasting.
#ifndef GGUF_NS
#define GGUF_NS roseinfer_gguf
#endif
#define GGUF_LIBRARY(ns, lib) TORCH_LIBRARY(ns, lib)
#define GGUF_LIBRARY_IMPL(ns, key, lib) TORCH_LIBRARY_IMPL(ns, key, lib)

GGUF_LIBRARY(GGUF_NS, lib) {
  lib.def("mm(Tensor x, Tensor blocks, int kind) -> Tensor");
  lib.def("dequantize(Tensor blocks, int kind, int k) -> Tensor");
  lib.def("form() -> int", &form);
}

GGUF_LIBRARY_IMPL(GGUF_NS, CPU, lib) {
  lib.impl("mm", &mm);
  lib.impl("dequantize", &dequantize);
}

GGUF_LIBRARY_IMPL(GGUF_NS, Meta, lib) {
  lib.impl("mm", &mm_meta);
  lib.impl("dequantize", &dequantize_meta);
}
