"""Qwen2.5-VL: Qwen2's decoder with M-RoPE, and a vision transformer whose features take the
place of the prompt's image tokens.

The decoder is Llama's layers (q/k/v with biases) with multimodal rotary positions
(layers/rotary.py, ``MultimodalRotaryEmbedding``). The vision tower is transformers' own
module (windowed attention, 2 x 2 patch merging), run once an image when its request comes
in (core/multimodal.py), not in the step: its weights load with the checkpoint's. A step
that holds image tokens takes their features and three-part positions from the step's
model inputs; text-only requests run as Qwen2 does."""
from __future__ import annotations

import copy

import torch

from roseinfer.core.attention import get_context
from roseinfer.layers import patch_embed
from roseinfer.layers.encoder_attention import tower_attention
from roseinfer.layers.rotary import MultimodalRotaryEmbedding, RotaryEmbedding, interleaved, \
    rope_params, sectioned
from roseinfer.models.llama import LlamaForCausalLM


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    """A family built as this one with another tower or rotary sets them here (Qwen3-VL,
    models/qwen3_vl.py): ``qkv_bias``, ``tower``, ``interleaved`` (M-RoPE's components)."""
    qkv_bias = True
    interleaved = False

    def __init__(self, cfg):
        cfg.qkv_bias = self.qkv_bias
        super().__init__(cfg)
        vision = cfg.vision_config
        # A copy of the config, held by every module of the tower, names its attention
        # after the build (transformers looks for a flash package at a "flash" name then)
        self.visual = self.tower()._from_config(copy.deepcopy(vision))
        self.visual.config._attn_implementation = tower_attention()
        patch_embed.as_linear(self.visual.patch_embed)
        self.image_token_id, self.merge = cfg.image_token_id, vision.spatial_merge_size
        # Qwen2-VL's processor as the checkpoint's preprocessor_config.json sets it (the
        # pixels an image is resized within: Qwen2.5-VL's allow 12.8 M, the processor's
        # defaults 1 M), else at the tower's patch sizes with the processor's defaults
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil)
        self.image_processor = Qwen2VLImageProcessorPil.from_dict({
            "patch_size": vision.patch_size, "temporal_patch_size": vision.temporal_patch_size,
            "merge_size": vision.spatial_merge_size,
            **getattr(cfg, "preprocessor_config", {})})

    @staticmethod
    def tower():
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel)
        return Qwen2_5_VisionTransformerPretrainedModel

    @classmethod
    def rotaries(cls, cfg) -> list[RotaryEmbedding]:
        inv_freq, scaling = rope_params(cfg)
        sections = cfg.rope_parameters["mrope_section"]
        components = (interleaved if cls.interleaved else sectioned)(sections)
        return [MultimodalRotaryEmbedding(inv_freq, cfg.max_position_embeddings, components,
                                          scaling)] * cfg.num_hidden_layers

    def bind_head(self) -> None:
        super().bind_head()
        # The tower's rotary frequencies are a buffer its checkpoint does not hold: made
        # again where the module was built on the meta device
        rotary = self.visual.rotary_pos_emb
        inv_freq, _ = rotary.compute_axial_rope_parameters(rotary.config)
        rotary.inv_freq = inv_freq.to(self.embed_tokens.weight.device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        images = get_context().model_inputs
        if images is not None and images.rows.numel():
            x[images.rows] = images.features.to(x.dtype)
        return x

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        """The tower's features of images prepared by the image processor: a row an image
        token, in order."""
        param = self.embed_tokens.weight
        return self.visual(pixels.to(param.device, param.dtype),
                           grid_thw=grids.to(param.device)).pooler_output

    def image_inputs(self, picture) -> tuple[torch.Tensor, torch.Tensor]:
        """(patches, grid [1, 3]: time, height, width in patches) of a picture."""
        prepared = self.image_processor(images=[picture], return_tensors="pt")
        return prepared["pixel_values"], prepared["image_grid_thw"]

    def image_positions(self, ids: list[int], grids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(M-RoPE positions [3, P] of a prompt's tokens, the offset of every position past
        it): text tokens count on from the last position, each image's tokens are its grid
        (time 0, rows, columns) after it, and the next text starts past its larger side."""
        out, at, pos = [], 0, 0
        ids_t = torch.tensor(ids)
        image = (ids_t == self.image_token_id).tolist()
        for t, h, w in grids.tolist():
            h, w = h // self.merge, w // self.merge
            start = image.index(True, at)
            out.append(torch.arange(start - at).expand(3, -1) + pos)
            pos += start - at
            grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w),
                                  indexing="ij")
            out.append(torch.stack([g.flatten() for g in grid]) + pos)
            pos += max(h, w)
            at = start + t * h * w
        out.append(torch.arange(len(ids) - at).expand(3, -1) + pos)
        positions = torch.cat(out, dim=1)
        return positions, int(positions.max()) + 1 - len(ids)

    @staticmethod
    def convert_hf_state_dict(sd: dict, cfg) -> dict:
        """The decoder's tensors as Llama's (transformers' ``model.language_model.`` names or
        the checkpoints' ``model.``), the tower's under ``visual.``."""
        text, visual = {}, {}
        for key, t in sd.items():
            if key.startswith(("model.visual.", "visual.")):
                visual["visual." + key.split("visual.", 1)[1]] = t
            else:
                text[key.replace("model.language_model.", "model.")] = t
        return {**LlamaForCausalLM.convert_hf_state_dict(text, cfg), **visual}
