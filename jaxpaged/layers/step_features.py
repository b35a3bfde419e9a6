"""Which optional computations a step runs, decided on the host from the step's own inputs.

A `lax.cond` in the step decides on the device, and on a GPU that costs a stall: the predicate goes to the host
and the host waits for the stream before it can launch either branch, so it cannot run ahead of the device
(measured on an H200: ~5 ms of a 12.7 ms step blocked in one conditional). Every predicate the step branches
on is a function of arrays the host builds anyway (temperatures, penalties, min_p, logprob counts, drafts,
prompt-logprob targets, draw rows, the grammar mask), so the host can decide instead and pick a compiled variant
of the step: `StepFeatures` is a static argument, one compiled step per feature set.

`ON_DEVICE` (every flag None) keeps the conditionals: the default where a conditional costs no stall (XLA:CPU
runs them on the host thread that runs the step anyway) and where one executable per bucket matters more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepFeatures:
    """Each flag: True (run it), False (skip it), None (decide on the device with `lax.cond`)."""

    sampling: bool | None = None  # some row samples (not every row greedy)
    min_p: bool | None = None  # some row has min_p > 0
    filter: bool | None = None  # some row has top_k or top_p on
    logprobs: bool | None = None  # some row asks for logprobs
    bias: bool | None = None  # some row has a bias row (logit_bias, allowed_token_ids, bad_words)
    min_tokens: bool | None = None  # some row still suppresses its stop tokens
    penalties: bool | None = None  # some row has repetition, presence or frequency penalties
    bitmask: bool | None = None  # some row draws under a structured-output grammar
    drafts: bool | None = None  # some sequence verifies drafts
    prompt_logprobs: bool | None = None  # some fed prompt token's successor needs its logprobs
    narrow: bool | None = None  # no row past the narrow branch's draws (`sample_rows`)
    propose: bool | None = None  # (draft model) some row draws, so the draft model proposes

    @property
    def on_device(self) -> bool:
        return all(getattr(self, f.name) is None for f in dataclasses.fields(self))

    def describe(self) -> str:
        """The flags that are on, for logs ("plain" when none)."""
        on = [f.name for f in dataclasses.fields(self) if getattr(self, f.name)]
        return "+".join(on) or "plain"


ON_DEVICE = StepFeatures()
FLAGS = tuple(f.name for f in dataclasses.fields(StepFeatures))


def branch(flag: bool | None, predicate: Callable, on: Callable, off: Callable, *operands):
    """`on(*operands)` or `off(*operands)`: chosen by the host's `flag`, or by `lax.cond` on `predicate()` when
    the flag is None. Both must be right for every row; `on` may do work some rows do not need."""
    if flag is None:
        import jax

        return jax.lax.cond(predicate(), on, off, *operands)
    return on(*operands) if flag else off(*operands)


def host_features(inp, *, head_rows: int, num_slots: int, constrained: bool, vocab_size: int,
                  draft_model: bool) -> StepFeatures:
    """The feature set of one step from its host-side `StepInput` (numpy): each flag is the predicate its
    `lax.cond` would evaluate on the device, over all of the step's rows (a superset of the narrow branch's).
    head_rows: the narrow branch's rows (the step's own row count when it has none); constrained: some row
    draws under a grammar."""
    s, p = inp.sampling, inp.sampling.processors
    top_k, top_p = np.asarray(s.top_k), np.asarray(s.top_p)
    draw_rows = np.asarray(inp.draw_rows)
    rows = draw_rows.shape[0]
    return StepFeatures(
        sampling=not bool(np.all(np.asarray(s.temperature) <= 0)),
        min_p=bool(np.any(np.asarray(p.min_p) > 0)),
        filter=bool(np.any(((top_k > 0) & (top_k < vocab_size)) | (top_p < 1.0))),
        logprobs=bool(np.any(np.asarray(s.num_logprobs) >= 0)),
        bias=bool(np.any(p.use_bias)),
        min_tokens=bool(np.any(p.suppress_stop)),
        penalties=bool(np.any((np.asarray(p.repetition_penalty) != 1) | (np.asarray(p.presence_penalty) != 0)
                              | (np.asarray(p.frequency_penalty) != 0))),
        bitmask=constrained,
        drafts=bool(np.any(np.asarray(inp.draft_tokens) >= 0)) if inp.draft_tokens.shape[0] else False,
        prompt_logprobs=bool(np.any(np.asarray(inp.next_prompt_ids) >= 0)),
        narrow=bool(np.all(draw_rows[head_rows:] >= num_slots)) if head_rows < rows else False,
        propose=bool(np.any(draw_rows < num_slots)) if draft_model else False,
    )
