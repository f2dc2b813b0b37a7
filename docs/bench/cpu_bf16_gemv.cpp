// A bfloat16 GEMV of the project's own for the CPU, beside oneDNN's packed bfloat16 linear
// (cpu_weight_dtype="bfloat16", layers/cpu_weights.py), built and timed by
// docs/bench/cpu_bf16_gemv.py: y[m, n] = sum_k x[m, k] * w[n, k], x and w bfloat16, the
// sums float32. Each weight row is streamed once for every row of x: four weight rows at a
// time, 32 values an instruction (AVX512-BF16's dot product), the rows over torch's threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace {

constexpr int64_t kRows = 4;    // weight rows a pass
constexpr int64_t kMaxX = 4;    // rows of x a pass takes
constexpr int64_t kLanes = 32;  // bfloat16 values a 512-bit register holds

float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#ifdef __AVX512BF16__
// Weight rows [r, r + R) against the M rows of x: out[j * n + r + i]. R and M are
// compile-time, so the accumulators stay in registers.
template <int64_t R, int64_t M>
void pass(const uint16_t* w, const uint16_t* x, float* out, int64_t r, int64_t n, int64_t k) {
  __m512 acc[R][M];
#pragma GCC unroll 16
  for (int64_t i = 0; i < R * M; ++i) acc[i / M][i % M] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += kLanes) {
    __m512bh xs[M];
#pragma GCC unroll 4
    for (int64_t j = 0; j < M; ++j) xs[j] = (__m512bh)_mm512_loadu_si512(x + j * k + c);
#pragma GCC unroll 4
    for (int64_t i = 0; i < R; ++i) {
      __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (r + i) * k + c);
#pragma GCC unroll 4
      for (int64_t j = 0; j < M; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xs[j]);
    }
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < M; ++j) out[j * n + r + i] = _mm512_reduce_add_ps(acc[i][j]);
}

#endif

// The same sums one value at a time: CPUs without AVX512-BF16, and widths not a multiple
// of 32.
void plain(const uint16_t* w, const uint16_t* x, float* out, int64_t r, int64_t m, int64_t n,
           int64_t k) {
  for (int64_t j = 0; j < m; ++j) {
    float sum = 0.f;
    for (int64_t c = 0; c < k; ++c) sum += bf16_to_float(w[r * k + c]) * bf16_to_float(x[j * k + c]);
    out[j * n + r] = sum;
  }
}

// Weight rows [lo, hi) against the M rows of x from row x0: four weight rows a pass.
template <int64_t M>
void group(const uint16_t* w, const uint16_t* x, float* out, int64_t lo, int64_t hi,
           int64_t n, int64_t k) {
  for (int64_t r = lo; r < hi; r += kRows) {
#ifdef __AVX512BF16__
    if (k % kLanes == 0 && r + kRows <= hi) {
      pass<kRows, M>(w, x, out, r, n, k);
      continue;
    }
#endif
    for (int64_t i = r; i < std::min(hi, r + kRows); ++i) plain(w, x, out, i, M, n, k);
  }
}

// Every weight row against every row of x. The weight rows go over torch's threads in
// blocks of kBlock; each block meets the rows of x four at a time, so it is read from
// memory once and from the cache for the next four (a block of 576-wide rows: 73 KB).
constexpr int64_t kBlock = 64;

at::Tensor mm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "bf16_gemv.mm takes bfloat16 x and weights");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.size(0) >= 1,
              "bf16_gemv.mm takes x [m >= 1, k] and weights [n, k]");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  const int64_t m = x.size(0), n = w.size(0), k = w.size(1);
  auto out = at::empty({m, n}, x.options().dtype(at::kFloat));
  const auto* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (n + kBlock - 1) / kBlock, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * kBlock, hi = std::min(n, lo + kBlock);
      for (int64_t j = 0; j < m; j += kMaxX) {
        const uint16_t* xj = xp + j * k;
        float* oj = op + j * n;
        switch (std::min(kMaxX, m - j)) {
          case 1: group<1>(wp, xj, oj, lo, hi, n, k); break;
          case 2: group<2>(wp, xj, oj, lo, hi, n, k); break;
          case 3: group<3>(wp, xj, oj, lo, hi, n, k); break;
          default: group<4>(wp, xj, oj, lo, hi, n, k);
        }
      }
    }
  });
  return out;
}

at::Tensor mm_meta(const at::Tensor& x, const at::Tensor& w) {
  return at::empty({x.size(0), w.size(0)}, x.options().dtype(at::kFloat));
}

bool vectorized() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(roseinfer_bf16, lib) {
  lib.def("mm(Tensor x, Tensor w) -> Tensor");
  lib.def("vectorized() -> bool", &vectorized);
}

TORCH_LIBRARY_IMPL(roseinfer_bf16, CPU, lib) { lib.impl("mm", &mm); }

TORCH_LIBRARY_IMPL(roseinfer_bf16, Meta, lib) { lib.impl("mm", &mm_meta); }
