"""Applying a packed token bitmask to logits inside the jitted step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def apply_token_bitmask(logits: Float[Array, "S V"], bitmask: Int[Array, "S W"]) -> Float[Array, "S V"]:
    """-inf where bit v % 32 of bitmask[s, v // 32] is clear; rows of all ones (-1) are left alone, and a step
    without any constrained row skips the work."""
    s, v = logits.shape

    def masked(x):
        bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
        allowed = bits.reshape(s, -1)[:, :v] != 0
        return jnp.where(allowed, x, -jnp.inf)

    return jax.lax.cond(jnp.any(bitmask != -1), masked, lambda x: x, logits)
