"""KV append in one Triton kernel, specialised at compile time for three batch shapes.

- ``triton_generic``: source rows gathered through ``slots.rows`` (or identity).
- ``triton_identity_pos``: row b -> ``(block_idx[b], offsets[b])``.
- ``triton_full_batch``: identity rows and one offset for all, read from the
  ``[1]`` tensor ``slots.shared_offset`` so a captured CUDA graph replays with
  whatever offset the step has written there.

One program per new token writes every KV head of K and V, cast to the cache's dtype
(an FP8 cache: e4m3, scale 1). No host syncs.
"""
from __future__ import annotations  # kernel annotations stay strings without triton

import functools

import torch

from roseinfer.core.hookspecs import hookimpl
from roseinfer.core.triton_support import dependent_launch, kernel as _kernel, tl, triton, \
    triton_usable, wait_for_inputs
from roseinfer.layers.fused import ROPE_HEAD_ROWS, _rotate_heads, _store_cached


@_kernel
def _append_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr,
    block_idx_ptr, offsets_ptr, rows_ptr, shared_offset_ptr,
    s_block, s_offset, s_row,                    # index strides (an expanded offset is fine)
    sk_n, sk_h, sk_d, sv_n, sv_h, sv_d,          # key / value strides (views allowed)
    sc_b, sc_h, sc_o, sc_d,                      # cache strides (K and V alike)
    num_kv_heads, head_dim,
    GATHER: tl.constexpr, SHARED_OFFSET: tl.constexpr, FP8: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    i = tl.program_id(0)
    if GATHER:
        src = tl.load(rows_ptr + i * s_row).to(tl.int64)
    else:
        src = i.to(tl.int64)
    if SHARED_OFFSET:
        offset = tl.load(shared_offset_ptr).to(tl.int64)
    else:
        offset = tl.load(offsets_ptr + i * s_offset).to(tl.int64)
    # int64: num_blocks * block stride overflows int32 on large caches.
    block = tl.load(block_idx_ptr + i * s_block).to(tl.int64)

    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    dst = block * sc_b + h * sc_h + offset * sc_o + d * sc_d
    k = tl.load(key_ptr + src * sk_n + h * sk_h + d * sk_d, mask=mask)
    v = tl.load(value_ptr + src * sv_n + h * sv_h + d * sv_d, mask=mask)
    if FP8:  # e4m3, scale 1: saturated at its largest finite value, as torch_index does
        k = tl.clamp(k.to(tl.float32), -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32), -448.0, 448.0)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@_kernel
def _rope_append_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, block_idx_ptr, offsets_ptr,
    shared_offset_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, eps,
    s_q, s_k, s_v, s_pos, s_table, s_block, s_offset,  # row strides (q/k/v: slices of qkv)
    sc_b, sc_h, sc_o, sc_d,                            # cache strides (K and V alike)
    num_heads, num_kv_heads, head_dim, half,
    SHARED_OFFSET: tl.constexpr, FP8: tl.constexpr, NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """RoPE (layers/fused.py's ``_rope_kernel``, full rotary) and the append in one launch,
    token i to slot i: program (token, j) turns ``BLOCK_H`` heads of the token's q in place
    (the first programs), or turns as many heads of its k into its cache slot and copies
    the same heads of v there. k itself is left as it was: attention reads the cache."""
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
        if SHARED_OFFSET:
            offset = tl.load(shared_offset_ptr).to(tl.int64)
        else:
            offset = tl.load(offsets_ptr + row * s_offset).to(tl.int64)
        block = tl.load(block_idx_ptr + row * s_block).to(tl.int64)  # int64: large caches
        slot = block * sc_b + first * sc_h + offset * sc_o
        _rotate_heads(k_ptr, row * s_k + first * head_dim, num_kv_heads - first, head_dim,
                      cos, sin, half, kw_ptr, eps, BLOCK_H, BLOCK_HALF, NORM, UNIT_OFFSET,
                      k_cache_ptr + slot, sc_h, sc_d, True, FP8)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_kv_heads - first) & (d < head_dim)
        v = tl.load(v_ptr + row * s_v + (first + h) * head_dim + d, mask=mask)
        _store_cached(v_cache_ptr + slot + h * sc_h + d * sc_d, v, mask, FP8)


class TritonAppend:
    """One backend per variant; the variant only changes what ``supports`` accepts
    and which constexpr branches the kernel is compiled with."""

    def __init__(self, variant: str):
        assert variant in ("generic", "identity_pos", "full_batch")
        self.variant = variant

    def supports(self, slots, device) -> bool:
        if not triton_usable(device):
            return False
        if self.variant == "generic":
            return True
        if self.variant == "identity_pos":
            return slots.rows is None
        return slots.rows is None and slots.shared_offset is not None

    def append(self, k_cache, v_cache, key, value, slots) -> None:
        assert k_cache.stride() == v_cache.stride()
        gather = slots.rows is not None
        shared = self.variant == "full_batch"
        # Unused pointer arguments still need a tensor; block_idx is always there.
        rows = slots.rows if gather else slots.block_idx
        shared_offset = slots.shared_offset if shared else slots.block_idx
        _, num_kv_heads, _, head_dim = k_cache.shape
        pdl = dependent_launch(key.device, len(slots))
        _append_kernel[(len(slots),)](
            key, value, k_cache, v_cache,
            slots.block_idx, slots.offsets, rows, shared_offset,
            slots.block_idx.stride(0), slots.offsets.stride(0), rows.stride(0),
            *key.stride(), *value.stride(), *k_cache.stride(),
            num_kv_heads, head_dim,
            GATHER=gather, SHARED_OFFSET=shared, FP8=k_cache.dtype == torch.float8_e4m3fn,
            BLOCK_H=triton.next_power_of_2(num_kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim), PDL=pdl, launch_pdl=pdl,
        )

    def append_rotated(self, k_cache, v_cache, q, key, value, slots, rotation) -> bool:
        """RoPE of q (in place) and of key as it is written, with value, in one launch
        (``rotation``: layers/rotary.py's Rotation); False, nothing done, where the slots
        gather their rows (the generic variant's batches)."""
        if slots.rows is not None:
            return False
        assert k_cache.stride() == v_cache.stride()
        rotary, positions, num_heads, num_kv_heads, norms = rotation
        shared = self.variant == "full_batch"
        shared_offset = slots.shared_offset if shared else slots.block_idx
        head_dim, half = k_cache.shape[-1], rotary.cos.shape[1]
        rows = q.shape[0]
        block_h = 1 if rows <= ROPE_HEAD_ROWS else \
            triton.next_power_of_2(max(num_heads, num_kv_heads))
        programs = triton.cdiv(num_heads, block_h) + triton.cdiv(num_kv_heads, block_h)
        qw, kw, eps = (q, key, 0.0) if norms is None else (norms.q, norms.k, norms.eps)
        pdl = dependent_launch(q.device, rows)
        _rope_append_kernel[(rows, programs)](
            q, key, value, k_cache, v_cache, slots.block_idx, slots.offsets, shared_offset,
            positions, rotary.cos, rotary.sin, qw, kw, eps,
            q.stride(0), key.stride(0), value.stride(0), positions.stride(0),
            rotary.cos.stride(0), slots.block_idx.stride(0), slots.offsets.stride(0),
            *k_cache.stride(), num_heads, num_kv_heads, head_dim, half,
            SHARED_OFFSET=shared, FP8=k_cache.dtype == torch.float8_e4m3fn,
            NORM=norms is not None, UNIT_OFFSET=norms is not None and norms.unit_offset,
            BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_D=triton.next_power_of_2(head_dim), PDL=pdl,
            num_warps=max(1, min(block_h * triton.next_power_of_2(half) // 256, 16)),
            launch_pdl=pdl)
        return True


@hookimpl
def roseinfer_register_kv_append_backends(register):
    if triton is None:
        return
    for variant in ("generic", "identity_pos", "full_batch"):
        register(f"triton_{variant}", functools.partial(TritonAppend, variant))
