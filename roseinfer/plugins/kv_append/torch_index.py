"""KV append by plain tensor indexing: any device, any batch shape, any cache dtype (an
FP8 cache takes the keys and values rounded to e4m3, scale 1)."""
import torch

from roseinfer.core.hookspecs import hookimpl
from roseinfer.core.kv_cache import cache_rows


class TorchIndexAppend:
    def supports(self, slots, device) -> bool:
        return True

    def append(self, k_cache, v_cache, key, value, slots) -> None:
        if slots.rows is not None:
            key, value = key[slots.rows], value[slots.rows]
        _, heads, block_size, d = k_cache.shape
        if "cache_rows" not in slots.memo:  # every layer of the step writes the same rows
            slots.memo["cache_rows"] = cache_rows(slots.block_idx, slots.offsets, heads,
                                                  block_size).flatten()
        rows = slots.memo["cache_rows"]
        # index_copy_ into the cache seen as [slots, D]: half the time of k_cache[b, :, o] =
        # key's advanced indexing on the CPU (docs/benchmarks.md), two of them a layer.
        for cache, x in ((k_cache, key), (v_cache, value)):
            x = x.reshape(-1, d).to(cache.dtype)
            if cache.dtype.itemsize == 1 and cache.is_floating_point():
                # an FP8 cache (no index_copy_ for FP8 on the CPU): its bytes
                cache, x = cache.view(torch.uint8), x.view(torch.uint8)
            cache.view(-1, d).index_copy_(0, rows, x)


@hookimpl
def roseinfer_register_kv_append_backends(register):
    register("torch_index", TorchIndexAppend)
