"""Tensor parallelism: this process's rank in its group, and the collectives
the sharded layers call.

Every process of a group builds the same model with its own shards (the
layers ask ``group()`` for their sizes) and runs every step in lockstep; the
collectives here are no-ops in a group of one, so a model without tensor
parallelism pays one Python call per use. NCCL on CUDA (the calls are
captured in CUDA graphs like any kernel), gloo on the CPU.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from roseinfer.core.errors import ConfigError


@dataclass(frozen=True)
class Group:
    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")  # where collectives' tensors live
    # Mixtures of experts: each rank holds 1/size of the experts whole, not 1/size of
    # every expert (layers/moe.py).
    expert_parallel: bool = False


_group = Group()
_one_shot = None  # core/one_shot.py's buffers, on GPUs that map each other's memory


def group() -> Group:
    return _group


def init(rank: int, size: int, port: int, device: torch.device,
         expert_parallel: bool = False) -> None:
    """Join the group of ``size`` processes rendezvousing on localhost:``port``."""
    import torch.distributed as dist

    global _group
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            device_id=device if device.type == "cuda" else None)
    _group = Group(rank, size, device, expert_parallel)
    if device.type == "cuda":
        from roseinfer.core import one_shot
        global _one_shot
        _one_shot = one_shot.connect(rank, size, device)


@contextmanager
def assume(rank: int, size: int, expert_parallel: bool = False):
    """Build as rank ``rank`` of ``size`` would, without a group (checks, tests)."""
    global _group
    before, _group = _group, Group(rank, size, expert_parallel=expert_parallel)
    try:
        yield
    finally:
        _group = before


def destroy(finish: bool = True) -> None:
    """Leave the group, without waiting for the other ranks. NCCL's orderly teardown
    (ncclCommFinalize, then ncclCommDestroy) waits for every rank, and hung on two
    H100s after a generation had finished; aborting the communicators is local.
    ``finish``: this rank's device work is finished first, so nothing in flight is cut
    off (not when a rank is gone: its peers' collectives would never complete)."""
    import torch.distributed as dist

    global _group, _one_shot
    device, _group, one, _one_shot = _group.device, Group(), _one_shot, None
    if not dist.is_initialized():
        return
    if device.type == "cuda":
        if finish:
            torch.cuda.synchronize(device)
        if one is not None:
            from roseinfer.core.one_shot import disconnect
            disconnect(one)
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over ranks (row-parallel layers' partial results): decode-sized messages
    on GPUs through core/one_shot.py, the rest through NCCL (in place) or gloo."""
    if _group.size > 1:
        if _one_shot is not None and _one_shot.fits(x):
            return _one_shot(x)
        import torch.distributed as dist
        dist.all_reduce(x)
    return x


def all_reduce_rms_norm(x: torch.Tensor, residual: torch.Tensor | None,
                        weight: torch.Tensor, eps: float):
    """(rms_norm(s + residual), s + residual) for s the sum over ranks of ``x``, in one
    kernel (core/one_shot.py) where the one-shot path takes ``x``; else None."""
    if _group.size > 1 and _one_shot is not None and _one_shot.fits(x):
        return _one_shot(x, residual, weight, eps)
    return None


def gather_columns(x: torch.Tensor) -> torch.Tensor:
    """[rows, c] on each rank -> [rows, size * c], rank r's columns r-th (the
    vocabulary shards' logits)."""
    if _group.size == 1:
        return x
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    out = x.new_empty(_group.size * x.shape[0], x.shape[1])
    gather(out, x.contiguous())
    return out.view(_group.size, x.shape[0], x.shape[1]).transpose(0, 1).reshape(x.shape[0], -1)


def broadcast(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` into every rank's ``x`` (the sampled ids)."""
    if _group.size > 1:
        import torch.distributed as dist
        dist.broadcast(x, 0)
    return x


def smallest(value: int) -> int:
    """The smallest of the ranks' ``value``s (KV blocks that fit on every GPU)."""
    if _group.size == 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=_group.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


# ---------------------------------------------------------------- shard sizes

def split(n: int, what: str) -> int:
    """This rank's share of ``n`` (heads, intermediate size), which must divide."""
    if n % _group.size:
        raise ConfigError(f"tensor_parallel_size {_group.size} does not divide the model's "
                          f"{n} {what}; choose a size that does")
    return n // _group.size


def kv_heads(n: int) -> tuple[int, int]:
    """(K/V heads on this rank, the first one's index). With fewer K/V heads than
    ranks each is replicated on size / n ranks, next to the query heads it serves."""
    size, rank = _group.size, _group.rank
    if n >= size:
        local = split(n, "key/value heads")
        return local, rank * local
    if size % n:
        raise ConfigError(f"tensor_parallel_size {size} is neither a divisor nor a multiple "
                          f"of the model's {n} key/value heads")
    return 1, rank // (size // n)


def vocab_shard(vocab: int) -> int:
    """Rows of the embedding and LM head on each rank: the vocabulary split evenly
    and rounded up to 64 rows (cuBLAS's fast path); the last rank's tail is zeros."""
    if _group.size == 1:
        return vocab
    per_rank = -(-vocab // _group.size)
    return -(-per_rank // 64) * 64
