"""With measured step times the scheduler fills a smaller bucket exactly when that finishes the prompts sooner."""

import pytest

from jaxpaged.core.step_costs import StepCosts
from tests.core.test_scheduler import make, req, step

# budget 64 -> buckets [16, 32, 64]; a CPU-like cost: a step's time follows its padded tokens
CPU = {16: 0.030, 32: 0.050, 64: 0.100}
GPU = {16: 0.010, 32: 0.010, 64: 0.011}  # small steps cost about the same


def test_times_where_no_split_can_pay_are_dropped():
    assert StepCosts(CPU).can_split() and not StepCosts(GPU).can_split()
    s = make(max_num_batched_tokens=64)
    s.set_step_costs(GPU)
    assert s.step_costs is None


def test_costs_are_made_non_decreasing():
    assert StepCosts({16: 0.03, 32: 0.02, 64: 0.1}).seconds == {16: 0.02, 32: 0.02, 64: 0.1}
    with pytest.raises(ValueError, match="at least one bucket"):
        StepCosts({})


@pytest.mark.parametrize("decodes, ready, limit, expected", [
    (3, 37, 61, 29),   # 40 tokens -> 64 (100 ms); 32 (29 prompt) + 16 (3 + 8) = 80 ms
    (3, 50, 61, 61),   # 53 tokens: 32 + 32 = 100 ms is no faster than one 64 step: all it may
    (0, 40, 64, 32),   # no decodes: 32 + 16 = 80 ms
    (0, 10, 64, 64),   # fits the smallest bucket: nothing to split
    (3, 200, 61, 61),  # the step fills up anyway
])
def test_prompt_tokens(decodes, ready, limit, expected):
    assert StepCosts(CPU).prompt_tokens(decodes, ready, limit) == expected
    assert StepCosts(GPU).prompt_tokens(decodes, ready, limit) == limit


def beside_decodes(costs, num_decodes: int, prompt_len: int, **cfg):
    """A scheduler (budget 64) with `costs`, `num_decodes` requests decoding, and a prompt just arrived."""
    s = make(**{"max_num_batched_tokens": 64, "max_num_seqs": 8, "max_model_len": 512, **cfg})
    s.set_step_costs(costs)
    for i in range(num_decodes):
        s.add_request(req(f"r{i + 1}", 4, max_tokens=50))
    step(s)
    s.add_request(req(f"r{num_decodes + 1}", prompt_len, max_tokens=50))
    return s


def test_scheduler_fills_the_smaller_bucket_and_finishes_the_prompt_next():
    s = beside_decodes(CPU, 3, 37)
    out = step(s)
    assert [(x.request.request_id, x.num_new_tokens, x.samples) for x in out.scheduled] == [
        ("r1", 1, True), ("r2", 1, True), ("r3", 1, True), ("r4", 29, False)]
    out = step(s)  # the last 8 prompt tokens beside the decodes: a 16-token step, and r4 draws its first token
    assert [(x.request.request_id, x.num_new_tokens, x.samples) for x in out.scheduled] == [
        ("r1", 1, True), ("r2", 1, True), ("r3", 1, True), ("r4", 8, True)]


def test_without_costs_or_with_flat_ones_the_prompt_is_taken_whole():
    for costs in (None, GPU):
        assert [x.num_new_tokens for x in step(beside_decodes(costs, 1, 37)).scheduled] == [1, 37]


def test_costs_work_with_the_prefill_cap():
    # 1 decode + cap 8 -> bucket 16 -> 15 of the 20 ready prompt tokens may come: no smaller bucket to fill, the
    # cap's chunk stands
    s = beside_decodes(CPU, 1, 20, max_prefill_tokens_with_decodes=8)
    assert [x.num_new_tokens for x in step(s).scheduled] == [1, 15]


def test_without_chunked_prefill_costs_are_not_used():
    # a prompt cannot be split then: it would never be admitted if the step planned for 32 of its 37 tokens
    s = make(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512, enable_chunked_prefill=False)
    s.set_step_costs(CPU)
    s.add_request(req("r1", 37, max_tokens=50))
    assert [x.num_new_tokens for x in step(s).scheduled] == [37]


def test_by_tokens_a_partly_filled_bucket_costs_its_share():
    """Where a step costs its real tokens (packed CPU weights), a step between two buckets costs in proportion,
    and the split that filled the 32 bucket exactly no longer pays: the prompt comes whole."""
    costs = StepCosts(CPU, by_tokens=True)
    assert costs.of(16) == costs.of(10) == 0.030  # the smallest bucket: its time
    assert costs.of(40) == pytest.approx(0.050 + 0.050 * 8 / 32)
    assert costs.of(64) == 0.100
    assert costs.fraction(64, 40) == pytest.approx(0.0625 / 0.100)
    assert costs.fraction(64, 64) == costs.fraction(64, 0) == StepCosts(CPU).fraction(64, 40) == 1.0
    assert costs.prompt_tokens(3, 37, 61) == 61  # 40 tokens: 62.5 ms against 32 + 16 = 80 ms
    assert costs.prompt_tokens(0, 40, 64) == 64
    s = make(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512)
    s.set_step_costs(CPU, by_tokens=True)
    assert s.step_costs.by_tokens
