"""Gemma 3 with images (models/gemma3_vl.py) against transformers' own model on a tiny
random config, images prepared by the same processor: greedy ids equal with one image,
two, and text only, in one batch; with prompt chunks shorter than an image (a chunk never
ends inside one: its tokens attend both ways); beside decoding sequences; and through a
prefix-cache hit that ends inside an image."""
import pytest
import torch

from roseinfer import LLM, SamplingParams
from tests.conftest import DEVICE
from tests.vision_models import gemma3_reference, picture, tiny_gemma3_vl

IMAGE, START, END = 300, 301, 302
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
ONE = [5, 6, 7, START, IMAGE, END, 8, 9, 10]
TWO = [5, START, IMAGE, END, 11, 12, START, IMAGE, END, 13]


@pytest.fixture(scope="module")
def hf():
    return tiny_gemma3_vl(512, IMAGE, START, END)


def with_images(ids, images):
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}


def exact(hf, llm, prompts, outs):
    model = llm.engine.model
    for prompt, out in zip(prompts, outs):
        images = prompt["multi_modal_data"]["image"] if isinstance(prompt, dict) else []
        images = images if isinstance(images, list) else [images]
        n = out.seq.num_prompt_tokens
        assert out.token_ids == gemma3_reference(hf, model, out.seq.token_ids[:n], images)


@pytest.mark.parametrize("config", [{}, {"max_num_batched_tokens": 6}, {"block_size": 2}],
                         ids=["whole", "chunks-of-6", "blocks-of-2"])
def test_greedy_equals_transformers_with_one_and_two_images_and_text(hf, config):
    """One batch: an image, two images, text only. Chunks of 6 tokens, shorter than an
    image prompt: each chunk ends before an image or takes it whole."""
    a, b, c = picture(60, 40, 1), picture(56, 56, 2), picture(30, 90, 3)
    prompts = [with_images(ONE, a), with_images(TWO, [b, c]), [5, 6, 7, 8]]
    with LLM(hf, device=DEVICE, dtype="float32", **{"block_size": 4, "num_kv_blocks": 256,
                                                   **config}) as llm:
        outs = llm.generate(prompts, GREEDY)
        assert outs[0].seq.num_prompt_tokens == len(ONE) + 3  # one token widened to 4
        exact(hf, llm, prompts, outs)


def test_the_image_tokens_attend_both_ways(hf):
    """The same prompt with its image tokens causal is not what transformers computes:
    the check above could not pass without the bidirectional mask."""
    a = picture(60, 40, 4)
    with LLM(hf, device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=256,
             enable_prefix_cache=False) as llm:
        model = llm.engine.model
        causal = type(model).bidirectional_images
        try:
            type(model).bidirectional_images = False
            out = llm.generate([with_images(ONE, a)], SamplingParams(
                max_tokens=1, temperature=0, logprobs=0))[0]
        finally:
            type(model).bidirectional_images = causal
        ids = out.seq.token_ids[:out.seq.num_prompt_tokens]
        both = llm.generate([with_images(ONE, a)], SamplingParams(
            max_tokens=1, temperature=0, logprobs=0))[0]
    assert out.logprobs[0].logprob != both.logprobs[0].logprob
    assert both.token_ids == gemma3_reference(hf, model, ids, [a], max_tokens=1)


def test_an_image_prompt_joins_decoding_sequences(hf):
    """Text requests decode while an image prompt arrives in chunks beside them."""
    a = picture(48, 64, 5)
    with LLM(hf, device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=256,
             max_num_batched_tokens=8) as llm:
        eng, outs = llm.engine, {}
        eng.add_request("text", [5, 6, 7], GREEDY)
        eng.step()
        eng.add_request("image", with_images(ONE + [20, 21, 22, 23], a), GREEDY)
        while eng.has_unfinished():
            outs.update({o.request_id: o for o in eng.step() if o.finished})
        seq = outs["image"].seq
        assert seq.token_ids[seq.num_prompt_tokens:] == gemma3_reference(
            hf, eng.model, seq.token_ids[:seq.num_prompt_tokens], [a])


def test_a_prefix_hit_inside_an_image_computes_the_rest_of_it_whole(hf):
    """The same prompt again, ending with its image: the cached blocks end inside the image
    (blocks of 4: the image is tokens 2-5, the hit 4 tokens), whose cached tokens saw it
    whole when they were computed; the rest of it is computed in one chunk, exactly."""
    a = picture(56, 56, 6)
    prompt = [5, START, IMAGE]
    with LLM(hf, device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=256) as llm:
        first = llm.generate([with_images(prompt, a)], GREEDY)[0]
        second = llm.generate([with_images(prompt, a)], GREEDY)[0]
        assert second.seq.num_cached_tokens == 4
        for out in (first, second):
            n = out.seq.num_prompt_tokens
            assert out.token_ids == gemma3_reference(hf, llm.engine.model,
                                                     out.seq.token_ids[:n], [a])


def test_a_saved_checkpoint_takes_images(hf, tmp_path):
    """Loaded from a directory as transformers saves it (the tower's and projector's
    tensors under their names there): an image prompt's reply is exact."""
    hf.save_pretrained(tmp_path)
    a = picture(40, 60, 7)
    with LLM(str(tmp_path), device=DEVICE, dtype="float32", block_size=4,
             num_kv_blocks=256) as llm:
        out = llm.generate([with_images(ONE, a)], GREEDY)[0]
        n = out.seq.num_prompt_tokens
        assert out.token_ids == gemma3_reference(hf, llm.engine.model, out.seq.token_ids[:n],
                                                 [a])


def test_an_image_longer_than_a_step_is_refused_by_name(hf):
    """An image's tokens come in one chunk: one longer than a step's budget could never be
    computed, so the request is refused, not left waiting."""
    from roseinfer.core.errors import InvalidRequestError

    with LLM(hf, device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=256,
             max_num_batched_tokens=3) as llm:
        with pytest.raises(InvalidRequestError, match="max_num_batched_tokens"):
            llm.generate([with_images(ONE, picture(56, 56, 8))], GREEDY)
        assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids  # the engine goes on
