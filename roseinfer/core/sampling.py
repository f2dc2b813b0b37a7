"""SamplingParams: what a request asks of the sampler, validated."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from roseinfer.core.errors import InvalidRequestError

MAX_LOGPROBS = 20       # OpenAI's top_logprobs limit
MAX_LOGIT_BIAS = 300    # OpenAI's limit on logit_bias entries
MAX_N = 16
# Temperatures below this sample as greedy (vLLM's rule): 1/T would overflow float32
# logits long before T reaches zero. Above MAX_TEMPERATURE every kept token is as good
# as uniform; larger values are refused rather than packed past float32.
GREEDY_BELOW = 1e-5
MAX_TEMPERATURE = 1e4
# top_k at or past the vocabulary keeps every token; past this it is stored as this,
# which means the same and fits the step's int32 rows.
MAX_TOP_K = (1 << 31) - 1


@dataclass
class SamplingParams:
    # Independent samples of the prompt, computed once for all of them; with a
    # seed, sample i draws with seed + i.
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Log probabilities of each generated token and of the top `logprobs`
    # alternatives (0-20; None = off), from the distribution it was sampled
    # from: after the bias, the penalties and the temperature, before top-k,
    # top-p and min-p (core/logits.py).
    logprobs: Optional[int] = None
    # Log probabilities of each prompt token after the first, and of the top
    # `prompt_logprobs` alternatives at its position (0-20; None = off), from
    # the model's raw logits (vLLM's meaning). The prompt is then computed
    # whole: no prefix-cache hit skips any of it.
    prompt_logprobs: Optional[int] = None
    repetition_penalty: float = 1.0   # transformers' meaning: > 1 discourages repeats
    frequency_penalty: float = 0.0    # OpenAI's meanings: subtracted per occurrence
    presence_penalty: float = 0.0     # ... and once per token that occurred
    logit_bias: dict[int, float] = field(default_factory=dict)
    # The output's shape, enforced token by token: {"type": "json_schema",
    # "json_schema": {"name": ..., "schema": {...}}} (OpenAI's form),
    # {"type": "json_object"}, {"type": "regex", "pattern": "..."}, or
    # {"type": "text"} (= None: free text).
    response_format: Optional[dict] = None
    # Logits-processor plugins by name, each with its arguments (core/processors.py).
    logits_processors: dict[str, Any] = field(default_factory=dict)
    # False: no drafts for this request where the engine speculates (core/speculation.py).
    speculative: bool = True
    # Lower runs first (vLLM's meaning): the waiting queue is ordered by it, then by
    # arrival, and under KV pressure the lowest-priority running sequence is preempted.
    priority: int = 0
    # A reasoning model's request (core/reasoning.py): response_format constrains only
    # its answer, after it has thought. Set by frontends from their reasoning parser.
    answer_gate: Optional[Any] = None  # reasoning.AnswerGate

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        self.top_k = min(self.top_k, MAX_TOP_K)
        if self.response_format == {"type": "text"}:
            self.response_format = None

    def validate(self) -> None:
        def bad(name, why):
            raise InvalidRequestError(name, why)

        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            bad("temperature", f"must be a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy), "
                f"got {self.temperature!r}")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            bad("top_k", f"must be an integer >= 0 (0 = off; the vocabulary or more keeps "
                f"every token), got {self.top_k!r}")
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not (is_int(self.seed) and -2**63 <= self.seed < 2**64):
            bad("seed", f"must be a 64-bit integer or None, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if not (isinstance(self.stop_token_ids, (list, tuple))
                and all(is_int(t) and t >= 0 for t in self.stop_token_ids)):
            bad("stop_token_ids", "must be a list of token ids (integers >= 0)")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", f"must be true or false, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not (is_int(v) and 0 <= v <= MAX_LOGPROBS):
                bad(name, f"must be an integer in [0, {MAX_LOGPROBS}] or None, got {v!r}")
        if not is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 10:
            bad("repetition_penalty", f"must be in (0, 10] (1 = off), got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not is_number(v) or not -2 <= v <= 2:
                bad(name, f"must be in [-2, 2] (0 = off), got {v!r}")
        if not isinstance(self.speculative, bool):
            bad("speculative", f"must be true or false, got {self.speculative!r}")
        if not (is_int(self.priority) and -2**31 <= self.priority < 2**31):
            bad("priority", f"must be a 32-bit integer (lower runs first), got {self.priority!r}")
        self._validate_bias()
        _validate_format(self.response_format)
        procs = self.logits_processors
        if not (isinstance(procs, dict) and all(isinstance(k, str) and k for k in procs)):
            bad("logits_processors", "must be a map of plugin names to their arguments")

    def _validate_bias(self) -> None:
        bias = self.logit_bias
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                "logit_bias", f"must be a map of at most {MAX_LOGIT_BIAS} token ids to biases")
        for token, b in bias.items():
            if not (is_int(token) and token >= 0 and is_number(b) and -100 <= b <= 100):
                raise InvalidRequestError(
                    "logit_bias", f"maps token ids (integers >= 0) to numbers in [-100, 100]; "
                    f"got {str(token)[:20]!r}: {str(b)[:20]!r}")

    @property
    def penalized(self) -> bool:
        """Whether the logits need work before sampling (core/logits.py)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0 or bool(self.logit_bias))

    @property
    def constrained(self) -> bool:
        """Whether logits processors work on its logits (core/processors.py)."""
        return self.response_format is not None or bool(self.logits_processors)

    @property
    def processed(self) -> bool:
        """Whether its steps go through core/logits.py (not inside a CUDA graph)."""
        return (self.penalized or self.constrained or self.logprobs is not None
                or self.prompt_logprobs is not None)

    def sample(self, index: int) -> "SamplingParams":
        """The params of sample ``index`` of n: its own seed, if there is one; the
        prompt's log probabilities come with sample 0 only."""
        if index == 0:
            return self
        seed = None if self.seed is None else (self.seed + index + 2**63) % 2**64 - 2**63
        return replace(self, seed=seed, prompt_logprobs=None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


FORMAT_TYPES = ("text", "json_object", "json_schema", "regex")


def _validate_format(fmt) -> None:
    """The shape of a response_format; whether its schema or pattern compiles is
    the structured-output processor's to say."""
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in FORMAT_TYPES:
        raise InvalidRequestError("response_format", "must be a map whose type is one of "
                                  f"{', '.join(FORMAT_TYPES)}; got {str(fmt)[:60]!r}")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not (isinstance(spec, dict) and isinstance(spec.get("schema"), dict)):
            raise InvalidRequestError("response_format", 'json_schema must be a map holding '
                                      'the schema under "schema", as OpenAI\'s API has it')
    if kind == "regex" and not (isinstance(fmt.get("pattern"), str) and fmt["pattern"]):
        raise InvalidRequestError("response_format", "regex needs a non-empty pattern")


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    """A finite number: NaN and infinities are refused by name, never sampled with."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

