"""`ModelRunner`: holds params and the device state, and runs exactly what the scheduler decided.

One jitted step (model + KV write + attention + last-token logits + sampling) per token bucket,
compiled ahead of time at start. The device state (KV pool, processor rows, each row's last drawn
token) is donated into every call, so XLA updates it in place. `execute` only dispatches: the step
runs on the device while the host goes on (async scheduling builds the next step meanwhile), and
`fetch` brings its results back. A token not yet known on the host (drawn by the step before) is
taken from the device's last-token row, so steps can follow each other without a host round trip.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxpaged.config import EngineConfig
from jaxpaged.config.buckets import pick_token_bucket, seq_bucket
from jaxpaged.core.sched.output import SchedulerOutput
from jaxpaged.distributed.multihost import place, to_host
from jaxpaged.distributed.tensor_parallel import pool_sharding, replicated
from jaxpaged.kv_offload import KVOffload
from jaxpaged.layers.attention import empty_kv_pool, empty_kv_pool_soon, kv_pool_spec
from jaxpaged.layers.backends import CPU_CUSTOM_CALL_TARGETS
from jaxpaged.layers.logits_processors import RowState, write_rows
from jaxpaged.layers.step_features import ON_DEVICE, StepFeatures
from jaxpaged.models.llama import LlamaForCausalLM
from jaxpaged.runner import device_step, step_channel, step_timing
from jaxpaged.runner.block_transfer import CHUNK, BlockTransfer
from jaxpaged.runner.compilation import (
    CompileGuard,
    enable_persistent_compilation_cache,
)
from jaxpaged.runner.input_batch import InputBatch
from jaxpaged.runner.lora_loads import load_loras, warm_lora_writes
from jaxpaged.runner.step_cache import StepCache, step_cache_dir
from jaxpaged.runner.step_input import (
    StepGeometry,
    StepPacker,
    build_step_input,
)
from jaxpaged.runner.step_loader import StepLoader
from jaxpaged.runner.step_records import PreparedStep, StepHandle, StepResult
from jaxpaged.runner.step_results import StepResultReader
from jaxpaged.runner.step_variants import StepVariants
from jaxpaged.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

class ModelRunner:
    """Owns the device state (params, KV pool, processor rows, last tokens) and the compiled steps.

    stub=True (`jaxpaged bench host`): no model and no device work; each step draws token 7 at once, so
    the engine's host path can be timed alone.
    """

    def __init__(self, config: EngineConfig, model: LlamaForCausalLM | None, *, stub: bool = False,
                 structured: StructuredOutputManager | None = None, offload: KVOffload | None = None,
                 draft_model: LlamaForCausalLM | None = None, kv_pool: Future | None = None):
        """kv_pool: the pool being zeroed already (`empty_kv_pool_soon`), or None to start it here."""
        self.config = config
        self.stub = stub
        self.structured = structured
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        chunk_blocks = 4 * config.attention_chunk // cc.block_size  # the widest chunk the attention reads
        width = -(-sc.max_model_len // cc.block_size)
        self.geometry = StepGeometry(cc.block_size, cc.num_blocks, -(-width // chunk_blocks) * chunk_blocks)
        self.buckets = sc.token_buckets()
        self.num_rows = sc.max_num_seqs
        self.spec_width = config.num_speculative_tokens  # K: drafts a sequence may verify per step
        self.batch = InputBatch(self.num_rows, sc.max_model_len, self.geometry.table_width)
        self.results = StepResultReader(self.batch, self._get, stub, self.spec_width)
        self._packers = {t: StepPacker(self._template(t)) for t in self.buckets}
        self.mask_width = (config.model_config.vocab_size + 31) // 32
        self._free_masks: dict[int, jax.Array] = {}  # rows -> an all-ones bitmask kept on the device
        self._compiled: dict[int, jax.stages.Compiled] = {}
        self._loader: StepLoader | None = None  # the step cache's buckets, loading after warmup
        self.guard = CompileGuard()
        self.transfer: BlockTransfer | None = None  # compiled at warmup
        self.draft_transfer: BlockTransfer | None = None  # (the draft pool's copies)
        self._host_pool: np.ndarray | None = None
        self.offload = offload  # the host/disk tiers behind the prefix cache (their stores and loads run here)
        self.mesh = self.channel = self._kv_pool = self._pending_pool = None
        self.closed = False  # (`close`: the device state freed)
        # whether a step costs its whole bucket, or only its real tokens (packed CPU weights: `warm_steps`' times
        # are then full buckets', and a partly filled step costs less)
        self.pays_for_padding = stub or getattr(model, "pays_for_padding", True)
        self.variants = StepVariants(False, self._jitted, num_slots=self.num_rows, vocab_size=mc.vocab_size,
                                     draft_model=draft_model is not None)
        if stub:
            return
        self.graphdef, self.state = nnx.split(model)
        self.mesh = model.mesh  # tensor parallelism: the pool sharded by KV heads, the rest of the state replicated
        # The pool is zeroed on a thread (or was, from before the weights loaded: `kv_pool`) while the steps
        # compile against its shape; `warmup` waits for it at the end.
        pool = (mc.num_layers, cc.num_blocks, cc.block_size, mc.num_kv_heads, mc.head_dim, jnp.dtype(cc.dtype))
        self._pool_args = pool
        self._pool_spec = kv_pool_spec(*pool, sharding=pool_sharding(self.mesh))
        self._pending_pool = kv_pool or empty_kv_pool_soon(*pool, sharding=pool_sharding(self.mesh))
        self.draft_graphdef = self.draft_state = self.draft_pool = None
        if draft_model is not None:  # its own pool, same blocks: the target's block tables index both
            dc = config.draft_model_config
            self.draft_graphdef, self.draft_state = nnx.split(draft_model)
            self.draft_pool = empty_kv_pool(dc.num_layers, cc.num_blocks, cc.block_size, dc.num_kv_heads, dc.head_dim,
                                            jnp.dtype(cc.dtype))
        self.row_state = self._replicated(RowState.zeros(self.num_rows, mc.vocab_size))
        self.last_token = self._replicated(jnp.zeros(self.num_rows, jnp.int32))
        self._write_rows = jax.jit(write_rows, donate_argnums=(0,))
        self.channel = step_channel.attach(self)  # a mesh over several processes: process 0 sends each device call
        # (several processes: each would have to pick the variant; they keep the device's conditionals)
        self.variants.enabled = config.branch_on_host and self.channel is None

    @property
    def kv_pool(self) -> jax.Array:
        """The KV pool [L, 2, N, bs, KH, D] (waits for it to be zeroed, the first time)."""
        if self._pending_pool is not None:
            self._kv_pool, self._pending_pool = self._pending_pool.result(), None
        return self._kv_pool

    @kv_pool.setter
    def kv_pool(self, pool: jax.Array) -> None:
        self._kv_pool, self._pending_pool = pool, None

    def close(self) -> None:
        """Free the device state: compiled steps, KV pools, weights, processor rows (idempotent; the runner
        cannot step afterwards). What still refers to the engine (a stopped server's app, say) then holds
        no device memory and no compiled code."""
        self.closed = True
        if self.stub:
            return
        if self._loader is not None:
            self._loader.close()
        pools = [self._kv_pool, self.draft_pool]
        if self._pending_pool is not None:
            pools.append(self._pending_pool.result())
        for pool in pools:
            if isinstance(pool, jax.Array) and not pool.is_deleted():
                pool.delete()
        self._compiled, self._loader, self._free_masks = {}, None, {}
        self.variants.clear()
        self._kv_pool = self._pending_pool = self.draft_pool = self.transfer = self.draft_transfer = None
        self.state = self.draft_state = self.row_state = self.last_token = self._write_rows = None
        self._host_pool = None

    def _replicated(self, tree):
        """`tree` on every device of the mesh (as is without one)."""
        return tree if self.mesh is None else jax.tree.map(partial(place, sharding=replicated(self.mesh)), tree)

    def _call(self):
        """Hold the multi-process channel for one device call (nothing without one)."""
        return contextlib.nullcontext() if self.channel is None else self.channel.call()

    def _sends(self) -> bool:
        """Whether this process sends its device calls to others (process 0 of several)."""
        return self.channel is not None and self.channel.leader

    # -- the device calls after warmup (process 0 sends each; the other processes make them from `follow`) ----
    def write_row(self, row: int, bias: np.ndarray, min_mask: np.ndarray) -> None:
        """A request's dense processor rows (logit bias, min_tokens mask) into processor slot `row`."""
        with self._call():
            if self._sends():
                self.channel.send_rows(row, bias, min_mask)
            self.row_state = self._write_rows(self.row_state, np.int32(row), bias, min_mask)

    def copy_chunk(self, pairs: list[tuple[int, int]]) -> None:
        """Copy up to `CHUNK` blocks src -> dst in the KV pool."""
        with self._call():
            if self._sends():
                self.channel.send_copy(pairs)
            self.kv_pool = self.transfer.copy(self.kv_pool, pairs)

    def run_step(self, t: int, ints, floats, bitmask, step=None):
        """Run the compiled step of bucket `t` (bitmask: a numpy structured-output mask, or a free mask kept on
        the device; step: a variant of it, `StepVariants`); returns (result, prompt_lp)."""
        if self.closed:  # (before other processes are sent the step)
            raise RuntimeError("the engine was shut down: its steps and KV pool are freed")
        with self._call():
            if self._sends():
                self.channel.send_step(t, ints, floats, bitmask if isinstance(bitmask, np.ndarray) else None)
            step = step or self._ready_step(t)
            return self._run(self._jitted(t) if step is None else step, ints, floats, bitmask)

    def _get(self, tree):
        """Step results on the host (across processes: this process's copy of the replicated results)."""
        return jax.device_get(tree) if self.channel is None else jax.tree.map(to_host, tree)

    def _num_seqs(self, num_tokens: int) -> int:
        return seq_bucket(num_tokens, self.config.scheduler_config.max_num_seqs)

    def _template(self, t: int):
        """An empty step of t tokens whose dense layers and LM head still run on all their rows
        (`num_real_tokens`, `head_rows`), so that timing it (`warm_steps`, `time_buckets`) gives the cost of a
        full bucket (drawing nothing, it takes `sample_rows`' narrow branch)."""
        empty = np.zeros(0, np.int32)
        s = self._num_seqs(t)
        inp, _ = build_step_input(self.batch, empty, empty, empty, np.zeros(0, bool), t, s, self.geometry,
                                  np.zeros(self.num_rows, bool), spec_width=self.spec_width)
        return dataclasses.replace(inp, attn=dataclasses.replace(inp.attn, num_real_tokens=np.asarray(t, np.int32)),
                                   head_rows=np.asarray(s, np.int32))

    def _jitted(self, t: int, features: StepFeatures | None = None):
        """Bucket t's jitted step: the `features` variant, by default the one warmup compiles."""
        features = self.variants.warm.get(t, ON_DEVICE) if features is None else features
        return jax.jit(partial(device_step.device_step, self.graphdef, self.draft_graphdef, self.config.logprobs_mode,
                               self.config.sampler_backend, self.spec_width, self._packers[t], features),
                       donate_argnums=device_step.DONATED)

    def _run(self, step, ints, floats, bitmask):
        """Call a step (compiled or jitted), keeping the device state it returns; returns (result, prompt_lp)."""
        (self.kv_pool, self.row_state, self.last_token, result, prompt_lp, self.draft_pool) = step(
            self.state, self.kv_pool, self.row_state, self.last_token, ints, floats, bitmask, self.draft_state,
            self.draft_pool)
        return result, prompt_lp

    def warmup(self) -> float:
        """Compile the step for every token bucket (ahead of time); returns seconds spent."""
        if self.stub:
            return 0.0
        enable_persistent_compilation_cache()
        start = time.perf_counter()
        if self.channel is not None:  # (before compiling: processes built from other flags fail here, clearly)
            self.channel.check_same_engine()
        logger.info("Compiling the step for %d token buckets: %s", len(self.buckets), self.buckets)
        # Tracing holds the GIL; XLA's compile (or its load from the persistent cache) does not: buckets are
        # traced one by one and compiled on a thread per core (docs/benchmarks/design-choices.md); a bucket
        # found in the step cache is not traced.
        cache = self._step_cache()
        v = self.config.model_config.vocab_size
        args = {}
        for t in self.buckets:
            if self.variants.enabled:  # (the empty step's variant: the warm runs and timings use it)
                self.variants.warm[t] = self.variants.features(self._template(t), constrained=False)
            ints, floats = self._packers[t].pack(self._template(t))
            args[t] = (self.state, self._pool_spec, self.row_state, self.last_token, ints, floats, self._free_mask(t),
                       self.draft_state, self.draft_pool)
        cached = [t for t in self.buckets if cache is not None and cache.has(str(t))]
        if cached:  # (loaded in the background, smallest first: see step_loader.py)
            self._loader = StepLoader({t: partial(self._load_cached, cache, t, args[t]) for t in cached},
                                      workers=max(1, (os.cpu_count() or 1) - 1))
        with ThreadPoolExecutor(max_workers=max(1, min(len(self.buckets), os.cpu_count() or 1))) as pool:
            futures = {}
            for t in self.buckets:
                if t not in cached:
                    step = cache.export(str(t), self._jitted(t), args[t], device_step.DONATED) if cache is not None else None
                    futures[pool.submit((step or self._jitted(t)).lower(*args[t]).compile)] = t
            for future in tqdm(as_completed(futures), total=len(futures), desc="Compiling step buckets",
                               unit="bucket", leave=False):
                self._compiled[futures[future]] = future.result()
        # The small executables after the pool, on this thread: a CI run with them compiling on the pool beside the
        # steps crashed inside XLA's compile once (jaxlib 0.10.2, CPU); steps compiling beside each other had run
        # there for many sessions.
        self._write_rows = self._write_rows.lower(self.row_state, np.int32(0), np.zeros(v, np.float32),
                                                  np.zeros(v, bool)).compile()
        self.transfer = BlockTransfer(self._pool_spec)
        self.draft_transfer = BlockTransfer(self.draft_pool) if self.draft_pool is not None else None
        self.state = warm_lora_writes(self.graphdef, self.state)  # (compiled now rather than at the first load)
        if cached:
            logger.info("%d of %d step buckets are in the step cache %s (loading in the background)", len(cached),
                        len(self.buckets), cache.dir)
        if self.channel is not None:
            self.channel.warmup(self.buckets)
        pool = self.kv_pool.block_until_ready()  # (ready: the pool zeroed)
        if (pool.shape, pool.dtype) != (self._pool_spec.shape, self._pool_spec.dtype):  # (a bug upstream)
            logger.warning("the KV pool made before the weights loaded is %s %s, not %s %s: making it again",
                           pool.shape, pool.dtype, self._pool_spec.shape, self._pool_spec.dtype)
            del pool
            self.kv_pool = None
            self.kv_pool = empty_kv_pool(*self._pool_args, sharding=pool_sharding(self.mesh))
        elapsed = time.perf_counter() - start
        logger.info("Compiled %d step buckets in %.1f s", len(self.buckets), elapsed)
        return elapsed

    def _load_cached(self, cache: StepCache, t: int, args):
        """Bucket t's step from the step cache, compiled (traced again, and its entry replaced, if unusable)."""
        try:
            return cache.compile(str(t), args, device_step.DONATED)
        except Exception as e:  # noqa: BLE001 - a damaged or foreign entry: trace it instead
            logger.warning("the cached step for %d tokens is unusable (%s); tracing it again", t, e)
            step = cache.export(str(t), self._jitted(t), args, device_step.DONATED)
            return (step or self._jitted(t)).lower(*args).compile()

    def _ready_step(self, t: int):
        """Bucket t's compiled step (waiting for its background load, if it is one), or None."""
        step = self._compiled.get(t)
        if step is None and self._loader is not None and t in self._loader:
            step = self._compiled[t] = self._loader.get(t)
        return step

    def wait_for_steps(self) -> None:
        """Wait until every bucket's step is loaded (the step cache's load in the background after warmup)."""
        for t in self.buckets:
            self._ready_step(t)

    def _step_cache(self) -> StepCache | None:
        """The on-disk cache of compiled steps for this engine (one process, no mesh), or None (off)."""
        root = step_cache_dir()
        if root is None or self.mesh is not None or self.channel is not None:
            return None
        shared = (self.state, self._pool_spec, self.row_state, self.last_token, self.draft_state, self.draft_pool)
        cpu = self.config.attention_backend == "cpu"
        calls = CPU_CUSTOM_CALL_TARGETS if cpu else ()
        if "pallas" in (self.config.attention_backend, self.config.sampler_backend):
            calls += ("__gpu$xla.gpu.triton",)  # (Pallas' Triton kernels on GPU)
        config = dataclasses.replace(self.config, cache_config=dataclasses.replace(  # (roles share their steps)
            self.config.cache_config, kv_role=None))
        return StepCache(root, repr((config, self.graphdef, self.draft_graphdef)), shared, calls)

    def _run_empty(self, t: int, inp) -> float:
        """Seconds one run of bucket t's step takes on `inp`, an empty batch (`_template`): its writes go to the pad
        slot and its tokens to no row, so it changes no request's state. (Its own variant, `StepVariants`.)"""
        ints, floats = self._packers[t].pack(inp)
        features, variant = self.variants.features(inp, constrained=False), None
        if self.variants.enabled and not self.variants.is_warm(t, features):
            variant = self.variants.get(t, features, (self.state, self.kv_pool, self.row_state, self.last_token, ints,
                                                      floats, self._free_mask(t), self.draft_state, self.draft_pool))
        start = time.perf_counter()
        result, _ = self.run_step(t, ints, floats, self._free_mask(t), variant)
        jax.block_until_ready(result)
        return time.perf_counter() - start

    def warm_steps(self, timed_runs: int = 2) -> dict[int, float]:
        """Run each bucket's step on an empty batch, so that no request pays a step's first run (`step_timing`);
        seconds per bucket."""
        return {} if self.stub else step_timing.warm_steps(self, timed_runs)

    def time_buckets(self, up_to: int) -> dict[int, tuple[float, float]]:
        """Seconds a step of each token bucket up to `up_to` takes without and with drafts (`step_timing`)."""
        return {} if self.stub else step_timing.time_buckets(self, up_to)

    # -- a step ---------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> StepHandle | None:
        """Apply `out`'s changes to the batch, move blocks, and dispatch the step (None if it computes nothing).

        Returns at once: the step runs on the device until `fetch` needs its results.
        """
        prepared = self.prepare(out)
        return None if prepared is None else self.dispatch(prepared)

    def prepare(self, out: SchedulerOutput) -> PreparedStep | None:
        """The host half of `execute`: batch changes, block moves, the step's packed inputs (None: nothing
        to compute). Structured-output masks wait for `dispatch`, so the caller may first feed the matchers
        the tokens of the step still in flight."""
        batch = self.batch
        for rid in out.finished_ids:
            batch.remove(rid)
        for rid in out.preempted_ids:
            batch.remove(rid)
        if out.moves_blocks and not self.stub:
            self._move_blocks(out)
        if out.lora_loads and not self.stub:  # (several processes never get here: `EngineArgs.validate`)
            self.state = load_loras(self.graphdef, self.state, out.lora_loads)
        if out.is_empty:
            return None
        reset = np.zeros(self.num_rows, bool)
        requests = out.requests
        for i, block_ids in out.block_ids.items():  # requests entering the batch, or whose table changed
            req = requests[i]
            if req.batch_row < 0:
                row = batch.add(req, block_ids)
                reset[row] = True
                if req.processor_rows is not None and not self.stub:
                    self.write_row(row, *req.processor_rows)
            else:
                batch.set_blocks(req.batch_row, block_ids)
        for i, block_ids in out.new_block_ids.items():
            batch.append_blocks(requests[i].batch_row, block_ids)
        rows = np.array([r.batch_row for r in requests], np.int32)
        for row in rows[batch.held[rows]]:  # beams: their owner appended tokens since
            batch.refresh_tokens(int(row))
        n = np.array(out.num_new_tokens, np.int32)
        start = np.array(out.starts, np.int32)
        samples = np.array(out.samples, bool)
        t = pick_token_bucket(self.buckets, int(n.sum()))
        num_drafts = self._write_drafts(out) if out.spec_tokens else None
        inp, plan = build_step_input(batch, rows, n, start, samples, t, self._num_seqs(t), self.geometry, reset,
                                     num_drafts, self.spec_width)
        ints, floats = self._packers[t].pack(inp)
        matchers = [(req.grammar_matcher, j) for j, (i, draws) in enumerate(zip(plan.order, plan.samples))
                    if draws and (req := requests[i]).grammar_matcher is not None]
        features = self.variants.features(inp, constrained=bool(matchers)) if self.variants.enabled else None
        return PreparedStep(out, plan, t, ints, floats, matchers, features)

    def _write_drafts(self, out: SchedulerOutput) -> np.ndarray:
        """Put each request's drafts in its batch row after its known tokens; returns drafts per request."""
        num_drafts = np.zeros(len(out.requests), np.int32)
        for i, drafts in out.spec_tokens.items():
            row, at = out.requests[i].batch_row, out.starts[i] + out.num_new_tokens[i] - len(drafts)
            self.batch.token_ids[row, at : at + len(drafts)] = drafts
            num_drafts[i] = len(drafts)
        return num_drafts

    def dispatch(self, prep: PreparedStep) -> StepHandle:
        """Fill the structured-output masks (from the matchers as they are now) and dispatch the step."""
        t = prep.t
        bitmask = self._free_mask(t)
        if prep.matchers:
            bitmask = np.full((self._num_seqs(t), self.mask_width), -1, np.int32)
            self.structured.fill_bitmask(bitmask, prep.matchers)
        if self.stub:
            return StepHandle(prep.out, prep.plan, np.full(len(prep.plan.order), 7, np.int32), None,
                              prep.constrained, t)
        if self._ready_step(t) is None and self.config.compile_guard:  # (before the guard: a load is no compile)
            raise RuntimeError(f"no compiled step for {t} tokens: warmup() was not run")
        variant = None
        if prep.features is not None and not self.variants.is_warm(t, prep.features):  # (compiled once, here)
            variant = self.variants.get(t, prep.features, (self.state, self.kv_pool, self.row_state, self.last_token,
                                                           prep.ints, prep.floats, bitmask, self.draft_state,
                                                           self.draft_pool))
        with self.guard.watch() if self.config.compile_guard else contextlib.nullcontext():
            result, prompt_lp = self.run_step(t, prep.ints, prep.floats, bitmask, variant)
        return StepHandle(prep.out, prep.plan, result, prompt_lp, prep.constrained, t)

    def _free_mask(self, t: int) -> jax.Array | np.ndarray:
        rows = self._num_seqs(t)
        if self.stub:
            return np.full((rows, self.mask_width), -1, np.int32)
        if rows not in self._free_masks:
            self._free_masks[rows] = self._replicated(jnp.full((rows, self.mask_width), -1, jnp.int32))
        return self._free_masks[rows]

    def is_done(self, handle: StepHandle) -> bool:
        """Whether a dispatched step has finished (fetching its results would not wait)."""
        return self.stub or all(leaf.is_ready() for leaf in jax.tree.leaves(handle.result))

    def fetch(self, handle: StepHandle) -> StepResult:
        """Wait for a dispatched step and bring its results to the host, in scheduler order."""
        return self.results.fetch(handle)

    def prepare_idle(self, out: SchedulerOutput) -> None:
        """For a step that computes nothing: still free ended requests' rows and move blocks."""
        self.execute(out)

    def _move_blocks(self, out: SchedulerOutput) -> None:
        """Fork copies (recorded before this step's schedule), swap-outs, copy-on-write copies, swap-ins: each
        reads its blocks before anything handed out later in the schedule can overwrite them."""
        if self.transfer is None:
            self.transfer = BlockTransfer(self._pool_spec)
        with self.guard.watch() if self.config.compile_guard else contextlib.nullcontext():
            if out.kv_store:  # evicted cached blocks, before anything handed out again overwrites them
                self.store_blocks(out.kv_store)
            if out.fork_copies:
                self._copy_blocks(out.fork_copies)
            if out.swap_out:
                dev, host = zip(*out.swap_out)
                self.transfer.read(self.kv_pool, list(dev), self.host_pool, list(host))
            if out.block_copies:
                self._copy_blocks(out.block_copies)
            if out.swap_in:
                host, dev = zip(*out.swap_in)
                self.kv_pool = self.transfer.write(self.kv_pool, list(dev), self.host_pool, list(host))
            if out.kv_load:  # prefix blocks found in the host (or disk) tier, into their fresh device blocks
                slots, dev = zip(*out.kv_load)
                self.kv_pool = self.transfer.write(self.kv_pool, list(dev), self.offload.host.data, list(slots))

    def store_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks into the offload tier's host slots, (device block, host slot) pairs, and pass them
        on to its disk tier."""
        if self.transfer is None:
            self.transfer = BlockTransfer(self._pool_spec)
        dev, slots = zip(*pairs)
        self.transfer.read(self.kv_pool, list(dev), self.offload.host.data, list(slots))
        self.offload.stored(slots)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy blocks src -> dst in the KV pool, and in the draft model's pool. (Swaps and the offload tiers move
        the target's KV only: a request resumed from them drafts from a stale draft cache until it is rewritten;
        its outputs do not change, drafts are verified.)"""
        for i in range(0, len(pairs), CHUNK):  # (several processes: each chunk is sent just before it is made)
            self.copy_chunk(pairs[i : i + CHUNK])
        if self.draft_pool is not None:
            if self.draft_transfer is None:
                self.draft_transfer = BlockTransfer(self.draft_pool)
            self.draft_pool = self.draft_transfer.copy(self.draft_pool, pairs)

    @property
    def host_pool(self) -> np.ndarray:
        """[host blocks, L, 2, block_size, KH, D] in host memory (a block per row), allocated on first use."""
        if self._host_pool is None:
            cc, shape = self.config.cache_config, self.kv_pool.shape
            self._host_pool = np.zeros((cc.num_host_blocks, *shape[:2], *shape[3:]), self.kv_pool.dtype)
        return self._host_pool
