"""`AsyncLLM`: the engine on its own thread, streaming outputs into one asyncio queue per request.

The engine thread steps while any request is unfinished and blocks on an event when none is, so an
idle server uses no CPU. Requests and aborts from the event loop go through a thread-safe inbox and
join the next step. Cancelling a `generate()` (client gone) aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.request import RequestOutput
from jaxpaged.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncLLM:
    """Async front of an `LLMEngine`, for servers: `async for out in llm.generate(prompt, params)`."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
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
        return len(self._streams)

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
        if self.errored is not None:
            raise RuntimeError(f"the engine loop died: {self.errored!r}")
        request_id = request_id or f"req-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._streams[request_id] = stream
        done = threading.Event()
        error: list[BaseException] = []
        self._inbox.put(("add", request_id, prompt, params, priority, done, error))
        self._wake.set()
        await asyncio.get_running_loop().run_in_executor(None, done.wait)
        if error:
            self._streams.pop(request_id, None)
            raise error[0]
        finished = False
        sent = {}
        try:
            while not finished:
                out = await stream.queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield _delta(out, sent) if delta else out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed before the next step."""
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
                _, rid, prompt, params, priority, done, error = msg
                try:
                    self.engine.add_request(rid, prompt, params, priority=priority)
                except Exception as e:  # bad input: reported to the caller, the engine goes on
                    error.append(e)
                done.set()
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
                    if stream is not None:
                        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        except BaseException as e:  # surface to every waiting stream instead of hanging them
            logger.exception("engine loop failed")
            self.errored = e
            for stream in list(self._streams.values()):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, e)


def _delta(out: RequestOutput, sent: dict[int, tuple[int, int]]) -> RequestOutput:
    """The output with only text and tokens not yet yielded, per sequence index."""
    outputs = []
    for o in out.outputs:
        text_len, tok_len = sent.get(o.index, (0, 0))
        outputs.append(replace(o, text=o.text[text_len:], token_ids=o.token_ids[tok_len:]))
        sent[o.index] = (len(o.text), len(o.token_ids))
    return replace(out, outputs=outputs)
