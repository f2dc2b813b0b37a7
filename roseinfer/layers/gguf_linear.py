"""Linears that keep a GGUF file's quantized blocks and multiply them as stored, on the
CPU (``cpu_weight_dtype="gguf"``).

A batch-1 step reads every weight once, so its time follows the weights' bytes: Q4_1
holds 5 bits a weight where the de-quantized float32 model holds 32. The kernel
(``gguf_blocks.cpp``, built on this machine by torch's ``cpp_extension`` into the cache,
once) rounds each row of x to int8 per block of 32, as llama.cpp does, and takes each
block's product as one integer dot (AVX-512 VNNI where the CPU has it, else AVX2). From
``DOT_ROWS`` rows up (prompts) the weight is de-quantized into a GEMM instead: the integer
dots do each row's work again, and oneDNN's GEMM reuses a weight tile across rows; in
bfloat16 where the CPU has oneDNN's bfloat16 kernels, so prompts see the weights and x
rounded to bfloat16, as decode sees x rounded to int8 (docs/kernels.md, "GGUF blocks on
the CPU").

Kinds: ggml's type numbers, Q4_0 (2), Q4_1 (3) and Q8_0 (8), and Q4_K, Q5_K, Q6_K, Q5_0
and Q5_1 repacked at load into blocks of 32 that hold the same values (100 and 101,
layers/gguf_repack.py). Other tensors of the file (float ones) stay in the
de-quantized float32 model.
"""
from __future__ import annotations

import functools
import logging
import platform
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gguf_blocks.cpp")
HEADERS = tuple(Path(__file__).with_name(h) for h in ("gguf_common.h", "gguf_interleaved.h"))
# 32 weights a block: Q4_0, Q4_1, Q8_0, and the kinds repacked at load (layers/gguf_repack.py)
BLOCK_BYTES = {2: 18, 3: 20, 8: 34, 100: 24, 101: 44, 102: 20, 103: 34, 104: 18, 105: 24}
Q4_0, Q4_1, Q8_0, F32_Q4 = 2, 3, 8, 100
# the kinds regrouped by sixteen rows at load, and each one's scale fields (bytes a row)
INTERLEAVED = {Q4_1: 102, Q8_0: 103, Q4_0: 104, F32_Q4: 105}
SCALE_FIELDS = {Q4_1: (2, 2), Q8_0: (2,), Q4_0: (2,), F32_Q4: (4, 4)}
# Rows from which a GEMM over the de-quantized weight is faster than the integer dots (each
# row's dots are its own work): bfloat16 in oneDNN's packed layout where the CPU has its
# kernels (3.1x float32's F.linear at 512 rows of ffn_gate, weight reorder included),
# else float32 (docs/kernels.md, "GGUF blocks on the CPU").
DOT_ROWS = 32
BF16_GEMM = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
# at::parallel_for spreads a call's rows over torch's threads only where the kernels are
# compiled with OpenMP (as torch is): without it every call ran on one thread
OPENMP = ("-fopenmp",) if torch.backends.openmp.is_available() else ()
NATIVE = ("-O3", "-march=native", *OPENMP)
_built: dict[tuple[str, ...], object] = {}
# The kinds each form of the kernels (the build's ``form()``: 2 AVX-512 VNNI, 1 AVX2, 0
# plain C++) reads over sixteen interleaved rows faster than as stored (docs/kernels.md,
# "Sixteen rows interleaved"); the plain form reads them for the tests only
INTERLEAVES = {2: (Q4_0, Q4_1, Q8_0, F32_Q4), 1: (Q4_0, Q4_1, F32_Q4), 0: ()}


def _cpu() -> str:
    """The CPU the kernels are built for (-march=native): its model and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


def build(flags: tuple[str, ...] = NATIVE, namespace: str = "roseinfer_gguf"):
    """Builds the kernels for this CPU (20-30 s, once: kept under the cache, keyed by the
    source, the flags, torch and the CPU), loads them and returns their ops
    (``torch.ops.<namespace>``: ``mm`` and ``dequantize``); later calls in the process
    return at once. ``namespace``: another build's (other ``flags``) beside the default
    one. Raises RuntimeError where no C++ compiler or ninja can build them."""
    key = (*flags, namespace)
    if key not in _built:
        _built[key] = _load(flags, namespace)
    return _built[key]


def _load(flags: tuple[str, ...], namespace: str):
    from roseinfer.layers.extensions import build_library

    try:
        return build_library(SOURCE, namespace, (*flags, f"-DGGUF_NS={namespace}"), _cpu(),
                             "the GGUF block kernels", headers=HEADERS)
    except RuntimeError as e:
        raise RuntimeError(f"{e}; install a C++ compiler, or use cpu_weight_dtype "
                           "float32") from e


class GgufLinear(nn.Module):
    """A linear whose weight is GGUF blocks ([N, K / 32 * block bytes], uint8) of ``kind``;
    float32 in and out, as the float32 model's linears."""

    def __init__(self, blocks: torch.Tensor, kind: int, in_features: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        if kind not in BLOCK_BYTES:
            raise ValueError(f"GGUF kind {kind} is not one of {sorted(BLOCK_BYTES)}")
        if blocks.shape[0] % 16 == 0 and kind in interleaves():
            kind, blocks = INTERLEAVED[kind], interleave(kind, blocks)
        self.kind, self.in_features, self.out_features = kind, in_features, blocks.shape[0]
        self.register_buffer("blocks", blocks.contiguous())
        self.bias = bias

    def weight(self) -> torch.Tensor:
        """The de-quantized weight, float32 [N, K]."""
        return torch.ops.roseinfer_gguf.dequantize(self.blocks, self.kind, self.in_features)

    def forward(self, x: torch.Tensor, gelu: str | None = None) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        rows = flat.shape[0]
        if rows < DOT_ROWS:
            out = torch.ops.roseinfer_gguf.mm(flat, self.blocks, self.kind)
            if self.bias is not None:
                out = out + self.bias
        elif BF16_GEMM:
            weight = torch.ops.mkldnn._reorder_linear_weight(self.weight().bfloat16(), rows)
            out = torch.ops.mkldnn._linear_pointwise(flat.bfloat16(), weight, None, "none",
                                                     [], "").float()
            if self.bias is not None:
                out = out + self.bias
        else:
            out = F.linear(flat, self.weight(), self.bias)
        out = out.view(*x.shape[:-1], self.out_features)
        return out if gelu is None else F.gelu(out, approximate=gelu)


@functools.cache
def interleaves() -> tuple[int, ...]:
    """The kinds this CPU's build reads faster as sixteen interleaved rows."""
    return INTERLEAVES[build().form()]


def interleave(kind: int, blocks: torch.Tensor) -> torch.Tensor:
    """Rows of ``kind`` (a key of INTERLEAVED) [N, K / 32 * bytes], N a multiple of 16, as
    INTERLEAVED[kind] holds them, the same shape: per group of 16 rows and block, each of
    the rows' scale fields in turn (16 d, then Q4_1's and kind 100's 16 m), then their
    weight bytes four at a time, the j-th 64 bytes holding each row's bytes 4j .. 4j + 3;
    Q8_0's plus 128, as u8 (gguf_common.h)."""
    n, width = blocks.shape
    size, fields = BLOCK_BYTES[kind], SCALE_FIELDS[kind]
    nb = width // size
    g = blocks.reshape(n // 16, 16, nb, size).permute(0, 2, 1, 3)         # [G, nb, 16, size]
    starts = [sum(fields[:i]) for i in range(len(fields))]
    levels = g[..., sum(fields):]
    if kind == Q8_0:
        levels = levels ^ 0x80
    levels = levels.reshape(n // 16, nb, 16, -1, 4).transpose(2, 3)     # [G, nb, j, 16, 4]
    parts = [g[..., a:a + f] for a, f in zip(starts, fields)] + [levels]
    return torch.cat([p.reshape(n // 16, nb, -1) for p in parts], -1).reshape(n, width)


def quantize_rows_like_kernel(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: each block of 32 rounded to int8 steps of its absmax / 127
    (float32, the same shape). The reference the tests hold the kernel to."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, blocks / d, torch.zeros_like(blocks)).round()
    return (q * d).reshape(x.shape)
