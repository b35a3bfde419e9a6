"""Draft-model speculative decoding (`{"method": "draft_model", "model": PATH}`) through the engine, on tiny
random-weight models sharing a tokenizer: the same greedy tokens and logprobs as without it; a draft identical
to the target has nearly every draft accepted (its cache follows the target's through chunked prefill, prefix
hits, forks and rollbacks); sampled tokens keep their distribution; bad configurations fail before any
weights load."""

import time

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.kv_cache_sizing import num_kv_blocks
from tests.spec_decode.same_distribution import assert_same_distribution

K = 3
ENGINE = dict(max_num_batched_tokens=64, num_kv_blocks=160, compile_guard=True, max_model_len=512)


def spec_config(path: str, **extra) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": K, "adaptive": False, **extra}


def prompts(count: int, seed: int = 0, longest: int = 150) -> list[list[int]]:
    """Random token-id prompts, some longer than a step's token budget (chunked prefill), and a shared prefix
    for half of them (prefix-cache hits)."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 256, 48).tolist()
    out = []
    for i in range(count):
        own = rng.integers(3, 256, int(rng.integers(2, longest))).tolist()
        out.append(prefix + own if i % 2 else own)
    return out


def tokens(llm, ps, params):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params,
                                                          use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), **ENGINE)


@pytest.fixture(scope="module")
def small_draft(tiny_model_dir):
    """The target with a smaller draft model of another shape (1 layer, 1 KV head of 16)."""
    return LLM(tiny_model_dir("llama"), speculative_config=spec_config(tiny_model_dir("llama-draft")), **ENGINE)


@pytest.fixture(scope="module")
def self_draft(tiny_model_dir):
    """The target drafting for itself: greedy drafts are what it would generate, so all should be accepted."""
    path = tiny_model_dir("llama")
    return LLM(path, speculative_config=spec_config(path), **ENGINE)


def test_greedy_tokens_and_logprobs_identical(plain, small_draft):
    ps = prompts(12)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    before = small_draft.engine.stats.spec_num_draft_tokens
    a = plain.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    b = small_draft.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    for x, y in zip(a, b):
        ox, oy = x.outputs[0], y.outputs[0]
        assert oy.token_ids == ox.token_ids
        for lx, ly in zip(ox.logprobs, oy.logprobs):
            assert lx.keys() == ly.keys()
            assert all(abs(lx[t].logprob - ly[t].logprob) < 1e-4 for t in lx)
    assert small_draft.engine.stats.spec_num_draft_tokens - before > 100  # drafts were proposed and verified


def test_a_draft_equal_to_the_target_is_accepted_throughout(plain, self_draft):
    """Chunked prompts, prefix hits and every verification's rollback: the draft's cache must hold exactly the
    target's tokens at their positions, or its greedy drafts would stray from the target's tokens."""
    ps = prompts(12, seed=1)
    params = SamplingParams(temperature=0, max_tokens=41, ignore_eos=True)
    st = self_draft.engine.stats
    drafts, accepted = st.spec_num_draft_tokens, st.spec_num_accepted_tokens
    hits = self_draft.engine.kv_cache_manager.num_hit_tokens
    assert tokens(self_draft, ps, params) == tokens(plain, ps, params)
    assert self_draft.engine.kv_cache_manager.num_hit_tokens - hits >= 5 * 48  # the shared prefix was found
    rate = (st.spec_num_accepted_tokens - accepted) / (st.spec_num_draft_tokens - drafts)
    assert rate > 0.97, rate
    # 40 tokens after the prompt's own come in 10 steps of K + 1
    assert st.mean_acceptance_length > K + 0.9


def test_n_samples_and_forks(plain, self_draft):
    """n > 1 siblings fork from the first (shared blocks, copy-on-write, in both pools): the outputs stay the
    plain engine's, and the siblings' drafts stay accepted (their draft caches were copied with the blocks)."""
    ps = prompts(3, seed=2)
    params = SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True)
    st = self_draft.engine.stats
    drafts, accepted = st.spec_num_draft_tokens, st.spec_num_accepted_tokens
    a = plain.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    b = self_draft.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
    rate = (st.spec_num_accepted_tokens - accepted) / (st.spec_num_draft_tokens - drafts)
    assert rate > 0.97, rate


def test_preemption_with_a_draft_model(tiny_model_dir):
    """A pool too small for the batch (its lookahead slots included): requests are preempted and recomputed;
    the greedy tokens stay those of the plain engine."""
    small = dict(ENGINE, num_kv_blocks=24)
    ps = prompts(10, seed=3, longest=40)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    spec = LLM(tiny_model_dir("llama"), speculative_config=spec_config(tiny_model_dir("llama-draft")), **small)
    got = tokens(spec, ps, params)
    assert spec.engine.scheduler.num_preemptions > 0 and spec.engine.stats.spec_num_draft_tokens > 0
    del spec
    assert got == tokens(LLM(tiny_model_dir("llama"), **small), ps, params)


def test_sampled_tokens_follow_the_same_distribution(plain, self_draft):
    """Seeded samples at temperature 1 with and without draft-model speculation: the tokens at each output
    position have the same distribution (chi-square on a contingency table, rare tokens pooled)."""
    prompt = {"prompt_token_ids": [17, 42, 99, 5, 61, 8]}
    n = 1200
    params = [SamplingParams(temperature=1.0, top_k=4, max_tokens=4, ignore_eos=True, seed=s) for s in range(n)]
    drafts = self_draft.engine.stats.spec_num_draft_tokens
    a = np.array([o.outputs[0].token_ids for o in plain.generate([prompt] * n, params, use_tqdm=False)])
    b = np.array([o.outputs[0].token_ids for o in self_draft.generate([prompt] * n, params, use_tqdm=False)])
    assert self_draft.engine.stats.spec_num_draft_tokens - drafts > n
    assert_same_distribution(a, b, range(1, 4))


def test_the_pool_holds_both_models_kv(tiny_model_dir, plain, small_draft):
    """Each block holds the target's and the draft's KV: a byte budget gives fewer blocks with a draft."""
    target, draft = plain.engine.config.model_config, small_draft.engine.config.draft_model_config
    args = EngineArgs(kv_cache_memory="1MiB")
    alone = num_kv_blocks(args, target, 16, 0)
    both = num_kv_blocks(args, target, 16, 0, draft)
    per_token = target.kv_bytes_per_token("float32"), draft.kv_bytes_per_token("float32")
    assert both == 2**20 // ((per_token[0] + per_token[1]) * 16) < alone
    assert small_draft.engine.config.scheduler_config.num_lookahead_tokens == K


@pytest.mark.parametrize("bad, field", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "draft_model", "model": "/no/such/model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "prompt_lookup_max"),
    ({"model": "BYTES", "num_speculative_tokens": 2}, "tokenizer"),
])
def test_bad_draft_configs_fail_before_weights_load(bad, field, tiny_model_dir):
    if bad.get("model") == "BYTES":  # a model on another tokenizer
        bad = dict(bad, model=tiny_model_dir("llama-bytes"))
    start = time.perf_counter()
    with pytest.raises(ValueError, match=field):
        LLM(tiny_model_dir("llama"), speculative_config=bad)
    assert time.perf_counter() - start < 5  # no weights, no compile


def test_draft_model_with_tiers_or_swap_is_refused(tiny_model_dir):
    """The offload tiers and swap move the target's KV only: refused with a draft model, before loading."""
    spec = spec_config(tiny_model_dir("llama-draft"))
    for extra in ({"kv_offload_host_gb": 1}, {"preemption_mode": "swap"}):
        with pytest.raises(ValueError, match="speculative_config.model"):
            LLM(tiny_model_dir("llama"), speculative_config=spec, **extra)
