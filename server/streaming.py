"""Running a request's prompts on the `AsyncLLM`, and Server-Sent Events framing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
from collections.abc import AsyncIterator

from aiohttp import web

from jaxpaged.engine.async_llm import AsyncLLM, RequestStream
from jaxpaged.request import RequestOutput
from jaxpaged.sampling_params import SamplingParams
from server.protocol import APIError
from server.state import SSE
from server.tenants import RateLimited, Tenant, TenantLimits


@contextlib.asynccontextmanager
async def generate_all(engine: AsyncLLM, prompts: list[list[int]], params: SamplingParams, request_id: str,
                       priority: int = 0, tenant: Tenant | None = None, limits: TenantLimits | None = None,
                       cache_salt: str | None = None, lora_request=None):
    """Queue every prompt (delta outputs), then yield an iterator of (prompt index, output) as they arrive.

    Bad input raises APIError before any prompt is left running; so does a tenant's limit (429). Leaving the
    block for any reason (done, error, client gone, cancellation) aborts whatever has not finished, at once.
    """
    streams: list[RequestStream] = []
    merged = None
    counted = tenant is not None and limits is not None
    if counted:
        priority = max(priority, tenant.priority)  # (a tenant may ask for less than its class, not more)
        tokens = _acquire(engine, limits, tenant, prompts, params)
    try:
        try:
            for i, p in enumerate(prompts):
                streams.append(await engine.add_request(p, params, f"{request_id}-{i}", delta=True,
                                                        priority=priority, tenant=tenant and tenant.name,
                                                        cache_salt=cache_salt, lora_request=lora_request))
        except ValueError as e:
            if counted and not streams:
                limits.refund(tenant, tokens)  # (refused: nothing ran)
            head = str(e).split(":", 1)[0]
            raise APIError(str(e), param=head if re.fullmatch(r"[a-z_]+", head) else None) from None
        merged = _merged(streams if not counted else [_counted(s, engine, tenant.name) for s in streams])
        yield merged
    finally:
        if counted:  # (first: a second cancellation in an await below must not keep the tenant's slot)
            limits.release(tenant)
            engine.engine.metrics.tenant_running.labels(tenant=tenant.name).dec()
        for s in streams:
            s.close()
        if merged is not None:
            await merged.aclose()


def _acquire(engine: AsyncLLM, limits: TenantLimits, tenant: Tenant, prompts: list[list[int]],
             params: SamplingParams) -> int:
    """Count the request against its tenant's limits (prompt + max_tokens per sample), or answer 429; returns the
    tokens taken."""
    max_len = engine.engine.config.scheduler_config.max_model_len
    tokens = sum(len(p) + params.n * (params.max_tokens or max_len - len(p)) for p in prompts)
    metrics = engine.engine.metrics
    try:
        limits.acquire(tenant, tokens)
    except RateLimited as e:
        metrics.tenant_rejections.labels(tenant=tenant.name, limit=e.limit).inc()
        headers = {"Retry-After": str(math.ceil(e.retry_after))} if e.retry_after != math.inf else None
        raise APIError(f"Rate limit reached: {e}", status=429, err_type="requests", code="rate_limit_exceeded",
                       headers=headers) from None
    metrics.tenant_requests.labels(tenant=tenant.name).inc()
    metrics.tenant_running.labels(tenant=tenant.name).inc()
    metrics.tenant_prompt_tokens.labels(tenant=tenant.name).inc(sum(len(p) for p in prompts))
    return tokens


async def _counted(stream: RequestStream, engine: AsyncLLM, tenant: str) -> AsyncIterator[RequestOutput]:
    """A stream's outputs, counting its tenant's generated tokens and finished samples."""
    metrics = engine.engine.metrics
    async for out in stream:
        metrics.tenant_generation_tokens.labels(tenant=tenant).inc(sum(len(o.token_ids) for o in out.outputs))
        for o in out.outputs:
            if o.finish_reason is not None:
                metrics.tenant_success.labels(tenant=tenant, finished_reason=o.finish_reason).inc()
        yield out


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
        self.request[SSE] = self  # (an error after this point is sent as an event: see `fail`)

    async def fail(self, error: dict) -> web.StreamResponse:
        """End a started stream with an error event (vLLM's: `data: {"error": {...}}`), then `[DONE]`."""
        await self.send(error)
        return await self.done()

    async def send(self, payload: dict) -> None:
        await self.response.write(f"data: {json.dumps(payload)}\n\n".encode())

    async def done(self) -> web.StreamResponse:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response
