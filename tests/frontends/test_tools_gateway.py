"""Tool calling through the gateway with the official `openai` client, a real redis-server
and a worker: a two-turn exchange, tool_choice required under sampling (every call valid
against a nested schema), streamed calls equal to whole ones, bad tools refused with the
field named, and the default model (no tool section in its template) still calling."""
import json
import shutil

import jsonschema
import openai
import pytest

from roseinfer import SamplingParams
from roseinfer.core.tools import check_tools

from .test_gateway import client
from .conftest import TINY_ENGINE

# A chat template with a tool section, as Hermes-style templates have: the tools, then
# each turn, an assistant turn's calls as <tool_call> blocks.
TEMPLATE = ("{% if tools %}<|system|>Tools: {{ tools | tojson }}\n{% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|>"
            "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}"
            "</tool_call>{% endfor %}{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
FORECAST = {"type": "object", "additionalProperties": False,
            "required": ["place", "unit", "days"],
            "properties": {
                "place": {"type": "object", "additionalProperties": False,
                          "required": ["city", "grid"],
                          "properties": {"city": {"enum": ["Oslo", "Rome", "Lima"]},
                                         "grid": {"type": "array", "maxItems": 3,
                                                  "items": {"enum": [1, 2, 3]}}}},
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "forecast", "description": "Weather.",
                                           "parameters": FORECAST}},
         {"type": "function", "function": {"name": "clock", "parameters": {
             "type": "object", "additionalProperties": False, "properties": {}}}}]
MESSAGES = [{"role": "user", "content": "Weather in Oslo for three days?"}]
# A schema that checks as an object but does not compile: a type JSON Schema lacks.
NONSENSE = {"type": "function", "function": {"name": "bad", "parameters": {
    "type": "object", "properties": {"x": {"type": "nonsense"}}}}}


@pytest.fixture(scope="module")
def tool_llm(tiny_gpt2_dir, tmp_path_factory):
    """A tiny GPT-2 with a chat template that renders tools, and a context of 1024 (the
    tools' schemas take about 230 tokens of the prompt)."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from roseinfer import LLM

    path = tmp_path_factory.mktemp("tiny-tools")
    shutil.copytree(tiny_gpt2_dir, path, dirs_exist_ok=True)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=1024)
                    ).save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return LLM(str(path), **{**TINY_ENGINE, "num_kv_blocks": 400})


def reference_calls(llm, messages, choice="required", parallel=True, max_tokens=80):
    """The engine's own constrained output for the prompt transformers renders with the
    tools: what the gateway's calls must be."""
    prompt = llm.engine.tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                                      add_generation_prompt=True)
    tools = check_tools(TOOLS, choice, parallel)
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                   response_format=tools.constraint()))
    return [(c.name, json.loads(c.arguments)) for c in tools.forced_calls(out.text)]


def calls_of(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def test_a_call_then_its_result_then_an_answer(tool_llm, start_worker, gateway):
    want = reference_calls(tool_llm, MESSAGES)  # before the worker: one caller per engine
    worker = start_worker(tool_llm.engine)
    api = client(gateway())
    reply = api.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                        tool_choice="required", max_tokens=80, temperature=0)
    choice = choice0 = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert calls_of(choice.message) == want
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])

    turn = choice0.message.tool_calls[0]
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": turn.id, "type": "function",
             "function": {"name": turn.function.name, "arguments": turn.function.arguments}}]},
        {"role": "tool", "tool_call_id": turn.id, "content": "Sunny, 21 C."}]
    answer = api.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                         max_tokens=12, temperature=0)
    worker.stop()  # the reference below uses the same engine
    # what transformers renders for the same turns (arguments as an object, as templates
    # take them), greedy through the engine
    rendered = history[:1] + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": turn.id, "type": "function", "function": {
                "name": turn.function.name, "arguments": json.loads(turn.function.arguments)}}]},
        history[2]]
    prompt = tool_llm.engine.tokenizer.apply_chat_template(rendered, tools=TOOLS, tokenize=False,
                                                           add_generation_prompt=True)
    assert "<|tool|>Sunny, 21 C." in prompt and "<tool_call>" in prompt
    (ref,) = tool_llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0))
    assert answer.choices[0].message.content == ref.text
    assert answer.choices[0].finish_reason == "length"


def test_required_gives_100_valid_calls_under_sampling(tool_llm, start_worker, gateway):
    start_worker(tool_llm.engine)
    api = client(gateway())
    valid = 0
    for seed in range(10):
        reply = api.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=TOOLS, parallel_tool_calls=False,
            tool_choice={"type": "function", "function": {"name": "forecast"}}, n=10,
            max_tokens=120, temperature=1.0, seed=seed)
        for choice in reply.choices:
            assert choice.finish_reason == "tool_calls", choice
            (call,) = choice.message.tool_calls
            assert call.function.name == "forecast"
            jsonschema.validate(json.loads(call.function.arguments), FORECAST)
            valid += 1
    assert valid == 100


def test_streamed_calls_reassemble_to_the_whole_reply(tool_llm, start_worker, gateway):
    start_worker(tool_llm.engine)
    api = client(gateway())
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                  max_tokens=80, temperature=0)
    whole = api.chat.completions.create(**kwargs).choices[0]
    calls, finish = {}, None
    for part in api.chat.completions.create(stream=True, **kwargs):
        delta = part.choices[0].delta
        for d in delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = d.id or c["id"]
            c["name"] += (d.function.name or "") if d.function else ""
            c["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = part.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        calls_of(whole.message)
    assert all(c["id"].startswith("call_") for c in calls.values())


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"tools": TOOLS + [NONSENSE], "tool_choice": "required"}, "tools[2].function.parameters"),
])
def test_bad_tools_are_400s_naming_the_field(tool_llm, start_worker, gateway, extra, param):
    start_worker(tool_llm.engine)
    api = client(gateway())
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **extra)
    assert e.value.body["param"] == param


def test_a_schema_that_does_not_compile_is_refused_by_its_tool_over_redis(
        tool_llm, start_worker, real_redis, prefix):
    """The Redis protocol's bad_request names the tool, as the gateway's 400 does."""
    from roseinfer.frontends.redis_streams.client import Client, RequestFailed
    from roseinfer.frontends.redis_streams.protocol import Chat

    start_worker(tool_llm.engine)
    chat = Chat(MESSAGES, check_tools(TOOLS + [NONSENSE], "required"))
    with pytest.raises(RequestFailed) as e:
        Client(prefix=prefix, redis_client=real_redis).generate(chat, max_tokens=4, timeout=30)
    assert e.value.code == "bad_request"
    assert e.value.message.startswith("tools[2].function.parameters: cannot compile")


def test_the_default_model_calls_under_required(start_worker, gateway):
    """SmolLM2-135M-Instruct's template has no tool section: the tools are not in its
    prompt, and the constrained output is still a valid call."""
    from roseinfer import LLM

    llm = LLM("SmolLM2-135M-Instruct", device="cpu", num_kv_blocks=64, cuda_graphs=False)
    start_worker(llm.engine)
    reply = client(gateway()).chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=120, temperature=0)
    (call,) = reply.choices[0].message.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])
    llm.close()


def test_auto_parses_the_call_the_model_writes(tool_llm, start_worker, gateway):
    """tool_choice auto with the worker's parser (hermes, the family default here): the
    output is made to be text then a call (a regex response_format, which a model that
    calls would not need), and comes back as content and tool_calls, whole and streamed."""
    start_worker(tool_llm.engine)
    api = client(gateway())
    written = ('The time: <tool_call>{"name": "clock", "arguments": {}}</tool_call>'
               '<tool_call>{"name": "forecast", "arguments": {"place": {"city": "Oslo", '
               '"grid": [1]}, "unit": "c", "days": 2}}</tool_call>')
    pattern = "".join("\\" + c if c in "{}[]()|.*+?^$\\" else c for c in written)
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200,
                  temperature=0, response_format={"type": "regex", "pattern": pattern})
    whole = api.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "The time: "
    assert calls_of(whole.message) == [
        ("clock", {}), ("forecast", {"place": {"city": "Oslo", "grid": [1]}, "unit": "c",
                                     "days": 2})]
    content, names = "", []
    for part in api.chat.completions.create(stream=True, **kwargs):
        delta = part.choices[0].delta
        content += delta.content or ""
        names += [d.function.name for d in delta.tool_calls or [] if d.function.name]
    assert content == "The time: " and names == ["clock", "forecast"]
    one = api.chat.completions.create(parallel_tool_calls=False, **kwargs).choices[0]
    assert [name for name, _ in calls_of(one.message)] == ["clock"]
    none = api.chat.completions.create(tool_choice="none", **kwargs).choices[0]
    assert none.message.content == written and not none.message.tool_calls
    assert none.finish_reason == "stop"


@pytest.mark.parametrize("responses_api", [False, True], ids=["chat", "responses"])
def test_a_langchain_agent_step(tool_llm, start_worker, gateway, responses_api):
    """langchain-openai as a user writes it: a tool from a typed function, bound to the
    chat model; the call is run and its result sent back for the answer. Over chat
    completions and over the Responses API (use_responses_api)."""
    from typing import Literal

    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def local_time(zone: Literal["UTC", "CET", "JST"]) -> str:
        """The time now in a time zone."""
        return {"UTC": "11:00", "CET": "12:00", "JST": "20:00"}[zone]

    start_worker(tool_llm.engine)
    chat = ChatOpenAI(base_url=f"{gateway().url}/v1", api_key="none", model="tiny",
                      temperature=0, max_tokens=60, max_retries=0,
                      use_responses_api=responses_api)
    history = [HumanMessage("What time is it in Tokyo?")]
    step = chat.bind_tools([local_time], tool_choice="any",
                           parallel_tool_calls=False).invoke(history)
    (call,) = step.tool_calls
    assert call["name"] == "local_time" and call["args"]["zone"] in ("UTC", "CET", "JST")
    history += [step, ToolMessage(local_time.invoke(call["args"]), tool_call_id=call["id"])]
    answer = chat.bind_tools([local_time]).invoke(history)
    assert answer.text and not answer.tool_calls


def test_roseinfer_submit_with_a_tools_file(tool_llm, start_worker, redis_server, prefix,
                                            tmp_path):
    import subprocess

    from .conftest import roseinfer_cmd as roseinfer

    want = reference_calls(tool_llm, MESSAGES)  # before the worker: one caller per engine
    start_worker(tool_llm.engine)
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    submit = ["submit", "--redis-url", redis_server.url, "--prefix", prefix, "--no-stream",
              "--max-tokens", "80", "--messages-file", "-", "--tools-file",
              str(tmp_path / "tools.json")]
    called = subprocess.run(roseinfer(*submit, "--tool-choice", "required"), text=True,
                            input=json.dumps(MESSAGES), capture_output=True, timeout=60)
    assert called.returncode == 0, called.stderr
    lines = called.stdout.strip().split("\n")
    got = [json.loads(line)["tool_call"]["function"] for line in lines]
    assert [(f["name"], json.loads(f["arguments"])) for f in got] == want
    assert called.stderr.startswith("[tool_calls: ")
    (tmp_path / "bad.json").write_text(json.dumps([{"type": "function"}]))
    bad = subprocess.run(roseinfer(*submit[:-1], str(tmp_path / "bad.json")), text=True,
                         input=json.dumps(MESSAGES), capture_output=True, timeout=60)
    assert bad.returncode == 1 and "--tools-file: tools[0]" in bad.stderr
