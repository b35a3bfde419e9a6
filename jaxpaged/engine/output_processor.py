"""`OutputProcessor`: from the core's token outputs to `RequestOutput`s, as each request asked for them.

It gathers a request's n samples, detokenizes, finds stop strings (the core knows only tokens, so a
stop string ends a sample here and the core is told to free it), builds logprob entries, records
the per-request latency metrics, and makes outputs only when they are wanted: each step for
CUMULATIVE and DELTA requests (streaming), once at the end for FINAL_ONLY (`LLM.generate`). A
FINAL_ONLY sample without stop strings is not detokenized token by token: its text is decoded once.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from jaxpaged.engine.core import CoreOutput
from jaxpaged.engine.detokenizer import IncrementalDetokenizer, decode_output
from jaxpaged.metrics import EngineMetrics
from jaxpaged.request import CompletionOutput, Logprob, Request, RequestOutput, RequestStatus


class RequestOutputKind(enum.Enum):
    """vLLM's output kinds: every step the whole output so far, only what is new, or once at the end."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    for k in range(min(len(text), max((len(s) for s in stops), default=1) - 1), 0, -1):
        if any(s.startswith(text[-k:]) for s in stops):
            return k
    return 0


@dataclass
class _Sample:
    """One of a request's n samples, as the frontend tracks it."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer | None  # None: FINAL_ONLY without stop strings (decoded at the end)
    final_text: str | None = None  # set when a stop string cut the text, or at the end
    stop_checked: int = 0  # text length already searched for stop strings
    num_tokens: int = 0  # output tokens taken in (the core may be ahead, with tokens this sample will drop)
    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # (its parent's)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list | None = None  # [{token id: Logprob}] per output token, built as tokens arrive
    sent_text: int = 0  # (DELTA) text and tokens already handed out
    sent_tokens: int = 0
    sent_finish: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def text(self) -> str:
        """Text safe to show: the final text, or the text minus a tail that may still become a stop string."""
        if self.final_text is not None:
            return self.final_text
        text = self.detokenizer.text
        return text[: len(text) - _stop_prefix_len(text, self.request.sampling_params.stop)]


@dataclass
class _Parent:
    """A user request: a prompt and its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    samples: list[_Sample] = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


class OutputProcessor:
    """Per-request output state; `process()` turns a step's core outputs into request outputs."""

    def __init__(self, tokenizer, metrics: EngineMetrics):
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.parents: dict[str, _Parent] = {}
        self.sample_of: dict[str, _Sample] = {}  # core request id -> sample
        self.parent_of: dict[str, _Parent] = {}
        self._token_text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        """A token's text as vLLM reports it in logprobs: the token decoded alone (' Paris', not 'ĠParis')."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def add(self, request_id: str, prompt: str | None, prompt_ids: list[int], requests: list[Request],
            kind: RequestOutputKind) -> None:
        parent = _Parent(request_id, prompt, prompt_ids, kind)
        for i, req in enumerate(requests):
            p = req.sampling_params
            incremental = kind != RequestOutputKind.FINAL_ONLY or bool(p.stop)
            det = IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=p.skip_special_tokens,
                                         spaces_between_special_tokens=p.spaces_between_special_tokens
                                         ) if incremental else None
            sample = _Sample(i, req, det, logprobs=[] if p.logprobs is not None else None, kind=kind)
            parent.samples.append(sample)
            self.sample_of[req.request_id] = sample
            self.parent_of[req.request_id] = parent
        self.parents[request_id] = parent

    def restore_samples(self, request_id: str, saved: list[dict]) -> None:
        """Bring a just-added request's samples to a snapshot's state (engine/snapshot.py): the tokens taken in,
        their text and logprobs, or how a sample finished. Outputs made from here on hold everything so far."""
        for sample, d in zip(self.parents[request_id].samples, saved):
            tokens = d["output_token_ids"]
            sample.num_tokens = len(tokens)
            if sample.detokenizer is not None and tokens:
                for t in tokens:  # (one by one: the text a sample streamed token by token)
                    sample.detokenizer.add_tokens([t])
                sample.stop_checked = len(sample.detokenizer.text)
            if sample.logprobs is not None:
                sample.logprobs = [self._logprob_entry(t, info) for t, info in
                                   zip(tokens, sample.request.output_logprobs)]
            if d["finish_reason"] is not None:
                sample.finish_reason, sample.stop_reason = d["finish_reason"], d["stop_reason"]
                sample.final_text = d["final_text"]

    def has(self, request_id: str) -> bool:
        return request_id in self.parents

    def __len__(self) -> int:
        return len(self.parents)

    def abort(self, request_id: str) -> list[str]:
        """Forget a user request; returns its samples' core request ids (the core frees them)."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return []
        ids = []
        for s in parent.samples:
            ids.append(s.request.request_id)
            self.sample_of.pop(s.request.request_id, None)
            self.parent_of.pop(s.request.request_id, None)
            if not s.finished:
                self.metrics.success.labels(finished_reason="abort").inc()
        return ids

    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Request outputs for this step's core outputs, and the core requests a stop string ended (to free)."""
        now = time.monotonic()
        touched: dict[str, _Parent] = {}
        stopped: list[str] = []
        first, between, queued = [], [], []  # latencies, observed once per step
        sample_of, parent_of, final_only = self.sample_of, self.parent_of, RequestOutputKind.FINAL_ONLY
        for req, token, ended in outputs:
            sample = sample_of.get(req.request_id)
            if sample is None or sample.finish_reason is not None:
                continue  # aborted, or ended by a stop string while a step was in flight
            last = req.last_token_time
            if last is None:
                first.append(now - req.arrival_time)
                if req.first_scheduled_time is not None:
                    queued.append(req.first_scheduled_time - req.arrival_time)
            elif last != now:  # (speculative decoding: a step's later tokens of a request are not new gaps)
                between.append(now - last)
            req.last_token_time = now
            sample.num_tokens += 1
            if sample.logprobs is not None:
                sample.logprobs.append(self._logprob_entry(token, req.output_logprobs[sample.num_tokens - 1]))
            if sample.detokenizer is not None:
                sample.detokenizer.add_tokens([token])
                if req.sampling_params.stop and self._check_stop_strings(sample):
                    stopped.append(req.request_id)
            if ended and sample.finish_reason is None:
                sample.finish_reason, sample.stop_reason = req.status.finish_reason, req.stop_reason
            if sample.finish_reason is not None:
                self._finish(sample, now)
            elif sample.kind is final_only:
                continue
            parent = parent_of[req.request_id]
            touched[parent.request_id] = parent
        self.metrics.ttft.observe_many(first)
        self.metrics.itl.observe_many(between)
        self.metrics.queue_time.observe_many(queued)
        results = []
        for parent in touched.values():
            if parent.kind != RequestOutputKind.FINAL_ONLY or parent.finished:
                results.append(self._make_output(parent))
            if parent.finished:
                self._forget(parent)
        return results, stopped

    def _check_stop_strings(self, sample: _Sample) -> bool:
        """End the sample at the first stop string in its text; True if one was found."""
        p = sample.request.sampling_params
        text = sample.detokenizer.text
        start = max(0, sample.stop_checked - max(len(x) for x in p.stop) + 1)
        sample.stop_checked = len(text)
        hits = [(i, x) for x in p.stop if (i := text.find(x, start)) >= 0]
        if not hits:
            return False
        i, stop = min(hits)
        sample.final_text = text[: i + len(stop)] if p.include_stop_str_in_output else text[:i]
        sample.finish_reason, sample.stop_reason = "stop", stop
        return True

    def _finish(self, sample: _Sample, now: float) -> None:
        req = sample.request
        if sample.final_text is None:
            if sample.detokenizer is not None:
                sample.detokenizer.flush()
                sample.final_text = sample.detokenizer.text
            else:
                p = req.sampling_params
                sample.final_text = decode_output(self.tokenizer, req.prompt_token_ids,
                                                  req.output_token_ids[: sample.num_tokens],
                                                  skip_special_tokens=p.skip_special_tokens,
                                                  spaces_between_special_tokens=p.spaces_between_special_tokens)
        self.metrics.e2e.observe(now - req.arrival_time)
        self.metrics.success.labels(finished_reason=sample.finish_reason).inc()

    def _forget(self, parent: _Parent) -> None:
        self.parents.pop(parent.request_id, None)
        for s in parent.samples:
            self.sample_of.pop(s.request.request_id, None)
            self.parent_of.pop(s.request.request_id, None)

    def _logprob_entry(self, token: int, info) -> dict[int, Logprob]:
        """vLLM's {token id: Logprob} for one generated token: the top k alternatives and the token itself."""
        lp, rank, top_ids, top_lps = info
        entry = {t: Logprob(v, r + 1, self.token_text(t)) for r, (t, v) in enumerate(zip(top_ids, top_lps))}
        entry[token] = Logprob(lp, rank, self.token_text(token))
        return entry

    def _prompt_logprobs(self, req: Request) -> list | None:
        """vLLM's `prompt_logprobs`: None for the first prompt token, then {token_id: Logprob} per token."""
        k = req.sampling_params.prompt_logprobs
        if k is None or len(req.prompt_logprob_rows) < len(req.prompt_token_ids) - 1:
            return None
        entries: list = [None]
        for tok, lp, rank, top_ids, top_lps in req.prompt_logprob_rows:
            entry = {int(t): Logprob(float(v), r + 1, self.token_text(int(t))) for r, (t, v) in
                     enumerate(zip(top_ids[:k], top_lps[:k]))}
            entry[tok] = Logprob(lp, rank, self.token_text(tok))
            entries.append(entry)
        return entries

    def _make_output(self, parent: _Parent) -> RequestOutput:
        delta = parent.kind == RequestOutputKind.DELTA
        outputs = []
        for s in parent.samples:
            req = s.request
            text, tokens = s.text(), req.output_token_ids[: s.num_tokens]
            logprobs = s.logprobs
            cumulative = (float(sum(x[0] for x in req.output_logprobs[: s.num_tokens])) if logprobs is not None
                          else None)
            if delta:
                if s.sent_finish or (len(text) == s.sent_text and len(tokens) == s.sent_tokens and not s.finished):
                    continue
                text, new_tokens = text[s.sent_text :], tokens[s.sent_tokens :]
                logprobs = logprobs[s.sent_tokens :] if logprobs is not None else None
                s.sent_text, s.sent_tokens, s.sent_finish = s.sent_text + len(text), len(tokens), s.finished
                tokens = new_tokens
            outputs.append(CompletionOutput(index=s.index, text=text, token_ids=list(tokens),
                                            cumulative_logprob=cumulative, logprobs=logprobs,
                                            finish_reason=s.finish_reason, stop_reason=s.stop_reason))
        prompt_lp = None
        if not (delta and parent.prompt_logprobs_sent):
            prompt_lp = self._prompt_logprobs(parent.samples[0].request)
            parent.prompt_logprobs_sent = prompt_lp is not None
        cached = parent.samples[0].request.num_cached_tokens
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs, parent.finished,
                             prompt_logprobs=prompt_lp, num_cached_tokens=cached if cached >= 0 else None)


__all__ = ["OutputProcessor", "RequestOutputKind", "RequestStatus"]
