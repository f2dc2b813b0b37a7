"""KV append by plain tensor indexing: any device, any batch shape."""
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
        k_cache.view(-1, d).index_copy_(0, rows, key.reshape(-1, d))
        v_cache.view(-1, d).index_copy_(0, rows, value.reshape(-1, d))


@hookimpl
def roseinfer_register_kv_append_backends(register):
    register("torch_index", TorchIndexAppend)
