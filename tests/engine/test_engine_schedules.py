"""The same greedy outputs under any schedule: block sizes, chunked prefill, preemption, late arrivals."""

import numpy as np
import pytest

from jaxpaged import LLM, LLMEngine, SamplingParams
from jaxpaged.engine.arg_utils import EngineArgs
from tests.reference import hf_greedy
from tests.tiny_models import load_hf_model

NEW_TOKENS = 24


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(3, 256, size=n).tolist() for n in (3, 15, 16, 33, 47, 70)]


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    hf = load_hf_model(tiny_model_dir("llama"))
    return [hf_greedy(hf, p, NEW_TOKENS) for p in prompts()]


@pytest.fixture(params=[True, False], ids=["async", "sync"])
def mode(request) -> dict:
    """Each schedule runs with async scheduling (the default) and without: greedy outputs must be equal."""
    return {"async_scheduling": request.param}


def run(path, **engine_args):
    engine_args.setdefault("max_num_batched_tokens", 128)  # (every prompt whole; few step buckets to compile)
    llm = LLM(path, compile_guard=True, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts(), params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("block_size", [16, 32])
def test_block_sizes(block_size, tiny_model_dir, expected, mode):
    llm, got = run(tiny_model_dir("llama"), block_size=block_size, num_kv_blocks=64, **mode)
    assert got == expected
    assert llm.engine.kv_cache_manager.num_free_blocks == 63  # everything freed


def test_chunked_prefill_small_budget(tiny_model_dir, expected, mode):
    llm, got = run(tiny_model_dir("llama"), max_num_batched_tokens=32, num_kv_blocks=64, **mode)
    assert got == expected
    assert llm.engine.stats.num_steps > NEW_TOKENS  # prompts really were split over steps


@pytest.mark.parametrize("policy", ["sjf", "hybrid"])
def test_policies_keep_outputs(tiny_model_dir, expected, mode, policy):
    """Another order of admission and preemption victims changes no greedy output."""
    llm, got = run(tiny_model_dir("llama"), num_kv_blocks=13, max_num_batched_tokens=64, scheduling_policy=policy,
                   **mode)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected


def test_preemption_keeps_outputs(tiny_model_dir, expected, mode):
    # 12 usable blocks of 16 tokens: the six requests (up to 94 tokens each) cannot all fit.
    llm, got = run(tiny_model_dir("llama"), num_kv_blocks=13, max_num_batched_tokens=64, **mode)
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert llm.engine.kv_cache_manager.num_free_blocks == 12


@pytest.mark.parametrize("swap_space", [1e-3, 1.2e-5])  # room for all swapped blocks; for one block (recompute)
def test_swap_preemption_keeps_outputs(tiny_model_dir, expected, swap_space, mode):
    """Preempted requests' blocks go to host memory and come back; where host space is short, recompute."""
    llm, got = run(tiny_model_dir("llama"), num_kv_blocks=13, max_num_batched_tokens=64, preemption_mode="swap",
                   swap_space=swap_space, **mode)
    sched, kv = llm.engine.scheduler, llm.engine.kv_cache_manager
    assert sched.num_preemptions > 0
    if swap_space > 1e-4:
        assert sched.num_swaps == sched.num_preemptions  # every preemption swapped
    else:
        assert kv.num_host_blocks == 1 and sched.num_swaps < sched.num_preemptions  # some had to recompute
    assert got == expected
    assert kv.num_free_blocks == 12 and len(kv.host_free) == kv.num_host_blocks  # both pools whole again


def test_max_num_seqs_limits_the_batch(tiny_model_dir, expected, mode):
    llm, got = run(tiny_model_dir("llama"), max_num_seqs=2, num_kv_blocks=64, **mode)
    assert got == expected


@pytest.mark.parametrize("prefill_cap", [0, 4])
def test_requests_arriving_while_others_decode(tiny_model_dir, expected, mode, prefill_cap):
    """prefill_cap 4: beside decodes, prompts get 4 tokens plus what fills the 16-token bucket, so no step
    outgrows 16 tokens; outputs are the same."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_model_dir("llama"), num_kv_blocks=64,
                                                   compile_guard=True, max_num_batched_tokens=64,
                                                   max_prefill_tokens_with_decodes=prefill_cap, **mode))
    sizes = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: (out := schedule(), sizes.append(out.total_num_scheduled_tokens))[0]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    pending = list(enumerate(prompts()))
    results = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new request every third step, while others are mid-decode
            i, p = pending.pop(0)
            engine.add_request(str(i), p, params)
        for out in engine.step():
            if out.finished:
                results[int(out.request_id)] = out.outputs[0].token_ids
        step += 1
    assert [results[i] for i in range(len(expected))] == expected
    assert (max(sizes) <= 16) == bool(prefill_cap)


def test_seeded_sampling_is_independent_of_batch(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), num_kv_blocks=64, compile_guard=True, max_num_batched_tokens=128)
    seeded = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompts()[2]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.7, max_tokens=16, ignore_eos=True)
    batch = llm.generate(prompts(), [others, others, seeded, others, others, others], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    unseeded = llm.generate([prompts()[2]] * 2, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_stop_conditions(tiny_model_dir, expected):
    llm = LLM(tiny_model_dir("llama"), num_kv_blocks=64, compile_guard=True, max_num_batched_tokens=128)
    p, ref = prompts()[0], expected[0]
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref[:5] and out.outputs[0].finish_reason == "length"
    stop_tok = ref[3]
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0]
    first = ref.index(stop_tok)
    assert out.outputs[0].token_ids == ref[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok


def test_eos_comes_from_the_generation_config(tiny_model_dir, tmp_path):
    """config.json says EOS is 2; generation_config.json lists 7 and 9 (as Llama 3 lists two): the latter wins,
    and generation stops at either."""
    import json
    import shutil

    path = shutil.copytree(tiny_model_dir("llama"), tmp_path / "model")
    with open(path / "generation_config.json", "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [7, 9]}, f)
    llm = LLM(str(path), num_kv_blocks=64, max_num_batched_tokens=32)
    assert llm.engine.config.model_config.eos_token_ids == (7, 9)
    out = llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=8, logit_bias={9: 100.0}),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [9] and out.finish_reason == "stop"


def test_bad_input_raises_named_errors(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[1] * 128], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[300]], use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(TypeError, match="blok_size"):
        LLM(tiny_model_dir("llama"), blok_size=16)
    assert not llm.engine.has_unfinished_requests()


def test_compile_guard_fails_a_step_that_compiles(tiny_model_dir):
    import jax

    llm = LLM(tiny_model_dir("llama"), num_kv_blocks=64, compile_guard=True, max_num_batched_tokens=128)
    with pytest.raises(RuntimeError, match="compiled"):
        with llm.engine.runner.guard.watch():
            jax.jit(lambda x: x * 3)(np.ones(7))
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)  # a normal step stays quiet


@pytest.mark.parametrize("budget", [128, 16])  # 16: prefix hits followed by chunked continuations
def test_prefix_caching_gives_the_same_outputs(tiny_model_dir, budget):
    rng = np.random.default_rng(7)
    shared = rng.integers(3, 256, size=40).tolist()
    batch = [shared + rng.integers(3, 256, size=n).tolist() for n in (0, 1, 7, 16, 25)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = {}
    for caching in (True, False):
        llm = LLM(tiny_model_dir("llama"), num_kv_blocks=64, compile_guard=True, max_num_batched_tokens=budget,
                  enable_prefix_caching=caching)
        first = llm.generate([shared + [9]], params, use_tqdm=False)  # fills the cache
        outs = llm.generate(batch, params, use_tqdm=False)
        results[caching] = [o.outputs[0].token_ids for o in first + outs]
        kv = llm.engine.kv_cache_manager
        assert kv.num_free_blocks == 63
        if caching:
            assert kv.num_hit_tokens >= 5 * 32  # every batch prompt found at least two cached blocks
    assert results[True] == results[False]


def test_parallel_sampling_shares_the_prompt_blocks(tiny_model_dir):
    """n=4: the prompt is prefilled once and the samples fork from it (copy-on-write of the partial last
    block), with or without prefix caching; with neither, each sample prefills and stores its own prompt."""
    prompt = np.random.default_rng(8).integers(3, 256, size=70).tolist()
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    peaks, texts, copies = {}, {}, {}
    for caching, share in ((True, True), (False, True), (True, False), (False, False)):
        llm = LLM(tiny_model_dir("llama"), num_kv_blocks=64, compile_guard=True, enable_prefix_caching=caching,
                  share_forked_blocks=share, max_num_batched_tokens=128)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert [o.index for o in out.outputs] == [0, 1, 2, 3]
        assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # each child has its own seed stream
        peaks[caching, share] = llm.engine.stats.peak_kv_blocks_used
        copies[caching, share] = llm.engine.kv_cache_manager.num_cow_copies
        texts[caching, share] = [o.token_ids for o in out.outputs]
        assert llm.engine.kv_cache_manager.num_free_blocks == 63
    assert all(t == texts[True, True] for t in texts.values())
    # 70 prompt tokens = 4 full blocks + 6 tokens. Forked: the 4 full blocks are held once and each sample
    # ends up with its own copy of the fifth (3 copies: the last writer keeps the original).
    assert peaks[False, True] == peaks[True, True] == 4 + 4 * 1 and copies[False, True] == 3
    assert peaks[True, False] == 4 + 4 * 1  # prefix caching alone shares the full blocks too
    assert peaks[False, False] == 4 * 5 and copies[False, False] == 0
