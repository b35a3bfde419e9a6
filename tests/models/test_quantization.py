"""Quantized weights: GGUF blocks decoded as gguf decodes them, the device dots equal to the reference formula,
models with quantized weights equal to the same model with the dequantized weights (and HF's greedy tokens on
those), the CPU integer GEMM exact, the flags' errors."""

import dataclasses
from types import SimpleNamespace

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxpaged import LLM, SamplingParams
from jaxpaged.layers.quant import Int8Panels, QuantizedWeight, dequantize, quantized_dense
from jaxpaged.models import build_model, load_hf_config, model_config_from_hf
from jaxpaged.models.gguf_blocks import gguf_host_quant
from jaxpaged.models.param_tree import param_shapes
from jaxpaged.models.quantize import device_weight, quantize_fp8, quantize_int8, resolve_quantization, vocab_groups
from jaxpaged.models.registry import load_weights
from pallas_kernels import cpu_onednn
from tests.reference import hf_greedy, our_last_logits_batch
from tests.tiny_models import load_hf_model

N_OUT, N_IN = 6, 512


def gguf_tensor(kind: str, rng) -> SimpleNamespace:
    """A [N_OUT, N_IN] tensor of `kind` as GGUFReader gives it: quantized by gguf, or (Q4_K, which gguf cannot
    quantize) random blocks with finite float16 scales."""
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "Q4_K":
        raw = rng.integers(0, 256, size=(N_OUT, N_IN // 256, 144), dtype=np.uint8)
        raw[..., 0:4] = np.abs(rng.standard_normal((N_OUT, N_IN // 256, 2)) * 0.01).astype(np.float16).view(np.uint8)
        data = raw.reshape(N_OUT, -1)
    else:
        data = gguf.quants.quantize(rng.standard_normal((N_OUT, N_IN)).astype(np.float32), qtype)
    return SimpleNamespace(name="blk.0.ffn_up.weight", tensor_type=qtype, shape=np.array([N_IN, N_OUT]), data=data)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_0"])
def test_gguf_blocks_decode_as_gguf_dequantizes(kind):
    rng = np.random.default_rng(0)
    t = gguf_tensor(kind, rng)
    expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(N_OUT, N_IN).T  # [in, out]
    h = gguf_host_quant(t)
    assert h.shape == (N_IN, N_OUT)
    step = 0.0 if kind != "Q5_0" else np.abs(expected).max() / 127  # (Q5_0: requantized to int8 blocks of 32)
    np.testing.assert_allclose(h.dequantize(), expected, rtol=1e-6, atol=step / 2 + 1e-7)
    assert h.bits == (4 if kind.startswith("Q4") else 8)
    if kind != "Q5_0":
        assert h.scale.shape == (N_IN // 32, N_OUT)  # (kept in blocks of 32 rows)
    on_device = np.asarray(dequantize(device_weight(h)))
    np.testing.assert_allclose(on_device, h.dequantize(), rtol=1e-6, atol=1e-7)


def test_gguf_rows_fix_applies_to_codes_and_scales():
    rng = np.random.default_rng(1)
    t = gguf_tensor("Q4_1", rng)
    flipped = gguf_host_quant(t, lambda a: a[::-1])
    np.testing.assert_allclose(flipped.dequantize(), gguf_host_quant(t).dequantize()[:, ::-1], rtol=1e-6)


@pytest.mark.parametrize("form", ["int8", "int8-groups", "fp8", "q4-affine"])
def test_quantized_dense_equals_the_dot_with_dequantized_weights(form):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    if form == "q4-affine":
        codes = rng.integers(0, 16, size=(64, 48)).astype(np.uint8)
        from jaxpaged.models.quantize import HostQuant

        h = HostQuant(codes, rng.random((2, 48)).astype(np.float32), rng.standard_normal((2, 48)).astype(np.float32), 4)
    else:
        h = {"int8": lambda: quantize_int8(w), "int8-groups": lambda: quantize_int8(w, 4),
             "fp8": lambda: quantize_fp8(w)}[form]()
    qw = device_weight(h)
    assert qw.shape == (64, 48) and (qw.codes.shape[0] == 32) == (form == "q4-affine")  # (two codes a byte)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    np.testing.assert_allclose(np.asarray(quantized_dense(x, qw)), np.asarray(x) @ h.dequantize(), rtol=1e-5,
                               atol=1e-4)
    if form != "q4-affine":  # (random codes: no float weight behind them)
        assert np.abs(h.dequantize() - w).max() < (0.08 * np.abs(w).max() if form == "fp8" else 0.03)


def test_int8_integer_gemm_is_exact():
    if cpu_onednn.pack_s8(np.zeros((64, 64), np.int8)) is None:
        pytest.skip("oneDNN's int8 GEMM is not available here (needs AVX512-VNNI or AMX)")
    rng = np.random.default_rng(3)
    q = rng.integers(-127, 128, size=(576, 960)).astype(np.int8)
    x = rng.integers(-127, 128, size=(24, 576)).astype(np.int8)
    y = np.asarray(cpu_onednn.onednn_dense_s8(jnp.asarray(x), jnp.asarray(cpu_onednn.pack_s8(q)), 960, 20))
    np.testing.assert_array_equal(y[:20], x[:20].astype(np.int64) @ q.astype(np.int64))
    assert not y[20:].any()


def dequantized_weights(weights: dict, method: str) -> dict:
    """The float weights a `method`-quantized model computes with (per output channel; the vocabulary table in
    groups of 32 of the LM head's [E, V] form)."""
    def roundtrip(w, groups=1):
        return (quantize_int8(w, groups) if method == "int8" else quantize_fp8(w)).dequantize()

    out = dict(weights)
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        out["layers." + name] = roundtrip(np.asarray(weights["layers." + name], np.float32))
    table = np.asarray(weights["embed"], np.float32).T
    out["embed"] = roundtrip(table, vocab_groups(table.shape[0])).T
    if "lm_head" in weights:
        head = np.asarray(weights["lm_head"], np.float32)
        out["lm_head"] = roundtrip(head, vocab_groups(head.shape[0]))
    return out


@pytest.mark.parametrize("method,layout", [("int8", "per-layer"), ("int8", "stacked"), ("fp8", "per-layer")])
def test_quantized_model_logits_equal_the_dequantized_model(tiny_model_dir, method, layout):
    path = tiny_model_dir("llama")
    cfg = model_config_from_hf(path, load_hf_config(path), "float32")
    weights = load_weights(cfg)
    per_layer = layout == "per-layer"
    quantized = build_model(dataclasses.replace(cfg, quantization=method), weights=dict(weights),
                            per_layer=per_layer)
    layers = quantized.params()["layers"]
    assert isinstance((layers[0] if per_layer else layers)["w_gate_up"], QuantizedWeight)
    assert isinstance(quantized.params()["embed"], QuantizedWeight)
    reference = build_model(cfg, weights=dequantized_weights(weights, method), per_layer=per_layer)
    plain = build_model(cfg, weights=weights, per_layer=per_layer)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (1, 9, 40)]
    ours, ref, orig = (our_last_logits_batch(m, prompts) for m in (quantized, reference, plain))
    assert max(float(np.abs(a - b).max()) for a, b in zip(ours, ref)) < 1e-4
    assert max(float(np.abs(a - b).max()) for a, b in zip(ours, orig)) > 1e-3  # (the quantization is real)


def hf_with_dequantized_weights(path: str, method: str):
    hf = load_hf_model(path)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            w = p.detach().numpy().astype(np.float32)
            if name.endswith("embed_tokens.weight"):  # [V, E]: groups of 32 of E per token
                w = (quantize_int8(w.T, vocab_groups(w.shape[1])) if method == "int8" else quantize_fp8(w.T))
                p.copy_(torch.from_numpy(w.dequantize().T.copy()))
            elif p.ndim == 2 and "layers." in name:  # [out, in] Linear weights: per output channel
                q = quantize_int8(w.T) if method == "int8" else quantize_fp8(w.T)
                p.copy_(torch.from_numpy(q.dequantize().T.copy()))
    return hf


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_engine_greedy_equals_hf_on_the_dequantized_weights(tiny_model_dir, method):
    path = tiny_model_dir("llama")
    hf = hf_with_dequantized_weights(path, method)
    llm = LLM(model=path, quantization=method, attention_backend="reference", compile_guard=True,
              max_num_seqs=4, num_kv_blocks=64)
    held = jax.tree.leaves(llm.engine.core.runner.state, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    assert sum(isinstance(x, QuantizedWeight) for x in held) >= 4 * 2  # (every layer's matmuls, kept quantized)
    rng = np.random.default_rng(6)  # (prompts whose greedy steps keep a top-2 logit margin > 0.02 in both)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (3, 17, 30)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == hf_greedy(hf, p, 12)


def test_cpu_integer_gemm_model_runs_close_to_the_dequantized_one(tiny_model_dir, monkeypatch):
    """The CPU integer form ($JAXPAGED_CPU_INT8_GEMM=1): wo and gate/up as int8 panels (inputs quantized per
    row), the rest oneDNN bf16 from the dequantized weights; logits within 5% of the largest of the weight-only
    model's."""
    monkeypatch.setenv("JAXPAGED_CPU_INT8_GEMM", "1")
    if not cpu_onednn.available() or cpu_onednn.pack_s8(np.zeros((64, 64), np.int8)) is None:
        pytest.skip("oneDNN's int8 GEMM is not available here")
    path = tiny_model_dir("llama")
    cfg = dataclasses.replace(model_config_from_hf(path, load_hf_config(path), "float32"), quantization="int8")
    weights = load_weights(cfg)
    packed = build_model(cfg, weights=dict(weights), per_layer=True, attention_backend="cpu")
    assert isinstance(packed.params()["layers"][0]["w_gate_up"], Int8Panels)
    assert not packed.pays_for_padding
    plain = build_model(cfg, weights=dict(weights), per_layer=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (2, 33)]
    for a, b in zip(our_last_logits_batch(packed, prompts), our_last_logits_batch(plain, prompts)):
        assert np.abs(a - b).max() < 0.05 * np.abs(b).max()


def test_quantization_flag_errors():
    with pytest.raises(ValueError, match="quantization must be one of"):
        resolve_quantization("int3", None, False)
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_quantization("gguf", None, False)
    bnb = SimpleNamespace(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported"):
        resolve_quantization(None, bnb, False)
    fp8 = SimpleNamespace(quantization_config={"quant_method": "fp8"})
    assert resolve_quantization(None, fp8, False) == "fp8"
    with pytest.raises(ValueError, match="quantized as 'fp8'"):
        resolve_quantization("int8", fp8, False)
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(quantization="q4")


def test_default_model_gguf_blocks_kept(smollm2_path):
    """SmolLM2's Q4_1 / Q8_0 blocks kept: logits equal the dequantized model's, in ~0.36x bf16's bytes."""
    cfg = model_config_from_hf(smollm2_path, load_hf_config(smollm2_path), "float32")
    kept = build_model(dataclasses.replace(cfg, quantization="gguf"), per_layer=True)
    w = kept.params()["layers"][0]["w_gate_up"]
    assert isinstance(w, QuantizedWeight) and w.bits == 4 and w.scale.dtype == jnp.float16
    nbytes = sum(x.nbytes for x in jax.tree.leaves(kept.params()))
    bf16_bytes = 2 * sum(int(np.prod(s)) for s in param_shapes(cfg).values())
    assert nbytes < 0.4 * bf16_bytes
    plain = build_model(cfg, per_layer=True)
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(100, 160))]
    for a, b in zip(our_last_logits_batch(kept, prompts), our_last_logits_batch(plain, prompts)):
        assert np.abs(a - b).max() < 1e-3


def write_fp8_checkpoint(src: str, dst: str) -> None:
    """`src`'s HF folder as an fp8 checkpoint (vLLM's/llm-compressor's "fp8" layout): every decoder Linear weight
    float8_e4m3fn [out, in] with a per-channel weight_scale [out, 1], the rest as it was."""
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    [name] = [f for f in os.listdir(dst) if f.endswith(".safetensors")]
    tensors = load_file(os.path.join(dst, name))
    out = {}
    for key, t in tensors.items():
        if key.startswith("model.layers.") and key.endswith("proj.weight"):
            q = quantize_fp8(t.float().numpy().T)  # [in, out] codes, [1, out] scales
            out[key] = torch.from_numpy(q.codes.T.astype(np.float32).copy()).to(torch.float8_e4m3fn)
            out[key + "_scale"] = torch.from_numpy(q.scale.reshape(-1, 1).copy())
        else:
            out[key] = t
    save_file(out, os.path.join(dst, name))
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)


def test_fp8_checkpoint_detected_and_kept(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    dst = str(tmp_path / "fp8")
    write_fp8_checkpoint(src, dst)
    cfg = model_config_from_hf(dst, load_hf_config(dst), "float32")
    assert cfg.quantization == "fp8"  # (from quantization_config)
    model = build_model(cfg, per_layer=True)
    w = model.params()["layers"][0]["wqkv"]
    assert isinstance(w, QuantizedWeight) and w.codes.dtype == jnp.float8_e4m3fn
    assert not isinstance(model.params()["embed"], QuantizedWeight)  # (the checkpoint's tables stay as they are)
    base = model_config_from_hf(src, load_hf_config(src), "float32")
    weights = load_weights(base)
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        weights["layers." + name] = quantize_fp8(np.asarray(weights["layers." + name])).dequantize()
    reference = build_model(base, weights=weights, per_layer=True)
    prompts = [[5, 9, 33, 2], list(range(3, 40))]
    for a, b in zip(our_last_logits_batch(model, prompts), our_last_logits_batch(reference, prompts)):
        assert np.abs(a - b).max() < 1e-4
