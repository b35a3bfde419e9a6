"""Waiting order and preemption victims under fcfs, priority, sjf (with aging) and hybrid, exactly."""

import pytest

from jaxpaged.config import SchedulerConfig
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.sched.scheduler import Scheduler
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.request import Request
from jaxpaged.sampling_params import SamplingParams


def make(policy, num_blocks=256, **cfg):
    config = SchedulerConfig(**{"max_num_seqs": 1, "max_num_batched_tokens": 64, "max_model_len": 4096,
                                "policy": policy, **cfg})
    return Scheduler(config, KVCacheManager(num_blocks, 4))


def req(rid, prompt, max_tokens, arrival, priority=0):
    return Request(rid, list(range(3, 3 + prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed=0,
                   eos_token_ids=(2,), priority=priority, arrival_time=arrival)


def completion_order(s: Scheduler) -> list[str]:
    done = []
    while s.has_unfinished_requests():
        out = s.schedule()
        for _, r, _ in s.update_from_output(out, [7] * len(out.scheduled)):
            if r.status.finished:
                done.append(r.request_id)
    return done


# (id, prompt tokens, max_tokens, arrival s, priority): all waiting before the first step
REQUESTS = [("long", 40, 30, 0.00, 1), ("mid", 10, 20, 0.01, 0), ("short", 3, 4, 0.02, 1), ("tiny", 2, 2, 0.03, 2),
            ("urgent-long", 30, 30, 0.04, 0)]


@pytest.mark.parametrize("policy,expected", [
    ("fcfs", ["long", "mid", "short", "tiny", "urgent-long"]),
    ("priority", ["mid", "urgent-long", "long", "short", "tiny"]),
    ("sjf", ["tiny", "short", "mid", "urgent-long", "long"]),  # work 4, 7, 30, 60, 70
    ("hybrid", ["mid", "urgent-long", "short", "long", "tiny"]),  # class 0 by work, then class 1, then 2
])
def test_completion_order_with_one_sequence_slot(policy, expected):
    s = make(policy)
    for r in REQUESTS:
        s.add_request(req(*r))
    assert completion_order(s) == expected


def test_hybrid_ages_across_classes():
    """One priority level is worth priority_class_seconds of waiting: an old low-priority request goes first."""
    s = make("hybrid", priority_class_seconds=5.0)
    s.add_request(req("old-low", 3, 3, arrival=0.0, priority=1))
    s.add_request(req("new-high", 3, 3, arrival=6.0, priority=0))
    s.add_request(req("newer-high", 3, 3, arrival=4.0, priority=0))
    assert completion_order(s) == ["newer-high", "old-low", "new-high"]


@pytest.mark.parametrize("rate", [100.0, 20.0])
def test_sjf_aging_bounds_how_long_a_long_request_is_overtaken(rate):
    """A long request (work 500) among short ones arriving every 0.1 s: only shorts that arrived within
    work / rate seconds after it finish before it; with (almost) no aging it would wait for all of them."""
    s = make("sjf", aging_rate=rate)
    s.add_request(req("long", 100, 400, arrival=0.0))
    for i in range(1, 120):
        s.add_request(req(f"s{i}", 2, 3, arrival=0.1 * i))
    order = completion_order(s)
    before = order[: order.index("long")]
    assert before and all(0.1 * int(r[1:]) <= 500 / rate + 1e-9 for r in before)
    assert len(before) == sum(0.1 * i + 5 / rate < 500 / rate for i in range(1, 120))

    starved = make("sjf", aging_rate=1e-6)
    starved.add_request(req("long", 100, 400, arrival=0.0))
    for i in range(1, 120):
        starved.add_request(req(f"s{i}", 2, 3, arrival=0.1 * i))
    assert completion_order(starved)[-1] == "long"


@pytest.mark.parametrize("policy,victim", [("sjf", "big"), ("fcfs", "small")])
def test_preemption_victim_follows_the_policy(policy, victim):
    """Both grow until the pool (40 tokens) is short: sjf preempts the one with most work left, fcfs the newest."""
    s = make(policy, num_blocks=11, max_num_seqs=4)
    s.add_request(req("big", 8, 28, arrival=0.0))
    s.add_request(req("small", 8, 20, arrival=0.05))
    preempted = []
    while s.has_unfinished_requests():
        out = s.schedule()
        preempted += out.preempted_ids
        s.update_from_output(out, [7] * len(out.scheduled))
    assert preempted and set(preempted) == {victim}


def test_unbounded_requests_are_predicted_a_default_output():
    """Without max_tokens (chat requests often set none) the output is estimated, so the prompt still counts."""
    from jaxpaged.core.sched.request_queue import UNBOUNDED_OUTPUT_ESTIMATE

    s = make("sjf")
    short, long = req("short", 10, None, 0.0), req("long", 900, None, 0.0)
    assert s.predicted_work(short) == 10 + UNBOUNDED_OUTPUT_ESTIMATE
    assert s.predicted_work(long) == 900 + UNBOUNDED_OUTPUT_ESTIMATE
    near_end = make("sjf", max_model_len=1000)
    assert near_end.predicted_work(req("long", 900, None, 0.0)) == 900 + 100


def test_bad_aging_flags_are_rejected():
    with pytest.raises(ValueError, match="scheduling_aging_rate"):
        EngineArgs(scheduling_aging_rate=0).validate()
    with pytest.raises(ValueError, match="priority_class_seconds"):
        EngineArgs(priority_class_seconds=-1).validate()


def test_generate_passes_priorities_and_checks_them(tiny_model_dir):
    from jaxpaged import LLM

    llm = LLM(tiny_model_dir("llama"), num_kv_blocks=32, scheduling_policy="priority", max_num_seqs=1)
    seen = []
    add = llm.engine.add_request
    llm.engine.add_request = lambda *a, **kw: seen.append(kw["priority"]) or add(*a, **kw)
    outs = llm.generate([[5, 6], [7, 8]], SamplingParams(max_tokens=2), priority=[3, -1], use_tqdm=False)
    assert seen == [3, -1] and all(o.finished for o in outs)
    with pytest.raises(ValueError, match="priority"):
        llm.generate([[5, 6]], priority=[1, 2])
