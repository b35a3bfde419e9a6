"""The step's LM head and sampler, run on only the first rows when no later row draws a token.

A step has S = min(T, max_num_seqs) sequence rows, but a prefill-heavy step draws few tokens: a served prompt
prefilled beside 4 decodes fills a 384-token step whose 64 rows (the CPU default) would all go through the LM
head and the sampler (SmolLM2: 64 x 49,152 logits, 3.6 GFLOP; measured 14 ms of an 83 ms 64-token float32
step on 2 cores).
Rows are in scheduler order, so when every row past the first S/4 draws nothing (padding, or a prompt chunk
that does not reach its end), those are the only rows computed, in one branch of a `lax.cond`: the compiled
step count stays the same, the sampler is compiled twice (for steps of 64 rows or more). Within a branch, a
packed LM head (CPU) multiplies only the rows up to the last that draws (`StepInput.head_rows`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpaged.layers.logits_processors import RowState
from jaxpaged.layers.sampler import SamplerOutput, sample
from jaxpaged.layers.step_features import ON_DEVICE, StepFeatures, branch
from jaxpaged.layers.token_bitmask import apply_token_bitmask

# fewer rows: one branch. The second branch compiles the sampler again (+28% compile time for a small test
# engine when its 32- and 48-row steps split too); from 64 rows on, the steps that carry served prompts split.
MIN_ROWS_TO_SPLIT = 64


def head_rows(s: int) -> int:
    """Rows of the narrow branch for a step of s sequence rows: a quarter of them, a multiple of 8 (s: none)."""
    return s if s < MIN_ROWS_TO_SPLIT else max(8, s // 4 // 8 * 8)


def sample_rows(model, hidden, inp, row_state: RowState, bitmask, *, logprobs_mode: str,
                backend: str, features: StepFeatures = ON_DEVICE) -> SamplerOutput:
    """`sample` on the logits of each sequence row's last token [S]; rows that draw nothing get zeros when the
    narrow branch runs (the host reads only the rows that draw)."""
    s = inp.logits_indices.shape[0]
    k = head_rows(s)

    def draw(rows: int):
        def run(_):
            meta = inp.sampling if rows == s else inp.sampling.head(rows)
            logits = model.compute_logits(hidden[inp.logits_indices[:rows]], inp.head_rows)  # [rows, V]
            out = sample(apply_token_bitmask(logits, bitmask[:rows], features.bitmask), row_state, meta,
                         logprobs_mode=logprobs_mode, backend=backend, features=features)
            if rows == s:
                return out
            return jax.tree.map(lambda x: jnp.zeros((s, *x.shape[1:]), x.dtype).at[:rows].set(x), out)
        return run

    if k == s:
        return draw(s)(None)
    num_slots = row_state.bias.shape[0]  # draw_rows holds this where a row draws nothing
    return branch(features.narrow, lambda: jnp.all(inp.draw_rows[k:] >= num_slots), draw(k), draw(s), None)
