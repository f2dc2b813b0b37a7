"""roseinfer command line: generate | plugins | serve | worker | submit | status | gateway | bench."""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from roseinfer.core.config import engine_args_parser

# Command groups living outside core, each exposing add_commands(subparsers, engine_parent).
COMMAND_MODULES = ("roseinfer.frontends.redis_streams.commands",
                   "roseinfer.frontends.openai.commands", "roseinfer.bench.commands")


def cmd_generate(args) -> int:
    from roseinfer import SamplingParams

    from roseinfer.core.llm import llm_from_args

    llm = llm_from_args(args)
    prompt = args.prompt if args.raw else llm.engine.chat_prompt(args.prompt)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed_sample)
    engine = llm.engine
    engine.add_request("cli", prompt, params, lora=args.lora)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_plugins(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from roseinfer.core.plugins import KINDS, default_registry

    reg = default_registry()
    table = Table("kind", "name", "origin")
    for kind in KINDS:
        for r in reg.registrations(kind).values():
            table.add_row(kind, r.name, r.origin)
    Console().print(table)
    return 0


def build_parser() -> argparse.ArgumentParser:
    engine = engine_args_parser()
    parser = argparse.ArgumentParser(prog="roseinfer", description=__doc__)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v info, -vv debug")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", parents=[engine], help="generate text for one prompt")
    g.add_argument("prompt")
    g.add_argument("--lora", default=None, metavar="NAME",
                   help="run with this adapter of --lora-modules (default: the base model)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed-sample", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.set_defaults(func=cmd_generate)
    sub.add_parser("plugins", help="list registered plugins").set_defaults(func=cmd_plugins)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        module.add_commands(sub, engine)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


def run() -> None:
    """Console entry point. Triton's native bindings print leak reports while
    the interpreter tears down; the command has cleaned up by now, so skip that."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
