"""$JAXPAGED_LAYER_LAYOUT picks the layers' layout over the backend's default (per layer on CPU, stacked else)."""

import numpy as np
import pytest

from jaxpaged.config import ModelConfig
from jaxpaged.models import llama

CFG = ModelConfig(model="tiny", architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                  rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False,
                  o_bias=False, sliding_window=None, eos_token_ids=(0,), dtype="float32")


@pytest.mark.parametrize("layout,want_list", [("", True), ("per_layer", True), ("stacked", False)])
def test_layout_from_the_environment(monkeypatch, layout, want_list):
    monkeypatch.setenv(llama.LAYOUT_ENV, layout)
    weights = {k: np.ones(s, np.float32) for k, s in llama.param_shapes(CFG).items()}
    layers = llama.model_params(CFG, weights)["layers"]
    assert isinstance(layers, list) == want_list  # ("": this CPU's default, one dict per layer)
    assert llama.model_params(CFG, weights, per_layer=True)["layers"].__class__ is list  # (an argument wins)


def test_a_bad_layout_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(llama.LAYOUT_ENV, "scan")
    with pytest.raises(ValueError, match="JAXPAGED_LAYER_LAYOUT"):
        llama.default_per_layer()
