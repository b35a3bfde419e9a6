"""Tiny PEFT LoRA adapters written by peft itself (random A and B: PEFT's default B = 0 would be a no-op), and
HF transformers references with the adapter merged into the weights."""

from __future__ import annotations

import os


def make_adapter(base_path: str, out_path: str, *, r: int, targets: list[str], seed: int, alpha: float = 16.0,
                 rslora: bool = False, scale: float = 0.2, **config) -> str:
    """Save a LoRA adapter of the model at `base_path` to `out_path` (adapter_config.json and
    adapter_model.safetensors); returns out_path."""
    import torch
    from peft import LoraConfig, get_peft_model

    from tests.tiny_models import load_hf_model

    torch.manual_seed(seed)
    model = get_peft_model(load_hf_model(base_path), LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False, **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, scale)
    model.save_pretrained(out_path, safe_serialization=True)
    assert os.path.isfile(os.path.join(out_path, "adapter_model.safetensors"))
    return out_path


def hf_merged(base_path: str, adapter_path: str):
    """The base model with the adapter merged into its weights (PEFT's merge_and_unload), float32, eval mode."""
    from peft import PeftModel

    from tests.tiny_models import load_hf_model

    return PeftModel.from_pretrained(load_hf_model(base_path), adapter_path).merge_and_unload().eval()
