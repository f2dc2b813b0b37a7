"""Tool calling: the tools a chat request offers, what its ``tool_choice`` asks, and the
calls its output holds.

``tool_choice`` "auto" lets the model answer or call: a tool-call parser (a plugin, one per
model family's format: plugins/tool_parsers.py) finds the calls in its text. "required" or
a named function constrains the output with structured output to JSON calls against the
tools' own schemas, so it is always a valid call. "none" leaves the output text.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import secrets
from dataclasses import dataclass
from typing import Optional, Protocol, Union

from roseinfer.core.errors import InvalidRequestError, short as _short

log = logging.getLogger(__name__)
CHOICES = ("none", "auto", "required")
# "auto" parsers by the model's family (its config's model_type), as vLLM names them
FAMILY_PARSERS = {"llama": "llama3_json", "mistral": "mistral", "qwen2": "hermes",
                  "qwen3": "hermes"}
DEFAULT_PARSER = "hermes"


def parser_name(configured: str, hf_config) -> str:
    """The tool-call parser a worker uses: the one configured, or its model family's."""
    if configured != "auto":
        return configured
    return FAMILY_PARSERS.get(getattr(hf_config, "model_type", None), DEFAULT_PARSER)


def held_from(text: str, marker: str) -> int:
    """Where ``marker`` starts in ``text``, or where a prefix of it ends the text (it may
    be arriving); len(text) if neither."""
    at = text.find(marker)
    if at >= 0:
        return at
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return len(text) - n
    return len(text)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def as_dict(self, index: int) -> dict:
        """The call as OpenAI and protocol v1 carry it."""
        return {"index": index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call(name: str, arguments) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ToolCall(f"call_{secrets.token_hex(12)}", name, text)


class ToolParser(Protocol):
    """What a tool-call parser plugin's factory() returns."""

    def start(self, text: str) -> int:
        """Where in ``text`` a call may begin (len(text) if nowhere yet): what comes before
        is content, streamed at once; the rest waits until the output ends."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output; raises ValueError for a call it cannot
        read."""


@dataclass(frozen=True)
class Tools:
    """A request's tools (OpenAI's shape, checked) and what it chose of them."""
    tools: tuple[dict, ...]
    choice: Union[str, dict] = "auto"   # CHOICES, or {"type": "function", "function": {"name"}}
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def forced(self) -> bool:
        """The output is JSON calls, constrained (``constraint``)."""
        return self.choice == "required" or isinstance(self.choice, dict)

    def constraint(self) -> dict:
        """The response_format that makes the output calls: one {"name", "arguments"}
        object (a named function, or one call), else a list of them."""
        pick = [t for t in self.tools if not isinstance(self.choice, dict)
                or t["function"]["name"] == self.choice["function"]["name"]]
        calls = [{"type": "object", "additionalProperties": False,
                  "required": ["name", "arguments"],
                  "properties": {"name": {"const": t["function"]["name"]},
                                 "arguments": t["function"].get("parameters")
                                 or {"type": "object"}}} for t in pick]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        many = self.parallel and not isinstance(self.choice, dict)
        schema = {"type": "array", "minItems": 1, "items": one} if many else one
        return {"type": "json_schema", "json_schema": {"name": "tool_calls", "schema": schema}}

    def prepare(self, processors, params) -> None:
        """Compile ``params``' constraint (the calls', ``constraint``) now, with
        ``processors``' prepare; a tool whose parameters do not compile is refused by its
        own field, not as the response_format the request did not send."""
        try:
            processors.prepare(params)
        except InvalidRequestError as e:
            if e.field != "response_format":
                raise
            for i, tool in enumerate(self.tools):
                alone = Tools((tool,), {"type": "function", "function": {
                    "name": tool["function"]["name"]}})
                try:
                    processors.prepare(dataclasses.replace(params,
                                                           response_format=alone.constraint()))
                except InvalidRequestError as bad:
                    raise InvalidRequestError(f"tools[{i}].function.parameters",
                                              bad.message) from None
            raise

    def forced_calls(self, text: str) -> list[ToolCall]:
        """The calls of a constrained output. A list that max_tokens cut short keeps the
        calls it completed; raises ValueError if there are none."""
        try:
            value = json.loads(text)
        except ValueError:
            value = _complete_items(text)
        calls = value if isinstance(value, list) else [value]
        if not calls:
            raise ValueError("no complete call")
        return [new_call(c["name"], c["arguments"]) for c in calls]

    def as_body(self) -> dict:
        """The request fields that carry these tools (protocol v1)."""
        return {"tools": list(self.tools), "tool_choice": self.choice,
                "parallel_tool_calls": self.parallel}


def _complete_items(text: str) -> list:
    """The whole items at the start of a JSON list cut short."""
    if not text.startswith("["):
        raise ValueError("not a list of calls")
    decoder, items, at = json.JSONDecoder(), [], 1
    while True:
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            return items
        items.append(item)
        at += len(text[at:]) - len(text[at:].lstrip(", "))


def check_tools(tools, choice="auto", parallel=True) -> Optional[Tools]:
    """A request's tools, checked; None without any. Raises InvalidRequestError naming
    the field at fault."""
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice", f"{_short(choice)} needs tools; give "
                                      "tools or leave tool_choice out")
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError("tools", "must be a list of {type: function, function: "
                                  "{name, description, parameters}}")
    names = []
    for i, tool in enumerate(tools):
        names.append(_check_tool(tool, f"tools[{i}]"))
    if len(set(names)) < len(names):
        raise InvalidRequestError("tools", f"function names repeat: {names}")
    choice = "auto" if choice is None else choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" \
            else None
        if name not in names:
            raise InvalidRequestError("tool_choice", f"{_short(choice)} names no function "
                                      f"of tools; they are {names}")
        choice = {"type": "function", "function": {"name": name}}
    elif choice not in CHOICES:
        raise InvalidRequestError("tool_choice", f"must be none, auto, required or "
                                  f"{{type: function, function: {{name}}}}, got {_short(choice)}")
    if not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls", f"must be true or false, got "
                                  f"{_short(parallel)}")
    return Tools(tuple(tools), choice, parallel)


def _check_tool(tool, field: str) -> str:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
        raise InvalidRequestError(field, "must be {type: function, function: {name, "
                                  "description, parameters}}")
    name = fn.get("name")
    if not isinstance(name, str) or not name or len(name) > 64 or not all(
            c.isalnum() or c in "_-" for c in name):
        raise InvalidRequestError(f"{field}.function.name", f"must be 1-64 letters, digits, "
                                  f"_ or -, got {_short(name)}")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise InvalidRequestError(f"{field}.function.parameters",
                                  f"must be a JSON schema object, got {_short(params)}")
    return name


class ToolStream:
    """One sample's output as content and calls, as it streams: content goes out as it
    comes until a call may begin; from there the text waits for the end and is parsed
    then. A call the parser cannot read is returned as content, with a warning."""

    def __init__(self, tools: Tools, parser: Optional[ToolParser]):
        self.tools, self.parser = tools, parser
        self.text = ""
        self.sent = 0  # characters of text already handed out as content

    def feed(self, new_text: str) -> str:
        """The content that can go out now."""
        self.text += new_text
        if self.tools.forced:
            return ""
        if self.tools.choice == "none" or self.parser is None:
            end = len(self.text)
        else:
            end = max(self.sent, self.parser.start(self.text))
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not handed out yet, calls) at the end of the output."""
        rest = self.text[self.sent:]
        if self.tools.forced:
            try:
                return "", self.tools.forced_calls(self.text)
            except (ValueError, KeyError, TypeError):  # cut short by max_tokens
                log.warning("a constrained tool call did not complete: %r", self.text[:200])
                return rest, []
        if self.tools.choice == "none" or self.parser is None or not rest:
            return rest, []
        try:
            content, calls = self.parser.parse(self.text)
        except ValueError as e:
            log.warning("the model's tool call does not parse (%s); returned as content", e)
            return rest, []
        if not calls:
            return rest, []
        calls = calls if self.tools.parallel else calls[:1]
        return content[self.sent:] if len(content) > self.sent else "", calls
