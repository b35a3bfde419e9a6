"""Narrow KV and bf16 weights on the default model: greedy agreement with float32 over 64 chat prompts x 64 tokens.

Run through `jaxpaged.functional` (the engine's model and attention code; tests/engine/test_kv_cache_dtype.py
holds the engine equal to it on each KV dtype). The floors are what was measured (README), less a margin.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import functional as F
from tests.reference import chat_prompt_ids

TOPICS = ["the sea", "volcanoes", "bread", "chess", "the moon", "bees", "rivers", "jazz", "glass", "trains",
          "coffee", "snow", "maps", "owls", "clocks", "paper", "rain", "tigers", "bridges", "salt", "kites",
          "deserts", "violins", "honey", "forests", "comets", "cheese", "lighthouses", "sand", "whales",
          "gardens", "bicycles"]
QUESTIONS = [form.format(t) for t in TOPICS for form in ("Write two sentences about {}.",
                                                         "What is interesting about {}?")]
NEW = 64
# (weights dtype, kv dtype) -> (least fraction of the 64 x 64 greedy tokens that agree with all-float32's, i.e.
# come before their output's first divergence; largest mean |logprob difference| of those tokens). Measured
# 2026-11-30 here: bf16 KV 92.4% agreeing (54/64 outputs identical), 3.2e-3; fp8 e4m3 KV (unscaled) 30.5%
# (6/64), 5.8e-2; with calibrated scales (`F.with_kv_scales`, the engine's default) 28.3% (4/64), 5.7e-2: SmolLM2's K
# and V stay far inside e4m3's range, so its 3 mantissa bits, not saturation, cost the agreement; bf16 weights
# (float32 activations on CPU, bf16 KV) 84.6% (43/64), 9.0e-3.
FLOORS = {("float32", "bfloat16"): (0.90, 0.01), ("float32", "fp8_e4m3"): (0.25, 0.1),
          ("float32", "fp8_e4m3+scales"): (0.25, 0.1), ("bfloat16", "auto"): (0.80, 0.02)}


@pytest.fixture(scope="module")
def runs(smollm2_path):
    tok = F.load_tokenizer(smollm2_path)
    tokens, lengths = F.pad_batch([chat_prompt_ids(tok, q) for q in QUESTIONS])

    @partial(jax.jit, static_argnames=("config", "kv"))
    def greedy_with_logprobs(config, params, tokens, lengths, kv):
        cache = F.init_cache(config, num_seqs=tokens.shape[0], max_len=tokens.shape[1] + NEW, dtype=kv)
        logits, cache = F.prefill(config, params, cache, tokens, lengths)

        def step(carry, _):
            logits, cache = carry
            token = jnp.argmax(logits, -1).astype(jnp.int32)
            lp = jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], axis=-1)[:, 0]
            logits, cache = F.decode(config, params, cache, token)
            return (logits, cache), (token, lp)

        _, (toks, lps) = jax.lax.scan(step, (logits, cache), length=NEW)
        return toks.T, lps.T

    out = {}
    for weights in ("float32", "bfloat16"):
        config, params = F.load(smollm2_path, dtype=weights)
        for kv in ("auto", "bfloat16", "fp8_e4m3", "fp8_e4m3+scales") if weights == "float32" else ("auto",):
            p = F.with_kv_scales(config, params, tok) if kv.endswith("+scales") else params
            out[weights, kv] = tuple(map(np.asarray, greedy_with_logprobs(config, p, tokens, lengths,
                                                                          kv.removesuffix("+scales"))))
    return out


@pytest.mark.parametrize("weights,kv", list(FLOORS))
def test_greedy_agreement_with_float32(runs, weights, kv):
    (base, base_lp), (toks, lps) = runs["float32", "auto"], runs[weights, kv]
    identical = float(np.mean((base == toks).all(axis=1)))
    agree, diffs = 0, []
    for a, b, la, lb in zip(base, toks, base_lp, lps):
        n = int(np.argmin(a == b)) if (a != b).any() else NEW  # tokens before the first divergence
        agree += n
        diffs.append(np.abs(la[:n] - lb[:n]))
    agreement, mean_diff = agree / base.size, float(np.concatenate(diffs).mean())
    print(f"weights {weights}, kv {kv}: {agreement:.1%} of tokens agree, {identical:.1%} of outputs identical, "
          f"mean |logprob diff| {mean_diff:.2e}")
    floor, ceiling = FLOORS[weights, kv]
    assert agreement >= floor and mean_diff <= ceiling
