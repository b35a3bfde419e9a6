"""`jaxpaged convert`: the engine's parameter tree saved with orbax loads back to exactly the source's weights,
and the engine on the converted folder generates what it does on the source."""

import json
import os

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.cli import main
from jaxpaged.models.convert import convert
from jaxpaged.models.converted import MARKER
from jaxpaged.models.registry import load_hf_config, load_weights, model_config_from_hf


def weights(path: str, dtype: str = "float32") -> dict:
    return {k: np.asarray(v) for k, v in load_weights(model_config_from_hf(path, load_hf_config(path), dtype)).items()}


def test_converted_weights_and_outputs_equal_the_source(tiny_model_dir, tmp_path):
    src = tiny_model_dir("qwen2")  # (biases, tied embeddings)
    out = convert(src, str(tmp_path / "conv"))
    a, b = weights(src), weights(out)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 33, 7]}, {"prompt_token_ids": list(range(3, 40))}]
    assert ([o.outputs[0].token_ids for o in LLM(out).generate(prompts, params, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in LLM(src).generate(prompts, params, use_tqdm=False)])


def test_cli_converts_to_bfloat16_and_refuses_a_used_folder(tiny_model_dir, tmp_path, capsys):
    src, out = tiny_model_dir("llama"), str(tmp_path / "bf16")
    main(["convert", "--model", src, "--out", out, "--dtype", "bfloat16"])
    assert json.load(open(os.path.join(out, MARKER)))["dtype"] == "bfloat16"
    got = weights(out, "bfloat16")
    assert got["embed"].dtype.name == "bfloat16"
    np.testing.assert_array_equal(got["embed"].astype(np.float32),
                                  weights(src)["embed"].astype("bfloat16").astype(np.float32))
    with pytest.raises(SystemExit):
        main(["convert", "--model", src, "--out", out])
    assert "not empty" in capsys.readouterr().err


def test_another_format_version_is_refused(tiny_model_dir, tmp_path):
    out = convert(tiny_model_dir("llama"), str(tmp_path / "old"))
    marker = os.path.join(out, MARKER)
    meta = json.load(open(marker))
    json.dump({**meta, "format_version": 0}, open(marker, "w"))
    with pytest.raises(ValueError, match="format version"):
        weights(out)


def test_converted_default_model_equals_the_gguf(smollm2_path, tmp_path):
    out = convert(smollm2_path, str(tmp_path / "smollm2"))
    a, b = weights(smollm2_path), weights(out)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
