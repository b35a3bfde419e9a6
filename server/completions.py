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
from server.streaming import SSEWriter, generate_all


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
    params = sampling_params_from(body, default_max_tokens=16)
    prompts = parse_prompts(body, state.engine.tokenizer)
    for p in prompts:
        state.check_length(len(p), params.max_tokens, where="prompt")
    rid, created = new_id("cmpl"), now()
    stream = get_field(body, "stream", (bool,), False)
    include_usage = bool((get_field(body, "stream_options", (dict,), {}) or {}).get("include_usage"))
    n = params.n
    # Choice index = prompt index * n + sample index (vLLM's order).
    texts = [""] * (len(prompts) * n)
    finish: list = [None] * len(texts)
    stop_reasons: list = [None] * len(texts)
    logprobs: list = [None if params.logprobs is None else completion_logprobs([], []) for _ in texts]
    prompt_lps: list = [None] * len(prompts)
    completion_tokens = 0

    def chunk(choices):
        return {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                "choices": choices}

    async with generate_all(state.engine, prompts, params, rid) as outputs:
        sse = SSEWriter(request) if stream else None
        if sse:
            await sse.start()
        async for i, out in outputs:
            if out.prompt_logprobs is not None:
                prompt_lps[i] = prompt_logprobs_json(out.prompt_logprobs)
            choices = []
            for o in out.outputs:
                c = i * n + o.index
                completion_tokens += len(o.token_ids)
                lp = None
                if o.logprobs is not None:
                    lp = completion_logprobs(o.logprobs, o.token_ids, text_offset=len(texts[c]))
                    for key in lp:
                        logprobs[c][key] += lp[key]
                texts[c] += o.text
                finish[c], stop_reasons[c] = o.finish_reason, o.stop_reason
                choices.append({"index": c, "text": o.text, "logprobs": lp, "finish_reason": o.finish_reason,
                                "stop_reason": o.stop_reason})
            if sse:
                for choice in choices:  # one choice per chunk, as vLLM and OpenAI send them
                    await sse.send(chunk([choice]))
    usage = Usage(sum(len(p) for p in prompts), completion_tokens)
    if sse:
        if include_usage:
            await sse.send({**chunk([]), "usage": usage.to_dict()})
        return await sse.done()
    choices = [{"index": c, "text": texts[c], "finish_reason": finish[c], "stop_reason": stop_reasons[c],
                "logprobs": logprobs[c], "prompt_logprobs": prompt_lps[c // n]} for c in range(len(texts))]
    return web.json_response({**chunk(choices), "usage": usage.to_dict()})
