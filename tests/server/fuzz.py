"""Requests generated from the server's OpenAPI document, and hostile variants of them, sent in concurrent
batches; every answer checked: never a 5xx or a hang, a 4xx always OpenAI's error JSON, a 200 valid against its
response schema (every event of a stream). tests/server/test_fuzz.py runs a bounded number in CI;

    python -m tests.server.fuzz --requests 20000 --json fuzz.json

runs the longer one against a tiny model (docs/benchmarks/reliability.md)."""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import time

import aiohttp
import jsonschema
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from server.openapi import openapi_document
from server.schemas import RESPONSES

ENDPOINTS = {"/v1/completions": ("Completion", "Completion"),
             "/v1/chat/completions": ("ChatCompletion", "ChatCompletionChunk"),
             "/tokenize": ("TokenizeResponse", None), "/detokenize": ("DetokenizeResponse", None)}
BATCH = 8  # requests sent at once per generated example
TIMEOUT_S = 120  # an answer later than this is a hang

# Bodies no schema describes: truncated, deeply nested, numbers with thousands of digits, invalid UTF-8, a
# lone surrogate, JSON that is not an object.
RAW = [b"", b"null", b"[]", b"123", b'"x"', b"{", b"[" * 100_000, b'{"a": ' * 50_000,
       b'{"prompt": 1' + b"0" * 5000 + b"}", b'{"prompt": "\xff\xfe"}', b'{"prompt": "\\ud800"}',
       b'{"messages": [{"role": "user", "content": "\\udfff"}]}', b'{"prompt": NaN, "n": Infinity}',
       b'{"prompt": "w5", "prompt": 3}', b'{"tokens": [1e400]}']


def raw_body(i: int) -> bytes:
    return RAW[i]  # (a function, so the strategy's repr does not print RAW)


def bounded(schema, depth: int = 0):
    """The schema with small strings, arrays and free-form objects (and no extra keys deep inside), so a
    generated request is cheap to make and to serve; the top-level objects still get unknown fields."""
    if isinstance(schema, list):
        return [bounded(v, depth + 1) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded(v, depth + 1) for k, v in schema.items()}
    if out.get("type") == "string":
        out.setdefault("maxLength", 24)
    elif out.get("type") == "array":
        out.setdefault("maxItems", 3)
    elif out.get("type") == "object":
        out.setdefault("maxProperties", 4 if "properties" not in out else 60)
        if "properties" in out and depth > 3:
            out.setdefault("additionalProperties", False)
    return out


def request_cases() -> st.SearchStrategy[tuple[str, str, bytes]]:
    """(path, content type, body) for the POST routes of the OpenAPI document: schemathesis's valid
    (positive) and invalid (negative) bodies, and the raw bodies above."""
    doc = openapi_document("fuzz")
    doc["components"]["schemas"] = {k: bounded(v) for k, v in doc["components"]["schemas"].items()}
    schema = schemathesis.openapi.from_dict(doc)

    def encoded(path):
        def encode(case):
            body = case.body
            return path, "application/json", body if isinstance(body, bytes) else json.dumps(body).encode()
        return encode

    generated = [schema[path]["POST"].as_strategy(generation_mode=mode).map(encoded(path))
                 for path in ENDPOINTS for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
    raw = st.tuples(st.sampled_from(sorted(ENDPOINTS)), st.sampled_from(["application/json", "text/plain"]),
                    st.integers(0, len(RAW) - 1).map(raw_body))
    return st.one_of(*generated, raw)


class Tally:
    """What came back: counts by (path, status) and every breach of the contract."""

    def __init__(self):
        self.status = collections.Counter()
        self.breaches: list[str] = []
        self.sent = 0

    def summary(self) -> dict:
        return {"requests": self.sent, "breaches": len(self.breaches), "first_breaches": self.breaches[:10],
                "by_status": {f"{p} {s}": n for (p, s), n in sorted(self.status.items())}}


def check_answer(path: str, status: int, content_type: str, raw: bytes) -> str | None:
    """None when the answer keeps the contract, else what broke."""
    if status >= 500:
        return f"{status}: {raw[:300]!r}"
    response, chunk = ENDPOINTS[path]
    try:
        if content_type == "text/event-stream":
            events = [e[6:] for e in raw.decode().split("\n\n") if e]
            if not events or events[-1] != "[DONE]":
                return f"a stream without [DONE]: {raw[-200:]!r}"
            for e in events[:-1]:
                item = json.loads(e)
                jsonschema.validate(item, RESPONSES["ErrorResponse" if "error" in item else chunk])
            return None
        jsonschema.validate(json.loads(raw), RESPONSES[response if status == 200 else "ErrorResponse"])
    except (ValueError, jsonschema.ValidationError) as e:
        return f"{status} {path}: {type(e).__name__}: {str(e)[:300]} in {raw[:200]!r}"
    return None


async def send(session: aiohttp.ClientSession, base_url: str, path: str, content_type: str, data: bytes,
               tally: Tally) -> None:
    tally.sent += 1
    try:
        async with session.post(base_url + path, data=data, headers={"Content-Type": content_type},
                                timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as r:
            raw = await r.read()
            tally.status[path, r.status] += 1
            if (breach := check_answer(path, r.status, r.content_type, raw)) is not None:
                tally.breaches.append(f"{breach} <- {data[:300]!r}")
    except TimeoutError:
        tally.breaches.append(f"no answer in {TIMEOUT_S} s <- {path} {data[:300]!r}")
    except aiohttp.ClientError as e:
        tally.breaches.append(f"connection failed ({type(e).__name__}: {e}) <- {path} {data[:300]!r}")


def fuzz(base_url: str, num_requests: int, headers: dict | None = None, seed: int = 0) -> Tally:
    """Send ~num_requests generated requests, BATCH at a time, to the server at base_url."""
    tally = Tally()

    async def batch(cases):
        async with aiohttp.ClientSession(headers=headers) as s:
            await asyncio.gather(*(send(s, base_url, p, c, d, tally) for p, c, d in cases))

    @settings(max_examples=math.ceil(num_requests / BATCH), deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=["generate"])
    @given(st.lists(request_cases(), min_size=BATCH, max_size=BATCH))
    def run(cases):
        asyncio.run(batch(cases))

    run()
    return tally


def main() -> None:
    """Serve a tiny random-weight model and fuzz it; prints and writes the tally."""
    import tempfile

    from tests.server.conftest import serving
    from tests.tiny_models import make_tiny_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as d, serving(make_tiny_model("llama", d), max_model_len=64) as server:
        tally = fuzz(server.base_url, args.requests, headers={"Authorization": "Bearer test-key"})
        kv = server.engine.engine.kv_cache_manager
        out = {**tally.summary(), "seconds": round(time.perf_counter() - start, 1),
               "kv_usage_after": kv.usage(), "unfinished_after": server.engine.num_unfinished}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
