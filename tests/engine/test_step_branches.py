"""The step's branches decided on the host (`step_branches="host"`, the GPU default) give what the device's
conditionals give: the same tokens and logprobs for every feature the step can skip, alone and mixed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams, StructuredOutputsParams
from jaxpaged.layers.step_features import FLAGS, ON_DEVICE, StepFeatures, host_features

PROMPTS = [[5, 17, 33, 2, 81, 9], [44, 3, 12], [7, 7, 7, 19, 60, 21, 8, 90, 14], [100, 2, 56, 31]]


def mixed_params() -> list[SamplingParams]:
    """One request per feature, then all of them together (each batch of 4 mixes plain rows and featured ones)."""
    base = dict(max_tokens=8, ignore_eos=True)
    return [
        SamplingParams(temperature=0, **base),
        SamplingParams(temperature=0.8, seed=1, **base),
        SamplingParams(temperature=0.9, seed=2, top_k=5, top_p=0.8, **base),
        SamplingParams(temperature=1.0, seed=3, min_p=0.2, **base),
        SamplingParams(temperature=0, logprobs=2, **base),
        SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.3, **base),
        SamplingParams(temperature=0, logit_bias={11: 4.0}, **base),
        SamplingParams(temperature=0, min_tokens=6, max_tokens=8),
        SamplingParams(temperature=0, prompt_logprobs=1, **base),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["red", "blue"])),
        SamplingParams(temperature=0.7, seed=4, top_k=3, min_p=0.1, logprobs=1, presence_penalty=0.5,
                       logit_bias={3: -2.0}, min_tokens=3, prompt_logprobs=0, max_tokens=8, ignore_eos=True),
    ]


def outputs(llm: LLM) -> list:
    params = mixed_params()
    prompts = [PROMPTS[i % len(PROMPTS)] * 2 for i in range(len(params))]
    # greedy over repeated phrases: what n-gram drafts feed on (with speculative decoding), one with logprobs
    prompts += [[31, 32, 33] * 4, [90, 4, 61, 5] * 3]
    params += [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
               SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[9].outputs[0].text in ("red", "blue")  # (the grammar held)
    return [(o.outputs[0].token_ids, [sorted((t, round(lp.logprob, 4)) for t, lp in e.items())
                                      for e in o.outputs[0].logprobs or []],
             [None if e is None else sorted((t, round(lp.logprob, 4)) for t, lp in e.items())
              for e in o.prompt_logprobs or []]) for o in outs]


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "adaptive": False}


@pytest.mark.parametrize("engine", [dict(async_scheduling=False), dict(async_scheduling=True),
                                    dict(speculative_config=SPEC)], ids=["sync", "async", "speculative"])
def test_host_decided_branches_equal_the_devices(tiny_model_dir, engine):
    runs = {}
    for mode in ("device", "host"):
        llm = LLM(tiny_model_dir("llama-bytes"), num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                  compile_guard=True, step_branches=mode, **engine)  # (byte-level: a grammar can read it)
        assert llm.engine.runner.variants.enabled == (mode == "host")
        runs[mode] = outputs(llm)
        if mode == "host":  # several variants were picked, each compiled once
            assert len(llm.engine.runner.variants._compiled) >= 2
        if "speculative_config" in engine:  # (drafts verified, not only skipped: the same tokens either way)
            assert llm.engine.stats.spec_num_accepted_tokens > 0
    assert runs["host"] == runs["device"]


def test_host_features_are_the_devices_predicates(tiny_model_dir):
    """Each flag from the step's host arrays: a plain greedy batch sets none; each feature sets its own."""
    llm = LLM(tiny_model_dir("llama"), num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
              step_branches="host")
    runner = llm.engine.runner
    t = runner.buckets[0]
    empty = runner._template(t)
    plain = runner.variants.features(empty, constrained=False)
    assert not plain.sampling and not plain.logprobs and not plain.penalties and not plain.bitmask
    s = empty.sampling
    hot = dataclasses.replace(empty, sampling=dataclasses.replace(
        s, temperature=np.where(np.arange(len(s.temperature)) == 0, 0.5, 0).astype(np.float32),
        num_logprobs=np.full_like(s.num_logprobs, -1) + (np.arange(len(s.num_logprobs)) == 1)))
    f = host_features(hot, head_rows=len(s.temperature), num_slots=runner.num_rows, constrained=True,
                      vocab_size=llm.engine.config.model_config.vocab_size, draft_model=False)
    assert f.sampling and f.logprobs and f.bitmask and not f.penalties and not f.min_p
    assert ON_DEVICE.on_device and not plain.on_device and set(FLAGS) == {x.name for x in
                                                                          dataclasses.fields(StepFeatures)}
