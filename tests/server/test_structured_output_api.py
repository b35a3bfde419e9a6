"""Structured output over the OpenAI API (response_format, vLLM's structured_outputs and guided_* fields), on a
tiny random-weight model with a byte-level tokenizer: only the mask keeps its outputs inside the constraint."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import jsonschema
import openai
import pytest

from tests.server.conftest import API_KEY, serving

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "kind": {"enum": ["cat", "dog"]}},
          "required": ["id", "kind"], "additionalProperties": False}
REGEX = r"[a-z]{3}-\d{2}"


@pytest.fixture(scope="module")
def byte_server(tiny_model_dir):
    with serving(tiny_model_dir("llama-bytes")) as server:
        yield server


def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)


def test_chat_json_schema(byte_server):
    r = client(byte_server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a pet"}], max_tokens=64, temperature=1.0, seed=4,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra", [{"structured_outputs": {"regex": REGEX}}, {"guided_regex": REGEX}])
def test_streamed_n_samples_each_match(byte_server, extra):
    stream = client(byte_server).completions.create(model="tiny", prompt="id:", max_tokens=32, n=3, temperature=1.0,
                                                    seed=7, stream=True, extra_body=extra)
    texts = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert sorted(texts) == [0, 1, 2]
    assert all(re.fullmatch(REGEX, t) for t in texts.values()), texts


def test_choice_through_extra_body(byte_server):
    r = client(byte_server).completions.create(model="tiny", prompt="x", max_tokens=16, temperature=1.0, seed=1,
                                               n=4, extra_body={"structured_outputs": {"choice": ["up", "down"]}})
    assert {c.text for c in r.choices} <= {"up", "down"}


def test_bad_schema_is_a_400_naming_the_field(byte_server):
    async def go():
        body = {"model": "tiny", "prompt": "x", "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "dependentSchemas": {}}}}}
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
            async with s.post(byte_server.base_url + "/v1/completions", json=body) as r:
                return r.status, await r.json()
    status, payload = asyncio.run(go())
    assert status == 400 and payload["error"]["param"] == "response_format"
    assert "dependentSchemas" in payload["error"]["message"]


def test_a_tokenizer_the_grammar_engine_cannot_read_is_a_400(live_server):
    with pytest.raises(openai.BadRequestError, match="tokenizer"):
        client(live_server).completions.create(model="tiny", prompt="w5", max_tokens=4,
                                               extra_body={"guided_regex": "w[0-9]"})
