"""Metadata store of one mutable slots dataclass per block (updated in place)."""
from dataclasses import dataclass, field

from roseinfer.core.blocks import NO_HASH
from roseinfer.core.hookspecs import hookimpl


@dataclass(slots=True)
class BlockInfo:
    ref: int = 0
    hash: int = NO_HASH
    tokens: tuple = field(default=())


class SlotsStore:
    def __init__(self, num_blocks: int, block_size: int):
        self.blocks = [BlockInfo() for _ in range(num_blocks)]

    def ref(self, block):
        return self.blocks[block].ref

    def set_ref(self, block, n):
        self.blocks[block].ref = n

    def hash(self, block):
        return self.blocks[block].hash

    def tokens(self, block):
        return self.blocks[block].tokens

    def set_hash(self, block, h, tokens):
        info = self.blocks[block]
        info.hash, info.tokens = h, tuple(tokens)


@hookimpl
def roseinfer_register_metadata_stores(register):
    register("slots", SlotsStore)
