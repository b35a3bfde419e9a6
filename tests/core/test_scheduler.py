"""Scheduler decisions without any model: budget, chunking, seq limit, preemption, stop rules."""

from jaxpaged.config import SchedulerConfig
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.scheduler import Scheduler
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
