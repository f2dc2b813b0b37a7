"""OpenAI request bodies to protocol-v1 requests, and replies back to OpenAI objects.

Fields this engine cannot honour yet are refused with OpenAI's error shape when they
ask for something other than their default, never silently misread.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Optional

from roseinfer.core import content_parts
from roseinfer.core.errors import InvalidRequestError
from roseinfer.core.sampling import is_int, is_number
from roseinfer.core.tools import check_tools
from roseinfer.frontends.redis_streams.protocol import Chat, Prompt

CHAT_DEFAULT_MAX_TOKENS = 1024  # OpenAI's chat default is "up to the context"


class APIError(Exception):
    """An error as OpenAI shapes it: HTTP status, message, type, param, code."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 kind: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param)


@dataclass
class Call:
    """One OpenAI call as a queue request."""
    prompt: Prompt
    params: dict
    stream: bool
    include_usage: bool
    chat: bool
    continuous_usage: bool = False  # usage in every streamed chunk (vLLM's extension)
    reasoning: bool = True  # include_reasoning: a reasoning model's thinking goes out too

    @property
    def logprobs(self) -> bool:
        return "logprobs" in self.params

    @property
    def n(self) -> int:
        return self.params.get("n", 1)


# Fields accepted only at their default (value, or None meaning "absent or null").
_DEFAULTS = {"best_of": 1, "echo": False, "suffix": None, "functions": None,
             "function_call": None}
_LATER = "is not supported by this server yet"


def _check_defaults(body: dict) -> None:
    for name, default in _DEFAULTS.items():
        value = body.get(name)
        if value is None or value == default:
            continue
        raise bad(name, f"{name}={value!r} {_LATER}; leave it out or use {default!r}")


def _sampling(body: dict, max_tokens_default: int) -> dict:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    stop = body.get("stop")
    params = {"n": body.get("n"),
              "max_tokens": max_tokens_default if max_tokens is None else max_tokens,
              "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
              "seed": body.get("seed"), "stop": [stop] if isinstance(stop, str) else stop,
              "frequency_penalty": body.get("frequency_penalty"),
              "presence_penalty": body.get("presence_penalty"),
              "logit_bias": body.get("logit_bias") or None,
              "response_format": body.get("response_format"),
              # Extensions that vLLM's server takes too: not in OpenAI's API.
              "top_k": body.get("top_k"), "min_p": body.get("min_p"),
              "ignore_eos": body.get("ignore_eos"),
              "repetition_penalty": body.get("repetition_penalty"),
              "prompt_logprobs": body.get("prompt_logprobs"),
              "speculative": body.get("speculative"), "priority": body.get("priority")}
    optional_number = lambda v: v is None or is_number(v)  # noqa: E731
    for name, ok in (("n", lambda v: v is None or is_int(v)), ("max_tokens", is_int), ("temperature", is_number), ("top_p", is_number),
                     ("frequency_penalty", optional_number),
                     ("presence_penalty", optional_number),
                     ("repetition_penalty", optional_number),
                     ("logit_bias", lambda v: v is None or isinstance(v, dict)),
                     ("response_format", lambda v: v is None or isinstance(v, dict)),
                     ("top_k", lambda v: v is None or is_int(v)),
                     ("prompt_logprobs", lambda v: v is None or is_int(v)),
                     ("min_p", lambda v: v is None or is_number(v)),
                     ("ignore_eos", lambda v: v is None or isinstance(v, bool)),
                     ("speculative", lambda v: v is None or isinstance(v, bool)),
                     ("priority", lambda v: v is None or is_int(v)),
                     ("seed", lambda v: v is None or is_int(v)),
                     ("stop", lambda v: v is None or (isinstance(v, list)
                                                      and all(isinstance(s, str) for s in v)))):
        if not ok(params[name]):
            raise bad(name, f"{name} has the wrong type: {params[name]!r}")
    return {k: v for k, v in params.items() if v is not None}


def completion_call(body: dict) -> Call:
    _check_defaults(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                        and all(is_int(t) for t in prompt))):
        raise bad("prompt", "prompt must be a string or a list of token ids (one prompt "
                  "per request: batches are not supported)")
    params = {**_sampling(body, 16), "raw": True}
    k = body.get("logprobs")
    if k is not None:  # completions: the number of alternatives, up to 5
        if not is_int(k) or not 0 <= k <= 5:
            raise bad("logprobs", f"logprobs must be an integer in [0, 5], got {k!r}")
        params["logprobs"] = k
    return Call(prompt, params, *_stream(body), chat=False, continuous_usage=_continuous(body))


def chat_call(body: dict) -> Call:
    _check_defaults(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list")
    try:
        tools = check_tools(body.get("tools"), body.get("tool_choice"),
                            body.get("parallel_tool_calls", True))
    except InvalidRequestError as e:
        raise bad(e.field, str(e).partition(": ")[2]) from None
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", f"chat_template_kwargs must be an object, got {kwargs!r}")
    effort = body.get("reasoning_effort")
    if effort is not None:  # gpt-oss's template writes it into its system message
        if effort not in ("low", "medium", "high"):
            raise bad("reasoning_effort", f"reasoning_effort must be low, medium or high, got {effort!r}")
        kwargs = {"reasoning_effort": effort, **(kwargs or {})}
    reasoning = body.get("include_reasoning", True)
    if not isinstance(reasoning, bool):
        raise bad("include_reasoning", f"include_reasoning must be true or false, got {reasoning!r}")
    chat = Chat([_message(m, i) for i, m in enumerate(messages)], tools, kwargs or None)
    params = _sampling(body, CHAT_DEFAULT_MAX_TOKENS)
    wanted, k = body.get("logprobs"), body.get("top_logprobs")
    if wanted not in (None, True, False):
        raise bad("logprobs", f"logprobs must be true or false, got {wanted!r}")
    if k is not None and (not is_int(k) or not 0 <= k <= 20 or not wanted):
        raise bad("top_logprobs", "top_logprobs must be an integer in [0, 20], with "
                  "logprobs set to true")
    if wanted:
        params["logprobs"] = k or 0
    return Call(chat, params, *_stream(body), chat=True, continuous_usage=_continuous(body),
                reasoning=reasoning)


def _message(m, i: int) -> dict:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(param, "each message must be an object with role and content")
    role = {"developer": "system"}.get(m.get("role"), m.get("role"))
    if role not in ("system", "user", "assistant", "tool"):
        raise bad(f"{param}.role", f"role {m.get('role')!r} {_LATER}; use system, user, "
                  "assistant or tool")
    # An assistant turn's tool calls, a tool turn's call id: the worker checks them.
    extra = {k: m[k] for k in ("tool_calls", "tool_call_id") if m.get(k) is not None}
    content = m.get("content")
    if content is None and extra.get("tool_calls"):
        content = ""
    if isinstance(content, list):  # content parts: images go to the worker as bytes
        try:
            content = content_parts.as_sent(*content_parts.parse(content, f"{param}.content"))
        except InvalidRequestError as e:
            raise bad(e.field, e.message) from None
    if not isinstance(content, (str, list)):
        raise bad(f"{param}.content", "content must be a string or a list of content parts "
                  "(text, image_url)")
    return {"role": role, "content": content, **extra}


def _stream(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", "stream must be true or false")
    options = body.get("stream_options") or {}
    return stream, bool(stream and options.get("include_usage"))


def _continuous(body: dict) -> bool:
    return bool(body.get("stream") and (body.get("stream_options") or {}).get(
        "continuous_usage_stats"))




# --- replies -------------------------------------------------------------------------------

def finish(reason: Optional[str]) -> Optional[str]:
    """OpenAI knows stop, length and tool_calls; a cancelled request ended as a stop."""
    return None if reason is None else reason if reason in ("length", "tool_calls") else "stop"


def usage(*samples: Optional[dict]) -> dict:
    """OpenAI's usage of a request from its samples' own: the prompt once, every
    sample's completion tokens."""
    samples = [u or {} for u in samples] or [{}]
    p = max(u.get("prompt_tokens", 0) for u in samples)
    c = sum(u.get("completion_tokens", 0) for u in samples)
    cached = max(u.get("cached_tokens", 0) for u in samples)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


# The field an error names: a name, or a path into the request (tools[2].function.parameters).
FIELD_PATH = re.compile(r"[A-Za-z_]\w*(\[\d+\])?(\.\w+(\[\d+\])?)*")


def worker_error(error: dict) -> APIError:
    """A worker's error chunk as an OpenAI error: the field it names is the param."""
    code, message = error.get("code"), error.get("message", "")
    if code in ("bad_request", "too_long"):
        field, _, _ = message.partition(":")
        return APIError(400, message, field if FIELD_PATH.fullmatch(field) else None,
                        code="context_length_exceeded" if code == "too_long" else None)
    return APIError(500, f"the worker failed the request ({code}): {message}", kind="server_error")


def envelope(call: Call, rid: str, model: str, created: int) -> dict:
    kind = ("chat.completion" if call.chat else "text_completion")
    return {"id": f"{'chatcmpl' if call.chat else 'cmpl'}-{rid}", "object": kind,
            "created": created, "model": model}


def logprobs(call: Call, entries: Optional[list[dict]], offset: int = 0) -> Optional[dict]:
    """Protocol-v1 logprob entries in OpenAI's shape: chat's ``content`` list, or the
    completions API's parallel lists (``text_offset`` counted from ``offset``)."""
    if not call.logprobs:
        return None
    entries = entries or []
    if call.chat:
        return {"content": [{"token": e.get("token", ""), "logprob": e["logprob"],
                             "bytes": list(e.get("token", "").encode()),
                             "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                                              for t, (_, lp) in _top(e)]}
                            for e in entries]}
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.get("token", ""))
    return {"tokens": [e.get("token", "") for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t: lp for t, (_, lp) in _top(e)} for e in entries],
            "text_offset": offsets}


def prompt_logprobs(entries: list[Optional[dict]]) -> list[Optional[dict]]:
    """Protocol-v1 prompt entries in vLLM's shape: per prompt token None (the first)
    or {token id: {"logprob", "decoded_token"}} for the token and its alternatives."""
    def one(e):
        texts = [e.get("token"), *(e.get("top_tokens") or [None] * len(e["top_logprobs"]))]
        pairs = [(e["token_id"], e["logprob"]), *e["top_logprobs"]]
        return {str(t): {"logprob": lp, "decoded_token": text}
                for (t, lp), text in zip(pairs, texts)}
    return [None if e is None else one(e) for e in entries]


def _top(entry: dict):
    """(text, (id, logprob)) of an entry's alternatives; ids stand in without a tokenizer."""
    texts = entry.get("top_tokens") or [str(t) for t, _ in entry["top_logprobs"]]
    return zip(texts, entry["top_logprobs"])


@dataclass
class Sample:
    """One sample's reply, gathered from its chunks."""
    text: str = ""
    tokens: int = 0
    entries: list = field(default_factory=list)   # logprob entries
    reason: Optional[str] = None
    usage: Optional[dict] = None
    prompt_entries: Optional[list] = None
    tool_calls: list = field(default_factory=list)
    reasoning: str = ""

    def add(self, chunk) -> None:
        self.tool_calls += chunk.tool_calls or []
        self.text += chunk.text
        self.reasoning += chunk.reasoning or ""
        self.tokens += len(chunk.token_ids)
        self.entries += chunk.logprobs or []
        self.reason, self.usage = chunk.finish_reason, chunk.usage or self.usage
        self.prompt_entries = self.prompt_entries or chunk.prompt_logprobs


def whole(call: Call, rid: str, model: str, samples: list[Sample]) -> dict:
    choices = []
    for i, s in enumerate(samples):
        choice = {"index": i, "logprobs": logprobs(call, s.entries), "finish_reason": finish(s.reason)}
        if s.prompt_entries is not None:
            choice["prompt_logprobs"] = prompt_logprobs(s.prompt_entries)
        if call.chat:
            choice["message"] = {"role": "assistant", "content": s.text,
                                 **thinking(call, s.reasoning)}
            if s.tool_calls:  # OpenAI: content null when the turn is only calls
                choice["message"].update(content=s.text or None, tool_calls=[
                    {k: v for k, v in c.items() if k != "index"} for c in s.tool_calls])
        else:
            choice["text"] = s.text
        choices.append(choice)
    return {**envelope(call, rid, model, int(time.time())), "choices": choices,
            "usage": usage(*(s.usage for s in samples))}


def thinking(call: Call, reasoning: Optional[str]) -> dict:
    """A message's or delta's reasoning fields: ``reasoning_content`` as vLLM and DeepSeek
    name it, and ``reasoning``, vLLM's newer name; none where there is none or the
    request set include_reasoning false."""
    return {"reasoning_content": reasoning, "reasoning": reasoning} \
        if reasoning and call.reasoning else {}


def piece(call: Call, head: dict, text: Optional[str], reason: Optional[str],
          first: bool = False, entries: Optional[list[dict]] = None, offset: int = 0,
          prompt_entries: Optional[list] = None, index: int = 0,
          reasoning: Optional[str] = None) -> dict:
    """One streamed chunk of sample ``index``; text None means no content in it."""
    choice = {"index": index, "logprobs": logprobs(call, entries, offset),
              "finish_reason": finish(reason)}
    if prompt_entries is not None:
        choice["prompt_logprobs"] = prompt_logprobs(prompt_entries)
    if call.chat:
        delta = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        delta.update(thinking(call, reasoning))
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    obj = {**head, "choices": [choice]}
    if call.chat:
        obj["object"] = "chat.completion.chunk"
    return obj


def call_pieces(call: Call, head: dict, chunk, opening: bool, offset: int,
                index: int = 0) -> list[dict]:
    """A final chunk with tool calls as OpenAI streams them: its text, then for each call
    its id and name, then its arguments, then the finish."""
    out = []
    if chunk.text or opening or chunk.logprobs or chunk.reasoning:
        out.append(piece(call, head, chunk.text, None, opening, chunk.logprobs, offset,
                         chunk.prompt_logprobs, index, chunk.reasoning))
    for c in chunk.tool_calls:
        fn = c["function"]
        for delta in ({"index": c["index"], "id": c["id"], "type": "function",
                       "function": {"name": fn["name"], "arguments": ""}},
                      {"index": c["index"], "function": {"arguments": fn["arguments"]}}):
            obj = piece(call, head, None, None, index=index)
            obj["choices"][0]["delta"]["tool_calls"] = [delta]
            out.append(obj)
    out.append(piece(call, head, None, chunk.finish_reason, index=index))
    return out
