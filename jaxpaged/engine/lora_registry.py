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
from jaxpaged.models.lora_adapter import LoRAAdapter, LoRAError, load_lora_adapter

logger = logging.getLogger(__name__)


class LoRARegistry:
    def __init__(self, model_config: ModelConfig, config: LoRAConfig):
        """model_config: the base model's (before tensor parallelism replicates its KV heads)."""
        self.model_config = model_config
        self.config = config
        self._adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._known: dict[int, tuple[str, str]] = {}  # id -> (name, path) of every adapter seen (one id, one adapter)
        self._lock = threading.Lock()  # (a server loads adapters on a worker thread while requests resolve theirs)
        self._kept: set[int] = set()  # ids never dropped from host memory (a server's named adapters)
        self._last_new_id = 0  # (`id_for`: ids it hands out are past every id seen)

    def resolve(self, request: LoRARequest, *, keep: bool = False) -> LoRAAdapter:
        """The adapter `request` names, loaded and checked (ValueError naming what is wrong). keep: never drop it
        from host memory (a server serves it by name: a request must not wait on its folder)."""
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
        try:
            adapter = load_lora_adapter(request.lora_name, request.lora_int_id, request.lora_path,
                                        self.model_config, self.config.max_lora_rank)
        except LoRAError:
            raise
        except Exception as e:  # noqa: BLE001 - anything else a strange adapter trips is still its error, named
            raise LoRAError(f"LoRA adapter {request.lora_name!r}: cannot be read ({type(e).__name__}: {e})") from None
        with self._lock:
            self._check_id(request, key)
            self._known[request.lora_int_id] = key
            self._adapters[request.lora_int_id] = adapter
            if keep:
                self._kept.add(request.lora_int_id)
            drop = [i for i in self._adapters if i not in self._kept and i != request.lora_int_id]  # (LRU first)
            for old in drop[: max(0, len(self._adapters) - self.config.host_capacity)]:
                del self._adapters[old]
        logger.info("Loaded LoRA adapter %r (id %d, rank %d, %s; %.1f MB in host memory) from %s in %.2f s",
                    adapter.name, adapter.lora_id, adapter.rank, "/".join(adapter.targets), adapter.nbytes / 2**20,
                    adapter.path, time.perf_counter() - start)
        return adapter

    def id_for(self, name: str, path: str) -> int:
        """The id an adapter (name, folder) is known under, or a new id no adapter has had."""
        with self._lock:
            for lora_id, key in self._known.items():
                if key == (name, path):
                    return lora_id
            self._last_new_id = max(self._last_new_id, max(self._known, default=0)) + 1
            return self._last_new_id

    def _check_id(self, request: LoRARequest, key: tuple[str, str]) -> None:
        known = self._known.get(request.lora_int_id)
        if known is not None and known != key:
            raise ValueError(f"lora_request: lora_int_id {request.lora_int_id} is adapter {known[0]!r} at "
                             f"{known[1]!r}, not {request.lora_name!r} at {request.lora_path!r}")

    def remove(self, lora_id: int) -> LoRAAdapter | None:
        """Forget an adapter (its id may then name another; requests holding it finish with it, and its device
        slot is taken again in LRU order: slots are keyed by the adapter's content, so none is ever mistaken
        for it); returns it, or None if unknown."""
        with self._lock:
            self._known.pop(lora_id, None)
            self._kept.discard(lora_id)
            return self._adapters.pop(lora_id, None)

    def __len__(self) -> int:
        return len(self._adapters)
