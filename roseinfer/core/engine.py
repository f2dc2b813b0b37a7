"""Engine: add_request / step / abort over scheduler, block manager and runner."""
from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from roseinfer.core import device_side, faults, multimodal, recurrent, speculation, tp
from roseinfer.core.cpu_step_choice import StepChoice
from roseinfer.core.device_side import resolve_device, settle_heap
from roseinfer.core.blocks import BlockManager
from roseinfer.core.config import EngineConfig
from roseinfer.core.errors import ConfigError, InvalidRequestError
from roseinfer.core.image_encoder import ImageEncoder
from roseinfer.core.intake import Intake, Prompt
from roseinfer.core.outputs import RequestOutput
from roseinfer.core.plugins import PluginRegistry, default_registry
from roseinfer.core.processors import ProcessorContext, Processors, catch_up
from roseinfer.core.request import Sequence, Status
from roseinfer.core.sampling import SamplingParams, is_int
from roseinfer.core.scheduler import Scheduler
from roseinfer.core.step_times import StepTimes
from roseinfer.core.tp_workers import Peers, rank_device
from roseinfer.models import loader
from roseinfer.models.tokenizers import as_chat

log = logging.getLogger(__name__)
# The CPU's default max_mixed_prefill_tokens (config.py says why).
CPU_MIXED_PREFILL_TOKENS = 16


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    # Speculative decoding since start (core/speculation.py): drafts checked, their
    # tokens, and the tokens of them kept.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # LoRA adapters (core/lora.py): how many it serves, and slots filled since start.
    num_loras: int = 0
    num_lora_swaps: int = 0


class Engine:
    def __init__(self, model, tokenizer=None, config: Optional[EngineConfig] = None,
                 plugins: Optional[PluginRegistry] = None):
        config = config or EngineConfig()
        self.plugins = plugins = plugins or default_registry()
        self.device = resolve_device(config.device)
        self.config = config = device_side.weights_decided(config, model, self.device)
        self.peers = None
        if config.tensor_parallel_size > 1:
            self.device = rank_device(self.device, 0, config.tensor_parallel_size)
            with tp.assume(0, config.tensor_parallel_size, config.enable_expert_parallel):
                loader.check_shards(model, plugins)
            self.peers = Peers.start(model, config, self.device)
        try:
            self._build(model, tokenizer)
        except BaseException:
            if self.peers is not None:
                self.peers.close(kill=True)
            raise
        self._leave = lambda: None
        if self.peers is not None:  # not bound to self: the engine must stay collectable
            self._leave = weakref.finalize(self, device_side.leave_group, self.runner,
                                           self.peers)

    def _build(self, model, tokenizer) -> None:
        config, plugins = self.config, self.plugins
        side = device_side.build(model, tokenizer, config, plugins, self.device, self.peers)
        self.config = config = side.config
        self.shares_prompts = not recurrent.layers(side.model)  # _queue
        beside = config.encoder_beside_steps
        self.encoder = ImageEncoder(side.model, config.max_num_batched_tokens, beside=(
            self.device.type == "cuda" if beside is None else beside)) \
            if hasattr(side.model, "encode_images") else None
        self.dtype, self.model, self.hf_config = side.dtype, side.model, side.hf_config
        self.tokenizer, self.kv_cache, self.runner = side.tokenizer, side.kv_cache, side.runner
        self.loras = side.loras
        self.max_model_len = side.max_model_len
        self.vocab_size = self.hf_config.vocab_size
        self.eos_ids = _eos_ids(self.hf_config, self.tokenizer)
        num_blocks = self.kv_cache.scratch_block
        self.step_choice = StepChoice(self, model)
        store = plugins.create("metadata", config.metadata_store, num_blocks, config.block_size)
        self.blocks = BlockManager(num_blocks, config.block_size, store,
                                   config.enable_prefix_cache, self.runner.copy_block,
                                   self.kv_cache.groups.windows, self.runner.remap)
        mixed_prefill = config.max_mixed_prefill_tokens
        if mixed_prefill is None and self.device.type == "cpu":
            mixed_prefill = CPU_MIXED_PREFILL_TOKENS
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.decode_steps, config.decode_steps_min_seqs, mixed_prefill,
                                   config.priority_aging_s)
        self.blocks.on_free_seq = self.runner.rows.release
        self.blocks.states = self.runner.snapshots
        self.scheduler.admits = _encoded
        if self.loras is not None:
            self._serve_loras()
        plugins.get("logits_processor", config.structured_output)  # fail early, listing names
        self.processors = Processors(plugins, ProcessorContext(
            self.tokenizer, self.model.head.vocab_size, frozenset(self.eos_ids), self.device),
            config.structured_output)
        self.intake = Intake(self.tokenizer, self.vocab_size, self.max_model_len, self.device,
                             self.processors)
        self.seqs: dict[str, Sequence] = {}  # by Sequence.key
        self.groups: dict[str, int] = {}     # n of the unfinished requests with n > 1
        self._forks: list[tuple[Sequence, list[Sequence]]] = []  # _share_prompts
        self.speculator = speculation.build(
            config, plugins, self.device, self.dtype, self.vocab_size, self.max_model_len,
            speculation.Target(model, self.model, self.kv_cache, self.runner))
        self._aborted: list[Sequence] = []
        self._in_flight = None
        self.step_times = StepTimes()
        self._stepping = threading.Lock()
        settle_heap()
        log.info("engine ready: %s on %s/%s, %d KV blocks of %d, max_model_len %d%s%s",
                 type(self.model).__name__, self.device, self.dtype, num_blocks,
                 config.block_size, self.max_model_len, self.kv_cache.groups.describe(),
                 f", tensor parallel over {config.tensor_parallel_size}" if self.peers else "")

    def _serve_loras(self) -> None:
        """A request's adapter takes a slot when it is admitted and gives it back with its
        blocks; the other ranks fill the slots rank 0 fills."""
        loras, free_rows = self.loras, self.runner.rows.release
        self.scheduler.admits = lambda seq: _encoded(seq) and (seq.lora is None or
                                                               loras.acquire(seq))
        self.blocks.on_free_seq = lambda seq: (free_rows(seq), loras.release(seq))
        if self.peers is not None:
            loras.announce = self.peers.send_lora

    def add_lora(self, name: str, path: str) -> None:
        """Serve the PEFT LoRA adapter at ``path`` as ``name`` (read and checked now):
        requests then name it (``add_request(..., lora=name)``)."""
        if self.loras is None:
            raise ConfigError("this engine serves no LoRA adapters: start it with "
                              "enable_lora=True (worker: --lora-modules name=path)")
        self.loras.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Stop serving adapter ``name``; its requests must have ended."""
        if self.loras is None:
            raise ConfigError("this engine serves no LoRA adapters")
        users = [s.key for s in self.seqs.values() if s.lora == name]
        if users:
            raise ConfigError(f"adapter {name!r} still serves {len(users)} request(s) "
                              f"({users[:3]}): remove it once they end")
        self.loras.remove(name)

    @property
    def lora_names(self) -> list[str]:
        """The adapters requests may name."""
        return [] if self.loras is None else self.loras.names

    def close(self) -> None:
        """Release the model, its KV cache and CUDA graphs, and stop the other ranks of a
        tensor-parallel group, leaving it; the engine serves nothing after. The group is
        also left when the engine is garbage-collected, and at exit."""
        if self.closed:
            return
        self._leave()
        if self.encoder is not None:
            self.encoder.close()
        self.seqs.clear()
        self.groups.clear()
        self._in_flight = self.runner = self.kv_cache = self.model = None
        self.blocks = self.scheduler = self.processors = None
        device_side.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def prompts_pending(self) -> bool:
        """Whether a prompt waits or is being computed (the step in flight included)."""
        launched, scheduler = self._in_flight, self.scheduler
        return bool(scheduler.waiting) or (launched is not None and launched.batch.prefill_tokens
                                           > 0) or any(s.num_computed < s.num_prompt_tokens
                                                       for s in scheduler.running)

    @property
    def closed(self) -> bool:
        return self.scheduler is None

    # ---- requests -------------------------------------------------------
    def chat_prompt(self, text: str) -> str:
        """``text`` as one user turn in the tokenizer's chat template (if it has one)."""
        return as_chat(self.tokenizer, text)

    def add_request(self, request_id: str, prompt: Prompt, params: Optional[SamplingParams] = None,
                    emitted_ids=None, emitted_text=None, indexes=None, lora: Optional[str] = None):
        """Queue a request. ``emitted_ids`` resumes one whose first tokens were
        already handed out elsewhere: they are recomputed as context, count
        against ``max_tokens``, and are not emitted again. ``emitted_text`` is
        the text handed out with them: text still held back then comes out next.

        With ``params.n`` > 1 the n samples run as sequences of their own, each
        output carrying its ``index``; ``indexes`` picks the ones to run (a
        resumed request's unfinished ones) and ``emitted_ids`` / ``emitted_text``
        map an index to its own. The samples after the first share its prompt's
        full KV blocks once computed (_share_prompts). ``lora``: the name of an adapter
        the request runs with (add_lora), None for the base model."""
        params = params or SamplingParams()
        if self.closed:
            raise RuntimeError("this engine is closed; make a new one")
        if request_id in self.seqs or request_id in self.groups:
            raise InvalidRequestError("rid", f"request id {request_id!r} is already in use")
        self._check_lora(lora)
        prompt, images = multimodal.split(prompt)
        if images is not None and isinstance(prompt, str):
            prompt = multimodal.prompt_text(self.model, self.tokenizer, prompt)
        ids = self.intake.prompt_ids(prompt, params)
        if images is not None:
            ids, images = multimodal.prepare(self.model, ids, images, self.encoder and
                                             self.encoder.cache)
            multimodal.check_spans(images, self.config.max_num_batched_tokens)
        if params.n == 1:
            seq = self.intake.sequence(request_id, 0, ids, params, emitted_ids, emitted_text, lora)
            self._queue(self._with_images([seq], images))
            return
        indexes = range(params.n) if indexes is None else indexes
        if not indexes or not all(is_int(i) and 0 <= i < params.n for i in indexes):
            raise InvalidRequestError("indexes", f"must name samples in [0, {params.n})")
        emitted_ids, emitted_text = emitted_ids or {}, emitted_text or {}
        self._queue(self._with_images([
            self.intake.sequence(request_id, i, ids, params.sample(i), emitted_ids.get(i),
                                 emitted_text.get(i), lora) for i in sorted(set(indexes))],
            images))
        self.groups[request_id] = params.n

    def _with_images(self, seqs: list[Sequence], images) -> list[Sequence]:
        """The samples carrying their prompt's images, queued for the tower where their
        features are not cached; their blocks' hashes chain from the images' too, so no
        prompt with other images takes them."""
        for seq in seqs if images is not None else ():
            seq.images = images
            seq.hash_root = hash((seq.hash_root, images.digest))
        if images is not None:
            self.encoder.add(images)
        return seqs

    def _check_lora(self, lora: Optional[str]) -> None:
        if lora is None:
            return
        if self.loras is None:
            raise InvalidRequestError("lora", f"this engine serves no adapters, so not "
                                      f"{lora!r}; ask for the base model (no lora)")
        self.loras.check(lora)

    def _queue(self, samples: list[Sequence]) -> None:
        """Into the scheduler: the first sample now, the others once its prompt's
        full blocks are computed (right away if it has none)."""
        for seq in samples:
            self.seqs[seq.key] = seq
        first, rest = samples[0], samples[1:]
        self.scheduler.add(first)
        if rest and not self.shares_prompts:
            for seq in rest:  # a recurrent state to share is not kept: each computes its own
                self.scheduler.add(seq)
        elif rest:
            self._forks.append((first, rest))
            self._share_prompts()

    def _share_prompts(self) -> None:
        """Start the samples waiting for their first sample's prompt blocks: they
        take them (the K/V writes are queued before anything they launch) and
        compute only the prompt's last, partial block themselves, as a prefix-cache
        hit does. If the first sample ended before, they compute their own."""
        waiting = []
        for first, rest in self._forks:
            full = (first.num_prompt_tokens - 1) // self.config.block_size
            if first.num_computed < full * self.config.block_size and not first.finished:
                waiting.append((first, rest))
                continue
            for seq in rest:
                if seq.finished:
                    continue
                if not first.finished:
                    self.blocks.share(first, seq, full)
                self.scheduler.add(seq)
        self._forks = waiting

    def abort(self, request_id: str) -> None:
        for seq in self._samples(request_id):
            self.scheduler.finish(seq)
            seq.finish_reason = "abort"
            self._aborted.append(seq)

    def fail(self, seq: Sequence, error: Exception) -> list[RequestOutput]:
        """End ``seq``'s request, every sample of it, with an internal error naming
        ``error``; returns their final outputs."""
        log.error("event=request_failed rid=%s", seq.request_id, exc_info=error)
        outputs = []
        for s in self._samples(seq.request_id):
            self.scheduler.finish(s)
            s.finish_reason, s.error = "error", f"{type(error).__name__}: {error}"
            outputs.append(self._output(s, []))
            self._forget(s)
        return outputs

    def _samples(self, request_id: str) -> list[Sequence]:
        """The request's unfinished sequences (its samples, when n > 1)."""
        n = self.groups.get(request_id)
        keys = [request_id] if n is None else [f"{request_id}#{i}" for i in range(n)]
        return [seq for seq in map(self.seqs.get, keys) if seq is not None and not seq.finished]

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def num_unfinished(self) -> int:
        return len(self.seqs)

    @property
    def step_kind(self) -> str:
        """How a one-sequence decode step runs: "compiled", "building" (eager while the
        compiled step is built in the background) or "eager"."""
        return self.step_choice.kind(self.runner)

    def stats(self) -> EngineStats:
        s, spec = self.scheduler, self.speculator
        drafts = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) \
            if spec is not None else ()
        stats = EngineStats(len(s.running), len(s.waiting), self.blocks.usage(),
                            s.num_preemptions, *drafts)
        if self.loras is not None:
            stats.num_loras, stats.num_lora_swaps = len(self.loras.paths), self.loras.num_swaps
        return stats

    # ---- stepping -------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch the next batch, then collect the previous one while it runs.

        Outputs therefore trail the launch by one step; a request that turns
        out finished has at most one extra token computed and dropped. A step
        that raises costs only the request that made it raise (core/faults.py).
        """
        if not self._stepping.acquire(blocking=False):
            raise RuntimeError("Engine.step() called from a second thread while another step "
                               "runs: an engine has one caller at a time (stop the Worker "
                               "serving it before calling LLM.generate on it)")
        try:
            return self._step()
        finally:
            self._stepping.release()

    def _step(self) -> list[RequestOutput]:
        outputs = [self._output(seq, []) for seq in self._aborted]
        for seq in self._aborted:
            self._forget(seq)
        self._aborted.clear()
        try:
            outputs += self._advance()
        except Exception as error:
            if self.peers is not None:
                raise  # the other ranks may wait in this step's collectives
            outputs += faults.isolate(self, error)
        self.step_choice.start_build(idle=not self.seqs)
        return outputs

    def _advance(self) -> list[RequestOutput]:
        failed = self._encode_images() if self.encoder is not None else []
        return failed + self._steps()

    def _encode_images(self) -> list[RequestOutput]:
        """The queued requests' next images through the tower (core/image_encoder.py); a
        request whose images raise there fails."""
        outputs, waiting = [], self.scheduler.waiting
        idle = not self.scheduler.running and self._in_flight is None and \
            not any(_encoded(s) for s in waiting)  # only images to wait for
        for images, error in self.encoder.step(wait=idle):
            for seq in [s for s in waiting if s.images is images]:
                if not seq.finished:
                    outputs += self.fail(seq, error)
        return outputs

    def _steps(self) -> list[RequestOutput]:
        self.step_choice.swap_in(self, self._in_flight is None and not self.scheduler.running)
        if self.speculator is not None and self.speculator.wanted(self.scheduler.running):
            return self._speculate()
        batch = self.scheduler.schedule()
        previous, self._in_flight = self._in_flight, None
        if batch.seqs:
            self._in_flight = self._launch(batch, previous)
        if self._forks:
            self._share_prompts()
        outputs = self._collect(previous) if previous is not None else []
        if self.speculator is not None:
            self.speculator.tick(self.speculator.kind(batch))
        return outputs

    def _speculate(self) -> list[RequestOutput]:
        """A step with drafts, collected at once: the next drafts need its tokens."""
        previous, self._in_flight = self._in_flight, None
        outputs = self._collect(previous) if previous is not None else []
        self.speculator.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        kind = self.speculator.kind(batch)
        if batch.seqs:
            outputs += self._collect(self._launch(batch, None))
        if self._forks:
            self._share_prompts()
        self.speculator.tick(kind)
        return outputs

    def _launch(self, batch, previous):
        launched = StepTimes.launching(self.runner.launch, batch, previous)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed += n * batch.steps  # steps > 1 only when every n is 1
        return launched

    def _collect(self, launched) -> list[RequestOutput]:
        ids = launched.result()
        self.step_times.collected(launched)
        if launched.verify is not None:
            self.speculator.verify(launched, ids)
        outputs = self._take(launched, ids)
        if launched.hidden is not None:
            self.speculator.observe(launched, ids)
        return outputs

    def _take(self, launched, ids: list[list[int]]) -> list[RequestOutput]:
        """The step's tokens to their sequences, and each sequence's output."""
        outputs, seqs, steps = [], launched.batch.seqs, launched.batch.steps
        logprobs = launched.token_logprobs(ids, self.tokenizer)
        for i, pos, lp in launched.prompt_logprobs(self.tokenizer):
            plp = seqs[i].prompt_logprobs
            if pos == len(plp):  # a recomputed chunk's positions are there already
                plp.append(lp)
        for k, (row, tokens) in enumerate(zip(launched.rows, ids)):
            seq = seqs[row]
            seq.pending -= steps
            if seq.status is Status.FINISHED:
                continue  # finished while this step was in flight: drop its tokens
            try:
                before = len(seq.token_ids)
                self._append(seq, tokens)
                if k in logprobs:  # one per token taken
                    seq.logprobs += logprobs[k][:len(seq.token_ids) - before]
                outputs.append(self._emit(seq))
            except Exception as error:  # its own host work failed: it alone ends
                outputs += self.fail(seq, error)
        return outputs

    def _append(self, seq: Sequence, tokens: list[int]) -> None:
        """Take a step's tokens up to the first that finishes the sequence."""
        p, eos = seq.params, self.eos_ids
        take, reason = len(tokens), None
        room = seq.max_len - len(seq.token_ids)
        for i, token in enumerate(tokens):
            if token in p.stop_token_ids or (token in eos and not p.ignore_eos):
                take, reason = i + 1, "stop"
                break
            if i + 1 >= room:
                take, reason = i + 1, "length"
                break
        tokens = tokens[:take]
        if seq.detok is not None:
            text_ids = tokens[:-1] if reason == "stop" else tokens  # not the stop token itself
            taken = seq.detok.take(text_ids)
            if seq.detok.stopped:
                tokens, reason = tokens[:taken], "stop"
        seq.token_ids += tokens
        seq.finish_reason = reason
        if seq.constraints:
            catch_up(seq)

    def _emit(self, seq: Sequence) -> RequestOutput:
        if self.blocks.prefix_cache:
            self.blocks.commit(seq)
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)
            self._forget(seq)
        new_ids = seq.token_ids[seq.num_prompt_tokens + seq.num_emitted:]
        seq.num_emitted += len(new_ids)
        return self._output(seq, new_ids)

    def _forget(self, seq: Sequence) -> None:
        if self.seqs.get(seq.key) is not seq:
            return  # forgotten already, or never added (faults.works's probe)
        del self.seqs[seq.key]
        if seq.images is not None and seq.images.features is None:
            self.encoder.drop(seq.images)  # its samples leave together
        n = self.groups.get(seq.request_id)
        if n is not None and not any(f"{seq.request_id}#{i}" in self.seqs for i in range(n)):
            del self.groups[seq.request_id]

    def _output(self, seq: Sequence, new_ids: list[int]) -> RequestOutput:
        final = seq.finish_reason is not None
        # a failed sequence's text is not released: its detokenizer may be what failed
        new_text = seq.detok.release(final) if seq.detok is not None and not seq.error else ""
        lps = seq.logprobs[len(seq.logprobs) - len(new_ids):] if seq.logprobs is not None else None
        return RequestOutput(seq.request_id, new_ids, new_text, final, seq.finish_reason, seq, lps,
                             seq.index)


def _eos_ids(hf, tokenizer) -> set[int]:
    ids = getattr(hf, "eos_token_id", None)  # a text config of transformers 5 may lack it
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _encoded(seq: Sequence) -> bool:
    """Whether a queued sequence may be admitted: its images' features are in."""
    return seq.images is None or seq.images.features is not None
