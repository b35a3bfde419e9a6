"""The scheduler's LoRA slots: a resident adapter is reused, a load takes a free slot, else the least recently
released unpinned one, and a pinned slot is never taken."""

from jaxpaged.core.lora_slots import LoRASlots


def test_slots_pin_reuse_and_evict_lru():
    s = LoRASlots(2)
    assert s.take("a") == (0, True) and s.take("a") == (0, False)
    assert s.take("b") == (1, True)
    assert not s.can_take("c")  # both pinned
    s.release(1)  # b unpinned
    assert s.can_take("c") and s.can_take("a")
    assert s.take("c") == (1, True)  # b's slot: the only unpinned one
    s.release(0)
    s.release(0)
    s.release(1)  # a released before c: a's slot goes first
    assert s.take("b") == (0, True)
    assert s.take("c") == (1, False)  # still resident
    assert s.num_loads == 4
