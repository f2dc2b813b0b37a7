"""Codec and validation of protocol v1, against the field lists of DESIGN.md section 4."""
import msgpack
import pytest

from roseinfer.core.errors import InvalidRequestError
from roseinfer.frontends.redis_streams.protocol import (
    Chunk, Keys, Limits, decode_chunk, encode_chunk, encode_request)
from roseinfer.frontends.redis_streams.request_entry import decode_request, queued_at, reply_rid


def as_redis(fields: dict) -> dict:
    """Fields as redis-py returns them: bytes keys and values."""
    return {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in fields.items()}


def entry(body=None, **fields) -> dict:
    if body is not None:
        fields["body"] = body if isinstance(body, bytes) else msgpack.packb(body)
    return as_redis({"v": "1", **fields})


def test_key_names():
    keys = Keys("p")
    assert (keys.requests, keys.cancel, keys.dead) == ("p:requests", "p:cancel", "p:dead")
    assert keys.out("abc") == "p:out:{abc}"
    assert Keys().requests == "roseinfer:requests"


def test_body_round_trip_and_defaults():
    fields = as_redis(encode_request("Hi", rid="r-1", max_tokens=5, temperature=0, stop=["."],
                                     stream_interval=2))
    req = decode_request("1-0", fields)
    assert (req.rid, req.prompt, req.stream_interval) == ("r-1", "Hi", 2)
    p = req.params
    assert (p.max_tokens, p.temperature, p.stop, p.top_p, p.top_k, p.seed) == (5, 0, ["."], 1.0, 0, None)
    default = decode_request("1-0", entry({"prompt_token_ids": [1, 2]}))
    assert (default.rid, default.prompt, default.params.max_tokens, default.params.temperature) == \
        ("1-0", [1, 2], 16, 1.0)


def test_unknown_keys_are_ignored():
    req = decode_request("1-0", entry({"prompt": "x", "future_knob": {"a": 1}}))
    assert req.prompt == "x"


def test_shell_form():
    fields = as_redis({"prompt": "Hello", "max_tokens": "20", "temperature": "0.5", "stop": "\n",
                       "ignore_eos": "true", "stop_token_ids": "1,2", "seed": "7"})
    req = decode_request("5-1", fields)
    p = req.params
    assert (req.rid, req.prompt, p.max_tokens, p.temperature, p.stop, p.ignore_eos, p.stop_token_ids,
            p.seed) == ("5-1", "Hello", 20, 0.5, ["\n"], True, [1, 2], 7)
    assert decode_request("5-1", as_redis({"prompt_token_ids": "3 4 5"})).prompt == [3, 4, 5]


BAD = [
    (entry(b"\xc1"), "body"),                                  # undecodable msgpack
    (entry(b"\x92\x01"), "body"),                              # truncated msgpack
    (entry([1, 2]), "body"),                                   # not a map
    (as_redis({"v": "2", "prompt": "x"}), "v"),
    (entry({"prompt": "x"}, rid="bad rid!"), "rid"),
    (entry({"prompt": "x"}, rid="r" * 129), "rid"),
    (entry({"max_tokens": 3}), "prompt"),                      # missing prompt
    (entry({"prompt": "x", "prompt_token_ids": [1]}), "prompt"),
    (entry({"prompt": 5}), "prompt"),
    (entry({"prompt_token_ids": "1 2"}), "prompt_token_ids"),
    (entry({"prompt_token_ids": [1, "2"]}), "prompt_token_ids"),
    (entry({"prompt_token_ids": [1, True]}), "prompt_token_ids"),
    (entry({"prompt": "x", "max_tokens": 0}), "max_tokens"),
    (entry({"prompt": "x", "max_tokens": "5"}), "max_tokens"),
    (entry({"prompt": "x", "max_tokens": 2.5}), "max_tokens"),
    (entry({"prompt": "x", "temperature": -1}), "temperature"),
    (entry({"prompt": "x", "temperature": "hot"}), "temperature"),
    (entry({"prompt": "x", "top_p": 0}), "top_p"),
    (entry({"prompt": "x", "top_k": -1}), "top_k"),
    (entry({"prompt": "x", "min_p": 2}), "min_p"),
    (entry({"prompt": "x", "seed": 1.5}), "seed"),
    (entry({"prompt": "x", "stop": 5}), "stop"),
    (entry({"prompt": "x", "stop": [""]}), "stop"),
    (entry({"prompt": "x", "stop_token_ids": 5}), "stop_token_ids"),
    (entry({"prompt": "x", "stop_token_ids": [-1]}), "stop_token_ids"),
    (entry({"prompt": "x", "ignore_eos": "yes"}), "ignore_eos"),
    (entry({"prompt": "x", "stream_interval": 0}), "stream_interval"),
    (entry({"prompt": "x", "stream_interval": None}), "stream_interval"),
    (as_redis({"prompt": "x", "max_tokens": "abc"}), "max_tokens"),
    (as_redis({"prompt": "x", "ignore_eos": "maybe"}), "ignore_eos"),
    (as_redis({"prompt_token_ids": "1,x"}), "prompt_token_ids"),
    (entry({"prompt": "x", "logprobs": 21}), "logprobs"),
    (entry({"prompt": "x", "repetition_penalty": 0}), "repetition_penalty"),
    (entry({"prompt": "x", "frequency_penalty": 3}), "frequency_penalty"),
    (entry({"prompt": "x", "presence_penalty": "a"}), "presence_penalty"),
    (entry({"prompt": "x", "logit_bias": [1]}), "logit_bias"),
    (entry({"prompt": "x", "logit_bias": {"a": 1}}), "logit_bias"),
    (entry({"prompt": "x", "logit_bias": {"5": 200}}), "logit_bias"),
    (entry({"prompt": "x", "logit_bias": {5: 1}}), "body"),   # integer map keys
    (as_redis({"prompt": "x", "logit_bias": "5"}), "logit_bias"),
    ({b"prompt": b"\xff\xfe"}, "prompt"),                      # not UTF-8
]


@pytest.mark.parametrize("fields,field", BAD, ids=[f"{i}-{f}" for i, (_, f) in enumerate(BAD)])
def test_bad_entries_name_the_field(fields, field):
    with pytest.raises(InvalidRequestError) as e:
        decode_request("1-0", fields)
    assert e.value.field == field and e.value.code == "bad_request"
    assert str(e.value).startswith(f"{field}: ")


def test_logits_fields_in_both_forms():
    """logit_bias keys are strings of digits, as JSON writes them; the client converts."""
    body = {"prompt": "x", "logprobs": 3, "repetition_penalty": 1.2, "frequency_penalty": 0.5,
            "presence_penalty": -0.5, "logit_bias": {"5": 1.5, "7": -100}}
    p = decode_request("1-0", entry(body)).params
    assert decode_request("1-0", as_redis(encode_request("x", logit_bias={5: 1.5, 7: -100}))) \
        .params.logit_bias == {5: 1.5, 7: -100}
    assert (p.logprobs, p.repetition_penalty, p.frequency_penalty, p.presence_penalty,
            p.logit_bias) == (3, 1.2, 0.5, -0.5, {5: 1.5, 7: -100})
    shell = as_redis({"prompt": "x", "logprobs": "2", "logit_bias": "5:1.5,7:-100",
                      "presence_penalty": "0.25"})
    p = decode_request("1-0", shell).params
    assert (p.logprobs, p.logit_bias, p.presence_penalty) == (2, {5: 1.5, 7: -100.0}, 0.25)
    chunk = Chunk("r", 0, [4], "a", logprobs=[{"logprob": -0.5, "top_logprobs": [[4, -0.5]]}])
    assert decode_chunk(as_redis(encode_chunk(chunk))) == chunk


def test_speculative_in_both_forms_and_through_the_gateway():
    """A request may turn drafts off: the body's bool, the shell form's "false", the
    gateway's extension field; anything but a bool is refused by name."""
    from roseinfer.frontends.openai.mapping import APIError, chat_call

    assert decode_request("1-0", entry({"prompt": "x"})).params.speculative is True
    assert decode_request("1-0", entry({"prompt": "x", "speculative": False})) \
        .params.speculative is False
    assert decode_request("1-0", as_redis({"prompt": "x", "speculative": "false"})) \
        .params.speculative is False
    with pytest.raises(InvalidRequestError, match="^speculative: "):
        decode_request("1-0", entry({"prompt": "x", "speculative": "no"}))
    messages = [{"role": "user", "content": "hi"}]
    assert chat_call({"messages": messages, "speculative": False}).params["speculative"] is False
    assert "speculative" not in chat_call({"messages": messages}).params
    with pytest.raises(APIError) as e:
        chat_call({"messages": messages, "speculative": 1})
    assert e.value.param == "speculative"


def test_a_request_moved_from_the_backlog_was_queued_when_its_backlog_entry_was():
    assert queued_at("9000-0", {b"backlog_id": b"4500-3"}) == 4.5
    assert queued_at("9000-0", {}) == 9.0
    assert queued_at("9000-0", {b"backlog_id": b"soon"}) == 9.0  # unreadable: its own


def test_reply_rid_falls_back_to_the_entry_id():
    assert reply_rid("9-0", as_redis({"rid": "mine"})) == "mine"
    assert reply_rid("9-0", as_redis({"rid": "not valid"})) == "9-0"
    assert reply_rid("9-0", {b"rid": b"\xff"}) == "9-0"
    assert reply_rid("9-0", {}) == "9-0"


def test_client_side_checks():
    with pytest.raises(TypeError, match="max_token"):
        encode_request("x", max_token=3)
    with pytest.raises(ValueError, match="rid"):
        encode_request("x", rid="has space")
    body = msgpack.unpackb(encode_request([1, 2], seed=None)["body"])
    assert body == {"prompt_token_ids": [1, 2]}  # None means "the worker's default"


def test_chunk_bodies():
    mid = encode_chunk(Chunk("r", 1, [5, 6], "ab"))
    assert mid["v"] == "1"
    assert msgpack.unpackb(mid["body"]) == {"rid": "r", "seq": 1, "token_ids": [5, 6], "text": "ab",
                                            "finish_reason": None}
    final = Chunk("r", 2, [], "", "error", {"prompt_tokens": 0, "completion_tokens": 0},
                  {"code": "bad_request", "message": "m"})
    assert decode_chunk(as_redis(encode_chunk(final))) == final


LIMITS = Limits(max_entry_bytes=1000, max_prompt_tokens=50, max_prompt_chars=400, max_stop=3,
                max_stop_chars=20, max_stop_token_ids=5)


@pytest.mark.parametrize("fields,field,code,says", [
    (encode_request("x" * 2000), "body", "too_long", "--max-entry-bytes"),
    ({"prompt": "x" * 1200}, "body", "too_long", "over the worker's limit of 1000"),
    (encode_request("x" * 401), "prompt", "too_long", "at most 400 characters"),
    (encode_request([1] * 50), "prompt_token_ids", "too_long", "50-token context"),
    (encode_request([1, "a"]), "prompt_token_ids", "bad_request", "integer token ids"),
    (encode_request("hi", stop=["a", "b", "c", "d"]), "stop", "bad_request", "at most 3"),
    (encode_request("hi", stop=["x" * 21]), "stop", "bad_request", "20 characters"),
    (encode_request("hi", stop_token_ids=[1] * 6), "stop_token_ids", "bad_request", "at most 5"),
])
def test_limits_refuse_before_the_work_they_would_cost(fields, field, code, says):
    with pytest.raises(InvalidRequestError, match=says) as e:
        decode_request("1-0", as_redis(fields), LIMITS)
    assert (e.value.field, e.value.code) == (field, code)


def test_entries_within_the_limits_pass():
    req = decode_request("1-0", as_redis(encode_request("x" * 400, stop=["ab", "c"])), LIMITS)
    assert len(req.prompt) == 400 and req.params.stop == ["ab", "c"]
    assert decode_request("1-0", as_redis(encode_request([3] * 49)), LIMITS).prompt == [3] * 49


def test_messages_round_trip_and_are_checked():
    from roseinfer.frontends.redis_streams.protocol import Chat

    chat = Chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    req = decode_request("1-0", as_redis(encode_request(chat, max_tokens=3)))
    assert req.prompt == chat and req.params.max_tokens == 3
    bad = [[], [{"role": "user"}], [{"role": "robot", "content": "x"}], "Hi",
           [{"role": "user", "content": 3}]]
    for messages in bad:
        with pytest.raises(InvalidRequestError) as e:
            decode_request("1-0", entry({"messages": messages}))
        assert e.value.field.startswith("messages")  # "messages[0].content", ...
    with pytest.raises(InvalidRequestError, match="exactly one of"):
        decode_request("1-0", entry({"messages": chat.messages, "prompt": "x"}))
    with pytest.raises(InvalidRequestError) as e:  # sizes count before any templating
        decode_request("1-0", entry({"messages": [{"role": "user", "content": "x" * 50}]}),
                       Limits(max_prompt_tokens=10, max_prompt_chars=40))
    assert e.value.code == "too_long"


TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}


def test_tools_ride_beside_messages_and_past_calls_come_as_objects():
    from roseinfer.core.tools import check_tools
    from roseinfer.frontends.redis_streams.protocol import Chat

    turns = [{"role": "user", "content": "Time?"},
             {"role": "assistant", "content": None, "tool_calls": [{
                 "id": "call_1", "type": "function",
                 "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    chat = Chat(turns, check_tools([TOOL], "required", parallel=False))
    req = decode_request("1-0", as_redis(encode_request(chat, max_tokens=30)))
    assert req.tools == chat.tools and req.prompt.tools == chat.tools
    assert req.prompt.messages[1] == {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]}
    assert req.prompt.messages[2]["tool_call_id"] == "call_1"
    # required: the output is constrained to a call of the tool's schema
    schema = req.params.response_format["json_schema"]["schema"]
    assert schema["properties"]["arguments"] == TOOL["function"]["parameters"]


@pytest.mark.parametrize("body, field", [
    ({"prompt": "Hi", "tools": [TOOL]}, "tools"),
    ({"messages": [{"role": "user", "content": "Hi"}], "tools": [TOOL],
      "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "Hi"}], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}, "tools": [TOOL]}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "Hi", "tool_calls": []}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_tool_requests_name_the_field(body, field):
    with pytest.raises(InvalidRequestError) as e:
        decode_request("1-0", entry(body))
    assert e.value.field == field


def test_a_chunk_carries_its_calls():
    calls = [{"index": 0, "id": "call_9", "type": "function",
              "function": {"name": "get_time", "arguments": "{}"}}]
    final = Chunk("r", 3, [7], "", "tool_calls", {"prompt_tokens": 4, "completion_tokens": 9},
                  tool_calls=calls)
    assert msgpack.unpackb(encode_chunk(final)["body"])["tool_calls"] == calls
    assert decode_chunk(as_redis(encode_chunk(final))) == final
