"""Quantized weights beside the engine's other features: LoRA adapters on a packed AWQ base, a GPTQ draft model
for speculative decoding, the functional API; each against the same run on the float weights the checkpoint
encodes (saved as a float checkpoint)."""

import os
import shutil

import jax
import numpy as np
import pytest
import torch

from jaxpaged import LLM, LoRARequest, SamplingParams, functional
from jaxpaged.layers.quant import QuantizedWeight
from tests.lora.adapters import make_adapter
from tests.quant_checkpoints import write_quantized_checkpoint
from tests.tiny_models import load_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE = dict(attention_backend="reference", compile_guard=True, max_num_seqs=4, num_kv_blocks=96,
              max_num_batched_tokens=64, max_model_len=256)


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory):
    """(AWQ folder, GPTQ act-order folder, {method: float folder of the weights that checkpoint encodes})."""
    src = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("quantized")
    folders, floats = {}, {}
    for method, kind in (("awq", {}), ("gptq", {"act_order": True})):
        folders[method] = str(root / method)
        encoded = write_quantized_checkpoint(src, folders[method], method, **kind)
        hf = load_hf_model(src)
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name in encoded:
                    p.copy_(torch.from_numpy(encoded[name]))
        floats[method] = str(root / f"{method}-float")
        hf.save_pretrained(floats[method])
        for f in set(os.listdir(src)) - set(os.listdir(floats[method])):  # (the tokenizer's files)
            shutil.copy(os.path.join(src, f), floats[method])
    return folders, floats


def prompts(seed: int, lens=(5, 17, 40)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, size=n).tolist() for n in lens]


def tokens(llm, ps, params=GREEDY, **kw) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False, **kw)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_lora_on_a_quantized_base_equals_the_float_base(checkpoints, tiny_model_dir, tmp_path):
    folders, floats = checkpoints
    adapter = make_adapter(tiny_model_dir("llama"), str(tmp_path / "a"), r=4, targets=["q_proj", "v_proj", "down_proj"],
                           seed=1)
    lora = LoRARequest("a", 1, adapter)
    ps = prompts(0)
    quantized = LLM(folders["awq"], enable_lora=True, max_lora_rank=8, **ENGINE)
    reference = LLM(floats["awq"], enable_lora=True, max_lora_rank=8, **ENGINE)
    with_adapter = tokens(quantized, ps, lora_request=[lora] * len(ps))
    assert with_adapter == tokens(reference, ps, lora_request=[lora] * len(ps))
    assert with_adapter != tokens(quantized, ps)  # (the adapter changes the outputs)


def test_quantized_draft_model(checkpoints):
    """A GPTQ (act order) copy of the target as its draft: the target's greedy tokens, and nearly every draft
    accepted (the draft computes with the weights it encodes, close to the target's)."""
    folders, floats = checkpoints
    ps = prompts(1)
    spec = {"method": "draft_model", "model": folders["gptq"], "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(floats["gptq"], speculative_config=spec, **ENGINE)
    assert llm.engine.config.draft_model_config.quantization == "gptq"
    plain = LLM(floats["gptq"], **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert tokens(llm, ps, params) == tokens(plain, ps, params)
    st = llm.engine.stats
    assert st.spec_num_draft_tokens > 30 and st.spec_num_accepted_tokens > 0.9 * st.spec_num_draft_tokens


def test_functional_generate_with_quantized_weights(checkpoints):
    folders, floats = checkpoints
    ps = prompts(2, (6, 6))
    outs = []
    for path in (folders["awq"], floats["awq"]):
        config, params = functional.load(path, attention_backend="reference")
        tokens_, lengths = functional.pad_batch(ps)
        outs.append(np.asarray(functional.generate(config, params, tokens_, lengths, jax.random.key(0),
                                                       max_new_tokens=8)))
        if path == folders["awq"]:
            assert isinstance(params["layers"][0]["wqkv"], QuantizedWeight)
    np.testing.assert_array_equal(outs[0], outs[1])


def test_teacher_forced_agreement(checkpoints):
    """The bench's teacher-forced agreement: 1 for a run's own greedy tokens, low for other tokens."""
    from jaxpaged.bench.quantization import teacher_forced_agreement

    folders, floats = checkpoints
    llm = LLM(floats["awq"], **ENGINE)
    ps = prompts(3)
    own = tokens(llm, ps)
    assert teacher_forced_agreement(llm, ps, own) == 1.0
    assert teacher_forced_agreement(llm, ps, [[(t + 1) % 256 for t in r] for r in own]) < 0.5
