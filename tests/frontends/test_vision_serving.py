"""Images through the queue: a tiny Qwen2.5-VL behind a worker on a real Redis, with GPT-2's
tokenizer and Qwen2-VL's way of rendering image parts. Chat content parts (bytes, a data
URL, OpenAI's image_url) from the Python client, the official `openai` client through the
gateway (chat completions and Responses) and `LLM.chat` give transformers' greedy ids; hostile images are refused by name,
fast, the worker alive and the next request exact."""
import base64
import io
import time

import openai
import pytest

from roseinfer import LLM, SamplingParams
from roseinfer.frontends.redis_streams.client import Client, RequestFailed
from roseinfer.frontends.redis_streams.protocol import Chat
from tests.vision_models import declared_png, picture, reference, tiny_qwen2_5_vl

# Qwen2-VL's chat template, its image branch: one image token a picture, between its marks
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for part in m['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def served(tiny_gpt2_dir):
    """(transformers' model, roseinfer's LLM) sharing weights and GPT-2's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    tokenizer.chat_template = TEMPLATE
    ids = tokenizer.convert_tokens_to_ids(SPECIALS[2:])
    hf = tiny_qwen2_5_vl(vocab=len(tokenizer) + 7, image=ids[1], start=ids[0], end=ids[2])
    llm = LLM(hf, tokenizer=tokenizer, device="cpu", dtype="float32", block_size=4,
              num_kv_blocks=512, max_num_seqs=4)
    yield hf, llm
    llm.engine.close()


def png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


def expected(served, messages_text: str, images) -> list[int]:
    """transformers' greedy ids for one user turn: the images, then the text."""
    hf, llm = served
    parts = [{"type": "image"}] * len(images) + [{"type": "text", "text": messages_text}]
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": parts}],
                                             tokenize=False, add_generation_prompt=True)
    prompt = {"prompt": text, "multi_modal_data": {"image": images}}
    widened = llm.generate([prompt], SamplingParams(max_tokens=1))[0].prompt_token_ids
    return reference(hf, llm.engine.model, widened, images, MAX_TOKENS)


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def test_content_parts_through_the_python_client_and_llm_chat(served, start_worker,
                                                              redis_server, prefix):
    """An image as bytes, one as a data URL, two in one turn: each equals transformers."""
    _, llm = served
    a, b = picture(56, 84, 0), picture(84, 56, 1)
    start_worker(llm.engine)
    client = Client(redis_server.url, prefix=prefix)
    greedy = dict(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    text = {"type": "text", "text": "What is this?"}
    one = client.generate(Chat(user({"type": "image", "data": png(a)}, text)), timeout=60,
                          **greedy)
    assert one.token_ids == expected(served, "What is this?", [a])
    two = client.generate(Chat(user({"type": "image_url", "url": data_url(a)},
                                    {"type": "image", "data": png(b)}, text)), timeout=60, **greedy)
    assert two.token_ids == expected(served, "What is this?", [a, b])
    assert two.usage["prompt_tokens"] > one.usage["prompt_tokens"]  # b's features counted
    chat = llm.chat(user({"type": "image_url", "image_url": {"url": data_url(b)}}, text),
                    SamplingParams(**greedy))
    assert chat.output.token_ids == expected(served, "What is this?", [b])


def test_the_openai_client_sends_an_image_to_the_gateway(served, start_worker, gateway):
    _, llm = served
    image = picture(56, 56, 2)
    start_worker(llm.engine)
    api = openai.OpenAI(base_url=f"{gateway().url}/v1", api_key="none", max_retries=0)
    messages = user({"type": "image_url", "image_url": {"url": data_url(image), "detail": "low"}},
                    {"type": "text", "text": "Describe it."})
    reply = api.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                        temperature=0, extra_body={"ignore_eos": True})
    want = llm.tokenizer.decode(expected(served, "Describe it.", [image]),
                                skip_special_tokens=True)
    assert reply.choices[0].message.content == want
    assert reply.usage.prompt_tokens > 16  # the image's 4 features and the template's text
    response = api.responses.create(model="tiny", max_output_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True}, input=[{
                                        "role": "user", "content": [
                                            {"type": "input_image", "image_url": data_url(image)},
                                            {"type": "input_text", "text": "Describe it."}]}])
    assert response.output_text == want
    for url, match in (("https://example.com/cat.png", "an http"),
                       ("data:image/png;base64,@@@", "not valid base64")):
        bad = user({"type": "image_url", "image_url": {"url": url}})
        with pytest.raises(openai.BadRequestError, match=match) as refused:
            api.chat.completions.create(model="tiny", messages=bad)
        assert refused.value.body["param"] == "messages[0].content[0].url"


HOSTILE = [
    ({"type": "image", "data": declared_png(100_000, 100_000)}, "decompression bomb"),
    ({"type": "image", "data": b"not an image"}, "not a readable image"),
    ({"type": "image", "data": "text, not bytes"}, "encoded bytes"),
    ({"type": "image_url", "url": "http://example.com/a.png"}, "nothing is fetched"),
    ({"type": "video", "data": b""}, "must be text, image or image_url"),
]


@pytest.mark.parametrize("part, match", HOSTILE, ids=["bomb", "corrupt", "not-bytes", "url",
                                                      "video"])
def test_hostile_images_are_refused_by_name_and_the_worker_goes_on(
        served, start_worker, redis_server, prefix, part, match):
    _, llm = served
    worker = start_worker(llm.engine)
    client = Client(redis_server.url, prefix=prefix)
    start = time.monotonic()
    with pytest.raises(RequestFailed, match=match) as refused:
        client.generate(Chat(user({"type": "text", "text": "hi"}, part)), timeout=30)
    assert time.monotonic() - start < 2.0
    assert "messages[0].content[1]" in refused.value.message
    image = picture(56, 56, 3)
    ok = client.generate(Chat(user({"type": "image", "data": png(image)},
                                   {"type": "text", "text": "ok?"})),
                         timeout=60, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    assert ok.token_ids == expected(served, "ok?", [image]) and worker.alive()


def test_a_thousand_images_and_an_image_to_a_text_model_are_refused(
        served, tiny_llm, start_worker, redis_server, prefix):
    _, llm = served
    client = Client(redis_server.url, prefix=prefix)
    tiny = png(picture(28, 28, 4))
    worker = start_worker(llm.engine)
    with pytest.raises(RequestFailed, match="1000 images; at most 16"):
        client.generate(Chat(user(*[{"type": "image", "data": tiny}] * 1000)), timeout=30)
    worker.stop()
    start_worker(tiny_llm.engine)  # GPT-2: text only
    with pytest.raises(RequestFailed, match="takes no images") as refused:
        client.generate(Chat(user({"type": "image", "data": tiny})), timeout=30)
    assert "messages[0].content[0]" in refused.value.message
    assert client.generate([5, 6], max_tokens=2, timeout=30).token_ids  # still serving
