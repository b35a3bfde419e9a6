"""`StepInput`: the arrays of one jitted step, built on the host with numpy and padded to a bucket."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jaxtyping import Array, Int

from jaxpaged.core.scheduler import SchedulerOutput
from jaxpaged.models.llama import AttentionMetadata
from jaxpaged.logits_processors import ProcessorInputs
from jaxpaged.sampler import SamplingMetadata


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepInput:
    """Everything the step reads besides params and the pool. T = token bucket, S = sequence rows."""

    token_ids: Int[Array, "T"]
    attn: AttentionMetadata
    logits_indices: Int[Array, "S"]  # flat index of each sequence's last scheduled token
    next_prompt_ids: Int[Array, "T"]  # for prompt_logprobs: the prompt token after each fed token, else -1
    sampling: SamplingMetadata


@dataclass(frozen=True)
class StepGeometry:
    """Static sizes the host needs to lay out a step."""

    block_size: int
    num_blocks: int
    table_width: int  # blocks per row of block_tables (max_model_len rounded up to the attention chunk)

    @property
    def pad_slot(self) -> int:
        """A slot past the end of the pool: writes to it are dropped."""
        return self.num_blocks * self.block_size


def row_order(out: SchedulerOutput) -> list[int]:
    """Decode rows first, longest context first; then chunk continuations; fresh prefills last.

    The XLA attention reads decode context per row in groups that stop at their own longest context,
    so sorting by context keeps each group's work close to what its rows need.
    """
    def key(i: int) -> tuple[int, int]:
        s = out.scheduled[i]
        ctx = s.request.num_computed_tokens
        kind = 2 if ctx == 0 else (0 if s.num_new_tokens == 1 else 1)
        return kind, -ctx

    return sorted(range(len(out.scheduled)), key=key)


def build_step_input(out: SchedulerOutput, num_tokens: int, num_seqs: int, geo: StepGeometry,
                     order: list[int], slots: dict[str, int], reset_slots: np.ndarray) -> StepInput:
    """Numpy arrays for `out` with rows in `order`, padded to `num_tokens` tokens and `num_seqs` rows.

    `slots` maps request ids to their processor-state rows; `reset_slots` [R] marks rows handed out now.
    """
    num_slots = len(reset_slots)
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.full(num_tokens, geo.pad_slot, np.int32)
    token_seq = np.full(num_tokens, -1, np.int32)
    decode_context_lens = np.zeros(num_tokens, np.int32)
    seq_context_lens = np.zeros(num_seqs, np.int32)
    continuation_rows = np.full(num_seqs, -1, np.int32)
    num_continuations = 0
    block_tables = np.zeros((num_seqs, geo.table_width), np.int32)
    logits_indices = np.zeros(num_seqs, np.int32)
    temperature = np.zeros(num_seqs, np.float32)
    top_k = np.zeros(num_seqs, np.int32)
    top_p = np.ones(num_seqs, np.float32)
    seeds = np.zeros(num_seqs, np.uint32)
    steps = np.zeros(num_seqs, np.int32)
    num_logprobs = np.full(num_seqs, -1, np.int32)
    next_prompt_ids = np.full(num_tokens, -1, np.int32)
    token_slot = np.full(num_tokens, num_slots, np.int32)
    token_is_output = np.zeros(num_tokens, bool)
    row_slot = np.zeros(num_seqs, np.int32)
    rep, pres, freq = np.ones(num_seqs, np.float32), np.zeros(num_seqs, np.float32), np.zeros(num_seqs, np.float32)
    min_p = np.zeros(num_seqs, np.float32)
    use_bias, suppress = np.zeros(num_seqs, bool), np.zeros(num_seqs, bool)

    t = 0
    for i, j in enumerate(order):
        s = out.scheduled[j]
        req, n = s.request, s.num_new_tokens
        start = req.num_computed_tokens
        table = np.asarray(s.block_ids, np.int32)
        block_tables[i, : len(table)] = table
        pos = np.arange(start, start + n, dtype=np.int32)
        token_ids[t : t + n] = req.token_ids_slice(start, start + n)
        positions[t : t + n] = pos
        slot_mapping[t : t + n] = table[pos // geo.block_size] * geo.block_size + pos % geo.block_size
        token_seq[t : t + n] = i
        seq_context_lens[i] = start
        if start and n == 1:
            decode_context_lens[t] = start
        elif start:
            continuation_rows[num_continuations] = i
            num_continuations += 1
        t += n
        logits_indices[i] = t - 1
        p = req.sampling_params
        temperature[i], top_k[i], top_p[i] = p.temperature, p.top_k, p.top_p
        seeds[i], steps[i] = req.seed, req.num_output_tokens
        num_logprobs[i] = -1 if p.logprobs is None else p.logprobs
        if p.prompt_logprobs is not None and start + 1 < len(req.prompt_token_ids):
            stop = min(start + n, len(req.prompt_token_ids) - 1)  # positions whose next token is a prompt token
            next_prompt_ids[t - n : t - n + stop - start] = req.prompt_token_ids[start + 1 : stop + 1]
        slot = slots[req.request_id]
        token_slot[t - n : t] = slot
        token_is_output[t - n : t] = pos >= len(req.prompt_token_ids)
        row_slot[i] = slot
        rep[i], pres[i], freq[i], min_p[i] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.min_p
        use_bias[i] = p.needs_bias_row
        suppress[i] = req.num_output_tokens < p.min_tokens

    return StepInput(
        token_ids=token_ids,
        attn=AttentionMetadata(positions=positions, slot_mapping=slot_mapping, token_seq=token_seq,
                               decode_context_lens=decode_context_lens, seq_context_lens=seq_context_lens,
                               continuation_rows=continuation_rows, block_tables=block_tables),
        logits_indices=logits_indices,
        next_prompt_ids=next_prompt_ids,
        sampling=SamplingMetadata(
            temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds, steps=steps, num_logprobs=num_logprobs,
            processors=ProcessorInputs(
                token_slot=token_slot, token_is_output=token_is_output, reset_slots=reset_slots, row_slot=row_slot,
                repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq, min_p=min_p,
                use_bias=use_bias, suppress_stop=suppress)),
    )
