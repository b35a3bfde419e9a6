"""The engine's jitted step, in its GPU form (stacked layers, bf16 activations, Pallas attention and sampling,
the structured-output bitmask argument, speculative decoding's verification), lowers for CUDA on a machine
without a GPU."""

import dataclasses
from functools import partial

import pytest

from jaxpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jaxpaged.layers.step_features import ON_DEVICE
from jaxpaged.models import build_model, load_hf_config, model_config_from_hf
from jaxpaged.runner.device_step import device_step as _step
from jaxpaged.runner.model_runner import ModelRunner
from jaxpaged.spec_decode import SpeculativeConfig
from tests.kernels.cuda_lowering import lower_for_cuda


@pytest.mark.parametrize("arch, speculative", [("llama", None), ("qwen2", None), ("llama", 3)],
                         ids=["llama", "qwen2", "llama-speculative"])
def test_engine_step_lowers_for_cuda(arch, speculative, tiny_model_dir):
    path = tiny_model_dir(arch)
    cfg = model_config_from_hf(path, load_hf_config(path), "bfloat16")
    cfg = dataclasses.replace(cfg, activation_dtype="bfloat16")  # what registry picks on a GPU
    model = build_model(cfg, per_layer=False, attention_backend="pallas")
    config = EngineConfig(model_config=cfg, cache_config=CacheConfig(block_size=16, num_blocks=32, dtype="bfloat16"),
                          scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                                           max_model_len=256),
                          attention_backend="pallas", sampler_backend="pallas",
                          speculative=speculative and SpeculativeConfig(num_speculative_tokens=speculative))
    runner = ModelRunner(config, model)
    t = runner.buckets[-1]
    ints, floats = runner._packers[t].pack(runner._template(t))
    step = partial(_step, runner.graphdef, None, config.logprobs_mode, config.sampler_backend, runner.spec_width,
                   runner._packers[t], ON_DEVICE)
    text = lower_for_cuda(step, runner.state, runner.kv_pool, runner.row_state, runner.last_token, ints, floats,
                          runner._free_mask(t), None, None)
    assert "ragged_paged_attention" in text and "top_k_top_p" in text
    assert "jaxpaged_ragged_paged_attention" not in text  # (the CPU kernel's FFI target)


def test_tensor_parallel_step_lowers_for_cuda(tiny_model_dir):
    """The step with tensor parallelism 2 (GPU form): the Pallas attention inside shard_map's manual computation
    over an abstract mesh of two H200s."""
    import jax
    from flax import nnx

    from jaxpaged.distributed.tensor_parallel import tensor_parallel_mesh

    path = tiny_model_dir("llama")
    cfg = dataclasses.replace(model_config_from_hf(path, load_hf_config(path), "bfloat16"), activation_dtype="bfloat16")
    model = build_model(cfg, per_layer=False, attention_backend="pallas", mesh=tensor_parallel_mesh(2))
    config = EngineConfig(model_config=model.cfg,
                          cache_config=CacheConfig(block_size=16, num_blocks=32, dtype="bfloat16"),
                          scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                                           max_model_len=256),
                          attention_backend="pallas", sampler_backend="pallas")
    runner = ModelRunner(config, model)
    gpus = jax.sharding.AbstractMesh((2,), ("tp",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=None, platform="gpu"))
    model.mesh = gpus  # the same model, its shard_map over the GPUs
    graphdef, state = nnx.split(model)
    t = runner.buckets[-1]
    ints, floats = runner._packers[t].pack(runner._template(t))
    step = partial(_step, graphdef, None, config.logprobs_mode, config.sampler_backend, runner.spec_width,
                   runner._packers[t], ON_DEVICE)
    arrays = (state, runner.kv_pool, runner.row_state, runner.last_token, ints, floats, runner._free_mask(t))
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), arrays)
    with jax.sharding.use_abstract_mesh(gpus):
        text = jax.jit(step).trace(*args, None, None).lower(lowering_platforms=("cuda",)).as_text()
    assert "ragged_paged_attention" in text and "manual_computation" in text and "top_k_top_p" in text


def feature_sets():
    """Every flag off, every flag on, and each flag on alone (the flags choose independent pieces of the step)."""
    from jaxpaged.layers.step_features import FLAGS, StepFeatures

    off = {f: False for f in FLAGS}
    return [StepFeatures(**off), StepFeatures(**{f: True for f in FLAGS})] + [
        StepFeatures(**{**off, f: True}) for f in FLAGS]


def test_the_gpu_step_has_no_device_decided_branch(tiny_model_dir):
    """With the branches decided on the host, the GPU step lowers with no conditional for any feature set (a
    conditional on a GPU copies its predicate to the host and stalls the stream), and with layers unrolled, no
    loop outside the kernels; the device-decided form has its conditionals (the check can fail)."""
    path = tiny_model_dir("llama")
    cfg = dataclasses.replace(model_config_from_hf(path, load_hf_config(path), "bfloat16"), activation_dtype="bfloat16")
    model = build_model(cfg, per_layer=True, attention_backend="pallas")
    config = EngineConfig(model_config=cfg, cache_config=CacheConfig(block_size=16, num_blocks=32, dtype="bfloat16"),
                          scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                                           max_model_len=256),
                          attention_backend="pallas", sampler_backend="pallas", branch_on_host=True,
                          speculative=SpeculativeConfig(num_speculative_tokens=2))
    runner = ModelRunner(config, model)
    assert runner.variants.enabled
    t = runner.buckets[-1]
    ints, floats = runner._packers[t].pack(runner._template(t))
    args = (runner.state, runner.kv_pool, runner.row_state, runner.last_token, ints, floats, runner._free_mask(t),
            None, None)

    def lowered(features):
        return lower_for_cuda(partial(_step, runner.graphdef, None, config.logprobs_mode, config.sampler_backend,
                                      runner.spec_width, runner._packers[t], features), *args)

    assert "stablehlo.case" in lowered(ON_DEVICE)
    for features in feature_sets():
        text = lowered(features)
        assert "stablehlo.case" not in text and "stablehlo.if" not in text, features.describe()
        assert "stablehlo.while" not in text, features.describe()


def test_the_lora_step_lowers_for_cuda_without_branches(tiny_model_dir):
    """With a multi-LoRA stack (2 slots of rank 8, stacked layers under lax.scan: the GPU form), the step lowers for
    CUDA and mixes adapters with no conditional: every token's update is the same two matmuls."""
    from jaxpaged.config import LoRAConfig
    from jaxpaged.layers.step_features import FLAGS, StepFeatures

    path = tiny_model_dir("llama")
    cfg = dataclasses.replace(model_config_from_hf(path, load_hf_config(path), "bfloat16"), activation_dtype="bfloat16")
    model = build_model(cfg, per_layer=False, attention_backend="pallas")
    model.add_lora_stack(2, 8)
    config = EngineConfig(model_config=cfg, cache_config=CacheConfig(block_size=16, num_blocks=32, dtype="bfloat16"),
                          scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                                           max_model_len=256),
                          attention_backend="pallas", sampler_backend="pallas", branch_on_host=True,
                          lora=LoRAConfig(max_loras=2, max_lora_rank=8))
    runner = ModelRunner(config, model)
    t = runner.buckets[-1]
    ints, floats = runner._packers[t].pack(runner._template(t))
    features = StepFeatures(**{f: False for f in FLAGS})
    text = lower_for_cuda(partial(_step, runner.graphdef, None, config.logprobs_mode, config.sampler_backend,
                                  runner.spec_width, runner._packers[t], features),
                          runner.state, runner.kv_pool, runner.row_state, runner.last_token, ints, floats,
                          runner._free_mask(t), None, None)
    assert "x3x2x8xbf16" in text  # (the q/k/v stack: [L, K, 3 parts, 2 slots, rank 8])
    assert "stablehlo.case" not in text and "stablehlo.if" not in text
