"""Padded step sizes: the token count T is bucketed, the sequence count S follows from it."""

from __future__ import annotations

import bisect

MIN_TOKEN_BUCKET = 16
FINE_BUCKETS_UP_TO = 1024  # the CPU budget's default: larger budgets (chunked prefill off) add no more compiles
# fine buckets under a serving budget (>= this) start at 8: a few decoding requests pay for a few rows; smaller
# budgets (tests, tiny configs) keep 16 and two compiles fewer
SMALL_BUCKETS_FROM_BUDGET = 512
# and from 256 to 512 they step by a quarter (256, 320, 384, 448, 512): a served prompt of a few hundred tokens
# is prefilled in one step with the decodes, and padding there costs in proportion (docs/benchmarks/design-choices.md)
QUARTER_BUCKETS = (256, 512)


def token_buckets(max_num_batched_tokens: int, *, fine: bool = False) -> list[int]:
    """Powers of two from 16 up to the budget, the budget itself last; fine=True adds a bucket halfway (1.5x)
    between each two up to 1024 and, with a budget of 512 or more, starts at 8 (8, 12, 16, ...) and adds quarter
    steps from 256 to 512.

    On CPU a step's cost grows with its padded tokens at every size (docs/benchmarks/design-choices.md):
    decode batches live in the small buckets (a served model often decodes only a few requests), and a served
    prompt is prefilled in one step of its length plus the decodes (a 300-token prompt pays 320 tokens, not 512).
    """
    small = fine and max_num_batched_tokens >= SMALL_BUCKETS_FROM_BUDGET
    out, t = [], MIN_TOKEN_BUCKET // 2 if small else MIN_TOKEN_BUCKET
    while t < max_num_batched_tokens:
        out.append(t)
        if fine and t < FINE_BUCKETS_UP_TO:
            quarters = (1, 2, 3) if small and QUARTER_BUCKETS[0] <= t < QUARTER_BUCKETS[1] else (2,)
            out += [t + t * q // 4 for q in quarters if t + t * q // 4 < max_num_batched_tokens]
        t *= 2
    return out + [max_num_batched_tokens]


def seq_bucket(num_tokens_bucket: int, max_num_seqs: int) -> int:
    """Rows for a step of T tokens: every scheduled sequence has >= 1 token, so min(T, max_num_seqs) fits."""
    return min(num_tokens_bucket, max_num_seqs)


def pick_token_bucket(buckets: list[int], num_tokens: int) -> int:
    """The smallest bucket that holds `num_tokens`."""
    i = bisect.bisect_left(buckets, num_tokens)
    if i == len(buckets):
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {buckets[-1]}")
    return buckets[i]
