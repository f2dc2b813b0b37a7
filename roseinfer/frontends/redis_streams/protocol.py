"""Redis Streams protocol v1 (DESIGN.md section 4): key names, entry codecs, request validation.

Pure functions only, no I/O: the worker and both clients share them, and other
languages implement the same rules (docs/protocol.md).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional, Union

import msgpack

from roseinfer.core.errors import InvalidRequestError, short as _short
from roseinfer.core.sampling import MAX_N, SamplingParams, is_int
from roseinfer.core.tools import Tools, check_tools

VERSION = "1"
DEFAULT_PREFIX = "roseinfer"
DEFAULT_URL = "redis://127.0.0.1:6379"
DEFAULT_GROUP = "workers"
RID_PATTERN = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
SAMPLING_KEYS = ("n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                 "stop", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs",
                 "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias",
                 "response_format", "logits_processors", "speculative", "priority")
PARAM_KEYS = SAMPLING_KEYS + ("stream_interval", "raw")
ROLES = ("system", "user", "assistant", "tool")
TOOL_KEYS = ("tools", "tool_choice", "parallel_tool_calls")


@dataclass
class Chat:
    """A conversation: the worker renders it, and the tools it offers, with its model's
    chat template."""
    messages: list[dict]
    tools: Optional[Tools] = None


Prompt = Union[str, list[int], Chat]  # text, token ids of the worker's model, or messages


@dataclass(frozen=True)
class Keys:
    """Every Redis key of one deployment, all under one prefix."""
    prefix: str = DEFAULT_PREFIX

    @property
    def requests(self) -> str:
        return f"{self.prefix}:requests"

    @property
    def cancel(self) -> str:
        return f"{self.prefix}:cancel"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"

    def worker(self, consumer: str) -> str:
        """A worker's heartbeat key."""
        return f"{self.prefix}:workers:{consumer}"

    @property
    def workers_pattern(self) -> str:
        return f"{self.prefix}:workers:*"

    def bell(self, client_id: str) -> str:
        """A client's own stream: a write there wakes its blocked read of reply streams."""
        return f"{self.prefix}:bell:{client_id}"

    def out(self, rid: str) -> str:
        # Literal braces: the rid is the Redis Cluster hash tag of its reply stream.
        return f"{self.prefix}:out:{{{rid}}}"

    # Routing's keys (routing.py) share the request stream's Redis Cluster slot: the
    # script that hands an entry to another worker touches the stream and an inbox.
    def inbox(self, consumer: str) -> str:
        """Entries handed to a worker by another: read in the same XREADGROUP as requests."""
        return f"{{{self.requests}}}:inbox:{consumer}"

    def cached(self, consumer: str) -> str:
        """A worker's cached prompt blocks: a set of block hashes."""
        return f"{{{self.requests}}}:cached:{consumer}"

    def roots(self, consumer: str) -> str:
        """The first-block hashes of a worker's newest cached prompts: a list, newest first."""
        return f"{{{self.requests}}}:roots:{consumer}"

    def load(self, consumer: str) -> str:
        """A worker's load (msgpack), rewritten as it changes, expiring with its heartbeat."""
        return f"{{{self.requests}}}:load:{consumer}"

    @property
    def backlog(self) -> str:
        """Requests with a priority above 0: moved into the request stream as workers have
        room (lanes.py). In the request stream's slot: the move is one script."""
        return f"{{{self.requests}}}:backlog"

    def lane(self, params: dict) -> str:
        """Where a request with these keys is added: background work (priority > 0) to the
        backlog, the rest to the request stream."""
        priority = params.get("priority") or 0
        return self.backlog if isinstance(priority, int) and priority > 0 else self.requests

    @property
    def fleet(self) -> str:
        """The set of workers that route: whose cached and load keys to look at."""
        return f"{{{self.requests}}}:fleet"


@dataclass(frozen=True)
class Limits:
    """What a worker refuses before any work that grows with the entry (docs/protocol.md,
    "Limits"). The prompt limits come from the model: a prompt that cannot fit its
    context even at the most characters a token can hold is refused untokenized."""
    max_entry_bytes: int = 4 << 20          # body, or every shell-form field together
    max_prompt_tokens: Optional[int] = None  # the model's context
    max_prompt_chars: Optional[int] = None   # the context times the longest token's text
    max_stop: int = 16                       # stop strings, and their characters together:
    max_stop_chars: int = 4096
    max_stop_token_ids: int = 1024


@dataclass
class Request:
    rid: str
    prompt: Prompt
    params: SamplingParams
    stream_interval: int = 1
    raw: bool = False        # a text prompt skips the worker's chat template
    tools: Optional[Tools] = None


@dataclass
class Chunk:
    """One reply entry: the tokens and text a request produced since its previous chunk."""
    rid: str
    seq: int
    token_ids: list[int]
    text: str
    finish_reason: Optional[str] = None
    usage: Optional[dict] = None   # final chunk only: prompt_tokens, completion_tokens
    error: Optional[dict] = None   # "error" chunk only: code, message
    # Requests that asked: one map per id in token_ids, {"logprob": float,
    # "top_logprobs": [[id, logprob], ...]} (most likely first), plus "token" and
    # "top_tokens" (each id's text alone) when the worker's model has a tokenizer.
    logprobs: Optional[list[dict]] = None
    # Requests that asked, first chunk only: one entry per prompt token, nil for
    # the first, then a map as in ``logprobs``.
    prompt_logprobs: Optional[list[Optional[dict]]] = None
    # Requests with n > 1: the sample (0..n-1) the chunk belongs to; each ends with
    # its own final chunk.
    index: Optional[int] = None
    # Requests with tools, final chunk only: the calls the output made, each
    # {"index", "id", "type": "function", "function": {"name", "arguments"}} (arguments:
    # JSON text); finish_reason is then "tool_calls". Their text is not in ``text``.
    tool_calls: Optional[list[dict]] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# --- requests ---------------------------------------------------------------------------

def encode_request(prompt: Prompt, rid: Optional[str] = None, **params) -> dict:
    """The fields of a request entry. Unknown parameter names are refused here, since a
    worker would silently ignore them."""
    unknown = sorted(set(params) - set(PARAM_KEYS))
    if unknown:
        raise TypeError(f"unknown request parameter(s) {unknown}; known: {list(PARAM_KEYS)}")
    if rid is not None and not RID_PATTERN.fullmatch(rid):
        raise ValueError(f"rid {rid!r} must be 1-128 characters of [A-Za-z0-9_.:-]")
    if isinstance(prompt, Chat):
        body = {"messages": prompt.messages, **(prompt.tools.as_body() if prompt.tools else {})}
    else:
        body = {"prompt" if isinstance(prompt, str) else "prompt_token_ids": prompt}
    body.update((k, v) for k, v in params.items() if v is not None)
    if "logit_bias" in body:
        body["logit_bias"] = {str(t): b for t, b in body["logit_bias"].items()}
    fields = {"v": VERSION, "body": msgpack.packb(body)}
    if rid is not None:
        fields["rid"] = rid
    return fields


def reply_rid(entry_id: str, fields: dict) -> str:
    """Where the replies of an entry go: its rid when readable, else the entry ID."""
    try:
        rid = _str_field(fields, "rid")
    except InvalidRequestError:
        return entry_id
    return rid if rid is not None and RID_PATTERN.fullmatch(rid) else entry_id


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
    sampling = {k: body[k] for k in SAMPLING_KEYS if k in body}
    tools = _tools(body, prompt)
    if tools is not None and tools.forced:
        if sampling.get("response_format") not in (None, {"type": "text"}):
            raise InvalidRequestError("response_format", "cannot go with tool_choice required "
                                      "or a named function: the tools' schemas constrain the "
                                      "output")
        sampling["response_format"] = tools.constraint()
    return Request(rid, prompt, SamplingParams(**sampling), stream_interval, raw, tools)


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
                                  f"({', '.join(ROLES)}) and content (a string)")
    chat = Chat([_message(m, f"messages[{i}]") for i, m in enumerate(messages)])
    _check_chars("messages", sum(len(m["content"]) + len(str(m.get("tool_calls", "")))
                                 for m in chat.messages), limits)
    return chat


def _message(m, field: str) -> dict:
    """One turn: role and content; an assistant turn may carry the tool calls it made
    (content may then be empty), a tool turn the id of the call it answers."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise InvalidRequestError(field, f"must be a map with role ({', '.join(ROLES)}) and "
                                  "content (a string)")
    calls = m.get("tool_calls")
    content = m.get("content")
    if content is None and calls and m["role"] == "assistant":
        content = ""
    if not isinstance(content, str):
        raise InvalidRequestError(f"{field}.content", f"must be a string, got {_short(content)}")
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
    return out


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


def _bias(s: str) -> dict[int, float]:
    pairs = (p.split(":") for p in s.replace(",", " ").split())
    return {int(token): float(b) for token, b in pairs}


_SHELL_PARSERS = {
    "prompt": str, "prompt_token_ids": _ids, "n": int, "max_tokens": int, "temperature": float,
    "top_p": float, "top_k": int, "min_p": float, "seed": int, "stop": lambda s: [s],
    "stop_token_ids": _ids, "ignore_eos": _bool, "stream_interval": int, "raw": _bool,
    "speculative": _bool, "priority": int,
    "logprobs": int, "prompt_logprobs": int, "repetition_penalty": float, "frequency_penalty": float,
    "presence_penalty": float, "logit_bias": _bias, "response_format": _json_map,
    "logits_processors": _json_map,
}
_SHELL_KINDS = {int: "an integer", float: "a number", _ids: "integers separated by commas",
                _bool: "true or false", _bias: "id:bias pairs separated by commas",
                _json_map: "a JSON object"}


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


# --- replies ----------------------------------------------------------------------------

def encode_chunk(chunk: Chunk) -> dict:
    return {"v": VERSION, "body": chunk_body(chunk)}


def chunk_body(chunk: Chunk) -> bytes:
    """The msgpack ``body`` field of a reply entry."""
    body = {"rid": chunk.rid, "seq": chunk.seq, "token_ids": chunk.token_ids,
            "text": chunk.text, "finish_reason": chunk.finish_reason}
    if chunk.usage is not None:
        body["usage"] = chunk.usage
    if chunk.logprobs is not None:
        body["logprobs"] = chunk.logprobs
    if chunk.prompt_logprobs is not None:
        body["prompt_logprobs"] = chunk.prompt_logprobs
    if chunk.error is not None:
        body["error"] = chunk.error
    if chunk.index is not None:
        body["index"] = chunk.index
    if chunk.tool_calls is not None:
        body["tool_calls"] = chunk.tool_calls
    return msgpack.packb(body)


def decode_chunk(fields: dict) -> Chunk:
    body = msgpack.unpackb(fields[b"body"], raw=False)
    return Chunk(body["rid"], body["seq"], body["token_ids"], body["text"],
                 body["finish_reason"], body.get("usage"), body.get("error"),
                 body.get("logprobs"), body.get("prompt_logprobs"), body.get("index"),
                 body.get("tool_calls"))


def error_chunk(rid: str, code: str, message: str, seq: int = 0,
                completion_tokens: int = 0) -> Chunk:
    """The final chunk of a failed request: the only one of a refused request, or the one
    after ``completion_tokens`` tokens already sent in chunks 0..seq-1."""
    return Chunk(rid, seq, [], "", "error",
                 {"prompt_tokens": 0, "completion_tokens": completion_tokens},
                 {"code": code, "message": message})


class ChunkOrder:
    """The rule every reader of a reply stream follows: chunks in seq order, a chunk whose
    seq was already seen (at-least-once delivery) and anything after the end dropped. The
    stream ends with the final chunk of each of its request's ``n`` samples, or with an
    error chunk."""

    def __init__(self, n: int = 1):
        self.next_seq, self.left, self.done = 0, n, False

    def accept(self, chunk: Chunk) -> bool:
        if self.done or chunk.seq < self.next_seq:
            return False
        self.next_seq = chunk.seq + 1
        if chunk.finished:
            self.left -= 1
            self.done = self.left == 0 or chunk.finish_reason == "error"
        return True


def accepted_chunks(entries, n: int = 1) -> list[Chunk]:
    """The chunks a client keeps of a reply stream's entries, as XRANGE returns them."""
    order = ChunkOrder(n)
    return [c for c in (decode_chunk(fields) for _, fields in entries) if order.accept(c)]


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


def entry_time(entry_id: str) -> float:
    """When Redis added an entry, in seconds since the epoch: the first part of its ID."""
    return int(entry_id.split("-", 1)[0]) / 1000
