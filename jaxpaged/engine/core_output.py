"""What the engine core hands on after a step, by value: per-token records (vLLM's `EngineCoreOutput`), the
step's counters and the engine's gauges as they were at the step's end.

With `AsyncLLM` these cross from the engine thread to the output thread; records hold copies of what the
output side needs, so no `Request` (which the scheduler, the runner and the core keep writing) crosses."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class EngineCoreOutput:
    """One token a step gave one request. A step makes one per running request (several with speculative
    decoding); `finished` only on a request's last token."""

    request_id: str
    token: int
    finished: bool = False
    finish_reason: str | None = None  # (when finished) "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token that ended it, if one did
    logprob: tuple | None = None  # (when asked for) (logprob, rank, top ids, top logprobs) of this token
    prompt_logprob_rows: list | None = None  # the prompt's logprob rows, once, when all are known
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache (-1: not yet known)
    first_scheduled_time: float | None = None  # (monotonic s) when the request first ran


@dataclass
class StepStats:
    """Counters of one step, for metrics and logs."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    # speculative decoding: sequences that verified drafts, their draft tokens, the accepted ones, and the
    # accepted count at each draft position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    tenant_kv_blocks: dict | None = None  # (tenants' KV shares) blocks each tenant's running requests hold


@dataclass
class EngineGauges:
    """The engine's state after a step (all replicas), read on the engine thread."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_usage: float = 0.0  # mean over the replicas' pools
    prefix_queries_total: int = 0
    prefix_hits_total: int = 0
    device_memory_bytes: float | None = None  # the process's, on its JAX devices (`metrics.device_memory_in_use`)
    offload: dict | None = field(default=None)  # the host/disk tiers' counters (`KVOffload.stats()`), if any
