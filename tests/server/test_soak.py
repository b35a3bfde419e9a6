"""`jaxpaged bench soak`: its traffic mix against a live server for 3 minutes (the CI version of the hour-long
run) keeps every request within the contract, leaves no KV block held and grows neither memory nor descriptors
after its warm-up; it samples what it says it samples, and its verdict flags growth (it can fail)."""

from __future__ import annotations

import asyncio
import logging
import os

import jax
import pytest

from jaxpaged.bench.soak import KINDS, drive, svg_plot, verdict
from tests.server.conftest import API_KEY, serving


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir("llama-bytes")) as s:  # (a tokenizer the structured-output kinds can use)
        yield s


def test_the_mix_runs_clean_and_is_sampled(server, tmp_path, caplog):
    run = asyncio.run(drive(server.base_url, os.getpid(), duration=180, sample_every=10, concurrency=4,
                            max_tokens=8, api_key=API_KEY, quiet=True, warmup=40))
    assert run["errors"] == 0, run["errors"]
    assert run["requests"] >= 2 * len(KINDS)  # (each kind drawn, most likely several times)
    samples = run["samples"]
    assert len(samples) >= 17 and all(s["rss_mb"] > 0 and s["fds"] > 0 for s in samples)
    # (the KV pool at least: the tiny model's pool is its largest array)
    pool_mb = sum(x.nbytes for x in jax.tree.leaves(server.engine.engine.runner.kv_pool)) / 2**20
    assert all(s["device_mb"] >= pool_mb for s in samples), (pool_mb, [s["device_mb"] for s in samples])
    assert samples[-1]["kv_usage"] == 0.0  # (after the traffic: aborted and disconnected requests freed too)
    assert server.engine.num_unfinished == 0
    # (clients that hang up mid-stream are routine: no traceback in the log for them)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    checks = verdict(samples, warmup_s=40, errors=run["errors"])  # (this process's RSS: the test's own too)
    checks.pop("latency")  # (the suite's other worker shares the two cores: latency here is its load, not ours)
    assert checks == {"errors": None, "kv_after": None, "rss_mb": None, "device_mb": None, "fds": None}
    svg_plot(samples, str(tmp_path / "soak.svg"), 40)
    assert (tmp_path / "soak.svg").read_text().startswith("<svg")
    assert 0 < run["latency_s"]["p50"] <= run["latency_s"]["p99"] and run["ttft_s"]["p50"] <= run["latency_s"]["p99"]


def test_streams_only_at_more_clients_than_sequence_slots(server):
    """(The saturation load's shape, briefly: every stream ends with [DONE], none is lost.)"""
    slots = server.engine.engine.config.scheduler_config.max_num_seqs
    run = asyncio.run(drive(server.base_url, os.getpid(), duration=4, sample_every=2, concurrency=2 * slots,
                            max_tokens=4, api_key=API_KEY, quiet=True, kinds=("stream",)))
    assert run["errors"] == 0 and run["requests"] >= 2 * slots and run["ttft_s"]["p99"] > 0
    assert server.engine.num_unfinished == 0


def flat(n=12, **over):
    return [{"t_s": 60.0 * i, "rss_mb": 1000.0, "device_mb": 500.0, "fds": 40, "kv_usage": 0.2, "p50_s": 0.1, **over} for i in range(n)]


def test_the_verdict_sees_growth():
    assert not any(verdict(flat() + [{**flat()[0], "kv_usage": 0.0}], 120, 0).values())
    growing = [{**s, "rss_mb": 1000.0 + 30 * i, "device_mb": 500.0 + 10 * i, "fds": 40 + 2 * i, "p50_s": 0.1 + 0.05 * i}
               for i, s in enumerate(flat())]
    checks = verdict(growing + [{**growing[-1], "kv_usage": 0.1}], 120, 3)
    assert all(checks[k] for k in ("errors", "kv_after", "rss_mb", "device_mb", "fds", "latency")), checks
    noisy = [{**s, "rss_mb": 1000.0 + (20 if i % 2 else -20)} for i, s in enumerate(flat())]
    assert verdict(noisy + [{**noisy[0], "kv_usage": 0.0}], 120, 0)["rss_mb"] is None
