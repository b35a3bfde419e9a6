"""HF transformers (PyTorch, CPU, float32) references, and our model run once without the engine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.layers.attention import empty_kv_pool
from jaxpaged.models.llama import AttentionMetadata, compute_logits, forward


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    """Token ids of one user question under the model's chat template, with the generation prompt."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                              return_dict=True)["input_ids"])


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int, stop_at: tuple[int, ...] = ()) -> list[int]:
    """Greedy continuation by HF transformers, one sequence, with its KV cache; stops after a `stop_at` token."""
    import inspect

    import torch

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
    """Our model's logits at the last prompt position (`our_last_logits_batch` of one prompt)."""
    return our_last_logits_batch(model, [prompt_ids], block_size)[0]


def our_last_logits_batch(model, prompts: list[list[int]], block_size: int = 16) -> list[np.ndarray]:
    """Our model's logits at each prompt's last position: the prompts as one ragged prefill through a fresh paged
    pool (each sequence's blocks in reverse physical order, the sequences' blocks interleaved), so one compile
    serves them all and a token that attends to another sequence's keys shows as a wrong logit. The weights are
    arguments of the jitted call, not constants folded into it (which took minutes on the default model)."""
    cfg = model.cfg
    lens = [len(p) for p in prompts]
    per_seq = [-(-n // block_size) for n in lens]
    s, b = len(prompts), max(per_seq)
    table_width = -(-b // (128 // block_size)) * (128 // block_size)
    table = np.zeros((s, table_width), np.int32)
    for i, nb in enumerate(per_seq):  # block j of sequence i -> physical 1 + i + s * (nb - 1 - j)
        table[i, :nb] = 1 + i + s * np.arange(nb - 1, -1, -1)
    pool = empty_kv_pool(cfg.num_layers, 1 + s * b, block_size, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    seq = np.repeat(np.arange(s, dtype=np.int32), lens)
    pos = np.concatenate([np.arange(n, dtype=np.int32) for n in lens])
    slots = table[seq, pos // block_size] * block_size + pos % block_size
    t = len(pos)
    meta = AttentionMetadata(positions=jnp.asarray(pos), slot_mapping=jnp.asarray(slots), token_seq=jnp.asarray(seq),
                             decode_context_lens=jnp.zeros(t, jnp.int32), seq_context_lens=jnp.zeros(s, jnp.int32),
                             continuation_rows=jnp.full(s, -1, jnp.int32), block_tables=jnp.asarray(table))
    last = jnp.asarray(np.cumsum(lens) - 1, jnp.int32)

    @jax.jit
    def logits(params, ids, pool, meta):
        hidden, _ = forward(cfg, params, ids, pool, meta, attention_backend=model.attention_backend,
                            kv_chunk=model.kv_chunk, mesh=model.mesh)
        return compute_logits(params, hidden[last], model.mesh, None, cfg.logits_scale, cfg.final_softcap)

    out = np.asarray(logits(model.params(), jnp.asarray(np.concatenate(prompts), jnp.int32), pool, meta))
    return list(out)
