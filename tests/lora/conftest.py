"""A tiny Llama and PEFT adapters of it (session-scoped: written once per test process)."""

from __future__ import annotations

import pytest

from tests.lora.adapters import make_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="session")
def lora_setup(tiny_model_dir, tmp_path_factory):
    """(base model folder, {name: adapter folder}): "a1" rank 4 on q/v/down, "a2" rank 8 on every projection
    with rslora scaling, "a3" rank 2 on o/gate/up with a rank_pattern (rank 6 for o_proj)."""
    base = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("lora")
    adapters = {
        "a1": make_adapter(base, str(root / "a1"), r=4, targets=["q_proj", "v_proj", "down_proj"], seed=1),
        "a2": make_adapter(base, str(root / "a2"), r=8, targets=ALL, seed=2, rslora=True, alpha=8.0),
        "a3": make_adapter(base, str(root / "a3"), r=2, targets=["o_proj", "gate_proj", "up_proj"], seed=3,
                           rank_pattern={"o_proj": 6}),
    }
    return base, adapters
