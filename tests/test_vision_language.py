"""Vision-language models: Qwen2.5-VL (models/qwen2_5_vl.py) against transformers' own model
on tiny random configs, images prepared by the same processor: greedy ids equal with one
image, with two of different sizes, with text only, with image tokens split over prompt
chunks, beside text-only requests; the M-RoPE positions equal transformers'; prefix-cache
blocks shared only by prompts with the same images; bad image inputs refused by name,
a decompression bomb before its pixels are decoded (core/multimodal.py)."""
import io
import threading

import pytest
import torch

from roseinfer import LLM, SamplingParams
from roseinfer.core.errors import InvalidRequestError
from tests.conftest import DEVICE
from tests.vision_models import declared_png, picture, reference, tiny_qwen2_5_vl

IMAGE, START, END = 300, 301, 302
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf():
    return tiny_qwen2_5_vl(512, IMAGE, START, END)


@pytest.fixture(scope="module")
def llm(hf):
    with LLM(hf, device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=256) as llm:
        yield llm


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
    assert outs[0].token_ids == reference(hf, llm.engine.model, outs[0].prompt_token_ids, [a])
    assert outs[1].token_ids == reference(hf, llm.engine.model, outs[1].prompt_token_ids, [b, c])
    assert outs[2].token_ids == reference(hf, llm.engine.model, [5, 6, 7, 8, 9], None)


def test_the_towers_windows_attend_in_one_call_a_block(hf, llm, monkeypatch):
    """transformers' tower over torch's SDPA attends one window a call; built here, each
    block's windows go through one packed call (layers/encoder_attention.py), and the
    reference model's own config is left as it was."""
    from roseinfer.layers import encoder_attention
    calls = []
    attend = encoder_attention.packed_attention
    monkeypatch.setattr(encoder_attention, "packed_attention",
                        lambda q, *a, **k: calls.append(q.shape[0]) or attend(q, *a, **k))
    model = llm.engine.model
    pixels = model.image_processor(images=[picture(112, 168, 9)], return_tensors="pt")
    model.encode_images(pixels["pixel_values"], pixels["image_grid_thw"])
    blocks = hf.config.vision_config.depth
    assert len(calls) == blocks and set(calls) == {8 * 12}
    assert hf.config.vision_config._attn_implementation != encoder_attention.TOWER_ATTENTION


def test_image_tokens_split_over_prompt_chunks(hf):
    """5-token chunks cut an image's 12 features apart; a text request decodes beside."""
    image = picture(84, 112, 3)
    with LLM(hf, device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=256,
             max_num_batched_tokens=5, max_mixed_prefill_tokens=5) as llm:
        outs = llm.generate([[9, 8, 7], with_images(ONE, image)], GREEDY)
        assert outs[1].token_ids == reference(hf, llm.engine.model, outs[1].prompt_token_ids, [image])
        assert outs[0].token_ids == reference(hf, llm.engine.model, [9, 8, 7], None)


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
    assert other.token_ids == reference(hf, llm.engine.model, other.prompt_token_ids, [b])
    assert again.token_ids == first.token_ids


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


def test_a_checkpoint_directory_prepares_images_as_its_preprocessor_config_says(hf, tmp_path):
    """The checkpoint's pixel bounds (here at most 56 x 56 pixels: a 112 x 112 image gives
    4 features, not the processor defaults' 16), as transformers' own processor reads
    them from the same directory."""
    import json
    import types

    from transformers import AutoImageProcessor

    hf.save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 784,
        "max_pixels": 3136, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}))
    theirs = types.SimpleNamespace(image_processor=AutoImageProcessor.from_pretrained(tmp_path))
    image = picture(112, 112, 10)
    with LLM(str(tmp_path), device=DEVICE, dtype="float32", block_size=4,
             num_kv_blocks=64) as llm:
        out = llm.generate([with_images(ONE, image)], GREEDY)[0]
    assert len(out.prompt_token_ids) == len(ONE) - 1 + 4
    assert out.token_ids == reference(hf, theirs, out.prompt_token_ids, [image])


def test_an_image_seen_before_is_not_encoded_again(hf, llm, monkeypatch):
    """A second turn with the same image takes its features from the encoder cache; a
    prompt with that image and a new one encodes only the new one; outputs stay exact."""
    a, b = picture(56, 84, 11), picture(84, 56, 12)
    encoded = []
    model = llm.engine.model
    encode = model.encode_images
    monkeypatch.setattr(model, "encode_images",
                        lambda pixels, grids: encoded.append(grids.tolist()) or encode(pixels, grids))
    first = llm.generate([with_images(ONE, a)], GREEDY)[0]
    turn = llm.generate([with_images(ONE + [14, 15], a)], GREEDY)[0]
    both = llm.generate([with_images(TWO, [a, b])], GREEDY)[0]
    assert encoded == [[[1, 4, 6]], [[1, 6, 4]]]  # a once, then b alone
    assert turn.token_ids == reference(hf, model, turn.prompt_token_ids, [a])
    assert both.token_ids == reference(hf, model, both.prompt_token_ids, [a, b])
    assert first.token_ids == reference(hf, model, first.prompt_token_ids, [a])
    assert llm.engine.encoder.cache.hits >= 2


def test_an_image_sent_again_is_not_prepared_again(hf, monkeypatch):
    """The same image bytes in a conversation's next turn skip the image processor (their
    features are in the encoder cache); the same pixels as a new PIL image, or bytes whose
    features were dropped meanwhile, are prepared again; outputs stay exact."""
    a = picture(56, 84, 21)
    png = io.BytesIO()
    a.save(png, format="PNG")
    with LLM(hf, device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=256) as llm:
        model, cache = llm.engine.model, llm.engine.encoder.cache
        process = model.image_processor

        def run(ids, image):
            """The output, and the image processor's calls it made."""
            calls = []
            monkeypatch.setattr(model, "image_processor",
                                lambda **k: calls.append(1) or process(**k))
            out = llm.generate([with_images(ids, image)], GREEDY)[0]
            monkeypatch.setattr(model, "image_processor", process)
            assert out.token_ids == reference(hf, model, out.prompt_token_ids, [a])
            return len(calls)
        assert run(ONE, png.getvalue()) == 1
        assert run(ONE + [14, 15], png.getvalue()) == 0
        assert run(ONE, picture(56, 84, 21)) == 1  # a new PIL image of the same pixels
        cache._features.clear()  # dropped under the byte budget meanwhile
        cache.bytes = 0
        assert run(ONE + [16], png.getvalue()) == 1


def test_the_encoder_cache_keeps_the_recent_images_within_its_bytes():
    from roseinfer.core.encoder_cache import EncoderCache

    cache = EncoderCache(max_bytes=3 * 400)
    for key in range(4):
        cache.put(key, torch.full((10, 10), float(key)))  # 400 bytes each
    assert len(cache) == 3 and cache.get(0) is None and cache.bytes == 1200
    assert torch.equal(cache.get(1), torch.full((10, 10), 1.0))
    cache.put(4, torch.zeros(10, 10))  # 2 is now the least recently used
    assert cache.get(2) is None and cache.get(1) is not None
    cache.put(5, torch.zeros(20, 20))  # larger than the budget: not kept
    assert cache.get(5) is None and len(cache) == 3


@pytest.mark.parametrize("beside", [False, True], ids=["in-step", "beside"])
def test_queued_images_go_through_the_tower_a_budget_a_step_batched(hf, monkeypatch, beside):
    """A budget of 16 image tokens a step: two requests' images (6 tokens each) in one
    call of the tower, the third's (12) in the next call; a text request decodes a token
    in every step meanwhile; every output exact. Beside: the calls on the side thread."""
    a, b, c = picture(56, 84, 13), picture(84, 56, 14), picture(84, 112, 15)
    with LLM(hf, device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=256,
             max_num_batched_tokens=16, encoder_beside_steps=beside) as llm:
        eng, calls = llm.engine, []
        encode = eng.model.encode_images
        monkeypatch.setattr(eng.model, "encode_images", lambda pixels, grids: calls.append(
            grids[:, 1:].tolist()) or encode(pixels, grids))
        eng.add_request("text", [5, 6, 7], GREEDY)
        while not eng.seqs["text"].token_ids[3:]:
            eng.step()
        for rid, image in (("a", a), ("b", b), ("c", c)):
            eng.add_request(rid, with_images(ONE, image), GREEDY)
        outs, text_tokens = {}, []
        while eng.has_unfinished():
            for out in eng.step():
                outs[out.request_id] = out
                if out.request_id == "text":
                    text_tokens.append(len(out.new_token_ids))
        assert calls == [[[4, 6], [6, 4]], [[6, 8]]]
        assert all(text_tokens[:4])  # decoding went on while the images were encoded
        model = eng.model
        for rid, image in (("a", a), ("b", b), ("c", c)):
            seq = outs[rid].seq
            assert seq.token_ids[seq.num_prompt_tokens:] == reference(
                hf, model, seq.token_ids[:seq.num_prompt_tokens], [image])


@pytest.mark.parametrize("beside", [False, True], ids=["in-step", "beside"])
def test_a_request_whose_image_the_tower_cannot_encode_fails_alone(hf, monkeypatch, beside):
    a, bad = picture(56, 84, 16), picture(84, 112, 17)
    with LLM(hf, device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=256,
             encoder_beside_steps=beside) as llm:
        encode = llm.engine.model.encode_images

        def failing(pixels, grids):
            if [6, 8] in grids[:, 1:].tolist():
                raise RuntimeError("out of memory in the tower")
            return encode(pixels, grids)
        monkeypatch.setattr(llm.engine.model, "encode_images", failing)
        eng = llm.engine
        eng.add_request("ok", with_images(ONE, a), GREEDY)
        eng.add_request("bad", with_images(ONE, bad), GREEDY)
        outs = {}
        while eng.has_unfinished():
            outs.update({o.request_id: o for o in eng.step() if o.finished})
        assert outs["bad"].finish_reason == "error" and "out of memory" in outs["bad"].seq.error
        seq = outs["ok"].seq
        assert seq.token_ids[seq.num_prompt_tokens:] == reference(
            hf, llm.engine.model, seq.token_ids[:seq.num_prompt_tokens], [a])
        assert not eng.encoder.pending


def test_beside_the_steps_decoding_goes_on_while_the_tower_runs(hf, monkeypatch):
    """The tower's call held on its thread (until the test lets it go): the text request
    decodes a token every step meanwhile and the image request waits; then it is admitted
    and exact, and a step with nothing else to run waits for the tower."""
    a, gate = picture(84, 56, 20), threading.Event()
    with LLM(hf, device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=256,
             encoder_beside_steps=True) as llm:
        eng = llm.engine
        encode = eng.model.encode_images
        monkeypatch.setattr(eng.model, "encode_images",
                            lambda pixels, grids: gate.wait(60) and encode(pixels, grids))
        eng.add_request("text", [5, 6, 7], SamplingParams(max_tokens=12, temperature=0,
                                                          ignore_eos=True))
        eng.add_request("image", with_images(ONE, a), GREEDY)
        text = [o for _ in range(8) for o in eng.step() if o.request_id == "text"]
        assert len(text) >= 6 and eng.seqs["image"].images.features is None
        threading.Timer(0.2, gate.set).start()  # after the text request ends
        outs = {}
        while eng.has_unfinished():
            outs.update({o.request_id: o for o in eng.step() if o.finished})
        seq = outs["image"].seq
        assert seq.token_ids[seq.num_prompt_tokens:] == reference(
            hf, eng.model, seq.token_ids[:seq.num_prompt_tokens], [a])
        assert outs["text"].seq.token_ids[3:] == llm.generate(
            [[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids


def test_a_request_whose_features_cannot_be_gathered_fails_alone(hf, monkeypatch):
    """Past the tower, putting a request's features together on the device may fail (its
    memory): that request fails, the one beside it is exact, the engine goes on."""
    from roseinfer.core import multimodal

    a, big = picture(56, 84, 18), picture(84, 112, 19)
    complete = multimodal.Images.complete

    def failing(self, device):
        if 12 in self.counts:
            raise torch.cuda.OutOfMemoryError("no memory for 12 features")
        complete(self, device)
    monkeypatch.setattr(multimodal.Images, "complete", failing)
    with LLM(hf, device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=256) as llm:
        eng, outs = llm.engine, {}
        eng.add_request("ok", with_images(ONE, a), GREEDY)
        eng.add_request("big", with_images(ONE, big), GREEDY)
        while eng.has_unfinished():
            outs.update({o.request_id: o for o in eng.step() if o.finished})
        assert outs["big"].finish_reason == "error" and "no memory" in outs["big"].seq.error
        seq = outs["ok"].seq
        assert seq.token_ids[seq.num_prompt_tokens:] == reference(
            hf, eng.model, seq.token_ids[:seq.num_prompt_tokens], [a])
        assert llm.generate([[5, 6]], SamplingParams(max_tokens=2))[0].token_ids


@pytest.mark.parametrize("bias", [False, True], ids=["qwen2.5-vl", "qwen3-vl"])
def test_the_patch_embedding_as_a_linear_equals_the_conv3d(bias):
    """layers/patch_embed.py against transformers' own Conv3d patch embedding."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionPatchEmbed

    from roseinfer.layers.patch_embed import as_linear

    torch.manual_seed(0)
    embed = Qwen2_5_VisionPatchEmbed(patch_size=14, temporal_patch_size=2, embed_dim=48)
    if bias:
        embed.proj.bias = torch.nn.Parameter(torch.randn(48))
    patches = torch.randn(37, 3 * 2 * 14 * 14)
    want = embed(patches)
    as_linear(embed)
    torch.testing.assert_close(embed(patches), want, rtol=1e-5, atol=1e-5)
