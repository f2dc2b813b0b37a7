"""A request as the engine's sequences: its ids checked against the vocabulary and the
context, and each sample given what it carries through its life (its seed's generator,
its constraints, its detokenizer), a resumed request's emitted tokens taken as context."""
from __future__ import annotations

import time
from typing import Optional, Union

import torch

from roseinfer.core.detokenizer import IncrementalDetokenizer
from roseinfer.core.errors import InvalidRequestError
from roseinfer.core.processors import catch_up
from roseinfer.core.request import Sequence
from roseinfer.core.sampling import SamplingParams

Prompt = Union[str, list[int]]


class Intake:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, device: torch.device,
                 processors):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.device, self.processors = device, processors

    def prompt_ids(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """The prompt's ids; ``params``' logit bias checked against the vocabulary too."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", "this model has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = self.token_ids(prompt, "prompt_token_ids")
        if not ids:
            raise InvalidRequestError("prompt", "the prompt is empty")
        too_big = [t for t in params.logit_bias if t >= self.vocab_size]
        if too_big:
            raise InvalidRequestError("logit_bias", f"token ids must be below the vocabulary "
                                      f"size {self.vocab_size}; got {too_big[:5]}")
        return ids

    def token_ids(self, ids, field: str) -> list[int]:
        ids = list(ids)
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)
               or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                field, f"ids must be integers in [0, {self.vocab_size}); got {bad[:5]}")
        return ids

    def sequence(self, request_id: str, index: int, ids: list[int], params: SamplingParams,
                 emitted_ids, emitted_text, lora: Optional[str] = None) -> Sequence:
        emitted = self.token_ids(emitted_ids or [], "emitted_ids")
        if len(emitted) >= params.max_tokens:
            raise InvalidRequestError("emitted_ids", "the request already has all its tokens")
        if len(ids) + len(emitted) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"{len(ids)} tokens leave no room to generate within the "
                f"model's {self.max_model_len}-token context; shorten the prompt", "too_long")
        gen = None  # on CUDA the seed keys the sampler's noise instead (sample_kernel)
        if params.seed is not None and self.device.type != "cuda":
            gen = torch.Generator(self.device).manual_seed(params.seed)
        max_len = min(self.max_model_len, len(ids) + params.max_tokens)
        seq = Sequence(request_id, ids, params, max_len, time.monotonic(), gen, lora)
        seq.index = index
        seq.key = request_id if params.n == 1 else f"{request_id}#{index}"
        if params.constrained:
            seq.constraints = self.processors.start(params, ids)
        seq.token_ids += emitted
        seq.num_emitted = len(emitted)
        if seq.constraints:
            catch_up(seq)
        if self.tokenizer is not None:
            seq.detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop)
            if emitted:  # decode them as their first owner did, then skip what it released
                seq.detok.add(emitted)
                seq.detok.released = len(seq.detok.text if emitted_text is None else emitted_text)
        return seq
