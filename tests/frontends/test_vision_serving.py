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
from tests.vision_models import QWEN_VL_TEMPLATE as TEMPLATE, declared_png, picture, \
    reference, tiny_qwen2_5_vl

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


def expected(served, text: str, images, text_first: bool = False) -> list[int]:
    """transformers' greedy ids for one user turn: the images, then the text (or the text
    first)."""
    hf, llm = served
    pictures, words = [{"type": "image"}] * len(images), [{"type": "text", "text": text}]
    parts = words + pictures if text_first else pictures + words
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": parts}],
                                             tokenize=False, add_generation_prompt=True)
    prompt = {"prompt": text, "multi_modal_data": {"image": images}}
    widened = llm.generate([prompt], SamplingParams(max_tokens=1))[0].prompt_token_ids
    return reference(hf, llm.engine.model, widened, images, MAX_TOKENS)


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def test_content_parts_through_the_python_client_and_llm_chat(served, start_worker,
                                                              redis_server, prefix):
    """An image as bytes, one as a data URL, two in one turn: each equals transformers.
    (The engine has one caller at a time: what runs it in this thread, the references and
    LLM.chat, runs before its worker starts.)"""
    _, llm = served
    a, b = picture(56, 84, 0), picture(84, 56, 1)
    want = [expected(served, "What is this?", images) for images in ([a], [a, b], [b])]
    greedy = dict(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    text = {"type": "text", "text": "What is this?"}
    chat = llm.chat(user({"type": "image_url", "image_url": {"url": data_url(b)}}, text),
                    SamplingParams(**greedy))
    assert chat.output.token_ids == want[2]
    start_worker(llm.engine)
    client = Client(redis_server.url, prefix=prefix)
    one = client.generate(Chat(user({"type": "image", "data": png(a)}, text)), timeout=60,
                          **greedy)
    assert one.token_ids == want[0]
    two = client.generate(Chat(user({"type": "image_url", "url": data_url(a)},
                                    {"type": "image", "data": png(b)}, text)), timeout=60, **greedy)
    assert two.token_ids == want[1]
    assert two.usage["prompt_tokens"] > one.usage["prompt_tokens"]  # b's features counted


def test_the_openai_client_sends_an_image_to_the_gateway(served, start_worker, gateway):
    _, llm = served
    image = picture(56, 56, 2)
    want = llm.tokenizer.decode(expected(served, "Describe it.", [image]),
                                skip_special_tokens=True)
    start_worker(llm.engine)
    api = openai.OpenAI(base_url=f"{gateway().url}/v1", api_key="none", max_retries=0)
    messages = user({"type": "image_url", "image_url": {"url": data_url(image), "detail": "low"}},
                    {"type": "text", "text": "Describe it."})
    reply = api.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                        temperature=0, extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == want
    assert reply.usage.prompt_tokens > 16  # the image's 4 features and the template's text
    response = api.responses.create(model="tiny", max_output_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True}, input=[{
                                        "role": "user", "content": [
                                            {"type": "input_image", "image_url": data_url(image)},
                                            {"type": "input_text", "text": "Describe it."}]}])
    assert response.output_text == want
    for url, match, param in (
            ("https://example.com/cat.png", "allowed-media-domains \\(none\\)", ""),
            ("data:image/png;base64,@@@", "not valid base64", ".url")):
        bad = user({"type": "image_url", "image_url": {"url": url}})
        with pytest.raises(openai.BadRequestError, match=match) as refused:
            api.chat.completions.create(model="tiny", messages=bad)
        assert refused.value.body["param"] == "messages[0].content[0]" + param


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
    image = picture(56, 56, 3)
    want = expected(served, "ok?", [image])
    worker = start_worker(llm.engine)
    client = Client(redis_server.url, prefix=prefix)
    start = time.monotonic()
    with pytest.raises(RequestFailed, match=match) as refused:
        client.generate(Chat(user({"type": "text", "text": "hi"}, part)), timeout=30)
    assert time.monotonic() - start < 2.0
    assert "messages[0].content[1]" in refused.value.message
    ok = client.generate(Chat(user({"type": "image", "data": png(image)},
                                   {"type": "text", "text": "ok?"})),
                         timeout=60, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    assert ok.token_ids == want and worker.alive()


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


@pytest.fixture
def image_server():
    """A local HTTP server: /cat.png an image, /big 33 MiB, /gone 404, /moved a redirect
    to /cat.png, /slow an image after 3 s. Yields (base URL, the image)."""
    import http.server
    import threading

    image = picture(56, 84, 5)
    body = png(image)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/moved":
                self.send_response(302)
                self.send_header("Location", "/cat.png")
                self.end_headers()
                return
            if self.path == "/gone":
                self.send_error(404)
                return
            if self.path == "/slow":
                time.sleep(3)
            data = b"\0" * (33 << 20) if self.path == "/big" else body
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            try:
                self.wfile.write(data)
            except OSError:  # the gateway hung up: it read enough
                pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", image
    server.shutdown()


def test_the_gateway_fetches_images_only_from_allowed_domains(served, start_worker, gateway,
                                                              image_server):
    _, llm = served
    base, image = image_server
    want = llm.tokenizer.decode(expected(served, "Describe it.", [image], text_first=True),
                                skip_special_tokens=True)
    start_worker(llm.engine)
    url = gateway(allowed_media_domains=["127.0.0.1"], media_timeout=1.0).url
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    def ask(image_url):
        return api.chat.completions.create(
            model="tiny", max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
            messages=user({"type": "text", "text": "Describe it."},
                          {"type": "image_url", "image_url": {"url": image_url}}))

    assert ask(f"{base}/cat.png").choices[0].message.content == want
    response = api.responses.create(model="tiny", max_output_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True}, input=[{
                                        "role": "user", "content": [
                                            {"type": "input_text", "text": "Describe it."},
                                            {"type": "input_image",
                                             "image_url": f"{base}/cat.png"}]}])
    assert response.output_text == want
    port = base.rsplit(":", 1)[1]
    for path, match in ((f"http://localhost:{port}/cat.png", "allowed-media-domains"),
                        (f"{base}/gone", "HTTP 404"), (f"{base}/moved", "redirects"),
                        (f"{base}/big", "over 33,554,432 bytes"), (f"{base}/slow", "over 1 s")):
        with pytest.raises(openai.BadRequestError, match=match) as refused:
            ask(path)
        assert refused.value.body["param"] == "messages[0].content[1]"


GEMMA_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
GEMMA_SPECIALS = ["<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<image_soft_token>",
                  "<end_of_image>"]


def test_gemma3_chat_images_as_its_processor_writes_them(tiny_gpt2_dir, start_worker,
                                                          redis_server, prefix):
    """Gemma 3's chat template writes one ``<start_of_image>`` an image, which its processor
    widens (newlines, the image's tokens, ``<end_of_image>``) before tokenizing: the prompt
    ids through LLM.chat and through a worker equal transformers' Gemma3Processor's, and the
    reply its model's."""
    from transformers import AutoTokenizer, Gemma3Processor

    from tests.vision_models import tiny_gemma3_vl

    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": GEMMA_SPECIALS})
    tokenizer.chat_template = GEMMA_TEMPLATE
    start, image, end = tokenizer.convert_tokens_to_ids(GEMMA_SPECIALS[2:])
    for name, token in zip(("boi", "image", "eoi"), GEMMA_SPECIALS[2:]):  # as Gemma's has
        setattr(tokenizer, f"{name}_token", token)
        setattr(tokenizer, f"{name}_token_id", tokenizer.convert_tokens_to_ids(token))
    hf = tiny_gemma3_vl(vocab=len(tokenizer) + 7, image=image, start=start, end=end)
    llm = LLM(hf, tokenizer=tokenizer, device="cpu", dtype="float32", block_size=4,
              num_kv_blocks=512, max_num_seqs=4)
    processor = Gemma3Processor(image_processor=llm.engine.model.image_processor,
                                tokenizer=tokenizer, image_seq_length=4)
    a = picture(56, 84, 2)
    messages = user({"type": "image"}, {"type": "text", "text": "What is this?"})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[[a]], return_tensors="pt")
    greedy = dict(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    want = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, inputs["input_ids"].shape[1]:].tolist()
    parts = user({"type": "image", "data": png(a)}, {"type": "text", "text": "What is this?"})
    chat = llm.chat(parts, SamplingParams(**greedy))
    assert chat.output.seq.token_ids[:chat.output.seq.num_prompt_tokens] == \
        inputs["input_ids"][0].tolist()
    assert chat.output.token_ids == want
    start_worker(llm.engine)
    out = Client(redis_server.url, prefix=prefix).generate(Chat(parts), timeout=60, **greedy)
    assert out.token_ids == want
