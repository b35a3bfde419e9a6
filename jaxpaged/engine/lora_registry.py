"""`LoRARegistry`: the LoRA adapters an engine knows, by id, in host memory.

An adapter is read from its folder and checked against the base model the first time a request names it
(`models/lora_adapter.py`: a bad adapter fails that request with an error naming it, before any step), then
kept; past `max_cpu_loras` the least recently used is dropped from host memory (requests holding it keep their
copy) and read again when asked for. Which adapters sit on the device is the scheduler's business
(`core/lora_slots.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

from jaxpaged.config import LoRAConfig, ModelConfig
from jaxpaged.lora_request import LoRARequest
from jaxpaged.models.lora_adapter import LoRAAdapter, load_lora_adapter

logger = logging.getLogger(__name__)


class LoRARegistry:
    def __init__(self, model_config: ModelConfig, config: LoRAConfig):
        """model_config: the base model's (before tensor parallelism replicates its KV heads)."""
        self.model_config = model_config
        self.config = config
        self._adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._known: dict[int, tuple[str, str]] = {}  # id -> (name, path) of every adapter seen (one id, one adapter)
        self._lock = threading.Lock()  # (a server loads adapters on a worker thread while requests resolve theirs)

    def resolve(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter `request` names, loaded and checked (ValueError naming what is wrong)."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request: expected a LoRARequest, got {type(request).__name__}")
        key = (request.lora_name, request.lora_path)
        with self._lock:
            self._check_id(request, key)
            adapter = self._adapters.get(request.lora_int_id)
            if adapter is not None:
                self._adapters.move_to_end(request.lora_int_id)
                return adapter
        start = time.perf_counter()  # (read outside the lock: a request of a loaded adapter need not wait)
        adapter = load_lora_adapter(request.lora_name, request.lora_int_id, request.lora_path, self.model_config,
                                    self.config.max_lora_rank)
        with self._lock:
            self._check_id(request, key)
            self._known[request.lora_int_id] = key
            self._adapters[request.lora_int_id] = adapter
            while len(self._adapters) > self.config.host_capacity:
                self._adapters.popitem(last=False)
        logger.info("Loaded LoRA adapter %r (id %d, rank %d, %s) from %s in %.2f s", adapter.name, adapter.lora_id,
                    adapter.rank, "/".join(adapter.targets), adapter.path, time.perf_counter() - start)
        return adapter

    def _check_id(self, request: LoRARequest, key: tuple[str, str]) -> None:
        known = self._known.get(request.lora_int_id)
        if known is not None and known != key:
            raise ValueError(f"lora_request: lora_int_id {request.lora_int_id} is adapter {known[0]!r} at "
                             f"{known[1]!r}, not {request.lora_name!r} at {request.lora_path!r}")

    def remove(self, lora_id: int) -> LoRAAdapter | None:
        """Forget an adapter (its id may then name another; requests holding it finish with it, and its device
        slot is taken again in LRU order); returns it, or None if unknown."""
        with self._lock:
            self._known.pop(lora_id, None)
            return self._adapters.pop(lora_id, None)

    def __len__(self) -> int:
        return len(self._adapters)
