"""Speculative decoding behind the OpenAI server: the same greedy completions as a plain server, streamed or
not, with vLLM's spec_decode metrics."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import API_KEY, serving
from tests.server.test_openai_api import delta, scrape

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "adaptive": False}
PROMPTS = [[17, 42, 99, 5] * 4, [7, 8, 9] * 5 + [7], [100, 3, 100, 3, 100, 61, 62, 63, 100, 3]]


@pytest.fixture(scope="module")
def spec_server(tiny_model_dir):
    with serving(tiny_model_dir("llama"), speculative_config=SPEC) as server:
        yield server


def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)


def completion(server, prompt, stream: bool, **kw) -> str:
    r = client(server).completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0, stream=stream,
                                          **kw)
    if not stream:
        return r.choices[0].text
    return "".join(c.choices[0].text for c in r if c.choices)


def test_greedy_completions_match_a_plain_server(live_server, spec_server):
    before = scrape(spec_server)
    for prompt in PROMPTS:
        want = completion(live_server, prompt, False)
        assert completion(spec_server, prompt, False) == want
        assert completion(spec_server, prompt, True) == want  # several tokens a step stream as one delta
    after = scrape(spec_server)
    assert delta(before, after, "jaxpaged:spec_decode_num_drafts_total") > 0
    assert delta(before, after, "jaxpaged:spec_decode_num_accepted_tokens_total") > 0


def test_streamed_samples_are_well_formed(spec_server):
    chunks = list(client(spec_server).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, n=2,
                                                         temperature=1.0, seed=3, stream=True))
    texts = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        for ch in c.choices:
            assert ch.index not in finished
            texts[ch.index] += ch.text
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1} and all(texts.values())
