"""FP8 linears on CUDA (W8A8, dynamic): e4m3 weights with one scale per output channel
stay FP8 in GPU memory, and each input row is rounded to e4m3 with a scale of its own
(its largest magnitude maps to 448), as vLLM's ``--quantization fp8`` computes.

The input's rows are rounded first, by one small kernel (one program a row), or already
by the kernel that made them (``QuantizedRows`` from an RMSNorm or SwiGLU, layers/fused.py):
the linear takes either. Decode rows
(at most MAX_ROWS; where fbgemm runs, of at most SKINNY_MAX_K inputs) then go through
the skinny kernel (layers/skinny_linear.py), which streams each weight once, here at one
byte a value, multiplying e4m3 tiles on the tensor cores (as float16, which holds every
e4m3 value exactly). Other products go to an FP8 tensor-core GEMM with row-wise scales:
fbgemm-gpu-genai's CUTLASS ``f8f8bf16_rowwise`` on Hopper GPUs where it is installed for
this torch, else ``torch._scaled_mm``. docs/kernels.md ("FP8 linears") has the
candidates measured per shape and row count. On the CPU the model keeps the de-quantized
values (plugins/quantization/fp8.py): the same products, up to the order of the sums.
"""
from __future__ import annotations  # kernel annotations stay strings without triton

import functools
import importlib.util
import logging

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.core.triton_support import dependent_launch, kernel as _kernel, tl, triton, \
    wait_for_inputs
from roseinfer.layers.fused import QuantizedRows
from roseinfer.models.quantization import FP8, FP8_MAX, absmax_scale
from roseinfer.layers.skinny_linear import _skinny_kernel, measured_on

MAX_ROWS = 16  # one tile of rows
# Where fbgemm's GEMM runs, wider rows go to it at any count: Llama-3-8B's down (14,336
# inputs) took 25 us at 1-16 rows against the skinny kernel's 30-35 on the H200; of the
# 4,096-input shapes qkv is faster skinny (12.2 against 14.1 us), o and gate_up level
SKINNY_MAX_K = 8192


@_kernel
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, s_x, s_q, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
    """Row ``program_id`` of x as e4m3 values (``q``) and its scale: absmax_scale's."""
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    ks = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + ks
        x = tl.load(x_ptr + row * s_x + k, mask=k < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)
    for k0 in range(0, K, BLOCK):
        k = k0 + ks
        x = tl.load(x_ptr + row * s_x + k, mask=k < K, other=0.0).to(tl.float32)
        tl.store(q_ptr + row * s_q + k, tl.clamp(x / scale, -448.0, 448.0).to(tl.float8e4nv),
                 mask=k < K)
    tl.store(s_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> QuantizedRows:
    """The e4m3 rows and float32 scales [M, 1] of a 2-D ``x`` (unit column stride), one
    launch."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    pdl = dependent_launch(x.device, m)
    _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0),
                                BLOCK=min(1024, triton.next_power_of_2(k)), PDL=pdl,
                                num_warps=4, launch_pdl=pdl)
    return QuantizedRows(q, scale, x.dtype)


# BLOCK_N, BLOCK_K, warps, stages: the fastest or within 4 % of it on each Llama-3-8B
# linear at 1 and 16 rows on the H100 (docs/bench/fp8_linears.py). On the H200 three
# stages: gate_up 31.4 against 36.7 us at one row, the other shapes within 0.3 us
# (docs/bench/fp8_skinny_sweep.py)
CONFIG = (64, 512, 4, 4)
H200_CONFIG = (64, 512, 4, 3)


@functools.cache
def _config(device: torch.device) -> tuple[int, int, int, int]:
    h200 = device.type == "cuda" and "H200" in torch.cuda.get_device_name(device)
    return H200_CONFIG if h200 else CONFIG


def _rows(x: torch.Tensor | QuantizedRows) -> QuantizedRows:
    return x if isinstance(x, QuantizedRows) else quantize_rows(x)


def fp8_skinny_linear(x: torch.Tensor | QuantizedRows, weight: torch.Tensor,
                      weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                      config=None) -> torch.Tensor:
    """The W8A8 product of at most MAX_ROWS rows (a 2-D ``x`` with unit column strides,
    or its QuantizedRows) with e4m3 ``weight`` [N, K] and its float32 per-channel
    ``weight_scale`` [N]."""
    q, scale, dtype = _rows(x)
    m, k = q.shape
    n = weight.shape[0]
    block_n, block_k, warps, stages = config or _config(q.device)
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    y = torch.empty(m, n, dtype=dtype, device=q.device)
    pdl = dependent_launch(q.device, m)
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        q, weight, bias if bias is not None else weight_scale, y, scale, weight_scale, m, n, k,
        q.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, PRECISION="tf32",
        SCALED=True, PDL=pdl, num_warps=warps, num_stages=stages, launch_pdl=pdl)
    return y


@functools.cache
def fbgemm_rowwise(device: torch.device):
    """fbgemm-gpu-genai's row-wise FP8 GEMM on this device: on Hopper GPUs, where it was
    measured (its CUTLASS kernels are built for them); None elsewhere, or where it is not
    installed or does not load with this torch (each release is built for one torch)."""
    if not measured_on(device) or importlib.util.find_spec("fbgemm_gpu") is None:
        return None
    try:
        import fbgemm_gpu.experimental.gen_ai  # noqa: F401 registers torch.ops.fbgemm
        return torch.ops.fbgemm.f8f8bf16_rowwise
    except Exception as e:  # a build for another torch: its library fails to load
        logging.getLogger(__name__).warning(
            "fbgemm-gpu-genai does not load (%s); FP8 GEMMs go through torch._scaled_mm. "
            "Install the fbgemm-gpu-genai release built for torch %s.", e, torch.__version__)
        return None


def fp8_gemm(x: torch.Tensor | QuantizedRows, weight: torch.Tensor,
             weight_scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product for any number of rows: fbgemm's or torch's FP8 GEMM (row-wise
    scales give bfloat16 out), else through the de-quantized weight (a slow path, for
    other dtypes)."""
    q, scale, dtype = _rows(x)
    rowwise = fbgemm_rowwise(q.device) if dtype == torch.bfloat16 else None
    if rowwise is not None:
        y = rowwise(q, weight, scale.view(-1), weight_scale)
    elif dtype == torch.bfloat16:
        y = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale.view(1, -1),
                             out_dtype=dtype)
    else:
        y = F.linear((q.float() * scale).to(dtype),
                     (weight.float() * weight_scale[:, None]).to(dtype))
    return y if bias is None else y + bias


def runs_here(device: torch.device) -> bool:
    """FP8 tensor-core conversions and GEMMs: compute capability 8.9 (Ada) and up."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8Linear(nn.Linear):
    """An nn.Linear whose weight is e4m3 with ``weight_scale`` per output channel; its
    input a tensor, or QuantizedRows (2-D) from the kernel that made them."""
    takes_quantized_rows = True

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        flat = x if isinstance(x, QuantizedRows) else x.reshape(-1, x.shape[-1])
        rows = _rows(flat if isinstance(flat, QuantizedRows) or flat.stride(1) == 1
                     else flat.contiguous())  # rows may be strided, columns not
        m, k = rows.values.shape
        skinny_k = k <= SKINNY_MAX_K or fbgemm_rowwise(rows.values.device) is None
        if m <= MAX_ROWS and skinny_k:
            y = fp8_skinny_linear(rows, self.weight, self.weight_scale, self.bias)
        else:
            y = fp8_gemm(rows, self.weight, self.weight_scale, self.bias)
        return y if isinstance(x, QuantizedRows) else y.view(*x.shape[:-1], y.shape[-1])


def to_fp8(linear: nn.Linear) -> None:
    """Make ``linear`` (float weights, on CUDA) an Fp8Linear in place: its weight rounded
    to e4m3 per output channel, the float copy freed."""
    w = linear.weight.detach().float()
    scale = absmax_scale(w).view(-1)
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    linear.weight = nn.Parameter(q, requires_grad=False)
    linear.register_buffer("weight_scale", scale)
    linear.__class__ = Fp8Linear
    fbgemm_rowwise(q.device)  # loaded now, not first inside a CUDA graph's capture
