"""Sampling controls end to end: HF-equal repetition penalty, logprobs, min_tokens, bias, allowed ids."""

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from tests.reference import hf_last_logits
from tests.tiny_models import load_hf_model


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), num_kv_blocks=64, compile_guard=True, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return load_hf_model(tiny_model_dir("llama"))


PROMPT = [5, 9, 14, 9, 30, 41]


def test_repetition_penalty_matches_hf_generate(llm, hf):
    import torch

    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.8),
                       use_tqdm=False)[0]
    ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, repetition_penalty=1.8,
                      pad_token_id=0)[0, len(PROMPT):].tolist()  # both stop after EOS
    assert out.outputs[0].token_ids == ref


def test_greedy_logprobs_equal_hf_log_softmax(llm, hf):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    seq = list(PROMPT)
    total = 0.0
    for tok, entry in zip(out.token_ids, out.logprobs):
        ref = hf_last_logits(hf, seq)
        ref = ref - np.log(np.exp(ref - ref.max()).sum()) - ref.max()
        assert entry[tok].rank == 1 and entry[tok].logprob == pytest.approx(ref[tok], abs=1e-4)
        top5 = np.argsort(-ref)[:5]
        assert sorted(entry) == sorted(top5.tolist())
        for t in top5:
            assert entry[int(t)].logprob == pytest.approx(ref[t], abs=1e-4)
        total += ref[tok]
        seq.append(tok)
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_min_tokens_suppresses_eos(llm):
    base = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    first = base[0].outputs[0].token_ids[0]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first], min_tokens=3),
                       use_tqdm=False)[0].outputs[0]
    assert first not in out.token_ids[:3] and len(out.token_ids) >= 3


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    """vLLM's left truncation: the request runs on the prompt's last k tokens (its output is that shorter
    prompt's), -1 keeps up to max_model_len, and a prompt shorter than k is untouched."""
    greedy = dict(temperature=0, max_tokens=6, ignore_eos=True)
    cut, tail, full, whole = llm.generate(
        [PROMPT, PROMPT[-3:], PROMPT, PROMPT],
        [SamplingParams(**greedy, truncate_prompt_tokens=3), SamplingParams(**greedy),
         SamplingParams(**greedy, truncate_prompt_tokens=-1), SamplingParams(**greedy, truncate_prompt_tokens=50)],
        use_tqdm=False)
    assert cut.prompt_token_ids == PROMPT[-3:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    assert full.prompt_token_ids == PROMPT == whole.prompt_token_ids
    assert full.outputs[0].token_ids == whole.outputs[0].token_ids != cut.outputs[0].token_ids


def test_logit_bias_allowed_ids_and_mixed_batch_do_not_recompile(llm):
    params = [
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias={77: 100.0}),
        SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True, allowed_token_ids=[10, 11, 12], seed=3),
        SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, min_p=0.2, presence_penalty=1.0, seed=4),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
    ]
    outs = llm.generate([PROMPT] * 4, params, use_tqdm=False)  # compile_guard is on
    assert outs[0].outputs[0].token_ids == [77] * 5
    assert set(outs[1].outputs[0].token_ids) <= {10, 11, 12}
    alone = llm.generate([PROMPT], params[3], use_tqdm=False)[0]
    assert outs[3].outputs[0].token_ids == alone.outputs[0].token_ids  # neighbours' features leave row 3 alone


def test_bad_values_name_the_field():
    for kw, field in [(dict(repetition_penalty=-1), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
                      (dict(frequency_penalty=5), "frequency_penalty"), (dict(logprobs=50), "logprobs"),
                      (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(bad_words=[""]), "bad_words")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)


def test_stop_strings_across_token_boundaries(llm):
    base = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    words = base.text.split(" ")
    # a stop string made of the end of word 3, the space, and the start of word 4: it spans two tokens
    stop = words[3][-2:] + " " + words[4][:2]
    cut = base.text.index(stop)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop, "zzz"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[:cut]
    kept = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stop,
                                                 include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == base.text[: cut + len(stop)]
    longer = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                   stop=["never appears"]), use_tqdm=False)[0].outputs[0]
    assert longer.text == base.text and longer.finish_reason == "length"


def test_prompt_logprobs_match_hf_also_in_chunks(tiny_model_dir, hf):
    import torch

    prompt = list(np.random.default_rng(5).integers(3, 256, size=40))
    prompt = [int(x) for x in prompt]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1).numpy()  # [P, V]
    chunked = LLM(tiny_model_dir("llama"), num_kv_blocks=64, compile_guard=True, max_num_batched_tokens=16)
    out = chunked.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3),
                           use_tqdm=False)[0]
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for pos in range(1, len(prompt)):
        entry, row = plp[pos], ref[pos - 1]
        assert entry[prompt[pos]].logprob == pytest.approx(row[prompt[pos]], abs=1e-4)
        assert entry[prompt[pos]].rank == int((row > row[prompt[pos]]).sum()) + 1
        assert set(np.argsort(-row)[:3].tolist()) <= set(entry)


def test_skip_special_tokens(llm):
    forced = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={2: 100.0})  # EOS (</s>) every step
    shown = llm.generate([PROMPT], SamplingParams(**forced, skip_special_tokens=False), use_tqdm=False)[0]
    hidden = llm.generate([PROMPT], SamplingParams(**forced), use_tqdm=False)[0]
    assert shown.outputs[0].token_ids == [2, 2, 2] == hidden.outputs[0].token_ids
    assert shown.outputs[0].text.split() == ["</s>"] * 3 and hidden.outputs[0].text.strip() == ""


def test_streamed_text_never_shows_part_of_a_stop_string(tiny_model_dir):
    """Step by step, each output's text is a prefix of the final text: a tail that may still become a stop
    string (one spanning two tokens here) is held back until it is known not to; with n=3, each sample has its
    own stop point."""
    from jaxpaged import LLMEngine
    from jaxpaged.engine.arg_utils import EngineArgs

    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_model_dir("llama"), num_kv_blocks=64,
                                                   max_num_batched_tokens=64, compile_guard=True))
    free = SamplingParams(n=3, temperature=1.0, seed=17, max_tokens=12, ignore_eos=True)
    engine.add_request("free", PROMPT, free)
    texts = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts = {o.index: o.text for o in out.outputs}
    words = texts[0].split(" ")
    stops = [words[4][-2:] + " " + words[5][:2]]  # spans two tokens of sample 0
    engine.add_request("stopped", PROMPT, SamplingParams(n=3, temperature=1.0, seed=17, max_tokens=12,
                                                         ignore_eos=True, stop=stops))
    seen: dict[int, list[str]] = {0: [], 1: [], 2: []}
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            for o in out.outputs:
                seen[o.index].append(o.text)
            final = out
    for o in final.outputs:
        cut = texts[o.index].find(stops[0])
        assert o.text == (texts[o.index] if cut < 0 else texts[o.index][:cut])
        assert o.finish_reason == ("stop" if cut >= 0 else "length")
        assert all(o.text.startswith(t) for t in seen[o.index]), f"sample {o.index} showed text it took back"
    assert final.outputs[0].finish_reason == "stop"
