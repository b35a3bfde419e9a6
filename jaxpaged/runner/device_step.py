"""The one jitted step the runner compiles per token bucket: forward, KV write, logits, sampling, speculative
verification and draft proposals, prompt logprobs."""

from __future__ import annotations

from functools import partial

import jax.numpy as jnp
from flax import nnx

from jaxpaged.layers.logits_processors import RowState, update_row_state
from jaxpaged.layers.sample_rows import sample_rows
from jaxpaged.layers.sampler import token_logprobs
from jaxpaged.layers.step_features import StepFeatures, branch
from jaxpaged.runner.step_input import StepPacker
from jaxpaged.sampling_params import MAX_LOGPROBS
from jaxpaged.spec_decode.draft_model import propose_drafts
from jaxpaged.spec_decode.verify import drafts_per_seq, no_drafts, verified

DONATED = (1, 2, 3, 8)  # the step's arguments updated in place: KV pool, processor rows, last tokens, draft pool


def device_step(graphdef, draft_graphdef, logprobs_mode, sampler_backend, spec_width: int, packer: StepPacker,
                features: StepFeatures, state, kv_pool, row_state: RowState, last_token, ints, floats, bitmask,
                draft_state, draft_pool):
    """The jitted step: forward all scheduled tokens, write K/V, process logits, sample one token per sequence
    (with speculative decoding, verify each sequence's drafts: it emits 1 to K + 1 tokens; with a draft model,
    then propose each sequence's next K drafts, `propose_drafts`).

    bitmask [S, ceil(V / 32)] int32: the tokens each sequence row may draw (structured output; all ones = free).
    draft_state, draft_pool: the draft model's params and KV pool (None without a draft model).
    features: which optional parts run, decided on the host (`StepFeatures`; `ON_DEVICE`: by `lax.cond`).
    """
    inp = packer.unpack(ints, floats)
    rows = inp.sampling.processors.token_slot
    token_ids = jnp.where(inp.from_device, last_token[jnp.minimum(rows, last_token.shape[0] - 1)], inp.token_ids)
    model = nnx.merge(graphdef, state)
    row_state = update_row_state(row_state, inp.sampling.processors, token_ids)
    hidden, kv_pool = model(token_ids, kv_pool, inp.attn, inp.lora_slots if getattr(model, "lora_slots", 0) else None)
    out = sample_rows(model, hidden, inp, row_state, bitmask, logprobs_mode=logprobs_mode, backend=sampler_backend,
                      features=features)
    spec = None
    if inp.draft_tokens.shape[0]:  # speculative decoding configured: verify the drafts, if any
        k = spec_width
        spec = branch(features.drafts, lambda: jnp.any(inp.draft_tokens >= 0),
                      partial(verified, model, hidden, inp, k, features=features), partial(no_drafts, k), out)
    final = out.token_ids if spec is None else jnp.take_along_axis(spec[0], spec[1][:, None] - 1, axis=1)[:, 0]
    last_token = last_token.at[inp.draw_rows].set(final, mode="drop")
    drafts = None
    if draft_graphdef is not None:
        draft_pool, drafts = propose_drafts(draft_graphdef, draft_state, draft_pool, token_ids, inp, final,
                                            drafts_per_seq(inp, final.shape[0]),
                                            spec[1], inp.draw_rows < last_token.shape[0], spec_width,
                                            row_state.bias.shape[-1], features.propose)
    return (kv_pool, row_state, last_token, (out, spec, drafts),
            prompt_logprobs(model, hidden, inp.next_prompt_ids, features.prompt_logprobs), draft_pool)


def prompt_logprobs(model, hidden, next_ids, flag: bool | None = None):
    """Logprob information of each fed prompt token's successor [T]; all logits only if some row asks."""
    t = hidden.shape[0]
    none = (jnp.zeros(t, jnp.float32), jnp.zeros(t, jnp.int32), jnp.zeros((t, MAX_LOGPROBS), jnp.int32),
            jnp.zeros((t, MAX_LOGPROBS), jnp.float32))
    compute = lambda h, ids: token_logprobs(model.compute_logits(h), jnp.maximum(ids, 0))  # noqa: E731
    return branch(flag, lambda: jnp.any(next_ids >= 0), compute, lambda *_: none, hidden, next_ids)
