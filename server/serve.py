"""`jaxpaged serve`: run the app until SIGINT/SIGTERM, then drain running streams and exit."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket

from aiohttp import web

from jaxpaged.config import EngineArgs
from jaxpaged.engine.async_llm import AsyncLLM
from server.app import create_app
from server.state import STATE

logger = logging.getLogger(__name__)


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port but not yet listening (connections are refused until the server starts).

    Done before the model loads, so a busy port is a one-line error at once, not after the load.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host: cannot resolve {host!r}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (a port in TIME_WAIT is free; a listening one is not)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"--port: cannot listen on {host}:{port}: {e.strerror.lower()}") from None
    return sock


async def serve(engine: AsyncLLM, sock: socket.socket, *, api_key: str | None = None,
                model_name: str | None = None, shutdown_timeout: float = 30.0) -> None:
    """Serve on a bound socket until a signal; on SIGTERM stop accepting, wait for running requests (up to the
    timeout)."""
    app = create_app(engine, model_name=model_name, api_key=api_key)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    host, port = sock.getsockname()[:2]
    logger.info("Serving %s on http://%s:%d (OpenAI API under /v1)", app[STATE].model_name, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("Shutting down: no new connections; waiting up to %.0f s for %d running requests",
                shutdown_timeout, engine.num_unfinished)
    # Stops listening at once, lets running handlers finish for up to the shutdown timeout, then cancels the
    # rest (a cancelled handler aborts its requests).
    await runner.cleanup()
    engine.shutdown()


def main(ns) -> None:
    """Check the flags and the port, then load the model and serve."""
    args = EngineArgs.from_cli_args(ns)
    args.validate()
    sock = bind_socket(ns.host, ns.port)
    try:
        engine = AsyncLLM.from_engine_args(args)
        asyncio.run(serve(engine, sock, api_key=ns.api_key, model_name=ns.served_model_name,
                          shutdown_timeout=ns.shutdown_timeout))
    finally:
        sock.close()
