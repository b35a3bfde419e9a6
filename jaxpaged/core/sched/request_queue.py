"""The waiting queue in the scheduling policy's order (fcfs, priority, sjf, hybrid) and the policy's sort key."""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from jaxpaged.config import SchedulerConfig
from jaxpaged.request import Request

# sjf/hybrid: the output length assumed for a request without max_tokens (chat requests often set none).
UNBOUNDED_OUTPUT_ESTIMATE = 256


class WaitingQueue:
    """Waiting requests in the policy's order: FCFS (a deque), or by `rank` (a heap; see `Scheduler.rank`)."""

    def __init__(self, policy: str, rank):
        self.policy = policy
        self.rank = rank
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[object, int, Request]] = []
        self._tiebreak = itertools.count()

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._heap)

    def __iter__(self):
        return iter(self._fifo) if self.policy == "fcfs" else (e[2] for e in sorted(self._heap))

    def unordered(self):
        """The waiting requests in no particular order (without sorting the heap)."""
        return iter(self._fifo) if self.policy == "fcfs" else (e[2] for e in self._heap)

    def add(self, req: Request, *, front: bool = False) -> None:
        if self.policy == "fcfs":
            self._fifo.appendleft(req) if front else self._fifo.append(req)
        else:
            heapq.heappush(self._heap, (self.rank(req), next(self._tiebreak), req))

    def peek(self) -> Request:
        return self._fifo[0] if self.policy == "fcfs" else self._heap[0][2]

    def pop(self) -> Request:
        return self._fifo.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[2]

    def remove(self, req: Request) -> None:
        if self.policy == "fcfs":
            self._fifo.remove(req)
        else:
            self._heap = [e for e in self._heap if e[2] is not req]
            heapq.heapify(self._heap)


def predicted_work(req: Request, max_model_len: int) -> int:
    """Tokens a request still has to compute: its prompt left (all of it, and its output so far, after a
    recompute preemption), and max_tokens less what it generated (UNBOUNDED_OUTPUT_ESTIMATE tokens when
    max_tokens is unset, capped by max_model_len)."""
    room = max_model_len - len(req.prompt_token_ids)
    budget = req.sampling_params.max_tokens or min(UNBOUNDED_OUTPUT_ESTIMATE, room)
    return (max(req.num_tokens - req.num_computed_tokens, 0) + max(budget - req.num_output_tokens, 0))


def policy_rank(req: Request, config: SchedulerConfig):
    """Sort key of the policy, lower first (waiting order; the running request with the highest is the
    preemption victim). sjf/hybrid: arrival time + predicted work / aging rate, a key that does not change
    while a request waits, equivalent to lowering its work by the rate for each second waited."""
    policy = config.policy
    if policy == "priority":
        return (req.priority, req.arrival_time)
    if policy in ("sjf", "hybrid"):
        key = req.arrival_time + predicted_work(req, config.max_model_len) / config.aging_rate
        if policy == "hybrid":
            key += req.priority * config.priority_class_seconds
        return (key, req.arrival_time)
    return (req.arrival_time,)
