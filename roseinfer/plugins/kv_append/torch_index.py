"""KV append by plain tensor indexing: any device, any batch shape."""
import torch

from roseinfer.core.hookspecs import hookimpl


class TorchIndexAppend:
    def supports(self, slots, device) -> bool:
        return True

    def append(self, k_cache, v_cache, key, value, slots) -> None:
        if slots.rows is not None:
            key, value = key[slots.rows], value[slots.rows]
        if "cache_rows" not in slots.memo:  # every layer of the step writes the same rows
            slots.memo["cache_rows"] = cache_rows(slots, k_cache.shape)
        rows, d = slots.memo["cache_rows"], k_cache.shape[-1]
        # index_copy_ into the cache seen as [slots, D]: half the time of k_cache[b, :, o] =
        # key's advanced indexing on the CPU (docs/benchmarks.md), two of them a layer.
        k_cache.view(-1, d).index_copy_(0, rows, key.reshape(-1, d))
        v_cache.view(-1, d).index_copy_(0, rows, value.reshape(-1, d))


def cache_rows(slots, shape) -> torch.Tensor:
    """Row ``(block * H_kv + head) * block_size + offset`` of the cache seen as
    [blocks * H_kv * block_size, D], for each new row and head in order."""
    _, heads, block_size, _ = shape
    head = torch.arange(heads, device=slots.block_idx.device)
    first = slots.block_idx.long()[:, None] * heads + head
    return (first * block_size + slots.offsets.long()[:, None]).flatten()


@hookimpl
def roseinfer_register_kv_append_backends(register):
    register("torch_index", TorchIndexAppend)
