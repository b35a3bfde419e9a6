"""`jaxpaged.functional`: pure jitted generation equals HF transformers and the engine, token for token."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged import functional as F
from jaxpaged.runner.compilation import CompileGuard
from tests.reference import chat_prompt_ids, hf_greedy
from tests.tiny_models import load_hf_model

PROMPT_LENS = [1, 5, 17, 40, 33, 64]
NEW = 24


def batch(seed: int = 0, lens=PROMPT_LENS):
    """Prompts of different lengths as right-padded tokens [B, P] and lengths [B]."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in lens]
    return prompts, *F.pad_batch(prompts)


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    path = tiny_model_dir("llama")
    return path, *F.load(path)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "mistral-window"])
def test_greedy_generate_under_jit_matches_hf(arch, tiny_model_dir):
    path = tiny_model_dir(arch)
    config, params = F.load(path)
    prompts, tokens, lengths = batch()
    gen = jax.jit(F.generate, static_argnums=0, static_argnames=("max_new_tokens", "eos_id"))
    out = np.asarray(gen(config, params, tokens, lengths, jax.random.key(0), max_new_tokens=NEW))
    hf = load_hf_model(path)
    for row, ids in zip(out, prompts):
        assert row.tolist() == hf_greedy(hf, ids, NEW), f"{arch}: prompt of {len(ids)} tokens"


def test_greedy_generate_matches_llm_generate(llama):
    path, config, params = llama
    prompts, tokens, lengths = batch(1)
    out = np.asarray(F.generate(config, params, tokens, lengths, jax.random.key(0), max_new_tokens=NEW))
    llm = LLM(path, max_num_batched_tokens=128, num_kv_blocks=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == out.tolist()


def test_smollm2_matches_llm_generate(smollm2_path):
    path = smollm2_path
    config, params = F.load(path)
    tok = F.load_tokenizer(path)
    questions = ["What is the capital of France?", "List three prime numbers.", "Write a haiku about the sea."]
    prompts = [chat_prompt_ids(tok, q) for q in questions]
    tokens, lengths = F.pad_batch(prompts)
    eos = config.eos_token_ids
    out = np.asarray(F.generate(config, params, tokens, lengths, jax.random.key(0), max_new_tokens=32, eos_id=eos))
    llm = LLM(path, max_num_batched_tokens=128, num_kv_blocks=128, max_model_len=512)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    for row, o in zip(out.tolist(), outs):
        want = o.outputs[0].token_ids
        assert row[: len(want)] == want
        assert all(t == eos[0] for t in row[len(want):])  # padded after EOS
    assert "Paris" in tok.decode(out[0])


def test_prefill_then_scanned_decode_equals_generate(llama):
    """A researcher's loop: prefill, then decode under lax.scan recording every step's logits."""
    _, config, params = llama
    _, tokens, lengths = batch(2)
    want = np.asarray(F.generate(config, params, tokens, lengths, jax.random.key(0), max_new_tokens=NEW))

    @jax.jit
    def run(params, tokens, lengths):
        cache = F.init_cache(config, num_seqs=tokens.shape[0], max_len=tokens.shape[1] + NEW)
        logits, cache = F.prefill(config, params, cache, tokens, lengths)

        def step(carry, _):
            logits, cache = carry
            token = jnp.argmax(logits, -1).astype(jnp.int32)
            logits, cache = F.decode(config, params, cache, token)
            return (logits, cache), (token, logits)

        (_, cache), (toks, all_logits) = jax.lax.scan(step, (logits, cache), length=NEW)
        return toks.T, all_logits, cache.lengths

    toks, all_logits, final_lengths = run(params, tokens, lengths)
    assert np.asarray(toks).tolist() == want.tolist()
    assert all_logits.shape == (NEW, tokens.shape[0], config.vocab_size)
    assert np.asarray(final_lengths).tolist() == (np.asarray(lengths) + NEW).tolist()


def test_prefill_appends_to_a_filled_cache(llama):
    """Prefilling a prompt in two parts (the second over cached context; one row adds nothing) gives the
    logits of prefilling it whole, and the same decode after."""
    _, config, params = llama
    prompts, tokens, lengths = batch(3, [30, 7, 50, 12])
    cut = jnp.asarray([13, 7, 1, 0], jnp.int32)  # row 1: all in the first part; row 3: all in the second

    def fresh():
        return F.init_cache(config, num_seqs=4, max_len=80)

    whole, whole_cache = F.prefill(config, params, fresh(), tokens, lengths)
    first = jnp.where(jnp.arange(tokens.shape[1])[None, :] < cut[:, None], tokens, 0)
    _, cache = F.prefill(config, params, fresh(), first, cut)
    rest = np.zeros_like(np.asarray(tokens))
    for i, (p, c) in enumerate(zip(prompts, np.asarray(cut))):
        rest[i, : len(p) - c] = p[c:]
    logits, cache = F.prefill(config, params, cache, jnp.asarray(rest), lengths - cut)
    assert np.asarray(cache.lengths).tolist() == np.asarray(lengths).tolist()
    got, want = np.asarray(logits), np.asarray(whole)
    np.testing.assert_allclose(got[[0, 2, 3]], want[[0, 2, 3]], atol=1e-4)
    assert not got[1].any()  # no new tokens: zero logits
    nxt = jnp.asarray(np.argmax(want, -1), jnp.int32)
    a, _ = F.decode(config, params, cache, nxt)
    b, _ = F.decode(config, params, whole_cache, nxt)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


def test_sampling_reproducible_for_a_key(llama):
    _, config, params = llama
    _, tokens, lengths = batch(4)
    kw = dict(max_new_tokens=NEW, temperature=1.0, top_k=20, top_p=0.9)
    a = np.asarray(F.generate(config, params, tokens, lengths, jax.random.key(7), **kw))
    b = np.asarray(F.generate(config, params, tokens, lengths, jax.random.key(7), **kw))
    c = np.asarray(F.generate(config, params, tokens, lengths, jax.random.key(8), **kw))
    greedy = np.asarray(F.generate(config, params, tokens, lengths, jax.random.key(7), max_new_tokens=NEW))
    assert (a == b).all()
    assert (a != c).any() and (a != greedy).any()
    top1 = F.generate(config, params, tokens, lengths, jax.random.key(7), max_new_tokens=NEW, temperature=1.0, top_k=1)
    assert (np.asarray(top1) == greedy).all()  # top-k 1 keeps only the argmax
    per_row = jnp.asarray([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])  # per-row temperatures: greedy rows stay greedy
    mixed = np.asarray(F.generate(config, params, tokens, lengths, jax.random.key(7), max_new_tokens=NEW,
                                  temperature=per_row))
    assert (mixed[::2] == greedy[::2]).all() and (mixed[1::2] != greedy[1::2]).any()


def test_eos_ends_each_row_and_pads_after(llama):
    _, config, params = llama
    _, tokens, lengths = batch(5)
    greedy = np.asarray(F.generate(config, params, tokens, lengths, jax.random.key(0), max_new_tokens=NEW))
    stop = [int(greedy[0, 4]), int(greedy[1, 9])]  # two EOS ids: row 0 ends at step 4 at the latest
    out = np.asarray(F.generate(config, params, tokens, lengths, jax.random.key(0), max_new_tokens=NEW,
                                eos_id=stop))
    for row, ref in zip(out, greedy):
        hits = [i for i, t in enumerate(ref) if t in stop]
        end = hits[0] + 1 if hits else NEW
        assert row[:end].tolist() == ref[:end].tolist()
        assert (row[end:] == stop[0]).all()


def test_generate_is_one_compiled_call_without_host_transfers(llama):
    """Compiled once per shape; a second call with other values compiles nothing and moves nothing between
    host and device until its result is read; the program is one while loop with no host callbacks."""
    _, config, params = llama
    _, tokens, lengths = batch(6)
    key = jax.random.key(0)
    F.generate(config, params, tokens, lengths, key, max_new_tokens=NEW).block_until_ready()
    guard = CompileGuard()
    args = (config, params, (tokens + 1) % 256, lengths, jax.random.key(1))  # on the device, as the settings:
    settings = dict(temperature=jnp.float32(0.5), top_k=jnp.int32(3), top_p=jnp.float32(0.9))
    F.generate(*args, max_new_tokens=NEW, **settings).block_until_ready()  # (compiles: argument types differ)
    settings = dict(temperature=jnp.float32(0.7), top_k=jnp.int32(0), top_p=jnp.float32(1.0))
    with guard.watch(), jax.transfer_guard("disallow"):
        out = F.generate(*args, max_new_tokens=NEW, **settings)
        out.block_until_ready()
    jaxpr = str(jax.make_jaxpr(lambda t: F.generate(config, params, t, lengths, key, max_new_tokens=NEW))(tokens))
    assert "while[" in jaxpr
    assert "callback" not in jaxpr


def test_pallas_backends_in_the_interpreter_match_reference(llama):
    _, config, params = llama
    _, tokens, lengths = batch(7, [3, 20, 9])
    pallas = dataclasses.replace(config, attention_backend="pallas-interpret", sampler_backend="pallas-interpret")
    kw = dict(max_new_tokens=8)
    want = np.asarray(F.generate(config, params, tokens, lengths, jax.random.key(0), **kw))
    got = np.asarray(F.generate(pallas, params, tokens, lengths, jax.random.key(0), **kw))
    assert (got == want).all()
    sampled = F.generate(pallas, params, tokens, lengths, jax.random.key(0), temperature=1.0, top_k=5, **kw)
    assert np.asarray(sampled).shape == (3, 8)


def test_bad_arguments_raise_before_work(llama):
    _, config, params = llama
    _, tokens, lengths = batch(8)
    with pytest.raises(ValueError, match="max_new_tokens"):
        F.generate(config, params, tokens, lengths, jax.random.key(0), max_new_tokens=0)
    with pytest.raises(ValueError, match="lengths"):
        F.generate(config, params, tokens, lengths[:2], jax.random.key(0), max_new_tokens=4)
    with pytest.raises(ValueError, match="lengths"):
        F.generate(config, params, tokens, np.full(tokens.shape[0], tokens.shape[1] + 1), jax.random.key(0),
                   max_new_tokens=4)
    with pytest.raises(ValueError, match="max_len"):
        F.init_cache(config, num_seqs=2, max_len=10_000)
    with pytest.raises(ValueError, match="block_size"):
        F.init_cache(config, num_seqs=2, max_len=64, block_size=12)
    with pytest.raises(ValueError, match="dtype"):
        F.load("unused", dtype="float64")
    with pytest.raises(ValueError, match="non-empty"):
        F.pad_batch([[1, 2], []])


def test_bench_functional_compares_with_the_engine(tiny_model_dir, tmp_path, capsys):
    from jaxpaged.cli import build_parser

    out = tmp_path / "functional.json"
    ns = build_parser().parse_args(["bench", "functional", "--model", tiny_model_dir("llama"), "--num-prompts", "3",
                                    "--input-len", "20", "--output-len", "6", "--max-num-batched-tokens", "64",
                                    "--output-json", str(out)])
    ns.func(ns)
    engine, functional = json.loads(out.read_text())
    assert (engine["backend"], functional["backend"]) == ("LLM.generate", "functional.generate")
    assert functional["rows_equal_to_engine"] == 3
    assert functional["output_tokens_per_s"] > 0 and engine["output_tokens_per_s"] > 0
    assert "greedy rows equal: 3/3" in capsys.readouterr().out


def test_generate_lowers_for_cuda_with_the_pallas_kernels(llama):
    """On a GPU `generate` runs the Pallas attention and sampling kernels: the whole program lowers for CUDA."""
    from tests.kernels.cuda_lowering import lower_for_cuda

    _, config, params = llama
    _, tokens, lengths = batch(9, [3, 20])
    gpu = dataclasses.replace(config, attention_backend="pallas", sampler_backend="pallas")
    text = lower_for_cuda(lambda p, t, n, k: F.generate(gpu, p, t, n, k, max_new_tokens=4, temperature=1.0),
                          params, tokens, lengths, jax.random.key(0))
    assert "ragged_paged_attention" in text and "top_k_top_p" in text
