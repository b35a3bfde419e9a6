"""Token selection inside the jitted step: per-row temperature, top-k, top-p and seeds."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt32

from pallas_kernels.sampling import reference_top_k_top_p_sampling


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling settings for one step (rows = scheduled sequences, padded)."""

    temperature: Float[Array, "S"]  # 0 = greedy
    top_k: Int[Array, "S"]  # 0 = off
    top_p: Float[Array, "S"]  # 1 = off
    seeds: UInt32[Array, "S"]  # the request's seed
    steps: Int[Array, "S"]  # index of the output token being drawn


def request_keys(seeds: UInt32[Array, "S"], steps: Int[Array, "S"]):
    """Key per row from (seed, output index) only, so a seeded request draws the same tokens in any batch."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seeds, steps)


def sample(logits: Float[Array, "S V"], meta: SamplingMetadata) -> Int[Array, "S"]:
    """Next token per row. All-greedy batches skip the random draw entirely."""

    def draw(logits):
        keys = request_keys(meta.seeds, meta.steps)
        return reference_top_k_top_p_sampling(logits, keys, meta.temperature, meta.top_k, meta.top_p)

    all_greedy = jnp.all(meta.temperature <= 0)
    return jax.lax.cond(all_greedy, lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32), draw, logits)
