"""Per-request block lists on top of the `BlockPool`: allocate on demand, share cached prefixes, free."""

from __future__ import annotations

from jaxpaged.core import block_pool
from jaxpaged.core.block_pool import BlockPool, KVCacheBlock
from jaxpaged.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps each request id to the physical blocks that hold its tokens, in logical order."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.req_to_hashes: dict[str, list[int]] = {}  # chained hashes of each request's full blocks
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0  # of which found

    def _block_hashes(self, request: Request, num_tokens: int) -> list[int]:
        """Hashes of the request's full blocks within its first `num_tokens` tokens (computed once each)."""
        hashes = self.req_to_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(block_pool.hash_block_tokens(hashes[-1] if hashes else None,
                                                       request.token_ids_slice(i * bs, (i + 1) * bs)))
        return hashes

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """The longest run of cached full blocks that starts the request, leaving at least one token to compute."""
        if not self.enable_prefix_caching or not request.prefix_cacheable:
            return []
        bs = self.block_size
        hashes = self._block_hashes(request, request.num_tokens - 1)
        hits = []
        for i, h in enumerate(hashes):
            b = self.pool.get_cached_block(h, tuple(request.token_ids_slice(i * bs, (i + 1) * bs)))
            if b is None:
                break
            hits.append(b)
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVCacheBlock] = ()) -> list[KVCacheBlock] | None:
        """Give `request` room for `num_new_tokens` more tokens after `computed_blocks` (a prefix-cache hit).

        Returns the new blocks, or None (and no change) if the pool is short. Blocks that this step
        fills become cached.
        """
        held = len(self.req_to_blocks.get(request.request_id, ())) + len(computed_blocks)
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = max(0, cdiv(total, self.block_size) - held)
        evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if need + evictable_hits > self.pool.num_free_blocks:
            return None
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        self.pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        new = self.pool.get_new_blocks(need)
        blocks.extend(new)
        if self.enable_prefix_caching:
            bs = self.block_size
            hashes = self._block_hashes(request, total)
            for i in range((total - num_new_tokens) // bs, total // bs):  # blocks this step fills
                self.pool.cache_block(blocks[i], hashes[i], tuple(request.token_ids_slice(i * bs, (i + 1) * bs)))
        return new

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_of(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def free(self, request: Request) -> None:
        """Release every block of `request`, tail first: a prefix's head blocks stay cached the longest."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.pool.free_blocks(reversed(blocks))
        if request.finished:
            self.req_to_hashes.pop(request.request_id, None)
