"""kv_cache_dtype: a narrower KV pool (bf16, fp16, fp8) than the model, in the engine and the functional API."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged import functional as F
from pallas_kernels.kv_storage import decode, logical_dtype
from tests.engine.test_engine_schedules import NEW_TOKENS, prompts

POOL = {"auto": "float32", "bfloat16": "bfloat16", "float16": "float16", "fp8_e4m3": "float8_e4m3fn",
        "fp8_e5m2": "float8_e5m2"}


def greedy(llm) -> list[list[int]]:
    outs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def functional_greedy(path, kv_cache_dtype, scales: bool = True) -> list[list[int]]:
    config, params = F.load(path)
    if scales and kv_cache_dtype.startswith("fp8"):  # (as the engine calibrates them)
        params = F.with_kv_scales(config, params, F.load_tokenizer(path), kv_cache_dtype)
    out = F.generate(config, params, *F.pad_batch(prompts()), jax.random.key(0), max_new_tokens=NEW_TOKENS,
                     kv_cache_dtype=kv_cache_dtype)
    return np.asarray(out).tolist()


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8_e4m3"])
def test_pool_dtype_memory_and_outputs(tiny_model_dir, kv_cache_dtype):
    """The pool has the asked dtype, the same memory holds 2x (bf16) or 4x (fp8) the float32 blocks, the
    metrics say so, and the engine's greedy tokens equal the functional API's on the same KV dtype (both
    round K/V the same way when they write them)."""
    path = tiny_model_dir("llama")
    kw = dict(kv_cache_memory="2MiB", max_num_batched_tokens=128, compile_guard=True)
    base = LLM(path, **kw).engine.config.cache_config.num_blocks
    llm = LLM(path, kv_cache_dtype=kv_cache_dtype, **kw)
    assert str(logical_dtype(llm.engine.runner.kv_pool.dtype)) == POOL[kv_cache_dtype]
    blocks = llm.engine.config.cache_config.num_blocks
    assert blocks == base * (4 // jnp.dtype(POOL[kv_cache_dtype]).itemsize)
    text = llm.engine.metrics.render().decode()
    assert f'cache_dtype="{POOL[kv_cache_dtype]}"' in text and f'num_gpu_blocks="{blocks}"' in text
    assert greedy(llm) == functional_greedy(path, kv_cache_dtype)


def test_swapped_narrow_blocks_come_back_exactly(tiny_model_dir):
    """Swap preemption moves bf16 blocks to host memory and back bit for bit: outputs equal a run with room."""
    path = tiny_model_dir("llama")
    roomy = greedy(LLM(path, kv_cache_dtype="bfloat16", num_kv_blocks=64, max_num_batched_tokens=64))
    llm = LLM(path, kv_cache_dtype="bfloat16", num_kv_blocks=13, max_num_batched_tokens=64, preemption_mode="swap",
              swap_space=1e-3, compile_guard=True)
    assert greedy(llm) == roomy
    assert llm.engine.scheduler.num_swaps > 0


@pytest.mark.parametrize("dtype,big", [(jnp.float8_e4m3fn, 448.0), (jnp.float16, 65504.0),
                                       (jnp.bfloat16, 999424.0)])  # (1e6 in bf16: in range, rounded)
def test_narrow_writes_round_and_saturate(dtype, big):
    """Stored as integers of their width, read back as the rounded value; past the range: the largest finite
    value (fp8 e4m3 has no infinity), never NaN."""
    from jaxpaged.layers.attention import empty_kv_pool, write_kv

    pool = empty_kv_pool(1, 2, 16, 1, 4, dtype)
    assert pool.dtype.kind in "ui" and pool.dtype.itemsize == jnp.dtype(dtype).itemsize
    k = jnp.asarray([[[1e6, 1.3, -2.7, 0.1]]], jnp.float32)
    pool = write_kv(pool, jnp.int32(0), k, -k, jnp.asarray([16], jnp.int32))
    got_k, got_v = decode(pool[0, 0, 1, 0, 0]), decode(pool[0, 1, 1, 0, 0])
    want = jnp.clip(k[0, 0], -big, big).astype(dtype).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(got_k), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got_v), -np.asarray(want))
    assert float(got_k[0]) == big


def test_vllm_fp8_alias_is_e4m3():
    from jaxpaged.config import kv_pool_dtype

    assert kv_pool_dtype("fp8", "float32") == kv_pool_dtype("fp8_e4m3", "float32") == "float8_e4m3fn"
    assert kv_pool_dtype("auto", "bfloat16") == "bfloat16"


def test_bad_kv_cache_dtype_is_refused_before_loading():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM("no-such-model", kv_cache_dtype="int4")


def scaled_k(tiny_model_dir, tmp_path, factor: float) -> str:
    """The tiny llama with K projections times `factor` and Q projections divided by it: the same attention
    scores and outputs in float32, but K values far past fp8 e4m3's largest (448) for a large factor."""
    import torch

    from tests.tiny_models import load_hf_model, make_tokenizer

    model = load_hf_model(tiny_model_dir("llama"))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(factor)
            layer.self_attn.q_proj.weight.div_(factor)
    path = str(tmp_path / f"k{factor:g}")
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer().save_pretrained(path)
    return path


def test_fp8_scales_keep_large_keys_in_range(tiny_model_dir, tmp_path):
    """Per-layer and per-head scales make an fp8 pool indifferent to K's magnitude: with K 2000x larger (and Q
    2000x smaller: the float32 model is unchanged), the engine's fp8 outputs stay those of the original model;
    unscaled (calculate_kv_scales=False, vLLM's scale of 1.0) the keys saturate and the outputs change."""
    big = scaled_k(tiny_model_dir, tmp_path, 2000.0)
    kw = dict(kv_cache_dtype="fp8_e4m3", num_kv_blocks=128, max_num_batched_tokens=128, compile_guard=True)
    assert greedy(LLM(big, max_num_batched_tokens=128)) == greedy(LLM(tiny_model_dir("llama"),
                                                                      max_num_batched_tokens=128))
    reference = greedy(LLM(tiny_model_dir("llama"), **kw))
    llm = LLM(big, **kw)
    scale = np.asarray(llm.engine.runner.state["kv_scale"][...])  # [L, 2, KH]
    assert (scale[:, 0] > 100 * scale[:, 1]).all()  # K's scales took the factor, V's did not
    assert greedy(llm) == reference
    unscaled = greedy(LLM(big, calculate_kv_scales=False, **kw))
    agree = np.mean([a == b for x, y in zip(unscaled, reference) for a, b in zip(x, y)])
    assert agree < 0.5, agree
