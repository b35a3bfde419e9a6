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
from jaxpaged.runner.buckets import pick_token_bucket, seq_bucket, token_buckets
from jaxpaged.runner.step_input import StepGeometry, StepInput, build_step_input, row_order
from jaxpaged.logits_processors import RowState, update_row_state, write_rows
from jaxpaged.sampler import SamplerOutput, sample

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


def _step(graphdef, logprobs_mode, state, kv_pool, row_state: RowState, inp: StepInput):
    """The jitted step: forward all scheduled tokens, write K/V, process logits, sample one token per sequence."""
    model = nnx.merge(graphdef, state)
    row_state = update_row_state(row_state, inp.sampling.processors, inp.token_ids)
    hidden, kv_pool = model(inp.token_ids, kv_pool, inp.attn)
    logits = model.compute_logits(hidden[inp.logits_indices])  # [S, V]
    return kv_pool, row_state, sample(logits, row_state, inp.sampling, logprobs_mode=logprobs_mode)


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
        self._jitted = jax.jit(partial(_step, self.graphdef, config.logprobs_mode), donate_argnums=(1, 2))
        self._write_rows = jax.jit(write_rows, donate_argnums=(0,))
        self._compiled: dict[int, jax.stages.Compiled] = {}
        self.guard = CompileGuard()

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
        elapsed = time.perf_counter() - start
        logger.info("Compiled %d step buckets in %.1f s", len(self.buckets), elapsed)
        return elapsed

    def _assign_slots(self, out: SchedulerOutput) -> np.ndarray:
        """Free slots of ended or preempted requests; give new ones a slot (and their processor rows)."""
        self.slots.release(out.finished_ids)
        self.slots.release(out.preempted_ids)
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

    def execute(self, out: SchedulerOutput) -> SamplerOutput:
        """Run one step; returns the sampler output per scheduled request (in `out.scheduled` order), numpy."""
        num_tokens = out.total_num_scheduled_tokens
        t = pick_token_bucket(self.buckets, num_tokens)
        order = row_order(out)
        reset = self._assign_slots(out)
        inp = build_step_input(out, t, self._num_seqs(t), self.geometry, order, self.slots.of, reset)
        step = self._compiled.get(t)
        if step is None:
            if self.config.compile_guard:
                raise RuntimeError(f"no compiled step for {t} tokens: warmup() was not run")
            step = self._jitted
        with self.guard.watch() if self.config.compile_guard else contextlib.nullcontext():
            self.kv_pool, self.row_state, result = step(self.state, self.kv_pool, self.row_state, inp)
            result = jax.device_get(result)
        inverse = np.empty(len(order), np.int64)
        inverse[order] = np.arange(len(order))
        return jax.tree.map(lambda x: x[inverse], result)
