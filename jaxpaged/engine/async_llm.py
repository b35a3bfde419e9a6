"""`AsyncLLM`: the engine on its own thread, streaming outputs into one asyncio queue per request.

The engine thread steps while any request is unfinished and blocks on an event when none is, so an
idle server uses no CPU. Requests and aborts from the event loop go through a thread-safe inbox and
join the next step. Closing a request's stream early (client gone) aborts it and frees its blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import replace

from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.request import RequestOutput
from jaxpaged.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestStream:
    """One request's outputs as the engine produces them: `async for out in stream`.

    Outputs that pile up while the consumer is busy are merged into one (the latest: outputs are
    cumulative inside the engine). With delta=True each yields only what is new per sequence.
    `close()` before the end aborts the request.
    """

    def __init__(self, llm: AsyncLLM, request_id: str, delta: bool):
        self.request_id = request_id
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self._llm = llm
        self._delta = delta
        self._sent: dict[int, tuple[int, int, bool]] = {}

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self.queue.get()
        while not isinstance(out, BaseException) and not self.queue.empty():
            out = self.queue.get_nowait()
        if isinstance(out, BaseException):
            self.finished = True
            raise out
        self.finished = out.finished
        return _delta(out, self._sent) if self._delta else out

    def close(self) -> None:
        """Abort the request unless it finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self._llm.abort(self.request_id)


class AsyncLLM:
    """Async front of an `LLMEngine`, for servers: `async for out in llm.generate(prompt, params)`."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._stopped = False
        self.errored: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="jaxpaged-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLM:
        return cls(LLMEngine.from_engine_args(args))

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
    ) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it. Bad input raises ValueError."""
        if self.errored is not None:
            raise RuntimeError(f"the engine loop died: {self.errored!r}")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = RequestStream(self, request_id, delta)
        self._streams[request_id] = stream
        accepted = stream.loop.create_future()
        self._inbox.put(("add", request_id, prompt, params, priority, accepted))
        self._wake.set()
        try:
            await accepted
        except BaseException:
            self._streams.pop(request_id, None)
            self.abort(request_id)  # cancelled while the engine was adding it: nothing must keep running
            raise
        return stream

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        delta: bool = False,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs as tokens arrive (cumulative text, or only the new part with delta=True).

        Bad input raises ValueError before anything is yielded. Leaving the loop early (or
        cancellation) aborts the request.
        """
        stream = await self.add_request(prompt, params, request_id, delta=delta, priority=priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed before the next step."""
        self._streams.pop(request_id, None)
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    # -- engine thread ------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                _, rid, prompt, params, priority, accepted = msg
                try:
                    self.engine.add_request(rid, prompt, params, priority=priority)
                except Exception as e:  # bad input: reported to the caller, the engine goes on
                    accepted.get_loop().call_soon_threadsafe(_settle, accepted, e)
                else:
                    accepted.get_loop().call_soon_threadsafe(_settle, accepted, None)
            else:
                self.engine.abort_request(msg[1])

    def _loop(self) -> None:
        try:
            while not self._stopped:
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue
                    if out.finished:
                        self._streams.pop(out.request_id, None)
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        except BaseException as e:  # surface to every waiting stream instead of hanging them
            logger.exception("engine loop failed")
            self.errored = e
            for stream in list(self._streams.values()):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, e)


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _delta(out: RequestOutput, sent: dict[int, tuple[int, int, bool]]) -> RequestOutput:
    """The output with only what was not yet yielded, per sequence index: new text, tokens and logprobs.

    A sequence with nothing new is left out, and so is one whose finish was already yielded, so each
    sequence's finish_reason arrives exactly once (vLLM's DELTA outputs).
    """
    outputs = []
    for o in out.outputs:
        text_len, tok_len, done = sent.get(o.index, (0, 0, False))
        if done:
            continue
        text, tokens = o.text[text_len:], o.token_ids[tok_len:]
        if not text and not tokens and o.finish_reason is None:
            continue
        logprobs = o.logprobs[tok_len:] if o.logprobs is not None else None
        outputs.append(replace(o, text=text, token_ids=tokens, logprobs=logprobs))
        sent[o.index] = (len(o.text), len(o.token_ids), o.finish_reason is not None)
    return replace(out, outputs=outputs)
