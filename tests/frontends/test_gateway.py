"""The OpenAI gateway with the official `openai` client, against a real redis-server and
a worker: outputs equal LLM.generate's, streaming and not; errors shaped as OpenAI's;
auth; a disconnect cancels the request; no worker gives a 503."""
import json
import shutil

import httpx
import openai
import pytest

from roseinfer import SamplingParams
from roseinfer.frontends.openai.app import BackgroundGateway, GatewayConfig
from roseinfer.frontends.redis_streams.server import free_port

from .conftest import TINY_ENGINE, FakeEngine, raw_chunks, wait_until

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def chat_llm(tiny_gpt2_dir, tmp_path_factory):
    """The tiny GPT-2 with a chat template: messages have a form to take."""
    from transformers import AutoTokenizer

    from roseinfer import LLM

    path = tmp_path_factory.mktemp("tiny-chat")
    shutil.copytree(tiny_gpt2_dir, path, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return LLM(str(path), **TINY_ENGINE)


def client(g, key="none"):
    return openai.OpenAI(base_url=f"{g.url}/v1", api_key=key, max_retries=0)


def test_completions_and_chat_equal_llm_generate(chat_llm, start_worker, gateway):
    greedy = SamplingParams(max_tokens=12, temperature=0)
    raw = chat_llm.generate(["The capital of France is"], greedy)[0]
    templated = chat_llm.engine.tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)
    chat = chat_llm.generate([templated], greedy)[0]
    start_worker(chat_llm.engine)
    api = client(gateway())
    assert [m.id for m in api.models.list().data] == ["tiny"]

    done = api.completions.create(model="tiny", prompt="The capital of France is",
                                  max_tokens=12, temperature=0)
    assert done.choices[0].text == raw.text and done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(raw.prompt_token_ids), 12)

    reply = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12,
                                        temperature=0)
    assert reply.choices[0].message.content == chat.text
    assert reply.choices[0].message.role == "assistant" and reply.object == "chat.completion"

    parts = list(api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == chat.text
    assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == "length"
    assert parts[-1].choices == [] and parts[-1].usage.completion_tokens == 12
    # The same prompt again: every full block but the last token's came from the cache.
    bs, usage = chat_llm.engine.config.block_size, parts[-1].usage
    assert usage.prompt_tokens > bs
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // bs * bs

    streamed = api.completions.create(model="tiny", prompt="The capital of France is",
                                      max_tokens=12, temperature=0, stream=True)
    assert "".join(p.choices[0].text for p in streamed) == raw.text
    metrics = httpx.get(f"{api.base_url}".removesuffix("/v1/") + "/metrics").text
    assert 'roseinfer:gateway_requests_total{endpoint="/v1/chat/completions",status="200"} 2.0' in metrics
    assert 'roseinfer:gateway_requests_total{endpoint="/v1/completions",status="200"} 2.0' in metrics
    assert "roseinfer:gateway_requests_in_flight 0.0" in metrics


def test_logprobs_penalties_and_bias_through_the_gateway(chat_llm, start_worker, gateway):
    """OpenAI's logprobs shapes (chat and completions, whole and streamed) carry the
    engine's numbers and token texts; penalties and logit_bias reach the engine."""
    tok = chat_llm.engine.tokenizer
    prompt = "The capital of France is"
    scored = SamplingParams(max_tokens=8, temperature=0, logprobs=2, frequency_penalty=0.5,
                            presence_penalty=0.3, logit_bias={13: 3.0})
    raw = chat_llm.generate([prompt], scored)[0]
    templated = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    chat = chat_llm.generate([templated], SamplingParams(max_tokens=8, temperature=0,
                                                         logprobs=3))[0]
    start_worker(chat_llm.engine)
    api = client(gateway())

    done = api.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                  logprobs=2, frequency_penalty=0.5, presence_penalty=0.3,
                                  logit_bias={"13": 3})
    lp = done.choices[0].logprobs
    assert done.choices[0].text == raw.text
    assert lp.tokens == [tok.decode([t]) for t in raw.token_ids]
    assert max(abs(a - b.logprob) for a, b in zip(lp.token_logprobs, raw.logprobs)) < 1e-5
    assert [list(d) for d in lp.top_logprobs] == [[tok.decode([t]) for t, _ in e.top]
                                                  for e in raw.logprobs]
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]

    reply = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8,
                                        temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([t]) for t in chat.token_ids]
    assert [len(c.top_logprobs) for c in content] == [3] * 8
    assert abs(content[0].logprob - chat.logprobs[0].logprob) < 1e-5

    parts = list(api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8,
                                             temperature=0, logprobs=True, top_logprobs=3,
                                             stream=True))
    streamed = [c for p in parts if p.choices and p.choices[0].logprobs
                for c in p.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    plain = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="tiny", messages=MESSAGES, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:  # refused by the worker
        api.completions.create(model="tiny", prompt=prompt, frequency_penalty=3)
    assert e.value.body["param"] == "frequency_penalty"


def test_prompt_logprobs_through_the_gateway(chat_llm, start_worker, gateway):
    """vLLM's prompt_logprobs extension, whole and streamed: per prompt token None
    first, then {id: {logprob, decoded_token}} for the token and its alternatives."""
    tok = chat_llm.engine.tokenizer
    prompt = "The capital of France is"
    ref = chat_llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0,
                                                     prompt_logprobs=1))[0]
    start_worker(chat_llm.engine)
    api = client(gateway())
    done = api.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 1})
    parts = list(api.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                        temperature=0, stream=True,
                                        extra_body={"prompt_logprobs": 1}))
    whole = done.choices[0].model_extra["prompt_logprobs"]
    streamed = parts[0].choices[0].model_extra["prompt_logprobs"]
    assert whole == streamed and whole[0] is None and len(whole) == len(ref.prompt_logprobs)
    for got, want in zip(whole[1:], ref.prompt_logprobs[1:]):
        entry = got[str(want.token_id)]
        assert abs(entry["logprob"] - want.logprob) < 1e-5
        assert entry["decoded_token"] == tok.decode([want.token_id])
        assert all(str(t) in got for t, _ in want.top)
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model="tiny", prompt=prompt, extra_body={"prompt_logprobs": 21})
    assert e.value.body["param"] == "prompt_logprobs"


def test_errors_are_shaped_as_openais(chat_llm, start_worker, gateway):
    start_worker(chat_llm.engine)
    api = client(gateway())
    with pytest.raises(openai.BadRequestError) as e:  # refused by the gateway
        api.completions.create(model="tiny", prompt="Hi", best_of=2)
    assert e.value.body["param"] == "best_of" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:  # refused by the worker
        api.chat.completions.create(model="tiny", messages=MESSAGES, n=17)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:  # refused by the worker
        api.completions.create(model="tiny", prompt="Hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="tiny", messages=[{"role": "function", "content": "x"}])
    assert e.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as e:  # its schema missing
        api.chat.completions.create(model="tiny", messages=MESSAGES, response_format={
            "type": "json_schema", "json_schema": {"name": "answer"}})
    assert e.value.body["param"] == "response_format"


def test_structured_output_through_the_gateway(chat_llm, start_worker, gateway):
    """OpenAI's json_schema response_format, whole and streamed: the content parses,
    fits the schema, and equals the engine's own constrained output."""
    schema = {"type": "object", "properties": {"capital": {"enum": ["Paris", "Lyon"]},
                                               "sure": {"type": "boolean"}},
              "required": ["capital", "sure"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    templated = chat_llm.engine.tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)
    (ref,) = chat_llm.generate([templated], SamplingParams(max_tokens=30, temperature=0,
                                                           response_format=fmt))
    start_worker(chat_llm.engine)
    api = client(gateway())
    reply = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=30,
                                        temperature=0, response_format=fmt)
    answer = json.loads(reply.choices[0].message.content)
    assert answer["capital"] in ("Paris", "Lyon") and isinstance(answer["sure"], bool)
    assert reply.choices[0].message.content == ref.text
    assert reply.choices[0].finish_reason == "stop"
    parts = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=30,
                                        temperature=0, response_format=fmt, stream=True)
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == ref.text


def test_n_choices_through_the_gateway(chat_llm, start_worker, gateway):
    """n = 3 seeded samples as choices 0-2, whole and streamed, each equal to the engine's
    sample of that index; usage counts the prompt once and every sample's tokens."""
    templated = chat_llm.engine.tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)
    (want,) = chat_llm.generate([templated], SamplingParams(n=3, max_tokens=6, temperature=1.0,
                                                            seed=9, ignore_eos=True))
    start_worker(chat_llm.engine)
    api = client(gateway())
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=6, temperature=1.0, seed=9, n=3,
              extra_body={"ignore_eos": True})
    reply = api.chat.completions.create(**kw)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [w.text for w in want]
    assert reply.usage.completion_tokens == 18
    assert reply.usage.prompt_tokens == len(want[0].prompt_token_ids)
    parts = list(api.chat.completions.create(**kw, stream=True,
                                             stream_options={"include_usage": True}))
    texts = ["", "", ""]
    for p in parts:
        for c in p.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [w.text for w in want]
    assert [c.finish_reason for p in parts for c in p.choices if c.finish_reason] == ["length"] * 3
    assert parts[-1].choices == [] and parts[-1].usage.completion_tokens == 18


def test_api_keys(gateway, redis_server):
    g = gateway(api_keys=["sesame"])
    with pytest.raises(openai.AuthenticationError) as e:
        client(g, "wrong").models.list()
    assert e.value.body["code"] == "invalid_api_key"
    assert [m.id for m in client(g, "sesame").models.list().data] == ["tiny"]
    assert httpx.get(f"{g.url}/health").json() == {"status": "ok"}


def test_no_worker_is_a_503(gateway):
    api = client(gateway(queue_timeout=0.5))
    with pytest.raises(openai.InternalServerError) as e:
        api.completions.create(model="tiny", prompt="Hi", max_tokens=3)
    assert e.value.status_code == 503 and "no worker answered" in e.value.body["message"]


def test_an_unreachable_queue_is_a_503():
    g = BackgroundGateway(GatewayConfig(f"redis://127.0.0.1:{free_port()}"), port=free_port())
    g.start()
    try:
        with pytest.raises(openai.InternalServerError) as e:
            client(g).completions.create(model="tiny", prompt="Hi", max_tokens=3)
        assert e.value.status_code == 503 and "unreachable" in e.value.body["message"]
    finally:
        g.stop()


def test_a_disconnect_cancels_the_request(start_worker, gateway, real_redis, prefix):
    """Closing a stream after its first event aborts the request: the worker ends it
    with finish_reason abort long before its 60 tokens."""
    start_worker(FakeEngine(step_s=0.05))
    g = gateway()
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 60, "stream": True}
    with httpx.stream("POST", f"{g.url}/v1/completions", json=body, timeout=10) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data:"))
    rid = json.loads(first.removeprefix("data:").strip())["id"].removeprefix("cmpl-")
    wait_until(lambda: any(c.finished for c in raw_chunks(real_redis, prefix, rid)))
    chunks = raw_chunks(real_redis, prefix, rid)
    assert chunks[-1].finish_reason == "abort"
    assert sum(len(c.token_ids) for c in chunks) < 60


def test_a_disconnect_before_the_first_event_cancels_the_request(start_worker, gateway,
                                                                   real_redis, prefix):
    """A client that leaves while the gateway still waits for the first token: the
    event stream never starts, yet the request is cancelled and the call counted."""
    start_worker(FakeEngine(step_s=0.2))
    g = gateway()
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 60, "stream": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{g.url}/v1/completions", json=body, headers={"X-Request-Id": "early"},
                   timeout=httpx.Timeout(10, read=0.05))
    wait_until(lambda: any(c.finished for c in raw_chunks(real_redis, prefix, "early")))
    chunks = raw_chunks(real_redis, prefix, "early")
    assert chunks[-1].finish_reason == "abort"
    assert sum(len(c.token_ids) for c in chunks) < 60

    def in_flight() -> float:
        line = next(x for x in httpx.get(f"{g.url}/metrics").text.splitlines()
                    if x.startswith("roseinfer:gateway_requests_in_flight"))
        return float(line.split()[-1])
    wait_until(lambda: in_flight() == 0.0)
