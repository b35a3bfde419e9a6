"""What the handlers share, and the typed application key it lives under."""

from __future__ import annotations

import asyncio
import json
import os
import re
from dataclasses import dataclass

from aiohttp import web

from jaxpaged.engine.async_llm import AsyncLLM
from jaxpaged.lora_request import LoRARequest
from server.lora_modules import LoRAModules
from server.protocol import APIError, get_field
from server.reasoning import REASONING_PARSERS
from server.tenants import Tenant, TenantLimits
from server.tool_parsers import TOOL_PARSERS

_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")  # (a JSON \uD800-\uDFFF escape)
BODY_TIMEOUT_S = 30.0  # a request body not in by then is a 408: a slow sender cannot hold a handler forever


@dataclass(frozen=True)
class ChatOptions:
    """vLLM's chat serving flags: --enable-auto-tool-choice with a --tool-call-parser (tool_choice "auto" parses
    the calls a model writes; "required" and named functions need neither), --reasoning-parser."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {sorted(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {list(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")

    @property
    def auto_tools(self) -> bool:
        return self.enable_auto_tool_choice and self.tool_call_parser is not None


class ServerState:
    """What the handlers share: the engine, the served model's name and limits, the API key."""

    def __init__(self, engine: AsyncLLM, model_name: str | None, api_key: str | None,
                 tenants: list[Tenant] | None = None, kv_pull_from: list[str] | None = None,
                 prompt_tokens_details: bool = False, chat: ChatOptions | None = None,
                 lora_modules: list[tuple[str, str, str | None]] | None = None, allow_runtime_lora: bool = False):
        self.engine = engine
        self.chat = chat or ChatOptions()
        self.prompt_tokens_details = prompt_tokens_details  # usage carries prompt_tokens_details.cached_tokens
        self.kv_pull_from = [u.rstrip("/") for u in kv_pull_from or []]  # prefill instances trusted for KV blocks
        cfg = engine.engine.config
        self.model_name = model_name or os.path.basename(cfg.model_config.model.rstrip("/"))
        self.max_model_len = cfg.scheduler_config.max_model_len
        self.max_num_seqs = cfg.scheduler_config.max_num_seqs
        self.api_key = api_key
        self.body_timeout_s = BODY_TIMEOUT_S
        self.limits = TenantLimits(tenants) if tenants else None
        engine.engine.set_kv_shares({t.name: (t.kv_min, t.kv_max) for t in tenants} if tenants else None)
        self.loras = LoRAModules(engine, self.model_name, allow_runtime_lora)  # (--lora-modules: loaded now)
        for name, path, base in lora_modules or []:
            self.loras.add(name, path, base)

    async def read_json(self, request: web.Request) -> dict:
        try:
            raw = await asyncio.wait_for(request.read(), self.body_timeout_s)
        except TimeoutError:
            raise APIError(f"the request body did not arrive within {self.body_timeout_s:g} s", status=408,
                           err_type="RequestTimeoutError") from None
        try:
            body = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise APIError("the request body is not valid UTF-8") from None
        except json.JSONDecodeError as e:
            raise APIError(f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise APIError("the request body is nested too deeply") from None
        except ValueError as e:  # (e.g. an integer of more digits than Python converts)
            raise APIError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        if _SURROGATE_ESCAPE.search(raw):  # (a pair is one character once decoded; a lone half is no text)
            try:
                json.dumps(body, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                raise APIError("the request body has a lone UTF-16 surrogate (\\uD800-\\uDFFF) in a string") from None
        return body

    def check_model(self, body: dict) -> LoRARequest | None:
        """The LoRA adapter the request's `model` names, None for the base model (or no model); 404 for others."""
        return self.loras.request_for(get_field(body, "model", (str,), None))

    def check_n(self, n: int) -> None:
        """A request's samples run at once, one sequence slot each: more than there are is a 400 (before the
        handler sizes anything by n)."""
        if n > self.max_num_seqs:
            raise APIError(f"n: {n} samples exceed the server's max_num_seqs={self.max_num_seqs}", param="n")

    def check_length(self, prompt_len: int, max_tokens: int | None, *, where: str) -> None:
        """OpenAI's context-length error; `where` names the input ("prompt" or "messages")."""
        total = prompt_len + (max_tokens or 0)
        if prompt_len >= self.max_model_len or total > self.max_model_len:
            raise APIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({prompt_len} in the {where}, {max_tokens or 0} in the completion).",
                param="max_tokens" if prompt_len < self.max_model_len else where)


STATE = web.AppKey("state", ServerState)
# Per-request storage: the caller's tenant (None without tenants), and a started event stream (server/streaming.py).
_key = getattr(web, "RequestKey", lambda name, _: name)  # (typed keys since aiohttp 3.13; plain strings before)
TENANT = _key("tenant", object)
SSE = _key("sse", object)
