"""Reading a request entry of protocol v1 (docs/protocol.md): its rid, its n, and the
whole request, decoded and checked field by field; a bad field raises InvalidRequestError
naming it. Pure functions, no I/O: the worker's reader thread runs them.
"""
from __future__ import annotations

import json
import re
from typing import Optional

import msgpack

from roseinfer.core import content_parts
from roseinfer.core.errors import InvalidRequestError, short as _short
from roseinfer.core.sampling import MAX_N, SamplingParams, is_int
from roseinfer.core.tools import Tools, check_tools
from roseinfer.frontends.redis_streams.pooling_entry import pooling_task
from roseinfer.frontends.redis_streams.protocol import (
    RID_PATTERN, ROLES, SAMPLING_KEYS, TOOL_KEYS, VERSION, Chat, Limits, Prompt, Request,
    entry_time)

BACKLOG_ID = re.compile(rb"\d{1,20}-\d{1,20}")


def reply_rid(entry_id: str, fields: dict) -> str:
    """Where the replies of an entry go: its rid when readable, else the entry ID."""
    try:
        rid = _str_field(fields, "rid")
    except InvalidRequestError:
        return entry_id
    return rid if rid is not None and RID_PATTERN.fullmatch(rid) else entry_id


def queued_at(entry_id: str, fields: dict) -> float:
    """When a request was queued, in seconds since the epoch: its backlog entry's time if a
    worker moved it from the backlog (lanes.py), else its own entry's."""
    moved = fields.get(b"backlog_id", b"")
    if isinstance(moved, bytes) and BACKLOG_ID.fullmatch(moved):
        return entry_time(moved.decode())
    return entry_time(entry_id)


def decode_request(entry_id: str, fields: dict, limits: Limits = Limits()) -> Request:
    """Parse and check one request entry (fields as bytes, as Redis returns them).

    Raises InvalidRequestError naming the first bad field; range checks of the sampling
    parameters are SamplingParams' own, the vocabulary the engine's. Sizes are checked
    against ``limits`` before the work they would cost.
    """
    size = sum(len(v) for v in fields.values() if isinstance(v, bytes))
    if size > limits.max_entry_bytes:
        raise InvalidRequestError(
            "body", f"the entry is {size} bytes, over the worker's limit of "
            f"{limits.max_entry_bytes} (--max-entry-bytes)", "too_long")
    version = _str_field(fields, "v")
    if version not in (None, VERSION):
        raise InvalidRequestError("v", f"protocol version {version!r} is not supported; send v=1")
    rid = _str_field(fields, "rid")
    if rid is None:
        rid = entry_id
    elif not RID_PATTERN.fullmatch(rid):
        raise InvalidRequestError("rid", "must be 1-128 characters of [A-Za-z0-9_.:-]")
    body = _decode_body(fields[b"body"]) if b"body" in fields else _shell_body(fields)
    pooling = pooling_task(body)
    if pooling is not None:  # one final chunk, no sampling: only the priority applies
        return Request(rid, None, SamplingParams(priority=body.get("priority", 0)),
                       pooling=pooling)
    prompt = _prompt(body, limits)
    stream_interval = body.get("stream_interval", 1)
    if not is_int(stream_interval) or stream_interval < 1:
        raise InvalidRequestError("stream_interval",
                                  f"must be an integer >= 1, got {_short(stream_interval)}")
    for key in ("stop", "stop_token_ids"):
        if key in body and not isinstance(body[key], (list, str) if key == "stop" else list):
            raise InvalidRequestError(key, f"must be a list, got {_short(body[key])}")
    _check_stop_sizes(body, limits)
    if "logit_bias" in body:
        body["logit_bias"] = _logit_bias(body["logit_bias"])
    raw = body.get("raw", False)
    if not isinstance(raw, bool):
        raise InvalidRequestError("raw", f"must be true or false, got {_short(raw)}")
    lora = body.get("lora")
    if lora is not None and (not isinstance(lora, str) or not 0 < len(lora) <= 256):
        raise InvalidRequestError("lora", f"must be an adapter's name (a string of 1-256 "
                                  f"characters) or nil, got {_short(lora)}")
    sampling = {k: body[k] for k in SAMPLING_KEYS if k in body}
    _template_kwargs(body, prompt)
    tools = _tools(body, prompt)
    if tools is not None and tools.forced:
        if sampling.get("response_format") not in (None, {"type": "text"}):
            raise InvalidRequestError("response_format", "cannot go with tool_choice required "
                                      "or a named function: the tools' schemas constrain the "
                                      "output")
        sampling["response_format"] = tools.constraint()
    return Request(rid, prompt, SamplingParams(**sampling), stream_interval, raw, tools, lora)


def _tools(body: dict, prompt: Prompt) -> Optional[Tools]:
    given = [k for k in TOOL_KEYS if k in body]
    if given and not isinstance(prompt, Chat):
        raise InvalidRequestError(given[0], "goes with messages: tools are rendered by the "
                                  "chat template")
    if not given:
        return None
    prompt.tools = check_tools(body.get("tools"), body.get("tool_choice"),
                               body.get("parallel_tool_calls", True))
    return prompt.tools


# Template options that are the rendering's own: a request may not set them.
RENDERING_KEYS = {"messages", "conversation", "tools", "documents", "add_generation_prompt",
                  "tokenize", "continue_final_message", "return_dict", "chat_template"}


def _template_kwargs(body: dict, prompt: Prompt) -> None:
    """chat_template_kwargs (e.g. Qwen3's enable_thinking): a map of names to scalars,
    passed to a chat request's template."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return
    if not isinstance(prompt, Chat):
        raise InvalidRequestError("chat_template_kwargs", "goes with messages: only they are "
                                  "rendered by the chat template")
    if not isinstance(kwargs, dict) or len(kwargs) > 32 or not all(
            isinstance(k, str) and k.isidentifier() and k not in RENDERING_KEYS
            and (v is None or isinstance(v, (bool, int, float, str)) and len(str(v)) <= 4096)
            for k, v in kwargs.items()):
        raise InvalidRequestError("chat_template_kwargs", "must be a map of at most 32 names "
                                  "to scalars (strings of at most 4096 characters), not "
                                  f"{sorted(RENDERING_KEYS)}; got {_short(kwargs)}")
    prompt.template_kwargs = kwargs


def _decode_body(raw: bytes) -> dict:
    try:
        body = msgpack.unpackb(raw, raw=False)
    except ValueError as e:  # every msgpack decoding error is a ValueError
        raise InvalidRequestError("body", f"is not valid msgpack ({e or type(e).__name__})") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("body", f"must be a msgpack map, got {type(body).__name__}")
    return body


def _prompt(body: dict, limits: Limits) -> Prompt:
    given = [k for k in ("prompt", "prompt_token_ids", "messages") if k in body]
    if len(given) != 1:
        raise InvalidRequestError(
            "prompt", "give exactly one of prompt (text), prompt_token_ids or messages")
    if "messages" in body:
        return _chat(body["messages"], limits)
    if "prompt" in body:
        text = body["prompt"]
        if not isinstance(text, str):
            raise InvalidRequestError("prompt", f"must be a string, got {type(text).__name__}")
        _check_chars("prompt", len(text), limits)
        return text
    ids = body["prompt_token_ids"]
    if not isinstance(ids, list):
        raise InvalidRequestError("prompt_token_ids", "must be a list of integer token ids")
    if limits.max_prompt_tokens is not None and len(ids) >= limits.max_prompt_tokens:
        raise InvalidRequestError(
            "prompt_token_ids", f"{len(ids)} tokens leave no room to generate within the "
            f"model's {limits.max_prompt_tokens}-token context; shorten the prompt", "too_long")
    if not all(is_int(t) for t in ids):
        raise InvalidRequestError("prompt_token_ids", "must be a list of integer token ids")
    return ids


def _chat(messages, limits: Limits) -> Chat:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list of maps with role "
                                  f"({', '.join(ROLES)}) and content (a string or a list "
                                  "of content parts)")
    chat = Chat([])
    for i, m in enumerate(messages):
        message, images = _message(m, f"messages[{i}]")
        chat.messages.append(message)
        chat.images += images
    _check_chars("messages", sum(content_parts.text_chars(m["content"]) +
                                 len(str(m.get("tool_calls", ""))) for m in chat.messages),
                 limits)
    return chat


def _message(m, field: str) -> tuple[dict, list]:
    """One turn: role and content, and the images of its content parts (bytes, field);
    an assistant turn may carry the tool calls it made (content may then be empty), a
    tool turn the id of the call it answers."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise InvalidRequestError(field, f"must be a map with role ({', '.join(ROLES)}) and "
                                  "content (a string or a list of content parts)")
    calls = m.get("tool_calls")
    content = m.get("content")
    if content is None and calls and m["role"] == "assistant":
        content = ""
    content, images = content_parts.parse(content, f"{field}.content")
    out = {"role": m["role"], "content": content}
    if calls is not None:
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise InvalidRequestError(f"{field}.tool_calls", "only an assistant turn carries "
                                      "tool_calls: a list of {id, type, function: {name, "
                                      "arguments}}")
        out["tool_calls"] = [_past_call(c, f"{field}.tool_calls[{i}]")
                             for i, c in enumerate(calls)]
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    return out, images


def _past_call(call, field: str) -> dict:
    """A call an earlier assistant turn made, its arguments as an object: chat templates
    render them as JSON themselves."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequestError(field, "must be {id, type: function, function: {name, "
                                  "arguments}}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError:
            raise InvalidRequestError(f"{field}.function.arguments",
                                      "must be a JSON object (as text or a map)") from None
    return {"id": str(call.get("id", "")), "type": "function",
            "function": {"name": fn["name"], "arguments": args}}


def _logit_bias(bias) -> dict:
    """Token ids come as strings of digits, as JSON writes them: msgpack maps with
    integer keys are refused while decoding (colliding integer keys would make one
    entry's map cost quadratic time to build)."""
    if not isinstance(bias, dict):
        raise InvalidRequestError("logit_bias", f"must be a map of token ids to biases, "
                                  f"got {_short(bias)}")
    out = {}
    for token, b in bias.items():
        if isinstance(token, str) and token.isdigit() and len(token) < 12:
            token = int(token)
        out[token] = b
    return out


def _check_chars(name: str, chars: int, limits: Limits) -> None:
    if limits.max_prompt_chars is not None and chars > limits.max_prompt_chars:
        raise InvalidRequestError(
            name, f"{chars} characters cannot fit the model's {limits.max_prompt_tokens}-token"
            f" context (at most {limits.max_prompt_chars} characters even at the longest "
            "tokens); shorten the prompt", "too_long")


def _check_stop_sizes(body: dict, limits: Limits) -> None:
    stop = body.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    chars = sum(len(s) for s in stop if isinstance(s, str))
    if len(stop) > limits.max_stop or chars > limits.max_stop_chars:
        raise InvalidRequestError(
            "stop", f"{len(stop)} strings of {chars} characters; at most {limits.max_stop} "
            f"strings of {limits.max_stop_chars} characters together")
    if len(body.get("stop_token_ids", [])) > limits.max_stop_token_ids:
        raise InvalidRequestError(
            "stop_token_ids", f"at most {limits.max_stop_token_ids} ids, got "
            f"{len(body['stop_token_ids'])}")


# Shell form: the same keys as plain string fields, for redis-cli users. Lists of ids are
# written "1,2,3"; stop is a single string.
def _ids(s: str) -> list[int]:
    return [int(t) for t in s.replace(",", " ").split()]


def _bool(s: str) -> bool:
    return {"true": True, "1": True, "false": False, "0": False}[s.lower()]


def _json_map(s: str) -> dict:
    value = json.loads(s)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def _json_list(s: str) -> list:
    value = json.loads(s)
    if not isinstance(value, list):
        raise ValueError("not a JSON array")
    return value


def _bias(s: str) -> dict[int, float]:
    pairs = (p.split(":") for p in s.replace(",", " ").split())
    return {int(token): float(b) for token, b in pairs}


_SHELL_PARSERS = {
    "prompt": str, "prompt_token_ids": _ids, "n": int, "max_tokens": int, "temperature": float,
    "top_p": float, "top_k": int, "min_p": float, "seed": int, "stop": lambda s: [s],
    "stop_token_ids": _ids, "ignore_eos": _bool, "stream_interval": int, "raw": _bool,
    "speculative": _bool, "priority": int, "lora": str,
    "logprobs": int, "prompt_logprobs": int, "repetition_penalty": float, "frequency_penalty": float,
    "presence_penalty": float, "logit_bias": _bias, "response_format": _json_map,
    "logits_processors": _json_map,
    "task": str, "input": str, "query": str, "documents": _json_list, "dimensions": int,
    "truncate": str, "prompt_name": str, "encoding_format": str,
}
_SHELL_KINDS = {int: "an integer", float: "a number", _ids: "integers separated by commas",
                _bool: "true or false", _bias: "id:bias pairs separated by commas",
                _json_map: "a JSON object", _json_list: "a JSON array"}


def _shell_body(fields: dict) -> dict:
    body = {}
    for key, parse in _SHELL_PARSERS.items():
        text = _str_field(fields, key)
        if text is None:
            continue
        try:
            body[key] = parse(text)
        except (ValueError, KeyError):
            raise InvalidRequestError(key, f"cannot read {text!r} as {_SHELL_KINDS[parse]}") from None
    return body


def _str_field(fields: dict, name: str) -> Optional[str]:
    raw = fields.get(name.encode())
    if raw is None:
        return None
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise InvalidRequestError(name, "is not valid UTF-8") from None


def requested_n(fields: dict) -> int:
    """The n of a request entry, read leniently: 1 where it is unreadable (its admission
    then refuses the entry, saying why)."""
    try:
        body = _decode_body(fields[b"body"]) if b"body" in fields else {
            "n": int(_str_field(fields, "n") or 1)}
    except (InvalidRequestError, ValueError):
        return 1
    n = body.get("n", 1)
    return n if is_int(n) and 1 <= n <= MAX_N else 1
