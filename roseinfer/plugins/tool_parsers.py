"""Tool-call parsers, one per model family's format, named as vLLM names them:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per
  call, after any text (Hermes, Qwen2.5, Qwen3).
- ``llama3_json``: the output is the call, ``{"name": ..., "parameters": {...}}``, after an
  optional ``<|python_tag|>``; several are joined by ``;`` (Llama 3.1-3.3).
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``, after any
  text (Mistral's v3 tokenizer and its instruct models).
"""
from __future__ import annotations

import json
import re

from roseinfer.core.hookspecs import hookimpl
from roseinfer.core.tools import ToolCall, held_from, new_call


@hookimpl
def roseinfer_register_tool_parsers(register):
    register("hermes", Hermes)
    register("llama3_json", Llama3Json)
    register("mistral", Mistral)


def _call(obj, arguments_key: str) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError(f"a call must be an object with a name, got {str(obj)[:100]!r}")
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError(f"{obj['name']}'s arguments are not an object")
    return new_call(obj["name"], args)


class AfterMarker:
    """Calls that follow a marker, after any content."""
    MARKER = ""

    def start(self, text: str) -> int:
        return held_from(text, self.MARKER)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        at = text.find(self.MARKER)
        return (text, []) if at < 0 else (text[:at], self.calls(text[at:]))

    def calls(self, text: str) -> list[ToolCall]:
        raise NotImplementedError


class Hermes(AfterMarker):
    MARKER = "<tool_call>"
    BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def calls(self, text: str) -> list[ToolCall]:
        return [_call(json.loads(body), "arguments")
                for body in self.BLOCK.findall(text) if body.strip()]


LEADING_SPACE = re.compile(r"\s*")


class Llama3Json:
    TAG = "<|python_tag|>"

    def start(self, text: str) -> int:
        # Called as the output grows: only its first characters after whitespace decide
        # (no copy of the whole text each time).
        at = LEADING_SPACE.match(text).end()
        head = text[at:at + len(self.TAG)]
        if head.startswith("{") or self.TAG.startswith(head):
            return 0  # the whole output is a call, or may be
        return len(text)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            obj, at = decoder.raw_decode(body, at)
            calls.append(_call(obj, "parameters"))
            at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        return "", calls


class Mistral(AfterMarker):
    MARKER = "[TOOL_CALLS]"

    def calls(self, text: str) -> list[ToolCall]:
        value, _ = json.JSONDecoder().raw_decode(text[len(self.MARKER):].lstrip())
        return [_call(c, "arguments") for c in (value if isinstance(value, list) else [value])]
