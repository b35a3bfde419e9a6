"""Applying a packed token bitmask to logits inside the jitted step."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxpaged.layers.step_features import branch


def apply_token_bitmask(logits: Float[Array, "S V"], bitmask: Int[Array, "S W"], flag: bool | None = None
                        ) -> Float[Array, "S V"]:
    """-inf where bit v % 32 of bitmask[s, v // 32] is clear; rows of all ones (-1) are left alone, and a step
    without any constrained row skips the work (`flag`: the host's `StepFeatures.bitmask`; None: decided here)."""
    s, v = logits.shape

    def masked(x):
        bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
        allowed = bits.reshape(s, -1)[:, :v] != 0
        return jnp.where(allowed, x, -jnp.inf)

    return branch(flag, lambda: jnp.any(bitmask != -1), masked, lambda x: x, logits)
