"""OpenAI's Responses API requests as chat requests: input items, ``instructions``, function
tools, ``text.format`` and the conversation a ``previous_response_id`` left, turned into
the chat completions body the gateway already serves (mapping.chat_call)."""
from __future__ import annotations

from typing import Optional

from roseinfer.core import content_parts
from roseinfer.core.errors import InvalidRequestError
from roseinfer.frontends.openai.mapping import APIError, bad

UNSUPPORTED = {"conversation": None, "prompt": None, "truncation": "disabled"}
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def chat_body(body: dict, history: list[dict]) -> tuple[dict, list[dict]]:
    """(the chat completions body, the conversation to store: ``history`` and this input,
    without ``instructions``, which do not carry over to a next response)."""
    for key, default in UNSUPPORTED.items():
        if body.get(key) not in (None, default):
            raise bad(key, f"{key} is not supported by this server yet")
    turns = history + input_messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", "instructions must be a string")
    chat = {"messages": ([{"role": "system", "content": instructions}] if instructions else [])
            + turns, "stream": bool(body.get("stream", False))}
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls"),
                         ("seed", "seed"), ("include_reasoning", "include_reasoning"),
                         ("chat_template_kwargs", "chat_template_kwargs")):
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]
    if body.get("tools"):
        chat["tools"] = [function_tool(t, i) for i, t in enumerate(_list(body, "tools"))]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = tool_choice(body["tool_choice"])
    effort = (body.get("reasoning") or {}).get("effort") \
        if isinstance(body.get("reasoning"), dict) else None
    if effort is not None:
        chat["reasoning_effort"] = effort
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt is not None:
        chat["response_format"] = response_format(fmt)
    return chat, turns


def input_messages(items) -> list[dict]:
    """Input text or items as chat messages: a function call joins the assistant turn
    before it (one turn, several calls), its output is a tool turn; reasoning items are
    the model's own past thinking and are not sent back to it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("input", "input must be a string or a non-empty list of items")
    turns: list[dict] = []
    for i, item in enumerate(items):
        field = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(field, f"{field} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            turns.append({"role": _role(item, field), "content": _text(item.get("content"), field)})
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", field), "type": "function", "function": {
                "name": _str(item, "name", field), "arguments": _str(item, "arguments", field)}}
            if not (turns and turns[-1]["role"] == "assistant"):
                turns.append({"role": "assistant", "content": ""})
            turns[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            turns.append({"role": "tool", "tool_call_id": _str(item, "call_id", field),
                          "content": output if isinstance(output, str) else
                          _text(output, f"{field}.output")})
        elif kind != "reasoning":
            raise bad(f"{field}.type", f"input items of type {kind!r} are not supported by "
                      "this server: message, function_call, function_call_output, reasoning")
    return turns


def function_tool(tool, i: int) -> dict:
    field = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad(f"{field}.type", "only function tools are supported by this server "
                  f"(type \"function\"), got {tool.get('type') if isinstance(tool, dict) else tool!r}")
    fn = {"name": tool.get("name"), "parameters": tool.get("parameters") or {
        "type": "object", "properties": {}}}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # "none", "auto", "required": chat_call checks them


def response_format(fmt) -> dict:
    """``text.format``: text, json_object, or json_schema ({"name", "schema", "strict"})."""
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("text.format", "text.format must be {\"type\": \"text\"}, "
                  "{\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"name\", \"schema\"}")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    return {"type": "json_schema", "json_schema": {
        k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}


def _role(item: dict, field: str) -> str:
    role = ROLES.get(item.get("role"))
    if role is None:
        raise bad(f"{field}.role", f"role must be one of {sorted(ROLES)}, got {item.get('role')!r}")
    return role


def _text(content, field: str) -> str | list[dict]:
    """A message's content: a string, or parts: text (input_text, output_text, text) and
    images (input_image, as a data URL), checked here (errors name the input item) and
    kept as data URLs: a stored conversation is JSON."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{field}.content", "content must be a string or a list of content parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        at = f"{field}.content[{j}]"
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": _str(part, "text", at)})
        elif kind == "input_image":
            parts.append({"type": "image_url", "url": _str(part, "image_url", at)})
        else:
            raise bad(at, f"content parts of type {kind!r} are not supported by this server: "
                      "input_text, output_text, input_image")
    try:
        text, images = content_parts.parse(parts, f"{field}.content")
    except InvalidRequestError as e:
        raise bad(e.field, e.message) from None
    return parts if images else text


def _str(item: dict, key: str, field: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad(f"{field}.{key}", f"{key} must be a string, got {value!r}")
    return value


def _list(body: dict, key: str) -> list:
    if not isinstance(body[key], list):
        raise bad(key, f"{key} must be a list")
    return body[key]


def previous_id(body: dict) -> Optional[str]:
    pid = body.get("previous_response_id")
    if pid is not None and not isinstance(pid, str):
        raise APIError(400, "previous_response_id must be a string", "previous_response_id")
    return pid
