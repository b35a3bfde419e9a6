"""AWQ and GPTQ checkpoints (written by tests/quant_checkpoints.py in AutoAWQ's and AutoGPTQ's layouts): their
codes decoded to the reference formula's weights, kept packed in memory, models equal to the same model on the
encoded float weights (and HF's greedy tokens on them), their config errors."""

import dataclasses
from types import SimpleNamespace

import jax
import numpy as np
import pytest
import torch

from jaxpaged import LLM, SamplingParams
from jaxpaged.layers.quant import QuantizedWeight, dequantize
from jaxpaged.models import build_model, load_hf_config, model_config_from_hf
from jaxpaged.models.awq_gptq import awq_host_quant, gptq_host_quant
from jaxpaged.models.quantize import device_weight, resolve_quantization
from jaxpaged.models.registry import load_weights
from tests.quant_checkpoints import dequantized, pack_awq, pack_gptq, rtn, write_quantized_checkpoint
from tests.reference import hf_greedy, our_last_logits_batch
from tests.tiny_models import load_hf_model


@pytest.mark.parametrize("form", ["awq", "gptq", "gptq-v2-8bit", "gptq-act-order"])
def test_packed_linear_decodes_to_the_reference_formula(form):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 256)).astype(np.float32)  # [out, in]
    bits = 8 if "8bit" in form else 4
    codes, zeros, scales, g_idx = rtn(w, 64, bits, rng.permutation(256) if form == "gptq-act-order" else None)
    expected = dequantized(codes, zeros, scales, g_idx).T  # [in, out]
    if form == "awq":
        h = awq_host_quant("x", **pack_awq(codes, zeros, scales))
    else:
        h = gptq_host_quant("x", **pack_gptq(codes, zeros, scales, g_idx, bits, v2="v2" in form), bits=bits,
                            zeros_minus_one="v2" not in form)
    assert (h.perm is not None) == (form == "gptq-act-order")
    np.testing.assert_allclose(h.dequantize(), expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dequantize(device_weight(h))), expected, rtol=1e-6, atol=1e-6)
    assert np.abs(expected - w.T).max() <= 1.01 * np.abs(w).max() / (2 ** bits - 1)  # (half a step at most)


@pytest.mark.parametrize("method,kind,layout", [("awq", {}, "per-layer"), ("gptq", {"act_order": True}, "stacked"),
                                                ("gptq", {"bits": 8, "v2": True}, "per-layer")])
def test_checkpoint_kept_packed_and_equal_to_the_encoded_model(tiny_model_dir, tmp_path, method, kind, layout):
    src = tiny_model_dir("llama")
    dst = str(tmp_path / method)
    encoded = write_quantized_checkpoint(src, dst, method, **kind)
    cfg = model_config_from_hf(dst, load_hf_config(dst), "float32")
    assert cfg.quantization == method  # (from quantization_config)
    per_layer = layout == "per-layer"
    model = build_model(cfg, per_layer=per_layer)
    layers = model.params()["layers"]
    w = (layers[0] if per_layer else layers)["w_gate_up"]
    assert isinstance(w, QuantizedWeight) and w.bits == kind.get("bits", 4)
    assert (w.perm is not None) == kind.get("act_order", False)
    base = model_config_from_hf(src, load_hf_config(src), "float32")
    weights = load_weights(base)
    for key, value in encoded.items():  # model.layers.<i>.<module>.<name>_proj.weight
        i, module = int(key.split(".")[2]), key.split(".")[4].replace("_proj", "")
        ours = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down"}[module]
        weights["layers." + ours][i] = value.T
    reference = build_model(base, weights=weights, per_layer=per_layer)
    plain = build_model(base, per_layer=per_layer)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (1, 9, 40)]
    ours, ref, orig = (our_last_logits_batch(m, prompts) for m in (model, reference, plain))
    assert max(float(np.abs(a - b).max()) for a, b in zip(ours, ref)) < 1e-4
    assert max(float(np.abs(a - b).max()) for a, b in zip(ours, orig)) > 1e-3  # (the quantization is real)


def test_awq_engine_greedy_equals_hf_on_the_encoded_weights(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    dst = str(tmp_path / "awq")
    encoded = write_quantized_checkpoint(src, dst, "awq")
    hf = load_hf_model(src)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in encoded:
                p.copy_(torch.from_numpy(encoded[name]))
    llm = LLM(model=dst, attention_backend="reference", compile_guard=True, max_num_seqs=4, num_kv_blocks=64)
    held = jax.tree.leaves(llm.engine.core.runner.state, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    assert sum(isinstance(x, QuantizedWeight) and x.bits == 4 for x in held) >= 4 * 2  # (every layer's, packed)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (3, 17, 30)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == hf_greedy(hf, p, 12)


def test_int4_weights_take_under_0_3x_bf16():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((576, 1536)).astype(np.float32)  # [out, in], group 128
    codes, zeros, scales, g_idx = rtn(w, 128, 4)
    q = device_weight(awq_host_quant("x", **pack_awq(codes, zeros, scales)))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(q))
    assert nbytes <= 0.3 * w.size * 2


def test_awq_gptq_config_errors(tiny_model_dir):
    def config(**qc):
        return SimpleNamespace(quantization_config=qc)

    assert resolve_quantization(None, config(quant_method="awq", bits=4, version="gemm"), False) == "awq"
    assert resolve_quantization("gptq", config(quant_method="gptq", bits=8), False) == "gptq"
    with pytest.raises(ValueError, match="version 'gemv'"):
        resolve_quantization(None, config(quant_method="awq", bits=4, version="gemv"), False)
    with pytest.raises(ValueError, match="zero_point False"):
        resolve_quantization(None, config(quant_method="awq", zero_point=False), False)
    with pytest.raises(ValueError, match="bits 3"):
        resolve_quantization(None, config(quant_method="gptq", bits=3), False)
    with pytest.raises(ValueError, match="'marlin'"):
        resolve_quantization(None, config(quant_method="gptq", bits=4, checkpoint_format="marlin"), False)
    with pytest.raises(ValueError, match="quantization='awq' loads a checkpoint quantized so"):
        resolve_quantization("awq", None, False)
    with pytest.raises(ValueError, match="quantized as 'awq'"):
        resolve_quantization("int8", config(quant_method="awq"), False)
    src = tiny_model_dir("llama")
    cfg = model_config_from_hf(src, load_hf_config(src), "float32")
    with pytest.raises(ValueError, match="holds no .qweight tensors"):
        load_weights(dataclasses.replace(cfg, quantization="gptq"))


def test_convert_refuses_a_quantized_checkpoint(tiny_model_dir, tmp_path):
    from jaxpaged.models.convert import convert

    dst = str(tmp_path / "awq")
    write_quantized_checkpoint(tiny_model_dir("llama"), dst, "awq")
    with pytest.raises(ValueError, match=r"is quantized \(awq\); serve it as it is"):
        convert(dst, str(tmp_path / "out"))
