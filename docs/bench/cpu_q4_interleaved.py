"""A prototype beside the GGUF Q4_1 block kernel: sixteen weight rows interleaved, so that one
AVX-512 VNNI `vpdpbusd` takes four weights of each of sixteen rows against four bytes of x
broadcast, and each block's sixteen scales are one vector (the kernel today takes one row's
blocks, two a step, their scales scalar). Same bytes a weight (20 a block of 32). Timed
against `torch.ops.roseinfer_gguf.mm` on the same blocks, the default model's Q4_1 shapes,
1 and 4 rows of x, the weights hot in cache and streamed through copies of about 100 MB
(the model's size).

Usage: python3 docs/bench/cpu_q4_interleaved.py [--threads 1,2]
"""
import argparse
import time

import gguf
import numpy as np
import torch
from torch.utils.cpp_extension import load_inline

from roseinfer.layers import gguf_linear

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>

// [N, nb * 20] Q4_1 blocks -> [N / 16, nb, 320]: per 16 rows and block, their fp16 d (32 B),
// fp16 m (32 B), then 4 x 64 B: vector j's lane r holds row r's qs[4j .. 4j + 3] (weights
// 4j..4j+3 in the low nibbles, 16+4j..16+4j+3 in the high ones).
torch::Tensor interleave(torch::Tensor blocks) {
  const int64_t n = blocks.size(0), nb = blocks.size(1) / 20;
  TORCH_CHECK(n % 16 == 0);
  auto out = torch::empty({n / 16, nb, 320}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t g = 0; g < n / 16; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* o = dst + (g * nb + b) * 320;
      for (int r = 0; r < 16; ++r) {
        const uint8_t* blk = src + (g * 16 + r) * nb * 20 + b * 20;
        std::memcpy(o + 2 * r, blk, 2);
        std::memcpy(o + 32 + 2 * r, blk + 2, 2);
        for (int j = 0; j < 4; ++j) std::memcpy(o + 64 + 64 * j + 4 * r, blk + 4 + 4 * j, 4);
      }
    }
  return out;
}

template <int R>
void group_dot(const uint8_t* g, int64_t nb, const int8_t* q, const float* d, const float* s,
               int64_t k, float* out, int64_t n) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R], mins[R];
  for (int t = 0; t < R; ++t) { acc[t] = _mm512_setzero_ps(); mins[t] = _mm512_setzero_ps(); }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* o = g + b * 320;
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)o));
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(o + 32)));
    __m512i lv[8];
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512((const void*)(o + 64 + 64 * j));
      lv[j] = _mm512_and_si512(v, low);
      lv[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    for (int t = 0; t < R; ++t) {
      const int32_t* x4 = (const int32_t*)(q + t * k + b * 32);
      __m512i dot = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) dot = _mm512_dpbusd_epi32(dot, lv[j], _mm512_set1_epi32(x4[j]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                               _mm512_mul_ps(dw, _mm512_set1_ps(d[t * nb + b])), acc[t]);
      mins[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(s[t * nb + b]), mins[t]);
    }
  }
  for (int t = 0; t < R; ++t) _mm512_storeu_ps(out + t * n, _mm512_add_ps(acc[t], mins[t]));
}

torch::Tensor mm(torch::Tensor x, torch::Tensor packed) {
  const int64_t m = x.size(0), k = x.size(1), nb = k / 32, groups = packed.size(0);
  const int64_t n = groups * 16;
  std::vector<int8_t> q(m * k);
  std::vector<float> d(m * nb), s(m * nb);
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < m * nb; ++i) {  // as gguf_blocks.cpp rounds x
    const float* v = xp + i * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float dd = amax / 127.f, id = dd ? 1.f / dd : 0.f;
    int sum = 0;
    for (int j = 0; j < 32; ++j) { const int qq = (int)std::nearbyint(v[j] * id); q[i * 32 + j] = (int8_t)qq; sum += qq; }
    d[i] = dd; s[i] = dd * (float)sum;
  }
  auto out = torch::empty({m, n}, x.options());
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, groups, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t gi = lo; gi < hi; ++gi) {
      const uint8_t* g = pp + gi * nb * 320;
      int64_t t = 0;
      for (; t + 4 <= m; t += 4)
        group_dot<4>(g, nb, q.data() + t * k, d.data() + t * nb, s.data() + t * nb, k, op + t * n + gi * 16, n);
      for (; t < m; ++t)
        group_dot<1>(g, nb, q.data() + t * k, d.data() + t * nb, s.data() + t * nb, k, op + t * n + gi * 16, n);
    }
  });
  return out;
}
"""


def timed(fn, seconds=0.4):
    for _ in range(5):
        fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", default="1,2")
    args = p.parse_args()
    ext = load_inline("q4_interleaved", cpp_sources=SOURCE, functions=["interleave", "mm"],
                      extra_cflags=["-O3", "-march=native", *gguf_linear.OPENMP])
    ops = gguf_linear.build()
    rng = np.random.default_rng(0)
    shapes = {"ffn gate_up 3072 x 576": (3072, 576), "ffn down 576 x 1536": (576, 1536),
              "attn q 576 x 576": (576, 576)}
    print(f"CPU: {gguf_linear._cpu().splitlines()[0]}")
    for name, (n, k) in shapes.items():
        w = rng.standard_normal((n, k)).astype(np.float32)
        blocks = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
                                  .view(np.uint8).reshape(n, -1).copy())
        copies = max(1, (100 << 20) // blocks.numel())
        plain = [blocks.clone() for _ in range(copies)]
        packed = [ext.interleave(b) for b in plain]
        for rows in (1, 4):
            x = torch.randn(rows, k)
            ref, got = ops.mm(x, blocks, 3), ext.mm(x, packed[0])
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            for threads in map(int, args.threads.split(",")):
                torch.set_num_threads(threads)
                row = []
                for hot in (True, False):
                    it = [0]

                    def call(fn, ws):
                        i = 0 if hot else it[0] % len(ws)
                        it[0] += 1
                        return fn(ws[i])
                    a = timed(lambda: call(lambda b: ops.mm(x, b, 3), plain))
                    b = timed(lambda: call(lambda b: ext.mm(x, b), packed))
                    row.append(f"{'hot' if hot else 'streamed'} {a:7.1f} -> {b:7.1f} us ({a / b:4.2f}x)")
                print(f"{name:24s} rows {rows} threads {threads}: " + "; ".join(row)
                      + f"; max rel diff {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
