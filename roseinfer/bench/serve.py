"""`bench serve`: requests go through Redis to a worker, from client processes on a schedule.

Layout: a real redis-server (the frontend's embedded one unless --redis-url), the worker
in a thread of this process driving an EngineProbe (so queue wait and step times are
observable), and the load in separate client processes (asyncio + the frontend's
AsyncClient), so the clients never compete with the worker for this process's GIL.
Times are time.monotonic() in every process (one system clock on Linux).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
import threading
import uuid
from typing import Optional

from roseinfer.bench.metrics import RequestRecord
from roseinfer.bench.offline import finish_run
from roseinfer.bench.probe import EngineProbe
from roseinfer.bench.progress import Progress
from roseinfer.bench.timing import now
from roseinfer.bench.workloads import Workload

START_MARGIN_S = 0.2  # the client processes are warm; this covers handing them the run


class ServeHarness:
    """``with ServeHarness(probe, ...) as h: metrics = h.run(workload, "r0", progress)``

    Without a probe it starts no worker: the load goes to the workers already serving
    ``prefix`` on ``redis_url`` (a fleet), and engine-side figures are not reported."""

    def __init__(self, probe: Optional[EngineProbe], redis_url: Optional[str] = None,
                 client_procs: int = 1, request_timeout_s: float = 600.0,
                 prefix: Optional[str] = None, endpoint: str = "redis", ack_replicas: int = 0,
                 tools: Optional[list] = None, loras: Optional[list[str]] = None,
                 images: int = 0):
        self.probe = probe
        self.images = images  # each request a chat with a fresh image of this many pixels a side
        self.tools = tools
        self.loras = loras or []  # request i runs with loras[i % len]
        self.ack_replicas = ack_replicas
        self.endpoint = endpoint
        self._gateway = None
        self.redis_url = redis_url
        self.client_procs = client_procs
        self.timeout_s = request_timeout_s
        self.prefix = prefix or f"bench-{uuid.uuid4().hex[:8]}"
        self.tag = uuid.uuid4().hex[:8]
        self._server = None
        self._worker = None
        self._thread = None
        self._error: Optional[BaseException] = None
        self._pools: list = []  # one multiprocessing Pool(1) per client process

    def __enter__(self) -> "ServeHarness":
        from roseinfer.frontends.redis_streams.connection import connect
        from roseinfer.frontends.redis_streams.server import EmbeddedRedis, free_port
        from roseinfer.frontends.redis_streams.worker import Worker

        try:
            if self.redis_url is None:
                self._server = EmbeddedRedis(port=free_port()).start()
                self.redis_url = self._server.url
            if self.probe is not None:
                # Raw prompts, as `bench offline` sends them: no chat template.
                self._worker = Worker(self.probe, connect(self.redis_url),
                                      prefix=self.prefix, block_ms=50, chat_template=False,
                                      ack_replicas=self.ack_replicas)
                self._thread = threading.Thread(target=self._run_worker, daemon=True,
                                                name="bench-worker")
                self._thread.start()
            if self.endpoint.startswith("openai"):
                from roseinfer.frontends.openai.app import BackgroundGateway, GatewayConfig

                config = GatewayConfig(self.redis_url, self.prefix,
                                       request_timeout=self.timeout_s)
                self._gateway = BackgroundGateway(config, port=free_port()).start()
            ctx = multiprocessing.get_context("spawn")  # never fork a process that holds CUDA
            self._pools = [ctx.Pool(1) for _ in range(self.client_procs)]
            for r in [p.apply_async(_ping) for p in self._pools]:
                r.get(120)  # pay the client processes' start-up before any clock runs
        except BaseException:
            self.__exit__()
            raise
        return self

    def _run_worker(self) -> None:
        try:
            self._worker.run()
        except BaseException as e:  # reported by run(): the bench must not wait forever
            self._error = e

    def __exit__(self, *exc) -> None:
        for p in self._pools:
            p.terminate()  # between runs they are idle; after an error they must not wait on
        if self._gateway is not None:
            self._gateway.stop()
        if self._worker is not None:
            self._worker.stop(grace_s=5.0)
            self._thread.join(15)
        if self._server is not None:
            self._server.stop()

    def run(self, w: Workload, run_id: str,
            progress: Progress) -> tuple[dict, list[RequestRecord]]:
        if w.schedule == "relative" and (self.client_procs > 1 or w.request_rate is not None):
            raise ValueError("--schedule relative needs --client-procs 1 and no --request-rate: "
                             "each submit waits "
                             "for the previous one")
        if self.probe is not None:
            self.probe.reset()  # safe: the worker is idle between runs
        t0 = now() + START_MARGIN_S
        pending = [pool.apply_async(client_run, (self._spec(w, run_id, t0, k),))
                   for k, pool in enumerate(self._pools)]
        self._wait(pending, progress)
        records = [RequestRecord(**r) for p in pending for r in p.get()]
        records.sort(key=lambda r: int(r.rid.rsplit("-", 1)[1]))
        for r in records:
            r.first_scheduled = self.probe and self.probe.first_scheduled.get(r.rid)
        end = max((r.chunks[-1][0] for r in records if r.chunks), default=now())
        return finish_run(records, end - t0, self.probe), records

    def _spec(self, w: Workload, run_id: str, t0: float, shard: int) -> dict:
        params = {"max_tokens": w.max_new_tokens, "temperature": 0.0, **w.sampling,
                  "ignore_eos": w.ignore_eos, "stream_interval": w.stream_interval}
        # A tag of this harness in every rid: another bench on the same prefix (a fleet's)
        # must never find its reply streams already written.
        return {"url": self.redis_url, "prefix": self.prefix, "run_id": f"{self.tag}-{run_id}",
                "t0": t0,
                "prompts": w.prompts, "params": params, "output_lens": w.output_lens,
                "interval_s": w.submit_interval_s,
                "offsets": w.offsets,
                "schedule": w.schedule, "shard": shard, "num_shards": self.client_procs,
                "max_concurrency": _share(w.max_concurrency, shard, self.client_procs),
                "gateway_url": self._gateway.url if self._gateway else None,
                # the chat endpoint: the tools each request offers ([]: none)
                "chat": (self.tools or []) if self.endpoint == "openai-chat" else None,
                "loras": self.loras, "images": self.images,
                "timeout_s": self.timeout_s}

    def _wait(self, pending, progress: Progress) -> None:
        seen = 0
        for p in pending:
            while not p.ready():
                p.wait(0.5)
                if self.probe is None:
                    continue  # the fleet's progress is not visible from here
                if self._error is not None or not self._thread.is_alive():
                    raise RuntimeError(f"the bench worker died: {self._error!r}")
                total = self.probe.num_outputs
                progress.advance(now(), total - seen)
                seen = total


# --- the client processes ---------------------------------------------------------------

def _ping() -> bool:
    import roseinfer.frontends.redis_streams.client  # noqa: F401  (the import is the warm-up)
    return True


def _share(cap, shard: int, shards: int):
    """This shard's part of an in-flight cap (None: no cap); every shard gets >= 1."""
    return None if cap is None else max(1, cap // shards + (shard < cap % shards))


def client_run(spec: dict) -> list[dict]:
    """Submit this shard's requests on the schedule and read their streams; records as dicts."""
    return asyncio.run(_client(spec))


async def _client(spec: dict) -> list[dict]:
    transport = (_Gateway if spec.get("gateway_url") else _Queue)(spec)
    mine = range(spec["shard"], len(spec["prompts"]), spec["num_shards"])
    records = [RequestRecord(f"{spec['run_id']}-{i}") for i in mine]
    tasks, last = [], spec["t0"]
    slots = asyncio.Semaphore(spec["max_concurrency"] or len(records) or 1)
    try:
        for i, rec in zip(mine, records):
            relative = spec["schedule"] == "relative" and tasks
            rec.due = last + spec["interval_s"] if relative else spec["t0"] + spec["offsets"][i]
            await asyncio.sleep(max(0.0, rec.due - now()))
            await slots.acquire()  # released when its stream ends
            rec.submit = last = now()
            params = {**spec["params"], "max_tokens": spec["output_lens"][i]}
            if spec.get("loras"):
                params["lora"] = spec["loras"][i % len(spec["loras"])]
            prompt = spec["prompts"][i]
            if spec.get("images"):
                prompt = _with_image(prompt, spec["images"], rec.rid)
            tasks.append(await transport.send(prompt, rec, params, slots))
        await asyncio.gather(*tasks)
    finally:
        await transport.close()
    return [dataclasses.asdict(r) for r in records]


def _with_image(text: str, size: int, seed: str):
    """A chat of one user turn: a fresh JPEG of ``size`` x ``size`` random pixels (seeded by
    the request's id: no two alike, so neither cache holds it), then the prompt's text."""
    import io
    import zlib

    import numpy as np
    from PIL import Image

    from roseinfer.frontends.redis_streams.protocol import Chat
    if not isinstance(text, str):
        raise SystemExit("--images needs text prompts: the model has no tokenizer (give one: "
                         "--tokenizer DIR, docs/bench/synthetic_tokenizer.py)")
    pixels = np.random.RandomState(zlib.crc32(seed.encode())).randint(0, 256, (size, size, 3))
    data = io.BytesIO()
    Image.fromarray(pixels.astype("uint8")).save(data, format="JPEG", quality=90)
    return Chat([{"role": "user", "content": [{"type": "image", "data": data.getvalue()},
                                              {"type": "text", "text": text}]}])


class _Queue:
    """Requests straight onto the Redis stream (protocol v1)."""

    def __init__(self, spec: dict):
        from roseinfer.frontends.redis_streams.client import AsyncClient

        self.client = AsyncClient(spec["url"], spec["prefix"])
        self.timeout_s = spec["timeout_s"]

    async def send(self, prompt, rec: RequestRecord, params: dict, slots) -> asyncio.Task:
        await self.client.submit(prompt, rid=rec.rid, **params)
        return asyncio.create_task(_read(self.client, rec, self.timeout_s, slots))

    async def close(self) -> None:
        await self.client.close()


class _Gateway:
    """Requests through the OpenAI gateway: streamed completions (or chat completions, a
    text prompt as one user turn, with tools if given), with the usage in every chunk
    (vLLM's continuous_usage_stats) to count each chunk's tokens."""

    def __init__(self, spec: dict):
        import httpx

        self.chat = spec.get("chat")
        kind = "completions" if self.chat is None else "chat/completions"
        self.url = f"{spec['gateway_url']}/v1/{kind}"
        self.http = httpx.AsyncClient(timeout=spec["timeout_s"],
                                      limits=httpx.Limits(max_connections=None))

    async def send(self, prompt, rec: RequestRecord, params: dict, slots) -> asyncio.Task:
        if params.pop("stream_interval", 1) != 1:
            raise ValueError("--endpoint openai streams every token: drop --stream-interval")
        model = params.pop("lora", "bench")  # the gateway's model names an adapter
        body = {"model": model, "prompt": prompt, "stream": True, **params,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        if self.chat is not None:
            if not isinstance(prompt, str):
                raise ValueError("--endpoint openai-chat sends text prompts: use --dataset "
                                 "repeat without --pretok")
            body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
            if self.chat:
                body["tools"] = self.chat
        return asyncio.create_task(self._request(body, rec, slots))

    async def _request(self, body: dict, rec: RequestRecord, slots) -> None:
        try:
            # Our rid as the queue's: the worker-side probe finds the request by it.
            async with self.http.stream("POST", self.url, json=body,
                                        headers={"X-Request-Id": rec.rid}) as reply:
                if reply.status_code != 200:
                    rec.error = f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}"
                    return
                made = 0
                async for line in reply.aiter_lines():
                    data = line.removeprefix("data:").strip()
                    if not line.startswith("data:") or data == "[DONE]":
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        rec.error = f"{event['error'].get('message')}"
                        return
                    usage = event.get("usage") or {}
                    rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
                    if event["choices"]:
                        n = usage.get("completion_tokens", made) - made
                        made += n
                        rec.chunks.append((now(), n))
                        rec.finish_reason = event["choices"][0]["finish_reason"]
        except Exception as e:  # a lost request counts as failed, the run goes on
            rec.error = f"{type(e).__name__}: {e}"
        finally:
            slots.release()

    async def close(self) -> None:
        await self.http.aclose()


async def _read(client, rec: RequestRecord, timeout_s: float, slots) -> None:
    try:
        async for chunk in client.stream(rec.rid, timeout=timeout_s):
            rec.chunks.append((now(), len(chunk.token_ids)))
            rec.token_ids += chunk.token_ids
            if chunk.finished:
                rec.finish_reason = chunk.finish_reason
                rec.prompt_tokens = (chunk.usage or {}).get("prompt_tokens", 0)
                if chunk.error:
                    rec.error = f"{chunk.error.get('code')}: {chunk.error.get('message')}"
    except Exception as e:  # a lost request counts as failed, the run goes on
        rec.error = f"{type(e).__name__}: {e}"
    finally:
        slots.release()
