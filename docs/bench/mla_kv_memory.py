"""K/V memory a token takes with latent attention, against the same model with its heads
decompressed (ordinary multi-head attention: 2 x heads x head dims a layer), and the
tokens a GPU's cache then holds: the model built on the meta device (no memory), its
cache shape read as the engine reads it (core/device_side.py), bf16.

    python3 docs/bench/mla_kv_memory.py [--gpu-gib 139.8] [--utilization 0.9]
"""
import argparse

import torch

from roseinfer.core.device_side import _kv_shape
from roseinfer.models import model_class
from roseinfer.models.loader import RANDOM

SHAPES = ("deepseek-v2-lite-random", "moonlight-16b-a3b-random")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gpu-gib", type=float, default=139.8, help="an H200's, as torch sees it")
    p.add_argument("--utilization", type=float, default=0.9)
    a = p.parse_args()
    print("| shape | weights (bf16) | latent K/V a token | decompressed MHA a token | ratio | "
          f"tokens in {a.utilization:.0%} of {a.gpu_gib:g} GiB, latent | decompressed |")
    print("|---|---|---|---|---|---|---|")
    for name in SHAPES:
        cfg, _ = RANDOM[name]()
        with torch.device("meta"):
            model = model_class(cfg)(cfg).to(torch.bfloat16)
        weights = sum(t.numel() for t in model.parameters()) * 2
        groups, kv_heads, head_dim, values_are_keys = _kv_shape(model)
        layers = cfg.num_hidden_layers
        latent = layers * (1 if values_are_keys else 2) * kv_heads * head_dim * 2
        mha = layers * cfg.num_attention_heads * (
            cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * 2
        room = a.gpu_gib * 2**30 * a.utilization - weights  # activations not counted
        print(f"| {name.removesuffix('-random')} | {weights / 1e9:.1f} GB | "
              f"{latent / 1024:.1f} KiB | {mha / 1024:.1f} KiB | {mha / latent:.1f}x | "
              f"{room / latent / 1e6:.2f} M | {room / mha / 1e6:.2f} M |")


if __name__ == "__main__":
    main()
