"""A workload: which prompts to send, with which parameters, on which submit schedule."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional, Union

# transformers baselines: DynamicCache, and StaticCache with torch.compile
HF_VARIANTS = ("dynamic", "static")

Prompt = Union[str, list[int]]

# Models without a tokenizer (e.g. smollm2-random) get this token repeated; its value does
# not matter for speed, only the prompt length does.
DEFAULT_FIXED_TOKEN = 1000


@dataclass
class Workload:
    prompts: list[Prompt]          # what the engine (or the Redis client) receives
    prompt_ids: list[list[int]]    # the same prompts as token ids, for transformers
    max_new_tokens: int
    ignore_eos: bool
    submit_interval_s: float = 0.0
    schedule: str = "absolute"     # "absolute": t0 + i*interval; "relative": previous + interval
    stream_interval: int = 1
    sampling: dict = field(default_factory=dict)  # temperature, top_p, top_k; empty: greedy
    request_rate: Optional[float] = None  # Poisson arrivals per second (absolute schedule)
    seed: int = 0
    output_lens: list[int] = field(default_factory=list)  # per request; empty: max_new_tokens
    max_concurrency: Optional[int] = None  # in-flight cap (serve)

    def __post_init__(self):
        self.offsets = _offsets(self.num_requests, self.submit_interval_s, self.request_rate,
                                self.seed)
        self.output_lens = self.output_lens or [self.max_new_tokens] * self.num_requests
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")

    def offset(self, i: int) -> float:
        """When request i is due on the absolute schedule, in seconds after t0."""
        return self.offsets[i]

    @property
    def temperature(self) -> float:
        return self.sampling.get("temperature", 0.0)

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    def describe(self) -> dict:
        lens = [len(p) for p in self.prompt_ids]
        return {"num_requests": self.num_requests, "max_new_tokens": self.max_new_tokens,
                "output_tokens_min": min(self.output_lens),
                "output_tokens_max": max(self.output_lens),
                "output_tokens_total": sum(self.output_lens), "ignore_eos": self.ignore_eos, "prompt_tokens_min": min(lens),
                "prompt_tokens_max": max(lens), "prompt_tokens_total": sum(lens),
                "pretokenized": bool(self.prompts) and not isinstance(self.prompts[0], str),
                "submit_interval_ms": self.submit_interval_s * 1e3, "schedule": self.schedule,
                "stream_interval": self.stream_interval, "sampling": self.sampling or "greedy",
                "request_rate": self.request_rate, "max_concurrency": self.max_concurrency}


def parse_repeats(text: str) -> list[int]:
    try:
        repeats = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        repeats = []
    if not repeats or min(repeats) < 1:
        raise ValueError(f"--prompt-repeats wants positive integers like '1,4', got {text!r}")
    return repeats


def build_prompts(n: int, text: str, repeats: list[int], tokenizer, vocab_size: int,
                  pretok: bool = False, sep: str = " ",
                  fixed_token: Optional[int] = None) -> tuple[list[Prompt], list[list[int]]]:
    """Request i gets the prompt unit repeated ``repeats[i % len(repeats)]`` times.

    Text prompts are joined with ``sep`` ("Hello Hello" is two GPT-2 tokens, "HelloHello"
    is not). Pre-tokenized prompts repeat the unit's ids; without a tokenizer the unit is
    one fixed token. Returns (prompts as sent, prompts as ids).
    """
    if tokenizer is None:
        pretok = True
    unit = _unit_ids(text, tokenizer, vocab_size, fixed_token) if pretok else None
    prompts: list[Prompt] = []
    ids: list[list[int]] = []
    for i in range(n):
        r = repeats[i % len(repeats)]
        if pretok:
            prompts.append(unit * r)
            ids.append(unit * r)
        else:
            prompt = sep.join([text] * r)
            prompts.append(prompt)
            ids.append(tokenizer.encode(prompt))
    return prompts, ids


def _unit_ids(text: str, tokenizer, vocab_size: int, fixed_token: Optional[int]) -> list[int]:
    if fixed_token is not None or tokenizer is None:
        token = DEFAULT_FIXED_TOKEN % vocab_size if fixed_token is None else fixed_token
        if not 0 <= token < vocab_size:
            raise ValueError(f"--prompt-token-id {token} is outside the vocabulary "
                             f"[0, {vocab_size})")
        return [token]
    unit = tokenizer.encode(text, add_special_tokens=False)
    if not unit:
        raise ValueError(f"prompt {text!r} tokenizes to nothing")
    return unit


def random_prompts(n: int, input_len: int, range_ratio: float, vocab_size: int,
                   seed: int = 0) -> list[list[int]]:
    """vLLM's random dataset: ids uniform over the vocabulary, lengths uniform in
    [input_len * (1 - range_ratio), input_len * (1 + range_ratio)], at least 1. Random
    ids share no prefix, so the prefix cache saves no prefill."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(k)]
            for k in random_lengths(n, input_len, range_ratio, rng)]


def random_lengths(n: int, length: int, range_ratio: float, rng: random.Random) -> list[int]:
    """``n`` lengths uniform in [length * (1 - range_ratio), length * (1 + range_ratio)],
    at least 1 (vLLM's random dataset, for prompts and outputs alike)."""
    if length < 1 or not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"lengths must be >= 1 and --range-ratio in [0, 1); "
                         f"got {length} and {range_ratio}")
    lo, hi = max(1, round(length * (1 - range_ratio))), round(length * (1 + range_ratio))
    return [rng.randint(lo, hi) for _ in range(n)]


def sampling_of(temperature: float, top_p: float, top_k: int) -> dict:
    """The workload's sampling parameters; greedy (temperature 0) needs none."""
    if temperature == 0.0:
        return {}
    return {"temperature": temperature, "top_p": top_p, "top_k": top_k}


def _offsets(n: int, interval_s: float, rate: Optional[float], seed: int) -> list[float]:
    """Due times after t0: every interval_s, or Poisson arrivals at ``rate`` per second
    (vLLM's --request-rate: exponential gaps; inf = all at once)."""
    if rate is None:
        return [i * interval_s for i in range(n)]
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf = all at once), got {rate}")
    if rate == float("inf"):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out
