"""`jaxpaged serve-disagg`: one OpenAI-compatible endpoint in front of prefill and decode instances.

Each completion or chat request goes first to a prefill instance (`jaxpaged serve --kv-role producer`) as the same
request cut to one token, not streamed: that instance computes the prompt, writes its full KV blocks to its
folder and answers once they are written. Then the request goes to a decode instance (`--kv-role consumer`). If
the two see the same folder (one host, or a shared file system: each folder carries a random id, compared at
start), its prefix lookup finds the blocks there by the prefix cache's block hashes; otherwise the request
carries `"kv_transfer_params": {"source": PREFILL_URL}` and the decode instance first pulls the blocks it lacks
over HTTP (server/kv_transfer.py). Either way only the prompt's last partial block is computed again there, and
the completion streams back through this proxy.

Instances are tried round-robin. A prefill instance that cannot be reached or fails (5xx) is skipped for the
next one; if none answers, the client gets a 502 in OpenAI's error format. A client error (4xx) from the prefill
instance is the client's answer at once (bad input is refused before any decode). A decode instance that cannot
be reached is skipped the same way, before anything was streamed. A client that disconnects closes the upstream
connection, which aborts the request there. Before serving, every instance is asked for its KV role, folder and
block identity (`GET /kv_transfer`): wrong roles and mismatched models, dtypes or block sizes are refused.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging

import aiohttp
from aiohttp import web

logger = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")
PASSED_THROUGH = ("/v1/models", "/health", "/tokenizer_info", "/tokenize", "/detokenize")
# fields of a request the prefill instance does not need (it computes the prompt and one token)
_DECODE_ONLY = ("stream", "stream_options", "n", "best_of", "min_tokens", "max_completion_tokens", "logprobs",
                "top_logprobs", "response_format", "structured_outputs", "guided_json", "guided_regex",
                "guided_choice", "guided_grammar", "stop", "stop_token_ids", "seed", "echo", "suffix")
_HOP_BY_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


def _error(status: int, message: str) -> web.Response:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}},
                             status=status)


def prefill_body(body: dict) -> dict:
    """The request a prefill instance gets: the same prompt and settings that shape it (chat template, special
    tokens), one token, not streamed, one choice."""
    out = {k: v for k, v in body.items() if k not in _DECODE_ONLY}
    out["max_tokens"] = 1
    return out


class DisaggProxy:
    """Routes requests to `prefill` then `decode` instances (base URLs)."""

    def __init__(self, prefill: list[str], decode: list[str], *, timeout: float = 600.0):
        if not prefill or not decode:
            raise ValueError("serve-disagg needs at least one --prefill and one --decode instance")
        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        self._next_prefill = itertools.cycle(range(len(self.prefill)))
        self._next_decode = itertools.cycle(range(len(self.decode)))
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout)  # (streams run long)
        self.session: aiohttp.ClientSession | None = None
        self.num_prefill_failures = 0
        self.info: dict[str, dict] = {}  # each instance's /kv_transfer answer (from `check`)

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=self.timeout, auto_decompress=False)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def check(self) -> dict:
        """Ask every instance for its KV transfer settings; raise ValueError naming a mismatch (or one that
        cannot be reached). Returns the settings they share."""
        async def info(url: str) -> dict:
            try:
                async with self.session.get(f"{url}/kv_transfer") as resp:
                    if resp.status != 200:
                        raise ValueError(f"{url}/kv_transfer answered {resp.status}: is it a jaxpaged server?")
                    return await resp.json()
            except aiohttp.ClientError as e:
                raise ValueError(f"cannot reach {url}: {e}") from None

        infos = await asyncio.gather(*(info(u) for u in self.prefill + self.decode))
        self.info = dict(zip(self.prefill + self.decode, infos))
        roles = {"prefill": ("producer", "both"), "decode": ("consumer", "both")}
        for kind, urls, got in (("prefill", self.prefill, infos[: len(self.prefill)]),
                                ("decode", self.decode, infos[len(self.prefill):])):
            for url, i in zip(urls, got):
                if i.get("kv_role") not in roles[kind]:
                    raise ValueError(f"{url} is a {kind} instance but serves with kv_role={i.get('kv_role')!r}; "
                                     f"start it with --kv-role {' or '.join(roles[kind])}")
        first = infos[0]
        for url, i in zip(self.prefill + self.decode, infos):
            if i.get("identity") != first.get("identity"):
                raise ValueError(f"{url} and {self.prefill[0]} differ in model, dtypes or block size (identity "
                                 f"{i.get('identity')!r} vs {first.get('identity')!r}): their KV blocks cannot "
                                 "move between them")
        return first

    def _shares_folder(self, prefill: str, decode: str) -> bool:
        """Whether two instances move blocks through one folder (else the decode instance pulls them over
        HTTP); assumed when `check` has not run."""
        a, b = self.info.get(prefill), self.info.get(decode)
        return a is None or b is None or a.get("kv_folder_id") == b.get("kv_folder_id")

    def _headers(self, request: web.Request) -> dict:
        keep = ("authorization", "content-type", "x-request-id")
        return {**{k: v for k, v in request.headers.items() if k.lower() in keep}, "Accept-Encoding": "identity"}

    async def _prefill(self, request: web.Request, body: dict) -> tuple[web.Response | None, str | None]:
        """Run the prompt on a prefill instance: (None, its URL) when done, else (the response the client gets
        instead, None)."""
        data = json.dumps(prefill_body(body))
        failures = []
        for _ in range(len(self.prefill)):
            url = self.prefill[next(self._next_prefill)]
            try:
                async with self.session.post(f"{url}{request.path}", data=data,
                                             headers=self._headers(request)) as resp:
                    payload = await resp.read()
                    if resp.status < 400:
                        return None, url
                    if resp.status < 500:  # the client's error: the same request would fail everywhere
                        return web.Response(status=resp.status, body=payload, content_type="application/json"), None
                    failures.append(f"{url}: {resp.status}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                failures.append(f"{url}: {type(e).__name__}: {e}")
            self.num_prefill_failures += 1
            logger.warning("prefill instance failed (%s); trying the next one", failures[-1])
        return _error(502, "no prefill instance could compute the prompt: " + "; ".join(failures)), None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """A completion or chat request: prefill, then decode, streamed through."""
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        source = None
        if isinstance(body, dict) and "kv_transfer_params" in body:  # (only this proxy says where blocks come from)
            body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
            raw = json.dumps(body).encode()
        if isinstance(body, dict) and uses_prefix_cache(body):  # (else the decode instance answers alone)
            refused, source = await self._prefill(request, body)
            if refused is not None:
                return refused
        return await self._forward(request, raw, body if source else None, source)

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """Any other route: answered by a decode instance."""
        return await self._forward(request, await request.read())

    async def _forward(self, request: web.Request, raw: bytes, body: dict | None = None,
                       source: str | None = None) -> web.StreamResponse:
        """Send the request to a decode instance (the next one if it cannot be reached) and stream its answer;
        one that does not share the prefill instance `source`'s folder is told to pull the blocks from it."""
        failures = []
        for _ in range(len(self.decode)):
            url = self.decode[next(self._next_decode)]
            data = raw
            if source is not None and not self._shares_folder(source, url):
                data = json.dumps({**body, "kv_transfer_params": {"source": source}}).encode()
            out = None
            try:
                async with self.session.request(request.method, f"{url}{request.path_qs}", data=data or None,
                                                headers=self._headers(request)) as resp:
                    out = web.StreamResponse(status=resp.status, headers={
                        k: v for k, v in resp.headers.items() if k.lower() not in _HOP_BY_HOP})
                    await out.prepare(request)
                    async for chunk in resp.content.iter_any():
                        await out.write(chunk)
                    await out.write_eof()
                    return out
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                if out is not None:  # part of the answer went out: it cannot start again elsewhere
                    raise
                failures.append(f"{url}: {type(e).__name__}: {e}")
                logger.warning("decode instance failed (%s); trying the next one", failures[-1])
        return _error(502, "no decode instance answered: " + "; ".join(failures))


def uses_prefix_cache(body: dict) -> bool:
    """Whether the decode instance would use the prompt's blocks: requests with penalties or prompt logprobs
    build their state from the tokens they are fed, so they compute their whole prompt anyway (no prefill)."""
    neutral = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1}
    echoed_logprobs = body.get("echo") is True and body.get("logprobs") not in (None, False)  # (prompt logprobs)
    return (all(body.get(k) in (None, v) for k, v in neutral.items()) and body.get("prompt_logprobs") is None
            and not echoed_logprobs)


def create_proxy_app(proxy: DisaggProxy) -> web.Application:
    """The proxy's aiohttp application (its client session opens and closes with it)."""
    app = web.Application(client_max_size=64 * 2**20)

    async def lifecycle(app):
        await proxy.start()
        yield
        await proxy.close()

    app.cleanup_ctx.append(lifecycle)
    for route in ROUTES:
        app.router.add_post(route, proxy.handle)
    for route in PASSED_THROUGH:
        app.router.add_route("*", route, proxy.passthrough)
    return app


async def serve_proxy(proxy: DisaggProxy, host: str, port: int) -> None:
    """Check the instances, then serve until SIGINT/SIGTERM."""
    import signal

    app = create_proxy_app(proxy)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    try:
        await proxy.check()
        await web.TCPSite(runner, host, port).start()
        remote = sum(not proxy._shares_folder(p, d) for p in proxy.prefill for d in proxy.decode)
        logger.info("Serving prefill %s and decode %s on http://%s:%d (%s)", ", ".join(proxy.prefill),
                    ", ".join(proxy.decode), host, port,
                    "KV through a shared folder" if not remote else f"{remote} prefill/decode pairs pull KV over "
                    "HTTP: start those decode instances with --kv-pull-from the prefill URLs")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


def main(ns) -> None:
    proxy = DisaggProxy([u for u in ns.prefill.split(",") if u], [u for u in ns.decode.split(",") if u],
                        timeout=ns.timeout)
    asyncio.run(serve_proxy(proxy, ns.host, ns.port))
