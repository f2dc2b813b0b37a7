"""GGUF's quantized blocks multiplied as they are stored, on the CPU: a candidate kernel
beside the float linears the engine runs today, on the default model's own tensors.

The candidate (C++ with AVX-512 VNNI, built here by torch's cpp_extension) reads each
weight row's blocks in the file's layout (Q4_1: fp16 scale and min, 16 bytes of
nibbles, 32 weights; Q8_0: fp16 scale and 32 int8) and rounds each row of x to int8 per
block of 32 first, as llama.cpp does (its Q8_1 and Q8_0 activations): a block's product
is one u8 x s8 dot (`vpdpbusd`), scaled. Beside it, per shape and row count: float32
`F.linear` and oneDNN's packed kernel (the engine's two float32 choices), bfloat16 in
oneDNN's packed layout and ATen's weight-only int8 (`cpu_weight_dtype`), all over
weights streamed from memory (256 MB of copies in turn), two threads.

Prints a table, µs per call, and each kernel's relative error against the float64
product of the de-quantized weights.

    python3 docs/bench/cpu_gguf_kernels.py [--rows 1,4,16,64]
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {
constexpr int QK = 32;

struct Rows { std::vector<int8_t> q; std::vector<float> d, s; };

// Each row of x rounded to int8 per block of 32: q, its scale d and d * sum(q).
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

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float half(const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return _cvtsh_ss(h); }

// One weight row's dot with R rows of x, Q4_1 (20 bytes a block): per block
// d_w d_x (levels . q_x) + m_w s_x, the levels' products as u8 x s8 (vpdpbusd), two
// blocks a 512-bit step; R accumulators stay in registers.
template <int R>
inline void q4_1_dot(const uint8_t* row, const int8_t* const* q, const float* const* d,
                     const float* const* s, int64_t nb, float* out) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m512 acc[R];
  float mins[R];
  for (int t = 0; t < R; ++t) { acc[t] = _mm512_setzero_ps(); mins[t] = 0.f; }
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    const uint8_t* b0 = row + b * 20;
    const uint8_t* b1 = b0 + 20;
    uint32_t h0, h1;
    std::memcpy(&h0, b0, 4);
    std::memcpy(&h1, b1, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_set_epi32(0, 0, (int)h1, (int)h0));  // d0 m0 d1 m1
    const float d0 = _mm_cvtss_f32(dm), m0 = _mm_cvtss_f32(_mm_shuffle_ps(dm, dm, 1));
    const float d1 = _mm_cvtss_f32(_mm_shuffle_ps(dm, dm, 2));
    const float m1 = _mm_cvtss_f32(_mm_shuffle_ps(dm, dm, 3));
    const __m256i nib = _mm256_set_m128i(_mm_loadu_si128((const __m128i*)(b1 + 4)),
                                         _mm_loadu_si128((const __m128i*)(b0 + 4)));
    // per 128-bit lane: a block's 16 low nibbles, then its 16 high ones, as x's order
    const __m256i lo = _mm256_and_si256(nib, low);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(nib, 4), low);
    const __m512i lv = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_permute2x128_si256(lo, hi, 0x20)),
        _mm256_permute2x128_si256(lo, hi, 0x31), 1);
    for (int t = 0; t < R; ++t) {
      const __m512i qx = _mm512_loadu_si512((const void*)(q[t] + b * 32));
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lv, qx);
      const __m512 sc = _mm512_insertf32x8(_mm512_set1_ps(d0 * d[t][b]),
                                           _mm256_set1_ps(d1 * d[t][b + 1]), 1);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc[t]);
      mins[t] += m0 * s[t][b] + m1 * s[t][b + 1];
    }
  }
  for (; b < nb; ++b) {  // an odd last block
    const uint8_t* b0 = row + b * 20;
    const float d0 = half(b0), m0 = half(b0 + 2);
    const __m128i nib = _mm_loadu_si128((const __m128i*)(b0 + 4));
    const __m128i l4 = _mm_set1_epi8(0x0F);
    const __m256i lv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(nib, 4), l4),
                                        _mm_and_si128(nib, l4));
    for (int t = 0; t < R; ++t) {
      const __m256i qx = _mm256_loadu_si256((const __m256i*)(q[t] + b * 32));
      const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lv, qx);
      mins[t] += d0 * d[t][b] * (float)_mm512_reduce_add_epi32(_mm512_castsi256_si512(dot))
                 + m0 * s[t][b];
    }
  }
  for (int t = 0; t < R; ++t) out[t] = _mm512_reduce_add_ps(acc[t]) + mins[t];
}

// Q8_0 (34 bytes a block): signed x signed as |w| (u8) . (q_x with w's signs)
template <int R>
inline void q8_0_dot(const uint8_t* row, const int8_t* const* q, const float* const* d,
                     const float* const*, int64_t nb, float* out) {
  __m256 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * 34;
    const float dw = half(blk);
    const __m256i qw = _mm256_loadu_si256((const __m256i*)(blk + 2));
    const __m256i aw = _mm256_sign_epi8(qw, qw);
    for (int t = 0; t < R; ++t) {
      const __m256i qx = _mm256_loadu_si256((const __m256i*)(q[t] + b * 32));
      const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw,
                                              _mm256_sign_epi8(qx, qw));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * d[t][b]), acc[t]);
    }
  }
  for (int t = 0; t < R; ++t) out[t] = hsum(acc[t]);
}

template <int R>
void rows_tile(int64_t kind, const uint8_t* w, const Rows& x, float* y, int64_t r0, int64_t n,
               int64_t k, int64_t n0, int64_t n1) {
  const int64_t nb = k / QK, bytes = nb * (kind == 0 ? 20 : 34);
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
    if (kind == 0) q4_1_dot<R>(w + col * bytes, q, d, s, nb, out);
    else q8_0_dot<R>(w + col * bytes, q, d, s, nb, out);
    for (int t = 0; t < R; ++t) y[(r0 + t) * n + col] = out[t];
  }
}

void rows(int64_t kind, const uint8_t* w, const Rows& x, float* y, int64_t m, int64_t n,
          int64_t k, int64_t n0, int64_t n1) {
  int64_t r0 = 0;
  for (; r0 + 4 <= m; r0 += 4) rows_tile<4>(kind, w, x, y, r0, n, k, n0, n1);
  for (; r0 < m; ++r0) rows_tile<1>(kind, w, x, y, r0, n, k, n0, n1);
}
}  // namespace

torch::Tensor gguf_linear(torch::Tensor x, torch::Tensor w, int64_t kind) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2);
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  TORCH_CHECK(k % QK == 0 && w.is_contiguous());
  auto y = torch::empty({m, n}, x.options());
  const Rows xr = quantize_rows(x.data_ptr<float>(), m, k);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t n0, int64_t n1) {
    ::rows(kind, wp, xr, yp, m, n, k, n0, n1);
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) { mod.def("gguf_linear", &gguf_linear); }
"""
STREAM_BYTES = 256 << 20
KINDS = {"Q4_1": 0, "Q8_0": 1}


def build():
    from torch.utils.cpp_extension import load_inline
    start = time.perf_counter()
    mod = load_inline("gguf_kernels", cpp_sources=SOURCE,
                      extra_cflags=["-O3", "-march=native"])
    print(f"built in {time.perf_counter() - start:.1f} s", flush=True)
    return mod


def gguf_tensors(path: str) -> dict:
    """One layer's linears and the tied head, as stored: {name: (kind, raw [N, bytes],
    de-quantized float32 [N, K])}."""
    import gguf
    reader = gguf.GGUFReader(path)
    out = {}
    for t in reader.tensors:
        if t.name.startswith("blk.0.") or t.name == "token_embd.weight":
            if t.tensor_type.name not in KINDS:
                continue
            raw = torch.from_numpy(np.ascontiguousarray(t.data))
            deq = torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).astype(np.float32))
            out[t.name.removeprefix("blk.0.")] = (t.tensor_type.name, raw, deq)
    return out


def per_call(fn, copies, reps=3) -> float:
    """µs a call, each call on the next copy of the weights (from memory, as in a step)."""
    for c in copies[:2]:
        fn(c)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for c in copies:
            fn(c)
        best = min(best, (time.perf_counter() - start) / len(copies))
    return best * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--gguf", default=None, help="default: the default model's file")
    args = ap.parse_args()
    torch.set_num_threads(2)
    path = args.gguf
    if path is None:
        from roseinfer.models.loader import ALIASES
        path = ALIASES["SmolLM2-135M-Instruct"]()
    mod = build()
    tensors = gguf_tensors(path)
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; µs a call "
          "(relative error against float64 of the de-quantized weight)")
    print("| tensor | kind | N x K | rows | gguf blocks (candidate) | float32 F.linear | "
          "float32 oneDNN packed | bfloat16 oneDNN packed | int8 weight-only |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (kind, raw, deq) in tensors.items():
        n, k = deq.shape
        copies = max(2, min(64, STREAM_BYTES // (n * k * 4)))
        for rows in rows_list:
            x = torch.randn(rows, k)
            want = (x.double() @ deq.double().T)

            def err(y):
                return ((y.double() - want).norm() / want.norm()).item()
            raws = [raw.clone() for _ in range(copies)]
            f32 = [deq.clone() for _ in range(copies)]
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in f32]
            bf = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 16) for w in f32]
            scale = deq.abs().amax(1).clamp(min=1e-12) / 127
            i8 = [(w / scale[:, None]).round().to(torch.int8) for w in f32]
            ones = torch.ones(n, dtype=torch.bfloat16)
            cells = []
            for fn, ws, post in (
                    (lambda w: mod.gguf_linear(x, w, KINDS[kind]), raws, None),
                    (lambda w: F.linear(x, w), f32, None),
                    (lambda w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                     packed, None),
                    (lambda w: torch.ops.mkldnn._linear_pointwise(
                        x.bfloat16(), w, None, "none", [], "").float(), bf, None),
                    (lambda w: torch.ops.aten._weight_int8pack_mm(
                        x.bfloat16(), w, ones).float() * scale, i8, None)):
                us = per_call(fn, ws)
                cells.append(f"{us:.1f} ({err(fn(ws[0])):.1e})")
            print(f"| {name} | {kind} | {n} x {k} | {rows} | " + " | ".join(cells) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
