"""Speculative verification inside the step: each sequence's drafts checked against the target's logits
(`rejection.verify_drafts`), and the logprob information of the tokens it emits."""

from __future__ import annotations

import jax.numpy as jnp

from jaxpaged.layers.sampler import SamplerOutput, token_logprobs
from jaxpaged.layers.step_features import ON_DEVICE, StepFeatures, branch
from jaxpaged.spec_decode.rejection import verify_drafts


def drafts_per_seq(inp, s: int):
    """[S] the draft tokens each sequence row verifies this step."""
    rows = jnp.where(inp.draft_tokens >= 0, inp.draft_seq, s)  # padding entries scatter out of range
    return jnp.zeros(s, jnp.int32).at[rows].add(1, mode="drop")


def verified(model, hidden, inp, k: int, out: SamplerOutput, features: StepFeatures = ON_DEVICE):
    """The tokens each sequence emits after verifying its drafts (`verify_drafts`), and the logprob information
    of each: (emitted [S, K+1], count [S], logprob [S, K+1], rank [S, K+1], top ids and logprobs [S, K+1, M]).
    Only the D draft entries go through the LM head (D = min(T, S * K))."""
    s = out.token_ids.shape[0]
    draft_logits = model.compute_logits(hidden[inp.draft_indices])  # [D, V]
    emitted, count = verify_drafts(draft_logits, inp.draft_tokens, inp.draft_seq, inp.draft_pos, out.token_ids,
                                   inp.sampling, k, features)
    rows = jnp.where(inp.draft_tokens >= 0, inp.draft_seq, s)  # padding entries scatter out of range
    num_drafts = drafts_per_seq(inp, s)

    def logprobs(_):  # of each emitted token: under its draft position's logits, or the bonus row's
        tokens = jnp.maximum(emitted[jnp.minimum(inp.draft_seq, s - 1), inp.draft_pos], 0)  # [D]
        grid = lambda x: jnp.zeros((s, k + 1, *x.shape[1:]), x.dtype).at[rows, inp.draft_pos].set(  # noqa: E731
            x, mode="drop")
        at_bonus = jnp.arange(k + 1) == num_drafts[:, None]  # [S, K+1]
        pick = lambda d, b: jnp.where(at_bonus.reshape(s, k + 1, *([1] * (d.ndim - 2))),  # noqa: E731
                                      jnp.broadcast_to(b[:, None], d.shape), d)
        return tuple(pick(grid(d), b) for d, b in zip(token_logprobs(draft_logits, tokens),
                                                      (out.logprob, out.rank, out.top_ids, out.top_logprobs)))

    lps = branch(features.logprobs, lambda: jnp.any(inp.sampling.num_logprobs >= 0), logprobs,
                 lambda _: spread_logprobs(out, k), None)
    return (emitted, count, *lps)


def spread_logprobs(out: SamplerOutput, k: int):
    """The step's logprob information as that of the first of K+1 emitted tokens per sequence."""
    def widen(x):
        return jnp.concatenate([x[:, None], jnp.zeros((x.shape[0], k, *x.shape[1:]), x.dtype)], axis=1)
    return widen(out.logprob), widen(out.rank), widen(out.top_ids), widen(out.top_logprobs)


def no_drafts(k: int, out: SamplerOutput):
    """`verified`'s results for a step without drafts: each sequence emits its drawn token."""
    s = out.token_ids.shape[0]
    emitted = jnp.concatenate([out.token_ids[:, None], jnp.full((s, k), -1, jnp.int32)], axis=1)
    return (emitted, jnp.ones(s, jnp.int32), *spread_logprobs(out, k))
