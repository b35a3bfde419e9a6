"""POST /v1/chat/completions."""

from __future__ import annotations

import dataclasses
import json

from aiohttp import web

from jaxpaged.request import prefix_salt
from server.chat_output import ChoiceParser
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
from server.reasoning import END, START, ReasoningParser, reply_start
from server.state import STATE, TENANT, ServerState
from server.streaming import SSEWriter, generate_all
from server.tool_parsers import TOOL_PARSERS
from server.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from server.tool_requests import ToolRequest, template_messages, tool_request_from

ROLES = {"system", "user", "assistant", "developer", "tool"}


def parse_messages(body: dict) -> list[dict]:
    """Validated messages with string content (text parts joined); an assistant's `tool_calls` and a tool
    message's `tool_call_id` kept for the template (an assistant with tool calls may have no content)."""
    messages = get_field(body, "messages", (list,))
    if not messages:
        raise APIError("'messages' must not be empty", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in ROLES:
            raise APIError(f"each message needs a 'role' in {sorted(ROLES)}", param="messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError("only text content parts are supported", param="messages")
            content = "\n".join(p["text"] for p in content)  # (as vLLM joins text parts)
        message = {"role": m["role"]}
        if m["role"] == "assistant":  # (content may be null: a reply that was only calls)
            if m.get("tool_calls"):
                message["tool_calls"] = _tool_calls(m["tool_calls"], i)
            content = "" if content is None else content
        if m["role"] == "tool":
            if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
                raise APIError(f"messages[{i}]: a tool message needs a 'tool_call_id'", param="messages")
            message["tool_call_id"] = m["tool_call_id"]
        if not isinstance(content, str):
            raise APIError("message 'content' must be a string or a list of text parts", param="messages")
        message["content"] = content
        if isinstance(m.get("name"), str):
            message["name"] = m["name"]
        out.append(message)
    return out


def _tool_calls(calls, i: int) -> list[dict]:
    """An assistant message's tool calls, checked: each with an id and a function whose arguments are JSON text."""
    if not isinstance(calls, list):
        raise APIError(f"messages[{i}].tool_calls must be a list", param="messages")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)):
            raise APIError(f"messages[{i}].tool_calls: each call needs a function with a name and arguments "
                           "(a JSON string)", param="messages")
        try:
            json.loads(fn["arguments"])
        except (ValueError, RecursionError):  # (JSONDecodeError; digits or nesting past Python's limits)
            raise APIError(f"messages[{i}].tool_calls: the arguments of {fn['name']!r} are not JSON",
                           param="messages") from None
        out.append({"id": str(c.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


# apply_chat_template's own arguments: not settable through chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tokenize", "return_dict", "return_tensors", "padding",
                             "truncation", "max_length", "tokenizer_kwargs", "chat_template", "tools"}


def render_chat(tok, messages: list[dict], body: dict, tools: list[dict] | None = None) -> tuple[list[int], str]:
    """The prompt's token ids and the reply's role, under vLLM's chat options: `add_generation_prompt` (default
    true; when false the reply continues in the last message's role), `continue_final_message` (the last
    message is left open and the reply extends it), `chat_template_kwargs` (extra template variables, e.g.
    Qwen3's `enable_thinking`), `documents` (for templates that take them) and `add_special_tokens` (the
    tokenizer's, e.g. BOS, on top of the template's; default false). A request's own `chat_template` is a 400,
    as in vLLM unless its server is told to trust them (a template runs the client's code in the server).
    `tools` reach the template as transformers passes them (`apply_chat_template(tools=...)`)."""
    if body.get("chat_template") is not None:
        raise APIError("a chat template passed with the request is not accepted (the server's is used)",
                       param="chat_template")
    extra = get_field(body, "chat_template_kwargs", (dict,), None) or {}
    if bad := sorted(set(extra) & _RESERVED_TEMPLATE_KWARGS):
        raise APIError(f"chat_template_kwargs may not set {bad[0]!r}", param="chat_template_kwargs")
    kwargs = {"add_generation_prompt": get_field(body, "add_generation_prompt", (bool,), True),
              "continue_final_message": get_field(body, "continue_final_message", (bool,), False),
              **extra}  # (as vLLM: chat_template_kwargs may set those two as well)
    if tools:
        kwargs["tools"] = tools
    messages = template_messages(messages)
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


def choice_parsers(state: ServerState, tools: ToolRequest, prompt_text: str, n: int) -> list[ChoiceParser]:
    """A parser per choice: the server's reasoning parser, then the calls tool_choice asks for."""
    opts = state.chat

    def tool_parser():
        if tools.choice == "named":
            return NamedCallParser(tools.named)
        if tools.choice == "required":
            return RequiredCallsParser()
        return TOOL_PARSERS[opts.tool_call_parser]() if tools.choice == "auto" and tools.tools else None

    start = reply_start(opts.reasoning_parser, prompt_text) if opts.reasoning_parser else None
    return [ChoiceParser(reasoning=ReasoningParser(start) if start else None,
                         tools=tool_parser(), parallel=tools.parallel) for _ in range(n)]


def constrain(params, tools: ToolRequest, state: ServerState, prompt_text: str) -> None:
    """The grammar of "required" and named calls (not beside another output constraint), and with a reasoning
    parser, any constraint only after the thinking (the grammar lets the thinking run free until its end tag)."""
    forced = tools.constraint()
    if forced is not None:
        if params.structured_outputs is not None:
            raise APIError("tool_choice 'required' or a named function constrains the reply already: give no "
                           "other output constraint", param="tool_choice")
        params.structured_outputs = forced
    parser = state.chat.reasoning_parser
    start = reply_start(parser, prompt_text) if parser is not None else "closed"
    if params.structured_outputs is not None and start != "closed":
        params.structured_outputs = dataclasses.replace(params.structured_outputs, reasoning_end=END,
                                                        reasoning_start=None if start == "inside" else START)
    if tools.choice == "auto" and tools.tools and state.chat.tool_call_parser == "mistral":
        params.skip_special_tokens = False  # ([TOOL_CALLS] is a special token)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await state.read_json(request)
    lora = state.check_model(body)
    messages = parse_messages(body)
    tools = tool_request_from(body, auto_enabled=state.chat.auto_tools)
    params = sampling_params_from(body, default_max_tokens=None, chat=True)
    state.check_n(params.n)
    cache_salt = cache_salt_from(body)
    tok = state.engine.tokenizer
    prompt, role = render_chat(tok, messages, body, tools.tools)
    prompt_tail = tok.decode(prompt[-16:]) if state.chat.reasoning_parser else ""
    constrain(params, tools, state, prompt_tail)
    # echo (vLLM's): the reply starts with the last message's content when that message has the reply's role
    echo = messages[-1]["content"] if get_field(body, "echo", (bool,), False) and messages[-1]["role"] == role else ""
    prompt = params.truncated(prompt, state.max_model_len)
    state.check_length(len(prompt), params.max_tokens, where="messages")
    if (source := transfer_source(body, state)) is not None:  # (prefill/decode disaggregation across hosts)
        salt = prefix_salt(cache_salt, lora and state.engine.engine.resolve_lora(lora))  # (as the engine hashes)
        await pull_blocks(state, request, source, [prompt], salt)
    if params.max_tokens is None:
        params.max_tokens = state.max_model_len - len(prompt)
    rid, created = new_id("chatcmpl"), now()
    stream = get_field(body, "stream", (bool,), False)
    include_usage, continuous_usage = stream_usage(body)
    n, k = params.n, params.logprobs or 0
    as_ids = get_field(body, "return_tokens_as_token_ids", (bool,), False)
    parsers = choice_parsers(state, tools, prompt_tail, n)
    finish, stop_reasons = [None] * n, [None] * n
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

    def finish_reason(j: int, calls) -> str | None:
        """"tool_calls" when the reply made calls and ended by itself (not cut short); a named function's reply
        ends with "stop", as OpenAI and vLLM answer it."""
        return "tool_calls" if calls and finish[j] == "stop" and tools.choice != "named" else finish[j]

    async with generate_all(state.engine, [prompt], params, rid,
                            priority=get_field(body, "priority", (int,), 0), tenant=request.get(TENANT),
                            limits=state.limits, cache_salt=cache_salt, lora_request=lora) as outputs:
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
            for o in out.outputs:
                completion_tokens += len(o.token_ids)
                tokens[o.index] += o.token_ids
                finish[o.index], stop_reasons[o.index] = o.finish_reason, o.stop_reason
                delta = parsers[o.index].feed(o.text, final=o.finish_reason is not None)
                lp = None
                if o.logprobs is not None:
                    logprobs[o.index] += o.logprobs
                    lp = chat_logprobs(o.logprobs, o.token_ids, k, as_ids=as_ids)
                if sse and (delta or lp is not None or o.finish_reason is not None):
                    await sse.send(choice_chunk({"index": o.index, "delta": delta, "logprobs": lp,
                                                 "finish_reason": finish_reason(o.index, parsers[o.index].calls),
                                                 "stop_reason": o.stop_reason}))
    usage = Usage(len(prompt), completion_tokens, cached_tokens())
    if sse:
        if include_usage:
            await sse.send({**chunk([]), "usage": usage.to_dict()})
        return await sse.done()
    check_no_failed_choice(finish)
    messages_out = [parsers[j].message(role, prefix=echo) for j in range(n)]
    choices = [{"index": j, "message": messages_out[j],
                "logprobs": (chat_logprobs(logprobs[j], tokens[j], k, as_ids=as_ids)
                             if params.logprobs is not None else None),
                "finish_reason": finish_reason(j, messages_out[j].get("tool_calls")),
                "stop_reason": stop_reasons[j]} for j in range(n)]
    return web.json_response({**chunk(choices, "chat.completion"), "usage": usage.to_dict()})
