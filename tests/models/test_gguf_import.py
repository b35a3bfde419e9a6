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
    for key, value in {"llama.block_count": 1, "llama.context_length": 256, "llama.embedding_length": 16,
                       "llama.feed_forward_length": 32, "llama.attention.head_count": 2,
                       "llama.attention.head_count_kv": 1, "llama.rope.freq_base": 10000.0,
                       "llama.attention.layer_norm_rms_epsilon": 1e-5}.items():
        (w.add_uint32 if isinstance(value, int) else w.add_float32)(key, value)
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_scores(meta["tokenizer.ggml.scores"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("output_norm.weight", np.ones(16, np.float32))
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
