"""The real default model (SmolLM2-135M-Instruct, GGUF Q4_1) equals HF transformers on the same file."""

import os

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from tests.reference import (
    chat_prompt_ids,
    hf_greedy,
    hf_last_logits,
    our_last_logits_batch,
)

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a KV cache is in one sentence.",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    path = smollm2_path
    llm = LLM(path, max_num_batched_tokens=128, num_kv_blocks=128, max_model_len=512, compile_guard=True)
    return path, llm


@pytest.fixture(scope="module")
def hf_smollm2(smollm2):
    import torch
    from transformers import AutoModelForCausalLM

    path = smollm2[0]
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


def chat_ids(llm, question):
    return chat_prompt_ids(llm.get_tokenizer(), question)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_greedy_tokens_match_hf(smollm2, hf_smollm2, async_scheduling):
    path, llm = smollm2
    if not async_scheduling:  # (the fixture's engine is async, the default)
        llm = LLM(path, max_num_batched_tokens=128, num_kv_blocks=128, max_model_len=512, compile_guard=True,
                  async_scheduling=False)
    prompts = [list(chat_ids(llm, q)) for q in QUESTIONS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    eos = llm.engine.config.model_config.eos_token_ids
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_smollm2, p, 24, stop_at=eos)
    assert "Paris" in outs[0].outputs[0].text


def test_last_logits_match_hf(smollm2, hf_smollm2):
    _, llm = smollm2
    model = llm.engine.runner.graphdef, llm.engine.runner.state
    from flax import nnx

    model = nnx.merge(*model)
    prompts = [list(chat_ids(llm, q)) for q in QUESTIONS]
    worst = 0.0
    for ids, ours in zip(prompts, our_last_logits_batch(model, prompts)):
        worst = max(worst, float(np.abs(ours - hf_last_logits(hf_smollm2, ids)).max()))
    print(f"SmolLM2: max |logits - HF| = {worst:.2e}")
    assert worst < 1e-3


def test_speculative_greedy_tokens_match_hf(smollm2, hf_smollm2):
    """n-gram speculative decoding on prompts that ask to repeat a paragraph: the same greedy tokens as HF, with
    most drafts accepted."""
    from jaxpaged.bench.workload import copy_workload

    path, _ = smollm2
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
            "adaptive": False}
    llm = LLM(path, max_num_batched_tokens=128, num_kv_blocks=128, max_model_len=512, compile_guard=True,
              speculative_config=spec)
    reqs = copy_workload(3, llm.get_tokenizer(), seed=0, max_output_len=40)
    prompts = [r.prompt_token_ids for r in reqs]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    eos = llm.engine.config.model_config.eos_token_ids
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_smollm2, p, 40, stop_at=eos)
    assert llm.engine.stats.mean_acceptance_length > 2.5
