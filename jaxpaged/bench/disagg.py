"""`jaxpaged bench serve --disagg`: the same streamed workload against one engine on every core, then against a
prefill/decode split (a producer and a consumer, each pinned to half of the cores, behind `jaxpaged serve-disagg`),
side by side in one table and one JSON.

    jaxpaged bench serve --disagg --serve-model DIR --num-prompts 32 --input-len 64:256 --output-len 64 \\
        --long-prompts 8:2048 --request-rate 1 --seed 1

The servers are started here (`jaxpaged serve`, logs under the output folder) and stopped after their run; the
KV blocks move through a folder on /dev/shm where there is one. `--serve-args` adds flags to every instance.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

START_TIMEOUT = 900.0


def free_port() -> int:
    """A loopback port free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: str, timeout: float = START_TIMEOUT) -> None:
    """Wait until the server at `url` answers `/v1/models`; raise with its log's tail if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"the server behind {url} exited ({proc.returncode}); its log ends:\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s (log: {log})")


@contextlib.contextmanager
def server_process(cmd: list[str], log: str, cpus: set[int] | None = None):
    """A child process (pinned to `cpus`), sent SIGTERM and waited for on exit."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _serve_cmd(ns, port: int, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "jaxpaged.cli", "serve", "--port", str(port), "--shutdown-timeout", "5"]
    if ns.serve_model:
        cmd += ["--model", ns.serve_model]
    return cmd + shlex.split(ns.serve_args or "") + list(extra)


def _bench(ns, url: str, label: str) -> dict:
    from jaxpaged.bench import serve

    run_ns = copy.copy(ns)
    run_ns.base_url, run_ns.label, run_ns.output_json, run_ns.disagg = url, label, None, False
    run_ns.model = None
    print(f"--- {label} ---", flush=True)
    return serve.main(run_ns)


def main(ns) -> dict:
    """Run the workload on one engine, then on the split; print both side by side and write the JSON."""
    from jaxpaged.bench.serve import parse_long_prompts

    if "," in str(ns.request_rate):
        raise SystemExit("--disagg runs one request rate")
    if ns.long_prompts:
        parse_long_prompts(ns.long_prompts)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--disagg needs at least 2 CPU cores (one for each instance)")
    half = len(cpus) // 2
    prefill_cpus, decode_cpus = set(cpus[:half]), set(cpus[half:])
    out_dir = os.path.dirname(ns.output_json or "bench_results/x") or "."
    os.makedirs(out_dir, exist_ok=True)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    results = {}

    port = free_port()
    log = os.path.join(out_dir, "disagg_single.log")
    with server_process(_serve_cmd(ns, port), log) as proc:
        wait_healthy(f"http://127.0.0.1:{port}", proc, log)
        results["one engine"] = _bench(ns, f"http://127.0.0.1:{port}", f"one engine, {len(cpus)} cores")

    with tempfile.TemporaryDirectory(prefix="jaxpaged-kv-", dir=shm) as folder:
        p_port, d_port, x_port = free_port(), free_port(), free_port()
        logs = [os.path.join(out_dir, f"disagg_{n}.log") for n in ("prefill", "decode", "proxy")]
        kv = ["--kv-offload-dir", folder]
        with server_process(_serve_cmd(ns, p_port, "--kv-role", "producer", *kv), logs[0], prefill_cpus) as prefill, \
                server_process(_serve_cmd(ns, d_port, "--kv-role", "consumer", *kv), logs[1], decode_cpus) as decode:
            wait_healthy(f"http://127.0.0.1:{p_port}", prefill, logs[0])
            wait_healthy(f"http://127.0.0.1:{d_port}", decode, logs[1])
            proxy_cmd = [sys.executable, "-m", "jaxpaged.cli", "serve-disagg", "--port", str(x_port),
                         "--prefill", f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}"]
            with server_process(proxy_cmd, logs[2]) as proxy:
                wait_healthy(f"http://127.0.0.1:{x_port}", proxy, logs[2], timeout=60)
                results["prefill/decode split"] = _bench(
                    ns, f"http://127.0.0.1:{x_port}",
                    f"prefill on cores {sorted(prefill_cpus)}, decode on cores {sorted(decode_cpus)}")

    print_side_by_side(results)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"runs": results, "args": {k: v for k, v in vars(ns).items() if k != "func"}}, f, indent=2,
                      default=str)
        print(f"wrote {ns.output_json}")
    return results


def print_side_by_side(results: dict[str, dict]) -> None:
    """One line per setup: wall, throughput, TTFT and ITL percentiles."""
    print(f"{'setup':<22} {'done':>5} {'wall s':>7} {'out tok/s':>9} {'TTFT p50/p99 ms':>18} {'ITL p50/p99 ms':>18}")
    for name, s in results.items():
        print(f"{name:<22} {s['successful_requests']:>5} {s['duration_s']:>7.1f} {s['output_token_throughput']:>9.1f} "
              f"{s['median_ttft_ms']:>8.0f} /{s.get('p99_ttft_ms', float('nan')):>8.0f} "
              f"{s['median_itl_ms']:>8.0f} /{s.get('p99_itl_ms', float('nan')):>8.0f}")
