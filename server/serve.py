"""`jaxpaged serve`: run the app until SIGINT/SIGTERM, then drain running streams and exit."""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from jaxpaged.config import EngineArgs
from jaxpaged.engine.async_llm import AsyncLLM
from server.app import create_app
from server.state import STATE

logger = logging.getLogger(__name__)


async def serve(engine: AsyncLLM, host: str, port: int, *, api_key: str | None = None,
                model_name: str | None = None, shutdown_timeout: float = 30.0) -> None:
    """Serve until a signal; on SIGTERM stop accepting, wait for running requests (up to the timeout)."""
    app = create_app(engine, model_name=model_name, api_key=api_key)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    logger.info("Serving %s on http://%s:%d (OpenAI API under /v1)", app[STATE].model_name, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("Shutting down: no new connections; waiting up to %.0f s for %d running requests",
                shutdown_timeout, engine.num_unfinished)
    await site.stop()
    deadline = loop.time() + shutdown_timeout
    while engine.num_unfinished and loop.time() < deadline:
        await asyncio.sleep(0.1)
    await runner.cleanup()
    engine.shutdown()


def main(ns) -> None:
    engine = AsyncLLM.from_engine_args(EngineArgs.from_cli_args(ns))
    asyncio.run(serve(engine, ns.host, ns.port, api_key=ns.api_key, model_name=ns.served_model_name,
                      shutdown_timeout=ns.shutdown_timeout))
