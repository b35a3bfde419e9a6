"""A GGUF file's config, tokenizer and chat template as an HF folder, built without torch and cached.

transformers reads GGUF metadata through its PyTorch loading path, so a base install (no torch)
could not open the default model. Here the `gguf` package reads the metadata and `tokenizers`
builds the tokenizer, the way llama.cpp describes it: byte-level BPE (`gpt2`: SmolLM2, Llama 3,
Qwen2) or SentencePiece BPE with byte fallback (`llama`: Llama 2, Mistral). The result is saved
once as `config.json` + `generation_config.json` + tokenizer files under
`~/.cache/jaxpaged/gguf/<key>` (key: the file's path, size and mtime), so later starts read a
small folder instead of the whole GGUF. Weights still come from the GGUF (`weights.py`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when the folder's contents change, so stale caches are rebuilt

# GGUF general.architecture -> (HF architecture, model_type)
_ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
          "qwen3": ("Qwen3ForCausalLM", "qwen3")}

# llama.cpp's pre-tokenizer names -> the split regex its vocabulary was trained with (byte-level BPE).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SMOLLM_DIGITS = r"\p{N}"  # llama.cpp's smollm: digits one by one, then GPT-2's split
PRE_TOKENIZER_SPLITS: dict[str, list[str]] = {
    "llama3": [_LLAMA3_SPLIT], "llama-v3": [_LLAMA3_SPLIT], "llama-bpe": [_LLAMA3_SPLIT],
    "smaug-bpe": [_LLAMA3_SPLIT], "qwen2": [_QWEN2_SPLIT], "deepseek-r1-qwen": [_QWEN2_SPLIT],
    "smollm": [_SMOLLM_DIGITS],
}

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def cache_root() -> str:
    return os.environ.get("JAXPAGED_GGUF_CACHE", os.path.expanduser("~/.cache/jaxpaged/gguf"))


def gguf_hf_folder(path: str) -> str:
    """The HF folder (config, generation config, tokenizer) describing the GGUF at `path`; built on first use."""
    st = os.stat(path)
    key = hashlib.sha256(repr((os.path.abspath(path), st.st_size, st.st_mtime_ns, FORMAT_VERSION)).encode())
    folder = os.path.join(cache_root(), key.hexdigest()[:16])
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    logger.info("Reading the GGUF metadata of %s (once; cached in %s)", path, folder)
    tmp = f"{folder}.tmp{os.getpid()}"
    write_hf_folder(read_metadata(path), tmp)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    try:
        os.replace(tmp, folder)
    except OSError:  # another process built it first
        if not os.path.exists(os.path.join(folder, "config.json")):
            raise
    return folder


def read_metadata(path: str) -> dict[str, Any]:
    """Every metadata field of a GGUF as Python values, plus `tensor_names`."""
    import gguf

    reader = gguf.GGUFReader(path)
    meta: dict[str, Any] = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    meta["tensor_names"] = [t.name for t in reader.tensors]
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # (llama.cpp's per-frequency RoPE divisors: Llama 3.1+ scaling)
            meta["rope_freqs"] = [float(x) for x in gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)]
    return meta


def write_hf_folder(meta: dict[str, Any], folder: str) -> None:
    """Save the config, generation config and tokenizer that `meta` describes into `folder`."""
    os.makedirs(folder, exist_ok=True)
    config = hf_config_dict(meta)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config.get("bos_token_id"), "eos_token_id": eos_token_ids(meta)}, f, indent=2)
    build_tokenizer(meta).save_pretrained(folder)


def hf_config_dict(meta: dict[str, Any]) -> dict[str, Any]:
    """A transformers `config.json` for a Llama-family GGUF (llama, mistral, qwen2, qwen3)."""
    arch = meta["general.architecture"]
    if arch not in _ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(_ARCHS))})")
    hf_arch, model_type = _ARCHS[arch]
    if arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        hf_arch, model_type = "MistralForCausalLM", "mistral"

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    names = set(meta["tensor_names"])
    config: dict[str, Any] = {
        "architectures": [hf_arch], "model_type": model_type,
        "vocab_size": int(get("vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "hidden_size": hidden, "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names and arch != "qwen2",
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    scaling = get("rope.scaling.type")
    if scaling in ("linear", "yarn"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(get("rope.scaling.factor", 1.0))}
        if scaling == "yarn":
            config["rope_scaling"]["original_max_position_embeddings"] = int(
                get("rope.scaling.original_context_length", config["max_position_embeddings"]))
    if "rope_freqs.weight" in names:
        config["rope_scaling"] = llama3_rope_scaling(meta.get("rope_freqs"), config["rope_theta"], config["head_dim"])
    for name in ("bos", "eos", "padding", "unknown"):
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config[{"padding": "pad", "unknown": "unk"}.get(name, name) + "_token_id"] = int(token_id)
    return config


def eos_token_ids(meta: dict[str, Any]) -> list[int]:
    """End-of-generation ids: EOS, and llama.cpp's end-of-turn / end-of-message ids when the file has them."""
    ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def build_tokenizer(meta: dict[str, Any]):
    """The `PreTrainedTokenizerFast` that a GGUF's `tokenizer.*` metadata describes."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    if kind == "gpt2":
        backend = _byte_level_bpe(meta, tokens)
    elif kind == "llama":
        backend = _sentencepiece_bpe(meta, tokens)
    else:
        raise ValueError(f"GGUF tokenizer {kind!r} is not supported (supported: gpt2, llama)")
    types = list(meta.get("tokenizer.ggml.token_type") or [])
    specials = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    backend.add_special_tokens(specials)
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED])

    def token(name: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{name}_token_id")
        return tokens[int(i)] if i is not None and int(i) < len(tokens) else None

    bos, eos = token("bos"), token("eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos) or (add_eos and eos):
        single = " ".join([f"{bos}:0"] * (add_bos and bool(bos)) + ["$A:0"] + [f"{eos}:0"] * (add_eos and bool(eos)))
        pair = single + " " + single.replace("$A", "$B").replace(":0", ":1")
        special = [(t, tokens.index(t)) for t in {bos, eos} if t and t in single]
        backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, unk_token=token("unknown"),
        pad_token=token("padding"), chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=add_bos, add_eos_token=add_eos, clean_up_tokenization_spaces=False,
    )


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str]):
    """GPT-2 style byte-level BPE (tokens are already spelled in the byte alphabet)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    backend = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    splits = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre", ""), [])
    gpt2 = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if splits == [_SMOLLM_DIGITS]:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), *gpt2])
    elif splits:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [*(pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        backend.pre_tokenizer = gpt2[0]
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str]):
    """SentencePiece BPE with byte fallback (`<0x0A>` tokens), as llama.cpp's `llama` vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        merges = merges_from_scores(tokens, list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    backend = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace("\u2581", prepend_scheme="first" if prefix else "never",
                                                     split=False)
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *strip])
    return backend


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by a vocabulary: each split of a token into two tokens, ranked by the
    token's score (then longer left piece, longer right piece), as transformers derives them."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in dict(zip(tokens, scores)).items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        merges += [(a, b, score) for a, b in sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]]))]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _llama3_factors(wavelen, factor: float, low: float, high: float, original: float):
    """llama.cpp's `rope_freqs` for Llama 3's RoPE scaling (its converter's formula): 1 for short wavelengths,
    `factor` for long ones, a smooth blend between."""
    import numpy as np

    smooth = (original / wavelen - low) / (high - low)
    blend = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, blend))


def llama3_rope_scaling(freq_divisors, theta: float, head_dim: int) -> dict[str, Any]:
    """The Llama 3 RoPE scaling that gives these per-frequency divisors (a GGUF's `rope_freqs` tensor, which
    llama.cpp writes instead of the parameters): `factor` is the largest divisor; in the blended band
    1/divisor is linear in the smoothing s = original/wavelength - low over (high - low), and a line through the
    band's points fixes original/(high - low) and low/(high - low), so low = 1 loses nothing. Raises
    ValueError where no such scaling reproduces the tensor."""
    import numpy as np

    refuse = ValueError("this GGUF's rope_freqs tensor is not a Llama 3 RoPE scaling jaxpaged can read: load the "
                        "model's HF folder instead")
    if freq_divisors is None or len(freq_divisors) != head_dim // 2:
        raise refuse
    f = np.asarray(freq_divisors, np.float64)
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    factor = float(f.max())
    band = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))
    if factor <= 1 or band.sum() < 2:
        raise refuse
    smooth = (1 / f[band] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(1 / wavelen[band], smooth, 1)  # smooth = slope / wavelen + intercept
    if slope <= 0 or intercept >= 0:
        raise refuse
    factor, high, original = round(factor, 4), round(1 - 1 / intercept, 4), int(round(slope / -intercept))
    if not np.allclose(_llama3_factors(wavelen, factor, 1.0, high, original), f, rtol=1e-4):
        raise refuse
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": high,
            "original_max_position_embeddings": original}
