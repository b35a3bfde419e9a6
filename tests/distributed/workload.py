"""One workload for the multi-device tests: chunked prompts in a pool small enough to preempt, prompts that hit
the prefix cache, and n=3 seeded samples (forks, copy-on-write); each mechanism is checked to have run."""

import numpy as np

from jaxpaged import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SAMPLED = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
BIASED = SamplingParams(temperature=0, max_tokens=8, logit_bias={17: 4.0, 30: 2.0}, min_tokens=3)  # processor rows
_baselines: dict[str, tuple] = {}


def prompts() -> tuple[list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 256, size=40).tolist()
    first = [rng.integers(3, 256, size=n).tolist() for n in (1, 5, 17, 60, 100)] + [shared + [9, 8, 7]]
    second = [shared + rng.integers(3, 256, size=n).tolist() for n in (2, 21)]  # prefix-cache hits on `shared`
    return first, second


def hit_tokens(llm: LLM) -> int:
    return sum(core.kv_cache_manager.num_hit_tokens for core in llm.engine.core.replicas)


def run(path: str, check=None, **engine_args) -> tuple:
    """Greedy outputs of the first prompts (32-token steps, 14 blocks of 16: preempts), then of the second
    (prefix-cache hits), then of one prompt with a logit bias and min_tokens, then the n=3 samples of one prompt.
    `check(llm)` is called at the end."""
    llm = LLM(path, **{"max_num_batched_tokens": 32, "max_num_seqs": 8, "num_kv_blocks": 14, "compile_guard": True,
                       **engine_args})
    first, second = prompts()
    out = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in first], GREEDY,
                                                         use_tqdm=False)]
    assert llm.engine.scheduler.num_preemptions > 0
    hits = hit_tokens(llm)
    out += [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in second], GREEDY,
                                                          use_tqdm=False)]
    assert hit_tokens(llm) >= hits + 32
    out += [llm.generate([{"prompt_token_ids": first[2]}], BIASED, use_tqdm=False)[0].outputs[0].token_ids]
    samples = [c.token_ids for c in llm.generate([{"prompt_token_ids": first[3]}], SAMPLED, use_tqdm=False)[0].outputs]
    assert len({tuple(s) for s in samples}) > 1
    if check is not None:
        check(llm)
    return out, samples


def baseline(path: str) -> tuple:
    """`run` on one device (once per model)."""
    if path not in _baselines:
        _baselines[path] = run(path)
    return _baselines[path]
