"""GGUF config + tokenizer without torch: equal to what transformers' (torch) GGUF path builds, and cached."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxpaged.models import gguf_import, registry

TEXTS = [
    "What is the capital of France?", "1, 2, 3, 12345 and 3.14159", "  leading spaces\tand tabs\n\nnew lines",
    "Ünïcödé façade — naïve café, 日本語のテキスト, emoji 🙂🚀", "don't I'll we've THEY'RE", "x" * 40,
    "<|im_start|>user\nhi<|im_end|>", "code: def f(x):\n    return x**2  # square",
]


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXPAGED_GGUF_CACHE", str(tmp_path / "gguf-cache"))


@pytest.fixture(scope="module")
def smollm2_path():
    try:
        return registry.default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def transformers_gguf(path: str):
    """transformers' own GGUF config and tokenizer (its path needs torch)."""
    pytest.importorskip("torch")
    from transformers import AutoConfig, AutoTokenizer

    folder, name = os.path.dirname(path), os.path.basename(path)
    return AutoConfig.from_pretrained(folder, gguf_file=name), AutoTokenizer.from_pretrained(folder, gguf_file=name)


def assert_same_tokenizer(ours, ref, texts=TEXTS):
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text
    assert (ours.bos_token, ours.eos_token, ours.unk_token) == (ref.bos_token, ref.eos_token, ref.unk_token)
    assert len(ours) == len(ref)


def test_default_model_matches_transformers(smollm2_path):
    ref_config, ref_tok = transformers_gguf(smollm2_path)
    ours = registry.model_config_from_hf(smollm2_path, registry.load_hf_config(smollm2_path), "float32")
    assert ours == registry.model_config_from_hf(smollm2_path, ref_config, "float32")
    tok = registry.load_tokenizer(smollm2_path)
    assert_same_tokenizer(tok, ref_tok)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Capital of France?"}]
    for gen in (True, False):
        assert (tok.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
                == ref_tok.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False))


def test_folder_is_built_once(smollm2_path, monkeypatch):
    folder = gguf_import.gguf_hf_folder(smollm2_path)
    assert sorted(os.listdir(folder))[:3] == ["chat_template.jinja", "config.json", "generation_config.json"]

    def fail(path):
        raise AssertionError("read the GGUF metadata again instead of the cached folder")
    monkeypatch.setattr(gguf_import, "read_metadata", fail)
    assert gguf_import.gguf_hf_folder(smollm2_path) == folder
    registry.load_tokenizer(smollm2_path)


NO_TORCH = textwrap.dedent("""
    import sys
    sys.modules["torch"] = None  # import torch fails; transformers believes torch is not installed
    from jaxpaged.models import registry
    path = registry.default_model_path()
    {body}
""")


def run_without_torch(body: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TORCH.format(body=body)], capture_output=True, text=True,
                          timeout=300, env={**os.environ})


def test_default_model_config_and_tokenizer_load_without_torch(smollm2_path):
    got = run_without_torch("cfg = registry.model_config_from_hf(path, registry.load_hf_config(path), 'float32')\n"
                            "tok = registry.load_tokenizer(path)\n"
                            "print(cfg.num_layers, tok.decode(tok.encode('The capital of France')))")
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.strip() == "30 The capital of France"
    # the control: transformers' own GGUF reader cannot work here, so the test above proves the torch-free path
    control = run_without_torch("import os; from transformers import AutoConfig\n"
                                "AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))")
    assert control.returncode != 0


def sentencepiece_metadata() -> dict:
    """llama.cpp `llama` (SentencePiece BPE) tokenizer metadata: specials, 256 byte tokens, a trained vocabulary
    with scores and no merges (as Llama 2 / Mistral GGUFs store it)."""
    from tokenizers import SentencePieceBPETokenizer

    trainer = SentencePieceBPETokenizer(unk_token="<unk>")
    trainer.train_from_iterator(TEXTS * 20 + ["the quick brown fox jumps over the lazy dog"] * 50, vocab_size=400,
                                special_tokens=["<unk>", "<s>", "</s>"])
    trained = [t for t, _ in sorted(trainer.get_vocab().items(), key=lambda kv: kv[1])][3:]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + trained
    types = [2, 3, 3] + [6] * 256 + [1] * len(trained)
    scores = [0.0] * 259 + [-float(i) for i in range(len(trained))]
    return {"general.architecture": "llama", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}


def write_gguf(path: str, meta: dict) -> None:
    """A llama GGUF with this tokenizer metadata, a 1-layer config and one small tensor."""
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    add_config_and_tokenizer(w, "llama", {"block_count": 1, "context_length": 256, "embedding_length": 16,
                                          "feed_forward_length": 32, "attention.head_count": 2,
                                          "attention.head_count_kv": 1, "rope.freq_base": 10000.0,
                                          "attention.layer_norm_rms_epsilon": 1e-5}, meta)
    w.add_tensor("output_norm.weight", np.ones(16, np.float32))
    finish_gguf(w)


def add_config_and_tokenizer(w, arch: str, hparams: dict, meta: dict) -> None:
    """`{arch}.KEY` hyperparameters (ints as uint32, floats as float32) and the tokenizer `meta` describes, with
    BOS 1, EOS 2 and UNK 0."""
    for key, value in hparams.items():
        (w.add_uint32 if isinstance(value, int) else w.add_float32)(f"{arch}.{key}", value)
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_scores(meta["tokenizer.ggml.scores"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def finish_gguf(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_sentencepiece_gguf_tokenizer_matches_transformers(tmp_path):
    path = str(tmp_path / "spm.gguf")
    write_gguf(path, sentencepiece_metadata())
    _, ref = transformers_gguf(path)
    ours = registry.load_tokenizer(path)
    assert_same_tokenizer(ours, ref, TEXTS + ["the lazy dog", " the lazy dog", "unseen ∑ symbols ✓"])
    assert ours.encode("the fox")[0] == 1  # BOS, as llama.cpp adds for a sentencepiece vocabulary
    assert "<0xE2>" in ours.convert_ids_to_tokens(ours.encode("∑"))  # byte fallback


def test_eos_lists_end_of_turn_tokens():
    meta = {"tokenizer.ggml.eos_token_id": 128001, "tokenizer.ggml.eot_token_id": 128009}
    assert gguf_import.eos_token_ids(meta) == [128001, 128009]


def test_unsupported_gguf_architecture_is_named():
    with pytest.raises(ValueError, match="'phi3'"):
        gguf_import.hf_config_dict({"general.architecture": "phi3", "tensor_names": []})


def write_model_gguf(hf_model, path: str, arch: str) -> None:
    """An HF model as llama.cpp's converter writes it: float32 tensors under GGUF names, q/k rows permuted for
    interleaved RoPE where the architecture is `llama` (not for qwen2/qwen3, which run rotate-half RoPE), the
    sentencepiece tokenizer above."""
    import gguf

    c = hf_model.config
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf_model.state_dict().items()}
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    theta = getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]

    def permute(x: np.ndarray, heads: int) -> np.ndarray:  # (llama.cpp's LlamaModel.permute)
        return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    w = gguf.GGUFWriter(path, arch)
    add_config_and_tokenizer(w, arch, {
        "block_count": c.num_hidden_layers, "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads, "attention.head_count_kv": c.num_key_value_heads,
        "attention.key_length": d, "attention.value_length": d, "rope.freq_base": float(theta),
        "attention.layer_norm_rms_epsilon": float(c.rms_norm_eps)}, sentencepiece_metadata())
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    rope = getattr(c, "rope_parameters", None) or {}
    if rope.get("rope_type") == "llama3":  # (llama.cpp's converter: the scaling as per-frequency divisors; written
        # out here, not from gguf_import._llama3_factors, so the reader is held to llama.cpp, not to itself)
        factors, low, high = [], rope["low_freq_factor"], rope["high_freq_factor"]
        for freq in 1.0 / theta ** (np.arange(0, d, 2) / d):
            wavelen, old = 2 * np.pi / freq, rope["original_max_position_embeddings"]
            if wavelen < old / high:
                factors.append(1.0)
            elif wavelen > old / low:
                factors.append(rope["factor"])
            else:
                smooth = (old / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
        w.add_tensor("rope_freqs.weight", np.asarray(factors, np.float32))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not c.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.o_proj.weight": "attn_output.weight", "self_attn.v_proj.weight": "attn_v.weight",
             "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
             "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
             "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias"}
    for i in range(c.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            x = sd.get(f"model.layers.{i}.{hf_name}")
            if x is None:
                continue
            if arch == "llama" and gguf_name.startswith(("attn_q.", "attn_k.")):
                x = permute(x, c.num_attention_heads if gguf_name.startswith("attn_q.") else c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gguf_name}", x)
    finish_gguf(w)


@pytest.mark.parametrize("tiny,arch", [("llama-tied", "llama"), ("llama", "llama"), ("qwen2", "qwen2"),
                                       ("qwen3", "qwen3")])  # ("llama": Llama 3's RoPE scaling, as rope_freqs)
def test_gguf_weights_give_the_hf_models_logits(tmp_path, tiny, arch):
    """A GGUF written as llama.cpp writes each architecture loads into the same model: llama's q/k rows are
    un-permuted, qwen2's and qwen3's (rotate-half RoPE in llama.cpp) are not, qwen2's biases and qwen3's q/k
    norms are read."""
    torch = pytest.importorskip("torch")
    import transformers

    from jaxpaged.models import build_model, model_config_from_hf
    from tests.reference import hf_last_logits, our_last_logits_batch
    from tests.tiny_models import tiny_config

    torch.manual_seed(0)
    config = tiny_config(tiny)
    config.vocab_size = len(sentencepiece_metadata()["tokenizer.ggml.tokens"])
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # (biases and norms away from their zero / one inits, so a misread one shows)
        for name, p in hf.named_parameters():
            if name.endswith(("bias", "q_norm.weight", "k_norm.weight")):
                p.add_(torch.randn_like(p) * 0.3)
    path = str(tmp_path / f"{tiny}.gguf")
    write_model_gguf(hf, path, arch)
    if arch != "qwen3" and tiny != "llama":  # (the writer's layout is the one transformers' GGUF reader expects;
        # it reads no Qwen3 and no rope_freqs here)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path),
                                                                   dtype=torch.float32).eval()
        np.testing.assert_array_equal(hf_last_logits(theirs, [5, 9, 30]), hf_last_logits(hf, [5, 9, 30]))
    cfg = model_config_from_hf(path, registry.load_hf_config(path), "float32")
    assert (cfg.qkv_bias, cfg.qk_norm) == (arch == "qwen2", arch == "qwen3")
    if tiny == "llama":  # (the parameters read back from the divisors)
        want = {k: config.rope_parameters[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                       "original_max_position_embeddings")}
        assert {k: cfg.rope_scaling[k] for k in want} == want
    model = build_model(cfg, per_layer=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config.vocab_size, size=n).tolist() for n in (1, 7, 40)]
    for ids, ours in zip(prompts, our_last_logits_batch(model, prompts)):
        np.testing.assert_allclose(ours, hf_last_logits(hf, ids), atol=1e-4)


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1 / 3.3 and Llama 3.2
def test_llama3_rope_scaling_is_read_back_from_rope_freqs(factor):
    theta, d = 500000.0, 128
    wavelen = 2 * np.pi * theta ** (np.arange(0, d, 2) / d)
    divisors = gguf_import._llama3_factors(wavelen, factor, 1.0, 4.0, 8192).astype(np.float32)
    assert gguf_import.llama3_rope_scaling(divisors.tolist(), theta, d) == {
        "rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    for bad in ([1.0] * (d // 2), divisors[:-1].tolist(), (divisors * np.linspace(1, 1.5, d // 2)).tolist()):
        with pytest.raises(ValueError, match="rope_freqs"):
            gguf_import.llama3_rope_scaling(bad, theta, d)
