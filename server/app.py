"""`create_app(engine)`: the OpenAI-compatible aiohttp application."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from jaxpaged.engine.async_llm import AsyncLLM, EngineStopped
from server.chat import create_chat_completion
from server.completions import create_completion
from server.kv_transfer import folder_id, serve_block
from server.lora_modules import add_routes as add_lora_routes
from server.openapi import openapi_document
from server.protocol import APIError, get_field, now
from server.state import SSE, STATE, TENANT, ChatOptions, ServerState
from server.tenants import Tenant

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 << 20


@web.middleware
async def errors_and_auth(request: web.Request, handler):
    """API key check, and every failure as OpenAI's JSON error body."""
    state: ServerState = request.app[STATE]
    try:
        if (state.api_key or state.limits) and request.path.startswith("/v1"):
            key = request.headers.get("Authorization", "").removeprefix("Bearer ")
            tenant = state.limits.by_key.get(key) if state.limits else None
            if tenant is None and key != state.api_key:
                raise APIError("Invalid API key.", status=401, err_type="AuthenticationError",
                               code="invalid_api_key")
            request[TENANT] = tenant
        return await handler(request)
    except APIError as e:
        return await _error_response(request, e)
    except web.HTTPException as e:
        if e.status == 404:
            e = APIError(f"Not found: {request.path}", status=404, err_type="NotFoundError")
        elif e.status == 413:
            e = APIError("the request body is too large", status=413)
        else:
            e = APIError(e.reason, status=e.status)
        return web.json_response(e.body(), status=e.status)
    except ConnectionResetError:  # the client hung up mid-answer: its request is aborted already (generate_all)
        logger.debug("client went away during %s", request.path)
        sse = request.get(SSE)
        return sse.response if sse is not None else web.Response(status=499)  # (aiohttp drops it quietly)
    except EngineStopped as e:
        return await _error_response(request, APIError(str(e), status=503, err_type="ServiceUnavailableError"))
    except Exception as e:
        logger.exception("request failed")
        return await _error_response(request, APIError(f"internal error: {type(e).__name__}: {e}", status=500,
                                                       err_type="InternalServerError"))


async def _error_response(request: web.Request, err: APIError) -> web.StreamResponse:
    """The error as a JSON body, or, when an event stream has started, as its last event."""
    sse = request.get(SSE)
    if sse is not None:
        return await sse.fail(err.body())
    return web.json_response(err.body(), status=err.status, headers=err.headers)


async def models(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    created = now()
    return web.json_response({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": created, "owned_by": "jaxpaged",
        "max_model_len": state.max_model_len}, *state.loras.model_cards(created)]})


async def health(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    if state.engine.errored is not None:
        return web.json_response({"status": "error"}, status=503)
    return web.Response(text="")


async def version(request: web.Request) -> web.Response:
    """vLLM's /version: the server's package version."""
    from jaxpaged import __version__

    return web.json_response({"version": __version__})


async def metrics(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    return web.Response(body=state.engine.engine.metrics.render(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def openapi(request: web.Request) -> web.Response:
    from jaxpaged import __version__

    return web.json_response(openapi_document(__version__))


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: a `prompt`, or chat `messages` through the chat template."""
    state: ServerState = request.app[STATE]
    body = await state.read_json(request)
    tok = state.engine.tokenizer
    if "messages" in body:
        from server.chat import parse_messages, render_chat
        from server.tool_requests import tools_from

        ids, _ = render_chat(tok, parse_messages(body), body, tools_from(body))  # (as chat completions do)
    else:
        ids = tok.encode(get_field(body, "prompt", (str,)),
                         add_special_tokens=get_field(body, "add_special_tokens", (bool,), True))
    out = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
    if get_field(body, "return_token_strs", (bool,), False):
        out["token_strs"] = tok.convert_ids_to_tokens(ids)
    return web.json_response(out)


async def tokenizer_info(request: web.Request) -> web.Response:
    """vLLM's /tokenizer_info: what a client needs to tokenize as the server does (lm-evaluation-harness's
    remote tokenizer reads it)."""
    state: ServerState = request.app[STATE]
    tok = state.engine.tokenizer
    template = tok.chat_template if isinstance(tok.chat_template, str) else None
    return web.json_response({
        "tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
        "pad_token": tok.pad_token, "unk_token": tok.unk_token, "chat_template": template,
        "model_max_length": state.max_model_len, "vocab_size": len(tok)})


async def detokenize(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    body = await state.read_json(request)
    ids = get_field(body, "tokens", (list,))
    vocab = state.engine.engine.config.model_config.vocab_size
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
        raise APIError(f"'tokens' must be token ids in [0, {vocab})", param="tokens")
    return web.json_response({"prompt": state.engine.tokenizer.decode(ids)})


async def kv_transfer(request: web.Request) -> web.Response:
    """What `jaxpaged serve-disagg` checks before it connects instances: this one's KV role and, with one, the id
    of the folder blocks move through and the identity (model, dtypes, block size) the blocks carry."""
    state: ServerState = request.app[STATE]
    cc = state.engine.engine.config.cache_config
    if cc.kv_role is None:
        return web.json_response({"kv_role": None})
    folder = await asyncio.to_thread(folder_id, cc.offload_dir)
    return web.json_response({"kv_role": cc.kv_role, "kv_folder_id": folder, "identity": cc.offload_identity,
                              "block_size": cc.block_size})


def create_app(engine: AsyncLLM, *, model_name: str | None = None, api_key: str | None = None,
               tenants: list[Tenant] | None = None, kv_pull_from: list[str] | None = None,
               prompt_tokens_details: bool = False, chat: ChatOptions | None = None,
               lora_modules: list[tuple[str, str, str | None]] | None = None,
               allow_runtime_lora: bool = False) -> web.Application:
    """The aiohttp application serving `engine` with OpenAI's API. tenants: the API keys it accepts, with each
    tenant's limits (server/tenants.py); `api_key` is then also accepted, without limits. prompt_tokens_details:
    usage objects carry `prompt_tokens_details.cached_tokens` (vLLM's --enable-prompt-tokens-details). chat: the
    tool-calling and reasoning flags. lora_modules: (name, path, base model name) of the LoRA adapters served by
    name (server/lora_modules.py); allow_runtime_lora: their load/unload routes work."""
    app = web.Application(middlewares=[errors_and_auth], client_max_size=MAX_BODY_BYTES)
    app[STATE] = ServerState(engine, model_name, api_key, tenants, kv_pull_from, prompt_tokens_details, chat,
                             lora_modules, allow_runtime_lora)
    add_lora_routes(app, STATE)
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)  # (vLLM's alias, as SageMaker probes it)
    app.router.add_post("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_get("/kv_transfer", kv_transfer)
    app.router.add_get("/openapi.json", openapi)
    if engine.engine.config.cache_config.kv_role in ("producer", "both"):
        app.router.add_get("/v1/kv_blocks/{hash}", serve_block)
    return app
