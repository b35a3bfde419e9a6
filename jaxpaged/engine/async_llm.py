"""`AsyncLLM`: the engine core on its own thread, the output processing on another, streams in asyncio.

The engine thread only schedules and steps (and, with async scheduling, prepares step N+1 while the
device runs step N); it blocks on an event when idle, so an idle server uses no CPU. Its token outputs
go to an output thread that detokenizes, finds stop strings and builds each request's delta, then hands
them to the request's asyncio queue. Requests are tokenized and validated in the caller's event loop;
adds, aborts and stop-string ends reach the engine thread through a thread-safe inbox and join the next
step. Closing a request's stream early (client gone) aborts it and frees its blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import jaxpaged.faults as faults
from jaxpaged.distributed.multihost import KEEPALIVE_SECONDS
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine.output_processor import RequestOutputKind
from jaxpaged.lora_request import LoRARequest
from jaxpaged.request import RequestOutput
from jaxpaged.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineStopped(RuntimeError):
    """The engine stopped (server shutdown) before a request finished; `saved`: it is in a snapshot."""

    def __init__(self, saved: bool):
        super().__init__("the server shut down before this request finished" +
                         ("; it was saved in a snapshot and will finish after the restart" if saved else ""))
        self.saved = saved


class RequestStream:
    """One request's outputs as the engine produces them: `async for out in stream`.

    Outputs that pile up while the consumer is busy are merged into one. With delta=True each yields only
    what is new per sample, and each sample's finish_reason arrives once. `close()` before the end aborts.
    """

    def __init__(self, llm: AsyncLLM, request_id: str, delta: bool):
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self._llm = llm
        self._delta = delta

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self.queue.get()
        while not isinstance(out, BaseException) and not self.queue.empty():
            nxt = self.queue.get_nowait()
            out = nxt if isinstance(nxt, BaseException) or not self._delta else _merge_deltas(out, nxt)
        if isinstance(out, BaseException):
            self.finished = True
            raise out
        self.finished = out.finished
        return out

    def close(self) -> None:
        """Abort the request unless it finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self._llm.abort(self.request_id)


def _merge_deltas(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive delta outputs of one request as one."""
    merged = {o.index: o for o in a.outputs}
    for o in b.outputs:
        prev = merged.get(o.index)
        if prev is None:
            merged[o.index] = o
            continue
        logprobs = None if o.logprobs is None else (prev.logprobs or []) + o.logprobs
        merged[o.index] = replace(o, text=prev.text + o.text, token_ids=prev.token_ids + o.token_ids,
                                  logprobs=logprobs)
    return replace(b, outputs=[merged[i] for i in sorted(merged)],
                   prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs)


class AsyncLLM:
    """Async front of an `LLMEngine`, for servers: `async for out in llm.generate(prompt, params)`."""

    def __init__(self, engine: LLMEngine, *, owns_engine: bool = False):
        """owns_engine: `shutdown()` also frees the engine's device state (`from_engine_args` makes its own engine;
        one handed in may still be used by its owner after this front stops)."""
        self.engine = engine
        self.owns_engine = owns_engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # to the engine thread
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # to the output thread
        self._wake = threading.Event()
        self._lock = threading.Lock()  # the output processor's state (event loop and output thread)
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._stopped = False
        self.errored: BaseException | None = None
        self._restored: dict[str, str] = {}  # restored request id -> the JSON-lines file its final output goes to
        self._engine_thread = threading.Thread(target=self._engine_loop, name="jaxpaged-engine", daemon=True)
        self._output_thread = threading.Thread(target=self._output_loop, name="jaxpaged-output", daemon=True)
        self._engine_thread.start()
        self._output_thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLM:
        """A front over a new engine whose steps have each run once (`LLMEngine.warm_steps`): a server's first
        requests wait for no step's first run."""
        engine = LLMEngine.from_engine_args(args)
        try:
            engine.warm_steps()
        except BaseException:
            engine.close()
            raise
        return cls(engine, owns_engine=True)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def num_unfinished(self) -> int:
        """Requests added and neither finished nor aborted."""
        return len(self._streams)

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        delta: bool = False,
        priority: int = 0,
        tenant: str | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Tokenize, validate and queue a request; returns its stream. Bad input raises ValueError. tenant: whose
        KV share it counts against (`LLMEngine.set_kv_shares`). cache_salt: its own prefix cache; lora_request: its
        LoRA adapter (`LLMEngine.make_requests`)."""
        if self._stopped:
            raise EngineStopped(saved=False)
        if self.errored is not None:
            raise RuntimeError(f"the engine loop died: {self.errored!r}")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids, requests = self.engine.make_requests(request_id, prompt, params, priority=priority, tenant=tenant,
                                                        cache_salt=cache_salt, lora_request=lora_request)
        stream = RequestStream(self, request_id, delta)
        kind = RequestOutputKind.DELTA if delta else RequestOutputKind.CUMULATIVE
        with self._lock:
            if self.engine.output.has(request_id):
                raise ValueError(f"request_id {request_id!r} is already in use")
            self.engine.output.add(request_id, text, ids, requests, kind)
            self._streams[request_id] = stream
        self._send("add", requests)
        return stream

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        delta: bool = False,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs as tokens arrive (cumulative text, or only the new part with delta=True).

        Bad input raises ValueError before anything is yielded. Leaving the loop early (or
        cancellation) aborts the request.
        """
        stream = await self.add_request(prompt, params, request_id, delta=delta, priority=priority,
                                        cache_salt=cache_salt, lora_request=lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def forget_lora(self, lora_id: int) -> None:
        """Forget a LoRA adapter (`LoRARegistry.remove`): new requests cannot name it; running ones finish."""
        if self.engine.loras is not None:
            self.engine.loras.remove(lora_id)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed before the next step."""
        with self._lock:
            self._streams.pop(request_id, None)
            core_ids = self.engine.output.abort(request_id)
        if core_ids:
            self._send("abort", core_ids)

    def shutdown(self) -> None:
        """Stop the engine and output threads (the outputs of steps already taken are handed out first), then
        free the engine's device state if this front owns the engine."""
        self._stopped = True
        self._wake.set()
        self._engine_thread.join(timeout=10)
        self._outbox.put(None)
        self._output_thread.join(timeout=10)
        if self.owns_engine and not self._engine_thread.is_alive():  # (a step still running keeps its state)
            self.engine.close()

    # -- snapshots (engine/snapshot.py) ---------------------------------------------------------
    def restore(self, path: str, outputs_file: str) -> list[str]:
        """Continue the requests of the newest intact snapshot in `path` (none: nothing to do). They have no
        client: each one's final output is appended to `outputs_file` as a JSON line when it finishes."""
        from jaxpaged.engine.snapshot import SnapshotError, load_snapshot

        def refused(d: dict, error: ValueError) -> None:
            logger.error("not restoring request %s from %s: %s", d["request_id"], path, error)
            self._append(outputs_file, {"id": d["request_id"], "prompt": d["prompt"], "error": str(error)})

        try:
            with self._lock:
                ids = load_snapshot(self.engine, path, missing_ok=True, kind=RequestOutputKind.FINAL_ONLY,
                                    queue=lambda reqs: self._send("restore", reqs), on_invalid=refused)
                self._restored.update(dict.fromkeys(ids, outputs_file))
        except SnapshotError as e:  # (another model, dtype or version): serve without them, the snapshot kept
            logger.error("not restoring the snapshot in %s: %s", path, e)
            return []
        if ids:
            logger.info("Restored %d unfinished requests from %s; their outputs go to %s", len(ids), path,
                        outputs_file)
        return ids

    def stop_and_save(self, path: str | None) -> int:
        """Stop the engine; save every unfinished request as a snapshot in `path` (None: none); end their streams
        with EngineStopped. Returns how many were saved."""
        self.shutdown()
        saved = None
        try:
            saved = self.engine.save_state(path) if path is not None else 0
        except Exception:
            logger.exception("saving the unfinished requests to %s failed", path)
        finally:
            self._fail(EngineStopped(saved=path is not None and saved is not None))
        return saved or 0

    def _write_restored(self, out: RequestOutput) -> None:
        """A restored request's final output, as one JSON line of its outputs file."""
        record = {"id": out.request_id, "prompt": out.prompt, "prompt_token_ids": out.prompt_token_ids,
                  "outputs": [{"index": o.index, "text": o.text, "token_ids": o.token_ids,
                               "finish_reason": o.finish_reason, "stop_reason": o.stop_reason} for o in out.outputs],
                  "finished_at": time.time()}
        self._append(self._restored.pop(out.request_id), record)

    @staticmethod
    def _append(path: str, record: dict) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def _send(self, kind: str, payload) -> None:
        self._inbox.put((kind, payload))
        self._wake.set()

    # -- engine thread ------------------------------------------------------------------
    def _drain_inbox(self) -> int:
        """Hands the queued messages to the engine; returns how many there were."""
        engine = self.engine
        handlers = {"add": engine.add_core_requests, "restore": engine.restore_core_requests,
                    "abort": engine.abort_core_requests, "finish": engine.finish_core_requests}
        handled = 0
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return handled
            handlers[kind](payload)
            handled += 1

    def _engine_loop(self) -> None:
        core = self.engine.core
        channel = core.step_channel  # (several processes)
        try:
            while not self._stopped:
                handled = self._drain_inbox()
                if not core.has_unfinished_requests():
                    if handled:  # (aborts and finishes freed blocks with no step after them: fresh gauges)
                        self._outbox.put((None, None, core.gauges()))
                    idle = not self._wake.wait(KEEPALIVE_SECONDS if channel is not None else None)
                    self._wake.clear()
                    if idle and channel is not None:
                        channel.keepalive()
                    continue
                if self._wait_to_schedule(core):
                    continue
                outputs = core.step()
                self._outbox.put((outputs, core.last_stats, core.gauges()))
        except BaseException as e:  # surface to every waiting stream instead of hanging them
            logger.exception("engine loop failed")
            self._fail(e)
            if channel is not None:  # the other processes may wait in a call this one will not make: end them all
                logger.critical("process 0's engine failed: exiting, which ends the other processes")
                os._exit(1)

    def _wait_to_schedule(self, core) -> bool:
        """Late scheduling: sleep until the core's deadline (just before the step in flight ends), taking in
        requests and aborts as they come; True when messages came (the loop goes round again)."""
        deadline = core.schedule_deadline()
        if deadline is None or (left := deadline - time.perf_counter()) <= 0:
            return False
        if self._wake.wait(left):
            self._wake.clear()
            return True
        return False

    # -- output thread ------------------------------------------------------------------
    def _output_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            outputs, stats, gauges = item
            if outputs is None:  # the engine gone idle: its gauges alone
                with self._lock:
                    self.engine.record_gauges(gauges)
                continue
            try:
                faults.check("output")
                with self._lock:
                    self.engine.record_step(stats, gauges)
                    results, stopped = self.engine.output.process(outputs)
                    streams = [(r, self._streams.get(r.request_id)) for r in results]
                    for r in results:
                        if r.finished:
                            self._streams.pop(r.request_id, None)
                            if r.request_id in self._restored:
                                self._write_restored(r)
            except BaseException as e:
                logger.exception("output processing failed")
                self._fail(e)
                return
            if stopped:
                self._send("finish", stopped)
            for r, stream in streams:
                if stream is not None:
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, r)

    def _fail(self, error: BaseException) -> None:
        self.errored = error
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
