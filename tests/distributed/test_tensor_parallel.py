"""Tensor parallelism on 8 forced CPU devices (tests/conftest.py): the same outputs as one device, and the
shardings the design names (Megatron-style weights, the KV pool split over KV heads)."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxpaged import LLM
from jaxpaged.distributed.tensor_parallel import check_tensor_parallel, tensor_parallel_mesh
from jaxpaged.models import build_model, load_hf_config, model_config_from_hf
from tests.distributed.workload import GREEDY, baseline, run
from tests.reference import our_last_logits

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS, tests/conftest.py)")


@pytest.mark.parametrize("arch, tp", [
    ("llama", 2),  # GQA, 2 KV heads: one per device
    ("llama", 4),  # ... replicated to 4
    ("llama-mqa", 2),  # one KV head, replicated to every device
    ("llama-mqa", 4),
    ("llama-mha", 2),  # 8 heads and 8 KV heads
    ("llama-mha", 4),
    ("llama-mha", 8),
    ("qwen2", 2),  # q/k/v biases, tied embeddings
    ("qwen2", 4),
    ("qwen2-moe", 2),  # experts (replicated) beside a shared expert (split as the dense MLP)
])
def test_outputs_equal_one_device(arch, tp, tiny_model_dir):
    path = tiny_model_dir(arch)
    assert run(path, tensor_parallel_size=tp) == baseline(path)


def test_layers_of_two_kinds_equal_one_device(tiny_model_dir):
    """Gemma 3's sliding and full layers (a window per layer through shard_map): the same logits on 2 and 4
    devices as on one. (Its tiny random model is too peaked for the sampled workload above.)"""
    path = tiny_model_dir("gemma3")
    cfg = model_config_from_hf(path, load_hf_config(path), "float32")
    ids = np.random.default_rng(1).integers(3, 256, size=37).tolist()
    want = our_last_logits(build_model(cfg), ids)
    for tp in (2, 4):
        got = our_last_logits(build_model(cfg, mesh=tensor_parallel_mesh(tp)), ids)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("per_layer", [True, False], ids=["per-layer", "stacked"])  # CPU and GPU weight layouts
def test_logits_equal_one_device(per_layer, tiny_model_dir):
    path = tiny_model_dir("qwen2")
    cfg = model_config_from_hf(path, load_hf_config(path), "float32")
    ids = np.random.default_rng(1).integers(3, 256, size=37).tolist()
    want = our_last_logits(build_model(cfg, per_layer=per_layer), ids)
    for tp in (2, 4):
        got = our_last_logits(build_model(cfg, per_layer=per_layer, mesh=tensor_parallel_mesh(tp)), ids)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_shardings(tiny_model_dir):
    """Parameters and pool carry the shardings tensor parallelism means; each device holds 1 / tp of the pool."""
    llm = LLM(tiny_model_dir("llama"), tensor_parallel_size=4, num_kv_blocks=8, max_num_batched_tokens=32)
    runner = llm.engine.runner
    assert llm.engine.config.model_config.num_kv_heads == 4  # 2 KV heads, each on 2 devices
    params = nnx.merge(runner.graphdef, runner.state).params()
    layer = params["layers"][0]
    specs = {name: layer[name].sharding.spec for name in ("wqkv", "w_gate_up", "wo", "w_down", "input_norm")}
    assert specs == {"wqkv": P(None, "tp"), "w_gate_up": P(None, "tp"), "wo": P("tp", None), "w_down": P("tp", None),
                     "input_norm": P()}
    assert params["embed"].sharding.spec == P("tp", None)
    assert params["lm_head"].sharding.spec == P(None, "tp")
    pool = runner.kv_pool
    assert pool.sharding.spec == P(None, None, None, None, "tp") and len(pool.sharding.device_set) == 4
    assert {s.data.shape[4] for s in pool.addressable_shards} == {1}
    assert runner.last_token.sharding.is_fully_replicated
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)  # still sharded after steps
    assert runner.kv_pool.sharding.is_equivalent_to(pool.sharding, pool.ndim)
    assert runner.row_state.output_counts.sharding.is_fully_replicated


@pytest.mark.parametrize("tp, field", [(3, "num_attention_heads"), (16, "device"), (0, "tensor_parallel_size")])
def test_bad_sizes_are_refused_before_loading(tp, field, tiny_model_dir):
    with pytest.raises(ValueError, match=field):
        LLM(tiny_model_dir("llama"), tensor_parallel_size=tp)


def test_kv_heads_that_do_not_divide_are_refused(tiny_model_dir):
    path = tiny_model_dir("llama")
    cfg = dataclasses.replace(model_config_from_hf(path, load_hf_config(path), "float32"), num_heads=12,
                              num_kv_heads=4, intermediate_size=192)
    check_tensor_parallel(cfg, 4)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(4\)"):  # 12 heads divide by 6, 4 KV heads do not
        check_tensor_parallel(cfg, 6)


def test_fp8_kv_with_calibrated_scales(tiny_model_dir):
    """Calibrated fp8 scales live on the mesh (replicated) and give one device's outputs."""
    path = tiny_model_dir("llama")
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 13, 40, 7] * 3, [8, 3, 11])]
    outs = []
    for tp in (1, 2):
        llm = LLM(path, tensor_parallel_size=tp, kv_cache_dtype="fp8", num_kv_blocks=16, max_num_batched_tokens=32,
                  compile_guard=True)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
    scales = nnx.merge(llm.engine.runner.graphdef, llm.engine.runner.state).params()["kv_scale"]
    assert scales.sharding.is_fully_replicated and len(scales.sharding.device_set) == 2
    assert outs[0] == outs[1]
