"""Tool calling's parts (core/tools.py, plugins/tool_parsers.py): the request's tools
checked, the constraint of tool_choice required, each family's parser, and the stream
that holds a call back until the output ends."""
import json

import pytest

from roseinfer.core.errors import InvalidRequestError
from roseinfer.core.plugins import PluginRegistry
from roseinfer.core.tools import Tools, ToolStream, check_tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}}}}
REGISTRY = PluginRegistry()


def parser(name):
    return REGISTRY.create("tool_parser", name)


@pytest.mark.parametrize("tools, choice, parallel, field", [
    ({"a": 1}, "auto", True, "tools"),
    ([{"type": "function"}], "auto", True, "tools[0]"),
    ([{"type": "function", "function": {"name": "has space"}}], "auto", True,
     "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "auto", True,
     "tools[0].function.parameters"),
    ([WEATHER, WEATHER], "auto", True, "tools"),
    ([WEATHER], "always", True, "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, True, "tool_choice"),
    ([WEATHER], "auto", "yes", "parallel_tool_calls"),
    (None, "required", True, "tool_choice"),
])
def test_bad_tools_are_refused_naming_the_field(tools, choice, parallel, field):
    with pytest.raises(InvalidRequestError) as e:
        check_tools(tools, choice, parallel)
    assert e.value.field == field


def test_no_tools_is_none_and_choices_are_kept():
    assert check_tools(None) is None and check_tools([], "none") is None
    t = check_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert t.choice == {"type": "function", "function": {"name": "get_time"}} and t.forced
    assert not check_tools([WEATHER]).forced and check_tools([WEATHER], "required").forced


def test_required_constrains_to_calls_of_the_tools_schemas():
    xgr = pytest.importorskip("xgrammar")
    many = Tools((WEATHER, TIME), "required", parallel=True).constraint()["json_schema"]["schema"]
    one = Tools((WEATHER, TIME), "required", parallel=False).constraint()["json_schema"]["schema"]
    named = Tools((WEATHER, TIME), {"type": "function", "function": {"name": "get_weather"}}
                  ).constraint()["json_schema"]["schema"]
    assert many["type"] == "array" and many["minItems"] == 1
    assert one["anyOf"][0]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    assert named["properties"]["name"] == {"const": "get_weather"}
    good = [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    for schema, text, ok in [
            (many, json.dumps(good), True),
            (many, "[]", False),
            (one, json.dumps(good[0]), True),
            (named, json.dumps({"name": "get_time", "arguments": {}}), False),
            (named, json.dumps({"name": "get_weather", "arguments": {"unit": "c"}}), False)]:
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True)
        assert xgr.testing._is_grammar_accept_string(grammar, text) == ok, (schema, text)


def test_a_list_cut_short_keeps_its_complete_calls():
    t = Tools((WEATHER, TIME), "required")
    cut = '[{"name":"get_time","arguments":{}}, {"name":"get_weather","arguments":{"ci'
    assert [c.name for c in t.forced_calls(cut)] == ["get_time"]
    with pytest.raises(ValueError):
        t.forced_calls('[{"name":"get_ti')
    stream = ToolStream(t, None)
    stream.feed(cut)
    assert [c.name for c in stream.finish()[1]] == ["get_time"]


def test_forced_calls_read_one_call_or_a_list():
    t = Tools((WEATHER,), "required")
    calls = t.forced_calls('[{"name":"get_weather","arguments":{"city":"Oslo"}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert calls[0].id.startswith("call_") and len(calls[0].id) == 29
    assert calls[0].as_dict(0)["function"]["name"] == "get_weather"


@pytest.mark.parametrize("name, text, content, calls", [
    ("hermes", 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
     '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me look.", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("hermes", "No call here.", "No call here.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
     "", [("get_weather", {"city": "Oslo"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}; '
     '{"name": "get_weather", "parameters": {"city": "Rome"}}',
     "", [("get_time", {}), ("get_weather", {"city": "Rome"})]),
    ("llama3_json", "It is sunny.", "It is sunny.", []),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
     "Sure. ", [("get_weather", {"city": "Oslo"})]),
])
def test_each_parser_reads_its_familys_calls(name, text, content, calls):
    got_content, got = parser(name).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize("name, text", [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": [1]}'),
    ("mistral", "[TOOL_CALLS] not json"),
])
def test_a_broken_call_is_content(name, text, caplog):
    stream = ToolStream(Tools((WEATHER,), "auto"), parser(name))
    sent = "".join(stream.feed(text[i:i + 3]) for i in range(0, len(text), 3))
    rest, calls = stream.finish()
    assert calls == [] and sent + rest == text
    assert "does not parse" in caplog.text


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_the_stream_holds_back_only_a_call(choice):
    text = ('The weather: <tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Oslo"}}\n</tool_call>')
    stream = ToolStream(Tools((WEATHER,), choice), parser("hermes"))
    pieces = [stream.feed(text[i:i + 2]) for i in range(0, len(text), 2)]
    rest, calls = stream.finish()
    if choice == "none":
        assert "".join(pieces) + rest == text and calls == []
        return
    assert "".join(pieces) == "The weather: " and rest == ""
    assert pieces[:2] == ["Th", "e "]  # content goes out as it comes
    assert [c.name for c in calls] == ["get_weather"]


def test_a_text_that_only_looks_like_a_call_start_comes_out_at_the_end():
    stream = ToolStream(Tools((WEATHER,), "auto"), parser("hermes"))
    assert stream.feed("a <tool") == "a "
    assert stream.feed(" shed") == "<tool shed"
    assert stream.finish() == ("", [])


def test_parallel_false_keeps_the_first_call():
    text = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    stream = ToolStream(Tools((WEATHER, TIME), "auto", parallel=False), parser("hermes"))
    stream.feed(text)
    assert [c.name for c in stream.finish()[1]] == ["get_time"]


def test_llm_chat_renders_the_tools_and_returns_calls():
    """LLM.chat on the default model (a real template without a tool section): no tools
    is generate over the template's text; required is a valid call; auto its text."""
    import jsonschema

    from roseinfer import LLM, SamplingParams

    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    greedy = SamplingParams(max_tokens=40, temperature=0)
    # float32: the GGUF blocks' prompt rows (a bfloat16 GEMM) and decode rows (int8 dots)
    # round apart, so a prompt the prefix cache holds may decode otherwise at a near tie
    with LLM("SmolLM2-135M-Instruct", device="cpu", num_kv_blocks=64,
             cpu_weight_dtype="float32", cpu_compiled_step="off") as llm:
        plain = llm.chat(messages, greedy)
        prompt = llm.tokenizer.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=True)
        assert plain.content == llm.generate([prompt], greedy)[0].text and not plain.tool_calls
        called = llm.chat(messages, greedy, tools=[WEATHER], tool_choice="required",
                          parallel_tool_calls=False)
        auto = llm.chat(messages, greedy, tools=[WEATHER])
        with pytest.raises(InvalidRequestError):
            llm.chat(messages, tools=[WEATHER], tool_choice="always")
    (call,) = called.tool_calls
    assert called.finish_reason == "tool_calls" and called.content == ""
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    assert auto.content and auto.finish_reason in ("stop", "length")
