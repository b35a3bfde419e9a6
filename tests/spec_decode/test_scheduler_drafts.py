"""The scheduler's side of speculative decoding: drafts as extra tokens of a decode, rollback of rejected ones,
no preemption for drafts, n > 1 siblings forked when the first token comes from a verifying step."""

from jaxpaged.config import SchedulerConfig
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.sched.scheduler import Scheduler
from jaxpaged.request import Request, RequestStatus
from jaxpaged.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def two_decoding(num_blocks: int, block_size: int = 4):
    """Requests A and B of 5 prompt tokens, prefilled, one token drawn each (6 tokens, 5 computed)."""
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), KVCacheManager(num_blocks, block_size))
    a, b = Request("A", list(range(3, 8)), PARAMS, seed=0), Request("B", list(range(10, 15)), PARAMS, seed=0)
    s.add_request(a)
    s.add_request(b)
    s.update_from_output(s.schedule(), [50, 60])
    return s, a, b


def test_drafts_are_scheduled_after_the_decode_token_and_rolled_back():
    s, a, b = two_decoding(num_blocks=16)
    a.spec_token_ids = [1, 2, 3]
    out = s.schedule()
    assert out.num_new_tokens == [4, 1] and out.spec_tokens == {0: [1, 2, 3]} and out.samples == [True, True]
    assert a.num_computed_tokens == 9  # 5 + the decode token + 3 drafts
    got = s.update_from_output(out, [70, 80], {0: [1]})  # draft 1 accepted, 2 rejected (70 drawn in its place)
    assert [t for _, r, t in got if r is a] == [1, 70] and a.output_token_ids == [50, 1, 70]
    assert a.num_computed_tokens == a.num_tokens - 1 == 7  # the rejected drafts are no longer computed
    assert (a.num_draft_tokens, a.num_accepted_tokens, a.num_draft_rejections) == (3, 1, 1)


def test_drafts_that_do_not_fit_are_dropped_before_anyone_is_preempted():
    s, a, b = two_decoding(num_blocks=5)  # 4 usable blocks, all held: A's decode fits in its last block
    a.spec_token_ids = [1, 2, 3]  # would cross into a fifth block
    out = s.schedule()
    assert out.preempted_ids == [] and out.spec_tokens == {}
    assert out.num_new_tokens == [1, 1] and b.status == RequestStatus.RUNNING


def test_a_stop_inside_the_drafts_ends_the_request_there():
    s, a, b = two_decoding(num_blocks=16)
    a.sampling_params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[2])
    a.spec_token_ids = [1, 2, 3]
    out = s.schedule()
    got = s.update_from_output(out, [70, 80], {0: [1, 2, 3]})
    assert [t for _, r, t in got if r is a] == [1, 2] and a.status == RequestStatus.FINISHED_STOPPED
    assert a not in s.running


def test_siblings_fork_when_the_first_token_comes_from_a_verifying_step():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=7, max_model_len=64), KVCacheManager(32, 4))
    parent = Request("p#0", list(range(3, 11)), PARAMS, seed=0)  # 8 prompt tokens: 7, then the last one
    child = Request("p#1", parent.prompt_token_ids, PARAMS, seed=1)
    parent.pending_forks = [child]
    s.add_request(parent)
    s.update_from_output(s.schedule(), [-1])
    assert parent.num_computed_tokens == 7
    parent.spec_token_ids = [5]  # a draft from the prompt itself
    out = s.schedule()
    assert out.spec_tokens == {0: [5]}
    s.update_from_output(out, [9], {0: [5]})
    assert parent.output_token_ids == [5, 9]
    assert child in s.running and child.num_computed_tokens == 7  # forked: recomputes the last prompt token


def test_lookahead_slots_are_reserved_for_a_draft_models_writes():
    """With a draft model (num_lookahead_tokens = K), a decode holds blocks for K positions past its tokens: the
    draft model writes its drafts' KV there after the step. Without room for them, the decode runs without."""
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64, num_lookahead_tokens=3),
                  KVCacheManager(16, 4))
    a = Request("A", list(range(3, 10)), PARAMS, seed=0)  # 7 prompt tokens: blocks for 7 + 3 positions
    s.add_request(a)
    s.update_from_output(s.schedule(), [50])
    assert len(s.kv.req_to_blocks["A"]) == 3
    s.update_from_output(s.schedule(), [51])  # the decode at position 7: positions up to 10
    assert len(s.kv.req_to_blocks["A"]) == 3
    s.update_from_output(s.schedule(), [52])  # position 8: up to 11
    assert len(s.kv.req_to_blocks["A"]) == 3
    s.schedule()  # position 9: up to 12, a fourth block
    assert len(s.kv.req_to_blocks["A"]) == 4
    full = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64, num_lookahead_tokens=3),
                     KVCacheManager(4, 4))  # 3 usable blocks
    b = Request("B", list(range(3, 10)), PARAMS, seed=0)
    full.add_request(b)
    full.update_from_output(full.schedule(), [50])
    full.update_from_output(full.schedule(), [51])
    full.update_from_output(full.schedule(), [52])
    out = full.schedule()  # no fourth block: the decode runs in the blocks it has, nobody is preempted
    assert out.num_new_tokens == [1] and out.preempted_ids == [] and len(full.kv.req_to_blocks["B"]) == 3
