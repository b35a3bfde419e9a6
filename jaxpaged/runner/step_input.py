"""`StepInput`: the arrays of one jitted step, gathered from the `InputBatch` with numpy and padded to a bucket.

No per-token Python: token ids, positions, slots and sampling settings are fancy-indexed out of the
batch's rows. The arrays travel to the device packed into one int32 and one float32 buffer
(`StepPacker`), unpacked inside the jitted step.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from jaxpaged.layers.logits_processors import ProcessorInputs
from jaxpaged.layers.sampler import SamplingMetadata
from jaxpaged.models.llama import AttentionMetadata
from jaxpaged.runner.input_batch import InputBatch


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepInput:
    """Everything the step reads besides params and device state. T = token bucket, S = sequence rows."""

    token_ids: Int[Array, "T"]  # (a placeholder's id is taken from the device, see from_device)
    from_device: Bool[Array, "T"]  # the token is the one its row drew in the previous step (not known on host)
    lora_slots: Int[Array, "T"]  # each token's slot in the device's LoRA stack; -1: the base model (and padding)
    attn: AttentionMetadata
    logits_indices: Int[Array, "S"]  # flat index of each sequence's last scheduled token
    next_prompt_ids: Int[Array, "T"]  # for prompt_logprobs: the prompt token after each fed token, else -1
    draw_rows: Int[Array, "S"]  # the batch row whose drawn token the device keeps; R where the step draws none
    head_rows: Int[Array, ""]  # sequence rows up to the last that draws: the rows whose logits the LM head computes
    sampling: SamplingMetadata
    # speculative decoding, D = min(T, S * K) draft entries (K = num_speculative_tokens; D = 0 without): draft j of
    # sequence s, the flat index of the token before it (whose logits verify it); token -1 = padding
    draft_indices: Int[Array, "D"]
    draft_tokens: Int[Array, "D"]
    draft_seq: Int[Array, "D"]
    draft_pos: Int[Array, "D"]


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


@dataclass(frozen=True)
class StepPlan:
    """Where a step's sequences came from, to map its results back (host side)."""

    order: np.ndarray  # [n] index into SchedulerOutput.requests of each sequence row of the step
    rows: np.ndarray  # [n] batch row of each sequence
    generations: np.ndarray  # [n] the rows' generations when the step was built
    draw_positions: np.ndarray  # [n] position of the token each sequence draws (where it samples)
    samples: np.ndarray  # [n] bool
    num_prompt_tokens: int  # prompt tokens the step computes
    wants_logprobs: bool
    wants_prompt_logprobs: bool
    next_prompt_ids: np.ndarray  # [T] (host copy, to split prompt logprobs per request)
    num_drafts: np.ndarray | None = None  # [n] draft tokens each sequence verifies (None: no drafts this step)


def step_order(start: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Decode rows first, longest context first; then chunk continuations; fresh prefills last.

    The XLA attention reads decode context per row in groups that stop at their own longest context,
    so sorting by context keeps each group's work close to what its rows need.
    """
    kind = np.where(start == 0, 2, np.where(n == 1, 0, 1))
    return np.lexsort((-start, kind))


def build_step_input(batch: InputBatch, rows: np.ndarray, n: np.ndarray, start: np.ndarray, samples: np.ndarray,
                     num_tokens: int, num_seqs: int, geo: StepGeometry, reset_rows: np.ndarray,
                     num_drafts: np.ndarray | None = None, spec_width: int = 0) -> tuple[StepInput, StepPlan]:
    """Numpy inputs for sequences (batch `rows`, `n` tokens from `start`, `samples`: draws a token), in
    scheduler order, laid out in `step_order` and padded to `num_tokens` tokens and `num_seqs` rows.
    `reset_rows` [R] marks rows handed to a request this step (its processor state is cleared).
    `num_drafts` [n]: how many of each sequence's tokens are drafts to verify (written in the batch's rows
    after its known tokens); `spec_width` = K, the most drafts a sequence may have."""
    order = step_order(start, n)
    rows_o, n_o, start_o, samples_o = rows[order], n[order], start[order], samples[order]
    s_real, t_real = len(order), int(n_o.sum())
    R, bs = batch.num_rows, geo.block_size

    ends = np.cumsum(n_o)
    tok_row = np.repeat(rows_o, n_o)
    tok_idx = np.arange(t_real) - np.repeat(ends - n_o, n_o)  # index of each token within its sequence
    tok_pos = (tok_idx + np.repeat(start_o, n_o)).astype(np.int32)
    prompt_len = batch.prompt_len[tok_row]
    num_entries = min(num_tokens, num_seqs * spec_width)
    draft_indices = np.zeros(num_entries, np.int32)
    draft_tokens = np.full(num_entries, -1, np.int32)
    draft_seq = np.zeros(num_entries, np.int32)
    draft_pos = np.zeros(num_entries, np.int32)
    drafts_o = None
    if num_drafts is not None:
        drafts_o = num_drafts[order]
        m = int(drafts_o.sum())
        seq = np.repeat(np.arange(s_real, dtype=np.int32), drafts_o)
        j = np.arange(m) - np.repeat(np.cumsum(drafts_o) - drafts_o, drafts_o)  # index of each draft in its sequence
        first = ends[seq] - 1 - drafts_o[seq]  # the sequence's last known token: its logits verify draft 0
        draft_indices[:m], draft_seq[:m], draft_pos[:m] = first + j, seq, j
        draft_tokens[:m] = batch.token_ids[rows_o[seq], start_o[seq] + n_o[seq] - drafts_o[seq] + j]

    def padded(values, size, fill, dtype):
        out = np.full(size, fill, dtype)
        out[: len(values)] = values
        return out

    token_ids = padded(batch.token_ids[tok_row, tok_pos], num_tokens, 0, np.int32)
    from_device = tok_pos >= batch.num_known[tok_row]
    if drafts_o is not None:  # drafts are written on the host, never drawn on the device
        from_device &= tok_idx < np.repeat(n_o - drafts_o, n_o)
    from_device = padded(from_device, num_tokens, False, bool)
    slots = batch.block_table[tok_row, tok_pos // bs] * bs + tok_pos % bs
    decode = np.repeat((n_o == 1) & (start_o > 0), n_o)
    wants_plp = batch.prompt_logprobs[tok_row] & (tok_pos + 1 < prompt_len)
    last = batch.token_ids.shape[1] - 1
    next_prompt = np.where(wants_plp, batch.token_ids[tok_row, np.minimum(tok_pos + 1, last)], -1)
    continuation = np.flatnonzero((start_o > 0) & (n_o > 1))
    block_tables = np.zeros((num_seqs, geo.table_width), np.int32)
    block_tables[:s_real] = batch.block_table[rows_o]
    seq_rows = padded(rows_o, num_seqs, 0, np.int32)
    draw_index = start_o + n_o - batch.prompt_len[rows_o]  # index of the output token each sequence draws

    def per_seq(values, fill, dtype):
        return padded(values[rows_o], num_seqs, fill, dtype)

    inp = StepInput(
        token_ids=token_ids,
        from_device=from_device,
        lora_slots=padded(batch.lora_slot[tok_row], num_tokens, -1, np.int32),
        attn=AttentionMetadata(
            positions=padded(tok_pos, num_tokens, 0, np.int32),
            slot_mapping=padded(slots, num_tokens, geo.pad_slot, np.int32),
            token_seq=padded(np.repeat(np.arange(s_real, dtype=np.int32), n_o), num_tokens, -1, np.int32),
            decode_context_lens=padded(np.where(decode, tok_pos, 0), num_tokens, 0, np.int32),
            seq_context_lens=padded(start_o, num_seqs, 0, np.int32),
            continuation_rows=padded(continuation, num_seqs, -1, np.int32),
            block_tables=block_tables, num_real_tokens=np.asarray(t_real, np.int32)),
        logits_indices=padded(ends - 1, num_seqs, 0, np.int32),
        next_prompt_ids=padded(next_prompt, num_tokens, -1, np.int32),
        draw_rows=padded(np.where(samples_o, rows_o, R), num_seqs, R, np.int32),
        head_rows=np.asarray(np.flatnonzero(samples_o)[-1] + 1 if samples_o.any() else 0, np.int32),
        sampling=SamplingMetadata(
            temperature=per_seq(batch.temperature, 0.0, np.float32), top_k=per_seq(batch.top_k, 0, np.int32),
            top_p=per_seq(batch.top_p, 1.0, np.float32), seeds=per_seq(batch.seed, 0, np.uint32),
            steps=padded(draw_index, num_seqs, 0, np.int32),
            num_logprobs=per_seq(batch.num_logprobs, -1, np.int32),
            processors=ProcessorInputs(
                token_slot=padded(tok_row, num_tokens, R, np.int32),
                token_is_output=padded(tok_pos >= prompt_len, num_tokens, False, bool),
                reset_slots=reset_rows, row_slot=seq_rows,
                repetition_penalty=per_seq(batch.repetition_penalty, 1.0, np.float32),
                presence_penalty=per_seq(batch.presence_penalty, 0.0, np.float32),
                frequency_penalty=per_seq(batch.frequency_penalty, 0.0, np.float32),
                min_p=per_seq(batch.min_p, 0.0, np.float32), use_bias=per_seq(batch.use_bias, False, bool),
                suppress_stop=padded(draw_index < batch.min_tokens[rows_o], num_seqs, False, bool))),
        draft_indices=draft_indices, draft_tokens=draft_tokens, draft_seq=draft_seq, draft_pos=draft_pos,
    )
    plan = StepPlan(order=order, rows=rows_o, generations=batch.generation[rows_o],
                    draw_positions=start_o + n_o, samples=samples_o,
                    num_prompt_tokens=int(np.clip(np.minimum(start_o + n_o, batch.prompt_len[rows_o]) - start_o,
                                                  0, None).sum()),
                    wants_logprobs=bool((batch.num_logprobs[rows_o][samples_o] >= 0).any()),
                    wants_prompt_logprobs=bool(wants_plp.any()), next_prompt_ids=next_prompt, num_drafts=drafts_o)
    return inp, plan


class StepPacker:
    """Moves a StepInput to the device as two buffers (int32 and float32) instead of one transfer per array.

    Built from a template of the step's shapes; `pack` runs on the host, `unpack` inside the jitted step.
    """

    def __init__(self, template: StepInput):
        leaves, self.treedef = jax.tree.flatten(template)
        self.layout = []  # (kind, offset, size, shape, dtype)
        sizes = {"i": 0, "f": 0}
        for leaf in leaves:
            kind = "f" if np.dtype(leaf.dtype) == np.float32 else "i"
            self.layout.append((kind, sizes[kind], int(np.prod(leaf.shape)), tuple(leaf.shape), np.dtype(leaf.dtype)))
            sizes[kind] += int(np.prod(leaf.shape))
        self.sizes = sizes

    def pack(self, inp: StepInput) -> tuple[np.ndarray, np.ndarray]:
        ints = np.empty(self.sizes["i"], np.int32)
        floats = np.empty(self.sizes["f"], np.float32)
        for leaf, (kind, off, size, _, dtype) in zip(jax.tree.leaves(inp), self.layout):
            if kind == "f":
                floats[off : off + size] = leaf.ravel()
            elif dtype == np.uint32:
                ints[off : off + size] = np.asarray(leaf).ravel().view(np.int32)
            else:
                ints[off : off + size] = np.asarray(leaf).ravel()
        return ints, floats

    def unpack(self, ints, floats) -> StepInput:
        leaves = []
        for kind, off, size, shape, dtype in self.layout:
            x = (floats if kind == "f" else ints)[off : off + size].reshape(shape)
            if dtype == np.bool_:
                x = x != 0
            elif dtype == np.uint32:
                x = jax.lax.bitcast_convert_type(x, jnp.uint32)
            leaves.append(x)
        return jax.tree.unflatten(self.treedef, leaves)
