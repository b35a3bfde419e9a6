"""Per-request block lists on top of the `BlockPool`: allocate on demand, share, copy on write, free."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxpaged.core import block_pool
from jaxpaged.core.block_pool import BlockPool, KVCacheBlock
from jaxpaged.core.sched.output import BlockCopy
from jaxpaged.request import Request, RequestStatus

if TYPE_CHECKING:
    from jaxpaged.kv_offload import KVOffload


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps each request id to the physical blocks that hold its tokens, in logical order; and a swapped-out
    request to the host blocks that hold them while it waits."""

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False,
                 num_host_blocks: int = 0, offload: KVOffload | None = None, export_finished: bool = False):
        """offload: host/disk tiers behind the prefix cache (evicted cached blocks go there; lookups that miss
        on the device continue there). export_finished: a finished request's full blocks go there at once too
        (a prefill instance of prefill/decode disaggregation: its decode instance loads them)."""
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.host_free: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self.req_to_host_blocks: dict[str, list[int]] = {}
        self.offload = offload if enable_prefix_caching else None
        self.export_finished = export_finished and self.offload is not None
        self.exports: list[tuple[int, int, tuple[int, ...]]] = []  # (block id, hash, tokens) not yet exported
        self.pool = BlockPool(num_blocks, on_evict=self.offload.on_evict if self.offload is not None else None)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.req_to_hashes: dict[str, list[int]] = {}  # chained hashes of each request's full blocks
        self.req_to_num_cached: dict[str, int] = {}  # leading blocks of each request made findable so far
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0  # of which found
        self.pending_copies: list[BlockCopy] = []  # copy-on-write copies the next step must do first
        self.num_cow_copies = 0

    def _block_hashes(self, request: Request, num_tokens: int) -> list[int]:
        """Hashes of the request's full blocks within its first `num_tokens` tokens (computed once each)."""
        hashes = self.req_to_hashes.setdefault(request.request_id, [])
        bs, done = self.block_size, len(hashes)
        blocks = (request.token_ids_slice(i * bs, (i + 1) * bs) for i in range(done, num_tokens // bs))
        hashes.extend(block_pool.prompt_block_hashes(blocks, request.prefix_salt, parent=hashes[-1] if done else None,
                                                     first=done))
        return hashes[: num_tokens // bs]  # (more may be known from earlier steps: never hand out those)

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

    def num_cached_prefix_tokens(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """Leading tokens of `token_ids` (under `cache_salt`) whose full blocks the device's prefix cache holds now
        (a probe: nothing is recorded; data-parallel routing asks each replica)."""
        if not self.enable_prefix_caching:
            return 0
        bs, n = self.block_size, 0
        blocks = [tuple(token_ids[i * bs : (i + 1) * bs]) for i in range((len(token_ids) - 1) // bs)]
        for h, tokens in zip(block_pool.prompt_block_hashes(blocks, cache_salt), blocks):
            if self.pool.get_cached_block(h, tokens) is None:
                break
            n += bs
        return n

    def get_offloaded_blocks(self, request: Request, start: int) -> list[int]:
        """Host slots (see kv_offload) holding the request's full blocks from block `start` on, in order, up to
        the first miss; never its last token. Empty without offload tiers."""
        if self.offload is None or not request.prefix_cacheable:
            return []
        bs = self.block_size
        hashes = self._block_hashes(request, request.num_tokens - 1)
        slots = []
        for i in range(start, len(hashes)):
            slot = self.offload.find(hashes[i], tuple(request.token_ids_slice(i * bs, (i + 1) * bs)))
            if slot is None:
                break
            slots.append(slot)
        return slots

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[KVCacheBlock] = (),
                       offloaded: list[int] = ()) -> list[KVCacheBlock] | None:
        """Give `request` room for `num_new_tokens` more tokens after `computed_blocks` (a prefix-cache hit)
        and the blocks held in host slots `offloaded` (loaded into the first new blocks this step).

        Returns the new blocks, or None (and no change) if the pool is short. Blocks that this step
        fills become cached.
        """
        held = len(self.req_to_blocks.get(request.request_id, ())) + len(computed_blocks)
        start = request.num_computed_tokens + (len(computed_blocks) + len(offloaded)) * self.block_size
        total = start + num_new_tokens
        need = max(0, cdiv(total, self.block_size) - held)
        shared = self._shared_written_blocks(request.request_id, start, total)
        evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if need + len(shared) + evictable_hits > self.pool.num_free_blocks:
            return None
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        for i in shared:  # copy on write: this request gets its own copy of a block others still hold
            (dst,) = self.pool.get_new_blocks(1)
            self.pending_copies.append(BlockCopy(blocks[i].block_id, dst.block_id))
            self.pool.free_blocks([blocks[i]])
            blocks[i] = dst
            self.num_cow_copies += 1
        self.pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        new = self.pool.get_new_blocks(need)
        blocks.extend(new)
        for slot, b in zip(offloaded, new):
            self.offload.load(slot, b.block_id)
        if self.enable_prefix_caching:
            # Full blocks whose tokens are all known (a placeholder for a token still being drawn is not) become
            # findable; a block completed by a placeholder is cached on a later call, once the token is known.
            bs = self.block_size
            done = self.req_to_num_cached.get(request.request_id, len(computed_blocks))
            full = min(total, request.num_tokens) // bs
            if full > done:
                hashes = self._block_hashes(request, full * bs)
                for i in range(done, full):
                    self.pool.cache_block(blocks[i], hashes[i], tuple(request.token_ids_slice(i * bs, (i + 1) * bs)))
                self.req_to_num_cached[request.request_id] = full
        return new

    def _shared_written_blocks(self, request_id: str, start: int, total: int) -> list[int]:
        """Indexes of held blocks that tokens [start, total) would write and that someone else also holds."""
        blocks = self.req_to_blocks.get(request_id, [])
        first, last = start // self.block_size, min(len(blocks), cdiv(total, self.block_size))
        return [i for i in range(first, last) if blocks[i].ref_cnt > 1]

    def fork(self, parent: Request, child: Request, num_tokens: int, *, share: bool = True) -> None:
        """Give `child` the parent's blocks that hold its first `num_tokens` tokens: shared (ref counts),
        or with share=False fresh blocks and a copy of each (raises if the pool is short)."""
        if child.request_id in self.req_to_blocks:
            raise ValueError(f"request {child.request_id!r} already holds blocks")
        blocks = self.req_to_blocks[parent.request_id][: cdiv(num_tokens, self.block_size)]
        if share:
            self.pool.touch(blocks)
            self.req_to_blocks[child.request_id] = list(blocks)
            return
        copies = self.pool.get_new_blocks(len(blocks))
        self.pending_copies += [BlockCopy(a.block_id, b.block_id) for a, b in zip(blocks, copies)]
        self.req_to_blocks[child.request_id] = copies

    def take_copies(self) -> list[BlockCopy]:
        """The copy-on-write copies recorded since the last call (the next step's `block_copies`)."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_of(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    # -- swapping ---------------------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        return 0 < len(self.req_to_blocks.get(request.request_id, ())) <= len(self.host_free)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to host blocks: returns (device block, host block) pairs to copy, and
        drops its device references (shared blocks stay with their other holders)."""
        blocks = self.req_to_blocks.pop(request.request_id)
        self.req_to_num_cached.pop(request.request_id, None)  # (its blocks come back as new ones)
        host = [self.host_free.pop() for _ in blocks]
        self.req_to_host_blocks[request.request_id] = host
        self.pool.free_blocks(reversed(blocks))
        return [(b.block_id, h) for b, h in zip(blocks, host)]

    def is_swapped(self, request: Request) -> bool:
        return request.request_id in self.req_to_host_blocks

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request back into fresh device blocks with room for `num_new_tokens` more:
        returns (host block, device block) pairs to copy, or None (and no change) if the pool is short."""
        host = self.req_to_host_blocks[request.request_id]
        total = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        if max(total, len(host)) > self.pool.num_free_blocks:
            return None
        blocks = self.pool.get_new_blocks(max(total, len(host)))
        self.req_to_blocks[request.request_id] = blocks
        del self.req_to_host_blocks[request.request_id]
        self.host_free.extend(reversed(host))
        return [(h, b.block_id) for h, b in zip(host, blocks)]

    def take_exports(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """The finished requests' blocks to export (prefill/decode disaggregation), (block id, hash, tokens):
        the caller copies them before the next schedule can hand the blocks out again."""
        out, self.exports = self.exports, []
        return out

    def free(self, request: Request) -> None:
        """Release every block of `request` (device and host), tail first: a prefix's head blocks stay cached
        the longest."""
        self.host_free.extend(reversed(self.req_to_host_blocks.pop(request.request_id, [])))
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_num_cached.pop(request.request_id, None)
        if self.export_finished and request.status.finished and request.status != RequestStatus.FINISHED_ABORTED:
            self.exports.extend((b.block_id, b.block_hash, b.block_tokens)  # (full and computed: cached)
                                for b in blocks if b.block_hash is not None)
        self.pool.free_blocks(reversed(blocks))
        if request.finished:
            self.req_to_hashes.pop(request.request_id, None)
