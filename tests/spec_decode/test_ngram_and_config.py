"""The n-gram proposer and the speculative_config checks (before any model loads)."""

import time

import numpy as np
import pytest

from jaxpaged import LLM
from jaxpaged.spec_decode import SpeculativeConfig, propose_ngram


def ids(*xs):
    return np.array(xs, np.int32)


def test_proposes_what_followed_the_most_recent_longest_match():
    tokens = ids(1, 2, 3, 9, 9, 5, 2, 3, 7, 8, 6, 1, 2, 3)
    # suffix (1, 2, 3) occurs at 0: followed by 9 9 5; the shorter (2, 3) also at 6 (followed by 7 8), but the
    # longest n is tried first
    assert propose_ngram(tokens, 3, 2, 3).tolist() == [9, 9, 5]
    assert propose_ngram(tokens, 3, 2, 2).tolist() == [7, 8, 6]  # the most recent (2, 3)
    assert propose_ngram(tokens, 10, 2, 2).tolist() == [7, 8, 6, 1, 2, 3]  # up to the end, not past it


def test_no_match_no_drafts():
    assert propose_ngram(ids(1, 2, 3, 4, 5), 4, 1, 3).tolist() == []
    assert propose_ngram(ids(1, 2, 3, 4, 3), 4, 2, 3).tolist() == []  # (a 1-gram matches, below min)
    assert propose_ngram(ids(1, 2, 3, 4, 3), 4, 1, 3).tolist() == [4, 3]
    assert propose_ngram(ids(7), 4, 1, 3).tolist() == []


def test_config_parses_vllm_names_and_json():
    c = SpeculativeConfig.from_user('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (3, 4, 4)
    c = SpeculativeConfig.from_user({"num_speculative_tokens": 2})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 5, 5)
    assert SpeculativeConfig.from_user(None) is None
    c = SpeculativeConfig.from_user({"model": "[ngram]", "num_speculative_tokens": 2})  # vLLM's older spelling
    assert (c.method, c.model) == ("ngram", None)
    c = SpeculativeConfig.from_user({"model": "/a/draft", "num_speculative_tokens": 2})  # the method is implied
    assert (c.method, c.model) == ("draft_model", "/a/draft")


@pytest.mark.parametrize("bad, field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "unknown key"),
    ("{not json", "JSON"),
])
def test_bad_config_is_refused_before_the_model_loads(bad, field, tiny_model_dir):
    path = tiny_model_dir("llama")
    start = time.perf_counter()
    with pytest.raises(ValueError, match=field):
        LLM(path, speculative_config=bad)
    assert time.perf_counter() - start < 5  # no weights, no compile
