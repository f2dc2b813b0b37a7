"""`roseinfer bench offline | serve | plot` (roseinfer/cli.py calls add_commands)."""
from __future__ import annotations

import argparse
import json
import os

from roseinfer.bench.workloads import HF_VARIANTS as VARIANTS


def add_commands(subparsers, engine_parent: argparse.ArgumentParser) -> None:
    bench = subparsers.add_parser("bench",
                                  help="measure throughput and latency (docs/benchmarks.md)")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    workload = _workload_parent()
    off = sub.add_parser("offline", parents=[engine_parent, workload],
                         help="the engine in this process, no frontend")
    off.set_defaults(func=lambda args: run_bench(args, "offline"))
    srv = sub.add_parser("serve", parents=[engine_parent, workload],
                         help="through Redis: a worker thread, clients in other processes")
    g = srv.add_argument_group("serve")
    g.add_argument("--stream-interval", type=int, default=1, help="tokens per chunk (default: 1)")
    g.add_argument("--redis-url", default=None,
                   help="use this Redis (default: start an embedded redis-server)")
    g.add_argument("--client-procs", type=int, default=1,
                   help="client processes sharing the requests (default: 1)")
    g.add_argument("--no-worker", action="store_true",
                   help="start no worker: load the workers already serving --prefix on "
                        "--redis-url (a fleet); --model only names the model for prompts")
    g.add_argument("--prefix", default=None,
                   help="with --no-worker: the fleet's key prefix")
    g.add_argument("--compare-offline", action="store_true",
                   help="also run the same requests on the engine alone (bench offline) first, "
                        "and report the ratio")
    g.add_argument("--endpoint", choices=("redis", "openai", "openai-chat"), default="redis",
                   help="redis: clients write the stream (protocol v1); openai: completions "
                        "through the OpenAI gateway, started in this process; openai-chat: "
                        "chat completions there, each text prompt one user turn (default: "
                        "%(default)s)")
    g.add_argument("--tools-file", default=None, metavar="FILE",
                   help="with --endpoint openai-chat: tools (a JSON list, OpenAI's shape) "
                        "every request offers, tool_choice auto")
    g.add_argument("--loras", default=None, metavar="NAMES",
                   help="comma-separated LoRA adapters of the workers' (--lora-modules); "
                        "request i runs with the (i mod n)-th (default: none)")
    g.add_argument("--ack-replicas", type=int, default=0,
                   help="the worker acknowledges a finished request once this many replicas of "
                   "--redis-url hold its chunks (worker --ack-replicas; default: %(default)s)")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight; a due request waits for a "
                        "slot (vLLM's meaning; default: no cap)")
    g.add_argument("--images", type=int, default=0, metavar="PIXELS",
                   help="each request a chat with a fresh PIXELS x PIXELS JPEG before its text "
                        "prompt (a vision-language model; docs/bench/synthetic_tokenizer.py "
                        "gives a random shape a tokenizer)")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds to wait for each chunk (default: %(default)s)")
    srv.set_defaults(func=lambda args: run_bench(args, "serve"))
    plot = sub.add_parser("plot", help="one chart from several bench JSON files")
    plot.add_argument("results", nargs="+", help="JSON files written by --output-json")
    plot.add_argument("--output", required=True, help="PNG path")
    plot.add_argument("--labels", default=None, help="comma-separated, one per file")
    plot.set_defaults(func=cmd_plot)


def _workload_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, default=16, help="(default: %(default)s)")
    g.add_argument("--prompt", default="Hello", help="prompt unit (default: %(default)s)")
    g.add_argument("--prompt-repeats", default="1", help="request i repeats the unit "
                   "repeats[i %% len] times, e.g. '1,4' (default: %(default)s)")
    g.add_argument("--prompt-sep", default=" ", help="joins text repeats (default: a space)")
    g.add_argument("--pretok", action="store_true", help="send token ids, tokenized once "
                   "(automatic when the model has no tokenizer)")
    g.add_argument("--prompt-token-id", type=int, default=None,
                   help="with --pretok: the unit is this one token instead of --prompt's ids")
    g.add_argument("--dataset", choices=("repeat", "random"), default="repeat",
                   help="repeat: --prompt repeated; random: --input-len random token ids "
                        "(vLLM's random dataset) (default: %(default)s)")
    g.add_argument("--input-len", type=int, default=32,
                   help="with --dataset random: prompt tokens (default: %(default)s)")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="with --dataset random: lengths uniform in input-len * (1 +- R) "
                        "(default: %(default)s)")
    g.add_argument("--output-len", "--max-new-tokens", dest="max_new_tokens", type=int,
                   default=64, help="new tokens per request, vLLM's name; --max-new-tokens "
                   "is the same (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off (default: %(default)s)")
    g.add_argument("--ignore-eos", action="store_true", help="always make --output-len tokens")
    g.add_argument("--submit-interval-ms", type=float, default=0.0,
                   help="gap between submits; 0 = all at once (default: 0)")
    g.add_argument("--request-rate", type=float, default=None,
                   help="Poisson arrivals at this many requests per second (vLLM's meaning; "
                        "inf = all at once); replaces --submit-interval-ms")
    g.add_argument("--schedule", choices=("absolute", "relative"), default="absolute",
                   help="absolute: request i due at t0 + i*interval; relative: interval after "
                        "the previous submit (default: %(default)s)")
    r = p.add_argument_group("runs and output")
    r.add_argument("--warmup-runs", type=int, default=1, help="untimed runs first (default: 1)")
    r.add_argument("--repeat-runs", type=int, default=3, help="timed runs (default: 3)")
    r.add_argument("--compare-hf", action="store_true",
                   help="also time transformers generate on the same weights and prompts")
    r.add_argument("--hf-variants", default=",".join(VARIANTS),
                   help="dynamic (DynamicCache) and/or static (StaticCache + torch.compile) "
                        "(default: %(default)s)")
    r.add_argument("--output-json", default=None, help="write every run and the summary here")
    r.add_argument("--peak-tb-s", type=float, default=None,
                   help="memory bandwidth (TB/s, per GPU) the decode bytes floor is taken at "
                   "(default: 3.0, what the benchmarks count an H100 SXM at)")
    r.add_argument("--plot", default=None, help="write a PNG chart here (needs matplotlib)")
    r.add_argument("--label", default=None, help="name of this workload in charts")
    r.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar")
    return p


def run_bench(args, mode: str) -> int:
    from roseinfer.bench.runner import BenchRun
    # A run measures the step its engine starts with: a compiled CPU step built in the
    # background would slow the runs while it builds and speed up the ones after it
    # (core/cpu_step.py). `--cpu-compiled-step build` benches the compiled step.
    os.environ.setdefault("ROSEINFER_BACKGROUND_BUILDS", "0")
    return BenchRun(args, mode).main()


def cmd_plot(args) -> int:
    from roseinfer.bench.report import plot

    results = []
    for path in args.results:
        with open(path) as f:
            results.append(json.load(f))
    labels = args.labels.split(",") if args.labels else [
        r["meta"].get("label") or os.path.splitext(os.path.basename(p))[0]
        for r, p in zip(results, args.results)]
    if len(labels) != len(results):
        raise SystemExit(f"--labels has {len(labels)} names for {len(results)} files")
    plot(results, labels, args.output)
    print(f"chart written to {args.output}")
    return 0

