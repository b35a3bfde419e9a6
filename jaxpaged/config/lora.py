"""`LoRAConfig`: multi-LoRA serving's limits (vLLM's --max-loras, --max-lora-rank, --max-cpu-loras)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAConfig:
    """max_loras: adapters resident on the device at once (slots of the LoRA stack; a step mixes any of them and
    the base model). max_lora_rank: the largest rank an adapter may have (every slot is this wide).
    max_cpu_loras: adapters kept in host memory (least recently used dropped past it; re-read from their
    folder when asked again); None: max(max_loras, 8)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self):
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_cpu_loras is not None and (isinstance(self.max_cpu_loras, bool)
                                               or not isinstance(self.max_cpu_loras, int)
                                               or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras={self.max_loras}, got "
                             f"{self.max_cpu_loras!r}")

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else max(self.max_loras, 8)
