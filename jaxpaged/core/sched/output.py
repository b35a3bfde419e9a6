"""The scheduler's output contract: what one step runs (`SchedulerOutput`), as the runner reads it. The runner
imports this, not the scheduler.

What the runner needs travels as changes: a request's whole block table only when it (re)enters the batch or
copy-on-write replaced a block, else just the blocks added this step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from jaxpaged.request import Request


class BlockCopy(NamedTuple):
    """Copy the K/V of physical block `src` into block `dst` (all layers) before the step writes."""

    src: int
    dst: int


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: tokens [start, start + num_new_tokens), and its block-table changes."""

    request: Request
    num_new_tokens: int
    start: int  # num_computed_tokens before this step
    samples: bool  # the step reaches the end of the request's tokens, so it draws the next one
    block_ids: list[int] | None = None  # the whole table, when the request (re)enters the batch or a block changed
    new_block_ids: list[int] | tuple = ()  # else: blocks appended this step


@dataclass
class SchedulerOutput:
    """What the runner executes this step, in order.

    The scheduled requests are parallel lists (index i is one request's share of the step), so a step of a
    thousand decodes costs a few list appends each; block-table changes are sparse, keyed by index.
    """

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # num_computed_tokens before this step
    samples: list[bool] = field(default_factory=list)  # the step reaches the end of the tokens: it draws one
    block_ids: dict[int, list[int]] = field(default_factory=dict)  # whole tables: requests (re)entering the batch,
    # or whose table copy-on-write changed
    new_block_ids: dict[int, list[int]] = field(default_factory=dict)  # blocks appended this step
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # ended since the last step (runner frees their rows)
    fork_copies: list[BlockCopy] = field(default_factory=list)  # forks by copy since the last step: done first
    block_copies: list[BlockCopy] = field(default_factory=list)  # copy-on-write, done before the step writes
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block), done first
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block), done last
    # offload tiers (kv_offload): evicted cached blocks kept in host slots, done before anything else; prefix
    # blocks found in a tier loaded into fresh device blocks, done after everything else
    kv_store: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    kv_load: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    # speculative decoding: index in `requests` -> the draft tokens the step verifies after the request's last
    # token (they are the last of its num_new_tokens; it draws after the last accepted one)
    spec_tokens: dict[int, list[int]] = field(default_factory=dict)
    # LoRA adapters to load before this step: (slot of the device's LoRA stack, the adapter), `core/lora_slots.py`
    lora_loads: list[tuple[int, object]] = field(default_factory=list)

    def add(self, req: Request, n: int, start: int, samples: bool, block_ids: list[int] | None = None,
            new_block_ids: list[int] | None = None) -> None:
        i = len(self.requests)
        self.requests.append(req)
        self.num_new_tokens.append(n)
        self.starts.append(start)
        self.samples.append(samples)
        if block_ids is not None:
            self.block_ids[i] = block_ids
        elif new_block_ids:
            self.new_block_ids[i] = new_block_ids

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        """The step as one record per request (for tests and tools; the hot paths read the lists)."""
        return [ScheduledRequest(r, n, st, sa, self.block_ids.get(i), self.new_block_ids.get(i, ()))
                for i, (r, n, st, sa) in enumerate(zip(self.requests, self.num_new_tokens, self.starts, self.samples))]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def moves_blocks(self) -> bool:
        """Whether the runner has block copies or swaps to do (even in a step that computes nothing)."""
        return bool(self.fork_copies or self.block_copies or self.swap_out or self.swap_in or self.kv_store
                    or self.kv_load)
