"""Rotary position embeddings: the tables from a config, and the rotation of q and k."""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from roseinfer.core.attention import get_context
from roseinfer.core.triton_support import rope_in_append
from roseinfer.layers.fused import HeadNorms, apply_rope, rope_rows, rotate_qk_


def rope_params(cfg, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling; non-default RoPE types go through transformers.
    ``layer_type``: of a config whose ``rope_parameters`` differ by layer type (Gemma 3's
    "sliding_attention" and "full_attention"), that type's."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        by_type = {"layer_type": layer_type} if layer_type else {}
        with torch.device("cpu"):  # the model may be built under a meta device: not these
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", **by_type)
        return inv_freq, scaling
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))  # the rotated dims
    exps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (theta ** exps), 1.0


class Rotation(NamedTuple):
    """A layer's RoPE of this step, left to the KV append: a backend that turns k as it
    writes it to the cache (``append_rotated``) does it in that launch, else ``apply``."""
    rotary: "RotaryEmbedding"
    positions: torch.Tensor
    num_heads: int
    num_kv_heads: int
    norms: HeadNorms | None

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(self.positions, q, k, self.num_heads, self.num_kv_heads, self.norms)


class RotaryEmbedding(nn.Module):
    """Non-interleaved (rotate-half) RoPE from precomputed cos/sin tables."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, scaling: float = 1.0):
        super().__init__()
        self._spec = (inv_freq.float().cpu(), max_positions, scaling)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build_tables()

    def build_tables(self, device=None) -> None:
        """(Re)build the tables, e.g. after the module was created on the meta device."""
        inv_freq, max_positions, scaling = self._spec
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        device = device or self.cos.device
        self.cos = (freqs.cos() * scaling).to(device)
        self.sin = (freqs.sin() * scaling).to(device)

    def deferred(self, positions, q, num_heads, num_kv_heads, norms: HeadNorms | None = None
                 ) -> Rotation | None:
        """This rotation as a Rotation for the KV append to run (one launch fewer), where
        the Triton kernel would run it: on CUDA, every dim rotated, plain RoPE (M-RoPE's
        positions come from the step), unless ``ROSEINFER_ROPE_IN_APPEND=0``; None where it
        must run now."""
        if not q.is_cuda or type(self) is not RotaryEmbedding or \
                2 * self.cos.shape[-1] != q.shape[-1] // num_heads or not rope_in_append():
            return None
        return Rotation(self, positions, num_heads, num_kv_heads, norms)

    def forward(self, positions, q, k, num_heads, num_kv_heads, norms: HeadNorms | None = None):
        """Rotates q and k in place (they may be column slices of a fused qkv); ``norms``
        (CUDA): each head's q/k RMSNorm first, in the same kernel."""
        if q.is_cuda:  # one kernel gathers (norms) and rotates
            return apply_rope(q, k, positions, self.cos, self.sin, num_heads, num_kv_heads,
                              norms=norms)
        assert norms is None, "q/k norms fuse into RoPE on CUDA only"
        memo = get_context().attn.memo
        if self not in memo:  # the first layer gathers the step's rows for all
            memo[self] = rope_rows(positions, self.cos, self.sin)
        return rotate_qk_(q, k, *memo[self], num_heads, num_kv_heads)


def sectioned(sections: list[int]) -> list[int]:
    """Qwen2-VL's M-RoPE components: the frequencies in three runs (``sections``: their
    sizes), time, height, width."""
    return [c for c, size in enumerate(sections) for _ in range(size)]


def interleaved(sections: list[int]) -> list[int]:
    """Qwen3-VL's: frequency f turns by height where f % 3 == 1 and f < 3 x sections[1], by
    width where f % 3 == 2 and f < 3 x sections[2], else by time."""
    return [1 if f % 3 == 1 and f < 3 * sections[1] else
            2 if f % 3 == 2 and f < 3 * sections[2] else 0 for f in range(sum(sections))]


class MultimodalRotaryEmbedding(RotaryEmbedding):
    """M-RoPE: each rotated frequency turned by one component of a token's position (time,
    height, width): ``components``, per frequency (``sectioned``, Qwen2-VL's;
    ``interleaved``, Qwen3-VL's). A step whose model inputs carry them (``positions3``,
    [3, N]; core/multimodal.py) rotates by those; any other step's tokens have three equal
    components: plain RoPE, at each token's position plus its sequence's offset (``shift``,
    by sequence row: an image prompt's offset past it, else 0) where the step computes a
    token a sequence (decode, which CUDA graphs capture)."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, components: list[int],
                 scaling: float = 1.0):
        super().__init__(inv_freq, max_positions, scaling)
        assert len(components) == inv_freq.numel(), "M-RoPE components: one a frequency"
        self.components = list(components)  # a list: the module may be built on meta
        self.shift: torch.Tensor | None = None  # [sequence rows], core/multimodal.py binds it

    def forward(self, positions, q, k, num_heads, num_kv_heads, norms: HeadNorms | None = None):
        ctx = get_context()
        positions3 = getattr(ctx.model_inputs, "positions3", None)
        if positions3 is None:
            if self.shift is not None and positions.shape[0] == ctx.seq_rows.shape[0]:
                positions = positions + self.shift[ctx.seq_rows]
            return super().forward(positions, q, k, num_heads, num_kv_heads, norms)
        if norms is not None:  # Qwen3-VL's q/k norms, unfused on this path
            q, k = norms.apply(q, k, q.shape[1] // num_heads)
        memo = ctx.attn.memo
        if self not in memo:
            pick = torch.tensor(self.components, device=positions3.device)[None, None].expand(
                1, positions3.shape[1], -1)
            cos, sin = (torch.stack([table[positions3[c]] for c in range(3)]).gather(0, pick)[0]
                        for table in (self.cos, self.sin))
            memo[self] = rope_rows(torch.arange(cos.shape[0], device=cos.device), cos, sin)
        return rotate_qk_(q, k, *memo[self], num_heads, num_kv_heads)
