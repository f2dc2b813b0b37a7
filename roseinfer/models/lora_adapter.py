"""LoRA adapters in PEFT's format (``adapter_config.json`` and
``adapter_model.safetensors``): read, checked against the model they adapt, scaled and
cut to this rank of a tensor-parallel group.

An adapted projection is one of a Llama-family layer's: q, k, v and o of its attention,
gate, up and down of its MLP. q/k/v and gate/up are one fused projection each here
(models/llama.py), so each part is a slice of it: ``weights[(layer, "qkv_proj")]`` holds
the (A, B) pair of q, k and v, None for a part the adapter leaves alone.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from roseinfer.core.errors import ConfigError
from roseinfer.models import sharding

# PEFT's module name: (our fused projection, its slice)
PARTS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0),
         "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
SLICES = {"qkv_proj": 3, "o_proj": 1, "gate_up_proj": 2, "down_proj": 1}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# Settings whose other values change what the weights mean: refused rather than misread.
_PLAIN = {"use_dora": False, "fan_in_fan_out": False, "bias": "none"}


class AdapterError(ConfigError):
    """An adapter roseinfer refuses; the message names it and what is wrong."""


@dataclass
class Adapter:
    name: str
    path: str
    rank: int
    # (layer, fused projection) -> per slice (A [rank, in], B [out, rank] scaled), or None;
    # as the engine holds it, packed (layers/lora.py: LoraLinear.pack)
    weights: dict[tuple[int, str], list] = field(default_factory=dict)

    def nbytes(self) -> int:
        def size(x) -> int:
            if isinstance(x, torch.Tensor):
                return x.numel() * x.element_size()
            return sum(size(y) for y in x) if x is not None else 0
        return size(list(self.weights.values()))


def read(name: str, path: str, cfg, shard_rule, max_rank: int, adapted: set,
         dtype: torch.dtype) -> Adapter:
    """The adapter at ``path`` for the model of HF config ``cfg`` (whose class cuts
    tensors with ``shard_rule``); ``adapted``: the (layer, projection) pairs this model
    adapts. Raises AdapterError naming what is wrong."""
    config = _config(name, path)
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"adapter {name!r}: adapter_config.json's r must be a positive "
                           f"integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"adapter {name!r} has rank {rank}, above max_lora_rank "
                           f"{max_rank}: start the engine with --max-lora-rank {rank} or more")
    alpha = rank if alpha is None else alpha
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs = _pairs(name, path, rank)
    dims = _dims(cfg)
    adapter = Adapter(name, path, rank)
    for (layer, module), (a, b) in sorted(pairs.items()):
        fused, part = PARTS[module]
        if (layer, fused) not in adapted:
            raise AdapterError(f"adapter {name!r} adapts layers.{layer}.{module}, which this "
                               f"model does not serve adapters on (its layers "
                               f"{_describe(adapted)})")
        _check_shape(name, layer, module, a, b, dims[module])
        a, b = _cut(shard_rule(f"layers.{layer}.{module}.weight", cfg), a, b)
        parts = adapter.weights.setdefault((layer, fused), [None] * SLICES[fused])
        parts[part] = (a.to(dtype), (b.float() * scaling).to(dtype))
    return adapter


def _config(name: str, path: str) -> dict:
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise AdapterError(f"adapter {name!r}: {path} has no adapter_config.json; give the "
                           "folder PEFT's save_pretrained wrote")
    try:
        with open(cfg_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter {name!r}: {cfg_path} is not readable JSON: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r} is not a LoRA adapter (peft_type "
                           f"{config.get('peft_type') if isinstance(config, dict) else None!r})")
    for key, plain in _PLAIN.items():
        if config.get(key, plain) != plain:
            raise AdapterError(f"adapter {name!r} sets {key}={config[key]!r}; roseinfer serves "
                               f"LoRA adapters with {key}={plain!r}")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            raise AdapterError(f"adapter {name!r} sets {key}; roseinfer serves adapters with "
                               "one rank and alpha and no modules to save: merge them first")
    return config


def _pairs(name: str, path: str, rank: int) -> dict[tuple[int, str], tuple]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise AdapterError(f"adapter {name!r}: {path} has no adapter_model.safetensors (save "
                           "the adapter with safe_serialization=True)")
    try:
        tensors = load_file(file)
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"adapter {name!r}: {file} is not a readable safetensors file: "
                           f"{e}") from None
    found: dict[tuple[int, str], dict] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in PARTS:
            raise AdapterError(f"adapter {name!r} holds {key}: roseinfer adapts "
                               f"{', '.join(PARTS)} of each layer only")
        found.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    if not found:
        raise AdapterError(f"adapter {name!r}: {file} holds no LoRA weights")
    pairs = {}
    for (layer, module), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: layers.{layer}.{module} has lora_"
                               f"{''.join(ab)} but not its other half")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(f"adapter {name!r}: layers.{layer}.{module}'s lora_A "
                               f"{list(a.shape)} and lora_B {list(b.shape)} are not of rank "
                               f"{rank}, adapter_config.json's r")
        pairs[layer, module] = (a, b)
    return pairs


def _dims(cfg) -> dict[str, tuple[int, int]]:
    """(inputs, outputs) of each adapted module of the whole (unsharded) model."""
    from roseinfer.models.llama import heads_of

    e, (h, hkv, d), inter = cfg.hidden_size, heads_of(cfg), cfg.intermediate_size
    return {"q_proj": (e, h * d), "k_proj": (e, hkv * d), "v_proj": (e, hkv * d),
            "o_proj": (h * d, e), "gate_proj": (e, inter), "up_proj": (e, inter),
            "down_proj": (inter, e)}


def _check_shape(name: str, layer: int, module: str, a, b, dims: tuple[int, int]) -> None:
    if (a.shape[1], b.shape[0]) != dims:
        raise AdapterError(f"adapter {name!r}: layers.{layer}.{module} maps {a.shape[1]} to "
                           f"{b.shape[0]} features, this model's {dims[0]} to {dims[1]}: it "
                           "was made for another base model")


def _cut(rule: sharding.Shard | None, a: torch.Tensor, b: torch.Tensor) -> tuple:
    """This rank's A and B: a layer split by its outputs (q/k/v, gate/up) splits B's rows,
    one split by its inputs (o, down) A's columns; the other factor stays whole."""
    if rule is None:
        return a, b
    if rule.dim == 0:
        return a, sharding.take(b, rule).contiguous()
    return sharding.take(a, rule).contiguous(), b


def _describe(adapted: set) -> str:
    layers = sorted({layer for layer, _ in adapted})
    modules = sorted({m for _, m in adapted})
    return f"{layers[0]}..{layers[-1]}: {', '.join(modules)}" if layers else "none"
