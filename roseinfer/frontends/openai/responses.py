"""``/v1/responses``: OpenAI's Responses API over the queue. A request becomes a chat request
(responses_input.py), its chunks become output items (reasoning, the message, function
calls) and, streamed, the spec's typed events with contiguous ``sequence_number``s.

With ``store`` (the default) a finished response and its conversation are kept in Redis
under the fleet's prefix for ``--responses-ttl`` seconds, so any gateway answers ``GET``
and ``DELETE`` for it and continues from it with ``previous_response_id``.

A ``background`` response is stored at once as ``queued`` and its request goes to the
fleet's backlog (priority BACKGROUND_PRIORITY); a task of the gateway reads its chunks and
stores it ``in_progress``, then finished, holding a lease on it while it does. A gateway
that reads one whose lease has lapsed (its gateway stopped) takes it over and reads its
reply stream from the start, so nothing is lost that the workers wrote. Cancel aborts the
request and stores it ``cancelled``.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Optional

import redis.asyncio as aioredis
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from roseinfer.frontends.openai import mapping, responses_input
from roseinfer.frontends.openai.mapping import APIError
from roseinfer.frontends.redis_streams.protocol import Keys

DEFAULT_TTL_S = 30 * 24 * 3600
BACKGROUND_PRIORITY = 5  # behind interactive requests (docs/protocol.md, "Priorities")
LEASE_S = 15             # a background response's reader renews its lease every third of it
RUNNING = ("queued", "in_progress")
ECHOED = ("instructions", "max_output_tokens", "temperature", "top_p", "previous_response_id",
          "metadata")


def new_id(kind: str) -> str:
    return f"{kind}_{secrets.token_hex(16)}"


class Output:
    """A response as its chunks arrive: the output items, and the stream events that
    build them (each with the next sequence number)."""

    def __init__(self, response: dict):
        self.response, self.items, self.seq = response, [], 0
        self.open: Optional[dict] = None  # the reasoning or message item being written

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.snapshot("in_progress")),
                self.event("response.in_progress", response=self.snapshot("in_progress"))]

    def add(self, chunk, include_reasoning: bool) -> list[dict]:
        out = []
        if chunk.reasoning and include_reasoning:
            out += self._write("reasoning", chunk.reasoning)
        if chunk.text:
            out += self._write("message", chunk.text)
        return out

    def finish(self, sample: mapping.Sample) -> list[dict]:
        out = self._close()
        if not self.items and not sample.tool_calls:  # an empty answer is still a message
            out += self._write("message", "") + self._close()
        for c in sample.tool_calls:
            item = {"type": "function_call", "id": new_id("fc"), "call_id": c["id"],
                    "name": c["function"]["name"], "arguments": "", "status": "in_progress"}
            at = len(self.items)
            self.items.append(item)
            args = c["function"]["arguments"]
            out += [self.event("response.output_item.added", output_index=at, item=dict(item)),
                    self.event("response.function_call_arguments.delta", item_id=item["id"],
                               output_index=at, delta=args)]
            item.update(arguments=args, status="completed")
            out += [self.event("response.function_call_arguments.done", item_id=item["id"],
                               output_index=at, name=item["name"], arguments=args),
                    self.event("response.output_item.done", output_index=at, item=dict(item))]
        incomplete = sample.reason == "length"
        self.response.update(usage=_usage(sample.usage), incomplete_details={
            "reason": "max_output_tokens"} if incomplete else None)
        status = "incomplete" if incomplete else "completed"
        return out + [self.event(f"response.{status}", response=self.snapshot(status))]

    def snapshot(self, status: str) -> dict:
        return {**self.response, "status": status, "output": [dict(i) for i in self.items]}

    def _write(self, kind: str, delta: str) -> list[dict]:
        out = []
        if self.open is not None and self.open["type"] != kind:
            out += self._close()
        if self.open is None:
            part = "reasoning_text" if kind == "reasoning" else "output_text"
            self.open = item = {"type": kind, "id": new_id("rs" if kind == "reasoning" else "msg"),
                                "status": "in_progress", "content": []}
            if kind == "reasoning":
                item["summary"] = []
            else:
                item["role"] = "assistant"
            self.items.append(item)
            out += [self.event("response.output_item.added", output_index=len(self.items) - 1,
                               item=_copy(item)),
                    self.event("response.content_part.added", item_id=item["id"],
                               output_index=len(self.items) - 1, content_index=0,
                               part=_part(part, ""))]
            item["content"].append(_part(part, ""))
        item, at = self.open, len(self.items) - 1
        item["content"][0]["text"] += delta
        kind_event = "reasoning_text" if kind == "reasoning" else "output_text"
        extra = {"logprobs": []} if kind == "message" else {}
        return out + [self.event(f"response.{kind_event}.delta", item_id=item["id"],
                                 output_index=at, content_index=0, delta=delta, **extra)]

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        at, part = len(self.items) - 1, item["content"][0]
        kind_event = "reasoning_text" if item["type"] == "reasoning" else "output_text"
        extra = {"logprobs": []} if item["type"] == "message" else {}
        item["status"] = "completed"
        return [self.event(f"response.{kind_event}.done", item_id=item["id"], output_index=at,
                           content_index=0, text=part["text"], **extra),
                self.event("response.content_part.done", item_id=item["id"], output_index=at,
                           content_index=0, part=dict(part)),
                self.event("response.output_item.done", output_index=at, item=_copy(item))]


def _part(kind: str, text: str) -> dict:
    return {"type": kind, "text": text, **({"annotations": [], "logprobs": []}
                                           if kind == "output_text" else {})}


def _copy(item: dict) -> dict:
    return {**item, "content": [dict(p) for p in item["content"]]}


def _usage(u: Optional[dict]) -> Optional[dict]:
    if u is None:
        return None
    prompt, completion = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    return {"input_tokens": prompt, "output_tokens": completion,
            "total_tokens": prompt + completion,
            "input_tokens_details": {"cached_tokens": u.get("cached_tokens", 0),
                                     "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def conversation_after(turns: list[dict], items: list[dict]) -> list[dict]:
    """The conversation a response leaves: its input turns, then its answer as an
    assistant turn (text and calls) for a next response to continue from."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [{"id": i["call_id"], "type": "function", "function": {
        "name": i["name"], "arguments": i["arguments"]}} for i in items if i["type"] == "function_call"]
    return turns + [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]


class Responses:
    """The routes, over a Gateway (its queue client, authorization and metrics)."""

    def __init__(self, gateway, ttl_s: int = DEFAULT_TTL_S):
        self.gw, self.ttl_s = gateway, ttl_s
        self.prefix = Keys(gateway.config.prefix).prefix
        self._redis: Optional[aioredis.Redis] = None

    def _key(self, rid: str) -> str:
        return f"{self.prefix}:response:{rid}"

    @property
    def redis(self) -> aioredis.Redis:
        if self._redis is None:
            self._redis = aioredis.Redis.from_url(self.gw.config.redis_url)
        return self._redis

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()

    async def _get_both(self, rid: str):
        """The record and the cancel mark, one key at a time (another slot in a Cluster)."""
        return await self.redis.get(self._key(rid)), \
            await self.redis.get(self._key(rid) + ":cancelled")

    async def _stored(self, rid: str, param: Optional[str] = None) -> dict:
        """The stored record; a running response that was cancelled reads as cancelled
        (its reader may store its progress once more before it sees the abort)."""
        raw, cancelled = await self._get_both(rid)
        if raw is None:
            raise APIError(404, f"Response with id {rid!r} not found: it was never stored "
                           "(store: false), was deleted, or is older than --responses-ttl",
                           param, code="response_not_found")
        record = json.loads(raw)
        if cancelled is not None and record["response"]["status"] in RUNNING:
            record["response"]["status"] = "cancelled"
        return record

    async def retrieve(self, request: Request) -> Response:
        self.gw._authorize(request)
        record = await self._stored(request.path_params["rid"])
        await self.adopt(record)
        return JSONResponse(record["response"])

    async def delete(self, request: Request) -> Response:
        self.gw._authorize(request)
        rid = request.path_params["rid"]
        if not await self.redis.delete(self._key(rid)):
            await self._stored(rid)  # raises its 404
        await self.redis.delete(self._key(rid) + ":cancelled")
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    async def cancel(self, request: Request) -> Response:
        self.gw._authorize(request)
        rid = request.path_params["rid"]
        record = await self._stored(rid)
        if not record["response"].get("background"):
            raise APIError(400, "only a background response can be cancelled", code="not_background")
        if record["response"]["status"] in RUNNING:
            await self.redis.set(self._key(rid) + ":cancelled", "1", ex=self.ttl_s)
            await self.gw.client.cancel(record["rid"])
            record["response"]["status"] = "cancelled"
            await self._save(record)
        return JSONResponse(record["response"])

    async def _save(self, record: dict) -> None:
        await self.redis.set(self._key(record["response"]["id"]), json.dumps(record),
                             ex=self.ttl_s)

    async def _background(self, record: dict) -> None:
        """Read a background response's reply stream (from its start) into its record,
        holding its lease meanwhile; the record says where it ended."""
        rid = record["response"]["id"]
        holding = asyncio.create_task(self._hold(rid))
        output, sample = Output(record["response"]), mapping.Sample()
        try:
            # no timeout: queued work may wait long in the backlog; while it does, the
            # response reads queued (a gateway that stops hands the wait on, by the lease)
            async for chunk in self.gw.client.stream(record["rid"]):
                if chunk.error:
                    raise mapping.worker_error(chunk.error)
                if not sample.tokens and not sample.text:
                    await self._save({**record, "response": output.snapshot("in_progress")})
                sample.add(chunk)
                output.add(chunk, record["reasoning"])
            *_, done = output.finish(sample)
            status = done["response"]["status"]
        except APIError as e:
            output.response["error"] = {"code": getattr(e, "code", None) or "server_error",
                                        "message": str(e)}
            status = "failed"
        except asyncio.CancelledError:  # this gateway stops: another takes it over at once
            await self.redis.delete(self._key(rid) + ":lease")
            raise
        finally:
            holding.cancel()
        latest, cancelled = await self._get_both(rid)
        if latest is None:
            return  # deleted meanwhile
        if sample.reason == "abort" or cancelled is not None:
            status = "cancelled"
        record.update(response=output.snapshot(status),
                      conversation=conversation_after(record["turns"], output.items))
        await self._save(record)
        await self.redis.delete(self._key(rid) + ":lease")

    async def _hold(self, rid: str) -> None:
        while True:
            await self.redis.set(self._key(rid) + ":lease", "1", ex=LEASE_S)
            await asyncio.sleep(LEASE_S / 3)

    def _read_later(self, record: dict) -> None:
        task = asyncio.create_task(self._background(record))
        self.gw.tasks.add(task)
        task.add_done_callback(self.gw.tasks.discard)

    async def adopt(self, record: dict) -> None:
        """Read a background response whose reader's lease lapsed (its gateway stopped),
        unless another gateway took it first."""
        lease = self._key(record["response"]["id"]) + ":lease"
        if record["response"]["status"] in RUNNING and await self.redis.set(
                lease, "1", ex=LEASE_S, nx=True):
            self._read_later(record)

    async def create(self, request: Request) -> Response:
        return await self.gw._serve(request, self._answer)

    async def _answer(self, request: Request, endpoint, start, ended) -> Response:
        body = await self.gw.body(request)
        pid = responses_input.previous_id(body)
        history = (await self._stored(pid, "previous_response_id"))["conversation"] if pid else []
        chat, turns = responses_input.chat_body(body, history)
        call = mapping.chat_call(chat)
        if call.n != 1:
            raise APIError(400, "a response has one output: n is not supported", "n")
        if body.get("background"):
            return await self._queue(request, body, call, turns)
        _, model, first, chunks = await self.gw.submit(request, body, call, endpoint, start)
        output = self._new(body, model)
        events = self._events(call, output, first, chunks, turns)
        if call.stream:
            return EventSourceResponse(self._sent(events, ended))
        async for _ in events:
            pass
        return JSONResponse(output.snapshot(output.response["status"]))

    async def _queue(self, request: Request, body: dict, call, turns) -> Response:
        """A background response: stored as queued, its request in the backlog, a task
        to read it; answered at once."""
        if body.get("store") is False or call.stream:
            raise APIError(400, "background responses are stored and read later: give "
                           "store true (the default) and no stream", "background")
        response = self._new(body, await self.gw.route_adapter(body, call))
        response.response.update(background=True, status="queued")
        rid = f"resp-{response.response['id']}"
        record = {"response": response.snapshot("queued"), "rid": rid, "turns": turns,
                  "reasoning": call.reasoning, "conversation": None}
        await self._save(record)
        await self.redis.set(self._key(response.response["id"]) + ":lease", "1", ex=LEASE_S)
        await self.gw.client.submit(call.prompt, rid=rid, **{
            **call.params, "priority": call.params.get("priority") or BACKGROUND_PRIORITY})
        self._read_later(record)
        return JSONResponse(record["response"])

    @staticmethod
    def _new(body: dict, model: str) -> Output:
        return Output({
            "id": new_id("resp"), "object": "response", "created_at": int(time.time()),
            "model": model, "error": None, "incomplete_details": None, "usage": None,
            **{k: body.get(k) for k in ECHOED}, "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "text": body.get("text") or {"format": {"type": "text"}},
            "store": body.get("store", True) is not False, "background": False,
            "truncation": "disabled", "reasoning": None})

    async def _events(self, call, output: Output, first, chunks, turns):
        """Every event of the response, the chunks read as they come; stored at the end."""
        sample = mapping.Sample()
        for event in output.start():
            yield event
        chunk = first
        try:
            while chunk is not None:
                sample.add(chunk)
                for event in output.add(chunk, call.reasoning):
                    yield event
                chunk = await anext(chunks, None)
        finally:
            await chunks.aclose()
        for event in output.finish(sample):
            yield event
        output.response["status"] = event["response"]["status"]
        if output.response["store"]:
            record = {"response": output.snapshot(output.response["status"]),
                      "conversation": conversation_after(turns, output.items)}
            await self.redis.set(self._key(output.response["id"]), json.dumps(record),
                                 ex=self.ttl_s)

    async def _sent(self, events, ended):
        status = 499  # unless it ends: the client went away
        try:
            async for event in events:
                yield {"event": event["type"], "data": json.dumps(event)}
            status = 200
        except APIError as e:  # the status line is sent: the error goes in the stream
            status = e.status
            yield {"event": "error", "data": json.dumps({"type": "error", **e.body()["error"]})}
        finally:
            await events.aclose()
            self.gw.metrics.in_flight.dec()
            ended(status)
