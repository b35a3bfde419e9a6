"""`LoRASlots`: which adapter each slot of the device's LoRA stack holds, and which slots running requests pin.

The scheduler decides which adapters are resident: a request with an adapter is admitted only when its adapter
has a slot or one can be taken (a free slot, else the least recently used one no running request pins), and
the load travels to the runner in `SchedulerOutput.lora_loads`. Plain Python: an adapter is anything with a
`fingerprint` (its content's hash), so one adapter loaded twice reuses its slot and a changed one does not.
"""

from __future__ import annotations


class LoRASlots:
    """S slots; slot -> (adapter fingerprint or None, running requests using it, when last released)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.holder: list[str | None] = [None] * num_slots
        self.users = [0] * num_slots
        self.released_at = [0] * num_slots  # a counter: the least recently used unpinned slot is taken first
        self._clock = 0
        self.num_loads = 0

    def slot_of(self, fingerprint: str) -> int:
        """The slot holding this adapter, or -1."""
        try:
            return self.holder.index(fingerprint)
        except ValueError:
            return -1

    def can_take(self, fingerprint: str) -> bool:
        """Whether a request of this adapter can run now (resident, or a slot is free or unpinned)."""
        return self.slot_of(fingerprint) >= 0 or 0 in self.users

    def take(self, fingerprint: str) -> tuple[int, bool]:
        """Pin a slot for one running request of this adapter; returns (slot, whether it must be loaded). Call
        only after `can_take`."""
        slot = self.slot_of(fingerprint)
        load = slot < 0
        if load:
            free = [s for s in range(self.num_slots) if self.users[s] == 0]
            empty = [s for s in free if self.holder[s] is None]
            slot = empty[0] if empty else min(free, key=self.released_at.__getitem__)
            self.holder[slot] = fingerprint
            self.num_loads += 1
        self.users[slot] += 1
        return slot, load

    def release(self, slot: int) -> None:
        """A request that pinned `slot` stopped running (finished, aborted or preempted)."""
        self.users[slot] -= 1
        self._clock += 1
        self.released_at[slot] = self._clock

    def pin(self, req, loads: list) -> None:
        """Pin the slot of a request that starts running with an adapter (`req.lora`) as `req.lora_slot`; a
        slot that must be (re)loaded is appended to `loads` as (slot, adapter), for the runner."""
        req.lora_slot, load = self.take(req.lora.fingerprint)
        if load:
            loads.append((req.lora_slot, req.lora))

    def unpin(self, req) -> None:
        """A request that stopped running gives its slot back."""
        self.release(req.lora_slot)
        req.lora_slot = -1
