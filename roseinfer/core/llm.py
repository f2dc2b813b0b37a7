"""LLM: the offline facade over Engine."""
from __future__ import annotations

from typing import Iterable, Union

from roseinfer.core.config import EngineConfig, config_from_args
from roseinfer.core.engine import Engine, Prompt
from roseinfer.core.outputs import RequestOutput
from roseinfer.core.sampling import SamplingParams


class LLM:
    def __init__(self, model, tokenizer=None, plugins=None, **config):
        self.engine = Engine(model, tokenizer, EngineConfig.from_kwargs(**config), plugins)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Release the model, its KV cache and GPU memory, and stop the other ranks of a
        tensor-parallel group; a new LLM can be made in this process after."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: list[Prompt],
                 params: Union[SamplingParams, list[SamplingParams], None] = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. A prompt whose
        params ask for n > 1 samples gets the list of its n outputs, by index."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("prompts must be a list: [\"text\", ...] or [[ids], ...]")
        params = params or SamplingParams()
        per = params if isinstance(params, list) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"{len(per)} SamplingParams for {len(prompts)} prompts")
        ids = [f"gen-{i}" for i in range(len(prompts))]
        try:
            for rid, prompt, p in zip(ids, prompts, per):
                self.engine.add_request(rid, prompt, p)
        except BaseException:  # a refused prompt: the ones added before it leave too
            for rid in ids:
                self.engine.abort(rid)
            while self.engine.has_unfinished():
                self.engine.step()
            raise
        final: dict[tuple[str, int], RequestOutput] = {}
        for out in self._drive(sum(p.n for p in per), use_tqdm):
            final[out.request_id, out.index] = out
        return [final[rid, 0] if p.n == 1 else [final[rid, i] for i in range(p.n)]
                for rid, p in zip(ids, per)]

    def _drive(self, total: int, use_tqdm: bool) -> Iterable[RequestOutput]:
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=total, desc="samples", unit="sample")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    if bar is not None:
                        bar.update()
                    yield out
        if bar is not None:
            bar.close()


def llm_from_args(args) -> LLM:
    """An LLM from the flags of ``roseinfer.core.config.engine_args_parser``."""
    import dataclasses

    config = config_from_args(args)
    return LLM(args.model, tokenizer=args.tokenizer, **dataclasses.asdict(config))
