"""What a step is on the host between its stages: laid out (`PreparedStep`), dispatched (`StepHandle`),
fetched (`StepResult`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxpaged.core.sched.output import SchedulerOutput
from jaxpaged.layers.step_features import StepFeatures
from jaxpaged.runner.step_input import StepPlan


@dataclass
class StepHandle:
    """A dispatched step: what it was, and its results while they are still on the device."""

    out: SchedulerOutput
    plan: StepPlan
    result: object  # SamplerOutput of device arrays (or numpy, for the stub)
    prompt_lp: object
    constrained: bool = False  # some row drew under a structured-output mask
    bucket: int = 0  # the step's token bucket


@dataclass
class PreparedStep:
    """A step laid out on the host, not yet dispatched (`ModelRunner.prepare`)."""

    out: SchedulerOutput
    plan: StepPlan
    t: int  # token bucket
    ints: np.ndarray
    floats: np.ndarray
    matchers: list  # (structured-output matcher, sequence row) of the rows that draw under a grammar
    features: StepFeatures | None = None  # (branches decided on the host) the step's variant; None: the bucket's

    @property
    def constrained(self) -> bool:
        return bool(self.matchers)


@dataclass
class StepResult:
    """A step's results, aligned with `SchedulerOutput.requests` (numpy)."""

    token_ids: np.ndarray  # [n] the drawn token; -1 where the request draws none
    num_prompt_tokens: int  # prompt tokens the step computed
    logprobs: tuple | None  # (logprob [n], rank [n], top ids [n, K], top logprobs [n, K]) when asked
    prompt_logprobs: list | None  # per request: [(token, logprob, rank, top ids, top logprobs)] or None
    accepted: dict[int, list[int]] | None = None  # speculative decoding: per request index, its accepted drafts
    # (they come before token_ids[i]; logprobs then have a position axis: [n, K+1, ...])
    proposals: dict[int, np.ndarray] | None = None  # draft model: per request index that drew, its next K drafts
