"""`ModelRunner`: holds params and the KV pool, and runs exactly what the scheduler decided.

One jitted step (model + KV write + attention + last-token logits + sampling) per token bucket,
compiled ahead of time at start. The pool is donated into every call, so XLA updates it in place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxpaged.attention import empty_kv_pool
from jaxpaged.config import EngineConfig
from jaxpaged.core.scheduler import SchedulerOutput
from jaxpaged.models.llama import LlamaForCausalLM
from jaxpaged.runner.block_transfer import BlockTransfer
from jaxpaged.runner.buckets import pick_token_bucket, seq_bucket, token_buckets
from jaxpaged.runner.step_input import StepGeometry, StepInput, build_step_input, row_order
from jaxpaged.logits_processors import RowState, update_row_state, write_rows
from jaxpaged.sampler import SamplerOutput, sample, token_logprobs
from jaxpaged.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)

_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")


class CompileGuard:
    """Counts JAX traces and compiles; `check()` raises if any happened inside `watch()`."""

    _installed: list[CompileGuard] = []

    def __init__(self):
        self.count = 0
        self._active = False
        if not CompileGuard._installed:
            jax.monitoring.register_event_duration_secs_listener(CompileGuard._on_event)
        CompileGuard._installed.append(self)

    @staticmethod
    def _on_event(event: str, duration: float, **kwargs) -> None:
        if event in _COMPILE_EVENTS:
            for g in CompileGuard._installed:
                if g._active:
                    g.count += 1

    @contextlib.contextmanager
    def watch(self):
        before, self._active = self.count, True
        try:
            yield
        finally:
            self._active = False
        if self.count != before:
            raise RuntimeError(
                f"the step compiled {self.count - before} time(s) after warmup: a shape or dtype escaped the buckets"
            )


def enable_persistent_compilation_cache() -> None:
    """Keep compiled steps on disk so a second start skips XLA compilation."""
    cache_dir = os.environ.get("JAXPAGED_COMPILATION_CACHE", os.path.expanduser("~/.cache/jaxpaged/xla"))
    if cache_dir in ("", "0", "off"):
        return
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _step(graphdef, logprobs_mode, sampler_backend, state, kv_pool, row_state: RowState, inp: StepInput):
    """The jitted step: forward all scheduled tokens, write K/V, process logits, sample one token per sequence."""
    model = nnx.merge(graphdef, state)
    row_state = update_row_state(row_state, inp.sampling.processors, inp.token_ids)
    hidden, kv_pool = model(inp.token_ids, kv_pool, inp.attn)
    logits = model.compute_logits(hidden[inp.logits_indices])  # [S, V]
    out = sample(logits, row_state, inp.sampling, logprobs_mode=logprobs_mode, backend=sampler_backend)
    return kv_pool, row_state, out, prompt_logprobs(model, hidden, inp.next_prompt_ids)


def prompt_logprobs(model, hidden, next_ids):
    """Logprob information of each fed prompt token's successor [T]; all logits only if some row asks."""
    t = hidden.shape[0]
    none = (jnp.zeros(t, jnp.float32), jnp.zeros(t, jnp.int32), jnp.zeros((t, MAX_LOGPROBS), jnp.int32),
            jnp.zeros((t, MAX_LOGPROBS), jnp.float32))
    compute = lambda h, ids: token_logprobs(model.compute_logits(h), jnp.maximum(ids, 0))  # noqa: E731
    return jax.lax.cond(jnp.any(next_ids >= 0), compute, lambda *_: none, hidden, next_ids)


class SlotTable:
    """Processor-state rows of running requests: one per request while it runs."""

    def __init__(self, num_slots: int):
        self.free = list(range(num_slots - 1, -1, -1))
        self.of: dict[str, int] = {}

    def release(self, request_ids) -> None:
        for rid in request_ids:
            slot = self.of.pop(rid, None)
            if slot is not None:
                self.free.append(slot)

    def assign(self, request_id: str) -> int:
        slot = self.free.pop()
        self.of[request_id] = slot
        return slot


class ModelRunner:
    """Owns the device state (params, KV pool) and the compiled steps."""

    def __init__(self, config: EngineConfig, model: LlamaForCausalLM):
        self.config = config
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        self.graphdef, self.state = nnx.split(model)
        self.kv_pool = empty_kv_pool(mc.num_layers, cc.num_blocks, cc.block_size, mc.num_kv_heads, mc.head_dim,
                                     jnp.dtype(mc.dtype))
        chunk_blocks = 4 * config.attention_chunk // cc.block_size  # the widest chunk the attention reads
        width = -(-sc.max_model_len // cc.block_size)
        self.geometry = StepGeometry(cc.block_size, cc.num_blocks, -(-width // chunk_blocks) * chunk_blocks)
        self.buckets = token_buckets(sc.max_num_batched_tokens)
        self.num_slots = sc.max_num_seqs
        self.row_state = RowState.zeros(self.num_slots, mc.vocab_size)
        self.slots = SlotTable(self.num_slots)
        self._jitted = jax.jit(partial(_step, self.graphdef, config.logprobs_mode, config.sampler_backend), donate_argnums=(1, 2))
        self._write_rows = jax.jit(write_rows, donate_argnums=(0,))
        self._compiled: dict[int, jax.stages.Compiled] = {}
        self.guard = CompileGuard()
        self.transfer: BlockTransfer | None = None  # compiled at warmup
        self._host_pool: np.ndarray | None = None

    def _num_seqs(self, num_tokens: int) -> int:
        return seq_bucket(num_tokens, self.config.scheduler_config.max_num_seqs)

    def warmup(self) -> float:
        """Compile the step for every token bucket (ahead of time); returns seconds spent."""
        enable_persistent_compilation_cache()
        start = time.perf_counter()
        logger.info("Compiling the step for %d token buckets: %s", len(self.buckets), self.buckets)
        for t in tqdm(self.buckets, desc="Compiling step buckets", unit="bucket", leave=False):
            dummy = build_step_input(SchedulerOutput(), t, self._num_seqs(t), self.geometry, [], {},
                                     np.zeros(self.num_slots, bool))
            self._compiled[t] = self._jitted.lower(self.state, self.kv_pool, self.row_state, dummy).compile()
        v = self.config.model_config.vocab_size
        self._write_rows = self._write_rows.lower(self.row_state, np.int32(0), np.zeros(v, np.float32),
                                                  np.zeros(v, bool)).compile()
        self.transfer = BlockTransfer(self.kv_pool)
        elapsed = time.perf_counter() - start
        logger.info("Compiled %d step buckets in %.1f s", len(self.buckets), elapsed)
        return elapsed

    def _release_slots(self, out: SchedulerOutput) -> None:
        self.slots.release(out.finished_ids)
        self.slots.release(out.preempted_ids)

    def _assign_slots(self, out: SchedulerOutput) -> np.ndarray:
        """Free slots of ended or preempted requests; give new ones a slot (and their processor rows)."""
        self._release_slots(out)
        reset = np.zeros(self.num_slots, bool)
        for s in out.scheduled:
            req = s.request
            if req.request_id in self.slots.of:
                continue
            slot = self.slots.assign(req.request_id)
            reset[slot] = True
            if req.processor_rows is not None:
                bias, min_mask = req.processor_rows
                self.row_state = self._write_rows(self.row_state, np.int32(slot), bias, min_mask)
        return reset

    def execute(self, out: SchedulerOutput) -> tuple[SamplerOutput, list | None]:
        """Run one step, in `out.scheduled` order (numpy): the sampler output, and per request its prompt
        logprob rows (logprob, rank, top ids, top logprobs for each fed token) or None."""
        num_tokens = out.total_num_scheduled_tokens
        t = pick_token_bucket(self.buckets, num_tokens)
        order = row_order(out)
        reset = self._assign_slots(out)
        inp = build_step_input(out, t, self._num_seqs(t), self.geometry, order, self.slots.of, reset)
        if out.moves_blocks:
            self._move_blocks(out)
        step = self._compiled.get(t)
        if step is None:
            if self.config.compile_guard:
                raise RuntimeError(f"no compiled step for {t} tokens: warmup() was not run")
            step = self._jitted
        with self.guard.watch() if self.config.compile_guard else contextlib.nullcontext():
            self.kv_pool, self.row_state, result, prompt_lp = step(self.state, self.kv_pool, self.row_state, inp)
            result = jax.device_get(result)
        inverse = np.empty(len(order), np.int64)
        inverse[order] = np.arange(len(order))
        return jax.tree.map(lambda x: x[inverse], result), self._split_prompt_logprobs(out, order, inp, prompt_lp)

    def prepare_idle(self, out: SchedulerOutput) -> None:
        """For a step that computes nothing: still free ended requests' slots and move blocks."""
        self._release_slots(out)
        if out.moves_blocks:
            self._move_blocks(out)

    def _move_blocks(self, out: SchedulerOutput) -> None:
        """Fork copies (recorded before this step's schedule), swap-outs, copy-on-write copies, swap-ins: each
        reads its blocks before anything handed out later in the schedule can overwrite them."""
        if self.transfer is None:
            self.transfer = BlockTransfer(self.kv_pool)
        with self.guard.watch() if self.config.compile_guard else contextlib.nullcontext():
            if out.fork_copies:
                self.kv_pool = self.transfer.copy(self.kv_pool, out.fork_copies)
            if out.swap_out:
                dev, host = zip(*out.swap_out)
                self.host_pool[:, :, list(host)] = self.transfer.read(self.kv_pool, list(dev))
            if out.block_copies:
                self.kv_pool = self.transfer.copy(self.kv_pool, out.block_copies)
            if out.swap_in:
                host, dev = zip(*out.swap_in)
                self.kv_pool = self.transfer.write(self.kv_pool, list(dev), self.host_pool[:, :, list(host)])

    @property
    def host_pool(self) -> np.ndarray:
        """[L, 2, host blocks, block_size, KH, D] in host memory, allocated on first use."""
        if self._host_pool is None:
            cc, shape = self.config.cache_config, self.kv_pool.shape
            self._host_pool = np.zeros((*shape[:2], cc.num_host_blocks, *shape[3:]), self.kv_pool.dtype)
        return self._host_pool

    @staticmethod
    def _split_prompt_logprobs(out: SchedulerOutput, order: list[int], inp: StepInput, prompt_lp):
        if not (inp.next_prompt_ids >= 0).any():
            return None
        lp, rank, top_ids, top_lp = jax.device_get(prompt_lp)
        per_request: list = [None] * len(out.scheduled)
        t = 0
        for j in order:
            n = out.scheduled[j].num_new_tokens
            rows = [r for r in range(t, t + n) if inp.next_prompt_ids[r] >= 0]
            if rows:
                per_request[j] = [(int(inp.next_prompt_ids[r]), float(lp[r]), int(rank[r]), top_ids[r], top_lp[r])
                                  for r in rows]
            t += n
        return per_request
