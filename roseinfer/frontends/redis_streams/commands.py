"""CLI commands of the Redis frontend: `roseinfer serve`, `roseinfer worker`, `roseinfer submit`.

roseinfer/cli.py calls add_commands(); each command returns the process exit code.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys

import redis

from roseinfer.frontends.redis_streams.client import DEFAULT_URL, Client
from roseinfer.frontends.redis_streams.protocol import DEFAULT_GROUP, DEFAULT_PREFIX
from roseinfer.frontends.redis_streams.server import EmbeddedRedis
from roseinfer.frontends.redis_streams.worker import Worker

log = logging.getLogger("roseinfer.worker")
EXAMPLE_PROMPT = "What is the capital of France?"


def add_commands(subparsers, engine_parent: argparse.ArgumentParser) -> None:
    serve = subparsers.add_parser(
        "serve", parents=[engine_parent],
        help="run a worker, with an embedded Redis unless --redis-url is given")
    serve.add_argument("--redis-url", default=None,
                       help="use this Redis instead of starting one (default: start one)")
    serve.add_argument("--port", type=int, default=6379,
                       help="port of the embedded Redis, on 127.0.0.1 (default: %(default)s)")
    _add_worker_flags(serve)
    serve.set_defaults(func=serve_command)

    worker = subparsers.add_parser("worker", parents=[engine_parent],
                                   help="serve requests from a Redis stream")
    worker.add_argument("--redis-url", default=DEFAULT_URL, help="(default: %(default)s)")
    _add_worker_flags(worker)
    worker.set_defaults(func=worker_command)

    submit = subparsers.add_parser("submit", help="send a prompt to the workers, print the reply")
    submit.add_argument("prompt")
    submit.add_argument("--redis-url", default=DEFAULT_URL, help="(default: %(default)s)")
    submit.add_argument("--prefix", default=DEFAULT_PREFIX, help="(default: %(default)s)")
    submit.add_argument("--max-tokens", type=int, default=128, help="(default: %(default)s)")
    submit.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy (default: %(default)s)")
    submit.add_argument("--top-p", type=float, default=None)
    submit.add_argument("--top-k", type=int, default=None)
    submit.add_argument("--min-p", type=float, default=None)
    submit.add_argument("--seed", type=int, default=None)
    submit.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    submit.add_argument("--ignore-eos", action="store_true", default=None)
    submit.add_argument("--stream-interval", type=int, default=None, help="tokens per chunk")
    submit.add_argument("--rid", default=None, help="request id (default: the entry ID)")
    submit.add_argument("--no-stream", dest="stream", action="store_false",
                        help="print the text once it is complete")
    submit.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for each chunk (default: %(default)s)")
    submit.set_defaults(func=submit_command)


def _add_worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="key prefix (default: %(default)s)")
    p.add_argument("--group", default=DEFAULT_GROUP, help="consumer group (default: %(default)s)")
    p.add_argument("--consumer", default=None, help="consumer name (default: HOST-PID)")
    p.add_argument("--raw", action="store_true",
                   help="pass text prompts as they are, not wrapped in the model's chat template")


def worker_command(args: argparse.Namespace) -> int:
    _show_worker_logs()
    return _serve_with(args, args.redis_url)


def serve_command(args: argparse.Namespace) -> int:
    _show_worker_logs()
    if args.redis_url:
        return _serve_with(args, args.redis_url)
    with EmbeddedRedis(port=args.port) as server:
        log.info("embedded Redis listening at %s", server.url)
        return _serve_with(args, server.url, announce=True)


def _serve_with(args: argparse.Namespace, redis_url: str, announce: bool = False) -> int:
    from roseinfer.core.llm import llm_from_args  # torch loads only for commands that need it

    redis_client = _connect(redis_url)  # before the model loads: fail fast
    llm = llm_from_args(args)
    worker = Worker(llm.engine, redis_client, prefix=args.prefix,
                    group=args.group, consumer=args.consumer, chat_template=not args.raw)
    if announce:
        print(f"roseinfer is serving {args.model} at {redis_url}; from another terminal:\n"
              f"  roseinfer submit {EXAMPLE_PROMPT!r}{_client_flags(args, redis_url)}", flush=True)
    _stop_on_signals(worker)
    try:
        worker.run()
    except KeyboardInterrupt:
        log.warning("interrupted twice: quit without finishing in-flight requests")
        return 130
    return 0


def _connect(url: str) -> redis.Redis:
    client = redis.Redis.from_url(url)
    try:
        client.ping()
    except redis.ConnectionError as e:
        sys.exit(f"cannot reach Redis at {url} ({e}): start one with `roseinfer serve`, "
                 "or pass the right --redis-url")
    return client


def _client_flags(args: argparse.Namespace, redis_url: str) -> str:
    flags = "" if redis_url == DEFAULT_URL else f" --redis-url {redis_url}"
    return flags + ("" if args.prefix == DEFAULT_PREFIX else f" --prefix {args.prefix}")


def _stop_on_signals(worker: Worker) -> None:
    def handler(signum, frame):
        if worker.stopping:
            raise KeyboardInterrupt
        log.info("stopping: finishing in-flight requests (Ctrl-C again to quit at once)")
        worker.stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def _show_worker_logs() -> None:
    # A worker's lifecycle lines are its only sign of life: show them without -v.
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)


def submit_command(args: argparse.Namespace) -> int:
    params = {k: getattr(args, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p",
                                             "seed", "stop", "ignore_eos", "stream_interval")}
    client = Client(prefix=args.prefix, redis_client=_connect(args.redis_url))
    rid = client.submit(args.prompt, rid=args.rid, **params)
    chunks = []
    try:
        for chunk in client.stream(rid, timeout=args.timeout):
            chunks.append(chunk)
            if args.stream:
                print(chunk.text, end="", flush=True)
    except KeyboardInterrupt:
        client.cancel(rid)
        return 130
    except TimeoutError as e:
        print(f"\n{e}", file=sys.stderr)
        return 1
    final = chunks[-1]
    if final.error is not None:
        print(f"error ({final.error['code']}): {final.error['message']}", file=sys.stderr)
        return 1
    print("" if args.stream else "".join(c.text for c in chunks))
    usage = final.usage
    print(f"[{final.finish_reason}: {usage['prompt_tokens']} prompt + "
          f"{usage['completion_tokens']} generated tokens]", file=sys.stderr)
    return 0
