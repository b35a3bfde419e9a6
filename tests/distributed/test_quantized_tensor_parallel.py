"""Quantized weights under tensor parallelism (8 forced CPU devices, tests/conftest.py): codes, scales and offsets
sharded with their weights, the fused q/k/v and gate/up groups per device, replicated KV heads; the same logits and
engine outputs as one device."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxpaged.distributed.tensor_parallel import tensor_parallel_mesh
from jaxpaged.layers.quant import QuantizedWeight
from jaxpaged.models import build_model, load_hf_config, model_config_from_hf
from tests.distributed.workload import run
from tests.quant_checkpoints import write_quantized_checkpoint
from tests.reference import our_last_logits

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS, tests/conftest.py)")


@pytest.mark.parametrize("form, per_layer", [("gptq-act-order", True), ("awq", False), ("int8", True)])
def test_quantized_logits_equal_one_device(form, per_layer, tiny_model_dir, tmp_path):
    path = tiny_model_dir("llama")
    if form == "int8":
        cfg = dataclasses.replace(model_config_from_hf(path, load_hf_config(path), "float32"), quantization="int8")
    else:
        path = str(tmp_path / form)
        write_quantized_checkpoint(tiny_model_dir("llama"), path, form.split("-")[0],
                                   act_order=form == "gptq-act-order")
        cfg = model_config_from_hf(path, load_hf_config(path), "float32")
    ids = np.random.default_rng(1).integers(3, 256, size=37).tolist()
    want = our_last_logits(build_model(cfg, per_layer=per_layer), ids)
    for tp in (2, 4):  # (4: the two KV heads replicated, codes and scales alike)
        model = build_model(cfg, per_layer=per_layer, mesh=tensor_parallel_mesh(tp))
        layers = model.params()["layers"]
        layer = layers[0] if per_layer else layers
        lead = () if per_layer else (None,)
        qkv, wo = layer["wqkv"], layer["wo"]
        assert isinstance(qkv, QuantizedWeight) and isinstance(wo, QuantizedWeight)
        assert qkv.codes.sharding.spec == P(*lead, None, "tp") and qkv.scale.sharding.spec == P(*lead, None, "tp")
        assert wo.codes.sharding.spec == P(*lead, "tp", None)  # (row-parallel: its groups split where they divide)
        np.testing.assert_allclose(our_last_logits(model, ids), want, atol=2e-5, rtol=1e-5)


def test_quantized_engine_outputs_equal_one_device(tiny_model_dir):
    """(One device on the plain-JAX path: the CPU's packed one runs quantized weights as bf16.)"""
    path = tiny_model_dir("llama")
    one = run(path, quantization="int8", attention_backend="reference")
    assert run(path, tensor_parallel_size=2, quantization="int8", attention_backend="reference") == one
