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


@hookimpl
def roseinfer_register_kv_append_backends(register):
    if triton is None:
        return
    for variant in ("generic", "identity_pos", "full_batch"):
        register(f"triton_{variant}", functools.partial(TritonAppend, variant))
