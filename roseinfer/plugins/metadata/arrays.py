"""Struct-of-arrays metadata store: numpy columns, no per-block Python objects."""
import numpy as np

from roseinfer.core.blocks import NO_HASH
from roseinfer.core.hookspecs import hookimpl


class ArraysStore:
    def __init__(self, num_blocks: int, block_size: int):
        self.refs = np.zeros(num_blocks, dtype=np.int32)
        self.hashes = np.full(num_blocks, NO_HASH, dtype=np.int64)
        self.token_rows = np.zeros((num_blocks, block_size), dtype=np.int64)
        self.filled = np.zeros(num_blocks, dtype=np.int32)

    def ref(self, block):
        return int(self.refs[block])

    def set_ref(self, block, n):
        self.refs[block] = n

    def hash(self, block):
        return int(self.hashes[block])

    def tokens(self, block):
        return self.token_rows[block, :self.filled[block]].tolist()

    def set_hash(self, block, h, tokens):
        self.hashes[block] = h
        self.filled[block] = len(tokens)
        self.token_rows[block, :len(tokens)] = tokens


@hookimpl
def roseinfer_register_metadata_stores(register):
    register("arrays", ArraysStore)
