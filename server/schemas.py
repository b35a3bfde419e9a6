"""The server's request and response bodies as JSON Schema (2020-12, as OpenAPI 3.1 embeds it): what
`server/openapi.py` publishes at /openapi.json and what clients and fuzzers generate requests from.

The handlers validate by hand (`protocol.get_field` and `SamplingParams`), with error messages that name the
field; tests/server/test_openapi.py keeps the two in step: every field a handler reads is here with the same
JSON types, every documented response validates against its schema, and a request generated from a schema is
never answered with a 5xx. Ranges are the ones `SamplingParams` enforces; cross-field rules (min_tokens <=
max_tokens, top_logprobs needs logprobs, one output constraint) are in the descriptions, not the schema."""

from __future__ import annotations

from jaxpaged.sampling_params import FLOAT32_MAX, MAX_LOGPROBS, SEED_RANGE

INT, NUM, STR, BOOL = {"type": "integer"}, {"type": "number"}, {"type": "string"}, {"type": "boolean"}
TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
JSON_OBJECT = {"type": "object"}


def nullable(schema: dict) -> dict:
    """An optional field may also be sent as null (OpenAI's clients do): it then means the default."""
    return {"anyOf": [schema, {"type": "null"}]}


def _described(schema: dict, text: str) -> dict:
    return {**schema, "description": text}


# ---- requests -------------------------------------------------------------------------------------------

SAMPLING_FIELDS = {
    "model": _described(STR, "the served model's name (--served-model-name); another name is a 404"),
    "n": _described({"type": "integer", "minimum": 1}, "samples per prompt; at most the server's max_num_seqs"),
    "best_of": _described({"type": "integer", "minimum": 1}, "only equal to n (beam search is offline only)"),
    "temperature": _described({"type": "number", "minimum": 0, "maximum": FLOAT32_MAX}, "0: greedy"),
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": _described({"type": "integer", "minimum": 0}, "0: all tokens (vLLM also reads -1 as off)"),
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "seed": {"type": "integer", "minimum": SEED_RANGE[0], "maximum": SEED_RANGE[1] - 1},
    "max_tokens": _described({"type": "integer", "minimum": 1}, "prompt + max_tokens <= max_model_len"),
    "max_completion_tokens": _described({"type": "integer", "minimum": 1}, "OpenAI's newer name of max_tokens"),
    "min_tokens": _described({"type": "integer", "minimum": 0}, "EOS and stop tokens masked until then; "
                             "<= max_tokens"),
    "ignore_eos": BOOL,
    "stop": {"anyOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "items": {"type": "string", "minLength": 1}}]},
    "stop_token_ids": TOKEN_IDS,
    "include_stop_str_in_output": BOOL,
    "skip_special_tokens": BOOL,
    "spaces_between_special_tokens": BOOL,
    "prompt_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": FLOAT32_MAX},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "logit_bias": _described({"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                              "additionalProperties": {"type": "number"}}, "token id -> bias added to its logit"),
    "allowed_token_ids": {**TOKEN_IDS, "minItems": 1},
    "bad_words": {"type": "array", "items": {"type": "string", "minLength": 1}},
    "truncate_prompt_tokens": _described({"anyOf": [{"type": "integer", "minimum": 1}, {"const": -1}]},
                                         "keep the prompt's last k tokens (-1: as many as fit)"),
    "response_format": _described({"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]},
        "json_schema": {"type": "object", "properties": {"name": STR, "schema": JSON_OBJECT, "strict": BOOL}}}},
        "OpenAI's output constraint; json_schema needs json_schema.schema"),
    "structured_outputs": _described({"type": "object", "properties": {
        "json": {"anyOf": [JSON_OBJECT, STR]}, "regex": STR, "choice": {"type": "array", "items": STR},
        "grammar": STR, "json_object": BOOL, "whitespace_pattern": STR, "reasoning_start": STR,
        "reasoning_end": STR}, "additionalProperties": False},
        "vLLM's output constraint: exactly one of json, regex, choice, grammar, json_object (reasoning_end: free "
        "text up to it first, as a reasoning model thinks)"),
    "guided_json": {"anyOf": [JSON_OBJECT, STR]},
    "guided_regex": STR,
    "guided_choice": {"type": "array", "items": STR},
    "guided_grammar": STR,
    "guided_whitespace_pattern": STR,
    "stream": BOOL,
    "stream_options": {"type": "object", "properties": {"include_usage": BOOL, "continuous_usage_stats": BOOL}},
    "priority": _described(INT, "lower runs first under --scheduling-policy priority"),
    "cache_salt": _described({"type": "string", "minLength": 1}, "a prefix cache shared only with the same salt"),
    "return_tokens_as_token_ids": _described(BOOL, "logprobs name tokens as token_id:N"),
    "echo": BOOL,
    "user": STR,
    "kv_transfer_params": _described({"type": "object", "required": ["source"], "properties": {"source": STR}},
                                     "disaggregated serving: the prefill instance to pull KV blocks from (one "
                                     "of the server's --kv-pull-from)"),
}

COMPLETION_REQUEST = {
    "type": "object", "required": ["prompt"],
    "properties": {
        "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                             {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                             {**TOKEN_IDS, "minItems": 1},
                             {"type": "array", "minItems": 1, "items": {**TOKEN_IDS, "minItems": 1}}]},
        **SAMPLING_FIELDS,
        "max_tokens": _described({"type": "integer", "minimum": 0}, "0 with echo: score the prompt only"),
        "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
        "add_special_tokens": _described(BOOL, "the tokenizer's special tokens (BOS) on a text prompt; "
                                         "default true"),
    },
}

_CONTENT = {"anyOf": [STR, {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                                          "properties": {"type": {"const": "text"},
                                                                         "text": STR}}}]}
TOOL_CALL = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": STR, "type": {"const": "function"}, "function": {"type": "object", "required": ["name", "arguments"],
                                                        "properties": {"name": STR, "arguments": STR}}}}
MESSAGE = _described({"type": "object", "required": ["role"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]}, "content": nullable(_CONTENT),
    "name": STR, "tool_calls": {"type": "array", "items": TOOL_CALL}, "tool_call_id": STR}},
    "content is required but for an assistant message with tool_calls; a tool message needs tool_call_id")
TOOL_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_.\\-]{1,64}$"}
TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"}, "function": {"type": "object", "required": ["name"], "properties": {
        "name": TOOL_NAME, "description": STR, "parameters": _described(JSON_OBJECT, "a JSON schema"),
        "strict": BOOL}}}}
CHAT_TEMPLATE_FIELDS = {
    "messages": {"type": "array", "minItems": 1, "items": MESSAGE},
    "add_generation_prompt": _described(BOOL, "default true; false continues the last message's role"),
    "continue_final_message": BOOL,
    "chat_template_kwargs": _described(JSON_OBJECT, "extra template variables (e.g. enable_thinking)"),
    "documents": {"type": "array", "items": JSON_OBJECT},
    "tools": _described({"type": "array", "items": TOOL}, "functions the model may call (the template sees them)"),
    "chat_template": _described(STR, "not accepted: the server's template is used (a template runs code)"),
    "add_special_tokens": _described(BOOL, "the tokenizer's special tokens on top of the template's; "
                                     "default false"),
}
CHAT_REQUEST = {
    "type": "object", "required": ["messages"],
    "properties": {
        **SAMPLING_FIELDS, **CHAT_TEMPLATE_FIELDS,
        "logprobs": BOOL,
        "top_logprobs": _described({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
                                   "needs logprobs: true"),
        "tool_choice": _described({"anyOf": [{"enum": ["none", "auto", "required"]}, {
            "type": "object", "required": ["type", "function"], "properties": {
                "type": {"const": "function"}, "function": {"type": "object", "required": ["name"],
                                                            "properties": {"name": STR}}}}]},
            "default auto with tools (needs --enable-auto-tool-choice); required and a named function are "
            "constrained to valid calls"),
        "parallel_tool_calls": _described(BOOL, "false: at most one call a reply"),
    },
}

TOKENIZE_REQUEST = {"type": "object", "properties": {
    "model": STR, "prompt": STR, "return_token_strs": BOOL, **CHAT_TEMPLATE_FIELDS,
    "add_special_tokens": BOOL}, "anyOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}
DETOKENIZE_REQUEST = {"type": "object", "required": ["tokens"], "properties": {"model": STR, "tokens": TOKEN_IDS}}


def optional_fields_nullable(schema: dict) -> dict:
    """The request schema as published: every optional property also accepts null."""
    required = set(schema.get("required", ()))
    props = {k: v if k in required else nullable(v) for k, v in schema["properties"].items()}
    return {**schema, "properties": props}


LOAD_LORA_REQUEST = {"type": "object", "required": ["lora_name", "lora_path"],
                     "properties": {"lora_name": STR, "lora_path": STR}}
UNLOAD_LORA_REQUEST = {"type": "object", "required": ["lora_name"], "properties": {"lora_name": STR}}

REQUESTS = {name: optional_fields_nullable(s) for name, s in [
    ("CompletionRequest", COMPLETION_REQUEST), ("ChatCompletionRequest", CHAT_REQUEST),
    ("TokenizeRequest", TOKENIZE_REQUEST), ("DetokenizeRequest", DETOKENIZE_REQUEST),
    ("LoadLoRAAdapterRequest", LOAD_LORA_REQUEST), ("UnloadLoRAAdapterRequest", UNLOAD_LORA_REQUEST)]}

# ---- responses ------------------------------------------------------------------------------------------

ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "code"],
    "properties": {"message": STR, "type": STR, "param": nullable(STR), "code": {"type": ["string", "integer"]}}}}}
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    "prompt_tokens": INT, "completion_tokens": INT, "total_tokens": INT,
    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": INT}}}}
FINISH = nullable({"enum": ["stop", "length", "abort", "error", "tool_calls"]})
_HEAD = {"id": STR, "created": INT, "model": STR}

COMPLETION_LOGPROBS = nullable({"type": "object", "properties": {
    "tokens": {"type": "array", "items": STR},
    "token_logprobs": {"type": "array", "items": nullable(NUM)},
    "top_logprobs": {"type": "array", "items": nullable({"type": "object", "additionalProperties": NUM})},
    "text_offset": {"type": "array", "items": INT}}})
PROMPT_LOGPROBS = nullable({"type": "array", "items": nullable({"type": "object", "additionalProperties": {
    "type": "object", "properties": {"logprob": NUM, "rank": nullable(INT), "decoded_token": nullable(STR)}}})})
COMPLETION_CHOICE = {"type": "object", "required": ["index", "text", "finish_reason"], "properties": {
    "index": INT, "text": STR, "logprobs": COMPLETION_LOGPROBS, "finish_reason": FINISH,
    "stop_reason": nullable({"type": ["string", "integer"]}), "prompt_logprobs": PROMPT_LOGPROBS}}
COMPLETION = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
    **_HEAD, "object": {"const": "text_completion"}, "choices": {"type": "array", "items": COMPLETION_CHOICE},
    "usage": nullable(USAGE)}}

_TOP = {"type": "object", "required": ["token", "logprob"], "properties": {
    "token": STR, "logprob": NUM, "bytes": nullable({"type": "array", "items": INT})}}
CHAT_LOGPROBS = nullable({"type": "object", "properties": {"content": nullable({"type": "array", "items": {
    **_TOP, "properties": {**_TOP["properties"], "top_logprobs": {"type": "array", "items": _TOP}}}})}})
CHAT_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": STR, "content": nullable(STR), "reasoning_content": nullable(STR),
    "tool_calls": {"type": "array", "items": TOOL_CALL}}}
TOOL_CALL_DELTA = {"type": "object", "required": ["index"], "properties": {
    "index": INT, "id": STR, "type": {"const": "function"},
    "function": {"type": "object", "properties": {"name": STR, "arguments": STR}}}}
CHAT_CHOICE = {"type": "object", "required": ["index", "message", "finish_reason"], "properties": {
    "index": INT, "message": CHAT_MESSAGE, "logprobs": CHAT_LOGPROBS, "finish_reason": FINISH,
    "stop_reason": nullable({"type": ["string", "integer"]})}}
CHAT_COMPLETION = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
    **_HEAD, "object": {"const": "chat.completion"}, "choices": {"type": "array", "items": CHAT_CHOICE},
    "usage": nullable(USAGE), "prompt_logprobs": PROMPT_LOGPROBS}}
CHAT_CHUNK = {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
    **_HEAD, "object": {"const": "chat.completion.chunk"}, "usage": nullable(USAGE),
    "choices": {"type": "array", "items": {"type": "object", "required": ["index", "delta"], "properties": {
        "index": INT, "delta": {"type": "object", "properties": {
            "role": STR, "content": nullable(STR), "reasoning_content": nullable(STR),
            "tool_calls": {"type": "array", "items": TOOL_CALL_DELTA}}},
        "logprobs": CHAT_LOGPROBS, "finish_reason": FINISH}}}}}
MODEL_LIST = {"type": "object", "required": ["object", "data"], "properties": {
    "object": {"const": "list"}, "data": {"type": "array", "items": {
        "type": "object", "required": ["id", "object"],
        "properties": {"id": STR, "object": {"const": "model"}, "created": INT, "owned_by": STR,
                       "max_model_len": INT, "root": STR, "parent": STR}}}}}
TOKENIZE = {"type": "object", "required": ["count", "tokens"], "properties": {
    "count": INT, "max_model_len": INT, "tokens": TOKEN_IDS, "token_strs": {"type": "array", "items": STR}}}
DETOKENIZE = {"type": "object", "required": ["prompt"], "properties": {"prompt": STR}}
VERSION = {"type": "object", "required": ["version"], "properties": {"version": STR}}

RESPONSES = {"ErrorResponse": ERROR, "Completion": COMPLETION, "ChatCompletion": CHAT_COMPLETION,
             "ChatCompletionChunk": CHAT_CHUNK, "ModelList": MODEL_LIST, "TokenizeResponse": TOKENIZE,
             "DetokenizeResponse": DETOKENIZE, "VersionResponse": VERSION}
