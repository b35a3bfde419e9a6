"""A Llama-shaped model folder with no weights (config.json + a word-level tokenizer), for `load_format="dummy"`.

Benchmarks of engine speed need a model's shapes, not its weights: jaxpaged and vLLM both fill such a
folder with random weights (`load_format="dummy"`), and HF transformers builds it with `from_config`.
"""

from __future__ import annotations

import json
import os

# Named shapes: the issue's tiny host-bound model, and Llama-3.2-1B's layers with SmolLM2's vocabulary.
SHAPES = {
    "tiny": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                 intermediate_size=512, vocab_size=512),
    "1b": dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
               intermediate_size=8192, vocab_size=49152),
}


def write_dummy_model(path: str, shape: str | dict = "tiny", *, max_position_embeddings: int = 4096) -> str:
    """Write config.json, generation_config.json and a tokenizer of the shape's vocabulary to `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    dims = SHAPES[shape] if isinstance(shape, str) else dict(shape)
    vocab = dims["vocab_size"]
    os.makedirs(path, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16", **dims}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}",
                            ).save_pretrained(path)
    return path
