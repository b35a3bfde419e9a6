"""HF transformers (PyTorch, CPU, float32) references, and our model run once without the engine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.attention import empty_kv_pool
from jaxpaged.models.llama import AttentionMetadata


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    """Token ids of one user question under the model's chat template, with the generation prompt."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                              return_dict=True)["input_ids"])


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int, stop_at: tuple[int, ...] = ()) -> list[int]:
    """Greedy continuation by HF transformers, one sequence, with its KV cache; stops after a `stop_at` token."""
    import torch

    import inspect

    cache_kw = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    out: list[int] = []
    with torch.no_grad():
        res = hf_model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(max_new_tokens):
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            if tok in stop_at:
                break
            res = hf_model(torch.tensor([[tok]]), use_cache=True, **{cache_kw: getattr(res, cache_kw)})
    return out


def hf_last_logits(hf_model, prompt_ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf_model(torch.tensor([prompt_ids])).logits[0, -1].numpy()


def our_last_logits(model, prompt_ids: list[int], block_size: int = 16) -> np.ndarray:
    """Our model's logits at the last prompt position, through a fresh paged pool (blocks in reverse order)."""
    cfg = model.cfg
    n = len(prompt_ids)
    num_blocks = -(-n // block_size)
    table_width = -(-num_blocks // (128 // block_size)) * (128 // block_size)
    pool = empty_kv_pool(cfg.num_layers, num_blocks + 1, block_size, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    table = np.zeros((1, table_width), np.int32)
    table[0, :num_blocks] = np.arange(num_blocks, 0, -1)  # shuffled physical order
    pos = np.arange(n, dtype=np.int32)
    slots = table[0, pos // block_size] * block_size + pos % block_size
    zeros = jnp.zeros(n, jnp.int32)
    meta = AttentionMetadata(positions=jnp.asarray(pos), slot_mapping=jnp.asarray(slots), token_seq=zeros,
                             decode_context_lens=zeros, seq_context_lens=jnp.zeros(1, jnp.int32),
                             continuation_rows=jnp.full(1, -1, jnp.int32), block_tables=jnp.asarray(table))
    hidden, _ = jax.jit(lambda ids, pool, meta: model(ids, pool, meta))(jnp.asarray(prompt_ids, jnp.int32), pool,
                                                                           meta)
    return np.asarray(model.compute_logits(hidden[-1:]))[0]
