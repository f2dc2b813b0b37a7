"""Fused elementwise ops for the decode step: one kernel where the plain model runs several.

At decode batch sizes every small kernel costs more in launch and gap than in
work, so each op here folds a chain of elementwise torch ops into one Triton
kernel:

- ``add_layer_norm`` / ``add_rms_norm``: residual add + norm (one shared kernel).
- ``silu_and_mul``: SwiGLU's ``silu(gate) * up`` on the fused gate_up output.
- ``gated_rms_norm``: the recurrent layers' RMSNorm with a SiLU gate, per group of channels
  (Qwen3-Next's DeltaNet, Mamba2's mixers).
- ``fp8=True`` (RMSNorm, SwiGLU): the rows come out rounded to e4m3 with a scale each
  (``QuantizedRows``), for an FP8 linear that reads them: its rounding's launch saved.
- ``apply_rope``: gather cos/sin by position and rotate q and k, in place; with
  ``HeadNorms``, each head's q/k RMSNorm first, in the same kernel.

Every op has a plain-torch twin with the same semantics, used off CUDA.
``use_triton=None`` picks Triton iff the input is on CUDA; ``True`` forces it
(on CPU that needs ``TRITON_INTERPRET=1``, for tests). Both paths compute in
float32 and return the input dtype. The kernels do no host syncs and allocate
only shape-dependent outputs, so they are CUDA-graph capturable.
"""
from __future__ import annotations  # kernel annotations stay strings without triton

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from roseinfer.core.triton_support import dependent_launch, kernel as _kernel, tl, triton, \
    wait_for_inputs
from roseinfer.models.quantization import FP8, FP8_MAX, absmax_scale

class QuantizedRows(NamedTuple):
    """Rows rounded to e4m3 with a float32 scale each (the row's largest magnitude maps to
    448), as FP8 linears read them: ``values`` [M, K], ``scales`` [M, 1], and the ``dtype``
    the rows were rounded from (the product's)."""
    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype


def takes_quantized_rows(linear) -> bool:
    """Whether ``linear`` reads QuantizedRows in place of its input (FP8 linears do)."""
    return getattr(linear, "takes_quantized_rows", False)


def quantize_rows_torch(x: torch.Tensor) -> QuantizedRows:
    """The plain-torch rounding of 2-D ``x``'s rows, as the kernels round them."""
    scale = absmax_scale(x.float())
    return QuantizedRows((x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale, x.dtype)


def _use_triton(use_triton: bool | None, x: torch.Tensor) -> bool:
    if use_triton is None:
        return x.is_cuda and triton is not None
    if use_triton and triton is None:
        raise RuntimeError("use_triton=True but Triton is not installed")
    return use_triton


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A 2-D [rows, cols] view with unit column stride (rows may be strided)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


# ---------------------------------------------------------------- residual add + norm
@_kernel
def add_residual(h, res_row, res_out_row, cols, mask):
    """``h`` + the residual row, stored to ``res_out_row`` and returned in its dtype: the
    unfused model stores x + residual in the activation dtype and normalises what it
    stored, so the sum is rounded the same way."""
    r = tl.load(res_row + cols, mask=mask, other=0.0)
    h = (h.to(tl.float32) + r.to(tl.float32)).to(res_out_row.dtype.element_ty)
    tl.store(res_out_row + cols, h, mask=mask)
    return h


@_kernel
def rms_norm_row(h, w_ptr, dtype_ptr, cols, mask, n_cols, eps, UNIT_OFFSET: tl.constexpr):
    """The RMSNorm of a float32 row ``h``, in float32, rounded as transformers' norms
    round (to ``dtype_ptr``'s dtype, the activations')."""
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    if UNIT_OFFSET:  # Gemma's: scaled by 1 + weight in float32, rounded once
        y = h * rstd * (1.0 + w)
    else:
        # LlamaRMSNorm rounds the normalised value to the activation dtype before
        # scaling by the weight.
        y = (h * rstd).to(dtype_ptr.dtype.element_ty).to(tl.float32) * w
    return y


@_kernel
def store_e4m3_row(y, q_row, s_at, cols, mask):
    """Row ``y`` (float32, already rounded to the activation dtype) as e4m3 at ``q_row``
    and its scale at ``s_at``: the largest magnitude maps to 448, as ``quantize_rows``
    rounds a stored row."""
    amax = tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0)
    scale = tl.maximum(amax / 448.0, 1e-12)
    tl.store(q_row + cols, tl.clamp(y / scale, -448.0, 448.0).to(tl.float8e4nv), mask=mask)
    tl.store(s_at, scale)


@_kernel
def _add_norm_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, xw_ptr, scale_ptr,
    s_x, s_res, s_out, s_res_out,                # row strides
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, IS_RMS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr = False, NORM_X: tl.constexpr = False, FP8: tl.constexpr = False,
):
    """FP8: ``out`` is e4m3 (and ``scale_ptr`` a scale a row), the row rounded to
    ``res_out``'s dtype first, as the unfused pair rounds what the norm stored."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride overflows int32 on long prefills
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0)
    if NORM_X:  # Gemma's post-norm of a block's output, rounded once, before the add
        hx = h.to(tl.float32)
        xw = tl.load(xw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        h = (hx * tl.rsqrt(tl.sum(hx * hx, axis=0) / n_cols + eps) * (1.0 + xw)).to(h.dtype)
    if HAS_RESIDUAL:
        h = add_residual(h, res_ptr + row * s_res, res_out_ptr + row * s_res_out, cols, mask)
    h = h.to(tl.float32)
    if IS_RMS:
        y = rms_norm_row(h, w_ptr, res_out_ptr, cols, mask, n_cols, eps, UNIT_OFFSET)
    else:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(h, axis=0) / n_cols
        centered = tl.where(mask, h - mean, 0.0)  # padding lanes must not add to the variance
        rstd = tl.rsqrt(tl.sum(centered * centered, axis=0) / n_cols + eps)
        b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = centered * rstd * w + b
    if FP8:
        y = y.to(res_out_ptr.dtype.element_ty).to(tl.float32)
        store_e4m3_row(y, out_ptr + row * s_out, scale_ptr + row, cols, mask)
    else:
        tl.store(out_ptr + row * s_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _add_norm_triton(x, residual, weight, bias, eps, is_rms, unit_offset=False,
                     x_weight=None, fp8=False):
    """Returns (normed, x + residual), or (normed, x) itself when residual is None;
    ``fp8``: normed as QuantizedRows."""
    rows = _rows(x)
    n_rows, n_cols = rows.shape
    out = torch.empty((n_rows, n_cols), dtype=torch.float8_e4m3fn if fp8 else x.dtype,
                      device=x.device)
    scales = torch.empty((n_rows, 1), dtype=torch.float32, device=x.device) if fp8 else out
    if residual is None:
        res = res_out = rows  # never written: HAS_RESIDUAL is off (FP8 reads its dtype)
    else:
        res = _rows(residual)
        res_out = torch.empty_like(rows, memory_format=torch.contiguous_format)
    block = triton.next_power_of_2(n_cols)
    pdl = dependent_launch(x.device, n_rows)
    _add_norm_kernel[(n_rows,)](
        rows, res, weight, weight if bias is None else bias, out, res_out,
        weight if x_weight is None else x_weight, scales,
        rows.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
        n_cols, eps,
        HAS_RESIDUAL=residual is not None, IS_RMS=is_rms, BLOCK=block, PDL=pdl,
        UNIT_OFFSET=unit_offset, NORM_X=x_weight is not None, FP8=fp8,
        num_warps=_warps(block), launch_pdl=pdl,
    )
    normed = QuantizedRows(out, scales, x.dtype) if fp8 else out.view(x.shape)
    return normed, x if residual is None else res_out.view(x.shape)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                   bias: torch.Tensor, eps: float, use_triton: bool | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (``x`` when residual is None), then ``(layer_norm(h), h)``.

    ``h`` is rounded to ``x.dtype`` before it is normalised, as in the unfused
    model; statistics and the affine are float32. With ``residual=None`` the
    second result is ``x`` itself.
    """
    if _use_triton(use_triton, x):
        return _add_norm_triton(x, residual, weight, bias, eps, is_rms=False)
    h = x if residual is None else x + residual
    normed = F.layer_norm(h.float(), (h.shape[-1],), weight.float(), bias.float(), eps)
    return normed.to(h.dtype), h


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, use_triton: bool | None = None, unit_offset: bool = False,
                 x_weight: torch.Tensor | None = None, fp8: bool = False
                 ) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """``h = x + residual`` (``x`` when residual is None), then ``(rms_norm(h), h)``.

    Rounds like transformers' LlamaRMSNorm: float32 variance of ``h``, then
    ``weight * (h * rsqrt(var + eps)).to(x.dtype)``; the result is ``x.dtype``.
    ``unit_offset``: Gemma's, ``(h * rsqrt(var + eps) * (1 + weight)).to(x.dtype)``.
    ``x_weight``: ``x`` is first normed by it, Gemma's way (a block's post-norm), in the
    same kernel. With ``residual=None`` the second result is ``x`` itself. ``fp8``: the
    normed rows as QuantizedRows (2-D), rounded in the same kernel.
    """
    if _use_triton(use_triton, x):
        return _add_norm_triton(x, residual, weight, None, eps, True, unit_offset, x_weight,
                                fp8)
    if fp8:
        normed, h = add_rms_norm(x, residual, weight, eps, False, unit_offset, x_weight)
        return quantize_rows_torch(normed.reshape(-1, normed.shape[-1])), h
    if x_weight is not None:
        x = add_rms_norm(x, None, x_weight, eps, False, unit_offset=True)[0]
    h = x if residual is None else x + residual
    if unit_offset:
        normed = F.rms_norm(h.float(), (h.shape[-1],), eps=eps) * (1.0 + weight.float())
        return normed.to(h.dtype), h
    if h.dtype == torch.float32:  # nothing to round: one op (a batch-1 CPU step runs 61)
        return F.rms_norm(h, (h.shape[-1],), weight, eps), h
    normed = F.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(h.dtype) * weight
    return normed.to(h.dtype), h


# ---------------------------------------------------------------- gated RMSNorm
@_kernel
def _gated_norm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, s_x, s_g, per_token, n_cols, eps,
                       BLOCK: tl.constexpr, GATE_FIRST: tl.constexpr):
    """One group of a token's channels: row r is token r // per_token, group r % per_token
    (the token's stride for x and the gate, the groups contiguous in it)."""
    r = tl.program_id(0).to(tl.int64)
    token, group = r // per_token, r % per_token
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(x_ptr + token * s_x + group * n_cols + cols, mask=mask, other=0.0)
    g = tl.load(g_ptr + token * s_g + group * n_cols + cols, mask=mask, other=0.0)
    h, g = h.to(tl.float32), g.to(tl.float32)
    silu = g / (1.0 + tl.exp(-g))
    if GATE_FIRST:
        h = h * silu
    y = rms_norm_row(h, w_ptr + group * n_cols, out_ptr, cols, mask, n_cols, eps,
                     UNIT_OFFSET=False)
    if not GATE_FIRST:
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32) * silu
    tl.store(out_ptr + r * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   group: int, gate_first: bool, use_triton: bool | None = None
                   ) -> torch.Tensor:
    """RMSNorm over each ``group`` channels of x [..., C] with a SiLU gate [..., C]:
    ``gate_first`` (Mamba2's) norms x * silu(gate) and rounds before the weight; else
    (Qwen3-Next's) the weight [C] scales the rounded norm, rounded, times silu(gate).
    Returns x's shape and dtype."""
    if _use_triton(use_triton, x):
        return _gated_norm_triton(x, gate, weight, eps, group, gate_first)
    h, silu = x.float(), F.silu(gate.float())
    if gate_first:
        h = h * silu
    rows = h.view(*h.shape[:-1], -1, group)
    h = (rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps)).view_as(h)
    h = weight * h.to(x.dtype)
    return h if gate_first else (h * silu).to(x.dtype)


def _gated_norm_triton(x, gate, weight, eps, group, gate_first):
    x2, g2 = (t.reshape(-1, t.shape[-1]) for t in (x, gate))
    x2, g2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (x2, g2))
    per_token = x2.shape[1] // group
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(group)
    _gated_norm_kernel[(x2.shape[0] * per_token,)](
        x2, g2, weight, out, x2.stride(0), g2.stride(0), per_token, group, eps, BLOCK=block,
        GATE_FIRST=gate_first, num_warps=_warps(block))
    return out


# ---------------------------------------------------------------- SwiGLU

@_kernel
def _silu_and_mul_kernel(x_ptr, out_ptr, scale_ptr, s_x, s_out, n_cols, BLOCK: tl.constexpr,
                         PDL: tl.constexpr, GELU: tl.constexpr = False, FP8: tl.constexpr = False):
    """act(gate) * up of one row's block of columns: SiLU, or with ``GELU`` gelu-tanh.
    FP8 (a program a whole row): ``out`` is e4m3 and ``scale_ptr`` a scale a row, the row
    rounded to x's dtype first."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * s_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:  # 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        y = gate / (1.0 + tl.exp(-2.0 * u)) * up
    else:
        y = gate / (1.0 + tl.exp(-gate)) * up
    if FP8:
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        store_e4m3_row(y, out_ptr + row * s_out, scale_ptr + row, cols, mask)
    else:
        tl.store(out_ptr + row * s_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _gated(gate_up: torch.Tensor, gelu: bool, fp8: bool = False):
    x = _rows(gate_up)
    n_cols = x.shape[1] // 2
    out = torch.empty((x.shape[0], n_cols), dtype=torch.float8_e4m3fn if fp8 else x.dtype,
                      device=x.device)
    scales = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device) if fp8 \
        else out
    # FP8: a program holds a whole row, for its largest magnitude
    block = triton.next_power_of_2(n_cols) if fp8 else min(triton.next_power_of_2(n_cols), 1024)
    pdl = dependent_launch(x.device, x.shape[0])
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n_cols, block))](
        x, out, scales, x.stride(0), out.stride(0), n_cols, BLOCK=block, PDL=pdl, GELU=gelu,
        FP8=fp8, num_warps=_warps(block), launch_pdl=pdl)
    if fp8:
        return QuantizedRows(out, scales, x.dtype)
    return out.view(*gate_up.shape[:-1], n_cols)


def silu_and_mul(gate_up: torch.Tensor, use_triton: bool | None = None, fp8: bool = False
                 ) -> torch.Tensor | QuantizedRows:
    """``silu(gate) * up`` for ``gate_up = [..., 2I]`` (gate first); returns ``[..., I]``;
    ``fp8``: as QuantizedRows (2-D), rounded in the same kernel."""
    if _use_triton(use_triton, gate_up):
        return _gated(gate_up, gelu=False, fp8=fp8)
    if fp8:
        y = silu_and_mul(gate_up, False)
        return quantize_rows_torch(y.reshape(-1, y.shape[-1]))
    if gate_up.dtype == torch.float32:  # nothing to round: no casts (30 layers a step)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def gelu_tanh_and_mul(gate_up: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for ``gate_up = [..., 2I]`` (gate first): Gemma's GeGLU, in
    float32, rounded once."""
    if _use_triton(use_triton, gate_up):
        return _gated(gate_up, gelu=True)
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") * up).to(gate_up.dtype)


# ---------------------------------------------------------------- RoPE

ROPE_HEAD_ROWS = 16  # tokens up to which RoPE runs a program per head

@_kernel
def _rotate_heads(ptr, row_offset, num_heads, head_dim, cos, sin, half, w_ptr, eps,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, NORM: tl.constexpr,
                  UNIT_OFFSET: tl.constexpr, dst=None, s_dst_h=0, s_dst_d=0,
                  TO_DST: tl.constexpr = False, FP8: tl.constexpr = False):
    """Rotate-half RoPE of one token's heads, in place: [x1, x2] -> [x1 c - x2 s, x2 c + x1 s]
    over each head's first ``2 * half`` dims (partial rotary leaves the rest). NORM: each
    head is first RMS-normed by ``w_ptr`` (full rotary only), rounded as the unfused norm
    stores it, so the rotation sees the same values. TO_DST (full rotary): stored at
    ``dst`` (head h, dim d at ``h * s_dst_h + d * s_dst_d``: a cache slot's heads) in its
    dtype, rounded to x's dtype first as the in-place store and the copy after it round;
    FP8: saturated at e4m3's largest value, as the KV append saturates."""
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (j < half)
    first = ptr + row_offset + h * head_dim + j
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / head_dim + eps)[:, None]
        x1 = _head_norm(x1 * rstd, w_ptr + j, j < half, ptr.dtype.element_ty, UNIT_OFFSET)
        x2 = _head_norm(x2 * rstd, w_ptr + half + j, j < half, ptr.dtype.element_ty,
                        UNIT_OFFSET)
    y1 = (x1 * cos - x2 * sin).to(ptr.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(ptr.dtype.element_ty)
    if TO_DST:
        at = dst + h * s_dst_h + j * s_dst_d
        _store_cached(at, y1, mask, FP8)
        _store_cached(at + half * s_dst_d, y2, mask, FP8)
    else:
        tl.store(first, y1, mask=mask)
        tl.store(first + half, y2, mask=mask)


@_kernel
def _store_cached(at, y, mask, FP8: tl.constexpr):
    """``y`` stored in the cache's dtype at ``at``; FP8: e4m3, scale 1, saturated."""
    if FP8:
        y = tl.clamp(y.to(tl.float32), -448.0, 448.0)
    tl.store(at, y.to(at.dtype.element_ty), mask=mask)


@_kernel
def _head_norm(y, w_ptrs, w_ok, dtype, UNIT_OFFSET: tl.constexpr):
    """``rms_norm_row``'s scaling and rounding of normalised values ``y``, stored as ``dtype``
    and read back, as the unfused norm's output is."""
    w = tl.load(w_ptrs, mask=w_ok, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        return (y * (1.0 + w)).to(dtype).to(tl.float32)
    return (y.to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)


@_kernel
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, eps,
    s_q, s_k, s_pos, s_table,                    # row strides (q/k may be slices of qkv)
    num_heads, num_kv_heads, head_dim, half,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr,
    NORM: tl.constexpr = False, UNIT_OFFSET: tl.constexpr = False,
):
    """Program (token, j) turns ``BLOCK_H`` heads of the token's q (the first programs)
    or k (the rest)."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    q_programs = tl.cdiv(num_heads, BLOCK_H)
    pos = tl.load(pos_ptr + row * s_pos).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + pos * s_table + cols, mask=cols < half, other=0.0)
    sin = tl.load(sin_ptr + pos * s_table + cols, mask=cols < half, other=0.0)
    if j < q_programs:
        first = j * BLOCK_H
        _rotate_heads(q_ptr, row * s_q + first * head_dim, num_heads - first, head_dim, cos,
                      sin, half, qw_ptr, eps, BLOCK_H, BLOCK_HALF, NORM, UNIT_OFFSET)
    else:
        first = (j - q_programs) * BLOCK_H
        _rotate_heads(k_ptr, row * s_k + first * head_dim, num_kv_heads - first, head_dim,
                      cos, sin, half, kw_ptr, eps, BLOCK_H, BLOCK_HALF, NORM, UNIT_OFFSET)


def rope_rows(positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``([cos, cos], [-sin, sin])`` rows at ``positions``, [N, 1, R]: what
    ``rotate_half_`` multiplies by. Every layer of a step can share them."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    return torch.cat((c, c), dim=-1), torch.cat((-s, s), dim=-1)


def rotate_half_(x: torch.Tensor, num_heads: int, cos: torch.Tensor, sin: torch.Tensor
                 ) -> torch.Tensor:
    """The plain-torch RoPE of ``x`` [N, heads*D], in place, by ``rope_rows``' rows:
    ``x * cos + swap(x) * sin`` over the first R dims of each head, where swap
    exchanges the two halves of those R."""
    rot, rotated = x.view(x.shape[0], num_heads, -1), cos.shape[-1]
    if rotated < rot.shape[-1]:  # partial rotary
        rot = rot[..., :rotated]
    swapped = rot.roll(rotated // 2, -1)  # one op where chunk + cat are two (30 a step)
    if rot.dtype == torch.float32:  # nothing to round: 3 ops, not 4 (61 layers a step)
        return rot.mul_(cos).addcmul_(swapped, sin)
    return rot.copy_(torch.addcmul(rot.float() * cos, swapped.float(), sin))


def rotate_qk_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotate_half_`` of q and k, in one pass where k's columns follow q's in
    memory (column slices of a fused qkv)."""
    # Traced (core/cpu_step.py), tensors have no data pointer; the compiler fuses both anyway.
    joined = not torch.compiler.is_compiling() and q.stride() == k.stride() and \
        q.stride(1) == 1 and q.dtype == k.dtype and \
        k.data_ptr() == q.data_ptr() + q.shape[1] * q.element_size()
    if joined:
        qk = q.as_strided((q.shape[0], q.shape[1] + k.shape[1]), q.stride())
        rotate_half_(qk, num_heads + num_kv_heads, cos, sin)
    else:
        rotate_half_(q, num_heads, cos, sin)
        rotate_half_(k, num_kv_heads, cos, sin)
    return q, k


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
               use_triton: bool | None = None, norms: "HeadNorms | None" = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE, IN PLACE: overwrites ``q`` [N, H*D] and ``k`` [N, Hkv*D] and returns them.

    ``q`` and ``k`` need unit column stride only (column slices of a fused qkv
    tensor are fine); ``positions`` [N] must index rows of the float32
    ``cos``/``sin`` tables [max_pos, R/2] (not bounds-checked on the Triton path); the
    first R dims of each head rotate (R < D: partial rotary, as Phi-4-mini's).
    ``norms``: each head of q and k is RMS-normed first (Qwen3's and Gemma 3's q/k norms),
    in the same kernel; full rotary only.
    """
    half, head_dim = cos.shape[1], q.shape[1] // num_heads
    assert k.shape[1] == num_kv_heads * head_dim and 2 * half <= head_dim
    assert norms is None or 2 * half == head_dim, "q/k norms fuse with full rotary only"
    if not _use_triton(use_triton, q):
        if norms is not None:
            q, k = norms.apply(q, k, head_dim)
        return rotate_qk_(q, k, *rope_rows(positions, cos, sin), num_heads, num_kv_heads)
    assert q.stride(1) == k.stride(1) == cos.stride(1) == 1 and sin.stride() == cos.stride()
    block_half = triton.next_power_of_2(half)
    rows = q.shape[0]
    # A program per head where few tokens would leave most SMs idle (a head's norm is a
    # reduction: a decode row's whole q and k in one program took 7.5 µs on an H200);
    # a program per token's q or k where there are tokens enough.
    block_h = 1 if rows <= ROPE_HEAD_ROWS else triton.next_power_of_2(max(num_heads, num_kv_heads))
    programs = triton.cdiv(num_heads, block_h) + triton.cdiv(num_kv_heads, block_h)
    pdl = dependent_launch(q.device, rows)
    qw, kw, eps = (q, k, 0.0) if norms is None else (norms.q, norms.k, norms.eps)
    _rope_kernel[(rows, programs)](
        q, k, positions, cos, sin, qw, kw, eps,
        q.stride(0), k.stride(0), positions.stride(0), cos.stride(0),
        num_heads, num_kv_heads, head_dim, half,
        BLOCK_H=block_h, BLOCK_HALF=block_half, PDL=pdl, NORM=norms is not None,
        UNIT_OFFSET=norms is not None and norms.unit_offset,
        num_warps=_warps(block_h * block_half), launch_pdl=pdl,
    )
    return q, k


@dataclass(frozen=True)
class HeadNorms:
    """The per-head RMSNorm weights of q and k (``unit_offset``: Gemma's 1 + weight)."""
    q: torch.Tensor
    k: torch.Tensor
    eps: float
    unit_offset: bool = False

    def apply(self, q: torch.Tensor, k: torch.Tensor, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The unfused norms: new tensors of q's and k's shapes."""
        def norm(x, w):
            heads = x.reshape(-1, head_dim)
            return add_rms_norm(heads, None, w, self.eps, False, self.unit_offset)[0].view(x.shape)
        return norm(q, self.q), norm(k, self.k)
