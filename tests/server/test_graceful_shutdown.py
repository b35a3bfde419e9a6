"""`jaxpaged serve` as a process: SIGTERM lets a running stream finish, then the process exits."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def test_sigterm_drains_running_stream(tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAXPAGED_COMPILATION_CACHE": "off"}
    proc = subprocess.Popen([sys.executable, "-m", "jaxpaged", "serve", "--model", tiny_model_dir("llama"),
                             "--port", str(port), "--num-kv-blocks", "64", "--max-model-len", "256",
                             "--max-num-batched-tokens", "64"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        body = json.dumps({"prompt": "w5 w6", "max_tokens": 40, "stream": True, "ignore_eos": True}).encode()
        req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            first = r.readline()
            assert first.startswith(b"data: ")
            proc.send_signal(signal.SIGTERM)
            rest = r.read().decode()
        assert rest.rstrip().endswith("data: [DONE]")
        assert '"finish_reason": "length"' in rest
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
