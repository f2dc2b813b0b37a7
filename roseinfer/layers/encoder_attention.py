"""Bidirectional attention over packed sequences: an encoder's tokens run one row a token,
without padding, through every linear; only attention pads, per batch, to its longest
sequence, each query seeing its own sequence's keys.

Vision towers taken from transformers (Qwen2.5-VL's, Qwen3-VL's) attend within windows of
an image's patches, given as ``cu_seqlens``. With torch's SDPA transformers runs them one
window a call, about 80 windows a block of a 1,024 x 1,024 image; a tower built with
``TOWER_ATTENTION`` (``tower_attention``) runs each block's windows as one call here.
"""
from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from roseinfer.layers.packed_attention_kernel import packed_attention_kernel


@dataclass(frozen=True)
class Packed:
    """Sequences packed one row a token: each token's position in its sequence, its
    segment (``token_types``: 1 on a pair's second text), and its place in the [B, L]
    padding attention uses."""
    lens: list[int]
    positions: torch.Tensor    # [N] int64
    token_types: torch.Tensor  # [N] int64
    seq_index: torch.Tensor    # [N] int64: each token's sequence
    starts: torch.Tensor       # [B] int64: each sequence's first row
    slots: torch.Tensor        # [N] int64: b * L + position
    keys_ok: torch.Tensor | None  # [B, 1, 1, L] bool; None where every length is L
    cu_seqlens: torch.Tensor   # [B + 1] int32: where each sequence starts, then N
    # [2, N] int32, each row's sequence's [start, end): a captured graph's packing, run
    # by layers/packed_attention_kernel.py (core/pooling_graphs.py); None elsewhere
    bounds: torch.Tensor | None = None

    @classmethod
    def of(cls, lens: list[int], token_types: list[int] | None, device) -> "Packed":
        longest = max(lens)
        seq_index = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        starts = torch.tensor([0, *lens[:-1]]).cumsum(0)
        positions = torch.arange(len(seq_index)) - starts[seq_index]
        keys_ok = None
        if min(lens) < longest:
            keys_ok = (torch.arange(longest)[None, :] < torch.tensor(lens)[:, None])[:, None, None]
        types = torch.zeros_like(positions) if token_types is None else torch.tensor(token_types)
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
        return cls(lens, move(positions), move(types), move(seq_index), move(starts),
                   move(seq_index * longest + positions), move(keys_ok), move(cu))

    @property
    def ends(self) -> torch.Tensor:
        """Each sequence's last row."""
        return self.starts + torch.tensor(self.lens, device=self.starts.device) - 1


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
                      packed: Packed) -> torch.Tensor:
    """Softmax attention of ``q``, ``k``, ``v`` ([N, heads * D]) within each sequence of
    ``packed``; [N, heads * D]."""
    shaped = [x.view(x.shape[0], heads, -1) for x in (q, k, v)]
    return packed_attention(*shaped, packed).flatten(1)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packed,
                     causal: bool = False, scale: float | None = None,
                     window: int | None = None) -> torch.Tensor:
    """Attention within each sequence of ``packed``: q [N, H, D], k and v [N, H_kv, D]
    (grouped-query: H a multiple of H_kv); ``causal``: each query sees the keys up to its
    own position; ``window``: only keys at most that far from it, on either side. [N, H, D]."""
    if packed.bounds is not None:
        return packed_attention_kernel(q, k, v, packed.bounds, causal, scale, window)
    batch, longest = len(packed.lens), max(packed.lens)
    varlen = _varlen() if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) else None
    kwargs = None if varlen is None else flash_kwargs(
        varlen[1], q.shape, k.shape[1], causal, scale, window)
    if kwargs is not None:  # no padding at all
        return varlen[0](q, k, v, packed.cu_seqlens, packed.cu_seqlens, longest, longest,
                         **kwargs)

    def padded(x):
        out = x.new_zeros(batch * longest, *x.shape[1:])
        out[packed.slots] = x
        return out.view(batch, longest, *x.shape[1:]).transpose(1, 2)

    mask = packed.keys_ok
    if causal or window is not None:
        i = torch.arange(longest, device=q.device)
        offset = i[:, None] - i[None, :]  # query minus key position
        seen = torch.ones_like(offset, dtype=torch.bool)
        if causal:
            seen &= offset >= 0
        if window is not None:
            seen &= offset.abs() <= window
        mask = seen if mask is None else mask & seen
    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=mask,
                                         scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).reshape(batch * longest, *q.shape[1:])[packed.slots]


TOWER_ATTENTION = "roseinfer_flash_packed"  # "flash": transformers then passes cu_seqlens


def tower_attention() -> str:
    """The attention implementation to build a transformers vision tower with, registered
    with transformers once."""
    from transformers import AttentionInterface
    AttentionInterface.register(TOWER_ATTENTION, _tower_attention)
    return TOWER_ATTENTION


def _tower_attention(module, query, key, value, attention_mask=None, scaling=None,
                     cu_seq_lens_q=None, **kwargs):
    """transformers' attention call: q, k, v [1, H, N, D] of one packed batch of windows
    (``cu_seq_lens_q``); returns ([1, N, H, D], None), as its flash kernels do. The tower
    passes the same boundaries tensor to every block of a kind (windowed or full), so the
    packing is made once a call and kept on it: one read to the host a kind, not a block."""
    packed = getattr(cu_seq_lens_q, "roseinfer_packed", None)
    if packed is None:
        lens = (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).tolist()
        packed = cu_seq_lens_q.roseinfer_packed = Packed.of(lens, None, query.device)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    return packed_attention(q, k, v, packed, scale=scaling)[None], None


def flash_kwargs(params: frozenset, q_shape, kv_heads: int, causal: bool,
                 scale: float | None, window: int | None) -> dict | None:
    """The keyword arguments of torch's ``varlen_attn`` (whose ``params`` these are) for
    the call, or None where that torch's cannot make it: the function gained its window,
    grouped-query and scale arguments over releases (torch 2.11's takes ``is_causal``)."""
    kwargs = {}
    if "window_size" in params:
        reach = -1 if window is None else window
        kwargs["window_size"] = (reach, 0 if causal else reach)
    elif window is not None:
        return None
    elif causal:
        if "is_causal" not in params:
            return None
        kwargs["is_causal"] = True
    if q_shape[1] != kv_heads:
        if "enable_gqa" not in params:
            return None
        kwargs["enable_gqa"] = True
    if scale is not None:
        if "scale" in params:
            kwargs["scale"] = scale
        elif not math.isclose(scale, q_shape[-1] ** -0.5):
            return None  # the default scale is the only one it takes
    return kwargs


@functools.cache
def _varlen():
    """(torch's flash attention over packed sequences, its parameter names), where this
    torch has it; imported on first use (it loads torch._dynamo, seconds of a cold start
    a generating model does not need)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)
