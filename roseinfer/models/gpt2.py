"""GPT-2 on the paged KV cache."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from roseinfer.models.fused import add_layer_norm
from roseinfer.models.cpu_linear import CpuLinear
from roseinfer.models.layers import LogitsHead, PagedAttention, embedding


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
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        e, h = cfg.n_embd, cfg.n_head
        inner = cfg.n_inner or 4 * e
        self.ln_1 = nn.LayerNorm(e, eps=cfg.layer_norm_epsilon)
        self.c_attn = nn.Linear(e, 3 * e)
        self.attn_proj = nn.Linear(e, e)
        self.ln_2 = nn.LayerNorm(e, eps=cfg.layer_norm_epsilon)
        self.c_fc = nn.Linear(e, inner)
        self.mlp_proj = nn.Linear(inner, e)
        self.attn = PagedAttention(layer_idx, h, h, e // h, (e // h) ** -0.5)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None):
        """Returns (this block's output, the residual stream before it is added):
        the next norm adds the two in one fused kernel."""
        h, residual = layer_norm(self.ln_1, x, residual)
        q, k, v = self.c_attn(h).chunk(3, dim=-1)
        h, residual = layer_norm(self.ln_2, self.attn_proj(self.attn(q, k, v)), residual)
        return self.mlp_proj(linear_gelu_tanh(h, self.c_fc)), residual


class GPT2ForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte = embedding(cfg.vocab_size, cfg.n_embd)
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
