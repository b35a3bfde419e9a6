"""`/v1/completions` with `echo` (how evaluation clients score prompts), `return_tokens_as_token_ids`, and
`/tokenize` / `/detokenize` as vLLM serves them."""

from __future__ import annotations

import numpy as np
import pytest

from tests.server.conftest import post
from tests.tiny_models import load_hf_model

PROMPT = "w5 w6 w7 w8 w9 w10"


def tokenize(server, text: str) -> list[int]:
    return post(server, "/tokenize", {"prompt": text})["tokens"]


@pytest.fixture(scope="module")
def hf_prompt_logprobs(tiny_model_dir):
    """HF transformers' log-probability of each prompt token given the ones before it."""
    import torch

    hf = load_hf_model(tiny_model_dir("llama"))

    def run(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].double()
        lp = torch.log_softmax(logits, -1)
        return np.array([float(lp[i - 1, ids[i]]) for i in range(1, len(ids))])
    return run


def test_echo_scores_the_prompt_as_hf_does(live_server, hf_prompt_logprobs):
    ids = tokenize(live_server, PROMPT)
    r = post(live_server, "/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 1,
                                              "temperature": 0})
    c = r["choices"][0]
    lp = c["logprobs"]
    assert c["text"].startswith(PROMPT) and len(c["text"]) > len(PROMPT)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][1: len(ids)], hf_prompt_logprobs(ids), atol=2e-4)
    assert lp["tokens"][: len(ids)] == PROMPT.split()  # (this tokenizer decodes a lone word without its space)
    assert lp["text_offset"][: len(ids)] == np.cumsum([0] + [len(t) for t in lp["tokens"][: len(ids) - 1]]).tolist()
    assert lp["text_offset"][-1] == len(PROMPT)  # the completion starts after the echoed prompt
    for top, token_lp in zip(lp["top_logprobs"][1:], lp["token_logprobs"][1:]):
        assert token_lp in top.values() and 1 <= len(top) <= 2  # the token and the 1 most likely
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}
    assert c.get("prompt_logprobs") is None  # not asked for


def test_echo_with_max_tokens_0_only_scores(live_server, hf_prompt_logprobs):
    ids = tokenize(live_server, PROMPT)
    r = post(live_server, "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 0})
    c = r["choices"][0]
    assert c["text"].split() == PROMPT.split() and c["finish_reason"] == "length"
    assert len(c["logprobs"]["tokens"]) == len(ids)
    np.testing.assert_allclose(c["logprobs"]["token_logprobs"][1:], hf_prompt_logprobs(ids), atol=2e-4)
    assert r["usage"]["completion_tokens"] == 0
    without_echo = post(live_server, "/v1/completions", {"prompt": ids, "max_tokens": 0}, status=400)
    assert without_echo["error"]["param"] == "max_tokens"


def test_echo_without_logprobs_and_with_sampled_choices(live_server):
    r = post(live_server, "/v1/completions", {"prompt": [PROMPT, "w20 w21"], "echo": True, "max_tokens": 3,
                                              "n": 2, "temperature": 0.8, "seed": 1, "ignore_eos": True})
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    for c in r["choices"]:
        prompt = PROMPT if c["index"] < 2 else "w20 w21"
        assert c["text"].startswith(prompt) and len(c["text"].split()) == len(prompt.split()) + 3
        assert c["logprobs"] is None


@pytest.mark.parametrize("max_tokens", [0, 2])
def test_streamed_echo_equals_the_non_streamed_one(live_server, max_tokens):
    ids = tokenize(live_server, "w30 w31 w32")
    body = {"prompt": [PROMPT, ids], "echo": True, "logprobs": 1, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    whole = post(live_server, "/v1/completions", body)
    chunks = post(live_server, "/v1/completions", {**body, "stream": True})
    for c in whole["choices"]:
        mine = [ch["choices"][0] for ch in chunks if ch["choices"][0]["index"] == c["index"]]
        assert "".join(m["text"] for m in mine) == c["text"]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert sum((m["logprobs"][key] for m in mine), []) == c["logprobs"][key], key
        assert [m["finish_reason"] for m in mine if m["finish_reason"]] == [c["finish_reason"]]
    assert whole["choices"][1]["logprobs"]["tokens"][0] == "w30"


def test_return_tokens_as_token_ids(live_server):
    ids = tokenize(live_server, PROMPT)
    r = post(live_server, "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 2,
                                              "temperature": 0, "return_tokens_as_token_ids": True})
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"][: len(ids)] == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"][1:] for k in top)
    chat = post(live_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                                      "max_tokens": 2, "logprobs": True, "top_logprobs": 2,
                                                      "return_tokens_as_token_ids": True})
    for entry in chat["choices"][0]["logprobs"]["content"]:
        assert entry["token"].startswith("token_id:") and len(entry["top_logprobs"]) == 2
        assert all(t["token"].startswith("token_id:") for t in entry["top_logprobs"])


def test_prompt_logprobs_field_beside_echo(live_server, hf_prompt_logprobs):
    ids = tokenize(live_server, PROMPT)
    r = post(live_server, "/v1/completions", {"prompt": ids, "echo": True, "max_tokens": 1, "prompt_logprobs": 0})
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    got = [entry[str(t)]["logprob"] for entry, t in zip(plp[1:], ids[1:])]
    np.testing.assert_allclose(got, hf_prompt_logprobs(ids), atol=2e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_prepends_the_last_message_of_the_replys_role(live_server, stream):
    """vLLM's chat `echo`: the reply starts with the last message's content when it has the reply's role (an
    assistant message continued with `continue_final_message`); a user's last message is not echoed."""
    def reply(messages, **extra):
        body = {"messages": messages, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "n": 2, **extra}
        if not stream:
            return [c["message"]["content"] for c in post(live_server, "/v1/chat/completions", body)["choices"]]
        texts = ["", ""]
        for ch in post(live_server, "/v1/chat/completions", {**body, "stream": True}):
            for c in ch["choices"]:
                texts[c["index"]] += c["delta"].get("content") or ""
        return texts

    user = [{"role": "user", "content": "w1 w2"}]
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    partial = user + [{"role": "assistant", "content": "w7 w8"}]
    plain = reply(partial, **cont)
    echoed = reply(partial, echo=True, **cont)
    assert echoed == ["w7 w8" + t for t in plain] and plain[0]
    assert reply(user, echo=True) == reply(user)


def test_tokenize_options(live_server):
    with_special = post(live_server, "/tokenize", {"prompt": "w5 w6"})
    without = post(live_server, "/tokenize", {"prompt": "w5 w6", "add_special_tokens": False,
                                              "return_token_strs": True})
    assert with_special["tokens"][-2:] == without["tokens"] and without["count"] == 2
    assert without["token_strs"] == ["w5", "w6"] and without["max_model_len"] == 256
    chat = post(live_server, "/tokenize", {"messages": [{"role": "user", "content": "w5 w6"}]})
    assert chat["count"] == len(chat["tokens"]) >= 2
    # (vLLM's: the rendered text tokenized with the tokenizer's special tokens; this one adds none)
    chat_special = post(live_server, "/tokenize", {"messages": [{"role": "user", "content": "w5 w6"}],
                                                   "add_special_tokens": True})
    assert chat_special["tokens"] == chat["tokens"]
    assert post(live_server, "/detokenize", {"tokens": without["tokens"]})["prompt"] == "w5 w6"
    bad = post(live_server, "/tokenize", {"prompt": 5}, status=400)
    assert bad["error"]["param"] == "prompt"
