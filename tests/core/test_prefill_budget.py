"""The prompt tokens a step may carry beside its decodes (`core/sched/prefill_budget.py`)."""

from jaxpaged.core.sched.prefill_budget import prefill_budget
from jaxpaged.core.sched.request_queue import WaitingQueue

BUCKETS = [16, 32, 64, 128]


def test_without_a_cap_or_costs_the_whole_budget():
    assert prefill_budget(128, None, None, BUCKETS, [(1, 0)] * 5, WaitingQueue("fcfs", None)) == 128
    assert prefill_budget(128, 16, None, BUCKETS, [], WaitingQueue("fcfs", None)) == 128


def test_the_cap_fills_the_bucket_the_decodes_and_their_drafts_need():
    waiting = WaitingQueue("fcfs", None)
    # 2 decodes, one verifying 4 drafts: 6 decode tokens; 6 + 16 -> bucket 32, so 26 prompt tokens
    assert prefill_budget(128, 16, None, BUCKETS, [(1, 4), (1, 0)], waiting) == 26
    # a running prefill (40 tokens left) is not a decode: 1 decode + 16 -> bucket 32, 31 prompt tokens
    assert prefill_budget(128, 16, None, BUCKETS, [(1, 0), (40, 0)], waiting) == 31
    # one whose token in flight may be its last (0 tokens) counts as nothing: no decodes, no cap
    assert prefill_budget(128, 16, None, BUCKETS, [(0, 0)], waiting) == 128
