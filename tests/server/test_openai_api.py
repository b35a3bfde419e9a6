"""The OpenAI-compatible server, driven by the official `openai` client and raw aiohttp."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest

import jaxpaged
from jaxpaged import LLM, SamplingParams
from server.state import STATE
from tests.server.conftest import API_KEY, ENGINE_ARGS, post

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
            for method in (s.get, s.post):
                async with method(live_server.base_url + "/ping") as r:
                    assert r.status == 200
            async with s.get(live_server.base_url + "/version") as r:
                assert (await r.json())["version"] == jaxpaged.__version__
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


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats(live_server, path):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage so far (prompt
    tokens, tokens generated for that choice), the last chunk the request's; without include_usage, none."""
    body = {"model": "tiny", "max_tokens": 5, "temperature": 1.0, "seed": 3, "n": 2, "ignore_eos": True,
            "stream": True, **({"prompt": PROMPT} if "chat" not in path else
                               {"messages": [{"role": "user", "content": PROMPT}]})}

    def chunks(options):
        return post(live_server, path, {**body, "stream_options": options})

    got = chunks({"include_usage": True, "continuous_usage_stats": True})
    *per_choice, last = got
    prompt_tokens = last["usage"]["prompt_tokens"]
    seen = {0: 0, 1: 0}
    for ch in per_choice:
        (choice,) = ch["choices"]
        u = ch["usage"]
        assert u["prompt_tokens"] == prompt_tokens and u["total_tokens"] == prompt_tokens + u["completion_tokens"]
        assert u["completion_tokens"] >= seen[choice["index"]]
        seen[choice["index"]] = u["completion_tokens"]
    assert seen == {0: 5, 1: 5} and last["usage"]["completion_tokens"] == 10 and last["choices"] == []
    assert all("usage" not in ch for ch in chunks({"continuous_usage_stats": True}))


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
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "response_format": {"type": "json_schema"}}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "structured_outputs": {"regex": "[a-"}}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "priority": "high"}, 400),
    # tools with no tool_choice mean "auto", which needs --enable-auto-tool-choice; "required" needs tools
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w5"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w5"}],
                              "tool_choice": "required"}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "suffix": "w9"}, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w5"}],
                              "add_generation_prompt": True, "continue_final_message": True}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "echo": True, "max_tokens": -1}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "echo": "yes"}, 400),
    # numbers the engine's arrays cannot hold, or that are not numbers: 400s, not a dead engine loop
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "seed": 2**64}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "n": 10**20}, 400),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w5"}], "n": 10**8}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "temperature": float("nan")}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "temperature": float("inf")}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "repetition_penalty": float("inf")}, 400),
    ("/v1/completions", {"model": "tiny", "prompt": "w5", "logit_bias": {"5": float("nan")}}, 400),
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
    if isinstance(body, dict) and "suffix" in body:
        assert payload["error"]["param"] == "suffix" and "not supported" in payload["error"]["message"]
    if isinstance(body, dict) and ("tools" in body or "tool_choice" in body):
        assert payload["error"]["param"] == "tool_choice" and "tool" in payload["error"]["message"]
    # and the server keeps serving
    assert client(live_server).completions.create(model="tiny", prompt="w5", max_tokens=1).choices


def test_extreme_but_valid_numbers_are_served(live_server):
    """64-bit seeds (vLLM's range, negative ones too), a top_k or priority past any int32, a stop token id past
    the vocabulary: each is served (a seed is as reproducible as any), and the server keeps serving."""
    c = client(live_server)

    def text(**extra):
        r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=1.0,
                                 extra_body={"ignore_eos": True, **extra})
        return r.choices[0].text

    for seed in (2**32, 2**40, -1, 2**63 - 1, -(2**63)):
        assert text(seed=seed) == text(seed=seed)
    assert len({text(seed=s) for s in (2**40, 2**40 + 1, 2**41, 2**42)}) > 1
    assert text(top_k=10**20, seed=3) == text(seed=3)  # (k past the vocabulary keeps every token)
    text(priority=10**20)
    text(stop_token_ids=[10**20])
    assert client(live_server).completions.create(model="tiny", prompt="w5", max_tokens=1).choices


def test_truncate_prompt_tokens_over_http(live_server):
    """The request runs on the prompt's last k tokens: what it generates, its usage and its echo are that
    prompt's; a prompt too long for the model fits once truncated; a bad k is a 400 naming the field."""
    c = client(live_server)
    greedy = dict(model="tiny", max_tokens=4, temperature=0)
    words = PROMPT.split()
    cut = c.completions.create(prompt=PROMPT, echo=True, extra_body={"truncate_prompt_tokens": 3, "ignore_eos": True},
                               **greedy)
    tail = c.completions.create(prompt=" ".join(words[-3:]), extra_body={"ignore_eos": True}, **greedy)
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].text.split() == words[-3:] + tail.choices[0].text.split()
    long = " ".join(["w5"] * 300)  # (past this server's max_model_len of 256)
    r = c.completions.create(prompt=long, extra_body={"truncate_prompt_tokens": 100}, **greedy)
    assert r.usage.prompt_tokens == 100
    chat = c.chat.completions.create(messages=[{"role": "user", "content": long}],
                                     extra_body={"truncate_prompt_tokens": 50}, **greedy)
    assert chat.usage.prompt_tokens == 50
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(prompt=PROMPT, extra_body={"truncate_prompt_tokens": 0}, **greedy)
    assert e.value.body["param"] == "truncate_prompt_tokens"


def test_cache_salt_over_http(live_server):
    """vLLM's cache_salt: a prompt's cached blocks are found again only under the same salt (completions and
    chat); the outputs do not change; an empty salt is a 400 naming it."""
    c = client(live_server)
    kv = live_server.engine.engine.kv_cache_manager
    ids = [3 + (i * 37) % 250 for i in range(70)]  # (4 full blocks of 16 before the last token)
    greedy = dict(model="tiny", max_tokens=4, temperature=0, prompt=ids)

    def hits(salt):
        before = kv.num_hit_tokens
        r = c.completions.create(**greedy, extra_body={"cache_salt": salt, "ignore_eos": True})
        return kv.num_hit_tokens - before, r.choices[0].text

    first, text = hits("alpha")
    assert first == 0
    assert hits("alpha") == (64, text)
    assert hits("beta") == (0, text)
    message = [{"role": "user", "content": " ".join(f"w{i % 200}" for i in range(60))}]
    for expected in (0, 48):
        before = kv.num_hit_tokens
        c.chat.completions.create(model="tiny", messages=message, max_tokens=2, extra_body={"cache_salt": "gamma"})
        assert kv.num_hit_tokens - before == expected
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(**greedy, extra_body={"cache_salt": ""})
    assert e.value.body["param"] == "cache_salt"


def test_prompt_tokens_details_count_cached_tokens(live_server):
    """vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens, per request (both
    endpoints, streamed usage too); absent without the flag."""
    c = client(live_server)
    state = live_server.runner.app[STATE]
    ids = [3 + (i * 41) % 250 for i in range(50)]  # (3 full blocks of 16 before the last token)
    body = dict(model="tiny", max_tokens=2, prompt=ids, extra_body={"cache_salt": "details"})
    assert c.completions.create(**body).usage.prompt_tokens_details is None  # (off by default)
    state.prompt_tokens_details = True
    try:
        assert c.completions.create(**body).usage.prompt_tokens_details.cached_tokens == 48
        two = c.completions.create(**{**body, "prompt": [ids, ids[:20] + [7] * 30]})
        assert two.usage.prompt_tokens_details.cached_tokens == 48 + 16
        chunks = post(live_server, "/v1/completions", {"model": "tiny", "max_tokens": 2, "prompt": ids,
                                                       "cache_salt": "details", "stream": True,
                                                       "stream_options": {"include_usage": True}})
        assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
        message = [{"role": "user", "content": " ".join(f"w{(i * 7) % 200 + 3}" for i in range(40))}]
        chat = [c.chat.completions.create(model="tiny", messages=message, max_tokens=2).usage for _ in range(2)]
        assert [u.prompt_tokens_details.cached_tokens for u in chat] == [0, 32]
    finally:
        state.prompt_tokens_details = False


@pytest.mark.parametrize("path,field,where", [("/v1/completions", "prompt", "prompt"),
                                              ("/v1/chat/completions", "messages", "messages")])
def test_too_long_input_names_what_was_too_long(live_server, path, field, where):
    long = " ".join(["w5"] * 300)
    value = long if field == "prompt" else [{"role": "user", "content": long}]
    c = client(live_server)
    with pytest.raises(openai.BadRequestError) as e:
        if field == "prompt":
            c.completions.create(model="tiny", prompt=value, max_tokens=4)
        else:
            c.chat.completions.create(model="tiny", messages=value, max_tokens=4)
    assert f"300 in the {where}" in str(e.value) and e.value.body["param"] == where


def test_accepted_defaults_of_unsupported_fields(live_server):
    c = client(live_server)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=2,
                                  response_format={"type": "text"}, tool_choice="none")
    assert r.choices[0].finish_reason is not None


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


def test_logprobs_and_sampling_fields_over_http(live_server):
    c = client(live_server)
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2,
                             extra_body={"ignore_eos": True, "repetition_penalty": 1.3, "min_p": 0.05})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) >= 2 for t in lp.top_logprobs)
    text = r.choices[0].text
    # (this word-level tokenizer's decoder puts a space before each word, which a token decoded alone does not
    # show, so offsets only bound positions here; tests/engine/test_logprob_text.py checks them exactly)
    offsets = lp.text_offset
    assert offsets[0] == 0 and all(b - a >= len(t) for a, b, t in zip(offsets, offsets[1:], lp.tokens))
    assert all(text.find(t, o) >= o for o, t in zip(offsets, lp.tokens))
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


def scrape(server) -> dict[str, float]:
    """Every sample of /metrics: {'name{labels}': value}."""
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.get(server.base_url + "/metrics") as r:
                return await r.text()
    values = {}
    for line in asyncio.run(go()).splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def delta(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_metrics_count_exactly_what_was_served(live_server):
    """Exact deltas per request: tokens, finishes by reason, prefix-cache hits, one latency sample per event."""
    p = "jaxpaged:"
    long_prompt = " ".join(f"w{i}" for i in range(110, 150))  # 40 tokens, never seen before: two full blocks
    c = client(live_server)
    before = scrape(live_server)
    c.completions.create(model="tiny", prompt=long_prompt, max_tokens=3, extra_body={"ignore_eos": True})
    first = scrape(live_server)
    assert delta(before, first, p + "prompt_tokens_total") == 40
    assert delta(before, first, p + "generation_tokens_total") == 3
    assert delta(before, first, p + 'request_success_total{finished_reason="length"}') == 1
    assert delta(before, first, p + "prefix_cache_queries_total") == 40
    assert delta(before, first, p + "prefix_cache_hits_total") == 0
    for hist, count in (("time_to_first_token_seconds", 1), ("inter_token_latency_seconds", 2),
                        ("e2e_request_latency_seconds", 1), ("request_queue_time_seconds", 1)):
        assert delta(before, first, f"{p}{hist}_count") == count, hist
    # the same prompt again, n=2: two blocks come from the cache; two sequences of 3 tokens
    c.completions.create(model="tiny", prompt=long_prompt, max_tokens=3, n=2, extra_body={"ignore_eos": True})
    second = scrape(live_server)
    assert delta(first, second, p + "prefix_cache_queries_total") == 40
    assert delta(first, second, p + "prefix_cache_hits_total") == 32
    assert delta(first, second, p + "prompt_tokens_total") == 8 + 1  # the rest, and the fork's last prompt token
    assert delta(first, second, p + "generation_tokens_total") == 6
    assert delta(first, second, p + 'request_success_total{finished_reason="length"}') == 2
    for hist, count in (("time_to_first_token_seconds", 2), ("inter_token_latency_seconds", 4),
                        ("e2e_request_latency_seconds", 2)):
        assert delta(first, second, f"{p}{hist}_count") == count, hist
    # EOS forced by a bias: finished with reason stop
    c.completions.create(model="tiny", prompt="w5", max_tokens=3, logit_bias={"2": 100})
    third = scrape(live_server)
    assert delta(second, third, p + 'request_success_total{finished_reason="stop"}') == 1
    assert delta(second, third, p + "generation_tokens_total") == 1
    assert third[p + "num_requests_running"] == 0 and third[p + "kv_cache_usage_perc"] == 0


def test_gauges_are_fresh_after_the_last_request_is_aborted(live_server):
    """A stream the client hangs up on ends with no step after it: the KV and running gauges still come back to 0
    (they were published only after steps, so /metrics kept the last step's blocks until the next request)."""
    p = "jaxpaged:"
    stream = client(live_server).completions.create(model="tiny", prompt=" ".join(f"v{i}" for i in range(40)),
                                                    max_tokens=200, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            assert scrape(live_server)[p + "kv_cache_usage_perc"] > 0
            break
    stream.close()
    deadline = time.monotonic() + 10
    while (now := scrape(live_server))[p + "kv_cache_usage_perc"] != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert now[p + "kv_cache_usage_perc"] == 0 and now[p + "num_requests_running"] == 0


def test_oversized_body_is_413(live_server):
    async def go():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
            data = b'{"model": "tiny", "prompt": "' + b"w5 " * (12 << 20) + b'"}'  # 36 MiB
            async with s.post(live_server.base_url + "/v1/completions", data=data) as r:
                return r.status, await r.json()
    status, payload = asyncio.run(go())
    assert status == 413 and payload["error"]["code"] == 413


def test_health_is_503_once_the_engine_loop_died(live_server):
    """A second front (its own engine thread and app) over the same engine, whose step fails: the request gets a
    500 naming the failure and /health answers 503 from then on. The shared server is untouched."""
    from jaxpaged.engine.async_llm import AsyncLLM
    from tests.server.conftest import LiveServer

    engine = live_server.engine.engine

    def broken_step():
        raise RuntimeError("device lost")
    engine.core.step = broken_step
    doomed = LiveServer(AsyncLLM(engine), API_KEY)
    try:
        async def go():
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
                async with s.get(doomed.base_url + "/health") as r:
                    healthy = r.status
                async with s.post(doomed.base_url + "/v1/completions",
                                  json={"model": "tiny", "prompt": "w5", "max_tokens": 2}) as r:
                    failed = r.status, await r.json()
                async with s.get(doomed.base_url + "/health") as r:
                    return healthy, failed, r.status
        healthy, (status, body), after = asyncio.run(go())
        assert healthy == 200 and status == 500 and "device lost" in body["error"]["message"] and after == 503
    finally:
        del engine.core.step
        engine.abort_request(list(engine.output.parents))
        doomed.stop()
    assert client(live_server).completions.create(model="tiny", prompt="w5", max_tokens=2).choices
