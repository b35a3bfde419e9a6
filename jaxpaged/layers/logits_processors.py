"""Logits processors applied to the whole batch inside the jitted step.

Per-request state lives on the device in rows ("slots", one per running request), donated into the
step like the KV pool:
  output_counts[slot, v]  how often token v was generated (fed back as an input token);
  prompt_seen[slot, v]    whether v is in the prompt;
  bias[slot, v]           logit_bias, allowed_token_ids and bad_words folded into one additive row;
  min_tokens_mask[slot, v] EOS and stop ids, suppressed while fewer than min_tokens were generated.
Counts are rebuilt from the tokens the step is fed, so a request resumed after recompute preemption
gets them back for free. Batches without a feature skip its work: decided on the host (`StepFeatures`) or
under `lax.cond`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxpaged.layers.step_features import ON_DEVICE, StepFeatures, branch

NEG_INF = -jnp.inf


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RowState:
    """Device-resident per-slot processor state. R = slots (max_num_seqs), V = vocabulary."""

    output_counts: Int[Array, "R V"]
    prompt_seen: Bool[Array, "R V"]
    bias: Float[Array, "R V"]
    min_tokens_mask: Bool[Array, "R V"]

    @classmethod
    def zeros(cls, rows: int, vocab: int) -> RowState:
        return cls(jnp.zeros((rows, vocab), jnp.int32), jnp.zeros((rows, vocab), bool),
                   jnp.zeros((rows, vocab), jnp.float32), jnp.zeros((rows, vocab), bool))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ProcessorInputs:
    """Per-step inputs of the processors. T = tokens, S = sequence rows, R = slots."""

    token_slot: Int[Array, "T"]  # slot of each fed token's request; R for padding (dropped)
    token_is_output: Bool[Array, "T"]  # the fed token is a generated one (position >= prompt length)
    reset_slots: Bool[Array, "R"]  # slots handed to a new (or resumed) request this step
    row_slot: Int[Array, "S"]  # slot of each sequence row
    repetition_penalty: Float[Array, "S"]
    presence_penalty: Float[Array, "S"]
    frequency_penalty: Float[Array, "S"]
    min_p: Float[Array, "S"]
    use_bias: Bool[Array, "S"]
    suppress_stop: Bool[Array, "S"]  # fewer than min_tokens generated: EOS and stop ids masked

    def head(self, k: int) -> ProcessorInputs:
        """The first k sequence rows' inputs (the per-token and per-slot ones unchanged)."""
        return dataclasses.replace(self, **{f: getattr(self, f)[:k] for f in _ROW_FIELDS})


_ROW_FIELDS = ("row_slot", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p", "use_bias",
               "suppress_stop")


def update_row_state(state: RowState, p: ProcessorInputs, token_ids: Int[Array, "T"]) -> RowState:
    """Clear reset slots, then count this step's fed tokens into their slots."""
    keep = ~p.reset_slots[:, None]
    counts = jnp.where(keep, state.output_counts, 0)
    seen = state.prompt_seen & keep
    counts = counts.at[p.token_slot, token_ids].add(p.token_is_output.astype(jnp.int32), mode="drop")
    seen = seen.at[p.token_slot, token_ids].max(~p.token_is_output, mode="drop")
    return RowState(counts, seen, state.bias, state.min_tokens_mask)


def apply_penalties(logits, counts, seen, rep, pres, freq):
    """vLLM's penalties: repetition over prompt or output tokens, presence and frequency over the output."""
    seen = seen | (counts > 0)
    r = rep[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    return logits - freq[:, None] * counts - pres[:, None] * (counts > 0)


def process_logits(logits: Float[Array, "S V"], state: RowState, p: ProcessorInputs,
                   features: StepFeatures = ON_DEVICE) -> Float[Array, "S V"]:
    """Bias rows and min_tokens masks, then penalties (before temperature; min_p comes with sampling)."""
    rows = p.row_slot

    def with_bias(x):
        return jnp.where(p.use_bias[:, None], x + state.bias[rows], x)

    def with_min_tokens(x):
        return jnp.where(p.suppress_stop[:, None] & state.min_tokens_mask[rows], NEG_INF, x)

    def with_penalties(x):
        return apply_penalties(x, state.output_counts[rows], state.prompt_seen[rows], p.repetition_penalty,
                               p.presence_penalty, p.frequency_penalty)

    def penalized():
        return jnp.any((p.repetition_penalty != 1) | (p.presence_penalty != 0) | (p.frequency_penalty != 0))

    keep = lambda x: x  # noqa: E731
    logits = branch(features.bias, lambda: jnp.any(p.use_bias), with_bias, keep, logits)
    logits = branch(features.min_tokens, lambda: jnp.any(p.suppress_stop), with_min_tokens, keep, logits)
    return branch(features.penalties, penalized, with_penalties, keep, logits)


def apply_min_p(scaled: Float[Array, "S V"], min_p: Float[Array, "S"]) -> Float[Array, "S V"]:
    """Drop tokens whose probability is below min_p times the most likely token's (on tempered logits)."""
    top = scaled.max(axis=-1, keepdims=True)
    # p_i / p_max = exp(x_i - x_max) < min_p
    return jnp.where(jnp.exp(scaled - top) < min_p[:, None], NEG_INF, scaled)


def write_rows(state: RowState, slot: Int[Array, ""], bias: Float[Array, "V"], min_mask: Bool[Array, "V"]
               ) -> RowState:
    """Install one request's bias and min_tokens rows at admission (a small, separately compiled call)."""
    return RowState(state.output_counts, state.prompt_seen, state.bias.at[slot].set(bias),
                    state.min_tokens_mask.at[slot].set(min_mask))
