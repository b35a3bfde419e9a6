"""Pure, jittable generation on the engine's paged KV cache, for JAX research code.

    config, params = load()                                  # HF folder, GGUF, or the default model
    out = generate(config, params, tokens, lengths, jax.random.key(0), max_new_tokens=64)

`prefill`, `decode` and `generate` are pure functions of arrays, already jitted (`config` static, the
cache donated), and usable inside a caller's own `jit`, `lax.scan` or `while_loop`. They run the
engine's model code (`jaxpaged.models.llama.forward`) with the engine's attention and sampler
backends: the Pallas kernels on GPU, the plain-JAX paths elsewhere. There is no host loop: `generate`
is one compiled program, a `lax.while_loop` over decode steps that stops when every row has ended.

The KV cache is the engine's paged pool with a block table per row; `init_cache` gives each row its
own contiguous run of blocks (block 0 stays the null block that padding points at), and a caller may
hand in other tables (rows sharing a prefix's blocks, say) as long as they write only their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxpaged.config import DTYPES, KERNEL_BACKENDS, ModelConfig, kv_pool_dtype, platform_is_gpu
from jaxpaged.layers.attention import empty_kv_pool
from jaxpaged.layers.backends import resolve_attention_backend, resolve_kernel_backend
from jaxpaged.layers.sampler import filtered_draw, first_argmax
from jaxpaged.models.llama import AttentionMetadata, compute_logits, forward, model_params

__all__ = ["Config", "KVCache", "load", "load_tokenizer", "pad_batch", "init_cache", "prefill", "decode", "sample",
           "generate", "with_kv_scales", "with_loras"]


@dataclass(frozen=True)
class Config:
    """Everything static about a model: its shapes and which kernels run it. Hashable (a static argument)."""

    model: ModelConfig
    attention_backend: str = "reference"  # "pallas", "pallas-interpret", "cpu" or "reference" (resolved)
    sampler_backend: str = "reference"

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.model.eos_token_ids


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """The paged KV cache of B rows: a pytree, donated into `prefill` and `decode`."""

    pool: Float[Array, "L 2 N bs KH D"]  # every layer's K (index 0) and V (index 1); block 0 is the null block
    block_tables: Int[Array, "B W"]  # each row's physical blocks in order; 0 past its capacity
    lengths: Int[Array, "B"]  # tokens of each row already in the cache

    @property
    def block_size(self) -> int:
        return self.pool.shape[3]


def load(model: str | None = None, *, dtype: str | None = None, load_format: str = "auto",
         attention_backend: str = "auto", sampler_backend: str = "auto", per_layer: bool | None = None,
         quantization: str | None = None) -> tuple[Config, dict]:
    """(config, params) from an HF folder, a .gguf file, or (None) the default SmolLM2 model.

    dtype: "float32", "bfloat16" or "float16"; default bfloat16 on GPU, float32 elsewhere. load_format
    "dummy": random weights from the config alone. Backends "auto": the Pallas kernels on GPU; on CPU
    the C++ attention kernel (plain JAX without a compiler) and the plain-JAX sampler. params is a dict of
    jax arrays; its "layers" a list of one dict per layer (per_layer, the default on CPU, where it runs
    faster) or one dict of arrays stacked on a leading [L] axis (run under `lax.scan`; the default on GPU).
    quantization: "int8", "fp8", "gguf", "awq" or "gptq" (the engine's flag, docs/quantization.md; a checkpoint's
    own quantization_config is read without it): matmul weights are then
    `layers.quant.QuantizedWeight` pytrees in the tree (the plain-JAX dots; the CPU engine's oneDNN forms are
    the engine's).
    """
    from jaxpaged.models.registry import default_model_path, load_hf_config, load_weights, model_config_from_hf

    dtype = dtype or ("bfloat16" if platform_is_gpu() else "float32")
    if dtype not in DTYPES[1:]:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES[1:])}, got {dtype!r}")
    if sampler_backend not in KERNEL_BACKENDS:
        raise ValueError(f"sampler_backend must be one of {', '.join(KERNEL_BACKENDS)}, got {sampler_backend!r}")
    attention_backend = resolve_attention_backend(attention_backend)  # a bad name raises here, before loading
    path = model or default_model_path()
    model_config = model_config_from_hf(path, load_hf_config(path), dtype, quantization)
    params = model_params(model_config, load_weights(model_config, load_format), per_layer=per_layer)
    return Config(model_config, attention_backend, resolve_kernel_backend(sampler_backend)), params


def load_tokenizer(model: str | None = None):
    """The transformers tokenizer (with its chat template) of `model`, as `load` reads it."""
    from jaxpaged.models.registry import default_model_path
    from jaxpaged.models.registry import load_tokenizer as _load

    return _load(model or default_model_path())


def with_kv_scales(config: Config, params: dict, tokenizer, kv_cache_dtype: str = "fp8_e4m3") -> dict:
    """`params` with fp8 KV scales, one K and one V scale per layer and KV head, calibrated as the engine does
    (`jaxpaged.models.kv_scales`): a cache of that fp8 dtype then stores K and V divided by them. Without them an
    fp8 cache is unscaled (values past its range saturate)."""
    from jaxpaged.models.kv_scales import calibrated_kv_scales

    scales, _ = calibrated_kv_scales(config.model, params, tokenizer, kv_pool_dtype(kv_cache_dtype, config.model.dtype))
    return {**params, "kv_scale": jnp.asarray(scales)}


def with_loras(config: Config, params: dict, adapters: Sequence[str], *, max_rank: int | None = None) -> dict:
    """`params` with a LoRA stack of the PEFT adapter folders `adapters` (slot i holds adapters[i]); `prefill`,
    `decode` and `generate` then take `lora_ids` [B], each row's slot (-1: the base model), and rows of different
    adapters run in one call. max_rank: the stack's width (default: the largest adapter rank). A bad adapter
    raises a ValueError naming it and the module (`jaxpaged.models.lora_adapter`)."""
    import os

    from jaxpaged.layers.lora import adapter_slices, lora_shapes, write_slot
    from jaxpaged.models.lora_adapter import adapter_rank, load_lora_adapter, module_dims

    cfg = config.model
    if isinstance(adapters, str) or not adapters:
        raise ValueError("adapters: give a list of one or more adapter folders")
    names = [os.path.basename(os.fspath(p).rstrip("/")) for p in adapters]
    rank = max_rank or max(adapter_rank(n, p) for n, p in zip(names, adapters))
    loaded = [load_lora_adapter(n, i + 1, p, cfg, rank) for i, (n, p) in enumerate(zip(names, adapters))]
    shapes = lora_shapes(module_dims(cfg), len(loaded), rank, mlp=cfg.dense_mlp and not cfg.num_experts)
    dtype = jnp.dtype(cfg.compute_dtype)
    stacks = {name: jnp.zeros((cfg.num_layers, *shape), dtype) for name, shape in shapes.items()}  # [L, ...]
    for slot, adapter in enumerate(loaded):
        for name, value in adapter_slices(adapter.a, adapter.b, set(shapes)).items():
            stacks[name] = write_slot(stacks[name], name, value, slot, stacked=True)
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        layers = [{**w, **{n: s[i] for n, s in stacks.items()}} for i, w in enumerate(layers)]
    else:
        layers = {**layers, **stacks}
    return {**params, "layers": layers}


def pad_batch(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[Int[Array, "B P"], Int[Array, "B"]]:
    """Token-id prompts as the right-padded `tokens` [B, P] and `lengths` [B] that prefill and generate take."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
    tokens = np.full((len(prompts), max(map(len, prompts))), pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return jnp.asarray(tokens), jnp.asarray([len(p) for p in prompts], jnp.int32)


def _kv_chunk(block_size: int) -> int:
    return max(32, block_size)  # as the engine: context read a chunk of blocks at a time


def init_cache(config: Config, *, num_seqs: int, max_len: int, block_size: int = 16, dtype=None) -> KVCache:
    """An empty cache for `num_seqs` rows of up to `max_len` tokens each, blocks assigned contiguously.

    Tokens past a row's `max_len` (rounded up to whole blocks) are not stored. dtype: the model's (None), a
    jnp dtype, or one of vLLM's kv_cache_dtype names ("bfloat16", "fp8_e4m3", "fp8_e5m2").
    """
    mc = config.model
    if num_seqs <= 0:
        raise ValueError(f"num_seqs must be positive, got {num_seqs}")
    if not 0 < max_len <= mc.max_position_embeddings:
        raise ValueError(f"max_len must be in [1, {mc.max_position_embeddings}] (the model's context), got {max_len}")
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a positive power of two, got {block_size}")
    blocks = -(-max_len // block_size)  # per row
    chunk_blocks = 4 * _kv_chunk(block_size) // block_size  # table width: whole chunks of the widest read
    width = -(-blocks // chunk_blocks) * chunk_blocks
    ids = 1 + jnp.arange(num_seqs, dtype=jnp.int32)[:, None] * blocks + jnp.arange(width, dtype=jnp.int32)[None, :]
    tables = jnp.where(jnp.arange(width)[None, :] < blocks, ids, 0)
    name = "auto" if dtype is None else dtype if isinstance(dtype, str) else jnp.dtype(dtype).name
    pool = empty_kv_pool(mc.num_layers, 1 + num_seqs * blocks, block_size, mc.num_kv_heads, mc.head_dim,
                         jnp.dtype(kv_pool_dtype(name, mc.dtype)))
    return KVCache(pool, tables, jnp.zeros(num_seqs, jnp.int32))


def _slots(cache: KVCache, rows: Int[Array, "T"], positions: Int[Array, "T"], valid) -> Int[Array, "T"]:
    """Pool slot of each token; out of range (dropped on write) for padding and past a row's capacity."""
    bs, n = cache.block_size, cache.pool.shape[2]
    blk = cache.block_tables.at[rows, positions // bs].get(mode="fill", fill_value=0)
    return jnp.where(valid & (blk > 0), blk * bs + positions % bs, n * bs)


def _forward(config: Config, params: dict, cache: KVCache, token_ids, meta: AttentionMetadata, lora_slots=None):
    layers = params["layers"]
    if lora_slots is not None and "lora_a_qkv" not in (layers[0] if isinstance(layers, (list, tuple)) else layers):
        raise ValueError("lora_ids: these params have no LoRA stack (add one with functional.with_loras)")
    return forward(config.model, params, token_ids, cache.pool, meta, attention_backend=config.attention_backend,
                   kv_chunk=_kv_chunk(cache.block_size), lora_slots=lora_slots)


@partial(jax.jit, static_argnums=0, donate_argnums=2)
def prefill(config: Config, params: dict, cache: KVCache, tokens: Int[Array, "B P"], lengths: Int[Array, "B"],
            lora_ids: Int[Array, "B"] | None = None) -> tuple[Float[Array, "B V"], KVCache]:
    """Append each row's first `lengths[b]` tokens (right-padded `tokens`) after what the cache holds.

    Returns the logits (float32) after each row's last new token, and the cache with `lengths` added.
    A row with no new tokens keeps its cache; its logits are zeros. lora_ids: each row's LoRA slot (-1: none),
    with params from `with_loras`.
    """
    b, p = tokens.shape
    ctx = cache.lengths
    i = jnp.arange(p, dtype=jnp.int32)
    valid = i[None, :] < lengths[:, None]  # [B, P]
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, p))
    positions = jnp.where(valid, ctx[:, None] + i[None, :], 0).reshape(-1)
    flat_valid, flat_rows = valid.reshape(-1), rows.reshape(-1)
    (continuation,) = jnp.nonzero((ctx > 0) & (lengths > 0), size=b, fill_value=-1)
    meta = AttentionMetadata(
        positions=positions,
        slot_mapping=_slots(cache, flat_rows, positions, flat_valid),
        token_seq=jnp.where(flat_valid, flat_rows, -1),
        decode_context_lens=jnp.zeros(b * p, jnp.int32),  # cached context goes through part C (continuations)
        seq_context_lens=ctx,
        continuation_rows=continuation.astype(jnp.int32),
        block_tables=cache.block_tables,
        max_query_len=p,
    )
    slots = None if lora_ids is None else jnp.where(flat_valid, jnp.asarray(lora_ids, jnp.int32)[flat_rows], -1)
    hidden, pool = _forward(config, params, cache, tokens.reshape(-1).astype(jnp.int32), meta, slots)
    last = jnp.arange(b) * p + jnp.maximum(lengths - 1, 0)
    logits = compute_logits(params, hidden[last], scale=config.model.logits_scale,
                            softcap=config.model.final_softcap)
    logits = jnp.where((lengths > 0)[:, None], logits, 0.0)
    return logits, KVCache(pool, cache.block_tables, ctx + lengths.astype(jnp.int32))


@partial(jax.jit, static_argnums=0, donate_argnums=2)
def decode(config: Config, params: dict, cache: KVCache, tokens: Int[Array, "B"],
           lora_ids: Int[Array, "B"] | None = None) -> tuple[Float[Array, "B V"], KVCache]:
    """Append one token per row; returns the logits (float32) after it and the cache one longer per row.
    lora_ids: as `prefill`'s."""
    b = tokens.shape[0]
    ctx = cache.lengths
    rows = jnp.arange(b, dtype=jnp.int32)
    meta = AttentionMetadata(
        positions=ctx,
        slot_mapping=_slots(cache, rows, ctx, True),
        token_seq=rows,
        decode_context_lens=ctx,
        seq_context_lens=ctx,
        continuation_rows=jnp.full(b, -1, jnp.int32),
        block_tables=cache.block_tables,
        max_query_len=1,
    )
    slots = None if lora_ids is None else jnp.asarray(lora_ids, jnp.int32)
    hidden, pool = _forward(config, params, cache, tokens.astype(jnp.int32), meta, slots)
    logits = compute_logits(params, hidden, scale=config.model.logits_scale, softcap=config.model.final_softcap)
    return logits, KVCache(pool, cache.block_tables, ctx + 1)


def sample(config: Config, logits: Float[Array, "B V"], key, temperature=0.0, top_k=0, top_p=1.0
           ) -> Int[Array, "B"]:
    """One token per row: greedy where temperature <= 0, else drawn after top-k and top-p filtering.

    temperature, top_k (0 = off), top_p (1 = off): scalars or per-row [B] arrays (traced, not static).
    key: one PRNG key; rows draw independently.
    """
    b = logits.shape[0]
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (b,))
    top_k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (b,))
    top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (b,))
    return jax.lax.cond(jnp.all(temperature <= 0), first_argmax,
                        lambda x: filtered_draw(x, key, temperature, top_k, top_p, config.sampler_backend),
                        logits.astype(jnp.float32))


def generate(config: Config, params: dict, tokens: Int[Array, "B P"], lengths: Int[Array, "B"], key, *,
             max_new_tokens: int, temperature=0.0, top_k=0, top_p=1.0,
             eos_id: int | Sequence[int] | None = None, block_size: int = 16,
             kv_cache_dtype: str | None = None, lora_ids: Int[Array, "B"] | None = None) -> Int[Array, "B N"]:
    """`max_new_tokens` tokens after each row's prompt (right-padded `tokens`, `lengths[b]` real ones).

    One compiled program: a prefill, then a `lax.while_loop` of decode steps that exits once every row
    has drawn an `eos_id` (one id or several; None: never ends early). After its end a row is padded
    with the (first) eos id. Sampling as `sample`; step i draws with `fold_in(key, i)`. The cache is made
    inside (`init_cache` with `block_size` and `kv_cache_dtype`). lora_ids: each row's LoRA slot (-1: none),
    with params from `with_loras`.
    """
    eos = () if eos_id is None else (int(eos_id),) if isinstance(eos_id, int) else tuple(int(e) for e in eos_id)
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if jnp.ndim(tokens) != 2 or jnp.shape(lengths) != jnp.shape(tokens)[:1]:
        raise ValueError(f"tokens must be [B, P] and lengths [B]; got {jnp.shape(tokens)} and {jnp.shape(lengths)}")
    if isinstance(lengths, (np.ndarray, list, tuple)):  # values known on the host: check them for free
        lens = np.asarray(lengths)
        if lens.min() < 1 or lens.max() > jnp.shape(tokens)[1]:
            raise ValueError(f"lengths must be in [1, P={jnp.shape(tokens)[1]}], got {lens.tolist()}")
    return _generate(config, params, tokens, lengths, key, temperature, top_k, top_p, lora_ids,
                     max_new_tokens=max_new_tokens, eos=eos, block_size=block_size, kv_cache_dtype=kv_cache_dtype)


@partial(jax.jit, static_argnums=0, static_argnames=("max_new_tokens", "eos", "block_size", "kv_cache_dtype"))
def _generate(config: Config, params, tokens, lengths, key, temperature, top_k, top_p, lora_ids, *,
              max_new_tokens: int,
              eos: tuple[int, ...], block_size: int, kv_cache_dtype: str | None):
    b, p = tokens.shape
    cache = init_cache(config, num_seqs=b, max_len=p + max_new_tokens, block_size=block_size, dtype=kv_cache_dtype)
    eos_ids = jnp.asarray(eos or (-1,), jnp.int32)
    pad = eos[0] if eos else 0
    draw = lambda logits, i: sample(config, logits, jax.random.fold_in(key, i), temperature, top_k, top_p)  # noqa: E731

    logits, cache = prefill(config, params, cache, tokens, lengths.astype(jnp.int32), lora_ids)
    first = draw(logits, 0)
    out = jnp.full((b, max_new_tokens), pad, jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, eos_ids)

    def body(state):
        i, out, cache, done = state
        logits, cache = decode(config, params, cache, out[:, i - 1], lora_ids)
        token = jnp.where(done, pad, draw(logits, i))
        return i + 1, out.at[:, i].set(token), cache, done | jnp.isin(token, eos_ids)

    def cond(state):
        i, _, _, done = state
        return (i < max_new_tokens) & ~jnp.all(done)

    _, out, _, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), out, cache, done))
    return out
