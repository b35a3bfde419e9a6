"""Physical KV blocks: ref counts, an LRU queue of free blocks, and the prefix cache.

Block 0 is the null block: it is never handed out, and padding in block tables points at it.
A full block can be cached under a hash chained from its parent's: freed, it keeps its contents and
hash and stays findable until the pool hands it out again (lazy eviction, LRU order).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], extra: object = None) -> int:
    """Hash of a full block, chained from its parent's (tests replace this to force collisions)."""
    h = hashlib.blake2b(repr((parent_hash, tuple(token_ids), extra)).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little")


def prompt_block_hashes(blocks: Iterable[Sequence[int]], cache_salt: str | None = None, *, parent: int | None = None,
                        first: int = 0) -> Iterator[int]:
    """The chained hash of each full block of a request's tokens, lazily (a prefix lookup stops at its first miss):
    block `first` on, `parent` the hash of the block before it; the salt goes into block 0's. The one place the
    chain is built: the prefix cache, its probes and the disaggregated transfer all hash alike."""
    for i, tokens in enumerate(blocks, first):
        parent = hash_block_tokens(parent, tokens, None if i else cache_salt)
        yield parent


class KVCacheBlock:
    """One physical block of the pool. `prev_free`/`next_free` thread it into the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "block_tokens", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None  # set once the block is full and cached (prefix caching)
        self.block_tokens: tuple[int, ...] | None = None  # its tokens, to rule out hash collisions
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction order (front = evicted first). O(1) everywhere."""

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self._head = KVCacheBlock(-1)  # sentinels
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, f"{block} is not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} is already free"
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def __iter__(self):
        b = self._head.next_free
        while b is not self._tail:
            yield b
            b = b.next_free


class BlockPool:
    """All physical blocks of one KV pool; hands them out and takes them back by ref count."""

    def __init__(self, num_blocks: int, on_evict: Callable[[int, int, tuple[int, ...]], None] | None = None):
        """on_evict(block_id, hash, tokens): called when a cached block is handed out again (before it is
        overwritten), so a lower tier can keep its contents."""
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # held forever
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[int, KVCacheBlock] = {}  # block hash -> block
        self.on_evict = on_evict

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` blocks from the front of the free queue, each with ref_cnt 1."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot take {n} blocks: only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            assert b.ref_cnt == 0
            self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            if self.on_evict is not None:
                self.on_evict(block.block_id, block.block_hash, block.block_tokens)
        block.block_hash = block.block_tokens = None

    def cache_block(self, block: KVCacheBlock, block_hash: int, tokens: tuple[int, ...]) -> None:
        """Make a full block findable by its hash (the first block with a hash keeps it)."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash, block.block_tokens = block_hash, tokens
            self.cached[block_hash] = block

    def get_cached_block(self, block_hash: int, tokens: tuple[int, ...]) -> KVCacheBlock | None:
        """The cached block with this hash whose tokens are exactly `tokens`, if any."""
        b = self.cached.get(block_hash)
        return b if b is not None and b.block_tokens == tokens else None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a holder to each block (sharing); a free block leaves the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one holder from each block; blocks reaching 0 join the free queue's tail in this order."""
        for b in blocks:
            if b.ref_cnt <= 0 or b is self.null_block:
                raise AssertionError(f"double free of {b}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents)."""
        for b in list(self.cached.values()):
            b.block_hash = b.block_tokens = None
        self.cached.clear()

    def usage(self) -> float:
        """Fraction of usable blocks held by requests."""
        usable = self.num_blocks - 1
        return (usable - self.num_free_blocks) / usable
