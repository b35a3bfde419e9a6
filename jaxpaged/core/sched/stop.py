"""The stop rules a drawn token is checked against (vLLM's `check_stop`)."""

from __future__ import annotations

from jaxpaged.request import Request, RequestStatus


def check_stop(req: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """The status a request ends with after appending `token` (EOS, a stop token, max_tokens, the model's
    length; a stop token is kept as its `stop_reason`), or None: it goes on. Stop strings are the
    detokenizer's (`engine/output_processor.py`)."""
    p = req.sampling_params
    if req.num_output_tokens >= p.min_tokens:
        if not p.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in p.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if p.max_tokens is not None and req.num_output_tokens >= p.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
