"""The pooling runner: models that embed, score or classify instead of generating.

A request's inputs are tokenized and checked first (``prepare``: on a worker's reader
thread), with the model's prompt for embeddings and as pairs for a cross-encoder. Each
``step`` packs the queued requests' inputs, in priority order and longest first, into a
batch of at most ``max_num_batched_tokens`` tokens without padding, runs the model once
and pools it (core/pooling.py); a request ends in the step that runs its last input.
There is no KV cache. ``add_request``, ``step``, ``abort`` and ``stats`` are the
generate engine's, so a Redis worker serves either."""
from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass, field
import torch

from roseinfer.core.config import EngineConfig
from roseinfer.core.device_side import resolve_device, resolve_dtype
from roseinfer.core.engine import EngineStats
from roseinfer.core.errors import InvalidRequestError
from roseinfer.core.plugins import default_registry
from roseinfer.core.pooling import PoolingOutput, Prepared, activate, finish, pool, spec_of
from roseinfer.core.pooling_decoder import decoder_states
from roseinfer.core.pooling_graphs import EncoderGraphs
from roseinfer.core.pooling_inputs import InputRules
from roseinfer.core.pooling_task import PoolingTask
from roseinfer.core.token_classifier import token_classifier
from roseinfer.layers.encoder_attention import Packed
from roseinfer.models import loader

TASKS = ("embed", "score", "classify")
TRUNCATE = (None, "right", "left")


@dataclass
class _Queued:
    rid: str
    prepared: Prepared
    priority: int
    arrival: int
    next: int = 0                                    # of prepared.order
    rows: dict = field(default_factory=dict)         # input index -> its row


class PoolingEngine:
    step_kind = "pool"

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None,
                 plugins=None):
        self.config = config = config or EngineConfig()
        self.plugins = plugins or default_registry()
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        model = _local(model)
        self.model, self.hf_config, _ = loader.load(
            model, None, self.dtype, self.device, seed=config.seed or 0, plugins=self.plugins)
        # A decoder family (Qwen3-Embedding) runs causally over the packed sequences
        # (core/pooling_decoder.py); an encoder (BERT) is made for this.
        self.decoder = not getattr(self.model, "pooling_only", False)
        path = tokenizer or (model if isinstance(model, (str, os.PathLike)) else None)
        self.tokenizer = _tokenizer(path)
        self.spec = spec_of(model, self.hf_config, decoder=self.decoder)
        names = getattr(self.hf_config, "id2label", None) or {}
        labels = [names.get(i, f"LABEL_{i}") for i in range(self.hf_config.num_labels)]
        if config.classifier_from_token:
            self.model.score, labels = token_classifier(
                self.model, self.hf_config, self.tokenizer, config.classifier_from_token)
            self.spec = dataclasses.replace(
                self.spec, activation="sigmoid" if len(labels) == 1 else None)
        limits = [self.hf_config.max_position_embeddings - getattr(
            self.model, "position_offset", 0), self.spec.max_len, config.max_model_len]
        self.max_model_len = min(n for n in limits if n)
        self.classifier = getattr(self.model, "score" if self.decoder else "head",
                                  None) is not None
        self.rules = InputRules(self.max_model_len, self.hf_config.vocab_size,
                                getattr(self.hf_config, "type_vocab_size", 1) > 1)
        self.labels = labels if self.classifier else None
        self.tasks = ("embed", "score", "classify") if self.classifier else ("embed", "score")
        self.loras = None
        self._graphs = None
        if config.cuda_graphs and self.device.type == "cuda" and not self.decoder:
            with torch.inference_mode():
                self._graphs = EncoderGraphs(self.model, self.device,
                                             config.max_num_batched_tokens)
        self._queue: list[_Queued] = []
        self._aborted: list[str] = []
        self._arrivals = itertools.count()

    def close(self) -> None:
        self.model = None

    # ---- the generate engine's interface, as a worker drives it ------------------------
    def add_request(self, rid: str, prompt, params=None, **_) -> None:
        """``prompt``: a ``prepare``d task, or token ids (embedded as one input: the
        worker's health probe sends those)."""
        prepared = prompt if isinstance(prompt, Prepared) else self.prepare(
            PoolingTask("embed", [list(prompt)]))
        priority = getattr(params, "priority", 0)
        self._queue.append(_Queued(rid, prepared, priority, next(self._arrivals)))
        self._queue.sort(key=lambda q: (q.priority, q.arrival))

    def abort(self, rid: str) -> None:
        if any(q.rid == rid for q in self._queue):
            self._queue = [q for q in self._queue if q.rid != rid]
            self._aborted.append(rid)

    def has_unfinished(self) -> bool:
        return bool(self._queue or self._aborted)

    def num_unfinished(self) -> int:
        return len(self._queue)

    def stats(self) -> EngineStats:
        started = sum(q.next > 0 for q in self._queue)
        return EngineStats(started, len(self._queue) - started, 0.0, 0)

    @torch.inference_mode()
    def step(self, max_tokens: int | None = None) -> list[PoolingOutput]:
        """A batch of the queued inputs (of at most ``max_tokens`` tokens, one input at
        least; default the config's budget) through the model; the requests it ends."""
        outputs = [PoolingOutput(rid, "abort") for rid in self._aborted]
        self._aborted = []
        batch = self._take_batch(max_tokens)
        if batch:
            self._run(batch)
        for q in [q for q in self._queue if len(q.rows) == len(q.prepared.items)]:
            self._queue.remove(q)
            p = q.prepared
            labels = self.labels if p.task.task == "classify" else None
            outputs.append(PoolingOutput(q.rid, "stop", p.task, self._result(q),
                                         [len(ids) for ids, _ in p.items], labels))
        return outputs

    # ---- inputs --------------------------------------------------------------------------
    def prepare(self, task: PoolingTask, tokenizer=None) -> Prepared:
        """The task tokenized (by ``tokenizer``, a copy for another thread, else the
        engine's) and checked; raises InvalidRequestError naming the field at fault."""
        if task.task not in TASKS:
            raise InvalidRequestError("task", f"must be one of {', '.join(TASKS)} on this "
                                      f"worker, whose model pools; got {task.task!r}")
        if task.truncate not in TRUNCATE:
            raise InvalidRequestError("truncate", f"must be left, right or unset, got "
                                      f"{task.truncate!r}")
        if not task.inputs:
            raise InvalidRequestError("documents" if task.task == "score" else "input",
                                      "is empty: give at least one")
        tok = tokenizer or self.tokenizer
        logits = task.task == "classify" or (task.task == "score" and self.classifier)
        if task.task == "classify" and not self.classifier:
            raise InvalidRequestError("task", "this model has no classification head: use embed")
        field_name = "documents" if task.task == "score" else "input"
        if task.task == "score" and self.classifier:
            if not isinstance(task.query, str) or not task.query:
                raise InvalidRequestError("query", "a cross-encoder scores text pairs: give a "
                                          "non-empty string")
            items = self.rules.encode(tok, task.inputs, field_name, task.truncate,
                                      query=task.query)
        else:
            self.spec.check_dimensions(task.dimensions, self.hf_config.hidden_size)
            prompt = self.spec.prompt(task.prompt_name)
            items = self.rules.encode(tok, task.inputs, field_name, task.truncate, prompt)
            if task.task == "score":  # an embedder's: the query embedded first
                items = self.rules.encode(tok, [task.query], "query", task.truncate,
                                          prompt) + items
        order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))
        return Prepared(task, items, order, logits)

    # ---- batches ---------------------------------------------------------------------
    def _take_batch(self, max_tokens: int | None) -> list[tuple[_Queued, int]]:
        """(request, input index) pairs of the next batch: queued inputs in order until
        the token budget."""
        budget = max_tokens or max(self.config.max_num_batched_tokens, self.max_model_len)
        batch, tokens = [], 0
        for q in self._queue:
            order, items = q.prepared.order, q.prepared.items
            while q.next < len(order):
                size = len(items[order[q.next]][0])
                if batch and tokens + size > budget:
                    return batch
                batch.append((q, order[q.next]))
                tokens += size
                q.next += 1
        return batch

    def _classify(self, hidden: torch.Tensor, packed: Packed) -> torch.Tensor:
        """Logits [B, labels]: an encoder's head, or a decoder's ``score`` of its last
        token (transformers' ``*ForSequenceClassification``)."""
        if self.decoder:
            return self.model.score(hidden[packed.ends])
        return self.model.classify(hidden, packed)

    def _run(self, batch: list[tuple[_Queued, int]]) -> None:
        encoded = [q.prepared.items[i] for q, i in batch]
        lens = [len(ids) for ids, _ in encoded]
        types = None
        if any(t is not None for _, t in encoded):
            types = [x for ids, t in encoded for x in (t or [0] * len(ids))]
        packed = Packed.of(lens, types, self.device)
        ids = torch.tensor([x for ids, _ in encoded for x in ids], device=self.device)
        hidden = None if self._graphs is None else self._graphs.forward(ids, packed)
        if hidden is None:
            hidden = decoder_states(self.model, ids, packed) if self.decoder else \
                self.model(ids, packed)
        vectors = pool(hidden, packed, self.spec.mode).cpu()
        logits = self._classify(hidden, packed).float().cpu() if any(
            q.prepared.logits for q, _ in batch) else None
        for row, (q, i) in enumerate(batch):
            q.rows[i] = (logits if q.prepared.logits else vectors)[row]

    def _result(self, q: _Queued):
        p, task = q.prepared, q.prepared.task
        rows = torch.stack([q.rows[i] for i in range(len(p.items))])
        if task.task == "classify":
            return [_probs(r).tolist() for r in rows]
        if task.task == "score" and p.logits:
            return activate(rows[:, 0], self.spec.activation).tolist()
        normalize = self.spec.normalize if task.normalize is None else task.normalize
        if task.task == "score":  # an embedder's: the cosine of each document to the query
            unit = finish(rows, True, None)
            return (unit[1:] @ unit[0]).tolist()
        return finish(rows, normalize, task.dimensions)


def pooling_runner(model, runner: str, plugins=None, classifier_from_token=None) -> bool:
    """Whether ``model`` runs in the pooling runner: asked for, or (``auto``) a family
    that only pools, or a language model scored by its tokens (``classifier_from_token``)."""
    if runner != "auto" or classifier_from_token:
        return runner != "generate"
    if _hub_id(model):
        from huggingface_hub import file_exists
        if file_exists(model, "modules.json"):
            return True  # a sentence-transformers model: an embedder, whatever its family
    elif isinstance(model, (str, os.PathLike)) and os.path.exists(
            os.path.join(model, "modules.json")):
        return True
    from roseinfer.models import model_class
    from roseinfer.models.bert import classifies, headless
    config = model.config if hasattr(model, "config") else loader.model_info(
        model, tokenizer=False)[0]
    if classifies(config) or headless(config):
        return True  # a classifier of any family scores; a model without a head embeds
    try:
        return getattr(model_class(config, plugins), "pooling_only", False)
    except ValueError:
        return False  # an unknown family: the generate engine says so, naming the ones known


def _hub_id(model) -> bool:
    return isinstance(model, str) and not os.path.exists(model) and \
        model not in loader.RANDOM and model not in loader.ALIASES


def _local(model):
    """A hub id as the directory of its files: a sentence-transformers model's modules
    and configs are read from there, as its weights."""
    if not _hub_id(model):
        return model
    from huggingface_hub import snapshot_download
    return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt",
                                                    "*.model", "1_Pooling/*", "2_Normalize/*"])


def _probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, -1)


def _tokenizer(path):
    """transformers' tokenizer: pairs, token types and truncation are its to do."""
    if path is None:
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)
