"""KV append by plain tensor indexing: any device, any batch shape."""
from roseinfer.core.hookspecs import hookimpl


class TorchIndexAppend:
    def supports(self, slots, device) -> bool:
        return True

    def append(self, k_cache, v_cache, key, value, slots) -> None:
        if slots.rows is not None:
            key, value = key[slots.rows], value[slots.rows]
        b, o = slots.block_idx, slots.offsets  # int32 indexes: a .long() copy costs more
        k_cache[b, :, o] = key
        v_cache[b, :, o] = value


@hookimpl
def roseinfer_register_kv_append_backends(register):
    register("torch_index", TorchIndexAppend)
