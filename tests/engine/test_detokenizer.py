"""Incremental detokenization: deltas add up to the full decode, for byte-level BPE and SentencePiece-style BPE."""

import numpy as np
import pytest

from jaxpaged.engine.detokenizer import IncrementalDetokenizer, decode_output

TEXTS = [
    "Hello, world! Ünïcödé façade — naïve café, 日本語のテキスト, emoji 🙂🚀👩‍💻 and more.",
    "Multi-byte: Привет мир, γειά σου κόσμε, مرحبا بالعالم, 한국어 문장, ✓✗ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢.",
    "   leading spaces, tabs\tand\nnew lines\n\n  indented 🙂",
]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from jaxpaged.models import default_model_path, load_tokenizer

    try:
        return load_tokenizer(default_model_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """A SentencePiece-style BPE (metaspace, byte fallback) trained offline on a little text."""
    from tokenizers import SentencePieceBPETokenizer
    from transformers import PreTrainedTokenizerFast

    tok = SentencePieceBPETokenizer(unk_token="<unk>")
    corpus = TEXTS * 20 + ["the quick brown fox jumps over the lazy dog"] * 50
    tok.train_from_iterator(corpus, vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def stream(tokenizer, prompt_ids, output_ids, rng):
    det = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas, i = [], 0
    while i < len(output_ids):
        k = int(rng.integers(1, 4))  # one to three tokens per step
        deltas.append(det.add_tokens(output_ids[i : i + k]))
        i += k
    deltas.append(det.flush())
    assert "".join(deltas) == det.text
    return det.text


@pytest.mark.parametrize("which", ["smollm2_tokenizer", "sentencepiece_tokenizer"])
def test_deltas_concatenate_to_the_full_decode(which, request):
    tok = request.getfixturevalue(which)
    rng = np.random.default_rng(0)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        full = tok.decode(ids)
        cuts = [c for c in range(1, len(ids)) if full.startswith(tok.decode(ids[:c]))]  # prompts of whole chars
        assert len(cuts) > len(ids) // 2
        for cut in cuts[:: max(1, len(cuts) // 6)]:
            prompt, out = ids[:cut], ids[cut:]
            got = stream(tok, prompt, out, rng)
            assert got == full[len(tok.decode(prompt)):]
            assert "\ufffd" not in got
            assert decode_output(tok, prompt, out) == got  # the one-shot decode of FINAL_ONLY outputs


def test_no_replacement_character_mid_stream(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("🙂🚀👩‍💻", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [])
    for t in ids:
        assert "\ufffd" not in det.add_tokens([t])
    det.flush()
    assert det.text == "🙂🚀👩‍💻"
