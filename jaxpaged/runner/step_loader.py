"""`StepLoader`: the steps read from the step cache, compiled on background threads after warmup returns.

A cached step is a deserialize, a cheap lowering and a compile that XLA's persistent cache answers (~0.4 s a
bucket on 2 cores, mostly loading the executable); loading all 17 CPU buckets before an offline `LLM` returns
would take longer than zeroing the KV pool, which is what a warm start otherwise waits for (a server waits for
them: it runs each step once before listening, `LLMEngine.warm_steps`). So the loads run smallest bucket first
on daemon threads, and `get(t)` returns bucket t's step: at once if loaded, after its load if running, and if not
yet started, loaded right there on the caller's thread (a step never waits behind other buckets). At interpreter
exit the loads not started are dropped and the running ones finished, so a short run does not pay for the
buckets it never used.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future


class StepLoader:
    """Runs `jobs[t]()` for each bucket t in order on `workers` daemon threads; `get(t)` gives its result."""

    def __init__(self, jobs: dict[int, Callable], workers: int):
        self._queue = list(jobs)  # buckets not started, in the order given
        self._dropped: set[int] = set()  # (not started when `close` was called)
        self._jobs = dict(jobs)
        self._futures: dict[int, Future] = {t: Future() for t in jobs}
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"step-loader-{i}", daemon=True)
                         for i in range(min(workers, len(jobs)))]
        for thread in self._threads:
            thread.start()
        ref = weakref.ref(self)
        atexit.register(lambda: (loader := ref()) is not None and loader.close())

    def _take(self, t: int | None = None) -> int | None:
        """Remove bucket t (or the next one) from the queue, if it has not started; returns it or None."""
        with self._lock:
            if t is None:
                return None if self._closed or not self._queue else self._queue.pop(0)
            if t in self._queue or t in self._dropped:
                self._queue = [u for u in self._queue if u != t]
                self._dropped.discard(t)
                return t
            return None

    def _run(self, t: int) -> None:
        future, job = self._futures[t], self._jobs[t]
        try:
            future.set_result(job())
        except Exception as e:  # (handed to whoever asks for this bucket)
            future.set_exception(e)
        except BaseException as e:  # (an interrupt: this load did not fail; the next `get` starts it again)
            with self._lock:
                self._futures[t] = Future()
                self._dropped.add(t)
            future.set_exception(e)
            raise
        else:
            del self._jobs[t]

    def _work(self) -> None:
        while (t := self._take()) is not None:
            self._run(t)

    def __contains__(self, t: int) -> bool:
        return t in self._futures

    def get(self, t: int):
        """Bucket t's step (loading it on this thread if no worker has started it)."""
        if self._take(t) is not None:
            self._run(t)
        return self._futures[t].result()

    def close(self) -> None:
        """Drop the loads not started (a later `get` loads one on its caller's thread) and wait for the running
        ones."""
        with self._lock:
            self._closed = True
            self._dropped.update(self._queue)
            self._queue = []
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()
