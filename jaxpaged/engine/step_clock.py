"""`StepClock`: when the steps on the device will end, predicted from the step times seen so far.

With async scheduling, step N+1 is scheduled as soon as step N is dispatched, so a request arriving while N
runs waits for N, for N+1 and then for its own step. Late scheduling (`EngineCore.schedule_deadline`) schedules
N+1 only shortly before N is predicted to end: requests arriving until then join N+1, as with synchronous
scheduling, while the host's work for N+1 still overlaps N on the device.

A bucket's predicted time is the shortest of its recent times (a step that ends later than predicted costs
nothing: the next one is queued behind it). A step's time is exact when its results were not ready when asked
for (it ended then) and the step before it ended the same way (it started then, or at its dispatch); otherwise
the time from its earliest possible start to its fetch bounds it from above. Both enter the record: when a
prediction was too long the device waited and the step is found done before its predicted end: it records a
fifth less than the prediction (or its bound, if shorter), and the next is scheduled earlier (scheduling early
costs less than a waiting device).
"""

from __future__ import annotations

from collections import deque

WINDOW = 8  # recent times kept per bucket
MARGIN_S = 0.001  # scheduled this much earlier than the prediction less the host's own time
SHRINK = 0.8  # a step found done records at most this part of its prediction


class StepClock:
    """Step times per token bucket, and the steps in flight with their dispatch times (perf_counter s)."""

    def __init__(self):
        self._times: dict[int, deque[float]] = {}
        self._host: deque[float] = deque(maxlen=WINDOW)  # seconds from starting to schedule to dispatched
        self._flight: deque[tuple[int, float]] = deque()  # (bucket, dispatched at), oldest first
        self._free_at: float | None = None  # when the last fetched step ended, if known exactly

    def seed(self, times: dict[int, float]) -> None:
        """Step times measured before serving (`ModelRunner.warm_steps`, seconds per bucket): a first record."""
        for bucket, seconds in times.items():
            self._record(bucket, seconds)

    def dispatched(self, bucket: int, scheduling_started: float, now: float) -> None:
        self._host.append(now - scheduling_started)
        self._flight.append((bucket, now))

    def fetched(self, now: float, waited: bool) -> None:
        """The oldest step in flight's results came in at `now`; `waited`: they were not ready when asked for."""
        bucket, dispatched = self._flight.popleft()
        start = dispatched if self._free_at is None else max(dispatched, self._free_at)  # (or later, if not exact)
        seconds = now - start  # exact when both ends are known, else too long: never too short
        if not waited and (seen := self._times.get(bucket)) and seconds < min(seen):  # done before its predicted end
            seconds = min(seconds, SHRINK * min(seen))
        self._record(bucket, seconds)
        self._free_at = now if waited else None

    def deadline(self) -> float | None:
        """The time (perf_counter s) to start scheduling the next step: just before the device finishes the steps
        in flight; None when nothing is in flight or a step's bucket has no time yet."""
        if not self._flight:
            return None
        end = self._free_at
        for bucket, dispatched in self._flight:
            if not (seen := self._times.get(bucket)):
                return None
            end = (dispatched if end is None else max(dispatched, end)) + min(seen)
        return end - max(self._host, default=0.0) - MARGIN_S

    def _record(self, bucket: int, seconds: float) -> None:
        self._times.setdefault(bucket, deque(maxlen=WINDOW)).append(seconds)
