"""A request's state inside the engine, and the outputs handed back to users (vLLM's shapes)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from jaxpaged.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS or a stop token
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # a failure of this request alone (its grammar matcher raised): the others go on

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                   RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}
for _status in RequestStatus:  # a plain attribute: read for every request on every step
    _status.finished = _status.value >= RequestStatus.FINISHED_STOPPED.value


def check_cache_salt(salt) -> None:
    """Raise ValueError unless `salt` is None or a non-empty string (vLLM's rule)."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt: must be a non-empty string, got {salt!r}")


def prefix_salt(cache_salt: str | None, lora) -> str | None:
    """The salt of a prompt's first block hash: its cache salt, and its LoRA adapter's fingerprint if any."""
    return cache_salt if lora is None else f"{cache_salt or ''}\x00lora:{lora.fingerprint}"


@dataclass(eq=False, slots=True)
class Request:
    """One sequence being generated. `num_computed_tokens` catches up to `num_tokens` step by step."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # the request's sampling seed: the user's, or one drawn by the engine
    eos_token_ids: tuple[int, ...] = ()
    prompt: str | None = None
    priority: int = 0
    tenant: str | None = None  # (a server with tenants) whose KV share it counts against
    cache_salt: str | None = None  # mixed into its first block's hash: only requests with the same salt share blocks
    # Its LoRA adapter (`models.lora_adapter.LoRAAdapter`: host arrays and a fingerprint), or None: the base model;
    # and (scheduler) the slot of the device's LoRA stack it runs with while running, else -1.
    lora: object | None = None
    lora_slot: int = -1
    num_cached_tokens: int = -1  # prompt tokens found cached (device, host or disk) when first scheduled; -1 before
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens scheduled so far (counted when scheduled, before the step runs)
    num_output_placeholders: int = 0  # tokens being drawn by scheduled steps whose results are not in yet
    needs_full_table: bool = False  # (scheduler) the runner gets the whole block table with the next step
    batch_row: int = -1  # (runner) its row in the persistent input batch, -1 when it has none
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    # Dense rows for the logits processors (bias, min_tokens mask), built at admission when needed.
    processor_rows: tuple | None = None
    # Structured output: this sample's llguidance matcher (it takes each drawn token), or None.
    grammar_matcher: object | None = None
    # Logprob information of each generated token: (logprob, rank, top ids, top logprobs).
    output_logprobs: list = field(default_factory=list)
    # Prompt logprob rows (token, logprob, rank, top ids, top logprobs) for prompt positions 1.. so far.
    prompt_logprob_rows: list = field(default_factory=list)
    prompt_logprobs_handed: bool = False  # (core) the complete rows went out in an `EngineCoreOutput`
    # Held requests (beam search): a step computes their tokens and logprobs but appends no token; the
    # owner appends the next token itself.
    hold_output: bool = False
    # Speculative decoding: draft tokens proposed for the next step (the scheduler takes them), and how many
    # drafts this request had verified and accepted so far.
    spec_token_ids: list[int] | tuple = ()
    # draft-model speculation: (the request's token count when proposed, the draft model's next tokens)
    draft_proposal: tuple[int, list[int]] | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_draft_rejections: int = 0  # verifications that ended at a rejected draft
    # Sibling samples (n > 1) forked from this request once its prompt is computed, sharing its blocks.
    pending_forks: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """Token ids [start, stop) of prompt + output, without building the whole list."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def prefix_salt(self) -> str | None:
        """What its first block's hash is salted with: the cache salt and its adapter's fingerprint (a block
        computed under one adapter holds other K/V than the base model's or another adapter's)."""
        return prefix_salt(self.cache_salt, self.lora)

    @property
    def prefix_cacheable(self) -> bool:
        """Whether this request may share cached blocks: not when it needs every prompt position computed
        (prompt_logprobs) or its fed-token history (penalties count the tokens the step is fed)."""
        p = self.sampling_params
        return p.prompt_logprobs is None and not p.needs_penalties


@dataclass
class Logprob:
    """vLLM's Logprob: a token's log-probability, its rank in the distribution, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request (vLLM's `CompletionOutput`)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What `LLM.generate` returns per prompt (vLLM's `RequestOutput`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list | None = None
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache when first scheduled (vLLM's)
