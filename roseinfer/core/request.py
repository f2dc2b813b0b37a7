"""Per-request sequence state."""
from __future__ import annotations

import enum
from typing import Optional

import torch

from roseinfer.core.blocks import root_hash
from roseinfer.core.sample_kernel import words
from roseinfer.core.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    __slots__ = ("request_id", "params", "token_ids", "num_prompt_tokens", "num_computed",
                 "block_table", "group_tables", "block_hashes", "status", "finish_reason",
                 "generator", "detok", "num_emitted", "arrival_time", "max_len", "pending",
                 "sample_slot",
                 "row", "synced", "sample_words", "logprobs", "prompt_logprobs",
                 "constraints", "num_accepted", "index", "key", "error", "draft", "spec",
                 "num_cached_tokens", "lora", "lora_slot", "hash_root", "images")

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 max_len: int, arrival_time: float, generator: Optional[torch.Generator] = None,
                 lora: Optional[str] = None):
        self.request_id = request_id
        self.index = 0                 # of the request's n samples
        self.key = request_id          # in Engine.seqs: request_id#index when n > 1
        self.params = params
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.num_computed = 0          # tokens whose K/V are in the cache
        self.num_cached_tokens: Optional[int] = None  # prompt tokens the prefix cache held
        self.block_table: list[int] = []
        self.group_tables: list[list[int]] = []  # KV groups 1.. (core/kv_groups.py)
        self.block_hashes: list[int] = []
        self.status = Status.WAITING
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None  # with finish_reason "error": what failed
        self.generator = generator
        self.detok = None
        self.num_emitted = 0           # generated ids already handed out
        self.arrival_time = arrival_time
        self.max_len = max_len         # prompt + generated may not pass this
        # Sampled on the device, not yet seen by the host (the step in flight);
        # the next step reads it from row ``sample_slot`` of the sampled buffer.
        self.pending = 0
        self.sample_slot = -1
        self.row = -1                  # device block-table row while it holds blocks
        self.synced = 0                # entries of block_table already on the device
        self.sample_words = words(params)  # written after the table entries when it gets a row
        # One TokenLogprob per id generated here (not for resumed ids), if asked for.
        self.logprobs: Optional[list] = [] if params.logprobs is not None else None
        # One per prompt token, if asked for: None for the first (nothing predicts
        # it), then a TokenLogprob per token, filled in as its chunk is computed.
        self.prompt_logprobs: Optional[list] = \
            [None] if params.prompt_logprobs is not None else None
        # (logits processor, its state for this sequence) pairs (core/processors.py).
        self.constraints: list = []
        self.num_accepted = 0          # generated ids the constraints' states have seen
        # Tokens proposed for this step to check (core/speculation.py), and the record
        # of its drafts so far (None until it drafts).
        self.draft = None
        self.spec = None
        self.lora = lora               # the adapter's name (core/lora.py), None: the base model
        self.lora_slot = -1            # its adapter's slot while running
        self.hash_root = root_hash(lora)  # its blocks' hashes chain from here (core/blocks.py)
        self.images = None             # its prompt's images (core/multimodal.py)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Length counting the token in flight: what the scheduler plans with."""
        return len(self.token_ids) + self.pending

    @property
    def prompt_logprobs_due(self) -> bool:
        """Whether prompt log probabilities are asked for and not all computed yet."""
        plp = self.prompt_logprobs
        return plp is not None and len(plp) < self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
