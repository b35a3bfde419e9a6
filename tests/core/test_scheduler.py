"""Scheduler decisions without any model: budget, chunking, seq limit, preemption, stop rules."""

from jaxpaged.config import SchedulerConfig
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.sched.scheduler import Scheduler
from jaxpaged.request import Request, RequestStatus
from jaxpaged.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, num_host_blocks=0, **cfg):
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 16, "max_model_len": 256, **cfg})
    return Scheduler(config, KVCacheManager(num_blocks, block_size, num_host_blocks=num_host_blocks))


def req(rid, n, max_tokens=8, priority=0, **kw):
    return Request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens, **kw), seed=0,
                   eos_token_ids=(2,), priority=priority, arrival_time=float(rid.strip("r") or 0))


def step(s, token=7):
    out = s.schedule()
    s.update_from_output(out, [token] * len(out.scheduled))
    return out


def test_prefill_and_decode_share_a_step():
    s = make()
    s.add_request(req("r1", 5))
    out = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("r1", 5)]
    s.add_request(req("r2", 6))
    out = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("r1", 1), ("r2", 6)]


def test_chunked_prefill_splits_long_prompts_by_budget():
    s = make(max_num_batched_tokens=8)
    s.add_request(req("r1", 20))
    chunks = []
    while not s.requests["r1"].output_token_ids:
        out = step(s)
        chunks.append(out.scheduled[0].num_new_tokens)
    assert chunks == [8, 8, 4]


def test_without_chunking_a_long_prompt_waits_for_a_free_budget():
    s = make(max_num_batched_tokens=32, enable_chunked_prefill=False)
    s.add_request(req("r1", 20))
    s.add_request(req("r2", 20))
    out = step(s)
    assert [x.request.request_id for x in out.scheduled] == ["r1"]


def test_max_num_seqs():
    s = make(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(4):
        s.add_request(req(f"r{i}", 3))
    assert len(step(s).scheduled) == 2
    assert s.num_waiting == 2


def test_preempts_newest_and_resumes_it_with_its_output():
    s = make(num_blocks=5, block_size=4, max_num_batched_tokens=32)  # 4 usable blocks
    s.add_request(req("r1", 7, max_tokens=20))
    s.add_request(req("r2", 7, max_tokens=20))
    step(s)  # both prefilled: 2 blocks each, both have 1 output token
    step(s)  # position 7 still fits in block 2
    out = step(s)  # both need a 3rd block at position 8: r2 (newest) is preempted
    assert out.preempted_ids == ["r2"]
    r2 = s.requests["r2"]
    assert r2.status == RequestStatus.PREEMPTED and r2.num_computed_tokens == 0
    assert r2.output_token_ids == [7, 7]  # kept: recomputed on resume
    assert s.kv.num_free_blocks == 1


def test_swap_preemption_moves_blocks_to_host_and_back():
    s = make(num_blocks=5, block_size=4, max_num_batched_tokens=32, preemption_mode="swap", num_host_blocks=4)
    s.add_request(req("r1", 7, max_tokens=20))
    s.add_request(req("r2", 7, max_tokens=20))
    step(s), step(s)
    r2_blocks = s.kv.block_ids("r2")
    out = step(s)  # r2 is preempted: its two blocks go to host blocks 0 and 1
    assert out.preempted_ids == ["r2"] and out.swap_out == list(zip(r2_blocks, [0, 1]))
    r2 = s.requests["r2"]
    assert r2.status == RequestStatus.PREEMPTED and r2.num_computed_tokens == 8  # nothing to recompute
    assert s.kv.req_to_host_blocks == {"r2": [0, 1]} and s.kv.host_free == [3, 2]
    s.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
    out = step(s)  # r2 comes back: host blocks copied into fresh device blocks, one more token computed
    assert [h for h, _ in out.swap_in] == [0, 1] and s.kv.block_ids("r2")[:2] == [d for _, d in out.swap_in]
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("r2", 1)]
    assert not s.kv.req_to_host_blocks and len(s.kv.host_free) == 4


def test_swap_falls_back_to_recompute_when_host_space_is_short():
    s = make(num_blocks=5, block_size=4, max_num_batched_tokens=32, preemption_mode="swap", num_host_blocks=1)
    s.add_request(req("r1", 7, max_tokens=20))
    s.add_request(req("r2", 7, max_tokens=20))
    step(s), step(s)
    out = step(s)
    assert out.preempted_ids == ["r2"] and not out.swap_out
    assert s.requests["r2"].num_computed_tokens == 0


def test_priority_policy_preempts_lowest_priority():
    s = make(num_blocks=5, block_size=4, max_num_batched_tokens=32, policy="priority")
    s.add_request(req("r1", 7, max_tokens=20, priority=5))  # larger = less urgent
    s.add_request(req("r2", 7, max_tokens=20, priority=0))
    step(s), step(s)
    out = step(s)
    assert out.preempted_ids == ["r1"]


def test_priority_policy_admits_urgent_first():
    s = make(max_num_seqs=1, policy="priority")
    s.add_request(req("r1", 3, priority=2))
    s.add_request(req("r2", 3, priority=1))
    assert step(s).scheduled[0].request.request_id == "r2"


def test_stop_rules():
    s = make()
    r = req("r1", 3, max_tokens=3, min_tokens=2, stop_token_ids=[9])
    s.add_request(r)
    step(s, token=2)  # EOS before min_tokens: ignored
    assert r.status == RequestStatus.RUNNING
    step(s, token=2)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [2, 2]
    assert s.kv.num_free_blocks == 63

    r = req("r2", 3, max_tokens=3, ignore_eos=True)
    s.add_request(r)
    for _ in range(3):
        step(s, token=2)
    assert r.status == RequestStatus.FINISHED_LENGTH

    r = req("r3", 3, stop_token_ids=[9])
    s.add_request(r)
    step(s, token=9)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 9


def test_max_model_len_ends_a_request():
    s = make(max_model_len=6)
    r = req("r1", 4, max_tokens=100)
    s.add_request(r)
    step(s), step(s)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 6


def test_abort_frees_blocks_everywhere():
    s = make(max_num_seqs=1)
    s.add_request(req("r1", 5))
    s.add_request(req("r2", 5))
    step(s)
    s.abort_requests(["r1", "r2", "unknown"])
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == 63


def test_every_running_request_is_scheduled_each_step():
    s = make(max_num_batched_tokens=64)
    for i in range(5):
        s.add_request(req(f"r{i}", 3 + i, max_tokens=10))
    step(s)
    out = step(s)
    assert [(x.request.request_id, x.num_new_tokens, x.samples) for x in out.scheduled] == [
        (f"r{i}", 1, True) for i in range(5)]


def test_a_request_with_nothing_to_compute_does_not_block_the_others():
    s = make(max_num_batched_tokens=64)
    held = Request("h", [3, 4, 5], SamplingParams(max_tokens=5), seed=0, hold_output=True)
    s.add_request(held)
    s.add_request(req("r1", 4))
    step(s)  # both computed; the held request now waits for its owner's token
    out = step(s)
    assert [x.request.request_id for x in out.scheduled] == ["r1"]


def test_async_schedules_the_token_in_flight_before_its_value_is_known():
    """Step N+1 is scheduled before step N's results: a decoding request computes the placeholder of the token
    it draws in step N (fed on the device), and one whose token in flight may be its last waits for it."""
    s = make(max_num_batched_tokens=64)
    r = req("r1", 5, max_tokens=3, ignore_eos=True)
    s.add_request(r)
    first = s.schedule()  # the prompt: draws output 1
    assert r.num_output_placeholders == 1 and r.num_computed_tokens == 5
    second = s.schedule()  # before output 1 is known: its position is computed, output 2 drawn
    assert [(x.start, x.num_new_tokens, x.samples) for x in second.scheduled] == [(5, 1, True)]
    assert r.num_output_placeholders == 2 and r.num_computed_tokens == 6
    s.update_from_output(first, [11])
    assert r.output_token_ids == [11] and r.num_output_placeholders == 1
    third = s.schedule()  # output 3 would be the last (max_tokens 3): drawn, then nothing more is scheduled
    assert [(x.start, x.samples) for x in third.scheduled] == [(6, True)]
    s.update_from_output(second, [12])
    assert s.schedule().is_empty  # output 3 is in flight and is the last
    s.update_from_output(third, [13])
    assert r.output_token_ids == [11, 12, 13] and r.status == RequestStatus.FINISHED_LENGTH
    assert s.kv.num_free_blocks == 63 and s.schedule().finished_ids == ["r1"]


def test_results_for_a_request_that_ended_meanwhile_are_dropped():
    s = make()
    r = req("r1", 4, max_tokens=10)
    s.add_request(r)
    first = s.schedule()
    s.abort_requests(["r1"])
    assert s.update_from_output(first, [5]) == [] and r.output_token_ids == []


def test_the_parent_copies_a_shared_block_before_writing_it():
    """n > 1: the siblings fork from the first sample when its prompt is in, sharing the partial last block; the
    first sample's next token goes to a copy (copy-on-write), and the runner gets its whole new table."""
    s = make(block_size=4)
    first = Request("r1#0", list(range(3, 9)), SamplingParams(max_tokens=4), seed=0)
    first.pending_forks = [Request("r1#1", list(range(3, 9)), SamplingParams(max_tokens=4), seed=1)]
    s.add_request(first)
    step(s)  # the prompt (blocks b0, b1 with 2 of 4 slots used); the sibling forks at 5 tokens, sharing both
    shared = s.kv.block_ids("r1#0")
    assert s.kv.block_ids("r1#1") == shared and s.kv.pool.blocks[shared[1]].ref_cnt == 2
    out = s.schedule()
    by_id = {x.request.request_id: x for x in out.scheduled}
    copy = [c for c in out.block_copies if c.src == shared[1]]
    assert len(copy) == 1 and s.kv.block_ids("r1#0") == [shared[0], copy[0].dst]
    assert by_id["r1#0"].block_ids == [shared[0], copy[0].dst]  # the whole table, since a block changed


def test_fork_copies_come_first_in_their_own_list():
    s = make(block_size=4)
    parent = req("r9", 6)
    s.add_request(parent)
    step(s)
    child = Request("c", parent.prompt_token_ids, parent.sampling_params, seed=0,
                    output_token_ids=list(parent.output_token_ids))
    s.fork(parent, child, 6, share=False)
    out = s.schedule()
    assert [c.src for c in out.fork_copies] == s.kv.block_ids("r9")[:2] and not out.block_copies


def test_with_a_step_in_flight_idle_beams_are_not_preempted():
    """The deadlock breaker (idle held requests yield their blocks to waiting ones) waits while a step is in
    flight: its results may let the beams' owner go on (it thrashed under async scheduling)."""
    s = make(num_blocks=4, block_size=2, max_num_batched_tokens=16)  # 3 usable blocks
    a = Request("a", [3, 4], SamplingParams(max_tokens=4), seed=0, hold_output=True)
    b = Request("b", [5, 6], SamplingParams(max_tokens=4), seed=0, hold_output=True)
    s.add_request(a)
    s.add_request(b)
    first = s.schedule()  # both computed, both draw (in flight)
    s.update_from_output(first, [7, 7])
    a.output_token_ids.append(7)  # the owner fed a, not yet b
    in_flight = s.schedule()  # a computes its new token: a step in flight, with b idle
    s.add_request(req("r5", 3))  # needs 2 blocks; 0 free
    out = s.schedule()
    assert out.is_empty and not out.preempted_ids and b.status == RequestStatus.RUNNING
    s.update_from_output(in_flight, [8])
    out = s.schedule()  # nothing in flight now: the newest idle beam yields its blocks
    assert out.preempted_ids and "r5" in [x.request.request_id for x in out.scheduled]


def test_prompts_beside_decodes_get_the_prefill_cap_filled_to_the_bucket():
    # budget 64 -> buckets [16, 32, 64]; 3 decodes + cap 8 = 11 -> bucket 16 -> 13 prompt tokens
    s = make(max_num_batched_tokens=64, max_prefill_tokens_with_decodes=8, max_num_seqs=8, max_model_len=512)
    for rid in ("r1", "r2", "r3"):
        s.add_request(req(rid, 4, max_tokens=50))
    assert [x.num_new_tokens for x in step(s).scheduled] == [4, 4, 4]  # no decodes yet: no cap
    s.add_request(req("r4", 100, max_tokens=50))
    out = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [
        ("r1", 1), ("r2", 1), ("r3", 1), ("r4", 13)]
    # a prompt already running (chunked), ahead of the decodes in the running order, is capped the same way
    s.running.insert(0, s.running.pop())
    out = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [
        ("r4", 13), ("r1", 1), ("r2", 1), ("r3", 1)]
    # and a second prompt shares what is left of the cap
    s.add_request(req("r5", 40, max_tokens=50))
    out = step(s)
    assert sum(x.num_new_tokens for x in out.scheduled if x.request.request_id in ("r4", "r5")) == 13


def test_without_the_cap_a_prompt_takes_the_whole_budget_beside_decodes():
    s = make(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512)
    s.add_request(req("r1", 4, max_tokens=50))
    step(s)
    s.add_request(req("r2", 100, max_tokens=50))
    assert [x.num_new_tokens for x in step(s).scheduled] == [1, 63]


def test_a_capped_prompt_still_finishes_and_decodes():
    s = make(max_num_batched_tokens=64, max_prefill_tokens_with_decodes=1, max_num_seqs=8, max_model_len=512)
    s.add_request(req("r1", 4, max_tokens=200))
    step(s)
    r2 = req("r2", 60, max_tokens=2, ignore_eos=True)
    s.add_request(r2)
    chunks = [next(x.num_new_tokens for x in step(s).scheduled if x.request is r2) for _ in range(5)]
    assert chunks == [15, 15, 15, 15, 1]  # 1 decode + cap 1 -> bucket 16 -> 15 prompt tokens a step
    assert r2.status == RequestStatus.FINISHED_LENGTH


def test_a_request_whose_token_in_flight_may_be_its_last_does_not_count_as_decoding_for_the_cap():
    s = make(max_num_batched_tokens=64, max_prefill_tokens_with_decodes=8, max_num_seqs=8, max_model_len=512)
    s.add_request(req("r1", 4, max_tokens=2, ignore_eos=True))
    s.schedule()  # (async: no results yet) the prompt, drawing output 1
    s.schedule()  # output 2, its last, in flight
    s.add_request(req("r2", 100, max_tokens=50))
    # r1 waits for its last token: nothing decodes in this step, so the prompt is not capped (15 with a decode)
    assert [(x.request.request_id, x.num_new_tokens) for x in s.schedule().scheduled] == [("r2", 64)]
