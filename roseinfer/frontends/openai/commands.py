"""`roseinfer gateway`: the OpenAI-compatible HTTP gateway in front of the queue."""
from __future__ import annotations

import logging

from roseinfer.frontends.redis_streams.protocol import DEFAULT_PREFIX, DEFAULT_URL, prefix_arg

log = logging.getLogger("roseinfer.gateway")


def add_commands(subparsers, engine_parent) -> None:
    g = subparsers.add_parser("gateway", help="serve the OpenAI API (completions, chat, "
                              "responses) in front of the Redis queue")
    g.add_argument("--redis-url", default=DEFAULT_URL, help="(default: %(default)s)")
    g.add_argument("--prefix", default=DEFAULT_PREFIX, type=prefix_arg, help="(default: %(default)s)")
    g.add_argument("--host", default=None,
                   help="address to bind (default: 0.0.0.0 with --api-key, else 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    g.add_argument("--api-key", action="append", default=[], dest="api_keys",
                   help="require Authorization: Bearer KEY (repeat for several keys)")
    g.add_argument("--model-name", default="roseinfer",
                   help="the model id /v1/models lists and replies name (default: %(default)s)")
    g.add_argument("--queue-timeout", type=float, default=60.0,
                   help="seconds to wait for a worker's reply before a 503 (default: %(default)s)")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a whole request may take (default: %(default)s)")
    g.add_argument("--responses-ttl", type=int, default=30 * 24 * 3600,
                   help="seconds a stored /v1/responses response is kept in Redis, for "
                        "GET and previous_response_id (default: %(default)s, 30 days)")
    g.add_argument("--allowed-media-domains", default="", metavar="HOSTS",
                   help="hosts (comma-separated, matched exactly) whose http(s) image URLs "
                        "the gateway fetches; without, images come as data URLs only")
    g.add_argument("--media-timeout", type=float, default=10.0,
                   help="seconds one image's fetch may take (default: %(default)s)")
    g.set_defaults(func=gateway_command)


def gateway_command(args) -> int:
    import uvicorn

    from roseinfer.frontends.openai.app import GatewayConfig, create_app

    host = args.host or ("0.0.0.0" if args.api_keys else "127.0.0.1")
    if not args.api_keys:
        log.warning("no --api-key: anyone who can reach %s:%d may call the gateway%s", host,
                    args.port, "" if args.host else " (so it binds to 127.0.0.1 only)")
    config = GatewayConfig(args.redis_url, args.prefix, args.model_name, args.api_keys,
                           args.queue_timeout, args.request_timeout, args.responses_ttl,
                           args.allowed_media_domains.split(","), args.media_timeout)
    print(f"OpenAI API on http://{host}:{args.port}/v1, queue {args.redis_url} "
          f"(prefix {args.prefix!r}). Try:\n"
          f"  curl http://{'127.0.0.1' if host == '0.0.0.0' else host}:{args.port}"
          "/v1/chat/completions -H 'Content-Type: application/json' -d "
          f"'{{\"model\": \"{args.model_name}\", \"messages\": [{{\"role\": \"user\", "
          "\"content\": \"Hello\"}]}'", flush=True)
    uvicorn.run(create_app(config), host=host, port=args.port, log_level="warning")
    return 0
