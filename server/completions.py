"""POST /v1/completions."""

from __future__ import annotations

from aiohttp import web

from server.state import STATE
from server.protocol import (
    APIError,
    Usage,
    completion_logprobs,
    get_field,
    new_id,
    now,
    prompt_logprobs_json,
    sampling_params_from,
)
from server.streaming import SSEWriter, merged, start_all


def parse_prompts(body: dict, tokenizer) -> list[list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> token id lists."""
    prompt = get_field(body, "prompt", (str, list))
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
            out.append(tokenizer.encode(p, add_special_tokens=True))
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            out.append(list(p))
        else:
            raise APIError("'prompt' must be a string, a list of strings, or token ids", param="prompt")
    return out


async def create_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await state.read_json(request)
    state.check_model(body)
    prompts = parse_prompts(body, state.engine.tokenizer)
    params = sampling_params_from(body, default_max_tokens=16)
    for p in prompts:
        state.check_length(len(p), params.max_tokens)
    rid, created = new_id("cmpl"), now()
    stream = get_field(body, "stream", (bool,), False)
    include_usage = bool((get_field(body, "stream_options", (dict,), {}) or {}).get("include_usage"))
    gens = await start_all(state.engine, prompts, params, rid)
    n = params.n
    texts = [[""] * n for _ in prompts]
    finish = [[None] * n for _ in prompts]
    tokens = [[[] for _ in range(n)] for _ in prompts]
    logprobs = [[[] for _ in range(n)] for _ in prompts]
    tok = state.engine.tokenizer
    prompt_lps: list = [None] * len(prompts)
    completion_tokens = 0

    def chunk(choices):
        return {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                "choices": choices}

    sse = SSEWriter(request) if stream else None
    if sse:
        await sse.start()
    async for i, out in merged(gens):
        if out.prompt_logprobs is not None:
            prompt_lps[i] = prompt_logprobs_json(out.prompt_logprobs)
        choices = []
        for o in out.outputs:
            completion_tokens += len(o.token_ids)
            texts[i][o.index] += o.text
            finish[i][o.index] = o.finish_reason
            tokens[i][o.index] += o.token_ids
            delta_lp = o.logprobs[-len(o.token_ids):] if o.logprobs is not None and o.token_ids else None
            if delta_lp:
                logprobs[i][o.index] += delta_lp
            if sse and (o.text or o.finish_reason):
                choices.append({"index": i * n + o.index, "text": o.text,
                                "logprobs": completion_logprobs(delta_lp, o.token_ids, tok) if delta_lp else None,
                                "finish_reason": o.finish_reason, "stop_reason": o.stop_reason})
        if sse and choices:
            await sse.send(chunk(choices))
    usage = Usage(sum(len(p) for p in prompts), completion_tokens)
    if sse:
        if include_usage:
            await sse.send({**chunk([]), "usage": usage.to_dict()})
        return await sse.done()
    want_lp = params.logprobs is not None
    choices = [{"index": i * n + j, "text": texts[i][j], "finish_reason": finish[i][j],
                "logprobs": completion_logprobs(logprobs[i][j], tokens[i][j], tok) if want_lp else None,
                "prompt_logprobs": prompt_lps[i]}
               for i in range(len(prompts)) for j in range(n)]
    return web.json_response({**chunk(choices), "usage": usage.to_dict()})
