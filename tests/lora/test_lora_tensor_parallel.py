"""LoRA under tensor parallelism (8 forced CPU devices): adapters sharded with their layers, k/v updates
repeated where the mesh replicates KV heads; greedy outputs equal HF's with each adapter merged."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxpaged import LoRARequest
from jaxpaged.distributed.tensor_parallel import AXIS
from tests.lora.test_lora_parity import GREEDY, engine, hf_outputs, prompts

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS, tests/conftest.py)")


@pytest.mark.parametrize("tp", [2, 4])  # the tiny Llama's 2 KV heads: split over 2 devices, replicated over 4
def test_mixed_adapters_equal_hf(lora_setup, tp):
    base, adapters = lora_setup
    llm = engine(base, max_loras=2, tensor_parallel_size=tp)
    requests = {"a1": LoRARequest("a1", 1, adapters["a1"]), "a2": LoRARequest("a2", 2, adapters["a2"]), None: None}
    cases = list(zip(prompts(5, [9, 21, 4]), ["a2", None, "a1"]))
    outs = llm.generate([ids for ids, _ in cases], GREEDY, lora_request=[requests[n] for _, n in cases])
    assert [o.outputs[0].token_ids for o in outs] == hf_outputs(base, adapters, cases)
    layer = llm.engine.runner.state["layers"][0]  # (after the loads: still split over N, beside wq's columns)
    assert layer["lora_b_q"].value.sharding.spec == P(None, None, AXIS)
    assert layer["lora_a_o"].value.sharding.spec == P(AXIS, None, None, None)
