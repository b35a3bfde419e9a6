"""`EngineCore`: the scheduler and the runner, stepping; it knows tokens, not text.

A step schedules, dispatches the jitted step and takes in results. Synchronously, the results are
those of the step just dispatched. With async scheduling (vLLM's, SGLang's overlap scheduler), step
N+1 is scheduled and dispatched while the device runs step N, and N's results come in after: each
`step()` returns the previous step's outputs. The token drawn in step N reaches step N+1 on the
device; the scheduler counts it as a placeholder until its value arrives. Stop rules, aborts,
preemption, forks and logprobs behave the same in both modes; a request that ends in step N may
have one more token computed in step N+1, which is dropped.
"""

from __future__ import annotations

import itertools
import logging
import time

import jaxpaged.faults as faults
from jaxpaged.config import EngineConfig
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.sched.output import SchedulerOutput
from jaxpaged.core.sched.scheduler import Scheduler
from jaxpaged.engine.core_output import EngineCoreOutput, EngineGauges, StepStats
from jaxpaged.engine.step_clock import StepClock
from jaxpaged.kv_offload import KVOffload
from jaxpaged.metrics import device_memory_in_use
from jaxpaged.request import Request, RequestStatus
from jaxpaged.runner.model_runner import ModelRunner, StepHandle
from jaxpaged.spec_decode.budget import DraftBudget
from jaxpaged.spec_decode.ngram import propose_ngram

logger = logging.getLogger(__name__)

class EngineCore:
    """Schedules and runs steps; `step()` returns per-token records (`EngineCoreOutput`)."""

    def __init__(self, config: EngineConfig, model, *, stub: bool = False, structured=None, draft_model=None,
                 kv_pool=None):
        """kv_pool: the KV pool being zeroed already (a Future, `empty_kv_pool_soon`), or None."""
        self.config = config
        sc, cc = config.scheduler_config, config.cache_config
        self.offload = KVOffload.for_engine(config) if cc.offload_host_blocks and not stub else None
        self.kv_cache_manager = KVCacheManager(cc.num_blocks, cc.block_size,
                                               enable_prefix_caching=cc.enable_prefix_caching,
                                               num_host_blocks=cc.num_host_blocks, offload=self.offload,
                                               export_finished=cc.export_finished_blocks)
        self.scheduler = Scheduler(sc, self.kv_cache_manager, config.lora.max_loras if config.lora else 0)
        self.runner = ModelRunner(config, model, stub=stub, structured=structured, offload=self.offload,
                                  draft_model=draft_model, kv_pool=kv_pool)
        self.speculative = config.speculative
        # Drafts are proposed from known tokens, and a step's accepted count decides where the next one starts:
        # with speculative decoding, each step's results come in before the next is scheduled.
        self.async_scheduling = config.async_scheduling and self.speculative is None
        if config.async_scheduling and self.speculative is not None:
            logger.info("Speculative decoding: steps run synchronously (async scheduling is off)")
        self.draft_budget = (DraftBudget(self.runner.buckets, by_tokens=not self.runner.pays_for_padding)
                             if self.speculative is not None and self.speculative.adaptive else None)
        self._in_flight: StepHandle | None = None
        self._dispatched_at = 0.0
        # late scheduling: the next step is scheduled just before the device ends the one in flight
        self.clock = StepClock() if self.async_scheduling and config.late_scheduling else None
        self.last_stats = StepStats()

    @property
    def replicas(self) -> list[EngineCore]:
        """The cores behind this one: itself (`DataParallelCore` has several)."""
        return [self]

    def warmup(self) -> float:
        seconds = self.runner.warmup()
        if self.draft_budget is not None:  # the step time of each bucket drafts may fill
            sc = self.config.scheduler_config
            start = time.perf_counter()
            most = min(sc.max_num_batched_tokens, sc.max_num_seqs * (1 + self.speculative.num_speculative_tokens))
            times = self.runner.time_buckets(most)
            for bucket, (plain, verifying) in times.items():
                self.draft_budget.observe_step(bucket, plain, False)
                self.draft_budget.observe_step(bucket, verifying, True)
            logger.info("Timed %d step buckets for the draft budget in %.1f s (ms without / with drafts): %s",
                        len(times), time.perf_counter() - start,
                        ", ".join(f"{b}: {1e3 * p:.1f} / {1e3 * v:.1f}" for b, (p, v) in times.items()))
            seconds += time.perf_counter() - start
        return seconds

    def warm_steps(self) -> dict[int, float]:
        """Run every step bucket before serving (`ModelRunner.warm_steps`) and give the scheduler their times
        (it plans prompt chunks with them, `StepCosts`); seconds per bucket."""
        times = self.runner.warm_steps()
        by_tokens = not self.runner.pays_for_padding  # (times are full buckets'; a partly filled step costs less)
        self.scheduler.set_step_costs(times, by_tokens)
        if self.clock is not None:
            self.clock.seed(times, by_tokens)
        return times

    def close(self) -> None:
        """Free the runner's device state and stop the disk tier's writer (after what it has queued)."""
        self.runner.close()
        if self.offload is not None:
            self.offload.close()

    def has_unfinished_requests(self) -> bool:
        """Whether any request runs or waits. (A step may still be in flight: its results concern only
        finished requests then, and the next step drops them.)"""
        return self.scheduler.has_unfinished_requests()

    def schedule_deadline(self) -> float | None:
        """With late scheduling, when (perf_counter s) to call `step()` next: just before the device is predicted
        to finish the step in flight, so that requests arriving until then join the next step (`StepClock`);
        None: now."""
        return self.clock.deadline() if self.clock is not None else None

    def step(self) -> list[EngineCoreOutput]:
        """One step: schedule and dispatch; then the results of this step (sync) or of the one before (async).

        A structured-output mask needs the request's last token: when both the step in flight and the next one
        draw under a grammar, the next step is scheduled and laid out while the device runs, then the step in
        flight's results feed the matchers, and only the masks and the dispatch wait for them."""
        faults.check("step")
        stats, started = StepStats(), time.perf_counter()
        out = self._schedule(stats)  # what runs
        prepared = self.runner.prepare(out)  # laid out on the host
        outputs = self._results_the_masks_need(prepared, stats)  # grammar masks: the step in flight's tokens
        handle = self._dispatch(prepared, started)  # on the device
        outputs += self._results_of_the_step_done(handle, stats)  # tokens in, the scheduler updated
        self._end_step(stats)
        return outputs

    def _schedule(self, stats: StepStats) -> SchedulerOutput:
        out = self.scheduler.schedule()
        stats.num_preemptions = len(out.preempted_ids)
        now = time.monotonic()
        for i in out.block_ids:
            if (req := out.requests[i]).first_scheduled_time is None:
                req.first_scheduled_time = now
        return out

    def _results_the_masks_need(self, prepared, stats: StepStats) -> list[EngineCoreOutput]:
        """(Async) the step in flight's results now, if it and the next step both draw under a grammar."""
        if (self.async_scheduling and self._in_flight is not None and self._in_flight.constrained
                and prepared is not None and prepared.constrained):
            done, self._in_flight = self._in_flight, None
            return self._take_results(done, stats)
        return []

    def _dispatch(self, prepared, scheduling_started: float) -> StepHandle | None:
        self._dispatched_at = time.perf_counter()
        handle = None if prepared is None else self.runner.dispatch(prepared)
        if handle is not None and self.clock is not None:
            self.clock.dispatched(handle.bucket, scheduling_started, time.perf_counter(),
                                  handle.out.total_num_scheduled_tokens)
        return handle

    def _results_of_the_step_done(self, handle: StepHandle | None, stats: StepStats) -> list[EngineCoreOutput]:
        """Sync: the results of the step just dispatched; async: of the one before it (now `handle` is in flight)."""
        if self.async_scheduling:
            done, self._in_flight = self._in_flight, handle
        else:
            done = handle
        return self._take_results(done, stats) if done is not None else []

    def _end_step(self, stats: StepStats) -> None:
        if (shares := self.scheduler.shares) is not None:  # (here: the engine thread owns the running list)
            stats.tenant_kv_blocks = shares.usage(self.scheduler.running, self.kv_cache_manager.req_to_blocks)
        self.last_stats = stats

    def gauges(self) -> EngineGauges:
        """The scheduler's and the KV pool's state now (call on the engine thread)."""
        kv, sched = self.kv_cache_manager, self.scheduler
        return EngineGauges(num_running=sched.num_running, num_waiting=sched.num_waiting,
                            kv_blocks_used=kv.pool.num_blocks - 1 - kv.num_free_blocks, kv_usage=kv.usage(),
                            prefix_queries_total=kv.num_queried_tokens, prefix_hits_total=kv.num_hit_tokens,
                            device_memory_bytes=device_memory_in_use(),
                            offload=self.offload.stats() if self.offload is not None else None)

    @property
    def step_channel(self):
        """The multi-process step channel (`runner/step_channel.py`), or None in one process."""
        return self.runner.channel

    def _advance_grammar(self, req: Request, token: int) -> None:
        """Feed a drawn token to the request's matcher. A complete output (the grammar allows nothing more)
        ends the request, as EOS would, unless it ignores EOS; so does a token the grammar refuses (only
        possible when other settings, e.g. min_tokens or allowed_token_ids, forbid every token it allows). A
        matcher that raises ends its own request with an error; the step's other requests go on."""
        m = req.grammar_matcher
        try:
            faults.check("grammar")
            ok = m.consume_token(token)
            stopped = m.is_stopped()
        except Exception:
            logger.exception("request %s: its structured-output matcher failed; ending it with an error",
                             req.request_id)
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ERROR)
            return
        if not ok:
            logger.warning("request %s: token %d is outside its structured-output grammar (%s); stopping it",
                           req.request_id, token, m.get_error())
        if not ok or (stopped and not req.sampling_params.ignore_eos):
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)

    def _take_results(self, handle: StepHandle, stats: StepStats) -> list[EngineCoreOutput]:
        waited = self.clock is not None and not self.runner.is_done(handle)
        result = self.runner.fetch(handle)
        if self.clock is not None:
            self.clock.fetched(time.perf_counter(), waited)
        if self.draft_budget is not None:
            self.draft_budget.observe_step(handle.bucket, time.perf_counter() - self._dispatched_at,
                                           handle.plan.num_drafts is not None, sum(handle.out.num_new_tokens))
        out: SchedulerOutput = handle.out
        if result.prompt_logprobs is not None:
            for req, start, rows in zip(out.requests, out.starts, result.prompt_logprobs):
                if rows and start == len(req.prompt_logprob_rows):  # (a recompute adds none)
                    req.prompt_logprob_rows.extend(rows)
        stats.num_prompt_tokens = result.num_prompt_tokens
        advanced = self.scheduler.update_from_output(out, result.token_ids, result.accepted)
        if result.proposals is not None:  # (draft model) each request's next drafts, valid at its current length
            for i, drafts in result.proposals.items():
                req = out.requests[i]
                req.draft_proposal = (req.num_tokens, drafts.tolist())
        lp = result.logprobs
        if lp is not None:
            position: dict[int, int] = {}  # (speculative decoding: a request's tokens this step, in order)
            for i, req, _ in advanced:
                if (k := req.sampling_params.logprobs) is not None:
                    at = i
                    if result.accepted is not None:
                        position[i] = j = position.get(i, -1) + 1
                        at = (i, j)
                    req.output_logprobs.append((float(lp[0][at]), int(lp[1][at]), lp[2][at][:k].tolist(),
                                                lp[3][at][:k].tolist()))
        for _, req, token in advanced:
            if req.grammar_matcher is not None and not req.status.finished:
                self._advance_grammar(req, token)
        stats.num_generation_tokens = len(advanced)
        if self.kv_cache_manager.exports:
            self._export_finished_blocks()
        if self.speculative is not None:
            self._propose_drafts()
        if result.accepted is not None:
            self._count_speculation(out, result.accepted, stats)
        return self._records(advanced, lp is not None)

    @staticmethod
    def _records(advanced: list, with_logprobs: bool) -> list[EngineCoreOutput]:
        """The step's tokens as records by value. Only a request's last token of the step ends it; its logprob
        entries are its last ones, in order (several with speculative decoding)."""
        last = {id(req): n for n, (_, req, _) in enumerate(advanced)}
        taken: dict[int, int] = {}  # request -> its tokens of this step so far
        per_request = {}
        for _, req, _ in advanced:
            per_request[id(req)] = per_request.get(id(req), 0) + 1
        records = []
        for n, (_, req, token) in enumerate(advanced):
            finished = req.status.finished and last[id(req)] == n
            logprob = None
            if with_logprobs and req.sampling_params.logprobs is not None:
                j = taken[id(req)] = taken.get(id(req), 0) + 1
                logprob = req.output_logprobs[len(req.output_logprobs) - per_request[id(req)] + j - 1]
            rows = None
            if (req.sampling_params.prompt_logprobs is not None and not req.prompt_logprobs_handed
                    and len(req.prompt_logprob_rows) >= len(req.prompt_token_ids) - 1):
                rows, req.prompt_logprobs_handed = list(req.prompt_logprob_rows), True
            records.append(EngineCoreOutput(
                req.request_id, token, finished, req.status.finish_reason if finished else None,
                req.stop_reason if finished else None, logprob, rows, req.num_cached_tokens,
                req.first_scheduled_time))
        return records

    def _export_finished_blocks(self) -> None:
        """Prefill/decode disaggregation, the producer: the blocks of the requests this step finished go to the
        disk tier now, and are written before the outputs are handed back (so the decode instance the proxy sends
        the request to next finds them). Their device blocks stay cached: the next schedule may hand them out
        again, but only after these copies have read them. Copied through host slots, as many at a time as there
        are slots."""
        todo = self.kv_cache_manager.take_exports()
        while todo:
            left = [e for e in todo if not self.offload.export(*e)]
            stores, loads = self.offload.take()
            assert not loads, "loads are taken by the schedule that makes them"
            if stores:
                self.runner.store_blocks(stores)
            if len(left) == len(todo):  # (no slot at all: cannot happen with a disk tier's staging slots)
                logger.warning("%d finished blocks not exported: no host slot free", len(left))
                break
            todo = left
        self.offload.flush()

    def _count_speculation(self, out: SchedulerOutput, accepted: dict[int, list[int]], stats: StepStats) -> None:
        per_pos = [0] * self.speculative.num_speculative_tokens
        for i, drafts in out.spec_tokens.items():
            if self.draft_budget is not None:
                self.draft_budget.observe_verification(len(drafts), len(accepted[i]))
            stats.spec_num_drafts += 1
            stats.spec_num_draft_tokens += len(drafts)
            stats.spec_num_accepted_tokens += len(accepted[i])
            for j in range(len(accepted[i])):
                per_pos[j] += 1
        stats.spec_accepted_per_pos = tuple(per_pos)

    def can_speculate(self, req: Request) -> bool:
        """Whether drafts may be verified for `req`: not when each position's logits depend on the tokens before
        it beyond the model (penalties, bias rows, min_tokens, a grammar) or a beam's owner picks its tokens; nor
        while n > 1 siblings wait to fork from its first token."""
        p = req.sampling_params
        return (not req.hold_output and not req.pending_forks and req.grammar_matcher is None
                and not p.needs_penalties and not p.needs_bias_row and req.num_output_tokens >= p.min_tokens)

    def _propose_drafts(self) -> None:
        """Drafts for every running request about to decode, within its max_tokens and max_model_len: n-gram
        lookups, or what the draft model proposed in the step just taken."""
        spec, sc, batch = self.speculative, self.config.scheduler_config, self.runner.batch
        proposing, decodes, prefill = [], 0, 0
        for req in self.scheduler.running:
            req.spec_token_ids = ()
            n = req.num_tokens
            if req.num_computed_tokens != n - 1 or req.num_output_placeholders or req.batch_row < 0:
                prefill += max(n - req.num_computed_tokens, 0)
                continue
            decodes += 1
            room = min(spec.num_speculative_tokens, sc.max_model_len - n - 1)
            if (m := req.sampling_params.max_tokens) is not None:
                room = min(room, m - req.num_output_tokens - 1)
            if room <= 0 or not self.can_speculate(req):
                continue
            if spec.method == "draft_model":
                proposal = req.draft_proposal
                req.spec_token_ids = proposal[1][:room] if proposal is not None and proposal[0] == n else []
            else:
                req.spec_token_ids = propose_ngram(batch.token_ids[req.batch_row, :n], room, spec.prompt_lookup_min,
                                                   spec.prompt_lookup_max).tolist()
            if req.spec_token_ids:
                proposing.append(req)
        if self.draft_budget is not None and proposing:
            cap = sc.max_prefill_tokens_with_decodes or sc.max_num_batched_tokens
            if prefill < cap:
                prefill += sum(r.num_tokens for r in itertools.islice(self.scheduler.waiting, 16))
            base = decodes + min(prefill, cap, sc.max_num_batched_tokens - decodes)
            self.draft_budget.trim(base, proposing, sc.max_num_batched_tokens)
