"""Greedy tokens and logits of our Llama-family model equal HF transformers' on tiny random models."""

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.models import build_model, load_hf_config, model_config_from_hf, param_tree
from pallas_kernels import cpu_dense
from tests.reference import hf_greedy, hf_last_logits, our_last_logits_batch
from tests.tiny_models import load_hf_model

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "mistral-window"]  # (window 8 against prompts up to 100 tokens)
# the families that differ from Llama in ModelConfig fields: Gemma (norm offset, GELU, embedding scale), Granite
# (multipliers), Phi-3 (fused checkpoint tensors, partial rotary; LongRoPE), YaRN RoPE, experts; Gemma 3 (sliding
# and full layers with their own RoPE, q/k norms, norms around each block), Gemma 2 (soft-capping)
VARIANT_ARCHS = ["gemma", "gemma2", "gemma3", "granite", "phi3", "phi3-longrope", "qwen2-yarn",
                 "mixtral", "qwen3-moe", "qwen2-moe"]  # mixtures of experts (Qwen2-MoE: with a shared expert)
PROMPT_LENS = [1, 5, 16, 17, 31, 40, 64, 100]


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, size=n).tolist() for n in PROMPT_LENS]


# CPU and GPU weight layouts; packed: the CPU kernels' (dense on packed weights, the C++ attention and rotary
# tables). The variants per layer, and in the other layouts where they take another path there (the CPU rotary
# tables of partial / LongRoPE / YaRN RoPE, the CPU attention's scale, stacked experts, Gemma 3's refusal).
LOGIT_CASES = ([(a, layout) for a in ARCHS for layout in ("per-layer", "stacked", "packed")]
               + [(a, "per-layer") for a in VARIANT_ARCHS]
               + [(a, "packed") for a in ("phi3-longrope", "qwen2-yarn", "granite", "qwen3-moe", "gemma2")]
               + [(a, "stacked") for a in ("qwen2-moe", "gemma3")])


@pytest.mark.parametrize("arch,layout", LOGIT_CASES)
def test_last_position_logits_match_hf(arch, tiny_model_dir, layout):
    path = tiny_model_dir(arch)
    hf = load_hf_model(path)
    per_layer = layout != "stacked"
    backend = "cpu" if layout == "packed" else "reference"
    if backend == "cpu" and not cpu_dense.panel():
        pytest.skip("the CPU kernels cannot be built here")
    cfg = model_config_from_hf(path, load_hf_config(path), "float32")
    if not cfg.uniform_layers and not per_layer:  # (Gemma 3's sliding and full layers run per layer)
        with pytest.raises(ValueError, match="per-layer layout"):
            build_model(cfg, per_layer=False)
        assert isinstance(build_model(cfg).params()["layers"], list)
        return
    model = build_model(cfg, per_layer=per_layer, attention_backend=backend)
    assert isinstance(model.params()["layers"], list) == per_layer
    assert not per_layer or (model.params()["layers"][0]["wqkv"].ndim == 3) == (backend == "cpu")
    worst = 0.0
    for ids, ours in zip(prompts(), our_last_logits_batch(model, prompts())):
        worst = max(worst, float(np.abs(ours - hf_last_logits(hf, ids)).max()))
    print(f"{arch}: max |logits - HF| = {worst:.2e}")
    assert worst < 1e-4


def test_tied_float32_cpu_params_carry_their_own_lm_head(tiny_model_dir, monkeypatch):
    """XLA:CPU's dot transposes a tied [V, E] table at every LM-head call, so per-layer (CPU) float32 params carry
    an [E, V] copy (the test above holds their logits to HF's); stacked and bf16 params, and tables over the
    size cap, use the table."""
    path = tiny_model_dir("qwen2")  # (tied)
    cfg = model_config_from_hf(path, load_hf_config(path), "float32")
    params = build_model(cfg, per_layer=True).params()
    np.testing.assert_array_equal(np.asarray(params["lm_head"]), np.asarray(params["embed"]).T)
    assert "lm_head" not in build_model(cfg, per_layer=False).params()
    bf16 = model_config_from_hf(path, load_hf_config(path), "bfloat16")
    assert "lm_head" not in build_model(bf16, per_layer=True).params()
    monkeypatch.setattr(param_tree, "TIED_HEAD_COPY_MAX_BYTES", 0)
    assert "lm_head" not in build_model(cfg, per_layer=True).params()


@pytest.mark.parametrize("arch,async_scheduling", [(a, s) for a in ARCHS for s in (True, False)]
                         + [(a, True) for a in ("gemma2", "gemma3", "phi3-longrope", "qwen3-moe")],  # (engine
                         # paths of their own: the attention swap, per-layer windows, CPU rotary tables, experts)
                         ids=lambda x: {True: "async", False: "sync"}.get(x, x) if isinstance(x, bool) else x)
def test_batched_greedy_matches_hf_token_for_token(arch, tiny_model_dir, async_scheduling):
    path = tiny_model_dir(arch)
    hf = load_hf_model(path)
    llm = LLM(path, max_num_batched_tokens=128, num_kv_blocks=64, compile_guard=True, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(prompts(), params, use_tqdm=False)
    for ids, out in zip(prompts(), outs):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 32), f"{arch}: prompt of {len(ids)} tokens"
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("arch", ["llama", "mistral-window"])
def test_plain_jax_attention_matches_hf(arch, tiny_model_dir):
    """The plain-JAX attention (what runs on a CPU without a C++ compiler): greedy tokens still equal HF's."""
    path = tiny_model_dir(arch)
    hf = load_hf_model(path)
    llm = LLM(path, max_num_batched_tokens=128, num_kv_blocks=64, compile_guard=True, attention_backend="reference")
    assert llm.engine.config.attention_backend == "reference"
    outs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for ids, out in zip(prompts(), outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 24), f"{arch}: prompt of {len(ids)} tokens"


def test_pallas_backends_in_the_interpreter_match_hf(tiny_model_dir):
    """Attention and sampling through the Pallas kernels (interpreted): greedy rows still equal HF, token for
    token, in batches where other rows sample (so the sampling kernel runs on mixed rows)."""
    path = tiny_model_dir("llama")
    hf = load_hf_model(path)
    llm = LLM(path, max_num_batched_tokens=128, num_kv_blocks=64, compile_guard=True,
              attention_backend="pallas", sampler_backend="pallas")
    assert llm.engine.config.attention_backend == "pallas-interpret"
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_k=3, top_p=0.9, seed=5, max_tokens=16, ignore_eos=True)
    ps = prompts()
    outs = llm.generate(ps, [greedy if i % 2 == 0 else sampled for i in range(len(ps))], use_tqdm=False)
    for i, (ids, out) in enumerate(zip(ps, outs)):
        if i % 2 == 0:
            assert out.outputs[0].token_ids == hf_greedy(hf, ids, 16), f"prompt of {len(ids)} tokens"
        else:  # each sampled token is among HF's top 3 after the tokens before it
            toks = out.outputs[0].token_ids
            assert len(toks) == 16
            for j, tok in enumerate(toks):
                assert tok in np.argsort(-hf_last_logits(hf, ids + toks[:j]))[:3]


def test_pallas_attention_variant_in_the_engine_matches_hf(tiny_model_dir, monkeypatch):
    """The Triton attention's wider steps and split contexts ($JAXPAGED_PALLAS_ATTENTION, interpreted) under the
    engine's own steps (decodes, prefill chunks, padding): greedy tokens still equal HF's."""
    from pallas_kernels import paged_attention

    monkeypatch.setenv("JAXPAGED_PALLAS_ATTENTION", "kv_blocks=2,num_splits=3")
    traced, real = set(), paged_attention._ragged_paged_attention

    def spy(*args, **kw):
        traced.add((kw["kv_blocks"], kw["num_splits"]))
        return real(*args, **kw)

    monkeypatch.setattr(paged_attention, "_ragged_paged_attention", spy)
    path = tiny_model_dir("llama")
    hf = load_hf_model(path)
    llm = LLM(path, max_num_batched_tokens=128, num_kv_blocks=64, compile_guard=True, attention_backend="pallas")
    outs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert traced == {(2, 3)}  # the engine's steps ran the variant
    for ids, out in zip(prompts(), outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, 12), f"prompt of {len(ids)} tokens"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bfloat16_weights_keep_float32_activations_on_cpu(arch, tiny_model_dir):
    """bf16 weights on a CPU: float32 residual stream, bf16 matmul inputs with float32 accumulation. Logits are
    as close to HF float32 on the same bf16-rounded weights as HF computing in bf16 is (measured: 0.12 vs 0.11
    on llama; a wrong cast or layout is off by whole units)."""
    import torch

    path = tiny_model_dir(arch)
    cfg = model_config_from_hf(path, load_hf_config(path), "bfloat16")
    assert (cfg.dtype, cfg.compute_dtype) == ("bfloat16", "float32")
    model = build_model(cfg)
    hf_rounded = load_hf_model(path).to(torch.bfloat16).to(torch.float32)
    hf_bf16 = load_hf_model(path).to(torch.bfloat16)
    ours_err = bf16_err = 0.0
    for ids, ours in zip(prompts(), our_last_logits_batch(model, prompts())):
        ref = hf_last_logits(hf_rounded, ids)
        with torch.no_grad():
            full_bf16 = hf_bf16(torch.tensor([ids])).logits[0, -1].float().numpy()
        ours_err = max(ours_err, float(np.abs(ours - ref).max()))
        bf16_err = max(bf16_err, float(np.abs(full_bf16 - ref).max()))
    print(f"{arch}: max |logits - HF on bf16 weights|: ours {ours_err:.2e}, HF in bf16 {bf16_err:.2e}")
    assert ours_err < 1.5 * bf16_err
