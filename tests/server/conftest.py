"""A real server on a loopback port, backed by a tiny model, in a background thread."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading

import aiohttp
import pytest
from aiohttp import web

from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.async_llm import AsyncLLM
from server.app import create_app

API_KEY = "test-key"
ENGINE_ARGS = dict(num_kv_blocks=256, max_model_len=256, max_num_batched_tokens=128, compile_guard=True)


class LiveServer:
    def __init__(self, engine: AsyncLLM, api_key: str | None, tenants=None, kv_pull_from=None, chat=None,
                 app_kw: dict | None = None):
        self.engine = engine
        self.app_kw = app_kw or {}  # more of create_app's options (LoRA modules)
        self.chat = chat
        self.tenants = tenants
        self.kv_pull_from = kv_pull_from
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(api_key,), daemon=True)
        self._thread.start()
        self._ready.wait(30)

    def _run(self, api_key):
        asyncio.set_event_loop(self.loop)
        app = create_app(self.engine, model_name="tiny", api_key=api_key, tenants=self.tenants,
                         kv_pull_from=self.kv_pull_from, chat=self.chat, **self.app_kw)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self.loop.run_forever()

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.engine.shutdown()


def post(server, path: str, body: dict, status: int = 200):
    """The JSON answer, or for a stream the list of chunk payloads before [DONE]."""
    async def go():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
            async with s.post(server.base_url + path, json=body) as r:
                raw = (await r.read()).decode()
                assert r.status == status, raw
        if not body.get("stream") or status != 200:
            return json.loads(raw)
        events = [e[6:] for e in raw.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]
    return asyncio.run(go())


@contextlib.contextmanager
def serving(model_dir: str, tenants=None, kv_pull_from=None, chat=None, app_kw: dict | None = None, **engine_args):
    """A LiveServer over the model at `model_dir` (ENGINE_ARGS, updated by `engine_args`; API_KEY; `tenants`;
    the prefill instances it may pull KV blocks from; the tool and reasoning flags, a ChatOptions; app_kw: more
    `create_app` options), stopped on exit."""
    args = EngineArgs(model=model_dir, **{**ENGINE_ARGS, **engine_args})
    server = LiveServer(AsyncLLM.from_engine_args(args), API_KEY, tenants, kv_pull_from, chat, app_kw)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def live_server(tiny_model_dir):
    with serving(tiny_model_dir("llama")) as server:
        yield server
