"""`StepClock`: when the steps on the device will end, predicted from the step times seen so far.

With async scheduling, step N+1 is scheduled as soon as step N is dispatched, so a request arriving while N
runs waits for N, for N+1 and then for its own step. Late scheduling (`EngineCore.schedule_deadline`) schedules
N+1 only shortly before N is predicted to end: requests arriving until then join N+1, as with synchronous
scheduling, while the host's work for N+1 still overlaps N on the device.

A bucket's predicted time is the shortest of its recent times (a step that ends later than predicted costs
nothing: the next one is queued behind it). A step's time is exact when its results were not ready when asked
for (it ended then) and it started at a known time (when the step before it ended so, or at its dispatch if
the device was free by then). When a prediction was too long the device waited, and the step is found done
before its predicted end: it records a fifth less than the prediction (or less, if its time is known to be
shorter), and the next is scheduled earlier (scheduling early costs less than a waiting device). A step found
done later than predicted (fetched late, e.g. after the engine idled) tells nothing.

Where a step costs its real tokens rather than its bucket (`ModelRunner.pays_for_padding` False), a step of n
tokens is predicted to take `StepCosts.fraction(bucket, n)` of its bucket's time (interpolated from the warm
steps' times), and its measured time is recorded divided by that share: a bucket's times stay comparable
however full its steps were.
"""

from __future__ import annotations

from collections import deque

from jaxpaged.core.step_costs import StepCosts

WINDOW = 8  # recent times kept per bucket
MARGIN_S = 0.001  # scheduled this much earlier than the prediction less the host's own time
SHRINK = 0.8  # a step found done records at most this part of its prediction


class StepClock:
    """Step times per token bucket, and the steps in flight with their dispatch times (perf_counter s)."""

    def __init__(self):
        self._times: dict[int, deque[float]] = {}
        self._seeded: dict[int, float] = {}  # times measured before serving, until a bucket has its own
        self._host: deque[float] = deque(maxlen=WINDOW)  # seconds from starting to schedule to dispatched
        self._flight: deque[tuple[int, float, float]] = deque()  # (bucket, share of it, dispatched at), oldest first
        self._costs: StepCosts | None = None  # a partly filled step's share of its bucket's time (by_tokens)
        self._last_end = float("-inf")  # when the last fetched step ended (exactly) or by when (it was found done)
        self._last_end_exact = True

    def seed(self, times: dict[int, float], by_tokens: bool = False) -> None:
        """Step times measured before serving (`ModelRunner.warm_steps`, seconds per full bucket), used for a
        bucket until one of its steps is seen (they ran without prompts: no attention work, so shorter than a
        prefill). by_tokens: a step costs its real tokens, not its bucket."""
        self._seeded.update(times)
        self._costs = StepCosts(self._seeded, by_tokens=True) if by_tokens and self._seeded else None

    def dispatched(self, bucket: int, scheduling_started: float, now: float, num_tokens: int | None = None) -> None:
        """A step of `bucket` (carrying `num_tokens` real tokens, if known) was dispatched at `now`."""
        share = self._costs.fraction(bucket, num_tokens) if self._costs is not None and num_tokens else 1.0
        self._host.append(now - scheduling_started)
        self._flight.append((bucket, share, now))

    def fetched(self, now: float, waited: bool) -> None:
        """The oldest step in flight's results came in at `now`; `waited`: they were not ready when asked for."""
        bucket, share, dispatched = self._flight.popleft()
        exact_start = self._last_end_exact or dispatched >= self._last_end
        start = max(dispatched, self._last_end) if self._last_end_exact else dispatched  # (its earliest start)
        predicted = self._predicted(bucket)
        predicted = None if predicted is None else predicted * share
        if waited and exact_start:
            self._record(bucket, (now - start) / share)
        elif not waited and predicted is not None and now - start < predicted:  # done before its predicted end
            self._record(bucket, min(now - start, SHRINK * predicted) / share)
        self._last_end, self._last_end_exact = now, waited

    def deadline(self) -> float | None:
        """The time (perf_counter s) to start scheduling the next step: just before the device finishes the steps
        in flight; None when nothing is in flight or a step's bucket has no time yet."""
        if not self._flight:
            return None
        end = self._last_end if self._last_end_exact else None
        for bucket, share, dispatched in self._flight:
            if (predicted := self._predicted(bucket)) is None:
                return None
            end = (dispatched if end is None else max(dispatched, end)) + predicted * share
        return end - max(self._host, default=0.0) - MARGIN_S

    def _record(self, bucket: int, seconds: float) -> None:
        self._times.setdefault(bucket, deque(maxlen=WINDOW)).append(seconds)

    def _predicted(self, bucket: int) -> float | None:
        seen = self._times.get(bucket)
        return min(seen) if seen else self._seeded.get(bucket)
