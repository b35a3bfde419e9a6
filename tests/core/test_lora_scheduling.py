"""The scheduler's LoRA decisions without a model: which adapters run together, when slots load, fairness, and
slot accounting under randomized schedules (admission, preemption, forks, aborts, finishes)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxpaged.config import SchedulerConfig
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.sched.scheduler import Scheduler
from jaxpaged.request import Request, RequestStatus
from jaxpaged.sampling_params import SamplingParams


@dataclass(frozen=True)
class Adapter:  # (the scheduler reads only a fingerprint)
    fingerprint: str


A, B, C = Adapter("A"), Adapter("B"), Adapter("C")


def make(slots, num_blocks=64, **cfg):
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 32, "max_model_len": 256, **cfg})
    return Scheduler(config, KVCacheManager(num_blocks, 4), num_lora_slots=slots)


def req(rid, n, lora, max_tokens=6):
    return Request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens), seed=0, eos_token_ids=(2,),
                   lora=lora, arrival_time=float(len(rid)))


def check_slots(s: Scheduler, out) -> None:
    """Pins equal the running requests on each slot; each running adapter request sits on its adapter's slot;
    a slot loaded this step is used by no running request of another adapter."""
    users = [0] * s.loras.num_slots
    for r in s.running:
        if r.lora is None:
            assert r.lora_slot == -1
            continue
        assert r.lora_slot >= 0 and s.loras.holder[r.lora_slot] == r.lora.fingerprint
        users[r.lora_slot] += 1
    assert users == s.loras.users
    for slot, adapter in out.lora_loads:
        assert all(r.lora is adapter for r in s.running if r.lora_slot == slot)
    for r in s.waiting:
        assert r.lora_slot == -1


def test_adapters_wait_for_a_slot_and_the_base_model_does_not():
    s = make(1)
    r1, r2, r3 = req("a", 4, A, max_tokens=20), req("bb", 4, B), req("ccc", 4, None)
    s.add_requests([r1, r2, r3])
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["a", "ccc"] and out.lora_loads == [(0, A)]
    check_slots(s, out)
    late = req("dddd", 4, A)  # A is resident, but B waits for the slot: A's new request must not pass it
    s.add_request(late)
    s.update_from_output(out, [7] * len(out.requests))
    for _ in range(60):
        out = s.schedule()
        check_slots(s, out)
        ids = [r.request_id for r in out.requests]
        assert "dddd" not in ids or r2.status != RequestStatus.WAITING
        s.update_from_output(out, [7] * len(out.requests))
        if not s.has_unfinished_requests():
            break
    assert not s.has_unfinished_requests() and s.loras.num_loads == 3  # A, B, then A again
    assert s.loras.users == [0]


def test_randomized_schedules_keep_slots_consistent():
    rng = np.random.default_rng(0)
    for trial in range(20):
        s = make(int(rng.integers(1, 3)), num_blocks=int(rng.integers(12, 40)))
        pending = [req(f"r{trial}-{i}", int(rng.integers(1, 30)), [A, B, C, None][rng.integers(4)],
                       max_tokens=int(rng.integers(1, 12))) for i in range(16)]
        for _ in range(400):
            if pending and rng.random() < 0.4:
                s.add_request(pending.pop())
            if s.running and rng.random() < 0.05:
                s.abort_requests([s.running[int(rng.integers(len(s.running)))].request_id])
            if len(s.waiting) and rng.random() < 0.03:
                s.abort_requests([next(iter(s.waiting)).request_id])
            out = s.schedule()
            check_slots(s, out)
            s.update_from_output(out, [int(rng.choice([7, 7, 7, 2]))] * len(out.requests))
            check_slots(s, out)
            if not pending and not s.has_unfinished_requests():
                break
        assert not s.has_unfinished_requests(), f"trial {trial}: requests left unscheduled"
        assert s.loras.users == [0] * s.loras.num_slots
