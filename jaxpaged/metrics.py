"""Prometheus metrics with vLLM's names under a `jaxpaged:` prefix, and the periodic log line."""

from __future__ import annotations

import logging
import threading
import time

import jax
import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import HistogramMetricFamily

logger = logging.getLogger("jaxpaged.stats")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)


_device_memory = [-1.0, 0.0]  # (read at, bytes)


def device_memory_in_use(max_age_s: float = 1.0) -> float:
    """Bytes the process holds on its JAX devices: the allocator's count where the backend keeps one (GPU, TPU),
    else the bytes of the live arrays (XLA:CPU keeps no statistics); read at most once per `max_age_s`. Call it
    on the thread that dispatches the steps: from another, the live arrays miss a pool a step has taken in and
    not yet given back."""
    if (now := time.monotonic()) - _device_memory[0] >= max_age_s:
        stats = [d.memory_stats() for d in jax.local_devices()]
        if all(s and "bytes_in_use" in s for s in stats):
            _device_memory[1] = float(sum(s["bytes_in_use"] for s in stats))
        else:
            _device_memory[1] = float(sum(a.nbytes for a in jax.live_arrays()))
        _device_memory[0] = now
    return _device_memory[1]


class BatchHistogram:
    """A Prometheus histogram that takes a step's observations at once (one numpy call, not one per token).

    prometheus-client's Histogram costs microseconds per `observe`; a step of a thousand tokens observes a
    thousand inter-token latencies.
    """

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self.bounds = np.asarray(buckets, np.float64)
        self.counts = np.zeros(len(buckets) + 1, np.int64)  # the last one is +Inf
        self.sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float) -> None:
        self.observe_many([value])

    def observe_many(self, values) -> None:
        if len(values) == 0:
            return
        values = np.asarray(values, np.float64)
        idx = np.searchsorted(self.bounds, values, side="left")  # le semantics: value <= bound
        with self._lock:
            self.counts += np.bincount(idx, minlength=len(self.counts))
            self.sum += float(values.sum())

    @property
    def count(self) -> int:
        return int(self.counts.sum())

    def collect(self):
        with self._lock:
            cumulative = np.cumsum(self.counts)
            total = self.sum
        buckets = [(repr(float(b)), int(c)) for b, c in zip(self.bounds, cumulative[:-1])]
        buckets.append(("+Inf", int(cumulative[-1])))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=total)

    def describe(self):
        return []


class EngineMetrics:
    """Collectors for one engine, in their own registry (several engines can live in one process)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r, p = self.registry, "jaxpaged:"
        self.running = Gauge(p + "num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting to be scheduled.", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_perc", "Fraction of KV blocks held by requests (0-1).",
                              registry=r)
        self.device_memory = Gauge(p + "device_memory_used_bytes", "Bytes held on the JAX devices.", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prefill tokens computed.", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated.", registry=r)
        self.success = Counter(p + "request_success", "Finished requests by reason.", ["finished_reason"],
                               registry=r)
        self.preemptions = Counter(p + "num_preemptions", "Requests preempted.", registry=r)
        self.prefix_queries = Counter(p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Prompt tokens found in the prefix cache.", registry=r)
        self.spec_drafts = Counter(p + "spec_decode_num_drafts", "Sequences that verified draft tokens.", registry=r)
        self.spec_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r)
        self.spec_accepted = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r)
        self.spec_accepted_per_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted at each draft position.", ["position"],
                                             registry=r)
        self.offload_hits = Counter(p + "kv_offload_hits", "Prefix blocks loaded back from an offload tier "
                                    "instead of recomputed.", ["tier"], registry=r)
        self.offload_bytes = Counter(p + "kv_offload_bytes", "KV bytes moved to and from each offload tier.",
                                     ["tier", "direction"], registry=r)
        self.offload_blocks = Gauge(p + "kv_offload_blocks", "Blocks each offload tier holds.", ["tier"], registry=r)
        self._offload: dict[str, int] = {}  # the offload's running totals at the last step
        self._offload_series: list = []  # (stats key, labelled counter)
        self._offload_logged = (0, 0)
        self._spec = [0, 0, 0]  # drafts, draft tokens, accepted (for the log line)
        self._last_spec = [0, 0, 0]
        hist = lambda name, doc: BatchHistogram(p + name, doc, _LATENCY_BUCKETS, r)  # noqa: E731
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between two tokens of a request.")
        self.e2e = hist("e2e_request_latency_seconds", "Request latency, arrival to finish.")
        self.queue_time = hist("request_queue_time_seconds", "Time from arrival to first scheduling.")
        # (a server with tenants) per tenant
        self.tenant_requests = Counter(p + "tenant_requests", "Requests accepted, by tenant.", ["tenant"], registry=r)
        self.tenant_success = Counter(p + "tenant_request_success", "Finished requests by tenant and reason.",
                                      ["tenant", "finished_reason"], registry=r)
        self.tenant_rejections = Counter(p + "tenant_rejections", "Requests refused by a tenant limit (HTTP 429).",
                                         ["tenant", "limit"], registry=r)
        self.tenant_prompt_tokens = Counter(p + "tenant_prompt_tokens", "Prompt tokens of accepted requests.",
                                            ["tenant"], registry=r)
        self.tenant_generation_tokens = Counter(p + "tenant_generation_tokens", "Tokens generated.", ["tenant"],
                                                registry=r)
        self.tenant_kv_blocks = Gauge(p + "tenant_kv_blocks", "KV blocks held by the tenant's running requests.",
                                      ["tenant"], registry=r)
        self.tenant_running = Gauge(p + "tenant_num_requests_running", "Requests in flight, by tenant.", ["tenant"],
                                    registry=r)
        self._last_log = time.monotonic()
        self._totals = {"prompt": 0, "gen": 0, "queries": 0, "hits": 0}  # plain copies, for the log line
        self._last_prompt = 0
        self._last_gen = 0
        self._running = self._waiting = 0
        self._kv_usage = 0.0

    def set_cache_info(self, *, block_size: int, num_blocks: int, dtype: str) -> None:
        """The KV pool's geometry as an info gauge (vLLM's cache_config_info): value 1, facts in the labels."""
        info = Gauge("jaxpaged:cache_config_info", "Information of the KV cache.",
                     ["block_size", "num_gpu_blocks", "cache_dtype"], registry=self.registry)
        info.labels(block_size=str(block_size), num_gpu_blocks=str(num_blocks), cache_dtype=dtype).set(1)

    def observe_step(self, *, prompt_tokens: int, generation_tokens: int, preemptions: int, running: int,
                     waiting: int, kv_usage: float, prefix_queries_total: int, prefix_hits_total: int,
                     device_memory: float | None = None) -> None:
        """Record one engine step (prefix-cache figures are the cache manager's running totals)."""
        t = self._totals
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.preemptions.inc(preemptions)
        self.prefix_queries.inc(prefix_queries_total - t["queries"])
        self.prefix_hits.inc(prefix_hits_total - t["hits"])
        t["prompt"] += prompt_tokens
        t["gen"] += generation_tokens
        t["queries"], t["hits"] = prefix_queries_total, prefix_hits_total
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        if device_memory is not None:
            self.device_memory.set(device_memory)
        self._running, self._waiting, self._kv_usage = running, waiting, kv_usage

    def observe_speculation(self, *, drafts: int, draft_tokens: int, accepted: int,
                            accepted_per_pos: tuple[int, ...]) -> None:
        """Record one step's draft verification (speculative decoding)."""
        self.spec_drafts.inc(drafts)
        self.spec_draft_tokens.inc(draft_tokens)
        self.spec_accepted.inc(accepted)
        for pos, n in enumerate(accepted_per_pos):
            if n:
                self.spec_accepted_per_pos.labels(position=str(pos)).inc(n)
        for j, v in enumerate((drafts, draft_tokens, accepted)):
            self._spec[j] += v

    def observe_offload(self, stats: dict) -> None:
        """Record the offload tiers' running totals (`KVOffload.stats()`)."""
        if not self._offload_series:  # (labelled on first use: engines without tiers export none)
            hits, moved = self.offload_hits, self.offload_bytes
            self._offload_series = [
                ("host_hit_blocks", hits.labels(tier="host")), ("disk_hit_blocks", hits.labels(tier="disk")),
                ("host_stored_bytes", moved.labels(tier="host", direction="store")),
                ("host_loaded_bytes", moved.labels(tier="host", direction="load")),
                ("disk_written_bytes", moved.labels(tier="disk", direction="store")),
                ("disk_read_bytes", moved.labels(tier="disk", direction="load"))]
        last = self._offload
        for key, counter in self._offload_series:
            if stats.get(key, 0) != last.get(key, 0):
                counter.inc(stats[key] - last.get(key, 0))
        self.offload_blocks.labels(tier="host").set(stats["host_blocks"])
        if "disk_blocks" in stats:
            self.offload_blocks.labels(tier="disk").set(stats["disk_blocks"])
        self._offload = stats

    def render(self) -> bytes:
        """The Prometheus text exposition of every collector."""
        return generate_latest(self.registry)

    def maybe_log(self, interval_s: float = 5.0) -> None:
        """Log throughput, queue sizes and KV usage if `interval_s` passed since the last line."""
        now = time.monotonic()
        if now - self._last_log < interval_s:
            return
        t = self._totals
        prompt, gen, queries, hits = t["prompt"], t["gen"], t["queries"], t["hits"]
        dt = now - self._last_log
        logger.info(
            "prompt throughput: %.1f tok/s, generation throughput: %.1f tok/s, running: %d, waiting: %d, "
            "KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%",
            (prompt - self._last_prompt) / dt, (gen - self._last_gen) / dt, self._running, self._waiting,
            100 * self._kv_usage, 100 * hits / queries if queries else 0.0,
        )
        self._last_log, self._last_prompt, self._last_gen = now, prompt, gen
        drafts, tokens, accepted = (a - b for a, b in zip(self._spec, self._last_spec))
        if drafts:
            logger.info("speculative decoding: mean acceptance length %.2f, draft acceptance rate %.1f%% "
                        "(%d drafts, %d draft tokens)", 1 + accepted / drafts, 100 * accepted / max(tokens, 1),
                        drafts, tokens)
        self._last_spec = list(self._spec)
        hits = (self._offload.get("host_hit_blocks", 0), self._offload.get("disk_hit_blocks", 0))
        if hits != self._offload_logged:
            logger.info("KV offload: %d blocks loaded from host, %d from disk (%d / %d since the last line)",
                        *hits, hits[0] - self._offload_logged[0], hits[1] - self._offload_logged[1])
            self._offload_logged = hits
