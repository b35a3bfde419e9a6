"""Measured step times per token bucket, and the prompt tokens a step should carry given them.

A step is padded to its token bucket, so on a CPU (where a step's time follows its padded tokens) a prompt
just past a bucket pays for the padding: SmolLM2 float32 on 2 cores with the 1.5x buckets, a 260-token prompt
beside 4 decodes filled a 384-token step (228 ms measured) though a 256-token step (164 ms) and a 12-token one
for the last 8 (29 ms) finish it sooner, and the decodes get two tokens instead of one. With each bucket's time measured
(`ModelRunner.warm_steps`, before serving), the scheduler picks, among "all it may take" and "exactly fill a
smaller bucket", the split that finishes the waiting prompt tokens first. On a GPU, where small steps cost
about the same, it keeps taking all it may.

Where a step costs its real tokens rather than its bucket (float32 CPU weights packed for the dense call, which
skips the padding rows: `ModelRunner.pays_for_padding`), a partly filled bucket's time is interpolated between
the bucket below (at its size) and its own (`by_tokens`); a split then pays only where a step's fixed cost is
small against the jump it avoids, which is rare.
"""

from __future__ import annotations

from jaxpaged.config.buckets import pick_token_bucket

# a split must beat taking everything by this fraction (step times are measured once, with some noise)
MIN_GAIN = 0.05


class StepCosts:
    """Seconds a step of each token bucket takes, made non-decreasing in the bucket (a measured bigger step
    that came out cheaper than a smaller one is noise). Measured on empty steps, which sample the fewest rows:
    a step where many rows draw costs a little more."""

    def __init__(self, seconds: dict[int, float], by_tokens: bool = False):
        if not seconds:
            raise ValueError("StepCosts needs the time of at least one bucket")
        self.by_tokens = by_tokens
        self.buckets = sorted(seconds)
        self.seconds: dict[int, float] = {}
        cheapest = float("inf")
        for t in reversed(self.buckets):
            cheapest = min(cheapest, seconds[t])
            self.seconds[t] = cheapest

    def can_split(self) -> bool:
        """Whether any split can pay: some bucket plus the smallest costs less than the next bucket up."""
        b, smallest = self.buckets, self.seconds[self.buckets[0]]
        return any(self.seconds[lo] + smallest < self.seconds[hi] * (1 - MIN_GAIN) for lo, hi in zip(b, b[1:]))

    def of(self, num_tokens: int) -> float:
        """Seconds of the step that carries `num_tokens`: its bucket's, or with `by_tokens` interpolated between
        the bucket below (at its size) and its own."""
        b = pick_token_bucket(self.buckets, num_tokens)
        i = self.buckets.index(b)
        if not self.by_tokens or i == 0:
            return self.seconds[b]
        lo = self.buckets[i - 1]
        return self.seconds[lo] + (self.seconds[b] - self.seconds[lo]) * (num_tokens - lo) / (b - lo)

    def fraction(self, bucket: int, num_tokens: int) -> float:
        """The share of a full `bucket` step's time that a step of `num_tokens` in it takes (1 unless by_tokens)."""
        if not self.by_tokens or bucket not in self.seconds or not 0 < num_tokens < bucket:
            return 1.0
        return self.of(num_tokens) / self.seconds[bucket]

    def finish(self, decodes: int, prompt_tokens: int, limit: int) -> float:
        """Seconds to compute `prompt_tokens` beside `decodes` decode tokens a step, at most `limit` a step."""
        total = 0.0
        while prompt_tokens > 0:
            n = min(prompt_tokens, limit)
            total += self.of(decodes + n)
            prompt_tokens -= n
        return total

    def prompt_tokens(self, decodes: int, ready: int, limit: int) -> int:
        """Prompt tokens this step should carry: `limit` (what it may take), or fewer so that the step exactly
        fills a smaller bucket, when the prompts' `ready` tokens then finish sooner (by MIN_GAIN)."""
        take = min(ready, limit)
        if take <= 0 or decodes + take > self.buckets[-1]:
            return limit
        best, best_time = limit, self.finish(decodes, ready, limit) * (1 - MIN_GAIN)
        for b in self.buckets:
            n = b - decodes
            if n >= take:
                break
            if n <= 0:
                continue
            t = self.seconds[b] + self.finish(decodes, ready - n, limit)
            if t <= best_time:  # (a tie: the bigger chunk)
                best, best_time = n, t
        return best
