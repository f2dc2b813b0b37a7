"""A smaller model with the same vocabulary drafts k tokens a round, greedily.

It runs in an engine of its own (its own paged KV cache and prefix cache) on the
target's device: each round a sequence's tokens so far go in as a request, the
prefix cache keeps what earlier rounds computed, and the draft decodes up to k
tokens. Greedy drafts are deterministic proposals, which the target's rejection
rule checks exactly (core/speculation.py)."""
from __future__ import annotations

from roseinfer.core.errors import ConfigError, InvalidRequestError
from roseinfer.core.sampling import SamplingParams
from roseinfer.core.speculation import Draft


class DraftModel:
    def __init__(self, ctx):
        from roseinfer.core.engine import Engine

        cfg = ctx.config
        if cfg.draft_model is None:
            raise ConfigError("speculative draft needs draft_model: a smaller model with "
                              "the target's vocabulary (--draft-model NAME)")
        batch = cfg.speculative_disable_by_batch_size
        # On a GPU its cache holds the drafting sequences whole: the target took its
        # share of the memory first (gpu_memory_utilization), and this comes out of the
        # rest. On the CPU it takes its share of what is available, as any engine.
        blocks = batch * (-(-(ctx.max_model_len + ctx.k) // cfg.block_size) + 1) \
            if ctx.device.type == "cuda" else None
        self.engine = Engine(cfg.draft_model, config=cfg.replace(
            speculative=None, draft_model=None, tensor_parallel_size=1, quantization=None,
            device=str(ctx.device), cpu_compiled_step="off", cpu_weight_dtype="auto",
            max_num_seqs=batch, num_kv_blocks=blocks), plugins=ctx.plugins)
        if self.engine.vocab_size != ctx.vocab_size:
            raise ConfigError(f"the draft model's vocabulary ({self.engine.vocab_size} ids) "
                              f"is not the target's ({ctx.vocab_size}); pick a draft "
                              f"model of the same family")

    def propose(self, token_ids: list[list[int]], room: list[int]) -> list:
        engine, drafts = self.engine, {}
        for i, (ids, n) in enumerate(zip(token_ids, room)):
            try:
                engine.add_request(f"draft-{i}", ids, SamplingParams(
                    max_tokens=n, temperature=0, ignore_eos=True))
                drafts[f"draft-{i}"] = []
            except InvalidRequestError:  # past the draft model's context: no draft
                pass
        while engine.has_unfinished():
            for out in engine.step():
                drafts[out.request_id] += out.new_token_ids
        return [Draft(drafts[f"draft-{i}"]) if drafts.get(f"draft-{i}") else None
                for i in range(len(token_ids))]
