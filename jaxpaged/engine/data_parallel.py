"""Data parallelism: several `EngineCore` replicas, each with its own model copy, KV pool and scheduler on its own
devices, behind one frontend. `DataParallelCore` looks like one core to `LLMEngine` and `AsyncLLM`; its
`scheduler` (`ReplicaRouter`) sends each new request to the least-loaded replica and every later call about
a request to the replica holding it.
"""

from __future__ import annotations

import dataclasses
from collections import ChainMap
from collections.abc import Iterable

from jaxpaged.engine.core import EngineCore
from jaxpaged.engine.core_output import EngineCoreOutput, EngineGauges, StepStats
from jaxpaged.request import Request, RequestStatus


def replica_load(core: EngineCore) -> int:
    """Tokens a replica still has to compute: the prompt tokens not yet in its cache and the output tokens not
    yet drawn (up to max_tokens, else max_model_len) of every running and waiting request."""
    max_len = core.config.scheduler_config.max_model_len
    load = 0
    for req in (*core.scheduler.running, *core.scheduler.waiting):
        limit = req.sampling_params.max_tokens
        total = len(req.prompt_token_ids) + limit if limit is not None else max_len
        load += max(0, min(total, max_len) - req.num_computed_tokens)
    return load


class ReplicaRouter:
    """The scheduler calls frontends make, each sent to the right replica's scheduler."""

    def __init__(self, cores: list[EngineCore]):
        self.cores = cores
        self.requests = ChainMap(*(c.scheduler.requests for c in cores))  # (.get: the request, wherever it is)
        self.num_routed = [0] * len(cores)

    def pick(self, prompt_token_ids: list[int], cache_salt: str | None = None) -> int:
        """The replica for a new prompt: the least loaded (`replica_load`); among equally loaded ones, the one whose
        prefix cache holds the most of the prompt (under its salt); then the first."""
        def key(i: int):
            cached = self.cores[i].kv_cache_manager.num_cached_prefix_tokens(prompt_token_ids, cache_salt)
            return replica_load(self.cores[i]), -cached, i

        return min(range(len(self.cores)), key=key)

    def holder(self, request_id: str) -> EngineCore | None:
        return next((c for c in self.cores if request_id in c.scheduler.requests), None)

    def add_request(self, req: Request) -> None:
        self.add_requests([req])

    def add_requests(self, reqs: list[Request]) -> None:
        """Queue requests that belong together (a prompt's samples) on one replica."""
        for req in reqs:
            if req.request_id in self.requests:
                raise ValueError(f"request_id {req.request_id!r} is already in use")
        i = self.pick(reqs[0].prompt_token_ids, reqs[0].prefix_salt)
        self.num_routed[i] += 1
        for req in reqs:
            self.cores[i].scheduler.add_request(req)

    def fork(self, parent: Request, child: Request, num_tokens: int, *, share: bool = True) -> None:
        self.holder(parent.request_id).scheduler.fork(parent, child, num_tokens, share=share)

    def _by_replica(self, request_ids: Iterable[str]):
        for core in self.cores:
            ids = [rid for rid in request_ids if rid in core.scheduler.requests]
            if ids:
                yield core, ids

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        request_ids = list(request_ids)
        return [r for core, ids in self._by_replica(request_ids) for r in core.scheduler.finish_requests(ids, status)]

    def has_unfinished_requests(self) -> bool:
        return any(c.scheduler.has_unfinished_requests() for c in self.cores)

    @property
    def num_running(self) -> int:
        return sum(c.scheduler.num_running for c in self.cores)

    @property
    def num_waiting(self) -> int:
        return sum(c.scheduler.num_waiting for c in self.cores)

    @property
    def num_preemptions(self) -> int:
        return sum(c.scheduler.num_preemptions for c in self.cores)


class DataParallelCore:
    """Replicas stepped in turn from one thread: each `step()` schedules and dispatches every replica that has
    work (its device runs while the next replica is scheduled), and returns their outputs together."""

    def __init__(self, cores: list[EngineCore]):
        self.replicas = cores
        self.config = cores[0].config
        self.scheduler = ReplicaRouter(cores)
        self.async_scheduling = cores[0].async_scheduling
        self.last_stats = StepStats()

    # the first replica's parts, for tests and benchmarks that look at one
    @property
    def runner(self):
        return self.replicas[0].runner

    @property
    def kv_cache_manager(self):
        return self.replicas[0].kv_cache_manager

    @property
    def offload(self):
        return self.replicas[0].offload

    def warmup(self) -> float:
        return sum(core.warmup() for core in self.replicas)

    def warm_steps(self) -> dict[int, float]:
        """Each replica's steps (`EngineCore.warm_steps`); steady seconds per bucket, summed over the replicas
        (they run one after another)."""
        times: dict[int, float] = {}
        for core in self.replicas:
            for t, s in core.warm_steps().items():
                times[t] = times.get(t, 0.0) + s
        return times

    def close(self) -> None:
        for core in self.replicas:
            core.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def schedule_deadline(self) -> float | None:
        """Now: the replicas are stepped in turn (`EngineCore.schedule_deadline` has none)."""
        return None

    @property
    def step_channel(self):
        """None: the replicas live in this process."""
        return None

    def gauges(self) -> EngineGauges:
        """The replicas' gauges summed (KV usage: their mean; the tiers': the first replica's, which they share)."""
        each = [core.gauges() for core in self.replicas]
        total = EngineGauges(offload=each[0].offload, device_memory_bytes=each[0].device_memory_bytes)
        for g in each:
            total.num_running += g.num_running
            total.num_waiting += g.num_waiting
            total.kv_blocks_used += g.kv_blocks_used
            total.kv_usage += g.kv_usage / len(each)
            total.prefix_queries_total += g.prefix_queries_total
            total.prefix_hits_total += g.prefix_hits_total
        return total

    def step(self) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        stats = StepStats()
        for core in self.replicas:
            if core.has_unfinished_requests():
                outputs += core.step()
                stats = merge_stats(stats, core.last_stats)
        self.last_stats = stats
        return outputs


def merge_stats(a: StepStats, b: StepStats) -> StepStats:
    """Two replicas' step counters as one step's."""
    per_pos = [x + y for x, y in zip(a.spec_accepted_per_pos, b.spec_accepted_per_pos)] or list(
        a.spec_accepted_per_pos or b.spec_accepted_per_pos)
    return dataclasses.replace(
        a, **{f.name: getattr(a, f.name) + getattr(b, f.name) for f in dataclasses.fields(StepStats)
              if isinstance(getattr(a, f.name), int)},
        spec_accepted_per_pos=tuple(per_pos),
        tenant_kv_blocks=_sum_counts(a.tenant_kv_blocks, b.tenant_kv_blocks))


def _sum_counts(a: dict | None, b: dict | None) -> dict | None:
    """Two replicas' per-tenant counts summed (None when neither has any)."""
    if a is None or b is None:
        return a if b is None else b
    return {t: a.get(t, 0) + b.get(t, 0) for t in a.keys() | b.keys()}
