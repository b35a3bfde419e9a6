"""`jaxpaged bench throughput --profile-dir` traces the timed run, and `trace_summary` reduces a trace to the
few lines worth bringing back from a GPU machine."""

import gzip
import json

from jaxpaged.bench.trace_summary import newest_trace, summarize
from jaxpaged.cli import build_parser


def test_summary_sums_each_lane_and_counts_nested_time_once(tmp_path):
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "tid": 7, "ts": 0, "dur": 10, "name": "fusion.1"},
        {"ph": "X", "pid": 1, "tid": 7, "ts": 20, "dur": 5, "name": "ragged_paged_attention_m16_kv8"},
        {"ph": "X", "pid": 1, "tid": 7, "ts": 30, "dur": 10, "name": "fusion.1"},
        {"ph": "X", "pid": 2, "tid": 3, "ts": 0, "dur": 100, "name": "$llm.py:66 generate"},
        {"ph": "X", "pid": 2, "tid": 3, "ts": 10, "dur": 50, "name": "$core.py:1 step"},  # inside generate
    ]
    (tmp_path / "plugins" / "profile" / "run").mkdir(parents=True)
    path = tmp_path / "plugins" / "profile" / "run" / "vm.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert newest_trace(str(tmp_path)) == str(path)
    gpu, host = (summarize(str(path))["lanes"][k] for k in ("/device:GPU:0", "/host:CPU"))
    assert gpu["top"][0] == ["fusion.1", 20.0, 2] and gpu["busy_us"] == 25.0 and gpu["span_us"] == 40.0
    assert host["busy_us"] == 100.0 and host["top"][1] == ["$core.py:1 step", 50.0, 1]


def test_throughput_bench_writes_a_trace_of_its_timed_run(tiny_model_dir, tmp_path):
    out, trace = tmp_path / "run.json", tmp_path / "profile"
    ns = build_parser().parse_args(["bench", "throughput", "--model", tiny_model_dir("llama"), "--load-format", "dummy",
                                    "--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--temperature",
                                    "0", "--num-kv-blocks", "64", "--profile-dir", str(trace),
                                    "--output-json", str(out)])
    ns.func(ns)
    assert json.loads(out.read_text())[0]["output_tokens"] == 16
    lanes = summarize(newest_trace(str(trace)))["lanes"]
    host = next(v for k, v in lanes.items() if k.startswith("/host"))
    assert any("generate" in name for name, _, _ in host["top"])


def test_throughput_bench_times_no_step_still_loading(tiny_model_dir, tmp_path, monkeypatch):
    """Steps found in the step cache load in the background after warmup; the bench waits for them before its
    timed run (else a warm start timed their compiles too: 0.3-0.5 s against 0.03 s on a tiny model)."""
    from jaxpaged import LLM
    from jaxpaged.runner.model_runner import ModelRunner

    events = []
    wait, generate = ModelRunner.wait_for_steps, LLM.generate
    monkeypatch.setattr(ModelRunner, "wait_for_steps", lambda self: (events.append("wait"), wait(self))[1])
    monkeypatch.setattr(LLM, "generate", lambda self, *a, **k: (events.append("generate"), generate(self, *a, **k))[1])
    ns = build_parser().parse_args(["bench", "throughput", "--model", tiny_model_dir("llama"), "--load-format", "dummy",
                                    "--num-prompts", "2", "--input-len", "8", "--output-len", "2", "--temperature",
                                    "0", "--num-kv-blocks", "64", "--max-num-seqs", "2", "--max-num-batched-tokens",
                                    "16", "--output-json", str(tmp_path / "run.json")])
    ns.func(ns)
    assert "wait" in events[:events.index("generate")]
