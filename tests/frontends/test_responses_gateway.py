"""/v1/responses through the gateway with the official `openai` client, a real redis-server
and a worker: text and typed input, reasoning items, the SDK's stream helper over the
spec's events, storage read back by a second gateway process, previous_response_id,
delete, function tools (a call, then its output continuing the response), and bad input
refused with the field named; an OpenAI Agents SDK turn. (LangChain over the Responses
API: test_tools_gateway.py.)"""
import json
import time

import openai
import pytest

from .conftest import free_port
from .test_reasoning_gateway import ANSWER, engine  # noqa: F401 - the scripted engine
from .test_tools_gateway import TOOLS, tool_llm  # noqa: F401 - a tiny model that calls

THOUGHT, SAID = "\nTwo and two make four.\n", "\n\nIt is 4."


def api(g):
    return openai.OpenAI(base_url=f"{g.url}/v1", api_key="none", max_retries=0)


def test_create_retrieve_continue_delete(engine, start_worker, gateway, redis_server, prefix):  # noqa: F811
    start_worker(engine)
    client = api(gateway())
    first = client.responses.create(model="tiny", input="2 + 2?", instructions="Be brief.")
    assert first.status == "completed" and first.output_text == SAID
    reasoning, message = first.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == THOUGHT
    assert message.type == "message" and message.content[0].type == "output_text"
    assert first.usage.output_tokens > 0 and first.usage.input_tokens > 0
    assert engine.prompts[-1].startswith("<|system|>Be brief.\n<|user|>2 + 2?")

    # a second gateway process reads it as stored, field for field
    from roseinfer.frontends.openai.app import BackgroundGateway, GatewayConfig
    other = BackgroundGateway(GatewayConfig(redis_server.url, prefix, model_name="tiny"),
                              port=free_port()).start()
    try:
        assert api(other).responses.retrieve(first.id).model_dump() == first.model_dump()
    finally:
        other.stop()

    second = client.responses.create(model="tiny", previous_response_id=first.id, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "And 3 + 3?"}]}])
    # instructions do not carry over; the first turn and its answer do
    assert engine.prompts[-1] == ("<|user|>2 + 2?\n<|assistant|>" + SAID + "\n"
                                  "<|user|>And 3 + 3?\n<|assistant|>")
    assert second.previous_response_id == first.id

    assert client.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id|not found"):
        client.responses.create(model="tiny", previous_response_id=first.id, input="x")
    unstored = client.responses.create(model="tiny", input="2 + 2?", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    off = client.responses.create(model="tiny", input="2 + 2?",
                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert [i.type for i in off.output] == ["message"] and off.output_text == ANSWER


def test_the_sdk_stream_helper_over_the_events(engine, start_worker, gateway):  # noqa: F811
    start_worker(engine)
    client = api(gateway())
    with client.responses.stream(model="tiny", input="2 + 2?") as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == SAID
    assert final.output_text == SAID and final.output[0].content[0].text == THOUGHT
    assert client.responses.retrieve(final.id).output_text == SAID


def test_a_function_call_then_its_output(tool_llm, start_worker, gateway):  # noqa: F811
    start_worker(tool_llm.engine)
    client = api(gateway())
    tools = [{"type": "function", "name": t["function"]["name"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]
    called = client.responses.create(model="tiny", input="Weather in Oslo?", tools=tools,
                                     tool_choice="required", parallel_tool_calls=False,
                                     max_output_tokens=80, temperature=0)
    (call,) = [i for i in called.output if i.type == "function_call"]
    assert call.name in ("forecast", "clock") and json.loads(call.arguments) is not None
    with client.responses.stream(model="tiny", input="Weather in Oslo?", tools=tools,
                                 tool_choice={"type": "function", "name": "clock"},
                                 max_output_tokens=40, temperature=0) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert [i.name for i in streamed.output if i.type == "function_call"] == ["clock"]
    answer = client.responses.create(model="tiny", previous_response_id=called.id, tools=tools,
                                     max_output_tokens=8, temperature=0, input=[
                                         {"type": "function_call_output", "call_id": call.call_id,
                                          "output": "sunny, 21 C"}])
    assert answer.status in ("completed", "incomplete") and answer.output[-1].type in (
        "message", "function_call")
    # the call and its output went into the prompt after the first turn's
    assert answer.usage.input_tokens > called.usage.input_tokens + 8


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].url"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0]"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": []}, "input"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
])
def test_bad_requests_name_the_field(engine, start_worker, gateway, body, param):  # noqa: F811
    start_worker(engine)
    with pytest.raises(openai.BadRequestError) as e:
        api(gateway()).responses.create(model="tiny", **body)
    assert e.value.body["param"] == param


def until(fn, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if what(value):
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {value}")


def test_background_responses_complete_cancel_and_survive_their_gateway(
        engine, start_worker, gateway, redis_server, prefix):  # noqa: F811
    """Queued at once and read by the gateway; GET shows them through to completed. A
    cancelled one stays cancelled and its worker aborts it. One whose gateway stops
    mid-way is finished by the next gateway that a client asks about it."""
    engine.step_s = 0.05
    start_worker(engine)
    client = api(gateway())
    queued = client.responses.create(model="tiny", input="2 + 2?", background=True)
    assert queued.status in ("queued", "in_progress") and queued.background
    done = until(lambda: client.responses.retrieve(queued.id), lambda r: r.status == "completed")
    assert done.output_text == SAID and done.output[0].type == "reasoning"

    engine.step_s = 0.5  # long enough to cancel, and to stop a gateway, mid-way
    doomed = client.responses.create(model="tiny", input="2 + 2?", background=True)
    assert client.responses.cancel(doomed.id).status == "cancelled"
    time.sleep(1.5)
    assert client.responses.retrieve(doomed.id).status == "cancelled"

    from roseinfer.frontends.openai.app import BackgroundGateway, GatewayConfig
    config = GatewayConfig(redis_server.url, prefix, model_name="tiny")
    first = BackgroundGateway(config, port=free_port()).start()
    orphan = api(first).responses.create(model="tiny", input="2 + 2?", background=True)
    until(lambda: api(first).responses.retrieve(orphan.id), lambda r: r.status == "in_progress")
    first.stop()
    second = BackgroundGateway(config, port=free_port()).start()
    try:
        done = until(lambda: api(second).responses.retrieve(orphan.id),
                     lambda r: r.status == "completed")
    finally:
        second.stop()
    assert done.output_text == SAID and done.output[0].content[0].text == THOUGHT


def test_an_agents_sdk_turn_calls_a_tool_and_answers(start_worker, gateway):
    """The OpenAI Agents SDK on the default model, over the Responses API: the tool is
    called (tool_choice required), its result fed back, and the run ends with an answer."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    from roseinfer import LLM

    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    llm = LLM("SmolLM2-135M-Instruct", device="cpu", num_kv_blocks=128, cuda_graphs=False)
    start_worker(llm.engine)
    agents.set_tracing_disabled(True)
    model = agents.OpenAIResponsesModel(
        "tiny", AsyncOpenAI(base_url=f"{gateway().url}/v1", api_key="none", max_retries=0))
    agent = agents.Agent(name="weather", instructions="Answer with the weather.", model=model,
                         tools=[get_weather], model_settings=agents.ModelSettings(
                             tool_choice="required", max_tokens=40, temperature=0))
    result = agents.Runner.run_sync(agent, "Weather in Oslo?", max_turns=3)
    llm.close()
    assert len(calls) == 1 and isinstance(calls[0], str)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item" and isinstance(result.final_output, str)
