"""A dispatched step's results brought to the host in the scheduler's order: drawn tokens (recorded in the
input batch), verified drafts, the draft model's proposals, logprobs and prompt logprobs, as a `StepResult`."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxpaged.runner.input_batch import InputBatch
from jaxpaged.runner.step_input import StepPlan
from jaxpaged.runner.step_records import StepHandle, StepResult


class StepResultReader:
    """The runner's read side. get: brings a tree of device arrays to the host (a process's own copy, under a
    mesh over several processes). stub: the host-only runner's steps, whose result is its drawn token."""

    def __init__(self, batch: InputBatch, get: Callable, stub: bool, spec_width: int):
        self.batch = batch
        self._get = get
        self.stub = stub
        self.spec_width = spec_width

    def fetch(self, handle: StepHandle) -> StepResult:
        """Wait for a dispatched step and bring its results to the host, in scheduler order; record the drawn
        tokens in the input batch."""
        plan, count = handle.plan, len(handle.plan.order)
        if plan.num_drafts is not None:
            return self._fetch_verified(handle)
        drafts = None
        if self.stub:
            drawn = handle.result
        else:
            drawn, drafts = self._get((handle.result[0].token_ids, handle.result[2]))
            drawn = np.asarray(drawn)[:count]
        keep = plan.samples & ~self.batch.held[plan.rows]  # (a beam's owner picks its token)
        self.batch.record_tokens(plan.rows[keep], plan.draw_positions[keep], drawn[keep], plan.generations[keep])
        tokens = np.full(count, -1, np.int32)
        tokens[plan.order] = np.where(plan.samples, drawn, -1)
        res = None if self.stub else handle.result[0]
        return self._result(handle, tokens, lambda: (res.logprob, res.rank, res.top_ids, res.top_logprobs),
                            proposals=self._proposals(plan, drafts))

    @staticmethod
    def _proposals(plan: StepPlan, drafts) -> dict[int, np.ndarray] | None:
        """The draft model's next drafts [K] per scheduled request index that drew a token (None without)."""
        if drafts is None:
            return None
        drafts = np.asarray(drafts)
        return {int(i): drafts[j] for j, i in enumerate(plan.order) if plan.samples[j]}

    def _fetch_verified(self, handle: StepHandle) -> StepResult:
        """`fetch` for a step that verified drafts: each request's accepted drafts, then its drawn token (the
        residual draw at the first rejection, or the bonus token); logprob arrays get a position axis [n, K+1]."""
        plan, out, count = handle.plan, handle.out, len(handle.plan.order)
        if self.stub:  # every draft rejected: each request emits the step's token 7
            emitted = np.full((count, self.spec_width + 1), -1, np.int32)
            emitted[:, 0] = handle.result
            counts, drafts = np.ones(count, np.int32), None
        else:
            emitted, counts, drafts = self._get((*handle.result[1][:2], handle.result[2]))
            emitted, counts = np.asarray(emitted)[:count], np.asarray(counts)[:count]
        for j, (row, draws, gen, pos, c) in enumerate(zip(plan.rows, plan.samples, plan.generations,
                                                          plan.draw_positions, counts)):
            if draws and not self.batch.held[row]:  # the tokens land from the first draft's position on
                first = pos - plan.num_drafts[j]
                self.batch.record_tokens(np.full(c, row), np.arange(first, first + c), emitted[j, :c],
                                         np.full(c, gen))
        tokens = np.full(count, -1, np.int32)
        last = emitted[np.arange(count), counts - 1]
        tokens[plan.order] = np.where(plan.samples, last, -1)
        accepted = {int(i): emitted[j, : counts[j] - 1].tolist() for j, i in enumerate(plan.order)
                    if i in out.spec_tokens}
        return self._result(handle, tokens, lambda: handle.result[1][2:], accepted, self._proposals(plan, drafts))

    def _result(self, handle: StepHandle, tokens: np.ndarray, logprob_arrays, accepted=None,
                proposals=None) -> StepResult:
        """The StepResult of a fetched step: its tokens, and (when asked) the logprob arrays `logprob_arrays()`
        names, brought to the host in scheduler order, and the prompt logprobs per request."""
        plan, count = handle.plan, len(handle.plan.order)
        logprobs = None
        if plan.wants_logprobs and not self.stub:
            r = self._get(tuple(logprob_arrays()))
            logprobs = tuple(np.empty_like(x[:count]) for x in r)
            for dst, src in zip(logprobs, r):
                dst[plan.order] = src[:count]
        prompt_lp = None
        if plan.wants_prompt_logprobs and not self.stub:
            prompt_lp = self._split_prompt_logprobs(handle, self._get(handle.prompt_lp))
        return StepResult(tokens, plan.num_prompt_tokens, logprobs, prompt_lp, accepted, proposals)

    @staticmethod
    def _split_prompt_logprobs(handle: StepHandle, prompt_lp) -> list:
        """Per scheduled request: (next prompt token, logprob, rank, top ids, top logprobs) of each fed token."""
        lp, rank, top_ids, top_lp = prompt_lp
        plan, out = handle.plan, handle.out
        per_request: list = [None] * len(out.requests)
        t = 0
        for j in plan.order:
            n = out.num_new_tokens[j]
            ids = plan.next_prompt_ids[t : t + n]
            if (ids >= 0).any():
                per_request[j] = [(int(ids[r]), float(lp[t + r]), int(rank[t + r]), top_ids[t + r], top_lp[t + r])
                                  for r in range(n) if ids[r] >= 0]
            t += n
        return per_request
