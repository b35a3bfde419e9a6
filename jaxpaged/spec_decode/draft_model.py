"""Draft-model speculation (vLLM's `draft_model` method): a smaller model sharing the tokenizer proposes drafts.

The draft runs inside the target's jitted step, after verification, so proposing costs no extra dispatch or
host round trip. Its KV lives in a pool of its own shape indexed by the target's block tables and slots (the
scheduler reserves `num_speculative_tokens` lookahead slots per decode for it):
  1. catch-up: the draft model runs on the step's tokens (prompt chunks, decodes and drafts, at their slots),
     so its cache holds every position the target computed (rejected drafts' entries are overwritten later,
     as the target's are);
  2. k single-token passes (a `lax.scan`): the token each sequence ended the step with, at the position after
     its last accepted token, then each greedy draft after it.
Drafts are the draft model's argmax: deterministic given the context, so the target's rejection sampling
(`rejection.verify_drafts`, with a one-hot draft distribution) keeps the target's distribution exactly.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Int

from jaxpaged.config import ModelConfig
from jaxpaged.layers.step_features import branch
from jaxpaged.models.llama import AttentionMetadata

logger = logging.getLogger(__name__)


def draft_model_config(path: str, target: ModelConfig, tokenizer, dtype: str) -> ModelConfig:
    """The draft model's ModelConfig, checked before any weights load: it must exist, be a supported
    architecture, and share the target's tokenizer. ValueError names `speculative_config.model`."""
    from jaxpaged.models.registry import load_hf_config, load_tokenizer, model_config_from_hf

    try:
        cfg = model_config_from_hf(path, load_hf_config(path), dtype)
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_config.model: cannot use {path!r} as a draft model: {e}") from None
    try:
        draft_vocab = load_tokenizer(path).get_vocab()
    except (OSError, ValueError):
        draft_vocab = None  # (no tokenizer beside the weights: trust the user, as vLLM does)
    if draft_vocab is not None:  # the same token strings with the same ids (extra special tokens may differ)
        vocab = tokenizer.get_vocab()
        shared = vocab.keys() & draft_vocab.keys()
        moved = sum(vocab[t] != draft_vocab[t] for t in shared)
        if moved or len(shared) < 0.9 * len(vocab):
            raise ValueError(f"speculative_config.model: the draft model {path!r} has another tokenizer than the "
                             f"target ({len(shared)} of the target's {len(vocab)} tokens shared, {moved} of them with "
                             f"other ids); a draft model must share the target's tokenizer")
    if cfg.max_position_embeddings < target.max_position_embeddings:
        logger.warning("The draft model's context (%d) is shorter than the target's (%d): drafts past it may be "
                       "poor (they are verified, so outputs do not change)", cfg.max_position_embeddings,
                       target.max_position_embeddings)
    return cfg


def _single_token_metadata(pos: Int[Array, "S"], active, block_tables: Int[Array, "S B"], block_size: int,
                           pad_slot: int) -> AttentionMetadata:
    """Attention inputs of one token per sequence row at `pos` (rows not `active`, or past the table, are
    padding: their writes drop and they attend to nothing)."""
    s, width = block_tables.shape
    block = pos // block_size
    valid = active & (block < width)
    slot = block_tables[jnp.arange(s), jnp.minimum(block, width - 1)] * block_size + pos % block_size
    return AttentionMetadata(
        positions=jnp.where(valid, pos, 0),
        slot_mapping=jnp.where(valid, slot, pad_slot),
        token_seq=jnp.where(valid, jnp.arange(s, dtype=jnp.int32), -1),
        decode_context_lens=jnp.where(valid, pos, 0),
        seq_context_lens=jnp.where(valid, pos, 0),
        continuation_rows=jnp.full(s, -1, jnp.int32),
        block_tables=block_tables,
        max_query_len=1,
    )


def propose_drafts(graphdef, state, kv_pool, token_ids: Int[Array, "T"], inp, final: Int[Array, "S"],
                   num_drafts: Int[Array, "S"], count: Int[Array, "S"], active, k: int, vocab_size: int,
                   propose: bool | None = None):
    """Run the draft model after the target's step (see the module docstring).

    token_ids [T]: the step's tokens; `inp`: its StepInput; final [S]: the token each sequence ended with;
    num_drafts [S] drafts it verified, count [S] tokens it emitted (accepted + 1); active [S]: it drew a token.
    Returns (the draft pool, drafts [S, k] int32: the next k tokens the draft model expects after `final`).
    """
    model = nnx.merge(graphdef, state)
    _, kv_pool = model(token_ids, kv_pool, inp.attn)  # catch-up: the draft cache follows the target's
    block_size, pad_slot = kv_pool.shape[3], kv_pool.shape[2] * kv_pool.shape[3]
    # the position `final` goes to: after the last accepted token
    next_pos = inp.attn.positions[inp.logits_indices] - num_drafts + count

    def one_token(carry, j):
        pool, tokens = carry
        meta = _single_token_metadata(next_pos + j, active, inp.attn.block_tables, block_size, pad_slot)
        hidden, pool = model(tokens, pool, meta)
        logits = model.compute_logits(hidden)[:, :vocab_size]  # [S, V] (a larger draft vocabulary: padding ids)
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return (pool, nxt), nxt

    def passes(pool):
        (pool, _), drafts = jax.lax.scan(one_token, (pool, final), jnp.arange(k, dtype=jnp.int32))
        return pool, drafts.T

    def none(pool):  # (a step that draws no token: all prompt chunks)
        return pool, jnp.zeros((final.shape[0], k), jnp.int32)

    return branch(propose, lambda: jnp.any(active), passes, none, kv_pool)
