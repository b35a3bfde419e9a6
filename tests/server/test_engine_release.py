"""A stopped server frees its engine's device state at once, though the stopped app is still referenced (aiohttp
caches each app's middleware chain for the life of the process): its KV pool is deleted and its compiled steps'
code unmapped. Every compiled executable holds mappings of JIT code, and a process may have at most
vm.max_map_count (65,530 by default) of them: the test suite, serving a few dozen engines in one process, ran
past that once, and LLVM crashed inside XLA's compile."""

import gc
import json
import sys
import urllib.request

import pytest

from tests.server.conftest import API_KEY, serving

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/maps")


def mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_a_stopped_server_frees_its_engine(tiny_model_dir):
    gc.collect()
    before = mappings()
    with serving(tiny_model_dir("llama")) as server:
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4}).encode()
        req = urllib.request.Request(server.base_url + "/v1/completions", data=body, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert len(json.load(r)["choices"][0]["text"]) > 0
        runner = server.engine.engine.core.runner
        pool = runner.kv_pool
        running = mappings()
    gc.collect()
    assert pool.is_deleted() and not runner._compiled
    assert running - before > 500  # (the engine's compiled code: ~2,000 mappings for the tiny model)
    assert mappings() - before < (running - before) / 4, "the stopped engine's compiled code is still mapped"
    with pytest.raises(RuntimeError, match="shut down"):
        runner.run_step(runner.buckets[0], None, None, None)
