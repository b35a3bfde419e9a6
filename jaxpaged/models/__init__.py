"""Model implementations and checkpoint loading."""

from jaxpaged.models.llama import AttentionMetadata, LlamaForCausalLM
from jaxpaged.models.registry import (
    ARCHITECTURES,
    build_model,
    default_model_path,
    load_hf_config,
    load_tokenizer,
    model_config_from_hf,
)

__all__ = ["ARCHITECTURES", "AttentionMetadata", "LlamaForCausalLM", "build_model", "default_model_path",
           "load_hf_config", "load_tokenizer", "model_config_from_hf"]
