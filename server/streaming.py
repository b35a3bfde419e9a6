"""Running a request's prompts on the `AsyncLLM`, and Server-Sent Events framing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator

from aiohttp import web

from jaxpaged.engine.async_llm import AsyncLLM, RequestStream
from jaxpaged.request import RequestOutput
from jaxpaged.sampling_params import SamplingParams
from server.protocol import APIError


@contextlib.asynccontextmanager
async def generate_all(engine: AsyncLLM, prompts: list[list[int]], params: SamplingParams, request_id: str,
                       priority: int = 0):
    """Queue every prompt (delta outputs), then yield an iterator of (prompt index, output) as they arrive.

    Bad input raises APIError before any prompt is left running. Leaving the block for any reason (done,
    error, client gone, cancellation) aborts whatever has not finished, at once.
    """
    streams: list[RequestStream] = []
    merged = None
    try:
        try:
            for i, p in enumerate(prompts):
                streams.append(await engine.add_request(p, params, f"{request_id}-{i}", delta=True,
                                                        priority=priority))
        except ValueError as e:
            head = str(e).split(":", 1)[0]
            raise APIError(str(e), param=head if re.fullmatch(r"[a-z_]+", head) else None) from None
        merged = _merged(streams)
        yield merged
    finally:
        if merged is not None:
            await merged.aclose()
        for s in streams:
            s.close()


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all streams as they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await q.put((i, out))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await q.put((i, e))
        finally:
            await q.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class SSEWriter:
    """`data: {json}` events on a streaming response, ending with `data: [DONE]`."""

    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                    "Cache-Control": "no-cache"})

    async def start(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, payload: dict) -> None:
        await self.response.write(f"data: {json.dumps(payload)}\n\n".encode())

    async def done(self) -> web.StreamResponse:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response
