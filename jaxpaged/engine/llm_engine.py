"""`LLMEngine`: requests in, one scheduler + runner step at a time, `RequestOutput`s out."""

from __future__ import annotations

import functools
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from jaxpaged.config import (
    CacheConfig,
    EngineArgs,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    resolve_kernel_backend,
)
from jaxpaged.core.kv_cache_manager import KVCacheManager, cdiv
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.engine.detokenizer import IncrementalDetokenizer
from jaxpaged.metrics import EngineMetrics
from jaxpaged.models.registry import (
    build_model,
    default_model_path,
    load_hf_config,
    load_tokenizer,
    model_config_from_hf,
)
from jaxpaged.request import CompletionOutput, Logprob, Request, RequestOutput, RequestStatus
from jaxpaged.runner.kv_cache_sizing import num_host_blocks, num_kv_blocks
from jaxpaged.runner.model_runner import ModelRunner
from jaxpaged.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Sequence:
    """One of a request's n samples, as the engine tracks it for output."""

    request: Request
    detokenizer: IncrementalDetokenizer
    final_text: str | None = None  # set when a stop string cut the text
    stop_checked: int = 0  # text length already searched for stop strings

    @property
    def text(self) -> str:
        """Text safe to show: the final text, or the text minus a tail that may still become a stop string."""
        if self.final_text is not None:
            return self.final_text
        text = self.detokenizer.text
        if self.request.finished:
            return text
        return text[: len(text) - _stop_prefix_len(text, self.request.sampling_params.stop)]


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    for k in range(min(len(text), max((len(s) for s in stops), default=1) - 1), 0, -1):
        if any(s.startswith(text[-k:]) for s in stops):
            return k
    return 0


@dataclass
class _ParentRequest:
    """A user request: a prompt and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[_Sequence] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.request.finished for s in self.sequences)


class ModelSetup(NamedTuple):
    """What is known before the weights load: enough to validate prompts cheaply."""

    path: str
    model_config: ModelConfig
    tokenizer: Any
    scheduler_config: SchedulerConfig


def prepare_model(args: EngineArgs) -> ModelSetup:
    """Validate the flags, read the model's config and tokenizer (seconds, no weights, no compile)."""
    args.validate()
    path = args.model or default_model_path()
    model_config = model_config_from_hf(path, load_hf_config(path), args.resolved_dtype())
    tokenizer = load_tokenizer(args.tokenizer or path)
    return ModelSetup(path, model_config, tokenizer, args.scheduler_config(model_config.max_position_embeddings))


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    """A prompt must leave room for at least one generated token."""
    if num_tokens >= max_model_len:
        raise ValueError(f"prompt: {num_tokens} tokens leave no room to generate within max_model_len="
                         f"{max_model_len}")


@dataclass
class EngineStats:
    """Counters since start, for logs, benchmarks and metrics."""

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    peak_kv_blocks_used: int = 0


class LLMEngine:
    """The synchronous engine: add requests, call `step()` until none are unfinished."""

    def __init__(self, config: EngineConfig, tokenizer, model):
        self.config = config
        self.tokenizer = tokenizer
        sc, cc = config.scheduler_config, config.cache_config
        self.kv_cache_manager = KVCacheManager(cc.num_blocks, cc.block_size,
                                               enable_prefix_caching=cc.enable_prefix_caching,
                                               num_host_blocks=cc.num_host_blocks)
        self.scheduler = Scheduler(sc, self.kv_cache_manager)
        self.runner = ModelRunner(config, model)
        self.warmup_seconds = self.runner.warmup()
        self._parents: dict[str, _ParentRequest] = {}
        self._child_to_parent: dict[str, str] = {}
        self._seed_rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        self.stats = EngineStats()
        self.metrics = EngineMetrics()
        # A token's text as vLLM reports it in logprobs: the token decoded alone (' Paris', not 'ĠParis').
        self.token_text = functools.lru_cache(maxsize=1 << 16)(lambda t: tokenizer.decode([t]))

    @classmethod
    def from_engine_args(cls, args: EngineArgs, setup: ModelSetup | None = None) -> LLMEngine:
        """Load the model and tokenizer, size the KV pool, build and warm up the engine.

        `setup` (from `prepare_model`) skips reading the config and tokenizer again.
        """
        path, model_config, tokenizer, sched = setup or prepare_model(args)
        t0 = time.perf_counter()
        attention_backend = resolve_kernel_backend(args.attention_backend)
        sampler_backend = resolve_kernel_backend(args.sampler_backend)
        model = build_model(model_config, kv_chunk=max(32, args.block_size), attention_backend=attention_backend)
        logger.info("Loaded %s (%s, %s) in %.1f s", path, model_config.architecture, model_config.dtype,
                    time.perf_counter() - t0)
        param_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
        blocks = num_kv_blocks(args, model_config, args.block_size, param_bytes)
        if (blocks - 1) * args.block_size < sched.max_model_len:
            logger.warning("The KV pool holds %d tokens, fewer than max_model_len=%d: long requests will be "
                           "rejected", (blocks - 1) * args.block_size, sched.max_model_len)
        config = EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(block_size=args.block_size, num_blocks=blocks,
                                     enable_prefix_caching=args.enable_prefix_caching,
                                     num_host_blocks=num_host_blocks(args, model_config, args.block_size)),
            scheduler_config=sched,
            seed=args.seed,
            compile_guard=args.compile_guard,
            attention_chunk=max(32, args.block_size),
            logprobs_mode=args.logprobs_mode,
            attention_backend=attention_backend,
            sampler_backend=sampler_backend,
            share_forked_blocks=args.share_forked_blocks,
        )
        return cls(config, tokenizer, model)

    # -- requests -----------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
    ) -> str:
        """Queue a prompt (text or token ids); returns its request id. Bad input raises ValueError."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = (prompt, self.tokenize(prompt)) if isinstance(prompt, str) else (None, list(prompt))
        self.validate_prompt(ids, params)
        parent = _ParentRequest(request_id, text, ids)
        base_seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**31))
        rows = self._processor_rows(params)  # read-only, shared by the n samples
        for i in range(params.n):
            seed = base_seed if params.n == 1 else int(np.random.SeedSequence([base_seed, i]).generate_state(1)[0])
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(child_id, ids, params, seed=seed, prompt=text, priority=priority,
                          eos_token_ids=self.config.model_config.eos_token_ids,
                          processor_rows=rows)
            parent.sequences.append(_Sequence(req, IncrementalDetokenizer(
                self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens)))
            self._child_to_parent[child_id] = request_id
        first, *siblings = [seq.request for seq in parent.sequences]
        if siblings and params.n > self.config.scheduler_config.max_num_seqs:
            raise ValueError(f"n: {params.n} samples exceed max_num_seqs={self.config.scheduler_config.max_num_seqs}")
        if siblings and self.config.share_forked_blocks and not params.needs_penalties:
            first.pending_forks = siblings  # they fork from the first once its prompt is computed
            siblings = []
        for req in (first, *siblings):
            self.scheduler.add_request(req)
        self._parents[request_id] = parent
        return request_id

    # -- held requests (beam search drives them token by token) ----------------------------
    def add_held_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Queue a request whose steps compute logprobs but append no token: the caller appends each next token."""
        req = Request(request_id, list(prompt_token_ids), params, seed=0, hold_output=True,
                      eos_token_ids=self.config.model_config.eos_token_ids)
        self.scheduler.add_request(req)
        return req

    def fork_held_request(self, parent: Request, request_id: str) -> Request:
        """A held copy of `parent` (same tokens so far) that shares its blocks until one of them writes."""
        child = Request(request_id, parent.prompt_token_ids, parent.sampling_params, seed=parent.seed,
                        hold_output=True, eos_token_ids=parent.eos_token_ids,
                        output_token_ids=list(parent.output_token_ids))
        self.scheduler.fork(parent, child, parent.num_computed_tokens, share=self.config.share_forked_blocks)
        return child

    def abort_held_request(self, req: Request) -> None:
        self.scheduler.abort_requests([req.request_id])

    def _processor_rows(self, params: SamplingParams):
        """Dense (bias, min_tokens mask) rows [V] for requests that use those features, else None."""
        if not params.needs_bias_row and params.min_tokens == 0:
            return None
        vocab = self.config.model_config.vocab_size
        bias = np.zeros(vocab, np.float32)
        if params.allowed_token_ids is not None:
            bad = [t for t in params.allowed_token_ids if t >= vocab]
            if bad:
                raise ValueError(f"allowed_token_ids: {bad[:5]} are outside the vocabulary [0, {vocab})")
            bias[:] = -np.inf
            bias[params.allowed_token_ids] = 0.0
        for tok, b in (params.logit_bias or {}).items():
            if not 0 <= tok < vocab:
                raise ValueError(f"logit_bias: token id {tok} is outside the vocabulary [0, {vocab})")
            bias[tok] += b
        for word in params.bad_words or []:
            for variant in (word, " " + word):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if len(ids) == 1:  # multi-token bad words are not masked (see README)
                    bias[ids[0]] = -np.inf
        min_mask = np.zeros(vocab, bool)
        if params.min_tokens:
            stop_ids = [t for t in (*self.config.model_config.eos_token_ids, *params.stop_token_ids) if t < vocab]
            min_mask[stop_ids] = True
        return bias, min_mask

    def validate_prompt(self, ids: list[int], params: SamplingParams) -> None:
        sc, cc = self.config.scheduler_config, self.config.cache_config
        vocab = self.config.model_config.vocab_size
        if not ids:
            raise ValueError("prompt: the prompt is empty")
        if any(not isinstance(t, (int, np.integer)) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
        check_prompt_length(len(ids), sc.max_model_len)
        longest = min(len(ids) + (params.max_tokens or sc.max_model_len), sc.max_model_len)
        if cdiv(longest, cc.block_size) > cc.num_blocks - 1:
            raise ValueError(f"prompt: {longest} tokens (prompt + max_tokens) need more KV blocks than the pool has "
                             f"({cc.num_blocks - 1} x {cc.block_size} tokens)")

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests (and all their samples) and free their blocks at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            children = [s.request.request_id for s in parent.sequences]
            for s in parent.sequences:
                s.request.pending_forks = []
                if not s.request.finished:
                    self.metrics.success.labels(finished_reason="abort").inc()
                    if s.request.request_id not in self.scheduler.requests:
                        s.request.status = RequestStatus.FINISHED_ABORTED  # a sibling that never forked
            self.scheduler.abort_requests(children)
            for c in children:
                self._child_to_parent.pop(c, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self._parents)

    # -- stepping -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one jitted step, and return outputs of requests that advanced or ended."""
        out = self.scheduler.schedule()
        if out.is_empty:
            self.runner.prepare_idle(out)  # swaps, copies and freed slots still happen
            return []
        touched: dict[str, None] = {}
        now = time.monotonic()
        for s in out.scheduled:
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
                self.metrics.queue_time.observe(now - s.request.arrival_time)
        prompt_tokens = sum(
            max(0, min(s.request.num_computed_tokens + s.num_new_tokens, len(s.request.prompt_token_ids))
                - s.request.num_computed_tokens) for s in out.scheduled)
        result, prompt_lp = self.runner.execute(out)
        for i, s in enumerate(out.scheduled):
            rows = prompt_lp[i] if prompt_lp else None
            if rows and s.request.num_computed_tokens == len(s.request.prompt_logprob_rows):  # not a recompute
                s.request.prompt_logprob_rows.extend(rows)
            k = s.request.sampling_params.logprobs
            if k is not None and s.samples:
                s.request.output_logprobs.append((float(result.logprob[i]), int(result.rank[i]),
                                                  result.top_ids[i, :k].tolist(), result.top_logprobs[i, :k].tolist()))
        generated = sum(1 for s in out.scheduled if s.samples)  # (held requests' tokens count too)
        advanced = self.scheduler.update_from_output(out, result.token_ids)
        self._record_step(out, prompt_tokens, generated)
        now = time.monotonic()
        for req, new_ids in advanced:
            parent_id = self._child_to_parent.get(req.request_id)
            if parent_id is None:
                continue
            self._observe_token(req, now)
            seq = next(s for s in self._parents[parent_id].sequences if s.request is req)
            seq.detokenizer.add_tokens(new_ids)
            self._check_stop_strings(seq)
            if req.finished:
                seq.detokenizer.flush()
                self._observe_finish(req, now)
            touched[parent_id] = None
        return [self._make_output(pid) for pid in touched]

    def _check_stop_strings(self, seq: _Sequence) -> None:
        req = seq.request
        stops = req.sampling_params.stop
        if not stops or req.status == RequestStatus.FINISHED_ABORTED:
            return
        text = seq.detokenizer.text
        start = max(0, seq.stop_checked - max(len(x) for x in stops) + 1)
        seq.stop_checked = len(text)
        hits = [(i, x) for x in stops if (i := text.find(x, start)) >= 0]
        if not hits:
            return
        i, stop = min(hits)
        seq.final_text = text[: i + len(stop)] if req.sampling_params.include_stop_str_in_output else text[:i]
        if not req.finished:
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
        req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop

    def _record_step(self, out, prompt_tokens: int, generated: int) -> None:
        kv, m = self.kv_cache_manager, self.metrics
        used = kv.pool.num_blocks - 1 - kv.num_free_blocks
        self.stats.peak_kv_blocks_used = max(self.stats.peak_kv_blocks_used, used)
        self.stats.num_steps += 1
        self.stats.num_prompt_tokens += prompt_tokens
        self.stats.num_generation_tokens += generated
        m.observe_step(prompt_tokens=prompt_tokens, generation_tokens=generated, preemptions=len(out.preempted_ids),
                       running=self.scheduler.num_running, waiting=self.scheduler.num_waiting, kv_usage=kv.usage(),
                       prefix_queries_total=kv.num_queried_tokens, prefix_hits_total=kv.num_hit_tokens)
        m.maybe_log()

    def _observe_token(self, req: Request, now: float) -> None:
        if req.last_token_time is None:
            self.metrics.ttft.observe(now - req.arrival_time)
        else:
            self.metrics.itl.observe(now - req.last_token_time)
        req.last_token_time = now

    def _observe_finish(self, req: Request, now: float) -> None:
        self.metrics.e2e.observe(now - req.arrival_time)
        self.metrics.success.labels(finished_reason=req.status.finish_reason).inc()

    def _logprob_fields(self, req: Request) -> dict:
        """vLLM's `logprobs` (one {token_id: Logprob} per generated token) and `cumulative_logprob`."""
        if req.sampling_params.logprobs is None:
            return {}
        decode = self.token_text
        entries = []
        for tok, (lp, rank, top_ids, top_lps) in zip(req.output_token_ids, req.output_logprobs):
            entry = {t: Logprob(v, r + 1, decode(t)) for r, (t, v) in enumerate(zip(top_ids, top_lps))}
            entry[tok] = Logprob(lp, rank, decode(tok))
            entries.append(entry)
        return {"logprobs": entries, "cumulative_logprob": float(sum(e[0] for e in req.output_logprobs))}

    def _prompt_logprobs(self, req: Request) -> list | None:
        """vLLM's `prompt_logprobs`: None for the first prompt token, then {token_id: Logprob} per token."""
        k = req.sampling_params.prompt_logprobs
        if k is None or len(req.prompt_logprob_rows) < len(req.prompt_token_ids) - 1:
            return None
        decode = self.token_text
        entries: list = [None]
        for tok, lp, rank, top_ids, top_lps in req.prompt_logprob_rows:
            entry = {int(t): Logprob(float(v), r + 1, decode(int(t))) for r, (t, v) in
                     enumerate(zip(top_ids[:k], top_lps[:k]))}
            entry[tok] = Logprob(lp, rank, decode(tok))
            entries.append(entry)
        return entries

    def _make_output(self, parent_id: str) -> RequestOutput:
        parent = self._parents[parent_id]
        outputs = [
            CompletionOutput(index=i, text=s.text, token_ids=list(s.request.output_token_ids),
                             finish_reason=s.request.status.finish_reason, stop_reason=s.request.stop_reason,
                             **self._logprob_fields(s.request))
            for i, s in enumerate(parent.sequences)
        ]
        finished = parent.finished
        if finished:
            del self._parents[parent_id]
            for s in parent.sequences:
                self._child_to_parent.pop(s.request.request_id, None)
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs, finished,
                             prompt_logprobs=self._prompt_logprobs(parent.sequences[0].request))
