"""Running a request's prompts on the `AsyncLLM`, and Server-Sent Events framing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from aiohttp import web

from jaxpaged.engine.async_llm import AsyncLLM
from jaxpaged.request import RequestOutput
from jaxpaged.sampling_params import SamplingParams
from server.protocol import APIError


async def start_all(engine: AsyncLLM, prompts: list[list[int]], params: SamplingParams, request_id: str
                    ) -> list[AsyncIterator[RequestOutput]]:
    """Add every prompt to the engine (delta outputs); bad input raises APIError before any is left running."""
    gens = []
    try:
        for i, p in enumerate(prompts):
            gen = engine.generate(p, params, f"{request_id}-{i}", delta=True)
            first = await gen.__anext__()  # validates and queues the request
            gens.append(_prepend(first, gen))
    except ValueError as e:
        for g in gens:
            await g.aclose()
        raise APIError(str(e), param="prompt" if "prompt" in str(e) else None) from None
    return gens


async def _prepend(first: RequestOutput, gen: AsyncIterator[RequestOutput]):
    try:
        yield first
        async for out in gen:
            yield out
    finally:
        await gen.aclose()


async def merged(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, delta output) from all generators as they arrive; closing this aborts the rest."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, gen):
        try:
            async for out in gen:
                await q.put((i, out))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await q.put((i, e))
        finally:
            await q.put((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
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
