"""xgrammar against llguidance on the host work structured output adds per step.

For each library and tokenizer: the time to set up the tokenizer, to compile
a JSON schema, and per generated token the time to fill the next-token mask
and to accept the token, walking a matcher along a valid JSON answer.
Usage: PYTHONPATH=. python3 docs/bench/grammar_libs.py
"""
import json
import statistics
import time

import torch

from roseinfer.models import loader

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "population": {"type": "integer"},
    "landmarks": {"type": "array", "items": {"type": "string"}},
    "capital": {"type": "boolean"}},
    "required": ["city", "population", "landmarks", "capital"]}
ANSWER = json.dumps({"city": "Paris", "population": 2148000,
                     "landmarks": ["Eiffel Tower", "Louvre", "Notre-Dame de Paris"],
                     "capital": True})


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def walk(fill, accept, ids):
    fills, accepts = [], []
    for t in ids:
        fills.append(timed(fill)[1])
        ok, took = timed(lambda: accept(t))
        assert ok is not False, f"token {t} refused"
        accepts.append(took)
    return statistics.median(fills) * 1e6, statistics.median(accepts) * 1e6


def xgrammar(tok, vocab):
    import xgrammar as xgr
    info, setup = timed(lambda: xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab))
    compiler = xgr.GrammarCompiler(info)
    grammar, compile_s = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    matcher = xgr.GrammarMatcher(grammar)
    mask = xgr.allocate_token_bitmask(1, vocab)
    return setup, compile_s, walk(lambda: matcher.fill_next_token_bitmask(mask),
                                  matcher.accept_token, tok.encode(ANSWER))


def llguidance(tok, vocab):
    import llguidance as llg
    import llguidance.hf
    import llguidance.torch
    lltok, setup = timed(lambda: llguidance.hf.from_tokenizer(tok, n_vocab=vocab))
    text = llg.grammar_from("json_schema", json.dumps(SCHEMA))
    matcher, compile_s = timed(lambda: llg.LLMatcher(lltok, text))
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)
    return setup, compile_s, walk(
        lambda: llguidance.torch.fill_next_token_bitmask(matcher, mask, 0),
        matcher.consume_token, tok.encode(ANSWER))


def main():
    torch.set_num_threads(1)
    for model in ("gpt2-random", "SmolLM2-135M-Instruct"):
        hf, tok = loader.model_info(model)
        vocab = hf.vocab_size
        for name, fn in (("xgrammar", xgrammar), ("llguidance", llguidance)):
            setup, compile_s, (fill_us, accept_us) = fn(tok, vocab)
            print(f"{model:22} {name:11} tokenizer {setup * 1e3:7.1f} ms  compile "
                  f"{compile_s * 1e3:7.1f} ms  mask {fill_us:6.1f} us/token  "
                  f"accept {accept_us:5.1f} us/token")


if __name__ == "__main__":
    main()
