"""GET /openapi.json: the server's OpenAPI 3.1 document, built from `server/schemas.py` (as vLLM's FastAPI
server publishes one), so clients, gateways and fuzzers read the same contract the handlers validate."""

from __future__ import annotations

from server.schemas import REQUESTS, RESPONSES

_JSON = "application/json"


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _ok(name: str | None, *, text: str = "OK", stream: str | None = None) -> dict:
    content = {_JSON: {"schema": _ref(name)}} if name else {}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string", "description": f"SSE events, each "
                                                   f"`data: <{stream}>`, then `data: [DONE]`"}}
    return {"description": text, **({"content": content} if content else {})}


_ERRORS = {str(code): {"description": text, "content": {_JSON: {"schema": _ref("ErrorResponse")}}}
           for code, text in [(400, "invalid request (the error's `param` names the field)"),
                              (401, "missing or wrong API key"), (404, "unknown model"),
                              (413, "request body too large"), (429, "a tenant's limit reached"),
                              (503, "the engine has stopped")]}


def _post(summary: str, request: str, response: str, op: str, stream: str | None = None) -> dict:
    return {"post": {"summary": summary, "operationId": op,
                     "requestBody": {"required": True, "content": {_JSON: {"schema": _ref(request)}}},
                     "responses": {"200": _ok(response, stream=stream), **_ERRORS}}}


def _get(summary: str, response: str | None, op: str, text: str = "OK", **extra) -> dict:
    return {"get": {"summary": summary, "operationId": op, "responses": {"200": _ok(response, text=text),
                                                                         **extra}}}


def openapi_document(version: str) -> dict:
    """The OpenAPI 3.1 document of every route `create_app` serves to clients."""
    paths = {
        "/v1/completions": _post("Create a completion", "CompletionRequest", "Completion", "createCompletion",
                                  stream="Completion"),
        "/v1/chat/completions": _post("Create a chat completion", "ChatCompletionRequest", "ChatCompletion",
                                      "createChatCompletion", stream="ChatCompletionChunk"),
        "/tokenize": _post("Token ids of a prompt or of chat messages through the chat template",
                           "TokenizeRequest", "TokenizeResponse", "tokenize"),
        "/detokenize": _post("Text of token ids", "DetokenizeRequest", "DetokenizeResponse", "detokenize"),
        "/v1/models": _get("The served model", "ModelList", "listModels"),
        "/health": _get("200 while the engine runs", None, "health",
                        **{"503": {"description": "the engine has stopped"}}),
        "/ping": _get("Alias of /health", None, "ping"),
        "/version": _get("The server's version", "VersionResponse", "version"),
        "/metrics": _get("Prometheus metrics", None, "metrics", text="Prometheus text format"),
        "/tokenizer_info": _get("The tokenizer's special tokens, chat template and size", None, "tokenizerInfo"),
        "/openapi.json": _get("This document", None, "openapi"),
        "/v1/load_lora_adapter": _post("Serve a LoRA adapter (PEFT folder) under a name (text reply)",
                                       "LoadLoRAAdapterRequest", None, "loadLoraAdapter"),
        "/v1/unload_lora_adapter": _post("Stop serving a LoRA adapter (text reply)", "UnloadLoRAAdapterRequest",
                                         None, "unloadLoraAdapter"),
    }
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):  # (403: --allow-runtime-lora-updating is off)
        paths[path]["post"]["responses"]["403"] = {"description": "runtime LoRA updating is off",
                                                   "content": {_JSON: {"schema": _ref("ErrorResponse")}}}
    return {"openapi": "3.1.0",
            "info": {"title": "jaxpaged OpenAI-compatible server", "version": version},
            "paths": paths,
            "components": {"schemas": {**REQUESTS, **RESPONSES},
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
            "security": [{}, {"bearer": []}]}
