"""How many prompt tokens a step may carry beside its decodes: the prefill cap's padded bucket, and with measured
step times the split that finishes the prompts soonest (`StepCosts.prompt_tokens`)."""

from __future__ import annotations

from jaxpaged.config.buckets import pick_token_bucket
from jaxpaged.core.sched.request_queue import WaitingQueue
from jaxpaged.core.step_costs import StepCosts


def prefill_budget(budget: int, cap: int | None, costs: StepCosts | None, buckets: list[int],
                   running: list[tuple[int, int]], waiting: WaitingQueue) -> int:
    """Prompt tokens the step may carry: with requests decoding and a cap (`max_prefill_tokens_with_decodes`),
    that many, plus what still fits in the padded step (the token bucket the decodes and the cap need); with
    measured step times (`costs`), possibly fewer.

    running: per running request, (tokens it computes next, its draft tokens): 1 for a decode, 0 for one whose
    token in flight may be its last (it is not scheduled); waiting: the queue, read only as far as needed."""
    if costs is None and (not cap or not running):
        return budget
    decodes = ready = 0
    for n, drafts in running:
        if n == 1:
            decodes += 1 + drafts
        elif n > 1:
            ready += n
    decodes = min(decodes, budget)
    limit = budget
    if cap and decodes:
        limit = pick_token_bucket(buckets, min(decodes + cap, budget)) - decodes
    if costs is None:
        return limit
    for r in waiting.unordered():  # (enough of the queue to know whether the step fills up)
        if ready > limit:
            break
        ready += r.num_tokens - r.num_computed_tokens
    return costs.prompt_tokens(decodes, ready, limit) if ready else limit
