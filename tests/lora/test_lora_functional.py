"""The functional API with LoRA adapters: `with_loras` stacks PEFT adapters into the params, and `generate`'s
`lora_ids` picks each row's; greedy tokens equal HF transformers' with each adapter merged."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxpaged import functional as F
from tests.lora.adapters import hf_merged
from tests.reference import hf_greedy
from tests.tiny_models import load_hf_model


def test_rows_of_different_adapters_in_one_generate(lora_setup):
    base, adapters = lora_setup
    config, params = F.load(base, attention_backend="reference")
    with_loras = F.with_loras(config, params, [adapters["a1"], adapters["a2"]])
    prompts = [[5, 9, 13, 40], [7, 7, 81], [200, 3, 4, 5, 6], [11]]
    slots = [0, 1, -1, 1]
    tokens, lengths = F.pad_batch(prompts)
    out = np.asarray(F.generate(config, with_loras, tokens, lengths, jax.random.key(0), max_new_tokens=6,
                                lora_ids=np.asarray(slots, np.int32)))
    models = {0: hf_merged(base, adapters["a1"]), 1: hf_merged(base, adapters["a2"]), -1: load_hf_model(base)}
    assert [list(r) for r in out] == [hf_greedy(models[s], p, 6) for p, s in zip(prompts, slots)]
    with pytest.raises(ValueError, match="no LoRA stack"):
        F.generate(config, params, tokens, lengths, jax.random.key(0), max_new_tokens=2,
                   lora_ids=np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="adapters"):
        F.with_loras(config, params, [])
