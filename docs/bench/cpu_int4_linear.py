"""One row through SmolLM2-135M's linear shapes on the CPU: float32 and bfloat16
F.linear against torch's own 4-bit kernel (``_weight_int4pack_mm_for_cpu``, groups of 32
with a scale and a zero each, the layout GGUF's Q4_1 maps onto), on the threads torch
uses; microseconds per call (mean of 200 after 10), and the 4-bit result's largest error
against the float32 product of the same 4-bit weights.

    python3 docs/bench/cpu_int4_linear.py
"""
import time

import torch
import torch.nn.functional as F

GROUP = 32
SHAPES = [(576, 1536), (1536, 576), (576, 1728), (576, 49152)]  # gate/up, down, qkv, head


def micros(fn, n: int = 200) -> float:
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def four_bit(w: torch.Tensor):
    """(codes 0..15, scale, min) per group of GROUP along the input dimension."""
    n, k = w.shape
    groups = w.view(n, k // GROUP, GROUP)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = (high - low).clamp(min=1e-8) / 15
    codes = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32).view(n, k)
    return codes, scale, low


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    for k, n in SHAPES:
        x, w = torch.randn(1, k), torch.randn(n, k)
        fp32 = micros(lambda: F.linear(x, w))
        xb, wb = x.bfloat16(), w.bfloat16()
        bf16 = micros(lambda: F.linear(xb, wb))
        codes, scale, low = four_bit(w)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        # the kernel's weight is (code - 8) * scale + zero: zero = low + 8 * scale
        scales_zeros = torch.stack([scale.view(n, -1).t(), (low + 8 * scale).view(n, -1).t()],
                                   -1).contiguous()
        run = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP,  # noqa: E731
                                                                 scales_zeros)
        int4 = micros(run)
        exact = F.linear(x, (codes.view(n, k // GROUP, GROUP) * scale + low).view(n, k))
        print(f"{k:5d} -> {n:5d}: float32 {fp32:8.1f} us, bfloat16 {bf16:8.1f} us, "
              f"int4pack {int4:8.1f} us ({int4 / fp32:.1f}x float32), "
              f"max error {(run() - exact).abs().max().item():.1e}", flush=True)


if __name__ == "__main__":
    main()
