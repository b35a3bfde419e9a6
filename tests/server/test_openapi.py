"""/openapi.json: the document is valid, names every route the app serves, and says what the handlers do: every
field a handler reads is in its request schema with the same JSON types, and real responses (streamed and
not, errors too) validate against the response schemas."""

from __future__ import annotations

import ast
import asyncio
import json
from pathlib import Path

import aiohttp
import jsonschema
import pytest

from server.openapi import openapi_document
from server.schemas import REQUESTS, RESPONSES
from tests.server.conftest import API_KEY

SERVER_DIR = Path(__file__).resolve().parents[2] / "server"
PY_TO_JSON = {"int": "integer", "float": "number", "str": "string", "bool": "boolean", "list": "array",
              "dict": "object"}


def json_types(schema: dict) -> set[str]:
    """The JSON types a schema admits (following anyOf; a const or enum by its values' types), null left out."""
    if "anyOf" in schema:
        return set().union(*(json_types(s) for s in schema["anyOf"]))
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if values is not None:
        return {PY_TO_JSON[type(v).__name__] for v in values}
    t = schema.get("type")
    return ({t} if isinstance(t, str) else set(t or ())) - {"null"}


def fields_read(source: str) -> list[tuple[str, set[str] | None]]:
    """(name, JSON types) of each `get_field(body, "name", (kinds...), ...)` in the source, and (name, None)
    of each `body.get("name")` / `body["name"]`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "get_field" and len(node.args) >= 3:
            name, kinds = node.args[1], node.args[2]
            if isinstance(name, ast.Constant) and isinstance(kinds, ast.Tuple):
                types = {PY_TO_JSON[k.id] for k in kinds.elts}
                if "number" in types:
                    types.discard("integer")  # ((int, float): a JSON number)
                out.append((name.value, types))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and getattr(node.func.value, "id", None) == "body" and isinstance(node.args[0], ast.Constant)):
            out.append((node.args[0].value, None))
        elif (isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == "body"
              and isinstance(node.slice, ast.Constant)):
            out.append((node.slice.value, None))
    return out


def mismatches(reads: list[tuple[str, set[str] | None]], requests: dict) -> list[str]:
    """Fields read that no request schema documents, or documents with other JSON types."""
    bad = []
    for name, types in reads:
        documented = [json_types(s["properties"][name]) for s in requests.values() if name in s["properties"]]
        if not documented:
            bad.append(f"{name}: in no request schema")
        elif types is not None and types not in documented:
            bad.append(f"{name}: read as {sorted(types)}, documented as {[sorted(d) for d in documented]}")
    return bad


def test_every_field_a_handler_reads_is_documented_with_its_types():
    reads = [r for f in sorted(SERVER_DIR.glob("*.py")) if f.name not in ("disagg_proxy.py", "tenants.py")
             for r in fields_read(f.read_text())]
    assert len(reads) > 40  # (the scan sees the handlers' fields)
    assert mismatches(reads, REQUESTS) == []


def test_the_field_check_sees_a_drift():
    """(The check above can fail: an undocumented field, and a documented one read as another type.)"""
    reads = fields_read('get_field(body, "temperature", (str,), 1)\nbody.get("wizardry")\n'
                        'get_field(body, "top_p", (int, float), 1.0)')
    assert mismatches(reads, REQUESTS) == [
        "temperature: read as ['string'], documented as [['number'], ['number']]", "wizardry: in no request schema"]


def test_the_document_is_valid_openapi_with_valid_schemas():
    doc = openapi_document("0")
    assert doc["openapi"].startswith("3.1")
    for schema in doc["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)
    refs = {m for m in json.dumps(doc["paths"]).split('"') if m.startswith("#/components/schemas/")}
    assert refs and all(r.rsplit("/", 1)[1] in doc["components"]["schemas"] for r in refs)


def get(server, path: str):
    async def go():
        async with (aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s,
                    s.get(server.base_url + path) as r):
            return r.status, await r.json()
    return asyncio.run(go())


def post_raw(server, path: str, body: dict):
    """(status, JSON body, or the list of SSE payloads of a stream)."""
    async def go():
        async with (aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s,
                    s.post(server.base_url + path, json=body) as r):
            raw = (await r.read()).decode()
            if r.content_type == "text/event-stream":
                events = [e[6:] for e in raw.split("\n\n") if e]
                assert events[-1] == "[DONE]"
                return r.status, [json.loads(e) for e in events[:-1]]
            return r.status, json.loads(raw)
    return asyncio.run(go())


def check(instance, name: str):
    jsonschema.validate(instance, RESPONSES[name], cls=jsonschema.Draft202012Validator)


def test_served_document_names_every_route(live_server):
    status, doc = get(live_server, "/openapi.json")
    assert status == 200 and doc == json.loads(json.dumps(openapi_document(doc["info"]["version"])))
    app_routes = {r.resource.canonical for r in live_server.runner.app.router.routes()
                  if r.method in ("GET", "POST") and r.resource.canonical not in ("/kv_transfer",)}
    assert app_routes == set(doc["paths"])


MESSAGES = [{"role": "user", "content": "w5 w6"}]


@pytest.mark.parametrize("stream", [False, True])
def test_real_responses_validate_against_their_schemas(live_server, stream):
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    completion = {"model": "tiny", "prompt": ["w5 w6", "w7"], "max_tokens": 3, "logprobs": 2, "n": 2,
                  "prompt_logprobs": 1, **extra}
    chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, **extra}
    for path, body, request, response in [
            ("/v1/completions", completion, "CompletionRequest", "Completion"),
            ("/v1/chat/completions", chat, "ChatCompletionRequest",
             "ChatCompletionChunk" if stream else "ChatCompletion")]:
        jsonschema.validate(body, REQUESTS[request])
        status, out = post_raw(live_server, path, body)
        assert status == 200
        for item in out if stream else [out]:
            check(item, response)
    for path, body, name in [("/tokenize", {"prompt": "w5 w6", "return_token_strs": True}, "TokenizeResponse"),
                             ("/tokenize", {"messages": MESSAGES}, "TokenizeResponse"),
                             ("/detokenize", {"tokens": [5, 6]}, "DetokenizeResponse")]:
        jsonschema.validate(body, REQUESTS[name.replace("Response", "Request")])
        status, out = post_raw(live_server, path, body)
        assert status == 200
        check(out, name)
    for path, name in [("/v1/models", "ModelList"), ("/version", "VersionResponse")]:
        status, out = get(live_server, path)
        assert status == 200
        check(out, name)


def test_errors_validate_against_the_error_schema(live_server):
    for path, body in [("/v1/completions", {"prompt": "w5", "temperature": -1}),
                       ("/v1/chat/completions", {"messages": []}), ("/detokenize", {"tokens": [-1]})]:
        status, out = post_raw(live_server, path, body)
        assert status == 400
        check(out, "ErrorResponse")
