"""The dense logits-processor rows a request needs on the device: its logit bias (allowed tokens, logit_bias,
single-token bad words) and its min_tokens mask of stop tokens, each [V], built once when it is added."""

from __future__ import annotations

import numpy as np

from jaxpaged.config import ModelConfig
from jaxpaged.sampling_params import SamplingParams


def processor_rows(params: SamplingParams, model_config: ModelConfig, tokenizer):
    """(bias [V] float32, min_tokens mask [V] bool) for requests that use those features, else None; ValueError
    names a token outside the vocabulary."""
    if not params.needs_bias_row and params.min_tokens == 0:
        return None
    vocab = model_config.vocab_size
    bias = np.zeros(vocab, np.float32)
    if params.allowed_token_ids is not None:
        bad = [t for t in params.allowed_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"allowed_token_ids: {bad[:5]} are outside the vocabulary [0, {vocab})")
        bias[:] = -np.inf
        bias[params.allowed_token_ids] = 0.0
    for tok, b in (params.logit_bias or {}).items():
        if not 0 <= tok < vocab:
            raise ValueError(f"logit_bias: token id {tok} is outside the vocabulary [0, {vocab})")
        bias[tok] += b
    for word in params.bad_words or []:
        for variant in (word, " " + word):
            ids = tokenizer.encode(variant, add_special_tokens=False)
            if len(ids) == 1:  # multi-token bad words are not masked (see README)
                bias[ids[0]] = -np.inf
    min_mask = np.zeros(vocab, bool)
    if params.min_tokens:
        stop_ids = [t for t in (*model_config.eos_token_ids, *params.stop_token_ids) if t < vocab]
        min_mask[stop_ids] = True
    return bias, min_mask
