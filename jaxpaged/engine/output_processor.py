"""`OutputProcessor`: from the core's token outputs to `RequestOutput`s, as each request asked for them.

It gathers a request's n samples, detokenizes, finds stop strings (the core knows only tokens, so a
stop string ends a sample here and the core is told to free it), builds logprob entries, records
the per-request latency metrics, and makes outputs only when they are wanted: each step for
CUMULATIVE and DELTA requests (streaming), once at the end for FINAL_ONLY (`LLM.generate`). A
FINAL_ONLY sample without stop strings is not detokenized token by token: its text is decoded once.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

import jaxpaged.faults as faults
from jaxpaged.engine.core_output import EngineCoreOutput
from jaxpaged.engine.detokenizer import IncrementalDetokenizer, decode_output
from jaxpaged.metrics import EngineMetrics
from jaxpaged.request import CompletionOutput, Logprob, Request, RequestOutput, RequestStatus
from jaxpaged.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


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
    """One of a request's n samples, as the frontend tracks it: its own copies of what the core's records said
    (the core's `Request` is the engine thread's)."""

    index: int
    request_id: str  # the core request's
    params: SamplingParams
    arrival_time: float
    seed: int
    detokenizer: IncrementalDetokenizer | None  # None: FINAL_ONLY without stop strings (decoded at the end)
    token_ids: list[int] = field(default_factory=list)  # output tokens taken in
    token_logprobs: list = field(default_factory=list)  # (asked for) each token's (logprob, rank, top ids, lps)
    last_token_time: float | None = None
    final_text: str | None = None  # set when a stop string cut the text, or at the end
    stop_checked: int = 0  # text length already searched for stop strings
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

    @property
    def num_tokens(self) -> int:  # (the core may be ahead, with tokens this sample will drop)
        return len(self.token_ids)

    def text(self) -> str:
        """Text safe to show: the final text, or the text minus a tail that may still become a stop string."""
        if self.final_text is not None:
            return self.final_text
        text = self.detokenizer.text
        return text[: len(text) - _stop_prefix_len(text, self.params.stop)]


@dataclass
class _Parent:
    """A user request: a prompt and its n samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    priority: int = 0
    tenant: str | None = None
    cache_salt: str | None = None
    samples: list[_Sample] = field(default_factory=list)
    prompt_logprob_rows: list | None = None  # (prompt_logprobs) all of them, once the core has them
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = -1

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
        first = requests[0]
        parent = _Parent(request_id, prompt, prompt_ids, kind, first.priority, first.tenant, first.cache_salt)
        for i, req in enumerate(requests):
            p = req.sampling_params
            incremental = kind != RequestOutputKind.FINAL_ONLY or bool(p.stop)
            det = IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=p.skip_special_tokens,
                                         spaces_between_special_tokens=p.spaces_between_special_tokens
                                         ) if incremental else None
            sample = _Sample(i, req.request_id, p, req.arrival_time, req.seed, det,
                             logprobs=[] if p.logprobs is not None else None, kind=kind)
            parent.samples.append(sample)
            self.sample_of[req.request_id] = sample
            self.parent_of[req.request_id] = parent
        self.parents[request_id] = parent

    def restore_samples(self, request_id: str, saved: list[dict]) -> None:
        """Bring a just-added request's samples to a snapshot's state (engine/snapshot.py): the tokens taken in,
        their text and logprobs, or how a sample finished. Outputs made from here on hold everything so far."""
        parent, now = self.parents[request_id], time.monotonic()
        rows = saved[0]["prompt_logprob_rows"] if saved else []
        if parent.samples and parent.samples[0].params.prompt_logprobs is not None and rows is not None and len(
                rows) >= len(parent.prompt_token_ids) - 1:
            parent.prompt_logprob_rows = [tuple(r) for r in rows]
        for sample, d in zip(parent.samples, saved):
            tokens = d["output_token_ids"]
            sample.token_ids = list(tokens)
            sample.token_logprobs = [tuple(x) for x in d["output_logprobs"]]
            sample.last_token_time = now  # (its next token is no first token)
            parent.num_cached_tokens = max(parent.num_cached_tokens, d["num_cached_tokens"])
            if sample.detokenizer is not None and tokens:
                for t in tokens:  # (one by one: the text a sample streamed token by token)
                    sample.detokenizer.add_tokens([t])
                sample.stop_checked = len(sample.detokenizer.text)
            if sample.logprobs is not None:
                sample.logprobs = [self._logprob_entry(t, info) for t, info in zip(tokens, sample.token_logprobs)]
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
            ids.append(s.request_id)
            self.sample_of.pop(s.request_id, None)
            self.parent_of.pop(s.request_id, None)
            if not s.finished:
                self.metrics.success.labels(finished_reason="abort").inc()
        return ids

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Request outputs for this step's core outputs, and the core requests a stop string ended (to free)."""
        now = time.monotonic()
        touched: dict[str, _Parent] = {}
        stopped: list[str] = []
        first, between, queued = [], [], []  # latencies, observed once per step
        sample_of, parent_of, final_only = self.sample_of, self.parent_of, RequestOutputKind.FINAL_ONLY
        for rec in outputs:
            sample = sample_of.get(rec.request_id)
            if sample is None or sample.finish_reason is not None:
                continue  # aborted, or ended by a stop string while a step was in flight
            parent, token = parent_of[rec.request_id], rec.token
            if rec.prompt_logprob_rows is not None and parent.prompt_logprob_rows is None:
                parent.prompt_logprob_rows = rec.prompt_logprob_rows
            if sample.index == 0:
                parent.num_cached_tokens = rec.num_cached_tokens
            last = sample.last_token_time
            if last is None:
                first.append(now - sample.arrival_time)
                if rec.first_scheduled_time is not None:
                    queued.append(rec.first_scheduled_time - sample.arrival_time)
            elif last != now:  # (speculative decoding: a step's later tokens of a request are not new gaps)
                between.append(now - last)
            sample.last_token_time = now
            sample.token_ids.append(token)
            if rec.logprob is not None:
                sample.token_logprobs.append(rec.logprob)
                if sample.logprobs is not None:
                    sample.logprobs.append(self._logprob_entry(token, rec.logprob))
            if sample.detokenizer is not None:
                try:
                    faults.check("detokenizer")
                    sample.detokenizer.add_tokens([token])
                    if sample.params.stop and self._check_stop_strings(sample):
                        stopped.append(rec.request_id)
                except Exception:  # (this sample's text alone: it ends with an error, the others go on)
                    logger.exception("request %s: detokenizing its output failed; ending it with an error",
                                     rec.request_id)
                    sample.final_text = sample.detokenizer.text
                    sample.finish_reason, sample.stop_reason = "error", None
                    stopped.append(rec.request_id)
            if rec.finished and sample.finish_reason is None:
                sample.finish_reason, sample.stop_reason = rec.finish_reason, rec.stop_reason
            if sample.finish_reason is not None:
                self._finish(sample, now)
            elif sample.kind is final_only:
                continue
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
        p = sample.params
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
        if sample.final_text is None:
            if sample.detokenizer is not None:
                sample.detokenizer.flush()
                sample.final_text = sample.detokenizer.text
            else:
                p = sample.params
                sample.final_text = decode_output(self.tokenizer, self.parent_of[sample.request_id].prompt_token_ids,
                                                  sample.token_ids, skip_special_tokens=p.skip_special_tokens,
                                                  spaces_between_special_tokens=p.spaces_between_special_tokens)
        self.metrics.e2e.observe(now - sample.arrival_time)
        self.metrics.success.labels(finished_reason=sample.finish_reason).inc()

    def _forget(self, parent: _Parent) -> None:
        self.parents.pop(parent.request_id, None)
        for s in parent.samples:
            self.sample_of.pop(s.request_id, None)
            self.parent_of.pop(s.request_id, None)

    def _logprob_entry(self, token: int, info) -> dict[int, Logprob]:
        """vLLM's {token id: Logprob} for one generated token: the top k alternatives and the token itself."""
        lp, rank, top_ids, top_lps = info
        entry = {t: Logprob(v, r + 1, self.token_text(t)) for r, (t, v) in enumerate(zip(top_ids, top_lps))}
        entry[token] = Logprob(lp, rank, self.token_text(token))
        return entry

    def _prompt_logprobs(self, parent: _Parent) -> list | None:
        """vLLM's `prompt_logprobs`: None for the first prompt token, then {token_id: Logprob} per token."""
        k = parent.samples[0].params.prompt_logprobs
        if k is None or parent.prompt_logprob_rows is None:
            return None
        entries: list = [None]
        for tok, lp, rank, top_ids, top_lps in parent.prompt_logprob_rows:
            entry = {int(t): Logprob(float(v), r + 1, self.token_text(int(t))) for r, (t, v) in
                     enumerate(zip(top_ids[:k], top_lps[:k]))}
            entry[tok] = Logprob(lp, rank, self.token_text(tok))
            entries.append(entry)
        return entries

    def _make_output(self, parent: _Parent) -> RequestOutput:
        delta = parent.kind == RequestOutputKind.DELTA
        outputs = []
        for s in parent.samples:
            text, tokens = s.text(), s.token_ids
            logprobs = s.logprobs
            cumulative = float(sum(x[0] for x in s.token_logprobs)) if logprobs is not None else None
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
            prompt_lp = self._prompt_logprobs(parent)
            parent.prompt_logprobs_sent = prompt_lp is not None
        cached = parent.num_cached_tokens
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs, parent.finished,
                             prompt_logprobs=prompt_lp, num_cached_tokens=cached if cached >= 0 else None)


__all__ = ["OutputProcessor", "RequestOutputKind", "RequestStatus"]
