"""Reading a pooling request entry: ``task`` embed, score or classify, with its inputs
(docs/protocol.md, "Embeddings, scores and classes"). Pure functions, as
request_entry.py's: a bad field raises InvalidRequestError naming it."""
from __future__ import annotations

from typing import Optional

from roseinfer.core.errors import InvalidRequestError, short
from roseinfer.core.pooling_task import PoolingTask
from roseinfer.core.sampling import is_int

TASKS = ("generate", "embed", "score", "classify")
MAX_INPUTS = 2048  # inputs (or documents) in one request: a larger job is several requests
ENCODINGS = ("binary", "float")
GENERATE_KEYS = ("prompt", "prompt_token_ids", "messages")


def pooling_task(body: dict) -> Optional[PoolingTask]:
    """The entry's pooling task; None for ``task`` generate (the default)."""
    task = body.get("task", "generate")
    if task not in TASKS:
        raise InvalidRequestError("task", f"must be one of {', '.join(TASKS)}, got {short(task)}")
    if task == "generate":
        return None
    stray = [k for k in GENERATE_KEYS if k in body]
    if stray:
        takes = "query and documents" if task == "score" else "input"
        raise InvalidRequestError(stray[0], f"goes with task generate; task {task} takes {takes}")
    if task == "score":
        query = body.get("query")
        if not (isinstance(query, str) or _ids(query)):
            raise InvalidRequestError("query", f"must be a string or token ids, got {short(query)}")
        inputs = _inputs(body, "documents")
    else:
        query, inputs = None, _inputs(body, "input")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not is_int(dimensions) or dimensions < 1):
        raise InvalidRequestError("dimensions", f"must be an integer >= 1, got {short(dimensions)}")
    encoding = body.get("encoding_format", "binary")
    if encoding not in ENCODINGS:
        raise InvalidRequestError("encoding_format", f"must be binary or float, got "
                                  f"{short(encoding)}")
    for key in ("truncate", "prompt_name"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise InvalidRequestError(key, f"must be a string, got {short(body[key])}")
    return PoolingTask(task, inputs, query, dimensions, body.get("truncate"),
                       body.get("prompt_name"), encoding_format=encoding)


def _inputs(body: dict, key: str) -> list:
    value = body.get(key)
    if isinstance(value, str) or (key == "input" and _ids(value) and value):
        return [value]  # one text, or one input's token ids
    if not isinstance(value, list) or not value:
        raise InvalidRequestError(key, f"must be a string or a non-empty list of strings or "
                                  f"token-id lists, got {short(value)}")
    if len(value) > MAX_INPUTS:
        raise InvalidRequestError(key, f"has {len(value)} items, over {MAX_INPUTS}: send the "
                                  "rest in other requests", "too_long")
    return value


def _ids(value) -> bool:
    return isinstance(value, list) and all(is_int(i) for i in value)
