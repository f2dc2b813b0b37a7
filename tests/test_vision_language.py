"""Vision-language models: Qwen2.5-VL (models/qwen2_5_vl.py) against transformers' own model
on tiny random configs, images prepared by the same processor: greedy ids equal with one
image, with two of different sizes, with text only, with image tokens split over prompt
chunks, beside text-only requests; the M-RoPE positions equal transformers'; prefix-cache
blocks shared only by prompts with the same images; bad image inputs refused by name,
a decompression bomb before its pixels are decoded (core/multimodal.py)."""
import io

import numpy as np
import pytest
import torch

from roseinfer import LLM, SamplingParams
from roseinfer.core.errors import InvalidRequestError
from tests.conftest import DEVICE

IMAGE, START, END = 300, 301, 302
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf():
    """Two decoder layers (4 heads of 16, M-RoPE sections 2/3/3), a two-block tower (one
    windowed, one full), 2 x 2 merging into the decoder's width."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                          "rope_theta": 10000.0},
                         max_position_embeddings=1024, initializer_range=0.1),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                           initializer_range=0.1),
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END,
        bos_token_id=0, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


@pytest.fixture(scope="module")
def llm(hf):
    with LLM(hf, device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=256) as llm:
        yield llm


def picture(height, width, seed):
    from PIL import Image

    pixels = np.random.RandomState(seed).rand(height, width, 3) * 255
    return Image.fromarray(pixels.astype("uint8"))


def reference(hf, llm, ids, images, max_tokens=10):
    """transformers' greedy ids for the widened prompt ``ids`` and its images."""
    kwargs = {}
    if images:
        prepared = llm.engine.model.image_processor(images=images, return_tensors="pt")
        kwargs = dict(pixel_values=prepared["pixel_values"],
                      image_grid_thw=prepared["image_grid_thw"],
                      mm_token_type_ids=(torch.tensor([ids]) == IMAGE).int())
    hf.model.rope_deltas = None  # transformers keeps the last prompt's offset between calls
    out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_tokens,
                      attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                      do_sample=False, eos_token_id=None, pad_token_id=0, **kwargs)
    return out[0, len(ids):].tolist()


def with_images(ids, images):
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}


ONE = [5, 6, 7, START, IMAGE, END, 8, 9, 10]
TWO = [5, START, IMAGE, END, 11, 12, START, IMAGE, END, 13]


def test_greedy_equals_transformers_with_one_and_two_images_and_text(hf, llm):
    """A batch: one image (56 x 84: 2 x 3 merged features), two of different sizes (56 x
    56 and 84 x 112, the second bytes of a PNG), and a text-only prompt."""
    a, b, c = picture(56, 84, 0), picture(56, 56, 1), picture(84, 112, 2)
    png = io.BytesIO()
    c.save(png, format="PNG")
    prompts = [with_images(ONE, a), with_images(TWO, [b, png.getvalue()]), [5, 6, 7, 8, 9]]
    outs = llm.generate(prompts, GREEDY)
    assert len(outs[0].prompt_token_ids) == len(ONE) - 1 + 6
    assert len(outs[1].prompt_token_ids) == len(TWO) - 2 + 4 + 12
    assert outs[0].token_ids == reference(hf, llm, outs[0].prompt_token_ids, [a])
    assert outs[1].token_ids == reference(hf, llm, outs[1].prompt_token_ids, [b, c])
    assert outs[2].token_ids == reference(hf, llm, [5, 6, 7, 8, 9], None)


def test_image_tokens_split_over_prompt_chunks(hf):
    """5-token chunks cut an image's 12 features apart; a text request decodes beside."""
    image = picture(84, 112, 3)
    with LLM(hf, device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=256,
             max_num_batched_tokens=5, max_mixed_prefill_tokens=5) as llm:
        outs = llm.generate([[9, 8, 7], with_images(ONE, image)], GREEDY)
        assert outs[1].token_ids == reference(hf, llm, outs[1].prompt_token_ids, [image])
        assert outs[0].token_ids == reference(hf, llm, [9, 8, 7], None)


def test_positions_equal_transformers(hf, llm):
    images = [picture(56, 84, 4), picture(84, 56, 5)]
    widened = llm.generate([with_images(TWO, images)], SamplingParams(max_tokens=1))[0]
    ids = widened.prompt_token_ids
    grids = llm.engine.model.image_processor(images=images, return_tensors="pt")[
        "image_grid_thw"]
    ours, delta = llm.engine.model.image_positions(ids, grids)
    kinds = (torch.tensor([ids]) == IMAGE).int()
    theirs, deltas = hf.model.get_rope_index(torch.tensor([ids]), kinds, grids)
    assert torch.equal(ours, theirs[:, 0]) and delta == int(deltas[0, 0])


def test_cached_blocks_are_shared_only_by_the_same_images(hf, llm):
    """The same ids with another image hit nothing; with the same image, every full block
    but the last."""
    a, b = picture(56, 84, 6), picture(56, 84, 7)
    first = llm.generate([with_images(ONE, a)], GREEDY)[0]
    other = llm.generate([with_images(ONE, b)], GREEDY)[0]
    again = llm.generate([with_images(ONE, a)], GREEDY)[0]
    assert other.num_cached_tokens == 0 and again.num_cached_tokens == 12
    assert other.token_ids == reference(hf, llm, other.prompt_token_ids, [b])
    assert again.token_ids == first.token_ids


def declared_png(width: int, height: int) -> bytes:
    """A small PNG whose header declares ``width`` x ``height`` pixels (a decompression
    bomb's shape: its pixels are never there)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(
        b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("prompt, match", [
    (with_images(ONE, declared_png(10_000, 10_000)), "10000 x 10000 pixels"),
    (with_images(ONE, declared_png(100_000, 100_000)), "decompression bomb"),
    (with_images(ONE, b"\x00" * (33 << 20)), "at most 33,554,432"),
    (with_images([IMAGE] * 1000, [picture(28, 28, 9)] * 1000), "at most 16"),
    (with_images(ONE, [picture(56, 56, 8)] * 2), "2 images"),
    (with_images(ONE, b"not an image"), "not a readable image"),
    (with_images(ONE, 3), "PIL image or encoded bytes"),
    ({"prompt_token_ids": ONE, "multi_modal_data": {"video": []}}, "only images"),
    ({"prompt_token_ids": ONE, "images": []}, "unknown prompt keys"),
], ids=["pixels", "bomb", "encoded-size", "thousand", "count", "bytes", "type", "video", "key"])
def test_bad_image_inputs_are_refused_by_name(llm, prompt, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate([prompt], GREEDY)
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2))[0].token_ids


def test_a_text_model_refuses_images(llama_model):
    with LLM(llama_model, device=DEVICE, dtype="float32", num_kv_blocks=64) as llm:
        with pytest.raises(InvalidRequestError, match="takes no images"):
            llm.generate([with_images([5, 6], picture(56, 56, 9))], GREEDY)
