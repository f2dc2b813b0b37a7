"""The project's own W4A16 kernel for 1 to 64 rows (``int4_mma.cu``): 4-bit levels
unpacked in registers straight into tensor-core fragments, the Marlin recipe.

Built with nvcc on the machine at first use (about a minute; kept under the cache), for
the GPU it runs on. Its words hold GPTQ's levels (input 8r + j of a column in word r),
with the nibbles of each word in the order ``SIGMA`` (two neighbouring inputs a mask
apart), and are stored in panels of 32 columns, ``[N / 32, K / 8, 32]``, so that each
block of the kernel streams long runs; scales and shifts bf16 in the same panels,
``[N / 32, K / group, 32]``: ``w = level * scale + shift``.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from roseinfer.core.triton_support import dependent_launch

SOURCE = Path(__file__).with_name("int4_mma.cu")
SIGMA = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble j of a word holds input 8r + SIGMA[j]
MAX_ROWS = 64
PANEL = 32  # columns a panel: words, scales and shifts are stored panel by panel
GROUPS = (32, 64, 128)
# Block shapes the library is built with (int4_mma.cu, launch_config): columns a block,
# chunks of 128 inputs a stage
CONFIGS = {0: (128, 2), 1: (64, 4), 2: (32, 4), 3: (128, 1), 4: (32, 1)}
PARTIALS = 1 << 22  # float32 sums of split inputs: splits x rows x N at most
COUNTERS = 1 << 16  # column blocks a linear, at most


def runs(device: torch.device, n: int, k: int, group: int) -> bool:
    """Whether the kernel takes this weight here: a CUDA GPU of compute capability 8.0 or
    up with nvcc to build it, outputs in whole panels, inputs in whole chunks of 128."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0) \
        and _cuda_home() is not None and n % PANEL == 0 and k % 128 == 0 and group in GROUPS


def _cuda_home():
    """torch's: $CUDA_HOME, or where nvcc is found."""
    from torch.utils.cpp_extension import CUDA_HOME
    return CUDA_HOME


@functools.cache
def ops(capability: tuple[int, int]):
    """The kernel's ops for GPUs of this compute capability (built here once)."""
    from roseinfer.layers.extensions import build_library

    arch = f"{capability[0]}{capability[1]}"
    return build_library(SOURCE, "roseinfer_int4", ("-O3",), f"sm_{arch}",
                         "the 4-bit tensor-core kernel",
                         ("-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}"))


def panels(rows: torch.Tensor) -> torch.Tensor:
    """[R, N] (N a multiple of 32) as the kernel streams it: [N / 32, R, 32]."""
    r, n = rows.shape
    return rows.view(r, n // PANEL, PANEL).transpose(0, 1).contiguous()


def pack(levels: torch.Tensor) -> torch.Tensor:
    """Words [N / 32, K / 8, 32] int32 of levels [N, K] (0..15), nibbles in SIGMA's
    order."""
    n, k = levels.shape
    per_word = levels.to(torch.int32).view(n, k // 8, 8)[..., list(SIGMA)]
    shifts = torch.arange(0, 32, 4, device=levels.device, dtype=torch.int32)
    return panels((per_word << shifts).sum(-1, dtype=torch.int32).t())


def levels_of(words: torch.Tensor) -> torch.Tensor:
    """``pack``'s inverse: levels [N, K] int32."""
    p, rows, _ = words.shape
    nibbles = words.unsqueeze(-1) >> torch.arange(0, 32, 4, device=words.device) & 15
    order = torch.tensor(SIGMA).argsort()
    return nibbles[..., order].transpose(1, 2).reshape(p * PANEL, rows * 8)


class Workspace:
    """Float32 sums of split inputs and a counter per column block, one a device: linears
    run one at a time on a stream, and each call leaves the counters at zero."""

    def __init__(self, device: torch.device):
        self.partials = torch.empty(PARTIALS, dtype=torch.float32, device=device)
        self.counters = torch.zeros(COUNTERS, dtype=torch.int32, device=device)


@functools.cache
def workspace(device: torch.device) -> Workspace:
    return Workspace(device)


def fits(config: int, splits: int, n: int, k: int) -> bool:
    """Whether a block config and split count tile [N, K] whole: whole blocks of columns,
    the inputs split into whole stages."""
    columns, chunks = CONFIGS[config]
    return n % columns == 0 and (k // 128) % (splits * chunks) == 0


BUCKETS = (8, 16, 32, 64)  # rows a batch tile bucket holds: one kernel build each
SPLITS = (1, 2, 4, 7, 8, 14, 16)
FLUSH_BYTES = 256 << 20  # over L2 (50 MB on an H100, 60 on an H200): tuned from memory
_tuned: dict = {}


def candidates(m: int, n: int, k: int):
    """Every (config, splits) that tiles [N, K] for m rows within the partials."""
    return [(config, splits) for config in CONFIGS for splits in SPLITS
            if fits(config, splits, n, k) and splits * m * n <= PARTIALS]


def tune(words: torch.Tensor, scales: torch.Tensor, shifts: torch.Tensor) -> None:
    """Times every candidate for this weight's shape at each bucket's rows, the weight
    read from memory (L2 flushed before each call), and keeps the fastest for ``mm``:
    about 0.1 s a shape, once a process. Block shapes and splits are chosen by timing
    because the best differ by shape and GPU (docs/kernels.md, "INT4 linears")."""
    device = words.device
    n, k = words.shape[0] * PANEL, words.shape[1] * 8
    if (device, n, k) in _tuned:
        return
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = {}
    for m in BUCKETS:
        x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
        times = {}
        for config, splits in candidates(m, n, k):
            mm(x, words, scales, shifts, config, splits)  # its first launch sizes its memory
            took = []
            for _ in range(3):
                flush.zero_()
                start.record()
                mm(x, words, scales, shifts, config, splits)
                end.record()
                end.synchronize()
                took.append(start.elapsed_time(end))
            times[(config, splits)] = min(took)
        best[m] = min(times, key=times.get)
    _tuned[(device, n, k)] = best


def choose(m: int, n: int, k: int, device: torch.device) -> tuple[int, int]:
    """(config, splits) for m rows: the tuned ones, else the first that fits."""
    bucket = next(b for b in BUCKETS if m <= b)
    tuned = _tuned.get((device, n, k))
    return tuned[bucket] if tuned else candidates(bucket, n, k)[0]


def mm(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, shifts: torch.Tensor,
       config: int | None = None, splits: int | None = None) -> torch.Tensor:
    """x [M, K] bf16 (M <= 64) times the packed weight: [M, N] bf16. ``config`` and
    ``splits`` (both or neither) override ``choose``'s."""
    m, k = x.shape
    n = words.shape[0] * PANEL
    if config is None:
        config, splits = choose(m, n, k, x.device)
    w = workspace(x.device)
    return ops(torch.cuda.get_device_capability(x.device)).mm(
        x.contiguous(), words, scales, shifts, w.partials, w.counters, config, splits,
        dependent_launch(x.device, m))
