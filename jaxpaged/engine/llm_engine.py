"""`LLMEngine`: requests in, `RequestOutput`s out; the engine core and the output processor, in one thread.

Input processing (tokenize, validate, fan n samples out into core requests) happens in `add_request`;
`step()` runs one core step and turns its token outputs into request outputs (`OutputProcessor`).
`AsyncLLM` puts the same pieces on threads instead.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxpaged.faults as faults
from jaxpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, platform_is_gpu
from jaxpaged.core.kv_cache_manager import cdiv
from jaxpaged.distributed import multihost
from jaxpaged.distributed.tensor_parallel import check_tensor_parallel, replica_meshes
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.core import EngineCore
from jaxpaged.engine.core_output import EngineGauges, StepStats
from jaxpaged.engine.data_parallel import DataParallelCore
from jaxpaged.engine.kv_cache_sizing import (
    num_host_blocks,
    num_kv_blocks,
    offload_settings,
)
from jaxpaged.engine.lora_registry import LoRARegistry
from jaxpaged.engine.output_processor import OutputProcessor, RequestOutputKind
from jaxpaged.engine.processor_rows import processor_rows
from jaxpaged.layers.attention import empty_kv_pool_soon
from jaxpaged.layers.backends import resolve_attention_backend, resolve_kernel_backend
from jaxpaged.lora_request import LoRARequest
from jaxpaged.metrics import EngineMetrics
from jaxpaged.models.kv_scales import calibrated_kv_scales, is_fp8
from jaxpaged.models.quantize import weight_bytes
from jaxpaged.models.registry import (
    build_model,
    cpu_has_bf16_dot,
    default_model_path,
    load_hf_config,
    load_tokenizer,
    load_weights,
    model_config_from_hf,
)
from jaxpaged.request import Request, RequestOutput, RequestStatus, check_cache_salt
from jaxpaged.sampling_params import SamplingParams, row_seed
from jaxpaged.spec_decode.draft_model import draft_model_config
from jaxpaged.structured import StructuredOutputManager

logger = logging.getLogger(__name__)


class ModelSetup(NamedTuple):
    """What is known before the weights load: enough to validate prompts cheaply."""

    path: str
    model_config: ModelConfig
    tokenizer: Any
    scheduler_config: SchedulerConfig
    draft_config: ModelConfig | None = None  # speculative decoding's draft model (method "draft_model")


def prepare_model(args: EngineArgs) -> ModelSetup:
    """Validate the flags, read the model's config and tokenizer (seconds, no weights, no compile); with a draft
    model, its config too (checked against the target's tokenizer)."""
    args.validate()
    if args.num_processes > 1:  # (before anything starts JAX's backend)
        multihost.initialize(args.num_processes, args.process_id, args.coordinator_address)
        multihost.check_mesh(args.tensor_parallel_size)
    path = args.model or default_model_path()
    model_config = model_config_from_hf(path, load_hf_config(path), args.resolved_dtype(), args.quantization)
    tokenizer = load_tokenizer(args.tokenizer or path)
    check_tensor_parallel(model_config, args.tensor_parallel_size, args.data_parallel_size)
    spec = args.resolved_speculative_config()
    draft_config = None
    if spec is not None and spec.method == "draft_model":
        draft_config = draft_model_config(spec.model, model_config, tokenizer, args.resolved_dtype())
    return ModelSetup(path, model_config, tokenizer, args.scheduler_config(model_config.max_position_embeddings),
                      draft_config)


def _pool_known_before_weights(args: EngineArgs) -> bool:
    """Whether the KV pool can be sized and made before the weights load: one process, one device, and a size
    that does not depend on the memory the weights leave free."""
    sized_by_free_memory = platform_is_gpu() and args.kv_cache_memory is None and args.num_kv_blocks is None
    return (not sized_by_free_memory and args.tensor_parallel_size == 1 and args.data_parallel_size == 1
            and args.num_processes == 1)


def calibrate_kv_scales(model, tokenizer, kv_dtype: str) -> None:
    """Give `model` fp8 KV scales from the calibration text (models/kv_scales.py), and log their range."""
    start = time.perf_counter()
    scales, amax = calibrated_kv_scales(model.cfg, model.params(), tokenizer, kv_dtype, model.mesh)
    model.set_kv_scales(scales)
    logger.info("fp8 KV scales calibrated in %.1f s: largest |K| per layer and head %.3g-%.3g, |V| %.3g-%.3g",
                time.perf_counter() - start, amax[:, 0].min(), amax[:, 0].max(), amax[:, 1].min(), amax[:, 1].max())


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
    spec_num_drafts: int = 0  # speculative decoding: sequences that verified drafts
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens a verifying sequence emitted per step on average (accepted drafts + 1), None without drafts."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else None


class LLMEngine:
    """The synchronous engine: add requests, call `step()` until none are unfinished."""

    def __init__(self, config: EngineConfig, tokenizer, model, *, stub: bool = False, draft_model=None,
                 kv_pool=None, lora_base_config: ModelConfig | None = None):
        """model: the model, or a list of copies on disjoint devices (data parallelism: a replica each), with a
        LoRA stack where config.lora is set (`add_lora_stack`); kv_pool: one model's KV pool being zeroed already
        (a Future, `empty_kv_pool_soon`), or None. lora_base_config: the model's config before tensor parallelism
        replicated its KV heads (what adapters are checked against; default config.model_config)."""
        self.config = config
        self.loras = (LoRARegistry(lora_base_config or config.model_config, config.lora) if config.lora is not None
                      else None)
        self.tokenizer = tokenizer
        mc = config.model_config
        self.structured = StructuredOutputManager(tokenizer, mc.vocab_size, mc.eos_token_ids)
        models = model if isinstance(model, list) else [model]
        cores = [EngineCore(config, m, stub=stub, structured=self.structured, draft_model=draft_model,
                            kv_pool=kv_pool if len(models) == 1 else None) for m in models]
        self.core = cores[0] if len(cores) == 1 else DataParallelCore(cores)
        self.warmup_seconds = self.core.warmup()
        self._seed_rng = np.random.default_rng(config.seed)
        self._ids = itertools.count()
        self.stats = EngineStats()
        self.metrics = EngineMetrics()
        cc = config.cache_config
        self.metrics.set_cache_info(block_size=cc.block_size, num_blocks=cc.num_blocks * len(self.core.replicas),
                                    dtype=cc.dtype)
        self.output = OutputProcessor(tokenizer, self.metrics)

    # the core's parts, for tests and benchmarks
    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv_cache_manager(self):
        return self.core.kv_cache_manager

    @property
    def runner(self):
        return self.core.runner

    @classmethod
    def from_engine_args(cls, args: EngineArgs, setup: ModelSetup | None = None, *, stub: bool = False
                         ) -> LLMEngine:
        """Load the model and tokenizer, size the KV pool, build and warm up the engine.

        `setup` (from `prepare_model`) skips reading the config and tokenizer again. stub=True: no model and no
        device (`jaxpaged bench host`).
        """
        path, model_config, tokenizer, sched, draft_config = setup or prepare_model(args)
        setup_config = model_config  # (adapters are checked against the checkpoint's shapes)
        t0 = time.perf_counter()
        attention_backend = resolve_attention_backend(args.attention_backend)
        sampler_backend = resolve_kernel_backend(args.sampler_backend)
        model, models, draft_model, param_bytes = None, None, None, 0
        blocks = kv_pool = None
        if not stub and _pool_known_before_weights(args):  # (zeroing it overlaps the weights' load)
            blocks = num_kv_blocks(args, model_config, args.block_size, 0, draft_config)
            kv_pool = empty_kv_pool_soon(model_config.num_layers, blocks, args.block_size, model_config.num_kv_heads,
                                         model_config.head_dim, jnp.dtype(args.resolved_kv_dtype()))
        if not stub:
            weights = load_weights(model_config, args.load_format)  # (once, for every data-parallel replica)
            models = [build_model(model_config, weights=weights, kv_chunk=max(32, args.block_size),
                                  attention_backend=attention_backend, mesh=mesh)
                      for mesh in replica_meshes(args.tensor_parallel_size, args.data_parallel_size)]
            del weights
            if args.enable_lora:  # (before the KV pool is sized: the stack's memory counts)
                lora = args.resolved_lora_config()
                for m in models:
                    m.add_lora_stack(lora.max_loras, lora.max_lora_rank)
            model = models[0]
            model_config = model.cfg  # (tensor parallelism: KV heads replicated up to the devices, where fewer)
            logger.info("Loaded %s (%s, %s weights%s, %s activations, %.0f MiB) in %.1f s", path,
                        model_config.architecture, model_config.dtype,
                        f" kept {model_config.quantization}" if model_config.quantization else "",
                        model_config.compute_dtype, weight_bytes(nnx.state(model)) / 2**20, time.perf_counter() - t0)
            if model_config.dtype == "float32" and not platform_is_gpu() and cpu_has_bf16_dot():
                logger.info("This CPU has bf16 dot instructions: --dtype bfloat16 is faster here (bf16 weights, "
                            "float32 activations; greedy outputs differ slightly from float32's; SmolLM2-135M on "
                            "a 2-core AVX512-BF16 machine: 1.6x, docs/benchmarks/cpu.md)")
            if draft_config is not None:
                draft_model = build_model(draft_config, load_format=args.load_format, kv_chunk=max(32, args.block_size),
                                          attention_backend=attention_backend)
                logger.info("Loaded the draft model %s (%s, %d layers)", draft_config.model, draft_config.architecture,
                            draft_config.num_layers)
            if is_fp8(args.resolved_kv_dtype()) and args.calculate_kv_scales:
                for m in (model, draft_model):
                    if m is not None:
                        calibrate_kv_scales(m, tokenizer, args.resolved_kv_dtype())
                for m in models[1:]:  # (the replicas: the same weights, the same scales)
                    m.set_kv_scales(model.kv_scale[...])
            param_bytes = sum(weight_bytes(nnx.state(m)) for m in (model, draft_model) if m is not None)
        if blocks is None:
            blocks = num_kv_blocks(args, model_config, args.block_size, param_bytes, draft_config)
        blocks = multihost.from_leader(blocks)  # (several processes: each sized its own; all take process 0's)
        if (blocks - 1) * args.block_size < sched.max_model_len:
            logger.warning("The KV pool holds %d tokens, fewer than max_model_len=%d: long requests will be "
                           "rejected", (blocks - 1) * args.block_size, sched.max_model_len)
        config = EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(block_size=args.block_size, num_blocks=blocks, dtype=args.resolved_kv_dtype(),
                                     enable_prefix_caching=args.enable_prefix_caching,
                                     num_host_blocks=num_host_blocks(args, model_config, args.block_size),
                                     kv_role=args.kv_role,
                                     **offload_settings(args, model_config, sched.max_model_len)),
            scheduler_config=sched,
            seed=args.seed,
            compile_guard=args.compile_guard,
            attention_chunk=max(32, args.block_size),
            logprobs_mode=args.logprobs_mode,
            attention_backend=attention_backend,
            sampler_backend=sampler_backend,
            branch_on_host=args.step_branches == "host" or (args.step_branches == "auto" and platform_is_gpu()),
            share_forked_blocks=args.share_forked_blocks,
            async_scheduling=args.resolved_async_scheduling(),
            late_scheduling=args.late_scheduling,
            speculative=args.resolved_speculative_config(),
            draft_model_config=draft_config,
            load_format=args.load_format,
            lora=args.resolved_lora_config(),
        )
        engine = cls(config, tokenizer, models if models and len(models) > 1 else model, stub=stub,
                     draft_model=draft_model, kv_pool=kv_pool, lora_base_config=setup_config)
        engine.param_bytes = param_bytes  # (the weights' bytes on the device, quantized forms as they are)
        return engine

    def wait_for_steps(self) -> None:
        """Wait for the steps the step cache still loads in the background after warmup (a warm start serves at
        once, each bucket's first step waiting for its load): a benchmark calls this before its timed run, so
        the run neither compiles beside itself nor waits for a load."""
        for core in self.core.replicas:
            core.runner.wait_for_steps()

    def flush_kv_offload(self) -> None:
        """Wait until the KV disk tier has written every block handed to it (the engine stays usable)."""
        for core in self.core.replicas:
            if core.offload is not None:
                core.offload.flush()

    # -- requests -----------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        faults.check("tokenizer")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def resolve_lora(self, lora_request: LoRARequest | None):
        """The adapter a request names (loaded and checked: ValueError naming what is wrong), or None."""
        if lora_request is None:
            return None
        if self.loras is None:
            raise ValueError("lora_request: this engine was started without enable_lora")
        return self.loras.resolve(lora_request)

    def make_requests(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                      priority: int = 0, tenant: str | None = None, cache_salt: str | None = None,
                      lora_request: LoRARequest | None = None) -> tuple[str | None, list[int], list[Request]]:
        """Tokenize and validate a prompt, and make its n core requests (bad input raises ValueError). tenant: the
        server's tenant whose KV share the requests count against (`set_kv_shares`). cache_salt: vLLM's, a
        non-empty string mixed into the first block's hash, so only requests with the same salt share cached
        prefix blocks (one tenant's prompts cannot be probed by another's timing). lora_request: the LoRA adapter
        the requests run with (`resolve_lora`; read from its folder the first time)."""
        check_cache_salt(cache_salt)
        text, ids = (prompt, self.tokenize(prompt)) if isinstance(prompt, str) else (None, list(prompt))
        if (cut := params.truncated(ids, self.config.scheduler_config.max_model_len)) is not ids:
            text, ids = None, cut
        self.validate_prompt(ids, params, tenant)
        lora = self.resolve_lora(lora_request)
        if params.n > 1 and params.n > self.config.scheduler_config.max_num_seqs:
            raise ValueError(f"n: {params.n} samples exceed max_num_seqs={self.config.scheduler_config.max_num_seqs}")
        base_seed = row_seed(params.seed) if params.seed is not None else int(self._seed_rng.integers(2**31))
        rows = processor_rows(params, self.config.model_config, self.tokenizer)  # read-only, shared by the n samples
        grammar = self.structured.grammar(params.structured_outputs) if params.structured_outputs else None
        requests = []
        for i in range(params.n):
            seed = base_seed if params.n == 1 else int(np.random.SeedSequence([base_seed, i]).generate_state(1)[0])
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            requests.append(Request(child_id, ids, params, seed=seed, prompt=text, priority=priority, tenant=tenant,
                                    cache_salt=cache_salt, eos_token_ids=self.config.model_config.eos_token_ids,
                                    processor_rows=rows, lora=lora,
                                    grammar_matcher=self.structured.matcher(grammar) if grammar else None))
        return text, ids, requests

    def add_core_requests(self, requests: list[Request]) -> None:
        """Queue a prompt's samples: with shared blocks, the siblings fork from the first once its prompt is in."""
        first, *siblings = requests
        if siblings and self.config.share_forked_blocks and not first.sampling_params.needs_penalties:
            first.pending_forks = siblings
            siblings = []
        self.scheduler.add_requests([first, *siblings])  # (data parallelism: one replica for all)

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a prompt (text or token ids); returns its request id. Bad input raises ValueError. cache_salt,
        lora_request: as `make_requests`'."""
        params = params or SamplingParams()
        if request_id is None:
            request_id = str(next(self._ids))
            while self.output.has(request_id):  # (numbers a restored snapshot's requests hold)
                request_id = str(next(self._ids))
        if self.output.has(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids, requests = self.make_requests(request_id, prompt, params, priority=priority, cache_salt=cache_salt,
                                                 lora_request=lora_request)
        self.output.add(request_id, text, ids, requests, output_kind)
        self.add_core_requests(requests)
        return request_id

    # -- held requests (beam search drives them token by token) ----------------------------
    def add_held_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                         cache_salt: str | None = None, lora=None) -> Request:
        """Queue a request whose steps compute logprobs but append no token: the caller appends each next token.
        lora: its adapter (`resolve_lora`), or None."""
        req = Request(request_id, list(prompt_token_ids), params, seed=0, hold_output=True, cache_salt=cache_salt,
                      eos_token_ids=self.config.model_config.eos_token_ids, lora=lora)
        self.scheduler.add_request(req)
        return req

    def fork_held_request(self, parent: Request, request_id: str) -> Request:
        """A held copy of `parent` (same tokens so far) that shares its blocks until one of them writes."""
        child = Request(request_id, parent.prompt_token_ids, parent.sampling_params, seed=parent.seed,
                        hold_output=True, eos_token_ids=parent.eos_token_ids, cache_salt=parent.cache_salt,
                        output_token_ids=list(parent.output_token_ids), lora=parent.lora)
        self.scheduler.fork(parent, child, parent.num_computed_tokens, share=self.config.share_forked_blocks)
        return child

    def abort_held_request(self, req: Request) -> None:
        self.scheduler.abort_requests([req.request_id])

    def set_kv_shares(self, shares: dict[str, tuple[float, float]] | None) -> None:
        """Tenants' (min, max) fractions of the KV pool, enforced by every replica's scheduler (core/kv_shares.py)."""
        for core in self.core.replicas:
            core.scheduler.set_kv_shares(shares)

    def validate_prompt(self, ids: list[int], params: SamplingParams, tenant: str | None = None) -> None:
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
        shares = self.core.replicas[0].scheduler.shares
        if shares is not None:
            shares.check_fits(tenant, longest)

    # -- snapshots (engine/snapshot.py) ---------------------------------------------------------
    def save_state(self, path: str) -> int:
        """Save every unfinished request to the snapshot folder `path` (atomically; the engine goes on unchanged).
        Returns how many were saved."""
        from jaxpaged.engine.snapshot import save_snapshot

        return save_snapshot(self, path)

    def load_state(self, path: str, *, missing_ok: bool = False, kind: RequestOutputKind | None = None
                   ) -> list[str]:
        """Queue the requests of the newest intact snapshot in `path`, to continue where they were; returns their
        ids. A snapshot of another model, dtype or version raises SnapshotError (a ValueError); none there,
        FileNotFoundError unless missing_ok. kind: how they hand out outputs now (default: as when saved)."""
        from jaxpaged.engine.snapshot import load_snapshot

        return load_snapshot(self, path, missing_ok=missing_ok, kind=kind)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests (and all their samples) and free their blocks at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            self.abort_core_requests(self.output.abort(rid))

    # -- the core's requests, by id (`AsyncLLM`'s engine thread calls these) --------------------------------------
    def abort_core_requests(self, core_ids: list[str]) -> None:
        """Abort core requests and free their blocks; a sibling that never forked is in no queue: it just ends."""
        for cid in core_ids:
            if (req := self.scheduler.requests.get(cid)) is not None:
                req.pending_forks = []
        self.scheduler.abort_requests(core_ids)

    def finish_core_requests(self, core_ids: list[str]) -> None:
        """End core requests that a stop string ended (the output side found it) and free their blocks."""
        self.scheduler.finish_requests(core_ids, RequestStatus.FINISHED_STOPPED)

    def restore_core_requests(self, requests: list[Request]) -> None:
        """Queue a snapshot's core requests as they were (their forks included)."""
        self.scheduler.add_requests(requests)

    def warm_steps(self) -> float:
        """Run every step bucket on an empty batch, so that the first requests a server takes pay no step's
        first run, and time them for the scheduler (see `ModelRunner.warm_steps`); returns seconds spent."""
        start = time.perf_counter()
        times = self.core.warm_steps()
        seconds = time.perf_counter() - start
        if times:
            logger.info("Ran each step bucket in %.1f s; steady step times (ms, all replicas): %s", seconds,
                        ", ".join(f"{t}: {1e3 * s:.0f}" for t, s in times.items()))
        return seconds

    def close(self) -> None:
        """Free the device state (compiled steps, KV pool, weights) at once, without waiting for the engine
        to be garbage-collected; the engine cannot step afterwards."""
        self.core.close()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output)

    # -- stepping -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One core step; returns the outputs of requests that advanced or ended, as each asked for them."""
        outputs = self.core.step()
        self.record_step(self.core.last_stats, self.core.gauges())
        results, stopped = self.output.process(outputs)
        if stopped:
            self.finish_core_requests(stopped)
        return results

    def record_gauges(self, gauges: EngineGauges, step: StepStats | None = None) -> None:
        """The engine's gauges into the metrics, with a step's counters (`record_step`) or alone: after aborts and
        finishes free blocks and no step follows, the last step's gauges (KV usage, running) would stay."""
        self.metrics.observe_step(prompt_tokens=step.num_prompt_tokens if step else 0,
                                  generation_tokens=step.num_generation_tokens if step else 0,
                                  preemptions=step.num_preemptions if step else 0, running=gauges.num_running,
                                  waiting=gauges.num_waiting, kv_usage=gauges.kv_usage,
                                  prefix_queries_total=gauges.prefix_queries_total,
                                  prefix_hits_total=gauges.prefix_hits_total, device_memory=gauges.device_memory_bytes)

    def record_step(self, step: StepStats, gauges: EngineGauges) -> None:
        """A step's counters and the engine's gauges after it into the stats and metrics (values: `AsyncLLM`
        calls this on its output thread)."""
        m = self.metrics
        self.stats.peak_kv_blocks_used = max(self.stats.peak_kv_blocks_used, gauges.kv_blocks_used)
        self.stats.num_steps += 1
        self.stats.num_prompt_tokens += step.num_prompt_tokens
        self.stats.num_generation_tokens += step.num_generation_tokens
        self.record_gauges(gauges, step)
        if gauges.offload is not None:
            m.observe_offload(gauges.offload)
        for t, n in (step.tenant_kv_blocks or {}).items():
            if t is not None:
                m.tenant_kv_blocks.labels(tenant=t).set(n)
        if step.spec_num_drafts:
            self.stats.spec_num_drafts += step.spec_num_drafts
            self.stats.spec_num_draft_tokens += step.spec_num_draft_tokens
            self.stats.spec_num_accepted_tokens += step.spec_num_accepted_tokens
            m.observe_speculation(drafts=step.spec_num_drafts, draft_tokens=step.spec_num_draft_tokens,
                                  accepted=step.spec_num_accepted_tokens, accepted_per_pos=step.spec_accepted_per_pos)
        m.maybe_log()

