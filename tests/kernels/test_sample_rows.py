"""The LM head and sampler on the first rows only (when no later row draws) give what all rows give."""

import numpy as np

from jaxpaged import LLM, SamplingParams
from jaxpaged.layers import sample_rows
from jaxpaged.layers.sample_rows import head_rows


def test_head_rows():
    assert [head_rows(s) for s in (8, 16, 24, 32, 48, 64, 96, 256)] == [8, 16, 24, 32, 48, 16, 24, 64]


def _params() -> list[SamplingParams]:
    """A row of each kind the narrow branch must slice right: seeded draws, penalties, a bias, min_tokens,
    min_p, logprobs, greedy."""
    return [SamplingParams(temperature=0.9, top_p=0.8, seed=1, max_tokens=10, ignore_eos=True, logprobs=3),
            SamplingParams(temperature=1.0, top_k=20, seed=2, max_tokens=10, repetition_penalty=1.5,
                           frequency_penalty=0.5, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=10, logit_bias={17: 5.0}, min_tokens=6, logprobs=2),
            SamplingParams(temperature=0.7, min_p=0.2, seed=3, max_tokens=10, presence_penalty=1.0,
                           ignore_eos=True)]


def _run(path: str) -> list:
    # budget 64, 64 rows: the 64-token steps have 64 sequence rows (narrow branch: 16)
    llm = LLM(path, max_num_batched_tokens=64, max_num_seqs=64, num_kv_blocks=256, compile_guard=True)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (9, 30, 45, 60)]
    few = llm.generate(prompts, _params(), use_tqdm=False)  # at most 4 rows draw: the narrow branch
    many = llm.generate([p[:3] for p in prompts] * 5, _params() * 5, use_tqdm=False)  # 20 draw: all rows
    return [(c.token_ids, c.logprobs and [sorted(d.items()) for d in c.logprobs]) for o in few + many
            for c in o.outputs]


def test_narrow_branch_equals_all_rows(tiny_model_dir, monkeypatch):
    path = tiny_model_dir("llama")
    narrow = _run(path)
    monkeypatch.setattr(sample_rows, "MIN_ROWS_TO_SPLIT", 10**9)  # every step samples all its rows
    full = _run(path)
    assert narrow == full
    assert len({tuple(t) for t, _ in narrow}) > 1
