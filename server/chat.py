"""POST /v1/chat/completions."""

from __future__ import annotations

from aiohttp import web

from server.kv_transfer import pull_blocks, transfer_source
from server.protocol import (
    APIError,
    Usage,
    cache_salt_from,
    chat_logprobs,
    check_no_failed_choice,
    get_field,
    new_id,
    now,
    sampling_params_from,
    stream_usage,
)
from server.state import STATE, TENANT
from server.streaming import SSEWriter, generate_all

ROLES = {"system", "user", "assistant", "developer", "tool"}


def parse_messages(body: dict) -> list[dict]:
    """Validated messages with string content (text parts joined)."""
    messages = get_field(body, "messages", (list,))
    if not messages:
        raise APIError("'messages' must not be empty", param="messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in ROLES:
            raise APIError(f"each message needs a 'role' in {sorted(ROLES)}", param="messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError("only text content parts are supported", param="messages")
            content = "\n".join(p["text"] for p in content)  # (as vLLM joins text parts)
        if not isinstance(content, str):
            raise APIError("message 'content' must be a string or a list of text parts", param="messages")
        out.append({"role": m["role"], "content": content})
    return out


# apply_chat_template's own arguments: not settable through chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tokenize", "return_dict", "return_tensors", "padding",
                             "truncation", "max_length", "tokenizer_kwargs", "chat_template", "tools"}


def render_chat(tok, messages: list[dict], body: dict) -> tuple[list[int], str]:
    """The prompt's token ids and the reply's role, under vLLM's chat options: `add_generation_prompt` (default
    true; when false the reply continues in the last message's role), `continue_final_message` (the last
    message is left open and the reply extends it), `chat_template_kwargs` (extra template variables, e.g.
    Qwen3's `enable_thinking`), `documents` (for templates that take them) and `add_special_tokens` (the
    tokenizer's, e.g. BOS, on top of the template's; default false). A request's own `chat_template` is a 400,
    as in vLLM unless its server is told to trust them (a template runs the client's code in the server)."""
    if body.get("chat_template") is not None:
        raise APIError("a chat template passed with the request is not accepted (the server's is used)",
                       param="chat_template")
    extra = get_field(body, "chat_template_kwargs", (dict,), None) or {}
    if bad := sorted(set(extra) & _RESERVED_TEMPLATE_KWARGS):
        raise APIError(f"chat_template_kwargs may not set {bad[0]!r}", param="chat_template_kwargs")
    kwargs = {"add_generation_prompt": get_field(body, "add_generation_prompt", (bool,), True),
              "continue_final_message": get_field(body, "continue_final_message", (bool,), False),
              **extra}  # (as vLLM: chat_template_kwargs may set those two as well)
    if kwargs["add_generation_prompt"] and kwargs["continue_final_message"]:
        raise APIError("cannot set both 'continue_final_message' and 'add_generation_prompt' to true",
                       param="chat_template_kwargs" if {"add_generation_prompt", "continue_final_message"} & set(extra)
                       else "continue_final_message")
    if (documents := get_field(body, "documents", (list,), None)) is not None:
        if not all(isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents):
            raise APIError("'documents' must be a list of objects of strings", param="documents")
        kwargs["documents"] = documents
    special = get_field(body, "add_special_tokens", (bool,), False)
    try:
        if special:  # (vLLM's way: the rendered text, tokenized with the tokenizer's special tokens)
            prompt = tok.encode(tok.apply_chat_template(messages, tokenize=False, **kwargs), add_special_tokens=True)
        else:
            prompt = tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"]
    except Exception as e:  # a template that rejects this conversation
        raise APIError(f"the chat template failed on these messages: {e}", param="messages") from None
    # the reply's role follows the field itself, not chat_template_kwargs (vLLM's get_chat_request_role)
    role = "assistant" if get_field(body, "add_generation_prompt", (bool,), True) else messages[-1]["role"]
    return list(prompt), role


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await state.read_json(request)
    state.check_model(body)
    messages = parse_messages(body)
    params = sampling_params_from(body, default_max_tokens=None, chat=True)
    state.check_n(params.n)
    cache_salt = cache_salt_from(body)
    prompt, role = render_chat(state.engine.tokenizer, messages, body)
    # echo (vLLM's): the reply starts with the last message's content when that message has the reply's role
    echo = messages[-1]["content"] if get_field(body, "echo", (bool,), False) and messages[-1]["role"] == role else ""
    prompt = params.truncated(prompt, state.max_model_len)
    state.check_length(len(prompt), params.max_tokens, where="messages")
    if (source := transfer_source(body, state)) is not None:  # (prefill/decode disaggregation across hosts)
        await pull_blocks(state, request, source, [prompt], cache_salt)
    if params.max_tokens is None:
        params.max_tokens = state.max_model_len - len(prompt)
    rid, created = new_id("chatcmpl"), now()
    stream = get_field(body, "stream", (bool,), False)
    include_usage, continuous_usage = stream_usage(body)
    n, k = params.n, params.logprobs or 0
    as_ids = get_field(body, "return_tokens_as_token_ids", (bool,), False)
    texts, finish, stop_reasons = [""] * n, [None] * n, [None] * n
    logprobs: list[list] = [[] for _ in range(n)]
    tokens: list[list[int]] = [[] for _ in range(n)]
    completion_tokens = 0
    cached = None  # prompt tokens found in the prefix cache

    def cached_tokens() -> int | None:
        return (cached or 0) if state.prompt_tokens_details else None

    def chunk(choices, obj="chat.completion.chunk"):
        return {"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": choices}

    def choice_chunk(choice: dict) -> dict:  # one choice per chunk, as vLLM and OpenAI send them
        payload = chunk([choice])
        if continuous_usage:  # (vLLM's continuous_usage_stats: the choice's usage so far)
            payload["usage"] = Usage(len(prompt), len(tokens[choice["index"]]), cached_tokens()).to_dict()
        return payload

    async with generate_all(state.engine, [prompt], params, rid,
                            priority=get_field(body, "priority", (int,), 0), tenant=request.get(TENANT),
                            limits=state.limits, cache_salt=cache_salt) as outputs:
        sse = SSEWriter(request) if stream else None
        if sse:
            await sse.start()
            for j in range(n):
                await sse.send(choice_chunk({"index": j, "delta": {"role": role, "content": ""}, "logprobs": None,
                                             "finish_reason": None}))
            if echo:
                for j in range(n):
                    await sse.send(choice_chunk({"index": j, "delta": {"content": echo}, "logprobs": None,
                                                 "finish_reason": None}))
        async for _, out in outputs:
            if out.num_cached_tokens is not None and cached is None:
                cached = out.num_cached_tokens
            choices = []
            for o in out.outputs:
                completion_tokens += len(o.token_ids)
                texts[o.index] += o.text
                tokens[o.index] += o.token_ids
                finish[o.index], stop_reasons[o.index] = o.finish_reason, o.stop_reason
                lp = None
                if o.logprobs is not None:
                    logprobs[o.index] += o.logprobs
                    lp = chat_logprobs(o.logprobs, o.token_ids, k, as_ids=as_ids)
                choices.append({"index": o.index, "delta": {"content": o.text} if o.text else {}, "logprobs": lp,
                                "finish_reason": o.finish_reason, "stop_reason": o.stop_reason})
            if sse:
                for choice in choices:
                    await sse.send(choice_chunk(choice))
    usage = Usage(len(prompt), completion_tokens, cached_tokens())
    if sse:
        if include_usage:
            await sse.send({**chunk([]), "usage": usage.to_dict()})
        return await sse.done()
    check_no_failed_choice(finish)
    choices = [{"index": j, "message": {"role": role, "content": echo + texts[j]},
                "logprobs": (chat_logprobs(logprobs[j], tokens[j], k, as_ids=as_ids)
                             if params.logprobs is not None else None),
                "finish_reason": finish[j], "stop_reason": stop_reasons[j]} for j in range(n)]
    return web.json_response({**chunk(choices, "chat.completion"), "usage": usage.to_dict()})
