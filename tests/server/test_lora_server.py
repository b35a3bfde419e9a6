"""LoRA adapters over HTTP (vLLM's): --lora-modules served by name through the request's model field, listed by
/v1/models, loaded and unloaded at run time behind --allow-runtime-lora-updating, and 4xx for the rest."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from jaxpaged import LoRARequest, SamplingParams
from server.lora_modules import parse_lora_modules
from tests.lora.conftest import lora_setup  # noqa: F401 (the tiny model and its adapters)
from tests.server.conftest import API_KEY, post, serving


def call(server, method: str, path: str, body: dict | None = None) -> tuple[int, str]:
    async def go():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
            async with s.request(method, server.base_url + path, json=body) as r:
                return r.status, await r.text()
    return asyncio.run(go())


@pytest.fixture(scope="module")
def lora_server(lora_setup):
    base, adapters = lora_setup
    with serving(base, enable_lora=True, max_loras=2, max_lora_rank=8,
                 app_kw={"lora_modules": [("a1", adapters["a1"], None)], "allow_runtime_lora": True}) as server:
        yield server, adapters


def completion(server, model: str, prompt: list[int]) -> list:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_tokens_as_token_ids": True, "logprobs": 0}
    out = post(server, "/v1/completions", body)
    return out["choices"][0]["logprobs"]["tokens"]


def offline(server, prompt, lora):
    async def go():
        final = None
        async for out in server.engine.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                                lora_request=lora):
            final = out
        return final.outputs[0].token_ids
    return asyncio.run_coroutine_threadsafe(go(), server.loop).result(60)


def test_model_field_picks_the_adapter(lora_server):
    server, adapters = lora_server
    prompt = [5, 17, 33, 8, 91, 4, 12]
    with_a1, base = completion(server, "a1", prompt), completion(server, "tiny", prompt)
    assert with_a1 != base
    a1 = next(iter(server.engine.engine.loras._adapters.values()))
    assert [f"token_id:{t}" for t in offline(server, prompt, LoRARequest("a1", a1.lora_id, a1.path))] == with_a1
    models = post_get(server, "/v1/models")
    assert [m["id"] for m in models["data"]] == ["tiny", "a1"]
    assert models["data"][1]["parent"] == "tiny" and models["data"][1]["root"] == adapters["a1"]
    err = post(server, "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "w1"}]},
               status=404)
    assert err["error"]["param"] == "model"


def post_get(server, path):
    import json

    status, text = call(server, "GET", path)
    assert status == 200, text
    return json.loads(text)


def test_runtime_load_and_unload(lora_server):
    server, adapters = lora_server
    status, text = call(server, "POST", "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": adapters["a2"]})
    assert status == 200 and "a2" in text, text
    prompt = [9, 9, 41, 7]
    assert completion(server, "a2", prompt) != completion(server, "tiny", prompt)
    assert call(server, "POST", "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": adapters["a2"]})[0] == 400
    status, text = call(server, "POST", "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "/nowhere"})
    assert status == 400 and "is not a folder" in text
    assert call(server, "POST", "/v1/load_lora_adapter", {"lora_name": "x"})[0] == 400
    assert call(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "a2"})[0] == 200
    assert call(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "a2"})[0] == 404
    assert post(server, "/v1/completions", {"model": "a2", "prompt": "w1", "max_tokens": 2}, status=404)
    assert [m["id"] for m in post_get(server, "/v1/models")["data"]] == ["tiny", "a1"]


def test_runtime_updates_are_off_by_default_and_flags_parse(lora_setup):
    base, adapters = lora_setup
    with serving(base, enable_lora=True, max_lora_rank=8) as server:
        status, text = call(server, "POST", "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": adapters["a2"]})
        assert status == 403 and "--allow-runtime-lora-updating" in text
    assert parse_lora_modules(["x=/p", '{"name": "y", "path": "/q", "base_model_name": "b"}']) == [
        ("x", "/p", None), ("y", "/q", "b")]
    for bad in (["x"], ["=p"], ["x=/p", "x=/q"], ['{"name": "y"}']):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules(bad)
