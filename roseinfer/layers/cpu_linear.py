"""Float32 linears on the CPU: per weight shape and batch size, the faster of two
kernels on this machine, measured when the model loads.

- ``plain``: ``F.linear`` on the weight as it is.
- ``packed``: the weight reordered once into oneDNN's blocked layout, run by
  ``mkldnn._linear_pointwise`` (the op Inductor emits on the CPU) on dense
  inputs and outputs.

Neither wins everywhere (docs/benchmarks.md), with the weights coming from memory
as in a step, on two cores: on an AMD EPYC with Zen 1 cores packed is 1.5-5x faster
from 4 rows up and about even at one row; with Zen 5 cores it is 2-4.7x faster
everywhere; on an Intel Xeon with AVX-512 and AMX plain is 1.1-1.4x faster on the
one-row layer shapes, and at 16 rows each wins some shapes (packed by 1.6x on the
LM head).
"""
from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

KERNELS = ("plain", "packed")
ROWS = (1, 16)       # the batch sizes measured: one sequence decoding, and a batch
SMALL_BELOW = 4      # rows under this run the 1-row choice, the rest the 16-row one
STREAM_BYTES = 256 << 20  # weights timed in turn: more than a server's last-level cache holds
MAX_COPIES = 256          # ...except for tiny shapes, which a model's step may find cached
KEEP_BOTH_GAIN = 1.1  # hold both layouts (twice the memory) only for a >10% faster step


class CpuLinear(nn.Module):
    """nn.Linear running the kernel chosen for its batch size: ``kernels`` is
    (the choice under ``SMALL_BELOW`` rows, the choice from there up)."""

    def __init__(self, linear: nn.Linear, kernels: tuple[str, str]):
        super().__init__()
        weight = linear.weight.detach()
        self.kernels = kernels
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Parameters, as nn.Linear's weight is: a compiled step (core/cpu_step.py) finds
        # them by name, and takes them as they are (buffers it would copy).
        self.plain = frozen(weight if "plain" in kernels else None)
        self.packed = frozen(_pack(weight) if "packed" in kernels else None)
        self.bias = frozen(None if linear.bias is None else linear.bias.detach())

    def step_weights(self) -> list[torch.Tensor]:
        """What a step reads: one of the two layouts (the larger, where both are held;
        which one depends on its rows), and the bias."""
        held = [t for t in (self.plain, self.packed) if t is not None]
        return [max(held, key=lambda t: t.nbytes)] + ([] if self.bias is None else [self.bias])

    def forward(self, x: torch.Tensor, gelu: str | None = None) -> torch.Tensor:
        """``gelu`` ("tanh" or "none"): the activation, fused into the packed
        kernel's epilogue."""
        small = x.numel() < SMALL_BELOW * self.in_features
        if self.kernels[0 if small else 1] == "packed":
            return torch.ops.mkldnn._linear_pointwise(
                x, self.packed, self.bias, "none" if gelu is None else "gelu", [], gelu or "")
        out = F.linear(x, self.plain, self.bias)
        return out if gelu is None else F.gelu(out, approximate=gelu)


def frozen(t: torch.Tensor | None) -> nn.Parameter | None:
    """``t`` as a parameter that needs no grad: what a compiled step (core/cpu_step.py)
    takes as it is (a buffer it would clone, which an opaque oneDNN layout cannot be)."""
    return None if t is None else nn.Parameter(t, requires_grad=False)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, ROWS[-1])


def choose_cpu_linears(model: nn.Module, cache: str | None = None) -> None:
    """Swap every plain nn.Linear (the LM head's too; not a quantized method's subclass,
    whose forward does more) for a CpuLinear, timing both
    kernels on each weight shape first (about 1 s of a 135M model's load on 2
    cores). ``cache``: a JSON file of earlier timings on this machine, read and
    updated, so that later loads skip the timing."""
    linears = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    by_shape = defaultdict(list)
    for entry in linears:
        by_shape[tuple(entry[2].weight.shape)].append(entry)
    known = _read_timings(cache)
    for shape, entries in by_shape.items():
        key = _timing_key(shape)
        if key not in known:
            known[key] = _time_kernels([e[2].weight.detach() for e in entries])
            _write_timings(cache, known)
        kernels = _choose(known[key])
        log.info("CPU linear %s x %d: %s under %d rows, %s from there", shape, len(entries),
                 kernels[0], SMALL_BELOW, kernels[1])
        for parent, name, child in entries:
            setattr(parent, name, CpuLinear(child, kernels))
    _log_copies(model, linears)


def _log_copies(model: nn.Module, linears: list) -> None:
    """Say what memory the chosen layouts take beyond the checkpoint's weights: a linear
    that runs both kernels holds both layouts, and a packed LM head tied to the embedding
    is a second copy of the table (the embedding keeps its own for the lookups)."""
    tables = {m.weight.data_ptr() for m in model.modules() if isinstance(m, nn.Embedding)}
    copies = [(name, getattr(parent, name).packed.nbytes) for parent, name, child in linears
              if getattr(parent, name).packed is not None
              and (getattr(parent, name).plain is not None or child.weight.data_ptr() in tables)]
    if copies:
        log.info("CPU linears hold %.0f MB beyond the model's weights: packed copies of %s",
                 sum(b for _, b in copies) / 2**20, ", ".join(sorted({n for n, _ in copies})))


@torch.inference_mode()
def _time_kernels(weights: list[torch.Tensor]) -> dict[str, dict[int, float]]:
    """Seconds per call of each kernel at each of ROWS, the best of two passes over
    the weights in turn, with copies added up to STREAM_BYTES. In a step every
    weight comes from memory, and where the two kernels are close (one row on an
    Intel Xeon, docs/benchmarks.md) a weight timed from the cache picks by what the
    step never sees."""
    weights = _streamed(weights)
    forms = {"plain": weights, "packed": [_pack(w) for w in weights]}
    times = {k: {} for k in KERNELS}
    for rows in ROWS:
        x = torch.randn(rows, weights[0].shape[1])
        for kernel, ws in forms.items():
            run = _runner(kernel, x, ws)
            run()  # first calls create oneDNN primitives
            times[kernel][rows] = min(_timed(run) for _ in range(2)) / len(ws)
    return times


def _streamed(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    count = min(MAX_COPIES, max(len(weights), -(-STREAM_BYTES // weights[0].nbytes)))
    return [weights[i] if i < len(weights) else weights[i % len(weights)].clone()
            for i in range(count)]


def _timing_key(shape: tuple[int, int]) -> str:
    """Timings hold for one CPU model, thread count and torch build."""
    return (f"{cpu_model()}|{torch.get_num_threads()} threads|torch {torch.__version__}|"
            f"{STREAM_BYTES >> 20} MB streamed|{shape[0]}x{shape[1]}")


def cpu_model() -> str:
    """The CPU's name with its family and model numbers: a VM may name Zen 1 and
    Zen 5 alike ("AMD EPYC"), and their kernels' timings differ 2-4x."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n", 1)[0]
    except OSError:
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields:
        name += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    return name


def _read_timings(path: str | None) -> dict:
    """{key: {kernel: {rows: seconds}}}; an unreadable file counts as empty."""
    if path is None:
        return {}
    try:
        with open(path) as f:
            found = json.load(f)
        return {key: {k: {int(r): float(s) for r, s in t[k].items()} for k in KERNELS}
                for key, t in found.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _write_timings(path: str | None, timings: dict) -> None:
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(timings, f, indent=1)
        os.replace(tmp, path)  # atomic: a concurrent load reads the old file or this one
    except OSError as e:  # a read-only home: time again next load
        log.info("cannot cache CPU linear timings in %s: %s", path, e)


def _runner(kernel, x, weights):
    if kernel == "plain":
        return lambda: [F.linear(x, w) for w in weights]
    return lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                    for w in weights]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _choose(times: dict[str, dict[int, float]]) -> tuple[str, str]:
    """One kernel for every batch size when it is within KEEP_BOTH_GAIN of the
    best at each; otherwise the best per batch size."""
    best = {rows: min(times[k][rows] for k in KERNELS) for rows in ROWS}
    for kernel in sorted(KERNELS, key=lambda k: sum(times[k].values())):
        if all(times[kernel][rows] <= KEEP_BOTH_GAIN * best[rows] for rows in ROWS):
            return kernel, kernel
    return tuple(min(KERNELS, key=lambda k: times[k][rows]) for rows in ROWS)
