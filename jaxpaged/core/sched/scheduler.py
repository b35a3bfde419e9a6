"""Continuous batching with one token budget per step (vLLM v1's scheduler, kept short).

Each request has `num_computed_tokens` catching up to its tokens. A step gives running requests
their tokens first (1 for decode, the rest of a chunk for a prefill), then admits waiting requests
while budget, sequence slots and blocks last, in the policy's order (fcfs, priority, sjf: least predicted
work first with aging, hybrid: priority classes then sjf; see `request_queue.policy_rank`). When blocks run out, the
newest (fcfs) or last-ranked running request is preempted (recompute, or swap to host memory).

`schedule()` counts the scheduled tokens as computed at once, and a step that reaches a request's
last token leaves a placeholder for the token it will draw (`num_output_placeholders`). With async
scheduling the next step is scheduled before this one's tokens are known: the placeholder position
is scheduled like any other, and the runner feeds the drawn token on the device. `update_from_output`
then replaces placeholders with tokens and applies the stop rules. In synchronous use placeholders are
resolved before the next `schedule()`.

Forks share blocks: an n > 1 request runs as its first sample until the prompt is computed, then its
siblings fork from it (sharing every block of the prompt but the last token, which each recomputes for
its own logits); beam search forks held requests. A shared block that a request is about to write is
copied first (copy-on-write): the copies travel in `SchedulerOutput.block_copies` (`output.py`).
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxpaged.config import SchedulerConfig
from jaxpaged.core.kv_cache_manager import KVCacheManager, cdiv
from jaxpaged.core.kv_shares import KVShares
from jaxpaged.core.lora_slots import LoRASlots
from jaxpaged.core.sched.output import SchedulerOutput
from jaxpaged.core.sched.prefill_budget import prefill_budget
from jaxpaged.core.sched.request_queue import WaitingQueue, policy_rank, predicted_work
from jaxpaged.core.sched.stop import check_stop
from jaxpaged.core.sched.tenant_room import make_room_for_guarantees
from jaxpaged.core.step_costs import StepCosts
from jaxpaged.request import Request, RequestStatus


class Scheduler:
    """Decides, each step, which requests run and how many tokens each gets."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager, num_lora_slots: int = 0):
        """num_lora_slots: adapters the device's LoRA stack holds at once (0: no LoRA)."""
        self.config = config
        self.kv = kv_cache_manager
        self.waiting = WaitingQueue(config.policy, self.rank)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_swaps = 0
        self._finished_ids: list[str] = []
        self._buckets = config.token_buckets()  # the runner's padded step sizes
        self.shares: KVShares | None = None  # tenants' KV shares (core/kv_shares.py), when the server has tenants
        self.step_costs: StepCosts | None = None  # measured step times (set_step_costs)
        self.loras = LoRASlots(num_lora_slots) if num_lora_slots else None  # which adapters are resident

    def set_kv_shares(self, shares: dict[str, tuple[float, float]] | None) -> None:
        """Enforce tenants' (min, max) fractions of the KV pool from now on (None: no tenants)."""
        self.shares = KVShares(shares, self.kv.pool.num_blocks, self.kv.block_size) if shares else None

    def predicted_work(self, req: Request) -> int:
        """Tokens a request still has to compute (`request_queue.predicted_work`)."""
        return predicted_work(req, self.config.max_model_len)

    def rank(self, req: Request):
        """Sort key of the policy, lower first (`request_queue.policy_rank`)."""
        return policy_rank(req, self.config)

    # -- queue management ---------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def add_requests(self, reqs: list[Request]) -> None:
        """Queue requests that belong together (a prompt's samples)."""
        for req in reqs:
            self.add_request(req)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Stop requests wherever they are and free their blocks. Unknown ids are ignored."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests with `status` (abort, or a stop string the detokenizer found) and free their blocks."""
        ended = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, status)
            ended.append(req)
        return ended

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_reserved_seqs(self) -> int:
        """Running requests plus the siblings they will fork: what counts against max_num_seqs."""
        return len(self.running) + sum(len(r.pending_forks) for r in self.running if r.pending_forks)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.kv.exports:  # (requests ended outside a step, e.g. by a stop string: copied first, with the stores)
            for export in self.kv.take_exports():
                self.kv.offload.export(*export)
        out = SchedulerOutput(finished_ids=self._finished_ids, fork_copies=self.kv.take_copies())
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens
        kv, running = self.kv, self.running
        req_blocks, bs, caching, num_cached = kv.req_to_blocks, kv.block_size, kv.enable_prefix_caching, kv.req_to_num_cached
        max_len, lookahead = self.config.max_model_len, self.config.num_lookahead_tokens
        add_req, add_n, add_start, add_samples = (out.requests.append, out.num_new_tokens.append, out.starts.append,
                                                  out.samples.append)
        shares = self.shares
        if shares is not None:
            make_room_for_guarantees(self, out)
            # Tenants within their minimum first: if one needs a block the pool lacks, the victims (taken from the
            # requests not yet scheduled this step) are then still there to pick from.
            used = shares.usage(running, req_blocks)
            running.sort(key=lambda r: shares.excess(r.tenant, used) > 0)  # (stable: the policy's order within)
        num_made_room = len(out.preempted_ids)
        prefill_left = self._prefill_budget(budget)  # prompt tokens this step may carry
        i = 0
        while i < len(running) and budget > 0:  # (the hot loop: one pass over every running request)
            req = running[i]
            known = len(req.prompt_token_ids) + len(req.output_token_ids)
            computed = req.num_computed_tokens
            placeholders = req.num_output_placeholders
            end = known + placeholders
            if req.hold_output:
                end = known
            elif placeholders:  # (async scheduling) if a token in flight may be its last, wait for it
                max_tokens = req.sampling_params.max_tokens
                if end >= max_len or (max_tokens is not None and len(req.output_token_ids) + placeholders >= max_tokens):
                    end = computed
            n = end - computed
            prefill = n > 1
            n = min(n, prefill_left) if prefill else n
            n = min(n, budget)
            if n <= 0:  # a held request waiting for its owner's token, one at its limit with a token in flight,
                i += 1  # or a prompt with no prefill budget left
                continue
            drafts = req.spec_token_ids
            if drafts:  # (speculative decoding) a decode verifies its drafts in the same step
                req.spec_token_ids = ()
                drafts = drafts[: budget - 1] if n == 1 and not placeholders else ()
                n += len(drafts)
            # In place (the common case, a decode): the tokens fall in one block the request holds alone and fill
            # no block to cache, so `allocate_slots` would do nothing (checked here: it runs for every request).
            blocks = req_blocks.get(req.request_id)
            first = computed // bs
            # (a draft model writes its drafts' KV after a decode's tokens: slots reserved for them, if they fit)
            reach = self._with_lookahead(n, computed) if lookahead and computed + n - len(drafts) == end else n
            if (req.needs_full_table or not blocks or first != (computed + reach - 1) // bs or first >= len(blocks)
                    or blocks[first].ref_cnt != 1
                    or (caching and min(computed + n, known) // bs > num_cached.get(req.request_id, 0))):
                if shares is not None and shares.applies(req.tenant):
                    grow = cdiv(computed + n, bs) - len(blocks or ())  # (lookahead slots are dropped if need be)
                    if grow > 0 and shares.over_max(req.tenant, shares.usage(running, req_blocks), grow):
                        victim = [r for r in running[i:] if r.tenant == req.tenant][-1]  # its tenant's newest
                        self._preempt(victim, out)
                        out.preempted_ids.append(victim.request_id)
                        continue
                copies = len(kv.pending_copies)
                new = kv.allocate_slots(req, reach)
                if new is None and reach > n:  # no room for the lookahead: the draft model's writes then drop
                    new = kv.allocate_slots(req, n)
                if new is None and drafts:  # verify no drafts rather than preempt for them
                    n -= len(drafts)
                    drafts = ()
                    new = kv.allocate_slots(req, n)
                if new is None:
                    victim = self._pick_victim(start=i)
                    self._preempt(victim, out)
                    out.preempted_ids.append(victim.request_id)
                    continue  # `victim` is at index >= i, so scheduled requests keep their slots; retry `req`
                if req.needs_full_table or len(kv.pending_copies) != copies:
                    out.block_ids[len(out.requests)] = kv.block_ids(req.request_id)
                    req.needs_full_table = False
                elif new:
                    out.new_block_ids[len(out.requests)] = [b.block_id for b in new]
            samples = computed + n - len(drafts) == end
            if drafts:
                out.spec_tokens[len(out.requests)] = drafts
            add_req(req)
            add_n(n)
            add_start(computed)
            add_samples(samples)
            req.num_computed_tokens = computed + n
            if samples:
                req.num_output_placeholders = placeholders + 1
            budget -= n
            if prefill:
                prefill_left -= n
            i += 1

        if len(out.preempted_ids) == num_made_room:  # no admissions in a step that had to preempt (except to make
            # room for tenants owed their minimum share)
            self._admit(out, min(budget, prefill_left))
            in_flight = any(r.num_output_placeholders for r in self.running) if not out.requests else True
            for _ in range(0 if in_flight else len(self.running)):  # (bounded: each preempts another request)
                if out.requests or not len(self.waiting):
                    break
                # Nothing runs and no step is in flight: idle held requests (beams waiting for their siblings) may
                # hold the blocks the waiting siblings need. Recompute the newest of them later, behind the waiting
                # ones. (With a step in flight, its results may let the owners go on: wait for them.)
                idle = [r for r in self.running if r.hold_output and self._num_to_compute(r) == 0
                        and not r.num_output_placeholders]
                if not idle:
                    break
                self._preempt(idle[-1], out, front=False)
                out.preempted_ids.append(idle[-1].request_id)
                self._admit(out, budget)
        out.block_copies = self.kv.take_copies()
        if self.kv.offload is not None:
            out.kv_store, out.kv_load = self.kv.offload.take()
        return out

    def _share_allows(self, req: Request, num_tokens: int, num_hits: int, used: dict, waiting_tenants: set) -> bool:
        """Whether admitting `req` with `num_tokens` in blocks (`num_hits` of them cached) keeps its tenant within
        its maximum (`used`: blocks each tenant holds) and leaves the free blocks the other waiting tenants are owed
        up to their minimum. Requests without a share are held to the second rule only."""
        shares, kv = self.shares, self.kv
        total = cdiv(num_tokens, kv.block_size)
        if shares.applies(req.tenant):
            if shares.over_max(req.tenant, used, total):
                return False
            if used[req.tenant] + total <= shares.min[req.tenant]:
                return True  # within its own guarantee
        owed = shares.owed(waiting_tenants, used, but=req.tenant)
        return not owed or kv.num_free_blocks - (total - num_hits) >= owed

    def _num_to_compute(self, req: Request) -> int:
        """Tokens (placeholders included) not yet scheduled; 0 when a token in flight may already be its last."""
        if req.hold_output:
            return req.num_tokens - req.num_computed_tokens
        if req.num_output_placeholders and self._at_limit(req, req.num_output_placeholders):
            return 0
        return req.num_tokens + req.num_output_placeholders - req.num_computed_tokens

    def _at_limit(self, req: Request, extra: int) -> bool:
        """Whether `extra` more output tokens reach max_tokens or max_model_len."""
        p = req.sampling_params
        if p.max_tokens is not None and req.num_output_tokens + extra >= p.max_tokens:
            return True
        return req.num_tokens + extra >= self.config.max_model_len

    def _schedule(self, out: SchedulerOutput, req: Request, n: int) -> None:
        """Record `n` tokens of a request (re)entering the batch, with its whole table, and count them computed."""
        start = req.num_computed_tokens
        end = start + n
        samples = end == req.num_tokens + (0 if req.hold_output else req.num_output_placeholders)
        out.add(req, n, start, samples, block_ids=self.kv.block_ids(req.request_id))
        req.needs_full_table = False
        req.num_computed_tokens = end
        if samples:
            req.num_output_placeholders += 1

    def set_step_costs(self, seconds: dict[int, float] | None, by_tokens: bool = False) -> None:
        """Each token bucket's measured step time (`ModelRunner.warm_steps`), or None: from now on a step carries
        fewer prompt tokens where filling a smaller bucket exactly finishes them sooner (`StepCosts`). Times
        where that never happens (a GPU's: small steps cost about the same) are dropped. by_tokens: a step
        costs its real tokens, not its bucket (`ModelRunner.pays_for_padding` False)."""
        costs = StepCosts(seconds, by_tokens) if seconds else None
        self.step_costs = costs if costs is not None and costs.can_split() else None

    def _prefill_budget(self, budget: int) -> int:
        """Prompt tokens the step may carry (`prefill_budget`)."""
        costs = self.step_costs if self.config.enable_chunked_prefill else None  # (unchunked: a prompt comes whole)
        if costs is None and (not self.config.max_prefill_tokens_with_decodes or not self.running):
            return budget  # (the common case, without a pass over the running requests)
        running = [(self._num_to_compute(r), len(r.spec_token_ids)) for r in self.running]
        return prefill_budget(budget, self.config.max_prefill_tokens_with_decodes, costs, self._buckets, running,
                              self.waiting)

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Request] = []  # waiting for a token in flight (preempted in async mode): they stay first
        # Once a request waits for an adapter slot, no other adapter's request is admitted this step, so the
        # pinned slots drain and it is not passed over for as long as other adapters' traffic lasts.
        lora_blocked = False
        if self.shares is not None:  # (once per step: tenants' blocks, kept up to date below, and who waits)
            used = self.shares.usage(self.running, self.kv.req_to_blocks)
            waiting_tenants = {r.tenant for r in self.waiting}
        while len(self.waiting) and budget > 0:
            req = self.waiting.peek()
            if self.num_reserved_seqs + 1 + len(req.pending_forks) > self.config.max_num_seqs:
                break
            if req.num_output_placeholders:
                skipped.append(self.waiting.pop())
                continue
            if req.lora is not None and (lora_blocked or not self.loras.can_take(req.lora.fingerprint)):
                lora_blocked = True
                skipped.append(self.waiting.pop())  # (the base model's requests still run meanwhile)
                continue
            if self.kv.is_swapped(req):  # resumes where it stopped, its blocks copied back from host memory
                n = min(req.num_tokens - req.num_computed_tokens, budget)
                if self.shares is not None and not self._share_allows(req, req.num_computed_tokens + n, 0, used,
                                                                      waiting_tenants):
                    skipped.append(self.waiting.pop())
                    continue
                pairs = self.kv.swap_in(req, n)
                if pairs is None:
                    break
                self.waiting.pop()
                out.swap_in += pairs
            else:
                hits = self.kv.get_computed_blocks(req)
                offloaded = self.kv.get_offloaded_blocks(req, len(hits))  # the next blocks, from host or disk
                num_cached = (len(hits) + len(offloaded)) * self.kv.block_size
                n = req.num_tokens - num_cached
                if n > budget:
                    if not self.config.enable_chunked_prefill:
                        break
                    n = budget
                # (with a draft model, a prompt computed in full also reserves its lookahead slots)
                reach = self._with_lookahead(n, num_cached) if num_cached + n == req.num_tokens else n
                # (the draft model's lookahead slots are not counted: they are dropped when they do not fit)
                if self.shares is not None and not self._share_allows(req, num_cached + n, len(hits), used,
                                                                      waiting_tenants):
                    skipped.append(self.waiting.pop())  # (others' requests may still fit)
                    continue
                if (self.kv.allocate_slots(req, reach, hits, offloaded) is None
                        and (reach == n or self.kv.allocate_slots(req, n, hits, offloaded) is None)):
                    break
                req.num_computed_tokens = num_cached
                if req.num_cached_tokens < 0:  # (a restored request's outputs are not its prompt's)
                    req.num_cached_tokens = min(num_cached, len(req.prompt_token_ids))
                self.waiting.pop()
                self.kv.num_queried_tokens += req.num_tokens
                self.kv.num_hit_tokens += len(hits) * self.kv.block_size  # (tier hits: the offload's counters)
            req.status = RequestStatus.RUNNING
            req.needs_full_table = True
            self.running.append(req)
            if req.lora is not None:
                self.loras.pin(req, out.lora_loads)
            if self.shares is not None and self.shares.applies(req.tenant):
                used[req.tenant] += len(self.kv.req_to_blocks.get(req.request_id, ()))
            if n:  # (a swapped-in held request may have nothing to compute yet)
                self._schedule(out, req, n)
            budget -= n
        for req in reversed(skipped):
            self.waiting.add(req, front=True)

    def _with_lookahead(self, n: int, start: int) -> int:
        """Slots to hold for `n` tokens from `start` and the draft model's lookahead after them (within
        max_model_len): where the draft model writes the KV of the drafts it proposes after the step."""
        return min(n + self.config.num_lookahead_tokens, self.config.max_model_len - start)

    def fork(self, parent: Request, child: Request, num_tokens: int, *, share: bool = True) -> None:
        """Start `child` running with the parent's first `num_tokens` tokens computed, sharing their blocks
        (or, share=False, with copies of them)."""
        if child.request_id in self.requests:
            raise ValueError(f"request_id {child.request_id!r} is already in use")
        if ((not share and len(self.kv.blocks_of(parent.request_id)) > self.kv.num_free_blocks)
                or (child.lora is not None and self.loras.slot_of(child.lora.fingerprint) < 0)):
            # (no room for copies, or its adapter's slot was retaken while the parent waited: it computes later)
            self.requests[child.request_id] = child
            self.waiting.add(child)
            return
        self.kv.fork(parent, child, num_tokens, share=share)
        child.num_computed_tokens = num_tokens
        child.status = RequestStatus.RUNNING
        child.needs_full_table = True
        self.requests[child.request_id] = child
        self.running.append(child)
        if child.lora is not None:  # (resident, checked above: pinning it loads nothing)
            self.loras.pin(child, [])

    def _pick_victim(self, start: int) -> Request:
        """The running request to preempt, among those not yet scheduled: the newest (fcfs), else the last in
        the policy's order (lowest priority; most predicted work left, aged)."""
        candidates = self.running[start:]
        if self.shares is not None:  # the tenant furthest over its minimum share first
            used = self.shares.usage(self.running, self.kv.req_to_blocks)
            candidates = self.shares.furthest_over(candidates, used) or candidates
        return self._last_in_policy(candidates)

    def _last_in_policy(self, candidates: list[Request]) -> Request:
        """The newest (fcfs), else the last in the policy's order (lowest priority; most predicted work left)."""
        return candidates[-1] if self.config.policy == "fcfs" else max(candidates, key=self.rank)

    def _preempt(self, req: Request, out: SchedulerOutput, *, front: bool = True) -> None:
        """Swap the request's blocks to host memory (swap mode, when they fit and its state survives it),
        else free them and recompute it later."""
        self.running.remove(req)
        if req.lora_slot >= 0:
            self.loras.unpin(req)
        swap = (self.config.preemption_mode == "swap" and req.prefix_cacheable and not req.hold_output
                and self.kv.can_swap_out(req))  # (a held beam may be forked while waiting: it keeps no host copy)
        if swap:
            out.swap_out += self.kv.swap_out(req)
            self.num_swaps += 1
        else:
            self.kv.free(req)
            req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(req, front=front)

    def update_from_output(self, out: SchedulerOutput, sampled_token_ids,
                           accepted: dict[int, list[int]] | None = None) -> list[tuple[int, Request, int]]:
        """Resolve the placeholders of `out`'s sampling requests with their tokens; apply the stop rules; free
        the requests that finished.

        `sampled_token_ids[i]` is the token drawn for `out.requests[i]` (ignored where it draws none).
        `accepted[i]` (speculative decoding): the drafts of request i the step accepted, which come before its
        drawn token; the rejected ones are rolled back (no longer computed; their KV is overwritten later).
        Returns (index in out.requests, request, token) for each request that got a token (held requests
        included: their owner appends it). Tokens of requests that ended meanwhile (abort, stop string, an earlier stop while this
        step was in flight) are dropped.
        """
        results = []
        stopped = False
        tokens = sampled_token_ids.tolist() if hasattr(sampled_token_ids, "tolist") else list(sampled_token_ids)
        max_len = self.config.max_model_len
        for i, (req, draws) in enumerate(zip(out.requests, out.samples)):
            if not draws:
                continue
            req.num_output_placeholders -= 1
            if req.status.finished:
                continue
            token = tokens[i]
            if req.hold_output:
                results.append((i, req, token))
                continue
            if accepted is not None and i in out.spec_tokens:
                stopped |= self._take_speculated(req, i, out.spec_tokens[i], accepted[i], token, results)
                continue
            if req.pending_forks and req.status == RequestStatus.RUNNING:
                # the prompt is computed: siblings fork, each to recompute the last prompt token
                for child in req.pending_forks:
                    self.fork(req, child, len(req.prompt_token_ids) - 1)
                req.pending_forks = []
            out_ids = req.output_token_ids
            out_ids.append(token)
            p = req.sampling_params
            if (token not in req.eos_token_ids and not p.stop_token_ids and len(out_ids) < (p.max_tokens or max_len)
                    and len(out_ids) + len(req.prompt_token_ids) < max_len):
                results.append((i, req, token))  # (the common case: no stop rule applies)
                continue
            status = check_stop(req, token, self.config.max_model_len)
            if status is not None:
                if req.status == RequestStatus.RUNNING:
                    stopped = True
                else:
                    self.waiting.remove(req)
                self._finish(req, status)
            results.append((i, req, token))
        if stopped:
            self.running = [r for r in self.running if not r.finished]
        return results

    def _take_speculated(self, req: Request, i: int, drafts: list[int], accepted: list[int], token: int,
                         results: list) -> bool:
        """Append a verified request's accepted drafts and its drawn token, stopping at the first that ends it;
        roll back the rejected drafts. Returns whether a running request stopped."""
        req.num_computed_tokens -= len(drafts) - len(accepted)
        if req.pending_forks and req.status == RequestStatus.RUNNING:  # (drafts verified at the prompt's end)
            for child in req.pending_forks:
                self.fork(req, child, len(req.prompt_token_ids) - 1)
            req.pending_forks = []
        req.num_draft_tokens += len(drafts)
        req.num_accepted_tokens += len(accepted)
        req.num_draft_rejections += len(accepted) < len(drafts)
        for t in (*accepted, token):
            req.output_token_ids.append(t)
            results.append((i, req, t))
            status = check_stop(req, t, self.config.max_model_len)
            if status is not None:
                running = req.status == RequestStatus.RUNNING
                if not running:
                    self.waiting.remove(req)
                self._finish(req, status)
                return running
        return False

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.lora_slot >= 0:
            self.loras.unpin(req)
        self._finished_ids.append(req.request_id)
        req.status = status
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
