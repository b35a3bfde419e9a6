"""Tiny random-weight Llama-family checkpoints (Llama, Qwen2/3, Mistral, Gemma, Granite, Phi-3) built with
transformers, for parity tests."""

from __future__ import annotations

VOCAB = 256


def make_tokenizer():
    """A word-level tokenizer over `VOCAB` tokens (w0..w252 and three specials), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i + 3 for i in range(VOCAB - 3)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")


BYTE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_byte_tokenizer():
    """A byte-level BPE tokenizer (GPT-2's byte alphabet, so ' ' is the piece 'Ġ') over 3 specials + 256 bytes +
    a few merges: VOCAB_BYTES tokens. Any text round-trips; pieces differ from decoded text, as in real models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    vocab = {t: i for i, t in enumerate(BYTE_SPECIALS + alphabet)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(BYTE_SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   chat_template="{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>"
                                                 "{% endfor %}<|im_start|>")


VOCAB_BYTES = len(BYTE_SPECIALS) + 256 + 5

# Qwen3's chat template, cut down: tools in the system turn, an assistant's calls as <tool_call> lines (arguments
# written with tojson: they reach the template as objects), tool results as <tool_response>, and a reply that
# opens its thinking unless enable_thinking is false (then the prompt closes it, as Qwen3's does).
THINK_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>{% else %}{{ m.content or '' }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
    "{% if enable_thinking is defined and not enable_thinking %}\n</think>\n\n{% endif %}{% endif %}")
THINK_TOKENS = ["<think>", "</think>"]  # (added, not special, as in Qwen3's tokenizer)


def make_think_tokenizer():
    """The byte-level tokenizer with <think> and </think> as tokens of their own and THINK_TEMPLATE."""
    from tokenizers import AddedToken

    tok = make_byte_tokenizer()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    tok.chat_template = THINK_TEMPLATE
    return tok


def tiny_config(arch: str):
    """A 2-layer, hidden-64, GQA config of the given architecture."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    if arch == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=False,
                                        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 64})
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":  # q/k norms per head, a head_dim that is not hidden / heads
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    if arch == "mistral":
        return transformers.MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)
    if arch == "mistral-window":  # each token sees itself and the 7 before it
        return transformers.MistralConfig(**common, tie_word_embeddings=False, sliding_window=8)
    if arch == "llama-long":  # a long context, for streams that outlast what a test waits for
        return transformers.LlamaConfig(**{**common, "max_position_embeddings": 32768}, tie_word_embeddings=False)
    if arch == "llama-tied":
        return transformers.LlamaConfig(**common, tie_word_embeddings=True)
    if arch == "llama-bytes":  # the byte-level tokenizer's vocabulary; EOS is <|im_end|>
        return transformers.LlamaConfig(**{**common, "vocab_size": VOCAB_BYTES, "bos_token_id": 1, "eos_token_id": 2},
                                        tie_word_embeddings=False)
    if arch == "llama-think":  # the byte-level vocabulary and <think>, </think> (make_think_tokenizer)
        return transformers.LlamaConfig(**{**common, "vocab_size": VOCAB_BYTES + 2, "bos_token_id": 1,
                                           "eos_token_id": 2}, tie_word_embeddings=False)
    if arch == "llama-mqa":  # one KV head for all query heads (tensor parallelism replicates it)
        return transformers.LlamaConfig(**{**common, "num_key_value_heads": 1}, tie_word_embeddings=False)
    if arch == "llama-mha":  # as many KV heads as query heads, 8 of each (tensor parallelism up to 8)
        return transformers.LlamaConfig(**{**common, "num_attention_heads": 8, "num_key_value_heads": 8},
                                        tie_word_embeddings=False)
    if arch == "llama-draft":  # a smaller model on the same tokenizer (a draft for speculative decoding)
        return transformers.LlamaConfig(**{**common, "hidden_size": 32, "intermediate_size": 64,
                                           "num_hidden_layers": 1, "num_attention_heads": 2,
                                           "num_key_value_heads": 1}, tie_word_embeddings=True)
    if arch == "gemma":  # GELU-tanh MLP, norms scaled by (1 + weight), embeddings by sqrt(hidden), head_dim 32
        return transformers.GemmaConfig(**common, head_dim=32, tie_word_embeddings=True)
    if arch == "granite":  # embedding, residual, attention and logits multipliers
        return transformers.GraniteConfig(**common, tie_word_embeddings=False, embedding_multiplier=6.0,
                                          residual_multiplier=0.3, attention_multiplier=0.09, logits_scaling=4.0)
    if arch == "phi3":  # fused qkv and gate_up in the checkpoint; RoPE on half of each head
        return transformers.Phi3Config(**{**common, "pad_token_id": 0}, tie_word_embeddings=False,
                                       partial_rotary_factor=0.5)
    if arch == "phi3-longrope":  # LongRoPE (its short factors below original_max_position_embeddings)
        half = 8  # (head_dim 16: 8 frequencies)
        return transformers.Phi3Config(**{**common, "pad_token_id": 0, "max_position_embeddings": 1024},
                                       tie_word_embeddings=False, original_max_position_embeddings=256,
                                       rope_scaling={"rope_type": "longrope",
                                                     "short_factor": [1.0 + i / 4 for i in range(half)],
                                                     "long_factor": [2.0 + i for i in range(half)]})
    if arch == "qwen2-yarn":  # YaRN RoPE scaling (ramped frequencies, cos/sin times its attention factor)
        return transformers.Qwen2Config(**common, tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                         "original_max_position_embeddings": 32})
    if arch == "gemma2":  # alternating sliding (window 8) and full layers, soft-capped scores and logits
        return transformers.Gemma2Config(**common, head_dim=32, sliding_window=8, query_pre_attn_scalar=24,
                                         attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                         tie_word_embeddings=True)
    if arch == "gemma3":  # a sliding (window 8, theta 1e4) and a full layer (linear-scaled theta 1e6), q/k norms,
        # norms around each block, query_pre_attn_scalar
        return transformers.Gemma3TextConfig(
            **common, head_dim=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=24, tie_word_embeddings=True,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    moe = dict(num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "mixtral":  # 4 experts, 2 per token, renormalized
        return transformers.MixtralConfig(**{**common, "intermediate_size": 32}, num_local_experts=4,
                                          num_experts_per_tok=2, tie_word_embeddings=False, sliding_window=None)
    if arch == "qwen3-moe":  # 4 experts (q/k norms as Qwen3)
        return transformers.Qwen3MoeConfig(**common, head_dim=32, num_experts=4, moe_intermediate_size=32,
                                           norm_topk_prob=True, tie_word_embeddings=False, **moe)
    if arch == "qwen2-moe":  # 4 experts, probabilities not renormalized, a gated shared expert, q/k/v biases
        return transformers.Qwen2MoeConfig(**common, num_experts=4, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=48, norm_topk_prob=False,
                                           tie_word_embeddings=False, **moe)
    raise ValueError(arch)


def make_tiny_model(arch: str, path: str, seed: int = 0) -> str:
    """Save a random model of `arch` (safetensors) and the tokenizer to `path`; returns path."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(arch)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "qwen2":  # random q/k/v biases, so the bias path is exercised
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    if arch in ("gemma", "gemma2", "gemma3", "granite", "phi3", "phi3-longrope"):
        with torch.no_grad():  # every norm away from its init, so an offset or a misplaced norm shows
            for name, module in model.named_modules():
                if name.rpartition(".")[2].endswith("norm"):
                    module.weight.normal_(0 if arch.startswith("gemma") else 1, 0.3)
    if arch == "qwen3":  # q/k norm weights away from ones, so a missing or misplaced norm shows
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1, 0.5)
                layer.self_attn.k_norm.weight.normal_(1, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    tokenizers = {"llama-bytes": make_byte_tokenizer, "llama-think": make_think_tokenizer}
    tokenizers.get(arch, make_tokenizer)().save_pretrained(path)
    return path


def load_hf_model(path: str):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
