"""Adapters the engine cannot serve fail with an error naming the adapter and the module, before any step."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from jaxpaged import LLM, LoRARequest, SamplingParams
from jaxpaged.models import load_hf_config, model_config_from_hf
from jaxpaged.models.lora_adapter import LoRAError, load_lora_adapter
from tests.lora.adapters import make_adapter


@pytest.fixture(scope="module")
def cfg(lora_setup):
    base, _ = lora_setup
    return model_config_from_hf(base, load_hf_config(base), "float32")


def edited_copy(src, dst, config=None, tensors=None):
    """A copy of adapter `src` with its config updated by `config` and its tensors by tensors(dict) -> dict."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    if config:
        with open(os.path.join(dst, "adapter_config.json")) as f:
            c = json.load(f)
        c.update(config)
        with open(os.path.join(dst, "adapter_config.json"), "w") as f:
            json.dump(c, f)
    if tensors:
        file = os.path.join(dst, "adapter_model.safetensors")
        save_file(tensors(load_file(file)), file)
    return dst


def test_bad_adapters_are_named(lora_setup, cfg, tmp_path):
    base, adapters = lora_setup
    a1 = adapters["a1"]

    def fails(path, *match, max_rank=8):
        with pytest.raises(LoRAError) as e:
            load_lora_adapter("bad", 9, path, cfg, max_rank)
        for m in ("'bad'", *match):
            assert m in str(e.value), str(e.value)

    fails(str(tmp_path / "nowhere"), "is not a folder")
    fails(a1, "rank 4 exceeds max_lora_rank=2", "of layer 0", max_rank=2)
    fails(edited_copy(a1, tmp_path / "dora", {"use_dora": True}), "use_dora")
    fails(edited_copy(a1, tmp_path / "bias", {"bias": "all"}), "bias")
    fails(edited_copy(a1, tmp_path / "saved", {"modules_to_save": ["lm_head"]}), "modules_to_save")
    fails(edited_copy(a1, tmp_path / "alpha", {"lora_alpha": 0}), "lora_alpha")

    def wrong_width(t):
        key = next(k for k in t if "layers.1.self_attn.v_proj.lora_B" in k)
        t[key] = np.zeros((t[key].shape[0] + 1, t[key].shape[1]), np.float32)
        return t

    fails(edited_copy(a1, tmp_path / "shape", tensors=wrong_width), "'v_proj' of layer 1", "do not fit")

    def half_pair(t):
        del t[next(k for k in t if "layers.0.mlp.down_proj.lora_A" in k)]
        return t

    fails(edited_copy(a1, tmp_path / "half", tensors=half_pair), "'down_proj' of layer 0", "lora_A missing")

    def deep_layer(t):
        return {k.replace("layers.1.", f"layers.{cfg.num_layers}."): v for k, v in t.items()}

    fails(edited_copy(a1, tmp_path / "deep", tensors=deep_layer), f"layer {cfg.num_layers}")
    embed = make_adapter(base, str(tmp_path / "embed"), r=2, targets=["q_proj", "embed_tokens"], seed=5)
    fails(embed, "embed_tokens")
    os.remove(os.path.join(a1_copy := str(edited_copy(a1, tmp_path / "nofile")), "adapter_model.safetensors"))
    fails(a1_copy, "adapter_model.safetensors is missing")


def test_engine_refuses_bad_lora_requests_before_any_step(lora_setup):
    base, adapters = lora_setup
    plain = LLM(base, num_kv_blocks=32, max_model_len=64, max_num_batched_tokens=32, max_num_seqs=4)
    with pytest.raises(ValueError, match="lora_request: this engine was started without enable_lora"):
        plain.generate([[5, 6, 7]], SamplingParams(max_tokens=2), lora_request=LoRARequest("a1", 1, adapters["a1"]))
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, adapters["a1"])
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, adapters["a1"])
    llm = LLM(base, enable_lora=True, max_lora_rank=8, num_kv_blocks=32, max_model_len=64,
              max_num_batched_tokens=32, max_num_seqs=4)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), lora_request=LoRARequest("a1", 1, adapters["a1"]))
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'a1'"):  # one id, one adapter
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), lora_request=LoRARequest("a2", 1, adapters["a2"]))
    with pytest.raises(ValueError, match="lora_request: got 1 for 2 prompts"):
        llm.generate([[5], [6]], SamplingParams(max_tokens=2), lora_request=[None])
    with pytest.raises(ValueError, match="max_loras must be a positive integer"):
        LLM(base, enable_lora=True, max_loras=0)
    assert not llm.engine.has_unfinished_requests()


def test_bf16_adapters_load_and_strange_ones_are_refused(lora_setup, cfg, tmp_path):
    import ml_dtypes

    base, adapters = lora_setup
    a1 = adapters["a1"]
    f32 = load_lora_adapter("a1", 1, a1, cfg, 8)

    import torch
    from safetensors.numpy import load_file
    from safetensors.torch import save_file as save_torch  # (numpy's writer has no bfloat16)

    bf16_dir = edited_copy(a1, tmp_path / "bf16")
    tensors = load_file(os.path.join(a1, "adapter_model.safetensors"))
    save_torch({k: torch.from_numpy(v).to(torch.bfloat16) for k, v in tensors.items()},
               os.path.join(bf16_dir, "adapter_model.safetensors"))
    bf16 = load_lora_adapter("a1", 1, str(bf16_dir), cfg, 8)
    rounded = f32.a["q"].astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(bf16.a["q"], rounded) and not np.array_equal(bf16.a["q"], f32.a["q"])

    def fails(path, *match):
        with pytest.raises(LoRAError) as e:
            load_lora_adapter("bad", 9, path, cfg, 8)
        for m in ("'bad'", *match):
            assert m in str(e.value), str(e.value)

    def poisoned(t):
        key = next(k for k in t if "layers.0.self_attn.q_proj.lora_B" in k)
        t[key] = t[key].copy()
        t[key][0, 0] = np.nan
        return t

    fails(edited_copy(a1, tmp_path / "nan", tensors=poisoned), "not finite", "'q_proj' of layer 0")
    fails(edited_copy(a1, tmp_path / "pat", {"rank_pattern": ["q_proj"]}), "rank_pattern must be an object")
    fails(edited_copy(a1, tmp_path / "re", {"alpha_pattern": {"q_proj(": 4}}), "not a regular expression")
    fails(edited_copy(a1, tmp_path / "alpha0", {"alpha_pattern": {"q_proj": 0}}), "must be a positive number")

    def vision(t):
        return {k.replace("base_model.model.model.layers", "base_model.model.vision_tower.layers"): v
                for k, v in t.items()}

    fails(edited_copy(a1, tmp_path / "vision", tensors=vision), "not in the decoder's layers")

    def twice(t):
        key = next(k for k in t if "layers.0.self_attn.q_proj.lora_A" in k)
        t[key.replace("lora_A.weight", "lora_A.default.weight")] = t[key]
        return t

    fails(edited_copy(a1, tmp_path / "twice", tensors=twice), "two lora_A tensors")
    # PEFT's pattern match: a key with alternatives, matched from model.layers (not base_model.model.)
    patterned = edited_copy(a1, tmp_path / "alt", {"alpha_pattern": {"q_proj|v_proj": 32}})
    scaled = load_lora_adapter("alt", 10, str(patterned), cfg, 8)
    assert np.allclose(scaled.b["q"], 2 * f32.b["q"]) and np.allclose(scaled.b["v"], 2 * f32.b["v"])
    assert np.allclose(scaled.b["down"], f32.b["down"])


def test_registry_keeps_named_adapters_and_gives_fresh_ids(lora_setup, cfg):
    from jaxpaged.config import LoRAConfig
    from jaxpaged.engine.lora_registry import LoRARegistry

    _, adapters = lora_setup
    registry = LoRARegistry(cfg, LoRAConfig(max_loras=1, max_lora_rank=8, max_cpu_loras=1))
    registry.resolve(LoRARequest("a1", 1, adapters["a1"]), keep=True)
    registry.resolve(LoRARequest("a2", 2, adapters["a2"]))
    registry.resolve(LoRARequest("a3", 3, adapters["a3"]))
    assert sorted(registry._adapters) == [1, 3]  # (a2 dropped, a1 kept past max_cpu_loras)
    assert registry.id_for("a2", adapters["a2"]) == 2 and registry.id_for("new", "/x") == 4
    assert registry.id_for("new2", "/y") == 5
