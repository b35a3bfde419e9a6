"""cache_salt (vLLM's): a prompt's cached prefix blocks are shared only with prompts that send the same salt."""

from types import SimpleNamespace

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine import data_parallel
from jaxpaged.engine.data_parallel import ReplicaRouter

PROMPT = np.random.default_rng(3).integers(3, 256, size=40).tolist()  # 2 full blocks of 16 (and 8 tokens)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), num_kv_blocks=64, block_size=16, compile_guard=True,
               enable_prefix_caching=True)


def run(llm, salt=None, n=1):
    prompt = {"prompt_token_ids": PROMPT} if salt is None else {"prompt_token_ids": PROMPT, "cache_salt": salt}
    params = GREEDY if n == 1 else SamplingParams(n=n, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return out


def test_a_salt_sees_only_its_own_cached_blocks(llm):
    plain = run(llm)
    assert run(llm).num_cached_tokens == 32  # the unsalted prompt's blocks
    assert run(llm, "tenant-a").num_cached_tokens == 0  # ... are not another salt's
    again = run(llm, "tenant-a")
    assert again.num_cached_tokens == 32  # the same salt shares its own
    assert run(llm, "tenant-b").num_cached_tokens == 0
    assert again.outputs[0].token_ids == plain.outputs[0].token_ids  # (the salt changes no output)
    kv = llm.engine.kv_cache_manager
    assert kv.num_cached_prefix_tokens(PROMPT) == 32  # data-parallel routing's probe salts the same way
    assert kv.num_cached_prefix_tokens(PROMPT, "tenant-a") == 32
    assert kv.num_cached_prefix_tokens(PROMPT, "tenant-c") == 0


def test_a_salted_prompts_samples_cache_its_blocks_under_the_salt(llm):
    out = run(llm, "tenant-n", n=3)
    assert len(out.outputs) == 3 and out.num_cached_tokens == 0
    assert run(llm, "tenant-n").num_cached_tokens == 32


def test_data_parallel_routing_probes_with_the_salt(llm, monkeypatch):
    """Between equally loaded replicas the router prefers the one holding the prompt's blocks under its salt."""
    monkeypatch.setattr(data_parallel, "replica_load", lambda core: 0)
    cold = SimpleNamespace(kv_cache_manager=SimpleNamespace(num_cached_prefix_tokens=lambda ids, salt=None: 0))
    router = ReplicaRouter.__new__(ReplicaRouter)  # (only what `pick` reads)
    router.cores = [cold, SimpleNamespace(kv_cache_manager=llm.engine.kv_cache_manager)]
    run(llm, "tenant-r")
    assert router.pick(PROMPT, "tenant-r") == 1
    assert router.pick(PROMPT, "tenant-unseen") == 0


@pytest.mark.parametrize("salt", ["", 5])
def test_a_bad_salt_is_refused_by_name(llm, salt):
    with pytest.raises(ValueError, match="cache_salt"):
        run(llm, salt)


def test_a_decode_instance_pulls_the_blocks_the_salted_prompt_cached(llm):
    """Disaggregation: the hashes a consumer asks a producer for (`server.kv_transfer.prompt_blocks`) are the
    ones the engine cached the salted prompt's blocks under."""
    from server.kv_transfer import prompt_blocks

    run(llm, "tenant-p")
    pool = llm.engine.kv_cache_manager.pool
    salted = prompt_blocks(PROMPT, 16, "tenant-p")
    assert len(salted) == 2 and all(pool.get_cached_block(h, t) is not None for h, t in salted)
    other = prompt_blocks(PROMPT, 16, "tenant-q")
    assert [h for h, _ in other] != [h for h, _ in salted] and pool.get_cached_block(*other[0]) is None


def test_beam_search_keeps_the_salt(llm, monkeypatch):
    """LLM.beam_search's dict prompts carry their salt into the held requests (and a bad one is refused)."""
    from jaxpaged.engine.beam_search import BeamSearchParams

    seen, real = [], llm.engine.add_held_request

    def spy(*args, **kw):
        req = real(*args, **kw)
        seen.append(req.cache_salt)
        return req

    monkeypatch.setattr(llm.engine, "add_held_request", spy)
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    llm.beam_search([{"prompt_token_ids": PROMPT, "cache_salt": "beams"}, PROMPT], params, use_tqdm=False)
    assert seen == ["beams", None]
    with pytest.raises(ValueError, match="cache_salt"):
        llm.beam_search([{"prompt_token_ids": PROMPT, "cache_salt": ""}], params, use_tqdm=False)
