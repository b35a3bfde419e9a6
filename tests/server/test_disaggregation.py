"""Prefill/decode disaggregation behind `jaxpaged serve-disagg` (server/disagg_proxy.py): a producer and a
consumer server sharing a KV folder, the proxy in front; greedy outputs equal one server's (completions and chat,
streamed and not, a prompt longer than a step's chunk, n>1), the consumer loads the prompt blocks instead of
computing them, a dead prefill instance is skipped or answered with a 502, and mismatched instances are refused
before serving."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import threading

import aiohttp
import numpy as np
import pytest
import requests
from aiohttp import web

from jaxpaged.bench.disagg import free_port, server_process, wait_healthy
from server.disagg_proxy import DisaggProxy, create_proxy_app, prefill_body, uses_prefix_cache
from server.state import STATE
from tests.server.conftest import API_KEY, serving

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = np.random.default_rng(7).integers(3, 250, size=170).tolist()  # > max_num_batched_tokens (128): chunked


class AppThread:
    """An aiohttp app on a loopback port, in a background thread."""

    def __init__(self, app: web.Application):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run():
            asyncio.set_event_loop(self.loop)
            self.runner = web.AppRunner(app, handler_cancellation=True)
            self.loop.run_until_complete(self.runner.setup())
            self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait(30)

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def stop(self):
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@contextlib.contextmanager
def proxied(prefill: list[str], decode: list[str], check: bool = True):
    """(a DisaggProxy over these instances, its server), `check`ed first, stopped on exit."""
    proxy = DisaggProxy(prefill, decode)
    front = AppThread(create_proxy_app(proxy))
    try:
        if check:
            front.call(proxy.check())
        yield proxy, front
    finally:
        front.stop()


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    """(plain server, producer, consumer, proxy over them); the consumer shares the producer's folder."""
    path, folder = tiny_model_dir("llama"), str(tmp_path_factory.mktemp("kv"))
    with serving(path) as plain, serving(path, kv_role="producer", kv_offload_dir=folder) as producer, \
            serving(path, kv_role="consumer", kv_offload_dir=folder) as consumer, \
            proxied([producer.base_url], [consumer.base_url]) as (_, front):
        yield plain, producer, consumer, front


@pytest.fixture(scope="module")
def remote(cluster, tiny_model_dir, tmp_path_factory):
    """A consumer with a folder of its own (as on another host) and a proxy in front of it and the producer."""
    folder = tmp_path_factory.mktemp("remote-kv")
    with serving(tiny_model_dir("llama"), kv_role="consumer", kv_offload_dir=str(folder),
                 kv_pull_from=[cluster[1].base_url]) as server, \
            proxied([cluster[1].base_url], [server.base_url]) as (proxy, front):
        yield server, folder, proxy, front


def post(base_url: str, route: str, body: dict) -> requests.Response:
    return requests.post(f"{base_url}/v1/{route}", json=body, headers=HEADERS, timeout=120)


def streamed_text(resp: requests.Response) -> list[str]:
    """Each choice's text from an SSE stream (choices in index order)."""
    texts: dict[int, str] = {}
    for line in resp.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            for c in json.loads(line[6:])["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + (c.get("text") or c.get("delta", {}).get("content")
                                                                 or "")
    return [texts[i] for i in sorted(texts)]


def texts(resp: requests.Response) -> list[str]:
    assert resp.status_code == 200, resp.text
    return [c.get("text", c.get("message", {}).get("content")) for c in resp.json()["choices"]]


def kv_stats(server) -> dict:
    return server.engine.engine.core.offload.stats()


def free_blocks_all(server) -> bool:
    kv = server.engine.engine.core.kv_cache_manager
    return kv.num_free_blocks == kv.pool.num_blocks - 1


COMPLETION = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, ignore_eos=True)
CHAT = dict(model="tiny", messages=[{"role": "user", "content": "tell me about paged attention " * 24}],
            max_tokens=10, temperature=0, ignore_eos=True)
SAMPLED = dict(model="tiny", prompt=np.random.default_rng(8).integers(3, 250, size=90).tolist(), max_tokens=6,
               temperature=0.9, seed=11, n=3, ignore_eos=True)


@pytest.mark.parametrize("route, body", [("completions", COMPLETION), ("chat/completions", CHAT),
                                         ("completions", SAMPLED)], ids=["completion", "chat", "n3-seeded"])
def test_same_outputs_as_one_server_with_blocks_moved(cluster, route, body):
    plain, producer, consumer, front = cluster
    expected = texts(post(plain.base_url, route, body))
    hits = kv_stats(consumer)["disk_hit_blocks"]
    resp = post(front.base_url, route, body)
    assert texts(resp) == expected
    prompt_tokens = resp.json()["usage"]["prompt_tokens"]
    assert prompt_tokens > 64  # (several blocks)
    # every full block of the prompt came from the producer (only the block holding its last token is computed)
    assert kv_stats(consumer)["disk_hit_blocks"] - hits == (prompt_tokens - 1) // 16
    with requests.post(f"{front.base_url}/v1/{route}", json={**body, "stream": True}, headers=HEADERS,
                       stream=True, timeout=120) as resp:
        assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        assert streamed_text(resp) == expected
    assert free_blocks_all(producer) and free_blocks_all(consumer)


def test_bad_input_is_refused_by_the_prefill_instance(cluster):
    _, producer, consumer, front = cluster
    before = consumer.engine.engine.stats.num_prompt_tokens
    resp = post(front.base_url, "completions", {**COMPLETION, "temperature": -1})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "temperature"
    resp = requests.post(f"{front.base_url}/v1/completions", data=b"{not json", headers=HEADERS, timeout=30)
    assert resp.status_code == 400 and "error" in resp.json()
    assert consumer.engine.engine.stats.num_prompt_tokens == before


def test_a_dead_prefill_instance_is_skipped_or_a_502(cluster):
    plain, producer, consumer, _ = cluster
    dead = f"http://127.0.0.1:{free_port()}"
    with proxied([dead, producer.base_url], [consumer.base_url], check=False) as (proxy, front):
        assert texts(post(front.base_url, "completions", COMPLETION)) == texts(post(plain.base_url, "completions",
                                                                                    COMPLETION))
        assert proxy.num_prefill_failures == 1
    with proxied([dead], [consumer.base_url], check=False) as (_, front):
        resp = post(front.base_url, "completions", COMPLETION)
        assert resp.status_code == 502 and "no prefill instance" in resp.json()["error"]["message"]
    with proxied([producer.base_url], [dead], check=False) as (_, front):
        resp = post(front.base_url, "completions", COMPLETION)
        assert resp.status_code == 502 and "no decode instance" in resp.json()["error"]["message"]
    assert free_blocks_all(producer) and free_blocks_all(consumer)


def fake_instance(info: dict) -> AppThread:
    """A server answering /kv_transfer with `info`, and every block with garbage."""
    async def kv_transfer(request):
        return web.json_response(info)

    async def block(request):
        return web.Response(body=b"not a block")

    app = web.Application()
    app.router.add_get("/kv_transfer", kv_transfer)
    app.router.add_get("/v1/kv_blocks/{hash}", block)
    return AppThread(app)


def test_a_consumer_on_another_host_pulls_the_blocks_over_http(cluster, remote):
    plain, producer, _, _ = cluster
    server, folder, proxy, front = remote
    assert not proxy._shares_folder(producer.base_url, server.base_url)  # (each folder has its own id)
    body = {**COMPLETION, "prompt": np.random.default_rng(9).integers(3, 250, size=120).tolist()}
    expected = texts(post(plain.base_url, "completions", body))
    resp = post(front.base_url, "completions", body)
    assert texts(resp) == expected
    moved = (resp.json()["usage"]["prompt_tokens"] - 1) // 16
    assert kv_stats(server)["disk_hit_blocks"] == moved == len(list(folder.rglob("*.kvblock")))
    with requests.post(f"{front.base_url}/v1/chat/completions", json={**CHAT, "stream": True}, headers=HEADERS,
                       stream=True, timeout=120) as resp:
        assert streamed_text(resp) == texts(post(plain.base_url, "chat/completions", CHAT))
    assert kv_stats(server)["disk_hit_blocks"] > moved
    assert free_blocks_all(producer) and free_blocks_all(server)


def test_a_bad_block_from_the_source_is_refused_and_computed(cluster, remote, caplog):
    plain = cluster[0]
    server, folder, _, _ = remote
    fake = fake_instance({})
    trusted = server.runner.app[STATE].kv_pull_from
    trusted.append(fake.base_url)
    body = {**COMPLETION, "prompt": np.random.default_rng(10).integers(3, 250, size=40).tolist()}
    try:
        files = len(list(folder.rglob("*.kvblock")))
        with caplog.at_level(logging.WARNING):
            resp = post(server.base_url, "completions", {**body, "kv_transfer_params": {"source": fake.base_url}})
        assert texts(resp) == texts(post(plain.base_url, "completions", body))
        assert caplog.text.count("refusing a received block") == 2  # (both full blocks pulled, and refused)
        assert len(list(folder.rglob("*.kvblock"))) == files
    finally:
        trusted.remove(fake.base_url)
        fake.stop()


def dying_instance(source: str) -> AppThread:
    """A prefill instance that dies in the middle of every block it sends: it announces the whole block (the real
    one, fetched from `source`), sends half, and drops the connection, as a killed process's socket does."""
    async def block(request):
        async with aiohttp.ClientSession(headers=HEADERS) as s:
            async with s.get(f"{source}/v1/kv_blocks/{request.match_info['hash']}") as r:
                data = await r.read()
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/octet-stream"})
        resp.content_length = len(data)
        await resp.prepare(request)
        await resp.write(data[: len(data) // 2])
        request.transport.abort()  # (no FIN after a whole body: a reset mid-body)
        return resp

    app = web.Application()
    app.router.add_get("/v1/kv_blocks/{hash}", block)
    return AppThread(app)


def test_a_prefill_peer_dying_mid_transfer_leaves_the_request_computed(cluster, remote, caplog):
    """The pull fails for each block (logged), nothing half-received is adopted, the decode instance computes the
    prompt itself and answers as one server does, frees every block, and serves the next request."""
    plain, producer = cluster[0], cluster[1]
    server, folder, _, _ = remote
    body = {**COMPLETION, "prompt": np.random.default_rng(12).integers(3, 250, size=70).tolist()}
    assert texts(post(producer.base_url, "completions", {**body, "max_tokens": 1}))  # (the peer has the blocks)
    dying = dying_instance(producer.base_url)
    trusted = server.runner.app[STATE].kv_pull_from
    trusted.append(dying.base_url)
    try:
        files = len(list(folder.rglob("*.kvblock")))
        with caplog.at_level(logging.WARNING):
            resp = post(server.base_url, "completions", {**body, "kv_transfer_params": {"source": dying.base_url}})
        assert texts(resp) == texts(post(plain.base_url, "completions", body))
        assert caplog.text.count("KV pull: block") == (len(body["prompt"]) - 1) // 16 == 4
        assert len(list(folder.rglob("*.kvblock"))) == files and not list(folder.rglob("*.tmp"))
        assert free_blocks_all(server)
        assert texts(post(server.base_url, "completions", COMPLETION))  # (and it keeps serving)
    finally:
        trusted.remove(dying.base_url)
        dying.stop()


def test_kv_transfer_params_only_from_trusted_sources_and_only_on_consumers(cluster, remote):
    plain, producer = cluster[0], cluster[1]
    server = remote[0]
    body = {**COMPLETION, "prompt": [5, 6, 7]}
    for source in ("http://127.0.0.1:9", 3):  # (a source it was not told to trust; not a URL)
        resp = post(server.base_url, "completions", {**body, "kv_transfer_params": {"source": source}})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "kv_transfer_params"
    for other in (producer, plain):  # (not consumers: the field is ignored, as vLLM does)
        resp = post(other.base_url, "completions", {**body, "kv_transfer_params": {"source": "http://x:1"}})
        assert resp.status_code == 200
    assert requests.get(f"{plain.base_url}/v1/kv_blocks/{0:016x}", headers=HEADERS, timeout=10).status_code == 404
    assert requests.get(f"{plain.base_url}/kv_transfer", timeout=10).json() == {"kv_role": None}


def test_mismatched_instances_are_refused_at_start(cluster):
    plain, producer, consumer, _ = cluster
    info = requests.get(f"{producer.base_url}/kv_transfer", timeout=10).json()
    assert info["kv_role"] == "producer" and info["identity"]

    def check(prefill: list[str], decode: list[str]):
        proxy = DisaggProxy(prefill, decode)
        runner = AppThread(web.Application())  # (a loop to run the check on)
        try:
            runner.call(proxy.start())
            return runner.call(proxy.check())
        finally:
            runner.call(proxy.close())
            runner.stop()

    assert check([producer.base_url], [consumer.base_url])["kv_folder_id"] == info["kv_folder_id"]
    with pytest.raises(ValueError, match="kv_role='consumer'"):
        check([consumer.base_url], [consumer.base_url])
    with pytest.raises(ValueError, match="kv_role=None"):
        check([producer.base_url], [plain.base_url])
    other = fake_instance({**info, "kv_role": "consumer", "identity": "another model"})
    try:
        with pytest.raises(ValueError, match="identity"):
            check([producer.base_url], [other.base_url])
    finally:
        other.stop()


def test_prefill_request_is_one_token_of_the_same_prompt():
    body = {**SAMPLED, "prompt": [1, 2], "stream": True, "stream_options": {"include_usage": True},
            "max_completion_tokens": 99, "logprobs": 2, "stop": ["x"]}
    assert prefill_body(body) == {"model": "tiny", "prompt": [1, 2], "max_tokens": 1, "temperature": 0.9,
                                  "ignore_eos": True}
    assert uses_prefix_cache(COMPLETION) and not uses_prefix_cache({**COMPLETION, "presence_penalty": 0.5})
    assert not uses_prefix_cache({**COMPLETION, "prompt_logprobs": 1})
    assert not uses_prefix_cache({**COMPLETION, "echo": True, "logprobs": 1})


def test_server_processes_behind_the_cli_proxy(cluster, tiny_model_dir, tmp_path):
    """The commands themselves: `jaxpaged serve --kv-role ...` twice and `jaxpaged serve-disagg`, as processes."""
    plain = cluster[0]
    serve = [sys.executable, "-m", "jaxpaged.cli", "serve", "--model", tiny_model_dir("llama"), "--num-kv-blocks",
             "256", "--max-model-len", "256", "--max-num-batched-tokens", "128", "--kv-offload-dir",
             str(tmp_path / "kv"), "--kv-offload-disk-gb", "0.1", "--served-model-name", "tiny"]
    urls = {role: (f"http://127.0.0.1:{(port := free_port())}", port) for role in ("producer", "consumer", "proxy")}
    logs = {role: str(tmp_path / f"{role}.log") for role in urls}
    def serve_as(name: str) -> list[str]:
        return serve + ["--port", str(urls[name][1]), "--kv-role", name]

    with server_process(serve_as("producer"), logs["producer"]) as p, \
            server_process(serve_as("consumer"), logs["consumer"]) as d:
        wait_healthy(urls["producer"][0], p, logs["producer"], timeout=300)
        wait_healthy(urls["consumer"][0], d, logs["consumer"], timeout=300)
        proxy_cmd = [sys.executable, "-m", "jaxpaged.cli", "serve-disagg", "--port", str(urls["proxy"][1]),
                     "--prefill", urls["producer"][0], "--decode", urls["consumer"][0]]
        with server_process(proxy_cmd, logs["proxy"]) as x:
            wait_healthy(urls["proxy"][0], x, logs["proxy"], timeout=60)
            body = {**COMPLETION, "prompt": np.random.default_rng(12).integers(3, 250, size=100).tolist()}
            assert texts(post(urls["proxy"][0], "completions", body)) == texts(post(plain.base_url, "completions",
                                                                                    body))
            metrics = requests.get(f"{urls['consumer'][0]}/metrics", timeout=10).text
            assert 'jaxpaged:kv_offload_hits_total{tier="disk"} 6.0' in metrics  # ((100 - 1) // 16 blocks)
