"""LoRA adapters behind the OpenAI API (vLLM's): `--lora-modules name=path ...` served under their names (the
request's `model` picks one), listed by /v1/models beside the base model, and, with
`--allow-runtime-lora-updating` (or $VLLM_ALLOW_RUNTIME_LORA_UPDATING=true), loaded and unloaded at run time by
POST /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter {"lora_name"}."""

from __future__ import annotations

import asyncio
import json
import os

from aiohttp import web

from jaxpaged.lora_request import LoRARequest
from server.protocol import APIError, get_field

RUNTIME_UPDATES_ENV = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "JAXPAGED_ALLOW_RUNTIME_LORA_UPDATING")


def parse_lora_modules(entries: list[str] | None) -> list[tuple[str, str, str | None]]:
    """`--lora-modules` entries, `name=path` or vLLM's JSON {"name", "path", "base_model_name"}: (name, path,
    base model name) each; ValueError naming a bad one."""
    out = []
    for entry in entries or []:
        if entry.lstrip().startswith("{"):
            try:
                d = json.loads(entry)
                name, path, base = d["name"], d["path"], d.get("base_model_name")
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules: {entry!r} is not a JSON object with name and path ({e})") from None
        else:
            name, sep, path = entry.partition("=")
            base = None
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: expected name=path, got {entry!r}")
        if any(name == n for n, _, _ in out):
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        out.append((name, path, base))
    return out


def runtime_updates_allowed(flag: bool) -> bool:
    return flag or any(os.environ.get(v, "").lower() in ("1", "true") for v in RUNTIME_UPDATES_ENV)


class LoRAModules:
    """The adapters the server serves, by name; each loaded (read and checked) when added, so a request that
    names one never waits on its folder."""

    def __init__(self, engine, base_name: str, allow_runtime_updates: bool = False):
        self.engine = engine  # the AsyncLLM
        self.base_name = base_name
        self.allow_runtime_updates = allow_runtime_updates
        self.by_name: dict[str, LoRARequest] = {}
        self._lock = asyncio.Lock()

    @property
    def enabled(self) -> bool:
        return self.engine.engine.loras is not None

    def new_request(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """The LoRARequest a new adapter would be served by (ValueError naming what is wrong: no LoRA, a taken
        name)."""
        if not self.enabled:
            raise ValueError("lora_name: the server was started without --enable-lora")
        if name == self.base_name or name in self.by_name:
            raise ValueError(f"lora_name: the name {name!r} is already in use")
        return LoRARequest(name, self.engine.engine.loras.id_for(name, path), path, base_model_name)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Load and serve an adapter under `name` now (at start; ValueError naming what is wrong)."""
        request = self.new_request(name, path, base_model_name)
        self.engine.engine.loras.resolve(request, keep=True)
        self.by_name[name] = request
        return request

    def request_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for a name the server does not have."""
        if model is None or model == self.base_name:
            return None
        request = self.by_name.get(model)
        if request is None:
            raise APIError(f"The model `{model}` does not exist.", status=404, param="model", err_type="NotFoundError")
        return request

    def model_cards(self, created: int) -> list[dict]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "jaxpaged", "root": r.lora_path,
                 "parent": self.base_name} for name, r in self.by_name.items()]

    def _check_runtime_updates(self) -> None:
        if not self.allow_runtime_updates:
            raise APIError("Loading and unloading LoRA adapters at run time is off: start the server with "
                           "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)", status=403,
                           err_type="PermissionDeniedError")

    async def load(self, body: dict) -> str:
        self._check_runtime_updates()
        name = get_field(body, "lora_name", (str,), nullable=False)
        path = get_field(body, "lora_path", (str,), nullable=False)
        if not name or not path:
            raise APIError("lora_name and lora_path must be non-empty", param="lora_name" if not name else "lora_path")
        async with self._lock:  # (one load at a time: the name check and the add stay together)
            try:
                request = self.new_request(name, path)
                # (read and checked on a worker thread; `by_name` itself only changes here, on the loop)
                await asyncio.to_thread(self.engine.engine.loras.resolve, request, keep=True)
            except ValueError as e:
                raise APIError(str(e), param="lora_name" if "name" in str(e).split(":")[0] else "lora_path") from None
            self.by_name[name] = request
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: dict) -> str:
        self._check_runtime_updates()
        name = get_field(body, "lora_name", (str,), nullable=False)
        request = self.by_name.pop(name, None)
        if request is None:
            raise APIError(f"The LoRA adapter '{name}' cannot be found.", status=404, param="lora_name",
                           err_type="NotFoundError")
        self.engine.forget_lora(request.lora_int_id)
        return f"Success: LoRA adapter '{name}' removed successfully."


def add_routes(app: web.Application, state_key) -> None:
    async def load(request: web.Request) -> web.Response:
        state = request.app[state_key]
        return web.Response(text=await state.loras.load(await state.read_json(request)))

    async def unload(request: web.Request) -> web.Response:
        state = request.app[state_key]
        return web.Response(text=await state.loras.unload(await state.read_json(request)))

    app.router.add_post("/v1/load_lora_adapter", load)
    app.router.add_post("/v1/unload_lora_adapter", unload)
