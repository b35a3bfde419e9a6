"""LoRA adapters into the model's device stack (`LlamaForCausalLM.write_lora`), as the scheduler's
`SchedulerOutput.lora_loads` say: the state the compiled steps take gets new arrays of the same shapes, so
nothing recompiles and a step still in flight keeps reading the old ones."""

from __future__ import annotations

from flax import nnx


def load_loras(graphdef, state, loads: list[tuple[int, object]]):
    """The model state with each (slot, adapter) of `loads` written into the LoRA stack."""
    model = nnx.merge(graphdef, state)
    for slot, adapter in loads:
        model.write_lora(slot, adapter)
    return nnx.split(model)[1]


def warm_lora_writes(graphdef, state):
    """The state after compiling the slot writes (warmup; unchanged values), or as it is without a LoRA stack."""
    model = nnx.merge(graphdef, state)
    if not getattr(model, "lora_slots", 0):
        return state
    model.warm_lora_writes()
    return nnx.split(model)[1]
