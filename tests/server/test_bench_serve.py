"""`jaxpaged bench serve` against a live server: every request streams to the end, percentiles, goodput and a
request-rate sweep land in the JSON."""

from __future__ import annotations

import json

import pytest

from jaxpaged.cli import build_parser
from tests.server.conftest import API_KEY


def test_bench_serve_sweep_with_goodput(live_server, tmp_path):
    out = tmp_path / "serve.json"
    ns = build_parser().parse_args([
        "bench", "serve", "--base-url", live_server.base_url, "--api-key", API_KEY, "--num-prompts", "6",
        "--input-len", "4:16", "--output-len", "5", "--vocab-size", "256", "--request-rate", "inf,40",
        "--metric-percentiles", "50,90", "--goodput", "ttft:60000", "itl:60000", "e2el:0.001", "--label", "tiny",
        "--output-json", str(out)])
    ns.func(ns)
    runs = json.loads(out.read_text())["runs"]
    assert [r["request_rate"] for r in runs] == [float("inf"), 40.0]
    for r in runs:
        assert r["successful_requests"] == 6 and r["failed_requests"] == 0 and r["label"] == "tiny"
        assert r["total_generated_tokens"] == 30
        assert r["p50_ttft_ms"] <= r["p90_ttft_ms"] and "p99_ttft_ms" not in r
        assert r["goodput_slos_ms"] == {"ttft": 60000.0, "itl": 60000.0, "e2el": 0.001}
        assert r["percent_meeting_slos"] == 0.0  # no request ends within 1 us
    ns = build_parser().parse_args(["bench", "serve", "--base-url", live_server.base_url, "--api-key", API_KEY,
                                    "--num-prompts", "2", "--input-len", "4", "--output-len", "3", "--vocab-size",
                                    "256", "--goodput", "ttft:60000", "--output-json", str(out)])
    ns.func(ns)
    single = json.loads(out.read_text())
    assert single["percent_meeting_slos"] == 100.0 and single["request_goodput"] > 0


def test_long_prompts_are_spread_through_the_workload():
    from jaxpaged.bench.serve import load_prompts

    ns = build_parser().parse_args(["bench", "serve", "--num-prompts", "12", "--input-len", "4:16", "--output-len",
                                    "5", "--vocab-size", "256", "--long-prompts", "3:100"])
    lengths = [len(p) for p, _ in load_prompts(ns)]
    assert [i for i, n in enumerate(lengths) if n == 100] == [2, 6, 10]
    assert all(4 <= n <= 16 for i, n in enumerate(lengths) if i not in (2, 6, 10))
    ns.long_prompts = "3:x"
    with pytest.raises(SystemExit, match="--long-prompts"):
        load_prompts(ns)
