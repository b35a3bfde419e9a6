"""Greedy tokens and logits of our Llama-family model equal HF transformers' on tiny random models."""

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.models import build_model, load_hf_config, model_config_from_hf
from tests.reference import hf_greedy, hf_last_logits, our_last_logits
from tests.tiny_models import load_hf_model

ARCHS = ["llama", "qwen2", "mistral"]
PROMPT_LENS = [1, 5, 16, 17, 31, 40, 64, 100]


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, size=n).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("arch", ARCHS)
def test_last_position_logits_match_hf(arch, tiny_model_dir):
    path = tiny_model_dir(arch)
    hf = load_hf_model(path)
    model = build_model(model_config_from_hf(path, load_hf_config(path), "float32"))
    worst = 0.0
    for ids in prompts():
        ours, ref = our_last_logits(model, ids), hf_last_logits(hf, ids)
        worst = max(worst, float(np.abs(ours - ref).max()))
    print(f"{arch}: max |logits - HF| = {worst:.2e}")
    assert worst < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_matches_hf_token_for_token(arch, tiny_model_dir):
    path = tiny_model_dir(arch)
    hf = load_hf_model(path)
    llm = LLM(path, max_num_batched_tokens=128, num_kv_blocks=64, compile_guard=True)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(prompts(), params, use_tqdm=False)
    for ids, out in zip(prompts(), outs):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 32), f"{arch}: prompt of {len(ids)} tokens"
        assert out.outputs[0].finish_reason == "length"
