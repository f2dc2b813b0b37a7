// 4-bit weights times bf16 rows on tensor cores, for 1 to 64 rows (layers/int4_mma.py).
//
// The weight is int32 words, 32 columns a panel ([N / 32, K / 8, 32], each block streaming
// long runs): nibble j of word r holds input 8r + SIGMA[j] of its column, SIGMA = {0, 2, 4, 6, 1, 3, 5, 7}, so that one mask takes two neighbouring inputs
// into the two halves of a register: (word >> 4i) & 0x000F000F holds inputs 2i and 2i + 1.
// ORed into the mantissa of bf16 128.0 (0x4300), each half is then 128 + level, exactly;
// `(v - 128) * scale + shift` gives the weight, rounded once. Scales and shifts are bf16
// in the same panels, [N / 32, K / group, 32], group 32, 64 or 128.
//
// The weight is the left operand of `mma.m16n8k16` (16 output columns by 16 inputs), the
// rows of x the right one (8 rows a tile), so the unpacked words go from registers straight
// into the tensor cores: no shared-memory round trip, no shuffle. Each lane owns whole words:
// in a chunk of 128 inputs, lane (g, c) (g = lane / 4, c = lane % 4) reads words c, c + 4,
// c + 8 and c + 12 of columns g and g + 8; word c + 4q gives the lane its inputs of k-slices
// 2q and 2q + 1, the mma's k positions (2c, 2c + 1) and (2c + 8, 2c + 9) standing for inputs
// 8r + 4h + (0, 1) and (2, 3). x's matching four inputs are one 8-byte load.
//
// A block is WARPS_N x WARPS_K warps: WARPS_N side by side over its columns (16 * M_TILES
// each), WARPS_K over the inputs (one chunk each a stage). Words, scales, shifts and x come
// through a cp.async pipeline of up to four stages. Warps of one column range sum in shared memory at
// the end. Where the inputs are split over blocks (`splits` > 1) each block writes its float32
// sums to `partials`, and the last to finish (a counter per column block, left at zero for the
// next call) adds them in order and rounds: one launch, the same sums every call.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <torch/library.h>

namespace {

constexpr int CHUNK = 128;        // inputs a warp takes a stage
constexpr int CHUNK_WORDS = CHUNK / 8;
constexpr int WORD_PAD = 8;       // words: lane (g, c) reads bank 8c + g, every bank once
constexpr int X_PAD = 32;         // x: row stride = 16 banks mod 32, 16-byte reads conflict-free

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  int bytes = valid ? 16 : 0;  // 0: the 16 bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src),
               "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// A dependent launch (Hopper on): wait until the kernel before has ended and its writes are
// visible, then let the next kernel start (the same contract as the Triton kernels'
// core/triton_support.wait_for_inputs).
__device__ __forceinline__ void wait_for_inputs() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" :::);
#endif
}

// Two levels, (word >> shift) & 0x000F000F, as bf16 128 + level in each half
__device__ __forceinline__ unsigned levels_128(unsigned word) {
  unsigned out;
  asm("lop3.b32 %0, %1, %2, %3, %4;\n"
      : "=r"(out)
      : "r"(word), "r"(0x000F000Fu), "r"(0x43004300u), "n"((0xF0 & 0xCC) | 0xAA));
  return out;
}

__device__ __forceinline__ unsigned weights(unsigned v, __nv_bfloat162 scale,
                                            __nv_bfloat162 shift) {
  const __nv_bfloat162 bias = __floats2bfloat162_rn(128.f, 128.f);
  __nv_bfloat162 w = __hfma2(__hsub2(*reinterpret_cast<__nv_bfloat162*>(&v), bias), scale,
                             shift);
  return *reinterpret_cast<unsigned*>(&w);
}

__device__ __forceinline__ void mma(float* d, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Weights, scales and shifts are stored in panels of 32 columns, each panel's rows in turn
// ([N / 32, rows, 32]), so that a block streams long runs of its own bytes
constexpr int PANEL = 32;
__device__ __forceinline__ size_t panel_at(int col, int row, int rows) {
  return ((size_t)(col / PANEL) * rows + row) * PANEL + col % PANEL;
}

template <int BATCH_TILES, int M_TILES, int WARPS_N, int WARPS_K, int STAGES>
struct Tile {
  static constexpr int ROWS = 8 * BATCH_TILES;
  static constexpr int BN = 16 * M_TILES * WARPS_N;
  static constexpr int THREADS = 32 * WARPS_N * WARPS_K;
  static constexpr int WORD_ROWS = CHUNK_WORDS * WARPS_K;
  static constexpr int WORD_STRIDE = BN + WORD_PAD;
  static constexpr int META_ROWS = 4 * WARPS_K;  // groups a stage holds, at most (group 32)
  static constexpr int X_STRIDE = CHUNK * WARPS_K + X_PAD;
  static constexpr int WORDS_BYTES = WORD_ROWS * WORD_STRIDE * 4;
  static constexpr int META_BYTES = META_ROWS * BN * 2;
  static constexpr int X_BYTES = ROWS * X_STRIDE * 2;
  static constexpr int STAGE_BYTES = WORDS_BYTES + 2 * META_BYTES + X_BYTES;
  static constexpr int SUM_BYTES = WARPS_K * ROWS * BN * 4;
  static constexpr int SMEM = STAGE_BYTES * STAGES > SUM_BYTES ? STAGE_BYTES * STAGES
                                                                : SUM_BYTES;
  static_assert(BN % 32 == 0, "the words' bank layout needs 32 columns a block");
};

struct Args {
  const __nv_bfloat16* x;
  const unsigned* words;
  const __nv_bfloat16* scales;
  const __nv_bfloat16* shifts;
  __nv_bfloat16* out;
  float* partials;
  int* counters;
  int M, N, K, group, iters, splits;  // iters: stages a block, whole (the host checks)
  bool dependent;  // launched as a programmatic dependent of the kernel before
};

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <int BATCH_TILES, int M_TILES, int WARPS_N, int WARPS_K, int STAGES>
__global__ void __launch_bounds__(32 * WARPS_N * WARPS_K)
    w4a16_kernel(const Args args) {
  using T = Tile<BATCH_TILES, M_TILES, WARPS_N, WARPS_K, STAGES>;
  // Up to 16 rows the levels go into the tensor cores as they are (128 + level) and each
  // group's sums are scaled after, in float32: scale * sum((128 + level) x) + (shift - 128
  // scale) * sum(x), sum(x) from one more mma against ones. That takes the two half-
  // precision ops a pair of weights off the ALUs, which bound the kernel at few rows. From
  // 17 rows the mma's own throughput bounds it, and a group's three sums a tile would
  // not fit the registers: the weights are made in bf16 first.
  constexpr bool FOLD = BATCH_TILES <= 2;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wn = warp % WARPS_N, wk = warp / WARPS_N;
  const int g = lane / 4, c = lane % 4;
  const int n0 = blockIdx.x * T::BN, split = blockIdx.y;
  const int first = split * args.iters * WARPS_K;  // the split's first chunk
  const int groups_per_chunk = CHUNK / args.group;  // 1, 2 or 4

  // Each thread's copies of a stage. The host splits the inputs into whole stages and the
  // columns into whole blocks, so only rows of x past M are zero-filled; stage `it` lies
  // `it` strides on from the first.
  constexpr int WORD_COPIES = T::WORD_ROWS * T::BN / 4 / T::THREADS;
  constexpr int WORD_ROW_STEP = T::THREADS / (T::BN / 4);  // rows between a thread's copies
  constexpr int X_COPIES = T::ROWS * WARPS_K * CHUNK / 8 / T::THREADS;
  constexpr int X_ROW_STEP = T::THREADS / (WARPS_K * CHUNK / 8);
  static_assert(WORD_COPIES * T::THREADS == T::WORD_ROWS * T::BN / 4 &&
                    T::THREADS % (T::BN / 4) == 0 &&
                    X_COPIES * T::THREADS == T::ROWS * WARPS_K * CHUNK / 8 &&
                    T::THREADS % (WARPS_K * CHUNK / 8) == 0 &&
                    2 * 4 * WARPS_K * T::BN / 8 <= T::THREADS,
                "a stage's copies must spread evenly over the threads");
  const int word_row = tid / (T::BN / 4), word_col = tid % (T::BN / 4) * 4;
  const unsigned* word_src =
      args.words + panel_at(n0 + word_col, first * CHUNK_WORDS + word_row, args.K / 8);
  const int word_dst = word_row * T::WORD_STRIDE + word_col;
  const int x_row = tid / (WARPS_K * CHUNK / 8), x_col = tid % (WARPS_K * CHUNK / 8) * 8;
  const __nv_bfloat16* x_src = args.x + (size_t)x_row * args.K + first * CHUNK + x_col;
  const int x_dst = x_row * T::X_STRIDE + x_col;
  // scales, then shifts: groups_per_chunk rows a chunk, one copy a thread at most
  const int meta_rows = WARPS_K * groups_per_chunk, meta_copies = meta_rows * T::BN / 8;
  const bool meta_copier = tid < 2 * meta_copies;
  const int meta_which = tid / meta_copies, meta_j = tid % meta_copies;
  const int meta_row = meta_j / (T::BN / 8), meta_col = meta_j % (T::BN / 8) * 8;
  const __nv_bfloat16* meta_src =
      (meta_which ? args.shifts : args.scales) +
      (meta_copier ? panel_at(n0 + meta_col, first * groups_per_chunk + meta_row,
                              args.K / args.group) : 0);
  const int meta_dst = T::WORDS_BYTES / 2 + meta_which * T::META_BYTES / 2 +
                       meta_row * T::BN + meta_col;  // in bf16s from the stage

  // Each block walks its inputs from its own stage on (blockIdx.x % iters, wrapping round),
  // so that blocks side by side do not all read the same offset of their panels at once
  // (2-10 % faster a call, docs/kernels.md). Weights and x are loaded apart: with a
  // dependent launch the first stages' weights are read before the kernel before has ended.
  const int x_valid = args.M > x_row ? (args.M - x_row + X_ROW_STEP - 1) / X_ROW_STEP : 0;
  int weight_stage = blockIdx.x % args.iters, x_stage = weight_stage;
  int weights_loaded = 0, x_loaded = 0;
  auto load_weights = [&](int s) {  // s: a constant once the loops unroll
    if (weights_loaded++ >= args.iters) return;
    unsigned char* stage = smem + s * T::STAGE_BYTES;
    unsigned* w = reinterpret_cast<unsigned*>(stage) + word_dst;
    const unsigned* src = word_src + (size_t)weight_stage * WARPS_K * CHUNK_WORDS * PANEL;
#pragma unroll
    for (int j = 0; j < WORD_COPIES; ++j)
      cp_async16(w + j * WORD_ROW_STEP * T::WORD_STRIDE, src + j * WORD_ROW_STEP * PANEL, true);
    if (meta_copier)
      cp_async16(reinterpret_cast<__nv_bfloat16*>(stage) + meta_dst,
                 meta_src + (size_t)weight_stage * meta_rows * PANEL, true);
    if (++weight_stage == args.iters) weight_stage = 0;
  };
  auto load_x = [&](int s) {
    if (x_loaded++ >= args.iters) return;
    __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem + s * T::STAGE_BYTES +
                                                         T::WORDS_BYTES + 2 * T::META_BYTES) +
                        x_dst;
    const __nv_bfloat16* src = x_src + x_stage * WARPS_K * CHUNK;
#pragma unroll
    for (int j = 0; j < X_COPIES; ++j) {
      bool valid = j < x_valid;
      cp_async16(xs + j * X_ROW_STEP * T::X_STRIDE,
                 valid ? src + (size_t)j * X_ROW_STEP * args.K : args.x, valid);
    }
    if (++x_stage == args.iters) x_stage = 0;
  };

  int meta_q[4];  // each quarter's group row in a chunk's scales
#pragma unroll
  for (int q = 0; q < 4; ++q) meta_q[q] = 32 * q / args.group * T::BN;
  const unsigned group_ends = args.group / 32 - 1;  // a group ends after quarter q: (q+1) & this == 0

  // part and xsum: a group's sums, one chain of mmas each half (h), so that two chains
  // of dependent mmas run side by side
  float acc[M_TILES][BATCH_TILES][4], part[2][M_TILES][BATCH_TILES][4], xsum[2][BATCH_TILES][4];
#pragma unroll
  for (int t = 0; t < M_TILES; ++t)
#pragma unroll
    for (int b = 0; b < BATCH_TILES; ++b)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        acc[t][b][i] = part[0][t][b][i] = part[1][t][b][i] = xsum[0][b][i] = xsum[1][b][i] = 0.f;
  const unsigned ones[4] = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};

  // this warp's columns and chunk in a stage
  const int word_at = (wk * CHUNK_WORDS + c) * T::WORD_STRIDE + wn * 16 * M_TILES + g;
  const int meta_at = T::WORDS_BYTES / 2 + wk * groups_per_chunk * T::BN + wn * 16 * M_TILES + g;
  const int x_at = (T::WORDS_BYTES + 2 * T::META_BYTES) / 2 + wk * CHUNK + 8 * c;

  // The first stages: weights, then (after the kernel before, where launched dependent) x,
  // a commit group each stage, the first holding every weight copy.
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) load_weights(s);
  if (args.dependent) wait_for_inputs();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    load_x(s);
    cp_async_commit();
  }
  for (int it0 = 0; it0 < args.iters; it0 += STAGES)
#pragma unroll
  for (int s = 0; s < STAGES; ++s) {
    if (it0 + s >= args.iters) break;
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    load_weights((s + STAGES - 1) % STAGES);
    load_x((s + STAGES - 1) % STAGES);
    cp_async_commit();
    unsigned char* stage = smem + s * T::STAGE_BYTES;
    const unsigned* w = reinterpret_cast<const unsigned*>(stage) + word_at;
    const __nv_bfloat16* sc = reinterpret_cast<const __nv_bfloat16*>(stage) + meta_at;
    const __nv_bfloat16* sh = sc + T::META_BYTES / 2;
    const __nv_bfloat16* xs = reinterpret_cast<const __nv_bfloat16*>(stage) + x_at;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int meta = meta_q[q];
      unsigned a[M_TILES][2][4];  // [tile][h][mma register]
#pragma unroll
      for (int t = 0; t < M_TILES; ++t) {
        unsigned lo = w[4 * q * T::WORD_STRIDE + 16 * t];
        unsigned hi = w[4 * q * T::WORD_STRIDE + 16 * t + 8];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          // registers: (column g, inputs +0 +1), (g + 8, +0 +1), (g, +2 +3), (g + 8, +2 +3)
          a[t][h][0] = levels_128(lo >> (8 * h));
          a[t][h][1] = levels_128(hi >> (8 * h));
          a[t][h][2] = levels_128(lo >> (8 * h + 4));
          a[t][h][3] = levels_128(hi >> (8 * h + 4));
        }
        if constexpr (!FOLD) {
          __nv_bfloat162 s_lo = __bfloat162bfloat162(sc[meta + 16 * t]);
          __nv_bfloat162 z_lo = __bfloat162bfloat162(sh[meta + 16 * t]);
          __nv_bfloat162 s_hi = __bfloat162bfloat162(sc[meta + 16 * t + 8]);
          __nv_bfloat162 z_hi = __bfloat162bfloat162(sh[meta + 16 * t + 8]);
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int r = 0; r < 4; ++r)
              a[t][h][r] = weights(a[t][h][r], r % 2 ? s_hi : s_lo, r % 2 ? z_hi : z_lo);
        }
      }
#pragma unroll
      for (int b = 0; b < BATCH_TILES; ++b) {
        // row 8b + g's inputs 8(c + 4q) .. + 7: halves h = 0 and 1
        uint4 xv = *reinterpret_cast<const uint4*>(xs + (8 * b + g) * T::X_STRIDE + 32 * q);
#pragma unroll
        for (int t = 0; t < M_TILES; ++t) {
          mma(FOLD ? part[0][t][b] : acc[t][b], a[t][0], xv.x, xv.y);
          mma(FOLD ? part[1][t][b] : acc[t][b], a[t][1], xv.z, xv.w);
        }
        if constexpr (FOLD) {
          mma(xsum[0][b], ones, xv.x, xv.y);
          mma(xsum[1][b], ones, xv.z, xv.w);
        }
      }
      if constexpr (FOLD) {
        if (((q + 1) & group_ends) == 0) {  // the group ends: scale its sums into acc
          float xs_sum[BATCH_TILES][2];  // rows 2c and 2c + 1
#pragma unroll
          for (int b = 0; b < BATCH_TILES; ++b)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              xs_sum[b][i] = xsum[0][b][i] + xsum[1][b][i];
              xsum[0][b][i] = xsum[1][b][i] = xsum[0][b][i + 2] = xsum[1][b][i + 2] = 0.f;
            }
#pragma unroll
          for (int t = 0; t < M_TILES; ++t) {
            float scale[2], bias[2];  // columns g and g + 8
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              scale[e] = to_float(sc[meta + 16 * t + 8 * e]);
              bias[e] = to_float(sh[meta + 16 * t + 8 * e]) - 128.f * scale[e];
            }
#pragma unroll
            for (int b = 0; b < BATCH_TILES; ++b)
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                float v = fmaf(scale[i / 2], part[0][t][b][i], acc[t][b][i]);
                v = fmaf(scale[i / 2], part[1][t][b][i], v);
                acc[t][b][i] = fmaf(bias[i / 2], xs_sum[b][i % 2], v);
                part[0][t][b][i] = part[1][t][b][i] = 0.f;
              }
          }
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // warps of one column range add up in shared memory: sums [WARPS_K][ROWS][BN]
  float* sums = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int t = 0; t < M_TILES; ++t)
#pragma unroll
    for (int b = 0; b < BATCH_TILES; ++b)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        int col = wn * 16 * M_TILES + 16 * t + g + 8 * (i / 2);
        int row = 8 * b + 2 * c + i % 2;
        sums[(wk * T::ROWS + row) * T::BN + col] = acc[t][b][i];
      }
  __syncthreads();
  const bool whole = args.splits == 1;
  for (int i = tid; i < args.M * T::BN; i += T::THREADS) {
    int row = i / T::BN, col = i % T::BN;
    float v = 0.f;
#pragma unroll
    for (int k = 0; k < WARPS_K; ++k) v += sums[(k * T::ROWS + row) * T::BN + col];
    size_t at = (size_t)row * args.N + n0 + col;
    if (whole)
      args.out[at] = __float2bfloat16(v);
    else
      args.partials[(size_t)split * args.M * args.N + at] = v;
  }
  if (whole) return;
  __threadfence();
  __syncthreads();
  __shared__ bool last_block;
  if (tid == 0) last_block = atomicAdd(args.counters + blockIdx.x, 1) == args.splits - 1;
  __syncthreads();
  if (!last_block) return;
  __threadfence();
  for (int i = tid; i < args.M * T::BN; i += T::THREADS) {
    int row = i / T::BN, col = i % T::BN;
    size_t at = (size_t)row * args.N + n0 + col;
    float v = 0.f;
    for (int k = 0; k < args.splits; ++k)
      v += __ldcg(args.partials + (size_t)k * args.M * args.N + at);
    args.out[at] = __float2bfloat16(v);
  }
  if (tid == 0) args.counters[blockIdx.x] = 0;
}

// The shapes of a block (`config` in int4_mma.py): M_TILES, WARPS_N, WARPS_K
constexpr int MAX_SMEM = 227 * 1024;  // a block's shared memory on Hopper and Ampere

template <int BATCH_TILES, int M_TILES, int WARPS_N, int WARPS_K>
void launch(Args args, cudaStream_t stream) {
  constexpr int BN = 16 * M_TILES * WARPS_N;
  TORCH_CHECK(args.N % BN == 0 && args.K / CHUNK % (args.splits * WARPS_K) == 0,
              "int4 mm: config takes ", BN, " columns a block and ", WARPS_K * CHUNK,
              " inputs a stage; N ", args.N, ", K ", args.K, ", splits ", args.splits);
  args.iters = args.K / CHUNK / (args.splits * WARPS_K);
  // four stages, fewer where x's rows make a stage too large (64 rows, 512 inputs: two)
  constexpr int STAGE_BYTES = Tile<BATCH_TILES, M_TILES, WARPS_N, WARPS_K, 1>::STAGE_BYTES;
  constexpr int STAGES = MAX_SMEM / STAGE_BYTES < 4 ? MAX_SMEM / STAGE_BYTES : 4;
  static_assert(STAGES >= 2, "a stage too large for two in shared memory");
  using T = Tile<BATCH_TILES, M_TILES, WARPS_N, WARPS_K, STAGES>;
  auto kernel = w4a16_kernel<BATCH_TILES, M_TILES, WARPS_N, WARPS_K, STAGES>;
  static unsigned long long sized = 0;  // a bit a device: shared memory past 48 KB asked for
  int device;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (!(sized >> device & 1)) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        T::SMEM));
    sized |= 1ull << device;
  }
  cudaLaunchConfig_t launch{dim3(args.N / T::BN, args.splits), dim3(T::THREADS), T::SMEM, stream};
  cudaLaunchAttribute dependent;
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  launch.attrs = &dependent;
  launch.numAttrs = args.dependent ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&launch, kernel, args));
}

template <int BATCH_TILES>
void launch_config(int64_t config, const Args& args, cudaStream_t stream) {
  switch (config) {
    case 0: return launch<BATCH_TILES, 2, 4, 2>(args, stream);  // 128 columns, 256 inputs
    case 1: return launch<BATCH_TILES, 2, 2, 4>(args, stream);  // 64 columns, 512 inputs
    case 2: return launch<BATCH_TILES, 1, 2, 4>(args, stream);  // 32 columns, 512 inputs
    case 3: return launch<BATCH_TILES, 2, 4, 1>(args, stream);  // 128 columns, 128 inputs
    case 4: return launch<BATCH_TILES, 1, 2, 1>(args, stream);  // 32 columns, 128 inputs
    default: TORCH_CHECK(false, "int4 mma: no block config ", config);
  }
}

at::Tensor mm(const at::Tensor& x, const at::Tensor& words, const at::Tensor& scales,
              const at::Tensor& shifts, const at::Tensor& partials, const at::Tensor& counters,
              int64_t config, int64_t splits, bool dependent) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "int4 mm: x must be contiguous bf16 [M, K]");
  TORCH_CHECK(words.is_contiguous() && scales.is_contiguous() && shifts.is_contiguous(),
              "int4 mm: words, scales and shifts must be contiguous");
  const int M = x.size(0), K = x.size(1), N = words.size(0) * PANEL;
  TORCH_CHECK(words.dim() == 3 && words.size(1) * 8 == K && words.size(2) == PANEL &&
                  K % CHUNK == 0,
              "int4 mm: words must be [N / 32, K / 8, 32], K a multiple of 128");
  TORCH_CHECK(scales.dim() == 3 && scales.sizes() == shifts.sizes() &&
                  scales.size(0) * PANEL == N,
              "int4 mm: scales and shifts must be [N / 32, K / group, 32]");
  const int group = K / scales.size(1);
  TORCH_CHECK(group == 32 || group == 64 || group == 128, "int4 mm: groups of 32, 64 or 128");
  TORCH_CHECK(M >= 1 && M <= 64, "int4 mm: 1 to 64 rows");
  for (const at::Tensor* t : {&x, &words, &scales, &shifts})
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
                "int4 mm: tensors must start on 16 bytes");
  TORCH_CHECK(splits == 1 || partials.numel() >= splits * M * N,
              "int4 mm: partials too small for ", splits, " splits");
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({M, N}, x.options());
  Args args{reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()),
            reinterpret_cast<const unsigned*>(words.data_ptr()),
            reinterpret_cast<const __nv_bfloat16*>(scales.data_ptr()),
            reinterpret_cast<const __nv_bfloat16*>(shifts.data_ptr()),
            reinterpret_cast<__nv_bfloat16*>(out.data_ptr()),
            partials.data_ptr<float>(), counters.data_ptr<int>(),
            M, N, K, group, 0, static_cast<int>(splits), dependent};
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (M <= 8) launch_config<1>(config, args, stream);
  else if (M <= 16) launch_config<2>(config, args, stream);
  else if (M <= 32) launch_config<4>(config, args, stream);
  else launch_config<8>(config, args, stream);
  return out;
}

}  // namespace

TORCH_LIBRARY(roseinfer_int4, lib) {
  lib.def("mm(Tensor x, Tensor words, Tensor scales, Tensor shifts, Tensor partials, "
          "Tensor counters, int config, int splits, bool dependent) -> Tensor");
}

TORCH_LIBRARY_IMPL(roseinfer_int4, CUDA, lib) { lib.impl("mm", &mm); }
