"""Structured output on xgrammar: a request's ``response_format`` as a mask of
the tokens its grammar allows next, filled on the host each step (xgrammar
took 5-9 us a token to llguidance's 34-36 on the same schema:
docs/bench/grammar_libs.py) and applied to the logits on their device."""
from __future__ import annotations

import json

import torch

from roseinfer.core.hookspecs import hookimpl

CACHE_BYTES = 256 << 20


@hookimpl
def roseinfer_register_logits_processors(register):
    register("xgrammar", XGrammarOutput)


class XGrammarOutput:
    def __init__(self, ctx):
        import xgrammar as xgr

        self.xgr, self.ctx = xgr, ctx
        self.compiler = None
        if ctx.tokenizer is not None:
            # xgrammar reads a transformers tokenizer: a JsonTokenizer loads its own here.
            hf = getattr(ctx.tokenizer, "hf", ctx.tokenizer)
            info = xgr.TokenizerInfo.from_huggingface(
                hf, vocab_size=ctx.vocab_size, stop_token_ids=sorted(ctx.eos_ids))
            # It caches compiled grammars (least recently used out past the limit):
            # prepare() compiles, start() finds it there.
            self.compiler = xgr.GrammarCompiler(info, cache_limit_bytes=CACHE_BYTES)
        self.mask = None  # host bitmask, one row per logits row, grown as batches grow
        # Past its grammar's end (a request that ignores EOS goes on) a row may
        # only repeat a stop token: the text stays what the grammar matched.
        self.stop_only = xgr.allocate_token_bitmask(1, ctx.vocab_size)[0].zero_()
        for t in ctx.eos_ids:
            self.stop_only[t // 32] |= 1 << (t % 32)

    def prepare(self, response_format: dict) -> None:
        self._compile(response_format)

    def start(self, response_format: dict, prompt_ids) -> "GrammarState":
        return GrammarState(self.xgr.GrammarMatcher(self._compile(response_format)))

    def _compile(self, fmt: dict):
        if self.compiler is None:
            raise ValueError("this model has no tokenizer, which structured output needs")
        kind = fmt["type"]
        try:
            if kind == "json_schema":
                # Compact JSON: with free whitespace a model can pad forever.
                return self.compiler.compile_json_schema(
                    json.dumps(fmt["json_schema"]["schema"]), any_whitespace=False)
            if kind == "json_object":
                return self.compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False)
            return self.compiler.compile_regex(fmt["pattern"])
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"cannot compile its {kind}: {str(e)[:300]}") from None

    def apply(self, logits: torch.Tensor, rows: list[int], states) -> None:
        mask = self._host_mask(logits.shape[0])
        for row, state in zip(rows, states):
            if state.matcher.is_terminated():
                mask[row] = self.stop_only
            else:
                state.matcher.fill_next_token_bitmask(mask, row)
        # Pinned: the copy does not wait for the step queued before it. The
        # buffer is reused once the engine has seen this step's tokens.
        device_mask = mask.to(logits.device, non_blocking=True)
        self.xgr.apply_token_bitmask_inplace(logits, device_mask, indices=rows)

    def _host_mask(self, num_rows: int) -> torch.Tensor:
        if self.mask is None or self.mask.shape[0] < num_rows:
            mask = self.xgr.allocate_token_bitmask(num_rows, self.ctx.vocab_size)
            self.mask = mask.pin_memory() if self.ctx.device.type == "cuda" else mask
        return self.mask[:num_rows]


class GrammarState:
    __slots__ = ("matcher",)

    def __init__(self, matcher):
        self.matcher = matcher

    def accept(self, token_ids: list[int]) -> None:
        for t in token_ids:
            # Refused only past the grammar's end (a stop token of the request's
            # own, which ends it): nothing follows that the mask would need.
            if not self.matcher.accept_token(t):
                return
