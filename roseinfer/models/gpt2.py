"""GPT-2 on the paged KV cache."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.core import tp
from roseinfer.models import sharding
from roseinfer.layers.fused import add_layer_norm
from roseinfer.layers.cpu_linear import CpuLinear
from roseinfer.layers.attention import PagedAttention
from roseinfer.layers.embedding import LogitsHead, VocabEmbedding, embedding


def layer_norm(ln: nn.LayerNorm, x, residual):
    """(ln(x + residual), x + residual) in one kernel on CUDA."""
    return add_layer_norm(x, residual, ln.weight, ln.bias, ln.eps)


def linear_gelu_tanh(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """GELU (tanh approximation, GPT-2's gelu_new) of a linear layer.

    The activation runs in the GEMM epilogue, one kernel instead of two: on
    CUDA cuBLASLt's GELU_BIAS (the tanh form), on the CPU oneDNN's where a
    CpuLinear runs its packed kernel. ``_addmm_activation`` on the CPU uses the erf form.
    """
    if x.is_cuda and x.dim() == 2:
        return torch._addmm_activation(linear.bias, x, linear.weight.t(), use_gelu=True)
    if isinstance(linear, CpuLinear):
        return linear(x, gelu="tanh")
    return F.gelu(linear(x), approximate="tanh")


class GPT2Block(nn.Module):
    """One block; under tensor parallelism this rank's heads and share of the MLP
    (llama.LlamaLayer says how they split)."""

    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        e, d = cfg.n_embd, cfg.n_embd // cfg.n_head
        h = tp.split(cfg.n_head, "attention heads")
        inner = tp.split(cfg.n_inner or 4 * e, "MLP size")
        self.ln_1 = nn.LayerNorm(e, eps=cfg.layer_norm_epsilon)
        self.c_attn = nn.Linear(e, 3 * h * d)
        self.attn_proj = nn.Linear(h * d, e)
        self.ln_2 = nn.LayerNorm(e, eps=cfg.layer_norm_epsilon)
        self.c_fc = nn.Linear(e, inner)
        self.mlp_proj = nn.Linear(inner, e)
        self.attn = PagedAttention(layer_idx, h, h, d, d ** -0.5)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None):
        """Returns (this block's output, the residual stream before it is added):
        the next norm adds the two in one fused kernel."""
        h, residual = layer_norm(self.ln_1, x, residual)
        q, k, v = self.c_attn(h).chunk(3, dim=-1)
        attn = tp.all_reduce(self.attn_proj(self.attn(q, k, v)))
        h, residual = layer_norm(self.ln_2, attn, residual)
        return tp.all_reduce(self.mlp_proj(linear_gelu_tanh(h, self.c_fc))), residual


class GPT2ForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte = VocabEmbedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(GPT2Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.head = LogitsHead(cfg.vocab_size)

    def bind_head(self) -> None:
        self.head.bind(self.wte.weight)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.wte(input_ids) + self.wpe(positions), None
        for block in self.h:
            x, residual = block(x, residual)
        return layer_norm(self.ln_f, x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    @staticmethod
    def shard_rule(key: str, cfg) -> sharding.Shard | None:
        """How checkpoint tensor ``key`` splits over the ranks (models/sharding.py).
        transformers keeps GPT-2's weights as [in, out]: outputs split along dim 1."""
        e, d, inner = cfg.n_embd, cfg.n_embd // cfg.n_head, cfg.n_inner or 4 * cfg.n_embd
        module, name, kind = ["", *key.split(".")][-3:]
        out = 0 if kind == "bias" else 1
        if name in ("wte", "lm_head"):
            return sharding.vocab(cfg.vocab_size)
        if name == "c_attn":
            q = sharding.heads(cfg.n_head, d, out)
            return sharding.joined(out, q, q, q, offsets=(0, e, 2 * e))
        if name == "c_fc":
            return sharding.split(inner, "MLP size", out)
        if name == "c_proj":  # row-parallel: split by input rows
            if kind == "bias":
                return sharding.Shard(0, once=True)
            if module == "attn":
                return sharding.heads(cfg.n_head, d)
            return sharding.split(inner, "MLP size")
        return None

    @staticmethod
    def convert_hf_state_dict(sd: dict, cfg) -> dict:
        """transformers' GPT-2 keeps Conv1D weights as [in, out]; ours are [out, in]."""
        renames = {"attn.c_attn": "c_attn", "attn.c_proj": "attn_proj",
                   "mlp.c_fc": "c_fc", "mlp.c_proj": "mlp_proj"}
        out = {}
        for key, t in sd.items():
            key = key.removeprefix("transformer.")
            if key == "lm_head.weight" or key.endswith(".attn.bias") or key.endswith("masked_bias"):
                continue  # tied to wte / causal-mask buffers
            for old, new in renames.items():
                if f".{old}." in key:
                    key = key.replace(f".{old}.", f".{new}.")
                    if key.endswith(".weight"):
                        t = t.t()
            out[key] = t.contiguous()
        return out
