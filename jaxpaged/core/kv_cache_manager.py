"""Per-request block lists on top of the `BlockPool`: allocate on demand, free at the end."""

from __future__ import annotations

from jaxpaged.core.block_pool import BlockPool, KVCacheBlock
from jaxpaged.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps each request id to the physical blocks that hold its tokens, in logical order."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_of(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        held = len(self.req_to_blocks.get(request.request_id, ()))
        return max(0, cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - held)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[KVCacheBlock] | None:
        """Give `request` room for `num_new_tokens` more tokens; None (and no change) if the pool is short."""
        need = self.num_blocks_needed(request, num_new_tokens)
        if need > self.pool.num_free_blocks:
            return None
        new = self.pool.get_new_blocks(need)
        self.req_to_blocks.setdefault(request.request_id, []).extend(new)
        return new

    def free(self, request: Request) -> None:
        """Release every block of `request`; the tail block is freed first, so it is evicted last."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.pool.free_blocks(reversed(blocks))
