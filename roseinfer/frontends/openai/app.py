"""The gateway's HTTP app (starlette): each call becomes one queue request, and its
reply stream becomes the response, whole or as server-sent events (sse-starlette).

Stateless: any number of gateways and workers can share one Redis.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import redis
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from roseinfer.frontends.openai import mapping
from roseinfer.frontends.openai.mapping import APIError, Call
from roseinfer.frontends.openai.media import DEFAULT_TIMEOUT_S as DEFAULT_MEDIA_TIMEOUT_S, \
    MediaFetcher
from roseinfer.frontends.openai.metrics import GatewayMetrics
from roseinfer.frontends.openai.pooling import Pooling
from roseinfer.frontends.openai.responses import DEFAULT_TTL_S, Responses
from roseinfer.frontends.redis_streams import adapters
from roseinfer.frontends.redis_streams.client import AsyncClient
from roseinfer.frontends.redis_streams.heartbeat import read_heartbeats
from roseinfer.frontends.redis_streams.protocol import RID_PATTERN, ChunkOrder, Keys

log = logging.getLogger(__name__)
ADAPTERS_TTL_S = 1.0  # how stale a gateway's list of the workers' adapters may be


@dataclass
class GatewayConfig:
    redis_url: str
    prefix: str = "roseinfer"
    model_name: str = "roseinfer"
    api_keys: list[str] = field(default_factory=list)
    queue_timeout: float = 60.0    # no first reply by then: 503 (no worker took it)
    request_timeout: float = 600.0  # the whole request
    responses_ttl: int = DEFAULT_TTL_S  # how long a stored response is kept (seconds)
    # hosts images may be fetched from by http(s) URL (media.py); none: data URLs only
    allowed_media_domains: list[str] = field(default_factory=list)
    media_timeout: float = DEFAULT_MEDIA_TIMEOUT_S  # seconds one image's fetch may take


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.client: AsyncClient | None = None
        self.metrics = GatewayMetrics()
        self._keys = Keys(config.prefix)
        self._redis: redis.Redis | None = None  # for the adapters' waits, in threads
        self._served: tuple[float, set[str]] | None = None  # (when, adapters) _adapters
        self.responses = Responses(self, config.responses_ttl)
        self.pooling = Pooling(self)  # embeddings, rerank, score, classify
        self.tasks: set[asyncio.Task] = set()  # background responses being read
        self.media = MediaFetcher(config.allowed_media_domains, config.media_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.client = AsyncClient(self.config.redis_url, self.config.prefix)
        try:
            yield
        finally:
            for task in self.tasks:  # they give up their leases: another gateway reads them
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            await self.client.close()
            await self.responses.close()
            if self._redis is not None:
                self._redis.close()

    # --- routes ---------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> Response:
        """The model, then the LoRA adapters any live worker serves (vLLM lists them so,
        each with its base as ``parent``)."""
        self._authorize(request)
        name = self.config.model_name
        adapters = sorted(await self._adapters(fresh=True))
        tasks = sorted(await self._tasks())
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "roseinfer",
             "tasks": tasks},
            *({"id": a, "object": "model", "created": 0, "owned_by": "roseinfer",
               "parent": name} for a in adapters)]})

    async def load_lora_adapter(self, request: Request) -> Response:
        return await self._adapter(request, "load")

    async def unload_lora_adapter(self, request: Request) -> Response:
        return await self._adapter(request, "unload")

    async def _adapter(self, request: Request, op: str) -> Response:
        """vLLM's endpoints: ``{"lora_name", "lora_path"}``; every worker serving adapters
        loads (or unloads) it through P:adapters, and the answer waits for them."""
        self._authorize(request)
        try:
            body = await request.json()
        except ValueError:
            raise APIError(400, "the request body is not valid JSON") from None
        name, path = body.get("lora_name"), body.get("lora_path", "")
        if not isinstance(name, str) or not name or (op == "load" and not path):
            raise APIError(400, "give lora_name" + (" and lora_path" if op == "load" else ""))
        results = await asyncio.to_thread(adapters.request, self._sync_redis(), self._keys,
                                          op, name, str(path))
        if not results:
            raise APIError(503, "no live worker serves adapters: start workers with "
                           "--enable-lora", kind="server_error")
        self._served = None  # this gateway's next call sees the change
        failed = {w: r for w, r in results.items() if r != "ok"}
        if failed:
            raise APIError(400, f"{op} {name!r} failed on {len(failed)} of {len(results)} "
                           f"workers: {failed}")
        return Response(f"Success: LoRA adapter {name!r} {op}ed on {len(results)} workers.")

    async def _adapters(self, fresh: bool = False) -> set[str]:
        """The adapters live workers serve, from their heartbeats, looked up again after
        ADAPTERS_TTL_S (or when ``fresh``)."""
        now = time.monotonic()
        if fresh or self._served is None or now - self._served[0] > ADAPTERS_TTL_S:
            beats = await asyncio.to_thread(read_heartbeats, self._sync_redis(), self._keys)
            self._served = now, {a for beat in beats for a in beat.get("adapters", ())}
        return self._served[1]

    async def _tasks(self) -> set[str]:
        """What the live workers do: generate, or embed, score and classify (a worker whose
        model pools); generate where none says (workers from before the field)."""
        beats = await asyncio.to_thread(read_heartbeats, self._sync_redis(), self._keys)
        return {t for beat in beats for t in beat.get("tasks", ("generate",))} or {"generate"}

    def _sync_redis(self) -> redis.Redis:
        if self._redis is None:
            self._redis = redis.Redis.from_url(self.config.redis_url)
        return self._redis

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, functools.partial(self._answer,
                                                            make_call=mapping.completion_call))

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, functools.partial(self._answer,
                                                            make_call=mapping.chat_call))

    def counted(self, answer):
        """A route whose whole answer ``answer(request)`` is counted as ``_serve`` counts."""
        async def route(request: Request) -> Response:
            return await self._serve(request, lambda r, *_: answer(r))
        return route

    # --- one call -------------------------------------------------------------------------

    async def _serve(self, request: Request, answer) -> Response:
        """One call, counted: in flight until its last byte; by status when it ends.
        ``answer(request, endpoint, start, ended)`` makes the response; a streamed one
        decrements in_flight and calls ``ended`` itself when its last event is out."""
        endpoint, start = request.url.path, time.monotonic()

        def ended(status: int) -> None:
            self.metrics.ended(endpoint, status, time.monotonic() - start)

        self.metrics.in_flight.inc()
        try:
            response = await answer(request, endpoint, start, ended)
        except BaseException as e:
            self.metrics.in_flight.dec()
            ended(e.status if isinstance(e, APIError) else 500)
            raise
        if not isinstance(response, EventSourceResponse):
            self.metrics.in_flight.dec()
            ended(response.status_code)
        return response

    async def body(self, request: Request) -> dict:
        """The call's JSON object, from an authorized client."""
        self._authorize(request)
        try:
            body = await request.json()
        except ValueError:
            raise APIError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        return await self.media.fetched(body)

    async def route_adapter(self, body: dict, call: Call) -> str:
        """The model name replies carry: a LoRA adapter a live worker serves, named as the
        call's model (vLLM's convention), runs the call; else the base model."""
        model = body.get("model")
        if isinstance(model, str) and model != self.config.model_name and \
                model in await self._adapters():
            call.params["lora"] = model
        return call.params.get("lora") or self.config.model_name

    async def submit(self, request: Request, body: dict, call: Call, endpoint: str,
                     start: float):
        """The call into the queue: (rid, model name, its first chunk, the chunks after).
        The first chunk is awaited before any byte is sent, so errors keep their status."""
        model = await self.route_adapter(body, call)
        rid = request.headers.get("x-request-id") or f"oai-{uuid.uuid4().hex}"
        if not RID_PATTERN.fullmatch(rid):
            raise APIError(400, "X-Request-Id must be 1-128 characters of [A-Za-z0-9_.:-]")
        await self.client.submit(call.prompt, rid=rid, **call.params)
        chunks = self.chunks(rid, call.n)
        try:
            first = await anext(chunks)
        except BaseException:
            await chunks.aclose()
            raise
        self.metrics.ttft.labels(endpoint).observe(time.monotonic() - start)
        return rid, model, first, chunks

    async def _answer(self, request: Request, endpoint, start, ended, make_call) -> Response:
        body = await self.body(request)
        call = make_call(body)
        rid, model, first, chunks = await self.submit(request, body, call, endpoint, start)
        head = mapping.envelope(call, rid, model, int(time.time()))
        if call.stream:
            return EventSourceResponse(self._events(call, head, first, chunks, ended))
        return await self._whole(request, call, rid, first, chunks)

    async def chunks(self, rid: str, n: int) -> AsyncIterator:
        """The request's chunks (of its n samples); a worker error raises it as an OpenAI
        error. Ending early (a disconnect, a timeout) cancels the request, so its worker
        frees the slot."""
        cfg, order, seen = self.config, ChunkOrder(n), False
        try:
            async with asyncio.timeout(cfg.request_timeout):
                async for chunk in self.client.stream(rid, timeout=cfg.queue_timeout, n=n):
                    seen = True
                    order.accept(chunk)
                    if chunk.error:
                        raise mapping.worker_error(chunk.error)
                    yield chunk
        except TimeoutError:
            if seen:
                raise APIError(504, f"the reply stalled past --queue-timeout "
                               f"({cfg.queue_timeout:g} s per chunk) or --request-timeout "
                               f"({cfg.request_timeout:g} s in all)", kind="server_error") from None
            raise APIError(503, f"no worker answered within {cfg.queue_timeout:g} s "
                           f"(--queue-timeout): are workers running with prefix "
                           f"{cfg.prefix!r}?", kind="server_error") from None
        finally:
            if not order.done:
                await asyncio.shield(self.client.cancel(rid))

    async def _events(self, call: Call, head: dict, first, chunks, ended) -> AsyncIterator[dict]:
        status = 499  # unless it ends: the client went away
        try:
            chunk, samples, left = first, {}, call.n
            while chunk is not None:
                index = chunk.index or 0
                opening = index not in samples
                sample = samples.setdefault(index, mapping.Sample())
                sent = len(sample.text)
                sample.add(chunk)
                if chunk.tool_calls:
                    for obj in mapping.call_pieces(call, head, chunk, opening, sent, index):
                        yield {"data": json.dumps(obj)}
                elif chunk.text or opening or chunk.finished or call.continuous_usage \
                        or chunk.logprobs or (chunk.reasoning and call.reasoning):
                    obj = mapping.piece(call, head, chunk.text, chunk.finish_reason, opening,
                                        chunk.logprobs, sent, chunk.prompt_logprobs, index,
                                        chunk.reasoning)
                    if call.continuous_usage:  # prompt tokens are known at the end only
                        obj["usage"] = mapping.usage(chunk.usage or {
                            "completion_tokens": sample.tokens})
                    yield {"data": json.dumps(obj)}
                left -= chunk.finished
                if not left and call.include_usage:
                    yield {"data": json.dumps({**mapping.piece(call, head, None, None),
                                               "choices": [], "usage": mapping.usage(
                                                   *(s.usage for s in samples.values()))})}
                chunk = await anext(chunks, None)
            status = 200
        except APIError as e:  # the status line is sent: the error goes in the stream
            status = e.status
            yield {"data": json.dumps(e.body())}
        finally:
            await chunks.aclose()
            self.metrics.in_flight.dec()
            ended(status)
        yield {"data": "[DONE]"}

    async def _whole(self, request: Request, call: Call, rid: str, first, chunks) -> Response:
        async def collect():
            samples = [mapping.Sample() for _ in range(call.n)]
            samples[first.index or 0].add(first)
            async for chunk in chunks:
                samples[chunk.index or 0].add(chunk)
            return mapping.whole(call, rid, call.params.get("lora") or self.config.model_name,
                                 samples)

        task = asyncio.create_task(collect())
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()  # its generator's cleanup cancels the request
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return Response(status_code=499)
        return JSONResponse(task.result())

    def _authorize(self, request: Request) -> None:
        keys = self.config.api_keys
        if keys and request.headers.get("authorization", "") not in {f"Bearer {k}" for k in keys}:
            raise APIError(401, "Incorrect API key provided: send Authorization: Bearer KEY "
                           "with a key the gateway was started with (--api-key)",
                           code="invalid_api_key")


async def _api_error(request: Request, exc: APIError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _queue_error(request: Request, exc: Exception) -> Response:
    """Redis unreachable: a 503 in OpenAI's shape (clients retry those)."""
    log.warning("the queue is unreachable: %s", exc)
    return await _api_error(request, APIError(
        503, f"the request queue (Redis) is unreachable: {exc}", kind="server_error"))


def create_app(config: GatewayConfig) -> Starlette:
    gw = Gateway(config)
    routes = [Route("/health", gw.health), Route("/metrics", gw.prometheus),
              Route("/v1/models", gw.models),
              Route("/v1/load_lora_adapter", gw.load_lora_adapter, methods=["POST"]),
              Route("/v1/unload_lora_adapter", gw.unload_lora_adapter, methods=["POST"]),
              Route("/v1/completions", gw.completions, methods=["POST"]),
              Route("/v1/chat/completions", gw.chat_completions, methods=["POST"]),
              Route("/v1/responses", gw.responses.create, methods=["POST"]),
              Route("/v1/responses/{rid}", gw.responses.retrieve, methods=["GET"]),
              Route("/v1/responses/{rid}", gw.responses.delete, methods=["DELETE"]),
              Route("/v1/responses/{rid}/cancel", gw.responses.cancel, methods=["POST"]),
              *(Route(path, gw.counted(answer), methods=["POST"]) for path, answer in (
                  ("/v1/embeddings", gw.pooling.embeddings), ("/v1/rerank", gw.pooling.rerank),
                  ("/rerank", gw.pooling.rerank), ("/v1/score", gw.pooling.score),
                  ("/classify", gw.pooling.classify)))]
    return Starlette(routes=routes, lifespan=gw.lifespan,
                     exception_handlers={APIError: _api_error,
                                         redis.exceptions.ConnectionError: _queue_error,
                                         redis.exceptions.TimeoutError: _queue_error})


class BackgroundGateway:
    """The gateway served by uvicorn in a process of its own (`roseinfer serve`, the
    bench, tests). In a thread of the worker's process its HTTP, JSON and SSE work
    held the engine loop's interpreter lock: on an H100 that made TPOT 2.5x
    (docs/gateway.md, "Overhead")."""

    def __init__(self, config: GatewayConfig, host: str = "127.0.0.1", port: int = 8000):
        import multiprocessing

        self.url = f"http://{host}:{port}"
        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA
        self.ready = ctx.Event()
        self.process = ctx.Process(target=_serve_gateway, args=(config, host, port, self.ready),
                                   name="roseinfer-gateway", daemon=True)

    def start(self, timeout_s: float = 60.0) -> "BackgroundGateway":
        self.process.start()
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.05):
            if not self.process.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the gateway did not start on {self.url} (port taken?)")
        return self

    def stop(self) -> None:
        """Finish open responses (uvicorn's shutdown on SIGTERM), then end the process."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _serve_gateway(config: GatewayConfig, host: str, port: int, ready) -> None:
    """A BackgroundGateway's process: serve until SIGTERM or until the parent is gone."""
    import os
    import threading

    import uvicorn

    parent = os.getppid()
    server = uvicorn.Server(uvicorn.Config(create_app(config), host=host, port=port,
                                           log_level="warning"))

    def watch() -> None:
        while not server.should_exit:
            if server.started:
                ready.set()
            if os.getppid() != parent:  # the worker died without stopping us
                server.should_exit = True
            time.sleep(0.05)
    threading.Thread(target=watch, daemon=True).start()
    server.run()
