"""One `bench offline|serve` invocation: build the engine (and the transformers twin), run
warm-up and timed runs, compare, report."""
from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import threading

from rich.console import Console

from roseinfer.bench import hf_baseline, report
from roseinfer.bench.floor import decode_floor
from roseinfer.bench.metrics import RequestRecord, summarize
from roseinfer.bench.probe import EngineProbe
from roseinfer.bench.progress import Progress
from roseinfer.bench.workloads import (
    Workload, build_prompts, parse_repeats, random_lengths, random_prompts, sampling_of)
from roseinfer.core.device_side import settle_heap


class BenchRun:
    def __init__(self, args, mode: str):
        self.args, self.mode = args, mode
        self.console = Console(stderr=True)
        self.variants = [v for v in args.hf_variants.split(",") if v] if args.compare_hf else []
        for v in self.variants:
            if v not in hf_baseline.VARIANTS:
                raise SystemExit(f"unknown --hf-variants entry {v!r}; known: "
                                 f"{', '.join(hf_baseline.VARIANTS)}")
        if args.plot:
            report.require_matplotlib()  # before the runs, not after them

    def main(self) -> int:
        a = self.args
        if a.num_requests < 1 or a.max_new_tokens < 1 or a.repeat_runs < 1 or a.warmup_runs < 0:
            raise SystemExit("--num-requests, --output-len and --repeat-runs must be >= 1, "
                             "--warmup-runs >= 0")
        if threading.current_thread() is not threading.main_thread():
            return self._main()
        # SIGTERM unwinds like Ctrl-C, so the embedded Redis and client processes are stopped.
        previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            return self._main()
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _main(self) -> int:
        a = self.args
        if getattr(a, "no_worker", False):
            return self._main_fleet()
        llm, hf_model = self._build()
        engine = llm.engine
        w = self._workload(engine.tokenizer, engine.vocab_size, engine.config.seed,
                           engine.max_model_len)
        meta = {"mode": self.mode, "model": a.model, "label": a.label,
                "endpoint": getattr(a, "endpoint", None),
                "command": report.command_line(getattr(a, "argv", None)),
                **report.machine_info(engine.device)}
        self.console.log(f"{self.mode}: {w.num_requests} requests, {w.max_new_tokens} new tokens, "
                         f"{engine.device}/{str(engine.dtype).removeprefix('torch.')}, "
                         f"load avg {meta['load_avg_1m_at_start']:.2f}")
        self.hf_model, self.tokenizer = hf_model, engine.tokenizer
        probe = EngineProbe(engine)
        offline = self._offline_baseline(probe, w) if getattr(a, "compare_offline", False) else None
        runs, hf = self._run_all(probe, w)
        ours = summarize(runs)
        meta["load_avg_1m_at_end"] = os.getloadavg()[0]
        result = {"meta": meta, "workload": w.describe(),
                  "engine_config": dataclasses.asdict(engine.config),
                  "roseinfer": {"summary": ours, "runs": runs}, "hf": hf,
                  "ratios": {v: ours["output_throughput"] / r["summary"]["output_throughput"]
                             for v, r in hf.items() if "summary" in r}}
        if engine.device.type == "cuda":
            peak = getattr(a, "peak_tb_s", None)
            floor = decode_floor(engine, [len(p) for p in w.prompt_ids], w.output_lens,
                                 *([peak * 1e12] if peak else []))
            floor["fraction"] = ours["output_throughput"] / floor["output_throughput"]
            result["bytes_floor"] = floor
        if offline is not None:
            result["offline"] = {"summary": summarize(offline), "runs": offline}
            result["offline_ratio"] = (ours["output_throughput"]
                                       / result["offline"]["summary"]["output_throughput"])
        self._emit(result)
        ok = all(r["completed"] == r["num_requests"] for r in runs)
        return 0 if ok else 1

    # --- set-up ---------------------------------------------------------------------------

    def _build(self):
        """The engine; with --compare-hf built from the very transformers model timed next."""
        from roseinfer.core.config import config_from_args
        from roseinfer.core.device_side import resolve_device, resolve_dtype
        from roseinfer.core.llm import LLM, llm_from_args

        a = self.args
        if not self.variants:
            return llm_from_args(a), None
        config = config_from_args(a)
        device = resolve_device(config.device)
        hf_model, tok = hf_baseline.load_hf_model(a.model, config.seed or 0, device,
                                                  resolve_dtype(config.dtype, device))
        llm = LLM(hf_model, tokenizer=a.tokenizer or tok, **dataclasses.asdict(config))
        hf_model.to(device=llm.engine.device, dtype=llm.engine.dtype)
        return llm, hf_model

    def _main_fleet(self) -> int:
        """--no-worker: load on workers already running on --redis-url / --prefix."""
        from roseinfer.bench.serve import ServeHarness
        from roseinfer.models.loader import model_info

        a = self.args
        if not (a.redis_url and a.prefix):
            raise SystemExit("--no-worker drives workers that already serve: give their "
                             "--redis-url and --prefix")
        hf_config, tokenizer = model_info(a.model)
        w = self._workload(tokenizer, hf_config.vocab_size, a.seed, None)
        meta = {"mode": "serve (fleet)", "model": a.model, "label": a.label,
                "endpoint": a.endpoint,
                "command": report.command_line(getattr(a, "argv", None)),
                **report.machine_info("cpu")}
        runs = []
        with ServeHarness(None, a.redis_url, a.client_procs, a.request_timeout,
                          prefix=a.prefix, endpoint=a.endpoint, tools=_tools(a),
                          loras=_loras(a), images=_images(a)) as harness:
            for k in range(a.warmup_runs):
                self._ours(harness, w, f"warm-up {k + 1}/{a.warmup_runs}", f"w{k}")
            for k in range(a.repeat_runs):
                runs.append(self._ours(harness, w, f"run {k + 1}/{a.repeat_runs}", f"r{k}")[0])
        self._emit({"meta": meta, "workload": w.describe(),
                    "roseinfer": {"summary": summarize(runs), "runs": runs}})
        return 0 if all(r["completed"] == r["num_requests"] for r in runs) else 1

    def _workload(self, tokenizer, vocab_size: int, seed, max_model_len) -> Workload:
        a = self.args
        if tokenizer is None and not a.pretok:
            self.console.log("the model has no tokenizer: sending pre-tokenized prompts")
        output_lens = None
        if a.dataset == "random":
            prompts = ids = random_prompts(a.num_requests, a.input_len, a.range_ratio,
                                           vocab_size, seed or 0)
            output_lens = random_lengths(a.num_requests, a.max_new_tokens, a.range_ratio,
                                         random.Random(f"output {seed or 0}"))
        else:
            prompts, ids = build_prompts(a.num_requests, a.prompt, parse_repeats(a.prompt_repeats),
                                         tokenizer, vocab_size, a.pretok, a.prompt_sep,
                                         a.prompt_token_id)
        w = Workload(prompts, ids, a.max_new_tokens, a.ignore_eos,
                     a.submit_interval_ms / 1e3, a.schedule, getattr(a, "stream_interval", 1),
                     sampling_of(a.temperature, a.top_p, a.top_k), a.request_rate, seed or 0,
                     output_lens, getattr(a, "max_concurrency", None))
        longest = max(len(p) + n for p, n in zip(ids, w.output_lens))
        if max_model_len is not None and longest > max_model_len:
            raise SystemExit(f"prompt + new tokens = {longest} tokens exceeds the engine's "
                             f"max_model_len {max_model_len}")
        return w

    # --- runs -----------------------------------------------------------------------------

    def _run_all(self, probe: EngineProbe, w: Workload) -> tuple[list[dict], dict]:
        """Warm-ups first, then timed runs interleaved (ours, each transformers variant, ours,
        ...), so that load from other processes drifting over time hits both sides alike."""
        a = self.args
        runs, records = [], []
        hf_runs: dict[str, list] = {v: [] for v in self.variants}
        self._hf_skipped: dict[str, str] = {}
        self._hf_outputs: dict[str, list] = {}
        with self._harness(probe) as harness:
            for k in range(a.warmup_runs):
                self._ours(harness, w, f"warm-up {k + 1}/{a.warmup_runs}", f"w{k}")
            for v in self.variants:
                # A compiled variant's first call compiles: never time it.
                n = max(a.warmup_runs, 1) if v == "static" else a.warmup_runs
                for k in range(n):
                    self._hf(v, w, f"warm-up {k + 1}/{n}")
            settle_heap()  # the transformers models and compiled graphs loaded since
            for k in range(a.repeat_runs):
                metrics, records = self._ours(harness, w, f"run {k + 1}/{a.repeat_runs}", f"r{k}")
                runs.append(metrics)
                for v in self.variants:
                    r = self._hf(v, w, f"run {k + 1}/{a.repeat_runs}")
                    if r is not None:
                        hf_runs[v].append(r)
        hf = {v: self._hf_result(v, hf_runs[v], records) for v in self.variants}
        return runs, hf

    def _offline_baseline(self, probe: EngineProbe, w: Workload) -> list[dict]:
        """`bench offline` on the same engine and requests, before the worker starts (it
        would step the engine too): what the frontend's throughput is a fraction of."""
        a, runs = self.args, []
        with _OfflineHarness(probe) as harness:
            for k in range(a.warmup_runs):
                self._ours(harness, w, f"offline warm-up {k + 1}/{a.warmup_runs}", f"ow{k}")
            for k in range(a.repeat_runs):
                runs.append(self._ours(harness, w, f"offline run {k + 1}/{a.repeat_runs}",
                                       f"o{k}")[0])
        return runs

    def _ours(self, harness, w: Workload, name: str, run_id: str):
        total = sum(w.output_lens)
        with Progress(total, f"roseinfer {name}", self.args.progress) as progress:
            metrics, records = harness.run(w, run_id, progress)
        self.console.log(f"roseinfer {name}: {metrics['output_throughput']:,.1f} completion tok/s, "
                         f"{metrics['completed']}/{w.num_requests} done, "
                         f"{metrics['duration_s']:.3f} s")
        if metrics["completed"] == 0:  # broken set-up: say why now, not after every run
            why = next((r.error for r in records if r.error), "no error was reported")
            raise SystemExit(f"roseinfer {name}: no request completed: {why}")
        return metrics, records

    def _hf(self, variant: str, w: Workload, name: str):
        """One transformers run; None once the variant has been skipped."""
        if variant in self._hf_skipped:
            return None
        try:
            r = hf_baseline.run_hf(self.hf_model, self.tokenizer, w, variant)
        except hf_baseline.VariantUnavailable as e:
            self.console.log(f"[yellow]transformers {variant} skipped[/]: {e}")
            self._hf_skipped[variant] = str(e)
            return None
        self._hf_outputs[variant] = r.pop("outputs")
        self.console.log(f"transformers {variant} {name}: {r['output_throughput']:,.1f} "
                         f"completion tok/s, {r['duration_s']:.3f} s")
        return r

    def _hf_result(self, variant: str, runs: list[dict], ours: list[RequestRecord]) -> dict:
        if variant in self._hf_skipped:
            return {"skipped": self._hf_skipped[variant]}
        outputs = self._hf_outputs[variant]
        same = sum(r.token_ids == o for r, o in zip(ours, outputs))
        return {"summary": {**summarize(runs), "outputs_equal_to_roseinfer": same / len(ours)},
                "runs": runs}

    def _harness(self, probe: EngineProbe):
        if self.mode == "serve":
            from roseinfer.bench.serve import ServeHarness
            a = self.args
            return ServeHarness(probe, a.redis_url, a.client_procs, a.request_timeout,
                                endpoint=a.endpoint, ack_replicas=a.ack_replicas,
                                tools=_tools(a), loras=_loras(a), images=_images(a))
        return _OfflineHarness(probe)

    # --- output ---------------------------------------------------------------------------

    def _emit(self, result: dict) -> None:
        a = self.args
        if a.output_json:
            report.write_json(result, a.output_json)
            self.console.log(f"results written to {a.output_json}")
        if a.plot:
            label = a.label or f"{self.mode} {result['workload']['num_requests']} req"
            report.plot([result], [label], a.plot)
            self.console.log(f"chart written to {a.plot}")
        report.print_report(result, Console())


class _OfflineHarness:
    def __init__(self, probe: EngineProbe):
        self.probe = probe

    def __enter__(self) -> "_OfflineHarness":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def run(self, w: Workload, run_id: str, progress: Progress):
        from roseinfer.bench.offline import run_offline
        return run_offline(self.probe, w, run_id, progress)


def _loras(args) -> list[str]:
    """--loras: the adapters requests run with, in turn."""
    names = getattr(args, "loras", None)
    return [n for n in names.split(",") if n] if names else []


def _images(args) -> int:
    """--images: the pixels a side of each request's image (0: none); its requests are
    chats through the queue, so their prompts are text."""
    size = getattr(args, "images", 0)
    if size and (args.pretok or args.dataset == "random" or args.endpoint != "redis"):
        raise SystemExit("--images sends chats through the queue: text prompts (--dataset "
                         "repeat, no --pretok) and --endpoint redis")
    return size


def _tools(args) -> list | None:
    """--tools-file's tools, for the chat endpoint only."""
    path = getattr(args, "tools_file", None)
    if path is None:
        return None
    if args.endpoint != "openai-chat":
        raise SystemExit("--tools-file goes with --endpoint openai-chat")
    with open(path) as f:
        return json.load(f)
