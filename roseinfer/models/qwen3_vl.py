"""Qwen3-VL: Qwen3's decoder (per-head q/k norms, no q/k/v bias) beside a vision tower, as
Qwen2.5-VL is built (models/qwen2_5_vl.py), with three differences:

- the tower is transformers' Qwen3-VL one (16-pixel patches, learned position embeddings
  resampled to each image's grid);
- M-RoPE's frequencies take their components interleaved (layers/rotary.py,
  ``interleaved``), not in three runs;
- DeepStack: the tower also hands out features from some of its middle blocks
  (``deepstack_visual_indexes``), and the first of the decoder's layers each add one of
  them to the hidden state at the image tokens. The encoder keeps them beside the main
  features, one row an image token (``encode_images``), so the encoder cache and the
  step's inputs carry them as one tensor.
"""
from __future__ import annotations

import torch

from roseinfer.core.attention import get_context
from roseinfer.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration


class Qwen3VLForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    qkv_bias = False
    interleaved = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.hidden = cfg.hidden_size
        self.deepstack = len(cfg.vision_config.deepstack_visual_indexes)

    @staticmethod
    def tower():
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
        return Qwen3VLVisionModel

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        images = get_context().model_inputs
        if images is not None and images.rows.numel():
            x[images.rows] = images.features[:, :self.hidden].to(x.dtype)
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed(input_ids), None
        images = get_context().model_inputs
        deep = images is not None and images.rows.numel() > 0
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions)
            if deep and i < self.deepstack:  # the hidden state is x + residual: add to x
                part = images.features[:, (i + 1) * self.hidden:(i + 2) * self.hidden]
                x[images.rows] += part.to(x.dtype)
        return self.final_norm(x, residual)

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        """[image tokens, hidden x (1 + DeepStack levels)]: each image token's feature,
        then its DeepStack features, in order."""
        param = self.embed_tokens.weight
        out = self.visual(pixels.to(param.device, param.dtype), grid_thw=grids.to(param.device))
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)
