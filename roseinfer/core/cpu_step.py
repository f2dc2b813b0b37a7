"""One sequence's decode step on the CPU, compiled ahead of time (AOTInductor).

At batch 1 a CPU step is its weights' bytes plus some 1,100 small ops, and after
each linear has streamed megabytes of weights through the caches those ops cost
several times their hot-cache time: 18-20 ms of a 47-54 ms step on an Intel Xeon
(docs/benchmarks.md). Compiled, the same forward runs as one C++ function: the
chains of small ops fuse into loops, the linears call the kernels the eager step
chose (oneDNN's packed GEMM or MKL's), and no Python or dispatcher runs between.

What is compiled is the model's own forward and LM head, traced by torch.export
with the step's context as inputs (the block table row, the context length as a
dynamic size, the new token's slot) and the KV cache tensors, written in place as
in the eager step. The package holds code only: it takes the module's weights as
they are (user-managed constants), so one build serves every checkpoint of a shape.

A build takes a minute or more (87 s for the default model on two cores). With
``"auto"``, the default, a start that finds none serves at once with the eager step
and builds in the background: a child process at the lowest CPU priority loads the
same model and builds, in a process group of its own, so that it outlives a one-shot
``generate`` and the next start finds it. The engine swaps the built step in between two requests (never
during one: its tokens come from one step throughout), where it measured faster than
the eager step. ``"build"`` builds first, in the start itself. A build is kept under
``CACHE_DIR/cpu_steps``, keyed by the model's config and weight layouts, the CPU,
torch's version and roseinfer's source; one that failed or measured slower is
recorded and not tried again.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from roseinfer.core.attention import AttnMetadata, StepContext, set_context
from roseinfer.core.kv_cache import SlotBatch

log = logging.getLogger(__name__)

TIMED_CONTEXT = 64  # the context the build's timing decodes at
MIN_CONTEXT = 2     # export would specialize a context of 1
TIMED_STEPS = 10


class _InputCache:
    """The KV cache as the traced step sees it: its tensors are the step's inputs."""

    def __init__(self, k, v, append, slots: SlotBatch):
        self.k, self.v, self._append, self._slots = k, v, append, slots

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.k[layer], self.v[layer], 0  # the step serves caches of one group only

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self._append.append(self.k[layer], self.v[layer], key, value, self._slots)


class DecodeStep(nn.Module):
    """The model's forward and logits for one sequence's decode step, under a step
    context built from its inputs: what is exported, and the eager twin it is timed
    against."""

    def __init__(self, model: nn.Module, append, attention):
        super().__init__()
        self.model, self.kv_append, self.attention = model, append, attention

    def forward(self, ids, positions, table, context, slot_block, slot_offset, k, v):
        """``context``: any tensor of the context's length (its size is the dynamic one)."""
        slots = SlotBatch(slot_block, slot_offset)
        attn = AttnMetadata(table, None, None, 1, context.shape[0])
        set_context(StepContext(_InputCache(k, v, self.kv_append, slots), self.attention, attn,
                                slots))
        try:
            return self.model.compute_logits(self.model(ids, positions))
        finally:
            set_context(None)


class CompiledStep:
    """The loaded package, called as the runner's forward of a one-sequence decode step."""

    def __init__(self, package, kv_cache, max_model_len: int):
        self.package = package
        self.caches = [*kv_cache.k, *kv_cache.v]
        self.lengths = torch.empty(max_model_len + 1, dtype=torch.uint8)
        self.steps = 0

    @staticmethod
    def serves(num_tokens: int, attn: AttnMetadata) -> bool:
        """One sequence's decode step, within the context lengths it was exported for
        (from 2: a one-token prompt's prefill runs eagerly)."""
        return num_tokens == 1 and attn.is_decode and attn.max_context_len >= MIN_CONTEXT

    def __call__(self, ids, positions, table, context_len: int, slots: SlotBatch) -> torch.Tensor:
        self.steps += 1
        return self.package.boxed_run([ids, positions, table, self.lengths[:context_len],
                                       slots.block_idx, slots.offsets, *self.caches])[0]


def prepare(mode: str, model, hf_config, kv_cache, append, attention, max_model_len: int,
            cache_dir: str) -> CompiledStep | None:
    """The compiled step to use, or None: loaded if built before for this model and
    machine and faster than eager there; built first when ``mode`` is "build"."""
    if mode == "off":
        return None
    step = DecodeStep(model, append, attention)
    path = step_path(cache_dir, model, hf_config, kv_cache)
    record = _read_record(path)
    context_len = min(TIMED_CONTEXT, max_model_len)
    if record is not None and record.get("untimed"):  # built in the background: time it here
        package = _load_built(path, step)
        if package is not None:
            package = _timed(step, package, kv_cache, context_len, path, record)
    elif record is not None:
        package = _load_built(path, step) if _pays(record) else None
    elif mode == "build":
        package = build(step, kv_cache, path, context_len)
    else:
        return None
    return None if package is None else CompiledStep(package, kv_cache, max_model_len)


def step_path(cache_dir: str, model, hf_config, kv_cache) -> Path:
    """Where this model's build lives (``.pt2``, its record ``.json``)."""
    return Path(cache_dir, "cpu_steps", step_key(model, hf_config, kv_cache))


def is_built(path: Path) -> bool:
    """Whether a build was recorded at ``path``: used, or found slower, or failed."""
    return _read_record(path) is not None


# ---------------------------------------------------------------- background builds

class BackgroundBuild:
    """A build running in a child process (``start_background``)."""

    def __init__(self, proc: subprocess.Popen, path: Path):
        self.proc, self.path, self.started = proc, path, time.monotonic()

    def done(self) -> bool:
        return self.proc.poll() is not None


def start_background(spec, config: dict, path: Path) -> BackgroundBuild | None:
    """Build ``spec``'s step in a child process at the lowest CPU priority (the serving step
    keeps its cores), in a process group of its own, so that it outlives a one-shot
    start and its Ctrl-C. None where another build of it runs already, or
    ``ROSEINFER_BACKGROUND_BUILDS=0`` (a test suite's engines)."""
    if os.environ.get("ROSEINFER_BACKGROUND_BUILDS") == "0" or not _take_lock(path):
        return None
    cmd = [sys.executable, "-m", "roseinfer.core.cpu_step", "--model", os.fspath(spec),
           "--config", json.dumps(config), "--path", str(path),
           "--threads", str(torch.get_num_threads())]
    with open(path.with_suffix(".log"), "w") as out:
        # the same cache: the linear kernels the engine timed and chose are in its layouts
        env = {**os.environ, "ROSEINFER_CACHE": str(path.parent.parent)}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, preexec_fn=_lowest_priority)
    path.with_suffix(".building").write_text(str(proc.pid))  # a lock outlives only its builder
    log.warning("event=cpu_step_build_started pid=%d path=%s (in the background, at the "
                "lowest priority; the eager step serves until it is in)", proc.pid, path)
    return BackgroundBuild(proc, path)


def _lowest_priority() -> None:
    """In the builder, before it runs: a process group of its own (Ctrl-C at the terminal
    reaches the engine, not the build), nice 19 and SCHED_IDLE where allowed. Not a
    session of its own: the kernel's autogroups share the CPU fairly between sessions
    whatever their nice values, and in one the build slowed the default model's eager
    decoding from 52 to 3 tokens/s on two cores."""
    os.setpgid(0, 0)
    os.nice(19)
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def _take_lock(path: Path) -> bool:
    """Claim ``path``'s build: a ``.building`` file naming this process's child-to-be;
    a lock whose process is gone is taken over."""
    lock = path.with_suffix(".building")
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                os.kill(int(lock.read_text() or 0), 0)
                return False  # its builder runs
            except (ProcessLookupError, ValueError, OSError):
                lock.unlink(missing_ok=True)  # left by a builder that died
                continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True
    return False


def _build_in_child(args) -> None:
    """The child's part: load the model as the engine did (a small KV cache), check it
    has the engine's key, build, record."""
    from roseinfer.core import device_side
    from roseinfer.core.config import EngineConfig
    from roseinfer.core.plugins import default_registry

    torch.set_num_threads(args.threads)
    path = Path(args.path)
    path.with_suffix(".building").write_text(str(os.getpid()))
    try:
        given = json.loads(args.config)
        blocks = TIMED_CONTEXT // given["block_size"] + 2  # what the timed steps use
        cfg = EngineConfig(**{**given, "cpu_compiled_step": "off", "num_kv_blocks": blocks,
                              "max_model_len": None})
        side = device_side.build(args.model, None, cfg, default_registry(),
                                 torch.device("cpu"))
        found = step_path(str(path.parent.parent), side.model, side.hf_config, side.kv_cache)
        if found != path:
            _record(path, {"failed": f"the model loaded for the build has key {found.name}, "
                           f"not the engine's {path.name}", "compiled_ms": None})
            return
        step = DecodeStep(side.model, side.kv_cache.backends["torch_index"],
                          side.runner.attention)
        build(step, side.kv_cache, path, min(TIMED_CONTEXT, side.max_model_len), timed=False)
    except Exception as e:  # recorded: the next start does not try again
        _record(path, {"failed": f"{type(e).__name__}: {e}"[:500], "compiled_ms": None})
        raise
    finally:
        path.with_suffix(".building").unlink(missing_ok=True)


def _read_record(path: Path) -> dict | None:
    """The build's record; None if there is none, or its package went missing."""
    try:
        record = json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return None
    if (record.get("compiled_ms") is not None or record.get("untimed")) and \
            not path.with_suffix(".pt2").exists():
        return None
    return record


def _load_built(path: Path, step: DecodeStep):
    try:
        return load(path.with_suffix(".pt2"), step)
    except RuntimeError as e:  # a damaged file: the start goes on eagerly
        log.warning("cannot load the compiled CPU step %s (%s); decoding eagerly. Delete it "
                    "and start with cpu_compiled_step=build to build it again", path, e)
        return None


def _pays(record: dict) -> bool:
    if record["compiled_ms"] is not None and record["compiled_ms"] < record["eager_ms"]:
        return True
    log.info("the compiled CPU step built here is not used: %s", record.get("failed") or
             f"{record['compiled_ms']} ms a step against {record['eager_ms']} eager")
    return False


def step_key(model: nn.Module, hf_config, kv_cache) -> str:
    """What the compiled code depends on: the config (norm epsilons, flags), each
    tensor's name, shape and layout (the linear kernels chosen), the cache's block
    shape, the CPU and the thread count (Inductor plans its loops' parallelism for the
    count it compiles with), torch and roseinfer's source."""
    from roseinfer.layers.cpu_linear import cpu_model

    config = {k: v for k, v in hf_config.to_dict().items()
              if k not in ("_name_or_path", "transformers_version")}
    tensors = [(name, tuple(t.shape), str(t.dtype), str(t.layout))
               for name, t in [*model.named_parameters(), *model.named_buffers()]]
    parts = [json.dumps(config, sort_keys=True, default=str), repr(tensors),
             repr(tuple(kv_cache.k[0].shape[1:])), cpu_model(), str(torch.get_num_threads()),
             torch.__version__, _source_digest()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def _source_digest() -> str:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()


@torch.inference_mode()
def build(step: DecodeStep, kv_cache, path: Path, context_len: int, timed: bool = True):
    """Export and compile the step, writing ``path``.pt2 and ``path``.json; ``timed``: then
    time it against the eager step and return the loaded package if it is faster (else
    None). A build in the background leaves the timing to the engine that loads it: its
    own would measure the serving process's load on the cores."""
    log.warning("building the compiled CPU decode step (a minute or more; once per model "
                "shape and machine) into %s", path.parent)
    start = time.perf_counter()
    tmp = _compile(step, _example(kv_cache, context_len), path)
    record = {"built_s": round(time.perf_counter() - start, 1), "torch": torch.__version__,
              "eager_ms": None, "compiled_ms": None}
    failed = _load_fails(tmp, _op_libraries(step))
    if failed:
        tmp.unlink()
        _record(path, {**record, "failed": failed})
        log.warning("compiled CPU decode step built in %.0f s: %s", record["built_s"], failed)
        return None
    os.replace(tmp, path.with_suffix(".pt2"))
    if not timed:
        _record(path, {**record, "untimed": True})
        log.warning("compiled CPU decode step built in %.0f s; the engine that loads it "
                    "times it", record["built_s"])
        return None
    return _timed(step, load(path.with_suffix(".pt2"), step), kv_cache, context_len, path,
                  record)


def _timed(step: DecodeStep, package, kv_cache, context_len: int, path: Path, record: dict):
    """Time the package against the eager step, record both; the package if it pays."""
    args = _example(kv_cache, context_len)
    flat = [*args[:6], *args[6], *args[7]]
    with torch.inference_mode():
        record = {**record, "eager_ms": _median_ms(lambda: step(*args)),
                  "compiled_ms": _median_ms(lambda: package.boxed_run(list(flat)))}
    record.pop("untimed", None)
    _record(path, record)
    log.warning("compiled CPU decode step: %.1f ms a step against %.1f eager",
                record["compiled_ms"], record["eager_ms"])
    return package if _pays(record) else None


def _record(path: Path, record: dict) -> None:
    written = path.with_name(f"{path.name}.{os.getpid()}.json")
    written.write_text(json.dumps(record, indent=1))
    os.replace(written, path.with_suffix(".json"))  # a concurrent start reads all or nothing


def _compile(step: DecodeStep, args: tuple, path: Path) -> Path:
    """The AOTInductor package of ``step``, at a temporary path beside ``path``."""
    from torch._inductor import aoti_compile_and_package, config as inductor_config

    context = torch.export.Dim("context", min=MIN_CONTEXT, max=1 << 20)
    blocks, table_width = torch.export.Dim("cache_blocks"), torch.export.Dim("table_width")
    caches = [{0: blocks}] * len(args[6])
    program = torch.export.export(
        step, args, strict=False,
        dynamic_shapes=(None, None, {1: table_width}, {0: context}, None, None, caches, caches))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.pt2")
    with inductor_config.patch({"aot_inductor.package_constants_in_so": False}):
        aoti_compile_and_package(program, package_path=str(tmp))
    return tmp


def _op_libraries(step: nn.Module) -> str:
    """Python that loads the operator libraries of the project's own the step calls: the
    package finds them by name, and they must be loaded first."""
    from roseinfer.layers.gguf_linear import GgufLinear
    if any(isinstance(m, GgufLinear) for m in step.modules()):
        return "from roseinfer.layers.gguf_linear import build; build(); "
    return ""


def _load_fails(package_path: Path, preload: str = "") -> str | None:
    """Why torch's loader cannot open the package, tried in a process of its own (it
    ended one with a segmentation fault under torch 2.11 on an Intel Xeon); None if it can.
    ``preload``: Python run first (``_op_libraries``)."""
    code = ("import sys, torch; " + preload +
            "torch._C._aoti.AOTIModelPackageLoader(sys.argv[1], 'model', False, 1, -1)")
    try:
        done = subprocess.run([sys.executable, "-c", code, str(package_path)],
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "loading the package took over 300 s"
    if done.returncode == 0:
        return None
    return (f"loading the package ended its process with code {done.returncode}: "
            f"{done.stderr.strip()[-300:]}")


def load(package_path: Path, step: DecodeStep):
    """The package, with the module's own tensors as its weights. Through torch's
    loader itself: torch._inductor's wrapper of it would import torch._inductor,
    2 s of a start on two cores, and flatten the inputs by their tree spec each call."""
    package = torch._C._aoti.AOTIModelPackageLoader(str(package_path), "model", False, 1, -1)
    named = dict(step.named_parameters(remove_duplicate=False))
    named.update(step.named_buffers(remove_duplicate=False))
    # (constants, into the inactive buffer, check that all are given, user-managed, copy to device)
    package.load_constants({name: named[name] for name in package.get_constant_fqns()},
                           False, True, True, False)
    return package


def _example(kv_cache, context_len: int) -> tuple:
    """Inputs of a decode step at ``context_len``, over K/V blocks of its own shaped as the
    cache's: the engine's cache may hold live or prefix-cached blocks."""
    bs, pos = kv_cache.block_size, context_len - 1
    blocks = -(-context_len // bs) + 1
    table = torch.arange(blocks, dtype=torch.int32)[None, :]
    ints = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731 (the runner's dtype)
    own = lambda caches: [torch.zeros(blocks, *c.shape[1:], dtype=c.dtype)  # noqa: E731
                          for c in caches]
    return (ints(1), ints(pos), table, torch.empty(context_len, dtype=torch.uint8),
            ints(pos // bs), ints(pos % bs), own(kv_cache.k), own(kv_cache.v))


def _median_ms(fn) -> float:
    fn()
    times = []
    for _ in range(TIMED_STEPS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1000, 3)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="build a model's compiled CPU decode step "
                                     "(started by an engine in the background; not meant "
                                     "to be run by hand)")
    for flag in ("--model", "--config", "--path"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--threads", type=int, required=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    _build_in_child(parser.parse_args())
