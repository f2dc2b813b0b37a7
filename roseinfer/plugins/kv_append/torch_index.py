"""KV append by plain tensor indexing: any device, any batch shape, any cache dtype (an
FP8 cache takes the keys and values rounded to e4m3, scale 1, saturated at 448)."""
import torch

from roseinfer.core.hookspecs import hookimpl
from roseinfer.core.kv_cache import cache_rows
from roseinfer.models.quantization import FP8, FP8_MAX


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
            x = x.reshape(-1, d)
            if cache.dtype == FP8:
                # saturated at 448 as the Triton append does (e4m3 has no infinity), and
                # written as bytes: no index_copy_ for FP8 on the CPU
                x = x.clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
                cache = cache.view(torch.uint8)
            cache.view(-1, d).index_copy_(0, rows, x.to(cache.dtype))


@hookimpl
def roseinfer_register_kv_append_backends(register):
    register("torch_index", TorchIndexAppend)
