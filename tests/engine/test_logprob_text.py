"""Logprob tokens are text (vLLM's decoded_token: ' the', not the byte-level piece 'Ġthe'), offsets add up."""

from __future__ import annotations

import pytest

from jaxpaged import LLM, SamplingParams
from server.protocol import completion_logprobs


@pytest.fixture(scope="module")
def byte_llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama-bytes"), num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=32,
               compile_guard=True)


def test_logprob_tokens_are_decoded_text(byte_llm):
    tok = byte_llm.get_tokenizer()
    printable = [i for i in range(len(tok)) if tok.decode([i]).isprintable() and tok.decode([i])]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, prompt_logprobs=2, ignore_eos=True,
                            allowed_token_ids=printable)
    out = byte_llm.generate([" the cat in the hat"], params, use_tqdm=False)[0]
    o = out.outputs[0]
    entries = [e for e in o.logprobs] + [e for e in out.prompt_logprobs[1:]]
    pieces = 0
    for entry in entries:
        for token_id, lp in entry.items():
            assert lp.decoded_token == tok.decode([token_id])
            pieces += tok.convert_ids_to_tokens(token_id) != lp.decoded_token
    assert pieces > 0, "no token whose piece differs from its text: the test would not tell them apart"
    lp = completion_logprobs(o.logprobs, o.token_ids)
    assert "".join(lp["tokens"]) == o.text
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    resumed = completion_logprobs(o.logprobs[5:], o.token_ids[5:], text_offset=lp["text_offset"][5])
    assert resumed["text_offset"] == lp["text_offset"][5:]
