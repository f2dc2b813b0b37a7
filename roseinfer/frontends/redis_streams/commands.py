"""CLI commands of the Redis frontend: `roseinfer serve | worker | submit | embed | status`.

roseinfer/cli.py calls add_commands(); each command returns the process exit code.
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import tomllib

from roseinfer.core.errors import InvalidRequestError
from roseinfer.core.tools import check_tools
from roseinfer.frontends.redis_streams import embed_job
from roseinfer.frontends.redis_streams.protocol import DEFAULT_GROUP, DEFAULT_PREFIX, \
    DEFAULT_URL, Chat, Keys, prefix_arg
# The Redis client, the worker and the metrics are imported by the commands that use
# them: every CLI command builds this parser, and `generate` starts 0.3 s sooner.

log = logging.getLogger("roseinfer.worker")
EXAMPLE_PROMPT = "What is the capital of France?"
# Well above a blocking read (1 s): only a Redis that stopped answering trips it, and the
# worker then retries as through any outage.
SOCKET_TIMEOUT_S = 10.0

# Worker settings: flag (--claim-idle-ms), or key of the --config file's [worker] table
# (claim_idle_ms = 10000); the flag wins. name: (default, type, help)
WORKER_SETTINGS = {
    "redis_url": (None, str, (f"Redis to serve from (worker default: {DEFAULT_URL}; "
                              "serve default: start an embedded one)")),
    "prefix": (DEFAULT_PREFIX, prefix_arg, "key prefix"),
    "group": (DEFAULT_GROUP, str, "consumer group"),
    "consumer": (None, str, "consumer name, unique per worker (default: HOST-PID)"),
    "claim_idle_ms": (30_000, int, "claim a dead worker's request once idle this long"),
    "max_deliveries": (5, int, "move a request delivered more often than this to P:dead"),
    "grace_s": (30.0, float, "on SIGTERM/SIGINT, let in-flight requests finish this long"),
    "heartbeat_s": (5.0, float, "rewrite this worker's heartbeat key this often"),
    "metrics_port": (None, int, "serve Prometheus metrics at http://ADDR:PORT/metrics (default: off)"),
    "metrics_addr": ("0.0.0.0", str, "address of the metrics endpoint"),
    "raw": (False, bool, "pass text prompts as they are, not wrapped in the chat template"),
    "max_entry_bytes": (4 << 20, int, "refuse request entries larger than this (too_long), "
                                      "before decoding them"),
    "ack_replicas": (0, int, "acknowledge a finished request only once this many replicas "
                             "hold its chunks (Redis WAIT; docs/operations.md)"),
    "ack_timeout_ms": (1000, int, "with --ack-replicas: wait this long for the replicas, "
                                  "then acknowledge anyway (logged as ack_unreplicated)"),
    "no_route": (False, bool, "serve every entry this worker reads, never handing one to the "
                              "worker whose prefix cache holds its prompt (docs/operations.md)"),
    "route_min_gain_tokens": (128, int, "hand an entry over only to a worker holding at least "
                                        "this many more of its prompt's tokens"),
    "route_max_load": (1.0, float, "hand no entry to a worker running this many times its "
                                   "max_num_seqs or more"),
    "route_max_excess": (None, int, "hand no entry to a worker running more than this many "
                                    "sequences beyond this one's (default: its max_num_seqs/8, "
                                    "at least 2)"),
    "route_policy": ("ttft", str, "where a prompt's prefix is cached elsewhere: ttft (to the "
                                  "worker predicted to answer first) or prefix (to the holder "
                                  "unless it is loaded past the bounds above)"),
    "pooling_model": (None, str, "also serve this embedding or scoring model, on the same "
                                 "device: requests with task embed, score or classify go to "
                                 "it, and its batches yield to generation "
                                 "(core/paired_engine.py)"),
}


def add_commands(subparsers, engine_parent: argparse.ArgumentParser) -> None:
    serve = subparsers.add_parser(
        "serve", parents=[engine_parent],
        help="run a worker, with an embedded Redis unless --redis-url is given")
    serve.add_argument("--port", type=int, default=6379,
                       help="port of the embedded Redis, on 127.0.0.1 (default: %(default)s)")
    serve.add_argument("--gateway-port", type=int, default=8000,
                       help="port of the OpenAI API gateway, on 127.0.0.1 (default: %(default)s)")
    serve.add_argument("--no-gateway", dest="gateway", action="store_false",
                       help="serve no OpenAI API: the Redis queue only")
    serve.add_argument("--allowed-media-domains", default="", metavar="HOSTS",
                       help="hosts (comma-separated, matched exactly) whose http(s) image "
                            "URLs the gateway fetches; without, images come as data URLs only")
    _add_worker_flags(serve)
    serve.set_defaults(func=serve_command)

    worker = subparsers.add_parser("worker", parents=[engine_parent],
                                   help="serve requests from a Redis stream")
    _add_worker_flags(worker)
    worker.set_defaults(func=worker_command)

    st = subparsers.add_parser("status", help="list live workers, queue lag and in-flight counts")
    st.add_argument("--redis-url", default=DEFAULT_URL, help="(default: %(default)s)")
    st.add_argument("--prefix", default=DEFAULT_PREFIX, type=prefix_arg, help="(default: %(default)s)")
    st.add_argument("--group", default=DEFAULT_GROUP, help="(default: %(default)s)")
    st.add_argument("--json", action="store_true", help="print it as JSON")
    st.set_defaults(func=status_command)

    embed_job.add_command(subparsers)
    submit = subparsers.add_parser("submit", help="send a prompt to the workers, print the reply")
    _add_submit_flags(submit)
    submit.set_defaults(func=submit_command)

    lora = subparsers.add_parser("lora", help="load or unload a LoRA adapter on every worker "
                                 "started with --enable-lora, and wait until they have")
    lora.add_argument("op", choices=("load", "unload"))
    lora.add_argument("name", help="the name requests give as their lora")
    lora.add_argument("path", nargs="?", default="",
                      help="with load: the adapter's folder (PEFT's save_pretrained), as the "
                           "workers' hosts see it")
    lora.add_argument("--redis-url", default=DEFAULT_URL, help="(default: %(default)s)")
    lora.add_argument("--prefix", default=DEFAULT_PREFIX, type=prefix_arg, help="(default: %(default)s)")
    lora.add_argument("--timeout", type=float, default=30.0,
                      help="seconds to wait for the workers (default: %(default)s)")
    lora.set_defaults(func=lora_command)


def _add_submit_flags(submit: argparse.ArgumentParser) -> None:
    submit.add_argument("prompt", nargs="?", help="the prompt text (or give --messages-file)")
    submit.add_argument("--messages-file", default=None, metavar="FILE",
                        help='a conversation instead of a prompt: a JSON list of {"role", '
                             '"content"} maps ("-" reads it from stdin)')
    submit.add_argument("--redis-url", default=DEFAULT_URL, help="(default: %(default)s)")
    submit.add_argument("--prefix", default=DEFAULT_PREFIX, type=prefix_arg, help="(default: %(default)s)")
    submit.add_argument("--max-tokens", type=int, default=128, help="(default: %(default)s)")
    submit.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy (default: %(default)s)")
    submit.add_argument("--top-p", type=float, default=None)
    submit.add_argument("--top-k", type=int, default=None)
    submit.add_argument("--min-p", type=float, default=None)
    submit.add_argument("--seed", type=int, default=None)
    submit.add_argument("--priority", type=int, default=None,
                        help="lower runs first; above 0 the request waits in the backlog "
                             "(docs/protocol.md, Priorities)")
    submit.add_argument("-n", "--n", type=int, default=None,
                        help="independent samples (1-16); with more than one, each sample's "
                             "text prints whole when it ends, under a '--- sample I ---' line")
    submit.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    submit.add_argument("--ignore-eos", action="store_true", default=None)
    submit.add_argument("--stream-interval", type=int, default=None, help="tokens per chunk")
    submit.add_argument("--logprobs", type=int, default=None, metavar="K",
                        help="after the text, one JSON line per token: its log probability "
                             "and the K most likely alternatives (0-20)")
    submit.add_argument("--prompt-logprobs", type=int, default=None, metavar="K",
                        help="after the text, a JSON line with each prompt token's log "
                             "probability and the K most likely alternatives (0-20)")
    submit.add_argument("--repetition-penalty", type=float, default=None, help="1 = off")
    submit.add_argument("--frequency-penalty", type=float, default=None, help="0 = off")
    submit.add_argument("--presence-penalty", type=float, default=None, help="0 = off")
    submit.add_argument("--logit-bias", action="append", default=None, metavar="ID:BIAS",
                        type=_bias_pair, help="add BIAS to token ID's logit (repeatable)")
    submit.add_argument("--response-format", type=_json_object, default=None, metavar="JSON",
                        help='the output\'s shape, e.g. \'{"type": "json_object"}\', '
                             '\'{"type": "regex", "pattern": "[0-9]+"}\' or a json_schema '
                             '(docs/protocol.md)')
    submit.add_argument("--tools-file", default=None, metavar="FILE",
                        help="tools the model may call, with --messages-file: a JSON list of "
                             "OpenAI's {type: function, function: {name, description, "
                             "parameters}}; calls print as JSON lines after the text")
    submit.add_argument("--tool-choice", default=None, metavar="CHOICE",
                        help="none, auto (default), required, or a function's name")
    submit.add_argument("--no-parallel-tool-calls", dest="parallel_tool_calls",
                        action="store_false", help="at most one call")
    submit.add_argument("--lora", default=None, metavar="NAME",
                        help="run with this LoRA adapter of the workers' (default: none)")
    submit.add_argument("--rid", default=None, help="request id (default: the entry ID)")
    submit.add_argument("--no-stream", dest="stream", action="store_false",
                        help="print the text once it is complete")
    submit.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for each chunk (default: %(default)s)")


def _add_worker_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("worker (flags, or keys of the --config file's [worker] table)")
    for name, (default, kind, help) in WORKER_SETTINGS.items():
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            g.add_argument(flag, action="store_true", default=None, help=help)
        else:  # None here, so that a flag left out lets the config file speak
            shown = help if default is None else f"{help} (default: {default})"
            g.add_argument(flag, type=kind, default=None, help=shown)


def worker_settings(args: argparse.Namespace) -> dict:
    """Flags given on the command line override the config file's [worker] table, which
    overrides the defaults."""
    settings = {name: default for name, (default, _, _) in WORKER_SETTINGS.items()}
    if getattr(args, "config", None):
        with open(args.config, "rb") as f:
            table = tomllib.load(f).get("worker", {})
        unknown = sorted(set(table) - set(settings))
        if unknown:
            sys.exit(f"unknown key(s) {unknown} in the [worker] table of {args.config}; "
                     f"known: {sorted(settings)}")
        settings.update(table)
    settings.update((k, getattr(args, k)) for k in settings if getattr(args, k, None) is not None)
    return settings


def worker_command(args: argparse.Namespace) -> int:
    _show_worker_logs()
    settings = worker_settings(args)
    return _serve_with(args, settings, settings["redis_url"] or DEFAULT_URL)


def serve_command(args: argparse.Namespace) -> int:
    _show_worker_logs()
    settings = worker_settings(args)
    if settings["redis_url"]:
        return _serve_with(args, settings, settings["redis_url"])
    from roseinfer.frontends.redis_streams.server import EmbeddedRedis

    with EmbeddedRedis(port=args.port) as server:
        log.info("embedded Redis listening at %s", server.url)
        return _serve_with(args, settings, server.url, announce=True)


def _start_gateway(args, settings: dict, redis_url: str):
    """`serve`'s OpenAI gateway, in a thread, on 127.0.0.1 (None: a worker, --no-gateway)."""
    if not getattr(args, "gateway", False):
        return None
    from roseinfer.frontends.openai.app import BackgroundGateway, GatewayConfig

    config = GatewayConfig(redis_url, settings["prefix"], model_name="roseinfer",
                           allowed_media_domains=args.allowed_media_domains.split(","))
    return BackgroundGateway(config, port=args.gateway_port).start()


def _paired(engine, pooling_model: str | None):
    """``engine``, or it with a pooling engine for ``pooling_model`` beside it, on its
    device and in its dtype."""
    if pooling_model is None:
        return engine
    from roseinfer.core.config import EngineConfig
    from roseinfer.core.paired_engine import PairedEngine
    from roseinfer.core.pooling_engine import PoolingEngine

    if not hasattr(engine, "scheduler"):
        kind = engine.hf_config.model_type
        raise SystemExit(f"--pooling-model serves beside a generating model; {kind} pools "
                         f"itself: serve {pooling_model} on its own")
    config = EngineConfig(device=str(engine.device), dtype=str(engine.dtype).removeprefix(
        "torch."), max_num_batched_tokens=engine.config.max_num_batched_tokens)
    return PairedEngine(engine, PoolingEngine(pooling_model, config=config))


def _serve_with(args: argparse.Namespace, settings: dict, redis_url: str,
                announce: bool = False) -> int:
    from roseinfer.core.llm import llm_from_args  # torch loads only for commands that need it
    from roseinfer.frontends.redis_streams import metrics
    from roseinfer.frontends.redis_streams.routing import RouteConfig
    from roseinfer.frontends.redis_streams.worker import EngineFailed, Worker

    # Both before the model loads: fail fast on an unreachable Redis or a taken port.
    redis_client = _connect(redis_url, socket_timeout=SOCKET_TIMEOUT_S)
    worker_metrics = metrics.Metrics(model_name=args.model)
    stop_metrics = _serve_metrics(worker_metrics, settings)
    try:
        llm = llm_from_args(args)
        engine = _paired(llm.engine, settings["pooling_model"])
        worker = Worker(engine, redis_client, prefix=settings["prefix"],
                        group=settings["group"], consumer=settings["consumer"],
                        grace_s=settings["grace_s"], claim_idle_ms=settings["claim_idle_ms"],
                        max_deliveries=settings["max_deliveries"],
                        heartbeat_s=settings["heartbeat_s"], metrics=worker_metrics,
                        chat_template=not settings["raw"], model_name=args.model,
                        max_entry_bytes=settings["max_entry_bytes"],
                        ack_replicas=settings["ack_replicas"],
                        ack_timeout_ms=settings["ack_timeout_ms"],
                        route=None if settings["no_route"] else RouteConfig(
                            settings["route_min_gain_tokens"], settings["route_max_load"],
                            settings["route_max_excess"], settings["route_policy"]))
        gateway = _start_gateway(args, settings, redis_url)
        pools = "generate" not in getattr(engine, "tasks", ("generate",))
        if announce:
            example = "embed FILE.jsonl --out OUT.jsonl" if pools else \
                f"submit {EXAMPLE_PROMPT!r}"
            print(f"roseinfer is serving {args.model} at {redis_url}; from another terminal:\n"
                  f"  roseinfer {example}{_client_flags(settings, redis_url)}", flush=True)
        if gateway is not None:
            route, body = ("embeddings", f'"input": ["{EXAMPLE_PROMPT}"]') if pools else (
                "chat/completions",
                f'"messages": [{{"role": "user", "content": "{EXAMPLE_PROMPT}"}}]')
            print(f"OpenAI API at {gateway.url}/v1:\n  curl {gateway.url}/v1/{route} "
                  "-H 'Content-Type: application/json' -d '{\"model\": \"roseinfer\", "
                  f"{body}}}'", flush=True)
        _stop_on_signals(worker)
        try:
            worker.run()
        finally:
            if gateway is not None:
                gateway.stop()
    except KeyboardInterrupt:
        log.warning("interrupted twice: quit without finishing in-flight requests")
        return 130
    except EngineFailed as e:
        log.error("%s (%s)", e, e.__cause__)
        return 1
    finally:
        stop_metrics()
    return 0


def _serve_metrics(worker_metrics: metrics.Metrics, settings: dict):
    from roseinfer.frontends.redis_streams import metrics

    port = settings["metrics_port"]
    if port is None:
        return lambda: None
    try:
        stop = metrics.serve(worker_metrics, port, settings["metrics_addr"])
    except OSError as e:
        sys.exit(f"cannot serve metrics on {settings['metrics_addr']}:{port} ({e}): "
                 "pick another --metrics-port")
    log.info("metrics at http://%s:%d/metrics", settings["metrics_addr"], port)
    return stop


def _connect(url: str, **options) -> redis.Redis:
    import redis

    from roseinfer.frontends.redis_streams.connection import connect

    try:
        client = connect(url, socket_connect_timeout=5, **options)
        client.ping()
    except ValueError as e:
        sys.exit(f"--redis-url: {e}")
    except redis.ConnectionError as e:
        sys.exit(f"cannot reach Redis at {url} ({e}): start one with `roseinfer serve`, "
                 "or pass the right --redis-url")
    return client


def _client_flags(settings: dict, redis_url: str) -> str:
    flags = "" if redis_url == DEFAULT_URL else f" --redis-url {redis_url}"
    return flags + ("" if settings["prefix"] == DEFAULT_PREFIX else f" --prefix {settings['prefix']}")


def _stop_on_signals(worker: Worker) -> None:
    from roseinfer.frontends.redis_streams.events import event

    def handler(signum, frame):
        if worker.stopping:
            raise KeyboardInterrupt
        event("stopping", signal=signal.Signals(signum).name, grace_s=worker.grace_s,
              note="finishing in-flight requests; the same signal again quits at once")
        worker.stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def _show_worker_logs() -> None:
    # A worker's lifecycle lines are its only sign of life: show them without -v.
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)


def _bias_pair(text: str) -> tuple[int, float]:
    token, _, bias = text.partition(":")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not ID:BIAS, e.g. 50256:-100") from None


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"type\": \"json_object\"}'")
    return value


def submit_command(args: argparse.Namespace) -> int:
    from roseinfer.frontends.redis_streams.client import Client

    params = {k: getattr(args, k) for k in ("n", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                                             "seed", "stop", "ignore_eos", "stream_interval",
                                             "logprobs", "prompt_logprobs", "repetition_penalty",
                                             "frequency_penalty", "presence_penalty",
                                             "response_format", "priority", "lora")}
    params["logit_bias"] = dict(args.logit_bias) if args.logit_bias else None
    client = Client(prefix=args.prefix, redis_client=_connect(args.redis_url))
    rid = client.submit(_submitted_prompt(args), rid=args.rid, **params)
    n = args.n or 1
    if n > 1:
        return _print_samples(client, rid, n, args.timeout)
    chunks = []

    def take(chunk):
        chunks.append(chunk)
        if args.stream:
            print(chunk.text, end="", flush=True)
    code = _follow(client, rid, args.timeout, 1, take)
    if code:
        return code
    print("" if args.stream else "".join(c.text for c in chunks))
    for call in chunks[-1].tool_calls or []:
        print(json.dumps({"tool_call": call}))
    if chunks[0].prompt_logprobs is not None:
        print(json.dumps({"prompt_logprobs": chunks[0].prompt_logprobs}))
    for c in chunks:
        for token, lp in zip(c.token_ids, c.logprobs or []):
            print(json.dumps({"token_id": token, **lp}))
    final = chunks[-1]
    usage = final.usage
    print(f"[{final.finish_reason}: {usage['prompt_tokens']} prompt + "
          f"{usage['completion_tokens']} generated tokens]", file=sys.stderr)
    return 0


def _submitted_prompt(args: argparse.Namespace):
    """The prompt text, or the conversation of --messages-file; exits saying what to
    give when it is neither or both."""
    if (args.prompt is None) == (args.messages_file is None):
        sys.exit("roseinfer submit: give a prompt or --messages-file, not both")
    if args.messages_file is None:
        if args.tools_file is not None:
            sys.exit("roseinfer submit: --tools-file goes with --messages-file")
        return args.prompt
    return Chat(_json_file(args.messages_file, "--messages-file"), _tools(args))


def _tools(args: argparse.Namespace):
    if args.tools_file is None:
        return None
    choice = args.tool_choice
    if choice not in (None, "none", "auto", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    try:
        return check_tools(_json_file(args.tools_file, "--tools-file"), choice,
                           args.parallel_tool_calls)
    except InvalidRequestError as e:
        sys.exit(f"roseinfer submit: --tools-file: {e}")


def _json_file(path: str, flag: str):
    try:
        with (sys.stdin if path == "-" else open(path)) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"roseinfer submit: cannot read {flag} {path}: {e}")


def _print_samples(client: Client, rid: str, n: int, timeout: float) -> int:
    texts, usage = [""] * n, []

    def take(chunk):
        texts[chunk.index] += chunk.text
        if chunk.finished:
            print(f"--- sample {chunk.index} ({chunk.finish_reason}) ---\n{texts[chunk.index]}",
                  flush=True)
            usage.append(chunk.usage)
    code = _follow(client, rid, timeout, n, take)
    if not code:
        print(f"[{n} samples: {usage[0]['prompt_tokens']} prompt + "
              f"{sum(u['completion_tokens'] for u in usage)} generated tokens]", file=sys.stderr)
    return code


def _follow(client: Client, rid: str, timeout: float, n: int, take) -> int:
    """Each chunk of the request to ``take``; the exit code: 0, 1 on an error reply or a
    timeout, 130 on Ctrl-C (which cancels the request)."""
    try:
        for chunk in client.stream(rid, timeout=timeout, n=n):
            if chunk.error is not None:
                print(f"error ({chunk.error['code']}): {chunk.error['message']}", file=sys.stderr)
                return 1
            take(chunk)
    except KeyboardInterrupt:
        client.cancel(rid)
        return 130
    except TimeoutError as e:
        print(f"\n{e}", file=sys.stderr)
        return 1
    return 0


def lora_command(args: argparse.Namespace) -> int:
    from roseinfer.frontends.redis_streams.adapters import request

    if args.op == "load" and not args.path:
        sys.exit("roseinfer lora load NAME PATH: give the adapter's folder")
    results = request(_connect(args.redis_url), Keys(args.prefix), args.op, args.name,
                      args.path, args.timeout)
    if not results:
        print("no live worker serves adapters: start workers with --enable-lora "
              "(the entry stays, and workers that start later apply it)", file=sys.stderr)
        return 1
    for worker, result in sorted(results.items()):
        print(f"{worker}: {result}")
    return 0 if all(r == "ok" for r in results.values()) else 1


def status_command(args: argparse.Namespace) -> int:
    from roseinfer.frontends.redis_streams import status

    found = status.collect(_connect(args.redis_url), Keys(args.prefix), args.group)
    print(json.dumps(found, indent=2) if args.json else status.render(found))
    return 0
