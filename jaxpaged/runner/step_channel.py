"""Process 0's device calls, sent to every other process of a mesh that spans several (`distributed/multihost.py`):
a header, then the call's arrays, each a `broadcast_one_to_all` over the devices; the followers (`follow`) make
the call it names, so every process makes the same device calls in the same order."""

from __future__ import annotations

import atexit
import contextlib
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxpaged.runner.block_transfer import CHUNK

NOOP, STEP, ROWS, COPY, STOP = 0, 1, 2, 3, 4


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
