"""`roseinfer embed FILE.jsonl --out OUT.jsonl`: embed a file through the fleet.

Each input line is a JSON string, or an object with ``text`` (or ``input``) and an
optional ``id`` (the line's number otherwise). Inputs go in batches, several requests in
flight, at a background priority; each result is appended to OUT as soon as its batch
returns: ``{"id", "embedding"}``, or ``{"id", "error"}`` for an input the workers
refused (the others of its batch go again without it). Killed and started again, the job
reads OUT first and embeds only what has no embedding there yet."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from roseinfer.frontends.redis_streams.protocol import DEFAULT_PREFIX, DEFAULT_URL, prefix_arg

ITEM = re.compile(r"^\w+: item (\d+) ")  # the input a worker's refusal names


def add_command(subparsers) -> None:
    p = subparsers.add_parser("embed", help="embed a JSONL file through the workers, "
                              "resuming where a previous run stopped")
    p.add_argument("input", help="JSONL: a string, or {\"text\", \"id\"} per line")
    p.add_argument("--out", required=True, help="JSONL of {\"id\", \"embedding\"}, appended")
    p.add_argument("--redis-url", default=DEFAULT_URL)
    p.add_argument("--prefix", type=prefix_arg, default=DEFAULT_PREFIX)
    p.add_argument("--batch", type=int, default=64, help="inputs per request")
    p.add_argument("--in-flight", type=int, default=8, help="requests at once")
    p.add_argument("--priority", type=int, default=5,
                   help="the requests' priority: above 0 waits behind interactive ones")
    p.add_argument("--dimensions", type=int, default=None)
    p.add_argument("--truncate", choices=("right", "left"), default=None,
                   help="cut inputs over the model's length on this side (default: refuse)")
    p.add_argument("--prompt-name", default=None, help="the model's prompt, e.g. query")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may wait")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=embed_command)


def embed_command(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from roseinfer.frontends.redis_streams.client import Client
    inputs = read_inputs(args.input)
    done = written_ids(args.out)
    todo = [(i, text) for i, text in inputs if i not in done]
    bar = tqdm(total=len(inputs), initial=len(inputs) - len(todo), unit="input",
               disable=args.no_progress, desc="embedded")
    batches = [todo[k:k + args.batch] for k in range(0, len(todo), args.batch)]
    failed = 0
    with Client(args.redis_url, args.prefix) as client, open(args.out, "a") as out, \
            ThreadPoolExecutor(args.in_flight) as pool:
        def send(batch):
            return batch, pool.submit(client.embed, [t for _, t in batch],
                                      dimensions=args.dimensions, truncate=args.truncate,
                                      prompt_name=args.prompt_name, timeout=args.timeout,
                                      priority=args.priority)
        running = dict(send(b)[::-1] for b in batches[:args.in_flight])
        queued = batches[args.in_flight:]
        while running:
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                batch = running.pop(future)
                lines, again = _lines(batch, future)
                failed += sum("error" in line for line in lines)
                out.writelines(json.dumps(line) + "\n" for line in lines)
                out.flush()
                bar.update(len(lines))
                queued[:0] = [again] if again else []
                while queued and len(running) < args.in_flight:
                    future_batch = send(queued.pop(0))
                    running[future_batch[1]] = future_batch[0]
    bar.close()
    if failed:
        print(f"{failed} inputs were refused: see the \"error\" lines in {args.out}",
              file=sys.stderr)
    return 1 if failed else 0


def _lines(batch: list, future) -> tuple[list[dict], list]:
    """The batch's output lines, and what must go again: a refusal that names one input
    costs that input alone."""
    from roseinfer.frontends.redis_streams.client import RequestFailed
    try:
        result = future.result()
    except RequestFailed as e:
        named = ITEM.match(e.message)
        if named is None or int(named[1]) >= len(batch):
            return [{"id": i, "error": {"code": e.code, "message": e.message}}
                    for i, _ in batch], []
        k = int(named[1])
        return ([{"id": batch[k][0], "error": {"code": e.code, "message": e.message}}],
                batch[:k] + batch[k + 1:])
    return [{"id": i, "embedding": e} for (i, _), e in zip(batch, result.embeddings)], []


def read_inputs(path: str) -> list[tuple[object, str]]:
    """(id, text) of each line; a line that is neither a string nor such an object stops
    the job, naming the line."""
    inputs = []
    with open(path) as f:
        for number, line in enumerate(f):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError:
                raise SystemExit(f"{path}:{number + 1}: not JSON") from None
            if isinstance(value, dict):
                text, key = value.get("text", value.get("input")), value.get("id", number)
            else:
                text, key = value, number
            if not isinstance(text, str):
                raise SystemExit(f"{path}:{number + 1}: give a string, or an object with "
                                 "\"text\"")
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise SystemExit(f"{path}:{number + 1}: \"id\" must be a string or an integer")
            inputs.append((key, text))
    ids = [i for i, _ in inputs]
    if len(set(ids)) != len(ids):
        raise SystemExit(f"{path}: ids repeat; each line's id must be its own")
    return inputs


def written_ids(path: str) -> set:
    """Ids that already have an embedding in ``path``; a last line cut short by a kill is
    removed first, so that appending starts on a line of its own."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            f.truncate(end)
    records = (json.loads(line) for line in data[:end].splitlines())
    return {r["id"] for r in records if "embedding" in r}
