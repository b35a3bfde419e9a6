"""`jaxpaged serve`: run the app until SIGINT/SIGTERM, then drain running streams and exit.

With a snapshot folder, the requests still running when the drain time is up are saved there (their clients get a
503 saying so), and the next start restores and finishes them; having no client by then, their final outputs are
appended to `restored_outputs.jsonl` in that folder.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import socket
import time

from aiohttp import web

from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.async_llm import AsyncLLM
from server.app import create_app
from server.lora_modules import parse_lora_modules, runtime_updates_allowed
from server.state import STATE, ChatOptions
from server.tenants import Tenant, load_tenants

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


RESTORED_OUTPUTS = "restored_outputs.jsonl"


async def serve(engine: AsyncLLM, sock: socket.socket, *, api_key: str | None = None,
                model_name: str | None = None, shutdown_timeout: float = 30.0, snapshot_dir: str | None = None,
                tenants: list[Tenant] | None = None, kv_pull_from: list[str] | None = None,
                prompt_tokens_details: bool = False, chat: ChatOptions | None = None,
                lora_modules: list[tuple[str, str, str | None]] | None = None, allow_runtime_lora: bool = False) -> int:
    """Serve on a bound socket until a signal; on SIGTERM stop accepting, wait for running requests (up to the
    timeout), then end the rest (saved in `snapshot_dir` when given). Returns the exit status: 1 when the engine
    died (its requests have ended with the error), so a supervisor restarts the server."""
    app = create_app(engine, model_name=model_name, api_key=api_key, tenants=tenants,  # (sets the KV shares)
                     kv_pull_from=kv_pull_from, prompt_tokens_details=prompt_tokens_details, chat=chat,
                     lora_modules=lora_modules, allow_runtime_lora=allow_runtime_lora)
    if snapshot_dir is not None:
        engine.restore(snapshot_dir, os.path.join(snapshot_dir, RESTORED_OUTPUTS))
    if chat is not None and (chat.tool_call_parser or chat.reasoning_parser):
        logger.info("Chat: tool_choice auto %s; tool-call parser %s; reasoning parser %s",
                    "on" if chat.auto_tools else "off", chat.tool_call_parser, chat.reasoning_parser)
    if app[STATE].loras.by_name:
        logger.info("LoRA adapters: %s%s", ", ".join(app[STATE].loras.by_name),
                    " (runtime loading on)" if allow_runtime_lora else "")
    if tenants:
        logger.info("Tenants: %s", ", ".join(f"{t.name} (priority {t.priority}, KV share {t.kv_min:.0%}-{t.kv_max:.0%})"
                                             for t in tenants))
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
    watch = asyncio.create_task(_stop_when_the_engine_dies(engine, stop))
    await stop.wait()
    watch.cancel()
    if engine.errored is not None:  # (its streams have ended with the error; a supervisor restarts the server)
        logger.critical("The engine failed (%r): exiting with status 1", engine.errored)
        await runner.cleanup()
        return 1
    logger.info("Shutting down: no new connections; waiting up to %.0f s for %d running requests",
                shutdown_timeout, engine.num_unfinished)
    await site.stop()  # stops listening;
    runner.server.pre_shutdown()  # and keep-alive connections take no new request (running ones finish)
    deadline = time.monotonic() + shutdown_timeout
    while engine.num_unfinished and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    unfinished = engine.num_unfinished
    saved = engine.stop_and_save(snapshot_dir)  # the rest end with a 503 (saved, with a snapshot folder)
    if unfinished or snapshot_dir is not None:
        logger.info("%d requests still running after %.0f s%s", unfinished, shutdown_timeout,
                    f"; saved {saved} unfinished requests to {snapshot_dir}" if snapshot_dir is not None else "")
    await runner.cleanup()
    return 0


async def _stop_when_the_engine_dies(engine: AsyncLLM, stop: asyncio.Event, every_s: float = 0.2) -> None:
    while engine.errored is None:
        await asyncio.sleep(every_s)
    stop.set()


def main(ns) -> None:
    """Check the flags and the port, then load the model and serve."""
    args = EngineArgs.from_cli_args(ns)
    args.validate()
    tenants = load_tenants(ns.tenants) if ns.tenants else None
    chat = ChatOptions(ns.enable_auto_tool_choice, ns.tool_call_parser, ns.reasoning_parser)
    lora_modules = parse_lora_modules(ns.lora_modules)
    if lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    allow_runtime_lora = runtime_updates_allowed(ns.allow_runtime_lora_updating)
    sock = bind_socket(ns.host, ns.port)
    try:
        engine = AsyncLLM.from_engine_args(args)
        status = asyncio.run(serve(engine, sock, api_key=ns.api_key, model_name=ns.served_model_name,
                          shutdown_timeout=ns.shutdown_timeout, snapshot_dir=ns.snapshot_dir, tenants=tenants,
                          kv_pull_from=[u for u in (ns.kv_pull_from or "").split(",") if u],
                          prompt_tokens_details=ns.enable_prompt_tokens_details, chat=chat,
                          lora_modules=lora_modules, allow_runtime_lora=allow_runtime_lora))
    finally:
        sock.close()
    if status:
        sys.exit(status)
