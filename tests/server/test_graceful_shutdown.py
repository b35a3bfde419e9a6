"""`jaxpaged serve` as a process: on SIGTERM it refuses new connections at once, lets running streams finish
within --shutdown-timeout, cuts the ones still running at the timeout, and exits 0."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request


def start_server(model: str, port: int, timeout: float) -> subprocess.Popen:
    env = {**os.environ, "JAXPAGED_COMPILATION_CACHE": "off"}
    return subprocess.Popen([sys.executable, "-m", "jaxpaged", "serve", "--model", model, "--port", str(port),
                             "--num-kv-blocks", "1100", "--max-model-len", "8192", "--max-num-batched-tokens", "64",
                             "--shutdown-timeout", str(timeout)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def stream(base: str, max_tokens: int, out: dict, started: threading.Event) -> None:
    """Read a streamed completion into out['body'] (what arrived before the stream ended or was cut)."""
    body = json.dumps({"prompt": "w5 w6", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    chunks = []
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            chunks.append(r.readline())
            started.set()
            while line := r.readline():
                chunks.append(line)
    except Exception as e:  # noqa: BLE001 - a cut stream may end in a reset; what arrived is what counts
        out["error"] = repr(e)
    out["body"] = b"".join(chunks).decode()
    started.set()


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except ConnectionRefusedError:
        return True


def test_sigterm_refuses_new_connections_drains_short_streams_and_cuts_long_ones(tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_server(tiny_model_dir("llama-long"), port, timeout=3.0)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        short, long_ = {}, {}
        events = [threading.Event(), threading.Event()]
        threads = [threading.Thread(target=stream, args=(base, 40, short, events[0])),
                   threading.Thread(target=stream, args=(base, 8000, long_, events[1]))]  # outlasts the timeout
        for t in threads:
            t.start()
        for e in events:
            assert e.wait(60)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        deadline = signalled + 2.0
        while not refused(port) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert refused(port), "still accepting connections after SIGTERM"
        for t in threads:
            t.join(30)
        assert proc.wait(timeout=30) == 0
        exited = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    assert short["body"].rstrip().endswith("data: [DONE]") and '"finish_reason": "length"' in short["body"]
    assert "data: [DONE]" not in long_["body"], "the long stream was not cut"
    assert 2.5 < exited < 15, f"exited {exited:.1f} s after SIGTERM with a 3 s shutdown timeout"
