"""Several processes, one mesh: `jax.distributed` joins them, process 0 runs the engine (scheduler, requests,
outputs) and every other process runs the same jitted steps on its devices, with the inputs process 0 sends.

JAX runs one program per process over a mesh that spans them all (multi-controller): each process must make the
same device calls in the same order. Start-up (loading, placing the weights, compiling) is the same code on
every process; after it, process 0's runner sends each device call through a `StepChannel` (a header, then
its arrays, each a `broadcast_one_to_all` over the devices) and the followers (`follow`) make the call it
names. A process that dies makes the others' next collective fail: they raise and end (JAX's heartbeat ends
a process whose peer stopped answering, within `HEARTBEAT_SECONDS`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxpaged.runner.block_transfer import CHUNK

logger = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 10
NOOP, STEP, ROWS, COPY, STOP = 0, 1, 2, 3, 4
KEEPALIVE_SECONDS = 300  # an idle process 0 sends a no-op this often (CPU collectives time out after 30 min)
_initialized: tuple | None = None


def check_multihost_args(num_processes: int, process_id: int, coordinator_address: str | None) -> None:
    """Raise ValueError naming the bad flag."""
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be a positive integer, got {num_processes!r}")
    if isinstance(process_id, bool) or not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, num_processes={num_processes}), got {process_id!r}")
    if num_processes > 1 and not coordinator_address:
        raise ValueError("coordinator_address (HOST:PORT of process 0) is needed with num_processes > 1")


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


def follow(args) -> None:
    """A process other than 0: build the engine as process 0 does, then run its steps until it stops."""
    from jaxpaged.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(args)
    logger.info("Process %d of %d: running process 0's steps", jax.process_index(), jax.process_count())
    engine.core.runner.channel.follow()
    logger.info("Process %d: process 0 stopped; exiting", jax.process_index())


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


class StepChannel:
    """Process 0's device calls, sent to every process: a header [kind, a, b] int32, then the call's arrays. The
    runner's `write_row`, `copy_chunk` and `run_step` send them; `follow` makes them on the other processes."""

    def __init__(self, runner):
        self.runner = runner
        self.leader = jax.process_index() == 0
        self.closed = False
        self.broken = False  # a call was sent and not made (an error between): the followers wait in it
        self.lock = threading.Lock()  # one call at a time: its header, arrays and the device call itself

    @contextlib.contextmanager
    def call(self):
        """Hold the channel for one device call (send, then make it); an error inside breaks the channel."""
        with self.lock:
            try:
                yield
            except BaseException:
                self.broken = True
                raise

    def _header(self, kind: int = NOOP, a: int = 0, b: int = 0) -> tuple[int, int, int]:
        return tuple(int(v) for v in multihost_utils.broadcast_one_to_all(np.array([kind, a, b], np.int32)))

    @staticmethod
    def _arrays(arrays):
        return [np.asarray(a) for a in multihost_utils.broadcast_one_to_all(tuple(arrays))]

    # -- process 0 ------------------------------------------------------------------------
    def send_step(self, t: int, ints: np.ndarray, floats: np.ndarray, bitmask: np.ndarray | None) -> None:
        self._header(STEP, t, bitmask is not None)
        self._arrays([ints, floats] if bitmask is None else [ints, floats, bitmask])

    def send_rows(self, row: int, bias: np.ndarray, min_mask: np.ndarray) -> None:
        self._header(ROWS, row)
        self._arrays([bias.astype(np.float32), min_mask.astype(np.uint8)])

    def send_copy(self, pairs: list[tuple[int, int]]) -> None:
        """One chunk of block copies (at most `block_transfer.CHUNK` pairs: a fixed shape, compiled at warmup)."""
        part = np.zeros((CHUNK, 2), np.int32)
        part[: len(pairs)] = pairs
        self._header(COPY, len(pairs))
        self._arrays([part])

    def keepalive(self) -> None:
        """A no-op call, so an idle mesh's collectives do not time out."""
        with self.call():
            self._header(NOOP)

    def close(self) -> None:
        """Tell the followers to stop (once). Skipped when a call was left unmade (they wait in it; they end
        when this process exits, by JAX's heartbeat) or another thread holds the channel past 30 s."""
        if self.closed or not self.leader or self.broken or not self.lock.acquire(timeout=30):
            return
        try:
            self.closed = True
            self._header(STOP)
        finally:
            self.lock.release()

    def check_same_engine(self) -> None:
        """Raise ValueError unless every process built the same step shapes as process 0 (same flags, same
        pool): otherwise the processes would run different programs and hang."""
        r, sc, cc = self.runner, self.runner.config.scheduler_config, self.runner.config.cache_config
        mine = np.array([cc.num_blocks, cc.block_size, sc.max_num_seqs, sc.max_num_batched_tokens, sc.max_model_len,
                         r.mask_width, len(r.buckets), sum(p.sizes["i"] + p.sizes["f"] for p in r._packers.values())],
                        np.int64)
        leaders = np.asarray(multihost_utils.broadcast_one_to_all(mine))
        if not np.array_equal(mine, leaders):
            raise ValueError(f"process {jax.process_index()} built another engine than process 0 (blocks, block "
                             f"size, max_num_seqs, max_num_batched_tokens, max_model_len, mask width, buckets, "
                             f"step size: {mine.tolist()} vs {leaders.tolist()}): start every process with the "
                             f"same flags")

    def warmup(self, buckets) -> None:
        """Compile every broadcast the calls use, on every process alike (during start-up, not after)."""
        v = self.runner.config.model_config.vocab_size
        self._header()
        for t in buckets:
            self._arrays(self._like_step(t, False))
            self._arrays(self._like_step(t, True))
        self._arrays([np.zeros(v, np.float32), np.zeros(v, np.uint8)])
        self._arrays([np.zeros((CHUNK, 2), np.int32)])

    def _like_step(self, t: int, masked: bool) -> list[np.ndarray]:
        """Zero arrays shaped like a step's inputs for bucket `t` (with a structured-output bitmask or not)."""
        runner = self.runner
        packer = runner._packers[t]
        like = [np.zeros(packer.sizes["i"], np.int32), np.zeros(packer.sizes["f"], np.float32)]
        if masked:
            like.append(np.zeros((runner._num_seqs(t), runner.mask_width), np.int32))
        return like

    # -- the others ---------------------------------------------------------------------
    def follow(self) -> None:
        """Make process 0's device calls until it stops."""
        runner, v = self.runner, self.runner.config.model_config.vocab_size
        while True:
            kind, a, b = self._header()
            if kind == STEP:
                ints, floats, *mask = self._arrays(self._like_step(a, bool(b)))
                runner.run_step(a, ints, floats, mask[0] if mask else runner._free_mask(a))
            elif kind == ROWS:
                bias, min_mask = self._arrays([np.zeros(v, np.float32), np.zeros(v, np.uint8)])
                runner.write_row(a, bias, min_mask.astype(bool))
            elif kind == COPY:
                (pairs,) = self._arrays([np.zeros((CHUNK, 2), np.int32)])
                runner.copy_chunk([tuple(p) for p in pairs[:a].tolist()])
            elif kind == NOOP:
                continue
            elif kind == STOP:
                return
            else:
                raise RuntimeError(f"process {jax.process_index()}: unknown device call {kind} from process 0")


def attach(runner) -> StepChannel | None:
    """Give `runner` a channel when the mesh spans processes (process 0 sends; the others will `follow`); the
    followers are stopped when process 0 exits."""
    if jax.process_count() == 1:
        return None
    channel = StepChannel(runner)
    if channel.leader:
        atexit.register(channel.close)
    return channel
