"""`DraftBudget`: how many proposed draft tokens a step verifies, chosen to raise the step's tokens per second.

A draft token costs compute whether or not it is accepted. Where a step is bound by reading the weights (small
batches; a GPU below its compute limit), extra tokens are nearly free and every likely draft pays; where it is
bound by compute (a CPU, or a large batch), a draft pays only if it is accepted often enough. The budget keeps
the drafts that maximize (tokens the step yields) / (the step's time): the step's own tokens plus each draft's
chance of acceptance (a request's conditional acceptance rate a, compounding: position j is kept with a^(j+1)),
over the time of the token bucket they fill (timed once per bucket at startup, then a running average of what
steps actually take). Where a step costs its real tokens rather than its bucket (`by_tokens`: packed CPU
weights skip padding rows, `ModelRunner.pays_for_padding`), a partly filled bucket costs the interpolation
between the bucket below (at its size) and its own, every draft count is a candidate, and an observed step's
time counts for its full bucket scaled by that share.
"""

from __future__ import annotations

import bisect

from jaxpaged.request import Request

PRIOR_ACCEPTANCE = 0.5  # a request's conditional acceptance rate before any of its drafts were verified
PRIOR_WEIGHT = 2.0  # pseudo-verifications the prior is worth (shrinks a new request's rate toward the global one)
STEP_TIME_DECAY = 0.9  # running average of observed step times, per bucket
# Drafts must promise this much more than the step's own rate: step times are noisy, and when the batch runs to
# its end (nothing waiting) tokens gained by some requests do not shorten the others.
MIN_GAIN = 0.1


class DraftBudget:
    """Step times per token bucket, acceptance rates, and the choice of drafts for a step."""

    def __init__(self, buckets: list[int], by_tokens: bool = False):
        self.buckets = list(buckets)
        self.by_tokens = by_tokens
        # token bucket -> seconds a step of it takes, without drafts and verifying some (their LM-head rows)
        self.step_seconds: dict[bool, dict[int, float]] = {False: {}, True: {}}
        self.accepted = 0  # accepted drafts over all requests
        self.rejections = 0  # verifications that ended at a rejected draft

    # -- what is measured -------------------------------------------------------------------
    def observe_step(self, bucket: int, seconds: float, with_drafts: bool, num_tokens: int | None = None) -> None:
        """A step of `bucket` took `seconds`; with by_tokens, one of `num_tokens` real tokens (scaled to a full
        bucket's time by its estimated share)."""
        table = self.step_seconds[with_drafts]
        if self.by_tokens and num_tokens is not None and 0 < num_tokens < bucket and bucket in table:
            full = self.seconds(bucket, with_drafts)
            share = self.seconds(num_tokens, with_drafts) / full if full > 0 else 1.0
            seconds /= max(share, 1e-3)
        old = table.get(bucket)
        table[bucket] = seconds if old is None else STEP_TIME_DECAY * old + (1 - STEP_TIME_DECAY) * seconds

    def observe_verification(self, num_drafts: int, num_accepted: int) -> None:
        self.accepted += num_accepted
        self.rejections += num_accepted < num_drafts

    def acceptance(self, req: Request) -> float:
        """The request's estimated probability that a draft is accepted given the ones before it were."""
        judged = self.accepted + self.rejections
        prior = (self.accepted + PRIOR_WEIGHT * PRIOR_ACCEPTANCE) / (judged + PRIOR_WEIGHT)
        mine = req.num_accepted_tokens + req.num_draft_rejections
        return (req.num_accepted_tokens + PRIOR_WEIGHT * prior) / (mine + PRIOR_WEIGHT)

    def seconds(self, tokens: int, with_drafts: bool, full: dict[int, float] | None = None) -> float:
        """Estimated time of a step of `tokens` tokens: its bucket's, never less than a smaller bucket's (or, with
        drafts, than the same step without them: timings are noisy); past the timed buckets, linear in tokens.
        With by_tokens, a partly filled bucket: interpolated from the bucket below at its size. full: each
        bucket's time, where a caller asking for many sizes has them (`trim`)."""
        i = bisect.bisect_left(self.buckets, tokens)
        bucket = self.buckets[min(i, len(self.buckets) - 1)]
        if self.by_tokens and 0 < i < len(self.buckets) and tokens < bucket:
            lo = self.buckets[i - 1]
            below, top = ((full[lo], full[bucket]) if full is not None
                          else (self._timed(lo, lo, with_drafts), self._timed(bucket, bucket, with_drafts)))
            return below + (top - below) * (tokens - lo) / (bucket - lo)
        return self._timed(tokens, bucket, with_drafts)

    def _timed(self, tokens: int, bucket: int, with_drafts: bool) -> float:
        best, largest = 0.0, 0
        tables = (self.step_seconds[False], self.step_seconds[True]) if with_drafts else (self.step_seconds[False],)
        for table in tables:
            for b, t in table.items():
                if b <= bucket:
                    best, largest = max(best, t), max(largest, b)
        return best * max(tokens, largest) / largest if largest and bucket > largest else best

    # -- the choice ---------------------------------------------------------------------------
    def trim(self, base_tokens: int, proposals: list[Request], max_tokens: int) -> int:
        """Cut each proposing request's `spec_token_ids` to the drafts worth verifying in a step that computes
        `base_tokens` tokens anyway (at most `max_tokens` in all). Returns the draft tokens kept."""
        if not self.step_seconds[True]:  # (not timed: keep every draft)
            return sum(len(r.spec_token_ids) for r in proposals)
        chances = []  # (probability of acceptance, request index)
        for i, req in enumerate(proposals):
            a, p = self.acceptance(req), 1.0
            for _ in req.spec_token_ids:
                p *= a
                chances.append((p, i))
        chances.sort(key=lambda c: -c[0])
        room = max(0, min(len(chances), max_tokens - base_tokens))
        # more drafts in the same bucket cost nothing more: try each bucket filled (or every draft kept); where
        # a step costs its tokens, every count
        best, best_rate = 0, (1 + MIN_GAIN) * base_tokens / max(self.seconds(base_tokens, False), 1e-9)
        cumulative = [0.0]
        for p, _ in chances[:room]:
            cumulative.append(cumulative[-1] + p)
        counts = range(1, room + 1) if self.by_tokens else (min(b - base_tokens, room) for b in self.buckets)
        full = {b: self._timed(b, b, True) for b in self.buckets} if self.by_tokens else None  # (once a step)
        for d in counts:
            if d <= 0:
                continue
            rate = (base_tokens + cumulative[d]) / max(self.seconds(base_tokens + d, True, full), 1e-9)
            if rate > best_rate:
                best, best_rate = d, rate
            if d == room:
                break
        keep = [0] * len(proposals)
        for _, i in chances[:best]:
            keep[i] += 1
        for req, k in zip(proposals, keep):
            req.spec_token_ids = req.spec_token_ids[:k]
        return best
