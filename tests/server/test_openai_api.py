"""The OpenAI-compatible server, driven by the official `openai` client and raw aiohttp."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest

from jaxpaged import LLM, SamplingParams
from tests.server.conftest import API_KEY, ENGINE_ARGS

PROMPT = "w5 w6 w7 w8 w9"


def client(server, **kw):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, **kw)


def test_models_health_metrics(live_server):
    models = client(live_server).models.list()
    assert [m.id for m in models.data] == ["tiny"]

    async def raw():
        async with aiohttp.ClientSession() as s:
            async with s.get(live_server.base_url + "/health") as r:
                assert r.status == 200
            async with s.get(live_server.base_url + "/metrics") as r:
                return await r.text()
    text = asyncio.run(raw())
    for name in ("jaxpaged:num_requests_running", "jaxpaged:kv_cache_usage_perc", "jaxpaged:prompt_tokens_total",
                 "jaxpaged:time_to_first_token_seconds_bucket", "jaxpaged:request_success_total"):
        assert name in text


def test_completion_and_chat(live_server):
    c = client(live_server)
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == 5
    r2 = c.completions.create(model="tiny", prompt=[PROMPT, [5, 6, 7]], max_tokens=4, temperature=0, n=2,
                              extra_body={"ignore_eos": True})
    assert len(r2.choices) == 4
    assert r2.choices[0].text == r2.choices[1].text == r.choices[0].text[: len(r2.choices[0].text)]
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=6,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6


def test_streaming_matches_non_streaming(live_server):
    c = client(live_server)
    kw = dict(model="tiny", max_tokens=10, temperature=0.9, seed=11, extra_body={"ignore_eos": True})
    full = c.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], **kw)
    chunks = list(c.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], stream=True,
                                            stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


def test_stop_string(live_server):
    c = client(live_server)
    base = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    words = base.split()
    stop = words[2]
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                             extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[: base.index(stop)]


def test_sse_framing_raw(live_server):
    async def go():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "stream": True, "temperature": 0,
                    "ignore_eos": True}
            async with s.post(live_server.base_url + "/v1/completions", json=body) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                raw = (await r.read()).decode()
        events = [e for e in raw.split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events)
        assert events[-1] == "data: [DONE]"
        return [json.loads(e[6:]) for e in events[:-1]]
    payloads = asyncio.run(go())
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


BAD = [
    ("/v1/chat/completions", b"{not json", 400),
    ("/v1/chat/completions", b"\xff\xfe\x00", 400),
    ("/v1/chat/completions", {"model": "tiny"}, 400),
    ("/v1/completions", {"model": "tiny"}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": 5}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "max_tokens": -1}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "max_tokens": 10**9}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "max_tokens": "3"}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "temperature": -0.5}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "top_p": 0}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "top_p": 1.5}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "n": 0}, 400),
    ("/v1/completions", {"model": "nope", "prompt": "w5"}, 404),
    ("/v1/completions", {"model": "tiny", "prompt": " ".join(["w5"] * 300)}, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hello"}, 400),
    ("/v1/nothing", {}, 404),
]


@pytest.mark.parametrize("path,body,status", BAD)
def test_bad_input_gets_openai_errors(live_server, path, body, status):
    async def go():
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
            async with s.post(live_server.base_url + path, data=data) as r:
                return r.status, await r.json()
    got, payload = asyncio.run(go())
    assert got == status
    assert set(payload["error"]) == {"message", "type", "param", "code"} and payload["error"]["message"]
    # and the server keeps serving
    assert client(live_server).completions.create(model="tiny", prompt="w5", max_tokens=1).choices


def test_wrong_api_key_is_401(live_server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_tokenize_detokenize(live_server):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(live_server.base_url + "/tokenize", json={"prompt": PROMPT}) as r:
                toks = (await r.json())["tokens"]
            async with s.post(live_server.base_url + "/detokenize", json={"tokens": toks}) as r:
                return toks, (await r.json())["prompt"]
    toks, text = asyncio.run(go())
    assert len(toks) == 5 and text == PROMPT


def test_64_concurrent_streams_match_offline(live_server, tiny_model_dir):
    prompts = [" ".join(f"w{(i * 7 + j) % 200 + 3}" for j in range(3 + i % 9)) for i in range(64)]

    async def one(c, i):
        stream = await c.completions.create(model="tiny", prompt=prompts[i], max_tokens=6 + i % 5, temperature=0.8,
                                            seed=i, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
        text, usage = "", None
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].text
            if ch.usage:
                usage = ch.usage
        return text, usage

    async def all_():
        c = openai.AsyncOpenAI(base_url=live_server.base_url + "/v1", api_key=API_KEY, max_retries=0)
        return await asyncio.gather(*(one(c, i) for i in range(64)))

    results = asyncio.run(all_())
    offline = LLM(tiny_model_dir("llama"), **ENGINE_ARGS).generate(
        prompts, [SamplingParams(temperature=0.8, seed=i, max_tokens=6 + i % 5, ignore_eos=True) for i in range(64)],
        use_tqdm=False)
    for i, ((text, usage), off) in enumerate(zip(results, offline)):
        assert usage.completion_tokens == 6 + i % 5
        assert text == off.outputs[0].text


def test_disconnects_abort_and_free_blocks(live_server):
    kv = live_server.engine.engine.kv_cache_manager

    async def drop(s, i):
        body = {"model": "tiny", "prompt": f"w{i + 3} w9", "max_tokens": 200, "stream": True, "ignore_eos": True}
        async with s.post(live_server.base_url + "/v1/completions", json=body) as r:
            async for _ in r.content:
                break  # one event, then hang up

    async def go():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
            await asyncio.gather(*(drop(s, i) for i in range(20)))
    asyncio.run(go())
    deadline = time.time() + 30
    while time.time() < deadline and (kv.num_free_blocks != kv.pool.num_blocks - 1
                                      or live_server.engine.engine.has_unfinished_requests()):
        time.sleep(0.1)
    assert not live_server.engine.engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.pool.num_blocks - 1


def test_logprobs_and_sampling_fields_over_http(live_server):
    c = client(live_server)
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2,
                             extra_body={"ignore_eos": True, "repetition_penalty": 1.3, "min_p": 0.05})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) >= 2 for t in lp.top_logprobs)
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=3,
                                     temperature=0, logprobs=True, top_logprobs=3, presence_penalty=0.5,
                                     frequency_penalty=0.2, logit_bias={"77": 100}, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(x.top_logprobs) == 3 for x in content)
    assert chat.choices[0].message.content.split() == ["w74"] * 3  # id 77 is "w74"; the bias forces it
    stream = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=3,
                                       temperature=0, logprobs=True, stream=True, extra_body={"ignore_eos": True})
    streamed = [x for ch in stream if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    assert len(streamed) == 3
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, logprobs=50)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, extra_body={"min_p": 3})


def test_prompt_logprobs_over_http(live_server):
    r = client(live_server).completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                               extra_body={"prompt_logprobs": 1})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 5 and all(v["logprob"] <= 0 for e in plp[1:] for v in e.values())


def test_metrics_count_what_was_served(live_server):
    long_prompt = " ".join(f"w{i}" for i in range(10, 50))  # 40 tokens: two full blocks to find in the cache
    for _ in range(2):
        client(live_server).completions.create(model="tiny", prompt=long_prompt, max_tokens=3,
                                               extra_body={"ignore_eos": True})

    async def scrape():
        async with aiohttp.ClientSession() as s:
            async with s.get(live_server.base_url + "/metrics") as r:
                return await r.text()
    values = {}
    for line in asyncio.run(scrape()).splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    assert values["jaxpaged:generation_tokens_total"] >= 3
    assert values["jaxpaged:prompt_tokens_total"] >= 40
    assert values['jaxpaged:request_success_total{finished_reason="length"}'] >= 1
    assert values["jaxpaged:prefix_cache_queries_total"] >= values["jaxpaged:prefix_cache_hits_total"] > 0
