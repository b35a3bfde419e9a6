"""The disk tier: one safetensors file per KV block, named by its block hash, under a folder per model identity.

Files are written by a background thread (to a temporary name, then renamed, so no reader ever sees half a
file) and checked when read: format version, model identity, block size, dtype, shape, the block's tokens and
a CRC32 of its bytes. A file that fails any check is skipped with a warning (and removed); a disk that is full
or unwritable turns the tier off with a warning. The folder outlives the engine: a restarted engine finds the
blocks of prefixes it computed before.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import queue
import threading
import time
import zlib
from collections import OrderedDict

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

import jaxpaged.faults as faults

logger = logging.getLogger(__name__)

FORMAT_VERSION = "1"
SUFFIX = ".kvblock"
_tmp_ids = itertools.count()
STALE_TMP_S = 600  # a temporary file this old was left by a writer that died (a write takes milliseconds)


class DiskTier:
    """KV blocks as files under `root/identity/`, at most `capacity_bytes` of them written by this engine (the
    least recently used go first)."""

    def __init__(self, root: str, identity: str, capacity_bytes: int, *, block_size: int,
                 block_shape: tuple[int, ...], dtype):
        self.dir = os.path.join(root, identity)
        self.identity = identity
        self.capacity_bytes = capacity_bytes
        self.block_size = block_size
        self.block_shape = tuple(block_shape)
        self.dtype = np.dtype(dtype)
        self.enabled = True
        self.index: OrderedDict[int, int] = OrderedDict()  # hash -> file bytes, least recently used first
        self.num_bytes = 0
        self.num_bytes_written = 0
        self.num_bytes_read = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        try:
            os.makedirs(self.dir, exist_ok=True)
            self._scan()
        except OSError as e:
            self._disable(f"cannot use {self.dir}: {e}")
        self._thread = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def _scan(self) -> None:
        """Index the files a previous engine left, oldest first."""
        found = []
        now = time.time()
        with os.scandir(self.dir) as it:
            for e in it:
                if e.name.endswith(".tmp"):  # (a process killed mid-write left it; another may be writing it)
                    with contextlib.suppress(OSError):
                        if now - e.stat().st_mtime > STALE_TMP_S:
                            os.remove(e.path)
                    continue
                if e.name.endswith(SUFFIX):
                    try:
                        st = e.stat()
                        found.append((st.st_mtime, int(e.name[: -len(SUFFIX)], 16), st.st_size))
                    except (OSError, ValueError):
                        continue
        for _, h, size in sorted(found):
            self.index[h] = size
            self.num_bytes += size
        if found:
            logger.info("KV disk tier: %d blocks (%.2f GiB) from earlier runs in %s", len(found),
                        self.num_bytes / 2**30, self.dir)

    def _disable(self, why: str) -> None:
        if self.enabled:
            logger.warning("KV disk tier off: %s", why)
        self.enabled = False

    def path(self, block_hash: int) -> str:
        return os.path.join(self.dir, f"{block_hash:016x}{SUFFIX}")

    def __contains__(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self.index

    def read(self, block_hash: int, tokens: tuple[int, ...]) -> np.ndarray | None:
        """The block's KV [L, 2, block_size, KH, D], or None: not on disk, or a file that fails a check."""
        if not self.enabled:
            return None
        path = self.path(block_hash)
        with self._lock:
            known = block_hash in self.index
        if not known and not os.path.exists(path):  # (another engine sharing the folder may have written it)
            return None
        try:
            with safe_open(path, framework="numpy") as f:
                meta = f.metadata() or {}
                raw, stored_tokens = f.get_tensor("kv"), f.get_tensor("tokens")
            problem = self._check(meta, raw, stored_tokens, tokens)
        except FileNotFoundError:
            problem = "gone"
        except Exception as e:  # a truncated or garbled file: safetensors' own errors, numpy's
            problem = f"unreadable ({type(e).__name__}: {e})"
        if problem is not None:
            if problem != "gone":
                logger.warning("KV disk tier: skipping %s: %s", path, problem)
                self._remove(block_hash, path)
            else:
                self._forget(block_hash)
            return None
        with self._lock:
            if block_hash not in self.index:
                self.index[block_hash] = os.path.getsize(path)
                self.num_bytes += self.index[block_hash]
            self.index.move_to_end(block_hash)
        self.num_bytes_read += raw.nbytes
        return raw.view(self.dtype).reshape(self.block_shape)

    def _check(self, meta: dict, raw: np.ndarray, stored_tokens: np.ndarray, tokens: tuple[int, ...]) -> str | None:
        expected = {"format_version": FORMAT_VERSION, "model_identity": self.identity,
                    "block_size": str(self.block_size), "dtype": self.dtype.name,
                    "shape": ",".join(map(str, self.block_shape))}
        for key, value in expected.items():
            if meta.get(key) != value:
                return f"{key} is {meta.get(key)!r}, expected {value!r}"
        if raw.dtype != np.uint8 or raw.nbytes != int(np.prod(self.block_shape)) * self.dtype.itemsize:
            return f"{raw.nbytes} bytes of KV, expected {int(np.prod(self.block_shape)) * self.dtype.itemsize}"
        if tuple(stored_tokens.tolist()) != tuple(tokens):
            return "its tokens differ (a hash collision)"
        if meta.get("crc32") != str(zlib.crc32(raw)):
            return "checksum mismatch"
        return None

    @property
    def block_bytes(self) -> int:
        return int(np.prod(self.block_shape)) * self.dtype.itemsize

    def touch(self, block_hash: int) -> None:
        """Mark a block recently used (the last to go when the budget is exceeded)."""
        with self._lock:
            if block_hash in self.index:
                self.index.move_to_end(block_hash)

    def has_file(self, block_hash: int) -> bool:
        """Whether the folder holds this block's file now (written by this engine or another sharing the folder,
        and not removed since, e.g. by another engine's budget)."""
        return os.path.exists(self.path(block_hash))

    def adopt(self, block_hash: int, tokens: tuple[int, ...], data: bytes) -> bool:
        """Add a block file received from another instance (its bytes, as `read` expects them), if it passes
        every check `read` makes; returns whether it was added (a failure is logged)."""
        if not self.enabled:
            return False
        path = self.path(block_hash)
        tmp = f"{path}.{os.getpid()}.{next(_tmp_ids)}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            with safe_open(tmp, framework="numpy") as f:
                problem = self._check(f.metadata() or {}, f.get_tensor("kv"), f.get_tensor("tokens"), tokens)
            if problem is None:
                os.replace(tmp, path)
        except Exception as e:  # noqa: BLE001 - a truncated or garbled file: safetensors' own errors, numpy's
            problem = f"unreadable ({type(e).__name__}: {e})"
        if problem is not None:
            logger.warning("KV disk tier: refusing a received block %016x: %s", block_hash, problem)
            try:
                os.remove(tmp)
            except OSError:
                pass
            return False
        with self._lock:
            if block_hash not in self.index:
                self.index[block_hash] = len(data)
                self.num_bytes += len(data)
        self._evict_over_budget()
        return True

    def write(self, block_hash: int, tokens: tuple[int, ...], kv: np.ndarray) -> None:
        """Queue a block for writing (a copy of `kv` [L, 2, block_size, KH, D]); blocks already here are skipped."""
        if not self.enabled or (block_hash in self and self.has_file(block_hash)):
            return
        self._queue.put((block_hash, tokens, np.array(kv, copy=True)))

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self.enabled:
                    self._write(*item)
            except Exception as e:  # (not an OSError: still no tier is better than a writer thread gone)
                logger.exception("KV disk tier writer failed")
                self._disable(f"the writer failed: {type(e).__name__}: {e}")
            finally:
                self._queue.task_done()

    def _write(self, block_hash: int, tokens: tuple[int, ...], kv: np.ndarray) -> None:
        if block_hash in self and self.has_file(block_hash):
            return
        raw = np.ascontiguousarray(kv).view(np.uint8).reshape(-1)
        meta = {"format_version": FORMAT_VERSION, "model_identity": self.identity,
                "block_size": str(self.block_size), "dtype": self.dtype.name,
                "shape": ",".join(map(str, self.block_shape)), "crc32": str(zlib.crc32(raw))}
        path = self.path(block_hash)
        tmp = f"{path}.{os.getpid()}.{next(_tmp_ids)}.tmp"
        try:
            save_file({"kv": raw, "tokens": np.asarray(tokens, np.int64)}, tmp, metadata=meta)
            faults.check("disk_write")
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.remove(tmp)
            except OSError:
                pass
            self._disable(f"writing {path} failed: {e}")
            return
        size = os.path.getsize(path)
        with self._lock:
            if block_hash not in self.index:  # (`read` or `adopt` may have indexed it meanwhile)
                self.index[block_hash] = size
                self.num_bytes += size
            self.num_bytes_written += raw.nbytes
        self._evict_over_budget()

    def _evict_over_budget(self) -> None:
        """Remove the least recently used files while the folder holds more than the budget."""
        with self._lock:
            victims = []
            while self.num_bytes > self.capacity_bytes and len(self.index) > 1:
                h, s = self.index.popitem(last=False)
                self.num_bytes -= s
                victims.append(h)
        for h in victims:
            try:
                os.remove(self.path(h))
            except OSError:
                pass

    def _forget(self, block_hash: int) -> None:
        with self._lock:
            size = self.index.pop(block_hash, None)
            if size is not None:
                self.num_bytes -= size

    def _remove(self, block_hash: int, path: str) -> None:
        self._forget(block_hash)
        try:
            os.remove(path)
        except OSError:
            pass

    def flush(self) -> None:
        """Wait until every queued block is on disk."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued and stop the writer (idempotent)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
