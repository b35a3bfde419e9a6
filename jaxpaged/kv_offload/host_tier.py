"""The host-memory tier: an LRU of KV blocks keyed by block hash, in one numpy array of slots."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class HostTier:
    """`num_slots` blocks of KV in host memory, each holding one hashed block; least recently used goes first.

    `data` is [num_slots, L, 2, block_size, KH, D] in the pool's dtype (a block per contiguous row), allocated on
    first use (zero pages).
    A pinned slot (a load or a disk read this schedule promised) is never reused before `unpin_all`.
    """

    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype):
        if num_slots < 1:
            raise ValueError(f"the host tier needs at least one block, got {num_slots}")
        self.num_slots = num_slots
        self.block_shape = tuple(block_shape)  # (L, 2, block_size, KH, D)
        self.dtype = np.dtype(dtype)
        self.entries: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()  # hash -> (slot, tokens)
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.slot_hash: list[int | None] = [None] * num_slots
        self.pinned: set[int] = set()
        self._data: np.ndarray | None = None

    @property
    def data(self) -> np.ndarray:
        if self._data is None:
            self._data = np.zeros((self.num_slots, *self.block_shape), self.dtype)
        return self._data

    @property
    def block_bytes(self) -> int:
        return int(np.prod(self.block_shape)) * self.dtype.itemsize

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        """The slot holding this block (its tokens exactly), now the most recently used; or None."""
        entry = self.entries.get(block_hash)
        if entry is None or entry[1] != tokens:
            return None
        self.entries.move_to_end(block_hash)
        return entry[0]

    def key_of(self, slot: int) -> tuple[int, tuple[int, ...]] | None:
        """(hash, tokens) of the block a slot holds, or None."""
        h = self.slot_hash[slot]
        return None if h is None else (h, self.entries[h][1])

    def put(self, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        """A slot for a new block (the least recently used unpinned one if none is free), indexed under its hash
        from now on: the caller fills it before anyone reads it. None if the hash is already here or every slot
        is pinned."""
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)
            return None
        if self.free:
            slot = self.free.pop()
        else:
            victim = next((h for h, (s, _) in self.entries.items() if s not in self.pinned), None)
            if victim is None:
                return None
            slot = self.entries.pop(victim)[0]
        self.entries[block_hash] = (slot, tokens)
        self.slot_hash[slot] = block_hash
        return slot

    def pin(self, slot: int) -> None:
        self.pinned.add(slot)

    def unpin_all(self) -> None:
        self.pinned.clear()
