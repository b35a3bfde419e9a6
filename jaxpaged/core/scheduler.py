"""Continuous batching with one token budget per step (vLLM v1's scheduler, kept short).

Each request has `num_computed_tokens` catching up to `num_tokens`. A step gives running
requests their tokens first (1 for decode, the rest of a chunk for a prefill), then admits
waiting requests while budget, sequence slots and blocks last. When blocks run out, the
newest (or lowest-priority) running request is preempted by recompute.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from jaxpaged.config import SchedulerConfig
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step: its next `num_new_tokens` tokens, and its whole block table."""

    request: Request
    num_new_tokens: int
    block_ids: list[int]

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the request's known tokens (so it yields a new token)."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """What the runner executes this step, in order."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # ended since the last step (runner frees their slots)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class WaitingQueue:
    """Waiting requests: FCFS order, or (priority, arrival) order for the priority policy."""

    def __init__(self, policy: str):
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._heap)

    def __iter__(self):
        return iter(self._fifo) if self.policy == "fcfs" else (e[3] for e in sorted(self._heap))

    def add(self, req: Request, *, front: bool = False) -> None:
        if self.policy == "fcfs":
            self._fifo.appendleft(req) if front else self._fifo.append(req)
        else:
            heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._tiebreak), req))

    def peek(self) -> Request:
        return self._fifo[0] if self.policy == "fcfs" else self._heap[0][3]

    def pop(self) -> Request:
        return self._fifo.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> None:
        if self.policy == "fcfs":
            self._fifo.remove(req)
        else:
            self._heap = [e for e in self._heap if e[3] is not req]
            heapq.heapify(self._heap)


class Scheduler:
    """Decides, each step, which requests run and how many tokens each gets."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        self.config = config
        self.kv = kv_cache_manager
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_ids: list[str] = []

    # -- queue management ---------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Stop requests wherever they are and free their blocks. Unknown ids are ignored."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests with `status` (abort, or a stop string the detokenizer found) and free their blocks."""
        ended = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, status)
            ended.append(req)
        return ended

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self.kv.allocate_slots(req, n) is not None:
                out.scheduled.append(ScheduledRequest(req, n, self.kv.block_ids(req.request_id)))
                budget -= n
                i += 1
                continue
            victim = self._pick_victim(start=i)
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            # `victim` is at index >= i, so scheduled requests keep their slots; retry `req` (or the next).

        if out.preempted_ids:
            return out  # no admissions in a step that had to preempt
        while len(self.waiting) and len(self.running) < self.config.max_num_seqs and budget > 0:
            req = self.waiting.peek()
            hits = self.kv.get_computed_blocks(req)
            num_cached = len(hits) * self.kv.block_size
            n = req.num_tokens - num_cached
            if n > budget:
                if not self.config.enable_chunked_prefill:
                    break
                n = budget
            if self.kv.allocate_slots(req, n, hits) is None:
                break
            self.waiting.pop()
            self.kv.num_queried_tokens += req.num_tokens
            self.kv.num_hit_tokens += num_cached
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, self.kv.block_ids(req.request_id)))
            budget -= n
        return out

    def _pick_victim(self, start: int) -> Request:
        """The running request to preempt: the newest (fcfs) or the lowest priority, not yet scheduled."""
        candidates = self.running[start:]
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(req, front=True)

    def update_from_output(self, out: SchedulerOutput, sampled_token_ids) -> list[tuple[Request, list[int]]]:
        """Advance every scheduled request; append sampled tokens, apply stop rules, free finished ones.

        `sampled_token_ids[i]` is the token drawn for `out.scheduled[i]` (ignored for a partial prefill).
        Returns (request, new token ids) for each request that produced a token or finished.
        """
        results = []
        for i, s in enumerate(out.scheduled):
            req = s.request
            if req.finished:  # aborted while the step ran
                continue
            samples = s.samples
            req.num_computed_tokens += s.num_new_tokens
            if not samples:
                continue
            token = int(sampled_token_ids[i])
            req.output_token_ids.append(token)
            status = self._check_stop(req, token)
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
            results.append((req, [token]))
        return results

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.sampling_params
        if req.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if p.max_tokens is not None and req.num_output_tokens >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self._finished_ids.append(req.request_id)
        req.status = status
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
