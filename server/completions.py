"""POST /v1/completions."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

import jaxpaged.faults as faults
from jaxpaged.request import prefix_salt
from server.kv_transfer import pull_blocks, transfer_source
from server.protocol import (
    APIError,
    Usage,
    cache_salt_from,
    check_no_failed_choice,
    completion_logprobs,
    get_field,
    new_id,
    now,
    prompt_logprobs_json,
    sampling_params_from,
    stream_usage,
)
from server.state import STATE, TENANT
from server.streaming import SSEWriter, generate_all


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None  # as the client sent it; None for token ids


def parse_prompts(body: dict, tokenizer) -> list[Prompt]:
    """str | list[str] | list[int] | list[list[int]] -> prompts."""
    prompt = get_field(body, "prompt", (str, list))
    special = get_field(body, "add_special_tokens", (bool,), True)  # (vLLM's: e.g. BOS in front of a text)
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [prompt]
    else:
        prompts = prompt
    if not prompts:
        raise APIError("'prompt' must not be empty", param="prompt")
    out = []
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise APIError("'prompt' must not be empty", param="prompt")
            faults.check("tokenizer")
            out.append(Prompt(tokenizer.encode(p, add_special_tokens=special), p))
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            out.append(Prompt(list(p), None))
        else:
            raise APIError("'prompt' must be a string, a list of strings, or token ids", param="prompt")
    return out


def echo_request(body: dict) -> tuple[dict, bool]:
    """`echo` as vLLM reads it: the body the sampling parameters come from, and whether nothing is generated.

    `max_tokens: 0` scores the prompt without generating (one token is drawn and dropped); with `logprobs: k`
    the prompt's tokens get k alternatives too."""
    echo = get_field(body, "echo", (bool,), False)
    if not echo:
        return body, False
    body = dict(body)
    only_prompt = body.get("max_tokens") == 0
    if only_prompt:
        body["max_tokens"] = 1
    k = get_field(body, "logprobs", (int,), None)
    if k is not None:
        body["prompt_logprobs"] = max(k, get_field(body, "prompt_logprobs", (int,), None) or 0)
    return body, only_prompt


async def create_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await state.read_json(request)
    lora = state.check_model(body)
    echo = get_field(body, "echo", (bool,), False)
    wants_prompt_logprobs = body.get("prompt_logprobs") is not None
    engine_body, only_prompt = echo_request(body)
    params = sampling_params_from(engine_body, default_max_tokens=16)
    state.check_n(params.n)
    cache_salt = cache_salt_from(body)
    as_ids = get_field(body, "return_tokens_as_token_ids", (bool,), False)
    tok = state.engine.tokenizer
    prompts = [p if (ids := params.truncated(p.token_ids, state.max_model_len)) is p.token_ids else Prompt(ids, None)
               for p in parse_prompts(body, tok)]
    for p in prompts:
        state.check_length(len(p.token_ids), params.max_tokens, where="prompt")
    if (source := transfer_source(body, state)) is not None:  # (prefill/decode disaggregation across hosts)
        salt = prefix_salt(cache_salt, lora and state.engine.engine.resolve_lora(lora))  # (as the engine hashes)
        await pull_blocks(state, request, source, [p.token_ids for p in prompts], salt)
    rid, created = new_id("cmpl"), now()
    stream = get_field(body, "stream", (bool,), False)
    include_usage, continuous_usage = stream_usage(body)
    n = params.n
    # Choice index = prompt index * n + sample index (vLLM's order).
    texts = [""] * (len(prompts) * n)
    finish: list = [None] * len(texts)
    stop_reasons: list = [None] * len(texts)
    logprobs: list = [None if params.logprobs is None else completion_logprobs([], []) for _ in texts]
    prompt_lps: list = [None] * len(prompts)  # the engine's entries, per prompt
    started = [False] * len(texts)
    offsets = [0] * len(texts)  # where the next token's text starts: the echo, then the tokens' texts so far
    choice_tokens = [0] * len(texts)
    completion_tokens = 0
    cached: list[int | None] = [None] * len(prompts)  # each prompt's tokens found in the prefix cache

    def cached_tokens(*indices: int) -> int | None:
        return sum(cached[i] or 0 for i in indices) if state.prompt_tokens_details else None

    def chunk(choices):
        return {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                "choices": choices}

    def echoed(i: int) -> tuple[str, dict | None]:
        """Prompt i's text and, with logprobs, its logprobs object (the first token's logprob is null)."""
        p = prompts[i]
        text = p.text if p.text is not None else tok.decode(p.token_ids)
        if params.logprobs is None:
            return text, None
        entries = prompt_lps[i] or [None] * len(p.token_ids)
        return text, completion_logprobs(entries, p.token_ids, as_ids=as_ids,
                                         first_text=tok.decode(p.token_ids[:1]))

    async with generate_all(state.engine, [p.token_ids for p in prompts], params, rid,
                            priority=get_field(body, "priority", (int,), 0), tenant=request.get(TENANT),
                            limits=state.limits, cache_salt=cache_salt, lora_request=lora) as outputs:
        sse = SSEWriter(request) if stream else None
        if sse:
            await sse.start()
        async for i, out in outputs:
            if out.prompt_logprobs is not None:
                prompt_lps[i] = out.prompt_logprobs
            if out.num_cached_tokens is not None and cached[i] is None:
                cached[i] = out.num_cached_tokens
            for o in out.outputs:
                c = i * n + o.index
                text, token_ids, lp = o.text, o.token_ids, None
                if only_prompt:
                    text, token_ids = "", []
                prefix, prefix_lp = "", None
                if echo and not started[c]:
                    prefix, prefix_lp = echoed(i)
                    texts[c] = prefix
                    offsets[c] = len(prefix)
                started[c] = True
                completion_tokens += len(token_ids)
                choice_tokens[c] += len(token_ids)
                if o.logprobs is not None:
                    entries = o.logprobs[: len(token_ids)]
                    # (offsets count the tokens' texts, not the text sent so far, which may hold back a partial
                    # character or stop string: the same offsets however the tokens are grouped into chunks)
                    lp = completion_logprobs(entries, token_ids, text_offset=offsets[c], as_ids=as_ids)
                    offsets[c] += sum(len(e[t].decoded_token or "") for t, e in zip(token_ids, entries))
                    if prefix_lp is not None:
                        lp = {key: prefix_lp[key] + lp[key] for key in lp}
                    for key in lp:
                        logprobs[c][key] += lp[key]
                texts[c] += text
                finish[c], stop_reasons[c] = o.finish_reason, o.stop_reason
                if sse:
                    payload = chunk([{"index": c, "text": prefix + text, "logprobs": lp,
                                      "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}])
                    if continuous_usage:
                        payload["usage"] = Usage(len(prompts[i].token_ids), choice_tokens[c],
                                                 cached_tokens(i)).to_dict()
                    await sse.send(payload)
    usage = Usage(sum(len(p.token_ids) for p in prompts), completion_tokens, cached_tokens(*range(len(prompts))))
    if sse:
        if include_usage:
            await sse.send({**chunk([]), "usage": usage.to_dict()})
        return await sse.done()
    check_no_failed_choice(finish)
    choices = [{"index": c, "text": texts[c], "finish_reason": finish[c], "stop_reason": stop_reasons[c],
                "logprobs": logprobs[c],
                "prompt_logprobs": prompt_logprobs_json(prompt_lps[c // n]) if wants_prompt_logprobs else None}
               for c in range(len(texts))]
    return web.json_response({**chunk(choices), "usage": usage.to_dict()})
