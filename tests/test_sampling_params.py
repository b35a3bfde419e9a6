"""`SamplingParams` validation: every bad value raises ValueError naming its field; good values normalize."""

from __future__ import annotations

import pytest

from jaxpaged.sampling_params import MAX_LOGPROBS, SamplingParams, row_seed


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.min_tokens, p.seed) == (1, 1.0, 1.0, 0, 16, 0, None)
    assert p.stop == [] and p.stop_token_ids == [] and not p.ignore_eos and p.skip_special_tokens
    assert not p.greedy and not p.needs_penalties and not p.needs_bias_row


@pytest.mark.parametrize("kw", [
    dict(n=0), dict(n=1.5), dict(n=True), dict(temperature=-0.1), dict(temperature="1"),
    dict(temperature=float("nan")), dict(temperature=float("inf")), dict(top_p=0), dict(top_p=1.01), dict(top_p="0.5"),
    dict(top_k=-2), dict(top_k=1.0), dict(seed=2**63), dict(seed=-(2**63) - 1), dict(seed=2.0),
    dict(max_tokens=0), dict(max_tokens=True), dict(min_tokens=-1), dict(min_tokens=5, max_tokens=4),
    dict(stop_token_ids=[-1]), dict(stop_token_ids=[1.0]), dict(stop_token_ids=[True]), dict(stop_token_ids=5),
    dict(stop=[""]), dict(stop=[3]), dict(stop=""), dict(logprobs=-1), dict(logprobs=MAX_LOGPROBS + 1),
    dict(prompt_logprobs=-1), dict(prompt_logprobs=MAX_LOGPROBS + 1), dict(repetition_penalty=0),
    dict(repetition_penalty=-1), dict(repetition_penalty=float("inf")), dict(repetition_penalty=float("nan")),
    dict(presence_penalty=2.01), dict(presence_penalty=-2.01),
    dict(frequency_penalty=2.5), dict(frequency_penalty=-3), dict(min_p=-0.1), dict(min_p=1.1), dict(min_p=True),
    dict(logit_bias=[1]), dict(logit_bias={"x": 1}), dict(logit_bias={1: "a"}), dict(logit_bias={1: float("nan")}),
    dict(logit_bias={1: float("-inf")}), dict(allowed_token_ids=[]),
    dict(allowed_token_ids=[-1]), dict(allowed_token_ids=[1.0]), dict(bad_words=[""]), dict(bad_words=[3]),
    dict(truncate_prompt_tokens=0), dict(truncate_prompt_tokens=-2), dict(truncate_prompt_tokens=True),
])
def test_bad_values_name_their_field(kw):
    field = next(iter(kw))
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_good_edges_and_normalization():
    p = SamplingParams(temperature=0, top_p=1, top_k=-1, max_tokens=None, min_tokens=3, stop="end",
                       stop_token_ids=(4, 5), logprobs=0, prompt_logprobs=MAX_LOGPROBS, repetition_penalty=2,
                       presence_penalty=-2, frequency_penalty=2, min_p=1, logit_bias={"7": 500, 8: -500},
                       allowed_token_ids=[0], bad_words=["x"])
    assert p.greedy and p.top_k == 0 and p.stop == ["end"] and p.stop_token_ids == [4, 5]
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float) and isinstance(p.repetition_penalty, float)
    assert p.logit_bias == {7: 100.0, 8: -100.0}  # clamped to [-100, 100] as vLLM
    assert p.needs_penalties and p.needs_bias_row
    assert SamplingParams(min_p=0.0, presence_penalty=0.5).needs_penalties
    assert SamplingParams(frequency_penalty=0.1).needs_penalties
    assert not SamplingParams(logit_bias={}).needs_bias_row
    assert SamplingParams(bad_words=["a"]).needs_bias_row and SamplingParams(allowed_token_ids=[1]).needs_bias_row
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"] and SamplingParams(stop=None).stop == []
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4
    # the smallest and largest values each field accepts
    edge = SamplingParams(seed=0, stop_token_ids=[0], logprobs=MAX_LOGPROBS, prompt_logprobs=0, min_p=0.0,
                          top_k=0, allowed_token_ids=[0], presence_penalty=2, frequency_penalty=-2)
    assert (edge.seed, edge.stop_token_ids, edge.logprobs, edge.prompt_logprobs) == (0, [0], MAX_LOGPROBS, 0)
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1 and SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_every_64_bit_seed_is_a_32_bit_row_seed():
    """Rows sample with 32-bit seeds: a seed in that range is kept (seeded outputs do not move), any other
    64-bit seed (vLLM takes them, negative ones too) is hashed into it, distinct seeds to distinct rows."""
    assert [row_seed(s) for s in (0, 7, 2**32 - 1)] == [0, 7, 2**32 - 1]
    big = [row_seed(s) for s in (2**32, 2**32 + 1, 2**63 - 1, -1, -(2**63))]
    assert all(0 <= s < 2**32 for s in big) and len(set(big)) == len(big)
    assert row_seed(2**40) == row_seed(2**40)


def test_messages_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"repetition_penalty must be a finite number in \(0.0, 3.40282e\+38\], got 0"):
        SamplingParams(repetition_penalty=0)
    with pytest.raises(ValueError, match=r"min_p must be a finite number in \[0.0, 1\], got 2"):
        SamplingParams(min_p=2)
    with pytest.raises(ValueError, match="logit_bias must be a dict of token id -> bias, got list"):
        SamplingParams(logit_bias=[1])
    with pytest.raises(ValueError, match="logit_bias must map integer token ids to numbers"):
        SamplingParams(logit_bias={"a": 1})
    with pytest.raises(ValueError, match="allowed_token_ids must be a non-empty list of non-negative ints"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(ValueError, match="bad_words must be a list of non-empty strings"):
        SamplingParams(bad_words=[""])


def test_settings_the_device_cannot_hold_are_refused_or_made_greedy():
    """Sampling settings reach the device as float32: a penalty or temperature past float32's range would be
    inf there (a 400, not a NaN row); a temperature too small to divide by samples greedily (vLLM's)."""
    for field in ("repetition_penalty", "presence_penalty", "temperature"):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: 1e300})
    assert SamplingParams(temperature=1e-7).temperature == 0.0 and SamplingParams(temperature=1e-4).temperature
