"""`bench throughput --compare-lora N`: the workload with its requests spread evenly over N random LoRA adapters
(and the base model), against the base model alone on the same workload, in one run.

The adapters are written here in PEFT's documented layout (adapter_config.json, adapter_model.safetensors with
base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight), rank `rank` on every attention and
MLP projection, small random weights: what multi-LoRA costs does not depend on what the adapters learned."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import numpy as np

from jaxpaged.models.lora_adapter import module_dims

_PATHS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
          "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def write_random_adapter(model_config, path: str, rank: int, seed: int, scale: float = 0.02) -> str:
    """A rank-`rank` adapter of every projection of the model `model_config` describes, saved to `path`."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(model_config.num_layers):
        for module, (d_in, d_out) in module_dims(model_config).items():
            key = f"base_model.model.model.layers.{layer}.{_PATHS[module]}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, d_in)) * scale).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((d_out, rank)) * scale).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": [p.rsplit(".", 1)[1] for p in _PATHS.values()]}, f)
    return path


def compare_lora(reqs, engine_args, num_adapters: int, rank: int, temperature: float, run_jaxpaged) -> list[dict]:
    """[base model alone, requests over `num_adapters` adapters + the base model] on the same workload."""
    from jaxpaged import LoRARequest
    from jaxpaged.engine.llm_engine import prepare_model

    model_config = prepare_model(engine_args).model_config
    folder = tempfile.mkdtemp(prefix="jaxpaged-bench-lora-")
    adapters = [LoRARequest(f"bench-{i}", i + 1, write_random_adapter(model_config, os.path.join(folder, str(i)),
                                                                      rank, seed=i))
                for i in range(num_adapters)]
    mixed = dataclasses.replace(engine_args, enable_lora=True, max_loras=num_adapters, max_lora_rank=rank)
    per_request = [None if i % (num_adapters + 1) == num_adapters else adapters[i % (num_adapters + 1)]
                   for i in range(len(reqs))]
    results = [run_jaxpaged(reqs, engine_args, label="jaxpaged base model", temperature=temperature),
               run_jaxpaged(reqs, mixed, label=f"jaxpaged {num_adapters} LoRAs r{rank} + base",
                            temperature=temperature, lora_requests=per_request)]
    base_rows = [i for i, lora in enumerate(per_request) if lora is None]
    same = all(results[0]["token_ids"][i] == results[1]["token_ids"][i] for i in base_rows)
    ratio = results[1]["output_tokens_per_s"] / results[0]["output_tokens_per_s"]
    print(f"mixed LoRA / base output tokens/s: {ratio:.2f}x; base-model requests' outputs unchanged beside the "
          f"adapters': {same}")
    results[1].update(lora_ratio=ratio, base_outputs_unchanged=same, num_adapters=num_adapters, lora_rank=rank)
    return results
