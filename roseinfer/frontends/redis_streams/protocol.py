"""Redis Streams protocol v1 (DESIGN.md section 4): key names, entry codecs (request_entry.py
decodes and checks a request entry).

Pure functions only, no I/O: the worker and both clients share them, and other
languages implement the same rules (docs/protocol.md).
"""
from __future__ import annotations

import argparse
import re
import struct
import uuid
from dataclasses import dataclass, field
from typing import Optional, Union

import msgpack

from roseinfer.core.pooling_task import PoolingTask
from roseinfer.core.sampling import SamplingParams
from roseinfer.core.tools import Tools

VERSION = "1"
DEFAULT_PREFIX = "roseinfer"
DEFAULT_URL = "redis://127.0.0.1:6379"
DEFAULT_GROUP = "workers"
RID_PATTERN = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
SAMPLING_KEYS = ("n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                 "stop", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs",
                 "repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias",
                 "response_format", "logits_processors", "speculative", "priority")
PARAM_KEYS = SAMPLING_KEYS + ("stream_interval", "raw", "lora")
ROLES = ("system", "user", "assistant", "tool")
TOOL_KEYS = ("tools", "tool_choice", "parallel_tool_calls")


@dataclass
class Chat:
    """A conversation: the worker renders it, and the tools it offers, with its model's
    chat template."""
    messages: list[dict]
    tools: Optional[Tools] = None
    template_kwargs: Optional[dict] = None  # chat_template_kwargs: the template's own options
    # the images of its content parts (core/content_parts.py): (encoded bytes, the field
    # that carried it), in order; each message holds {"type": "image"} where one goes
    images: list = field(default_factory=list)


# text, token ids of the worker's model, messages, or a pooling task (embed, score, classify)
Prompt = Union[str, list[int], Chat, PoolingTask]


@dataclass(frozen=True)
class Keys:
    """Every Redis key of one deployment, all under one prefix."""
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self):
        if hash_tag(self._in_stream_slot("x")) != hash_tag(self.requests):
            raise ValueError(f"prefix {self.prefix!r}: its braces would put the backlog and "
                             "routing keys in another Redis Cluster slot than the request "
                             "stream; use a prefix without braces, or with one {tag} pair")

    @property
    def requests(self) -> str:
        return f"{self.prefix}:requests"

    @property
    def cancel(self) -> str:
        return f"{self.prefix}:cancel"

    @property
    def adapters(self) -> str:
        """Every worker's LoRA adapters to load and unload (adapters.py)."""
        return f"{self.prefix}:adapters"

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

    # Routing's keys (routing.py) and the backlog share the request stream's Redis Cluster
    # slot, since one script touches the stream and one of them: the stream's name is
    # their hash tag. They start with the prefix like every other key, so that an ACL
    # user limited to ``P:*`` can run a tenant's workers (docs/operations.md, "Tenants").
    def _in_stream_slot(self, name: str) -> str:
        return f"{self.prefix}:{{{self.requests}}}:{name}"

    def inbox(self, consumer: str) -> str:
        """Entries handed to a worker by another: read in the same XREADGROUP as requests."""
        return self._in_stream_slot(f"inbox:{consumer}")

    def cached(self, consumer: str) -> str:
        """A worker's cached prompt blocks: a set of block hashes."""
        return self._in_stream_slot(f"cached:{consumer}")

    def roots(self, consumer: str) -> str:
        """The first-block hashes of a worker's newest cached prompts: a list, newest first."""
        return self._in_stream_slot(f"roots:{consumer}")

    def load(self, consumer: str) -> str:
        """A worker's load (msgpack), rewritten as it changes, expiring with its heartbeat."""
        return self._in_stream_slot(f"load:{consumer}")

    @property
    def backlog(self) -> str:
        """Requests with a priority above 0: moved into the request stream as workers have
        room (lanes.py). In the request stream's slot: the move is one script."""
        return self._in_stream_slot("backlog")

    def lane(self, params: dict) -> str:
        """Where a request with these keys is added: background work (priority > 0) to the
        backlog, the rest to the request stream."""
        return self.backlog if is_background(params) else self.requests

    @property
    def fleet(self) -> str:
        """The set of workers that route: whose cached and load keys to look at."""
        return self._in_stream_slot("fleet")


def prefix_arg(text: str) -> str:
    """``--prefix``, as an argparse type: one whose keys cannot share the request stream's
    cluster slot is refused with the flag named."""
    try:
        Keys(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def is_background(params: dict) -> bool:
    priority = params.get("priority") or 0
    return isinstance(priority, int) and priority > 0


def rid_for(rid: Optional[str], params: dict) -> Optional[str]:
    """The rid a client sends: a background request gets one of its own when none is given.
    Without one its rid would be its backlog entry ID, and the request stream can give
    another request the same ID in the same millisecond: the two would share one reply
    stream (docs/protocol.md, "Priorities")."""
    return rid or (uuid.uuid4().hex if is_background(params) else None)


def hash_tag(key: str) -> str:
    """What Redis Cluster hashes to place a key: the text inside its first {...} when that
    is not empty, else the whole key."""
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    return key[start + 1:end] if end > start + 1 else key


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
    lora: Optional[str] = None  # the LoRA adapter it runs with, None: the base model
    # A chat request whose output a reasoning parser splits (core/reasoning.py): whether
    # the output begins inside the reasoning (its template opened it); None: no split.
    reasoning_inside: Optional[bool] = None
    # task embed, score or classify (core/pooling.py): its inputs, and no prompt
    pooling: Optional[PoolingTask] = None


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
    # Chat requests on a worker with a reasoning parser: the model's thinking since the
    # previous chunk, apart from ``text`` (its answer). Absent when empty.
    reasoning: Optional[str] = None
    # Pooling requests (task embed, score or classify), final chunk only: "embeddings"
    # and "dimensions", or "scores", or "probs" (pooled_fields).
    pooled: Optional[dict] = None

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
    if isinstance(prompt, PoolingTask):
        body = pooling_body(prompt)
    elif isinstance(prompt, Chat):
        body = {"messages": prompt.messages, **(prompt.tools.as_body() if prompt.tools else {})}
        if prompt.template_kwargs:
            body["chat_template_kwargs"] = prompt.template_kwargs
    else:
        body = {"prompt" if isinstance(prompt, str) else "prompt_token_ids": prompt}
    body.update((k, v) for k, v in params.items() if v is not None)
    if "logit_bias" in body:
        body["logit_bias"] = {str(t): b for t, b in body["logit_bias"].items()}
    fields = {"v": VERSION, "body": msgpack.packb(body)}
    if rid is not None:
        fields["rid"] = rid
    return fields


def pooling_body(task: PoolingTask) -> dict:
    """A pooling request's body: ``task`` and its inputs, the options only where set."""
    body = {"task": task.task}
    if task.task == "score":
        body.update(query=task.query, documents=task.inputs)
    else:
        body["input"] = task.inputs
    for key in ("dimensions", "truncate", "prompt_name"):
        if getattr(task, key) is not None:
            body[key] = getattr(task, key)
    if task.encoding_format != "binary":
        body["encoding_format"] = task.encoding_format
    return body


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
    if chunk.reasoning:
        body["reasoning"] = chunk.reasoning
    if chunk.pooled:
        body.update(chunk.pooled)
    return msgpack.packb(body)


POOLED_KEYS = ("embeddings", "dimensions", "scores", "probs", "labels")


def embedding_rows(pooled: dict) -> list[list[float]]:
    """A final chunk's embeddings as lists of floats, from either encoding."""
    rows, dim = pooled["embeddings"], pooled["dimensions"]
    if isinstance(rows, bytes):  # float32, little-endian, row after row
        flat = struct.unpack(f"<{len(rows) // 4}f", rows)
        return [list(flat[i:i + dim]) for i in range(0, len(flat), dim)]
    return rows


def pooled_fields(task: PoolingTask, result, labels: Optional[list[str]] = None) -> dict:
    """A pooling result as its final chunk carries it: embeddings as little-endian
    float32 bytes, row after row (``dimensions`` a row), or lists of floats (encoding
    ``float``); scores; class probabilities and the classes' names."""
    if task.task == "score":
        return {"scores": list(result)}
    if task.task == "classify":
        return {"probs": list(result), "labels": labels}
    rows = result.float().numpy()
    if task.encoding_format == "float":
        return {"embeddings": rows.tolist(), "dimensions": rows.shape[1]}
    return {"embeddings": rows.astype("<f4").tobytes(), "dimensions": rows.shape[1]}


def decode_chunk(fields: dict) -> Chunk:
    body = msgpack.unpackb(fields[b"body"], raw=False)
    pooled = {k: body[k] for k in POOLED_KEYS if k in body}
    return Chunk(body["rid"], body["seq"], body["token_ids"], body["text"],
                 body["finish_reason"], body.get("usage"), body.get("error"),
                 body.get("logprobs"), body.get("prompt_logprobs"), body.get("index"),
                 body.get("tool_calls"), body.get("reasoning"), pooled or None)


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


def entry_time(entry_id: str) -> float:
    """When Redis added an entry, in seconds since the epoch: the first part of its ID."""
    return int(entry_id.split("-", 1)[0]) / 1000
