"""A reasoning model's thinking apart from its answer, through a worker (a real Redis) to the
gateway and the official `openai` client, and to the Python client: whole and streamed
token by token (the tags split over several GPT-2 tokens), include_reasoning false, and
chat_template_kwargs turning Qwen3-style thinking off in the template.

The engine is scripted (it writes a fixed reply in GPT-2's tokens): a tiny random model
never writes the tags."""
import time

import openai
import pytest

from roseinfer.core.config import EngineConfig
from roseinfer.core.sampling import SamplingParams
from roseinfer.frontends.redis_streams.admission import Admission
from roseinfer.frontends.redis_streams.client import Client
from roseinfer.frontends.redis_streams.protocol import Chat

from .conftest import FakeEngine, FakeOutput

# Qwen3's way: with enable_thinking false the template writes an empty pair itself; and
# gpt-oss's, the reasoning effort in the prompt.
TEMPLATE = ("{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and "
            "not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
THINKING = "<think>\nTwo and two make four.\n</think>\n\nIt is 4."
ANSWER = "It is 4."
MESSAGES = [{"role": "user", "content": "2 + 2?"}]


class ScriptedEngine(FakeEngine):
    """Writes ``script`` (THINKING), or ANSWER where the prompt closed the thinking, a
    token a step (its text without special tokens, as a worker's detokenizer has it)."""

    def __init__(self, tokenizer, parser="qwen3", script=THINKING):
        super().__init__()
        self.config = EngineConfig(device="cpu", max_num_seqs=4, reasoning_parser=parser)
        self.tokenizer, self.script = tokenizer, script
        self.max_model_len = 256
        self.scripts = {}
        self.prompts = []  # each request's prompt text, as the template rendered it

    def add_request(self, rid, prompt, params, emitted_ids=None, emitted_text=None):
        text = self.tokenizer.decode(prompt)
        self.prompts.append(text)
        self.scripts[rid] = self.tokenizer.encode(
            ANSWER if text.endswith("</think>\n\n") else self.script)
        self.seqs[rid] = _Seq(prompt, params)

    def step(self):
        time.sleep(self.step_s)
        outs = []
        for rid, s in list(self.seqs.items()):
            script = self.scripts[rid]
            new = [script[len(s.out_ids)]]
            s.out_ids += new
            reason = "stop" if len(s.out_ids) == len(script) else \
                "length" if len(s.out_ids) >= s.params.max_tokens else None
            if reason:
                del self.seqs[rid]
            outs.append(FakeOutput(rid, s.prompt_ids, list(s.out_ids),
                                   self.tokenizer.decode(s.out_ids, skip_special_tokens=True),
                                   new, self.tokenizer.decode(new, skip_special_tokens=True),
                                   reason is not None, reason))
        return outs


class _Seq:
    def __init__(self, prompt_ids, params):
        self.prompt_ids, self.params, self.out_ids, self.aborted = prompt_ids, params, [], False


@pytest.fixture
def engine(tiny_gpt2_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    tokenizer.chat_template = TEMPLATE
    return ScriptedEngine(tokenizer)


def test_reasoning_apart_whole_and_streamed(engine, start_worker, gateway):
    start_worker(engine)
    api = openai.OpenAI(base_url=f"{gateway().url}/v1", api_key="none", max_retries=0)
    message = api.chat.completions.create(model="tiny", messages=MESSAGES).choices[0].message
    assert message.reasoning_content == message.reasoning == "\nTwo and two make four.\n"
    assert message.content == "\n\nIt is 4."

    thought, content, pieces = "", "", 0
    for chunk in api.chat.completions.create(model="tiny", messages=MESSAGES, stream=True):
        delta = chunk.choices[0].delta
        thought += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        pieces += 1
        assert "<" not in thought + content and ">" not in thought + content  # no tag leaks
    assert (thought, content) == (message.reasoning_content, message.content)
    assert pieces > 10  # a token a chunk

    hidden = api.chat.completions.create(model="tiny", messages=MESSAGES,
                                         extra_body={"include_reasoning": False})
    assert hidden.choices[0].message.content == message.content
    assert getattr(hidden.choices[0].message, "reasoning_content", None) is None

    off = api.chat.completions.create(model="tiny", messages=MESSAGES, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert (off.content, getattr(off, "reasoning_content", None)) == (ANSWER, None)

    api.chat.completions.create(model="tiny", messages=MESSAGES, reasoning_effort="high")
    assert engine.prompts[-1].startswith("Reasoning: high\n<|user|>")  # gpt-oss's way
    bad = {"chat_template_kwargs": {"messages": "x"}}
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        api.chat.completions.create(model="tiny", messages=MESSAGES, extra_body=bad)


def test_the_python_client_gets_reasoning_apart(engine, start_worker, redis_server, prefix):
    start_worker(engine)
    client = Client(redis_server.url, prefix=prefix)
    result = client.generate(Chat(MESSAGES), max_tokens=64, timeout=30)
    assert (result.reasoning, result.text) == ("\nTwo and two make four.\n", "\n\nIt is 4.")
    result = client.generate(Chat(MESSAGES, template_kwargs={"enable_thinking": False}),
                             max_tokens=64, timeout=30)
    assert (result.reasoning, result.text) == ("", ANSWER)


def test_a_resumed_request_splits_where_its_first_owner_stopped(engine):
    """A worker that takes a request over after k tokens (its streams primed with their
    text) hands out what the first owner had not: together, the whole split, at every k."""
    admission = Admission(engine, chat_template=True)
    ids = engine.tokenizer.encode(THINKING)

    def run(make, tokens, index=0):
        stream, pieces = make(index), ["", ""]
        for t in tokens:
            pieces = [a + b for a, b in zip(pieces, stream.feed(engine.tokenizer.decode([t])))]
        return pieces, stream

    from roseinfer.frontends.redis_streams.protocol import encode_request
    req = admission("1-0", {k.encode(): v.encode() if isinstance(v, str) else v
                            for k, v in encode_request(Chat(MESSAGES)).items()})
    assert req.reasoning_inside is False and isinstance(req.params, SamplingParams)
    (whole, stream) = run(admission.reasoning_streams(req), ids)
    whole = [a + b for a, b in zip(whole, stream.finish())]
    assert whole == ["\nTwo and two make four.\n", "\n\nIt is 4."]
    for k in range(len(ids)):
        sent, _ = run(admission.reasoning_streams(req), ids[:k])
        rest, stream = run(admission.reasoning_streams(req, lambda i: ids[:k]), ids[k:])
        rest = [a + b for a, b in zip(rest, stream.finish())]
        assert [a + b for a, b in zip(sent, rest)] == whole, k


def test_gpt_oss_harmony_reasoning_and_a_call(tiny_gpt2_dir, start_worker, gateway):
    """gpt_oss: the analysis channel comes as reasoning, a commentary message to a
    function as a tool call, through the worker and the gateway."""
    from transformers import AutoTokenizer

    from roseinfer.plugins.reasoning_parsers import HarmonyStream
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(HarmonyStream.SPECIALS)})
    tokenizer.chat_template = TEMPLATE
    script = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
              "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
              '{"city": "Oslo"}<|call|>')
    start_worker(ScriptedEngine(tokenizer, "gpt_oss", script))
    api = openai.OpenAI(base_url=f"{gateway().url}/v1", api_key="none", max_retries=0)
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    for stream in (False, True):
        reply = api.chat.completions.create(model="tiny", messages=MESSAGES, tools=[weather],
                                            stream=stream)
        if stream:
            parts = list(reply)
            thought = "".join(getattr(p.choices[0].delta, "reasoning_content", None) or ""
                              for p in parts if p.choices)
            calls = [c for p in parts if p.choices for c in p.choices[0].delta.tool_calls or []]
            name, args = calls[0].function.name, "".join(c.function.arguments or "" for c in calls)
            reason = [p.choices[0].finish_reason for p in parts if p.choices][-1]
        else:
            choice = reply.choices[0]
            thought, reason = choice.message.reasoning_content, choice.finish_reason
            (call,) = choice.message.tool_calls
            name, args = call.function.name, call.function.arguments
        assert (thought, name, args, reason) == (
            "Need the weather.", "get_weather", '{"city": "Oslo"}', "tool_calls"), stream
