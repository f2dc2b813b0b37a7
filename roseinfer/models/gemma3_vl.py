"""Gemma 3 with images: Gemma 3's decoder (models/gemma.py), a SigLIP vision tower and a
projector whose features take the place of the prompt's image tokens.

Each image is resized to the tower's square (896 x 896 in the released checkpoints), and
its patch features are average-pooled to ``mm_tokens_per_image`` (256) and projected to
the decoder's width: every image is that many tokens. The tower and projector are
transformers' own modules, run off the step (core/image_encoder.py); their weights load
with the checkpoint's. Positions stay one-dimensional (the decoder's RoPE). What differs
from a text prompt is the attention: an image's tokens see each other both ways
(``bidirectional_images``): in a prompt step each of them sees the keys up to its image's
last token (core/multimodal.py ``step_inputs``, the attention backends' ``visible``), and
a prompt chunk never ends inside an image (``Images.chunk``)."""
from __future__ import annotations

import copy

import torch

from roseinfer.core.attention import get_context
from roseinfer.models.gemma import GemmaForCausalLM
from roseinfer.models.llama import LlamaForCausalLM

_IMAGE_PARTS = ("vision_tower.", "multi_modal_projector.")


class Gemma3ForConditionalGeneration(GemmaForCausalLM):
    bidirectional_images = True
    merge = 1  # an image's grid is its tokens (core/multimodal.py counts them so)

    def __init__(self, cfg):
        super().__init__(cfg)
        from transformers import AutoModel, Gemma3Config
        from transformers.models.gemma3.image_processing_pil_gemma3 import \
            Gemma3ImageProcessorPil
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        vision = copy.deepcopy(cfg.vision_config)
        self.vision_tower = AutoModel.from_config(vision)
        self.multi_modal_projector = Gemma3MultiModalProjector(Gemma3Config(
            text_config={"hidden_size": cfg.hidden_size}, vision_config=vision.to_dict(),
            mm_tokens_per_image=cfg.mm_tokens_per_image))
        self.image_token_id = cfg.image_token_id
        self.marks = cfg.boi_token_id, cfg.eoi_token_id  # around an image's tokens
        self.side = int(cfg.mm_tokens_per_image ** 0.5)  # tokens a side of an image
        size = vision.image_size
        self.image_processor = Gemma3ImageProcessorPil.from_dict({
            "size": {"height": size, "width": size}, "image_mean": [0.5] * 3,
            "image_std": [0.5] * 3, **getattr(cfg, "preprocessor_config", {})})

    def bind_head(self) -> None:
        super().bind_head()
        # SigLIP's position ids are a buffer its checkpoint does not hold: made again
        # where the module was built on the meta device
        embeddings = self.vision_tower.embeddings
        embeddings.position_ids = torch.arange(
            embeddings.num_positions, device=self.embed_tokens.weight.device)[None]

    def prompt_text(self, text: str, tokenizer) -> str:
        """As Gemma 3's processor: each ``<start_of_image>`` the chat template writes becomes
        the image's sequence, two newlines, the marker, the image's tokens (one here: the
        engine widens it), ``<end_of_image>``, two newlines; tokenized as a whole after."""
        start, image, end = tokenizer.convert_ids_to_tokens(
            [self.marks[0], self.image_token_id, self.marks[1]])
        return text.replace(start, f"\n\n{start}{image}{end}\n\n")

    def image_inputs(self, picture) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixels [1, 3, size, size], grid [1, 3]: 1 x side x side tokens) of a picture."""
        pixels = self.image_processor(images=[picture], return_tensors="pt")["pixel_values"]
        return pixels, torch.tensor([[1, self.side, self.side]])

    def image_positions(self, ids: list[int], grids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Every token's position is its index (the three parts equal), none shifted."""
        return torch.arange(len(ids)).expand(3, -1), 0

    @torch.inference_mode()
    def encode_images(self, pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        """[images x tokens an image, hidden]: each image token's feature, in order."""
        param = self.embed_tokens.weight
        patches = self.vision_tower(pixel_values=pixels.to(param.device, param.dtype))
        features = self.multi_modal_projector(patches.last_hidden_state)
        return features.reshape(-1, features.shape[-1])

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Gemma's scaled embeddings; an image token's is its feature, unscaled."""
        x = super().embed(input_ids)
        images = get_context().model_inputs
        if images is not None and images.rows.numel():
            x[images.rows] = images.features.to(x.dtype)
        return x

    @staticmethod
    def convert_hf_state_dict(sd: dict, cfg) -> dict:
        """The decoder's tensors as Gemma's, the tower's and projector's under their
        modules' names: ``model.`` before them in transformers' own, not on disk, where
        the tower's are also under ``vision_model.`` (the SigLIP module of the day)."""
        parts, text = {}, {}
        for key, t in sd.items():
            name = key.removeprefix("model.")
            if name.startswith(_IMAGE_PARTS):
                parts[name.replace("vision_tower.vision_model.", "vision_tower.")] = t
            else:
                text[key] = t
        return {**GemmaForCausalLM.convert_hf_state_dict(text, cfg), **parts}

    @staticmethod
    def shard_rule(key: str, cfg):
        """Llama's; the image parts are read whole on every rank."""
        if key.removeprefix("model.").startswith(_IMAGE_PARTS):
            return None
        return LlamaForCausalLM.shard_rule(key, cfg)
