"""W4A16 linear candidates on the Llama-3-8B shapes (one GPU), per row count, ms per
call over 8 copies of the weight in one CUDA graph (weights from memory, as in a decode
step), groups of 128 with a zero point each (as AWQ's):

- bf16: cuBLAS, and the skinny kernel up to 16 rows (the unquantized baseline);
- torch's int4 kernel (tinygemm, ``torch._weight_int4pack_mm``, its own packing);
- GemLite's kernels, each type, with its H100-tuned configs;
- ``unpack`` then cuBLAS: the weight de-quantized into a bf16 buffer, then multiplied;
- ``layer``: layers/int4_linear.py's Int4Linear as it runs (its choice per row count);
- fbgemm-gpu-genai's CUTLASS mixed-input GEMM, where it imports: ``bf16i4bf16_shuffled``
  (the weight pre-shuffled for the tensor cores);
- optimum-quanto's Marlin kernel, where it imports (built with nvcc at its first call):
  float16 activations only, so each call includes x's cast to float16 and y's back.

Each candidate's error against the float64 product is recorded at 16 rows (``err_*``:
the largest difference over the largest magnitude).

Usage: python docs/bench/int4_linears.py [--output-json F]
"""
import torch
import torch.nn.functional as F
from torch import nn

from linear_shapes import COPIES, per_call, run
from roseinfer.layers.fp8_linear import fbgemm_rowwise
from roseinfer.layers.int4_linear import dequantize, quantize, to_int4, unpack
from roseinfer.layers.skinny_linear import skinny_linear

GROUP = 128
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512, 2048)
GEMV = ("GEMV", "GEMV_REVSPLITK", "GEMV_SPLITK")


def tinygemm_pack(levels, scales, zeros):
    """tinygemm's packing (inner K tiles 8) and (scale, zero) table: it computes
    (level - 8) * scale + zero."""
    two_a_byte = (levels[:, ::2] << 4 | levels[:, 1::2]).to(torch.uint8)
    packed = torch._convert_weight_to_int4pack(two_a_byte, 8)
    table = torch.stack([scales, (8 - zeros) * scales], -1).bfloat16()
    return packed, table.transpose(0, 1).contiguous()


def fbgemm_ops():
    """fbgemm-gpu-genai's ops, loaded as the FP8 layer loads them, or None where they
    do not load here."""
    return torch.ops.fbgemm if fbgemm_rowwise(torch.device("cuda")) else None


def fbgemm_pack(ops, levels, scales, zeros):
    """fbgemm's (levels - 8) two a byte along K, pre-shuffled, and its per-group scale and
    zero [K / group, N]: it computes (level - 8) * scale + zero, zero = (8 - our zero) *
    scale."""
    q = (levels - 8).to(torch.int8)
    packed = (q[:, ::2] & 0xF) | (q[:, 1::2] << 4)
    zero = ((8 - zeros) * scales).t().contiguous().bfloat16()
    shuffled, shuffled_scale = ops.preshuffle_i4(packed, scales.t().contiguous().bfloat16())
    return shuffled, shuffled_scale, zero


def quanto_marlin():
    """optimum-quanto's Marlin packing and permutation, with its CUDA ops registered, or
    None where it does not import."""
    try:
        from optimum.quanto.library.extensions import cuda  # registers torch.ops.quanto
        from optimum.quanto.tensor.weights.marlin.int4.packed import pack
        from optimum.quanto.tensor.weights.marlin.permutations import marlin_permute
        cuda.ext.lib  # builds the kernels here, not inside the first timed call
        return pack, marlin_permute
    except Exception as e:  # not installed
        print("optimum-quanto:", repr(e)[:200])
        return None


def marlin_pack(quanto, levels, scales, zeros):
    """Marlin's words of the levels, and its permuted float16 scales and shifts [K /
    group, N] (it computes level * scale + shift, shift = -zero * scale), and a
    workspace."""
    pack, permute = quanto
    shift = -(zeros * scales)
    return (pack(levels.to(torch.uint8)), permute(scales.t().contiguous().half()),
            permute(shift.t().contiguous().half()),
            torch.zeros(levels.shape[0] // 128 * 16, dtype=torch.int32, device=levels.device))


def marlin(x, packed):
    return torch.ops.quanto.gemm_f16i4_marlin(x.half(), *packed).to(x.dtype)


def error(y, x, levels, scales, zeros):
    ref = x.double() @ dequantize(levels, scales, zeros).double().t()
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


def weights(n, k):
    """The generator that made them (the inputs come from it next), COPIES random bf16
    weights [n, k], their levels and scales, and a zero per group (4-11, as AWQ's)."""
    gen = torch.Generator("cuda").manual_seed(n + k)
    w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5
           for _ in range(COPIES)]
    quants = [quantize(w, GROUP) for w in w16]
    zeros = [torch.randint(4, 12, s.shape, device="cuda", generator=gen).float()
             for _, s in quants]
    return gen, w16, quants, zeros


def measure(n, k):
    gen, w16, quants, zeros = weights(n, k)
    tiny = [tinygemm_pack(lv, s, z) for (lv, s), z in zip(quants, zeros)]
    layers = []
    for (lv, s), z in zip(quants, zeros):
        layers.append(nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
        to_int4(layers[-1], lv, s, z)
    lite = [m.kernel for m in layers]
    ops = fbgemm_ops()
    fb = [fbgemm_pack(ops, lv, s, z) for (lv, s), z in zip(quants, zeros)] if ops else []
    quanto = quanto_marlin()
    mq = [marlin_pack(quanto, lv, s, z) for (lv, s), z in zip(quants, zeros)] if quanto else []
    row = {"int4_floor_ms": (n * k / 2 + 2 * n * k / GROUP * 2) / 3.0e9,
           "bf16_floor_ms": 2 * n * k / 3.0e9}
    buf = torch.empty(k, n, device="cuda", dtype=torch.bfloat16)
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        row[f"bf16_cublas_m{m}"] = per_call(lambda i: F.linear(x, w16[i]))
        if m <= 16:
            row[f"bf16_skinny_m{m}"] = per_call(lambda i: skinny_linear(x, w16[i]))
        row[f"tinygemm_m{m}"] = per_call(
            lambda i: torch._weight_int4pack_mm(x, tiny[i][0], GROUP, tiny[i][1]))
        types = (GEMV if m <= 4 else ()) + (("GEMM_SPLITK",) if m <= 64 else ()) + \
            (("GEMM",) if m >= 16 else ())
        for t in types:
            row[f"gemlite_{t}_m{m}"] = per_call(lambda i: lite[i].forward_manual(x, t))
        if m >= 16:
            row[f"unpack_cublas_m{m}"] = per_call(
                lambda i: x @ unpack(lite[i].W_q, lite[i].scales, lite[i].zeros, buf))
        row[f"layer_m{m}"] = per_call(lambda i: layers[i](x))
        if fb:
            op = ops.bf16i4bf16_shuffled
            row[f"fbgemm_shuffled_m{m}"] = per_call(lambda i: op(x, *fb[i]))
            if m == 16:
                row["err_fbgemm_shuffled"] = error(op(x, *fb[0]), x, *quants[0], zeros[0])
        if mq:
            row[f"marlin_m{m}"] = per_call(lambda i: marlin(x, mq[i]))
            if m == 16:
                row["err_marlin"] = error(marlin(x, mq[0]), x, *quants[0], zeros[0])
        if m == 16:
            row["err_layer"] = error(layers[0](x), x, *quants[0], zeros[0])
    row["unpack_only"] = per_call(lambda i: unpack(lite[i].W_q, lite[i].scales, lite[i].zeros,
                                                   buf))
    return row


if __name__ == "__main__":
    run(measure)
