"""Tiny Qwen2.5-VL models, pictures and transformers' greedy reference, for the
vision-language tests (tests/test_vision_language.py, tests/frontends/test_vision_serving.py)."""
import struct
import zlib

import numpy as np
import torch


# Qwen2-VL's chat template, its image branch: one image token a picture, between its marks
QWEN_VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_qwen2_5_vl(vocab: int = 512, image: int = 300, start: int = 301, end: int = 302):
    """Two decoder layers (4 heads of 16, M-RoPE sections 2/3/3), a two-block tower (one
    windowed, one full), 2 x 2 merging into the decoder's width; ``image``, ``start``,
    ``end``: the image token and the ids around it."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                          "rope_theta": 10000.0},
                         max_position_embeddings=1024, initializer_range=0.1),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                           initializer_range=0.1),
        image_token_id=image, vision_start_token_id=start, vision_end_token_id=end,
        bos_token_id=0, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def picture(height, width, seed):
    from PIL import Image

    pixels = np.random.RandomState(seed).rand(height, width, 3) * 255
    return Image.fromarray(pixels.astype("uint8"))


def reference(hf, model, ids, images, max_tokens=10):
    """transformers' greedy ids for the widened prompt ``ids`` and its images, prepared by
    ``model``'s (roseinfer's) image processor."""
    kwargs = {}
    if images:
        prepared = model.image_processor(images=images, return_tensors="pt")
        kwargs = dict(pixel_values=prepared["pixel_values"],
                      image_grid_thw=prepared["image_grid_thw"],
                      mm_token_type_ids=(torch.tensor([ids]) == hf.config.image_token_id).int())
    hf.model.rope_deltas = None  # transformers keeps the last prompt's offset between calls
    out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_tokens,
                      attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)
    return out[0, len(ids):].tolist()


def declared_png(width: int, height: int) -> bytes:
    """A small PNG whose header declares ``width`` x ``height`` pixels (a decompression
    bomb's shape: its pixels are never there)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(
        b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


def tiny_gemma3_vl(vocab: int = 512, image: int = 300, start: int = 301, end: int = 302):
    """Gemma 3 with images: two decoder layers (a window of 16, then a global one; 4 heads
    of 16), a one-layer SigLIP tower over 56 x 56 pixels in 14-pixel patches, pooled 2 x 2
    to 4 tokens an image; ``image``, ``start``, ``end``: the image token and the ids around
    it. Norms and the projector drawn away from their zero starts, so that they matter."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    config = Gemma3Config(
        text_config=dict(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
                         layer_types=["sliding_attention", "full_attention"],
                         max_position_embeddings=1024, rope_parameters={
                             "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 10000.0}}),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=56, patch_size=14),
        mm_tokens_per_image=4, image_token_index=image, boi_token_index=start,
        eoi_token_index=end, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    hf = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name and "vision_tower" not in name:
                p.uniform_(-0.5, 0.5)
            elif name.endswith("mm_input_projection_weight"):
                p.normal_(0, 0.3)
    return hf


def gemma3_reference(hf, model, ids, images, max_tokens=10):
    """transformers' greedy ids for the widened prompt ``ids`` and its images, prepared by
    ``model``'s (roseinfer's) image processor; its image tokens attend both ways."""
    kwargs = {}
    if images:
        kwargs = dict(pixel_values=torch.cat([model.image_inputs(i)[0] for i in images]),
                      token_type_ids=(torch.tensor([ids]) == hf.config.image_token_id).long())
    out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_tokens,
                      attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)
    return out[0, len(ids):].tolist()
