"""Top-k / top-p sampling with temperature, per row: the plain-JAX reference.

Meaning (vLLM's): temperature first; then top-k keeps the k largest logits; then top-p keeps
the smallest set of the remaining (renormalized) distribution whose cumulative probability
reaches p, the crossing token included. k=0 and p=1 mean off; temperature 0 means argmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def check_sampling_args(logits, key, temperature, top_k, top_p) -> None:
    """Raise ValueError on shapes the sampler cannot take."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
    b = logits.shape[0]
    for name, a in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if a.shape != (b,):
            raise ValueError(f"{name} must be [B={b}], got shape {a.shape}")
    if not jnp.issubdtype(top_k.dtype, jnp.integer):
        raise ValueError(f"top_k must be integer, got {top_k.dtype}")
    kshape = jnp.shape(jax.random.key_data(key)) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key.shape
    if kshape not in ((2,), (b, 2)):
        raise ValueError(f"key must be one PRNG key or one per row [B={b}], got shape {key.shape}")


def row_keys(key, batch: int):
    """One key per row: a per-row key array as is, or `batch` independent keys split from one key."""
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    return data if data.ndim == 2 else jax.random.split(data, batch)


def top_k_top_p_mask(logits: Float[Array, "B V"], top_k: Int[Array, "B"], top_p: Float[Array, "B"]):
    """Logits with everything outside each row's top-k, then top-p, set to -inf (sorts each row)."""
    v = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)  # [B, V]
    k = jnp.where((top_k <= 0) | (top_k > v), v, top_k)
    rank = jnp.arange(v)[None, :]
    sorted_desc = jnp.where(rank < k[:, None], sorted_desc, -jnp.inf)  # top-k applied
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each rank
    keep = jnp.sum((before < top_p[:, None]) & (rank < k[:, None]), axis=-1)  # >= 1
    threshold = jnp.take_along_axis(sorted_desc, (keep - 1)[:, None], axis=-1)  # [B, 1]
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def categorical_from_uniform(weights: Float[Array, "B V"], u: Float[Array, "B"], *, tile: int = 128):
    """Inverse-CDF draw from unnormalized non-negative `weights` with one uniform u in (0, 1] per row.

    Two levels (tile sums, then one tile), so no [B, V] scan or per-element random numbers.
    """
    b, v = weights.shape
    pad = (-v) % tile
    w = jnp.pad(weights, ((0, 0), (0, pad))).reshape(b, -1, tile)  # [B, V/tile, tile]
    tile_cdf = jnp.cumsum(w.sum(-1), axis=-1)  # [B, V/tile]
    target = u * tile_cdf[:, -1]
    blk = jnp.minimum(jnp.sum(tile_cdf < target[:, None], axis=-1), tile_cdf.shape[1] - 1)
    before = jnp.where(blk > 0, jnp.take_along_axis(tile_cdf, jnp.maximum(blk - 1, 0)[:, None], -1)[:, 0], 0.0)
    inner_cdf = jnp.cumsum(jnp.take_along_axis(w, blk[:, None, None], axis=1)[:, 0], axis=-1) + before[:, None]
    idx = blk * tile + jnp.minimum(jnp.sum(inner_cdf < target[:, None], axis=-1), tile - 1)
    return jnp.minimum(idx, v - 1)


def reference_top_k_top_p_sampling(
    logits: Float[Array, "B V"],
    key,
    temperature: Float[Array, "B"],
    top_k: Int[Array, "B"],
    top_p: Float[Array, "B"],
) -> Int[Array, "B"]:
    """One token per row; `key` is one PRNG key (rows draw independently) or one key per row [B, 2]."""
    check_sampling_args(logits, key, temperature, top_k, top_p)
    b, v = logits.shape
    logits = logits.astype(jnp.float32)
    greedy_rows = temperature <= 0
    scaled = logits / jnp.where(greedy_rows, 1.0, temperature)[:, None]
    needs_filter = jnp.any(((top_k > 0) & (top_k < v)) | (top_p < 1.0))
    filtered = jax.lax.cond(needs_filter, top_k_top_p_mask, lambda x, *_: x, scaled, top_k, top_p)
    weights = jnp.exp(filtered - filtered.max(axis=-1, keepdims=True))
    u = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(row_keys(key, b))  # (0, 1]
    sampled = categorical_from_uniform(weights, u)
    return jnp.where(greedy_rows, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
