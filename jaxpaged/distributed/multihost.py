"""Several processes, one mesh: `jax.distributed` joins them, process 0 runs the engine (scheduler, requests,
outputs) and every other process runs the same jitted steps on its devices, with the inputs process 0 sends.

JAX runs one program per process over a mesh that spans them all (multi-controller): each process must make the
same device calls in the same order. Start-up (loading, placing the weights, compiling) is the same code on
every process; after it, process 0's runner sends each device call through its `StepChannel`
(`runner/step_channel.py`) and the followers make the call it names. A process that dies makes the others' next collective fail: they raise and end (JAX's heartbeat ends
a process whose peer stopped answering, within `HEARTBEAT_SECONDS`).
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.experimental import multihost_utils

logger = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 10
KEEPALIVE_SECONDS = 300  # an idle process 0 sends a no-op this often (CPU collectives time out after 30 min)
_initialized: tuple | None = None


def initialize(num_processes: int, process_id: int, coordinator_address: str, *, timeout_s: int = 120) -> None:
    """Join the processes (once per process; before JAX's backend starts). CPU devices talk over gloo."""
    global _initialized
    key = (num_processes, process_id, coordinator_address)
    if _initialized is not None:
        if _initialized != key:
            raise ValueError(f"this process already joined {_initialized}; it cannot join {key}")
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    logger.info("Process %d of %d: joining %s", process_id, num_processes, coordinator_address)
    jax.distributed.initialize(coordinator_address, num_processes, process_id, initialization_timeout=timeout_s,
                               heartbeat_timeout_seconds=HEARTBEAT_SECONDS)
    _initialized = key


def check_mesh(tensor_parallel_size: int) -> None:
    """With several processes the mesh spans every device of every process."""
    if tensor_parallel_size != len(jax.devices()):
        raise ValueError(f"tensor_parallel_size must be {len(jax.devices())} with num_processes="
                         f"{jax.process_count()} (every process's devices: one mesh over them all), got "
                         f"{tensor_parallel_size}")


def place(x, sharding):
    """`x` (the same value on every process) as a global array with `sharding`, which may span processes."""
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def to_host(x) -> np.ndarray:
    """A step result on the host: fully replicated results are read from this process's own copy."""
    if x.is_fully_addressable:
        return np.asarray(x)
    if not x.sharding.is_fully_replicated:
        raise RuntimeError(f"a step result of shape {x.shape} is split over processes ({x.sharding}); process 0 "
                           f"cannot read it")
    return np.asarray(x.addressable_shards[0].data)


def from_leader(value: int) -> int:
    """Process 0's `value` on every process (e.g. the KV block count: each process's memory may differ)."""
    if jax.process_count() == 1:
        return value
    return int(multihost_utils.broadcast_one_to_all(np.array(value, np.int64)))
