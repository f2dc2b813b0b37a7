"""The gateway's pooling routes: ``/v1/embeddings`` in OpenAI's shape, ``/v1/rerank`` and
``/rerank`` in Cohere's and Jina's, ``/v1/score`` and ``/classify`` in vLLM's. Each call is
one queue request with ``task`` embed, score or classify (docs/protocol.md), answered
by a worker whose model pools."""
from __future__ import annotations

import base64
import struct
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from roseinfer.core.pooling_task import PoolingTask
from roseinfer.frontends.openai.mapping import APIError, bad
from roseinfer.frontends.redis_streams.protocol import RID_PATTERN, embedding_rows


class Pooling:
    def __init__(self, gateway):
        self.gw = gateway

    async def embeddings(self, request: Request) -> Response:
        body = await self.gw.body(request)
        inputs = _inputs(body.get("input"), "input")
        encoding = body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise bad("encoding_format", f"must be float or base64, got {encoding!r}")
        dimensions = body.get("dimensions")
        if dimensions is not None and (not isinstance(dimensions, int) or dimensions < 1):
            raise bad("dimensions", f"must be an integer >= 1, got {dimensions!r}")
        task = PoolingTask("embed", inputs, dimensions=dimensions, truncate=_truncate(body),
                           prompt_name=body.get("prompt_name"))
        _, final = await self._run(request, task, body)
        rows = embedding_rows(final.pooled)
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(struct.pack(f"<{len(r)}f", *r)).decode()
                 if encoding == "base64" else r} for i, r in enumerate(rows)]
        return JSONResponse({"object": "list", "data": data, "model": self.gw.config.model_name,
                             "usage": _usage(final.usage)})

    async def rerank(self, request: Request) -> Response:
        body = await self.gw.body(request)
        query = body.get("query")
        if not isinstance(query, str) or not query:
            raise bad("query", "must be a non-empty string")
        documents = body.get("documents")
        if not isinstance(documents, list) or not documents:
            raise bad("documents", "must be a non-empty list of strings or {\"text\": ...}")
        texts = [d.get("text") if isinstance(d, dict) else d for d in documents]
        if not all(isinstance(t, str) for t in texts):
            raise bad("documents", "each must be a string or {\"text\": string}")
        top_n = body.get("top_n", len(texts))
        if not isinstance(top_n, int) or top_n < 1:
            raise bad("top_n", f"must be an integer >= 1, got {top_n!r}")
        rid, final = await self._run(request, PoolingTask(
            "score", texts, query, truncate=_truncate(body)), body)
        ranked = sorted(enumerate(final.pooled["scores"]), key=lambda s: -s[1])[:top_n]
        keep = body.get("return_documents", True)
        results = [{"index": i, "relevance_score": s,
                    **({"document": {"text": texts[i]}} if keep else {})} for i, s in ranked]
        return JSONResponse({"id": rid, "model": self.gw.config.model_name, "results": results,
                             "usage": {"total_tokens": final.usage["prompt_tokens"]}})

    async def score(self, request: Request) -> Response:
        """vLLM's: ``text_1`` (one text) against ``text_2`` (a text or a list)."""
        body = await self.gw.body(request)
        first, second = body.get("text_1"), body.get("text_2")
        if isinstance(first, list) and len(first) == 1:
            first = first[0]
        if not isinstance(first, str) or not first:
            raise bad("text_1", "must be one non-empty string (scored against each of text_2)")
        second = _inputs(second, "text_2")
        rid, final = await self._run(request, PoolingTask(
            "score", second, first, truncate=_truncate(body)), body)
        data = [{"index": i, "object": "score", "score": s}
                for i, s in enumerate(final.pooled["scores"])]
        return JSONResponse({"id": f"score-{rid}", "object": "list", "created": int(time.time()),
                             "model": self.gw.config.model_name, "data": data,
                             "usage": _usage(final.usage)})

    async def classify(self, request: Request) -> Response:
        body = await self.gw.body(request)
        task = PoolingTask("classify", _inputs(body.get("input"), "input"),
                           truncate=_truncate(body))
        rid, final = await self._run(request, task, body)
        labels = final.pooled.get("labels") or []
        data = []
        for i, probs in enumerate(final.pooled["probs"]):
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": i, "label": labels[best] if best < len(labels) else str(best),
                         "probs": probs, "num_classes": len(probs)})
        return JSONResponse({"id": f"classify-{rid}", "object": "list",
                             "created": int(time.time()), "model": self.gw.config.model_name,
                             "data": data, "usage": _usage(final.usage)})

    async def _run(self, request: Request, task: PoolingTask, body: dict):
        """The task through the queue, to its one final chunk; a worker's refusal as a 400
        naming the field."""
        rid = request.headers.get("x-request-id") or f"pool-{uuid.uuid4().hex}"
        if not RID_PATTERN.fullmatch(rid):
            raise APIError(400, "X-Request-Id must be 1-128 characters of [A-Za-z0-9_.:-]")
        priority = body.get("priority", 0)
        if not isinstance(priority, int):
            raise bad("priority", f"must be an integer, got {priority!r}")
        await self.gw.client.submit(task, rid=rid, priority=priority)
        final = None
        async for chunk in self.gw.chunks(rid, 1):
            final = chunk
        return rid, final


def _inputs(value, name: str) -> list:
    """OpenAI's ``input``: a string, a list of strings, token ids, or lists of them."""
    if isinstance(value, str) or (isinstance(value, list) and value and
                                  all(isinstance(i, int) for i in value)):
        return [value]
    if not isinstance(value, list) or not value:
        raise bad(name, "must be a string or a non-empty list of strings or token-id lists")
    return value


def _truncate(body: dict):
    """TEI's ``truncate`` (true: on the right) and ``truncation_direction``."""
    truncate = body.get("truncate", False)
    if truncate in (None, False):
        return None
    if truncate is True:
        direction = str(body.get("truncation_direction", "right")).lower()
        if direction not in ("left", "right"):
            raise bad("truncation_direction", f"must be left or right, got {direction!r}")
        return direction
    raise bad("truncate", f"must be true or false, got {truncate!r}")


def _usage(usage: dict) -> dict:
    tokens = (usage or {}).get("prompt_tokens", 0)
    return {"prompt_tokens": tokens, "total_tokens": tokens}
