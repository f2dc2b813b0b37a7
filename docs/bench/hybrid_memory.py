"""What one sequence holds in a hybrid model's caches, against the same shape with every
layer full attention: K/V a token in the paged cache (the model's own PagedAttention
layers) plus the recurrent layers' state a sequence (their ``state_shapes``), bf16 K/V and
convolution inputs, float32 SSM and delta-rule states. The models are built on the meta
device from the random-weight shapes (models/loader.py): nothing is allocated.

Usage: python3 docs/bench/hybrid_memory.py [--tokens 32768] [MODEL ...]
"""
import argparse

import torch

from roseinfer.core.plugins import default_registry
from roseinfer.core.recurrent import layers as recurrent_layers
from roseinfer.layers.attention import PagedAttention
from roseinfer.models.loader import RANDOM

KV_BYTES = 2  # bf16


def build(config):
    with torch.device("meta"):
        return default_registry().create("model", config.model_type, config)


def held(model, tokens: int) -> tuple[int, int]:
    """(K/V bytes at ``tokens`` tokens, state bytes) of one sequence."""
    kv = sum(2 * m.num_kv_heads * m.head_dim * KV_BYTES
             for m in model.modules() if isinstance(m, PagedAttention)) * tokens
    state = sum(torch.Size(shape).numel() * (4 if fp32 else KV_BYTES)
                for layer in recurrent_layers(model)
                for shape, fp32 in layer.state_shapes().values())
    return kv, state


def every_layer_attention(config):
    """The same config with every layer full attention."""
    config = config.__class__(**config.to_dict())
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    return config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("models", nargs="*", default=["qwen3-next-80b-a3b-random"])
    args = ap.parse_args()
    for name in args.models:
        config, _ = RANDOM[name]()
        kv, state = held(build(config), args.tokens)
        full_kv, full_state = held(build(every_layer_attention(config)), args.tokens)
        print(f"{name}, one sequence at {args.tokens} tokens: K/V {kv / 2**20:.1f} MiB + "
              f"state {state / 2**20:.1f} MiB = {(kv + state) / 2**20:.1f} MiB; every layer "
              f"full attention: {(full_kv + full_state) / 2**20:.1f} MiB; "
              f"{(kv + state) / (full_kv + full_state):.3f}x")


if __name__ == "__main__":
    main()
